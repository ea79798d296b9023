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
from .hessian import hutchinson_trace
from .kfac import KFACApprox, diag_ggn, ekfac, kfac
from .laplacian import forward_laplacian, laplacian
from .losses import per_sample_losses
from .optim import EKFAC, KFAC, DiagonalNaturalGradient
from .per_sample import jacobian, per_sample_grads

__version__ = "0.1.0"

__all__ = [
    "Capture",
    "DiagonalNaturalGradient",
    "EKFAC",
    "KFAC",
    "KFACApprox",
    "capture",
    "diag_ggn",
    "ekfac",
    "empirical_fisher",
    "fisher",
    "ggn",
    "ggn_vector_product",
    "hessian",
    "hessian_vector_product",
    "hutchinson_trace",
    "forward_laplacian",
    "laplacian",
    "jacobian",
    "kfac",
    "per_sample_grads",
    "per_sample_losses",
]
