"""Per-call host time of the curvature functions on small inputs (one thread, CPU).

At tiny sizes a call of :func:`curvature.kfac` is all Python and small ops: what a GPU
pays on the host per call (issue 17: ``kfac()`` on an MLP 784-512-256-10 at batch 1024 on
an H200 was host-bound). Each repeat times ``--inner`` back-to-back calls of a plain
forward+backward and of each function, alternating; the median over ``--repeats`` of the
per-call milliseconds is printed, with the ratio to the forward+backward.

    python benchmarks/host_overhead.py --size tiny   # MLP 78-51-25-10, N = 8
    python benchmarks/host_overhead.py --size cpu    # MLP 784-512-256-10, N = 128
    python benchmarks/host_overhead.py --size cnn [--unfolded]  # CNN 3x32x32, N = 64
    python benchmarks/host_overhead.py --size tokens  # token MLP 16-32-16 on [4, 8, 16], MSE

``--peers`` adds the peers' equivalents on the same model and data, timed in the same
loop (interleaved with ours): ASDL's Kronecker factors (empirical and MC, ``SHAPE_KRON``)
and empirical diagonal (``SHAPE_DIAG``), and curvlinops' ``KFACLinearOperator``
(empirical and MC, factors computed). Each of our rows is then also printed as a ratio
to its peer rows: host time per call, ours / theirs, on this machine, one thread.
``--clock thread`` times this thread's CPU time instead of the wall clock: on a machine
shared with other jobs, the time the thread waits for a core is then not counted.
``--only a,b`` times those rows (and the forward+backward) only.

``--size cnn`` is optim_step.py's CNN (two 3x3 convolutions, a 12544->128 Linear);
``--unfolded`` switches the convolutions' direct diagonal off
(``curvature.layer_diagonal.DIRECT_DIAGONAL``), for the path before it.
"""

from __future__ import annotations

import argparse
import copy
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

SIZES = {
    "tiny": ((78, 51, 25, 10), 8),
    "cpu": ((784, 512, 256, 10), 128),
    "cnn": (None, 64),
    "tokens": ((16, 32, 16), 4),
}
#: ours -> the peer rows it is compared with
PEERS_OF = {
    "kfac empirical": ("ASDL kron empirical", "curvlinops KFAC empirical"),
    "kfac mc": ("ASDL kron mc", "curvlinops KFAC mc"),
    "diag_ggn empirical": ("ASDL diag empirical",),
}


def mlp(widths) -> nn.Sequential:
    """``Linear``/``ReLU`` layers of the given widths."""
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def calls(size: str, peers: bool = False) -> Dict[str, Callable[[], object]]:
    """The timed calls, ``"forward+backward"`` first (the peers' last with ``peers``)."""
    torch.manual_seed(0)
    widths, N = SIZES[size]
    loss_func: nn.Module = nn.CrossEntropyLoss()
    if widths is None:  # the CNN
        model, X, y = optim_step._cnn(), torch.randn(N, 3, 32, 32), torch.randint(0, 10, (N,))
    elif size == "tokens":  # gpu.py's token MLP (Linear, GELU, Linear), per-token MSE
        model = nn.Sequential(nn.Linear(widths[0], widths[1]), nn.GELU())
        model.append(nn.Linear(widths[1], widths[2]))
        X, y, loss_func = torch.randn(N, 8, widths[0]), torch.randn(N, 8, widths[2]), nn.MSELoss()
    else:
        model = mlp(widths)
        X, y = torch.randn(N, widths[0]), torch.randint(0, widths[-1], (N,))
    LF = loss_func

    def plain():
        model.zero_grad()
        LF(model(X), y).backward()

    out = {
        "forward+backward": plain,
        "kfac empirical": lambda: curvature.kfac(model, LF, (X, y), fisher="empirical"),
        "kfac mc": lambda: curvature.kfac(model, LF, (X, y), fisher="mc"),
        "ekfac empirical": lambda: curvature.ekfac(model, LF, (X, y), fisher="empirical"),
        "diag_ggn empirical": lambda: curvature.diag_ggn(model, LF, (X, y), "empirical"),
    }
    if peers:
        out.update(peer_calls(model, LF, X, y))
    return out


def peer_calls(model: nn.Module, loss_func: nn.Module, X, y) -> Dict[str, Callable[[], object]]:
    """The peers' equivalents (those installed) on a copy of ``model``, same data.

    ASDL: a ``FisherMaker`` per row (made once, as a user would), each call a forward, the
    loss and the backward with its hooks; ``data_size`` the loss's normalization (``N``
    for cross-entropy, the number of entries for MSE), as in ``gpu.py``. curvlinops: a
    ``KFACLinearOperator`` built and its factors computed, per call.
    """
    out: Dict[str, Callable[[], object]] = {}
    theirs = copy.deepcopy(model)
    out.update(optim_step.asdl_fisher_runs(theirs, loss_func, X, y, "mc"))
    try:
        import curvlinops
    except ImportError:
        return out
    params = [p for p in theirs.parameters() if p.requires_grad]
    for ftype in ("empirical", "mc"):

        def op(ftype=ftype):
            kw = dict(check_deterministic=False, fisher_type=ftype)
            K = curvlinops.KFACLinearOperator(theirs, loss_func, params, [(X, y)], **kw)
            if hasattr(K, "compute_kronecker_factors"):  # lazy in newer versions
                K.compute_kronecker_factors()
            return K

        out[f"curvlinops KFAC {ftype}"] = op
    return out


def main() -> None:
    """Print the median milliseconds per call and the ratio to a forward+backward."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--inner", type=int, default=0, help="calls per timing (0: auto)")
    parser.add_argument("--unfolded", action="store_true", help="no direct conv diagonal")
    parser.add_argument("--peers", action="store_true", help="time ASDL and curvlinops too")
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall time, or this thread's CPU time (steadier on a loaded machine)",
    )
    parser.add_argument("--only", default="", help="comma-separated rows to time (and fwd+bwd)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    layer_diagonal.DIRECT_DIAGONAL = not args.unfolded
    warnings.filterwarnings("ignore", ".*larger than max_factor_size")  # the CNN's 12544
    fns = calls(args.size, args.peers)
    if args.only:
        keep = {"forward+backward", *args.only.split(",")}
        fns = {k: f for k, f in fns.items() if k in keep}
    inner = args.inner or {"tiny": 20, "cpu": 3, "cnn": 1, "tokens": 20}[args.size]
    for fn in fns.values():  # warm up
        fn()
        fn()
    times: Dict[str, list] = {k: [] for k in fns}
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    for _ in range(args.repeats):
        for key, fn in fns.items():
            t = clock()
            for _ in range(inner):
                fn()
            times[key].append(1e3 * (clock() - t) / inner)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(
        f"size={args.size} repeats={args.repeats} inner={inner} unfolded={args.unfolded} "
        f"clock={args.clock} "
        f"loadavg={' '.join(load)}"
    )
    base = statistics.median(times["forward+backward"])
    med = {key: statistics.median(ts) for key, ts in times.items()}
    for key, m in med.items():
        print(f"{key:28s} {m:8.3f} ms  {m / base:6.2f}x")
    for ours, peers in PEERS_OF.items():
        for peer in (p for p in peers if ours in med and p in med):
            print(f"{ours:20s} / {peer:28s} {med[ours] / med[peer]:6.2f}")


if __name__ == "__main__":
    main()
