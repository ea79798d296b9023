"""benchmarks/ab_step.py: two packages' steps timed in one process."""

import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import ab_step  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def test_compares_a_checkout_with_itself():
    # in a process of its own (the copy registers operators of its own)
    argv = ["--old", str(ROOT), "--workload", "fm", "--periods", "2", "--steps", "1"]
    script = str(ROOT / "benchmarks" / "ab_step.py")
    run = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "KFAC on fm" in run.stdout and "new / old: min" in run.stdout


def test_the_copys_operators_do_not_replace_ours(tmp_path):
    # torch.library keeps one implementation per operator name: the copy's go to a
    # namespace of their own (else the compiled-model tests that run after this one
    # in the same process find the copy's receivers instead of ours, and fail)
    ab_step.import_old(str(ROOT), str(tmp_path))
    assert hasattr(torch.ops.curvature_old, "tap") and hasattr(torch.ops.curvature_old, "grab")
    copied = "".join(p.read_text() for p in (tmp_path / "curvature_old").rglob("*.py"))
    assert '"curvature::' not in copied and "torch.ops.curvature." not in copied
    for name in [m for m in sys.modules if m.split(".")[0] == "curvature_old"]:
        del sys.modules[name]


def test_the_old_package_is_the_given_checkouts(tmp_path):
    # a copy imported under another name, beside this checkout's package
    (tmp_path / "curvature").mkdir()
    (tmp_path / "curvature" / "__init__.py").write_text("MARK = 'old'\n")
    old = ab_step.import_old(str(tmp_path), str(tmp_path / "into"))
    assert old.MARK == "old" and old.__name__ == "curvature_old"


def test_a_path_without_the_package_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="no curvature/ package"):
        ab_step.main(["--old", str(tmp_path)])


def test_an_unknown_optimizer_is_refused():
    with pytest.raises(SystemExit, match="not an optimizer"):
        ab_step.make_step(torch, "fm", "NoSuchOptimizer")


@pytest.mark.parametrize(
    "kwargs, key, want",
    [
        ({"fisher": "mc"}, "fisher", "mc"),
        ({}, "fisher", None),
        ({"extra": {"kfac_approx": "reduce"}}, "kfac_approx", "reduce"),
    ],
)
def test_the_options_reach_the_optimizer(kwargs, key, want, monkeypatch):
    import curvature

    made = []

    class Spy(curvature.KFAC):
        def __init__(self, *args, **options):
            made.append(options.get(key))
            super().__init__(*args, **options)

    monkeypatch.setattr(curvature, "KFAC", Spy)
    ab_step.make_step(curvature, "fm", "KFAC", warmup=1, **kwargs)
    assert made == [want]


def test_options_are_read_as_json():
    with pytest.raises(SystemExit):  # argparse's refusal of a value that is not JSON
        ab_step.main(["--old", str(ROOT), "--options", "{not json"])


def test_options_must_be_a_json_object():
    with pytest.raises(SystemExit, match="expected a JSON object"):
        ab_step.main(["--old", str(ROOT), "--options", "[1, 2]"])


def test_the_gpu_workloads_are_issue_17s_shapes():
    model, X, y, options = ab_step.workload("gpu-vgg")
    assert tuple(X.shape) == (256, 3, 32, 32) and model(X[:2]).shape == (2, 10)
    model, X, y, _ = ab_step.workload("gpu-resnet")
    assert tuple(X.shape) == (128, 1, 28, 28) and model.conv1.out_channels == 64
    assert options == {"lr": 1e-3, "damping": 0.1}
