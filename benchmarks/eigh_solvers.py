"""Which cuSOLVER solver pays for a float32 factor's eigendecomposition (issue 17).

    python benchmarks/eigh_solvers.py [--device cuda] [--sizes 64,128,...] [--resnet]

``torch.linalg.eigh`` hands float32 matrices of sizes 32 to 512 to cuSOLVER's Jacobi
solver (``syevj``, one matrix after another) and larger ones, and float64 ones, to divide
and conquer (``syevd``). ``curvature.linalg.FLOAT64_EIGH_SIZES`` solves float32 calls of
sizes in its range in float64 instead. For each size and batch this prints, in ms per
call (median of ``--reps`` after a warm-up):

* ``eigh f32``: ``torch.linalg.eigh`` itself (``syevj`` from 32 to 512 on CUDA);
* ``eighs f32`` / ``eighs f64``: ``curvature.linalg.eighs`` (symmetrize, checks, one
  host read) with ``FLOAT64_EIGH_SIZES=None`` and with every size solved in float64;
* ``eigh f64``: ``torch.linalg.eigh`` of the float64 copy (``syevd`` at every size);
* the largest error of ``eighs``' results either way (rebuilt matrix, orthonormality).

(Until commit ac6e68b the script timed a padding of such calls to 513 instead, the
earlier rule: docs/benchmarks.md has that run.) ``--resnet``: a KFAC step with a refresh
every step on ResNet-18 (width 64, batch 128, random data; the three ``layer4`` blocks
keep their 512 x 512 ``G`` full and need its eigenbasis), with ``FLOAT64_EIGH_SIZES=None``
and the library's default, alternated.
On a CPU nothing is padded by default (``PAD_EIGH_DEVICES``): the script adds the CPU
there to time the same code.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from typing import Callable, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import timed as gpu_timed  # noqa: E402

import curvature  # noqa: E402
import curvature.linalg as linalg  # noqa: E402


def timed(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median ms per call of ``fn`` over ``reps`` calls after one warm-up call."""
    fn()
    return gpu_timed(fn, torch.device(device), reps) * 1e3


def factors(n: int, batch: int, device: str) -> List[torch.Tensor]:
    """``batch`` PSD matrices like Kronecker factors: ``X^T X / 256`` of 256 rows."""
    g = torch.Generator().manual_seed(n + batch)
    out = []
    for _ in range(batch):
        X = torch.randn(256, n, generator=g)
        out.append((X.T @ X / 256).to(device))
    return out


def rebuilt_error(M: torch.Tensor, evals: torch.Tensor, evecs: torch.Tensor) -> float:
    """``max |Q diag(l) Q^T - M| / max |M|``, and ``Q``'s departure from orthonormality."""
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    rebuilt = (evecs * evals[..., None, :]) @ evecs.mT
    scale = M.abs().max()
    return max(
        float((rebuilt - M).abs().max() / scale), float((evecs.mT @ evecs - eye).abs().max())
    )


def solver_table(sizes: List[int], batches: List[int], device: str, reps: int) -> None:
    default = linalg.FLOAT64_EIGH_SIZES
    print(
        f"{'n':>5} {'batch':>5} {'eigh f32':>9} {'eighs f32':>12} {'eighs f64':>13} {'eigh f64':>9}"
    )
    for n in sizes:
        for b in batches:
            mats = factors(n, b, device)
            stacked = torch.stack(mats)
            row = [timed(lambda s=stacked: torch.linalg.eigh(s), device, reps)]
            errors = []
            for sizes in (None, (1, 1 << 20)):
                linalg.FLOAT64_EIGH_SIZES = sizes
                row.append(timed(lambda m=mats: linalg.eighs(m, ["f"] * len(m)), device, reps))
                errors.append(
                    max(rebuilt_error(M, *r) for M, r in zip(mats, linalg.eighs(mats, ["f"] * b)))
                )
            linalg.FLOAT64_EIGH_SIZES = default
            row.append(timed(lambda s=stacked: torch.linalg.eigh(s.double()), device, reps))
            print(
                f"{n:5d} {b:5d} "
                + " ".join(f"{t:{w}.2f}" for t, w in zip(row, (9, 12, 13, 9)))
                + f"   rebuilt error f32 {errors[0]:.1e}, f64 {errors[1]:.1e}"
            )


def resnet_refresh(device: str, rounds: int, steps: int) -> None:
    from resnets import ResNet18

    ce = torch.nn.CrossEntropyLoss()
    default = linalg.FLOAT64_EIGH_SIZES
    settings = {"FLOAT64_EIGH_SIZES=None": None, f"FLOAT64_EIGH_SIZES={default}": default}
    runs = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchNorm, one-sided blocks
        for name in settings:
            torch.manual_seed(0)
            model = ResNet18(num_classes=10, in_channels=1, width=64).to(device)
            runs[name] = (model, curvature.KFAC(model, inverse_every=1))
        X = torch.randn(128, 1, 28, 28, device=device)
        y = torch.randint(0, 10, (128,), device=device)
        times = {name: [] for name in settings}

        def period(model, opt) -> None:
            for _ in range(steps):
                opt.zero_grad()
                ce(model(X), y).backward()
                opt.step()

        for r in range(rounds + 1):
            for name, sizes in settings.items():
                linalg.FLOAT64_EIGH_SIZES = sizes
                t = timed(lambda run=runs[name]: period(*run), device, 1) / steps
                if r:  # (round 0: warm-up)
                    times[name].append(t)
        linalg.FLOAT64_EIGH_SIZES = default
    for name, ts in times.items():
        print(
            f"KFAC refresh every step, ResNet-18 width 64, batch 128, {name}: "
            f"{statistics.median(ts):.2f} ms per step ({', '.join(f'{t:.2f}' for t in ts)})"
        )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sizes", default="32,64,128,192,256,320,384,448,512")
    p.add_argument("--batches", default="1,3")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--resnet", action="store_true")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device).type
    if device not in linalg.PAD_EIGH_DEVICES:
        linalg.PAD_EIGH_DEVICES = (*linalg.PAD_EIGH_DEVICES, device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name}, torch {torch.__version__}, FLOAT64_EIGH_SIZES {linalg.FLOAT64_EIGH_SIZES}")
    sizes = [int(x) for x in args.sizes.split(",")]
    solver_table(sizes, [int(x) for x in args.batches.split(",")], args.device, args.reps)
    if args.resnet:
        resnet_refresh(args.device, args.rounds, args.steps)


if __name__ == "__main__":
    main()
