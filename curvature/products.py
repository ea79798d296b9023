r"""Hessian- and GGN-vector products from an existing graph: the one implementation.

Symbols: ``theta`` the parameters (a :class:`~curvature.layout.ParamLayout`, flat length
``P``), ``L`` a scalar with a graph to them, ``g = grad_theta L [P]``,
``H = d g / d theta [P, P]`` (symmetric), ``K`` the number of vectors, ``V [K, P]``.

Hessian-vector products (reverse over reverse, Pearlmutter 1994): with ``g`` computed once
with ``create_graph=True``,

.. math:: H v = \nabla_\theta \langle g, v \rangle = J_g(\theta)^T v,

one backward through the graph of ``g`` with ``v`` as its output gradient. ``K`` products
share one batched backward (``torch.autograd.grad(..., is_grads_batched=True)``, a
``vmap`` over the backward); where an operation has no batching rule the products are
taken one at a time. Rows and columns of a tensor whose gradient has no graph (``L``
linear in it) or that ``L`` does not use are zero.

Generalized Gauss-Newton products for ``L = l(f)`` with the model output ``f(theta)``
(``J = d f / d theta [F, P]``, ``H_f = d^2 l / d f^2 [F, F]``):

.. math:: G v = J^T H_f J v,

with ``J v`` by the double-backward trick (``J v = grad_u <J^T u, v>``: ``J^T u`` is
linear in a dummy ``u [F]``), ``H_f (J v)`` a Hessian-vector product of ``l`` at
``f`` (detached from ``theta``), and ``J^T (.)`` a plain backward. Reverse mode only.
"""

from __future__ import annotations

import warnings
from typing import Callable, List, Optional, Sequence, Union

import torch
from torch import Tensor

from .layout import ParamLayout

__all__ = ["HessianVectorProducts", "ggn_vp", "hvp"]

Params = Union[ParamLayout, Sequence[Tensor]]

# vmap's per-operation fallback (no batching rule) warns once per op; it still works
_VMAP_FALLBACK = "There is a performance drop because we have not yet implemented"


def _layout(params: Params) -> ParamLayout:
    return params if isinstance(params, ParamLayout) else ParamLayout.of_tensors(params)


def _check_chunk(chunk_size: Optional[int]) -> None:
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"HessianVectorProducts(chunk_size={chunk_size!r}): chunk_size must be a "
            "positive integer or None (all rows at once)."
        )


class HessianVectorProducts:
    """``V [K, P] -> V H [K, P]`` (rows ``(H v_k)^T``) from one gradient graph.

    The gradient ``g = grad L`` is taken once (``create_graph=True``) at construction;
    every call is one batched backward of ``<g, v_k>`` per chunk of rows of ``V`` and
    keeps the graph, so calls can be repeated (Hutch++ makes two).

    Args:
        loss: A scalar tensor (``numel() == 1``) with a graph to ``params``.
        params: The parameters: a layout or a sequence of tensors (flat order).
        caller: The function named in error messages.

    Raises:
        ValueError: For a non-scalar ``loss`` or one without a graph.

    Attributes:
        layout: The parameters' layout (``P = layout.numel``).
        numel: ``P``.
        dtype: The dtype of the first parameter (that of unit vectors and probes).
        device: Its device.

    """

    def __init__(self, loss: Tensor, params: Params, *, caller: str = "hvp"):
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"{caller}: loss must be a scalar tensor (numel() == 1); got {shape}. "
                "Reduce it first, e.g. loss.sum() or loss.mean()."
            )
        if not loss.requires_grad:
            raise ValueError(
                f"{caller}: loss does not require grad (no graph to the parameters); "
                "compute it with gradients enabled from tensors with requires_grad=True."
            )
        self.layout = _layout(params)
        if not len(self.layout):
            raise ValueError(f"{caller}: params must hold at least one tensor.")
        ps = self.layout.params
        self.numel = self.layout.numel
        self.dtype = ps[0].dtype
        self.device = ps[0].device
        with torch.enable_grad():
            grads = torch.autograd.grad(loss, ps, create_graph=True, allow_unused=True)
        self._live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        self._grads = [grads[i] for i in self._live]
        self._batched = True  # False once a batched backward failed

    def __call__(
        self, V: Tensor, *, create_graph: bool = False, chunk_size: Optional[int] = None
    ) -> Tensor:
        """The products ``H v_k`` of the rows of ``V``.

        Args:
            V: ``[K, P]`` vectors (any floating dtype; cast to the parameters' dtype).
            create_graph: Make the products differentiable (w.r.t. ``theta`` and ``V``).
            chunk_size: Rows per batched backward (all ``K`` at once if ``None``; 1 is
                one plain backward per row).

        Returns:
            ``[K, P]`` in ``V``'s dtype, row ``k`` being ``(H v_k)^T``.

        Raises:
            ValueError: For ``V`` not ``[K, P]`` or a bad ``chunk_size``.

        """
        if not isinstance(V, Tensor) or V.dim() != 2 or V.shape[1] != self.numel:
            got = tuple(V.shape) if isinstance(V, Tensor) else type(V).__name__
            raise ValueError(
                f"HessianVectorProducts: V must be [K, P] with P = {self.numel}; got {got}."
            )
        _check_chunk(chunk_size)
        K = V.shape[0]
        step = K if chunk_size is None else chunk_size
        if K == 0:
            return V.new_zeros(0, self.numel)
        parts = [
            self._rows(V[i : i + step], create_graph, batched=step > 1) for i in range(0, K, step)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def matrix(self, *, chunk_size: Optional[int] = None, create_graph: bool = False) -> Tensor:
        """The Hessian ``H [P, P]``: its rows ``H e_i``, ``chunk_size`` unit vectors a time."""
        return torch.cat(list(self._unit_rows(chunk_size, create_graph, diagonal=False)))

    def diagonal(self, *, chunk_size: Optional[int] = None, create_graph: bool = False) -> Tensor:
        """The diagonal ``H_ii [P]`` from the rows ``H e_i`` (only ``chunk_size`` held)."""
        return torch.cat(list(self._unit_rows(chunk_size, create_graph, diagonal=True)))

    # -- internals ---------------------------------------------------------------------------
    def _unit_rows(self, chunk_size: Optional[int], create_graph: bool, diagonal: bool):
        _check_chunk(chunk_size)
        P = self.numel
        step = P if chunk_size is None else chunk_size
        for start in range(0, P, step):
            k = min(step, P - start)
            units = torch.zeros(k, P, dtype=self.dtype, device=self.device)
            units[:, start : start + k].fill_diagonal_(1)
            rows = self._rows(units, create_graph, batched=step > 1)
            if diagonal:
                local = torch.arange(k, device=self.device)
                yield rows[local, start + local]
            else:
                yield rows

    def _rows(self, V: Tensor, create_graph: bool, batched: bool) -> Tensor:
        """``[k, P]`` products of one chunk: one batched backward, else one per row."""
        k = V.shape[0]
        if not self._live:
            return V.new_zeros(k, self.numel)
        if batched and self._batched:
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=_VMAP_FALLBACK)
                    return self._backward(V, create_graph, batched=True)
            except RuntimeError:  # an op without a batching rule: one row at a time
                self._batched = False
        return torch.cat([self._backward(v.unsqueeze(0), create_graph, False) for v in V])

    def _backward(self, V: Tensor, create_graph: bool, batched: bool) -> Tensor:
        k = V.shape[0]
        ps, lay = self.layout.params, self.layout
        chunks = lay.unflatten(V)  # [k, *shape] views
        outs = [chunks[i].to(ps[i].dtype) for i in self._live]
        if not batched:
            outs = [o[0] for o in outs]
        with torch.enable_grad():
            rows = torch.autograd.grad(
                self._grads,
                ps,
                grad_outputs=outs,
                retain_graph=True,
                create_graph=create_graph,
                allow_unused=True,
                is_grads_batched=batched,
            )
        if not batched:
            rows = tuple(None if r is None else r.unsqueeze(0) for r in rows)
        return lay.flatten(rows, what="H v", batch_shape=(k,), none_as_zero=True).to(V.dtype)


