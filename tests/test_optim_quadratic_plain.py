"""``update_rule="quadratic"`` in a plain training loop (no closure).

The 2x2 quadratic model uses the Kronecker-factored curvature (the optimizer's own ``C``);
the loss of the step's own batch (replayed: test_optim_quadratic_replay.py) and of the
next forward measure each step (reduction ratio, rejection). Checked against brute force:
a linear least-squares model, where the Kronecker factors are the exact Gauss-Newton
matrix, and the 2x2 system solved by hand with the dense matrix.
"""

from __future__ import annotations

import copy
import pathlib
import sys
import warnings

import pytest
import torch
from cases import train_step
from torch import nn

import curvature

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from step_counts import HostReads  # noqa: E402

MSE = nn.MSELoss()
CE = nn.CrossEntropyLoss()


#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def linear_problem(N=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, 3, generator=g, dtype=torch.float64)
    y = torch.randn(N, 2, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    return nn.Linear(3, 2).double(), X, y


def measured_kfac(model):
    """KFAC with the quadratic rule on type-2 statistics, damping adapted every step (the
    reduction ratio of every step is read)."""
    return curvature.KFAC(
        model,
        fisher="type-2",
        loss_func=CE,
        update_rule="quadratic",
        damping_adaptation_interval=1,
    )


def classifier(seed=0):
    torch.manual_seed(seed)
    X = torch.randn(256, 10)
    y = (X[:, :3].sum(1) > 0).long() + (X[:, 3] > 1).long()
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3)), X, y


