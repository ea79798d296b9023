"""``curvature.linalg``: damped inverses by Cholesky, with the eigendecomposition fallback."""

from __future__ import annotations

import warnings

import pytest
import torch

from curvature.linalg import (
    damped_inverse,
    damped_inverses,
    eigh,
    eighs,
    finite_flags,
    host_values,
)


def _psd(*batch: int, D: int = 12, rank: int = 5, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    X = torch.randn(*batch, D, rank, generator=g, dtype=dtype)
    return X @ X.mT  # rank-deficient: the shift makes it invertible


def _reference(M: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(M.shape[-1], dtype=M.dtype)
    return torch.linalg.inv(M + shift[..., None, None] * eye)


def test_batched_shifts_match_the_inverse():
    M, shift = _psd(3), torch.tensor([1e-3, 0.1, 10.0], dtype=torch.float64)
    torch.testing.assert_close(damped_inverse(M, shift), _reference(M, shift))


def test_a_number_as_shift():
    M = _psd()
    torch.testing.assert_close(damped_inverse(M, 0.5), _reference(M, torch.tensor(0.5)))


def test_inverse_is_exactly_symmetric_and_reads_the_lower_triangle_only():
    # no symmetrization before or after the Cholesky route: the result is still exactly
    # symmetric (cholesky_inverse mirrors its lower triangle), the float64 inverse to
    # rounding, and the upper triangle of M is never read
    for dtype in (torch.float32, torch.float64):
        M = _psd(2, D=40, rank=10, dtype=dtype)
        shift = torch.tensor([1e-2, 1.0], dtype=dtype)
        got = damped_inverse(M, shift)
        assert torch.equal(got, got.mT)
        exact = _reference(M.double(), shift.double())
        tol = 1e-10 if dtype == torch.float64 else 1e-3
        torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * exact.abs().max())
        garbage = M.tril() + torch.triu(torch.full_like(M, 7.0), diagonal=1)
        assert torch.equal(damped_inverse(garbage, shift), got)


def test_not_positive_definite_falls_back_to_the_clamped_eigendecomposition():
    # eigenvalues -1e-3 (rounding far below zero) and a shift 1e-6: Cholesky fails
    M = _psd(D=6, rank=3)
    M = M - 1e-3 * torch.eye(6, dtype=M.dtype)
    shift = torch.tensor(1e-6, dtype=M.dtype)
    assert torch.linalg.cholesky_ex(M + shift * torch.eye(6, dtype=M.dtype))[1] != 0
    evals, evecs = eigh(M)  # clamped at 0
    expected = evecs @ torch.diag(1 / (evals + shift)) @ evecs.mT
    torch.testing.assert_close(damped_inverse(M, shift), expected)


def test_float32_is_closer_to_the_float64_inverse_than_the_eigendecomposition_route():
    M = _psd(D=50, rank=20, dtype=torch.float32)
    shift = torch.tensor(1e-3)
    exact = _reference(M.double(), shift.double())
    chol = damped_inverse(M, shift).double()
    evals, evecs = eigh(M)
    eig = ((evecs / (evals + shift)) @ evecs.mT).double()
    assert (chol - exact).abs().max() < (eig - exact).abs().max()


def test_non_finite_entries_raise_with_the_name():
    M = _psd()
    M[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="damped_inverse\\(A of 'fc'\\).*non-finite"):
        damped_inverse(M, 0.1, name="A of 'fc'")


def test_several_inverses_in_one_pass_fall_back_one_by_one(monkeypatch):
    # the middle matrix is not positive definite after its shift: only it takes the
    # eigendecomposition route; the outcomes are read in one synchronization, and the
    # fallback's eigendecomposition reads once more (its input's and result's finiteness)
    good, other = _psd(D=6, rank=3), _psd(D=4, rank=4)
    bad = good - 1e-3 * torch.eye(6, dtype=good.dtype)
    shifts = [0.5, 1e-6, torch.tensor(0.1, dtype=torch.float64)]
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    got = damped_inverses([good, bad, other], shifts, check_finite=False)
    assert len(reads) == 2
    for g, M, s in zip(got, [good, bad, other], shifts):
        torch.testing.assert_close(g, damped_inverse(M, s))


def test_several_inverses_name_the_non_finite_matrix():
    M = _psd()
    bad = M.clone()
    bad[1, 2] = float("inf")
    with pytest.raises(RuntimeError, match="damped_inverse\\(G of 'b'\\).*non-finite"):
        damped_inverses([M, bad], [0.1, 0.1], names=["A of 'a'", "G of 'b'"])


def test_finite_flags_and_host_values():
    t = torch.ones(3)
    assert finite_flags([t, t * float("nan"), torch.tensor([1.0, -float("inf")])]) == [
        True,
        False,
        False,
    ]
    assert finite_flags([]) == [] and host_values([]) == []
    # a float16 sum of 1000 x 100 would overflow (max 65504): the sum runs in float32
    assert finite_flags([torch.full((1000,), 100.0, dtype=torch.float16)]) == [True]
    assert host_values([torch.tensor(2.5), torch.tensor(True)]) == [2.5, 1.0]


def test_eighs_equal_eigh_with_one_host_read_and_errors_per_matrix(monkeypatch):
    """The inputs' and the results' finiteness are read at once: one host read for all
    matrices (a bad one is decomposed with its non-finite entries zeroed, then dropped
    with its error)."""
    mats = [_psd(D=5, rank=2), _psd(2, D=4, rank=4), _psd(D=3, rank=1, dtype=torch.float32)]
    bad = _psd(D=3)
    bad[0, 1] = float("nan")
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or tolist(t))
    got = eighs([*mats, bad], ["a", "b", "c", "bad"])
    monkeypatch.undo()
    assert len(reads) == 1
    for (evals, evecs), M in zip(got, mats):
        ref_evals, ref_evecs = eigh(M)
        assert evals.dtype == M.dtype and evecs.dtype == M.dtype
        torch.testing.assert_close(evals, ref_evals)  # the same computation as eigh
        torch.testing.assert_close(evecs, ref_evecs)
    assert isinstance(got[3], RuntimeError) and "eigh(bad)" in str(got[3])
    assert "non-finite" in str(got[3])


