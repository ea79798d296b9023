r"""The public functions: :func:`laplacian` and :func:`forward_laplacian`.

They check the arguments, then route: ``method="forward"`` compiles the model
(:mod:`curvature.laplacian.compiler`) and propagates the stacked state
(:mod:`curvature.laplacian.forward`); ``"autograd"`` and ``"hutchinson"``, and a model the
forward Laplacian cannot propagate with ``unsupported="autograd"``, use nested reverse
mode (:mod:`curvature.laplacian.autograd`).
"""

from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from ..options import LaplacianMethod, Unsupported, choice
from .autograd import hutchinson_probes, nested_autograd
from .compiler import UnsupportedModule, compile_module
from .forward import ForwardLaplacian, Plan, propagate

__all__ = ["forward_laplacian", "laplacian"]

#: The :class:`Unsupported` choices that apply to the forward Laplacian.
_UNSUPPORTED = (Unsupported.AUTOGRAD, Unsupported.ERROR)
_UNSUPPORTED_HINT = (
    "It says what method='forward' does with a layer it cannot propagate: 'autograd' "
    "computes the exact Laplacian by nested autograd instead (with a warning), 'error' "
    "raises naming the layer."
)
_METHOD_HINT = (
    "'forward' is the forward Laplacian, 'autograd' exact nested autograd, 'hutchinson' "
    "a stochastic estimate with num_samples probes."
)

Coefficients = Optional[Union[Tensor, Sequence[float], float]]


