"""The step-choosing rules under torch.distributed: 2 gloo ranks against one process.

``update_rule="quadratic"`` (plain loop and closure), ``adaptive_damping=True`` and
``line_search_grid`` choose the step from losses and curvature products; every rank must
take the same decisions (parameters bit-identical across ranks), and those of one
process on the union batch (to rounding: float64, the sums over the union are formed in
another order, per rank then over the ranks; measured at most 1.3e-10 after 7 steps, the
largest with EKFAC's empirical Fisher and a sum-reduction loss, 3e-13 with equal batches
and a mean; ``1e-8`` leaves room without hiding a wrong average: unweighted averages with
3 + 5 samples were off by 0.19 to 0.26, the mean of sum-reduction ranks by 0.75 to 0.92).

Setups: equal batches and a mean-reduction loss; ``@unequal`` batches of 3 and 5 samples;
``@sum`` a sum-reduction loss (see ``distributed_rules_worker.py``).
"""

import pytest
import torch
import torch.distributed as dist
from distributed_rules_worker import FAULTS, RULES, make_model, run_rule
from distributed_worker import spawn

from curvature.optim.quadratic import solve_coefficients

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()),
    reason="needs torch.distributed with gloo",
)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(str(tmp_path_factory.mktemp("rules")), "rules")


@pytest.mark.parametrize("name", list(RULES) + list(FAULTS))
def test_ranks_stay_bit_identical(ranks, name):
    for p, q in zip(ranks[0][name]["params"], ranks[1][name]["params"]):
        assert torch.equal(p, q)
    assert ranks[0][name]["trace"] == ranks[1][name]["trace"]


@pytest.mark.parametrize("fisher", ["type2", "empirical"])
def test_plain_rule_reduces_the_loss_and_the_gram_matrix_in_one_all_reduce(ranks, fisher):
    """Per step ``2 + K^2 + 3`` float64 values with a pull (``K = 1`` at the first step,
    then 2), the loss and its weight alone without one (``"empirical"``): 7 steps."""
    sent = ranks[0][f"kfac-quadratic-plain-{fisher}"]["bytes"]
    assert "quadratic loss" not in sent
    assert sent["quadratic model"] == (8 * (6 + 6 * 9) if fisher == "type2" else 8 * 2 * 7)


@pytest.mark.parametrize("name", list(FAULTS))
def test_a_bad_batch_on_one_rank_is_rejected_on_every_rank(ranks, name):
    """Rank 1's batch of step 2 is empty or has a NaN: that step is not taken, on every
    rank (an empty batch used to skip the plain rule's Gram all-reduce on that rank only,
    and the ranks' collectives fell out of step: a hang)."""
    result = ranks[0][name]
    assert all(bool(torch.isfinite(p).all()) for p in result["params"])
    assert result["trace"][2]["taken"] is False
    assert all(t["taken"] for i, t in enumerate(result["trace"][:6]) if i != 2)


@pytest.mark.parametrize("name", list(RULES))
def test_two_ranks_match_one_process_on_the_union(ranks, name):
    ref = run_rule(name, None)
    for p, q in zip(ranks[0][name]["params"], ref["params"]):
        torch.testing.assert_close(p, q, atol=1e-8, rtol=0)
    ours, theirs = ranks[0][name]["trace"], ref["trace"]
    # the same damping decisions (products of the same factors: equal bits)
    assert [t["damping"] for t in ours] == [t["damping"] for t in theirs]
    for a, b in zip(ours, theirs):
        for key in ("rho", "coefficients", "lr"):
            x, y = a.get(key), b.get(key)
            assert (x is None) == (y is None)
            if x is not None:
                torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-7, rtol=1e-7)
    # not vacuous: the parameters moved, and the damping adapted (or the grid chose)
    start = [p.detach() for p in make_model().parameters()]
    assert max(float((p - q).abs().max()) for p, q in zip(ref["params"], start)) > 1e-2
    if "line-search" in name:
        assert all(t["lr"] is not None for t in theirs)
    else:
        assert len({t["damping"] for t in theirs}) > 1


def test_a_closure_mixing_loss_reductions_is_refused_on_every_rank(ranks):
    for r in range(2):
        assert "mix loss reductions ['mean', 'sum']" in ranks[r]["mixed-reductions"]["error"]


def test_coefficients_are_the_exact_solve_and_least_norm_when_singular():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(2, 2, generator=g, dtype=torch.float64)
    gram, damped = A @ A.T, 0.1 * torch.eye(2, dtype=torch.float64)
    linear = torch.randn(2, generator=g, dtype=torch.float64)
    c, model = solve_coefficients(gram, damped, linear)
    exact = torch.linalg.solve(gram + damped, -linear)
    torch.testing.assert_close(c, exact, atol=1e-12, rtol=0)
    assert model == pytest.approx(0.5 * float(exact @ (gram + damped) @ exact + 2 * linear @ exact))
    u = torch.randn(2, generator=g, dtype=torch.float64)  # delta0 parallel to Delta
    S = torch.outer(u, u)
    c, _ = solve_coefficients(S, torch.zeros_like(S), u)
    torch.testing.assert_close(c, -torch.linalg.pinv(S) @ u, atol=1e-12, rtol=0)
    c1, _ = solve_coefficients(S[:1, :1], torch.zeros(1, 1, dtype=torch.float64), u[:1])
    torch.testing.assert_close(c1, -u[:1] / S[0, 0])
