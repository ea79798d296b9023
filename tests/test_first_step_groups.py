"""KFAC's first step against the offline reference, per parameter, with parameter groups
and KL clipping.

The first step of ``KFAC`` (its statistics and inverses are those of this batch) moves
the parameters by ``-lr_p nu d_p`` with ``d = (G + s I)^{-1} M (A + s I)^{-1}`` per block
from ``curvature.kfac(...).inverse_matvec`` and the KL factor ``nu = min(1, sqrt(kl_clip /
sum_p lr_p^2 d_p^T g_p))``: each parameter must get its own block's entries (weights and
bias of a ``[W | b]`` block, grouped convolutions, layers without bias, layers outside
any block) and the KL sum must pair each direction with its own gradient and learning
rate.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from cases import torch_state
from torch import nn

import curvature


@pytest.fixture(autouse=True)
def _float64_seed_one_thread():
    with torch_state(dtype=torch.float64):
        yield


def _mlp():
    return nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6, bias=False), nn.Tanh(), nn.Linear(6, 3)
    )


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, groups=2, bias=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    )


def _mixed():  # a LayerNorm: positions outside the Kronecker blocks
    return nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))


MODELS = {"mlp": (_mlp, (5,)), "cnn": (_cnn, (2, 5, 5)), "layernorm": (_mixed, (5,))}


def _reference_step(model, X, y, lrs, damping, kl_clip):
    """The expected parameter change of the first step, from the offline KFAC."""
    CE = nn.CrossEntropyLoss()
    model = copy.deepcopy(model)
    CE(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    approx = curvature.kfac(model, CE, (X, y), fisher="empirical")
    d = approx.inverse_matvec(grads, damping, mode="pi")
    total = sum(lr**2 * (di * g).sum() for lr, di, g in zip(lrs, d, grads))
    nu = 1.0 if kl_clip is None or total <= 0 else min(1.0, math.sqrt(kl_clip / float(total)))
    return [-lr * nu * di for lr, di in zip(lrs, d)], nu


@pytest.mark.parametrize("kl_clip", [None, 1e-4], ids=["no-clip", "clipped"])
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("groups", ["one", "two-lrs"])
def test_first_step_is_the_offline_direction(name, groups, kl_clip):
    make, shape = MODELS[name]
    model = make()
    X, y = torch.randn(12, *shape), torch.randint(0, 3, (12,))
    params = list(model.parameters())
    lr, damping = 0.5, 1e-2
    if groups == "one":
        lrs, param_groups = [lr] * len(params), None
    else:  # the last layer at a tenth of the rate: KL clipping then sums per group
        lrs = [lr] * (len(params) - 2) + [lr / 10] * 2
        param_groups = [{"params": params[:-2]}, {"params": params[-2:], "lr": lr / 10}]
    expected, nu = _reference_step(model, X, y, lrs, damping, kl_clip)
    if kl_clip is not None:
        assert nu < 0.5  # (the clip acts)
    opt = curvature.KFAC(
        model,
        lr=lr,
        damping=damping,
        kl_clip=kl_clip,
        stale_clip=None,
        loss_func=nn.CrossEntropyLoss(),
        param_groups=param_groups,
    )
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(X), y).backward()
    opt.step()
    for p, q, e in zip(params, before, expected):
        torch.testing.assert_close(p.detach() - q, e, atol=1e-12, rtol=1e-10)


def test_a_parameter_without_gradient_keeps_its_value_and_the_others_step():
    # an unused layer: no gradient, no update
    model = _mlp()
    extra = nn.Linear(3, 3)
    holder = nn.ModuleDict({"net": model, "unused": extra})
    X, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    expected, _ = _reference_step(model, X, y, [0.5] * 5, 1e-2, None)
    opt = curvature.KFAC(
        holder, lr=0.5, damping=1e-2, stale_clip=None, loss_func=nn.CrossEntropyLoss()
    )
    before = [p.detach().clone() for p in model.parameters()]
    frozen = [p.detach().clone() for p in extra.parameters()]
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(X), y).backward()
    opt.step()
    for p, q, e in zip(model.parameters(), before, expected):
        torch.testing.assert_close(p.detach() - q, e, atol=1e-12, rtol=1e-10)
    assert all(torch.equal(p, q) for p, q in zip(extra.parameters(), frozen))


def test_two_groups_of_one_learning_rate_step_as_one_group():
    # the KL sum per group equals the one over the whole vector: two groups whose rates
    # differ by one rounding step take the single group's steps, through several steps
    # with momentum, weight decay and refreshes
    torch.manual_seed(1)
    model = _cnn()
    X, y = torch.randn(16, 2, 5, 5), torch.randint(0, 3, (16,))
    CE = nn.CrossEntropyLoss()
    runs = []
    for flat in (False, True):
        m = copy.deepcopy(model)
        kw = dict(lr=0.2, momentum=0.9, weight_decay=1e-2, damping=1e-2, inverse_every=3)
        if flat:  # two groups
            ps = list(m.parameters())
            groups = [{"params": ps[:-1]}, {"params": ps[-1:], "lr": 0.2 * (1 + 1e-15)}]
            opt = curvature.KFAC(m, param_groups=groups, kl_clip=1e3, loss_func=CE, **kw)
        else:
            opt = curvature.KFAC(m, kl_clip=1e3, loss_func=CE, **kw)
        for _ in range(7):
            opt.zero_grad()
            CE(m(X), y).backward()
            opt.step()
        runs.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
