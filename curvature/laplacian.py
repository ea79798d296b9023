r"""Laplacians of a model's output w.r.t. its input, per sample (PINN losses).

For a model ``f: R^d -> R^O`` applied row-wise to ``x [N, d]``, the Laplacian of sample
``n`` is ``Delta f(x_n) = sum_{i=1}^d d^2 f / d x_i^2 (x_n) = tr(H_n)`` with ``H_n`` the
``[d, d]`` Hessian of each output w.r.t. the input. Three methods, all differentiable
w.r.t. the parameters (and ``x``):

- ``"forward"``: the forward Laplacian (Li et al. 2023; Dangel, Muller, Zeinhofer 2024),
  one forward pass of the stacked state ``[N, d + 2, F]`` (value, the ``d`` first
  derivatives, the Laplacian) through the layers, which are *called as modules* so that
  the capture engine sees every Linear layer with weight sharing over the ``d + 2`` slots.
- ``"autograd"``: exact, nested reverse mode: one backward for the gradient, one batched
  backward over the ``d`` input directions for the diagonal of the Hessian.
- ``"hutchinson"``: ``mean_k v_k^T H_n v_k`` over ``K`` Rademacher probes per sample, in
  one batched backward.
"""

from __future__ import annotations

import contextvars
import operator
import warnings
import weakref
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ACTIVATIONS",
    "FORWARD_LAPLACIAN_SLOTS",
    "ForwardLaplacian",
    "current_slots",
    "forward_laplacian",
    "laplacian",
    "register_activation",
]

_METHODS = ("forward", "autograd", "hutchinson")
_FALLBACKS = ("autograd", "error")

#: ``d + 2`` while the forward Laplacian calls a Linear module on its stacked state
#: ``[N, d + 2, F]`` (slot 0 the value, slots ``1..d`` the first derivatives, slot
#: ``d + 1`` the Laplacian), ``None`` otherwise. A forward hook reads it to know that only
#: slot 0 carries the bias (bias coordinate 1 on slot 0, 0 on the other slots).
FORWARD_LAPLACIAN_SLOTS: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "FORWARD_LAPLACIAN_SLOTS", default=None
)
# The coefficients ``c [d]`` of the weighted Laplacian during a forward Laplacian run.
_COEFFICIENTS: contextvars.ContextVar[Optional[Tensor]] = contextvars.ContextVar(
    "_COEFFICIENTS", default=None
)


def current_slots() -> Optional[int]:
    """The number of stacked slots ``d + 2`` of the forward Laplacian that is calling a
    Linear module right now, or ``None`` outside such a call.
    """
    return FORWARD_LAPLACIAN_SLOTS.get()


# -- activation registry ---------------------------------------------------------------------
#: ``z -> (sigma(z), sigma'(z), sigma''(z))``; ``sigma''`` may be ``None`` (identically 0).
Derivatives = Callable[[Tensor], Tuple[Tensor, Tensor, Optional[Tensor]]]
#: A module instance to its :data:`Derivatives` (reads ``beta``, ``approximate``, ...).
ActivationRule = Callable[[nn.Module], Derivatives]

#: Activation module type to its rule; extend with :func:`register_activation`.
ACTIVATIONS: Dict[Type[nn.Module], ActivationRule] = {}


def register_activation(
    module_type: Type[nn.Module],
    rule: Union[Sequence[Callable[[Tensor], Tensor]], ActivationRule],
) -> None:
    """Teach the forward Laplacian an elementwise activation module.

    Example:
        >>> register_activation(MySin, (torch.sin, torch.cos, lambda z: -torch.sin(z)))

    Args:
        module_type: A subclass of ``nn.Module`` whose forward is elementwise; its
            subclasses are covered too (the most specific registered type wins).
        rule: ``(sigma, dsigma, d2sigma)``, three callables ``z -> Tensor`` (the
            activation and its first and second derivatives, elementwise), or a callable
            ``module -> (z -> (sigma(z), sigma'(z), sigma''(z)))`` for activations with
            attributes (``sigma''`` may be ``None`` where it vanishes).

    Raises:
        ValueError: If ``module_type`` is not an ``nn.Module`` subclass or ``rule`` is
            neither form.

    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ValueError(
            f"register_activation: module_type must be a subclass of nn.Module; got "
            f"{module_type!r}."
        )
    if isinstance(rule, (tuple, list)):
        if len(rule) != 3 or not all(callable(f) for f in rule):
            raise ValueError(
                f"register_activation({module_type.__name__}): rule must be three callables "
                f"(sigma, dsigma, d2sigma); got a sequence of {len(rule)} items."
            )
        fs = tuple(rule)

        def derivatives(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
            return tuple(_like(f(z), z) for f in fs)  # type: ignore[return-value]

        ACTIVATIONS[module_type] = lambda module: derivatives
    elif callable(rule):
        ACTIVATIONS[module_type] = rule
    else:
        raise ValueError(
            f"register_activation({module_type.__name__}): rule must be (sigma, dsigma, "
            f"d2sigma) or a callable module -> derivatives; got {type(rule).__name__}."
        )


def _like(v: Any, z: Tensor) -> Tensor:
    """A rule's result (a number, a 0-dim or a full tensor) as a tensor shaped like ``z``."""
    v = v if isinstance(v, Tensor) else torch.full_like(z, float(v))
    return v.expand_as(z) if v.shape != z.shape else v


