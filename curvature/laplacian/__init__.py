r"""Laplacians of a model's output w.r.t. its input, per sample (PINN losses).

For a model ``f: R^d -> R^O`` applied row-wise to ``x [N, d]``, the Laplacian of sample
``n`` is ``Delta f(x_n) = sum_{i=1}^d d^2 f / d x_i^2 (x_n) = tr(H_n)`` with ``H_n`` the
``[d, d]`` Hessian of each output w.r.t. the input. Three methods, all differentiable
w.r.t. the parameters (and ``x``):

- ``"forward"``: the forward Laplacian (Li et al. 2023; Dangel, Muller, Zeinhofer 2024),
  one forward pass of the stacked state ``[N, d + 2, F]`` (value, the ``d`` first
  derivatives, the Laplacian) through the layers, which are *called as modules* so that
  the capture engine sees every Linear layer with weight sharing over the ``d + 2`` slots
  (inside :func:`curvature.layers.base.shared_slots`).
- ``"autograd"``: exact, nested reverse mode: one backward for the gradient, one batched
  backward over the ``d`` input directions for the diagonal of the Hessian.
- ``"hutchinson"``: ``mean_k v_k^T H_n v_k`` over ``K`` Rademacher probes per sample, in
  one batched backward.

Modules: :mod:`~curvature.laplacian.api` (:func:`laplacian`, :func:`forward_laplacian`),
:mod:`~curvature.laplacian.activations` (the activation tables,
:func:`register_activation`), :mod:`~curvature.laplacian.compiler` (a model to a plan,
``torch.fx`` for custom modules), :mod:`~curvature.laplacian.forward` (the state and its
propagation), :mod:`~curvature.laplacian.autograd` (nested reverse mode).
"""

from __future__ import annotations

from ..layers.base import SHARED_SLOTS, current_shared_slots
from .activations import ACTIVATIONS, register_activation
from .api import forward_laplacian, laplacian
from .forward import ForwardLaplacian

__all__ = [
    "ACTIVATIONS",
    "FORWARD_LAPLACIAN_SLOTS",
    "ForwardLaplacian",
    "current_slots",
    "forward_laplacian",
    "laplacian",
    "register_activation",
]

#: Alias of :data:`curvature.layers.base.SHARED_SLOTS`: ``d + 2`` while the forward
#: Laplacian calls a Linear module on its stacked state ``[N, d + 2, F]``, else ``None``.
FORWARD_LAPLACIAN_SLOTS = SHARED_SLOTS
#: Alias of :func:`curvature.layers.base.current_shared_slots`.
current_slots = current_shared_slots
