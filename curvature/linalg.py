"""The only caller of ``torch.linalg``: symmetric eigendecompositions with fallbacks.

Decompositions never run in half precision: inputs are promoted to at least float32
(float64 on retry). Every result is checked for finiteness; a failure retries in
float64, then with a small diagonal jitter, and only then raises with the name of the
matrix and the suggestion to raise the damping.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import rng


def symmetrize(M: Tensor) -> Tensor:
    """``(M + M^T) / 2`` over the last two axes (one temporary: the sum, halved in place)."""
    return (M + M.transpose(-1, -2)).mul_(0.5)


def eigh(M: Tensor, *, name: str = "matrix", canonical: bool = False) -> Tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix (batched).

    Args:
        M: ``[..., D, D]`` symmetric positive semi-definite.
        name: Used in the error message.
        canonical: The null space's eigenvectors by :func:`canonical_null_basis`.

    Returns:
        ``(evals [..., D], evecs [..., D, D])`` in ``M``'s dtype (at least float32).

    Raises:
        RuntimeError: For non-finite entries, or when the decomposition fails in float64
            even with jitter.

    """
    (res,) = eighs([M], [name], canonical=[canonical])  # one host read (finiteness, null space)
    if isinstance(res, Exception):
        raise res
    return res


def eighs(mats: Sequence[Tensor], names: Sequence[str], also=(), canonical=()) -> List[Any]:
    """:func:`eigh` of several matrices, with one host read for all of them.

    Every matrix is decomposed as it is symmetrized (non-finite entries zeroed first, so
    that the decomposition of a bad matrix runs and is thrown away); then its finiteness
    and its result's are read at once, together with the values of ``also``. Only a
    matrix whose first attempt fails pays for its retries (float64, then with jitter)
    one by one. On a GPU ``torch.linalg.eigh`` also reads its error codes once per
    call: equal shapes share one call, and on :data:`PAD_EIGH_DEVICES` smaller sizes
    join a larger size's call within :data:`PAD_EIGH_COST` (float32 sizes in
    :data:`FLOAT64_EIGH_SIZES` solved in float64). The values of the tensors ``also`` are
    appended to the returned list (:func:`host_values`). Where ``canonical[i]``, matrix
    ``i``'s eigenvectors of its numerical null space (:func:`null_count`, read with the
    rest) are replaced by :func:`canonical_null_basis` (not after a retry).

    Returns:
        Per matrix ``(evals, evecs)`` as from :func:`eigh`, or the ``RuntimeError`` that
        :func:`eigh` raises for it (non-finite entries, repeated failure).

    """
    out: List[Any] = [None] * len(mats)
    first: Dict[int, Tuple[Tensor, torch.dtype, Optional[Tuple[Tensor, Tensor]]]] = {}
    # the inputs' finiteness, judged on the device now and read below with the results
    inputs = [_finite_sum(M).isfinite() for M in mats]
    for key, idx in _groups(mats).items():  # one batched call per group
        first.update(_first_eighs([mats[i] for i in idx], idx, key, sanitize=True))
    tried = [i for i in range(len(mats)) if first[i][2] is not None]
    results = [_finite_sum(t).isfinite() for i in tried for t in first[i][2]]
    nulls = [i for i in tried if i < len(canonical) and canonical[i]]
    counts = [null_count(first[i][2][0].to(first[i][1])).reshape(-1) for i in nulls]
    read = host_values(inputs + results + counts + list(also))
    n_in, n_res = len(inputs), len(inputs) + len(results)
    ok_in, flags = read[:n_in], read[n_in:n_res]  # (counts as ints: `also` may hold floats)
    null_of = {i: [int(c) for c in v] for i, v in zip(nulls, read[n_res:])}
    extra = read[n_res + len(counts) :]
    for i, name in enumerate(names):
        if not ok_in[i]:
            out[i] = RuntimeError(non_finite_message(f"eigh({name})"))
    for j, i in enumerate(tried):
        evals, evecs = first[i][2]
        if out[i] is None and flags[2 * j] and flags[2 * j + 1]:
            evecs = evecs.to(first[i][1])
            if max(null_of.get(i, [0])) > 1:  # (one null direction: unique up to its sign)
                evecs = canonical_null_basis(evecs, null_of[i])
            out[i] = (evals.clamp_min(0).to(first[i][1]), evecs)
    for i, (S, dtype, _) in first.items():
        if out[i] is None:
            out[i] = _eigh_retries(S, dtype, names[i])
    return out + extra


