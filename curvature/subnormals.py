"""Subnormal numbers flushed to zero inside the library's own CPU computations.

An x86 CPU takes a slow microcode path for arithmetic whose input or result is
subnormal (``0 < |x| < 1.2e-38`` in float32, ``2.2e-308`` in float64). Late in training
on a memorized batch the curvature statistics go there (squared per-sample gradients of
a loss near zero, their running averages): a ``DiagonalNaturalGradient`` step on an MLP
784-512-256-10 at batch 128, one thread, slowed from 8.1 to 10.1 ms over 800 steps
(7.2-7.7 ms after the first 100 with the flush; the same losses;
``python benchmarks/subnormals.py``).

:func:`flushing` sets the calling thread's flush-to-zero / denormals-are-zero flags
(``torch.set_flush_denormal(True)``) for the block and restores the caller's setting
after. Results smaller than the smallest normal number become 0: far below any damping,
so no update changes by more than that. Limits: the flags are per thread, so with
several intra-op threads only the calling thread's share of an operation is flushed
(``torch.get_num_threads() == 1``: all of it); CPUs without the flags (not x86)
keep subnormals. GPUs are not affected by these flags at all (a GPU run changes nothing
but the host thread's bookkeeping). EKFAC's carry-over of its corrections does not rely
on this (:mod:`curvature.blocks.carry` flushes its results itself, on every thread).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Iterator

import torch

#: Device types whose float arithmetic slows down on subnormal numbers (x86 and ARM CPUs:
#: about 100x per operation). EKFAC carries its eigenvalue corrections into a new basis
#: in float64 there (:func:`curvature.blocks.carry.carried_corrections`: on every thread,
#: which the flags of :func:`flushing` do not reach).
SUBNORMAL_SLOW_DEVICES = ("cpu",)

_SMALLEST = sys.float_info.min  # the smallest normal float64
_HALF = 0.5

#: Switch for measurements (benchmarks/subnormals.py compares both): ``False`` leaves
#: the flags alone.
ENABLED = True


def flushed() -> bool:
    """Whether this thread flushes subnormal results to zero now (a host-only probe: a
    Python float product, which runs on the same SSE unit as torch's CPU kernels).
    """
    return _SMALLEST * _HALF == 0.0


@contextmanager
def flushing() -> Iterator[None]:
    """Flush subnormal results to zero on this thread inside the block (see the module)."""
    if not ENABLED or flushed() or not torch.set_flush_denormal(True):  # on, or unsupported
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


__all__ = ["SUBNORMAL_SLOW_DEVICES", "flushed", "flushing"]
