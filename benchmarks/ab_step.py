"""Old against new code: one optimizer's training step, both packages in one process.

    git worktree add ../old <commit>          # the code to compare against
    python benchmarks/ab_step.py --old ../old [--workload fm] [--optimizer KFAC] [--periods 31]
        [--inverse-every 1]                   # every step a refresh
        [--fisher mc]                         # the optimizer's curvature type
        [--options '{"kfac_approx": "reduce"}']  # further options of the optimizer (JSON)

The package of ``--old`` (its ``curvature/`` directory) is copied under another name
(``curvature_old``, into a temporary directory: the package imports itself only
relatively; its custom operators renamed into the namespace ``curvature_old``) and
imported beside this checkout's ``curvature``; the same model, batch and
options are built for each, and 20-step periods of the two alternate (the order swapped
every period), one thread. On a noisy machine a ratio within one process is steadier
than two processes' times; the minimum and the first quartile are the steadiest figures.

Workloads: ``fm`` (the Fashion-MNIST MLP of benchmarks/training.py, 784-256-10 at batch
256), ``mlp`` (784-512-256-10 at batch 128, issue 17's), ``cnn`` (benchmarks/optim_step.py's
CNN at batch 64), ``vgg`` (benchmarks/gpu.py's VGG at width 16, batch 32), ``resnet``
(benchmarks/resnets.py's ResNet-18 with BatchNorm at width 16 on 1x28x28, batch 128),
``tiny`` (that ResNet-18 at width 4, batch 4: every kernel tiny, so the step is the
host's work, the proxy of a host-bound GPU step), ``gpu-vgg`` (gpu.py's VGG at its GPU
size, batch 256) and ``gpu-resnet`` (that ResNet-18 at torchvision's width 64, batch 128);
random inputs and labels. ``--device cuda``: on the GPU, each period ended by a
synchronization (carry the old checkout's ``curvature/`` inside the repository, e.g.
``.old/curvature``, to a device machine). The image
workloads use ``lr=1e-3, damping=0.1`` (the defaults diverge on random labels, and
skipped steps would time something else).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


WORKLOADS = ["fm", "mlp", "cnn", "vgg", "resnet", "tiny", "gpu-vgg", "gpu-resnet"]


def workload(name: str):
    """``(model, X, y, options)`` of a workload, after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    if name == "fm":
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
        return model, torch.randn(256, 784), torch.randint(0, 10, (256,)), {}
    if name == "mlp":
        import step_memory

        return step_memory.mlp(), torch.randn(128, 784), torch.randint(0, 10, (128,)), {}
    images = {"lr": 1e-3, "damping": 0.1}
    if name == "cnn":
        import optim_step

        model = optim_step._cnn()
        return model, torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,)), images
    if name == "vgg":
        import gpu

        model = gpu.vgg(16, 128)
        return model, torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,)), images
    if name == "resnet":
        from resnets import ResNet18

        model = ResNet18(num_classes=10, in_channels=1, width=16)
        return model, torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,)), images
    if name == "gpu-vgg":
        import gpu

        model = gpu.vgg()
        return model, torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,)), images
    if name == "gpu-resnet":
        from resnets import ResNet18

        model = ResNet18(num_classes=10, in_channels=1, width=64)
        return model, torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,)), images
    if name == "tiny":  # the host's share: every kernel tiny (a GPU's host-bound case)
        from resnets import ResNet18

        model = ResNet18(num_classes=10, in_channels=1, width=4)
        return model, torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)), images
    raise ValueError(f"unknown workload {name!r}")


