"""The capture engine: the one module that owns every hook.

Inside ``with capture(model) as cap:`` a forward hook on every covered layer records
its inputs and the *gradient edges* of its outputs (the autograd node that produced
each output). Afterwards any number of backward passes over the same graph pull the
gradients ``g`` w.r.t. those outputs with :func:`torch.autograd.grad` on the recorded
edges: no second forward, ``.grad`` untouched, and ``K`` vectors injected at the output
at once with ``is_grads_batched``. Because an edge names the producing node, in-place
ops applied to a layer output later (``ReLU(inplace=True)``) do not change what is
received, and nothing can fire twice. A module called several times in one forward gets
one record per call, paired call by call.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .edges import CheckedView, assign_grads, check_out_buffer, leaves, output_edge
from .layers import Call, FunctionalRule, LayerRule, registered_rule
from .layers.base import current_shared_slots
from .layers.norm import batchnorm_train_error
from .options import Unsupported, choice, renamed

_FUNCTIONAL = FunctionalRule()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside DDP / DataParallel wrappers and ``torch.compile``'s wrapper.

    Layer names are then those of the plain model (not ``_orig_mod.<name>``); calling the
    compiled wrapper runs the inner model's hooks. ``torch.compile`` imports dynamo.
    """
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif dynamo is not None and isinstance(model, dynamo.OptimizedModule):
            model = model._orig_mod  # the compiled model (no public accessor)
        else:
            return model


def select_layers(
    model: nn.Module,
    unsupported: Union[str, Unsupported] = "functorch",
    *,
    arg: str = "unsupported",
) -> List[Tuple[str, nn.Module, LayerRule]]:
    """The layers that carry trainable parameters, each with the rule that covers it.

    Args:
        model: The model.
        unsupported: ``"functorch"`` covers parameterized layers without a registered
            rule with the ``torch.func`` replay; ``"error"`` refuses them.
        arg: The argument's name as the user wrote it (for the error message).

    Returns:
        ``(name, module, rule)`` triples in ``named_modules`` order.

    Raises:
        ValueError: For a BatchNorm layer in train mode, an uncovered layer with
            ``unsupported="error"``, or an unknown ``unsupported``.

    """
    fallback = choice(
        Unsupported,
        unsupported,
        f"capture({arg}",
        allowed=(Unsupported.FUNCTORCH, Unsupported.ERROR),
    )
    targets: List[Tuple[str, nn.Module, LayerRule]] = []
    covered: List[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(prefix + ".") for prefix in covered):
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            module.training or not module.track_running_stats
        ):
            raise batchnorm_train_error(name, module)
        rule = registered_rule(module)
        if rule is None:
            if not any(p.requires_grad for p in module.parameters(recurse=False)):
                continue
            if fallback == Unsupported.ERROR:
                raise ValueError(
                    f"Module '{name}' ({type(module).__name__}) has trainable parameters "
                    "but no layer rule. Register one with @curvature.layers.register, use "
                    "unsupported='functorch' (exact, replays the module per sample), or "
                    "freeze its parameters."
                )
            rule = _FUNCTIONAL
        if rule.param_names(module):
            targets.append((name, module, rule))
            if rule.covers_children:
                covered.append(name)
    return targets


