"""The rules' ``kfac_shapes`` against the shapes of their ``kfac_index``, brute force.

``kfac()`` learns its factor sizes (which blocks exceed ``max_factor_size``) from
``kfac_shapes`` without building any index; these must be the index's shapes
``[C, D_out, D]`` for every layer, and the index itself must put entry ``(c, o, i)`` of
the layer's matrix ``[W | b]`` where the row-major layout of the parameters has it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from curvature.layer_stats import block_index
from curvature.layers import LinearFamilyRule
from curvature.layers.registry import registered_rule
from curvature.layout import ParamLayout


def _frozen(module: nn.Module, *names: str) -> nn.Module:
    for n in names:
        getattr(module, n).requires_grad_(False)
    return module


def _modules():
    torch.manual_seed(0)
    return {
        "linear": nn.Linear(5, 3),
        "linear_no_bias": nn.Linear(5, 3, bias=False),
        "linear_frozen_weight": _frozen(nn.Linear(5, 3), "weight"),
        "linear_frozen_bias": _frozen(nn.Linear(5, 3), "bias"),
        "conv1d_groups": nn.Conv1d(4, 6, 3, groups=2),
        "conv2d": nn.Conv2d(3, 4, (2, 3)),
        "conv2d_groups_no_bias": nn.Conv2d(6, 9, 2, groups=3, bias=False),
        "conv3d_depthwise": nn.Conv3d(4, 4, 2, groups=4),
        "embedding": nn.Embedding(7, 3),
        "layernorm": nn.LayerNorm(4),
        "batchnorm_eval": nn.BatchNorm1d(4).eval(),
        "rnn": nn.RNN(3, 4),
        "mha_packed": nn.MultiheadAttention(6, 2),
        "mha_no_bias": nn.MultiheadAttention(6, 3, bias=False),
        "mha_kdim": nn.MultiheadAttention(6, 2, kdim=4, vdim=5),
        "mha_frozen_in_proj": _frozen(nn.MultiheadAttention(6, 2), "in_proj_weight"),
        "mha_frozen_out_bias": _frozen(nn.MultiheadAttention(6, 2), "in_proj_bias"),
        "mha_bias_kv": nn.MultiheadAttention(6, 2, add_bias_kv=True),
    }


def _matrix_positions(module: nn.Module, layout: ParamLayout, prefix: str, W: str, b: str, C):
    """``[C, D_out, D]`` positions of ``[W | b]`` entry by entry (rows split into groups)."""
    params = dict(module.named_parameters())
    weight, bias = params.get(W), params.get(b)
    ref = weight if weight is not None else bias
    out = ref.shape[0]
    rows = []
    for o in range(out):
        row = []
        if weight is not None:
            cols = weight[o].numel()
            row += [layout.offsets[prefix + W] + o * cols + i for i in range(cols)]
        if bias is not None:
            row.append(layout.offsets[prefix + b] + o)
        rows.append(row)
    return torch.tensor(rows).view(C, out // C, -1)


@pytest.mark.parametrize("case", list(_modules()))
def test_kfac_shapes_equal_the_index_shapes(case):
    module = _modules()[case]
    model = nn.Sequential(nn.Linear(2, 2), module)  # offsets not starting at 0
    layout = ParamLayout.of(model)
    rule = registered_rule(module)
    shapes = rule.kfac_shapes(module)
    index = rule.kfac_index(module, layout.local_offsets("1"))
    if index is None:
        assert shapes is None
        return
    assert shapes == {s: tuple(ix.shape) for s, ix in index.items()}
    assert all(ix.dtype == torch.int64 for ix in index.values())
    if isinstance(rule, LinearFamilyRule):  # brute force from the row-major layout
        names = {n for n, p in module.named_parameters() if p.requires_grad}
        W = "weight" if "weight" in names else None
        b = "bias" if "bias" in names else None
        C = getattr(module, "groups", 1)
        want = _matrix_positions(module, layout, "1.", W, b, C)
        assert torch.equal(index[""], want)
    if case == "embedding":  # the layer's matrix is E^T [D, V]
        E = torch.arange(7 * 3).view(7, 3) + layout.offsets["1.weight"]
        assert torch.equal(index[""], E.T[None])


def test_kfac_shapes_default_builds_the_index_without_data():
    """A rule of one's own with only ``kfac_index``: the default reads its shapes (meta)."""

    class Own(LinearFamilyRule):
        def kfac_index(self, module, offsets):
            V = torch.arange(offsets["weight"], offsets["weight"] + module.weight.numel())
            return {"": V.view(1, -1, 1), "twice": V.view(1, 1, -1)}

    module = nn.Linear(4, 3)
    assert Own().kfac_shapes(module) == {"": (1, 12, 1), "twice": (1, 1, 12)}


def test_kfac_shapes_decide_the_large_blocks():
    """``kfac()``'s one-sided blocks from the shapes alone: the same sizes, the same split."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, groups=3), nn.Flatten(), nn.Linear(6 * 4 * 4, 5))
    X, y = torch.randn(4, 3, 6, 6), torch.randint(0, 5, (4,))
    with pytest.warns(UserWarning, match="max_factor_size=8"):
        approx = curvature.kfac(model, nn.CrossEntropyLoss(), (X, y), max_factor_size=8)
    kinds = {b.name: type(b).__name__ for b in approx.blocks}
    # conv: D = 1 * 9 + 1 = 10 > 8 (A diagonal), D_out = 2; linear: D = 97 > 8
    assert kinds == {"0": "OneSidedBlock", "2": "OneSidedBlock"}
    for b in approx.blocks:
        assert tuple(b.index.shape) == {"0": (3, 2, 10), "2": (1, 5, 97)}[b.name]


def test_block_index_builds_on_the_device_with_or_without_a_device_argument():
    """Built-in rules take ``device``; a rule of one's own without it gets a device context."""

    class Old(LinearFamilyRule):  # kfac_index(module, offsets): the signature before
        def kfac_index(self, module, offsets):
            return super().kfac_index(module, offsets)

    module = nn.Linear(4, 3)
    offsets = {"weight": 5, "bias": 17}
    want = registered_rule(module).kfac_index(module, offsets)[""]
    for rule in (registered_rule(module), Old()):
        meta = block_index(rule, module, offsets, torch.device("meta"))[""]
        assert meta.device.type == "meta" and meta.shape == want.shape
        cpu = block_index(rule, module, offsets, torch.device("cpu"))[""]
        assert cpu.device.type == "cpu" and torch.equal(cpu, want)
    with torch.device("meta"):  # without device: the default device, as before
        assert registered_rule(module).kfac_index(module, offsets)[""].device.type == "meta"
