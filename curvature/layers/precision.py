"""The Kronecker statistics' GEMMs ``sum a a^T`` and ``sum g g^T`` (:func:`gram`): large ones
on a CPU from their lower block triangle (:func:`triangle_gram`); lower precision (opt-in).

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


#: Devices whose large Gram matrices are taken a block row at a time, the lower block
#: triangle only (:func:`triangle_gram`): a CPU's GEMM does not know that ``x^T x`` is
#: symmetric. One thread / two threads, one GEMM -> ``gram()``, ms (``python
#: benchmarks/gram_blocks.py``, 2026-11-27): ``[256, 785]`` 1.98 -> 1.69 / 1.09 -> 1.01,
#: ``[2048, 288]`` 2.23 -> 1.50 / 1.14 -> 0.93, ``[1024, 2049]`` 55.3 -> 40.7 / 26.0 ->
#: 22.4; below about :data:`TRIANGLE_GRAM_WORK` multiply-adds three blocks lose on two
#: threads (``[128, 785]`` 0.55 -> 0.60).
TRIANGLE_GRAM_DEVICES = ("cpu",)
#: The least ``M D^2`` (and ``D >= 128``) of a Gram matrix taken by :func:`triangle_gram`.
TRIANGLE_GRAM_WORK = 10**8
#: Block rows of :func:`triangle_gram` (3: 2/3 of the full product's multiply-adds).
TRIANGLE_GRAM_BLOCKS = 3


def triangle_gram(x: Tensor, blocks: int = TRIANGLE_GRAM_BLOCKS) -> Tensor:
    """``x^T x`` of a 2-d ``x [M, D]`` from its lower block triangle, mirrored.

    The columns split into ``blocks`` ranges ``b_0 < ... < b_k``; block row ``i`` is one
    GEMM, ``x[:, b_i:b_{i+1}]^T x[:, :b_{i+1}]``, written in place into the result (a
    strided view, read by the BLAS with its leading dimension), and each block above the
    diagonal is the transpose of its mirror: ``(k + 1) / (2 k)`` of the multiply-adds,
    and a result that is exactly symmetric.
    """
    if x.dim() != 2 or not isinstance(blocks, int) or blocks < 1:
        raise ValueError(
            f"triangle_gram: expected a 2-d x and blocks >= 1, got x of shape "
            f"{tuple(x.shape)} and blocks={blocks!r}."
        )
    return _triangle_into(x, x.new_empty(x.shape[1], x.shape[1]), blocks)


def _triangle_into(x: Tensor, out: Tensor, blocks: int) -> Tensor:
    """:func:`triangle_gram` of ``x [M, D]`` written into ``out [D, D]`` (returned)."""
    D = x.shape[1]
    b = [(i * D) // blocks for i in range(blocks + 1)]
    for i in range(blocks):
        torch.mm(x[:, b[i] : b[i + 1]].T, x[:, : b[i + 1]], out=out[b[i] : b[i + 1], : b[i + 1]])
    for i in range(blocks):
        for j in range(i + 1, blocks):
            out[b[i] : b[i + 1], b[j] : b[j + 1]].copy_(out[b[j] : b[j + 1], b[i] : b[i + 1]].T)
    return out


def _by_triangle(y: Tensor) -> bool:
    """Whether :func:`gram` takes ``y``'s Gram matrix by :func:`triangle_gram`."""
    M, D = y.shape[-2:]
    return (
        y.device.type in TRIANGLE_GRAM_DEVICES
        and (y.dim() == 2 or (y.dim() == 3 and y.shape[0] == 1))
        and y.dtype in (torch.float32, torch.float64)
        and D >= 128
        and M * D * D >= TRIANGLE_GRAM_WORK
        # out= takes no autograd graph, no vmap'ed and no traced tensors: one GEMM there
        and not (y.requires_grad and torch.is_grad_enabled())
        and not torch._C._are_functorch_transforms_active()
        and not torch.compiler.is_compiling()
    )


def gram(x: Tensor, spec: Optional[str] = None) -> Tensor:
    """``x^T x``: ``[..., M, D] -> [..., D, D]`` (``torch.bmm`` for 3-d, a GEMM for 2-d;
    large ones on a CPU by :func:`triangle_gram`), or ``torch.einsum(spec, x, x)``; in the
    dtype of :func:`statistics_precision` when it is narrower than ``x``'s (the result
    widened back to ``x.dtype``; a float32 result straight from half-precision operands
    on :data:`WIDE_OUTPUT_DEVICES`).
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
    elif _by_triangle(y):
        # a 3-d result of its own, not a view of a 2-d one: the statistics' flush zeroes
        # such a tensor in place, where it selects a view into a copy (a ``where`` of
        # 0.50-0.73 ms against 0.24-0.30 ms on a 785 x 785 factor, one thread)
        D = y.shape[-1]
        full = y.new_empty(*y.shape[:-2], D, D)
        _triangle_into(
            y[0] if y.dim() == 3 else y, full[0] if y.dim() == 3 else full, TRIANGLE_GRAM_BLOCKS
        )
        out = full
    elif y.dim() == 3:
        out = torch.bmm(y.mT, y)
    else:
        out = y.mT @ y
    return out.to(x.dtype) if low else out


__all__ = ["STATISTICS_DTYPES", "gram", "statistics_precision", "triangle_gram"]
