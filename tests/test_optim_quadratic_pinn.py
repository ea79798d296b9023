"""``update_rule="quadratic"`` with a closure on a PINN loss (forward Laplacian, two terms).

The 2x2 model's ``C`` is the exact Gauss-Newton matrix of the registered residuals. With
``fisher="type-2"`` it comes from the statistics the closure's backward pulled (layer
inputs ``a`` and output gradients ``g`` of the weight-shared slots), otherwise from a second
evaluation of the closure and a double backward. Brute force for both: the dense
``J^T H J`` from ``torch.func.jacrev`` of the residuals and the 2x2 solve by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature

MSE = nn.MSELoss()
HALF = 0.5**0.5


#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x_int = torch.rand(20, 2, generator=g, dtype=torch.float64)
    x_bnd = torch.rand(6, 2, generator=g, dtype=torch.float64)
    g_bnd = torch.randn(6, generator=g, dtype=torch.float64)
    f = torch.randn(20, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 1))
    return net.double(), x_int, x_bnd, g_bnd, f


def pinn_closure(opt, net, x_int, x_bnd, g_bnd, f):
    def closure(backward=True):
        opt.zero_grad()
        r = curvature.laplacian(net, x_int, method="forward") + f  # [N]
        u_b = net(x_bnd).squeeze(-1)  # [M]
        opt.register_output(HALF * r.unsqueeze(-1), MSE, torch.zeros_like(r).unsqueeze(-1))
        opt.register_output(HALF * u_b.unsqueeze(-1), MSE, HALF * g_bnd.unsqueeze(-1))
        loss = 0.5 * r.pow(2).mean() + 0.5 * (u_b - g_bnd).pow(2).mean()
        if backward:
            loss.backward()
        return loss

    return closure


def dense_ggn(net, x_int, x_bnd):
    """``J_r^T J_r / N + J_b^T J_b / M``: the GGN of ``1/2 mean r^2 + 1/2 mean (u_b - g)^2``."""
    names = [n for n, _ in net.named_parameters()]
    theta = {n: p.detach() for n, p in net.named_parameters()}

    def interior(params):
        # the Laplacian by nested autograd of the functional model (independent of the
        # forward Laplacian the optimizer sees)
        def u(x):
            return torch.func.functional_call(net, params, (x.unsqueeze(0),)).squeeze()

        hess = torch.vmap(torch.func.hessian(u))(x_int)  # [N, 2, 2]
        return hess.diagonal(dim1=-2, dim2=-1).sum(-1)

    def boundary(params):
        return torch.func.functional_call(net, params, (x_bnd,)).squeeze(-1)

    C = 0
    for fn, n in ((interior, len(x_int)), (boundary, len(x_bnd))):
        jac = torch.func.jacrev(fn)(theta)
        J = torch.cat([jac[k].reshape(n, -1) for k in names], 1)
        C = C + J.T @ J / n
    return C


def flat(tensors):
    return torch.cat([t.detach().flatten() for t in tensors])


@pytest.mark.parametrize("fisher", ["type-2", "mc"], ids=["pulled-statistics", "double-backward"])
@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
def test_the_pinn_step_solves_the_2x2_model_with_the_exact_ggn(cls, fisher):
    net, x_int, x_bnd, g_bnd, f = problem()
    opt = cls(
        net,
        damping=1e-3,
        damping_mode="per_factor",
        fisher=fisher,
        loss_func=MSE,
        auto_output=False,
        kfac_approx="expand",
        factor_decay=0.45,
        inverse_every=1,
        update_rule="quadratic",
    )
    closure = pinn_closure(opt, net, x_int, x_bnd, g_bnd, f)
    theta0 = flat(net.parameters())
    opt.step(closure)
    assert opt.last_step_taken
    theta1 = flat(net.parameters())
    # brute force at theta1: the gradient, the dense GGN, the damping as adapted by step 1
    net.zero_grad()
    with torch.enable_grad():
        r = curvature.laplacian(net, x_int, method="autograd") + f
        u_b = net(x_bnd).squeeze(-1)
        (0.5 * r.pow(2).mean() + 0.5 * (u_b - g_bnd).pow(2).mean()).backward()
    grads = [p.grad.clone() for p in net.parameters()]
    g = flat(grads)
    lam = opt.param_groups[0]["damping"]
    C = dense_ggn(net, x_int, x_bnd) + lam * torch.eye(g.numel(), dtype=torch.float64)
    opt.step(closure)
    assert opt.last_step_taken
    Delta = -flat(opt.inverse_matvec(grads))  # step 2's direction (factors of step 2)
    V = torch.stack([Delta, theta1 - theta0], 1)
    alpha, mu = torch.linalg.solve(V.T @ C @ V, -V.T @ g).tolist()
    assert opt.last_update_coefficients == pytest.approx((alpha, mu), rel=1e-6)
    d = flat(net.parameters()) - theta1
    assert opt.last_model_change == pytest.approx(float(0.5 * d @ C @ d + g @ d), rel=1e-6)
    opt.close()
