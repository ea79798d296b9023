"""``torch.compile``: the optimizers split no graph, and their numbers are the eager ones.

- graph count: dynamo's ``CompileCounter`` backend over three training steps of an MLP,
  a small CNN and an MLP with LayerNorm and GroupNorm gives one graph and no graph
  break with ``KFAC`` for the empirical Fisher and for ``fisher="mc"`` (as many graphs
  as the model alone);
- exactness: factors and parameters after compiled steps (backends ``"eager"`` and
  ``"aot_eager"``: no C++ compiler needed) equal those of the uncompiled model, bit for
  bit, also with EKFAC, several MC samples, gradient accumulation, a module called twice
  and an in-place ReLU after a layer;
- per-sample quantities of ``curvature.capture`` on a compiled model equal the eager ones.

Skipped where ``torch.compile`` cannot run.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch import nn

import curvature

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from compile_graphs import cnn, mlp  # noqa: E402  (the benchmark's models)

dynamo = pytest.importorskip("torch._dynamo")
testing = pytest.importorskip("torch._dynamo.testing")
utils = pytest.importorskip("torch._dynamo.utils")

CE = nn.CrossEntropyLoss()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch (no cache, no counters of another test)."""
    try:
        torch.compile(nn.Linear(2, 2), backend="eager")(torch.ones(1, 2))
    except Exception as e:  # pragma: no cover - depends on the platform
        pytest.skip(f"torch.compile is unavailable here: {type(e).__name__}: {e}")
    dynamo.reset()
    utils.counters.clear()
    yield
    dynamo.reset()


def normed() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 16), nn.LayerNorm(16), nn.GELU(), nn.GroupNorm(4, 16), nn.Linear(16, 4)
    )


class Twice(nn.Module):
    """One layer called twice per forward, an in-place ReLU after a layer."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(20, 20)
        self.b = nn.Linear(20, 4)

    def forward(self, x):
        return self.b(torch.relu_(self.a(torch.relu(self.a(x)))))


SHAPES = {mlp: (20,), cnn: (3, 8, 8), normed: (20,), Twice: (20,)}


def train(build, fisher, backend, steps=3, cls=curvature.KFAC, pattern="plain", **kw):
    """Factors, parameters and the backend after ``steps`` steps (``backend=None``: eager)."""
    torch.manual_seed(0)
    model = build()
    # fullgraph=True: any graph break would raise
    fwd = model if backend is None else torch.compile(model, backend=backend, fullgraph=True)
    if fisher != "empirical":
        kw["loss_func"] = CE
    optim = cls(fwd, lr=1e-2, damping=1e-3, kl_clip=1e-3, fisher=fisher, **kw)
    X, y = torch.randn(16 * steps, *SHAPES[build]), torch.randint(0, 4, (16 * steps,))
    for i in range(steps):
        x, t = X[16 * i : 16 * i + 16], y[16 * i : 16 * i + 16]
        optim.zero_grad()
        if pattern == "accumulate":  # a backward after each of two forwards
            CE(fwd(x[:8]), t[:8]).backward()
            CE(fwd(x[8:]), t[8:]).backward()
        elif pattern == "one backward":  # two forwards, then one backward
            (CE(fwd(x[:8]), t[:8]) + CE(fwd(x[8:]), t[8:])).backward()
        else:
            CE(fwd(x), t).backward()
        optim.step()
    factors = optim.factors()
    optim.close()
    return factors, [p.detach().clone() for p in model.parameters()]


def assert_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, z in zip(a, b):
            assert_equal(x, z)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("build", [mlp, cnn, normed])
def test_one_graph_and_no_graph_break(build, fisher):
    """The compiled forward stays one graph: no break from the optimizer's hooks."""
    counter = testing.CompileCounter()
    factors, _ = train(build, fisher, counter)
    assert counter.frame_count == 1
    assert not utils.counters["graph_break"], dict(utils.counters["graph_break"])
    layers = [n for n, m in build().named_modules() if list(m.parameters(recurse=False))]
    assert set(factors) == set(layers)  # named as in the plain model, no `_orig_mod.`


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("build", [mlp, cnn, normed])
def test_compiled_steps_equal_the_eager_ones(build, fisher, backend):
    assert_equal(train(build, fisher, backend), train(build, fisher, None))


