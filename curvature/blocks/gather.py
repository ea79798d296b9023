"""Preconditioning many blocks with persistent gather/scatter buffers.

The blocks of an optimizer cover disjoint flat positions of the gradient ``g [P]``
(``index`` of each block). Instead of a gather, a reshape, the product and a scatter per
block, :class:`BlockGather` gathers every block's entries with one ``index_select`` into a
persistent buffer, hands each block views of it (``[C, D_out, D]``, and ``[D_out, D]`` for
one group) and a view of a persistent output buffer that the block writes into
(``out=`` of its GEMMs), and scatters the output with one ``index_copy_``: the per-step
aten calls (kernel launches on a GPU) are the blocks' own products plus three.
The buffers are built once per set of blocks, device and dtype.

On a CPU an ``index_select`` over every parameter costs several times a copy (one index
read per entry, scattered reads). Where every block's positions are a few affine pieces
of the flat vector (a Linear or convolution block ``[W | b]``: the weight's rows and the
bias column), the gather and the scatter are instead one ``torch._foreach_copy_`` each,
between strided views of the vector and of the buffers (:func:`affine_pieces`): the same
entries, the same number of aten calls. On a GPU the single ``index_select`` stays (a
strided multi-tensor copy there is a kernel per piece).
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..foreach import copy_into


class AllBlocks:
    """A job for every block at once: ``fn(views, extra_views)`` with the lists of all
    blocks' :class:`BlockViews` and ``extra`` views (multi-tensor calls over the blocks
    instead of a few calls per block). Pass it as the only job of
    :meth:`BlockGather.apply`; without ``extra`` it gets ``None`` for the extra views.
    """

    def __init__(self, fn: Callable[[List[BlockViews], Optional[List[Tensor]]], None]):
        self.fn = fn

    def __call__(self, views: List[BlockViews], extras: Optional[List[Tensor]]) -> None:
        """Run the job on all blocks' views."""
        self.fn(views, extras)


class BlockViews(NamedTuple):
    """A block's views of the gathered input ``M`` and of its output ``out``.

    Attributes:
        M: ``index.shape`` view of the gathered entries (e.g. ``[C, D_out, D]``).
        out: The same shape; the block writes its result here.
        M2: ``M[0]`` when ``M`` has 3 dimensions and one group (``C = 1``), else ``None``.
        out2: ``out[0]`` likewise.

    """

    M: Tensor
    out: Tensor
    M2: Optional[Tensor]
    out2: Optional[Tensor]


def inverse_into(block: Any, views: BlockViews, damping: Any, mode: str) -> None:
    """``views.out = (block + damping)^{-1} views.M``, by the block's ``inverse_matvec_into``
    where it has one (GEMMs writing into the output), else by ``inverse_matvec`` and a copy.
    """
    into = getattr(block, "inverse_matvec_into", None)
    if into is not None:
        into(views, damping, mode)
    else:
        views.out.copy_(block.inverse_matvec(views.M, damping, mode))


#: At most this many affine pieces per block for the strided copies (else ``index_select``).
MAX_PIECES = 4


class Piece(NamedTuple):
    """Columns ``[start, stop)`` of a block index ``[C, D_out, D]`` that are affine:
    ``index[c, o, start + j] = offset + c strides[0] + o strides[1] + j strides[2]``.
    """

    start: int
    stop: int
    offset: int
    strides: Tuple[int, int, int]


def affine_pieces(index: Tensor, limit: int = MAX_PIECES) -> Optional[List[Piece]]:
    """The block index ``[C, D_out, D]`` as at most ``limit`` affine column pieces.

    Columns are taken left to right, each piece as wide as its entries stay affine in
    ``(c, o, j)`` with non-negative strides (the form of an ``as_strided`` view). Host
    reads: made once per plan, never in a step.

    Returns:
        The pieces, or ``None`` when the index needs more (or is not 3-D).

    """
    if index.dim() != 3 or index.numel() == 0:
        return None
    ix = index.detach().to("cpu", torch.int64)
    C, D_out, D = ix.shape
    pieces: List[Piece] = []
    start = 0
    while start < D:
        if len(pieces) == limit:
            return None
        base = int(ix[0, 0, start])
        sc = int(ix[1, 0, start]) - base if C > 1 else 0
        so = int(ix[0, 1, start]) - base if D_out > 1 else 0
        sj = int(ix[0, 0, start + 1]) - base if start + 1 < D else 1
        if min(sc, so, sj) < 0:
            return None
        grid = (
            base
            + sc * torch.arange(C).view(C, 1, 1)
            + so * torch.arange(D_out).view(1, D_out, 1)
            + sj * torch.arange(D - start).view(1, 1, -1)
        )
        same = (ix[:, :, start:] == grid).all(0).all(0)  # [D - start]: columns that fit
        width = int(same.long().cumprod(0).sum())
        if width == 0:
            return None
        if width == 1:
            sj = 1  # (a one-column piece: any stride along j)
        pieces.append(Piece(start, start + width, base, (sc, so, sj)))
        start += width
    return pieces


