"""Running averages of a block's statistics, folded in on the device.

:class:`RunningFactors` (the statistics half of the Kronecker and one-sided blocks),
:func:`ema` and :func:`update_weight` (one running update without a host read) and
:func:`batched_ema` (the updates of one step in one ``torch._foreach_lerp_``).
"""

from __future__ import annotations

import struct
import threading
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from ..foreach import in_dtype

_PENDING = threading.local()  # the lerps deferred by ``batched_ema`` (per thread)


@contextmanager
def batched_ema() -> Iterator[None]:
    """Defer the in-place running updates of :func:`ema` with a device weight and run
    them at the end as one ``torch._foreach_lerp_`` (the same values as one ``lerp_``
    each; one call, one launch of the fused kernel on a GPU). The running values must
    not be read inside the block.
    """
    outer = getattr(_PENDING, "lerps", None)
    _PENDING.lerps = lerps = ([], [], [])
    try:
        yield
    finally:
        _PENDING.lerps = outer
        if lerps[0]:
            torch._foreach_lerp_(*lerps)


def ema(
    old: Optional[Tensor], new: Tensor, decay: float, weight: Optional[Tensor] = None
) -> Tensor:
    """``decay old + (1 - decay) new`` in place of ``old``; ``new`` itself if no ``old``.

    ``weight`` (a 0-d tensor from :func:`update_weight`) replaces ``1 - decay``:
    ``old + weight (new - old)`` in place, computed without reading the weight (at the
    end of an enclosing :func:`batched_ema`).
    """
    if old is None:
        return new
    if weight is not None:  # (in the running value's dtype, as mul_/add_ would)
        lerps = getattr(_PENDING, "lerps", None)
        dtype = old.dtype  # (no `to` call where the dtype fits: a dispatch each, per block)
        new, weight = in_dtype(new, dtype), in_dtype(weight, dtype)
        if lerps is None:
            return old.lerp_(new, weight)
        for pending, x in zip(lerps, (old, new, weight)):
            pending.append(x)
        return old
    return old.mul_(decay).add_(new, alpha=1 - decay)


