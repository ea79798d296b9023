"""Refreshing many blocks at once: batched decompositions, few host synchronizations.

A refresh decomposes (or snapshots) every block's factors. On a GPU each check of a
result's finiteness is a host synchronization, so the checks of all blocks are read
together: :func:`snapshots` (with the Cholesky inverses) costs one synchronization,
:func:`eigendecompositions` one (via :func:`~curvature.linalg.eighs`; on a GPU
the eigendecompositions add one per batched call). A block whose decomposition
fails keeps its previous record (:attr:`RefreshStatus.KEPT`) or, without one, fails
(:attr:`RefreshStatus.FAILED`); the caller decides what to say.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Sequence, Tuple

from torch import Tensor

from ..linalg import damped_inverses_or_errors, eighs, inverts_in_place, spare
from .kronecker import KroneckerBlock
from .onesided import OneSidedBlock, full_sides, install_sides
from .records import DampedInverses, Eigen, FactorSnapshot, Outcome, RefreshStatus
from .sum import KroneckerSumBlock


def failure(block, cause: str) -> Outcome:
    """``KEPT`` (the block has a previous record) or ``FAILED``, with the cause."""
    status = RefreshStatus.KEPT if block.record is not None else RefreshStatus.FAILED
    return Outcome(status, None, cause)


def snapshots(
    blocks: Sequence[KroneckerBlock],
    damping_of: Callable[[object], float],
    mode: str = "pi",
    also: Sequence[Any] = (),
) -> Tuple[Dict[KroneckerBlock, Outcome], Dict[KroneckerBlock, DampedInverses], list]:
    """:class:`FactorSnapshot` records of the blocks' factors and their damped inverses,
    in one host read.

    Pi damping needs only ``(A + pi sqrt(lambda) I)^{-1}`` and ``(G + sqrt(lambda)/pi
    I)^{-1}``, which are taken by Cholesky (:func:`~curvature.linalg.damped_inverses_or_errors`)
    at the damping of the moment, from the running factors (``mode``: ``"pi"`` or
    ``"per_factor"``, :meth:`KroneckerBlock.shifts`), which the snapshots copy after
    (the same values). The factors' finiteness, the factorizations' outcomes and the
    values of the tensors ``also`` are read at once. Memory: the blocks' previous
    inverses are dropped first (a block whose refresh fails keeps its record and takes
    them from it again when used), each matrix is inverted right after its factorization
    (written over its damped copy), and the snapshots are copied last: at the peak, one
    factor's copy and inverse beside the state. Where the inverse is written in place
    (:func:`~curvature.linalg.inverts_in_place`: a CPU) the previous inverses' storage
    takes the damped copies, factors and new inverses, and a block refreshed without
    failure copies its snapshot into the previous one's storage (on every device): a
    refresh after the first allocates no ``D x D`` matrix there.

    Returns:
        The outcome per block (a non-finite snapshot: :func:`failure`), the inverses of
        the blocks whose outcome is ``OK`` (their ``source`` the new snapshot: for the
        caller to set once the record is installed), and the values of ``also``.

    """
    spares: list = []  # the previous inverses' storage, for the new ones where in place
    for b in blocks:  # the previous inverses and products go first (a block whose refresh
        # fails keeps its record and recomputes them from it when used): not alive beside
        # the new ones
        old = b.inverses
        reuse = old is not None and inverts_in_place(old.Ainv.device)
        spares += [old.Ainv, old.Ginv] if reuse else [None, None]
        del old
        b.install(b.record)
    mats, shifts, names = [], [], []
    for b in blocks:  # the running factors themselves (nothing writes them until the end)
        sA, sG = b.shifts(damping_of(b), mode, record=FactorSnapshot(b.A, b.G))
        mats += [b.A, b.G]
        shifts += [sA, sG]
        names += [f"A of '{b.label}'", f"G of '{b.label}'"]
    results = damped_inverses_or_errors(mats, shifts, names=names, also=also, into=spares)
    del spares
    results, extra = results[: len(mats)], results[len(mats) :]
    out, inverses = {}, {}
    for i, b in enumerate(blocks):
        a, g = results[2 * i], results[2 * i + 1]
        err = next((e for e in (a, g) if isinstance(e, Exception)), None)
        if err is not None:
            out[b] = failure(b, str(err))
        else:  # copied after the inverses (not alive beside a factorization), into the
            # previous snapshot where it can take it (it is replaced by this one)
            snap = FactorSnapshot(_copy(b.A, b.record, "A"), _copy(b.G, b.record, "G"))
            out[b] = Outcome(RefreshStatus.OK, snap)
            inverses[b] = DampedInverses(a, g, damping_of(b), snap, mode)
    return out, inverses, extra


def _copy(factor: Tensor, previous: Any, side: str) -> Tensor:
    """A copy of a running ``factor``: into the ``side`` of the ``previous`` record where that
    is a :class:`FactorSnapshot` whose tensor can take it (not the factor's own storage:
    before the first refresh a block's record may be its running factors themselves).
    """
    old = getattr(previous, side) if isinstance(previous, FactorSnapshot) else None
    if spare(old, factor.shape, factor.dtype, factor.device) and (
        old.untyped_storage().data_ptr() != factor.untyped_storage().data_ptr()
    ):
        return old.copy_(factor)
    return factor.clone()


def eigendecompositions(
    blocks: Sequence,
    damping_of: Callable[[object], float],
    also: Sequence[Any] = (),
    onesided: Sequence[OneSidedBlock] = (),
) -> Tuple[Dict[object, Outcome], list]:
    """:class:`Eigen` records (Kronecker blocks) and generalized ones (sum blocks).

    The eigendecompositions of all Kronecker blocks' factors run through
    :func:`~curvature.linalg.eighs` (one host read for all of them, which also reads the
    tensors ``also``: their values are returned second), together with the full sides
    of the ``onesided`` blocks (refreshed here: :func:`~.onesided.install_sides`; on a
    GPU their sizes join the same batched calls).
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
    jobs, sides, side_names = full_sides(onesided)
    results = eighs(mats + sides, names + side_names, also)
    install_sides(jobs, results[len(mats) : len(mats) + len(sides)])
    results, extra = results[: len(mats)], results[len(mats) + len(sides) :]
    for i, b in enumerate(single):
        a, g = results[2 * i], results[2 * i + 1]
        err = next((e for e in (a, g) if isinstance(e, Exception)), None)
        out[b] = (
            failure(b, str(err)) if err is not None else Outcome(RefreshStatus.OK, Eigen(*a, *g))
        )
    return out, extra


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
