"""``per_sample_losses`` and the supported-loss checks (SPEC section 1)."""

from __future__ import annotations

import pytest
import torch
from cases import assert_close
from torch import nn

import curvature


def _ce(N, *trailing):
    return torch.randn(N, 4, *trailing), torch.randint(0, 4, (N, *trailing))


def _soft(N):
    return torch.randn(N, 4), torch.softmax(torch.randn(N, 4), 1)


def _ignored(N):
    logits, labels = _ce(N, 3)
    labels[0, 1] = -100
    return logits, labels


def _regression(N, *shape):
    return torch.randn(N, *shape), torch.randn(N, *shape)


def _binary(N, *shape):
    return torch.randn(N, *shape), torch.randint(0, 2, (N, *shape)).double()


LOSSES = {
    "ce": (nn.CrossEntropyLoss, lambda N: _ce(N)),
    "ce_trailing_axes": (nn.CrossEntropyLoss, lambda N: _ce(N, 3, 2)),
    "ce_label_smoothing": (
        lambda **kw: nn.CrossEntropyLoss(label_smoothing=0.1, **kw),
        lambda N: _ce(N, 3),
    ),
    "ce_soft_labels": (nn.CrossEntropyLoss, _soft),
    "mse": (nn.MSELoss, lambda N: _regression(N, 3)),
    "mse_sequence": (nn.MSELoss, lambda N: _regression(N, 2, 3)),
    "bce": (nn.BCEWithLogitsLoss, lambda N: _binary(N, 3)),
    "bce_weight_pos_weight": (
        lambda **kw: nn.BCEWithLogitsLoss(
            weight=torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64),
            pos_weight=torch.tensor([3.0, 1.0, 0.5], dtype=torch.float64),
            **kw,
        ),
        lambda N: _binary(N, 2, 3),
    ),
}


@pytest.mark.parametrize("N", [1, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_per_sample_losses_are_the_loss_of_each_sample_alone(name, reduction, N):
    make_loss, make_data = LOSSES[name]
    torch.manual_seed(0)
    loss_func = make_loss(reduction=reduction)
    out, y = make_data(N)
    out = out.double().requires_grad_()
    losses = curvature.per_sample_losses(loss_func, out, y)
    assert losses.shape == (N,)
    alone = torch.stack([loss_func(out[n : n + 1], y[n : n + 1]) for n in range(N)])
    assert_close(losses, alone)
    R = 1.0 / N if reduction == "mean" else 1.0
    assert_close(R * losses.sum(), loss_func(out, y))
    # differentiable: the per-sample losses carry the graph back to the output
    (g,) = torch.autograd.grad(losses.sum(), out)
    (expected,) = torch.autograd.grad(alone.sum(), out)
    assert_close(g, expected)


def test_cross_entropy_ignore_index_with_sum_is_supported():
    torch.manual_seed(0)
    loss_func = nn.CrossEntropyLoss(reduction="sum")
    out, y = _ignored(4)
    out = out.double()
    losses = curvature.per_sample_losses(loss_func, out, y)
    alone = torch.stack([loss_func(out[n : n + 1], y[n : n + 1]) for n in range(4)])
    assert_close(losses, alone)


def test_cross_entropy_ignore_index_with_mean_is_refused():
    out, y = _ignored(4)
    with pytest.raises(ValueError, match="ignore_index=-100 with reduction 'mean'"):
        curvature.per_sample_losses(nn.CrossEntropyLoss(), out, y)


@pytest.mark.parametrize(
    "loss_func",
    [nn.L1Loss(), nn.NLLLoss(), nn.HuberLoss(), nn.MSELoss],
    ids=["L1Loss", "NLLLoss", "HuberLoss", "class_not_instance"],
)
def test_unsupported_loss_is_refused_naming_the_supported_set(loss_func):
    out, y = _regression(3, 2)
    match = r"not supported; use one of nn\.CrossEntropyLoss, nn\.MSELoss, nn\.BCEWithLogitsLoss"
    with pytest.raises(ValueError, match=match):
        curvature.per_sample_losses(loss_func, out, y)


@pytest.mark.parametrize("cls", [nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss])
def test_reduction_none_is_refused(cls):
    out, y = _binary(3, 4)
    with pytest.raises(ValueError, match=r"reduction='none'\) is not supported"):
        curvature.per_sample_losses(cls(reduction="none"), out, y)


def test_cross_entropy_with_class_weights_is_refused():
    out, y = _ce(3)
    with pytest.raises(ValueError, match=r"CrossEntropyLoss\(weight=\.\.\.\)"):
        curvature.per_sample_losses(nn.CrossEntropyLoss(weight=torch.ones(4)), out, y)


@pytest.mark.parametrize(
    ("loss_func", "match"),
    [
        (nn.L1Loss(), "L1Loss.* is not supported; use one of nn.CrossEntropyLoss"),
        (nn.MSELoss(reduction="none"), r"MSELoss\(reduction='none'\) is not supported"),
        (nn.CrossEntropyLoss(weight=torch.ones(2)), r"CrossEntropyLoss\(weight=\.\.\.\)"),
    ],
    ids=["L1Loss", "reduction_none", "ce_weight"],
)
def test_per_sample_grads_refuses_unsupported_losses(loss_func, match):
    model = nn.Linear(3, 2)
    X = torch.randn(4, 3)
    y = (
        torch.randint(0, 2, (4,))
        if isinstance(loss_func, nn.CrossEntropyLoss)
        else torch.randn(4, 2)
    )
    with pytest.raises(ValueError, match=match):
        curvature.per_sample_grads(model, loss_func, X, y)
