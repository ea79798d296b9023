"""Live tensor bytes of an optimizer step, counted on CPU: the peak and what stays alive.

    python benchmarks/step_memory.py [--no-doc]

A GPU's peak memory is the peak of the bytes its live tensors hold (plus allocator
slack); on CPU the same quantity is counted exactly, without a GPU, by
:class:`LiveBytes`: a ``TorchDispatchMode`` that registers the storage of every tensor an
aten call allocates, with a ``weakref.finalize`` that subtracts its bytes when the
storage is freed (torch keeps one Python object per storage, so the finalizer runs when
the memory goes). The mode is on from the model's construction, so everything of the
workload is counted and nothing else of the process. Workloads: MLP 784-512-256-10 at
batch 128, a small CNN (two 3x3 convolutions, 16 and 32 channels, on 3x32x32, batch
64) and the GPU benchmark's transformer LM at a CPU size (d=64, 2 layers, T=32,
vocabulary 1024, batch 8, ``max_factor_size=512`` so that its head is a one-sided block
as at the GPU size); a training step is ``zero_grad``, forward,
loss, backward, ``step``, measured after two warm-up steps, without a refresh
(``inverse_every=1000``) and at a refresh (``inverse_every=1``).

Counted per optimizer: the peak of the step (everything alive: model, data, gradients,
optimizer state, temporaries), the same over AdamW's (``foreach=True``) on the same
model, the bytes of the curvature state (:func:`state_bytes`: Kronecker factors,
inverses or eigenbases, diagonals; 0 for AdamW), issue 17's budget ``AdamW's peak + 3x
the state``, and ``kept``: the bytes allocated during the step that are still alive after
it besides the parameters' ``.grad`` (statistics buffers allocated once and nothing kept
that the next step does not need: 0).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402

import curvature  # noqa: E402

MB = 2**20
CE = nn.CrossEntropyLoss()


def _storage(t: Tensor):
    """The untyped storage of a dense tensor, or ``None`` (sparse, meta, nested...)."""
    if not isinstance(t, Tensor) or t.is_meta or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages allocated while the mode is on and alive: ``current``.

    Every storage an aten call returns that the mode has not seen is an allocation made
    inside it: its bytes are added to :attr:`current` and subtracted by a
    ``weakref.finalize`` when torch frees it (torch keeps one Python object per storage,
    so the finalizer runs when the memory goes). Storages first seen as inputs existed
    before the mode (or came from outside the dispatcher) and are not counted, also when
    written in place. :attr:`peak` is the largest :attr:`current` since the start or the
    last :meth:`mark`.

    Args:
        on_alloc: Optional callback ``(func, tensor)`` for every output of an aten call
            whose storage is new (an allocation; e.g. to flag per-sample sizes).

    """

    def __init__(self, on_alloc: Optional[Callable[[Any, Tensor], None]] = None):
        super().__init__()
        self.current = 0
        self.peak = 0
        self.on_alloc = on_alloc
        self._sizes: Dict[int, Optional[int]] = {}  # key -> bytes (None: not counted)
        self._alive: Dict[int, Any] = {}  # counted key -> weakref to the storage
        self._marked: Set[int] = set()
        self._finalizers: List[Any] = []

    def _add(self, st, counted: bool) -> bool:
        """Register a storage; whether it was unknown."""
        key = st._cdata
        if key not in self._sizes:
            self._sizes[key] = st.nbytes() if counted else None
            self._finalizers.append(weakref.finalize(st, self._free, key))
            if counted:
                self.current += st.nbytes()
                self._alive[key] = weakref.ref(st)
                self.peak = max(self.peak, self.current)
            return True
        old = self._sizes[key]
        if old is not None and old != st.nbytes():  # resized in place (an out= of a new shape)
            self._sizes[key] = st.nbytes()
            self.current += st.nbytes() - old
            self.peak = max(self.peak, self.current)
        return False

    def _free(self, key: int) -> None:
        self.current -= self._sizes.pop(key, None) or 0
        self._alive.pop(key, None)
        self._marked.discard(key)  # (a later storage may get the same address)

    def mark(self) -> int:
        """Start a new peak here and remember what is alive (:meth:`alive_since_mark`).

        Returns:
            :attr:`current`, the bytes alive at the mark.

        """
        gc.collect()
        self.peak = self.current
        self._marked = set(self._alive)
        return self.current

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for f in self._finalizers:
            f.detach()
        self._finalizers = []
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_flatten((args, kwargs))[0]:
            st = _storage(t) if isinstance(t, Tensor) else None
            if st is not None:
                self._add(st, counted=False)  # an unseen input: from before the mode
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            st = _storage(t) if isinstance(t, Tensor) else None
            if st is not None and self._add(st, counted=True) and self.on_alloc is not None:
                self.on_alloc(func, t)
        return out

    def alive_since_mark(self, exclude: Iterable[Tensor] = ()) -> int:
        """Bytes allocated after the last :meth:`mark` and alive now, less ``exclude``'s."""
        gc.collect()
        skip: Set[int] = {st._cdata for st in map(_storage, exclude) if st is not None}
        alive = [k for k, ref in list(self._alive.items()) if ref() is not None]
        return sum(self._sizes[k] or 0 for k in alive if k not in skip | self._marked)


