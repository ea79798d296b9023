"""The adversarial table: hostile-but-ordinary inputs, each run against every estimator it
applies to, each checked against an oracle written from the definitions or against the
expected error or warning.

After the error-input tables of torch's ``OptimizerInfo``: one :class:`Row` per hostile
input (what real training code does to an optimizer: hooks of other libraries, gradient
checkpointing, padding targets, tied weights, parameters frozen mid-run, a profiler, ...)
names the estimators it applies to (:data:`ESTIMATORS`: the optimizers ``KFAC``,
``EKFAC`` and ``DiagonalNaturalGradient`` with their Fisher types, and the functions
``kfac()``, ``ekfac()``, ``diag_ggn()``, ``per_sample_grads``), and every pair
(input, estimator) is one test. The rule (issue 16): the right result, or a clear error
or warning naming the layer / parameter / argument and the way out; never a silently
wrong number, never an unrelated crash, never a stall.

The oracle (:class:`Oracle`) is computed by batch-of-one loops with
``torch.autograd.grad``: per-sample gradients, the Kronecker factors from their
definitions (``A = 1/(N S) sum a a^T`` over every call of a Linear layer,
``G = sum_{n,k,s} g g^T`` with ``g`` the gradient w.r.t. the layer's own output of the
loss-Hessian square-root columns, or of ``sqrt(R) grad l_n`` for the empirical Fisher),
the Fisher diagonal, the dense GGN and EKFAC's corrections; or a clean twin run where the
hostile element must not change anything. Optimizers are run with ``lr=0``: the first
step's statistics are taken as they are.

Rows that expose a library bug not yet fixed are ``xfail(strict=True)`` with the reason.
``docs/robustness.md`` (the report card) is generated from :data:`ROWS`; regenerate it
from the repository root with ``PYTHONPATH=. python tests/test_adversarial_table.py``.
"""

from __future__ import annotations

import copy
import math
import pathlib
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import pytest
import torch
import torch.nn.utils.prune as prune
from optimizer_info import tiny_batch, tiny_mlp
from torch import Tensor, nn
from torch.nn.utils import parametrizations
from torch.utils.checkpoint import checkpoint

import curvature
from curvature.blocks import EigenCorrectedBlock

DT = torch.float64
EXACT = dict(rtol=1e-10, atol=1e-12)
DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "robustness.md"
_OPEN: List[Any] = []  # optimizers built by a test, closed after it


@pytest.fixture(autouse=True)
def _quiet_and_seeded():
    old_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, also on a loaded machine
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(0)
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield
    finally:
        torch.set_num_threads(old_threads)
        while _OPEN:
            _OPEN.pop().close()


# -- estimators ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Estimator:
    """One estimator of the table: an optimizer with a Fisher type, or a function.

    Attributes:
        name: The test id (``"KFAC-type-2"``, ``"kfac()"``, ...).
        kind: ``"optimizer"``, ``"kfac"``, ``"ekfac"``, ``"diag_ggn"`` or
            ``"per_sample_grads"``.
        cls: The optimizer class.
        fisher: The Fisher type (the functions: ``"type-2"``).
    """

    name: str
    kind: str
    cls: Optional[type] = None
    fisher: str = "type-2"

    @property
    def optimizer(self) -> bool:
        return self.cls is not None

    @property
    def diagonal(self) -> bool:
        return self.cls is curvature.DiagonalNaturalGradient

    def build(self, model: nn.Module, loss_func: Optional[nn.Module], **kw: Any):
        """The optimizer with ``lr=0`` (statistics only), refreshed every step."""
        kw = {"lr": 0.0, "damping": 1e-3, "inverse_every": 1, **kw}
        opt = self.cls(model, fisher=self.fisher, loss_func=loss_func, **kw)
        _OPEN.append(opt)
        return opt

    def run(self, model: nn.Module, loss_func: nn.Module, X: Any, y: Tensor, **kw: Any):
        """The function on the batch ``(X, y)``."""
        if self.kind == "per_sample_grads":
            return curvature.per_sample_grads(model, loss_func, X, y, **kw)
        fn = getattr(curvature, self.kind)
        return fn(model, loss_func, (X, y), fisher=self.fisher, **kw)


def _optimizer(cls: type, fisher: str, short: str) -> Estimator:
    return Estimator(f"{short}-{fisher}", "optimizer", cls, fisher)


ESTIMATORS: Dict[str, Estimator] = {
    e.name: e
    for e in (
        _optimizer(curvature.KFAC, "empirical", "KFAC"),
        _optimizer(curvature.KFAC, "type-2", "KFAC"),
        _optimizer(curvature.KFAC, "mc", "KFAC"),
        _optimizer(curvature.KFAC, "rademacher", "KFAC"),
        _optimizer(curvature.EKFAC, "empirical", "EKFAC"),
        _optimizer(curvature.EKFAC, "type-2", "EKFAC"),
        _optimizer(curvature.EKFAC, "mc", "EKFAC"),
        _optimizer(curvature.DiagonalNaturalGradient, "empirical", "DNG"),
        _optimizer(curvature.DiagonalNaturalGradient, "type-2", "DNG"),
        _optimizer(curvature.DiagonalNaturalGradient, "mc", "DNG"),
        Estimator("kfac()", "kfac"),
        Estimator("ekfac()", "ekfac"),
        Estimator("diag_ggn()", "diag_ggn"),
        Estimator("per_sample_grads", "per_sample_grads"),
    )
}
OPT_EMP = ("KFAC-empirical", "EKFAC-empirical", "DNG-empirical")
OPT_T2 = ("KFAC-type-2", "EKFAC-type-2", "DNG-type-2")
OPT = OPT_EMP + OPT_T2
SAMPLED = ("KFAC-mc", "KFAC-rademacher", "EKFAC-mc", "DNG-mc")
FN = ("kfac()", "ekfac()", "diag_ggn()", "per_sample_grads")
ALL = OPT + FN


# -- the oracle ------------------------------------------------------------------------------------
def _columns(loss_func: nn.Module, out: Tensor, target: Tensor, fisher: str, R: float) -> Tensor:
    """``[K, *out.shape]``: ``sum_k c c^T = R d^2 l / d out^2`` (type-2) or ``sqrt(R) grad l``."""
    if fisher == "empirical":
        z = out.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_func(z, target), z)
        return (math.sqrt(R) * g).unsqueeze(0)
    H = torch.autograd.functional.hessian(lambda z: loss_func(z, target), out.detach())
    M = out.numel()
    e, U = torch.linalg.eigh(H.reshape(M, M))
    return ((U * e.clamp(min=0).sqrt()).T * math.sqrt(R)).reshape(M, *out.shape)


