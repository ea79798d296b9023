"""Subnormal results of the library's own CPU arithmetic are flushed to zero
(:mod:`curvature.subnormals`), and the caller's setting is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
import curvature.subnormals as subnormals

pytestmark = [
    pytest.mark.usefixtures("one_thread_seeded"),
    pytest.mark.skipif(
        not torch.set_flush_denormal(False), reason="no flush-to-zero flags on this CPU"
    ),
]

TINY = torch.finfo(torch.float32).tiny


def tiny_inputs_step(enabled: bool):
    """One DiagonalNaturalGradient step whose weight statistics are subnormal: inputs of
    1e-20 make the per-sample weight gradients about 1e-20 and their squares 1e-40."""
    was = subnormals.ENABLED
    subnormals.ENABLED = enabled
    try:
        model = nn.Linear(4, 3)
        opt = curvature.DiagonalNaturalGradient(model, lr=1e-3)
        X, y = torch.randn(8, 4) * 1e-20, torch.randint(0, 3, (8,))
        nn.CrossEntropyLoss()(model(X), y).backward()
        opt.step()
    finally:
        subnormals.ENABLED = was
    return opt.diagonal_[""]  # 12 weight and 3 bias entries


def subnormal(d):
    return (d != 0) & (d.abs() < TINY)


def test_subnormal_statistics_are_flushed_to_zero():
    d = tiny_inputs_step(True)
    assert not subnormal(d).any()
    assert (d > TINY).sum() == 3  # the bias's statistics (inputs 1) are untouched


def test_without_the_flush_they_stay_subnormal():
    """The check above can fail: the same step keeps subnormal entries without it."""
    assert subnormal(tiny_inputs_step(False)).sum() == 12


@pytest.mark.parametrize("before", [False, True])
def test_the_callers_setting_is_restored(before):
    torch.set_flush_denormal(before)
    try:
        tiny_inputs_step(True)
        assert subnormals.flushed() is before
        with subnormals.flushing():
            assert subnormals.flushed()
        assert subnormals.flushed() is before
    finally:
        torch.set_flush_denormal(False)
