"""The Kronecker factors' damping apart from the quadratic model's: ``factor_damping="greedy"``.

With ``update_rule="quadratic"`` and ``factor_damping="tied"`` (the default) one ``lambda``
(each group's ``damping``) does two jobs: it damps the Kronecker factors (it shapes the
direction ``Delta = -(F_kron + lambda)^{-1} g``) and it damps the 2x2 quadratic model
(it shortens the step along that direction); the reduction ratio ``rho`` measures the
second only. ``factor_damping="greedy"`` separates them as Martens & Grosse (2015,
section 6.6) do:

* the factors' damping ``gamma`` (each group's ``"factor_damping"``, starting at its
  ``damping``) is chosen every ``GREEDY_INTERVAL`` steps among
  ``{gamma omega, gamma, gamma / omega}``, ``omega = decay^(GREEDY_INTERVAL / 2)`` (their
  ``sqrt(19/20)^T2`` with ``decay`` = ``damping_adaptation_decay``): the one whose update
  (its own 2x2 solve for ``(alpha, mu)``) has the lowest value of the quadratic model
  ``M(delta) = 1/2 delta^T (C + lambda) delta + g^T delta`` with the exact Gauss-Newton
  matrix ``C`` of the batch. The three directions share one Gram matrix (``K = 3`` plus
  the previous update), so the choice costs two more damped inverses and
  preconditionings and the Gram matrix's projections of two more vectors, every
  ``GREEDY_INTERVAL`` steps;
* the model's damping ``lambda`` (``damping``) damps the 2x2 model only and is adapted
  by Nielsen's Levenberg-Marquardt rule, ``lambda *= max(1/3, 1 - (2 rho - 1)^3)`` for
  an accepted step (``2`` when ``rho <= 0``), every ``damping_adaptation_interval``
  steps; a rejected step raises it as with ``"tied"``. With ``C`` exact in the model and
  ``rho`` near 1, ``lambda`` falls by 3x per adaptation: the step length is the model's,
  the direction's damping is ``gamma``'s. (With one tied ``lambda`` this faster decrease
  was worse: it also took the factors' damping down.)

Closure steps only (``step(closure)``; the plain loop's device-only bookkeeping has no
host read to choose with), one process.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .updates import damping_factor

#: steps between two greedy choices of the factors' damping (Martens & Grosse: T2 = 20)
GREEDY_INTERVAL = 5


def nielsen_factor(rho: float) -> float:
    """Nielsen's Levenberg-Marquardt factor: ``max(1/3, 1 - (2 rho - 1)^3)``, ``2`` when
    ``rho <= 0`` or NaN (the loss rose, or the model predicted no decrease).
    """
    if not rho > 0:
        return 2.0
    return max(1.0 / 3.0, 1.0 - (2.0 * rho - 1.0) ** 3)


def greedy_candidates(gamma: float, decay: float) -> Tuple[float, float, float]:
    """``(gamma omega, gamma, gamma / omega)``, ``omega = decay^(GREEDY_INTERVAL / 2)``."""
    omega = decay ** (GREEDY_INTERVAL / 2)
    return gamma * omega, gamma, gamma / omega


def lowest_model(
    gram: Tensor, damped: Tensor, linear: Tensor, heads: int, solve
) -> Tuple[int, List[float]]:
    """``(i, models)``: the candidate direction whose own solve has the lowest model value.

    Args:
        gram: ``[K, K]`` ``v_i^T C v_j`` of ``heads`` candidate directions (rows
            ``0 .. heads - 1``) and ``K - heads`` (0 or 1) previous updates (the rest).
        damped: ``[K, K]`` the damping's ``v_i^T lambda v_j``.
        linear: ``[K]`` ``g^T v_i``.
        heads: The number of candidate directions.
        solve: ``(gram, damped, linear) -> (c, M)`` (:func:`.quadratic.solve_coefficients`).

    Returns:
        The index of the lowest finite ``M`` (ties: the first; the middle one when none is
        finite) and every candidate's ``M`` (``inf`` where not finite).

    """
    rest = list(range(heads, gram.shape[0]))
    models: List[float] = []
    for i in range(heads):
        ix = [i] + rest
        c, m = solve(gram[ix][:, ix], damped[ix][:, ix], linear[ix])
        models.append(m if bool(torch.isfinite(c).all()) and math.isfinite(m) else math.inf)
    finite = [i for i, m in enumerate(models) if math.isfinite(m)]
    return (min(finite, key=lambda i: models[i]) if finite else heads // 2), models


class GreedyFactorDamping:
    """The ``factor_damping="greedy"`` part of the quadratic rule (module docstring)."""

    #: the factors' damping of each candidate of the last greedy choice and their ``M``
    last_factor_damping_models: Optional[List[Tuple[float, float]]] = None

    def _greedy_due(self) -> bool:
        return (
            self.config.factor_damping == "greedy"
            and self.steps > 0
            and self.steps % GREEDY_INTERVAL == 0
        )

    def _check_greedy(self, closure) -> None:
        if self.config.factor_damping != "greedy":
            return
        who = type(self).__name__
        if closure is None:
            raise ValueError(
                f"{who}(factor_damping='greedy').step() needs a closure (def "
                "closure(backward=True): ...): the greedy choice of the factors' damping "
                "reads the quadratic model on the host; the plain loop does not."
            )
        if self._comm is not None:
            raise ValueError(
                f"{who}(factor_damping='greedy'): not supported under torch.distributed; "
                "use factor_damping='tied'."
            )
        for g in self.param_groups:
            g.setdefault("factor_damping", g["damping"])

    def _model_damping_factor(self, rho: float, decay: float) -> float:
        """``lambda``'s factor at an adaptation after an accepted step: Nielsen's with
        ``"greedy"``, else :func:`~curvature.optim.updates.damping_factor`.
        """
        if self.config.factor_damping == "greedy":
            return nielsen_factor(rho)
        return damping_factor(rho, decay)

    def _set_factor_damping(self, scale: float, base: Sequence[float]) -> None:
        for g, gamma in zip(self.param_groups, base):
            g["factor_damping"] = gamma * scale

    def _greedy_heads(self, grads: Tensor, directions: Tensor, unused) -> List[Tensor]:
        """The directions at ``gamma omega``, ``gamma`` (``directions``), ``gamma / omega``
        (every group's ``gamma`` scaled alike; the blocks invert again at a damping other
        than their cached inverses').
        """
        base = [g["factor_damping"] for g in self.param_groups]
        low, _, high = greedy_candidates(1.0, self.config.damping_adaptation_decay)
        heads = []
        for scale in (low, high):
            self._set_factor_damping(scale, base)
            d = self._precondition(grads)
            for span in unused:
                d[span] = 0
            heads.append(d)
        self._set_factor_damping(1.0, base)
        return [heads[0], directions, heads[1]]

    def _greedy_settle(self, i: int, models: List[float]) -> None:
        """Keep candidate ``i``'s damping (the next preconditioning inverts at it)."""
        base = [g["factor_damping"] for g in self.param_groups]
        scales = greedy_candidates(1.0, self.config.damping_adaptation_decay)
        self.last_factor_damping_models = [(base[0] * s, m) for s, m in zip(scales, models)]
        self._set_factor_damping(scales[i], base)