def _recorder(calls: List[Tuple[Tensor, Tensor]]) -> Callable[..., Tensor]:
    """A first forward hook: records ``(input, own output)``, hands later hooks a copy."""

    def hook(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        calls.append((args[0], out))
        return out.clone()  # hooks after this one may replace or modify it in place

    return hook


class Oracle:
    """The definitions, by batch-of-one loops with ``torch.autograd.grad``.

    For sample ``n`` alone (the loss module with its own reduction, ``l_n``) and the batch
    loss ``L = R sum_n l_n``:

    - ``per_sample[name]`` ``[N, *p.shape]``: ``grad l_n``;
    - ``factors[layer]``: ``A = 1/(N S) sum_{n,s} a a^T`` (bias: a last input 1, ``S`` the
      positions of all calls of the layer), ``G = sum_{n,k,s} g g^T`` with ``g`` the
      gradient w.r.t. the layer's own output (before any hook replaced it) of
      ``c_nk . out_n``, ``c_nk`` the columns of ``R d^2 l_n / d out_n^2`` (type-2) or
      ``sqrt(R) grad l_n`` (empirical);
    - ``diag[name]``: ``sum_{n,k} (grad_p c_nk . out_n)^2``; :meth:`dense` the matrix
      ``sum_{n,k} v v^T`` of these flat gradients (type-2: the GGN);
    - :meth:`corrections`: EKFAC's ``sum_{n,k} (QG^T [gW | gb] QA)^2`` in a given basis.

    Only ``nn.Linear`` layers get factors (the tables' other layers are compared with a twin).
    """

    def __init__(
        self,
        model: nn.Module,
        loss_func: nn.Module,
        X: Tensor,
        y: Tensor,
        fisher: str = "type-2",
        *,
        forward: Optional[Callable[[Tensor], Tensor]] = None,
    ):
        forward = forward or model
        N = X.shape[0]
        R = 1.0 / N if loss_func.reduction == "mean" else 1.0
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        params = [p for _, p in named]
        self.layers = {
            n: m
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and any(p.requires_grad for p in m.parameters())
        }
        A: Dict[str, Tensor] = {}
        G: Dict[str, Tensor] = {}
        count: Dict[str, int] = {}
        self.diag = {n: torch.zeros_like(p) for n, p in named}
        per_sample: Dict[str, List[Tensor]] = {n: [] for n in self.names}
        self.vectors: List[Dict[str, Tensor]] = []
        for i in range(N):
            rec: Dict[str, List[Tuple[Tensor, Tensor]]] = {n: [] for n in self.layers}

            handles = [
                m.register_forward_hook(_recorder(rec[n]), prepend=True)
                for n, m in self.layers.items()
            ]
            try:
                out = forward(X[i : i + 1])
            finally:
                for h in handles:
                    h.remove()
            t = y[i : i + 1]
            grads = torch.autograd.grad(
                loss_func(out, t), params, retain_graph=True, allow_unused=True
            )
            for n, g, p in zip(self.names, grads, params):
                per_sample[n].append(torch.zeros_like(p) if g is None else g)
            for n, calls in rec.items():
                for a, _ in calls:
                    a = a.detach().reshape(-1, a.shape[-1])
                    if self.layers[n].bias is not None:
                        a = torch.cat([a, torch.ones_like(a[:, :1])], 1)
                    A[n] = A.get(n, 0) + a.T @ a
                    count[n] = count.get(n, 0) + a.shape[0]
            outs = [(n, z) for n, calls in rec.items() for _, z in calls]
            for c in _columns(loss_func, out, t, fisher, R):
                got = torch.autograd.grad(
                    out, [z for _, z in outs] + params, c, retain_graph=True, allow_unused=True
                )
                for (n, z), g in zip(outs, got[: len(outs)]):
                    g = torch.zeros_like(z) if g is None else g.reshape(-1, g.shape[-1])
                    G[n] = G.get(n, 0) + g.T @ g
                vec = {}
                for n, g, p in zip(self.names, got[len(outs) :], params):
                    vec[n] = torch.zeros_like(p) if g is None else g
                    self.diag[n] += vec[n] ** 2
                self.vectors.append(vec)
        self.factors = {n: (A[n] / count[n], G[n]) for n in A}
        self.per_sample = {n: torch.stack(v) for n, v in per_sample.items()}

    def dense(self) -> Tensor:
        """``sum_{n,k} v v^T`` over the flat per-vector gradients (type-2: the GGN)."""
        V = torch.stack([torch.cat([v[n].reshape(-1) for n in self.names]) for v in self.vectors])
        return V.T @ V

    def flat_positions(self, names: Sequence[str]) -> Tensor:
        """The positions of ``names`` in the flat ``[P]`` vector (``named_parameters`` order)."""
        out, start = [], 0
        for n in self.names:
            size = self.per_sample[n][0].numel()
            if n in names:
                out.append(torch.arange(start, start + size))
            start += size
        return torch.cat(out)

    def corrections(self, layer: str, QA: Tensor, QG: Tensor) -> Tensor:
        """EKFAC's ``sum_{n,k} (QG^T M_nk QA)^2`` with ``M_nk = [gW | gb]`` of ``layer``."""
        prefix = f"{layer}." if layer else ""
        out = 0
        for v in self.vectors:
            M = v[prefix + "weight"]
            if prefix + "bias" in v:
                M = torch.cat([M, v[prefix + "bias"][:, None]], 1)
            out = out + (QG.T @ M @ QA) ** 2
        return out


def close(actual: Tensor, expected: Tensor, what: str, **tol: Any) -> None:
    tol = tol or EXACT
    torch.testing.assert_close(
        actual.to(expected.dtype), expected, **tol, msg=lambda m: f"{what}: {m}"
    )


def compare(
    est: Estimator,
    result: Any,
    oracle: Oracle,
    *,
    only: Optional[Sequence[str]] = None,
    tol: Optional[Mapping[str, float]] = None,
) -> None:
    """``result`` of ``est`` against ``oracle``: all of it, or the layers / parameters ``only``.

    Optimizers: ``factors()`` (KFAC, EKFAC) or the running diagonal ``matvec(ones)``
    (DiagonalNaturalGradient); functions: their return value (``ekfac()`` with its
    corrections in its own eigenbasis).
    """
    tol = dict(tol or EXACT)
    if est.kind in ("per_sample_grads", "diag_ggn") or est.diagonal:
        ref = oracle.per_sample if est.kind == "per_sample_grads" else oracle.diag
        if est.diagonal:
            ones = [torch.ones_like(ref[n]) for n in oracle.names]
            got = dict(zip(oracle.names, result.matvec(ones)))
        else:
            got = result
            assert only is not None or list(got) == oracle.names, (list(got), oracle.names)
        for n in only or oracle.names:
            close(got[n], ref[n], f"{est.name} {n}", **tol)
        return
    factors = result.factors() if est.optimizer else result.factors
    layers = list(only or oracle.factors)
    if only is None:
        assert set(factors) == set(oracle.factors), (sorted(factors), sorted(oracle.factors))
    for n in layers:
        A, G = factors[n]
        close(A, oracle.factors[n][0], f"{est.name} A of {n!r}", **tol)
        close(G, oracle.factors[n][1], f"{est.name} G of {n!r}", **tol)
    if est.kind == "ekfac":
        for b in result.blocks:
            if isinstance(b, EigenCorrectedBlock) and b.name in layers:
                r = b.eigen()
                lam = oracle.corrections(b.name, r.QA[0], r.QG[0])
                close(b.corrections[0], lam, f"ekfac() corrections of {b.name!r}", **tol)


def train_step(opt, model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor) -> None:
    """The ordinary loop: ``zero_grad``, ``loss_func(model(X), y).backward()``, ``step``."""
    opt.zero_grad()
    loss_func(model(X), y).backward()
    opt.step()


def measure(
    est: Estimator,
    model: nn.Module,
    loss_func: nn.Module,
    X: Any,
    y: Tensor,
    *,
    train: Callable[..., None] = train_step,
    **kw: Any,
) -> Any:
    """An optimizer after one step of ``train`` (``lr=0``), or the function's result."""
    if est.optimizer:
        opt = est.build(model, loss_func, **kw)
        train(opt, model, loss_func, X, y)
        return opt
    return est.run(model, loss_func, X, y, **kw)


def exact(
    est: Estimator,
    model: nn.Module,
    loss_func: nn.Module,
    X: Tensor,
    y: Tensor,
    *,
    train: Callable[..., None] = train_step,
    oracle: Optional[Oracle] = None,
    **kw: Any,
) -> Any:
    """:func:`measure` against the oracle of ``(model, loss_func, X, y)`` (or ``oracle``)."""
    result = measure(est, model, loss_func, X, y, train=train, **kw)
    compare(est, result, oracle or Oracle(model, loss_func, X, y, est.fisher))
    return result


def refused(est: Estimator, match: str, model, loss_func, X, y, **kw: Any) -> None:
    """A ``ValueError`` matching ``match`` (constructor, training step or function call)."""
    with pytest.raises(ValueError, match=match):
        measure(est, model, loss_func, X, y, **kw)


def same_result(est: Estimator, a: Any, b: Any, **tol: Any) -> None:
    """Two results of ``est`` (a run and its clean twin) are equal."""
    tol = tol or dict(rtol=0, atol=0)
    if est.kind in ("per_sample_grads", "diag_ggn"):
        assert list(a) == list(b)
        for n in a:
            close(a[n].to_dense() if a[n].is_sparse else a[n], b[n], f"{est.name} {n}", **tol)
        return
    if est.diagonal:
        for x, z in zip(a.diagonal_.values(), b.diagonal_.values()):
            close(x, z, f"{est.name} diagonal", **tol)
        return
    fa = a.factors() if est.optimizer else a.factors
    fb = b.factors() if est.optimizer else b.factors
    assert set(fa) == set(fb)
    for n in fa:
        for x, z, w in zip(fa[n], fb[n], "AG"):
            close(x, z, f"{est.name} {w} of {n!r}", **tol)
    if est.kind == "ekfac":
        for x, z in zip(a.blocks, b.blocks):
            close(x.corrections, z.corrections, f"ekfac() corrections of {x.name!r}", **tol)


def warned(rec: Sequence[warnings.WarningMessage], pattern: str) -> bool:
    return any(re.search(pattern, str(r.message)) for r in rec)


def params_of(model: nn.Module) -> List[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# -- small problems --------------------------------------------------------------------------------
def ce(reduction: str = "mean", **kw: Any) -> nn.Module:
    return nn.CrossEntropyLoss(reduction=reduction, **kw)


def mlp(seed: int = 0, dtype: torch.dtype = DT) -> nn.Sequential:
    """``Linear(4, 6) -> Tanh -> Linear(6, 3)``: layers ``"0"`` and ``"2"``."""
    return tiny_mlp(seed, dtype)


def batch(step: int = 0, N: int = 8, dtype: torch.dtype = DT) -> Tuple[Tensor, Tensor]:
    return tiny_batch(step, N, dtype)


def padded(step: int = 0) -> Tuple[Tensor, Tensor]:
    X, y = batch(step)
    y = y.clone()
    y[::3] = -100
    return X, y


class Tokens(nn.Module):
    """``[N, T, 4] -> [N, T, 3]``: class logits in the layout CrossEntropy needs transposed."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        return self.body(x)


class Tied(nn.Module):
    """A language model's tied embedding: ``head.weight = emb.weight``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(5, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x)))).mean(1)


def tokens(N: int = 6, vocab: int = 5, T: int = 3) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, vocab, (N, T), generator=g), torch.randint(0, vocab, (N,), generator=g)


class Scaled(nn.Module):
    """A custom module with a 0-dim parameter: ``scale * lin(x)``."""

    def __init__(self):
        super().__init__()
        self.lin = mlp()[0:1]
        self.out = nn.Linear(6, 3).double()
        self.scale = nn.Parameter(torch.tensor(1.5, dtype=DT))

    def forward(self, x):
        return self.out(torch.tanh(self.lin(x))) * self.scale


class Loop(nn.Module):
    """A cell called three times per forward (weight sharing across calls)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.inp, self.cell, self.out = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = torch.tanh(self.cell(h))
        return self.out(h)


class Checkpointed(nn.Module):
    """A block under ``torch.utils.checkpoint`` (``use_reentrant=False``), or not."""

    def __init__(self, use_checkpoint: bool = True):
        super().__init__()
        torch.manual_seed(5)
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 5), nn.Linear(5, 3)
        self.use_checkpoint = use_checkpoint

    def block(self, x):
        return torch.tanh(self.b(torch.tanh(self.a(x))))

    def forward(self, x):
        if self.use_checkpoint:
            return self.c(checkpoint(self.block, x, use_reentrant=False))
        return self.c(self.block(x))


class Recurrent(nn.Module):
    """``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` with ``batch_first=True`` and a Linear head."""

    def __init__(self, kind: type):
        super().__init__()
        torch.manual_seed(6)
        self.rnn = kind(4, 3, batch_first=True)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Bag(nn.Module):
    """An embedding bag of words: ``Embedding(7, 4, sparse=...)``, mean, Linear head."""

    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(8)
        self.emb = nn.Embedding(7, 4, sparse=sparse)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


class Unused(nn.Module):
    """A model with a layer its forward never calls."""

    def __init__(self):
        super().__init__()
        self.body = mlp()
        self.spare = nn.Linear(4, 3).double()

    def forward(self, x):
        return self.body(x)


class DictOut(nn.Module):
    """A model returning ``{"logits": ..., "aux": ...}`` (as Hugging Face models do)."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        return {"logits": self.body(x), "aux": x.sum()}


class Logits(nn.Module):
    """:class:`DictOut`'s twin returning the logits tensor."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        return self.body(x)


class TupleOut(nn.Module):
    """A model returning ``(logits, features)``."""

    def __init__(self):
        super().__init__()
        self.body = mlp()

    def forward(self, x):
        h = self.body(x)
        return h, h.detach()


def conv() -> nn.Sequential:
    torch.manual_seed(9)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(75, 3)
    ).double()


def images(N: int = 4) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(10)
    return torch.randn(N, 2, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (N,), generator=g)


# -- the rows --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    """One hostile input, the estimators it applies to and how each is checked.

    Attributes:
        id: The row id (test ids ``id[estimator]``; listed in ``docs/robustness.md``).
        input: What the user does, in the report card's words.
        report: What happens (the report card's text).
        outcome: ``"exact"``, ``"warning"``, ``"error"`` or ``"known issue"`` (xfail rows).
        estimators: Names in :data:`ESTIMATORS`.
        check: ``check(estimator)``: runs the input and asserts the outcome.
        xfail: Estimator name to the reason it fails today (a library bug; strict xfail).
    """

    id: str
    input: str
    report: str
    outcome: str
    estimators: Tuple[str, ...]
    check: Callable[[Estimator], None]
    xfail: Mapping[str, str] = field(default_factory=dict)


ROWS: List[Row] = []


def row(
    id: str,
    input: str,
    report: str,
    estimators: Sequence[str],
    outcome: str = "exact",
    xfail: Optional[Mapping[str, str]] = None,
) -> Callable[[Callable[[Estimator], None]], Callable[[Estimator], None]]:
    """Register the decorated ``check(estimator)`` as a row of the table."""

    def register(check: Callable[[Estimator], None]) -> Callable[[Estimator], None]:
        assert all(e in ESTIMATORS for e in estimators), estimators
        assert id not in {r.id for r in ROWS}, id
        ROWS.append(Row(id, input, report, outcome, tuple(estimators), check, dict(xfail or {})))
        return check

    return register


def each(names: Sequence[str], reason: str) -> Dict[str, str]:
    return {n: reason for n in names}


# ---- fixed on main: the optimizers' own curvature backward and the functions' limits ----------
@row(
    "ignore-index-sum",
    "`nn.CrossEntropyLoss(reduction='sum')` with padding targets (`ignore_index=-100`)",
    "Exact: ignored targets contribute nothing (the optimizers read the targets from your "
    "call of `loss_func`).",
    OPT + FN,
)
def _ignore_index_sum(est):
    exact(est, mlp(), ce("sum"), *padded())


@row(
    "ignore-index-mean",
    "`nn.CrossEntropyLoss()` (mean) with padding targets",
    "Clear `ValueError` naming `ignore_index` and the way out, `reduction='sum'` (the mean "
    "over the kept targets does not split into per-sample losses); for the optimizers at "
    "`step()` (at the first step; later at the next refresh, the batches' statistics "
    "skipped until then).",
    OPT + FN,
    outcome="error",
)
def _ignore_index_mean(est):
    refused(est, r"ignore_index.*reduction='sum'", mlp(), ce(), *padded())


@row(
    "transposed-output",
    "A model returning `[N, T, C]`, trained with `loss_func(out.transpose(1, 2), y)`",
    "Exact: the optimizers pull the curvature backward from the input of your `loss_func` "
    "call, so they see your transpose.",
    OPT_T2,
)
def _transposed_output(est):
    model, CE = Tokens(), ce()
    g = torch.Generator().manual_seed(2)
    X, y = torch.randn(4, 5, 4, generator=g, dtype=DT), torch.randint(0, 3, (4, 5), generator=g)

    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        loss_func(model(X).transpose(1, 2), y).backward()
        opt.step()

    oracle = Oracle(model, CE, X, y, est.fisher, forward=lambda x: model(x).transpose(1, 2))
    exact(est, model, CE, X, y, train=train, oracle=oracle)


@row(
    "autograd-grad-before-backward",
    "`torch.autograd.grad(loss, params, retain_graph=True)` (logging, a penalty) before "
    "`loss.backward()`",
    "Exact: only the gradients a backward accumulates into `.grad` count.",
    OPT_EMP,
)
def _autograd_grad_first(est):
    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        loss = loss_func(model(X), y)
        torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        loss.backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "refilled-input-buffer",
    "One input buffer refilled (`buf.copy_(chunk)`) between gradient-accumulation micro-batches",
    "Exact: the statistics are those of the union batch (`loss / k` per micro-batch).",
    OPT,
)
def _refilled_buffer(est):
    def train(opt, model, loss_func, X, y):
        buf = torch.empty(4, 4, dtype=DT)
        opt.zero_grad()
        for i in (0, 4):
            buf.copy_(X[i : i + 4])
            (loss_func(model(buf), y[i : i + 4]) / 2).backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "factor-above-max_factor_size",
    "A layer whose Kronecker factor exceeds `max_factor_size` (a 20k-wide layer; here "
    "`max_factor_size=6`)",
    "Warning naming the layer and the sizes; no large factor is formed (no stall): by "
    "default that factor is kept as its diagonal (`OneSidedBlock`), with "
    '`large_factors="per_sample_diagonal"` (checked here) the block is the exact '
    "per-sample Fisher diagonal.",
    ("KFAC-empirical", "KFAC-type-2", "EKFAC-type-2", "kfac()", "ekfac()"),
    outcome="warning",
)
def _max_factor_size(est):
    model, CE, (X, y) = mlp(), ce(), batch()
    with pytest.warns(UserWarning, match=r"max_factor_size=6.*'2'"):
        result = measure(
            est, model, CE, X, y, max_factor_size=6, large_factors="per_sample_diagonal"
        )
    oracle = Oracle(model, CE, X, y, est.fisher)
    compare(est, result, oracle, only=["0"])
    ref = torch.cat([oracle.diag["2.weight"], oracle.diag["2.bias"][:, None]], 1)
    if est.optimizer:
        assert "2" not in result.factors()
        got = dict(zip(oracle.names, result.matvec([torch.ones_like(p) for p in params_of(model)])))
        got = torch.cat([got["2.weight"], got["2.bias"][:, None]], 1)
    else:
        assert "2" not in result.factors
        got = result.diagonals["2"]
    close(got, ref, f"{est.name} diagonal of '2'")


# ---- fixed in issue 16: tied weights, 0-dim parameters, empty batches, recurrent layers, ... ---
def exact_or_named(
    est: Estimator,
    model: nn.Module,
    loss_func: nn.Module,
    X: Any,
    y: Tensor,
    *,
    odd: Sequence[str],
    pattern: str,
    oracle: Optional[Oracle] = None,
) -> None:
    """Parameters ``odd`` that a layer rule may not cover (tied, 0-dim, recurrent, pruned).

    Either a ``ValueError`` whose message matches ``pattern`` (naming the layer or
    parameter), or: per-sample gradients and diagonals are exact for every parameter; the
    other estimators leave only odd parameters out (``uncovered``), with a warning matching
    ``pattern``; the Kronecker ones are exact on the layers without odd parameters and, on
    the odd parameters they cover, ``matvec`` equals the oracle's block (an exact block);
    DiagonalNaturalGradient's diagonal is exact on every parameter it covers.
    """
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        try:
            result = measure(est, model, loss_func, X, y)
        except ValueError as e:
            assert re.search(pattern, str(e)), f"{type(e).__name__}: {e}"
            return
    oracle = oracle or Oracle(model, loss_func, X, y, est.fisher)
    if est.kind in ("per_sample_grads", "diag_ggn"):
        compare(est, result, oracle)
        return
    odd_ids = {id(p) for n, p in model.named_parameters() if n in odd}
    plain = [
        n for n, m in oracle.layers.items() if not any(id(p) in odd_ids for p in m.parameters())
    ]
    uncovered = set(result.uncovered)
    assert uncovered <= set(odd), sorted(uncovered)
    if uncovered:
        assert warned(rec, pattern), [str(r.message) for r in rec]
    if est.diagonal:  # every covered parameter: its exact Fisher diagonal
        compare(est, result, oracle, only=[n for n in oracle.names if n not in uncovered])
        return
    compare(est, result, oracle, only=plain)
    covered = [n for n in odd if n not in uncovered]
    if covered:  # their block must be exact
        ix = oracle.flat_positions(covered)
        P = oracle.dense().shape[0]
        cols = []
        for i in ix.tolist():
            e = torch.zeros(P, dtype=DT)
            e[i] = 1
            v = [
                t.view_as(oracle.per_sample[n][0]) for t, n in zip(_split(e, oracle), oracle.names)
            ]
            cols.append(torch.cat([t.reshape(-1) for t in result.matvec(v)]))
        M = torch.stack(cols, 1)[ix]
        close(M, oracle.dense()[ix][:, ix], f"{est.name} block of {covered}")


def _split(flat: Tensor, oracle: Oracle) -> List[Tensor]:
    sizes = [oracle.per_sample[n][0].numel() for n in oracle.names]
    return list(flat.split(sizes))


@row(
    "tied-weights",
    "Tied weights: `head.weight = emb.weight` (a language model's tied embedding)",
    "Per-sample gradients, norms, Gram matrix, `diag_ggn()` and DNG exact (the sums over "
    "both uses); `kfac()`, `ekfac()`, KFAC and EKFAC give the tied layers no Kronecker "
    "block and a warning names the parameter and its layers (the optimizers: plain "
    "gradient; `unsupported='diagonal'` for its exact diagonal, `'error'` to refuse).",
    ("KFAC-empirical",) + OPT_T2 + FN,
    outcome="warning",
)
def _tied(est):
    model, CE, (X, y) = Tied().double(), ce(), tokens()
    exact_or_named(est, model, CE, X, y, odd=["emb.weight"], pattern=r"emb\.weight|tied|shared")
    if est.kind == "per_sample_grads":
        oracle = Oracle(model, CE, X, y)
        flat = torch.cat([oracle.per_sample[n].flatten(1) for n in oracle.names], 1)
        with curvature.capture(model) as cap:
            out = model(X)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        close(cap.per_sample_grad_norms(losses), flat.norm(dim=1), "norms")
        close(cap.gram(losses), flat @ flat.T, "Gram matrix")


@row(
    "0-dim-parameter",
    "A custom module with a 0-dim `nn.Parameter` (a learned scalar `scale * f(x)`)",
    "Exact: per-sample gradients `[N]` for the scalar; the Kronecker estimators give the "
    "module an exact block.",
    ("KFAC-empirical",) + OPT_T2 + FN,
    outcome="warning",
)
def _zero_dim(est):
    exact_or_named(est, Scaled(), ce(), *batch(), odd=["scale"], pattern=r"\bscale\b")


def _empty_ok(est: Estimator, result: Any, model: nn.Module, before: List[Tensor]) -> None:
    """An empty batch that did not raise: nothing computed from nothing, nothing moved."""
    if est.kind == "per_sample_grads":
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert list(result) == names and all(v.shape[0] == 0 for v in result.values())
    elif est.optimizer:
        assert all(torch.equal(p, q) for p, q in zip(params_of(model), before))
    else:
        pytest.fail(f"{est.name} of an empty batch returned {type(result).__name__}")


@row(
    "empty-batch",
    "An empty batch (`N = 0`, e.g. the last batch of a filtered loader)",
    "`kfac()`, `ekfac()`, `diag_ggn()`: a clear `ValueError` saying the batch is empty; "
    "`per_sample_grads`: empty results; the optimizers: no statistics, the parameters "
    "unchanged.",
    ALL,
    outcome="error",
)
def _empty(est):
    model, CE = mlp(), ce("sum")
    X, y = batch(N=0)
    before = params_of(model)
    try:
        result = (
            measure(est, model, CE, X, y, lr=0.1) if est.optimizer else est.run(model, CE, X, y)
        )
    except ValueError as e:
        assert re.search(r"(?i)empty|N = 0|no samples", str(e)), str(e)
        return
    _empty_ok(est, result, model, before)


def _recurrent(kind: type) -> Callable[[Estimator], None]:
    def check(est):
        model = Recurrent(kind).double()
        X, y = sequences()
        odd = [n for n, _ in model.named_parameters() if n.startswith("rnn.")]
        exact_or_named(est, model, ce(), X, y, odd=odd, pattern=rf"rnn|{kind.__name__}")

    return check


for _kind in (nn.LSTM, nn.GRU, nn.RNN):
    row(
        f"{_kind.__name__.lower()}-batch-first",
        f"`nn.{_kind.__name__}(batch_first=True)` with a Linear head",
        "Exact: per-sample gradients by replaying each sample, an exact curvature block in "
        "the Kronecker estimators (up to 4096 parameters), exact diagonals.",
        ("KFAC-type-2", "DNG-type-2", "kfac()", "diag_ggn()", "per_sample_grads"),
        outcome="exact",
    )(_recurrent(_kind))


class StackedLSTM(nn.Module):
    """Two LSTM layers with dropout between them."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.rnn = nn.LSTM(4, 3, num_layers=2, dropout=0.5, batch_first=True)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


class Packed(nn.Module):
    """A GRU over a ``PackedSequence`` of lengths 3, 2, 2, 1."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(6)
        self.rnn = nn.GRU(4, 3, batch_first=True)
        self.head = nn.Linear(3, 3)

    def forward(self, x):
        lengths = torch.tensor([3, 2, 2, 1])
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        return self.head(self.rnn(packed)[1][0])


def sequences(N: int = 4) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(N, 3, 4, generator=g, dtype=DT), torch.randint(0, 3, (N,), generator=g)


_RECURRENT = ("KFAC-empirical", "KFAC-type-2", "DNG-type-2", "kfac()", "diag_ggn()")


@row(
    "lstm-dropout-between-layers",
    "`nn.LSTM(num_layers=2, dropout=0.5)` in train mode",
    "Clear `ValueError` naming `dropout=0.5` and the way out (eval mode or `dropout=0`): "
    "its random masks cannot be replayed per sample.",
    _RECURRENT + ("per_sample_grads",),
    outcome="error",
)
def _lstm_dropout(est):
    refused(
        est,
        r"LSTM\(dropout=0.5\).*eval mode.*dropout=0",
        StackedLSTM().double(),
        ce(),
        *sequences(),
    )


@row(
    "packed-sequence",
    "A recurrent layer fed a `PackedSequence`",
    "Clear `ValueError` naming the layer type and the way out (a padded batch, or freeze "
    "the layer).",
    _RECURRENT + ("per_sample_grads",),
    outcome="error",
)
def _packed(est):
    refused(est, r"GRU got a PackedSequence.*padded batch", Packed().double(), ce(), *sequences())


@row(
    "sparse-embedding",
    "`nn.Embedding(sparse=True)` (sparse `.grad`)",
    "Exact: the same as `sparse=False` (the twin); the optimizers densify its gradient.",
    ("KFAC-empirical", "KFAC-type-2", "DNG-empirical", "kfac()", "diag_ggn()", "per_sample_grads"),
)
def _sparse_embedding(est):
    g = torch.Generator().manual_seed(12)
    X, y = torch.randint(0, 7, (5, 3), generator=g), torch.randint(0, 3, (5,), generator=g)
    results, models = [], []
    for sparse in (True, False):
        model = Bag(sparse).double()
        try:
            if est.optimizer:
                opt = est.build(model, ce(), lr=0.1)
                for _ in range(2):
                    step_on(opt, model, X, y)
                results.append(opt)
            else:
                results.append(est.run(model, ce(), X, y))
        except ValueError as e:
            assert sparse and re.search(r"emb.*sparse|sparse.*emb", str(e)), str(e)
            return
        models.append(model)
    same_result(est, *results, rtol=1e-12, atol=1e-14)
    for p, q in zip(*[params_of(m) for m in models]):
        close(p, q, "parameters after two steps", rtol=1e-12, atol=1e-14)


@row(
    "add_param_group-outside-the-model",
    "`optim.add_param_group({'params': [p]})` with a parameter that is not the model's",
    "Clear `ValueError` naming the group and the way out (its own optimizer, or make it a "
    "model parameter); never a parameter that silently does not train.",
    ("KFAC-empirical", "EKFAC-empirical", "DNG-empirical"),
    outcome="error",
)
def _add_param_group(est):
    opt = est.build(mlp(), None, lr=0.1)
    extra = nn.Parameter(torch.zeros(3, dtype=DT))
    with pytest.raises(ValueError, match=r"not a parameter of the model.*own optimizer"):
        opt.add_param_group({"params": [extra]})


def step_on(opt, model: nn.Module, X: Tensor, y: Tensor) -> None:
    """:func:`train_step` with the optimizer's own loss module (a fresh one if it has none)."""
    train_step(opt, model, opt.loss_func or ce(), X, y)


def _trained(est: Estimator, model: nn.Module, steps: int = 2, **kw: Any):
    opt = est.build(model, ce(), lr=0.1, momentum=0.5, **kw)
    for s in range(steps):
        step_on(opt, model, *batch(s))
    return opt


@row(
    "load_state_dict-other-widths",
    "`load_state_dict` of a state saved on a model of other layer widths",
    "Clear `ValueError` naming the block, the saved and expected shapes (not a shape error "
    "one step later).",
    ("KFAC-empirical", "EKFAC-empirical", "DNG-empirical"),
    outcome="error",
)
def _load_other_widths(est):
    state = _trained(est, mlp()).state_dict()
    wide = nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    opt = est.build(wide, ce(), lr=0.1)
    with pytest.raises(ValueError, match=r"'0(\.weight)?'.*saved shape.*expected"):
        opt.load_state_dict(state)


def _with_prefix(state: Dict[str, Any], prefix: str = "_orig_mod.") -> Dict[str, Any]:
    """The state as the optimizer of a ``torch.compile``'d model saved it (older versions)."""
    state = copy.deepcopy(state)
    curv = state["curvature"]
    for key in ("blocks", "diag", "terms", "diagonals"):
        if key in curv:
            curv[key] = {
                (prefix + k[0], k[1]) if isinstance(k, tuple) else prefix + k: v
                for k, v in curv[key].items()
            }
    return state


@row(
    "load_state_dict-compiled-prefix",
    "Resume the plain model from a state whose block names carry `torch.compile`'s "
    "`_orig_mod.` prefix",
    "Exact: the resumed run equals the uninterrupted one, bit for bit.",
    ("KFAC-empirical", "EKFAC-type-2", "DNG-empirical"),
)
def _load_compiled_prefix(est):
    model = mlp()
    opt = _trained(est, model)
    saved_model, saved_state = copy.deepcopy(model.state_dict()), _with_prefix(opt.state_dict())
    for s in (2, 3):
        step_on(opt, model, *batch(s))
    resumed = mlp(seed=9)
    resumed.load_state_dict(saved_model)
    opt2 = est.build(resumed, ce(), lr=0.1, momentum=0.5)
    opt2.load_state_dict(saved_state)
    for s in (2, 3):
        step_on(opt2, resumed, *batch(s))
    for p, q in zip(params_of(resumed), params_of(model)):
        assert torch.equal(p, q)


@row(
    "load_state_dict-other-optimizer",
    "`load_state_dict` of a state saved by another optimizer class",
    "KFAC <-> EKFAC: the factors carry over (EKFAC's corrections dropped with a warning); "
    "DiagonalNaturalGradient <-> KFAC/EKFAC: clear `ValueError` naming both classes.",
    ("KFAC-empirical", "EKFAC-empirical", "DNG-empirical"),
    outcome="error",
)
def _load_other_class(est):
    source = {"KFAC": "DNG", "EKFAC": "KFAC", "DNG": "KFAC"}[est.name.split("-")[0]]
    src_est = ESTIMATORS[f"{source}-empirical"]
    src = _trained(src_est, mlp())
    opt = est.build(mlp(), ce(), lr=0.1)
    if est.diagonal or src_est.diagonal:
        src_name = src_est.cls.__name__
        with pytest.raises(ValueError, match=rf"saved by {src_name}.*loads only into"):
            opt.load_state_dict(src.state_dict())
        return
    opt.load_state_dict(src.state_dict())
    same_result(est, opt, src)


@row(
    "training-in-eval-mode",
    "Training a model left in `model.eval()` mode",
    "Warning (once) that no curvature statistics were collected, naming the layers and "
    "eval mode; the steps are plain `-lr g`.",
    OPT,
    outcome="warning",
)
def _eval_mode(est):
    model = mlp().eval()
    opt = est.build(model, ce(), lr=0.1)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for s in range(2):
            opt.zero_grad()
            (opt.loss_func or ce())(model(batch(s)[0]), batch(s)[1]).backward()
            before, grads = params_of(model), [p.grad.clone() for p in model.parameters()]
            opt.step()
            for p, q, g in zip(params_of(model), before, grads):
                close(p, q - 0.1 * g, "plain step", rtol=0, atol=1e-15)
    assert warned(rec, r"no curvature statistics.*eval mode"), [str(r.message) for r in rec]


# ---- beyond the list -------------------------------------------------------------------
@row(
    "gradient-checkpointing",
    "A block under `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`",
    "Exact (the recomputation in the backward records nothing twice); sampled Fisher types "
    "draw the same as without checkpointing.",
    OPT + SAMPLED + FN,
)
def _checkpointing(est):
    X, y = batch()
    plain = Checkpointed(use_checkpoint=False).double()
    if est.fisher in ("mc", "rademacher"):  # the twin without checkpointing draws the same
        twins = [measure(est, Checkpointed(c).double(), ce(), X, y) for c in (True, False)]
        same_result(est, *twins, rtol=1e-12, atol=1e-14)
        return
    model = Checkpointed().double()
    exact(est, model, ce(), X, y, oracle=Oracle(plain, ce(), X, y, est.fisher))


@row(
    "observer-forward-hook",
    "Another library's forward hook that only observes (activation statistics, logging)",
    "Exact.",
    ALL,
)
def _observer_hook(est):
    model, seen = mlp(), []
    for m in model:
        m.register_forward_hook(lambda m, a, o: seen.append(o.detach().norm()))
    exact(est, model, ce(), *batch())
    assert seen


@row(
    "observer-forward-pre-hook",
    "Another library's forward pre-hook that only observes (returns `None`)",
    "Exact.",
    ALL,
)
def _observer_pre_hook(est):
    model, seen = mlp(), []
    for m in model:
        m.register_forward_pre_hook(lambda m, a: seen.append(a[0].shape))
    exact(est, model, ce(), *batch())
    assert seen


@row(
    "full-backward-hook",
    "`register_full_backward_hook` on every layer (as opacus-style libraries do)",
    "Exact.",
    ALL,
)
def _full_backward_hook(est):
    model, seen = mlp(), []
    for m in model:
        m.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].norm()))
    exact(est, model, ce(), *batch())


@row(
    "output-replacing-forward-hook",
    "A forward hook that returns a new output (`lambda m, a, out: 2 * out`)",
    "Exact: the engine records the layer's own output (its hook runs before yours), so the "
    "hook's factor is part of the backpropagated gradient.",
    ALL,
    outcome="exact",
)
def _replacing_hook(est):
    model = mlp()
    model[0].register_forward_hook(lambda m, a, out: 2.0 * out)
    exact(est, model, ce(), *batch())


@row(
    "in-place-output-hook",
    "A forward hook that scales the output in place (`out.mul_(2)`)",
    "Exact, as for an output-replacing hook.",
    ("KFAC-empirical", "DNG-type-2", "kfac()", "diag_ggn()", "per_sample_grads"),
    outcome="exact",
)
def _inplace_hook(est):
    model = mlp()
    model[0].register_forward_hook(lambda m, a, out: out.mul_(2.0))
    exact(est, model, ce(), *batch())


@row(
    "profiler",
    "`torch.profiler.profile()` around the training step",
    "Exact.",
    OPT + ("kfac()", "per_sample_grads"),
)
def _profiler(est):
    with torch.profiler.profile():
        exact(est, mlp(), ce(), *batch())


@row(
    "requires_grad-toggled",
    "`requires_grad_(False)` on a layer mid-run, then `requires_grad_(True)` again",
    "Warning at each change (the curvature is reset, the step of the change takes the plain "
    "gradient); the frozen layer does not move; the steps after the change are exact again.",
    OPT,
    outcome="warning",
)
def _toggled(est):
    model = mlp()
    opt = est.build(model, ce(), lr=0.1)
    step_on(opt, model, *batch(0))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        model[0].requires_grad_(False)
        frozen = params_of(model)[:2]
        step_on(opt, model, *batch(1))
        assert all(torch.equal(p, q) for p, q in zip(params_of(model)[:2], frozen))
        model[0].requires_grad_(True)
        step_on(opt, model, *batch(2))
    assert sum(warned([r], "trainable parameters changed") for r in rec) == 2
    for g in opt.param_groups:
        g["lr"] = 0.0
    X, y = batch(3)
    step_on(opt, model, X, y)  # the first statistics after the reset
    compare(est, opt, Oracle(model, ce(), X, y, est.fisher))


@row(
    "frozen-layer",
    "A layer frozen with `requires_grad_(False)` before the call",
    "Exact over the trainable parameters; the frozen ones are left out.",
    FN,
)
def _frozen(est):
    model = mlp()
    model[0].requires_grad_(False)
    exact(est, model, ce(), *batch())


@row(
    "evaluation-forwards",
    "`torch.no_grad()`, `torch.inference_mode()` and `model.eval()` forwards between steps "
    "and between a forward and its backward",
    "Exact: only training forwards with gradients count.",
    OPT,
)
def _evaluation_forwards(est):
    X2, _ = batch(5)

    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        with torch.no_grad():
            model(X2)
        with torch.inference_mode():
            model(X2)
        model.eval()
        model(X2).sum()
        model.train()
        out = model(X)
        with torch.no_grad():
            model(X2)
        model.eval()
        model(X2)
        model.train()
        loss_func(out, y).backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "training-forwards-without-backward",
    "Training-mode forwards with gradients on that are never backpropagated (a training "
    "accuracy on another batch before the forward, a validation loss with `loss_func` after "
    "the backward)",
    "Exact: only forwards that a backward reaches count (the curvature backward of type-2 / "
    "mc still runs for the others; mc draws samples for it).",
    OPT,
)
def _forwards_without_backward(est):
    X2, y2 = batch(5)

    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        (model(X2 * 3).argmax(1) == y2).float().mean()
        loss_func(model(X), y).backward()
        loss_func(model(X2), y2).item()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "submodule-called-in-a-loop",
    "A submodule called several times per forward (a cell in a Python loop)",
    "Exact: per-sample gradients sum over the calls; KFAC treats the calls as shared "
    "positions (`kfac_approx='expand'`).",
    ALL,
)
def _loop(est):
    exact(est, Loop().double(), ce(), *batch())


@row(
    "input-requires-grad",
    "Inputs with `requires_grad=True` (adversarial training, input saliency)",
    "Exact.",
    ALL,
)
def _input_requires_grad(est):
    X, y = batch()
    exact(
        est,
        mlp(),
        ce(),
        X.clone().requires_grad_(True),
        y,
        oracle=Oracle(mlp(), ce(), X, y, est.fisher),
    )


@row(
    "input-gradient-penalty",
    "An input-gradient penalty: `gx = autograd.grad(loss, x, create_graph=True)`, then "
    "`(loss + gx.pow(2).sum()).backward()`",
    "type-2: exact (the curvature of `loss_func`). `'empirical'`: a warning that the "
    "statistics include the penalty's backward (use `fisher='type-2'`).",
    OPT,
    outcome="warning",
)
def _penalty(est):
    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        Xr = X.clone().requires_grad_(True)
        loss = loss_func(model(Xr), y)
        (gx,) = torch.autograd.grad(loss, Xr, create_graph=True)
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            (loss + gx.pow(2).sum()).backward()
            opt.step()
        if est.fisher == "empirical" and warned(rec, r"(?i)create_graph|double backward|penalty"):
            pytest.skip("warned")  # the accepted alternative to the exact loss statistics

    exact(est, mlp(), ce(), *batch(), train=train)


BF16 = dict(rtol=3e-2, atol=3e-3)


@row(
    "bf16-autocast",
    "CPU autocast: `torch.autocast('cpu', dtype=torch.bfloat16)` around the forward",
    "Within bfloat16 accuracy of the float64 definitions; the optimizers keep float32 factors.",
    OPT + FN,
)
def _bf16(est):
    X, y = batch()
    model = mlp().float()
    oracle = Oracle(mlp(), ce(), X, y, est.fisher)
    Xf = X.float()
    if est.optimizer:
        CE = ce()
        opt = est.build(model, CE)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = CE(model(Xf), y)
        loss.backward()
        opt.step()
        result = opt
        if not est.diagonal:
            assert all(t.dtype == torch.float32 for AG in opt.factors().values() for t in AG)
    else:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            result = est.run(model, ce(), Xf, y)
    if est.kind == "ekfac":
        est = ESTIMATORS["kfac()"]  # the corrections' eigenbasis is not defined to bf16 accuracy
    compare(est, result, oracle, tol=BF16)


@row(
    "zero_grad-set_to_none-False",
    "`optim.zero_grad(set_to_none=False)`: stale `.grad` tensors zeroed, not freed",
    "Exact.",
    OPT,
)
def _set_to_none_false(est):
    def train(opt, model, loss_func, X, y):
        for _ in range(2):  # the second step starts from zeroed, existing .grad tensors
            opt.zero_grad(set_to_none=False)
            loss_func(model(X), y).backward()
            opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "backward-discarded-by-zero_grad",
    "An extra forward/backward (validation gradient, logging) before `optim.zero_grad()`",
    "Exact: `zero_grad()` drops the statistics of the gradients it zeroes (a forward whose "
    "backward ran before it); a forward whose backward comes after `zero_grad()` counts.",
    OPT,
    outcome="exact",
)
def _discarded(est):
    X2, y2 = batch(7)

    def train(opt, model, loss_func, X, y):
        loss_func(model(X2), y2).backward()
        opt.zero_grad()
        loss_func(model(X), y).backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "backward-discarded-by-model-zero_grad",
    "An extra forward/backward (validation gradient) cleared by `model.zero_grad()`, "
    "another optimizer's `zero_grad()` or `p.grad = None` instead of `optim.zero_grad()`",
    "Exact: at the next forward a parameter that backward filled (its witness) has no "
    "`.grad`, so its statistics go as with `optim.zero_grad()` (before, they stayed in the "
    "step). Not seen: `model.zero_grad(set_to_none=False)` (zeroes in place).",
    OPT + ("KFAC-mc", "DNG-mc"),
    outcome="exact",
)
def _discarded_elsewhere(est):
    X2, y2 = batch(7)
    for clear in ("model", "params"):

        def train(opt, model, loss_func, X, y, clear=clear):
            opt.zero_grad()
            loss_func(model(X2), y2).backward()
            if clear == "model":
                model.zero_grad()
            else:
                for p in model.parameters():
                    p.grad = None
            loss_func(model(X), y).backward()
            opt.step()

        if est.fisher == "mc":  # the draws of the discarded forward come first: the twin
            twin = measure(est, mlp(), ce(), *batch(), train=_discarded_twin(X2, y2))
            same_result(est, measure(est, mlp(), ce(), *batch(), train=train), twin)
        else:
            exact(est, mlp(), ce(), *batch(), train=train)


def _discarded_twin(X2: Tensor, y2: Tensor) -> Callable[..., None]:
    def train(opt, model, loss_func, X, y):  # the same loop with optim.zero_grad()
        opt.zero_grad()
        loss_func(model(X2), y2).backward()
        opt.zero_grad()
        loss_func(model(X), y).backward()
        opt.step()

    return train


def _nan_batch() -> Tuple[Tensor, Tensor]:
    X, y = batch(6)
    X = X.clone()
    X[3, 1] = float("nan")
    return X, y


def _curvature_now(est: Estimator, opt) -> List[Tensor]:
    if est.diagonal:
        return [d.clone() for d in opt.diagonal_.values()]
    return [t.clone() for AG in opt.factors().values() for t in AG]


@row(
    "nan-in-one-batch",
    "A batch with a NaN input",
    "Optimizers: the statistics skipped and counted (`skipped_statistics`), the "
    "parameters and the curvature unchanged, training goes on; the warning comes at the next "
    "refresh or when `skipped_statistics` is read (the step itself does not wait for the "
    "device). `per_sample_grads`: the other "
    "samples exact. `kfac()`/`diag_ggn()`: NaN in the result (never a finite wrong number).",
    OPT + ("kfac()", "diag_ggn()", "per_sample_grads"),
    outcome="warning",
)
def _nan(est):
    model, CE = mlp(), ce()
    Xn, y = _nan_batch()
    if est.kind == "per_sample_grads":
        got = curvature.per_sample_grads(model, CE, Xn, y)
        keep = torch.tensor([i for i in range(8) if i != 3])
        oracle = Oracle(model, CE, Xn[keep], y[keep])
        compare(est, {n: v[keep] for n, v in got.items()}, oracle)
        assert all(not torch.isfinite(v[3]).all() for n, v in got.items() if n.startswith("0."))
        return
    if not est.optimizer:
        result = est.run(model, CE, Xn, y)
        values = result.values() if isinstance(result, dict) else sum(result.factors.values(), ())
        assert any(not torch.isfinite(v).all() for v in values)
        return
    opt = est.build(model, CE, lr=0.1)
    train_step(opt, model, CE, *batch(0))
    before, curv = params_of(model), _curvature_now(est, opt)
    with pytest.warns(UserWarning, match="non-finite"):
        train_step(opt, model, CE, Xn, y)
        assert opt.skipped_statistics >= 1  # the reading warns
    assert all(torch.equal(p, q) for p, q in zip(params_of(model), before))
    assert all(torch.equal(a, b) for a, b in zip(_curvature_now(est, opt), curv))
    train_step(opt, model, CE, *batch(1))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@row(
    "batch-of-one",
    "A batch of one sample",
    "Exact (the Kronecker blocks equal the GGN blocks there).",
    ALL,
)
def _batch_of_one(est):
    exact(est, mlp(), ce(), *batch(N=1))


@row(
    "loss-times-zero",
    "`(loss * 0).backward()` (a loss switched off by a schedule)",
    "The parameters do not move; empirical statistics are zero (finite, with pi damping "
    "too); type-2 statistics are those of `loss_func` (exact).",
    OPT,
)
def _loss_times_zero(est):
    model, CE, (X, y) = mlp(), ce(), batch()
    opt = est.build(model, CE, lr=0.1)
    before = params_of(model)
    for _ in range(2):
        opt.zero_grad()
        (CE(model(X), y) * 0).backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params_of(model), before))
    if est.fisher == "empirical":
        if est.diagonal:
            assert all(not d.any() for d in opt.diagonal_.values())
        else:
            assert all(not G.any() for _, G in opt.factors().values())
    else:
        compare(est, opt, Oracle(model, CE, X, y, est.fisher))
    train_step(opt, model, CE, *batch(1))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@row(
    "dict-output",
    "A model returning a dict, trained with `loss_func(out['logits'], y)`",
    "Optimizers: exact (the curvature backward starts at the tensor your `loss_func` call "
    "received). The functions: a clear error naming the output type; pass a wrapper that "
    "returns the logits.",
    ("KFAC-empirical", "KFAC-type-2", "EKFAC-type-2", "DNG-type-2", "KFAC-mc")
    + ("kfac()", "diag_ggn()", "per_sample_grads"),
    outcome="error",
)
def _dict_output(est):
    X, y = batch()
    if not est.optimizer:
        model = DictOut()
        with pytest.raises((ValueError, TypeError), match=r"(?i)output.*dict|dict.*output"):
            est.run(model, ce(), X, y)
        return

    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        loss_func(model(X)["logits"], y).backward()
        opt.step()

    if est.fisher == "mc":  # the same draws as a model returning the logits
        a = measure(est, DictOut(), ce(), X, y, train=train)
        b = measure(est, Logits(), ce(), X, y)
        same_result(est, a, b)
        return
    model = DictOut()
    oracle = Oracle(model, ce(), X, y, est.fisher, forward=lambda x: model(x)["logits"])
    exact(est, model, ce(), X, y, train=train, oracle=oracle)


@row(
    "tuple-output-register_output",
    "A model returning `(logits, features)`, the curvature output named with "
    "`optim.register_output(logits, loss_func, y)` (`auto_output=False`)",
    "Exact.",
    OPT_T2,
)
def _tuple_output(est):
    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        logits, _ = model(X)
        opt.register_output(logits, loss_func, y)
        loss_func(logits, y).backward()
        opt.step()

    model, (X, y) = TupleOut(), batch()
    oracle = Oracle(model, ce(), X, y, est.fisher, forward=lambda x: model(x)[0])
    exact(est, model, ce(), X, y, train=train, oracle=oracle, auto_output=False)


@row(
    "clip_grad_norm",
    "`torch.nn.utils.clip_grad_norm_` between `backward()` and `step()`",
    "Exact: the statistics are the unclipped per-sample ones; the step preconditions the "
    "clipped gradient.",
    OPT_EMP + ("KFAC-type-2",),
)
def _clip(est):
    model, CE, (X, y) = mlp(), ce(), batch()
    opt = est.build(model, CE, lr=0.1)
    opt.zero_grad()
    CE(model(X), y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    clipped, before = [p.grad.clone() for p in model.parameters()], params_of(model)
    opt.step()
    compare(est, opt, Oracle(mlp(), CE, X, y, est.fisher))
    for p, q, d in zip(params_of(model), before, opt.inverse_matvec(clipped)):
        close(p, q - 0.1 * d, "the step", rtol=1e-12, atol=1e-14)


@row(
    "analysis-call-on-a-live-optimizers-model",
    "`curvature.kfac(model, ...)` / `per_sample_grads(model, ...)` (monitoring) on the model "
    "an optimizer is attached to",
    "Exact: the functions' own forwards and pulls are isolated from the optimizer's hooks "
    "(`curvature.capture.isolated`), so the optimizer's next step is unaffected.",
    OPT + FN,
    outcome="exact",
)
def _analysis(est):
    X2, y2 = batch(8)
    if not est.optimizer:  # the function's result, with an optimizer attached
        model = mlp()
        opt = ESTIMATORS["KFAC-empirical"].build(model, ce())
        opt.zero_grad()
        exact(est, model, ce(), *batch())
        return

    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        curvature.kfac(model, ce(), (X2, y2))
        curvature.per_sample_grads(model, ce(), X2, y2)
        loss_func(model(X), y).backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "pruned-layer",
    "A layer pruned with `torch.nn.utils.prune` (`weight_orig` and a mask)",
    "A clear error naming the layer and its pruning: compute curvature before pruning, or "
    "after `prune.remove(module, 'weight')` (which stops enforcing the mask).",
    ALL,
    outcome="error",
)
def _pruned(est):
    model = mlp()
    prune.random_unstructured(model[0], "weight", amount=0.5)
    exact_or_named(
        est, model, ce(), *batch(), odd=["0.weight_orig"], pattern=r"'0'.*(prun|weight_orig)"
    )


@row(
    "parametrized-weight",
    "A parametrized weight (`torch.nn.utils.parametrizations.weight_norm`)",
    "A clear error naming the layer and its parametrization: use plain weights "
    "(`parametrize.remove_parametrizations`) or freeze the layer.",
    ALL,
    outcome="error",
)
def _parametrized(est):
    model = mlp()
    parametrizations.weight_norm(model[2])
    odd = [n for n, _ in model.named_parameters() if "parametrizations" in n]
    exact_or_named(est, model, ce(), *batch(), odd=odd, pattern=r"'2'.*parametriz")


@row(
    "label-smoothing",
    "`nn.CrossEntropyLoss(label_smoothing=0.1)`",
    "Exact (the smoothed targets in the empirical Fisher; the GGN does not depend on them).",
    ("KFAC-empirical", "KFAC-type-2", "DNG-empirical") + FN,
)
def _label_smoothing(est):
    exact(est, mlp(), ce(label_smoothing=0.1), *batch())


@row(
    "soft-targets",
    "Class-probability targets (`y` of shape `[N, C]`, mixup / distillation)",
    "Exact.",
    ("KFAC-empirical", "KFAC-type-2", "EKFAC-empirical", "DNG-empirical") + FN,
)
def _soft_targets(est):
    X, _ = batch()
    g = torch.Generator().manual_seed(13)
    y = torch.randn(8, 3, generator=g, dtype=DT).softmax(1)
    exact(est, mlp(), ce(), X, y)


@row(
    "class-weights",
    "`nn.CrossEntropyLoss(weight=w)` (class weights)",
    "Clear `ValueError` naming `weight=`: the weighted mean does not split into per-sample "
    "losses; the way out: `weight=None` and reweight the per-sample losses yourself.",
    OPT + FN,
    outcome="error",
)
def _class_weights(est):
    CE = ce(weight=torch.tensor([1.0, 2.0, 0.5], dtype=DT))
    refused(est, r"weight=.*does not split into per-sample losses", mlp(), CE, *batch())


@row(
    "channels-last-input",
    "A convolution fed `channels_last` inputs (`X.to(memory_format=torch.channels_last)`)",
    "Exact: the same as contiguous inputs (the twin).",
    ("KFAC-empirical", "KFAC-type-2", "DNG-empirical") + FN,
)
def _channels_last(est):
    X, y = images()
    a = measure(est, conv(), ce(), X.to(memory_format=torch.channels_last), y)
    b = measure(est, conv(), ce(), X, y)
    same_result(est, a, b, rtol=1e-12, atol=1e-14)
    if est.kind == "per_sample_grads":
        compare(est, a, Oracle(conv(), ce(), X, y))


@row(
    "unused-layer",
    "A layer the forward never calls",
    "Its parameters get no curvature (zeros in `diag_ggn()`, `uncovered` in `kfac()`, "
    "plain/zero gradient with a warning in the optimizers, zeros in `per_sample_grads`); "
    "the rest exact.",
    ("KFAC-type-2", "DNG-empirical") + FN,
    outcome="warning",
)
def _unused(est):
    model, CE, (X, y) = Unused(), ce(), batch()
    oracle = Oracle(model, CE, X, y, est.fisher)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        result = measure(est, model, CE, X, y)
        if est.optimizer:
            train_step(result, model, CE, X, y)
    if est.kind in ("per_sample_grads", "diag_ggn"):
        compare(est, result, oracle)
        return
    used = [n for n in oracle.names if n.startswith("body.")]
    if est.diagonal:
        compare(est, result, oracle, only=used)
    else:
        compare(est, result, oracle, only=["body.0", "body.2"])
    assert warned(rec, r"spare"), [str(r.message) for r in rec]


@row(
    "dtype-changed-after-construction",
    "`model.double()` after the optimizer was built on the float32 model",
    "Exact to float32 accuracy: the optimizer follows the parameters (same objects), EKFAC's "
    "corrections included.",
    OPT,
    outcome="warning",
)
def _dtype_changed(est):
    model, CE = mlp(dtype=torch.float32), ce()
    opt = est.build(model, CE, factor_decay=0.0)
    X, y = batch()
    train_step(opt, model, CE, X.float(), y)
    model.double()
    X2, y2 = batch(1)
    train_step(opt, model, CE, X2, y2)
    compare(est, opt, Oracle(model, CE, X2, y2, est.fisher), tol=dict(rtol=1e-5, atol=1e-6))


@row(
    "global-rng-consumed",
    "The global RNG used or reseeded between steps (dropout elsewhere, data augmentation)",
    "Exact: sampled Fisher types draw from the optimizer's own generator, the same as the "
    "twin run.",
    SAMPLED,
)
def _global_rng(est):
    runs = []
    for disturb in (False, True):
        model = mlp()
        opt = est.build(model, ce(), lr=0.1)
        for s in range(2):
            if disturb:
                torch.rand(5)
                torch.manual_seed(123 + s)
            step_on(opt, model, *batch(s))
        runs.append((opt, params_of(model)))
    same_result(est, runs[0][0], runs[1][0])
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1]))


@row(
    "non-contiguous-input",
    "A non-contiguous input (a transposed view)",
    "Exact.",
    ("KFAC-empirical", "DNG-type-2", "kfac()", "per_sample_grads"),
)
def _non_contiguous(est):
    X, y = batch()
    Xt = X.T.contiguous().T
    assert not Xt.is_contiguous()
    exact(est, mlp(), ce(), Xt, y)


@row(
    "functional-loss-call",
    "The loss computed with `F.cross_entropy` instead of the `loss_func` module given to "
    "the optimizer",
    "Exact: the curvature backward then starts at the model output.",
    OPT_T2,
)
def _functional_loss(est):
    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


# ---- found by a hostile-use audit (2026-11-27): a layer's sample axis, groups, replaced params --
class SetEncoder(nn.Module):
    """``enc`` over the 3 elements of each sample, then ``head`` over their codes; with
    ``folded`` the encoder sees ``[N * 3, 4]`` (the batch folded into its rows)."""

    def __init__(self, folded: bool):
        super().__init__()
        torch.manual_seed(0)
        self.enc, self.head, self.folded = (
            nn.Linear(4, 3).double(),
            nn.Linear(9, 3).double(),
            folded,
        )

    def forward(self, x: Tensor) -> Tensor:  # [N, 3, 4]
        h = self.enc(x.reshape(-1, 4)) if self.folded else self.enc(x)
        return self.head(torch.tanh(h).reshape(x.shape[0], 9))


class FlatLogits(nn.Module):
    """A token model whose logits leave it flattened: ``[N, T, 4] -> [N * T, 3]``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.mix, self.head = nn.Linear(4, 4).double(), nn.Linear(4, 3).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(x)).cumsum(1)).reshape(-1, 3)


def sets(N: int = 6) -> Tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 3, 4, generator=g, dtype=DT), torch.randint(0, 3, (N,), generator=g)


@row(
    "batch-folded-into-rows",
    "A layer fed the batch folded into its rows: `enc(x.reshape(N * K, d))` inside the "
    "forward (a set or time-distributed encoder)",
    "DNG, EKFAC, `ekfac()`, `diag_ggn()`, `per_sample_grads`: clear `ValueError` naming the "
    "layer, its rows, the samples and the way out (`[N, K, d]` inputs: the layer then shares "
    "its weight over `K`); their squares would miss the cross terms of one sample's rows. "
    "KFAC type-2 / mc and `kfac()`: exact, the factors of the same layer on `[N, K, d]` (the "
    "clean twin); KFAC empirical too: the folded layer's `G` is normalized by its "
    "forward's samples, not its `K N` rows (before, `K` times the twin's).",
    OPT + ("KFAC-mc", "EKFAC-mc", "DNG-mc") + FN,
    outcome="error",
)
def _folded_rows(est):
    X, y = sets()
    if est.name in ("KFAC-empirical", "KFAC-type-2", "KFAC-mc", "kfac()"):
        folded = measure(est, SetEncoder(True), ce(), X, y)
        same_result(est, folded, measure(est, SetEncoder(False), ce(), X, y), rtol=1e-12, atol=0)
    elif est.kind == "per_sample_grads":
        refused_any = pytest.raises((ValueError, RuntimeError), match="different batch sizes")
        with refused_any:
            measure(est, SetEncoder(True), ce(), X, y)
    else:
        refused(est, "'enc' has 18 entries on its sample axis where", SetEncoder(True), ce(), X, y)


@row(
    "flattened-logits",
    "A model returning logits flattened to `[N * T, C]` while its layers see `[N, T, ...]` "
    "(a language model's `logits.view(-1, C)`)",
    "`ekfac()`, `diag_ggn()` (type-2): clear `ValueError` naming the layer and the way out "
    "(unflattened `[N, C, T]` logits to `CrossEntropyLoss`): each square would sum a "
    "sequence's positions, whose type-2 columns and gradients do not cancel. DNG and EKFAC "
    "(empirical, type-2): one warning (a sequence-level curvature, still a preconditioner). "
    "DNG and EKFAC (mc): no warning: independent draws per position make those sums "
    "unbiased (`diag_ggn(fisher='mc')` converges to the GGN's diagonal, "
    "tests/test_sample_axis.py).",
    ("EKFAC-empirical", "EKFAC-type-2", "EKFAC-mc", "DNG-empirical", "DNG-type-2", "DNG-mc")
    + ("ekfac()", "diag_ggn()"),
    outcome="warning",
)
def _flattened_logits(est):
    g = torch.Generator().manual_seed(8)
    X, y = torch.randn(3, 4, 4, generator=g, dtype=DT), torch.randint(0, 3, (12,), generator=g)
    if not est.optimizer:
        refused(est, "'mix' has 3 entries on its sample axis where", FlatLogits(), ce(), X, y)
        return
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        measure(est, FlatLogits(), ce(), X, y)
    hits = [r for r in rec if "sample axis" in str(r.message)]
    assert len(hits) == (0 if est.fisher == "mc" else 1), [str(r.message) for r in hits]


@row(
    "several-forwards-one-backward",
    "Two forwards in one backward: `((loss_func(model(x1), y1) + loss_func(model(x2), y2)) "
    "/ 2).backward()`",
    "Exact: the statistics of the union batch (each forward's calls fold with their own "
    "batch size; before, the empirical `G` was halved and unequal halves raised a shape "
    "error).",
    OPT,
)
def _several_forwards(est):
    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        ((loss_func(model(X[:4]), y[:4]) + loss_func(model(X[4:]), y[4:])) / 2).backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "one-loss-over-several-forwards",
    "One `loss_func` call on `torch.cat` of two forwards' outputs: "
    "`loss_func(torch.cat([model(x1), model(x2)]), y)`",
    "Warning (once) naming the loss's and the forward's sample counts and the way out (one "
    "`loss_func` call per forward, losses summed): the first forward's curvature backward "
    "ran from its own output when the second began, so the pulled Fisher types weight the "
    "halves unequally (type-2 `G` at 2/3 of the union's). Empirical: exact (your "
    "gradients).",
    OPT + ("KFAC-mc",),
    outcome="warning",
)
def _joined_outputs(est):
    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        loss_func(torch.cat([model(X[:4]), model(X[4:])]), y).backward()
        opt.step()

    if est.fisher == "empirical":
        exact(est, mlp(), ce(), *batch(), train=train)
        return
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        measure(est, mlp(), ce(), *batch(), train=train)
    hits = [r for r in rec if "outputs of several forwards" in str(r.message)]
    assert len(hits) == 1 and "received 8 samples where this forward's output has 4" in str(
        hits[0].message
    )


