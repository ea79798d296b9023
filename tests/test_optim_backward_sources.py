"""Where the optimizers' curvature backward gets its gradients, under ordinary hostile use.

- mc / type-2 / rademacher: the optimizer pulls from the input of the user's own call of
  ``loss_func`` (so it sees the targets, e.g. ``ignore_index`` padding, and any transform
  of the output such as ``out.transpose(1, 2)``); if the loss module is never called, from
  the model output when the user's backward reaches it.
- empirical: only gradients that a backward accumulated into ``.grad`` count (not those of
  a ``torch.autograd.grad`` call through the same graph), and they are folded while the
  layer inputs are still those of the forward (a refilled input buffer does not matter).

Oracle: ``curvature.kfac`` / ``curvature.diag_ggn`` on the same data (``lr=0`` keeps the
model fixed, and the first statistics are taken as they are).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import curvature


def _close(actual, expected):
    assert set(actual) == set(expected)
    for k in expected:
        for a, e in zip(actual[k], expected[k]):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def _diag_close(opt, model, ref):
    """The optimizer's running diagonal (``matvec`` of ones) against ``diag_ggn``."""
    got = opt.matvec([torch.ones_like(p) for p in model.parameters()])
    for g, (name, r) in zip(got, ref.items()):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12, msg=name)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _data(N=8, seed=1, pad=True):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    if pad:
        y[::3] = -100
    return X, y


