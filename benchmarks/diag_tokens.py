"""The type-2 GGN diagonal of a token MLP with a per-token MSE: ``C`` vectors against ``C T``.

    python benchmarks/diag_tokens.py [--sizes 32 256] [--exact-up-to 32] [--device cuda]
                                     [--no-doc]

Workload (issue 17): the token MLP 128-256-128 (Linear, GELU, Linear) on ``[N, 64, 128]``
inputs, ``nn.MSELoss()`` over the ``[N, 64, 128]`` outputs, float32. ``diag_ggn(model,
loss_func, (X, y))`` folds the 64 positions into the samples (the model is position-wise:
:mod:`curvature.positionwise`) and pulls ``C = 128`` vectors; the ``C T`` path (what every
call took before, 8192 vectors per sample, pulled in chunks of ``MAX_SOURCES_NUMEL``
entries) is reached through an ``nn.Sequential`` subclass with the same modules, which the
structural check does not trust. Both results are compared (largest absolute difference
over the largest entry). Time: best of ``--repeats`` calls; peak memory: the process's
peak resident memory over its resident memory before one call (``common.peak_memory_of``),
including the result; on CUDA, ``torch.cuda.max_memory_allocated`` over the allocated
memory before the call. The docs section is written for CPU runs only (a GPU run prints
its table). ``--exact-up-to``: the largest ``N`` for which the ``C T`` path is run
(it costs ``T`` times the backward work).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import curvature  # noqa: E402

T, D, HIDDEN = 64, 128, 256
MB = 2**20

#: Measured once on a GPU machine (the docs section keeps it; a CPU run cannot remeasure it).
GPU_NOTE = (
    "On one NVIDIA H200 (torch 2.11.0+cu130, float32; the C-vector column is the same "
    "computation, `diag_ggn` of commit d9a29bb (before this change) on the batch with its "
    "positions folded, `(X.reshape(-1, 128), y.reshape(-1, 128))`, the C T column that "
    "commit on `(X, y)`; "
    "time: best of 5 calls / one call, peak: `torch.cuda.max_memory_allocated` over the "
    "allocated memory before the call): `[32, 64, 128]` 2.9 ms, 901 MB against 369 ms, "
    "2571 MB (127x); `[256, 64, 128]` 12.7 ms against 4.67 s (367x), 2641 MB both (the "
    "vectors are pulled in chunks of `MAX_SOURCES_NUMEL` entries either way); relative "
    "differences 4.5e-07 and 8.6e-07. A forward+backward of the model takes 0.76 ms and "
    "0.62 ms there, so the C-vector diagonal costs 3.8x and 20x one."
)


class Chain(nn.Sequential):
    """The same modules, not trusted to keep positions apart: the ``C T`` path."""


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(model, loss_func, data, repeats, device):
    best, out = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = curvature.diag_ggn(model, loss_func, data)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        del out
    if device.type != "cuda":
        peak, out, _ = common.peak_memory_of(lambda: curvature.diag_ggn(model, loss_func, data))
        return best, peak, out
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = curvature.diag_ggn(model, loss_func, data)
    _sync(device)
    return best, torch.cuda.max_memory_allocated(device) - before, out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--exact-up-to", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, D)).to(device)
    loss_func = nn.MSELoss()
    rows = []
    for N in args.sizes:
        X, y = torch.randn(N, T, D, device=device), torch.randn(N, T, D, device=device)
        t_c, m_c, d_c = _run(model, loss_func, (X, y), args.repeats, device)
        cells = [f"[{N}, {T}, {D}]", f"{t_c:.3f} s", f"{m_c / MB:.0f} MB"]
        if N <= args.exact_up_to:
            t_ct, m_ct, d_ct = _run(Chain(*model), loss_func, (X, y), 1, device)
            rel = common.max_abs_diff(d_c, d_ct) / common.max_abs(d_ct)
            cells += [
                f"{t_ct:.2f} s",
                f"{m_ct / MB:.0f} MB",
                f"{t_ct / t_c:.0f}x",
                f"{rel:.1e}",
            ]
        else:
            cells += ["not run"] * 3 + ["-"]
        rows.append(cells)
        print(" | ".join(cells), flush=True)
    header = [
        "outputs",
        "C vectors: time",
        "peak",
        "C T vectors (before): time",
        "peak",
        "speed-up",
        "rel. difference",
    ]
    table = common.markdown_table(header, rows)
    print(table)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(device), torch.__version__)
    if args.no_doc or device.type == "cuda":
        return
    command = common.portable_command("benchmarks/diag_tokens.py", sys.argv[1:])
    body = (
        "`diag_ggn(model, nn.MSELoss(), (X, y))` (type-2) on the token MLP 128-256-128 "
        "(Linear, GELU, Linear) over `[N, 64, 128]`, float32: the positions of a "
        "position-wise model are folded into the samples (`curvature.positionwise`), "
        "`C = 128` vectors instead of `C T = 8192` per sample. `C T` (before): the same "
        "modules in an `nn.Sequential` subclass, which the structural check does not trust, "
        "so that call takes the path every call took before. Time: best of "
        f"{args.repeats} calls (the `C T` path: one); peak: resident memory over that "
        "before one call, result included. `rel. difference`: largest absolute difference "
        "of the two diagonals over their largest entry.\n\n"
        f"{table}\n\n`{command}`; {common.machine_line()}; load average "
        f"{os.getloadavg()[0]:.1f} at the end of the run.\n\n{GPU_NOTE}"
    )
    path = os.path.join(common.ROOT, "docs", "benchmarks.md")
    common.update_doc_section(path, "Type-2 diagonal on per-token losses", body)


if __name__ == "__main__":
    main()
