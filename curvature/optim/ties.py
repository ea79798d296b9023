"""Tied layers in the optimizers: the exact Fisher diagonal of parameters several layers use.

A parameter that two layers use (a language model's ``head.weight = emb.weight``) has the
per-sample, per-vector gradient ``grad_nk = sum_l grad_nk^(l)`` over the layers ``l``
using it, and its Fisher diagonal ``d = sum_{k,n} grad_nk^2`` needs every layer's
contribution at once (the cross terms between the layers count). The statistics collector
hands over the layers of a forward one fold at a time: all at once after the optimizer's
own curvature backward, one by one inside the user's backward (``"empirical"``: a layer's
gradients count once its parameters accumulated theirs). So the layers of a tie are kept
(:meth:`TiedLayers.defer`); inside the user's backward their per-sample gradients are
formed at once (while the layer inputs are the forward's) and summed; once the forward's
layers are all in, the group's diagonal is emitted as one statistic, named by its layers
(``"emb+head"``). A Kronecker block cannot represent such a parameter: KFAC and EKFAC give
the tied layers no block (see :func:`curvature.layout.tie_hint`);
``DiagonalNaturalGradient`` and ``unsupported="diagonal"`` use this diagonal.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import Tensor, nn

from ..layer_stats import Layer, tied_fisher_diagonal, tied_per_vector_grads
from ..layout import ParamLayout, ParamSharing


@dataclass
class _Group:
    """What a tie group has received since its last emission."""

    emit: Callable[..., Any]
    layers: List[Layer] = field(default_factory=list)  # with their calls' gradients
    grads: Dict[str, Tensor] = field(default_factory=dict)  # [K, N, *p.shape], folded


class TiedLayers:
    """The groups of tied layers of one optimizer, and what they received so far.

    Args:
        layout: The optimizer's parameter layout.
        suffix: The suffix of the statistics key of a group's diagonal.

    Attributes:
        sharing: The :class:`~curvature.layout.ParamSharing` of the covered layers (set
            once the layers are known).

    """

    def __init__(self, layout: ParamLayout, suffix: str):
        self.layout = layout
        self.suffix = suffix
        self.sharing = ParamSharing(nn.Module(), [])
        self._groups: Dict[str, _Group] = {}

    def tied(self, layer: str) -> bool:
        """Whether ``layer`` shares a parameter with another layer."""
        return self.sharing.tied(layer)

    def defer(self, name: str, module, rule, calls: list, emit: Callable[..., Any]) -> None:
        """Keep a tied layer's calls (with their gradients) until :meth:`finish`.

        Shallow copies: the collector releases the gradients of the calls it handed over
        as soon as their layer is folded, the group's copies keep theirs.
        """
        group = self._groups.setdefault(self.sharing.group_name(name), _Group(emit))
        group.layers.append((name, module, rule, [copy.copy(c) for c in calls]))
        group.emit = emit

    def finish(self, flush: Optional[bool]) -> None:
        """The end of a fold (the collector's ``finish``).

        ``flush=False`` (a layer committed inside the user's backward): the per-vector
        gradients of the kept calls are formed now and summed per parameter.
        ``flush=True``: each group's ``sum_{k,n} (sum_l grad_nk^(l))^2`` ``[P_g]`` over its
        parameters in :meth:`index` order is emitted under ``(group name, suffix)``.
        ``flush=None``: forget everything (the fold was cut short).
        """
        if flush is None:
            self._groups = {}
            return
        for name, group in list(self._groups.items()):
            if flush:
                self._emit(name, group)
                del self._groups[name]
            elif group.layers:
                grads = tied_per_vector_grads(group.layers, self.sharing.names)
                group.layers = []
                if any(
                    k in group.grads and group.grads[k].shape != g.shape for k, g in grads.items()
                ):
                    self._emit(name, group)  # another batch size: a forward of its own
                    group.grads = {}
                for key, g in grads.items():
                    old = group.grads.get(key)
                    group.grads[key] = g if old is None else old + g

    def _emit(self, name: str, group: _Group) -> None:
        diag = tied_fisher_diagonal(group.layers, self.sharing.names, group.grads)
        d = torch.cat(
            [diag[n].reshape(-1) for n in self.sharing.group_params(self.first_layer(name))]
        )
        d = d.to(torch.float64 if d.dtype == torch.float64 else torch.float32)
        group.emit((name, self.suffix), [d], ("g",))

    def group_names(self) -> List[str]:
        """The names of the groups of tied layers (``"emb+head"``)."""
        return ["+".join(g) for g in self.sharing.groups]

    def first_layer(self, group: str) -> Optional[str]:
        """The first layer of the group named ``group`` (``None``: no such group)."""
        return next((g[0] for g in self.sharing.groups if "+".join(g) == group), None)

    def index(self, group: str) -> Optional[Tensor]:
        """Flat positions ``[P_g]`` of the group's parameters (``None``: no such group)."""
        first = self.first_layer(group)
        return None if first is None else self.layout.index(self.sharing.group_params(first))
