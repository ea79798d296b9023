"""The cache of result buffers (``curvature._memory.ResultPool``) and the direct-write paths.

Results of ``per_sample_grads`` reuse the memory of earlier results once every tensor
viewing it has died; these tests check that a result (or a view of it) the user keeps is
never overwritten, that dropped results are reused, and that the cache empties itself.
The pool's size threshold is lowered to 0 so that every result goes through it.
"""

from __future__ import annotations

import gc

import pytest
import torch
from cases import CASES, assert_grads_match, build, run_model
from torch import nn

import curvature
from curvature import _memory
from curvature.layers import registered_rule


@pytest.fixture
def pool_everything(monkeypatch):
    """Route every CPU result through a fresh pool."""
    pool = _memory.ResultPool()
    monkeypatch.setattr(_memory, "POOL", pool)
    monkeypatch.setattr(_memory, "POOL_MIN_BYTES", 0)
    yield pool
    pool.release()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 5), nn.LayerNorm(5), nn.Flatten(), nn.Linear(15, 4))


def _grads(model, X, y):
    with curvature.capture(model) as cap:
        out = model(X)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    return cap.per_sample_grads(losses, retain_graph=False)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 7, (6, 3), generator=g), torch.randint(0, 4, (6,), generator=g)


def test_kept_results_are_never_overwritten(pool_everything):
    model = _model()
    first = _grads(model, *_batch(0))
    snapshot = {k: v.clone() for k, v in first.items()}
    view = first["3.weight"][2]  # a view alone must also keep its block
    view_snapshot = view.clone()
    del first["3.weight"]
    gc.collect()
    for seed in range(1, 4):
        _grads(model, *_batch(seed))
    for k, v in first.items():
        torch.testing.assert_close(v, snapshot[k], rtol=0, atol=0)
    torch.testing.assert_close(view, view_snapshot, rtol=0, atol=0)


def test_dropped_results_are_reused_and_correct(pool_everything):
    model = _model()
    X, y = _batch(0)
    expected = {k: v.clone() for k, v in _grads(model, X, y).items()}  # result dropped
    gc.collect()
    assert pool_everything.cached_bytes > 0
    ptrs = {v.data_ptr() for v in _grads(model, *_batch(1)).values()}  # reuses, drops
    again = _grads(model, X, y)
    assert {v.data_ptr() for v in again.values()} & ptrs  # the same memory came back
    for k, v in again.items():  # stale contents (e.g. embedding rows) never leak in
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)


def test_unused_blocks_are_released_after_one_call(pool_everything):
    model = _model()
    _grads(model, *_batch(0))
    gc.collect()
    assert pool_everything.cached_bytes > 0
    pool_everything.new_call()  # a call that reuses nothing
    assert pool_everything.cached_bytes > 0
    pool_everything.new_call()
    assert pool_everything.cached_bytes == 0
    _grads(model, *_batch(0))
    gc.collect()
    curvature.per_sample.release_result_cache()  # the global pool: the fixture's
    assert pool_everything.cached_bytes == 0


def test_disabled_pool_allocates_plain_tensors(pool_everything):
    pool_everything.enabled = False
    grads = _grads(_model(), *_batch(0))
    del grads
    gc.collect()
    assert pool_everything.cached_bytes == 0


def test_pooled_results_behave_like_tensors(pool_everything):
    import copy
    import pickle

    grads = _grads(_model(), *_batch(0))
    w = grads["3.weight"]
    torch.testing.assert_close(pickle.loads(pickle.dumps(w)), w)
    torch.testing.assert_close(copy.deepcopy(w), w)
    w.mul_(2).add_(1)  # in place ops work
    assert w.is_contiguous() and w.dtype == torch.float32


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_grid_through_the_pool(pool_everything, case):
    """Every case, twice in a row with the first results kept, through the pool."""
    problem = build(case, torch.float64, "mean", 3)
    results = []
    for _ in range(2):
        with curvature.capture(problem.model) as cap:
            out = run_model(problem.model, problem.X)
        losses = curvature.per_sample_losses(problem.loss_func, out, problem.y)
        results.append(cap.per_sample_grads(losses))
    for grads in results:
        assert_grads_match(grads, problem.reference)


# -- nn.MultiheadAttention: per-sample gradients written straight from the graph ----------
@pytest.fixture
def graph_only(monkeypatch):
    """Attention must take its projections from the recorded graph: a replay fails."""
    from curvature.layers.attention import MultiheadAttentionRule

    def no_replay(self, module, call):
        raise AssertionError("the graph path should cover this model")

    monkeypatch.setattr(MultiheadAttentionRule, "_replay", no_replay)


def _assert_captured_grads_match(model, loss, X, y):
    """One captured forward of ``model(*X)``: per-sample gradients equal torch.func's."""
    from cases import torch_func_per_sample_grads

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
    from cases import torch_func_per_sample_grads

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
    walk = attention._find_projections
    monkeypatch.setattr(attention, "_find_projections", lambda *a: walks.append(1) or walk(*a))
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
    from curvature.layers.attention import _find_projections, _follow_routes

    att = nn.MultiheadAttention(6, 2, batch_first=True)
    x = torch.randn(2, 3, 6, requires_grad=True) * 1.0
    out = att(x, x, x, need_weights=False)[0]
    found = _find_projections(att, out, [x])
    again = _follow_routes(att, out, [x], found["routes"])
    assert again["out"] is found["out"] and again["in"] == found["in"]
    routes = dict((hit[0], (path, hit)) for path, hit in found["routes"])
    (p_out, hit_out), (p_in, hit_in) = routes["out_proj.weight"], routes["in_proj_weight"]
    assert _follow_routes(att, out, [x], [(p_out + (9,), hit_out), (p_in, hit_in)]) is None
    other_rows = (hit_in[0], hit_in[1] + 1)  # the same weight, another split
    assert _follow_routes(att, out, [x], [(p_out, hit_out), (p_in, other_rows)]) is None
    assert _follow_routes(att, out, [out], found["routes"]) is None  # stop at the inputs


def test_empty_results_do_not_go_through_the_pool(pool_everything):
    assert _memory.result_empty((0, 5), torch.float32, torch.device("cpu")).numel() == 0
    assert pool_everything.cached_bytes == 0


def test_pool_keeps_at_most_max_bytes(pool_everything):
    pool_everything.max_bytes = 0
    grads = _grads(_model(), *_batch(0))
    del grads
    gc.collect()
    assert pool_everything.cached_bytes == 0
