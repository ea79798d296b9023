"""Layer rules: one file per layer family, one registry."""

from . import attention, conv, embedding, linear, norm, recurrent  # noqa: F401
from .base import Call, LayerRule, LinearFamilyRule
from .functional import FunctionalRule, ReplayRandomnessError
from .registry import register, registered_rule, registered_types

__all__ = [
    "ReplayRandomnessError",
    "Call",
    "FunctionalRule",
    "LayerRule",
    "LinearFamilyRule",
    "register",
    "registered_rule",
    "registered_types",
]
