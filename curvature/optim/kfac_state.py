"""The checkpoint of :class:`~curvature.KFAC` / ``EKFAC``'s blocks: what ``state_dict``
holds of the curvature and how ``load_state_dict`` checks and restores it; the running
factors as ``factors()`` reports them, and the live columns the blocks are told of.

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
    KroneckerSumBlock,
    block_state,
    restore_block,
)
from ..blocks.live import union_columns
from ..layer_stats import block_name
from ..options import Unsupported
from .checkpoint import check_kronecker_state, warn_dropped_corrections
from .deferred import has_statistics
from .large import restore_onesided, split_state


class KroneckerState:
    """``_curvature_state``, its checks and its restore for the Kronecker optimizers;
    ``factors()`` and the live columns of their blocks.
    """

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

    def factors(self) -> Dict[str, Any]:
        """Block name to the running ``(A, G)`` (``[groups, D, D]`` for grouped convs).

        A block reached by several registered outputs (terms) maps to the list of their
        ``(A, G)`` in registration order.
        """
        out: Dict[str, Any] = {}
        for key, block in self._blocks.items():
            if not has_statistics(block):
                continue  # only non-finite statistics so far
            if isinstance(block, KroneckerSumBlock):
                terms = [block.terms[t] for t in sorted(block.terms)]
            else:
                terms = [(block.A, block.G)]
            pairs = [(A[0], G[0]) if A.shape[0] == 1 else (A, G) for A, G in terms]
            out[block_name(*key)] = pairs[0] if len(pairs) == 1 else pairs
        return out

    def _note_live(self, name, module, rule, calls, A_sum) -> None:
        """The columns of the layer's ``A`` that these calls can make nonzero (the rule's
        ``live_columns``, from shapes), joined with the step's earlier ones: KFAC's
        Kronecker blocks invert ``A`` on them alone (:mod:`curvature.blocks.live`). Not
        with several ranks (whose inputs may differ in shape: their union is not known).
        """
        key = (name, "")
        if self.block_type is not KroneckerBlock or self._comm is not None:
            return
        cols = rule.live_columns(module, calls)
        if cols is not None and (A_sum is None or max(cols) >= A_sum.shape[-1]):
            cols = None
        self._live_now[key] = (
            union_columns(self._live_now[key], cols) if key in self._live_now else cols
        )
