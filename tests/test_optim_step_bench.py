"""benchmarks/optim_step.py's ASDL rows: built, finite, and the same preconditioning as ours.

Skipped without ASDL (``pip install asdfghjkl``). Nothing is timed here.
"""

import copy
import pathlib
import sys

import pytest
import torch
from torch import nn

import curvature

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import optim_step  # noqa: E402


def mlp(bias=True):
    return nn.Sequential(nn.Linear(6, 5, bias=bias), nn.Tanh(), nn.Linear(5, 3, bias=bias))


def token_mlp(bias=True):
    return nn.Sequential(nn.Linear(3, 4, bias=bias), nn.Tanh(), nn.Linear(4, 3, bias=bias))


def cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, bias=False), nn.Tanh(), nn.Flatten(), nn.Linear(48, 3, bias=False)
    )


def classification(model, N=8):
    X = torch.randn(N, 2, 6, 6) if isinstance(model[0], nn.Conv2d) else torch.randn(N, 6)
    return X, torch.randint(0, 3, (N,)), nn.CrossEntropyLoss()


def regression(N=4, T=5):
    return torch.randn(N, T, 3), torch.randn(N, T, 3), nn.MSELoss()


def test_without_asdl_the_reference_is_quoted():
    assert "6.9x / 41x / 3.1x (ASDL)" in optim_step.ASDL_REFERENCE
    assert "not re-measured" in optim_step.ASDL_REFERENCE


def test_head_to_head_is_our_ratio_over_asdls():
    data = {
        "MLP": {
            "KFAC empirical": {"ratio": 6.0},
            "ASDL KFAC empirical": {"ratio": 8.0},
            "KFAC mc-1": {"ratio": 9.0},
            "ASDL KFAC mc-1": {"ratio": 6.0},
        },
        "CNN": {"KFAC empirical": {"ratio": 3.0}},
    }
    text = optim_step.head_to_head(data)
    assert "- MLP: empirical 0.75, mc-1 1.50" in text
    assert "CNN" not in text
    assert optim_step.head_to_head({"CNN": {"KFAC empirical": {"ratio": 3.0}}}) == ""


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("workload", ["mlp", "tokens", "cnn"])
def test_asdl_row_yields_finite_steps(fisher, workload):
    pytest.importorskip("asdl")
    torch.manual_seed(0)
    if workload == "tokens":
        model, (X, y, loss_func) = token_mlp(), regression()
    else:
        model = mlp() if workload == "mlp" else cnn()
        X, y, loss_func = classification(model)
    before = [p.detach().clone() for p in model.parameters()]
    step = optim_step.asdl_kfac(model, X, y, loss_func, fisher, lr=1e-2, period=3)
    for _ in range(7):  # three refreshes (steps 0, 3, 6)
        step()
    for p, p0 in zip(model.parameters(), before):
        assert torch.isfinite(p).all() and torch.isfinite(p.grad).all()
        assert not torch.equal(p, p0)


def test_training_steps_put_asdl_after_our_kfac():
    pytest.importorskip("asdl")
    torch.manual_seed(0)
    model = mlp()
    X, y, loss_func = classification(model)
    twin = copy.deepcopy(model)
    untouched = [p.detach().clone() for p in twin.parameters()]
    names = []
    for name, step, close in optim_step.training_steps(model, twin, X, y, loss_func, True):
        step()
        names.append(name)
        if close is not None:
            close()
    assert names[:6] == [
        "SGD",
        "Adam",
        "KFAC empirical",
        "KFAC mc-1",
        "ASDL KFAC empirical",
        "ASDL KFAC mc-1",
    ]
    # ASDL trained a copy: the baseline's model is untouched
    assert all(torch.equal(p, q) for p, q in zip(twin.parameters(), untouched))