class PieceViews:
    """The ``as_strided`` views of a flat vector for every piece of every block, made
    again only when :meth:`of` gets another tensor than the last (a persistent buffer's
    views are made once).
    """

    def __init__(self, pieces: Sequence[Sequence[Piece]], shapes: Sequence[Sequence[int]]):
        self.pieces, self.shapes = list(pieces), list(shapes)
        self._last: Tuple[Optional[Tensor], List[Tensor]] = (None, [])

    def of(self, flat: Tensor) -> List[Tensor]:
        """The views of ``flat`` (contiguous ``[P]``), in the order of the pieces."""
        if self._last[0] is not flat:
            views = []
            for block, shape in zip(self.pieces, self.shapes):
                for p in block:
                    size = (shape[0], shape[1], p.stop - p.start)
                    offset = flat.storage_offset() + p.offset
                    views.append(flat.as_strided(size, p.strides, offset))
            self._last = (flat, views)
        return self._last[1]


class _Plan:
    """The buffers and views of one set of blocks on one device, in one dtype."""

    def __init__(self, indices: Sequence[Tensor], like: Tensor):
        self.indices = list(indices)  # kept: identity checks on reuse
        self.total = sum(ix.numel() for ix in indices)
        #: whether the blocks cover every position of the flat vector
        self.covers = self.total == like.numel()
        self.inputs = like.new_empty(self.total)
        self.outputs = like.new_empty(self.total)
        self.extra: Optional[Tensor] = None  # made at the first call with ``extra``
        self.extra_source: Optional[Tensor] = None  # the vector ``extra`` holds entries of
        self.views: List[BlockViews] = []
        self.extra_views: List[Tensor] = []
        self.shapes = [ix.shape for ix in indices]
        #: the blocks' affine pieces where a CPU plan can copy instead of index (see the
        #: module docstring); the strided views of the last vector and output are cached
        pieces = [affine_pieces(ix) for ix in indices] if like.device.type == "cpu" else []
        self.pieces = pieces if pieces and all(p is not None for p in pieces) else None
        #: the concatenated index and, where the blocks cover every position, the order
        #: back to the flat layout: as large as the parameters, so made only where used
        #: (without pieces; with them only the index, for ``extra``)
        self._index: Optional[Tensor] = None
        self.back: Optional[Tensor] = None
        if self.pieces is None:
            self._make_index(back=self.covers)
        if self.pieces is not None:  # views of the gathered vector and of the result
            self.source_views = PieceViews(self.pieces, self.shapes)
            self.target_views = PieceViews(self.pieces, self.shapes)
        self.piece_inputs: List[Tensor] = []
        self.piece_outputs: List[Tensor] = []
        start = 0
        for ix in indices:
            stop = start + ix.numel()
            M = self.inputs[start:stop].view(ix.shape)
            out = self.outputs[start:stop].view(ix.shape)
            one = M.dim() == 3 and M.shape[0] == 1
            self.views.append(BlockViews(M, out, M[0] if one else None, out[0] if one else None))
            start = stop
        if self.pieces is not None:
            for v, block in zip(self.views, self.pieces):
                self.piece_inputs += [v.M[:, :, p.start : p.stop] for p in block]
                self.piece_outputs += [v.out[:, :, p.start : p.stop] for p in block]

    def _make_index(self, back: bool) -> None:
        flat = [ix.reshape(-1) for ix in self.indices]
        index = torch.cat(flat) if len(flat) > 1 else flat[0]
        if back:  # every position covered: gathered back by ``back``, never index_copy_
            self.back = torch.argsort(index)
            if index.numel() < 2**31:  # (index_copy_ takes int64 only)
                # 32-bit positions: the index vectors are as large as the parameters (the
                # index of a single block is a view of the block's own: kept as it is)
                self.back = self.back.int()
                index = index.int() if len(flat) > 1 else index
        self._index = index

    @property
    def index(self) -> Tensor:
        """The blocks' flat positions, concatenated (made at the first use)."""
        if self._index is None:
            self._make_index(back=False)
        return self._index

    def fits(self, indices: Sequence[Tensor], like: Tensor) -> bool:
        return (
            len(indices) == len(self.indices)
            and all(a is b for a, b in zip(indices, self.indices))
            and self.inputs.dtype == like.dtype
            and self.inputs.device == like.device
            and self.covers == (self.total == like.numel())
        )