#: Eigenvalues at most ``NULL_RTOL sqrt(n) eps max(evals)`` make the numerical null space
#: (a rank-deficient ``A^T A`` gives at most 13 eps at ``n = 1537`` in float32, 5 in float64).
NULL_RTOL = 1.0


def null_count(evals: Tensor) -> Tensor:
    """``[...]`` the number of eigenvalues (``[..., n]``) in the numerical null space."""
    n = evals.shape[-1]
    top = evals.amax(-1, keepdim=True).clamp_min(0)
    return (evals <= NULL_RTOL * n**0.5 * torch.finfo(evals.dtype).eps * top).sum(-1)


def canonical_null_basis(evecs: Tensor, ks: Sequence[int]) -> Tensor:
    """``evecs [..., n, n]`` (ascending eigenvalues) with the first ``k`` columns of each
    matrix (``ks``: one per matrix), a basis ``Q_k`` of its null space, replaced by the
    orthonormal basis of ``P R`` (``P = Q_k Q_k^T`` the projector onto that space, ``R [n,
    k]`` the fixed :func:`~curvature.rng.probe_matrix`), ``Q_k U`` with ``U`` the QR factor
    of ``Q_k^T R``: a function of the space alone, which a rounding change of the matrix
    moves by as little (EKFAC's eigenbasis; ``eigh`` picks any basis there). In place, a
    slice of rows at a time (``k x k`` new: a null space can be nearly all of ``n``).
    """
    n = evecs.shape[-1]
    for Q, k in zip(evecs.view(-1, n, n), ks):
        if k > 1:  # (Q_k U a slice of rows at a time)
            U = orthonormal_basis(rng.probe_product(Q[:, :k]), overwrite=True)
            for rows in rng.row_slices(n, k):
                Q[rows, :k] @= U
    return evecs


def _finite_sum(t: Tensor) -> Tensor:
    """``t``'s sum (float32 for half precision): finite iff every entry is (barring overflow)."""
    return t.sum(dtype=torch.float32) if t.dtype in (torch.float16, torch.bfloat16) else t.sum()


#: Devices on which :func:`eighs` decomposes matrices of different sizes (one dtype) in
#: one batched call, the smaller ones padded: ``torch.linalg.eigh`` reads its error codes
#: on the host once per call there (a synchronization each). ``[[S, 0], [0, s I]]`` has
#: the eigenpairs of ``S`` (zero in the padded coordinates) and ``(s, e_k)``; ``s`` below
#: ``S``'s spectrum (``-2 (1 + |M|_F)``) puts them first, and they are dropped (the other
#: pairs are ``S``'s up to rounding). A CPU keeps every size's own call (bit for bit).
PAD_EIGH_DEVICES = ("cuda",)

#: How much more work padding may cost on :data:`PAD_EIGH_DEVICES`: sizes join the next
#: larger size's call (cheapest join first) while ``sum count * m^3`` over the padded
#: sizes ``m`` stays within ``(1 + PAD_EIGH_COST)`` times that of the sizes themselves: a
#: Linear layer's ``G`` (``n``) joins the next layer's ``A = [x | 1]`` almost for free, an
#: MLP 784-2048-2048-10's ``10`` the ``785`` (1.4%), the ``785`` not the ``2049`` (23%).
PAD_EIGH_COST = 0.1

