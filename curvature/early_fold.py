"""Fold a layer's statistics while a pull is still running, as its gradient arrives.

A pull (:meth:`curvature.capture.Capture.pull`) asks :func:`torch.autograd.grad` for
the gradients of every recorded layer output at once; autograd holds each one until the
call returns, so the output gradients of all layers are alive together (on a VGG-like
CNN at batch 256, 168 MB: as much as a third of the saved activations). A caller that
only reduces each layer's gradients to small statistics (the optimizers' Kronecker
factors) can instead take them one layer at a time, while autograd runs:

- an edge whose autograd node reaches another recorded layer's node further down the
  graph (:func:`split_edges`) is not requested from autograd; a one-shot node pre-hook
  (:meth:`EarlyFolds.prehooks`, registered by the capture for the pull) receives its
  gradient when the node runs (its input buffer then holds the sum over every consumer
  of the output) and hands the call to the caller at once; the gradient goes when the
  node has run;
- the other edges (the lowest recorded layers, and calls this does not cover) are
  requested as before. Every hooked node then lies on a path from the outputs to a
  requested edge, so autograd runs it (a node that the outputs do not reach runs as
  little as before: its call is unreached, with zero gradients or none as the pull's
  ``unreached`` says).

The numbers are those of the plain pull (the same gradients, folded in another order;
one contribution per layer, so no sum changes its order). Covered: one-vector pulls
(no ``vmap``), layers with one call in the pull, calls with one recorded edge, eager
calls (not ``torch.compile``-traced ones).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torch import Tensor, nn
from torch.autograd.graph import Node

from .edges import assign_grads
from .layers import Call

#: Fold early where possible (``False``: every pull requests every edge, as before; for
#: comparisons)
ENABLED = True

#: The smallest output gradient worth taking early, in elements (1 MiB of float32): below
#: it the memory saved is small and the walk, the hooks and a fold's set-up per layer
#: cost host time (``diag_ggn()`` empirical on the MLP 784-512-256-10 at batch 128, every
#: layer above the lowest taken early: 6-9% slower)
EARLY_FOLD_ELEMENTS = 2**18

#: ``fold(name, module, rule, calls)``: the caller's handler of a layer whose gradients
#: arrived (``grads`` set on each call)
Fold = Callable[[str, Any, Any, List[Call]], None]


@dataclass(frozen=True)
class FoldPlan:
    """What a pull may hand out early (``Capture.pull(fold=...)``).

    Attributes:
        fold: Called inside the backward with the layer's calls, ``grads`` set (taken
            back when it returns: their memory goes then).
        take: Remove the calls handed to ``fold`` from the capture (else they stay, as
            the calls that a pull reaches).
        worth: ``worth(name, module, rule, call)``: whether taking this call early pays
            (e.g. its output gradient is larger than what ``fold`` keeps of it until the
            pull ends); ``None``: every call that can be.

    """

    fold: Fold
    take: bool = False
    worth: Optional[Callable[[str, Any, Any, Call], bool]] = None


def split_edges(
    layers: Sequence[Tuple[str, Any, Any, List[Call]]],
    worth: Optional[Callable[[str, Any, Any, Call], bool]] = None,
) -> Set[int]:
    """The ``id`` of each call whose gradient can be taken from a node pre-hook.

    A call qualifies when its layer has only this call, it has exactly one recorded
    edge, ``worth`` (if given) accepts it, and that edge's node reaches (through
    ``next_functions``) the node of another recorded edge: autograd runs it on the way
    there. One walk over the graph below the recorded nodes, each node visited once.
    """
    recorded: Set[Node] = set()
    for _, _, _, calls in layers:
        for c in calls:
            recorded.update(e.node for e in c.out_edges)
    below: Dict[Node, bool] = {}  # node -> a recorded node lies strictly below it

    def reaches(start: Node) -> bool:  # (autograd graphs have no cycles)
        stack = [start]
        while stack:
            node = stack[-1]
            if node in below:
                stack.pop()
                continue
            children = [c for c, _ in node.next_functions if c is not None]
            pending = [c for c in children if c not in recorded and c not in below]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            below[node] = any(c in recorded or below[c] for c in children)
        return below[start]

    early: Set[int] = set()
    if not ENABLED:
        return early
    for name, module, rule, calls in layers:
        if len(calls) != 1:
            continue
        c = calls[0]
        if c.tickets or len(c.out_edges) != 1:
            continue
        if worth is not None and not worth(name, module, rule, c):
            continue
        if reaches(c.out_edges[0].node):
            early.add(id(c))
    return early


#: a layer's Kronecker statistics' elements (:func:`early_pays`), per module
_STAT_NUMEL: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def early_pays(name: str, module: nn.Module, rule: Any, call: Any) -> bool:
    """Whether a curvature backward should hand this layer's output gradient to the
    statistics while autograd runs (a :class:`FoldPlan`'s ``worth``).

    Taken early, the gradient goes at once but the layer's statistics wait for the end of
    the pull (the flush), alive through the folds of the layers below; requested as
    before, the gradient waits and the statistics are made after. So: early when the
    gradient has at least as many elements as the layer's Kronecker statistics
    (``sum_blocks C (D_out^2 + D^2)`` of ``rule.kfac_shapes``; every call where the rule
    cannot say) and at least :data:`EARLY_FOLD_ELEMENTS`. A VGG convolution's ``[256, 64,
    32, 32]`` gradient against its ``577^2 + 64^2`` statistics: early; a classifier's
    ``[64, 128]`` against ``2049^2 + 128^2``: not.
    """
    if not large_gradient(name, module, rule, call):
        return False
    numel = _STAT_NUMEL.get(module)
    if numel is None:
        shapes = rule.kfac_shapes(module)
        numel = 0 if shapes is None else sum(C * (Do * Do + D * D) for C, Do, D in shapes.values())
        _STAT_NUMEL[module] = numel
    return math.prod(call.out_meta[0][0]) >= numel


def large_gradient(name: str, module: nn.Module, rule: Any, call: Any) -> bool:
    """Whether the call's output gradient has at least :data:`EARLY_FOLD_ELEMENTS` elements.

    A :class:`FoldPlan`'s ``worth`` where the fold keeps nothing until the pull's end (a
    diagonal added into the result at once).
    """
    return math.prod(call.out_meta[0][0]) >= EARLY_FOLD_ELEMENTS


class EarlyFolds:
    """One pull's early folds: which calls, their one-shot node pre-hooks, what came of them.

    Args:
        layers: The pull's ``(name, module, rule, calls)``.
        plan: The caller's :class:`FoldPlan`, or ``None`` (nothing is taken early; nor
            from a vmapped pull of several vectors).
        lead: ``(1,)`` for a pull of one batched vector (the gradients handed out get
            that axis), ``()`` for a plain one.
        drop: ``drop(name, calls)``: remove them from the capture (called before
            ``plan.fold`` where ``plan.take``).

    Attributes:
        folded: The calls handed to ``fold`` so far.

    """

    def __init__(
        self,
        layers: Sequence[Tuple[str, Any, Any, List[Call]]],
        plan: Optional[FoldPlan],
        lead: Tuple[int, ...],
        drop: Callable[[str, List[Call]], None],
    ):
        if plan is not None and not isinstance(plan, FoldPlan):
            raise TypeError(
                f"Capture.pull(fold=...): a curvature.early_fold.FoldPlan, not "
                f"{type(plan).__name__} (FoldPlan(fold) wraps a function "
                "fold(name, module, rule, calls))."
            )
        self.layers = layers
        self.plan = plan
        self.lead = lead
        self.drop = drop
        one = plan is not None and lead in ((), (1,))  # (not a vmapped pull)
        self.early = split_edges(layers, plan.worth) if one else set()
        self.folded: List[Call] = []
        self._errors: List[BaseException] = []

    def takes(self, call: Call) -> bool:
        """Whether ``call``'s gradient comes from a pre-hook (not requested from autograd)."""
        return id(call) in self.early

    def _hand(self, name: str, module: Any, rule: Any, call: Call, g: Tensor) -> None:
        assign_grads(call, [g.unsqueeze(0) if self.lead else g], self.lead)
        self.folded.append(call)
        if self.plan.take:
            self.drop(name, [call])
        try:
            self.plan.fold(name, module, rule, [call])
        finally:  # the gradient and what the rule made of it go now
            call.grads = call.plain = call.expanded = None

    def prehooks(self) -> List[Tuple[Node, Callable[..., None]]]:
        """``(node, hook)``: the one-shot pre-hooks of the early calls' nodes, for the
        capture to register for the pull and remove after it.

        An exception inside ``fold`` is kept (:meth:`raise_errors` raises it once autograd
        has returned) and later hooks do nothing.
        """

        def make(name: str, module: Any, rule: Any, call: Call, output_nr: int):
            def prehook(grad_outputs: Sequence[Optional[Tensor]]) -> None:
                g = grad_outputs[output_nr]
                if g is None or self._errors:
                    return
                try:
                    self._hand(name, module, rule, call, g)
                except BaseException as err:  # raised once autograd returns
                    self._errors.append(err)

            return prehook

        out = []
        for name, module, rule, calls in self.layers:
            for c in calls:
                if self.takes(c):
                    edge = c.out_edges[0]
                    out.append((edge.node, make(name, module, rule, c, edge.output_nr)))
        return out

    def missed(self) -> List[Call]:
        """The early calls whose node did not run (the outputs do not depend on them)."""
        done = {id(c) for c in self.folded}
        return [c for *_, cs in self.layers for c in cs if self.takes(c) and id(c) not in done]

    def raise_errors(self) -> None:
        """Raise the first exception of ``fold`` inside the pull, if any."""
        if self._errors:
            raise self._errors[0]


__all__ = [
    "EARLY_FOLD_ELEMENTS",
    "ENABLED",
    "EarlyFolds",
    "Fold",
    "FoldPlan",
    "early_pays",
    "large_gradient",
    "split_edges",
]