class BlockGather:
    """Gathers the blocks' entries of a flat vector at once and scatters their results.

    Example::

        gather = BlockGather()
        out = gather.apply(g, [ix1, ix2], [f1, f2])  # f(views) writes views.out

    The blocks' ``indices`` must be disjoint (each flat position in at most one block,
    as the blocks of an optimizer are); positions in no block keep ``g``'s value.
    """

    def __init__(self) -> None:
        self._plan: Optional[_Plan] = None

    def _get(self, indices: Sequence[Tensor], like: Tensor) -> _Plan:
        if self._plan is None or not self._plan.fits(indices, like):
            self._plan = _Plan(indices, like)
        return self._plan

    def apply(
        self,
        flat: Tensor,
        indices: Sequence[Tensor],
        jobs: Sequence[Callable[..., None]],
        extra: Optional[Tensor] = None,
        out: Optional[Tensor] = None,
    ) -> Tensor:
        """``flat`` with each block's entries replaced by its job's output.

        Args:
            flat: ``[P]`` the vector (e.g. the gradient).
            indices: The blocks' flat positions (on ``flat``'s device), one per job.
            jobs: ``job(views)`` (or ``job(views, extra_view)`` with ``extra``) writes the
                block's result into ``views.out`` (:class:`BlockViews`); or, with
                ``extra``, one :class:`AllBlocks` for all of them.
            extra: ``[P]`` a second vector gathered alike (e.g. a per-position damping),
                passed to the jobs as a view shaped like their index; gathered again only
                when a different tensor is passed (it must not change in place).
            out: ``[P]`` where to write the result (e.g. a persistent buffer: no
                allocation); a new tensor without it.

        Returns:
            ``out``, or a new ``[P]`` tensor.

        """
        if out is not None and (
            out.dtype != flat.dtype or out.shape != flat.shape or not out.is_contiguous()
        ):
            out = None
        flat = flat if flat.is_contiguous() else flat.contiguous()  # (the strided views)
        if not jobs:
            return flat.clone() if out is None else out.copy_(flat)
        plan = self._get(indices, flat)
        # the products in the vector's dtype even where step() runs under autocast (the
        # GEMMs write into ``out=`` buffers of that dtype)
        with torch.autocast(flat.device.type, enabled=False):
            self._run(plan, flat, jobs, extra)
        if plan.pieces is not None:  # strided copies back (CPU)
            if out is None:
                out = torch.empty_like(flat) if plan.covers else flat.clone()
            elif not plan.covers:
                out.copy_(flat)
            copy_into(plan.target_views.of(out), plan.piece_outputs)
            return out
        if plan.back is not None:  # every position is in a block: one gather back
            if out is None:
                return plan.outputs.index_select(0, plan.back)
            return torch.index_select(plan.outputs, 0, plan.back, out=out)
        out = flat.clone() if out is None else out.copy_(flat)
        return out.index_copy_(0, plan.index, plan.outputs)

    @staticmethod
    def _run(plan: _Plan, flat: Tensor, jobs: Sequence[Callable[..., None]], extra) -> None:
        if plan.pieces is not None:
            copy_into(plan.piece_inputs, plan.source_views.of(flat))
        else:
            torch.index_select(flat, 0, plan.index, out=plan.inputs)
        if extra is not None:
            if plan.extra is None:
                plan.extra = flat.new_empty(plan.total)
                plan.extra_views = [
                    e.view(s)
                    for e, s in zip(plan.extra.split([s.numel() for s in plan.shapes]), plan.shapes)
                ]
            if plan.extra_source is not extra:  # gathered again only when it changes
                torch.index_select(extra.to(flat.dtype), 0, plan.index, out=plan.extra)
                plan.extra_source = extra
            if len(jobs) == 1 and isinstance(jobs[0], AllBlocks):  # one job for all blocks
                jobs[0](plan.views, plan.extra_views)
                return
            for job, views, e in zip(jobs, plan.views, plan.extra_views):
                job(views, e)
        elif len(jobs) == 1 and isinstance(jobs[0], AllBlocks):  # one job, no extra vector
            jobs[0](plan.views, None)
        else:
            for job, views in zip(jobs, plan.views):
                job(views)


__all__: List[str] = [
    "AllBlocks",
    "BlockGather",
    "BlockViews",
    "Piece",
    "PieceViews",
    "affine_pieces",
    "inverse_into",
]
