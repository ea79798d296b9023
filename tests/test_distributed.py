"""Distributed KFAC / EKFAC: 2 gloo processes on CPU against one process on the union.

The ranks run in subprocesses spawned by the tests (``distributed_worker.py``), all
scenarios in one launch; the references run here, without torch.distributed.
"""

import pytest
import torch
import torch.distributed as dist
from distributed_worker import (
    SCENARIOS,
    make_model,
    reference,
    reference_wide,
    spawn,
    union_batch,
)

import curvature

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)
TOL = dict(atol=1e-10, rtol=0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(str(tmp_path_factory.mktemp("dist")), "scenarios")


def assert_params(a, b, **tol):
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, **(tol or TOL))


def assert_factors(a, b):
    assert set(a) == set(b)
    for k in a:
        for x, y in zip(
            a[k] if isinstance(a[k], tuple) else (a[k],),
            b[k] if isinstance(b[k], tuple) else (b[k],),
        ):
            torch.testing.assert_close(x, y, **TOL)


@pytest.mark.parametrize("name", [n for n in SCENARIOS if not n.startswith("broken")])
def test_two_ranks_match_one_process_on_the_union(ranks, name):
    ref = reference(name)
    for r in range(2):
        assert_params(ranks[r][name]["params"], ref["params"])
        assert_factors(ranks[r][name]["factors"], ref["factors"])
    start = [p.detach() for p in make_model().parameters()]
    moved = max(float((p - q).abs().max()) for p, q in zip(ref["params"], start))
    assert moved > 1e-2  # the comparison is not vacuous


def test_ekfac_with_rank_deficient_factors_matches_one_process(ranks):
    """8 samples a step against 12 inputs and 16 hidden units: at the first refresh both
    factors of the first layer have a null space, which later batches reach. Its basis
    is canonical (a function of the space), so the all-reduce's rounding does not pick
    another one: before, the ranks ended 0.04-1 away from the single process."""
    ref = reference_wide()
    for r in range(2):
        assert_params(ranks[r]["ekfac-rank-deficient"]["params"], ref["params"], atol=1e-9, rtol=0)


def test_the_comparison_catches_unreduced_statistics(ranks):
    """``distributed=False`` under DDP: gradients averaged, factors per rank; must differ."""
    ref = reference("broken-unreduced")
    for r in range(2):
        with pytest.raises(AssertionError):
            assert_factors(ranks[r]["broken-unreduced"]["factors"], ref["factors"])
        with pytest.raises(AssertionError):
            assert_params(ranks[r]["broken-unreduced"]["params"], ref["params"])


def test_ranks_communicate_statistics_and_split_decompositions(ranks):
    plain, ddp = ranks[0]["kfac-empirical-plain"]["bytes"], ranks[0]["kfac-empirical-ddp"]["bytes"]
    assert plain["gradients"] > 0 and "gradients" not in ddp  # DDP averages the gradients
    # pi damping: every rank inverts its (identical) factors by Cholesky, nothing to share
    assert ddp["statistics"] > 0 and "decompositions" not in ddp
    # eigendecompositions (exact damping, EKFAC) are split over the ranks and shared
    for name in ("kfac-type2-exact-ddp", "ekfac-empirical-ddp"):
        assert ranks[0][name]["bytes"]["decompositions"] > 0
    assert "decompositions" not in ranks[0]["kfac-type2-plain-all"]["bytes"]
    assert ranks[0]["kfac-type2-owner"]["bytes"]["directions"] > 0


def test_factors_after_one_step_are_the_union_batch_factors(ranks):
    X, y = union_batch(0)
    offline = curvature.kfac(make_model(), torch.nn.CrossEntropyLoss(), (X, y), fisher="type-2")
    for r in range(2):
        assert_factors(ranks[r]["one-step-factors"], offline.factors)


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
def test_no_sync_accumulation_counts_every_micro_batch_once(ranks, fisher):
    ref = reference("kfac-empirical-ddp" if fisher == "empirical" else "kfac-type2-ddp")
    for r in range(2):
        assert_params(ranks[r][f"accumulate-{fisher}"]["params"], ref["params"])
        assert_factors(ranks[r][f"accumulate-{fisher}"]["factors"], ref["factors"])


def test_mc_fisher_is_reproducible_and_ranks_agree(ranks):
    for r in range(2):
        assert_params(ranks[r]["mc-0"]["params"], ranks[r]["mc-1"]["params"], atol=0, rtol=0)
    assert_params(ranks[0]["mc-0"]["params"], ranks[1]["mc-0"]["params"], atol=0, rtol=0)


