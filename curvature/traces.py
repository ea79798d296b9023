"""Traces of the Hessian of a scalar: Hutchinson and Hutch++ estimators, exact trace.

All three functions work on an already computed scalar ``loss`` (no second forward):
the gradient ``g = grad loss`` is taken once with ``create_graph=True`` and Hessian-vector
products ``H v = grad <g, v>`` of ``K`` probe vectors come from *one* batched backward
(``torch.autograd.grad(..., is_grads_batched=True)``, a ``vmap`` over the backward): no
Python loop over probes. The products are those of
:class:`curvature.products.HessianVectorProducts`, the package's one implementation.
Symbols: ``P`` the number of parameter entries (all tensors of ``params`` flattened
row-major and concatenated), ``K`` the number of probes, ``V [K, P]`` the probes,
``H [P, P]`` the Hessian of ``loss`` w.r.t. ``params``.

The graph of ``loss`` is kept: ``loss.backward()`` (or a regularized
``(loss + c * trace).backward()`` with ``create_graph=True``) can follow.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .layout import ParamLayout
from .linalg import orthonormal_basis
from .products import HessianVectorProducts

__all__ = ["hessian_trace", "hutchinson_trace", "hutchinson_trace_blocks", "orthonormal_basis"]

Params = Union[Tensor, Sequence[Tensor]]

_METHODS = ("hutchinson", "hutch++")
_DISTRIBUTIONS = ("rademacher", "gaussian")


def hutchinson_trace(
    loss: Tensor,
    params: Params,
    num_samples: int,
    *,
    method: str = "hutchinson",
    distribution: str = "rademacher",
    create_graph: bool = False,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    r"""A stochastic estimate of the trace of the Hessian of ``loss`` w.r.t. ``params``.

    ``method="hutchinson"`` (Hutchinson 1989): with ``K = num_samples`` probes ``v_k``
    with ``E[v v^T] = I``,

    .. math:: \operatorname{tr}(H) \approx \frac{1}{K} \sum_{k=1}^{K} v_k^T H v_k,

    unbiased, with variance ``2 sum_{i != j} H_ij^2 / K`` for Rademacher probes (the
    diagonal is exact) and ``2 ||H||_F^2 / K`` for Gaussian probes. All ``K`` products
    ``H v_k`` come from one batched backward.

    ``method="hutch++"`` (Meyer, Musco, Musco, Woodruff 2021) splits the budget of
    ``m = num_samples`` matrix-vector products in thirds: ``k = m // 3`` probes ``S``
    give an orthonormal basis ``Q = orth(H S) [P, k]`` (one batched backward), then

    .. math:: \operatorname{tr}(H) \approx \operatorname{tr}(Q^T H Q)
        + \frac{1}{m - 2k} \sum_i g_i^T (I - Q Q^T) H (I - Q Q^T) g_i

    with ``m - 2k`` fresh probes ``g_i``; ``H Q`` and ``H (I - Q Q^T) G`` share a second
    batched backward. The low-rank part is exact on the top of the spectrum, so for a
    Hessian with a decaying spectrum the error falls like ``1/m`` instead of
    ``1/sqrt(m)``. With ``k >= P`` the estimate is exact.

    With ``create_graph=True`` the estimate is differentiable w.r.t. ``params`` (and
    anything ``loss`` depends on), e.g. for a trace regularizer
    ``(loss + c * hutchinson_trace(loss, params, K, create_graph=True)).backward()``. The
    gradient of the estimate is an unbiased estimate of ``grad tr(H)``. For Hutch++ the
    basis ``Q`` is treated as a constant (it is computed without a graph): the estimator
    is unbiased for every fixed orthonormal ``Q``, so its gradient with ``Q`` held fixed
    stays unbiased, and no QR backward (unstable for a rank-deficient ``H S``) is needed.

    Args:
        loss: A scalar tensor (``numel() == 1``) with a graph to ``params``.
        params: A tensor or a sequence of tensors with ``requires_grad=True``.
        num_samples: The number of Hessian-vector products ``m`` (at least 1; at least 3
            for ``"hutch++"``).
        method: ``"hutchinson"`` or ``"hutch++"``.
        distribution: Probe distribution, ``"rademacher"`` (entries +-1, lower variance)
            or ``"gaussian"`` (standard normal).
        create_graph: Make the estimate differentiable.
        generator: The random generator of the probes (``None``: the global one).

    Returns:
        A 0-dim tensor in the dtype of ``params[0]``.

    Raises:
        ValueError: For a non-scalar ``loss``, parameters without ``requires_grad``, an
            unknown ``method`` or ``distribution``, or a bad ``num_samples``.

    Note:
        The probes of all parameters are drawn as one flat ``[K, P]`` matrix, and the
        batched backward holds ``K`` copies of the gradient graph's activations: memory
        grows like ``K`` times that of one Hessian-vector product.

    Note:
        Hutch++ computes the QR decomposition with :func:`orthonormal_basis`.

    """
    ps = _as_params(params, "params")
    diag = _diagonal_terms(
        loss, ps, num_samples, method, distribution, create_graph, generator, "hutchinson_trace"
    )
    return diag.sum()


def hutchinson_trace_blocks(
    loss: Tensor,
    params_dict: Mapping[str, Params],
    num_samples: int,
    *,
    method: str = "hutchinson",
    distribution: str = "rademacher",
    create_graph: bool = False,
    generator: Optional[torch.Generator] = None,
) -> Dict[str, Tensor]:
    r"""Estimates of the traces of the diagonal blocks of the Hessian, one per block.

    A block ``b`` is the set of entries of one value of ``params_dict`` (a tensor, or a
    sequence of tensors such as a layer's weight and bias). With the block selector
    ``D_b`` (the diagonal 0/1 matrix of its entries), ``tr(H_bb) = tr(D_b H)``, and the
    same probes as :func:`hutchinson_trace` give, in one batched backward over all blocks,

    .. math:: \operatorname{tr}(H_{bb}) \approx \frac{1}{K} \sum_k (v_k)_b^T (H v_k)_b

    (Hutchinson), or for Hutch++ ``sum_j (q_j)_b^T (H q_j)_b`` plus the Hutchinson term of
    the projected probes ``(I - Q Q^T) g_i`` restricted to the block; ``Q`` comes from the
    whole Hessian. Each estimate is unbiased, and the block estimates sum to the
    :func:`hutchinson_trace` estimate of the same probes.

    Args:
        loss: A scalar tensor with a graph to the parameters.
        params_dict: Block name to a tensor or a sequence of tensors (``requires_grad``);
            a tensor may appear in one block only. ``dict(model.named_parameters())``
            gives one block per parameter tensor.
        num_samples: As in :func:`hutchinson_trace`.
        method: As in :func:`hutchinson_trace`.
        distribution: As in :func:`hutchinson_trace`.
        create_graph: As in :func:`hutchinson_trace`.
        generator: As in :func:`hutchinson_trace`.

    Returns:
        Block name to a 0-dim tensor, in the order of ``params_dict``.

    Raises:
        ValueError: As :func:`hutchinson_trace`, for an empty ``params_dict`` or a tensor
            that appears in two blocks.

    """
    if not isinstance(params_dict, Mapping) or not params_dict:
        raise ValueError(
            "hutchinson_trace_blocks: params_dict must be a non-empty mapping from a block "
            f"name to a tensor or a sequence of tensors; got {type(params_dict).__name__}."
        )
    names: List[str] = []
    ps: List[Tensor] = []
    owner: Dict[int, str] = {}
    for name, value in params_dict.items():
        block = _as_params(value, f"params_dict[{name!r}]")
        for p in block:
            if id(p) in owner:
                raise ValueError(
                    f"hutchinson_trace_blocks: a tensor of shape {tuple(p.shape)} appears in "
                    f"blocks {owner[id(p)]!r} and {name!r}; blocks must not overlap."
                )
            owner[id(p)] = name
            names.append(name)
            ps.append(p)
    diag = _diagonal_terms(
        loss,
        ps,
        num_samples,
        method,
        distribution,
        create_graph,
        generator,
        "hutchinson_trace_blocks",
    )
    traces: Dict[str, Tensor] = {}
    for name, part in zip(names, ParamLayout.of_tensors(ps).unflatten(diag)):
        traces[name] = traces[name] + part.sum() if name in traces else part.sum()
    return traces


def hessian_trace(
    loss: Tensor,
    params: Params,
    *,
    create_graph: bool = False,
    chunk_size: Optional[int] = None,
) -> Tensor:
    """The exact trace of the Hessian of ``loss`` w.r.t. ``params`` (small problems).

    ``tr(H) = sum_i e_i^T H e_i``: the rows ``H e_i`` of the Hessian come from batched
    backwards over the unit vectors, ``chunk_size`` rows at a time, and only their
    diagonal entries are kept. Costs ``P`` Hessian-vector products; the reference for
    :func:`hutchinson_trace`.

    Args:
        loss: A scalar tensor with a graph to ``params``.
        params: A tensor or a sequence of tensors with ``requires_grad=True``.
        create_graph: Make the trace differentiable (``d tr(H) / d theta``).
        chunk_size: Rows per batched backward (all ``P`` at once if ``None``); memory is
            ``chunk_size * P`` plus ``chunk_size`` copies of the gradient graph.

    Returns:
        A 0-dim tensor.

    Raises:
        ValueError: For a non-scalar ``loss``, parameters without ``requires_grad`` or a
            bad ``chunk_size``.

    """
    ps = _as_params(params, "params")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(
            f"hessian_trace(chunk_size={chunk_size!r}): chunk_size must be a positive "
            "integer or None (all rows at once)."
        )
    hvp = HessianVectorProducts(loss, ps, caller="hessian_trace")
    return hvp.diagonal(chunk_size=chunk_size, create_graph=create_graph).sum()


# -- internals -------------------------------------------------------------------------------
def _as_params(params: Params, what: str) -> List[Tensor]:
    """``params`` as a non-empty list of tensors with ``requires_grad=True``."""
    ps = [params] if isinstance(params, Tensor) else list(params) if params is not None else []
    if not ps:
        raise ValueError(f"{what} must be a tensor or a non-empty sequence of tensors.")
    for i, p in enumerate(ps):
        if not isinstance(p, Tensor) or not p.requires_grad:
            got = "a tensor without requires_grad" if isinstance(p, Tensor) else type(p).__name__
            raise ValueError(f"{what}[{i}] must be a tensor with requires_grad=True; got {got}.")
    return ps


def _check_options(
    num_samples: int, method: str, distribution: str, generator, caller: str
) -> None:
    if method not in _METHODS:
        raise ValueError(f"{caller}(method={method!r}): method must be one of {_METHODS}.")
    if distribution not in _DISTRIBUTIONS:
        raise ValueError(
            f"{caller}(distribution={distribution!r}): distribution must be one of "
            f"{_DISTRIBUTIONS}."
        )
    least = 3 if method == "hutch++" else 1
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < least:
        raise ValueError(
            f"{caller}(num_samples={num_samples!r}): num_samples must be an integer >= "
            f"{least} for method={method!r}"
            + (" (a third of the budget builds the low-rank basis)." if least == 3 else ".")
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"{caller}(generator={generator!r}): generator must be a torch.Generator or None."
        )


def _probes(
    K: int,
    P: int,
    distribution: str,
    dtype: torch.dtype,
    device: torch.device,
    generator: Optional[torch.Generator],
) -> Tensor:
    """``[K, P]`` probes with ``E[v v^T] = I`` (drawn on the generator's device)."""
    where = generator.device if generator is not None else device
    if distribution == "rademacher":
        V = torch.randint(0, 2, (K, P), generator=generator, device=where).to(dtype) * 2 - 1
    else:
        V = torch.randn(K, P, generator=generator, device=where, dtype=dtype)
    return V.to(device)


def _diagonal_terms(
    loss: Tensor,
    ps: List[Tensor],
    num_samples: int,
    method: str,
    distribution: str,
    create_graph: bool,
    generator: Optional[torch.Generator],
    caller: str,
) -> Tensor:
    """``d [P]`` with ``sum_{i in b} d_i`` an unbiased estimate of ``tr(H_bb)``.

    Hutchinson: ``d = mean_k v_k * (H v_k)``. Hutch++: ``d = sum_j q_j * (H q_j) +
    mean_i r_i * (H r_i)`` with ``r_i = (I - Q Q^T) g_i``.
    """
    _check_options(num_samples, method, distribution, generator, caller)
    hvp = HessianVectorProducts(loss, ps, caller=caller)
    P, dtype, device = hvp.numel, hvp.dtype, hvp.device
    if method == "hutchinson":
        V = _probes(num_samples, P, distribution, dtype, device, generator)
        return (V * hvp(V, create_graph=create_graph)).mean(0)
    Q, R = _hutchpp_directions(hvp, num_samples, distribution, generator)
    W = torch.cat([Q.T, R])
    HW = hvp(W, create_graph=create_graph)
    r = Q.shape[1]
    low_rank = (Q.T * HW[:r]).sum(0)
    if R.shape[0] == 0:
        return low_rank
    return low_rank + (R * HW[r:]).mean(0)


def _hutchpp_directions(
    hvp: HessianVectorProducts,
    num_samples: int,
    distribution: str,
    generator: Optional[torch.Generator],
) -> Tuple[Tensor, Tensor]:
    """Hutch++'s basis ``Q [P, r]`` (no graph) and projected probes ``R [m - 2k, P]``."""
    P, dtype, device = hvp.numel, hvp.dtype, hvp.device
    k = num_samples // 3
    S = _probes(k, P, distribution, dtype, device, generator)
    Q = orthonormal_basis(hvp(S, create_graph=False).detach().T)  # [P, min(k, P)]
    G = _probes(num_samples - 2 * k, P, distribution, dtype, device, generator)
    if Q.shape[1] >= P:  # the basis is complete: the low-rank part is the exact trace
        return Q, G[:0]
    return Q, G - (G @ Q) @ Q.T
