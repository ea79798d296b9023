"""The optimizers under ``torch.amp.GradScaler``: the ordinary AMP loop is right whether
or not the scaler is passed as ``grad_scaler=`` (``curvature.optim.amp``).

``scaler.step(optim)`` hands the loss scale and its inf check to ``step()`` (the
optimizers set ``_step_supports_amp_scaling``); the step unscales the gradients and the
empirical statistics, skips a step with inf gradients as the scaler would, and reads the
device once per step (the scaler's own inf check, moved into ``step()``). Power-of-two
scales and a float64 model: the unscaled numbers are exact, so the AMP runs equal the
plain runs to rounding.
"""

from __future__ import annotations

import copy
import pathlib
import sys
import warnings

import pytest
import torch
from torch import nn

import curvature

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from step_counts import HostReads  # noqa: E402

CE = nn.CrossEntropyLoss()
OPTIMIZERS = [curvature.KFAC, curvature.EKFAC, curvature.DiagonalNaturalGradient]

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def scaler(scale=2.0**16):
    try:
        s = torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=2)
    except (AttributeError, TypeError, RuntimeError) as err:  # pragma: no cover
        pytest.skip(f"no CPU GradScaler in this torch: {err}")
    if not s.is_enabled():  # pragma: no cover
        pytest.skip("the CPU GradScaler is disabled in this torch")
    return s


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def batch(i, N=16):
    g = torch.Generator().manual_seed(i)
    return torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(
        0, 4, (N,), generator=g
    )


def run(cls, amp, steps=4, micro=2, poison=(), clip=False, pass_scaler=False, **kw):
    """``steps`` steps of ``micro`` micro-batches each; ``amp``: the GradScaler loop."""
    model = mlp()
    sc = scaler() if amp else None
    opt = cls(
        model,
        lr=0.1,
        damping=1e-2,
        loss_func=CE,
        inverse_every=2,
        grad_scaler=sc if pass_scaler else None,
        **kw,
    )
    for i in range(steps):
        opt.zero_grad()
        for j in range(micro):
            X, y = batch(micro * i + j)
            loss = CE(model(X), y) / micro
            (sc.scale(loss) if amp else loss).backward()
        if i in poison:
            model[0].weight.grad[0, 0] = float("inf")
        if amp:
            if clip:
                sc.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), 1e6)  # (changes nothing)
            sc.step(opt)
            sc.update()
        else:
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            opt.step()
    return model, opt


def assert_same_params(a, b):
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("pass_scaler", [False, True], ids=["not-given", "given"])
def test_the_amp_loop_steps_as_the_plain_loop(cls, fisher, pass_scaler):
    """Before, without ``grad_scaler=`` the empirical ``G`` carried ``s^2 = 2^32``: the
    weights moved by about 1e-9 per step."""
    plain, _ = run(cls, amp=False, fisher=fisher)
    scaled, opt = run(cls, amp=True, fisher=fisher, pass_scaler=pass_scaler)
    assert opt.steps == 4
    assert_same_params(scaled, plain)
    assert not all(torch.equal(p, q) for p, q in zip(scaled.parameters(), mlp().parameters()))


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("pass_scaler", [False, True], ids=["not-given", "given"])
def test_a_step_with_inf_gradients_is_skipped_and_its_statistics_dropped(cls, pass_scaler):
    """The scaler's promise: a step with inf gradients changes nothing, and the scale backs
    off; its statistics go with its gradients (the later steps equal a run without it)."""
    model, opt = run(cls, amp=True, steps=3, poison=(1,), pass_scaler=pass_scaler)
    assert opt.steps == 2
    assert opt.skipped_statistics == 0 and opt.skipped_updates == 0
    # the same run with the poisoned step's batches dropped: steps 0 and 2 only
    model0 = mlp()
    sc = scaler()
    ref = cls(model0, lr=0.1, damping=1e-2, loss_func=CE, inverse_every=2)
    for i in (0, 2):
        ref.zero_grad()
        for j in range(2):
            X, y = batch(2 * i + j)
            sc.scale(CE(model0(X), y) / 2).backward()
        sc.step(ref)
        sc.update()
    assert_same_params(model, model0)


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_unscale_before_step_needs_the_scaler_given(cls):
    """After ``scaler.unscale_(optim)`` (to clip) the scale is not handed to ``step()``:
    given as ``grad_scaler=``, the statistics are unscaled as they are folded (the plain
    loop's steps); not given, one warning says so."""
    plain, _ = run(cls, amp=False, clip=True)
    given, _ = run(cls, amp=True, clip=True, pass_scaler=True)
    assert_same_params(given, plain)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        run(cls, amp=True, clip=True)
    hits = [str(r.message) for r in rec if "grad_scaler=scaler" in str(r.message)]
    assert len(hits) == 1 and "scaler.unscale_(optimizer)" in hits[0], hits


