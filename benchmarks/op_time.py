"""Where a KFAC training step spends its time, aten call by aten call, against ASDL's.

Issue 17's CPU comparison (benchmarks/optim_step.py: our KFAC step over ASDL's on the MLP
784-512-256-10 at batch 128) is a ratio of whole steps; this script splits both steps into
their aten calls. A ``TorchDispatchMode`` times every call of ``--steps`` training steps
(zero_grad, forward, loss, backward, step; statistics every step, decompositions every
``--period`` steps, as optim_step.py's rows) of our ``KFAC`` and of ASDL's
``KfacGradientMaker`` with SGD (optim_step.py's ``asdl_kfac``), alternating; it prints
milliseconds per step: the total, the GEMMs (``mm``, ``bmm``, ``addmm`` and their ``out=``
forms), the rest, and the largest other calls with their counts per step. The timing of
each call includes the mode's own overhead (a few microseconds per call), so compare the
two columns, not the totals with optim_step.py's.

    python benchmarks/op_time.py [--fisher empirical|mc] [--steps 40] [--threads 1] [--top 15]

ASDL (``pip install asdfghjkl``) is optional: without it only our step is listed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import time
import warnings

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import optim_step  # noqa: E402

import curvature  # noqa: E402

GEMMS = ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm")


class OpTimes(TorchDispatchMode):
    """Wall time and count of every aten call, by operator."""

    def __init__(self):
        super().__init__()
        self.time = collections.defaultdict(float)
        self.count = collections.defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        name = str(func)
        self.time[name] += time.perf_counter() - start
        self.count[name] += 1
        return out


def steps_of(fisher: str, period: int):
    """``{name: step}`` of ours and (where installed) ASDL's, on copies of one MLP."""
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    X, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    CE = nn.CrossEntropyLoss()
    ours = copy.deepcopy(mlp)
    opt = curvature.KFAC(
        ours,
        lr=optim_step.LR,
        damping=optim_step.DAMPING,
        factor_decay=optim_step.FACTOR_DECAY,
        inverse_every=period,
        fisher=fisher,
        loss_func=CE,
    )

    def our_step():
        opt.zero_grad()
        CE(ours(X), y).backward()
        opt.step()

    out = {"ours": our_step}
    try:
        out["ASDL"] = optim_step.asdl_kfac(
            copy.deepcopy(mlp), X, y, CE, "mc" if fisher == "mc" else "empirical", period=period
        )
    except ImportError:
        print("(asdfghjkl not installed: our step only)")
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fisher", choices=["empirical", "mc"], default="empirical")
    parser.add_argument(
        "--steps", type=int, default=40, help="timed steps (a multiple of --period)"
    )
    parser.add_argument("--period", type=int, default=optim_step.PERIOD)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=15, help="other calls listed")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    steps = steps_of(args.fisher, args.period)
    modes = {name: OpTimes() for name in steps}
    for _ in range(2):  # two rounds, alternating; warm-up outside the modes
        for name, step in steps.items():
            for _ in range(args.period):
                step()
            with modes[name]:
                for _ in range(args.steps // 2):
                    step()
    n = args.steps // 2 * 2
    print(
        f"KFAC {args.fisher}, MLP 784-512-256-10 at batch 128, {args.threads} thread(s), "
        f"decompositions every {args.period} steps; ms per step (calls per step)"
    )
    for name, m in modes.items():
        total = sum(m.time.values()) * 1e3 / n
        gemm = sum(t for k, t in m.time.items() if k.startswith(GEMMS)) * 1e3 / n
        calls = sum(m.count.values()) / n
        other = total - gemm
        print(
            f"\n{name}: total {total:.2f}, GEMMs {gemm:.2f}, other {other:.2f} ({calls:.0f} calls)"
        )
        others = sorted(
            ((t, k) for k, t in m.time.items() if not k.startswith(GEMMS)), reverse=True
        )
        for t, k in others[: args.top]:
            print(f"  {t * 1e3 / n:7.3f}  ({m.count[k] / n:4.1f})  {k}")


if __name__ == "__main__":
    main()
