"""``KFAC`` and ``EKFAC`` optimizers (``torch.optim.Optimizer`` subclasses).

Per layer block (see :mod:`curvature.kfac` for the maths), with running factors ``A``
and ``G`` and damping ``lambda``, the update direction for the gradient matrix ``M``
(rows: outputs, columns: inputs with the bias last) is

    pi (default):     (G + sqrt(lambda)/pi I)^{-1} M (A + pi sqrt(lambda) I)^{-1}
    exact:            QG [ (QG^T M QA) / (lG lA^T + lambda) ] QA^T
    EKFAC:            QG [ (QG^T M QA) / (Lambda + lambda) ] QA^T

with ``Lambda`` the running second moments of the per-sample (per-vector) gradients in
the Kronecker eigenbasis (George et al., 2018). When the basis is refreshed, ``Lambda``
is carried over as the diagonal of the previous EKFAC matrix in the new basis.

A block reached by two registered outputs (terms; e.g. a PINN's interior and boundary
residuals) is preconditioned with the exact inverse of
``(A1 + pi sqrt(lambda) I) x (G1 + sqrt(lambda)/pi I) + A2 x G2`` (simultaneous
diagonalization; more terms are merged into the second). This damping is always of the
pi form, and such blocks use no eigenvalue correction.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from ..layer_stats import MAX_EXACT_BLOCK as _MAX_EXACT_BLOCK
from ..layer_stats import exact_factors as _exact_block_factors
from ..layer_stats import expanded_diagonal as _expanded_diag
from ..layer_stats import per_vector_grads as _per_vector_grads
from ..layer_stats import eigenvalue_corrections
from ..layout import ParamLayout
from ..layers.base import expanded_kfac
from ..linalg import (
    damped_inverses,
    eigh,
    eighs,
    finite_flags,
    generalized_eigh,
    non_finite_message,
    pi_factor,
)
from .base import CurvatureOptimizer, _put, _take

Key = Tuple[str, str]
_KINDS = ("A", "G", "g")  # statistics values of a block: A, G, EKFAC's corrections


def _clone(x):
    return x.clone() if isinstance(x, Tensor) else x


def _block_name(key: Key) -> str:
    return ".".join(x for x in key if x)


class KFAC(CurvatureOptimizer):
    """Kronecker-factored natural gradient (Martens & Grosse, 2015).

    Example:
        >>> optim = curvature.KFAC(model, lr=1e-2, damping=1e-3)  # doctest: +SKIP
        >>> for X, y in loader:
        ...     optim.zero_grad()
        ...     loss_func(model(X), y).backward()
        ...     optim.step()

    Args:
        model (nn.Module): The model (a DDP wrapper is unwrapped for hooks).
        lr (float): Learning rate.
        damping (float): ``lambda > 0`` added to the curvature before inversion.
        momentum (float): Heavy-ball momentum on the preconditioned direction.
        weight_decay (float): Decoupled weight decay (``p -= lr * weight_decay * p``).

    Keyword Args:
        fisher (str): ``"empirical"`` (default; from your own backward), ``"mc"``,
            ``"type-2"``, ``"rademacher"`` (from the model output and ``loss_func``,
            backpropagated by the optimizer on the existing graph), ``"forward-only"``.
        loss_func (nn.Module | None): The loss module; required for ``"mc"``,
            ``"type-2"`` and ``"rademacher"``; for ``"empirical"`` it tells the
            reduction (mean if omitted).
        mc_samples (int): Samples for ``"mc"`` / ``"rademacher"`` (default 1).
        kfac_approx (str): ``"expand"`` (default) or ``"reduce"`` for weight-sharing
            layers.
        factor_decay (float): EMA decay of the factors (default 0.95).
        factor_every (int): Collect statistics every this many steps (default 1).
        inverse_every (int): Refresh the factor inverses (pi damping: Cholesky) or
            eigendecompositions (``"exact"``, EKFAC) every this many steps (default 10).
        kl_clip (float | None): Scale updates so that ``lr^2 d^T g <= kl_clip``
            (default None: off).
        damping_mode (str): ``"pi"`` (default; Tikhonov damping of each factor with the pi
            heuristic, more conservative in directions where one factor is large; the
            damped factors are inverted by Cholesky) or
            ``"exact"`` (``kron(G, A) + lambda I`` inverted exactly in the eigenbasis).
            EKFAC always damps its corrected eigenvalues exactly.
        max_factor_size (int): Blocks with a Kronecker factor larger than this (default
            4096) use the per-sample Fisher diagonal (with a warning naming them):
            decomposing a factor of size 10k takes minutes on a small CPU.
        unsupported (str): For parameters no rule covers: ``"warn"`` (default; plain
            gradient, one warning), ``"error"``, or ``"diagonal"`` (diagonal empirical
            Fisher).
        auto_output (bool): Run the curvature backward at the end of every training
            forward of the model (``"mc"``/``"type-2"``/``"rademacher"``; default True);
            set ``False`` when the outputs are named with :meth:`register_output`.
        seed (int): Seed of the sampling generator (saved in ``state_dict``; default 0).
        param_groups (Sequence[dict] | None): Optional ``torch.optim``-style groups of
            the model's parameters with per-group ``lr``, ``damping``, ``momentum``,
            ``weight_decay``.
        grad_scaler (torch.amp.GradScaler | None): A ``torch.amp.GradScaler`` whose loss
            scale is removed from the empirical statistics.
        adaptive_damping (bool): Adapt ``damping`` by the Levenberg-Marquardt rule from
            the reduction ratio (default False; ``step`` then needs a closure; see
            :meth:`step`).
        damping_adaptation_interval (int): Adapt the damping every this many steps
            (default 5).
        damping_adaptation_decay (float): Factor by which the damping shrinks (or, its
            inverse, grows) at an adaptation (default 0.95).
        line_search_grid (Sequence[float] | None): Learning rates tried at each step
            (default None: off; ``step`` then needs a closure); the one with the lowest
            loss is taken, replacing the groups' learning rates.
        distributed (bool | None): Average the curvature over the ranks of
            ``torch.distributed`` (default None: when it is initialized with more than one
            rank; see docs/distributed.md).
        process_group (ProcessGroup | None): The ranks to average over (default: a DDP
            model's group, else the default group).
        sync_grads (bool | None): Average the gradients over the ranks in ``step()``
            (default None: unless the model is DDP-wrapped, which averages them itself).
        comm_timeout (float): Seconds a collective may wait before it raises a clear
            error naming the step and the rank (default 300).
        bucket_mb (float): Largest all-reduce bucket in megabytes (default 25).
        decompose (str): ``"split"`` (default; each block is decomposed on one rank
            chosen by a cost model, and the results are shared) or ``"all"`` (every rank
            decomposes every block; nothing communicated at refresh time). For
            eigendecomposed blocks only: KFAC with pi damping inverts its factors by
            Cholesky on each rank that preconditions them, with nothing to share.
        precondition (str): ``"all"`` (default; every rank preconditions every block) or
            ``"owner"`` (KFAC only: each block on its owner, which keeps its
            decomposition; the preconditioned gradient is all-reduced every step).

    Warning:
        Statistics of ``"empirical"`` assume that the gradient accumulated in ``.grad``
        (averaged over the ranks) is the gradient of ``loss_func`` over the union of
        the step's micro-batches (and ranks): a plain mean loss on one process, ``loss /
        k`` over ``k`` equal micro-batches; each forward's backward must run before the
        next training forward.

    """

    _ekfac = False

    def __init__(self, model, lr=1e-2, damping=1e-3, momentum=0.0, weight_decay=0.0, **kwargs):
        max_factor_size = kwargs.pop("max_factor_size", 4096)
        if not isinstance(max_factor_size, int) or max_factor_size < 1:
            raise ValueError(
                f"{type(self).__name__}(max_factor_size={max_factor_size!r}): a positive int; "
                "blocks with a larger Kronecker factor use the per-sample Fisher diagonal."
            )
        self.max_factor_size = max_factor_size
        decompose = kwargs.pop("decompose", "split")
        precondition = kwargs.pop("precondition", "all")
        if decompose not in ("split", "all"):
            raise ValueError(
                f"{type(self).__name__}(decompose={decompose!r}): 'split' (each block's "
                "decompositions on one rank, then shared) or 'all' (every rank decomposes "
                "every block)."
            )
        if precondition not in ("all", "owner"):
            raise ValueError(
                f"{type(self).__name__}(precondition={precondition!r}): 'all' (every rank "
                "preconditions every block) or 'owner' (each block on its owner rank, the "
                "preconditioned gradient is shared)."
            )
        if precondition == "owner" and (decompose != "split" or self._ekfac):
            raise ValueError(
                f"{type(self).__name__}(precondition='owner') needs decompose='split' and "
                "KFAC (EKFAC's corrections need every block's eigenbasis on every rank)."
            )
        self.decompose, self.precondition = decompose, precondition
        self._decomposed: set = set()
        self._large: Dict[Key, Tensor] = {}
        self._inv: Dict[Key, tuple] = {}  # damped factor inverses (pi damping), derived
        self.factors_: Dict[Key, Dict[int, List[Tensor]]] = {}
        self._eig: Dict[Key, Tuple[Tensor, Tensor, Tensor, Tensor]] = {}
        self._lambda: Dict[Key, Tensor] = {}
        self._diag: Dict[str, Tensor] = {}
        super().__init__(model, lr, damping, momentum, weight_decay, **kwargs)
        self._structure()

    def _reset_curvature(self) -> None:
        self.factors_, self._eig, self._lambda, self._diag = {}, {}, {}, {}
        self._large = {}
        self._decomposed = set()
        self._structure()

    def _structure(self) -> None:
        self._index = self._block_indices()
        by_offset = {
            o: p
            for n, p in self.model.named_parameters()
            if (o := self._offsets.get(n)) is not None
        }
        starts = sorted(by_offset)
        self._block_param = {}
        for key, ix in self._index.items():
            pos = int(ix.reshape(-1)[0])
            start = max(o for o in starts if o <= pos)
            self._block_param[key] = by_offset[start]
        self._owner: Dict[Key, int] = {}
        self._mask = None
        if self._comm is not None:
            costs = {
                k: ix.shape[0] * (ix.shape[1] ** 3 + ix.shape[2] ** 3)
                for k, ix in self._index.items()
            }
            self._owner = self._comm.owners(costs)

    def _mine(self, key: Key) -> bool:
        """Whether this rank decomposes (and, with ``precondition='owner'``, uses) ``key``."""
        if self._comm is None or self.decompose == "all":
            return True
        return self._owner.get(key, 0) == self._comm.rank

    def _uses(self, key: Key) -> bool:
        """Whether this rank preconditions block ``key``."""
        return self.precondition == "all" or self._mine(key)

    # -- structure ---------------------------------------------------------------------------
    def _block_indices(self) -> Dict[Key, Tensor]:
        index: Dict[Key, Tensor] = {}
        for name, (module, rule) in self._layers.items():
            local = rule.kfac_index(module, _local_offsets(name, self._offsets))
            if local is not None:
                for suffix, ix in local.items():
                    if (
                        max(ix.shape[1], ix.shape[2]) > self.max_factor_size
                        and self.fisher != "forward-only"
                    ):
                        self._large[(name, suffix)] = ix  # too large to decompose: diagonal
                    else:
                        index[(name, suffix)] = ix
            elif self._exact_ok(module):
                index[(name, "")] = _exact_index(module, name, self._offsets).view(1, -1, 1)
        return index

    def _exact_ok(self, module) -> bool:
        n = sum(p.numel() for p in module.parameters() if p.requires_grad)
        return self.fisher != "forward-only" and n <= _MAX_EXACT_BLOCK

    def _covered_names(self) -> List[str]:
        index = self._block_indices()
        covered = set()
        for ix in list(index.values()) + list(self._large.values()):
            covered.update(ix.reshape(-1).tolist())
        if self._large:
            warnings.warn(
                f"{type(self).__name__}: Kronecker factors larger than max_factor_size="
                f"{self.max_factor_size} in {sorted(_block_name(k) for k in self._large)}; "
                "these blocks are preconditioned by their per-sample Fisher diagonal.",
                stacklevel=4,
            )
        return [n for n, o in self._offsets.items() if o in covered]

    def factors(self) -> Dict[str, Any]:
        """Block name to the running ``(A, G)`` (``[groups, D, D]`` for grouped convs).

        A block reached by several registered outputs (terms) maps to the list of their
        ``(A, G)`` in registration order.
        """
        out: Dict[str, Any] = {}
        for key, terms in self.factors_.items():
            pairs = [
                (A[0], G[0]) if A.shape[0] == 1 else (A, G) for _, (A, G) in sorted(terms.items())
            ]
            out[_block_name(key)] = pairs[0] if len(pairs) == 1 else pairs
        return out

    # -- statistics ----------------------------------------------------------------------------
    def _stat_dtype(self, t: Tensor) -> torch.dtype:
        return torch.float64 if t.dtype == torch.float64 else torch.float32

    def _accumulate(self, name, module, rule, calls, with_g) -> None:
        if with_g and any(k[0] == name for k in self._large):
            expanded = rule.expanded_blocks(module, calls)
            for suffix, (a, g) in (expanded or {}).items():
                if (name, suffix) in self._large:
                    d = _expanded_diag(a, g)
                    self._add_step_stat(
                        (name, "<diag>" + suffix), [d.to(self._stat_dtype(d))], ("g",)
                    )
                else:
                    A_sum, G_sum, count = expanded_kfac(a, g, self.kfac_approx)
                    dt = self._stat_dtype(A_sum)
                    self._add_step_stat(
                        (name, suffix), [A_sum.to(dt), G_sum.to(dt), None], _KINDS, count
                    )
            return
        res = rule.kfac_factors(module, calls, self.kfac_approx, with_g)
        if res is None:
            if (name, "") not in self._index:
                if self.unsupported == "diagonal" and with_g:  # diagonal Fisher fallback
                    d = _per_vector_grads(rule, module, calls).pow(2).sum((0, 1))
                    self._add_step_stat((name, "<diag>"), [d.to(self._stat_dtype(d))], ("g",))
                return
            res = _exact_block_factors(rule, module, calls)
        lambdas: Dict[str, Tensor] = {}
        if self._ekfac and with_g and self._eig:
            bases = {}
            for key in res:
                k = (name, key)
                if k in self._eig and self._eig[k][0] == "one":
                    _, _, QA, _, QG = self._eig[k]
                    bases[_block_name(k)] = (QA, QG)
            lambdas = eigenvalue_corrections(name, module, rule, calls, bases)
        for suffix, (A_sum, G_sum, count) in res.items():
            key = (name, suffix)
            dt = self._stat_dtype(A_sum)
            lam = lambdas.get(_block_name(key))
            self._add_step_stat(
                key,
                [
                    A_sum.to(dt),
                    None if G_sum is None else G_sum.to(dt),
                    None if lam is None else lam.to(dt),
                ],
                _KINDS,
                count,
            )

    def _update_statistics(self, stats) -> None:
        beta = self.factor_decay
        for (name, suffix, term), values in stats.items():
            key = (name, suffix)
            if suffix.startswith("<diag>"):
                d, prev = values[0].reshape(-1), self._diag.get(key)
                self._diag[key] = d if prev is None else prev.mul_(beta).add_(d, alpha=1 - beta)
                continue
            A, G, lam = values
            if G is None:  # forward-only: G = I
                D_out = self._index[key].shape[1]
                G = torch.eye(D_out, dtype=A.dtype, device=A.device).expand(A.shape[0], -1, -1)
            terms = self.factors_.setdefault(key, {})
            old = terms.get(term)
            if old is None:
                terms[term] = [A, G.clone()]
            else:
                old[0].mul_(beta).add_(A, alpha=1 - beta)
                old[1].mul_(beta).add_(G, alpha=1 - beta)
            if lam is not None and term == 0:
                prev = self._lambda.get(key)
                self._lambda[key] = (
                    lam if prev is None else prev.mul_(beta).add_(lam, alpha=1 - beta)
                )

    def _needs_refresh(self) -> bool:
        return any(k not in self._decomposed for k in self.factors_)

    def _block_damping(self, key: Key) -> float:
        group = self._group_of().get(self._block_param[key], self.param_groups[0])
        return group["damping"]

    @staticmethod
    def _two_terms(terms: Dict[int, List[Tensor]]) -> Tuple[List[Tensor], List[Tensor]]:
        """The first term and the rest (merged: mean of the ``A``, sum of the ``G``)."""
        ordered = [terms[t] for t in sorted(terms)]
        first, rest = ordered[0], ordered[1:]
        if len(rest) == 1:
            return first, rest[0]
        A = sum(r[0] for r in rest) / len(rest)
        G = sum(r[1] for r in rest)
        return first, [A, G]

    def _refresh(self) -> None:
        """Decompose the factors: locally, or split over the ranks and shared.

        Blocks inverted by Cholesky (:meth:`_by_cholesky`) only keep their factors here,
        which every rank holds identically after the statistics' all-reduce: nothing is
        exchanged for them, and each rank that preconditions a block inverts it.
        """
        keys = sorted(self.factors_, key=repr)
        local = [k for k in keys if self._by_cholesky() and len(self.factors_[k]) == 1]
        shared = [k for k in keys if k not in local]
        results = self._decompose([k for k in shared if self._mine(k)])
        if self._comm is not None and self.decompose == "split" and shared:
            results = self._share(shared, results)
        results.update(self._keep_for_cholesky(local))
        for key in keys:
            self._install(key, *results[key])
        # the damped inverses of the Cholesky blocks at the damping of the moment, in one
        # batched pass (recomputed one by one only if the damping changes before a refresh)
        chol = [k for k in local if self._uses(k) and self._eig.get(k, ("",))[0] == "chol"]
        self._invert([(k, self._block_damping(k)) for k in chol])

    def _keep_for_cholesky(self, keys: List[Key]) -> Dict[Key, Tuple[str, Any]]:
        """Install payloads ``("chol", A, G)`` of single-term blocks inverted by Cholesky.

        Pi damping needs only the damped inverses: keep the factors of this refresh (their
        finiteness checked in one synchronization for all blocks) and invert them for the
        damping of the moment. A block with non-finite factors keeps its previous payload
        (``"kept"``) or fails. Blocks this rank does not precondition get ``None``.
        """
        used = [k for k in keys if self._uses(k)]
        pairs = [next(iter(self.factors_[k].values())) for k in used]
        flags = finite_flags([m for A, G in pairs for m in (A, G)])
        res: Dict[Key, Tuple[str, Any]] = {k: ("ok", None) for k in keys}
        for i, (key, (A, G)) in enumerate(zip(used, pairs)):
            bad = [f for f, ok in zip(("A", "G"), flags[2 * i : 2 * i + 2]) if not ok]
            if bad:
                what = f"{bad[0]} of '{_block_name(key) or '<model>'}'"
                res[key] = ("kept" if key in self._eig else "failed", non_finite_message(what))
            else:
                res[key] = ("ok", ("chol", A.clone(), G.clone()))
        return res

    def _decompose(self, keys: List[Key]) -> Dict[Key, Tuple[str, Any]]:
        """Per block ``("ok", eig)``, or ``("kept" | "failed", message)`` when eigh failed.

        The eigendecompositions of single-term blocks run through :func:`eighs`: their
        checks cost two synchronizations for all blocks, not a few per factor.
        """
        res: Dict[Key, Tuple[str, Any]] = {}
        single = []
        for key in keys:
            if len(self.factors_[key]) == 1:
                single.append(key)
                continue
            try:
                res[key] = ("ok", self._decompose_two(key, self.factors_[key]))
            except RuntimeError as err:
                res[key] = ("kept" if key in self._eig else "failed", str(err))
        mats, names = [], []
        for key in single:
            A, G = next(iter(self.factors_[key].values()))
            name = _block_name(key) or "<model>"
            mats += [A, G]
            names += [f"A of '{name}'", f"G of '{name}'"]
        outs = eighs(mats, names)
        for i, key in enumerate(single):
            a, g = outs[2 * i], outs[2 * i + 1]
            err = next((e for e in (a, g) if isinstance(e, Exception)), None)
            if err is None:
                res[key] = ("ok", ("one", *a, *g))
            else:
                res[key] = ("kept" if key in self._eig else "failed", str(err))
        return res

    def _by_cholesky(self) -> bool:
        """Whether single-term blocks are inverted with Cholesky instead of decomposed.

        KFAC with pi damping only ever uses ``(A + pi sqrt(lam) I)^{-1}`` and
        ``(G + sqrt(lam) / pi I)^{-1}``: a Cholesky factorization gives them about five
        times faster than ``eigh`` at several hundred rows (and more accurately in
        float32). Forming the inverse from an eigendecomposition costs about as much
        as the whole Cholesky route and ran on every rank anyway, so distributed runs
        use it too, without splitting: no decompositions to exchange.
        """
        return not self._ekfac and self.damping_mode == "pi"

    def _share(self, keys: List[Key], results: Dict[Key, Tuple[str, Any]]) -> Dict[Key, Any]:
        """Exchange the owners' results (one all-reduce of a zero-padded buffer).

        With ``precondition="all"`` every rank receives every decomposition; with
        ``"owner"`` only the status of each block (its decomposition stays on its owner).
        """
        comm = self._comm
        codes = {"ok": 1.0, "kept": 2.0, "failed": 3.0}
        codes_here = [codes[results[k][0]] if k in results else 0.0 for k in keys]
        status = torch.tensor(codes_here, dtype=torch.float64).to(comm.device)
        buffers: List[Tensor] = [status]
        layout = []
        for key in keys:
            mine = key in results
            if self.precondition == "owner":
                continue
            A, G = next(iter(self.factors_[key].values()))
            shapes = [A.shape[:-1], A.shape, G.shape[:-1], G.shape]
            ok = mine and results[key][0] == "ok"
            parts = []
            for j, shape in enumerate(shapes):
                t = results[key][1][1 + j].to(A.dtype) if ok else A.new_zeros(shape)
                parts.append(t.to(comm.device).contiguous())
            buffers += parts
            layout.append((key, parts, A.device))
        comm.all_reduce(buffers, "decompositions")
        shared: Dict[Key, Any] = {}
        parts_of = {key: (parts, dev) for key, parts, dev in layout}
        for key, code in zip(keys, status.tolist()):
            owner = self._owner.get(key, 0)
            if code == 1:
                if key in parts_of:
                    parts, dev = parts_of[key]
                    kind = "one" if len(self.factors_[key]) == 1 else "two"
                    eig = (kind, *(p.to(dev) for p in parts))
                    if kind == "two":
                        eig = (*eig, self._block_damping(key))
                    shared[key] = ("ok", eig)
                else:
                    shared[key] = results.get(key, ("ok", None))
            elif key in results:
                shared[key] = results[key]
            else:
                kind = "kept" if code == 2 else "failed"
                shared[key] = (kind, f"the decomposition failed on rank {owner}, its owner")
        return shared

    def _install(self, key: Key, status: str, payload: Any) -> None:
        name = _block_name(key) or "<model>"
        if status == "kept":
            warnings.warn(
                f"{type(self).__name__}: decomposition of '{name}' failed ({payload}); "
                "keeping the previous one. Consider a larger damping.",
                stacklevel=4,
            )
            return
        if status == "failed":
            raise RuntimeError(
                f"{type(self).__name__}: decomposition of layer '{name}' failed "
                f"repeatedly; increase damping (now {self._block_damping(key)}). "
                f"Cause: {payload}"
            )
        self._decomposed.add(key)
        if payload is None:  # owned by another rank (precondition="owner")
            return
        previous = self._eig.get(key)
        self._eig[key] = payload
        if payload[0] != "one":
            self._lambda.pop(key, None)  # two-term blocks use no eigenvalue correction
        elif self._ekfac and key in self._lambda and previous and previous[0] == "one":
            # diag of the previous EKFAC matrix in the new basis
            _, _, QA, _, QG = payload
            RA = (QA.mT @ previous[2]).pow(2)
            RG = (QG.mT @ previous[4]).pow(2)
            self._lambda[key] = RG @ self._lambda[key] @ RA.mT

    def _decompose_two(self, key: Key, terms) -> tuple:
        """``(A1 + pi sqrt(l) I) x (G1 + sqrt(l)/pi I) + A2 x G2`` simultaneously diagonalized."""
        (A1, G1), (A2, G2) = self._two_terms(terms)
        lam = self._block_damping(key)
        dA, dG = A1.shape[-1], G1.shape[-1]
        trA = A1.diagonal(dim1=-2, dim2=-1).sum(-1) / dA
        trG = G1.diagonal(dim1=-2, dim2=-1).sum(-1) / dG
        pi = pi_factor(trA, trG)[..., None, None]
        eyeA = torch.eye(dA, dtype=A1.dtype, device=A1.device)
        eyeG = torch.eye(dG, dtype=G1.dtype, device=G1.device)
        name = _block_name(key)
        muA, PA = generalized_eigh(A2, A1 + pi * lam**0.5 * eyeA, name=f"A of '{name}'")
        muG, PG = generalized_eigh(G2, G1 + lam**0.5 / pi * eyeG, name=f"G of '{name}'")
        return ("two", muA, PA, muG, PG, lam)

    # -- preconditioning ------------------------------------------------------------------------
    def _precondition(self, grads: Tensor) -> Tensor:
        groups = self._group_of()
        out = grads.clone()
        missing = [k for k in self._index if k not in self._eig and self._uses(k)]
        if missing and self.steps > 0 and not getattr(self, "_warned_missing", False):
            self._warned_missing = True
            warnings.warn(
                f"{type(self).__name__}: no curvature statistics yet for "
                f"{[_block_name(k) for k in missing]} (not reached by the curvature "
                "backward, or only non-finite batches); they get the plain gradient.",
                stacklevel=3,
            )
        for key, index in self._index.items():
            if key not in self._eig or not self._uses(key):
                continue
            ix = index.to(grads.device)
            M = _take(grads, ix)
            lam = self._block_damping(key)
            kind, *parts = self._eig[key]
            if kind == "chol" and (self._ekfac or self.damping_mode != "pi"):
                # e.g. a state saved with pi damping, loaded with exact damping
                self._eig[key] = self._eigendecompose(key, *parts)
                kind, *parts = self._eig[key]
            if kind == "two":
                if parts[-1] != lam:  # the damping changed (adaptive): decompose again
                    self._eig[key] = self._decompose_two(key, self.factors_[key])
                    kind, *parts = self._eig[key]
                muA, PA, muG, PG = (t.to(grads.dtype) for t in parts[:4])
                rot = (PG.mT @ M @ PA) / (1 + muG[..., :, None] * muA[..., None, :])
                _put(out, ix, PG @ rot @ PA.mT)
                continue
            if not self._ekfac and self.damping_mode == "pi":
                Ainv, Ginv = self._pi_inverses(key, lam)
                _put(out, ix, Ginv.to(grads.dtype) @ M @ Ainv.to(grads.dtype))  # two GEMMs
                continue
            lA, QA, lG, QG = (t.to(grads.dtype) for t in parts)
            rot = QG.mT @ M @ QA
            if self._ekfac and key in self._lambda:
                rot = rot / (self._lambda[key].to(grads.dtype) + lam)
            else:  # exact damping in the eigenbasis (KFAC "exact", EKFAC before Lambda)
                rot = rot / (lG[..., :, None] * lA[..., None, :] + lam)
            _put(out, ix, QG @ rot @ QA.mT)
        for key, d in self._diag.items():  # blocks on the diagonal fallback
            ix = self._diag_index(key).to(grads.device)
            group = groups.get(self._layer_param(key[0]), self.param_groups[0])
            _put(out, ix, _take(grads, ix) / (d.to(grads.dtype) + group["damping"]))
        if self.precondition == "owner" and self._comm is not None:
            out = out * self._owned_mask(out)
            self._comm.all_reduce([out], "directions")
        return out

    def _owned_mask(self, like: Tensor) -> Tensor:
        """1 at the positions this rank preconditions with ``precondition='owner'``.

        Every block belongs to its owner; positions outside the Kronecker blocks
        (diagonal blocks, plain gradients) to rank 0, so that the sum over ranks has
        each position exactly once.
        """
        if self._mask is None or self._mask.device != like.device:
            mask = torch.zeros(self._num_flat, dtype=torch.bool)
            blocks = torch.zeros(self._num_flat, dtype=torch.bool)
            for key, index in self._index.items():
                blocks[index.reshape(-1)] = True
                if self._mine(key):
                    mask[index.reshape(-1)] = True
            if self._comm.rank == 0:
                mask |= ~blocks
            self._mask = mask.to(like.device)
        return self._mask.to(like.dtype)

    def _pi_inverses(self, key: Key, lam: float) -> Tuple[Tensor, Tensor]:
        """Damped inverses ``(A + pi sqrt(lam) I)^{-1}``, ``(G + sqrt(lam)/pi I)^{-1}`` (cached)."""
        cached = self._inv.get(key)
        eig = self._eig[key]
        if cached is not None and cached[2] == lam and cached[3] is eig:
            return cached[0], cached[1]
        if eig[0] == "chol":
            self._invert([(key, lam)])
            return self._inv[key][0], self._inv[key][1]
        root = lam**0.5
        _, lA, QA, lG, QG = eig
        dA, dG = lA.shape[-1], lG.shape[-1]
        pi = pi_factor(lA.sum(-1) / dA, lG.sum(-1) / dG)
        Ainv = (QA / (lA + (pi * root)[..., None])[..., None, :]) @ QA.mT
        Ginv = (QG / (lG + (root / pi)[..., None])[..., None, :]) @ QG.mT
        self._inv[key] = (Ainv, Ginv, lam, eig)
        return Ainv, Ginv

    def _invert(self, jobs: List[Tuple[Key, float]]) -> None:
        """Cache the pi-damped inverses of Cholesky blocks ``(key, damping)`` (one pass).

        ``(A + pi sqrt(lam) I)^{-1}`` and ``(G + sqrt(lam) / pi I)^{-1}`` with the pi of
        the factors' mean eigenvalues (their mean diagonals); the factorizations' outcomes
        are read in one synchronization for all blocks.
        """
        mats, shifts, names = [], [], []
        for key, lam in jobs:
            _, A, G = self._eig[key]
            trA = A.diagonal(dim1=-2, dim2=-1).clamp_min(0).mean(-1)
            trG = G.diagonal(dim1=-2, dim2=-1).clamp_min(0).mean(-1)
            pi, root = pi_factor(trA, trG), lam**0.5
            name = _block_name(key) or "<model>"
            mats += [A, G]
            shifts += [pi * root, root / pi]
            names += [f"A of '{name}'", f"G of '{name}'"]
        invs = damped_inverses(mats, shifts, names=names, check_finite=False)  # checked
        for i, (key, lam) in enumerate(jobs):
            self._inv[key] = (invs[2 * i], invs[2 * i + 1], lam, self._eig[key])

    def _eigendecompose(self, key: Key, A: Tensor, G: Tensor) -> tuple:
        """``("one", lA, QA, lG, QG)``: the eigendecompositions of a block's factors."""
        name = _block_name(key) or "<model>"
        return ("one", *eigh(A, name=f"A of '{name}'"), *eigh(G, name=f"G of '{name}'"))

    def _diag_index(self, key) -> Tensor:
        """Flat positions of a diagonal block: a large Kronecker block or a whole layer."""
        name, tag = key
        sub = tag[len("<diag>") :]
        if (name, sub) in self._large:
            return self._large[(name, sub)].reshape(-1)
        module, _ = self._layers[name]
        return _exact_index(module, name, self._offsets)

    def _curvature_matvec(self, v: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for key, index in self._index.items():
            if key not in self.factors_:
                continue
            ix = index.to(v.device)
            M = _take(v, ix)
            if self._ekfac and key in self._lambda and self._eig.get(key, ("",))[0] == "one":
                _, _, QA, _, QG = (
                    t if isinstance(t, str) else t.to(v.dtype) for t in self._eig[key]
                )
                _put(out, ix, QG @ ((QG.mT @ M @ QA) * self._lambda[key].to(v.dtype)) @ QA.mT)
            else:
                _put(
                    out,
                    ix,
                    sum(G.to(v.dtype) @ M @ A.to(v.dtype) for A, G in self.factors_[key].values()),
                )
        for key, d in self._diag.items():
            ix = self._diag_index(key).to(v.device)
            _put(out, ix, d.to(v.dtype) * _take(v, ix))
        return out

    def _layer_param(self, name: str):
        module, _ = self._layers[name]
        return next(p for p in module.parameters() if p.requires_grad)

    # -- state ------------------------------------------------------------------------------------
    def _curvature_state(self) -> Dict[str, Any]:
        return {
            "factors": {
                k: {t: [x.clone() for x in v] for t, v in terms.items()}
                for k, terms in self.factors_.items()
            },
            "eig": {k: tuple(_clone(t) for t in v) for k, v in self._eig.items()},
            "lambda": {k: v.clone() for k, v in self._lambda.items()},
            "diag": {k: v.clone() for k, v in self._diag.items()},
        }

    def _load_curvature_state(self, state: Dict[str, Any]) -> None:
        self.factors_ = {
            tuple(k): {t: [x.clone() for x in v] for t, v in terms.items()}
            for k, terms in state["factors"].items()
        }
        self._eig = {tuple(k): tuple(_clone(t) for t in v) for k, v in state["eig"].items()}
        self._lambda = {tuple(k): v.clone() for k, v in state["lambda"].items()}
        self._diag = {k: v.clone() for k, v in state["diag"].items()}
        if self.precondition == "owner" and self._comm is not None:
            # the saving rank held only its own blocks' decompositions: every rank
            # decomposes again at the next step (the same step everywhere)
            self._eig, self._inv = {}, {}
        self._decomposed = set(self._eig)


class EKFAC(KFAC):
    """Eigenvalue-corrected KFAC (George et al., 2018); the same arguments as :class:`KFAC`.

    The Kronecker eigenbasis is refreshed every ``inverse_every`` steps; in between, the
    eigenvalues are replaced by the running second moments of the per-sample gradients
    projected into that basis, re-estimated every ``factor_every`` steps.
    """

    _ekfac = True


def _local_offsets(name, offsets):
    prefix = f"{name}." if name else ""
    return {n[len(prefix) :]: o for n, o in offsets.items() if n.startswith(prefix)}


def _exact_index(module, name, offsets):
    prefix = f"{name}." if name else ""
    ix = [
        torch.arange(offsets[prefix + n], offsets[prefix + n] + p.numel())
        for n, p in module.named_parameters()
        if p.requires_grad and prefix + n in offsets
    ]
    return torch.cat(ix)
