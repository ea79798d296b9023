"""The shared base of curvature optimizers: statistics collection, schedule, state.

A :class:`CurvatureOptimizer` owns a :class:`~curvature.capture.Capture` on the model for
its whole life. What it collects depends on the Fisher type:

- ``"empirical"``: layer inputs from the forward and, through node pre-hooks, the
  gradients of the user's own ``loss.backward()`` w.r.t. each layer output. With
  ``g = R grad l_n`` (``R = 1/N`` for a mean loss), ``G = (1/R) sum_n g g^T``.
- ``"mc"``, ``"type-2"``, ``"rademacher"``: at the end of each training forward of the
  model (or at :meth:`register_output`), the vectors of
  :func:`~curvature.losses.backprop_sources` are backpropagated on the existing graph in
  one batched call; the user's backward is untouched.
- ``"forward-only"``: inputs only, ``G = I``.

Statistics of all forwards between two ``step()`` calls (gradient accumulation), and
under ``torch.distributed`` of all ranks, count as one batch, their union: ``A`` is the
mean of ``a a^T`` over all rows, ``G`` is ``R(N) sum g g^T`` over all ``N`` samples
(``R(N) = 1/N`` for a mean loss, ``1`` for a sum). They are folded into running
estimates with ``factor_decay`` every ``factor_every`` steps; decompositions are
refreshed every ``inverse_every`` steps. Statistics accumulate in float32 (float64 for
float64 models) whatever the model dtype.

For ``"empirical"`` the optimizer sees the user's gradients ``c grad l_n`` and assumes
that the gradient accumulated in ``.grad`` (and averaged over the ``W`` ranks) is the
gradient of ``loss_func`` over that union, i.e. ``c = W R(N)``: a plain mean loss on one
process; ``loss / k`` over ``k`` equal micro-batches; on ``W`` ranks with batches ``N_r``,
``W / N * sum_n l_n`` on each rank (for equal ``N_r`` simply the local mean).
"""

from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..capture import Capture, WeakHook, unwrap_model as _unwrap
from ..layers import LayerRule
from ..linalg import finite_flags
from ..losses import (
    FISHER_TYPES,
    SUPPORTED_LOSSES,
    backprop_sources,
    check_loss,
    reduction_scale,
)
from .distributed import Communicator, check_not_sharded, is_ddp

_UNSUPPORTED = ("warn", "error", "diagonal")

#: Kinds of statistics values: ``"A"`` (symmetric; a sum of ``a a^T`` normalized by its
#: rows), ``"G"`` (symmetric; a sum of ``g g^T``-like terms normalized per sample) and
#: ``"g"`` (like ``"G"`` but not symmetric: EKFAC corrections, Fisher diagonals).
StatKind = str


@dataclass
class _Stat:
    """The statistics sums of one block and term over the forwards of one step."""

    values: List[Optional[Tensor]]
    kinds: Tuple[StatKind, ...]
    rows: float = 0.0
    samples: float = 0.0
    reduction: str = "mean"  # of the loss the G-like values were computed with
    empirical: bool = False  # G-like values are c^2 sum g g^T of the user's gradients
    shapes: List[Optional[Tuple[int, ...]]] = field(default_factory=list)


