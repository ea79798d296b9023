"""The capture engine: the one module that owns every hook.

Inside ``with capture(model) as cap:`` a forward hook on every covered layer records
its inputs and the *gradient edges* of its outputs (the autograd node that produced
each output). Afterwards any number of backward passes over the same graph pull the
gradients ``g`` w.r.t. those outputs with :func:`torch.autograd.grad` on the recorded
edges: no second forward, ``.grad`` untouched, and ``K`` vectors injected at the output
at once with ``is_grads_batched``. Because an edge names the producing node, in-place
ops applied to a layer output later (``ReLU(inplace=True)``) do not change what is
received, and nothing fires twice. A module called several times gets one record per call.
"""

from __future__ import annotations

import contextvars
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .capture_hooks import HookedCall, make_commit_hook, make_prehook, positional_input
from .capture_quantities import PerSampleQuantities
from .capture_traced import TracedCalls, outside_graph
from .early_fold import EarlyFolds, FoldPlan
from .edges import WeakHook, assign_grads, check_views, leaves, output_edge
from .layers import Call, LayerRule
from .layers.base import current_shared_slots
from .layers.norm import uses_batch_statistics
from .layers.select import compiled_wrapper, select_layers, unwrap_model
from .options import Unsupported, renamed
from .subnormals import flushing

FIRST_WITH_KWARGS = {"with_kwargs": True, "prepend": True}  # the root pre-hook: as passed

#: Pulls of any capture in progress, process-wide: no capture's push hooks take their ``g``.
_PULLS = [0]
#: ``id`` of the capture that alone records forwards now (``0``: none), else ``None``.
_EXCLUSIVE: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "curvature_exclusive_capture", default=None
)


@contextmanager
def isolated(owner: Optional[Capture] = None) -> Iterator[None]:
    """Inside, only ``owner`` records forwards (no capture at all if ``None``).

    The library's own forwards (``kfac()``, ``per_sample_grads()``, the dense oracles) use
    it, so that an optimizer attached to the same model neither records them nor runs
    its callbacks on them. Pulls are isolated the same way, process-wide.
    """
    token = _EXCLUSIVE.set(0 if owner is None else id(owner))
    try:
        yield
    finally:
        _EXCLUSIVE.reset(token)


