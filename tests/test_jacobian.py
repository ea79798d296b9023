"""``curvature.jacobian``: Jacobians of an already computed output from its graph."""

from __future__ import annotations

import pytest
import torch
from cases import assert_close
from torch.autograd.functional import jacobian as autograd_jacobian

import curvature


def test_jacobian_of_scaled_input_wrt_scalar_is_the_input():
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64)
    C = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    y = C * x
    J = curvature.jacobian(y, C)
    assert J.shape == (4, 3)
    assert_close(J, x)


def test_jacobian_wrt_the_input_is_diagonal_scale():
    torch.manual_seed(0)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    C = torch.tensor(2.5, dtype=torch.float64, requires_grad=True)
    J = curvature.jacobian(C * x, x)
    assert J.shape == (4, 3, 4, 3)
    assert_close(J, 2.5 * torch.eye(12, dtype=torch.float64).view(4, 3, 4, 3))


def _f(W, b, x):
    return torch.tanh(x @ W.T + b).pow(2) * x.sum(-1, keepdim=True)


def _inputs():
    torch.manual_seed(1)
    W = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    return W, b, x


def test_jacobian_of_several_inputs_matches_autograd_functional():
    W, b, x = _inputs()
    J = curvature.jacobian(_f(W, b, x), [W, b, x])
    expected = autograd_jacobian(_f, (W.detach(), b.detach(), x.detach()))
    assert isinstance(J, list) and len(J) == 3
    for j, e, t in zip(J, expected, (W, b, x)):
        assert j.shape == (5, 3, *t.shape)
        assert_close(j, e)


def test_jacobian_of_scalar_output_is_the_gradient():
    W, b, x = _inputs()
    out = _f(W, b, x).sum()
    (J,) = curvature.jacobian(out, (W,))
    (g,) = torch.autograd.grad(out, W, retain_graph=True)
    assert J.shape == W.shape
    assert_close(J, g)


@pytest.mark.parametrize("chunk_size", [1, 2, 7, 15, 100])
def test_jacobian_chunk_sizes_give_identical_results(chunk_size):
    W, b, x = _inputs()
    out = _f(W, b, x)
    full = curvature.jacobian(out, [W, b, x])
    chunked = curvature.jacobian(out, [W, b, x], chunk_size=chunk_size)
    for c, f in zip(chunked, full):
        assert torch.equal(c, f)


def test_jacobian_keeps_the_graph():
    W, b, x = _inputs()
    out = _f(W, b, x)
    first = curvature.jacobian(out, W)
    assert torch.equal(curvature.jacobian(out, W), first)
    out.sum().backward()
    assert_close(W.grad, first.sum((0, 1)))


def test_jacobian_wrt_unused_input_is_zero():
    W, b, x = _inputs()
    unused = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    J_W, J_unused = curvature.jacobian(_f(W, b, x), [W, unused], chunk_size=4)
    assert J_unused.shape == (5, 3, 2, 2)
    assert torch.count_nonzero(J_unused) == 0
    assert torch.count_nonzero(J_W) > 0


def test_jacobian_of_output_without_grad_fn_is_refused():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="no grad_fn"):
        curvature.jacobian(x.detach() * 2, x)
    with pytest.raises(ValueError, match="no grad_fn"):
        curvature.jacobian(x, x)  # a leaf has no grad_fn either


def test_jacobian_wrt_input_not_requiring_grad_is_refused():
    x = torch.randn(3, requires_grad=True)
    c = torch.randn(3)
    with pytest.raises(ValueError, match=r"inputs\[1\] must be a tensor with requires_grad=True"):
        curvature.jacobian(x * c, [x, c])


def test_jacobian_nonpositive_chunk_size_is_refused():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="chunk_size=0"):
        curvature.jacobian(x * 2, x, chunk_size=0)
