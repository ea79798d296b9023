"""Checks over many tensors in a few calls (a few kernel launches on a GPU, whatever their count).

:func:`finite_flags` judges each tensor of a list as finite or not with one
``torch._foreach_norm`` (the largest magnitude of each tensor), one ``stack`` and one
``isfinite``, on the device and without a host synchronization. The largest magnitude is
NaN for a tensor with a NaN, ``inf`` for one with an infinite entry and finite
otherwise: unlike a sum, it cannot overflow for finite entries.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
from torch import Tensor

INF = float("inf")


def finite_flags(tensors: Sequence[Tensor]) -> Tensor:
    """``[n]`` device bool: whether every entry of ``tensors[i]`` is finite.

    Args:
        tensors: ``n >= 1`` tensors on one device (any shapes and floating dtypes; an
            empty tensor counts as finite).

    Returns:
        A bool tensor on the tensors' device, without reading anything on the host.

    """
    if all(t.numel() for t in tensors):
        # (a largest magnitude is >= 0 or NaN: below inf iff finite, in one call)
        return torch.stack(torch._foreach_norm(list(tensors), INF)).lt(INF)
    # an empty tensor has no largest magnitude: judged apart (a rare case)
    return torch.stack([torch.isfinite(t).all() for t in tensors])


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