def _tanh(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    t = torch.tanh(z)
    s = 1 - t * t
    return t, s, -2 * t * s


def _sigmoid(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    s = torch.sigmoid(z)
    ds = s * (1 - s)
    return s, ds, ds * (1 - 2 * s)


def _relu(z: Tensor) -> Tuple[Tensor, Tensor, None]:
    return torch.relu(z), (z > 0).to(z.dtype), None


def _leaky_relu(slope: float) -> Derivatives:
    def rule(z: Tensor) -> Tuple[Tensor, Tensor, None]:
        return F.leaky_relu(z, slope), torch.where(z > 0, 1.0, slope).to(z.dtype), None

    return rule


def _elu(alpha: float) -> Derivatives:
    def rule(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        neg = alpha * torch.exp(torch.clamp(z, max=0))
        pos = z > 0
        return F.elu(z, alpha), torch.where(pos, 1.0, neg), torch.where(pos, 0.0, neg)

    return rule


_SQRT_HALF = 0.5**0.5
_INV_SQRT_2PI = (2 * torch.pi) ** -0.5
_SQRT_2_OVER_PI = (2 / torch.pi) ** 0.5


def _gelu(approximate: str) -> Derivatives:
    if approximate == "tanh":
        return _gelu_tanh
    if approximate == "none":
        return _gelu_erf
    raise ValueError(f"GELU(approximate={approximate!r}) is not 'none' or 'tanh'.")


def _gelu_erf(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    # sigma = z Phi(z), sigma' = Phi + z phi, sigma'' = phi (2 - z^2)
    cdf = 0.5 * (1 + torch.erf(z * _SQRT_HALF))
    pdf = _INV_SQRT_2PI * torch.exp(-0.5 * z * z)
    return z * cdf, cdf + z * pdf, pdf * (2 - z * z)


def _gelu_tanh(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    # sigma = z (1 + tanh u) / 2 with u = c (z + 0.044715 z^3)
    c, a = _SQRT_2_OVER_PI, 0.044715
    z2 = z * z
    t = torch.tanh(c * z * (1 + a * z2))
    s = 1 - t * t
    du = c * (1 + 3 * a * z2)
    d2u = 6 * c * a * z
    value = 0.5 * z * (1 + t)
    d1 = 0.5 * (1 + t) + 0.5 * z * s * du
    d2 = s * du + 0.5 * z * s * (d2u - 2 * t * du * du)
    return value, d1, d2


def _silu(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    s = torch.sigmoid(z)
    ds = s * (1 - s)
    return z * s, s + z * ds, ds * (2 + z * (1 - 2 * s))


def _softplus(beta: float, threshold: float) -> Derivatives:
    # torch's softplus is linear where beta z > threshold
    def rule(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        bz = beta * z
        s = torch.sigmoid(bz)
        linear = bz > threshold
        d1 = torch.where(linear, 1.0, s)
        d2 = torch.where(linear, 0.0, beta * s * (1 - s))
        return F.softplus(z, beta, threshold), d1, d2

    return rule


def _sin(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    s = torch.sin(z)
    return s, torch.cos(z), -s


def _cos(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    c = torch.cos(z)
    return c, -torch.sin(z), -c


def _power(p: Any) -> Derivatives:
    if isinstance(p, Tensor):
        if p.numel() != 1:
            raise ValueError(
                f"laplacian(method='forward'): z ** p needs a scalar exponent; got shape "
                f"{tuple(p.shape)}."
            )
        p = p.item()

    def rule(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        if p == 2:
            return z * z, 2 * z, torch.full_like(z, 2.0)
        return z**p, p * z ** (p - 1), p * (p - 1) * z ** (p - 2)

    return rule


def _exp(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    e = torch.exp(z)
    return e, e, e


ACTIVATIONS.update(
    {
        nn.Tanh: lambda m: _tanh,
        nn.Sigmoid: lambda m: _sigmoid,
        nn.ReLU: lambda m: _relu,
        nn.LeakyReLU: lambda m: _leaky_relu(m.negative_slope),
        nn.ELU: lambda m: _elu(m.alpha),
        nn.GELU: lambda m: _gelu(m.approximate),
        nn.SiLU: lambda m: _silu,
        nn.Softplus: lambda m: _softplus(m.beta, m.threshold),
    }
)


def _kw(args: tuple, kwargs: dict, names: Sequence[str], defaults: Sequence[Any]) -> List[Any]:
    """The extra arguments of a functional activation, positional or by keyword."""
    values = list(defaults)
    for i, a in enumerate(args[: len(names)]):
        values[i] = a
    for i, name in enumerate(names):
        if name in kwargs:
            values[i] = kwargs[name]
    return values


#: Functional activations in a traced forward (``torch.fx`` targets, or method names) to
#: ``(*extra_args, **kwargs) -> Derivatives``.
_FUNCTIONAL: Dict[Any, Callable[..., Derivatives]] = {}
for _targets, _factory in [
    ((torch.tanh, F.tanh, "tanh"), lambda *a, **k: _tanh),
    ((torch.sigmoid, F.sigmoid, "sigmoid"), lambda *a, **k: _sigmoid),
    ((torch.relu, F.relu, "relu"), lambda *a, **k: _relu),
    ((torch.sin, "sin"), lambda *a, **k: _sin),
    ((torch.cos, "cos"), lambda *a, **k: _cos),
    ((torch.exp, "exp"), lambda *a, **k: _exp),
    ((F.silu, torch._C._nn.silu), lambda *a, **k: _silu),
    ((F.gelu, torch._C._nn.gelu), lambda *a, **k: _gelu(*_kw(a, k, ["approximate"], ["none"]))),
    (
        (F.softplus, torch._C._nn.softplus),
        lambda *a, **k: _softplus(*_kw(a, k, ["beta", "threshold"], [1.0, 20.0])),
    ),
    (
        (F.leaky_relu, torch._C._nn.leaky_relu),
        lambda *a, **k: _leaky_relu(*_kw(a, k, ["negative_slope"], [0.01])),
    ),
    ((F.elu,), lambda *a, **k: _elu(*_kw(a, k, ["alpha"], [1.0]))),
]:
    for _t in _targets:
        _FUNCTIONAL[_t] = _factory

#: A compiled module: the stacked state ``[N, d + 2, *F_in]`` to ``[N, d + 2, *F_out]``.
Plan = Callable[[Tensor], Tensor]

_ADD = (operator.add, torch.add, "add")
_SUB = (operator.sub, torch.sub, "sub")
_MUL = (operator.mul, torch.mul, "mul")
_DIV = (operator.truediv, torch.div, "div")
_NEG = (operator.neg, torch.neg, "neg")
_POW = (operator.pow, torch.pow, "pow")


# -- the public functions -------------------------------------------------------------------
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


def laplacian(
    model: nn.Module,
    x: Tensor,
    *,
    method: str = "forward",
    num_samples: Optional[int] = None,
    fallback: str = "autograd",
    generator: Optional[torch.Generator] = None,
    coefficients: Optional[Union[Tensor, Sequence[float], float]] = None,
) -> Tensor:
    r"""The Laplacian of the model's output w.r.t. its input, for each sample.

    .. math:: \Delta f(x_n) = \sum_{i=1}^{d} c_i \frac{\partial^2 f}{\partial x_i^2}(x_n)
        = \operatorname{tr}(C \nabla_x^2 f(x_n)), \quad C = \operatorname{diag}(c)

    per sample ``n`` and output, with ``c = 1`` (the Laplacian) unless ``coefficients``
    are given. The result has a graph (``create_graph``) to the parameters and to ``x``: a
    PINN loss built on it can be backpropagated.

    Methods (``d`` input dimensions, ``O`` outputs, ``K`` probes):

    - ``"forward"`` (default): the forward Laplacian. The state ``[N, d + 2, F]`` holds
      the value (slot 0), the first derivatives w.r.t. the ``d`` inputs (slots ``1..d``,
      initially the identity) and the Laplacian (slot ``d + 1``, initially 0). A Linear
      layer is called as a module on the whole state (weight sharing over the slots) and
      its bias removed again from slots ``1..d+1``; an elementwise activation ``sigma``
      maps ``(z, dz_j, lap)`` to ``(sigma(z), sigma'(z) dz_j, sigma'(z) lap + sigma''(z)
      sum_j c_j dz_j^2)``. About ``d + 2`` forwards' worth of GEMMs, one pass, no nested
      backward. Supports ``nn.Sequential`` (nested), ``nn.Linear``, ``nn.Identity``, the
      activations of :data:`ACTIVATIONS` (Tanh, Sigmoid, ReLU, LeakyReLU, ELU, GELU both
      forms, SiLU, Softplus; more with :func:`register_activation`), and custom modules
      whose forward ``torch.fx`` can trace into such modules, the functional activations
      (``torch.tanh``, ``F.gelu``, ``torch.sin``, ``z ** p``, ...), sums and differences
      (residual connections), products of two hidden states (product rule) and scaling by
      or adding of constants (numbers, parameters, buffers). Anything else is
      *unsupported*: see ``fallback``.
    - ``"autograd"``: exact nested reverse mode: ``g = grad_x f`` with ``create_graph``,
      then one batched backward (``is_grads_batched``) over the ``O * d`` pairs of an output
      and a unit direction ``e_i`` (directions with ``c_i = 0`` are skipped) gives
      ``e_i^T H_n e_i`` for all samples at once. Requires a model that treats samples
      independently (no BatchNorm in train mode).
    - ``"hutchinson"``: ``mean_k (H_n v_{kn})^T (c * v_{kn})`` with ``K = num_samples``
      Rademacher probes ``v_{kn}`` per sample (one batched backward over ``O * K``);
      unbiased, variance ``2 sum_{i != j} (H_n)_{ij}^2 / K`` for ``c = 1``. Cheaper than
      ``"autograd"`` only for ``K < d``.

    Args:
        model: Maps ``[N, d]`` to ``[N]``, ``[N, 1]`` or ``[N, *out]``, row by row.
        x: Inputs ``[N, d]`` (floating point). If ``x.requires_grad``, the result is also
            differentiable w.r.t. ``x``.
        method: ``"forward"``, ``"autograd"`` or ``"hutchinson"``.
        num_samples: The number of probes ``K`` per sample, required for ``"hutchinson"``
            and only for it.
        fallback: What ``"forward"`` does with an unsupported model: ``"autograd"``
            computes the exact Laplacian with ``"autograd"`` instead (with a warning that
            names the unsupported module; the capture engine then sees ordinary calls),
            ``"error"`` raises a ``ValueError`` naming it. The check runs before any layer
            is called.
        generator: The random generator of the Hutchinson probes.
        coefficients: ``c``: a number or ``d`` numbers (a tensor ``[d]``) weighting the
            second derivatives, e.g. ``(0, 1/4)`` for the ``u_xx / 4`` of a heat equation
            in ``(t, x)``; ``None`` is the Laplacian (all ones).

    Returns:
        ``[N]`` for a scalar-output model (output ``[N]`` or ``[N, 1]``), else ``[N, *out]``.

    Raises:
        ValueError: For a bad ``x``, ``method``, ``num_samples``, ``fallback`` or
            ``coefficients``, and with ``fallback="error"`` for a model that the forward
            Laplacian does not support.

    """
    c = _check(model, x, method, num_samples, fallback, generator, coefficients, "laplacian")
    if method == "forward":
        plan = _plan_or_fallback(model, fallback, "laplacian")
        if plan is not None:
            return _forward_laplacian(plan, x, c).laplacian
        return _nested_autograd(model, x, None, c).laplacian
    if method == "autograd":
        return _nested_autograd(model, x, None, c).laplacian
    N, d = x.shape
    where = generator.device if generator is not None else x.device
    probes = torch.randint(0, 2, (num_samples, N, d), generator=generator, device=where)
    return _nested_autograd(model, x, (probes.to(x.dtype) * 2 - 1).to(x.device), c).laplacian


def forward_laplacian(
    model: nn.Module,
    x: Tensor,
    *,
    coefficients: Optional[Union[Tensor, Sequence[float], float]] = None,
    fallback: str = "autograd",
) -> ForwardLaplacian:
    """Value, Jacobian and (weighted) Laplacian of the model from one forward Laplacian.

    The same pass as ``laplacian(model, x, method="forward")`` (see :func:`laplacian`),
    returning all three slots: for a PINN residual that needs first derivatives as well,
    e.g. the heat equation ``u_t - u_xx / 4`` on inputs ``(t, x)``::

        out = forward_laplacian(model, tx, coefficients=[0.0, 0.25])
        residual = out.jacobian[:, 0] - out.laplacian

    Args:
        model: As in :func:`laplacian`.
        x: Inputs ``[N, d]``.
        coefficients: As in :func:`laplacian`.
        fallback: As in :func:`laplacian` (the fallback gives the same three parts).

    Returns:
        A :class:`ForwardLaplacian` ``(value, jacobian, laplacian)``, all with graphs.

    """
    c = _check(model, x, "forward", None, fallback, None, coefficients, "forward_laplacian")
    plan = _plan_or_fallback(model, fallback, "forward_laplacian")
    if plan is not None:
        return _forward_laplacian(plan, x, c)
    return _nested_autograd(model, x, None, c)


def _check(
    model: nn.Module,
    x: Tensor,
    method: str,
    num_samples: Optional[int],
    fallback: str,
    generator: Optional[torch.Generator],
    coefficients: Any,
    caller: str,
) -> Optional[Tensor]:
    """Validate the arguments; the coefficients as a tensor ``[d]`` (or ``None``)."""
    if method not in _METHODS:
        raise ValueError(f"{caller}(method={method!r}): method must be one of {_METHODS}.")
    if fallback not in _FALLBACKS:
        raise ValueError(f"{caller}(fallback={fallback!r}): fallback must be one of {_FALLBACKS}.")
    if not isinstance(model, nn.Module):
        raise ValueError(f"{caller}: model must be an nn.Module; got {type(model).__name__}.")
    if not isinstance(x, Tensor) or x.ndim != 2 or not x.is_floating_point():
        got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"{caller}: x must be a floating-point tensor [N, d] (one row per sample); "
            f"got {got}. Flatten the input dimensions into d."
        )
    if method == "hutchinson":
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(
                f"{caller}(method='hutchinson', num_samples={num_samples!r}): num_samples "
                "(probes per sample) must be a positive integer."
            )
    elif num_samples is not None:
        raise ValueError(
            f"{caller}(method={method!r}, num_samples={num_samples!r}): num_samples is "
            "only used by method='hutchinson'; leave it None."
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"{caller}(generator={generator!r}): generator must be a torch.Generator or None."
        )
    if coefficients is None:
        return None
    d = x.shape[1]
    try:
        c = torch.as_tensor(coefficients, dtype=x.dtype, device=x.device)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{caller}(coefficients={coefficients!r}): coefficients must be a number or "
            f"{d} numbers (one per input dimension)."
        ) from err
    if c.ndim == 0:
        c = c.expand(d)
    if c.shape != (d,):
        raise ValueError(
            f"{caller}(coefficients of shape {tuple(c.shape)}): coefficients must be a number "
            f"or {d} numbers (one per input dimension of x [N, {d}])."
        )
    return c


def _plan_or_fallback(model: nn.Module, fallback: str, caller: str) -> Optional[Plan]:
    """The forward Laplacian's plan, or ``None`` to fall back (with a warning)."""
    try:
        return _compile(model, "")
    except _Unsupported as err:
        if fallback == "error":
            raise ValueError(
                f"{caller}(method='forward'): {err}. Use method='autograd' (exact, any model), "
                "fallback='autograd', or register the activation with "
                "curvature.laplacian.register_activation."
            ) from None
        warnings.warn(
            f"{caller}(method='forward'): {err}; computing the exact Laplacian with "
            "method='autograd' instead (fallback='autograd').",
            stacklevel=3,
        )
        return None


def _squeeze_scalar(t: Tensor, out_shape: torch.Size, trailing: int = 0) -> Tensor:
    """``[N, *out, *trailing]`` to ``[N, *trailing]`` for a scalar output (``[N]``/``[N, 1]``)."""
    rest = tuple(t.shape[t.ndim - trailing :]) if trailing else ()
    if len(out_shape) == 1 or tuple(out_shape[1:]) == (1,):
        return t.reshape(out_shape[0], *rest)
    return t.reshape(*out_shape, *rest)


# -- nested reverse mode --------------------------------------------------------------------
def _nested_autograd(
    model: nn.Module, x: Tensor, probes: Optional[Tensor], c: Optional[Tensor]
) -> ForwardLaplacian:
    """Exact (``probes=None``: unit directions) or Hutchinson (``probes [K, N, d]``)."""
    N, d = x.shape
    with torch.enable_grad():
        xg = x if x.requires_grad else x.detach().requires_grad_(True)
        out = model(xg)
        if not isinstance(out, Tensor) or out.ndim == 0 or out.shape[0] != N:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"laplacian: the model must return a tensor [N, ...] with N = {N} rows; got {got}."
            )
        flat = out.reshape(N, -1)
        n_out = flat.shape[1]
        if n_out == 1:
            (g,) = torch.autograd.grad(flat.sum(), xg, create_graph=True, allow_unused=True)
            g = None if g is None else g.unsqueeze(0)
        else:
            seeds = torch.eye(n_out, dtype=flat.dtype, device=flat.device)
            seeds = seeds.unsqueeze(1).expand(n_out, N, n_out)
            (g,) = torch.autograd.grad(
                flat, xg, seeds, create_graph=True, allow_unused=True, is_grads_batched=True
            )
        if g is None:  # f does not depend on x
            g = flat.new_zeros(n_out, N, d)
        if probes is None:  # V[j, n] = e_{i_j} for the directions i_j with c_i != 0
            dirs = torch.arange(d, device=x.device) if c is None else c.nonzero().flatten()
            V = torch.eye(d, dtype=g.dtype, device=g.device)[dirs].unsqueeze(1).expand(-1, N, d)
        else:
            V = probes.to(g.dtype)
        B = V.shape[0]
        HV = None
        if g.requires_grad and B > 0:  # else f is affine in x
            if n_out == 1:
                seeds = V.unsqueeze(1)  # [B, 1, N, d]
            else:  # seeds[(o, b), o'] = delta_{o o'} V[b]
                eye = torch.eye(n_out, dtype=g.dtype, device=g.device)
                seeds = (eye[:, None, :, None, None] * V[None, :, None]).reshape(
                    n_out * B, n_out, N, d
                )
            (HV,) = torch.autograd.grad(
                g, xg, seeds, create_graph=True, allow_unused=True, is_grads_batched=True
            )
    value = _squeeze_scalar(flat, out.shape)
    jacobian = _squeeze_scalar(g.permute(1, 0, 2), out.shape, trailing=1)  # [N, *out, d]
    if HV is None:
        return ForwardLaplacian(
            value, jacobian, _squeeze_scalar(flat.new_zeros(N, n_out), out.shape)
        )
    HV = HV.reshape(n_out, B, N, d)
    if probes is None:  # e_{i_j}^T H e_{i_j}, weighted by c_{i_j}, summed over j
        quad = (HV * V).sum(-1)  # [n_out, B, N]
        lap = quad.sum(1) if c is None else (quad * c[dirs].view(-1, 1)).sum(1)
    else:  # mean_k (H v_k)^T (c * v_k)
        lap = (HV * (V if c is None else V * c)).sum(-1).mean(1)
    return ForwardLaplacian(value, jacobian, _squeeze_scalar(lap.T, out.shape))


# -- forward Laplacian -------------------------------------------------------------------------
class _Unsupported(Exception):
    """A module or operation that the forward Laplacian cannot propagate."""


def _describe(path: str, module: nn.Module) -> str:
    where = f"layer {path!r}" if path else "the model"
    return f"{where} ({type(module).__name__})"


def _compile(module: nn.Module, path: str) -> Plan:
    """A function ``state -> state`` for ``module``; raises :class:`_Unsupported`.

    Nothing is called here: an unsupported model is refused before any layer runs.
    """
    if isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward:
        return lambda state: _linear(module, state)
    if type(module) is nn.Identity:
        return lambda state: state
    rule = _activation_rule(module)
    if rule is not None:
        derivatives = rule(module)
        return lambda state: _elementwise(derivatives, state)
    if isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward:
        prefix = f"{path}." if path else ""
        # not named_children(): it skips a module that appears twice (a shared activation)
        children = [(n, c) for n, c in module._modules.items() if c is not None]
        steps = [_compile(child, f"{prefix}{name}") for name, child in children]
        return lambda state: _chain(steps, state)
    if type(module).__module__.startswith("torch."):
        raise _Unsupported(f"{_describe(path, module)} is not supported by the forward Laplacian")
    return _compile_traced(module, path)


def _chain(steps: List[Plan], state: Tensor) -> Tensor:
    for step in steps:
        state = step(state)
    return state


def _activation_rule(module: nn.Module) -> Optional[ActivationRule]:
    for cls in type(module).__mro__:
        if cls in ACTIVATIONS:
            return ACTIVATIONS[cls]
    return None


def _forward_laplacian(plan: Plan, x: Tensor, c: Optional[Tensor]) -> ForwardLaplacian:
    """Run ``plan`` on the initial state ``[x, I, 0]`` and read the three parts."""
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
        _squeeze_scalar(out[:, 0], out_shape),
        _squeeze_scalar(jacobian, out_shape, trailing=1),
        _squeeze_scalar(out[:, d + 1], out_shape),
    )


def _linear(module: nn.Linear, state: Tensor) -> Tensor:
    """``module(state)`` on all slots (weight sharing), the bias on slot 0 only.

    A module that nobody observes is applied as ``W state`` plus the bias on the value
    slot. Otherwise the module itself is called, so that forward hooks (the capture
    engine) see a Linear layer applied to ``[N, d + 2, F_in]`` with weight sharing over
    the slots, and :data:`FORWARD_LAPLACIAN_SLOTS` is ``d + 2`` during the call; the bias
    is then removed from slots ``1..`` out of place (hooks may hold the module's output).
    """
    if module.bias is not None and not _observed(module):
        # nobody else sees this call: the bias goes into the value slot only (exact zeros
        # for the derivative slots, and no full-size correction)
        rows = F.pad(module.bias.unsqueeze(0), (0, 0, 0, state.shape[1] - 1))  # [b, 0, ..]
        return F.linear(state, module.weight) + rows.view(
            state.shape[1], *([1] * (state.ndim - 3)), -1
        )
    token = FORWARD_LAPLACIAN_SLOTS.set(state.shape[1])
    try:
        out = module(state)
    finally:
        FORWARD_LAPLACIAN_SLOTS.reset(token)
    if module.bias is not None:  # out + [0, -b, ..., -b]: an add (its backward is a view)
        sign = torch.full((state.shape[1],), -1.0, dtype=out.dtype, device=out.device)
        sign[0] = 0
        out = out + sign.view(-1, *([1] * (out.ndim - 2))) * module.bias
    return out


def _observed(module: nn.Module) -> bool:
    """Whether calling ``module`` could be seen by anyone: forward hooks (the capture
    engine's among them), global module hooks, or a subclass with its own ``forward``.
    """
    from torch.nn.modules import module as _module

    return bool(
        type(module).forward is not nn.Linear.forward
        or module._forward_hooks
        or module._forward_pre_hooks
        or _module._global_forward_hooks
        or _module._global_forward_pre_hooks
    )


def _elementwise(derivatives: Derivatives, state: Tensor) -> Tensor:
    """``(z, dz, lap) -> (s(z), s'(z) dz, s'(z) lap + s''(z) sum_j dz_j^2)``.

    One full-size product ``s'(z) * state``, then slot 0 and the Laplacian slot are
    written in place (into that fresh product, which no one else holds): no concatenation.
    """
    value, d1, d2 = derivatives(state[:, 0])
    out = d1.unsqueeze(1) * state
    out[:, 0] = value
    if d2 is not None:
        dz = state[:, 1:-1]
        out[:, -1].addcmul_(d2, _weighted_sum(dz * dz))
    return out


def _weighted_sum(t: Tensor) -> Tensor:
    """``sum_j c_j t_j`` over the derivative slots ``t [N, d, *F]`` (``c = 1`` if unset)."""
    c = _COEFFICIENTS.get()
    if c is None:
        return t.sum(1)
    return (t * c.view(-1, *([1] * (t.ndim - 2)))).sum(1)


def _product(u: Tensor, v: Tensor) -> Tensor:
    """Product rule: ``(uv)_j = u v_j + v u_j``, ``D(uv) = u Dv + v Du + 2 sum_j c_j u_j v_j``."""
    u0, v0 = u[:, :1], v[:, :1]
    cross = _weighted_sum(u[:, 1:-1] * v[:, 1:-1]).unsqueeze(1)
    lap = u0 * v[:, -1:] + v0 * u[:, -1:] + 2 * cross
    return torch.cat([u0 * v0, u0 * v[:, 1:-1] + v0 * u[:, 1:-1], lap], dim=1)


def _constant(c: Any, state: Tensor) -> Any:
    """A constant broadcastable against one slot ``[N, *F]`` as ``[N, 1, *F]``-compatible."""
    if isinstance(c, Tensor) and c.ndim == state.ndim - 1:  # per-sample constant [N, *F]
        return c.unsqueeze(1)
    if isinstance(c, Tensor) and c.ndim >= state.ndim:
        raise ValueError(
            f"laplacian(method='forward'): cannot broadcast a constant of shape "
            f"{tuple(c.shape)} against the activations {tuple(state[:, 0].shape)}."
        )
    return c


def _add_constant(state: Tensor, c: Any) -> Tensor:
    """A constant shifts the value slot only."""
    return torch.cat([state[:, :1] + _constant(c, state), state[:, 1:]], dim=1)


# The fx graphs of traced custom modules, per module (a failed trace is cached too).
_TRACES: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def _trace(module: nn.Module, path: str) -> torch.fx.Graph:
    if module not in _TRACES:
        try:
            _TRACES[module] = torch.fx.Tracer().trace(module)
        except Exception as err:  # noqa: BLE001 - any tracing failure means unsupported
            _TRACES[module] = f"{type(err).__name__}: {err}"
    graph = _TRACES[module]
    if isinstance(graph, str):
        raise _Unsupported(f"{_describe(path, module)} could not be traced with torch.fx ({graph})")
    return graph


def _fetch_attr(module: nn.Module, target: str) -> Any:
    obj: Any = module
    for name in target.split("."):
        obj = getattr(obj, name)
    return obj


def _compile_traced(module: nn.Module, path: str) -> Plan:
    """Compile the fx graph of a custom module into steps on states and constants.

    Every node is classified statically as a *state* (depends on the input: a stacked
    ``[N, d + 2, *F]`` tensor at run time) or a *constant*; operations on states are
    checked against the supported set here, so that nothing runs for an unsupported model.
    """
    graph = _trace(module, path)
    prefix = f"{path}." if path else ""
    is_state: Dict[torch.fx.Node, bool] = {}
    steps: List[Tuple[torch.fx.Node, Callable[[Dict[torch.fx.Node, Any]], Any]]] = []
    result: Optional[torch.fx.Node] = None
    source: Optional[torch.fx.Node] = None  # the input

    def unsupported(node: torch.fx.Node, what: str) -> _Unsupported:
        return _Unsupported(
            f"{_describe(path, module)}: {what} (fx node {node.name!r}) is not supported by "
            "the forward Laplacian"
        )

    def value(env: Dict[torch.fx.Node, Any], a: Any) -> Any:
        return torch.fx.node.map_arg(a, lambda n: env[n])

    for node in graph.nodes:
        args = node.args
        states = [a for a in node.all_input_nodes if is_state.get(a, False)]
        if node.op == "placeholder":
            if source is None:
                source = node
                is_state[node] = True
                continue
            if not args:
                raise unsupported(node, f"a second required input {node.target!r}")
            default = args[0]
            is_state[node] = False
            steps.append((node, lambda env, v=default: v))
            continue
        if node.op == "output":
            if not (isinstance(args[0], torch.fx.Node) and is_state.get(args[0], False)):
                raise unsupported(node, "an output that is not one tensor computed from the input")
            result = args[0]
            continue
        if node.op == "get_attr":
            is_state[node] = False
            steps.append((node, lambda env, t=node.target: _fetch_attr(module, t)))
            continue
        if not states:  # a constant computation (e.g. from parameters): run as it is
            is_state[node] = False
            steps.append((node, _constant_step(module, node, value)))
            continue
        is_state[node] = True
        steps.append((node, _state_step(module, node, states, prefix, value, unsupported)))
    if source is None or result is None:
        raise _Unsupported(f"{_describe(path, module)} has no input or no output")

    def run(state: Tensor) -> Tensor:
        env: Dict[torch.fx.Node, Any] = {source: state}
        for node, step in steps:
            env[node] = step(env)
        return env[result]

    return run


def _constant_step(module: nn.Module, node: torch.fx.Node, value: Callable) -> Callable:
    def step(env: Dict[torch.fx.Node, Any]) -> Any:
        args, kwargs = value(env, node.args), value(env, node.kwargs)
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            return getattr(args[0], node.target)(*args[1:], **kwargs)
        return module.get_submodule(node.target)(*args, **kwargs)

    return step


def _state_step(
    module: nn.Module,
    node: torch.fx.Node,
    states: List[torch.fx.Node],
    prefix: str,
    value: Callable,
    unsupported: Callable[[torch.fx.Node, str], _Unsupported],
) -> Callable:
    """The run-time step of a node that depends on the input (checked here)."""
    args, kwargs, target = node.args, node.kwargs, node.target
    if node.op == "call_module":
        if len(args) != 1 or kwargs or args[0] is not states[0]:
            raise unsupported(node, f"a call of {target!r} with other arguments than one state")
        plan = _compile(module.get_submodule(target), f"{prefix}{target}")
        return lambda env: plan(env[states[0]])
    name = getattr(target, "__name__", repr(target)) if node.op == "call_function" else target
    if node.op not in ("call_function", "call_method"):
        raise unsupported(node, f"operation {node.op}")
    extra = args[1:]
    if target in _FUNCTIONAL:
        if args[0] is not states[0] or len(states) != 1:
            raise unsupported(node, f"{name} of more than one state")
        if any(isinstance(a, torch.fx.Node) for a in (*extra, *kwargs.values())):
            raise unsupported(node, f"{name} with input-dependent extra arguments")
        factory = _FUNCTIONAL[target]
        kw = {k: v for k, v in kwargs.items() if k != "inplace"}
        derivatives = factory(*extra, **kw)
        return lambda env: _elementwise(derivatives, env[args[0]])
    if (kwargs and target not in _DIV) or (target in _DIV and set(kwargs) - {"rounding_mode"}):
        raise unsupported(node, f"{name} with keyword arguments {dict(kwargs)}")
    if target in _DIV and kwargs.get("rounding_mode") is not None:
        raise unsupported(node, f"{name} with rounding_mode")
    if target in _NEG and len(args) == 1:
        return lambda env: -env[args[0]]
    if len(args) != 2:
        raise unsupported(node, f"operation {name}")
    a, b = args
    a_state = isinstance(a, torch.fx.Node) and a in states
    b_state = isinstance(b, torch.fx.Node) and b in states
    if target in _ADD or target in _SUB:
        sign = 1 if target in _ADD else -1
        if a_state and b_state:
            return (lambda env: env[a] + env[b]) if sign == 1 else (lambda env: env[a] - env[b])
        if a_state:
            return lambda env: _add_constant(env[a], sign * value(env, b))
        return lambda env: _add_constant(sign * env[b], value(env, a))
    if target in _MUL:
        if a_state and b_state:
            return lambda env: _product(env[a], env[b])
        s, c = (a, b) if a_state else (b, a)
        return lambda env: env[s] * _constant(value(env, c), env[s])
    if target in _POW and a_state and not b_state:  # z^p, p a constant number
        return lambda env: _elementwise(_power(value(env, b)), env[a])
    if target in _DIV and a_state and not b_state:
        return lambda env: env[a] / _constant(value(env, b), env[a])
    raise unsupported(node, f"operation {name} on input-dependent tensors")
