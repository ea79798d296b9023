"""Kernel taps of a convolution that only ever read its zero padding.

A convolution with ``padding_mode="zeros"`` whose input is small against its kernel's
reach (a 3x3 kernel with padding 1 on a 1x1 feature map, the last stage of a ResNet on
28x28 images) has taps that read padding at every output position: tap ``t`` of a
spatial axis with input size ``n``, stride ``s``, padding ``p`` and dilation ``d`` reads
input position ``j s + t d - p`` at output position ``j`` (``0 <= j < n_out``), and is
*dead* when that is outside ``[0, n)`` for every ``j``. A tap of a 2-d (3-d) kernel is
dead when it is dead along one of its axes.

A dead tap's column of the unfolded patches is zero at every position of every sample,
so its rows and columns of the KFAC input factor ``A`` are exactly zero and so are the
weight's gradient entries there (from the data; a term added to the loss, such as an
``L2`` penalty, can make them nonzero). Which taps are dead depends only on the shapes:
:func:`live_columns` finds them without reading any value. The optimizers invert ``A``
on the other columns alone (:mod:`curvature.blocks.live`): the same preconditioner,
``(A + s I)^{-1}`` being ``1 / s`` on a zero row and column.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

from torch import nn

#: Columns of ``A`` compacted only when at most this fraction of them is live (fewer dead
#: columns save little against the gather and scatter of the compact product).
MAX_LIVE_FRACTION = 0.75


def live_columns(
    module: nn.modules.conv._ConvNd, spatial: Sequence[Tuple[int, ...]], bias: bool
) -> Optional[Tuple[int, ...]]:
    """The columns of ``[W | b]`` (one group: ``(C_in / groups) prod(kernel)`` weight
    columns, channel-major like the weight's ``flatten(1)``, then the bias column when
    ``bias``) that inputs of the spatial shapes ``spatial`` can make nonzero.

    Returns:
        Their sorted indices, or ``None`` where all are live, where more than
        :data:`MAX_LIVE_FRACTION` of them are, or where the padding is not zeros of a
        fixed size (``padding_mode`` other than ``"zeros"``, ``padding="same"``), a
        transposed convolution among them.

    """
    if (
        getattr(module, "transposed", False)
        or module.padding_mode != "zeros"
        or isinstance(module.padding, str)
        or not spatial
    ):
        return None
    taps = set()
    for shape in spatial:
        taps |= set(_live_taps(tuple(shape), *_geometry(module)))
    channels = module.in_channels // module.groups
    return _columns(tuple(sorted(taps)), math.prod(module.kernel_size), channels, bias)


@functools.lru_cache(maxsize=256)
def _columns(
    taps: Tuple[int, ...], per_channel: int, channels: int, bias: bool
) -> Optional[Tuple[int, ...]]:
    """:func:`live_columns` of the live ``taps`` (one tuple per geometry: the optimizer's
    union of a step's columns with the block's is then an identity check).
    """
    if len(taps) == per_channel:
        return None
    D = channels * per_channel + (1 if bias else 0)
    live = [c * per_channel + t for c in range(channels) for t in taps]
    if bias:
        live.append(D - 1)
    if len(live) > MAX_LIVE_FRACTION * D:
        return None
    return tuple(live)


def positions(n: int, k: int, s: int, d: int, left: int, right: int) -> int:
    """Output positions along an axis of ``n`` inputs (kernel ``k``, stride ``s``,
    dilation ``d``, padding ``left`` and ``right``).
    """
    return (n + left + right - d * (k - 1) - 1) // s + 1


def _geometry(module: nn.modules.conv._ConvNd) -> tuple:
    return (
        tuple(module.kernel_size),
        tuple(module.stride),
        tuple(module.padding),
        tuple(module.dilation),
    )


@functools.lru_cache(maxsize=256)
def _live_taps(
    shape: Tuple[int, ...],
    kernel: Tuple[int, ...],
    stride: Tuple[int, ...],
    padding: Tuple[int, ...],
    dilation: Tuple[int, ...],
) -> Tuple[int, ...]:
    """Flat indices (row-major over the kernel) of the taps that read the input."""
    if len(shape) != len(kernel):
        raise ValueError(f"expected {len(kernel)} spatial sizes, got {shape}")
    axes = []
    for n, k, s, p, d in zip(shape, kernel, stride, padding, dilation):
        out = positions(n, k, s, d, p, p)
        axes.append([t for t in range(k) if any(0 <= j * s + t * d - p < n for j in range(out))])
    flat = [0]
    for k, live in zip(kernel, axes):
        flat = [f * k + t for f in flat for t in live]
    return tuple(flat)


__all__ = ["MAX_LIVE_FRACTION", "live_columns", "positions"]
