"""Benchmark: input Laplacians (forward Laplacian, nested autograd, Hutchinson).

MLP ``16 -> 64 -> 64 -> 1`` (tanh), ``N = 256``, float32. Each method is timed as a ratio
to a plain forward+backward w.r.t. the parameters of the same model on the same batch
(alternating, median of per-repeat ratios, :class:`common.QuietGate` before each
baseline; see ``benchmarks/common.py``), alone and followed by the parameter gradient
of a loss on the Laplacian (a PINN step).

    python benchmarks/laplacian.py                  # 15 repeats, updates docs/benchmarks.md
    python benchmarks/laplacian.py --quick --json out.json   # 5 repeats, docs untouched

Targets (shared/PERFORMANCE.md: nested autograd about 10x, a forward Laplacian about 4x):
``method="forward"`` at most 4x a forward+backward, ``method="autograd"`` at most 10x.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

import curvature  # noqa: E402
from curvature.laplacian import laplacian  # noqa: E402

DOC_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "benchmarks.md")
DOC_TITLE = "Input Laplacians"
METHODS = ("forward", "autograd", "hutchinson")
WHAT = {False: "Laplacian", True: "Laplacian + parameter gradient"}
TARGETS = {"forward": 4.0, "autograd": 10.0}  # x fwd+bwd, Laplacian alone
WORKLOAD = "MLP 16-64-64-1 tanh, N=256, d=16, float32"


def make_problem(d: int = 16, n: int = 256, seed: int = 0):
    """The model, the batch and its parameters."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(d, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1)
    )
    return model, torch.randn(n, d), list(model.parameters())


def targets(results: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Forward Laplacian <= 4x and nested autograd <= 10x a forward+backward."""
    out = []
    for name, limit in TARGETS.items():
        r = results["Laplacian"].get(name)
        if r is None:
            continue
        out.append(
            {
                "target": f"{name} Laplacian <= {limit:g}x fwd+bwd",
                "met": r["ratio"] <= limit,
                "detail": f"{r['ratio']:.2f}x",
                "unreliable": bool(r.get("disturbed")),
            }
        )
    return out


def table(results: Dict[str, Any]) -> str:
    """Markdown: one row per quantity, one column per method."""
    header = ["quantity", *(f'`"{m}"`' for m in METHODS)]
    rows = []
    for what in WHAT.values():
        cells = []
        for m in METHODS:
            r = results[what].get(m)
            cells.append(
                "-" if r is None else f"{r['ratio']:.2f}x" + (" †" if r.get("disturbed") else "")
            )
        rows.append([what, *cells])
    return common.markdown_table(header, rows)


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """Run the comparisons, print the table, write JSON / the docs section."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 repeats, docs untouched")
    parser.add_argument("--repeats", type=int, default=None, help="15 (full) / 5 (--quick)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--no-doc", action="store_true", help="never touch the docs")
    parser.add_argument("--doc", metavar="PATH", default=None, help="Markdown file to update")
    parser.add_argument("--no-wait", action="store_true", help="never wait for a quiet CPU")
    args = parser.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 15)
    start = time.time()
    d = 16
    model, x, params = make_problem(d)

    def baseline():  # a plain forward + backward w.r.t. the parameters
        torch.autograd.grad(model(x).sum(), params)

    def method(name: str, backward: bool):
        kw = {"num_samples": d} if name == "hutchinson" else {}

        def fn():
            lap = laplacian(model, x, method=name, **kw)
            if backward:  # a PINN step: the parameter gradient of a loss on the Laplacian
                torch.autograd.grad(lap.square().mean(), params, allow_unused=True)

        return fn

    info = common.machine_info()
    print(common.machine_line(info))
    for _ in range(10 if args.quick else 50):  # warm up (the first comparison is distorted)
        baseline(), method("forward", True)(), method("autograd", True)()
    gate = common.QuietGate(max_wait=2.0, budget=20.0) if args.quick else common.QuietGate()
    if args.no_wait:
        gate = common.QuietGate(max_wait=0.0, budget=0.0)
    results: Dict[str, Any] = {what: {} for what in WHAT.values()}
    for backward, what in WHAT.items():
        for name in METHODS:
            r = common.compare(
                baseline, method(name, backward), repeats=repeats, min_time=0.05, gate=gate
            )
            r.pop("ratios", None), r.pop("baseline_times", None)
            results[what][name] = r
            print(f"{what:32s} {name:11s} {r['ratio']:6.2f}x", flush=True)
    command = common.portable_command(
        "benchmarks/laplacian.py", sys.argv[1:] if argv is None else argv
    )
    data = {
        "command": command,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "elapsed_s": time.time() - start,
        "machine": info,
        "versions": {"curvature": curvature.__version__},
        "workload": WORKLOAD,
        "repeats": repeats,
        "quiet_gate": gate.summary(),
        "results": results,
        "targets": targets(results),
    }
    text = table(results)
    print("\n" + text + "\n")
    for t in data["targets"]:
        print(f"- {t['target']}: {'met' if t['met'] else 'NOT MET'} ({t['detail']})")
    if args.json:
        common.write_json(args.json, data)
        print(f"wrote {args.json}")
    if not args.no_doc and (args.doc or not args.quick):
        path = args.doc or DOC_PATH
        g = data["quiet_gate"]
        body = (
            f"Generated by `benchmarks/laplacian.py`. Command: `{data['command']}` "
            f"({data['date']}, {data['elapsed_s']:.0f} s). Machine: "
            f"{common.machine_line(info)}. {g['started_under_load']} of {g['measurements']} "
            "measurements started under load.\n\n"
            f"{WORKLOAD}: `curvature.laplacian(model, x, method=...)` as a ratio to a plain "
            "forward+backward w.r.t. the parameters (median of per-repeat ratios, "
            f'{repeats} repeats, alternating); `"hutchinson"` with K = d = 16 probes; the '
            "second row adds the parameter gradient of a loss on the Laplacian (a PINN step). "
            '`"autograd"` is nested autograd (what a user writes with `torch.autograd.grad`). '
            "† unreliable (spread over 30% or disturbed baselines).\n\n"
            + text
            + "\n\nTargets (shared/PERFORMANCE.md: nested autograd about 10x, a forward "
            "Laplacian about 4x):\n\n"
            + "\n".join(
                f"- {t['target']}: {'met' if t['met'] else '**not met**'} ({t['detail']})"
                for t in data["targets"]
            )
        )
        common.update_doc_section(path, DOC_TITLE, body)
        print(f"updated section '{DOC_TITLE}' of {os.path.normpath(path)}")
    return data


if __name__ == "__main__":
    main()
