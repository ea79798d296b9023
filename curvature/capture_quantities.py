"""The per-sample quantities of a capture: gradients, their norms and Gram matrix.

A mixin of :class:`curvature.capture.Capture`: each method pulls the per-sample losses
``[N]`` once through the recorded graph and asks every layer rule for its part. Layers
without ties take their cheapest route (Linear without sharing: ``|a_n|^2 |g_n|^2``);
parameters that several layers use (tied weights) are summed over the layers first.
"""

from __future__ import annotations

from typing import Dict, Optional

from torch import Tensor

from .layer_stats import empty_per_sample_grads, summed_per_sample_grads, tied_per_sample_grads
from .layers.base import gram_of
from .layout import ParamSharing


class PerSampleQuantities:
    """Per-sample methods over a capture's recorded calls (see :class:`Capture`)."""

    def _pull_losses(self, losses: Tensor, retain_graph: bool) -> int:
        """Check ``losses [N]``, pull ``sum_n l_n`` (unless ``N = 0``) and return ``N``."""
        N = self.batch_size
        if not isinstance(losses, Tensor) or losses.dim() != 1 or losses.shape[0] != N:
            shape = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses)
            raise ValueError(
                f"losses must be a 1-D tensor [N] = [{N}] of per-sample losses (e.g. "
                f"`loss_func(reduction='none')` reduced over non-batch axes); got {shape}."
            )
        if N == 0:  # an empty batch: empty results, nothing to pull
            return N
        if losses.grad_fn is None:
            raise ValueError(
                "losses do not require grad: compute them from the captured model output "
                "with gradients enabled."
            )
        self.pull(losses.sum(), retain_graph=retain_graph)
        for name, _, _, calls in self.active():
            for c in calls:
                c.check_inputs_unchanged(name)
        return N

    def sharing(self) -> ParamSharing:
        """Which parameters several captured layers use (tied weights), found by identity."""
        return ParamSharing(self.model, [(n, m, r.param_names(m)) for n, m, r in self.layers])

    # -- per-sample quantities ----------------------------------------------------------
    def per_sample_grads(
        self,
        losses: Tensor,
        *,
        retain_graph: bool = True,
        out: Optional[Dict[str, Tensor]] = None,
    ) -> Dict[str, Tensor]:
        """Per-sample gradients ``grad l_n`` of every captured parameter.

        A parameter that several layers use (tied weights, e.g. ``head.weight =
        emb.weight``) gets the sum of every layer's contribution, under its name in
        ``model.named_parameters()`` (the first one).

        Args:
            losses: Per-sample losses ``[N]`` computed from the captured output.
            retain_graph: Keep the graph for further pulls or a later ``backward()``.
            out: Optional preallocated results, parameter name to ``[N, *p.shape]``
                (contiguous, the parameter's dtype and device). Reusing buffers across
                steps avoids the page faults of fresh allocations, which otherwise
                dominate the cost on CPU for large layers.

        Returns:
            Parameter name (as in ``model.named_parameters()``) to ``[N, *p.shape]``.
            Without ``out``, new tensors on the parameters' device, freed when you
            drop them. For an empty batch (``N = 0``), ``[0, *p.shape]``.

        """
        N = self._pull_losses(losses, retain_graph)
        sharing = self.sharing()
        if N == 0:
            return empty_per_sample_grads(self.model, sharing, out)
        with self.computing():
            res = summed_per_sample_grads(self.active(), sharing, N, out)
        # captured layers the losses do not depend on (or not called): zero gradients
        for n, z in empty_per_sample_grads(self.model, sharing, None).items():
            if n not in res:
                buf = (out or {}).get(n)
                res[n] = buf.zero_() if buf is not None else z.new_zeros((N, *z.shape[1:]))
        return {n: res[n] for n, _ in self.model.named_parameters() if n in res}

    def per_sample_grad_norms(self, losses: Tensor, *, retain_graph: bool = True) -> Tensor:
        """L2 norms ``[N]`` of the per-sample gradients over all captured parameters.

        Layers with a cheaper route (Linear without sharing: ``|a_n|^2 |g_n|^2``; with
        sharing: the Gram trick over positions) never materialize ``[N, *p.shape]``.
        Layers that share a parameter with another layer (tied weights) materialize
        their per-sample gradients, summed per parameter: the norm is that of the sum.
        """
        N = self._pull_losses(losses, retain_graph)
        if N == 0:
            return losses.new_zeros(0)
        sharing = self.sharing()
        with self.computing():
            tied = [layer for layer in self.active() if sharing.tied(layer[0])]
            tied_grads = tied_per_sample_grads(tied, sharing.names)
            sq = sum(g.reshape(N, -1).pow(2).sum(1) for g in tied_grads.values())
            for name, module, rule, calls in self.active():
                if not sharing.tied(name):
                    sq = sq + rule.per_sample_sq_norms(module, calls)
        return sq.sqrt()

    def gram(self, losses: Tensor, *, retain_graph: bool = True) -> Tensor:
        """Gram matrix ``K[n, m] = <grad l_n, grad l_m>`` ``[N, N]`` of per-sample grads.

        Tied parameters count once, with the sum of their layers' contributions (as in
        :meth:`per_sample_grad_norms`).
        """
        N = self._pull_losses(losses, retain_graph)
        if N == 0:
            return losses.new_zeros(0, 0)
        sharing = self.sharing()
        with self.computing():
            tied = [layer for layer in self.active() if sharing.tied(layer[0])]
            total = gram_of(tied_per_sample_grads(tied, sharing.names)) if tied else 0
            for name, module, rule, calls in self.active():
                if not sharing.tied(name):
                    total = total + rule.gram(module, calls)
            return total
