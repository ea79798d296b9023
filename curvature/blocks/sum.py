"""A sum of Kronecker products, inverted exactly for two terms.

A layer reached by several curvature outputs (terms; e.g. a PINN's interior and boundary
residuals) has one pair of factors per term; terms after the first are merged into the
second (mean of their ``A``, sum of their ``G``). Every term is damped, by the block's
``mode``:

    "per_factor":  (A1 + lambda I) x (G1 + lambda I) + (A2 + lambda I) x (G2 + lambda I)
    "pi":          (A1 + pi1 sqrt(lambda) I) x (G1 + sqrt(lambda)/pi1 I)
                   + (A2 + pi2 sqrt(lambda) I) x (G2 + sqrt(lambda)/pi2 I)

with ``pi_t = sqrt(mean eig(A_t) / mean eig(G_t))``. ``"per_factor"`` is the damping of
Dangel, Mueller & Zeinhofer (2024). Writing ``A1', A2', G1', G2'`` for the damped
factors, the block is inverted exactly by simultaneous diagonalization: with ``PA^T A1'
PA = I``, ``PA^T A2' PA = diag(muA)`` (likewise ``PG``, ``muG``), its inverse applied to
``M [C, D_out, D]`` is ``PG [(PG^T M PA) / (1 + muG muA^T)] PA^T``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..linalg import generalized_eigh
from .kronecker import KroneckerBlock
from .records import GeneralizedEigen, Record
from .running import ema, mean_diagonal, pi_factor, update_weight


class KroneckerSumBlock:
    """``sum_t kron(G_t, A_t)`` over the terms ``t`` of one layer block.

    Attributes:
        name: The block's name.
        index: ``[C, D_out, D]`` flat positions.
        terms: Term number to ``(A [C, D, D], G [C, D_out, D_out])`` running factors.
        record: The last :class:`GeneralizedEigen`, or ``None``.
        mode: The damping, ``"pi"`` or ``"per_factor"`` (module docstring).

    """

    def __init__(self, name: str, index: Tensor, mode: str = "pi"):
        self.name = name
        self.index = index
        self.terms: Dict[int, List[Tensor]] = {}
        self.record: Any = None
        self.mode = mode

    @classmethod
    def from_block(
        cls, block: KroneckerBlock, term: int = 0, mode: str = "pi"
    ) -> KroneckerSumBlock:
        """A sum block whose term ``term`` is ``block``'s factors (its record is dropped)."""
        out = cls(block.name, block.index, mode)
        if block.A is not None:
            out.terms[term] = [block.A, block.G]
        return out

    @property
    def label(self) -> str:  # noqa: D102
        return self.name or "<model>"

    def update(
        self,
        A: Tensor,
        G: Tensor,
        decay: float = 0.0,
        term: int = 0,
        valid: Optional[Tensor] = None,
    ) -> None:
        """Fold the factors of one term into its running estimate.

        ``valid`` (0-d device bool; ``None``: true): false statistics (zeros) leave the
        term unchanged (a term's first update is taken as it is).
        """
        old = self.terms.get(term)
        if old is None:
            self.terms[term] = [A, G.clone()]
        else:
            w, _ = update_weight(valid, None, decay, old[0].dtype)
            self.terms[term] = [ema(old[0], A, decay, w), ema(old[1], G, decay, w)]

    def two_terms(self) -> Tuple[List[Tensor], List[Tensor]]:
        """The first term and the rest, merged (mean of the ``A``, sum of the ``G``)."""
        ordered = [self.terms[t] for t in sorted(self.terms)]
        first, rest = ordered[0], ordered[1:]
        if len(rest) == 1:
            return first, rest[0]
        return first, [sum(r[0] for r in rest) / len(rest), sum(r[1] for r in rest)]

    def damped(self, A: Tensor, G: Tensor, damping: float) -> Tuple[Tensor, Tensor]:
        """One term's damped factors ``(A + sA I, G + sG I)`` (module docstring)."""
        if self.mode == "per_factor":
            sA = sG = torch.full(A.shape[:-2], float(damping), dtype=A.dtype, device=A.device)
        else:
            pi = pi_factor(mean_diagonal(A), mean_diagonal(G))
            sA, sG = pi * damping**0.5, damping**0.5 / pi
        eyeA = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        eyeG = torch.eye(G.shape[-1], dtype=G.dtype, device=G.device)
        return A + sA[..., None, None] * eyeA, G + sG[..., None, None] * eyeG

    def decompose(self, damping: float) -> GeneralizedEigen:
        """The simultaneous diagonalization at ``damping`` (see the module docstring)."""
        (A1, G1), (A2, G2) = (self.damped(A, G, damping) for A, G in self.two_terms())
        muA, PA = generalized_eigh(A2, A1, name=f"A of '{self.label}'")
        muG, PG = generalized_eigh(G2, G1, name=f"G of '{self.label}'")
        return GeneralizedEigen(muA, PA, muG, PG, damping)

    def install(self, record: Record) -> None:
        """Use ``record`` from now on."""
        self.record = record

    def matvec(self, M: Tensor) -> Tensor:
        """``sum_t G_t M A_t``."""
        return sum(G.to(M.dtype) @ M @ A.to(M.dtype) for A, G in self.terms.values())

    def inverse_matvec(self, M: Tensor, damping: float, mode: str = "pi") -> Tensor:
        """The exact inverse of the damped two-term block times ``M``.

        ``mode`` ``"per_factor"`` or ``"pi"`` (``"exact"`` damping has no exact inverse
        for a sum of Kronecker products: pi). A damping or mode other than the record's
        (adaptive damping) decomposes again.
        """
        mode = "per_factor" if mode == "per_factor" else "pi"
        if self.record is None or self.record.damping != damping or self.mode != mode:
            self.mode = mode
            self.install(self.decompose(damping))
        r = self.record
        muA, PA, muG, PG = (t.to(M.dtype) for t in r.tensors())
        rot = (PG.mT @ M @ PA) / (1 + muG[..., :, None] * muA[..., None, :])
        return PG @ rot @ PA.mT

    def trace(self) -> Tensor:
        """``sum_t sum_c tr(G_tc) tr(A_tc)``."""
        return sum(
            (G.diagonal(dim1=-2, dim2=-1).sum(-1) * A.diagonal(dim1=-2, dim2=-1).sum(-1)).sum()
            for A, G in self.terms.values()
        )

    def state_dict(self) -> Dict[str, Any]:
        """Terms and record (cloned)."""
        return {
            "terms": {t: [x.clone() for x in v] for t, v in self.terms.items()},
            "record": None if self.record is None else self.record.state(),
            "mode": self.mode,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.terms = {int(t): [x.clone() for x in v] for t, v in state["terms"].items()}
        rec = state.get("record")
        self.record = None if rec is None else Record.from_state(rec)
        self.mode = state.get("mode", "pi")