def state_bytes(opt) -> int:
    """Bytes of the distinct tensor storages in ``opt.state_dict()`` besides the step counts.

    For the curvature optimizers: the running factors, inverses or eigenbases and
    eigenvalues, diagonals, momentum (the curvature state); for torch optimizers their
    moment buffers.
    """
    seen: Dict[int, int] = {}
    for t in tree_flatten(opt.state_dict())[0]:
        st = _storage(t) if isinstance(t, Tensor) else None
        if st is not None and t.numel() > 1:
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def curvature_bytes(opt) -> int:
    """Bytes of the curvature state alone: factors, inverses, eigenbases, diagonals.

    ``blocks`` of a curvature optimizer, every tensor attribute of each block (distinct
    storages); 0 for a torch optimizer.
    """
    blocks = getattr(opt, "blocks", None)
    if not blocks:
        return 0
    seen: Dict[int, int] = {}
    for b in blocks.values():
        for t in tree_flatten(vars(b))[0]:
            st = _storage(t) if isinstance(t, Tensor) else None
            if st is not None and t.numel() > 1:
                seen[st._cdata] = st.nbytes()
    return sum(seen.values())


# -- workloads -------------------------------------------------------------------------------
def mlp() -> nn.Module:
    """MLP 784-512-256-10 (issue 17's workload)."""
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def cnn() -> nn.Module:
    """Two 3x3 convolutions (16, 32 channels) with pooling, a linear head, on 3x32x32."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 10),
    )


def lm() -> nn.Module:
    """benchmarks/gpu.py's transformer LM at a CPU size: d=64, 2 layers, 2 heads, T=32,
    vocabulary 1024; logits ``[N T, V]``, one row per token."""
    from gpu import LM  # (gpu.py imports this module)

    return LM(LM_VOCAB, 64, 2, heads=2, context=LM_T)


def vgg() -> nn.Module:
    """benchmarks/gpu.py's VGG-like CNN (64-128-256 channels, 3x32x32) at its GPU batch."""
    from gpu import vgg as gpu_vgg  # (gpu.py imports this module)

    return gpu_vgg()


LM_VOCAB, LM_T = 1024, 32

#: name to (model, input shape, batch size); the LM's inputs are tokens ``[N, T]``
WORKLOADS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...], int]] = {
    "mlp": (mlp, (784,), 128),
    "cnn": (cnn, (3, 32, 32), 64),
    "lm": (lm, (LM_T,), 8),
}

#: Workloads measured on request only (``--workloads``), not in the generated table:
#: the GPU benchmark's VGG at its GPU batch (about 30 s per optimizer and mode here).
EXTRA_WORKLOADS: Dict[str, Tuple[Callable[[], nn.Module], Tuple[int, ...], int]] = {
    "vgg": (vgg, (3, 32, 32), 256),
}

#: Optimizer options per workload: the LM's head (``G`` of 1024) over ``max_factor_size``
#: like the GPU workload's (vocabulary 8192 over the default 4096): a one-sided block.
OPTIONS: Dict[str, Dict[str, Any]] = {"lm": {"max_factor_size": 512}}


