"""``stale_clip``: between two refreshes a parameter's direction is scaled to at most
``stale_clip`` times its norm at the last refresh step (curvature.optim.stale_clip).

- exact: with the loss scaled up 10x after the refresh step, the update of every
  parameter is the unclipped optimizer's update times ``min(1, rho |d(r)| / |d|)``, and
  some parameter is clipped (the test exercises the clip); refresh steps are never scaled;
- without growth the clipped run equals the unclipped one bit for bit;
- ``state_dict`` carries the reference: a run resumed between two refreshes continues
  bit for bit (and would not without it); a state saved without it still loads;
- the arguments are checked; ``DiagonalNaturalGradient`` (no aging inverses) has none.

The residual CNN that the clip keeps from diverging at the defaults: tests/test_defaults.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from cases import torch_state
from torch import nn

import curvature


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_state(seed=None):
        yield


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(n: int = 32):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def step(opt, model, X, y, scale: float = 1.0) -> dict:
    """One training step with the loss times ``scale``; the parameters' changes."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    (scale * nn.CrossEntropyLoss()(model(X), y)).backward()
    opt.step()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC], ids=lambda c: c.__name__)
def test_a_grown_direction_is_scaled_to_the_ratio(cls):
    X, y = batch()
    a, b = mlp(), mlp()
    # (the MC Fisher: its statistics do not grow with the loss's scale, so EKFAC's fresh
    # eigenvalue corrections do not shrink the grown direction either)
    kw = dict(lr=0.1, inverse_every=10, fisher="mc", loss_func=nn.CrossEntropyLoss())
    clipped = cls(a, stale_clip=2.0, **kw)
    plain = cls(b, stale_clip=None, **kw)
    first_a, first_b = step(clipped, a, X, y), step(plain, b, X, y)
    for n in first_a:  # the refresh step is never scaled
        assert torch.equal(first_a[n], first_b[n]), n
    # the gradient grows 10x, the inverses (eigenbases) are those of step 0
    da, db = step(clipped, a, X, y, 10.0), step(plain, b, X, y, 10.0)
    scaled = 0
    for n in da:
        c = min(1.0, 2.0 * first_b[n].norm().item() / db[n].norm().item())
        torch.testing.assert_close(da[n], c * db[n], rtol=1e-5, atol=1e-8)
        assert da[n].norm() <= 2.0 * first_a[n].norm() * (1 + 1e-5)
        scaled += c < 1
    assert scaled >= 2, "no parameter was clipped: the test does not exercise the clip"
    clipped.close()
    plain.close()


class WithUnused(nn.Module):
    """The MLP and a layer the forward never uses (its parameters get no gradient: the
    update's parameters do not tile the flat vector)."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.unused = nn.Linear(2, 2)

    def forward(self, x):
        return self.net(x)


def test_the_clip_applies_where_some_parameter_has_no_gradient():
    X, y = batch()
    torch.manual_seed(0)
    a = WithUnused()
    b = copy.deepcopy(a)
    kw = dict(lr=0.1, inverse_every=10, fisher="mc", loss_func=nn.CrossEntropyLoss())
    clipped, plain = curvature.KFAC(a, **kw), curvature.KFAC(b, stale_clip=None, **kw)
    first = step(plain, b, X, y)
    step(clipped, a, X, y)
    da, db = step(clipped, a, X, y, 10.0), step(plain, b, X, y, 10.0)
    for n in first:
        if n.startswith("unused"):
            assert not da[n].any() and not db[n].any()
            continue
        c = min(1.0, 2.0 * first[n].norm().item() / db[n].norm().item())
        assert c < 1, n
        torch.testing.assert_close(da[n], c * db[n], rtol=1e-5, atol=1e-8)
    clipped.close()
    plain.close()


def test_without_growth_the_clip_changes_nothing():
    """Shrinking directions (one batch, a few steps): bit for bit the unclipped run."""
    X, y = batch()
    a, b = mlp(), mlp()
    clipped = curvature.KFAC(a, inverse_every=4, stale_clip=2.0, momentum=0.5)
    plain = curvature.KFAC(b, inverse_every=4, stale_clip=None, momentum=0.5)
    for _ in range(9):
        step(clipped, a, X, y)
        step(plain, b, X, y)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    clipped.close()
    plain.close()


def run_growing(opt, model, X, y, steps, start):
    for k in range(steps):
        step(opt, model, X, y, 1.0 + 3.0 * (start + k))


def test_state_dict_resumes_between_refreshes_bit_for_bit():
    X, y = batch()
    model = mlp()
    opt = curvature.KFAC(model, lr=0.1, inverse_every=10)
    run_growing(opt, model, X, y, 3, 0)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert saved_opt["curvature"]["stale_clip"]["names"] == [n for n, _ in model.named_parameters()]
    run_growing(opt, model, X, y, 3, 3)  # the loss grows: the clip acts
    expected = [p.detach().clone() for p in model.parameters()]

    def resumed(state):
        m = mlp()
        m.load_state_dict(saved_model)
        o = curvature.KFAC(m, lr=0.1, inverse_every=10)
        o.load_state_dict(state)
        run_growing(o, m, X, y, 3, 3)
        o.close()
        return [p.detach() for p in m.parameters()]

    for p, q in zip(resumed(saved_opt), expected):
        assert torch.equal(p, q)
    # a state of an earlier version (no reference) loads; without the reference the
    # steps up to the next refresh are not clipped, so the run differs
    old = copy.deepcopy(saved_opt)
    del old["curvature"]["stale_clip"]
    assert any(not torch.equal(p, q) for p, q in zip(resumed(old), expected))
    opt.close()


def test_a_malformed_reference_is_refused():
    X, y = batch()
    model = mlp()
    opt = curvature.KFAC(model)
    step(opt, model, X, y)
    state = opt.state_dict()
    state["curvature"]["stale_clip"] = {"names": ["0.weight"], "reference": torch.ones(3)}
    with pytest.raises(ValueError, match="stale_clip"):
        opt.load_state_dict(state)
    opt.close()


@pytest.mark.parametrize("value", [0.5, 0, -1.0, float("inf"), float("nan"), True, "2"])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="stale_clip"):
        curvature.KFAC(mlp(), stale_clip=value)


def test_the_defaults_and_who_clips():
    assert curvature.KFAC(mlp()).stale_clip == 2.0
    assert curvature.EKFAC(mlp(), stale_clip=1).stale_clip == 1
    assert curvature.KFAC(mlp(), stale_clip=None).stale_clip is None
    assert curvature.DiagonalNaturalGradient(mlp()).stale_clip is None


def test_finite_norms_are_the_norms_the_clip_reads():
    """``curvature.foreach.finite_norms``: each tensor's norm, NaN / inf where it is not
    finite (or its squares overflow), 0 for an empty tensor (the per-tensor path)."""
    from curvature.foreach import finite_norms

    a, b = torch.tensor([3.0, 4.0]), torch.ones(2, 2)
    torch.testing.assert_close(finite_norms([a, b]), torch.tensor([5.0, 2.0]))
    out = finite_norms([a, torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])])
    assert out[0] == 5.0 and out[1].isnan() and out[2] == float("inf")
    assert finite_norms([torch.tensor([3e19, 0.0])])[0] == float("inf")  # float32 squares
    torch.testing.assert_close(finite_norms([torch.empty(0), a]), torch.tensor([0.0, 5.0]))
