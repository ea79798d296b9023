"""Input Laplacians: forward Laplacian, nested autograd and Hutchinson vs torch.func.hessian."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvature.laplacian import (
    ACTIVATIONS,
    FORWARD_LAPLACIAN_SLOTS,
    current_slots,
    forward_laplacian,
    laplacian,
    register_activation,
)
from curvature.layers.base import SHARED_SLOTS, current_shared_slots, shared_slots
from curvature.options import LaplacianMethod, Unsupported

DT = torch.float64
D_IN, N = 4, 5

ACTIVATION_MODULES = {
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "relu": nn.ReLU,
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "elu": lambda: nn.ELU(0.7),
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "softplus": lambda: nn.Softplus(beta=2.0),
    "softplus_threshold": lambda: nn.Softplus(beta=1.0, threshold=0.5),
    "identity": nn.Identity,
}


def _mlp(act: str, out: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    make = ACTIVATION_MODULES[act]
    shared = make()  # the same module object used twice, as users often do
    return nn.Sequential(nn.Linear(D_IN, 8), shared, nn.Linear(8, 8), shared, nn.Linear(8, out)).to(
        DT
    )


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(N, D_IN, dtype=DT, generator=torch.Generator().manual_seed(seed))


def _input_hessians(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[N, O, d, d]``: the Hessian of every output w.r.t. the input, per sample."""

    def f(xi):
        return model(xi[None]).reshape(-1)

    return torch.vmap(torch.func.hessian(f))(x.detach())


