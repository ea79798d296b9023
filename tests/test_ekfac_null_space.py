"""EKFAC's eigenbasis within a factor's null space is canonical (``canonical_null_basis``).

Where a factor is rank-deficient (a batch narrower than a layer, early in training, or a
batch reused), ``eigh`` returns any orthonormal basis of its null space, and a rounding
change (another thread count, the all-reduce of two ranks) picks another one. Later
batches reach that space, and EKFAC's diagonal corrections in it depend on the basis:
a run moved by O(1) under a ``1e-15`` change of its input. The basis is now a function
of the space alone; KFAC, whose update is a function of the factors, never depended on it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvature
from curvature.linalg import canonical_null_basis, eighs, null_count

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def rank_deficient(n=12, r=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, n, generator=g, dtype=torch.float64)
    return a.T @ a


def test_the_null_count_finds_the_rank_deficiency():
    A = rank_deficient()
    evals = torch.linalg.eigvalsh(A)
    assert int(null_count(evals)) == 7
    assert int(null_count(torch.linalg.eigvalsh(A + 1e-6 * torch.eye(12)))) == 0


def test_the_canonical_basis_depends_on_the_null_space_only():
    """Two bases of the same null space (one rotated) give the same canonical basis."""
    A = rank_deficient()
    evals, Q = torch.linalg.eigh(A)
    k = int(null_count(evals))
    rot = torch.linalg.qr(torch.randn(k, k, dtype=torch.float64)).Q
    rotated = torch.cat([Q[:, :k] @ rot, Q[:, k:]], dim=1)
    assert (rotated[:, :k] - Q[:, :k]).abs().max() > 0.1  # another basis indeed
    a, b = canonical_null_basis(Q, [k]), canonical_null_basis(rotated, [k])
    torch.testing.assert_close(a[:, :k].abs(), b[:, :k].abs(), rtol=0, atol=1e-12)
    torch.testing.assert_close(a[:, k:], Q[:, k:], rtol=0, atol=0)  # the rest untouched
    # still an orthonormal eigenbasis of A
    torch.testing.assert_close(a.T @ a, torch.eye(12, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(A @ a, a * evals.clamp_min(0), rtol=0, atol=1e-10)


def test_eighs_returns_the_canonical_basis_where_asked():
    A = rank_deficient()
    B = A * (1 + 1e-15)  # a rounding change
    (la, Qa), (lb, Qb) = eighs([A, B], ["A", "B"], canonical=[True, True])
    torch.testing.assert_close(Qa[:, :7].abs(), Qb[:, :7].abs(), rtol=0, atol=1e-8)
    (plain,) = eighs([A], ["A"])
    torch.testing.assert_close(plain[1][:, 7:].abs(), Qa[:, 7:].abs(), rtol=0, atol=0)


def _ekfac_run(eps, cls=curvature.EKFAC, steps=4):
    """The audit's setting: 12 inputs against batches of 8 (a null space at the refresh)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    opt = cls(model, lr=0.1, damping=1e-3, momentum=0.5)
    ce = nn.CrossEntropyLoss()
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        X = torch.randn(8, 12, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        X = X * (1 + eps) if s == 0 else X
        opt.zero_grad()
        ce(model(X), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.parametrize("cls", [curvature.EKFAC, curvature.KFAC], ids=lambda c: c.__name__)
def test_a_rounding_change_of_the_input_moves_the_run_by_as_little(cls):
    """Before, EKFAC moved by 1.48 (KFAC by 9e-15) under a 1e-15 relative input change."""
    a, b = _ekfac_run(0.0, cls), _ekfac_run(1e-15, cls)
    assert float((a - b).abs().max()) < 1e-9
    assert float((a - _ekfac_run(0.0, cls, steps=0)).abs().max()) > 1e-2  # it trained


def _resumed_from_kfac(eps, steps=4):
    """A KFAC state (a Cholesky refresh: no eigenbasis) loaded into EKFAC, which then
    decomposes its factors outside the refresh schedule (``KroneckerBlock.decompose``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    ce = nn.CrossEntropyLoss()
    kw = dict(lr=0.1, damping=1e-3, momentum=0.5)
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        X = torch.randn(8, 40, generator=g, dtype=torch.float64)
        y = torch.randint(0, 3, (8,), generator=g)
        if s == 0:
            opt = curvature.KFAC(model, **kw)
            X = X * (1 + eps)
        elif s == 1:
            state = opt.state_dict()
            opt.close()
            opt = curvature.EKFAC(model, **kw)
            opt.load_state_dict(state)
        opt.zero_grad()
        ce(model(X), y).backward()
        opt.step()
    opt.close()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_kfac_state_resumed_in_ekfac_gets_the_canonical_basis_too():
    """Before (found by an audit): 0.24 under a 1e-15 input change."""
    assert float((_resumed_from_kfac(0.0) - _resumed_from_kfac(1e-15)).abs().max()) < 1e-9


def test_a_full_rank_float32_factor_with_a_decaying_spectrum_has_no_null_space():
    """Its smallest eigenvalues (8e-6 of the largest) are resolved by float32's eigh: the
    threshold ``sqrt(n) eps`` (here 2.7e-6) leaves them alone. A first version took ``4 n
    eps`` (2.4e-4): 149 of these 513 directions (found by an audit)."""
    g = torch.Generator().manual_seed(0)
    n = 513
    a = torch.randn(4096, n, generator=g, dtype=torch.float64) * torch.logspace(
        0, -2.5, n, dtype=torch.float64
    )
    A = (a.T @ a / 4096).float()
    evals = torch.linalg.eigvalsh(A)
    assert float(evals[0] / evals[-1]) > 3e-6
    assert int(null_count(evals)) == 0


def test_the_probe_matrix_is_fixed_generic_and_made_in_integers():
    from curvature.rng import probe_matrix

    R = probe_matrix(40, 25, torch.device("cpu"), torch.float64)
    assert R.shape == (40, 25) and bool((R.abs() < 1).all())
    assert torch.equal(R, probe_matrix(40, 25, torch.device("cpu"), torch.float64))
    R32 = probe_matrix(40, 25, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(R32, R.float(), rtol=0, atol=2e-7)
    assert int(torch.linalg.matrix_rank(R)) == 25
    assert abs(float(R.mean())) < 0.1 and 0.5 < float(R.std()) < 0.65  # uniform's 0.577
    assert not torch.equal(R[:, :4], probe_matrix(40, 4, torch.device("cpu"), torch.float64))


def test_the_canonical_basis_makes_nothing_off_the_device_of_its_input():
    """On a GPU a CPU tensor moved to the device synchronizes the host (7 / 13 / 15 reads
    at an EKFAC refresh of gpu.py's MLP / CNN / LM on an H200, 3 / 5 / 5 without): on the
    ``meta`` device every tensor made on the way must be a ``meta`` tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Devices(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.seen.add((t.device.type, str(func)))
            return out

    evecs = torch.empty(2, 9, 9, device="meta")
    with Devices() as mode:
        try:
            canonical_null_basis(evecs, [4, 3])
        except (NotImplementedError, RuntimeError):
            pass  # (no meta kernel for the QR: what ran before it is what is checked)
    assert any(func.startswith("aten.mm") for _, func in mode.seen)  # it got to R's product
    assert {device for device, _ in mode.seen} == {"meta"}, sorted(mode.seen)


def test_the_probe_product_is_made_a_slice_of_rows_at_a_time(monkeypatch):
    """``probe_product(Q) = Q^T R`` with ``R`` made in slices of rows (the slices of one
    matrix: ``rows=(a, b)`` is ``R[a:b]``), whatever the slice size; the canonical basis
    is the same to rounding with one-row slices."""
    import curvature.rng as rng

    cpu = torch.device("cpu")
    R = rng.probe_matrix(30, 7, cpu, torch.float64)
    assert torch.equal(rng.probe_matrix(30, 7, cpu, torch.float64, rows=(4, 11)), R[4:11])
    Q = torch.linalg.qr(torch.randn(30, 7, dtype=torch.float64))[0]
    whole = rng.probe_product(Q)
    monkeypatch.setattr(rng, "PROBE_SLICE", 7)  # one row of R at a time
    torch.testing.assert_close(rng.probe_product(Q), Q.T @ R, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole, Q.T @ R, rtol=1e-12, atol=1e-12)
    A = rank_deficient()
    _, evecs = torch.linalg.eigh(A)
    default = canonical_null_basis(evecs.clone(), [7])
    monkeypatch.setattr(rng, "PROBE_SLICE", 1)  # (and one row of the basis at a time)
    torch.testing.assert_close(
        canonical_null_basis(evecs.clone(), [7]), default, atol=1e-12, rtol=0
    )


def test_an_overwritten_qr_gives_the_same_basis_in_the_inputs_memory():
    from curvature.linalg import orthonormal_basis

    M = torch.randn(2, 12, 5, dtype=torch.float64)
    ref = orthonormal_basis(M.clone())
    work = M.clone()
    got = orthonormal_basis(work, overwrite=True)
    assert torch.equal(got, ref) and got.data_ptr() == work.data_ptr()
    wide = torch.randn(4, 9)  # k > P: no room in M for Q, a new tensor as without
    assert torch.equal(orthonormal_basis(wide.clone(), overwrite=True), orthonormal_basis(wide))


def test_a_basis_of_a_tensor_that_requires_grad_has_the_same_signs():
    """``orthonormal_basis`` of a tensor that requires grad (``torch.linalg.qr``, which has a
    derivative) makes ``R``'s diagonal non-negative too: the same basis as without grad."""
    from curvature.linalg import orthonormal_basis

    M = torch.randn(7, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with_grad = orthonormal_basis(M.clone().requires_grad_())
    torch.testing.assert_close(with_grad.detach(), orthonormal_basis(M), rtol=0, atol=1e-12)
    with_grad.sum().backward()  # differentiable


def test_float_values_read_with_the_null_counts_keep_them_integers():
    """``eighs(..., also=[a float tensor], canonical=[True])``: the host read promotes every
    value to floats; the null counts are used as integers all the same."""
    A = rank_deficient()
    (evals, evecs), extra = eighs(
        [A], ["a"], also=[torch.tensor(1.5, dtype=torch.float64)], canonical=[True]
    )
    assert extra == 1.5
    torch.testing.assert_close(evecs @ torch.diag_embed(evals) @ evecs.T, A, atol=1e-10, rtol=0)
