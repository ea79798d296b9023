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

:class:`ForwardReplay` keeps what each training forward of the model since the last step
needs to run again: the root module, its positional and keyword arguments (references,
no copies), the random number generators' states at its start (dropout draws the same
masks), and the ``loss_func`` calls on its output (the module, the other arguments,
where the output went). :meth:`ForwardReplay.loss` runs those whose losses the step's
backward reached once more, under ``torch.no_grad`` with every hook of the library muted,
and restores the model's buffers afterwards (a train-mode BatchNorm updates its running
statistics in the forward; the replay normalizes with the batch's statistics, as the
recorded forward did). The cost is one forward per damping adaptation (every
``damping_adaptation_interval`` steps), no backward.

The replayed loss is the measured one, ``sum_i w_i L_i`` over the ``loss_func`` calls a
backward reached (micro-batches of gradient accumulation included), when each of those
calls took a recorded forward's output as it is (a tensor, or one element of a tuple,
list or mapping such as Hugging Face's ``out.logits``). Otherwise (a loss of a
transformed output, a forward under autocast or ``torch.compile``, whose no-grad call
would compile once more), and under ``torch.distributed`` (a replay would be one more
collective forward), the step is measured on the next batch, as with
``reduction_ratio="next_batch"``. A forward that fails without gradients (one that
differentiates inside ``forward``) turns the replay off for good, with one warning.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ..layers.base import replaying
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


def _places(output: Any) -> List[Tuple[Tuple[Any, ...], Any]]:
    """Where the output's tensors sit (``()`` for the output itself, ``(k,)`` for an
    element of a tuple / list / mapping), each with a weak reference: a forward that no
    backward reaches keeps its graph alive no longer than before.
    """
    if isinstance(output, Tensor):
        return [((), weakref.ref(output))]
    items = output.items() if isinstance(output, Mapping) else None
    if items is None and isinstance(output, (tuple, list)):
        items = enumerate(output)
    return [((k,), weakref.ref(o)) for k, o in items or () if isinstance(o, Tensor)]


class _Forward:
    """One recorded training forward: its call, RNG states, output and loss calls."""

    __slots__ = ("module", "args", "kwargs", "cpu_rng", "devices", "cuda_rngs", "places")
    __slots__ += ("calls",)

    def __init__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.module, self.args, self.kwargs = module, args, dict(kwargs or {})
        self.devices = _cuda_devices()
        self.cuda_rngs = [torch.cuda.get_rng_state(d) for d in self.devices]
        self.cpu_rng = torch.get_rng_state()
        self.places: Optional[list] = None  # where its output's tensors sit
        # its loss_func calls: (module, args, kwargs, where, position) and the LossRecord
        self.calls: List[Tuple[tuple, Any]] = []

    def losses(self, kept: List[Any]) -> Tensor:
        """``sum weight_i loss_i`` of its ``loss_func`` calls whose records are in ``kept``
        at the current parameters, with the recorded random states (no grad, the
        library's hooks muted).
        """
        with torch.random.fork_rng(devices=self.devices), replaying(), torch.no_grad():
            torch.set_rng_state(self.cpu_rng)
            for d, state in zip(self.devices, self.cuda_rngs):
                torch.cuda.set_rng_state(state, d)
            output = self.module(*self.args, **self.kwargs)
            total = None
            for (module, args, kwargs, where, position), record in self.calls:
                if not any(record is k for k in kept):
                    continue
                out = output
                for k in position:
                    out = out[k]
                if where == "input":
                    kwargs = {**kwargs, "input": out}
                else:
                    args = (out,) + args[1:]
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
    are not replayed, as they are not measured.
    """

    def __init__(self, who: str) -> None:
        self.who = who
        self.broken = False  # a replay raised: off for good
        self.clear()

    def clear(self) -> None:
        """Forget the recorded forwards (at the end of each step)."""
        self.forwards: List[_Forward] = []
        self.plan: List[_Forward] = []  # the forwards to replay, once confirmed
        self.kept: List[Any] = []

    def started(self, module: nn.Module, args: Any, kwargs: Any, plain: bool = True) -> None:
        """A training forward of the model starts: keep its inputs and RNG states
        (``plain``: not ``torch.compile``'s wrapper, which is not replayed; nor is a
        forward under autocast).
        """
        if not self.broken and plain and not autocast_on():
            self.forwards.append(_Forward(module, args, kwargs))

    def ended(self, module: nn.Module, output: Any) -> None:
        """Its output (a ``loss_func`` call must take it, or one element of it)."""
        if self.forwards and self.forwards[-1].module is module:
            if self.forwards[-1].places is None:
                self.forwards[-1].places = _places(output)

    def loss_called(self, module: nn.Module, args: Any, kwargs: Any, record: Any) -> None:
        """A counted ``loss_func`` call with its :class:`~.pending.LossRecord`: kept with
        the recorded forward whose output (or an element of it) it takes; one that takes
        a transformed output (a view, a slice) is not replayable.
        """
        where, first = (0, args[0]) if args else ("input", kwargs.get("input"))
        if not isinstance(first, Tensor):
            return
        for forward in reversed(self.forwards):
            position = next((k for k, ref in forward.places or () if ref() is first), None)
            if position is not None:
                call = (module, tuple(args), dict(kwargs), where, position)
                forward.calls.append((call, record))
                return

    def confirm(self, kept: List[Any]) -> None:
        """The losses the step's backward reached: the replay applies iff each of them is
        a recorded forward's ``loss_func`` call.
        """
        plan = [f for f in self.forwards if any(r is k for _, r in f.calls for k in kept)]
        known = sum(1 for f in plan for _, r in f.calls if any(r is k for k in kept))
        ok = bool(kept) and known == len(kept)
        self.plan, self.kept = (plan, list(kept)) if ok else ([], [])

    def loss(self) -> Optional[Tensor]:
        """``sum_i weight_i loss_i`` of the confirmed losses at the current parameters
        (0-d, on the device; each with its backward's weight, as the measured loss has),
        or ``None`` when the step cannot be replayed. The model's buffers are restored.
        """
        if not self.plan or self.broken:
            return None
        buffers = [(b, b.clone()) for b in self.plan[0].module.buffers()]
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
            for b, saved in buffers:
                b.copy_(saved)
        return sum(values[1:], values[0])
