"""``KFAC(exact_layer_size=P)``: small layers keep their exact Fisher block.

A layer with at most ``P`` trainable parameters (and a Kronecker rule) gets one dense
block ``F_l = sum_{k,n} u_kn u_kn^T`` over all its parameters instead of ``A (x) G``,
``u_kn`` the per-vector gradient of the layer's parameters (for a layer shared over
positions or slots, e.g. the forward Laplacian's, ``u_n = vec(sum_s g_ns a_ns^T)``: the
correlation between a slot's input and its gradient that the Kronecker factorization
drops). It is the library's exact block (``A = [[1]]``, ``G = F_l``), so the running
average, damping (``per_factor``: ``(1 + lambda)(F_l + lambda I)``; pi: ``(1 + pi
sqrt(lambda))(F_l + sqrt(lambda) / pi I)``, ``pi = sqrt(P_l / tr F_l)``; ``exact``:
``F_l + lambda I``), refresh, terms, checkpoint and distributed reduction are the
Kronecker blocks'. Its
statistics cost ``O(K N P^2)`` per step and its inverse ``O(P^3)``, hence a size limit
(at most :data:`~curvature.layer_stats.MAX_EXACT_BLOCK`).
"""

from __future__ import annotations

from typing import Any, Set

from ..layer_stats import MAX_EXACT_BLOCK, layer_numel


def check_exact_layer_size(who: str, size: Any, ekfac: bool) -> int:
    """``exact_layer_size``, validated: an int in ``[0, MAX_EXACT_BLOCK]``; 0 with EKFAC."""
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_EXACT_BLOCK:
        raise ValueError(
            f"{who}(exact_layer_size={size!r}): an int from 0 (default: every layer "
            f"Kronecker-factored) to {MAX_EXACT_BLOCK}; layers with at most this many "
            "parameters keep their exact Fisher block."
        )
    if size and ekfac:
        raise ValueError(
            f"{who}(exact_layer_size={size}): a KFAC option; EKFAC's eigenvalue "
            "corrections are defined for Kronecker blocks only."
        )
    return size


def exact_layer_names(layers: dict, tied: Any, size: int, forward_only: bool) -> Set[str]:
    """The names of the layers (``name -> (module, rule)``) that get an exact block: with
    at most ``size`` trainable parameters, not tied to another layer, not forward-only.
    """
    if not size or forward_only:
        return set()
    return {
        name
        for name, (module, rule) in layers.items()
        if not tied.tied(name) and 0 < layer_numel(module, rule) <= size
    }