#: Added work (``count * m^3`` units) that padding may always cost, whatever
#: :data:`PAD_EIGH_COST` allows: one ``64 x 64`` decomposition (small ones cost a GPU
#: little besides the synchronization of their call).
PAD_EIGH_FREE = 64**3

#: On :data:`PAD_EIGH_DEVICES`, float32 calls of a size in this range are solved in
#: float64 (results rounded back): ``torch.linalg.eigh`` gives float32 sizes 32-512 to
#: cuSOLVER's Jacobi solver (``syevj``), float64 to divide and conquer (``syevd``),
#: faster from 64 on and 100x more accurate (docs/benchmarks.md, GPU). ``None``: never.
FLOAT64_EIGH_SIZES: Optional[Tuple[int, int]] = (64, 512)


def _groups(mats: Sequence[Tensor]) -> Dict[Tuple[Any, ...], List[int]]:
    """The batched calls (key: size, :func:`solve_dtype`, ...) and their matrices: equal
    shapes together, on :data:`PAD_EIGH_DEVICES` sizes joined within :data:`PAD_EIGH_COST`.
    """
    counts: Dict[Tuple[Any, ...], Dict[int, int]] = {}
    for M in (M for M in mats if M.device.type in PAD_EIGH_DEVICES):
        sizes, n = counts.setdefault((M.dtype, M.device), {}), M.shape[-1]
        sizes[n] = sizes.get(n, 0) + math.prod(M.shape[:-2])
    into = {(*k, n): m for k, sizes in counts.items() for n, m in padded_sizes(sizes).items()}
    groups: Dict[Tuple[Any, ...], List[int]] = {}
    for i, M in enumerate(mats):
        n, padded = M.shape[-1], M.device.type in PAD_EIGH_DEVICES
        key = (into[(M.dtype, M.device, n)], "sizes") if padded else (n, M.shape)
        solve = solve_dtype(M.dtype, key[0], M.device)
        groups.setdefault((key[0], solve, key[1], M.dtype, M.device), []).append(i)
    return groups


def solve_dtype(dtype: torch.dtype, n: int, device: torch.device) -> torch.dtype:
    """The dtype :func:`eighs` solves an ``n x n`` call of ``dtype`` in on ``device``."""
    low, high = FLOAT64_EIGH_SIZES or (1, 0)  # (float32 in the range on PAD_EIGH_DEVICES)
    jacobi = _eigh_dtype(dtype) == torch.float32 and low <= n <= high
    return torch.float64 if jacobi and device.type in PAD_EIGH_DEVICES else _eigh_dtype(dtype)


def padded_sizes(
    counts: Dict[int, int], budget: Optional[float] = None, free: Optional[float] = None
) -> Dict[int, int]:
    """Size ``n`` -> the size ``m >= n`` it is decomposed at on :data:`PAD_EIGH_DEVICES`.

    ``counts``: size to the number of matrices of that size. Greedy: the cheapest join of
    a group into the next larger one, while the added work stays within ``budget``
    (default :data:`PAD_EIGH_COST`) times ``sum count * n^3`` or ``free`` (default
    :data:`PAD_EIGH_FREE`), whichever is more.
    """
    budget = PAD_EIGH_COST if budget is None else budget
    free = PAD_EIGH_FREE if free is None else free
    groups = [[n, counts[n], [n]] for n in sorted(counts)]  # [size, count, members]
    allowed = max(free, budget * sum(c * float(n) ** 3 for n, c in counts.items()))
    spent = 0.0
    while len(groups) > 1:
        costs = [
            groups[j][1] * (float(groups[j + 1][0]) ** 3 - float(groups[j][0]) ** 3)
            for j in range(len(groups) - 1)
        ]
        j = min(range(len(costs)), key=costs.__getitem__)
        if spent + costs[j] > allowed:
            break
        spent += costs[j]
        low = groups.pop(j)
        groups[j][1] += low[1]
        groups[j][2] += low[2]
    return {n: size for size, _, members in groups for n in members}