@row(
    "user-torch-func-on-the-attached-model",
    "Your own per-sample gradients of the model with `torch.func` "
    "(`vmap(grad(loss of functional_call(model, ...)))`) between steps",
    "Exact, no warning: forwards inside a `torch.func` transform are not recorded (before, "
    "the next backward failed with functorch's 'tensor may have escaped' error, after a "
    "wrong `create_graph` warning).",
    OPT,
)
def _user_vmap(est):
    from torch.func import functional_call, grad, vmap

    def train(opt, model, loss_func, X, y):
        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, x, t):
            return loss_func(functional_call(model, p, (x[None],)), t[None])

        vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)
        train_step(opt, model, loss_func, X, y)

    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        exact(est, mlp(), ce(), *batch(), train=train)
    assert not [
        r for r in rec if "curvature" in str(r.filename) or "create_graph" in str(r.message)
    ]


@row(
    "attention-under-the-empirical-fisher",
    "`nn.MultiheadAttention` (self-attention, `batch_first` either way) trained with "
    "`fisher='empirical'` (the optimizers' default)",
    "Exact: one step equals that of the same attention written with four `nn.Linear` "
    "projections. Before, the layer was committed when `out_proj`'s parameters "
    "accumulated, the in-projections' gradients came later and were dropped: q / k / v "
    "curvature exactly zero (a step of `1 / damping` times the gradient) and a wrong "
    "warning about a second backward.",
    OPT_EMP,
)
def _attention_empirical(est):
    from test_attention_empirical import Attention, ExplicitAttention, one_step

    for batch_first in (True, False):
        model = Attention(batch_first)
        twin = ExplicitAttention(model)
        _OPEN.append(one_step(est.cls, model))
        _OPEN.append(one_step(est.cls, twin))
        after = torch.cat([twin.q.weight, twin.k.weight, twin.v.weight])
        close(model.att.in_proj_weight, after, "in_proj_weight", rtol=1e-9, atol=1e-12)


