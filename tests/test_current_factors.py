"""KFAC's Cholesky refresh without a copy of the factors (``CurrentFactors`` records).

Where the damping does not change between refreshes by design (no ``adaptive_damping``,
no quadratic rule), a refresh keeps the damped inverses and no snapshot of the factors:
between refreshes the optimizer holds each factor twice (running value, inverse), not
three times. What that changes and what it must not:

- memory: one ``D x D`` tensor less per factor between steps (counted by storage);
- a damping the user changes between refreshes takes the running factors of that moment
  (checked against dense inverses of ``optim.factors()``), while the adaptive rules keep
  their snapshot (the factors of the refresh);
- a resumed run continues bit for bit inside a refresh period (the inverses are saved,
  they cannot be derived again from factors that moved on).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import pathlib
import sys
import warnings

import pytest
import torch
from torch import nn

import curvature

CE = nn.CrossEntropyLoss()


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(31, 17), nn.Tanh(), nn.Linear(17, 5)).double()


def _data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 31, generator=g, dtype=torch.float64), torch.randint(
        0, 5, (16,), generator=g
    )


def _train(opt, model, X, y, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        CE(model(X), y).backward()
        opt.step()


def _storages(shape) -> int:
    """Distinct storages of the live float64 tensors of ``shape``."""
    gc.collect()
    with warnings.catch_warnings():  # (isinstance on some of torch's deprecated objects)
        warnings.simplefilter("ignore")
        found = [
            t
            for t in gc.get_objects()
            if type(t) in (torch.Tensor, nn.Parameter)  # (not another test's fake tensors)
            and tuple(t.shape) == shape
            and t.dtype == torch.float64
        ]
    return len({t.untyped_storage().data_ptr() for t in found})


@pytest.mark.parametrize("rule", ["fixed", "quadratic"])
def test_between_refreshes_a_factor_is_held_twice_without_adaptive_damping(rule):
    model = _model()
    X, y = _data()
    kw = dict(update_rule="quadratic") if rule == "quadratic" else {}
    opt = curvature.KFAC(model, lr=1e-2, loss_func=CE, inverse_every=2, **kw)
    _train(opt, model, X, y, 5)  # refreshes at steps 0, 2, 4
    kinds = {type(b.record).__name__ for b in opt.blocks.values()}
    # the first layer's A [1, 32, 32]: running factor and inverse (+ the refresh's copy)
    if rule == "fixed":
        assert kinds == {"CurrentFactors"}
        assert _storages((1, 32, 32)) == 2
    else:
        assert kinds == {"FactorSnapshot"}
        assert _storages((1, 32, 32)) == 3


def _pi_inverse_step(A: torch.Tensor, G: torch.Tensor, M: torch.Tensor, damping: float):
    """``(G + sqrt(l)/pi I)^{-1} M (A + pi sqrt(l) I)^{-1}`` by dense inverses."""
    pi = ((A.diagonal().clamp_min(0).mean()) / (G.diagonal().clamp_min(0).mean())).sqrt()
    root = damping**0.5
    Ainv = torch.linalg.inv(A + pi * root * torch.eye(A.shape[0], dtype=A.dtype))
    Ginv = torch.linalg.inv(G + root / pi * torch.eye(G.shape[0], dtype=G.dtype))
    return Ginv @ M @ Ainv


def test_a_damping_changed_between_refreshes_takes_the_running_factors():
    model = _model()
    X, y = _data()
    opt = curvature.KFAC(model, lr=1e-2, damping=1e-3, inverse_every=100)
    _train(opt, model, X, y, 4)  # one refresh (step 0), three updates of the factors since
    v = [torch.randn(p.shape, dtype=p.dtype) for p in model.parameters()]
    before = opt.inverse_matvec(v)
    opt.param_groups[0]["damping"] = 3e-3
    after = opt.inverse_matvec(v)
    factors = opt.factors()
    for i, name in enumerate(["0", "2"]):
        A, G = (f.reshape(f.shape[-2:]) for f in factors[name])
        W, b = v[2 * i], v[2 * i + 1]
        want = _pi_inverse_step(A, G, torch.cat([W, b[:, None]], 1), 3e-3)
        torch.testing.assert_close(after[2 * i], want[:, :-1], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(after[2 * i + 1], want[:, -1], rtol=1e-9, atol=1e-12)
        # not vacuous: the inverses before the change are those of the step-0 factors
        stale = _pi_inverse_step(A, G, torch.cat([W, b[:, None]], 1), 1e-3)
        assert not torch.allclose(before[2 * i], stale[:, :-1], rtol=1e-6)


def test_the_adaptive_rule_keeps_the_factors_of_the_refresh():
    """With ``adaptive_damping`` the inverses at a new damping come from the snapshot: the
    same as a refresh's at that damping of the factors of that refresh."""
    model = _model()
    X, y = _data()
    opt = curvature.KFAC(
        model,
        lr=1e-2,
        damping=1e-3,
        inverse_every=100,
        adaptive_damping=True,
        damping_adaptation_interval=1000,
    )

    def closure():
        opt.zero_grad()
        loss = CE(model(X), y)
        loss.backward()
        return loss

    opt.step(closure)  # the refresh (step 0)
    at_refresh = copy.deepcopy(opt.factors())
    for _ in range(3):
        opt.step(closure)
    v = [torch.randn(p.shape, dtype=p.dtype) for p in model.parameters()]
    opt.param_groups[0]["damping"] = 3e-3
    after = opt.inverse_matvec(v)
    for i, name in enumerate(["0", "2"]):
        A, G = (f.reshape(f.shape[-2:]) for f in at_refresh[name])
        W, b = v[2 * i], v[2 * i + 1]
        want = _pi_inverse_step(A, G, torch.cat([W, b[:, None]], 1), 3e-3)
        torch.testing.assert_close(after[2 * i], want[:, :-1], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_a_run_resumed_inside_a_refresh_period_continues_bit_for_bit(fisher):
    X, y = _data()
    model = _model()
    opt = curvature.KFAC(model, lr=0.1, inverse_every=10, fisher=fisher, loss_func=CE)
    _train(opt, model, X, y, 4)  # refreshed at step 0; the factors moved on since
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    _train(opt, model, X, y, 3)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    twin = _model(seed=5)
    twin.load_state_dict(saved["model"])
    again = curvature.KFAC(twin, lr=0.1, inverse_every=10, fisher=fisher, loss_func=CE)
    again.load_state_dict(saved["optim"])
    _train(again, twin, X, y, 3)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    # not vacuous: without the saved inverses (taken from the running factors) it differs
    state = copy.deepcopy(saved["optim"])
    for block in state["curvature"]["blocks"].values():
        assert "inverses" in block
        del block["inverses"]
    twin = _model(seed=5)
    twin.load_state_dict(saved["model"])
    other = curvature.KFAC(twin, lr=0.1, inverse_every=10, fisher=fisher, loss_func=CE)
    other.load_state_dict(state)
    _train(other, twin, X, y, 3)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))


