"""A diagonal block: a running Fisher diagonal on a set of flat positions.

For layers whose Kronecker factors are too large, layers no Kronecker rule covers (with
``unsupported="diagonal"``) and :class:`~curvature.DiagonalNaturalGradient`: the
curvature on positions ``index [P_b]`` is ``diag(d)``, ``d = sum_{k,n} grad_nk^2`` from
the per-sample (per-vector) gradients, and its damped inverse maps ``v`` to
``v / (d + lambda)``.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Union

import torch
from torch import Tensor

from .running import ema, update_weight


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
        #: 0-d device bool: no finite statistics folded in yet (``None``: known not).
        self.fresh: Optional[Tensor] = None
        #: ``d`` in the shape the statistics arrive in (e.g. ``[1, D_out, D]``), sharing its
        #: storage: updated in place with no reshape per step (``None``: reshape them).
        self._running: Optional[Tensor] = None

    def update(self, d: Tensor, decay: float = 0.0, valid: Optional[Tensor] = None) -> None:
        """Fold a new diagonal into the running one (``valid`` as in ``KroneckerBlock.update``)."""
        if self.d is None:
            self.d = d.reshape(-1)
            self._running = d if d.dim() != 1 and d.is_contiguous() else None  # (d a view)
            self.fresh = None if valid is None else ~valid
            return
        w, self.fresh = update_weight(valid, self.fresh, decay, self.d.dtype)
        if self._running is not None and d.shape == self._running.shape:
            ema(self._running, d, decay, w)  # in place, so in d too
            return
        self.d = ema(self.d, d if d.dim() == 1 else d.reshape(-1), decay, w)

    def rebase(self, d: Tensor) -> None:
        """Hold the running diagonal in ``d`` ``[P_b]`` from now on (copied in first).

        E.g. a view of one flat buffer shared by several blocks, so that an optimizer
        acts on all their diagonals with one call; the in-place updates write through it.
        """
        if self.d is not None and d is not self.d:
            d.copy_(self.d)
        running = None if self._running is None else self._running.shape
        self.d = d
        self._running = None if running is None else d.view(running)

    def flags(self) -> List[Tensor]:
        """The 0-d device flags the block waits to read (:meth:`read_flags`)."""
        return [] if self.fresh is None else [self.fresh]

    def read_flags(self, values: List[bool]) -> None:
        """The host values of :meth:`flags`."""
        if self.fresh is not None and not values[0]:
            self.fresh = None

    def matvec(self, v: Tensor) -> Tensor:
        """``d * v`` for ``v [P_b]``."""
        return self.d.to(v.dtype) * v

    def inverse_matvec(
        self, v: Tensor, damping: Union[float, Tensor], mode: str = "exact"
    ) -> Tensor:
        """``v / (d + damping)``; ``damping`` a number or ``[P_b]`` (per position).

        The damping is exact for every ``mode`` (``"pi"`` has no factors to split it).
        While the block has had no finite statistics (:attr:`fresh`), ``v`` itself.
        """
        out = v / (self.d.to(v.dtype) + damping)
        return out if self.fresh is None else torch.where(self.fresh, v, out)

    def inverse_matvec_into(
        self, v: Any, damping: Union[float, Tensor], mode: str = "exact"
    ) -> None:
        """:meth:`inverse_matvec` of ``v.M`` written into ``v.out`` (``BlockViews``)."""
        torch.add(self.d.to(v.M.dtype), damping, out=v.out)
        torch.div(v.M, v.out, out=v.out)
        if self.fresh is not None:
            torch.where(self.fresh, v.M, v.out, out=v.out)

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
        self._running = None
        self.index = state["index"].clone()
        if math.prod(self.shape) != self.index.numel():
            self.shape = tuple(self.index.shape)
