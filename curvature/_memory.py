"""Allocation of large result buffers.

Freshly allocated CPU memory is paid for by one page fault per 4 KiB page on first
write, which makes writing a new per-sample gradient tensor several times slower than
computing it. :func:`empty_large` asks the kernel for transparent huge pages (2 MiB) on
large CPU buffers (Linux ``madvise(MADV_HUGEPAGE)``), which removes most of that cost.
Anywhere else it is ``torch.empty``.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Optional, Sequence

import torch

_HUGE = 1 << 21
_MADV_HUGEPAGE = 14
_libc: Optional[ctypes.CDLL] = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _libc = None


def empty_large(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty(shape)``, backed by huge pages when large and on a Linux CPU."""
    t = torch.empty(tuple(shape), dtype=dtype, device=device)
    nbytes = t.numel() * t.element_size()
    if _libc is not None and t.device.type == "cpu" and nbytes >= 2 * _HUGE:
        ptr = t.data_ptr()
        start = (ptr + _HUGE - 1) & ~(_HUGE - 1)
        end = (ptr + nbytes) & ~(_HUGE - 1)
        if end > start:
            _libc.madvise(start, end - start, _MADV_HUGEPAGE)
    return t