class Capture(PerSampleQuantities, TracedCalls):
    """Records layer inputs and output edges of one forward; pulls backprops after it.

    Use :func:`capture` to create one. After the ``with`` block, the per-sample methods
    run backward passes on the retained graph of the recorded forward.

    Attributes:
        model: The captured model (DDP wrappers removed).
        layers: ``(name, module, rule)`` of the covered layers.
        batch_statistics: With ``skip_batch_statistics=True`` (the optimizers), the names
            of the BatchNorm layers left out because they normalize with batch statistics
            (train mode); with the default ``False`` such a layer is refused.

    """

    def __init__(
        self,
        model: nn.Module,
        *,
        unsupported: Union[str, Unsupported] = "functorch",
        fallback: Optional[str] = None,
        skip_batch_statistics: bool = False,
    ):
        unsupported, arg = renamed(unsupported, fallback, "unsupported", "fallback", "capture")
        self.model = unwrap_model(model)
        self.wrapper = compiled_wrapper(model)  # torch.compile's wrapper, if any
        self._in_wrapper = False  # a call of the wrapper in progress
        self.layers = select_layers(
            self.model, unsupported, arg=arg, skip_batch_statistics=skip_batch_statistics
        )
        skipped = self.model.named_modules() if skip_batch_statistics else ()
        self.batch_statistics = [n for n, m in skipped if uses_batch_statistics(m)]
        if not self.layers:
            raise ValueError(
                f"capture({type(self.model).__name__}): the model has no trainable "
                "parameters in any layer, so there is nothing to capture."
            )
        self._calls: Dict[str, List[Call]] = {name: [] for name, _, _ in self.layers}
        self._rules: Dict[str, LayerRule] = {name: rule for name, _, rule in self.layers}
        self._handles: List[Any] = []
        self._param_handles: List[Any] = []  # push mode: post-accumulate hooks (commits)
        # the hooks go when this capture is collected; a finalizer, not ``__del__``: an
        # object sharing these lists (a ``copy.copy``) can then not remove them
        weakref.finalize(self, _remove_handles, self._handles, self._param_handles)
        self._recording = False
        self._push = False  # push mode: node pre-hooks store g during the user's backward
        #: push mode: each recorded call's pre-hook state (held by the hooks, the call weakly)
        self._hooked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._pushing = True  # off while our own pulls run
        self._on_commit: Optional[Callable[..., Any]] = None
        self.late_gradients = 0  # gradients that reached a call after it was handed out
        self.graph_gradients = 0  # committed calls a create_graph=True pass reached before
        self._init_traced()

    # -- hooks -------------------------------------------------------------------------
    def attach(self) -> Capture:
        """Register the layer hooks and start recording (what ``with`` does on entry).

        For a capture that lives longer than one ``with`` block (an optimizer's): the
        hooks stay until :meth:`remove_hooks`.
        """
        if self._handles:
            raise RuntimeError("This capture is already active (nested `with`).")
        for calls in self._calls.values():
            calls.clear()
        for name, module, _ in self.layers:
            hook = WeakHook(self, "_on_forward", module, name)
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True, prepend=True))
        self._recording = True
        return self

    def __enter__(self) -> Capture:
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.remove_hooks()

    def on_forward(
        self,
        start: Optional[Callable[..., Any]] = None,
        end: Optional[Callable[..., Any]] = None,
    ) -> None:
        """Call ``start(module, args, kwargs)`` / ``end(module, args, output)`` around each forward.

        Root-module hooks owned by this capture (removed by :meth:`remove_hooks`), held
        weakly: ``start`` and ``end`` are bound methods of an owner (an optimizer) that
        may be garbage-collected while the model lives. ``start`` runs before the user's
        pre-hooks (the arguments as passed), ``end`` after every layer hook has recorded.
        """
        self._root = {
            "start": None if start is None else weakref.WeakMethod(start),
            "end": None if end is None else weakref.WeakMethod(end),
        }
        pre, post = (WeakHook(self, f"_root_{w}", self.model) for w in ("start", "end"))
        self._handles.append(self.model.register_forward_pre_hook(pre, **FIRST_WITH_KWARGS))
        self._handles.append(self.model.register_forward_hook(post))
        self._hook_wrapper()

    @property
    def suspended(self) -> bool:
        """Whether another capture records exclusively now (see :func:`isolated`)."""
        owner = _EXCLUSIVE.get()
        return owner is not None and owner != id(self)

    def _root_start(self, module: nn.Module, args: Any, kwargs: Any, outside: bool = False) -> None:
        self._root_call("start", outside, module, args, kwargs)

    def _root_end(self, module: nn.Module, args: Any, output: Any, outside: bool = False) -> None:
        self._root_call("end", outside, module, args, output)

    def _root_call(self, which: str, outside: bool, *args: Any) -> None:
        if self._in_wrapper and not outside:  # the wrapper's hook runs it, outside the graph
            return
        if torch.compiler.is_compiling():  # a model compiled after the capture attached
            return outside_graph(self._root_call, which, True, *args)  # one graph break
        if which == "end" and self._inbox:  # a compiled forward's output nodes (no edges)
            self._output_nodes = [getattr(t, "grad_fn", None) for t in leaves(args[2])]
        fn = self._root[which]() if self._root[which] is not None else None
        if fn is not None and not self.suspended:
            fn(*args)

    @property
    def recording(self) -> bool:
        """Whether the layer hooks record calls now (``False`` while paused)."""
        return self._recording

    @recording.setter
    def recording(self, value: bool) -> None:
        self._recording = bool(value) and bool(self._handles)

    @property
    def pushing(self) -> bool:
        """Whether the user's backward stores ``g`` now (off while our own pulls run)."""
        return self._push and self._pushing and _PULLS[0] == 0

    @property
    def calls(self) -> Dict[str, List[Call]]:
        """Layer name to its recorded calls of the current forward(s), in call order."""
        self._drain()
        return {name: list(calls) for name, calls in self._calls.items()}

    def remove_hooks(self) -> None:
        """Remove every hook this capture registered (idempotent)."""
        self._recording = False
        _remove_handles(self._handles, self._param_handles)

    def _on_forward(self, name: str, module: nn.Module, args, kwargs, output) -> Any:
        if torch.compiler.is_compiling() and self._traceable[name] and isinstance(output, Tensor):
            return self._record_traced(name, args, kwargs, output)  # the tapped output
        if self._recording and not self.suspended:
            self._record(name, module, args, kwargs, output)
        return None

    def _record(self, name: str, module: nn.Module, args, kwargs, output) -> None:
        args, kwargs = positional_input(module, args, kwargs)  # (linear(input=x))
        outs = leaves(output)
        edges, meta, index, views = [], [], [], []
        base_ok = self._rules[name].base_edge_outputs
        for i, t in enumerate(outs):
            if isinstance(t, Tensor) and t.grad_fn is not None:
                edge, view = output_edge(t, i in base_ok)
                edges.append(edge)
                views.append(view)
                meta.append((t.shape, t.dtype, t.device))
                index.append(i)
        if not edges:  # e.g. a forward under no_grad: nothing to differentiate
            return
        inputs = leaves(args) + leaves(list(kwargs.values())) if kwargs else leaves(args)
        versions = [(t, t._version) for t in inputs if isinstance(t, Tensor)]
        extra = self._rules[name].extra_edges(module, args, kwargs, outs, index)
        for edge, t_meta in extra[0] if extra else ():
            edges.append(edge)  # internal tensors the rule needs g for (after the outputs)
            meta.append(t_meta)
            views.append(None)
        call = Call(args, kwargs, versions, edges, meta, index)
        call.out_views = views
        call.extra_info = extra[1] if extra else None
        call.slots = current_shared_slots()
        if self._rules[name].needs_outputs:
            call.outputs = [outs[i] for i in index]
            call.output_versions = [t._version for t in call.outputs]
        if self._push:
            call.pushed = [None] * len(edges)
            call.pending = [None] * len(edges)
            ref = weakref.ref(self)
            box = self._hooked[call] = HookedCall(call)
            for j, edge in enumerate(edges):
                edge.node.register_prehook(make_prehook(ref, box, j, edge.output_nr))
        self._calls[name].append(call)

    def watch_backward(
        self, enabled: bool = True, on_commit: Optional[Callable[..., Any]] = None
    ) -> None:
        """Push mode: keep ``g`` of every later recorded call from the user's backward.

        Each recorded output's autograd node gets a pre-hook that keeps the gradient it
        receives in a backward pass (the gradient of whatever scalar the user
        backpropagates). The gradients of a pass count once the layer's parameters
        accumulated theirs into ``.grad`` (a post-accumulate-grad hook *commits* them): a
        ``torch.autograd.grad`` call through the graph (a gradient penalty, a logged
        norm) never accumulates, so its gradients are replaced by those of the next
        pass, and the statistics follow ``.grad`` exactly. Our own pulls never trigger
        the hooks.

        Args:
            enabled: Turn push mode on (for calls recorded from now on) or off.
            on_commit: Called as ``on_commit(name, module, rule, calls)`` with the calls
                of a layer whose gradients were just committed (``grads`` set; removed
                from the capture), inside the backward, while the layer inputs are still
                those of the forward. Without it, committed calls wait for
                :meth:`take_pushed`. A bound method, held weakly.

        """
        self._push = enabled
        self._on_commit = None if on_commit is None else weakref.WeakMethod(on_commit)
        _remove_handles(self._param_handles)
        ref = weakref.ref(self)
        for name, module, _ in self.layers if enabled else ():
            for p in (p for p in module.parameters() if p.requires_grad):
                hook = make_commit_hook(ref, name)
                self._param_handles.append(p.register_post_accumulate_grad_hook(hook))

    def commit(self, name: str) -> None:
        """Commit the pending gradients of layer ``name``'s calls (see :meth:`watch_backward`)."""
        self._drain()
        done, task = [], torch._C._current_graph_task_id()  # this backward's pass only: an
        for c in self._calls.get(name, ()):  # autograd.grad pass never accumulates (its g go)
            if c.pending is None or c.task != task or all(g is None for g in c.pending):
                continue
            c.pushed = [
                p if q is None else (q if p is None else p + q) for p, q in zip(c.pushed, c.pending)
            ]
            c.pending = [None] * len(c.pending)
            self.graph_gradients += c.graphed  # a create_graph pass reached it (a penalty;
            c.graphed = False  # a monitoring loss's Hessian trace never commits)
            if all(g is not None for g in c.pushed[len(c.out_index) :]):  # the rule's inner
                done.append(c)  # edges too (MHA's in-projections: after out_proj's params)
        callback = self._on_commit() if self._on_commit is not None else None
        if done and callback is not None:
            self._calls[name] = [c for c in self._calls[name] if c not in done]
            for c in done:
                self._hand_out(c)
            module, rule = next((m, r) for n, m, r in self.layers if n == name)
            callback(name, module, rule, done)

    def _hand_out(self, call: Call) -> None:
        """A call's committed gradients become its ``grads``; a later backward is late."""
        assign_grads(call, call.pushed, ())
        call.pushed = call.pending = None
        box = self._hooked.pop(call, None)
        if box is not None:
            box.handed_out = True

    def take_pushed(self) -> List[Tuple[str, nn.Module, LayerRule, List[Call]]]:
        """Calls whose gradients a user backward committed since the last take.

        Their ``grads`` are set (zeros for outputs that received none); they are removed
        from the capture, and calls still waiting for their backward stay.
        """
        self._drain()
        out = []
        for name, module, rule in self.layers:
            done = [c for c in self._calls[name] if any(g is not None for g in c.pushed or ())]
            if not done:
                continue
            self._calls[name] = [c for c in self._calls[name] if c not in done]
            for c in done:
                self._hand_out(c)
            out.append((name, module, rule, done))
        return out

    def watch_accumulation(self, callback: Callable[[], Any]) -> None:
        """Call ``callback(param)`` when a backward accumulates a captured layer's ``.grad``.

        Post-accumulate-grad hooks on the layers' trainable parameters (removed by
        :meth:`remove_hooks`); ``callback`` is a bound method, held weakly. A
        ``torch.autograd.grad`` call never triggers it.
        """
        method = weakref.WeakMethod(callback)

        def hook(param: Tensor) -> None:
            fn = method()
            if fn is not None:
                fn(param)

        seen = set()
        for _, module, _ in self.layers:
            for p in module.parameters():
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self._param_handles.append(p.register_post_accumulate_grad_hook(hook))

    def watch_module(self, module: nn.Module, end: Callable[..., Any]) -> None:
        """Call ``end(module, args, kwargs, output)`` after each call of ``module``.

        For a module outside the captured model (e.g. the loss module, to see its input
        and target); held weakly (``end`` a bound method), removed by
        :meth:`remove_hooks`.
        """
        hook = WeakHook(end.__self__, end.__func__.__name__, module)
        self._handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def reaches(self, output: Tensor) -> bool:
        """Whether ``output``'s graph contains an output edge of a recorded call.

        A walk of the autograd graph from ``output`` that stops at the first recorded
        node (for the model's own output, a few nodes away).
        """
        self._drain()
        targets = {e.node for cs in self._calls.values() for c in cs for e in c.out_edges}
        if any(c.tickets for cs in self._calls.values() for c in cs):
            if not self._output_nodes:  # a compiled forward's calls, its output unknown
                return True
            targets.update(self._output_nodes)  # the compiled graph's own output nodes
        stack, seen = [output.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            if node in targets:
                return True
            seen.add(node)
            stack.extend(f for f, _ in node.next_functions)
        return False

    def clear(self) -> None:
        """Forget every recorded call (and its pushed gradients)."""
        self._inbox.clear()
        self._output_nodes = []
        for calls in self._calls.values():
            calls.clear()

    # -- backward pulls ------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Batch size ``N`` of the recorded forward."""
        self._drain()
        sizes = {
            rule.batch_size(module, call)
            for name, module, rule in self.layers
            for call in self._calls[name]
        }
        if not sizes:
            raise RuntimeError(
                "No forward pass was recorded: run the model inside "
                "`with curvature.capture(model) as cap:` (with gradients enabled) before "
                "asking for per-sample quantities."
            )
        if len(sizes) > 1:
            raise RuntimeError(
                f"The captured layers saw different batch sizes {sorted(sizes)}; "
                "per-sample quantities need one batch axis shared by all layers "
                "(axis 0, or axis 1 for nn.MultiheadAttention with batch_first=False)."
            )
        return sizes.pop()

    def active(self) -> List[Tuple[str, nn.Module, LayerRule, List[Call]]]:
        """``(name, module, rule, calls)`` of every layer with recorded calls."""
        self._drain()
        return [(n, m, r, list(self._calls[n])) for n, m, r in self.layers if self._calls[n]]

    def reached(self, *, take: bool = False) -> List[Tuple[str, nn.Module, LayerRule, List[Call]]]:
        """Like :meth:`active`, with only the calls whose ``grads`` a pull set.

        Args:
            take: Also remove those calls from the capture (the caller owns them now);
                calls the pull did not reach stay for a later pull.

        """
        out = []
        for name, module, rule in self.layers:
            done = [c for c in self._calls[name] if c.grads is not None]
            if done:
                out.append((name, module, rule, done))
                if take:
                    self._calls[name] = [c for c in self._calls[name] if c.grads is None]
        return out

    def pull(
        self,
        outputs: Union[Tensor, Sequence[Tensor]],
        grad_outputs: Union[None, Tensor, Sequence[Optional[Tensor]]] = None,
        *,
        is_grads_batched: bool = False,
        retain_graph: bool = True,
        unreached: str = "zeros",
        fold: Optional[FoldPlan] = None,
    ) -> None:
        """Backpropagate through the captured graph and store ``g`` on every call.

        Computes ``g = (d outputs / d z)^T grad_outputs`` for every recorded layer output
        ``z`` with one :func:`torch.autograd.grad` call on the recorded edges. With
        ``is_grads_batched=True``, ``grad_outputs`` carry a leading ``[K]`` axis and every
        ``g`` gets it too (``K`` vector-Jacobian products in one vmapped backward).

        Args:
            outputs: Tensors to differentiate (e.g. the per-sample losses, or the model
                output).
            grad_outputs: Vectors injected at ``outputs`` (ones for scalars if omitted).
            is_grads_batched: Whether ``grad_outputs`` have a leading batch axis ``[K]``.
            retain_graph: Keep the graph for further pulls or a later ``backward()``.
            unreached: Calls that ``outputs`` do not depend on get zero gradients
                (``"zeros"``) or keep ``grads=None`` (``"skip"``).
            fold: A :class:`~curvature.early_fold.FoldPlan`: its ``fold(name, module,
                rule, calls)`` runs inside the backward for the layers whose ``grads``
                arrive before the pull ends (one vector; not the unreached ones).

        """
        active = self.active()
        if not active:
            _ = self.batch_size  # raises the "no forward was recorded" error
        lead: Tuple[int, ...] = ()
        vmapped = is_grads_batched
        if is_grads_batched:
            many = isinstance(grad_outputs, (list, tuple))
            first = next(g for g in grad_outputs if g is not None) if many else grad_outputs
            lead = (first.shape[0],)
            if lead == (1,):  # one vector: a plain backward, without vmap's overhead
                vmapped = False
                if many:
                    grad_outputs = [None if g is None else g[0] for g in grad_outputs]
                else:
                    grad_outputs = grad_outputs[0]
        early = EarlyFolds(active, fold, lead, self._drop)
        calls = [c for _, _, _, cs in active for c in cs if not c.tickets and not early.takes(c)]
        traced = [c for _, _, _, cs in active for c in cs if c.tickets]  # compiled forwards
        edges = [e for c in calls for e in c.out_edges]
        self._recording = False
        self._pushing = False
        _PULLS[0] += 1
        handles, grads = [], ()
        try:
            handles = [node.register_prehook(hook) for node, hook in early.prehooks()]
            if edges:
                grads = torch.autograd.grad(
                    outputs,
                    edges,
                    grad_outputs,
                    retain_graph=retain_graph or bool(traced),
                    allow_unused=True,
                    is_grads_batched=vmapped,
                )
            _remove_handles(handles)
            early.raise_errors()
            if traced:
                grads = (
                    *grads,
                    *self._pull_traced(traced, outputs, grad_outputs, vmapped, retain_graph),
                )
            if is_grads_batched and not vmapped:
                grads = tuple(None if g is None else g.unsqueeze(0) for g in grads)
        except RuntimeError as err:
            if "second time" in str(err) or "freed" in str(err):
                raise RuntimeError(
                    "The graph of the captured forward was already freed (a backward() "
                    "without retain_graph=True ran on it). Ask for per-sample quantities "
                    "before loss.backward(), or call loss.backward(retain_graph=True)."
                ) from err
            raise
        finally:
            _remove_handles(handles)
            _PULLS[0] -= 1
            self._recording = bool(self._handles)
            self._pushing = True
        check_views(calls + early.folded)
        if all(g is None for g in grads) and not early.folded:
            raise ValueError(
                "The given outputs do not depend on the captured forward: compute them "
                "from the output of the model run inside `with capture(model)`."
            )
        calls = calls + traced
        it = iter(grads)
        for c in calls:
            gs = [next(it) for _ in (c.tickets or c.out_edges)]
            if unreached == "skip" and all(g is None for g in gs):
                c.grads = None
                continue
            assign_grads(c, gs, lead)
        for c in early.missed():  # taken early, but the outputs do not depend on them
            c.grads = None
            if unreached == "zeros":
                assign_grads(c, [None], lead)

    def _drop(self, name: str, calls: List[Call]) -> None:
        """Remove ``calls`` of layer ``name`` from the capture (handed to a pull's fold)."""
        self._calls[name] = [c for c in self._calls[name] if c not in calls]

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Compute from pulled ``g`` without building a graph; release every ``g`` after.

        Recording pauses inside (the ``torch.func`` replays of layer rules must not be
        recorded as calls); subnormal results are flushed to zero on this thread
        (:mod:`curvature.subnormals`).
        """
        recording, self._recording = self._recording, False  # replays must not record
        try:
            with torch.no_grad(), flushing():
                yield
        finally:
            self._recording = recording and bool(self._handles)
            for calls in self._calls.values():
                for c in calls:
                    c.grads = None


def _remove_handles(*lists: List[Any]) -> None:
    """Remove the hooks of ``lists`` and empty them (the lists stay the same objects)."""
    for handles in lists:
        for handle in handles:
            handle.remove()
        handles.clear()


def capture(
    model: nn.Module,
    *,
    unsupported: Union[str, Unsupported] = "functorch",
    fallback: Optional[str] = None,
) -> Capture:
    """Capture one forward of ``model`` for per-sample quantities from its graph.

    Example:
        >>> with curvature.capture(model) as cap:  # doctest: +SKIP
        ...     out = model(X)
        >>> losses = nn.functional.cross_entropy(out, y, reduction="none")  # [N]
        >>> norms = cap.per_sample_grad_norms(losses)  # [N], no second forward

    Args:
        model: The model (a DDP wrapper is unwrapped). Its batch axis must be axis 0 of
            every layer input (axis 1 for ``nn.MultiheadAttention(batch_first=False)``).
        unsupported: What to do with parameterized layers without a rule:
            ``"functorch"`` (replay the module per sample with ``torch.func``) or
            ``"error"``.
        fallback: Deprecated name of ``unsupported``.

    Returns:
        A :class:`Capture`, to be used as a context manager around the forward.

    """
    return Capture(model, unsupported=unsupported, fallback=fallback)
