"""Per-call host time of the curvature functions on small inputs (one thread, CPU).

At tiny sizes a call of :func:`curvature.kfac` is all Python and small ops: what a GPU
pays on the host per call (issue 17: ``kfac()`` on an MLP 784-512-256-10 at batch 1024 on
an H200 was host-bound). Each repeat times ``--inner`` back-to-back calls of a plain
forward+backward and of each function, alternating; the median over ``--repeats`` of the
per-call milliseconds is printed, with the ratio to the forward+backward.

    python benchmarks/host_overhead.py --size tiny   # MLP 78-51-25-10, N = 8
    python benchmarks/host_overhead.py --size cpu    # MLP 784-512-256-10, N = 128
    python benchmarks/host_overhead.py --size cnn [--unfolded]  # CNN 3x32x32, N = 64

``--size cnn`` is optim_step.py's CNN (two 3x3 convolutions, a 12544->128 Linear);
``--unfolded`` switches the convolutions' direct diagonal off
(``curvature.layer_diagonal.DIRECT_DIAGONAL``), for the path before it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Callable, Dict

import torch
from torch import nn

import curvature
import curvature.layer_diagonal as layer_diagonal

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optim_step  # noqa: E402

SIZES = {"tiny": ((78, 51, 25, 10), 8), "cpu": ((784, 512, 256, 10), 128), "cnn": (None, 64)}


def mlp(widths) -> nn.Sequential:
    """``Linear``/``ReLU`` layers of the given widths."""
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def calls(size: str) -> Dict[str, Callable[[], object]]:
    """The timed calls, ``"forward+backward"`` first."""
    torch.manual_seed(0)
    widths, N = SIZES[size]
    CE = nn.CrossEntropyLoss()
    if widths is None:  # the CNN
        model, X, y = optim_step._cnn(), torch.randn(N, 3, 32, 32), torch.randint(0, 10, (N,))
    else:
        model = mlp(widths)
        X, y = torch.randn(N, widths[0]), torch.randint(0, widths[-1], (N,))

    def plain():
        model.zero_grad()
        CE(model(X), y).backward()

    return {
        "forward+backward": plain,
        "kfac empirical": lambda: curvature.kfac(model, CE, (X, y), fisher="empirical"),
        "kfac mc": lambda: curvature.kfac(model, CE, (X, y), fisher="mc"),
        "ekfac empirical": lambda: curvature.ekfac(model, CE, (X, y), fisher="empirical"),
        "diag_ggn empirical": lambda: curvature.diag_ggn(model, CE, (X, y), "empirical"),
    }


def main() -> None:
    """Print the median milliseconds per call and the ratio to a forward+backward."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--inner", type=int, default=0, help="calls per timing (0: auto)")
    parser.add_argument("--unfolded", action="store_true", help="no direct conv diagonal")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layer_diagonal.DIRECT_DIAGONAL = not args.unfolded
    warnings.filterwarnings("ignore", ".*larger than max_factor_size")  # the CNN's 12544
    fns = calls(args.size)
    inner = args.inner or {"tiny": 20, "cpu": 3, "cnn": 1}[args.size]
    for fn in fns.values():  # warm up
        fn()
        fn()
    times: Dict[str, list] = {k: [] for k in fns}
    for _ in range(args.repeats):
        for key, fn in fns.items():
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            times[key].append(1e3 * (time.perf_counter() - t) / inner)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(
        f"size={args.size} repeats={args.repeats} inner={inner} unfolded={args.unfolded} "
        f"loadavg={' '.join(load)}"
    )
    base = statistics.median(times["forward+backward"])
    for key, ts in times.items():
        med = statistics.median(ts)
        print(f"{key:20s} {med:8.3f} ms  {med / base:6.2f}x")


if __name__ == "__main__":
    main()
