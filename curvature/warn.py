"""Warnings that point at the user's line, not into the library or torch.

``warnings.warn(..., stacklevel=k)`` needs the depth of the user's frame, which depends
on the path through the library and on torch's wrappers (``@torch.no_grad()``,
``Optimizer.step``'s profiling hooks). :func:`warn` finds it: the first frame outside
``curvature`` and ``torch``.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Type

import torch

_SKIP = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,
)


def warn(message: str, category: Type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first calling frame outside curvature and torch."""
    frame = inspect.currentframe()
    caller = frame.f_back if frame is not None else None
    level = 2
    while caller is not None and os.path.abspath(caller.f_code.co_filename).startswith(_SKIP):
        caller = caller.f_back
        level += 1
    del frame, caller
    warnings.warn(message, category, stacklevel=level)
