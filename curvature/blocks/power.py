"""Eigenbasis updates without an eigendecomposition: one warm-started subspace iteration.

EKFAC preconditions in the eigenbases of its Kronecker factors and re-estimates the
eigenvalues itself (the corrections ``Lambda``), so a basis close to the factors'
eigenbasis serves as well as the exact one (any orthonormal basis gives a valid EKFAC
preconditioner; the eigenbasis is the best one). Between refreshes the factors move
by a running average, so the previous basis is already close: one step of orthogonal
(subspace) iteration from it, as in SOAP (Vyas et al., 2024), tracks them:

``Y = (F + sigma I) Q_old P``, ``Y = Q R``, ``Q_new = Q diag(sign(R_jj))``,

with ``P`` the permutation that sorts the columns by their Rayleigh quotients ``q_j^T F
q_j`` in descending order (orthogonal iteration converges to nested dominant subspaces
in the order of the columns; quotients below ``sigma`` count as equal and keep their
previous order, so that rounding does not permute them) and the signs of ``R``'s
diagonal folded into ``Q`` (each new column points as its old one). The shift ``sigma
=`` :data:`POWER_SHIFT` times the largest quotient keeps the columns of a numerical null
space where they were: ``F q ~ 0`` there (and ``F Q``'s columns lose rank where ``F``
does), and the Householder QR of rounding-level columns would take their directions from
the rounding (the reason a full eigendecomposition needs
:func:`~curvature.linalg.canonical_null_basis`); with the shift the new basis is a
smooth function of the factor and the previous basis.

Cost per ``n x n`` factor: one GEMM (``F Q``, ``2 n^3`` flops) and one Householder QR
(``~8/3 n^3``, :func:`~curvature.linalg.orthonormal_basis`), against an
eigendecomposition's ``~9 n^3`` with less parallelism; on a GPU the QR reads no error
code on the host (the eigendecomposition does, once per batched call). The eigenvalues
returned are the Rayleigh quotients in the previous basis (what EKFAC uses only until
its first corrections arrive).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..linalg import orthonormal_basis

#: ``sigma / max_j q_j^T F q_j`` of :func:`power_step`, per dtype of the basis: directions
#: whose eigenvalue is below about this fraction of the largest barely turn (they keep
#: their previous columns), and a rounding change ``delta`` (relative) of the factor
#: moves the null space's columns by about ``delta / sigma``: ``1e-9`` for a float64
#: rounding (``1e-15``), ``1e-3`` for a float32 one (``1e-7``). A first version took
#: ``1e-3`` for both, which froze an audit's ill-conditioned least squares (one Linear
#: layer, input eigenvalues over six decades) at a loss of ``7.6e-4`` in float64 and
#: ``6.2e-4`` in float32 where decompositions reach ``2e-27`` and ``6.5e-10``; now ``2e-27``
#: and ``6.5e-10`` (untracked ``scratch/audit5/s12_illcond_training.py``).
POWER_SHIFT = {torch.float32: 1e-4, torch.float64: 1e-6}


def power_step(F: Tensor, Q: Tensor) -> Tuple[Tensor, Tensor]:
    """One step of shifted subspace iteration of ``F [..., n, n]`` from ``Q`` (the module's
    formula).

    Memory: besides ``F`` and ``Q``, at most three ``n x n`` temporaries at a time (the
    shifted ``F Q`` with its columns in the new order, and the QR's two outputs); ``F`` is
    used as it is (a running factor, symmetric up to rounding: ``F`` and ``F^T`` give the
    same quotients).

    Args:
        F: Symmetric positive semi-definite.
        Q: ``[..., n, n]`` orthonormal, the previous basis (its columns in any order).

    Returns:
        ``(evals [..., n], Q_new [..., n, n])`` in ``Q``'s dtype (float64 for a float64
        ``F``): the Rayleigh quotients of the previous columns (clamped at 0) and the new
        basis, both in descending order of those quotients (``eigh``'s order is
        ascending; nothing depends on the order). Non-finite where ``F`` is (checked by
        the caller).

    """
    # (a factor of a model made float64 since the last refresh: the basis follows it)
    dtype = torch.promote_types(F.dtype, Q.dtype) if F.dtype == torch.float64 else Q.dtype
    F, Q = F.to(dtype), Q.to(dtype)
    Y = F @ Q
    est = (Q * Y).sum(-2)  # q_j^T F q_j
    top = est.amax(-1, keepdim=True).clamp_min(0)
    # a zero factor (a dead layer) keeps its basis: a shift of 1 (Y = Q P)
    sigma = torch.where(top > 0, POWER_SHIFT.get(dtype, 1e-4) * top, torch.ones_like(top))
    Y.addcmul_(Q, sigma.unsqueeze(-1))  # (F + sigma I) Q, in place
    # descending, the quotients below the shift tied (stable: in their previous order,
    # so that rounding does not permute the null space)
    order = est.maximum(sigma).argsort(dim=-1, descending=True, stable=True)
    Y = Y.gather(-1, order.unsqueeze(-2).expand(Q.shape))
    # each column as its old one: R's diagonal made non-negative by orthonormal_basis
    return est.gather(-1, order).clamp_min(0), orthonormal_basis(Y)


def power_steps(
    pairs: Sequence[Tuple[Tensor, Tensor]],
) -> Tuple[List[Tuple[Tensor, Tensor]], List[Tensor]]:
    """:func:`power_step` of several ``(F, Q)`` pairs, equal shapes in one batched call,
    without a host read.

    Returns:
        The ``(evals, Q_new)`` per pair, and per pair a 0-d device bool: ``F`` and the
        result are finite (for the caller's one host read).

    """
    out: List[Any] = [None] * len(pairs)
    groups: Dict[Tuple[Any, ...], List[int]] = {}
    for i, (F, Q) in enumerate(pairs):
        groups.setdefault((F.shape, F.dtype, Q.dtype, F.device), []).append(i)
    for idx in groups.values():
        if len(idx) == 1:
            F, Q = pairs[idx[0]]
            out[idx[0]] = power_step(F, Q)
            continue
        evals, Qn = power_step(
            torch.stack([pairs[i][0] for i in idx]),
            torch.stack([pairs[i][1] for i in idx]),
        )
        for j, i in enumerate(idx):
            out[i] = (evals[j], Qn[j])
    # (F's sum is finite iff F is, barring overflow; the result's likewise)
    ok = [(F.sum() + r[0].sum() + r[1].sum()).isfinite() for (F, _), r in zip(pairs, out)]
    return out, ok
