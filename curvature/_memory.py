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
import weakref
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


# -- a cache of result buffers that the user has dropped ------------------------------------
#: Smallest buffer (bytes) that goes through the cache; smaller ones are cheap to allocate.
POOL_MIN_BYTES = 1 << 20


class ResultPool:
    """Reuses the memory of large CPU results once every tensor using it has died.

    Per-sample gradients are handed to the user as new tensors. Allocating them afresh on
    every step pays one page fault per 4 KiB page (the allocator returns large blocks to
    the operating system when they are freed), often more than computing them. This pool
    keeps the memory of a result after the user dropped it and hands it out again on the
    next step, like PyTorch's CUDA caching allocator:

    * a block is reused only after **every** tensor viewing it is gone: the result is a
      :func:`torch.frombuffer` view of a ``memoryview`` that only the tensor's storage
      holds, and a weak reference to that ``memoryview`` puts the block back into the
      pool when the storage dies; a result the user keeps (or any view of it) is never
      overwritten;
    * free blocks not reused during one whole call are released (:meth:`new_call`), so
      the pool never holds more than the results of the previous call, and never more
      than ``max_bytes`` (1 GiB) of free memory; :meth:`release` empties it at once.

    Only CPU buffers of at least :data:`POOL_MIN_BYTES` go through the pool.
    """

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.enabled = True
        self.max_bytes = max_bytes  # free memory kept at most; the rest is freed
        self._free: dict = {}  # nbytes -> [(memoryview of the block, generation freed)]
        self._generation = 0

    def new_call(self) -> None:
        """Start a call: drop the free blocks that the previous call did not reuse."""
        self._generation += 1
        keep = self._generation - 1
        for nbytes in list(self._free):
            blocks = [b for b in self._free.get(nbytes, ()) if b[1] >= keep]
            if blocks:
                self._free[nbytes] = blocks
            else:
                self._free.pop(nbytes, None)

    def release(self) -> None:
        """Free every cached block now."""
        self._free.clear()

    @property
    def cached_bytes(self) -> int:
        """Bytes held by free blocks."""
        return sum(n * len(blocks) for n, blocks in list(self._free.items()))

    def _put_back(self, nbytes: int, block: memoryview) -> None:
        if self.enabled and self.cached_bytes + nbytes <= self.max_bytes:
            # list.append is atomic: safe from any thread's callback
            self._free.setdefault(nbytes, []).append((block, self._generation))

    def empty(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized contiguous tensor, from the pool where possible."""
        shape = tuple(shape)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        if (
            not self.enabled
            or torch.device(device).type != "cpu"
            or nbytes < max(POOL_MIN_BYTES, 1)
            or _np is None
        ):
            return empty_large(shape, dtype, device)
        blocks = self._free.get(nbytes)
        try:
            block = blocks.pop()[0] if blocks else None
        except IndexError:  # emptied by another thread meanwhile
            block = None
        if block is None:
            # the memory and a memoryview of it (which holds it) for the block's lifetime
            block = memoryview(empty_large((nbytes,), torch.uint8, torch.device("cpu")).numpy())
        proxy = block[:]  # a new view object: only the result's storage will hold it
        _proxies[id(proxy)] = weakref.ref(proxy, _returner(self, nbytes, block, id(proxy)))
        return torch.frombuffer(proxy, dtype=dtype, count=numel).view(shape)


def _returner(pool: ResultPool, nbytes: int, block: memoryview, key: int):
    def callback(_ref) -> None:
        _proxies.pop(key, None)
        pool._put_back(nbytes, block)

    return callback


_proxies: dict = {}  # keeps the weak references (and so their callbacks) alive
try:
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is a dependency
    _np = None

#: The pool used for the results of :meth:`curvature.Capture.per_sample_grads`.
POOL = ResultPool()


def result_empty(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized buffer for a result handed to the user (see :class:`ResultPool`)."""
    return POOL.empty(shape, dtype, device)
