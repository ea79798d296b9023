"""``nn.Linear`` on inputs ``[N, *, D_in]``: the leading axes after ``N`` are shared."""

from __future__ import annotations

import torch
from torch import nn

from .base import LinearFamilyRule, cached_ones
from .plain import PlainOperands, SquaredInputs
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

    def expanded_blocks(self, module, calls):
        """``{"": (a, g)}`` of :meth:`expand_calls`; for one call made once per ``call.grads``
        (kept in ``call.expanded``): the quadratic rule's records and the Kronecker
        statistics of a pull share them (in a forward Laplacian, ``a`` with the bias column
        is a copy of the state's size).
        """
        one = calls[0] if len(calls) == 1 else None
        if one is not None and one.expanded is not None and one.expanded[0] is one.grads:
            return one.expanded[1]
        blocks = super().expanded_blocks(module, calls)
        if one is not None:
            one.expanded = (one.grads, blocks)
        return blocks

    def plain_operands(self, module, calls):
        """The :class:`~curvature.layers.plain.PlainOperands` of one call, else ``None``.

        ``a [1, N S, D]`` (bias column appended when the bias is trainable) and
        ``g [K, N S, D_out]``: one reshape where the input is not 2-D, one ``unsqueeze``
        and one ``cat`` for the bias column, made once per ``call.grads`` (kept in
        ``call.plain``). ``None`` for several calls or a call inside
        :func:`~curvature.layers.base.shared_slots` (the general path handles them).
        """
        if len(calls) != 1 or calls[0].slots is not None:
            return None
        call = calls[0]
        if call.plain is not None and call.plain[0] is call.grads:  # made for these grads
            return call.plain[1]
        has_w, has_b = self._weight_bias(module)
        x = call.args[0]
        D_in = x.shape[-1]
        g = None if call.grads is None else call.grads[0]
        if g is not None and x.dtype != g.dtype:  # e.g. bf16 inputs under autocast
            x = x.to(torch.promote_types(x.dtype, g.dtype))
        a = x.unsqueeze(0) if x.dim() == 2 else x.reshape(1, -1, D_in)
        if has_b:
            ones = cached_ones((1, a.shape[1], 1), a.dtype, a.device)
            a = torch.cat([a, ones], dim=2) if has_w else ones
        if g is not None and g.dim() != 3:  # [K, N, S..., D_out]
            g = g.reshape(g.shape[0], -1, g.shape[-1])
        ops = PlainOperands(a, g, a.shape[1] // x.shape[0] if x.shape[0] else 1)
        call.plain = (call.grads, ops)
        return ops

    def plain_squares(self, module, calls, squares: SquaredInputs):
        """``(g [K, M, D_out], [x^2 | 1] [1, M, D])`` of one call with 2-D inputs, else ``None``.

        The operands of the Fisher diagonal (:func:`~curvature.layers.plain.squares_diagonal`)
        with the squared inputs written into the persistent ``squares``: one ``pow`` per
        call. ``None`` where :meth:`plain_operands` would take the general path, for
        inputs that are not 2-D (shared positions), without gradients, or with inputs in
        another dtype than the gradients (e.g. bf16 under autocast: promoted there); and
        where the buffer ``[M, D]`` would be larger than the layer's diagonal ``[D_out,
        D]`` (``M > D_out``, e.g. a classifier head): a buffer kept from step to step is
        at most the size of the optimizer's own state for the layer.
        """
        if len(calls) != 1 or calls[0].slots is not None or calls[0].grads is None:
            return None
        x, g = calls[0].args[0], calls[0].grads[0]
        if x.dim() != 2 or g.dim() != 3 or x.dtype != g.dtype or x.shape[0] > g.shape[-1]:
            return None
        return g, squares.of(x, *self._weight_bias(module))
