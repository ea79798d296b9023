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

from ..linalg import (
    damped_inverses_or_errors,
    eighs,
    finite_flags,
    inverts_in_place,
    non_finite_message,
    spare,
)
from .kronecker import EigenCorrectedBlock, KroneckerBlock
from .live import compact
from .onesided import OneSidedBlock, full_sides, install_sides
from .power import power_steps
from .records import CurrentFactors, DampedInverses, Eigen, FactorSnapshot, Outcome, RefreshStatus
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
    keep: bool = True,
) -> Tuple[Dict[KroneckerBlock, Outcome], Dict[KroneckerBlock, DampedInverses], list]:
    """The blocks' damped inverses by Cholesky and their records, in one host read (two
    on a CPU without ``keep``, below).

    Pi damping needs only ``(A + pi sqrt(lambda) I)^{-1}`` and ``(G + sqrt(lambda)/pi
    I)^{-1}``, which are taken by Cholesky (:func:`~curvature.linalg.damped_inverses_or_errors`)
    at the damping of the moment, from the running factors (``mode``: ``"pi"`` or
    ``"per_factor"``, :meth:`KroneckerBlock.shifts`). The factors' finiteness, the
    factorizations' outcomes and the values of the tensors ``also`` are read at once.

    ``keep`` (where the damping changes between refreshes by design: adaptive damping,
    the quadratic rule): the record is a :class:`FactorSnapshot`, a copy of the factors,
    from which inverses at another damping are taken until the next refresh. Memory: the
    blocks' previous inverses are dropped first (a block whose refresh fails keeps its
    record and takes them from it again when used), each matrix is inverted right after
    its factorization (written over its damped copy), and the snapshots are copied last:
    at the peak, one factor's copy and inverse beside the state. Where the inverse is
    written in place (:func:`~curvature.linalg.inverts_in_place`: a CPU) the previous
    inverses' storage takes the damped copies, factors and new inverses, and a block
    refreshed without failure copies its snapshot into the previous one's storage (on
    every device): a refresh after the first allocates no ``D x D`` matrix there.

    Without ``keep``: the record is a :class:`CurrentFactors` (no copy: a third of the
    curvature memory less between refreshes; inverses at another damping come from the
    running factors of that moment). A block whose refresh fails keeps its previous
    inverses themselves, so they stay alive until the outcomes are read (on a GPU, new
    memory beside them: the same peak as with the snapshots, which they replace). Where
    the inverse is written in place, the previous inverses take the new ones (no ``D x
    D`` allocation) only for blocks whose factors are finite, which is read first: one
    host read more there (a CPU, where it costs no synchronization).

    Returns:
        The outcome per block (a non-finite factor: :func:`failure`), the inverses of
        the blocks whose outcome is ``OK`` (their ``source`` the new record: for the
        caller to set once the record is installed), and the values of ``also``.

    """
    if not keep:
        return _current(blocks, damping_of, mode, also)
    spares: list = []  # the previous inverses' storage, for the new ones where in place
    for b in blocks:  # the previous inverses and products go first (a block whose refresh
        # fails keeps its record and recomputes them from it when used): not alive beside
        # the new ones
        old = b.inverses
        reuse = old is not None and inverts_in_place(old.Ainv.device)
        spares += [old.Ainv, old.Ginv] if reuse else [None, None]
        del old
        b.install(b.record)
    mats, shifts, names, lives = _damped(blocks, damping_of, mode)
    results = damped_inverses_or_errors(mats, shifts, names=names, also=also, into=spares)
    del spares

    def snapshot(b: KroneckerBlock) -> FactorSnapshot:
        # copied after the inverses (not alive beside a factorization), into the previous
        # snapshot where it can take it (it is replaced by this one)
        return FactorSnapshot(_copy(b.A, b.record, "A"), _copy(b.G, b.record, "G"))

    return _outcomes(blocks, results, damping_of, mode, snapshot, {}, lives)


def _damped(blocks: Sequence[KroneckerBlock], damping_of, mode: str):
    """The running factors of ``blocks``, their shifts at the damping of the moment, names,
    and per block its live columns' index and ``A``'s shift (``A`` on those columns
    alone, a copy: :mod:`.live`) or ``None``.
    """
    mats, shifts, names, lives = [], [], [], []
    for b in blocks:  # the running factors themselves (nothing writes them until the end)
        sA, sG = b.shifts(damping_of(b), mode, record=CurrentFactors())
        live = b.live_index(b.A)
        mats += [b.A if live is None else compact(b.A, live), b.G]
        shifts += [sA, sG]
        names += [f"A of '{b.label}'", f"G of '{b.label}'"]
        lives.append(None if live is None else (live, sA))
    return mats, shifts, names, lives


