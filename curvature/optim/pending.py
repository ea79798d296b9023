"""Statistics of one forward held until a backward reaches it (:class:`PendingStatistics`).

The automatic curvature backward of ``"mc"`` / ``"type-2"`` / ``"rademacher"`` runs at
the end of a training forward (or at the user's call of ``loss_func``), before the user's
``loss.backward()``. A forward that is never backpropagated (a training-accuracy or
validation forward with gradients enabled) must not count: its statistics wait here
until a backward reaches the tensor they were pulled from, which a hook on that tensor
records with the backward's graph task: they count once a backward that accumulates into
``.grad`` reaches them (a ``torch.autograd.grad`` pass, e.g. a Hessian trace of a
monitoring loss, never does).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Set

import torch
from torch import Tensor

from .statistics import StepStatistics


class PendingStatistics(StepStatistics):
    """One automatic pull's statistics and quadratic-rule projections, until reached.

    Attributes:
        reached_in: The graph task (backward pass) that last computed the pulled tensor's
            gradient since the pull (``None``: none yet).
        projections: The pull's records for the plain-loop quadratic rule (``None``: off).

    """

    def __init__(self, projections: bool) -> None:
        super().__init__()
        self.reached_in: Optional[int] = None
        self.projections: Optional[List[Any]] = [] if projections else None

    @property
    def reached(self) -> bool:
        """Whether a backward (any) has passed through the pulled tensor since the pull."""
        return self.reached_in is not None

    def watch(self, tensor: Any) -> None:
        """Set :attr:`reached_in` whenever a backward computes the gradient of ``tensor``.

        Called after the pull (whose own batched backward would fire the hook); a tensor
        without a graph is never reached.
        """
        if isinstance(tensor, Tensor) and tensor.requires_grad:
            ref = weakref.ref(self)

            def hook(grad: Tensor) -> None:
                pending = ref()
                if pending is not None:
                    pending.reached_in = torch._C._current_graph_task_id()

            tensor.register_hook(hook)


class LossRecord:
    """A ``loss_func`` value of the plain-loop quadratic rule and the weight that the
    backward gave it.

    Attributes:
        value: The 0-d loss (detached).
        into: ``loss_func``'s input (its leading size counts the samples).
        weight: ``d(backward root) / d(value)`` summed over the backwards that reached it,
            over the AMP loss scale of its forward (0-d, on the device): ``1`` for
            ``loss.backward()``, ``1 / k`` for ``(loss / k).backward()`` of ``k``
            micro-batches. The measured loss is ``sum_i weight_i value_i``, the function
            whose gradient the backward produced.

    """

    __slots__ = ("value", "into", "weight", "__weakref__")

    def __init__(self, value: Tensor, into: Tensor) -> None:
        self.value, self.into = value, into
        self.weight: Optional[Tensor] = None


def count_loss(
    owner: Any, output: Tensor, into: Tensor, scale: Optional[Callable[[], Optional[Tensor]]] = None
) -> LossRecord:
    """Append a :class:`LossRecord` of the scalar loss ``output`` to ``owner.losses`` once
    a backward reaches it (the plain-loop quadratic rule's loss; not a validation loss
    with grad on), with the gradient that backward gives it (over ``scale()``, the AMP
    loss scale of that backward, a 0-d tensor or ``None``) as its weight; later
    backwards through it add theirs. Returns the record (not yet appended).
    """
    record = LossRecord(output.detach().reshape(()), into)
    ref = weakref.ref(owner)

    def hook(grad: Tensor) -> None:
        w = grad.detach().reshape(())
        s = None if scale is None else scale()
        w = w if s is None else w / s.to(w.device)
        if record.weight is not None:
            record.weight = record.weight + w
            return
        target = ref()
        if target is not None:
            record.weight = w
            target.losses.append(record)

    output.register_hook(hook)
    return record


def absorb(stats: StepStatistics, records: Optional[List[Any]], pending: PendingStatistics) -> None:
    """Add ``pending``'s statistics to ``stats`` and its projections to ``records``."""
    stats.absorb(pending)
    if records is not None and pending.projections:
        records.extend(pending.projections)


class PendingPulls:
    """The automatic pulls of a step not yet reached by a backward, in pull order."""

    def __init__(self) -> None:
        self.items: List[PendingStatistics] = []

    def new(self, projections: bool) -> PendingStatistics:
        """A new pull's (empty) statistics, held here."""
        pending = PendingStatistics(projections)
        self.items.append(pending)
        return pending

    def confirm(
        self, stats: StepStatistics, records: Optional[List[Any]], drop: bool, tasks: Set[int]
    ) -> None:
        """Move the pulls reached by one of the accumulating backward passes ``tasks`` into
        ``stats`` / ``records``; ``drop``: forget the rest.
        """
        for pending in self.items:
            if pending.reached_in in tasks:
                absorb(stats, records, pending)
        self.items = [p for p in self.items if not (p.reached_in in tasks or drop)]

    def forget_reached(self) -> None:
        """``zero_grad()``: the reached pulls' gradients were zeroed, so they do not count."""
        self.items = [p for p in self.items if not p.reached]