@row(
    "transformer-layer-sequence-first",
    "`nn.TransformerEncoderLayer` / `nn.TransformerDecoderLayer` with `batch_first=False` "
    "(PyTorch's default)",
    "Clear `ValueError` naming the layer and the way out (`batch_first=True`, the same "
    "function and parameters, `[N, T, d]` inputs): its linear and norm layers see "
    "`[T, N, d]`, whose axis 0 their rules would take as the batch (a Fisher diagonal "
    "10-70% off and LayerNorm factors 16-99% off against the `batch_first=True` twin, "
    "without an error, before).",
    OPT + FN,
    outcome="error",
)
def _sequence_first(est):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0).double()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = layer, nn.Linear(4, 3).double()

        def forward(self, x):  # [N, T, 4]
            return self.head(self.enc(x.transpose(0, 1)).mean(0))

    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(5, 3, 4, generator=g, dtype=DT), torch.randint(0, 3, (5,), generator=g)
    refused(
        est, r"Layer 'enc' \(TransformerEncoderLayer\) runs sequence first", Model(), ce(), X, y
    )


@row(
    "monitoring-gradient-of-another-batch",
    "A training-mode forward on another batch and `torch.autograd.grad` of its loss (a "
    "gradient norm, `curvature.hessian_trace`) between `zero_grad()` and the training "
    "forward",
    "Exact: only backward passes that accumulate into `.grad` count (the graph task of "
    "each pass is recorded); before, that batch's gradients entered the next backward's "
    "statistics (6.9e-2 / 1.1e-1 parameter difference after one step, type-2 / empirical).",
    OPT,
)
def _monitoring_gradient(est):
    X2, y2 = batch(9)

    def train(opt, model, loss_func, X, y):
        opt.zero_grad()
        torch.autograd.grad(loss_func(model(X2), y2), list(model.parameters()))
        curvature.hessian_trace(loss_func(model(X2), y2), list(model.parameters()))
        loss_func(model(X), y).backward()
        opt.step()

    exact(est, mlp(), ce(), *batch(), train=train)


