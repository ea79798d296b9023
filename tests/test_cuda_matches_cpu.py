"""The GPU paths of the optimizers and curvature functions against the CPU paths.

Some parts of a step take another path on a GPU than on a CPU (the blocks' gather and
scatter by ``index_select`` instead of strided copies, the update's non-finite select by
``where`` instead of ``nan_to_num`` and a product, DiagonalNaturalGradient's layout by
its permutation). The CPU suite never runs them. Here, in float64, a model and its data
copied to CUDA must give the CPU's parameters after steps that include refreshes, a
non-finite batch and a convolution, and the curvature functions the CPU's values.
Skipped without CUDA.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import curvature

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CE = nn.CrossEntropyLoss()
TOL = dict(rtol=1e-9, atol=1e-12)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, groups=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(6 * 4 * 4, 12),
        nn.LayerNorm(12),
        nn.Tanh(),
        nn.Linear(12, 5),
    ).double()


def _batches(steps: int):
    # more samples than any factor's size: the eigenbases are unique (up to signs), as
    # EKFAC's corrections need for the two devices' decompositions to agree
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(steps):
        X = torch.randn(160, 4, 6, 6, generator=g, dtype=torch.float64)
        if i == 2:
            X[0, 0, 0, 0] = float("nan")  # a non-finite batch: statistics and update skipped
        out.append((X, torch.randint(0, 5, (160,), generator=g)))
    return out


def _train(cls, device: str, steps: int = 6, **kwargs) -> nn.Module:
    model = _net().to(device)
    opt = cls(model, loss_func=CE, **{"lr": 0.05, "damping": 1e-2, "inverse_every": 2, **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for X, y in _batches(steps):
            opt.zero_grad()
            CE(model(X.to(device)), y.to(device)).backward()
            opt.step()
    return model


CASES = [
    (curvature.KFAC, {}),
    (curvature.KFAC, {"momentum": 0.9, "weight_decay": 1e-3, "kl_clip": 1e-3}),
    (curvature.KFAC, {"kfac_approx": "reduce", "damping_mode": "exact"}),
    (curvature.KFAC, {"fisher": "type-2"}),
    (curvature.KFAC, {"max_factor_size": 50}),  # the 96-input layer keeps one side
    (curvature.EKFAC, {}),
    (curvature.DiagonalNaturalGradient, {}),
    (curvature.DiagonalNaturalGradient, {"momentum": 0.9, "kl_clip": 1e-3}),
]


@pytest.mark.parametrize("cls, kwargs", CASES, ids=lambda c: getattr(c, "__name__", str(c)))
def test_cuda_steps_equal_cpu_steps(cls, kwargs):
    cpu, cuda = _train(cls, "cpu", **kwargs), _train(cls, "cuda", **kwargs)
    moved = 0.0
    for p, q, p0 in zip(cpu.parameters(), cuda.parameters(), _net().parameters()):
        assert torch.isfinite(q).all()
        torch.testing.assert_close(q.cpu(), p, **TOL)
        moved += float((p - p0).detach().abs().max())
    assert moved > 1e-3  # the steps moved the parameters


def test_cuda_curvature_functions_equal_cpu():
    model = _net()
    X, y = _batches(1)[0]
    on = {"cpu": (model, X, y), "cuda": (copy.deepcopy(model).cuda(), X.cuda(), y.cuda())}
    res = {}
    for dev, (m, Xd, yd) in on.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res[dev] = {
                "kfac": curvature.kfac(m, CE, (Xd, yd), fisher="empirical").to_dense(),
                "kfac type-2": curvature.kfac(m, CE, (Xd, yd)).to_dense(),
                "ekfac": curvature.ekfac(m, CE, (Xd, yd), fisher="empirical").to_dense(),
                "diag_ggn": curvature.diag_ggn(m, CE, (Xd, yd)),
                "diag_ef": curvature.diag_ggn(m, CE, (Xd, yd), "empirical"),
                "per_sample": curvature.per_sample_grads(m, CE, Xd, yd),
            }
    for name, value in res["cpu"].items():
        other = res["cuda"][name]
        if isinstance(value, dict):
            assert value.keys() == other.keys()
            for k in value:
                torch.testing.assert_close(other[k].cpu(), value[k], **TOL, msg=f"{name} {k}")
        else:
            torch.testing.assert_close(other.cpu(), value, **TOL, msg=name)
