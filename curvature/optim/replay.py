"""The loss of the step's own batch after the step: one more forward of the last training
forward, for the plain-loop quadratic rule's reduction ratio.

In a plain loop (``step()`` without a closure) the quadratic rule has the loss ``h(theta)``
of the batch the step was computed on (the user's ``loss_func`` call) and, after the move,
only the next batch's loss. On fresh data only the part of the batch gradient shared with
the population lowers the loss, so a ratio from the next batch is biased low once the
gradient noise dominates, and Levenberg-Marquardt then raises ``lambda`` without bound
(docs/optimizers.md, "The plain loop's reduction ratio"). The ratio of Martens & Grosse
(2015) and kfac-jax is measured on the same batch:

    rho = (h(theta + delta) - h(theta)) / M(delta).

:class:`ForwardReplay` keeps, for a step that adapts the damping (the others are never
replayed), what each training forward of the model since the last step needs to run
again: the root module, its positional and keyword arguments as passed (references, no
copies; the versions of their tensors), the states of the CPU, CUDA and Python
``random`` generators at its start (dropout and a LayerDrop draw the same), the versions
of the model's buffers, weak references to its output's tensors, and the ``loss_func``
calls that take one of them unchanged. :meth:`ForwardReplay.loss` runs those
whose losses the step's backward reached once more, under ``torch.no_grad`` with every
hook of the library muted, and restores the buffers of the model and of ``loss_func``
(by name: one re-assigned in the forward too) and Python's random state afterwards. The
cost is one forward per damping adaptation (every ``damping_adaptation_interval`` steps),
no backward.

The replayed loss is the measured one, ``sum_i w_i L_i`` over the ``loss_func`` calls a
backward reached (micro-batches of gradient accumulation included). The step is measured
on the next batch instead (as with ``reduction_ratio="next_batch"``) where a replay would
run another function or cannot run: a loss of a transformed output (a view, a slice, an
output changed in place), inputs changed in place since the forward (also a buffer the
loop reuses for the next batch) or computed from parameters (an unrolled cell's state),
a buffer the forward changed other than a train-mode BatchNorm's running statistics (a
running state), the model in another train/eval mode at ``step()``, an embedding with
``max_norm`` (it renormalizes its weight in every forward), a forward under autocast or
``torch.compile`` (a no-grad call would compile once more), an output on a device other
than a CPU or CUDA (its generator is not replayed), ``torch.distributed`` (a replay would
be one more collective forward). Not detected: random numbers from a generator of the
model's own (a ``torch.Generator`` it holds, NumPy) and state kept in plain attributes. A
forward that fails without gradients (one that differentiates inside ``forward``) or that
changes parameters in place turns the replay off for good, with one warning.
"""

from __future__ import annotations

import random
import weakref
from collections.abc import Mapping
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..layers.base import replaying
from ..layers.norm import uses_batch_statistics
from ..warn import warn


def autocast_on() -> bool:
    """Whether an autocast region is active (CPU or CUDA)."""
    try:
        return torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")
    except TypeError:  # torch < 2.4: no device argument
        return torch.is_autocast_enabled() or torch.is_autocast_cpu_enabled()


