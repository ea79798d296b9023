"""Gradient edges of recorded layer outputs, and the gradients they receive.

The capture engine (:mod:`curvature.capture`) records, for every layer call, the autograd
edge of each output; these helpers choose the edge (:func:`output_edge`), map a
received gradient back onto the output (:func:`assign_grads`), flatten a module's
inputs and outputs (:func:`leaves`) and check user-given result buffers
(:func:`check_out_buffer`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import get_gradient_edge
from torch.utils._pytree import tree_flatten

from .layers import Call
from .layers.base import REPLAYING


@dataclass(frozen=True)
class BaseView:
    """The output is this view of its base, whose edge was recorded instead."""

    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    numel: int

    def of(self, g: Tensor, lead: Tuple[int, ...]) -> Tensor:
        """The same view of the base's gradient ``g`` (with leading axes ``lead``)."""
        stride = (self.numel,) * len(lead) + self.stride
        return g.contiguous().as_strided((*lead, *self.size), stride, self.offset)


@dataclass(frozen=True)
class CheckedView:
    """The output is a view with its own edge: modified in place later, it detaches."""

    tensor: Tensor
    version: int

    def modified(self) -> bool:
        """Whether the view was modified in place since it was recorded."""
        return self.tensor._version != self.version


_SCALARS = (type(None), bool, int, float, str)


def leaves(obj: Any) -> List[Any]:
    """``tree_flatten(obj)[0]``, without its cost for a tensor or a flat tuple / list."""
    if type(obj) is Tensor:
        return [obj]
    if type(obj) in (tuple, list) and all(type(x) is Tensor or type(x) in _SCALARS for x in obj):
        return list(obj)
    return tree_flatten(obj)[0]


def assign_grads(c: Call, grads: Sequence[Optional[Tensor]], lead: Tuple[int, ...]) -> None:
    """Store the gradients received for a call's recorded edges as ``c.grads``.

    Missing gradients (unused outputs) become zeros; a gradient received on a view's base
    edge is mapped to the view.
    """
    c.grads = []
    for (shape, dtype, device), view, g in zip(c.out_meta, c.out_views, grads):
        if g is None:
            g = torch.zeros(*lead, *shape, dtype=dtype, device=device)
        elif isinstance(view, BaseView):  # take the view of the base's g
            g = view.of(g, lead)
        c.grads.append(g)


def check_views(calls: Sequence[Call]) -> None:
    """Raise if a recorded output view of ``calls`` was modified in place (after a pull)."""
    for c in calls:
        for view in c.out_views:
            if isinstance(view, CheckedView) and view.modified():
                raise RuntimeError(
                    "A layer output that is a view of another tensor was modified in "
                    "place after the layer (e.g. ReLU(inplace=True) on a reshaped "
                    "output), which detaches the recorded gradient edge. Use an "
                    "out-of-place op after this layer."
                )


def output_edge(t: Tensor, base_ok: bool):
    """The gradient edge to record for output ``t`` and how to map its gradient back.

    In-place ops on a *view* rebase the view's history, so the view's own edge would drop
    out of the graph. When the rule knows that the base of this output is used by nothing
    else (``base_ok``, e.g. the matmul result behind ``nn.Linear`` on ``[N, S, D]``) and
    ``t`` covers the whole (contiguous) base, the base's edge is recorded instead, with
    a :class:`BaseView` to take the same view of the base's gradient. Other views keep
    their edge with a :class:`CheckedView`, to raise a clear error if they are modified
    in place.
    """
    if t._is_view():
        base = t._base
        if (
            base_ok
            and base is not None
            and base.grad_fn is not None
            and base.is_contiguous()
            and base.numel() == t.numel()
        ):
            offset = t.storage_offset() - base.storage_offset()
            view = BaseView(tuple(t.shape), tuple(t.stride()), offset, t.numel())
            return get_gradient_edge(base), view
        return get_gradient_edge(t), CheckedView(t, t._version)
    return get_gradient_edge(t), None


def check_out_buffer(name: str, buf: Tensor, param: Tensor, N: int) -> None:
    """A ``ValueError`` unless ``buf`` can hold the per-sample results ``[N, *param.shape]``."""
    shape = (N, *param.shape)
    if (
        tuple(buf.shape) != shape
        or buf.dtype != param.dtype
        or buf.device != param.device
        or not buf.is_contiguous()
    ):
        raise ValueError(
            f"out[{name!r}] must be a contiguous {param.dtype} tensor of shape {shape} on "
            f"{param.device}; got {buf.dtype} {tuple(buf.shape)} on {buf.device}."
        )


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

    def __call__(self, module: nn.Module, *args: Any) -> Any:  # noqa: D102
        owner = self._owner() if self._owner is not None else None
        if owner is None or module is not (self._module() if self._module else None):
            return None
        # a rule replays the module per sample: not a forward of ours (never compiled)
        if not torch.compiler.is_compiling() and REPLAYING.get():
            return None
        return getattr(owner, self._method)(*self._extra, module, *args)

    def __deepcopy__(self, memo: dict) -> WeakHook:
        return WeakHook(None, self._method, None)  # bound to nothing: does nothing

    def __getstate__(self) -> dict:
        return {"_method": self._method}

    def __setstate__(self, state: dict) -> None:
        self._owner, self._module, self._method, self._extra = None, None, state["_method"], ()
