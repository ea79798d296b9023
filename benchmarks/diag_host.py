"""Host time of a DiagonalNaturalGradient training step at tiny sizes (issue 17), on CPU.

    PYTHONPATH=. python benchmarks/diag_host.py [--steps 300] [--profile cnn]

On a GPU the DiagonalNG step of issue 17's workloads is host-bound: it takes as long as the
host needs to enqueue it. Here the same workloads (``gpu.py --scale small``: MLP
784-32-32-10 at batch 16, VGG-like CNN 4-8-16 at batch 4) run on one CPU thread, where the
compute is negligible and a step's wall time is its host time; the median over blocks of
10 steps (one refresh period) is printed per step in ms, for AdamW (``foreach=True``) and
DiagonalNG empirical, with the aten calls per step (the mean over one period).
``--profile NAME`` prints cProfile's top functions of that workload.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu  # noqa: E402

import curvature  # noqa: E402


class _Count(TorchDispatchMode):
    """Counts aten calls."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def main() -> None:  # noqa: D103
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--profile", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for key, _, make, x, y, loss_func in gpu.step_workloads("small"):
        if key == "lm":
            continue
        for name in ("AdamW", "DiagonalNG"):
            torch.manual_seed(0)
            model = make()
            if name == "AdamW":
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
            else:
                opt = curvature.DiagonalNaturalGradient(
                    model, lr=1e-3, fisher="empirical", loss_func=loss_func, inverse_every=10
                )

            def step(opt=opt, model=model, loss_func=loss_func, x=x, y=y):
                opt.zero_grad()
                loss_func(model(x), y).backward()
                opt.step()

            for _ in range(20):
                step()
            times = []
            for _ in range(max(1, args.steps // 10)):
                t0 = time.perf_counter()
                for _ in range(10):
                    step()
                times.append((time.perf_counter() - t0) / 10 * 1e3)
            with _Count() as count:
                for _ in range(10):
                    step()
            print(
                f"{key:4s} {name:11s} {statistics.median(times):7.3f} ms/step (host, CPU), "
                f"{count.n / 10:.1f} aten calls/step"
            )
            if args.profile == key and name == "DiagonalNG":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    step()
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
