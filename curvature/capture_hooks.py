"""The backward hooks of :class:`~curvature.capture.Capture`'s push mode.

During the user's own backward, a pre-hook on the autograd node behind each output of a
recorded layer call keeps the gradient ``g`` at that output (the call's ``pending``
slot), and a hook on each parameter's gradient accumulation commits the layer's calls
once its ``.grad`` is complete. The hooks hold the capture and the call weakly: the
autograd graph keeps its hooks alive, and a strong reference would keep the call's
inputs and gradients alive through a cycle ``gc`` cannot see (it runs through C++).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .capture_traced import receive_pushed
from .layers import Call


class HookedCall:
    """What a call's backward pre-hooks hold: the call, weakly, and whether it was handed out.

    The autograd nodes keep their hooks as long as the graph lives, and the call holds
    edges to those nodes: a strong reference would make a cycle through C++ (which
    ``gc`` cannot collect) and keep the call's inputs and gradients alive after they
    were consumed.
    """

    __slots__ = ("call", "handed_out")

    def __init__(self, call: Call):
        self.call = weakref.ref(call)
        self.handed_out = False


def make_prehook(ref: weakref.ReferenceType[Any], box: HookedCall, j: int, output_nr: int):
    """A pre-hook for the node behind output ``j`` of ``box``'s call (``output_nr`` of it)."""

    def prehook(grad_outputs):
        cap = ref()
        if cap is None or not cap.pushing:
            return None
        g = grad_outputs[output_nr]
        if g is None or batched(g):  # a batched backward (is_grads_batched: a Hessian
            return None  # trace, a Laplacian) never accumulates into .grad
        call = box.call()
        if call is not None:  # handed out already (pending None): counted as late
            receive_pushed(cap, call, j, g)
        else:  # a call dropped after hand-out or unconsumed: nothing to keep
            cap.graph_gradients += int(g.requires_grad)
            cap.late_gradients += int(box.handed_out)
        return None

    return prehook


def batched(g: Tensor) -> bool:
    """Whether ``g`` is a batched tensor of ``vmap`` or of ``is_grads_batched``'s engine."""
    f = torch._C._functorch
    return f.is_batchedtensor(g) or f.is_legacy_batchedtensor(g)


def make_commit_hook(ref: weakref.ReferenceType[Any], name: str):
    """A hook on the gradient accumulation of a parameter of layer ``name``: commit it."""

    def hook(param: Tensor) -> None:
        cap = ref()
        if cap is not None:
            cap.commit(name)

    return hook


def positional_input(module: Any, args: tuple, kwargs: Dict[str, Any]) -> Tuple[tuple, dict]:
    """``(args, kwargs)`` of a call with the forward's first input moved into ``args``
    where it came by keyword (``linear(input=x)``): the rules read it as ``args[0]``.
    """
    if args or not kwargs:
        return args, kwargs
    name = _first_input(type(module))
    if name is None or name not in kwargs:
        return args, kwargs
    rest = dict(kwargs)
    return (rest.pop(name),), rest


@functools.cache
def _first_input(cls: type) -> Optional[str]:
    """The name of ``cls.forward``'s first parameter after ``self`` (``None``: none)."""
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return params[0].name if params and params[0].kind in kinds else None
