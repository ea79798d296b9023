"""Per-layer curvature statistics from recorded calls with pulled gradients.

The pieces that :func:`curvature.kfac`, :func:`curvature.ekfac`, :func:`curvature.diag_ggn`
and the optimizers compute from a layer's calls (inputs ``a`` and pulled gradients ``g``
with a leading axis ``[K]`` over the injected vectors), each written once:

- :func:`fisher_diagonal`: ``sum_{k,n} grad_nk^2``, the layer's Fisher diagonal (with
  :mod:`curvature.layer_diagonal`: chunks of samples for convolutions);
- :func:`eigenvalue_corrections`: EKFAC's ``sum_{k,n} (QG^T grad_nk QA)^2``;
- :func:`exact_factors`: a layer without Kronecker structure as one exact block;
- :func:`per_vector_grads`: the per-vector, per-sample gradients ``[K, N, P_l]``;
- :func:`tied_per_sample_grads`, :func:`tied_per_vector_grads`,
  :func:`tied_fisher_diagonal`: the same for layers that share a parameter (tied
  weights), summed over the layers before any square.

Linear-family rules give ``expanded_blocks``, ``a [N, S, C, D]`` and ``g [K, N, S, C,
D_out]`` (``S`` shared positions, ``C`` groups): the gradient of sample ``n`` for vector
``k`` is ``sum_s g a^T``, so without sharing (``S = 1``) squares and rotations factor and
no ``[N, D_out, D]`` is formed.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Collection, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .block_indices import block_index, layer_positions  # noqa: F401 (layer_positions: re-export)
from .edges import check_out_buffer
from .layer_diagonal import chunked_diagonal, diagonal_chunk, direct_diagonal, expanded_diagonal
from .layers import Call, LayerRule
from .layers.base import expanded_kfac
from .layers.kfac_sums import group_grams
from .layers.plain import (
    PlainOperands,
    SquaredInputs,
    plain_diagonal,
    plain_rotated,
    squares_diagonal,
)
from .layout import ParamSharing

#: ``(layer name, module, rule, calls)`` of one layer with recorded calls.
Layer = Tuple[str, nn.Module, LayerRule, List[Call]]

#: Layers without a Kronecker rule get an exact block up to this many parameters.
MAX_EXACT_BLOCK = 4096


def layer_numel(module: nn.Module, rule: LayerRule) -> int:
    """The number of trainable parameter entries the rule covers in the module."""
    params = dict(module.named_parameters())
    return sum(params[n].numel() for n in rule.param_names(module))


def no_block_reasons(
    layers: Dict[str, Tuple[nn.Module, LayerRule]],
    sharing: ParamSharing,
    blocked: Collection[str],
    forward_only: bool,
) -> Dict[str, str]:
    """Parameter name to why no curvature block covers it (for warnings and errors).

    Args:
        layers: Covered layer name to ``(module, rule)``.
        sharing: Their :class:`~curvature.layout.ParamSharing` (tied parameters).
        blocked: The layers that got a block.
        forward_only: Whether the Fisher is forward-only (no exact blocks then).

    Returns:
        ``"'name' (why)"`` per parameter of a tied layer (:meth:`ParamSharing.tie_reasons`)
        or of a layer without Kronecker rule too large for an exact block.

    """
    out = sharing.tie_reasons()
    for name, (module, rule) in layers.items():
        if name in blocked or sharing.tied(name):
            continue
        n = layer_numel(module, rule)
        why = f"layer '{name or '<model>'}' ({type(module).__name__}) has no Kronecker rule" + (
            ", and a forward-only Fisher has no exact block"
            if forward_only
            else f" and {n} parameters, more than an exact block takes ({MAX_EXACT_BLOCK})"
        )
        out.update({c: f"'{c}' ({why})" for c in sharing.names[name].values()})
    return out


@contextmanager
def vector_slices(calls: Sequence[Call]) -> Iterator[Iterator[int]]:
    """Iterate over the pulled vectors ``k``: inside, every call's ``grads`` is slice ``k``.

    The calls' ``grads`` carry a leading ``[K]`` axis (a batched pull); the yielded
    iterator sets them to ``[g[k] for g in grads]`` for ``k = 0 .. K-1`` in turn, so that
    a rule's (non-batched) :meth:`~curvature.layers.LayerRule.per_sample_grads` sees one
    vector at a time. The full gradients are restored on exit.
    """
    full = [c.grads for c in calls]
    K = next(gs[0].shape[0] for gs in full if gs)

    def slices() -> Iterator[int]:
        for k in range(K):
            for c, gs in zip(calls, full):
                c.grads = [g[k] for g in gs]
            yield k

    try:
        yield slices()
    finally:
        for c, gs in zip(calls, full):
            c.grads = gs


def per_vector_grads(rule: LayerRule, module: nn.Module, calls: Sequence[Call]) -> Tensor:
    """``[K, N, P_l]``: gradients per pulled vector and sample (``named_parameters`` order)."""
    rows = []
    with vector_slices(calls) as ks:
        for _ in ks:
            grads = rule.per_sample_grads(module, calls)
            # reshape, not flatten(1): a 0-dim parameter has per-sample gradients [N]
            rows.append(torch.cat([g.reshape(g.shape[0], -1) for g in grads.values()], 1))
    return torch.stack(rows)


def tied_per_sample_grads(
    layers: Sequence[Layer], names: Dict[str, Dict[str, str]]
) -> Dict[str, Tensor]:
    """Per-sample gradients of layers that share parameters, summed per parameter.

    ``grad_n(p) = sum_l grad_n^(l)(p)`` over the layers ``l`` that use ``p``: a tied
    parameter's gradient is the sum of every use's contribution.

    Args:
        layers: The layers (with non-batched ``grads`` on their calls).
        names: Layer name to ``{local name: canonical name}``
            (:attr:`curvature.layout.ParamSharing.names`).

    Returns:
        Canonical name to ``[N, *p.shape]`` (new tensors).

    """
    out: Dict[str, Tensor] = {}
    for name, module, rule, calls in layers:
        for local, g in rule.per_sample_grads(module, calls).items():
            key = names[name][local]
            out[key] = out[key] + g if key in out else g.clone()
    return out


def summed_per_sample_grads(
    layers: Sequence[Layer],
    sharing: ParamSharing,
    N: int,
    out: Optional[Dict[str, Tensor]] = None,
) -> Dict[str, Tensor]:
    """Per-sample gradients of every layer's parameters, keyed by canonical name.

    A parameter several layers use (tied) gets the sum of their contributions.

    Args:
        layers: The layers with non-batched ``grads`` on their calls.
        sharing: The layers' :class:`~curvature.layout.ParamSharing`.
        N: The batch size.
        out: Optional preallocated results, canonical name to ``[N, *p.shape]``; the
            first layer using a parameter writes into its buffer, the others add to it.

    Returns:
        Canonical name to ``[N, *p.shape]``, in layer order.

    """
    res: Dict[str, Tensor] = {}
    for name, module, rule, calls in layers:
        names = sharing.names[name]
        params = dict(module.named_parameters())
        local_out = {}
        for local in rule.param_names(module):
            buf = None if out is None or names[local] in res else out.get(names[local])
            if buf is not None:
                check_out_buffer(names[local], buf, params[local], N)
                local_out[local] = buf
        for local, grad in rule.per_sample_grads(module, calls, local_out or None).items():
            key = names[local]
            if key in res:  # a tied parameter: add this layer's contribution
                own = out is not None and res[key] is out.get(key)
                res[key] = res[key].add_(grad) if own else res[key] + grad
            elif local in local_out and grad is not local_out[local]:
                res[key] = local_out[local].copy_(grad)
            else:
                res[key] = grad
    return res


def empty_per_sample_grads(
    model: nn.Module, sharing: ParamSharing, out: Optional[Dict[str, Tensor]] = None
) -> Dict[str, Tensor]:
    """The per-sample gradients of an empty batch: ``[0, *p.shape]`` per covered parameter."""
    covered = {c for local in sharing.names.values() for c in local.values()}
    out = out or {}
    return {
        n: out.get(n, p.new_empty((0, *p.shape)))
        for n, p in model.named_parameters()
        if n in covered
    }


def tied_per_vector_grads(
    layers: Sequence[Layer], names: Dict[str, Dict[str, str]]
) -> Dict[str, Tensor]:
    """``[K, N, *p.shape]`` per parameter: per-vector gradients summed over the layers."""
    calls = [c for _, _, _, cs in layers for c in cs]
    rows: Dict[str, List[Tensor]] = {}
    with vector_slices(calls) as ks:
        for _ in ks:
            for key, g in tied_per_sample_grads(layers, names).items():
                rows.setdefault(key, []).append(g)
    return {key: torch.stack(r) for key, r in rows.items()}


def tied_fisher_diagonal(
    layers: Sequence[Layer],
    names: Dict[str, Dict[str, str]],
    base: Optional[Dict[str, Tensor]] = None,
) -> Dict[str, Tensor]:
    """``sum_{k,n} (sum_l grad_nk^(l))^2`` per parameter of layers that share parameters.

    The exact Fisher diagonal of tied parameters: per pulled vector ``k`` the per-sample
    gradients of every layer using a parameter are summed before squaring (the cross
    terms between the layers count). One vector at a time, so at most ``[N, *p.shape]``
    per parameter is held.

    Args:
        layers: The layers of one tie group (calls with batched ``grads [K, ...]``).
        names: Layer name to ``{local name: canonical name}``.
        base: Per-vector gradients ``[K, N, *p.shape]`` of layers folded earlier
            (:func:`tied_per_vector_grads`), added before squaring.

    Returns:
        Canonical name to a tensor of ``p.shape``.

    """
    base = base or {}
    out: Dict[str, Tensor] = {}
    calls = [c for _, _, _, cs in layers for c in cs]
    if not calls:
        return {key: g.pow(2).sum((0, 1)) for key, g in base.items()}
    with vector_slices(calls) as ks:
        for k in ks:
            grads = tied_per_sample_grads(layers, names)
            for key in set(grads) | set(base):
                g = grads.get(key)
                if key in base:
                    g = base[key][k] if g is None else g + base[key][k]
                sq = g.pow(2).sum(0)
                out[key] = out[key] + sq if key in out else sq
    return out


def exact_factors(rule: LayerRule, module: nn.Module, calls) -> Dict[str, tuple]:
    """A layer without a Kronecker rule as one exact block: ``A = [[1]]``, ``G = U^T U``.

    ``U`` ``[K N, P_l]`` stacks the per-vector gradients of all the layer's parameters;
    the result has the ``{suffix: (A_sum, G_sum, count)}`` form of
    :meth:`~curvature.layers.LayerRule.kfac_factors`.
    """
    U = per_vector_grads(rule, module, calls).flatten(0, 1)
    one = torch.ones(1, 1, 1, dtype=U.dtype, device=U.device)
    # one batched GEMM: G a tensor of its own (a view would be selected into a copy by
    # the statistics' flush instead of zeroed in place)
    return {"": (one, torch.bmm(U.T.unsqueeze(0), U.unsqueeze(0)), 1)}


def fisher_diagonal(
    rule: LayerRule,
    module: nn.Module,
    calls: Sequence[Call],
    squares: Optional[SquaredInputs] = None,
) -> Tuple[bool, Dict[str, Tensor]]:
    """The layer's Fisher diagonal ``sum_{k,n} grad_nk^2`` from its pulled gradients.

    ``squares``: a persistent buffer of the layer's squared inputs (kept by an optimizer
    from step to step), used where the rule takes it (``nn.Linear`` on 2-D inputs: two
    aten calls fewer per call); the same values.

    Returns:
        ``(kronecker, parts)``: for a Linear-family layer (``kronecker=True``) block suffix
        to ``[C, D_out, D]``, laid out like the rule's ``kfac_index``; otherwise
        ``{"": [P_l]}`` over the module's trainable parameters in ``named_parameters``
        order.

    """
    direct = direct_diagonal(rule, module, calls)
    if direct is not None:  # convolutions: per-sample weight gradients without unfolding
        return True, direct
    chunk = diagonal_chunk(rule, module, calls)
    if chunk is not None:  # patches of a chunk of samples at a time
        return True, chunked_diagonal(rule, module, calls, chunk)
    get = None if squares is None else getattr(rule, "plain_squares", None)
    operands = None if get is None else get(module, calls, squares)
    if operands is not None:  # [x^2 | 1] in the persistent buffer: one pow, one GEMM
        return True, {"": squares_diagonal(*operands)}
    ops = _plain(rule, module, calls)
    if ops is not None:  # one group, one position: one GEMM
        return True, {"": plain_diagonal(ops)}
    expanded = rule.expanded_blocks(module, calls)
    if expanded is None:
        return False, {"": per_vector_grads(rule, module, calls).pow(2).sum((0, 1))}
    return True, {s: expanded_diagonal(a, g) for s, (a, g) in expanded.items()}


def _plain(rule: LayerRule, module: nn.Module, calls) -> Optional[PlainOperands]:
    """The rule's plain operands with gradients and one position per sample, else ``None``."""
    get = getattr(rule, "plain_operands", None)
    ops = None if get is None else get(module, calls)
    return ops if ops is not None and ops.g is not None and ops.positions == 1 else None


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
    ops = _plain(rule, module, calls)
    if ops is not None:  # one group, one position: three GEMMs
        if name in bases:
            QA, QG = bases[name]
            if ops.a.shape[-1] == QA.shape[-1] and ops.g.shape[-1] == QG.shape[-1]:
                return {name: plain_rotated(ops, QA, QG)}
        else:
            return out
    permuted = rule.permuted_blocks(module, calls)
    if permuted is not None:  # a's columns in another order: QA's rows taken in it
        for suffix, (a, g, order) in permuted.items():
            full = block_name(name, suffix)
            if full in bases:
                QA, QG = bases[full]
                # (a basis of another size, e.g. the bias made trainable since: left as
                # it is, to fail as on the channel-major path, not to be cut to size)
                if QA.shape[-2] == order.numel():
                    QA = QA.index_select(1, order.to(QA.device))
                out[full] = rotated_second_moments(a, g, QA, QG)
        return out
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
    out[name] = rot.flatten(0, 1).pow(2).sum(0, keepdim=True)  # [1, D_out, D], its own
    return out


