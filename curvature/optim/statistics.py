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

A contribution's finiteness is judged on its own values, on the device and without a
host synchronization (:meth:`StepStatistics.flush`): a non-finite one is replaced by
zeros (``torch.where``), left out of the counts and counted in a device tensor that is
read only when asked (:attr:`StepStatistics.skipped`). Each block's statistics carry a
device flag ``valid`` (some contribution was kept), which the running estimates use to
skip a step's update without reading it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..foreach import finite_flags, scalar
from ..linalg import host_values

#: Kinds of statistics values: ``"A"`` (symmetric; a sum of ``a a^T`` normalized by its
#: rows), ``"G"`` (symmetric; normalized per sample) and ``"g"`` (like ``"G"`` but not
#: symmetric: EKFAC corrections, Fisher diagonals).
STAT_KINDS = ("A", "G", "g")

#: Device types whose statistics flush zeroes a skipped contribution's values in place by
#: one product with the 0/1 flags and a ``nan_to_num_`` each (elsewhere: ``masked_fill_``
#: on the negated flags, one call per value).
PRODUCT_ZEROING_DEVICES = ("cpu",)

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
    #: ``(kept, rows, samples)`` per contribution, ``kept`` a 0-d device bool: ``rows``
    #: and ``samples`` above count every contribution, kept or not (host numbers).
    parts: List[Tuple[Tensor, float, float]] = field(default_factory=list)

    def merge(self, other: StepStat) -> StepStat:
        """Add ``other`` (same key; both global or both local) into this one."""
        self.values = [
            x if y is None else (y if x is None else x + y)
            for x, y in zip(self.values, other.values)
        ]
        self.shapes = [s if s is not None else t for s, t in zip(self.shapes, other.shapes)]
        self.rows += other.rows
        self.samples += other.samples
        self.parts = self.parts + other.parts
        return self

    def valid(self) -> Optional[Tensor]:
        """0-d device bool: some contribution was kept (``None``: known on the host)."""
        if not self.parts:
            return None
        if len(self.parts) == 1:
            return self.parts[0][0]
        return torch.stack([ok for ok, _, _ in self.parts]).any()

    def kept_counts(self) -> Tuple[object, object]:
        """``(rows, samples)`` of the kept contributions (0-d tensors where flags exist)."""
        if not self.parts:
            return self.rows, self.samples
        rows = sum(ok * r for ok, r, _ in self.parts)
        samples = sum(ok * n for ok, _, n in self.parts)
        return rows, samples

    def counts_reduced(self, rows: float, samples: float) -> None:
        """The global kept counts after an all-reduce: everything known on the host."""
        self.rows, self.samples, self.parts = rows, samples, []


class Normalized(NamedTuple):
    """A block's normalized statistics and its 0-d ``valid`` flag (``None``: valid)."""

    values: List[Optional[Tensor]]
    valid: Optional[Tensor]


