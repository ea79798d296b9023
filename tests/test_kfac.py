"""KFAC and EKFAC (SPEC sections 1 and 3) against the dense GGN in the exact cases.

A layer with weight ``W [out, in]`` and bias gets the block ``kron(G, A)`` in the row-major
order of ``[W | b]`` (the bias is an extra input coordinate equal to 1), ``A`` holds the
``1/N`` and ``G`` the loss scaling. The approximation is then *exact*, i.e. equal to the
GGN masked to the per-layer blocks, for: one datum; deep linear networks with MSE; weight
sharing with the matching ``kfac_approx`` (Eschenhagen et al., 2023). EKFAC keeps KFAC's
eigenbasis and is exact wherever KFAC is, and never further from the GGN blocks.
"""

from __future__ import annotations

import copy
import math
from typing import Callable, Dict, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from cases import bce as _bce
from cases import ce as _ce
from cases import mse as _mse
from torch import Tensor, nn

import curvature
from curvature import KFACApprox

pytestmark = pytest.mark.usefixtures("float64_seeded")


# -- models --------------------------------------------------------------------------------
class MeanOverPositions(nn.Module):
    """``net(x)`` averaged over the axes ``dims`` (weight sharing with a reduced output)."""

    def __init__(self, net: nn.Module, dims):
        super().__init__()
        self.net, self.dims = net, dims

    def forward(self, x):
        return self.net(x).mean(self.dims)


class EmbedNormLinear(nn.Module):
    """Embedding(padding_idx) -> LayerNorm -> Linear, averaged over the sequence."""

    def __init__(self, vocab=7, dim=3, out=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, out)

    def forward(self, tokens):
        return self.fc(self.norm(self.emb(tokens))).mean(1)


def _deep_linear():
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4, bias=False), nn.Linear(4, 2))


def _tanh_mlp(out=3):
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, out))


def _conv_deep_linear(groups=1):
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, groups=groups), nn.Conv2d(4, 4, 1, groups=groups)
    )


class Case(NamedTuple):
    model: Callable[[], nn.Module]
    X: Callable[[], Tensor]
    y: Callable[[], Tensor]
    loss: Callable[[str], nn.Module]
    kfac_approx: str = "expand"


def _deep_linear_case(N):
    return Case(_deep_linear, lambda: torch.randn(N, 3), lambda: torch.randn(N, 2), _mse)