def rotated_second_moments(a: Tensor, g: Tensor, QA: Tensor, QG: Tensor) -> Tensor:
    """``sum_{k,n} (QG^T grad_nk QA)^2`` ``[C, D_out, D]`` from expanded ``a`` and ``g``."""
    plain = a.shape[-1] == QA.shape[-1] and g.shape[-1] == QG.shape[-1]  # (a stale basis: not)
    if plain and a.shape[1] == 1 and a.shape[2] == 1:  # one position, one group: plain GEMMs
        ar = a.reshape(-1, a.shape[-1]).to(QA.dtype) @ QA[0]
        gr = (g.reshape(-1, g.shape[-1]).to(QG.dtype) @ QG[0]).pow(2)
        gr = gr.view(g.shape[0], -1, gr.shape[-1]).sum(0) if g.shape[0] > 1 else gr
        # one batched GEMM: a tensor of its own, not an unsqueezed view (which the
        # statistics' flush selects into a copy instead of zeroing it in place)
        return torch.bmm(gr.mT.unsqueeze(0), ar.pow(2).unsqueeze(0))
    ar = torch.einsum("nsci,cij->nscj", a.to(QA.dtype), QA)
    gr = torch.einsum("knsco,cop->knscp", g.to(QG.dtype), QG)
    if a.shape[1] == 1:  # no sharing: sum_{k,n} (gr^2)(ar^2)^T, one GEMM, no [N, D_out, D]
        return torch.einsum("knco,nci->coi", gr[:, :, 0].pow(2), ar[:, 0].pow(2))
    out = None
    K, N = gr.shape[:2]
    chunk = max(1, 2**22 // max(1, K * a.shape[2] * QA.shape[-1] * QG.shape[-1]))
    for i in range(0, N, chunk):
        grad = torch.einsum("knscp,nscj->kncpj", gr[:, i : i + chunk], ar[i : i + chunk])
        part = grad.pow_(2).sum((0, 1))  # (squared in place: one chunk-sized temporary)
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


def _factor(x: Tensor, full: bool) -> Tensor:
    """``sum x x^T`` over the leading axes (``full``: ``[C, D, D]``, one batched GEMM) or
    its diagonal ``sum x^2`` (``[C, D]``) of ``x [..., C, D]``; tensors of their own (the
    statistics' flush zeroes them in place).
    """
    if full:
        return group_grams(x)
    return x.pow(2).sum(tuple(range(x.dim() - 2)))


def onesided_factors(
    rule: LayerRule,
    module: nn.Module,
    calls: Sequence[Call],
    approx: str,
    large: Dict[str, Tuple[bool, bool]],
) -> Optional[Dict[str, Tuple[Tensor, Tensor, int]]]:
    """``(A_sum, G_sum, count)`` of every block of a layer, the large sides diagonal.

    ``large`` maps the suffix of each block over ``max_factor_size`` to ``(full_A,
    full_G)``; a side not kept full is the diagonal of KFAC's factor sum (``[C, D]``
    or ``[C, D_out]``), computed without forming it: ``sum a^2`` / ``sum g^2`` with the
    sums and counts of :func:`~curvature.layers.base.expanded_kfac` (``"reduce"``: of
    the meaned inputs and summed gradients). Blocks not in ``large`` get KFAC's factors.
    ``None`` when the rule gives neither ``expanded_blocks`` nor
    ``kfac_diagonal_input`` (the caller keeps the per-sample diagonal).
    """
    expanded = rule.expanded_blocks(module, calls)
    if expanded is None:
        get = getattr(rule, "kfac_diagonal_input", None)
        if get is None or set(large) != {""} or large[""][0]:
            return None
        A_diag, G_sum, count = get(module, calls, approx)
        full_G = large[""][1]
        return {"": (A_diag, G_sum if full_G else G_sum.diagonal(dim1=-2, dim2=-1), count)}
    out = {}
    for suffix, (a, g) in expanded.items():
        if suffix not in large:
            out[suffix] = expanded_kfac(a, g, approx)
            continue
        full_A, full_G = large[suffix]
        if approx == "expand":  # a [N, S, C, D], g [K, N, S, C, D_out]
            out[suffix] = (_factor(a, full_A), _factor(g, full_G), a.shape[0] * a.shape[1])
        else:
            ar, gr = a.mean(1), g.sum(2)
            out[suffix] = (_factor(ar, full_A), _factor(gr, full_G), a.shape[0])
    return out


def large_blocks(module, rule, max_size: int) -> Dict[str, Tuple[int, int, int]]:
    """Suffix to ``(C, D_out, D)`` of the layer's blocks with a factor over ``max_size``.

    The shapes of the rule's ``kfac_index`` (:meth:`~curvature.layers.LayerRule.kfac_shapes`),
    without building the index.
    """
    shapes = rule.kfac_shapes(module)
    if shapes is None:
        return {}
    return {s: shape for s, shape in shapes.items() if max(shape[1], shape[2]) > max_size}


def large_statistics(
    rule, module, calls, name, layout, large, approx, with_g, w, diag_stats, sided=None
):
    """Add the diagonals of the layer's ``large`` blocks to ``diag_stats``, never forming them.

    ``diag_stats[(name, suffix)] = [d_sum, count]``: with gradients the Fisher diagonal
    ``sum w sum_{k,n} grad_nk^2`` ``[C, D_out, D]`` (``count`` None), forward-only the
    diagonal of ``A`` summed over ``count`` inputs ``[C, 1, D]``.

    ``large``: suffix to ``(C, D_out, D)`` (:func:`large_blocks`).
    ``sided`` (suffix to ``(full_A, full_G)``, with gradients): one-sided statistics
    instead (:func:`onesided_factors`), ``diag_stats[(name, suffix)] = [A_sum, w G_sum,
    count, (full_A, full_G)]``, where the rule gives them.

    Returns:
        The other blocks' statistics like :meth:`~curvature.layers.LayerRule.kfac_factors`,
        or ``None`` without a diagonal (forward-only, a layer without ``expanded_blocks``).

    """
    if with_g and sided is not None:
        res = onesided_factors(rule, module, calls, approx, sided)
        if res is not None:
            for suffix in sided:
                A_sum, G_sum, count = res.pop(suffix)
                st = diag_stats.setdefault((name, suffix), [0, 0, 0, sided[suffix]])
                st[0], st[1], st[2] = st[0] + A_sum, st[1] + w * G_sum, st[2] + count
            return res
    expanded = rule.expanded_blocks(module, calls)
    parts = {}
    if expanded is None:  # a single block (Embedding): its Fisher diagonal, reordered
        if not with_g:
            return None
        d = fisher_diagonal(rule, module, calls)[1][""]
        pos = layout.module_index(module, name)
        index = block_index(rule, module, layout.local_offsets(name), d.device)
        for suffix in large:
            parts[suffix] = (at_positions(d, pos, index[suffix]), None)
    res = {}
    for suffix, (a, g) in (expanded or {}).items():
        if suffix not in large:
            res[suffix] = expanded_kfac(a, g if with_g else None, approx)
        elif with_g:
            parts[suffix] = (expanded_diagonal(a, g), None)
        else:  # diag(A): over the N S inputs (expand) or the N means (reduce)
            ar, count = (a, a.shape[0] * a.shape[1]) if approx == "expand" else (a.mean(1), len(a))
            parts[suffix] = (ar.pow(2).flatten(0, -3).sum(0).unsqueeze(1), count)
    for suffix, (d_sum, count) in parts.items():
        st = diag_stats.setdefault((name, suffix), [0, None])
        if count is None:  # a Fisher diagonal: weighted like G
            st[0] = st[0] + w * d_sum
        else:  # forward-only: a mean over the inputs, like A
            st[0], st[1] = st[0] + d_sum, (st[1] or 0) + count
    return res
