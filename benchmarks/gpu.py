"""GPU benchmark (issue 17): optimizer steps against AdamW and their lower bounds, peak
memory, host synchronizations, and the curvature functions against the peers.

    python benchmarks/gpu.py --device cuda --json gpu.json      # on a GPU machine (~6 min)
    python benchmarks/gpu.py --render a.json b.json             # docs/benchmarks.md section
    python benchmarks/gpu.py --device cpu --scale small --no-doc  # smoke run (seconds)

Parts (``--parts``, in this order; each one writes into the JSON as soon as it ends, so a
run stopped early keeps what it measured):

* ``syncs``: host synchronizations under ``torch.cuda.set_sync_debug_mode("warn")`` (each
  synchronizing CUDA call raises a warning, counted here), per training step without and
  with a refresh, and per ``curvature.kfac()`` call. On CPU nothing synchronizes: the
  CPU-side count is tests/test_optim_syncs.py's.
* ``optim``: one training step (zero_grad, forward, loss, backward, step) of SGD, AdamW
  (``foreach=True``), KFAC empirical / mc-1, EKFAC empirical, DiagonalNaturalGradient
  empirical and ASDL's KFAC (when installed; ``optim_step.asdl_kfac``) on issue 17's GPU
  workloads: an MLP 784-2048-2048-10 at batch 1024, a VGG-like CNN on 3x32x32 at batch
  256, a transformer language model (d=512, 4 layers, T=256, vocabulary 8192, batch 16).
  Every timed call is 10 consecutive steps (one refresh period with ``inverse_every=10``),
  ended by ``torch.cuda.synchronize()``; the median over the repeats is reported per
  step. The peak of ``torch.cuda.max_memory_allocated`` over one period after a warm-up
  period, and the bytes of the curvature state (factors, inverses, eigenbases: every
  tensor of ``opt.blocks``), give issue 17's memory target (peak within AdamW's peak + 3x
  the curvature state).
* ``bound``: per workload and optimizer, a lower bound of the step, each term timed alone
  on the same device: the AdamW step, plus the statistics GEMMs (``A = a^T a`` and ``G =
  g^T g`` for every Kronecker block, ``[R, D]`` operands with ``R`` rows: samples times
  positions), plus the preconditioning GEMMs (2 per block for KFAC, 4 for EKFAC), plus the
  decompositions over 10 (Cholesky inverse for KFAC, the basis update of
  ``curvature.blocks.power`` for EKFAC, ``eigh`` by the library's solver route for its
  ``eigenbasis_update="eigh"`` row), plus for mc the extra backward (forward+backward
  minus forward of the plain model), plus for EKFAC the eigenbasis statistics (2 rotations
  and the squares GEMM) and for DiagonalNG the squares GEMM. Layers over
  ``max_factor_size`` keep only their full side. Layers without a Kronecker rule
  (embeddings, norms) add nothing: the bound stays a bound.
* ``functions``: ``curvature.kfac`` (empirical, mc-1), ``ekfac`` (mc-1),
  ``diag_ggn`` (type-2 and empirical) and per-sample gradient norms, against ASDL
  (Kronecker factors, diagonal empirical Fisher), curvlinops (``KFACLinearOperator``) and
  BackPACK (``DiagGGNExact``) when installed, as ratios to a plain forward+backward, on
  shared/PERFORMANCE.md's workloads at 8x their CPU batch (MLP 784-512-256-10 at 1024, CNN
  3x32x32 with a 12544->128 Linear at 512, token MLP 128-256-128 on [256, 64, 128]).

TF32 is off (``torch.backends.cuda.matmul.allow_tf32 = False``), float32 throughout.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import optim_step  # noqa: E402
from step_memory import curvature_bytes  # noqa: E402

import curvature  # noqa: E402
from curvature.blocks.power import power_step  # noqa: E402

PERIOD = 10  # inverse_every of the curvature optimizers: one timed call = one period
LR, DAMPING = 1e-4, 1e-2
DOC_TITLE = "GPU"
CE, MSE = nn.CrossEntropyLoss(), nn.MSELoss()


# -- workloads -----------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal self-attention with ``nn.Linear`` projections (``[N, T, d]`` to itself)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        N, T, d = x.shape
        q, k, v = self.qkv(x).view(N, T, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.out(y.transpose(1, 2).reshape(N, T, d))


class Layer(nn.Module):
    """Pre-norm transformer layer: attention and a 4x MLP, each with a residual."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    """Decoder-only language model; logits ``[N * T, V]`` (one row per token)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.layers = nn.Sequential(*[Layer(d, heads) for _ in range(layers)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens: Tensor) -> Tensor:
        T = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(T, device=tokens.device))
        return self.head(self.ln(self.layers(x))).flatten(0, 1)