def test_eighs_decompose_equal_shapes_in_one_call_with_the_same_results(monkeypatch):
    """Equal-shaped matrices go through one batched ``torch.linalg.eigh`` (one error-code
    read on a GPU instead of one per matrix): the same values as one by one (bit for bit on
    the CPU, where LAPACK decomposes a batch matrix by matrix), order kept."""
    mats = [_psd(D=4, rank=3), _psd(D=5), _psd(D=4, rank=4), _psd(D=4, rank=2)]
    shapes = []
    inner = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda M: shapes.append(tuple(M.shape)) or inner(M))
    got = eighs(mats, ["a", "b", "c", "d"])
    monkeypatch.undo()
    assert sorted(shapes) == [(3, 4, 4), (5, 5)]
    for (evals, evecs), M in zip(got, mats):
        ref_evals, ref_evecs = eigh(M)
        assert torch.equal(evals, ref_evals) and torch.equal(evecs, ref_evecs)


def test_foreach_finite_flags_judges_by_the_norm():
    """``curvature.foreach.finite_flags``: NaN and infinities flagged (one flag per group of
    values), finite values kept, including half precision whose sum of magnitudes would
    overflow; a float32 tensor whose sum of squares overflows counts as non-finite (the
    documented bound, about ``1.8e19`` for its norm)."""
    from curvature.foreach import finite_flags as device_flags

    nan, inf = float("nan"), float("inf")
    ts = [torch.ones(3), torch.tensor([1.0, nan]), torch.tensor([-inf, 0.0]), torch.tensor([inf])]
    assert device_flags(ts).tolist() == [True, False, False, False]
    assert device_flags(ts, group=2).tolist() == [False, False]
    assert device_flags([torch.ones(2), torch.ones(5)], group=2).tolist() == [True]
    big = [
        torch.full((1000,), 1e17),
        torch.full((1000,), 1e18),
        torch.full((10,), 1e150, dtype=torch.float64),
    ]
    assert device_flags(big).tolist() == [True, False, True]  # 1e18: norm 3.2e19 overflows
    assert device_flags([torch.full((1000,), 100.0, dtype=torch.float16)]).tolist() == [True]
    assert device_flags([torch.ones(0), torch.tensor([nan])]).tolist() == [True, False]


