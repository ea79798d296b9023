"""``diag_ggn(fisher="type-2")`` on per-position losses of position-wise models: ``C`` vectors.

A model whose structure shows that positions never mix (:mod:`curvature.positionwise`)
gets its positions folded into the samples: ``C`` type-2 vectors instead of ``C T``, the
same diagonal. Each case is checked against the dense GGN diagonal and against the exact
``C T`` path, reached through ``Chain``: an ``nn.Sequential`` subclass with the same
parameters and forward, which the structural check does not trust. Models that mix
positions keep the ``C T`` path and equal the dense diagonal.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import curvature
from curvature.positionwise import fold_positions, model_layout

pytestmark = pytest.mark.usefixtures("float64_seeded")

N, T, D, H, C = 3, 5, 4, 6, 3


class Chain(nn.Sequential):
    """``nn.Sequential`` by another name: not trusted to keep positions apart."""


def _dense(model: nn.Module, loss_func: nn.Module, data, matrix=curvature.ggn):
    """``matrix``'s diagonal, name to a tensor of the parameter's shape."""
    diagonal = matrix(model, loss_func, data).diagonal()
    out: Dict[str, Tensor] = {}
    i = 0
    for n, p in model.named_parameters():
        out[n] = diagonal[i : i + p.numel()].view_as(p)
        i += p.numel()
    return out


def _assert_same(actual: Dict[str, Tensor], expected: Dict[str, Tensor]) -> None:
    assert list(actual) == list(expected)
    scale = max(t.abs().max() for t in expected.values())
    for n in expected:
        torch.testing.assert_close(actual[n], expected[n], rtol=0, atol=1e-12 * scale, msg=n)


def _token_mlp() -> nn.Sequential:
    # features last: [N, T, D] -> [N, T, C]
    return nn.Sequential(
        nn.Linear(D, H),
        nn.LayerNorm(H),
        nn.GELU(),
        nn.Sequential(nn.Dropout(0.0), nn.Linear(H, H), nn.Tanh()),
        nn.Linear(H, C),
    )


def _pointwise_convs() -> nn.Sequential:
    # channels first: [N, D, T] -> [N, C, T], the token MLP of a per-token CrossEntropy
    return nn.Sequential(nn.Conv1d(D, H, 1), nn.SiLU(), nn.Conv1d(H, C, 1, bias=False))


def _check(model, loss_func, data, folded=True):
    """The diagonal equals the dense one and (if ``folded``) the exact ``C T`` path's."""
    batches = data if isinstance(data, list) else [data]
    assert fold_positions(model, loss_func, batches)[1] is folded
    got = curvature.diag_ggn(model, loss_func, data)
    _assert_same(got, _dense(model, loss_func, data))
    if folded:
        _assert_same(got, curvature.diag_ggn(Chain(*model), loss_func, data))


@pytest.mark.parametrize("loss", ["mse-mean", "mse-sum", "bce-mean", "bce-pos-weight-sum"])
def test_token_mlp_diagonal_with_c_vectors_equals_the_dense_and_the_ct_diagonal(loss):
    model = _token_mlp()
    X, y = torch.randn(N, T, D), torch.rand(N, T, C)
    reduction = loss.split("-")[-1]
    if loss.startswith("mse"):
        loss_func = nn.MSELoss(reduction=reduction)
    else:
        pos_weight = torch.rand(C) + 0.5 if "pos-weight" in loss else None
        loss_func = nn.BCEWithLogitsLoss(reduction=reduction, pos_weight=pos_weight)
    assert model_layout(model) == "last"
    _check(model, loss_func, (X, y))


@pytest.mark.parametrize(
    "targets", ["classes-mean", "classes-sum", "smoothing-mean", "probabilities-mean", "ignored"]
)
def test_per_token_cross_entropy_with_c_vectors_equals_the_dense_and_the_ct_diagonal(targets):
    model = _pointwise_convs()
    X = torch.randn(N, D, T)
    y = torch.randint(0, C, (N, T))
    kwargs = {"reduction": "sum" if targets in ("classes-sum", "ignored") else "mean"}
    if targets == "smoothing-mean":
        kwargs["label_smoothing"] = 0.1
    if targets == "probabilities-mean":
        y = torch.rand(N, C, T).softmax(1)
    if targets == "ignored":
        y[0, 1] = y[2, 4] = -100
    assert model_layout(model) == "conv1"
    _check(model, nn.CrossEntropyLoss(**kwargs), (X, y))


def test_two_position_axes_of_pointwise_conv2d_fold():
    model = nn.Sequential(nn.Conv2d(D, H, 1), nn.ReLU(), nn.Conv2d(H, C, (1, 1)))
    X, y = torch.randn(N, D, 3, 2), torch.randint(0, C, (N, 3, 2))
    assert model_layout(model) == "conv2"
    _check(model, nn.CrossEntropyLoss(), (X, y))


def test_batches_fold_with_the_same_weights_as_their_union():
    model = _token_mlp()
    same = [(torch.randn(n, T, D), torch.randn(n, T, C)) for n in (2, 3)]
    _check(model, nn.MSELoss(), same)
    # a mean over batches with different positions per sample weighs batches by N, which
    # folded batches would not: the exact path
    other = [
        (torch.randn(2, T, D), torch.randn(2, T, C)),
        (torch.randn(3, 2, D), torch.randn(3, 2, C)),
    ]
    _check(model, nn.MSELoss(), other, folded=False)
    _check(model, nn.MSELoss(reduction="sum"), other)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Observer(nn.Linear):
    """An ``nn.Linear`` subclass: its forward could be anything."""


