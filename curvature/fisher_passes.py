"""The backward passes of the curvature functions: a forward per batch, the Fisher's pull.

:func:`curvature.kfac`, :func:`curvature.ekfac` and :func:`curvature.diag_ggn` iterate over
:func:`fisher_passes`: for each batch one captured forward and one pull of the Fisher
type's vectors (:func:`curvature.losses.backprop_sources`) through it, after which the
capture holds each layer's inputs ``a`` and output gradients ``g``.

Host work per batch (issue 17: on a GPU these functions are bound by it): the empirical
Fisher's vectors ``sqrt(R) grad_f l_n`` are not formed (one backward from ``sum_n l_n``
seeded with ``sqrt(R)`` gives the same ``g``, equal to rounding, without a second
backward through the loss), and the ignored targets of a mean CrossEntropy are read
once, after the last batch, instead of after each forward (no stall of the device's
queue in between).
"""

from __future__ import annotations

import math

import torch

from .capture import capture, isolated
from .dense import batch_weights, batches, empty_batch, warn_random_forward
from .early_fold import FoldPlan, early_pays
from .layers.select import unwrap_model
from .losses import (
    backprop_sources,
    check_ignored,
    hessian_sqrt_chunks,
    ignored_targets,
    per_sample_losses,
    reduction_scale,
    require_tensor_output,
)
from .options import FisherType
from .rng import SamplingGenerators
from .sample_axis import check_sample_axis

#: Entries of the type-2 vectors pulled at once by :func:`diag_ggn` (a sum over them):
#: per-position losses on ``[N, T, C]`` have ``T C`` vectors of ``N T C`` entries.
MAX_SOURCES_NUMEL = 1 << 26


def fisher_passes(
    model,
    loss_func,
    data,
    fisher,
    mc_samples,
    seed,
    caller="kfac",
    chunked=False,
    fold=None,
    pays=early_pays,
    per_sample=False,
):
    """Yield ``(weight, Capture)`` per batch after pulling the Fisher's vectors.

    Empty batches (``N = 0``) are skipped; data without any sample is a ``ValueError``.
    ``chunked`` (type-2, for sums over the vectors): yield once per chunk of at most
    :data:`MAX_SOURCES_NUMEL` entries of vectors. Empirical: one backward from ``sum_n
    l_n`` seeded with ``sqrt(R)``. Ignored targets (mean CE) are read once, at the end.

    ``fold(weight, capture, name, module, rule, calls)``: with it, a layer that ``pays``
    accepts (default :func:`~curvature.early_fold.early_pays`: its output gradient
    outweighs its Kronecker statistics) is handed to it inside the pull (its gradients
    set, the calls removed from the capture; :mod:`curvature.early_fold`), the others stay
    for the caller (:meth:`~curvature.capture.Capture.reached`; layers with a tied
    parameter always). Chunked pulls take nothing early (the calls serve every chunk).
    """
    model = unwrap_model(model)  # (a compiled or DDP model: the plain one, eagerly)
    warn_random_forward(model, caller)
    draws = fisher in (FisherType.MC, FisherType.RADEMACHER)  # on out's device, seeded
    generator = SamplingGenerators(torch.Generator().manual_seed(seed)) if draws else None
    ignored, kw = [], dict(check_targets=False)
    bs = [(X, y) for X, y in batches(data) if not empty_batch(X, y)]
    if not bs:
        raise ValueError(
            f"{caller}(data): the batch is empty (N = 0; every batch of data has no "
            "samples), so there is no curvature to estimate. Pass at least one sample."
        )
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        with capture(model) as cap, isolated(cap):
            out = model(X)
        require_tensor_output(out, caller)
        if per_sample and out.dim():  # "kronecker": only layers coarser than the samples
            axis = dict(independent=draws, finer_ok=per_sample == "kronecker")
            check_sample_axis(caller, out.shape[0], cap.active(), "the model output", **axis)
        plan = None if fold is None else _plan(fold, pays, w, cap)
        ignored.append(ignored_targets(loss_func, y))
        many = out.dim() > 0 and math.prod(out.shape[1:]) * out.numel() > MAX_SOURCES_NUMEL
        if chunked and fisher == FisherType.TYPE2 and many:  # [K, *out] would not fit
            for V in hessian_sqrt_chunks(loss_func, out, y, MAX_SOURCES_NUMEL, **kw):
                cap.pull(out, V, is_grads_batched=True, retain_graph=True)
                yield w, cap
            continue
        if fisher == FisherType.EMPIRICAL:  # one backward from the losses: no V formed
            total = per_sample_losses(loss_func, out, y, **kw).sum()
            seed_ = total.new_full((1,), reduction_scale(loss_func, out.shape[0]) ** 0.5)
            cap.pull(total, seed_, is_grads_batched=True, retain_graph=False, fold=plan)
        elif fisher != FisherType.FORWARD_ONLY:
            V = backprop_sources(
                loss_func, out, y, fisher.value, mc_samples=mc_samples, **kw, generator=generator
            )
            cap.pull(out, V, is_grads_batched=True, retain_graph=False, fold=plan)
        yield w, cap
    check_ignored(loss_func, [] if fisher == FisherType.FORWARD_ONLY else ignored)


def _plan(fold, pays, w, cap) -> FoldPlan:
    """The :class:`FoldPlan` of one batch's pull: early where it pays and ``fold`` takes it."""
    sharing = cap.sharing()

    def worth(name, module, rule, call) -> bool:
        return not sharing.tied(name) and pays(name, module, rule, call)

    return FoldPlan(lambda *layer: fold(w, cap, *layer), take=True, worth=worth)