@pytest.mark.parametrize("pattern", ["plain", "accumulate", "one backward"])
@pytest.mark.parametrize(
    "cls, fisher, kw",
    [
        (curvature.KFAC, "empirical", {}),
        (curvature.EKFAC, "empirical", {}),
        (curvature.KFAC, "mc", {"mc_samples": 3}),
        (curvature.EKFAC, "type-2", {}),
    ],
)
def test_compiled_steps_equal_the_eager_ones_in_harder_cases(cls, fisher, kw, pattern):
    """A layer called twice, an in-place ReLU on a layer output, several forwards."""
    counter = testing.CompileCounter()
    compiled = train(Twice, fisher, counter, cls=cls, pattern=pattern, **kw)
    assert_equal(compiled, train(Twice, fisher, None, cls=cls, pattern=pattern, **kw))
    assert not utils.counters["graph_break"], dict(utils.counters["graph_break"])


def test_per_sample_quantities_of_a_compiled_model():
    torch.manual_seed(0)
    model = mlp()
    X, y = torch.randn(10, 20), torch.randint(0, 4, (10,))

    def quantities(fwd):
        with curvature.capture(fwd) as cap:
            out = fwd(X)
        losses = nn.functional.cross_entropy(out, y, reduction="none")
        return cap.per_sample_grad_norms(losses, retain_graph=True), cap.per_sample_grads(losses)

    assert_equal(quantities(torch.compile(model, backend="aot_eager")), quantities(model))


