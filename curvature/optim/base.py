"""The ``torch.optim`` contract and the step skeleton of the curvature optimizers.

A :class:`CurvatureOptimizer` is a ``torch.optim.Optimizer`` over the model's trainable
parameters. Its parts, one job each:

- :mod:`.config`: the structure arguments, validated once (:class:`CurvatureConfig`);
- :mod:`.collector`: what is captured from the user's forwards and backwards, and when;
- :mod:`.groups`: the param groups' checks and the report of uncovered parameters;
- :mod:`.statistics`: one step's sums and their normalization;
- :mod:`.distributed`: everything that crosses ranks;
- :mod:`.updates`: momentum, weight decay, KL clipping, line search, damping adaptation;
- :mod:`.amp`: a ``GradScaler``'s loss scale and inf check, handed to ``step()``;
- the subclasses (:class:`~curvature.KFAC`, :class:`~curvature.EKFAC`,
  :class:`~curvature.DiagonalNaturalGradient`): the curvature blocks, how statistics fold
  into them, their refresh and the preconditioning.

One ``step()``: fold the last backward's statistics (reduced over the ranks, normalized)
into the running estimates every ``factor_every`` steps; refresh decompositions every
``inverse_every`` steps; precondition the flat gradient; update the parameters.

For ``"empirical"`` the optimizer sees the user's gradients ``c grad l_n`` and assumes
that ``.grad`` (averaged over the ``W`` ranks) is the gradient of ``loss_func`` over the
union of the step's forwards, i.e. ``c = W R(N)``: a plain mean loss on one process;
``loss / k`` over ``k`` equal micro-batches; on ``W`` ranks with batches ``N_r``, ``W / N
* sum_n l_n`` on each rank (for equal ``N_r`` the local mean).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..blocks.gather import BlockGather
from ..blocks.running import batched_ema
from ..capture import compiled_wrapper, unwrap_model
from ..foreach import FlatBuffer
from ..layer_stats import block_name
from ..layout import DeviceIndices, ParamLayout, ParamSharing
from ..options import Unsupported
from ..rng import SamplingGenerators
from ..subnormals import flushing
from ..warn import warn
from .amp import scaled_step_skipped
from .checkpoint import check_param_state, refuse
from .collector import StatisticsCollector
from .config import CurvatureConfig, check_hyperparameters
from .coverage import no_statistics_message, replaced_message
from .deferred import DeferredReads
from .distributed import Communicator, check_not_sharded, flat_gradients, is_ddp
from .groups import ParamGroups
from .quadratic import QuadraticRule
from .stale_clip import StaleClip
from .stale_clip import check_state as check_stale_state
from .ties import TiedLayers
from .updates import (
    ParamSlot,
    apply_update,
    damping_factor,
    line_search,
    loss_only,
    reduction_ratio,
)
from .watch import GroupIndex, ModelWatch


class CurvatureOptimizer(ParamGroups, QuadraticRule, Optimizer):
    """Base class: the ``torch.optim`` contract, statistics collection, ``step`` skeleton.

    Subclasses implement :meth:`_accumulate` (a layer's statistics), :meth:`_update_curvature`
    (fold one step's statistics into the running estimates), :meth:`_refresh`
    (decompositions), :meth:`_precondition` (gradients to update directions) and the
    state methods.
    """

    #: ``GradScaler.step(optim)`` hands the loss scale and its inf check to ``step()``
    #: unless the scaler was given (as ``grad_scaler``: :mod:`.amp`)
    _step_supports_amp_scaling = property(lambda self: self.config.grad_scaler is None)
    #: Whether the preconditioner ages between refreshes (``KFAC``, ``EKFAC``): then the
    #: config's ``stale_clip`` bounds the directions in between (:mod:`.stale_clip`).
    stale_inverses = False
    #: Whether the statistics square per-sample gradients (``DiagonalNaturalGradient``,
    #: ``EKFAC``): then every layer's sample axis must hold the loss's samples
    #: (:mod:`curvature.sample_axis`).
    _per_sample_statistics = False

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        damping: float,
        momentum: float,
        weight_decay: float,
        config: CurvatureConfig,
        param_groups: Optional[Sequence[Dict[str, Any]]] = None,
    ):
        who = config.who
        if not isinstance(model, nn.Module):
            raise ValueError(f"{who}(model={type(model).__name__}): model must be an nn.Module.")
        check_hyperparameters(who, lr, damping, momentum, weight_decay)
        check_not_sharded(model, who)
        self.config = config
        process_group = config.process_group
        if process_group is None and is_ddp(model):
            process_group = model.process_group
        self._comm = Communicator.create(
            config.distributed, process_group, config.comm_timeout, config.bucket_mb, who
        )
        # DDP averages the gradients itself; a plain model under torch.distributed is
        # treated as replicated data parallelism and its gradients are averaged here.
        self.sync_grads = (not is_ddp(model)) if config.sync_grads is None else config.sync_grads
        self._ddp, self._compiled = (model if is_ddp(model) else None), compiled_wrapper(model)
        self.model = unwrap_model(model)
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        groups: Any = (
            [{"params": trainable}] if param_groups is None else list(map(dict, param_groups))
        )
        super().__init__(groups, defaults)  # checks each group with add_param_group
        self._check_quadratic(None)
        self.last_line_search_lr: Optional[float] = None
        self.last_reduction_ratio: Optional[float] = None
        self._kl_scale, self._damping_cache = 1.0, (None, None)  # device values, read lazily
        # between two refreshes, directions are clipped to stale_clip x those of the last
        # refresh step (KFAC, EKFAC: their inverses age; curvature.optim.stale_clip)
        clips = self.stale_inverses and config.stale_clip is not None
        self._stale = StaleClip(config.stale_clip) if clips else None
        self._reads = DeferredReads(type(self).__name__)  # device values read later
        self._ix = DeviceIndices()  # index tensors on the gradients' device, copied once
        self.last_step_taken = True  # False: the line search kept the parameters
        self._gather = BlockGather()  # preconditioning: persistent gather/scatter buffers
        self._watch, self._groups = ModelWatch(), GroupIndex()  # cheap per-step checks
        # the step's gradients and directions, reused (the update selects in place of the
        # directions: no third [P] buffer)
        self._flat = (FlatBuffer(), FlatBuffer())
        self.generator = torch.Generator().manual_seed(config.seed)
        self._generators = SamplingGenerators(self.generator)  # one per device
        self.steps = 0
        self._skipped_before = 0
        self._closed = False
        # The hooks go when this optimizer is collected. A finalizer on this object, not
        # ``__del__``: an object of a subclass that shares or forwards its attributes
        # (Lightning's LightningOptimizer) inherits ``__del__`` and would remove the hooks
        # of the live optimizer when it is collected.
        self._live = [None]  # the current collector (replaced by a rebuild)
        weakref.finalize(self, _close_collector, self._live)
        self._build()
        self._check_coverage()
        self._reseed()

    # -- configuration, read-only ------------------------------------------------------------
    fisher = property(lambda self: self.config.fisher, doc="The Fisher type.")
    loss_func = property(lambda self: self.config.loss_func, doc="The loss module or None.")
    kl_clip = property(lambda self: self.config.kl_clip, doc="The KL clipping bound or None.")
    stale_clip = property(
        lambda self: None if self._stale is None else self._stale.ratio,
        doc="The stale-inverse clip ratio or None (curvature.optim.stale_clip).",
    )
    factor_every = property(lambda self: self.config.factor_every, doc="Statistics period.")
    inverse_every = property(lambda self: self.config.inverse_every, doc="Refresh period.")
    line_search_grid = property(lambda self: self.config.line_search_grid, doc="Grid or None.")
    unsupported = property(lambda self: self.config.unsupported, doc="Uncovered parameters.")

    @property
    def skipped_statistics(self) -> int:
        """Contributions skipped as non-finite (a device read; warns of skipped updates)."""
        self._reads.read_updates()
        return self._skipped_before + self._collector.stats.skipped

    @skipped_statistics.setter
    def skipped_statistics(self, value: int) -> None:
        self._skipped_before = int(value) - self._collector.stats.skipped

    skipped_updates = property(
        lambda self: self._reads.read_updates(),
        doc="Steps whose update was skipped (non-finite) for some parameter (a device read).",
    )
    last_kl_scale = property(lambda self: float(self._kl_scale), doc="The last KL factor (a read).")

    # -- distributed -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The rank of this process among the optimizer's ranks (0 without torch.distributed)."""
        return 0 if self._comm is None else self._comm.rank

    @property
    def world_size(self) -> int:
        """The number of ranks the statistics are averaged over (1 on one process)."""
        return 1 if self._comm is None else self._comm.world

    @property
    def bytes_communicated(self) -> Dict[str, int]:
        """Bytes this rank put into collectives so far, by purpose (empty on one process)."""
        return {} if self._comm is None else dict(self._comm.bytes)

    def _reseed(self) -> None:
        """On several ranks: a sampling generator per (seed, step, rank): each rank draws
        its own MC labels / Rademacher signs, and a run resumed from a ``state_dict`` saved
        on any one rank continues the same draws on every rank.
        """
        if self._comm is not None:
            mixed = ((self.config.seed * 1_000_003 + self.steps) * 4099 + self._comm.rank) % 2**62
            self._generators.manual_seed(mixed)

    def _global_loss(self, value: float) -> float:
        """A closure's loss, averaged over the ranks (identical decisions everywhere)."""
        return value if self._comm is None else self._comm.mean(value)

    # -- structure ---------------------------------------------------------------------------
    def _build(self) -> None:
        """The parameter layout and the statistics collector (with its hooks)."""
        self.layout = ParamLayout.of(self.model)
        self._tied = TiedLayers(self.layout, self.diagonal_suffix)  # layers sharing parameters
        old = getattr(self, "_collector", None)
        self._collector = StatisticsCollector(
            type(self).__name__,
            self.model,
            self.config.fisher,
            self.config.loss_func,
            self.config.mc_samples,
            self.config.auto_output,
            self._accumulate_layer,
            self._generators,
            self._comm,
            self._ddp,
            self.config.grad_scaler,
            finish=self._tied.finish,
            wrapper=self._compiled,
        )
        self._plain_records()  # the quadratic rule's projections, losses, replay
        self._collector.per_sample = self._per_sample_statistics
        if old is not None:  # its skipped count; the losses that measure the last step
            self._skipped_before += old.stats.skipped
            self._collector.losses = old.losses
        self._live[0] = self._collector
        self._layers = self._collector.layers
        self._tied.sharing = ParamSharing(
            self.model, [(n, m, r.param_names(m)) for n, (m, r) in self._layers.items()]
        )

    def _warn_missing(self, keys: List[Tuple[str, str]]) -> None:
        """One warning (after the first step) for the blocks ``(layer, suffix)`` without
        statistics, but those of layers the collector already reported (unreplayable).
        """
        names = [block_name(*k) for k in keys if k[0] not in self._collector.unreplayable]
        if names and self.steps > 0 and not self._warned_missing:
            self._warned_missing = True
            warn(no_statistics_message(type(self).__name__, names))

    def _check_trainable(self) -> None:
        """Rebuild (and reset the curvature) when parameters were frozen or unfrozen; refuse
        parameters replaced by new tensors (the groups hold the old ones: never trained).
        """
        if self._watch.unchanged():  # (the walk below costs ~0.1 ms on a ResNet-18)
            return
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        now = tuple(n for n, _ in named)
        held = dict(zip(self.layout.names, self.layout.params))
        if not self._closed and any(held.get(n, p) is not p for n, p in named):
            replaced = [n for n, p in named if held.get(n, p) is not p]
            raise ValueError(replaced_message(type(self).__name__, replaced))
        if now == self.layout.names or self._closed:
            self._watch.remember(self.model)
            return
        warn(
            f"{type(self).__name__}: the trainable parameters changed since the last step; the "
            "curvature estimates are reset and this step takes the plain gradient (-lr * grad; "
            "update_rule='quadratic': no move)."
        )
        self._collector.close()
        self._build()
        self._reset_curvature()
        self._watch.remember(self.model)

    #: The suffix of the statistics key of a group of tied layers' diagonal.
    diagonal_suffix = ""

    @property
    def _tied_diagonal(self) -> bool:
        """Whether tied layers get the exact Fisher diagonal of their summed gradients."""
        return self.config.unsupported == Unsupported.DIAGONAL

    def _accumulate_layer(self, name, module, rule, calls, with_g: bool, emit) -> None:
        """A layer's statistics (:meth:`_accumulate`); a tied layer's calls join its group."""
        if not self._tied.tied(name):
            self._accumulate(name, module, rule, calls, with_g, emit)
        elif self._tied_diagonal and with_g:
            self._tied.defer(name, module, rule, calls, emit)

    # -- lifecycle ---------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """``torch.optim.Optimizer.zero_grad``, and the statistics of the zeroed gradients.

        The statistics follow ``.grad``: a forward whose backward ran before
        ``zero_grad()`` does not count in the next step (a forward whose backward comes
        after it does; under DDP the automatic curvature backward counts at once).
        """
        super().zero_grad(set_to_none=set_to_none)
        if not self._closed:
            self._collector.gradients_zeroed()

    def close(self) -> None:
        """Remove every hook (the optimizer can still ``step`` with plain gradients)."""
        if getattr(self, "_closed", True):
            return
        self._collector.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- statistics ------------------------------------------------------------------------
    def register_output(
        self, output: Tensor, loss_func: Optional[nn.Module] = None, target: Optional[Tensor] = None
    ) -> None:
        """Use ``output`` (with ``loss_func``) for this step's curvature backward.

        May be called several times per step (several heads, a PINN's interior and
        boundary residuals). Each registration of a step is its own *term* (numbered in
        call order): a layer reached by several terms is preconditioned with the sum of
        their Kronecker products, inverted exactly for two terms (see
        :class:`~curvature.KFAC`). The first call of a step discards the statistics of
        the automatic model-output backward of that step. Only the layer calls that
        ``output`` depends on are used.
        """
        self._collector.register_output(output, loss_func, target)

    # -- the step -------------------------------------------------------------------------
    @torch.compiler.disable
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:
        """One update. ``closure`` (optional) re-evaluates the loss, as in ``torch.optim``.

        With ``adaptive_damping=True`` a closure is required: every
        ``damping_adaptation_interval`` steps it is evaluated again after the update to
        compare the actual loss change with the quadratic model's prediction
        ``q(d) = g^T d + 1/2 d^T (C + lambda) d`` (``C`` the curvature approximation):
        the reduction ratio ``rho > 3/4`` multiplies the damping by
        ``damping_adaptation_decay``, ``rho < 1/4`` divides it (Levenberg-Marquardt,
        Martens & Grosse 2015).

        ``line_search_grid`` takes the best grid point only if its loss is below the
        closure's loss, else keeps the parameters (``last_step_taken`` is ``False``).
        These evaluations (one per candidate learning rate) only need the loss: a closure
        with a ``backward`` keyword (``def closure(backward=True): ...``) is called with
        ``backward=False`` for them (else as it is: wasted backward passes, and ``.grad``
        after the step holds the gradient at the last evaluated point). Under
        ``scaler.step(optim)`` the loss scale is handled here (:mod:`.amp`).
        """
        self.config.check_closure(closure)
        self._check_quadratic(closure or False)
        if scaled_step_skipped(self, self._collector, self.config.update_rule == "quadratic"):
            return None  # a GradScaler found inf gradients
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad(), flushing():  # (our CPU arithmetic: no subnormals)
            self._step(closure, loss)
        return loss

    def _step(self, closure, loss) -> None:
        cfg = self.config
        self._check_trainable()
        collector = self._collector
        collector.begin_step()
        if self._comm is not None:
            self._comm.step = self.steps
        stats = collector.finalize(collector.default_dtype())
        if stats:
            with batched_ema():  # the running updates in one call
                self._update_curvature(stats)
        refresh = (
            self.steps % cfg.inverse_every == 0
            or self.steps < cfg.inverse_warmup
            or self._needs_refresh()
        )
        if refresh:
            self._refresh()
        grads = self._flat_grads()
        adapt = (
            cfg.adaptive_damping
            and cfg.update_rule == "fixed"
            and grads is not None
            and self.steps % cfg.damping_adaptation_interval == 0
        )
        before = self.layout.flat_params(torch.float64) if adapt else None
        if grads is not None:
            plain = cfg.line_search_grid is None and cfg.update_rule != "quadratic"
            # the plain update's directions in a persistent buffer (no allocation, and
            # its views shaped like the parameters need no split per step)
            buf, views = (
                self._flat[1].get([p.shape for p in self.layout.params], grads.dtype, grads.device)
                if plain
                else (None, None)
            )
            directions = self._precondition(grads, out=buf)
            if cfg.line_search_grid is not None:
                self.last_line_search_lr = line_search(
                    self._slots(),
                    directions,
                    cfg.line_search_grid,
                    lambda: self._evaluate(closure),
                    type(self).__name__,
                    self._global_loss(float(loss.detach())),
                )
                self.last_step_taken = self.last_line_search_lr is not None
            elif cfg.update_rule == "quadratic":
                self._quadratic_update(closure, loss, grads, directions)
            else:
                slots = [s for s in self._slots() if s.param.grad is not None]
                self._kl_scale, ok = apply_update(
                    slots,
                    directions,
                    grads,
                    self.state,
                    cfg.kl_clip,
                    type(self).__name__,
                    direction_views=views if directions is buf else None,
                    stale_clip=self._stale,
                    refreshed=refresh,
                )
                self._reads.record_update(tuple(s.name for s in slots), ok, self.steps)
        if adapt:
            delta = self.layout.flat_params(torch.float64) - before
            self._adapt_damping(closure, float(loss.detach()), grads, delta)
        self.steps += 1
        self._reseed()
        collector.due = self.steps % cfg.factor_every == 0
        collector.resume_recording()

    def _evaluate(self, closure) -> float:
        """The closure's loss at the current parameters, without recording statistics."""
        self._collector.evaluating = True
        try:
            return self._global_loss(loss_only(closure))
        finally:
            self._collector.evaluating = False

    def _slots(self) -> List[ParamSlot]:
        """The trainable parameters of the groups, with their flat spans."""
        return list(self._groups.of(self.layout, self.param_groups).slots)

    def _adapt_damping(self, closure, loss_before: float, grads: Tensor, delta: Tensor) -> None:
        """Levenberg-Marquardt: rescale every group's damping by the reduction ratio.

        The quadratic model uses each position's own group damping:
        ``q(d) = g^T d + 1/2 d^T C d + 1/2 sum_i lambda_i d_i^2``.
        """
        loss_after = self._evaluate(closure)
        loss_before = self._global_loss(loss_before)
        d = delta.to(grads.dtype)
        Cd = self._curvature_matvec(d)
        rho = reduction_ratio(loss_before, loss_after, grads, d, Cd, self._damping_vector(d))
        self.last_reduction_ratio = rho
        factor = damping_factor(rho, self.config.damping_adaptation_decay)
        for g in self.param_groups:
            g["damping"] = g["damping"] * factor

    def _damping_vector(self, like: Tensor) -> Tensor:
        """``[P]``: each position's group damping (built once per set of dampings)."""
        spans = [(s.span.start, s.span.stop, s.group["damping"]) for s in self._slots()]
        key = (tuple(spans), self.param_groups[0]["damping"], like.dtype, like.device)
        if self._damping_cache[0] != key:
            out = torch.full_like(like, self.param_groups[0]["damping"])
            for start, stop, damping in spans:
                out[start:stop] = damping
            self._damping_cache = (key, out)
        return self._damping_cache[1]

    def _flat_grads(self) -> Optional[Tensor]:
        """The gradients as one flat vector (averaged over the ranks where we sync them)."""
        return flat_gradients(self.layout, self._comm if self.sync_grads else None, self._flat[0])

    def _group_damping(self, param: Tensor, index: Optional[GroupIndex] = None) -> float:
        """``param``'s group damping (``index``: the groups' index of this step)."""
        index = index or self._groups.of(self.layout, self.param_groups)
        return index.damping(param, self.param_groups[0])

    # -- public products -------------------------------------------------------------------
    @torch.no_grad()
    def inverse_matvec(self, v: Sequence[Tensor]) -> List[Tensor]:
        """The update direction for ``v``: the damped curvature inverse times ``v``.

        Args:
            v: Tensors shaped like the trainable parameters (``model.parameters()`` order),
                e.g. their gradients.

        Returns:
            ``(C + lambda)^{-1} v`` as the optimizer preconditions gradients now (plain
            ``v`` for parameters without curvature), shaped like ``v``.

        """
        flat = self.layout.flatten(v)
        return self.layout.unflatten(self._precondition(flat))

    @torch.no_grad()
    def matvec(self, v: Sequence[Tensor]) -> List[Tensor]:
        """The running curvature approximation ``C`` (undamped) times ``v``."""
        flat = self.layout.flatten(v)
        return self.layout.unflatten(self._curvature_matvec(flat))

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s state with a ``"curvature"`` entry: counters, generator, blocks."""
        sd = super().state_dict()
        sd["curvature"] = {
            "optimizer": type(self).__name__,
            "steps": self.steps,
            "skipped_statistics": self.skipped_statistics,
            "generator": self.generator.get_state(),
            "device_generators": self._generators.device_states(),
            "stale_clip": None if self._stale is None else self._stale.state(),
            **self._curvature_state(),
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`, after checking the whole state against this optimizer.

        The param groups, each per-parameter buffer's shape, the curvature family (a
        ``KFAC`` or ``EKFAC`` state loads into either; a ``DiagonalNaturalGradient`` state
        only into that class), every block name and every tensor's shape must match;
        block names saved from a ``torch.compile``'d model (``_orig_mod.`` prefix) are
        those of the plain model. Nothing changes when a check fails.

        Raises:
            ValueError: Naming the mismatching key, the saved and the expected shape.

        """
        who = type(self).__name__
        state_dict = dict(state_dict)
        curv = state_dict.pop("curvature", None)
        if curv is None:
            raise refuse(
                who, "the state has no 'curvature' entry (was it saved by a different optimizer?)"
            )
        names = {p: n for n, p in self.model.named_parameters()}
        check_param_state(who, state_dict, self.param_groups, names)
        curv = self._checked_curvature_state(curv)
        clip = check_stale_state(who, curv.get("stale_clip"))
        super().load_state_dict(state_dict)
        self.steps = curv["steps"]
        self.skipped_statistics = curv["skipped_statistics"]
        self._generators.set_state({**curv.get("device_generators", {}), "cpu": curv["generator"]})
        self._load_curvature_state(curv)
        if self._stale is not None:  # (a state without it: no reference until a refresh)
            self._stale.load(clip)
        self._reseed()
        self._collector.due = self.steps % self.config.factor_every == 0
        self._collector.resume_recording()

    # -- subclass interface ------------------------------------------------------------------
    def _accumulate(self, name, module, rule, calls, with_g: bool, emit) -> None:
        """Emit a layer's statistics sums: ``emit((name, suffix), values, kinds, rows)``."""
        raise NotImplementedError

    def _covered_names(self) -> List[str]:
        raise NotImplementedError

    def _reset_curvature(self) -> None:
        raise NotImplementedError

    def _update_curvature(self, stats: Dict[Any, list]) -> None:
        raise NotImplementedError

    def _needs_refresh(self) -> bool:
        return False

    def _refresh(self) -> None:
        raise NotImplementedError

    def _precondition(self, grads: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The preconditioned gradient ``[P]``: ``out`` where given, else a new tensor."""
        raise NotImplementedError

    def _curvature_matvec(self, v: Tensor) -> Tensor:
        """The curvature approximation times a flat vector (no damping)."""
        raise NotImplementedError

    def _curvature_state(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _checked_curvature_state(self, state: Any) -> Dict[str, Any]:
        """The saved curvature state, validated (``ValueError``) and with plain names."""
        raise NotImplementedError

    def _load_curvature_state(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError


def _close_collector(live: List[Any]) -> None:
    """The finalizer of an optimizer: remove the hooks of its collector."""
    if live[0] is not None:
        live[0].close()
