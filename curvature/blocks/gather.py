"""Preconditioning many blocks with persistent gather/scatter buffers.

The blocks of an optimizer cover disjoint flat positions of the gradient ``g [P]``
(``index`` of each block). Instead of a gather, a reshape, the product and a scatter per
block, :class:`BlockGather` gathers every block's entries with one ``index_select`` into a
persistent buffer, hands each block views of it (``[C, D_out, D]``, and ``[D_out, D]`` for
one group) and a view of a persistent output buffer that the block writes into
(``out=`` of its GEMMs), and scatters the output with one ``index_copy_``: the per-step
aten calls (kernel launches on a GPU) are the blocks' own products plus three.
The buffers are built once per set of blocks, device and dtype.
"""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor


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


class _Plan:
    """The buffers and views of one set of blocks on one device, in one dtype."""

    def __init__(self, indices: Sequence[Tensor], like: Tensor):
        self.indices = list(indices)  # kept: identity checks on reuse
        flat = [ix.reshape(-1) for ix in indices]
        self.index = torch.cat(flat) if len(flat) > 1 else flat[0]
        self.inputs = like.new_empty(self.index.numel())
        self.outputs = like.new_empty(self.index.numel())
        self.extra: Optional[Tensor] = None  # made at the first call with ``extra``
        self.extra_source: Optional[Tensor] = None  # the vector ``extra`` holds entries of
        #: where the blocks cover every position: the order back to the flat layout
        self.back = torch.argsort(self.index) if self.index.numel() == like.numel() else None
        if self.back is not None and like.numel() < 2**31:  # (index_copy_ takes int64 only)
            # 32-bit positions: the index vectors are as large as the parameters (the
            # index of a single block is a view of the block's own: kept as it is)
            self.back = self.back.int()
            self.index = self.index.int() if len(flat) > 1 else self.index
        self.views: List[BlockViews] = []
        self.extra_views: List[Tensor] = []
        self.shapes = [ix.shape for ix in indices]
        start = 0
        for ix in indices:
            stop = start + ix.numel()
            M = self.inputs[start:stop].view(ix.shape)
            out = self.outputs[start:stop].view(ix.shape)
            one = M.dim() == 3 and M.shape[0] == 1
            self.views.append(BlockViews(M, out, M[0] if one else None, out[0] if one else None))
            start = stop

    def fits(self, indices: Sequence[Tensor], like: Tensor) -> bool:
        return (
            len(indices) == len(self.indices)
            and all(a is b for a, b in zip(indices, self.indices))
            and self.inputs.dtype == like.dtype
            and self.inputs.device == like.device
            and (self.back is None) == (self.index.numel() != like.numel())
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
        if out is not None and (out.dtype != flat.dtype or out.shape != flat.shape):
            out = None
        if not jobs:
            return flat.clone() if out is None else out.copy_(flat)
        plan = self._get(indices, flat)
        # the products in the vector's dtype even where step() runs under autocast (the
        # GEMMs write into ``out=`` buffers of that dtype)
        with torch.autocast(flat.device.type, enabled=False):
            self._run(plan, flat, jobs, extra)
        if plan.back is not None:  # every position is in a block: one gather back
            if out is None:
                return plan.outputs.index_select(0, plan.back)
            return torch.index_select(plan.outputs, 0, plan.back, out=out)
        out = flat.clone() if out is None else out.copy_(flat)
        return out.index_copy_(0, plan.index, plan.outputs)

    @staticmethod
    def _run(plan: _Plan, flat: Tensor, jobs: Sequence[Callable[..., None]], extra) -> None:
        torch.index_select(flat, 0, plan.index, out=plan.inputs)
        if extra is not None:
            if plan.extra is None:
                plan.extra = flat.new_empty(plan.index.numel())
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


__all__: List[str] = ["AllBlocks", "BlockGather", "BlockViews", "inverse_into"]
