"""Per-sample gradients, norms and Gram matrices against brute-force twins (SPEC section 2).

The grid tests take the ``problem`` fixture (``conftest.py``): every case of ``cases.py``
for every dtype, reduction and batch size.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
from cases import (
    CASES,
    Case,
    Problem,
    assert_close,
    assert_grads_match,
    build,
    flat,
    grad_mismatches,
    loop_per_sample_grads,
    randint,
    randn,
    run_model,
    torch_func_per_sample_grads,
    trainable,
)
from torch import nn

import curvature
from curvature.layers import LayerRule, register, registry
from curvature.layers.attention import MultiheadAttentionRule
from curvature.layers.linear import LinearRule


def captured_losses(problem: Problem):
    """``(cap, losses)`` from one captured forward of the problem's model."""
    with curvature.capture(problem.model) as cap:
        out = run_model(problem.model, problem.X)
    return cap, curvature.per_sample_losses(problem.loss_func, out, problem.y)


# ---------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------
def test_torch_func_twin_matches_python_loop(problem: Problem):
    loop = loop_per_sample_grads(problem.model, problem.loss_func, problem.X, problem.y)
    assert_grads_match(problem.reference, loop)


def test_per_sample_grads_match_torch_func(problem: Problem):
    grads = curvature.per_sample_grads(problem.model, problem.loss_func, problem.X, problem.y)
    assert_grads_match(grads, problem.reference)
    # frozen parameters are absent, trainable ones present in named_parameters order
    assert list(grads) == list(trainable(problem.model))


def test_capture_per_sample_grads_match_torch_func(problem: Problem):
    cap, losses = captured_losses(problem)
    assert_grads_match(cap.per_sample_grads(losses), problem.reference)


def test_per_sample_grad_norms_match_torch_func(problem: Problem):
    cap, losses = captured_losses(problem)
    norms = cap.per_sample_grad_norms(losses)
    assert norms.shape == (problem.N,)
    assert_close(norms, flat(problem.reference).norm(dim=1))


def test_gram_matches_torch_func(problem: Problem):
    cap, losses = captured_losses(problem)
    G = flat(problem.reference)
    assert_close(cap.gram(losses), G @ G.T)


def test_per_sample_grads_sum_to_batch_gradient(problem: Problem):
    grads = curvature.per_sample_grads(problem.model, problem.loss_func, problem.X, problem.y)
    model = copy.deepcopy(problem.model)
    problem.loss_func(run_model(model, problem.X), problem.y).backward()
    R = 1.0 / problem.N if problem.reduction == "mean" else 1.0
    summed = {k: R * g.sum(0) for k, g in grads.items()}
    assert_grads_match(summed, {k: p.grad for k, p in trainable(model).items()})


# ---------------------------------------------------------------------------------------
# The comparison catches wrong rules
# ---------------------------------------------------------------------------------------
@contextmanager
def registry_restored():
    """Undo every rule registered inside the block."""
    saved = dict(registry._RULES)
    try:
        yield
    finally:
        registry._RULES.clear()
        registry._RULES.update(saved)


@pytest.fixture
def restore_registry():
    with registry_restored():
        yield


def _mlp_problem(N: int = 4) -> Problem:
    case = Case(
        "mlp_for_broken_rules",
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)),
        randn(3),
        randint(2),
        nn.CrossEntropyLoss,
    )
    return build(case, torch.float64, "mean", N)


@pytest.mark.parametrize("defect", ["scaled", "transposed_samples"])
def test_comparison_catches_broken_linear_rule(monkeypatch, defect):
    problem = _mlp_problem()
    original = LinearRule.expand

    def broken(self, module, call):
        a, g = original(self, module, call)
        return (a, 2 * g) if defect == "scaled" else (a, g.flip(0))

    monkeypatch.setattr(LinearRule, "expand", broken)
    grads = curvature.per_sample_grads(problem.model, problem.loss_func, problem.X, problem.y)
    problems = grad_mismatches(grads, problem.reference)
    assert {p.split(":")[0] for p in problems} == {"0.weight", "0.bias", "2.weight", "2.bias"}
    with pytest.raises(AssertionError, match="per-sample gradients differ"):
        assert_grads_match(grads, problem.reference)
    cap, losses = captured_losses(problem)
    if defect == "scaled":  # a sample permutation keeps the norms' multiset, not the values
        assert not torch.allclose(
            cap.per_sample_grad_norms(losses), flat(problem.reference).norm(dim=1)
        )
    monkeypatch.undo()
    assert_grads_match(
        curvature.per_sample_grads(problem.model, problem.loss_func, problem.X, problem.y),
        problem.reference,
    )


