"""Convolution taps that only read zero padding: found from shapes, inverted apart.

``curvature.layers.conv_taps.live_columns`` against its brute-force twin (the columns of
the weight gradient that an all-positive input and output gradient leave at exactly
zero), and KFAC's preconditioning with ``A`` inverted on the live columns alone against
the dense formula ``(G + sG I)^{-1} M (A + sA I)^{-1}`` from the public factors.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import curvature
from curvature.blocks import KroneckerBlock
from curvature.layers.conv_taps import MAX_LIVE_FRACTION, live_columns

pytestmark = pytest.mark.usefixtures("one_thread_seeded")

CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def zero_columns(conv: nn.modules.conv._ConvNd, shapes) -> set:
    """Columns of one group's ``[W | b]`` whose gradient is exactly zero for inputs and
    output gradients of ones at every spatial shape in ``shapes``."""
    live = torch.zeros(conv.weight[: conv.out_channels // conv.groups].flatten(1).shape[1])
    for shape in shapes:
        x = torch.ones(2, conv.in_channels, *shape, dtype=torch.float64)
        out = conv.double()(x)
        (gw,) = torch.autograd.grad(out.sum(), conv.weight)
        live += gw.flatten(1).abs().sum(0)  # every group's rows alike
    return {i for i, v in enumerate(live.tolist()) if v == 0}


def cases(n=150):
    rng = random.Random(0)
    for _ in range(n):
        d = rng.choice([1, 2, 3])
        k = tuple(rng.choice([1, 2, 3, 5]) for _ in range(d))
        stride = tuple(rng.choice([1, 2, 3]) for _ in range(d))
        dilation = tuple(rng.choice([1, 2]) for _ in range(d))
        padding = tuple(rng.choice([0, 1, 2, 4]) for _ in range(d))
        groups = rng.choice([1, 2])
        # input sizes with an output: at least the dilated kernel's reach past the padding
        low = [max(1, q * (r - 1) + 1 - 2 * p) for q, r, p in zip(dilation, k, padding)]
        shapes = [
            tuple(n + rng.choice([0, 0, 1, 2, 5]) for n in low)
            for _ in range(rng.choice([1, 1, 2]))
        ]
        yield d, k, stride, dilation, padding, groups, shapes, rng.random() < 0.5


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: str(c))
def test_live_columns_are_the_columns_a_gradient_can_reach(case):
    d, k, stride, dilation, padding, groups, shapes, bias = case
    conv = CONVS[d](4, 2, k, stride=stride, padding=padding, dilation=dilation, groups=groups)
    conv.bias.requires_grad_(bias)
    dead = zero_columns(conv, shapes)
    got = live_columns(conv, shapes, bias)
    D = conv.weight.shape[1] * conv.weight[0, 0].numel() + bias
    expected = [c for c in range(D) if c not in dead]
    if not dead or len(expected) > MAX_LIVE_FRACTION * D:
        assert got is None
    else:
        assert got == tuple(expected)


def test_live_columns_of_small_feature_maps():
    conv = nn.Conv2d(4, 8, 3, padding=1)  # on a 1x1 map only the centre tap reads it
    assert live_columns(conv, [(1, 1)], True) == (4, 13, 22, 31, 36)
    down = nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False)  # 2x2 -> 1x1: taps 1, 2
    assert live_columns(down, [(2, 2)], False) == tuple(
        c * 9 + t for c in range(4) for t in (4, 5, 7, 8)
    )
    assert live_columns(conv, [(1, 1), (8, 8)], True) is None  # every tap reads 8x8
    assert live_columns(conv, [(28, 28)], True) is None


@pytest.mark.parametrize("mode", ["reflect", "circular", "replicate"])
def test_padding_that_is_not_zeros_has_no_dead_taps(mode):
    conv = nn.Conv2d(4, 8, 3, padding=1, padding_mode=mode)
    assert live_columns(conv, [(1, 1)], True) is None
    assert live_columns(nn.Conv2d(4, 8, 3, padding="same"), [(1, 1)], True) is None


def small_net():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1),  # 2x2 -> 1x1: 4 taps of 9 live
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),  # 1x1: the centre tap alone
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).double()


def dense_direction(opt, module, name, damping, mode):
    """``(G + sG I)^{-1} [grad W | grad b] (A + sA I)^{-1}`` from the public factors."""
    A, G = opt.factors()[name]
    M = torch.cat([module.weight.grad.flatten(1), module.bias.grad[:, None]], 1)
    if mode == "pi":
        pi = (A.diagonal().mean() / G.diagonal().mean()).sqrt()
        sA, sG = pi * damping**0.5, damping**0.5 / pi
    else:
        sA = sG = damping
    eye = torch.eye
    return torch.linalg.solve(G + sG * eye(len(G), dtype=G.dtype), M) @ torch.linalg.inv(
        A + sA * eye(len(A), dtype=A.dtype)
    )


@pytest.mark.parametrize("mode", ["pi", "per_factor"])
@pytest.mark.parametrize("sizes", [[2, 2, 2], [2, 2, 4]], ids=["fixed", "growing"])
def test_kfac_with_live_columns_equals_the_dense_formula(mode, sizes):
    """Every step refreshes (``inverse_every=1``), so the update is ``-lr`` times the
    preconditioned gradient of the factors ``opt.factors()`` returns. An L2 term makes
    the dead taps' gradients nonzero: they are scaled by ``1 / sA`` as the full inverse
    would. With ``growing`` the third step's 4x4 inputs reach every tap."""
    model = small_net()
    lr, damping = 0.1, 1e-2
    opt = curvature.KFAC(
        model, lr=lr, damping=damping, damping_mode=mode, inverse_every=1, stale_clip=None
    )
    g = torch.Generator().manual_seed(0)
    convs = {"0": model[0], "2": model[2], "4": model[4], "7": model[7]}
    compact = []
    for size in sizes:
        X = torch.randn(16, 3, size, size, generator=g, dtype=torch.float64)
        y = torch.randint(0, 4, (16,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(X), y)
        loss = loss + 1e-2 * sum((p**2).sum() for p in model.parameters())
        loss.backward()
        before = {n: (m.weight.detach().clone(), m.bias.detach().clone()) for n, m in convs.items()}
        opt.step()
        blocks = opt.blocks
        compact.append(
            sorted(
                n
                for n, b in blocks.items()
                if b.inverses is not None and b.inverses.live is not None
            )
        )
        for n, m in convs.items():
            expected = dense_direction(opt, m, n, damping, mode)
            W0, b0 = before[n]
            got = torch.cat(
                [(W0 - m.weight.detach()).flatten(1), (b0 - m.bias.detach())[:, None]], 1
            )
            # (to the rounding of the dense reference: A + sA I's condition number reaches
            # 1e7 on the 4x4 inputs)
            assert (got / lr - expected).abs().max() <= 1e-9 * expected.abs().max()
    assert compact[0] == ["2", "4"]  # the compact route was taken
    assert compact[-1] == (["2", "4"] if sizes[-1] == 2 else [])  # 4x4: every tap live


def test_a_kfac_state_with_live_columns_resumes_bit_for_bit():
    def run(split):
        model = small_net()
        opt = curvature.KFAC(model, lr=0.05, inverse_every=2)
        g = torch.Generator().manual_seed(1)
        batches = [
            (
                torch.randn(8, 3, 2, 2, generator=g, dtype=torch.float64),
                torch.randint(0, 4, (8,), generator=g),
            )
            for _ in range(5)
        ]
        for i, (X, y) in enumerate(batches):
            if i == split:
                state = opt.state_dict()
                model2 = small_net()
                model2.load_state_dict(model.state_dict())
                model = model2
                opt = curvature.KFAC(model, lr=0.05, inverse_every=2)
                opt.load_state_dict(state)
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            opt.step()
        assert isinstance(opt.blocks["4"], KroneckerBlock) and opt.blocks["4"].live_cols is not None
        return [p.detach() for p in model.parameters()]

    for a, b in itertools.zip_longest(run(None), run(3)):
        assert torch.equal(a, b)


def test_ekfac_blocks_keep_their_full_factors():
    model = small_net()
    opt = curvature.EKFAC(model, lr=0.05, inverse_every=1)
    X, y = torch.randn(8, 3, 2, 2, dtype=torch.float64), torch.randint(0, 4, (8,))
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    assert all(b.live_cols is None for b in opt.blocks.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("approx", ["reduce", "expand"])
@pytest.mark.parametrize("size", [2, 8], ids=["dead taps", "window sums"])
def test_factors_equal_the_unfolded_patches(size, approx):
    """``A`` from the patches (``F.unfold``, bias column 1): ``"reduce"``: ``mean_n a_n
    a_n^T`` with ``a_n`` sample ``n``'s patches averaged over positions; ``"expand"``:
    the mean of ``p p^T`` over samples and positions. On 2x2 inputs the last two
    convolutions have dead taps (their ``A`` from the live columns' GEMM, zeros around
    it); on 8x8 ones the first two sum their windows by the per-axis GEMMs."""
    model = small_net()
    opt = curvature.KFAC(model, kfac_approx=approx, inverse_every=1)
    inputs = {}
    for i in (0, 2, 4):
        model[i].register_forward_hook(lambda m, a, out, i=i: inputs.__setitem__(i, a[0].detach()))
    X, y = torch.randn(8, 3, size, size, dtype=torch.float64), torch.randint(0, 4, (8,))
    opt.zero_grad()
    nn.functional.cross_entropy(model(X), y).backward()
    opt.step()
    for i in (0, 2, 4):
        conv = model[i]
        P = nn.functional.unfold(inputs[i], 3, padding=1, stride=conv.stride)  # [N, 9 C, S]
        if approx == "reduce":
            P = P.mean(-1, keepdim=True)
        a = P.transpose(1, 2).reshape(-1, P.shape[1])  # [N S, 9 C]
        a = torch.cat([a, torch.ones(len(a), 1, dtype=a.dtype)], 1)
        A, _ = opt.factors()[str(i)]  # (the first statistics as they are)
        torch.testing.assert_close(A, a.T @ a / len(a), rtol=1e-12, atol=1e-14)


def test_live_columns_read_nothing_from_the_device():
    """The live columns come from shapes: a step without a refresh reads no device value
    (the count a GPU would see as synchronizations; ``benchmarks/step_counts.py``)."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_counts import HostReads

    model = small_net()
    opt = curvature.KFAC(model, lr=0.05, inverse_every=1000)
    X, y = torch.randn(8, 3, 2, 2, dtype=torch.float64), torch.randint(0, 4, (8,))

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()

    for _ in range(2):
        step()
    assert opt.blocks["4"].inverses.live is not None
    with HostReads() as reads:
        for _ in range(3):
            step()
    assert reads.count == 0, reads.where
