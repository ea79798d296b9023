"""Per-sample quantities refuse layers whose sample axis does not hold the loss's samples.

A batch folded into a layer's rows (``x.reshape(N * K, d)`` before an ``nn.Linear``) or
outputs flattened to ``[N * T, C]`` before the loss pair another grouping with the loss's
samples: Fisher / GGN diagonals and EKFAC's corrections would square the wrong sums. The
twins: the same functions with the samples kept on axis 0 (``[N, K, d]`` inputs,
``[N, C, T]`` outputs), checked against the dense GGN and against the per-sample loop.
"""

import pytest
import torch
from torch import nn

import curvature

K, N, V, T, D = 3, 8, 5, 4, 6


class SetNet(nn.Module):
    """An encoder over the ``K`` elements of each sample, then a head over their codes."""

    def __init__(self, folded: bool):
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(5, 4)
        self.head = nn.Linear(K * 4, 3)
        self.folded = folded

    def forward(self, x):  # [N, K, 5]
        n = x.shape[0]
        h = self.enc(x.reshape(n * K, 5)) if self.folded else self.enc(x)
        return self.head(torch.tanh(h).reshape(n, K * 4))


class TokenLM(nn.Module):
    """Embedding, a position-mixing layer, a head; logits ``[N * T, V]`` or ``[N, V, T]``."""

    def __init__(self, flat: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.flat = flat

    def forward(self, x):  # [N, T]
        out = self.head(torch.tanh(self.mix(self.emb(x))).cumsum(1))  # [N, T, V]
        return out.reshape(-1, V) if self.flat else out.transpose(1, 2)


def set_data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, K, 5, generator=g), torch.randint(0, 3, (N,), generator=g)


def lm_data():
    g = torch.Generator().manual_seed(4)
    return torch.randint(0, V, (N, T), generator=g), torch.randint(0, V, (N, T), generator=g)


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_diag_ggn_refuses_flattened_outputs(fisher):
    x, y = lm_data()
    with pytest.raises(ValueError, match="'emb' has 8 entries on its sample axis.* 32 samples"):
        curvature.diag_ggn(TokenLM(flat=True), nn.CrossEntropyLoss(), (x, y.reshape(-1)), fisher)


def test_diag_ggn_mc_of_flattened_outputs_is_unbiased():
    """Independent draws per loss sample: a sequence's summed gradient squares to the sum
    of its positions' squares in expectation, so the MC diagonal converges to the GGN's
    (CrossEntropyLoss: Fisher = GGN); the type-2 vectors, on every position at once, do not
    (225% off without the check)."""
    x, y = lm_data()
    model, ce, data = TokenLM(flat=True), nn.CrossEntropyLoss(), (x, y.reshape(-1))
    dense = curvature.ggn(model, ce, data).diagonal()
    d = curvature.diag_ggn(model, ce, data, "mc", mc_samples=4000)
    flat = torch.cat([d[n].reshape(-1) for n, _ in model.named_parameters()])
    assert (flat - dense).abs().max() < 0.04 * dense.abs().max()  # 0.012 measured


def test_diag_ggn_with_samples_on_axis_0_is_exact():
    x, y = lm_data()
    model, ce = TokenLM(flat=False), nn.CrossEntropyLoss()
    dense = curvature.ggn(model, ce, (x, y)).diagonal()
    d = curvature.diag_ggn(model, ce, (x, y))
    flat = torch.cat([d[n].reshape(-1) for n, _ in model.named_parameters()])
    torch.testing.assert_close(flat, dense, rtol=1e-5, atol=1e-7)


def test_diag_ggn_refuses_folded_rows_and_ekfac_too():
    x, y = set_data()
    ce = nn.CrossEntropyLoss()
    with pytest.raises(ValueError, match="'enc' has 24 entries on its sample axis"):
        curvature.diag_ggn(SetNet(folded=True), ce, (x, y))
    with pytest.raises(ValueError, match="'enc' has 24 entries on its sample axis"):
        curvature.ekfac(SetNet(folded=True), ce, (x, y))
    # the twin with [N, K, 5] inputs: the diagonal of the dense GGN
    model = SetNet(folded=False)
    d = curvature.diag_ggn(model, ce, (x, y))
    flat = torch.cat([d[n].reshape(-1) for n, _ in model.named_parameters()])
    torch.testing.assert_close(flat, curvature.ggn(model, ce, (x, y)).diagonal())


