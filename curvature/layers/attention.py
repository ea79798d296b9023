"""``nn.MultiheadAttention``: all projection weights, including ``out_proj``.

``nn.MultiheadAttention`` calls ``F.multi_head_attention_forward`` with
``out_proj.weight`` as a plain tensor, so hooks on ``out_proj`` never fire. The rule
therefore covers the whole module (``in_proj_weight``/``q,k,v_proj_weight``, biases,
``bias_k``/``bias_v`` and ``out_proj``) and computes per-sample gradients with the
``torch.func`` replay of :class:`~curvature.layers.functional.FunctionalRule` from the
recorded inputs and the received output gradients.
"""

from __future__ import annotations

from torch import Tensor, nn

from .functional import FunctionalRule
from .registry import register

_ARG_NAMES = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)


@register(nn.MultiheadAttention)
class MultiheadAttentionRule(FunctionalRule):
    """Per-sample gradients of every trainable parameter of ``nn.MultiheadAttention``."""

    covers_children = True

    def batch_axis(self, module):  # noqa: D102
        return 0 if module.batch_first else 1

    def arg_batch_axes(self, module, call, N):  # noqa: D102
        if module.training and module.dropout > 0:
            raise RuntimeError(
                f"nn.MultiheadAttention(dropout={module.dropout}) in train mode draws "
                "random attention masks that cannot be replayed per sample. Use "
                "dropout=0.0 or eval mode while computing per-sample quantities."
            )
        ax = self.batch_axis(module)
        named = dict(zip(_ARG_NAMES, call.args))
        named.update(call.kwargs)
        mask = named.get("attn_mask")
        if isinstance(mask, Tensor) and mask.dim() == 3:
            raise ValueError(
                "nn.MultiheadAttention with a per-sample 3-D attn_mask [N * num_heads, L, S] "
                "is not supported for per-sample quantities; pass a shared [L, S] mask and "
                "a key_padding_mask [N, S] instead."
            )
        args = tuple(ax if i < 3 else None for i in range(len(call.args)))
        if len(call.args) > 3 and isinstance(call.args[3], Tensor):
            args = args[:3] + (0,) + args[4:]
        kwargs = {k: None for k in call.kwargs}
        if isinstance(call.kwargs.get("key_padding_mask"), Tensor):
            kwargs["key_padding_mask"] = 0
        return args, kwargs
