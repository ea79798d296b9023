"""``DiagonalNaturalGradient``: its step against the offline ``curvature.diag_ggn``.

The update direction is ``g / (d + lambda)`` with ``d`` the running Fisher diagonal
(module docstring of ``curvature/optim/diagonal.py``); on the first step ``d`` is the
batch's diagonal, later the exponential moving average with ``factor_decay``. The
``torch.optim`` contract of the optimizer is in ``test_optim_contract.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import curvature

DNG = curvature.DiagonalNaturalGradient


@pytest.fixture(autouse=True)
def _float64_one_thread(float64_seeded):
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def batch(seed, N=10):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def offline_diagonal(model, loss_func, data, fisher):
    d = curvature.diag_ggn(copy.deepcopy(model), loss_func, data, fisher=fisher)
    return flat([d[n] for n, _ in model.named_parameters()])


def step(opt, model, loss_func, data):
    """One step; the gradient and the update, flat."""
    before = flat([p.detach().clone() for p in model.parameters()])
    opt.zero_grad()
    loss_func(model(data[0]), data[1]).backward()
    grad = flat([p.grad for p in model.parameters()])
    opt.step()
    return grad, flat([p.detach() for p in model.parameters()]) - before


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_first_step_divides_by_the_offline_diagonal(fisher, reduction):
    model, loss_func = mlp(), nn.CrossEntropyLoss(reduction=reduction)
    data = batch(1)
    diag = offline_diagonal(model, loss_func, data, fisher)
    lr, damping = 0.3, 1e-2
    opt = DNG(model, lr=lr, damping=damping, fisher=fisher, loss_func=loss_func)
    grad, delta = step(opt, model, loss_func, data)
    torch.testing.assert_close(delta, -lr * grad / (diag + damping), atol=1e-12, rtol=1e-10)
    assert set(opt.diagonal_) == {"0", "2"}


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_the_diagonal_is_an_exponential_moving_average(fisher):
    """Two steps with lr = 0 (the model stays), then one with lr = 1: its direction
    divides by ``beta (beta d1 + (1 - beta) d2) + (1 - beta) d3``."""
    model, loss_func = mlp(), nn.CrossEntropyLoss()
    data = [batch(s) for s in (1, 2, 3)]
    d1, d2, d3 = (offline_diagonal(model, loss_func, b, fisher) for b in data)
    beta, damping = 0.7, 1e-2
    opt = DNG(model, lr=0.0, damping=damping, fisher=fisher, loss_func=loss_func, factor_decay=beta)
    step(opt, model, loss_func, data[0])
    step(opt, model, loss_func, data[1])
    opt.param_groups[0]["lr"] = 1.0
    grad, delta = step(opt, model, loss_func, data[2])
    running = beta * (beta * d1 + (1 - beta) * d2) + (1 - beta) * d3
    torch.testing.assert_close(delta, -grad / (running + damping), atol=1e-12, rtol=1e-10)


def test_forward_only_is_refused():
    with pytest.raises(ValueError, match="forward-only.*no diagonal"):
        DNG(mlp(), fisher="forward-only")


def odd_mlp():
    """No bias on the first layer, a frozen weight (bias only) on the last."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Tanh(), nn.Linear(6, 5), nn.Tanh())
    model.append(nn.Linear(5, 3))
    model[4].weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("groups", [False, True], ids=["one-damping", "per-group-damping"])
