"""EKFAC's eigenvalue corrections carried into a new eigenbasis at a refresh."""

from __future__ import annotations

import torch
from torch import Tensor

from ..subnormals import SUBNORMAL_SLOW_DEVICES
from .records import Eigen


def carried_corrections(corrections: Tensor, old: Eigen, new: Eigen) -> Tensor:
    """``RG Lambda RA^T`` with ``R = (Q_new^T Q_old)^2`` elementwise: the diagonal of the
    EKFAC matrix of ``Lambda`` in the ``old`` basis, in the ``new`` basis (its dtype).

    Late in training consecutive bases barely move: most overlaps are rounding-level
    (``1e-20`` and below in float32), and products of their squares with small
    ``Lambda`` entries fall below ``torch.finfo(torch.float32).tiny`` (about
    ``1.2e-38``), where a CPU computes about 100x slower: on the MLP 784-512-256-10
    (one thread, after 400 steps on one batch) the ``[512, 785] x [785, 785]`` product
    took 540-577 ms instead of 4 ms. On
    :data:`~curvature.subnormals.SUBNORMAL_SLOW_DEVICES` the squares and products are
    taken in float64 (no subnormal float32 products; about 2x the float32 GEMM time,
    once per refresh), the R matrices made :data:`CARRY_ROWS` rows at a time (the
    refresh's peak memory stays that of the float32 formula or below), and the result's
    entries below ``tiny`` are set to 0 (a ``Lambda`` entry that small only adds to the
    damping, in every later step's division, on the same slow path).
    """
    dtype = new.QA.dtype
    QG_old, QA_old = old.QG.to(dtype), old.QA.to(dtype)
    if corrections.device.type not in SUBNORMAL_SLOW_DEVICES or dtype == torch.float64:
        RA = _squared_rows(new.QA, QA_old, slice(None), dtype)
        RG = _squared_rows(new.QG, QG_old, slice(None), dtype)
        return RG @ corrections.to(dtype) @ RA.mT
    # float64 in row chunks of the R matrices (made chunk by chunk: at most CARRY_ROWS
    # rows of an R alive, in float64), so that the refresh's peak does not grow
    wide = torch.float64
    lam = corrections.to(wide)
    T = lam.new_empty(lam.shape)  # RG Lambda
    for i in range(0, lam.shape[-2], CARRY_ROWS):
        rows = slice(i, i + CARRY_ROWS)
        T[..., rows, :] = _squared_rows(new.QG, QG_old, rows, wide) @ lam
    del lam
    out = corrections.new_empty(corrections.shape, dtype=dtype)
    for j in range(0, T.shape[-1], CARRY_ROWS):
        cols = slice(j, j + CARRY_ROWS)
        out[..., :, cols] = T @ _squared_rows(new.QA, QA_old, cols, wide).mT
    return torch.threshold(out, torch.finfo(dtype).tiny, 0.0)  # (Lambda >= 0)


#: Rows of the squared-overlap matrices made at a time by :func:`carried_corrections`.
CARRY_ROWS = 256


def _squared_rows(Q_new: Tensor, Q_old: Tensor, rows: slice, dtype: torch.dtype) -> Tensor:
    """Rows ``rows`` of ``(Q_new^T Q_old)^2`` (elementwise), squared in ``dtype``."""
    return (Q_new[..., :, rows].mT @ Q_old).to(dtype).pow_(2)