def one_step(opt_cls, model, fisher):
    x, y = set_data()
    ce = nn.CrossEntropyLoss()
    opt = opt_cls(model, lr=1e-2, damping=1e-3, fisher=fisher, loss_func=ce)
    opt.zero_grad()
    ce(model(x), y).backward()
    opt.step()
    return opt


@pytest.mark.parametrize("fisher", ["empirical", "mc", "type-2"])
@pytest.mark.parametrize("opt_cls", [curvature.DiagonalNaturalGradient, curvature.EKFAC])
def test_per_sample_optimizers_refuse_folded_rows(opt_cls, fisher):
    where = "model output" if fisher == "empirical" else "loss input"
    with pytest.raises(ValueError, match=f"'enc' has 24 entries.*the {where} has 8 samples"):
        one_step(opt_cls, SetNet(folded=True), fisher)
    one_step(opt_cls, SetNet(folded=False), fisher)  # the twin trains


@pytest.mark.parametrize("fisher", ["mc", "type-2"])
def test_kfac_factors_of_folded_rows_equal_the_shared_layer(fisher):
    """KFAC (expand) needs no per-sample gradients: the folded layer's factors are those
    of the same layer on ``[N, K, 5]`` (normalized by the loss's samples)."""
    folded = one_step(curvature.KFAC, SetNet(folded=True), fisher).factors()["enc"]
    shared = one_step(curvature.KFAC, SetNet(folded=False), fisher).factors()["enc"]
    for a, b in zip(folded, shared):
        torch.testing.assert_close(a, b)


def test_kfac_empirical_factors_of_folded_rows_equal_the_shared_layer(recwarn):
    """The user's backward: the folded layer's G is normalized by its forward's samples
    (the model output's 8, not its 24 rows): the factors of the layer on [N, K, 5], and
    G the brute-force empirical ``1/N sum_n d_n^T d_n`` (``d_n [K, 4]``: sample n's loss
    gradient at the layer's output, one sample at a time)."""
    folded = one_step(curvature.KFAC, SetNet(folded=True), "empirical").factors()["enc"]
    shared = one_step(curvature.KFAC, SetNet(folded=False), "empirical").factors()["enc"]
    for a, b in zip(folded, shared):
        torch.testing.assert_close(a, b)
    assert not [w for w in recwarn if "sample axis" in str(w.message)]
    x, y = set_data()
    model, outs = SetNet(folded=False), []
    model.enc.register_forward_hook(lambda m, i, o: (o.retain_grad(), outs.append(o))[-1] and None)
    G = torch.zeros(4, 4)
    for n in range(N):
        outs.clear()
        nn.functional.cross_entropy(model(x[n : n + 1]), y[n : n + 1]).backward()
        d = outs[0].grad[0]
        G += d.T @ d / N
    torch.testing.assert_close(folded[1], G)


def test_kfac_empirical_warns_once_about_flattened_logits():
    with pytest.warns(UserWarning, match="G is normalized by its own 8, 8/32 times") as got:
        lm_step(curvature.KFAC, "empirical")
    assert len([w for w in got if "sample axis" in str(w.message)]) == 1


def lm_step(opt_cls, fisher, flat=True):
    x, y = lm_data()
    model, ce = TokenLM(flat=flat), nn.CrossEntropyLoss()
    opt = opt_cls(model, lr=1e-2, damping=1e-3, fisher=fisher, loss_func=ce)
    opt.zero_grad()
    ce(model(x), y.reshape(-1) if flat else y).backward()
    opt.step()


@pytest.mark.parametrize("fisher", ["empirical", "type-2"])
@pytest.mark.parametrize("opt_cls", [curvature.DiagonalNaturalGradient, curvature.EKFAC])
def test_per_sample_optimizers_warn_about_flattened_outputs(opt_cls, fisher):
    """A layer sample covering several loss samples: a coarser (sequence) curvature, which
    can still precondition: one warning, not an error."""
    with pytest.warns(UserWarning, match="has 8 entries on its sample axis.* 32 samples") as got:
        lm_step(opt_cls, fisher)
    assert len([w for w in got if "sample axis" in str(w.message)]) == 1  # once


