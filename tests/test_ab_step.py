"""benchmarks/ab_step.py: two packages' steps timed in one process."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ab_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def test_compares_a_checkout_with_itself(capsys):
    ab_step.main(["--old", str(ROOT), "--workload", "fm", "--periods", "2", "--steps", "1"])
    out = capsys.readouterr().out
    assert "KFAC on fm" in out and "new / old: min" in out


def test_the_old_package_is_the_given_checkouts(tmp_path):
    # a copy imported under another name, beside this checkout's package
    (tmp_path / "curvature").mkdir()
    (tmp_path / "curvature" / "__init__.py").write_text("MARK = 'old'\n")
    old = ab_step.import_old(str(tmp_path), str(tmp_path / "into"))
    assert old.MARK == "old" and old.__name__ == "curvature_old"


def test_a_path_without_the_package_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no curvature/ package"):
        ab_step.main(["--old", str(tmp_path)])
