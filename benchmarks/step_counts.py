"""Host synchronizations and aten calls per optimizer step, counted on CPU.

    python benchmarks/step_counts.py [--no-doc]
    python benchmarks/step_counts.py --gpu-shapes   # refresh syncs at gpu.py's shapes

On a GPU every host read of a device value (``item``, ``tolist``, ``bool(t)``,
``float(t)``, ``.cpu()``, ``nonzero``, ...) stalls the pipeline and every aten call is a
kernel launch; both are counted here on CPU, the reads with a ``TorchFunctionMode`` and
the aten calls with a ``TorchDispatchMode`` (the method of issue 17 and of
tests/test_optim_syncs.py). Workload: MLP 784-512-256-10 at batch 128, a training step
is ``zero_grad``, forward, loss, backward, ``step``; the aten calls are compared with
``torch.optim.AdamW(foreach=True)`` on the same model.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
import warnings
from collections import Counter
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import curvature  # noqa: E402

READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.__bool__,
    Tensor.__int__,
    Tensor.__float__,
    Tensor.__index__,
    Tensor.cpu,
    Tensor.numpy,
    Tensor.nonzero,
    torch.nonzero,
    torch.equal,
    Tensor.equal,
    torch.unique,
    Tensor.unique,
    torch.masked_select,
}


#: ``torch.linalg`` calls that read their error codes on the host on a GPU (a
#: synchronization each there; none on a CPU): counted by ``HostReads(checked=True)``.
CHECKED = {torch.linalg.eigh}


class HostReads(TorchFunctionMode):
    """Counts host reads of tensor values (a synchronization each on a GPU).

    Besides the calls in :data:`READS`: indexing with a boolean mask (a ``nonzero`` on
    the host) and ``repeat_interleave`` with tensor repeats and no ``output_size``; with
    ``checked=True`` also the calls of :data:`CHECKED` (which synchronize on a GPU only:
    with :func:`as_on_cuda`, the count a GPU would see). ``where`` counts them by call
    site in ``curvature`` (the last three frames).
    """

    def __init__(self, checked: bool = False):
        super().__init__()
        self.count = 0
        self.where: Counter = Counter()
        self.checked = checked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        read = func in READS or (self.checked and func in CHECKED)
        name = getattr(func, "__name__", "")
        if name == "__getitem__":  # a boolean mask index: nonzero on the host
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            read = any(isinstance(i, Tensor) and i.dtype == torch.bool for i in idx)
        if name == "repeat_interleave":  # tensor repeats without output_size
            read = isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), Tensor)
            read = read and kwargs.get("output_size") is None
        if read:
            self.count += 1
            frames = [f for f in traceback.extract_stack()[:-1] if "curvature" in f.filename]
            self.where[f"{name} at " + " < ".join(f"{f.name}:{f.lineno}" for f in frames[-3:])] += 1
        return func(*args, **kwargs)


@contextmanager
def as_on_cuda():
    """Run the decompositions of a CPU run as on CUDA, so that ``HostReads(checked=True)``
    counts the synchronizations a GPU would see: eigendecompositions grouped (padded
    sizes in one call: ``curvature.linalg.PAD_EIGH_DEVICES``), Cholesky inverses in new
    memory (not written over the previous ones: ``COLUMN_MAJOR_CHOLESKY_DEVICES``, which
    costs a CPU refresh without a snapshot one more host read, no synchronization)."""
    linalg = importlib.import_module("curvature.linalg")
    devices, in_place = linalg.PAD_EIGH_DEVICES, linalg.COLUMN_MAJOR_CHOLESKY_DEVICES
    linalg.PAD_EIGH_DEVICES = (*devices, "cpu")
    linalg.COLUMN_MAJOR_CHOLESKY_DEVICES = tuple(d for d in in_place if d != "cpu")
    try:
        yield
    finally:
        linalg.PAD_EIGH_DEVICES = devices
        linalg.COLUMN_MAJOR_CHOLESKY_DEVICES = in_place


class AtenCalls(TorchDispatchMode):
    """Counts aten calls (a kernel launch each, roughly, on a GPU)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


CE = nn.CrossEntropyLoss()


