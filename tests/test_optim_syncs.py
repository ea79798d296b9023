"""Host synchronizations and aten calls of an optimizer step, counted on CPU.

On a GPU every read of a device value by the host (``item``, ``tolist``, ``bool(t)``,
``float(t)``, ``.cpu()``, ``nonzero``...) waits for the device, and every aten call is
a kernel launch of several microseconds. Both are counted here on CPU: a
``TorchFunctionMode`` sees every host read, a ``TorchDispatchMode`` every aten call.
Targets (issue 17): no host synchronization in a step without a refresh, at most two
in a refresh step and in a ``curvature.kfac()`` call; aten calls of a training step at
most 1.5x (KFAC empirical), 1.8x (mc), 2x (EKFAC), 1.3x (DiagonalNaturalGradient)
AdamW's (see docs/benchmarks.md).
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
from step_counts import CE as STEP_CE  # noqa: E402
from step_counts import AtenCalls, HostReads, as_on_cuda, per_step  # noqa: E402

CE = nn.CrossEntropyLoss()


#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def mlp(depth=2):
    torch.manual_seed(0)
    layers, sizes = [], [6] + [8] * depth + [4]
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers += ([nn.Tanh()] if i else []) + [nn.Linear(a, b)]
    return nn.Sequential(*layers)


def reads_per_step(cls, accumulate=1, steps=3, depth=2, counter=HostReads, **kwargs):
    model = mlp(depth)
    opt = cls(model, loss_func=CE, **{"lr": 0.01, "inverse_every": 1000, **kwargs})
    g = torch.Generator().manual_seed(0)

    def step():
        opt.zero_grad()
        for _ in range(accumulate):
            X, y = torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g)
            (CE(model(X), y) / accumulate).backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            step()
        with counter() as reads:
            for _ in range(steps):
                step()
    return reads.count / steps, reads.where


STEPS = [
    dict(),
    dict(fisher="mc"),
    dict(fisher="type-2"),
    dict(kl_clip=1e-3),
    dict(fisher="mc", kl_clip=1e-3, momentum=0.9, weight_decay=1e-2),
    dict(momentum=0.9, weight_decay=1e-2, accumulate=2),
    dict(fisher="mc", accumulate=3, kl_clip=1e-2),
]
OPTIMIZERS = [curvature.KFAC, curvature.EKFAC, curvature.DiagonalNaturalGradient]


@pytest.mark.parametrize("kwargs", STEPS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
@pytest.mark.parametrize("cls", OPTIMIZERS, ids=lambda c: c.__name__)
def test_a_step_without_refresh_reads_nothing_from_the_device(cls, kwargs):
    count, where = reads_per_step(cls, **kwargs)
    assert count == 0, dict(where)


def test_the_counter_sees_host_reads():
    with HostReads() as reads:
        t = torch.ones(3)
        bool(t.sum() > 0), t.tolist(), float(t[0]), t[t > 0], t.repeat_interleave(t.long())
    assert reads.count == 5


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (curvature.KFAC, {}),
        (curvature.KFAC, {"fisher": "mc", "kl_clip": 1e-3, "momentum": 0.9}),
        (curvature.KFAC, {"damping_mode": "exact"}),
        (curvature.KFAC, {"inverse_method": "eigh"}),
        (curvature.EKFAC, {"fisher": "mc"}),
        (curvature.DiagonalNaturalGradient, {}),
    ],
)
@pytest.mark.parametrize("depth", [1, 5])
def test_a_refresh_step_reads_the_device_at_most_twice(cls, kwargs, depth):
    count, where = reads_per_step(cls, inverse_every=1, depth=depth, **kwargs)
    assert count <= 2, dict(where)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (curvature.KFAC, {}),
        (curvature.KFAC, {"damping_mode": "exact"}),
        (curvature.EKFAC, {}),
        (curvature.EKFAC, {"fisher": "mc"}),
        (curvature.DiagonalNaturalGradient, {}),
    ],
)
@pytest.mark.parametrize("depth", [1, 5])
def test_a_refresh_step_would_synchronize_a_gpu_at_most_twice(cls, kwargs, depth):
    """The host reads plus the decompositions that read their error codes on a GPU
    (``torch.linalg.eigh``, one per batched call), grouped as on CUDA: EKFAC's refresh
    reads once and decomposes the MLP's factor sizes (7, 9, 8, 4) in one padded call."""
    with as_on_cuda():
        count, where = reads_per_step(
            cls, inverse_every=1, depth=depth, counter=lambda: HostReads(checked=True), **kwargs
        )
    assert count <= 2, dict(where)


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
def test_a_refresh_with_one_sided_blocks_would_synchronize_a_gpu_at_most_twice(cls):
    """A token model whose embedding and head exceed ``max_factor_size`` (one-sided
    blocks: the embedding's ``G`` 8 x 8 and the head's ``A`` 9 x 9 full): their full
    sides are decomposed in one call with the Kronecker blocks' read, KFAC's snapshots
    and Cholesky outcomes in one read (4 synchronizations before: 2 reads, 2 calls)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(40, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 40))
    opt = cls(model, loss_func=CE, lr=0.01, inverse_every=1, max_factor_size=16)
    g = torch.Generator().manual_seed(0)

    def step():
        tokens = torch.randint(0, 40, (3, 5), generator=g)
        opt.zero_grad()
        CE(model(tokens).flatten(0, 1), torch.randint(0, 40, (15,), generator=g)).backward()
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step()
        with as_on_cuda(), HostReads(checked=True) as reads:
            step()
    assert reads.count <= 2, dict(reads.where)


def test_the_gpu_count_sees_each_decomposition_call():
    """``HostReads(checked=True)`` counts each ``torch.linalg.eigh`` call; a CPU run
    groups by shape, ``as_on_cuda`` pads sizes into one call (one read in both)."""
    from curvature.linalg import eighs

    mats = [torch.eye(n, dtype=torch.float64) * (1 + n) for n in (3, 4, 5)]
    with HostReads(checked=True) as cpu:
        eighs(mats, ["a", "b", "c"])
    with as_on_cuda(), HostReads(checked=True) as gpu:
        got = eighs(mats, ["a", "b", "c"])
    assert (cpu.count, gpu.count) == (1 + 3, 1 + 1)
    for (evals, _), n in zip(got, (3, 4, 5)):
        torch.testing.assert_close(evals, torch.full((n,), 1.0 + n, dtype=torch.float64))


@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
def test_a_kfac_call_reads_the_device_at_most_twice(fisher):
    model = mlp(3)
    X, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    with HostReads() as reads:
        curvature.kfac(model, CE, (X, y), fisher=fisher)
    assert reads.count <= 2, dict(reads.where)


def test_skipped_updates_are_warned_when_the_counter_is_read():
    model = mlp()
    opt = curvature.KFAC(model, lr=0.1, loss_func=CE)
    X, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    CE(model(X), y).backward()
    opt.step()
    X[0, 0] = float("nan")
    opt.zero_grad()
    CE(model(X), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # nothing read: no warning yet
    with pytest.warns(UserWarning, match="non-finite update for .*'0.weight'"):
        assert opt.skipped_statistics == 3  # one contribution per layer
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


# -- aten calls per training step ------------------------------------------------------------------
def aten_calls_per_step(make, steps=2):
    """Aten calls per training step of the benchmark's MLP (benchmarks/step_counts.py)."""
    return per_step(make, AtenCalls, steps)