def _first_eighs(
    mats: Sequence[Tensor], idx: Sequence[int], key: Tuple[Any, ...], sanitize: bool = False
) -> Dict[int, Any]:
    """:func:`_first_eigh` of several matrices in one batched call (on a GPU,
    ``torch.linalg.eigh`` reads its error codes on the host once per call); one by one
    where the batched call raises. Leading axes are flattened into the batch; a matrix
    smaller than the group's size is padded to it (:data:`PAD_EIGH_DEVICES`), all solved
    in the group's dtype (``key``: :func:`_groups`').
    """
    m, dtype, result = max(key[0], *(M.shape[-1] for M in mats)), key[1], _eigh_dtype(key[3])
    if len(mats) == 1 and mats[0].shape[-1] == m:
        return {idx[0]: _first_eigh(mats[0], sanitize=sanitize, solve=dtype)}
    # symmetrized straight into the batch (no stacked copy of the matrices besides it:
    # the memory of decomposing them one by one), in the dtype it is solved in
    counts = [math.prod(M.shape[:-2]) for M in mats]
    S = mats[0].new_empty((sum(counts), m, m), dtype=dtype)
    starts = []
    at = 0
    for M, k in zip(mats, counts):
        n = M.shape[-1]
        M = M.to(dtype).reshape(k, n, n)
        block = S[at : at + k]
        if n == m:
            torch.add(M, M.mT, out=block)
        else:  # [[M + M^T, 0], [0, 2 s I]], halved with the rest below
            block.zero_()
            torch.add(M, M.mT, out=block[:, :n, :n])
            sentinel = -4.0 * (1.0 + torch.linalg.matrix_norm(M.nan_to_num(0.0, 0.0, 0.0)))
            block[:, n:, n:].diagonal(dim1=-2, dim2=-1).copy_(sentinel[:, None])
        starts.append(at)
        at += k
    S, _, res = _first_eigh(S.mul_(0.5), symmetric=True, sanitize=sanitize)
    # with padded members, every result is a copy of its own: a view would keep the whole
    # batch's storage alive, the padded members' share of it too (their results are copies)
    padded = any(M.shape[-1] < m for M in mats)
    out = {}
    for i, M, at, k in zip(idx, mats, starts, counts):
        n = M.shape[-1]
        Si = S[at : at + k, :n, :n].reshape(M.shape)
        if res is None:
            out[i] = _first_eigh(Si, symmetric=True, sanitize=sanitize, result=result)
            continue
        evals, evecs = res[0][at : at + k], res[1][at : at + k]
        if n < m:  # the sentinel pairs first: dropped
            evals, evecs = evals[:, m - n :].contiguous(), evecs[:, :n, m - n :].contiguous()
        elif padded:
            evals, evecs = evals.clone(), evecs.clone()
        out[i] = (Si, result, (evals.reshape(M.shape[:-1]), evecs.reshape(M.shape)))
    return out


def _eigh_dtype(dtype: torch.dtype) -> torch.dtype:  # (at least float32)
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _first_eigh(
    M: Tensor, symmetric: bool = False, sanitize: bool = False, solve=None, result=None
) -> Tuple[Tensor, torch.dtype, Optional[Tuple[Tensor, Tensor]]]:
    """``(S, dtype, (evals, evecs) or None)``: the first attempt of :func:`eigh`, unchecked:
    ``dtype`` the results' (``result``, default ``M``'s, at least float32), ``S`` and the
    pairs ``M`` symmetrized in ``solve`` (default ``dtype``; ``M`` itself where
    ``symmetric``; non-finite entries zeroed where ``sanitize``); ``None`` if eigh raised.
    """
    dtype = result or _eigh_dtype(M.dtype)
    S = M if symmetric else symmetrize(M.to(solve or dtype))
    if sanitize:  # (eighs: a bad matrix is decomposed too, its result dropped with its error)
        S.nan_to_num_(0.0, 0.0, 0.0)
    try:
        return S, dtype, torch.linalg.eigh(S)
    except RuntimeError:
        return S, dtype, None


