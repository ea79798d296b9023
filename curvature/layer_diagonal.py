"""A Linear-family layer's Fisher diagonal from its expanded operands, in chunks of samples.

The diagonal ``sum_{k,n} (sum_s g_kns a_ns^T)^2`` of a layer with shared positions
``S > 1`` (a convolution: ``a`` are its unfolded patches) needs the per-sample gradients,
and the patches of the whole batch are ``prod(kernel) / prod(stride)`` times its input.
:func:`chunked_diagonal` unfolds and contracts a chunk of samples at a time, with the
chunk size from a memory bound (:func:`diagonal_chunk`): the whole batch at once where it
fits (no extra calls for small inputs).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .layers import Call, LayerRule

#: The memory bound of a layer's Fisher diagonal with shared positions (convolutions),
#: in elements: the temporaries of one chunk of samples (unfolded patches with the bias
#: column, the gradients in the GEMM's layout, the per-sample gradients; see
#: :func:`diagonal_chunk`) stay within ``max(DIAGONAL_CHUNK_ELEMENTS,
#: DIAGONAL_CHUNK_SHARE * (numel(x) + numel(g)))``, ``x`` and ``g`` the layer's inputs
#: and output gradients (alive anyway): the statistics add at most half the memory of the
#: layer's own tensors, and small inputs are one chunk (no extra calls). The share was 1.0
#: until 2026-11-27: a DiagonalNaturalGradient step on benchmarks/gpu.py's VGG at batch
#: 256 peaked in one chunk's per-sample weight gradients (66.6 MB) at 459.8 MB of live
#: tensors, over issue 17's budget (AdamW's 352.2 + 3x the diagonals' 19.2 = 409.7);
#: with 0.5, 407.0 MB, at the same step time (benchmarks/step_memory.py, docs).
DIAGONAL_CHUNK_ELEMENTS = 2**16
DIAGONAL_CHUNK_SHARE = 0.5
#: The floor of the Kronecker statistics' bound (:func:`kfac_chunk`), in elements: their
#: temporaries are the patches alone (no per-sample gradients), and a layer whose patches
#: of the whole batch fit in ``2**20`` elements (4 MiB in float32) takes them at once.
#: Cutting such a batch saves little memory and costs one full ``D x D`` GEMM output per
#: chunk (a ResNet-18 layer with 1x1 maps: three ``1152 x 1152`` products instead of one).
KFAC_CHUNK_ELEMENTS = 2**20
#: The same floor on CUDA, ``2**22`` elements (16 MiB in float32): there each chunk is a
#: round of a dozen host-bound calls (the unfold, the bias column, the GEMMs, the sums)
#: whose kernels take microseconds, and a GPU's memory is not the bound. ResNet-18 at
#: width 64 and batch 128 (benchmarks/resnet_step.py) cuts its 18 chunked layers into 41
#: chunks per statistics step with the CPU's floor (``layer1``'s patches of 128 samples
#: are 3.6M elements: 4 chunks of 37 samples), into 18 (one per layer) with this one; a
#: layer whose inputs are large (gpu.py's VGG at batch 256) is bound by
#: ``KFAC_CHUNK_SHARE`` as before.
KFAC_CHUNK_ELEMENTS_CUDA = 2**22
#: The share of the Kronecker statistics' bound (:func:`kfac_chunk`): their patches take
#: at most ``KFAC_CHUNK_SHARE * (numel(x) + numel(g))`` elements. Half of the diagonal's
#: share: a curvature backward of its own (MC, type-2) folds the layers while the
#: forward's whole graph is alive, where a chunk the size of a large layer's input and
#: output gradient was a fifth of the step's peak (benchmarks/gpu.py's VGG at batch 256,
#: KFAC mc: 683.21 -> 612.30 MiB counted on the CPU; its patches, 604 MB at once, in 10 chunks
#: instead of 5: the same GEMMs, each on 28 samples' 28,672 rows instead of 56's).
KFAC_CHUNK_SHARE = 0.5
#: The floor of EKFAC's eigenvalue corrections' bound (:func:`correction_chunk`), in
#: elements: a sample's temporaries include its rotated per-sample gradient
#: ``K C D_out D``, so under the diagonal's floor (``2**16``) a layer with ``D_out D``
#: above it went one sample at a time (ResNet-18's last stages: 128 chunks per layer and
#: step). ``2**20`` elements (4 MiB in float32) take a few dozen such samples at once
#: (``2**22`` was faster still but raised the peak of ``ekfac()`` on a small CNN).
CORRECTION_CHUNK_ELEMENTS = 2**20
#: The same floor on CUDA: its small batched GEMMs of a few samples per chunk run far
#: below the device's throughput (EKFAC's step on gpu.py's VGG-like CNN at batch 256, on
#: an H100: 343 ``bmm`` calls per step; floor ``2**20`` / ``2**24`` / ``2**26`` / ``2**28``:
#: 71.0 / 67.4 / 63.7 / 61.7 ms per step, peak 891 / 889 / 891 / 1205 MiB). ``2**26``
#: elements are at most 256 MiB of float32 temporaries.
CORRECTION_CHUNK_ELEMENTS_CUDA = 2**26
#: Whether :func:`direct_diagonal` takes a rule's direct path (convolutions: per-sample
#: weight gradients in one kernel call, no unfolding); ``False``: the unfolded path.
DIRECT_DIAGONAL = True


def expanded_diagonal(a: Tensor, g: Tensor) -> Tensor:
    """``sum_{k,n} (sum_s g a^T)^2`` ``[C, D_out, D]``; ``(g^2)^T (a^2)`` without sharing."""
    if a.shape[1] == 1 and a.shape[2] == 1:  # one position, one group: one plain GEMM
        g2 = (
            g.pow(2).sum(0).reshape(-1, g.shape[-1])
            if g.shape[0] > 1
            else g.reshape(-1, g.shape[-1]).pow(2)
        )
        # one batched GEMM: a [1, D_out, D] tensor of its own (an unsqueezed product would
        # be a view, which the statistics' flush selects into a copy instead of zeroing)
        return torch.bmm(g2.mT.unsqueeze(0), a.reshape(1, -1, a.shape[-1]).pow(2))
    if a.shape[1] == 1:
        return torch.einsum("knco,nci->coi", g[:, :, 0].pow(2), a[:, 0].pow(2))
    d = None
    N = a.shape[0]
    chunk = max(1, 2**22 // max(1, g.shape[0] * g[0, 0, 0].numel() * a.shape[-1]))
    for i in range(0, N, chunk):
        gr = torch.einsum("knsco,nsci->kncoi", g[:, i : i + chunk], a[i : i + chunk])
        part = gr.pow_(2).sum((0, 1))  # (squared in place: one chunk-sized temporary)
        d = part if d is None else d + part
    return d


def diagonal_chunk(rule: LayerRule, module: nn.Module, calls: Sequence[Call]) -> Optional[int]:
    """Samples per chunk of the layer's Fisher diagonal, or ``None`` for the whole batch.

    For a rule with :meth:`~curvature.layers.LayerRule.expanded_shape` ``(N, S, C, D,
    D_out)``, the temporaries of one sample are ``S C (2 D + K D_out)`` (the patches, a
    copy with the bias column, the ``K`` gradients in the GEMM's layout) plus, with
    several positions (``S > 1``), ``K C D_out D`` (the per-sample gradients; with one
    position :func:`expanded_diagonal` is one GEMM of the squares, without them); chunks
    hold as many samples as the bound (:data:`DIAGONAL_CHUNK_ELEMENTS`) takes, at least
    one. ``None`` when the whole batch fits (or the rule cannot say).
    """
    return samples_per_chunk(
        rule,
        module,
        calls,
        lambda S, C, D, D_out, K: S * C * (2 * D + K * D_out) + (S > 1) * K * C * D_out * D,
    )


def samples_per_chunk(
    rule: LayerRule,
    module: nn.Module,
    calls: Sequence[Call],
    per_sample,
    floor: Optional[int] = None,
    share: Optional[float] = None,
):
    """Samples per chunk under the bound ``max(floor, share * (numel(x) + numel(g)))``
    (``floor`` default :data:`DIAGONAL_CHUNK_ELEMENTS`, ``share`` default
    :data:`DIAGONAL_CHUNK_SHARE`),
    ``per_sample(S, C, D, D_out, K)`` the temporaries of one sample (elements) from the
    rule's :meth:`~curvature.layers.LayerRule.expanded_shape` and the pulled vectors
    ``K``; at least one; ``None`` when the whole batch fits or the rule cannot say.
    """
    get = getattr(rule, "expanded_shape", None)
    shape = None if get is None or not calls or calls[0].grads is None else get(module, calls)
    if shape is None:
        return None
    N, S, C, D, D_out = shape
    x, g = calls[0].args[0], calls[0].grads[0]
    K = g.shape[: g.dim() - x.dim()].numel()
    chunk = max(1, _bound(calls, floor, share) // max(1, per_sample(S, C, D, D_out, K)))
    return chunk if chunk < N else None


def direct_diagonal(rule: LayerRule, module: nn.Module, calls: Sequence[Call]):
    """The layer's Fisher diagonal ``{"": [C, D_out, D]}`` from the rule's direct path
    (a convolution's per-sample weight gradients in one kernel call per chunk of samples,
    without unfolding), or ``None`` where the rule has none (the general path then).

    The per-sample gradients of a chunk stay within :func:`diagonal_chunk`'s bound
    (``max(DIAGONAL_CHUNK_ELEMENTS, DIAGONAL_CHUNK_SHARE * (numel(x) + numel(g)))``); they
    are fewer elements per sample than the unfolded path's temporaries (which hold them as
    well as the patches), so this path takes no more chunks and no more memory, and one
    call per chunk instead of an unfold, a bias column and an ``einsum``.
    """
    get = getattr(rule, "direct_diagonal", None) if DIRECT_DIAGONAL else None
    if get is None or not calls or calls[0].grads is None:
        return None
    d = get(module, calls, _bound(calls))
    return None if d is None else {"": d}


def _bound(
    calls: Sequence[Call], floor: Optional[int] = None, share: Optional[float] = None
) -> int:
    """``max(floor, share * (numel(x) + numel(g)))``, ``floor`` default
    :data:`DIAGONAL_CHUNK_ELEMENTS`, ``share`` default :data:`DIAGONAL_CHUNK_SHARE`.
    """
    held = sum(c.args[0].numel() + c.grads[0].numel() for c in calls)
    floor = DIAGONAL_CHUNK_ELEMENTS if floor is None else floor
    share = DIAGONAL_CHUNK_SHARE if share is None else share
    return max(floor, int(share * held))


def _sample_slice(calls: Sequence[Call], start: int, stop: int) -> List[Call]:
    """The calls restricted to samples ``start:stop`` (first input, output gradients)."""
    out = []
    for c in calls:
        x = c.args[0]
        lead = c.grads[0].dim() - x.dim()  # the leading [K] of batched pulls
        grads = [g.narrow(lead, start, stop - start) for g in c.grads]
        out.append(replace(c, args=(x[start:stop], *c.args[1:]), grads=grads, plain=None))
    return out


def chunked_diagonal(rule: LayerRule, module: nn.Module, calls, chunk: int) -> Dict[str, Tensor]:
    """:func:`expanded_diagonal` of the layer's blocks summed over chunks of ``chunk``
    samples (the last one ragged): the expanded operands (unfolded patches) of one chunk
    alive at a time. The same sums as the whole batch at once, in another order.

    Returns:
        Block suffix to ``[C, D_out, D]``.

    """
    N = calls[0].args[0].shape[0]
    out: Dict[str, Tensor] = {}
    for start in range(0, N, chunk):
        part = _chunk_diagonal(rule, module, _sample_slice(calls, start, min(N, start + chunk)))
        for s, d in part.items():
            out[s] = out[s].add_(d) if s in out else d
    return out


def _chunk_diagonal(rule: LayerRule, module: nn.Module, calls) -> Dict[str, Tensor]:
    """The expanded diagonals of one chunk (its operands freed on return)."""
    return {s: expanded_diagonal(a, g) for s, (a, g) in rule.expanded_blocks(module, calls).items()}


def kfac_chunk(rule: LayerRule, module: nn.Module, calls: Sequence[Call]) -> Optional[int]:
    """Samples per chunk of the layer's Kronecker statistics, or ``None`` for the whole batch.

    The statistics need no per-sample gradients: a sample's temporaries are its unfolded
    patches, ``S C D`` (a convolution's rule adds the bias column without copying them;
    other rules' copies with the bias column fit within the bound's factor 2); the bound is
    ``max(KFAC_CHUNK_ELEMENTS, KFAC_CHUNK_SHARE * (numel(x) + numel(g)))``: the
    statistics add at most half the memory of the layer's own inputs and output gradients,
    or take at most :data:`KFAC_CHUNK_ELEMENTS` elements (the patches of a small layer's
    whole batch, one GEMM; on CUDA :data:`KFAC_CHUNK_ELEMENTS_CUDA`).
    """
    return samples_per_chunk(
        rule,
        module,
        calls,
        lambda S, C, D, D_out, K: S * C * D,
        floor=KFAC_CHUNK_ELEMENTS_CUDA if _on_cuda(calls) else KFAC_CHUNK_ELEMENTS,
        share=KFAC_CHUNK_SHARE,
    )


def _on_cuda(calls: Sequence[Call]) -> bool:
    """Whether the layer's calls ran on CUDA (the device of the first call's first output:
    a layer may take its input by keyword).
    """
    return bool(calls) and bool(calls[0].out_meta) and calls[0].out_meta[0][2].type == "cuda"


def chunked_kfac_factors(rule: LayerRule, module: nn.Module, calls, approx: str, with_g: bool):
    """``rule.kfac_factors`` summed over chunks of :func:`kfac_chunk` samples (the one site
    of the optimizers' and :func:`curvature.kfac`'s Kronecker statistics).

    The same sums as the whole batch at once (``A_sum``, ``G_sum`` and the counts add
    over samples, for ``"expand"`` and ``"reduce"``), with the unfolded patches of one
    chunk alive at a time: a convolution's patches are ``prod(kernel) / prod(stride)``
    times its input (a VGG layer at batch 256: 0.6 GB, twice with the bias column).
    """
    chunk = kfac_chunk(rule, module, calls)
    if chunk is None:
        return rule.kfac_factors(module, calls, approx, with_g)
    N = calls[0].args[0].shape[0]
    out: Dict[str, list] = {}
    for start in range(0, N, chunk):
        part = rule.kfac_factors(
            module, _sample_slice(calls, start, min(N, start + chunk)), approx, with_g
        )
        if part is None:
            return None
        for s, (A, G, count) in part.items():
            if s not in out:
                out[s] = [A, G, count]
                continue
            acc = out[s]
            acc[0] = acc[0].add_(A)
            acc[1] = None if G is None else acc[1].add_(G)
            acc[2] += count
    return {s: tuple(v) for s, v in out.items()}


def correction_chunk(rule: LayerRule, module: nn.Module, calls: Sequence[Call]) -> Optional[int]:
    """Samples per chunk of EKFAC's eigenvalue corrections, or ``None`` for the whole batch.

    A sample's temporaries: the patches, their copy with the bias column and their
    rotation (``3 S C D``), the rotated gradients (``K S C D_out``) and, where a sample
    has several positions (``S > 1``), the rotated per-sample gradient (``K C D_out D``;
    with one position the corrections are one GEMM of the squared rotations, no
    per-sample matrix: a padded 3x3 convolution on 1x1 maps, ResNet-18's last stage on
    28x28 inputs, is one chunk instead of 22 of 6 samples, each a GEMM through the whole
    ``D x D`` basis); the bound is ``max(CORRECTION_CHUNK_ELEMENTS, DIAGONAL_CHUNK_SHARE
    * (numel(x) + numel(g)))`` (on CUDA the floor :data:`CORRECTION_CHUNK_ELEMENTS_CUDA`).
    """
    return samples_per_chunk(
        rule,
        module,
        calls,
        lambda S, C, D, D_out, K: (3 * S * C * D + K * S * C * D_out) + (S > 1) * K * C * D_out * D,
        floor=CORRECTION_CHUNK_ELEMENTS_CUDA if _on_cuda(calls) else CORRECTION_CHUNK_ELEMENTS,
    )


def summed_over_chunks(fn, calls: Sequence[Call], chunk: Optional[int]) -> Dict[str, Tensor]:
    """``fn(calls)`` (a dict of tensors that add over samples) summed over chunks of
    ``chunk`` samples (``None``: the whole batch at once).
    """
    if chunk is None:
        return fn(calls)
    N = calls[0].args[0].shape[0]
    out: Dict[str, Tensor] = {}
    for start in range(0, N, chunk):
        for k, v in fn(_sample_slice(calls, start, min(N, start + chunk))).items():
            out[k] = out[k].add_(v) if k in out else v
    return out


def chunked_corrections(name: str, module: nn.Module, rule: LayerRule, calls, bases):
    """EKFAC's eigenvalue corrections of a layer (``layer_stats.eigenvalue_corrections``,
    block name to ``[C, D_out, D]``) summed over chunks of :func:`correction_chunk`
    samples: for a convolution, the patches of one chunk alive at a time.

    The one site of the optimizers (``EKFAC``) and of :func:`curvature.ekfac`.
    """
    from .layer_stats import eigenvalue_corrections  # (layer_stats imports this module)

    return summed_over_chunks(
        lambda c: eigenvalue_corrections(name, module, rule, c, bases),
        calls,
        correction_chunk(rule, module, calls),
    )
