"""EKFAC's refresh: eigendecompositions against the tracked basis (``eigenbasis_update``).

Times, in one process and alternating, EKFAC training steps of an MLP with a refresh at
every step (``inverse_every=1``: the refresh's cost plus a step's) and without refreshes
(``inverse_every=1000``), for ``eigenbasis_update="eigh"`` and ``"power"``; each
optimizer trains its own copy of the model on the same batches. Also counts the GPU
synchronizations a refresh would make (``step_counts.HostReads(checked=True)`` under
``as_on_cuda``). Usage::

    python benchmarks/ekfac_refresh.py --widths 784,512,256,10 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_counts import HostReads, as_on_cuda  # noqa: E402

import curvature  # noqa: E402

CE = nn.CrossEntropyLoss()
UPDATES = ("eigh", "power")


def mlp(widths):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += ([nn.ReLU()] if i else []) + [nn.Linear(a, b)]
    return nn.Sequential(*layers)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="784,512,256,10")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    widths = [int(w) for w in args.widths.split(",")]
    base = mlp(widths)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(args.batch, widths[0], generator=g),
            torch.randint(0, widths[-1], (args.batch,), generator=g),
        )
        for _ in range(4)
    ]
    runs = {}
    for every in (1, 1000):
        for update in UPDATES:
            model = copy.deepcopy(base)
            opt = curvature.EKFAC(model, inverse_every=every, eigenbasis_update=update)
            runs[(every, update)] = (model, opt, [])

    def step(model, opt, i):
        X, y = batches[i % len(batches)]
        opt.zero_grad()
        CE(model(X), y).backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(2):  # the first refresh decomposes in both
            for model, opt, _ in runs.values():
                step(model, opt, i)
        for i in range(2, 2 + args.repeats):
            for model, opt, times in runs.values():
                t0 = time.perf_counter()
                step(model, opt, i)
                times.append(time.perf_counter() - t0)
        syncs = {}
        for update in UPDATES:
            model, opt, _ = runs[(1, update)]
            with as_on_cuda(), HostReads(checked=True) as reads:
                step(model, opt, 0)
            syncs[update] = reads.count
    print(
        f"MLP {args.widths}, batch {args.batch}, {args.threads} thread(s), {args.repeats} repeats"
    )
    for (every, update), (_, _, times) in runs.items():
        ms = [t * 1e3 for t in times]
        what = "refresh every step" if every == 1 else "no refresh"
        extra = f", predicted GPU syncs at a refresh {syncs[update]}" if every == 1 else ""
        print(
            f"  {update:5s} {what:18s} median {statistics.median(ms):8.1f} ms, "
            f"min {min(ms):8.1f} ms{extra}"
        )
    return runs, syncs


if __name__ == "__main__":
    main()
