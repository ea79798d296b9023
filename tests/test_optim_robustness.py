"""KFAC / EKFAC optimizers on adversarial input: NaNs, degenerate layers and batches,
frozen and shared parameters, stray forwards, uncovered layers, BatchNorm, mixed precision.

The contract checked here: never a crash where the documentation promises a skip, never
a NaN parameter, never silently corrupted statistics, and a clear error where the input
cannot be handled.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from cases import TinyTransformer, train_step
from optimizer_info import optimizer_params, variants
from torch import nn

import curvature
import curvature.blocks.refresh
from curvature.optim.statistics import BatchContext, StepStatistics, normalize

KFAC, EKFAC = curvature.KFAC, curvature.EKFAC
CE = nn.CrossEntropyLoss()


#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


# -- helpers ---------------------------------------------------------------------------------------
def mlp(sizes=(4, 6, 3), seed=0, act=nn.Tanh, dtype=torch.float32, bias=True):
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(act())
        layers.append(nn.Linear(a, b, bias=bias))
    return nn.Sequential(*layers).to(dtype)


def batch(N=10, D=4, C=3, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g).to(dtype), torch.randint(0, C, (N,), generator=g)


def params(model):
    return [p.detach().clone() for p in model.parameters()]


def finite(model):
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def snapshot(opt):
    return {k: (A.clone(), G.clone()) for k, (A, G) in opt.factors().items()}


def assert_factors_equal(a, b, atol=0.0, rtol=0.0):
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k][0], b[k][0], atol=atol, rtol=rtol)
        torch.testing.assert_close(a[k][1], b[k][1], atol=atol, rtol=rtol)


GRAD_FISHERS = ("empirical", "type-2", "rademacher")
# (optimizer, fisher) of the Kronecker-factored optimizers (the tests below read factors());
# the tests that need no factors run on every optimizer of the table
VARIANTS = [
    pytest.param(info.cls, fisher, id=f"{info.name}-{fisher}")
    for info, fisher in (v.values for v in variants(lambda i, f: hasattr(i.cls, "factors")))
]
ALL_VARIANTS = [
    pytest.param(info.cls, fisher, id=f"{info.name}-{fisher}")
    for info, fisher in (v.values for v in variants())
]


# -- NaN in a batch --------------------------------------------------------------------------------
def _nan_batch(seed=5):
    X, y = batch(seed=seed)
    X[3, 1] = float("nan")
    return X, y


@pytest.mark.parametrize("cls,fisher", [v for v in VARIANTS if "mc" not in v.id])
def test_nan_batch_is_skipped_with_a_warning(cls, fisher):
    model = mlp()
    opt = cls(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
    train_step(opt, model, *batch(seed=1))
    train_step(opt, model, *batch(seed=2))
    before, factors = params(model), snapshot(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the step itself reads nothing from the device
        train_step(opt, model, *_nan_batch())
    with pytest.warns(UserWarning, match="non-finite update"):  # read with the counter
        assert opt.skipped_statistics >= 1
    assert finite(model)
    assert all(torch.equal(p, q) for p, q in zip(params(model), before))
    assert_factors_equal(snapshot(opt), factors)  # the NaN statistics never entered
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_step(opt, model, *batch(seed=3))  # and training goes on
    assert finite(model)
    assert not torch.equal(params(model)[0], before[0])
    assert all(
        bool(torch.isfinite(A).all() and torch.isfinite(G).all()) for A, G in opt.factors().values()
    )


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_nan_in_the_very_first_batch(fisher):
    model = mlp()
    opt = KFAC(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
    with pytest.warns(UserWarning, match="non-finite"):  # step 0 refreshes, and reads
        train_step(opt, model, *_nan_batch())
        train_step(opt, model, *_nan_batch())  # the next step refreshes again (no data)
    assert finite(model) and opt.factors() == {} and opt.skipped_statistics >= 1
    train_step(opt, model, *batch())
    assert finite(model) and set(opt.factors()) == {"0", "2"}


@pytest.mark.parametrize("info", optimizer_params(lambda i: "mc" in i.fishers))
def test_nan_batch_with_mc_fisher_does_not_crash(info):
    cls = info.cls
    model = mlp()
    opt = cls(model, lr=0.1, damping=1e-2, fisher="mc", loss_func=CE)
    train_step(opt, model, *batch())
    before = params(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_step(opt, model, *_nan_batch())
    assert finite(model) and opt.skipped_statistics >= 1
    assert all(torch.equal(p, q) for p, q in zip(params(model), before))


@pytest.mark.parametrize("owned", [False, True], ids=["selected", "zeroed-in-place"])
def test_one_non_finite_block_is_skipped_alone(owned):
    # the finiteness of a pull's contributions is checked in one batched reduction: each
    # contribution must still be judged on its own values. Owned values (the library's
    # own new tensors) are zeroed in place, the skipped one before it is summed with the
    # kept one of the same block
    stats, ctx = StepStatistics(), BatchContext(samples=10)
    good, bad = torch.ones(2, 2), torch.tensor([[1.0, float("inf")], [0.0, 1.0]])

    def add(name, A, G):
        values = [A.clone(), G.clone(), None] if owned else [A, G, None]
        stats.add((name, "", 0), values, ("A", "G", "G"), ctx, rows=10, owned=owned)

    add("0", good, good)
    add("2", good, bad)
    add("2", good, good)
    assert stats.skipped == 0  # nothing is judged before the flush
    stats.flush()
    assert stats.skipped == 1
    first, second = stats.slots[("0", "", 0)], stats.slots[("2", "", 0)]
    counts = [*first.kept_counts(), *second.kept_counts()]
    assert [float(c) for c in counts] == [10, 10, 10, 10]  # the skipped one is not counted
    assert torch.equal(second.values[1], good) and second.values[2] is None
    out = normalize(stats.take(), world=1, ordered=False)
    assert bool(out[("2", "", 0)].valid)
    torch.testing.assert_close(out[("2", "", 0)].values[0], good / 10, rtol=0, atol=0)
    torch.testing.assert_close(out[("2", "", 0)].values[1], good / 10, rtol=0, atol=0)


@pytest.mark.parametrize("owned", [True, False], ids=["library-factor", "rule-value"])
def test_one_non_finite_input_vector_or_entry_skips_a_large_contribution(owned):
    # a library factor (a Gram matrix sum_n x_n x_n^T) from one input vector with a NaN:
    # most of its entries are finite; a rule's own value with one NaN off its diagonal.
    # Either contribution is skipped whole (a judgement on fewer entries, e.g. a Gram
    # matrix's diagonal, must keep both)
    D = 512
    if owned:
        x = torch.randn(6, D)
        x[2, 7] = float("nan")
        value = x.T @ x
        assert torch.isfinite(value[0, 1]) and not torch.isfinite(value.diagonal()).all()
    else:
        value = torch.eye(D)
        value[0, 1] = float("nan")
    stats, ctx = StepStatistics(), BatchContext(samples=6)
    stats.add(("0", "", 0), [value, torch.eye(3), None], ("A", "G", "G"), ctx, 6, owned)
    stats.flush()
    assert stats.skipped == 1
    ((values, valid),) = normalize(stats.take(), world=1, ordered=False).values()
    assert not bool(valid) and all(not v.any() for v in values[:2])


def test_a_wide_layer_with_one_nan_input_skips_its_statistics():
    # end to end: one NaN entry of a 600-wide input skips the step's statistics
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(600, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = KFAC(model, lr=0.1, damping=1e-2, loss_func=CE)
    X, y = torch.randn(16, 600), torch.randint(0, 3, (16,))
    train_step(opt, model, X, y)
    X[4, 123] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_step(opt, model, X, y)
    assert opt.skipped_statistics >= 1 and finite(model)
    assert all(bool(torch.isfinite(f).all()) for pair in opt.factors().values() for f in pair)


def test_owned_contributions_of_different_sizes_are_zeroed_in_place_alone():
    # contributions holding two values (Kronecker factors) and one value (a diagonal)
    # in one flush (judged value by value): the library's own values of the skipped one
    # are zeroed in place (a NaN, an inf and a finite entry alike), the others untouched
    stats, ctx = StepStatistics(), BatchContext(samples=10)
    bad_A = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
    bad_G, good = torch.ones(2, 2), torch.ones(2, 2)
    stats.add(("0", "", 0), [bad_A, bad_G, None], ("A", "G", "G"), ctx, rows=10, owned=True)
    stats.add(("1", "", 0), [good.clone()], ("g",), ctx, owned=True)
    stats.add(
        ("2", "", 0), [good.clone(), good.clone(), None], ("A", "G", "G"), ctx, rows=10, owned=True
    )
    stats.flush()
    assert stats.skipped == 1
    assert bad_A.eq(0).all() and bad_G.eq(0).all()  # in place: the same tensors, zeros
    assert stats.slots[("0", "", 0)].values[0] is bad_A
    assert torch.equal(stats.slots[("1", "", 0)].values[0], good)
    assert torch.equal(stats.slots[("2", "", 0)].values[1], good)
    out = normalize(stats.take(), world=1, ordered=False)
    assert not bool(out[("0", "", 0)].valid) and bool(out[("2", "", 0)].valid)


def test_a_block_with_only_non_finite_contributions_is_not_updated():
    # judged on the device: the statistics are zeros with valid=False, and the running
    # factors select their old values without a host read
    stats, ctx = StepStatistics(), BatchContext(samples=10)
    bad = torch.full((2, 2), float("nan"))
    stats.add(("0", "", 0), [bad, torch.eye(2), None], ("A", "G", "G"), ctx, rows=10)
    stats.flush()
    ((values, valid),) = normalize(stats.take(), world=1, ordered=False).values()
    assert not bool(valid) and all(torch.equal(v, torch.zeros(2, 2)) for v in values[:2])
    block = curvature.blocks.KroneckerBlock("0", torch.zeros(1, 2, 2, dtype=torch.long))
    block.update(torch.eye(2)[None], torch.eye(2)[None], 0.9)
    block.update(values[0][None], values[1][None], 0.9, valid)
    assert torch.equal(block.A[0], torch.eye(2)) and block.has_statistics()
    fresh = curvature.blocks.KroneckerBlock("0", torch.zeros(1, 2, 2, dtype=torch.long))
    fresh.update(values[0][None], values[1][None], 0.9, valid)
    assert not fresh.has_statistics()  # the first valid update is then taken as it is
    fresh.update(2 * torch.eye(2)[None], torch.eye(2)[None], 0.9, torch.tensor(True))
    assert torch.equal(fresh.A[0], 2 * torch.eye(2)) and fresh.has_statistics()


@pytest.mark.parametrize("bad_at", [None, 3, 69])
def test_failed_checks_are_kept_over_many_flushes(bad_at):
    # the checks' flags are OR-ed when read (and every 64 flushes), not at every flush
    stats, msg = StepStatistics(), "bad targets"
    for i in range(70):
        stats.require_false(torch.tensor(i == bad_at), msg)
        stats.flush()
    assert list(stats.failed) == [msg] and bool(stats.failed[msg]) == (bad_at is not None)
    if bad_at is None:
        stats.raise_failed([False])
    else:
        with pytest.raises(ValueError, match=msg):
            stats.raise_failed([True])
    assert stats.failed == {}


def test_diagonal_block_running_update_in_the_statistics_shape():
    # [1, D_out, D] statistics update the flat d [P_b] in place (no reshape per step): the
    # same values as the flat running average, also after a state round trip
    gen = torch.Generator().manual_seed(0)
    block = curvature.blocks.DiagonalBlock("0", torch.arange(6).reshape(1, 2, 3))
    ref = None
    for i, ok in enumerate([True, False, True, True, None, True]):
        new = (
            torch.rand(1, 2, 3, generator=gen, dtype=torch.float64)
            if ok is not False
            else (torch.zeros(1, 2, 3, dtype=torch.float64))
        )
        block.update(new, 0.9, None if ok is None else torch.tensor(ok))
        flat = new.reshape(-1)
        if ref is None:
            ref = flat.clone()
        else:  # (valid None: 1 - decay selected from the block's flag on the device)
            w = torch.tensor(0.0 if ok is False else 1 - 0.9, dtype=torch.float64)
            if ok is None:
                w = torch.where(torch.tensor(False), 1.0, 1 - 0.9).to(torch.float64)
            ref = torch.lerp(ref, flat, w)
        assert block.d.shape == (6,) and torch.equal(block.d, ref), i
        if i == 3:
            block.load_state_dict(block.state_dict())


def _spd(n, seed, dtype):
    x = torch.randn(n, n + 2, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return (x @ x.T)[None]


@pytest.mark.parametrize(
    "decay,dtype",
    # 1e-12: 1 - decay rounds to 1 in float32, so the flag is tracked per update
    [(0.9, torch.float64), (0.0, torch.float64), (0.9, torch.float32), (1e-12, torch.float32)],
)
def test_ekfac_corrections_before_finite_statistics_are_kfac_eigenvalues(decay, dtype):
    # brute-force twin of the running corrections: weights 0 (not valid), 1 (first valid),
    # 1 - decay; until a valid one arrives the eigenvalues used are KFAC's, and the stored
    # Lambda (trace, state) is zeros; a new basis carries the rule over
    block = curvature.blocks.EigenCorrectedBlock(
        "0", torch.arange(6).reshape(1, 2, 3), _spd(3, 0, dtype), _spd(2, 1, dtype)
    )
    block.install(block.decompose())
    gen = torch.Generator().manual_seed(2)
    raw, fresh = None, True
    steps = [False, False, "refresh", False, True, False, True, "refresh", True]
    for i, ok in enumerate(steps):
        if ok == "refresh":  # new factors, new basis (flags unread: still on the device)
            block.A, block.G = _spd(3, 10 + i, dtype), _spd(2, 20 + i, dtype)
            block.install(block.decompose())
            if raw is not None and not fresh:  # the old Lambda rotated into the new basis
                raw = block.corrections.clone()
        else:
            lam = torch.rand(1, 2, 3, generator=gen, dtype=dtype) if ok else torch.zeros(1, 2, 3)
            lam = lam.to(dtype)
            block.update_corrections(lam, decay, torch.tensor(ok))
            w = 0.0 if not ok else (1.0 if fresh else 1 - decay)
            raw = lam.clone() if raw is None else torch.lerp(raw, lam, torch.tensor(w, dtype=dtype))
            fresh = fresh and not ok
        kfac = curvature.blocks.KroneckerBlock.eigenvalues(block)
        expected_raw = torch.zeros_like(raw) if fresh else raw
        assert torch.equal(block.eigenvalues(), kfac if fresh else raw), i
        assert torch.equal(block.state_dict()["corrections"], expected_raw), i
        assert torch.equal(block.trace(), expected_raw.sum()), i
        assert bool(block.corrections_fresh) == fresh, i
    block.read_flags([bool(f) for f in block.flags()])
    assert block.corrections_fresh is None and torch.equal(block.eigenvalues(), raw)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (KFAC, {}),
        (KFAC, {"kl_clip": 1e-3}),
        (EKFAC, {}),
        # refreshes on every step: Cholesky and eigendecompositions are batched too
        (KFAC, {"inverse_every": 1}),
        (KFAC, {"inverse_every": 1, "damping_mode": "exact"}),
        (EKFAC, {"inverse_every": 1}),
    ],
)
def test_a_step_synchronizes_the_host_a_fixed_number_of_times(cls, kwargs, monkeypatch):
    # on a GPU every bool() / float() / tolist() of a tensor waits for the device: the
    # number per step (refreshes included) must not grow with the number of layers
    kwargs = {"inverse_every": 1000, **kwargs}

    def syncs_per_step(depth):
        model = mlp((4,) + (6,) * depth + (3,))
        opt = cls(model, lr=0.01, fisher="mc", loss_func=CE, **kwargs)
        for seed in range(2):
            train_step(opt, model, *batch(seed=seed))
        count = [0]
        for name in ("__bool__", "__float__", "__int__", "item", "tolist"):
            orig = getattr(torch.Tensor, name)

            def counting(self, *args, _orig=orig):
                count[0] += 1
                return _orig(self, *args)

            monkeypatch.setattr(torch.Tensor, name, counting)
        for seed in range(2, 5):
            X, y = batch(seed=seed)
            opt.zero_grad()
            CE(model(X), y).backward()  # the loss is not converted: only the optimizer counts
            opt.step()
        monkeypatch.undo()
        return count[0] / 3

    # none without a refresh (the statistics' and updates' checks stay on the device), at
    # most two at a refresh; all of them are counted in tests/test_optim_syncs.py
    shallow, deep = syncs_per_step(1), syncs_per_step(6)
    assert shallow == deep <= (2 if kwargs["inverse_every"] == 1 else 0)


# -- degenerate layers and batches -----------------------------------------------------------------
@pytest.mark.parametrize("damping_mode", ["exact", "pi"])
@pytest.mark.parametrize("cls", [KFAC, EKFAC])
def test_layer_with_all_zero_inputs(cls, damping_mode):
    """``A = 0`` (no bias) for the first layer: its gradient is zero and so is its update."""
    model = mlp((4, 6, 3), bias=False)
    opt = cls(model, lr=0.5, damping=1e-3, fisher="type-2", loss_func=CE, damping_mode=damping_mode)
    w0 = model[0].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for seed in range(3):
            _, y = batch(seed=seed)
            train_step(opt, model, torch.zeros(10, 4), y)
    assert finite(model)
    assert torch.equal(model[0].weight, w0)
    A, G = opt.factors()["0"]
    assert torch.equal(A, torch.zeros_like(A)) and torch.isfinite(G).all()


@pytest.mark.parametrize("damping_mode", ["exact", "pi"])
@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_dead_relu_layer(fisher, damping_mode):
    """All-zero inputs to the second layer (dead ReLUs); its weight gets zero gradient."""
    model = mlp((4, 6, 3), act=nn.ReLU)
    with torch.no_grad():
        model[0].bias.fill_(-100.0)
    opt = KFAC(model, lr=0.5, damping=1e-3, fisher=fisher, loss_func=CE, damping_mode=damping_mode)
    w2 = model[2].weight.detach().clone()
    for seed in range(3):
        train_step(opt, model, *batch(seed=seed))
    assert finite(model)
    assert torch.equal(model[2].weight, w2)
    assert not torch.equal(model[2].bias, mlp((4, 6, 3), act=nn.ReLU)[2].bias)


@pytest.mark.parametrize("cls,fisher", ALL_VARIANTS)
def test_batch_of_one(cls, fisher):
    model = mlp()
    opt = cls(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
    for seed in range(4):
        X, y = batch(N=1, seed=seed)
        train_step(opt, model, X, y)
    assert finite(model) and opt.steps == 4


@pytest.mark.parametrize("cls,fisher", ALL_VARIANTS)
def test_batch_smaller_than_the_layer_width(cls, fisher):
    """N=3 samples, 32 inputs: A has rank <= 4; damping keeps the inverse finite.

    The MC Fisher draws 8 labels per sample: with one, whether a step at lr 0.2 lowers
    the loss of 3 samples is up to the draw (KFAC and EKFAC over seeds 0-29: 9 to 16 of
    60 runs end above the start; with 8, none)."""
    model = mlp((32, 24, 3))
    kw = {"mc_samples": 8} if fisher == "mc" else {}
    opt = cls(model, lr=0.2, damping=1e-2, fisher=fisher, loss_func=CE, **kw)
    X, y = batch(N=3, D=32)
    with torch.no_grad():
        start = float(CE(model(X), y))
    for _ in range(5):
        train_step(opt, model, X, y)
    assert finite(model)
    with torch.no_grad():
        assert float(CE(model(X), y)) < start


@pytest.mark.parametrize("cls,fisher", VARIANTS)
def test_changing_batch_sizes(cls, fisher):
    model = mlp()
    opt = cls(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE, inverse_every=2)
    for i, N in enumerate([7, 1, 16, 3, 9, 2]):
        train_step(opt, model, *batch(N=N, seed=i))
    assert finite(model)
    # accumulation over micro-batches of different sizes
    opt.zero_grad()
    for i, N in enumerate([5, 2]):
        X, y = batch(N=N, seed=10 + i)
        CE(model(X), y).backward()
    opt.step()
    assert finite(model) and opt.steps == 7


# -- frozen parameters -----------------------------------------------------------------------------
@pytest.mark.parametrize("fisher", ["empirical", "type-2", "forward-only"])
def test_frozen_parameters_are_untouched(fisher):
    model = mlp((4, 6, 5, 3))
    model[0].weight.requires_grad_(False)
    model[0].bias.requires_grad_(False)
    model[2].bias.requires_grad_(False)  # a Linear with a trainable weight only
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # everything trainable is covered
        opt = KFAC(
            model, lr=0.2, damping=1e-2, fisher=fisher, loss_func=CE, momentum=0.5, weight_decay=0.1
        )
    assert opt.uncovered == []
    before = params(model)
    for seed in range(3):
        train_step(opt, model, *batch(seed=seed))
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and p.grad is None
    assert not torch.equal(model[2].weight, before[2])
    assert opt.factors()["2"][0].shape == (6, 6)  # no bias column for the frozen bias
    assert "0" not in opt.factors()


def test_frozen_parameters_match_the_offline_step():
    model = mlp((4, 6, 3)).double()
    model[2].bias.requires_grad_(False)
    X, y = batch(dtype=torch.float64)
    approx = curvature.kfac(copy.deepcopy(model), CE, (X, y), fisher="type-2")
    opt = KFAC(model, lr=1.0, damping=1e-2, fisher="type-2", loss_func=CE, damping_mode="exact")
    before = params(model)
    opt.zero_grad()
    CE(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    opt.step()
    trainable = [(p, q) for p, q in zip(model.parameters(), before) if p.requires_grad]
    for (p, q), e in zip(trainable, approx.inverse_matvec(grads, 1e-2)):
        torch.testing.assert_close(p.detach() - q, -e, atol=1e-12, rtol=0)


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_freezing_a_parameter_after_construction(fisher):
    model = mlp()
    opt = KFAC(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
    train_step(opt, model, *batch(seed=1))
    model[0].bias.requires_grad_(False)
    b = model[0].bias.detach().clone()
    train_step(opt, model, *batch(seed=2))
    assert torch.equal(model[0].bias, b) and finite(model)


# -- a module used twice ---------------------------------------------------------------------------
class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(4, 5)
        self.shared = nn.Linear(5, 5)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h)


@pytest.mark.parametrize(
    "fisher",
    [
        "empirical",
        "type-2",
        "mc",
    ],
)
def test_module_used_twice_in_one_forward(fisher):
    """Two calls act like weight sharing over two positions ("expand"), as offline."""
    model = Twice().double()
    X, y = batch(dtype=torch.float64)
    approx = curvature.kfac(copy.deepcopy(model), CE, (X, y), fisher=fisher)
    opt = KFAC(model, lr=0.1, damping=1e-1, fisher=fisher, loss_func=CE)
    train_step(opt, model, X, y)
    if fisher != "mc":  # mc: another stream of samples than the offline function
        assert_factors_equal(opt.factors(), approx.factors, atol=1e-12, rtol=1e-10)
    assert opt.factors()["shared"][0].shape == (6, 6)
    losses = [train_step(opt, model, X, y) for _ in range(5)]
    assert finite(model) and losses[-1] < losses[0]


# -- stray forwards --------------------------------------------------------------------------------
def _run_with_stray_forwards(fisher, stray, data):
    model = mlp()
    opt = KFAC(model, lr=0.2, damping=1e-2, fisher=fisher, loss_func=CE, inverse_every=2)
    probe = torch.randn(5, 4)
    for X, y in data:
        opt.zero_grad()
        out = model(X)
        if stray == "before-backward-no-grad":
            with torch.no_grad():
                model(probe)
        elif stray == "before-backward-eval":
            model.eval()
            model(probe)
            model.train()
        CE(out, y).backward()
        opt.step()
        if stray == "after-step":
            with torch.no_grad():
                model(probe)
            model.eval()
            model(probe)  # eval forward with a graph, never backpropagated
            model.train()
            model(probe).sum()  # a train forward with a graph that is never used
    return params(model), opt


@pytest.mark.parametrize("fisher", ["empirical", "type-2", "mc"])
def test_eval_and_no_grad_forwards_after_step_change_nothing(fisher):
    data = [batch(seed=s) for s in range(4)]
    clean, clean_opt = _run_with_stray_forwards(fisher, None, data)
    stray, stray_opt = _run_with_stray_forwards(fisher, "after-step", data)
    if fisher != "mc":  # the unused train forward has no backward: dropped
        assert all(torch.equal(p, q) for p, q in zip(clean, stray))
        assert_factors_equal(stray_opt.factors(), clean_opt.factors())
    else:  # mc: its curvature backward drew other samples; the first layer's A is exact
        A = clean_opt.factors()["0"][0]
        torch.testing.assert_close(stray_opt.factors()["0"][0], A, atol=0, rtol=0)


def _stray_grad_forwards(make, stray, steps=3):
    """A loop with forwards that have a graph but no backward: a training accuracy on
    another batch before the training forward, a validation loss with ``loss_func`` after
    the backward (both without ``torch.no_grad()``)."""
    model = mlp()
    opt = make(model)
    for seed in range(steps):
        X, y = batch(seed=seed)
        Xv, yv = batch(N=7, seed=100 + seed)
        Xv = Xv * 10.0  # other inputs: counted, they would change A
        opt.zero_grad()
        if stray:
            (model(Xv).argmax(1) == yv).float().mean()
        loss = CE(model(X), y)
        loss.backward()
        if stray:
            CE(model(Xv), yv).item()
        opt.step()
    return params(model), opt


STRAY_MAKERS = {
    "KFAC": lambda m, f: curvature.KFAC(m, lr=0.2, damping=1e-2, fisher=f, loss_func=CE),
    "EKFAC": lambda m, f: curvature.EKFAC(m, lr=0.2, damping=1e-2, fisher=f, loss_func=CE),
    "DiagonalNaturalGradient": lambda m, f: curvature.DiagonalNaturalGradient(
        m, lr=0.2, damping=1e-2, fisher=f, loss_func=CE
    ),
    "KFAC-quadratic": lambda m, f: curvature.KFAC(
        m, fisher=f, loss_func=CE, update_rule="quadratic", damping_adaptation_interval=1
    ),
}


@pytest.mark.parametrize(
    "name, fisher",
    [
        (n, f)
        for n in STRAY_MAKERS
        for f in ("type-2", "mc")
        if (n, f) != ("DiagonalNaturalGradient", "mc")
    ],
)
def test_a_forward_that_no_backward_reaches_is_not_counted(name, fisher):
    """The curvature backward of mc / type-2 runs at the end of every training forward;
    only the forwards that a backward then reaches count (a training accuracy or a
    validation loss computed with gradients on must not), with the quadratic rule's
    losses and Gauss-Newton products too."""
    clean, clean_opt = _stray_grad_forwards(lambda m: STRAY_MAKERS[name](m, fisher), False)
    got, opt = _stray_grad_forwards(lambda m: STRAY_MAKERS[name](m, fisher), True)
    if fisher == "type-2":  # no sampling: the same steps
        assert all(torch.equal(p, q) for p, q in zip(clean, got))
    if hasattr(opt, "factors"):  # mc: other samples drawn; the first layer's A is exact
        A = clean_opt.factors()["0"][0]
        torch.testing.assert_close(opt.factors()["0"][0], A, atol=0, rtol=0)
        if fisher == "type-2":
            assert_factors_equal(opt.factors(), clean_opt.factors())


@pytest.mark.parametrize("stray", ["before-backward-no-grad", "before-backward-eval"])
@pytest.mark.parametrize("fisher", ["type-2", "rademacher"])
def test_stray_forward_between_forward_and_backward(fisher, stray):
    """A target computed with the same model under no_grad / in eval mode (as in DQN or
    self-distillation) between the training forward and its backward."""
    data = [batch(seed=s) for s in range(4)]
    clean, clean_opt = _run_with_stray_forwards(fisher, None, data)
    got, opt = _run_with_stray_forwards(fisher, stray, data)
    assert all(torch.equal(p, q) for p, q in zip(clean, got))
    assert_factors_equal(opt.factors(), clean_opt.factors())


@pytest.mark.parametrize("stray", ["before-backward-no-grad", "before-backward-eval"])
def test_stray_forward_between_forward_and_backward_empirical(stray):
    data = [batch(seed=s) for s in range(4)]
    clean, clean_opt = _run_with_stray_forwards("empirical", None, data)
    got, opt = _run_with_stray_forwards("empirical", stray, data)
    assert_factors_equal(opt.factors(), clean_opt.factors())
    assert all(torch.equal(p, q) for p, q in zip(clean, got))


# -- layers no rule covers -------------------------------------------------------------------------
class BigScale(nn.Module):
    """5000 parameters, no rule: too large for an exact block."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5000))

    def forward(self, x):
        return x * self.scale[: x.shape[-1]]


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_uncovered_layer_gets_the_plain_gradient_and_one_warning(fisher):
    model = nn.Sequential(nn.Linear(4, 6), BigScale(), nn.Tanh(), nn.Linear(6, 3))
    with pytest.warns(UserWarning, match=r"1\.scale.*plain gradient") as record:
        opt = KFAC(model, lr=0.3, damping=1e-2, fisher=fisher, loss_func=CE)
    assert len(record) == 1
    assert opt.uncovered == ["1.scale"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warning while training
        for seed in range(3):
            before = model[1].scale.detach().clone()
            opt.zero_grad()
            CE(model(batch(seed=seed)[0]), batch(seed=seed)[1]).backward()
            grad = model[1].scale.grad.clone()
            opt.step()
            torch.testing.assert_close(
                model[1].scale.detach(), before - 0.3 * grad, atol=1e-7, rtol=0
            )
    assert set(opt.factors()) == {"0", "3"}
    assert finite(model)


def test_uncovered_layer_with_the_diagonal_fallback():
    model = nn.Sequential(nn.Linear(4, 6), BigScale(), nn.Tanh(), nn.Linear(6, 3))
    with pytest.warns(UserWarning, match="diagonal"):
        opt = KFAC(
            model, lr=0.1, damping=1e-2, fisher="type-2", loss_func=CE, unsupported="diagonal"
        )
    before = model[1].scale.detach().clone()
    opt.zero_grad()
    CE(model(batch()[0]), batch()[1]).backward()
    grad = model[1].scale.grad.clone()
    opt.step()
    step = model[1].scale.detach() - before
    assert finite(model)
    used = grad != 0
    assert used.any() and torch.equal(step[~used], torch.zeros_like(step[~used]))
    assert not torch.allclose(step[used], -0.1 * grad[used])  # preconditioned


# -- BatchNorm -------------------------------------------------------------------------------------
def _bn_model():
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("info", optimizer_params())
def test_batchnorm_in_train_mode_is_refused_with_unsupported_error(info):
    """Accepted by default (plain gradient, tests/test_stacks.py); refused by name with
    unsupported='error', since its parameters get no curvature."""
    with pytest.raises(ValueError, match=r"BatchNorm layer\(s\) \('1'\).*eval mode"):
        info.cls(_bn_model(), lr=0.1, damping=1e-2, unsupported="error")


def test_batchnorm_in_eval_mode_is_supported():
    model = _bn_model()
    model[1].eval()
    opt = KFAC(model, lr=0.1, damping=1e-2, fisher="type-2", loss_func=CE)
    for seed in range(3):
        train_step(opt, model, *batch(seed=seed))
    assert finite(model) and "1" in opt.factors()


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_batchnorm_switched_to_train_mode_later_raises(fisher):
    """Built with BatchNorm in eval mode, trained with model.train(): a clear error, never
    silently wrong statistics."""
    model = _bn_model().eval()
    opt = KFAC(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
    model.train()
    with pytest.raises(ValueError, match="BatchNorm1d"):
        train_step(opt, model, *batch())


# -- mixed precision -------------------------------------------------------------------------------
def _autocast_run(cls, fisher, autocast, steps=3):
    model = mlp((4, 8, 3))
    opt = cls(model, lr=0.1, damping=1e-2, fisher=fisher, loss_func=CE)
    for seed in range(steps):
        X, y = batch(seed=seed)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(X)
            loss = CE(out, y)
        if autocast:
            assert out.dtype == torch.bfloat16
        loss.backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize(
    "cls,fisher",
    [v for v in VARIANTS if v.id != "EKFAC-empirical"],
)
def test_bf16_autocast_keeps_float32_factors(cls, fisher):
    model, opt = _autocast_run(cls, fisher, True)
    assert finite(model) and all(p.dtype == torch.float32 for p in model.parameters())
    for A, G in opt.factors().values():
        assert A.dtype == G.dtype == torch.float32
        assert torch.isfinite(A).all() and torch.isfinite(G).all()
    if fisher in ("empirical", "type-2", "forward-only"):  # deterministic: compare to float32
        _, ref = _autocast_run(cls, fisher, False, steps=1)
        _, one = _autocast_run(cls, fisher, True, steps=1)
        for k, (A, G) in ref.factors().items():
            torch.testing.assert_close(one.factors()[k][0], A, atol=2e-2, rtol=5e-2)
            torch.testing.assert_close(one.factors()[k][1], G, atol=2e-3, rtol=1e-1)


def test_bf16_autocast_ekfac_empirical():
    model, opt = _autocast_run(EKFAC, "empirical", True)
    assert finite(model)


def _grad_scaler():
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    except (AttributeError, TypeError, RuntimeError) as err:  # pragma: no cover
        pytest.skip(f"no CPU GradScaler in this torch: {err}")
    if not scaler.is_enabled():  # pragma: no cover
        pytest.skip("the CPU GradScaler is disabled in this torch")
    return scaler


def _scaled_step(opt, model, scaler, X, y, poison=False):
    opt.zero_grad()
    scaler.scale(CE(model(X), y)).backward()
    if poison:
        model[0].weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()


def test_grad_scaler_removes_the_loss_scale_and_skips_inf_steps():
    X, y = batch()
    scaler = _grad_scaler()
    model = mlp()
    opt = KFAC(model, lr=0.1, damping=1e-2, fisher="empirical", loss_func=CE, grad_scaler=scaler)
    reference = mlp()
    ref_opt = KFAC(reference, lr=0.1, damping=1e-2, fisher="empirical", loss_func=CE)
    _scaled_step(opt, model, scaler, X, y)
    train_step(ref_opt, reference, X, y)
    assert opt.steps == 1
    assert_factors_equal(opt.factors(), ref_opt.factors(), atol=1e-6, rtol=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
    # inf gradients: scaler.step(optim) skips the step, the scale backs off
    before = params(model)
    _scaled_step(opt, model, scaler, *batch(seed=2), poison=True)
    assert opt.steps == 1 and scaler.get_scale() == 2.0**9
    assert all(torch.equal(p, q) for p, q in zip(params(model), before))
    _scaled_step(opt, model, scaler, *batch(seed=3))
    assert opt.steps == 2 and finite(model)
    assert not torch.equal(params(model)[0], before[0])


def test_grad_scaler_skipped_step_does_not_distort_the_factors():
    X, y = batch()
    scaler = _grad_scaler()
    model = mlp()
    expected = curvature.kfac(copy.deepcopy(model), CE, (X, y), fisher="empirical").factors
    # lr=0: the model, and so the true factors, never change
    opt = KFAC(model, lr=0.0, damping=1e-2, fisher="empirical", loss_func=CE, grad_scaler=scaler)
    _scaled_step(opt, model, scaler, X, y)
    _scaled_step(opt, model, scaler, X, y, poison=True)  # skipped
    _scaled_step(opt, model, scaler, X, y)
    assert_factors_equal(opt.factors(), expected, atol=1e-6, rtol=1e-4)


def test_float64_model_keeps_float64_factors():
    model = mlp(dtype=torch.float64)
    opt = KFAC(model, lr=0.1, damping=1e-2, fisher="type-2", loss_func=CE)
    train_step(opt, model, *batch(dtype=torch.float64))
    assert all(A.dtype == G.dtype == torch.float64 for A, G in opt.factors().values())
    assert bool(torch.isfinite(model[0].weight).all())


# -- damped inverses by Cholesky (KFAC, pi damping) ------------------------------------------------
def _records(opt):
    """The kinds of the blocks' refresh records: CurrentFactors (Cholesky), FactorSnapshot
    (Cholesky where the damping adapts) or Eigen."""
    return {type(b.record).__name__ for b in opt.blocks.values()}


def _type2_kfac(model, cholesky, **kw):
    method = "cholesky" if cholesky else "eigh"
    return KFAC(model, fisher="type-2", loss_func=CE, inverse_method=method, **kw)


def _run_kfac(steps=12, cholesky=True, **kw):
    model, (X, y) = mlp((4, 6, 3), dtype=torch.float64), batch(dtype=torch.float64)
    opt = _type2_kfac(model, cholesky, lr=0.2, damping=1e-3, inverse_every=3, **kw)

    def closure():
        opt.zero_grad()
        loss = CE(model(X), y)
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure) if kw.get("adaptive_damping") else train_step(opt, model, X, y)
    return model, opt


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive damping"])
def test_cholesky_inverses_give_the_steps_of_the_eigendecomposition(adaptive):
    kw = dict(adaptive_damping=True, damping_adaptation_interval=2) if adaptive else {}
    fast, opt = _run_kfac(**kw)
    assert _records(opt) == {"FactorSnapshot" if adaptive else "CurrentFactors"}
    slow, ref = _run_kfac(cholesky=False, **kw)
    assert _records(ref) == {"Eigen"}
    for p, q in zip(fast.parameters(), slow.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-8)


def _grouped_cnn():
    return nn.Sequential(
        nn.Conv2d(4, 6, 3, groups=2),
        nn.Tanh(),
        nn.Conv2d(6, 4, 2, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    )


@pytest.mark.parametrize("arch", ["grouped conv", "tokens"])
def test_cholesky_and_eigendecomposition_agree_on_other_layers(arch):
    g = torch.Generator().manual_seed(3)
    if arch == "tokens":  # logits [N, vocab, S] for targets [N, S]
        make, X = TinyTransformer, torch.randint(0, 11, (6, 5), generator=g)
        y = torch.randint(0, 11, (6, 5), generator=g)
    else:
        make, X = _grouped_cnn, torch.randn(6, 4, 6, 6, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (6,), generator=g)
    runs = []
    for cholesky in (True, False):
        torch.manual_seed(0)
        model = make().double()
        opt = _type2_kfac(model, cholesky, lr=0.1, damping=1e-2, inverse_every=2)
        for _ in range(5):
            train_step(opt, model, X, y)
        assert _records(opt) == ({"CurrentFactors"} if cholesky else {"Eigen"})
        runs.append(model)
        opt.close()
    for p, q in zip(runs[0].parameters(), runs[1].parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed", "adaptive damping"])
def test_a_failed_inversion_keeps_the_previous_one(adaptive):
    model, (X, y) = mlp(), batch()
    kw = dict(adaptive_damping=True, damping_adaptation_interval=100) if adaptive else {}
    opt = KFAC(model, lr=0.1, damping=1e-2, fisher="type-2", loss_func=CE, inverse_every=2, **kw)

    def closure():
        opt.zero_grad()
        loss = CE(model(X), y)
        loss.backward()
        return loss

    def step():
        opt.step(closure) if adaptive else train_step(opt, model, X, y)

    for _ in range(3):
        step()
    kept = {k: b.record for k, b in opt.blocks.items()}
    assert {type(r).__name__ for r in kept.values()} == {
        "FactorSnapshot" if adaptive else "CurrentFactors"
    }
    v = [torch.randn(p.shape, dtype=p.dtype) for p in model.parameters()]
    before = opt.inverse_matvec(v)
    for b in opt.blocks.values():  # running factors gone non-finite (e.g. an overflow)
        b.A.view(-1)[0] = float("nan")
    with pytest.warns(UserWarning, match="keeping the previous one"):
        for _ in range(2):  # one of them refreshes
            step()
    assert all(opt.blocks[k].record is r for k, r in kept.items())
    assert finite(model)
    # the previous inverses themselves (without a snapshot: a CPU refresh wrote no new
    # inverse over them), or taken again from the kept snapshots
    for a, b in zip(opt.inverse_matvec(v), before):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


def test_a_first_failed_inversion_raises(monkeypatch):
    model, (X, y) = mlp(), batch()
    real = curvature.blocks.refresh.damped_inverses_or_errors

    def broken(mats, shifts, *, names, also=(), **kw):  # every factor reads as non-finite
        out = real(mats, shifts, names=names, also=also, **kw)
        errors = [RuntimeError(curvature.linalg.non_finite_message(n)) for n in names]
        return errors + out[len(mats) :]

    monkeypatch.setattr(curvature.blocks.refresh, "damped_inverses_or_errors", broken)
    fresh = KFAC(model, lr=0.1, damping=1e-2, fisher="type-2", loss_func=CE)
    with pytest.raises(RuntimeError, match="failed repeatedly.*non-finite entries"):
        train_step(fresh, model, X, y)


def test_a_pi_damping_state_loads_into_exact_damping():
    model, opt = _run_kfac(steps=4)
    other = KFAC(model, lr=0.2, damping=1e-3, damping_mode="exact", fisher="type-2", loss_func=CE)
    other.load_state_dict(opt.state_dict())
    X, y = batch(dtype=torch.float64)
    train_step(other, model, X, y)
    assert _records(other) == {"Eigen"}
    assert finite(model)
