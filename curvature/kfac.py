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

import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from .capture import capture
from .dense import Data, batch_weights, batches
from .layers import LayerRule
from .linalg import eigh, pi_factor
from .losses import backprop_sources, check_fisher, check_loss

KFAC_APPROX = ("expand", "reduce")
_MAX_EXACT_BLOCK = 4096


@dataclass
class KroneckerBlock:
    """One layer's block: ``blockdiag_c kron(G[c], A[c])`` on ``index``.

    Attributes:
        name: Module name.
        A: ``[C, D, D]`` input factor.
        G: ``[C, D_out, D_out]`` output-gradient factor.
        index: ``[C, D_out, D]`` positions of the entries in the flat parameter vector.
        evals: For EKFAC, the corrected eigenvalues ``[C, D_out, D]`` in the basis
            ``(QG, QA)``; ``None`` for KFAC.

    """

    name: str
    A: Tensor
    G: Tensor
    index: Tensor
    evals: Optional[Tensor] = None
    _eig: Optional[Tuple[Tensor, Tensor, Tensor, Tensor]] = None

    def eig(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(lA, QA, lG, QG)``: eigendecompositions of the factors (cached)."""
        if self._eig is None:
            lA, QA = eigh(self.A, name=f"A of '{self.name}'")
            lG, QG = eigh(self.G, name=f"G of '{self.name}'")
            self._eig = (lA, QA, lG, QG)
        return self._eig

    def gather(self, flat: Tensor) -> Tensor:
        """The block's entries of a flat vector as matrices ``[C, D_out, D]``."""
        return flat[self.index]

    def matvec(self, M: Tensor) -> Tensor:
        """Block times ``M [C, D_out, D]``."""
        if self.evals is None:
            return self.G @ M @ self.A  # A, G symmetric
        _, QA, _, QG = self.eig()
        return QG @ ((QG.mT @ M @ QA) * self.evals) @ QA.mT

    def inverse_matvec(self, M: Tensor, damping: float, mode: str) -> Tensor:
        """``(block + damping I)^{-1} M`` (``mode="exact"``) or with the pi heuristic."""
        lA, QA, lG, QG = self.eig()
        if self.evals is not None or mode == "exact":
            denom = self.evals if self.evals is not None else lG[..., :, None] * lA[..., None, :]
            return QG @ ((QG.mT @ M @ QA) / (denom + damping)) @ QA.mT
        # Tikhonov on the factors: (G + damping^0.5 / pi) x (A + pi damping^0.5)
        dA, dG = lA.shape[-1], lG.shape[-1]
        pi = pi_factor(lA.sum(-1) / dA, lG.sum(-1) / dG)
        root = damping**0.5
        iA = 1.0 / (lA + (pi * root)[..., None])
        iG = 1.0 / (lG + (root / pi)[..., None])
        return QG @ ((QG.mT @ M @ QA) * iG[..., :, None] * iA[..., None, :]) @ QA.mT

    def diagonal_in_eigenbasis(self) -> Tensor:
        """``[C, D_out, D]``: the block's eigenvalues."""
        if self.evals is not None:
            return self.evals
        lA, _, lG, _ = self.eig()
        return lG[..., :, None] * lA[..., None, :]

    def dense(self) -> Tensor:
        """``[C, D_out D, D_out D]`` dense per-group blocks (row-major in ``(o, i)``)."""
        if self.evals is None:
            return torch.stack([torch.kron(g, a) for g, a in zip(self.G, self.A)])
        _, QA, _, QG = self.eig()
        Q = torch.stack([torch.kron(qg, qa) for qg, qa in zip(QG, QA)])
        return Q @ torch.diag_embed(self.evals.flatten(1)) @ Q.mT


class KFACApprox:
    """Block-diagonal Kronecker-factored curvature of a model.

    Attributes:
        blocks: The layers' :class:`KroneckerBlock`.
        param_names: Trainable parameter names in ``model.parameters()`` order.
        uncovered: Names of trainable parameters no block covers (zero rows and
            columns in :meth:`to_dense`).

    """

    def __init__(
        self,
        blocks: List[KroneckerBlock],
        params: Dict[str, Tensor],
        uncovered: List[str],
    ):
        self.blocks = blocks
        self.param_names = list(params)
        self._shapes = [p.shape for p in params.values()]
        self.num_params = sum(p.numel() for p in params.values())
        self.uncovered = uncovered
        ref = next(iter(params.values()))
        self._dtype, self._device = ref.dtype, ref.device

    @property
    def factors(self) -> Dict[str, Tuple[Tensor, Tensor]]:
        """Module name to ``(A, G)``; ``[D, D]`` each, or ``[groups, D, D]`` if grouped."""
        out = {}
        for b in self.blocks:
            A, G = (b.A[0], b.G[0]) if b.A.shape[0] == 1 else (b.A, b.G)
            out[b.name] = (A, G)
        return out

    # -- vectors -------------------------------------------------------------------------
    def _flatten(self, v: Sequence[Tensor]) -> Tensor:
        v = list(v)
        if len(v) != len(self._shapes) or any(a.shape != s for a, s in zip(v, self._shapes)):
            raise ValueError(
                f"v must be a list of {len(self._shapes)} tensors shaped like the trainable "
                f"parameters {[tuple(s) for s in self._shapes]}."
            )
        return torch.cat([a.reshape(-1) for a in v])

    def _unflatten(self, flat: Tensor) -> List[Tensor]:
        out, i = [], 0
        for s in self._shapes:
            n = s.numel()
            out.append(flat[i : i + n].view(s))
            i += n
        return out

    def _uncovered_mask(self) -> Tensor:
        mask = torch.ones(self.num_params, dtype=torch.bool, device=self._device)
        for b in self.blocks:
            mask[b.index.reshape(-1)] = False
        return mask

    def matvec(self, v: Sequence[Tensor]) -> List[Tensor]:
        """The approximation times ``v`` (a list shaped like the parameters)."""
        flat = self._flatten(v)
        out = torch.zeros_like(flat)
        for b in self.blocks:
            out[b.index] = b.matvec(b.gather(flat))
        return self._unflatten(out)

    def inverse_matvec(
        self, v: Sequence[Tensor], damping: float, *, mode: str = "exact"
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
        if mode not in ("exact", "pi"):
            raise ValueError(f"mode={mode!r} must be 'exact' or 'pi'.")
        flat = self._flatten(v)
        out = flat / damping  # uncovered parameters: (0 + lambda)^{-1}
        for b in self.blocks:
            out[b.index] = b.inverse_matvec(b.gather(flat), damping, mode)
        return self._unflatten(out)

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
            if b.evals is None:
                total = (
                    total
                    + (
                        b.G.diagonal(dim1=-2, dim2=-1).sum(-1)
                        * b.A.diagonal(dim1=-2, dim2=-1).sum(-1)
                    ).sum()
                )
            else:
                total = total + b.evals.sum()
        return total

    def logdet(self, damping: float) -> Tensor:
        """``log det(approx + damping I)`` over all trainable parameters."""
        if damping <= 0:
            raise ValueError(f"damping={damping} must be > 0.")
        n_unc = int(self._uncovered_mask().sum())
        total = torch.tensor(n_unc * torch.log(torch.tensor(float(damping))).item())
        total = total.to(self._dtype)
        for b in self.blocks:
            total = total + torch.log(b.diagonal_in_eigenbasis() + damping).sum()
        return total


# -- collecting statistics ---------------------------------------------------------------
def _per_vector_grads(rule: LayerRule, module: nn.Module, calls) -> Tensor:
    """``[K, N, P_l]``: gradients per pulled vector and sample, for exact blocks."""
    full = [c.grads for c in calls]
    K = full[0][0].shape[0]
    rows = []
    try:
        for k in range(K):
            for c, gs in zip(calls, full):
                c.grads = [g[k] for g in gs]
            grads = rule.per_sample_grads(module, calls)
            rows.append(torch.cat([g.flatten(1) for g in grads.values()], 1))
    finally:
        for c, gs in zip(calls, full):
            c.grads = gs
    return torch.stack(rows)


def _param_offsets(model: nn.Module) -> Tuple[Dict[str, Tensor], Dict[str, int]]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    offsets, i = {}, 0
    for n, p in params.items():
        offsets[n] = i
        i += p.numel()
    return params, offsets


def _local_offsets(name: str, offsets: Dict[str, int]) -> Dict[str, int]:
    prefix = f"{name}." if name else ""
    return {n[len(prefix) :]: o for n, o in offsets.items() if n.startswith(prefix)}


def _exact_index(module: nn.Module, name: str, offsets: Dict[str, int]) -> Tensor:
    """Flat positions of the module's trainable parameters, ``[P_l]``."""
    prefix = f"{name}." if name else ""
    ix = [
        torch.arange(offsets[prefix + n], offsets[prefix + n] + p.numel())
        for n, p in module.named_parameters()
        if p.requires_grad and prefix + n in offsets
    ]
    return torch.cat(ix)


def _block_index(module, rule, name, suffix, offsets) -> Tensor:
    index = rule.kfac_index(module, _local_offsets(name, offsets))
    if index is None:  # exact block over the module's trainable parameters
        return _exact_index(module, name, offsets).view(1, -1, 1)
    return index[suffix]


def _check_args(loss_func, fisher, kfac_approx, mc_samples, on_unsupported):
    check_loss(loss_func)
    check_fisher(fisher)
    if kfac_approx not in KFAC_APPROX:
        raise ValueError(f"kfac_approx={kfac_approx!r} must be one of {KFAC_APPROX}.")
    if not isinstance(mc_samples, int) or mc_samples < 1:
        raise ValueError(f"mc_samples={mc_samples!r} must be a positive integer.")
    if on_unsupported not in ("warn", "error"):
        raise ValueError(f"on_unsupported={on_unsupported!r} must be 'warn' or 'error'.")


def _exact_block_factors(rule: LayerRule, module: nn.Module, calls) -> Dict[str, tuple]:
    """A layer without a Kronecker rule as one exact block: ``A = [[1]]``, ``G = U^T U``.

    ``U`` ``[K N, P_l]`` stacks the per-vector gradients of all the layer's parameters;
    the result has the ``{suffix: (A_sum, G_sum, count)}`` form of
    :meth:`~curvature.layers.LayerRule.kfac_factors`.
    """
    U = _per_vector_grads(rule, module, calls).flatten(0, 1)
    one = torch.ones(1, 1, 1, dtype=U.dtype, device=U.device)
    return {"": (one, (U.T @ U)[None], 1)}


def _passes(model, loss_func, data, fisher, mc_samples, seed):
    """Yield ``(weight, Capture)`` per batch after pulling the Fisher's vectors."""
    generator = torch.Generator().manual_seed(seed)
    bs = batches(data)
    for w, (X, y) in zip(batch_weights(loss_func, bs), bs):
        with capture(model) as cap:
            out = model(X)
        if fisher != "forward-only":
            V = backprop_sources(
                loss_func, out, y, fisher, mc_samples=mc_samples, generator=generator
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
    on_unsupported: str = "warn",
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
        on_unsupported: ``"warn"`` or ``"error"`` for trainable parameters no block
            covers (they stay in :meth:`KFACApprox.to_dense`'s order with zero blocks).

    Returns:
        A :class:`KFACApprox`.

    """
    _check_args(loss_func, fisher, kfac_approx, mc_samples, on_unsupported)
    params, offsets = _param_offsets(model)
    stats: Dict[Tuple[str, str], list] = {}
    layers: Dict[str, Tuple[nn.Module, LayerRule]] = {}
    skipped: Dict[str, str] = {}
    for w, cap in _passes(model, loss_func, data, fisher, mc_samples, seed):
        with cap._computing():
            for name, module, rule, calls in cap._active():
                layers[name] = (module, rule)
                res = rule.kfac_factors(module, calls, kfac_approx, fisher != "forward-only")
                if res is None:
                    n_params = sum(p.numel() for p in module.parameters() if p.requires_grad)
                    if fisher == "forward-only" or n_params > _MAX_EXACT_BLOCK:
                        skipped[name] = (
                            "no Kronecker rule"
                            + (" (forward-only)" if fisher == "forward-only" else "")
                            + f", {n_params} parameters"
                        )
                        continue
                    res = _exact_block_factors(rule, module, calls)
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
        index = _block_index(module, rule, name, suffix, offsets)
        A = A_sum / count
        if G_sum is None:
            G = torch.eye(index.shape[1], dtype=A.dtype, device=A.device)
            G = G.expand(index.shape[0], -1, -1).clone()
        else:
            G = G_sum
        full = ".".join(x for x in (name, suffix) if x)
        blocks.append(KroneckerBlock(full, A, G, index.to(A.device)))
    covered = set()
    for b in blocks:
        covered.update(b.index.reshape(-1).tolist())
    uncovered = [n for n, p in params.items() if offsets[n] not in covered and p.numel() > 0]
    if skipped or uncovered:
        msg = (
            "KFAC covers no block for "
            + ", ".join([f"'{n}' ({why})" for n, why in skipped.items()] + uncovered)
            + "; these parameters get zero blocks in to_dense()."
        )
        if on_unsupported == "error":
            raise ValueError(msg)
        warnings.warn(msg, stacklevel=2)
    return KFACApprox(blocks, params, uncovered)


def ekfac(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    *,
    fisher: str = "type-2",
    mc_samples: int = 1,
    kfac_approx: str = "expand",
    seed: int = 0,
    on_unsupported: str = "warn",
) -> KFACApprox:
    """EKFAC: KFAC's eigenbasis with eigenvalues from projected per-sample gradients.

    ``Lambda[c, o, i] = sum_{n,k} (QG_c^T grad_nk,c QA_c)[o, i]^2`` where ``grad_nk`` is the
    gradient of vector ``k`` for sample ``n`` (summed over shared positions). A second
    pass over ``data`` (with the same seed) computes it once the basis is known.
    """
    if fisher == "forward-only":
        raise ValueError("ekfac(fisher='forward-only') is undefined: there are no gradients.")
    approx = kfac(
        model,
        loss_func,
        data,
        fisher=fisher,
        mc_samples=mc_samples,
        kfac_approx=kfac_approx,
        seed=seed,
        on_unsupported=on_unsupported,
    )
    by_name = {b.name: b for b in approx.blocks}
    evals: Dict[str, Tensor] = {}
    for w, cap in _passes(model, loss_func, data, fisher, mc_samples, seed):
        with cap._computing():
            for name, module, rule, calls in cap._active():
                bases = {k: (b.eig()[1], b.eig()[3]) for k, b in by_name.items()}
                for full, lam in eigenvalue_corrections(name, module, rule, calls, bases).items():
                    evals[full] = evals.get(full, 0) + w * lam
    for b in approx.blocks:
        b.evals = evals[b.name]
    return approx


def eigenvalue_corrections(
    name: str,
    module: nn.Module,
    rule: LayerRule,
    calls,
    bases: Dict[str, Tuple[Tensor, Tensor]],
) -> Dict[str, Tensor]:
    """EKFAC's ``sum_{k,n} (QG^T grad_nk QA)^2`` for each of the layer's blocks.

    Args:
        name: Module name; blocks are named ``name`` or ``name.suffix``.
        module: The layer.
        rule: Its rule.
        calls: Its calls, with pulled ``grads [K, ...]``.
        bases: Block name to ``(QA [C, D, D], QG [C, D_out, D_out])``; blocks without a
            basis are skipped.

    Returns:
        Block name to ``[C, D_out, D]``.

    """
    out: Dict[str, Tensor] = {}
    expanded = rule.expanded_blocks(module, calls)
    if expanded is not None:
        for suffix, (a, g) in expanded.items():
            full = ".".join(x for x in (name, suffix) if x)
            if full in bases:
                QA, QG = bases[full]
                out[full] = _rotated_second_moments(a, g, QA, QG)
        return out
    if name not in bases:
        return out
    QA, QG = bases[name]
    U = _per_vector_grads(rule, module, calls)  # [K, N, P_l]
    D, D_out = QA.shape[-1], QG.shape[-1]
    if D != 1:  # Embedding: per-sample grads [V, D_out] are the layer matrix transposed
        rot = QG[0].mT @ U.view(*U.shape[:2], D, D_out).mT @ QA[0]
    else:
        rot = (U @ QG[0]).unsqueeze(-1)
    out[name] = rot.pow(2).sum((0, 1)).reshape(D_out, D)[None]
    return out


def _rotated_second_moments(a: Tensor, g: Tensor, QA: Tensor, QG: Tensor) -> Tensor:
    """``sum_{k,n} (QG^T grad_nk QA)^2`` ``[C, D_out, D]`` from expanded ``a`` and ``g``."""
    ar = torch.einsum("nsci,cij->nscj", a.to(QA.dtype), QA)
    gr = torch.einsum("knsco,cop->knscp", g.to(QG.dtype), QG)
    if a.shape[1] == 1:  # no sharing: sum_{k,n} (gr^2)(ar^2)^T, one GEMM, no [N, D_out, D]
        return torch.einsum("knco,nci->coi", gr[:, :, 0].pow(2), ar[:, 0].pow(2))
    out = None
    K, N = gr.shape[:2]
    chunk = max(1, 2**22 // max(1, K * a.shape[2] * QA.shape[-1] * QG.shape[-1]))
    for i in range(0, N, chunk):
        grad = torch.einsum("knscp,nscj->kncpj", gr[:, i : i + chunk], ar[i : i + chunk])
        part = grad.pow(2).sum((0, 1))
        out = part if out is None else out + part
    return out


def _expanded_diag(a: Tensor, g: Tensor) -> Tensor:
    """``sum_{k,n} (sum_s g a^T)^2`` ``[C, D_out, D]``; ``(g^2)^T (a^2)`` without sharing."""
    if a.shape[1] == 1:
        return torch.einsum("knco,nci->coi", g[:, :, 0].pow(2), a[:, 0].pow(2))
    d = None
    N = a.shape[0]
    chunk = max(1, 2**22 // max(1, g.shape[0] * g[0, 0, 0].numel() * a.shape[-1]))
    for i in range(0, N, chunk):
        gr = torch.einsum("knsco,nsci->kncoi", g[:, i : i + chunk], a[i : i + chunk])
        part = gr.pow(2).sum((0, 1))
        d = part if d is None else d + part
    return d


def diag_ggn(
    model: nn.Module,
    loss_func: nn.Module,
    data: Data,
    fisher: str = "type-2",
    *,
    mc_samples: int = 1,
    seed: int = 0,
) -> Dict[str, Tensor]:
    """Diagonal of the GGN (or of another Fisher type) from per-layer quantities.

    ``diag = sum_{k,n} grad_nk^2`` with ``grad_nk`` the gradient of pulled vector ``k`` for
    sample ``n``; for ``"type-2"`` it is exactly the diagonal of :func:`curvature.ggn`,
    computed without forming any matrix. Linear-family layers without weight sharing use
    ``(g^2)^T (a^2)``; others form the per-vector gradients a chunk at a time.

    Returns:
        Trainable parameter name to a tensor of the parameter's shape.

    """
    check_loss(loss_func)
    check_fisher(fisher)
    if fisher == "forward-only":
        raise ValueError("diag_ggn(fisher='forward-only') is undefined: there is no backward.")
    params, offsets = _param_offsets(model)
    P = sum(p.numel() for p in params.values())
    ref = next(iter(params.values()))
    flat = torch.zeros(P, dtype=ref.dtype, device=ref.device)
    for w, cap in _passes(model, loss_func, data, fisher, mc_samples, seed):
        with cap._computing():
            for name, module, rule, calls in cap._active():
                expanded = rule.expanded_blocks(module, calls)
                if expanded is None:
                    U = _per_vector_grads(rule, module, calls)  # [K, N, P_l]
                    ix = _exact_index(module, name, offsets).to(flat.device)
                    flat.index_add_(0, ix, w * U.pow(2).sum((0, 1)).to(flat))
                    continue
                index = rule.kfac_index(module, _local_offsets(name, offsets))
                for suffix, (a, g) in expanded.items():
                    d = _expanded_diag(a, g)
                    ix = index[suffix].reshape(-1).to(flat.device)
                    flat.index_add_(0, ix, w * d.reshape(-1).to(flat))
    out, i = {}, 0
    for n, p in params.items():
        out[n] = flat[i : i + p.numel()].view_as(p)
        i += p.numel()
    return out
