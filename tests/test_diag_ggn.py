"""``diag_ggn`` (SPEC section 3) equals the diagonal of the dense matrices, per parameter.

``diag_ggn(model, loss_func, data, fisher)`` returns name to a tensor of the parameter's
shape; for ``"type-2"`` it is the diagonal of :func:`curvature.ggn`, for ``"empirical"``
that of :func:`curvature.empirical_fisher`, computed without forming either matrix.
"""

from __future__ import annotations

import importlib
from typing import Callable, Dict, NamedTuple

import pytest
import torch
from torch import Tensor, nn

import curvature

pytestmark = pytest.mark.usefixtures("float64_seeded")


class EmbedNormConvLinear(nn.Module):
    """Tokens ``[N, S]`` -> Embedding -> LayerNorm -> Conv1d -> Linear -> logits ``[N, C, S]``."""

    def __init__(self, vocab=6, dim=3, hidden=4, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.norm = nn.LayerNorm(dim)
        self.conv = nn.Conv1d(dim, hidden, 3, padding=1)
        self.fc = nn.Linear(hidden, classes)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens)).transpose(1, 2)  # [N, dim, S]
        h = torch.tanh(self.conv(h)).transpose(1, 2)  # [N, S, hidden]
        return self.fc(h).transpose(1, 2)  # [N, C, S]


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 4)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(4, 3)

    def forward(self, tokens):
        h = self.emb(tokens)
        return self.fc(self.attn(h, h, h, need_weights=False)[0]).transpose(1, 2)


def _mlp():
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, groups=2),
        nn.Tanh(),
        nn.Conv2d(4, 2, 3, stride=2, padding=1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def _sequence_mlp():
    # Linear layers on [N, S, D] (weight sharing) and CE over [N, C, S]
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3), _Transpose())


class _Transpose(nn.Module):
    def forward(self, x):
        return x.transpose(1, 2)


class Problem(NamedTuple):
    model: Callable[[], nn.Module]
    X: Callable[[], Tensor]
    y: Callable[[], Tensor]
    loss: Callable[[str], nn.Module]


N = 4
PROBLEMS: Dict[str, Problem] = {
    "mlp-ce": Problem(
        _mlp, lambda: torch.randn(N, 3), lambda: torch.randint(0, 3, (N,)), nn.CrossEntropyLoss
    ),
    "mlp-mse": Problem(_mlp, lambda: torch.randn(N, 3), lambda: torch.randn(N, 3), nn.MSELoss),
    "mlp-bce": Problem(
        _mlp, lambda: torch.randn(N, 3), lambda: torch.rand(N, 3), nn.BCEWithLogitsLoss
    ),
    "cnn-padding-groups-ce": Problem(
        _cnn,
        lambda: torch.randn(N, 2, 4, 4),
        lambda: torch.randint(0, 3, (N,)),
        nn.CrossEntropyLoss,
    ),
    "sequence-mlp-ce-NCS": Problem(
        _sequence_mlp,
        lambda: torch.randn(N, 5, 3),
        lambda: torch.randint(0, 3, (N, 5)),
        nn.CrossEntropyLoss,
    ),
    "embedding-layernorm-conv1d-linear-ce-NCS": Problem(
        EmbedNormConvLinear,
        lambda: torch.randint(0, 6, (N, 5)),
        lambda: torch.randint(0, 3, (N, 5)),
        nn.CrossEntropyLoss,
    ),
    "attention-ce-NCS": Problem(
        Attention,
        lambda: torch.randint(0, 5, (N, 3)),
        lambda: torch.randint(0, 3, (N, 3)),
        nn.CrossEntropyLoss,
    ),
}
REDUCTIONS = ["mean", "sum"]


def _build(name, reduction):
    p = PROBLEMS[name]
    return p.model(), p.loss(reduction=reduction), p.X(), p.y()