EXACT: Dict[str, Case] = {
    "deep-linear-mse-N1": _deep_linear_case(1),
    "deep-linear-mse-N7": _deep_linear_case(7),
    "one-datum-tanh-mlp-ce": Case(
        _tanh_mlp, lambda: torch.randn(1, 3), lambda: torch.randint(0, 3, (1,)), _ce
    ),
    "one-datum-tanh-mlp-bce": Case(
        _tanh_mlp, lambda: torch.randn(1, 3), lambda: torch.rand(1, 3), _bce
    ),
    "one-datum-tanh-mlp-mse": Case(
        _tanh_mlp, lambda: torch.randn(1, 3), lambda: torch.randn(1, 3), _mse
    ),
    "expand-deep-linear-on-[N,4,8,D]": Case(
        _deep_linear, lambda: torch.randn(2, 4, 8, 3), lambda: torch.randn(2, 4, 8, 2), _mse
    ),
    "reduce-deep-linear-mean-over-positions": Case(
        lambda: MeanOverPositions(_deep_linear(), 1),
        lambda: torch.randn(5, 6, 3),
        lambda: torch.randn(5, 2),
        _mse,
        "reduce",
    ),
    "expand-conv3x3-conv1x1-flatten": Case(
        lambda: nn.Sequential(_conv_deep_linear(), nn.Flatten()),
        lambda: torch.randn(3, 2, 5, 5),
        lambda: torch.randn(3, 4 * 25),
        _mse,
    ),
    "expand-grouped-conv3x3-conv1x1-flatten": Case(
        lambda: nn.Sequential(_conv_deep_linear(groups=2), nn.Flatten()),
        lambda: torch.randn(3, 2, 5, 5),
        lambda: torch.randn(3, 4 * 25),
        _mse,
    ),
    "reduce-conv3x3-conv1x1-mean-over-positions": Case(
        lambda: MeanOverPositions(_conv_deep_linear(), (2, 3)),
        lambda: torch.randn(3, 2, 5, 5),
        lambda: torch.randn(3, 4),
        _mse,
        "reduce",
    ),
    "one-datum-grouped-conv-ce": Case(
        lambda: nn.Sequential(nn.Conv2d(4, 6, 3, groups=2), nn.Flatten()),
        lambda: torch.randn(1, 4, 3, 3),
        lambda: torch.randint(0, 6, (1,)),
        _ce,
    ),
    "one-datum-grouped-conv-mse": Case(
        lambda: nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten()),
        lambda: torch.randn(1, 2, 5, 5),
        lambda: torch.randn(1, 36),
        _mse,
    ),
    "expand-conv1d-stride-dilation-padding": Case(
        lambda: nn.Sequential(nn.Conv1d(2, 3, 3, stride=2, dilation=2, padding=2), nn.Flatten()),
        lambda: torch.randn(3, 2, 9),
        lambda: torch.randn(3, 15),
        _mse,
    ),
    "expand-conv3d": Case(
        lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.Flatten()),
        lambda: torch.randn(2, 2, 3, 3, 3),
        lambda: torch.randn(2, 24),
        _mse,
    ),
    "expand-conv2d-circular-padding": Case(
        lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, padding_mode="circular"), nn.Flatten()),
        lambda: torch.randn(2, 2, 4, 4),
        lambda: torch.randn(2, 48),
        _mse,
    ),
    "one-datum-batchnorm-eval-mlp-ce": Case(
        lambda: nn.Sequential(
            nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)
        ).eval(),
        lambda: torch.randn(1, 3),
        lambda: torch.randint(0, 2, (1,)),
        _ce,
    ),
    "one-datum-groupnorm-mlp-ce": Case(
        lambda: nn.Sequential(nn.Linear(3, 4), nn.GroupNorm(2, 4), nn.Tanh(), nn.Linear(4, 2)),
        lambda: torch.randn(1, 3),
        lambda: torch.randint(0, 2, (1,)),
        _ce,
    ),
    "one-datum-embedding-layernorm-linear-S1": Case(
        EmbedNormLinear, lambda: torch.tensor([[3]]), lambda: torch.tensor([1]), _ce
    ),
    "one-datum-embedding-at-padding-idx-S1": Case(
        EmbedNormLinear, lambda: torch.tensor([[0]]), lambda: torch.tensor([2]), _ce
    ),
}
REDUCTIONS = ["mean", "sum"]


def _build(case: Case, reduction: str):
    return case.model(), case.loss(reduction), case.X(), case.y()


# -- helpers -------------------------------------------------------------------------------
def _layer_mask(model: nn.Module) -> Tensor:
    """``[P, P]`` True on the blocks of each module's own trainable parameters.

    Grouped convolutions are block-diagonal over their groups (one ``(A_c, G_c)`` each).
    """
    owner = []
    for i, (_, module) in enumerate(model.named_modules()):
        groups = getattr(module, "groups", 1) if isinstance(module, nn.modules.conv._ConvNd) else 1
        for p in module.parameters(recurse=False):
            if p.requires_grad:
                per_out = p[0].numel()  # weight [out, ...] or bias [out]
                group = torch.arange(p.shape[0]) // (p.shape[0] // groups)
                owner += (i * 1000 + group).repeat_interleave(per_out).tolist()
    owner = torch.tensor(owner)
    return owner[:, None] == owner[None, :]