#: aten calls per training step against ``AdamW(foreach=True)`` (75 with torch 2.13): issue
#: 17's targets (on the benchmark's MLP: KFAC empirical 112 calls, 1.49x; mc 134, 1.79x;
#: EKFAC 149, 1.99x; DiagonalNaturalGradient 97, 1.29x, as benchmarks/step_counts.py counts
#: them; until 2026-11-28 this test counted 3 calls fewer, its optimizers watching another
#: loss module than the step called), so that a regression fails
#: (benchmarks/step_counts.py, docs/benchmarks.md).
ATEN_RATIO = {  # (loss_func: the module per_step's loop calls)
    "KFAC-empirical": (lambda m: curvature.KFAC(m, loss_func=STEP_CE, inverse_every=1000), 1.5),
    "KFAC-mc": (
        lambda m: curvature.KFAC(m, loss_func=STEP_CE, fisher="mc", inverse_every=1000),
        1.8,
    ),
    "EKFAC": (lambda m: curvature.EKFAC(m, loss_func=STEP_CE, inverse_every=1000), 2.0),
    "DiagonalNaturalGradient": (
        lambda m: curvature.DiagonalNaturalGradient(m, loss_func=STEP_CE, inverse_every=1000),
        1.3,
    ),
}


@pytest.mark.parametrize("name", list(ATEN_RATIO))
def test_the_counted_optimizers_watch_the_loss_the_step_calls(name):
    # per_step's loop calls step_counts.CE: an optimizer registered with another loss
    # module never runs its per-step loss hooks (the empirical Fisher's ignore_index
    # check, 3 aten calls), and its count is low (109 against the benchmark's 112)
    opt = ATEN_RATIO[name][0](nn.Linear(3, 2))
    assert opt.loss_func is STEP_CE


