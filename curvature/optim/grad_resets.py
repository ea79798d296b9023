"""Gradients reset outside the optimizer: ``model.zero_grad()``, ``p.grad = None``.

The statistics of a step follow the gradients in ``.grad``: the optimizer's own
``zero_grad()`` drops those of the backward passes whose gradients it zeroes. A reset
through another door (``model.zero_grad()`` after a validation gradient, another
optimizer's ``zero_grad()``, ``p.grad = None``) used to leave them in the step.
:class:`GradientResets` keeps a *witness*: the first parameter a backward filled since
the statistics were last dropped. At the next forward, a witness whose ``.grad`` is
``None`` means the gradients those statistics belong to were reset: the collector drops
them as ``zero_grad()`` would. No host read. Not seen: a reset that zeroes in place
(``set_to_none=False``), or one that spares the witness.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

from torch import Tensor


class GradientResets:
    """The witness of the gradients the step's statistics belong to (module docstring)."""

    def __init__(self) -> None:
        self._witness: Optional[Callable[[], Optional[Tensor]]] = None

    def filled(self, param: Tensor) -> None:
        """A backward accumulated into ``param.grad`` (the first one becomes the witness)."""
        if self._witness is None:
            self._witness = weakref.ref(param)

    def reset(self) -> bool:
        """Whether the witness's ``.grad`` was reset (then it is forgotten)."""
        param = None if self._witness is None else self._witness()
        if param is None or param.grad is not None:
            return False
        self._witness = None
        return True

    def forget(self) -> None:
        """The statistics were dropped (``zero_grad()``): no witness until the next fill."""
        self._witness = None


__all__ = ["GradientResets"]
