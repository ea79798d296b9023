"""Communication of the curvature optimizers over ``torch.distributed`` (the only module that does).

Data-parallel training runs one process per device, each with its own batch. The
optimizers keep the curvature identical on every rank by reducing, once per step:

- the **statistics** as ``(sum, count)`` pairs: sums of ``a a^T`` with their row counts,
  sums of ``g g^T`` (and of EKFAC's projected squares and of Fisher diagonals) with the
  number of samples, so that ranks with different batch sizes give exactly the mean
  over the union of their batches. Symmetric factors travel as upper triangles; all
  tensors of one dtype are packed into buckets of at most ``bucket_mb`` megabytes, one
  ``all_reduce`` per bucket, all launched before the first is awaited;
- the **gradients**, averaged like DDP does, when the model is not DDP-wrapped;
- the **decompositions** of the blocks a rank owns (``decompose="split"``): each rank
  writes its blocks into a zero buffer and one ``all_reduce`` (a sum in which every
  entry has exactly one non-zero term, hence exact) hands every rank every result;
- with ``precondition="owner"`` the preconditioned gradient of each block instead of
  its decomposition.

Ownership follows a cost model: blocks are sorted by the cost of their decompositions
(``groups * (D_A^3 + D_G^3)``) and each goes to the rank with the least work so far
(longest processing time first).

Every collective waits at most ``timeout`` seconds; a rank that raised, stopped, or
called ``step()`` a different number of times turns into a ``RuntimeError`` on the
others that says so, instead of a silent hang.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..blocks import Eigen, GeneralizedEigen, KroneckerSumBlock, Outcome, RefreshStatus
from ..foreach import FlatBuffer, copy_into
from .statistics import StepStat

try:  # pragma: no cover - torch builds without distributed support
    import torch.distributed as dist
except ImportError:  # pragma: no cover
    dist = None  # type: ignore[assignment]

#: Symmetric ``[..., D, D]`` statistics with at least this ``D`` travel as upper triangles.
TRIU_MIN_SIZE = 16


def is_ddp(model: nn.Module) -> bool:
    """Whether ``model`` is a ``DistributedDataParallel`` wrapper."""
    return isinstance(model, nn.parallel.DistributedDataParallel)


def check_not_sharded(model: nn.Module, name: str) -> None:
    """Refuse FSDP-wrapped models (sharded parameters) with a clear error."""
    sharded = type(model).__name__ == "FullyShardedDataParallel" or any(
        type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"
        for p in model.parameters()
    )
    if sharded:
        raise NotImplementedError(
            f"{name}: the model's parameters are sharded (FSDP / fully_shard); curvature "
            "optimizers support replicated data parallelism (DDP, or plain models under "
            "torch.distributed) for now. See docs/distributed.md for the FSDP2 plan."
        )


class Communicator:
    """The process group of a curvature optimizer and every collective it runs.

    Args:
        group: The process group (``None``: the default group).
        timeout: Seconds a collective may wait before it raises.
        bucket_mb: Largest bucket of one ``all_reduce``.
        name: The optimizer's name, for error messages.

    Attributes:
        rank: This process's rank in ``group``.
        world: The number of ranks.
        bytes: Bytes this rank sent into collectives, by purpose (``"statistics"``,
            ``"gradients"``, ``"decompositions"``, ``"directions"``, ``"control"``);
            the payload of each ``all_reduce`` (a ring all-reduce moves about twice that
            over the wire per rank).

    """

    def __init__(
        self, group: Any = None, timeout: float = 300.0, bucket_mb: float = 25.0, name: str = ""
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = datetime.timedelta(seconds=timeout)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.name = name
        self.step = 0
        self.bytes: Dict[str, int] = {}
        self._layout: Optional[Tuple[int, List[Any]]] = None

    @classmethod
    def create(
        cls,
        enabled: Optional[bool],
        group: Any,
        timeout: float,
        bucket_mb: float,
        name: str,
    ) -> Optional[Communicator]:
        """A communicator, or ``None`` for single-process training.

        ``enabled=None`` (auto): on when ``torch.distributed`` is initialized with more
        than one rank in ``group``.
        """
        available = dist is not None and dist.is_available() and dist.is_initialized()
        if enabled is None:
            enabled = available and dist.get_world_size(group) > 1
        if not enabled:
            return None
        if not available:
            raise ValueError(
                f"{name}(distributed=True): torch.distributed is not initialized; call "
                "torch.distributed.init_process_group first (e.g. under torchrun)."
            )
        return cls(group, timeout, bucket_mb, name)

    # -- collectives --------------------------------------------------------------------
    def _wait(self, works: Sequence[Any], what: str) -> None:
        for work in works:
            try:
                ok = work.wait(self.timeout)
            except Exception as err:  # noqa: BLE001 - every backend error means the same
                raise self._error(what, err) from err
            if ok is False:  # pragma: no cover - backends that report instead of raising
                raise self._error(what, "timed out")

    def _error(self, what: str, cause: Any) -> RuntimeError:
        return RuntimeError(
            f"{self.name}: the {what} collective of step {self.step} failed on rank "
            f"{self.rank} of {self.world} ({cause}). Another rank probably raised, stopped "
            f"or skipped optimizer.step(); every rank must call step() (and state-changing "
            f"methods) the same number of times. Timeout: {self.timeout.total_seconds():g} s."
        )

    def all_reduce(self, tensors: Sequence[Tensor], what: str, op: Any = None) -> None:
        """In-place sum (or ``op``) of ``tensors`` over the ranks, bucketed by dtype."""
        self.finish(self.start(tensors, what, op))

    def start(self, tensors: Sequence[Tensor], what: str, op: Any = None) -> List[Any]:
        """Launch the bucketed all-reduce of ``tensors``; :meth:`finish` completes it."""
        op = dist.ReduceOp.SUM if op is None else op
        by_dtype: Dict[Tuple[torch.dtype, torch.device], List[Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        pending = []
        for items in by_dtype.values():
            bucket: List[Tensor] = []
            size = 0
            for t in items + [None]:  # type: ignore[list-item]
                if t is not None and (not bucket or size + t.nbytes <= self.bucket_bytes):
                    bucket.append(t)
                    size += t.nbytes
                    continue
                if bucket:
                    flat = torch.cat([b.reshape(-1) for b in bucket])
                    self.bytes[what] = self.bytes.get(what, 0) + flat.nbytes
                    work = dist.all_reduce(flat, op=op, group=self.group, async_op=True)
                    pending.append((work, flat, bucket, what))
                bucket, size = ([t], t.nbytes) if t is not None else ([], 0)
        return pending

    def finish(self, pending: List[Any]) -> None:
        """Wait for :meth:`start`'s all-reduces and copy the results into the tensors."""
        for work, _, _, what in pending:
            self._wait([work], what)
        for _, flat, bucket, _ in pending:
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    def mean(self, value: float, what: str = "loss") -> float:
        """The mean of a scalar over the ranks (float64)."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        self.all_reduce([t], what)
        return float(t) / self.world

    @property
    def device(self) -> torch.device:
        """The device collectives of this group run on (NCCL: the current CUDA device)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def agree(self, signature: List[Tuple[Hashable, Any]]) -> List[Tuple[Hashable, Any]]:
        """The union over ranks of ``(key, spec)`` pairs, sorted by key, same on every rank.

        One small all-reduce checks that every rank has the layout it had last time
        (the common case); otherwise the ranks exchange their keys (``all_gather_object``)
        and merge them: a key that only some ranks have (a skipped non-finite batch, a
        branch not taken) is reduced with zeros from the others. For a key present on
        several ranks the first non-``None`` spec wins; specs must agree otherwise.
        """
        signature = sorted(signature, key=lambda kv: repr(kv[0]))
        digest = hashlib.sha1(repr(signature).encode()).digest()[:7]
        h = int.from_bytes(digest, "little")
        check = torch.tensor([h, -h], dtype=torch.int64, device=self.device)
        self.all_reduce([check], "control", op=dist.ReduceOp.MAX)
        same = int(check[0]) == h and int(check[1]) == -h
        if same and self._layout is not None and self._layout[0] == h:
            return self._layout[1]
        if same:
            layout = signature
        else:
            gathered: List[Any] = [None] * self.world
            try:
                dist.all_gather_object(gathered, signature, group=self.group)
            except Exception as err:  # noqa: BLE001
                raise self._error("layout exchange", err) from err
            merged: Dict[Hashable, Any] = {}
            for part in gathered:
                for key, spec in part:
                    merged[key] = _merge_spec(merged.get(key), spec, key, self.name)
            layout = sorted(merged.items(), key=lambda kv: repr(kv[0]))
        self._layout = (h, layout) if same else None
        return layout

    def owners(self, costs: Dict[Hashable, float]) -> Dict[Hashable, int]:
        """Assign each key to a rank: longest processing time first, least-loaded rank."""
        load = [0.0] * self.world
        owner: Dict[Hashable, int] = {}
        for key, cost in sorted(costs.items(), key=lambda kv: (-kv[1], repr(kv[0]))):
            r = min(range(self.world), key=lambda i: (load[i], i))
            owner[key] = r
            load[r] += cost
        return owner