def vgg(width: int = 64, hidden: int = 512) -> nn.Module:
    """VGG-like CNN on 3x32x32: three stages of two 3x3 convolutions and a max-pool."""
    layers: List[nn.Module] = []
    c_in = 3
    for c in (width, 2 * width, 4 * width):
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU()]
        layers += [nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        c_in = c
    layers += [nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(4 * c_in, hidden), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(hidden, 10))


Workload = Tuple[str, str, Callable[[], nn.Module], Tensor, Tensor, nn.Module]


def step_workloads(scale: str) -> List[Workload]:
    """Issue 17's GPU workloads (``scale="small"``: the same shapes, tiny, for a smoke run)."""
    g = torch.Generator().manual_seed(0)
    full = scale == "full"
    w, N_mlp, N_cnn = (2048, 1024, 256) if full else (32, 16, 4)
    V, d, L, T, N_lm = (8192, 512, 4, 256, 16) if full else (64, 16, 2, 8, 2)

    def mlp():
        return nn.Sequential(
            nn.Linear(784, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)
        )

    tokens = torch.randint(0, V, (N_lm, T + 1), generator=g)
    return [
        (
            "mlp",
            f"MLP 784-{w}-{w}-10, N={N_mlp}",
            mlp,
            torch.randn(N_mlp, 784, generator=g),
            torch.randint(0, 10, (N_mlp,), generator=g),
            CE,
        ),
        (
            "cnn",
            f"VGG-like CNN 3x32x32 (64-128-256), N={N_cnn}",
            (lambda: vgg()) if full else (lambda: vgg(4, 16)),
            torch.randn(N_cnn, 3, 32, 32, generator=g),
            torch.randint(0, 10, (N_cnn,), generator=g),
            CE,
        ),
        (
            "lm",
            f"transformer LM d={d}, {L} layers, T={T}, V={V}, N={N_lm}",
            lambda: LM(V, d, L, heads=8 if full else 2, context=T),
            tokens[:, :-1],
            tokens[:, 1:].reshape(-1),
            CE,
        ),
    ]


def function_workloads(scale: str) -> List[Workload]:
    """shared/PERFORMANCE.md's workloads at 8x their CPU batch."""
    g = torch.Generator().manual_seed(0)
    k = 8 if scale == "full" else 1
    return [
        (
            "mlp",
            f"MLP 784-512-256-10, N={128 * k}",
            lambda: nn.Sequential(
                nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
            ),
            torch.randn(128 * k, 784, generator=g),
            torch.randint(0, 10, (128 * k,), generator=g),
            CE,
        ),
        (
            "cnn",
            f"CNN 3x32x32 (12544->128), N={64 * k}",
            optim_step._cnn,
            torch.randn(64 * k, 3, 32, 32, generator=g),
            torch.randint(0, 10, (64 * k,), generator=g),
            CE,
        ),
        (
            "tokens",
            f"token MLP 128-256-128, [{32 * k}, 64, 128]",
            lambda: nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)),
            torch.randn(32 * k, 64, 128, generator=g),
            torch.randn(32 * k, 64, 128, generator=g),
            MSE,
        ),
    ]


# -- timing --------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, inner: int = 1) -> float:
    """Median seconds per call over ``repeats`` measurements of ``inner`` calls each."""
    return timed_host(fn, device, repeats, inner)[0]


def timed_host(
    fn: Callable[[], Any], device: torch.device, repeats: int, inner: int = 1
) -> Tuple[float, float]:
    """:func:`timed` and the median host time: until the last call returns, before the
    final synchronization (close to the total: the host is the bottleneck)."""
    times, host = [], []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        host.append((time.perf_counter() - start) / inner)
        _sync(device)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times), statistics.median(host)


