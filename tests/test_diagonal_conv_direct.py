"""A convolution's Fisher diagonal from per-sample weight gradients in one kernel call
(``ConvRule.direct_diagonal``, ``curvature.layer_diagonal.direct_diagonal``).

``DiagonalNaturalGradient`` takes the diagonal of a convolution from the per-sample weight
gradients of a convolution with ``N * groups`` groups (no unfolded patches). Twins: the
per-sample gradients of ``torch.func`` (``vmap`` of ``grad`` of each sample's loss),
squared and summed, through the optimizer's first step ``-lr g / (d + lambda)``, for
Conv1d/2d/3d with groups, stride, padding (numbers, ``"same"``, circular), dilation, no
bias, a frozen weight, one module called twice, and chunks of samples (ragged, one
sample); and the unfolded path (``DIRECT_DIAGONAL = False``) for the Fishers with several
pulled vectors (type-2, mc with 3 samples). Every test runs on both ways of making the
per-sample weight gradients: one grouped convolution backward (the CPU's for many output
positions per input channel) and batched
GEMMs over unfolded patches (``PATCH_GEMM_DEVICES``, a GPU's), the latter with the whole
batch and with one sample per chunk of patches.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import force_patch_gemms
from torch import nn
from torch.func import functional_call, grad, vmap

import curvature
import curvature.layer_diagonal as layer_diagonal

pytestmark = pytest.mark.usefixtures("float64_seeded")

N = 5


@pytest.fixture(autouse=True, params=["grouped", "patches", "patches-one-sample"])
def weight_grads_path(request, monkeypatch):
    """The per-sample weight gradients by a grouped convolution, or by patch GEMMs (taken
    here on the CPU; the whole batch in one chunk of patches, or one sample per chunk)."""
    import curvature.layers.conv as conv

    if request.param == "grouped":
        monkeypatch.setattr(conv, "PATCH_GEMM_POSITIONS", 0)
    else:
        seen = force_patch_gemms(monkeypatch, request.param == "patches-one-sample")
        yield request.param
        assert seen or request.node.callspec.params.get("kind") == "frozen-weight"
        return
    yield request.param


class Net(nn.Module):
    """A convolution (or a stack of them) of ``dim`` spatial axes, then a Linear head."""

    def __init__(self, dim: int, kind: str):
        super().__init__()
        torch.manual_seed(0)
        Conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.dim, self.kind = dim, kind
        if kind == "groups-stride-dilation":
            self.c = Conv(4, 6, 3, stride=2, padding=2, dilation=2, groups=2)
        elif kind == "same-circular-no-bias":
            self.c = Conv(2, 3, 2, padding="same", padding_mode="circular", bias=False)
        elif kind == "twice":
            self.c = Conv(4, 4, 3, padding=1, groups=4)
        else:  # "frozen-weight": the bias alone
            self.c = Conv(4, 3, 3, padding=1)
            self.c.weight.requires_grad_(False)
        self.fc = nn.LazyLinear(3)

    def forward(self, x):
        h = torch.tanh(self.c(x))
        if self.kind == "twice":
            h = torch.tanh(self.c(h))
        return self.fc(h.flatten(1))


def data(dim: int, channels: int):
    g = torch.Generator().manual_seed(1)
    shape = {1: (9,), 2: (6, 5), 3: (5, 4, 3)}[dim]
    return torch.randn(N, channels, *shape, generator=g), torch.randint(0, 3, (N,), generator=g)


def model_and_data(dim: int, kind: str):
    model = Net(dim, kind)
    X, y = data(dim, 2 if kind == "same-circular-no-bias" else 4)
    model(X)  # the lazy head
    return model, X, y


def brute_force(model, X, y):
    """``sum_n grad_n^2`` per trainable parameter."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    frozen = {k: v.detach() for k, v in model.named_parameters() if not v.requires_grad}

    def loss(p, x, t):
        out = functional_call(model, {**p, **frozen}, (x[None],))
        return nn.functional.cross_entropy(out, t[None], reduction="sum")

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)
    return {k: g.pow(2).sum(0) for k, g in per_sample.items()}


def calls_seen(monkeypatch):
    """The samples of every kernel call of the direct path."""
    import curvature.layers.conv as conv

    seen = []
    inner = conv.folded_weight_grads

    def spy(module, x, g, K):
        seen.append(x.shape[0])
        return inner(module, x, g, K)

    monkeypatch.setattr(conv, "folded_weight_grads", spy)
    return seen


KINDS = ["groups-stride-dilation", "same-circular-no-bias", "twice", "frozen-weight"]
# bounds in elements (DIAGONAL_CHUNK_SHARE = 0): one sample per chunk, ragged, whole batch
BOUNDS = {"one-sample": 1, "ragged": 0, "whole": 2**30}


@pytest.mark.parametrize("bound", BOUNDS, ids=BOUNDS.keys())
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_first_step_divides_by_the_per_sample_gradients_squared(dim, kind, bound, monkeypatch):
    model, X, y = model_and_data(dim, kind)
    loss = nn.CrossEntropyLoss(reduction="sum")
    d = brute_force(model, X, y)
    per_sample = model.c.weight.numel() * (2 if kind == "twice" else 1)
    elements = {"one-sample": 1, "ragged": 2 * per_sample, "whole": 2**30}[bound]
    monkeypatch.setattr(layer_diagonal, "DIAGONAL_CHUNK_SHARE", 0.0)
    monkeypatch.setattr(layer_diagonal, "DIAGONAL_CHUNK_ELEMENTS", elements)
    seen = calls_seen(monkeypatch)
    lr, damping = 0.1, 1e-2
    opt = curvature.DiagonalNaturalGradient(model, lr=lr, damping=damping, loss_func=loss)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss(model(X), y).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    opt.step()
    for k, p in model.named_parameters():
        if k not in grads:
            continue
        expected = before[k] - lr * grads[k] / (d[k] + damping)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-12, msg=k)
    if kind == "frozen-weight":  # the bias alone: no per-sample weight gradients
        assert seen == []
        return
    calls = 2 if kind == "twice" else 1
    chunks = {"one-sample": [1] * N, "ragged": [2, 2, 1], "whole": [N]}[bound]
    assert seen == [n for n in chunks for _ in range(calls)]


@pytest.mark.parametrize("fisher", ["type-2", "mc"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dim", [1, 2, 3])
def test_several_pulled_vectors_equal_the_unfolded_path(dim, kind, fisher, monkeypatch):
    model, X, y = model_and_data(dim, kind)
    loss = nn.CrossEntropyLoss()
    monkeypatch.setattr(layer_diagonal, "DIAGONAL_CHUNK_SHARE", 0.0)
    monkeypatch.setattr(layer_diagonal, "DIAGONAL_CHUNK_ELEMENTS", 2 * model.c.weight.numel())
    got = {}
    for direct in (True, False):
        monkeypatch.setattr(layer_diagonal, "DIRECT_DIAGONAL", direct)
        m = copy.deepcopy(model)
        opt = curvature.DiagonalNaturalGradient(m, fisher=fisher, mc_samples=3, loss_func=loss)
        loss(m(X), y).backward()
        opt.step()
        got[direct] = opt.diagonal_
    assert list(got[True]) == list(got[False])
    for k in got[False]:
        torch.testing.assert_close(got[True][k], got[False][k], rtol=1e-10, atol=1e-14, msg=k)
