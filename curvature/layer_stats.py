"""Per-layer curvature statistics from recorded calls with pulled gradients.

The pieces that :func:`curvature.kfac`, :func:`curvature.ekfac`, :func:`curvature.diag_ggn`
and the optimizers compute from a layer's calls (inputs ``a`` and pulled gradients ``g``
with a leading axis ``[K]`` over the injected vectors), each written once:

- :func:`fisher_diagonal`: ``sum_{k,n} grad_nk^2``, the layer's Fisher diagonal;
- :func:`eigenvalue_corrections`: EKFAC's ``sum_{k,n} (QG^T grad_nk QA)^2``;
- :func:`exact_factors`: a layer without Kronecker structure as one exact block;
- :func:`per_vector_grads`: the per-vector, per-sample gradients ``[K, N, P_l]``.

Linear-family rules give ``expanded_blocks``, ``a [N, S, C, D]`` and ``g [K, N, S, C,
D_out]`` (``S`` shared positions, ``C`` groups): the gradient of sample ``n`` for vector
``k`` is ``sum_s g a^T``, so without sharing (``S = 1``) squares and rotations factor and
no ``[N, D_out, D]`` is formed.
"""

from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch
from torch import Tensor, nn

from .layers import Call, LayerRule

#: Layers without a Kronecker rule get an exact block up to this many parameters.
MAX_EXACT_BLOCK = 4096


def per_vector_grads(rule: LayerRule, module: nn.Module, calls: Sequence[Call]) -> Tensor:
    """``[K, N, P_l]``: gradients per pulled vector and sample (``named_parameters`` order)."""
    full = [c.grads for c in calls]
    K = full[0][0].shape[0]
    rows = []
    try:
        for k in range(K):
            for c, gs in zip(calls, full):
                c.grads = [g[k] for g in gs]
            grads = rule.per_sample_grads(module, calls)
            rows.append(torch.cat([g.flatten(1) for g in grads.values()], 1))
    finally:
        for c, gs in zip(calls, full):
            c.grads = gs
    return torch.stack(rows)


def exact_factors(rule: LayerRule, module: nn.Module, calls) -> Dict[str, tuple]:
    """A layer without a Kronecker rule as one exact block: ``A = [[1]]``, ``G = U^T U``.

    ``U`` ``[K N, P_l]`` stacks the per-vector gradients of all the layer's parameters;
    the result has the ``{suffix: (A_sum, G_sum, count)}`` form of
    :meth:`~curvature.layers.LayerRule.kfac_factors`.
    """
    U = per_vector_grads(rule, module, calls).flatten(0, 1)
    one = torch.ones(1, 1, 1, dtype=U.dtype, device=U.device)
    return {"": (one, (U.T @ U)[None], 1)}


