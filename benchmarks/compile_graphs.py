"""Graphs and graph breaks of a ``torch.compile``'d model trained with the optimizers.

Counts the graphs dynamo hands to the backend (``torch._dynamo.testing.CompileCounter``)
over a few training steps of a 3-layer MLP and a small CNN, without an optimizer and
with ``KFAC`` for each Fisher type, and lists the graph-break reasons dynamo reports
(``torch._dynamo.utils.counters["graph_break"]``).

Run: ``PYTHONPATH=. python benchmarks/compile_graphs.py`` (``--fisher empirical mc``,
``--model mlp cnn``, ``--steps 3``).
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Optional, Tuple

import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import curvature


def mlp() -> nn.Module:
    """A 3-layer MLP on ``[N, 20]`` inputs, 4 classes."""
    return nn.Sequential(
        nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def cnn() -> nn.Module:
    """A small CNN on ``[N, 3, 8, 8]`` inputs, 4 classes."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 4),
    )


MODELS = {"mlp": (mlp, (20,)), "cnn": (cnn, (3, 8, 8))}


def count(
    model_name: str, fisher: Optional[str], steps: int = 3, batch: int = 16
) -> Tuple[int, int, Dict[str, int]]:
    """``(graphs, ops, break reasons)`` of ``steps`` training steps of a compiled model.

    ``fisher=None``: no optimizer (plain SGD on ``.grad``).
    """
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    build, shape = MODELS[model_name]
    model = build()
    backend = CompileCounter()
    compiled = torch.compile(model, backend=backend)
    loss_func = nn.CrossEntropyLoss()
    if fisher is None:
        optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    else:
        kw = {} if fisher == "empirical" else {"loss_func": loss_func}
        optim = curvature.KFAC(compiled, lr=1e-2, damping=1e-3, fisher=fisher, **kw)
    X, y = torch.randn(batch * steps, *shape), torch.randint(0, 4, (batch * steps,))
    for i in range(steps):
        sl = slice(i * batch, (i + 1) * batch)
        optim.zero_grad()
        loss_func(compiled(X[sl]), y[sl]).backward()
        optim.step()
    if fisher is not None:
        assert optim.factors(), "no statistics were collected"
        optim.close()
    return backend.frame_count, backend.op_count, dict(counters["graph_break"])


def short(reason: str) -> str:
    """A break reason on one line: its title and dynamo's debug context."""
    lines = [line.strip() for line in reason.splitlines() if line.strip()]
    context = [line for line in lines if line.startswith("Developer debug context")]
    return " | ".join(lines[:1] + [c.split(":", 1)[1].strip() for c in context][:1])


def main(argv: Optional[List[str]] = None) -> None:
    """Print the counts of each model and Fisher type."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--fisher", nargs="+", default=["none", "empirical", "mc"])
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}")
    for name in args.model:
        for fisher in args.fisher:
            graphs, ops, reasons = count(name, None if fisher == "none" else fisher, args.steps)
            print(f"{name:4s} {fisher:10s} graphs={graphs:3d} ops={ops:4d}")
            for reason, n in reasons.items():
                print(f"    break x{n}: {short(reason)}")


if __name__ == "__main__":
    main()