def test_eighs_pads_smaller_sizes_into_larger_calls_within_the_cost(monkeypatch):
    """On ``PAD_EIGH_DEVICES`` (a GPU's: one host read of the error codes per call)
    smaller matrices join a larger size's batched call, padded with sentinel eigenvalues
    that are dropped, while the padded work stays within ``PAD_EIGH_COST``: cheapest join
    first, chained (4 joins 5, both join 6, 7 joins 9; 6 into 9 would cost too much). Results:
    the eigenvalues of one by one, an orthonormal basis that reconstructs each matrix
    (also with a leading axis and a rank-deficient matrix), the order kept."""
    import curvature.linalg as linalg

    monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",))
    # work sum n^3: 125 + 3 * 216 + 343 + 64 + 729 = 1909, 954.5 allowed; joins 4->5: 61,
    # then 5->6: 2 * 91, then 7->9: 386 (cheaper than 6->7: 5 * 127; 629 in all), then
    # 6->9: 5 * 513 (beyond)
    monkeypatch.setattr(linalg, "PAD_EIGH_COST", 0.5)
    monkeypatch.setattr(linalg, "PAD_EIGH_FREE", 0)
    mats = [_psd(D=5, rank=2), _psd(D=6), _psd(2, D=6, rank=3), _psd(D=7), _psd(D=4), _psd(D=9)]
    mats[4] = mats[4] * 1e3  # a sentinel below every spectrum, whatever its scale
    shapes = []
    inner = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda M: shapes.append(tuple(M.shape)) or inner(M))
    got = eighs(mats, ["a", "b", "c", "d", "e", "f"])
    monkeypatch.undo()
    assert sorted(shapes) == [(2, 9, 9), (5, 6, 6)]
    for (evals, evecs), M in zip(got, mats):
        ref, _ = eigh(M)
        assert evals.shape == ref.shape and evecs.shape == M.shape
        scale = M.abs().max()
        torch.testing.assert_close(evals, ref, rtol=1e-10, atol=1e-10 * scale)
        eye = torch.eye(M.shape[-1], dtype=M.dtype)
        torch.testing.assert_close(evecs.mT @ evecs, eye.expand_as(M), rtol=0, atol=1e-10)
        rebuilt = evecs @ torch.diag_embed(evals) @ evecs.mT
        torch.testing.assert_close(rebuilt, M, rtol=1e-10, atol=1e-10 * scale)


def test_float32_calls_in_cusolvers_jacobi_range_are_solved_in_float64(monkeypatch):
    """On ``PAD_EIGH_DEVICES``, float32 calls of a size in ``FLOAT64_EIGH_SIZES`` (which
    ``torch.linalg.eigh`` gives cuSOLVER's Jacobi solver on CUDA) are solved in float64,
    their results rounded back to float32; other sizes, float64 matrices and a CPU's own
    calls keep their dtype. The results are those of each matrix alone, in float32, and
    a rank-deficient factor's null space is counted at float32's precision (the
    canonical basis of EKFAC is that of the float32 decomposition)."""
    import curvature.linalg as linalg

    monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",))
    monkeypatch.setattr(linalg, "FLOAT64_EIGH_SIZES", (8, 12))
    monkeypatch.setattr(linalg, "PAD_EIGH_COST", 0.0)  # (no joins of their own)
    monkeypatch.setattr(linalg, "PAD_EIGH_FREE", 0)
    mats = [_psd(D=9).float(), _psd(2, D=12, rank=5).float(), _psd(D=6).float(), _psd(D=10)]
    mats += [_psd(D=14).float()]
    calls = []
    inner = torch.linalg.eigh
    monkeypatch.setattr(
        torch.linalg, "eigh", lambda M: calls.append((tuple(M.shape), M.dtype)) or inner(M)
    )
    got = eighs(mats, ["a", "b", "c", "d", "e"], canonical=[True] * 5)
    unchecked = linalg.eighs_unchecked(mats)
    monkeypatch.setattr(linalg, "FLOAT64_EIGH_SIZES", None)
    plain = eighs(mats, ["a", "b", "c", "d", "e"], canonical=[True] * 5)
    monkeypatch.undo()
    f32, f64 = torch.float32, torch.float64
    expected = [((9, 9), f64), ((2, 12, 12), f64), ((6, 6), f32), ((10, 10), f64), ((14, 14), f32)]
    assert sorted(calls[:5], key=str) == sorted(expected, key=str), calls
    assert all(dtype == torch.float32 for _, dtype in calls[10:] if _ != (10, 10))  # None
    for (evals, evecs), (e2, v2), M in zip(got, unchecked, mats):
        assert evals.dtype == evecs.dtype == e2.dtype == v2.dtype == M.dtype
        ref = torch.linalg.eigvalsh(M.double())
        scale = float(M.abs().max())
        torch.testing.assert_close(evals.double(), ref.clamp_min(0), rtol=0, atol=1e-5 * scale)
        rebuilt = evecs @ torch.diag_embed(evals) @ evecs.mT
        torch.testing.assert_close(rebuilt, M, rtol=0, atol=1e-5 * scale)
        eye = torch.eye(M.shape[-1], dtype=M.dtype).expand_as(M)
        torch.testing.assert_close(evecs.mT @ evecs, eye, rtol=0, atol=1e-5)
    # the 12s (rank 5): the same null space, and its canonical basis, either way
    Q, P = got[1][1][..., :7], plain[1][1][..., :7]
    torch.testing.assert_close(Q @ Q.mT, P @ P.mT, rtol=0, atol=1e-4)
    torch.testing.assert_close(Q, P, rtol=0, atol=1e-3)