def _eigh_retries(S: Tensor, dtype: torch.dtype, name: str) -> Any:
    """The retries after a failed first attempt: float64, then with a jitter (or the error)."""
    last: Exception = RuntimeError("the first attempt failed")
    for jitter in (0.0, 1e-10)[S.dtype == torch.float64 :]:  # (a float64 first: jitter)
        A = S.to(torch.float64)
        if jitter:
            scale = A.diagonal(dim1=-2, dim2=-1).abs().mean().clamp_min(1.0)
            A = A + jitter * scale * torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        try:
            evals, evecs = torch.linalg.eigh(A)
        except RuntimeError as err:  # e.g. convergence failure
            last = err
            continue
        if torch.isfinite(evals).all() and torch.isfinite(evecs).all():
            return evals.clamp_min(0).to(dtype), evecs.to(dtype)
    err = RuntimeError(f"eigh({name}) failed in float64 even with jitter; increase the damping.")
    err.__cause__ = last
    return err


def non_finite_message(what: str) -> str:
    """The error message for a matrix ``what`` with NaN or infinite entries."""
    return (
        f"{what}: the matrix has non-finite entries (NaN/inf in the statistics); "
        "check the data and the loss, or lower the learning rate."
    )


def host_values(tensors: Sequence[Tensor]) -> list:
    """The Python values of tensors, one host synchronization per device.

    On a GPU each ``bool(t)`` or ``float(t)`` would wait for the device. Values on one
    device are promoted to a common dtype (``True`` next to floats reads as ``1.0``); a
    0-d tensor gives a number, any other a flat list.
    """
    per_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(tensors):
        per_device.setdefault(t.device, []).append(i)
    out: list = [None] * len(tensors)
    for idx in per_device.values():
        values = torch.cat([tensors[i].reshape(-1) for i in idx]).tolist()
        at = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = values[at] if tensors[i].dim() == 0 else values[at : at + n]
            at += n
    return out


def finite_flags(tensors: Sequence[Tensor], also: Sequence[Tensor] = ()) -> List[bool]:
    """Whether each tensor is free of NaN and infinity (one synchronization per device).

    A tensor's sum is finite iff every entry is (barring overflow of the sum, which runs
    in float32 for half-precision tensors and in the tensor's dtype otherwise: no float64,
    which some devices lack). The values of the tensors ``also`` (e.g. flags of other
    checks; see :func:`host_values`) are read in the same synchronization and appended.
    """
    return host_values([_finite_sum(t).isfinite() for t in tensors] + list(also))


def damped_inverse(M: Tensor, shift, *, name: str = "matrix") -> Tensor:
    """``(M + shift I)^{-1}`` of a symmetric PSD ``M [..., D, D]`` (see :func:`damped_inverses`).

    ``shift`` > 0 is a number or ``[...]``, one per matrix.
    """
    return damped_inverses([M], [shift], names=[name])[0]


def damped_inverses(
    mats: Sequence[Tensor],
    shifts: Sequence,
    *,
    names: Optional[Sequence[str]] = None,
    check_finite: bool = True,
) -> List[Tensor]:
    """``(M + shift I)^{-1}`` for several symmetric PSD ``M [..., D, D]`` and shifts > 0.

    :func:`damped_inverses_or_errors`, raising the first error.

    Returns:
        The inverses, each in its ``M``'s dtype, at least float32.

    Raises:
        RuntimeError: Naming the first matrix with non-finite entries.

    """
    out = damped_inverses_or_errors(mats, shifts, names=names, check_finite=check_finite)
    for inv in out:
        if isinstance(inv, Exception):
            raise inv
    return out


