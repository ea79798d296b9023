"""The only caller of ``torch.linalg``: symmetric eigendecompositions with fallbacks.

Decompositions never run in half precision: inputs are promoted to at least float32
(float64 on retry). Every result is checked for finiteness; a failure retries in
float64, then with a small diagonal jitter, and only then raises with the name of the
matrix and the suggestion to raise the damping.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def symmetrize(M: Tensor) -> Tensor:
    """``(M + M^T) / 2`` over the last two axes."""
    return 0.5 * (M + M.transpose(-1, -2))


def eigh(M: Tensor, *, name: str = "matrix") -> Tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD matrix (batched).

    Args:
        M: ``[..., D, D]`` symmetric positive semi-definite.
        name: Used in the error message.

    Returns:
        ``(evals [..., D], evecs [..., D, D])`` in ``M``'s dtype (at least float32).

    Raises:
        RuntimeError: When the decomposition fails in float64 even with jitter.

    """
    dtype = M.dtype if M.dtype in (torch.float32, torch.float64) else torch.float32
    require_finite(M, f"eigh({name})")
    S = symmetrize(M.to(dtype))
    attempts = [(dtype, 0.0), (torch.float64, 0.0), (torch.float64, 1e-10)]
    last: Exception = RuntimeError("unreachable")
    for attempt_dtype, jitter in attempts:
        A = S.to(attempt_dtype)
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
    raise RuntimeError(
        f"eigh({name}) failed in float64 even with jitter; increase the damping."
    ) from last


def require_finite(M: Tensor, what: str) -> None:
    """Raise a ``RuntimeError`` naming ``what`` if ``M`` has a NaN or an infinity."""
    if not torch.isfinite(M).all():
        raise RuntimeError(
            f"{what}: the matrix has non-finite entries (NaN/inf in the statistics); "
            "check the data and the loss, or lower the learning rate."
        )


def damped_inverse(M: Tensor, shift, *, name: str = "matrix") -> Tensor:
    """``(M + shift I)^{-1}`` of a symmetric PSD ``M [..., D, D]``, ``shift`` > 0 (a number or
    ``[...]``, one per matrix).

    A Cholesky factorization and its inverse: about five times cheaper than an
    eigendecomposition at ``D`` of several hundred. Where the shifted matrix is not
    numerically positive definite (a ``shift`` far below the rounding error of ``M``),
    the inverse is taken from :func:`eigh`, whose eigenvalues are clamped at 0, so
    the result is the same as ``Q diag(1 / (max(l, 0) + shift)) Q^T``.

    Returns:
        The inverse in ``M``'s dtype, at least float32.

    """
    dtype = M.dtype if M.dtype in (torch.float32, torch.float64) else torch.float32
    require_finite(M, f"damped_inverse({name})")
    shift = torch.as_tensor(shift, dtype=dtype, device=M.device)
    eye = torch.eye(M.shape[-1], dtype=dtype, device=M.device)
    L, info = torch.linalg.cholesky_ex(symmetrize(M.to(dtype)) + shift[..., None, None] * eye)
    if not bool((info == 0).all()):
        evals, evecs = eigh(M, name=name)
        return (evecs / (evals + shift.to(evals.dtype)[..., None])[..., None, :]) @ evecs.mT
    return symmetrize(torch.cholesky_inverse(L))


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