def batch(workload: str) -> Tuple[Tensor, Tensor]:
    """``(X, y)`` of a workload (after ``torch.manual_seed``): inputs and class labels."""
    _, shape, N = {**WORKLOADS, **EXTRA_WORKLOADS}[workload]
    if workload == "lm":
        tokens = torch.randint(0, LM_VOCAB, (N, shape[0] + 1))
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)
    return torch.randn(N, *shape), torch.randint(0, 10, (N,))


def optimizers(inverse_every: int, workload: str = "mlp"):
    """``(name, factory)`` of the compared optimizers (AdamW first)."""
    kw = dict(lr=1e-3, loss_func=CE, inverse_every=inverse_every)
    kron = dict(kw, **OPTIONS.get(workload, {}))  # (KFAC's and EKFAC's options)
    yield "AdamW (foreach)", lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, foreach=True)
    yield "KFAC empirical", lambda m: curvature.KFAC(m, **kron)
    yield "KFAC mc", lambda m: curvature.KFAC(m, fisher="mc", **kron)
    yield "EKFAC empirical", lambda m: curvature.EKFAC(m, **kron)
    yield "DiagonalNG empirical", lambda m: curvature.DiagonalNaturalGradient(m, **kw)


def measure(
    make: Callable[[nn.Module], Any],
    workload: str = "mlp",
    on_alloc: Optional[Callable[[Any, Tensor], None]] = None,
    warmup: int = 2,
) -> Dict[str, int]:
    """Live tensor bytes of one training step after ``warmup`` steps.

    Returns:
        ``peak`` (bytes alive at the step's peak: the model, data, gradients, state,
        temporaries, all allocated since the model was built), ``base`` (alive before
        the step), ``kept`` (allocated
        during the step, alive after it, besides the parameters' ``.grad``),
        ``state`` (:func:`state_bytes`), ``curvature`` (:func:`curvature_bytes`),
        ``params`` (the parameters' bytes).

    """
    build = {**WORKLOADS, **EXTRA_WORKLOADS}[workload][0]
    with warnings.catch_warnings(), LiveBytes() as live:
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        model = build()
        opt = make(model)
        X, y = batch(workload)

        def step():
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()

        for _ in range(warmup):
            step()
        base = live.mark()
        live.on_alloc = on_alloc
        step()
        live.on_alloc = None
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        kept = live.alive_since_mark(grads)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "peak": live.peak,
        "base": base,
        "kept": kept,
        "state": state_bytes(opt),
        "curvature": curvature_bytes(opt),
        "params": params,
    }