def damped_inverses_or_errors(
    mats: Sequence[Tensor],
    shifts: Sequence,
    *,
    names: Optional[Sequence[str]] = None,
    check_finite: bool = True,
    also: Sequence[Tensor] = (),
    into: Sequence[Optional[Tensor]] = (),
) -> List[Any]:
    """``(M + shift I)^{-1}`` of several symmetric PSD ``M`` (or an error), one host read.

    A Cholesky factorization and its inverse: about five times cheaper than an
    eigendecomposition at ``D`` of several hundred. The factorization reads the lower
    triangle of ``M`` only (``M`` is not symmetrized first: one pass over the ``D^2``
    entries less), and ``torch.cholesky_inverse`` returns an exactly symmetric matrix on the
    CPU (its upper triangle a copy of the lower), returned as it is; on other devices
    (cuSOLVER solves against the identity) the result is symmetrized. Where the shifted
    matrix is not numerically positive definite (a ``shift`` far below the rounding error of ``M``),
    the inverse is taken from :func:`eigh`, whose eigenvalues are clamped at 0, so
    the result is the same as ``Q diag(1 / (max(l, 0) + shift)) Q^T``. The matrices'
    finiteness (unless ``check_finite=False``: the caller checked), the outcomes of
    their factorizations and the values of ``also`` are read in one synchronization
    (a factorization that fails costs more: :func:`eigh`'s).

    ``into`` (optional, one entry per matrix or fewer): storage the caller no longer needs,
    e.g. the previous inverse of the same matrix (:func:`spare`). Where an entry has the
    damped copy's shape, dtype and device, owns its storage and is contiguous, the copy is
    written into it, factorized there and (where :func:`inverts_in_place`) inverted
    there: no new ``D x D`` memory (a CPU's fresh allocations of this size fault their
    pages in: 9.1 against 6.7 ms per ``785 x 785`` factorization and inverse, one
    thread). Whatever it held is overwritten, also where the result is an error.

    Returns:
        Per matrix its inverse (in ``M``'s dtype, at least float32) or the
        ``RuntimeError`` for its non-finite entries; then the values of ``also``
        (:func:`host_values`).

    """
    names = list(names) if names is not None else ["matrix"] * len(mats)
    flags = [_finite_sum(M).isfinite() for M in mats] if check_finite else []
    inverses, infos = [], []
    for i, (M, shift) in enumerate(zip(mats, shifts)):
        dtype = M.dtype if M.dtype in (torch.float32, torch.float64) else torch.float32
        shift = torch.as_tensor(shift, dtype=dtype, device=M.device)
        # a copy, + shift I in place (no identity matrices); the Cholesky factorization
        # reads its lower triangle only (a non-finite matrix fails it or is dropped below)
        buf = into[i] if i < len(into) else None
        if buf is not None and spare(buf, M.shape, dtype, M.device) and buf is not M:
            damped = buf.copy_(M)
        else:
            damped = M.to(dtype, copy=True)
        damped.diagonal(dim1=-2, dim2=-1).add_(shift[..., None])
        L, info, upper = _cholesky_in_place(damped)
        del damped
        # the inverse at once, before the outcome is read (dropped where the factorization
        # failed): one factor alive at a time, not every matrix's factor and inverse
        inverses.append((_cholesky_inverse(L, upper), shift))
        del L
        infos.append(info.ne(0).any())
    read = host_values(flags + infos + list(also))
    finite = read[: len(flags)] if check_finite else [True] * len(mats)
    failed, extra = read[len(flags) : len(flags) + len(infos)], read[len(flags) + len(infos) :]
    out: List[Any] = []
    for M, ok, bad, name in zip(mats, finite, failed, names):
        inv, shift = inverses.pop(0)
        if not ok:
            out.append(RuntimeError(non_finite_message(f"damped_inverse({name})")))
        elif bad or inv is None:
            del inv
            evals, evecs = eigh(M, name=name)
            shifted = evals + shift.to(evals.dtype)[..., None]
            out.append((evecs / shifted[..., None, :]) @ evecs.mT)
        else:
            out.append(inv)
    return out + extra


