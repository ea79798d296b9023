"""Per-sample gradients of a model on a batch, and Jacobians from an existing graph."""

from __future__ import annotations

import warnings
from typing import Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .capture import Capture, isolated
from .losses import check_loss, per_sample_losses, require_tensor_output
from .options import renamed


def per_sample_grads(
    model: nn.Module,
    loss_func: nn.Module,
    X: Tensor,
    y: Tensor,
    *,
    unsupported: str = "functorch",
    fallback: Optional[str] = None,
) -> Dict[str, Tensor]:
    """Per-sample gradients ``grad l_n`` (not scaled by the reduction) of every parameter.

    One forward and one backward: ``l_n`` is ``loss_func`` on sample ``n`` alone, so that
    the batch gradient is ``R * sum_n grad l_n`` (``R = 1/N`` for mean, ``1`` for sum).

    Args:
        model: The model; batch axis first.
        loss_func: ``nn.CrossEntropyLoss``, ``nn.MSELoss`` or ``nn.BCEWithLogitsLoss``.
        X: Inputs ``[N, ...]`` (a tuple is unpacked into ``model(*X)``).
        y: Targets.
        unsupported: ``"functorch"`` or ``"error"``, see :func:`curvature.capture`.
        fallback: Deprecated name of ``unsupported``.

    Returns:
        Trainable parameter name to ``[N, *p.shape]``, in ``model.named_parameters()``
        order.

    """
    check_loss(loss_func)
    unsupported, arg = renamed(unsupported, fallback, "unsupported", "fallback", "per_sample_grads")
    with Capture(model, unsupported=unsupported) as cap, isolated(cap):
        out = model(*X) if isinstance(X, (tuple, list)) else model(X)
    require_tensor_output(out, "per_sample_grads")
    return cap.per_sample_grads(per_sample_losses(loss_func, out, y), retain_graph=False)


def jacobian(
    outputs: Tensor,
    inputs: Union[Tensor, Sequence[Tensor]],
    *,
    chunk_size: Optional[int] = None,
) -> Union[Tensor, List[Tensor]]:
    """Jacobian of every element of an already computed ``outputs`` w.r.t. ``inputs``.

    Uses the existing graph: one vmapped backward (``is_grads_batched``) per chunk of
    output elements, no Python loop over elements and no second forward. The graph is
    retained.

    Example:
        >>> C = torch.tensor(2.0, requires_grad=True)  # doctest: +SKIP
        >>> y = C * x  # x [N, D]
        >>> curvature.jacobian(y, C)  # [N, D] = x

    Args:
        outputs: A tensor with a graph to ``inputs``.
        inputs: A tensor or a sequence of tensors that ``outputs`` was computed from.
        chunk_size: Output elements per backward (all at once if ``None``); lower it to
            bound memory, which is ``chunk_size * sum_i inputs[i].numel()``.

    Returns:
        ``[*outputs.shape, *input.shape]`` per input (a list for a sequence of inputs);
        zeros for inputs that ``outputs`` does not depend on.

    """
    single = isinstance(inputs, Tensor)
    ins = [inputs] if single else list(inputs)
    if not isinstance(outputs, Tensor) or outputs.grad_fn is None:
        raise ValueError(
            "outputs must be a tensor computed with gradients enabled from `inputs` "
            "(it has no grad_fn)."
        )
    for i, t in enumerate(ins):
        if not isinstance(t, Tensor) or not t.requires_grad:
            raise ValueError(f"inputs[{i}] must be a tensor with requires_grad=True.")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be a positive integer or None.")
    M = outputs.numel()
    chunk = M if chunk_size is None else min(chunk_size, M)
    parts: List[List[Tensor]] = [[] for _ in ins]
    for start in range(0, M, chunk):
        rows = min(chunk, M - start)
        V = torch.zeros(rows, M, dtype=outputs.dtype, device=outputs.device)
        V[torch.arange(rows), start + torch.arange(rows)] = 1
        grads = torch.autograd.grad(
            outputs,
            ins,
            V.view(rows, *outputs.shape),
            retain_graph=True,
            allow_unused=True,
            is_grads_batched=True,
        )
        for i, (g, t) in enumerate(zip(grads, ins)):
            parts[i].append(
                torch.zeros(rows, *t.shape, dtype=t.dtype, device=t.device) if g is None else g
            )
    result = [torch.cat(p).view(*outputs.shape, *t.shape) for p, t in zip(parts, ins)]
    return result[0] if single else result


def release_result_cache() -> None:
    """Deprecated no-op, kept so that existing code keeps running.

    :meth:`curvature.Capture.per_sample_grads` used to hand out large CPU results from
    a process-wide cache of reused memory, which this function emptied. Results are now
    ordinary tensors, freed as soon as you drop them, so there is nothing to release. To
    avoid allocating on every step, pass buffers you keep across steps:
    ``per_sample_grads(losses, out=buffers)``.

    Warns:
        DeprecationWarning: Always; the function will be removed in a later release.

    """
    warnings.warn(
        "curvature.per_sample.release_result_cache() does nothing and will be removed: "
        "per-sample results are ordinary tensors now, freed when you drop them (no cache). "
        "Pass out= buffers to per_sample_grads to reuse memory across steps.",
        DeprecationWarning,
        stacklevel=2,
    )
