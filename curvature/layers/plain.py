"""One group per layer: the per-step statistics of a ``nn.Linear`` as batched GEMMs.

For a layer whose expanded inputs have one group (``C = 1``: ``nn.Linear``) and one call,
the statistics the optimizers fold in every step are products over the rows of two
matrices. With the *plain operands*

- ``a [1, M, D]``: the inputs (bias column included), ``M = N S`` rows,
- ``g [K, M, D_out]``: the gradients at the layer output, ``K`` pulled vectors,

each is one ``torch.bmm`` over a batch of one group, whose result is ``[1, ., .]`` as
the blocks keep it: no reshapes, no ``unsqueeze`` and no einsum (each of which is an
aten call, a kernel launch on a GPU). These are the same sums as the general paths of
:mod:`curvature.layers.base` and :mod:`curvature.layer_stats` (``"expand"`` KFAC, the
Fisher diagonal and EKFAC's corrections), equal up to the summation order of the GEMM.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .precision import gram


class PlainOperands(NamedTuple):
    """A layer's inputs and output gradients as two matrices over its rows.

    Attributes:
        a: ``[1, M, D]`` inputs with the trainable columns (bias column included).
        g: ``[K, M, D_out]`` gradients at the output, or ``None`` (forward-only).
        positions: ``S``, the shared positions per sample (``M = N S``).

    """

    a: Tensor
    g: Optional[Tensor]
    positions: int


def plain_kfac(ops: PlainOperands) -> Tuple[Tensor, Optional[Tensor]]:
    """``(A_sum [1, D, D], G_sum [1, D_out, D_out] or None)``: ``"expand"`` KFAC sums.

    ``A_sum = sum_m a_m a_m^T``, ``G_sum = sum_{k,m} g_km g_km^T``.
    """
    a, g = ops.a, ops.g
    A_sum = gram(a)
    if g is None:
        return A_sum, None
    g1 = g if g.shape[0] == 1 else g.reshape(1, -1, g.shape[-1])
    return A_sum, gram(g1)


def _squares_over_vectors(g: Tensor) -> Tensor:
    """``[1, M, D_out]``: ``sum_k g_km^2``."""
    return g.pow(2) if g.shape[0] == 1 else g.pow(2).sum(0, keepdim=True)


def plain_diagonal(ops: PlainOperands) -> Tensor:
    """``[1, D_out, D]``: the Fisher diagonal ``sum_{k,n} (g_kn a_n^T)^2`` (``S = 1``).

    Without shared positions a per-sample gradient is the outer product ``g_kn a_n^T``,
    so its square is ``g_kn^2 (a_n^2)^T`` and the sum one GEMM.
    """
    assert ops.g is not None and ops.positions == 1
    return squares_diagonal(ops.g, ops.a.pow(2))


class SquaredInputs:
    """A layer's persistent ``[1, M, D]`` buffer of squared inputs ``[x^2 | 1]``.

    For the Fisher diagonal of a ``nn.Linear`` with 2-D inputs ``x [M, D_in]`` every step
    (:class:`~curvature.DiagonalNaturalGradient`): the bias column of the squared
    inputs is ones, written once when the buffer is made; each later step writes
    ``x^2`` into the other columns with one ``pow`` (``out=``), where building ``[x | 1]``
    and squaring it cost an ``unsqueeze``, a ``cat`` and a ``pow`` (three aten calls, three
    kernel launches on a GPU). Made again when the input's shape, dtype or device or the
    trainable columns change (e.g. a ragged last batch). Its contents are valid until the
    next :meth:`of`: the owner must consume them first (one GEMM).
    """

    def __init__(self) -> None:
        self._key: Optional[tuple] = None
        self._full: Optional[Tensor] = None
        self._cols: Optional[Tensor] = None

    def of(self, x: Tensor, has_w: bool, has_b: bool) -> Tensor:
        """``[1, M, D]``: ``[x^2 | 1]`` (``D = D_in`` with the weight ``+ 1`` with the bias).

        Args:
            x: ``[M, D_in]`` the layer's inputs.
            has_w: Whether the weight is trainable (the ``x^2`` columns).
            has_b: Whether the bias is trainable (the ones column, last).

        """
        key = (tuple(x.shape), x.dtype, x.device, has_w, has_b)
        if key != self._key or self._full is None:
            M, D_in = x.shape
            self._full = x.new_ones(1, M, D_in * has_w + has_b)
            self._cols = self._full[0, :, :D_in] if has_w else None
            self._key = key
        if self._cols is not None:
            torch.pow(x, 2, out=self._cols)
        return self._full


def squares_diagonal(g: Tensor, a2: Tensor) -> Tensor:
    """``[1, D_out, D]``: ``sum_{k,n} g_kn^2 (a_n^2)^T``, one GEMM (:func:`plain_diagonal`).

    Args:
        g: ``[K, M, D_out]`` gradients at the layer output.
        a2: ``[1, M, D]`` squared inputs (e.g. :meth:`SquaredInputs.of`).

    """
    return torch.bmm(_squares_over_vectors(g).mT, a2)


def plain_rotated(ops: PlainOperands, QA: Tensor, QG: Tensor) -> Tensor:
    """``[1, D_out, D]``: EKFAC's ``sum_{k,n} (QG^T g_kn a_n^T QA)^2`` (``S = 1``).

    Args:
        ops: The plain operands (``positions == 1``, gradients present).
        QA: ``[1, D, D]`` input eigenbasis.
        QG: ``[1, D_out, D_out]`` output eigenbasis.

    """
    assert ops.g is not None and ops.positions == 1
    a, g = ops.a.to(QA.dtype), ops.g.to(QG.dtype)
    ar = torch.bmm(a, QA)  # [1, M, D]
    if g.shape[0] == 1:
        gr = torch.bmm(g, QG)
    else:  # [K, M, D_out] @ [D_out, D_out]: the same basis for every vector
        gr = torch.matmul(g, QG)
    return torch.bmm(_squares_over_vectors(gr).mT, ar.pow(2))
