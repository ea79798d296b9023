"""Compile a model into a forward Laplacian :data:`~curvature.laplacian.forward.Plan`.

:func:`compile_module` walks the model once, without calling any layer: ``nn.Linear``,
``nn.Identity``, the registered activations (:data:`~.activations.ACTIVATIONS`) and
``nn.Sequential`` map to their steps in :mod:`curvature.laplacian.forward`; any other
module is traced with ``torch.fx`` and each node of its graph classified as a *state*
(depends on the input: a stacked ``[N, d + 2, *F]`` tensor at run time) or a *constant*
(parameters, buffers, numbers). Operations on states must be supported ones (functional
activations, sums, products, ``z ** p``, scaling by constants); anything else raises
:class:`UnsupportedModule` naming the layer and the operation, so that an unsupported
model is refused before any layer runs.
"""

from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

from .activations import FUNCTIONAL, activation_rule, power_rule
from .forward import (
    Plan,
    add_constant,
    broadcast_constant,
    elementwise,
    linear,
    product,
)

__all__ = ["UnsupportedModule", "compile_module"]

_ADD = (operator.add, torch.add, "add")
_SUB = (operator.sub, torch.sub, "sub")
_MUL = (operator.mul, torch.mul, "mul")
_DIV = (operator.truediv, torch.div, "div")
_NEG = (operator.neg, torch.neg, "neg")
_POW = (operator.pow, torch.pow, "pow")


class UnsupportedModule(Exception):
    """A module or operation that the forward Laplacian cannot propagate.

    The message names it, e.g. ``"layer '1' (LayerNorm) is not supported by the forward
    Laplacian"``.
    """


def _describe(path: str, module: nn.Module) -> str:
    where = f"layer {path!r}" if path else "the model"
    return f"{where} ({type(module).__name__})"


def compile_module(module: nn.Module, path: str = "") -> Plan:
    """A function ``state -> state`` for ``module``: ``[N, d + 2, *F_in]`` to
    ``[N, d + 2, *F_out]``.

    Nothing is called here: an unsupported model is refused before any layer runs.

    Args:
        module: The model or one of its layers.
        path: The layer's name in the model (``""`` for the model), for messages.

    Raises:
        UnsupportedModule: If a layer or an operation on an input-dependent tensor is not
            supported.

    """
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return lambda state: linear(module, state)
    if type(module) is nn.Identity:
        return lambda state: state
    rule = activation_rule(module)
    if rule is not None:
        derivatives = rule(module)
        return lambda state: elementwise(derivatives, state)
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        prefix = f"{path}." if path else ""
        # not named_children(): it skips a module that appears twice (a shared activation)
        children = [
            (n, c) for n, c in module.named_modules(remove_duplicate=False) if n and "." not in n
        ]
        steps = [compile_module(child, f"{prefix}{name}") for name, child in children]
        return lambda state: _chain(steps, state)
    if type(module).__module__.startswith("torch."):
        raise UnsupportedModule(
            f"{_describe(path, module)} is not supported by the forward Laplacian"
        )
    return _compile_traced(module, path)


def _chain(steps: List[Plan], state: Tensor) -> Tensor:
    for step in steps:
        state = step(state)
    return state


# The fx graphs of traced custom modules, per module (a failed trace is cached too).
_TRACES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _trace(module: nn.Module, path: str) -> torch.fx.Graph:
    if module not in _TRACES:
        try:
            _TRACES[module] = torch.fx.Tracer().trace(module)
        except Exception as err:  # noqa: BLE001 - any tracing failure means unsupported
            _TRACES[module] = f"{type(err).__name__}: {err}"
    graph = _TRACES[module]
    if isinstance(graph, str):
        raise UnsupportedModule(
            f"{_describe(path, module)} could not be traced with torch.fx ({graph})"
        )
    return graph


def _fetch_attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for name in target.split("."):
        obj = getattr(obj, name)
    return obj


