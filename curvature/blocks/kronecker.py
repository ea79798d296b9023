"""Kronecker-factored blocks: KFAC's ``kron(G, A)`` and EKFAC's eigenvalue correction.

A block covers the entries of one layer's ``[W | b]`` (bias as the last input column) at
the flat positions ``index [C, D_out, D]`` (``C`` groups of a grouped convolution, else
1). With ``M [C, D_out, D]`` the block's entries of a vector arranged as matrices, and
``A [C, D, D]``, ``G [C, D_out, D_out]`` its factors (see :mod:`curvature.kfac`):

    matvec:                     G M A
    inverse, pi damping:        (G + sqrt(lambda)/pi I)^{-1} M (A + pi sqrt(lambda) I)^{-1}
    inverse, per-factor:        (G + lambda I)^{-1} M (A + lambda I)^{-1}
    inverse, exact damping:     QG [ (QG^T M QA) / (lG lA^T + lambda) ] QA^T
    EKFAC (both):               the same with Lambda in place of lG lA^T

with ``pi = sqrt(mean eig(A) / mean eig(G))`` (Martens & Grosse, 2015) and ``Lambda`` the
second moments of the per-sample gradients in the Kronecker eigenbasis (George et al.,
2018). A layer without Kronecker structure is an exact block: ``A = [[1]]``, ``D = 1``
and ``G`` its dense curvature (``curvature.layer_stats.exact_factors``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..linalg import damped_inverses, eigh
from .carry import carried_corrections
from .live import compact, live_inverse_matvec, live_inverse_matvec_into, union_columns
from .records import CurrentFactors, DampedInverses, Eigen, FactorSnapshot, Record
from .running import (
    RunningFactors,
    decay_constants,
    ema,
    kron,
    mean_diagonal,
    pi_factor,
    rounds_to_one,
    update_weight,
)


class KroneckerBlock(RunningFactors):
    """KFAC's ``blockdiag_c kron(G[c], A[c])`` on ``index``.

    Attributes:
        name: The block's name (module name, ``.suffix`` for a layer with several).
        index: ``[C, D_out, D]`` flat positions of the entries.
        A: ``[C, D, D]`` input factor (running estimate in an optimizer), or ``None``.
        G: ``[C, D_out, D_out]`` output-gradient factor, or ``None``.
        record: The last refresh's :class:`Eigen`, :class:`FactorSnapshot` (a copy of the
            factors) or :class:`CurrentFactors` (none), or ``None``.
        inverses: Cached :class:`DampedInverses` (pi or per-factor damping), or ``None``.

    """

    #: Whether a null space's eigenvectors are canonical (:func:`canonical_null_basis`):
    #: EKFAC's corrections depend on the basis there, KFAC's inverses do not.
    canonical_basis = False

    def __init__(
        self, name: str, index: Tensor, A: Optional[Tensor] = None, G: Optional[Tensor] = None
    ):
        self.name = name
        self.index = index
        self.A = A
        self.G = G
        self.record: Optional[Record] = None
        self.inverses: Optional[DampedInverses] = None
        #: 0-d device bool: no finite statistics folded in yet (``None``: known not).
        self.fresh: Optional[Tensor] = None
        self._cache: Dict[str, tuple] = {}  # per-record products of the record, by dtype
        #: The columns of ``A`` its statistics can have made nonzero (:meth:`widen`), or
        #: ``None``: any (the full inverses).
        self.live_cols: Optional[Tuple[int, ...]] = None
        self._widened = False  # whether live_cols is known since the first statistics
        self._live_ix: Optional[Tuple[tuple, Tensor]] = None  # (live_cols, their index)

    # -- statistics -------------------------------------------------------------------
    def widen(self, cols: Optional[Tuple[int, ...]], most: int) -> None:
        """Count the columns ``cols`` of ``A`` that the statistics about to be folded in
        can make nonzero (``None``: any; from the layer rule's ``live_columns``, shapes
        only). The block keeps their union since its first statistics: the other rows
        and columns of its factors are exactly zero, and its damped inverse of ``A`` is
        taken on these alone (:mod:`curvature.blocks.live`). Once the union has more than
        ``most`` columns, or for a block that had statistics before it was told, it
        stays ``None``.
        """
        if not self._widened:
            self._widened = True
            cols = cols if self.A is None else None
        elif self.live_cols is None or cols is self.live_cols:  # (all already, or the same)
            return
        else:
            cols = union_columns(self.live_cols, cols)
        self.live_cols = None if cols is not None and len(cols) > most else cols

    def live_index(self, like: Tensor) -> Optional[Tensor]:
        """:attr:`live_cols` as an index on ``like``'s device (built when they change)."""
        cols = self.live_cols
        if cols is None:
            return None
        if (
            self._live_ix is None
            or self._live_ix[0] is not cols
            or self._live_ix[1].device != like.device
        ):
            self._live_ix = (cols, torch.tensor(cols, device=like.device))
        return self._live_ix[1]

    def has_statistics(self) -> bool:
        """Whether finite statistics were folded in (reads :attr:`fresh` if unknown)."""
        if self.A is None:
            return False
        if self.fresh is not None:
            self.read_flags([bool(self.fresh)])
        return self.fresh is None

    # -- refresh ----------------------------------------------------------------------
    def eigen(self) -> Eigen:
        """The record as an :class:`Eigen` (decomposing the current factors if needed)."""
        if not isinstance(self.record, Eigen):
            self.install(self.decompose())
        return self.record  # type: ignore[return-value]

    def factors_of(self, record: Optional[Record] = None) -> Tuple[Tensor, Tensor]:
        """``(A, G)`` that ``record`` (default: the installed one) inverts at another
        damping: a :class:`FactorSnapshot`'s copy, else the running factors.
        """
        record = self.record if record is None else record
        src = record if isinstance(record, FactorSnapshot) else self
        return src.A, src.G

    def decompose(self, A: Optional[Tensor] = None, G: Optional[Tensor] = None) -> Eigen:
        """Eigendecompositions of the factors (of the snapshot's, after a Cholesky refresh)."""
        if A is None:
            A, G = self.factors_of()
        lA, QA = eigh(A, name=f"A of '{self.label}'", canonical=self.canonical_basis)
        lG, QG = eigh(G, name=f"G of '{self.label}'", canonical=self.canonical_basis)
        return Eigen(lA, QA, lG, QG)

    def install(self, record: Record) -> None:
        """Use ``record`` from now on (cached inverses are recomputed when needed).

        The products cached from the previous record are dropped with it, so that it and
        its inverses are freed before the new ones are computed.
        """
        self.record = record
        self.inverses = None
        self._cache = {}

    def pi_shifts(self, damping: float, record: Optional[Record] = None) -> tuple:
        """``(pi sqrt(lambda), sqrt(lambda) / pi)``, ``[C]`` each, from the refresh record
        (or from ``record``, e.g. a snapshot not installed yet).
        """
        root = damping**0.5
        record = self.record if record is None else record
        if isinstance(record, Eigen):
            r = record
            pi = pi_factor(r.lA.sum(-1) / r.lA.shape[-1], r.lG.sum(-1) / r.lG.shape[-1])
        else:
            A, G = self.factors_of(record)
            pi = pi_factor(mean_diagonal(A), mean_diagonal(G))
        return pi * root, root / pi

    def shifts(self, damping: float, mode: str = "pi", record: Optional[Record] = None) -> tuple:
        """The shifts ``(sA, sG)`` added to ``A`` and ``G``, ``[C]`` each (from the
        refresh record, or from ``record``).

        ``"pi"``: :meth:`pi_shifts`; ``"per_factor"``: ``(lambda, lambda)``.
        """
        if mode == "per_factor":
            C = self.index.shape[0]
            like = self.A if self.A is not None else self.record.tensors()[0]
            full = torch.full((C,), float(damping), dtype=like.dtype, device=like.device)
            return full, full.clone()
        return self.pi_shifts(damping, record)

    def pi_inverses(self, damping: float, mode: str = "pi") -> DampedInverses:
        """``(A + sA I)^{-1}`` and ``(G + sG I)^{-1}`` with the :meth:`shifts` (cached).

        From the eigendecompositions when the record has them, else by Cholesky of the
        snapshot's factors, or of the running ones for a :class:`CurrentFactors` record
        (:func:`~curvature.linalg.damped_inverses`).
        """
        cached = self.inverses
        if (
            cached is not None
            and cached.damping == damping
            and cached.mode == mode
            and cached.source is self.record
        ):
            return cached
        sA, sG = self.shifts(damping, mode)
        live = None
        if isinstance(self.record, Eigen):
            r = self.record
            Ainv = (r.QA / (r.lA + sA[..., None])[..., None, :]) @ r.QA.mT
            Ginv = (r.QG / (r.lG + sG[..., None])[..., None, :]) @ r.QG.mT
        else:
            if self.record is None:
                self.install(CurrentFactors())
            A, G = self.factors_of()
            live = self.live_index(A)
            Ainv, Ginv = damped_inverses(
                [A if live is None else compact(A, live), G],
                [sA, sG],
                names=[f"A of '{self.label}'", f"G of '{self.label}'"],
            )
        shift = None if live is None else sA  # (A's shift: the dead columns' 1 / sA)
        self.inverses = DampedInverses(Ainv, Ginv, damping, self.record, mode, live, shift)
        return self.inverses

    # -- products ---------------------------------------------------------------------
    def eigenvalues(self) -> Tensor:
        """``[C, D_out, D]``: the block's eigenvalues ``lG lA^T`` in the Kronecker basis."""
        r = self.eigen()
        return r.lG[..., :, None] * r.lA[..., None, :]

    def matvec(self, M: Tensor) -> Tensor:
        """Block times ``M [C, D_out, D]``: ``G M A``."""
        return self.G.to(M.dtype) @ M @ self.A.to(M.dtype)

    def inverse_matvec(self, M: Tensor, damping: float, mode: str = "exact") -> Tensor:
        """``(block + damping)^{-1} M``: ``"exact"``, ``"pi"`` or ``"per_factor"`` damping."""
        if mode in ("pi", "per_factor"):
            inv = self.pi_inverses(damping, mode)
            Ginv, Ainv = inv.Ginv.to(M.dtype), inv.Ainv.to(M.dtype)
            if inv.live is not None:  # (A's other columns are zero)
                return live_inverse_matvec(Ginv, Ainv, inv.live, inv.sA, M)
            if M.shape[0] == 1:  # one group: two plain GEMMs
                return (Ginv[0] @ M[0] @ Ainv[0]).unsqueeze(0)
            return Ginv @ M @ Ainv
        return self.in_eigenbasis(M, lambda rot: rot / (self.eigenvalues().to(M.dtype) + damping))

    def inverse_matvec_into(self, v: Any, damping: float, mode: str = "exact") -> None:
        """:meth:`inverse_matvec` of ``v.M`` written into ``v.out`` (``BlockViews``).

        The same products in the same order (the same values), with the record's
        matrices for one group cached per record and dtype, and the GEMMs writing into
        the output: fewer aten calls (kernel launches) per step.
        """
        if v.M2 is None:  # several groups: the batched products
            v.out.copy_(self.inverse_matvec(v.M, damping, mode))
            return
        if mode in ("pi", "per_factor"):
            inv = self.pi_inverses(damping, mode)
            if inv.live is not None:  # (A's other columns are zero)
                Ginv, Ainv, inv_s = self._cached(
                    "pi", inv, v.M.dtype, lambda: (inv.Ginv[0], inv.Ainv[0], 1 / inv.sA[0])
                )
                live_inverse_matvec_into(Ginv, Ainv, inv.live, inv_s, v.M2, v.out2)
                return
            Ginv, Ainv = self._cached("pi", inv, v.M.dtype, lambda: (inv.Ginv[0], inv.Ainv[0]))
            torch.mm(torch.mm(Ginv, v.M2), Ainv, out=v.out2)
            return
        r = self.eigen()
        QG, QGt, QA, QAt = self._cached(
            "q", r, v.M.dtype, lambda: (r.QG[0], r.QG[0].mT, r.QA[0], r.QA[0].mT)
        )
        torch.mm(torch.mm(QGt, v.M2), QA, out=v.out2)  # QG^T M QA
        v.out.div_(self._denominators(damping, v.M.dtype))
        torch.mm(torch.mm(QG, v.out2), QAt, out=v.out2)

    def _cached(self, kind: str, source: Any, dtype: torch.dtype, make) -> tuple:
        """``make()``'s tensors in ``dtype``, kept while ``source`` is the current one."""
        hit = self._cache.get(kind)
        if hit is None or hit[0] is not source or hit[1] != dtype:
            hit = (source, dtype, tuple(t.to(dtype) for t in make()))
            self._cache[kind] = hit
        return hit[2]

    def _denominators(self, damping: float, dtype: torch.dtype) -> Tensor:
        """``[C, D_out, D]``: the eigenvalues plus ``damping`` (cached per record)."""
        hit = self._cache.get("den")
        if hit is None or hit[0] is not self.record or hit[1] != (damping, dtype):
            hit = (self.record, (damping, dtype), self.eigenvalues().to(dtype) + damping)
            self._cache["den"] = hit
        return hit[2]

    def in_eigenbasis(self, M: Tensor, scale) -> Tensor:
        """``QG scale(QG^T M QA) QA^T``: apply ``scale`` in the Kronecker eigenbasis."""
        r = self.eigen()
        QA, QG = r.QA.to(M.dtype), r.QG.to(M.dtype)
        if M.shape[0] == 1:  # one group: plain GEMMs
            QA, QG = QA[0], QG[0]
            return (QG @ scale((QG.mT @ M[0] @ QA).unsqueeze(0))[0] @ QA.mT).unsqueeze(0)
        return QG @ scale(QG.mT @ M @ QA) @ QA.mT

    def trace(self) -> Tensor:
        """``sum_c tr(G_c) tr(A_c)``."""
        trA = self.A.diagonal(dim1=-2, dim2=-1).sum(-1)
        trG = self.G.diagonal(dim1=-2, dim2=-1).sum(-1)
        return (trG * trA).sum()

    def logdet(self, damping: float) -> Tensor:
        """``log det(block + damping I)``."""
        return torch.log(self.eigenvalues() + damping).sum()

    def dense(self) -> Tensor:
        """``[C, D_out D, D_out D]`` dense per-group blocks (row-major in ``(o, i)``)."""
        return kron(self.G, self.A)

    # -- state ------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Factors and record (cloned). The cached inverses are derived from the record and
        not saved, except those of a :class:`CurrentFactors` record: taken from factors
        that have moved on since, they cannot be derived again (saved, so that a resumed
        run continues bit for bit).
        """
        state = {
            "A": None if self.A is None else self.A.clone(),
            "G": None if self.G is None else self.G.clone(),
            "record": None if self.record is None else self.record.state(),
            "live_columns": (self._widened, self.live_cols),
        }
        inv = self.inverses
        current = isinstance(self.record, CurrentFactors)
        if current and inv is not None and inv.source is self.record:
            state["inverses"] = {
                "Ainv": inv.Ainv.clone(),
                "Ginv": inv.Ginv.clone(),
                "damping": inv.damping,
                "mode": inv.mode,
            }
            if inv.live is not None:
                state["inverses"].update(live=inv.live.clone(), sA=inv.sA.clone())
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.A = None if state["A"] is None else state["A"].clone()
        self.G = None if state["G"] is None else state["G"].clone()
        rec = state.get("record")
        self.install(None if rec is None else Record.from_state(rec))
        # (a state without the live columns: the full inverses from now on)
        self._widened, cols = state.get("live_columns", (True, None))
        self.live_cols = None if cols is None else tuple(cols)
        self._live_ix = None
        inv = state.get("inverses")
        if inv is not None and isinstance(self.record, CurrentFactors):
            live = inv.get("live")
            self.inverses = DampedInverses(
                inv["Ainv"].clone(),
                inv["Ginv"].clone(),
                inv["damping"],
                self.record,
                inv["mode"],
                None if live is None else live.clone(),
                None if live is None else inv["sA"].clone(),
            )


class _WeightTurns:
    """EKFAC's corrections weight ``u`` and the update weight ``w``, in one call per update.

    While ``Lambda`` may have had no finite statistics, an update with the device flag
    ``valid`` takes ``w = valid ? u : 0`` and leaves ``u' = valid ? rate : u``. Two
    persistent buffers laid out as ``[0, w, u, rate]`` take turns: an update reads
    ``[u, rate]`` (entries 2 and 3) and ``[0, u]`` (entries 0 and 2, a stride-2 view) of
    one and writes ``[w', u']`` into entries 1 and 2 of the other, with one
    ``torch.where`` (two selects before). All views are made once; ``w`` and ``u`` are
    0-d views, valid until the update after next.
    """

    def __init__(self, u: Tensor, rate: Tensor):
        zero = torch.zeros((), dtype=u.dtype, device=u.device)
        self.rate = rate
        self.bufs = [torch.stack([zero, zero, u, rate]), torch.stack([zero, zero, zero, rate])]
        self.take = [b[2:4] for b in self.bufs]  # [u, rate]
        self.keep = [b.as_strided((2,), (2,), b.storage_offset()) for b in self.bufs]  # [0, u]
        self.into = [b[1:3] for b in self.bufs]  # [w, u]
        self.w = [b[1] for b in self.bufs]
        self.us = [b[2] for b in self.bufs]
        self.turn = 0
        self.u = self.us[0]

    def update(self, valid: Tensor) -> Tuple[Tensor, Tensor]:
        """``(w, u')`` for an update whose statistics are ``valid`` (0-d device bool)."""
        a, b = self.turn, 1 - self.turn
        torch.where(valid, self.take[a], self.keep[a], out=self.into[b])
        self.turn, self.u = b, self.us[b]
        return self.w[b], self.u


class EigenCorrectedBlock(KroneckerBlock):
    """EKFAC: KFAC's eigenbasis with corrected eigenvalues ``Lambda [C, D_out, D]``.

    ``Lambda = E[(QG^T grad QA)^2]`` over the per-sample (per-vector) gradient matrices;
    damping is always exact: ``QG [(QG^T M QA) / (Lambda + lambda)] QA^T``. Until the
    first corrections arrive, the block behaves as KFAC with exact damping.
    """

    canonical_basis = True

    def __init__(
        self, name: str, index: Tensor, A: Optional[Tensor] = None, G: Optional[Tensor] = None
    ):
        super().__init__(name, index, A, G)
        #: ``Lambda``; while it has had no finite statistics (:attr:`corrections_fresh`),
        #: KFAC's eigenvalues ``lG lA^T`` in its place (the values used), so that the
        #: preconditioning selects nothing per step.
        self.corrections: Optional[Tensor] = None
        #: 0-d device weight of the next finite corrections: ``1`` while ``Lambda`` has
        #: had none, else ``1 - decay`` (``None``: it has had some, known on the host).
        self.corrections_weight: Optional[Tensor] = None
        #: 0-d device bool tracked per update only where ``1 - decay`` rounds to ``1``
        #: (else read off :attr:`corrections_weight`).
        self._fresh: Optional[Tensor] = None
        #: the buffers that :attr:`corrections_weight` is a view of, between updates
        self._weights: Optional[_WeightTurns] = None

    @property
    def corrections_fresh(self) -> Optional[Tensor]:
        """0-d device bool: ``Lambda`` has had no finite statistics yet (``None``: it has)."""
        if self.corrections_weight is None:
            return None
        if self._fresh is not None:
            return self._fresh
        one = decay_constants(0.0, self.corrections_weight.dtype, self.corrections_weight.device)[0]
        return self.corrections_weight == one

    def update_corrections(
        self, corrections: Tensor, decay: float = 0.0, valid: Optional[Tensor] = None
    ) -> None:
        """Fold new second moments into the running ``Lambda`` (``valid`` as in :meth:`update`).

        The weight of the new moments is ``0`` (not valid), ``1`` (the first valid ones)
        or ``1 - decay``: the same values as :func:`update_weight`, in two calls while
        ``Lambda`` may have had no finite statistics, one after.
        """
        dtype = corrections.dtype if self.corrections is None else self.corrections.dtype
        if self.corrections is None:
            self.corrections = corrections
            if valid is not None:  # not valid: KFAC's eigenvalues in its place
                one, rate, _ = decay_constants(decay, dtype, valid.device)
                self.corrections = torch.where(valid, corrections, self._kfac_eigenvalues(dtype))
                self._weights = _WeightTurns(torch.where(valid, rate, one), rate)
                self.corrections_weight = self._weights.u
                self._fresh = ~valid if rounds_to_one(1 - decay, dtype) else None
            return
        u = self.corrections_weight
        if u is None:
            w, _ = update_weight(valid, None, decay, dtype)
        elif valid is None:  # valid, known on the host: the weight is u, then 1 - decay
            w, self.corrections_weight, self._fresh = u, None, None
        else:
            _, rate, _ = decay_constants(decay, dtype, valid.device)
            turns = self._weights
            if turns is None or turns.u is not u or turns.rate is not rate:  # (after a load)
                turns = self._weights = _WeightTurns(u, rate)
            w, self.corrections_weight = turns.update(valid)
            if self._fresh is not None:
                self._fresh = self._fresh > valid
        # (weight 1 gives the new moments exactly; weight 0 keeps the KFAC eigenvalues)
        self.corrections = ema(self.corrections, corrections, decay, w)

    def _kfac_eigenvalues(self, dtype: torch.dtype) -> Tensor:
        r = self.eigen()
        return self._cached("eig", r, dtype, lambda: (KroneckerBlock.eigenvalues(self),))[0]

    def _raw_corrections(self) -> Optional[Tensor]:
        """``Lambda`` itself: zeros while it has had no finite statistics."""
        fresh = self.corrections_fresh
        if self.corrections is None or fresh is None:
            return self.corrections
        return torch.where(fresh, 0.0, self.corrections)

    def flags(self) -> List[Tensor]:  # noqa: D102
        fresh = self.corrections_fresh
        return super().flags() + ([] if fresh is None else [fresh])

    def read_flags(self, values: List[bool]) -> None:  # noqa: D102
        n = len(super().flags())
        fresh = self.corrections_fresh
        super().read_flags(values[:n])
        if fresh is not None and not values[n]:
            self.corrections_weight = self._fresh = None

    def _corrected(self) -> Tensor:
        """``Lambda``, or KFAC's eigenvalues while it has had no finite statistics."""
        return self.corrections

    def basis(self) -> Optional[Eigen]:
        """The refreshed eigenbasis, or ``None`` before the first eigendecomposition."""
        return self.record if isinstance(self.record, Eigen) else None

    def tracks_basis(self) -> bool:
        """Whether a refresh may track the basis (:mod:`~curvature.blocks.power`) instead of
        decomposing: it has one and corrections in it (without corrections, e.g. under
        ``fisher="forward-only"``, the block is KFAC with exact damping, whose eigenpairs
        must be exact).
        """
        return self.basis() is not None and self.corrections is not None

    def install(self, record: Record) -> None:
        """Install a new basis and carry ``Lambda`` over into it.

        The new ``Lambda`` is the diagonal of the previous EKFAC matrix in the new basis:
        ``(RG Lambda RA^T)`` with ``R = (Q_new^T Q_old)^2`` elementwise
        (:func:`carried_corrections`).
        """
        old = self.basis()
        if self.corrections is not None and old is not None and isinstance(record, Eigen):
            fresh = self.corrections_fresh
            self.corrections = carried_corrections(self.corrections, old, record)
            super().install(record)
            if fresh is not None:  # the new KFAC eigenvalues in place of Lambda
                kfac = self._kfac_eigenvalues(self.corrections.dtype)
                self.corrections = torch.where(fresh, kfac, self.corrections)
            return
        super().install(record)

    def eigenvalues(self) -> Tensor:  # noqa: D102
        if self.corrections is not None and self.basis() is not None:
            return self._corrected()
        return super().eigenvalues()

    def matvec(self, M: Tensor) -> Tensor:  # noqa: D102
        if self.corrections is None or self.basis() is None:
            return super().matvec(M)
        return self.in_eigenbasis(M, lambda rot: rot * self._corrected().to(M.dtype))

    def inverse_matvec(self, M: Tensor, damping: float, mode: str = "exact") -> Tensor:  # noqa: D102
        return super().inverse_matvec(M, damping, "exact")

    def inverse_matvec_into(self, v: Any, damping: float, mode: str = "exact") -> None:  # noqa: D102
        super().inverse_matvec_into(v, damping, "exact")

    def _denominators(self, damping: float, dtype: torch.dtype) -> Tensor:
        if self.corrections is not None and self.basis() is not None:  # new every step
            return self._corrected().to(dtype) + damping
        return super()._denominators(damping, dtype)

    def trace(self) -> Tensor:  # noqa: D102
        if self.corrections is None:
            return super().trace()
        return self._raw_corrections().sum()

    def dense(self) -> Tensor:  # noqa: D102
        if self.corrections is None:
            return super().dense()
        r = self.eigen()
        Q = kron(r.QG, r.QA)
        return Q @ torch.diag_embed(self._raw_corrections().flatten(1)) @ Q.mT

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102
        state = super().state_dict()
        c = self._raw_corrections()
        state["corrections"] = None if c is None else c.clone()
        # the weight of the next corrections (it tells "no finite statistics yet")
        for key, t in (("corrections_weight", self.corrections_weight), ("fresh", self._fresh)):
            if t is not None:
                state[key] = t.clone()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:  # noqa: D102
        self.corrections = self.corrections_weight = self._fresh = self._weights = None
        super().load_state_dict(state)
        c = state.get("corrections")
        self.corrections = None if c is None else c.clone()
        u, fresh = state.get("corrections_weight"), state.get("fresh")
        if self.corrections is not None and u is not None:
            self.corrections_weight = u.clone()
            self._fresh = None if fresh is None else fresh.clone()
            if self.basis() is not None:  # KFAC's eigenvalues stand in, as before the save
                kfac = self._kfac_eigenvalues(self.corrections.dtype)
                self.corrections = torch.where(self.corrections_fresh, kfac, self.corrections)
