"""The forward Laplacian's fused activation rule against the unfused one (its brute-force
twin: the same formula differentiated by autograd op by op), values and derivatives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvature.laplacian import forward_laplacian, laplacian, register_activation
from curvature.laplacian.activations import (
    ACTIVATIONS,
    FUNCTIONAL,
    activation_rule,
    parameter_free,
    power_rule,
    rule_chain,
)
from curvature.laplacian.forward import elementwise, elementwise_reference

DT = torch.float64

MODULES = {
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "relu": nn.ReLU,  # s'' = None
    "leaky_relu": lambda: nn.LeakyReLU(0.1),
    "elu": lambda: nn.ELU(0.7),
    "gelu": nn.GELU,
    "gelu_tanh": lambda: nn.GELU(approximate="tanh"),
    "silu": nn.SiLU,
    "softplus": lambda: nn.Softplus(beta=2.0, threshold=0.5),
}


def _state(seed: int, d: int = 3, shape=(4, 6)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape[0], d + 2, *shape[1:], dtype=DT, generator=g)


#: rules of functional activations (a traced forward) and of ``z ** p``
FUNCTIONS = {
    "sin": lambda: FUNCTIONAL[torch.sin](),
    "cos": lambda: FUNCTIONAL[torch.cos](),
    "exp": lambda: FUNCTIONAL[torch.exp](),
    "cube": lambda: power_rule(3.0),
}


def _rule(name):
    if name in FUNCTIONS:
        return FUNCTIONS[name]()
    module = MODULES[name]()
    return activation_rule(module)(module)


@pytest.mark.parametrize("name", sorted(MODULES) + sorted(FUNCTIONS))
@pytest.mark.parametrize("shape", [(4, 6), (3, 2, 5)])
def test_fused_rule_matches_the_unfused_one(name, shape):
    rule = _rule(name)
    assert parameter_free(rule)
    if name in ("tanh", "sigmoid", "sin", "cos", "exp"):  # the backward without autograd
        assert rule_chain(rule) is not None
    state = _state(0, shape=shape)
    with torch.no_grad():  # the graph-free path writes into one output
        torch.testing.assert_close(elementwise(rule, state), elementwise_reference(rule, state))
    s1 = state.clone().requires_grad_(True)
    s2 = state.clone().requires_grad_(True)
    out1, out2 = elementwise(rule, s1), elementwise_reference(rule, s2)
    torch.testing.assert_close(out1, out2)
    assert out1.grad_fn is not None and type(out1.grad_fn).__name__ != "CatBackward0"
    cot = torch.randn_like(out1)
    (g1,) = torch.autograd.grad(out1, s1, cot, create_graph=True)
    (g2,) = torch.autograd.grad(out2, s2, cot, create_graph=True)
    torch.testing.assert_close(g1, g2)
    # a double backward differentiates the unfused formula: the same second derivatives
    v = torch.randn_like(g1)
    (h1,) = torch.autograd.grad(g1, s1, v, allow_unused=True)
    (h2,) = torch.autograd.grad(g2, s2, v, allow_unused=True)
    if h2 is None:  # (piecewise-linear rules)
        assert h1 is None or not h1.any()
    else:
        torch.testing.assert_close(h1, h2)


def test_fused_rule_with_coefficients_matches_the_unfused_one():
    """The coefficients are read at the forward and kept for the backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    model = model.to(DT)
    x = torch.rand(7, 3, dtype=DT, requires_grad=True)
    c = torch.tensor([0.5, -1.0, 2.0], dtype=DT)
    out = forward_laplacian(model, x, coefficients=c)
    loss = (out.laplacian**2).sum() + (out.jacobian**3).sum()
    grads = torch.autograd.grad(loss, [x, *model.parameters()])
    # brute force: every output Hessian of the model by torch.func
    xs = x.detach()
    H = torch.vmap(torch.func.hessian(lambda xi: model(xi[None]).reshape(())))(xs)
    J = torch.vmap(torch.func.grad(lambda xi: model(xi[None]).reshape(())))(xs)
    torch.testing.assert_close(out.laplacian, (H.diagonal(dim1=1, dim2=2) * c).sum(-1))
    torch.testing.assert_close(out.jacobian, J)

    # the same loss through the unfused rule (a parameter-free rule registered by the user
    # is not marked, so it takes the unfused path)
    class MyTanh(nn.Tanh):
        pass

    register_activation(MyTanh, (torch.tanh, lambda z: 1 - torch.tanh(z) ** 2, _tanh2))
    try:
        twin = nn.Sequential(*[MyTanh() if isinstance(m, nn.Tanh) else m for m in model])
        out2 = forward_laplacian(twin, x, coefficients=c)
        loss2 = (out2.laplacian**2).sum() + (out2.jacobian**3).sum()
        grads2 = torch.autograd.grad(loss2, [x, *model.parameters()])
    finally:
        del ACTIVATIONS[MyTanh]
    for a, b in zip(grads, grads2):
        torch.testing.assert_close(a, b)


def _tanh2(z):
    t = torch.tanh(z)
    return -2 * t * (1 - t * t)


def test_user_rule_with_a_parameter_gets_its_gradient():
    """A registered rule may read the module's parameters: it is not fused, and the
    gradient reaches the parameter (the fused function would drop it)."""

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.tensor(1.3, dtype=DT))

        def forward(self, z):
            return torch.sin(self.a * z)

    def rule(m):
        def derivatives(z):
            s, c = torch.sin(m.a * z), torch.cos(m.a * z)
            return s, m.a * c, -(m.a**2) * s

        return derivatives

    register_activation(Scaled, rule)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 5), Scaled(), nn.Linear(5, 1)).to(DT)
        assert not parameter_free(rule(model[1]))
        x = torch.rand(4, 2, dtype=DT)
        lap = laplacian(model, x, method="forward")
        (ga,) = torch.autograd.grad(lap.sum(), model[1].a)
        H = lambda a: torch.vmap(  # noqa: E731
            torch.func.hessian(
                lambda xi: torch.func.functional_call(model, {"1.a": a}, (xi[None],)).reshape(())
            )
        )(x)
        expected = torch.func.grad(lambda a: H(a).diagonal(dim1=1, dim2=2).sum())(
            model[1].a.detach()
        )
        torch.testing.assert_close(ga, expected)
    finally:
        del ACTIVATIONS[Scaled]
