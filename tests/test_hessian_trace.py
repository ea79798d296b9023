"""Hessian traces: exact trace, Hutchinson and Hutch++ against exact Hessians (float64)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import curvature
import curvature.dense
from curvature.traces import hessian_trace, hutchinson_trace, hutchinson_trace_blocks

DT = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _quadratic(M: torch.Tensor):
    """``0.5 x^T M x``: Hessian ``M`` (symmetric)."""
    x = torch.randn(M.shape[0], dtype=DT, generator=_gen(99)).requires_grad_(True)
    return 0.5 * x @ M @ x, x


@pytest.fixture
def matrix10() -> torch.Tensor:
    """A fixed symmetric 10x10 matrix with a dominant diagonal: tr = 55 + small."""
    A = torch.randn(10, 10, dtype=DT, generator=_gen(0))
    return torch.diag(torch.arange(1, 11, dtype=DT)) + 0.1 * (A + A.T)


def _decaying(D: int = 60, rate: float = 0.8, seed: int = 1) -> torch.Tensor:
    """A dense symmetric matrix with spectrum ``rate^i``."""
    Q, _ = torch.linalg.qr(torch.randn(D, D, dtype=DT, generator=_gen(seed)))
    return Q @ torch.diag(rate ** torch.arange(D, dtype=DT)) @ Q.T


def _tiny_model_loss():
    """An MLP 3 -> 4 -> 1 (tanh) with MSE: a non-quadratic loss of 21 parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(DT)
    X = torch.randn(6, 3, dtype=DT)
    y = torch.randn(6, 1, dtype=DT)
    return model, X, y


def _exact_hessian(model, X, y) -> torch.Tensor:
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss_of(theta):
        ps, i = {}, 0
        for n, s in zip(names, shapes):
            ps[n] = theta[i : i + s.numel()].reshape(s)
            i += s.numel()
        out = torch.func.functional_call(model, ps, (X,))
        return nn.functional.mse_loss(out, y)

    return torch.func.hessian(loss_of)(flat)


# -- exact trace ------------------------------------------------------------------------------
def test_exact_hessian_trace_of_a_quadratic_is_the_matrix_trace(matrix10):
    loss, x = _quadratic(matrix10)
    torch.testing.assert_close(hessian_trace(loss, x), matrix10.trace())


def test_exact_hessian_trace_matches_torch_func_hessian_on_an_mlp():
    model, X, y = _tiny_model_loss()
    loss = nn.functional.mse_loss(model(X), y)
    H = _exact_hessian(model, X, y)
    torch.testing.assert_close(hessian_trace(loss, list(model.parameters())), H.trace())


def test_exact_hessian_trace_chunked_equals_unchunked():
    model, X, y = _tiny_model_loss()
    loss = nn.functional.mse_loss(model(X), y)
    ps = list(model.parameters())
    torch.testing.assert_close(hessian_trace(loss, ps, chunk_size=5), hessian_trace(loss, ps))


# -- Hutchinson ---------------------------------------------------------------------------------
def test_hutchinson_converges_to_the_trace_of_a_10x10_quadratic(matrix10):
    loss, x = _quadratic(matrix10)
    est = hutchinson_trace(loss, x, 20000, generator=_gen(1))
    assert abs(est.item() - matrix10.trace().item()) / matrix10.trace().item() < 1e-3


def test_hutchinson_gaussian_probes_converge_within_four_standard_errors(matrix10):
    loss, x = _quadratic(matrix10)
    K = 20000
    est = hutchinson_trace(loss, x, K, distribution="gaussian", generator=_gen(2))
    std = math.sqrt(2 * matrix10.square().sum().item() / K)  # Var(v^T M v) = 2 ||M||_F^2
    assert abs(est.item() - matrix10.trace().item()) < 4 * std


def test_rademacher_hutchinson_is_exact_on_a_diagonal_hessian():
    M = torch.diag(torch.linspace(-2.0, 5.0, 12, dtype=DT))
    loss, x = _quadratic(M)
    torch.testing.assert_close(hutchinson_trace(loss, x, 3, generator=_gen(3)), M.trace())


def test_hutchinson_is_reproducible_with_a_generator(matrix10):
    loss, x = _quadratic(matrix10)
    a = hutchinson_trace(loss, x, 7, generator=_gen(5))
    b = hutchinson_trace(loss, x, 7, generator=_gen(5))
    assert a.item() == b.item()


def test_hutchinson_over_several_tensors_estimates_the_full_trace():
    model, X, y = _tiny_model_loss()
    loss = nn.functional.mse_loss(model(X), y)
    exact = _exact_hessian(model, X, y)
    off = exact - torch.diag(exact.diagonal())
    K = 4000
    est = hutchinson_trace(loss, list(model.parameters()), K, generator=_gen(6))
    std = math.sqrt(2 * off.square().sum().item() / K)
    assert abs(est.item() - exact.trace().item()) < 4 * std + 1e-12