def updates(model, X, y, loss_func, damping, steps, use_asdl):
    """Per-step updates ``p_before - p_after`` at ``lr = 1`` (the preconditioned gradients)."""
    if use_asdl:
        step = optim_step.asdl_kfac(
            model, X, y, loss_func, "empirical", lr=1.0, damping=damping, factor_decay=0.0
        )
    else:
        opt = curvature.KFAC(
            model,
            lr=1.0,
            damping=damping,
            fisher="empirical",
            loss_func=loss_func,
            factor_decay=0.0,
            inverse_every=optim_step.PERIOD,
            stale_clip=None,
        )  # fmt: skip  (ASDL has no stale clip)

        def step():
            opt.zero_grad()
            loss_func(model(X), y).backward()
            opt.step()

    out = []
    for _ in range(steps):
        before = [p.detach().clone() for p in model.parameters()]
        step()
        out.append([b - p.detach() for b, p in zip(before, model.parameters())])
    return out


def assert_close(ours, theirs, scale=1.0, rtol=1e-9):
    for a_step, b_step in zip(ours, theirs):
        for a, b in zip(a_step, b_step):
            torch.testing.assert_close(a, scale * b, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("make", [lambda: mlp(bias=False), cnn], ids=["mlp", "cnn"])
def test_asdl_preconditions_like_ours_without_bias(float64, make):
    """Bias-free layers, factors without averaging: the same direction, step after step."""
    pytest.importorskip("asdl")
    torch.manual_seed(0)
    model = make()
    X, y, loss_func = classification(model)
    ours = updates(copy.deepcopy(model), X, y, loss_func, 1e-2, 3, use_asdl=False)
    theirs = updates(copy.deepcopy(model), X, y, loss_func, 1e-2, 3, use_asdl=True)
    assert_close(ours, theirs)


def test_asdl_differs_with_bias(float64):
    """ASDL keeps the bias out of ``A``; we append it to the inputs: other preconditioners."""
    pytest.importorskip("asdl")
    torch.manual_seed(0)
    model = mlp()
    X, y, loss_func = classification(model)
    ours = updates(copy.deepcopy(model), X, y, loss_func, 1e-2, 1, use_asdl=False)
    theirs = updates(copy.deepcopy(model), X, y, loss_func, 1e-2, 1, use_asdl=True)
    with pytest.raises(AssertionError):
        assert_close(ours, theirs)


def test_asdl_mse_over_positions_maps_by_the_damping(float64):
    """MSE on ``[N, T, C]``: ASDL's Kronecker product is ``T`` times ours (its ``A`` is
    ours over ``C``, its ``B`` ours times ``T C``), so our step at damping ``lambda`` is
    ``T`` times ASDL's at ``T lambda``."""
    pytest.importorskip("asdl")
    torch.manual_seed(0)
    T = 5
    model = token_mlp(bias=False)
    X, y, loss_func = regression(T=T)
    ours = updates(copy.deepcopy(model), X, y, loss_func, 1e-2, 1, use_asdl=False)
    theirs = updates(copy.deepcopy(model), X, y, loss_func, T * 1e-2, 1, use_asdl=True)
    assert_close(ours, theirs, scale=T)
    same_damping = updates(copy.deepcopy(model), X, y, loss_func, 1e-2, 1, use_asdl=True)
    with pytest.raises(AssertionError):
        assert_close(ours, same_damping, scale=T)


def test_asdl_kfac_rejects_other_losses_and_fishers():
    pytest.importorskip("asdl")
    model = mlp()
    X, y, loss_func = classification(model)
    with pytest.raises(ValueError, match="fisher"):
        optim_step.asdl_kfac(model, X, y, loss_func, "type-2")
    with pytest.raises(ValueError, match="loss_func"):
        optim_step.asdl_kfac(model, X, y, nn.NLLLoss(), "empirical")
    with pytest.raises(ValueError, match="mean"):
        optim_step.asdl_kfac(model, X, y, nn.CrossEntropyLoss(reduction="sum"), "empirical")


def test_without_asdl_no_asdl_rows(monkeypatch):
    monkeypatch.setitem(sys.modules, "asdl", None)  # import asdl raises ImportError
    assert optim_step.load_asdl() is None
    model = mlp()
    X, y, loss_func = classification(model)
    names = []
    for name, _, close in optim_step.training_steps(model, model, X, y, loss_func, False):
        names.append(name)
        if close is not None:
            close()
    assert not any(n.startswith("ASDL") for n in names) and "KFAC empirical" in names
