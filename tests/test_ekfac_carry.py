"""EKFAC's corrections carried into a new eigenbasis at a refresh (curvature.blocks.carry)."""

import pytest
import torch

from curvature.blocks import carry
from curvature.blocks.carry import carried_corrections
from curvature.blocks.records import Eigen

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def _basis(D: int, angle: float, dtype) -> torch.Tensor:
    """``[1, D, D]`` orthogonal: the identity rotated by ``angle`` in the first plane."""
    Q = torch.eye(D, dtype=torch.float64)
    c, s = torch.cos(torch.tensor(angle)), torch.sin(torch.tensor(angle))
    Q[0, 0], Q[0, 1], Q[1, 0], Q[1, 1] = c, -s, s, c
    return Q[None].to(dtype)


def _eigen(QA, QG):
    return Eigen(torch.ones(QA.shape[:-1]), QA, torch.ones(QG.shape[:-1]), QG)


@pytest.mark.parametrize("rows", [2, 256], ids=["in-chunks", "at-once"])
def test_carried_corrections_equal_the_diagonal_in_the_new_basis(rows, monkeypatch):
    # the definition, in float64 from the dense EKFAC matrix: diag(Qn^T Qo diag(L) Qo^T Qn);
    # float32 on a CPU is computed in float64 with the R matrices made `rows` at a time
    monkeypatch.setattr(carry, "CARRY_ROWS", rows)
    g = torch.Generator().manual_seed(0)
    DA, DG = 5, 3
    qa = torch.linalg.qr(torch.randn(2, DA, DA, generator=g, dtype=torch.float64))[0]
    qg = torch.linalg.qr(torch.randn(2, DG, DG, generator=g, dtype=torch.float64))[0]
    lam = torch.rand(1, DG, DA, generator=g, dtype=torch.float64)
    old, new = _eigen(qa[:1], qg[:1]), _eigen(qa[1:], qg[1:])
    Q_old, Q_new = torch.kron(qg[0], qa[0]), torch.kron(qg[1], qa[1])  # (G x A) row order
    M = Q_old @ torch.diag(lam.reshape(-1)) @ Q_old.T
    want = torch.diagonal(Q_new.T @ M @ Q_new).reshape(1, DG, DA)
    torch.testing.assert_close(carried_corrections(lam, old, new), want, rtol=1e-12, atol=0)
    out32 = carried_corrections(
        lam.float(), _eigen(qa[:1].float(), qg[:1].float()), _eigen(qa[1:].float(), qg[1:].float())
    )
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), want, rtol=1e-5, atol=1e-7)


def test_carried_corrections_hold_no_subnormal_numbers():
    # late in training: bases that barely move (overlaps of rounding size, their squares
    # subnormal in float32) and corrections of dead units decayed below float32's
    # smallest normal number: the carried corrections hold no subnormal number (each one
    # would take a CPU's slow path in every later step) and the float64 reference's
    # values where those are normal
    D = 64
    old = _eigen(_basis(D, 0.0, torch.float32), _basis(D, 0.0, torch.float32))
    new = _eigen(_basis(D, 3e-20, torch.float32), _basis(D, 3e-20, torch.float32))
    lam = torch.full((1, D, D), 1e-3)
    lam[0, 0, :] = 1e-40  # a dead output unit's corrections: subnormal float32 numbers
    tiny = torch.finfo(torch.float32).tiny
    assert bool(((lam.abs() < tiny) & (lam != 0)).any())
    out = carried_corrections(lam, old, new)
    assert not bool(((out.abs() < tiny) & (out != 0)).any())
    ref = carried_corrections(
        lam.double(),
        _eigen(old.QA.double(), old.QG.double()),
        _eigen(new.QA.double(), new.QG.double()),
    )
    normal = ref >= tiny
    assert not bool(normal.all())
    torch.testing.assert_close(out[normal].double(), ref[normal], rtol=1e-6, atol=0)
    assert bool((out[~normal] == 0).all())
