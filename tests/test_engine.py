"""The capture engine's backward pulls: several pulls, batched pulls, in-place outputs."""

import pytest
import torch
from torch import nn

import curvature

pytestmark = pytest.mark.usefixtures("float64")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))


def _reference_output_grads(model, X, v):
    """Gradients of <out, v> w.r.t. each Linear output, from retain_grad on a fresh forward."""
    z1 = model[0](X)
    z1.retain_grad()
    z2 = model[2](torch.relu(z1))
    z2.retain_grad()
    (z2 * v).sum().backward()
    model.zero_grad()
    return [z1.grad, z2.grad]


def test_batched_pull_equals_loop_of_pulls():
    model = _model()
    X = torch.randn(4, 5)
    with curvature.capture(model) as cap:
        out = model(X)
    V = torch.randn(3, *out.shape)
    cap.pull(out, V, is_grads_batched=True)
    batched = [cap.calls[n][0].grads[0].clone() for n in ("0", "2")]
    for k in range(3):
        cap.pull(out, V[k])
        single = [cap.calls[n][0].grads[0] for n in ("0", "2")]
        ref = _reference_output_grads(model, X, V[k])
        for b, s, r in zip(batched, single, ref):
            assert b.shape == (3, *s.shape)
            torch.testing.assert_close(b[k], s, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(s, r, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("as_list", [False, True])
def test_batched_pull_of_one_vector_keeps_its_axis(as_list, monkeypatch):
    # K = 1 runs as a plain backward (no vmap) and must look like any batched pull,
    # including the zeros of an output that the vector does not reach
    model = _model()
    X = torch.randn(4, 5)
    with curvature.capture(model) as cap:
        out = model(X)
    v = torch.randn(1, *out.shape)
    seen = []
    grad = torch.autograd.grad
    monkeypatch.setattr(
        torch.autograd, "grad", lambda *a, **k: seen.append(k["is_grads_batched"]) or grad(*a, **k)
    )
    cap.pull([out] if as_list else out, [v] if as_list else v, is_grads_batched=True)
    assert seen == [False]
    ref = _reference_output_grads(model, X, v[0])
    for name, r in zip(("0", "2"), ref):
        g = cap.calls[name][0].grads[0]
        assert g.shape == (1, *r.shape)
        torch.testing.assert_close(g[0], r, rtol=1e-12, atol=1e-12)
    hidden = cap.calls["2"][0].args[0]  # depends on layer 0 only
    cap.pull(hidden, torch.ones(1, *hidden.shape), is_grads_batched=True, unreached="zeros")
    assert cap.calls["0"][0].grads[0].shape == (1, 4, 6)
    assert cap.calls["2"][0].grads[0].shape == (1, 4, 3)
    assert not cap.calls["2"][0].grads[0].any()


def test_expand_carries_the_batched_axis():
    model = _model()
    X = torch.randn(4, 2, 5)
    with curvature.capture(model) as cap:
        out = model(X)
    V = torch.randn(7, *out.shape)
    cap.pull(out, V, is_grads_batched=True)
    rule = curvature.layers.registered_rule(model[2])
    a, g = rule.expand(model[2], cap.calls["2"][0])
    assert a.shape == (4, 2, 1, 6)
    assert g.shape == (7, 4, 2, 1, 3)
    torch.testing.assert_close(g[:, :, :, 0], V)


def test_inplace_activation_after_layer_receives_pre_activation_gradient():
    """ReLU(inplace=True) rewrites the Linear output; the edge still names the Linear node."""
    model = _model()
    X = torch.randn(4, 5)
    with curvature.capture(model) as cap:
        out = model(X)
    v = torch.randn_like(out)
    cap.pull(out, v)
    ref = _reference_output_grads(model, X, v)
    torch.testing.assert_close(cap.calls["0"][0].grads[0], ref[0], rtol=1e-12, atol=1e-12)


def test_several_pulls_then_ordinary_backward():
    model = _model()
    X, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with curvature.capture(model) as cap:
        out = model(X)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    n1 = cap.per_sample_grad_norms(losses)
    n2 = cap.per_sample_grad_norms(losses)
    torch.testing.assert_close(n1, n2)
    losses.mean().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_pulls_do_not_touch_grad():
    model = _model()
    X, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with curvature.capture(model) as cap:
        out = model(X)
    cap.per_sample_grads(nn.functional.cross_entropy(out, y, reduction="none"))
    assert all(p.grad is None for p in model.parameters())


def test_out_buffers_are_filled_in_place():
    model = _model()
    X, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with curvature.capture(model) as cap:
        out = model(X)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    ref = cap.per_sample_grads(losses)
    bufs = {n: torch.full((4, *p.shape), float("nan")) for n, p in model.named_parameters()}
    got = cap.per_sample_grads(losses, out=bufs)
    for n in ref:
        assert got[n] is bufs[n]
        torch.testing.assert_close(got[n], ref[n])


def test_out_buffer_of_wrong_shape_is_refused():
    model = _model()
    X, y = torch.randn(4, 5), torch.randint(0, 3, (4,))
    with curvature.capture(model) as cap:
        out = model(X)
    losses = nn.functional.cross_entropy(out, y, reduction="none")
    with pytest.raises(ValueError, match=r"out\['0.weight'\] must be"):
        cap.per_sample_grads(losses, out={"0.weight": torch.zeros(4, 5, 6)})


class _ViewOut(nn.Module):
    """A parameterized layer whose output is a view (handled by the torch.func fallback)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        return (x @ self.w).view(x.shape[0], 2, 2)


def test_inplace_op_on_an_unsafe_view_output_raises_instead_of_silent_zeros():
    model = _ViewOut()
    X = torch.randn(5, 3)
    with curvature.capture(model) as cap:
        out = model(X)
    out.relu_()  # rebases the view: its recorded edge leaves the graph
    losses = out.pow(2).flatten(1).sum(1)
    with pytest.raises(RuntimeError, match="view of another tensor was modified in place"):
        cap.per_sample_grads(losses)
