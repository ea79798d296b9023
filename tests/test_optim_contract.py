"""The ``torch.optim`` contract of every curvature optimizer, for every Fisher type it accepts.

Expanded from the table in ``optimizer_info.py`` (optimizer x Fisher type x property):
param groups (per-group ``lr``, ``damping``, ``momentum``, ``weight_decay``;
``add_param_group``), LR schedulers, ``step(closure)``, the ``state_dict`` round trip, a
bit-for-bit resume, ``zero_grad`` both ways and gradient accumulation (where the
documentation promises it exactly). Public API only. Each property is compared with an
independently run trajectory, and each comparison comes with a check that it is not
vacuous (the thing compared does change the result).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from cases import torch_state
from optimizer_info import (
    ALL_FISHERS,
    FISHERS,
    OPTIMIZERS,
    layer_groups,
    optimizer_params,
    variants,
)
from torch import nn

VARIANTS = variants()

# the ordinary training loop warns about nothing
pytestmark = pytest.mark.filterwarnings("error")


@pytest.fixture(autouse=True)
def _one_thread_seeded():
    with torch_state():
        yield


# -- helpers ---------------------------------------------------------------------------------------
def params(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def train(info, opt, model, steps, start=0, dtype=torch.float32):
    """``steps`` ordinary steps on the batches ``start, start + 1, ...``; the last loss."""
    loss_func = info.make_loss()
    loss = None
    for s in range(start, start + steps):
        X, y = info.make_batch(s, dtype=dtype)
        opt.zero_grad()
        loss = loss_func(model(X), y)
        loss.backward()
        opt.step()
    return loss


def groups_of(model, *settings):
    """``param_groups`` of the two layers with the given per-group settings."""
    return [{"params": ps, **s} for ps, s in zip(layer_groups(model), settings)]


def assert_state_equal(a, b, where="state_dict"):
    """Recursive equality of two state dicts: tensors bit for bit, the rest by ``==``."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_state_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_state_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def state_equal(a, b) -> bool:
    try:
        assert_state_equal(a, b)
    except AssertionError:
        return False
    return True


def saved(obj):
    """``obj`` through ``torch.save`` / ``torch.load`` (this torch's ``weights_only`` default)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


# -- the table itself ------------------------------------------------------------------------------
@pytest.mark.parametrize("info", optimizer_params())
def test_the_table_states_every_fisher_type(info):
    """Each Fisher type is accepted (and needs ``loss_func`` where the table says so) or
    refused with the error the table gives."""
    assert set(info.fishers) | set(info.refused_fishers) == set(ALL_FISHERS)
    for fisher, match in info.refused_fishers.items():
        with pytest.raises(ValueError, match=match):
            info.build(info.make_model(), fisher, loss_func=info.make_loss())
    for fisher in info.fishers:
        if FISHERS[fisher].needs_loss_func:
            with pytest.raises(ValueError, match=rf"fisher='{fisher}'.*loss_func"):
                info.cls(info.make_model(), fisher=fisher)
        info.build(info.make_model(), fisher).close()


def test_the_table_has_every_optimizer():
    import curvature

    public = {
        getattr(curvature, n)
        for n in curvature.__all__
        if isinstance(getattr(curvature, n), type)
        and issubclass(getattr(curvature, n), torch.optim.Optimizer)
    }
    public.discard(curvature.optim.CurvatureOptimizer)
    assert {i.cls for i in OPTIMIZERS} == public


# -- param groups ----------------------------------------------------------------------------------
@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_param_group_with_zero_lr_leaves_its_params_unchanged(info, fisher):
    model = info.make_model()
    groups = groups_of(model, dict(lr=0.0, momentum=0.9, weight_decay=0.1), {})
    opt = info.build(model, fisher, param_groups=groups)
    before = params(model)
    train(info, opt, model, 3)
    after = params(model)
    assert same(after[:2], before[:2])  # the first layer: lr = 0
    assert not torch.equal(after[2], before[2]) and not torch.equal(after[3], before[3])


class TwoHeads(nn.Module):
    """Two independent layers side by side, ``[N, 4] -> [N, 3 + 2]``: with a loss that is a
    sum over output coordinates (MSE), each layer's gradient and curvature depend on its
    own parameters only, so each layer's trajectory is that of its own settings."""

    def __init__(self, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.a, self.b = nn.Linear(4, 3), nn.Linear(4, 2)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) / 2)

    def forward(self, x):
        return torch.cat([self.a(x), self.b(torch.tanh(x))], 1)


def train_two_heads(opt, model, steps):
    mse = nn.MSELoss()
    for s in range(steps):
        gen = torch.Generator().manual_seed(s)
        X, Y = torch.randn(8, 4, generator=gen), torch.randn(8, 5, generator=gen)
        opt.zero_grad()
        mse(model(X), Y).backward()
        opt.step()


