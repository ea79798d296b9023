"""Normalization layers: their affine parameters act elementwise on ``xhat``.

With ``xhat`` the normalized input (recomputed from the recorded input, no statistics
are stored by the forward), ``y = gamma * xhat + beta`` and the per-sample gradients are
``grad gamma_n = sum_s g[n, s] * xhat[n, s]`` and ``grad beta_n = sum_s g[n, s]`` over
the positions ``s`` that share the parameter.

BatchNorm is supported in eval mode only (running statistics); in train mode it mixes
samples and per-sample quantities are undefined. The optimizers accept it in train mode
(see :func:`uses_batch_statistics`): its parameters then get the plain gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import LayerRule
from .registry import register


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether ``module`` is a BatchNorm that normalizes with the statistics of the batch.

    True in train mode and for ``track_running_stats=False``: the output of one sample
    then depends on every sample of the batch.
    """
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or not module.track_running_stats
    )


def batchnorm_train_error(name: str, module: nn.Module) -> ValueError:
    """The error for a BatchNorm layer that normalizes with batch statistics."""
    return ValueError(
        f"Module '{name}' ({type(module).__name__}) normalizes with batch statistics "
        "(train mode or track_running_stats=False), which mixes the samples of a batch: "
        "per-sample quantities are undefined. Call `.eval()` on it (running statistics) "
        "or replace it by nn.GroupNorm / nn.LayerNorm."
    )


class _AffineNormRule(LayerRule):
    """Shared maths; subclasses give ``xhat`` and the channel axis layout."""

    def normalized(self, module: nn.Module, x: Tensor) -> Tensor:
        """The normalized input ``xhat`` (shape of ``x``)."""
        raise NotImplementedError

    def per_param_shape(self, module: nn.Module, t: Tensor) -> Tensor:
        """Sum ``t [N, *x.shape[1:]]`` over positions sharing a parameter entry."""
        raise NotImplementedError

    def normalized_from_call(self, module: nn.Module, call) -> Tensor:
        """``xhat`` of a recorded call (by default recomputed from its input)."""
        return self.normalized(module, call.args[0])

    def per_sample_grads(self, module, calls, out=None):  # noqa: D102
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        out: dict[str, Tensor] = {}
        for call in calls:
            g = call.grads[0]
            parts = {}
            if weight is not None and weight.requires_grad:
                xhat = self.normalized_from_call(module, call).to(g.dtype)
                parts["weight"] = self.per_param_shape(module, g * xhat)
            if bias is not None and bias.requires_grad:
                parts["bias"] = self.per_param_shape(module, g)
            for k, v in parts.items():
                out[k] = out[k] + v if k in out else v
        return out


@register(nn.LayerNorm)
class LayerNormRule(_AffineNormRule):
    """``nn.LayerNorm`` over the trailing ``normalized_shape`` axes."""

    extra_edges_optional = True  # the saved statistics only spare their recomputation

    def normalized(self, module, x):  # noqa: D102
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)

    def extra_edges(self, module, args, kwargs, leaves, index):  # noqa: D102
        """No extra edges; keeps the mean and ``1/std`` the forward saved, if found."""
        node = leaves[0].grad_fn if index and index[0] == 0 else None
        if type(node).__name__ != "NativeLayerNormBackward0":
            return None
        try:
            mean, rstd = node._saved_result1, node._saved_result2
        except (AttributeError, RuntimeError):
            return None
        x = args[0] if args else None
        expected = (
            (
                *x.shape[: x.dim() - len(module.normalized_shape)],
                *[1] * len(module.normalized_shape),
            )
            if isinstance(x, Tensor)
            else None
        )
        if expected is None or tuple(mean.shape) != expected or tuple(rstd.shape) != expected:
            return None
        return [], (mean, rstd)

    def normalized_from_call(self, module, call):  # noqa: D102
        stats = getattr(call, "extra_info", None)
        if stats is None:  # e.g. RMSNorm, or a forward without saved statistics
            return self.normalized(module, call.args[0])
        mean, rstd = stats
        return (call.args[0] - mean).mul_(rstd)  # the forward's own statistics

    def per_param_shape(self, module, t):  # noqa: D102
        ns = tuple(module.normalized_shape)
        return t.reshape(t.shape[0], -1, *ns).sum(1)


if hasattr(nn, "RMSNorm"):

    @register(nn.RMSNorm)
    class RMSNormRule(LayerNormRule):
        """``nn.RMSNorm``: ``xhat = x / sqrt(mean(x^2) + eps)``."""

        def normalized(self, module, x):  # noqa: D102
            return F.rms_norm(x, module.normalized_shape, None, module.eps)

        def extra_edges(self, module, args, kwargs, leaves, index):  # noqa: D102
            return None  # no saved statistics to reuse: xhat is recomputed


@register(nn.GroupNorm)
class GroupNormRule(_AffineNormRule):
    """``nn.GroupNorm`` on ``[N, C, *]``; affine parameters per channel."""

    def normalized(self, module, x):  # noqa: D102
        return F.group_norm(x, module.num_groups, None, None, module.eps)

    def per_param_shape(self, module, t):  # noqa: D102
        return t.reshape(t.shape[0], t.shape[1], -1).sum(-1)


@register(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
class BatchNormEvalRule(GroupNormRule):
    """BatchNorm with running statistics (eval mode) on ``[N, C, *]``."""

    def normalized(self, module, x):  # noqa: D102
        if module.training or module.running_mean is None:
            raise batchnorm_train_error(type(module).__name__, module)
        shape = (1, -1) + (1,) * (x.dim() - 2)
        mean = module.running_mean.view(shape)
        var = module.running_var.view(shape)
        return (x - mean) * torch.rsqrt(var + module.eps)
