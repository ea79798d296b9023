"""A recurrent layer unrolled in time: its Linear sub-layers shared over the time steps.

At step ``t`` of layer ``l`` (direction ``d``), ``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU``
compute two Linear maps, the input's ``z^ih_t = W_ih x_t + b_ih`` and the state's
``z^hh_t = W_hh h_{t-1} + b_hh`` (``[G H]``: ``G`` = 1, 4, 3 gates), and the gates from
them (torch's order: LSTM ``i, f, g, o``; GRU ``r, z, n``, ``n = tanh(z^ih_n + r z^hh_n)``).
Each weight is shared over the ``L`` steps, so the layer's per-sample gradient is

    grad W_ih = sum_t (dl / dz^ih_t) [x_t, 1]^T,    grad W_hh = sum_t (dl / dz^hh_t) [h_{t-1}, 1]^T

exactly (backpropagation through time): a Linear layer over ``S = L`` positions, the
weight sharing of KFAC's ``"expand"`` / ``"reduce"`` (Martens, Ba & Ba 2018 treat time as
such). :func:`unrolled_blocks` replays the layer step by step in torch ops (the recorded
input, the current weights), backpropagates the recorded output gradients through that
replay, and returns each sub-layer's inputs and output gradients as the expanded blocks
``{suffix: (a [N, L, 1, D], g [K, N, L, 1, G H])}``, ``suffix`` = ``"ih_l0"``,
``"hh_l0"``, ``"ih_l0_reverse"``, ... (the parameter names without ``weight_``).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn


def sublayers(module: nn.RNNBase) -> Iterator[Tuple[str, Tensor, Optional[Tensor]]]:
    """``(suffix, weight, bias or None)`` of every Linear sub-layer, in parameter order."""
    for layer in range(module.num_layers):
        for rev in ("", "_reverse")[: 2 if module.bidirectional else 1]:
            for kind in ("ih", "hh"):
                name = f"{kind}_l{layer}{rev}"
                yield name, getattr(module, f"weight_{name}"), getattr(module, f"bias_{name}", None)


def _cell(mode: str, zi: Tensor, zh: Tensor, h: Tensor, c: Optional[Tensor]):
    """One step from the two pre-activations: ``(h_t, c_t)`` (``c_t`` of an LSTM only)."""
    if mode == "LSTM":
        i, f, g, o = (zi + zh).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, i_n = zi.chunk(3, -1)
        hr, hz, h_n = zh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(i_n + r * h_n)
        return (1 - z) * n + z * h, None
    pre = zi + zh
    return (torch.tanh(pre) if mode == "RNN_TANH" else torch.relu(pre)), None


def _states(module: nn.RNNBase, hx: Any, N: int, like: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
    """``(h_0, c_0)`` ``[layers * directions, N, H]`` (zeros where not given)."""
    shape = (module.num_layers * (2 if module.bidirectional else 1), N, module.hidden_size)
    if hx is None:
        zeros = like.new_zeros(shape)
        return zeros, (zeros if module.mode == "LSTM" else None)
    if module.mode == "LSTM":
        return hx[0].detach(), hx[1].detach()
    return hx.detach(), None


def _with_k(g: Tensor, dims: int) -> Tensor:
    """``g`` with a leading ``[K]`` axis (``K = 1`` where it has none)."""
    return g if g.dim() > dims else g.unsqueeze(0)


def unrolled_blocks(
    module: nn.RNNBase, x: Tensor, hx: Any, grads: List[Tensor], out_index: List[int]
) -> Dict[str, Tuple[Tensor, Tensor]]:
    """Expanded blocks of one call (see the module docstring).

    Args:
        module: The layer (``proj_size == 0``).
        x: Its input ``[N, L, I]`` (``batch_first``) or ``[L, N, I]``.
        hx: Its initial state (``h_0``; ``(h_0, c_0)`` for an LSTM) or ``None``.
        grads: The recorded gradients of its output leaves ``out_index`` (``output``,
            ``h_n`` and ``c_n``), each with a leading ``[K]`` axis or without.
        out_index: The positions of those leaves in ``(output, h_n[, c_n])``.

    Returns:
        Suffix to ``(a [N, L, 1, D], g [K, N, L, 1, G H])``; ``a`` ends with the bias
        column where the bias is trainable, and starts with the input columns where the
        weight is.

    """
    mode = module.mode
    subs = {  # weights that require grad: the replay builds a graph (never backpropagated to)
        name: (W.detach().requires_grad_(), None if b is None else b.detach().requires_grad_())
        for name, W, b in sublayers(module)
    }
    dtype = next(iter(subs.values()))[0].dtype
    seq = (x.transpose(0, 1) if module.batch_first else x).detach().to(dtype)  # [L, N, I]
    L, N = seq.shape[0], seq.shape[1]
    h0, c0 = _states(module, hx, N, seq)
    h0, c0 = h0.to(dtype), (None if c0 is None else c0.to(dtype))
    inputs: Dict[str, Tensor] = {}  # suffix -> a [L, N, D_in] (time-major)
    zs: Dict[str, List[Tensor]] = {}  # suffix -> the pre-activations to differentiate
    with torch.enable_grad():
        layer_in, h_n, c_n = seq, [], []
        for layer in range(module.num_layers):
            outs = []
            for d, rev in enumerate(("", "_reverse")[: 2 if module.bidirectional else 1]):
                s = layer * (2 if module.bidirectional else 1) + d
                xs = layer_in.flip(0) if rev else layer_in
                Wi, bi = subs[f"ih_l{layer}{rev}"]
                Wh, bh = subs[f"hh_l{layer}{rev}"]
                zi = (
                    xs @ Wi.T
                    if bi is None
                    else torch.addmm(bi, xs.flatten(0, 1), Wi.T).view(L, N, -1)
                )
                h, c, hs, prev, zh_list = h0[s], (None if c0 is None else c0[s]), [], [], []
                for t in range(L):
                    zh = h @ Wh.T if bh is None else torch.addmm(bh, h, Wh.T)
                    prev.append(h)
                    zh_list.append(zh)
                    h, c = _cell(mode, zi[t], zh, h, c)
                    hs.append(h)
                out = torch.stack(hs)
                outs.append(out.flip(0) if rev else out)
                h_n.append(h)
                c_n.append(c)
                inputs[f"ih_l{layer}{rev}"], zs[f"ih_l{layer}{rev}"] = xs, [zi]
                inputs[f"hh_l{layer}{rev}"] = torch.stack(prev).detach()
                zs[f"hh_l{layer}{rev}"] = zh_list
            layer_in = torch.cat(outs, -1) if len(outs) > 1 else outs[0]
        output = layer_in.transpose(0, 1) if module.batch_first else layer_in
        leaves = [output, torch.stack(h_n)] + ([torch.stack(c_n)] if mode == "LSTM" else [])
        outs_, gs = [leaves[j] for j in out_index], [_with_k(g, 3) for g in grads]
        wanted = [z for name in zs for z in zs[name]]
        K = gs[0].shape[0]
        per_k = [
            [
                torch.zeros_like(z) if d is None else d
                for z, d in zip(
                    wanted,
                    torch.autograd.grad(
                        outs_,
                        wanted,
                        [g[k].to(dtype) for g in gs],
                        retain_graph=k < K - 1,
                        allow_unused=True,
                    ),
                )
            ]
            for k in range(K)
        ]
    blocks: Dict[str, Tuple[Tensor, Tensor]] = {}
    at = 0
    for name in subs:
        n_z = len(zs[name])
        g = torch.stack([torch.cat(r[at : at + n_z]).view(L, N, -1) for r in per_k])
        at += n_z  # g: [K, L, N, G H] (time-major)
        a = inputs[name].detach()
        cols = []
        if getattr(module, f"weight_{name}").requires_grad:
            cols.append(a)
        bias = getattr(module, f"bias_{name}", None)
        if bias is not None and bias.requires_grad:
            cols.append(a.new_ones(L, N, 1))
        if not cols:
            continue
        a = torch.cat(cols, -1) if len(cols) > 1 else cols[0]
        blocks[name] = (a.transpose(0, 1).unsqueeze(2), g.transpose(1, 2).unsqueeze(3))
    return blocks
