"""The quadratic rule's batch Gram matrix: ``u = g^T V a`` per layer from strided views
of the directions, against the gathered positions and a brute-force loop; the plain
loop's persistent update buffers and per-group damping against a hand 2x2 solve.
"""

from __future__ import annotations

import pytest
import torch
from cases import train_step
from torch import nn

import curvature
from curvature.layers.registry import registered_rule
from curvature.optim.batch_gram import Projection, layer_products, projection_of

MSE = nn.MSELoss()


#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def brute_products(V, a, g, index):
    """``u[k, l, n] = sum_{s, c} g[l, n, s, c]^T M_k[c] a[n, s, c]``, ``M_k = V_k[index]``."""
    K, (N, S, C, _), L = V.shape[0], a.shape, g.shape[0]
    u = torch.zeros(K, L, N, dtype=V.dtype)
    for k in range(K):
        M = V[k][index]  # [C, D_out, D]
        for j in range(L):
            for n in range(N):
                for s in range(S):
                    for c in range(C):
                        u[k, j, n] += g[j, n, s, c] @ (M[c] @ a[n, s, c])
    return u


LAYERS = ["linear", "linear-no-bias", "linear-frozen-weight", "linear-wide", "conv-groups"]


def layer(name):
    if name == "conv-groups":
        return nn.Conv2d(4, 6, 2, groups=2)
    if name == "linear-wide":  # D_out >= D: through g^T W
        return nn.Linear(3, 7)
    module = nn.Linear(5, 3, bias=name != "linear-no-bias")
    module.weight.requires_grad_(name != "linear-frozen-weight")
    return module


@pytest.mark.parametrize("name", LAYERS)
def test_strided_views_give_the_gathered_products(name):
    """A Linear's ``[W | b]`` and a grouped convolution's weight lie in contiguous spans
    of the flat vector (after 7 positions of another layer): ``z = a_w W^T + a_b b`` from
    views equals the gathered ``V[index] a`` and the brute-force loop."""
    torch.manual_seed(0)
    module = layer(name).double()
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    offsets, start = {}, 7
    for n, p in trainable:
        offsets[n] = start
        start += p.numel()
    index = registered_rule(module).kfac_index(module, offsets)[""]
    where = projection_of(index, torch.device("cpu"))
    assert where.weight == 7
    assert (where.bias is not None) == (len(trainable) == 2)
    C, Do, D = index.shape
    N, S, L, K = 4, 3 if name.startswith("conv") else 1, 2, 2
    V = torch.randn(K, start + 5, dtype=torch.float64)
    a = torch.randn(N, S, C, D, dtype=torch.float64)
    g = torch.randn(L, N, S, C, Do, dtype=torch.float64)
    expected = brute_products(V, a, g, index)
    strided = layer_products(V, a, g, where)
    gathered = layer_products(V, a, g, Projection(index))
    torch.testing.assert_close(strided, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gathered, expected, rtol=1e-12, atol=1e-12)


def test_an_index_without_strides_is_gathered():
    """Positions out of order (a transposed weight) are not read as a span."""
    index = (torch.arange(9).view(3, 3).T.contiguous() + 4).view(1, 3, 3)
    where = projection_of(index, torch.device("cpu"))
    assert where.weight is None
    V = torch.randn(2, 15, dtype=torch.float64)
    a, g = torch.randn(5, 1, 1, 3, dtype=torch.float64), torch.randn(1, 5, 1, 1, 3).double()
    torch.testing.assert_close(layer_products(V, a, g, where), brute_products(V, a, g, index))


def mlp_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    X, y = torch.randn(32, 6, dtype=torch.float64), torch.randn(32, 2, dtype=torch.float64)
    return model, X, y


def test_replaced_momentum_states_are_read_as_they_are():
    """The plain loop keeps the last update in a persistent buffer whose views are the
    ``previous_update`` states; states replaced by the user (here by equal copies, and
    in a twin with one layer's halved) are what the next step uses."""
    runs = []
    for scale in (1.0, 1.0, 0.5):
        model, X, y = mlp_problem()
        opt = curvature.KFAC(model, fisher="type-2", loss_func=MSE, update_rule="quadratic")
        for i in range(4):
            if i == 2 and len(runs) > 0:  # (one layer halved: another span)
                states = [opt.state[p] for p in model.parameters()]
                for j, state in enumerate(states):
                    state["previous_update"] = state["previous_update"] * (scale if j else 1.0)
            train_step(opt, model, X, y, MSE)
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        opt.close()
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_group_dampings_enter_the_2x2_model_per_position():
    """Two groups with different dampings: ``v^T (C + Lambda) w`` with ``Lambda`` each
    position's group damping; a linear model (Kronecker = GGN, exact) against the hand
    solve with the dense GGN."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    X, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
    groups = [{"params": [model.weight], "damping": 1e-2}, {"params": [model.bias]}]
    opt = curvature.KFAC(
        model,
        param_groups=groups,
        damping=3e-1,
        fisher="type-2",
        loss_func=MSE,
        update_rule="quadratic",
    )
    flat = lambda: torch.cat([p.detach().flatten() for p in model.parameters()])  # noqa: E731
    theta0 = flat()
    train_step(opt, model, X, y, MSE)
    theta1 = flat()
    model.zero_grad()
    MSE(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    g = torch.cat([t.flatten() for t in grads])
    lam = torch.tensor([opt.param_groups[0]["damping"]] * 6 + [opt.param_groups[1]["damping"]] * 2)
    C = curvature.ggn(model, MSE, (X, y)) + torch.diag(lam.double())
    train_step(opt, model, X, y, MSE)
    Delta = -torch.cat([d.flatten() for d in opt.inverse_matvec(grads)])
    V = torch.stack([Delta, theta1 - theta0], 1)
    alpha, mu = torch.linalg.solve(V.T @ C @ V, -V.T @ g).tolist()
    assert opt.last_update_coefficients == pytest.approx((alpha, mu), rel=1e-7)
    opt.close()


def test_a_checkpoint_holds_the_momentum_as_tensors_of_their_own():
    """The ``previous_update`` states are views of the plain loop's persistent buffers;
    ``state_dict()`` gives them as copies of their own size (a saved checkpoint holds
    ``P`` values, not the buffers' ``4 P``), and taking it changes nothing in the run."""
    runs = []
    for save in (False, True):
        model, X, y = mlp_problem()
        opt = curvature.KFAC(model, fisher="mc", loss_func=MSE, update_rule="quadratic", seed=1)
        for _ in range(3):
            train_step(opt, model, X, y, MSE)
            if save:
                state = opt.state_dict()["state"]
                for i, p in enumerate(model.parameters()):
                    saved = state[i]["previous_update"]
                    assert saved.untyped_storage().nbytes() == p.numel() * p.element_size()
                    assert torch.equal(saved, opt.state[p]["previous_update"])
        runs.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
        opt.close()
    assert torch.equal(runs[0], runs[1])