def _block_mask(approx: KFACApprox) -> Tensor:
    """``[P, P]`` True on the approximation's own blocks (e.g. per group, per projection)."""
    M = torch.zeros(approx.num_params, approx.num_params, dtype=torch.bool)
    for b in approx.blocks:
        for c in range(b.index.shape[0]):
            ix = b.index[c].reshape(-1)
            M[ix[:, None], ix[None, :]] = True
    return M


def _matches(actual: Tensor, expected: Tensor, tol: float = 1e-10) -> bool:
    return bool((actual - expected).abs().max() <= tol * expected.abs().max())


def _assert_matches(actual: Tensor, expected: Tensor, tol: float = 1e-10):
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= tol * scale, f"max error {err:.3e} vs scale {scale:.3e}"


def _params(model):
    return [p for p in model.parameters() if p.requires_grad]


def _flatten(ts) -> Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _masked_ggn(model, loss_func, data) -> Tensor:
    return curvature.ggn(model, loss_func, data) * _layer_mask(model)


# -- the exact cases -----------------------------------------------------------------------
@pytest.mark.parametrize("approx", [curvature.kfac, curvature.ekfac], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(EXACT))
def test_type2_equals_the_block_diagonal_ggn_in_the_exact_cases(name, reduction, approx):
    case = EXACT[name]
    model, loss_func, X, y = _build(case, reduction)
    K = approx(model, loss_func, (X, y), kfac_approx=case.kfac_approx)
    assert not K.uncovered
    _assert_matches(K.to_dense(), _masked_ggn(model, loss_func, (X, y)))


EF_EXACT = ["one-datum-tanh-mlp-ce", "one-datum-tanh-mlp-bce", "one-datum-tanh-mlp-mse"]


@pytest.mark.parametrize("approx", [curvature.kfac, curvature.ekfac], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", EF_EXACT)
def test_empirical_equals_the_block_diagonal_empirical_fisher_for_one_datum(
    name, reduction, approx
):
    model, loss_func, X, y = _build(EXACT[name], reduction)
    K = approx(model, loss_func, (X, y), fisher="empirical")
    EF = curvature.empirical_fisher(model, loss_func, (X, y)) * _layer_mask(model)
    _assert_matches(K.to_dense(), EF)


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("expand-deep-linear-on-[N,4,8,D]", "reduce"),
        ("expand-conv3x3-conv1x1-flatten", "reduce"),
        ("reduce-deep-linear-mean-over-positions", "expand"),
        ("reduce-conv3x3-conv1x1-mean-over-positions", "expand"),
    ],
)
def test_the_other_weight_sharing_setting_is_not_exact(name, wrong):
    # the exact cases above depend on the matching setting: expand != reduce here
    model, loss_func, X, y = _build(EXACT[name], "mean")
    K = curvature.kfac(model, loss_func, (X, y), kfac_approx=wrong)
    assert not _matches(K.to_dense(), _masked_ggn(model, loss_func, (X, y)), tol=1e-3)


def _perturb(K: KFACApprox, layer: str, how: str) -> KFACApprox:
    K = copy.deepcopy(K)
    b = next(b for b in K.blocks if b.name == layer)
    if how == "G*2":
        b.G = 2 * b.G
    elif how == "A*2":
        b.A = 2 * b.A
    elif how == "swap A and G":
        b.A, b.G = b.G, b.A
    elif how == "A/N instead of A":
        b.A = b.A / 7
    b.record = None
    return K


@pytest.mark.parametrize("how", ["G*2", "A*2", "swap A and G", "A/N instead of A"])
@pytest.mark.parametrize("layer", ["0", "2"])
def test_the_exact_comparison_detects_a_wrong_factor_scale_or_order(layer, how):
    model, loss_func, X, y = _build(EXACT["deep-linear-mse-N7"], "mean")
    K = curvature.kfac(model, loss_func, (X, y))
    ref = _masked_ggn(model, loss_func, (X, y))
    assert _matches(K.to_dense(), ref)
    assert not _matches(_perturb(K, layer, how).to_dense(), ref)


