"""Param groups of the curvature optimizers: the groups' checks and the parameters no
curvature rule covers.

A mixin of :class:`~curvature.optim.base.CurvatureOptimizer` (it uses the optimizer's
model, layout, layers, collector and configuration): ``add_param_group`` as in
``torch.optim``, with every parameter checked to be the model's, and the report (a
warning, or an error with ``unsupported="error"``) of the parameters that get the plain
gradient.
"""

from __future__ import annotations

from typing import Any, Dict, List

from torch import Tensor

from ..layer_stats import no_block_reasons
from ..options import FisherType
from ..warn import warn
from .config import check_group
from .coverage import owner, report_batch_statistics, report_uncovered


class ParamGroups:
    """``add_param_group`` with the groups' checks; the report of uncovered parameters."""

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """Add a group of the model's parameters (``torch.optim``'s ``add_param_group``).

        Also checks the groups given to the constructor. Every parameter must be a
        parameter of the model the optimizer was built on (one outside it would get a
        gradient but never be updated): a ``ValueError`` names it otherwise. A frozen
        parameter (``requires_grad=False``) is accepted with a warning: it is not updated
        while frozen, and once unfrozen it is (the curvature estimates are then reset).
        Parameters added later are preconditioned like the others.

        Raises:
            ValueError: For a parameter outside the model, a negative ``lr``,
                ``momentum`` or ``weight_decay``, a ``damping <= 0``, or (with
                ``unsupported="error"``) a parameter no curvature rule covers.

        """
        group = dict(param_group)
        params = group.get("params")
        if isinstance(params, Tensor):
            group["params"] = [params]
        elif params is not None and not isinstance(params, set):  # torch refuses a set
            group["params"] = list(params)
        if isinstance(group.get("params"), list):
            self._check_group(group, group["params"])
        super().add_param_group(group)

    def _check_group(self, group: Dict[str, Any], params: List[Any]) -> None:
        who = type(self).__name__
        names = {p: n for n, p in self.model.named_parameters()}
        where = f"param group {len(self.param_groups)}"
        check_group(
            who, {**self.defaults, **group}, params, names, where, type(self.model).__name__
        )
        frozen = [names[p] for p in params if isinstance(p, Tensor) and not p.requires_grad]
        if frozen:
            warn(
                f"{who}: {frozen} in {where} are frozen (requires_grad=False): not updated "
                "while frozen; after requires_grad_(True) they are, and the curvature "
                "estimates are reset."
            )
        if hasattr(self, "_covered"):  # a group added after construction
            self._report_uncovered([names[p] for p in params if isinstance(p, Tensor)])

    def _layer_damping(self, layer: str, param: Tensor) -> float:
        """The damping of ``param``'s group (a Kronecker block's), after checking that the
        other parameters of ``layer`` that the optimizer holds are in groups of the same
        damping (the block has one): a ``ValueError`` otherwise, never one ignored silently
        (``update_rule="quadratic"``: not checked, its 2x2 model adds each position's).
        """
        damping = self._group_damping(param)
        module, rule = self._layers.get(layer, (None, None))
        if module is None or self.config.update_rule == "quadratic":  # (its 2x2 model
            return damping  # takes each position's group damping: none ignored)
        own = [module.get_parameter(n) for n in rule.param_names(module)]
        values = {  # the dampings of the groups holding the layer's parameters
            g.get("factor_damping", g["damping"])
            for g in self.param_groups
            if any(p is q for p in g["params"] for q in own)
        } | {damping}
        if len(values) > 1:
            raise ValueError(
                f"{type(self).__name__}: the parameters of layer {layer!r} are in param "
                f"groups of different damping {sorted(values)}, but its Kronecker block has "
                "one damping (it would take the weight's and ignore the others'). Put the "
                "layer's weight and bias in groups of the same damping."
            )
        return damping

    def _check_coverage(self) -> None:
        self._covered = set(self._covered_names())
        self.uncovered: List[str] = []
        names = {p: n for n, p in self.model.named_parameters()}
        self._report_uncovered([names[p] for g in self.param_groups for p in g["params"]])

    def _report_uncovered(self, own: List[str]) -> None:
        """Warn about (or refuse) the parameters of ``own`` that no curvature rule covers."""
        bare = sorted(set(own) & set(self.layout.names) - self._covered)
        if not bare:
            return
        self.uncovered = sorted(set(self.uncovered) | set(bare))
        batch_norms = set(self._collector.capture.batch_statistics)
        who, unsupported = type(self).__name__, self.config.unsupported
        if report_batch_statistics(who, [n for n in bare if owner(n) in batch_norms], unsupported):
            bare = [n for n in bare if owner(n) not in batch_norms]
            if not bare:
                return
        sharing, forward_only = self._tied.sharing, self.config.fisher == FisherType.FORWARD_ONLY
        blocked = {n for n, local in sharing.names.items() if set(local.values()) <= self._covered}
        reasons = no_block_reasons(self._layers, sharing, blocked, forward_only)
        tied = any(n in sharing.tie_reasons() for n in bare)
        report_uncovered(who, [reasons.get(n, repr(n)) for n in bare], unsupported, tied)
