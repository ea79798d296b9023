"""The choices of the public API as ``str`` enums: one name for one idea everywhere.

Every option below is a ``str`` subclass, so ``fisher="mc"`` and ``fisher=FisherType.MC``
are the same argument, and a typo fails early with the allowed set (see :func:`choice`).
What to do with layers or parameters that no rule covers is called ``unsupported``
everywhere; each function accepts the subset of :class:`Unsupported` that makes sense
for it.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Iterable, Optional, Tuple, Type, TypeVar

E = TypeVar("E", bound=Enum)


class FisherType(str, Enum):
    """Which curvature backward fills the ``G`` side (see ``docs/conventions.md``)."""

    TYPE2 = "type-2"  #: exact GGN through the loss Hessian's square root
    MC = "mc"  #: labels sampled from the model's predictive distribution
    EMPIRICAL = "empirical"  #: the true labels' gradients (the user's backward)
    RADEMACHER = "rademacher"  #: Hessian square root times Rademacher vectors
    FORWARD_ONLY = "forward-only"  #: ``G = I``

    def __str__(self) -> str:
        return self.value


class KFACApproxType(str, Enum):
    """KFAC for weight-sharing layers (Eschenhagen et al., 2023)."""

    EXPAND = "expand"
    REDUCE = "reduce"

    def __str__(self) -> str:
        return self.value


class DampingMode(str, Enum):
    """How the optimizers damp a Kronecker block."""

    PI = "pi"  #: Tikhonov damping of each factor with the pi heuristic
    EXACT = "exact"  #: ``kron(G, A) + lambda I`` inverted exactly in the eigenbasis
    PER_FACTOR = "per_factor"  #: ``(A + lambda I) x (G + lambda I)``: ``lambda`` on each factor

    def __str__(self) -> str:
        return self.value


class Unsupported(str, Enum):
    """What happens to parameters or layers that no rule covers."""

    WARN = "warn"  #: plain gradient (optimizers) / zero block (``kfac()``), one warning
    ERROR = "error"  #: a clear error naming the layer
    DIAGONAL = "diagonal"  #: the optimizers precondition them by a Fisher diagonal
    FUNCTORCH = "functorch"  #: per-sample replay of the module with ``torch.func`` (exact)
    AUTOGRAD = "autograd"  #: Laplacians: the exact nested-autograd Laplacian instead

    def __str__(self) -> str:
        return self.value


class LaplacianMethod(str, Enum):
    """How :func:`curvature.laplacian` computes the input Laplacian."""

    FORWARD = "forward"
    AUTOGRAD = "autograd"
    HUTCHINSON = "hutchinson"

    def __str__(self) -> str:
        return self.value


def choice(
    enum: Type[E],
    value: object,
    where: str,
    *,
    allowed: Optional[Iterable[E]] = None,
    hint: str = "",
) -> E:
    """``value`` as a member of ``enum``, or a ``ValueError`` naming the allowed values.

    Args:
        enum: The option's enum.
        value: The user's value (a plain string or a member).
        where: The argument as the user wrote it, e.g. ``"KFAC(fisher=...)"`` is given
            as ``"KFAC(fisher"``; the message reads ``f"{where}={value!r})"``.
        allowed: The members this caller accepts (default: all).
        hint: A sentence appended to the message (what each value means, the way out).

    Returns:
        The enum member.

    Raises:
        ValueError: If ``value`` is not one of ``allowed``.

    """
    members = list(enum) if allowed is None else list(allowed)
    try:
        member = enum(value)
    except ValueError:
        member = None
    if member is None or member not in members:
        names = ", ".join(repr(m.value) for m in members)
        shown = value.value if isinstance(value, Enum) else value
        end = ")" if "(" in where else ""
        raise ValueError(
            f"{where}={shown!r}{end}: must be one of {names}." + (f" {hint}" if hint else "")
        )
    return member


def renamed(value: Any, old_value: Any, name: str, old_name: str, who: str) -> Tuple[Any, str]:
    """``(value, argument name)`` where ``old_name=`` is the deprecated name of ``name=``.

    A value given under the old name wins (with a ``DeprecationWarning`` at the user's
    line); the returned name is the one the user wrote, for error messages.
    """
    if old_value is None:
        return value, name
    from .warn import warn  # noqa: PLC0415 - warn imports torch; options stays light

    warn(
        f"{who}({old_name}=...) is deprecated; use {name}=... (the same values).",
        DeprecationWarning,
    )
    return old_value, old_name


def check_max_factor_size(value: Any, caller: str) -> None:
    """A ``ValueError`` unless ``max_factor_size`` is a positive int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{caller}(max_factor_size={value!r}): a positive int; blocks with a larger "
            "Kronecker factor use the per-sample Fisher diagonal (default 4096)."
        )
