"""The Fisher diagonal of convolutions in chunks of samples (``curvature.layer_diagonal``).

A convolution's diagonal ``sum_{k,n} (sum_s g a^T)^2`` needs per-sample gradients; the
unfolded patches of the whole batch are many times its input, so they are made a chunk
of samples at a time, the chunk size from a memory bound (``DIAGONAL_CHUNK_ELEMENTS``,
``DIAGONAL_CHUNK_SHARE``). Twin: per-sample gradients by ``torch.func`` (``vmap`` of
``grad`` of each sample's loss), squared and summed, for several chunk counts, a ragged
last chunk and one sample per chunk; and the optimizer's first step on them.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import curvature
import curvature.layer_diagonal as layer_diagonal
import curvature.layer_stats as layer_stats

pytestmark = pytest.mark.usefixtures("float64_seeded")


@pytest.fixture(autouse=True)
def _unfolded_path(monkeypatch):
    """These tests are about the unfolded path (convolutions' direct path: off)."""
    monkeypatch.setattr(layer_diagonal, "DIRECT_DIAGONAL", False)


N = 7


class Net(nn.Module):
    """Conv2d (groups, padding) -> Conv2d (stride, no bias) -> Conv1d over rows -> Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(2, 4, 3, padding=1, groups=2)
        self.c2 = nn.Conv2d(4, 3, 3, stride=2, padding=1, bias=False)
        self.c3 = nn.Conv1d(3, 2, 2, padding="same", padding_mode="circular")
        self.fc = nn.Linear(2 * 9, 3)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c1(x))))  # [N, 3, 3, 3]
        h = torch.tanh(self.c3(h.flatten(2)))  # [N, 2, 9]
        return self.fc(h.flatten(1))


class Twice(nn.Module):
    """One Conv2d called twice (two calls of one module: their positions concatenated)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Conv2d(2, 2, 3, padding=1)
        self.fc = nn.Linear(2 * 36, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.c(torch.tanh(self.c(x)))).flatten(1))


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 2, 6, 6, generator=g), torch.randint(0, 3, (N,), generator=g)


def brute_force(model, X, y):
    """``sum_n grad_n^2`` per parameter, ``grad_n`` the gradient of sample ``n``'s loss."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, t):
        out = functional_call(model, p, (x[None],))
        return nn.functional.cross_entropy(out, t[None], reduction="sum")

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))(params, X, y)
    return {k: g.pow(2).sum(0) for k, g in per_sample.items()}


def samples_seen(monkeypatch, owners, name, arg=0):
    """Record the leading size of argument ``arg`` of every call of ``owner.name`` (for each
    module of ``owners``, which share one spy); the calls go through."""
    seen = []
    inner = getattr(owners[0], name)

    def spy(*args):
        seen.append(args[arg].shape[0])
        return inner(*args)

    for owner in owners:
        monkeypatch.setattr(owner, name, spy)
    return seen


def chunks_seen(monkeypatch):
    """Record the samples of every expanded diagonal (one entry per chunk and layer): the
    chunks' (``layer_diagonal``) and the whole batch's (``layer_stats``)."""
    return samples_seen(monkeypatch, (layer_diagonal, layer_stats), "expanded_diagonal")


def chunk_bound(monkeypatch, bound):
    """Chunks bounded by ``bound`` elements alone (no share of the free memory; the
    Kronecker statistics' and EKFAC's corrections' floors too)."""
    monkeypatch.setattr(layer_diagonal, "DIAGONAL_CHUNK_SHARE", 0.0)
    monkeypatch.setattr(layer_diagonal, "KFAC_CHUNK_SHARE", 0.0)
    monkeypatch.setattr(layer_diagonal, "DIAGONAL_CHUNK_ELEMENTS", bound)
    monkeypatch.setattr(layer_diagonal, "KFAC_CHUNK_ELEMENTS", bound)
    monkeypatch.setattr(layer_diagonal, "CORRECTION_CHUNK_ELEMENTS", bound)


# bounds in elements (DIAGONAL_CHUNK_SHARE = 0): one sample per chunk, a few per chunk
# (ragged last chunks), and the whole batch at once
BOUNDS = {"one-sample": 1, "small": 3000, "medium": 9000, "whole": 2**30}


def empirical_in_chunks(model: nn.Module, bound: int, monkeypatch):
    """``(X, brute-force diagonal, diag_ggn's, chunk sizes seen)`` of the empirical Fisher
    (summed cross-entropy) with chunks bounded by ``bound`` elements alone."""
    X, y = data()
    expected = brute_force(model, X, y)
    chunk_bound(monkeypatch, bound)
    seen = chunks_seen(monkeypatch)
    loss = nn.CrossEntropyLoss(reduction="sum")
    return X, expected, curvature.diag_ggn(model, loss, (X, y), fisher="empirical"), seen


@pytest.mark.parametrize("bound", BOUNDS.values(), ids=BOUNDS.keys())
def test_chunked_diagonal_equals_per_sample_gradients_squared(bound, monkeypatch):
    X, expected, got, seen = empirical_in_chunks(Net(), bound, monkeypatch)
    assert list(got) == list(expected)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-10, atol=1e-12, msg=k)
    # three convolutions: their chunks add up to the batch each
    assert sum(seen) == 3 * N
    if bound == 1:
        assert seen == [1] * (3 * N)
    elif bound == 2**30:
        assert seen == [N] * 3
    else:
        assert len(seen) > 3 and any(s < max(seen) for s in seen)  # chunks, some ragged