def expanded_diagonal(a: Tensor, g: Tensor) -> Tensor:
    """``sum_{k,n} (sum_s g a^T)^2`` ``[C, D_out, D]``; ``(g^2)^T (a^2)`` without sharing."""
    if a.shape[1] == 1:
        return torch.einsum("knco,nci->coi", g[:, :, 0].pow(2), a[:, 0].pow(2))
    d = None
    N = a.shape[0]
    chunk = max(1, 2**22 // max(1, g.shape[0] * g[0, 0, 0].numel() * a.shape[-1]))
    for i in range(0, N, chunk):
        gr = torch.einsum("knsco,nsci->kncoi", g[:, i : i + chunk], a[i : i + chunk])
        part = gr.pow(2).sum((0, 1))
        d = part if d is None else d + part
    return d


def fisher_diagonal(
    rule: LayerRule, module: nn.Module, calls: Sequence[Call]
) -> Tuple[bool, Dict[str, Tensor]]:
    """The layer's Fisher diagonal ``sum_{k,n} grad_nk^2`` from its pulled gradients.

    Returns:
        ``(kronecker, parts)``: for a Linear-family layer (``kronecker=True``) block suffix
        to ``[C, D_out, D]``, laid out like the rule's ``kfac_index``; otherwise
        ``{"": [P_l]}`` over the module's trainable parameters in ``named_parameters``
        order.

    """
    expanded = rule.expanded_blocks(module, calls)
    if expanded is None:
        return False, {"": per_vector_grads(rule, module, calls).pow(2).sum((0, 1))}
    return True, {s: expanded_diagonal(a, g) for s, (a, g) in expanded.items()}


def block_name(name: str, suffix: str) -> str:
    """``name.suffix`` (or either alone): the name of one of a layer's blocks."""
    return ".".join(x for x in (name, suffix) if x)


def eigenvalue_corrections(
    name: str,
    module: nn.Module,
    rule: LayerRule,
    calls,
    bases: Dict[str, Tuple[Tensor, Tensor]],
) -> Dict[str, Tensor]:
    """EKFAC's ``sum_{k,n} (QG^T grad_nk QA)^2`` for each of the layer's blocks.

    Args:
        name: Module name; blocks are named ``name`` or ``name.suffix``.
        module: The layer.
        rule: Its rule.
        calls: Its calls, with pulled ``grads [K, ...]``.
        bases: Block name to ``(QA [C, D, D], QG [C, D_out, D_out])``; blocks without a
            basis are skipped.

    Returns:
        Block name to ``[C, D_out, D]``.

    """
    out: Dict[str, Tensor] = {}
    expanded = rule.expanded_blocks(module, calls)
    if expanded is not None:
        for suffix, (a, g) in expanded.items():
            full = block_name(name, suffix)
            if full in bases:
                QA, QG = bases[full]
                out[full] = rotated_second_moments(a, g, QA, QG)
        return out
    if name not in bases:
        return out
    QA, QG = bases[name]
    U = per_vector_grads(rule, module, calls)  # [K, N, P_l]
    D, D_out = QA.shape[-1], QG.shape[-1]
    if D != 1:  # Embedding: per-sample grads [V, D_out] are the layer matrix transposed
        rot = QG[0].mT @ U.view(*U.shape[:2], D, D_out).mT @ QA[0]
    else:
        rot = (U @ QG[0]).unsqueeze(-1)
    out[name] = rot.pow(2).sum((0, 1)).reshape(D_out, D)[None]
    return out


def rotated_second_moments(a: Tensor, g: Tensor, QA: Tensor, QG: Tensor) -> Tensor:
    """``sum_{k,n} (QG^T grad_nk QA)^2`` ``[C, D_out, D]`` from expanded ``a`` and ``g``."""
    ar = torch.einsum("nsci,cij->nscj", a.to(QA.dtype), QA)
    gr = torch.einsum("knsco,cop->knscp", g.to(QG.dtype), QG)
    if a.shape[1] == 1:  # no sharing: sum_{k,n} (gr^2)(ar^2)^T, one GEMM, no [N, D_out, D]
        return torch.einsum("knco,nci->coi", gr[:, :, 0].pow(2), ar[:, 0].pow(2))
    out = None
    K, N = gr.shape[:2]
    chunk = max(1, 2**22 // max(1, K * a.shape[2] * QA.shape[-1] * QG.shape[-1]))
    for i in range(0, N, chunk):
        grad = torch.einsum("knscp,nscj->kncpj", gr[:, i : i + chunk], ar[i : i + chunk])
        part = grad.pow(2).sum((0, 1))
        out = part if out is None else out + part
    return out


def at_positions(values: Tensor, positions: Tensor, wanted: Tensor) -> Tensor:
    """``values`` given at flat ``positions`` (``[P_l]`` each), read at ``wanted`` (any shape).

    E.g. a layer's Fisher diagonal in ``named_parameters`` order, laid out like one of its
    Kronecker blocks' index ``[C, D_out, D]``.
    """
    positions = positions.to(values.device)
    order = torch.argsort(positions)
    k = order[torch.searchsorted(positions[order], wanted.reshape(-1).to(values.device))]
    return values[k].view(wanted.shape)
