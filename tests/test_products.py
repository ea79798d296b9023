"""The one Hessian/GGN-vector product (curvature.products) against autograd references."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from curvature.layout import ParamLayout
from curvature.products import HessianVectorProducts, ggn_vp, hvp

pytestmark = pytest.mark.usefixtures("float64_seeded")


def _problem():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    return model, nn.CrossEntropyLoss(), X, y


def _hessian(model, loss_func, X, y):
    """``[P, P]`` with torch.func, independent of the products."""
    layout = ParamLayout.of(model)
    params = {n: p.detach() for n, p in zip(layout.names, layout.params)}

    def loss(flat):
        ps = layout.unflatten_dict(flat)
        out = torch.func.functional_call(model, {**params, **ps}, (X,))
        return loss_func(out, y)

    return torch.func.hessian(loss)(layout.flat_params())


def test_hvp_of_one_and_of_a_batch_of_vectors_match_the_hessian():
    model, loss_func, X, y = _problem()
    layout = ParamLayout.of(model)
    H = _hessian(model, loss_func, X, y)
    loss = loss_func(model(X), y)
    v = torch.randn(layout.numel)
    torch.testing.assert_close(hvp(loss, layout, v), H @ v)
    V = torch.randn(3, layout.numel)
    torch.testing.assert_close(hvp(loss, list(model.parameters()), V, is_grads_batched=True), V @ H)


def test_matrix_diagonal_and_chunks_match_the_hessian():
    model, loss_func, X, y = _problem()
    H = _hessian(model, loss_func, X, y)
    products = HessianVectorProducts(loss_func(model(X), y), ParamLayout.of(model))
    for chunk in (None, 1, 7):
        torch.testing.assert_close(products.matrix(chunk_size=chunk), H)
        torch.testing.assert_close(products.diagonal(chunk_size=chunk), H.diagonal())
        torch.testing.assert_close(products(H[:5], chunk_size=chunk), H[:5] @ H)


def test_products_fall_back_to_one_backward_per_row(monkeypatch):
    model, loss_func, X, y = _problem()
    H = _hessian(model, loss_func, X, y)
    grad = torch.autograd.grad

    def no_batching(*args, **kwargs):
        if kwargs.get("is_grads_batched"):
            raise RuntimeError("Batching rule not implemented for aten::something")
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", no_batching)
    products = HessianVectorProducts(loss_func(model(X), y), list(model.parameters()))
    torch.testing.assert_close(products.matrix(chunk_size=4), H)


def test_unused_and_linear_parameters_have_zero_rows():
    w, unused, lin = (torch.randn(3, requires_grad=True) for _ in range(3))
    x = torch.randn(3)
    loss = (w * x).pow(2).sum() + lin.sum()  # linear in `lin`: its gradient has no graph
    H = HessianVectorProducts(loss, [w, unused, lin]).matrix()
    expected = torch.zeros(9, 9)
    expected[:3, :3] = torch.diag(2 * x * x)
    torch.testing.assert_close(H, expected)


def test_errors_name_the_caller():
    p = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="my_fn: loss must be a scalar"):
        HessianVectorProducts(p * 2, [p], caller="my_fn")
    with pytest.raises(ValueError, match="does not require grad"):
        hvp(torch.tensor(1.0), [p], torch.ones(2))
    products = HessianVectorProducts((p**3).sum(), [p])
    with pytest.raises(ValueError, match=r"V must be \[K, P\] with P = 2; got \(3,\)"):
        products(torch.ones(3))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer"):
        products.matrix(chunk_size=0)


def test_ggn_vp_matches_the_dense_ggn():
    model, loss_func, X, y = _problem()
    layout = ParamLayout.of(model)
    v = torch.randn(layout.numel)
    G = curvature.ggn(model, loss_func, (X, y))
    torch.testing.assert_close(ggn_vp(model(X), lambda f: loss_func(f, y), layout, v), G @ v)


def test_a_zero_dim_parameter():
    s, w = torch.tensor(1.5, requires_grad=True), torch.randn(2, requires_grad=True)
    x = torch.randn(2)
    loss = (s**3 * (w * x).sum()).sin()

    def f(flat):
        return (flat[0] ** 3 * (flat[1:] * x).sum()).sin()

    H = torch.func.hessian(f)(torch.cat([s.detach().reshape(1), w.detach()]))
    products = HessianVectorProducts(loss, ParamLayout([("s", s), ("w", w)]))
    torch.testing.assert_close(products.matrix(), H)
    torch.testing.assert_close(products.matrix(chunk_size=1), H)
