"""Refreshing many blocks at once: batched decompositions, few host synchronizations.

A refresh decomposes (or snapshots) every block's factors. On a GPU each check of a
result's finiteness is a host synchronization, so the checks of all blocks are read
together: :func:`snapshots` costs one synchronization, :func:`eigendecompositions` two
(via :func:`~curvature.linalg.eighs`), :func:`invert` one. A block whose decomposition
fails keeps its previous record (:attr:`RefreshStatus.KEPT`) or, without one, fails
(:attr:`RefreshStatus.FAILED`); the caller decides what to say.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

from ..linalg import damped_inverses, eighs, finite_flags, non_finite_message
from .kronecker import KroneckerBlock
from .records import DampedInverses, Eigen, FactorSnapshot, Outcome, RefreshStatus
from .sum import KroneckerSumBlock


def failure(block, cause: str) -> Outcome:
    """``KEPT`` (the block has a previous record) or ``FAILED``, with the cause."""
    status = RefreshStatus.KEPT if block.record is not None else RefreshStatus.FAILED
    return Outcome(status, None, cause)


def snapshots(
    blocks: Sequence[KroneckerBlock], also: Sequence[Any] = ()
) -> Tuple[Dict[KroneckerBlock, Outcome], list]:
    """:class:`FactorSnapshot` records of the blocks' factors (one synchronization).

    Pi damping needs only ``(A + pi sqrt(lambda) I)^{-1}`` and ``(G + sqrt(lambda)/pi
    I)^{-1}``, which :func:`invert` takes by Cholesky at the damping of the moment.
    The values of the tensors ``also`` are read in the same synchronization and
    returned second.
    """
    read = finite_flags([m for b in blocks for m in (b.A, b.G)], also)
    flags, extra = read[: 2 * len(blocks)], read[2 * len(blocks) :]
    out = {}
    for i, b in enumerate(blocks):
        bad = [f for f, ok in zip(("A", "G"), flags[2 * i : 2 * i + 2]) if not ok]
        if bad:
            out[b] = failure(b, non_finite_message(f"{bad[0]} of '{b.label}'"))
        else:
            out[b] = Outcome(RefreshStatus.OK, FactorSnapshot(b.A.clone(), b.G.clone()))
    return out, extra


def eigendecompositions(
    blocks: Sequence, damping_of: Callable[[object], float], also: Sequence[Any] = ()
) -> Tuple[Dict[object, Outcome], list]:
    """:class:`Eigen` records (Kronecker blocks) and generalized ones (sum blocks).

    The eigendecompositions of all Kronecker blocks' factors run through
    :func:`~curvature.linalg.eighs` (two synchronizations for all of them), whose first
    one also reads the tensors ``also`` (their values are returned second).
    """
    out: Dict[object, Outcome] = {}
    single = []
    for b in blocks:
        if isinstance(b, KroneckerSumBlock):
            try:
                out[b] = Outcome(RefreshStatus.OK, b.decompose(damping_of(b)))
            except RuntimeError as err:
                out[b] = failure(b, str(err))
        else:
            single.append(b)
    mats, names = [], []
    for b in single:
        mats += [b.A, b.G]
        names += [f"A of '{b.label}'", f"G of '{b.label}'"]
    results = eighs(mats, names, also)
    results, extra = results[: len(mats)], results[len(mats) :]
    for i, b in enumerate(single):
        a, g = results[2 * i], results[2 * i + 1]
        err = next((e for e in (a, g) if isinstance(e, Exception)), None)
        out[b] = (
            failure(b, str(err)) if err is not None else Outcome(RefreshStatus.OK, Eigen(*a, *g))
        )
    return out, extra


def invert(
    blocks: Sequence[KroneckerBlock], damping_of: Callable[[object], float], mode: str = "pi"
) -> None:
    """Cache the damped inverses of blocks with a :class:`FactorSnapshot` (one pass).

    ``mode``: ``"pi"`` or ``"per_factor"`` (:meth:`KroneckerBlock.shifts`).

    The Cholesky factorizations' outcomes are read in one synchronization for all
    blocks (the snapshots' finiteness was checked when they were taken).
    """
    jobs = [b for b in blocks if isinstance(b.record, FactorSnapshot)]
    mats, shifts, names = [], [], []
    for b in jobs:
        sA, sG = b.shifts(damping_of(b), mode)
        mats += [b.record.A, b.record.G]
        shifts += [sA, sG]
        names += [f"A of '{b.label}'", f"G of '{b.label}'"]
    invs = damped_inverses(mats, shifts, names=names, check_finite=False)
    for i, b in enumerate(jobs):
        b.inverses = DampedInverses(invs[2 * i], invs[2 * i + 1], damping_of(b), b.record, mode)


def block_state(block: Any) -> Dict[str, Any]:
    """A block's ``state_dict`` with its type, for :func:`restore_block`."""
    return {"type": type(block).__name__, **block.state_dict()}


def restore_block(name: str, index: Any, state: Dict[str, Any], kronecker: type) -> Any:
    """The block saved by :func:`block_state`, on ``index``.

    A saved single-term Kronecker block is restored as ``kronecker`` (the loading
    optimizer's type: a KFAC state loads into EKFAC and back with the same factors).
    """
    state = dict(state)
    kind = state.pop("type")
    cls = KroneckerSumBlock if kind == KroneckerSumBlock.__name__ else kronecker
    block = cls(name, index)
    block.load_state_dict(state)
    return block