# -- the factors themselves ---------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_linear_factors_hold_1_over_N_in_A_and_the_loss_scale_in_G(reduction):
    N, C = 7, 2
    model = nn.Sequential(nn.Linear(3, C))
    X, y = torch.randn(N, 3), torch.randn(N, C)
    A, G = curvature.kfac(model, _mse(reduction), (X, y)).factors["0"]
    a = torch.cat([X, torch.ones(N, 1)], 1)
    torch.testing.assert_close(A, a.T @ a / N)
    # MSE Hessian per sample: 2 r I with r = 1/(N C) (mean) or 1 (sum), summed over samples
    expected_G = (2.0 / C if reduction == "mean" else 2.0 * N) * torch.eye(C)
    torch.testing.assert_close(G, expected_G)


@pytest.mark.parametrize("kfac_approx", ["expand", "reduce"])
def test_conv_input_factor_is_the_mean_outer_product_of_unfolded_patches(kfac_approx):
    N, S = 3, 25
    conv = nn.Conv2d(2, 4, 3, padding=1)
    model = MeanOverPositions(nn.Sequential(conv), (2, 3))
    X, y = torch.randn(N, 2, 5, 5), torch.randn(N, 4)
    A, _ = curvature.kfac(model, _mse("mean"), (X, y), kfac_approx=kfac_approx).factors["net.0"]
    patches = F.unfold(X, 3, padding=1).transpose(1, 2)  # [N, S, 2*9]
    a = torch.cat([patches, torch.ones(N, S, 1)], 2)
    if kfac_approx == "expand":
        expected = torch.einsum("nsi,nsj->ij", a, a) / (N * S)
    else:
        abar = a.mean(1)
        expected = abar.T @ abar / N
    torch.testing.assert_close(A, expected)


@pytest.mark.parametrize(
    "module, X, A_shape, G_shape",
    [
        (lambda: nn.Linear(3, 4), lambda: torch.randn(2, 3), (4, 4), (4, 4)),
        (lambda: nn.Linear(3, 5, bias=False), lambda: torch.randn(2, 3), (3, 3), (5, 5)),
        (lambda: nn.Linear(3, 2), lambda: torch.randn(2, 6, 3), (4, 4), (2, 2)),
        (lambda: nn.Conv2d(2, 5, 3), lambda: torch.randn(2, 2, 4, 4), (19, 19), (5, 5)),
        (
            lambda: nn.Conv2d(4, 6, 3, groups=2),
            lambda: torch.randn(2, 4, 4, 4),
            (2, 19, 19),
            (2, 3, 3),
        ),
        (lambda: nn.Conv1d(2, 3, 2, bias=False), lambda: torch.randn(2, 2, 5), (4, 4), (3, 3)),
        (lambda: nn.Embedding(6, 3), lambda: torch.randint(0, 6, (2, 4)), (6, 6), (3, 3)),
    ],
    ids=["linear", "linear-no-bias", "linear-sequence", "conv2d", "grouped-conv2d", "conv1d",
         "embedding"],
)  # fmt: skip
def test_factor_shapes(module, X, A_shape, G_shape):
    model = nn.Sequential(module(), nn.Flatten())
    X = X()
    y = torch.randn_like(model(X))
    A, G = curvature.kfac(model, _mse("sum"), (X, y)).factors["0"]
    assert A.shape == A_shape and G.shape == G_shape


def test_forward_only_has_identity_G_and_the_type2_A():
    model, loss_func, X, y = _build(EXACT["deep-linear-mse-N7"], "mean")
    K2 = curvature.kfac(model, loss_func, (X, y))
    K0 = curvature.kfac(model, loss_func, (X, y), fisher="forward-only")
    for name, (A, G) in K0.factors.items():
        torch.testing.assert_close(A, K2.factors[name][0])
        torch.testing.assert_close(G, torch.eye(G.shape[0]))


