"""KFAC for Laplacian (PINN) losses: factors over the d+2 forward-Laplacian slots."""

import pytest
import torch
from torch import nn

import curvature
from curvature.laplacian import laplacian

pytestmark = pytest.mark.usefixtures("float64")


def _tanh_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))


def _slots_by_hand(model, x):
    """Independent forward Laplacian of a Linear-Tanh-Linear net, exposing every layer.

    Returns the slot inputs ``a`` of both Linear layers ``[N, 4, D]`` (value, d/dx1,
    d/dx2, Laplacian) and a function of the second layer's slot outputs giving the
    Laplacian of u, so that ``g`` can be differentiated independently.
    """
    W1, b1 = model[0].weight, model[0].bias
    N = x.shape[0]
    a1 = torch.stack(
        [
            x,
            torch.eye(2).expand(N, 2, 2)[:, 0],
            torch.eye(2).expand(N, 2, 2)[:, 1],
            torch.zeros_like(x),
        ],
        dim=1,
    )  # [N, 4, 2]

    def layer1(z1):  # slot outputs of layer 1 (bias on the value slot only) -> tanh slots
        v, d1, d2, lap = z1.unbind(1)
        t = torch.tanh(v)
        s1 = 1 - t**2
        s2 = -2 * t * s1
        return torch.stack([t, s1 * d1, s1 * d2, s1 * lap + s2 * (d1**2 + d2**2)], 1)

    z1 = a1 @ W1.T
    z1 = torch.cat([z1[:, :1] + b1, z1[:, 1:]], 1)
    a2 = layer1(z1)
    return a1, z1, a2, layer1


def _mask_bias(a, bias=True):
    col = torch.zeros(*a.shape[:-1], 1)
    col[:, 0] = 1.0
    return torch.cat([a, col], -1) if bias else a


def test_interior_kfac_factors_match_an_independent_forward_laplacian():
    model = _tanh_net()
    x = torch.rand(5, 2)
    N, S = 5, 4
    mse = nn.MSELoss()
    opt = curvature.KFAC(
        model,
        lr=0.0,
        damping=1.0,
        fisher="type-2",
        loss_func=mse,
        auto_output=False,
        damping_mode="exact",
    )
    lap = laplacian(model, x, method="forward")
    r = lap + 1.0
    opt.register_output(r.unsqueeze(-1), mse, torch.zeros(N, 1))
    (0.5 * r.pow(2).mean()).backward()
    opt.step()
    factors = opt.factors()

    a1, z1, a2, layer1 = _slots_by_hand(model, x)
    W2 = model[2].weight
    # Laplacian of u as a function of each layer's slot outputs
    z1 = z1.detach().requires_grad_(True)
    a2_ = layer1(z1)
    z2 = a2_ @ W2.T  # bias only on the value slot: does not affect the Laplacian slot
    lap_u = z2[:, 3, 0]
    torch.testing.assert_close(lap_u, lap.detach())
    (g1,) = torch.autograd.grad(lap_u.sum(), z1)  # [N, 4, 3]
    g2 = torch.zeros(N, S, 1)
    g2[:, 3, 0] = 1.0  # d lap_u / d z2 slots
    scale = 2.0 / N  # type-2 of MSELoss(mean) on r [N, 1]: Hessian 2/N per sample
    for name, a, g in (("0", a1, g1), ("2", a2.detach(), g2)):
        A_ref = torch.einsum("nsi,nsj->ij", _mask_bias(a), _mask_bias(a)) / (N * S)
        G_ref = scale * torch.einsum("nso,nsp->op", g, g)
        A, G = factors[name]
        torch.testing.assert_close(A, A_ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(G, G_ref, rtol=1e-10, atol=1e-12)


def test_interior_and_boundary_terms_are_separate_kronecker_products():
    model = _tanh_net()
    x_int, x_bnd = torch.rand(6, 2), torch.rand(4, 2)
    mse = nn.MSELoss()
    opt = curvature.KFAC(
        model, lr=0.0, damping=1e-3, fisher="type-2", loss_func=mse, auto_output=False
    )
    r = laplacian(model, x_int, method="forward") + 1.0
    u_b = model(x_bnd)
    opt.register_output(r.unsqueeze(-1), mse, torch.zeros(6, 1))
    opt.register_output(u_b, mse, torch.zeros(4, 1))
    (0.5 * r.pow(2).mean() + 0.5 * u_b.pow(2).mean()).backward()
    opt.step()
    factors = opt.factors()
    for name in ("0", "2"):
        (A_int, G_int), (A_b, G_b) = factors[name]
        K_b = curvature.kfac(model, mse, (x_bnd, torch.zeros(4, 1))).factors[name]
        torch.testing.assert_close(A_b, K_b[0])
        torch.testing.assert_close(G_b, K_b[1])
        assert A_int.shape == A_b.shape


def test_forward_laplacian_per_sample_bias_gradient_uses_the_value_slot_only():
    """Per-sample gradients through the forward Laplacian match torch.func on the residual."""
    model = _tanh_net()
    x = torch.rand(4, 2)
    with curvature.capture(model) as cap:
        lap = laplacian(model, x, method="forward")
    grads = cap.per_sample_grads(lap.pow(2))
    for n in range(4):
        model.zero_grad()
        laplacian(model, x[n : n + 1], method="forward").pow(2).sum().backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name][n], p.grad, rtol=1e-10, atol=1e-12)


