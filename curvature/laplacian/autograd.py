r"""The Laplacian by nested reverse mode: exact (unit directions) or Hutchinson (probes).

Both differentiate the sum over samples, so they need a model that treats the samples
of a batch independently (no BatchNorm in train mode). They run the model normally, so
a capture engine sees ordinary layer calls. Methods ``"autograd"`` and ``"hutchinson"``
of :func:`curvature.laplacian.laplacian`, and the way out for models the forward
Laplacian does not support.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from .forward import ForwardLaplacian, squeeze_scalar

__all__ = ["hutchinson_probes", "nested_autograd"]


def nested_autograd(
    model: nn.Module, x: Tensor, probes: Optional[Tensor], c: Optional[Tensor]
) -> ForwardLaplacian:
    r"""Value, Jacobian and weighted Laplacian of ``model`` at ``x`` by nested reverse mode.

    ``g = grad_x f`` with ``create_graph``, then one batched backward of ``g``
    (``is_grads_batched``) over ``O * B`` seeds: the unit directions ``e_i`` with
    ``c_i != 0`` (``probes=None``, exact: ``sum_i c_i e_i^T H_n e_i``), or the probes
    ``v_k`` (Hutchinson: ``mean_k (H_n v_{kn})^T (c * v_{kn})``).

    Args:
        model: Maps ``[N, d]`` to ``[N, *out]``, row by row.
        x: Inputs ``[N, d]``.
        probes: ``None`` (exact), or the probes ``[K, N, d]``.
        c: The coefficients ``[d]``, ``None`` for all ones.

    Returns:
        Value ``[N, *out]``, Jacobian ``[N, *out, d]``, Laplacian ``[N, *out]`` (``*out``
        dropped for a scalar output), all with graphs.

    Raises:
        ValueError: If the model does not return a tensor with ``N`` rows.

    """
    N, d = x.shape
    with torch.enable_grad():
        xg = x if x.requires_grad else x.detach().requires_grad_(True)
        out = model(xg)
        if not isinstance(out, Tensor) or out.ndim == 0 or out.shape[0] != N:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(
                f"laplacian: the model must return a tensor [N, ...] with N = {N} rows; got {got}."
            )
        flat = out.reshape(N, -1)
        n_out = flat.shape[1]
        if n_out == 1:
            (g,) = torch.autograd.grad(flat.sum(), xg, create_graph=True, allow_unused=True)
            g = None if g is None else g.unsqueeze(0)
        else:
            seeds = torch.eye(n_out, dtype=flat.dtype, device=flat.device)
            seeds = seeds.unsqueeze(1).expand(n_out, N, n_out)
            (g,) = torch.autograd.grad(
                flat, xg, seeds, create_graph=True, allow_unused=True, is_grads_batched=True
            )
        if g is None:  # f does not depend on x
            g = flat.new_zeros(n_out, N, d)
        if probes is None:  # V[j, n] = e_{i_j} for the directions i_j with c_i != 0
            dirs = torch.arange(d, device=x.device) if c is None else c.nonzero().flatten()
            V = torch.eye(d, dtype=g.dtype, device=g.device)[dirs].unsqueeze(1).expand(-1, N, d)
        else:
            V = probes.to(g.dtype)
        B = V.shape[0]
        HV = None
        if g.requires_grad and B > 0:  # else f is affine in x
            if n_out == 1:
                seeds = V.unsqueeze(1)  # [B, 1, N, d]
            else:  # seeds[(o, b), o'] = delta_{o o'} V[b]
                eye = torch.eye(n_out, dtype=g.dtype, device=g.device)
                seeds = (eye[:, None, :, None, None] * V[None, :, None]).reshape(
                    n_out * B, n_out, N, d
                )
            (HV,) = torch.autograd.grad(
                g, xg, seeds, create_graph=True, allow_unused=True, is_grads_batched=True
            )
    value = squeeze_scalar(flat, out.shape)
    jacobian = squeeze_scalar(g.permute(1, 0, 2), out.shape, trailing=1)  # [N, *out, d]
    if HV is None:
        return ForwardLaplacian(
            value, jacobian, squeeze_scalar(flat.new_zeros(N, n_out), out.shape)
        )
    HV = HV.reshape(n_out, B, N, d)
    if probes is None:  # e_{i_j}^T H e_{i_j}, weighted by c_{i_j}, summed over j
        quad = (HV * V).sum(-1)  # [n_out, B, N]
        lap = quad.sum(1) if c is None else (quad * c[dirs].view(-1, 1)).sum(1)
    else:  # mean_k (H v_k)^T (c * v_k)
        lap = (HV * (V if c is None else V * c)).sum(-1).mean(1)
    return ForwardLaplacian(value, jacobian, squeeze_scalar(lap.T, out.shape))


def hutchinson_probes(
    num_samples: int, x: Tensor, generator: Optional[torch.Generator] = None
) -> Tensor:
    """``num_samples`` Rademacher probes per sample: ``[K, N, d]`` of +-1 in ``x``'s dtype.

    Drawn on the generator's device (for reproducibility across devices), then moved to
    ``x``'s device.
    """
    N, d = x.shape
    where = generator.device if generator is not None else x.device
    probes = torch.randint(0, 2, (num_samples, N, d), generator=generator, device=where)
    return (probes.to(x.dtype) * 2 - 1).to(x.device)
