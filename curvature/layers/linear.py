"""``nn.Linear`` on inputs ``[N, *, D_in]``: the leading axes after ``N`` are shared."""

from __future__ import annotations

from torch import nn

from .base import LinearFamilyRule
from .registry import register


@register(nn.Linear)
class LinearRule(LinearFamilyRule):
    """``z = W a + b`` with ``a [N, S..., D_in]`` flattened to ``[N, S, 1, D_in]``."""

    base_edge_outputs = (0,)  # the matmul result behind a reshaped output

    def expand(self, module, call):  # noqa: D102
        x = call.args[0]
        N = x.shape[0]
        a = x.reshape(N, -1, 1, x.shape[-1])
        if call.grads is None:  # forward-only statistics
            return a, None
        g = call.grads[0]
        g = g.reshape(*g.shape[: g.dim() - x.dim()], N, -1, 1, g.shape[-1])
        return a, g