@pytest.mark.parametrize("factor_every", [1, 2], ids=["batch-gram", "kronecker-gram"])
@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
def test_linear_least_squares_coefficients_are_the_hand_2x2_solve(cls, factor_every):
    """A linear layer with MSE: the Kronecker factors are the exact GGN, so the chosen
    ``(alpha, mu)`` minimize ``1/2 d^T (GGN + lambda) d + g^T d`` over
    ``d = alpha Delta + mu delta0`` (``Delta`` the preconditioned direction, ``delta0``
    the previous update): the 2x2 system with the dense GGN, solved by hand. With
    ``factor_every=2`` the second step pulls nothing and uses the Kronecker curvature."""
    model, X, y = linear_problem()
    opt = cls(
        model,
        damping=1e-2,
        fisher="type-2",
        loss_func=MSE,
        update_rule="quadratic",
        inverse_every=1,
        factor_every=factor_every,
    )
    theta0 = flat(model)
    train_step(opt, model, X, y, MSE)
    assert opt.last_update_coefficients[1] == 0.0  # no previous update: mu = 0
    theta1 = flat(model)
    # brute force at theta1: the gradient, the dense GGN (= Kronecker, exact here)
    model.zero_grad()
    MSE(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    g = torch.cat([t.flatten() for t in grads])
    ggn = curvature.ggn(model, MSE, (X, y))
    probe = torch.randn(g.numel(), dtype=torch.float64)
    kron = torch.cat([t.flatten() for t in opt.matvec(opt.layout.unflatten(probe))])
    torch.testing.assert_close(kron, ggn @ probe, rtol=1e-10, atol=1e-12)  # exact case
    damping = opt.param_groups[0]["damping"]
    C = ggn + damping * torch.eye(g.numel(), dtype=torch.float64)
    train_step(opt, model, X, y, MSE)
    theta2 = flat(model)
    assert opt.last_step_taken
    Delta = -torch.cat([d.flatten() for d in opt.inverse_matvec(grads)])
    V = torch.stack([Delta, theta1 - theta0], 1)
    S, r = V.T @ C @ V, -V.T @ g
    det = S[0, 0] * S[1, 1] - S[0, 1] ** 2
    alpha = float((r[0] * S[1, 1] - r[1] * S[0, 1]) / det)  # Cramer's rule by hand
    mu = float((r[1] * S[0, 0] - r[0] * S[0, 1]) / det)
    assert opt.last_update_coefficients == pytest.approx((alpha, mu), rel=1e-7)
    d = theta2 - theta1
    torch.testing.assert_close(
        d, V @ torch.tensor([alpha, mu], dtype=torch.float64), rtol=1e-7, atol=1e-12
    )
    model_change = 0.5 * d @ C @ d + g @ d
    assert opt.last_model_change == pytest.approx(float(model_change), rel=1e-7)
    opt.close()


def conv_net():
    """Shared positions (S = 9) and groups (C = 2) in the first layer."""
    return nn.Sequential(
        nn.Unflatten(1, (2, 3, 3)),
        nn.Conv2d(2, 4, 2, groups=2),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(16, 3),
    )


@pytest.mark.parametrize("net", ["mlp", "conv"])
@pytest.mark.parametrize("loss_func", [MSE, CE], ids=["mse", "ce"])
@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
def test_a_network_uses_the_batch_ggn_not_its_kronecker_approximation(cls, loss_func, net):
    """A tanh network (Kronecker != GGN): with ``fisher="type-2"`` the 2x2 model is the
    exact GGN of the step's batch, from the pulled layer inputs and output gradients;
    brute force: the dense GGN and the 2x2 solve."""
    torch.manual_seed(0)
    if net == "mlp":
        model = nn.Sequential(nn.Linear(18, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    else:
        model = conv_net().double()
    X = torch.randn(16, 18, dtype=torch.float64)
    y = torch.randn(16, 3, dtype=torch.float64) if loss_func is MSE else torch.randint(0, 3, (16,))
    opt = cls(model, damping=1e-1, fisher="type-2", loss_func=loss_func, update_rule="quadratic")
    theta0 = flat(model)
    train_step(opt, model, X, y, loss_func)
    theta1 = flat(model)
    model.zero_grad()
    loss_func(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    g = torch.cat([t.flatten() for t in grads])
    C = curvature.ggn(model, loss_func, (X, y))
    C = C + opt.param_groups[0]["damping"] * torch.eye(g.numel(), dtype=torch.float64)
    train_step(opt, model, X, y, loss_func)
    assert opt.last_step_taken
    Delta = -torch.cat([d.flatten() for d in opt.inverse_matvec(grads)])  # step 2's direction
    V = torch.stack([Delta, theta1 - theta0], 1)
    alpha, mu = torch.linalg.solve(V.T @ C @ V, -V.T @ g).tolist()
    assert opt.last_update_coefficients == pytest.approx((alpha, mu), rel=1e-6)
    d = flat(model) - theta1
    assert opt.last_model_change == pytest.approx(float(0.5 * d @ C @ d + g @ d), rel=1e-6)
    opt.close()


def test_a_layer_without_linear_structure_falls_back_to_the_kronecker_curvature():
    """An embedding has no ``(a, g)`` projection: the step's model is ``v^T (C + lambda) w``
    with ``C`` the Kronecker-factored curvature (brute force: ``optim.matvec``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(6, 2)).double()
    X, y = torch.randint(0, 7, (16, 2)), torch.randn(16, 2, dtype=torch.float64)
    opt = curvature.KFAC(
        model, damping=1e-1, fisher="type-2", loss_func=MSE, update_rule="quadratic"
    )
    theta0 = flat(model)
    train_step(opt, model, X, y, MSE)
    theta1 = flat(model)
    model.zero_grad()
    MSE(model(X), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    g = torch.cat([t.flatten() for t in grads])
    train_step(opt, model, X, y, MSE)
    assert opt.last_step_taken
    Delta = -torch.cat([d.flatten() for d in opt.inverse_matvec(grads)])
    V = torch.stack([Delta, theta1 - theta0], 1)
    CV = torch.stack(
        [torch.cat([t.flatten() for t in opt.matvec(opt.layout.unflatten(v))]) for v in V.T], 1
    )
    S = V.T @ CV + opt.param_groups[0]["damping"] * V.T @ V
    alpha, mu = torch.linalg.solve(S, -V.T @ g).tolist()
    assert opt.last_update_coefficients == pytest.approx((alpha, mu), rel=1e-6)
    opt.close()


def test_the_next_batch_reduction_ratio_is_the_next_forwards_loss_change_over_the_model():
    """``reduction_ratio="next_batch"``, the same batch every step: ``rho`` over an
    interval is the sum of the actual loss changes (each from the next forward's loss)
    over the sum of the predicted ones (the same-batch default: test_optim_quadratic_replay.py)."""
    model, X, y = linear_problem()
    opt = curvature.KFAC(
        model,
        damping=1e-1,
        fisher="type-2",
        loss_func=MSE,
        update_rule="quadratic",
        damping_adaptation_interval=3,
        reduction_ratio="next_batch",
    )
    losses, models = [], []
    for _ in range(4):  # steps 0..3; step 3 adapts over the changes of steps 0, 1, 2
        losses.append(train_step(opt, model, X, y, MSE))
        models.append(opt.last_model_change)
    rho = (losses[3] - losses[0]) / sum(models[:3])
    assert opt.last_reduction_ratio == pytest.approx(rho, rel=1e-9)
    decay = 0.95**3
    expected = 1e-1 * (decay if rho > 0.75 else 1 / decay if rho < 0.25 else 1.0)
    assert opt.param_groups[0]["damping"] == pytest.approx(expected)
    opt.close()


@pytest.mark.parametrize("blow_up", ["large", "nan"])
def test_a_step_that_blows_the_next_loss_up_is_rolled_back(blow_up):
    """The next forward's loss is more than twice the last (or not finite): the last
    update is subtracted again, the momentum dropped, this step does not move, and the
    damping grows by ``1 / decay^interval`` at the next adaptation."""
    model, X, y = linear_problem()
    opt = curvature.KFAC(
        model, damping=1e-2, fisher="type-2", loss_func=MSE, update_rule="quadratic"
    )
    theta0 = flat(model)
    train_step(opt, model, X, y, MSE)
    assert opt.last_step_taken and not torch.equal(flat(model), theta0)
    bad = (
        (y * 1e3, X)
        if blow_up == "large"
        else (y, X.clone().index_fill_(0, torch.tensor([0]), 1e400))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-finite statistics are skipped (and warned)
        train_step(opt, model, bad[1], bad[0], MSE)
    assert opt.last_step_taken is False
    assert opt.last_update_coefficients == (0.0, 0.0)
    torch.testing.assert_close(flat(model), theta0, rtol=0, atol=1e-12)
    assert all(not opt.state[p]["previous_update"].any() for p in model.parameters())
    for _ in range(4):  # steps 2..5: the adaptation at step 5 sees the rejection
        train_step(opt, model, X, y, MSE)
        assert opt.last_step_taken
    assert opt.param_groups[0]["damping"] == pytest.approx(1e-2 / 0.95**5)
    opt.close()


def test_state_dict_round_trip_resumes_bit_for_bit():
    """The loss to beat, the interval's sums, the momentum and the rejection count travel
    in ``state_dict``: a resumed twin takes the same steps (float32)."""
    model, X, y = classifier(1)
    batches = [(X[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32]) for i in range(8)]

    def make(m):
        return curvature.KFAC(
            m,
            fisher="type-2",
            loss_func=CE,
            update_rule="quadratic",
            inverse_every=2,
            damping_adaptation_interval=2,
        )

    twin = copy.deepcopy(model)
    opt = make(model)
    for Xb, yb in batches[:3]:
        train_step(opt, model, Xb, yb, CE)
    state = copy.deepcopy(opt.state_dict())
    assert torch.is_tensor(state["param_groups"][0]["quadratic_loss"])
    twin.load_state_dict(model.state_dict())
    resumed = make(twin)
    resumed.load_state_dict(state)
    for Xb, yb in batches[3:]:
        train_step(opt, model, Xb, yb, CE)
        train_step(resumed, twin, Xb, yb, CE)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert opt.param_groups[0]["damping"] == resumed.param_groups[0]["damping"]
    assert opt.last_update_coefficients == resumed.last_update_coefficients
    opt.close()
    resumed.close()


@pytest.mark.parametrize(
    "cls,fisher",
    [(curvature.KFAC, "mc"), (curvature.KFAC, "type-2"), (curvature.EKFAC, "mc")],
    ids=["kfac-mc", "kfac-type-2", "ekfac-mc"],
)
def test_a_plain_loop_trains_without_a_learning_rate(cls, fisher):
    """Four batches in turn whose losses differ by 2-5x late in the run (the next batch's
    loss is not a blow-up: the damping stays bounded, as it did not when the rollback
    compared with the last batch alone)."""
    model, X, y = classifier()
    opt = cls(model, fisher=fisher, loss_func=CE, update_rule="quadratic")
    with torch.no_grad():
        first = float(CE(model(X), y))
    for i in range(60):
        part = slice(i % 4 * 64, (i % 4 + 1) * 64)
        train_step(opt, model, X[part], y[part], CE)
    with torch.no_grad():
        last = float(CE(model(X), y))
    assert last < 0.3 * first
    assert opt.last_reduction_ratio is not None
    assert opt.param_groups[0]["damping"] < 0.1
    opt.close()


def test_a_plain_loop_needs_the_loss_of_its_forward():
    """Without a closure the rule needs the value of ``loss_func`` called in the loop."""
    model, X, y = classifier()
    opt = curvature.KFAC(model, fisher="mc", loss_func=CE, update_rule="quadratic")
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()  # not the registered module
    with pytest.raises(ValueError, match="loss of its forward.*loss_func"):
        opt.step()
    opt.close()


def test_only_the_adaptation_steps_read_the_device():
    """No host read in a plain-loop step without refresh or damping adaptation; one read
    (the interval's sums) at an adaptation step."""
    model, X, y = classifier()
    X, y = X[:16], y[:16]
    opt = curvature.KFAC(
        model,
        fisher="mc",
        loss_func=CE,
        update_rule="quadratic",
        inverse_every=1000,
        damping_adaptation_interval=4,
    )
    for _ in range(2):  # steps 0, 1
        train_step(opt, model, X, y, CE)
    counts, dampings = [], []
    for _ in range(4):  # steps 2, 3, 4 (adapts), 5
        opt.zero_grad()
        loss = CE(model(X), y)
        loss.backward()
        with HostReads() as reads:
            opt.step()
        counts.append(reads.count)
        dampings.append(opt.param_groups[0]["damping"])
    assert counts[:3] == [0, 0, 1], counts
    # a changed damping re-inverts the damped factors at the next step (as with the fixed
    # rule: a refresh's reads), an unchanged one reads nothing
    assert counts[3] == 0 if dampings[2] == dampings[1] else counts[3] <= 4, counts
    opt.close()


def test_freezing_a_layer_mid_run_keeps_training():
    """A rebuild (parameters frozen between steps) keeps the loss of the forward before it
    and the flat positions of the remaining layers."""
    model, X, y = classifier()
    opt = curvature.KFAC(model, fisher="mc", loss_func=CE, update_rule="quadratic")
    for _ in range(3):
        train_step(opt, model, X[:64], y[:64], CE)
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        losses = [train_step(opt, model, X[:64], y[:64], CE) for _ in range(6)]
    assert torch.equal(model[0].weight, frozen)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    opt.close()


@pytest.mark.parametrize("k", [2, 3])
def test_gradient_accumulation_measures_the_union_loss(k):
    """``k`` micro-batches with ``loss / k`` each are measured by the loss that the
    backward differentiates (the mean of the ``loss_func`` values, each weighted by its
    backward's gradient), not their sum, which made the reduction ratio ``k`` times the
    one-batch run's and adapted the damping differently (until 2026-11-26). With identical
    parts the last micro-batch's Gauss-Newton matrix is the union's, so the two loops
    take the same steps."""
    runs = []
    for micro in (1, k):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
        opt = measured_kfac(model)
        ratios = []
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            X = torch.randn(8, 6, generator=g, dtype=torch.float64).repeat(6, 1)
            y = torch.randint(0, 3, (8,), generator=g).repeat(6)
            opt.zero_grad()
            for Xc, yc in zip(X.chunk(micro), y.chunk(micro)):
                (CE(model(Xc), yc) / micro).backward()
            opt.step()
            ratios.append(opt.last_reduction_ratio)
        runs.append((flat(model), ratios[1:], opt.param_groups[0]["damping"]))
    (one, rho_one, damping_one), (two, rho_two, damping_two) = runs
    assert rho_two == pytest.approx(rho_one, rel=1e-9)
    torch.testing.assert_close(two, one, rtol=1e-9, atol=1e-12)
    assert damping_two == damping_one


def test_a_grad_scaler_passed_to_the_optimizer_leaves_the_measured_loss_unscaled():
    """``scaler.scale(loss).backward()`` weighs the loss by the scale; given the scaler, the
    plain loop measures the unscaled loss: the same steps as without it (a power-of-two
    scale, no autocast: the unscaled gradients are exact)."""
    try:
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    except (RuntimeError, TypeError, AttributeError) as err:
        pytest.skip(f"no CPU GradScaler in this torch: {err}")
    runs = []
    for scaled in (False, True):
        model, X, y = classifier()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        if scaled and not scaler.is_enabled():
            pytest.skip("the CPU GradScaler is disabled in this torch")
        opt = curvature.KFAC(
            model,
            fisher="type-2",
            loss_func=CE,
            update_rule="quadratic",
            damping_adaptation_interval=1,
            grad_scaler=scaler if scaled else None,
        )
        ratios = []
        for i in range(6):
            opt.zero_grad()
            loss = CE(model(X[32 * i : 32 * (i + 1)]), y[32 * i : 32 * (i + 1)])
            if scaled:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            ratios.append(opt.last_reduction_ratio)
        runs.append((flat(model), ratios[1:]))
    assert runs[1][1] == pytest.approx(runs[0][1], rel=1e-6)
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-6, atol=1e-7)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.h1, self.h2 = nn.Linear(10, 16), nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x, head=1):
        h = torch.tanh(self.body(x))
        return self.h1(h) if head == 1 else self.h2(h)


@pytest.mark.parametrize("with_closure", [False, True], ids=["plain", "closure"])
def test_a_parameter_without_a_gradient_does_not_move(with_closure):
    """As in ``torch.optim``: a head unused in a step (``.grad`` is ``None``) keeps its
    values; before, the rule's momentum moved it by ``mu`` times its last update."""
    _, X, y = classifier()
    torch.manual_seed(0)
    model = TwoHeads()
    opt = curvature.KFAC(model, fisher="type-2", loss_func=CE, update_rule="quadratic")
    for i, head in enumerate([2, 1, 1, 1]):
        Xb, yb = X[32 * i : 32 * (i + 1)], y[32 * i : 32 * (i + 1)]

        def closure(backward=True, Xb=Xb, yb=yb, head=head):
            opt.zero_grad()
            loss = CE(model(Xb, head), yb)
            if backward:
                loss.backward()
            return loss

        if head == 1 and i == 1:
            unused = [p.detach().clone() for p in model.h2.parameters()]
        if with_closure:
            opt.step(closure)
        else:
            closure()
            opt.step()
    assert opt.last_update_coefficients[1] != 0.0  # the momentum was in use
    for p, q in zip(model.h2.parameters(), unused):
        assert torch.equal(p, q)


def test_a_backward_discarded_by_zero_grad_does_not_measure_the_step():
    """A validation gradient (``loss_func`` on another batch, ``backward()``) taken before
    ``zero_grad()``: its loss is zeroed with its gradient, so the plain loop's measured loss
    and damping are those of the clean loop (before, its value was added to the loss)."""
    _, X, y = classifier()
    runs = []
    for validation in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = measured_kfac(model)
        ratios = []
        for i in range(5):
            if validation:
                CE(model(X[200:] * 2), y[200:]).backward()
            opt.zero_grad()
            CE(model(X[32 * i : 32 * (i + 1)]), y[32 * i : 32 * (i + 1)]).backward()
            opt.step()
            ratios.append(opt.last_reduction_ratio)
        runs.append((flat(model), ratios, opt.param_groups[0]["damping"]))
    assert runs[1][1] == runs[0][1]
    assert runs[1][2] == runs[0][2]
    assert torch.equal(runs[1][0], runs[0][0])
