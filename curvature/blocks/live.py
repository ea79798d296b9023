"""Products with a damped inverse of ``A`` kept on its live columns.

Where some columns of a Kronecker block's input factor ``A [C, D, D]`` are zero by
construction (a convolution's taps that only read its zero padding:
:mod:`curvature.layers.conv_taps`), ``A`` is, up to a permutation, ``diag(A_LL, 0)`` with
``A_LL [C, L, L]`` on the live columns ``L``, so

    (A + s I)^{-1} = diag((A_LL + s I)^{-1}, I / s)

and, for a block's matrix ``M [C, D_out, D]``,

    (G + s_G I)^{-1} M (A + s I)^{-1} = Ginv R,
    R[:, L] = M[:, L] Ainv_LL,   R[:, ~L] = M[:, ~L] / s

(``s = sA``, the shift of the whole ``A``: the pi heuristic's mean eigenvalue counts the
zero ones). The refresh decomposes ``A_LL`` (``L^3`` instead of ``D^3``) and a step
multiplies by it (``D_out L^2`` instead of ``D_out D^2``); the dead columns of ``M`` (zero
where the loss has no term of their own) are scaled, not dropped: the same
preconditioner as the full inverse, to rounding.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor


def union_columns(
    a: Optional[Tuple[int, ...]], b: Optional[Tuple[int, ...]]
) -> Optional[Tuple[int, ...]]:
    """The sorted union of two sets of live columns (``None``: all columns, either way)."""
    if a is None or b is None:
        return None
    return a if b is a else tuple(sorted({*a, *b}))


def compact(A: Tensor, live: Tensor) -> Tensor:
    """``A[..., live, :][..., :, live]``: ``[C, L, L]`` (a copy)."""
    return A.index_select(-1, live).index_select(-2, live)


def live_inverse_matvec(Ginv: Tensor, Ainv: Tensor, live: Tensor, sA: Tensor, M: Tensor) -> Tensor:
    """``Ginv R`` with ``R`` as in the module docstring: ``Ginv [C, D_out, D_out]``,
    ``Ainv [C, L, L]``, ``live [L]``, ``sA [C]``, ``M [C, D_out, D]``.
    """
    R = M / sA.to(M.dtype)[:, None, None]
    R.index_copy_(-1, live, M.index_select(-1, live) @ Ainv)
    return Ginv @ R


def live_inverse_matvec_into(
    Ginv: Tensor, Ainv: Tensor, live: Tensor, inv_s: Tensor, M: Tensor, out: Tensor
) -> None:
    """:func:`live_inverse_matvec` of one group (``[D_out, D]`` matrices, ``inv_s`` the
    0-d ``1 / sA``) written into ``out``.
    """
    R = M * inv_s
    R.index_copy_(1, live, torch.mm(M.index_select(1, live), Ainv))
    torch.mm(Ginv, R, out=out)


__all__ = ["compact", "live_inverse_matvec", "live_inverse_matvec_into", "union_columns"]