def _split(model: nn.Module, diagonal: Tensor) -> Dict[str, Tensor]:
    out, i = {}, 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            out[n] = diagonal[i : i + p.numel()].view_as(p)
            i += p.numel()
    return out


def _assert_same(actual: Dict[str, Tensor], expected: Dict[str, Tensor]):
    assert list(actual) == list(expected)
    scale = max(t.abs().max() for t in expected.values())
    for n in expected:
        assert actual[n].shape == expected[n].shape, n
        torch.testing.assert_close(actual[n], expected[n], rtol=0, atol=1e-10 * scale, msg=n)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_type2_diagonal_equals_the_ggn_diagonal(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    expected = _split(model, curvature.ggn(model, loss_func, (X, y)).diagonal())
    _assert_same(curvature.diag_ggn(model, loss_func, (X, y)), expected)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_empirical_diagonal_equals_the_empirical_fisher_diagonal(name, reduction):
    model, loss_func, X, y = _build(name, reduction)
    expected = _split(model, curvature.empirical_fisher(model, loss_func, (X, y)).diagonal())
    _assert_same(curvature.diag_ggn(model, loss_func, (X, y), fisher="empirical"), expected)


@pytest.mark.parametrize("name", ["mlp-ce", "mlp-mse", "cnn-padding-groups-ce"])
def test_mc_diagonal_equals_the_mc_fisher_diagonal_with_the_same_seed(name):
    # both draw the labels in the order of curvature.losses.backprop_sources
    model, loss_func, X, y = _build(name, "mean")
    F = curvature.fisher(model, loss_func, (X, y), mc_samples=3, seed=7)
    got = curvature.diag_ggn(model, loss_func, (X, y), fisher="mc", mc_samples=3, seed=7)
    _assert_same(got, _split(model, F.diagonal()))


@pytest.mark.parametrize("fisher", ["mc", "rademacher"])
def test_stochastic_diagonal_with_many_samples_approaches_the_ggn_diagonal(fisher):
    model, loss_func, X, y = _build("mlp-ce", "mean")
    exact = curvature.ggn(model, loss_func, (X, y)).diagonal()
    got = curvature.diag_ggn(model, loss_func, (X, y), fisher=fisher, mc_samples=3000, seed=1)
    got = torch.cat([t.reshape(-1) for t in got.values()])
    assert ((got - exact).norm() / exact.norm()).item() < 0.05


def test_frozen_parameters_are_left_out():
    model, loss_func, X, y = _build("cnn-padding-groups-ce", "sum")
    model[0].bias.requires_grad_(False)
    model[2].weight.requires_grad_(False)
    expected = _split(model, curvature.ggn(model, loss_func, (X, y)).diagonal())
    got = curvature.diag_ggn(model, loss_func, (X, y))
    assert "0.bias" not in got and "2.weight" not in got
    _assert_same(got, expected)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_list_of_batches_equals_their_union(reduction):
    model, loss_func, X, y = _build("embedding-layernorm-conv1d-linear-ce-NCS", reduction)
    batches = [(X[:1], y[:1]), (X[1:], y[1:])]
    _assert_same(
        curvature.diag_ggn(model, loss_func, batches), curvature.diag_ggn(model, loss_func, (X, y))
    )


def test_forward_only_is_refused():
    model, loss_func, X, y = _build("mlp-ce", "mean")
    with pytest.raises(ValueError, match="forward-only"):
        curvature.diag_ggn(model, loss_func, (X, y), fisher="forward-only")


def test_unknown_fisher_is_refused():
    model, loss_func, X, y = _build("mlp-ce", "mean")
    with pytest.raises(ValueError, match="type-2"):
        curvature.diag_ggn(model, loss_func, (X, y), fisher="exact")


def test_unsupported_loss_is_refused():
    model, _, X, y = _build("mlp-mse", "mean")
    with pytest.raises(ValueError, match="CrossEntropyLoss"):
        curvature.diag_ggn(model, nn.SmoothL1Loss(), (X, y))


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_ignored_targets_add_nothing_with_sum_and_are_refused_with_mean(fisher):
    model, loss_func, X, y = _build("sequence-mlp-ce-NCS", "sum")
    y[0, 1] = y[3, 4] = -100
    dense = curvature.ggn if fisher == "type-2" else curvature.empirical_fisher
    expected = _split(model, dense(model, loss_func, (X, y)).diagonal())
    _assert_same(curvature.diag_ggn(model, loss_func, (X, y), fisher=fisher), expected)
    with pytest.raises(ValueError, match="ignore_index"):
        curvature.diag_ggn(model, nn.CrossEntropyLoss(), (X, y), fisher=fisher)


# -- per-position losses: the type-2 vectors in chunks ---------------------------------------------
class _Chain(nn.Sequential):
    """Not trusted to keep positions apart (curvature.positionwise): the C T vectors."""


@pytest.mark.parametrize("loss", ["mse", "mse-chain", "ce-sum", "ce-mean", "bce", "bce-chain"])
def test_type2_diagonal_of_per_token_losses_pulls_chunks_of_vectors(loss, monkeypatch):
    # [N, T, C] outputs with a per-token loss have T C type-2 vectors of N T C entries
    # each; they are pulled a chunk at a time (a sum of squares over the vectors), with
    # the same result as the whole set and as the dense GGN. The plain nn.Sequential's
    # positions are folded into the samples (C vectors of N T C entries, also chunked)
    N, T, C = 3, 5, 4
    if loss.startswith("ce"):  # EmbedNormConvLinear mixes the positions (a Conv1d)
        model, X = EmbedNormConvLinear(classes=C), torch.randint(0, 6, (N, T))
        y = torch.randint(0, C, (N, T))
        loss_func = nn.CrossEntropyLoss(reduction=loss[3:])
    else:
        chain = _Chain if loss.endswith("chain") else nn.Sequential
        model = chain(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, C)).double()
        X, y = torch.randn(N, T, 6), torch.rand(N, T, C)
        loss_func = nn.MSELoss() if loss.startswith("mse") else nn.BCEWithLogitsLoss()
    model = model.double()
    whole = curvature.diag_ggn(model, loss_func, (X, y))
    module = importlib.import_module("curvature.fisher_passes")  # where the chunks are cut
    monkeypatch.setattr(module, "MAX_SOURCES_NUMEL", 2 * N * T * C)
    chunked = curvature.diag_ggn(model, loss_func, (X, y))
    dense = _split(model, curvature.ggn(model, loss_func, (X, y)).diagonal())
    for name in whole:
        torch.testing.assert_close(chunked[name], whole[name], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(chunked[name], dense[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss", ["mse", "ce"])
def test_hessian_sqrt_chunks_are_the_columns_of_hessian_sqrt(loss):
    out = torch.randn(3, 4, 5, dtype=torch.float64)  # CE: [N, C, T]; MSE: [N, T, C]
    loss_func = nn.CrossEntropyLoss() if loss == "ce" else nn.MSELoss()
    y = torch.randint(0, 4, (3, 5)) if loss == "ce" else torch.randn(3, 4, 5)
    S = curvature.losses.hessian_sqrt(loss_func, out, y)
    chunks = list(curvature.losses.hessian_sqrt_chunks(loss_func, out, y, 3 * out.numel()))
    assert all(c.numel() <= 4 * out.numel() for c in chunks) and len(chunks) > 1
    got = torch.cat(chunks)
    assert got.shape == S.shape
    # the same columns (CrossEntropy's grouped by position): the same S S^T
    flat, ref = got.reshape(got.shape[0], -1), S.reshape(S.shape[0], -1)
    torch.testing.assert_close(flat.T @ flat, ref.T @ ref, rtol=1e-13, atol=1e-15)
