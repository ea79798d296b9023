"""Device values an optimizer step does not read: they wait for a refresh or a counter.

On a GPU every read of a device value by the host (``bool``, ``float``, ``tolist``)
waits for the device. A step without a refresh reads nothing: the outcomes it would
branch on stay on the device (``torch.where`` selects) and are read later, together,
in the first host synchronization of the next refresh (or when the user reads
``skipped_statistics``):

- which parameters' updates were skipped as non-finite (one warning per parameter);
- the statistics' deferred checks (e.g. ignored targets with a mean CrossEntropy and
  the empirical Fisher), raised as ``ValueError``;
- the blocks that have had no finite statistics yet (``fresh`` flags).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..warn import warn
from .statistics import StepStatistics


class DeferredReads:
    """The skipped-update flags of the steps since the last read, and their reading.

    Attributes:
        who: The optimizer's name for messages.
        updates: ``(parameter names, ok [K])`` per step, ``ok`` a device bool.

    """

    def __init__(self, who: str):
        self.who = who
        self.updates: List[Tuple[Tuple[str, ...], Tensor]] = []

    def record_update(self, names: Tuple[str, ...], ok: Tensor) -> None:
        """Keep one step's flags (merged on the device after many steps without a read)."""
        self.updates.append((names, ok))
        if len(self.updates) > 64:
            merged: Dict[Tuple[str, ...], List[Tensor]] = {}
            for key, flags in self.updates:
                merged.setdefault(key, []).append(flags)
            self.updates = [(k, torch.stack(v).all(0)) for k, v in merged.items()]

    def tensors(self, stats: StepStatistics) -> List[Tensor]:
        """The values to read: the statistics' checks, then the update flags."""
        return list(stats.failed.values()) + [ok for _, ok in self.updates]

    def settle(self, stats: StepStatistics, values: Sequence[Any]) -> None:
        """Warn about skipped updates, then raise a failed check (values of :meth:`tensors`)."""
        n = len(stats.failed)
        self.settle_updates(values[n:])
        stats.raise_failed(values[:n])

    def settle_updates(self, values: Sequence[Any]) -> None:
        """One warning per parameter whose update was skipped (values of the flags)."""
        oks, self.updates = self.updates, []
        skipped = sorted(
            {n for (names, _), flags in zip(oks, values) for n, ok in zip(names, flags) if not ok}
        )
        for name in skipped:
            warn(f"{self.who}: non-finite update for '{name}' skipped (NaN/inf gradients?).")


def waiting_flags(blocks: Sequence[Any]) -> Tuple[List[Tuple[Any, List[Tensor]]], List[Tensor]]:
    """The blocks with device flags to read (``block.flags()``), and those flags in order."""
    waiting = [(b, getattr(b, "flags", list)()) for b in blocks]
    waiting = [(b, f) for b, f in waiting if f]
    return waiting, [f for _, flags in waiting for f in flags]


def read_flags(waiting: Sequence[Tuple[Any, List[Tensor]]], values: Sequence[Any]) -> None:
    """Hand each block of :func:`waiting_flags` the host values of its flags."""
    at = 0
    for block, flags in waiting:
        block.read_flags(list(values[at : at + len(flags)]))
        at += len(flags)


def has_statistics(block: Any) -> bool:
    """Whether ``block`` has had finite statistics (reads its flag if still unknown)."""
    return getattr(block, "has_statistics", lambda: True)()
