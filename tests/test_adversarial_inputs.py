"""Hostile but ordinary inputs, run against every estimator they apply to.

Tied weights (a language model's tied embedding, two Linear layers sharing one weight), a
0-dim ``nn.Parameter`` in a custom module, recurrent layers (``nn.LSTM`` / ``nn.GRU`` /
``nn.RNN``, with and without ``batch_first``), ``nn.Embedding(sparse=True)`` and empty
batches (``N = 0``). The table below has one row per hostile input and estimator; each row
is checked against an oracle written from the definitions or against the expected message:

- per-sample gradients: a batch-of-one loop with ``torch.autograd.grad``;
- norms and Gram matrices: the same gradients, flattened and multiplied;
- the GGN: ``sum_n J_n^T H_n J_n`` with ``J_n`` from one ``autograd.grad`` per output entry
  and ``H_n`` the loss Hessian of sample ``n`` (``torch.autograd.functional.hessian``); its
  diagonal for ``diag_ggn`` / ``DiagonalNaturalGradient``, its blocks for exact blocks;
- the empirical Fisher: ``sum_n g_n g_n^T`` from the batch-of-one gradients.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import pytest
import torch
from cases import torch_state
from torch import Tensor, nn

import curvature
from curvature.layout import ParamLayout

SUM = nn.CrossEntropyLoss(reduction="sum")
N = 4


@pytest.fixture(autouse=True)
def _float64_one_thread():
    with torch_state(dtype=torch.float64):
        yield


# -- hostile models --------------------------------------------------------------------------------
class TiedLM(nn.Module):
    """A language model with a tied embedding: ``head.weight = emb.weight``; ``[N, V, S]`` out."""

    def __init__(self, V=5, D=3, head_bias=True):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=head_bias)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x)))).transpose(1, 2)


class TiedLinear(nn.Module):
    """Two Linear layers sharing one weight (their biases their own)."""

    def __init__(self, D=3):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Scaled(nn.Module):
    """A custom module with a 0-dim parameter and a child Linear."""

    def __init__(self, D_in=3, D_out=3):
        super().__init__()
        self.lin = nn.Linear(D_in, D_out)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.lin(x) * self.scale


class Recurrent(nn.Module):
    """A recurrent layer; the head reads the last output and the last hidden state."""

    def __init__(self, cls, batch_first, hidden=4):
        super().__init__()
        self.rnn = cls(3, hidden, batch_first=batch_first)
        self.head = nn.Linear(2 * hidden, 2)
        self.batch_first = batch_first

    def forward(self, x):
        out, state = self.rnn(x)
        h = state[0] if isinstance(state, tuple) else state
        last = out[:, -1] if self.batch_first else out[-1]
        return self.head(torch.cat([last, h[-1]], 1))


@dataclass
class Case:
    """A hostile input: the model, a batch, the batch axis of the inputs, the layer of note."""

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int], Tuple[Tensor, Tensor]]
    axis: int = 0
    tied: Tuple[str, ...] = ()  # layers that share a parameter
    block: str = ""  # the layer with an exact (non-Kronecker) block


def _tokens(n):
    return torch.randint(0, 5, (n, 3)), torch.randint(0, 5, (n, 3))


def _vectors(n):
    return torch.randn(n, 3), torch.randint(0, 3, (n,))


def _sequences(batch_first):
    def data(n):
        X = torch.randn(n, 6, 3) if batch_first else torch.randn(6, n, 3)
        return X, torch.randint(0, 2, (n,))

    return data


TIED = [
    Case("tied-embedding-head", TiedLM, _tokens, tied=("emb", "head")),
    Case("tied-two-linear", TiedLinear, _vectors, tied=("a", "b")),
]
ZERO_DIM = [
    Case(
        "zero-dim-param-in-submodule",
        lambda: nn.Sequential(Scaled(), nn.Tanh(), nn.Linear(3, 3)),
        _vectors,
        block="0",
    ),
    Case("zero-dim-param-on-root", Scaled, _vectors, block=""),
]
RECURRENT = [
    Case(
        f"{cls.__name__.lower()}{'-batch-first' if bf else ''}",
        lambda cls=cls, bf=bf: Recurrent(cls, bf),
        _sequences(bf),
        axis=0 if bf else 1,
        block="rnn",
    )
    for cls in (nn.LSTM, nn.GRU, nn.RNN)
    for bf in (False, True)
]
CASES = {c.name: c for c in TIED + ZERO_DIM + RECURRENT}


# -- oracles from the definitions ---------------------------------------------------------------
def _sample(case: Case, X: Tensor, y: Tensor, n: int) -> Tuple[Tensor, Tensor]:
    return X.narrow(case.axis, n, 1), y[n : n + 1]


def oracle_grads(case, model, X, y) -> Dict[str, Tensor]:
    """``grad l_n`` by a batch-of-one loop, keyed like ``model.named_parameters()``."""
    names, params = zip(*model.named_parameters())
    rows = []
    for n in range(y.shape[0]):
        x_n, y_n = _sample(case, X, y, n)
        rows.append(torch.autograd.grad(SUM(model(x_n), y_n), params))
    return {k: torch.stack([r[i] for r in rows]) for i, k in enumerate(names)}


def flat_grads(grads: Dict[str, Tensor]) -> Tensor:
    return torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], 1)


def oracle_ggn(case, model, X, y) -> Tensor:
    """``sum_n J_n^T H_n J_n`` ``[P, P]`` (layout order) for the summed loss."""
    params = list(model.parameters())
    total = 0
    for n in range(y.shape[0]):
        x_n, y_n = _sample(case, X, y, n)
        out = model(x_n)
        J = torch.stack(
            [
                torch.cat(
                    [
                        (torch.zeros_like(p) if g is None else g).reshape(-1)
                        for p, g in zip(
                            params,
                            torch.autograd.grad(o, params, retain_graph=True, allow_unused=True),
                        )
                    ]
                )
                for o in out.reshape(-1)
            ]
        )
        H = torch.autograd.functional.hessian(
            lambda o, y_n=y_n, shape=out.shape: SUM(o.view(shape), y_n), out.detach().reshape(-1)
        )
        total = total + J.T @ H @ J
    return total


def built(case: Case, n: int = N):
    torch.manual_seed(0)
    model = case.build()
    X, y = case.data(n)
    return model, X, y


def positions(model: nn.Module, layer: str) -> Tensor:
    """Flat positions of the parameters of ``layer`` (direct ones for a functorch layer)."""
    layout = ParamLayout.of(model)
    module = model.get_submodule(layer)
    recurse = isinstance(module, nn.RNNBase)
    names = [n for n, _ in module.named_parameters(recurse=recurse)]
    return layout.module_index(module, layer, names)


def tied_names(model: nn.Module, layers: Tuple[str, ...]) -> List[str]:
    """Names (layout order) of every parameter of the tied layers."""
    layout = ParamLayout.of(model)
    ids = {id(p) for name in layers for p in model.get_submodule(name).parameters()}
    return [n for n, p in zip(layout.names, layout.params) if id(p) in ids]


def tied_positions(model: nn.Module, layers: Tuple[str, ...]) -> Tensor:
    return ParamLayout.of(model).index(tied_names(model, layers))


# -- estimators ------------------------------------------------------------------------------------
def captured(model, X, y):
    with curvature.capture(model) as cap:
        out = model(X)
    return cap, curvature.per_sample_losses(SUM, out, y)


def step_once(cls, model, X, y, fisher="type-2", **kwargs):
    """One optimizer step with ``lr = 0``: the curvature of this batch, parameters kept."""
    opt = cls(model, lr=0.0, damping=1.0, fisher=fisher, loss_func=SUM, **kwargs)
    opt.zero_grad()
    SUM(model(X), y).backward()
    opt.step()
    return opt


def matvec(opt, v: Tensor) -> Tensor:
    layout = ParamLayout.of(opt.model)
    return layout.flatten(opt.matvec(layout.unflatten(v)))


def check_per_sample(case):
    model, X, y = built(case)
    expected = oracle_grads(case, model, X, y)
    got = curvature.per_sample_grads(model, SUM, X, y)
    assert list(got) == list(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], atol=1e-12, rtol=1e-10)


def check_capture_out_buffers(case):
    model, X, y = built(case)
    expected = oracle_grads(case, model, X, y)
    cap, losses = captured(model, X, y)
    out = {k: torch.full_like(v, float("nan")) for k, v in expected.items()}
    got = cap.per_sample_grads(losses, out=out)
    for k in expected:
        assert got[k] is out[k]
        torch.testing.assert_close(got[k], expected[k], atol=1e-12, rtol=1e-10)


def check_norms(case):
    model, X, y = built(case)
    G = flat_grads(oracle_grads(case, model, X, y))
    cap, losses = captured(model, X, y)
    torch.testing.assert_close(cap.per_sample_grad_norms(losses), G.norm(dim=1))


def check_gram(case):
    model, X, y = built(case)
    G = flat_grads(oracle_grads(case, model, X, y))
    cap, losses = captured(model, X, y)
    torch.testing.assert_close(cap.gram(losses), G @ G.T)


def check_diag_ggn(case):
    model, X, y = built(case)
    ggn = oracle_ggn(case, model, X, y)
    d = curvature.diag_ggn(model, SUM, (X, y))
    torch.testing.assert_close(ParamLayout.of(model).flatten(d), ggn.diagonal())


def check_dng(case, fisher="type-2"):
    """``DiagonalNaturalGradient``'s diagonal: the GGN's (type-2) or the empirical Fisher's."""
    model, X, y = built(case)
    if fisher == "type-2":
        diag = oracle_ggn(case, model, X, y).diagonal()
    else:
        diag = flat_grads(oracle_grads(case, model, X, y)).pow(2).sum(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact for every layer: no warning
        opt = step_once(curvature.DiagonalNaturalGradient, model, X, y, fisher)
    v = torch.randn(diag.shape[0])
    torch.testing.assert_close(matvec(opt, v), diag * v)


def check_exact_block_function(case, fn):
    """``kfac()`` / ``ekfac()``: the exact block of the layer without Kronecker rule."""
    model, X, y = built(case)
    ggn = oracle_ggn(case, model, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dense = fn(model, SUM, (X, y)).to_dense()
    ix = positions(model, case.block)
    torch.testing.assert_close(dense[ix][:, ix], ggn[ix][:, ix])


def check_exact_block_optimizer(case, cls):
    model, X, y = built(case)
    ggn = oracle_ggn(case, model, X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = step_once(cls, model, X, y)
    ix = positions(model, case.block)
    v = torch.zeros(ggn.shape[0])
    v[ix] = torch.randn(ix.numel())
    torch.testing.assert_close(matvec(opt, v)[ix], (ggn @ v)[ix])


def _tie_pattern(case) -> str:
    a, b = case.tied
    return rf"tied: used by layers '{a}' and '{b}'"


def check_tied_function_warns(case, fn):
    """``kfac()`` / ``ekfac()``: the tied layers get no block, with a warning naming the tie."""
    model, X, y = built(case)
    with pytest.warns(UserWarning, match=_tie_pattern(case)) as record:
        approx = fn(model, SUM, (X, y))
    assert any("untie the weights" in str(w.message) for w in record)
    ix = tied_positions(model, case.tied)
    dense = approx.to_dense()
    assert dense[ix].abs().sum() == 0 and dense[:, ix].abs().sum() == 0
    assert set(approx.uncovered) == set(tied_names(model, case.tied))
    assert not any(b.name in case.tied for b in approx.blocks)


def check_tied_function_error(case, fn):
    model, X, y = built(case)
    with pytest.raises(ValueError, match=_tie_pattern(case)) as err:
        fn(model, SUM, (X, y), unsupported="error")
    assert "untie the weights" in str(err.value) and "diag_ggn()" in str(err.value)


def check_tied_optimizer_warn(case, cls):
    """``unsupported="warn"``: one warning naming the tie; the plain gradient for those entries."""
    model, X, y = built(case)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opt = step_once(cls, model, X, y)
        opt.zero_grad()
        SUM(model(X), y).backward()
        opt.step()
    messages = [str(w.message) for w in record]
    assert len(messages) == 1, messages
    assert re.search(_tie_pattern(case), messages[0]) and "plain gradient" in messages[0]
    ix = tied_positions(model, case.tied)
    g = torch.randn(ParamLayout.of(model).numel)
    layout = ParamLayout.of(model)
    d = layout.flatten(opt.inverse_matvec(layout.unflatten(g)))
    torch.testing.assert_close(d[ix], g[ix])


def check_tied_optimizer_diagonal(case, cls, fisher="type-2"):
    """``unsupported="diagonal"``: the exact Fisher diagonal of the summed gradients."""
    model, X, y = built(case)
    if fisher == "type-2":
        diag = oracle_ggn(case, model, X, y).diagonal()
    else:
        diag = flat_grads(oracle_grads(case, model, X, y)).pow(2).sum(0)
    with pytest.warns(UserWarning, match=_tie_pattern(case)):
        opt = step_once(cls, model, X, y, fisher, unsupported="diagonal")
    ix = tied_positions(model, case.tied)
    v = torch.zeros(diag.shape[0])
    v[ix] = torch.randn(ix.numel())
    torch.testing.assert_close(matvec(opt, v)[ix], diag[ix] * v[ix])
    assert "+".join(case.tied) in opt.blocks


def check_tied_optimizer_error(case, cls):
    model, X, y = built(case)
    with pytest.raises(ValueError, match=_tie_pattern(case)) as err:
        cls(model, lr=0.1, unsupported="error")
    text = str(err.value)
    assert "untie the weights" in text and "DiagonalNaturalGradient" in text


# -- the table: (case, estimator, check) -----------------------------------------------------------
FUNCTIONS = {"kfac": curvature.kfac, "ekfac": curvature.ekfac}
OPTIMIZERS = {"KFAC": curvature.KFAC, "EKFAC": curvature.EKFAC}

ROWS: List[Tuple[str, str, Callable[[Case], None]]] = []
for case in TIED + ZERO_DIM + RECURRENT:
    ROWS += [
        (case.name, "per_sample_grads", check_per_sample),
        (case.name, "Capture.per_sample_grads(out=)", check_capture_out_buffers),
        (case.name, "Capture.per_sample_grad_norms", check_norms),
        (case.name, "Capture.gram", check_gram),
        (case.name, "diag_ggn", check_diag_ggn),
        (case.name, "DiagonalNaturalGradient(type-2)", check_dng),
        (case.name, "DiagonalNaturalGradient(empirical)", lambda c: check_dng(c, "empirical")),
    ]
for case in TIED:
    for fname, fn in FUNCTIONS.items():
        ROWS += [
            (
                case.name,
                f"{fname}(unsupported=warn)",
                lambda c, fn=fn: check_tied_function_warns(c, fn),
            ),
            (
                case.name,
                f"{fname}(unsupported=error)",
                lambda c, fn=fn: check_tied_function_error(c, fn),
            ),
        ]
    for oname, cls in OPTIMIZERS.items():
        ROWS += [
            (
                case.name,
                f"{oname}(unsupported=warn)",
                lambda c, cls=cls: check_tied_optimizer_warn(c, cls),
            ),
            (
                case.name,
                f"{oname}(unsupported=diagonal)",
                lambda c, cls=cls: check_tied_optimizer_diagonal(c, cls),
            ),
            (
                case.name,
                f"{oname}(unsupported=error)",
                lambda c, cls=cls: check_tied_optimizer_error(c, cls),
            ),
        ]
    ROWS.append(
        (
            case.name,
            "KFAC(unsupported=diagonal, empirical)",
            lambda c: check_tied_optimizer_diagonal(c, curvature.KFAC, "empirical"),
        )
    )
for case in ZERO_DIM + RECURRENT:
    for fname, fn in FUNCTIONS.items():
        ROWS.append(
            (case.name, f"{fname}: exact block", lambda c, fn=fn: check_exact_block_function(c, fn))
        )
    for oname, cls in OPTIMIZERS.items():
        ROWS.append(
            (
                case.name,
                f"{oname}: exact block",
                lambda c, cls=cls: check_exact_block_optimizer(c, cls),
            )
        )


@pytest.mark.parametrize(
    "case_name, estimator, check",
    [pytest.param(*row, id=f"{row[0]}-{row[1]}") for row in ROWS],
)
def test_adversarial_table(case_name, estimator, check):
    check(CASES[case_name])


# -- recurrent layers: what cannot be replayed, and layers too large for an exact block -------
class Packed(nn.Module):
    """An LSTM fed a packed sequence (variable lengths)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        lengths = torch.arange(x.shape[0]) % x.shape[1] + 1
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, True, enforce_sorted=False)
        _, (h, _) = self.rnn(packed)
        return self.head(h[-1])


def _two_layer_lstm(dropout_training: bool):
    model = Recurrent(nn.LSTM, True)
    model.rnn = nn.LSTM(3, 4, num_layers=2, dropout=0.5, batch_first=True)
    model.rnn.train(dropout_training)  # the model trains; the LSTM's dropout on or off
    return model


def _large_lstm():
    model = Recurrent(nn.LSTM, True, hidden=40)  # 7,200 parameters > MAX_EXACT_BLOCK
    return model


def test_recurrent_packed_sequence_is_refused_clearly():
    model, X, y = Packed(), torch.randn(N, 5, 3), torch.randint(0, 2, (N,))
    with pytest.raises(ValueError, match=r"nn\.LSTM got a PackedSequence input.*packed sequences"):
        curvature.per_sample_grads(model, SUM, X, y)


def test_recurrent_dropout_between_layers_in_train_mode_is_refused_clearly():
    X, y = torch.randn(N, 5, 3), torch.randint(0, 2, (N,))
    with pytest.raises(ValueError, match=r"dropout=0.5\) in train mode.*eval mode"):
        curvature.per_sample_grads(_two_layer_lstm(True), SUM, X, y)


def test_two_layer_lstm_in_eval_mode_is_exact():
    case = Case("lstm-2-layers", lambda: _two_layer_lstm(False), _sequences(True), block="rnn")
    check_per_sample(case)
    check_exact_block_optimizer(case, curvature.KFAC)


def test_large_recurrent_layer_gets_kronecker_blocks_over_time():
    """Over an exact block's size, a recurrent layer's Linear sub-layers (``ih_l0``,
    ``hh_l0``) get Kronecker factors shared over the time steps (before: no curvature, the
    plain gradient). Exact where KFAC is: one datum, one time step (the GGN's block); and
    DiagonalNaturalGradient's diagonal from them is the exact per-sample Fisher diagonal
    over 6 steps (backpropagation through time, against a batch-of-one loop)."""
    case = Case("lstm-large", _large_lstm, _sequences(True), block="rnn")
    model, X, y = built(case)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "uncovered" warning
        factors = curvature.kfac(model, SUM, (X[:1, :1], y[:1])).factors
    assert {"rnn.ih_l0", "rnn.hh_l0", "head"} == set(factors)
    K = curvature.kfac(model, SUM, (X[:1, :1], y[:1]))
    ggn = oracle_ggn(case, model, X[:1, :1], y[:1])
    layout = ParamLayout.of(model)
    for sub in ("ih_l0", "hh_l0"):
        ix = layout.index([f"rnn.weight_{sub}", f"rnn.bias_{sub}"])
        torch.testing.assert_close(K.to_dense()[ix][:, ix], ggn[ix][:, ix], atol=1e-10, rtol=1e-8)
    ix = positions(model, "rnn")
    diag = flat_grads(oracle_grads(case, model, X, y)).pow(2).sum(0)
    opt = step_once(curvature.DiagonalNaturalGradient, model, X, y, "empirical")
    v = torch.randn(layout.numel)
    torch.testing.assert_close(matvec(opt, v)[ix], diag[ix] * v[ix])
    opt.close()


# -- nn.Embedding(sparse=True): the optimizers densify its gradient --------------------------------
class Bag(nn.Module):
    def __init__(self, sparse):
        super().__init__()
        self.emb = nn.Embedding(7, 3, sparse=sparse)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.emb(x)).mean(1))


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize(
    "cls", [curvature.KFAC, curvature.EKFAC, curvature.DiagonalNaturalGradient]
)
def test_sparse_embedding_steps_like_the_dense_one(cls, fisher):
    torch.manual_seed(0)
    dense = Bag(sparse=False)
    sparse = Bag(sparse=True)
    sparse.load_state_dict(dense.state_dict())
    kw = dict(lr=0.1, damping=0.1, momentum=0.9, weight_decay=0.01, fisher=fisher, loss_func=SUM)
    runs = []
    for model in (dense, sparse):
        opt = cls(model, **kw)
        torch.manual_seed(1)
        for _ in range(3):
            X, y = torch.randint(0, 7, (N, 3)), torch.randint(0, 2, (N,))
            opt.zero_grad()
            SUM(model(X), y).backward()
            opt.step()
        runs.append(ParamLayout.of(model).flat_params())
    assert sparse.emb.weight.grad is None or sparse.emb.weight.grad.is_sparse
    torch.testing.assert_close(runs[1], runs[0], atol=1e-12, rtol=1e-10)


def test_sparse_embedding_per_sample_grads_match_the_dense_ones():
    torch.manual_seed(0)
    dense, sparse = Bag(sparse=False), Bag(sparse=True)
    sparse.load_state_dict(dense.state_dict())
    X, y = torch.randint(0, 7, (N, 3)), torch.randint(0, 2, (N,))
    expected = oracle_grads(Case("bag", Bag, _tokens), dense, X, y)
    got = curvature.per_sample_grads(sparse, SUM, X, y)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k])


# -- empty batches (N = 0) -------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))


def empty():
    """A batch of no samples: ``X [0, 3]``, ``y [0]``."""
    return torch.randn(0, 3), torch.randint(0, 3, (0,))


def test_empty_batch_per_sample_grads_are_empty():
    model = _mlp()
    got = curvature.per_sample_grads(model, SUM, *empty())
    assert {k: tuple(v.shape) for k, v in got.items()} == {
        k: (0, *p.shape) for k, p in model.named_parameters()
    }
    cap, losses = captured(model, *empty())
    assert cap.per_sample_grad_norms(losses).shape == (0,)
    assert cap.gram(losses).shape == (0, 0)
    assert {k: v.shape[0] for k, v in cap.per_sample_grads(losses).items()} == dict.fromkeys(got, 0)


@pytest.mark.parametrize("fn", [curvature.kfac, curvature.ekfac, curvature.diag_ggn])
def test_empty_batch_curvature_functions(fn):
    model = _mlp()
    mean = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match=r"the batch is empty \(N = 0"):
        fn(model, mean, empty())
    X, y = _vectors(N)
    # an empty batch among others contributes nothing (and does not change the weights)
    with_empty, without = fn(model, mean, [(X, y), empty()]), fn(model, mean, [(X, y)])
    if isinstance(without, dict):
        for k in without:
            torch.testing.assert_close(with_empty[k], without[k])
    else:
        torch.testing.assert_close(with_empty.to_dense(), without.to_dense())


OPTIMIZER_FISHERS = [
    (cls, fisher)
    for cls in (curvature.KFAC, curvature.EKFAC, curvature.DiagonalNaturalGradient)
    for fisher in ("empirical", "type-2", "mc", "rademacher", "forward-only")
    if not (fisher == "forward-only" and cls is not curvature.KFAC)
]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(
    "cls, fisher", OPTIMIZER_FISHERS, ids=[f"{c.__name__}-{f}" for c, f in OPTIMIZER_FISHERS]
)
def test_empty_batch_optimizer_step(cls, fisher, reduction):
    """No statistics, no NaN, parameters unchanged; the next batch as if it came first."""
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    X, y = _vectors(N)
    runs = []
    for empty_first in (True, False):
        model = _mlp()
        opt = cls(model, lr=0.1, damping=0.1, fisher=fisher, loss_func=loss_func)
        if empty_first:
            before = ParamLayout.of(model).flat_params()
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                opt.zero_grad()
                X0, y0 = empty()
                loss_func(model(X0), y0).backward()
                opt.step()
            assert opt.blocks == {} or all(
                getattr(b, "record", None) is None and getattr(b, "d", None) is None
                for b in opt.blocks.values()
            )
            torch.testing.assert_close(ParamLayout.of(model).flat_params(), before)
        torch.manual_seed(2)
        opt.zero_grad()
        loss_func(model(X), y).backward()
        opt.step()
        runs.append(ParamLayout.of(model).flat_params())
    assert torch.isfinite(runs[0]).all()
    torch.testing.assert_close(runs[0], runs[1])


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (curvature.KFAC, {"unsupported": "diagonal"}),
        (curvature.EKFAC, {"unsupported": "diagonal"}),
        (curvature.DiagonalNaturalGradient, {}),
    ],
    ids=["KFAC-diagonal", "EKFAC-diagonal", "DiagonalNaturalGradient"],
)
def test_tied_group_diagonal_survives_a_state_dict_round_trip(cls, kwargs):
    case = CASES["tied-embedding-head"]
    model, X, y = built(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the coverage warning of KFAC / EKFAC
        opt = step_once(cls, model, X, y, **kwargs)
        twin, _, _ = built(case)
        loaded = cls(twin, lr=0.0, damping=1.0, fisher="type-2", loss_func=SUM, **kwargs)
    loaded.load_state_dict(opt.state_dict())
    assert "emb+head" in loaded.blocks
    v = torch.randn(ParamLayout.of(model).numel)
    torch.testing.assert_close(matvec(loaded, v), matvec(opt, v))