@row(
    "laplacian-of-the-attached-model",
    "`curvature.laplacian(model, x, method='autograd' | 'hutchinson')` (a PDE residual "
    "monitored) between steps, on the model an optimizer is attached to",
    "Exact: the batched backward passes of the Laplacian (`is_grads_batched`) leave "
    "nothing in the optimizer; before, the next `step()` raised 'Batching rule not "
    "implemented for aten::_foreach_norm' (the empirical Fisher).",
    OPT,
)
def _laplacian_monitor(est):
    g = torch.Generator().manual_seed(4)
    Xl = torch.randn(5, 4, generator=g, dtype=DT)

    def train(opt, model, loss_func, X, y):
        for method in ("autograd", "hutchinson"):
            kw = {"num_samples": 3} if method == "hutchinson" else {}
            curvature.laplacian(model, Xl, method=method, **kw)
        train_step(opt, model, loss_func, X, y)

    exact(est, mlp(), ce(), *batch(), train=train)


def _groups_of_damping(model: nn.Module, d_weight: float, d_bias: float) -> List[Dict[str, Any]]:
    weights = [m.weight for m in model if isinstance(m, nn.Linear)]
    biases = [m.bias for m in model if isinstance(m, nn.Linear)]
    return [{"params": weights, "damping": d_weight}, {"params": biases, "damping": d_bias}]


