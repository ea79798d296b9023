"""Curvature optimizers: ``torch.optim.Optimizer`` subclasses on one shared base."""

from .base import CurvatureOptimizer
from .diagonal import DiagonalNaturalGradient
from .kfac import EKFAC, KFAC

__all__ = ["CurvatureOptimizer", "DiagonalNaturalGradient", "EKFAC", "KFAC"]