def test_a_failed_float64_first_attempt_retries_with_jitter_not_the_same_call(monkeypatch):
    """A float32 factor solved in float64 (``FLOAT64_EIGH_SIZES``) whose first attempt
    fails is retried with a jitter at once: not the same float64 call again (``eighs`` and
    ``eighs_unchecked``)."""
    import curvature.linalg as linalg

    monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",))
    monkeypatch.setattr(linalg, "FLOAT64_EIGH_SIZES", (8, 16))
    M = _psd(D=12).float()
    for decompose in (lambda: eighs([M], ["m"])[0], lambda: linalg.eighs_unchecked([M])[0]):
        seen = []
        inner = torch.linalg.eigh

        def failing_once(S, seen=seen, inner=inner):
            seen.append(S.clone())
            if len(seen) == 1:
                raise RuntimeError("no convergence")
            return inner(S)

        monkeypatch.setattr(torch.linalg, "eigh", failing_once)
        evals, evecs = decompose()
        monkeypatch.setattr(torch.linalg, "eigh", inner)
        assert len(seen) == 2 and all(S.dtype == torch.float64 for S in seen)
        assert not torch.equal(seen[0], seen[1])  # the jitter
        assert evals.dtype == evecs.dtype == torch.float32
        torch.testing.assert_close(evecs @ torch.diag_embed(evals) @ evecs.mT, M, atol=1e-4, rtol=0)