# -- stochastic Fisher types -------------------------------------------------------------
@pytest.mark.parametrize("fisher", ["mc", "rademacher"])
@pytest.mark.parametrize(
    "loss, y", [(_ce, lambda: torch.randint(0, 3, (4,))), (_mse, lambda: torch.randn(4, 3))],
    ids=["ce", "mse"],
)  # fmt: skip
def test_stochastic_kfac_with_many_samples_approaches_type2(loss, y, fisher):
    model, loss_func, X, y = _tanh_mlp(), loss("mean"), torch.randn(4, 3), y()
    exact = curvature.kfac(model, loss_func, (X, y)).to_dense()
    approx = curvature.kfac(model, loss_func, (X, y), fisher=fisher, mc_samples=3000, seed=1)
    assert ((approx.to_dense() - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("fisher", ["mc", "rademacher"])
def test_stochastic_kfac_is_reproducible_by_seed(fisher):
    model, loss_func, X, y = _tanh_mlp(), _ce("mean"), torch.randn(4, 3), torch.randint(0, 3, (4,))

    def K(seed):
        return curvature.kfac(model, loss_func, (X, y), fisher=fisher, seed=seed).to_dense()

    torch.testing.assert_close(K(5), K(5), rtol=0, atol=0)
    assert not torch.allclose(K(5), K(6))


# -- EKFAC vs KFAC -------------------------------------------------------------------------
class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, groups=2)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).mean((2, 3)))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        return self.fc(self.attn(h, h, h, need_weights=False)[0].mean(1))


GENERAL: Dict[str, Case] = {
    "tanh-mlp-ce": Case(
        _tanh_mlp, lambda: torch.randn(8, 3), lambda: torch.randint(0, 3, (8,)), _ce
    ),
    "tanh-mlp-bce": Case(_tanh_mlp, lambda: torch.randn(8, 3), lambda: torch.rand(8, 3), _bce),
    "cnn-ce-expand": Case(
        SmallCNN, lambda: torch.randn(4, 2, 4, 4), lambda: torch.randint(0, 3, (4,)), _ce
    ),
    "cnn-ce-reduce": Case(
        SmallCNN,
        lambda: torch.randn(4, 2, 4, 4),
        lambda: torch.randint(0, 3, (4,)),
        _ce,
        "reduce",
    ),
    "embedding-layernorm-ce": Case(
        EmbedNormLinear, lambda: torch.randint(0, 7, (4, 3)), lambda: torch.randint(0, 4, (4,)), _ce
    ),
    "attention-ce": Case(
        Attention, lambda: torch.randint(0, 5, (3, 4)), lambda: torch.randint(0, 3, (3,)), _ce
    ),
}


@pytest.mark.parametrize("name", list(GENERAL))
def test_ekfac_is_never_further_from_the_ggn_blocks_than_kfac(name):
    # EKFAC's eigenvalues diag(Q^T B Q) minimize ||B - Q diag(l) Q^T||_F in KFAC's basis Q
    case = GENERAL[name]
    model, loss_func, X, y = _build(case, "mean")
    K = curvature.kfac(model, loss_func, (X, y), kfac_approx=case.kfac_approx)
    E = curvature.ekfac(model, loss_func, (X, y), kfac_approx=case.kfac_approx)
    ref = curvature.ggn(model, loss_func, (X, y)) * _block_mask(K)
    err_K, err_E = (K.to_dense() - ref).norm().item(), (E.to_dense() - ref).norm().item()
    assert err_E <= err_K * (1 + 1e-10)


