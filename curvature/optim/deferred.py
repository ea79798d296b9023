"""Device values an optimizer step does not read: they wait for a refresh or a counter.

On a GPU every read of a device value by the host (``bool``, ``float``, ``tolist``)
waits for the device. A step without a refresh reads nothing: the outcomes it would
branch on stay on the device (``torch.where`` selects) and are read later, together,
in the first host synchronization of the next refresh (or when the user reads
``skipped_statistics``):

- which parameters' updates were skipped as non-finite (one warning per optimizer, the
  steps counted in ``optim.skipped_updates``);
- the statistics' deferred checks (e.g. ignored targets with a mean CrossEntropy and
  the empirical Fisher), raised as ``ValueError``;
- the blocks that have had no finite statistics yet (``fresh`` flags).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..linalg import host_values
from ..warn import warn
from .statistics import StepStatistics
from .updates import skipped_message


class DeferredReads:
    """The skipped-update flags of the steps since the last read, and their reading.

    Attributes:
        who: The optimizer's name for messages.
        updates: ``(parameter names, ok [K], step, counted)`` per step, ``ok`` a device
            bool; ``counted`` is ``False`` for entries merged from several steps, whose
            skipped steps are counted in ``merged_bad`` (a device count) instead.
        skipped_steps: Steps whose update was skipped for some parameter, as read so far.

    """

    def __init__(self, who: str):
        self.who = who
        self.updates: List[Tuple[Tuple[str, ...], Tensor, int, bool]] = []
        self.merged_bad: Optional[Tensor] = None
        self.skipped_steps = 0
        self.warned = False

    def record_update(self, names: Tuple[str, ...], ok: Tensor, step: int) -> None:
        """Keep one step's flags (merged on the device after many steps without a read)."""
        self.updates.append((names, ok, step, True))
        if len(self.updates) > 64:
            merged: Dict[Tuple[str, ...], List[Tensor]] = {}
            for key, flags, _, counted in self.updates:
                merged.setdefault(key, []).append(flags)
                if counted:
                    bad = (~flags).any().to(torch.int64)
                    self.merged_bad = bad if self.merged_bad is None else self.merged_bad + bad
            self.updates = [(k, torch.stack(v).all(0), step, False) for k, v in merged.items()]

    def read_updates(self) -> int:
        """Read and settle the update flags now (one synchronization); the skipped steps."""
        self.settle_updates(host_values(self.update_tensors()))
        return self.skipped_steps

    def update_tensors(self) -> List[Tensor]:
        """The update flags to read, then the merged count (if any)."""
        extra = [] if self.merged_bad is None else [self.merged_bad]
        return [ok for _, ok, _, _ in self.updates] + extra

    def tensors(self, stats: StepStatistics) -> List[Tensor]:
        """The values to read: the statistics' checks, then :meth:`update_tensors`."""
        return list(stats.failed.values()) + self.update_tensors()

    def settle(self, stats: StepStatistics, values: Sequence[Any]) -> None:
        """Warn about skipped updates, then raise a failed check (values of :meth:`tensors`)."""
        n = len(stats.failed)
        self.settle_updates(values[n:])
        stats.raise_failed(values[:n])

    def settle_updates(self, values: Sequence[Any]) -> None:
        """Count the steps with a skipped update; warn at the first (values of the flags)."""
        entries, self.updates = self.updates, []
        steps = int(values[len(entries)]) if self.merged_bad is not None else 0
        self.merged_bad = None
        skipped: Dict[str, None] = {}
        total, last = 0, 0
        for (names, _, step, counted), flags in zip(entries, values):
            bad = [n for n, ok in zip(names, flags) if not ok]
            if bad:
                skipped.update(dict.fromkeys(bad))
                steps += int(counted)
                total, last = max(total, len(names)), max(last, step)
        self.skipped_steps += steps
        if skipped and not self.warned:
            self.warned = True  # one warning per optimizer; later ones are counted
            warn(skipped_message(self.who, list(skipped), total, steps, last))


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