def laplacian(
    model: nn.Module,
    x: Tensor,
    *,
    method: Union[str, LaplacianMethod] = "forward",
    num_samples: Optional[int] = None,
    unsupported: Union[str, Unsupported] = "autograd",
    generator: Optional[torch.Generator] = None,
    coefficients: Coefficients = None,
    fallback: Optional[str] = None,
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
      *unsupported*: see ``unsupported``.
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
        method: ``"forward"``, ``"autograd"`` or ``"hutchinson"`` (or the
            :class:`~curvature.options.LaplacianMethod` member).
        num_samples: The number of probes ``K`` per sample, required for ``"hutchinson"``
            and only for it.
        unsupported: What ``"forward"`` does with a model it cannot propagate (a
            :class:`~curvature.options.Unsupported` value): ``"autograd"`` computes the
            exact Laplacian with ``"autograd"`` instead (with a warning that names the
            unsupported module; the capture engine then sees ordinary calls), ``"error"``
            raises a ``ValueError`` naming it. The check runs before any layer is called.
        generator: The random generator of the Hutchinson probes.
        coefficients: ``c``: a number or ``d`` numbers (a tensor ``[d]``) weighting the
            second derivatives, e.g. ``(0, 1/4)`` for the ``u_xx / 4`` of a heat equation
            in ``(t, x)``; ``None`` is the Laplacian (all ones).
        fallback: Deprecated alias of ``unsupported`` (a ``DeprecationWarning``).

    Returns:
        ``[N]`` for a scalar-output model (output ``[N]`` or ``[N, 1]``), else ``[N, *out]``.

    Raises:
        ValueError: For a bad ``x``, ``method``, ``num_samples``, ``unsupported`` or
            ``coefficients``, and with ``unsupported="error"`` for a model that the
            forward Laplacian does not support.

    """
    method = choice(LaplacianMethod, method, "laplacian(method", hint=_METHOD_HINT)
    how = _unsupported_choice(unsupported, fallback, "laplacian")
    c = _check(model, x, method, num_samples, generator, coefficients, "laplacian")
    if method is LaplacianMethod.FORWARD:
        plan = _plan_or_none(model, how, "laplacian")
        if plan is not None:
            return propagate(plan, x, c).laplacian
        return nested_autograd(model, x, None, c).laplacian
    if method is LaplacianMethod.AUTOGRAD:
        return nested_autograd(model, x, None, c).laplacian
    return nested_autograd(model, x, hutchinson_probes(num_samples, x, generator), c).laplacian


def forward_laplacian(
    model: nn.Module,
    x: Tensor,
    *,
    coefficients: Coefficients = None,
    unsupported: Union[str, Unsupported] = "autograd",
    fallback: Optional[str] = None,
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
        unsupported: As in :func:`laplacian` (``"autograd"`` gives the same three parts).
        fallback: Deprecated alias of ``unsupported`` (a ``DeprecationWarning``).

    Returns:
        A :class:`ForwardLaplacian` ``(value, jacobian, laplacian)``, all with graphs.

    Raises:
        ValueError: As :func:`laplacian`.

    """
    how = _unsupported_choice(unsupported, fallback, "forward_laplacian")
    c = _check(model, x, LaplacianMethod.FORWARD, None, None, coefficients, "forward_laplacian")
    plan = _plan_or_none(model, how, "forward_laplacian")
    if plan is not None:
        return propagate(plan, x, c)
    return nested_autograd(model, x, None, c)


def _unsupported_choice(
    unsupported: Union[str, Unsupported], fallback: Optional[str], caller: str
) -> Unsupported:
    """``unsupported`` as a member, or the deprecated ``fallback`` (with a warning)."""
    name = "unsupported"
    if fallback is not None:
        old, new = str(fallback), str(unsupported)  # the values of enum members
        warnings.warn(
            f"{caller}(fallback={old!r}): fallback is deprecated; use "
            f"unsupported={old!r} (the same values).",
            DeprecationWarning,
            stacklevel=3,
        )
        if unsupported != Unsupported.AUTOGRAD and unsupported != fallback:
            raise ValueError(
                f"{caller}(unsupported={new!r}, fallback={old!r}): fallback is "
                "the deprecated name of unsupported; give only unsupported."
            )
        unsupported, name = fallback, "fallback"
    return choice(
        Unsupported, unsupported, f"{caller}({name}", allowed=_UNSUPPORTED, hint=_UNSUPPORTED_HINT
    )


def _check(
    model: nn.Module,
    x: Tensor,
    method: LaplacianMethod,
    num_samples: Optional[int],
    generator: Optional[torch.Generator],
    coefficients: Any,
    caller: str,
) -> Optional[Tensor]:
    """Validate the arguments (``method`` already is); the coefficients as a tensor ``[d]``
    (or ``None``).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"{caller}: model must be an nn.Module; got {type(model).__name__}.")
    if not isinstance(x, Tensor) or x.ndim != 2 or not x.is_floating_point():
        got = f"shape {tuple(x.shape)}, {x.dtype}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(
            f"{caller}: x must be a floating-point tensor [N, d] (one row per sample); "
            f"got {got}. Flatten the input dimensions into d."
        )
    if method is LaplacianMethod.HUTCHINSON:
        if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
            raise ValueError(
                f"{caller}(method='hutchinson', num_samples={num_samples!r}): num_samples "
                "(probes per sample) must be a positive integer."
            )
    elif num_samples is not None:
        raise ValueError(
            f"{caller}(method={method.value!r}, num_samples={num_samples!r}): num_samples is "
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


def _plan_or_none(model: nn.Module, unsupported: Unsupported, caller: str) -> Optional[Plan]:
    """The forward Laplacian's plan, or ``None`` to use nested autograd (with a warning)."""
    try:
        return compile_module(model)
    except UnsupportedModule as err:
        if unsupported is Unsupported.ERROR:
            raise ValueError(
                f"{caller}(method='forward'): {err}. Use method='autograd' (exact, any model), "
                "unsupported='autograd', or register the activation with "
                "curvature.laplacian.register_activation."
            ) from None
        warnings.warn(
            f"{caller}(method='forward'): {err}; computing the exact Laplacian with "
            "method='autograd' instead (unsupported='autograd').",
            stacklevel=3,
        )
        return None