# -- Hutch++ ------------------------------------------------------------------------------------
def test_hutchpp_is_exact_when_its_basis_spans_the_space(matrix10):
    loss, x = _quadratic(matrix10)
    est = hutchinson_trace(loss, x, 30, method="hutch++", generator=_gen(7))
    torch.testing.assert_close(est, matrix10.trace())


def test_hutchpp_beats_hutchinson_mse_at_the_same_budget_on_a_decaying_spectrum():
    M = _decaying()
    loss, x = _quadratic(M)
    exact = M.trace().item()
    budget, seeds = 30, 40
    errors = {"hutchinson": [], "hutch++": []}
    for method in errors:
        for seed in range(seeds):
            est = hutchinson_trace(loss, x, budget, method=method, generator=_gen(seed))
            errors[method].append((est.item() - exact) ** 2)
    mse = {m: sum(e) / seeds for m, e in errors.items()}
    assert mse["hutch++"] < 0.1 * mse["hutchinson"], mse


def test_hutchpp_with_a_budget_not_divisible_by_three_is_unbiased():
    M = _decaying(D=20, rate=0.7)
    loss, x = _quadratic(M)
    ests = [
        hutchinson_trace(loss, x, 8, method="hutch++", generator=_gen(s)).item() for s in range(120)
    ]
    mean = sum(ests) / len(ests)
    sem = math.sqrt(sum((e - mean) ** 2 for e in ests) / (len(ests) - 1) / len(ests))
    assert abs(mean - M.trace().item()) < 4 * sem + 1e-12


# -- differentiable traces (regularizers) -----------------------------------------------------
def _flat_grad(value, params):
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(value, params, retain_graph=True)])


def test_trace_regularizer_gradient_matches_the_exact_gradient_of_the_trace():
    model, X, y = _tiny_model_loss()
    ps = list(model.parameters())
    loss = nn.functional.mse_loss(model(X), y)
    # Hutch++ with a complete basis (3P >= 3 * 21 products) is exactly tr(H), and its basis
    # is held fixed: the gradient is d tr(H) / d theta.
    est = hutchinson_trace(loss, ps, 63, method="hutch++", create_graph=True, generator=_gen(8))
    exact = hessian_trace(loss, ps, create_graph=True)
    torch.testing.assert_close(est, exact)
    torch.testing.assert_close(_flat_grad(est, ps), _flat_grad(exact, ps))


def test_exact_trace_gradient_matches_finite_differences():
    model, X, y = _tiny_model_loss()
    ps = list(model.parameters())
    grad = _flat_grad(hessian_trace(nn.functional.mse_loss(model(X), y), ps, create_graph=True), ps)
    flat = torch.nn.utils.parameters_to_vector(ps).detach()
    eps = 1e-5
    fd = torch.empty_like(flat)
    for i in range(flat.numel()):
        vals = []
        for sign in (1, -1):
            torch.nn.utils.vector_to_parameters(flat + sign * eps * torch.eye(len(flat))[i], ps)
            vals.append(hessian_trace(nn.functional.mse_loss(model(X), y), ps).item())
        fd[i] = (vals[0] - vals[1]) / (2 * eps)
    torch.nn.utils.vector_to_parameters(flat, ps)
    torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-8)


def test_seeded_hutchinson_gradient_matches_finite_differences_of_the_estimate():
    model, X, y = _tiny_model_loss()
    ps = list(model.parameters())

    def estimate(create_graph=False):
        loss = nn.functional.mse_loss(model(X), y)
        return hutchinson_trace(loss, ps, 9, create_graph=create_graph, generator=_gen(11))

    grad = _flat_grad(estimate(create_graph=True), ps)
    flat = torch.nn.utils.parameters_to_vector(ps).detach()
    eps = 1e-5
    fd = torch.empty_like(flat)
    for i in range(flat.numel()):
        vals = []
        for sign in (1, -1):
            torch.nn.utils.vector_to_parameters(flat + sign * eps * torch.eye(len(flat))[i], ps)
            vals.append(estimate().item())
        fd[i] = (vals[0] - vals[1]) / (2 * eps)
    torch.nn.utils.vector_to_parameters(flat, ps)
    torch.testing.assert_close(grad, fd, rtol=1e-6, atol=1e-8)


def test_trace_regularizer_loss_can_be_backpropagated_after_the_estimate():
    model, X, y = _tiny_model_loss()
    ps = list(model.parameters())
    loss = nn.functional.mse_loss(model(X), y)
    reg = hutchinson_trace(loss, ps, 4, create_graph=True, generator=_gen(12))
    (loss + 0.1 * reg).backward()  # the graph of `loss` is kept
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ps)


