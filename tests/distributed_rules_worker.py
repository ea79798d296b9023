"""Step-choosing rules under torch.distributed: run by ``test_distributed_rules.py``.

The rules that pick the step from losses and curvature products (``update_rule="quadratic"``
with and without a closure, ``adaptive_damping=True``, ``line_search_grid``) on 2 gloo
ranks, each with 4 samples of the 8-sample union batch and a mean loss (so DDP's gradient
average is the union's mean-loss gradient); the reference runs one process on the union.
The setups ``@unequal`` (3 and 5 samples, the rank's mean loss scaled by ``W N_r / N``)
and ``@sum`` (a sum-reduction ``loss_func``, the rank's loss times ``W``) follow
docs/distributed.md's table. Launched through ``distributed_worker.spawn(..., "rules")``.
"""

from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch
from torch import nn

import curvature

STEPS = 6
SETUPS = {  # per-rank batch sizes, loss reduction
    "equal": ((4, 4), "mean"),
    "unequal": ((3, 5), "mean"),
    "sum": ((4, 4), "sum"),
}
BASE = dict(damping=1e-1, inverse_every=2, factor_decay=0.8, damping_adaptation_interval=2)

# name -> (class name, kwargs, closure?, DDP?)
RULES: Dict[str, tuple] = {}
for _cls in ("KFAC", "EKFAC"):
    _k = _cls.lower()
    RULES[f"{_k}-quadratic-plain-type2"] = (
        _cls,
        dict(fisher="type-2", update_rule="quadratic"),
        False,
        True,
    )
    RULES[f"{_k}-quadratic-plain-empirical"] = (
        _cls,
        dict(fisher="empirical", update_rule="quadratic"),
        False,
        True,
    )
    RULES[f"{_k}-quadratic-closure"] = (
        _cls,
        dict(fisher="type-2", update_rule="quadratic"),
        True,
        True,
    )
    RULES[f"{_k}-adaptive-damping"] = (
        _cls,
        dict(fisher="type-2", lr=0.3, momentum=0.5, adaptive_damping=True),
        True,
        True,
    )
    RULES[f"{_k}-line-search"] = (
        _cls,
        dict(fisher="type-2", line_search_grid=(1.0, 0.3, 0.1, 0.03)),
        True,
        True,
    )
# a plain model (no DDP): the optimizer averages the gradients itself
RULES["kfac-quadratic-plain-type2-noddp"] = (
    "KFAC",
    dict(fisher="type-2", update_rule="quadratic"),
    False,
    False,
)
RULES["kfac-quadratic-closure-noddp"] = (
    "KFAC",
    dict(fisher="type-2", update_rule="quadratic"),
    True,
    False,
)
# the ranks measure the plain loop's steps on the next batch (a same-batch replay would be
# one more collective forward); the one-process reference does the same
for _name, (_c, _kw, _closure, _ddp) in list(RULES.items()):
    if "quadratic-plain" in _name:
        RULES[_name] = (_c, {**_kw, "reduction_ratio": "next_batch"}, _closure, _ddp)
# the quadratic rule (whose curvature and losses come from loss_func) in the other setups
_QUADRATIC = [n for n in RULES if "quadratic" in n and "noddp" not in n]
for _setup in ("unequal", "sum"):
    for _name in _QUADRATIC:
        RULES[f"{_name}@{_setup}"] = RULES[_name]
    RULES[f"kfac-adaptive-damping@{_setup}"] = RULES["kfac-adaptive-damping"]
# with EKFAC's tracked bases (the default) this run's reduction ratios stay inside the
# Levenberg-Marquardt band (0.72 at step 5, 0.84 with eigendecompositions): no damping
# adaptation to compare, so this one decomposes (the others cover the tracked bases)
_c, _kw, _closure, _ddp = RULES["ekfac-quadratic-closure@sum"]
RULES["ekfac-quadratic-closure@sum"] = (_c, {**_kw, "eigenbasis_update": "eigh"}, _closure, _ddp)

