"""benchmarks/pinn_reference.py: its dense twin of the example's KFAC agrees with the library."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

import curvature

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ref():
    spec = importlib.util.spec_from_file_location(
        "pinn_reference", ROOT / "benchmarks" / "pinn_reference.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_reference_residual_jacobian_and_factors_match_the_library(ref):
    prob = ref.Problem(seed=0)
    ex = ref.example()
    torch.manual_seed(0)
    model = ex.make_model(2, (64,))
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.equal(theta, prob.theta0)  # the example's initialization
    residual = ex.poisson(torch.Generator().manual_seed(0), 900, 120, 9000)[5]
    r = residual(model, prob.x_int).detach()
    torch.testing.assert_close(prob.interior(theta), r, rtol=1e-12, atol=1e-12)

    # the Jacobian from the statistics against forward-mode products
    stats = prob.statistics(theta)
    J = prob.jacobian(stats)
    v = torch.randn(theta.shape[0], dtype=torch.float64)
    _, ji = torch.func.jvp(prob.interior, (theta,), (v,))
    _, jb = torch.func.jvp(prob.boundary, (theta,), (v,))
    expected = torch.cat([ji / 900**0.5, jb / 120**0.5])
    torch.testing.assert_close(J @ v, expected, rtol=1e-10, atol=1e-12)

    # the library's factors after the example's first step (decay: the first are unbiased)
    mse, half = nn.MSELoss(), 0.5**0.5
    opt = curvature.KFAC(
        model, lr=1.0, damping=1e-2, damping_mode="per_factor", fisher="type-2",
        loss_func=mse, auto_output=False, factor_decay=0.45, inverse_every=1,
        update_rule="quadratic", damping_adaptation_interval=1,
    )  # fmt: skip

    def closure(backward=True):
        opt.zero_grad()
        r = residual(model, prob.x_int)
        u_b = model(prob.x_bnd).squeeze(-1)
        loss = 0.5 * mse(r, torch.zeros_like(r)) + 0.5 * mse(u_b, prob.g_bnd)
        opt.register_output(half * r.unsqueeze(-1), mse, torch.zeros_like(r).unsqueeze(-1))
        opt.register_output(half * u_b.unsqueeze(-1), mse, half * prob.g_bnd.unsqueeze(-1))
        if backward:
            loss.backward()
        return loss

    opt.step(closure)
    lib = opt.factors()
    mine = prob.factors(stats)
    for layer, name in enumerate(["0", "2"]):
        for term, key in enumerate(["int", "bnd"]):
            for got, want in zip(lib[name][term], mine[key][layer]):
                torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)
    opt.close()


@pytest.mark.parametrize("direction", ["kfac", "exact", "blocks", "first"])
def test_reference_library_rule_lowers_the_error(ref, capsys, direction):
    # 20 steps of the library rule: the loss falls 100x (measured: 400x - 20000x)
    ref.main(["--steps", "20", "--log-every", "20", "--direction", direction])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step")]
    loss = [float(ln.split("loss")[1].split()[0]) for ln in lines]
    assert len(loss) == 2 and loss[1] < loss[0] / 100
