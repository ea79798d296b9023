"""EKFAC's eigenbasis tracked by one subspace iteration per refresh (``eigenbasis_update="power"``).

Twins: the exact eigenbasis is a fixed point of the step (an optimizer whose factors do
not move gets eigh's bases at every refresh); repeated steps on one matrix converge to
``eigh``'s basis; the null space stays put under a rounding change (as the canonical
basis of a full decomposition does); the refresh reads the device once and decomposes
nothing after the first.
"""

from __future__ import annotations

import pathlib
import sys
import warnings

import pytest
import torch
from torch import nn

import curvature
from curvature.blocks.power import power_step, power_steps

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from step_counts import HostReads, as_on_cuda  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_seeded")
CE = nn.CrossEntropyLoss()
F64 = torch.float64


def psd(n=12, r=12, seed=0, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(r, n, generator=g, dtype=F64) * torch.logspace(0, -spread, n, dtype=F64)
    return a.T @ a / r


def off_diagonal(F, Q):
    """``|offdiag(Q^T F Q)|_F / |F|_F``: 0 for an eigenbasis."""
    M = Q.mT @ F @ Q
    return float((M - torch.diag_embed(M.diagonal(dim1=-2, dim2=-1))).norm() / F.norm())


def test_the_eigenbasis_is_a_fixed_point():
    F = psd(30, r=60)
    evals, Q = torch.linalg.eigh(F)
    lam, Qn = power_step(F, Q)
    # the same columns with the same signs, in descending order (eigh's: ascending)
    torch.testing.assert_close(Qn, Q.flip(-1), rtol=0, atol=1e-10)
    torch.testing.assert_close(lam, evals.flip(-1), rtol=0, atol=1e-12)


def test_repeated_steps_converge_to_the_eigenbasis():
    F, Q = psd(20, r=40, seed=1), psd(20, r=40, seed=2)
    Q = torch.linalg.eigh(Q).eigenvectors  # another matrix's basis: far from F's
    start = off_diagonal(F, Q)
    for _ in range(300):
        lam, Q = power_step(F, Q)
    assert start > 0.1 and off_diagonal(F, Q) < 1e-8
    torch.testing.assert_close(lam, torch.linalg.eigvalsh(F).flip(-1), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(Q.mT @ Q, torch.eye(20, dtype=F64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype,decades,tol", [(F64, 6, 1e-10), (torch.float32, 5, 1e-4)])
def test_small_eigenvalues_converge_too(dtype, decades, tol):
    """Eigenvalues over six decades (float64; five in float32): the directions far
    below the largest are not frozen by the shift (a first version's ``1e-3`` shift left
    them 0.43 off after 300 refreshes, found by an audit)."""
    g = torch.Generator().manual_seed(3)
    U = torch.linalg.qr(torch.randn(20, 20, generator=g, dtype=F64)).Q
    spectrum = torch.diag(torch.logspace(0, -decades, 20, dtype=F64))
    F = U @ spectrum @ U.T
    near = torch.linalg.qr(U + 0.05 * torch.randn(20, 20, generator=g, dtype=F64)).Q
    Q = torch.linalg.eigh(near @ spectrum @ near.T)[1]
    F, Q = F.to(dtype), Q.to(dtype)
    for _ in range(100):
        _, Q = power_step(F, Q)
    cos = (U.T @ Q.double()).abs().amax(1)  # each true eigenvector's best match
    assert float((1 - cos).max()) < tol


def test_one_step_moves_a_stale_basis_toward_the_new_factor():
    """The refresh's situation: the basis of the factor before a running-average update."""
    F_old = psd(40, r=25, seed=3)
    F = 0.6 * F_old + 0.4 * psd(40, r=25, seed=4)
    Q = torch.linalg.eigh(F_old).eigenvectors
    _, Qn = power_step(F, Q)
    assert off_diagonal(F, Qn) < 0.6 * off_diagonal(F, Q)


def test_the_null_space_stays_put_under_a_rounding_change():
    """A rank-5 factor of size 12: without the shift, the QR of its rounding-level
    columns would pick the null space's directions from rounding."""
    F = psd(12, r=5)
    Q = torch.linalg.eigh(F).eigenvectors
    g = torch.Generator().manual_seed(9)
    E = torch.randn(12, 12, generator=g, dtype=F64)
    _, a = power_step(F, Q)
    _, b = power_step(F + 1e-15 * (E + E.T), Q)
    # about the change (3e-15 relative) over the shift (1e-6 in float64): 1.4e-9 here
    assert float((a - b).abs().max()) < 1e-8
    torch.testing.assert_close(a[:, 5:].mT @ F @ a[:, 5:], torch.zeros(7, 7, dtype=F64),
                               rtol=0, atol=1e-12)  # fmt: skip


def test_a_zero_factor_keeps_its_basis():
    Q = torch.linalg.eigh(psd(9)).eigenvectors
    lam, Qn = power_step(torch.zeros(9, 9, dtype=F64), Q)
    torch.testing.assert_close(Qn, Q, rtol=0, atol=1e-15)
    assert float(lam.abs().max()) == 0.0


def test_batched_steps_equal_single_ones_and_flag_non_finite_factors():
    pairs = [
        (psd(8, seed=s), torch.linalg.eigh(psd(8, seed=s + 10)).eigenvectors) for s in range(3)
    ]
    bad = psd(8, seed=5)
    bad[0, 0] = float("nan")
    pairs.append((bad, pairs[0][1]))
    out, ok = power_steps(pairs)
    for (F, Q), (lam, Qn) in zip(pairs[:3], out[:3]):
        ref = power_step(F, Q)
        torch.testing.assert_close(lam, ref[0], rtol=0, atol=1e-14)
        torch.testing.assert_close(Qn, ref[1], rtol=0, atol=1e-14)
    assert [bool(f) for f in ok] == [True, True, True, False]


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).double()


TEACHER = torch.randn(10, 3, generator=torch.Generator().manual_seed(77), dtype=F64)


def batch(seed, n=32):
    """Inputs and the labels of a fixed linear teacher (something to learn)."""
    X = torch.randn(n, 10, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return X, (X @ TEACHER).argmax(1)


def bases(opt):
    return {k: (b.basis().QA.clone(), b.basis().QG.clone()) for k, b in opt.blocks.items()}


def test_an_optimizer_whose_factors_do_not_move_keeps_the_exact_eigenbases():
    """``lr=0`` and one batch: the running factors stay those of the first step, so every
    power refresh must return eigh's bases (the exact case)."""
    runs = {}
    for update in ("eigh", "power"):
        model = mlp()
        opt = curvature.EKFAC(model, lr=0.0, inverse_every=2, eigenbasis_update=update)
        X, y = batch(0)
        for _ in range(9):
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()
        runs[update] = bases(opt)
    for k, (QA, QG) in runs["eigh"].items():
        pA, pG = runs["power"][k]
        # eigenvectors up to sign (eigh's signs are its own; the power step keeps the
        # first) and order (descending after a power step)
        torch.testing.assert_close(pA.abs(), QA.flip(-1).abs(), rtol=0, atol=1e-8)
        torch.testing.assert_close(pG.abs(), QG.flip(-1).abs(), rtol=0, atol=1e-8)


def train(update, steps=30, **kw):
    model = mlp()
    opt = curvature.EKFAC(model, lr=0.05, inverse_every=3, eigenbasis_update=update, **kw)
    losses = []
    for s in range(steps):
        X, y = batch(s)
        opt.zero_grad()
        loss = CE(model(X), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model, opt, losses


def test_power_refreshes_train_as_eigh_refreshes_do():
    _, _, eigh_losses = train("eigh")
    _, opt_p, power_losses = train("power")
    # the first refresh decomposes (the same bases); later ones only track
    assert abs(power_losses[-1] - eigh_losses[-1]) < 0.05 * eigh_losses[-1]
    assert power_losses[-1] < 0.8 * power_losses[0]
    assert power_losses[:4] == eigh_losses[:4]  # up to the second refresh: identical
    for k, (QA, QG) in bases(opt_p).items():  # orthonormal and near the current eigenbasis
        A, G = opt_p.factors()[k]
        QA, QG = QA[0], QG[0]
        torch.testing.assert_close(QA.mT @ QA, torch.eye(len(QA), dtype=F64), rtol=0, atol=1e-12)
        torch.testing.assert_close(QG.mT @ QG, torch.eye(len(QG), dtype=F64), rtol=0, atol=1e-12)


def test_a_power_run_resumes_bit_for_bit():
    model, opt, _ = train("power", steps=7)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    saved = opt.state_dict()
    tail = []
    for s in range(7, 12):
        X, y = batch(s)
        opt.zero_grad()
        CE(model(X), y).backward()
        opt.step()
    tail = [p.detach().clone() for p in model.parameters()]
    model2 = mlp()
    model2.load_state_dict(state)
    opt2 = curvature.EKFAC(model2, lr=0.05, inverse_every=3, eigenbasis_update="power")
    opt2.load_state_dict(saved)
    for s in range(7, 12):
        X, y = batch(s)
        opt2.zero_grad()
        CE(model2(X), y).backward()
        opt2.step()
    for a, b in zip(tail, model2.parameters()):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("depth", [1, 5])
def test_a_power_refresh_would_synchronize_a_gpu_once(depth):
    """After the first refresh no eigendecomposition: the host read of the refresh only
    (``torch.linalg.qr``'s parts read no error code on a GPU), against one read plus
    one ``eigh`` call per padded size group with ``"eigh"``."""
    counts = {}
    for update in ("eigh", "power"):
        torch.manual_seed(0)
        sizes = [6] + [8] * depth + [4]
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers += ([nn.Tanh()] if i else []) + [nn.Linear(a, b)]
        model = nn.Sequential(*layers)
        opt = curvature.EKFAC(model, inverse_every=1, eigenbasis_update=update)
        g = torch.Generator().manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(3):
                X, y = torch.randn(5, 6, generator=g), torch.randint(0, 4, (5,), generator=g)
                with as_on_cuda(), HostReads(checked=True) as reads:
                    opt.zero_grad()
                    CE(model(X), y).backward()
                    opt.step()
        counts[update] = reads.count
    assert counts["power"] == 1 and counts["eigh"] >= 2, counts


def test_the_option_is_checked():
    model = mlp()
    with pytest.raises(ValueError, match="eigenbasis_update='qr'"):
        curvature.EKFAC(model, eigenbasis_update="qr")
    with pytest.raises(ValueError, match="for EKFAC only, 'power'"):
        curvature.KFAC(model, eigenbasis_update="power")
    for bad in ("", 0, False, "POWER"):  # (a falsy value is not the default)
        with pytest.raises(ValueError, match="eigenbasis_update="):
            curvature.EKFAC(model, eigenbasis_update=bad)
    assert curvature.EKFAC(model).eigenbasis_update == "power"
    assert curvature.KFAC(model).eigenbasis_update == "eigh"


def test_the_refresh_benchmark_runs_and_counts_one_read_for_power():
    import ekfac_refresh

    runs, syncs = ekfac_refresh.main("--widths 6,8,4 --batch 5 --repeats 2".split())
    assert syncs["power"] == 1 and syncs["eigh"] >= 2
    assert all(len(times) == 2 for _, _, times in runs.values())


def test_forward_only_ekfac_decomposes_exactly():
    """Without corrections (``fisher="forward-only"``: none ever) EKFAC is KFAC with
    exact damping, whose eigenpairs must be exact: it decomposes at every refresh
    (found by an audit: 7e-2 off the dense inverse)."""
    runs = {}
    for update in ("eigh", "power"):
        model = mlp()
        opt = curvature.EKFAC(
            model, lr=0.1, inverse_every=1, fisher="forward-only", eigenbasis_update=update
        )
        for s in range(6):
            X, y = batch(s)
            opt.zero_grad()
            CE(model(X), y).backward()
            opt.step()
        runs[update] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(runs["power"], runs["eigh"], rtol=0, atol=0)


def dense_direction(opt, v, damping):
    """``(kron(G, A) + damping I)^{-1}`` of each layer's ``[W | b]`` (the MLP's two layers)."""
    out = []
    for i, name in enumerate(("0", "2")):
        A, G = opt.factors()[name]
        M = torch.cat([v[2 * i], v[2 * i + 1][:, None]], 1)
        K = torch.kron(G, A) + damping * torch.eye(A.shape[-1] * G.shape[-1], dtype=F64)
        d = torch.linalg.solve(K, M.reshape(-1)).reshape(M.shape)
        out += [d[:, :-1], d[:, -1]]
    return out


@pytest.mark.parametrize("fisher", ["empirical", "forward-only"])
def test_an_ekfac_state_loaded_into_kfac_is_decomposed_again(fisher):
    """EKFAC's tracked bases are not exact eigenpairs: KFAC decomposes the loaded factors
    (also without corrections to drop: the audit's forward-only state was 3e-2 off)."""
    model = mlp()
    ek = curvature.EKFAC(model, lr=0.05, damping=1e-3, inverse_every=2, fisher=fisher)
    for s in range(7):
        X, y = batch(s)
        ek.zero_grad()
        CE(model(X), y).backward()
        ek.step()
    kf = curvature.KFAC(model, damping=1e-3, damping_mode="exact")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the dropped corrections)
        kf.load_state_dict(ek.state_dict())
    v = [torch.randn_like(p) for p in model.parameters()]
    for got, want in zip(kf.inverse_matvec(v), dense_direction(kf, v, 1e-3)):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def _from_kfac_eigh(eps):
    """KFAC with eigendecompositions (not canonical in a null space: 12 inputs against a
    batch of 8) for two steps, its state loaded into EKFAC, four more steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    kf = curvature.KFAC(model, lr=0.1, inverse_method="eigh")
    ek = None
    for s in range(6):
        g = torch.Generator().manual_seed(100 + s)
        X = torch.randn(8, 12, generator=g, dtype=F64) * (1 + eps if s == 0 else 1)
        y = torch.randint(0, 3, (8,), generator=g)
        if s == 2:
            ek = curvature.EKFAC(model, lr=0.1, momentum=0.5)
            ek.load_state_dict(kf.state_dict())
        opt = kf if ek is None else ek
        opt.zero_grad()
        CE(model(X), y).backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_a_kfac_state_with_eigenbases_loads_into_ekfac_with_the_canonical_basis():
    """Before (an audit): EKFAC took KFAC's eigenbases as they were, whose null space
    follows the rounding: a 1e-15 change of the first batch moved the run by 3.9."""
    assert float((_from_kfac_eigh(0.0) - _from_kfac_eigh(1e-15)).abs().max()) < 1e-9


@pytest.mark.parametrize("shape", [(7, 3), (3, 7), (2, 5, 5), (6, 6), (2, 3, 7)])
def test_the_orthonormal_basis_is_the_qr_factor_with_a_non_negative_r_diagonal(shape):
    """``curvature.linalg.orthonormal_basis`` (Hutch++ and the power step): ``torch.linalg.qr``'s
    Q up to the signs that make ``R``'s diagonal non-negative (each column points as
    ``M``'s); differentiable where ``M`` requires a gradient."""
    from curvature.linalg import orthonormal_basis

    g = torch.Generator().manual_seed(0)
    M = torch.randn(*shape, generator=g, dtype=F64)
    Q = orthonormal_basis(M)
    Q0, R0 = torch.linalg.qr(M)
    signs = torch.where(R0.diagonal(dim1=-2, dim2=-1) < 0, -1.0, 1.0).to(F64).unsqueeze(-2)
    torch.testing.assert_close(Q, Q0 * signs, rtol=0, atol=1e-14)
    assert bool(((Q.mT @ M).diagonal(dim1=-2, dim2=-1) >= 0).all())
    leaf = M.clone().requires_grad_()
    orthonormal_basis(leaf).sum().backward()
    assert leaf.grad is not None and bool(torch.isfinite(leaf.grad).all())