class CurvatureOptimizer(Optimizer):
    """Base class: constructor validation, statistics collection, ``step`` skeleton.

    Subclasses implement :meth:`_update_statistics` (fold one step's statistics into the
    running estimates), :meth:`_refresh` (decompositions) and :meth:`_precondition`
    (map gradients to update directions).
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        *,
        fisher: str = "empirical",
        loss_func: Optional[nn.Module] = None,
        mc_samples: int = 1,
        kfac_approx: str = "expand",
        factor_decay: float = 0.95,
        factor_every: int = 1,
        inverse_every: int = 10,
        kl_clip: Optional[float] = None,
        damping_mode: str = "pi",
        unsupported: str = "warn",
        auto_output: bool = True,
        seed: int = 0,
        param_groups: Optional[Sequence[Dict[str, Any]]] = None,
        grad_scaler: Optional[Any] = None,
        adaptive_damping: bool = False,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: float = 0.95,
        line_search_grid: Optional[Sequence[float]] = None,
        distributed: Optional[bool] = None,
        process_group: Any = None,
        sync_grads: Optional[bool] = None,
        comm_timeout: float = 300.0,
        bucket_mb: float = 25.0,
    ):
        name = type(self).__name__
        if not isinstance(model, nn.Module):
            raise ValueError(f"{name}(model={type(model).__name__}): model must be an nn.Module.")
        _check(name, "lr", lr, lr >= 0, "must be >= 0")
        _check(
            name,
            "damping",
            damping,
            damping > 0,
            "must be > 0; it is added to the curvature before inversion, typical values "
            "1e-4 ... 1e-1",
        )
        _check(name, "momentum", momentum, 0 <= momentum < 1, "must be in [0, 1)")
        _check(name, "weight_decay", weight_decay, weight_decay >= 0, "must be >= 0")
        _check(name, "fisher", fisher, fisher in FISHER_TYPES, f"must be one of {FISHER_TYPES}")
        if fisher in ("mc", "type-2", "rademacher") and loss_func is None:
            raise ValueError(
                f"{name}(fisher={fisher!r}) needs loss_func=... (e.g. nn.CrossEntropyLoss()): "
                "the model output and the loss define the curvature backward."
            )
        if loss_func is not None:
            if not isinstance(loss_func, SUPPORTED_LOSSES):
                raise ValueError(
                    f"{name}(loss_func={loss_func!r}): unsupported loss; use one of "
                    "nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss."
                )
            check_loss(loss_func)
        _check(
            name,
            "mc_samples",
            mc_samples,
            isinstance(mc_samples, int) and mc_samples >= 1,
            "must be a positive int",
        )
        _check(
            name,
            "kfac_approx",
            kfac_approx,
            kfac_approx in ("expand", "reduce"),
            "must be 'expand' or 'reduce'",
        )
        _check(name, "factor_decay", factor_decay, 0 <= factor_decay < 1, "must be in [0, 1)")
        for arg, val in (("factor_every", factor_every), ("inverse_every", inverse_every)):
            _check(name, arg, val, isinstance(val, int) and val >= 1, "must be a positive int")
        _check(name, "kl_clip", kl_clip, kl_clip is None or kl_clip > 0, "must be None or > 0")
        _check(
            name,
            "damping_mode",
            damping_mode,
            damping_mode in ("exact", "pi"),
            "must be 'exact' (eigenbasis) or 'pi' (Tikhonov with the pi heuristic)",
        )
        _check(
            name,
            "unsupported",
            unsupported,
            unsupported in _UNSUPPORTED,
            f"must be one of {_UNSUPPORTED}",
        )

        check_not_sharded(model, name)
        _check(name, "comm_timeout", comm_timeout, comm_timeout > 0, "must be > 0 seconds")
        _check(name, "bucket_mb", bucket_mb, bucket_mb > 0, "must be > 0")
        if process_group is None and is_ddp(model):
            process_group = model.process_group
        self._comm = Communicator.create(distributed, process_group, comm_timeout, bucket_mb, name)
        # DDP averages the gradients itself; a plain model under torch.distributed is
        # treated as replicated data parallelism and its gradients are averaged here.
        self.sync_grads = (not is_ddp(model)) if sync_grads is None else bool(sync_grads)
        self._ddp = model if is_ddp(model) else None
        self.model = _unwrap(model)
        defaults = dict(lr=lr, damping=damping, momentum=momentum, weight_decay=weight_decay)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if param_groups is None:
            groups: Any = [{"params": trainable}]
        else:
            groups = [dict(g) for g in param_groups]
        super().__init__(groups, defaults)
        for g in self.param_groups:
            for key in ("lr", "damping", "momentum", "weight_decay"):
                if g[key] < 0 or (key == "damping" and g[key] <= 0):
                    allowed = "must be > 0" if key == "damping" else "must be >= 0"
                    raise ValueError(
                        f"{name}: param group {key}={g[key]} is invalid; {key} {allowed}."
                    )

        self.fisher = fisher
        self.loss_func = loss_func
        self.mc_samples = mc_samples
        self.kfac_approx = kfac_approx
        self.factor_decay = factor_decay
        self.factor_every = factor_every
        self.inverse_every = inverse_every
        self.kl_clip = kl_clip
        self.damping_mode = damping_mode
        self.unsupported = unsupported
        self.auto_output = auto_output
        self.grad_scaler = grad_scaler
        self.adaptive_damping = adaptive_damping
        if line_search_grid is not None:
            grid = [float(x) for x in line_search_grid]
            if not grid or any(x <= 0 for x in grid):
                raise ValueError(
                    f"{name}(line_search_grid={line_search_grid!r}): a non-empty sequence of "
                    "positive learning rates, e.g. [2.0 ** -k for k in range(10)]."
                )
            line_search_grid = grid
        self.line_search_grid = line_search_grid
        self.last_line_search_lr: Optional[float] = None
        self.damping_adaptation_interval = damping_adaptation_interval
        self.damping_adaptation_decay = damping_adaptation_decay
        self.last_reduction_ratio: Optional[float] = None
        self._evaluating = False
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.skipped_statistics = 0
        self._registered = False
        self._term = 0
        self._forward_scale = 1.0
        self._context: Tuple[int, str, float, bool] = (1, "mean", 1.0, False)
        self._pending: Optional[Tuple[Any, ...]] = None  # a statistics reduction in flight

        # parameter bookkeeping: flat positions over the model's trainable parameters
        self._names = {p: n for n, p in self.model.named_parameters()}
        own = [p for g in self.param_groups for p in g["params"]]
        missing = [p for p in own if p not in self._names]
        if missing:
            raise ValueError(
                f"{name}: {len(missing)} parameter(s) in param_groups do not belong to the model."
            )
        self._closed = False
        self._build()
        self._check_coverage()
        self._reseed()

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
        """On several ranks: a sampling generator per (seed, step, rank).

        Each rank draws its own MC labels / Rademacher signs, and a run resumed from a
        ``state_dict`` saved on any one rank continues the same draws on every rank.
        """
        if self._comm is not None:
            mixed = ((self.seed * 1_000_003 + self.steps) * 4099 + self._comm.rank) % 2**62
            self.generator.manual_seed(mixed)

    def _global_loss(self, value: float) -> float:
        """A closure's loss, averaged over the ranks (identical decisions everywhere)."""
        return value if self._comm is None else self._comm.mean(value)

    def _build(self) -> None:
        """Flat offsets of the trainable parameters, the capture and the root hooks."""
        self._trainable = tuple(n for n, p in self.model.named_parameters() if p.requires_grad)
        self._offsets: Dict[str, int] = {}
        i = 0
        for n, p in self.model.named_parameters():
            if p.requires_grad:
                self._offsets[n] = i
                i += p.numel()
        self._num_flat = i
        self._capture = Capture(self.model, fallback="functorch")
        self._capture.__enter__()
        if self.fisher == "empirical":
            self._capture.watch_backward(True)
        self._root_handle = self.model.register_forward_hook(
            WeakHook(self, "_root_forward_end", self.model)
        )
        self._pre_handle = self.model.register_forward_pre_hook(
            WeakHook(self, "_root_forward_start", self.model)
        )
        self._step_stats: Dict[Tuple[str, str, int], list] = {}
        self._stat_queue: list = []  # contributions awaiting one batched finiteness check
        self._layers: Dict[str, Tuple[nn.Module, LayerRule]] = {
            n: (m, r) for n, m, r in self._capture.layers
        }

    def _check_trainable(self) -> None:
        """Rebuild (and reset the curvature) when parameters were frozen or unfrozen."""
        now = tuple(n for n, p in self.model.named_parameters() if p.requires_grad)
        if now == self._trainable or self._closed:
            return
        warnings.warn(
            f"{type(self).__name__}: the trainable parameters changed since the last step; "
            "the curvature estimates are reset.",
            stacklevel=3,
        )
        self._capture.remove_hooks()
        self._root_handle.remove()
        self._pre_handle.remove()
        self._build()
        self._reset_curvature()

    def _reset_curvature(self) -> None:
        raise NotImplementedError

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        """Remove every hook (the optimizer can still ``step`` with plain gradients)."""
        if getattr(self, "_closed", True):
            return
        self._capture.remove_hooks()
        self._capture.clear()
        self._root_handle.remove()
        self._pre_handle.remove()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # -- coverage ------------------------------------------------------------------------
    def _covered_names(self) -> List[str]:
        raise NotImplementedError

    def _check_coverage(self) -> None:
        covered = set(self._covered_names())
        own = {self._names[p] for g in self.param_groups for p in g["params"]}
        bare = sorted(own - covered)
        self.uncovered = bare
        if not bare:
            return
        msg = f"{type(self).__name__}: no curvature rule covers {bare}; " + (
            "they are preconditioned by their per-sample Fisher diagonal."
            if self.unsupported == "diagonal"
            else "they are updated with the plain gradient."
        )
        if self.unsupported == "error":
            raise ValueError(
                msg.replace("they are updated", "pass unsupported='warn' to update them")
            )
        warnings.warn(msg, stacklevel=3)

    # -- statistics -----------------------------------------------------------------------
    @property
    def _due(self) -> bool:
        return self.steps % self.factor_every == 0

    def _root_forward_start(self, module, args) -> None:
        if not self._closed:
            self._on_forward_start()

    def _root_forward_end(self, module, args, output) -> None:
        if not self._closed:
            self._on_forward_end(output)

    def _on_forward_start(self) -> None:
        if self._evaluating:
            self._capture._recording = False
            return
        scale = self._loss_scale()
        if scale < self._forward_scale:
            # the grad scaler backed off: it found inf gradients and skipped step(), so the
            # gradients of the forwards since the last step are discarded; so are their
            # statistics (they count with the gradient they belong to)
            with self._capture.computing():
                self._capture.take_pushed()
            self._discard_statistics()
        # empirical: fold the calls whose backward already ran (bounded memory under
        # gradient accumulation); calls still waiting for their backward stay.
        if self.fisher == "empirical":
            self._consume(self._capture.take_pushed(), scale_by_reduction=True)
        self._forward_scale = scale
        self._capture._recording = self._due and self.model.training and not self._closed

    def _on_forward_end(self, output: Any) -> None:
        if self._evaluating:
            return
        if not (self._due and self.model.training and torch.is_grad_enabled()):
            return
        if self.fisher == "forward-only":
            calls = [(n, m, r, cs) for n, m, r, cs in self._capture.active()]
            self._consume(calls, with_g=False)
            self._capture.clear()
            return
        if self.fisher == "empirical" or not self.auto_output or self._registered:
            return
        if not isinstance(output, Tensor) or output.grad_fn is None:
            raise ValueError(
                f"{type(self).__name__}(fisher={self.fisher!r}): the model output is not a "
                "tensor with a graph; name the curvature outputs with "
                "optim.register_output(output, loss_func) and pass auto_output=False."
            )
        self._pull(output, self.loss_func, None, keep_calls=False)
        self._launch_early()

    def _loss_scale(self) -> float:
        """The AMP loss scale of the current forward (1 without a grad scaler)."""
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            return float(scaler.get_scale())
        return 1.0

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
        if self.fisher in ("empirical", "forward-only"):
            raise ValueError(
                f"register_output is for fisher in ('mc', 'type-2', 'rademacher'); this "
                f"optimizer uses fisher={self.fisher!r}."
            )
        if self._evaluating:  # loss evaluations of a line search / damping adaptation
            return
        loss_func = loss_func if loss_func is not None else self.loss_func
        if loss_func is None:
            raise ValueError("register_output(output) needs a loss_func.")
        check_loss(loss_func)
        if not self._registered:
            self._discard_statistics()
            self._registered = True
            self._term = 0
        if self._due:
            self._pull(output, loss_func, target, keep_calls=True)
        self._term += 1

    def _pull(
        self, output: Tensor, loss_func: nn.Module, target: Optional[Tensor], keep_calls: bool
    ) -> None:
        """Backpropagate the Fisher's vectors from ``output``; fold the reached calls.

        ``keep_calls``: registered outputs may share layer calls (two heads of one
        forward), so calls stay until ``step()``; the automatic output owns its forward.
        """
        if not torch.isfinite(output.detach().sum()):
            self.skipped_statistics += 1
            return
        V = backprop_sources(
            loss_func,
            output,
            target,
            self.fisher,
            mc_samples=self.mc_samples,
            generator=self.generator,
        )
        self._capture.pull(output, V, is_grads_batched=True, retain_graph=True, unreached="skip")
        N = output.shape[0] if output.dim() else 1
        reduction = getattr(loss_func, "reduction", "mean")
        # G-like sums are kept as raw per-sample sums: the sources carry sqrt(R(N)).
        self._context = (N, reduction, 1.0 / reduction_scale(loss_func, N), False)
        reached = []
        for name, module, rule, cs in self._capture.active():
            done = [c for c in cs if c.grads is not None]
            if done:
                reached.append((name, module, rule, done))
                if not keep_calls:
                    self._capture._calls[name] = [c for c in cs if c.grads is None]
        self._consume(reached)

    def _consume(self, calls, with_g: bool = True, scale_by_reduction: bool = False) -> None:
        """Fold calls (with ``grads`` set) into this step's statistics, then release them."""
        try:
            self._consume_calls(calls, with_g, scale_by_reduction)
            self._flush_step_stats()
        finally:
            self._stat_queue = []

    def _consume_calls(self, calls, with_g: bool, scale_by_reduction: bool) -> None:
        with self._capture.computing():
            for name, module, rule, cs in calls:
                if scale_by_reduction:  # user backward: c grad l_n (times the AMP scale)
                    inv = 1.0 / self._forward_scale
                    for c in cs:
                        c.grads = [
                            (_promote(g) * inv if inv != 1.0 else _promote(g)).unsqueeze(0)
                            for g in c.grads
                        ]
                    N = rule.batch_size(module, cs[0])
                    reduction = getattr(self.loss_func, "reduction", "mean")
                    self._context = (N, reduction, 1.0, True)
                elif not with_g:
                    self._context = (rule.batch_size(module, cs[0]), "mean", 1.0, False)
                else:
                    for c in cs:
                        if c.grads is not None:
                            c.grads = [_promote(g) for g in c.grads]
                self._accumulate(name, module, rule, cs, with_g)

    def _accumulate(self, name, module, rule, calls, with_g) -> None:
        raise NotImplementedError

    def _add_step_stat(
        self,
        key: Tuple[str, str],
        values: Sequence[Optional[Tensor]],
        kinds: Tuple[StatKind, ...],
        rows: int = 0,
    ) -> None:
        """Add statistics sums of one forward, skipping non-finite ones (counted).

        Args:
            key: ``(block name, suffix)``; the current term is appended.
            values: Sums over this forward's rows / samples (``None``: absent).
            kinds: One of ``"A"``, ``"G"``, ``"g"`` per value (see :data:`StatKind`).
            rows: The rows of the ``"A"`` sums.

        """
        key = (*key, self._term if self._registered else 0)
        N, reduction, g_scale, empirical = self._context
        slot = self._step_stats.get(key)
        if slot is None:
            slot = self._step_stats[key] = _Stat(
                [None] * len(values),
                tuple(kinds),
                reduction=reduction,
                empirical=empirical,
                shapes=[None if v is None else tuple(v.shape) for v in values],
            )
        if g_scale != 1.0:
            values = [v if (v is None or k == "A") else v * g_scale for v, k in zip(values, kinds)]
        # folded by _flush_step_stats once the finiteness of all is known (one sync)
        self._stat_queue.append((slot, list(values), rows, N))

    def _flush_step_stats(self) -> None:
        """Fold the queued contributions into their slots, skipping non-finite ones.

        A sum is finite iff every entry is (barring float overflow): the sums of all
        queued values are checked in one reduction per device, so that a step costs one
        host synchronization on a GPU instead of one per block. A skipped contribution
        is counted in ``skipped_statistics``; its slot stays (with zero counts) for the
        layout.
        """
        queue, self._stat_queue = self._stat_queue, []
        present = [[v for v in values if v is not None] for _, values, _, _ in queue]
        flags = iter(finite_flags([v for vs in present for v in vs]))
        finite = [all([next(flags) for _ in vs]) for vs in present]  # consumes every flag
        for (slot, values, rows, N), ok in zip(queue, finite):
            if not ok:
                self.skipped_statistics += 1
                continue
            slot.values = [
                a if b is None else (b if a is None else a + b) for a, b in zip(slot.values, values)
            ]
            slot.shapes = [s if v is None else tuple(v.shape) for s, v in zip(slot.shapes, values)]
            slot.rows += rows
            slot.samples += N

    def _finalize_statistics(self) -> Dict[Tuple[str, str, int], List[Optional[Tensor]]]:
        """The statistics of this step, reduced over the ranks and normalized.

        ``"A"`` values become means over their rows; ``"G"``/``"g"`` values become
        ``R(N) sum`` over the ``N`` samples of the union of all forwards (and ranks); for
        empirical statistics (``c^2 sum`` of the user's gradients with ``c = W R(N)``),
        ``sum / (W^2 R(N))``. Blocks without any finite contribution are dropped.
        """
        stats = self._step_stats
        if self._comm is not None:
            self._reduce_statistics(stats)
            if self._pending is not None:  # launched early: add the two global parts
                early = self._finish_reduction(self._pending)
                self._pending = None
                for key, st in stats.items():
                    if key in early:
                        st = _merge_stats(early[key], st)
                    early[key] = st
                stats = early
        W = self.world_size
        out = {}
        order = sorted(stats, key=repr) if self._comm is not None else list(stats)
        for key in order:
            st = stats[key]
            if st.samples == 0 or all(v is None for v in st.values):
                continue
            R = 1.0 / st.samples if st.reduction == "mean" else 1.0
            g_norm = 1.0 / (W * W * R) if st.empirical else R
            vals: List[Optional[Tensor]] = []
            for v, k in zip(st.values, st.kinds):
                if v is None:
                    vals.append(None)
                elif k == "A":
                    vals.append(v / st.rows)
                else:
                    vals.append(v * g_norm)
            out[key] = vals
        return out

    def _reduce_statistics(self, stats: Dict[Tuple[str, str, int], _Stat]) -> None:
        """Sum the statistics of all ranks in place (layout agreed, zeros where absent)."""
        self._finish_reduction(self._start_reduction(stats))

    def _start_reduction(self, stats: Dict[Tuple[str, str, int], _Stat]) -> Tuple[Any, ...]:
        """Agree on the layout, pack, and launch the statistics all-reduce."""
        from .distributed import pack  # noqa: PLC0415 - one module owns the packing

        comm = self._comm
        signature = [
            (key, (st.kinds, st.reduction, st.empirical, *st.shapes)) for key, st in stats.items()
        ]
        layout = comm.agree(signature)
        ref = next((v for st in stats.values() for v in st.values if v is not None), None)
        dtype = ref.dtype if ref is not None else self._stat_dtype_default()
        device = comm.device
        counts_cpu = torch.zeros(len(layout), 2, dtype=torch.float64)  # one host copy
        flats: List[Tensor] = []
        plan = []
        for i, (key, spec) in enumerate(layout):
            kinds, reduction, empirical, *shapes = spec
            st = stats.get(key)
            if st is None:
                st = stats[key] = _Stat(
                    [None] * len(kinds), kinds, reduction=reduction, empirical=empirical
                )
            st.shapes = list(shapes)
            counts_cpu[i, 0], counts_cpu[i, 1] = st.rows, st.samples
            for j, (shape, kind) in enumerate(zip(shapes, kinds)):
                if shape is None:
                    continue
                v = st.values[j]
                sym = kind in ("A", "G")
                if v is None:
                    v = torch.zeros(shape, dtype=dtype, device=device)
                flats.append(pack(v.to(device), sym))
                plan.append((st, j, shape, sym, v.device))
        counts = counts_cpu.to(device)
        handle = comm.start([counts] + flats, "statistics")
        return stats, layout, counts, flats, plan, handle

    def _finish_reduction(self, pending: Tuple[Any, ...]) -> Dict[Tuple[str, str, int], _Stat]:
        """Wait for :meth:`_start_reduction` and unpack; returns the (global) statistics."""
        from .distributed import unpack  # noqa: PLC0415

        stats, layout, counts, flats, plan, handle = pending
        self._comm.finish(handle)
        for (st, j, shape, sym, dev), flat in zip(plan, flats):
            st.values[j] = unpack(flat, shape, sym).to(dev)
        for (key, _), (rows, samples) in zip(layout, counts.tolist()):
            stats[key].rows, stats[key].samples = rows, samples
        return stats

    def _launch_early(self) -> None:
        """Overlap the statistics all-reduce with the backward when they are final.

        Under DDP, ``require_backward_grad_sync`` is ``False`` inside ``no_sync()``; a
        training forward outside it is the step's last micro-batch, and for the Fisher
        types whose backward the optimizer runs at the end of the forward its statistics
        are complete there: their reduction is launched at once and runs during the
        user's backward (statistics of any later forward are reduced at ``step()`` and
        added).
        """
        if self._comm is None or self._ddp is None or self._pending is not None:
            return
        if not getattr(self._ddp, "require_backward_grad_sync", False):
            return
        self._pending = self._start_reduction(self._step_stats)
        self._step_stats = {}

    def _discard_statistics(self) -> None:
        """Drop this step's statistics (and a reduction in flight, after it completes)."""
        if self._pending is not None:
            self._finish_reduction(self._pending)
            self._pending = None
        self._step_stats = {}

    def _stat_dtype_default(self) -> torch.dtype:
        p = next(iter(self._offsets_params()), None)
        return torch.float64 if p is not None and p.dtype == torch.float64 else torch.float32

    # -- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Tensor]] = None) -> Optional[Tensor]:
        """One update. ``closure`` (optional) re-evaluates the loss, as in ``torch.optim``.

        With ``adaptive_damping=True`` a closure is required: every
        ``damping_adaptation_interval`` steps it is evaluated again after the update to
        compare the actual loss change with the quadratic model's prediction
        ``q(d) = g^T d + 1/2 d^T (C + lambda) d`` (``C`` the curvature approximation):
        the reduction ratio ``rho > 3/4`` multiplies the damping by
        ``damping_adaptation_decay``, ``rho < 1/4`` divides it (Levenberg-Marquardt,
        Martens & Grosse 2015).

        These extra evaluations (and those of ``line_search_grid``, one per candidate
        learning rate) only need the loss. A closure that accepts a ``backward`` keyword
        (``def closure(backward=True): ...``) is called with ``backward=False`` for them
        and may skip its ``loss.backward()``; a closure without it is called as it is
        (its backward passes are then wasted work, and ``.grad`` after the step holds
        the gradient at the last evaluated point).
        """
        if self.line_search_grid is not None and closure is None:
            raise ValueError(
                f"{type(self).__name__}(line_search_grid=...).step() needs a closure that "
                "returns the loss."
            )
        if self.adaptive_damping and closure is None:
            raise ValueError(
                f"{type(self).__name__}(adaptive_damping=True).step() needs a closure that "
                "re-evaluates the loss (and calls backward)."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_trainable()
        if self.fisher == "empirical":
            self._consume(self._capture.take_pushed(), scale_by_reduction=True)
        self._capture.clear()  # calls whose backward never came (or kept for registration)
        if self._comm is not None:
            self._comm.step = self.steps
        if self._due and (self._step_stats or self._comm is not None):
            stats = self._finalize_statistics()
            if stats:
                self._update_statistics(stats)
        self._step_stats = {}
        self._registered = False
        self._term = 0
        if self.steps % self.inverse_every == 0 or self._needs_refresh():
            self._refresh()
        grads = self._flat_grads()
        adapt = (
            self.adaptive_damping
            and grads is not None
            and self.steps % self.damping_adaptation_interval == 0
        )
        before = self._flat_params() if adapt else None
        if grads is not None:
            directions = self._precondition(grads)
            if self.line_search_grid is not None:
                self._line_search(closure, directions)
            else:
                self._apply(directions, grads)
        if adapt:
            self._adapt_damping(closure, float(loss.detach()), grads, self._flat_params() - before)
        self.steps += 1
        self._reseed()
        self._capture._recording = self._due and not self._closed
        return loss

    def _line_search(self, closure, directions: Tensor) -> None:
        """Take the step ``-lr d`` with the ``lr`` of the grid that gives the lowest loss.

        The grid replaces the groups' learning rates; momentum and weight decay are not
        applied (the variant of Dangel, Mueller & Zeinhofer, 2024, for PINNs).
        """
        params = [
            (p, self._offsets[n]) for n, p in self.model.named_parameters() if n in self._offsets
        ]
        start = [p.detach().clone() for p, _ in params]

        def move(lr: float) -> None:
            for (p, o), p0 in zip(params, start):
                d = directions[o : o + p.numel()].view_as(p).to(p.dtype)
                p.copy_(p0 - lr * d)

        best, best_loss = None, float("inf")
        self._evaluating = True
        try:
            for lr in self.line_search_grid:
                move(lr)
                value = self._global_loss(_loss_only(closure))
                if value < best_loss:
                    best, best_loss = lr, value
        finally:
            self._evaluating = False
        self.last_line_search_lr = best
        if best is None:  # every candidate gave a non-finite loss: stay
            for (p, _), p0 in zip(params, start):
                p.copy_(p0)
            warnings.warn(
                f"{type(self).__name__}: line search found no finite loss; step skipped.",
                stacklevel=3,
            )
            return
        move(best)

    def _flat_params(self) -> Tensor:
        return torch.cat(
            [
                p.detach().reshape(-1).double()
                for n, p in self.model.named_parameters()
                if n in self._offsets
            ]
        )

    def _adapt_damping(self, closure, loss_before: float, grads: Tensor, delta: Tensor) -> None:
        self._evaluating = True
        try:
            loss_after = self._global_loss(_loss_only(closure))
        finally:
            self._evaluating = False
        loss_before = self._global_loss(loss_before)
        lam = self.param_groups[0]["damping"]
        d = delta.to(grads.dtype)
        q = float(grads @ d + 0.5 * (d @ self._curvature_matvec(d)) + 0.5 * lam * (d @ d))
        rho = (loss_after - loss_before) / q if q < 0 else float("nan")
        self.last_reduction_ratio = rho
        omega = self.damping_adaptation_decay
        factor = omega if rho > 0.75 else (1 / omega if (rho < 0.25 or rho != rho) else 1.0)
        for g in self.param_groups:
            g["damping"] = g["damping"] * factor

    def _curvature_matvec(self, v: Tensor) -> Tensor:
        """The curvature approximation times a flat vector (no damping)."""
        raise NotImplementedError

    def _needs_refresh(self) -> bool:
        return False

    def _flat_grads(self) -> Optional[Tensor]:
        """The gradients as one flat vector (averaged over the ranks where we sync them)."""
        sync = self._comm is not None and self.sync_grads
        ref = next((p.grad for p in self._offsets_params() if p.grad is not None), None)
        if ref is None and sync:  # every rank must join the all-reduce
            ref = next(iter(self._offsets_params()), None)
        if ref is None:
            return None
        dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
        flat = torch.zeros(self._num_flat, dtype=dtype, device=ref.device)
        for n, p in self.model.named_parameters():
            if n in self._offsets and p.grad is not None:
                o = self._offsets[n]
                flat[o : o + p.numel()] = p.grad.reshape(-1)
        if sync:
            self._comm.all_reduce([flat], "gradients")
            flat /= self._comm.world
            for n, p in self.model.named_parameters():
                if n in self._offsets:
                    o = self._offsets[n]
                    g = flat[o : o + p.numel()].view_as(p).to(p.dtype)
                    if p.grad is not None:
                        p.grad.copy_(g)
                    elif g.any():  # unused here, used on another rank
                        p.grad = g.clone()
        return flat

    def _offsets_params(self) -> Iterable[Tensor]:
        for n, p in self.model.named_parameters():
            if n in self._offsets:
                yield p

    def _group_of(self) -> Dict[Tensor, Dict[str, Any]]:
        return {p: g for g in self.param_groups for p in g["params"]}

    def _apply(self, directions: Tensor, grads: Tensor) -> None:
        """Momentum, decoupled weight decay, KL clipping; ``p -= lr * update``."""
        groups = self._group_of()
        nu = 1.0
        # one host synchronization: the finiteness of the directions (one reduction when
        # all is well) and, for KL clipping, sum_p lr_p^2 d_p . g_p
        checks = [directions.sum()]
        if self.kl_clip is not None:
            dots = [
                groups[p]["lr"] ** 2
                * torch.dot(directions[o : o + p.numel()], grads[o : o + p.numel()])
                for n, p in self.model.named_parameters()
                if p in groups and n in self._offsets
                for o in (self._offsets[n],)
            ]
            checks.append(torch.stack(dots).sum() if dots else directions.new_zeros(()))
        total, *kl = torch.stack(checks).tolist()
        if kl:
            vg = kl[0]
            nu = min(1.0, math.sqrt(self.kl_clip / vg)) if vg > 0 else 1.0
        self.last_kl_scale = nu
        all_finite = math.isfinite(total)
        for n, p in self.model.named_parameters():
            if p not in groups or n not in self._offsets or p.grad is None:
                continue
            g = groups[p]
            o = self._offsets[n]
            d = (nu * directions[o : o + p.numel()]).view_as(p).to(p.dtype)
            if not all_finite and not torch.isfinite(d).all():
                warnings.warn(
                    f"{type(self).__name__}: non-finite update for '{n}' skipped "
                    "(NaN/inf gradients?).",
                    stacklevel=3,
                )
                continue
            if g["weight_decay"]:
                p.mul_(1 - g["lr"] * g["weight_decay"])
            if g["momentum"]:
                state = self.state[p]
                buf = state.get("momentum_buffer")
                if buf is None:
                    buf = state["momentum_buffer"] = d.clone()
                else:
                    buf.mul_(g["momentum"]).add_(d)
                d = buf
            p.add_(d, alpha=-g["lr"])

    # -- state -----------------------------------------------------------------------------
    def _curvature_state(self) -> Dict[str, Any]:
        raise NotImplementedError

    def _load_curvature_state(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError

    def state_dict(self) -> Dict[str, Any]:  # noqa: D102
        sd = super().state_dict()
        sd["curvature"] = {
            "steps": self.steps,
            "skipped_statistics": self.skipped_statistics,
            "generator": self.generator.get_state(),
            **self._curvature_state(),
        }
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # noqa: D102
        state_dict = dict(state_dict)
        curv = state_dict.pop("curvature", None)
        super().load_state_dict(state_dict)
        if curv is None:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state has no 'curvature' entry "
                "(was it saved by a different optimizer?)."
            )
        self.steps = curv["steps"]
        self.skipped_statistics = curv["skipped_statistics"]
        self.generator.set_state(curv["generator"])
        self._load_curvature_state(curv)
        self._reseed()
        self._capture._recording = self._due and not self._closed

    # -- subclass interface ------------------------------------------------------------------
    def _update_statistics(self, step_stats) -> None:
        raise NotImplementedError

    def _refresh(self) -> None:
        raise NotImplementedError

    def _precondition(self, grads: Tensor) -> Tensor:
        raise NotImplementedError


def _merge_stats(a: _Stat, b: _Stat) -> _Stat:
    """The sum of two statistics of one key (both global, or both local)."""
    a.values = [x if y is None else (y if x is None else x + y) for x, y in zip(a.values, b.values)]
    a.shapes = [s if s is not None else t for s, t in zip(a.shapes, b.shapes)]
    a.rows += b.rows
    a.samples += b.samples
    return a


def _check(name: str, arg: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}({arg}={value!r}): {arg} {allowed}.")


def _promote(t: Tensor) -> Tensor:
    """Statistics never accumulate in half precision."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _take(flat: Tensor, index: Tensor) -> Tensor:
    """``flat[index]`` (shaped like ``index``); ``index_select`` is several times faster."""
    return flat.index_select(0, index.reshape(-1)).view(index.shape)


def _put(flat: Tensor, index: Tensor, values: Tensor) -> None:
    """``flat[index] = values`` in place, through ``index_copy_``."""
    flat.index_copy_(0, index.reshape(-1), values.reshape(-1).to(flat.dtype))


def _loss_only(closure: Callable[..., Tensor]) -> float:
    """The closure's loss, evaluated for its value only.

    ``closure(backward=False)`` where the closure takes a ``backward`` keyword (it may
    then skip its backward pass), else ``closure()``; with gradients enabled either way
    (the loss may need input derivatives, e.g. a Laplacian computed by autograd).
    """
    try:
        params = inspect.signature(closure).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature
        params = {}
    takes = "backward" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
    with torch.enable_grad():
        loss = closure(backward=False) if takes else closure()
    return float(loss.detach())