def _cuda_devices() -> List[int]:
    """The CUDA devices whose generators a replay restores (none before CUDA starts)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    return list(range(torch.cuda.device_count()))


def _items(obj: Any) -> List[Tuple[Tuple[Any, ...], Tensor]]:
    """The tensors of ``obj`` with where they sit: ``()`` for ``obj`` itself, ``(k,)`` for
    an element of a tuple / list / mapping.
    """
    if isinstance(obj, Tensor):
        return [((), obj)]
    items = obj.items() if isinstance(obj, Mapping) else None
    if items is None and isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    return [((k,), t) for k, t in items or () if isinstance(t, Tensor)]


def _tensors(obj: Any) -> List[Tensor]:
    """The tensors of ``obj``: itself, or the elements of a tuple / list / mapping."""
    return [t for _, t in _items(obj)]


def _places(output: Any) -> List[Tuple[Tuple[Any, ...], Any, int]]:
    """:func:`_items` of the output, each with a weak reference (a forward that no
    backward reaches keeps its graph alive no longer than before) and its version (a
    loss of an output changed in place is not replayable).
    """
    return [(k, weakref.ref(t), t._version) for k, t in _items(output)]


def _buffers(modules: List[nn.Module]) -> List[Tuple[nn.Module, str, Tensor]]:
    """Every buffer of ``modules`` with its owner and name (to restore by name)."""
    return [
        (m, name, b)
        for module in modules
        for m in module.modules()
        for name, b in m.named_buffers(recurse=False)
    ]


def _stateless(owner: nn.Module) -> bool:
    """Whether a buffer of ``owner`` that a forward changed leaves that forward's output
    as it was: a BatchNorm's running statistics where it normalizes with the batch's.
    """
    return uses_batch_statistics(owner)


class _Forward:
    """One recorded training forward: its call, the states that decide its output, where
    its output went (``loss_func`` calls).
    """

    __slots__ = ("module", "args", "kwargs", "inputs", "training", "buffers", "rng")
    __slots__ += ("devices", "places", "calls", "ok")

    def __init__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.module, self.args, self.kwargs = module, args, dict(kwargs or {})
        inputs = _tensors(args) + _tensors(self.kwargs)
        # an input computed from parameters (an unrolled cell's state) is stale after the
        # step: not replayable; inputs changed in place later neither (versions)
        self.ok = all(t.grad_fn is None for t in inputs)
        self.inputs = [(t, t._version) for t in inputs]
        self.training = module.training
        self.buffers = [(m, n, b, b._version) for m, n, b in _buffers([module])]
        self.devices = _cuda_devices()
        cuda = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.rng = (torch.get_rng_state(), cuda, random.getstate())
        self.places: Optional[list] = None  # where its output's tensors sit
        # its loss_func calls: (module, other args, other kwargs, where, position) and a
        # weak reference to the LossRecord (a loss no backward reaches is freed as before)
        self.calls: List[Tuple[tuple, Any]] = []

    def replayable(self) -> bool:
        """Whether its output would be the same now at the old parameters: its inputs and
        the buffers it reads unchanged since (a train-mode BatchNorm's running statistics
        aside), the model in the same mode.
        """
        unchanged = all(t._version == v for t, v in self.inputs)
        buffers = all(
            _stateless(m) or (getattr(m, n, None) is b and b._version == v)
            for m, n, b, v in self.buffers
        )
        return self.ok and unchanged and buffers and self.module.training == self.training

    def losses(self, kept: List[Any]) -> Tensor:
        """``sum weight_i loss_i`` of its ``loss_func`` calls whose records are in ``kept``
        at the current parameters, with the recorded random states (no grad, the
        library's hooks muted).
        """
        with torch.random.fork_rng(devices=self.devices), replaying(), torch.no_grad():
            torch.set_rng_state(self.rng[0])
            for d, state in zip(self.devices, self.rng[1]):
                torch.cuda.set_rng_state(state, d)
            random.setstate(self.rng[2])
            output = self.module(*self.args, **self.kwargs)
            total = None
            for (module, args, kwargs, where, position), ref in self.calls:
                record = ref()
                if not any(record is k for k in kept):
                    continue
                out = output
                for k in position:
                    out = out[k]
                if where == "input":
                    kwargs = {**kwargs, "input": out}
                else:
                    args = (out,) + args
                value = module(*args, **kwargs)
                if not isinstance(value, Tensor) or value.numel() != 1:
                    raise TypeError(f"loss_func returned {type(value).__name__}, not a scalar")
                term = value.detach().reshape(()).to(record.weight.dtype) * record.weight
                total = term if total is None else total + term
        return total


class ForwardReplay:
    """The training forwards of the model since the last step and their ``loss_func``
    calls (module docstring).

    The collector reports every training forward of the model (:meth:`started`,
    :meth:`ended`) and every ``loss_func`` call it counts for the quadratic rule
    (:meth:`loss_called`); the optimizer confirms which losses its backward reached
    (:meth:`confirm`), replays (:meth:`loss`) and forgets at the end of each step
    (:meth:`clear`). Forwards no backward reached (a training accuracy with grad on) and
    losses whose backward ran before ``zero_grad()`` are not among the confirmed ones and
    are not replayed, as they are not measured. Nothing is recorded unless
    :attr:`enabled` (the optimizer's plain-loop rule with ``reduction_ratio="same_batch"``
    in one process).
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.enabled = False
        # (a weak method of the optimizer) whether the coming step adapts: only then are
        # its forwards recorded, the others' would never be replayed
        self.wanted: Optional[Callable[[], Optional[Callable[[], bool]]]] = None
        self.broken = False  # a replay raised or changed parameters: off for good
        self.clear()

    def clear(self) -> None:
        """Forget the recorded forwards (at the end of each step)."""
        self.forwards: List[_Forward] = []
        self.plan: List[_Forward] = []  # the forwards to replay, once confirmed
        self.kept: List[Any] = []

    def started(self, module: nn.Module, args: Any, kwargs: Any, plain: bool = True) -> None:
        """A training forward of the model starts (the collector calls it where
        :attr:`enabled`): keep its inputs and RNG states if the coming step adapts
        (``plain``: not ``torch.compile``'s wrapper, which is not replayed; nor is a
        forward under autocast).
        """
        due = self.wanted() if self.wanted is not None else None
        if plain and not self.broken and (due is None or due()) and not autocast_on():
            self.forwards.append(_Forward(module, args, kwargs))

    def ended(self, module: nn.Module, output: Any) -> None:
        """Its output (a ``loss_func`` call must take it, or one element of it); on a
        device other than a CPU or CUDA (whose generators are not replayed) the forward
        is not replayable.
        """
        if self.forwards and self.forwards[-1].module is module:
            last = self.forwards[-1]
            if last.places is None:
                last.places = _places(output)
                last.ok &= all(t.device.type in ("cpu", "cuda") for t in _tensors(output))

    def loss_called(self, module: nn.Module, args: Any, kwargs: Any, record: Any) -> None:
        """A counted ``loss_func`` call with its :class:`~.pending.LossRecord`: kept with
        the recorded forward whose output (or an element of it) it takes unchanged; one
        that takes a transformed output (a view, a slice, an in-place change) is not
        replayable.
        """
        where, first = (0, args[0]) if args else ("input", kwargs.get("input"))
        if not isinstance(first, Tensor):
            return
        for forward in reversed(self.forwards):
            for position, ref, version in forward.places or ():
                if ref() is first and first._version == version:
                    rest = {k: v for k, v in kwargs.items() if k != "input"}
                    call = (module, tuple(args[1:]), rest, where, position)
                    forward.calls.append((call, weakref.ref(record)))
                    return

    def confirm(self, kept: List[Any]) -> None:
        """The losses the step's backward reached: the replay applies iff each of them is
        a recorded forward's ``loss_func`` call.
        """
        mine = [(f, ref()) for f in self.forwards for _, ref in f.calls]
        hits = [(f, r) for f, r in mine if any(r is k for k in kept)]
        plan = [f for f in self.forwards if any(f is g for g, _ in hits)]
        ok = bool(kept) and len(hits) == len(kept)
        self.plan, self.kept = (plan, list(kept)) if ok else ([], [])

    def loss(self, loss_modules: List[nn.Module]) -> Optional[Tensor]:
        """``sum_i weight_i loss_i`` of the confirmed losses at the current parameters
        (0-d, on the device; each with its backward's weight, as the measured loss has),
        or ``None`` when the step cannot be replayed now. The buffers of the model and of
        ``loss_modules``, and Python's random state, are restored afterwards.
        """
        if not self.plan or self.broken or not all(f.replayable() for f in self.plan):
            return None
        module = self.plan[0].module
        if any(getattr(m, "max_norm", None) is not None for m in module.modules()):
            return None  # an embedding with max_norm renormalizes its weight in the forward
        saved = [(m, n, b, b.clone()) for m, n, b in _buffers([module] + loss_modules)]
        versions = [(p, p._version) for p in module.parameters()]
        state = random.getstate()
        try:
            values = [f.losses(self.kept) for f in self.plan]
        except Exception as err:  # noqa: BLE001 (any failure: the next-batch ratio)
            self.broken = True
            warn(
                f"{self.who}(update_rule='quadratic'): the step's forward could not be run "
                f"again without gradients ({type(err).__name__}: {err}); the reduction ratio "
                "is measured on the next batch from now on."
            )
            return None
        finally:
            random.setstate(state)
            for m, n, b, copy in saved:
                if getattr(m, n, None) is not b:  # re-assigned in the forward
                    setattr(m, n, b)
                b.copy_(copy)
        if any(p._version != v for p, v in versions):
            self.broken = True
            warn(
                f"{self.who}(update_rule='quadratic'): the model's forward changed its "
                "parameters in place when run again without gradients; the reduction ratio "
                "is measured on the next batch from now on."
            )
        return sum(values[1:], values[0])
