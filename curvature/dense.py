"""Exact curvature matrices of small models, and their matrix-vector products.

These are the references every approximation is tested against. They are computed with
``torch.func`` (Jacobians, Hessians, per-sample gradients) independently of the capture
engine, over the trainable parameters in ``model.parameters()`` order, each flattened
row-major: matrices are ``[P, P]``.

``data`` is an ``(X, y)`` pair or an iterable of such batches; the curvature of several
batches is that of the loss over their union (for ``reduction="mean"`` each batch is
weighted by its share of the samples).
"""

from __future__ import annotations

import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.func import hessian as _hessian

from .losses import backprop_sources, check_loss

Data = Union[Tuple[Tensor, Tensor], Iterable[Tuple[Tensor, Tensor]]]


def batches(data: Data) -> List[Tuple[Tensor, Tensor]]:
    """The list of ``(X, y)`` batches in ``data``."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Tensor):
        return [(data[0], data[1])]
    out = list(data)
    for i, b in enumerate(out):
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise ValueError(f"data must be (X, y) or an iterable of (X, y); batch {i} is not.")
    return [(b[0], b[1]) for b in out]


def trainable(model: nn.Module) -> Dict[str, Tensor]:
    """Trainable parameters (``requires_grad``) in ``named_parameters`` order, detached."""
    return {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}


def batch_weights(loss_func: nn.Module, bs: Sequence[Tuple[Tensor, Tensor]]) -> List[float]:
    """Weight of each batch's loss in the loss of the union of the batches."""
    if loss_func.reduction == "sum":
        return [1.0] * len(bs)
    total = sum(X.shape[0] for X, _ in bs)
    return [X.shape[0] / total for X, _ in bs]


def _forward(model: nn.Module, params: Dict[str, Tensor], X: Tensor) -> Tensor:
    return functional_call(model, params, (X,))


def _flat(tree: Dict[str, Tensor], lead: int) -> Tensor:
    """Concatenate ``[*lead_shape, *p.shape]`` leaves into ``[*lead_shape, P]``."""
    leaves = list(tree.values())
    shape = leaves[0].shape[:lead]
    return torch.cat([t.reshape(*shape, -1) for t in leaves], dim=-1)


def _unflat(vec: Tensor, params: Dict[str, Tensor]) -> Dict[str, Tensor]:
    out, i = {}, 0
    for n, p in params.items():
        out[n] = vec[i : i + p.numel()].view_as(p)
        i += p.numel()
    return out


def _flat_or_zeros(
    grads: Sequence[Optional[Tensor]], params: Sequence[Tensor], lead: Tuple[int, ...] = ()
) -> Tensor:
    """``autograd.grad(..., allow_unused=True)`` results as ``[*lead, P]`` (zeros for None).

    ``lead`` is the batch shape of batched gradients (``is_grads_batched``).
    """
    return torch.cat(
        [
            (p.new_zeros(*lead, *p.shape) if g is None else g).reshape(*lead, -1)
            for g, p in zip(grads, params)
        ],
        dim=-1,
    )


def _accumulate(
    model: nn.Module, loss_func: nn.Module, data: Data, block: Callable[..., Tensor]
) -> Tensor:
    check_loss(loss_func)
    params = trainable(model)
    bs = batches(data)
    total: Optional[Tensor] = None
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        m = w * block(params, X, y)
        total = m if total is None else total + m
    return total


def ggn(model: nn.Module, loss_func: nn.Module, data: Data) -> Tensor:
    """The generalized Gauss-Newton ``sum_n J_n^T H_n J_n`` of the loss, ``[P, P]``."""

    def block(params, X, y):
        out = _forward(model, params, X)
        J = _flat(jacrev(lambda p: _forward(model, p, X))(params), out.dim()).reshape(
            out.numel(), -1
        )
        H = _hessian(lambda f: loss_func(f, y))(out.detach()).reshape(out.numel(), out.numel())
        return J.T @ H @ J

    return _accumulate(model, loss_func, data, block)


