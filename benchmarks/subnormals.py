"""Late-training slowdown from subnormal numbers on a CPU, with and without the flush.

    python benchmarks/subnormals.py [--optimizer DiagonalNaturalGradient] [--blocks 8]

Two copies of the same run (MLP 784-512-256-10 memorizing one batch of 128, one
thread): one with :mod:`curvature.subnormals` flushing (the default), one without
(``curvature.subnormals.ENABLED = False``), taking turns every ``--steps`` steps in one
process. Prints the milliseconds per step of each block and the loss of both (equal up
to the flushed values, far below the printed digits).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_memory import mlp  # noqa: E402

import curvature  # noqa: E402
import curvature.subnormals as subnormals  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--optimizer", default="DiagonalNaturalGradient")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    CE = nn.CrossEntropyLoss()
    runs = []
    for enabled in (True, False):
        torch.manual_seed(0)
        model = mlp()
        X, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
        opt = getattr(curvature, args.optimizer)(model)
        runs.append((enabled, model, opt, X, y))
    print(f"{args.optimizer}, ms per step over blocks of {args.steps} steps (flush / none)")
    was = subnormals.ENABLED
    try:
        for k in range(args.blocks):
            row = []
            for enabled, model, opt, X, y in runs:
                subnormals.ENABLED = enabled
                t = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for _ in range(args.steps):
                        opt.zero_grad()
                        loss = CE(model(X), y)
                        loss.backward()
                        opt.step()
                row.append(((time.perf_counter() - t) / args.steps * 1e3, float(loss.detach())))
            (a, la), (b, lb) = row
            steps = (k + 1) * args.steps
            print(f"steps {steps:5d}: {a:6.2f} / {b:6.2f} ms   loss {la:.3e} / {lb:.3e}")
    finally:
        subnormals.ENABLED = was


if __name__ == "__main__":
    main()
