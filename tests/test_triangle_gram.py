"""Large Gram matrices on a CPU from their lower block triangle (``triangle_gram``).

The Kronecker statistics ``x^T x`` are symmetric; above ``TRIANGLE_GRAM_WORK``
multiply-adds a CPU takes them a block row at a time, the lower block triangle only,
and mirrors the rest (benchmarks/gram_blocks.py has the times). Checked against the
plain product in float64, exact symmetry, where ``gram`` takes which route, autograd,
and KFAC's input factor of a layer large enough to take it, against its definition.
"""

import pytest
import torch
from torch import nn

import curvature
from curvature.layers import precision
from curvature.layers.precision import gram, triangle_gram


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("shape", [(50, 129), (7, 300), (300, 7)])
def test_the_triangle_is_the_product_and_exactly_symmetric(blocks, shape):
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    out = triangle_gram(x, blocks)
    torch.testing.assert_close(out, x.T @ x, rtol=1e-13, atol=1e-12)
    assert torch.equal(out, out.T)


def test_gram_takes_the_triangle_above_the_threshold_only(monkeypatch):
    monkeypatch.setattr(precision, "TRIANGLE_GRAM_WORK", 300 * 200 * 200)
    g = torch.Generator().manual_seed(1)
    big, small = torch.randn(1, 300, 200, generator=g), torch.randn(1, 299, 200, generator=g)
    assert torch.equal(gram(big), triangle_gram(big[0]).unsqueeze(0))
    assert torch.equal(gram(big[0]), triangle_gram(big[0]))
    assert torch.equal(gram(small), torch.bmm(small.mT, small))
    narrow = torch.randn(1, 2000, 100, generator=g)  # D < 128: one GEMM
    assert torch.equal(gram(narrow), torch.bmm(narrow.mT, narrow))
    monkeypatch.setattr(precision, "TRIANGLE_GRAM_DEVICES", ())
    assert torch.equal(gram(big), torch.bmm(big.mT, big))


def test_an_input_that_requires_grad_keeps_its_graph(monkeypatch):
    """``out=`` takes no graph: with grad mode on, a leaf that requires grad gets the plain
    product (differentiable); under ``no_grad`` (the statistics) the triangle."""
    monkeypatch.setattr(precision, "TRIANGLE_GRAM_WORK", 1)
    x = torch.randn(20, 130, dtype=torch.float64, requires_grad=True)
    out = gram(x)
    out.trace().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())
    with torch.no_grad():
        assert torch.equal(gram(x), triangle_gram(x.detach()))


def test_kfac_input_factor_of_a_large_layer_is_its_definition():
    """A layer whose input factor takes the triangle (``N (D_in + 1)^2 >= 1e8``): ``A``
    after one step with ``factor_decay=0`` is ``[X 1]^T [X 1] / N``, to float64 rounding."""
    torch.manual_seed(0)
    N, D = 300, 600
    assert N * (D + 1) ** 2 >= precision.TRIANGLE_GRAM_WORK
    model = nn.Sequential(nn.Linear(D, 3)).double()
    X, y = torch.randn(N, D, dtype=torch.float64), torch.randint(0, 3, (N,))
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2, factor_decay=0.0)
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(X), y).backward()
    opt.step()
    A, _ = opt.factors()["0"]
    a = torch.cat([X, torch.ones(N, 1, dtype=X.dtype)], 1)
    torch.testing.assert_close(A.reshape(D + 1, D + 1), a.T @ a / N, rtol=1e-12, atol=1e-13)
    assert torch.equal(A, A.mT)
    opt.close()


def test_under_vmap_gram_takes_one_gemm(monkeypatch):
    """``out=`` does not take vmap'ed tensors: inside ``torch.func.vmap`` the plain product."""
    monkeypatch.setattr(precision, "TRIANGLE_GRAM_WORK", 1)
    x = torch.randn(3, 20, 130, dtype=torch.float64)
    out = torch.func.vmap(gram)(x)
    torch.testing.assert_close(out, x.mT @ x)


@pytest.mark.parametrize("bad", [{"blocks": 0}, {"blocks": 2.5}, {"x": torch.zeros(2, 3, 4)}])
def test_bad_input_is_refused(bad):
    args = {"x": torch.zeros(3, 4), "blocks": 2, **bad}
    with pytest.raises(ValueError, match="triangle_gram"):
        triangle_gram(args["x"], args["blocks"])
