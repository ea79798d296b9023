"""The update rules of the curvature optimizers, as small functions.

Given the flat gradient ``g`` and the preconditioned direction ``d`` (both ``[P]`` over
the trainable parameters, :class:`~curvature.layout.ParamLayout` order):

- :func:`apply_update`: decoupled weight decay, heavy-ball momentum on ``d`` and KL
  clipping, then ``p -= lr * update`` per parameter group;
- :func:`line_search`: the learning rate of a grid with the lowest loss;
- :func:`damping_factor`: the Levenberg-Marquardt rule from the reduction ratio
  (:func:`checked_factor`: the plain loop's same-batch ratio checked by the next batches);
- :func:`loss_only`: a closure evaluated for its loss value only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ..foreach import INF, FlatBuffer, finite_norms, in_dtype, scalar
from ..warn import warn
from .stale_clip import StaleClip


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
    lrs = {s.group["lr"] for s in slots}
    whole = slots[0].span.start == 0 and slots[-1].span.stop == directions.numel()
    whole = whole and all(a.span.stop == b.span.start for a, b in zip(slots, slots[1:]))
    if len(lrs) == 1 and whole:  # one learning rate over the whole vector: one dot
        total = lrs.pop() ** 2 * torch.dot(directions, grads)
    else:
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
    buffer: Optional[FlatBuffer] = None,
    direction_views: Optional[Sequence[Tensor]] = None,
    stale_clip: Optional[StaleClip] = None,
    refreshed: bool = True,
) -> Tuple[Union[float, Tensor], Tensor]:
    """``p -= lr (momentum buffer of nu c d)`` after decoupled weight decay.

    Everything runs on the device, without a host synchronization: a parameter whose
    direction is not finite is left unchanged (its weight decay, momentum buffer and
    update are selected away with ``torch.where``), and the KL factor ``nu``
    (:func:`kl_scale`, from the finite directions) is applied as a tensor.

    Args:
        slots: The parameters with a gradient, their groups and flat spans.
        directions: ``[P]`` preconditioned gradient ``d`` (overwritten: the update's own).
        grads: ``[P]`` gradient ``g``.
        state: The optimizer's per-parameter state (``momentum_buffer``).
        kl_clip: The KL clipping bound, or ``None``.
        who: The optimizer's name for messages.
        buffer: Where the selected directions are written when the slots tile the
            flat vector and ``direction_views`` are not given (its views shaped like the
            parameters: no split or view per step); a new tensor without either.
        direction_views: Views of ``directions`` shaped like the parameters of all
            ``slots`` (when ``directions`` is a persistent buffer: no split per step);
            then the selection is made in place of ``directions``.
        stale_clip: Scales each parameter's direction by ``c_p`` between two refreshes
            (:class:`~curvature.optim.stale_clip.StaleClip`, from the norms of the
            finiteness check); ``None``: ``c = 1``.
        refreshed: Whether this step refreshed the inverses (``stale_clip`` takes its
            reference then and does not scale).

    Returns:
        ``nu`` (``1.0`` without ``kl_clip``, else a 0-d tensor) and ``ok [len(slots)]``
        (device bool: the parameter's update was finite and applied), for the caller to
        read when it reads its counters.

    """
    if not slots:
        return 1.0, directions.new_ones(0, dtype=torch.bool)
    sizes = [s.span.stop - s.span.start for s in slots]
    tiled = slots[0].span.start == 0 and slots[-1].span.stop == directions.numel()
    tiled = tiled and all(a.span.stop == b.span.start for a, b in zip(slots, slots[1:]))
    okf = None
    fits = tiled and direction_views is not None and len(direction_views) == len(slots)
    if fits:
        parts = list(direction_views)
    else:
        parts = directions.split(sizes) if tiled else [directions[s.span] for s in slots]
    # the finiteness of each parameter's direction, and the stale clip from the same norms
    norms = finite_norms(parts)
    ok = norms.lt(INF)
    names = [s.name for s in slots]
    clip = None if stale_clip is None else stale_clip.scale(names, norms, refreshed)
    if tiled:  # one split, the flags of all parameters, two passes over the flat vector
        # non-finite entries to 0, then every entry of a parameter with one to 0 (times
        # its 0/1 flag): no [P] index of the positions' parameters, neither kept (four
        # bytes per parameter on the device for the life of the process, as before: 81
        # MiB for benchmarks/gpu.py's language model in H100 run 13) nor made per step
        if clip is None:
            okf = ok.to(directions.dtype).unbind(0)
            factors = okf
        else:  # c_p times the 0/1 flag (the momentum below needs the flags alone)
            okf, factors = None, (clip * ok).to(directions.dtype).unbind(0)
        if fits:  # in place: the directions are the update's own, with views that fit
            clean, views = directions.nan_to_num_(0.0, 0.0, 0.0), parts
        elif buffer is not None:  # into the persistent buffer, whose views fit the parameters
            shapes = [s.param.shape for s in slots]
            clean, views = buffer.get(shapes, directions.dtype, directions.device)
            torch.nan_to_num(directions, 0.0, 0.0, 0.0, out=clean)
        else:
            clean = torch.nan_to_num(directions, 0.0, 0.0, 0.0)
            views = list(clean.split(sizes))
        torch._foreach_mul_(views, factors)
    else:
        clean = None
        views = [torch.where(ok[i], v, 0.0) for i, v in enumerate(parts)]
        if clip is not None:
            views = torch._foreach_mul(views, list(clip.to(directions.dtype).unbind(0)))
    nu: Union[float, Tensor] = 1.0
    if kl_clip is not None:
        full = clean if clean is not None else directions.new_zeros(directions.shape)
        if clean is None:
            for s, v in zip(slots, views):
                full[s.span] = v
        nu = kl_scale(slots, full, grads, kl_clip).to(directions.dtype)
        if clean is not None:
            clean.mul_(nu)  # (the views follow)
        else:
            views = torch._foreach_mul(views, nu)
    groups: Dict[int, List[int]] = {}
    for i, s in enumerate(slots):
        groups.setdefault(id(s.group), []).append(i)
    for idx in groups.values():
        g = slots[idx[0]].group
        params = [slots[i].param for i in idx]
        upd = [_shaped(views[i], p) for i, p in zip(idx, params)]
        if g["weight_decay"]:
            keep = 1 - g["lr"] * g["weight_decay"]
            dt = params[0].dtype
            factors = torch.where(ok, scalar(keep, dt, ok.device), scalar(1.0, dt, ok.device))
            factors = factors.unbind(0)
            torch._foreach_mul_(params, [factors[i] for i in idx])
        if g["momentum"]:
            if okf is None:
                okf = ok.to(directions.dtype).unbind(0)
            bufs = []
            for p, d in zip(params, upd):
                st = state[p]
                if st.get("momentum_buffer") is None:
                    st["momentum_buffer"] = torch.zeros_like(d)
                bufs.append(st["momentum_buffer"])
            dt = bufs[0].dtype
            decay = torch.where(
                ok, scalar(g["momentum"], dt, ok.device), scalar(1.0, dt, ok.device)
            )
            decay = decay.unbind(0)
            torch._foreach_mul_(bufs, [decay[i] for i in idx])
            torch._foreach_add_(bufs, upd)
            upd = torch._foreach_mul(bufs, [in_dtype(okf[i], b.dtype) for i, b in zip(idx, bufs)])
        torch._foreach_add_(params, upd, alpha=-g["lr"])
    return nu, ok


def skipped_message(who: str, names: Sequence[str], of: int, steps: int, last: int) -> str:
    """The one warning of an optimizer whose updates were skipped for the parameters ``names``.

    One warning per optimizer, not one per parameter per step: later skipped steps are only
    counted (``optim.skipped_updates``).
    """
    shown = ", ".join(f"'{n}'" for n in names[:4]) + (", ..." if len(names) > 4 else "")
    return (
        f"{who}: non-finite update for {len(names)} of {of} parameter(s) ({shown}) skipped "
        f"in {steps} step(s) up to step {last}: NaN/inf gradients, or a diverging run (try a "
        "smaller lr, a larger damping or kl_clip=1e-3). Further skipped steps are counted in "
        "optim.skipped_updates without another warning."
    )


def _shaped(v: Tensor, p: Tensor) -> Tensor:
    """``v`` viewed as ``p`` (no call where the shape already fits), in ``p``'s dtype."""
    return in_dtype(v if v.shape == p.shape else v.view_as(p), p.dtype)


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


def checked_factor(rho: Optional[float], actual: float, predicted: float, decay: float) -> float:
    """Levenberg-Marquardt on the same-batch ratio ``rho``, checked by the next batches:
    ``actual`` and ``predicted`` are the interval's summed loss changes measured by the
    next forwards and the model's predictions for them.

    ``1 / decay`` where the next batches' loss rose where a fall was predicted, else
    :func:`damping_factor` of ``rho``, whose shrinking holds (``1``) unless the next
    batches confirm at least a quarter of the predicted fall. On its own batch a step
    fits that batch's gradient noise too, so ``rho`` alone stays near 1 and shrinks
    ``lambda`` without bound on small batches (the next batches alone see only the
    shared part of the gradient and grow it without bound; docs/optimizers.md).
    """
    if predicted < 0 and actual > 0:
        return 1 / decay
    factor = 1.0 if rho is None else damping_factor(rho, decay)
    return factor if factor >= 1 or (predicted < 0 and actual < predicted / 4) else 1.0


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
    "checked_factor",
    "damping_factor",
    "kl_scale",
    "line_search",
    "loss_only",
    "reduction_ratio",
]
