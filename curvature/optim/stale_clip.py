"""The stale-inverse clip of the curvature optimizers' plain update (``stale_clip``).

``KFAC`` and ``EKFAC`` refresh their inverses (eigenbases) every ``inverse_every``
steps and precondition the steps in between with the last ones. Where the curvature grows
faster than that (the first steps of a CNN, whose output gradients grow by orders of
magnitude while the parameters leave their initialization), a stale inverse is too
large and the step blows up: each step then raises the curvature further, and the run
diverges within a few steps. A fresh inverse would shrink the direction as the curvature
grows; so between two refreshes each parameter's preconditioned direction ``d_p`` is
scaled by

``c_p = min(1, rho |d_p(r)| / |d_p|)``

with ``r`` the last refresh step and ``rho`` the ``stale_clip`` argument: no step with
stale inverses moves a parameter more than ``rho`` times as far as the step whose
inverses were fresh. Refresh steps are never scaled, and neither are parameters whose
direction at the refresh step was zero or not finite (no bound is known). With ``rho =
2`` it keeps the small and the residual CNN of the benchmarks and tests from diverging at
the defaults; it cannot tell a direction grown by stale inverses from one grown by a
gradient that grows for its own reasons, and slows those (the Fashion-MNIST MLP takes at
most 4% more steps, the deep autoencoder's first refresh periods are clipped often:
docs/optimizers.md, "Defaults and a safe start").

Everything runs on the device from the per-parameter norms that the update's finiteness
check computes anyway: two calls per step (a division and an ``fmin``), three more at a
refresh step, no host synchronization.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..foreach import INF, scalar
from .checkpoint import refuse


class StaleClip:
    """The reference norms of the last refresh step and the scale of a later step.

    Args:
        ratio: ``rho >= 1``, the growth of a parameter's direction allowed between two
            refreshes.

    """

    def __init__(self, ratio: float) -> None:
        self.ratio = float(ratio)
        #: The parameters of the reference (names, in the update's order).
        self.names: Optional[Tuple[str, ...]] = None
        #: ``[n]``: ``rho |d_p(r)|``, ``inf`` where no bound is known.
        self.reference: Optional[Tensor] = None

    def scale(self, names: Sequence[str], norms: Tensor, refreshed: bool) -> Optional[Tensor]:
        """``[n]`` factors ``c_p`` of this step (``None``: no scaling).

        Args:
            names: The parameters of this step's update, in the order of ``norms``.
            norms: ``[n]`` the norms ``|d_p|`` of their directions (NaN or ``inf`` where
                not finite: the caller skips those parameters).
            refreshed: Whether this step refreshed the inverses (it becomes the reference).

        Returns:
            ``min(1, reference / norms)`` (an ``fmin``, so a NaN quotient gives 1), or
            ``None`` at a refresh step, before the first one and when the parameters with
            a gradient differ from the reference's.

        """
        names = tuple(names)
        if refreshed:
            bound = norms * self.ratio
            self.reference = torch.where(norms > 0, bound, scalar(INF, norms.dtype, norms.device))
            self.names = names
            return None
        ref = self.reference
        if ref is None or names != self.names:  # (equal names: equal lengths, see check_state)
            return None
        if ref.device != norms.device or ref.dtype != norms.dtype:
            ref = self.reference = ref.to(norms.device, norms.dtype)
        return torch.fmin(ref / norms, scalar(1.0, norms.dtype, norms.device))

    def state(self) -> Optional[Dict[str, Any]]:
        """The reference for ``state_dict()`` (``None`` before the first refresh)."""
        if self.reference is None or self.names is None:
            return None
        return {"names": list(self.names), "reference": self.reference.detach().clone()}

    def load(self, state: Optional[Dict[str, Any]]) -> None:
        """Restore :meth:`state` (``None``: no reference until the next refresh)."""
        if state is None:
            self.names, self.reference = None, None
            return
        self.names = tuple(state["names"])
        self.reference = state["reference"].detach().clone()


def check_state(who: str, state: Any) -> Optional[Dict[str, Any]]:
    """A saved :meth:`StaleClip.state` (``None`` or a dict), validated: ``ValueError``."""
    if state is None:
        return None
    ok = isinstance(state, dict) and set(state) == {"names", "reference"}
    names = state.get("names") if ok else None
    ref = state.get("reference") if ok else None
    ok = ok and isinstance(names, (list, tuple)) and all(isinstance(n, str) for n in names)
    ok = ok and isinstance(ref, Tensor) and ref.dim() == 1 and ref.shape[0] == len(names)
    if not ok:
        raise refuse(
            who,
            "the state's 'stale_clip' entry must be None or {'names': [str, ...], "
            "'reference': a 1-d tensor of that length}",
        )
    return state


__all__ = ["StaleClip", "check_state"]