def test_the_mc_fisher_needs_nothing_after_unscale():
    """The MC Fisher's statistics come from its own curvature backward: no warning."""
    plain, _ = run(curvature.KFAC, amp=False, clip=True, fisher="mc")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        scaled, _ = run(curvature.KFAC, amp=True, clip=True, fisher="mc")
    assert not [r for r in rec if "grad_scaler" in str(r.message)]
    assert_same_params(scaled, plain)


def test_the_quadratic_rule_under_a_scaler_not_given_is_refused():
    with pytest.raises(ValueError, match="update_rule='quadratic'.*needs grad_scaler=scaler"):
        run(curvature.KFAC, amp=True, update_rule="quadratic")


@pytest.mark.parametrize("pass_scaler", [False, True], ids=["not-given", "given"])
def test_a_scaled_step_reads_the_device_once(pass_scaler):
    """The scaler's inf check, read in ``step()`` instead of in ``scaler.step`` (as for any
    optimizer under a GradScaler); before, a scaler given as ``grad_scaler=`` added a read
    of its scale at every forward (2 per step)."""
    model = mlp()
    sc = scaler()
    opt = curvature.KFAC(
        model, loss_func=CE, inverse_every=1000, grad_scaler=sc if pass_scaler else None
    )
    counts = []
    for i in range(4):
        X, y = batch(i)
        with HostReads() as reads:
            opt.zero_grad()
            sc.scale(CE(model(X), y)).backward()
            sc.step(opt)
            sc.update()
        counts.append(reads.count)
    assert counts[1:] == [1, 1, 1], counts


def test_a_resumed_amp_run_continues_bit_for_bit():
    """``state_dict`` of the optimizer and of the scaler: the resumed run equals the
    unbroken one (nothing of the hand-off is kept between steps)."""
    model, opt = run(curvature.KFAC, amp=True, steps=2)
    twin = copy.deepcopy(model)
    opt2 = curvature.KFAC(twin, lr=0.1, damping=1e-2, loss_func=CE, inverse_every=2)
    opt2.load_state_dict(opt.state_dict())
    state = scaler().state_dict()
    for m, o in ((model, opt), (twin, opt2)):
        sc = scaler()
        sc.load_state_dict(state)
        for i in (8, 9):
            o.zero_grad()
            X, y = batch(i)
            sc.scale(CE(m(X), y)).backward()
            sc.step(o)
            sc.update()
    assert opt2.steps == opt.steps == 4
    assert_same_params(model, twin)


def _growing(cls, amp, steps=26, switch_at=None):
    """A float32 model; the scale doubles every step from 2^16 (to 2^41): float32
    gradients never overflow, so the scaler keeps growing (bf16 autocast under a
    scaler, or a scaler left on). ``switch_at``: the plain loop from that step on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=1)
    opt = cls(model, lr=0.1, damping=1e-2)
    for i in range(steps):
        X, y = batch(i)
        X = X.float()
        opt.zero_grad()
        loss = CE(model(X), y)
        if amp and (switch_at is None or i < switch_at):
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
        else:
            loss.backward()
            opt.step()
    return model, opt


@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_growing_scale_not_given_never_overflows_the_statistics(cls):
    """A scaler not given: each step's gradients are divided by the last step's scale as
    they are folded, and the step corrects by ``(last / own)^2`` (exact for powers of two).
    Before (found by an audit), once ``s^2 G`` passed float32's finiteness check (~1.8e19,
    at ``s = 2^35`` here) every statistic was dropped and the run took plain gradients."""
    plain, _ = _growing(cls, amp=False)
    scaled, opt = _growing(cls, amp=True)
    assert opt.skipped_statistics == 0
    for p, q in zip(scaled.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    switched, _ = _growing(cls, amp=True, switch_at=5)  # back to the plain loop
    for p, q in zip(switched.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
