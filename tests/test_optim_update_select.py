"""The update's per-parameter select (a parameter with a non-finite direction is kept)
through the path a GPU takes (``apply_update`` without the CPU's buffered two passes),
and that it keeps nothing of the flat vector's size alive after the step."""

from __future__ import annotations

import gc
import warnings

import torch

from curvature.foreach import FlatBuffer
from curvature.optim.updates import ParamSlot, apply_update


def _setup():
    torch.manual_seed(0)
    params = [torch.randn(7, 13), torch.randn(13), torch.randn(3, 5, 2)]  # P = 7*13+13+30
    group = {"lr": 0.5, "weight_decay": 0.0, "momentum": 0.0}
    slots, at = [], 0
    for i, p in enumerate(params):
        slots.append(ParamSlot(f"p{i}", p, group, slice(at, at + p.numel())))
        at += p.numel()
    d = torch.randn(at)
    d[at - 3] = float("nan")  # the last parameter's direction is not finite
    return params, slots, d, torch.randn(at)


def test_every_select_path_keeps_a_non_finite_parameter_and_they_agree():
    """A new tensor (no buffer), a persistent buffer, and in place of the directions
    (views of them given: the optimizers' path), bit for bit alike."""
    results = []
    for path in ("new", "buffer", "in place"):
        params, slots, d, g = _setup()
        before = [p.clone() for p in params]
        buffer = FlatBuffer() if path == "buffer" else None
        directions = d.clone()
        views = None
        if path == "in place":
            views = [directions[s.span].view(s.param.shape) for s in slots]
        _, ok = apply_update(slots, directions, g, {}, None, "KFAC", buffer, views)
        if path == "in place":  # the selection was made there
            assert torch.equal(directions[-30:], torch.zeros(30))
        assert ok.tolist() == [True, True, False]
        assert torch.equal(params[2], before[2])  # kept, not NaN
        at = 0
        for p, p0 in zip(params[:2], before[:2]):
            n = p.numel()
            torch.testing.assert_close(p, p0 - 0.5 * d[at : at + n].view_as(p0))
            at += n
        results.append(params)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)


def test_the_select_keeps_nothing_of_the_flat_size_alive():
    """Before: a ``[P]`` index of every position's parameter stayed in a module-level
    cache for the life of the process (four bytes per parameter on the device)."""
    params, slots, d, g = _setup()
    P = d.numel()
    apply_update(slots, d, g, {}, None, "KFAC", None)
    del d, g
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on some of torch's deprecated objects)
        warnings.simplefilter("ignore")
        objects = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
    alive = [t for t in objects if t.numel() == P]
    assert alive == []