def _compile_traced(module: nn.Module, path: str) -> Plan:
    """Compile the fx graph of a custom module into steps on states and constants.

    Every node is classified statically as a *state* (depends on the input: a stacked
    ``[N, d + 2, *F]`` tensor at run time) or a *constant*; operations on states are
    checked against the supported set here, so that nothing runs for an unsupported model.
    """
    graph = _trace(module, path)
    prefix = f"{path}." if path else ""
    is_state: Dict[torch.fx.Node, bool] = {}
    steps: List[Tuple[torch.fx.Node, Callable[[Dict[torch.fx.Node, Any]], Any]]] = []
    result: Optional[torch.fx.Node] = None
    source: Optional[torch.fx.Node] = None  # the input

    def unsupported(node: torch.fx.Node, what: str) -> UnsupportedModule:
        return UnsupportedModule(
            f"{_describe(path, module)}: {what} (fx node {node.name!r}) is not supported by "
            "the forward Laplacian"
        )

    def value(env: Dict[torch.fx.Node, Any], a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    for node in graph.nodes:
        args = node.args
        states = [a for a in node.all_input_nodes if is_state.get(a, False)]
        if node.op == "placeholder":
            if source is None:
                source = node
                is_state[node] = True
                continue
            if not args:
                raise unsupported(node, f"a second required input {node.target!r}")
            default = args[0]
            is_state[node] = False
            steps.append((node, lambda env, v=default: v))
            continue
        if node.op == "output":
            if not (isinstance(args[0], torch.fx.Node) and is_state.get(args[0], False)):
                raise unsupported(node, "an output that is not one tensor computed from the input")
            result = args[0]
            continue
        if node.op == "get_attr":
            is_state[node] = False
            steps.append((node, lambda env, t=node.target: _fetch_attr(module, t)))
            continue
        if not states:  # a constant computation (e.g. from parameters): run as it is
            is_state[node] = False
            steps.append((node, _constant_step(module, node, value)))
            continue
        is_state[node] = True
        steps.append((node, _state_step(module, node, states, prefix, value, unsupported)))
    if source is None or result is None:
        raise UnsupportedModule(f"{_describe(path, module)} has no input or no output")

    def run(state: Tensor) -> Tensor:
        env: Dict[torch.fx.Node, Any] = {source: state}
        for node, step in steps:
            env[node] = step(env)
        return env[result]

    return run


def _constant_step(module: nn.Module, node: torch.fx.Node, value: Callable) -> Callable:
    def step(env: Dict[torch.fx.Node, Any]) -> Any:
        args, kwargs = value(env, node.args), value(env, node.kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return module.get_submodule(node.target)(*args, **kwargs)

    return step


def _state_step(
    module: nn.Module,
    node: torch.fx.Node,
    states: List[torch.fx.Node],
    prefix: str,
    value: Callable,
    unsupported: Callable[[torch.fx.Node, str], UnsupportedModule],
) -> Callable:
    """The run-time step of a node that depends on the input (checked here)."""
    args, kwargs, target = node.args, node.kwargs, node.target
    if node.op == "call_module":
        if len(args) != 1 or kwargs or args[0] is not states[0]:
            raise unsupported(node, f"a call of {target!r} with other arguments than one state")
        plan = compile_module(module.get_submodule(target), f"{prefix}{target}")
        return lambda env: plan(env[states[0]])
    name = getattr(target, "__name__", repr(target)) if node.op == "call_function" else target
    if node.op not in ("call_function", "call_method"):
        raise unsupported(node, f"operation {node.op}")
    extra = args[1:]
    if target in FUNCTIONAL:
        if args[0] is not states[0] or len(states) != 1:
            raise unsupported(node, f"{name} of more than one state")
        if any(isinstance(a, torch.fx.Node) for a in (*extra, *kwargs.values())):
            raise unsupported(node, f"{name} with input-dependent extra arguments")
        factory = FUNCTIONAL[target]
        kw = {k: v for k, v in kwargs.items() if k != "inplace"}
        derivatives = factory(*extra, **kw)
        return lambda env: elementwise(derivatives, env[args[0]])
    if (kwargs and target not in _DIV) or (target in _DIV and set(kwargs) - {"rounding_mode"}):
        raise unsupported(node, f"{name} with keyword arguments {dict(kwargs)}")
    if target in _DIV and kwargs.get("rounding_mode") is not None:
        raise unsupported(node, f"{name} with rounding_mode")
    if target in _NEG and len(args) == 1:
        return lambda env: -env[args[0]]
    if len(args) != 2:
        raise unsupported(node, f"operation {name}")
    a, b = args
    a_state = isinstance(a, torch.fx.Node) and a in states
    b_state = isinstance(b, torch.fx.Node) and b in states
    if target in _ADD or target in _SUB:
        sign = 1 if target in _ADD else -1
        if a_state and b_state:
            return (lambda env: env[a] + env[b]) if sign == 1 else (lambda env: env[a] - env[b])
        if a_state:
            return lambda env: add_constant(env[a], sign * value(env, b))
        return lambda env: add_constant(sign * env[b], value(env, a))
    if target in _MUL:
        if a_state and b_state:
            return lambda env: product(env[a], env[b])
        s, c = (a, b) if a_state else (b, a)
        return lambda env: env[s] * broadcast_constant(value(env, c), env[s])
    if target in _POW and a_state and not b_state:  # z^p, p a constant number
        return lambda env: elementwise(power_rule(value(env, b)), env[a])
    if target in _DIV and a_state and not b_state:
        return lambda env: env[a] / broadcast_constant(value(env, b), env[a])
    raise unsupported(node, f"operation {name} on input-dependent tensors")
