"""benchmarks/resnet_step.py: the ResNet-18 step breakdown runs and records every row."""

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import resnet_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def test_records_every_optimizer_and_a_profile(tmp_path, capsys):
    argv = ["--device", "cpu", "--width", "2", "--batch", "2", "--steps", "1", "--rows", "5"]
    resnet_step.main([*argv, "--out", str(tmp_path)])
    data = json.loads((tmp_path / "resnet_step.json").read_text())
    rows = data["results"]
    assert list(rows) == [
        "AdamW",
        "SGD",
        "KFAC",
        "KFAC, refresh every step",
        "KFAC, factor_every=10",
    ]
    assert all(r["wall_ms"] > 0 and r["host_ms"] > 0 and r["aten_calls"] > 0 for r in rows.values())
    # a refresh adds decompositions: more aten calls than a step without one
    assert rows["KFAC, refresh every step"]["aten_calls"] > rows["KFAC"]["aten_calls"]
    # the counted step of factor_every=10 takes no statistics: fewer calls than KFAC's
    assert rows["KFAC, factor_every=10"]["aten_calls"] < rows["KFAC"]["aten_calls"]
    assert "Self CPU" in (tmp_path / "profile.txt").read_text()
    assert "host" in capsys.readouterr().out