class Scale(nn.Module):
    """``x * s`` with a parameter ``s [D]`` shared over the positions of ``x [N, S, D]``."""

    def __init__(self, d: int):
        super().__init__()
        self.s = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.s


def _scale_problem() -> Problem:
    case = Case(
        "scale_for_registered_rules",
        lambda: nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh(), nn.Linear(4, 2)),
        randn(5, 3),
        randn(5, 2),
        nn.MSELoss,
    )
    return build(case, torch.float64, "sum", 3)


def _register_scale_rule(factor: float) -> None:
    @register(Scale)
    class ScaleRule(LayerRule):
        def per_sample_grads(self, module, calls, *args, **kwargs):
            total = sum((c.grads[0] * c.args[0]).flatten(1, -2).sum(1) for c in calls)
            return {"s": factor * total}


@pytest.mark.parametrize("factor", [1.0, -1.0, 2.0])
def test_comparison_flags_registered_rule_iff_wrong(restore_registry, factor):
    problem = _scale_problem()
    assert registry.registered_rule(problem.model[1]) is None  # the fallback covers it
    _register_scale_rule(factor)
    assert registry.registered_rule(problem.model[1]) is not None
    grads = curvature.per_sample_grads(problem.model, problem.loss_func, problem.X, problem.y)
    problems = grad_mismatches(grads, problem.reference)
    assert [p.split(":")[0] for p in problems] == ([] if factor == 1.0 else ["1.s"])
    cap, losses = captured_losses(problem)
    G = flat(problem.reference)
    # the Gram matrix is quadratic in each layer's gradients: blind to a sign flip
    assert torch.allclose(cap.gram(losses), G @ G.T) == (factor**2 == 1.0)


def test_registry_restored_after_registering_a_broken_rule():
    problem = _scale_problem()
    with registry_restored():
        _register_scale_rule(-1.0)
        assert registry.registered_rule(problem.model[1]) is not None
    assert registry.registered_rule(problem.model[1]) is None
    grads = curvature.per_sample_grads(problem.model, problem.loss_func, problem.X, problem.y)
    assert_grads_match(grads, problem.reference)


def test_embedding_on_one_token_per_sample_matches_torch_func():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2)).double()
    X = torch.randint(0, 5, (4,))
    y = torch.randint(0, 2, (4,))
    loss_func = nn.CrossEntropyLoss()
    grads = curvature.per_sample_grads(model, loss_func, X, y)
    assert_grads_match(grads, torch_func_per_sample_grads(model, loss_func, X, y))


# ---------------------------------------------------------------------------------------
# nn.MultiheadAttention: the torch.func replay the rule falls back to
# ---------------------------------------------------------------------------------------
ATTENTION_CASES = [c for c in CASES if c.name.startswith("mha_")]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name) for c in ATTENTION_CASES])
def test_attention_torch_func_fallback_matches_torch_func(monkeypatch, case):
    # force the fallback the rule takes when its batched replay does not reproduce the output
    monkeypatch.setattr(MultiheadAttentionRule, "_replay", lambda self, module, call: None)
    monkeypatch.setattr(MultiheadAttentionRule, "_warned", True, raising=False)
    problem = build(case, torch.float64, "mean", 3)
    cap, losses = captured_losses(problem)
    assert_grads_match(cap.per_sample_grads(losses), problem.reference)
    G = flat(problem.reference)
    assert_close(cap.per_sample_grad_norms(losses), G.norm(dim=1))
    assert_close(cap.gram(losses), G @ G.T)
