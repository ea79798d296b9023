"""The plain loop's quadratic rule measures a step on its own batch (``reduction_ratio=
"same_batch"``, the default): at each damping adaptation the step's forward and
``loss_func`` calls run once more, without gradients, at the new parameters.

Checked against the ratio computed by hand from the same batch (dropout with the same
masks, BatchNorm with the batch's statistics and its running statistics untouched), and
against a count of the model's forwards where the replay must not run (a transformed
output, ``reduction_ratio="next_batch"``, a forward that needs gradients).
"""

from __future__ import annotations

import warnings
import weakref

import pytest
import torch
from torch import nn

import curvature

CE = nn.CrossEntropyLoss()

#: one intra-op thread and a seeded, forked RNG per test (conftest.py)
pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def batches(n=4, N=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, N, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n, N), generator=g)
    return list(zip(X, y))


class Counted(nn.Module):
    """A small classifier that counts its forwards (and can take ``x=`` or return a dict)."""

    def __init__(self, dropout=0.0, norm=False, as_dict=False, needs_grad=False):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(6, 16),
            nn.BatchNorm1d(16) if norm else nn.Identity(),
            nn.Tanh(),
            nn.Dropout(dropout),
            nn.Linear(16, 3),
        ).double()
        self.calls, self.as_dict, self.needs_grad = 0, as_dict, needs_grad

    def forward(self, x):
        self.calls += 1
        if self.needs_grad and not torch.is_grad_enabled():
            raise RuntimeError("this forward differentiates inside")
        out = self.net(x)
        return {"logits": out} if self.as_dict else out


def kfac(model, cls=curvature.KFAC, **kw):
    kw.setdefault("fisher", "type-2")
    kw.setdefault("loss_func", CE)
    return cls(
        model,
        update_rule="quadratic",
        damping_adaptation_interval=1,  # every step after the first adapts (and replays)
        **kw,
    )


def rng_states(device):
    """The CPU generator's state and, on CUDA, the device's."""
    cuda = torch.cuda.get_rng_state() if device == "cuda" else None
    return torch.get_rng_state(), cuda


def set_rng_states(states):
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1])


def hand_ratio(model, X, y, loss_before, model_change, rng=None, pick=lambda o: o):
    """``(L(theta_new) - L(theta_old)) / M`` on the step's own batch, in train mode with the
    forward's random states, the buffers and generators restored."""
    saved = [b.clone() for b in model.buffers()]
    state = rng_states(X.device.type)
    with torch.no_grad():
        if rng is not None:
            set_rng_states(rng)
        after = CE(pick(model(X)), y).item()
    model.calls -= 1  # (not one of the optimizer's)
    set_rng_states(state)
    for b, s in zip(model.buffers(), saved):
        b.copy_(s)
    return (after - loss_before) / model_change


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["plain", "dropout", "batchnorm", "kwargs", "dict"])
def test_the_ratio_is_the_steps_own_batch_loss_change_over_the_model(case, device):
    """Every adaptation's ``rho`` equals the hand-computed same-batch ratio (a different
    batch at every step, so the next batch would give another number)."""
    model = Counted(
        dropout=0.3 if case == "dropout" else 0.0,
        norm=case == "batchnorm",
        as_dict=case == "dict",
    ).to(device)
    opt = kfac(model)
    pick = (lambda o: o["logits"]) if case == "dict" else (lambda o: o)
    for i, (X, y) in enumerate(batches()):
        X, y = X.to(device), y.to(device)
        opt.zero_grad()
        rng = rng_states(device)
        out = model(x=X) if case == "kwargs" else model(X)
        loss = CE(pick(out), y)
        loss.backward()
        torch.rand(3, device=device)  # the user's own draws between the forward and the step
        stats = [b.clone() for b in model.buffers()]
        rng_before_step = rng_states(device)
        opt.step()
        # the replay leaves the buffers (BatchNorm's running statistics) and the
        # generators as the user left them
        assert all(torch.equal(b, s) for b, s in zip(model.buffers(), stats))
        after_step = rng_states(device)
        assert all(a is None or torch.equal(a, b) for a, b in zip(after_step, rng_before_step))
        if i == 0:
            continue
        rho = hand_ratio(model, X, y, loss.item(), opt.last_model_change, rng, pick)
        assert opt.last_reduction_ratio == pytest.approx(rho, rel=1e-9, abs=1e-12)
    assert model.calls == 4 + 3  # four forwards, three replays
    opt.close()