def test_the_bounds_cut_the_batch_as_documented(monkeypatch):
    """``small`` and ``medium`` give several chunk counts, ragged last chunks included."""
    counts = {}
    for name in ("small", "medium"):
        chunk_bound(monkeypatch, BOUNDS[name])
        seen = chunks_seen(monkeypatch)
        model, (X, y) = Net(), data()
        curvature.diag_ggn(model, nn.CrossEntropyLoss(), (X, y), fisher="empirical")
        counts[name] = seen
    assert counts["small"] != counts["medium"]
    assert any(N % s for s in counts["small"] + counts["medium"])  # a ragged last chunk


@pytest.mark.parametrize("fisher", ["type-2", "mc"])
def test_chunked_equals_whole_batch_for_the_other_fishers(fisher, monkeypatch):
    model, (X, y) = Net(), data()
    loss = nn.CrossEntropyLoss()
    whole = curvature.diag_ggn(copy.deepcopy(model), loss, (X, y), fisher=fisher)
    chunk_bound(monkeypatch, 3000)
    seen = chunks_seen(monkeypatch)
    chunked = curvature.diag_ggn(copy.deepcopy(model), loss, (X, y), fisher=fisher)
    assert len(seen) > 3
    for k in whole:
        torch.testing.assert_close(chunked[k], whole[k], rtol=1e-10, atol=1e-14, msg=k)


def test_optimizer_step_divides_by_the_chunked_diagonal(monkeypatch):
    """DiagonalNaturalGradient's first step: ``-lr g / (d + lambda)`` with ``d`` the
    per-sample twin, its statistics in chunks."""
    model, (X, y) = Net(), data()
    loss = nn.CrossEntropyLoss(reduction="sum")
    d = brute_force(model, X, y)
    chunk_bound(monkeypatch, 3000)
    monkeypatch.setattr(layer_diagonal, "DIRECT_DIAGONAL", False)  # the unfolded path
    seen = chunks_seen(monkeypatch)
    lr, damping = 0.1, 1e-2
    opt = curvature.DiagonalNaturalGradient(model, lr=lr, damping=damping, loss_func=loss)
    before = {k: p.detach().clone() for k, p in model.named_parameters()}
    loss(model(X), y).backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    opt.step()
    assert len(seen) > 3
    for k, p in model.named_parameters():
        expected = before[k] - lr * grads[k] / (d[k] + damping)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-10, atol=1e-12, msg=k)


def test_the_default_bound_keeps_small_inputs_whole(monkeypatch):
    """With the default bound a small batch is one chunk per layer (no extra calls)."""
    seen = chunks_seen(monkeypatch)
    model, (X, y) = Net(), data()
    curvature.diag_ggn(model, nn.CrossEntropyLoss(), (X, y), fisher="empirical")
    assert seen == [N] * 3


def test_the_default_bound_cuts_a_large_batch_within_the_documented_bound(monkeypatch):
    """A 3x3 convolution on 16 x 16 images, batch 64: the patches of the whole batch are
    9x its input; with the default bound the batch is cut into chunks whose temporaries
    (``S C (2 D + K D_out) + K C D_out D`` per sample) stay within ``max(2**16,
    numel(x) + numel(g))``."""
    seen = chunks_seen(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Flatten(), nn.Linear(8 * 256, 3))
    X, y = torch.randn(64, 4, 16, 16), torch.randint(0, 3, (64,))
    curvature.diag_ggn(model, nn.CrossEntropyLoss(), (X, y), fisher="empirical")
    S, D, D_out = 256, 4 * 9 + 1, 8
    per_sample = S * (2 * D + D_out) + D_out * D
    bound = max(layer_diagonal.DIAGONAL_CHUNK_ELEMENTS, X.numel() + 64 * D_out * S)
    assert len(seen) > 1 and sum(seen) == 64
    assert max(seen) * per_sample <= bound


