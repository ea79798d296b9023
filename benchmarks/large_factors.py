"""Benchmark: blocks over ``max_factor_size``, one-sided factors against per-sample diagonals.

Two parts (issue 17, item 3):

* ``timing``: a KFAC training step (zero_grad, forward, backward, step; statistics every
  step, refresh every 10, amortized: one measurement is 10 consecutive steps) on a small
  token model (embedding 2000 x 128, two residual MLP blocks 128-512-128 over the tokens,
  head 128 -> 2000; T = 32, batch 16) with ``max_factor_size=1024``, so that the
  embedding (A: 2000) and the head (G: 2000) are over it. ``large_factors=
  "diagonal_factor"`` and ``"per_sample_diagonal"`` run interleaved with AdamW; the
  median and the spread over the repeats are printed (the machine may be busy).
* ``training``: next-byte prediction on the repository's docs/*.md concatenated (a
  window of 3 bytes embedded 256 x 32, MLP 96-128-256), ``max_factor_size=200`` (the
  embedding's A and the head's G, 256 each, over it); loss on a held-out tail of the
  text after a fixed number of steps, per seed: KFAC with each structure and AdamW.

Usage::

    PYTHONPATH=. python benchmarks/large_factors.py timing --repeats 7 [--threads 1 --cpu-time]
    PYTHONPATH=. python benchmarks/large_factors.py training --steps 150 --seeds 0 1
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time
import warnings

import torch
from torch import nn

import curvature

MODES = ("diagonal_factor", "per_sample_diagonal")


class Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class ClassesSecond(nn.Module):
    """``[N, T, C]`` logits as ``[N, C, T]``, the layout of ``nn.CrossEntropyLoss``."""

    def forward(self, x):
        return x.transpose(1, 2)


def token_model(vocab=2000, d=128, hidden=512, blocks=2):
    return nn.Sequential(
        nn.Embedding(vocab, d),
        *[Block(d, hidden) for _ in range(blocks)],
        nn.Linear(d, vocab),
        ClassesSecond(),
    )


CE = nn.CrossEntropyLoss()


def lm_loss(model, X, y):
    return CE(model(X), y)


def make_opt(kind, model, fisher="empirical"):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return curvature.KFAC(
            model,
            lr=1e-2,
            damping=1e-3,
            max_factor_size=1024,
            large_factors=kind,
            fisher=fisher,
            loss_func=CE,
        )


def timing(args):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 2000, (16, 33), generator=g) for _ in range(4)]
    runs = {}
    for kind in (*MODES, "adamw"):
        torch.manual_seed(0)
        model = token_model()
        runs[kind] = (model, make_opt(kind, model, args.fisher))
    times = {k: [] for k in runs}

    clock = time.process_time if args.cpu_time else time.perf_counter

    def ten_steps(kind):
        model, opt = runs[kind]
        start = clock()
        for i in range(10):
            batch = data[i % len(data)]
            opt.zero_grad()
            lm_loss(model, batch[:, :-1], batch[:, 1:]).backward()
            opt.step()
        return (clock() - start) / 10

    for kind in runs:  # warm-up: first statistics and decompositions
        ten_steps(kind)
    for _ in range(args.repeats):
        for kind in runs:
            times[kind].append(ten_steps(kind))
    what = "process CPU time" if args.cpu_time else "wall time"
    print(
        f"fisher={args.fisher} threads={torch.get_num_threads()} repeats={args.repeats} "
        f"(10 steps each), {what}"
    )
    base = statistics.median(times["adamw"])
    for kind, ts in times.items():
        med = statistics.median(ts)
        print(
            f"{kind:22s} median {1e3 * med:8.1f} ms/step  (min {1e3 * min(ts):.1f}, "
            f"max {1e3 * max(ts):.1f})  {med / base:5.1f}x AdamW"
        )


def text_data():
    root = pathlib.Path(__file__).resolve().parents[1] / "docs"
    raw = b"".join(p.read_bytes() for p in sorted(root.glob("*.md")))
    return torch.tensor(list(raw), dtype=torch.long)


def byte_model(window=3, d=32, hidden=128):
    return nn.Sequential(
        nn.Embedding(256, d),
        nn.Flatten(),
        nn.Linear(window * d, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 256),
    )


def windows(text, starts, window=3):
    ix = starts[:, None] + torch.arange(window + 1)
    chunk = text[ix]
    return chunk[:, :window], chunk[:, window]


def training(args):
    text = text_data()
    split = int(0.9 * len(text))
    train, held = text[:split], text[split:]
    eval_X, eval_y = windows(held, torch.arange(0, len(held) - 4, 7))
    print(f"bytes: train {len(train)}, held-out {len(held)} ({len(eval_y)} windows)")
    for seed in args.seeds:
        row = {}
        for kind in (*MODES, "adamw"):
            torch.manual_seed(seed)
            model = byte_model()
            if kind == "adamw":
                opt = torch.optim.AdamW(model.parameters(), lr=args.adam_lr)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    opt = curvature.KFAC(
                        model,
                        lr=args.lr,
                        damping=args.damping,
                        max_factor_size=200,
                        large_factors=kind,
                    )
            g = torch.Generator().manual_seed(seed)
            start = time.perf_counter()
            for _ in range(args.steps):
                X, y = windows(train, torch.randint(0, len(train) - 4, (args.batch,), generator=g))
                opt.zero_grad()
                nn.functional.cross_entropy(model(X), y).backward()
                opt.step()
            elapsed = time.perf_counter() - start
            with torch.no_grad():
                row[kind] = nn.functional.cross_entropy(model(eval_X), eval_y).item()
            row[kind + " s"] = elapsed
        print(
            f"seed {seed}: held-out loss after {args.steps} steps: "
            + ", ".join(f"{k} {row[k]:.4f} ({row[k + ' s']:.1f} s)" for k in (*MODES, "adamw"))
        )


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=["timing", "training"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--damping", type=float, default=1e-2)
    p.add_argument("--adam-lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--fisher", default="empirical", help="KFAC's fisher (timing)")
    p.add_argument("--cpu-time", action="store_true", help="time.process_time (busy machine)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    timing(args) if args.part == "timing" else training(args)


if __name__ == "__main__":
    main()
