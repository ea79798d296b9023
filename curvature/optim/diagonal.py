"""``DiagonalNaturalGradient``: preconditioning with a running Fisher diagonal.

The cheap member of the family, for models (or layers) whose Kronecker factors are too
large: the update direction is ``g / (d + lambda)`` with ``d`` the running diagonal of
the chosen Fisher, ``d = sum_{k,n} grad_nk^2`` from the per-sample (per-vector)
gradients of the collected backward: the diagonal empirical Fisher (``"empirical"``),
its Monte-Carlo estimate (``"mc"``), or the exact GGN diagonal (``"type-2"``). It is
computed per layer by :func:`curvature.layer_stats.fisher_diagonal`, without
materializing per-sample gradients where the layer allows (``(g^2)^T (a^2)`` for Linear
layers without weight sharing); each layer is one :class:`~curvature.blocks.DiagonalBlock`.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..blocks import AllBlocks, DiagonalBlock
from ..blocks.gather import PieceViews, affine_pieces
from ..foreach import copy_into
from ..layer_stats import fisher_diagonal, layer_positions
from ..layers.plain import SquaredInputs
from ..layers.registry import library_method
from ..layout import put, take
from ..linalg import host_values
from ..options import FisherType, KFACApproxType
from .base import CurvatureOptimizer
from .checkpoint import check_diagonal_state
from .config import CurvatureConfig
from .deferred import read_flags, waiting_flags
from .statistics import stat_dtype


class DiagonalNaturalGradient(CurvatureOptimizer):
    """Natural gradient with a diagonal Fisher; the arguments of :class:`~curvature.KFAC`.

    ``kfac_approx``, ``inverse_every``, ``inverse_warmup`` and ``damping_mode`` have no
    effect on the diagonal (a refresh only reads the steps' deferred device values);
    ``fisher="forward-only"`` is refused (it has no diagonal).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        *,
        fisher: Union[str, FisherType] = "empirical",
        loss_func: Optional[nn.Module] = None,
        mc_samples: int = 1,
        kfac_approx: Union[str, KFACApproxType] = "expand",
        factor_decay: float = 0.95,
        factor_every: int = 1,
        inverse_every: int = 10,
        kl_clip: Optional[float] = None,
        damping_mode: str = "pi",
        unsupported: str = "warn",
        auto_output: bool = True,
        seed: int = 0,
        param_groups: Optional[Sequence[Dict[str, Any]]] = None,
        grad_scaler: Any = None,
        adaptive_damping: bool = False,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: float = 0.95,
        line_search_grid: Optional[Sequence[float]] = None,
        distributed: Optional[bool] = None,
        process_group: Any = None,
        sync_grads: Optional[bool] = None,
        comm_timeout: float = 300.0,
        bucket_mb: float = 25.0,
        inverse_warmup: int = 0,
    ):
        if fisher == FisherType.FORWARD_ONLY:
            raise ValueError(
                "DiagonalNaturalGradient(fisher='forward-only'): a forward-only Fisher has "
                "no diagonal; use 'empirical', 'mc', 'type-2' or 'rademacher'."
            )
        self._diagonals: Dict[str, DiagonalBlock] = {}
        #: per layer, the persistent squared inputs of its Fisher diagonal (Linear layers)
        self._squares: Dict[str, SquaredInputs] = {}
        #: the running diagonals of the preconditioned blocks, in their order, as views of
        #: one flat buffer (:meth:`_flat_diagonal`)
        self._flat_d: Optional[Tensor] = None
        self._flat_views: List[Tensor] = []
        #: where every position is in a block: ``flat_d[order]`` is the diagonal in the
        #: parameters' flat layout (``[P]`` positions, int32 below 2**31 entries)
        self._order: Optional[Tensor] = None
        #: (CPU) the same order as strided copies: the source views of the flat
        #: diagonals and the (cached) views of the output, per affine piece of each block
        self._pieces: Optional[Tuple[List[Tensor], PieceViews]] = None
        self._warned_missing = False
        config = CurvatureConfig.from_arguments(type(self).__name__, locals())
        super().__init__(model, lr, damping, momentum, weight_decay, config, param_groups)

    @property
    def diagonal_(self) -> Dict[str, Tensor]:
        """Layer name to its running diagonal ``d`` (flat, the layer's positions)."""
        return {k: b.d for k, b in self._diagonals.items()}

    @property
    def blocks(self) -> Dict[str, DiagonalBlock]:
        """Layer name to its :class:`~curvature.blocks.DiagonalBlock`."""
        return dict(self._diagonals)

    def _covered_names(self) -> List[str]:
        covered = set()
        for name, (module, _) in self._layers.items():
            prefix = f"{name}." if name else ""
            covered.update(prefix + n for n, p in module.named_parameters() if p.requires_grad)
        return [n for n in self.layout.names if n in covered]

    #: The suffix of every statistics key: one diagonal per layer (or group of tied layers).
    diagonal_suffix = "diag"
    #: Tied layers: the exact diagonal of the summed gradients (one block per group).
    _tied_diagonal = True
    _per_sample_statistics = True

    def _reset_curvature(self) -> None:
        self._diagonals = {}

    def _accumulate(self, name, module, rule, calls, with_g, emit) -> None:
        squares = self._squares.setdefault(name, SquaredInputs())
        kron, parts = fisher_diagonal(rule, module, calls, squares)  # convolutions: direct
        if len(parts) == 1:  # as it is (e.g. [1, D_out, D]): the block keeps that shape
            (d,) = parts.values()
        else:
            d = torch.cat([v.reshape(-1) for v in parts.values()])
        if name not in self._diagonals:
            if kron:
                index = rule.kfac_index(module, self.layout.local_offsets(name))
                if len(parts) == 1:  # its [C, D_out, D] shape kept (the CPU's copies)
                    ix = index[next(iter(parts))]
                else:
                    ix = torch.cat([index[s].reshape(-1) for s in parts])
            else:  # named_parameters order, the rule's parameters
                ix = layer_positions(self.layout, name, module, rule)
            self._diagonals[name] = DiagonalBlock(name, ix)
        # new tensors of this step (zeroed in place if not finite), unless a rule of
        # one's own returned its direct diagonal as it is
        owned = library_method(rule, "direct_diagonal")
        emit((name, self.diagonal_suffix), [d.to(stat_dtype(d))], ("g",), 0, owned)

    def _update_curvature(self, stats) -> None:
        for (name, _, _), (values, valid) in stats.items():
            if name not in self._diagonals:  # a group of tied layers
                self._diagonals[name] = DiagonalBlock(name, self._tied.index(name))
            self._diagonals[name].update(values[0], self.config.factor_decay, valid)

    def _refresh(self) -> None:
        """No decompositions: the deferred device flags are read (one synchronization)."""
        deferred = self._reads.tensors(self._collector.stats)
        waiting, flags = waiting_flags(list(self._diagonals.values()))
        if not deferred and not flags:
            return
        read = host_values(deferred + flags)
        read_flags(waiting, read[len(deferred) :])
        self._reads.settle(self._collector.stats, read[: len(deferred)])

    def _precondition(self, grads: Tensor, out: Optional[Tensor] = None) -> Tensor:
        have = {n for n, b in self._diagonals.items() if b.d is not None}
        self._warn_missing([(n, "") for n in self._layers if n not in have])
        blocks = [b for b in self._diagonals.values() if b.d is not None]
        flat = self._flat_diagonal(blocks, grads)
        dampings = {g["damping"] for g in self.param_groups}
        damping = dampings.pop() if len(dampings) == 1 else self._damping_vector(grads)
        if flat is not None and self._order is not None:  # every position in a block
            return self._divide_in_layout(blocks, flat, grads, damping, out)
        # else (positions in no block, or diagonals in another dtype): gathered and
        # scattered at once, the divisions in three multi-tensor calls
        indices = [self._ix(b.index, grads.device) for b in blocks]
        if not isinstance(damping, Tensor):  # one number: no [P] damping vector to gather
            job = partial(_inverse_all, blocks, damping=damping)
            jobs = [AllBlocks(job)] if blocks else []
            return self._gather.apply(grads, indices, jobs, out=out)
        jobs = [AllBlocks(partial(_inverse_all, blocks))] if blocks else []
        return self._gather.apply(grads, indices, jobs, extra=damping, out=out)

    def _divide_in_layout(
        self,
        blocks: List[DiagonalBlock],
        flat: Tensor,
        grads: Tensor,
        damping,
        out: Optional[Tensor] = None,
    ) -> Tensor:
        """``g / (d + lambda)`` over the flat layout where the blocks cover every position.

        The running diagonals (block after block in ``flat``) are put in the layout's
        order with one ``index_select`` through the persistent order (:attr:`_order`),
        the damping added and ``g`` divided in place: three calls and one ``[P]`` tensor
        (the result), no gather of ``g`` and no scatter back. Blocks without finite
        statistics yet (:attr:`DiagonalBlock.fresh`, until a refresh reads the flags)
        keep ``g`` (a select over their positions, made only then).
        """
        if out is not None and (out.dtype != flat.dtype or out.device != flat.device):
            out = None  # (a model moved or cast after the statistics: a new tensor)
        if self._pieces is not None:  # (CPU) strided copies, as BlockGather's
            sources, targets = self._pieces
            out = torch.empty_like(flat) if out is None else out
            copy_into(targets.of(out), sources)
        else:
            out = torch.index_select(flat, 0, self._order, out=out)
        out.add_(damping)
        torch.div(grads, out, out=out)
        fresh = [b.fresh for b in blocks]
        if any(f is not None for f in fresh):
            no = torch.zeros((), dtype=torch.bool, device=grads.device)
            # (on the device: no host-to-device copy of the block sizes)
            keep = torch.cat(
                [(no if f is None else f).expand(b.d.numel()) for f, b in zip(fresh, blocks)]
            )
            torch.where(keep.index_select(0, self._order), grads, out, out=out)
        return out

    def _flat_diagonal(self, blocks: List[DiagonalBlock], like: Tensor) -> Optional[Tensor]:
        """``[P_1 + ... + P_B]``: the blocks' running diagonals, block after block, as one
        tensor whose pieces they are (views: updated in place with them).

        Where the blocks cover every position it is put in the layout's order with one
        ``index_select`` (on a CPU, where every block is a few affine pieces, one strided
        multi-tensor copy: :func:`_layout_pieces`) (:meth:`_divide_in_layout`: ``v / (d +
        lambda)`` of every block in three calls, without the gather buffers of
        :class:`~curvature.blocks.BlockGather`). Made
        once (one copy per block) when the blocks' diagonals are not yet its pieces (the
        first step, a new block, a loaded state); ``None`` when the diagonals are not all
        in ``like``'s dtype and on its device (the multi-tensor path then).
        """
        ds = [b.d for b in blocks]
        if len(ds) == len(self._flat_views) and all(a is b for a, b in zip(ds, self._flat_views)):
            return self._flat_d
        self._flat_d, self._flat_views, self._order = None, [], None
        self._pieces = None
        if not ds or any(d.dtype != like.dtype or d.device != like.device for d in ds):
            return None
        flat = like.new_empty(sum(d.numel() for d in ds))
        for b, piece in zip(blocks, flat.split([d.numel() for d in ds])):
            b.rebase(piece)
        self._flat_d, self._flat_views = flat, [b.d for b in blocks]
        if flat.numel() == like.numel():  # (disjoint blocks) every position: a permutation
            order = torch.argsort(torch.cat([self._ix(b.index, like.device) for b in blocks]))
            self._order = order.int() if like.numel() < 2**31 else order
            if like.device.type == "cpu":
                self._pieces = _layout_pieces(blocks, flat)
        return flat

    def _curvature_matvec(self, v: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for block in self._diagonals.values():
            if block.d is None:
                continue
            ix = self._ix(block.index, v.device)
            put(out, ix, block.matvec(take(v, ix)))
        return out

    def _curvature_state(self) -> Dict[str, Any]:
        return {"diagonals": {k: b.state_dict() for k, b in self._diagonals.items()}}

    def _checked_curvature_state(self, state: Any) -> Dict[str, Any]:
        candidates = {g: [self._tied.index(g)] for g in self._tied.group_names()}
        for name, (module, rule) in self._layers.items():
            if self._tied.tied(name):  # in its group's diagonal
                continue
            plain = [layer_positions(self.layout, name, module, rule)]
            kron = rule.kfac_index(module, self.layout.local_offsets(name))
            if kron:  # Linear-family layers: laid out like their Kronecker blocks
                plain.append(torch.cat([ix.reshape(-1) for ix in kron.values()]))
            candidates[name] = plain
        return check_diagonal_state(type(self).__name__, state, candidates)

    def _load_curvature_state(self, state: Dict[str, Any]) -> None:
        self._diagonals = {}
        for name, st in state["diagonals"].items():
            block = DiagonalBlock(name, st["index"])
            block.load_state_dict(st)
            self._diagonals[name] = block


def _inverse_all(
    blocks: List[DiagonalBlock],
    views,
    dampings: Optional[List[Tensor]] = None,
    damping: Optional[float] = None,
) -> None:
    """Every block's ``v / (d + damping)`` (``DiagonalBlock.inverse_matvec_into``, the same
    values) in three calls: one ``_foreach_add``, one ``_foreach_div``, one copy out.
    ``dampings``: the gathered per-position dampings, else the one number ``damping``.
    """
    ms = [v.M for v in views]
    diagonals = [b.d.to(m.dtype) for b, m in zip(blocks, ms)]
    denominators = torch._foreach_add(diagonals, damping if dampings is None else dampings)
    copy_into([v.out for v in views], torch._foreach_div(ms, denominators))
    for b, v in zip(blocks, views):
        if b.fresh is not None:  # no finite statistics yet: the gradient itself
            torch.where(b.fresh, v.M, v.out, out=v.out)


def _layout_pieces(
    blocks: List[DiagonalBlock], flat: Tensor
) -> Optional[Tuple[List[Tensor], PieceViews]]:
    """``(sources, targets)``: each block's positions as affine pieces of the flat layout
    (:func:`~curvature.blocks.gather.affine_pieces`, its index viewed in the shape its
    diagonal arrives in), the matching views of ``flat`` (the diagonals, block after
    block) and the layout's views; ``None`` where a block needs more pieces.
    """
    pieces, shapes, sources, start = [], [], [], 0
    for b in blocks:
        n = b.d.numel()
        shape = tuple(b.shape) if len(b.shape) == 3 and math.prod(b.shape) == n else (1, 1, n)
        block = affine_pieces(b.index.reshape(shape))
        if block is None:
            return None
        region = flat[start : start + n].view(shape)
        sources += [region[:, :, p.start : p.stop] for p in block]
        pieces.append(block)
        shapes.append(shape)
        start += n
    return sources, PieceViews(pieces, shapes)