class StepStatistics:
    """The sums of one step, keyed by :data:`StatKey`.

    Attributes:
        slots: Key to :class:`StepStat`.
        failed: Message to a 0-d device bool: checks of :meth:`require_false` that
            failed (or not) since they were last read by :meth:`raise_failed`.

    """

    def __init__(self) -> None:
        self.slots: Dict[StatKey, StepStat] = {}
        #: message to the flags of its checks since the last read (OR-ed when read)
        self._failed: Dict[str, List[Tensor]] = {}
        self._queue: list = []
        self._scaled: List[Tuple[list, int, float]] = []  # (values, position, g_scale)
        self._checks: List[Tuple[Tensor, str]] = []
        self._skipped: List[Tensor] = []  # device bools "kept" per contribution, read lazily
        self._skipped_host = 0

    @property
    def skipped(self) -> int:
        """Contributions skipped as non-finite so far (one host synchronization to read)."""
        if self._skipped:
            kept = host_values(self._skipped)
            self._skipped_host += sum(len(k) - sum(k) if isinstance(k, list) else -k for k in kept)
            self._skipped = []
        return int(self._skipped_host)

    @skipped.setter
    def skipped(self, value: int) -> None:
        self._skipped, self._skipped_host = [], int(value)

    def skip_records(self) -> Tuple[List[Tensor], int]:
        """The unread device records of :attr:`skipped` and the count already read."""
        return list(self._skipped), self._skipped_host

    def _count_skipped(self, kept: Tensor) -> None:
        """Keep ``kept [K]`` (device bools) to count later; summed on the device now and then."""
        self._skipped.append(kept)
        if len(self._skipped) > 64:  # a 0-d entry holds minus a skip count
            counts = [k.numel() - k.sum() if k.dim() else -k for k in self._skipped]
            self._skipped = [-torch.stack([c.to(counts[0].device) for c in counts]).sum()]

    def __bool__(self) -> bool:
        return bool(self.slots)

    def add(
        self,
        key: StatKey,
        values: Sequence[Optional[Tensor]],
        kinds: Sequence[str],
        context: BatchContext,
        rows: int = 0,
        owned: bool = False,
    ) -> None:
        """Queue one forward's sums for a block (judged and folded by :meth:`flush`).

        Args:
            key: ``(block name, suffix, term)``.
            values: Sums over this forward's rows / samples (``None``: absent).
            kinds: One of :data:`STAT_KINDS` per value.
            context: The forward's :class:`BatchContext`.
            rows: The rows of the ``"A"`` sums.
            owned: The values are new tensors that nothing else refers to (e.g. the
                products of a built-in layer rule): :meth:`flush` may zero them in
                place, instead of selecting into a new tensor (a pass and an
                allocation of each factor's size fewer).

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
        values = list(values)
        if context.g_scale != 1.0:  # scaled at the flush, all at once
            for i, (v, k) in enumerate(zip(values, kinds)):
                if v is not None and k != "A":
                    self._scaled.append((values, i, context.g_scale))
        self._queue.append((slot, values, rows, context.samples, owned))

    def flush(self) -> None:
        """Fold the queued contributions into their slots, skipping non-finite ones.

        A contribution is finite iff each of its values is (:func:`finite_flags`: the
        norms of all values at once, judged on the device; a value whose sum of squares
        overflows counts as non-finite, see :mod:`curvature.foreach`): a non-finite
        one is replaced by zeros, flagged in its slot's ``parts`` and counted in
        :attr:`skipped`, all without a host synchronization. A failed
        :meth:`require_false` check skips every queued contribution and is kept in
        :attr:`failed` for the caller to raise later.
        """
        queue, self._queue = self._queue, []
        scaled, self._scaled = self._scaled, []
        if scaled:  # the G-like values times their g_scale, one call (the same values)
            products = torch._foreach_mul([vs[i] for vs, i, _ in scaled], [c for *_, c in scaled])
            for (vs, i, _), v in zip(scaled, products):
                vs[i] = v
        checks, self._checks = self._checks, []
        if not queue and not checks:
            return
        present = [v for _, values, *_ in queue for v in values if v is not None]
        flags: Dict[torch.device, Tensor] = {}  # a device's values: finite or not
        by_device: Dict[torch.device, List[int]] = {}
        for i, v in enumerate(present):
            by_device.setdefault(v.device, []).append(i)
        where: Dict[int, Tuple[torch.device, int]] = {}
        for dev, idx in by_device.items():
            for j, i in enumerate(idx):
                where[i] = (dev, j)
        uniform = _uniform_counts(queue, where)
        for dev, idx in by_device.items():  # three calls per device (+ one per value kind)
            flags[dev] = finite_flags([present[i] for i in idx], uniform.get(dev, 1))
        bad: Optional[Tensor] = None
        for flag, msg in checks:
            self._fail(msg, flag)
            bad = flag if bad is None else bad | flag
        if bad is not None:  # a failed check: every contribution is skipped
            flags = {dev: f > bad.to(dev) for dev, f in flags.items()}  # f and not bad
        i = 0
        skipped: Dict[torch.device, List[Tensor]] = {}
        # the devices whose contributions all have the same number of values have one
        # flag per contribution (else one per value)
        slot_flags = {dev: iter(flags[dev].unbind(0)) for dev in uniform}
        # owned values (appearing once) are zeroed in place, the others selected into new
        # tensors. On a CPU by one product with the 0/1 flags for all owned values and a
        # nan_to_num_ each (a CPU's masked_fill_ or where with a 0-d mask costs 2.3x to 8x
        # those two passes: 510 against 221 us on a 785 x 785 factor, one thread; a where
        # 3.6 ms on a 1152 x 1152 one). On a GPU, where a contribution holds two or more of
        # them (Kronecker factors), by masked_fill_ on the negated flags (two calls per
        # flush, then one per value); else by a where into the value itself
        seen: Dict[int, int] = {}
        for v in present:
            seen[id(v)] = seen.get(id(v), 0) + 1
        several = any(e[-1] and sum(v is not None for v in e[1]) > 1 for e in queue)
        slot_bad = {  # (GPU: masked_fill_ on the negated flags)
            dev: iter(flags[dev].logical_not().unbind(0))
            for dev in (uniform if several else ())
            if dev.type not in PRODUCT_ZEROING_DEVICES
        }
        products: Tuple[List[Tensor], List[Tensor]] = ([], [])  # zeroed after the loop
        folds = []
        for slot, values, rows, N, owned in queue:
            n = sum(v is not None for v in values)
            if n == 0:
                continue
            dev, j = where[i]
            i += n
            bad = None
            if dev in slot_flags:  # judged per contribution at once
                ok = next(slot_flags[dev])
                bad = next(slot_bad[dev]) if dev in slot_bad else None
            else:
                ok = flags[dev][j] if n == 1 else flags[dev][j : j + n].all()
                skipped.setdefault(dev, []).append(ok)
            kept = []
            for v in values:
                mine = v is not None and owned and seen[id(v)] == 1 and v._base is None
                if mine and dev.type in PRODUCT_ZEROING_DEVICES:  # a CPU: after the loop
                    products[0].append(v)
                    products[1].append(ok)
                    kept.append(v)
                else:
                    kept.append(None if v is None else _zeroed(v, ok, bad, mine))
            folds.append((slot, values, kept, rows, N, ok))
        if products[0]:  # v * ok (NaN or inf where v had one and ok is false), then 0 there
            torch._foreach_mul_(*products)
            for v in products[0]:
                v.nan_to_num_(0.0, 0.0, 0.0)
        for slot, values, kept, rows, N, ok in folds:  # (after the zeroing above)
            slot.values = [
                a if b is None else (b if a is None else a + b) for a, b in zip(slot.values, kept)
            ]
            slot.shapes = [s if v is None else tuple(v.shape) for s, v in zip(slot.shapes, values)]
            slot.rows += rows
            slot.samples += N
            slot.parts.append((ok, rows, N))
        for oks in skipped.values():
            self._count_skipped(torch.stack(oks))
        for dev in slot_flags:
            self._count_skipped(flags[dev])

    def require_false(self, flag: Tensor, message: str) -> None:
        """A check on the device: if the 0-d ``flag`` is true, the next flush skips its
        contributions and keeps ``message`` in :attr:`failed` (raised by
        :meth:`raise_failed` where the caller reads its flags).
        """
        self._checks.append((flag, message))

    def raise_failed(self, values: Sequence[bool]) -> None:
        """Raise ``ValueError`` for the first true flag of :attr:`failed` (read as ``values``)."""
        messages = list(self._failed)
        self._failed = {}
        for msg, bad in zip(messages, values):
            if bad:
                raise ValueError(msg)

    def absorb(self, other: StepStatistics) -> None:
        """Add the (flushed) sums and skip count of ``other`` into this step's."""
        for key, st in other.slots.items():
            self.slots[key] = self.slots[key].merge(st) if key in self.slots else st
        unread, read = other.skip_records()
        for kept in unread:
            self._count_skipped(kept)
        self._skipped_host += read
        for msg, flag in other.failed.items():
            self._fail(msg, flag)

    @property
    def failed(self) -> Dict[str, Tensor]:
        """Message to a 0-d device bool: one of its checks failed since :meth:`raise_failed`.

        The flags of the flushes are OR-ed here (and every 64 flushes), not in every one.
        """
        for flags in self._failed.values():
            if len(flags) > 1:
                flags[:] = [torch.stack(flags).any()]
        return {msg: flags[0] for msg, flags in self._failed.items()}

    def _fail(self, msg: str, flag: Tensor) -> None:
        """Keep the flag of a check (OR-ed with the earlier ones when read, or every 64)."""
        flags = self._failed.setdefault(msg, [])
        flags.append(flag)
        if len(flags) >= 64:
            flags[:] = [torch.stack(flags).any()]

    def scale_empirical(self, factor: Tensor) -> None:
        """Multiply the flushed ``G``-like sums of the empirical slots by the 0-d ``factor``
        (on the device; ``A`` sums, which hold no gradients, stay).
        """
        places = [
            (st, i)
            for st in self.slots.values()
            if st.empirical
            for i, (v, k) in enumerate(zip(st.values, st.kinds))
            if v is not None and k != "A"
        ]
        groups: Dict[Tuple[torch.device, torch.dtype], List[Tuple[StepStat, int]]] = {}
        for st, i in places:
            v = st.values[i]
            groups.setdefault((v.device, v.dtype), []).append((st, i))
        for (dev, dtype), where in groups.items():
            products = torch._foreach_mul([st.values[i] for st, i in where], factor.to(dev, dtype))
            for (st, i), v in zip(where, products):
                st.values[i] = v

    def drop_queue(self) -> None:
        """Forget contributions that were queued but not flushed (after an error)."""
        self._queue = []
        self._scaled = []
        self._checks = []

    def take(self) -> Dict[StatKey, StepStat]:
        """The slots (this step's statistics), leaving this object empty."""
        slots, self.slots = self.slots, {}
        return slots


