"""The update rules of the curvature optimizers, as small functions.

Given the flat gradient ``g`` and the preconditioned direction ``d`` (both ``[P]`` over
the trainable parameters, :class:`~curvature.layout.ParamLayout` order):

- :func:`apply_update`: decoupled weight decay, heavy-ball momentum on ``d`` and KL
  clipping, then ``p -= lr * update`` per parameter group;
- :func:`line_search`: the learning rate of a grid with the lowest loss;
- :func:`damping_factor`: the Levenberg-Marquardt rule from the reduction ratio;
- :func:`loss_only`: a closure evaluated for its loss value only.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch
from torch import Tensor

from ..warn import warn


@dataclass(frozen=True)
class ParamSlot:
    """One parameter of the update: its name, tensor, group and flat positions."""

    name: str
    param: Tensor
    group: Dict[str, Any]
    span: slice


def kl_scale(slots: Sequence[ParamSlot], directions: Tensor, grads: Tensor, kl_clip: float):
    """The KL-clipping factor as a 0-dim tensor (computed on the device).

    ``nu = min(1, sqrt(kl_clip / sum_p lr_p^2 d_p^T g_p))`` (Ba, Grosse & Martens, 2017;
    Martens & Grosse, 2015, section 6.5): the update ``-lr nu d`` then changes the model's
    predictive distribution by at most about ``kl_clip`` in KL divergence (to second
    order, with the curvature approximation as the Fisher). ``nu = 1`` when the sum is
    not positive.
    """
    total = directions.new_zeros(())
    for s in slots:
        total = total + s.group["lr"] ** 2 * torch.dot(directions[s.span], grads[s.span])
    nu = torch.sqrt(kl_clip / total.clamp_min(torch.finfo(total.dtype).tiny)).clamp_max(1.0)
    return torch.where(total > 0, nu, torch.ones_like(nu))


def apply_update(
    slots: Sequence[ParamSlot],
    directions: Tensor,
    grads: Tensor,
    state: Dict[Tensor, Dict[str, Any]],
    kl_clip: Optional[float],
    who: str,
) -> float:
    """``p -= lr (momentum buffer of nu d)`` after decoupled weight decay; returns ``nu``.

    One host synchronization reads the finiteness of the directions and, with
    ``kl_clip``, the KL factor ``nu`` (:func:`kl_scale`). A parameter whose update is not
    finite is left unchanged, with a warning naming it.

    Args:
        slots: The parameters with a gradient, their groups and flat spans.
        directions: ``[P]`` preconditioned gradient ``d``.
        grads: ``[P]`` gradient ``g``.
        state: The optimizer's per-parameter state (``momentum_buffer``).
        kl_clip: The KL clipping bound, or ``None``.
        who: The optimizer's name for messages.

    """
    checks = [directions.sum()]
    if kl_clip is not None:
        checks.append(kl_scale(slots, directions, grads, kl_clip).to(directions.dtype))
    total, *kl = torch.stack(checks).tolist()
    nu = kl[0] if kl else 1.0
    all_finite = math.isfinite(total)
    for s in slots:
        p, g = s.param, s.group
        d = (nu * directions[s.span]).view_as(p).to(p.dtype)
        if not all_finite and not torch.isfinite(d).all():
            warn(f"{who}: non-finite update for '{s.name}' skipped (NaN/inf gradients?).")
            continue
        if g["weight_decay"]:
            p.mul_(1 - g["lr"] * g["weight_decay"])
        if g["momentum"]:
            st = state[p]
            buf = st.get("momentum_buffer")
            if buf is None:
                buf = st["momentum_buffer"] = d.clone()
            else:
                buf.mul_(g["momentum"]).add_(d)
            d = buf
        p.add_(d, alpha=-g["lr"])
    return nu


def line_search(
    slots: Sequence[ParamSlot],
    directions: Tensor,
    grid: Sequence[float],
    evaluate: Callable[[], float],
    who: str,
    loss_before: float = float("inf"),
) -> Optional[float]:
    """Take the step ``-lr d`` with the ``lr`` of ``grid`` that gives the lowest loss.

    The grid replaces the groups' learning rates; momentum and weight decay are not
    applied (the variant of Dangel, Mueller & Zeinhofer, 2024, for PINNs). A step is
    only taken if its loss is below ``loss_before`` (the loss at the current
    parameters): when no grid point lowers it, the parameters are kept and ``None`` is
    returned; likewise (with a warning) when no candidate gave a finite loss.
    """
    start = [s.param.detach().clone() for s in slots]

    def move(lr: float) -> None:
        for s, p0 in zip(slots, start):
            s.param.copy_(p0 - lr * directions[s.span].view_as(s.param).to(s.param.dtype))

    best, best_loss = None, float("inf")
    for lr in grid:
        move(lr)
        value = evaluate()
        if value < best_loss:
            best, best_loss = lr, value
    if best is None or not best_loss < loss_before:
        for s, p0 in zip(slots, start):
            s.param.copy_(p0)
        if best is None:
            warn(f"{who}: line search found no finite loss; step skipped.")
        return None
    move(best)
    return best


def damping_factor(rho: float, decay: float) -> float:
    """Levenberg-Marquardt: ``decay`` if ``rho > 3/4``, ``1/decay`` if ``rho < 1/4`` or NaN."""
    if rho > 0.75:
        return decay
    if rho < 0.25 or rho != rho:
        return 1 / decay
    return 1.0


def reduction_ratio(
    loss_before: float,
    loss_after: float,
    grads: Tensor,
    delta: Tensor,
    curvature_delta: Tensor,
    damping: Union[float, Tensor],
) -> float:
    """``rho = (L(x + delta) - L(x)) / q(delta)`` with the damped quadratic model.

    ``q(delta) = g^T delta + 1/2 delta^T C delta + 1/2 sum_i lambda_i delta_i^2`` (``C
    delta`` given as ``curvature_delta``; ``damping`` a number or ``[P]`` per position);
    NaN when ``q >= 0``.
    """
    damped = (damping * delta * delta).sum()
    q = float(grads @ delta + 0.5 * (delta @ curvature_delta) + 0.5 * damped)
    return (loss_after - loss_before) / q if q < 0 else float("nan")


def loss_only(closure: Callable[..., Tensor]) -> float:
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


__all__: List[str] = [
    "ParamSlot",
    "apply_update",
    "damping_factor",
    "kl_scale",
    "line_search",
    "loss_only",
    "reduction_ratio",
]
