"""``DiagonalNaturalGradient``: preconditioning with a running Fisher diagonal.

The cheap member of the family, for models (or layers) whose Kronecker factors are too
large: the update direction is ``g / (d + lambda)`` with ``d`` the running diagonal of
the chosen Fisher, ``d = sum_{k,n} grad_nk^2`` from the per-sample (per-vector)
gradients of the collected backward: the diagonal empirical Fisher (``"empirical"``),
its Monte-Carlo estimate (``"mc"``), or the exact GGN diagonal (``"type-2"``). It is
computed per layer without materializing per-sample gradients where the layer allows
(``(g^2)^T (a^2)`` for Linear layers without weight sharing).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch import Tensor

from ..layer_stats import expanded_diagonal as _expanded_diag
from ..layer_stats import per_vector_grads as _per_vector_grads
from ..layout import ParamLayout
from .base import CurvatureOptimizer, _put, _take


class DiagonalNaturalGradient(CurvatureOptimizer):
    """Natural gradient with a diagonal Fisher; the arguments of :class:`~curvature.KFAC`.

    ``kfac_approx``, ``inverse_every`` and ``damping_mode`` have no effect;
    ``fisher="forward-only"`` is refused (it has no diagonal).
    """

    def __init__(self, model, lr=1e-2, damping=1e-3, momentum=0.0, weight_decay=0.0, **kwargs):
        if kwargs.get("fisher", "empirical") == "forward-only":
            raise ValueError(
                "DiagonalNaturalGradient(fisher='forward-only'): a forward-only Fisher has "
                "no diagonal; use 'empirical', 'mc', 'type-2' or 'rademacher'."
            )
        self.diagonal_: Dict[str, Tensor] = {}
        self._ix: Dict[str, Tensor] = {}
        super().__init__(model, lr, damping, momentum, weight_decay, **kwargs)

    def _covered_names(self) -> List[str]:
        covered = []
        for name, (module, _) in self._layers.items():
            prefix = f"{name}." if name else ""
            covered += [prefix + n for n, p in module.named_parameters() if p.requires_grad]
        return [n for n in self._offsets if n in set(covered)]

    def _reset_curvature(self) -> None:
        self.diagonal_, self._ix = {}, {}

    def _accumulate(self, name, module, rule, calls, with_g) -> None:
        expanded = rule.expanded_blocks(module, calls)
        if expanded is None:
            d = _per_vector_grads(rule, module, calls).pow(2).sum((0, 1))
            ix = _exact_index(module, name, self._offsets)  # named_parameters order
        else:
            d = torch.cat([_expanded_diag(a, g).reshape(-1) for a, g in expanded.values()])
            index = rule.kfac_index(module, _local_offsets(name, self._offsets))
            ix = torch.cat([index[s].reshape(-1) for s in expanded])
        self._ix[name] = ix
        dt = torch.float64 if d.dtype == torch.float64 else torch.float32
        self._add_step_stat((name, "diag"), [d.to(dt)], ("g",))

    def _update_statistics(self, stats) -> None:
        beta = self.factor_decay
        for (name, _, _), values in stats.items():
            d = values[0]
            prev = self.diagonal_.get(name)
            self.diagonal_[name] = d if prev is None else prev.mul_(beta).add_(d, alpha=1 - beta)

    def _refresh(self) -> None:
        return None

    def _precondition(self, grads: Tensor) -> Tensor:
        out = grads.clone()
        groups = self._group_of()
        damping = torch.full_like(grads, self.param_groups[0]["damping"])
        for n, p in self.model.named_parameters():
            if n in self._offsets and p in groups:
                o = self._offsets[n]
                damping[o : o + p.numel()] = groups[p]["damping"]
        for name, d in self.diagonal_.items():
            ix = self._ix[name].to(grads.device)
            _put(out, ix, _take(grads, ix) / (d.to(grads.dtype) + _take(damping, ix)))
        return out

    def _curvature_matvec(self, v: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for name, d in self.diagonal_.items():
            ix = self._ix[name].to(v.device)
            _put(out, ix, d.to(v.dtype) * _take(v, ix))
        return out

    def _curvature_state(self) -> Dict[str, Any]:
        return {
            "diagonal": {k: v.clone() for k, v in self.diagonal_.items()},
            "index": {k: v.clone() for k, v in self._ix.items()},
        }

    def _load_curvature_state(self, state: Dict[str, Any]) -> None:
        self.diagonal_ = {k: v.clone() for k, v in state["diagonal"].items()}
        self._ix = {k: v.clone() for k, v in state["index"].items()}


def _local_offsets(name, offsets):
    prefix = f"{name}." if name else ""
    return {n[len(prefix) :]: o for n, o in offsets.items() if n.startswith(prefix)}


def _exact_index(module, name, offsets):
    prefix = f"{name}." if name else ""
    ix = [
        torch.arange(offsets[prefix + n], offsets[prefix + n] + p.numel())
        for n, p in module.named_parameters()
        if p.requires_grad and prefix + n in offsets
    ]
    return torch.cat(ix)