@row(
    "weight-and-bias-in-groups-of-different-damping",
    "A layer's weight and bias in param groups of different `damping`",
    "KFAC, EKFAC: clear `ValueError` at the refresh (a Kronecker block has one damping; "
    "before, the bias group's was silently ignored): put the layer in groups of one "
    "damping (`update_rule='quadratic'` accepts them: its 2x2 model adds each position's "
    "group damping). DNG: exact (each position its group's damping).",
    ("KFAC-empirical", "EKFAC-empirical", "DNG-empirical"),
    outcome="error",
)
def _split_damping(est):
    model = mlp()
    groups = _groups_of_damping(model, 1e-1, 1e-4)
    if est.diagonal:
        exact(est, model, ce(), *batch(), param_groups=groups)
    else:
        refused(
            est,
            "layer '0' are in param groups of different damping",
            model,
            ce(),
            *batch(),
            param_groups=groups,
        )


@row(
    "parameters-replaced-after-construction",
    "Parameters replaced after the optimizer was built (`model.load_state_dict(sd, "
    "assign=True)`, a new `nn.Parameter` or module assigned)",
    "Clear `ValueError` at the next step naming the parameters and the way out (build the "
    "optimizer after replacing them, or `load_state_dict` without `assign=True`); before, "
    "the optimizer updated the old tensors and the model never trained, as `torch.optim` "
    "does.",
    OPT_EMP,
    outcome="error",
)
def _replaced(est):
    model = mlp()
    opt = est.build(model, ce())
    train_step(opt, model, ce(), *batch())
    model.load_state_dict({k: v.clone() for k, v in mlp(1).state_dict().items()}, assign=True)
    with pytest.raises(ValueError, match=r"\['0.weight', '0.bias', '2.weight', '2.bias'\] are"):
        train_step(opt, model, ce(), *batch(1))


