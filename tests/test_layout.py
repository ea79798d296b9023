"""ParamLayout: the one owner of names, shapes, offsets and flatten/unflatten.

The reference for every flat vector is the SPEC's order: the trainable parameters of
``model.parameters()``, each ``p.flatten()``, concatenated.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from curvature.layout import ParamLayout


class Tied(nn.Module):
    """An embedding whose weight the output head shares, a frozen layer, a 0-dim scale."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.frozen = nn.Linear(3, 3)
        self.frozen.weight.requires_grad_(False)
        self.scale = nn.Parameter(torch.tensor(2.0))
        self.head = nn.Linear(3, 5)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens):
        return self.head(self.scale * self.frozen(self.emb(tokens)))


def _reference_flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])


def test_of_lists_trainable_parameters_in_named_parameters_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    layout = ParamLayout.of(model)
    assert layout.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert layout.shapes == (torch.Size([4, 3]), torch.Size([4]), torch.Size([2, 4]), (2,))
    assert layout.numels == (12, 4, 8, 2)
    assert layout.offsets == {"0.weight": 0, "0.bias": 12, "2.weight": 16, "2.bias": 24}
    assert layout.numel == 26
    assert all(a is b for a, b in zip(layout.params, model.parameters()))
    assert len(layout) == 4
    assert "2.bias" in layout and "1.weight" not in layout
    assert "P=26" in repr(layout)


def test_of_lists_a_tied_parameter_once_and_leaves_frozen_ones_out():
    model = Tied()
    layout = ParamLayout.of(model)
    assert layout.names == ("scale", "emb.weight", "frozen.bias", "head.bias")  # own first
    assert layout.names == tuple(n for n, p in model.named_parameters() if p.requires_grad)
    assert layout.params[1] is model.head.weight
    assert "frozen.weight" not in layout and "head.weight" not in layout
    assert layout.numel == 15 + 1 + 3 + 5
    torch.testing.assert_close(layout.flat_params(), _reference_flat(model))


def test_a_zero_dim_parameter_takes_one_entry():
    model = Tied()
    layout = ParamLayout.of(model)
    assert layout.shapes[0] == torch.Size([]) and layout.span("scale") == slice(0, 1)
    flat = torch.arange(float(layout.numel))
    scale = layout.unflatten_dict(flat)["scale"]
    assert scale.shape == () and scale.item() == 0.0
    batched = layout.unflatten(flat.expand(2, -1))
    assert batched[0].shape == (2,)
    torch.testing.assert_close(layout.flatten(layout.unflatten(flat)), flat)


def test_init_keeps_the_given_pairs_in_order_and_rejects_bad_ones():
    a, b = torch.zeros(2, 2), torch.zeros(3)
    layout = ParamLayout([("b", b), ("a", a)])
    assert layout.names == ("b", "a") and layout.offsets == {"b": 0, "a": 3}
    assert ParamLayout.of_tensors([a, b]).names == ("0", "1")
    with pytest.raises(ValueError, match="'a' appears twice"):
        ParamLayout([("a", a), ("a", b)])
    with pytest.raises(ValueError, match=r"entry 1 must be a \(name: str, parameter: Tensor\)"):
        ParamLayout([("a", a), b])
    empty = ParamLayout([])
    assert len(empty) == 0 and empty.numel == 0
    assert empty.flatten([]).shape == (0,) and empty.flat_params().shape == (0,)