@pytest.mark.parametrize("cls", [curvature.KFAC, curvature.EKFAC])
def test_micro_batches_are_replayed_each_with_its_weight(cls):
    """Gradient accumulation, ``(loss / k).backward()`` per micro-batch: the replayed loss
    is the mean of the micro-batches' losses at the new parameters, as measured."""
    model = Counted()
    opt = kfac(model, cls)
    for i, (X, y) in enumerate(batches()):
        opt.zero_grad()
        measured = 0.0
        for Xc, yc in zip(X.chunk(2), y.chunk(2)):
            loss = CE(model(Xc), yc) / 2
            loss.backward()
            measured += loss.item()
        opt.step()
        if i:
            with torch.no_grad():
                after = sum(CE(model(Xc), yc).item() / 2 for Xc, yc in zip(X.chunk(2), y.chunk(2)))
            rho = (after - measured) / opt.last_model_change
            assert opt.last_reduction_ratio == pytest.approx(rho, rel=1e-9)
    opt.close()


def test_a_validation_gradient_and_a_stray_forward_are_not_replayed():
    """A validation loss backpropagated before ``zero_grad()`` and an accuracy computed with
    gradients on are not measured, so not replayed: one replay per adaptation."""
    model = Counted()
    opt = kfac(model)
    Xv, yv = batches(1, seed=1)[0]
    for i, (X, y) in enumerate(batches()):
        CE(model(Xv), yv).backward()
        opt.zero_grad()
        (model(Xv).argmax(1) == yv).float().mean()
        loss = CE(model(X), y)
        loss.backward()
        opt.step()
        if i:
            rho = hand_ratio(model, X, y, loss.item(), opt.last_model_change)
            assert opt.last_reduction_ratio == pytest.approx(rho, rel=1e-9)
    assert model.calls == 4 * 3 + 3
    opt.close()


def test_a_forward_no_backward_reaches_is_freed_as_before():
    """The replay keeps the inputs of the step's forwards, not their outputs: an accuracy
    computed with gradients on frees its graph (activations) when the user drops it (with
    ``"empirical"``; ``"mc"`` / ``"type-2"`` keep the last output for their curvature
    backward until a loss comes)."""
    model = Counted()
    opt = kfac(model, fisher="empirical")
    X, y = batches(1)[0]
    out = model(X)
    alive = weakref.ref(out)
    (out.argmax(1) == y).float().mean()
    del out
    assert alive() is None
    CE(model(X), y).backward()
    opt.step()
    opt.close()


