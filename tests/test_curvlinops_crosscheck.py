"""Cross-check against curvlinops (optional peer; skipped when it is not installed).

SPEC section 1: our GGN, Hessian, empirical Fisher and KFAC conventions agree with
curvlinops', with one documented difference: for MSE or BCE with mean reduction over
``C > 1`` outputs, curvlinops' empirical Fisher (and empirical KFAC) use the loss summed
over outputs scaled by ``1/(N C)``, ours ``l_n`` (the mean over the sample's outputs):
curvlinops' is ``C`` times ours.
"""

from __future__ import annotations

from typing import Callable, Dict, NamedTuple

import pytest
import torch
from torch import Tensor, nn

import curvature

curvlinops = pytest.importorskip("curvlinops")


pytestmark = pytest.mark.usefixtures("float64_seeded")


def _mlp(out=3):
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, out))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 2, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(2, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


class Problem(NamedTuple):
    model: Callable[[], nn.Module]
    X: Callable[[], Tensor]
    y: Callable[[], Tensor]
    loss: Callable[..., nn.Module]


N = 6
PROBLEMS: Dict[str, Problem] = {
    "mlp-ce": Problem(
        _mlp, lambda: torch.randn(N, 3), lambda: torch.randint(0, 3, (N,)), nn.CrossEntropyLoss
    ),
    "cnn-ce": Problem(
        _cnn,
        lambda: torch.randn(N, 2, 4, 4),
        lambda: torch.randint(0, 3, (N,)),
        nn.CrossEntropyLoss,
    ),
}


def _setup(name, reduction="mean"):
    p = PROBLEMS[name]
    model, X, y = p.model(), p.X(), p.y()
    # two uneven batches: the union's weighting is part of what is checked
    data = [(X[:2], y[:2]), (X[2:], y[2:])]
    return model, p.loss(reduction=reduction), data


def _dense(op, model) -> Tensor:
    P = sum(p.numel() for p in model.parameters())
    return op @ torch.eye(P)


def _assert_close(actual: Tensor, expected: Tensor, tol: float = 1e-10):
    scale = expected.abs().max().clamp_min(1e-30)
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol * scale)


# -- exact matrices ------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", list(PROBLEMS))
@pytest.mark.parametrize(
    "ours, theirs",
    [
        (curvature.ggn, "GGNLinearOperator"),
        (curvature.empirical_fisher, "EFLinearOperator"),
        (curvature.hessian, "HessianLinearOperator"),
    ],
    ids=["ggn", "empirical_fisher", "hessian"],
)
def test_dense_matrices_agree(ours, theirs, name, reduction):
    model, loss_func, data = _setup(name, reduction)
    op = getattr(curvlinops, theirs)(
        model, loss_func, list(model.parameters()), data, check_deterministic=False
    )
    _assert_close(ours(model, loss_func, data), _dense(op, model))


# -- KFAC / EKFAC -----------------------------------------------------------------------------
def _their_kfac(model, loss_func, data, fisher, kfac_approx="expand", separate=False, cls=None):
    cls = cls or curvlinops.KFACLinearOperator
    return cls(
        model,
        loss_func,
        list(model.parameters()),
        data,
        check_deterministic=False,
        fisher_type=fisher,
        kfac_approx=kfac_approx,
        separate_weight_and_bias=separate,
    )


KFAC_CASES = [
    ("mlp-ce", "expand"),
    ("cnn-ce", "expand"),
    ("cnn-ce", "reduce"),
]


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
@pytest.mark.parametrize("name, kfac_approx", KFAC_CASES)
def test_kfac_agrees_with_weight_and_bias_joined(name, kfac_approx, fisher):
    model, loss_func, data = _setup(name)
    ours = curvature.kfac(model, loss_func, data, fisher=fisher, kfac_approx=kfac_approx)
    theirs = _their_kfac(model, loss_func, data, fisher, kfac_approx)
    _assert_close(ours.to_dense(), _dense(theirs, model))
    torch.testing.assert_close(ours.trace(), theirs.trace)


@pytest.mark.parametrize("name, kfac_approx", KFAC_CASES)
def test_kfac_with_separate_weight_and_bias_is_ours_masked(name, kfac_approx):
    # separate blocks keep kron(G, A_W) for W and G * A_bb = G for b (A_bb = 1)
    model, loss_func, data = _setup(name)
    ours = curvature.kfac(model, loss_func, data, kfac_approx=kfac_approx).to_dense()
    owner = torch.cat([torch.full((p.numel(),), i) for i, p in enumerate(model.parameters())])
    masked = ours * (owner[:, None] == owner[None, :])
    theirs = _their_kfac(model, loss_func, data, "type-2", kfac_approx, separate=True)
    _assert_close(masked, _dense(theirs, model))


def test_ekfac_agrees():
    model, loss_func, data = _setup("mlp-ce")
    ours = curvature.ekfac(model, loss_func, data)
    theirs = _their_kfac(model, loss_func, data, "type-2", cls=curvlinops.EKFACLinearOperator)
    _assert_close(ours.to_dense(), _dense(theirs, model))


# -- the documented empirical Fisher difference ------------------------------------------
@pytest.mark.parametrize("C", [1, 3])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(
    "loss_func, target",
    [(nn.MSELoss, torch.randn), (nn.BCEWithLogitsLoss, torch.rand)],
    ids=["mse", "bce"],
)
def test_their_empirical_fisher_is_C_times_ours_for_mean_over_C_outputs(
    loss_func, target, reduction, C
):
    model, loss_func = _mlp(out=C), loss_func(reduction=reduction)
    X, y = torch.randn(N, 3), target(N, C)
    factor = C if reduction == "mean" else 1
    ours = curvature.empirical_fisher(model, loss_func, (X, y))
    theirs = curvlinops.EFLinearOperator(
        model, loss_func, list(model.parameters()), [(X, y)], check_deterministic=False
    )
    _assert_close(factor * ours, _dense(theirs, model))
    ours_kfac = curvature.kfac(model, loss_func, (X, y), fisher="empirical").to_dense()
    theirs_kfac = _their_kfac(model, loss_func, [(X, y)], "empirical")
    _assert_close(factor * ours_kfac, _dense(theirs_kfac, model))
    # the exact GGN has no such difference
    theirs_ggn = curvlinops.GGNLinearOperator(
        model, loss_func, list(model.parameters()), [(X, y)], check_deterministic=False
    )
    _assert_close(curvature.ggn(model, loss_func, (X, y)), _dense(theirs_ggn, model))