def test_pinn_example_runs_and_kfac_beats_adam_per_step():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "pinn_poisson.py"
    spec = importlib.util.spec_from_file_location("pinn_poisson", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    hist = mod.main(
        [
            "--optimizers",
            "kfac",
            "adam",
            "--steps",
            "15",
            "--n-int",
            "100",
            "--n-bnd",
            "40",
            "--n-eval",
            "500",
            "--width",
            "16",
            "--log-every",
            "15",
        ]
    )
    assert hist["kfac"]["l2"][-1] < hist["adam"]["l2"][-1]


def _pinn_example():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "pinn_poisson.py"
    spec = importlib.util.spec_from_file_location("pinn_poisson", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _SumOfSines(nn.Module):
    """``u(x) = sum_i sin(k pi x_i)`` (``k = 1``: the 5d Poisson solution): ``[N, 1]``."""

    def __init__(self, k=1):
        super().__init__()
        self.inner, self.outer = nn.Linear(5, 5, bias=False), nn.Linear(5, 1, bias=False)
        with torch.no_grad():
            self.inner.weight.copy_(k * torch.pi * torch.eye(5))
            self.outer.weight.fill_(1.0)

    def forward(self, x):
        return self.outer(torch.sin(self.inner(x)))


def test_pinn_example_poisson5d_residual_vanishes_at_the_exact_solution():
    mod = _pinn_example()
    gen = torch.Generator().manual_seed(0)
    x_int, x_bnd, g_bnd, x_eval, solution, residual = mod.poisson5d(gen, 50, 40, 30)
    assert x_int.shape == (50, 5) and x_bnd.shape == (40, 5) and x_eval.shape == (30, 5)
    # every boundary point is on a face of [0, 1]^5; the targets are the solution there
    on_face = ((x_bnd == 0) | (x_bnd == 1)).sum(1)
    assert (on_face == 1).all()
    expected = (torch.sin(torch.pi * x_bnd)).sum(1)
    torch.testing.assert_close(g_bnd, expected)
    exact = _SumOfSines()
    torch.testing.assert_close(exact(x_eval).squeeze(-1), solution(x_eval))
    r = residual(exact, x_int)
    assert r.shape == (50,)
    torch.testing.assert_close(r, torch.zeros(50), atol=1e-10, rtol=0)

    # a wrong solution (a different frequency) leaves a residual of order one
    assert residual(_SumOfSines(k=2), x_int).abs().mean() > 1.0


@pytest.mark.parametrize("factor_damping", ["tied", "greedy"])
def test_pinn_example_poisson5d_kfac_lowers_the_loss(factor_damping):
    mod = _pinn_example()
    # the first steps are rejected while the rule's back-off raises the damping from its
    # initial 1e-2 (the initial loss is ~5e2); then the loss falls fast
    argv = ["--problem", "poisson5d", "--optimizers", "kfac", "--steps", "25"]
    argv += ["--factor-damping", factor_damping]
    argv += ["--n-int", "100", "--n-bnd", "50", "--n-eval", "200", "--log-every", "25"]
    hist = mod.main(argv)["kfac"]
    assert hist["step"] == [0, 25]
    assert hist["loss"][-1] < 0.5 * hist["loss"][0]
    assert hist["l2"][-1] < hist["l2"][0]
    # the deeper default network of the 5d problem
    model = mod.make_model(5, (64, 64, 48, 48))
    assert [m.weight.shape[1] for m in model if isinstance(m, nn.Linear)] == [5, 64, 64, 48, 48]


def _block_vector(model, name, vectors):
    """``M [D_out, D_in + 1]``: a layer's entries of ``vectors`` (bias as the last column)."""
    named = dict(zip([n for n, _ in model.named_parameters()], vectors))
    return torch.cat([named[f"{name}.weight"], named[f"{name}.bias"][:, None]], 1)


def _damped(A, G, damping, mode):
    eye_a, eye_g = torch.eye(A.shape[0]), torch.eye(G.shape[0])
    if mode == "per_factor":
        return torch.kron(G + damping * eye_g, A + damping * eye_a)
    pi = ((A.diagonal().mean() / G.diagonal().mean()) ** 0.5).item()
    root = damping**0.5
    return torch.kron(G + root / pi * eye_g, A + pi * root * eye_a)


@pytest.mark.parametrize("mode", ["per_factor", "pi"])
@pytest.mark.parametrize("damping", [1e-1, 1e-4])
def test_two_term_inverse_is_the_dense_inverse_of_every_term_damped(mode, damping):
    """Interior + boundary: the inverse equals the dense ``(sum_t damped kron(G_t, A_t))^-1``.

    ``per_factor``: ``(A_t + lambda I) x (G_t + lambda I)`` for every term ``t``; ``pi``:
    every term with its own ``pi_t``.
    """
    model = _tanh_net()
    x_int, x_bnd = torch.rand(7, 2), torch.rand(5, 2)
    mse = nn.MSELoss()
    opt = curvature.KFAC(
        model,
        lr=0.0,
        damping=damping,
        fisher="type-2",
        loss_func=mse,
        auto_output=False,
        damping_mode=mode,
        inverse_every=1,
    )
    r = laplacian(model, x_int, method="forward") + 1.0
    u_b = model(x_bnd)
    opt.register_output(r.unsqueeze(-1), mse, torch.zeros(7, 1))
    opt.register_output(u_b, mse, torch.zeros(5, 1))
    (0.5 * r.pow(2).mean() + 0.5 * u_b.pow(2).mean()).backward()
    opt.step()
    v = [torch.randn_like(p) for p in model.parameters()]
    out = opt.inverse_matvec(v)
    for name, terms in opt.factors().items():
        dense = sum(_damped(A, G, damping, mode) for A, G in terms)
        M = _block_vector(model, name, v)
        expected = torch.linalg.solve(dense, M.reshape(-1)).reshape(M.shape)
        torch.testing.assert_close(_block_vector(model, name, out), expected, rtol=1e-8, atol=0)
    opt.close()


@pytest.mark.parametrize("inverse_method", ["cholesky", "eigh"])
def test_one_term_per_factor_inverse_is_the_dense_inverse(inverse_method):
    model = _tanh_net()
    X, y = torch.rand(9, 2), torch.rand(9, 1)
    mse, damping = nn.MSELoss(), 1e-3
    opt = curvature.KFAC(
        model,
        lr=0.0,
        damping=damping,
        fisher="type-2",
        loss_func=mse,
        damping_mode="per_factor",
        inverse_method=inverse_method,
    )
    mse(model(X), y).backward()
    opt.step()
    v = [torch.randn_like(p) for p in model.parameters()]
    out = opt.inverse_matvec(v)
    for name, (A, G) in opt.factors().items():
        M = _block_vector(model, name, v)
        dense = _damped(A, G, damping, "per_factor")
        expected = torch.linalg.solve(dense, M.reshape(-1)).reshape(M.shape)
        torch.testing.assert_close(_block_vector(model, name, out), expected, rtol=1e-9, atol=0)
    opt.close()


def test_pinn_example_plain_loop_measures_the_composite_loss_and_trains():
    """``--loop plain`` (the 5d default): ``loss.backward(); opt.step()``, measured by the
    next step's ``loss_func`` calls weighted by their backward (0.5 each: the example's
    loss itself); it trains, and a plain loop with the line search is refused."""
    mod = _pinn_example()
    small = ["--n-int", "100", "--n-bnd", "40", "--n-eval", "500", "--width", "16"]
    hist = mod.main(
        ["--optimizers", "kfac", "--steps", "30", "--log-every", "30", "--loop", "plain", *small]
    )["kfac"]
    assert hist["l2"][-1] < 0.2 * hist["l2"][0]
    assert hist["loss"][-1] < 0.05 * hist["loss"][0]
    with pytest.raises(SystemExit):
        mod.main(["--optimizers", "kfac", "--loop", "plain", "--update-rule", "line-search"])


def test_pinn_example_loop_defaults():
    """plain on the 5d problem (no loss-only evaluation per step), closure elsewhere."""
    mod = _pinn_example()
    seen = {}
    real = mod.train

    def spy(name, args, problem):
        seen[args.problem] = args.loop
        return {"step": [0], "time": [0.0], "l2": [1.0], "loss": [1.0]}

    mod.train = spy
    try:
        for problem in ("poisson", "heat", "poisson5d"):
            mod.main(["--problem", problem, "--optimizers", "kfac", "--steps", "0"])
    finally:
        mod.train = real
    assert seen == {"poisson": "closure", "heat": "closure", "poisson5d": "plain"}
