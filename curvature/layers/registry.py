"""The one registry of layer rules: module type -> rule instance.

A new layer is one file with a :class:`~curvature.layers.base.LayerRule` subclass
decorated with :func:`register`, plus its import in ``curvature/layers/__init__.py``.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Type, TypeVar

from torch import nn

from .base import LayerRule

_RULES: Dict[Type[nn.Module], LayerRule] = {}

R = TypeVar("R", bound=Type[LayerRule])


def register(*module_types: Type[nn.Module]) -> Callable[[R], R]:
    """Class decorator registering a rule for the given module types.

    Example:
        >>> @register(nn.Linear)  # doctest: +SKIP
        ... class LinearRule(LinearFamilyRule): ...

    """

    def decorator(rule_cls: R) -> R:
        rule = rule_cls()
        for t in module_types:
            _RULES[t] = rule
        return rule_cls

    return decorator


def registered_rule(module: nn.Module) -> Optional[LayerRule]:
    """The registered rule for ``type(module)`` (exact type first, then its bases)."""
    for cls in type(module).__mro__:
        if cls in _RULES:
            return _RULES[cls]
    return None


def registered_types() -> tuple:
    """All module types with a registered rule."""
    return tuple(_RULES)


def library_method(rule: LayerRule, name: str) -> bool:
    """Whether ``rule``'s method ``name`` is the library's own (a built-in rule's or a base
    class's), or absent: then its results are new tensors of each call, which callers may
    write in place; a rule of one's own may return tensors it keeps.
    """
    method = getattr(type(rule), name, None)
    return method is None or method.__module__.startswith("curvature.")
