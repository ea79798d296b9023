"""curvature: second-order optimization and curvature for PyTorch.

Public names only; see ``docs/`` for the maths and conventions.
"""

from .capture import Capture, capture
from .losses import per_sample_losses
from .per_sample import jacobian, per_sample_grads

__version__ = "0.1.0"

__all__ = [
    "Capture",
    "capture",
    "jacobian",
    "per_sample_grads",
    "per_sample_losses",
]
