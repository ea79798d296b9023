"""A step's statistics are judged and zeroed in place where the library made them.

The optimizers skip a non-finite contribution without a host read: its values are zeroed
(in place where they are new tensors of a built-in rule, by a select into new tensors
otherwise) and the running factors keep their values. These tests check that skipping
leaves the factors exactly as they were, that the next finite step continues as if the
skipped one had not happened, and that the tensors a rule of one's own returns (which
it may keep) are never written.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import curvature
from curvature.layers import register, registered_rule

CE = nn.CrossEntropyLoss()


class CachedLinear(nn.Linear):
    """An ``nn.Linear`` whose rule (below) returns the same ``A`` tensor every call."""


@register(CachedLinear)
class CachedARule(type(registered_rule(nn.Linear(1, 1)))):
    """A rule of one's own (``nn.Linear``'s, but it keeps its first ``A`` sum and returns
    that tensor every time)."""

    def __init__(self):
        super().__init__()
        self.kept = {}

    def kfac_factors(self, module, calls, approx, with_g=True):
        out = super().kfac_factors(module, calls, approx, with_g)
        A, G, count = out[""]
        A = self.kept.setdefault(id(module), A)  # the same tensor from now on
        return {"": (A, G, count)}


def _data(seed: int, nan: bool = False):
    g = torch.Generator().manual_seed(seed)
    X, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    if nan:
        X[3, 1] = float("nan")
    return X, y


def _step(model, opt, X, y):
    opt.zero_grad()
    CE(model(X), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the non-finite update's warning
        opt.step()


def _factors(opt):
    return {k: (A.clone(), G.clone()) for k, (A, G) in opt.factors().items()}


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_a_non_finite_step_leaves_the_factors_as_they_were(cls, fisher):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = cls(model, lr=1e-2, damping=1e-2, loss_func=CE, fisher=fisher, inverse_every=2)
    for seed in range(3):
        _step(model, opt, *_data(seed))
    before = _factors(opt)
    skipped = opt.skipped_statistics
    _step(model, opt, *_data(10, nan=True))
    assert opt.skipped_statistics == skipped + 2  # one contribution per layer
    after = _factors(opt)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k][0], after[k][0]) and torch.equal(before[k][1], after[k][1])
    _step(model, opt, *_data(11))  # finite again: the factors move, and stay finite
    moved = _factors(opt)
    assert all(torch.isfinite(A).all() and torch.isfinite(G).all() for A, G in moved.values())
    assert any(not torch.equal(before[k][0], moved[k][0]) for k in before)


def test_the_factors_equal_a_run_without_the_skipped_step():
    """Skipping changes nothing but the step counter: the EMA continues from the same state."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    twin = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    twin.load_state_dict(model.state_dict())
    kw = dict(lr=0.0, damping=1e-2, inverse_every=1000)  # lr 0: the same parameters
    a, b = curvature.KFAC(model, **kw), curvature.KFAC(twin, **kw)
    for seed in range(3):
        _step(model, a, *_data(seed))
        _step(twin, b, *_data(seed))
    _step(model, a, *_data(10, nan=True))
    _step(model, a, *_data(4))
    _step(twin, b, *_data(4))
    fa, fb = _factors(a), _factors(b)
    for k in fa:
        assert torch.equal(fa[k][0], fb[k][0]) and torch.equal(fa[k][1], fb[k][1])