@pytest.mark.parametrize("bound", [1, 8000, 2**30], ids=["one-sample", "ragged", "whole"])
def test_a_convolution_called_twice_in_chunks_equals_the_twin(bound, monkeypatch):
    _, expected, got, seen = empirical_in_chunks(Twice(), bound, monkeypatch)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], rtol=1e-10, atol=1e-12, msg=k)
    # per sample 2 x 36 positions: S C (2 D + D_out) + D_out D = 2918 elements
    assert seen == {1: [1] * N, 8000: [2, 2, 2, 1], 2**30: [N]}[bound]


# -- the Kronecker statistics of the optimizers, a chunk of samples at a time ----------------
@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("fisher", ["empirical", "mc"])
@pytest.mark.parametrize("make", [Net, Twice], ids=["net", "twice"])
def test_kfac_statistics_in_chunks_equal_the_whole_batch(make, fisher, approx, monkeypatch):
    def factors(bound):
        if bound is not None:
            chunk_bound(monkeypatch, bound)
        model = make()
        opt = curvature.KFAC(
            model, lr=0.1, loss_func=nn.CrossEntropyLoss(), fisher=fisher, kfac_approx=approx
        )
        X, y = data()
        for _ in range(2):
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(X), y).backward()
            opt.step()
        return opt.factors(), [p.detach().clone() for p in model.parameters()]

    whole, params = factors(None)
    # one sample per chunk, then a ragged last chunk of 3 + 3 + 1 samples (N = 7)
    for bound in (1, 2 * 36 * 19 * 3):
        chunked, chunked_params = factors(bound)
        assert set(chunked) == set(whole)
        for name, (A, G) in whole.items():
            torch.testing.assert_close(chunked[name][0], A)
            torch.testing.assert_close(chunked[name][1], G)
        for p, q in zip(params, chunked_params):
            torch.testing.assert_close(p, q)


def test_kfac_statistics_unfold_a_chunk_of_samples_at_a_time(monkeypatch):
    import curvature.layers.conv as conv

    # the patches (with the bias column) come from biased_patches, or on a CPU from
    # kernel_major_sums (here small)
    monkeypatch.setattr(conv, "KERNEL_MAJOR_MIN_ELEMENTS", 0)
    channel_major = samples_seen(monkeypatch, (conv,), "biased_patches", arg=1)
    kernel_major = samples_seen(monkeypatch, (conv,), "kernel_major_sums", arg=1)

    def step():
        channel_major.clear()
        kernel_major.clear()
        model = Twice()
        opt = curvature.KFAC(model, lr=0.1, loss_func=nn.CrossEntropyLoss())
        X, y = data()
        nn.CrossEntropyLoss()(model(X), y).backward()
        opt.step()

        return channel_major + kernel_major

    assert set(step()) == {N}  # small inputs: the whole batch at once
    assert kernel_major  # (the CPU's route)
    # S C D = 72 * 1 * 19 elements per sample (the patches): 3 samples per chunk
    chunk_bound(monkeypatch, 3 * 72 * 19)
    assert sorted(set(step())) == [1, 3]  # chunks of 3, 3 and 1 samples


