"""One-sided Kronecker blocks: a full small factor with a diagonal large one.

For a layer whose factor ``A [D, D]`` or ``G [D_out, D_out]`` exceeds ``max_factor_size``,
the large factor is kept as its diagonal only (never formed), the small one full: the
curvature is ``kron(diag(g), A)`` (``D_out`` large), ``kron(G, diag(a))`` (``D`` large)
or ``kron(diag(g), diag(a))`` (both). ``diag(g)`` is the diagonal of the full ``G`` of
KFAC (same statistics, same normalization), so the block is KFAC's block with the
off-diagonal entries of the large factor dropped: it keeps the small side's correlations,
where a per-sample Fisher diagonal keeps none, and costs a few GEMMs of the layer's size.

With ``M [C, D_out, D]`` the block's entries as matrices and ``lX`` the eigenvalues of a
side (a diagonal side is its own eigenbasis, ``Q = I``; the full side is decomposed at
a refresh):

    matvec:                 G M A              (a diagonal side: an elementwise scale)
    inverse, pi damping:    QG [ (QG^T M QA) / ((lG + sqrt(lambda)/pi) (lA + pi sqrt(lambda))^T) ]
                            QA^T
    inverse, exact damping: QG [ (QG^T M QA) / (lG lA^T + lambda) ] QA^T

with ``pi = sqrt(mean lA / mean lG)`` (mean diagonals). The decomposition is refreshed
with the optimizer's other blocks (the diagonal side snapshotted with it). EKFAC uses
these blocks as KFAC does, with the optimizer's ``damping_mode`` (no eigenvalue
corrections).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..linalg import eigh_unchecked, eighs_unchecked
from .running import RunningFactors, kron, pi_factor

TYPE = "OneSidedBlock"


def _side(X: Tensor, full: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """``(eigenvalues >= 0, eigenvectors or None)`` of a side (``[C, n, n]`` or ``[C, n]``)."""
    if not full:
        return X.clamp_min(0), None
    return eigh_unchecked(X)


def full_sides(blocks: Sequence[OneSidedBlock]) -> Tuple[list, List[Tensor], List[str]]:
    """The blocks to refresh (:meth:`OneSidedBlock.refresh`), their full sides (the
    matrices to decompose) and the sides' names, for :func:`install_sides`.
    """
    jobs = [b for b in blocks if b.A is not None and b.fresh is None]
    mats, names = [], []
    for b in jobs:
        for side, X, full in (("A", b.A, b.full_A), ("G", b.G, b.full_G)):
            if full:
                mats.append(X)
                names.append(f"{side} of '{b.name}'")
    return jobs, mats, names


def install_sides(jobs: Sequence[OneSidedBlock], results: Sequence[Any]) -> None:
    """Set the records of :func:`full_sides`' blocks from the decompositions of their
    full sides (``(evals, evecs)`` each, in order); a block with an error among them
    keeps its record.
    """
    decomposed = iter(results)
    for b in jobs:
        record: list = []
        failed = False
        for X, full in ((b.A, b.full_A), (b.G, b.full_G)):
            res = next(decomposed) if full else (X.clamp_min(0), None)
            failed = failed or isinstance(res, Exception)
            record += [None, None] if failed else list(res)
        if not failed:
            b.record = tuple(record)


def refresh_blocks(blocks: Sequence[OneSidedBlock]) -> None:
    """:meth:`OneSidedBlock.refresh` of several blocks, their full sides decomposed
    together (:func:`~curvature.linalg.eighs_unchecked`: one batched call per group of
    sizes, on a GPU one synchronization each; no host read).
    """
    jobs, mats, _ = full_sides(blocks)
    install_sides(jobs, eighs_unchecked(mats))


class OneSidedBlock(RunningFactors):
    """KFAC's ``kron(G, A)`` with the large side(s) diagonal, on ``index [C, D_out, D]``.

    Attributes:
        name: The block's name.
        index: ``[C, D_out, D]`` flat positions of the entries.
        full_A: Whether ``A`` is kept full (``[C, D, D]``), else its diagonal ``[C, D]``.
        full_G: Whether ``G`` is kept full (``[C, D_out, D_out]``), else ``[C, D_out]``.
        A: Running input factor (full or diagonal), or ``None`` before the first update.
        G: Running output-gradient factor (full or diagonal), or ``None``.
        record: ``(lA, QA, lG, QG)`` of the last refresh (``Q`` ``None`` for a diagonal
            side), or ``None``.

    """

    def __init__(self, name: str, index: Tensor, full_A: bool, full_G: bool):
        self.name = name
        self.index = index
        self.full_A, self.full_G = bool(full_A), bool(full_G)
        self.A: Optional[Tensor] = None
        self.G: Optional[Tensor] = None
        self.record: Optional[Tuple[Tensor, Optional[Tensor], Tensor, Optional[Tensor]]] = None
        #: 0-d device bool: no finite statistics folded in yet (``None``: known not).
        self.fresh: Optional[Tensor] = None

    # -- refresh ----------------------------------------------------------------------
    def refresh(self) -> None:
        """Decompose the full side(s) of the current factors (no host synchronization).

        A block whose :attr:`fresh` flag is unread or true (no finite statistics known)
        keeps its record: zero factors are not decomposed.
        """
        refresh_blocks([self])

    def _eigen(self):
        if self.record is None:  # no refresh yet: decompose the current factors
            self.refresh()
        if self.record is None:  # no finite statistics known: not kept
            return (*_side(self.A, self.full_A), *_side(self.G, self.full_G))
        return self.record

    def eigenvalues(self) -> Tensor:
        """``[C, D_out, D]``: ``lG lA^T`` (of the last refresh)."""
        lA, _, lG, _ = self._eigen()
        return lG[..., :, None] * lA[..., None, :]

    # -- products ---------------------------------------------------------------------
    def matvec(self, M: Tensor) -> Tensor:
        """Block times ``M [C, D_out, D]``: ``G M A`` with the current factors."""
        A, G = self.A.to(M.dtype), self.G.to(M.dtype)
        out = G @ M if self.full_G else G[..., :, None] * M
        return out @ A if self.full_A else out * A[..., None, :]

    def inverse_matvec(self, M: Tensor, damping: float, mode: str = "exact") -> Tensor:
        """``(block + damping)^{-1} M``: ``"exact"``, ``"pi"`` or ``"per_factor"`` damping.

        From the last refresh's decomposition. While the block has had no finite
        statistics (:attr:`fresh`), ``M`` itself; so too without a refresh record while
        :attr:`fresh` is unread (as a Kronecker block without a record: the plain
        gradient until the next refresh).
        """
        if self.record is None and self.fresh is not None:
            return M
        lA, QA, lG, QG = self._eigen()
        lA, lG = lA.to(M.dtype), lG.to(M.dtype)
        R = M if QG is None else QG.to(M.dtype).mT @ M
        R = R if QA is None else R @ QA.to(M.dtype)
        if mode == "pi":
            pi = pi_factor(lA.mean(-1), lG.mean(-1))[..., None, None]
            root = damping**0.5
            R = R / ((lG[..., :, None] + root / pi) * (lA[..., None, :] + pi * root))
        elif mode == "per_factor":  # (G + lambda I) x (A + lambda I)
            R = R / ((lG[..., :, None] + damping) * (lA[..., None, :] + damping))
        else:
            R = R / (lG[..., :, None] * lA[..., None, :] + damping)
        R = R if QA is None else R @ QA.to(M.dtype).mT
        out = R if QG is None else QG.to(M.dtype) @ R
        return out if self.fresh is None else torch.where(self.fresh, M, out)

    def _full(self, X: Tensor, full: bool) -> Tensor:
        return X if full else torch.diag_embed(X)

    def trace(self) -> Tensor:
        """``sum_c tr(G_c) tr(A_c)``."""
        trA = self.A.diagonal(dim1=-2, dim2=-1).sum(-1) if self.full_A else self.A.sum(-1)
        trG = self.G.diagonal(dim1=-2, dim2=-1).sum(-1) if self.full_G else self.G.sum(-1)
        return (trG * trA).sum()

    def logdet(self, damping: float) -> Tensor:
        """``log det(block + damping I)`` of the current factors."""
        lA, _ = _side(self.A, self.full_A)
        lG, _ = _side(self.G, self.full_G)
        return torch.log(lG[..., :, None] * lA[..., None, :] + damping).sum()

    def dense(self) -> Tensor:
        """``[C, D_out D, D_out D]`` dense per-group blocks (row-major in ``(o, i)``)."""
        A, G = self._full(self.A, self.full_A), self._full(self.G, self.full_G)
        return kron(G, A)

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Factors, sides and refresh record (cloned), tagged ``type: "OneSidedBlock"``."""

        def c(t):
            return None if t is None else t.clone()

        return {
            "type": TYPE,
            "full_A": self.full_A,
            "full_G": self.full_G,
            "A": c(self.A),
            "G": c(self.G),
            "record": None if self.record is None else [c(t) for t in self.record],
            "index": self.index.clone(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the sides must match this block's)."""
        if (state.get("full_A"), state.get("full_G")) != (self.full_A, self.full_G):
            raise ValueError(
                f"OneSidedBlock '{self.label}': saved with full (A, G) = "
                f"({state.get('full_A')}, {state.get('full_G')}), this block has "
                f"({self.full_A}, {self.full_G}) (another max_factor_size?)"
            )
        self.A = None if state["A"] is None else state["A"].clone()
        self.G = None if state["G"] is None else state["G"].clone()
        rec = state.get("record")
        self.record = None if rec is None else tuple(None if t is None else t.clone() for t in rec)
        self.fresh = None


def onesided_sides(index: Union[Tensor, Sequence[int]], max_factor_size: int) -> Tuple[bool, bool]:
    """``(full_A, full_G)`` of a block on ``index [C, D_out, D]`` (or its shape): size <= max."""
    shape = index.shape if isinstance(index, Tensor) else index
    return shape[2] <= max_factor_size, shape[1] <= max_factor_size
