"""EKFAC's eigenvalue corrections carried into a new eigenbasis at a refresh."""

from __future__ import annotations

import torch
from torch import Tensor

from .records import Eigen

#: Device types whose float arithmetic slows down on subnormal numbers (x86 and ARM CPUs:
#: about 100x per operation); EKFAC carries its eigenvalue corrections into a new basis
#: in float64 there (:func:`carried_corrections`).
SUBNORMAL_SLOW_DEVICES = ("cpu",)


def carried_corrections(corrections: Tensor, old: Eigen, new: Eigen) -> Tensor:
    """``RG Lambda RA^T`` with ``R = (Q_new^T Q_old)^2`` elementwise: the diagonal of the
    EKFAC matrix of ``Lambda`` in the ``old`` basis, in the ``new`` basis (its dtype).

    Late in training consecutive bases barely move: most overlaps are rounding-level
    (``1e-20`` and below in float32), and products of their squares with small
    ``Lambda`` entries fall below ``torch.finfo(torch.float32).tiny`` (about
    ``1.2e-38``), where a CPU computes about 100x slower: on the MLP 784-512-256-10
    (one thread, after 400 steps on one batch) the ``[512, 785] x [785, 785]`` product
    took 540-577 ms instead of 4 ms. On :data:`SUBNORMAL_SLOW_DEVICES` the squares and
    products are taken in float64 (no subnormal float32 products; about 2x the float32
    GEMM time, once per refresh) and the result's entries below ``tiny`` are set to 0
    (a ``Lambda`` entry that small only adds to the damping, in every later step's
    division, on the same slow path).
    """
    dtype = new.QA.dtype
    wide = dtype
    if corrections.device.type in SUBNORMAL_SLOW_DEVICES and dtype != torch.float64:
        wide = torch.float64
    RA = (new.QA.mT @ old.QA.to(dtype)).to(wide).pow_(2)
    RG = (new.QG.mT @ old.QG.to(dtype)).to(wide).pow_(2)
    out = (RG @ corrections.to(wide) @ RA.mT).to(dtype)
    if wide is dtype:
        return out
    return torch.threshold(out, torch.finfo(dtype).tiny, 0.0)  # (Lambda >= 0)