def test_ekfac_is_strictly_closer_than_kfac_on_a_tanh_mlp_with_several_data():
    model, loss_func, X, y = _build(GENERAL["tanh-mlp-ce"], "mean")
    ref = _masked_ggn(model, loss_func, (X, y))
    err_K = (curvature.kfac(model, loss_func, (X, y)).to_dense() - ref).norm()
    err_E = (curvature.ekfac(model, loss_func, (X, y)).to_dense() - ref).norm()
    assert err_K > 1e-3 * ref.norm()  # KFAC is not exact here
    assert err_E < 0.95 * err_K


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
@pytest.mark.parametrize("name", list(GENERAL))
def test_ekfac_trace_equals_the_trace_of_the_curvature(name, fisher):
    # tr(Q diag(diag(Q^T B Q)) Q^T) = tr(B) for every block
    case = GENERAL[name]
    model, loss_func, X, y = _build(case, "sum")
    E = curvature.ekfac(model, loss_func, (X, y), fisher=fisher, kfac_approx=case.kfac_approx)
    dense = curvature.ggn if fisher == "type-2" else curvature.empirical_fisher
    torch.testing.assert_close(E.trace(), dense(model, loss_func, (X, y)).trace())


def test_ekfac_trace_equals_the_ggn_trace_with_ignored_targets():
    # CrossEntropy(sum) over [N, C, S] with ignore_index: ignored positions add no curvature
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))

    class Logits(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x).transpose(1, 2)

    X, y = torch.randn(3, 5, 3), torch.randint(0, 3, (3, 5))
    y[0, 1] = y[2, 4] = -100
    loss_func = _ce("sum")
    E = curvature.ekfac(Logits(), loss_func, (X, y))
    G = curvature.ggn(Logits(), loss_func, (X, y))
    torch.testing.assert_close(E.trace(), G.trace())
    with pytest.raises(ValueError, match="ignore_index"):
        curvature.kfac(Logits(), _ce("mean"), (X, y))


# -- operations agree with to_dense() ------------------------------------------------------
OPS_CASES = ["tanh-mlp-ce", "cnn-ce-expand", "embedding-layernorm-ce", "attention-ce"]


@pytest.mark.parametrize("damping", [1e-3, 0.5])
@pytest.mark.parametrize("approx", [curvature.kfac, curvature.ekfac], ids=["kfac", "ekfac"])
@pytest.mark.parametrize("name", OPS_CASES)
def test_operations_equal_those_of_the_dense_matrix(name, approx, damping):
    case = GENERAL[name]
    model, loss_func, X, y = _build(case, "mean")
    K = approx(model, loss_func, (X, y), kfac_approx=case.kfac_approx)
    D = K.to_dense()
    torch.testing.assert_close(D, D.T, rtol=0, atol=1e-14)
    P = D.shape[0]
    v = [torch.randn_like(p) for p in _params(model)]
    vf = _flatten(v)
    Dd = D + damping * torch.eye(P)
    torch.testing.assert_close(_flatten(K.matvec(v)), D @ vf)
    torch.testing.assert_close(
        _flatten(K.inverse_matvec(v, damping)), torch.linalg.solve(Dd, vf), rtol=1e-9, atol=1e-9
    )
    torch.testing.assert_close(K.trace(), D.trace())
    torch.testing.assert_close(K.logdet(damping), torch.logdet(Dd))
    assert [t.shape for t in K.inverse_matvec(v, damping)] == [p.shape for p in v]


def _pi_inverse_reference(K: KFACApprox, model: nn.Sequential, v, damping):
    """``(G + sqrt(l)/pi I)^{-1} ⊗ (A + pi sqrt(l) I)^{-1}`` from the factors, per Linear."""
    out = []
    for name, module in model.named_children():
        if not isinstance(module, nn.Linear):
            continue
        A, G = K.factors[name]
        pi = math.sqrt((A.trace() / A.shape[0]) / (G.trace() / G.shape[0]))
        root = math.sqrt(damping)
        inv = torch.kron(
            torch.linalg.inv(G + root / pi * torch.eye(G.shape[0])),
            torch.linalg.inv(A + pi * root * torch.eye(A.shape[0])),
        )
        vW, vb = v[len(out)], v[len(out) + 1]
        res = (inv @ torch.cat([vW, vb[:, None]], 1).reshape(-1)).view(vW.shape[0], -1)
        out += [res[:, :-1], res[:, -1]]
    return out


