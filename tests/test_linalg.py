"""``curvature.linalg``: damped inverses by Cholesky, with the eigendecomposition fallback."""

from __future__ import annotations

import pytest
import torch

from curvature.linalg import damped_inverse, eigh


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
