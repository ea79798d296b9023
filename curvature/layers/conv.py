"""``nn.Conv1d/2d/3d``: unfolded patches make a convolution a Linear layer shared over
output positions.

For input ``x [N, C_in, *spatial]`` and weight ``W [C_out, C_in / G, *k]``, the patch
of output position ``s`` and group ``c`` is ``a[n, s, c] in R^{C_in / G * prod(k)}``
(ordered like ``W[o].flatten()``), and ``z[n, :, s]`` of group ``c`` is ``W_c a[n, s, c]``.
Padding (numbers, ``"same"``, ``"valid"``, any ``padding_mode``), stride, dilation and
groups are handled by padding first and taking strided windows.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import CHUNK_ELEMENTS, LayerRule, LinearFamilyRule, check_same_samples, expanded_kfac
from .conv_sums import live_gram, output_positions, window_sums
from .conv_taps import live_columns
from .kfac_sums import positions_gram
from .precision import gram
from .registry import register


def unfold_patches(module: nn.modules.conv._ConvNd, x: Tensor) -> Tensor:
    """Patches ``[N, S, G, C_in / G * prod(k)]`` of a convolution's input ``x``.

    ``S`` is the number of output positions, in the row-major order of the output.
    """
    return _patch_rows(_windows(module, x), module.groups)


def biased_patches(module: nn.modules.conv._ConvNd, x: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`unfold_patches` with a column of ones last (the bias coordinate), ``[N, S,
    G, C_in / G prod(k) + 1]`` in ``dtype``: the windows copied once, straight into the
    result beside the column (one ``x^T x`` of it then gives the whole ``A`` sum, bias row
    and column included, where separate sums and a ``[D + 1, D + 1]`` assembly took a pass
    over the patches and four more copies).
    """
    rows = _row_view(_windows(module, x), module.groups)  # [N, O.., G, C_in / G, k..]
    d = len(module.kernel_size)
    N, outs, G, row = rows.shape[0], rows.shape[1 : 1 + d], module.groups, rows.shape[2 + d :]
    D = math.prod(row)  # (C_in / G) prod(k)
    out = rows.new_empty(N, math.prod(outs), G, D + 1, dtype=dtype)
    out[..., :D].unflatten(1, outs).unflatten(-1, row).copy_(rows)  # the one copy
    out[..., D] = 1
    return out


def _with_bias(pp: Tensor, ps: Tensor, count: int) -> Tensor:
    """``[[P^T P, P^T 1], [1^T P, count]]`` ``[C, D + 1, D + 1]`` from ``pp [C, D, D]`` and
    ``ps [C, D]``.
    """
    C, D = ps.shape
    A = pp.new_empty(C, D + 1, D + 1)
    A[:, :D, :D] = pp
    A[:, :D, D] = ps
    A[:, D, :D] = ps
    A[:, D, D] = count
    return A