def _current(blocks: Sequence[KroneckerBlock], damping_of, mode: str, also: Sequence[Any]):
    """:func:`snapshots` without ``keep``: :class:`CurrentFactors` records."""
    out: Dict[KroneckerBlock, Outcome] = {}
    reuse = {
        id(b) for b in blocks if b.inverses is not None and inverts_in_place(b.inverses.Ainv.device)
    }
    if reuse:  # (a CPU) the factors' finiteness first: which previous inverses may take
        # the new ones (a non-finite block keeps them, untouched)
        finite = finite_flags([t for b in blocks for t in (b.A, b.G)])
        for i, b in enumerate(blocks):
            if not (finite[2 * i] and finite[2 * i + 1]):
                name = f"{'A' if not finite[2 * i] else 'G'} of '{b.label}'"
                out[b] = failure(b, non_finite_message(f"damped_inverse({name})"))
        blocks = [b for b in blocks if b not in out]
    spares = []
    for b in blocks:
        old = b.inverses if id(b) in reuse else None
        spares += [None, None] if old is None else [old.Ainv, old.Ginv]
    mats, shifts, names, lives = _damped(blocks, damping_of, mode)
    results = damped_inverses_or_errors(
        mats, shifts, names=names, also=also, into=spares, check_finite=not reuse
    )
    del spares
    return _outcomes(blocks, results, damping_of, mode, lambda b: CurrentFactors(), out, lives)


def _outcomes(blocks, results: list, damping_of, mode: str, record_of, out: dict, lives: list):
    """Per block (two matrices each in ``results``, then the values of ``also``) its
    outcome in ``out`` (a failure, or ``OK`` with ``record_of(block)``) and the inverses
    of the ``OK`` ones (``lives``: :func:`_damped`'s); returns ``(out, inverses, also's
    values)``.
    """
    n = 2 * len(blocks)
    results, extra = results[:n], results[n:]
    inverses = {}
    for i, b in enumerate(blocks):
        a, g = results[2 * i], results[2 * i + 1]
        err = next((e for e in (a, g) if isinstance(e, Exception)), None)
        if err is not None:
            out[b] = failure(b, str(err))
        else:
            record = record_of(b)
            out[b] = Outcome(RefreshStatus.OK, record)
            live = lives[i] or (None, None)
            inverses[b] = DampedInverses(a, g, damping_of(b), record, mode, *live)
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
    power: bool = False,
) -> Tuple[Dict[object, Outcome], list]:
    """:class:`Eigen` records (Kronecker blocks) and generalized ones (sum blocks).

    The eigendecompositions of all Kronecker blocks' factors run through
    :func:`~curvature.linalg.eighs` (one host read for all of them, which also reads the
    tensors ``also``: their values are returned second), together with the full sides
    of the ``onesided`` blocks (refreshed here: :func:`~.onesided.install_sides`; on a
    GPU their sizes join the same batched calls). With ``power``, an EKFAC block that
    has a basis and corrections (:meth:`~.kronecker.EigenCorrectedBlock.tracks_basis`)
    gets its next one by :func:`~.power.power_steps` instead (no eigendecomposition; its
    finiteness read with the rest).
    """
    out: Dict[object, Outcome] = {}
    single, stepped = [], []
    for b in blocks:
        if isinstance(b, KroneckerSumBlock):
            try:
                out[b] = Outcome(RefreshStatus.OK, b.decompose(damping_of(b)))
            except RuntimeError as err:
                out[b] = failure(b, str(err))
        elif power and isinstance(b, EigenCorrectedBlock) and b.tracks_basis():
            stepped.append(b)
        else:
            single.append(b)
    steps, ok = power_steps(
        [p for b in stepped for p in ((b.A, b.basis().QA), (b.G, b.basis().QG))]
    )
    also = [*ok, *also]
    mats, names, canonical = [], [], []
    for b in single:
        mats += [b.A, b.G]
        names += [f"A of '{b.label}'", f"G of '{b.label}'"]
        # EKFAC's corrections depend on the basis within a null space: a canonical one
        canonical += [b.canonical_basis] * 2
    jobs, sides, side_names = full_sides(onesided)
    results = eighs(mats + sides, names + side_names, also, canonical)
    install_sides(jobs, results[len(mats) : len(mats) + len(sides)])
    results, extra = results[: len(mats)], results[len(mats) + len(sides) :]
    ok, extra = extra[: len(ok)], extra[len(ok) :]
    for i, b in enumerate(stepped):
        if ok[2 * i] and ok[2 * i + 1]:
            out[b] = Outcome(RefreshStatus.OK, Eigen(*steps[2 * i], *steps[2 * i + 1]))
        else:
            which = "A" if not ok[2 * i] else "G"
            out[b] = failure(b, non_finite_message(f"power_step({which} of '{b.label}')"))
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