@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_per_group_lr_damping_momentum_weight_decay_are_honoured(info, fisher):
    """The preconditioners are block-diagonal per layer: on two independent layers, one
    group each, each layer moves as in a one-group run with its group's settings."""
    settings = [
        dict(lr=0.05, damping=1e-1, momentum=0.5, weight_decay=1e-2),
        dict(lr=0.2, damping=1e-3, momentum=0.0, weight_decay=0.0),
    ]
    kw = {"loss_func": nn.MSELoss()} if FISHERS[fisher].needs_loss_func else {}
    model = TwoHeads()
    groups = [{"params": list(m.parameters()), **s} for m, s in zip((model.a, model.b), settings)]
    opt = info.build(model, fisher, param_groups=groups, **kw)
    assert [{k: g[k] for k in settings[0]} for g in opt.param_groups] == settings
    train_two_heads(opt, model, 3)
    grouped = params(model)
    alone = []
    for s in settings:
        ref = TwoHeads()
        train_two_heads(info.build(ref, fisher, **s, **kw), ref, 3)
        alone.append(params(ref))
    assert same(grouped, alone[0][:2] + alone[1][2:])
    # not vacuous: the two settings give each layer another trajectory
    for i in range(4):
        assert not torch.allclose(alone[0][i], alone[1][i], atol=1e-4)


@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_add_param_group_of_model_params(info, fisher):
    first, second = dict(lr=0.1), dict(lr=0.2, damping=1e-3, momentum=0.5)
    model = info.make_model()
    opt = info.build(model, fisher, param_groups=groups_of(model, first))
    opt.add_param_group({"params": layer_groups(model)[1], **second})
    assert len(opt.param_groups) == 2
    g = opt.param_groups[1]
    assert (g["lr"], g["damping"], g["momentum"]) == (0.2, 1e-3, 0.5)
    assert g["weight_decay"] == opt.defaults["weight_decay"]  # filled in from the defaults
    before = params(model)
    train(info, opt, model, 3)
    ref = info.make_model()
    train(info, info.build(ref, fisher, param_groups=groups_of(ref, first, second)), ref, 3)
    assert same(params(model), params(ref))
    assert not same(params(model)[2:], before[2:])  # the added group moves


# -- LR schedulers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_step_lr_drives_the_step_size(info, fisher):
    model = info.make_model()
    opt = info.build(model, fisher, lr=0.4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen = []
    for s in range(4):
        seen.append(opt.param_groups[0]["lr"])
        train(info, opt, model, 1, start=s)
        sched.step()
    assert seen == pytest.approx([0.4, 0.2, 0.1, 0.05])
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)
    manual, constant = info.make_model(), info.make_model()
    opt_m, opt_c = info.build(manual, fisher, lr=0.4), info.build(constant, fisher, lr=0.4)
    for s in range(4):
        opt_m.param_groups[0]["lr"] = seen[s]
        train(info, opt_m, manual, 1, start=s)
        train(info, opt_c, constant, 1, start=s)
    assert same(params(model), params(manual))  # the step uses the scheduled lr
    assert not same(params(model), params(constant))


@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_lambda_lr_per_group(info, fisher):
    """LambdaLR with one factor per group: the first group's lr drops to 0 after one step
    (its layer stops), the second's decays as ``1 / (1 + epoch)``."""
    model = info.make_model()
    opt = info.build(model, fisher, lr=0.2, param_groups=groups_of(model, {}, {}))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, [lambda e: 1.0 if e == 0 else 0.0, lambda e: 1.0 / (1 + e)]
    )
    train(info, opt, model, 1)
    sched.step()
    after_one = params(model)
    for s in range(1, 3):
        train(info, opt, model, 1, start=s)
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.0, 0.2 / 4])
    now = params(model)
    assert same(now[:2], after_one[:2])
    assert not torch.equal(now[2], after_one[2])


# -- closure ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_step_with_closure_returns_its_loss_and_takes_the_plain_step(info, fisher):
    loss_func = info.make_loss()
    model = info.make_model()
    opt = info.build(model, fisher)
    returned = []
    for s in range(3):
        X, y = info.make_batch(s)

        def closure(X=X, y=y):
            opt.zero_grad()
            loss = loss_func(model(X), y)
            loss.backward()
            returned.append(loss)
            return loss

        before = params(model)
        out = opt.step(closure)
        assert out is returned[-1]
        assert not same(params(model), before)
    ref = info.make_model()
    last = train(info, info.build(ref, fisher), ref, 3)
    assert same(params(model), params(ref))
    assert torch.equal(returned[-1].detach(), last.detach())
    assert opt.step() is None  # without a closure, as in torch.optim


