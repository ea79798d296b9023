"""The quadratic model's 2x2 (or 1x1) solve for ``(alpha, mu)``: on the host (closed form in
float64, the same bits on every rank) or on the device (no host read, the plain loop).
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def solve_coefficients(gram: Tensor, damped: Tensor, linear: Tensor) -> Tuple[Tensor, float]:
    """``(c, M)``: ``c = -S^{-1} linear``, ``M = 1/2 c^T S c + linear^T c``, ``S = gram + damped``.

    Closed form (elementwise float64 arithmetic, the same bits on every rank: LAPACK's
    solvers may differ in the last bit between processes with the same input, which let
    the ranks of a distributed run drift apart); a singular ``S`` (``delta0`` parallel to
    ``Delta``: rank one, ``S = t u u^T``) takes the least-squares solution of least norm,
    ``S^+ = S / t^2`` with ``t = tr S``.
    """
    system = (gram + damped).to(torch.float64)
    rhs = -linear.to(torch.float64)
    if system.shape[0] == 1:
        c = rhs / system[0, 0]
    else:
        a, b, d = system[0, 0], (system[0, 1] + system[1, 0]) / 2, system[1, 1]
        det = a * d - b * b
        if det > 1e-14 * a * d:
            c = torch.stack([d * rhs[0] - b * rhs[1], a * rhs[1] - b * rhs[0]]) / det
        else:
            c = system @ rhs / (a + d) ** 2
    model = 0.5 * float(c @ system @ c) - float(rhs @ c)
    return c, model


def plain_dtype(like: Tensor) -> torch.dtype:
    """The loss bookkeeping's dtype: float64 where the device has it."""
    return torch.float32 if like.device.type == "mps" else torch.float64


def solve_on_device(system: Tensor, linear: Tensor) -> Tuple[Tensor, Tensor]:
    """``(c [2], M)``: the 2x2 (or 1x1) solve of :func:`solve_coefficients` without a
    host read (Cramer's rule; a nearly singular 2x2 system falls back to ``mu = 0``).
    """
    a, l0 = system[0, 0], linear[0]
    alone = torch.stack([-l0 / a, torch.zeros_like(a)])
    if system.shape[0] == 1:
        c = alone
    else:
        b, d, l1 = system[0, 1], system[1, 1], linear[1]
        det = a * d - b * b
        pair = torch.stack([(b * l1 - d * l0) / det, (b * l0 - a * l1) / det])
        c = torch.where(det > 1e-10 * a * d, pair, alone)
    model = 0.5 * (linear * c[: linear.shape[0]]).sum()
    return c, model
