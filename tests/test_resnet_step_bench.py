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


def test_chunk_floors_alternate_and_restore_the_floor(tmp_path):
    """``--chunk-floors``: KFAC's row with each floor three times; a floor that cuts the
    batch into more chunks makes more aten calls; the library's floor is put back."""
    from curvature import layer_diagonal

    kept = layer_diagonal.KFAC_CHUNK_ELEMENTS
    argv = ["--device", "cpu", "--width", "2", "--batch", "4", "--steps", "1"]
    resnet_step.main([*argv, "--chunk-floors", "1,1048576", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "chunk_floors.json").read_text())["results"]
    assert list(rows) == ["1", "1048576"] and all(len(v) == 3 for v in rows.values())
    assert rows["1"][0]["aten_calls"] > rows["1048576"][0]["aten_calls"]
    assert layer_diagonal.KFAC_CHUNK_ELEMENTS == kept
