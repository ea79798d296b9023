"""Layers folded during a pull, as their gradients arrive (``Capture.pull(fold=...)``).

The optimizers' MC / type-2 / Rademacher curvature backward hands each layer's pulled
output gradients to the statistics while autograd still runs, so that they are not all
alive together (a VGG-like CNN at batch 256: 168 MB of them, benchmarks/step_memory.py
``--workloads vgg``). Checked here: the gradients handed out are those of the plain pull,
bit for bit, on graphs with branches, a residual sum, a shared layer and an unreached
head; the calls that cannot be taken early come back as before; an error inside ``fold``
reaches the caller; and the MC step's peak no longer holds every layer's gradients.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch import nn

import curvature
import curvature.early_fold as early_fold

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from step_memory import LiveBytes  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


class Branchy(nn.Module):
    """A trunk, a residual block, a layer called twice, two heads (one unused by ``out``)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.res = nn.Linear(8, 8)
        self.twice = nn.Linear(8, 8)
        self.left = nn.Linear(8, 6)
        self.right = nn.Linear(8, 6)
        self.side = nn.Linear(8, 3)  # not in ``out``: unreached by a pull of ``out``
        self.head = nn.Linear(6, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = h + torch.tanh(self.res(h))  # the residual sum: inp's output gets two terms
        h = self.twice(torch.tanh(self.twice(h)))  # two calls of one layer
        out = self.head(torch.tanh(self.left(h)) * torch.sigmoid(self.right(h)))
        return out, self.side(h)


def count_hooks(monkeypatch) -> list:
    """Floor 0 (the tiny test layers may be taken early) and a count of the early calls'
    pre-hooks each pull registers (so that a comparison cannot pass without any)."""
    monkeypatch.setattr(early_fold, "EARLY_FOLD_ELEMENTS", 0)
    counts = []
    real = early_fold.EarlyFolds.prehooks

    def spy(self):
        hooks = real(self)
        counts.append(len(hooks))
        return hooks

    monkeypatch.setattr(early_fold.EarlyFolds, "prehooks", spy)
    return counts


class Head(nn.Module):
    """``Branchy`` seen through its first output (the loss does not reach ``side``)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)[0]


def with_and_without(fn, fisher, monkeypatch):
    """``(model, [result with early folds, result without])`` of ``fn(Head, CE, data,
    fisher=fisher)`` on two batches of 32, asserting that early folds happened exactly
    where they apply (not for type-2 of CE: vmapped)."""
    torch.manual_seed(0)
    model = Branchy()
    g = torch.Generator().manual_seed(2)
    data = [
        (torch.randn(32, 5, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(2)
    ]
    counts = count_hooks(monkeypatch)
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(early_fold, "ENABLED", enabled)
        runs.append(fn(Head(model), nn.CrossEntropyLoss(), data, fisher=fisher))
        assert (sum(counts) > 0) == (enabled and fisher != "type-2"), counts
        counts.clear()
    return model, runs


def _pulled(cap, out, V, fold=None):
    """``{(name, call index): g}`` after a pull of ``out`` with ``V`` (plain or folding)."""
    got = {}

    def keep(name, module, rule, calls):
        for c in calls:
            got[(name, cap_calls[name].index(c))] = [g.clone() for g in c.grads]
            c.grads = None

    cap_calls = cap.calls
    cap.pull(
        out,
        V,
        is_grads_batched=True,
        retain_graph=True,
        unreached="skip",
        fold=early_fold.FoldPlan(keep) if fold else None,
    )
    early = set(got)
    for name, calls in cap.calls.items():
        for i, c in enumerate(calls):
            if c.grads is not None:
                assert (name, i) not in got
                got[(name, i)] = [g.clone() for g in c.grads]
    return got, early


def test_folded_gradients_equal_the_plain_pull():
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(7, 5)
    with curvature.capture(model) as cap:
        out, _ = model(x)
    V = torch.randn(1, *out.shape)
    plain, none_early = _pulled(cap, out, V)
    folded, early = _pulled(cap, out, V, fold=True)
    assert not none_early
    assert set(plain) == set(folded)
    for k in plain:
        for a, b in zip(plain[k], folded[k]):
            assert torch.equal(a, b), k
    # the layers above another recorded layer with one call are handed out early; the
    # lowest one (inp), the shared one (twice) and the unreached one (side) are not
    assert early == {("res", 0), ("left", 0), ("right", 0), ("head", 0)}
    assert ("side", 0) not in plain


def test_an_unreached_call_of_a_folding_pull_gets_zeros_or_nothing():
    """``side`` reaches ``inp`` (taken early) but ``out`` does not depend on it: its node
    never runs; ``unreached="zeros"`` gives it zero gradients, ``"skip"`` none."""
    torch.manual_seed(0)
    model = Branchy()
    with curvature.capture(model) as cap:
        out, _ = model(torch.randn(3, 5))
    plan = early_fold.FoldPlan(lambda *a: None)
    for unreached in ("zeros", "skip"):
        cap.pull(
            out, torch.ones(1, *out.shape), is_grads_batched=True, unreached=unreached, fold=plan
        )
        side = cap.calls["side"][0]
        if unreached == "zeros":
            assert torch.equal(side.grads[0], torch.zeros(1, 3, 3))
        else:
            assert side.grads is None


def test_an_error_inside_fold_reaches_the_caller_and_the_hooks_go():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    with curvature.capture(model) as cap:
        out = model(torch.randn(4, 3))

    def boom(*args):
        raise KeyError("inside fold")

    kw = dict(is_grads_batched=True, unreached="skip")
    with pytest.raises(KeyError, match="inside fold"):
        cap.pull(out, torch.ones(1, 4, 2), fold=early_fold.FoldPlan(boom), **kw)
    cap.pull(out, torch.ones(1, 4, 2), **kw)  # no hook left: a plain pull sets every call
    assert all(c.grads is not None for calls in cap.calls.values() for c in calls)


def _train(fisher, model, steps=3):
    CE = nn.CrossEntropyLoss()
    opt = curvature.KFAC(model, fisher=fisher, loss_func=CE, lr=0.1, inverse_every=2, seed=3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        X, y = torch.randn(32, 6, generator=g), torch.randint(0, 4, (32,), generator=g)
        opt.zero_grad()
        out = model(X)
        CE(out if out.dim() == 2 else out[0], y).backward()
        opt.step()
    return opt


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.body(x)
        return self.head(h + self.body[2](h))  # a layer called twice: not folded early


@pytest.mark.parametrize("fisher", ["mc", "type-2", "rademacher"])
@pytest.mark.parametrize("make", ["chain", "shared"])
def test_optimizer_steps_equal_those_without_early_folding(fisher, make, monkeypatch):
    """Factors and parameters after three KFAC steps, bit for bit, with and without
    :data:`curvature.early_fold.ENABLED`."""

    def build():
        torch.manual_seed(0)
        if make == "chain":
            return nn.Sequential(
                nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)
            )
        return TwoHeads()

    counts = count_hooks(monkeypatch)
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(early_fold, "ENABLED", enabled)
        model = build()
        opt = _train(fisher, model)
        runs.append((model, opt.factors()))
        assert (sum(counts) > 0) == (enabled and fisher != "type-2")  # (type-2 of CE: vmap)
        counts.clear()
    (m1, f1), (m2, f2) = runs
    assert f1.keys() == f2.keys() and f1
    for k in f1:
        for a, b in zip(f1[k], f2[k]):
            assert torch.equal(a, b), k
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def _chain(width=64, depth=8):
    layers = [nn.Linear(16, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def test_mc_pull_does_not_hold_every_layers_gradients():
    """A chain of 8 layers of width 64 at batch 4096: each output gradient is 1 MiB, the
    factors 17 KiB. The MC curvature backward (at the loss call) grows the live memory by
    about two layers' gradients (the one being folded and its input's), not eight."""
    CE = nn.CrossEntropyLoss()
    N = 4096
    with LiveBytes() as live:
        torch.manual_seed(0)
        model = _chain()
        opt = curvature.KFAC(model, fisher="mc", loss_func=CE, lr=1e-3)
        X, y = torch.randn(N, 16), torch.randint(0, 10, (N,))
        for _ in range(2):
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()
        opt.zero_grad()
        out = model(X)
        base = live.mark()
        loss = CE(out, y)  # the curvature backward runs here
        grown = live.peak - base
        del loss, out
    one = N * 64 * 4
    assert grown < 4 * one, grown / one


def test_the_memory_test_sees_held_gradients(monkeypatch):
    """Without early folding the same pull holds all eight layers' gradients."""
    monkeypatch.setattr(early_fold, "ENABLED", False)
    with pytest.raises(AssertionError):
        test_mc_pull_does_not_hold_every_layers_gradients()


