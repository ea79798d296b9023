"""The structure of a curvature optimizer, validated once: a frozen config.

Per-group tunables (``lr``, ``damping``, ``momentum``, ``weight_decay``) live in the
optimizer's ``param_groups`` as in ``torch.optim``; everything that fixes the algorithm's
structure (Fisher type, update periods, damping form, distributed options) is checked
here, in the constructor, with an error that names the argument, the value and what is
allowed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..layers.precision import STATISTICS_DTYPES
from ..losses import SUPPORTED_LOSSES, check_loss
from ..options import DampingMode, FisherType, KFACApproxType, Unsupported, choice


def check(who: str, arg: str, value: Any, ok: bool, allowed: str) -> None:
    """``ValueError(f"{who}({arg}={value!r}): {arg} {allowed}.")`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{who}({arg}={value!r}): {arg} {allowed}.")


def check_hyperparameters(
    who: str, lr: float, damping: float, momentum: float, weight_decay: float
) -> None:
    """The per-group tunables (defaults, or one param group's values)."""
    check(who, "lr", lr, lr >= 0, "must be >= 0")
    check(
        who,
        "damping",
        damping,
        damping > 0,
        "must be > 0; it is added to the curvature before inversion, typical values 1e-4 ... 1e-1",
    )
    check(who, "momentum", momentum, 0 <= momentum < 1, "must be in [0, 1)")
    check(who, "weight_decay", weight_decay, weight_decay >= 0, "must be >= 0")


def check_group(
    who: str,
    group: Dict[str, Any],
    params: Sequence[Any],
    names: Dict[Any, str],
    where: str,
    model: str,
) -> None:
    """A param group's tunables (``group`` with the defaults filled in) and parameters.

    Raises:
        ValueError: For a negative ``lr`` / ``momentum`` / ``weight_decay``, ``damping <=
            0``, or a parameter that is not one of the model's (``names``).

    """
    for key in ("lr", "damping", "momentum", "weight_decay"):
        value = group[key]
        if value < 0 or (key == "damping" and value <= 0):
            allowed = "must be > 0" if key == "damping" else "must be >= 0"
            raise ValueError(f"{who}: param group {key}={value} is invalid; {key} {allowed}.")
    for i, p in enumerate(params):
        if isinstance(p, Tensor) and p not in names:
            raise ValueError(
                f"{who}: the parameter of shape {list(p.shape)} at {where}['params'][{i}] "
                f"is not a parameter of the model the optimizer was built on ({model}); it "
                "would get a gradient but never be updated. Give it its own optimizer (e.g. "
                "torch.optim.AdamW([param])), or make it a parameter of the model before "
                "building the optimizer."
            )


def check_kfac_arguments(
    who: str,
    ekfac: bool,
    max_factor_size: int,
    decompose: str,
    precondition: str,
    inverse_method: str,
    statistics_dtype: Optional[torch.dtype] = None,
    eigenbasis_update: Optional[str] = None,
) -> None:
    """The structure arguments of :class:`~curvature.KFAC` / ``EKFAC`` beyond the config."""
    if statistics_dtype is not None and statistics_dtype not in STATISTICS_DTYPES:
        raise ValueError(
            f"{who}(statistics_dtype={statistics_dtype!r}): None (the model's dtype) or one "
            f"of {', '.join(str(d) for d in STATISTICS_DTYPES)} (the Kronecker statistics' "
            "GEMMs in that dtype where it is narrower than the model's)."
        )
    if not isinstance(max_factor_size, int) or max_factor_size < 1:
        raise ValueError(
            f"{who}(max_factor_size={max_factor_size!r}): a positive int; "
            "blocks with a larger Kronecker factor keep that factor as its diagonal."
        )
    if decompose not in ("split", "all"):
        raise ValueError(
            f"{who}(decompose={decompose!r}): 'split' (each block's decompositions on "
            "one rank, then shared) or 'all' (every rank decomposes every block)."
        )
    if precondition not in ("all", "owner"):
        raise ValueError(
            f"{who}(precondition={precondition!r}): 'all' (every rank preconditions "
            "every block) or 'owner' (each block on its owner rank, the preconditioned "
            "gradient is shared)."
        )
    if precondition == "owner" and (decompose != "split" or ekfac):
        raise ValueError(
            f"{who}(precondition='owner') needs decompose='split' and KFAC (EKFAC's "
            "corrections need every block's eigenbasis on every rank)."
        )
    if inverse_method not in ("cholesky", "eigh"):
        raise ValueError(
            f"{who}(inverse_method={inverse_method!r}): 'cholesky' (default) or 'eigh'."
        )
    if eigenbasis_update not in (None, "eigh", "power") or (
        eigenbasis_update == "power" and not ekfac
    ):
        raise ValueError(
            f"{who}(eigenbasis_update={eigenbasis_update!r}): None (the default: 'power' for "
            "EKFAC, 'eigh' for KFAC), 'eigh' (eigendecompositions at every refresh) or, for "
            "EKFAC only, 'power' (one subspace iteration from the previous eigenbasis)."
        )


@dataclass(frozen=True)
class CurvatureConfig:
    """The validated structure arguments of :class:`~curvature.KFAC` and its siblings.

    See :class:`~curvature.KFAC` for the meaning of each field; ``who`` is the
    optimizer's class name, used in messages.
    """

    who: str
    fisher: FisherType = FisherType.EMPIRICAL
    loss_func: Optional[nn.Module] = None
    mc_samples: int = 1
    kfac_approx: KFACApproxType = KFACApproxType.EXPAND
    factor_decay: float = 0.95
    factor_every: int = 1
    inverse_every: int = 10
    inverse_warmup: int = 0
    kl_clip: Optional[float] = None
    stale_clip: Optional[float] = 2.0
    damping_mode: DampingMode = DampingMode.PI
    unsupported: Unsupported = Unsupported.WARN
    auto_output: bool = True
    seed: int = 0
    grad_scaler: Any = None
    adaptive_damping: bool = False
    damping_adaptation_interval: int = 5
    damping_adaptation_decay: float = 0.95
    line_search_grid: Optional[Tuple[float, ...]] = None
    update_rule: str = "fixed"
    reduction_ratio: str = "same_batch"
    factor_damping: str = "tied"
    distributed: Optional[bool] = None
    process_group: Any = None
    sync_grads: Optional[bool] = None
    comm_timeout: float = 300.0
    bucket_mb: float = 25.0

    @property
    def adapts_damping(self) -> bool:
        """Whether the damping changes between refreshes by design (Levenberg-Marquardt
        or the quadratic rule): the Cholesky refresh then keeps a copy of the factors, for
        the inverses at each new damping (:func:`~curvature.blocks.snapshots`).
        """
        return self.adaptive_damping or self.update_rule == "quadratic"

    def check_closure(self, closure: Any) -> None:
        """A ``ValueError`` if the settings need a closure for ``step()`` and it is ``None``."""
        if self.line_search_grid is not None and closure is None:
            raise ValueError(
                f"{self.who}(line_search_grid=...).step() needs a closure that returns the loss."
            )
        if self.adaptive_damping and closure is None:
            raise ValueError(
                f"{self.who}(adaptive_damping=True).step() needs a closure that "
                "re-evaluates the loss (and calls backward)."
            )

    @classmethod
    def from_arguments(cls, who: str, arguments: Dict[str, Any]) -> CurvatureConfig:
        """The config of a constructor's arguments (``locals()``): the fields it names."""
        names = {f.name for f in fields(cls)} - {"who"}
        return cls(who, **{k: v for k, v in arguments.items() if k in names})

    def __post_init__(self) -> None:
        who = self.who
        set_ = object.__setattr__
        set_(
            self,
            "fisher",
            choice(
                FisherType,
                self.fisher,
                f"{who}(fisher",
                hint="'empirical' (your own backward), 'mc', 'type-2', 'rademacher' or "
                "'forward-only'.",
            ),
        )
        needs_loss = (FisherType.MC, FisherType.TYPE2, FisherType.RADEMACHER)
        if self.fisher in needs_loss and self.loss_func is None:
            raise ValueError(
                f"{who}(fisher={self.fisher.value!r}) needs loss_func=... (e.g. "
                "nn.CrossEntropyLoss()): the model output and the loss define the curvature "
                "backward."
            )
        if self.loss_func is not None:
            if not isinstance(self.loss_func, SUPPORTED_LOSSES):
                raise ValueError(
                    f"{who}(loss_func={self.loss_func!r}): unsupported loss; use one of "
                    "nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss."
                )
            check_loss(self.loss_func)
        check(
            who,
            "mc_samples",
            self.mc_samples,
            isinstance(self.mc_samples, int) and self.mc_samples >= 1,
            "must be a positive int",
        )
        set_(self, "kfac_approx", choice(KFACApproxType, self.kfac_approx, f"{who}(kfac_approx"))
        check(
            who,
            "factor_decay",
            self.factor_decay,
            0 <= self.factor_decay < 1,
            "must be in [0, 1)",
        )
        for arg in ("factor_every", "inverse_every", "damping_adaptation_interval"):
            val = getattr(self, arg)
            check(who, arg, val, isinstance(val, int) and val >= 1, "must be a positive int")
        val = self.inverse_warmup
        ok = isinstance(val, int) and not isinstance(val, bool) and val >= 0
        check(who, "inverse_warmup", val, ok, "must be an int >= 0")
        check(
            who,
            "damping_adaptation_decay",
            self.damping_adaptation_decay,
            0 < self.damping_adaptation_decay < 1,
            "must be in (0, 1)",
        )
        check(
            who,
            "kl_clip",
            self.kl_clip,
            self.kl_clip is None or self.kl_clip > 0,
            "must be None or > 0",
        )
        val = self.stale_clip
        ok = val is None or (
            isinstance(val, (int, float)) and not isinstance(val, bool) and math.isfinite(val)
        )
        check(who, "stale_clip", val, ok and (val is None or val >= 1), "must be None or >= 1")
        set_(
            self,
            "damping_mode",
            choice(
                DampingMode,
                self.damping_mode,
                f"{who}(damping_mode",
                hint="'pi' (Tikhonov with the pi heuristic), 'per_factor' (lambda added to "
                "each Kronecker factor) or 'exact' (eigenbasis).",
            ),
        )
        set_(
            self,
            "unsupported",
            choice(
                Unsupported,
                self.unsupported,
                f"{who}(unsupported",
                allowed=(Unsupported.WARN, Unsupported.ERROR, Unsupported.DIAGONAL),
            ),
        )
        if self.line_search_grid is not None:
            grid = _grid(self.line_search_grid)
            if not grid or any(x <= 0 for x in grid):
                raise ValueError(
                    f"{who}(line_search_grid={self.line_search_grid!r}): a non-empty sequence "
                    "of positive learning rates, e.g. [2.0 ** -k for k in range(10)]."
                )
            set_(self, "line_search_grid", tuple(grid))
        check(
            who,
            "update_rule",
            self.update_rule,
            self.update_rule in ("fixed", "quadratic"),
            "must be 'fixed' (lr, momentum) or 'quadratic' (learning rate and momentum from "
            "the local quadratic model)",
        )
        if self.update_rule == "quadratic" and (
            self.line_search_grid is not None or self.loss_func is None
        ):
            raise ValueError(
                f"{who}(update_rule='quadratic') needs loss_func=... (its Gauss-Newton matrix) "
                "and no line_search_grid (both choose the step size)."
            )
        check(
            who,
            "reduction_ratio",
            self.reduction_ratio,
            self.reduction_ratio in ("same_batch", "next_batch"),
            "must be 'same_batch' (the plain loop's step measured on its own batch by one "
            "more forward) or 'next_batch' (by the next forward's loss)",
        )
        check(
            who,
            "factor_damping",
            self.factor_damping,
            self.factor_damping in ("tied", "greedy"),
            "must be 'tied' (one damping for the Kronecker factors and the quadratic model) "
            "or 'greedy' (the factors' own, chosen by the quadratic model; needs "
            "update_rule='quadratic')",
        )
        if self.factor_damping == "greedy" and self.update_rule != "quadratic":
            raise ValueError(
                f"{who}(factor_damping='greedy', update_rule={self.update_rule!r}): the "
                "greedy choice of the factors' damping needs update_rule='quadratic' (its "
                "quadratic model picks the damping)."
            )
        check(who, "comm_timeout", self.comm_timeout, self.comm_timeout > 0, "must be > 0 seconds")
        check(who, "bucket_mb", self.bucket_mb, self.bucket_mb > 0, "must be > 0")


def _grid(values: Sequence[float]):
    try:
        return [float(x) for x in values]
    except (TypeError, ValueError):
        return []