@pytest.mark.parametrize("name", list(ATEN_RATIO))
def test_aten_calls_per_step_do_not_grow(name):
    make, limit = ATEN_RATIO[name]
    adamw = aten_calls_per_step(lambda m: torch.optim.AdamW(m.parameters(), foreach=True))
    ours = aten_calls_per_step(make)
    assert ours / adamw <= limit + 1e-9, (ours, adamw)


# -- sampling on the device ------------------------------------------------------------------------
def _mc_run(device, steps, state=None):
    model = mlp().to(device)
    opt = curvature.KFAC(model, lr=0.05, loss_func=CE, fisher="mc", inverse_every=2, seed=3)
    if state is not None:
        model.load_state_dict(state[0])
        opt.load_state_dict(state[1])
    g = torch.Generator().manual_seed(7)
    data = [
        (torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g)) for _ in range(6)
    ]
    for X, y in data[len(data) - steps :] if state is not None else data[:steps]:
        opt.zero_grad()
        CE(model(X.to(device)), y.to(device)).backward()
        opt.step()
    return model, opt


def test_the_labels_are_drawn_from_the_optimizers_seeded_generators():
    # the optimizers hand the losses an object whose on(device) is that device's generator;
    # on CPU it is the optimizer's own generator, as before
    model = mlp()
    opt = curvature.KFAC(model, loss_func=CE, fisher="mc", seed=4)
    out, y = model(torch.randn(5, 6)), torch.randint(0, 4, (5,))
    sources = curvature.losses.backprop_sources
    state = opt.generator.get_state()
    generators = curvature.rng.SamplingGenerators(opt.generator)
    with_object = sources(CE, out, y, "mc", generator=generators)
    opt.generator.set_state(state)
    with_generator = sources(CE, out, y, "mc", generator=opt.generator)
    assert torch.equal(with_object, with_generator)
    assert opt.state_dict()["curvature"]["device_generators"] == {}