def _quiet(fn: Callable[[], Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


#: KFAC empirical with its statistics GEMMs in bf16 (``statistics_dtype``, opt-in)
BF16_ROW = "KFAC empirical, bf16 statistics"
#: EKFAC with an eigendecomposition at every refresh (the default tracks its bases)
EKFAC_EIGH_ROW = "EKFAC empirical, eigenbasis_update=eigh"


def optimizers(model: nn.Module, loss_func: nn.Module):
    """``(name, optimizer)`` of each row (built on demand)."""
    kw = dict(lr=LR, damping=DAMPING, inverse_every=PERIOD, loss_func=loss_func)
    yield "SGD", lambda: torch.optim.SGD(model.parameters(), lr=1e-3)
    yield "AdamW", lambda: torch.optim.AdamW(model.parameters(), lr=LR, foreach=True)
    yield "KFAC empirical", lambda: curvature.KFAC(model, fisher="empirical", **kw)
    yield "KFAC mc-1", lambda: curvature.KFAC(model, fisher="mc", **kw)
    yield (
        BF16_ROW,
        lambda: curvature.KFAC(model, fisher="empirical", statistics_dtype=torch.bfloat16, **kw),
    )
    yield "EKFAC empirical", lambda: curvature.EKFAC(model, fisher="empirical", **kw)
    yield (
        EKFAC_EIGH_ROW,
        lambda: curvature.EKFAC(model, fisher="empirical", eigenbasis_update="eigh", **kw),
    )
    yield (
        "DiagonalNG empirical",
        lambda: curvature.DiagonalNaturalGradient(model, fisher="empirical", **kw),
    )


# -- syncs ---------------------------------------------------------------------------------------
#: Where the synchronizations counted by :func:`count_syncs` happened (``file:line``)
SYNC_SITES: Dict[str, int] = {}


def count_syncs(fn: Callable[[], Any], device: torch.device) -> Optional[int]:
    """Synchronizing CUDA calls made by ``fn`` (``None`` off CUDA); sites in SYNC_SITES."""
    if device.type != "cuda":
        fn()
        return None
    _sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    hits = [w for w in caught if "synchronizing CUDA operation" in str(w.message)]
    for w in hits:
        site = f"{os.path.relpath(w.filename)}:{w.lineno}"
        SYNC_SITES[site] = SYNC_SITES.get(site, 0) + 1
    return len(hits)


def _curvature_steps(make, X: Tensor, y: Tensor, loss_func, device: torch.device):
    """``(name, step)`` for each curvature optimizer of :func:`optimizers` on a fresh model
    of ``make`` (one training step per call; X, y on ``device``)."""
    for name, _ in optimizers(make().to(device), loss_func):
        if name in ("SGD", "AdamW"):
            continue
        torch.manual_seed(0)
        model = make().to(device)
        opt = _quiet(dict(optimizers(model, loss_func))[name])

        def step(model=model, opt=opt):
            opt.zero_grad()
            loss_func(model(X), y).backward()
            opt.step()

        yield name, step


def part_syncs(device: torch.device, scale: str) -> Dict[str, Any]:
    """Syncs per step (without / with a refresh) and per ``kfac()`` call, MLP workload;
    the refresh step of the other workloads."""
    _, title, make, X, y, loss_func = step_workloads(scale)[0]
    X, y = X.to(device), y.to(device)
    out: Dict[str, Any] = {"workload": title}
    for name, step in _curvature_steps(make, X, y, loss_func, device):
        for _ in range(2):  # step 0 refreshes; step 1 is a plain step
            _quiet(step)
        plain = [count_syncs(step, device) for _ in range(PERIOD - 2)]  # steps 2..9
        refresh = count_syncs(step, device)  # step 10 refreshes
        out[name] = {"plain_steps": plain, "refresh_step": refresh}
    # the refresh step of the other workloads (their factor sizes group differently:
    # one eigendecomposition call per size group; the LM's one-sided blocks)
    others: Dict[str, Any] = {}
    for _key, title2, make2, X2, y2, loss2 in step_workloads(scale)[1:]:
        X2, y2 = X2.to(device), y2.to(device)
        for name, step in _curvature_steps(make2, X2, y2, loss2, device):
            for _ in range(PERIOD):  # step 0 refreshes, then plain steps up to the next
                _quiet(step)
            others[f"{title2}: {name}"] = count_syncs(step, device)
    out["refresh steps (other workloads)"] = others
    out["sites (optimizers)"] = dict(SYNC_SITES)
    SYNC_SITES.clear()
    model = make().to(device)
    _quiet(lambda: curvature.kfac(model, loss_func, (X, y)))  # warm-up
    for fisher in ("empirical", "mc"):
        out[f"kfac() {fisher}"] = count_syncs(
            lambda f=fisher: curvature.kfac(model, loss_func, (X, y), fisher=f), device
        )
        out[f"diag_ggn() {fisher}"] = count_syncs(
            lambda f=fisher: curvature.diag_ggn(model, loss_func, (X, y), f), device
        )
    out["sites (kfac)"] = dict(SYNC_SITES)
    return out


# -- optimizer steps -----------------------------------------------------------------------------
def part_optim(
    device: torch.device, scale: str, budget: float, only: Optional[List[str]] = None
) -> Dict[str, Any]:
    res: Dict[str, Any] = {}
    asdl = optim_step.load_asdl()
    for key, title, make, X, y, loss_func in step_workloads(scale):
        if only and key not in only:
            continue
        X, y = X.to(device), y.to(device)
        torch.manual_seed(0)
        template = make().to(device)
        rows: Dict[str, Any] = {}
        res[key] = {"title": title, "rows": rows}
        names = [n for n, _ in optimizers(template, loss_func)]
        if asdl is not None and key != "lm":
            names += ["ASDL KFAC empirical"]
        for name in names:
            try:
                rows[name] = _optim_row(name, template, X, y, loss_func, device, budget)
            except Exception as e:  # noqa: BLE001 (a row that fails is reported, not fatal)
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                traceback.print_exc()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            print(f"{title:50s} {name:22s} {_fmt_row(rows[name])}", flush=True)
        res[key]["plain"] = _plain_times(template, X, y, loss_func, device)
    return res


def _own_peak(row: Dict[str, Any]) -> float:
    """A row's peak less what earlier rows left allocated (``allocated_at_start``, where
    the run recorded it: the process's caches; H100 run 11 compared raw peaks)."""
    return row["peak"] - (row.get("allocated_at_start") or 0)


def _optim_row(name, template, X, y, loss_func, device, budget) -> Dict[str, Any]:
    # what earlier rows and parts left in reference cycles goes first: it would count in
    # this row's peak (H100 run 11: about 85 MiB in some rows, not in others)
    gc.collect()
    left = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    model = copy.deepcopy(template)
    if name.startswith("ASDL"):
        step = optim_step.asdl_kfac(model, X, y, loss_func, "empirical", period=PERIOD)
        opt = None
    else:
        opt = _quiet(dict(optimizers(model, loss_func))[name])

        def step():
            opt.zero_grad()
            loss_func(model(X), y).backward()
            opt.step()

    def period():
        for _ in range(PERIOD):
            step()

    start = time.perf_counter()
    _quiet(period)  # warm-up: first statistics, decompositions, allocator
    _sync(device)
    first = time.perf_counter() - start
    repeats = int(max(2, min(5, budget / max(first, 1e-9))))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t, host = _quiet(lambda: timed_host(period, device, repeats))
    row = {"time": t / PERIOD, "host": host / PERIOD, "repeats": repeats, "first_period": first}
    if device.type == "cuda":
        row["peak"] = torch.cuda.max_memory_allocated(device)
        row["allocated_before"] = base
        row["allocated_at_start"] = left  # before the row's model: what others left
    row["curvature_bytes"] = curvature_bytes(opt) if opt is not None else None
    if opt is not None and hasattr(opt, "close"):
        opt.close()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _plain_times(template, X, y, loss_func, device) -> Dict[str, float]:
    model = copy.deepcopy(template)

    def fwd():
        with torch.no_grad():
            loss_func(model(X), y)

    def fwd_bwd():
        model.zero_grad()
        loss_func(model(X), y).backward()

    fwd_bwd()
    return {"forward": timed(fwd, device, 5, 5), "forward_backward": timed(fwd_bwd, device, 5, 5)}


def _fmt_row(row: Dict[str, Any]) -> str:
    if "error" in row:
        return row["error"][:120]
    peak = f"  peak {row['peak'] / 2**20:8.1f} MiB" if "peak" in row else ""
    return f"{1e3 * row['time']:8.2f} ms{peak}"


# -- lower bounds --------------------------------------------------------------------------------
def kronecker_shapes(model: nn.Module, X: Tensor, max_factor_size: int = 4096) -> List[Dict]:
    """Per Linear / Conv2d: ``rows`` (samples x positions), ``a`` and ``g`` factor sizes.

    A factor over ``max_factor_size`` is kept as a diagonal (size 0 here: no GEMM).
    """
    shapes: List[Dict] = []

    def hook(mod, inp, out):
        if isinstance(mod, nn.Linear):
            a, g, rows = mod.in_features, mod.out_features, inp[0].numel() // mod.in_features
        else:
            k = math.prod(mod.kernel_size)
            a, g = mod.in_channels // mod.groups * k, mod.out_channels
            rows = out.numel() // mod.out_channels
        a += mod.bias is not None
        shapes.append(
            {
                "rows": rows,
                "a": a if a <= max_factor_size else 0,
                "g": g if g <= max_factor_size else 0,
                "weight": (g, a),
            }
        )

    handles = [
        m.register_forward_hook(hook)
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d))
    ]
    try:
        with torch.no_grad():
            model(X)
    finally:
        for h in handles:
            h.remove()
    return shapes