def update_weight(
    valid: Optional[Tensor],
    fresh: Optional[Tensor],
    decay: float,
    dtype: torch.dtype = torch.float64,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The weight of the new value in a running update, and the running value's new flag.

    ``valid`` (0-d device bool, ``None``: true) says whether the new statistics hold a
    finite contribution (else they are zeros); ``fresh`` (``None``: false) whether the
    running value has never had one. The weight (``dtype``, that of the running value) is
    ``0`` for invalid statistics, ``1`` for the first valid ones, else ``1 - decay``
    (``None`` when that is known on the host): no host synchronization.
    """
    if valid is None:
        return (None if fresh is None else torch.where(fresh, 1.0, 1 - decay).to(dtype)), None
    one, rate, zero = decay_constants(decay, dtype, valid.device)
    if fresh is None:  # (exactly valid.to(dtype) * (1 - decay), in one call)
        shared = _shared_weight(valid, rate, zero)
        return (torch.where(valid, rate, zero) if shared is None else shared), None
    # the weight is valid * (1 if fresh else 1 - decay); still fresh: fresh and not valid
    return torch.where(valid, torch.where(fresh, one, rate), zero), fresh > valid


_SHARED = threading.local()  # the last flags vector's weights (per thread)


def _shared_weight(valid: Tensor, rate: Tensor, zero: Tensor) -> Optional[Tensor]:
    """``torch.where(valid, rate, zero)`` taken from one ``where`` over the whole flags
    vector that ``valid`` is an entry of (the flush hands out one 0-d view per block of a
    ``[K]`` vector): two calls per step for ``K`` blocks instead of ``K`` (the same
    values). ``None`` where ``valid`` is not such a view, or the vector has fewer than
    three entries (no call saved).
    """
    base = valid._base
    if (
        base is None
        or valid.dim() != 0
        or base.dim() != 1
        or base.numel() < 3
        or base.dtype != torch.bool
        or base.stride() != (1,)
    ):
        return None
    hit = getattr(_SHARED, "last", None)
    if hit is None or hit[0] is not base or hit[1] is not rate:  # the next step's vector
        hit = (base, rate, torch.where(base, rate, zero).unbind(0))
        _SHARED.last = hit
    return hit[2][valid.storage_offset() - base.storage_offset()]


_DECAY_CONSTANTS: Dict[Tuple[float, torch.dtype, torch.device], Tuple[Tensor, Tensor, Tensor]] = {}


def decay_constants(decay: float, dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, ...]:
    """0-d ``1``, ``1 - decay``, ``0`` in ``dtype`` on ``device``: made once, never written,
    filled there (no copy from the host, which would synchronize a GPU).
    """
    key = (decay, dtype, device)
    if key not in _DECAY_CONSTANTS:
        _DECAY_CONSTANTS[key] = tuple(
            torch.full((), v, dtype=dtype, device=device) for v in (1.0, 1 - decay, 0.0)
        )
    return _DECAY_CONSTANTS[key]


def rounds_to_one(x: float, dtype: torch.dtype) -> bool:
    """Whether the number ``x`` is ``1`` in ``dtype`` (float32 or float64; else assumed)."""
    if dtype == torch.float64:
        return x == 1.0
    if dtype == torch.float32:
        return struct.unpack("f", struct.pack("f", x))[0] == 1.0
    return True


def mean_diagonal(M: Tensor) -> Tensor:
    """``[C]``: the mean diagonal entry of ``M [C, D, D]`` (its mean eigenvalue), >= 0."""
    return M.diagonal(dim1=-2, dim2=-1).clamp_min(0).mean(-1)


class RunningFactors:
    """Running factors ``A``, ``G`` of a block, folded in on the device.

    The statistics half shared by :class:`KroneckerBlock` and
    :class:`~curvature.blocks.OneSidedBlock`: ``name``, ``index [C, D_out, D]``, the
    factors ``A`` / ``G`` (whatever shapes the block keeps) and :attr:`fresh`.
    """

    name: str
    index: Tensor
    A: Optional[Tensor]
    G: Optional[Tensor]
    #: 0-d device bool: no finite statistics folded in yet (``None``: known not).
    fresh: Optional[Tensor] = None

    @property
    def label(self) -> str:
        """The name shown in messages (``<model>`` for the root module)."""
        return self.name or "<model>"

    @property
    def shape(self) -> torch.Size:
        """``[C, D_out, D]``."""
        return self.index.shape

    def update(
        self, A: Tensor, G: Tensor, decay: float = 0.0, valid: Optional[Tensor] = None
    ) -> None:
        """Fold new factors into the running ones: ``X <- decay X + (1 - decay) X_new``.

        The first update takes the new factors as they are (copied). ``valid`` (0-d
        device bool; ``None``: true): whether the new factors count; false ones are zeros
        and leave the running factors unchanged (selected on the device: see
        :attr:`fresh` for a block that has only had such updates).
        """
        if self.A is None:
            self.A, self.G = A.clone(), G.clone()
            self.fresh = None if valid is None else ~valid
            return
        w, self.fresh = update_weight(valid, self.fresh, decay, self.A.dtype)
        self.A = ema(self.A, A, decay, w)
        self.G = ema(self.G, G, decay, w)

    def flags(self) -> List[Tensor]:
        """The 0-d device flags the block waits to read (:meth:`read_flags`)."""
        return [] if self.fresh is None else [self.fresh]

    def read_flags(self, values: List[bool]) -> None:
        """The host values of :meth:`flags`."""
        if self.fresh is not None and not values[0]:
            self.fresh = None


def pi_factor(mean_a: Tensor, mean_g: Tensor) -> Tensor:
    """The pi heuristic ``sqrt(mean eig(A) / mean eig(G))`` (Martens & Grosse, 2015).

    Tikhonov damping of a Kronecker product splits ``lambda`` as
    ``(A + pi sqrt(lambda) I) x (G + sqrt(lambda) / pi I)``. The means are the factors'
    average eigenvalues (= average diagonal entries), batched over leading axes.
    """
    return (mean_a / mean_g.clamp_min(1e-30)).clamp_min(1e-30).sqrt()


def kron(A: Tensor, B: Tensor) -> Tensor:
    """Kronecker products ``A_i (x) B_i`` of two batches: ``[..., p, q]``, ``[..., r, s]``
    to ``[..., p r, q s]``, entry ``(i r + k, j s + l) = A[i, j] B[k, l]``.

    One broadcast product, for any strides (``torch.kron`` fails on a row-major and a
    column-major operand together: the eigenvectors of ``eigh`` are column-major,
    the copies of a padded decomposition's row-major).
    """
    p, q = A.shape[-2:]
    r, s = B.shape[-2:]
    out = A[..., :, None, :, None] * B[..., None, :, None, :]
    return out.reshape(*out.shape[:-4], p * r, q * s)
