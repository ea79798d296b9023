"""The checkpoint of :class:`~curvature.KFAC` / ``EKFAC``'s blocks: what ``state_dict``
holds of the curvature and how ``load_state_dict`` checks and restores it.

A mixin of :class:`~curvature.KFAC` (it uses the optimizer's blocks, indices and
configuration): the Kronecker blocks with statistics, the diagonal and one-sided blocks,
the terms of single-term blocks; :mod:`.checkpoint` checks names and shapes against this
optimizer before anything changes.
"""

from __future__ import annotations

from typing import Any, Dict

from ..blocks import (
    DiagonalBlock,
    Eigen,
    EigenCorrectedBlock,
    KroneckerBlock,
    block_state,
    restore_block,
)
from ..layer_stats import block_name
from ..options import Unsupported
from .checkpoint import check_kronecker_state, warn_dropped_corrections
from .deferred import has_statistics
from .large import restore_onesided, split_state


class KroneckerState:
    """``_curvature_state``, its checks and its restore for the Kronecker optimizers."""

    def _curvature_state(self) -> Dict[str, Any]:
        return {
            "blocks": {k: block_state(b) for k, b in self._blocks.items() if has_statistics(b)},
            "diag": {k: b.state_dict() for k, b in self._diag.items()},
            "terms": dict(self._term_of),
            "large_factors": self.large_factors,
        }

    def _checked_curvature_state(self, state: Any) -> Dict[str, Any]:
        diagonal = {k: ix.reshape(-1) for k, ix in self._large.items()}
        groups = self._tied.group_names()  # tied layers: one diagonal per group
        if self.config.unsupported == Unsupported.DIAGONAL:  # layers without a block
            blocked = {k[0] for k in (*self._index, *self._large)}
            free = [n for n in self._layers if n not in blocked and not self._tied.tied(n)]
            diagonal.update({(n, ""): self._diag_index((n, "")) for n in free + groups})
        who, layers = type(self).__name__, [*self._layers, *groups]
        state, onesided = split_state(who, state, self.large_factors, self._large, self._index)
        return {**check_kronecker_state(who, state, self._index, diagonal, layers), "one": onesided}

    def _load_curvature_state(self, state: Dict[str, Any]) -> None:
        if not issubclass(self.block_type, EigenCorrectedBlock):
            warn_dropped_corrections(type(self).__name__, state["blocks"])
        self._blocks = {
            tuple(k): restore_block(block_name(*k), self._index[tuple(k)], st, self.block_type)
            for k, st in state["blocks"].items()
        }
        # eigenbases across KFAC and EKFAC are decomposed again: EKFAC's may be tracked
        # (blocks.power), not exact eigenpairs; KFAC's are not canonical in a null space
        kinds = {KroneckerBlock.__name__, EigenCorrectedBlock.__name__} - {self.block_type.__name__}
        for k, st in state["blocks"].items():
            block = self._blocks[tuple(k)]
            if st.get("type") in kinds and isinstance(block.record, Eigen):
                block.install(block.decompose())
        self._term_of = {tuple(k): t for k, t in state["terms"].items()}
        self._diag = {}
        for k, st in state["diag"].items():
            block = DiagonalBlock(block_name(*k), st["index"])
            block.load_state_dict(st)
            self._diag[tuple(k)] = block
        self._diag.update(
            restore_onesided(type(self).__name__, state["one"], self._large, self.max_factor_size)
        )
        if self.precondition == "owner" and self._comm is not None:
            # the saving rank held only its own blocks' decompositions: every rank
            # decomposes again at the next step (the same step everywhere)
            for block in self._blocks.values():
                block.install(None)
        self._decomposed = {k for k, b in self._blocks.items() if b.record is not None}
