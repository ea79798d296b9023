"""The check that every layer's sample axis holds the loss's samples.

Per-sample quantities (Fisher and GGN diagonals, EKFAC's eigenvalue corrections) square
each sample's gradient: ``sum_n (grad_n)^2`` with ``grad_n`` summed over what the layer
shares within sample ``n`` (its positions, ``[N, K, D]``). They are the loss's only when
each layer's sample axis (axis 0 of its input by default; a rule says otherwise, e.g.
``nn.LSTM(batch_first=False)``) holds the same ``N`` samples as the loss. Two ways to
break that, both ordinary:

- **A layer that splits samples** (more entries than the loss has samples): a batch
  folded into its rows (``x.reshape(N * K, d)`` before an ``nn.Linear``, a
  time-distributed convolution on ``[N * T, C, H, W]``). Its squares miss the cross
  terms of the ``K`` rows of one sample: wrong for every Fisher type. Refused.
- **A loss that splits the layer's samples** (fewer entries than the loss has samples):
  outputs flattened to ``[N * T, C]`` before the loss while the layers see ``[N, T,
  ...]``. Each square then sums several of the loss's samples first: for ``"mc"`` and
  ``"rademacher"``, whose draws are independent with mean zero per loss sample, the
  cross terms vanish in expectation (an unbiased, noisier estimate); for ``"type-2"``
  (the loss Hessian's square-root columns, placed on every sample at once) and the
  empirical Fisher (the gradients themselves) they do not. The curvature functions
  refuse it; the optimizers warn once (a sequence-level estimate can still
  precondition; it is not the Fisher of the loss's samples).

The Kronecker factors of KFAC need no per-sample gradients, but a layer sample that
covers several loss samples (flattened logits of a model that mixes positions, a
batch-free input broadcast over the batch) sums their type-2 columns or gradients before
the outer product: ``kfac()`` refuses it and the optimizers warn once (the type-2 Fisher;
a provably position-wise model, :func:`curvature.positionwise.model_layout`, is exact
there). Folded rows are exact under the pulled Fisher types; under the
empirical Fisher a layer whose rows fold ``K`` rows of each sample is normalized by its
forward's samples (:func:`user_samples`: the factors of the same layer on ``[N, K,
d]``), any other mismatch by the layer's own entries, which :func:`normalization_warning`
reports once.
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from torch import Tensor, nn

from .warn import warn

Layer = Tuple[str, nn.Module, Any, Sequence[Any]]


def check_sample_axis(
    who: str,
    samples: int,
    layers: Sequence[Layer],
    source: str,
    *,
    independent: bool = False,
    strict: bool = True,
    quiet: bool = False,
    finer_ok: bool = False,
) -> bool:
    """Check that every call of ``layers`` has ``samples`` entries on its sample axis.

    Args:
        who: The caller, named in the messages (``"diag_ggn"``, ``"EKFAC"``).
        samples: ``N``, the samples of the loss (or of the model output).
        layers: ``(name, module, rule, calls)`` of the recorded layers.
        source: What ``samples`` was read from (for the messages).
        independent: The pulled vectors are independent, mean-zero draws per loss
            sample (``"mc"``, ``"rademacher"``): a layer with fewer entries passes.
        strict: Raise for a layer with fewer entries too (else one warning).
        quiet: No warning (one was given already); errors are still raised.
        finer_ok: A layer with more entries passes (Kronecker factors: a folded layer's
            rows are shared positions, normalized by the loss's samples).

    Returns:
        Whether it warned.

    Raises:
        ValueError: A layer with more entries than ``samples`` (or, ``strict``, fewer
            where not ``independent``).

    """
    for name, module, rule, calls in layers:
        for call in calls:
            n = rule.batch_size(module, call)
            if n == samples or (n < samples and independent) or (n > samples and finer_ok):
                continue
            if strict or n > samples:
                if finer_ok:  # (n < samples: Kronecker factors of a coarser layer)
                    raise ValueError(coarse_kronecker_message(who, name, n, samples, source))
                raise ValueError(sample_axis_message(who, name, n, samples, source))
            if quiet:
                continue
            warn(
                f"{who}: layer {name!r} has {n} entries on its sample axis where {source} "
                f"has {samples} samples: its per-sample statistics square gradients summed "
                "over several of the loss's samples (e.g. a sequence's positions, with "
                "outputs flattened to [N * T, C] before the loss; or one loss over the "
                "outputs of several model calls), a coarser curvature than the loss's. Give "
                "the loss unflattened outputs (e.g. [N, C, T] to CrossEntropyLoss) and call "
                "it once per model call, or use fisher='mc', whose independent draws per "
                "sample make those sums unbiased."
            )
            return True
    return False


def sample_axis_message(who: str, name: str, n: int, samples: int, source: str) -> str:
    """The ``ValueError`` of :func:`check_sample_axis`."""
    return (
        f"{who}: layer {name!r} has {n} entries on its sample axis where {source} has "
        f"{samples} samples, so its rows are not the loss's samples (a batch folded into "
        "rows, e.g. x.reshape(N * K, d) before the layer, sequence-first [T, N, d] inputs, "
        "or outputs flattened to [N * T, C] before the loss) and per-sample quantities "
        "(Fisher / GGN diagonals, EKFAC's eigenvalue corrections) would be silently "
        "wrong. Keep the samples on axis 0 of every layer's input and of the loss input: "
        "pass [N, K, d] to the layer (its weight is then shared over K) and give the loss "
        "unflattened outputs (e.g. [N, C, T] to CrossEntropyLoss). KFAC's Kronecker "
        "factors of a folded layer need no per-sample gradients."
    )


def coarse_kronecker_message(who: str, name: str, n: int, samples: int, source: str) -> str:
    """The ``ValueError`` of ``kfac()`` for a layer coarser than the samples."""
    return (
        f"{who}: layer {name!r} has {n} entries on its sample axis where {source} has "
        f"{samples} samples: each of its samples covers several of the loss's (outputs "
        "flattened to [N * T, C] while the layers see [N, T, ...], or a batch-free input "
        "broadcast over the batch), so their type-2 columns or gradients are summed before "
        "the outer product and its Kronecker factors are wrong unless no position sees "
        "another's. Give the loss unflattened outputs (e.g. [N, C, T] to "
        "CrossEntropyLoss), or use fisher='mc', whose independent draws make the sums "
        "unbiased."
    )


def user_samples(n: int, tag: Any) -> int:
    """``N`` of a layer's contribution from the user's backward: its own ``n`` entries, or
    its forward's ``N`` (``tag``: ``Call.forward``) where the layer's rows fold ``K > 1``
    rows of each sample (``n = K N``): its empirical ``G`` then equals that of the same
    layer on ``[N, K, d]`` (the Kronecker factors need no per-sample grouping).
    """
    N = None if tag is None else tag[1]
    return N if N and n > N and n % N == 0 else n


def normalization_warning(who: str, samples: int, layers: Sequence[Layer], source: str) -> bool:
    """Warn once (returns ``True``) if a layer's entries on its sample axis are not
    ``samples`` and not a multiple of them (:func:`user_samples`): KFAC's empirical ``G``
    is then normalized by the layer's own entries.
    """
    for name, module, rule, calls in layers:
        for call in calls:
            n = rule.batch_size(module, call)
            if n % samples:  # (neither the samples nor K rows of each: user_samples)
                warn(
                    f"{who}(fisher='empirical'): layer {name!r} has {n} entries on its "
                    f"sample axis where {source} has {samples} samples: its G is "
                    f"normalized by its own {n}, {n}/{samples} times that of the loss's "
                    "samples (e.g. logits flattened to [N * T, C] while the layers see "
                    "[N, T, ...]). Keep the samples on axis 0 of every layer's input and "
                    "of the loss input, or use fisher='mc' / 'type-2', which normalize by "
                    "the loss's samples."
                )
                return True
    return False


def check_layer_samples(
    who: str,
    fisher: str,
    per_sample: bool,
    user: bool,
    pulled: int,
    layer: Layer,
    warned: bool,
    positionwise: bool = False,
) -> bool:
    """An optimizer's check of one forward's calls of a layer: whether it has warned (now,
    or before: ``warned``, then only errors are raised).

    ``user``: the calls' gradients are the user's backward (empirical), checked against
    axis 0 of their forward's model output (``Call.forward``; untagged calls are not
    checked); else against ``pulled``, the samples of the pulled loss input.
    ``per_sample``: the optimizer squares per-sample gradients (:func:`check_sample_axis`,
    a ``ValueError`` or one warning); else (KFAC) a pulled type-2 layer coarser than the
    samples warns once unless the model is ``positionwise``, and the empirical ``G``'s
    normalization is reported (:func:`normalization_warning`).
    """
    calls = layer[3]
    N = (calls[0].forward or (0, None))[1] if user else pulled
    if N is None or (warned and not per_sample):
        return warned
    where = "the model output" if user else "the loss input"
    if not per_sample and not user:  # KFAC, pulled: type-2 columns summed over samples
        if positionwise or fisher != "type-2":  # (no position sees another's columns;
            return warned  # independent draws: unbiased)
        kw = dict(strict=False, finer_ok=True)
        return check_sample_axis(who, N, [layer], where, **kw)
    if not per_sample:
        return normalization_warning(who, N, [layer], where)
    draws = not user and fisher in ("mc", "rademacher")
    kw = dict(independent=draws, strict=False, quiet=warned)
    return check_sample_axis(who, N, [layer], where, **kw) or warned


def tag_forward(calls: Any, serial: int, output: Any) -> None:
    """Tag the untagged calls of ``calls`` (lists of ``Call``) with ``Call.forward =
    (serial, N)``, ``N`` axis 0 of the model ``output`` (``None``: not a tensor, 0-d).
    """
    N = output.shape[0] if isinstance(output, Tensor) and output.dim() else None
    for cs in calls:
        for c in cs:
            if c.forward is None:
                c.forward = (serial, N)


def by_forward(calls: Sequence[Any]) -> List[List[Any]]:
    """The calls grouped by the training forward that recorded them (``Call.forward``'s
    serial; untagged calls one group), in order: each forward folds with its own ``N``.
    """
    groups: Dict[Any, List[Any]] = {}
    for c in calls:
        groups.setdefault(None if c.forward is None else c.forward[0], []).append(c)
    return list(groups.values())


__all__ = [
    "by_forward",
    "check_layer_samples",
    "check_sample_axis",
    "coarse_kronecker_message",
    "normalization_warning",
    "sample_axis_message",
    "tag_forward",
    "user_samples",
]