@row(
    "grad-scaler-not-given-to-the-optimizer",
    "The AMP loop `scaler.scale(loss).backward(); scaler.step(optim); scaler.update()` "
    "with a `torch.amp.GradScaler` not passed as `grad_scaler=`",
    "Exact: the scaler hands its loss scale to `step()` (torch's protocol for optimizers "
    "that unscale themselves), which unscales the gradients and the step's empirical "
    "statistics; before, the empirical `G` carried the scale's square (`2^32` at the "
    "default scale) and a KFAC step moved the weights by about `1e-9`. After "
    "`scaler.unscale_(optim)` (clipping) one warning asks for `grad_scaler=`.",
    OPT + SAMPLED,
)
def _scaler_not_given(est):
    def train(opt, model, loss_func, X, y):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        if not scaler.is_enabled():  # pragma: no cover
            pytest.skip("the CPU GradScaler is disabled in this torch")
        opt.zero_grad()
        scaler.scale(loss_func(model(X), y)).backward()
        scaler.step(opt)
        scaler.update()

    if est.fisher in ("mc", "rademacher"):
        same_result(
            est,
            measure(est, mlp(), ce(), *batch(), train=train),
            measure(est, mlp(), ce(), *batch()),
        )
        return
    exact(est, mlp(), ce(), *batch(), train=train)


