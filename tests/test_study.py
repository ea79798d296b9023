"""The exact-vs-approximate study helper."""

import pytest
import torch
from torch import nn

from curvature.study import compare_approximations

pytestmark = pytest.mark.usefixtures("float64")


def test_study_reports_zero_error_for_kfac_on_one_datum_blocks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    data = (torch.randn(1, 3), torch.randint(0, 2, (1,)))
    res = compare_approximations(model, nn.CrossEntropyLoss(), data, ["kfac", "ef", "diag-ggn"])
    assert set(res.layers) == {"0", "2"}
    for layer in res.layers:  # KFAC is exact on each layer's block for one datum
        assert res.rel_error["kfac"][layer] < 1e-10
    assert res.rel_error["diag-ggn"]["overall"] > 1e-3
    assert -1.0 <= res.cosine["ef"] <= 1.0 + 1e-12
    table = res.table()
    assert "| kfac |" in table and "ggn (exact)" in table


def test_study_rejects_unknown_approximation():
    model = nn.Sequential(nn.Linear(3, 2))
    data = (torch.randn(4, 3), torch.randint(0, 2, (4,)))
    with pytest.raises(ValueError, match="unknown approximation 'foo'"):
        compare_approximations(model, nn.CrossEntropyLoss(), data, ["foo"])


def test_fisher_study_example_runs(tmp_path):
    pytest.importorskip("sklearn")
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "fisher_study.py"
    spec = importlib.util.spec_from_file_location("fisher_study", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--points", "32", "--epochs", "1", "--hidden", "4"])
