"""BlockGather: the blocks' entries gathered and scattered, by strided copies or by index.

On a CPU a plan whose blocks are a few affine pieces of the flat vector copies strided
views instead of indexing; every layout must give the entries that indexing gives.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import curvature
from curvature.blocks import BlockGather


def _linear(offset_w: int, offset_b: int, D_out: int, D_in: int) -> torch.Tensor:
    """``[1, D_out, D_in + 1]``: a Linear block ``[W | b]``."""
    W = torch.arange(offset_w, offset_w + D_out * D_in).view(D_out, D_in)
    b = torch.arange(offset_b, offset_b + D_out).view(D_out, 1)
    return torch.cat([W, b], 1)[None]


def _layouts():
    P = 4 * 3 + 4 + 6 * 5 + 3 * 2 + 7 * 3
    lin = _linear(0, 12, 4, 3)  # positions 0..15
    grouped = torch.arange(16, 16 + 30).view(2, 3, 5)  # two groups of a convolution
    no_bias = torch.arange(46, 46 + 6).view(1, 3, 2)
    emb = (torch.arange(21).view(7, 3) + 52).T[None]  # E^T: stride 3 along the columns
    every = [lin, grouped, no_bias, emb]
    perm = torch.randperm(P, generator=torch.Generator().manual_seed(0))
    return {
        "linear-conv-embedding": (P, every),
        "partial": (P, [lin, emb]),
        "scrambled": (P, [perm[:16].view(1, 4, 4), perm[16:].view(1, 1, -1)]),
        "bias-only": (4, [torch.arange(4).view(1, 4, 1)]),
    }


@pytest.mark.parametrize("case", list(_layouts()))
@pytest.mark.parametrize("with_out", [False, True])
def test_gather_and_scatter_give_the_indexed_entries(case, with_out):
    P, indices = _layouts()[case]
    g = torch.randn(P, dtype=torch.float64)
    scales = [float(i + 2) for i in range(len(indices))]
    seen = []

    def job(scale):
        def run(views):
            seen.append(views.M.clone())
            views.out.copy_(views.M * scale)

        return run

    gather = BlockGather()
    for _ in range(2):  # the second call reuses the plan and its cached views
        seen.clear()
        out = torch.full((P,), float("nan"), dtype=torch.float64) if with_out else None
        res = gather.apply(g, indices, [job(s) for s in scales], out=out)
        want = g.clone()
        for ix, s, M in zip(indices, scales, seen):
            assert torch.equal(M, g[ix])  # each block got its entries
            want[ix.reshape(-1)] = g[ix.reshape(-1)] * s
        assert torch.equal(res, want)
        if with_out:
            assert res is out
    assert torch.equal(g, g.clone())  # (the input is not written)


def test_a_new_vector_is_gathered_from_its_own_entries():
    P, indices = _layouts()["linear-conv-embedding"]
    gather = BlockGather()
    jobs = [lambda v: v.out.copy_(v.M)] * len(indices)
    a, b = torch.randn(P), torch.randn(P)
    assert torch.equal(gather.apply(a, indices, jobs), a)
    assert torch.equal(gather.apply(b, indices, jobs), b)
    offset = torch.randn(P + 5)[3 : 3 + P]  # a view with a storage offset
    assert torch.equal(gather.apply(offset, indices, jobs), offset)
    strided = torch.randn(2 * P)[::2]  # not contiguous
    assert torch.equal(gather.apply(strided, indices, jobs), strided)
    out = torch.empty(2 * P)[::2]
    assert torch.equal(gather.apply(a, indices, jobs, out=out), a)


class _Ops(TorchDispatchMode):
    """The names of the aten calls made inside the block."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "cls", [curvature.KFAC, curvature.EKFAC, curvature.DiagonalNaturalGradient]
)
def test_a_cpu_step_of_linear_layers_indexes_nothing(cls):
    """On a CPU the gather, the scatter, the diagonals' reorder and the update's select are
    strided copies and per-parameter products: no ``index_select`` of ``[P]`` entries."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = cls(model, lr=1e-2, damping=1e-2, inverse_every=1000)
    X, y = torch.randn(8, 6), torch.randint(0, 3, (8,))

    def step():
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(X), y).backward()
        opt.step()

    for _ in range(3):
        step()
    with _Ops() as ops:
        step()
    assert ops.names and not [n for n in ops.names if "index_select" in n]


def test_a_cpu_plan_of_affine_pieces_builds_no_flat_index():
    """The concatenated ``[P]`` index and its argsort (eight bytes per parameter) are made
    only where a plan indexes: not for a CPU plan of affine pieces (until a second vector
    is gathered alike, which takes the index); the results are those of indexing."""
    P, indices = _layouts()["linear-conv-embedding"]
    gather = BlockGather()
    jobs = [lambda v: v.out.copy_(v.M * 2)] * len(indices)
    g = torch.randn(P)
    with _Ops() as ops:
        res = gather.apply(g, indices, jobs)
    assert not [n for n in ops.names if "sort" in n or "cat" in n]
    assert torch.equal(res, g * 2)
    extra = torch.randn(P)
    seen = []

    def with_extra(views, extras):
        seen.extend(extras)
        for v in views:
            v.out.copy_(v.M)

    from curvature.blocks.gather import AllBlocks

    gather.apply(g, indices, [AllBlocks(with_extra)], extra=extra)
    for ix, e in zip(indices, seen):
        assert torch.equal(e, extra[ix])