# faults on rank 1 at step 2: scenario -> (rule, fault); the ranks must stay identical
FAULTS = {
    "kfac-quadratic-plain-type2-empty": ("kfac-quadratic-plain-type2", "empty"),
    "kfac-quadratic-plain-type2-nan": ("kfac-quadratic-plain-type2", "nan"),
    "ekfac-quadratic-closure-nan": ("ekfac-quadratic-closure", "nan"),
    "kfac-line-search-empty": ("kfac-line-search", "empty"),
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(torch.float64)


def batch(step: int, rank: Optional[int], sizes=(4, 4)):
    """The union batch of ``step`` (``rank=None``) or the rank's part of it."""
    g = torch.Generator().manual_seed(200 + step)
    X = torch.randn(sum(sizes), 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (sum(sizes),), generator=g)
    if rank is None:
        return X, y
    start = sum(sizes[:rank])
    return X[start : start + sizes[rank]], y[start : start + sizes[rank]]


def run_rule(name: str, rank: Optional[int], fault: Optional[str] = None) -> dict:
    """``STEPS`` steps of scenario ``name`` on ``rank`` (``None``: one process, the union);
    ``fault``: rank 1's batch of step 2 is empty (``"empty"``) or has a NaN (``"nan"``).
    """
    cls_name, kwargs, with_closure, ddp = RULES[name]
    sizes, reduction = SETUPS[name.split("@")[1] if "@" in name else "equal"]
    loss_func = nn.CrossEntropyLoss(reduction=reduction)
    model = make_model()
    net = nn.parallel.DistributedDataParallel(model) if ddp and rank is not None else model
    opt = getattr(curvature, cls_name)(net, **{**BASE, **kwargs}, loss_func=loss_func)

    def CE(out, y):  # the rank's share of the union loss (docs/distributed.md's table)
        loss = loss_func(out, y)
        if rank is None:
            return loss
        return loss * len(sizes) * (len(y) / sum(sizes) if reduction == "mean" else 1)

    trace = []
    for step in range(STEPS):
        X, y = batch(step, rank, sizes)
        if fault is not None and rank == 1 and step == 2:
            X, y = (X[:0], y[:0]) if fault == "empty" else (X.clone(), y)
            X[:1, :1] = float("nan")

        def closure(backward=True, X=X, y=y):
            opt.zero_grad()
            loss = CE(net(X), y)
            if backward:
                loss.backward()
            return loss

        if with_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
        trace.append(
            dict(
                damping=opt.param_groups[0]["damping"],
                rho=opt.last_reduction_ratio,
                coefficients=opt.last_update_coefficients,
                lr=opt.last_line_search_lr,
                taken=opt.last_step_taken,
            )
        )
    if not with_closure:  # the last step is judged by the next forward
        X, y = batch(STEPS, rank, sizes)
        opt.zero_grad()
        CE(net(X), y).backward()
        opt.step()
        trace.append(dict(damping=opt.param_groups[0]["damping"], rho=opt.last_reduction_ratio))
    out = {"params": [p.detach().clone() for p in model.parameters()], "trace": trace}
    out["bytes"] = opt.bytes_communicated
    opt.close()
    return out


def mixed_reductions(rank: int) -> str:
    """The closure rule with outputs of a mean and a sum loss: the error on this rank."""
    model = make_model()
    mean, total = nn.CrossEntropyLoss(), nn.CrossEntropyLoss(reduction="sum")
    opt = curvature.KFAC(model, **BASE, fisher="type-2", update_rule="quadratic", loss_func=mean)
    X, y = batch(0, rank)

    def closure(backward=True):
        opt.zero_grad()
        out = model(X)
        opt.register_output(out[:2], mean, y[:2])
        opt.register_output(out[2:], total, y[2:])
        loss = mean(out[:2], y[:2]) + total(out[2:], y[2:])
        if backward:
            loss.backward()
        return loss

    try:
        opt.step(closure)
        return ""
    except ValueError as err:
        return str(err)
    finally:
        opt.close()


def run_rules(rank: int) -> Dict[str, dict]:
    out = {name: run_rule(name, rank) for name in RULES}
    out["mixed-reductions"] = {"error": mixed_reductions(rank)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out.update({name: run_rule(FAULTS[name][0], rank, FAULTS[name][1]) for name in FAULTS})
    return out
