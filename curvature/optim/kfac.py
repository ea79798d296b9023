"""``KFAC`` and ``EKFAC`` optimizers (``torch.optim.Optimizer`` subclasses).

The optimizers route statistics to curvature blocks (:mod:`curvature.blocks`), which own
the maths. Per layer block (running factors ``A``, ``G``, damping ``lambda``) the
direction for the gradient matrix ``M`` (rows: outputs, columns: inputs, bias last) is

    pi (default):     (G + sqrt(lambda)/pi I)^{-1} M (A + pi sqrt(lambda) I)^{-1}
    per_factor:       (G + lambda I)^{-1} M (A + lambda I)^{-1}
    exact:            QG [ (QG^T M QA) / (lG lA^T + lambda) ] QA^T
    EKFAC:            QG [ (QG^T M QA) / (Lambda + lambda) ] QA^T

with ``Lambda`` the running second moments of the per-sample gradients in the Kronecker
eigenbasis (George et al., 2018; the basis tracked by :mod:`curvature.blocks.power`),
carried into a refreshed basis as the diagonal of the previous EKFAC matrix
(:class:`~curvature.blocks.EigenCorrectedBlock`). A block reached by two registered
outputs (a PINN's interior and boundary terms) is a :class:`~curvature.blocks.KroneckerSumBlock`
(every term damped, the sum inverted exactly). Blocks with a factor over ``max_factor_size``
are one-sided (:mod:`.large`); layers without a Kronecker rule are ``DiagonalBlock``
(``unsupported="diagonal"``) or exact blocks (``A = [[1]]``, as the small layers under
``exact_layer_size``: :mod:`.exact_layers`).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..blocks import (
    DiagonalBlock,
    EigenCorrectedBlock,
    KroneckerBlock,
    KroneckerSumBlock,
    OneSidedBlock,
    Outcome,
    RefreshStatus,
    eigendecompositions,
    inverse_into,
    refresh_blocks,
    snapshots,
)
from ..foreach import in_dtype
from ..layer_diagonal import chunked_corrections, chunked_kfac_factors
from ..layer_stats import (
    MAX_EXACT_BLOCK,
    block_name,
    exact_factors,
    fisher_diagonal,
    layer_numel,
    layer_positions,
)
from ..layers.conv_taps import MAX_LIVE_FRACTION
from ..layers.precision import statistics_precision
from ..layers.registry import library_method
from ..layout import put, take
from ..options import DampingMode, FisherType, KFACApproxType, Unsupported
from ..warn import warn
from .base import CurvatureOptimizer
from .config import CurvatureConfig, check_kfac_arguments
from .deferred import read_flags, waiting_flags
from .distributed import owned_mask, share_outcomes
from .exact_layers import check_exact_layer_size, exact_layer_names
from .kfac_state import KroneckerState
from .large import accumulate_large, check_mode, large_message, new_block
from .statistics import stat_dtype
from .watch import GroupIndex

Key = Tuple[str, str]
KINDS = ("A", "G", "g")  # statistics values of a block: A, G, EKFAC's corrections


class KFAC(KroneckerState, CurvatureOptimizer):
    """Kronecker-factored natural gradient (Martens & Grosse, 2015).

    Example:
        >>> optim = curvature.KFAC(model, lr=1e-2, damping=1e-3, kl_clip=1e-3)  # doctest: +SKIP
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
        inverse_warmup (int): The first this many steps refresh every step, whatever
            ``inverse_every`` (default 0: off): young factors and fast-moving parameters
            can make even a one-step-old preconditioner blow the step up (the small CNN
            of benchmarks/training.py with ``stale_clip=None``; docs/optimizers.md).
        kl_clip (float | None): KL clipping (Ba, Grosse & Martens, 2017): the update
            ``-lr d`` is scaled by ``nu = min(1, sqrt(kl_clip / sum_p lr_p^2 d_p^T g_p))``
            (default None: off; ``kl_clip=1e-3`` is a safe start, see docs/optimizers.md).
        stale_clip (float | None): Between two refreshes each parameter's direction is
            scaled to at most ``stale_clip`` times its norm at the last refresh step
            (default 2.0; ``None``: off): stale inverses where the curvature grows fast
            (a CNN's first steps) otherwise blow the step up (docs/optimizers.md,
            "Defaults and a safe start"; :mod:`curvature.optim.stale_clip`). Not used by
            the line search and ``update_rule="quadratic"``.
        damping_mode (str): ``"pi"`` (default; ``(A + pi sqrt(lambda) I) x (G +
            sqrt(lambda)/pi I)``, Cholesky), ``"per_factor"`` (``(A + lambda I) x (G +
            lambda I)``, Cholesky; the PINN convention of Dangel, Mueller & Zeinhofer,
            2024) or ``"exact"`` (``kron(G, A) + lambda I`` in the eigenbasis). Sum
            blocks damp every term (``"exact"``: pi). EKFAC's single blocks are exact.
        max_factor_size (int): Blocks with a Kronecker factor larger than this (default
            4096) keep that factor as its diagonal (with a warning naming them):
            decomposing a factor of size 10k takes minutes on a small CPU.
        large_factors (str): Those blocks' structure: ``"diagonal_factor"`` (default;
            :class:`~curvature.blocks.OneSidedBlock`, the small factor full) or
            ``"per_sample_diagonal"`` (the per-sample Fisher diagonal).
        statistics_dtype (torch.dtype | None): The Kronecker statistics' GEMMs in this
            narrower dtype (e.g. ``torch.bfloat16``; default None: the model's); numerics:
            :mod:`curvature.layers.precision`, docs/optimizers.md.
        exact_layer_size (int): Layers with at most this many trainable parameters keep
            their exact Fisher block, one dense ``[P_l, P_l]`` matrix ``sum u u^T`` of the
            per-vector gradients, instead of ``A (x) G`` (default 0: none; at most 4096;
            KFAC only; :mod:`curvature.optim.exact_layers`). ``factors()`` gives such a
            layer ``A = [[1]]`` and ``G`` the block.
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
        grad_scaler (torch.amp.GradScaler | None): The ``torch.amp.GradScaler`` of the
            loop (optional: ``scaler.step(optim)`` hands its scale to ``step()``; needed
            after ``scaler.unscale_(optim)`` and for ``update_rule="quadratic"``; see
            :mod:`curvature.optim.amp`).
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
        update_rule (str): ``"fixed"`` (default: ``lr``, ``momentum``) or ``"quadratic"``
            (both from the local quadratic model, in a plain loop or with a closure:
            :mod:`curvature.optim.quadratic`).
        reduction_ratio (str): How the plain loop's quadratic rule measures a step for
            Levenberg-Marquardt: ``"same_batch"`` (default: the step's forward and loss
            run once more, without gradients, at each adaptation; :mod:`.replay`) or
            ``"next_batch"`` (the next forward's loss). With a closure: the closure.
        factor_damping (str): ``"tied"`` (default: ``damping`` damps the Kronecker factors
            and the quadratic model) or ``"greedy"`` (``update_rule="quadratic"`` with a
            closure: the factors' own damping, chosen by the quadratic model every few
            steps; :mod:`curvature.optim.factor_damping`).
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
        inverse_method (str): How pi damping inverts a single-term block: ``"cholesky"``
            (default; the damped factors by Cholesky) or ``"eigh"`` (from the factors'
            eigendecompositions, split over the ranks with ``decompose="split"``). The
            same matrices up to rounding.
        eigenbasis_update (str | None): How EKFAC's refreshes after the first renew its
            eigenbases: ``"power"`` (EKFAC's default: one step of subspace iteration from
            the previous basis and a QR; no eigendecomposition, no host read on a GPU;
            :mod:`curvature.blocks.power`) or ``"eigh"`` (eigendecompositions; KFAC's only).

    Warning:
        Statistics of ``"empirical"`` assume that the gradient accumulated in ``.grad``
        (averaged over the ranks) is the gradient of ``loss_func`` over the union of
        the step's micro-batches (and ranks): a plain mean loss on one process, ``loss /
        k`` over ``k`` equal micro-batches; each forward's backward must run before the
        next training forward.

    """

    block_type = KroneckerBlock
    stale_inverses = True

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        damping: float = 1e-3,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        *,
        fisher: Union[str, FisherType] = "empirical",
        loss_func: Optional[nn.Module] = None,
        mc_samples: int = 1,
        kfac_approx: Union[str, KFACApproxType] = "expand",
        factor_decay: float = 0.95,
        factor_every: int = 1,
        inverse_every: int = 10,
        kl_clip: Optional[float] = None,
        damping_mode: Union[str, DampingMode] = "pi",
        unsupported: Union[str, Unsupported] = "warn",
        auto_output: bool = True,
        seed: int = 0,
        param_groups: Optional[Sequence[Dict[str, Any]]] = None,
        grad_scaler: Any = None,
        adaptive_damping: bool = False,
        damping_adaptation_interval: int = 5,
        damping_adaptation_decay: float = 0.95,
        line_search_grid: Optional[Sequence[float]] = None,
        update_rule: str = "fixed",
        reduction_ratio: str = "same_batch",
        factor_damping: str = "tied",
        distributed: Optional[bool] = None,
        process_group: Any = None,
        sync_grads: Optional[bool] = None,
        comm_timeout: float = 300.0,
        bucket_mb: float = 25.0,
        max_factor_size: int = 4096,
        decompose: str = "split",
        precondition: str = "all",
        inverse_method: str = "cholesky",
        eigenbasis_update: Optional[str] = None,
        large_factors: str = "diagonal_factor",
        statistics_dtype: Optional[torch.dtype] = None,
        exact_layer_size: int = 0,
        inverse_warmup: int = 0,
        stale_clip: Optional[float] = 2.0,
    ):
        check_kfac_arguments(
            type(self).__name__,
            issubclass(self.block_type, EigenCorrectedBlock),
            max_factor_size,
            decompose,
            precondition,
            inverse_method,
            statistics_dtype,
            eigenbasis_update,
        )
        self.max_factor_size, self.statistics_dtype = max_factor_size, statistics_dtype
        ekfac = issubclass(self.block_type, EigenCorrectedBlock)
        self.exact_layer_size = check_exact_layer_size(type(self).__name__, exact_layer_size, ekfac)
        self.large_factors = check_mode(type(self).__name__, large_factors)
        self.decompose, self.precondition, self.inverse_method = (
            decompose,
            precondition,
            inverse_method,
        )
        self.eigenbasis_update = eigenbasis_update or ("power" if ekfac else "eigh")  # (None)
        self._blocks: Dict[Key, Any] = {}
        self._diag: Dict[Key, DiagonalBlock] = {}
        self._large: Dict[Key, Tensor] = {}
        self._decomposed: set = set()
        self._term_of: Dict[Key, int] = {}  # the term of a single-term block
        self._live_now: Dict[Key, Optional[Tuple[int, ...]]] = {}  # this step's, per block
        self._warned_missing = False
        config = CurvatureConfig.from_arguments(type(self).__name__, locals())
        super().__init__(model, lr, damping, momentum, weight_decay, config, param_groups)
        self._structure()

    @property
    def blocks(self) -> Dict[str, Any]:
        """Block name to its curvature block (:mod:`curvature.blocks`), once it has statistics."""
        out: Dict[str, Any] = {block_name(*k): b for k, b in self._blocks.items()}
        out.update({block_name(*k): b for k, b in self._diag.items()})
        return out

    def _reset_curvature(self) -> None:
        self._blocks, self._diag, self._large = {}, {}, {}
        self._decomposed, self._term_of, self._live_now = set(), {}, {}
        self._structure()

    def _structure(self) -> None:
        self._index = self._block_indices()
        starts = sorted(
            (self.layout.offsets[n], p) for n, p in zip(self.layout.names, self.layout.params)
        )
        self._block_param = {}
        for key, ix in self._index.items():
            pos = int(ix.reshape(-1)[0])
            self._block_param[key] = max((s for s in starts if s[0] <= pos), key=lambda s: s[0])[1]
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
        forward_only = self.config.fisher == FisherType.FORWARD_ONLY
        exact = exact_layer_names(self._layers, self._tied, self.exact_layer_size, forward_only)
        self._exact_layers = exact
        for name, (module, rule) in self._layers.items():
            if self._tied.tied(name):  # a Kronecker block cannot hold a shared parameter
                continue
            if name in exact:  # exact_layer_size: one dense block over the layer's parameters
                index[(name, "")] = layer_positions(self.layout, name, module, rule).view(1, -1, 1)
                continue
            local = rule.kfac_index(module, self.layout.local_offsets(name))
            if local is not None:
                for suffix, ix in local.items():
                    if max(ix.shape[1], ix.shape[2]) > self.max_factor_size and not forward_only:
                        self._large[(name, suffix)] = ix  # too large to decompose: diagonal
                    else:
                        index[(name, suffix)] = ix
            elif self._exact_ok(module, rule):
                index[(name, "")] = layer_positions(self.layout, name, module, rule).view(1, -1, 1)
        return index

    def _exact_ok(self, module, rule) -> bool:
        forward_only = self.config.fisher == FisherType.FORWARD_ONLY
        return not forward_only and layer_numel(module, rule) <= MAX_EXACT_BLOCK

    def _covered_names(self) -> List[str]:
        index = self._block_indices()
        covered = self.layout.covered_names([*index.values(), *self._large.values()])
        if self._large:
            warn(large_message(self, sorted(block_name(*k) for k in self._large)))
        return covered

    # -- statistics ----------------------------------------------------------------------------
    def _accumulate(self, name, module, rule, calls, with_g, emit) -> None:
        approx = self.config.kfac_approx.value
        if with_g and any(k[0] == name for k in self._large):
            return accumulate_large(name, module, rule, calls, approx, self._large, self, emit)
        # the sums are new tensors of this step where the library computed them: a
        # built-in rule's (or the base class's) kfac_factors, or the exact factors
        owned = library_method(rule, "kfac_factors")
        if with_g and name in self._exact_layers:  # exact_layer_size: one dense block
            res, owned = exact_factors(rule, module, calls), True
        else:
            with statistics_precision(self.statistics_dtype):  # (patches in chunks)
                res = chunked_kfac_factors(rule, module, calls, approx, with_g)
        if res is None:
            if (name, "") not in self._index:
                if self.config.unsupported == Unsupported.DIAGONAL and with_g:
                    _, parts = fisher_diagonal(rule, module, calls)
                    d = parts[""]
                    emit((name, ""), [d.to(stat_dtype(d))], ("g",))
                return
            res, owned = exact_factors(rule, module, calls), True
        lambdas: Dict[str, Tensor] = {}
        if with_g and issubclass(self.block_type, EigenCorrectedBlock):
            bases = {}
            for suffix in res:
                block = self._blocks.get((name, suffix))
                basis = block.basis() if isinstance(block, EigenCorrectedBlock) else None
                if basis is not None:
                    bases[block_name(name, suffix)] = (basis.QA, basis.QG)
            if bases:  # convolutions: a chunk of samples' patches at a time
                lambdas = chunked_corrections(name, module, rule, calls, bases)
        if "" in res and (name, "") in self._index and name not in self._exact_layers:
            self._note_live(name, module, rule, calls, res[""][0])
        for suffix, (A_sum, G_sum, count) in res.items():
            dt = stat_dtype(A_sum)
            lam = lambdas.get(block_name(name, suffix))
            values = [None if v is None else in_dtype(v, dt) for v in (A_sum, G_sum, lam)]
            emit((name, suffix), values, KINDS, count, owned)

    def _update_curvature(self, stats) -> None:
        beta = self.config.factor_decay
        for (name, suffix, term), (values, valid) in stats.items():
            key = (name, suffix)
            if key not in self._index:  # a diagonal block
                block = self._diag.get(key)
                if block is None:
                    ix = self._large.get(key, self._diag_index(key))
                    block = self._diag[key] = new_block(key, values, ix, self.max_factor_size)
                block.update(*values, beta, valid)
                continue
            A, G, lam = values
            if G is None:  # forward-only: G = I
                D_out = self._index[key].shape[1]
                G = torch.eye(D_out, dtype=A.dtype, device=A.device).expand(A.shape[0], -1, -1)
            block = self._blocks.get(key)
            if block is None:
                block = self._blocks[key] = self.block_type(block_name(*key), self._index[key])
                self._term_of[key] = term
            if not isinstance(block, KroneckerSumBlock) and term != self._term_of[key]:
                # a second term reaches the block: a sum of Kronecker products from now on
                mode = "per_factor" if self.config.damping_mode.value == "per_factor" else "pi"
                block = KroneckerSumBlock.from_block(block, self._term_of[key], mode)
                self._blocks[key] = block
                self._decomposed.discard(key)
            if isinstance(block, KroneckerSumBlock):
                block.update(A, G, beta, term, valid)
            else:
                if type(block) is KroneckerBlock:  # (the columns of A it may fill)
                    most = int(MAX_LIVE_FRACTION * block.index.shape[-1])
                    block.widen(self._live_now.get(key), most)
                block.update(A, G, beta, valid)
            if lam is not None and term == 0 and isinstance(block, EigenCorrectedBlock):
                block.update_corrections(lam, beta, valid)
        self._live_now = {}

    def _diag_index(self, key: Key) -> Tensor:
        """Flat positions of a diagonal block: a large Kronecker block or a whole layer."""
        if key in self._large:
            return self._large[key].reshape(-1)
        if key[0] not in self._layers:  # a group of tied layers
            return self._tied.index(key[0])
        return layer_positions(self.layout, key[0], *self._layers[key[0]])

    def _needs_refresh(self) -> bool:
        return any(k not in self._decomposed for k in self._blocks)

    def _block_damping(self, key: Key, index: Optional[GroupIndex] = None) -> float:
        return self._group_damping(self._block_param[key], index)

    # -- refresh -------------------------------------------------------------------------------
    def _by_cholesky(self, block) -> bool:
        """Whether a block is inverted by Cholesky (KFAC, pi damping: about five times
        faster than ``eigh``; identical factors on every rank, nothing exchanged).
        """
        return (
            type(block) is KroneckerBlock
            and self.config.damping_mode != DampingMode.EXACT
            and self.inverse_method == "cholesky"
        )

    def _refresh(self) -> None:
        """Decompose (or snapshot) every block: locally, or split over the ranks and shared;
        reads the deferred device values (:mod:`.deferred`) in its first synchronization.
        """
        keys = sorted(self._blocks, key=repr)
        local = [k for k in keys if self._by_cholesky(self._blocks[k])]
        shared = [k for k in keys if k not in local]
        # (each layer's groups checked for one damping here, at a refresh: not per step)
        damping_of = {
            self._blocks[k]: self._layer_damping(k[0], self._block_param[k]) for k in keys
        }
        deferred = self._reads.tensors(self._collector.stats)
        waiting, flags = waiting_flags([*self._blocks.values(), *self._diag.values()])
        also = deferred + flags
        mine = [self._blocks[k] for k in shared if self._mine(k)]
        # the one-sided blocks' full sides: with the eigendecompositions where there are
        # some (one read, joint batched calls), else on their own (no read)
        onesided = [b for b in self._diag.values() if isinstance(b, OneSidedBlock)]
        power, jointly = self.eigenbasis_update == "power", (also, onesided) if shared else ([], [])
        by_block, read = eigendecompositions(mine, damping_of.get, *jointly, power=power)
        outcomes = {k: by_block[self._blocks[k]] for k in shared if self._mine(k)}
        if self._comm is not None and self.decompose == "split" and shared:
            outcomes = share_outcomes(
                self._comm,
                {k: self._blocks[k] for k in shared},
                outcomes,
                self._owner,
                self.precondition != "owner",
                self._block_damping,
            )
        used = [self._blocks[k] for k in local if self._uses(k)]
        mode = self.config.damping_mode.value
        snaps, inverses, extra = snapshots(
            used, damping_of.get, mode, [] if shared else also, keep=self.config.adapts_damping
        )
        read = read if shared else extra
        read_flags(waiting, read[len(deferred) :])
        for k in local:
            outcomes[k] = snaps.get(self._blocks[k], Outcome(RefreshStatus.OK))
        if not shared:
            refresh_blocks(onesided)
        for key in keys:
            if getattr(self._blocks[key], "fresh", None) is None:  # else: no statistics yet
                self._install(key, outcomes[key])
        # the Cholesky blocks' damped inverses at the damping of the moment, taken with
        # their records (a block that kept its previous record keeps its inverses, or
        # recomputes them from its snapshot when used)
        for block, inv in inverses.items():
            if block.record is inv.source:
                block.inverses = inv
        self._reads.settle(self._collector.stats, read[: len(deferred)])

    def _install(self, key: Key, outcome: Outcome) -> None:
        name = block_name(*key) or "<model>"
        if outcome.status is RefreshStatus.KEPT:
            warn(
                f"{type(self).__name__}: decomposition of '{name}' failed ({outcome.cause}); "
                "keeping the previous one. Consider a larger damping."
            )
            return
        if outcome.status is RefreshStatus.FAILED:
            raise RuntimeError(
                f"{type(self).__name__}: decomposition of layer '{name}' failed "
                f"repeatedly; increase damping (now {self._block_damping(key)}). "
                f"Cause: {outcome.cause}"
            )
        self._decomposed.add(key)
        if outcome.record is not None:  # None: owned by another rank (precondition="owner")
            self._blocks[key].install(outcome.record)

    # -- preconditioning ------------------------------------------------------------------------
    def _precondition(self, grads: Tensor, out: Optional[Tensor] = None) -> Tensor:
        self._warn_missing([k for k in self._index if self._record(k) is None and self._uses(k)])
        mode = self.config.damping_mode.value
        groups = self._groups.of(self.layout, self.param_groups)  # (once per step)
        indices, jobs = [], []  # every block's entries gathered and scattered at once
        for key, index in self._index.items():
            if self._record(key) is None or not self._uses(key):
                continue
            indices.append(self._ix(index, grads.device))
            damping = self._block_damping(key, groups)
            jobs.append(partial(inverse_into, self._blocks[key], damping=damping, mode=mode))
        for key, block in self._diag.items():  # blocks on the diagonal fallback
            indices.append(self._ix(block.index, grads.device))
            damping = self._group_damping(self._layer_param(key[0]), groups)
            jobs.append(partial(inverse_into, block, damping=damping, mode=mode))
        out = self._gather.apply(grads, indices, jobs, out=out)
        if self.precondition == "owner" and self._comm is not None:
            out = out * self._owned_mask(out)
            self._comm.all_reduce([out], "directions")
        return out

    def _record(self, key: Key):
        return getattr(self._blocks.get(key), "record", None)

    def _owned_mask(self, like: Tensor) -> Tensor:
        """1 at the positions this rank preconditions with ``precondition='owner'``."""
        if self._mask is None or self._mask.device != like.device:
            mine = [k for k in self._index if self._mine(k)]
            self._mask = owned_mask(self.layout.numel, self._index, mine, self._comm.rank)
            self._mask = self._mask.to(like.device)
        return self._mask.to(like.dtype)

    def _curvature_matvec(self, v: Tensor) -> Tensor:
        out = torch.zeros_like(v)
        for block in [*self._blocks.values(), *self._diag.values()]:
            ix = self._ix(block.index, v.device)
            put(out, ix, block.matvec(take(v, ix)))
        return out

    def _layer_param(self, name: str):
        module, _ = self._layers.get(name) or self._layers[self._tied.first_layer(name)]
        return next(p for p in module.parameters() if p.requires_grad)


class EKFAC(KFAC):
    """Eigenvalue-corrected KFAC (George et al., 2018); the same arguments as :class:`KFAC`.

    The Kronecker eigenbasis is refreshed every ``inverse_every`` steps (after the first
    decomposition by one subspace iteration: ``eigenbasis_update``); its eigenvalues are
    replaced by the running second moments of the per-sample gradients projected into it,
    re-estimated every ``factor_every`` steps (blocks:
    :class:`~curvature.blocks.EigenCorrectedBlock`; damping always exact).
    """

    block_type = EigenCorrectedBlock
    _per_sample_statistics = True
