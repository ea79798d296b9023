"""Recurrent layers as Linear layers shared over time (``curvature.layers.recurrent_unrolled``).

Over an exact block's size, ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` get Kronecker blocks
per Linear sub-layer (``ih_l0``, ``hh_l0``, ...). Their expanded operands come from a
step-by-step replay of the layer, backpropagated through time; the twins here: the
per-sample gradients ``sum_t g_t a_t^T`` against a batch-of-one autograd loop, the
Kronecker blocks against the dense GGN where KFAC is exact (one datum, one step), and
the empirical Fisher diagonal against the per-sample gradients of the replay rule.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import curvature
from curvature.layers.recurrent_unrolled import unrolled_blocks
from curvature.layout import ParamLayout

pytestmark = pytest.mark.usefixtures("float64_seeded", "one_thread_seeded")

VARIANTS = {
    "lstm": (nn.LSTM, {}),
    "gru": (nn.GRU, {}),
    "rnn-tanh": (nn.RNN, {}),
    "rnn-relu-2-layers": (nn.RNN, dict(nonlinearity="relu", num_layers=2)),
    "lstm-2-layers-bidirectional": (nn.LSTM, dict(num_layers=2, bidirectional=True)),
    "gru-batch-first": (nn.GRU, dict(batch_first=True)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_unrolled_blocks_give_the_exact_per_sample_gradients(variant):
    cls, kw = VARIANTS[variant]
    m = cls(5, 7, **kw)
    bf = kw.get("batch_first", False)
    N, L = 4, 6
    x = torch.randn(N, L, 5) if bf else torch.randn(L, N, 5)
    out, state = m(x)
    h_n = state[0] if isinstance(state, tuple) else state
    g_out, g_h = torch.randn_like(out), torch.randn_like(h_n)
    blocks = unrolled_blocks(m, x, None, [g_out, g_h], [0, 1])
    for i in range(N):
        xi = x[i : i + 1] if bf else x[:, i : i + 1]
        o, st = m(xi)
        hi = st[0] if isinstance(st, tuple) else st
        gi = g_out[i : i + 1] if bf else g_out[:, i : i + 1]
        loss = (o * gi).sum() + (hi * g_h[:, i : i + 1]).sum()
        names = [n for n, _ in m.named_parameters()]
        grads = dict(zip(names, torch.autograd.grad(loss, list(m.parameters()))))
        for sub, (a, g) in blocks.items():
            per = torch.einsum("so,si->oi", g[0, i, :, 0], a[i, :, 0])
            ref = torch.cat([grads[f"weight_{sub}"], grads[f"bias_{sub}"][:, None]], 1)
            torch.testing.assert_close(per, ref, rtol=1e-10, atol=1e-12)


def test_frozen_weights_and_biases_leave_their_columns_out():
    m = nn.LSTM(3, 4)
    m.weight_hh_l0.requires_grad_(False)
    m.bias_ih_l0.requires_grad_(False)
    x = torch.randn(5, 2, 3)
    out, _ = m(x)
    blocks = unrolled_blocks(m, x, None, [torch.randn_like(out)], [0])
    assert blocks["ih_l0"][0].shape[-1] == 3  # the weight's columns, no bias column
    assert blocks["hh_l0"][0].shape[-1] == 1  # the bias column only


class Tagger(nn.Module):
    def __init__(self, hidden=40, layers=1, cls=nn.LSTM):
        super().__init__()
        self.rnn = cls(3, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


@pytest.mark.parametrize(
    "cls, hidden", [(nn.LSTM, 30), (nn.GRU, 35), (nn.RNN, 62)], ids=["LSTM", "GRU", "RNN"]
)
def test_one_datum_one_step_blocks_equal_the_ggn(cls, hidden):
    """Just over an exact block's 4096 parameters. (An LSTM's and RNN's ``hh`` blocks share
    ``G`` with their ``ih`` ones, a GRU's not.)"""
    torch.manual_seed(0)
    model = Tagger(hidden=hidden, cls=cls)
    X, y = torch.randn(1, 1, 3), torch.randint(0, 2, (1,))
    ce = nn.CrossEntropyLoss()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K = curvature.kfac(model, ce, (X, y))
    assert set(K.factors) == {"rnn.ih_l0", "rnn.hh_l0", "head"}
    ggn, dense = curvature.ggn(model, ce, (X, y)), K.to_dense()
    layout = ParamLayout.of(model)
    for sub in ("ih_l0", "hh_l0"):
        ix = layout.index([f"rnn.weight_{sub}", f"rnn.bias_{sub}"])
        torch.testing.assert_close(dense[ix][:, ix], ggn[ix][:, ix], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_the_fisher_diagonal_over_time_is_exact(fisher):
    """``diag_ggn`` from the unrolled blocks (two layers, 6 steps, 8 sequences, type-2's
    ``C`` vectors per sample) against the per-sample gradients of the replay rule."""
    torch.manual_seed(0)
    model = Tagger(hidden=24, layers=2)
    X, y = torch.randn(8, 6, 3), torch.randint(0, 2, (8,))
    ce = nn.CrossEntropyLoss()
    diag = curvature.diag_ggn(model, ce, (X, y), fisher=fisher)
    if fisher == "empirical":
        grads = curvature.per_sample_grads(model, ce, X, y)
        expected = {k: g.pow(2).sum(0) / X.shape[0] for k, g in grads.items()}
    else:
        expected = dict(zip(ParamLayout.of(model).names, _ggn_diagonal(model, ce, X, y)))
    for k in expected:
        torch.testing.assert_close(diag[k], expected[k], rtol=1e-8, atol=1e-12)


def _ggn_diagonal(model, ce, X, y):
    layout = ParamLayout.of(model)
    d = curvature.ggn(model, ce, (X, y)).diagonal()
    return [t.reshape(s) for t, s in zip(d.split(layout.numels), layout.shapes)]


def test_kfac_and_ekfac_train_a_large_lstm():
    """A sequence task (the sign of the first feature's sum over time) at the defaults."""
    torch.manual_seed(0)
    X = torch.randn(64, 8, 3)
    y = (X[:, :, 0].sum(1) > 0).long()
    ce = nn.CrossEntropyLoss()
    for cls in (curvature.KFAC, curvature.EKFAC):
        torch.manual_seed(0)
        model = Tagger()
        opt = cls(model)
        first = float(ce(model(X), y).detach())
        for _ in range(30):
            opt.zero_grad()
            ce(model(X), y).backward()
            opt.step()
        assert {"rnn.ih_l0", "rnn.hh_l0"} <= set(opt.blocks)
        assert float(ce(model(X), y).detach()) < 0.5 * first
        opt.close()


class Keyword(nn.Module):
    """Layers called with ``input=``: a large LSTM and a Linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(3, 33, batch_first=True)
        self.head = nn.Linear(33, 2)

    def forward(self, x):
        out, _ = self.rnn(input=x)
        return self.head(input=out[:, -1])


def test_layers_called_with_a_keyword_input_get_ekfac_corrections():
    """Before, EKFAC's corrections read the input's device as ``args[0]`` (IndexError)."""
    torch.manual_seed(0)
    model, ce = Keyword(), nn.CrossEntropyLoss()
    X, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4,))
    E = curvature.ekfac(model, ce, (X, y))
    assert {b.name for b in E.blocks} == {"rnn.ih_l0", "rnn.hh_l0", "head"}
    opt = curvature.EKFAC(model, inverse_every=1)
    for _ in range(2):
        opt.zero_grad()
        ce(model(X), y).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()
