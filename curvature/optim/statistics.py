"""One step's curvature statistics: sums over the step's forwards, then normalized.

Between two ``step()`` calls every forward (gradient accumulation), and under
``torch.distributed`` every rank, contributes sums to the blocks it reaches; together
they count as one batch, their union:

- ``"A"`` values (symmetric, ``sum a a^T``) become means over their rows;
- ``"G"`` values (symmetric, ``sum g g^T``-like) and ``"g"`` values (not symmetric:
  EKFAC corrections, Fisher diagonals) become ``R(N) sum`` over the ``N`` samples of
  the union (``R(N) = 1/N`` for a mean loss, ``1`` for a sum); for the empirical Fisher
  (``c^2 sum g g^T`` of the user's gradients, ``c = W R(N)`` on ``W`` ranks)
  ``sum / (W^2 R(N))``.

A contribution's finiteness is judged on its own values, for all of a forward's
contributions in one host synchronization (:meth:`StepStatistics.flush`); non-finite
ones are skipped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from torch import Tensor

from ..linalg import finite_flags

#: Kinds of statistics values: ``"A"`` (symmetric; a sum of ``a a^T`` normalized by its
#: rows), ``"G"`` (symmetric; normalized per sample) and ``"g"`` (like ``"G"`` but not
#: symmetric: EKFAC corrections, Fisher diagonals).
STAT_KINDS = ("A", "G", "g")

#: ``(block name, suffix, term)``: the key of one block's statistics of one term.
StatKey = Tuple[str, str, int]


@dataclass(frozen=True)
class BatchContext:
    """How the G-like values of one forward's contributions are to be normalized.

    Attributes:
        samples: ``N``, the samples of this forward.
        reduction: ``"mean"`` or ``"sum"``: the loss the G-like values belong to.
        g_scale: A factor applied to the G-like values as they are added.
        empirical: The values are ``c^2 sum g g^T`` of the user's own gradients.

    """

    samples: int
    reduction: str = "mean"
    g_scale: float = 1.0
    empirical: bool = False


@dataclass
class StepStat:
    """The statistics sums of one block and term over the forwards of one step."""

    values: List[Optional[Tensor]]
    kinds: Tuple[str, ...]
    rows: float = 0.0
    samples: float = 0.0
    reduction: str = "mean"
    empirical: bool = False
    shapes: List[Optional[Tuple[int, ...]]] = field(default_factory=list)

    def merge(self, other: StepStat) -> StepStat:
        """Add ``other`` (same key; both global or both local) into this one."""
        self.values = [
            x if y is None else (y if x is None else x + y)
            for x, y in zip(self.values, other.values)
        ]
        self.shapes = [s if s is not None else t for s, t in zip(self.shapes, other.shapes)]
        self.rows += other.rows
        self.samples += other.samples
        return self


class StepStatistics:
    """The sums of one step, keyed by :data:`StatKey`.

    Attributes:
        slots: Key to :class:`StepStat`.
        skipped: Contributions skipped as non-finite so far (the optimizer's counter).

    """

    def __init__(self) -> None:
        self.slots: Dict[StatKey, StepStat] = {}
        self.skipped = 0
        self._queue: list = []
        self._checks: List[Tuple[Tensor, str]] = []

    def __bool__(self) -> bool:
        return bool(self.slots)

    def add(
        self,
        key: StatKey,
        values: Sequence[Optional[Tensor]],
        kinds: Sequence[str],
        context: BatchContext,
        rows: int = 0,
    ) -> None:
        """Queue one forward's sums for a block (judged and folded by :meth:`flush`).

        Args:
            key: ``(block name, suffix, term)``.
            values: Sums over this forward's rows / samples (``None``: absent).
            kinds: One of :data:`STAT_KINDS` per value.
            context: The forward's :class:`BatchContext`.
            rows: The rows of the ``"A"`` sums.

        """
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = StepStat(
                [None] * len(values),
                tuple(kinds),
                reduction=context.reduction,
                empirical=context.empirical,
                shapes=[None if v is None else tuple(v.shape) for v in values],
            )
        if context.g_scale != 1.0:
            values = [
                v if (v is None or k == "A") else v * context.g_scale for v, k in zip(values, kinds)
            ]
        self._queue.append((slot, list(values), rows, context.samples))

    def flush(self) -> None:
        """Fold the queued contributions into their slots, skipping non-finite ones.

        A sum is finite iff every entry is (barring float overflow): the sums of all
        queued values are checked in one reduction per device, so a forward costs one
        host synchronization on a GPU instead of one per block. A skipped contribution
        is counted in :attr:`skipped`; its slot stays (with zero counts) for the layout.
        """
        queue, self._queue = self._queue, []
        checks, self._checks = self._checks, []
        if not queue and not checks:
            return
        present = [[v for v in values if v is not None] for _, values, _, _ in queue]
        read = finite_flags([v for vs in present for v in vs], [flag for flag, _ in checks])
        failed = [msg for (_, msg), bad in zip(checks, read[len(read) - len(checks) :]) if bad]
        if failed:
            raise ValueError(failed[0])
        flags = iter(read[: len(read) - len(checks)])
        finite = [all([next(flags) for _ in vs]) for vs in present]  # consumes every flag
        for (slot, values, rows, N), ok in zip(queue, finite):
            if not ok:
                self.skipped += 1
                continue
            slot.values = [
                a if b is None else (b if a is None else a + b) for a, b in zip(slot.values, values)
            ]
            slot.shapes = [s if v is None else tuple(v.shape) for s, v in zip(slot.shapes, values)]
            slot.rows += rows
            slot.samples += N

    def require_false(self, flag: Tensor, message: str) -> None:
        """Raise ``ValueError(message)`` at the next flush if the 0-d ``flag`` is true.

        A check on the device read in the flush's one host synchronization.
        """
        self._checks.append((flag, message))

    def absorb(self, other: StepStatistics) -> None:
        """Add the (flushed) sums and skip count of ``other`` into this step's."""
        for key, st in other.slots.items():
            self.slots[key] = self.slots[key].merge(st) if key in self.slots else st
        self.skipped += other.skipped

    def drop_queue(self) -> None:
        """Forget contributions that were queued but not flushed (after an error)."""
        self._queue = []
        self._checks = []

    def take(self) -> Dict[StatKey, StepStat]:
        """The slots (this step's statistics), leaving this object empty."""
        slots, self.slots = self.slots, {}
        return slots


def normalize(
    stats: Dict[StatKey, StepStat], world: int, ordered: bool
) -> Dict[StatKey, List[Optional[Tensor]]]:
    """The step's statistics as means (see the module docstring).

    Args:
        stats: The (global) sums.
        world: ``W``, the number of ranks.
        ordered: Sort the keys (identical order on every rank).

    Returns:
        Key to the normalized values; blocks without any finite contribution are dropped.

    """
    out = {}
    for key in sorted(stats, key=repr) if ordered else list(stats):
        st = stats[key]
        if st.samples == 0 or all(v is None for v in st.values):
            continue
        R = 1.0 / st.samples if st.reduction == "mean" else 1.0
        g_norm = 1.0 / (world * world * R) if st.empirical else R
        out[key] = [
            None if v is None else (v / st.rows if k == "A" else v * g_norm)
            for v, k in zip(st.values, st.kinds)
        ]
    return out