def test_early_when_the_gradient_outweighs_the_statistics():
    """``early_pays``: a convolution's large output gradient is folded early, a
    classifier's small one (against its 2049^2 + 128^2 statistics) is requested, its
    statistics made after the pull (on the optimizers' CNN the other order would keep
    that 16.8 MB Gram alive through the convolutions' folds)."""
    from curvature.early_fold import early_pays

    conv, head = nn.Conv2d(64, 64, 3, padding=1), nn.Linear(2048, 128)
    model = nn.Sequential(conv, nn.Flatten(), nn.AdaptiveAvgPool1d(2048), head)
    with curvature.capture(model) as cap:
        model(torch.randn(8, 64, 32, 32))
    calls, rules = cap.calls, {n: r for n, _, r in cap.layers}
    assert early_pays("0", conv, rules["0"], calls["0"][0])  # 8 * 64 * 1024 > 577^2 + 64^2
    assert not early_pays("3", head, rules["3"], calls["3"][0])  # 8 * 128 < 2049^2 + 128^2


@pytest.mark.parametrize("fn", ["kfac", "ekfac"])
@pytest.mark.parametrize("fisher", ["mc", "type-2", "empirical"])
def test_curvature_functions_equal_those_without_early_folding(fn, fisher, monkeypatch):
    """``curvature.kfac`` / ``ekfac`` on two batches of a graph with a residual sum, a layer
    called twice and a head the loss does not reach: the same blocks in the model's
    order, bit for bit."""
    model, (a, b) = with_and_without(getattr(curvature, fn), fisher, monkeypatch)
    names = ["net.inp", "net.res", "net.twice", "net.left", "net.right", "net.side", "net.head"]
    assert [x.name for x in a.blocks] == [x.name for x in b.blocks] == names  # the layer order
    # 'side', which the loss does not reach (taken early, its node never ran), has zero G
    side = next(x for x in a.blocks if x.name == "net.side")
    assert not side.G.any()
    g = torch.Generator().manual_seed(3)
    v = [torch.randn(p.shape, generator=g) for p in model.parameters()]
    for x, y in zip(a.matvec(v), b.matvec(v)):
        assert torch.equal(x, y)