def make_step(
    lib,
    wl: str,
    optimizer: str,
    warmup: int = 12,
    inverse_every: Optional[int] = None,
    fisher: Optional[str] = None,
    extra: Optional[Dict[str, object]] = None,
    device: str = "cpu",
) -> Callable[[], None]:
    """A training step of ``lib``'s ``optimizer`` on the workload, warmed up
    (``inverse_every``, ``fisher``: the optimizer's, else its defaults; ``extra``: further
    options).
    """
    cls = getattr(lib, optimizer, None)
    if not isinstance(cls, type):
        raise SystemExit(f"--optimizer {optimizer!r}: not an optimizer of curvature")
    model, X, y, options = workload(wl)
    model, X, y = model.to(device), X.to(device), y.to(device)
    if inverse_every is not None:
        options = {**options, "inverse_every": inverse_every}
    loss_func = nn.CrossEntropyLoss()
    if fisher is not None:
        options = {**options, "fisher": fisher, "loss_func": loss_func}
    opt = cls(model, **{**options, **(extra or {})})

    def step() -> None:
        opt.zero_grad()
        loss_func(model(X), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    return step


def import_old(path: str, into: str):
    """The package of checkout ``path`` imported as ``curvature_old`` from ``into``."""
    src = os.path.join(path, "curvature")
    if not os.path.isdir(src):
        raise SystemExit(f"--old {path}: no curvature/ package there")
    dst = os.path.join(into, "curvature_old")
    shutil.copytree(src, dst)
    # its custom operators in a namespace of their own: the same names would replace
    # this checkout's (torch.library keeps one implementation per name)
    for root, _, files in os.walk(dst):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                with open(path) as fh:
                    text = fh.read()
                new = text.replace('"curvature::', '"curvature_old::')
                new = new.replace("torch.ops.curvature.", "torch.ops.curvature_old.")
                if new != text:
                    with open(path, "w") as fh:
                        fh.write(new)
    for name in [m for m in sys.modules if m.split(".")[0] == "curvature_old"]:
        del sys.modules[name]  # (a copy imported before, from elsewhere)
    sys.path.insert(0, into)
    return importlib.import_module("curvature_old")


def quantiles(values: List[float]) -> Dict[str, float]:
    v = sorted(values)
    return {"min": v[0], "q25": v[len(v) // 4], "median": v[len(v) // 2]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="a checkout of the code to compare against")
    p.add_argument("--workload", default="fm", choices=WORKLOADS)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--optimizer", default="KFAC", help="KFAC, EKFAC, DiagonalNaturalGradient")
    p.add_argument("--periods", type=int, default=31)
    p.add_argument("--steps", type=int, default=20, help="steps per timed period")
    p.add_argument("--inverse-every", type=int, default=None, help="e.g. 1: every step a refresh")
    p.add_argument("--fisher", default=None, help="e.g. mc (default: the optimizer's)")
    p.add_argument("--options", type=json.loads, default={}, help="further options, JSON")
    args = p.parse_args(argv)
    if not isinstance(args.options, dict):
        raise SystemExit(f"--options: expected a JSON object, got {args.options!r}")
    torch.set_num_threads(1)
    import curvature

    with tempfile.TemporaryDirectory() as tmp:
        old = import_old(args.old, tmp)
        steps = {
            k: make_step(
                lib,
                args.workload,
                args.optimizer,
                inverse_every=args.inverse_every,
                fisher=args.fisher,
                extra=args.options,
                device=args.device,
            )
            for k, lib in (("old", old), ("new", curvature))
        }
        times: Dict[str, List[float]] = {"old": [], "new": []}
        for r in range(args.periods):
            for k in ("old", "new") if r % 2 == 0 else ("new", "old"):
                t = time.perf_counter()
                for _ in range(args.steps):
                    steps[k]()
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times[k].append((time.perf_counter() - t) / args.steps * 1e3)
    q = {k: quantiles(v) for k, v in times.items()}
    every = "" if args.inverse_every is None else f", inverse_every={args.inverse_every}"
    every += "" if args.fisher is None else f", fisher={args.fisher}"
    every += "".join(f", {k}={v}" for k, v in args.options.items())
    where = "" if args.device == "cpu" else f" ({args.device})"
    print(
        f"{args.optimizer}{every} on {args.workload}{where}, ms per step, {args.periods} periods:"
    )
    for k in ("old", "new"):
        print(f"  {k}: " + ", ".join(f"{n} {x:.2f}" for n, x in q[k].items()))
    print("  new / old: " + ", ".join(f"{n} {q['new'][n] / q['old'][n]:.3f}" for n in q["new"]))


if __name__ == "__main__":
    main()
