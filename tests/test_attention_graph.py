"""``nn.MultiheadAttention``: per-sample gradients written straight from the recorded graph.

The rule finds the projection matmuls in the autograd graph of each call
(:mod:`curvature.layers.attention_graph`), reuses the route found on the module's
previous call and walks the graph again when it no longer fits. These tests forbid the
replay (``graph_only``) and compare with ``torch.func``'s per-sample gradients.
"""

from __future__ import annotations

import pytest
import torch
from cases import assert_grads_match, torch_func_per_sample_grads
from torch import nn

import curvature
from curvature.layers import registered_rule


@pytest.fixture
def graph_only(monkeypatch):
    """Attention must take its projections from the recorded graph: a replay fails."""
    from curvature.layers.attention import MultiheadAttentionRule

    def no_replay(self, module, call):
        raise AssertionError("the graph path should cover this model")

    monkeypatch.setattr(MultiheadAttentionRule, "_replay", no_replay)


def _assert_captured_grads_match(model, loss, X, y):
    """One captured forward of ``model(*X)``: per-sample gradients equal torch.func's."""
    with curvature.capture(model) as cap:
        out = model(*X)
    grads = cap.per_sample_grads(curvature.per_sample_losses(loss, out, y))
    assert_grads_match(grads, torch_func_per_sample_grads(model, loss, X, y))


class _AttentionTwice(nn.Module):
    """One attention module called twice on independent queries (self- or cross-attention)."""

    def __init__(self, cross: bool, kdim=None, **kwargs):
        super().__init__()
        self.cross = cross
        self.att = nn.MultiheadAttention(6, 2, batch_first=True, kdim=kdim, vdim=kdim, **kwargs)
        self.head = nn.Linear(6, 3)

    def forward(self, x, z, kv):
        if self.cross == "stacked":  # the second call's graph walk must stop at its input
            h = self.att(x, x, x, need_weights=False)[0]
            h = self.att(h, h, h)[0]
        elif self.cross:
            h = self.att(x, kv, kv, need_weights=False)[0] + self.att(z, kv, kv)[0]
        else:
            h = self.att(x, x, x, need_weights=False)[0] + self.att(z, z, z)[0]
        return self.head(h).mean(1)


@pytest.mark.parametrize(
    "cross, kdim, kwargs",
    [
        (False, None, {}),
        (True, None, {}),
        (True, 4, {}),
        (False, None, {"bias": False}),
        ("stacked", None, {}),
    ],
    ids=["self", "cross-packed", "cross-kdim", "self-no-bias", "stacked"],
)
def test_attention_called_twice_from_the_graph(float64_seeded, graph_only, cross, kdim, kwargs):
    model = _AttentionTwice(cross, kdim, **kwargs)
    X = (torch.randn(4, 5, 6), torch.randn(4, 5, 6), torch.randn(4, 3, kdim or 6))
    y = torch.randint(0, 3, (4,))
    loss = nn.CrossEntropyLoss()
    expected = torch_func_per_sample_grads(model, loss, X, y)
    for use_out in (False, True):
        with curvature.capture(model) as cap:
            out = model(*X)
        losses = curvature.per_sample_losses(loss, out, y)
        if not use_out:
            grads = cap.per_sample_grads(losses)
        else:  # out= buffers receive the same values, in place
            bufs = {k: torch.full_like(v, 7.0) for k, v in expected.items()}
            grads = cap.per_sample_grads(losses, out=bufs)
            assert all(grads[k] is bufs[k] for k in grads)
        assert_grads_match(grads, expected)


class _AttentionOnce(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(6, 2, batch_first=True)
        self.need_weights = False

    def forward(self, x):
        return self.att(x, x, x, need_weights=self.need_weights)[0].mean(1)


def test_attention_graph_routes_are_reused_and_revalidated(float64_seeded, graph_only, monkeypatch):
    from curvature.layers import attention

    walks = []
    walk = attention.find_projections  # the name the rule calls
    monkeypatch.setattr(attention, "find_projections", lambda *a: walks.append(1) or walk(*a))
    model = _AttentionOnce()
    for need_weights, expected_walks in [(False, 1), (False, 1), (True, 2), (True, 2)]:
        model.need_weights = need_weights  # another graph: the stored route must not match
        _assert_captured_grads_match(
            model, nn.MSELoss(), (torch.randn(3, 4, 6),), torch.randn(3, 6)
        )
        assert len(walks) == expected_walks


class _AttentionSwitching(nn.Module):
    """One attention module whose call pattern changes from one forward to the next."""

    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(6, 2, batch_first=True)
        self.mode = "self"

    def forward(self, x, z, w):
        q, k, v = {"self": (x, x, x), "kv": (x, z, z), "qkv": (x, z, w)}[self.mode]
        return self.att(q, k, v, need_weights=False)[0].mean(1)


def test_attention_routes_survive_changing_call_patterns(float64_seeded, graph_only):
    # self-attention projects q, k, v with one matmul, k-is-v with two, else three: a
    # stored route may then lead to some of them only; the walk must take over
    model = _AttentionSwitching()
    loss = nn.MSELoss()
    for mode in ("self", "kv", "qkv", "kv", "self", "qkv", "self", "qkv"):
        model.mode = mode
        X = (torch.randn(3, 4, 6), torch.randn(3, 5, 6), torch.randn(3, 5, 6))
        _assert_captured_grads_match(model, loss, X, torch.randn(3, 6))
    # a stored route that still fits but reaches only some projections (q and out of
    # three separate q, k, v matmuls): the graph is walked again
    rule = registered_rule(model.att)
    partial = [r for r in rule._routes[model.att] if r[1][1] == 0]
    assert 0 < len(partial) < len(rule._routes[model.att])
    rule._routes[model.att] = partial
    _assert_captured_grads_match(model, loss, X, torch.randn(3, 6))
    assert len(rule._routes[model.att]) == 4  # q, k, v and out again


def test_attention_routes_that_do_not_fit_the_graph_are_refused():
    from curvature.layers.attention_graph import find_projections, follow_routes

    att = nn.MultiheadAttention(6, 2, batch_first=True)
    x = torch.randn(2, 3, 6, requires_grad=True) * 1.0
    out = att(x, x, x, need_weights=False)[0]
    found = find_projections(att, out, [x])
    again = follow_routes(att, out, [x], found.routes)
    assert again.out_proj is found.out_proj and again.in_proj == found.in_proj
    routes = dict((hit[0], (path, hit)) for path, hit in found.routes)
    (p_out, hit_out), (p_in, hit_in) = routes["out_proj.weight"], routes["in_proj_weight"]
    assert follow_routes(att, out, [x], [(p_out + (9,), hit_out), (p_in, hit_in)]) is None
    other_rows = (hit_in[0], hit_in[1] + 1)  # the same weight, another split
    assert follow_routes(att, out, [x], [(p_out, hit_out), (p_in, other_rows)]) is None
    assert follow_routes(att, out, [out], found.routes) is None  # stop at the inputs