@pytest.mark.parametrize("fn,fisher", [("kfac", "mc"), ("diag_ggn", "empirical")])
def test_curvature_functions_do_not_hold_every_layers_gradients(fn, fisher):
    """``curvature.kfac(fisher="mc")`` and ``diag_ggn(fisher="empirical")`` on the chain of
    8 layers at batch 4096: their peak (above the data and the model) holds more than 3
    layers' gradients of 1 MiB fewer than with ``ENABLED = False`` (all 8 then)."""

    def peak():
        with LiveBytes() as live:
            torch.manual_seed(0)
            model = _chain()
            X, y = torch.randn(4096, 16), torch.randint(0, 10, (4096,))
            base = live.mark()
            getattr(curvature, fn)(model, nn.CrossEntropyLoss(), (X, y), fisher=fisher)
            return live.peak - base

    early = peak()
    early_fold.ENABLED = False
    try:
        held = peak()
    finally:
        early_fold.ENABLED = True
    one = 4096 * 64 * 4
    assert held - early > 3 * one, (early / one, held / one)


@pytest.mark.parametrize("fisher", ["mc", "empirical", "type-2"])
def test_diag_ggn_equals_the_one_without_early_folding(fisher, monkeypatch):
    """``diag_ggn`` on two batches of the branchy graph (a layer called twice, a head the
    loss does not reach): the same diagonal, bit for bit."""
    _, (a, b) = with_and_without(curvature.diag_ggn, fisher, monkeypatch)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not a["net.side.weight"].any()  # unreached: zero, as without early folds


def test_type2_steps_of_one_output_fold_early_and_equal_those_without(monkeypatch):
    """Type-2 with ``MSELoss`` on one output (one vector: no ``vmap``, as a PINN's): the
    layers are taken early, and the factors and parameters after three steps are those
    without early folds, bit for bit."""
    counts = count_hooks(monkeypatch)
    runs = []
    for enabled in (True, False):
        monkeypatch.setattr(early_fold, "ENABLED", enabled)
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)
        )
        mse = nn.MSELoss()
        opt = curvature.KFAC(model, fisher="type-2", loss_func=mse, lr=0.1, inverse_every=2)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            X, y = torch.randn(32, 3, generator=g), torch.randn(32, 1, generator=g)
            opt.zero_grad()
            mse(model(X), y).backward()
            opt.step()
        assert (sum(counts) > 0) == enabled
        counts.clear()
        runs.append((model, opt.factors()))
    (m1, f1), (m2, f2) = runs
    for k in f1:
        for a, b in zip(f1[k], f2[k]):
            assert torch.equal(a, b), k
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert torch.equal(p, q)


def test_a_fold_that_is_not_a_plan_is_refused():
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    with curvature.capture(model) as cap:
        out = model(torch.randn(4, 3))
    for K in (1, 3):  # (also where a vmapped pull would take nothing early)
        with pytest.raises(TypeError, match="FoldPlan"):
            cap.pull(out, torch.ones(K, 4, 2), is_grads_batched=True, fold=lambda *a: None)
