"""Fresh pages per step on a CPU: glibc's mmap threshold raised once.

glibc's ``malloc`` serves a request of at least its *mmap threshold* with a fresh
``mmap`` and returns it to the kernel when freed, so the next request of that size
faults every page in again (about 0.25 us per 4 KiB page, plus zeroing by the kernel).
The threshold starts at 128 KiB and rises to the size of an mmapped block when one is
freed, but a request of the same size as the freed block is mmapped again. A KFAC step
allocates its statistics anew every step (a 785 x 785 input factor's Gram matrix is 2.5
MB): a KFAC step of a 784-256-10 MLP at batch 256 in a loop of its own (one thread)
faulted 440-1,369 pages in per step against Adam's 13, and took 12.8-13.9 ms at the
minimum against 10.8-11.7 ms with this module (separate processes, 2026-11-27;
docs/stack.md, "On a CPU"). That MLP no longer re-faults without it since its statistic
is zeroed in place instead of copied every step (0.2 faults per step); a small CNN's
patches still do in most processes (up to 5,400 against 0.15-392 faults per step across
processes, whose heap layouts differ: tests/test_cpu_heap.py counts them).

:func:`raise_mmap_threshold` allocates and frees one block just below glibc's largest
dynamic threshold (32 MiB on 64-bit), once per process, when a curvature optimizer is
built on a CPU model: glibc then serves blocks of up to about 31 MiB from its heap and
keeps up to twice that free at the top of it instead of returning it to the kernel (the
same state any program reaches after freeing one such tensor; larger blocks are still
mmapped). Nothing changes on other C libraries (the block is allocated and freed,
nothing else) or for GPU memory. ``ENABLED = False`` leaves the process as it is.
"""

from __future__ import annotations

import torch

#: Switch for measurements (``False``: no block allocated).
ENABLED = True

#: The block's size: under glibc's ``DEFAULT_MMAP_THRESHOLD_MAX`` (32 MiB on 64-bit)
#: with room for its chunk header and the allocator's alignment.
BLOCK_BYTES = 31 * 2**20

_DONE = [False]


def raise_mmap_threshold() -> bool:
    """Allocate and free one :data:`BLOCK_BYTES` block on the CPU (once per process).

    Returns:
        Whether the block was allocated by this call (``False``: done before, or
        disabled).

    """
    if _DONE[0] or not ENABLED:
        return False
    _DONE[0] = True
    block = torch.empty(BLOCK_BYTES, dtype=torch.uint8)  # (its pages are never touched)
    del block
    return True


__all__ = ["BLOCK_BYTES", "ENABLED", "raise_mmap_threshold"]
