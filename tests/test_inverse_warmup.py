"""``inverse_warmup``: the first steps refresh every step, then every ``inverse_every``.

A refresh of KFAC (pi damping, Cholesky) or EKFAC reads the device once as on a GPU
(the factors' finiteness and the decompositions' outcomes; counted with
``step_counts.as_on_cuda``), a step without one never: the reads of steps 1, 2, ... show
the schedule (step 0 always refreshes). Off by default (the public
contract's ``inverse_every=10`` schedule); docs/optimizers.md ("Defaults and a safe
start") has the measurements.
"""

from __future__ import annotations

import pathlib
import sys
import warnings

import pytest
import torch
from torch import nn

import curvature

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from step_counts import HostReads, as_on_cuda  # noqa: E402

CE = nn.CrossEntropyLoss()


#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))


def reads_per_step(opt, model, steps=6):
    g = torch.Generator().manual_seed(0)
    counts = []
    for _ in range(steps):
        X, y = torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g)
        with as_on_cuda(), HostReads() as reads:
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()
        counts.append(reads.count)
    return counts[1:]  # (the first step also reads what the structure needs)


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
@pytest.mark.parametrize("warmup,expected", [(0, [0, 0, 0, 0, 0]), (3, [1, 1, 0, 0, 0])])
def test_the_first_steps_refresh_every_step(cls, warmup, expected):
    model = mlp()
    opt = cls(model, lr=0.05, loss_func=CE, inverse_every=1000, inverse_warmup=warmup)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert reads_per_step(opt, model) == expected


def test_a_refresh_period_shorter_than_the_warmup_keeps_its_own_refreshes():
    model = mlp()
    opt = curvature.KFAC(model, lr=0.05, loss_func=CE, inverse_every=4, inverse_warmup=2)
    assert reads_per_step(opt, model, steps=9) == [1, 0, 0, 1, 0, 0, 0, 1]  # steps 1-8


def test_the_default_is_off():
    assert curvature.KFAC(mlp(), loss_func=CE).config.inverse_warmup == 0
    model = mlp()
    opt = curvature.KFAC(model, lr=0.05, loss_func=CE, inverse_every=1000)
    assert reads_per_step(opt, model, steps=3) == [0, 0]


@pytest.mark.parametrize("value", [-1, 2.5, True, "10"])
def test_a_bad_warmup_is_refused(value):
    with pytest.raises(ValueError, match="inverse_warmup"):
        curvature.KFAC(mlp(), loss_func=CE, inverse_warmup=value)


def test_a_resumed_run_continues_the_warmup_bit_for_bit():
    """The warm-up follows ``optim.steps``, which the state restores: two steps, a save,
    three more in a new optimizer equal five uninterrupted steps."""
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g))]
    batches *= 5
    kw = dict(lr=0.05, damping=1e-2, loss_func=CE, inverse_every=1000, inverse_warmup=4)

    def run(opt, model, todo):
        for X, y in todo:
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()

    whole = mlp()
    run(curvature.KFAC(whole, **kw), whole, batches)
    first = mlp()
    opt = curvature.KFAC(first, **kw)
    run(opt, first, batches[:2])
    state = opt.state_dict()
    opt.close()
    resumed = curvature.KFAC(first, **kw)
    resumed.load_state_dict(state)
    run(resumed, first, batches[2:])
    for p, q in zip(first.parameters(), whole.parameters()):
        assert torch.equal(p, q)