#: Device types whose Cholesky factorizations run on the column-major view ``A^T`` of a
#: row-major ``A`` (as its upper factor ``U = L^T``, reading the same lower triangle of
#: ``A``): LAPACK's own layout, so torch copies nothing in or out. On one CPU thread at
#: ``D = 785``: factorization 2.8 against 4.2 ms, inverse 3.4 against 4.0 ms.
COLUMN_MAJOR_CHOLESKY_DEVICES = ("cpu",)


def _cholesky_in_place(A: Tensor) -> Tuple[Tensor, Tensor, bool]:
    """``torch.linalg.cholesky_ex`` of a row-major ``A`` written over ``A`` (the
    factorization is in place in LAPACK and cuSOLVER: no second matrix), out of place
    where torch refuses. Returns the factor, the LAPACK info and whether the factor is
    the upper one ``U`` (``U^T U = A``) of ``A``'s column-major view (on
    :data:`COLUMN_MAJOR_CHOLESKY_DEVICES`; either reads the lower triangle of ``A``).
    """
    info = torch.empty(A.shape[:-2], dtype=torch.int32, device=A.device)
    upper = A.device.type in COLUMN_MAJOR_CHOLESKY_DEVICES
    M = A.mT if upper else A
    try:
        L, info = torch.linalg.cholesky_ex(M, upper=upper, out=(M, info))
    except RuntimeError:
        L, info = torch.linalg.cholesky_ex(M, upper=upper)
    return L, info, upper


def _cholesky_inverse(L: Tensor, upper: bool = False) -> Optional[Tensor]:
    """``(L L^T)^{-1}`` (``upper``: ``(L^T L)^{-1}``) from a Cholesky factor, symmetric;
    ``None`` where torch raises (a CPU's LAPACK refuses the lower factor of a failed
    factorization; the caller drops the result of one that failed anyway).

    Exactly symmetric on the CPU (LAPACK's potri, one triangle then a copy of the
    other; returned row-major); CUDA's solves against the identity (cuSOLVER potrs),
    which is not: symmetrized. Written over ``L`` (the caller's to give up) where
    :func:`inverts_in_place` and ``L`` is column-major (LAPACK's potri works in place;
    torch copies the factor into its output first, a no-op there), else new memory.
    """
    into = L if inverts_in_place(L.device) and L.mT.is_contiguous() else None
    try:
        inv = torch.cholesky_inverse(L, upper=upper, out=into)
    except RuntimeError:
        return None
    if inv.device.type != "cpu":
        return symmetrize(inv)
    return inv.mT if inv.mT.is_contiguous() else inv  # (the same values: symmetric)


def inverts_in_place(device: torch.device) -> bool:
    """Whether :func:`damped_inverses_or_errors` writes each inverse over its damped copy
    (its ``into`` storage, where given) on ``device`` (:data:`COLUMN_MAJOR_CHOLESKY_DEVICES`);
    elsewhere only the damped copy goes there and the inverse is new memory, so that
    storage handed in stays alive beside it: pass none there.
    """
    return torch.device(device).type in COLUMN_MAJOR_CHOLESKY_DEVICES


