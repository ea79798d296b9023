"""curvature: second-order optimization and curvature for PyTorch.

Public names only; see ``docs/`` for the maths and conventions.
"""

from .capture import Capture, capture
from .dense import (
    empirical_fisher,
    fisher,
    ggn,
    ggn_vector_product,
    hessian,
    hessian_vector_product,
)
from .kfac import KFACApprox, diag_ggn, ekfac, kfac
from .laplacian import ForwardLaplacian, forward_laplacian, laplacian, register_activation
from .losses import per_sample_losses
from .optim import EKFAC, KFAC, DiagonalNaturalGradient
from .per_sample import jacobian, per_sample_grads
from .traces import hessian_trace, hutchinson_trace, hutchinson_trace_blocks

__version__ = "0.1.0"  # semantic versioning; the single source (pyproject.toml reads it)

__all__ = [
    "Capture",
    "DiagonalNaturalGradient",
    "EKFAC",
    "ForwardLaplacian",
    "KFAC",
    "KFACApprox",
    "capture",
    "diag_ggn",
    "ekfac",
    "empirical_fisher",
    "fisher",
    "forward_laplacian",
    "ggn",
    "ggn_vector_product",
    "hessian",
    "hessian_trace",
    "hessian_vector_product",
    "hutchinson_trace",
    "hutchinson_trace_blocks",
    "jacobian",
    "kfac",
    "laplacian",
    "per_sample_grads",
    "per_sample_losses",
    "register_activation",
]
