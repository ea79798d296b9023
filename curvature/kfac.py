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
``A = [[1]]``. EKFAC (George et al., 2018) keeps KFAC's eigenbasis and replaces the
eigenvalues by the second moments of the per-sample (per-vector) gradients in it.
"""

from __future__ import annotations

import math
import warnings
from typing import Dict, List, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from .blocks import EigenCorrectedBlock, KroneckerBlock
from .capture import capture
from .dense import Data, batch_weights, batches
from .layer_stats import (
    MAX_EXACT_BLOCK,
    block_name,
    eigenvalue_corrections,
    exact_factors,
    fisher_diagonal,
)
from .layout import ParamLayout
from .losses import backprop_sources, check_fisher, check_loss
from .options import DampingMode, FisherType, KFACApproxType, Unsupported, choice, renamed

KFAC_APPROX = tuple(m.value for m in KFACApproxType)


class KFACApprox:
    """Block-diagonal Kronecker-factored curvature of a model.

    Attributes:
        blocks: The layers' :class:`~curvature.blocks.KroneckerBlock` (for :func:`ekfac`
            :class:`~curvature.blocks.EigenCorrectedBlock`).
        param_names: Trainable parameter names in ``model.parameters()`` order.
        uncovered: Names of trainable parameters no block covers (zero rows and
            columns in :meth:`to_dense`).
        layout: The :class:`~curvature.layout.ParamLayout` of the flat vectors.

    """

    def __init__(self, blocks: List[KroneckerBlock], layout: ParamLayout, uncovered: List[str]):
        self.blocks = blocks
        self.layout = layout
        self.param_names = list(layout.names)
        self.num_params = layout.numel
        self.uncovered = uncovered
        ref = layout.params[0]
        self._dtype, self._device = ref.dtype, ref.device

    @property
    def factors(self) -> Dict[str, Tuple[Tensor, Tensor]]:
        """Module name to ``(A, G)``; ``[D, D]`` each, or ``[groups, D, D]`` if grouped."""
        out = {}
        for b in self.blocks:
            A, G = (b.A[0], b.G[0]) if b.A.shape[0] == 1 else (b.A, b.G)
            out[b.name] = (A, G)
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
                inverse of ``kron(G, A) + lambda I``) or ``"pi"`` (Tikhonov damping of
                each factor with the pi heuristic of Martens & Grosse, 2015; for KFAC
                only, EKFAC is always exact).

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
    loss_func, fisher, kfac_approx, mc_samples, unsupported, caller="kfac", arg="unsupported"
):
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


def _passes(model, loss_func, data, fisher, mc_samples, seed):
    """Yield ``(weight, Capture)`` per batch after pulling the Fisher's vectors."""
    generator = torch.Generator().manual_seed(seed)
    bs = batches(data)
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        with capture(model) as cap:
            out = model(X)
        if fisher != FisherType.FORWARD_ONLY:
            V = backprop_sources(
                loss_func, out, y, fisher.value, mc_samples=mc_samples, generator=generator
            )
            cap.pull(out, V, is_grads_batched=True, retain_graph=False)
        yield w, cap


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

    Returns:
        A :class:`KFACApprox`.

    """
    unsupported, arg = renamed(unsupported, on_unsupported, "unsupported", "on_unsupported", "kfac")
    fisher, kfac_approx, unsupported = _check_args(
        loss_func, fisher, kfac_approx, mc_samples, unsupported, arg=arg
    )
    return _kfac(model, loss_func, data, fisher, mc_samples, kfac_approx, seed, unsupported)


def _kfac(model, loss_func, data, fisher, mc_samples, kfac_approx, seed, unsupported, cls=None):
    layout = ParamLayout.of(model)
    stats: Dict[Tuple[str, str], list] = {}
    layers: Dict[str, Tuple[nn.Module, object]] = {}
    skipped: Dict[str, str] = {}
    forward_only = fisher == FisherType.FORWARD_ONLY
    for w, cap in _passes(model, loss_func, data, fisher, mc_samples, seed):
        with cap.computing():
            for name, module, rule, calls in cap.active():
                layers[name] = (module, rule)
                res = rule.kfac_factors(module, calls, kfac_approx.value, not forward_only)
                if res is None:
                    n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
                    if forward_only or n_params > MAX_EXACT_BLOCK:
                        skipped[name] = (
                            "no Kronecker rule"
                            + (" (forward-only)" if forward_only else "")
                            + f", {n_params} parameters"
                        )
                        continue
                    res = exact_factors(rule, module, calls)
                for suffix, (A_sum, G_sum, count) in res.items():
                    s = stats.setdefault((name, suffix), [0, None, 0])
                    s[0] = s[0] + A_sum
                    s[1] = (
                        None if G_sum is None else (w * G_sum if s[1] is None else s[1] + w * G_sum)
                    )
                    s[2] += count
    blocks = []
    for (name, suffix), (A_sum, G_sum, count) in stats.items():
        module, rule = layers[name]
        index = _block_index(module, rule, name, suffix, layout).to(A_sum.device)
        A = A_sum / count
        if G_sum is None:
            G = torch.eye(index.shape[1], dtype=A.dtype, device=A.device)
            G = G.expand(index.shape[0], -1, -1).clone()
        else:
            G = G_sum
        blocks.append((cls or KroneckerBlock)(block_name(name, suffix), index, A, G))
    covered = set()
    for b in blocks:
        covered.update(b.index.reshape(-1).tolist())
    uncovered = [
        n
        for n, p in zip(layout.names, layout.params)
        if layout.offsets[n] not in covered and p.numel() > 0
    ]
    if skipped or uncovered:
        msg = (
            "KFAC covers no block for "
            + ", ".join([f"'{n}' ({why})" for n, why in skipped.items()] + uncovered)
            + "; these parameters get zero blocks in to_dense()."
        )
        if unsupported == Unsupported.ERROR:
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=3)
    return KFACApprox(blocks, layout, uncovered)


def _block_index(module, rule, name, suffix, layout: ParamLayout) -> Tensor:
    index = rule.kfac_index(module, layout.local_offsets(name))
    if index is None:  # exact block over the module's trainable parameters
        return layout.module_index(module, name).view(1, -1, 1)
    return index[suffix]


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
) -> KFACApprox:
    """EKFAC: KFAC's eigenbasis with eigenvalues from projected per-sample gradients.

    ``Lambda[c, o, i] = sum_{n,k} (QG_c^T grad_nk,c QA_c)[o, i]^2`` where ``grad_nk`` is the
    gradient of vector ``k`` for sample ``n`` (summed over shared positions). A second
    pass over ``data`` (with the same seed) computes it once the basis is known. The
    arguments are those of :func:`kfac`; the blocks are
    :class:`~curvature.blocks.EigenCorrectedBlock`.
    """
    if fisher == FisherType.FORWARD_ONLY:
        raise ValueError("ekfac(fisher='forward-only') is undefined: there are no gradients.")
    unsupported, arg = renamed(
        unsupported, on_unsupported, "unsupported", "on_unsupported", "ekfac"
    )
    fisher, kfac_approx, unsupported = _check_args(
        loss_func, fisher, kfac_approx, mc_samples, unsupported, caller="ekfac", arg=arg
    )
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
    )
    bases = {b.name: (b.eigen().QA, b.eigen().QG) for b in approx.blocks}
    evals: Dict[str, Tensor] = {}
    for w, cap in _passes(model, loss_func, data, fisher, mc_samples, seed):
        with cap.computing():
            for name, module, rule, calls in cap.active():
                for full, lam in eigenvalue_corrections(name, module, rule, calls, bases).items():
                    evals[full] = evals.get(full, 0) + w * lam
    for b in approx.blocks:
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
    (:func:`curvature.layer_stats.fisher_diagonal`).

    Returns:
        Trainable parameter name to a tensor of the parameter's shape.

    """
    check_loss(loss_func)
    fisher = check_fisher(fisher)
    if fisher == FisherType.FORWARD_ONLY:
        raise ValueError("diag_ggn(fisher='forward-only') is undefined: there is no backward.")
    layout = ParamLayout.of(model)
    ref = layout.params[0]
    flat = torch.zeros(layout.numel, dtype=ref.dtype, device=ref.device)
    for w, cap in _passes(model, loss_func, data, fisher, mc_samples, seed):
        with cap.computing():
            for name, module, rule, calls in cap.active():
                kron, parts = fisher_diagonal(rule, module, calls)
                index = rule.kfac_index(module, layout.local_offsets(name)) if kron else None
                for suffix, d in parts.items():
                    ix = index[suffix] if kron else layout.module_index(module, name)
                    flat.index_add_(0, ix.reshape(-1).to(flat.device), w * d.reshape(-1).to(flat))
    return layout.unflatten_dict(flat)