def spare(t: Optional[Tensor], shape, dtype: torch.dtype, device: torch.device) -> bool:
    """``t`` can take a result of ``shape`` and ``dtype`` on ``device`` in place: row-major
    contiguous and the whole of its storage (nothing else lives there; whether anything
    still needs its values is the caller's to know).
    """
    return (
        t is not None
        and tuple(t.shape) == tuple(shape)
        and t.dtype == dtype
        and t.device == device
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def damped_solve(M: Tensor, damping: float, v: Tensor) -> Tensor:
    """``(M + damping I)^{-1} v`` for a dense symmetric ``M [P, P]``."""
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    return torch.linalg.solve(symmetrize(M) + damping * eye, v)


def top_eigenvalues(M: Tensor, k: int) -> list:
    """The ``k`` largest eigenvalues of a dense symmetric matrix, descending."""
    return torch.linalg.eigvalsh(symmetrize(M)).flip(0)[:k].tolist()


def generalized_eigh(B: Tensor, A: Tensor, *, name: str = "matrix") -> Tuple[Tensor, Tensor]:
    """``(mu, P)`` with ``P^T A P = I`` and ``P^T B P = diag(mu)`` (``A`` positive definite):
    the simultaneous diagonalization of two symmetric matrices (batched) that inverts a sum
    of two Kronecker products exactly. With ``A = Q diag(l) Q^T``, ``A^{-1/2} B A^{-1/2} =
    U diag(mu) U^T`` and ``P = A^{-1/2} U``.
    """
    lA, QA = eigh(A, name=name)
    inv_sqrt = QA @ torch.diag_embed(lA.clamp_min(torch.finfo(lA.dtype).tiny).rsqrt()) @ QA.mT
    mu, U = eigh(inv_sqrt @ B @ inv_sqrt, name=name)
    return mu, inv_sqrt @ U


def orthonormal_basis(M: Tensor, overwrite: bool = False) -> Tensor:
    """An orthonormal basis ``Q [..., P, min(P, k)]`` of ``M [..., P, k]``'s columns: the
    reduced QR's Q with ``R``'s diagonal made non-negative (``geqrf``, ``householder_product``,
    no host read), also for a rank-deficient ``M`` (arbitrary directions beyond its range:
    Hutch++ stays unbiased); half precision promoted to float32 and back. ``overwrite``:
    QR and Q in ``M``'s memory (float32/64, ``k <= P``; its values are lost).
    """
    dtype = M.dtype if M.dtype in (torch.float32, torch.float64) else torch.float32
    if M.requires_grad:  # (geqrf has no derivative; the same signs)
        Q, R = torch.linalg.qr(M.to(dtype), mode="reduced")
        return torch.where((R.diagonal(dim1=-2, dim2=-1) < 0)[..., None, :], -Q, Q).to(M.dtype)
    inplace = overwrite and M.dtype == dtype and M.shape[-1] <= M.shape[-2]
    tau = M.new_empty((*M.shape[:-2], M.shape[-1])) if inplace else None
    QR, tau = torch.geqrf(M, out=(M, tau)) if inplace else torch.geqrf(M.to(dtype))
    signs = torch.where(QR.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(dtype).unsqueeze(-2)
    Q = torch.linalg.householder_product(QR[..., : tau.shape[-1]], tau, out=QR if inplace else None)
    return Q.mul_(signs).to(M.dtype)


def eigh_unchecked(M: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`eigh` without host synchronization: no finiteness check, no jitter retries,
    for factors whose finiteness is guaranteed on the device (running averages of checked
    statistics). A decomposition that does not converge is retried once in float64.

    Returns:
        ``(evals >= 0 [..., D], evecs [..., D, D])`` in ``M``'s dtype (at least float32).

    """
    return eighs_unchecked([M])[0]


def eighs_unchecked(mats: Sequence[Tensor]) -> List[Tuple[Tensor, Tensor]]:
    """:func:`eigh_unchecked` of several matrices, without a host read: grouped as in
    :func:`eighs` (one synchronization per batched call on a GPU). A group whose call does
    not converge is decomposed one by one (then as :func:`eigh` retries, or its error).
    Per matrix ``(evals >= 0, evecs)`` in its dtype (at least float32).
    """
    out: List[Any] = [None] * len(mats)
    for key, idx in _groups(mats).items():
        for i, (S, dtype, res) in _first_eighs([mats[i] for i in idx], idx, key).items():
            res = res if res is not None else _eigh_retries(S, dtype, "factor")  # (rare)
            if isinstance(res, Exception):
                raise res
            out[i] = (res[0].clamp_min(0).to(dtype), res[1].to(dtype))
    return out


def least_squares(system: Tensor, rhs: Tensor) -> Tensor:
    """``argmin_x |system x - rhs|`` for a small square ``system [K, K]`` and ``rhs [K]``."""
    return torch.linalg.lstsq(system, rhs[:, None]).solution[:, 0]
