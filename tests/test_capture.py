"""The capture engine: one forward, no surviving hooks, graph reuse and clear errors."""

from __future__ import annotations

import gc
import sys
from collections import Counter

import pytest
import torch
from cases import (
    assert_close,
    assert_grads_match,
    default_dtype,
    flat,
    torch_func_per_sample_grads,
)
from torch import nn

import curvature

HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hook_counts(model: nn.Module) -> dict:
    """Number of registered module hooks of each kind, per module name."""
    return {
        (name, kind): len(getattr(m, kind))
        for name, m in model.named_modules()
        for kind in HOOK_DICTS
        if len(getattr(m, kind))
    }


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def data(N: int = 5):
    torch.manual_seed(0)
    return torch.randn(N, 3, dtype=torch.float64), torch.randint(0, 2, (N,))


class Mixed(nn.Module):
    """Rules (Embedding, Linear, LayerNorm) and replayed layers (attention, PReLU)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.lin1 = nn.Linear(4, 4)
        self.prelu = nn.PReLU()
        self.ln = nn.LayerNorm(4)
        self.lin2 = nn.Linear(4, 3)

    def forward(self, idx):
        h = self.emb(idx)
        h = h + self.att(h, h, h, need_weights=False)[0]
        h = self.ln(self.prelu(self.lin1(h)))
        return self.lin2(h).mean(1)


def mixed_problem(N: int = 4):
    torch.manual_seed(0)
    with default_dtype(torch.float64):
        model = Mixed()
    return model, torch.randint(0, 7, (N, 5)), torch.randint(0, 3, (N,)), nn.CrossEntropyLoss()


# ---------------------------------------------------------------------------------------
# One forward
# ---------------------------------------------------------------------------------------
def test_capture_runs_no_second_forward():
    model, X, y, loss_func = mixed_problem()
    calls: Counter = Counter()
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: calls.update([name]))
        for name, m in model.named_modules()
    ]
    try:
        with curvature.capture(model) as cap:
            out = model(X)
        after_forward = dict(calls)
        losses = curvature.per_sample_losses(loss_func, out, y)
        cap.per_sample_grads(losses)
        cap.per_sample_grad_norms(losses)
        cap.gram(losses)
    finally:
        for h in handles:
            h.remove()
    assert after_forward[""] == 1
    assert after_forward["lin1"] == after_forward["lin2"] == 1
    # the attention and PReLU rules replay their own module; nothing else runs again
    replayed = {"att", "prelu"}
    assert {k: v for k, v in calls.items() if k not in replayed} == {
        k: 1 for k in after_forward if k not in replayed
    }


def test_per_sample_grads_function_runs_one_forward():
    model = mlp()
    X, y = data()
    calls = Counter()
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: calls.update([name]))
        for name, m in model.named_modules()
    ]
    try:
        curvature.per_sample_grads(model, nn.CrossEntropyLoss(), X, y)
    finally:
        for h in handles:
            h.remove()
    assert calls == Counter({"": 1, "0": 1, "1": 1, "2": 1})


def test_queries_reuse_the_graph_and_leave_grad_untouched():
    model = mlp()
    X, y = data()
    loss_func = nn.CrossEntropyLoss()
    with curvature.capture(model) as cap:
        out = model(X)
    losses = curvature.per_sample_losses(loss_func, out, y)
    first = cap.per_sample_grads(losses)
    norms = cap.per_sample_grad_norms(losses)
    gram = cap.gram(losses)
    again = cap.per_sample_grads(losses)
    assert all(p.grad is None for p in model.parameters())
    assert_grads_match(again, first)
    assert_close(norms, flat(first).norm(dim=1))
    assert_close(gram, flat(first) @ flat(first).T)
    # the graph is still there for the user's own backward, with the ordinary gradient
    loss_func(out, y).backward()
    assert_grads_match(
        {k: g.mean(0) for k, g in first.items()},
        {k: p.grad for k, p in model.named_parameters()},
    )


def test_later_forwards_outside_the_block_are_not_recorded():
    model = mlp()
    X, y = data()
    loss_func = nn.CrossEntropyLoss()
    with curvature.capture(model) as cap:
        out = model(X)
    model(torch.randn(9, 3, dtype=torch.float64))  # different batch size: would clash
    losses = curvature.per_sample_losses(loss_func, out, y)
    assert_grads_match(
        cap.per_sample_grads(losses), torch_func_per_sample_grads(model, loss_func, X, y)
    )


def test_reentering_a_capture_records_the_new_forward_only():
    model = mlp()
    X, y = data()
    loss_func = nn.CrossEntropyLoss()
    cap = curvature.capture(model)
    with cap:
        model(torch.randn(9, 3, dtype=torch.float64))
    with cap:
        out = model(X)
    grads = cap.per_sample_grads(curvature.per_sample_losses(loss_func, out, y))
    assert_grads_match(grads, torch_func_per_sample_grads(model, loss_func, X, y))


def test_queries_inside_the_block_match_queries_after_it():
    model = mlp()
    X, y = data()
    loss_func = nn.CrossEntropyLoss()
    with curvature.capture(model) as cap:
        out = model(X)
        losses = curvature.per_sample_losses(loss_func, out, y)
        inside = cap.per_sample_grads(losses)
        inside_norms = cap.per_sample_grad_norms(losses)
    assert_grads_match(inside, cap.per_sample_grads(losses))
    assert_close(inside_norms, cap.per_sample_grad_norms(losses))


def test_queries_inside_the_block_with_a_replayed_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)).double()
    X, y = data()
    loss_func = nn.CrossEntropyLoss()
    with curvature.capture(model) as cap:
        out = model(X)
        grads = cap.per_sample_grads(curvature.per_sample_losses(loss_func, out, y))
    assert_grads_match(grads, torch_func_per_sample_grads(model, loss_func, X, y))


# ---------------------------------------------------------------------------------------
# In-place ops on layer outputs
# ---------------------------------------------------------------------------------------
def test_relu_inplace_after_linear_and_conv_matches_torch_func():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 3, 3),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(9, 4),
        nn.ReLU(inplace=True),
        nn.Linear(4, 2),
    ).double()
    X, y = torch.randn(5, 2, 5, dtype=torch.float64), torch.randint(0, 2, (5,))
    loss_func = nn.CrossEntropyLoss()
    grads = curvature.per_sample_grads(model, loss_func, X, y)
    assert_grads_match(grads, torch_func_per_sample_grads(model, loss_func, X, y))


@pytest.mark.parametrize("layer", ["linear_on_sequence", "attention"])
def test_inplace_op_on_a_view_output_matches_torch_func(layer):
    torch.manual_seed(0)
    with default_dtype(torch.float64):
        if layer == "linear_on_sequence":
            model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 2))
        else:
            model = InplaceResidualAttention()
        X, y = torch.randn(3, 6, 4), torch.randn(3, 6, 2)
    loss_func = nn.MSELoss()
    grads = curvature.per_sample_grads(model, loss_func, X, y)
    assert_grads_match(grads, torch_func_per_sample_grads(model, loss_func, X, y))


class InplaceResidualAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.att(x, x, x, need_weights=False)[0]
        h += x
        return self.fc(h)


# ---------------------------------------------------------------------------------------
# No hooks survive
# ---------------------------------------------------------------------------------------
def test_no_hooks_survive_the_with_block():
    model, X, y, loss_func = mixed_problem()
    before = hook_counts(model)
    with curvature.capture(model) as cap:
        assert hook_counts(model) != before  # the capture did hook the layers
        out = model(X)
    assert hook_counts(model) == before == {}
    cap.per_sample_grads(curvature.per_sample_losses(loss_func, out, y))
    curvature.per_sample_grads(model, loss_func, X, y)
    assert hook_counts(model) == {}


def test_no_hooks_survive_an_exception_in_the_block():
    model = mlp()
    with pytest.raises(KeyError):
        with curvature.capture(model):
            model(data()[0])
            raise KeyError("user error")
    assert hook_counts(model) == {}


def test_deleted_capture_leaves_no_hooks():
    model = mlp()
    cap = curvature.capture(model)
    cap.attach()  # never detached
    model(data()[0])
    assert hook_counts(model)
    del cap
    gc.collect()
    assert hook_counts(model) == {}


def test_refused_capture_is_collected_without_errors(monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    try:
        curvature.capture(nn.Sequential(nn.ReLU()))
    except ValueError:
        pass
    gc.collect()
    assert [type(u.exc_value).__name__ for u in unraisable] == []


def test_user_hooks_are_left_in_place():
    model = mlp()
    handle = model[0].register_forward_hook(lambda *args: None)
    with curvature.capture(model):
        model(data()[0])
    assert hook_counts(model) == {("0", "_forward_hooks"): 1}
    handle.remove()


# ---------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------
@pytest.fixture
def captured():
    model = mlp()
    X, y = data()
    with curvature.capture(model) as cap:
        out = model(X)
    return cap, curvature.per_sample_losses(nn.CrossEntropyLoss(), out, y)


@pytest.mark.parametrize("query", ["per_sample_grads", "per_sample_grad_norms", "gram"])
@pytest.mark.parametrize(
    "reshape",
    [lambda t: t[:, None], lambda t: t[:-1], lambda t: torch.cat([t, t]), lambda t: t.sum()],
    ids=["2d", "too_short", "too_long", "scalar"],
)
def test_losses_must_be_1d_with_batch_length(captured, query, reshape):
    cap, losses = captured
    with pytest.raises(ValueError, match=r"losses must be a 1-D tensor \[N\] = \[5\]"):
        getattr(cap, query)(reshape(losses))


def test_losses_must_require_grad(captured):
    cap, losses = captured
    with pytest.raises(ValueError, match="do not require grad"):
        cap.per_sample_grads(losses.detach())


def test_losses_must_come_from_the_captured_forward(captured):
    cap, _ = captured
    unrelated = torch.randn(5, dtype=torch.float64, requires_grad=True) * 2
    with pytest.raises(ValueError, match="do not depend on the captured forward"):
        cap.per_sample_grads(unrelated)


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.ReLU(), nn.Flatten()),
        nn.Sequential(nn.Linear(3, 2).requires_grad_(False), nn.Tanh()),
    ],
    ids=["no_parameters", "all_frozen"],
)
def test_model_without_trainable_layers_is_refused(model):
    with pytest.raises(ValueError, match="no trainable parameters"):
        curvature.capture(model)


def test_query_without_a_recorded_forward_is_refused():
    model = mlp()
    cap = curvature.capture(model)
    losses = torch.ones(5, requires_grad=True) * 1.0
    with pytest.raises(RuntimeError, match="No forward pass was recorded"):
        cap.per_sample_grads(losses)
    with cap, torch.no_grad():
        model(data()[0])
    with pytest.raises(RuntimeError, match="No forward pass was recorded"):
        cap.gram(losses)


@pytest.mark.parametrize(
    "bn", [nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False).eval()]
)
def test_batchnorm_with_batch_statistics_is_refused(bn):
    model = nn.Sequential(nn.Linear(3, 4), bn, nn.Linear(4, 2)).double()
    X, y = data()
    with pytest.raises(ValueError, match=r"Module '1' \(BatchNorm1d\).*mixes the samples"):
        curvature.capture(model)
    with pytest.raises(ValueError, match="batch statistics"):
        curvature.per_sample_grads(model, nn.CrossEntropyLoss(), X, y)


def test_unknown_layer_with_fallback_error_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.PReLU(), nn.Linear(4, 2)).double()
    X, y = data()
    with pytest.raises(ValueError, match=r"Module '1' \(PReLU\).*no layer rule"):
        curvature.capture(model, unsupported="error")
    with pytest.raises(ValueError, match="no layer rule"):
        curvature.per_sample_grads(model, nn.CrossEntropyLoss(), X, y, unsupported="error")
    # frozen, the unknown layer needs no rule
    model[1].requires_grad_(False)
    curvature.capture(model, unsupported="error")


def test_unknown_unsupported_value_is_refused():
    with pytest.raises(ValueError, match="unsupported='vmap'"):
        curvature.capture(mlp(), unsupported="vmap")


def test_the_deprecated_fallback_keyword_still_works_and_warns():
    with pytest.warns(DeprecationWarning, match="fallback"):
        cap = curvature.capture(mlp(), fallback="functorch")
    assert isinstance(cap, curvature.Capture)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="fallback='vmap'"):
        curvature.capture(mlp(), fallback="vmap")


def test_query_after_backward_freed_the_graph_is_refused():
    model = mlp()
    X, y = data()
    loss_func = nn.CrossEntropyLoss()
    with curvature.capture(model) as cap:
        out = model(X)
    losses = curvature.per_sample_losses(loss_func, out, y)
    loss_func(out, y).backward()
    with pytest.raises(RuntimeError, match="already freed"):
        cap.per_sample_grads(losses)


def test_query_after_retain_graph_false_is_refused(captured):
    cap, losses = captured
    cap.per_sample_grad_norms(losses, retain_graph=False)
    with pytest.raises(RuntimeError, match="already freed"):
        cap.gram(losses)


def test_nested_with_on_one_capture_is_refused():
    model = mlp()
    cap = curvature.capture(model)
    with cap:
        with pytest.raises(RuntimeError, match="already active"):
            cap.__enter__()
    assert hook_counts(model) == {}


def test_attention_dropout_in_train_mode_uses_the_recorded_masks():
    """The projections' gradients come from the recorded graph, dropout masks included."""
    torch.manual_seed(0)
    model = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with curvature.capture(model) as cap:
        out = model(x, x, x)[0]
    losses = out.pow(2).sum((1, 2))
    grads = cap.per_sample_grads(losses)
    losses.sum().backward()  # the same forward, the same dropout masks
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name].sum(0), p.grad, rtol=1e-10, atol=1e-12)


def test_attention_dropout_is_refused_where_a_replay_is_needed(monkeypatch):
    from curvature.layers.attention import MultiheadAttentionRule

    monkeypatch.setattr(MultiheadAttentionRule, "_from_graph", lambda self, module, call: None)
    model = nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True).double()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    with curvature.capture(model) as cap:
        out = model(x, x, x)[0]
    with pytest.raises(RuntimeError, match="dropout"):
        cap.per_sample_grads(out.pow(2).sum((1, 2)))


def test_embedding_scale_grad_by_freq_is_refused():
    model = nn.Sequential(nn.Embedding(5, 3, scale_grad_by_freq=True), nn.Flatten()).double()
    X = torch.randint(0, 5, (4, 2))
    with curvature.capture(model) as cap:
        out = model(X)
    with pytest.raises(ValueError, match="scale_grad_by_freq"):
        cap.per_sample_grads(out.pow(2).sum(1))