class GemmClock:
    """Times GEMMs and decompositions of given shapes once each (cached)."""

    def __init__(self, device: torch.device):
        self.device, self.cache = device, {}

    def _time(self, key, make, op) -> float:
        if key not in self.cache:
            operands = make()
            op(*operands)
            self.cache[key] = timed(lambda: op(*operands), self.device, 5, 3)
        return self.cache[key]

    def mm(self, m: int, k: int, n: int, dtype: torch.dtype = torch.float32) -> float:
        """``[m, k] @ [k, n]`` in ``dtype``."""
        if min(m, k, n) == 0:
            return 0.0
        dev = self.device
        return self._time(
            ("mm", m, k, n, dtype),
            lambda: (
                torch.randn(m, k, device=dev, dtype=dtype),
                torch.randn(k, n, device=dev, dtype=dtype),
            ),
            torch.mm,
        )

    def _spd(self, n: int) -> Tuple[Tensor]:
        a = torch.randn(n, 2 * n, device=self.device)
        return (a @ a.T / n + torch.eye(n, device=self.device),)

    def cholesky_inverse(self, n: int) -> float:
        if n == 0:
            return 0.0
        return self._time(
            ("chol", n),
            lambda: self._spd(n),
            lambda s: torch.cholesky_inverse(torch.linalg.cholesky(s)),
        )

    def eigh(self, n: int) -> float:
        """By the library's route (``curvature.linalg.solve_dtype``: float64 for float32
        sizes in ``FLOAT64_EIGH_SIZES`` on ``PAD_EIGH_DEVICES``, cuSOLVER's Jacobi there
        otherwise)."""
        if n == 0:
            return 0.0
        solve = curvature.linalg.solve_dtype(torch.float32, n, torch.device(self.device))
        if solve == torch.float64:
            return self._time(
                ("eigh64", n),
                lambda: self._spd(n),
                lambda s: [t.float() for t in torch.linalg.eigh(s.double())],
            )
        return self._time(("eigh", n), lambda: self._spd(n), torch.linalg.eigh)

    def power_step(self, n: int) -> float:
        """EKFAC's basis update (``curvature.blocks.power.power_step``: a GEMM and a QR)."""
        if n == 0:
            return 0.0

        def make():
            (S,) = self._spd(n)
            return S, torch.linalg.eigh(S).eigenvectors

        return self._time(("power", n), make, power_step)


