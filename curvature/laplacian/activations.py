"""The elementwise activations the forward Laplacian knows, and how to teach it more.

An activation ``sigma`` is described by its *derivatives*: ``z -> (sigma(z), sigma'(z),
sigma''(z))``, all elementwise and shaped like ``z``. The forward Laplacian maps a
hidden state ``(z, dz_j, lap)`` to ``(sigma(z), sigma'(z) dz_j, sigma'(z) lap +
sigma''(z) sum_j c_j dz_j^2)`` with them (see :mod:`curvature.laplacian.forward`).

Two tables: :data:`ACTIVATIONS` for activation *modules* (extend it with
:func:`register_activation`), :data:`FUNCTIONAL` for the functional forms found in a
``torch.fx`` trace (``torch.tanh``, ``F.gelu``, ``x.sin()``, ...).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ACTIVATIONS",
    "FUNCTIONAL",
    "ActivationRule",
    "Derivatives",
    "activation_rule",
    "parameter_free",
    "power_rule",
    "register_activation",
    "rule_chain",
]

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


def _pure(rule: Derivatives, chain: Optional[Callable[..., Tuple[Tensor, ...]]] = None):
    """Mark a built-in rule as a function of ``z`` alone (no tensor captured: its constants
    are Python numbers), so that :func:`parameter_free` lets the forward Laplacian fuse it.

    ``chain``: ``(s, s', s'') -> (s', s'', s''')``, the derivatives of the rule's three
    outputs from their values (the fused backward then needs no autograd of the rule).
    """
    rule.parameter_free = True  # type: ignore[attr-defined]
    rule.chain = chain  # type: ignore[attr-defined]
    return rule


def rule_chain(derivatives: Derivatives) -> Optional[Callable[..., Tuple[Tensor, ...]]]:
    """The ``(s, s', s'') -> (s', s'', s''')`` of a built-in rule where it has one, else
    ``None`` (the fused backward differentiates the rule by autograd).
    """
    return getattr(derivatives, "chain", None)


def parameter_free(derivatives: Derivatives) -> bool:
    """Whether ``derivatives`` depends on ``z`` alone, with no captured tensor (a parameter
    of the module, a traced exponent) that gradients must reach: the built-in rules. A rule
    registered with :func:`register_activation` is not (it may read module parameters).
    """
    return getattr(derivatives, "parameter_free", False) is True


def _tanh(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    t = torch.tanh(z)
    s = 1 - t * t
    return t, s, -2 * t * s


# tanh''' = -2 (s'^2 + t s'')
_pure(_tanh, lambda t, d1, d2: (d1, d2, -2 * torch.addcmul(d1 * d1, t, d2)))


def _sigmoid(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    s = torch.sigmoid(z)
    ds = s * (1 - s)
    return s, ds, ds * (1 - 2 * s)


# sigmoid''' = s' (1 - 6 s (1 - s))
_pure(_sigmoid, lambda s, d1, d2: (d1, d2, d1 * (1 - 6 * s * (1 - s))))


@_pure
def _relu(z: Tensor) -> Tuple[Tensor, Tensor, None]:
    return torch.relu(z), (z > 0).to(z.dtype), None


def _leaky_relu(slope: float) -> Derivatives:
    @_pure
    def rule(z: Tensor) -> Tuple[Tensor, Tensor, None]:
        return F.leaky_relu(z, slope), torch.where(z > 0, 1.0, slope).to(z.dtype), None

    return rule


def _elu(alpha: float) -> Derivatives:
    @_pure
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


@_pure
def _gelu_erf(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    # sigma = z Phi(z), sigma' = Phi + z phi, sigma'' = phi (2 - z^2)
    cdf = 0.5 * (1 + torch.erf(z * _SQRT_HALF))
    pdf = _INV_SQRT_2PI * torch.exp(-0.5 * z * z)
    return z * cdf, cdf + z * pdf, pdf * (2 - z * z)


@_pure
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


@_pure
def _silu(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    s = torch.sigmoid(z)
    ds = s * (1 - s)
    return z * s, s + z * ds, ds * (2 + z * (1 - 2 * s))


def _softplus(beta: float, threshold: float) -> Derivatives:
    # torch's softplus is linear where beta z > threshold
    @_pure
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


_pure(_sin, lambda s, c, ms: (c, ms, -c))


def _cos(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    c = torch.cos(z)
    return c, -torch.sin(z), -c


_pure(_cos, lambda c, ms, mc: (ms, mc, -ms))


def power_rule(p: Any) -> Derivatives:
    """The rule of ``z ** p`` for a constant exponent ``p`` (a number or a one-element tensor).

    Raises:
        ValueError: If ``p`` is a tensor with more than one element.

    """
    if isinstance(p, Tensor):
        if p.numel() != 1:
            raise ValueError(
                f"laplacian(method='forward'): z ** p needs a scalar exponent; got shape "
                f"{tuple(p.shape)}."
            )
        p = p.item()

    @_pure  # (p is a Python number here)
    def rule(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        if p == 2:
            return z * z, 2 * z, torch.full_like(z, 2.0)
        return z**p, p * z ** (p - 1), p * (p - 1) * z ** (p - 2)

    return rule


def _exp(z: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    e = torch.exp(z)
    return e, e, e


_pure(_exp, lambda e, _d1, _d2: (e, e, e))


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
#: ``(*extra_args, **kwargs) -> Derivatives``. ``torch._C._nn.*`` are what ``torch.fx``
#: records when it traces through ``F.silu``, ``F.gelu``, ... (the Python wrappers call
#: these builtins); torch has no public name for them.
FUNCTIONAL: Dict[Any, Callable[..., Derivatives]] = {}
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
        FUNCTIONAL[_t] = _factory


def activation_rule(module: nn.Module) -> Optional[ActivationRule]:
    """The registered rule of ``module``'s most specific type in :data:`ACTIVATIONS`, or
    ``None`` if neither its type nor a base class is registered.
    """
    for cls in type(module).__mro__:
        if cls in ACTIVATIONS:
            return ACTIVATIONS[cls]
    return None