@pytest.mark.parametrize("case", ["transformed", "next_batch"])
def test_no_replay_where_the_step_cannot_be_replayed_or_is_not_asked_to(case):
    """A loss of a transformed output (here a slice of it) and ``reduction_ratio=
    "next_batch"`` measure the step by the next forward's loss: no extra forward, and
    ``rho`` is that of the next batch."""
    model = Counted()
    opt = kfac(model, **({"reduction_ratio": "next_batch"} if case == "next_batch" else {}))
    losses, models = [], []
    for X, y in batches():
        opt.zero_grad()
        out = model(X)
        loss = CE(out[:, :] if case == "transformed" else out, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        models.append(opt.last_model_change)
    assert model.calls == 4
    # step 3 adapts on step 2's change, measured by step 3's forward
    assert opt.last_reduction_ratio == pytest.approx((losses[3] - losses[2]) / models[2])
    opt.close()


def test_a_forward_that_needs_gradients_turns_the_replay_off_with_one_warning():
    model = Counted(needs_grad=True)
    opt = kfac(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for X, y in batches():
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()
    said = [w for w in caught if "could not be run again" in str(w.message)]
    assert len(said) == 1 and "differentiates inside" in str(said[0].message)
    assert model.calls == 4 + 1  # the one failed replay, then none
    assert all(torch.isfinite(p).all() for p in model.parameters())
    opt.close()


def test_an_unknown_reduction_ratio_is_refused():
    with pytest.raises(ValueError, match="reduction_ratio"):
        kfac(Counted(), reduction_ratio="same")


def test_lambda_shrinks_when_the_step_fits_and_the_next_batches_confirm_it():
    """Linear least squares, one batch: the quadratic model is exact up to its damping
    term (``rho`` near 1 on the batch and on the next forward, the same batch), so every
    adaptation multiplies ``lambda`` by the decay."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(32, 3, generator=g, dtype=torch.float64)
    y = X @ torch.randn(3, 2, generator=g, dtype=torch.float64)
    model = nn.Linear(3, 2).double()
    mse = nn.MSELoss()
    opt = kfac(model, loss_func=mse, damping=1e-1)
    for i in range(4):
        opt.zero_grad()
        mse(model(X), y).backward()
        opt.step()
        if i:
            assert opt.last_reduction_ratio > 0.75
    assert opt.param_groups[0]["damping"] == pytest.approx(1e-1 * 0.95**3)
    opt.close()


def test_lambda_follows_the_same_batch_ratio_held_where_the_next_batch_disagrees():
    """Fresh batches: each adaptation multiplies ``lambda`` by ``1 / decay`` where the
    step's own batch gives ``rho < 1/4`` or the next forward's loss rose where the model
    predicted a fall (``rho_next < 0``), by the decay where ``rho > 3/4`` *and* the next
    forward confirms a quarter of the predicted change (``rho_next > 1/4``), else keeps
    it; both ratios computed by hand. The run holds ``lambda`` at least once where the
    same-batch ratio alone would have shrunk it (on Fashion-MNIST that alone took
    ``lambda`` from 1e-3 to 1e-12 with a rising loss, docs/optimizers.md)."""
    model = Counted()
    opt = kfac(model, damping=1e-3)
    decay, held, raised = 0.95, 0, 0
    losses, models, damping = [], [], 1e-3
    for i, (X, y) in enumerate(batches(10, N=24, seed=5)):
        opt.zero_grad()
        loss = CE(model(X), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i:
            same = hand_ratio(model, X, y, losses[-1], opt.last_model_change)
            nxt = (losses[-1] - losses[-2]) / models[-1]
            assert opt.last_reduction_ratio == pytest.approx(same, rel=1e-9)
            if same < 0.25 or nxt < 0:
                damping /= decay
            elif same > 0.75 and nxt > 0.25:
                damping *= decay
            held += same > 0.75 and 0 <= nxt <= 0.25
            raised += same >= 0.25 and nxt < 0
        models.append(opt.last_model_change)
        assert opt.param_groups[0]["damping"] == pytest.approx(damping, rel=1e-12)
    assert held >= 1 and raised >= 1, (held, raised)
    opt.close()


class Twisted(Counted):
    """``Counted`` with the ways a forward can make itself unreplayable."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.register_buffer("state", torch.zeros(3, dtype=torch.float64))

    def forward(self, x, h=None):
        if self.how == "input_in_place":
            x.mul_(0.5)
        out = super().forward(x if h is None else x + h[:, :1])
        if self.how == "stateful":  # the output depends on a buffer the forward changes
            out = out + self.state
            self.state.add_(0.1)
        return out


@pytest.mark.parametrize(
    "how",
    ["input_in_place", "input_reused", "output_in_place", "input_from_parameters", "eval"],
)
def test_a_forward_that_would_not_be_the_same_again_is_not_replayed(how):
    """Its inputs changed in place (inside the forward, or a buffer the loop reuses for
    the next batch), its output changed in place before the loss, an input computed from
    the parameters (an unrolled cell's state), the model in eval mode at ``step()``: a
    replay would measure another function, so the step is measured on the next batch
    (no extra forward)."""
    model = Twisted(how)
    opt = kfac(model)
    for X, y in batches():
        X = X.clone()
        opt.zero_grad()
        out = model(X)
        if how == "input_from_parameters":  # a cell unrolled twice, the loss on the last
            out = model(X, out)
        if how == "output_in_place":
            out = out.mul_(2.0)
        loss = CE(out, y)
        loss.backward()
        if how == "input_reused":
            X.copy_(torch.randn_like(X))  # the next batch loaded into the same buffer
        if how == "eval":
            model.eval()
        opt.step()
        model.train()
    assert model.calls == (8 if how == "input_from_parameters" else 4)
    opt.close()


def test_a_forward_whose_output_reads_a_state_it_changes_is_not_replayed():
    """A buffer the forward updates and reads (a running state): the replay would start
    from the updated value, so the step is measured on the next batch; the buffer is as
    the forward left it."""
    model = Twisted("stateful")
    opt = kfac(model)
    for X, y in batches():
        opt.zero_grad()
        CE(model(X), y).backward()
        state = model.state.clone()
        opt.step()
        assert torch.equal(model.state, state)
    assert model.calls == 4
    opt.close()


def test_the_users_pre_hook_and_python_random_are_replayed_as_in_the_forward():
    """A forward pre-hook registered before the optimizer runs once per replay, on the
    arguments as passed (not on its own result); a LayerDrop drawn from Python's
    ``random`` draws the same layers, and the user's ``random`` stream is left as it was."""
    import random

    class LayerDrop(Counted):
        def forward(self, x):
            self.calls += 1
            hidden = self.net[2](self.net[0](x))
            if random.random() < 0.5:  # the layer dropped or not
                hidden = hidden * 0.0 + hidden.detach() * 0.0 + hidden
            return self.net[4](hidden if random.random() < 0.5 else 0.5 * hidden)

    model = LayerDrop()
    model.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    opt = kfac(model)
    random.seed(7)
    for i, (X, y) in enumerate(batches()):
        opt.zero_grad()
        state = random.getstate()
        loss = CE(model(X), y)
        loss.backward()
        random.random()  # the user's own draw between the forward and the step
        before = random.getstate()
        opt.step()
        assert random.getstate() == before
        if i:
            after_state = random.getstate()
            random.setstate(state)
            with torch.no_grad():
                after = CE(model(X), y).item()
            model.calls -= 1
            random.setstate(after_state)
            rho = (after - loss.item()) / opt.last_model_change
            assert opt.last_reduction_ratio == pytest.approx(rho, rel=1e-9)
    assert model.calls == 4 + 3
    opt.close()


def test_an_embedding_with_max_norm_is_not_replayed():
    """``nn.Embedding(max_norm=...)`` renormalizes its weight in place in every forward,
    also without gradients: a replay would change the parameters inside ``step()``."""

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 6, max_norm=1.0).double()
            self.out = nn.Linear(6, 3).double()
            self.calls = 0

        def forward(self, t):
            self.calls += 1
            return self.out(self.emb(t).mean(1))

    model = Bag()
    opt = kfac(model, fisher="empirical")
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        t, y = torch.randint(0, 20, (16, 5), generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        CE(model(t), y).backward()
        opt.step()
    assert model.calls == 4
    opt.close()


def test_the_loss_modules_buffers_are_restored():
    class CountingCE(nn.CrossEntropyLoss):
        def __init__(self):
            super().__init__()
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))

        def forward(self, input, target):
            self.seen += 1
            return super().forward(input, target)

    loss_func = CountingCE()
    model = Counted()
    opt = kfac(model, loss_func=loss_func)
    for X, y in batches():
        opt.zero_grad()
        loss_func(model(X), y).backward()
        opt.step()
    assert int(loss_func.seen) == 4 and model.calls == 4 + 3
    opt.close()


@pytest.mark.parametrize("ratio", ["same_batch", "next_batch"])
def test_losses_never_backpropagated_free_their_graphs(ratio):
    """Losses computed with gradients on and never backpropagated (a monitoring loss)
    free their outputs' graphs as before: the replay keeps weak references to the
    outputs and loss records, and records nothing for the next-batch ratio."""
    model = Counted()
    opt = kfac(model, reduction_ratio=ratio)
    X, y = batches(1)[0]
    alive = []
    for _ in range(5):
        out = model(X)
        CE(out, y)
        alive.append(weakref.ref(out))
        del out
    assert all(r() is None for r in alive)
    CE(model(X), y).backward()
    opt.step()
    opt.close()