def lower_bounds(shapes: List[Dict], clock: GemmClock, adamw: float, plain: Dict) -> Dict:
    """Per optimizer name: the lower bound of one step and its terms (seconds)."""
    stats = stats_bf16 = precond = chol = eig = power = ek_stats = squares = ek_precond = 0.0
    for s in shapes:
        R, a, g = s["rows"], s["a"], s["g"]
        out_, in_ = s["weight"]
        stats += clock.mm(a, R, a) + clock.mm(g, R, g)
        stats_bf16 += clock.mm(a, R, a, torch.bfloat16) + clock.mm(g, R, g, torch.bfloat16)
        precond += clock.mm(g, g, in_) + clock.mm(out_, a, a)
        ek_precond += 2 * (clock.mm(g, g, in_) + clock.mm(out_, a, a))
        chol += clock.cholesky_inverse(a) + clock.cholesky_inverse(g)
        eig += clock.eigh(a) + clock.eigh(g)
        power += clock.power_step(a) + clock.power_step(g)
        ek_stats += clock.mm(R, a, a) + clock.mm(R, g, g) + clock.mm(out_, R, in_)
        squares += clock.mm(out_, R, in_)
    backward = max(plain["forward_backward"] - plain["forward"], 0.0)
    kfac = adamw + stats + precond + chol / PERIOD
    terms = {
        "adamw": adamw,
        "stats": stats,
        "stats_bf16": stats_bf16,
        "precond": precond,
        "cholesky_inverse": chol / PERIOD,
        "eigh": eig / PERIOD,
        "power_step": power / PERIOD,
        "extra_backward": backward,
        "ekfac_stats": ek_stats,
        "squares": squares,
    }
    return {
        "terms": terms,
        "KFAC empirical": kfac,
        "KFAC mc-1": kfac + backward,
        BF16_ROW: kfac - stats + stats_bf16,
        "EKFAC empirical": adamw + stats + ek_stats + ek_precond + power / PERIOD,
        EKFAC_EIGH_ROW: adamw + stats + ek_stats + ek_precond + eig / PERIOD,
        "DiagonalNG empirical": adamw + squares,
    }


def part_bound(device: torch.device, scale: str, optim: Dict[str, Any]) -> Dict[str, Any]:
    clock = GemmClock(device)
    res = {}
    for key, title, make, X, _, _ in step_workloads(scale):
        if key not in optim or "time" not in optim[key]["rows"].get("AdamW", {}):
            continue
        model = make().to(device)
        shapes = kronecker_shapes(model, X.to(device))
        res[key] = lower_bounds(
            shapes, clock, optim[key]["rows"]["AdamW"]["time"], optim[key]["plain"]
        )
        res[key]["shapes"] = shapes
        print(title, {k: v for k, v in res[key].items() if k not in ("shapes", "terms")})
    return res


# -- curvature functions against the peers -------------------------------------------------------
def _ours(model, loss_func, X, y):
    yield (
        "curvature kfac empirical",
        lambda: curvature.kfac(model, loss_func, (X, y), fisher="empirical"),
    )
    yield "curvature kfac mc-1", lambda: curvature.kfac(model, loss_func, (X, y), fisher="mc")
    yield "curvature ekfac mc-1", lambda: curvature.ekfac(model, loss_func, (X, y), fisher="mc")
    yield "curvature diag_ggn type-2", lambda: curvature.diag_ggn(model, loss_func, (X, y))
    yield (
        "curvature diag_ggn empirical",
        lambda: curvature.diag_ggn(model, loss_func, (X, y), "empirical"),
    )
    none = type(loss_func)(reduction="none")

    def norms():
        with curvature.capture(model) as cap:
            out = model(X)
        losses = none(out, y)
        return cap.per_sample_grad_norms(losses.reshape(losses.shape[0], -1).mean(1))

    yield "curvature per-sample norms", norms


