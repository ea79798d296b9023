"""Work over many tensors in a few calls (a few kernel launches on a GPU, whatever their count).

:func:`finite_flags` judges each tensor of a list as finite or not with one
``torch._foreach_norm`` of order 2 (the root sum of squares of each tensor), one ``stack``
and one ``lt(inf)`` (:func:`finite_norms`: the norms themselves), on the device and
without a host synchronization. The norm is NaN for a tensor with a NaN, ``inf`` for one
with an infinite entry or whose sum of squares overflows, and finite otherwise. Torch sums
the squares in float32 for float32 and half-precision tensors (measured on CPU), so a
float32 tensor whose root sum of squares exceeds about ``1.8e19`` counts as non-finite
although its entries are finite (float64: beyond about ``1.3e154``): for the curvature
optimizers that skips statistics or an update far beyond anything a training run survives
(see docs/optimizers.md).
(Order 2 runs at the speed of a plain sum on CPU and in torch's fused
multi-tensor kernel on CUDA; order 1, the sum of magnitudes, which overflows only near
the dtype's largest value, is about 3.5x slower on CPU, and the largest magnitude about
15x.)
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

INF = float("inf")


def in_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` itself where its dtype is ``dtype``, else ``t.to(dtype)``: ``Tensor.to``
    returns ``t`` then too, but through a dispatcher call (host time on every per-block
    call of a step).
    """
    return t if t.dtype == dtype else t.to(dtype)


def finite_norms(tensors: Sequence[Tensor]) -> Tensor:
    """``[n]`` the root sum of squares of each tensor (NaN or ``inf`` where one is not
    finite, or its sum of squares overflows: see the module docstring), on the device.

    One ``torch._foreach_norm`` and one ``stack`` (``below inf`` of the result is
    :func:`finite_flags` of the tensors); an empty tensor's norm is 0.
    """
    tensors = list(tensors)
    if all(t.numel() for t in tensors):
        return torch.stack(torch._foreach_norm(tensors, 2))
    return torch.stack([t.norm() for t in tensors])  # (_foreach_norm refuses some empty ones)


def finite_flags(tensors: Sequence[Tensor], group: int = 1) -> Tensor:
    """``[n / group]`` device bool: whether every entry of each group of tensors is finite.

    Args:
        tensors: ``n >= 1`` tensors on one device (any shapes and floating dtypes; an
            empty tensor counts as finite), in consecutive groups of ``group``.
        group: How many consecutive tensors make one judged item (the values of one
            contribution): their norms are combined with
            ``torch._foreach_maximum`` (which keeps a NaN), ``group - 1`` calls.

    Returns:
        A bool tensor on the tensors' device, without reading anything on the host.

    """
    tensors = list(tensors)
    if group == 1 and all(t.numel() for t in tensors):
        return finite_norms(tensors).lt(INF)
    if all(t.numel() for t in tensors):
        sums = torch._foreach_norm(tensors, 2)
        items = sums[0::group]
        for r in range(1, group):
            items = torch._foreach_maximum(items, sums[r::group])
        # (a norm is >= 0 or NaN: below inf iff finite, in one call)
        return torch.stack(items).lt(INF)
    # judged apart (a rare case; _foreach_norm refuses some empty tensors)
    flags = torch.stack([torch.isfinite(t).all() for t in tensors])
    return flags if group == 1 else flags.view(-1, group).all(1)


_SCALARS: Dict[Tuple[float, torch.dtype, torch.device], Tensor] = {}


def scalar(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d ``value`` in ``dtype`` on ``device`` (made once per value, never written).

    For ``torch.where`` and friends: a Python number there costs a ``scalar_tensor``
    call (and a host-to-device copy on a GPU) each time.
    """
    key = (value, dtype, device)
    if key not in _SCALARS:
        if len(_SCALARS) > 256:  # e.g. a schedule of weight decays: start over
            _SCALARS.clear()
        _SCALARS[key] = torch.full((), value, dtype=dtype, device=device)  # (no copy)
    return _SCALARS[key]


class FlatBuffer:
    """A persistent flat ``[P]`` buffer with views shaped like a list of tensors.

    Made once per (shapes, dtype, device) and reused by every later call with the same
    key: writing into it (``torch._foreach_copy_`` into :attr:`views`, an ``out=``
    argument into :attr:`flat`) costs no allocation, split or view per call. Its
    contents are only valid until the next write: the owner must not hand it out.
    """

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self.flat: Optional[Tensor] = None
        self.views: List[Tensor] = []

    def get(
        self, shapes: Sequence[torch.Size], dtype: torch.dtype, device: torch.device
    ) -> Tuple[Tensor, List[Tensor]]:
        """``(flat [P], views)``: the buffer and its views of ``shapes`` (in order)."""
        key = (tuple(tuple(s) for s in shapes), dtype, device)
        if key != self._key or self.flat is None:
            sizes = [math.prod(s) for s in key[0]]
            self.flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            self.views = [v.view(s) for v, s in zip(self.flat.split(sizes), key[0])]
            self._key = key
        return self.flat, self.views


def copy_into(views: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """``views[i].copy_(sources[i])`` for all ``i`` in one call where torch has it."""
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(list(views), list(sources))
    else:  # torch < 2.1
        for v, s in zip(views, sources):
            v.copy_(s)