MIXING = {
    "self-attention": lambda: nn.Sequential(SelfAttention(), nn.Linear(D, C)),
    "conv1d-kernel-3": lambda: nn.Sequential(nn.Conv1d(D, H, 3, padding=1), nn.Conv1d(H, C, 1)),
    "conv1d-stride-2": lambda: nn.Sequential(nn.Conv1d(D, C, 1, stride=2)),
    "conv1d-padding": lambda: nn.Sequential(nn.Conv1d(D, C, 1, padding=1)),
    "layernorm-over-positions": lambda: nn.Sequential(nn.Linear(D, C), nn.LayerNorm([T, C])),
    "gru": lambda: nn.Sequential(nn.GRU(D, C, batch_first=True)),
    "softmax": lambda: nn.Sequential(nn.Linear(D, C), nn.Softmax(1)),
    "batchnorm": lambda: nn.Sequential(nn.Conv1d(D, C, 1), nn.BatchNorm1d(C).eval()),
    "flatten": lambda: nn.Sequential(nn.Linear(D, C), nn.Flatten(1), nn.Unflatten(1, (T, C))),
    "linear-subclass": lambda: nn.Sequential(Observer(D, C)),
    "sequential-subclass": lambda: Chain(nn.Linear(D, C)),
    "convs-and-linears": lambda: nn.Sequential(nn.Conv1d(D, T, 1), nn.Linear(T, T)),
}


@pytest.mark.parametrize("name", list(MIXING))
def test_models_that_may_mix_positions_are_not_position_wise(name):
    assert model_layout(MIXING[name]()) is None


def test_hooks_and_instance_forwards_make_a_model_not_position_wise():
    model = _token_mlp()
    handle = model[2].register_forward_hook(lambda m, a, out: out.roll(1, dims=1))
    assert model_layout(model) is None
    handle.remove()
    handle = model[0].register_full_backward_hook(lambda m, gi, go: None)
    assert model_layout(model) is None
    handle.remove()
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    assert model_layout(model) is None
    handle.remove()
    model[2].forward = lambda x: x.flip(1)
    assert model_layout(model) is None
    del model[2].forward
    assert model_layout(model) == "last"


@pytest.mark.parametrize("name", ["self-attention", "conv1d-kernel-3"])
def test_position_mixing_models_keep_the_ct_path_and_equal_the_dense_diagonal(name):
    model = MIXING[name]()
    if name == "self-attention":
        X, y, loss_func = torch.randn(N, T, D), torch.randn(N, T, C), nn.MSELoss()
    else:
        X, y, loss_func = torch.randn(N, D, T), torch.randint(0, C, (N, T)), nn.CrossEntropyLoss()
    _check(model, loss_func, (X, y), folded=False)


def test_a_position_mixing_forward_hook_keeps_the_exact_path():
    # the hook makes the model mix positions: the folded batch would be wrong here
    model = _token_mlp()
    model[2].register_forward_hook(lambda m, a, out: out + out.roll(1, dims=1))
    X, y = torch.randn(N, T, D), torch.randn(N, T, C)
    _check(model, nn.MSELoss(), (X, y), folded=False)


def test_other_fisher_types_are_not_folded():
    # the empirical Fisher's per-sample gradients are per sequence: folding would change it
    model = _token_mlp()
    X, y = torch.randn(N, T, D), torch.randn(N, T, C)
    got = curvature.diag_ggn(model, nn.MSELoss(), (X, y), fisher="empirical")
    _assert_same(got, _dense(model, nn.MSELoss(), (X, y), curvature.empirical_fisher))


class Largest(TorchDispatchMode):
    """The largest tensor any aten call returns (the vectors, batched, are among them)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_the_token_mlp_pulls_c_vectors_not_c_t():
    # [C, N T, width] is the largest batched tensor with C vectors; the C T path has
    # [C T, N, T, C] vectors, T = 16 times more
    n, t, width, c = 2, 16, 8, 8
    model = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, c))
    X, y = torch.randn(n, t, 4), torch.randn(n, t, c)
    with Largest() as folded:
        curvature.diag_ggn(model, nn.MSELoss(), (X, y))
    with Largest() as exact:
        curvature.diag_ggn(Chain(*model), nn.MSELoss(), (X, y))
    assert folded.numel <= c * n * t * width < c * t * n * t * c <= exact.numel


def test_losses_whose_positions_are_not_the_models_keep_the_exact_path():
    model = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, C))  # [N, T, D] -> [N, T, C]
    X = torch.randn(N, T, D)
    # CrossEntropy on [N, T, C] takes T as the classes and the model's features as positions
    _check(model, nn.CrossEntropyLoss(), (X, torch.randint(0, T, (N, C))), folded=False)
    # a BCE weight over the positions and features does not broadcast the same way folded
    weighted = nn.BCEWithLogitsLoss(weight=torch.rand(T, C))
    _check(model, weighted, (X, torch.rand(N, T, C)), folded=False)
    # a pointwise convolution with a per-channel BCE weight (broadcast over the last axis)
    convs = _pointwise_convs()
    Xc, yc = torch.randn(N, D, T), torch.rand(N, C, T)
    _check(convs, nn.BCEWithLogitsLoss(weight=torch.rand(T)), (Xc, yc), folded=False)