def test_a_non_finite_matrix_in_a_padded_call_fails_alone(monkeypatch):
    """A matrix with NaN or inf entries joins the padded call (its entries zeroed for the
    decomposition) and gets its error; the others of the call are decomposed as alone."""
    import curvature.linalg as linalg

    monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",))
    good = [_psd(D=6), _psd(D=4, rank=2)]
    bad = _psd(D=5)
    bad[1, 3] = float("nan")
    worse = _psd(D=3)
    worse[0, 0] = float("inf")
    shapes = []
    inner = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda M: shapes.append(tuple(M.shape)) or inner(M))
    got = eighs([good[0], bad, good[1], worse], ["a", "bad", "b", "worse"])
    monkeypatch.undo()
    assert shapes == [(4, 6, 6)]  # one padded call for all four
    for i, name in ((1, "bad"), (3, "worse")):
        assert isinstance(got[i], RuntimeError) and f"eigh({name})" in str(got[i])
    for (evals, evecs), M in zip((got[0], got[2]), good):
        ref, _ = eigh(M)
        torch.testing.assert_close(evals, ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(
            evecs @ torch.diag_embed(evals) @ evecs.mT, M, atol=1e-10, rtol=0
        )


def test_the_default_padding_cost_joins_an_mlps_sizes_as_documented():
    """The default ``PAD_EIGH_COST`` on an MLP 784-2048-2048-10's factor sizes (``A``:
    785, 2049, 2049; ``G``: 2048, 2048, 10): the 2048s join the 2049s, the 10 joins the
    785, the 785 stays (two calls instead of four on a GPU); without a budget nothing
    joins, with a large one everything does; small matrices always join (``free``)."""
    from curvature.linalg import padded_sizes

    counts = {785: 1, 2049: 2, 2048: 2, 10: 1}
    assert padded_sizes(counts) == {10: 785, 785: 785, 2048: 2049, 2049: 2049}
    assert padded_sizes(counts, budget=0.0) == {n: n for n in counts}
    assert padded_sizes(counts, budget=0.0, free=1e9) == {10: 785, 785: 785, 2048: 2049, 2049: 2049}
    assert set(padded_sizes({4: 1, 7: 1, 8: 5, 9: 5}, budget=0.0).values()) == {9}
    assert set(padded_sizes(counts, budget=1.0).values()) == {2049}
    assert padded_sizes({}) == {} and padded_sizes({7: 3}) == {7: 7}


def test_eighs_keeps_one_call_per_shape_on_a_cpu():
    mats = [_psd(D=4), _psd(D=5), _psd(D=5)]
    from curvature.linalg import PAD_EIGH_DEVICES

    assert "cpu" not in PAD_EIGH_DEVICES
    got = eighs(mats, ["a", "b", "c"])
    for (evals, evecs), M in zip(got, mats):
        ref_evals, ref_evecs = eigh(M)
        assert torch.equal(evals, ref_evals) and torch.equal(evecs, ref_evecs)


def test_ekfac_with_padded_decompositions_steps_as_without(monkeypatch):
    """EKFAC's refresh through the padded batches (an MLP whose first ``A`` is 7 x 7 and
    first ``G`` 8 x 8) moves the parameters as with one call per shape (full-rank
    factors: eigenbases unique up to signs, which the corrections do not see)."""
    from torch import nn

    import curvature
    import curvature.linalg as linalg

    def run(pad):
        monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",) if pad else ())
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()
        opt = curvature.EKFAC(model, lr=0.1, damping=1e-2, inverse_every=2)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            X = torch.randn(64, 6, generator=g, dtype=torch.float64)
            y = torch.randint(0, 4, (64,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(model(X), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("cls", ["KFAC", "EKFAC"])
def test_one_sided_blocks_with_padded_decompositions_step_as_without(monkeypatch, cls):
    """A token model whose embedding and head are one-sided blocks (their full sides 8 x 8
    and 9 x 9): decomposed in padded calls (KFAC: on their own, unchecked; EKFAC: with
    the Kronecker blocks' factors) the parameters move as with one call per shape."""
    from torch import nn

    import curvature
    import curvature.linalg as linalg

    def run(pad):
        monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",) if pad else ())
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(40, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 40))
        model = model.double()
        opt = getattr(curvature, cls)(
            model, lr=0.1, damping=1e-2, inverse_every=2, max_factor_size=16
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            tokens = torch.randint(0, 40, (4, 6), generator=g)
            opt.zero_grad()
            out = model(tokens).flatten(0, 1)
            nn.functional.cross_entropy(out, torch.randint(0, 40, (24,), generator=g)).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for a, b in zip(run(True), run(False)):
            torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


def test_eigh_reads_the_device_once_and_names_a_non_finite_matrix():
    """``eigh`` of one matrix: the input's and the result's finiteness in one host read
    (a synchronization on a GPU), the same values as before (clamped at 0), and the
    error naming the matrix for NaN entries."""
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
    from step_counts import HostReads

    M = _psd(D=5, rank=2)
    with HostReads() as reads:
        evals, evecs = eigh(M)
    assert reads.count == 1
    ref = torch.linalg.eigh((M + M.mT) / 2)
    torch.testing.assert_close(evals, ref.eigenvalues.clamp_min(0))
    torch.testing.assert_close(evecs @ torch.diag_embed(evals) @ evecs.mT, M, atol=1e-10, rtol=0)
    bad = M.clone()
    bad[0, 1] = float("nan")
    with pytest.raises(RuntimeError, match="eigh\\(G of 'x'\\).*non-finite"):
        eigh(bad, name="G of 'x'")


@pytest.mark.parametrize("layout", ["row-major", "column-major", "1x1 slice", "batched"])
def test_kron_equals_torch_kron_for_every_layout(layout):
    """``linalg.kron`` equals ``torch.kron`` (of contiguous copies) entry by entry, also
    for a column-major ``B`` beside a row-major ``A`` (``torch.kron`` raises on that mix:
    ``torch.linalg.eigh``'s eigenvectors beside a padded decomposition's copies) and a 1 x 1
    slice with odd strides; batched over a leading axis."""
    from curvature.blocks.running import kron

    g = torch.Generator().manual_seed(0)
    A = torch.randn(2, 3, 4, generator=g, dtype=torch.float64)
    B = torch.randn(2, 5, 2, generator=g, dtype=torch.float64)
    if layout == "column-major":
        B = torch.randn(2, 2, 5, generator=g, dtype=torch.float64).mT
    elif layout == "1x1 slice":
        B = torch.randn(2, 24, 24, generator=g, dtype=torch.float64).mT[:, :1, 23:]
    got = kron(A, B)
    for i in range(2):
        ref = torch.kron(A[i], B[i].contiguous().clone())
        torch.testing.assert_close(got[i], ref, rtol=0, atol=0)
    if layout == "batched":  # no leading axis: one matrix
        torch.testing.assert_close(kron(A[0], B[0]), got[0], rtol=0, atol=0)


def test_ekfac_function_with_padded_decompositions_gives_the_same_dense_matrix(monkeypatch):
    """``curvature.ekfac(...).to_dense()`` through padded batched decompositions (a CUDA
    refresh's; a 1 x 1 factor padded into 24 x 24, and column-major eigenvectors) equals
    the one-call-per-shape result (the first GPU run failed in ``torch.kron`` here)."""
    from torch import nn

    import curvature
    import curvature.linalg as linalg

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 12), nn.Tanh(), nn.Linear(12, 24), nn.Tanh())
    model.append(nn.Linear(24, 1, bias=False)).double()
    g = torch.Generator().manual_seed(1)
    X = torch.randn(40, 96, generator=g, dtype=torch.float64)
    y = torch.randn(40, 1, generator=g, dtype=torch.float64)
    dense = {}
    for pad in (True, False):
        monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",) if pad else ())
        dense[pad] = curvature.ekfac(model, nn.MSELoss(), (X, y), fisher="empirical").to_dense()
    torch.testing.assert_close(dense[True], dense[False], rtol=1e-9, atol=1e-12)


def test_padded_eighs_results_hold_no_more_memory_than_their_own(monkeypatch):
    """Results of a padded batched call each own their storage: a view of the batch
    would keep the padded members' share alive beside their copies (the H100 run showed
    EKFAC's state 34 MiB larger on the MLP: two 2048 x 2048 bases twice)."""
    import curvature.linalg as linalg

    monkeypatch.setattr(linalg, "PAD_EIGH_DEVICES", ("cpu",))
    mats = [_psd(D=9), _psd(2, D=8), _psd(D=9)]
    for evals, evecs in eighs(mats, ["a", "b", "c"]):
        for t in (evals, evecs):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_damped_inverses_written_into_the_given_storage(dtype):
    """``into``: the damped copy, its factor and (on a CPU) the inverse in the storage
    handed in, the same values as without it; storage that cannot take it is left alone."""
    from curvature.linalg import damped_inverses_or_errors, inverts_in_place

    torch.manual_seed(0)
    X = torch.randn(40, 7, dtype=dtype)
    M = (X.T @ X).unsqueeze(0)
    M2 = M[:, :5, :5].clone()
    fresh = damped_inverses_or_errors([M, M2], [1e-2, 1e-1])
    buf = torch.full_like(M, float("nan"))
    wrong = torch.empty(1, 6, 6, dtype=dtype)  # not M2's shape: not used
    out = damped_inverses_or_errors([M, M2], [1e-2, 1e-1], into=[buf, wrong])
    assert inverts_in_place(M.device)
    assert out[0].data_ptr() == buf.data_ptr()
    assert out[1].data_ptr() != wrong.data_ptr()
    for a, b in zip(out, fresh):
        assert torch.equal(a, b)
    dense = torch.linalg.inv(M[0] + 1e-2 * torch.eye(7, dtype=dtype))
    assert torch.allclose(out[0][0], dense, rtol=1e-4 if dtype == torch.float32 else 1e-10)


def test_refreshes_without_in_place_inverses_take_the_same_steps(monkeypatch):
    """Where inverses are not written in place (a GPU's path, taken here on the CPU:
    row-major factors, no previous inverse handed in) the steps are those of the
    in-place path up to rounding."""
    from torch import nn

    import curvature
    from curvature import linalg

    def run():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        opt = curvature.KFAC(model, lr=0.1, inverse_every=2)
        X, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        for _ in range(7):
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(X), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    in_place = run()
    monkeypatch.setattr(linalg, "COLUMN_MAJOR_CHOLESKY_DEVICES", ())
    assert not linalg.inverts_in_place(torch.device("cpu"))
    for a, b in zip(in_place, run()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