class _Tokens(nn.Module):
    """``[N, T, d] -> [N, T, C]``: logits in the layout a loss needs transposed."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        return self.body(x)


class _Transposed(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).transpose(1, 2)


def _one_step(opt, model, loss_func, X, y):
    opt.zero_grad()
    loss_func(model(X), y).backward()
    opt.step()


@pytest.mark.parametrize("fisher", ["type-2", "mc"])
def test_ignored_targets_are_masked_in_the_optimizers_curvature(fisher):
    model, (X, y) = _mlp(), _data()
    CE = nn.CrossEntropyLoss(reduction="sum")
    opt = curvature.KFAC(model, lr=0.0, fisher=fisher, loss_func=CE, mc_samples=2)
    _one_step(opt, model, CE, X, y)
    if fisher == "type-2":
        _close(opt.factors(), curvature.kfac(model, CE, (X, y)).factors)
    else:  # the same draws: the masked positions contribute exactly nothing
        opt.close()
        keep = y != -100
        ref = curvature.KFAC(model, lr=0.0, fisher=fisher, loss_func=CE, mc_samples=2)
        _one_step(ref, model, CE, X[keep], y[keep])
        # the masked rows draw samples too (same generator), so compare via the exact
        # oracle's support: G is a sum over the kept samples only
        for (_, G), (_, G2) in zip(opt.factors().values(), ref.factors().values()):
            assert G.shape == G2.shape and torch.isfinite(G).all()
        exact = curvature.kfac(model, CE, (X[keep], y[keep])).factors
        for (_, G), (_, Gx) in zip(opt.factors().values(), exact.values()):
            # an MC estimate of the kept samples' GGN: same scale, not the padded one
            assert (G.trace() / Gx.trace() - 1).abs() < 0.9


def test_ignored_targets_are_masked_in_the_diagonal_natural_gradient():
    model, (X, y) = _mlp(), _data()
    CE = nn.CrossEntropyLoss(reduction="sum")
    opt = curvature.DiagonalNaturalGradient(model, lr=0.0, fisher="type-2", loss_func=CE)
    _one_step(opt, model, CE, X, y)
    ref = curvature.diag_ggn(model, CE, (X, y))
    _diag_close(opt, model, ref)


def test_ignored_targets_with_a_mean_loss_are_refused_clearly():
    model, (X, y) = _mlp(), _data()
    CE = nn.CrossEntropyLoss()
    opt = curvature.KFAC(model, lr=0.0, fisher="type-2", loss_func=CE)
    with pytest.raises(ValueError, match="ignore_index.*reduction='sum'"):
        _one_step(opt, model, CE, X, y)


@pytest.mark.parametrize("fisher", ["type-2", "rademacher"])
def test_a_transposed_output_uses_the_layout_the_loss_sees(fisher):
    g = torch.Generator().manual_seed(2)
    X = torch.randn(4, 5, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4, 5), generator=g)
    CE = nn.CrossEntropyLoss()
    factors = []
    for wrapped in (False, True):  # the user's transpose / a model that returns [N, C, T]
        inner = _Tokens().double()
        model = _Transposed(inner) if wrapped else inner
        opt = curvature.KFAC(model, lr=0.0, fisher=fisher, loss_func=CE, mc_samples=3)
        opt.zero_grad()
        out = model(X)
        CE(out if wrapped else out.transpose(1, 2), y).backward()
        opt.step()
        opt.close()
        factors.append(list(opt.factors().values()))
        if fisher == "type-2":
            exact = curvature.kfac(_Transposed(inner), CE, (X, y)).factors
            for (_, G), (_, G2) in zip(factors[-1], exact.values()):
                torch.testing.assert_close(G, G2, rtol=1e-10, atol=1e-12)
    for (A, G), (A2, G2) in zip(*factors):
        torch.testing.assert_close(A, A2, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(G, G2, rtol=1e-10, atol=1e-12)


def test_without_a_call_of_the_loss_module_the_model_output_is_used():
    model, (X, y) = _mlp(), _data(pad=False)
    CE = nn.CrossEntropyLoss()
    opt = curvature.KFAC(model, lr=0.0, fisher="type-2", loss_func=CE)
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()  # not the optimizer's loss module
    opt.step()
    _close(opt.factors(), curvature.kfac(model, CE, (X, y)).factors)


def test_unrelated_calls_of_the_loss_module_are_ignored():
    model, teacher, (X, y) = _mlp(), _mlp(seed=5), _data(pad=False)
    CE = nn.CrossEntropyLoss()
    opt = curvature.KFAC(model, lr=0.0, fisher="type-2", loss_func=CE)
    opt.zero_grad()
    out = model(X)
    CE(teacher(X), y)  # another model's loss through the same module
    with torch.no_grad():
        CE(out, y)  # a logged value
    CE(out, y).backward()
    opt.step()
    _close(opt.factors(), curvature.kfac(model, CE, (X, y)).factors)


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.DiagonalNaturalGradient])
def test_a_gradient_taken_before_backward_is_not_counted(cls):
    model, (X, y) = _mlp(), _data(pad=False)
    CE = nn.CrossEntropyLoss()
    opt = cls(model, lr=0.0, fisher="empirical", loss_func=CE)
    opt.zero_grad()
    loss = CE(model(X), y)
    penalty = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
    assert penalty[0].abs().sum() > 0
    loss.backward()
    opt.step()
    if cls is curvature.KFAC:
        _close(opt.factors(), curvature.kfac(model, CE, (X, y), fisher="empirical").factors)
    else:
        _diag_close(opt, model, curvature.diag_ggn(model, CE, (X, y), fisher="empirical"))


def test_an_input_buffer_refilled_between_micro_batches():
    model, (X, y) = _mlp(), _data(N=8, pad=False)
    CE = nn.CrossEntropyLoss()
    opt = curvature.KFAC(model, lr=0.0, fisher="empirical", loss_func=CE)
    buf = torch.empty(4, 4, dtype=torch.float64)
    opt.zero_grad()
    for i in (0, 4):
        buf.copy_(X[i : i + 4])
        (CE(model(buf), y[i : i + 4]) / 2).backward()
    opt.step()
    batches = [(X[:4], y[:4]), (X[4:], y[4:])]
    _close(opt.factors(), curvature.kfac(model, CE, batches, fisher="empirical").factors)


def test_a_second_backward_through_one_forward_warns():
    model, (X, y) = _mlp(), _data(pad=False)
    CE = nn.CrossEntropyLoss()
    opt = curvature.KFAC(model, lr=0.0, fisher="empirical", loss_func=CE)
    opt.zero_grad()
    out = model(X)
    CE(out, y).backward(retain_graph=True)
    out.pow(2).mean().backward()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        opt.step()
    assert any("second backward" in str(r.message) for r in rec)
