"""Distributed KFAC on this machine: 2 processes x 1 thread vs 1 process x 2 threads.

    python benchmarks/distributed.py                 # MLP and transformer block, 20 steps
    python benchmarks/distributed.py --steps 5 --no-doc --json dist.json

For each workload (the MLP 784-512-256-10 at batch 128 and the transformer block at
batch 16 of ``benchmarks/per_sample.py``) and optimizer (plain SGD, KFAC empirical,
KFAC empirical with ``precondition="owner"``, KFAC MC (one sample), EKFAC empirical)
it times one training step (forward, backward, ``step()``; median over ``--steps``
after 3 warm-up steps, ``inverse_every=10`` so the median is a step without
decompositions and the mean includes them):

- one process with 2 threads on the whole batch;
- 2 gloo processes with 1 thread each, DDP-wrapped, each on half of the batch
  (the time of a step is the slower rank's).

It also records the bytes each rank puts into the optimizer's collectives per step, by
purpose, next to the model of ``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import update_doc_section, write_json  # noqa: E402
from per_sample import make_workload  # noqa: E402

import curvature  # noqa: E402
from curvature.optim.distributed import packed_numel  # noqa: E402

DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks.md")
WORKLOADS = ("mlp", "transformer")
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_note.md")) as _f:
    NOTE = _f.read()  # how to read the numbers, appended to the docs section
OPTIMIZERS = ("sgd", "kfac-empirical", "kfac-empirical-owner", "kfac-mc", "ekfac-empirical")


def loss_of(wl, out, y):
    return nn.functional.cross_entropy(out, y.flatten())


def make_optimizer(kind: str, model: nn.Module):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=1e-3)
    cls = curvature.EKFAC if kind.startswith("ekfac") else curvature.KFAC
    fisher = "mc" if kind.endswith("mc") else "empirical"
    loss_func = nn.CrossEntropyLoss()
    extra = {"precondition": "owner"} if kind.endswith("owner") else {}
    return cls(
        model, lr=1e-3, damping=1e-2, fisher=fisher, loss_func=loss_func, inverse_every=10, **extra
    )


class TokenLogits(nn.Module):
    """The transformer block with its logits flattened to ``[N * S, vocab]``.

    Every token is a sample of the cross-entropy, so the optimizer's ``loss_func``
    (``nn.CrossEntropyLoss``, mean over tokens) defines the type-2 backward.
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, tokens):
        return self.block(tokens).flatten(0, 1)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    model = make_workload(name).model
    return TokenLogits(model) if name == "transformer" else model


def time_steps(wl, model, opt, X, y, steps: int, barrier=None) -> List[float]:
    times = []
    for i in range(steps + 3):
        if barrier is not None:
            barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        out = model(X)
        loss_of(wl, out, y).backward()
        opt.step()
        if barrier is not None:
            barrier()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return times


def model_bytes(opt) -> Dict[str, float]:
    """Predicted payload (bytes) from the optimizer's blocks: the model of docs/distributed.md.

    Per block ``[g, D_G, D_A]``: statistics ``4 g (t(D_A) + t(D_G))`` (``t`` the packed
    triangle), plus ``4 g D_G D_A`` for EKFAC's corrections; decompositions
    ``4 g (D_A^2 + D_A + D_G^2 + D_G)`` per refresh.
    """
    stats = decomp = 0
    for ix in getattr(opt, "_index", {}).values():
        g, D_G, D_A = ix.shape
        stats += 4 * (packed_numel((g, D_A, D_A), True) + packed_numel((g, D_G, D_G), True))
        if isinstance(opt, curvature.EKFAC):
            stats += 4 * g * D_G * D_A
        decomp += 4 * g * (D_A**2 + D_A + D_G**2 + D_G)
    return {"statistics": stats, "decompositions_per_refresh": decomp}


