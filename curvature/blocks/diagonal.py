"""A diagonal block: a running Fisher diagonal on a set of flat positions.

For layers whose Kronecker factors are too large, layers no Kronecker rule covers (with
``unsupported="diagonal"``) and :class:`~curvature.DiagonalNaturalGradient`: the
curvature on positions ``index [P_b]`` is ``diag(d)``, ``d = sum_{k,n} grad_nk^2`` from
the per-sample (per-vector) gradients, and its damped inverse maps ``v`` to
``v / (d + lambda)``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Union

import torch
from torch import Tensor

from .kronecker import ema


class DiagonalBlock:
    """``diag(d)`` on the flat positions ``index``.

    Attributes:
        name: The block's name.
        index: ``[P_b]`` flat positions.
        d: ``[P_b]`` running diagonal, or ``None`` before the first update.
        shape: The shape of the ``index`` given to the constructor, e.g. ``[C, D_out, D]``
            for a Kronecker block too large to keep (``d.view(shape)`` lays the diagonal
            out like the layer's matrix ``[W | b]``).

    """

    def __init__(self, name: str, index: Tensor, d: Optional[Tensor] = None):
        self.name = name
        self.shape = tuple(index.shape)
        self.index = index.reshape(-1)
        self.d = None if d is None else d.reshape(-1)

    def update(self, d: Tensor, decay: float = 0.0) -> None:
        """Fold a new diagonal into the running one."""
        self.d = ema(self.d, d.reshape(-1), decay)

    def matvec(self, v: Tensor) -> Tensor:
        """``d * v`` for ``v [P_b]``."""
        return self.d.to(v.dtype) * v

    def inverse_matvec(
        self, v: Tensor, damping: Union[float, Tensor], mode: str = "exact"
    ) -> Tensor:
        """``v / (d + damping)``; ``damping`` a number or ``[P_b]`` (per position).

        The damping is exact for every ``mode`` (``"pi"`` has no factors to split it).
        """
        return v / (self.d.to(v.dtype) + damping)

    def dense(self) -> Tensor:
        """``diag(d)`` ``[P_b, P_b]``."""
        return torch.diag(self.d)

    def trace(self) -> Tensor:
        """``sum d``."""
        return self.d.sum()

    def logdet(self, damping: float) -> Tensor:
        """``sum log(d + damping)``."""
        return torch.log(self.d + damping).sum()

    def state_dict(self) -> Dict[str, Any]:
        """The diagonal and the index (cloned)."""
        return {"d": None if self.d is None else self.d.clone(), "index": self.index.clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.d = None if state["d"] is None else state["d"].clone()
        self.index = state["index"].clone()
        if math.prod(self.shape) != self.index.numel():
            self.shape = tuple(self.index.shape)