def test_span_and_index():
    layout = ParamLayout.of(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    assert layout.span("0.bias") == slice(4, 6)
    ix = layout.index(["1.bias", "0.bias"])
    assert ix.dtype == torch.int64 and ix.tolist() == [8, 4, 5]
    assert layout.index([]).shape == (0,)
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        layout.index(["nope"])
    flat = torch.arange(9.0)
    for n, view in layout.unflatten_dict(flat).items():
        torch.testing.assert_close(flat[layout.span(n)], view.flatten())
        torch.testing.assert_close(flat[layout.index([n])], view.flatten())


def test_module_index_and_local_offsets():
    model = Tied()
    layout = ParamLayout.of(model)
    # frozen: its weight is frozen, its bias at 16..18
    assert layout.module_index(model.frozen, "frozen").tolist() == [16, 17, 18]
    # head: its weight is listed as emb.weight (tied), so only the bias
    assert layout.module_index(model.head, "head").tolist() == list(range(19, 24))
    root = layout.module_index(model, "")
    assert root.tolist() == list(range(layout.numel))
    assert layout.module_index(nn.Tanh(), "act").shape == (0,)
    assert layout.local_offsets("frozen") == {"bias": 16}
    assert layout.local_offsets("head") == {"bias": 19}
    assert layout.local_offsets("") == layout.offsets
    nested = nn.Sequential(nn.Sequential(nn.Linear(1, 1)), nn.Linear(1, 1))
    assert ParamLayout.of(nested).local_offsets("0") == {"0.weight": 0, "0.bias": 1}


def test_flatten_a_list_or_a_dict_matches_the_spec_order():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    layout = ParamLayout.of(model)
    ref = _reference_flat(model)
    torch.testing.assert_close(layout.flatten(list(model.parameters())), ref)
    shuffled = dict(reversed(list(model.named_parameters())))
    torch.testing.assert_close(layout.flatten(shuffled), ref)


def test_flatten_with_a_batch_shape_and_none_as_zero():
    layout = ParamLayout.of(nn.Linear(2, 3))  # weight [3, 2], bias [3]
    W, b = torch.randn(4, 5, 3, 2), torch.randn(4, 5, 3)
    flat = layout.flatten([W, b], batch_shape=(4, 5))
    assert flat.shape == (4, 5, 9)
    torch.testing.assert_close(flat[..., :6], W.reshape(4, 5, 6))
    W2, b2 = layout.unflatten(flat)
    torch.testing.assert_close(W2, W) and torch.testing.assert_close(b2, b)
    flat = layout.flatten([None, b], batch_shape=(4, 5), none_as_zero=True)
    assert (flat[..., :6] == 0).all()
    torch.testing.assert_close(flat[..., 6:], b)
    assert (layout.flatten([None, None], none_as_zero=True) == 0).all()


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.zeros(3, 2)],  # one tensor short
        [torch.zeros(3, 2), torch.zeros(3), torch.zeros(1)],  # one too many
        [torch.zeros(2, 3), torch.zeros(3)],  # transposed weight
        [torch.zeros(3, 2), None],  # None without none_as_zero
        [torch.zeros(3, 2), "bias"],  # not a tensor
    ],
)
def test_flatten_names_the_argument_and_the_expected_shapes(tensors):
    layout = ParamLayout.of(nn.Linear(2, 3))
    msg = (
        "direction must be 2 tensors shaped like the parameters [(3, 2), (3,)]: a list in "
        "the order ['weight', 'bias']"
    )
    with pytest.raises(ValueError, match=re.escape(msg)):
        layout.flatten(tensors, what="direction")


def test_flatten_of_a_dict_names_missing_and_unexpected_keys():
    layout = ParamLayout.of(nn.Linear(2, 3))
    with pytest.raises(ValueError, match=r"v must be a dict .* missing \['bias'\], unexpected"):
        layout.flatten({"weight": torch.zeros(3, 2)})
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        layout.flatten({"weight": torch.zeros(3, 2), "bias": torch.zeros(3), "extra": None})
    with pytest.raises(ValueError, match=re.escape("got 2: [(3, 2), (4,)]")):
        layout.flatten({"bias": torch.zeros(4), "weight": torch.zeros(3, 2)})


def test_unflatten_returns_views_and_checks_the_length():
    layout = ParamLayout.of(nn.Linear(2, 3))
    flat = torch.zeros(9)
    W, b = layout.unflatten(flat)
    W.fill_(1.0)
    assert flat[:6].eq(1).all() and flat[6:].eq(0).all()
    d = layout.unflatten_dict(flat)
    assert list(d) == ["weight", "bias"] and d["bias"].shape == (3,)
    with pytest.raises(ValueError, match=r"\[\.\.\., P\] with P = 9; got \(8,\)"):
        layout.unflatten(torch.zeros(8))
    with pytest.raises(ValueError, match="P = 9"):
        layout.unflatten(torch.tensor(1.0))


def test_flat_grads():
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    layout = ParamLayout.of(model)
    assert layout.flat_grads() is None
    model[1](torch.randn(4, 3)).sum().backward()  # grads of the second layer only
    flat = layout.flat_grads()
    assert flat.shape == (13,) and flat.dtype == torch.float32
    assert (flat[:9] == 0).all()
    torch.testing.assert_close(flat[9:], torch.cat([model[1].weight.grad[0], model[1].bias.grad]))
    assert layout.flat_grads(torch.float64).dtype == torch.float64


def test_flat_params_is_a_detached_copy():
    model = nn.Linear(2, 3)
    layout = ParamLayout.of(model)
    flat = layout.flat_params()
    assert not flat.requires_grad
    torch.testing.assert_close(flat, _reference_flat(model))
    flat.zero_()
    assert model.weight.abs().sum() > 0
    assert layout.flat_params(torch.float64).dtype == torch.float64


def test_covered_names_are_those_whose_first_entry_is_indexed():
    # weight [2, 3] at 0, an empty parameter at 6, bias [2] at 6, scale [1] at 8
    layout = ParamLayout(
        [
            ("weight", torch.zeros(2, 3)),
            ("empty", torch.zeros(0)),
            ("bias", torch.zeros(2)),
            ("scale", torch.zeros(1)),
        ]
    )
    assert layout.covered_names([]) == []
    assert layout.covered_names([torch.tensor([[0, 1], [2, 3]])]) == ["weight"]
    # the bias's first entry (6) is covered, the scale's (8) is not; the empty one never
    assert layout.covered_names([torch.tensor([5]), torch.tensor([6, 7])]) == ["bias"]
    assert layout.covered_names([torch.arange(9)]) == ["weight", "bias", "scale"]
    # a brute-force twin on random indices
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        ix = torch.randint(0, 9, (4,), generator=g)
        hits = set(ix.tolist())
        expected = [n for n in ("weight", "bias", "scale") if layout.offsets[n] in hits]
        assert layout.covered_names([ix]) == expected
