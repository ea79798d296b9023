"""``nn.Embedding``: a Linear layer on one-hot inputs, shared over token positions.

For indices ``i [N, S]`` and output gradients ``g [N, S, D]``, the per-sample gradient
of the table ``E [V, D]`` is ``sum_s onehot(i[n, s]) g[n, s]^T``; rows at ``padding_idx``
get no gradient. Norms and Gram matrices use ``onehot(i_s) . onehot(j_t) = [i_s == j_t]``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import LayerRule
from .precision import gram
from .registry import register


@register(nn.Embedding)
class EmbeddingRule(LayerRule):
    """Per-sample gradients of an embedding table without one-hot matrices."""

    def _flat(self, module: nn.Embedding, calls) -> tuple[Tensor, Tensor]:
        if module.scale_grad_by_freq:
            raise ValueError(
                "nn.Embedding(scale_grad_by_freq=True) scales gradients by token counts "
                "over the whole batch, which mixes samples: per-sample gradients are "
                "undefined. Use scale_grad_by_freq=False."
            )
        idx_list, g_list = [], []
        for call in calls:
            idx = call.args[0]
            if idx.dim() == 0:
                raise ValueError(
                    "nn.Embedding got a single index (0-d); per-sample quantities need a "
                    "leading batch axis, e.g. [N] or [N, S]."
                )
            N = idx.shape[0]
            idx = idx.reshape(N, -1)
            g = call.grads[0].reshape(N, idx.shape[1], -1)
            if module.padding_idx is not None:
                g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
            idx_list.append(idx)
            g_list.append(g)
        if len(calls) == 1:  # no copies
            return idx_list[0], g_list[0]
        return torch.cat(idx_list, 1), torch.cat(g_list, 1)

    def per_sample_grads(self, module, calls, out=None):  # noqa: D102
        if not module.weight.requires_grad:
            return {}
        idx, g = self._flat(module, calls)
        N, S, D = g.shape
        V = module.num_embeddings
        buf = out["weight"] if out else g.new_empty((N, V, D))
        flat = buf.view(N * V, D).zero_()
        rows = (idx + V * torch.arange(N, device=idx.device).unsqueeze(1)).reshape(-1)
        # index_put_ with accumulate: much faster than index_add_ on CPU for few rows
        flat.index_put_((rows,), g.reshape(-1, D), accumulate=True)
        return {"weight": buf}

    def per_sample_sq_norms(self, module, calls):  # noqa: D102
        # compaction: sum g over the (sample, token) pairs that hit the same row, O(N S D)
        idx, g = self._flat(module, calls)
        N, S, D = g.shape
        V = module.num_embeddings
        keys = (idx + V * torch.arange(N, device=idx.device).unsqueeze(1)).reshape(-1)
        rows, inverse = torch.unique(keys, return_inverse=True)
        acc = g.new_zeros(rows.shape[0], D).index_put_(
            (inverse,), g.reshape(-1, D), accumulate=True
        )
        out = g.new_zeros(N)
        return out.index_put_((rows // V,), acc.pow(2).sum(1), accumulate=True)

    def gram(self, module, calls):  # noqa: D102
        idx, g = self._flat(module, calls)
        N, S, D = g.shape
        # the rows the batch uses: U <= min(V, N S) of them
        used, inverse = torch.unique(idx.reshape(-1), return_inverse=True)
        U = used.shape[0]
        if S * S <= U:  # pairs of positions that hit the same row: N^2 S^2 D
            same = (idx[:, None, :, None] == idx[None, :, None, :]).to(g.dtype)  # [N,M,S,T]
            gg = torch.einsum("nsd,mtd->nmst", g, g)
            return (same * gg).sum((2, 3))
        # per-sample gradients restricted to the used rows [N, U, D]: N^2 U D
        rows = inverse.view(N, S) + U * torch.arange(N, device=idx.device).unsqueeze(1)
        compact = g.new_zeros(N * U, D).index_put_(
            (rows.reshape(-1),), g.reshape(-1, D), accumulate=True
        )
        flat = compact.view(N, U * D)
        return flat @ flat.T

    # -- Kronecker factors: a one-hot input, so A is diagonal for "expand" -----------------
    def _flat_batched(self, module, calls):
        """Indices ``[N, S]`` and gradients ``[K, N, S, D]`` (padding positions zeroed)."""
        idx_list, g_list = [], []
        for call in calls:
            raw = call.args[0]
            N = raw.shape[0]
            idx = raw.reshape(N, -1)
            g = call.grads[0]
            g = g.reshape(*g.shape[: g.dim() - raw.dim() - 1], N, idx.shape[1], g.shape[-1])
            if module.padding_idx is not None:
                g = g * (idx != module.padding_idx).unsqueeze(-1).to(g.dtype)
            idx_list.append(idx)
            g_list.append(g)
        return torch.cat(idx_list, 1), torch.cat(g_list, -2)

    def kfac_diagonal_input(self, module, calls, approx):
        """``(diag(A_sum) [1, V], G_sum [1, D, D], count)``: KFAC's sums, ``A``'s diagonal only.

        ``"expand"``: ``A`` is diagonal (the token counts); ``"reduce"``: the diagonal of
        the meaned one-hot inputs' ``sum abar abar^T``.
        """
        return self.kfac_factors(module, calls, approx, True, diagonal=True)[""]

    def kfac_factors(self, module, calls, approx, with_g=True, diagonal=False):  # noqa: D102
        V = module.num_embeddings
        idx = torch.cat([c.args[0].reshape(c.args[0].shape[0], -1) for c in calls], 1)
        N, S = idx.shape
        weight = torch.ones(idx.shape, dtype=module.weight.dtype, device=idx.device)
        if module.padding_idx is not None:
            weight = weight * (idx != module.padding_idx)
        # the sums are 3-d tensors of their own (not unsqueezed views), which the
        # statistics' flush zeroes in place when a step is not finite
        if approx == "expand":
            counts = torch.zeros(1, V, dtype=weight.dtype, device=idx.device)
            counts[0].index_put_((idx.reshape(-1),), weight.reshape(-1), accumulate=True)
            A_sum, count = (counts if diagonal else torch.diag_embed(counts)), N * S
        else:
            abar = torch.zeros(N, V, dtype=weight.dtype, device=idx.device)
            abar.scatter_add_(1, idx, weight / S)
            square = abar.pow(2).sum(0, keepdim=True) if diagonal else None
            A_sum, count = (square if diagonal else gram(abar.unsqueeze(0))), N
        G_sum = None
        if with_g:
            _, g = self._flat_batched(module, calls)  # [K, N, S, D]
            if approx == "reduce":
                g = g.sum(-2, keepdim=True)
            G_sum = gram(g.reshape(1, -1, g.shape[-1]))  # [1, D, D]
        return {"": (A_sum, G_sum, count)}

    def kfac_index(self, module, offsets, device=None):  # noqa: D102
        V, D = module.weight.shape
        # the layer's matrix is E^T [D, V]: entry (d, v) is E[v, d]
        E = torch.arange(offsets["weight"], offsets["weight"] + V * D, device=device)
        index = E.view(V, D).T.contiguous()
        return {"": index.unsqueeze(0)}

    def kfac_shapes(self, module):  # noqa: D102
        if type(self).kfac_index is not EmbeddingRule.kfac_index:  # a subclass's own index
            return super().kfac_shapes(module)
        V, D = module.weight.shape
        return {"": (1, D, V)}
