"""The one place where the per-sample cases are expanded (dtype x reduction x batch size)."""

from __future__ import annotations

import pytest
import torch
from cases import BATCH_SIZES, CASES, DTYPES, REDUCTIONS, Problem, build, torch_state

GRID = [
    pytest.param(
        (case, dtype, reduction, N),
        id=f"{case.name}-{str(dtype).removeprefix('torch.')}-{reduction}-N{N}",
    )
    for case in CASES
    for dtype in DTYPES
    for reduction in REDUCTIONS
    for N in BATCH_SIZES
]


@pytest.fixture(scope="session", params=GRID)
def problem(request) -> Problem:
    """A built case; its twin's gradients are computed once and shared by the tests."""
    return build(*request.param)


def pytest_configure(config):
    # torch.func's twins run ops without a batching rule (attention, bilinear): slow, not wrong
    config.addinivalue_line(
        "filterwarnings", "ignore:There is a performance drop because we have not yet implemented"
    )


@pytest.fixture
def float64():
    """float64 as the default dtype for one test (restored after)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


@pytest.fixture
def float64_seeded(float64):
    """float64 and a fixed seed, the global RNG state restored after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        yield


@pytest.fixture
def one_thread_seeded():
    """One intra-op thread, the RNG forked and seeded with 0, restored after
    (:func:`cases.torch_state`; a module opts in with ``pytest.mark.usefixtures``)."""
    with torch_state():
        yield