def _merge_spec(a: Any, b: Any, key: Hashable, name: str) -> Any:
    if a is None:
        return b
    merged = []
    for x, y in zip(a, b):
        if x is None or y is None:
            merged.append(x if y is None else y)
        elif x != y:
            raise RuntimeError(
                f"{name}: ranks disagree on the statistics of {key!r} ({x} vs {y}); do all "
                "ranks run the same model?"
            )
        else:
            merged.append(x)
    return tuple(merged)


# -- symmetric packing ---------------------------------------------------------------------
_TRIU: Dict[Tuple[int, torch.device], Tuple[Tensor, Tensor]] = {}


def _triu(D: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """Linear positions of the upper triangle of a ``D x D`` matrix, and of its mirror."""
    key = (D, device)
    if key not in _TRIU:
        i, j = torch.triu_indices(D, D, device=device)
        _TRIU[key] = (i * D + j, j * D + i)
    return _TRIU[key]


def pack(t: Tensor, symmetric: bool) -> Tensor:
    """``t`` flattened; the upper triangle only for symmetric ``[..., D, D]`` with large D."""
    if symmetric and t.shape[-1] >= TRIU_MIN_SIZE:
        D = t.shape[-1]
        upper, _ = _triu(D, t.device)
        return t.reshape(-1, D * D).index_select(1, upper).reshape(-1)
    return t.reshape(-1)


def packed_numel(shape: Sequence[int], symmetric: bool) -> int:
    """The length of :func:`pack`'s result for a tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    if symmetric and shape[-1] >= TRIU_MIN_SIZE:
        D = shape[-1]
        return n // (D * D) * (D * (D + 1) // 2)
    return n


def unpack(flat: Tensor, shape: Sequence[int], symmetric: bool) -> Tensor:
    """The inverse of :func:`pack` (the lower triangle mirrored from the upper)."""
    if symmetric and shape[-1] >= TRIU_MIN_SIZE:
        D = shape[-1]
        upper, mirror = _triu(D, flat.device)
        rows = flat.view(-1, upper.numel())
        out = flat.new_empty(rows.shape[0], D * D)
        out.index_copy_(1, upper, rows)
        out.index_copy_(1, mirror, rows)
        return out.view(*shape)
    return flat.view(*shape).clone()


# -- the step's statistics -------------------------------------------------------------------
@dataclass
class PendingReduction:
    """A statistics all-reduce in flight (see :func:`start_statistics_reduction`)."""

    stats: Dict[Any, StepStat]
    layout: List[Tuple[Hashable, Any]]
    counts: Tensor
    flats: List[Tensor]
    plan: List[Tuple[StepStat, int, Any, bool, torch.device]]
    handle: Any


def start_statistics_reduction(
    comm: Communicator, stats: Dict[Any, StepStat], default_dtype: torch.dtype
) -> PendingReduction:
    """Agree on the layout, pack, and launch the all-reduce of a step's statistics.

    Keys that only some ranks have are reduced with zeros from the others; the
    ``(rows, samples)`` counts travel in one small float64 tensor.
    """
    signature = [
        (key, (st.kinds, st.reduction, st.empirical, *st.shapes)) for key, st in stats.items()
    ]
    layout = comm.agree(signature)
    ref = next((v for st in stats.values() for v in st.values if v is not None), None)
    dtype = ref.dtype if ref is not None else default_dtype
    device = comm.device
    counts_cpu = torch.zeros(len(layout), 2, dtype=torch.float64)  # one host copy
    flats: List[Tensor] = []
    plan = []
    for i, (key, spec) in enumerate(layout):
        kinds, reduction, empirical, *shapes = spec
        st = stats.get(key)
        if st is None:
            st = stats[key] = StepStat(
                [None] * len(kinds), kinds, reduction=reduction, empirical=empirical
            )
        st.shapes = list(shapes)
        counts_cpu[i, 0], counts_cpu[i, 1] = st.kept_counts()  # kept contributions only
        for j, (shape, kind) in enumerate(zip(shapes, kinds)):
            if shape is None:
                continue
            v = st.values[j]
            sym = kind in ("A", "G")
            if v is None:
                v = torch.zeros(shape, dtype=dtype, device=device)
            flats.append(pack(v.to(device), sym))
            plan.append((st, j, shape, sym, v.device))
    counts = counts_cpu.to(device)
    handle = comm.start([counts] + flats, "statistics")
    return PendingReduction(stats, layout, counts, flats, plan, handle)


def finish_statistics_reduction(
    comm: Communicator, pending: PendingReduction
) -> Dict[Any, StepStat]:
    """Wait for :func:`start_statistics_reduction` and unpack: the global statistics."""
    comm.finish(pending.handle)
    for (st, j, shape, sym, dev), flat in zip(pending.plan, pending.flats):
        st.values[j] = unpack(flat, shape, sym).to(dev)
    for (key, _), (rows, samples) in zip(pending.layout, pending.counts.tolist()):
        pending.stats[key].counts_reduced(rows, samples)
    return pending.stats


# -- decompositions ---------------------------------------------------------------------------
def share_outcomes(
    comm: Communicator,
    blocks: Dict[Hashable, Any],
    outcomes: Dict[Hashable, Outcome],
    owners: Dict[Hashable, int],
    with_records: bool,
    damping_of: Callable[[Hashable], float],
) -> Dict[Hashable, Outcome]:
    """Exchange the owners' refresh outcomes (one all-reduce of a zero-padded buffer).

    Every block of ``blocks`` (in this order on every rank) was refreshed on its owner
    only, and ``outcomes`` holds this rank's. Each rank writes the status code and, with
    ``with_records``, the records' tensors of its own blocks into zeros; the sum over
    ranks has each entry from exactly one rank. Without ``with_records``
    (``precondition="owner"``) only the statuses travel, and blocks owned elsewhere get
    an ``OK`` outcome without a record.
    """
    keys = list(blocks)
    codes = [outcomes[k].status.code if k in outcomes else 0.0 for k in keys]
    status = torch.tensor(codes, dtype=torch.float64).to(comm.device)
    buffers: List[Tensor] = [status]
    parts_of: Dict[Hashable, Tuple[List[Tensor], torch.device]] = {}
    for key in keys:
        if not with_records:
            continue
        A, G = _first_factors(blocks[key])
        shapes = [A.shape[:-1], A.shape, G.shape[:-1], G.shape]
        out = outcomes.get(key)
        ok = out is not None and out.status is RefreshStatus.OK
        tensors = out.record.tensors() if ok else [A.new_zeros(s) for s in shapes]
        parts = [t.to(A.dtype).to(comm.device).contiguous() for t in tensors]
        buffers += parts
        parts_of[key] = (parts, A.device)
    comm.all_reduce(buffers, "decompositions")
    shared: Dict[Hashable, Outcome] = {}
    for key, code in zip(keys, status.tolist()):
        if code == 1:
            if key in parts_of:
                parts, dev = parts_of[key]
                tensors = [p.to(dev) for p in parts]
                block = blocks[key]
                if isinstance(block, KroneckerSumBlock):
                    record = GeneralizedEigen.from_tensors(tensors, damping_of(key))
                else:
                    record = Eigen.from_tensors(tensors)
                shared[key] = Outcome(RefreshStatus.OK, record)
            else:
                shared[key] = outcomes.get(key, Outcome(RefreshStatus.OK))
        elif key in outcomes:
            shared[key] = outcomes[key]
        else:
            owner = owners.get(key, 0)
            status_ = RefreshStatus.KEPT if code == 2 else RefreshStatus.FAILED
            cause = f"the decomposition failed on rank {owner}, its owner"
            shared[key] = Outcome(status_, None, cause)
    return shared


def _first_factors(block: Any) -> Tuple[Tensor, Tensor]:
    if isinstance(block, KroneckerSumBlock):
        return tuple(block.terms[min(block.terms)])  # type: ignore[return-value]
    return block.A, block.G


def owned_mask(
    numel: int, index: Dict[Hashable, Tensor], mine: Sequence[Hashable], rank: int
) -> Tensor:
    """``[P]`` True where this rank preconditions with ``precondition='owner'``.

    Every block (flat positions ``index[key]``) belongs to its owner (``mine``: this
    rank's blocks); positions outside the blocks (diagonal blocks, plain gradients) to
    rank 0, so that the sum over ranks has each position exactly once.
    """
    mask = torch.zeros(numel, dtype=torch.bool)
    blocks = torch.zeros(numel, dtype=torch.bool)
    for ix in index.values():
        blocks[ix.reshape(-1)] = True
    for key in mine:
        mask[index[key].reshape(-1)] = True
    if rank == 0:
        mask |= ~blocks
    return mask


def flat_gradients(
    layout: Any, comm: Optional[Communicator], buffer: Optional[FlatBuffer] = None
) -> Optional[Tensor]:
    """The parameters' gradients as one flat ``[P]`` vector, averaged over ``comm``'s ranks.

    With ``buffer`` the vector is that persistent buffer (valid until the next call) where
    every parameter has a dense gradient on one device.

    Sparse gradients (``nn.Embedding(sparse=True)``) are densified. With ``comm`` (a plain
    model under ``torch.distributed``: data parallelism without DDP) the average is
    written back into ``.grad``; a parameter unused here but used on another rank gets
    a ``.grad``. ``None`` when no parameter has a gradient (and no rank must join).
    """
    params = layout.params
    ref = next((p.grad for p in params if p.grad is not None), None)
    if ref is None and comm is not None:  # every rank must join the all-reduce
        ref = next(iter(params), None)
    if ref is None:
        return None
    dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
    grads = [p.grad for p in params]
    if all(g is not None and not g.is_sparse and g.device == ref.device for g in grads):
        if buffer is not None:  # one copy into the persistent buffer, one call
            flat, views = buffer.get([p.shape for p in params], dtype, ref.device)
            copy_into(views, grads)
        else:
            flat = torch.cat(  # one copy (layout order)
                [(g if g.dim() == 1 else g.reshape(-1)).to(dtype) for g in grads]
            )
    else:
        flat = torch.zeros(layout.numel, dtype=dtype, device=ref.device)
        for n, p in zip(layout.names, params):
            if p.grad is not None:
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                flat[layout.span(n)] = grad.reshape(-1)
    if comm is not None:
        comm.all_reduce([flat], "gradients")
        flat /= comm.world
        for n, p in zip(layout.names, params):
            g = flat[layout.span(n)].view_as(p).to(p.dtype)
            if p.grad is not None and not p.grad.is_sparse:
                p.grad.copy_(g)
            elif p.grad is not None or g.any():  # unused here, used on another rank
                p.grad = g.clone()
    return flat
