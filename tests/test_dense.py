"""Dense curvature references (SPEC sections 1 and 3) against independent computations.

Every matrix is ``[P, P]`` over the trainable parameters in ``model.parameters()`` order,
flattened row-major. The references here avoid the library's code path: Jacobians row by
row with ``torch.autograd.grad``, loss Hessians with ``torch.autograd.functional.hessian``,
per-sample gradients with a Python loop over samples (``l_n`` = the loss module applied to
sample ``n`` alone, so ``EF = R sum_n g_n g_n^T`` with ``R = 1/N`` for mean, ``1`` for sum).
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple

import pytest
import torch
from cases import bce as _bce
from cases import ce as _ce
from cases import mse as _mse
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvature
from curvature import dense

N = 5


pytestmark = pytest.mark.usefixtures("float64_seeded")


# -- models and data as data --------------------------------------------------------------
class TinyTransformer(nn.Module):
    """Embedding -> LayerNorm -> self-attention (residual) -> Linear; logits ``[N, C, S]``."""

    def __init__(self, vocab=6, dim=4, heads=2, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        h = h + self.attn(h, h, h)[0]  # need_weights=True: no fused SDPA kernel
        return self.head(h).transpose(1, 2)


def _mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(2, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


class Problem(NamedTuple):
    model: Callable[[], nn.Module]
    X: Callable[[], Tensor]
    y: Callable[[], Tensor]
    loss: Callable[[str], nn.Module]


PROBLEMS: Dict[str, Problem] = {
    "mlp-ce": Problem(_mlp, lambda: torch.randn(N, 3), lambda: torch.randint(0, 3, (N,)), _ce),
    "mlp-mse": Problem(_mlp, lambda: torch.randn(N, 3), lambda: torch.randn(N, 3), _mse),
    "mlp-bce": Problem(_mlp, lambda: torch.randn(N, 3), lambda: torch.rand(N, 3), _bce),
    "cnn-ce": Problem(
        _cnn, lambda: torch.randn(N, 2, 4, 4), lambda: torch.randint(0, 3, (N,)), _ce
    ),
    "transformer-ce": Problem(
        TinyTransformer,
        lambda: torch.randint(0, 6, (N, 3)),
        lambda: torch.randint(0, 3, (N, 3)),
        _ce,
    ),
}
REDUCTIONS = ["mean", "sum"]


def _build(name, reduction):
    p = PROBLEMS[name]
    return p.model(), p.loss(reduction), p.X(), p.y()


def _params(model) -> List[Tensor]:
    return [p for p in model.parameters() if p.requires_grad]


def _flatten(tensors) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _assert_close(actual: Tensor, expected: Tensor, tol: float = 1e-10):
    scale = expected.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol * scale)


# -- independent references ----------------------------------------------------------------
def _jacobian_loop(model, X) -> Tensor:
    """``[out.numel(), P]``, one ``autograd.grad`` per output element."""
    params = _params(model)
    out = model(X).reshape(-1)
    rows = []
    for i in range(out.numel()):
        gs = torch.autograd.grad(out[i], params, retain_graph=True, allow_unused=True)
        rows.append(_flatten([torch.zeros_like(p) if g is None else g for g, p in zip(gs, params)]))
    return torch.stack(rows)


def _ggn_loop(model, loss_func, X, y) -> Tensor:
    J = _jacobian_loop(model, X)
    out = model(X).detach()
    H = torch.autograd.functional.hessian(lambda f: loss_func(f, y), out).reshape(
        out.numel(), out.numel()
    )
    return J.T @ H @ J


def _hessian_autograd(model, loss_func, X, y) -> Tensor:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = _params(model)
    flat = _flatten([p.detach() for p in params])

    def loss_of(v):
        tree, i = {}, 0
        for n, p in zip(names, params):
            tree[n] = v[i : i + p.numel()].view_as(p)
            i += p.numel()
        return loss_func(torch.func.functional_call(model, tree, (X,)), y)

    return torch.autograd.functional.hessian(loss_of, flat)


def _per_sample_grads_loop(model, loss_func, X, y) -> Tensor:
    params = _params(model)
    rows = []
    for n in range(X.shape[0]):
        loss = loss_func(model(X[n : n + 1]), y[n : n + 1])
        rows.append(_flatten(torch.autograd.grad(loss, params, allow_unused=True)))
    return torch.stack(rows)


def _ef_loop(model, loss_func, X, y) -> Tensor:
    g = _per_sample_grads_loop(model, loss_func, X, y)
    R = 1.0 / X.shape[0] if loss_func.reduction == "mean" else 1.0
    return R * g.T @ g


# -- GGN, Hessian, empirical Fisher --------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "model",
    [
        lambda: nn.Linear(4, 3),
        lambda: nn.Sequential(nn.Tanh(), nn.Linear(4, 2)),  # linear in the parameters
    ],
    ids=["linear", "fixed-features"],
)
def test_ggn_equals_hessian_for_a_model_linear_in_its_parameters_with_mse(model, reduction):
    model, loss_func = model(), _mse(reduction)
    X, y = torch.randn(N, 4), torch.randn(N, model(torch.randn(1, 4)).shape[1])
    _assert_close(
        curvature.ggn(model, loss_func, (X, y)), curvature.hessian(model, loss_func, (X, y))
    )


def test_ggn_differs_from_hessian_for_a_deep_linear_network():
    # sanity: the previous test is not vacuous (products of weights have curvature)
    model, loss_func = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), _mse("mean")
    X, y = torch.randn(N, 3), torch.randn(N, 2)
    G, H = curvature.ggn(model, loss_func, (X, y)), curvature.hessian(model, loss_func, (X, y))
    assert (G - H).abs().max() > 1e-3


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_ggn_equals_JT_H_J_from_an_autograd_loop(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    _assert_close(curvature.ggn(model, loss_func, (X, y)), _ggn_loop(model, loss_func, X, y))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_hessian_equals_autograd_functional_hessian(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    _assert_close(
        curvature.hessian(model, loss_func, (X, y)), _hessian_autograd(model, loss_func, X, y)
    )


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_empirical_fisher_equals_R_sum_of_per_sample_gradient_outer_products(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    _assert_close(
        curvature.empirical_fisher(model, loss_func, (X, y)), _ef_loop(model, loss_func, X, y)
    )


def test_frozen_parameters_are_left_out():
    model, loss_func, X, y = _build("mlp-ce", "mean")
    full = curvature.ggn(model, loss_func, (X, y))
    model[0].weight.requires_grad_(False)
    skip = model[0].weight.numel()
    _assert_close(curvature.ggn(model, loss_func, (X, y)), full[skip:, skip:])
    _assert_close(
        curvature.hessian(model, loss_func, (X, y)), _hessian_autograd(model, loss_func, X, y)
    )


# -- Monte-Carlo Fisher ------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", ["mlp-ce", "mlp-mse", "mlp-bce"])
def test_mc_fisher_with_many_samples_approaches_the_ggn(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    G = curvature.ggn(model, loss_func, (X, y))
    F = curvature.fisher(model, loss_func, (X, y), mc_samples=4000, seed=1)
    assert ((F - G).norm() / G.norm()).item() < 0.06


def test_mc_fisher_is_reproducible_by_seed():
    model, loss_func, X, y = _build("mlp-ce", "mean")

    def F(seed):
        return curvature.fisher(model, loss_func, (X, y), mc_samples=2, seed=seed)

    torch.testing.assert_close(F(3), F(3), rtol=0, atol=0)
    assert not torch.allclose(F(3), F(4))


# -- matrix-vector products -----------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_ggn_vector_product_equals_the_dense_ggn_times_v(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    v = [torch.randn_like(p) for p in _params(model)]
    Gv = curvature.ggn_vector_product(model, loss_func, (X, y), v)
    assert [t.shape for t in Gv] == [t.shape for t in v]
    _assert_close(_flatten(Gv), curvature.ggn(model, loss_func, (X, y)) @ _flatten(v))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_hessian_vector_product_equals_the_dense_hessian_times_v(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    v = [torch.randn_like(p) for p in _params(model)]
    Hv = curvature.hessian_vector_product(model, loss_func, (X, y), v)
    assert [t.shape for t in Hv] == [t.shape for t in v]
    _assert_close(_flatten(Hv), _hessian_autograd(model, loss_func, X, y) @ _flatten(v))


@pytest.mark.parametrize(
    "product", [curvature.ggn_vector_product, curvature.hessian_vector_product]
)
def test_vector_of_wrong_shapes_is_refused(product):
    model, loss_func, X, y = _build("mlp-ce", "mean")
    v = [torch.randn_like(p) for p in _params(model)]
    with pytest.raises(ValueError, match="shaped like"):
        product(model, loss_func, (X, y), v[:-1])
    with pytest.raises(ValueError, match="shaped like"):
        product(model, loss_func, (X, y), [t.reshape(1, -1) for t in v])


# -- several batches are their union -------------------------------------------------------
SPLITS = [(0, 2), (2, 3), (3, 5)]  # uneven, so mean weighting by batch size matters


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "matrix",
    [curvature.ggn, curvature.hessian, curvature.empirical_fisher],
    ids=lambda f: f.__name__,
)
@pytest.mark.parametrize("name", ["mlp-ce", "mlp-mse", "transformer-ce"])
def test_list_of_batches_equals_their_union(name, matrix, reduction):
    model, loss_func, X, y = _build(name, reduction)
    batches = [(X[a:b], y[a:b]) for a, b in SPLITS]
    _assert_close(matrix(model, loss_func, batches), matrix(model, loss_func, (X, y)))
    # any iterable of batches, e.g. a generator
    _assert_close(matrix(model, loss_func, iter(batches)), matrix(model, loss_func, (X, y)))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "product", [curvature.ggn_vector_product, curvature.hessian_vector_product]
)
def test_vector_products_on_a_list_of_batches_equal_their_union(product, reduction):
    model, loss_func, X, y = _build("mlp-ce", reduction)
    v = [torch.randn_like(p) for p in _params(model)]
    batches = [(X[a:b], y[a:b]) for a, b in SPLITS]
    _assert_close(
        _flatten(product(model, loss_func, batches, v)),
        _flatten(product(model, loss_func, (X, y), v)),
    )


def test_mc_fisher_on_batches_is_weighted_like_their_union():
    # the draws differ, but in expectation (many samples) the weighting must be the union's
    model, loss_func, X, y = _build("mlp-ce", "mean")
    batches = [(X[a:b], y[a:b]) for a, b in SPLITS]
    F = curvature.fisher(model, loss_func, batches, mc_samples=4000, seed=2)
    G = curvature.ggn(model, loss_func, (X, y))
    assert ((F - G).norm() / G.norm()).item() < 0.06


@pytest.mark.parametrize(
    "matrix",
    [curvature.ggn, curvature.hessian, curvature.empirical_fisher, curvature.fisher],
    ids=lambda f: f.__name__,
)
def test_unsupported_loss_is_refused(matrix):
    model, _, X, y = _build("mlp-mse", "mean")
    with pytest.raises(ValueError, match="CrossEntropyLoss"):
        matrix(model, nn.L1Loss(), (X, y))


def test_dense_module_matches_public_names():
    assert curvature.ggn is dense.ggn and curvature.fisher is dense.fisher


# -- regressions: forward-mode AD got these wrong in torch 2.13 ----------------------------
# (Embedding.padding_idx is not masked by jvp; torch.func.hessian of LayerNorm misses cross
# terms; jvp(grad) through mse_loss(mean) raises; the fused attention kernel has no jvp)
def _padded_embedding():
    model = nn.Sequential(nn.Embedding(5, 2, padding_idx=0), nn.Flatten(), nn.Linear(6, 3))
    X, y = torch.tensor([[0, 1, 2], [3, 0, 4]]), torch.tensor([0, 2])
    return model, nn.CrossEntropyLoss(), X, y


def _finite_difference_hessian(model, loss_func, X, y, eps=1e-5) -> Tensor:
    """Central differences of autograd gradients, column by column."""
    params = _params(model)
    flat = _flatten([p.detach() for p in params])

    def gradient(v):
        with torch.no_grad():
            torch.nn.utils.vector_to_parameters(v, params)
        return _flatten(torch.autograd.grad(loss_func(model(X), y), params))

    cols = []
    for i in range(flat.numel()):
        e = torch.zeros_like(flat)
        e[i] = eps
        cols.append((gradient(flat + e) - gradient(flat - e)) / (2 * eps))
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(flat, params)
    return torch.stack(cols, 1)


@pytest.mark.parametrize(
    "model",
    [
        lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)),
        lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 4)),
    ],
    ids=["linear-layernorm", "mlp-layernorm"],
)
def test_hessian_matches_finite_differences(model):
    # (not for Embedding(padding_idx): autograd treats the padding row as a constant)
    model = model()
    loss_func, X, y = nn.CrossEntropyLoss(), torch.randn(2, 3), torch.tensor([0, 3])
    H = curvature.hessian(model, loss_func, (X, y))
    _assert_close(H, _finite_difference_hessian(model, loss_func, X, y), tol=1e-7)


def test_ggn_of_a_padded_embedding_has_zero_padding_rows():
    model, loss_func, X, y = _padded_embedding()
    G = curvature.ggn(model, loss_func, (X, y))
    assert G[:2].abs().max() == 0 and G[:, :2].abs().max() == 0
    _assert_close(G, _ggn_loop(model, loss_func, X, y))


def test_hessian_of_a_padded_embedding_is_symmetric_and_matches_autograd():
    model, loss_func, X, y = _padded_embedding()
    H = curvature.hessian(model, loss_func, (X, y))
    _assert_close(H, H.T)
    _assert_close(H, _hessian_autograd(model, loss_func, X, y))


def test_ggn_vector_product_of_a_padded_embedding_equals_ggn_times_v():
    model, loss_func, X, y = _padded_embedding()
    v = [torch.randn_like(p) for p in _params(model)]
    Gv = curvature.ggn_vector_product(model, loss_func, (X, y), v)
    _assert_close(_flatten(Gv), curvature.ggn(model, loss_func, (X, y)) @ _flatten(v))


def test_hessian_vector_product_of_a_padded_embedding_equals_hessian_times_v():
    model, loss_func, X, y = _padded_embedding()
    v = [torch.randn_like(p) for p in _params(model)]
    Hv = curvature.hessian_vector_product(model, loss_func, (X, y), v)
    _assert_close(_flatten(Hv), _hessian_autograd(model, loss_func, X, y) @ _flatten(v))


@pytest.mark.parametrize("mode", ["chunk 1", "chunk 5", "chunk 64", "no batching rule"])
def test_hessian_rows_in_chunks_or_one_by_one_match_autograd(monkeypatch, mode):
    model, loss_func, X, y = _build("transformer-ce", "mean")
    if mode.startswith("chunk"):
        monkeypatch.setattr(dense, "HESSIAN_CHUNK", int(mode.split()[1]))
    else:  # the batched backward raises: every row is computed on its own
        grad = torch.autograd.grad

        def no_batching(*args, **kwargs):
            if kwargs.get("is_grads_batched"):
                raise RuntimeError("Batching rule not implemented for aten::something")
            return grad(*args, **kwargs)

        monkeypatch.setattr(torch.autograd, "grad", no_batching)
    H = curvature.hessian(model, loss_func, (X, y))
    assert H.shape[0] % 5 != 0  # a last chunk shorter than the others
    _assert_close(H, _hessian_autograd(model, loss_func, X, y))


@pytest.mark.parametrize("N", [1, 4])
def test_hessian_of_linear_then_layernorm_matches_autograd(N):
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    loss_func, X, y = nn.CrossEntropyLoss(), torch.randn(N, 3), torch.randint(0, 4, (N,))
    H = curvature.hessian(model, loss_func, (X, y))
    _assert_close(H, _hessian_autograd(model, loss_func, X, y))


def test_hessian_vector_product_of_linear_then_layernorm_matches_autograd():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    loss_func, X, y = nn.CrossEntropyLoss(), torch.randn(4, 3), torch.randint(0, 4, (4,))
    v = [torch.randn_like(p) for p in model.parameters()]
    Hv = curvature.hessian_vector_product(model, loss_func, (X, y), v)
    _assert_close(_flatten(Hv), _hessian_autograd(model, loss_func, X, y) @ _flatten(v))


def test_hessian_vector_product_of_a_linear_layer_with_mse_mean():
    model, X, y = nn.Linear(3, 2), torch.randn(4, 3), torch.randn(4, 2)
    v = [torch.randn_like(p) for p in model.parameters()]
    Hv = curvature.hessian_vector_product(model, nn.MSELoss(), (X, y), v)
    _assert_close(_flatten(Hv), curvature.hessian(model, nn.MSELoss(), (X, y)) @ _flatten(v))


@pytest.mark.parametrize("what", ["hessian", "ggn_vector_product", "hessian_vector_product"])
def test_second_order_paths_work_on_a_transformer_encoder_layer(what):
    model = nn.Sequential(
        nn.TransformerEncoderLayer(4, 2, dim_feedforward=8, dropout=0.0, batch_first=True),
        nn.Flatten(),
        nn.Linear(12, 3),
    )
    loss_func, X, y = nn.CrossEntropyLoss(), torch.randn(2, 3, 4), torch.randint(0, 3, (2,))
    v = [torch.randn_like(p) for p in _params(model)]
    with sdpa_kernel(SDPBackend.MATH):  # the references need a twice-differentiable kernel
        G = _ggn_loop(model, loss_func, X, y)
        H = _hessian_autograd(model, loss_func, X, y)
    if what == "hessian":
        _assert_close(curvature.hessian(model, loss_func, (X, y)), H, tol=1e-8)
    else:
        result = _flatten(getattr(curvature, what)(model, loss_func, (X, y), v))
        ref = G if what == "ggn_vector_product" else H
        _assert_close(result, ref @ _flatten(v), tol=1e-8)