# -- state_dict ------------------------------------------------------------------------------------
@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_state_dict_round_trip(info, fisher):
    """Loaded into a fresh optimizer on a copy of the model (through torch.save and
    torch.load), the state comes back unchanged."""
    model = info.make_model()
    opt = info.build(model, fisher, momentum=0.5, weight_decay=1e-3)
    train(info, opt, model, 3)
    sd = opt.state_dict()
    twin = copy.deepcopy(model)
    fresh = info.build(twin, fisher, momentum=0.5, weight_decay=1e-3)
    assert not state_equal(fresh.state_dict(), sd)  # not vacuous
    fresh.load_state_dict(saved(sd))
    assert_state_equal(fresh.state_dict(), sd)
    assert_state_equal(opt.state_dict(), sd)  # state_dict() changes nothing
    # the loaded optimizer and the original take the same next step
    train(info, opt, model, 1, start=3)
    train(info, fresh, twin, 1, start=3)
    assert same(params(model), params(twin))


RESUME = dict(momentum=0.5, weight_decay=1e-3, factor_every=2, inverse_every=3, seed=7)


@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_resume_continues_bit_for_bit(info, fisher):
    """Train k steps, save model and optimizer, go on for n steps; a fresh model and
    optimizer (other initial values) loaded from the saved state take the same n steps
    to bit-identical parameters and state. The split is inside a statistics period and a
    refresh period; MC labels and Rademacher signs continue from the saved generator."""
    k, n = 3, 4
    model = info.make_model()
    opt = info.build(model, fisher, **RESUME)
    train(info, opt, model, k)
    checkpoint = saved({"model": model.state_dict(), "optim": opt.state_dict()})
    train(info, opt, model, n, start=k)
    straight, straight_state = params(model), opt.state_dict()

    resumed = info.make_model(seed=123)
    opt2 = info.build(resumed, fisher, **RESUME)
    resumed.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optim"])
    train(info, opt2, resumed, n, start=k)
    assert same(params(resumed), straight)
    assert_state_equal(opt2.state_dict(), straight_state)

    # not vacuous: the model state alone (a fresh optimizer) gives another trajectory
    alone = info.make_model(seed=123)
    alone.load_state_dict(checkpoint["model"])
    train(info, info.build(alone, fisher, **RESUME), alone, n, start=k)
    assert not same(params(alone), straight)


# -- zero_grad -------------------------------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zeros"])
@pytest.mark.parametrize("info,fisher", VARIANTS)
def test_zero_grad(info, fisher, set_to_none):
    """``zero_grad(set_to_none=...)`` as in torch.optim; a step on no (or zero)
    gradients moves nothing; training goes on afterwards as if that step had not been."""
    model = info.make_model()
    opt = info.build(model, fisher)
    train(info, opt, model, 2)
    assert all(p.grad is not None for p in model.parameters())
    opt.zero_grad(set_to_none=set_to_none)
    if set_to_none:
        assert all(p.grad is None for p in model.parameters())
    else:
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    before = params(model)
    opt.step()
    assert same(params(model), before)
    # accumulation starts from zero again: the next step is the one of a fresh gradient
    X, y = info.make_batch(2)
    info.make_loss()(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    twin = copy.deepcopy(model)
    twin.zero_grad(set_to_none=True)
    info.make_loss()(twin(X), y).backward()
    assert same(grads, [p.grad for p in twin.parameters()])
    opt.step()
    assert not same(params(model), before)
    opt.zero_grad()  # torch's default: set_to_none=True
    assert all(p.grad is None for p in model.parameters())


# -- gradient accumulation -------------------------------------------------------------------------
@pytest.mark.parametrize("info,fisher", variants(lambda i, f: f.accumulation_exact))
def test_gradient_accumulation_equals_the_full_batch_step(info, fisher):
    """Two half batches with ``loss / 2`` each, then ``step()``: the full-batch step (the
    documented promise for deterministic statistics: the forwards between two steps are
    one batch, their union). float64, two steps (the second preconditions with the
    statistics of the first)."""
    dtype = torch.float64
    loss_func = info.make_loss()
    accumulated = info.make_model(dtype=dtype)
    full = info.make_model(dtype=dtype)
    opt_a = info.build(accumulated, fisher)
    opt_f = info.build(full, fisher)
    for s in range(2):
        X, y = info.make_batch(s, N=8, dtype=dtype)
        opt_a.zero_grad()
        for half in (slice(0, 4), slice(4, 8)):
            (loss_func(accumulated(X[half]), y[half]) / 2).backward()
        opt_a.step()
        train(info, opt_f, full, 1, start=s, dtype=dtype)
        for p, q in zip(accumulated.parameters(), full.parameters()):
            torch.testing.assert_close(p, q, atol=1e-12, rtol=1e-10)
    # not vacuous: one half batch alone gives another step
    half = info.make_model(dtype=dtype)
    opt_h = info.build(half, fisher)
    for s in range(2):
        X, y = info.make_batch(s, N=8, dtype=dtype)
        opt_h.zero_grad()
        loss_func(half(X[:4]), y[:4]).backward()
        opt_h.step()
    assert not torch.allclose(params(half)[0], params(full)[0], atol=1e-6)
