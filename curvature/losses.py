"""Supported loss modules and their per-sample decomposition.

The curvature of a batch is that of exactly the scalar the loss module returns. With
``l_n`` the loss module applied to sample ``n`` alone (same reduction), the batch loss
is ``L = R * sum_n l_n`` with ``R = 1/N`` for ``reduction="mean"`` and ``R = 1`` for
``"sum"``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_LOSSES = (nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss)
_NAMES = "nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss"


def check_loss(loss_func: nn.Module) -> None:
    """Raise a ``ValueError`` unless ``loss_func`` is a supported loss module.

    Supported: ``nn.CrossEntropyLoss`` (also over trailing axes ``[N, C, *]``, without
    class ``weight``), ``nn.MSELoss`` and ``nn.BCEWithLogitsLoss``, each with reduction
    ``"mean"`` or ``"sum"``.
    """
    if not isinstance(loss_func, SUPPORTED_LOSSES):
        raise ValueError(
            f"loss_func={loss_func!r} is not supported; use one of {_NAMES} "
            "(reduction 'mean' or 'sum')."
        )
    if loss_func.reduction not in ("mean", "sum"):
        raise ValueError(
            f"{type(loss_func).__name__}(reduction={loss_func.reduction!r}) is not supported; "
            "use reduction='mean' or 'sum' (the curvature is that of the returned scalar)."
        )
    if isinstance(loss_func, nn.CrossEntropyLoss) and loss_func.weight is not None:
        raise ValueError(
            "nn.CrossEntropyLoss(weight=...) with class weights normalizes the mean by the "
            "batch's total weight, which does not split into per-sample losses; use "
            "weight=None (or reweight the per-sample losses yourself)."
        )


def reduction_scale(loss_func: nn.Module, batch_size: int) -> float:
    """``R`` in ``L = R * sum_n l_n``: ``1 / N`` for mean, ``1`` for sum."""
    return 1.0 / batch_size if loss_func.reduction == "mean" else 1.0


def per_sample_losses(loss_func: nn.Module, output: Tensor, target: Tensor) -> Tensor:
    """Per-sample losses ``l_n`` ``[N]`` such that ``loss_func(output, target) = R sum l_n``.

    Args:
        loss_func: A supported loss module (see :func:`check_loss`).
        output: Model output ``[N, ...]``.
        target: Targets for ``loss_func``.

    Returns:
        ``[N]``: the loss of each sample alone, with the module's reduction.

    """
    check_loss(loss_func)
    if isinstance(loss_func, nn.CrossEntropyLoss):
        if (
            loss_func.reduction == "mean"
            and not target.is_floating_point()
            and bool((target == loss_func.ignore_index).any())
        ):
            raise ValueError(
                f"target contains ignore_index={loss_func.ignore_index} with reduction "
                "'mean': the batch mean then runs over the non-ignored entries only and "
                "does not split into per-sample losses. Use reduction='sum'."
            )
        elementwise = F.cross_entropy(
            output,
            target,
            ignore_index=loss_func.ignore_index,
            reduction="none",
            label_smoothing=loss_func.label_smoothing,
        )
    elif isinstance(loss_func, nn.MSELoss):
        elementwise = F.mse_loss(output, target, reduction="none")
    else:
        elementwise = F.binary_cross_entropy_with_logits(
            output,
            target,
            weight=loss_func.weight,
            pos_weight=loss_func.pos_weight,
            reduction="none",
        )
    flat = elementwise.reshape(elementwise.shape[0], -1)
    return flat.mean(1) if loss_func.reduction == "mean" else flat.sum(1)
