"""Lower-precision Kronecker statistics (opt-in): the GEMMs ``sum a a^T`` and ``sum g g^T``.

The layer rules' Kronecker factors are Gram matrices of their inputs and output
gradients (:func:`gram`). Inside :func:`statistics_precision` (``KFAC(...,
statistics_dtype=torch.bfloat16)``) their operands are rounded to the narrower ``dtype``
and the product is taken there, then returned in the operands' own dtype. Numerics (as
documented in docs/optimizers.md): the inputs lose their bits below ``dtype``'s
mantissa (bf16: 8 bits, a relative rounding of at most ``2^-9``), the products are
accumulated in float32 by the BLAS (CPU GEMMs with bf16 units, GPU tensor cores) and
the result is rounded once more to ``dtype`` before it is widened (torch has no
bf16-input, float32-output GEMM on the CPU): each entry of the step's ``A_sum``
carries a relative error of about ``2^-8`` of the entries' magnitudes, the running
average then smooths it over steps. The finiteness checks see the widened result.
Outside the context (the default) nothing is rounded: the products are those of the
operands' dtype, bit for bit as without this module.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch import Tensor

_DTYPE: contextvars.ContextVar[Optional[torch.dtype]] = contextvars.ContextVar(
    "curvature_statistics_dtype", default=None
)

#: the dtypes a user may ask for (narrower than the statistics' own dtype to matter)
STATISTICS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HALF = (torch.bfloat16, torch.float16)


@contextmanager
def statistics_precision(dtype: Optional[torch.dtype]) -> Iterator[None]:
    """Take the Kronecker statistics' GEMMs (:func:`gram`) in ``dtype`` inside the block
    (``None``: in the operands' dtype).
    """
    token = _DTYPE.set(dtype)
    try:
        yield
    finally:
        _DTYPE.reset(token)


def _narrower(x: Tensor, dtype: Optional[torch.dtype]) -> bool:
    return (
        dtype is not None
        and x.is_floating_point()
        and torch.finfo(dtype).bits < torch.finfo(x.dtype).bits
    )


#: Devices whose GEMMs take half-precision operands to a float32 result in one call
#: (``torch.mm(..., out_dtype=torch.float32)``: CUDA; a CPU has no such kernel): there a
#: float32 statistic's bf16 / fp16 product is not rounded to half precision (only its
#: operands are), and no widening copy follows. Where the call fails (an older torch),
#: the device falls back to the rounded product for the rest of the process.
WIDE_OUTPUT_DEVICES = ["cuda"]
#: (``torch.OutOfMemoryError`` from torch 2.5 on; ``torch.cuda``'s before)
_OUT_OF_MEMORY = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


def _wide_gram(y: Tensor) -> Optional[Tensor]:
    """``y^T y`` of half-precision ``y`` (2-d or 3-d) as float32, or ``None``."""
    global WIDE_OUTPUT_DEVICES
    if y.device.type not in WIDE_OUTPUT_DEVICES or y.dim() not in (2, 3):
        return None
    try:
        mm = torch.bmm if y.dim() == 3 else torch.mm
        return mm(y.mT, y, out_dtype=torch.float32)
    except _OUT_OF_MEMORY:
        raise
    except (RuntimeError, TypeError, NotImplementedError):  # (a new list: threads, tuples)
        WIDE_OUTPUT_DEVICES = [d for d in WIDE_OUTPUT_DEVICES if d != y.device.type]
        return None


def gram(x: Tensor, spec: Optional[str] = None) -> Tensor:
    """``x^T x``: ``[..., M, D] -> [..., D, D]`` (``torch.bmm`` for 3-d, a GEMM for 2-d),
    or ``torch.einsum(spec, x, x)``; in the dtype of :func:`statistics_precision` when it
    is narrower than ``x``'s (the result widened back to ``x.dtype``; a float32 result
    straight from half-precision operands on :data:`WIDE_OUTPUT_DEVICES`).
    """
    dtype = _DTYPE.get()
    low = _narrower(x, dtype)
    y = x.to(dtype) if low else x
    if low and spec is None and x.dtype == torch.float32 and dtype in _HALF:
        out = _wide_gram(y)
        if out is not None:
            return out
    if spec is not None:
        out = torch.einsum(spec, y, y)
    elif y.dim() == 3:
        out = torch.bmm(y.mT, y)
    else:
        out = y.mT @ y
    return out.to(x.dtype) if low else out


__all__ = ["STATISTICS_DTYPES", "gram", "statistics_precision"]
