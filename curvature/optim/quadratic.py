"""The quadratic-model update rule: learning rate and momentum from a 2x2 solve.

``update_rule="quadratic"`` (Martens & Grosse, 2015, section 7; as in kfac-jax): given
the preconditioned direction ``Delta = -d`` and the previous update ``delta0``, the
update ``delta = alpha Delta + mu delta0`` minimizes the damped local quadratic model

    M(delta) = 1/2 delta^T (C + lambda I) delta + g^T delta

over ``(alpha, mu)``, with ``C`` the exact Gauss-Newton matrix of the closure's loss on
the current batch (not its Kronecker approximation) and ``lambda`` each position's group
damping. With ``v = (Delta, delta0)`` the solution is the 2x2 linear system

    [v_i^T (C + lambda) v_j] (alpha, mu)^T = -[g^T v_i]

(``mu = 0`` and a 1x1 system at the first step). ``C v`` products come from the outputs
that the closure registers (:meth:`~curvature.KFAC.register_output`) or, when it
registers none, from its calls of ``loss_func``: ``v^T C w = (J v)^T H (J w)`` with ``J``
the output's Jacobian (a double backward on the closure's graph) and ``H`` the loss's
Hessian w.r.t. the output; under ``torch.distributed`` these are averaged over the ranks
(the gradient is already).

After the move the closure is evaluated once more (loss only, the same batch): the
reduction ratio ``rho = (h(theta + delta) - h(theta)) / M(delta)`` adapts ``lambda`` by
Levenberg-Marquardt every ``damping_adaptation_interval`` steps, and a step that blows
the loss up (a non-finite loss, or more than twice the loss before) is rejected: the
parameters are kept, the momentum is dropped (``mu = 0`` next step) and ``lambda`` grows by
``decay^(-2^(k-1))`` (``damping_adaptation_decay``) at the ``k``-th rejection in a row, so
by ``decay^(1 - 2^k)`` after ``k`` (the exponent doubles, as in Nielsen's
Levenberg-Marquardt back-off: a ``lambda`` 1e7 times too small recovers in 9 rejections
with the decay 0.95, where a growth by ``1 / decay^k`` took 25).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..linalg import least_squares
from ..warn import warn
from .updates import damping_factor

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


def solve_coefficients(gram: Tensor, damped: Tensor, linear: Tensor) -> Tuple[Tensor, float]:
    """``(c, M)``: ``c = -S^{-1} linear``, ``M = 1/2 c^T S c + linear^T c``, ``S = gram + damped``.

    A singular ``S`` (``delta0`` parallel to ``Delta``) is solved by least squares.
    """
    system = gram + damped
    c = least_squares(system, -linear)
    model = 0.5 * float(c @ system @ c) + float(linear @ c)
    return c, model


def takes_backward(closure: Any) -> bool:
    """Whether ``closure`` accepts a ``backward`` keyword."""
    try:
        params = inspect.signature(closure).parameters
    except (TypeError, ValueError):
        return False
    return "backward" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class QuadraticRule:
    """The ``update_rule="quadratic"`` part of :class:`~curvature.optim.base.CurvatureOptimizer`.

    Attributes:
        last_update_coefficients: ``(alpha, mu)`` of the last step (``None`` before).
        last_model_change: ``M(delta)`` of the last step, the predicted loss change.

    """

    last_update_coefficients: Optional[Tuple[float, float]] = None
    last_model_change: Optional[float] = None

    def _check_quadratic(self, closure: Any) -> None:
        """Refuse what the rule cannot do: weight decay (``closure=None``: at construction),
        a step without a ``backward``-keyword closure (``closure``: at ``step``).
        """
        if self.config.update_rule != "quadratic":
            return
        who = type(self).__name__
        if closure is None and any(g["weight_decay"] for g in self.param_groups):
            raise ValueError(
                f"{who}(update_rule='quadratic', weight_decay>0): not supported; add the "
                "penalty to the loss."
            )
        if closure is not None and not takes_backward(closure):
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
        who = type(self).__name__
        slots = self._slots()
        previous = [self.state[s.param].get("previous_update") for s in slots]
        vectors = [-directions]
        if all(p is not None for p in previous):
            vectors.append(torch.cat([p.reshape(-1).to(directions.dtype) for p in previous]))
        outputs = self._closure_outputs(closure)
        if not outputs:
            raise ValueError(
                f"{who}(update_rule='quadratic'): the closure neither registered an output "
                "nor called loss_func on one; the rule needs the Gauss-Newton matrix of the "
                "loss (call loss_func inside the closure, or optim.register_output)."
            )
        params = [s.param for s in slots]
        spans = [s.span for s in slots]
        as_lists = [[v[sp].view_as(p) for sp, p in zip(spans, params)] for v in vectors]
        self._collector.evaluating = True  # the loss_func calls below are not training
        try:
            gram = ggn_gram(outputs, params, as_lists)
        finally:
            self._collector.evaluating = False
        if self._comm is not None:  # the GGN of the union of the ranks' batches
            shared = gram.to(self._comm.device)
            self._comm.all_reduce([shared], "quadratic model")
            gram = shared.cpu() / self._comm.world
        lam = self._damping_vector(directions)
        V = torch.stack(vectors)  # [K, P]: the damped Gram and the slopes read in two copies
        damped = ((V * lam) @ V.T).to(torch.float64).cpu()
        linear = (V @ grads.to(V.dtype)).to(torch.float64).cpu()
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
            factor = damping_factor(self.last_reduction_ratio, decay) if due else 1.0
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
