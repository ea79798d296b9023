"""The host-side shortcuts of kfac() and diag_ggn() (issue 17) against brute-force twins.

- The empirical Fisher is pulled with one backward from the per-sample losses seeded
  with ``sqrt(R)``: ``G`` must equal ``R sum_n g_n g_n^T`` with ``g_n`` the gradient of
  sample ``n``'s own loss at the layer output, formed here sample by sample.
- The built-in Linear-family indices are kept between calls
  (:func:`curvature.block_indices.linear_index`): equal to the rule's ``kfac_index``, the
  same tensor for the same layout, bounded in size.
- What those indices cover is known without reading them
  (:meth:`curvature.block_indices.BlockIndices.covered_names`): the same names as reading
  every index.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch import nn

import curvature
import curvature.block_indices as block_indices
from curvature.block_indices import BlockIndices, linear_index
from curvature.layers import registered_rule
from curvature.layout import ParamLayout

pytestmark = pytest.mark.usefixtures("float64_seeded")

LOSSES = {
    "ce": (nn.CrossEntropyLoss, lambda N: torch.randint(0, 3, (N,))),
    "mse": (nn.MSELoss, lambda N: torch.randn(N, 3)),
    "bce": (nn.BCEWithLogitsLoss, lambda N: torch.rand(N, 3)),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_empirical_G_is_the_sum_of_per_sample_outer_products(loss, reduction):
    cls, target = LOSSES[loss]
    N = 6
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    X, y = torch.randn(N, 4), target(N)
    loss_func = cls(reduction=reduction)
    K = curvature.kfac(model, loss_func, (X, y), fisher="empirical")
    # brute force: each sample's own loss, its gradient at both layer outputs
    R = 1.0 / N if reduction == "mean" else 1.0
    G0, G2 = torch.zeros(5, 5), torch.zeros(3, 3)
    for n in range(N):
        z0 = model[0](X[n : n + 1])
        out = model[2](model[1](z0))
        g0, g2 = torch.autograd.grad(cls(reduction=reduction)(out, y[n : n + 1]), (z0, out))
        G0 += R * g0.T @ g0
        G2 += R * g2.T @ g2
    torch.testing.assert_close(K.factors["0"][1], G0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(K.factors["2"][1], G2, rtol=1e-12, atol=1e-14)


def test_empirical_with_ignored_targets_of_a_summed_cross_entropy():
    model = nn.Linear(4, 3)
    X, y = torch.randn(5, 4), torch.tensor([0, -100, 2, 1, -100])
    K = curvature.kfac(model, nn.CrossEntropyLoss(reduction="sum"), (X, y), fisher="empirical")
    keep = y != -100
    out = model(X[keep])
    (g,) = torch.autograd.grad(nn.CrossEntropyLoss(reduction="sum")(out, y[keep]), out)
    torch.testing.assert_close(K.factors[""][1], g.T @ g, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="ignore_index"):
        curvature.kfac(model, nn.CrossEntropyLoss(), (X, y), fisher="empirical")


#: Linear-family modules of the index tests (id -> factory)
LINEAR_MODULES = {
    "linear": lambda: nn.Linear(4, 3),
    "linear-no-bias": lambda: nn.Linear(4, 3, bias=False),
    "conv2d-groups": lambda: nn.Conv2d(4, 6, 3, groups=2),
    "conv1d": lambda: nn.Conv1d(2, 4, 2),
}


def _with_frozen(module, frozen):
    """``module`` with its parameter ``frozen`` (if any) frozen; ``None`` if nothing trains."""
    if frozen is not None and getattr(module, frozen) is not None:
        getattr(module, frozen).requires_grad_(False)
    return module if any(p.requires_grad for p in module.parameters()) else None


@pytest.mark.parametrize("make", LINEAR_MODULES.values(), ids=LINEAR_MODULES.keys())
@pytest.mark.parametrize("frozen", [None, "weight", "bias"])
def test_the_kept_linear_index_equals_the_rules_index(make, frozen):
    module = _with_frozen(make(), frozen)
    if module is None:
        return
    rule = registered_rule(module)
    offsets = {"weight": 7, "bias": 300}
    built = rule.kfac_index(module, offsets)
    first = linear_index(rule, module, offsets, torch.device("cpu"))
    again = linear_index(rule, module, offsets, torch.device("cpu"))
    assert torch.equal(first[""], built[""])
    assert again[""] is first[""]  # kept, not built again
    moved = linear_index(rule, module, {"weight": 8, "bias": 300}, torch.device("cpu"))
    assert torch.equal(moved[""], rule.kfac_index(module, {"weight": 8, "bias": 300})[""])


def test_the_kept_indices_can_be_dropped():
    rule, module, cpu = registered_rule(nn.Linear(2, 2)), nn.Linear(3, 2), torch.device("cpu")
    first = linear_index(rule, module, {"weight": 0, "bias": 6}, cpu)
    assert linear_index(rule, module, {"weight": 0, "bias": 6}, cpu)[""] is first[""]
    block_indices.clear_index_cache()
    again = linear_index(rule, module, {"weight": 0, "bias": 6}, cpu)
    assert again[""] is not first[""] and torch.equal(again[""], first[""])


def test_the_kept_indices_are_bounded(monkeypatch):
    monkeypatch.setattr(block_indices, "CACHED_INDEX_NUMEL", 100)
    monkeypatch.setattr(block_indices, "MAX_CACHED_INDEX", 60)
    rule = registered_rule(nn.Linear(1, 1))
    big, small = nn.Linear(10, 10), nn.Linear(4, 5)  # 110 and 25 entries
    cpu = torch.device("cpu")
    a = linear_index(rule, big, {"weight": 0, "bias": 100}, cpu)
    assert linear_index(rule, big, {"weight": 0, "bias": 100}, cpu)[""] is not a[""]
    kept = [linear_index(rule, small, {"weight": 25 * i, "bias": 1000}, cpu) for i in range(5)]
    assert linear_index(rule, small, {"weight": 100, "bias": 1000}, cpu)[""] is kept[4][""]
    assert linear_index(rule, small, {"weight": 0, "bias": 1000}, cpu)[""] is not kept[0][""]


def test_known_covers_equal_the_read_ones():
    model = nn.Sequential(
        nn.Linear(3, 4), nn.LayerNorm(4), nn.Conv1d(1, 2, 2), nn.Flatten(), nn.Linear(6, 2)
    )
    model[4].bias.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    layout = ParamLayout.of(model)
    layers = {n: (m, registered_rule(m)) for n, m in model.named_children() if n != "3"}
    index_of = BlockIndices(layers, layout)
    indices = [index_of(name, "", torch.device("cpu")) for name in layers]
    assert index_of.covers("0") == ["0.weight", "0.bias"]
    assert index_of.covers("2") == ["2.weight"]
    assert index_of.covers("1") is None  # not a built-in Linear-family rule: read
    read = layout.covered_names([ix.reshape(-1) for ix in indices])
    assert index_of.covered_names() == read == list(layout.names)


def test_kfac_on_a_model_with_a_frozen_bias_covers_the_rest():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[2].bias.requires_grad_(False)
    X, y = torch.randn(5, 3), torch.randint(0, 2, (5,))
    K = curvature.kfac(model, nn.CrossEntropyLoss(), (X, y), fisher="mc")
    assert K.uncovered == []
    assert K.factors["2"][0].shape == (4, 4)  # no bias column


def test_ignored_targets_are_read_once_at_the_end_of_all_batches():
    model = nn.Linear(4, 3)
    X = torch.randn(6, 4)
    y1, y2 = torch.tensor([0, 1, 2]), torch.tensor([1, -100, 0])
    data = [(X[:3], y1), (X[3:], y2)]  # only the second batch ignores a target
    for fisher in ("empirical", "mc", "type-2"):
        with pytest.raises(ValueError, match="ignore_index"):
            curvature.kfac(model, nn.CrossEntropyLoss(), data, fisher=fisher)
        with pytest.raises(ValueError, match="ignore_index"):
            curvature.diag_ggn(model, nn.CrossEntropyLoss(), data, fisher)
    # forward-only never looks at the targets
    curvature.kfac(model, nn.CrossEntropyLoss(), data, fisher="forward-only")


def test_check_ignored_and_unchecked_per_sample_losses():
    CE = nn.CrossEntropyLoss()
    out, y = torch.randn(3, 4), torch.tensor([0, -100, 2])
    losses = curvature.losses.per_sample_losses(CE, out, y, check_targets=False)
    torch.testing.assert_close(losses, nn.CrossEntropyLoss(reduction="none")(out, y))
    with pytest.raises(ValueError, match="ignore_index"):
        curvature.losses.per_sample_losses(CE, out, y)
    flags = [curvature.losses.ignored_targets(CE, t) for t in (y[:1], y)]
    with pytest.raises(ValueError, match="ignore_index"):
        curvature.losses.check_ignored(CE, flags)
    curvature.losses.check_ignored(CE, flags[:1] + [None])  # nothing ignored: no error
    curvature.losses.check_ignored(CE, [None])


def test_per_sample_losses_of_one_element_per_sample_are_the_elements():
    out, y = torch.randn(5, 3), torch.randint(0, 3, (5,))
    for reduction in ("mean", "sum"):
        CE = nn.CrossEntropyLoss(reduction=reduction)
        losses = curvature.losses.per_sample_losses(CE, out, y)
        assert torch.equal(losses, nn.CrossEntropyLoss(reduction="none")(out, y))
        assert torch.equal(
            losses, torch.stack([CE(out[n : n + 1], y[n : n + 1]) for n in range(5)])
        )


@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
def test_kfac_and_diag_ggn_of_builtin_layers_read_the_device_once(fisher):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_counts import HostReads

    model = nn.Sequential(
        nn.Linear(6, 5), nn.ReLU(), nn.Unflatten(1, (1, 5)), nn.Conv1d(1, 2, 2), nn.Flatten()
    )
    model.append(nn.Linear(8, 4))
    X, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    for call in (curvature.kfac, curvature.diag_ggn):
        kw = {"fisher": fisher} if call is curvature.kfac else {}
        with HostReads() as reads:
            call(model, nn.CrossEntropyLoss(), (X, y), **kw)
        assert reads.count == 1, dict(reads.where)  # the ignored targets, once, at the end


@pytest.mark.parametrize(
    "make",
    [*LINEAR_MODULES.values(), lambda: nn.Linear(0, 3)],
    ids=[*LINEAR_MODULES, "no-inputs"],
)
@pytest.mark.parametrize("frozen", [None, "weight", "bias"])
def test_adding_a_linear_block_without_its_index_equals_index_add(make, frozen):
    module = _with_frozen(make(), frozen)
    if module is None:
        return
    rule = registered_rule(module)
    offsets = {"weight": 5, "bias": 5 + module.weight.numel() + 2}
    index = rule.kfac_index(module, offsets)[""]
    d = torch.randn(index.shape)
    flat = torch.randn(offsets["bias"] + module.weight.shape[0] + 3)
    want = flat.clone().index_add_(0, index.reshape(-1), d.reshape(-1))
    assert block_indices.add_linear_block(flat, rule, module, offsets, {"": d})
    assert torch.equal(flat, want)
    other = registered_rule(nn.MultiheadAttention(4, 2))  # several blocks, its own index
    assert not block_indices.add_linear_block(flat, other, module, {}, {"in": d, "out": d})


@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
def test_kfac_and_diag_ggn_with_mse_do_not_read_the_device(fisher):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_counts import HostReads

    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    X, y = torch.randn(5, 6), torch.randn(5, 4)
    for call in (curvature.kfac, curvature.diag_ggn):
        with HostReads() as reads:
            call(model, nn.MSELoss(), (X, y), fisher=fisher)
        assert reads.count == 0, dict(reads.where)