def _zeroed(v: Tensor, ok: Tensor, bad: Optional[Tensor], owned: bool) -> Tensor:
    """``v`` if ``ok`` (0-d device bool) else zeros: in place where ``v`` is ``owned`` (a
    tensor of its own, not a view, that nothing else refers to; by ``masked_fill_`` on
    ``bad``, the negated flag, where given), else a new tensor.
    """
    zero = scalar(0.0, v.dtype, v.device)
    if not owned:
        return torch.where(ok, v, zero)
    if bad is not None:
        return v.masked_fill_(bad, 0.0)
    return torch.where(ok, v, zero, out=v)


def _uniform_counts(queue: list, where: dict) -> Dict[torch.device, int]:
    """Device to the number of values of each of its contributions, for the devices whose
    contributions all have the same number (judged per contribution in a few calls).
    """
    counts: Dict[torch.device, set] = {}
    i = 0
    for _, values, *_ in queue:
        n = sum(v is not None for v in values)
        if n:
            counts.setdefault(where[i][0], set()).add(n)
            i += n
    return {dev: next(iter(ns)) for dev, ns in counts.items() if len(ns) == 1}


def normalize(
    stats: Dict[StatKey, StepStat], world: int, ordered: bool
) -> Dict[StatKey, Normalized]:
    """The step's statistics as means (see the module docstring).

    Args:
        stats: The (global) sums.
        world: ``W``, the number of ranks.
        ordered: Sort the keys (identical order on every rank).

    Returns:
        Key to the normalized values and their ``valid`` flag (a block whose every
        contribution was skipped has zeros and ``valid`` false, read by nobody: the
        running estimates select on it); blocks without contributions are dropped.

    """
    out = {}
    # (value, factor, (key, position)): ``A`` values times ``1 / rows`` (a product: a
    # division costs twice as much on a CPU), the G-like ones times ``g_norm``: one call
    scale: Tuple[list, list, list] = ([], [], [])
    fixes = []
    for key in sorted(stats, key=repr) if ordered else list(stats):
        st = stats[key]
        if st.samples == 0 or all(v is None for v in st.values):
            continue
        R = 1.0 / st.samples if st.reduction == "mean" else 1.0
        g_norm = 1.0 / (world * world * R) if st.empirical else R
        row_fix = sample_fix = None
        if len(st.parts) > 1:  # several contributions: the means run over the kept ones
            kept_rows, kept_samples = st.kept_counts()
            row_fix = st.rows / kept_rows.clamp_min(1)  # exactly 1 when all were kept
            if st.reduction == "mean":
                sample_fix = st.samples / kept_samples.clamp_min(1)
                if st.empirical:
                    sample_fix = 1 / sample_fix
        values: List[Optional[Tensor]] = [None] * len(st.values)
        for i, (v, k) in enumerate(zip(st.values, st.kinds)):
            if v is not None:
                factor = (1.0 / st.rows if st.rows else math.inf) if k == "A" else g_norm
                for pending, x in zip(scale, (v, factor, (key, i))):
                    pending.append(x)
                fix = row_fix if k == "A" else sample_fix
                if fix is not None:
                    fixes.append((key, i, fix))
        out[key] = Normalized(values, st.valid())
    # v / rows and v * g_norm for all values at once, in place: the sums are this step's
    # own (flush made them, or they are the library's new tensors of this step, judged
    # in place), so no second copy of every factor is alive at once
    vs, numbers, where = scale
    if vs:
        torch._foreach_mul_(vs, numbers)
    for (key, i), v in zip(where, vs):
        out[key].values[i] = v
    for key, i, fix in fixes:
        v = out[key].values[i]
        out[key].values[i] = v.mul_(fix.to(v.dtype))
    return out


def stat_dtype(t: Tensor) -> torch.dtype:
    """The statistics dtype for a value computed in ``t.dtype``: float64 or float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def promote(t: Tensor) -> Tensor:
    """Statistics never accumulate in half precision."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
