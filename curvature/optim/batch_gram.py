"""The quadratic rule's batch Gram matrix from the pulled layer inputs and output gradients,
and the plain loop's persistent buffers of its directions (:class:`DirectionBuffers`).

For a layer with linear structure (a weight that acts as a matrix on its expanded inputs
``a [N, S, C, D]``, the bias column included) and the output gradients ``g [L, N, S, C,
D_out]`` of the ``L`` sources a pull sent back, a direction ``v`` over the flat parameters
moves the layer's outputs by ``z = V a`` (``V [C, D_out, D]`` the layer's part of ``v``), and
``u[l, n] = sum_{s, c} g[l, n, s, c]^T z[n, s, c]`` is ``(J_n v)^T`` times the ``l``-th
source. :func:`layer_products` gives ``u`` for ``K`` directions at once, :func:`batch_gram`
sums it over the layers and forms ``F = scale * sum_{l, n} u_i u_j``.

Where the layer's positions in the flat vector are strided (:func:`projection_of`: a
``Linear`` or a convolution, whose weight is one contiguous ``[C, D_out, D_w]`` span and
whose bias is another), ``V`` is read as views of the directions and ``z = a_w W^T + a_b b``
is one matrix product per direction and group; otherwise the positions are gathered
through the layer's index.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor


class Projection(NamedTuple):
    """Where a layer block's matrix ``[C, D_out, D]`` lies in the flat vector.

    Attributes:
        index: ``[C, D_out, D]`` positions of the entries (the layer rule's ``kfac_index``).
        weight: Start of the contiguous span of the first ``D_w`` columns, ``None`` when the
            positions are not strided (then ``index`` gathers them).
        columns: ``D_w``, the columns in that span (``D`` or ``D - 1``).
        bias: Start of the contiguous span of the last column (``D_w = D - 1``), or ``None``.

    """

    index: Tensor
    weight: Optional[int] = None
    columns: int = 0
    bias: Optional[int] = None


def projection_of(index: Tensor, device: torch.device) -> Projection:
    """The :class:`Projection` of a host index ``[C, D_out, D]`` (kept on ``device``):
    strided when entry ``(c, o, i)`` sits at ``w + (c D_out + o) D_w + i`` for ``i < D_w``
    and the last column (``D_w = D - 1``) at ``b + c D_out + o``, as a ``Linear``'s
    ``[W | b]``.
    """
    C, Do, D = index.shape
    on = index.to(device)
    if index.numel() == 0:
        return Projection(on)
    for columns in (D, D - 1):
        if columns < 1:
            continue
        w = int(index[0, 0, 0])
        expected = w + torch.arange(C * Do * columns, dtype=index.dtype).view(C, Do, columns)
        if not torch.equal(index[..., :columns], expected):
            continue
        if columns == D:
            return Projection(on, w, columns)
        b = int(index[0, 0, D - 1])
        if torch.equal(index[..., D - 1], b + torch.arange(C * Do, dtype=index.dtype).view(C, Do)):
            return Projection(on, w, columns, b)
    return Projection(on)


def layer_products(V: Tensor, a: Tensor, g: Tensor, where: Projection) -> Tensor:
    """``u [K, L, N]``: ``u[k, l, n] = sum_{s, c} g[l, n, s, c]^T V_k[c] a[n, s, c]``.

    The layer's part of each direction is read as views (``W [K, C, D_out, D_w]`` and the
    bias column ``b [K, C, D_out]``) where its positions are strided, else gathered through
    the index (``D_w = D``, no separate bias). With one group the product runs on the
    narrower side: ``z = a [W | b]^T`` (``[N S, D_out]`` per direction) when
    ``D_out < D``, else ``y = g [W | b]`` (``[L N S, D]``), then summed against the other
    operand; a first layer of a few inputs never forms a ``D_out``-wide intermediate. The
    bias column enters the matrix product (``[W | b]`` is a copy of the layer's part of
    the directions, ``[K, D_out, D]``).

    Args:
        V: ``[K, P]`` directions over the flat parameters.
        a: ``[N, S, C, D]`` the layer's expanded inputs (bias column included).
        g: ``[..., N, S, C, D_out]`` the output gradients of the pulled sources.
        where: The layer block's positions in the flat vector (:func:`projection_of`).

    """
    K = V.shape[0]
    N, S, C, D = a.shape
    Do = g.shape[-1]
    g = g.reshape(-1, N, S, C, Do)  # [L, N, S, C, D_out]
    L = g.shape[0]
    b: Optional[Tensor] = None
    if where.weight is None:  # gather the positions
        Dw = D
        W = V.to(a.dtype).index_select(1, where.index.reshape(-1)).view(K, C, Do, D)
    else:  # views of the directions
        Dw, w = where.columns, where.weight
        W = V[:, w : w + C * Do * Dw].view(K, C, Do, Dw).to(a.dtype)
        if where.bias is not None:
            b = V[:, where.bias : where.bias + C * Do].view(K, C, Do).to(a.dtype)
    if C != 1:
        z = torch.einsum("nscd,kcod->knsco", a[..., :Dw], W)
        if b is not None:
            z.addcmul_(a[None, ..., Dw:], b.view(K, 1, 1, C, Do))
        return torch.einsum("knsco,lnsco->kln", z, g)
    # [W | b] per direction ([K, D_out, D], a small copy): the bias column of ``a`` enters
    # the matrix products, no pass of the products' size for it
    Wb = (W if b is None else torch.cat([W, b.unsqueeze(-1)], dim=-1))[:, 0]
    rows, g2 = a.reshape(N * S, D), g.reshape(L * N * S, Do)
    if Do >= D:  # through g: y = g [W | b], summed against a
        u = a.new_empty(K, L, N * S)
        for k in range(K):
            y = torch.mm(g2, Wb[k]).view(L, N * S, D)
            u[k] = (y * rows).sum(-1)
        return u.view(K, L, N, S).sum(-1)
    z = a.new_empty(K, N * S, Do)  # through a: z = a [W | b]^T
    for k in range(K):
        torch.mm(rows, Wb[k].T, out=z[k])
    # sum over the positions and outputs per sample: [N, K, S D_out] @ [N, S D_out, L]
    z = z.view(K, N, S * Do).transpose(0, 1)
    return torch.bmm(z, g.reshape(L, N, S * Do).permute(1, 2, 0)).permute(1, 2, 0)


def batch_gram(
    V: Tensor, records: list, projection: Callable[[str], Optional[Dict[str, Projection]]]
) -> Tuple[Optional[Tensor], int]:
    """``([K, K], N)``: ``v_i^T F v_j`` for the Fisher / GGN ``F`` of the last pull of each
    term in ``records`` and the samples of that pull (zeros and 0 without any).

    Args:
        V: ``[K, P]`` directions over the flat parameters.
        records: ``(ctx, term, name, blocks)`` per pulled layer, in the order of the pulls
            (the collector's ``projections``; ``blocks``: the rule's ``expanded_blocks``).
        projection: A layer's name to its blocks' :class:`Projection` (``None``: the layer
            has no linear structure).

    Returns:
        ``(None, 0)`` where a layer has no linear structure (e.g. an embedding).

    """
    last: dict = {}  # term -> (ctx, [(name, blocks)]): the last pull of each term
    for ctx, term, name, blocks in records:
        if term not in last or last[term][0] is not ctx:
            last[term] = (ctx, [])
        last[term][1].append((name, blocks))
    gram = V.new_zeros(V.shape[0], V.shape[0], dtype=torch.float64)
    samples = 0
    for ctx, layers in last.values():
        u = None
        for name, blocks in layers:
            index = projection(name)
            if blocks is None or index is None or set(index) != set(blocks):
                return None, 0
            for suffix, where in index.items():
                a, g = blocks[suffix]  # [N, S, C, D], [..., N, S, C, D_out]
                part = layer_products(V, a, g, where)
                u = part if u is None else u + part  # [K, L, N]: summed over the layers
        if u is None:
            continue
        U = u.flatten(1).double()
        scale = ctx.g_scale / ctx.samples if ctx.reduction == "mean" else ctx.g_scale
        gram = gram + scale * (U @ U.T)
        samples = max(samples, ctx.samples)
    return gram, samples


class DirectionBuffers:
    """The plain loop's directions ``V = (-d, delta0)`` in two persistent ``[2, P]`` buffers
    used in turn: a step's update is written into the row of the other buffer whose views
    become the ``previous_update`` states, and is ``V``'s second row as it lies at the next
    step (no concatenation of the states, no copy); states replaced in between (loaded,
    set by the user, of another dtype than the directions) are copied in instead.
    """

    def __init__(self) -> None:
        self.layout: Any = None
        self.buffers: Optional[Tensor] = None  # [2 (turn), 2 (-d, delta0), P]
        self.turn = 0  # the buffer of the next V
        self.views: Tuple[Tensor, ...] = ()  # the last update's views (the states)

    def directions(
        self, layout: Any, directions: Tensor, previous: Optional[List[Tensor]]
    ) -> Tuple[Tensor, Tensor]:
        """``(V [K, P], out [P])``: ``V = (-d, delta0)`` (``K = 1`` without ``previous``) and
        where this step's update goes (then :meth:`written`).
        """
        P, dtype, device = directions.numel(), directions.dtype, directions.device
        b = self.buffers
        if (
            b is None
            or layout is not self.layout
            or (b.shape[-1], b.dtype, b.device) != (P, dtype, device)
        ):
            self.buffers = b = directions.new_empty(2, 2, P)
            self.layout, self.turn, self.views = layout, 0, ()
        if previous is not None and not (
            len(self.views) == len(previous)
            and all(p is q and p.dtype == dtype for p, q in zip(previous, self.views))
        ):
            self.turn = 1 - self.turn  # into the buffer the states do not lie in
            torch.cat([p.reshape(-1).to(dtype) for p in previous], out=b[self.turn, 1])
        V = b[self.turn, : 1 if previous is None else 2]
        torch.neg(directions, out=V[0])
        return V, b[1 - self.turn, 1]

    def written(self, views: Sequence[Tensor]) -> None:
        """The update is in ``out``; ``views`` (its views per parameter) are the states."""
        self.turn, self.views = 1 - self.turn, tuple(views)

    def detached(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """A parameter's state with a ``previous_update`` in the buffers as its own copy."""
        p, b = state.get("previous_update"), self.buffers
        if p is None or b is None or p.untyped_storage().data_ptr() != b.data_ptr():
            return state
        return {**state, "previous_update": p.clone()}