def worker(rank: int, world: int, out_dir: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world
    )
    results: Dict[str, Any] = {}
    for name in WORKLOADS:
        wl = make_workload(name)
        half = wl.N // world
        X, y = wl.X[rank * half : (rank + 1) * half], wl.y[rank * half : (rank + 1) * half]
        for kind in OPTIMIZERS:
            model = build(name)
            ddp = nn.parallel.DistributedDataParallel(model)
            opt = make_optimizer(kind, ddp)
            times = time_steps(wl, ddp, opt, X, y, steps, barrier=dist.barrier)
            comm = getattr(opt, "bytes_communicated", {})
            predicted = model_bytes(opt)
            total_steps = steps + 3
            results[f"{name}/{kind}"] = {
                "median": statistics.median(times),
                "mean": statistics.fmean(times),
                "bytes_per_step": {k: v / total_steps for k, v in comm.items()},
                "model_bytes": predicted,
            }
            if hasattr(opt, "close"):
                opt.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    # the last DDP reducer freed while the group lives (examples/ddp_train.py: a hang at exit)
    del ddp, opt, model
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def single(steps: int) -> Dict[str, Any]:
    torch.set_num_threads(2)
    results: Dict[str, Any] = {}
    for name in WORKLOADS:
        wl = make_workload(name)
        for kind in OPTIMIZERS:
            model = build(name)
            opt = make_optimizer(kind, model)
            times = time_steps(wl, model, opt, wl.X, wl.y, steps)
            results[f"{name}/{kind}"] = {
                "median": statistics.median(times),
                "mean": statistics.fmean(times),
            }
            if hasattr(opt, "close"):
                opt.close()
    return results


def launch(steps: int, world: int = 2) -> Dict[str, Any]:
    with tempfile.TemporaryDirectory() as out_dir:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank",
                    str(r),
                    "--out",
                    out_dir,
                    "--steps",
                    str(steps),
                ],
                env=env,
            )
            for r in range(world)
        ]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError("a rank failed")
        ranks = []
        for r in range(world):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                ranks.append(json.load(f))
    merged = {}
    for key in ranks[0]:
        merged[key] = {
            "median": max(rk[key]["median"] for rk in ranks),
            "mean": max(rk[key]["mean"] for rk in ranks),
            "bytes_per_step": ranks[0][key]["bytes_per_step"],
            "model_bytes": ranks[0][key]["model_bytes"],
        }
    return merged


def table(one: Dict[str, Any], two: Dict[str, Any]) -> str:
    lines = [
        "| workload | optimizer | 1 proc x 2 threads (ms, median / mean) "
        "| 2 procs x 1 thread (ms, median / mean) | statistics (kB/step) "
        "| decompositions (kB/step) | directions (kB/step) | model: statistics kB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key in one:
        name, kind = key.split("/")
        a, b = one[key], two[key]
        comm = b.get("bytes_per_step", {})
        predicted = f"{b['model_bytes']['statistics'] / 1e3:.0f}" if kind != "sgd" else "-"
        lines.append(
            f"| {name} | {kind} | {1e3 * a['median']:.1f} / {1e3 * a['mean']:.1f} "
            f"| {1e3 * b['median']:.1f} / {1e3 * b['mean']:.1f} "
            f"| {comm.get('statistics', 0) / 1e3:.0f} | {comm.get('decompositions', 0) / 1e3:.0f} "
            f"| {comm.get('directions', 0) / 1e3:.0f} | {predicted} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank is not None:
        worker(args.rank, 2, args.out, args.steps)
        return
    two = launch(args.steps)
    one = single(args.steps)
    text = table(one, two)
    print(text)
    result = {"one_process_two_threads": one, "two_processes_one_thread": two, "table": text}
    if args.json:
        write_json(args.json, result)
    if not args.no_doc:
        body = (
            "Command: `python benchmarks/distributed.py` (gloo on this 2-core machine; "
            "DDP-wrapped; 20 steps after 3 warm-up steps; `inverse_every=10`, so the median "
            "step has no decomposition and the mean includes two). Communication: the "
            "payload each rank puts into the optimizer's all-reduces per step (DDP's own "
            "gradient all-reduce, 4 bytes per parameter, comes on top); the model column "
            "is the statistics payload predicted by the formula in docs/distributed.md.\n\n"
            + text
            + "\n\n"
            + NOTE
        )
        update_doc_section(DOC, "Distributed training", body)


if __name__ == "__main__":
    main()
