"""The vectors injected at the model output for each Fisher type (SPEC sections 1 and 3).

``backprop_sources(loss_func, output, target, fisher)`` returns ``V [K, *output.shape]``.
The loss Hessian w.r.t. the output is block-diagonal over samples; for every sample ``n``
the block ``sum_k V_k[n] V_k[n]^T`` must be

- ``"type-2"``: exactly the sample's diagonal block of ``d^2 L / d output^2`` (the loss
  module's scalar, reduction included), checked against ``torch.func.hessian``;
- ``"mc"`` / ``"rademacher"``: that block in expectation (checked with many samples);
- ``"empirical"``: ``R * grad l_n grad l_n^T`` with ``l_n`` the loss of sample ``n`` alone.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple

import pytest
import torch
from torch import Tensor, nn

from curvature.losses import FISHER_TYPES, backprop_sources, hessian_sqrt

N = 3


pytestmark = pytest.mark.usefixtures("float64_seeded")


class LossCase(NamedTuple):
    loss: Callable[..., nn.Module]  # reduction -> loss module
    data: Callable[[], tuple]  # () -> (output, target)


def _labels(C, *trailing):
    return lambda: (torch.randn(N, C, *trailing), torch.randint(0, C, (N, *trailing)))


def _regression(*shape):
    return lambda: (torch.randn(N, *shape), torch.randn(N, *shape))


def _binary(*shape):
    return lambda: (torch.randn(N, *shape), torch.randint(0, 2, (N, *shape)).double())


def _bce_pos_weight(reduction):
    return nn.BCEWithLogitsLoss(reduction=reduction, pos_weight=torch.tensor([0.5, 2.0, 3.0]))


def _bce_weight_pos_weight(reduction):
    return nn.BCEWithLogitsLoss(
        reduction=reduction,
        weight=torch.tensor([1.5, 0.5, 2.0]),
        pos_weight=torch.tensor([3.0, 1.0, 0.25]),
    )


LOSSES: Dict[str, LossCase] = {
    "ce": LossCase(lambda r: nn.CrossEntropyLoss(reduction=r), _labels(4)),
    "ce_trailing_NCS": LossCase(lambda r: nn.CrossEntropyLoss(reduction=r), _labels(3, 5)),
    "ce_trailing_NCHW": LossCase(lambda r: nn.CrossEntropyLoss(reduction=r), _labels(3, 2, 2)),
    "ce_label_smoothing": LossCase(
        lambda r: nn.CrossEntropyLoss(reduction=r, label_smoothing=0.2), _labels(4)
    ),
    "ce_soft_targets": LossCase(
        lambda r: nn.CrossEntropyLoss(reduction=r),
        lambda: (torch.randn(N, 4), torch.randn(N, 4).softmax(1)),
    ),
    "mse": LossCase(lambda r: nn.MSELoss(reduction=r), _regression(3)),
    "mse_NSD": LossCase(lambda r: nn.MSELoss(reduction=r), _regression(2, 3)),
    "bce": LossCase(lambda r: nn.BCEWithLogitsLoss(reduction=r), _binary(3)),
    "bce_soft_targets": LossCase(
        lambda r: nn.BCEWithLogitsLoss(reduction=r), lambda: (torch.randn(N, 3), torch.rand(N, 3))
    ),
    "bce_pos_weight": LossCase(_bce_pos_weight, _binary(3)),
    "bce_pos_weight_NSD": LossCase(_bce_pos_weight, _binary(2, 3)),
    "bce_weight_and_pos_weight": LossCase(_bce_weight_pos_weight, _binary(3)),
}
# cases where labels can be sampled from the model's predictive distribution
SAMPLEABLE = ["ce", "ce_trailing_NCS", "mse", "mse_NSD", "bce"]
REDUCTIONS = ["mean", "sum"]


def _build(name, reduction):
    case = LOSSES[name]
    out, target = case.data()
    return case.loss(reduction), out, target


def _hessian_blocks(loss_func, out, target) -> Tensor:
    """``[N, D, D]``: per-sample diagonal blocks of the loss Hessian w.r.t. the output."""
    H = torch.func.hessian(lambda f: loss_func(f, target))(out)
    D = out[0].numel()
    H = H.reshape(N, D, N, D)
    # the reference itself must be block-diagonal over samples
    off = H.clone()
    off[torch.arange(N), :, torch.arange(N)] = 0
    assert off.abs().max() == 0
    return H[torch.arange(N), :, torch.arange(N)]


def _source_blocks(V: Tensor) -> Tensor:
    """``[N, D, D]``: ``sum_k V_k[n] V_k[n]^T`` per sample."""
    flat = V.reshape(V.shape[0], N, -1)
    return torch.einsum("knd,kne->nde", flat, flat)


def _rel_err(a: Tensor, b: Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# -- type-2: exact Hessian square root ----------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(LOSSES))
def test_type2_sources_square_to_the_per_sample_loss_hessian(name, reduction):
    loss_func, out, target = _build(name, reduction)
    V = backprop_sources(loss_func, out, target, "type-2")
    assert V.shape[1:] == out.shape
    torch.testing.assert_close(
        _source_blocks(V), _hessian_blocks(loss_func, out, target), rtol=1e-10, atol=1e-13
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ["ce", "mse", "bce_pos_weight"])
def test_hessian_sqrt_is_the_type2_source(name, reduction):
    loss_func, out, target = _build(name, reduction)
    torch.testing.assert_close(
        hessian_sqrt(loss_func, out, target),
        backprop_sources(loss_func, out, target, "type-2"),
        rtol=0,
        atol=0,
    )


def test_type2_sources_do_not_depend_on_the_output_graph():
    loss_func, out, target = _build("ce", "mean")
    out = out.requires_grad_(True)
    V = backprop_sources(loss_func, out, target, "type-2")
    assert not V.requires_grad


# -- stochastic sources: unbiased, approach the Hessian with many samples -------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("fisher", ["mc", "rademacher"])
@pytest.mark.parametrize("name", SAMPLEABLE)
def test_stochastic_sources_approach_the_loss_hessian(name, fisher, reduction):
    loss_func, out, target = _build(name, reduction)
    gen = torch.Generator().manual_seed(1)
    M = 5_000
    V = backprop_sources(loss_func, out, target, fisher, mc_samples=M, generator=gen)
    assert V.shape == (M, *out.shape)
    exact = _hessian_blocks(loss_func, out, target)
    # relative error ~ M^{-1/2}; a wrong scale (e.g. a missing factor 2) is off by >= 40%
    assert _rel_err(_source_blocks(V), exact) < 0.1


@pytest.mark.parametrize("name", ["bce_pos_weight", "bce_weight_and_pos_weight"])
def test_rademacher_sources_approach_the_weighted_bce_hessian(name):
    loss_func, out, target = _build(name, "mean")
    gen = torch.Generator().manual_seed(2)
    V = backprop_sources(loss_func, out, target, "rademacher", mc_samples=5_000, generator=gen)
    assert _rel_err(_source_blocks(V), _hessian_blocks(loss_func, out, target)) < 0.1


@pytest.mark.parametrize("name", ["mse", "bce"])
def test_rademacher_sources_are_exact_for_a_diagonal_loss_hessian(name):
    # MSE/BCE Hessians are diagonal: v_m = eps * d, so each block's diagonal is exact
    loss_func, out, target = _build(name, "sum")
    gen = torch.Generator().manual_seed(3)
    V = backprop_sources(loss_func, out, target, "rademacher", mc_samples=5, generator=gen)
    exact = _hessian_blocks(loss_func, out, target)
    torch.testing.assert_close(
        _source_blocks(V).diagonal(dim1=1, dim2=2), exact.diagonal(dim1=1, dim2=2)
    )


@pytest.mark.parametrize("fisher", ["mc", "rademacher"])
def test_stochastic_sources_follow_the_generator(fisher):
    loss_func, out, target = _build("ce", "mean")

    def draw(seed):
        gen = torch.Generator().manual_seed(seed)
        return backprop_sources(loss_func, out, target, fisher, mc_samples=4, generator=gen)

    torch.testing.assert_close(draw(0), draw(0), rtol=0, atol=0)
    assert not torch.equal(draw(0), draw(1))


# -- empirical: the true labels' per-sample gradients -------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(LOSSES))
def test_empirical_sources_give_R_grad_grad_of_each_sample_alone(name, reduction):
    loss_func, out, target = _build(name, reduction)
    V = backprop_sources(loss_func, out, target, "empirical")
    assert V.shape == (1, *out.shape)
    R = 1.0 / N if reduction == "mean" else 1.0
    expected = []
    for n in range(N):
        f = out[n : n + 1].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(loss_func(f, target[n : n + 1]), f)
        expected.append(R * torch.outer(g.flatten(), g.flatten()))
    torch.testing.assert_close(_source_blocks(V), torch.stack(expected), rtol=1e-10, atol=1e-14)


# -- refusals ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bce_pos_weight", "bce_weight_and_pos_weight"])
def test_mc_on_weighted_bce_is_refused(name):
    loss_func, out, target = _build(name, "mean")
    with pytest.raises(ValueError, match="mc"):
        backprop_sources(loss_func, out, target, "mc")


@pytest.mark.parametrize("fisher", ["type2", "MC", "exact", ""])
def test_unknown_fisher_is_refused_naming_the_allowed_values(fisher):
    loss_func, out, target = _build("ce", "mean")
    with pytest.raises(ValueError) as info:
        backprop_sources(loss_func, out, target, fisher)
    for allowed in FISHER_TYPES:
        assert f"'{allowed}'" in str(info.value)


def test_forward_only_has_no_sources():
    loss_func, out, target = _build("ce", "mean")
    with pytest.raises(ValueError, match="forward-only"):
        backprop_sources(loss_func, out, target, "forward-only")


@pytest.mark.parametrize("mc_samples", [0, -1])
def test_non_positive_mc_samples_is_refused(mc_samples):
    loss_func, out, target = _build("ce", "mean")
    with pytest.raises(ValueError, match="mc_samples"):
        backprop_sources(loss_func, out, target, "mc", mc_samples=mc_samples)


@pytest.mark.parametrize(
    "loss_func", [nn.L1Loss(), nn.NLLLoss(), nn.MSELoss(reduction="none")], ids=str
)
def test_unsupported_loss_is_refused(loss_func):
    out, target = torch.randn(N, 3), torch.randn(N, 3)
    with pytest.raises(ValueError, match="MSELoss"):
        backprop_sources(loss_func, out, target, "type-2")


# -- ignore_index -------------------------------------------------------------------------
def _ce_with_ignored(reduction):
    out, target = torch.randn(N, 3, 4), torch.randint(0, 3, (N, 4))
    target[0, 1] = -100
    target[2, 3] = -100
    return nn.CrossEntropyLoss(reduction=reduction), out, target


def test_type2_sources_of_ignored_positions_vanish_with_sum():
    loss_func, out, target = _ce_with_ignored("sum")
    V = backprop_sources(loss_func, out, target, "type-2")
    torch.testing.assert_close(_source_blocks(V), _hessian_blocks(loss_func, out, target))


@pytest.mark.parametrize("fisher", ["mc", "rademacher", "empirical"])
def test_other_sources_of_ignored_positions_vanish_with_sum(fisher):
    loss_func, out, target = _ce_with_ignored("sum")
    V = backprop_sources(loss_func, out, target, fisher, mc_samples=3)
    assert V[:, 0, :, 1].abs().max() == 0 and V[:, 2, :, 3].abs().max() == 0
    assert V[:, 0, :, 0].abs().max() > 0


def test_stochastic_sources_with_ignored_targets_approach_the_loss_hessian():
    loss_func, out, target = _ce_with_ignored("sum")
    gen = torch.Generator().manual_seed(4)
    exact = _hessian_blocks(loss_func, out, target)
    for fisher in ["mc", "rademacher"]:
        V = backprop_sources(loss_func, out, target, fisher, mc_samples=5000, generator=gen)
        assert _rel_err(_source_blocks(V), exact) < 0.1


@pytest.mark.parametrize("fisher", ["type-2", "mc", "rademacher", "empirical"])
def test_ignored_targets_with_mean_are_refused(fisher):
    loss_func, out, target = _ce_with_ignored("mean")
    with pytest.raises(ValueError, match="ignore_index"):
        backprop_sources(loss_func, out, target, fisher)


def test_mc_labels_follow_the_softmax_and_never_draw_impossible_classes():
    """A CPU's categorical draws (the inverse CDF of float64 cumulative weights, one
    uniform per row): the drawn labels' frequencies match the softmax within sampling
    error (4 standard deviations), a class of probability 0 is never drawn, and the
    draws follow the generator."""
    R, inf = 20000, float("inf")
    logits = torch.tensor([0.0, 1.0, -inf, 2.0, -inf]).expand(R, 5).contiguous()
    y = torch.zeros(R, dtype=torch.long)
    sum_ce = nn.CrossEntropyLoss(reduction="sum")

    def draw(seed):
        V = backprop_sources(sum_ce, logits, y, "mc", generator=torch.Generator().manual_seed(seed))
        return logits.softmax(1) - V[0]  # the one-hot rows of the drawn labels

    onehot = draw(0)
    torch.testing.assert_close(onehot.sum(1), torch.ones(R))
    freq, p = onehot.mean(0), logits[0].softmax(0)
    assert freq[2] == 0 and freq[4] == 0
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / R).sqrt() + 1e-12).all(), (freq, p)
    assert torch.equal(draw(0), onehot) and not torch.equal(draw(1), onehot)
