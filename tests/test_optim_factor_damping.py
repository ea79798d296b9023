"""``factor_damping="greedy"``: the Kronecker factors' damping apart from the 2x2 model's.

Every few steps the factors' damping ``gamma`` is chosen among ``{gamma omega, gamma,
gamma / omega}`` by the value of the quadratic model (exact GGN) at each candidate's own
2x2-optimal update; ``damping`` (``lambda``) damps the model only. Brute force: the dense
GGN of the PINN loss and each candidate's direction from the public ``inverse_matvec``.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from test_optim_quadratic_pinn import (  # noqa: F401 (problem: its fixture)
    HALF,
    MSE,
    dense_ggn,
    flat,
    pinn_closure,
    problem,
)

import curvature
from curvature.optim.factor_damping import (
    GREEDY_INTERVAL,
    greedy_candidates,
    lowest_model,
    nielsen_factor,
)
from curvature.optim.quadratic import solve_coefficients

#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def make(net, cls=curvature.KFAC, fisher="type-2", **kw):
    options = dict(
        damping=1e-2,
        damping_mode="per_factor",
        fisher=fisher,
        loss_func=MSE,
        auto_output=False,
        factor_decay=0.45,
        inverse_every=1,
        update_rule="quadratic",
        damping_adaptation_interval=1,
        factor_damping="greedy",
    )
    options.update(kw)
    return cls(net, **options)


def gradient(net, x_int, x_bnd, g_bnd, f):
    net.zero_grad()
    with torch.enable_grad():
        r = curvature.laplacian(net, x_int, method="autograd") + f
        u_b = net(x_bnd).squeeze(-1)
        (0.5 * r.pow(2).mean() + 0.5 * (u_b - g_bnd).pow(2).mean()).backward()
    return [p.grad.clone() for p in net.parameters()]


# -- the pieces ---------------------------------------------------------------------------
def test_lowest_model_picks_the_candidate_with_the_lowest_model_value():
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        heads = 3
        K = heads + trial % 2  # with and without a previous update
        B = torch.randn(K + 2, K, generator=g, dtype=torch.float64)
        gram = B.T @ B
        damped = 0.1 * torch.eye(K, dtype=torch.float64)
        linear = torch.randn(K, generator=g, dtype=torch.float64)
        i, models = lowest_model(gram, damped, linear, heads, solve_coefficients)
        brute = []
        for j in range(heads):
            ix = [j] + list(range(heads, K))
            S = (gram + damped)[ix][:, ix]
            c = torch.linalg.solve(S, -linear[ix])
            brute.append(float(0.5 * c @ S @ c + linear[ix] @ c))
        assert models == pytest.approx(brute, rel=1e-9)
        assert i == min(range(heads), key=brute.__getitem__)


def test_lowest_model_skips_a_candidate_without_a_finite_solution():
    gram = torch.diag(torch.tensor([1.0, 0.0, 4.0], dtype=torch.float64))
    linear = torch.tensor([-1.0, -100.0, -1.0], dtype=torch.float64)
    # the middle one's system is 0: no finite solve, though its gradient part is largest
    i, models = lowest_model(gram, torch.zeros(3, 3), linear, 3, solve_coefficients)
    assert i == 0 and models[1] == math.inf
    assert models[0] == pytest.approx(-0.5) and models[2] == pytest.approx(-0.125)


def test_candidates_and_nielsen_factor():
    low, mid, high = greedy_candidates(2.0, 0.95)
    omega = 0.95 ** (GREEDY_INTERVAL / 2)
    assert (low, mid, high) == pytest.approx((2 * omega, 2.0, 2 / omega))
    assert nielsen_factor(1.0) == pytest.approx(1 / 3)
    assert nielsen_factor(0.5) == pytest.approx(1.0)
    assert nielsen_factor(0.25) == pytest.approx(1.125)
    assert nielsen_factor(-1.0) == 2.0 and nielsen_factor(float("nan")) == 2.0


# -- the step, against brute force --------------------------------------------------------
@pytest.mark.parametrize("fisher", ["type-2", "mc"], ids=["pulled-statistics", "double-backward"])
@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
def test_the_greedy_step_keeps_the_factor_damping_of_the_lowest_model(cls, fisher):
    net, x_int, x_bnd, g_bnd, f = problem()
    opt = make(net, cls, fisher)
    closure = pinn_closure(opt, net, x_int, x_bnd, g_bnd, f)
    for _ in range(GREEDY_INTERVAL - 1):
        opt.step(closure)
    theta_prev = flat(net.parameters())
    opt.step(closure)  # step 4: not due
    assert opt.last_factor_damping_models is None
    assert opt.last_step_taken
    theta = flat(net.parameters())
    group = opt.param_groups[0]
    gamma, lam = group["factor_damping"], group["damping"]
    grads = gradient(net, x_int, x_bnd, g_bnd, f)
    g = flat(grads)
    C = dense_ggn(net, x_int, x_bnd) + lam * torch.eye(g.numel(), dtype=torch.float64)
    opt.step(closure)  # step 5: due
    models = opt.last_factor_damping_models
    assert [m[0] for m in models] == pytest.approx(list(greedy_candidates(gamma, 0.95)))
    chosen = group["factor_damping"]
    brute = []
    for candidate, _ in models:  # each candidate's direction and 2x2 solve, by hand
        group["factor_damping"] = candidate
        Delta = -flat(opt.inverse_matvec(grads))
        V = torch.stack([Delta, theta - theta_prev], 1)
        c = torch.linalg.solve(V.T @ C @ V, -V.T @ g)
        brute.append(float(0.5 * c @ V.T @ C @ V @ c + g @ V @ c))
    group["factor_damping"] = chosen
    assert [m[1] for m in models] == pytest.approx(brute, rel=1e-6)
    best = min(range(3), key=brute.__getitem__)
    assert chosen == models[best][0]
    assert opt.last_model_change == pytest.approx(brute[best], rel=1e-6)
    # lambda damps the model only: the taken step's factor is Nielsen's
    rho = opt.last_reduction_ratio
    assert group["damping"] == pytest.approx(lam * nielsen_factor(rho), rel=1e-12)
    opt.close()


def test_the_factor_damping_moves_and_the_loss_falls():
    net, x_int, x_bnd, g_bnd, f = problem(1)
    opt = make(net)
    closure = pinn_closure(opt, net, x_int, x_bnd, g_bnd, f)
    first = float(closure(backward=False).detach())
    seen = set()
    for _ in range(4 * GREEDY_INTERVAL):
        opt.step(closure)
        seen.add(opt.param_groups[0]["factor_damping"])
    assert len(seen) > 1  # the greedy choice took another candidate than gamma at least once
    assert float(closure(backward=False).detach()) < 0.5 * first
    opt.close()


def test_the_tied_default_keeps_one_damping():
    net, x_int, x_bnd, g_bnd, f = problem()
    opt = make(net, factor_damping="tied")
    closure = pinn_closure(opt, net, x_int, x_bnd, g_bnd, f)
    for _ in range(GREEDY_INTERVAL + 1):
        opt.step(closure)
    assert "factor_damping" not in opt.param_groups[0]
    assert opt.last_factor_damping_models is None
    opt.close()


def test_state_dict_round_trip_is_bit_for_bit():
    net, x_int, x_bnd, g_bnd, f = problem(2)
    opt = make(net)
    closure = pinn_closure(opt, net, x_int, x_bnd, g_bnd, f)
    for _ in range(3):
        opt.step(closure)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)  # (the state's tensors move on with the run)
    params = [p.detach().clone() for p in net.parameters()]
    for _ in range(2 * GREEDY_INTERVAL):  # across two greedy choices
        opt.step(closure)
    expected = [p.detach().clone() for p in net.parameters()]
    group = dict(opt.param_groups[0])
    opt.close()

    net2, *data = problem(2)
    with torch.no_grad():
        for p, q in zip(net2.parameters(), params):
            p.copy_(q)
    opt2 = make(net2)
    buffer.seek(0)
    opt2.load_state_dict(torch.load(buffer))
    closure2 = pinn_closure(opt2, net2, *data)
    for _ in range(2 * GREEDY_INTERVAL):
        opt2.step(closure2)
    for p, q in zip(net2.parameters(), expected):
        assert torch.equal(p.detach(), q)
    assert opt2.param_groups[0]["factor_damping"] == group["factor_damping"]
    assert opt2.param_groups[0]["damping"] == group["damping"]
    opt2.close()


# -- refusals -----------------------------------------------------------------------------
def test_bad_values_are_refused():
    net = problem()[0]
    with pytest.raises(ValueError, match="factor_damping='bogus'"):
        make(net, factor_damping="bogus")
    with pytest.raises(ValueError, match="needs update_rule='quadratic'"):
        make(net, update_rule="fixed")


def test_the_plain_loop_is_refused():
    net, x_int, x_bnd, g_bnd, f = problem()
    opt = make(net, auto_output=True)
    loss = MSE(net(x_bnd).squeeze(-1), g_bnd)
    loss.backward()
    with pytest.raises(ValueError, match="needs a closure"):
        opt.step()
    opt.close()