def test_the_curvature_functions_of_a_compiled_model():
    """``kfac()`` and ``diag_ggn()`` of ``torch.compile(model)``: the plain model's results,
    under its names (before, found by an audit: ``KeyError: 'weight'``)."""
    torch.manual_seed(0)
    model = mlp()
    X, y = torch.randn(10, 20), torch.randint(0, 4, (10,))
    ce = nn.CrossEntropyLoss()
    compiled = torch.compile(model, backend="aot_eager")
    for fisher in ("type-2", "empirical"):
        a, b = (
            curvature.diag_ggn(compiled, ce, (X, y), fisher=fisher),
            curvature.diag_ggn(model, ce, (X, y), fisher=fisher),
        )
        assert list(a) == list(b)
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-7)
    Ka, Kb = curvature.kfac(compiled, ce, (X, y)), curvature.kfac(model, ce, (X, y))
    assert set(Ka.factors) == set(Kb.factors)
    torch.testing.assert_close(Ka.to_dense(), Kb.to_dense(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("how", ["compiled after", "Module.compile"])
def test_a_model_compiled_after_the_optimizer_was_built(how, fisher):
    """The forward callbacks then run inside the compiled call: they leave the graph
    there (a break before the first and after the last op), which stays one graph."""
    torch.manual_seed(0)
    model, counter = mlp(), testing.CompileCounter()
    kw = {} if fisher == "empirical" else {"loss_func": CE}
    optim = curvature.KFAC(model, lr=1e-2, damping=1e-3, kl_clip=1e-3, fisher=fisher, **kw)
    if how == "Module.compile":
        model.compile(backend=counter)
        fwd = model
    else:
        fwd = torch.compile(model, backend=counter)
    X, y = torch.randn(48, 20), torch.randint(0, 4, (48,))
    for i in range(3):
        optim.zero_grad()
        CE(fwd(X[16 * i : 16 * i + 16]), y[16 * i : 16 * i + 16]).backward()
        optim.step()
    assert counter.frame_count == 1
    got = optim.factors(), [p.detach().clone() for p in model.parameters()]
    optim.close()
    assert_equal(got, train(mlp, fisher, None))


def test_mc_pulls_from_the_compiled_models_loss_only():
    """``loss_func`` called on another model's output first (a distillation term): the
    curvature backward still starts from the loss of the compiled model's output."""

    def run(backend):
        torch.manual_seed(0)
        model, other = mlp(), nn.Linear(20, 4)
        fwd = model if backend is None else torch.compile(model, backend=backend)
        optim = curvature.KFAC(fwd, lr=1e-2, damping=1e-3, fisher="mc", loss_func=CE)
        X, y = torch.randn(16, 20), torch.randint(0, 4, (16,))
        for _ in range(2):
            optim.zero_grad()
            out = fwd(X)
            extra = CE(other(X), y)
            (CE(out, y) + extra).backward()
            optim.step()
        factors = optim.factors()
        optim.close()
        return factors

    assert_equal(run("aot_eager"), run(None))


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_inductor_gives_the_eager_numbers(fisher):
    """Inductor reuses the memory of its own tensors: the gradients the optimizer keeps
    must be its own copies (the MLP's factors and steps are then the eager ones)."""
    try:
        torch.compile(nn.Linear(2, 2), backend="inductor")(torch.ones(1, 2))
    except Exception as e:  # pragma: no cover - depends on the platform (a C++ compiler)
        pytest.skip(f"inductor is unavailable here: {type(e).__name__}: {e}")
    dynamo.reset()
    got, want = train(mlp, fisher, "inductor", steps=2), train(mlp, fisher, None, steps=2)
    for name in want[0]:
        for a, b in zip(got[0][name], want[0][name]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_a_compiled_training_step_that_calls_step(fisher):
    """``torch.compile`` of a whole training step (zero_grad, forward, backward and
    ``optim.step()``, as torch.optim's tutorials compile a step): the optimizer's step runs
    eagerly (``torch.compiler.disable``), the rest compiled; the same factors and
    parameters as eager, bit for bit with ``aot_eager``. Before, dynamo traced into the
    step and failed on its buffers' views ("does not yet handle non-differentiable view
    input mutations")."""

    def run(compiled):
        torch.manual_seed(0)
        model = mlp()
        kw = {"loss_func": CE} if fisher == "mc" else {}
        optim = curvature.KFAC(model, lr=1e-2, damping=1e-3, fisher=fisher, **kw)
        X, y = torch.randn(16, 20), torch.randint(0, 4, (16,))

        def train_step():
            optim.zero_grad()
            loss = CE(model(X), y)
            loss.backward()
            optim.step()
            return loss

        step = torch.compile(train_step, backend="aot_eager") if compiled else train_step
        for _ in range(3):
            step()
        factors = optim.factors()
        optim.close()
        return factors, [p.detach().clone() for p in model.parameters()]

    assert_equal(run(True), run(False))


class _Tagger(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.rnn = nn.LSTM(3, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


@pytest.mark.parametrize("hidden", [8, 33], ids=["exact block", "kronecker"])
def test_a_compiled_recurrent_layer_gets_its_statistics(hidden):
    """A layer that returns a tuple is recorded as in eager mode (a graph break around it);
    before (found by an audit), an ``nn.LSTM`` under ``torch.compile`` got no statistics."""
    torch._dynamo.reset()
    X, y = torch.randn(4, 5, 3), torch.randint(0, 2, (4,))
    ce = nn.CrossEntropyLoss()
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _Tagger(hidden)
        opt = curvature.KFAC(model, lr=0.1)
        fwd = torch.compile(model, backend="aot_eager") if compiled else model
        for _ in range(2):
            opt.zero_grad()
            ce(fwd(X), y).backward()
            opt.step()
        runs.append((opt.factors(), [p.detach().clone() for p in model.parameters()]))
        opt.close()
    (fa, pa), (fb, pb) = runs
    assert set(fa) == set(fb) and any(k.startswith("rnn") for k in fb)
    for k in fa:
        for x, z in zip(fa[k], fb[k]):
            torch.testing.assert_close(x, z, rtol=1e-5, atol=1e-6)
    for p, q in zip(pa, pb):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
