"""Time of one optimizer step (forward, backward, statistics, update) against a plain
forward+backward, for KFAC / EKFAC / DiagonalNaturalGradient and SGD / Adam.

    python benchmarks/optim_step.py [--quick] [--json PATH] [--no-doc] [--device cuda]

Workloads: MLP 784-512-256-10 at batch 128; a CNN on 3x32x32 at batch 64 (with a
12544->128 Linear, as in shared/PERFORMANCE.md); a token MLP 128-256-128 on [32, 64, 128].
The ratio includes the amortized decompositions (``inverse_every=10``): each timed call
is 10 consecutive training steps (one refresh period), against 10 plain steps.
``--device cuda`` runs the same workloads on the GPU (each timed call ends with
``torch.cuda.synchronize()``) and writes its own section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import curvature  # noqa: E402


def workloads():
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    yield "MLP 784-512-256-10, N=128", mlp, torch.randn(128, 784), torch.randint(0, 10, (128,))
    yield (
        "CNN 3x32x32 (12544->128), N=64",
        _cnn(),
        torch.randn(64, 3, 32, 32),
        torch.randint(0, 10, (64,)),
    )
    tok = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    yield (
        "token MLP 128-256-128, [32, 64, 128]",
        tok,
        torch.randn(32, 64, 128),
        torch.randn(32, 64, 128),
    )


def _cnn():
    # 3x32x32 -> conv(16) -> pool -> 16x16x16... -> 12544 = 64 * 14 * 14
    return nn.Sequential(
        nn.Conv2d(3, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(12544, 128),
        nn.ReLU(),
        nn.Linear(128, 10),
    )


PERIOD = 10  # inverse_every of the curvature optimizers below


def _period(fn, device=None):
    """``PERIOD`` consecutive calls of ``fn`` as one timed call (waiting for the device)."""

    def run():
        for _ in range(PERIOD):
            fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    return run


def optimizers(model, loss_func):
    yield "SGD", torch.optim.SGD(model.parameters(), lr=1e-3)
    yield "Adam", torch.optim.Adam(model.parameters(), lr=1e-4)
    kw = dict(lr=1e-4, damping=1e-2, inverse_every=PERIOD, loss_func=loss_func)
    yield "KFAC empirical", curvature.KFAC(model, fisher="empirical", **kw)
    yield "KFAC mc-1", curvature.KFAC(model, fisher="mc", **kw)
    yield "EKFAC empirical", curvature.EKFAC(model, fisher="empirical", **kw)
    yield "DiagonalNG empirical", curvature.DiagonalNaturalGradient(model, fisher="empirical", **kw)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["mlp", "cnn", "tokens"],
        help="subset of mlp, cnn, tokens (cnn decomposes a 12545x12545 factor: minutes)",
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    repeats = 3 if args.quick else 7
    gate = common.QuietGate() if hasattr(common, "QuietGate") else (lambda: None)
    rows, data = [], {}
    start = time.perf_counter()
    keys = ["mlp", "cnn", "tokens"]
    for key, (title, model, X, y) in zip(keys, workloads()):
        if key not in args.workloads:
            continue
        model, X, y = model.to(device), X.to(device), y.to(device)
        loss_func = nn.CrossEntropyLoss() if y.dtype == torch.long else nn.MSELoss()

        # the baseline runs on a copy without the optimizers' hooks
        twin = copy.deepcopy(model)

        def plain(model=twin, X=X, y=y, loss_func=loss_func):
            model.zero_grad()
            loss_func(model(X), y).backward()

        for name, opt in optimizers(model, loss_func):

            def step(opt=opt, model=model, X=X, y=y, loss_func=loss_func):
                opt.zero_grad()
                loss_func(model(X), y).backward()
                opt.step()

            # one measurement = one refresh period, so that every measurement holds
            # exactly one refresh (a median over shorter blocks would mostly miss it)
            res = common.compare(
                _period(plain, device),
                _period(step, device),
                repeats=repeats,
                min_time=0.0,
                gate=gate,
            )
            for k in ("time", "baseline_time"):
                res[k] /= PERIOD
            rows.append([title, name, f"{1e3 * res['time']:.1f}", f"{res['ratio']:.2f}"])
            data.setdefault(title, {})[name] = res
            print(f"{title:40s} {name:22s} {res['ratio']:6.2f}x", flush=True)
            if hasattr(opt, "close"):
                opt.close()
    table = common.markdown_table(["workload", "optimizer", "time [ms]", "x fwd+bwd"], rows)
    command = "python benchmarks/optim_step.py" + (" --quick" if args.quick else "")
    command += " --workloads " + " ".join(args.workloads)
    command += f" --device {args.device}" if device.type != "cpu" else ""
    body = (
        f"Generated by `benchmarks/optim_step.py`. Command: `{command}` "
        f"({time.strftime('%Y-%m-%d %H:%M')}, {time.perf_counter() - start:.0f} s). "
        f"Machine: {common.machine_line()}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
        + ".\n\n"
        "One full training step (zero_grad, forward, backward, optimizer step with statistics "
        "every step and decompositions every 10 steps, amortized) as a ratio to a plain "
        "forward+backward: each measurement times 10 consecutive steps (one refresh "
        "period, so exactly one refresh) against 10 plain steps; `time` is per step. "
        "Peers' figures from shared/PERFORMANCE.md for the same workloads: "
        "KFAC step with inverses every 10 steps 6.9x / 41x / 3.1x (ASDL), an "
        "SGD step 1.2x. The baseline runs on a copy of the model without the "
        "optimizers' hooks. On the CNN, the 12544->128 layer exceeds "
        "`max_factor_size=4096`: its `A` is kept as its diagonal, `G` full "
        "(`OneSidedBlock`; ASDL decomposes the full factor), so that row is not a "
        "like-for-like comparison. KFAC uses its default pi damping (damped inverses "
        "by Cholesky at each refresh); EKFAC decomposes with `eigh`.\n\n" + table
    )
    print(table)
    if not args.no_doc:
        title = "Optimizer steps" + (f" ({device.type})" if device.type != "cpu" else "")
        common.update_doc_section("docs/benchmarks.md", title, body)
    if args.json:
        common.write_json(args.json, data)


if __name__ == "__main__":
    main()