def test_estimate_without_create_graph_keeps_the_loss_graph_and_has_no_grad():
    model, X, y = _tiny_model_loss()
    ps = list(model.parameters())
    loss = nn.functional.mse_loss(model(X), y)
    est = hutchinson_trace(loss, ps, 4, generator=_gen(13))
    assert not est.requires_grad
    loss.backward()


# -- blocks -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["hutchinson", "hutch++"])
def test_block_traces_sum_to_the_total_trace_estimate_with_the_same_probes(method):
    model, X, y = _tiny_model_loss()
    loss = nn.functional.mse_loss(model(X), y)
    blocks = hutchinson_trace_blocks(
        loss, dict(model.named_parameters()), 9, method=method, generator=_gen(14)
    )
    total = hutchinson_trace(loss, list(model.parameters()), 9, method=method, generator=_gen(14))
    assert list(blocks) == [n for n, _ in model.named_parameters()]
    torch.testing.assert_close(sum(blocks.values()), total)


def test_block_traces_are_the_traces_of_the_diagonal_blocks():
    model, X, y = _tiny_model_loss()
    loss = nn.functional.mse_loss(model(X), y)
    H = _exact_hessian(model, X, y)
    layers = {"first": [model[0].weight, model[0].bias], "last": [model[2].weight, model[2].bias]}
    # Hutch++ with a complete basis: each block trace is exact
    est = hutchinson_trace_blocks(loss, layers, 63, method="hutch++", generator=_gen(15))
    split = 3 * 4 + 4
    torch.testing.assert_close(est["first"], H[:split, :split].trace())
    torch.testing.assert_close(est["last"], H[split:, split:].trace())


def test_hutchinson_block_traces_converge_to_the_diagonal_block_traces():
    model, X, y = _tiny_model_loss()
    loss = nn.functional.mse_loss(model(X), y)
    H = _exact_hessian(model, X, y)
    est = hutchinson_trace_blocks(loss, dict(model.named_parameters()), 20000, generator=_gen(16))
    start = 0
    for name, p in model.named_parameters():
        block = H[start : start + p.numel()]
        exact = block[:, start : start + p.numel()].trace().item()
        offdiag = (
            block.square().sum() - block[:, start : start + p.numel()].diagonal().square().sum()
        )
        std = math.sqrt(2 * offdiag.item() / 20000)  # |(v_b)^T (Hv)_b| cross terms
        assert abs(est[name].item() - exact) < 4 * std + 1e-12, name
        start += p.numel()


def test_parameter_the_loss_is_linear_in_has_a_zero_block():
    a = torch.randn(4, dtype=DT, requires_grad=True)
    b = torch.randn(3, dtype=DT, requires_grad=True)
    loss = (a**3).sum() + b.sum()  # H = diag(6 a) (+) 0
    est = hutchinson_trace_blocks(loss, {"a": a, "b": b}, 5, generator=_gen(17))
    torch.testing.assert_close(est["a"], (6 * a).sum().detach())
    assert est["b"].item() == 0.0
    torch.testing.assert_close(hessian_trace(loss, [a, b]), (6 * a).sum().detach())


# -- bad arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 2.5}, "num_samples"),
        ({"num_samples": True}, "num_samples"),
        ({"num_samples": 2, "method": "hutch++"}, "at least 3|>= 3"),
        ({"num_samples": 4, "method": "exact"}, "method"),
        ({"num_samples": 4, "distribution": "uniform"}, "distribution"),
        ({"num_samples": 4, "generator": 3}, "generator"),
    ],
)
def test_bad_arguments_raise_value_error(matrix10, kwargs, match):
    loss, x = _quadratic(matrix10)
    with pytest.raises(ValueError, match=match):
        hutchinson_trace(loss, x, **kwargs)


def test_bad_loss_and_params_raise_value_error(matrix10):
    loss, x = _quadratic(matrix10)
    with pytest.raises(ValueError, match="scalar"):
        hutchinson_trace(x * 2, x, 3)
    with pytest.raises(ValueError, match="requires_grad"):
        hutchinson_trace(loss, x.detach(), 3)
    with pytest.raises(ValueError, match="does not require grad"):
        hutchinson_trace(loss.detach(), x, 3)
    with pytest.raises(ValueError, match="non-empty"):
        hutchinson_trace(loss, [], 3)
    with pytest.raises(ValueError, match="blocks must not overlap"):
        hutchinson_trace_blocks(loss, {"a": x, "b": [x]}, 3)
    with pytest.raises(ValueError, match="non-empty mapping"):
        hutchinson_trace_blocks(loss, {}, 3)
    with pytest.raises(ValueError, match="chunk_size"):
        hessian_trace(loss, x, chunk_size=0)


def test_curvature_hessian_is_still_the_dense_hessian_function():
    # the traces live in curvature/traces.py so that no submodule shadows the function
    assert curvature.hessian is curvature.dense.hessian
