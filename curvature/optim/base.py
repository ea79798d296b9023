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

Statistics of the forwards between two ``step()`` calls (gradient accumulation) are
averaged, then folded into running estimates with ``factor_decay`` every
``factor_every`` steps; decompositions are refreshed every ``inverse_every`` steps.
Statistics accumulate in float32 (float64 for float64 models) whatever the model dtype.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ..capture import Capture, WeakHook, _unwrap
from ..layers import LayerRule
from ..losses import (
    FISHER_TYPES,
    SUPPORTED_LOSSES,
    backprop_sources,
    check_loss,
    reduction_scale,
)

_UNSUPPORTED = ("warn", "error", "diagonal")


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
        self.generator = torch.Generator().manual_seed(seed)
        self.steps = 0
        self.skipped_statistics = 0
        self._registered = False
        self._term = 0
        self._forward_scale = 1.0

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
        # empirical: fold the calls whose backward already ran (bounded memory under
        # gradient accumulation); calls still waiting for their backward stay.
        if self.fisher == "empirical":
            self._consume(self._capture.take_pushed(), scale_by_reduction=True)
        self._forward_scale = self._loss_scale()
        self._capture._recording = self._due and self.model.training and not self._closed

    def _on_forward_end(self, output: Any) -> None:
        if self._evaluating:
            return
        if not (self._due and self.model.training and torch.is_grad_enabled()):
            return
        if self.fisher == "forward-only":
            calls = [(n, m, r, cs) for n, m, r, cs in self._capture._active()]
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
            self._step_stats.clear()
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
        if not torch.isfinite(output.detach()).all():
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
        reached = []
        for name, module, rule, cs in self._capture._active():
            done = [c for c in cs if c.grads is not None]
            if done:
                reached.append((name, module, rule, done))
                if not keep_calls:
                    self._capture._calls[name] = [c for c in cs if c.grads is None]
        self._consume(reached)

    def _consume(self, calls, with_g: bool = True, scale_by_reduction: bool = False) -> None:
        """Fold calls (with ``grads`` set) into this step's statistics, then release them."""
        with self._capture._computing():
            for name, module, rule, cs in calls:
                if scale_by_reduction:  # user backward: g = R grad l_n, no [K] axis yet
                    for c in cs:
                        N = rule.batch_size(module, c)
                        scale = _reduction_rescale(self.loss_func, N) / self._forward_scale
                        c.grads = [(_promote(g) * scale).unsqueeze(0) for g in c.grads]
                else:
                    for c in cs:
                        if c.grads is not None:
                            c.grads = [_promote(g) for g in c.grads]
                self._accumulate(name, module, rule, cs, with_g)

    def _accumulate(self, name, module, rule, calls, with_g) -> None:
        raise NotImplementedError

    def _add_step_stat(
        self, key: Tuple[str, str], values: Sequence[Optional[Tensor]], count
    ) -> None:
        """Add statistics sums of one forward, skipping non-finite ones (counted).

        Keys get the current term appended: ``(name, suffix, term)``.
        """
        key = (*key, self._term if self._registered else 0)
        if any(v is not None and not torch.isfinite(v).all() for v in values):
            self.skipped_statistics += 1
            return
        slot = self._step_stats.get(key)
        if slot is None:
            self._step_stats[key] = [list(values), count, 1]
            return
        slot[0] = [a if b is None else (b if a is None else a + b) for a, b in zip(slot[0], values)]
        slot[1] += count
        slot[2] += 1

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
        if self._due and self._step_stats:
            self._update_statistics(self._step_stats)
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
                with torch.enable_grad():
                    value = float(closure().detach())
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
            with torch.enable_grad():
                loss_after = float(closure().detach())
        finally:
            self._evaluating = False
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
        ref = None
        for p in self._offsets_params():
            if p.grad is not None:
                ref = p.grad
                break
        if ref is None:
            return None
        dtype = torch.float64 if ref.dtype == torch.float64 else torch.float32
        flat = torch.zeros(self._num_flat, dtype=dtype, device=ref.device)
        for n, p in self.model.named_parameters():
            if n in self._offsets and p.grad is not None:
                o = self._offsets[n]
                flat[o : o + p.numel()] = p.grad.reshape(-1)
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
        if self.kl_clip is not None:
            vg = 0.0
            for n, p in self.model.named_parameters():
                if p in groups and n in self._offsets:
                    o = self._offsets[n]
                    lr = groups[p]["lr"]
                    vg += lr**2 * float(
                        (directions[o : o + p.numel()] * grads[o : o + p.numel()]).sum()
                    )
            nu = min(1.0, math.sqrt(self.kl_clip / vg)) if vg > 0 else 1.0
        self.last_kl_scale = nu
        for n, p in self.model.named_parameters():
            if p not in groups or n not in self._offsets or p.grad is None:
                continue
            g = groups[p]
            o = self._offsets[n]
            d = (nu * directions[o : o + p.numel()]).view_as(p).to(p.dtype)
            if not torch.isfinite(d).all():
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
        self._capture._recording = self._due and not self._closed

    # -- subclass interface ------------------------------------------------------------------
    def _update_statistics(self, step_stats) -> None:
        raise NotImplementedError

    def _refresh(self) -> None:
        raise NotImplementedError

    def _precondition(self, grads: Tensor) -> Tensor:
        raise NotImplementedError


def _check(name: str, arg: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}({arg}={value!r}): {arg} {allowed}.")


def _reduction_rescale(loss_func: Optional[nn.Module], N: int) -> float:
    """``1 / sqrt(R)``: ``g -> sqrt(N) g`` for a mean loss (also without loss_func), 1 for a sum."""
    R = 1.0 / N if loss_func is None else reduction_scale(loss_func, N)
    return R**-0.5


def _promote(t: Tensor) -> Tensor:
    """Statistics never accumulate in half precision."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