class Capture:
    """Records layer inputs and output edges of one forward; pulls backprops after it.

    Use :func:`capture` to create one. After the ``with`` block, the per-sample methods
    run backward passes on the retained graph of the recorded forward.

    Attributes:
        model: The captured model (DDP wrappers removed).
        layers: ``(name, module, rule)`` of the covered layers.

    """

    def __init__(
        self,
        model: nn.Module,
        *,
        unsupported: Union[str, Unsupported] = "functorch",
        fallback: Optional[str] = None,
    ):
        unsupported, arg = renamed(unsupported, fallback, "unsupported", "fallback", "capture")
        self.model = unwrap_model(model)
        self.layers = select_layers(self.model, unsupported, arg=arg)
        if not self.layers:
            raise ValueError(
                f"capture({type(self.model).__name__}): the model has no trainable "
                "parameters in any layer, so there is nothing to capture."
            )
        self._calls: Dict[str, List[Call]] = {name: [] for name, _, _ in self.layers}
        self._rules: Dict[str, LayerRule] = {name: rule for name, _, rule in self.layers}
        self._handles: List[Any] = []
        self._recording = False
        self._push = False  # push mode: node pre-hooks store g during the user's backward
        self._pushing = True  # off while our own pulls run

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
            self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
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
        """Call ``start(module, args)`` / ``end(module, args, output)`` around each forward.

        Root-module hooks owned by this capture (removed by :meth:`remove_hooks`), held
        weakly: ``start`` and ``end`` are bound methods of an owner (an optimizer) that
        may be garbage-collected while the model lives. ``end`` runs after every layer
        hook of the forward has recorded its call.
        """
        for method, register in (
            (start, self.model.register_forward_pre_hook),
            (end, self.model.register_forward_hook),
        ):
            if method is None:
                continue
            hook = WeakHook(method.__self__, method.__func__.__name__, self.model)
            self._handles.append(register(hook))

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
        return self._push and self._pushing

    @property
    def calls(self) -> Dict[str, List[Call]]:
        """Layer name to its recorded calls of the current forward(s), in call order."""
        return {name: list(calls) for name, calls in self._calls.items()}

    def remove_hooks(self) -> None:
        """Remove every hook this capture registered (idempotent)."""
        self._recording = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __del__(self) -> None:
        if hasattr(self, "_handles"):
            self.remove_hooks()

    def _on_forward(self, name: str, module: nn.Module, args, kwargs, output) -> None:
        if self._recording:
            self._record(name, module, args, kwargs, output)

    def _record(self, name: str, module: nn.Module, args, kwargs, output) -> None:
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
            ref = weakref.ref(self)
            for j, edge in enumerate(edges):
                edge.node.register_prehook(_make_prehook(ref, call, j, edge.output_nr))
        self._calls[name].append(call)

    def watch_backward(self, enabled: bool = True) -> None:
        """Push mode: store ``g`` of every later recorded call during the user's backward.

        Each recorded output's autograd node gets a pre-hook that keeps the gradient it
        receives (the gradient of whatever scalar the user backpropagates). Completed calls
        are handed out by :meth:`take_pushed`. Our own pulls never trigger it.
        """
        self._push = enabled

    def take_pushed(self) -> List[Tuple[str, nn.Module, LayerRule, List[Call]]]:
        """Calls that received gradients in a user backward since the last take.

        Their ``grads`` are set (zeros for outputs that received none); they are removed
        from the capture, and calls still waiting for their backward stay.
        """
        out = []
        for name, module, rule in self.layers:
            done = [c for c in self._calls[name] if any(g is not None for g in c.pushed or ())]
            if not done:
                continue
            self._calls[name] = [c for c in self._calls[name] if c not in done]
            for c in done:
                assign_grads(c, c.pushed, ())
                c.pushed = None
            out.append((name, module, rule, done))
        return out

    def clear(self) -> None:
        """Forget every recorded call (and its pushed gradients)."""
        for calls in self._calls.values():
            calls.clear()

    # -- backward pulls ------------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        """Batch size ``N`` of the recorded forward."""
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

        """
        active = self.active()
        if not active:
            _ = self.batch_size  # raises the "no forward was recorded" error
        calls = [c for _, _, _, cs in active for c in cs]
        edges = [e for c in calls for e in c.out_edges]
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
        self._recording = False
        self._pushing = False
        try:
            grads = torch.autograd.grad(
                outputs,
                edges,
                grad_outputs,
                retain_graph=retain_graph,
                allow_unused=True,
                is_grads_batched=vmapped,
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
            self._recording = bool(self._handles)
            self._pushing = True
        for c in calls:
            for view in c.out_views:
                if isinstance(view, CheckedView) and view.modified():
                    raise RuntimeError(
                        "A layer output that is a view of another tensor was modified in "
                        "place after the layer (e.g. ReLU(inplace=True) on a reshaped "
                        "output), which detaches the recorded gradient edge. Use an "
                        "out-of-place op after this layer."
                    )
        if all(g is None for g in grads):
            raise ValueError(
                "The given outputs do not depend on the captured forward: compute them "
                "from the output of the model run inside `with capture(model)`."
            )
        it = iter(grads)
        for c in calls:
            gs = [next(it) for _ in c.out_edges]
            if unreached == "skip" and all(g is None for g in gs):
                c.grads = None
                continue
            assign_grads(c, gs, lead)

    @contextmanager
    def computing(self) -> Iterator[None]:
        """Compute from pulled ``g`` without building a graph; release every ``g`` after.

        Recording pauses inside (the ``torch.func`` replays of layer rules must not be
        recorded as calls).
        """
        recording, self._recording = self._recording, False  # replays must not record
        try:
            with torch.no_grad():
                yield
        finally:
            self._recording = recording and bool(self._handles)
            for calls in self._calls.values():
                for c in calls:
                    c.grads = None

    def _pull_losses(self, losses: Tensor, retain_graph: bool) -> None:
        N = self.batch_size
        if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] != N:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses)
            raise ValueError(
                f"losses must be a 1-D tensor [N] = [{N}] of per-sample losses (e.g. "
                f"`loss_func(reduction='none')` reduced over non-batch axes); got {shape}."
            )
        if losses.grad_fn is None:
            raise ValueError(
                "losses do not require grad: compute them from the captured model output "
                "with gradients enabled."
            )
        self.pull(losses.sum(), retain_graph=retain_graph)
        for name, _, _, calls in self.active():
            for c in calls:
                c.check_inputs_unchanged(name)

    # -- per-sample quantities ----------------------------------------------------------
    def per_sample_grads(
        self,
        losses: Tensor,
        *,
        retain_graph: bool = True,
        out: Optional[Dict[str, Tensor]] = None,
    ) -> Dict[str, Tensor]:
        """Per-sample gradients ``grad l_n`` of every captured parameter.

        Args:
            losses: Per-sample losses ``[N]`` computed from the captured output.
            retain_graph: Keep the graph for further pulls or a later ``backward()``.
            out: Optional preallocated results, parameter name to ``[N, *p.shape]``
                (contiguous, the parameter's dtype and device). Reusing buffers across
                steps avoids the page faults of fresh allocations, which otherwise
                dominate the cost on CPU for large layers.

        Returns:
            Parameter name (as in ``model.named_parameters()``) to ``[N, *p.shape]``.
            Without ``out``, new tensors on the parameters' device, freed when you
            drop them.

        """
        self._pull_losses(losses, retain_graph)
        N = self.batch_size
        res: Dict[str, Tensor] = {}
        with self.computing():
            for name, module, rule, calls in self.active():
                prefix = f"{name}." if name else ""
                local_out = None
                if out is not None:
                    params = dict(module.named_parameters())
                    local_out = {}
                    for local in rule.param_names(module):
                        buf = out.get(prefix + local)
                        if buf is not None:
                            check_out_buffer(prefix + local, buf, params[local], N)
                            local_out[local] = buf
                for local, grad in rule.per_sample_grads(module, calls, local_out).items():
                    if local_out and local in local_out and grad is not local_out[local]:
                        grad = local_out[local].copy_(grad)
                    res[prefix + local] = grad
        order = [n for n, _ in self.model.named_parameters()]
        return {n: res[n] for n in order if n in res}

    def per_sample_grad_norms(self, losses: Tensor, *, retain_graph: bool = True) -> Tensor:
        """L2 norms ``[N]`` of the per-sample gradients over all captured parameters.

        Layers with a cheaper route (Linear without sharing: ``|a_n|^2 |g_n|^2``; with
        sharing: the Gram trick over positions) never materialize ``[N, *p.shape]``.
        """
        self._pull_losses(losses, retain_graph)
        with self.computing():
            sq = sum(
                rule.per_sample_sq_norms(module, calls) for _, module, rule, calls in self.active()
            )
        return sq.sqrt()

    def gram(self, losses: Tensor, *, retain_graph: bool = True) -> Tensor:
        """Gram matrix ``K[n, m] = <grad l_n, grad l_m>`` ``[N, N]`` of per-sample grads."""
        self._pull_losses(losses, retain_graph)
        with self.computing():
            return sum(rule.gram(module, calls) for _, module, rule, calls in self.active())


def _make_prehook(ref: weakref.ReferenceType[Capture], call: Call, j: int, output_nr: int):
    def prehook(grad_outputs):
        cap = ref()
        if cap is not None and cap.pushing and call.pushed is not None:
            g = grad_outputs[output_nr]
            if g is not None:
                call.pushed[j] = g if call.pushed[j] is None else call.pushed[j] + g
        return None

    return prehook


class WeakHook:
    """A picklable hook bound weakly to its owner and to the module it was registered on.

    It calls ``owner.<method>(*args)`` only on that very module: copies of the module
    (``copy.deepcopy`` copies hook dictionaries) and unpickled modules get a hook that
    does nothing, so they never feed statistics into the original owner.
    """

    def __init__(self, owner: Any, method: str, module: Optional[nn.Module], *extra: Any):
        self._owner = weakref.ref(owner) if owner is not None else None
        self._module = weakref.ref(module) if module is not None else None
        self._method = method
        self._extra = extra

    def __call__(self, module: nn.Module, *args: Any) -> None:  # noqa: D102
        owner = self._owner() if self._owner is not None else None
        if owner is None or module is not (self._module() if self._module else None):
            return None
        getattr(owner, self._method)(*self._extra, module, *args)
        return None

    def __deepcopy__(self, memo: dict) -> WeakHook:
        return WeakHook(None, self._method, None)  # bound to nothing: does nothing

    def __getstate__(self) -> dict:
        return {"_method": self._method}

    def __setstate__(self, state: dict) -> None:
        self._owner, self._module, self._method, self._extra = None, None, state["_method"], ()


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