@pytest.mark.parametrize("make", [mlp, odd_mlp])
def test_running_diagonal_over_ragged_batches_and_damping_groups(make, groups):
    """Batches of 10, 7 (a ragged one: the squared inputs are made again) and 10 samples,
    lr = 0 then 1; a damping per parameter group or one: the direction divides by the
    running average of the offline diagonals plus each parameter's damping."""
    model, loss_func = make(), nn.CrossEntropyLoss()
    data = [batch(1), batch(2, N=7), batch(3)]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    d1, d2, d3 = (
        flat(
            [
                curvature.diag_ggn(copy.deepcopy(model), loss_func, b, fisher="empirical")[n]
                for n in names
            ]
        )
        for b in data
    )
    beta = 0.7
    params = [p for p in model.parameters() if p.requires_grad]
    if groups:
        param_groups = [{"params": params[:2], "damping": 1e-2}, {"params": params[2:]}]
        damping = flat([torch.full_like(p, 1e-2 if i < 2 else 3e-2) for i, p in enumerate(params)])
    else:
        param_groups, damping = None, 3e-2
    opt = DNG(
        model,
        lr=0.0,
        damping=3e-2,
        loss_func=loss_func,
        factor_decay=beta,
        param_groups=param_groups,
    )
    for X, y in data[:2]:
        opt.zero_grad()
        loss_func(model(X), y).backward()
        opt.step()
    for g in opt.param_groups:
        g["lr"] = 1.0
    before = flat([p.detach().clone() for p in params])
    opt.zero_grad()
    loss_func(model(data[2][0]), data[2][1]).backward()
    grad = flat([p.grad for p in params])
    opt.step()
    delta = flat([p.detach() for p in params]) - before
    running = beta * (beta * d1 + (1 - beta) * d2) + (1 - beta) * d3
    torch.testing.assert_close(delta, -grad / (running + damping), atol=1e-12, rtol=1e-10)


def test_a_layer_without_finite_statistics_yet_keeps_its_gradient():
    """Step 0: the gradient at the first layer's output is made NaN (its statistics are
    skipped, its parameters not updated); step 1 collects no statistics
    (``factor_every=2``): the first layer, still without finite statistics, gets the
    plain gradient, the last one ``g / (d + lambda)`` with step 0's diagonal."""
    model, loss_func = mlp(), nn.CrossEntropyLoss()
    data = [batch(1), batch(2)]
    lr, damping = 0.1, 1e-2
    last = offline_diagonal(model, loss_func, data[0], "empirical")
    opt = DNG(model, lr=lr, damping=damping, loss_func=loss_func, factor_every=2)

    def nan_gradient(module, inputs, out):
        out.register_hook(lambda g: g * float("nan"))

    hook = model[0].register_forward_hook(nan_gradient)
    step(opt, model, loss_func, data[0])
    hook.remove()
    grad, delta = step(opt, model, loss_func, data[1])
    assert opt.skipped_statistics == 1
    n0 = sum(p.numel() for p in model[0].parameters())
    torch.testing.assert_close(delta[:n0], -lr * grad[:n0], atol=1e-14, rtol=1e-12)
    expected = -lr * grad[n0:] / (last[n0:] + damping)
    torch.testing.assert_close(delta[n0:], expected, atol=1e-12, rtol=1e-10)


class Scale(nn.Module):
    """A learnable scalar factor (a block of its own, from its per-sample gradients)."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.s * x


@pytest.mark.parametrize("groups", [False, True], ids=["one-damping", "per-group-damping"])
def test_blocks_of_several_rules_divide_in_the_parameters_layout(groups):
    """Linear blocks (laid out ``[W | b]``) and a scalar's block between them: every
    parameter divides by its offline diagonal plus its group's damping."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), Scale(), nn.Linear(6, 3))
    loss_func, data = nn.CrossEntropyLoss(), batch(1)
    names = ["0.weight", "0.bias", "2.s", "3.weight", "3.bias"]
    d = curvature.diag_ggn(copy.deepcopy(model), loss_func, data, fisher="empirical")
    params = dict(model.named_parameters())
    lr, dampings = 0.2, {n: 1e-2 for n in names}
    param_groups = None
    if groups:
        dampings.update({"3.weight": 3e-2, "3.bias": 3e-2})
        param_groups = [
            {"params": [params[n] for n in ("0.weight", "0.bias", "2.s")]},
            {"params": [params["3.weight"], params["3.bias"]], "damping": 3e-2},
        ]
    opt = DNG(model, lr=lr, damping=1e-2, loss_func=loss_func, param_groups=param_groups)
    before = {n: p.detach().clone() for n, p in params.items()}
    loss_func(model(data[0]), data[1]).backward()
    grads = {n: p.grad.clone() for n, p in params.items()}
    opt.step()
    for n, p in params.items():
        expected = before[n] - lr * grads[n] / (d[n] + dampings[n])
        torch.testing.assert_close(p.detach(), expected, atol=1e-12, rtol=1e-10)
