"""Supported loss modules and their per-sample decomposition.

The curvature of a batch is that of exactly the scalar the loss module returns. With
``l_n`` the loss module applied to sample ``n`` alone (same reduction), the batch loss
is ``L = R * sum_n l_n`` with ``R = 1/N`` for ``reduction="mean"`` and ``R = 1`` for
``"sum"``.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .options import FisherType

SUPPORTED_LOSSES = (nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss)
_NAMES = "nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss"


def check_loss(loss_func: nn.Module) -> None:
    """Raise a ``ValueError`` unless ``loss_func`` is a supported loss module.

    Supported: ``nn.CrossEntropyLoss`` (also over trailing axes ``[N, C, *]``, without
    class ``weight``), ``nn.MSELoss`` and ``nn.BCEWithLogitsLoss``, each with reduction
    ``"mean"`` or ``"sum"``.
    """
    if not isinstance(loss_func, SUPPORTED_LOSSES):
        raise ValueError(
            f"loss_func={loss_func!r} is not supported; use one of {_NAMES} "
            "(reduction 'mean' or 'sum')."
        )
    if loss_func.reduction not in ("mean", "sum"):
        raise ValueError(
            f"{type(loss_func).__name__}(reduction={loss_func.reduction!r}) is not supported; "
            "use reduction='mean' or 'sum' (the curvature is that of the returned scalar)."
        )
    if isinstance(loss_func, nn.CrossEntropyLoss) and loss_func.weight is not None:
        raise ValueError(
            "nn.CrossEntropyLoss(weight=...) with class weights normalizes the mean by the "
            "batch's total weight, which does not split into per-sample losses; use "
            "weight=None (or reweight the per-sample losses yourself)."
        )


def _ignored_mask(
    loss_func: nn.Module, output: Tensor, target: Tensor, check: bool = True
) -> Optional[Tensor]:
    """For CrossEntropy with class targets: ``[N, 1, *pos]`` 0/1 mask of kept positions.

    Raises for ignored targets with ``reduction="mean"`` (the mean then runs over the
    kept entries only and does not split into per-sample losses). ``check=False``: no
    host synchronization; the caller checks the targets of a mean loss itself
    (:func:`ignored_targets`), and the mask of a sum is applied whether or not it
    ignores anything.
    """
    if (
        not isinstance(loss_func, nn.CrossEntropyLoss)
        or target is None
        or target.is_floating_point()
    ):
        return None
    if not check and loss_func.reduction == "mean":  # (the caller checks the targets)
        return None
    ignored = target == loss_func.ignore_index
    if not check:
        return (~ignored).unsqueeze(1).to(output.dtype)
    if not bool(ignored.any()):
        return None
    if loss_func.reduction == "mean":
        raise ValueError(ignored_targets_message(loss_func))
    return (~ignored).unsqueeze(1).to(output.dtype)


def ignored_targets(loss_func: nn.Module, target: Optional[Tensor]) -> Optional[Tensor]:
    """A 0-d device bool: ``target`` holds ``ignore_index`` for a mean CrossEntropy.

    ``None`` where that cannot happen (another loss, a sum, probability targets). The
    curvature of such a batch does not split into per-sample losses: see
    :func:`ignored_targets_message`.
    """
    if (
        not isinstance(loss_func, nn.CrossEntropyLoss)
        or loss_func.reduction != "mean"
        or not isinstance(target, Tensor)
        or target.is_floating_point()
    ):
        return None
    return (target == loss_func.ignore_index).any()


def check_ignored(loss_func: nn.Module, flags: Sequence[Optional[Tensor]]) -> None:
    """Raise :func:`ignored_targets_message` if one of :func:`ignored_targets`' ``flags`` is set.

    One host synchronization for all of them (none if all are ``None``): a caller that
    enqueued its work without checking the targets first (``check_targets=False``) reads
    them once, at the end, instead of stalling after each forward.
    """
    flags = [f for f in flags if f is not None]
    if flags and bool(torch.stack(flags).any() if len(flags) > 1 else flags[0]):
        raise ValueError(ignored_targets_message(loss_func))


def ignored_targets_message(loss_func: nn.Module) -> str:
    """The error for ignored targets with a mean CrossEntropy (see :func:`ignored_targets`)."""
    return (
        f"target contains ignore_index={loss_func.ignore_index} with reduction "
        "'mean': the batch mean then runs over the non-ignored entries only and "
        "does not split into per-sample losses. Use reduction='sum'."
    )


def require_tensor_output(out: object, caller: str) -> None:
    """A ``ValueError`` unless the model output is a tensor (a dict, a tuple: not)."""
    if not isinstance(out, Tensor):
        raise ValueError(
            f"{caller}: the model returned a {type(out).__name__}, not a tensor of outputs; "
            "the loss module needs the tensor it is applied to. Pass a model whose forward "
            "returns it, e.g. a wrapper module with forward(x) = model(x)['logits']."
        )


def reduction_scale(loss_func: nn.Module, batch_size: int) -> float:
    """``R`` in ``L = R * sum_n l_n``: ``1 / N`` for mean, ``1`` for sum."""
    return 1.0 / batch_size if loss_func.reduction == "mean" else 1.0


def per_sample_losses(
    loss_func: nn.Module, output: Tensor, target: Tensor, *, check_targets: bool = True
) -> Tensor:
    """Per-sample losses ``l_n`` ``[N]`` such that ``loss_func(output, target) = R sum l_n``.

    Args:
        loss_func: A supported loss module (see :func:`check_loss`).
        output: Model output ``[N, ...]``.
        target: Targets for ``loss_func``.
        check_targets: Raise for ignored targets of a mean CrossEntropy (one host
            synchronization); ``False``: the caller checks them (:func:`check_ignored`).

    Returns:
        ``[N]``: the loss of each sample alone, with the module's reduction.

    """
    check_loss(loss_func)
    if isinstance(loss_func, nn.CrossEntropyLoss):
        if check_targets:
            _ignored_mask(loss_func, output, target)
        elementwise = F.cross_entropy(
            output,
            target,
            ignore_index=loss_func.ignore_index,
            reduction="none",
            label_smoothing=loss_func.label_smoothing,
        )
    elif isinstance(loss_func, nn.MSELoss):
        elementwise = F.mse_loss(output, target, reduction="none")
    else:
        elementwise = F.binary_cross_entropy_with_logits(
            output,
            target,
            weight=loss_func.weight,
            pos_weight=loss_func.pos_weight,
            reduction="none",
        )
    if elementwise.dim() == 1:  # one loss element per sample: itself (x / 1 = x)
        return elementwise
    # flatten, not reshape(N, -1): the latter is ambiguous for an empty batch (N = 0)
    flat = elementwise.flatten(1)
    return flat.mean(1) if loss_func.reduction == "mean" else flat.sum(1)


FISHER_TYPES = tuple(m.value for m in FisherType)
_FISHER_BY_VALUE = {m.value: m for m in FisherType}
FISHER_HINT = (
    "'type-2' (exact GGN), 'mc' (sampled labels), 'empirical' (true labels), 'rademacher' "
    "(random GGN estimate, one backward) or 'forward-only' (G = I)."
)


def check_fisher(fisher: Union[str, FisherType], where: str = "fisher") -> FisherType:
    """The Fisher type as a :class:`~curvature.options.FisherType`, or a ``ValueError``."""
    if type(fisher) is FisherType:  # (the checks of one call run several times: no scan)
        return fisher
    if type(fisher) is str and fisher in _FISHER_BY_VALUE:
        return _FISHER_BY_VALUE[fisher]
    if not any(fisher == m for m in FisherType):
        raise ValueError(
            f"{where}={fisher!r} is not a Fisher type; use one of {FISHER_TYPES}: {FISHER_HINT}"
        )
    return FisherType(fisher)


def _element_scale(loss_func: nn.Module, output: Tensor, target: Tensor) -> float:
    """``r`` in ``L = r * sum over loss elements`` (``1 / #elements`` for mean, else 1)."""
    if loss_func.reduction == "sum":
        return 1.0
    if isinstance(loss_func, nn.CrossEntropyLoss):
        # one loss element per sample and trailing position: output [N, C, *]
        return 1.0 / (output.numel() // output.shape[1])
    return 1.0 / output.numel()


def _softmax_axis(output: Tensor) -> int:
    return 1 if output.dim() > 1 else 0


def hessian_sqrt(
    loss_func: nn.Module, output: Tensor, target: Tensor, *, check_targets: bool = True
) -> Tensor:
    """Columns ``S [K, *output.shape]`` with ``sum_k S_k S_k^T = d^2 L / d output^2``.

    ``L`` is the loss module's scalar (reduction included); the Hessian is block-diagonal
    over samples (and CrossEntropy positions), and the columns are shared by all blocks:

    - CrossEntropy: ``K = C``, ``S_c = sqrt(r p_c) (e_c - p)`` (``p = softmax``), since
      ``diag(p) - p p^T = sum_c p_c (e_c - p)(e_c - p)^T``; over trailing positions
      ``[N, C, *pos]`` one column per class and position (``K = C * prod(pos)``), each
      non-zero at its position only.
    - MSE: ``K`` = elements per sample, ``S_j = sqrt(2 r) e_j``.
    - BCEWithLogits: ``K`` = elements per sample,
      ``S_j = sqrt(r w (pos_weight y + 1 - y) sigma (1 - sigma)) e_j``.

    ``r`` is ``1 / #loss elements`` for mean reduction and ``1`` for sum.
    ``check_targets=False``: ignored targets of a mean CrossEntropy are not looked for
    (no host synchronization; the caller checks them with :func:`ignored_targets`).
    """
    check_loss(loss_func)
    return next(_sqrt_columns(loss_func, output.detach(), target, check_targets, None))


def hessian_sqrt_chunks(
    loss_func: nn.Module,
    output: Tensor,
    target: Tensor,
    max_numel: int,
    *,
    check_targets: bool = True,
) -> Iterator[Tensor]:
    """The columns of :func:`hessian_sqrt` in chunks of at most ``max_numel`` entries.

    Each chunk is ``[K_i, *output.shape]`` (at least one column, or one position of
    CrossEntropy's ``C`` columns); together they are the columns of :func:`hessian_sqrt`
    (CrossEntropy over positions: grouped by position). For sums over the columns (a
    diagonal, a trace) without the whole ``[K, *output.shape]`` tensor, which for
    per-position losses on ``[N, T, C]`` holds ``N (T C)^2`` entries.
    """
    check_loss(loss_func)
    yield from _sqrt_columns(loss_func, output.detach(), target, check_targets, max_numel)


def _sqrt_columns(loss_func, out, target, check_targets, max_numel) -> Iterator[Tensor]:
    r = _element_scale(loss_func, out, target)
    if isinstance(loss_func, nn.CrossEntropyLoss):
        ax = _softmax_axis(out)
        p = out.softmax(ax)
        C = out.shape[ax]
        eye = torch.eye(C, dtype=out.dtype, device=out.device)
        shape = [C] + [1] * out.dim()
        shape[1 + ax] = C
        e = eye.view(shape)  # [C, 1, C, 1...]: e_c along the class axis
        coef = (r * p.movedim(ax, 0)).sqrt().unsqueeze(1 + ax)  # sqrt(r p_c) per column c
        S = coef * (e - p.unsqueeze(0))  # [C, N, C, *pos]: column c at every position
        mask = _ignored_mask(loss_func, out, target, check_targets) if out.dim() > 1 else None
        if mask is not None:  # ignored positions have a zero loss Hessian
            S = S * mask
        pos = out.shape[2:]
        if not pos:
            yield S
            return
        # the Hessian is block-diagonal over positions: one column per (class, position)
        P = math.prod(pos)
        onehot = torch.eye(P, dtype=out.dtype, device=out.device).view(1, P, 1, 1, *pos)
        if max_numel is None:
            yield (S.unsqueeze(1) * onehot).reshape(C * P, *out.shape)
            return
        step = max(1, max_numel // (C * out.numel()))
        for p0 in range(0, P, step):
            part = onehot[:, p0 : p0 + step]
            yield (S.unsqueeze(1) * part).reshape(C * part.shape[1], *out.shape)
        return
    if isinstance(loss_func, nn.MSELoss):
        diag = torch.full_like(out, 2.0 * r)
    else:
        s = out.sigmoid()
        h = s * (1 - s)
        if loss_func.pos_weight is not None:
            if target is None:
                raise ValueError(
                    "The loss Hessian of nn.BCEWithLogitsLoss(pos_weight=...) depends on the "
                    "targets; pass them (optim.register_output(output, loss_func, target))."
                )
            y = target.to(out.dtype)
            h = h * (loss_func.pos_weight * y + 1 - y)
        if loss_func.weight is not None:
            h = h * loss_func.weight
        diag = (r * h).expand_as(out)
    d = diag.sqrt()
    K = d[0].numel()
    step = max(K, 1) if max_numel is None else max(1, max_numel // max(d.numel(), 1))
    for j0 in range(0, K, step):
        yield _diag_columns(d, j0, min(K, j0 + step))


def _diag_columns(d: Tensor, start: int = 0, stop: Optional[int] = None) -> Tensor:
    """``[k, *d.shape]``: column ``j`` (``start <= j < stop``, elements of a sample) is ``d``
    on element ``j``, zero elsewhere.
    """
    N = d.shape[0]
    K = d[0].numel()
    stop = K if stop is None else stop
    cols = torch.zeros(stop - start, N, K, dtype=d.dtype, device=d.device)
    idx = torch.arange(stop - start, device=d.device)
    cols[idx, :, idx + start] = d.reshape(N, K)[:, start:stop].T
    return cols.view(stop - start, *d.shape)


def backprop_sources(
    loss_func: nn.Module,
    output: Tensor,
    target: Tensor,
    fisher: str,
    *,
    mc_samples: int = 1,
    generator: Optional[torch.Generator] = None,
    check_targets: bool = True,
) -> Tensor:
    """Vectors ``V [K, *output.shape]`` to inject at the output for a Fisher type.

    Backpropagating them gives ``g_k = J^T V_k`` for every layer output, and the curvature
    of the scalar loss ``L`` is ``sum_k J^T V_k V_k^T J``:

    - ``"type-2"``: the Hessian's square root (:func:`hessian_sqrt`), exact GGN.
    - ``"mc"``: ``sqrt(r / M) grad_f loss(f, yhat_m)`` for ``M = mc_samples`` labels drawn
      from the model's predictive distribution (categorical, Bernoulli, or Gaussian with
      variance 1/2 for MSE); its expectation is the GGN.
    - ``"rademacher"``: ``M^{-1/2} sum_k eps_mk S_k`` with Rademacher ``eps``; unbiased
      for the GGN with ``M`` backpropagated vectors instead of ``K``.
    - ``"empirical"``: ``sqrt(R) grad_f l_n`` with the true labels (``K = 1``), so that
      ``sum J^T V V^T J = R sum_n grad l_n grad l_n^T``, the empirical Fisher.

    ``"forward-only"`` has no backward (``G = I``) and raises here.

    Random draws come from ``generator``: a ``torch.Generator`` (on another device
    than ``output``, the draws are made there and copied), or an object with a method
    ``on(device)`` giving the generator of ``output``'s device (the optimizers': the
    draws then stay on the device). ``check_targets=False``: see :func:`hessian_sqrt`.
    """
    check_loss(loss_func)
    check_fisher(fisher)
    if mc_samples < 1:
        raise ValueError(f"mc_samples={mc_samples} must be a positive integer.")
    out = output.detach()
    if fisher == "forward-only":
        raise ValueError("fisher='forward-only' uses G = I and backpropagates nothing.")
    if generator is not None and not isinstance(generator, torch.Generator):
        generator = generator.on(out.device)
    if fisher == "type-2":
        return hessian_sqrt(loss_func, out, target, check_targets=check_targets)
    if fisher == "rademacher":
        return _rademacher_sources(loss_func, out, target, mc_samples, generator, check_targets)
    if fisher == "empirical":
        f = out.requires_grad_(True)
        with torch.enable_grad():
            total = per_sample_losses(loss_func, f, target).sum()
            (grad,) = torch.autograd.grad(total, f)
        scale = 1.0 / out.shape[0] if loss_func.reduction == "mean" else 1.0
        return (scale**0.5 * grad).unsqueeze(0)
    return _mc_sources(loss_func, out, target, mc_samples, generator, check_targets)


#: devices whose categorical draws use :func:`_inverse_cdf` (elsewhere ``torch.multinomial``)
INVERSE_CDF_DEVICES: Tuple[str, ...] = ("cpu",)


def _draw_dtype(out: Tensor) -> torch.dtype:
    """The dtype of Gaussian and Bernoulli draws: float64 for a float64 output, else
    float32 (a CPU draws float32 normals about 5x faster than float64).
    """
    return torch.float64 if out.dtype == torch.float64 else torch.float32


def _inverse_cdf(cdf: Tensor, generator: Optional[torch.Generator]) -> Tensor:
    """``[R, 1]`` labels drawn from the rows' cumulative weights ``cdf [R, C]``: one
    uniform ``u`` per row times the row's total, the first entry at or above it (a binary
    search): label ``i`` iff ``cdf[i-1] < u <= cdf[i]``, so with probability
    ``w_i / total`` (``u`` never exceeds the total: no label out of range; a weight-0
    label is never drawn, except label 0 when ``u`` is exactly 0, probability ``2^-53``).

    A CPU's ``torch.multinomial`` takes about 9x as long for the same draws' distribution
    (``[2048, 8192]`` float64 weights: 378-417 ms against 40-42 ms with the cumulative
    sums; benchmarks/mc_draws.py).
    """
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device)
    return torch.searchsorted(cdf, u.mul_(cdf[:, -1:]))


def _where(generator: Optional[torch.Generator], like: Tensor) -> torch.device:
    """The device random draws are made on: the generator's, else the tensor's."""
    return generator.device if generator is not None else like.device


def _rademacher(shape, generator, like: Tensor) -> Tensor:
    signs = torch.randint(0, 2, tuple(shape), generator=generator, device=_where(generator, like))
    return (signs * 2 - 1).to(like)


def _rademacher_sources(loss_func, out, target, M, generator, check_targets=True):
    """``v_m = M^{-1/2} sum_k eps_mk S_k`` with signs drawn independently per Hessian block."""
    S = hessian_sqrt(loss_func, out, target, check_targets=check_targets)
    if isinstance(loss_func, nn.CrossEntropyLoss):
        # blocks: (sample, position); S [C, *out], eps per column and block
        shape = [M, S.shape[0], *out.shape]
        shape[2 + _softmax_axis(out)] = 1
        return (_rademacher(shape, generator, S) * S).sum(1) / M**0.5
    # MSE / BCE: diagonal Hessian, S_j = d_j e_j, so v = eps * d elementwise
    d = S.sum(0)
    return _rademacher((M, *out.shape), generator, d) * d / M**0.5


def _categorical_sources(out: Tensor, M: int, generator, where: torch.device) -> Tensor:
    """``softmax(f) - onehot(yhat_m)`` ``[M, *out.shape]`` for labels drawn from the softmax.

    Built in the probabilities' own memory (``M = 1``) or in one copy of them per draw,
    with the drawn entries' ``p - 1`` written in place: at most the probabilities and the
    drawable copy of them (or the vectors) are alive at once, never a one-hot matrix or
    a difference next to them (for a language model's ``[N T, V]`` logits each of those
    is as large as the logits). The values are those of ``p - onehot`` (``p - 0 = p``;
    ``p - 1`` computed alike), the draws those of one ``multinomial`` call per sample in
    order (on a CPU: :func:`_inverse_cdf` on float64 weights, one uniform per row). A
    non-finite output is replaced for the draw only (the vectors stay NaN).
    """
    ax = _softmax_axis(out)
    p = out.softmax(ax)
    C = out.shape[ax]
    moved = p if ax == out.dim() - 1 else p.movedim(ax, -1)  # [N, C] or [C]: no call
    probs = moved if moved.dim() == 2 else moved.reshape(-1, C)
    inverse_cdf = where.type in INVERSE_CDF_DEVICES
    if inverse_cdf:  # float64 weights: their cumulative sums lose nothing
        probs = probs.double()
    probs = probs.to(where)
    # drawable; the vectors stay NaN (in place on a copy of its own: dtype, device, layout)
    own = probs.untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    probs = probs.nan_to_num_(1.0, 1.0, 1.0) if own else probs.nan_to_num(1.0, 1.0, 1.0)
    if inverse_cdf:  # the same distribution, ~9x faster than a CPU's multinomial
        probs = probs.cumsum_(-1)
        draws = [_inverse_cdf(probs, generator) for _ in range(M)]  # [R, 1]
    else:
        draws = [torch.multinomial(probs, 1, generator=generator) for _ in range(M)]
    del probs
    V = p.unsqueeze(0) if M == 1 else p.unsqueeze(0).expand(M, *p.shape).contiguous()
    lead = moved.shape[:-1]
    for m, idx in enumerate(draws):
        # the drawn label's entry along the softmax axis, in the layout of out (no view
        # or select where the layout already fits: each would be a call of its own)
        idx = idx.to(out.device)
        idx = idx if idx.shape == (*lead, 1) else idx.view(*lead, 1)
        idx = idx if ax == out.dim() - 1 else idx.movedim(-1, ax)
        Vm = p if M == 1 else V[m]
        if Vm.device.type == "cpu":  # p - 1 in one call (the same bits; deterministic there)
            Vm.scatter_(ax, idx, -1.0, reduce="add")
        else:
            Vm.scatter_(ax, idx, Vm.gather(ax, idx) - 1.0)
    return V


def _mc_sources(loss_func, out, target, M, generator, check_targets=True):
    """``sqrt(r / M) grad_f loss(f, yhat_m)``, the labels drawn on the generator's device.

    A non-finite output gives non-finite vectors (its statistics are then skipped):
    its probabilities are replaced for the draw only, without a host synchronization.
    """
    r = _element_scale(loss_func, out, target)
    scale = (r / M) ** 0.5
    where = _where(generator, out)

    def draw(fn):  # (one sample: an unsqueeze, not a stack's copy)
        return fn().unsqueeze(0) if M == 1 else torch.stack([fn() for _ in range(M)])

    if isinstance(loss_func, nn.CrossEntropyLoss):
        mask = _ignored_mask(loss_func, out, target, check_targets) if out.dim() > 1 else None
        V = _categorical_sources(out, M, generator, where).mul_(scale)
        return V if mask is None else V.mul_(mask)
    dtype = _draw_dtype(out)
    if isinstance(loss_func, nn.MSELoss):
        # yhat = f + eps / sqrt(2): grad_f (f - yhat)^2 = -sqrt(2) eps, times the scale
        def one():
            eps = torch.randn(out.shape, generator=generator, dtype=dtype, device=where)
            return eps.mul_(-(2**0.5) * scale).to(out)

        return draw(one)
    if loss_func.pos_weight is not None or loss_func.weight is not None:
        raise ValueError(
            "fisher='mc' with nn.BCEWithLogitsLoss(weight=..., pos_weight=...) is not "
            "defined (the weighted loss is not a likelihood); use 'type-2' or 'rademacher'."
        )
    s = out.sigmoid()
    s_where = s.to(where, dtype).nan_to_num(0.5)  # drawable; the vectors stay NaN

    def one():
        yhat = torch.bernoulli(s_where, generator=generator).to(out)
        return torch.sub(s, yhat, out=yhat).mul_(scale)

    return draw(one)
