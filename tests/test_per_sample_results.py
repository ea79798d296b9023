"""Per-sample results are ordinary, independent tensors, or the caller's ``out=`` buffers.

``Capture.per_sample_grads`` allocates each result afresh (no cache of dropped results):
a result you keep, or any view of it, is never written by a later call, and no two
results share memory. With ``out=`` the results are the given buffers, filled in place.
"""

from __future__ import annotations

import copy
import gc
import pickle

import pytest
import torch
from cases import CASES, assert_grads_match, build, run_model
from torch import Tensor, nn

import curvature


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(7, 5), nn.LayerNorm(5), nn.Flatten(), nn.Linear(15, 4))


class _Attention(nn.Module):
    """Embedding, self-attention and a head: the attention rule's graph path."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(7, 6)
        self.att = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        h = self.emb(x)
        return self.head(self.att(h, h, h, need_weights=False)[0].mean(1))


MODELS = {"embedding-norm-linear": _model, "attention": _Attention}


def _grads(model, X, y, **kwargs):
    with curvature.capture(model) as cap:
        out = model(X)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    return cap.per_sample_grads(losses, retain_graph=False, **kwargs)


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 7, (6, 3), generator=g), torch.randint(0, 4, (6,), generator=g)


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the memory of ``a``'s storage and ``b``'s storage intersect."""
    sa, sb = a.untyped_storage(), b.untyped_storage()
    a0, b0 = sa.data_ptr(), sb.data_ptr()
    return a0 < b0 + sb.nbytes() and b0 < a0 + sa.nbytes()


def _assert_independent(results, kept):
    """No result of ``results`` shares memory with another one or with any of ``kept``."""
    items = list(results.items())
    for i, (k, v) in enumerate(items):
        for k2, v2 in items[i + 1 :]:
            assert not _overlap(v, v2), f"results {k} and {k2} share memory"
        for k2, v2 in kept.items():
            assert not _overlap(v, v2), f"result {k} aliases the kept result {k2}"


@pytest.mark.parametrize("make", list(MODELS.values()), ids=list(MODELS))
def test_results_are_independent_tensors(make):
    model = make()
    first = _grads(model, *_batch(0))
    snapshot = {k: v.clone() for k, v in first.items()}
    dropped = next(iter(first))
    view = first[dropped][2]  # a view alone also keeps its memory
    view_snapshot = view.clone()
    del first[dropped]  # computing again may use its memory, never a kept result's
    gc.collect()
    for seed in range(1, 4):
        again = _grads(model, *_batch(seed))
        _assert_independent(again, {**first, "view": view})
        del again
        gc.collect()
    for k, v in first.items():
        torch.testing.assert_close(v, snapshot[k], rtol=0, atol=0)
    torch.testing.assert_close(view, view_snapshot, rtol=0, atol=0)


@pytest.mark.parametrize("make", list(MODELS.values()), ids=list(MODELS))
def test_out_buffers_are_honoured(make):
    model = make()
    X, y = _batch(0)
    expected = _grads(model, X, y)
    bufs = {k: torch.full_like(v, 7.0) for k, v in expected.items()}
    ptrs = {k: b.data_ptr() for k, b in bufs.items()}
    grads = _grads(model, X, y, out=bufs)
    assert all(grads[k] is bufs[k] and bufs[k].data_ptr() == ptrs[k] for k in grads)
    for k, v in grads.items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)
    plain = _grads(model, *_batch(1))  # without out=: new tensors, the buffers untouched
    _assert_independent(plain, bufs)
    for k, v in grads.items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)


def test_recomputed_results_are_correct_after_dropping():
    # memory freed by a dropped result may come back: its contents (e.g. embedding rows
    # of another batch) never leak into the new result
    model = _model()
    X, y = _batch(0)
    expected = {k: v.clone() for k, v in _grads(model, X, y).items()}  # result dropped
    gc.collect()
    _grads(model, *_batch(1))  # dropped too
    gc.collect()
    for k, v in _grads(model, X, y).items():
        torch.testing.assert_close(v, expected[k], rtol=0, atol=0)


def test_results_behave_like_tensors():
    grads = _grads(_model(), *_batch(0))
    w = grads["3.weight"]
    torch.testing.assert_close(pickle.loads(pickle.dumps(w)), w)
    torch.testing.assert_close(copy.deepcopy(w), w)
    w.mul_(2).add_(1)  # in place ops work
    assert w.is_contiguous() and w.dtype == torch.float32


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_grid_twice_with_the_first_results_kept(case):
    """Every case, twice in a row: the second call neither aliases nor changes the first."""
    problem = build(case, torch.float64, "mean", 3)
    results = []
    for _ in range(2):
        with curvature.capture(problem.model) as cap:
            out = run_model(problem.model, problem.X)
        losses = curvature.per_sample_losses(problem.loss_func, out, problem.y)
        results.append(cap.per_sample_grads(losses))
    _assert_independent(results[1], results[0])
    for grads in results:
        assert_grads_match(grads, problem.reference)


def test_release_result_cache_is_a_deprecated_no_op():
    grads = _grads(_model(), *_batch(0))
    snapshot = {k: v.clone() for k, v in grads.items()}
    with pytest.warns(DeprecationWarning, match="ordinary tensors"):
        assert curvature.per_sample.release_result_cache() is None
    for k, v in grads.items():
        torch.testing.assert_close(v, snapshot[k], rtol=0, atol=0)