def _patch_rows(w: Tensor, groups: int, fold: bool = False) -> Tensor:
    """Windows ``[N, C_in, O_1..O_d, k_1..k_d]`` as patch rows ``[N, S, G, C_in / G
    prod(k)]`` (``fold``: ``[N G, S, C_in / G prod(k)]``), one copy of the windows.

    The einops pattern ``n (g c) o.. k.. -> n (o..) g (c k..)`` written as one split of the
    channels (a view), a permutation (a view) and a reshape (the copy): no einops call on
    the hot path of every convolution's statistics.
    """
    N, C = w.shape[0], w.shape[1]
    d = (w.dim() - 2) // 2
    S, K = math.prod(w.shape[2 : 2 + d]), math.prod(w.shape[2 + d :])
    if fold:  # [N, G, O.., C / G, k..]
        outs, ks = range(3, 3 + d), range(3 + d, 3 + 2 * d)
        w = w.unflatten(1, (groups, C // groups)).permute(0, 1, *outs, 2, *ks)
        return w.reshape(N * groups, S, (C // groups) * K)
    return _row_view(w, groups).reshape(N, S, groups, (C // groups) * K)


def _row_view(w: Tensor, groups: int) -> Tensor:
    """Windows ``[N, C_in, O_1..O_d, k_1..k_d]`` as the view ``[N, O.., G, C_in / G,
    k..]``: the patch rows' order, before they are copied (:func:`_patch_rows`,
    :func:`biased_patches`).
    """
    d = (w.dim() - 2) // 2
    w = w.unflatten(1, (groups, w.shape[1] // groups))  # [N, G, C / G, O.., k..]
    return w.permute(0, *range(3, 3 + d), 1, 2, *range(3 + d, 3 + 2 * d))


def _check_batched(module: nn.modules.conv._ConvNd, x: Tensor) -> None:
    if x.dim() == len(module.kernel_size) + 1:
        raise ValueError(
            f"{type(module).__name__} got an unbatched input of shape {tuple(x.shape)}; "
            "per-sample quantities need a leading batch axis."
        )


def _windows(module: nn.modules.conv._ConvNd, x: Tensor, channels_last: bool = False) -> Tensor:
    """The padded input's windows ``[N, C_in, O_1..O_d, k_1..k_d]`` (a strided view);
    ``channels_last``: those of a channels-last copy, ``[N, O_1..O_d, C_in, k_1..k_d]``.
    """
    d = len(module.kernel_size)
    _check_batched(module, x)
    pad = module._reversed_padding_repeated_twice
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    first = 2  # the first spatial axis
    if channels_last:
        x, first = x.movedim(1, -1).contiguous(), 1  # [N, *spatial, C_in]
    for i in range(d):
        k, s, dil = module.kernel_size[i], module.stride[i], module.dilation[i]
        # window of extent dil * (k - 1) + 1 at every stride, then keep every dil-th entry
        x = x.unfold(first + i, dil * (k - 1) + 1, s)
        if dil != 1:
            x = x[..., ::dil]
    return x  # the channels split into groups as (G, C_in / G)


#: Devices on which a convolution's ``"expand"`` Kronecker statistics unfold the patches
#: of one group kernel-major (:func:`kernel_major_sums`) from a channels-last copy of the
#: input (runs of ``k_d C_in`` elements, not ``k_d``): 0.50-0.97x the channel-major route
#: from ``N S >= 0.89 D`` on, 1.26-1.54x below (``python benchmarks/conv_patches.py
#: --layers resnet --threads 1``; docs/benchmarks.md). Not on a GPU (not measured there).
KERNEL_MAJOR_DEVICES = ("cpu",)
#: ``N S >= KERNEL_MAJOR_ROWS * D``: the patch rows per patch entry from which
#: :data:`KERNEL_MAJOR_DEVICES` take the kernel-major route.
KERNEL_MAJOR_ROWS = 0.5
#: Patches of fewer elements (``N S D``) keep the channel-major copy: the kernel-major
#: route's few more calls cost more than it saves on tiny layers (benchmarks/ab_step.py's
#: ResNet-18 at width 4, batch 4, a host-bound step: 20.4 against 19.3 ms per step).
KERNEL_MAJOR_MIN_ELEMENTS = 2**15
#: Output positions per sample from which :func:`patch_sums` sums the windows by a GEMM
#: per axis instead of copying the patches (training.py's ResNet-18 layers at batch 128,
#: one thread: 0.12-0.39x the copy's time at 4 and 16 positions, 1.6-3.8x at 1).
WINDOW_SUM_POSITIONS = 2


def _kernel_major(module: nn.modules.conv._ConvNd, call) -> bool:
    """Whether :meth:`ConvRule.kfac_factors` takes :func:`kernel_major_sums` for ``call``:
    on :data:`KERNEL_MAJOR_DEVICES`, one group, at least ``KERNEL_MAJOR_ROWS * D`` patch
    rows and ``KERNEL_MAJOR_MIN_ELEMENTS`` patch entries, and a padded input no larger
    than the patches (its channels-last copy: a strided 1x1 convolution's input is
    ``prod(stride)`` times its patches).
    """
    x = call.args[0]
    if module.groups != 1 or x.device.type not in KERNEL_MAJOR_DEVICES or call.grads is None:
        return False
    d = len(module.kernel_size)
    S = call.grads[0].shape[-d:].numel()
    K = math.prod(module.kernel_size)
    pad = module._reversed_padding_repeated_twice
    padded = math.prod(
        x.shape[-d + i] + pad[2 * (d - 1 - i)] + pad[2 * (d - 1 - i) + 1] for i in range(d)
    )
    rows, D = x.shape[0] * S, module.in_channels * K
    return (
        rows >= KERNEL_MAJOR_ROWS * D and padded <= S * K and rows * D >= KERNEL_MAJOR_MIN_ELEMENTS
    )


def kernel_major_patches(module: nn.modules.conv._ConvNd, x: Tensor, bias: bool) -> Tensor:
    """Patches ``[N, S, D + bias]`` of a one-group convolution's input, unfolded
    kernel-major: column ``(k, c)`` for kernel entry ``k`` and input channel ``c`` (the
    weight's order is ``(c, k)``: :func:`kernel_major_order`), then a column of ones where
    ``bias``. One copy of the windows of a channels-last copy of the padded input, in
    contiguous runs of ``k_d C_in`` elements (the channel-major windows of a
    channels-first input copy in runs of ``k_d``: slow on a CPU).
    """
    d = len(module.kernel_size)
    x = _windows(module, x, channels_last=True)  # [N, O_1..O_d, C_in, k_1..k_d]
    outs, ks = range(1, 1 + d), range(2 + d, 2 + 2 * d)
    w = x.permute(0, *outs, *ks, 1 + d)  # [N, O.., k.., C_in]: a view
    N, D = w.shape[0], module.in_channels * math.prod(module.kernel_size)
    S = math.prod(w.shape[1 : 1 + d])
    if not bias:
        return w.reshape(N, S, D)  # the copy
    out = w.new_empty(N, S, D + 1)
    out[..., :D].view(w.shape).copy_(w)  # the copy, beside the bias column
    out[..., D] = 1
    return out


def kernel_major_order(module: nn.modules.conv._ConvNd, bias: bool, device=None) -> Tensor:
    """``[D + bias]``: kernel-major column ``j`` of :func:`kernel_major_patches` is column
    ``order[j]`` of the weight's (channel-major) order; the bias column last in both.
    """
    C, K = module.in_channels, math.prod(module.kernel_size)
    order = torch.arange(C * K + bias, device=device)
    order[: C * K] = order[: C * K].view(C, K).T.flatten()
    return order


def kernel_major_sums(
    module: nn.modules.conv._ConvNd, x: Tensor, bias: bool
) -> tuple[Tensor, Optional[Tensor], int]:
    """``(sum P^T P [1, D, D], sum P [1, D] or None, N S)`` of a one-group convolution's
    patches ``P [N S, D]`` (``D = C_in prod(k)``, the weight's order), unfolded
    kernel-major (:func:`kernel_major_patches`).

    The product ``P_k^T P_k`` of the kernel-major patches is permuted into the weight's
    ``(C_in, k)`` order, a copy of ``D^2`` elements (against ``N S D`` for the patches).
    The same sums as the channel-major patches up to the order of the GEMM's additions.
    """
    d = len(module.kernel_size)
    C, K = module.in_channels, math.prod(module.kernel_size)
    P = kernel_major_patches(module, x, False).flatten(0, 1)  # [N S, (k, C_in)]
    pp = gram(P.unsqueeze(0))  # [1, D, D], (k, C) order: the weight's if C or K is 1
    if C > 1 and K > 1:  # (k, C) x (k, C) -> (C, k) x (C, k), a copy
        kc = pp.view(1, *module.kernel_size, C, *module.kernel_size, C)
        rows, cols = (1 + d, *range(1, 1 + d)), (2 + 2 * d, *range(2 + d, 2 + 2 * d))
        pp = kc.permute(0, *rows, *cols).reshape(1, C * K, C * K)
    ps = None
    if bias:
        ps = P.sum(0).view(*module.kernel_size, C).movedim(-1, 0).reshape(1, C * K)
    return pp, ps, P.shape[0]


def patch_sums(module: nn.modules.conv._ConvNd, x: Tensor) -> tuple[Tensor, int]:
    """``(sum_s P[n, s] [N, D], S)``: a one-group convolution's patches summed over its
    ``S`` output positions, ``D = C_in prod(k)`` in the weight's order.

    From ``WINDOW_SUM_POSITIONS`` positions on, by a small GEMM per spatial axis
    (:func:`~curvature.layers.conv_sums.window_sums`; no copy of the patches), else the
    patches are copied and summed (fewer, longer runs).
    """
    _check_batched(module, x)
    if output_positions(module, x) >= WINDOW_SUM_POSITIONS:
        return window_sums(module, x)
    w = _windows(module, x)  # [N, C_in, O_1..O_d, k_1..k_d]
    return _patch_rows(w, 1).sum(1)[:, 0], math.prod(w.shape[2 : 2 + len(module.kernel_size)])


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d)
class ConvRule(LinearFamilyRule):
    """Convolutions as Linear layers over unfolded patches (shared over positions)."""

    def expand(self, module, call):  # noqa: D102
        return unfold_patches(module, call.args[0]), self._grads(module, call)

    def kfac_factors(self, module, calls, approx, with_g=True):
        """KFAC statistics from the unfolded patches ``P``, copied once.

        ``"expand"`` with a trainable weight: ``A_sum = [[P^T P, P^T 1], [1^T P, N S]]``
        (the bias coordinate, where trainable, is 1 at every position), the same matrix as
        :meth:`expand_calls`' ``a^T a`` without a second copy of the patches: one GEMM of
        the patches copied beside a column of ones (:func:`biased_patches`); on
        :data:`KERNEL_MAJOR_DEVICES` the patches of one group are unfolded kernel-major
        (:func:`kernel_major_sums`, ``P^T 1`` summed apart: its product is permuted into
        the weight's order). ``"reduce"`` with one group: the patches' means
        without copying them where a sample has many positions (:func:`patch_sums`).
        The other cases (groups with ``"reduce"``, no trainable weight, calls inside
        :func:`shared_slots`) take the general path.
        """
        has_w, has_b = self._weight_bias(module)
        if not has_w or any(c.slots is not None for c in calls):
            return super().kfac_factors(module, calls, approx, with_g)
        if approx == "reduce":
            return self._reduced_factors(module, calls, has_b, with_g)
        live = self.live_columns(module, calls) if module.groups == 1 else None
        kernel_major = [live is None and _kernel_major(module, c) for c in calls]
        if not (has_b or any(kernel_major) or live):
            return super().kfac_factors(module, calls, approx, with_g)
        A_sum = G_sum = None
        count = 0
        for call, km in zip(calls, kernel_major):
            g = self._grads(module, call) if with_g else None
            x = call.args[0]  # (promoted with g: e.g. bf16 inputs under autocast)
            dtype = x.dtype if g is None else torch.promote_types(x.dtype, g.dtype)
            if km:  # [1, D_in, D_in], [1, D_in]: no patch copy in the weight's order
                pp, ps, n = kernel_major_sums(module, x.to(dtype), has_b)
                a = _with_bias(pp, ps, n) if has_b else pp
                gg = None if g is None else positions_gram(g[..., 0, :])
            else:  # the patches (with the bias column): a^T a and g^T g, one GEMM each
                p = biased_patches(module, x, dtype) if has_b else self.expand(module, call)[0]
                a, gg, n = expanded_kfac(p.to(dtype), g, "expand", live)  # (live: zeros)
            A_sum = a if A_sum is None else A_sum.add_(a)
            count += n
            if gg is not None:
                G_sum = gg if G_sum is None else G_sum.add_(gg)
        return {"": (A_sum, G_sum, count)}

    def permuted_blocks(self, module, calls):
        """Kernel-major patches with the bias column (:func:`kernel_major_patches`: one
        copy instead of the channel-major patches' and their copy with the bias column)
        where :meth:`kfac_factors` takes them (one call), with their column order.
        """
        if len(calls) != 1 or calls[0].slots is not None or not _kernel_major(module, calls[0]):
            return None
        has_w, has_b = self._weight_bias(module)
        if not has_w:
            return None
        g = self._grads(module, calls[0])
        x = calls[0].args[0]
        x = x.to(torch.promote_types(x.dtype, g.dtype))
        a = kernel_major_patches(module, x, has_b).unsqueeze(2)  # [N, S, 1, D]
        return {"": (a, g, kernel_major_order(module, has_b, x.device))}

    @staticmethod
    def _grads(module, call) -> Optional[Tensor]:
        """``g [..., N, S, G, C_out / G]`` of one call (a view of ``[..., N, C_out, O_1..
        O_d]``, no copy), ``None`` without a backward (forward-only statistics).
        """
        if call.grads is None:
            return None
        g = call.grads[0].flatten(-len(module.kernel_size)).transpose(-1, -2)
        return g.unflatten(-1, (module.groups, -1))

    def _reduced_factors(self, module, calls, has_b: bool, with_g: bool):
        """``"reduce"`` statistics: the patches meaned over the positions of all calls
        (:func:`patch_sums`), the output gradients summed over them, one GEMM each.
        """
        if module.groups != 1:
            return super().kfac_factors(module, calls, "reduce", with_g)
        check_same_samples(module, [c.args[0].shape[0] for c in calls])
        means, g_sum = None, None
        S = 0
        for call in calls:
            g = self._grads(module, call) if with_g else None
            x = call.args[0]
            if g is not None and x.dtype != g.dtype:
                x = x.to(torch.promote_types(x.dtype, g.dtype))
            sums, s = patch_sums(module, x)  # [N, D_in], the call's positions
            means = sums if means is None else means.add_(sums)
            S += s
            if g is not None:
                gs = g[..., 0, :].sum(-2)  # [..., N, C_out]
                g_sum = gs if g_sum is None else g_sum.add_(gs)
        means = means.div_(S)
        if has_b:
            means = torch.cat([means, means.new_ones(means.shape[0], 1)], 1)
        live = self.live_columns(module, calls)  # (taps that read padding alone: zeros)
        A_sum = gram(means.unsqueeze(0)) if live is None else live_gram(means, live)
        G_sum = None if g_sum is None else gram(g_sum.reshape(1, -1, g_sum.shape[-1]))
        return {"": (A_sum, G_sum, means.shape[0])}

    def live_columns(self, module, calls):  # noqa: D102
        has_w, has_b = self._weight_bias(module)
        d = len(module.kernel_size)
        return live_columns(module, [c.args[0].shape[-d:] for c in calls], has_b) if has_w else None

    def expanded_shape(self, module, calls):
        """``(N, S, C, D, D_out)`` of :meth:`expand_calls`' operands, without unfolding.

        ``a [N, S, C, D]`` (bias column included), ``g [..., N, S, C, D_out]``; ``S`` the
        output positions of all calls. For chunking the batch before unfolding.
        """
        has_w, has_b = self._weight_bias(module)
        d = len(module.kernel_size)
        S = sum(c.grads[0].shape[-d:].numel() for c in calls)
        C = module.groups
        D = has_w * (module.in_channels // C) * math.prod(module.kernel_size) + has_b
        return calls[0].args[0].shape[0], S, C, D, module.out_channels // C

    def per_sample_grads(self, module, calls, out=None):  # noqa: D102
        has_w, has_b = self._weight_bias(module)
        res: dict = {}
        for i, call in enumerate(calls):
            x, g = call.args[0], call.grads[0]
            if has_w:
                w = per_sample_weight_grads(
                    module, x, g, out.get("weight") if out and i == 0 else None
                )
                res["weight"] = w if i == 0 else res["weight"].add_(w)
            if has_b:
                b = g.flatten(2).sum(-1)
                res["bias"] = b if i == 0 else res["bias"] + b
        return res

    def per_sample_sq_norms(self, module, calls):  # noqa: D102
        has_w, has_b = self._weight_bias(module)
        x0 = calls[0].args[0]
        N = x0.shape[0]
        S = calls[0].grads[0][0, 0].numel() * len(calls)
        D = module.weight[0].numel() + 1
        D_out = module.out_channels // module.groups
        if S * S * (D + D_out) <= (S + 1) * D * D_out:  # Gram trick over positions
            return super().per_sample_sq_norms(module, calls)
        # materialize per-sample gradients a chunk of samples at a time
        per_sample = module.weight.numel() * (1 + len(calls))
        chunk = max(1, CHUNK_ELEMENTS // per_sample)
        sq = x0.new_zeros(N, dtype=calls[0].grads[0].dtype)
        for n0 in range(0, N, chunk):
            w, b = None, None
            for call in calls:
                x, g = call.args[0][n0 : n0 + chunk], call.grads[0][n0 : n0 + chunk]
                if has_w:
                    wi = per_sample_weight_grads(module, x, g)
                    w = wi if w is None else w.add_(wi)
                if has_b:
                    bi = g.flatten(2).sum(-1)
                    b = bi if b is None else b + bi
            if w is not None:
                sq[n0 : n0 + chunk] += w.flatten(1).pow(2).sum(1)
            if b is not None:
                sq[n0 : n0 + chunk] += b.pow(2).sum(1)
        return sq

    def gram(self, module, calls):  # noqa: D102
        return LayerRule.gram(self, module, calls)

    def direct_diagonal(self, module, calls, bound: int) -> Optional[Tensor]:
        """The Fisher diagonal ``[C, D_out, D]`` (laid out like :meth:`expanded_shape`'s
        operands: the weight's ``C_in / G * prod(k)`` columns, then the bias) from
        per-sample weight gradients made in one kernel call per chunk of samples
        (:func:`per_sample_weight_grads`: no unfolded patches, no bias column).

        ``sum_{k,n} psg_kn^2`` for the weight (the gradients of all calls summed per
        sample before squaring) and ``sum_{k,n} (sum_{calls, s} g_kns)^2`` for the bias.
        A chunk holds ``bound // (K |W| (1 + [several calls]))`` samples, at least one
        (its per-sample gradients, and their running sum over several calls).
        ``None`` for calls inside :func:`shared_slots` and for one call with one output
        position per sample (the general path: there the diagonal is one GEMM ``(g^2)^T
        (a^2)`` of the patches, no per-sample gradient; ResNet-18's last stage on 28x28
        inputs made 128 one-sample chunks of ``[128, 1152]`` gradients per layer here).
        """
        if any(c.slots is not None or c.grads is None for c in calls):
            return None
        d = len(module.kernel_size)
        if len(calls) == 1 and calls[0].grads[0].shape[-d:].numel() == 1:
            return None
        has_w, has_b = self._weight_bias(module)
        x0, g0 = calls[0].args[0], calls[0].grads[0]
        lead = g0.dim() - x0.dim()  # the leading [K] axes of batched pulls
        K, N = g0.shape[:lead].numel(), x0.shape[0]
        G = module.groups
        D_out = module.out_channels // G
        parts = []
        if has_w:
            W = module.weight
            per_sample = K * W.numel() * (1 + (len(calls) > 1))
            chunk = max(1, bound // max(1, per_sample))
            d = None
            for n0 in range(0, N, chunk):
                n = min(chunk, N - n0)
                w = None
                for c in calls:
                    x, g = c.args[0], c.grads[0]
                    if n < N:  # (the whole batch: no slices)
                        x, g = x.narrow(0, n0, n), g.narrow(lead, n0, n)
                    wi = folded_weight_grads(module, x, g, K)
                    w = wi if w is None else w.add_(wi)
                # [n, G, K, D_out, C_in / G * prod(k)]: squared in place, summed
                part = w.view(n, G, K, D_out, -1).pow_(2).sum((0, 2))
                d = part if d is None else d.add_(part)
            parts.append(d)
        if has_b:
            b = None
            for c in calls:
                g = c.grads[0]
                bi = g.sum(tuple(range(lead + 2, g.dim())))  # [*K, N, C_out]
                b = bi if b is None else b + bi
            b = (b * b).sum(tuple(range(lead + 1)))  # [C_out]
            parts.append(b.view(G, D_out, 1))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts, -1)


def _conv_input(module: nn.modules.conv._ConvNd, x: Tensor) -> tuple[Tensor, list]:
    """The input and numeric padding to hand to an unpadded convolution kernel."""
    pad = module._reversed_padding_repeated_twice
    symmetric = all(pad[2 * i] == pad[2 * i + 1] for i in range(len(pad) // 2))
    if module.padding_mode == "zeros" and symmetric:
        return x, [pad[2 * i] for i in reversed(range(len(pad) // 2))]
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, pad, mode=mode)
    return x, [0] * len(module.kernel_size)


def per_sample_weight_grads(
    module: nn.modules.conv._ConvNd, x: Tensor, g: Tensor, out: Optional[Tensor] = None
) -> Tensor:
    """``[N, *W.shape]``: per-sample weight gradients of a convolution in one kernel call.

    The batch is folded into the channels, ``[1, N * C_in, *spatial]``, and the weight
    gradient of a convolution with ``N * G`` groups is exactly the stack of the per-sample
    weight gradients (the trick of "expanded weights").
    """
    W = module.weight
    N = x.shape[0]
    grad = _weight_grads(module, x, g, (N * W.shape[0], *W.shape[1:])).view(N, *W.shape)
    if out is None:
        return grad
    return out.copy_(grad)


#: Devices on which per-sample weight gradients are always patch GEMMs
#: (:func:`patch_weight_grads`) instead of one grouped convolution backward. cuDNN runs a
#: convolution with ``N * G`` groups as about one kernel per group: on an H100 (float32,
#: TF32 off) 0.8-9.8 ms per layer of gpu.py's CNNs against 0.1-1.2 ms for the patch GEMMs
#: (``benchmarks/conv_weight_grads.py``; docs/benchmarks.md, "GPU"). Elsewhere (a CPU)
#: the patch GEMMs are taken where a sample has at most ``PATCH_GEMM_POSITIONS`` output
#: positions per input channel of a group (``benchmarks/conv_weight_grads.py --device
#: cpu``): 1.9-10x faster than the grouped call at 0.01-0.5 positions per channel (the
#: late stages of a ResNet, the VGG's 8x8 layers), slower from about 1 on (0.73x at 1.0,
#: 0.43x at 1.1, 0.13-0.52x at 3-25; even at 2.0 with 128 channels).
PATCH_GEMM_DEVICES = ("cuda",)
PATCH_GEMM_POSITIONS = 0.5
#: The patches' memory bound in :func:`patch_weight_grads`, in elements: ``max(
#: PATCH_CHUNK_ELEMENTS, PATCH_CHUNK_SHARE * (numel(x) + numel(g)))``.
PATCH_CHUNK_ELEMENTS = 2**22
PATCH_CHUNK_SHARE = 1.0


def _weight_grads(module: nn.modules.conv._ConvNd, x: Tensor, g: Tensor, shape) -> Tensor:
    """The weight gradient ``shape`` of the convolution of ``x [N, C_in, *spatial]`` with
    ``N * G`` groups for output gradients ``g [..., *out]`` (``shape[0]`` channels in all:
    the leading axes in row-major order, sample first).
    """
    if _patch_gemms(module, x, g):
        return patch_weight_grads(module, x, g, shape)
    x, padding = _conv_input(module, x.to(g.dtype))
    N, sp = x.shape[0], g.shape[-(x.dim() - 2) :]
    w_like = _stand_in(shape, g)  # (in the gradients' dtype: e.g. bf16 under autocast)
    return torch.ops.aten.convolution_backward(
        g.reshape(1, -1, *sp),  # (any leading axes: [K = 1, N] or [N, G, K])
        x.reshape(1, -1, *x.shape[2:]),
        w_like,
        None,
        list(module.stride),
        padding,
        list(module.dilation),
        False,
        [0] * len(module.kernel_size),
        N * module.groups,
        [False, True, False],
    )[1]


def folded_weight_grads(module: nn.modules.conv._ConvNd, x: Tensor, g: Tensor, K: int) -> Tensor:
    """Per-sample weight gradients of ``K`` pulled vectors, ``[N * G * K * D_out, C_in / G,
    *k]`` (sample, group, vector, output channel): :func:`per_sample_weight_grads` with the
    vectors folded into each group's output channels (one copy of ``g`` for ``K > 1``).
    """
    G, N = module.groups, x.shape[0]
    sp = g.shape[-(x.dim() - 2) :]
    if K > 1:  # [K, N, G, D_out, *sp] -> [N, G, K, D_out, *sp]: group (n, c)'s channels
        g = g.reshape(K, N, G, -1, *sp).movedim(0, 2)
    W = module.weight
    return _weight_grads(module, x, g, (N * K * W.shape[0], *W.shape[1:]))


def _patch_gemms(module: nn.modules.conv._ConvNd, x: Tensor, g: Tensor) -> bool:
    """Whether :func:`_weight_grads` takes :func:`patch_weight_grads` (see
    :data:`PATCH_GEMM_DEVICES`, :data:`PATCH_GEMM_POSITIONS`).
    """
    if x.device.type in PATCH_GEMM_DEVICES:
        return True
    positions = g.shape[-len(module.kernel_size) :].numel()
    return positions <= PATCH_GEMM_POSITIONS * (module.in_channels // module.groups)


def patch_weight_grads(module: nn.modules.conv._ConvNd, x: Tensor, g: Tensor, shape) -> Tensor:
    """:func:`_weight_grads` as batched GEMMs over unfolded patches, a chunk of samples at
    a time: for sample ``n`` and group ``c``, ``g_nc [R, S] @ P_nc [S, C_in / G prod(k)]``
    (``R = shape[0] / (N G)`` rows: the pulled vectors times the group's output channels,
    ``S`` output positions). The patches of one chunk (one copy of its strided windows)
    stay within ``max(PATCH_CHUNK_ELEMENTS, PATCH_CHUNK_SHARE * (numel(x) + numel(g)))``
    elements: at most about the memory of the layer's own input and output gradients.
    Taken in ``g``'s dtype with autocast off (the grouped convolution's numerics: no
    lower-precision GEMM).
    """
    N, G, d = x.shape[0], module.groups, len(module.kernel_size)
    S = g.shape[-d:].numel()
    D = math.prod(shape[1:])  # C_in / G * prod(k)
    gm = g.reshape(N * G, -1, S)  # (any leading axes: [K = 1, N] or [N, G, K])
    bound = max(PATCH_CHUNK_ELEMENTS, int(PATCH_CHUNK_SHARE * (x.numel() + g.numel())))
    chunk = max(1, bound // max(1, G * S * D))
    # into one buffer, unless autograd records (a differentiable result: the chunks joined)
    graph = torch.is_grad_enabled() and (x.requires_grad or g.requires_grad)
    out = None if chunk >= N or graph else g.new_empty(N * G, gm.shape[1], D)
    parts = []
    with torch.autocast(x.device.type, enabled=False):
        for n0 in range(0, N, chunk):
            n = min(chunk, N - n0)
            xc = x if n == N else x.narrow(0, n0, n)
            # [n G, S, C_in / G prod(k)]: one copy of the windows
            P = _patch_rows(_windows(module, xc.to(g.dtype)), G, fold=True)
            rows = slice(n0 * G, (n0 + n) * G)
            if out is None:
                parts.append(torch.bmm(gm[rows], P))
            else:
                torch.bmm(gm[rows], P, out=out[rows])
    if out is None:
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.view(shape)


def _stand_in(shape, like: Tensor) -> Tensor:
    """``shape``, strides 0, one uninitialized element of ``like``'s dtype and device."""
    return like.new_empty(()).expand(shape)