def _loss_and_params(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor):
    """The batch loss with a graph to the trainable parameters (plain autograd).

    Attention runs the math kernel: the fused CPU kernels cannot be differentiated twice.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.enable_grad(), _math_attention():
        return loss_func(model(X), y), params


def _math_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def hessian(model: nn.Module, loss_func: nn.Module, data: Data) -> Tensor:
    """The Hessian of the loss w.r.t. the trainable parameters, ``[P, P]``.

    Reverse-over-reverse autograd (forward-mode AD misses ``Embedding.padding_idx`` and
    some LayerNorm cross terms in torch 2.13): the rows are Hessian-vector products with
    unit vectors, :data:`HESSIAN_CHUNK` of them per batched backward
    (``is_grads_batched``), one at a time where the batched backward is not supported.
    """

    def block(params, X, y):
        loss, ps = _loss_and_params(model, loss_func, X, y)
        grads = torch.autograd.grad(loss, ps, create_graph=True)
        flat = torch.cat([g.reshape(-1) for g in grads])
        return _hessian_rows(flat, ps).detach()

    return _accumulate(model, loss_func, data, block)


#: Rows of the Hessian computed per batched backward in :func:`hessian`.
HESSIAN_CHUNK = 64


def _hessian_rows(flat: Tensor, ps: Sequence[Tensor]) -> Tensor:
    """``[P, P]`` rows ``d flat_i / d ps`` of a flat gradient with a graph."""
    P = flat.numel()
    rows: List[Tensor] = []
    i = 0
    batched = HESSIAN_CHUNK > 1
    while i < P:
        if batched:
            k = min(HESSIAN_CHUNK, P - i)
            units = torch.zeros(k, P, dtype=flat.dtype, device=flat.device)
            units[:, i : i + k].fill_diagonal_(1)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # vmap's per-op fallback notices
                    out = torch.autograd.grad(
                        flat,
                        ps,
                        units,
                        retain_graph=True,
                        allow_unused=True,
                        is_grads_batched=True,
                    )
            except RuntimeError:  # an op without a batching rule: one row at a time
                batched = False
                continue
            rows.append(_flat_or_zeros(out, ps, (k,)))
            i += k
        else:
            row = torch.autograd.grad(flat[i], ps, retain_graph=True, allow_unused=True)
            rows.append(_flat_or_zeros(row, ps).unsqueeze(0))
            i += 1
    return torch.cat(rows)


def _per_sample_grads(model, loss_func, params, X, y) -> Tensor:
    """``[N, P]``: gradients of ``l_n`` (the loss of sample n alone) with ``torch.func``."""

    def l_n(p, x, t):
        return loss_func(_forward(model, p, x.unsqueeze(0)), t.unsqueeze(0))

    return _flat(vmap(grad(l_n), in_dims=(None, 0, 0))(params, X, y), 1)


def empirical_fisher(model: nn.Module, loss_func: nn.Module, data: Data) -> Tensor:
    """The empirical Fisher ``R sum_n grad l_n grad l_n^T`` (true labels), ``[P, P]``.

    Note:
        For MSE or BCE with mean reduction over ``C > 1`` outputs, curvlinops' empirical
        Fisher uses the loss summed over outputs scaled by ``1 / (N C)``; ours uses
        ``l_n`` (the mean over the sample's outputs), which is ``C`` times smaller.

    """
    bs = batches(data)

    def block(params, X, y):
        g = _per_sample_grads(model, loss_func, params, X, y)
        R = 1.0 / X.shape[0] if loss_func.reduction == "mean" else 1.0
        return R * g.T @ g

    return _accumulate(model, loss_func, bs, block)


def fisher(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    *,
    mc_samples: int = 1,
    seed: int = 0,
) -> Tensor:
    """Monte-Carlo Fisher with ``mc_samples`` labels per sample drawn from the model.

    ``sum_n (1/M) sum_m J_n^T grad_f l(f_n, yhat_nm) grad_f l(f_n, yhat_nm)^T J_n`` (with the
    reduction's scale), whose expectation is the GGN. Labels are drawn with a generator
    seeded by ``seed`` in the same order as :func:`curvature.losses.backprop_sources`.
    """
    generator = torch.Generator().manual_seed(seed)

    def block(params, X, y):
        out = _forward(model, params, X)
        J = _flat(jacrev(lambda p: _forward(model, p, X))(params), out.dim())
        V = backprop_sources(
            loss_func, out, y, "mc", mc_samples=mc_samples, generator=generator
        )  # [M, *out]
        N = out.shape[0]
        Jn = J.reshape(N, -1, J.shape[-1])  # [N, out per sample, P]
        U = torch.einsum("mno,nop->mnp", V.reshape(V.shape[0], N, -1), Jn).reshape(-1, J.shape[-1])
        return U.T @ U

    return _accumulate(model, loss_func, data, block)


def ggn_vector_product(
    model: nn.Module, loss_func: nn.Module, data: Data, v: Sequence[Tensor]
) -> List[Tensor]:
    """``GGN v = J^T H J v`` with ``v`` a list of tensors shaped like the trainable parameters.

    Reverse mode only: ``J v`` is the gradient w.r.t. ``u`` of ``<J^T u, v>``.
    """
    check_loss(loss_func)
    params = trainable(model)
    vs = list(_as_tree(v, params).values())
    bs = batches(data)
    total = None
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        ps = [p for p in model.parameters() if p.requires_grad]
        with torch.enable_grad(), _math_attention():
            out = model(X)
            u = torch.zeros_like(out, requires_grad=True)
            JTu = torch.autograd.grad(out, ps, u, create_graph=True, allow_unused=True)
            inner = sum((a * b).sum() for a, b in zip(JTu, vs) if a is not None)
            (Jv,) = torch.autograd.grad(inner, u)
            f = out.detach().requires_grad_(True)
            (gf,) = torch.autograd.grad(loss_func(f, y), f, create_graph=True)
            (HJv,) = torch.autograd.grad(gf, f, Jv)
            res = torch.autograd.grad(out, ps, HJv, allow_unused=True)
        flat = w * _flat_or_zeros(res, ps)
        total = flat if total is None else total + flat
    return list(_unflat(total, params).values())


def hessian_vector_product(
    model: nn.Module, loss_func: nn.Module, data: Data, v: Sequence[Tensor]
) -> List[Tensor]:
    """``H v`` (Hessian of the loss) with ``v`` shaped like the trainable parameters.

    Reverse-over-reverse: the gradient of ``<grad L, v>``.
    """
    check_loss(loss_func)
    params = trainable(model)
    vs = list(_as_tree(v, params).values())
    bs = batches(data)
    total = None
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        loss, ps = _loss_and_params(model, loss_func, X, y)
        with torch.enable_grad():
            grads = torch.autograd.grad(loss, ps, create_graph=True)
            inner = sum((g * b).sum() for g, b in zip(grads, vs))
            Hv = torch.autograd.grad(inner, ps, allow_unused=True)
        flat = w * _flat_or_zeros(Hv, ps).detach()
        total = flat if total is None else total + flat
    return list(_unflat(total, params).values())


def _as_tree(v: Sequence[Tensor], params: Dict[str, Tensor]) -> Dict[str, Tensor]:
    v = list(v)
    if len(v) != len(params) or any(a.shape != p.shape for a, p in zip(v, params.values())):
        shapes = [tuple(p.shape) for p in params.values()]
        raise ValueError(
            f"v must be a list of {len(params)} tensors shaped like the trainable "
            f"parameters {shapes}; got {[tuple(a.shape) for a in v]}."
        )
    return dict(zip(params, v))
