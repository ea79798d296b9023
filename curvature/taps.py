"""Gradient taps: the capture's route through a ``torch.compile``'d forward.

In eager mode the capture records the autograd node of each layer output
(:mod:`curvature.edges`). A compiled forward has no such nodes: the whole graph is one
autograd function, and reading ``grad_fn`` inside it splits the graph. There the layer
hook instead routes each output ``z`` through :func:`tap`, a custom operator that dynamo
puts into the graph as one opaque node (no graph break):

- forward: ``tap(z, key)`` returns ``(z.clone(), ticket)``, where the *ticket* is a CPU
  ``int64`` scalar with a serial number drawn when the compiled forward runs (``0``
  when the capture does not record this forward), so every call of every compiled run
  is told apart;
- backward: the gradient ``g`` w.r.t. the tapped output goes through ``grab(g, ticket,
  key)``, which hands ``g`` to the receiver of ``key`` (the capture) with the ticket's
  serial, and passes a copy of it on unchanged.

The receiver pairs ``g`` with the layer inputs that the hook kept in a Python list
(dynamo replays such appends after the graph), by serial. Both operators copy their
tensor (an operator's output may not alias its input): one copy of each layer output and
of its gradient per step, and one more copy of the gradient that is kept (the compiled
backward may reuse the memory of its own tensors), the price of the graph staying whole.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Dict, Tuple

import torch
from torch import Tensor

__all__ = ["KEY_STRIDE", "receiver", "register_receiver", "tap"]

#: Keys of one receiver: ``base + position`` with ``0 <= position < KEY_STRIDE``.
KEY_STRIDE = 1 << 20
_BASES = itertools.count(1)
#: Key base to ``(weak receiver, method name)``; the receiver's method is called as
#: ``method(position, serial, g)`` in the backward and ``method(position)`` in the
#: forward (``True``: record this call).
_RECEIVERS: Dict[int, Tuple[weakref.ReferenceType, str, str]] = {}
_SERIAL = itertools.count(1)


def register_receiver(owner: Any, forward: str, backward: str) -> int:
    """A new key base for ``owner`` (held weakly); its taps use ``base + position``.

    ``owner.<forward>(position)`` says whether a tapped call records (a ticket is drawn);
    ``owner.<backward>(position, serial, g)`` receives the gradient of a recorded call.
    """
    base = next(_BASES) * KEY_STRIDE
    ref = weakref.ref(owner, lambda _, b=base: _RECEIVERS.pop(b, None))
    _RECEIVERS[base] = (ref, forward, backward)
    return base


def receiver(key: int) -> Tuple[Any, int, Callable[..., Any], Callable[..., Any]]:
    """``(owner, position, forward, backward)`` of ``key`` (``owner`` ``None`` if gone)."""
    base = key - key % KEY_STRIDE
    entry = _RECEIVERS.get(base)
    owner = entry[0]() if entry is not None else None
    if owner is None:
        return None, key - base, None, None
    return owner, key - base, getattr(owner, entry[1]), getattr(owner, entry[2])


@torch.library.custom_op("curvature::tap", mutates_args=())
def _tap(z: Tensor, key: int) -> Tuple[Tensor, Tensor]:
    owner, position, forward, _ = receiver(key)
    serial = next(_SERIAL) if owner is not None and forward(position) else 0
    return z.clone(), torch.tensor(serial, dtype=torch.int64)


@_tap.register_fake
def _(z: Tensor, key: int) -> Tuple[Tensor, Tensor]:
    return torch.empty_like(z), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("curvature::grab", mutates_args=())
def _grab(g: Tensor, ticket: Tensor, key: int) -> Tensor:
    serial = int(ticket)  # a CPU scalar: no device synchronization
    if serial:
        owner, position, _, backward = receiver(key)
        if owner is not None:
            # a private copy: the compiled backward may reuse the memory of its own
            # tensors (``g`` and this operator's output) once they are used up
            backward(position, serial, g.clone())
    return g.clone()


@_grab.register_fake
def _(g: Tensor, ticket: Tensor, key: int) -> Tensor:
    return torch.empty_like(g)


def _setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    ctx.key = inputs[1]
    ctx.save_for_backward(output[1])


def _backward(ctx: Any, g: Tensor, _ticket: Any) -> Tuple[Tensor, None]:
    (ticket,) = ctx.saved_tensors
    return torch.ops.curvature.grab(g, ticket, ctx.key), None


_tap.register_autograd(_backward, setup_context=_setup)


def tap(z: Tensor, key: int) -> Tuple[Tensor, Tensor]:
    """``(z', ticket)``: ``z'`` equals ``z``; its gradient goes to the receiver of ``key``.

    Args:
        z: A layer output ``[N, ...]`` that requires grad.
        key: ``base + position`` (:func:`register_receiver`), a constant of the graph.

    Returns:
        A copy of ``z`` to use in its place, and the ticket (a CPU ``int64`` scalar: the
        call's serial number, ``0`` when it is not recorded).

    """
    return torch.ops.curvature.tap(z, key)
