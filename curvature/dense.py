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

from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jacrev, vmap
from torch.func import hessian as _hessian

from .capture import isolated
from .layers.norm import batchnorm_train_error, uses_batch_statistics
from .layout import ParamLayout
from .losses import backprop_sources, check_loss
from .products import HessianVectorProducts, ggn_vp, hvp
from .warn import warn

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


def warn_random_forward(model: nn.Module, caller: str) -> None:
    """One warning when ``model`` has dropout in train mode: each of the curvature
    functions' forwards draws other masks (a dense GGN's Jacobian and loss Hessian come
    from different ones), so the result is that of random, even inconsistent, masks.
    """
    modules = model.named_modules()
    drop = [n for n, m in modules if isinstance(m, _DROPOUT) and m.training and m.p > 0]
    if drop:
        warn(
            f"{caller}: dropout in train mode ({drop[:3]}{' ...' if len(drop) > 3 else ''}): "
            "every forward draws new masks, so the curvature is that of random masks (the "
            "dense references mix those of several forwards). Call model.eval() first for "
            "the curvature of the model itself."
        )


_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


def empty_batch(X, y) -> bool:
    """Whether a batch has no samples (an input or target with zero entries)."""
    return any(isinstance(t, Tensor) and t.numel() == 0 for t in (X, y))


def trainable(model: nn.Module) -> Dict[str, Tensor]:
    """Trainable parameters (``requires_grad``) in ``named_parameters`` order, detached."""
    layout = ParamLayout.of(model)
    return {n: p.detach() for n, p in zip(layout.names, layout.params)}


def batch_weights(loss_func: nn.Module, bs: Sequence[Tuple[Tensor, Tensor]]) -> List[float]:
    """Weight of each batch's loss in the loss of the union of the batches."""
    if loss_func.reduction == "sum":
        return [1.0] * len(bs)
    total = sum(X.shape[0] for X, _ in bs)
    return [X.shape[0] / total for X, _ in bs]


def _forward(model: nn.Module, params: Dict[str, Tensor], X: Tensor) -> Tensor:
    with isolated():  # an optimizer attached to the model must not see these forwards
        return functional_call(model, params, (X,))


def _flat(layout: ParamLayout, tree: Dict[str, Tensor], lead: Tuple[int, ...]) -> Tensor:
    """``torch.func`` results ``name -> [*lead, *p.shape]`` as ``[*lead, P]``."""
    return layout.flatten(tree, what="the per-parameter results", batch_shape=lead)


def _accumulate(
    model: nn.Module, loss_func: nn.Module, data: Data, block: Callable[..., Tensor]
) -> Tensor:
    check_loss(loss_func)
    for name, module in model.named_modules():  # torch.func cannot update running stats
        if uses_batch_statistics(module):
            raise batchnorm_train_error(name, module)
    warn_random_forward(model, "the dense references (ggn, hessian, fisher, ...)")
    layout = ParamLayout.of(model)
    params = trainable(model)
    bs = batches(data)
    total: Optional[Tensor] = None
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        m = w * block(layout, params, X, y)
        total = m if total is None else total + m
    return total


def ggn(model: nn.Module, loss_func: nn.Module, data: Data) -> Tensor:
    """The generalized Gauss-Newton ``sum_n J_n^T H_n J_n`` of the loss, ``[P, P]``."""

    def block(layout, params, X, y):
        out = _forward(model, params, X)
        J = _flat(layout, jacrev(lambda p: _forward(model, p, X))(params), out.shape).reshape(
            out.numel(), -1
        )
        H = _hessian(lambda f: loss_func(f, y))(out.detach()).reshape(out.numel(), out.numel())
        return J.T @ H @ J

    return _accumulate(model, loss_func, data, block)


def _loss(model: nn.Module, loss_func: nn.Module, X: Tensor, y: Tensor) -> Tensor:
    """The batch loss with a graph to the trainable parameters (plain autograd).

    Attention runs the math kernel: the fused CPU kernels cannot be differentiated twice.
    """
    with torch.enable_grad(), _math_attention(), isolated():
        return loss_func(model(X), y)


def _math_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