@pytest.mark.parametrize("cls_name", ["KFAC", "EKFAC"])
def test_state_saved_on_rank_0_resumes_every_rank(ranks, cls_name):
    uninterrupted = "kfac-type2-ddp" if cls_name == "KFAC" else None
    if uninterrupted is None:
        ref = reference_ekfac_type2_ddp()
    else:
        ref = reference(uninterrupted)
    for r in range(2):
        assert_params(ranks[r][f"resume-{cls_name}"]["params"], ref["params"])


def reference_ekfac_type2_ddp():
    SCENARIOS["_ekfac-type2"] = ("EKFAC", dict(fisher="type-2"), True)
    try:
        return reference("_ekfac-type2")
    finally:
        del SCENARIOS["_ekfac-type2"]


def test_nan_batch_on_one_rank_keeps_the_ranks_identical_and_finite(ranks):
    a, b = ranks[0]["nan"], ranks[1]["nan"]
    assert_params(a["params"], b["params"], atol=0, rtol=0)
    assert all(bool(torch.isfinite(p).all()) for p in a["params"])
    assert b["skipped"] >= 1 and a["skipped"] == 0
    assert_factors(a["factors"], b["factors"])


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_a_failing_rank_gives_a_clear_error_not_a_hang(tmp_path, mode):
    results = spawn(str(tmp_path), mode, timeout=60.0)
    error = results[0]["error"]
    assert error is not None and "RuntimeError" in error
    assert "rank 0 of 2" in error and "step()" in error


def test_a_decomposition_failing_on_its_owner_fails_on_every_rank(tmp_path):
    """Every eigh fails on rank 1: the block it owns has no previous decomposition, so
    both ranks raise (rank 0 naming the owner) instead of rank 0 waiting forever."""
    results = spawn(str(tmp_path), "decompose", timeout=60.0)
    assert "injected on rank 1" in results[1]["error"]
    assert "RuntimeError" in results[0]["error"] and "rank 1, its owner" in results[0]["error"]


def test_ddp_example_runs_under_torchrun_and_resumes(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "examples", "ddp_train.py")
    pytest.importorskip("sklearn")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ck = str(tmp_path / "ck.pt")
    # --standalone: a rendezvous on a free port (not the default 29500, which another run may hold)
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run.append(script)

    def launch(*args):
        done = subprocess.run(
            [*run, "--epochs", "1", *args], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done

    first = launch("--checkpoint", ck)
    assert "epoch 1: train loss" in first.stdout and "2 rank(s)" in first.stdout
    assert "statistics" in first.stdout  # bytes communicated per step are reported
    second = launch("--resume", ck)
    loss = lambda out: float(out.split("train loss ")[1].split()[0])  # noqa: E731
    assert loss(second.stdout) < loss(first.stdout)  # resumed, not restarted


# -- without processes ---------------------------------------------------------------------
def test_bad_distributed_arguments_are_refused():
    model = make_model()
    with pytest.raises(ValueError, match="decompose='sideways'"):
        curvature.KFAC(model, decompose="sideways")
    with pytest.raises(ValueError, match="precondition='everywhere'"):
        curvature.KFAC(model, precondition="everywhere")
    with pytest.raises(ValueError, match="EKFAC's corrections"):
        curvature.EKFAC(model, precondition="owner")
    with pytest.raises(ValueError, match="comm_timeout"):
        curvature.KFAC(model, comm_timeout=0)
    with pytest.raises(ValueError, match="init_process_group"):
        curvature.KFAC(model, distributed=True)


def test_single_process_communicates_nothing():
    model = make_model()
    opt = curvature.KFAC(model, lr=0.1, fisher="empirical")
    X, y = union_batch(0)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    assert opt.world_size == 1 and opt.rank == 0 and opt.bytes_communicated == {}


@pytest.mark.parametrize("D", [3, 16, 40])
def test_symmetric_packing_round_trips(D):
    from curvature.optim.distributed import pack, packed_numel, unpack

    A = torch.randn(2, D, D, dtype=torch.float64)
    A = A + A.mT
    flat = pack(A, True)
    assert flat.numel() == packed_numel(A.shape, True)
    assert flat.numel() < A.numel() or D < 16
    assert torch.equal(unpack(flat, A.shape, True), A)
    L = torch.randn(2, D, D)
    assert torch.equal(unpack(pack(L, False), L.shape, False), L)


def test_owners_balance_the_decomposition_cost():
    from curvature.optim.distributed import Communicator

    comm = Communicator.__new__(Communicator)
    comm.world = 2
    costs = {"a": 10.0, "b": 6.0, "c": 5.0, "d": 1.0}
    owner = comm.owners(costs)
    load = [sum(c for k, c in costs.items() if owner[k] == r) for r in range(2)]
    assert owner["a"] != owner["b"] and sorted(load) == [11.0, 11.0]