def hvp(
    loss: Tensor,
    params: Params,
    v: Tensor,
    *,
    create_graph: bool = False,
    is_grads_batched: bool = False,
) -> Tensor:
    """The Hessian of ``loss`` w.r.t. ``params`` times ``v``: ``H v = grad <grad L, v>``.

    Args:
        loss: A scalar with a graph to ``params`` (the graph is kept).
        params: A layout or a sequence of tensors (flat order, ``P`` entries).
        v: ``[P]``, or ``[K, P]`` with ``is_grads_batched``.
        create_graph: Make the product differentiable.
        is_grads_batched: ``v`` holds ``K`` vectors, multiplied in one batched backward.

    Returns:
        ``H v`` shaped like ``v`` (``[K, P]``: row ``k`` is ``(H v_k)^T``).

    """
    products = HessianVectorProducts(loss, params)
    if is_grads_batched:
        return products(v, create_graph=create_graph)
    return products(v.unsqueeze(0), create_graph=create_graph, chunk_size=1)[0]


def ggn_vp(
    output: Tensor,
    loss_of_output: Callable[[Tensor], Tensor],
    params: Params,
    v: Tensor,
) -> Tensor:
    """The generalized Gauss-Newton of ``L = l(f)`` times ``v``: ``J^T H_f J v``.

    Args:
        output: The model output ``f`` with a graph to ``params`` (kept).
        loss_of_output: ``l``: maps a tensor shaped like ``output`` to a scalar, e.g.
            ``lambda f: loss_func(f, y)``.
        params: A layout or a sequence of tensors (flat order, ``P`` entries).
        v: ``[P]``.

    Returns:
        ``[P]`` (detached), zero for parameters that ``output`` does not depend on.

    """
    lay = _layout(params)
    ps = list(lay.params)
    vs = lay.unflatten(v)
    with torch.enable_grad():
        u = torch.zeros_like(output, requires_grad=True)
        JTu = torch.autograd.grad(output, ps, u, create_graph=True, allow_unused=True)
        inner = sum((a * b).sum() for a, b in zip(JTu, vs) if a is not None)
        (Jv,) = torch.autograd.grad(inner, u)
        f = output.detach().requires_grad_(True)
        (gf,) = torch.autograd.grad(loss_of_output(f), f, create_graph=True)
        (HJv,) = torch.autograd.grad(gf, f, Jv)
        res: List[Optional[Tensor]] = list(
            torch.autograd.grad(output, ps, HJv, retain_graph=True, allow_unused=True)
        )
    return lay.flatten(res, what="G v", none_as_zero=True)
