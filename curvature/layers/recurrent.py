"""``nn.RNN``, ``nn.LSTM``, ``nn.GRU``: exact per-sample gradients by replaying each sample.

A recurrent layer ``(output, h_n) = f(theta, x, h_0)`` (``(h_n, c_n)`` for an LSTM) has
no Kronecker structure that this package uses. Its per-sample gradient is the exact
vector-Jacobian product

    grad_n = (d f(theta, x_n, h_0n) / d theta)^T g_n

with ``g_n`` the recorded output gradients of sample ``n``, computed by replaying the
layer on sample ``n`` alone (a batch of one, torch's own recurrent kernels) and one
backward: ``N`` replays per call, exact, and slower than the vectorized rules (torch's
recurrent kernels cannot be ``vmap``-ed). The batch axes are the layer's own:

- input ``x`` and ``output``: ``[N, L, H]`` with ``batch_first=True``, else ``[L, N, H]``;
- the states ``h_0``, ``c_0``, ``h_n``, ``c_n``: ``[layers * directions, N, H]`` (axis 1).

The curvature functions and optimizers give such a layer an exact block up to
:data:`curvature.layer_stats.MAX_EXACT_BLOCK` trainable parameters; a larger one (without
``proj_size``) gets Kronecker factors of its Linear sub-layers shared over the time steps
(:mod:`curvature.layers.recurrent_unrolled`: the layer replayed step by step, its
recorded output gradients backpropagated through time), blocks ``"ih_l0"``, ``"hh_l0"``,
... Packed sequences, unbatched inputs and dropout between layers in train mode are
refused with a clear error.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils._pytree import tree_flatten

from .base import Call, LayerRule, check_same_samples, replaying
from .kfac_sums import expanded_kfac
from .recurrent_unrolled import sublayers, unrolled_blocks
from .registry import register


def _narrow(x: Any, dim: Optional[int], i: int) -> Any:
    """Sample ``i`` of ``x`` along ``dim`` (kept as an axis of size one); tuples item-wise."""
    if isinstance(x, (tuple, list)):
        return type(x)(_narrow(t, dim, i) for t in x)
    if isinstance(x, Tensor) and dim is not None and x.dim() == 3:
        return x.narrow(dim, i, 1)
    return x


@register(nn.RNNBase)
class RecurrentRule(LayerRule):
    """Per-sample gradients of ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``, one sample at a time."""

    def batch_axis(self, module: nn.Module) -> int:
        """The batch axis of the input and ``output``: 0 with ``batch_first``, else 1."""
        return 0 if module.batch_first else 1

    def _input(self, module: nn.Module, call: Call) -> Tensor:
        x = call.args[0] if call.args else call.kwargs.get("input")
        name = type(module).__name__
        if not isinstance(x, Tensor):
            raise ValueError(
                f"nn.{name} got a {type(x).__name__} input: per-sample gradients of packed "
                "sequences are not supported. Pass a padded batch (e.g. torch.nn.utils.rnn."
                f"pad_packed_sequence), or freeze the {name}'s parameters "
                "(requires_grad_(False))."
            )
        if x.dim() != 3:
            layout = "[N, L, H]" if module.batch_first else "[L, N, H]"
            raise ValueError(
                f"nn.{name} got an unbatched input of shape {list(x.shape)}: per-sample "
                f"quantities need a batch axis, {layout}."
            )
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise ValueError(
                f"nn.{name}(dropout={module.dropout}) in train mode draws random masks "
                "between its layers, so its per-sample gradients cannot be replayed. Put "
                f"the {name} in eval mode, or use dropout=0."
            )
        return x

    def batch_size(self, module, call):  # noqa: D102
        return self._input(module, call).shape[self.batch_axis(module)]

    # -- Kronecker factors: the Linear sub-layers shared over time ----------------------
    @staticmethod
    def kronecker(module: nn.Module) -> bool:
        """Whether the layer gets Kronecker blocks: more trainable parameters than an exact
        block takes, and no ``proj_size`` (an LSTM's projection is not covered).
        """
        from ..layer_stats import MAX_EXACT_BLOCK  # (layer_stats imports the rules)

        n = sum(p.numel() for p in module.parameters() if p.requires_grad)
        return n > MAX_EXACT_BLOCK and not getattr(module, "proj_size", 0)

    def expanded_blocks(self, module, calls):  # noqa: D102
        if not self.kronecker(module) or any(c.grads is None for c in calls):
            return None
        out: Dict[str, list] = {}
        for call in calls:  # one replay per call and gradients, kept in ``call.expanded``
            if call.expanded is None or call.expanded[0] is not call.grads:  # (EKFAC's
                x = self._input(module, call)  # factors and corrections share it)
                hx = call.args[1] if len(call.args) > 1 else call.kwargs.get("hx")
                blocks = unrolled_blocks(module, x, hx, call.grads, call.out_index)
                call.expanded = (call.grads, blocks)
            for s, (a, g) in call.expanded[1].items():
                out.setdefault(s, []).append((a, g))
        for v in out.values():
            check_same_samples(module, [a.shape[0] for a, _ in v])
        return {  # several calls: weight sharing over their time steps (axis S)
            s: (torch.cat([a for a, _ in v], 1), torch.cat([g for _, g in v], 2))
            for s, v in out.items()
        }

    def kfac_factors(self, module, calls, approx, with_g=True):
        """As the base class, but an RNN's or LSTM's ``hh`` sub-layer shares ``G`` with its
        ``ih`` one: both pre-activations enter the gates as one sum, so their gradients are
        equal (a GRU's ``n`` gate takes ``r z^hh_n``: not there). One ``G`` GEMM fewer.
        """
        blocks = self.expanded_blocks(module, calls)
        if blocks is None:
            return None
        out = {}
        for s, (a, g) in blocks.items():
            twin = out.get("ih_" + s[3:]) if s.startswith("hh_") else None
            if twin is not None and twin[1] is not None and module.mode != "GRU":
                A_sum, _, count = expanded_kfac(a, None, approx)
                out[s] = (A_sum, twin[1], count)
            else:
                out[s] = expanded_kfac(a, g if with_g else None, approx)
        return out

    def kfac_index(self, module, offsets, device=None):  # noqa: D102
        if not self.kronecker(module):
            return None
        index = {}
        for name, W, b in sublayers(module):
            cols = []
            if W.requires_grad:
                base = offsets[f"weight_{name}"]
                cols.append(torch.arange(base, base + W.numel(), device=device).view(W.shape))
            if b is not None and b.requires_grad:
                base = offsets[f"bias_{name}"]
                cols.append(torch.arange(base, base + b.numel(), device=device).view(-1, 1))
            if cols:
                index[name] = torch.cat(cols, 1).unsqueeze(0)
        return index

    def kfac_shapes(self, module):  # noqa: D102
        if type(self).kfac_index is not RecurrentRule.kfac_index or not self.kronecker(module):
            return super().kfac_shapes(module)
        out = {}
        for name, W, b in sublayers(module):
            D = W.shape[1] * W.requires_grad + (b is not None and b.requires_grad)
            if D:
                out[name] = (1, W.shape[0], D)
        return out

    def per_sample_grads(self, module, calls, out=None):  # noqa: D102
        names = self.param_names(module)
        total: Dict[str, Tensor] = {}
        for call in calls:
            x = self._input(module, call)
            ax = self.batch_axis(module)
            rows: Dict[str, List[Tensor]] = {n: [] for n in names}
            for i in range(x.shape[ax]):
                for n, g in zip(names, self._sample_grads(module, call, names, i)):
                    rows[n].append(g)
            for n in names:
                g = torch.stack(rows[n])
                total[n] = total[n] + g if n in total else g
        return total

    def _sample_grads(self, module: nn.Module, call: Call, names: List[str], i: int):
        """The gradient of sample ``i``'s outputs, ``sum <g_i, f(theta, x_i, h_0i)>``."""
        ax = self.batch_axis(module)
        params = {n: p.detach().requires_grad_() for n, p in module.named_parameters()}
        args = (_narrow(call.args[0], ax, i), *(_narrow(h, 1, i) for h in call.args[1:]))
        kwargs = {k: _narrow(v, ax if k == "input" else 1, i) for k, v in call.kwargs.items()}
        with torch.enable_grad(), replaying():
            leaves, _ = tree_flatten(functional_call(module, params, args, kwargs))
        outs = [leaves[j] for j in call.out_index]
        gs = [g.narrow(ax if j == 0 else 1, i, 1) for g, j in zip(call.grads, call.out_index)]
        wanted = [params[n] for n in names]
        grads = torch.autograd.grad(outs, wanted, gs, allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(wanted, grads)]
