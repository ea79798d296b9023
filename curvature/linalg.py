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


def symmetrize(M: Tensor) -> Tensor:
    """``(M + M^T) / 2`` over the last two axes (one temporary: the sum, halved in place)."""
    return (M + M.transpose(-1, -2)).mul_(0.5)


def eigh(M: Tensor, *, name: str = "matrix") -> Tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix (batched).

    Args:
        M: ``[..., D, D]`` symmetric positive semi-definite.
        name: Used in the error message.

    Returns:
        ``(evals [..., D], evecs [..., D, D])`` in ``M``'s dtype (at least float32).

    Raises:
        RuntimeError: For non-finite entries, or when the decomposition fails in float64
            even with jitter.

    """
    require_finite(M, f"eigh({name})")
    S, dtype, res = _first_eigh(M)
    if res is not None and torch.isfinite(res[0]).all() and torch.isfinite(res[1]).all():
        return res[0].clamp_min(0).to(dtype), res[1].to(dtype)
    res = _eigh_retries(S, dtype, name)
    if isinstance(res, Exception):
        raise res
    return res


def eighs(mats: Sequence[Tensor], names: Sequence[str], also: Sequence[Tensor] = ()) -> List[Any]:
    """:func:`eigh` of several matrices, with two host synchronizations for all of them.

    Every matrix's finiteness is read at once, and so is every first attempt's result
    (in the matrix's dtype); only a matrix whose first attempt fails pays for its
    retries (float64, then with jitter) one by one.

    The values of the tensors ``also`` are read in the first synchronization and
    appended to the returned list (:func:`host_values`).

    Returns:
        Per matrix ``(evals, evecs)`` as from :func:`eigh`, or the ``RuntimeError`` that
        :func:`eigh` raises for it (non-finite entries, repeated failure).

    """
    out: List[Any] = [None] * len(mats)
    first: Dict[int, Tuple[Tensor, torch.dtype, Optional[Tuple[Tensor, Tensor]]]] = {}
    read = finite_flags(mats, also)
    extra = read[len(mats) :]
    for i, (ok, name) in enumerate(zip(read, names)):
        if not ok:
            out[i] = RuntimeError(non_finite_message(f"eigh({name})"))
    groups: Dict[Tuple[Any, ...], List[int]] = {}  # one batched call per group
    for i, key in _group_keys(mats, read).items():
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
        first.update(_first_eighs([mats[i] for i in idx], idx))
    tried = [i for i, (_, _, res) in first.items() if res is not None]
    flags = finite_flags([t for i in tried for t in first[i][2]]) if tried else []
    for j, i in enumerate(tried):
        evals, evecs = first[i][2]
        if flags[2 * j] and flags[2 * j + 1]:
            out[i] = (evals.clamp_min(0).to(first[i][1]), evecs.to(first[i][1]))
    for i, (S, dtype, _) in first.items():
        if out[i] is None:
            out[i] = _eigh_retries(S, dtype, names[i])
    return out + extra


#: Devices on which :func:`eighs` also decomposes the ``n x n`` and ``(n+1) x (n+1)``
#: matrices of one dtype in one batched call, the smaller ones padded (a Linear layer's
#: ``G`` and the next layer's ``A``, ``[x | 1]``, differ by one): ``torch.linalg.eigh``
#: reads its error codes on the host once per call there (a synchronization each).
#: ``[[S, 0], [0, s]]`` has the eigenpairs of ``S`` (zero in the last coordinate) and
#: ``(s, e_{n+1})``; ``s`` below the spectrum of ``S`` (``-2 (1 + |M|_F)``) makes it the
#: first in ascending order, and it is dropped. The tridiagonal reduction never mixes the
#: zero row in, so the other pairs are those of ``S`` up to rounding. On a CPU (no
#: synchronization to save) every size keeps its own call, bit for bit as one by one.
PAD_EIGH_DEVICES = ("cuda",)


def _group_keys(mats: Sequence[Tensor], ok: Sequence[bool]) -> Dict[int, Tuple[Any, ...]]:
    """The batched call of each finite matrix: equal shapes together (every device), and
    on :data:`PAD_EIGH_DEVICES` the sizes ``n`` and ``n + 1`` of one dtype (``n`` padded;
    not chained: an ``n + 1`` that takes ``n`` is not padded itself).
    """
    sizes: Dict[Tuple[Any, ...], set] = {}
    for M, good in zip(mats, ok):
        if good and M.device.type in PAD_EIGH_DEVICES:
            sizes.setdefault((M.dtype, M.device), set()).add(M.shape[-1])
    into: Dict[Tuple[Any, ...], int] = {}  # (dtype, device, n) -> the size it joins
    for (dtype, device), ns in sizes.items():
        for n in sorted(ns):
            if n + 1 in ns and (dtype, device, n) not in into:  # (n itself not taken)
                into[(dtype, device, n)] = into[(dtype, device, n + 1)] = n + 1
    keys: Dict[int, Tuple[Any, ...]] = {}
    for i, (M, good) in enumerate(zip(mats, ok)):
        if good:
            n = M.shape[-1]
            if M.device.type in PAD_EIGH_DEVICES:
                keys[i] = ("sizes", into.get((M.dtype, M.device, n), n), M.dtype, M.device)
            else:
                keys[i] = (M.shape, M.dtype, M.device)
    return keys


def _first_eighs(mats: Sequence[Tensor], idx: Sequence[int]) -> Dict[int, Any]:
    """:func:`_first_eigh` of several matrices in one batched call (on a GPU,
    ``torch.linalg.eigh`` reads its error codes on the host once per call); one by one
    where the batched call raises. Leading axes are flattened into the batch; a matrix
    smaller by one than the largest is padded (:data:`PAD_EIGH_DEVICES`).
    """
    m = max(M.shape[-1] for M in mats)
    if len(mats) == 1 and mats[0].shape[-1] == m:
        return {idx[0]: _first_eigh(mats[0])}
    # symmetrized straight into the batch (no stacked copy of the matrices besides it:
    # the memory of decomposing them one by one)
    dtype = _eigh_dtype(mats[0])
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
        else:  # [[M + M^T, 0], [0, 2 s]], halved with the rest below
            block.zero_()
            torch.add(M, M.mT, out=block[:, :n, :n])
            block[:, n, n] = -4.0 * (1.0 + torch.linalg.matrix_norm(M))
        starts.append(at)
        at += k
    S, dtype, res = _first_eigh(S.mul_(0.5), symmetric=True)
    out = {}
    for i, M, at, k in zip(idx, mats, starts, counts):
        n = M.shape[-1]
        Si = S[at : at + k, :n, :n].reshape(M.shape)
        if res is None:
            out[i] = _first_eigh(Si, symmetric=True)
            continue
        evals, evecs = res[0][at : at + k], res[1][at : at + k]
        if n < m:  # the sentinel pair first: dropped
            evals, evecs = evals[:, 1:].contiguous(), evecs[:, :n, 1:].contiguous()
        out[i] = (Si, dtype, (evals.reshape(M.shape[:-1]), evecs.reshape(M.shape)))
    return out


def _eigh_dtype(M: Tensor) -> torch.dtype:
    """The dtype :func:`eigh` decomposes ``M`` in: ``M``'s, at least float32."""
    return M.dtype if M.dtype in (torch.float32, torch.float64) else torch.float32


def _first_eigh(
    M: Tensor, symmetric: bool = False
) -> Tuple[Tensor, torch.dtype, Optional[Tuple[Tensor, Tensor]]]:
    """``(S, dtype, (evals, evecs) or None)``: the first attempt of :func:`eigh`, unchecked.

    ``S`` is the symmetrized ``M`` in ``dtype`` (``M``'s, at least float32; ``M`` itself
    where ``symmetric``: already symmetrized in that dtype); ``None`` when
    ``torch.linalg.eigh`` raised (e.g. no convergence).
    """
    dtype = _eigh_dtype(M)
    S = M if symmetric else symmetrize(M.to(dtype))
    try:
        return S, dtype, torch.linalg.eigh(S)
    except RuntimeError:
        return S, dtype, None


def _eigh_retries(S: Tensor, dtype: torch.dtype, name: str) -> Any:
    """The retries after a failed first attempt: float64, then with a jitter (or the error)."""
    last: Exception = RuntimeError("the first attempt failed")
    for jitter in (0.0, 1e-10):
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


def require_finite(M: Tensor, what: str) -> None:
    """Raise a ``RuntimeError`` naming ``what`` if ``M`` has a NaN or an infinity."""
    if not torch.isfinite(M).all():
        raise RuntimeError(non_finite_message(what))


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
    low = (torch.float16, torch.bfloat16)
    sums = [t.sum(dtype=torch.float32) if t.dtype in low else t.sum() for t in tensors]
    return host_values([s.isfinite() for s in sums] + list(also))


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

    A Cholesky factorization and its inverse: about five times cheaper than an
    eigendecomposition at ``D`` of several hundred. The factorization reads the lower
    triangle of ``M`` only (``M`` is not symmetrized first: one pass over the ``D^2``
    entries less), and ``torch.cholesky_inverse`` returns an exactly symmetric matrix on the
    CPU (its upper triangle a copy of the lower), returned as it is; on other devices
    (cuSOLVER solves against the identity) the result is symmetrized. Where the shifted
    matrix is not numerically positive definite (a ``shift`` far below the rounding error of ``M``),
    the inverse is taken from :func:`eigh`, whose eigenvalues are clamped at 0, so
    the result is the same as ``Q diag(1 / (max(l, 0) + shift)) Q^T``. The matrices'
    finiteness (unless ``check_finite=False``: the caller checked) and the outcomes
    of their factorizations are read in one synchronization each.

    Returns:
        The inverses, each in its ``M``'s dtype, at least float32.

    Raises:
        RuntimeError: Naming the first matrix with non-finite entries.

    """
    names = list(names) if names is not None else ["matrix"] * len(mats)
    if check_finite:
        for ok, name in zip(finite_flags(mats), names):
            if not ok:
                raise RuntimeError(non_finite_message(f"damped_inverse({name})"))
    factors, infos = [], []
    for M, shift in zip(mats, shifts):
        dtype = M.dtype if M.dtype in (torch.float32, torch.float64) else torch.float32
        shift = torch.as_tensor(shift, dtype=dtype, device=M.device)
        # a copy, + shift I in place (no identity matrices); the Cholesky factorization
        # reads its lower triangle only
        damped = M.to(dtype, copy=True)
        damped.diagonal(dim1=-2, dim2=-1).add_(shift[..., None])
        L, info = torch.linalg.cholesky_ex(damped)
        del damped
        factors.append((L, shift))
        infos.append(info.ne(0).any())
    out = []
    for M, bad, name in zip(mats, host_values(infos), names):
        L, shift = factors.pop(0)  # (each factor freed once its inverse is taken)
        if bad:
            evals, evecs = eigh(M, name=name)
            shifted = evals + shift.to(evals.dtype)[..., None]
            out.append((evecs / shifted[..., None, :]) @ evecs.mT)
        else:
            inv = torch.cholesky_inverse(L)
            # exactly symmetric on the CPU (LAPACK's potri, its upper triangle then a copy of
            # the lower); CUDA's solves against the identity (cuSOLVER potrs), which is not
            out.append(inv if inv.device.type == "cpu" else symmetrize(inv))
    return out


def pi_factor(mean_a: Tensor, mean_g: Tensor) -> Tensor:
    """The pi heuristic ``sqrt(mean eig(A) / mean eig(G))`` (Martens & Grosse, 2015).

    Tikhonov damping of a Kronecker product splits ``lambda`` as
    ``(A + pi sqrt(lambda) I) x (G + sqrt(lambda) / pi I)``. The means are the factors'
    average eigenvalues (= average diagonal entries), batched over leading axes.
    """
    return (mean_a / mean_g.clamp_min(1e-30)).clamp_min(1e-30).sqrt()


def damped_solve(M: Tensor, damping: float, v: Tensor) -> Tensor:
    """``(M + damping I)^{-1} v`` for a dense symmetric ``M [P, P]``."""
    eye = torch.eye(M.shape[-1], dtype=M.dtype, device=M.device)
    return torch.linalg.solve(symmetrize(M) + damping * eye, v)


def top_eigenvalues(M: Tensor, k: int) -> list:
    """The ``k`` largest eigenvalues of a dense symmetric matrix, descending."""
    return torch.linalg.eigvalsh(symmetrize(M)).flip(0)[:k].tolist()


def generalized_eigh(B: Tensor, A: Tensor, *, name: str = "matrix") -> Tuple[Tensor, Tensor]:
    """``(mu, P)`` with ``P^T A P = I`` and ``P^T B P = diag(mu)`` (``A`` positive definite).

    Simultaneous diagonalization of two symmetric matrices (batched), used to invert a sum
    of two Kronecker products exactly: with ``A = Q diag(l) Q^T``,
    ``A^{-1/2} B A^{-1/2} = U diag(mu) U^T`` and ``P = A^{-1/2} U``.
    """
    lA, QA = eigh(A, name=name)
    inv_sqrt = QA @ torch.diag_embed(lA.clamp_min(torch.finfo(lA.dtype).tiny).rsqrt()) @ QA.mT
    mu, U = eigh(inv_sqrt @ B @ inv_sqrt, name=name)
    return mu, inv_sqrt @ U


def orthonormal_basis(M: Tensor) -> Tensor:
    """An orthonormal basis ``Q [P, r]`` of the columns of ``M [P, k]``, ``r = min(P, k)``.

    Householder QR (``torch.linalg.qr``, reduced): ``Q`` has orthonormal columns even when
    ``M`` is rank-deficient (then ``Q`` spans ``range(M)`` plus arbitrary directions, which
    keeps Hutch++ unbiased). Half precision is promoted to float32 and cast back.
    """
    dtype = M.dtype if M.dtype in (torch.float32, torch.float64) else torch.float32
    Q = torch.linalg.qr(M.to(dtype), mode="reduced").Q
    return Q.to(M.dtype)


def eigh_unchecked(M: Tensor) -> Tuple[Tensor, Tensor]:
    """:func:`eigh` without host synchronization: no finiteness check, no jitter retries.

    For factors whose finiteness is guaranteed on the device (running averages of checked
    statistics). A decomposition that does not converge is retried once in float64.

    Returns:
        ``(evals >= 0 [..., D], evecs [..., D, D])`` in ``M``'s dtype.

    """
    S = (M + M.mT) / 2
    try:
        lam, Q = torch.linalg.eigh(S)
    except RuntimeError:  # no convergence (rare for a PSD factor): once more in float64
        lam, Q = (t.to(S.dtype) for t in torch.linalg.eigh(S.double()))
    return lam.clamp_min(0), Q


def least_squares(system: Tensor, rhs: Tensor) -> Tensor:
    """``argmin_x |system x - rhs|`` for a small square ``system [K, K]`` and ``rhs [K]``."""
    return torch.linalg.lstsq(system, rhs[:, None]).solution[:, 0]
