"""The backward hooks of :class:`~curvature.capture.Capture`'s push mode.

During the user's own backward, a pre-hook on the autograd node behind each output of a
recorded layer call keeps the gradient ``g`` at that output (the call's ``pending``
slot), and a hook on each parameter's gradient accumulation commits the layer's calls
once its ``.grad`` is complete. The hooks hold the capture and the call weakly: the
autograd graph keeps its hooks alive, and a strong reference would keep the call's
inputs and gradients alive through a cycle ``gc`` cannot see (it runs through C++).
"""

from __future__ import annotations

import weakref
from typing import Any

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