def _peers(model, loss_func, X, y):
    yield from optim_step.asdl_fisher_runs(model, loss_func, X, y, "mc-1")
    try:
        import curvlinops
    except ImportError:
        curvlinops = None
    if curvlinops is not None:
        params = [p for p in model.parameters() if p.requires_grad]
        rows = [
            ("curvlinops KFAC empirical", "KFACLinearOperator", "empirical"),
            ("curvlinops KFAC mc-1", "KFACLinearOperator", "mc"),
            ("curvlinops EKFAC mc-1", "EKFACLinearOperator", "mc"),
        ]
        for label, cls, ftype in rows:
            op_cls = getattr(curvlinops, cls, None)
            if op_cls is None:
                continue

            def run(op_cls=op_cls, ftype=ftype):
                # the factors (and EKFAC's corrections) are computed on demand: ask for them
                op = op_cls(
                    model,
                    loss_func,
                    params,
                    [(X, y)],
                    check_deterministic=False,
                    fisher_type=ftype,
                )
                for name in ("compute_kronecker_factors", "compute_eigenvalue_correction"):
                    if hasattr(op, name):
                        getattr(op, name)()
                return op

            yield label, run
    try:
        from backpack import backpack, extend
        from backpack.extensions import DiagGGNExact
    except ImportError:
        return
    bp_model, bp_loss = extend(copy.deepcopy(model)), extend(type(loss_func)())

    def diag_exact():
        bp_model.zero_grad()
        loss = bp_loss(bp_model(X), y)
        with backpack(DiagGGNExact()):
            loss.backward()

    yield "BackPACK DiagGGNExact", diag_exact


def part_functions(
    device: torch.device, scale: str, budget: float, only: Optional[List[str]] = None
) -> Dict[str, Any]:
    res: Dict[str, Any] = {}
    for key, title, make, X, y, loss_func in function_workloads(scale):
        if only and key not in only:
            continue
        torch.manual_seed(0)
        model, X, y = make().to(device), X.to(device), y.to(device)

        def plain(model=model, X=X, y=y, loss_func=loss_func):
            model.zero_grad()
            loss_func(model(X), y).backward()

        plain()
        base = timed(plain, device, 5, 3)
        rows: Dict[str, Any] = {}
        res[key] = {"title": title, "forward_backward": base, "rows": rows}
        for name, fn in [*_ours(model, loss_func, X, y), *_peers(model, loss_func, X, y)]:
            try:
                start = time.perf_counter()
                _quiet(fn)
                _sync(device)
                first = time.perf_counter() - start
                repeats = int(max(2, min(5, budget / max(first, 1e-9))))
                t = _quiet(lambda fn=fn, r=repeats: timed(fn, device, r))
                rows[name] = {"time": t, "ratio": t / base}
            except Exception as e:  # noqa: BLE001
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            r = rows[name]
            shown = f"{r['ratio']:7.2f}x" if "ratio" in r else r["error"][:100]
            print(f"{title:40s} {name:32s} {shown}", flush=True)
    return res


