"""Kronecker-factor sums ``sum a a^T`` and ``sum g g^T`` of expanded layer operands."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

from torch import Tensor

from .conv_sums import live_gram
from .precision import gram


def positions_gram(g: Tensor) -> Tensor:
    """``[1, D_out, D_out]``: ``sum g g^T`` over every axis but the last of ``g [..., S,
    D_out]`` (a tensor of its own, not a view: the statistics' flush zeroes it in place).

    A convolution's output gradient ``[..., N, C_out, O...]`` arrives as a view with
    the channels last (stride ``S`` apart): flattening it to ``[-1, D_out]`` copies it
    whole (as large as the layer's output, e.g. 67 MB at ``[256, 64, 32, 32]``). Where
    the positions are the contiguous axis and ``D_out < S``, per-sample GEMMs ``[D_out, S]
    x [S, D_out]`` read it in place and their ``[K N, D_out, D_out]`` results (smaller
    than the copy) are summed.
    """
    S, D = g.shape[-2:]
    x = g.reshape(-1, S, D) if g.dim() > 3 else g  # (leading axes merge without a copy)
    if g.dim() >= 3 and x.stride(-2) == 1 and x.stride(-1) == S and D < S:
        return gram(x).sum(0, keepdim=True)
    return _gram1(g.reshape(-1, D))


def _gram1(x: Tensor) -> Tensor:
    """``[1, D, D]``: ``x^T x`` of ``x [M, D]`` as a tensor of its own (one batched GEMM;
    an ``unsqueeze`` of the 2-d product would be a view, which the flush selects into a
    copy instead of zeroing in place: a 3.6 ms ``where`` on a 1152 x 1152 factor).
    """
    return gram(x.unsqueeze(0))


def expanded_kfac(
    a: Tensor, g: Optional[Tensor], approx: str, live: Optional[Sequence[int]] = None
) -> Tuple[Tensor, Optional[Tensor], int]:
    """``(A_sum [C, D, D], G_sum [C, D_out, D_out] or None, count)`` for KFAC.

    ``"expand"``: ``A_sum = sum_{n,s} a a^T`` over ``count = N S``, ``G_sum = sum_{k,n,s}
    g g^T``; ``"reduce"``: the inputs meaned and the gradients summed over ``s`` first.
    ``g`` carries the pulled vectors' axis ``[K]`` first. ``live`` (one group,
    ``"expand"``): the only columns of ``a`` that can be nonzero (``A_sum`` from their
    GEMM: :func:`~curvature.layers.conv_sums.live_gram`).
    """
    N, S = a.shape[:2]
    if approx == "expand" and a.shape[2] == 1:  # one group: two plain GEMMs
        rows = a.reshape(-1, a.shape[-1])
        A_sum = _gram1(rows) if live is None else live_gram(rows, live)
        return A_sum, None if g is None else positions_gram(g[..., 0, :]), N * S
    if approx == "expand":
        A_sum = group_grams(a)
        return A_sum, None if g is None else group_grams(g), N * S
    A_sum = group_grams(a.mean(1))
    if g is None:
        return A_sum, None, N
    return A_sum, group_grams(g.sum(-3)), N


def group_grams(x: Tensor) -> Tensor:
    """``[C, D, D]``: ``sum x x^T`` per group ``c`` of ``x [..., C, D]`` over all other axes,
    one batched GEMM whose result is a tensor of its own (an ``einsum``'s is a view, which
    the statistics' flush would select into a copy instead of zeroing it in place).
    """
    return gram(x.reshape(-1, *x.shape[-2:]).transpose(0, 1))