# -- the tests -------------------------------------------------------------------------------------
def _params() -> List[Any]:
    out = []
    for r in ROWS:
        for name in r.estimators:
            marks = []
            if name in r.xfail:
                marks.append(pytest.mark.xfail(strict=True, reason=r.xfail[name]))
            out.append(pytest.param(r, ESTIMATORS[name], id=f"{r.id}[{name}]", marks=marks))
    return out


@pytest.mark.parametrize("row,est", _params())
def test_hostile_input(row: Row, est: Estimator) -> None:
    row.check(est)


def test_the_table_is_large_enough_and_well_formed():
    pairs = [(r.id, e) for r in ROWS for e in r.estimators]
    assert len(pairs) >= 60 and len(set(pairs)) == len(pairs)
    for r in ROWS:
        assert set(r.xfail) <= set(r.estimators), r.id
        assert (r.outcome == "known issue") == bool(r.xfail) or r.id in _PARTLY_OPEN, r.id


_PARTLY_OPEN: set = set()


# -- the report card -------------------------------------------------------------------------------
def _estimators_text(names: Sequence[str]) -> str:
    by_opt: Dict[str, List[str]] = {}
    fns = []
    for n in names:
        e = ESTIMATORS[n]
        if e.optimizer:
            by_opt.setdefault(n.split("-")[0], []).append(e.fisher)
        else:
            fns.append(f"`{n}`")
    parts = [f"{k} ({', '.join(v)})" for k, v in by_opt.items()]
    return "; ".join(parts + ([", ".join(fns)] if fns else []))


def report_card() -> str:
    """The markdown table of ``docs/robustness.md``, one line per row of :data:`ROWS`."""
    lines = [
        "| Input | Estimators | What happens | Row id |",
        "| --- | --- | --- | --- |",
    ]
    for r in ROWS:
        cells = [r.input, _estimators_text(r.estimators), r.report, f"`{r.id}`"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


_START, _END = "<!-- table: generated by tests/test_adversarial_table.py -->", "<!-- end table -->"


def _doc_table() -> str:
    text = DOC.read_text()
    assert _START in text and _END in text, f"{DOC.name} lacks the table markers"
    return text.split(_START, 1)[1].split(_END, 1)[0].strip("\n") + "\n"


def test_the_report_card_lists_every_row():
    table = _doc_table()
    for r in ROWS:
        assert f"`{r.id}`" in table, f"docs/robustness.md does not list the row {r.id!r}"
    assert table == report_card(), (
        "docs/robustness.md is out of date: regenerate it with "
        "`PYTHONPATH=. python tests/test_adversarial_table.py` from the repository root"
    )


def _write_report_card() -> None:
    text = DOC.read_text()
    head, rest = text.split(_START, 1)
    tail = rest.split(_END, 1)[1]
    DOC.write_text(f"{head}{_START}\n{report_card()}{_END}{tail}")


if __name__ == "__main__":
    _write_report_card()