# -- the docs section ----------------------------------------------------------------------------
TARGETS = {  # issue 17: step time against AdamW's on the GPU
    "KFAC empirical": {"mlp": 2.0, "cnn": 2.0, "lm": 1.5},
    "KFAC mc-1": {"mlp": 2.0, "cnn": 2.0, "lm": 1.5},
    BF16_ROW: {"mlp": 2.0, "cnn": 2.0, "lm": 1.5},
    "EKFAC empirical": {"mlp": 3.0, "cnn": 3.0, "lm": 3.0},
    EKFAC_EIGH_ROW: {"mlp": 3.0, "cnn": 3.0, "lm": 3.0},
    "DiagonalNG empirical": {"mlp": 1.5, "cnn": 1.5, "lm": 1.5},
}


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def render(data: Dict[str, Any]) -> str:
    """The docs section from a run's JSON."""
    lines = [
        f"Generated by `benchmarks/gpu.py` from a run on {data.get('device_name', '?')} "
        f"(torch {data.get('torch', '?')}, float32, TF32 off), "
        f"{data.get('date', '?')}; command `{data.get('command', '?')}`, then "
        "`python benchmarks/gpu.py --render <that JSON>`. Only figures of that run appear "
        "here.",
        "",
    ]
    syncs = data.get("syncs")
    if syncs:
        lines += [
            "### Host synchronizations (CUDA sync debug mode)",
            "",
            f"Counted with `torch.cuda.set_sync_debug_mode('warn')` on {syncs['workload']}: "
            "each synchronizing CUDA call warns once. Issue 17's targets: 0 per step "
            "without a refresh, at most 2 per refresh step and per `kfac()` call.",
            "",
        ]
        rows = []
        for name, v in syncs.items():
            if isinstance(v, dict) and "plain_steps" in v:
                plain, ref = max(v["plain_steps"]), v["refresh_step"]
                ok = plain == 0 and ref <= 2
                rows.append([name, str(plain), str(ref), _met(ok)])
        for name, v in syncs.items():
            if name.startswith(("kfac()", "diag_ggn()")):
                rows.append([f"`{name}` call", "", str(v), _met(v <= 2)])
        lines += [
            common.markdown_table(
                ["", "syncs per step, no refresh (max of 8)", "refresh step / call", "target"],
                rows,
            ),
            "",
        ]
        others = syncs.get("refresh steps (other workloads)")
        if others:
            rows = [[k, str(v), _met(v is not None and v <= 2)] for k, v in others.items()]
            lines += [
                "Refresh steps of the other workloads (after `inverse_every` steps; target "
                "at most 2):",
                "",
                common.markdown_table(["workload: optimizer", "refresh step", "target"], rows),
                "",
            ]
        for label, key in (("optimizer steps", "sites (optimizers)"), ("calls", "sites (kfac)")):
            sites = syncs.get(key)
            if sites:
                where = ", ".join(f"`{k}` ({v})" for k, v in sites.items())
                lines += [f"Where the {label} synchronized (all rows together): {where}.", ""]
    optim, bound = data.get("optim"), data.get("bound", {})
    if optim:
        lines += [
            "### Optimizer steps against AdamW",
            "",
            "One training step (zero_grad, forward, loss, backward, step), `inverse_every=10` "
            "amortized: each timed call is 10 steps ended by a synchronization, median over "
            "the repeats. `x AdamW`: against the AdamW (`foreach=True`) step on the same "
            "workload; `bound`: the step's lower bound from its GEMMs and decompositions "
            "timed alone (module docstring), `x bound` the step over it (issue 17: within "
            "1.3x); `peak`: `torch.cuda.max_memory_allocated` over a period; `curvature`: "
            "the bytes of factors, inverses and eigenbases; memory target: peak <= AdamW's "
            "peak + 3x curvature (each peak less what earlier rows left allocated, where "
            "the run recorded it: `allocated_at_start`).",
            "",
        ]
        rows = []
        for key, w in optim.items():
            adam = w["rows"].get("AdamW", {})
            b = bound.get(key, {})
            for name, r in w["rows"].items():
                rows.append(_optim_cells(key, w["title"], name, r, adam, b.get(name)))
        lines += [
            common.markdown_table(
                [
                    "workload",
                    "optimizer",
                    "ms/step",
                    "host ms/step",
                    "x AdamW",
                    "target",
                    "bound [ms] (x AdamW)",
                    "x bound (<= 1.3x)",
                    "peak [MiB]",
                    "curvature [MiB]",
                    "memory target",
                ],
                rows,
            ),
            "",
        ]
    functions = data.get("functions")
    if functions:
        lines += [
            "### Curvature functions against the peers",
            "",
            "Each call as a user makes it (forward, loss, backward, the quantity), as a "
            "ratio to a plain forward+backward of the same model and batch.",
            "",
        ]
        rows = []
        for w in functions.values():
            for name, r in w["rows"].items():
                cell = f"{r['ratio']:.2f}x" if "ratio" in r else r["error"][:80]
                rows.append([w["title"], name, cell, _peer_verdict(name, w["rows"])])
        lines += [
            common.markdown_table(
                ["workload", "quantity", "x fwd+bwd", "against the fastest peer"], rows
            ),
            "",
        ]
    return "\n".join(lines)


#: Our function rows and the peer rows computing the same quantity (issue 17's comparison)
PEER_ROWS = {
    "curvature kfac empirical": ("ASDL kron empirical", "curvlinops KFAC empirical"),
    "curvature kfac mc-1": ("ASDL kron mc-1", "curvlinops KFAC mc-1"),
    "curvature ekfac mc-1": ("curvlinops EKFAC mc-1",),
    "curvature diag_ggn type-2": ("BackPACK DiagGGNExact",),
    "curvature diag_ggn empirical": ("ASDL diag empirical",),
}


def _peer_verdict(name: str, rows: Dict[str, Any]) -> str:
    peers = [(rows[p]["ratio"], p) for p in PEER_ROWS.get(name, ()) if "ratio" in rows.get(p, {})]
    if name not in PEER_ROWS or "ratio" not in rows[name]:
        return ""
    if not peers:
        return "no peer computes it here"
    best, who = min(peers)
    return f"{who} {best:.2f}x: {_met(rows[name]['ratio'] <= best)}"