@pytest.mark.parametrize("path", ["cpu", "gpu-like"])
def test_a_refresh_with_non_finite_factors_keeps_the_previous_inverses(path):
    """A CPU writes the new inverses over the previous ones (after reading the factors'
    finiteness); a GPU takes new memory and keeps the previous ones until the outcomes
    are read (``as_on_cuda``: that path on the CPU). Either way a block whose factors
    are not finite keeps its previous inverses, the others take new ones."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_counts import as_on_cuda

    model = _model()
    X, y = _data()
    opt = curvature.KFAC(model, lr=0.1, damping=1e-2, inverse_every=2)
    context = as_on_cuda() if path == "gpu-like" else contextlib.nullcontext()
    with context:
        _train(opt, model, X, y, 3)  # refreshed at steps 0 and 2
        first, second = opt.blocks["0"], opt.blocks["2"]
        old = (first.inverses.Ainv.clone(), first.inverses.Ginv.clone(), first.record)
        kept_second = second.inverses.Ainv.clone()
        first.G.view(-1)[0] = float("inf")
        with pytest.warns(UserWarning, match="decomposition of '0' failed.*keeping"):
            _train(opt, model, X, y, 2)  # steps 3 and 4: the refresh at step 4
    assert first.record is old[2]
    assert torch.equal(first.inverses.Ainv, old[0]) and torch.equal(first.inverses.Ginv, old[1])
    assert not torch.equal(second.inverses.Ainv, kept_second)  # refreshed
    assert all(torch.isfinite(p).all() for p in model.parameters())