def test_kfac_statistics_of_a_small_layer_are_one_chunk_above_the_share_bound(monkeypatch):
    """A padded 3x3 convolution on 1x1 maps (ResNet-18's last stage on 28x28 inputs), batch
    128: its patches are 9x its input, above the share bound ``numel(x) + numel(g)`` and
    the diagonal's floor, but within ``KFAC_CHUNK_ELEMENTS``: the statistics take the
    whole batch in one unfold (one ``D x D`` GEMM); with the floor lowered to the
    diagonal's, the same batch is cut, and the factors agree."""
    import curvature.layers.conv as conv

    seen = samples_seen(monkeypatch, (conv,), "biased_patches", arg=1)
    n, c = 128, 64  # patches 128 x 576 = 73,728 elements; x + g = 16,384

    def factors():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.Flatten(), nn.Linear(c, 3))
        opt = curvature.KFAC(model, lr=0.1)
        g = torch.Generator().manual_seed(2)
        X, y = torch.randn(n, c, 1, 1, generator=g), torch.randint(0, 3, (n,), generator=g)
        nn.CrossEntropyLoss()(model(X), y).backward()
        opt.step()
        return opt.factors()["0"]

    assert n * 9 * c > max(layer_diagonal.DIAGONAL_CHUNK_ELEMENTS, 2 * n * c)
    whole = factors()
    assert seen == [n]
    seen.clear()
    monkeypatch.setattr(
        layer_diagonal, "KFAC_CHUNK_ELEMENTS", layer_diagonal.DIAGONAL_CHUNK_ELEMENTS
    )
    cut = factors()
    assert len(seen) > 1 and sum(seen) == n
    for a, b in zip(whole, cut):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_kfac_statistics_take_the_floor_of_their_device(monkeypatch, device):
    """A padded 3x3 convolution on 16x16 maps, batch 64: its patches (64 x 256 x 72
    elements, 1.18M) lie between the CPU's floor ``KFAC_CHUNK_ELEMENTS`` (2**20) and
    CUDA's ``KFAC_CHUNK_ELEMENTS_CUDA`` (2**22), above the share bound: a CPU cuts the
    batch in two (56 and 8 samples), CUDA takes it whole (one copy of the patches, one
    GEMM per factor); each device's floor is its own (the other one's changed: nothing
    changes), and the factors equal the CPU's whole-batch ones."""
    import curvature.layers.conv as conv

    monkeypatch.setattr(conv, "KERNEL_MAJOR_DEVICES", ())  # CUDA's route on a CPU too
    seen = samples_seen(monkeypatch, (conv,), "biased_patches", arg=1)
    n, c = 64, 8

    def factors(dev):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.Flatten(), nn.Linear(c * 256, 3))
        opt = curvature.KFAC(model.to(dev), lr=0.1)
        g = torch.Generator().manual_seed(2)
        X, y = torch.randn(n, c, 16, 16, generator=g), torch.randint(0, 3, (n,), generator=g)
        nn.CrossEntropyLoss()(model(X.to(dev)), y.to(dev)).backward()
        opt.step()
        return [f.cpu() for f in opt.factors()["0"]]

    patches = n * 256 * 9 * c
    assert layer_diagonal.KFAC_CHUNK_ELEMENTS < patches < layer_diagonal.KFAC_CHUNK_ELEMENTS_CUDA
    assert patches > layer_diagonal.KFAC_CHUNK_SHARE * 2 * n * c * 256
    other = "KFAC_CHUNK_ELEMENTS" if device == "cuda" else "KFAC_CHUNK_ELEMENTS_CUDA"
    per_chunk = layer_diagonal.KFAC_CHUNK_ELEMENTS // (256 * 9 * c)  # 56 samples
    want = [n] if device == "cuda" else [per_chunk, n - per_chunk]
    got = factors(device)
    assert seen == want
    seen.clear()
    monkeypatch.setattr(layer_diagonal, other, 1)  # the other device's floor: no effect
    again = factors(device)
    assert seen == want
    monkeypatch.setattr(layer_diagonal, "KFAC_CHUNK_ELEMENTS", 2**40)
    monkeypatch.setattr(layer_diagonal, "KFAC_CHUNK_ELEMENTS_CUDA", 2**40)
    whole = factors("cpu")
    for a, b, w in zip(got, again, whole):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(a, w)