@pytest.mark.parametrize("damping", [1e-3, 0.5])
def test_pi_damped_inverse_equals_the_kronecker_of_damped_factor_inverses(damping):
    model, loss_func, X, y = _build(GENERAL["tanh-mlp-ce"], "mean")
    K = curvature.kfac(model, loss_func, (X, y))
    v = [torch.randn_like(p) for p in _params(model)]
    torch.testing.assert_close(
        _flatten(K.inverse_matvec(v, damping, mode="pi")),
        _flatten(_pi_inverse_reference(K, model, v, damping)),
    )
    # pi damping is not exact damping
    assert not torch.allclose(
        _flatten(K.inverse_matvec(v, damping, mode="pi")), _flatten(K.inverse_matvec(v, damping))
    )


def test_ekfac_inverse_ignores_the_pi_mode():
    model, loss_func, X, y = _build(GENERAL["tanh-mlp-ce"], "mean")
    E = curvature.ekfac(model, loss_func, (X, y))
    v = [torch.randn_like(p) for p in _params(model)]
    torch.testing.assert_close(
        _flatten(E.inverse_matvec(v, 0.1, mode="pi")), _flatten(E.inverse_matvec(v, 0.1))
    )


@pytest.mark.parametrize("damping", [0.0, -1.0])
def test_non_positive_damping_is_refused(damping):
    model, loss_func, X, y = _build(GENERAL["tanh-mlp-ce"], "mean")
    K = curvature.kfac(model, loss_func, (X, y))
    v = [torch.randn_like(p) for p in _params(model)]
    with pytest.raises(ValueError, match="damping"):
        K.inverse_matvec(v, damping)
    with pytest.raises(ValueError, match="damping"):
        K.logdet(damping)


def test_bad_inverse_mode_and_vector_shapes_are_refused():
    model, loss_func, X, y = _build(GENERAL["tanh-mlp-ce"], "mean")
    K = curvature.kfac(model, loss_func, (X, y))
    v = [torch.randn_like(p) for p in _params(model)]
    with pytest.raises(ValueError, match="mode"):
        K.inverse_matvec(v, 0.1, mode="tikhonov")
    with pytest.raises(ValueError, match="shaped like"):
        K.matvec(v[:-1])


# -- several batches -------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize(
    "name, approx",
    [
        ("tanh-mlp-ce", curvature.kfac),
        ("cnn-ce-reduce", curvature.kfac),
        ("cnn-ce-expand", curvature.kfac),
        # EKFAC only where the factors have simple spectra: in a degenerate eigenspace
        # the basis (and so EKFAC) is not unique and rounding picks one
        ("tanh-mlp-ce", curvature.ekfac),
    ],
    ids=["kfac-mlp", "kfac-cnn-reduce", "kfac-cnn-expand", "ekfac-mlp"],
)
def test_list_of_batches_equals_their_union(name, approx, reduction):
    case = GENERAL[name]
    model, loss_func, X, y = _build(case, reduction)
    batches = [(X[:1], y[:1]), (X[1:], y[1:])]
    _assert_matches(
        approx(model, loss_func, batches, kfac_approx=case.kfac_approx).to_dense(),
        approx(model, loss_func, (X, y), kfac_approx=case.kfac_approx).to_dense(),
    )


# -- coverage and argument checks ---------------------------------------------------------
class Big(nn.Module):
    """A parameterized module without a rule, too large for an exact block."""

    def __init__(self, size=4097):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(size) / size)

    def forward(self, x):
        return x * (1 + self.scale[: x.shape[1]]) + self.scale[x.shape[1] :].sum()


def _big_model():
    return nn.Sequential(nn.Linear(3, 4), Big(), nn.Tanh(), nn.Linear(4, 2))