def measure_fresh(name: str, workload: str, inverse_every: int) -> Dict[str, int]:
    """:func:`measure` of optimizer ``name`` in a fresh process (no caches of earlier runs)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import step_memory as s; "
        "m = dict(s.optimizers(int(sys.argv[4]), sys.argv[3]))[sys.argv[2]]; "
        "print(json.dumps(s.measure(m, sys.argv[3])))"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([common.ROOT, os.environ.get("PYTHONPATH", "")])
    )
    argv = [sys.executable, "-c", code, here, name, workload, str(inverse_every)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def rows(workload: str, inverse_every: int) -> List[List[str]]:
    """One table row per optimizer on ``workload``, each measured in a fresh process."""
    out, adam = [], None
    for name, _ in optimizers(inverse_every, workload):
        m = measure_fresh(name, workload, inverse_every)
        adam = adam or m["peak"]
        budget = adam + 3 * m["curvature"]
        out.append(
            [
                name,
                f"{m['peak'] / MB:.2f}",
                f"{m['peak'] / adam:.2f}x",
                f"{m['curvature'] / MB:.2f}",
                f"{budget / MB:.2f}",
                "yes" if m["peak"] <= budget else "no",
                f"{m['kept'] / MB:.3f}",
            ]
        )
        print(workload, inverse_every, " | ".join(out[-1]), flush=True)
    return out


#: The same measurement before issue 17's memory work (commit d14bbf9, same command):
#: peak MB (x AdamW), kept after step MB; AdamW's peak 10.60 MB (MLP), 14.12 MB (CNN).
BEFORE_ROWS = [
    ["KFAC empirical", "52.61 (4.96x), 0.625", "62.74 (5.92x), 10.339"]
    + ["106.13 (7.52x), 7.000", "165.50 (11.72x), 39.208"],
    ["KFAC mc", "50.98 (4.81x), 0.000", "61.11 (5.76x), 9.714"]
    + ["99.16 (7.02x), 0.000", "146.99 (10.41x), 32.208"],
    ["EKFAC empirical", "56.20 (5.30x), 0.625", "63.40 (5.98x), 7.535"]
    + ["94.83 (6.72x), 7.000", "133.61 (9.46x), 23.210"],
    ["DiagonalNG empirical", "41.36 (3.90x), 0.625", "41.36 (3.90x), 0.625"]
    + ["42.17 (2.99x), 7.000", "42.17 (2.99x), 7.000"],
]
BEFORE = (
    "Before the memory work (commit d14bbf9, same command; peak MB (x AdamW), kept after "
    "step MB):\n\n"
    + common.markdown_table(
        ["optimizer", "mlp", "mlp, refresh", "cnn", "cnn, refresh"], BEFORE_ROWS
    )
    + "\n\nKFAC mc before its curvature backward kept less (commit 5fa16e5, same command; "
    "peak MB without / with a refresh): mlp 46.63 / 47.15, cnn 99.25 / 99.25, lm 25.51 / "
    "25.51 (not within 24.08)."
)

HEADER = [
    "optimizer",
    "peak MB",
    "x AdamW",
    "curvature state MB",
    "AdamW + 3x state MB",
    "within",
    "kept after step MB",
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-doc", action="store_true")
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"comma-separated, of {', '.join([*WORKLOADS, *EXTRA_WORKLOADS])} (the "
        "docs' table: the default; another choice implies --no-doc)",
    )
    args = parser.parse_args(argv)
    chosen = args.workloads.split(",")
    known = {**WORKLOADS, **EXTRA_WORKLOADS}
    for w in chosen:
        if w not in known:
            parser.error(f"unknown workload {w!r}; choose from {', '.join(known)}")
    if chosen != list(WORKLOADS):
        args.no_doc = True
    tables = []
    for workload in chosen:
        _, shape, N = known[workload]
        for every, what in ((1000, "no refresh"), (1, "a refresh step")):
            title = f"{workload} (batch {N}, input {list(shape)}), {what}"
            tables.append(f"{title}:\n\n" + common.markdown_table(HEADER, rows(workload, every)))
    body = (
        "Generated by `benchmarks/step_memory.py`. Command: `python benchmarks/step_memory.py` "
        f"({time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}).\n\n"
        "Live tensor bytes of one training step (zero_grad, forward, loss, backward, step) "
        "after two warm-up steps, counted exactly on CPU by a `TorchDispatchMode` on from "
        "the model's construction that registers the storage of every aten call's new "
        "output with a `weakref.finalize` that subtracts its bytes when freed. "
        "`peak`: all live tensors at the step's peak (model, data, gradients, optimizer "
        "state, temporaries); `curvature state`: the blocks' tensors (factors, inverses, "
        "eigenbases, diagonals); issue 17's GPU target is a peak within AdamW's + 3x the "
        "factors and inverses, here checked on the CPU count (`within`); GPU memory: "
        "measured on an H100 for larger workloads, see [GPU](#gpu). `kept after step`: "
        "bytes allocated during the step and alive after it "
        "besides the parameters' `.grad` (0: statistics buffers allocated once, nothing kept "
        "that the next step does not need); tests/test_optim_memory.py checks it and the "
        "absence of `[N, *p.shape]` per-sample tensors in the step. A refresh step replaces "
        "the inverses (KFAC; on a CPU written over the previous ones) or eigenbases "
        "(EKFAC) with new tensors: that is its `kept`. "
        "`python benchmarks/step_memory.py --workloads vgg` measures benchmarks/gpu.py's "
        "VGG at batch 256 (not in this table). Workload `lm`: benchmarks/gpu.py's "
        "transformer LM at a CPU size (d=64, "
        "2 layers, T=32, vocabulary 1024, tokens `[8, 32]`), `max_factor_size=512` for KFAC "
        "and EKFAC so that its head is a one-sided block as at the GPU size.\n\n"
        + "\n\n".join(tables)
        + "\n\n"
        + BEFORE
    )
    print(body)
    if not args.no_doc:
        common.update_doc_section("docs/benchmarks.md", "Peak memory of an optimizer step", body)


if __name__ == "__main__":
    main()
