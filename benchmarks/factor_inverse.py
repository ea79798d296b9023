"""Refresh cost of one Kronecker factor: eigendecomposition vs Cholesky inverse.

``A = X^T X / m + 1e-3 I`` (float32, ``m = n + 2000`` random rows), median of 5 calls after
a warm-up: ``torch.linalg.eigh`` (EKFAC, ``damping_mode="exact"``), forming the damped
inverse from it (what pi damping did before), and ``cholesky`` + ``cholesky_inverse``
(KFAC's pi damping now).

    python benchmarks/factor_inverse.py [THREADS] [N ...]     # default: 2 threads, 257 785
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import quantile_ms  # noqa: E402


def timings(A: torch.Tensor, damping: float = 1e-3) -> tuple:
    """``(eigh, inverse from eigh, Cholesky inverse)`` in milliseconds for one factor."""
    evals, evecs = torch.linalg.eigh(A)
    return (
        quantile_ms(lambda: torch.linalg.eigh(A)),
        quantile_ms(lambda: (evecs / (evals + damping)) @ evecs.T),
        quantile_ms(lambda: torch.cholesky_inverse(torch.linalg.cholesky(A))),
    )


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    threads = int(argv[0]) if argv else 2
    sizes = [int(a) for a in argv[1:]] or [257, 785]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    for n in sizes:
        X = torch.randn(n + 2000, n)
        eig, from_eig, chol = timings(X.T @ X / (n + 2000) + 1e-3 * torch.eye(n))
        print(
            f"{threads} threads, n={n}: eigh {eig:.1f} ms, inverse from eigh {from_eig:.1f} ms, "
            f"cholesky + cholesky_inverse {chol:.1f} ms"
        )


if __name__ == "__main__":
    main()