def hessian(model: nn.Module, loss_func: nn.Module, data: Data) -> Tensor:
    """The Hessian of the loss w.r.t. the trainable parameters, ``[P, P]``.

    Reverse-over-reverse autograd (forward-mode AD misses ``Embedding.padding_idx`` and
    some LayerNorm cross terms in torch 2.13): the rows are Hessian-vector products with
    unit vectors (:meth:`curvature.products.HessianVectorProducts.matrix`),
    :data:`HESSIAN_CHUNK` of them per batched backward (``is_grads_batched``), one at a
    time where the batched backward is not supported.
    """

    def block(layout, params, X, y):
        loss = _loss(model, loss_func, X, y)
        products = HessianVectorProducts(loss, layout, caller="hessian")
        return products.matrix(chunk_size=HESSIAN_CHUNK).detach()

    return _accumulate(model, loss_func, data, block)


#: Rows of the Hessian computed per batched backward in :func:`hessian`.
HESSIAN_CHUNK = 64


def _per_sample_grads(model, loss_func, layout, params, X, y) -> Tensor:
    """``[N, P]``: gradients of ``l_n`` (the loss of sample n alone) with ``torch.func``."""

    def l_n(p, x, t):
        return loss_func(_forward(model, p, x.unsqueeze(0)), t.unsqueeze(0))

    # randomness="different": each sample draws its own dropout mask, as in one batched
    # forward (the caller warns about dropout in train mode)
    per_sample = vmap(grad(l_n), in_dims=(None, 0, 0), randomness="different")
    try:
        grads = per_sample(params, X, y)
    except RuntimeError:  # a forward that fails under vmap (a recurrent layer without h_0
        rows = [grad(l_n)(params, X[i], y[i]) for i in range(X.shape[0])]  # makes its own)
        grads = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    return _flat(layout, grads, (X.shape[0],))


def empirical_fisher(model: nn.Module, loss_func: nn.Module, data: Data) -> Tensor:
    """The empirical Fisher ``R sum_n grad l_n grad l_n^T`` (true labels), ``[P, P]``.

    Note:
        For MSE or BCE with mean reduction over ``C > 1`` outputs, curvlinops' empirical
        Fisher uses the loss summed over outputs scaled by ``1 / (N C)``; ours uses
        ``l_n`` (the mean over the sample's outputs), which is ``C`` times smaller.

    """
    bs = batches(data)

    def block(layout, params, X, y):
        w = getattr(loss_func, "weight", None)  # (a BCE weight per sample: [N, C])
        if isinstance(w, Tensor) and w.dim() >= 2 and w.shape[0] == X.shape[0] > 1:
            raise ValueError(
                f"empirical_fisher: {type(loss_func).__name__}(weight=...) of shape "
                f"{tuple(w.shape)} weights each sample, which this dense reference cannot "
                "split per sample (it would broadcast every sample's loss over the batch). "
                "Use curvature.per_sample_grads or diag_ggn(fisher='empirical'), which "
                "split it, or weight=None with the weights in your own loss."
            )
        g = _per_sample_grads(model, loss_func, layout, params, X, y)
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

    def block(layout, params, X, y):
        out = _forward(model, params, X)
        J = _flat(layout, jacrev(lambda p: _forward(model, p, X))(params), out.shape)
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

    Reverse mode only (:func:`curvature.products.ggn_vp`): ``J v`` is the gradient w.r.t.
    ``u`` of ``<J^T u, v>``.
    """
    check_loss(loss_func)
    layout = ParamLayout.of(model)
    flat_v = layout.flatten(v, what="v")
    bs = batches(data)
    total = None
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        with torch.enable_grad(), _math_attention(), isolated():
            out = model(X)
            flat = w * ggn_vp(out, lambda f, t=y: loss_func(f, t), layout, flat_v)
        total = flat if total is None else total + flat
    return layout.unflatten(total)


def hessian_vector_product(
    model: nn.Module, loss_func: nn.Module, data: Data, v: Sequence[Tensor]
) -> List[Tensor]:
    """``H v`` (Hessian of the loss) with ``v`` shaped like the trainable parameters.

    Reverse-over-reverse (:func:`curvature.products.hvp`): the gradient of ``<grad L, v>``.
    """
    check_loss(loss_func)
    layout = ParamLayout.of(model)
    flat_v = layout.flatten(v, what="v")
    bs = batches(data)
    total = None
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        loss = _loss(model, loss_func, X, y)
        flat = w * hvp(loss, layout, flat_v).detach()
        total = flat if total is None else total + flat
    return layout.unflatten(total)
