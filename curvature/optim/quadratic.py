"""The quadratic-model update rule: learning rate and momentum from a 2x2 solve.

``update_rule="quadratic"`` (Martens & Grosse, 2015, section 7; as in kfac-jax): given
the preconditioned direction ``Delta = -d`` and the previous update ``delta0``, the
update ``delta = alpha Delta + mu delta0`` minimizes the damped local quadratic model

    M(delta) = 1/2 delta^T (C + lambda I) delta + g^T delta

over ``(alpha, mu)``, with ``C`` the exact Gauss-Newton matrix of the closure's loss on
the current batch (not its Kronecker approximation) and ``lambda`` each position's group
damping. With ``v = (Delta, delta0)`` the solution is the 2x2 linear system

    [v_i^T (C + lambda) v_j] (alpha, mu)^T = -[g^T v_i]

(``mu = 0`` and a 1x1 system at the first step). With ``fisher="type-2"`` the products
``v^T C w`` come from the statistics that the closure's own step pulled (the layer inputs
and the loss Hessian's square root pulled to the layer outputs, as in the plain loop
below: no extra pass). Otherwise (sampled pulls: ``"mc"``, ``"rademacher"``; none this
step) the closure is evaluated once more, keeping the graph of the outputs it registers
(:meth:`~curvature.KFAC.register_output`) or, when it registers none, of its calls of
``loss_func``: ``v^T C w = (J v)^T H (J w)`` with ``J`` the output's Jacobian (a double
backward on that graph) and ``H`` the loss's Hessian w.r.t. the output. Under
``torch.distributed`` these are averaged over the ranks (the gradient is already).

After the move the closure is evaluated once more (loss only, the same batch): the
reduction ratio ``rho = (h(theta + delta) - h(theta)) / M(delta)`` adapts ``lambda`` by
Levenberg-Marquardt every ``damping_adaptation_interval`` steps (``factor_damping="greedy"``:
the factors' damping apart, :mod:`.factor_damping`), and a step that blows
the loss up (a non-finite loss, or more than twice the loss before) is rejected: the
parameters are kept, the momentum is dropped (``mu = 0`` next step) and ``lambda`` grows by
``decay^(-2^(k-1))`` (``damping_adaptation_decay``) at the ``k``-th rejection in a row, so
by ``decay^(1 - 2^k)`` after ``k`` (the exponent doubles, as in Nielsen's
Levenberg-Marquardt back-off: a ``lambda`` 1e7 times too small recovers in 9 rejections
with the decay 0.95, where a growth by ``1 / decay^k`` took 25).

**Plain loop** (``step()`` without a closure): the user's backward has freed the graph by
the time ``Delta`` is known, so the products come from the curvature backward the
optimizer ran on that graph (``"mc"``, ``"type-2"``, ``"rademacher"``): the collector keeps
each pulled layer's expanded inputs ``a [N, S, C, D]`` and source gradients
``g [L, N, S, C, D_out]`` until ``step()``, and ``(J v)^T s_l = sum g^T V a`` per sample and
source gives ``v^T F w`` for the batch's Fisher / GGN ``F`` (``_batch_gram``); without
them (``"empirical"``, a step off ``factor_every``, a layer without that structure) the
Kronecker-factored curvature. The loss of the step's batch is read from its forward's
``loss_func`` calls; at each adaptation the step is measured on that batch by one more
forward without gradients (:mod:`.replay`, ``reduction_ratio="same_batch"``) and on the
next batches by their forwards' losses, summed over the interval, and ``lambda`` moves
only where both agree (:func:`~.updates.checked_factor`); a blow-up is rolled back at the next
``step()``. Everything stays on the device except one read per damping adaptation.
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from ..options import FisherType
from ..warn import warn
from .batch_gram import DirectionBuffers, Projection, batch_gram, projection_of
from .factor_damping import GreedyFactorDamping, lowest_model
from .quadratic_solve import plain_dtype, solve_coefficients, solve_on_device
from .updates import checked_factor, damping_factor

Output = Tuple[Tensor, nn.Module, Optional[Tensor]]


def _dummy_target(output: Tensor, loss_func: nn.Module) -> Tensor:
    """A target of the right kind: the loss Hessian w.r.t. the output does not depend on it."""
    if isinstance(loss_func, nn.CrossEntropyLoss):
        shape = output.shape[:1] + output.shape[2:]
        return torch.zeros(shape, dtype=torch.long, device=output.device)
    return torch.zeros_like(output)


def ggn_gram(outputs: Sequence[Output], params: Sequence[Tensor], vectors: Sequence[list]):
    """``[k, k]``: ``v_i^T C v_j`` with ``C = sum_o J_o^T H_o J_o`` over the outputs.

    Args:
        outputs: ``(output, loss_func, target)`` with the output's graph alive.
        params: The trainable parameters.
        vectors: ``k`` lists of tensors shaped like ``params``.

    """
    k = len(vectors)
    gram = torch.zeros(k, k, dtype=torch.float64)
    with torch.enable_grad():
        for out, loss_func, target in outputs:
            z = torch.zeros_like(out, requires_grad=True)
            vjp = torch.autograd.grad(out, params, z, create_graph=True, allow_unused=True)
            used = [i for i, g in enumerate(vjp) if g is not None]
            if not used:
                continue
            jvps = [
                torch.autograd.grad(
                    [vjp[i] for i in used], z, [v[i].to(out.dtype) for i in used], retain_graph=True
                )[0]
                for v in vectors
            ]
            o = out.detach().requires_grad_(True)
            target = _dummy_target(o, loss_func) if target is None else target
            (grad_o,) = torch.autograd.grad(loss_func(o, target), o, create_graph=True)
            hjvps = [torch.autograd.grad(grad_o, o, jv, retain_graph=True)[0] for jv in jvps]
            gram += torch.stack(
                [torch.stack([(a * b).sum().double() for b in hjvps]) for a in jvps]
            ).cpu()
    return (gram + gram.T) / 2


def takes_backward(closure: Any) -> bool:
    """Whether ``closure`` accepts a ``backward`` keyword."""
    try:
        params = inspect.signature(closure).parameters
    except (TypeError, ValueError):
        return False
    return "backward" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class QuadraticRule(GreedyFactorDamping):
    """The ``update_rule="quadratic"`` part of :class:`~curvature.optim.base.CurvatureOptimizer`.

    Attributes:
        last_update_coefficients: ``(alpha, mu)`` of the last step (``None`` before).
        last_model_change: ``M(delta)`` of the last step, the predicted loss change.

    """

    _coefficients: Any = None  # (alpha, mu): floats, or a device [2] in a plain loop
    _model_change: Any = None
    _taken: Any = True

    @property
    def last_update_coefficients(self) -> Optional[Tuple[float, float]]:
        """``(alpha, mu)`` of the last step (``None`` before; read from the device)."""
        c = self._coefficients
        return tuple(c.tolist()) if isinstance(c, Tensor) else c

    @last_update_coefficients.setter
    def last_update_coefficients(self, value: Any) -> None:
        self._coefficients = value

    @property
    def last_model_change(self) -> Optional[float]:
        """``M(delta)`` of the last step, the predicted loss change (``0.0``: no move)."""
        m = self._model_change
        return float(m) if isinstance(m, Tensor) else m

    @last_model_change.setter
    def last_model_change(self, value: Any) -> None:
        self._model_change = value

    @property
    def last_step_taken(self) -> bool:
        """``False`` when the last step kept the parameters (a rejected or skipped step)."""
        t = self._taken
        return bool(t) if isinstance(t, Tensor) else t

    @last_step_taken.setter
    def last_step_taken(self, value: Any) -> None:
        self._taken = value

    def state_dict(self) -> Dict[str, Any]:
        """``torch.optim``'s state; the plain loop's ``previous_update`` states as tensors of
        their own (they are views of its persistent buffers, 4x their size).
        """
        sd = super().state_dict()
        buffers = self.__dict__.get("_plain_buffers")
        if buffers is not None:
            sd["state"] = {i: buffers.detached(st) for i, st in sd["state"].items()}
        return sd

    def _check_quadratic(self, closure: Any) -> None:
        """Refuse what the rule cannot do: weight decay (``closure=None``: at construction),
        a step without a ``backward``-keyword closure (``closure``: at ``step``).
        """
        if self.config.update_rule != "quadratic":
            return
        if closure is not None:  # (False: a step without a closure)
            self._check_greedy(closure or None)
        who = type(self).__name__
        if closure is None and any(g["weight_decay"] for g in self.param_groups):
            raise ValueError(
                f"{who}(update_rule='quadratic', weight_decay>0): not supported; add the "
                "penalty to the loss."
            )
        if callable(closure) and not takes_backward(closure):
            raise ValueError(
                f"{who}(update_rule='quadratic').step() needs a closure with a backward "
                "keyword (def closure(backward=True): ...): the rule evaluates it once more "
                "without backward and differentiates its outputs' graph."
            )

    def _closure_outputs(self, closure) -> List[Output]:
        """Evaluate the closure (loss only) and keep its outputs with their graphs."""
        sink: dict = {"registered": [], "called": []}
        self._collector.sink = sink
        try:
            self._evaluate(closure)
        finally:
            self._collector.sink = None
        return sink["registered"] or sink["called"]

    def _quadratic_update(self, closure, loss: Tensor, grads: Tensor, directions: Tensor) -> None:
        """Choose ``(alpha, mu)`` by the 2x2 solve and move the parameters."""
        unused = [s.span for s in self._slots() if s.param.grad is None]
        if unused:  # as in torch.optim, a parameter without a gradient does not move
            directions = directions.clone()
            for span in unused:
                directions[span] = 0
        if closure is None:
            self._plain_quadratic_update(grads, directions)
            return
        self._collector.losses.clear()  # the closure's own calls: not a plain loop's losses
        who = type(self).__name__
        slots = self._slots()
        previous = [self.state[s.param].get("previous_update") for s in slots]
        heads = self._greedy_heads(grads, directions, unused) if self._greedy_due() else []
        vectors = [-d for d in heads] if heads else [-directions]
        if all(p is not None for p in previous):
            moving = self._moving(slots, previous)
            vectors.append(torch.cat([p.reshape(-1).to(directions.dtype) for p in moving]))
        V = torch.stack(vectors)  # [K, P]
        # type-2 in one process: the exact GGN of the closure's batch from the statistics
        # its backward pulled (no second forward, no double backward); else (sampled pulls,
        # none this step, or torch.distributed, whose union weighing needs the closure's
        # outputs) from a second evaluation of the closure that keeps its outputs' graph
        exact = self.config.fisher is FisherType.TYPE2 and self._comm is None
        gram = self._closure_batch_gram(V) if exact else None
        if gram is None:
            gram = self._closure_gram(closure, vectors)
        lam = self._damping_vector(directions)
        damped = ((V * lam) @ V.T).to(torch.float64).cpu()
        linear = (V @ grads.to(V.dtype)).to(torch.float64).cpu()
        if heads:  # keep the candidate with the lowest M(delta) (and the previous update)
            i, models = lowest_model(gram, damped, linear, len(heads), solve_coefficients)
            self._greedy_settle(i, models)
            keep = [i] + list(range(len(heads), len(vectors)))
            gram, damped, linear = gram[keep][:, keep], damped[keep][:, keep], linear[keep]
            vectors = [vectors[j] for j in keep]
        c, model = solve_coefficients(gram, damped, linear)
        if not (torch.isfinite(c).all() and math.isfinite(model)) or model >= 0:
            warn(
                f"{who}(update_rule='quadratic'): the quadratic model has no descent; step skipped."
            )
            self.last_step_taken = False
            return
        delta = sum(float(ci) * v for ci, v in zip(c, vectors))
        steps = [delta[s.span].view_as(s.param).to(s.param.dtype) for s in slots]
        start = [s.param.detach().clone() for s in slots]
        for s, step in zip(slots, steps):
            s.param.add_(step)
        before, after = self._global_loss(float(loss)), self._evaluate(closure)
        self.last_reduction_ratio = (after - before) / model
        self.last_update_coefficients = (float(c[0]), float(c[1]) if len(c) > 1 else 0.0)
        self.last_model_change = model
        # non-monotone: only a blow-up is rejected (momentum steps often raise the loss a
        # little and still pay off; rejecting them all kills the momentum)
        self.last_step_taken = after <= before + abs(before)
        group = self.param_groups[0]
        decay = self.config.damping_adaptation_decay
        if self.last_step_taken:
            group["quadratic_rejections"] = 0
            for s, step in zip(slots, steps):
                self.state[s.param]["previous_update"] = step.clone()
            due = self.steps % self.config.damping_adaptation_interval == 0
            factor = self._model_damping_factor(self.last_reduction_ratio, decay) if due else 1.0
        else:
            for s, p0 in zip(slots, start):
                s.param.copy_(p0)
                self.state[s.param].pop("previous_update", None)
            group["quadratic_rejections"] = group.get("quadratic_rejections", 0) + 1
            # the k-th rejection in a row multiplies lambda by decay^(-2^(k-1)): the exponent
            # doubles (Nielsen's back-off), so a lambda many orders too small recovers in
            # O(log) rejections, each of which costs a whole step
            factor = decay ** -(2 ** (group["quadratic_rejections"] - 1))
        for g in self.param_groups:
            g["damping"] = g["damping"] * factor

    def _closure_gram(self, closure, vectors: List[Tensor]) -> Tensor:
        """``[K, K]``: ``v_i^T C v_j`` with ``C`` the GGN of the closure's outputs, from a
        second evaluation of the closure that keeps their graph (:func:`ggn_gram`).
        """
        self._collector.projections.clear()  # the closure's statistics (not used here)
        outputs = self._closure_outputs(closure)
        if not outputs:
            raise ValueError(
                f"{type(self).__name__}(update_rule='quadratic'): the closure neither "
                "registered an output nor called loss_func on one; the rule needs the "
                "Gauss-Newton matrix of the loss (call loss_func inside the closure, or "
                "optim.register_output)."
            )
        slots = self._slots()
        params = [s.param for s in slots]
        as_lists = [[v[s.span].view_as(s.param) for s in slots] for v in vectors]
        self._collector.evaluating = True  # the loss_func calls below are not training
        try:
            gram = ggn_gram(outputs, params, as_lists)
        finally:
            self._collector.evaluating = False
        if self._comm is not None:  # the GGN of the union of the ranks' batches
            gram = self._union_gram(gram, outputs)
        return gram

    def _closure_batch_gram(self, V: Tensor) -> Optional[Tensor]:
        """:meth:`_local_batch_gram` of the closure step's pulled statistics (on the host),
        or ``None`` where they give none (no pull, a layer without linear structure).
        """
        records = self._collector.projections
        gram = self._local_batch_gram(V, records)[0] if records else None
        records.clear()
        return None if gram is None else gram.cpu()

    def _union_gram(self, gram: Tensor, outputs: Sequence[Output]) -> Tensor:
        """The closure rule's Gram matrix of the union batch: mean-reduction losses weigh
        each rank by its samples (the leading size of its outputs), sum-reduction ones add
        the ranks; one all-reduce of ``K * K + 1`` values.
        """
        reductions = {getattr(loss_func, "reduction", "mean") for _, loss_func, _ in outputs}
        if len(reductions) > 1:
            raise ValueError(
                f"{type(self).__name__}(update_rule='quadratic') under torch.distributed: the "
                f"closure's outputs mix loss reductions {sorted(reductions)}; the ranks' "
                "Gauss-Newton matrices cannot be combined into the union batch's. Use one."
            )
        mean = reductions == {"mean"}
        weight = float(sum(out.shape[0] if out.dim() else 1 for out, _, _ in outputs))
        weight = weight if mean else 1.0
        flat = torch.cat([gram.reshape(-1) * weight, gram.new_full((1,), weight)])
        shared = flat.to(self._comm.device)
        self._comm.all_reduce([shared], "quadratic model")
        shared = shared.cpu()
        K = gram.shape[0]
        return shared[:-1].view(K, K) / (shared[-1] if mean else 1.0)

    # -- plain loop: no closure ----------------------------------------------------------------
    def _plain_records(self) -> None:
        """The plain-loop rule's records on the collector: pulled projections and losses;
        the same-batch replay in one process with ``reduction_ratio="same_batch"``.
        """
        on = self.config.update_rule == "quadratic"
        self._collector.projections = [] if on else None
        same = self.config.reduction_ratio == "same_batch"
        replay = self._collector.replay
        replay.enabled = on and same and self._comm is None
        replay.wanted = weakref.WeakMethod(self._adaptation_step)  # (the others: not used)

    def _adaptation_step(self) -> bool:
        """Whether the step about to run (or running) adapts the damping."""
        return self.steps > 0 and self.steps % self.config.damping_adaptation_interval == 0

    def _loss_modules(self) -> List[nn.Module]:
        """The loss modules whose buffers a replay restores."""
        loss = self.config.loss_func
        return [loss] if isinstance(loss, nn.Module) else []

    def _observed_loss(self, like: Tensor) -> Tuple[Tensor, int]:
        """``(h, N)``: ``sum_i w_i L_i`` of this rank's ``loss_func`` values since the last
        step, ``w_i`` from their backward (:class:`~.pending.LossRecord`), and their samples.
        """
        mine = {id(p) for p in self.layout.params}
        seen = self._collector.losses  # (a rebuilt collector keeps the old one's list)
        kept = [r for r in seen if reaches(r.into.grad_fn, mine)]
        seen.clear()
        self._collector.replay.confirm(kept)
        if not kept:
            raise ValueError(
                f"{type(self).__name__}(update_rule='quadratic').step() without a closure "
                "measures each step with the loss of its forward: call the loss_func "
                "passed to the optimizer in the training loop (a scalar loss, model in train "
                "mode, gradients enabled), or pass a closure with a backward keyword."
            )
        h = torch.stack([(r.value * r.weight).to(like.device, plain_dtype(like)) for r in kept])
        return h.sum(), sum(r.into.shape[0] if r.into.dim() else 1 for r in kept)

    @staticmethod
    def _moving(slots, previous: List[Tensor]) -> List[Tensor]:
        """The previous update per parameter; zero where a parameter has no gradient."""
        return [
            p if s.param.grad is not None else torch.zeros_like(p) for s, p in zip(slots, previous)
        ]

    def _plain_quadratic_update(self, grads: Tensor, directions: Tensor) -> None:
        """The rule without a closure: ``C`` is the batch Fisher / GGN from the pulled
        statistics (:meth:`_batch_gram`; else the Kronecker-factored curvature), the loss
        of the next forward measures the step, a blow-up is rolled back one step later.

        Every quantity stays on the device (``torch.where`` selects); the host reads the
        interval's sums once every ``damping_adaptation_interval`` steps. A step that does
        not move (a rollback, a rebuild: ``keep`` false) zeroes ``(alpha, mu)``, so the
        momentum needs no mask of its own.
        """
        group, slots = self.param_groups[0], self._slots()
        previous = [self.state[s.param].get("previous_update") for s in slots]
        with_momentum = all(p is not None for p in previous)
        buffers = self.__dict__.setdefault("_plain_buffers", DirectionBuffers())
        moving = self._moving(slots, previous) if with_momentum else None
        V, out = buffers.directions(self.layout, directions, moving)
        # the loss and the batch Gram matrix are averaged over the ranks in one all-reduce
        h, batch = self._batch_gram(V, *self._observed_loss(grads))
        seen, zero = h, h.new_zeros(())
        ref = group.get("quadratic_loss")
        # after a rebuild (parameters (un)frozen) the curvature restarts: measure, no move
        same = self.__dict__.get("_plain_layout", self.layout) is self.layout
        keep = torch.full((), same, dtype=torch.bool, device=h.device)
        self._plain_layout = self.layout
        if ref is not None:  # judge the last step by this forward's loss
            ref, last_model = ref.to(h), group["quadratic_model"].to(h)
            # a blow-up: not finite, or twice the larger of the last loss and the running
            # level of the kept losses (batches of one model differ by 2x and more when the
            # loss is small: the last batch's loss alone rejected sound steps)
            level = torch.maximum(ref, group.get("quadratic_level", ref).to(h))
            bad = ~torch.isfinite(h) | (h > level + level.abs())
            counted = (last_model < 0) & ~bad
            group["quadratic_actual"] = group["quadratic_actual"] + torch.where(
                counted, h - ref, zero
            )
            group["quadratic_predicted"] = group["quadratic_predicted"] + torch.where(
                counted, last_model, zero
            )
            group["quadratic_bad"] = group["quadratic_bad"] + bad.to(h.dtype)
            h = torch.where(bad, ref, h)  # the loss at the parameters we keep
            group["quadratic_level"] = torch.where(bad, level, 0.9 * level + 0.1 * h)
            keep = keep & ~bad
            if with_momentum:  # roll the blown-up step back (p - delta0 * bad)
                back = {p.dtype: -bad.to(p.dtype) for p in previous}
                for s, p in zip(slots, previous):
                    s.param.addcmul_(p, back[p.dtype])
        else:
            for key in ("quadratic_actual", "quadratic_predicted", "quadratic_bad"):
                group[key] = zero
        if batch is None:  # no pulled statistics this step: the Kronecker-factored curvature
            gram = V @ torch.stack([self._curvature_matvec(v) for v in V]).T
        else:
            gram = batch
        dampings = {g["damping"] for g in self.param_groups}
        if len(dampings) == 1:  # lambda V V^T
            damped = dampings.pop() * (V @ V.T)
        else:  # each position's group damping
            damped = (V * self._damping_vector(directions)) @ V.T
        system = (gram.to(V.dtype) + damped).to(h.dtype)
        linear = (V @ grads.to(V.dtype)).to(h.dtype)
        c, model = solve_on_device((system + system.T) / 2, linear)
        ok = keep & torch.isfinite(c).all() & torch.isfinite(model) & (model < 0)
        c, model = torch.where(ok, c, zero), torch.where(ok, model, zero)
        torch.mm(c[: V.shape[0]].to(V.dtype).unsqueeze(0), V, out=out.unsqueeze(0))
        delta = out.masked_fill_(~ok, 0.0)
        steps = [delta[s.span].view_as(s.param).to(s.param.dtype) for s in slots]
        torch._foreach_add_([s.param for s in slots], steps)
        for s, step in zip(slots, steps):
            self.state[s.param]["previous_update"] = step
        buffers.written(steps)
        group["quadratic_loss"], group["quadratic_model"] = h, model
        self._coefficients, self._model_change, self._taken = c, model, ok
        if self._adaptation_step():
            # this step judged on its own batch (one more forward), where it was recorded
            after = self._collector.replay.loss(self._loss_modules())
            own = None if after is None else [after.to(h) - seen, model]
            self._plain_adapt_damping(group, own and [torch.where(ok, x, zero) for x in own])

    def _batch_gram(self, V: Tensor, h: Tensor, n: int) -> Tuple[Tensor, Optional[Tensor]]:
        """``(h, [K, K])``: the loss ``h`` of ``n`` samples and ``v_i^T F v_j`` with ``F`` the
        Fisher of this step's last pull (the MC / type-2 / Rademacher curvature of the
        batch, not its Kronecker approximation), from the pulled layer inputs ``a`` and
        output gradients ``g`` the collector kept:
        ``u_i[k, n] = sum_layers sum_s g[k, n, s]^T V_i a[n, s]`` (``(J v_i)^T`` times the
        ``k``-th source) and ``F = scale * sum_{k, n} u_i u_j`` per term. ``None`` when
        nothing was pulled (``"empirical"``, a step off ``factor_every``).

        Under ``torch.distributed`` both become the union batch's in one all-reduce: ``h``
        (each rank's ``sum_i w_i L_i``) is averaged over the ranks as the gradients are;
        the Gram matrix of a mean-reduction loss weighs each rank by its samples, of a sum
        one adds the ranks. The Gram part runs whenever a pull was due (the same on every
        rank), also on a rank that pulled nothing (an empty batch: weight 0), so that no
        rank skips what the others run.
        """
        records = self._collector.projections
        pulled = self.config.fisher.value in ("mc", "type-2", "rademacher")
        shared = self._comm is not None and pulled and self._collector.due
        empty = not records  # (a rank with an empty batch pulled nothing)
        local, samples = (None, 0) if empty and not shared else self._local_batch_gram(V, records)
        records.clear()
        if self._comm is None:
            return h, local
        mean = getattr(self.config.loss_func, "reduction", "mean") == "mean"
        # [2 + K * K + 3]: the weighted loss and its weight; the weighted Gram matrix, its
        # weight, the number of ranks that found a layer without linear structure (then
        # every rank that pulled anything found it) and the number that pulled anything
        K = V.shape[0]
        payload = V.new_zeros(2 + (K * K + 3 if shared else 0), dtype=torch.float64)
        payload[:2] = torch.stack([h.to(payload.dtype), h.new_ones((), dtype=payload.dtype)])
        if shared and local is None:
            payload[3 + K * K] = 1.0
        elif shared:
            weight = float(samples) if mean else 1.0
            payload[2 : 2 + K * K] = local.reshape(-1) * weight
            payload[2 + K * K] = weight
        if shared:
            payload[4 + K * K] = float(not empty)
        self._comm.all_reduce([payload], "quadratic model")
        h = (payload[0] / payload[1]).to(h.dtype)
        if local is None or not shared:
            return h, None
        gram = payload[2 : 2 + K * K].view(K, K)
        gram = gram / payload[2 + K * K] if mean else gram
        if empty:  # the others decide, on the device (no read): the Kronecker curvature
            # where one found no linear structure or none pulled anything
            kron = V @ torch.stack([self._curvature_matvec(v) for v in V]).T
            fallback = (payload[3 + K * K] > 0) | (payload[4 + K * K] == 0)
            gram = torch.where(fallback, kron.to(gram.dtype), gram)
        return h, gram

    def _local_batch_gram(self, V: Tensor, records: list) -> Tuple[Optional[Tensor], int]:
        """The :meth:`_batch_gram` of this rank's records (zeros without any) and the
        samples of its pull (0 without one): :func:`~curvature.optim.batch_gram.batch_gram`.
        """
        return batch_gram(V, records, lambda name: self._projection_index(name, V.device))

    def _projection_index(self, name: str, device: torch.device) -> Optional[Dict[str, Projection]]:
        """A layer's ``kfac_index``: suffix to the flat positions ``[C, D_out, D]``
        (:class:`~curvature.optim.batch_gram.Projection`: strided spans where they are).
        """
        cache = self.__dict__.setdefault("_projection_ix", {})
        if cache.get("layout") is not self.layout:  # a rebuild (parameters (un)frozen)
            cache.clear()
            cache["layout"] = self.layout
        if (name, device) not in cache:
            module, rule = self._collector.layers[name]
            starts = {
                id(p): self.layout.span(n).start
                for n, p in zip(self.layout.names, self.layout.params)
            }
            offsets = {n: starts[id(p)] for n, p in module.named_parameters() if id(p) in starts}
            index = rule.kfac_index(module, offsets)
            cache[(name, device)] = index and {
                k: projection_of(v, device) for k, v in index.items()
            }
        return cache[(name, device)]

    def _plain_adapt_damping(self, group, same: Optional[List[Tensor]] = None) -> None:
        """Levenberg-Marquardt on the actual and predicted changes (one host read): of
        this step on its own batch where it was replayed (``same``), else summed over the
        interval (the next batches' losses); rejections in the interval raise ``lambda``.
        """
        keys = ("quadratic_actual", "quadratic_predicted", "quadratic_bad")
        read = torch.stack([group[k] for k in keys] + (same or [])).tolist()
        actual, predicted, bad = read[:3] if same is None else read[3:] + read[2:3]
        zero = group["quadratic_actual"].new_zeros(())
        for key in ("quadratic_actual", "quadratic_predicted", "quadratic_bad"):
            group[key] = zero
        # per interval decay^interval (Martens & Grosse's omega = (19/20)^T1): a rate per step
        decay = self.config.damping_adaptation_decay**self.config.damping_adaptation_interval
        streak = group.get("quadratic_rejections", 0)
        if bad > 0:  # 1/decay^k at the k-th rejection in a row
            factor = math.prod(decay ** -(streak + i) for i in range(1, int(bad) + 1))
            group["quadratic_rejections"] = streak + int(bad)
        else:
            group["quadratic_rejections"] = 0
            rho = actual / predicted if predicted < 0 else None
            self.last_reduction_ratio = rho
            if same is not None:
                factor = checked_factor(rho, read[0], read[1], decay)
            else:
                factor = 1.0 if rho is None else damping_factor(rho, decay)
        for g in self.param_groups:
            g["damping"] = g["damping"] * factor


def reaches(node: Any, params: Set[int]) -> bool:
    """Whether the autograd graph under ``node`` accumulates into one of ``params`` (ids):
    the loss is this model's (a walk that stops at the first parameter found).
    """
    stack, seen = [node], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if id(getattr(node, "variable", None)) in params:
            return True
        seen.add(node)
        stack.extend(f for f, _ in node.next_functions)
    return False