def _reference(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    lap = _input_hessians(model, x).diagonal(dim1=-2, dim2=-1).sum(-1)  # [N, O]
    return lap.squeeze(-1) if lap.shape[-1] == 1 else lap


# -- exactness -----------------------------------------------------------------------------------
@pytest.mark.parametrize("out", [1, 3], ids=["scalar", "vector"])
@pytest.mark.parametrize("act", list(ACTIVATION_MODULES))
@pytest.mark.parametrize("method", ["forward", "autograd"])
def test_laplacian_equals_trace_of_the_input_hessian(method, act, out):
    model, x = _mlp(act, out), _x()
    lap = laplacian(model, x, method=method)
    assert lap.shape == ((N,) if out == 1 else (N, out))
    torch.testing.assert_close(lap, _reference(model, x), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("out", [1, 3], ids=["scalar", "vector"])
@pytest.mark.parametrize("act", ["tanh", "gelu", "silu", "softplus", "sigmoid"])
def test_hutchinson_laplacian_is_within_four_standard_errors_of_the_exact_one(act, out):
    model, x = _mlp(act, out), _x()
    K = 10000
    H = _input_hessians(model, x)  # [N, O, d, d]
    off = H - torch.diag_embed(H.diagonal(dim1=-2, dim2=-1))
    std = (2 * off.square().sum((-2, -1)) / K).sqrt()  # Rademacher: 2 sum_{i!=j} H_ij^2 / K
    std = std.squeeze(-1) if out == 1 else std
    gen = torch.Generator().manual_seed(2)
    lap = laplacian(model, x, method="hutchinson", num_samples=K, generator=gen)
    exact = _reference(model, x)
    assert lap.shape == exact.shape
    assert ((lap - exact).abs() <= 4 * std + 1e-12).all(), (lap - exact).abs() / std
    assert 4 * std.max() < 0.2 * exact.abs().max()  # the tolerance is tight enough to mean it


def test_hutchinson_laplacian_is_exact_for_a_diagonal_input_hessian():
    class Separable(nn.Module):  # f(x) = sum_i w_i tanh(x_i): diagonal Hessian
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(D_IN, dtype=DT))

        def forward(self, x):
            return (torch.tanh(x) * self.w).sum(-1, keepdim=True)

    model, x = Separable(), _x()
    lap = laplacian(model, x, method="hutchinson", num_samples=2)
    torch.testing.assert_close(lap, _reference(model, x))


def test_hutchinson_laplacian_is_reproducible_with_a_generator():
    model, x = _mlp("tanh", 1), _x()
    a = laplacian(
        model, x, method="hutchinson", num_samples=3, generator=torch.Generator().manual_seed(4)
    )
    b = laplacian(
        model, x, method="hutchinson", num_samples=3, generator=torch.Generator().manual_seed(4)
    )
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("method", ["forward", "autograd", "hutchinson"])
def test_affine_model_has_zero_laplacian(method):
    model, x = nn.Linear(D_IN, 2).to(DT), _x()
    kw = {"num_samples": 3} if method == "hutchinson" else {}
    lap = laplacian(model, x, method=method, **kw)
    torch.testing.assert_close(lap, torch.zeros(N, 2, dtype=DT))


def test_scalar_output_of_shape_n_gives_shape_n():
    class Squeezed(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp("tanh", 1)

        def forward(self, x):
            return self.net(x).squeeze(-1)  # [N]: not supported by the forward Laplacian

    model, x = Squeezed(), _x()
    with pytest.warns(UserWarning, match="squeeze"):
        lap = laplacian(model, x)
    assert lap.shape == (N,)
    torch.testing.assert_close(lap, laplacian(model.net, x))


def test_float32_forward_laplacian_matches_autograd():
    model = _mlp("tanh", 1).float()
    x = _x().float()
    torch.testing.assert_close(
        laplacian(model, x), laplacian(model, x, method="autograd"), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("observed", [False, True], ids=["plain", "hooked"])
def test_float32_forward_laplacian_with_large_biases_is_accurate(observed):
    # W dz + b - b loses the digits of W dz below |b|; an unobserved Linear never adds b to
    # the derivative slots (relative error 4.8e-5 before, 1e-6 after). A hooked one must
    # call the module, so it keeps the subtraction (documented): a looser bound there.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
    model.append(nn.Linear(64, 1))
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.bias.fill_(3.0)
    x = torch.randn(64, 16)
    ref = laplacian(copy.deepcopy(model).double(), x.double())
    handles = [m.register_forward_hook(lambda *a: None) for m in model] if observed else []
    lap = laplacian(model, x)
    for h in handles:
        h.remove()
    err = ((lap.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < (2e-4 if observed else 1e-5)


# -- weighted Laplacians and the forward Laplacian's other slots ---------------------------------
COEFFICIENTS = [0.0, 0.25, -1.5, 2.0]  # a zero (skipped direction) and a negative weight


@pytest.mark.parametrize("out", [1, 3], ids=["scalar", "vector"])
@pytest.mark.parametrize("method", ["forward", "autograd"])
def test_weighted_laplacian_equals_the_weighted_diagonal_of_the_input_hessian(method, out):
    model, x = _mlp("silu", out), _x()
    c = torch.tensor(COEFFICIENTS, dtype=DT)
    exact = (_input_hessians(model, x).diagonal(dim1=-2, dim2=-1) * c).sum(-1)
    exact = exact.squeeze(-1) if out == 1 else exact
    lap = laplacian(model, x, method=method, coefficients=COEFFICIENTS)
    torch.testing.assert_close(lap, exact, rtol=1e-10, atol=1e-12)


def test_weighted_hutchinson_laplacian_converges_to_the_weighted_trace():
    model, x = _mlp("tanh", 1), _x()
    c = torch.tensor(COEFFICIENTS, dtype=DT)
    H = _input_hessians(model, x)[:, 0]  # [N, d, d]
    exact = (H.diagonal(dim1=-2, dim2=-1) * c).sum(-1)
    K = 10000  # v^T H (c * v) = sum_i c_i H_ii + sum_{i != j} c_i H_ij v_i v_j
    off = (H * c.view(1, -1, 1)) - torch.diag_embed(H.diagonal(dim1=-2, dim2=-1) * c)
    std = ((off.square() + off * off.transpose(-1, -2)).sum((-2, -1)) / K).sqrt()
    gen = torch.Generator().manual_seed(8)
    lap = laplacian(model, x, method="hutchinson", num_samples=K, coefficients=c, generator=gen)
    assert ((lap - exact).abs() <= 4 * std + 1e-12).all()


def test_a_scalar_coefficient_scales_the_laplacian():
    model, x = _mlp("tanh", 1), _x()
    torch.testing.assert_close(laplacian(model, x, coefficients=0.5), 0.5 * laplacian(model, x))


@pytest.mark.parametrize("out", [1, 3], ids=["scalar", "vector"])
@pytest.mark.parametrize("fallback", [False, True], ids=["forward", "fallback"])
def test_forward_laplacian_returns_value_jacobian_and_weighted_laplacian(out, fallback):
    model, x = _mlp("gelu", out), _x()
    if fallback:  # an unsupported layer: the autograd fallback returns the same three parts
        model = nn.Sequential(model, nn.Dropout(p=0.0))
    c = torch.tensor(COEFFICIENTS, dtype=DT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = forward_laplacian(model, x, coefficients=c)
    J = torch.vmap(torch.func.jacrev(lambda xi: model(xi[None]).reshape(-1)))(x)  # [N, O, d]
    lap = (_input_hessians(model, x).diagonal(dim1=-2, dim2=-1) * c).sum(-1)
    if out == 1:
        J, lap = J[:, 0], lap[:, 0]
    torch.testing.assert_close(res.value, model(x).squeeze(-1) if out == 1 else model(x))
    torch.testing.assert_close(res.jacobian, J, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(res.laplacian, lap, rtol=1e-10, atol=1e-12)
    assert res.jacobian.requires_grad and res.laplacian.requires_grad


def test_heat_equation_residual_from_one_forward_laplacian():
    torch.manual_seed(9)
    model = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1)).to(DT)
    tx = torch.rand(7, 2, dtype=DT)
    res = forward_laplacian(model, tx, coefficients=torch.tensor([0.0, 0.25]))  # float32 is cast

    def u(z):
        return model(z[None]).reshape(())

    u_t = torch.vmap(torch.func.grad(u))(tx)[:, 0]
    u_xx = torch.vmap(torch.func.hessian(u))(tx)[:, 1, 1]
    torch.testing.assert_close(res.jacobian[:, 0] - res.laplacian, u_t - u_xx / 4)


@pytest.mark.parametrize(
    "coefficients, match",
    [([1.0, 2.0], r"shape \(2,\)"), ("abc", "coefficients"), (torch.ones(D_IN, 2), "shape")],
)
def test_bad_coefficients_raise_value_error(coefficients, match):
    with pytest.raises(ValueError, match=match):
        laplacian(_mlp("tanh", 1), _x(), coefficients=coefficients)


# -- gradients -----------------------------------------------------------------------------------
def _grads(value, params):
    return torch.autograd.grad(value, params, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("out", [1, 3], ids=["scalar", "vector"])
@pytest.mark.parametrize("act", ["tanh", "gelu_tanh", "silu", "softplus", "relu"])
def test_parameter_gradients_of_a_laplacian_loss_match_between_forward_and_autograd(act, out):
    model, x = _mlp(act, out), _x()
    ps = list(model.parameters())
    weights = torch.randn(N, out, dtype=DT).squeeze(-1)
    g_fwd = _grads((laplacian(model, x, method="forward") * weights).sum(), ps)
    g_ad = _grads((laplacian(model, x, method="autograd") * weights).sum(), ps)
    for a, b in zip(g_fwd, g_ad):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_parameter_gradient_of_the_forward_laplacian_matches_torch_func():
    model, x = _mlp("tanh", 1), _x()
    names = [n for n, _ in model.named_parameters()]
    ps = dict(model.named_parameters())

    def loss_of(params):
        def f(xi):
            return torch.func.functional_call(model, params, (xi[None],)).reshape(())

        H = torch.vmap(torch.func.hessian(f))(x)
        return H.diagonal(dim1=-2, dim2=-1).sum(-1).square().mean()

    expected = torch.func.grad(loss_of)({n: p.detach() for n, p in ps.items()})
    got = _grads(laplacian(model, x).square().mean(), list(ps.values()))
    for n, g in zip(names, got):
        torch.testing.assert_close(g, expected[n], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method", ["forward", "autograd"])
def test_laplacian_is_differentiable_wrt_the_input(method):
    model = _mlp("tanh", 1)
    x = _x().requires_grad_(True)
    (gx,) = torch.autograd.grad(laplacian(model, x, method=method).sum(), x)

    def lap_of(xi):
        return torch.func.hessian(lambda z: model(z[None]).reshape(()))(xi).trace()

    torch.testing.assert_close(gx, torch.vmap(torch.func.grad(lap_of))(x.detach()))


# -- traced custom modules --------------------------------------------------------------------
class ResidualPINN(nn.Module):
    """Residual connections, functional activations, products and constants."""

    def __init__(self, out: int = 2):
        super().__init__()
        self.inp = nn.Linear(D_IN, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.SiLU())
        self.out = nn.Linear(6, out)
        self.scale = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + F.gelu(self.block(h), approximate="tanh") * self.scale
        h = h.sigmoid() * torch.sin(h) - 0.5 + F.softplus(h, beta=3.0) / 2
        h = 1.0 - h * h + 0.1 * h**3 / 2.0
        return self.out(-h)


def test_traced_custom_module_forward_laplacian_is_exact():
    torch.manual_seed(3)
    model, x = ResidualPINN().to(DT), _x()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to autograd
        lap = laplacian(model, x, unsupported="error")
    torch.testing.assert_close(lap, _reference(model, x), rtol=1e-10, atol=1e-12)
    ps = list(model.parameters())
    for a, b in zip(
        _grads(lap.sum(), ps), _grads(laplacian(model, x, method="autograd").sum(), ps)
    ):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_custom_module_nested_in_a_sequential_is_traced():
    torch.manual_seed(4)
    model = nn.Sequential(ResidualPINN(out=3), nn.Tanh(), nn.Linear(3, 1)).to(DT)
    x = _x()
    torch.testing.assert_close(
        laplacian(model, x, unsupported="error"), _reference(model, x), rtol=1e-10, atol=1e-12
    )


# -- unsupported layers and errors -------------------------------------------------------------
def _with_layernorm() -> nn.Module:
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(D_IN, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 1)).to(DT)


def test_unsupported_layer_falls_back_to_autograd_with_a_warning():
    model, x = _with_layernorm(), _x()
    with pytest.warns(UserWarning, match=r"layer '1' \(LayerNorm\)"):
        lap = laplacian(model, x)
    torch.testing.assert_close(lap, _reference(model, x), rtol=1e-10, atol=1e-12)


def test_unsupported_layer_raises_with_unsupported_error_before_any_layer_runs():
    model, x = _with_layernorm(), _x()
    calls = []
    model[0].register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=r"layer '1' \(LayerNorm\).*method='autograd'"):
        laplacian(model, x, unsupported="error")
    assert not calls


def test_unsupported_operation_in_a_custom_module_is_named():
    class Cat(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2 * D_IN, 1)

        def forward(self, x):
            return self.lin(torch.cat([x, x**2], dim=-1))

    model = Cat().to(DT)
    with pytest.raises(ValueError, match="cat"):
        laplacian(model, _x(), unsupported="error")
    with pytest.warns(UserWarning):
        torch.testing.assert_close(laplacian(model, _x()), _reference(model, _x()))


def test_untraceable_custom_module_falls_back():
    class Branching(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D_IN, 1)

        def forward(self, x):
            if x.shape[-1] == D_IN:  # control flow on a traced value: torch.fx refuses it
                return torch.tanh(self.lin(x))
            return self.lin(x)

    model, x = Branching().to(DT), _x()
    with pytest.raises(ValueError, match="could not be traced"):
        laplacian(model, x, unsupported="error")
    with pytest.warns(UserWarning, match="could not be traced"):
        torch.testing.assert_close(laplacian(model, x), _reference(model, x))


def test_register_activation_teaches_the_forward_laplacian_a_new_module():
    class Sine(nn.Module):
        def forward(self, x):
            return torch.sin(x)

    class Cube(nn.Module):  # with a factory rule that reads module attributes
        def __init__(self, a):
            super().__init__()
            self.a = a

        def forward(self, x):
            return self.a * x**3

    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(D_IN, 6), Sine(), nn.Linear(6, 6), Cube(0.3), nn.Linear(6, 1))
    model, x = model.to(DT), _x()
    try:
        used = []

        def d2sin(z):
            used.append("sine")
            return -torch.sin(z)

        def cube(m):
            def derivatives(z):
                used.append("cube")
                return m.a * z**3, 3 * m.a * z**2, 6 * m.a * z

            return derivatives

        register_activation(Sine, (torch.sin, torch.cos, d2sin))
        register_activation(Cube, cube)
        lap = laplacian(model, x, unsupported="error")
        assert used == ["sine", "cube"]  # the registered rules, not tracing
        torch.testing.assert_close(lap, _reference(model, x), rtol=1e-10, atol=1e-12)
    finally:
        ACTIVATIONS.pop(Sine, None)
        ACTIVATIONS.pop(Cube, None)


def test_registered_rule_may_return_numbers():
    class Square(nn.Module):
        def forward(self, x):
            return x * x

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(D_IN, 6), Square(), nn.Linear(6, 1)).to(DT)
    x = _x()
    try:
        register_activation(Square, (lambda z: z * z, lambda z: 2 * z, lambda z: 2.0))
        lap = laplacian(model, x, unsupported="error")
    finally:
        ACTIVATIONS.pop(Square, None)
    torch.testing.assert_close(lap, _reference(model, x), rtol=1e-10, atol=1e-12)


def test_register_activation_rejects_bad_rules():
    with pytest.raises(ValueError, match="module_type"):
        register_activation(int, (torch.sin, torch.cos, torch.sin))
    with pytest.raises(ValueError, match="three callables"):
        register_activation(nn.Module, (torch.sin, torch.cos))
    with pytest.raises(ValueError, match="rule must be"):
        register_activation(nn.Module, 3)


# -- the slots context for the capture engine ------------------------------------------------
def test_linear_modules_are_called_on_the_stacked_state_with_the_slots_context():
    model, x = _mlp("tanh", 1), _x()
    seen = []

    def hook(module, inputs, output):
        seen.append((current_slots(), tuple(inputs[0].shape), tuple(output.shape)))

    handles = [m.register_forward_hook(hook) for m in model if isinstance(m, nn.Linear)]
    try:
        laplacian(model, x)
    finally:
        for h in handles:
            h.remove()
    slots = D_IN + 2
    assert seen == [
        (slots, (N, slots, D_IN), (N, slots, 8)),
        (slots, (N, slots, 8), (N, slots, 8)),
        (slots, (N, slots, 8), (N, slots, 1)),
    ]
    assert current_slots() is None and FORWARD_LAPLACIAN_SLOTS.get() is None
    model(x)  # an ordinary call outside the forward Laplacian
    assert current_slots() is None


def test_the_slots_context_is_reset_when_a_layer_raises():
    model, x = _mlp("tanh", 1), _x()

    def boom(module, inputs):
        raise RuntimeError("boom")

    model[2].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        laplacian(model, x)
    assert current_slots() is None


def test_the_slots_context_is_the_engines_shared_slots():
    assert FORWARD_LAPLACIAN_SLOTS is SHARED_SLOTS and current_slots is current_shared_slots
    seen = []
    layer = nn.Linear(3, 2)
    layer.register_forward_hook(lambda m, i, o: seen.append(current_shared_slots()))
    with shared_slots(4):
        layer(torch.randn(2, 4, 3))
        with shared_slots(6):  # nests: the innermost holds
            layer(torch.randn(2, 6, 3))
        layer(torch.randn(2, 4, 3))
    layer(torch.randn(2, 3))
    assert seen == [4, 6, 4, None]
    with pytest.raises(RuntimeError, match="boom"), shared_slots(5):
        raise RuntimeError("boom")
    assert current_shared_slots() is None
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="n must be a positive integer"), shared_slots(bad):
            pass


def test_value_slot_of_the_forward_laplacian_is_the_model_output():
    model, x = _mlp("gelu", 3), _x()
    outputs = []
    model[-1].register_forward_hook(lambda m, i, o: outputs.append(o))
    laplacian(model, x)
    torch.testing.assert_close(outputs[0][:, 0], model(x))


# -- bad arguments -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"method": "exact"}, r"method='exact'.*'forward', 'autograd', 'hutchinson'"),
        ({"unsupported": "functorch"}, r"unsupported='functorch'.*'autograd', 'error'"),
        ({"unsupported": "warn"}, r"unsupported='warn'.*'autograd', 'error'"),
        ({"method": "hutchinson"}, "num_samples"),
        ({"method": "hutchinson", "num_samples": 0}, "num_samples"),
        ({"method": "hutchinson", "num_samples": 1.5}, "num_samples"),
        ({"method": "forward", "num_samples": 3}, "only used by method='hutchinson'"),
        ({"method": "hutchinson", "num_samples": 2, "generator": 0}, "generator"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        laplacian(_mlp("tanh", 1), _x(), **kwargs)


def test_method_and_unsupported_accept_the_enum_members():
    model, x = _mlp("tanh", 1), _x()
    for method in LaplacianMethod:
        kwargs = {"num_samples": 3} if method is LaplacianMethod.HUTCHINSON else {}
        torch.manual_seed(0)
        a = laplacian(model, x, method=method, unsupported=Unsupported.ERROR, **kwargs)
        torch.manual_seed(0)
        b = laplacian(model, x, method=method.value, unsupported="error", **kwargs)
        torch.testing.assert_close(a, b)


def test_fallback_is_a_deprecated_alias_of_unsupported():
    model, x = _with_layernorm(), _x()
    with pytest.warns(DeprecationWarning, match="use unsupported='error'"):
        with pytest.raises(ValueError, match=r"layer '1' \(LayerNorm\)"):
            laplacian(model, x, fallback="error")
    with pytest.warns(DeprecationWarning, match="fallback is deprecated"):
        with pytest.warns(UserWarning, match="LayerNorm"):
            res = forward_laplacian(model, x, fallback="autograd")
    torch.testing.assert_close(res.laplacian, _reference(model, x), rtol=1e-10, atol=1e-12)
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match=r"fallback='functorch'.*'autograd', 'error'"):
            laplacian(model, x, fallback="functorch")
    with pytest.warns(DeprecationWarning):
        with pytest.raises(ValueError, match="give only unsupported"):
            laplacian(model, x, unsupported="error", fallback="autograd")


@pytest.mark.parametrize(
    "x", [torch.randn(N, 2, D_IN), torch.randn(D_IN), torch.ones(N, D_IN, dtype=torch.long)]
)
def test_bad_input_shape_or_dtype_raises_value_error(x):
    with pytest.raises(ValueError, match=r"x must be a floating-point tensor \[N, d\]"):
        laplacian(_mlp("tanh", 1), x)
