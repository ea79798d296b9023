"""The curvature optimizers under ``torch.amp.GradScaler``: both ways of running them.

The empirical statistics come from the user's scaled backward: their ``G``-like sums
carry the square of the loss scale ``s`` (``2^32`` at a ``GradScaler``'s default scale),
which must be divided out; the measured losses of the plain-loop quadratic rule carry
``s``.

- **The scaler given** (``grad_scaler=scaler``): ``scaler.step(optim)`` works as for any
  optimizer (it unscales the gradients, reads its inf check on the host and calls
  ``step()`` only for finite gradients; a skipped step's statistics go with its
  gradients at the next ``zero_grad()``). Each gradient is divided by the scaler's scale
  tensor as it is folded (:meth:`ScalerSide.loss_scale`: no host read).
- **Not given**: the optimizers report ``_step_supports_amp_scaling``, torch's protocol
  for optimizers that handle the scale themselves (as the fused ``Adam``):
  ``scaler.step(optim)`` neither unscales nor reads its inf check, and sets two 0-d
  device tensors on the optimizer for the duration of ``step()``: ``found_inf`` (the
  step is skipped, as the scaler would: one host read, the scaler's own; its statistics
  are dropped, and it does not count) and ``grad_scale`` (``s``; the gradients are
  divided by it in place, as ``scaler.unscale_`` would, and the step's empirical
  ``G``-like sums by ``s^2`` before they enter the running estimates: the same numbers,
  for the power-of-two scales of a ``GradScaler``). So that ``s^2 G`` never reaches the
  float32 finiteness check (``s`` grows without bound where the gradients cannot
  overflow: bfloat16 or float32 under a scaler), each gradient is divided as it is folded
  by the scale handed to the previous step, and ``step()`` corrects by ``(previous /
  s)^2``. What cannot be recovered is said,
  not guessed: after ``scaler.unscale_(optim)`` (to clip) no ``grad_scale`` is handed
  over (one warning: pass ``grad_scaler=``), and the quadratic rule, whose losses carry
  ``s``, refuses the step (``ValueError``). PyTorch Lightning refuses gradient clipping
  for such optimizers; pass the scaler there.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import Tensor

from ..options import FisherType
from ..warn import warn

__all__ = ["ScalerSide", "handoff", "scale_tensor", "scaled_step_skipped", "unscale_grads"]


def handoff(optimizer: Any) -> Optional[Tuple[Tensor, Optional[Tensor]]]:
    """``(found_inf, grad_scale)`` set by ``GradScaler.step(optimizer)``, or ``None``
    when ``step()`` was called otherwise.
    """
    found_inf = getattr(optimizer, "found_inf", None)
    if not isinstance(found_inf, Tensor):
        return None
    grad_scale = getattr(optimizer, "grad_scale", None)
    return found_inf, grad_scale if isinstance(grad_scale, Tensor) else None


def scale_tensor(scaler: Any) -> Optional[Tensor]:
    """The loss scale of an enabled ``GradScaler`` as its 0-d device tensor (no host read,
    unlike ``get_scale()``); ``None`` without a scaler, when disabled, or before its first
    ``scale()``.
    """
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler._get_scale_async()


def unscale_grads(params: Iterable[Tensor], grad_scale: Tensor) -> None:
    """Divide the gradients of ``params`` by ``grad_scale`` in place, as
    ``GradScaler.unscale_`` does (times the float32 reciprocal, computed in float64).
    """
    inv = grad_scale.double().reciprocal().float()
    groups: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse:
            g.mul_(inv.to(g.device))
            continue
        groups.setdefault((g.device, g.dtype), []).append(g)
    for (device, _), grads in groups.items():
        torch._foreach_mul_(grads, inv.to(device))


def unscale_unknown_message(who: str) -> str:
    return (
        f"{who}: a GradScaler stepped this optimizer after scaler.unscale_(optimizer); "
        "the loss scale of the backward is not handed over then, so the empirical "
        "statistics keep its square (a step far too small). Pass grad_scaler=scaler to "
        f"{who}(...) so that they are unscaled."
    )


def quadratic_message(who: str) -> str:
    return (
        f"{who}(update_rule='quadratic') under a GradScaler needs grad_scaler=scaler: the "
        "losses it measures carry the loss scale."
    )


class ScalerSide:
    """The collector's side of the loss scale (a mixin of
    :class:`~curvature.optim.collector.StatisticsCollector`, whose attributes it uses:
    ``grad_scaler``, ``fisher``, ``who``, ``closed``, ``stats``, ``capture``).
    """

    grad_scaler: Any
    #: the factor of this step's empirical G-like sums at ``begin_step`` (a scaler not
    #: given), and whether the warning of an unknown scale was given
    amp_unscale: Optional[Tensor] = None
    amp_warned = False
    #: ``(scale tensor, its version, 1 / scale)``: :meth:`_inverse_loss_scale`'s cache
    _inverse_scale: Tuple[Any, int, Optional[Tensor]] = (None, -1, None)
    #: a scaler not given: the scale it handed to the last step, by which the next
    #: step's gradients are divided as they are folded (so that ``s^2 G`` never
    #: overflows the finiteness check), and the one this step's were divided by
    amp_prev: Optional[Tensor] = None
    amp_used: Optional[Tensor] = None

    def loss_scale(self) -> Optional[Tensor]:
        """The given grad scaler's loss scale, a 0-d device tensor (``None``: no scaler)."""
        return scale_tensor(self.grad_scaler)

    def _inverse_loss_scale(self) -> Optional[Tensor]:
        """``1 / loss_scale()`` as ``GradScaler.unscale_`` computes it, kept while the
        scale tensor is unchanged (no host read); a scaler not given: ``1 /`` the scale of
        the last step (:attr:`amp_prev`; corrected at ``step()`` by the step's own).
        """
        scale = self.loss_scale()
        if scale is None and self.grad_scaler is None and self.amp_prev is not None:
            scale = self.amp_used = self.amp_prev
        if scale is None:
            return None
        held, version, inv = self._inverse_scale
        if held is not scale or version != scale._version:
            inv = scale.double().reciprocal().float()
            self._inverse_scale = (scale, scale._version, inv)
        return inv

    def amp_step(self, grad_scale: Optional[Tensor], quadratic: bool) -> None:
        """A GradScaler steps the optimizer with finite gradients scaled by ``grad_scale``.

        With ``grad_scaler`` given, the statistics are unscaled as they are folded. Else
        the empirical ``G``-like sums of this step, whose gradients were divided by the
        previous step's scale (:attr:`amp_used`, or not at all), are multiplied by
        ``(used / grad_scale)^2`` at :meth:`begin_step`; without ``grad_scale``
        (``scaler.unscale_`` came first) one warning says how to unscale them. The
        quadratic rule refuses (its losses).
        """
        if self.grad_scaler is not None or self.closed:
            return
        if quadratic:
            raise ValueError(quadratic_message(self.who))
        if self.fisher != FisherType.EMPIRICAL:
            return
        used, self.amp_used = self.amp_used, None
        if grad_scale is not None:  # (used / s)^2: exact for a GradScaler's powers of two
            ratio = grad_scale.double().reciprocal() * (1.0 if used is None else used.double())
            self.amp_unscale = ratio.square()  # (float64: 1 / s^2 of a float64 model's s)
            self.amp_prev = grad_scale
            return
        if used is not None:  # the scale is unknown: as if none had been divided out
            self.amp_unscale = used.double().square()
        self.amp_prev = None
        if not self.amp_warned:
            self.amp_warned = True
            warn(unscale_unknown_message(self.who))

    def plain_step(self) -> None:
        """``step()`` not called by a scaler: a division by :attr:`amp_prev` undone."""
        if self.amp_used is not None:
            self.amp_unscale = self.amp_used.double().square()
        self.amp_prev = self.amp_used = None

    def skip_step(self) -> None:
        """A GradScaler found inf gradients: the step is skipped, its statistics are
        dropped with the gradients they belong to (as ``zero_grad()`` would).
        """
        if self.closed:
            return
        self.settle()
        with self.capture.computing():
            self.capture.take_pushed()
        self.discard()
        self.amp_unscale = self.amp_used = None


def scaled_step_skipped(optimizer: Any, collector: Any, quadratic: bool) -> bool:
    """Take ``GradScaler.step``'s hand-off at the start of ``step()``: ``True`` when the
    step is skipped (inf gradients: nothing moves, the statistics go, the step does not
    count); else the gradients are unscaled and so are the statistics (see the module
    docstring). Nothing happens when ``step()`` was not called by a scaler.
    """
    got = handoff(optimizer)
    if got is None:
        if collector.amp_prev is not None:
            collector.plain_step()
        return False
    found_inf, grad_scale = got
    if bool(found_inf):  # (the host read GradScaler.step makes for other optimizers)
        collector.skip_step()
        return True
    collector.amp_step(grad_scale, quadratic)
    if grad_scale is not None:
        unscale_grads((p for g in optimizer.param_groups for p in g["params"]), grad_scale)
    return False