def _optim_cells(key, title, name, r, adam, lb) -> List[str]:
    """One row of the optimizer table (see :func:`render`)."""
    if "error" in r:
        return [title, name, r["error"][:80]] + [""] * 8
    ratio = r["time"] / adam["time"] if "time" in adam else float("nan")
    target = TARGETS.get(name, {}).get(key)
    verdict = f"{target}x: {_met(ratio <= target)}" if target else ""
    bound_cells = ["", ""]
    if lb:
        over = r["time"] / lb
        bound_cells = [
            f"{1e3 * lb:.2f} ({lb / adam['time']:.2f}x)",
            f"{over:.2f}x: {_met(over <= 1.3)}",
        ]
    mem = ["", "", ""]
    if "peak" in r and "peak" in adam:
        cb = r.get("curvature_bytes") or 0
        mem = [
            f"{r['peak'] / 2**20:.0f}",
            f"{cb / 2**20:.1f}" if cb else "",
            _met(_own_peak(r) <= _own_peak(adam) + 3 * cb) if cb else "",
        ]
    host = f"{1e3 * r['host']:.2f}" if "host" in r else ""
    return [
        title,
        name,
        f"{1e3 * r['time']:.2f}",
        host,
        f"{ratio:.2f}x",
        verdict,
        *bound_cells,
        *mem,
    ]


def repeats(runs: List[Dict[str, Any]]) -> str:
    """The step times of several runs side by side (the same GPU kind, other machines)."""
    labels = [r.get("run", f"run {i + 1}") + f" ({r.get('code', '?')})" for i, r in enumerate(runs)]
    rows = []
    last = runs[-1].get("optim", {})
    for key, w in last.items():
        for name in w["rows"]:
            cells = []
            for r in runs:
                row = r.get("optim", {}).get(key, {}).get("rows", {}).get(name, {})
                adam = r.get("optim", {}).get(key, {}).get("rows", {}).get("AdamW", {})
                if "time" not in row or "time" not in adam:
                    cells.append("")
                    continue
                host = f", host {1e3 * row['host']:.2f}" if "host" in row else ""
                cells.append(
                    f"{1e3 * row['time']:.2f} ms{host} ({row['time'] / adam['time']:.2f}x)"
                )
            rows.append([w["title"], name, *cells])
    return (
        "\n### The same steps in every run of the session\n\n"
        "ms per step (host time to enqueue it) and the ratio to that run's AdamW step; each "
        "run on a fresh machine of the same kind, code as named (commit). Where the host "
        "time is the step time, the host is the bottleneck and the figure follows the "
        "machine's CPU.\n\n"
        + common.markdown_table(["workload", "optimizer", *labels], rows)
        + "\n"
    )


# -- main ----------------------------------------------------------------------------------------
PARTS = ("syncs", "optim", "bound", "functions")


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--scale", choices=["full", "small"], default="full")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--budget", type=float, default=4.0, help="seconds per row, about")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=None,
        help="only these keys (optim: mlp cnn lm; functions: mlp cnn tokens)",
    )
    parser.add_argument(
        "--render",
        nargs="+",
        default=None,
        help="write the docs section from run JSONs (the last in full, all in the repeats)",
    )
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args(argv)
    if args.render:
        runs = []
        for path in args.render:
            with open(path) as f:
                runs.append(json.load(f))
        body = render(runs[-1]) + (repeats(runs) if len(runs) > 1 else "")
        if not args.no_doc:
            common.update_doc_section("docs/benchmarks.md", DOC_TITLE, body)
        print(body)
        return runs[-1]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    data: Dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": common.portable_command(
            "benchmarks/gpu.py", sys.argv[1:] if argv is None else argv
        ),
        "scale": args.scale,
    }

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(data, f, indent=1)

    for part in args.parts:
        start = time.perf_counter()
        try:
            if part == "syncs":
                data["syncs"] = part_syncs(device, args.scale)
            elif part == "optim":
                data["optim"] = part_optim(device, args.scale, args.budget, args.workloads)
            elif part == "bound" and "optim" in data:
                data["bound"] = part_bound(device, args.scale, data["optim"])
            elif part == "functions":
                data["functions"] = part_functions(device, args.scale, args.budget, args.workloads)
        except Exception:  # noqa: BLE001 (the other parts still run)
            data.setdefault("errors", {})[part] = traceback.format_exc()[-2000:]
            traceback.print_exc()
        data.setdefault("seconds", {})[part] = time.perf_counter() - start
        print(f"== {part}: {time.perf_counter() - start:.1f} s", flush=True)
        save()
    if device.type == "cuda" and not args.no_doc:
        common.update_doc_section("docs/benchmarks.md", DOC_TITLE, render(data))
    return data


if __name__ == "__main__":
    main()
