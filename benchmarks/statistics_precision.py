"""KFAC's step with the Kronecker statistics in bf16 (``statistics_dtype``) against float32.

    python benchmarks/statistics_precision.py [--repeats 7] [--threads 1]

Two measurements on the CPU, one process, alternating: the statistics GEMM ``[D, N] x
[N, D]`` (D = 785, the MLP's first factor) in float32 and in bf16 (with the casts), and
the training step (zero_grad, forward, backward, ``step``; inverses every 10 steps, 10
steps per timed call) of the MLP 784-512-256-10 at batch 128 and 1024 with
``statistics_dtype=None`` and ``torch.bfloat16``. The clock is the process's CPU time
(one thread: fair on a shared machine). Prints the medians and the ratios bf16 / float32.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import curvature


def _cpu_ms(fn, calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e3


def gemm(N: int, repeats: int):
    """Median ms of ``a^T a`` for ``a [N, 785]``: float32, and bf16 with the casts."""
    a = torch.randn(N, 785)

    def low():
        b = a.to(torch.bfloat16)
        return (b.mT @ b).float()

    f32, bf16 = [], []
    for _ in range(repeats):
        f32.append(_cpu_ms(lambda: a.mT @ a, 20))
        bf16.append(_cpu_ms(low, 20))
    return statistics.median(f32), statistics.median(bf16)


def training_step(N: int, dtype, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    X, y = torch.randn(N, 784), torch.randint(0, 10, (N,))
    loss_func = nn.CrossEntropyLoss()
    opt = curvature.KFAC(
        model, lr=1e-2, damping=1e-2, inverse_every=10, loss_func=loss_func, statistics_dtype=dtype
    )

    def step():
        opt.zero_grad()
        loss_func(model(X), y).backward()
        opt.step()

    for _ in range(10):  # warm-up: one refresh period
        step()
    return step


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), CPU time, medians of {args.repeats}"
    )
    for N in (128, 1024):
        f32, bf16 = gemm(N, args.repeats)
        print(
            f"GEMM [785, {N}] x [{N}, 785]: float32 {f32:.3f} ms, bf16 {bf16:.3f} ms, "
            f"{f32 / bf16:.2f}x faster"
        )
    for N in (128, 1024):
        full, low = training_step(N, None), training_step(N, torch.bfloat16)
        tf, tl = [], []
        for _ in range(args.repeats):
            tf.append(_cpu_ms(full, 10))
            tl.append(_cpu_ms(low, 10))
        mf, ml = statistics.median(tf), statistics.median(tl)
        print(
            f"KFAC step, MLP 784-512-256-10, N={N}: float32 statistics {mf:.1f} ms, "
            f"bf16 {ml:.1f} ms, ratio {ml / mf:.3f}"
        )


if __name__ == "__main__":
    main()
