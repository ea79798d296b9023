"""Typed records of a block's refresh: what a decomposition produced, and how it went.

A refresh of a Kronecker block ``kron(G, A)`` (factors ``A [C, D, D]``, ``G [C, D_out,
D_out]``, ``C`` groups) stores one of these records; preconditioning reads it until the
next refresh. They replace positional tuples: every field is named, and a record can be
turned into a list of tensors and back (:meth:`tensors` / :meth:`from_tensors`) to be
exchanged between ranks or saved in a ``state_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence

from torch import Tensor


class RefreshStatus(str, Enum):
    """The outcome of one block's refresh."""

    OK = "ok"  #: the new record is installed
    KEPT = "kept"  #: the decomposition failed; the previous record stays (a warning)
    FAILED = "failed"  #: it failed and there is no previous record (an error)

    @property
    def code(self) -> float:
        """A number for collectives: ``1`` ok, ``2`` kept, ``3`` failed (``0``: none)."""
        return {"ok": 1.0, "kept": 2.0, "failed": 3.0}[self.value]

    @classmethod
    def from_code(cls, code: float) -> RefreshStatus:
        """The inverse of :attr:`code`."""
        return {1: cls.OK, 2: cls.KEPT, 3: cls.FAILED}[int(code)]


@dataclass(frozen=True)
class Outcome:
    """A block's refresh outcome: the status and the record (``OK``) or the cause."""

    status: RefreshStatus
    record: Optional[Any] = None
    cause: str = ""


@dataclass(frozen=True)
class Record:
    """Base of the refresh records: conversion to and from a list of tensors."""

    def tensors(self) -> List[Tensor]:
        """The record's tensor fields, in declaration order."""
        return [
            getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)
        ]

    def state(self) -> Dict[str, Any]:
        """A ``state_dict`` entry: the kind and the fields (tensors cloned)."""
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        return {"kind": type(self).__name__, **{k: _clone(v) for k, v in vals.items()}}

    @staticmethod
    def from_state(state: Dict[str, Any]) -> Record:
        """The record saved by :meth:`state`."""
        state = dict(state)
        cls = RECORDS[state.pop("kind")]
        return cls(**{k: _clone(v) for k, v in state.items()})


@dataclass(frozen=True)
class Eigen(Record):
    """Eigendecompositions ``A = QA diag(lA) QA^T``, ``G = QG diag(lG) QG^T`` (``[C, ...]``)."""

    lA: Tensor
    QA: Tensor
    lG: Tensor
    QG: Tensor

    @classmethod
    def from_tensors(cls, parts: Sequence[Tensor]) -> Eigen:
        """The record of :meth:`tensors`."""
        return cls(*parts)


@dataclass(frozen=True)
class FactorSnapshot(Record):
    """The factors at the refresh, for pi-damped inverses by Cholesky at any damping."""

    A: Tensor
    G: Tensor


@dataclass(frozen=True)
class CurrentFactors(Record):
    """A Cholesky refresh that kept no copy of the factors: its inverses (held beside the
    record, saved with it) were taken from the running factors of that moment, and
    inverses at another damping are taken from the running factors of *their* moment.

    The record of :func:`~curvature.blocks.refresh.snapshots` where the damping does not
    change between refreshes by design (no ``adaptive_damping``, quadratic rule or
    greedy factor damping): a copy of every factor (a third of KFAC's curvature memory)
    would only serve a damping the user changes by hand.
    """


@dataclass(frozen=True)
class GeneralizedEigen(Record):
    """A sum of two Kronecker products, simultaneously diagonalized at one damping.

    ``PA^T (A1 + pi sqrt(lambda) I) PA = I``, ``PA^T A2 PA = diag(muA)``, and likewise
    ``PG``, ``muG`` for ``(G2, G1 + sqrt(lambda) / pi I)``.
    """

    muA: Tensor
    PA: Tensor
    muG: Tensor
    PG: Tensor
    damping: float

    @classmethod
    def from_tensors(cls, parts: Sequence[Tensor], damping: float) -> GeneralizedEigen:
        """The record of :meth:`tensors` (the damping travels separately)."""
        return cls(*parts, damping=damping)


@dataclass(frozen=True)
class DampedInverses:
    """``(A + sA I)^{-1}``, ``(G + sG I)^{-1}`` at ``damping``.

    ``mode`` ``"pi"``: ``sA = pi sqrt(lambda)``, ``sG = sqrt(lambda) / pi``;
    ``"per_factor"``: ``sA = sG = lambda``.
    """

    Ainv: Tensor
    Ginv: Tensor
    damping: float
    source: Record  #: the record they were computed from (identity checked on reuse)
    mode: str = "pi"
    #: ``[L]`` device index: ``Ainv`` is ``[C, L, L]``, the inverse on these columns of
    #: ``A`` alone (the others' rows and columns are zero: ``1 / sA`` there;
    #: :mod:`curvature.blocks.live`); ``None``: ``Ainv`` is ``[C, D, D]``.
    live: Optional[Tensor] = None
    sA: Optional[Tensor] = None  #: ``[C]``: the shift of ``A`` (with ``live``)


RECORDS = {cls.__name__: cls for cls in (CurrentFactors, Eigen, FactorSnapshot, GeneralizedEigen)}


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, Tensor) else x