def test_ekfac_corrections_of_a_small_layer_take_many_samples_per_chunk(monkeypatch):
    """EKFAC's corrections of a padded 3x3 convolution on 1x1 maps, batch 128 (ResNet-18's
    last stage on 28x28 inputs): one position per sample, so no rotated per-sample
    gradient ``[64, 577]`` is formed (one GEMM of the squared rotations); a sample's
    temporaries are its patches, their copy and rotation and its rotated gradients. The
    diagonal's floor (once 128 one-sample chunks, then chunks of 27 while the per-sample
    gradient was counted) cuts the batch into chunks of 36; ``CORRECTION_CHUNK_ELEMENTS``
    takes it whole, and the corrections agree."""
    import curvature.layers.conv as conv

    n, c = 128, 64

    def chunks(floor):
        monkeypatch.setattr(layer_diagonal, "CORRECTION_CHUNK_ELEMENTS", floor)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.Flatten(), nn.Linear(c, 3))
        opt = curvature.EKFAC(model, lr=0.1, inverse_every=1)
        g = torch.Generator().manual_seed(2)
        X, y = torch.randn(n, c, 1, 1, generator=g), torch.randint(0, 3, (n,), generator=g)
        seen = samples_seen(monkeypatch, (conv,), "unfold_patches", arg=1)
        for _ in range(2):  # the corrections need a basis: the second step has one
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(X), y).backward()
            opt.step()
        approx = curvature.ekfac(model, nn.CrossEntropyLoss(), (X, y), fisher="empirical")
        corrections = {b.name: b.corrections for b in approx.blocks}
        opt.close()
        monkeypatch.undo()
        return [k for k in seen if k < n], corrections  # the corrections' chunks

    per_sample = 3 * 577 + 64
    small, cut = chunks(layer_diagonal.DIAGONAL_CHUNK_ELEMENTS)
    want = layer_diagonal.DIAGONAL_CHUNK_ELEMENTS // per_sample
    assert want == 36 and small[: n // want] == [want] * (n // want)
    whole, kept = chunks(layer_diagonal.CORRECTION_CHUNK_ELEMENTS)
    assert whole == []  # one chunk: the batch (n samples, not recorded)
    for name in kept:
        torch.testing.assert_close(cut[name], kept[name], rtol=1e-5, atol=1e-7)


class Pooled(nn.Module):
    """Convolutions (one called twice), a global average pool and a small Linear: every
    Kronecker factor of full rank with 7 samples (EKFAC's eigenbasis is then unique up to
    signs, so rounding-level changes of the statistics change the steps at rounding level
    only; with a rank-deficient factor any basis of its null space is as good)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(2, 4, 3, padding=1, groups=2)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = torch.tanh(self.c2(torch.tanh(self.c2(torch.tanh(self.c1(x))))))
        return self.fc(h.mean((2, 3)))


@pytest.mark.parametrize("fisher", ["empirical", "mc"])
def test_ekfac_corrections_in_chunks_equal_the_whole_batch(fisher, monkeypatch):
    """EKFAC's eigenvalue corrections (``sum_n (QG^T grad_n QA)^2``) of convolutions, a
    chunk of samples at a time: the same steps as the whole batch at once."""
    chunks = []
    inner = layer_diagonal.summed_over_chunks
    monkeypatch.setattr(
        layer_diagonal,
        "summed_over_chunks",
        lambda fn, calls, chunk: chunks.append(chunk) or inner(fn, calls, chunk),
    )

    def params(bound):
        if bound is not None:
            chunk_bound(monkeypatch, bound)
        model = Pooled()
        opt = curvature.EKFAC(
            model, lr=0.1, loss_func=nn.CrossEntropyLoss(), fisher=fisher, inverse_every=1
        )
        X, y = data()
        for _ in range(3):  # step 0 decomposes; steps 1, 2 use corrections in that basis
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(X), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    whole = params(None)
    assert set(chunks) == {None}
    # one sample per chunk; c2 (two calls, 8428 elements per sample) in chunks of 2, 2,
    # 2, 1 and c1 (2344 per sample) whole
    for bound, expected in ((1, {1}), (20000, {2})):
        chunks.clear()
        for p, q in zip(whole, params(bound)):
            torch.testing.assert_close(q, p, rtol=1e-9, atol=1e-12)
        assert {c for c in chunks if c is not None} == expected


def test_the_diagonal_of_a_convolution_on_1x1_maps_is_one_gemm(monkeypatch):
    """One output position per sample (ResNet-18's last stage on 28x28 inputs): the
    Fisher diagonal is ``(g^2)^T (a^2)`` of the patches, without per-sample gradients
    (they went one sample per chunk there); it equals the squared per-sample gradients'
    sum, for ``diag_ggn()`` and for DiagonalNaturalGradient's first statistics."""
    import curvature.layers.conv as conv

    made = samples_seen(monkeypatch, (conv,), "per_sample_weight_grads", arg=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(6, 5, 3, padding=1), nn.Flatten(), nn.Linear(5, 3))
    X, y = torch.randn(9, 6, 1, 1, dtype=torch.float64), torch.randint(0, 3, (9,))
    model = model.double()
    diag = curvature.diag_ggn(model, nn.CrossEntropyLoss(), (X, y), "empirical")
    assert made == []  # no per-sample weight gradients of the convolution
    grads = curvature.per_sample_grads(model, nn.CrossEntropyLoss(reduction="sum"), X, y)
    R = 1 / len(y)  # the mean loss: EF = R sum_n g_n g_n^T
    for name in ("0.weight", "0.bias"):
        torch.testing.assert_close(diag[name], R * grads[name].pow(2).sum(0))
