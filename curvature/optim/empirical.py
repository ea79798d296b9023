"""The empirical Fisher's side of the statistics collector: the user's own backward.

A mixin of :class:`~curvature.optim.collector.StatisticsCollector`: with
``fisher="empirical"`` the gradients w.r.t. each layer output come from the user's
``loss.backward()`` (node pre-hooks of the capture). A layer is folded as soon as its
gradients are complete (:meth:`EmpiricalSide._committed`), the rest at the next forward
or ``step()`` (:meth:`EmpiricalSide.consume_pushed`); backward passes the statistics
cannot split are reported once (:meth:`EmpiricalSide.warn_late`), and a mean
cross-entropy with ignored targets is refused at the next flush
(:meth:`EmpiricalSide._check_targets`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..warn import warn
from .coverage import graph_backward_message, late_backward_message


class EmpiricalSide:
    """The user-backward methods of the collector (uses its capture, statistics, flags)."""

    def consume_pushed(self) -> None:
        """Fold the calls whose user backward committed (``"empirical"``) and flush."""
        self._consume(self.capture.take_pushed(), "user")
        self.warn_late()

    def _committed(self, name: str, module: nn.Module, rule: Any, calls: list) -> None:
        """A layer's gradients of the user's backward are complete: fold them now.

        Inside the backward, while the layer inputs are still those of the forward (a
        buffer refilled before the next micro-batch's forward does not matter); the
        finiteness check waits for the next flush (one host synchronization).
        """
        self._consume([(name, module, rule, calls)], "user", flush=False)

    def warn_late(self) -> None:
        """One warning each for two kinds of backward the empirical statistics cannot split.

        A second backward pass through a forward already folded; a ``create_graph=True``
        pass through the model (a gradient penalty): the following ``backward()`` then
        also carries the penalty's gradients at the layer outputs.
        """
        if self.capture.late_gradients and not self.late_warned:
            self.late_warned = True
            warn(late_backward_message(self.who))
        if self.capture.graph_gradients and not self.graph_warned:
            self.graph_warned = True
            warn(graph_backward_message(self.who))

    def _check_targets(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """Empirical Fisher, ``CrossEntropyLoss(reduction="mean")``: no ignored targets.

        The mean then runs over the kept positions only, so the user's gradient is not
        ``R(N) sum_n grad l_n`` and the statistics' scale would be wrong; the check is
        read with the next flush's synchronization.
        """
        if self.closed or self.evaluating or module.reduction != "mean":
            return
        if not (self.due and self.model.training and torch.is_grad_enabled()):
            return
        values = list(args) + [kwargs[k] for k in ("input", "target") if k in kwargs]
        target = values[1] if len(values) > 1 else None
        if not isinstance(target, Tensor) or target.is_floating_point():
            return
        self.stats.require_false(
            (target == module.ignore_index).any(),
            f"{self.who}(fisher='empirical'): the targets contain "
            f"ignore_index={module.ignore_index} with CrossEntropyLoss(reduction='mean'): the "
            "loss is then a mean over the non-ignored entries only, which the empirical "
            "statistics cannot scale. Use reduction='sum' (and divide the learning rate).",
        )


__all__ = ["EmpiricalSide"]
