"""The curvature optimizers as data, for the ``torch.optim`` contract tests.

After torch's ``torch/testing/_internal/common_optimizers.py``: one :class:`OptimizerInfo`
per optimizer says what its constructor accepts (the Fisher types, the ones it refuses
and with which error, the keyword arguments every Fisher type needs) and how to build a
small problem for it (model, batch and loss factories). ``test_optim_contract.py``
expands every optimizer x every supported Fisher type x every contract property from
:data:`OPTIMIZERS`; other test files take :func:`variants` or :data:`OPTIMIZERS` instead
of listing the optimizer classes by hand.

What the documentation promises per Fisher type (``curvature/optim/base.py``, module
docstring) is in :data:`FISHERS`: the statistics of all forwards between two ``step()``
calls count as one batch, their union, so that micro-batches with ``loss / k`` and one
``step()`` equal one full-batch step whenever the statistics are deterministic
(``"empirical"``, ``"type-2"``, ``"forward-only"``); ``"mc"`` and ``"rademacher"`` draw
their vectors per forward, equal to the full batch's in distribution only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

import curvature
from curvature.options import FisherType

#: Every Fisher type of the library; each optimizer accepts or refuses each of them.
ALL_FISHERS: Tuple[str, ...] = tuple(f.value for f in FisherType)


@dataclass(frozen=True)
class FisherInfo:
    """What a Fisher type needs and what is promised for it.

    Attributes:
        name: The ``fisher=`` value.
        needs_loss_func: The constructor refuses it without ``loss_func`` (the model
            output and the loss define the optimizer's own curvature backward).
        sampled: Its vectors are drawn from the optimizer's generator (``state_dict``
            must carry the generator for a resumed run to draw the same).
        accumulation_exact: Micro-batches whose losses are divided by their number, then
            one ``step()``, give exactly the full-batch step (deterministic statistics of
            the union batch); for the sampled types only in distribution.
    """

    name: str
    needs_loss_func: bool
    sampled: bool
    accumulation_exact: bool


FISHERS: Dict[str, FisherInfo] = {
    f.name: f
    for f in (
        FisherInfo("empirical", needs_loss_func=False, sampled=False, accumulation_exact=True),
        FisherInfo("type-2", needs_loss_func=True, sampled=False, accumulation_exact=True),
        FisherInfo("mc", needs_loss_func=True, sampled=True, accumulation_exact=False),
        FisherInfo("rademacher", needs_loss_func=True, sampled=True, accumulation_exact=False),
        FisherInfo("forward-only", needs_loss_func=False, sampled=False, accumulation_exact=True),
    )
}


# -- the small problem -----------------------------------------------------------------------------
def tiny_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """``Linear(4, 6) -> Tanh -> Linear(6, 3)``: two Kronecker blocks, named ``"0"``, ``"2"``."""
    gen = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=dtype) / 2)
    return model


def tiny_batch(step: int, N: int = 8, dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """Inputs ``[N, 4]`` and class labels ``[N]`` in ``{0, 1, 2}``, fixed by ``step``."""
    gen = torch.Generator().manual_seed(1000 + step)
    X = torch.randn(N, 4, generator=gen, dtype=dtype)
    return X, torch.randint(0, 3, (N,), generator=gen)


def cross_entropy() -> nn.Module:
    """The loss of :func:`tiny_mlp` (mean reduction)."""
    return nn.CrossEntropyLoss()


def layer_groups(model: nn.Sequential) -> List[List[nn.Parameter]]:
    """The parameters of each Linear layer of :func:`tiny_mlp` (one block each)."""
    return [list(model[0].parameters()), list(model[2].parameters())]


# -- the table -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OptimizerInfo:
    """One optimizer class, what its constructor accepts and a problem to run it on.

    Attributes:
        cls: The optimizer class.
        fishers: The Fisher types its constructor accepts.
        refused_fishers: Fisher type to a regex of the ``ValueError`` that refuses it.
        kwargs: Constructor keywords of the contract tests (besides ``fisher`` and
            ``loss_func``): small refresh periods, so that a few steps cover a refresh.
        make_model: ``make_model(seed, dtype)``, a fresh model.
        make_batch: ``make_batch(step, N, dtype)``, the batch of a step.
        make_loss: A fresh loss module for the training loop and ``loss_func``.
    """

    cls: type
    fishers: Tuple[str, ...]
    refused_fishers: Mapping[str, str] = field(default_factory=dict)
    kwargs: Mapping[str, Any] = field(
        default_factory=lambda: dict(lr=0.1, damping=1e-2, factor_every=1, inverse_every=2)
    )
    make_model: Callable[..., nn.Module] = tiny_mlp
    make_batch: Callable[..., Tuple[Tensor, Tensor]] = tiny_batch
    make_loss: Callable[[], nn.Module] = cross_entropy

    def __post_init__(self):
        unknown = set(self.fishers) | set(self.refused_fishers)
        if unknown - set(ALL_FISHERS):
            raise ValueError(f"{self.name}: unknown Fisher types {sorted(unknown)}")
        if set(self.fishers) & set(self.refused_fishers):
            raise ValueError(f"{self.name}: a Fisher type both accepted and refused")

    @property
    def name(self) -> str:
        """The class name (test ids)."""
        return self.cls.__name__

    def fisher_kwargs(self, fisher: str) -> Dict[str, Any]:
        """``fisher=`` and, where the Fisher type needs it, ``loss_func=``."""
        kw: Dict[str, Any] = {"fisher": fisher}
        if FISHERS[fisher].needs_loss_func:
            kw["loss_func"] = self.make_loss()
        return kw

    def build(self, model: nn.Module, fisher: str, **overrides: Any) -> torch.optim.Optimizer:
        """The optimizer on ``model`` with :attr:`kwargs`, the Fisher type's and ``overrides``."""
        return self.cls(model, **{**self.kwargs, **self.fisher_kwargs(fisher), **overrides})


OPTIMIZERS: Tuple[OptimizerInfo, ...] = (
    OptimizerInfo(curvature.KFAC, fishers=ALL_FISHERS),
    # EKFAC's constructor accepts "forward-only" (G = I; the offline ekfac() refuses it)
    OptimizerInfo(curvature.EKFAC, fishers=ALL_FISHERS),
    OptimizerInfo(
        curvature.DiagonalNaturalGradient,
        fishers=tuple(f for f in ALL_FISHERS if f != "forward-only"),
        refused_fishers={"forward-only": r"forward-only.*no diagonal"},
    ),
)


def optimizer_params(where: Optional[Callable[[OptimizerInfo], bool]] = None) -> List[Any]:
    """``pytest.param(info, id=name)`` for each optimizer (those ``where`` accepts)."""
    return [pytest.param(i, id=i.name) for i in OPTIMIZERS if where is None or where(i)]


def variants(where: Optional[Callable[[OptimizerInfo, FisherInfo], bool]] = None) -> List[Any]:
    """``pytest.param(info, fisher, id="Name-fisher")``: every optimizer x accepted Fisher type.

    Args:
        where: Keeps the pairs for which ``where(info, FISHERS[fisher])`` is true.
    """
    return [
        pytest.param(info, fisher, id=f"{info.name}-{fisher}")
        for info in OPTIMIZERS
        for fisher in info.fishers
        if where is None or where(info, FISHERS[fisher])
    ]