def test_a_state_without_device_generators_loads():
    model, opt = _mc_run("cpu", 3)
    state = opt.state_dict()
    del state["curvature"]["device_generators"]  # saved by an earlier version
    other = curvature.KFAC(mlp(), loss_func=CE, fisher="mc", inverse_every=2, seed=3)
    other.load_state_dict(state)
    assert torch.equal(other.generator.get_state(), opt.generator.get_state())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_without_refresh_on_cuda_passes_the_sync_debug_mode():
    model, opt = _mc_run("cuda", 3)  # steps 0-2; the next refresh is at step 4
    X, y = torch.randn(5, 6, device="cuda"), torch.randint(0, 4, (5,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.zero_grad()
        CE(model(X), y).backward()
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mc_steps_on_cuda_sync_nothing_and_resume_bit_for_bit():
    model, opt = _mc_run("cuda", 3)
    state = (
        {k: v.clone() for k, v in model.state_dict().items()},
        opt.state_dict(),
    )
    assert list(state[1]["curvature"]["device_generators"]) == ["cuda:0"]
    full, _ = _mc_run("cuda", 6)
    resumed, _ = _mc_run("cuda", 3, state)
    for p, q in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_a_block_with_only_non_finite_statistics_is_not_saved():
    model = mlp()
    opt = curvature.KFAC(model, lr=0.1, loss_func=CE)
    X, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
    X[0, 0] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CE(model(X), y).backward()
        opt.step()
    assert opt.factors() == {} and opt.state_dict()["curvature"]["blocks"] == {}
    other = curvature.KFAC(mlp(), lr=0.1, loss_func=CE)
    other.load_state_dict(opt.state_dict())
    assert other.factors() == {}


# -- preconditioning through persistent buffers ----------------------------------------------------
class _Net(nn.Module):
    """A grouped convolution (blocks of 2 groups), a Linear and a LayerNorm."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3, groups=2)
        self.norm = nn.LayerNorm(24)
        self.fc = nn.Linear(24, 3)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x).flatten(1)))


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (curvature.KFAC, {"damping_mode": "exact"}),
        (curvature.KFAC, {"damping_mode": "exact", "factor_decay": 0.5}),
        (curvature.EKFAC, {}),
        (curvature.DiagonalNaturalGradient, {}),
    ],
)
def test_preconditioning_inverts_the_damped_curvature_and_keeps_earlier_results(cls, kwargs):
    # every block type (several groups, one group, the diagonal fallback of LayerNorm)
    # goes through the shared gather/scatter buffers: (C + lambda) u = v must hold, and
    # a later call must not change an earlier result
    torch.manual_seed(0)
    model = _Net().double()
    damping = 0.1
    opt = cls(model, lr=0.01, loss_func=CE, damping=damping, inverse_every=2, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):  # a refresh, then a step with new statistics
            opt.zero_grad()
            X, y = torch.randn(7, 4, 4, 4, dtype=torch.float64), torch.randint(0, 3, (7,))
            CE(model(X), y).backward()
            opt.step()
    v1 = [torch.randn_like(p) for p in model.parameters()]
    v2 = [torch.randn_like(p) for p in model.parameters()]
    u1 = opt.inverse_matvec(v1)
    kept = [u.clone() for u in u1]
    u2 = opt.inverse_matvec(v2)
    for u, k in zip(u1, kept):
        assert torch.equal(u, k)
    for u, v in [(u1, v1), (u2, v2)]:
        back = [c + damping * x for c, x in zip(opt.matvec(u), u)]
        for b, x in zip(back, v):
            torch.testing.assert_close(b, x, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "cls,kwargs",
    [
        (curvature.KFAC, {}),
        (curvature.KFAC, {"damping_mode": "exact"}),
        (curvature.DiagonalNaturalGradient, {}),
    ],
)
def test_a_step_inside_autocast_preconditions_in_float32(cls, kwargs):
    # the preconditioning GEMMs write into float32 buffers: autocast is off for them
    # (EKFAC's corrections computed in step() would still autocast: not compared)
    def run(autocast):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
        opt = cls(model, lr=0.01, loss_func=CE, inverse_every=2, **kwargs)
        for _ in range(3):
            X, y = torch.randn(5, 6), torch.randint(0, 4, (5,))
            opt.zero_grad()
            CE(model(X), y).backward()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                opt.step()
        return model

    for p, q in zip(run(True).parameters(), run(False).parameters()):
        assert torch.equal(p, q)


def _cuda_syncs(fn):
    """``fn()`` and the ``file:line`` of each synchronizing CUDA call it made (sync debug)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    sites = [
        f"{w.filename}:{w.lineno}"
        for w in caught
        if "synchronizing CUDA operation" in str(w.message)
    ]
    return out, sites


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fisher", ["type-2", "mc", "empirical"])
def test_kfac_and_diag_ggn_calls_on_cuda_sync_at_most_twice(fisher):
    model = mlp().cuda()
    X, y = torch.randn(5, 6, device="cuda"), torch.randint(0, 4, (5,), device="cuda")
    curvature.kfac(model, CE, (X, y), fisher=fisher)  # warm-up (lazy CUDA initialization)
    K, syncs = _cuda_syncs(lambda: curvature.kfac(model, CE, (X, y), fisher=fisher))
    assert len(syncs) <= 2, syncs
    assert all(A.is_cuda and G.is_cuda for A, G in K.factors.values())
    D, syncs = _cuda_syncs(lambda: curvature.diag_ggn(model, CE, (X, y), fisher))
    assert len(syncs) <= 2, syncs
    if fisher != "mc":  # deterministic: equal to the CPU result
        cpu = curvature.diag_ggn(mlp(), CE, (X.cpu(), y.cpu()), fisher)
        for name, d in D.items():
            torch.testing.assert_close(d.cpu(), cpu[name], rtol=1e-4, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kfac_mc_on_cuda_draws_there_and_repeats_with_its_seed():
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).cuda()
    X, y = torch.randn(4, 5, 6, device="cuda"), torch.randn(4, 5, 3, device="cuda")
    mse = nn.MSELoss()
    first = curvature.kfac(model, mse, (X, y), fisher="mc", seed=1).factors
    again = curvature.kfac(model, mse, (X, y), fisher="mc", seed=1).factors
    other = curvature.kfac(model, mse, (X, y), fisher="mc", seed=2).factors
    for name, (_, G) in first.items():
        assert torch.equal(G, again[name][1])
        assert not torch.equal(G, other[name][1])
