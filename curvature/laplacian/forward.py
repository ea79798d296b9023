r"""The forward Laplacian's state and how each operation propagates it.

Following Li et al. (2023) and Dangel, Muller & Zeinhofer (2024), every hidden tensor
``z [N, *F]`` of a model applied to ``x [N, d]`` is carried as a *state* ``[N, d + 2, *F]``
stacked on axis 1: slot 0 the value ``z``, slots ``1..d`` the first derivatives
``dz / dx_j``, slot ``d + 1`` the weighted Laplacian ``sum_j c_j d^2 z / dx_j^2``. The
input's state is ``[x, I, 0]``; each operation maps states to states:

- a Linear layer: ``W state`` on every slot, the bias on slot 0 only (:func:`linear`);
- an elementwise ``sigma``: ``(sigma(z), sigma'(z) dz_j, sigma'(z) lap + sigma''(z)
  sum_j c_j dz_j^2)`` (:func:`elementwise`);
- a product of two states: the product rule (:func:`product`);
- a sum with a constant: the value slot only (:func:`add_constant`).

A :data:`Plan` (built by :mod:`curvature.laplacian.compiler`) chains these steps;
:func:`propagate` runs one on ``[x, I, 0]`` and reads the three parts.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

from ..layers.base import shared_slots
from .activations import Derivatives, parameter_free, rule_chain

__all__ = [
    "ForwardLaplacian",
    "Plan",
    "add_constant",
    "broadcast_constant",
    "elementwise",
    "elementwise_reference",
    "linear",
    "product",
    "propagate",
    "squeeze_scalar",
]

#: A compiled module: the stacked state ``[N, d + 2, *F_in]`` to ``[N, d + 2, *F_out]``.
Plan = Callable[[Tensor], Tensor]

# The coefficients ``c [d]`` of the weighted Laplacian during a forward Laplacian run.
_COEFFICIENTS: contextvars.ContextVar[Optional[Tensor]] = contextvars.ContextVar(
    "_COEFFICIENTS", default=None
)


class ForwardLaplacian(NamedTuple):
    """The result of :func:`forward_laplacian`; ``[N]``-shaped parts for a scalar output.

    Attributes:
        value: ``f(x)``: ``[N]`` or ``[N, *out]``.
        jacobian: ``d f / d x``: ``[N, d]`` or ``[N, *out, d]``.
        laplacian: ``sum_i c_i d^2 f / d x_i^2``: ``[N]`` or ``[N, *out]``.

    """

    value: Tensor
    jacobian: Tensor
    laplacian: Tensor


def propagate(plan: Plan, x: Tensor, c: Optional[Tensor]) -> ForwardLaplacian:
    """Run ``plan`` on the initial state ``[x, I, 0]`` and read the three parts.

    Args:
        plan: The compiled model.
        x: Inputs ``[N, d]``.
        c: The coefficients ``[d]`` of the weighted Laplacian, ``None`` for all ones.

    Returns:
        Value ``[N, *out]``, Jacobian ``[N, *out, d]`` and Laplacian ``[N, *out]``, with
        ``*out`` dropped for a scalar output (see :func:`squeeze_scalar`).

    """
    N, d = x.shape
    eye = torch.eye(d, dtype=x.dtype, device=x.device).expand(N, d, d)
    state = torch.cat([x.unsqueeze(1), eye, x.new_zeros(N, 1, d)], dim=1)
    token = _COEFFICIENTS.set(c)
    try:
        out = plan(state)
    finally:
        _COEFFICIENTS.reset(token)
    out_shape = torch.Size([N, *out.shape[2:]])
    jacobian = out[:, 1 : d + 1].movedim(1, -1)  # [N, *out, d]
    return ForwardLaplacian(
        squeeze_scalar(out[:, 0], out_shape),
        squeeze_scalar(jacobian, out_shape, trailing=1),
        squeeze_scalar(out[:, d + 1], out_shape),
    )


def squeeze_scalar(t: Tensor, out_shape: torch.Size, trailing: int = 0) -> Tensor:
    """``[N, *out, *trailing]`` to ``[N, *trailing]`` for a scalar output (``[N]``/``[N, 1]``).

    Args:
        t: A part of the result, ``[N, *out]`` followed by ``trailing`` axes (or any
            tensor with as many elements).
        out_shape: The model's output shape ``[N, *out]``.
        trailing: The number of axes after ``*out`` (1 for the Jacobian's ``d``).

    """
    rest = tuple(t.shape[t.ndim - trailing :]) if trailing else ()
    if len(out_shape) == 1 or tuple(out_shape[1:]) == (1,):
        return t.reshape(out_shape[0], *rest)
    return t.reshape(*out_shape, *rest)


def linear(module: nn.Linear, state: Tensor) -> Tensor:
    """``module(state)`` on all slots (weight sharing), the bias on slot 0 only.

    A module that nobody observes is applied as ``W state`` plus the bias on the value
    slot. Otherwise the module itself is called inside
    :func:`curvature.layers.base.shared_slots` ``(d + 2)``, so that forward hooks (the
    capture engine) see a Linear layer applied to ``[N, d + 2, F_in]`` with weight
    sharing over the slots, of which only slot 0 carries the bias; the bias is then
    removed from slots ``1..`` out of place (hooks may hold the module's output).

    Args:
        module: The Linear layer.
        state: ``[N, d + 2, *S, F_in]``.

    Returns:
        ``[N, d + 2, *S, F_out]``.

    """
    if module.bias is not None and not _observed(module):
        # nobody else sees this call: the bias goes into the value slot only (exact zeros
        # for the derivative slots, and no full-size correction)
        rows = F.pad(module.bias.unsqueeze(0), (0, 0, 0, state.shape[1] - 1))  # [b, 0, ..]
        return F.linear(state, module.weight) + rows.view(
            state.shape[1], *([1] * (state.ndim - 3)), -1
        )
    with shared_slots(state.shape[1]):
        out = module(state)
    if module.bias is not None:  # out + [0, -b, ..., -b]: an add (its backward is a view)
        sign = torch.full((state.shape[1],), -1.0, dtype=out.dtype, device=out.device)
        sign[0] = 0
        out = out + sign.view(-1, *([1] * (out.ndim - 2))) * module.bias
    return out


def _observed(module: nn.Module) -> bool:
    """Whether calling ``module`` could be seen by anyone: forward hooks (the capture
    engine's among them), global module hooks, or a subclass with its own ``forward``.
    """
    # torch internals: torch has no public way to ask whether a module (or every module)
    # has forward hooks; the attributes exist since torch 1.x
    return bool(
        type(module).forward is not nn.Linear.forward
        or module._forward_hooks
        or module._forward_pre_hooks
        or torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
    )


def elementwise(derivatives: Derivatives, state: Tensor) -> Tensor:
    """``(z, dz, lap) -> (s(z), s'(z) dz, s'(z) lap + s''(z) sum_j c_j dz_j^2)``.

    For a built-in rule (:func:`~curvature.laplacian.activations.parameter_free`) the map
    is one fused step: without a graph the parts are written into one output (no
    temporary of the state's size); with one, an autograd function whose backward takes
    three passes over the derivative slots (``G_dz s' + 2 c G_lap s'' dz`` and
    ``sum_j G_dz_j dz_j``) where autograd's chain of products took about eight, and the
    rule's own derivatives from its values where it has them
    (:func:`~curvature.laplacian.activations.rule_chain`: tanh, sigmoid, sin, cos, exp),
    else by autograd of the ``[N, *F]`` rule. A double backward differentiates
    :func:`elementwise_reference`, the same formula unfused. The results equal the
    unfused ones up to rounding. A rule registered by the user (it may read the module's
    parameters), and any call under a ``torch.func`` transform, take the unfused path.

    Args:
        derivatives: ``z -> (s(z), s'(z), s''(z))`` (``s''`` may be ``None``: zero).
        state: ``[N, d + 2, *F]``.

    Returns:
        ``[N, d + 2, *F]``.

    """
    if not parameter_free(derivatives) or torch._C._are_functorch_transforms_active():
        return elementwise_reference(derivatives, state)
    c = _COEFFICIENTS.get()
    if torch.is_grad_enabled() and state.requires_grad:
        return _FusedElementwise.apply(state, derivatives, c)
    return _fused_forward(derivatives, state, c)[0]


def elementwise_reference(derivatives: Derivatives, state: Tensor) -> Tensor:
    """:func:`elementwise` unfused, differentiated by autograd op by op.

    The state is split into views of its three parts and the result concatenated: the
    backward of a concatenation is a view per part and that of the split one
    concatenation, where writing slot 0 and the Laplacian slot in place into a
    full-size product (and reading slot 0 by indexing) made the backward clone the
    full-size gradient per write and fill a full-size zero tensor per read.
    """
    z, dz, lap = state.split([1, state.shape[1] - 2, 1], dim=1)
    value, d1, d2 = derivatives(z.squeeze(1))  # each [N, *F]
    d1 = d1.unsqueeze(1)
    lap = d1 * lap
    if d2 is not None:
        lap = torch.addcmul(lap, d2.unsqueeze(1), _weighted_sum(dz * dz).unsqueeze(1))
    return torch.cat([value.unsqueeze(1).expand_as(lap), d1 * dz, lap], dim=1)


def _fused_forward(derivatives: Derivatives, state: Tensor, c: Optional[Tensor]):
    """``(out, (value, d1, d2), q)``: the forward of :func:`elementwise` written into one
    ``[N, d + 2, *F]`` output; ``q = sum_j c_j dz_j^2`` (``None`` where ``s'' = 0``).
    """
    z, dz, lap = state[:, 0], state[:, 1:-1], state[:, -1]
    value, d1, d2 = derivatives(z)  # each [N, *F]
    out = torch.empty(state.shape, dtype=value.dtype, device=state.device)
    out[:, 0].copy_(value)
    torch.mul(dz, d1.unsqueeze(1), out=out[:, 1:-1])
    torch.mul(d1, lap, out=out[:, -1])
    q = None
    if d2 is not None:
        q = _slot_dot(dz, dz, c)
        out[:, -1].addcmul_(d2, q)
    return out, (value, d1, d2), q


class _FusedElementwise(torch.autograd.Function):
    """:func:`elementwise` of a parameter-free rule with a hand-written backward."""

    @staticmethod
    def forward(ctx, state, derivatives, c):  # type: ignore[override]
        z = state[:, 0].detach()
        chain = rule_chain(derivatives)
        if chain is None:  # the [N, *F] rule's own graph, for the backward
            z.requires_grad_(True)
            with torch.enable_grad():
                value, d1, d2 = derivatives(z)
        else:
            value, d1, d2 = derivatives(z)
        with torch.no_grad():
            out, _, q = _fused_forward(lambda _: (value, d1, d2), state, c)
        ctx.save_for_backward(state)
        ctx.rule, ctx.derivatives, ctx.c, ctx.q = (z, value, d1, d2), derivatives, c, q
        ctx.chain = chain
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        (state,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph: differentiate the unfused formula
            token = _COEFFICIENTS.set(ctx.c)
            try:
                with torch.enable_grad():
                    s = state if state.requires_grad else state.detach().requires_grad_(True)
                    out = elementwise_reference(ctx.derivatives, s)
                    (g,) = torch.autograd.grad(out, s, grad, create_graph=True)
            finally:
                _COEFFICIENTS.reset(token)
            return g, None, None
        z, value, d1, d2 = ctx.rule
        dz, lap = state[:, 1:-1], state[:, -1]
        g_value, g_dz, g_lap = grad[:, 0], grad[:, 1:-1], grad[:, -1]
        out = torch.empty_like(state)
        # d(out_j)/d(dz_j) = s' and d(lap_out)/d(dz_j) = 2 c_j s'' dz_j
        torch.mul(g_dz, d1.unsqueeze(1), out=out[:, 1:-1])
        torch.mul(g_lap, d1, out=out[:, -1])
        # the rule's cotangents: value, s' (times dz_j and lap), s'' (times q)
        cot = [g_value, _slot_dot(g_dz, dz, None).addcmul_(g_lap, lap)]
        outputs = [value, d1]
        if d2 is not None:
            k = 2 * g_lap * d2  # [N, *F]
            c = ctx.c
            if c is not None:
                k = k.unsqueeze(1) * c.view(-1, *([1] * (k.ndim - 1)))
            out[:, 1:-1].addcmul_(k.unsqueeze(1) if c is None else k, dz)
            cot.append(g_lap * ctx.q)
            outputs.append(d2)
        if ctx.chain is not None:  # the rule's derivatives from their values
            g_z = out[:, 0]
            torch.mul(cot[0], d1, out=g_z)
            for t, dt in zip(cot[1:], ctx.chain(value, d1, d2)[1:]):
                g_z.addcmul_(t, dt)
            return out, None, None
        used = [(o, t) for o, t in zip(outputs, cot) if o.requires_grad]
        if used:
            (g_z,) = torch.autograd.grad(
                [o for o, _ in used], z, [t for _, t in used], retain_graph=True
            )
            out[:, 0].copy_(g_z)
        else:
            out[:, 0].zero_()
        return out, None, None


def _slot_dot(u: Tensor, v: Tensor, c: Optional[Tensor]) -> Tensor:
    """``sum_j c_j u_j v_j`` over the derivative slots of ``u, v [N, d, *F]``: ``[N, *F]``.

    Without coefficients one product and ``d - 1`` fused multiply-adds of ``[N, *F]``
    slices: no ``[N, d, *F]`` temporary (a fresh buffer of the state's size costs its page
    faults, more than the arithmetic).
    """
    if c is not None:
        return _weighted_sum(u * v, c)
    total = u[:, 0] * v[:, 0]
    for j in range(1, u.shape[1]):
        total.addcmul_(u[:, j], v[:, j])
    return total


def _weighted_sum(t: Tensor, c: Any = ...) -> Tensor:
    """``sum_j c_j t_j`` over the derivative slots ``t [N, d, *F]`` (``c = 1`` if unset;
    ``c`` defaults to the run's coefficients).
    """
    c = _COEFFICIENTS.get() if c is ... else c
    if c is None:
        return t.sum(1)
    return (t * c.view(-1, *([1] * (t.ndim - 2)))).sum(1)


def product(u: Tensor, v: Tensor) -> Tensor:
    """Product rule: ``(uv)_j = u v_j + v u_j``, ``D(uv) = u Dv + v Du + 2 sum_j c_j u_j v_j``.

    Args:
        u: A state ``[N, d + 2, *F]``.
        v: A state broadcastable against ``u``.

    """
    u0, v0 = u[:, :1], v[:, :1]
    cross = _weighted_sum(u[:, 1:-1] * v[:, 1:-1]).unsqueeze(1)
    lap = u0 * v[:, -1:] + v0 * u[:, -1:] + 2 * cross
    return torch.cat([u0 * v0, u0 * v[:, 1:-1] + v0 * u[:, 1:-1], lap], dim=1)


def broadcast_constant(c: Any, state: Tensor) -> Any:
    """A constant broadcastable against one slot ``[N, *F]`` as ``[N, 1, *F]``-compatible.

    Raises:
        ValueError: If the constant has as many axes as the state or more.

    """
    if isinstance(c, Tensor) and c.ndim == state.ndim - 1:  # per-sample constant [N, *F]
        return c.unsqueeze(1)
    if isinstance(c, Tensor) and c.ndim >= state.ndim:
        raise ValueError(
            f"laplacian(method='forward'): cannot broadcast a constant of shape "
            f"{tuple(c.shape)} against the activations {tuple(state[:, 0].shape)}."
        )
    return c


def add_constant(state: Tensor, c: Any) -> Tensor:
    """``state + c``: a constant shifts the value slot only."""
    return torch.cat([state[:, :1] + broadcast_constant(c, state), state[:, 1:]], dim=1)
