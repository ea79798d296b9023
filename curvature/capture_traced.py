"""The capture inside a ``torch.compile``'d forward: layer calls recorded through taps.

A mixin of :class:`curvature.capture.Capture`. While dynamo traces the model, a covered
layer whose output is one tensor and whose rule needs no internal gradient edges is
recorded without reading any autograd node (which would split the graph):

- its output goes through :func:`curvature.taps.tap` (one opaque node of the graph);
- its inputs, the output's shape and the tap's ticket are appended to a Python list,
  which dynamo replays after the compiled graph ran; the list is drained into
  :class:`~curvature.layers.Call` records whenever the capture is asked for them;
- in the backward the tap hands the gradient ``g`` w.r.t. the output to
  :meth:`TracedCalls._tap_backward`, which stores it like the node pre-hook of an eager
  record (the user's backward, ``"empirical"``), or as the result of a pull.

Other layers (tuple outputs, rules with internal edges: attention, norms over batch
statistics) are recorded as in eager mode, at the price of a graph break.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .edges import WeakHook
from .layers import Call
from .layers.base import LayerRule
from .taps import register_receiver, tap


class TracedCalls:
    """Tapped layer calls of compiled forwards (see the module docstring)."""

    def _init_traced(self) -> None:
        self._inbox: List[tuple] = []  # appended by compiled forwards (dynamo replays it)
        self._key_base = register_receiver(self, "_tap_forward", "_tap_backward")
        self._layer_names = [name for name, _, _ in self.layers]
        self._layer_index = {name: i for i, name in enumerate(self._layer_names)}
        self._traceable = {
            name: not rule.needs_outputs
            and (rule.extra_edges_optional or type(rule).extra_edges is LayerRule.extra_edges)
            for name, _, rule in self.layers
        }
        self._traced_pull: Optional[Dict[int, Tuple[Call, int]]] = None
        self._output_nodes: List[Any] = []  # autograd nodes of the last model output

    def _hook_wrapper(self) -> None:
        """Forward callbacks in the hooks of ``torch.compile``'s wrapper, if there is one.

        They run outside the compiled graph; the model's own root hooks then do nothing
        (read by the traced forward as a constant: no graph break). The flag is reset
        after the wrapper's call, also when it raised.
        """
        if self.wrapper is None:
            return
        wrapper = self.wrapper
        pre = WeakHook(self, "_wrapper_start", wrapper)
        post = WeakHook(self, "_wrapper_end", wrapper)
        done = WeakHook(self, "_wrapper_done", wrapper)
        self._handles.append(wrapper.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(wrapper.register_forward_hook(post))
        self._handles.append(wrapper.register_forward_hook(done, always_call=True))

    def _wrapper_start(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self._in_wrapper = True
        self._root_start(module, args, kwargs, outside=True)

    def _wrapper_end(self, module: nn.Module, args: Any, output: Any) -> None:
        self._root_end(module, args, output, outside=True)

    def _wrapper_done(self, module: nn.Module, args: Any, output: Any) -> None:
        self._in_wrapper = False

    def _record_traced(self, name: str, args: Any, kwargs: Any, output: Any) -> Any:
        """Tap ``output`` and keep the call's inputs (traced by dynamo, no graph break)."""
        if not isinstance(output, Tensor) or not output.requires_grad:
            return None
        y, ticket = tap(output, self._key_base + self._layer_index[name])
        self._inbox.append((name, args, kwargs, ticket, (y.shape, y.dtype, y.device)))
        return y

    def _tap_forward(self, position: int) -> bool:
        """Whether the tapped call records (read when the compiled forward runs)."""
        return self._recording and not self.suspended

    def _drain(self) -> None:
        """Turn the compiled forwards' records into calls (in call order)."""
        if not self._inbox:
            return
        records = list(self._inbox)
        self._inbox.clear()  # emptied in place: the compiled frame guards this list
        for name, args, kwargs, ticket, meta in records:
            serial = int(ticket)
            if not serial:  # not recording when it ran
                continue
            inputs = list(args) + list(kwargs.values())
            versions = [(t, t._version) for t in inputs if isinstance(t, Tensor)]
            call = Call(args, dict(kwargs), versions, [], [meta], [0])
            call.out_views = [None]
            call.tickets = [serial]
            if self._push:
                call.pushed, call.pending = [None], [None]
            self._calls[name].append(call)

    def _tap_backward(self, position: int, serial: int, g: Tensor) -> None:
        """The gradient ``g`` w.r.t. a tapped output arrived in a backward pass."""
        self._drain()
        if self._traced_pull is not None:  # our own pull
            entry = self._traced_pull.get(serial)
            if entry is not None:
                call, j = entry
                call.pulled[j] = g
            return
        if not self.pushing:
            return
        name = self._layer_names[position]
        for call in self._calls[name]:
            if call.tickets and serial in call.tickets:
                receive_pushed(self, call, call.tickets.index(serial), g)
                return

    def _pull_traced(
        self,
        calls: Sequence[Call],
        outputs: Any,
        grad_outputs: Any,
        is_grads_batched: bool,
        retain_graph: bool,
    ) -> List[Optional[Tensor]]:
        """The gradients w.r.t. the tapped outputs of ``calls`` (a pull through the taps).

        One backward per vector of ``grad_outputs`` (a compiled graph's backward cannot
        be vmapped), to the covered layers' parameters; the taps hand over ``g``.
        """
        params = [p for _, m, _ in self.layers for p in m.parameters() if p.requires_grad]
        outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
        if is_grads_batched:
            many = isinstance(grad_outputs, (list, tuple))
            vs = grad_outputs if many else [grad_outputs]
            K = next(v for v in vs if v is not None).shape[0]
            rounds = [[None if v is None else v[k] for v in vs] for k in range(K)]
        else:
            rounds = [grad_outputs]
        results: List[List[Optional[Tensor]]] = [[] for _ in calls]
        self._traced_pull = {s: (c, j) for c in calls for j, s in enumerate(c.tickets)}
        try:
            for k, vectors in enumerate(rounds):
                for c in calls:
                    c.pulled = [None] * len(c.tickets)
                last = k == len(rounds) - 1
                torch.autograd.grad(
                    outs,
                    params,
                    vectors,
                    retain_graph=retain_graph or not last,
                    allow_unused=True,
                )
                for i, c in enumerate(calls):
                    results[i].append(c.pulled)
        finally:
            self._traced_pull = None
            for c in calls:
                c.pulled = None
        grads: List[Optional[Tensor]] = []
        for per_round in results:
            for j in range(len(per_round[0])):
                gs = [r[j] for r in per_round]
                if all(g is None for g in gs):
                    grads.append(None)
                elif is_grads_batched:
                    shape = next(g for g in gs if g is not None)
                    gs = [torch.zeros_like(shape) if g is None else g for g in gs]
                    grads.append(torch.stack(gs))
                else:
                    grads.append(gs[0])
        return grads


@torch.compiler.disable
def outside_graph(fn: Any, *args: Any) -> Any:
    """``fn(*args)``, run eagerly when called from a forward that dynamo traces."""
    return fn(*args)


def receive_pushed(cap: Any, call: Call, j: int, g: Tensor) -> None:
    """Keep the gradient ``g`` of the user's backward for output ``j`` of ``call``."""
    if g.requires_grad:  # a create_graph=True pass (a gradient penalty, an HVP): counted
        call.graphed = True  # if an accumulating backward commits the call (Capture.commit)
    if call.pending is None:  # handed out already: a second backward through it
        cap.late_gradients += 1
    else:  # this pass's gradient; committed when the layer's .grad accumulates
        task = torch._C._current_graph_task_id()
        if call.task != task:  # another pass (an autograd.grad one never commits): anew
            call.pending, call.task = [None] * len(call.pending), task
        call.pending[j] = g