def optimizers(inverse_every):
    kw = dict(lr=1e-3, loss_func=CE, inverse_every=inverse_every)
    yield "AdamW (foreach)", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
    yield "KFAC empirical", lambda m: curvature.KFAC(m, **kw)
    yield "KFAC mc", lambda m: curvature.KFAC(m, fisher="mc", **kw)
    yield (
        "KFAC empirical, kl_clip, momentum, wd",
        lambda m: curvature.KFAC(m, kl_clip=1e-3, momentum=0.9, weight_decay=1e-2, **kw),
    )
    yield "EKFAC empirical", lambda m: curvature.EKFAC(m, **kw)
    yield (
        "EKFAC empirical, eigenbasis_update=eigh",
        lambda m: curvature.EKFAC(m, eigenbasis_update="eigh", **kw),
    )
    yield "DiagonalNG empirical", lambda m: curvature.DiagonalNaturalGradient(m, **kw)


def per_step(make, mode, steps, scaled=False):
    """Counts per training step of the MLP (``mode``: a counter); ``scaled``: the AMP loop
    under a CPU ``GradScaler`` (scale 2^16), built as ``make(model, scaler)``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if scaled else None
    opt = make(model, scaler) if scaled else make(model)
    X, y = torch.randn(128, 784), torch.randint(0, 10, (128,))

    def step():
        opt.zero_grad()
        loss = CE(model(X), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            step()
        with mode() as counter:
            for _ in range(steps):
                step()
    return counter.count / steps


def scaled_reads(steps: int = 3) -> dict:
    """Host reads per step of the MLP under a ``torch.amp.GradScaler`` (CPU scaler, a
    scale of 2^16): AdamW (foreach) and KFAC empirical with the scaler given as
    ``grad_scaler=`` or not (:mod:`curvature.optim.amp`)."""
    makers = {
        "AdamW (foreach)": lambda m, sc: torch.optim.AdamW(m.parameters(), foreach=True),
        "KFAC empirical, scaler given": lambda m, sc: curvature.KFAC(
            m, loss_func=CE, inverse_every=1000, grad_scaler=sc
        ),
        "KFAC empirical, scaler not given": lambda m, sc: curvature.KFAC(
            m, loss_func=CE, inverse_every=1000
        ),
    }
    return {name: per_step(make, HostReads, steps, scaled=True) for name, make in makers.items()}


#: ``(row name, class, options)`` of :func:`gpu_shapes_refresh`
REFRESH_OPTIMIZERS = [
    ("KFAC", curvature.KFAC, {}),
    ("EKFAC", curvature.EKFAC, {}),
    ("EKFAC (eigh)", curvature.EKFAC, {"eigenbasis_update": "eigh"}),
    ("DiagonalNaturalGradient", curvature.DiagonalNaturalGradient, {}),
]


def gpu_shapes_refresh() -> list:
    """Predicted GPU synchronizations of a refresh on ``benchmarks/gpu.py``'s workloads
    (MLP 784-2048-2048-10, the VGG-like CNN, the transformer LM at their GPU shapes; batch
    2-8 on the CPU: the counts do not depend on it): the second of two ``inverse_every=1``
    steps, ``HostReads(checked=True)`` inside :func:`as_on_cuda`. Rows ``[workload,
    optimizer, count, where]``.
    """
    import gpu

    rows = []
    for key, _, make, X, y, loss_func in gpu.step_workloads("full"):
        n = 8 if key == "mlp" else 2
        X, y = X[:n], y[: n * X.shape[1]] if key == "lm" else y[:n]
        for name, cls, kw in REFRESH_OPTIMIZERS:
            torch.manual_seed(0)
            model = make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt = cls(model, loss_func=loss_func, inverse_every=1, **kw)
                for _ in range(2):
                    with as_on_cuda(), HostReads(checked=True) as reads:
                        opt.zero_grad()
                        loss_func(model(X), y).backward()
                        opt.step()
            rows.append([key, name, reads.count, dict(reads.where)])
            print(*rows[-1][:3], flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument(
        "--gpu-shapes",
        action="store_true",
        help="only print the predicted GPU synchronizations of a refresh on gpu.py's workloads",
    )
    args = parser.parse_args(argv)
    if args.gpu_shapes:
        gpu_shapes_refresh()
        return
    rows, base = [], None
    for (name, make), (_, refreshing) in zip(optimizers(1000), optimizers(1)):
        calls = per_step(make, AtenCalls, 3)
        base = base or calls
        reads = per_step(make, HostReads, 3)
        refresh = per_step(refreshing, HostReads, 3)
        with as_on_cuda():
            gpu = per_step(refreshing, lambda: HostReads(checked=True), 3)
        gpu = f"{gpu:g}" if name != "AdamW (foreach)" else "0"
        row = [name, f"{reads:g}", f"{refresh:g}", gpu, f"{calls:g}", f"{calls / base:.2f}x"]
        rows.append(row)
        print(" | ".join(rows[-1]), flush=True)
    X, y = torch.randn(128, 784), torch.randint(0, 10, (128,))
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    with HostReads() as kfac_reads:
        curvature.kfac(model, CE, (X, y))
    header = [
        "optimizer",
        "host reads / step",
        "at a refresh",
        "GPU syncs at a refresh (predicted)",
        "aten calls / step",
        "x AdamW",
    ]
    table = common.markdown_table(header, rows)
    scaled = scaled_reads()
    print(scaled)
    scaled_text = ", ".join(f"{k} {v:g}" for k, v in scaled.items())
    targets = {"KFAC empirical": 1.5, "KFAC mc": 1.8, "EKFAC empirical": 2.0}
    targets["DiagonalNG empirical"] = 1.3
    ratios = {r[0]: float(r[5].rstrip("x")) for r in rows}
    verdicts = "; ".join(
        f"{k} {ratios[k]:.2f}x against {t}x: {'met' if ratios[k] <= t else 'not met'}"
        for k, t in targets.items()
    )
    body = (
        "Generated by `benchmarks/step_counts.py`. Command: `python benchmarks/step_counts.py` "
        f"({time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}).\n\n"
        "Counted on CPU, where they are exact and need no GPU: host reads of device values "
        "(`item`, `tolist`, `bool`, `float`, `int`, `cpu`, `numpy`, `nonzero`, `equal`; "
        "each one a synchronization on a GPU) with a `TorchFunctionMode`, and aten calls "
        "(each one roughly a kernel launch on a GPU) with a `TorchDispatchMode`, per "
        "training step (zero_grad, forward, loss, backward, step) of an MLP "
        "784-512-256-10 at batch 128, steps without a refresh (`inverse_every=1000`) and "
        "refresh steps (`inverse_every=1`). The predicted GPU synchronizations at a refresh "
        "add the calls that read their error codes on the host on a GPU only "
        "(`torch.linalg.eigh`: one per batched call), with the decompositions grouped "
        "as on CUDA (`curvature.linalg.PAD_EIGH_DEVICES`); AdamW's step counters are host "
        "values there (0). Issue 17's targets: no host read without a "
        "refresh, at most 2 at a refresh and per `curvature.kfac()` call (here: "
        f"{kfac_reads.count}); aten calls at most 1.5x (KFAC empirical), 1.8x (KFAC mc), "
        "2x (EKFAC), 1.3x (DiagonalNG) AdamW's. tests/test_optim_syncs.py fails above the "
        "read targets and above the aten-call targets, or above today's count where a "
        "target is not met. AdamW's reads are of its step counters, "
        "which torch keeps on the host (no synchronization on a GPU); ours would all be "
        "device reads. No GPU timing is implied.\n\n"
        + table
        + f"\n\nAten-call targets: {verdicts}.\n\n"
        "Under a `torch.amp.GradScaler` (`scaler.scale(loss).backward(); scaler.step(optim); "
        "scaler.update()`, steps without a refresh), host reads per step: "
        f"{scaled_text}. The one read of the KFAC rows is the scaler's inf check, made "
        "by `scaler.step` (as for AdamW) when the scaler is given, by KFAC's `step()` when "
        "it is not (`curvature.optim.amp`); AdamW's further reads are its host step "
        "counters.\n"
    )
    print(table)
    if not args.no_doc:
        common.update_doc_section(
            "docs/benchmarks.md", "Host synchronizations and kernel counts", body
        )


if __name__ == "__main__":
    main()
