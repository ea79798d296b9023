"""Statistics collection for the curvature optimizers: what is captured, when, from where.

A :class:`StatisticsCollector` owns a :class:`~curvature.capture.Capture` on the model for
the optimizer's whole life, with callbacks at the start and end of every forward of the
model. What it collects depends on the Fisher type:

- ``"empirical"``: layer inputs from the forward and, through node pre-hooks, the
  gradients of the user's own ``loss.backward()`` w.r.t. each layer output. With
  ``g = c grad l_n`` (``c = R`` for a mean loss on one process), the statistics are
  ``c^2 sum g g^T`` (normalized in :mod:`.statistics`).
- ``"mc"``, ``"type-2"``, ``"rademacher"``: at the end of each training forward (or at
  :meth:`register_output`), the vectors of :func:`~curvature.losses.backprop_sources`
  are backpropagated on the existing graph in one batched call.
- ``"forward-only"``: inputs only, ``G = I``.

Each layer's calls go to the optimizer's ``accumulate(name, module, rule, calls, with_g,
emit)``, which calls ``emit((name, suffix), values, kinds, rows)`` per sum; the collector
adds the term number and the forward's :class:`BatchContext` (into :class:`StepStatistics`).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..capture import Capture
from ..cpu_heap import raise_mmap_threshold
from ..early_fold import FoldPlan, early_pays
from ..layers import ReplayRandomnessError
from ..losses import (
    backprop_sources,
    check_loss,
    ignored_targets,
    ignored_targets_message,
    reduction_scale,
)
from ..options import FisherType
from ..positionwise import model_layout
from ..sample_axis import by_forward, check_layer_samples, tag_forward, user_samples
from ..warn import warn
from .amp import ScalerSide
from .coverage import no_root_message, warn_joined_outputs
from .distributed import (
    Communicator,
    PendingReduction,
    finish_statistics_reduction,
    start_statistics_reduction,
)
from .empirical import EmpiricalSide
from .grad_resets import GradientResets
from .pending import PendingPulls, PendingStatistics, absorb, count_loss
from .replay import ForwardReplay
from .statistics import BatchContext, StepStatistics, normalize, promote

Accumulate = Callable[..., None]


class StatisticsCollector(EmpiricalSide, ScalerSide):
    """Captures the model's forwards and turns them into one step's statistics.

    Args:
        who: The optimizer's name, for messages.
        model: The (unwrapped) model.
        fisher: The Fisher type.
        loss_func: The loss module (``None``: a mean loss, ``"empirical"`` / ``"forward-only"``).
        mc_samples: Samples for ``"mc"`` / ``"rademacher"``.
        auto_output: Pull from the model output at the end of each training forward.
        accumulate: The optimizer's per-layer statistics function (module docstring).
        generator: The sampling generator (MC labels, Rademacher signs).
        comm: The communicator under ``torch.distributed`` (``None``: one process).
        ddp: The DDP wrapper of the model, if any (early reduction launch).
        grad_scaler: A ``torch.amp.GradScaler`` (its scale removed from empirical statistics).
        finish: Called as ``finish(flush)`` after the layers of each fold were accumulated
            (statistics of several layers at once: tied parameters); ``flush`` is ``False``
            for a layer committed inside the user's backward (more layers follow), ``True``
            when the forward's layers are all in; ``finish(None)`` when an error cut the
            fold short. A bound method, held weakly.

    Attributes:
        due: Whether this step collects statistics (``factor_every``); set by the optimizer.
        evaluating: Loss evaluations of a line search / damping adaptation in progress:
            their forwards are not recorded.
        stats: This step's :class:`StepStatistics`.

    """

    def __init__(
        self,
        who: str,
        model: nn.Module,
        fisher: FisherType,
        loss_func: Optional[nn.Module],
        mc_samples: int,
        auto_output: bool,
        accumulate: Accumulate,
        generator: torch.Generator,
        comm: Optional[Communicator] = None,
        ddp: Optional[nn.Module] = None,
        grad_scaler: Any = None,
        finish: Optional[Callable[[Optional[bool]], None]] = None,
        wrapper: Optional[nn.Module] = None,  # torch.compile's, if given
    ):
        self.who = who
        self.model = model
        self.fisher = fisher
        self.loss_func = loss_func
        self.mc_samples = mc_samples
        self.auto_output = auto_output
        # held weakly: a strong reference back would make a cycle that only the garbage
        # collector frees (after the hooks' weak handles are cleared: unremovable hooks)
        self._accumulate = weakref.WeakMethod(accumulate)
        self._finish = None if finish is None else weakref.WeakMethod(finish)
        self.generator = generator
        self.comm = comm
        self.ddp = ddp
        self.grad_scaler = grad_scaler
        self.due = True
        self.evaluating = False
        self.sink: Optional[Dict[str, list]] = None  # outputs of an update-rule evaluation
        self.losses, self.projections = [], None  # plain-loop quadratic rule (list: on)
        self.replay = ForwardReplay(who)  # its same-batch loss (recorded while it is on)
        self.closed = False
        self.stats = StepStatistics()
        if any(p.device.type == "cpu" for p in model.parameters()):
            raise_mmap_threshold()  # the step's statistics on fresh pages: see cpu_heap
        self.registered = False
        self.term = 0
        self.pending: Optional[PendingReduction] = None
        self.waiting: Optional[Any] = None  # a forward whose curvature backward is due
        self.staged: Optional[PendingStatistics] = None  # its output pull, until the loss
        self.staged_rng: Optional[Tensor] = None
        self.mode = "unknown"  # where the automatic backward starts: "loss" or "output"
        self.late_warned = self.graph_warned = self.axis_warned = False
        self.settled = self.cat_warned = False
        self.outside = False  # recording outside the user's torch.func transform
        self.unreplayable: set = set()  # layers whose per-sample replay draws random numbers
        self.tasks: set = set()  # graph tasks of this step's backward passes that accumulated
        self.positionwise = model_layout(model) is not None  # (a token MLP: sample_axis)
        self.root_seen = False  # a forward of the model itself ran
        self.per_sample = False  # statistics of squared per-sample gradients
        self.serial = 0  # training forwards seen (Call.forward)
        self.root_warned = False
        # BatchNorm in train mode: left out, its parameters get the plain gradient
        root = model if wrapper is None else wrapper  # torch.compile's wrapper: its hooks
        self.capture = Capture(root, unsupported="functorch", skip_batch_statistics=True)
        self.capture.attach()
        if fisher == FisherType.EMPIRICAL:
            self.capture.watch_backward(True, on_commit=self._committed)
        self.capture.on_forward(start=self._forward_start, end=self._forward_end)
        if self.pulls and auto_output and loss_func is not None:
            self.capture.watch_module(loss_func, end=self._loss_called)
        # automatic pulls wait for a backward through them; zero_grad() after it drops them
        self.unconfirmed = PendingPulls()
        self.confirming = self.pulls and auto_output and ddp is None
        self.resets = GradientResets()  # model.zero_grad() and the like: see there
        self.capture.watch_accumulation(self._accumulated)
        if loss_func is not None:
            self.capture.watch_module(loss_func, end=self._output_seen)
        if fisher == FisherType.EMPIRICAL and isinstance(loss_func, nn.CrossEntropyLoss):
            self.capture.watch_module(loss_func, end=self._check_targets)

    @property
    def pulls(self) -> bool:
        """Whether the optimizer runs the curvature backward itself (mc, type-2, rademacher)."""
        return self.fisher in (FisherType.MC, FisherType.TYPE2, FisherType.RADEMACHER)

    @property
    def layers(self) -> Dict[str, Tuple[nn.Module, Any]]:
        """Covered layer name to ``(module, rule)``."""
        return {n: (m, r) for n, m, r in self.capture.layers}

    def close(self) -> None:
        """Remove every hook and forget recorded calls."""
        self.closed = True
        self.capture.remove_hooks()
        self.capture.clear()

    def resume_recording(self) -> None:
        """Record the next forward iff this step is due and the collector is open."""
        self.capture.recording = self.due and not self.closed
        self.replay.clear()  # (called at the end of each step)

    # -- forward callbacks -------------------------------------------------------------
    def _forward_start(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        self.root_seen = True
        if self.closed:
            return
        if in_transform():  # the user's own torch.func call: nothing recorded until its end
            self.outside, self.capture.recording = self.capture.recording, False
            return
        if self.evaluating:
            self.capture.recording = False
            return
        self.settle()  # the previous forward's loss_func call never came
        if self.resets.reset():  # .grad reset since (model.zero_grad()): as zero_grad()
            with self.capture.computing():
                self.capture.take_pushed()
            self.gradients_zeroed()
        # empirical: fold the calls whose backward already ran (bounded memory under
        # gradient accumulation); calls still waiting for their backward stay.
        if self.fisher == FisherType.EMPIRICAL:
            self.consume_pushed()
        self.capture.recording = self.due and self.model.training
        if self.replay.enabled and self.model.training and torch.is_grad_enabled():
            self.replay.started(module, args, kwargs, self.capture.wrapper is None)

    def _forward_end(self, module: nn.Module, args: Any, output: Any) -> None:
        if in_transform():
            self.capture.recording = self.outside and not self.closed
            return
        if self.closed or self.evaluating:
            return
        self.replay.ended(module, output)
        if not (self.due and self.model.training and torch.is_grad_enabled()):
            return
        if self.fisher == FisherType.EMPIRICAL:  # its calls: their forward and N (the
            self.serial += 1  # user's backward may span forwards; pulls know their N)
            tag_forward(self.capture.calls.values(), self.serial, output)
        if self.fisher == FisherType.FORWARD_ONLY:
            self._consume(self.capture.active(), None)
            self.capture.clear()
            return
        if not self.pulls or not self.auto_output or self.registered:
            return
        # The curvature backward runs from the input of the user's own call of loss_func
        # (it sees the targets: ignored positions, and any transform of the output); if
        # loss_func is not called, from the model output. Which one the user does is
        # learned on the first training forward: that one is pulled from the output at
        # once into a staging area (kept if the loss never comes, replaced if it does).
        if self.mode == "output" or self.loss_func is None:
            self.run_output(output)
            return
        self.waiting = output
        if self.mode == "unknown" and isinstance(output, Tensor) and output.grad_fn is not None:
            self.staged = PendingStatistics(self.projections is not None)
            self.staged_rng = self.generator.get_state()  # restored if it is replaced
            self.pull(output, self.loss_func, None, keep_calls=True, stats=self.staged)

    def _loss_called(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """The user called ``loss_func``: pull from its input, with its target."""
        if self.closed or self.evaluating or self.registered or self.waiting is None:
            return
        if not (self.due and self.model.training and torch.is_grad_enabled()):
            return
        values = list(args) + [kwargs[k] for k in ("input", "target") if k in kwargs]
        if len(values) < 2 or not isinstance(values[0], Tensor) or values[0].grad_fn is None:
            return
        if not self.capture.reaches(values[0]):  # another model's loss, a detached copy
            return
        if self.staged is not None:  # the staged pull never happened, draws included
            self.generator.set_state(self.staged_rng)
        if self.settled and not self.cat_warned:  # an earlier forward of this step pulled
            self.cat_warned = warn_joined_outputs(self.who, values[0], self.waiting)
        self.staged, self.waiting, self.mode = None, None, "loss"
        self.pull(values[0], module, values[1], keep_calls=False, stats=self._auto_stats())
        self._launch_early()

    def _output_seen(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        """A ``loss_func`` call: keep its input (:attr:`sink`) or value (``projections``)."""
        values = list(args) + [kwargs[k] for k in ("input", "target") if k in kwargs]
        if self.closed or len(values) < 2 or getattr(values[0], "grad_fn", None) is None:
            return
        if self.sink is not None:
            self.sink["called"].append((values[0], module, values[1]))
        elif self.projections is not None and self.model.training and not self.evaluating:
            if isinstance(output, Tensor) and output.numel() == 1 and output.requires_grad:
                record = count_loss(self, output, values[0], self.loss_scale)  # at backward
                self.replay.loss_called(module, args, kwargs, record)

    def settle(self) -> None:
        """Finish the curvature backward of a forward whose ``loss_func`` call never came.

        Before the next forward and at ``step()``: a staged pull (first forward) is kept
        and the model output is used from now on; in ``"loss"`` mode the waiting output
        is pulled now if its graph still exists, else this forward has no statistics
        (one warning) and the output is used from now on.
        """
        output, self.waiting = self.waiting, None
        if output is None or self.closed or self.registered:
            self.staged = None
            return
        self.settled = True  # a forward of this step pulled without its loss_func call
        if self.staged is not None:
            staged, self.staged = self.staged, None
            self.capture.clear()  # the staged forward's calls
            if self.confirming and not staged.reached:  # no backward yet: which mode is open
                self.unconfirmed.items.append(staged)
                return
            absorb(self.stats, self.projections, staged)
            self.mode = "output"
            self._launch_early()
            return
        try:
            self.run_output(output)
        except RuntimeError as err:
            if "freed" not in str(err):
                raise
            self.mode = "output"
            self.capture.clear()
            warn(
                f"{self.who}(fisher={self.fisher.value!r}): loss_func was not called on "
                "this forward's output before its backward, so its curvature backward was "
                "skipped; from now on it runs at the end of each forward (without targets)."
            )

    def run_output(self, output: Any) -> None:
        """Pull from the model output (without targets)."""
        if not isinstance(output, Tensor) or output.grad_fn is None:
            raise ValueError(
                f"{self.who}(fisher={self.fisher.value!r}): the model output is not a "
                "tensor with a graph and loss_func was not called on a tensor computed from "
                "it; call the loss_func you passed on the output (e.g. "
                "loss_func(out.logits, y)), or name the curvature outputs with "
                "optim.register_output(output, loss_func) and pass auto_output=False."
            )
        self.pull(output, self.loss_func, None, keep_calls=False, stats=self._auto_stats())
        self._launch_early()

    def _auto_stats(self) -> StepStatistics:
        """Where an automatic pull's statistics go: held until a backward reaches it."""
        return self.unconfirmed.new(self.projections is not None) if self.confirming else self.stats

    def _accumulated(self, param: Optional[Tensor] = None, drop: bool = False) -> None:
        """A backward accumulated ``param.grad``: the pulls it reached count (``drop``: the
        rest go); the first such parameter witnesses the step's gradients (grad_resets).
        """
        if param is not None:  # this pass accumulates: the pulls it reached count
            self.resets.filled(param)
            self.tasks.add(torch._C._current_graph_task_id())
        if self.confirming:
            self.unconfirmed.confirm(self.stats, self.projections, drop, self.tasks)

    def gradients_zeroed(self) -> None:
        """``zero_grad()``: drop the statistics whose gradients were just zeroed.

        Empirical: everything folded so far. The automatic pulls of mc / type-2 /
        rademacher: those of forwards whose backward already ran (a forward whose backward
        comes after ``zero_grad()`` still counts). So do the quadratic rule's losses.
        """
        self.losses.clear()  # (their backward ran: a validation gradient, say)
        self.resets.forget()
        if self.fisher == FisherType.EMPIRICAL:
            self.discard()
        elif self.confirming:
            self.stats.drop_queue()
            self.stats.take()
            if self.projections is not None:
                self.projections.clear()
            self.unconfirmed.forget_reached()
            if self.staged is not None and self.staged.reached:
                self.staged, self.waiting = None, None
                self.capture.clear()

    # -- curvature backward --------------------------------------------------------------
    def register_output(
        self, output: Tensor, loss_func: Optional[nn.Module], target: Optional[Tensor]
    ) -> None:
        """See :meth:`curvature.optim.base.CurvatureOptimizer.register_output`."""
        if self.fisher in (FisherType.EMPIRICAL, FisherType.FORWARD_ONLY):
            raise ValueError(
                f"register_output is for fisher in ('mc', 'type-2', 'rademacher'); this "
                f"optimizer uses fisher={self.fisher.value!r}."
            )
        loss_func = loss_func if loss_func is not None else self.loss_func
        if self.evaluating:  # loss evaluations of a line search / damping adaptation
            if self.sink is not None and loss_func is not None:
                self.sink["registered"].append((output, loss_func, target))
            return
        if loss_func is None:
            raise ValueError("register_output(output) needs a loss_func.")
        check_loss(loss_func)
        if not self.registered:
            self.waiting = self.staged = None
            self.discard()
            self.registered = True
            self.term = 0
        if self.due:
            self.pull(output, loss_func, target, keep_calls=True)
        self.term += 1

    def pull(
        self,
        output: Tensor,
        loss_func: nn.Module,
        target: Optional[Tensor],
        keep_calls: bool,
        stats: Optional[StepStatistics] = None,
    ) -> None:
        """Backpropagate the Fisher's vectors from ``output``; fold the reached calls.

        ``keep_calls``: registered outputs may share layer calls (two heads of one
        forward), so calls stay until ``step()``; the automatic output owns its forward.
        A non-finite output gives non-finite contributions, skipped (and counted) by the
        statistics' flush; an empty batch (``N = 0``) gives none. ``stats``: where the
        statistics go (default: this step's).
        """
        if output.dim() and output.shape[0] == 0:  # an empty batch: no statistics
            return
        stats = self.stats if stats is None else stats
        ignored = ignored_targets(loss_func, target)
        if ignored is not None:  # read at the next refresh (the statistics are skipped)
            stats.require_false(ignored, ignored_targets_message(loss_func))
        kw = dict(mc_samples=self.mc_samples, generator=self.generator, check_targets=False)
        V = backprop_sources(loss_func, output, target, self.fisher.value, **kw)
        N = output.shape[0] if output.dim() else 1
        reduction = getattr(loss_func, "reduction", "mean")
        # G-like sums are kept as raw per-sample sums: the sources carry sqrt(R(N)).
        context = BatchContext(N, reduction, 1.0 / reduction_scale(loss_func, N))

        def fold(name, module, rule, calls):  # inside the pull (curvature.early_fold)
            self._consume([(name, module, rule, calls)], context, flush=False, stats=stats)

        plan = FoldPlan(fold, take=not keep_calls, worth=early_pays)
        try:
            self.capture.pull(output, V, is_grads_batched=True, unreached="skip", fold=plan)
        except BaseException:
            stats.drop_queue()
            raise
        del V  # alive as long as the calls' g that alias it (each goes once folded)
        self._consume(self.capture.reached(take=not keep_calls), context, stats=stats)
        if isinstance(stats, PendingStatistics):
            stats.watch(output)  # after the pull, whose own backward would fire the hook

    def _consume(
        self,
        calls: Sequence[Tuple[str, nn.Module, Any, list]],
        context: Any,
        flush: bool = True,
        stats: Optional[StepStatistics] = None,
    ) -> None:
        """Fold calls (with ``grads`` set) into this step's statistics, then release them.

        ``context``: a :class:`BatchContext` for pulled gradients, ``"user"`` for the
        user's backward (``c grad l_n`` times the AMP scale), ``None`` for inputs only.
        """
        stats = self.stats if stats is None else stats
        finish = self._finish() if self._finish is not None else None
        try:
            with self.capture.computing():
                for name, module, rule, cs in calls:
                    cs = [c for c in cs if rule.batch_size(module, c) > 0]  # N = 0: nothing
                    user = context == "user"  # one backward, several forwards: each its own
                    for part in by_forward(cs) if user else ([cs] if cs else []):
                        self._fold(name, module, rule, part, context, stats)
                if finish is not None:
                    finish(flush)
            if flush:
                stats.flush()
        except BaseException:
            if finish is not None:
                finish(None)
            stats.drop_queue()
            raise

    def _fold(self, name, module, rule, cs, context, stats) -> None:
        """Fold one forward's calls of a layer (:meth:`_consume`)."""
        ctx, with_g = self._prepare(module, rule, cs, context)
        if with_g and (self.per_sample or not self.axis_warned):  # (curvature.sample_axis)
            layer, user = (name, module, rule, cs), context == "user"
            args = (self.who, self.fisher.value, self.per_sample, user, ctx.samples, layer)
            self.axis_warned = check_layer_samples(*args, self.axis_warned, self.positionwise)
        term = self.term if self.registered else 0
        records = getattr(stats, "projections", self.projections)
        if records is not None and isinstance(context, BatchContext):
            records.append((ctx, term, name, rule.expanded_blocks(module, cs)))

        def emit(key, values, kinds, rows=0, owned=False, _ctx=ctx, _term=term):
            stats.add((*key, _term), values, kinds, _ctx, rows, owned)

        try:
            if name not in self.unreplayable:
                self._accumulate()(name, module, rule, cs, with_g, emit)
        except ReplayRandomnessError as err:  # a container's own parameters, dropout inside:
            self.unreplayable.add(name)  # no statistics from now on (the plain gradient)
            where = repr(name) if name else "<model>"
            warn(
                f"{self.who}: no curvature for layer {where}: {err} Until then they get the "
                "plain gradient (lr, momentum, weight_decay)."
            )
        for c in cs:  # this layer's g (and operands made of them) go now
            c.grads = c.plain = c.expanded = None

    def _prepare(self, module, rule, cs, context) -> Tuple[BatchContext, bool]:
        if context == "user":
            inv = self._inverse_loss_scale()
            for c in cs:
                c.grads = [
                    (promote(g) if inv is None else promote(g) * inv.to(g.device)).unsqueeze(0)
                    for g in c.grads
                ]
            reduction = getattr(self.loss_func, "reduction", "mean")
            N = user_samples(rule.batch_size(module, cs[0]), cs[0].forward)
            return BatchContext(N, reduction, 1.0, True), True
        if context is None:
            return BatchContext(rule.batch_size(module, cs[0])), False
        for c in cs:
            if c.grads is not None:
                c.grads = [promote(g) for g in c.grads]
        return context, True

    # -- the step ------------------------------------------------------------------------
    def begin_step(self) -> None:
        """At ``step()``: fold the last backward's calls and forget the rest."""
        if self.fisher == FisherType.EMPIRICAL:
            self.consume_pushed()
        self.warn_no_root()
        self.settle()  # a forward whose loss_func call never came
        self._accumulated(drop=True)  # a forward no backward reached does not count
        self.tasks = set()  # (the step's accumulating backward passes)
        self.stats.flush()
        if self.amp_unscale is not None:  # a GradScaler's s, not given: 1 / s^2 now
            self.stats.scale_empirical(self.amp_unscale)
            self.amp_unscale = None
        self.capture.clear()  # calls whose backward never came (or kept for registration)

    def warn_no_root(self) -> None:
        """One warning when layers ran but the model never did (mc, type-2, rademacher).

        Their curvature backward starts at the end of a forward of the model the
        optimizer was built on; a loop that calls a submodule instead (a LightningModule
        whose ``training_step`` calls ``self.net(x)``) would get no statistics.
        """
        if self.root_seen or self.root_warned or self.registered or not self.pulls:
            return
        if self.auto_output and any(self.capture.calls.values()):
            self.root_warned = True
            warn(no_root_message(self.who, self.fisher.value, self.model))

    def finalize(self, default_dtype: torch.dtype) -> Dict[Any, list]:
        """The step's statistics, reduced over the ranks and normalized (``{}``: none)."""
        out: Dict[Any, list] = {}
        if self.due and (self.stats or self.comm is not None):
            stats = self.stats.take()
            if self.comm is not None:
                stats = finish_statistics_reduction(
                    self.comm, start_statistics_reduction(self.comm, stats, default_dtype)
                )
                if self.pending is not None:  # launched early: add the two global parts
                    early = finish_statistics_reduction(self.comm, self.pending)
                    self.pending = None
                    for key, st in stats.items():
                        early[key] = early[key].merge(st) if key in early else st
                    stats = early
            world = 1 if self.comm is None else self.comm.world
            out = normalize(stats, world, ordered=self.comm is not None)
        self.stats.take()
        self.registered = False
        self.term = 0
        self.settled = False
        return out

    def _launch_early(self) -> None:
        """Overlap the statistics all-reduce with the backward when they are final.

        Under DDP, ``require_backward_grad_sync`` is ``False`` inside ``no_sync()``; a
        training forward outside it is the step's last micro-batch, whose pulled statistics
        are complete at its end: their reduction runs during the user's backward (those of
        any later forward are reduced at ``step()`` and added).
        """
        if self.comm is None or self.ddp is None or self.pending is not None:
            return
        if not getattr(self.ddp, "require_backward_grad_sync", False):
            return
        self.stats.flush()
        self.pending = start_statistics_reduction(
            self.comm, self.stats.take(), self.default_dtype()
        )

    def discard(self) -> None:
        """Drop this step's statistics (and a reduction in flight, after it completes)."""
        if self._finish is not None and self._finish() is not None:
            self._finish()(None)  # and what tied layers kept for the forward's end
        if self.pending is not None:
            finish_statistics_reduction(self.comm, self.pending)
            self.pending = None
        self.stats.drop_queue()
        self.stats.take()
        self.unconfirmed = PendingPulls()

    def default_dtype(self) -> torch.dtype:
        """float64 for float64 models, else float32."""
        p = next((p for p in self.model.parameters() if p.requires_grad), None)
        return torch.float64 if getattr(p, "dtype", None) == torch.float64 else torch.float32


def in_transform() -> bool:
    """Inside a ``torch.func`` transform (``vmap``, ``grad``: the user's own per-sample
    gradients of the model): its forwards are not recorded (their tensors cannot leave it).
    """
    return torch._C._are_functorch_transforms_active()