@pytest.mark.parametrize("opt_cls", [curvature.DiagonalNaturalGradient, curvature.EKFAC])
def test_mc_of_flattened_outputs_and_unflattened_outputs_are_quiet(opt_cls, recwarn):
    lm_step(opt_cls, "mc")  # independent draws per loss sample: unbiased sums
    for fisher in ("empirical", "type-2"):
        lm_step(opt_cls, fisher, flat=False)
    assert not [w for w in recwarn if "sample axis" in str(w.message)]


def union_and_split(opt_cls, sizes):
    """The factors (or diagonal) of one step on the union batch, and of one step whose
    single backward runs through one forward per chunk of ``sizes`` (mean over the union)."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(sum(sizes), 6, generator=g), torch.randint(0, 3, (sum(sizes),), generator=g)
    ce = nn.CrossEntropyLoss(reduction="sum")
    out = []
    for chunks in ([sum(sizes)], sizes):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        opt = opt_cls(model, lr=1e-2, damping=1e-3, loss_func=nn.CrossEntropyLoss())
        opt.zero_grad()
        parts = zip(x.split(chunks), y.split(chunks))
        (sum(ce(model(xi), yi) for xi, yi in parts) / len(x)).backward()
        opt.step()
        state = opt.factors() if hasattr(opt, "factors") else opt.diagonal_
        out.append((state, [p.detach().clone() for p in model.parameters()]))
    return out


@pytest.mark.parametrize("sizes", [[8, 8], [4, 12], [3, 5, 8]])
@pytest.mark.parametrize("opt_cls", [curvature.KFAC, curvature.EKFAC])
def test_empirical_several_forwards_in_one_backward_equal_the_union(opt_cls, sizes):
    """Each forward's calls fold with their own ``N`` (before: the first call's ``N`` for
    all, G halved for two equal chunks; unequal chunks raised a shape error)."""
    (union, p_union), (split, p_split) = union_and_split(opt_cls, sizes)
    for name in union:
        for a, b in zip(union[name], split[name]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p_union, p_split, rtol=1e-5, atol=1e-7)


def test_diagonal_several_forwards_in_one_backward_equal_the_union():
    (union, p_union), (split, p_split) = union_and_split(curvature.DiagonalNaturalGradient, [4, 12])
    for name in union:
        torch.testing.assert_close(union[name], split[name], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(p_union, p_split, rtol=1e-5, atol=1e-7)


class Broadcast(nn.Module):
    """A layer fed a batch-free input broadcast over the batch (a learned context)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.ctx, self.head = nn.Linear(5, 4), nn.Linear(3, 4), nn.Linear(4, 3)
        self.register_buffer("c", torch.randn(1, 3))

    def forward(self, x):
        return self.head(torch.tanh(self.inp(x) + self.ctx(self.c)))


@pytest.mark.parametrize("fisher", ["type-2", "empirical"])
def test_kfac_refuses_a_layer_coarser_than_the_samples(fisher):
    """Its one row sums the samples' columns before the outer product (the ``ctx.bias``
    block was 3.8x the exact one without an error); flattened logits of a model that
    mixes positions alike (``TokenLM``: ``cumsum`` over positions)."""
    x, y = set_data()
    with pytest.raises(ValueError, match="'ctx' has 1 entries.* 8 samples: each of its"):
        curvature.kfac(Broadcast(), nn.CrossEntropyLoss(), (x[:, 0], y), fisher=fisher)
    t, u = lm_data()
    with pytest.raises(ValueError, match="'emb' has 8 entries.* 32 samples: each of its"):
        curvature.kfac(TokenLM(flat=True), nn.CrossEntropyLoss(), (t, u.reshape(-1)), fisher=fisher)


def test_kfac_mc_of_flattened_logits_equals_the_unflattened_model():
    """Independent draws per loss sample: no refusal, and the same factors as with
    ``[N, C, T]`` logits (the same draws)."""
    t, u = lm_data()
    ce = nn.CrossEntropyLoss()
    flat = curvature.kfac(TokenLM(flat=True), ce, (t, u.reshape(-1)), fisher="mc").factors
    nct = curvature.kfac(TokenLM(flat=False), ce, (t, u), fisher="mc").factors
    for name in flat:
        for a, b in zip(flat[name], nct[name]):
            torch.testing.assert_close(a, b)


def test_kfac_optimizer_type2_warns_once_about_a_coarser_layer(recwarn):
    lm_step(curvature.KFAC, "type-2")
    hits = [w for w in recwarn if "sample axis" in str(w.message)]
    assert len(hits) == 1 and "'emb' has 8 entries" in str(hits[0].message)