def test_a_rules_own_tensors_are_not_written_by_a_skipped_step():
    torch.manual_seed(0)
    model = nn.Sequential(CachedLinear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = curvature.KFAC(model, lr=1e-2, damping=1e-2, inverse_every=1)
    _step(model, opt, *_data(0))
    rule = registered_rule(model[0])
    kept = rule.kept[id(model[0])]
    copy = kept.clone()
    _step(model, opt, *_data(10, nan=True))  # G is not finite: the contribution is skipped
    assert torch.equal(kept, copy)  # the rule's tensor is as it was
    _step(model, opt, *_data(1))
    assert torch.equal(kept, copy)
    A, _ = opt.factors()["0"]
    assert torch.isfinite(A).all() and torch.allclose(A, copy / 16)


@pytest.mark.parametrize("skipped", [1, 2])
def test_ekfac_corrections_equal_a_run_without_the_skipped_step(skipped):
    """The first corrections (step 1) or later ones skipped: as if the step had not been."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    twin = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    twin.load_state_dict(model.state_dict())
    kw = dict(lr=0.0, damping=1e-2, inverse_every=1000)  # one eigenbasis, from step 0
    a, b = curvature.EKFAC(model, **kw), curvature.EKFAC(twin, **kw)
    for i in range(5):
        _step(model, a, *_data(i, nan=i == skipped))
        if i != skipped:
            _step(twin, b, *_data(i))
    blocks_a = a.state_dict()["curvature"]["blocks"]
    blocks_b = b.state_dict()["curvature"]["blocks"]
    assert blocks_a.keys() == blocks_b.keys() and blocks_a
    for k in blocks_a:
        ca, cb = blocks_a[k]["corrections"], blocks_b[k]["corrections"]
        assert ca is not None and torch.equal(ca, cb)


def test_a_non_finite_step_leaves_the_fisher_diagonals_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = curvature.DiagonalNaturalGradient(model, lr=1e-2, damping=1e-2, inverse_every=2)
    for seed in range(3):
        _step(model, opt, *_data(seed))

    def diagonals():
        return {k: v["d"].clone() for k, v in opt.state_dict()["curvature"]["diagonals"].items()}

    before = diagonals()
    _step(model, opt, *_data(10, nan=True))
    after = diagonals()
    assert before.keys() == after.keys() and before
    assert all(torch.equal(before[k], after[k]) for k in before)
    _step(model, opt, *_data(11))
    moved = diagonals()
    assert all(torch.isfinite(d).all() for d in moved.values())
    assert any(not torch.equal(before[k], moved[k]) for k in before)


def test_kfac_function_divides_only_the_librarys_sums_in_place():
    """``curvature.kfac()`` divides ``A_sum`` by the count in place where a built-in rule
    made it (one pass, no allocation) and into a new tensor for a rule of one's own: the
    kept tensor stays the sum, and two calls give the same ``A`` (the in-place twin would
    divide it twice)."""
    torch.manual_seed(0)
    model = nn.Sequential(CachedLinear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    X, y = _data(0)
    first = curvature.kfac(model, CE, (X, y), fisher="empirical")
    rule = registered_rule(model[0])
    kept = rule.kept[id(model[0])].clone()
    second = curvature.kfac(model, CE, (X, y), fisher="empirical")
    assert torch.equal(rule.kept[id(model[0])], kept)  # never written
    for a, b in zip(first.blocks, second.blocks):
        assert torch.equal(a.A, b.A)
    # the built-in rule's sum: A equals the dense mean of [x | 1] [x | 1]^T over the batch
    with torch.no_grad():
        h = torch.tanh(model[0](X))
    a = torch.cat([h, torch.ones(16, 1)], 1)
    torch.testing.assert_close(first.blocks[1].A[0], a.T @ a / 16)


def test_large_gram_statistics_on_a_cpu_are_zeroed_in_place():
    """A layer whose ``A`` takes the CPU's block-triangle Gram (``[256, 785]`` inputs with
    the bias column: ``M D^2`` above ``TRIANGLE_GRAM_WORK``) gets a 3-d sum of its own,
    which the flush zeroes in place (a product with the flag): no ``where`` into a new
    ``785 x 785`` tensor in any step (that select cost 0.50-0.73 against 0.24-0.30 ms there). A
    non-finite step still leaves the factors as they were."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from curvature.layers import precision

    class Selects(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.large = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("where"):
                self.large += any(isinstance(a, torch.Tensor) and a.numel() > 10**5 for a in args)
            return func(*args, **(kwargs or {}))

    assert 256 * 785**2 >= precision.TRIANGLE_GRAM_WORK and "cpu" in precision.TRIANGLE_GRAM_DEVICES
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))
    opt = curvature.KFAC(model, lr=1e-2, inverse_every=2)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(256, 784, generator=g), torch.randint(0, 10, (256,), generator=g)
    _step(model, opt, X, y)
    selects = Selects()
    with selects:
        _step(model, opt, X, y)
    assert selects.large == 0
    before = _factors(opt)
    X[0, 0] = float("nan")
    _step(model, opt, X, y)
    for k, (A, G) in _factors(opt).items():
        assert torch.equal(A, before[k][0]) and torch.equal(G, before[k][1])


class _Mixed(nn.Module):
    """An embedding, a LayerNorm (an exact block), a Linear and a convolution on 1x1 maps
    (its diagonal and EKFAC's corrections: one GEMM of squares)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.ln = nn.LayerNorm(6)
        self.conv = nn.Conv2d(6, 5, 3, padding=1)
        self.fc = nn.Linear(5, 3)

    def forward(self, tokens):
        h = self.ln(self.emb(tokens)).mean(1)  # [N, 6]
        h = torch.tanh(self.conv(h[:, :, None, None]))  # [N, 5, 1, 1]
        return self.fc(h.flatten(1))


@pytest.mark.parametrize(
    "cls, options",
    [
        (curvature.KFAC, {}),
        (curvature.EKFAC, {}),
        (curvature.DiagonalNaturalGradient, {}),
        (curvature.KFAC, {"max_factor_size": 8}),  # one-sided blocks: a diagonal side
        (curvature.EKFAC, {"max_factor_size": 8}),
    ],
)
def test_the_library_rules_statistics_are_never_selected_into_copies(cls, options):
    """Every built-in rule's statistics (an embedding's factors, an exact block's ``G``, a
    1x1-map convolution's diagonal and eigenvalue corrections, one-sided blocks' sides
    with ``max_factor_size``) are tensors of their
    own, zeroed in place by the flush: a step on a CPU makes no ``where`` on a matrix
    (each one was an allocation and a pass per step)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Selects(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("where"):
                self.shapes += [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = _Mixed()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the one-sided blocks' notice)
        opt = cls(model, lr=1e-2, damping=1e-2, inverse_every=2, **options)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randint(0, 11, (16, 4), generator=g), torch.randint(0, 3, (16,), generator=g)
    for _ in range(3):  # EKFAC's corrections need a basis: from the second step on
        _step(model, opt, X, y)
    selects = Selects()
    with selects:
        _step(model, opt, X, y)
    # (a where over the [K] vector of the blocks' flags is the EMA weights': 1-d)
    assert [s for s in selects.shapes if len(s) >= 2] == []
