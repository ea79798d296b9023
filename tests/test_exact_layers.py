"""``KFAC(exact_layer_size=P)``: layers with at most ``P`` parameters keep their exact
Fisher block (one dense ``[P_l, P_l]`` block from the per-vector gradients) instead of
``A (x) G``.

Twins: the dense GGN of ``curvature.dense.ggn`` (an MLP, MSE, ``fisher="type-2"``, where
the exact block is exactly the GGN's diagonal block), and, for the forward Laplacian's
weight sharing (a PINN with two registered terms), ``J^T J / N`` per term from
``torch.func`` (tests/test_optim_quadratic_pinn.py's ``dense_ggn``).
"""

from __future__ import annotations

import io

import pytest
import torch
from test_optim_quadratic_pinn import dense_ggn, pinn_closure, problem
from torch import nn

import curvature
from curvature import dense

MSE = nn.MSELoss()


#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def data():
    g = torch.Generator().manual_seed(1)
    return (
        torch.randn(7, 3, generator=g, dtype=torch.float64),
        torch.randn(7, 2, generator=g, dtype=torch.float64),
    )


def one_step(model, **kw):
    X, y = data()
    opt = curvature.KFAC(model, fisher="type-2", loss_func=MSE, **kw)
    MSE(model(X), y).backward()
    opt.step()
    return opt


@pytest.mark.parametrize("size", [16, 26], ids=["first-layer", "both-layers"])
def test_exact_blocks_are_the_ggn_blocks_of_the_small_layers(size):
    """Layer 0 has 16 parameters, layer 2 has 10: ``size=16`` makes both exact, and the
    first step's factors (the running estimates start from them) are ``A = [[1]]`` and
    the GGN's diagonal blocks; below 10 nothing changes."""
    model = mlp()
    X, y = data()
    C = dense.ggn(model, MSE, (X, y))
    factors = one_step(model, exact_layer_size=size).factors()
    for name, (lo, hi) in {"0": (0, 16), "2": (16, 26)}.items():
        A, G = factors[name]
        assert A.shape == (1, 1) and A.item() == 1.0
        torch.testing.assert_close(G, C[lo:hi, lo:hi], rtol=1e-12, atol=1e-14)
    kron = one_step(mlp(), exact_layer_size=9).factors()
    assert kron["0"][0].shape == (4, 4) and kron["2"][0].shape == (5, 5)  # [D_in + 1]^2


def test_exact_block_of_a_forward_laplacian_layer_is_j_transpose_j():
    """A PINN (forward Laplacian, weight sharing over the slots; interior and boundary
    terms registered): the first layer's exact block of each term sums to the GGN block
    ``J^T J / N`` of the loss, which the Kronecker factorization does not give."""
    net, x_int, x_bnd, g_bnd, f = problem()
    C = dense_ggn(net, x_int, x_bnd)
    opt = curvature.KFAC(
        net, lr=1e-3, fisher="type-2", loss_func=MSE, auto_output=False, exact_layer_size=15
    )
    pinn_closure(opt, net, x_int, x_bnd, g_bnd, f)()
    opt.step()
    terms = opt.factors()["0"]  # two terms: interior, boundary
    assert len(terms) == 2 and all(A.shape == (1, 1) for A, _ in terms)
    torch.testing.assert_close(terms[0][1] + terms[1][1], C[:15, :15], rtol=1e-10, atol=1e-12)
    kron = curvature.KFAC(net, fisher="type-2", loss_func=MSE, auto_output=False)
    pinn_closure(kron, net, x_int, x_bnd, g_bnd, f)()
    kron.step()
    approx = sum(torch.kron(G, A) for A, G in kron.factors()["0"])  # [W | b] row-major
    assert not torch.allclose(approx, C[:15, :15], rtol=1e-3)  # (in another layout, too)


def test_exact_blocks_precondition_with_the_damped_inverse():
    """The update of an exact layer is ``-lr (F_l + lambda I)^{-1} grad`` (per-factor
    damping with ``A = [[1]]``: ``(1 + lambda)(F_l + lambda I)``)."""
    model = mlp()
    X, y = data()
    C = dense.ggn(model, MSE, (X, y))
    before = [p.detach().clone() for p in model.parameters()]
    opt = curvature.KFAC(
        model,
        lr=0.1,
        damping=1e-2,
        damping_mode="per_factor",
        fisher="type-2",
        loss_func=MSE,
        exact_layer_size=16,
    )
    MSE(model(X), y).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    move = after - torch.cat([p.reshape(-1) for p in before])
    eye = torch.eye(16, dtype=torch.float64)
    want = -0.1 * torch.linalg.solve(1.01 * (C[:16, :16] + 1e-2 * eye), grad[:16])
    torch.testing.assert_close(move[:16], want, rtol=1e-9, atol=1e-12)


def test_state_dict_round_trip_and_refusal_across_structures():
    opt = one_step(mlp(), exact_layer_size=16)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=False)
    again = curvature.KFAC(mlp(), fisher="type-2", loss_func=MSE, exact_layer_size=16)
    again.load_state_dict(state)
    for name, (A, G) in opt.factors().items():
        torch.testing.assert_close(again.factors()[name][0], A)
        torch.testing.assert_close(again.factors()[name][1], G)
    kron = curvature.KFAC(mlp(), fisher="type-2", loss_func=MSE)
    with pytest.raises(ValueError, match="shape"):
        kron.load_state_dict(state)


@pytest.mark.parametrize("bad", [-1, 4097, 1.5, True, "16"])
def test_bad_exact_layer_size_is_refused(bad):
    with pytest.raises(ValueError, match="exact_layer_size"):
        curvature.KFAC(mlp(), exact_layer_size=bad)


def test_ekfac_refuses_exact_layers():
    with pytest.raises(ValueError, match="exact_layer_size=16.*KFAC option"):
        curvature.EKFAC(mlp(), exact_layer_size=16)
    curvature.EKFAC(mlp(), exact_layer_size=0).close()
