"""Kronecker-factored curvature (KFAC) and its eigenvalue-corrected variant (EKFAC).

For a layer with weight ``W [D_out, D_in]`` (convolutions: ``[C_out, C_in / G * k]``
after unfolding) and bias, the bias is appended as a last input coordinate equal to 1,
and the layer's curvature block in the row-major order of ``[W | b]`` is approximated by

    kron(G, A),   A = 1/(N S) sum_{n,s} a a^T,   G = sum_{k,n,s} g g^T    ("expand")
                  A = 1/N sum_n abar abar^T,     G = sum_{k,n} gbar gbar^T ("reduce")

with ``abar`` the mean of ``a`` over the shared positions and ``gbar`` the sum of ``g``.
The ``g`` are backpropagated from the vectors of :func:`curvature.losses.backprop_sources`,
which carry the loss reduction: ``A`` holds the ``1/N``, ``G`` the loss scaling, so that
``kron(G, A)`` equals the GGN block in the exact cases (one datum; deep linear networks
with MSE; weight sharing with the matching setting; Eschenhagen et al., 2023).

Grouped convolutions have one ``(A_c, G_c)`` pair per group (factors ``[G, D, D]``).
Layers without Kronecker structure (normalization layers, the ``torch.func`` fallback)
get their exact block ``sum_{n,k} vec(grad_nk) vec(grad_nk)^T``, stored as ``G`` with
``A = [[1]]``. A block with a factor larger than ``max_factor_size`` (``D`` or ``D_out``)
keeps that factor as its diagonal (:class:`~curvature.blocks.OneSidedBlock`, the large
factor never formed; as in the optimizers), or with ``large_factors="per_sample_diagonal"``
is a :class:`~curvature.blocks.DiagonalBlock`, the per-sample Fisher diagonal. EKFAC
(George et al., 2018) keeps KFAC's eigenbasis and replaces the eigenvalues by the second
moments of the per-sample (per-vector) gradients in it.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, List, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .block_indices import BlockIndices, add_linear_block, block_index, layer_offsets
from .blocks import (
    DiagonalBlock,
    EigenCorrectedBlock,
    KroneckerBlock,
    OneSidedBlock,
    eigendecompositions,
    onesided_sides,
)
from .dense import Data, batches
from .early_fold import large_gradient
from .fisher_passes import MAX_SOURCES_NUMEL, fisher_passes  # noqa: F401 (re-export)
from .layer_diagonal import chunked_corrections, chunked_kfac_factors
from .layer_stats import (
    MAX_EXACT_BLOCK,
    block_name,
    exact_factors,
    fisher_diagonal,
    large_blocks,
    large_statistics,
    layer_numel,
    layer_positions,
    tied_fisher_diagonal,
)
from .layers.registry import library_method
from .layout import ParamLayout, tie_hint
from .losses import check_fisher, check_loss
from .options import (
    DampingMode,
    FisherType,
    KFACApproxType,
    Unsupported,
    check_max_factor_size,
    choice,
    renamed,
)
from .positionwise import fold_positions, model_layout
from .warn import warn

KFAC_APPROX = tuple(m.value for m in KFACApproxType)


class KFACApprox:
    """Block-diagonal Kronecker-factored curvature of a model.

    Attributes:
        blocks: The layers' :class:`~curvature.blocks.KroneckerBlock` (for :func:`ekfac`
            :class:`~curvature.blocks.EigenCorrectedBlock`), and a
            :class:`~curvature.blocks.OneSidedBlock` (or, with
            ``large_factors="per_sample_diagonal"``, a :class:`~curvature.blocks.DiagonalBlock`)
            for each block whose Kronecker factor exceeds ``max_factor_size``.
        param_names: Trainable parameter names in ``model.parameters()`` order.
        uncovered: Names of trainable parameters no block covers (zero rows and
            columns in :meth:`to_dense`).
        layout: The :class:`~curvature.layout.ParamLayout` of the flat vectors.

    """

    def __init__(
        self,
        blocks: List[Union[KroneckerBlock, DiagonalBlock]],
        layout: ParamLayout,
        uncovered: List[str],
    ):
        self.blocks = blocks
        self.layout = layout
        self.param_names = list(layout.names)
        self.num_params = layout.numel
        self.uncovered = uncovered
        ref = layout.params[0]
        self._dtype, self._device = ref.dtype, ref.device

    @property
    def factors(self) -> Dict[str, Tuple[Tensor, Tensor]]:
        """Block name to ``(A, G)``; ``[D, D]`` each, or ``[groups, D, D]`` if grouped.

        Only the full Kronecker blocks: a block over ``max_factor_size`` is not here.
        """
        out = {}
        for b in self.blocks:
            if not isinstance(b, (DiagonalBlock, OneSidedBlock)):
                out[b.name] = (b.A[0], b.G[0]) if b.A.shape[0] == 1 else (b.A, b.G)
        return out

    @property
    def diagonals(self) -> Dict[str, Tensor]:
        """Block name to the diagonal ``d`` of a :class:`~curvature.blocks.DiagonalBlock`.

        ``[D_out, D]`` laid out like the layer's matrix ``[W | b]`` (``[groups, D_out, D]``
        if grouped): entry ``(o, i)`` is ``sum_{k,n} grad_nk[o, i]^2``, the exact Fisher
        diagonal of that entry (``fisher="forward-only"``: ``A[i, i]``, the diagonal of
        ``kron(I, A)``).
        """
        out = {}
        for b in self.blocks:
            if isinstance(b, DiagonalBlock):
                d = b.d.view(b.shape)
                out[b.name] = d[0] if len(b.shape) == 3 and b.shape[0] == 1 else d
        return out

    def _uncovered_count(self) -> int:
        covered = sum(b.index.numel() for b in self.blocks)
        return self.num_params - covered

    def matvec(self, v: Sequence[Tensor]) -> List[Tensor]:
        """The approximation times ``v`` (a list shaped like the parameters)."""
        flat = self.layout.flatten(v)
        out = torch.zeros_like(flat)
        for b in self.blocks:
            out[b.index] = b.matvec(flat[b.index])
        return self.layout.unflatten(out)

    def inverse_matvec(
        self, v: Sequence[Tensor], damping: float, *, mode: Union[str, DampingMode] = "exact"
    ) -> List[Tensor]:
        """``(approx + damping I)^{-1} v``.

        Args:
            v: A list shaped like the parameters.
            damping: ``lambda > 0``.
            mode: ``"exact"`` (damping added to the Kronecker eigenvalues, the exact
                inverse of ``kron(G, A) + lambda I``), ``"pi"`` (Tikhonov damping of
                each factor with the pi heuristic of Martens & Grosse, 2015) or
                ``"per_factor"`` (``(A + lambda I) x (G + lambda I)``); the last two for
                KFAC only, EKFAC is always exact. Diagonal blocks are always exact:
                ``v / (d + lambda)``.

        """
        if damping <= 0:
            raise ValueError(f"damping={damping} must be > 0.")
        mode = choice(DampingMode, mode, "inverse_matvec(mode")
        flat = self.layout.flatten(v)
        out = flat / damping  # uncovered parameters: (0 + lambda)^{-1}
        for b in self.blocks:
            out[b.index] = b.inverse_matvec(flat[b.index], damping, mode.value)
        return self.layout.unflatten(out)

    def to_dense(self) -> Tensor:
        """The block-diagonal ``[P, P]`` matrix (zero for uncovered parameters)."""
        P = self.num_params
        D = torch.zeros(P, P, dtype=self._dtype, device=self._device)
        for b in self.blocks:
            if isinstance(b, DiagonalBlock):  # no [P_b, P_b] temporary
                D[b.index, b.index] = b.d.to(D.dtype)
                continue
            dense = b.dense()
            for c in range(dense.shape[0]):
                ix = b.index[c].reshape(-1)
                D[ix.unsqueeze(1), ix.unsqueeze(0)] = dense[c].to(D.dtype)
        return D

    def trace(self) -> Tensor:
        """``tr`` of the approximation."""
        total = torch.zeros((), dtype=self._dtype, device=self._device)
        for b in self.blocks:
            total = total + b.trace().to(self._dtype)
        return total

    def logdet(self, damping: float) -> Tensor:
        """``log det(approx + damping I)`` over all trainable parameters."""
        if damping <= 0:
            raise ValueError(f"damping={damping} must be > 0.")
        total = torch.tensor(self._uncovered_count() * math.log(damping), dtype=self._dtype)
        total = total.to(self._device)
        for b in self.blocks:
            total = total + b.logdet(damping)
        return total


# -- collecting statistics ---------------------------------------------------------------
def _check_args(
    loss_func,
    fisher,
    kfac_approx,
    mc_samples,
    unsupported,
    on_unsupported,
    max_factor_size,
    caller,
    large_factors="diagonal_factor",
):
    """The validated arguments shared by :func:`kfac` and :func:`ekfac`."""
    if large_factors not in ("diagonal_factor", "per_sample_diagonal"):
        raise ValueError(
            f"{caller}(large_factors={large_factors!r}): 'diagonal_factor' (default) or "
            "'per_sample_diagonal'."
        )
    unsupported, arg = renamed(unsupported, on_unsupported, "unsupported", "on_unsupported", caller)
    check_max_factor_size(max_factor_size, caller)
    check_loss(loss_func)
    fisher = check_fisher(fisher)
    kfac_approx = choice(KFACApproxType, kfac_approx, f"{caller}(kfac_approx")
    if not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples={mc_samples!r} must be a positive integer.")
    unsupported = choice(
        Unsupported,
        unsupported,
        f"{caller}({arg}",
        allowed=(Unsupported.WARN, Unsupported.ERROR),
    )
    return fisher, kfac_approx, unsupported


def kfac(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    *,
    fisher: str = "type-2",
    mc_samples: int = 1,
    kfac_approx: str = "expand",
    seed: int = 0,
    unsupported: Union[str, Unsupported] = "warn",
    on_unsupported: Union[str, None] = None,
    max_factor_size: int = 4096,
    large_factors: str = "diagonal_factor",
) -> KFACApprox:
    """KFAC of ``model`` on ``data`` (see the module docstring for the maths).

    Args:
        model: The model.
        loss_func: ``nn.CrossEntropyLoss``, ``nn.MSELoss`` or ``nn.BCEWithLogitsLoss``.
        data: ``(X, y)`` or an iterable of batches (their union is the data set).
        fisher: ``"type-2"``, ``"mc"``, ``"empirical"``, ``"rademacher"`` or
            ``"forward-only"`` (``G = I``).
        mc_samples: Samples per datum for ``"mc"`` and ``"rademacher"``.
        kfac_approx: ``"expand"`` or ``"reduce"`` for weight-sharing layers.
        seed: Seed of the generator for ``"mc"`` and ``"rademacher"``.
        unsupported: ``"warn"`` or ``"error"`` for trainable parameters no block
            covers (they stay in :meth:`KFACApprox.to_dense`'s order with zero blocks).
        on_unsupported: Deprecated name of ``unsupported``.
        max_factor_size: A block with a Kronecker factor larger than this (``D`` or
            ``D_out`` above it) keeps that factor as its diagonal, computed without
            forming it, and a warning names it; as in the optimizers. Raise it to keep
            such factors (memory ``D^2``, inversion ``D^3``).
        large_factors: Those blocks' structure: ``"diagonal_factor"`` (default; a
            :class:`~curvature.blocks.OneSidedBlock`, the small factor full; a layer
            without per-vector inputs and gradients keeps the per-sample diagonal) or
            ``"per_sample_diagonal"`` (a :class:`~curvature.blocks.DiagonalBlock` with the
            exact per-sample Fisher diagonal of its entries, in :attr:`KFACApprox.diagonals`).
            ``fisher="forward-only"``: always the diagonal of ``kron(I, A)``.

    Returns:
        A :class:`KFACApprox`.

    """
    fisher, kfac_approx, unsupported = _check_args(
        loss_func,
        fisher,
        kfac_approx,
        mc_samples,
        unsupported,
        on_unsupported,
        max_factor_size,
        "kfac",
        large_factors,
    )
    return _kfac(
        model,
        loss_func,
        data,
        fisher,
        mc_samples,
        kfac_approx,
        seed,
        unsupported,
        max_factor_size=max_factor_size,
        large_factors=large_factors,
    )


def _kfac(
    model,
    loss_func,
    data,
    fisher,
    mc_samples,
    kfac_approx,
    seed,
    unsupported,
    cls=None,
    *,
    max_factor_size: int = 4096,
    large_factors: str = "diagonal_factor",
):
    layout = ParamLayout.of(model)
    stats: Dict[Tuple[str, str], list] = {}
    diag_stats: Dict[Tuple[str, str], list] = {}  # [d_sum, count] of too-large blocks
    large: Dict[str, Dict[str, Tensor]] = {}
    layers: Dict[str, Tuple[nn.Module, object]] = {}
    skipped: Dict[str, str] = {}
    forward_only = fisher == FisherType.FORWARD_ONLY
    tied: Dict[str, str] = {}
    caller = "ekfac" if cls is EigenCorrectedBlock else "kfac"

    def fold_layer(w, name, module, rule, calls) -> None:  # (a layer without a tied parameter)
        layers[name] = (module, rule)
        if name not in large:  # from the shapes: no index built here
            large[name] = large_blocks(module, rule, max_factor_size)
        if large[name]:  # the large factors are never formed
            args = (name, layout, large[name], kfac_approx.value, not forward_only, w)
            sided = {s: onesided_sides(ix, max_factor_size) for s, ix in large[name].items()}
            sided = sided if large_factors == "diagonal_factor" else None
            res = large_statistics(rule, module, calls, *args, diag_stats, sided)
            if res is None:
                skipped[name] = f"factor > max_factor_size={max_factor_size}, forward-only"
                return
        else:
            res = chunked_kfac_factors(  # convolutions: a chunk of samples at a time
                rule, module, calls, kfac_approx.value, not forward_only
            )
        # new tensors of this call where the library made them (divided in place below)
        owned = res is not None and not large[name] and library_method(rule, "kfac_factors")
        if res is None:
            n_params = layer_numel(module, rule)
            if forward_only or n_params > MAX_EXACT_BLOCK:
                skipped[name] = (
                    "no Kronecker rule"
                    + (" (forward-only)" if forward_only else "")
                    + f", {n_params} parameters"
                )
                return
            res = exact_factors(rule, module, calls)
        for suffix, (A_sum, G_sum, count) in res.items():
            s = stats.setdefault((name, suffix), [None, None, 0, owned])
            s[3] = s[3] or s[0] is not None  # a sum of two is a new tensor
            s[0] = A_sum if s[0] is None else s[0] + A_sum  # (no 0 + A_sum copy)
            if G_sum is not None:  # (w = 1, one batch: no product, the same bits)
                wG = G_sum if w == 1 else w * G_sum
                s[1] = wG if s[1] is None else s[1] + wG
            s[2] += count

    def early(w, cap, name, module, rule, calls) -> None:  # inside the pull
        with cap.computing():
            fold_layer(w, name, module, rule, calls)

    run = (model, loss_func, data, fisher, mc_samples, seed, caller)
    check = "kronecker" if model_layout(model) is None else False  # (position-wise: exact)
    passes = fisher_passes(*run, fold=None if forward_only else early, per_sample=check)
    order: Dict[str, int] = {}
    for w, cap in passes:
        order = order or {name: i for i, (name, *_) in enumerate(cap.layers)}
        sharing = cap.sharing()
        tied.update(sharing.tie_reasons())
        with cap.computing():
            for name, module, rule, calls in cap.active() if forward_only else cap.reached():
                if not sharing.tied(name):  # no Kronecker block for a layer with a tied parameter
                    fold_layer(w, name, module, rule, calls)
    # the blocks in the model's layer order (the layers taken early came top-down)
    stats, diag_stats = (
        dict(sorted(d.items(), key=lambda kv: order[kv[0][0]])) for d in (stats, diag_stats)
    )
    layers = dict(sorted(layers.items(), key=lambda kv: order[kv[0]]))
    blocks = []
    index_of = BlockIndices(layers, layout)
    for (name, suffix), (A_sum, G_sum, count, owned) in stats.items():
        index = index_of(name, suffix, A_sum.device)
        A = A_sum.div_(count) if owned else A_sum / count  # (in place: a pass, no allocation)
        if G_sum is None:
            G = torch.eye(index.shape[1], dtype=A.dtype, device=A.device)
            G = G.expand(index.shape[0], -1, -1).clone()
        else:
            G = G_sum
        blocks.append((cls or KroneckerBlock)(block_name(name, suffix), index, A, G))
    for (name, suffix), st in diag_stats.items():
        index = index_of(name, suffix, st[0].device)
        if len(st) == 4:  # one-sided: [A_sum, G_sum, count, (full_A, full_G)]
            blocks.append(OneSidedBlock(block_name(name, suffix), index, *st[3]))
            blocks[-1].update(st[0] / st[2], st[1])
            continue
        d = (st[0] if st[1] is None else st[0] / st[1]).expand(index.shape)
        blocks.append(DiagonalBlock(block_name(name, suffix), index.to(d.device), d))
    if diag_stats:
        sizes = ", ".join(
            f"'{block_name(*k) or '<model>'}' (A: {shape[2]}, G: {shape[1]})"
            for k, shape in ((k, large[k[0]][k[1]]) for k in diag_stats)
        )
        largest = max(max(large[n][s][1:]) for n, s in diag_stats)
        kinds = {len(st) for st in diag_stats.values()}
        what = "the per-sample Fisher diagonal (DiagonalBlock, see KFACApprox.diagonals)"
        what = "the diagonal of kron(I, A) (DiagonalBlock)" if forward_only else what
        warn(
            f"{caller}(): Kronecker factors larger than max_factor_size={max_factor_size} "
            f"in {sizes}; these blocks are "
            + (what if 2 in kinds else "")
            + (" or " if kinds == {2, 4} else "")
            + ("kron(G, A) with that factor diagonal (OneSidedBlock)" if 4 in kinds else "")
            + " instead of kron(G, A). Pass "
            f"max_factor_size={largest} to keep their factors (memory ~ size^2, "
            "inversion ~ size^3)."
        )
    covered = set(index_of.covered_names())  # a read of the device, if any
    uncovered = [n for n, p in zip(layout.names, layout.params) if n not in covered and p.numel()]
    if skipped or uncovered:
        msg = (
            "KFAC covers no block for "
            + ", ".join(
                [f"'{n}' ({why})" for n, why in skipped.items()]
                + [tied.get(n, n) for n in uncovered]
            )
            + "; these parameters get zero blocks in to_dense()."
            + (f" {tie_hint('use diag_ggn()')}" if tied else "")
        )
        if unsupported == Unsupported.ERROR:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
    return KFACApprox(blocks, layout, uncovered)


def ekfac(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    *,
    fisher: Union[str, FisherType] = "type-2",
    mc_samples: int = 1,
    kfac_approx: Union[str, KFACApproxType] = "expand",
    seed: int = 0,
    unsupported: Union[str, Unsupported] = "warn",
    on_unsupported: Union[str, None] = None,
    max_factor_size: int = 4096,
    large_factors: str = "diagonal_factor",
) -> KFACApprox:
    """EKFAC: KFAC's eigenbasis with eigenvalues from projected per-sample gradients.

    ``Lambda[c, o, i] = sum_{n,k} (QG_c^T grad_nk,c QA_c)[o, i]^2`` where ``grad_nk`` is the
    gradient of vector ``k`` for sample ``n`` (summed over shared positions). A second
    pass over ``data`` (with the same seed) computes it once the basis is known. The
    arguments are those of :func:`kfac`; the blocks are
    :class:`~curvature.blocks.EigenCorrectedBlock` (and
    :class:`~curvature.blocks.OneSidedBlock` over ``max_factor_size``, as in :func:`kfac`,
    without eigenvalue corrections).
    """
    if fisher == FisherType.FORWARD_ONLY:
        raise ValueError("ekfac(fisher='forward-only') is undefined: there are no gradients.")
    fisher, kfac_approx, unsupported = _check_args(
        loss_func,
        fisher,
        kfac_approx,
        mc_samples,
        unsupported,
        on_unsupported,
        max_factor_size,
        "ekfac",
        large_factors,
    )
    data = batches(data)  # two passes over it: a one-shot iterable is read once here
    approx = _kfac(
        model,
        loss_func,
        data,
        fisher,
        mc_samples,
        kfac_approx,
        seed,
        unsupported,
        cls=EigenCorrectedBlock,
        max_factor_size=max_factor_size,
        large_factors=large_factors,
    )
    kron = [b for b in approx.blocks if isinstance(b, EigenCorrectedBlock)]
    outcomes, _ = eigendecompositions(kron, lambda b: 0.0)  # two synchronizations for all
    for b in kron:
        if outcomes[b].record is None:
            raise RuntimeError(outcomes[b].cause)
        b.install(outcomes[b].record)
    bases = {b.name: (b.eigen().QA, b.eigen().QG) for b in kron}
    evals: Dict[str, Tensor] = {}
    for w, cap in fisher_passes(
        model, loss_func, data, fisher, mc_samples, seed, "ekfac", per_sample=True
    ):
        sharing = cap.sharing()
        with cap.computing():
            for name, module, rule, calls in cap.active():
                if sharing.tied(name):
                    continue
                for full, lam in chunked_corrections(name, module, rule, calls, bases).items():
                    evals[full] = evals.get(full, 0) + w * lam
    for b in kron:
        b.update_corrections(evals[b.name])
    return approx


def diag_ggn(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    fisher: Union[str, FisherType] = "type-2",
    *,
    mc_samples: int = 1,
    seed: int = 0,
) -> Dict[str, Tensor]:
    """Diagonal of the GGN (or of another Fisher type) from per-layer quantities.

    ``diag = sum_{k,n} grad_nk^2`` with ``grad_nk`` the gradient of pulled vector ``k`` for
    sample ``n``; for ``"type-2"`` it is exactly the diagonal of :func:`curvature.ggn`,
    computed without forming any matrix. Linear-family layers without weight sharing use
    ``(g^2)^T (a^2)``; others form the per-vector gradients a chunk at a time
    (:func:`curvature.layer_stats.fisher_diagonal`). A parameter several layers use (tied
    weights) sums their per-vector gradients before squaring
    (:func:`curvature.layer_stats.tied_fisher_diagonal`).

    Per-position losses on ``[N, *pos, C]`` have ``C P`` type-2 vectors (in chunks); a model
    that provably never mixes positions (:mod:`curvature.positionwise`: a token MLP) gets
    them folded into the samples, ``C`` vectors: the same diagonal, ``P`` times less work.

    Returns:
        Trainable parameter name to a tensor of the parameter's shape.

    """
    check_loss(loss_func)
    fisher = check_fisher(fisher)
    if fisher == FisherType.FORWARD_ONLY:
        raise ValueError("diag_ggn(fisher='forward-only') is undefined: there is no backward.")
    layout = ParamLayout.of(model)
    flat = layout.params[0].new_zeros(layout.numel)
    if fisher == FisherType.TYPE2:  # the same GGN with the positions as samples, C vectors
        data, _ = fold_positions(model, loss_func, batches(data))

    def fold_layer(w, name, module, rule, calls) -> None:  # (a layer without a tied parameter)
        kron, parts = fisher_diagonal(rule, module, calls)
        parts = {k: (d if w == 1 else w * d).to(flat) for k, d in parts.items()}
        offsets = layer_offsets(layout, name, rule) if kron else None
        if kron and add_linear_block(flat, rule, module, offsets, parts):
            return  # the built-in Linear family: two strided adds, no index
        if kron:  # the index built on flat's device: no host copy
            index = block_index(rule, module, offsets, flat.device)
        else:
            with torch.device(flat.device):
                index = {"": layer_positions(layout, name, module, rule)}
        for suffix, d in parts.items():
            flat.index_add_(0, index[suffix].reshape(-1), d.reshape(-1))

    def early(w, cap, name, module, rule, calls) -> None:  # inside the pull: each layer's
        with cap.computing():  # diagonal goes into flat at once, its gradient after
            fold_layer(w, name, module, rule, calls)

    run = (model, loss_func, data, fisher, mc_samples, seed, "diag_ggn")
    passes = fisher_passes(*run, chunked=True, fold=early, pays=large_gradient, per_sample=True)
    for w, cap in passes:
        sharing = cap.sharing()
        with cap.computing():
            tied = [layer for layer in cap.reached() if sharing.tied(layer[0])]
            for name, d in (tied_fisher_diagonal(tied, sharing.names) if tied else {}).items():
                flat[layout.span(name)] += w * d.reshape(-1).to(flat)
            for name, module, rule, calls in cap.reached():
                if not sharing.tied(name):
                    fold_layer(w, name, module, rule, calls)
    return layout.unflatten_dict(flat)
