"""The running updates' weights of one step from one ``where`` over its flags vector.

The statistics' flush judges every block's contribution at once and hands each block a
0-d view of one ``[K]`` flags vector; :func:`curvature.blocks.running.update_weight`
turns a flag into the update's weight (``1 - decay`` if valid, else 0). For views of
one vector the weights come from one ``where`` over the vector and one ``unbind`` (two
aten calls, kernel launches on a GPU, for ``K`` blocks instead of ``K``), with the same
values.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

from curvature.blocks.running import update_weight

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from step_counts import AtenCalls  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_weights_of_a_flags_vector_equal_one_where_each(dtype):
    flags = torch.tensor([True, False, True, True, False])
    decay = 0.95
    update_weight(torch.tensor(True), None, decay, dtype)  # (the constants, made once)
    with AtenCalls() as calls:
        got = [update_weight(v, None, decay, dtype) for v in flags.unbind(0)]
    assert calls.count == 2 + 1  # the where and the unbind, and the unbind above
    for (w, fresh), flag in zip(got, flags.tolist()):
        want = torch.where(torch.tensor(flag), torch.tensor(1 - decay, dtype=dtype), 0.0)
        assert fresh is None and w.dtype == dtype and w.dim() == 0
        assert torch.equal(w, want.to(dtype))


def test_a_flag_of_its_own_or_a_short_vector_takes_its_own_where():
    decay = 0.9
    alone = torch.tensor(True)
    pair = torch.tensor([False, True]).unbind(0)
    update_weight(alone, None, decay, torch.float32)  # (the constants, made once)
    with AtenCalls() as calls:
        w = update_weight(alone, None, decay, torch.float32)[0]
        v = [update_weight(p, None, decay, torch.float32)[0] for p in pair]
    assert calls.count == 3  # one where each
    assert float(w) == pytest.approx(0.1) and float(v[0]) == 0.0
    assert float(v[1]) == pytest.approx(0.1)


def test_a_new_flags_vector_gets_new_weights():
    decay = 0.5
    first = [
        update_weight(v, None, decay, torch.float64)[0] for v in torch.ones(3).bool().unbind(0)
    ]
    second = [
        update_weight(v, None, decay, torch.float64)[0] for v in torch.zeros(3).bool().unbind(0)
    ]
    assert [float(w) for w in first] == [0.5] * 3
    assert [float(w) for w in second] == [0.0] * 3