def test_uncovered_parameters_warn_and_get_zero_blocks():
    model, X, y = _big_model(), torch.randn(5, 3), torch.randint(0, 2, (5,))
    loss_func = _ce("mean")
    with pytest.warns(UserWarning, match="'1'"):
        K = curvature.kfac(model, loss_func, (X, y))
    assert K.uncovered == ["1.scale"]
    v = [torch.randn_like(p) for p in _params(model)]
    assert K.matvec(v)[2].abs().max() == 0
    torch.testing.assert_close(K.inverse_matvec(v, 0.3)[2], v[2] / 0.3)
    # the covered layers are those of the model with the big parameter frozen
    model[1].scale.requires_grad_(False)
    ref = curvature.kfac(model, loss_func, (X, y))
    torch.testing.assert_close(K.trace(), ref.trace())
    torch.testing.assert_close(K.logdet(0.3), ref.logdet(0.3) + 4097 * math.log(0.3))
    kept = [0, 1, 3, 4]
    for i, r in zip(kept, ref.matvec([v[i] for i in kept])):
        torch.testing.assert_close(K.matvec(v)[i], r)


def test_uncovered_parameters_are_refused_on_request():
    model, X, y = _big_model(), torch.randn(5, 3), torch.randint(0, 2, (5,))
    with pytest.raises(ValueError, match="'1'"):
        curvature.kfac(model, _ce("mean"), (X, y), unsupported="error")


def test_small_modules_without_a_rule_get_their_exact_block():
    model = nn.Sequential(nn.Linear(3, 4), Big(size=7), nn.Tanh(), nn.Linear(4, 2))
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    E = curvature.ekfac(model, _ce("sum"), (X, y), unsupported="error")
    G = curvature.ggn(model, _ce("sum"), (X, y))
    ix = slice(16, 23)  # Big's 7 parameters
    _assert_matches(E.to_dense()[ix, ix], G[ix, ix])
    _assert_matches(curvature.kfac(model, _ce("sum"), (X, y)).to_dense()[ix, ix], G[ix, ix])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"kfac_approx": "mean"}, "kfac_approx"),
        ({"fisher": "type2"}, "fisher"),
        ({"fisher": "mc", "mc_samples": 0}, "mc_samples"),
        ({"fisher": "mc", "mc_samples": 1.5}, "mc_samples"),
        ({"on_unsupported": "ignore"}, "on_unsupported"),
        ({"unsupported": "ignore"}, "unsupported"),
    ],
    ids=str,
)
@pytest.mark.parametrize("approx", [curvature.kfac, curvature.ekfac], ids=["kfac", "ekfac"])
def test_bad_arguments_are_refused(approx, kwargs, match):
    model, X, y = _tanh_mlp(), torch.randn(2, 3), torch.randint(0, 3, (2,))
    with pytest.raises(ValueError, match=match):
        approx(model, _ce("mean"), (X, y), **kwargs)


def test_unsupported_loss_is_refused():
    model, X = _tanh_mlp(), torch.randn(2, 3)
    with pytest.raises(ValueError, match="CrossEntropyLoss"):
        curvature.kfac(model, nn.L1Loss(), (X, torch.randn(2, 3)))


def test_ekfac_forward_only_is_refused():
    model, X, y = _tanh_mlp(), torch.randn(2, 3), torch.randint(0, 3, (2,))
    with pytest.raises(ValueError, match="forward-only"):
        curvature.ekfac(model, _ce("mean"), (X, y), fisher="forward-only")


def test_mc_on_weighted_bce_is_refused():
    model, X, y = _tanh_mlp(), torch.randn(2, 3), torch.rand(2, 3)
    loss_func = nn.BCEWithLogitsLoss(pos_weight=torch.ones(3))
    with pytest.raises(ValueError, match="mc"):
        curvature.kfac(model, loss_func, (X, y), fisher="mc")
