"""Where a KFAC step on ResNet-18 goes: host and device time, against AdamW and SGD.

    python benchmarks/resnet_step.py [--device cuda] [--width 64] [--batch 128]
        [--out DIR]                      # DIR/resnet_step.json and DIR/profile.txt

Issue 19's ResNet-18 (benchmarks/resnets.py, 1 input channel, Fashion-MNIST's 28 x 28,
random data: nothing to download) with BatchNorm in train mode. For AdamW, SGD (momentum
0.9) and KFAC (defaults; ``inverse_every=10`` over 20 steps; every step a refresh; and
the statistics every 10th step, ``factor_every=10, inverse_every=100, kfac_approx=
"reduce"``) it prints per training step (zero_grad, forward, loss, backward, step):

* ``wall``: the step's time with the device synchronized after it (the median of 5
  periods of ``--steps`` steps);
* ``host``: the time until ``step()`` returns, without waiting for the device (on a GPU,
  a host-bound step has ``host`` close to ``wall``);
* ``aten``: aten calls of one step, the fourth (each a kernel launch or more on a GPU;
  for ``factor_every=10`` a step without statistics).

``--chunk-floors OLD,NEW``: instead, KFAC's row alone, alternated three times with the
Kronecker statistics' chunk floor of the device at each value (on CUDA
``curvature.layer_diagonal.KFAC_CHUNK_ELEMENTS_CUDA``, else ``KFAC_CHUNK_ELEMENTS``),
with the peak memory of a period on CUDA (an A/B in one process).

Then ``torch.profiler`` tables of KFAC's steps (sorted by device time where there is a
device, and by host (CPU) time; ``--out``: written to ``profile.txt``). On a CPU at a small width
(``--width 4 --batch 4``) the step is host-bound, a proxy of a GPU's host side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from typing import Callable, Dict

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from resnets import ResNet18  # noqa: E402
from step_counts import AtenCalls  # noqa: E402

import curvature  # noqa: E402

CE = nn.CrossEntropyLoss()


def optimizers() -> Dict[str, Callable[[nn.Module], torch.optim.Optimizer]]:
    return {
        "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=1e-2),
        "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.03, momentum=0.9),
        "KFAC": lambda m: curvature.KFAC(m),
        "KFAC, refresh every step": lambda m: curvature.KFAC(m, inverse_every=1),
        # the statistics every 10th step (training.py's hand-tuned ResNet row's frequencies)
        "KFAC, factor_every=10": lambda m: curvature.KFAC(
            m, factor_every=10, inverse_every=100, kfac_approx="reduce"
        ),
    }


def training_step(make, device: str, width: int, batch: int):
    """``(step, optimizer)``: one training step of ResNet-18 on a fixed random batch,
    after three warm-up steps."""
    torch.manual_seed(0)
    model = ResNet18(num_classes=10, in_channels=1, width=width).to(device)
    opt = make(model)
    X = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        opt.zero_grad()
        CE(model(X), y).backward()
        opt.step()

    for _ in range(3):
        step()
    return step, opt


def measure(make, device: str, width: int, batch: int, steps: int) -> Dict[str, float]:
    step, opt = training_step(make, device, width, batch)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    sync()
    with AtenCalls() as calls:
        step()
    sync()
    walls, hosts = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        host = 0.0
        for _ in range(steps):
            t = time.perf_counter()
            step()
            host += time.perf_counter() - t
        sync()
        walls.append((time.perf_counter() - t0) / steps * 1e3)
        hosts.append(host / steps * 1e3)
    if hasattr(opt, "close"):
        opt.close()
    return {
        "wall_ms": sorted(walls)[2],
        "host_ms": sorted(hosts)[2],
        "aten_calls": calls.count,
    }


def chunk_floors(device: str, width: int, batch: int, steps: int, floors) -> Dict[str, list]:
    """KFAC's step with each Kronecker statistics chunk floor in ``floors``, alternated
    three times in this process: ``{floor: [measure(...) with "peak_mib", ...]}``."""
    from curvature import layer_diagonal

    name = "KFAC_CHUNK_ELEMENTS_CUDA" if device.startswith("cuda") else "KFAC_CHUNK_ELEMENTS"
    kept = getattr(layer_diagonal, name)
    out: Dict[str, list] = {str(f): [] for f in floors}
    try:
        for _ in range(3):
            for f in floors:
                setattr(layer_diagonal, name, f)
                if device.startswith("cuda"):
                    torch.cuda.reset_peak_memory_stats()
                r = measure(curvature.KFAC, device, width, batch, steps)
                if device.startswith("cuda"):
                    r["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
                out[str(f)].append(r)
                print(
                    f"  KFAC, chunk floor {f:>10d}  wall {r['wall_ms']:8.2f} ms  "
                    f"host {r['host_ms']:8.2f} ms  aten {r['aten_calls']:5d}"
                    + (f"  peak {r['peak_mib']:.0f} MiB" if "peak_mib" in r else "")
                )
    finally:
        setattr(layer_diagonal, name, kept)
    return out


def profile(device: str, width: int, batch: int, steps: int, rows: int) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    step, opt = training_step(curvature.KFAC, device, width, batch)
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    opt.close()
    # device time by operator and shape; host time by operator (where the Python goes)
    keys = (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]
    return "\n\n".join(
        f"sorted by {key} ({steps} steps)\n"
        + prof.key_averages(group_by_input_shape=key != "self_cpu_time_total").table(
            sort_by=key, row_limit=rows, max_name_column_width=40, max_shapes_column_width=60
        )
        for key in keys
    )


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="steps per timed period")
    p.add_argument("--rows", type=int, default=30, help="rows of the profile table")
    p.add_argument("--out", default=None, help="a folder for the JSON and the profile")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--chunk-floors",
        default=None,
        help="OLD,NEW: KFAC alone with each Kronecker statistics chunk floor (elements)",
    )
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"ResNet-18 width {args.width}, batch {args.batch}, {args.device} ({where})")
    results = {}
    if args.chunk_floors:
        try:
            floors = [int(v) for v in args.chunk_floors.split(",")]
        except ValueError:
            raise SystemExit(
                f"--chunk-floors: expected integers like 1048576,4194304, got {args.chunk_floors!r}"
            ) from None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = chunk_floors(args.device, args.width, args.batch, args.steps, floors)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "chunk_floors.json"), "w") as f:
                json.dump({"device": where, "torch": torch.__version__, "results": results}, f)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BatchNorm in train mode: plain gradient
        for name, make in optimizers().items():
            r = measure(make, args.device, args.width, args.batch, args.steps)
            results[name] = r
            print(
                f"  {name:26s} wall {r['wall_ms']:8.2f} ms  host {r['host_ms']:8.2f} ms  "
                f"aten {r['aten_calls']:5d}"
            )
        table = profile(args.device, args.width, args.batch, args.steps, args.rows)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {
            "device": where,
            "torch": torch.__version__,
            "width": args.width,
            "batch": args.batch,
            "steps": args.steps,
        }
        with open(os.path.join(args.out, "resnet_step.json"), "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        with open(os.path.join(args.out, "profile.txt"), "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
