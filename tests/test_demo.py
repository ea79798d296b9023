"""The README's demo (`python -m curvature.demo`): small, fast runs of its pieces."""

import gzip
import json
import struct
import sys

import numpy as np
import pytest
import torch

from curvature import demo, demo_data


def write_idx(path, array: np.ndarray) -> None:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">f4"): 0x0D}
    header = bytes([0, 0, codes[array.dtype], array.ndim])
    header += struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.tobytes()
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(raw)
    else:
        path.write_bytes(raw)


def tiny_fashion(folder, n_train=96, n_test=40, gz=True):
    rng = np.random.default_rng(0)
    ext = ".gz" if gz else ""
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        labels = (np.arange(n) % 10).astype(np.uint8)
        images = rng.integers(0, 40, size=(n, 28, 28)).astype(np.uint8)
        images[np.arange(n), labels, :] = 255  # learnable: the label's row is bright
        write_idx(folder / f"{prefix}-images-idx3-ubyte{ext}", images)
        write_idx(folder / f"{prefix}-labels-idx1-ubyte{ext}", labels)
    return folder


def test_demo_runs_on_digits(tmp_path, capsys):
    pytest.importorskip("sklearn")
    fig, js = tmp_path / "curves.png", tmp_path / "demo.json"
    args = ["--epochs", "1", "--subsample", "300", "--no-progress", "--device", "cpu"]
    results = demo.main(args + ["--figure", str(fig), "--json", str(js)])
    out = capsys.readouterr().out
    assert set(results) == {"sgd", "clip", "adam", "kfac", "ekfac"}
    for label in ("SGD", "SGD + per-sample clip", "Adam", "KFAC", "EKFAC"):
        assert f"| {label} |" in out
    assert "time to loss 0.1 (s)" in out and "equals x: True" in out
    assert "steps to loss 0.1" in out and "time to target / Adam's" in out
    grid = results["adam"]["grid"]
    assert [p["lr"] for p in grid] == list(demo.ADAM_GRID) and len(grid) >= 3
    assert results["adam"]["lr"] in demo.ADAM_GRID and "tuned over" in out
    assert "Adam's learning rate, tuned on this data and seed" in out
    assert "0.001: not reached (final loss" in out  # 5 steps at lr 1e-3
    for r in results.values():
        h = r["history"]
        assert h["epoch"][0] == 0 and h["epoch"][-1] == pytest.approx(1.0)
        assert h["step"][0] == 0 and h["step"][-1] == r["steps_per_epoch"]
        assert len(h["time"]) == len(h["loss"]) >= 3 and h["time"] == sorted(h["time"])
        assert 0 <= r["test_acc"] <= 1 and np.isfinite(r["train_loss"])
        if r["time_to_target"] is not None:
            assert r["time_to_target"] <= r["seconds"]
            i = h["step"].index(r["steps_to_target"])  # the first evaluation at the target
            assert h["loss"][i] <= 0.1 and min(h["loss"][:i], default=1) > 0.1
    assert 0 <= results["clip"]["clipped"] <= 1 and results["sgd"]["clipped"] is None
    assert json.loads(js.read_text())["results"]["kfac"]["optimizer"] == "KFAC"
    if _has("matplotlib"):
        assert fig.exists() and fig.stat().st_size > 1000
        assert str(fig) in out


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_target_and_figure_options(tmp_path, capsys):
    pytest.importorskip("sklearn")
    results = demo.main(
        ["--epochs", "1", "--subsample", "200", "--optimizers", "adam", "kfac"]
        + ["--target-loss", "100", "--figure", "", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert set(results) == {"adam", "kfac"}
    assert "time to loss 100 (s)" in out and "figure" not in out
    for r in results.values():  # the initial loss (~2.3) is below 100: reached at once
        assert r["time_to_target"] == 0.0 and r["epochs_to_target"] == 0.0
        assert r["steps_to_target"] == 0
    assert "the tuned Adam started below it: no ratio" in out


def _result(label, steps, seconds, loss=0.05):
    h = {"step": [0, steps or 10], "epoch": [0, 1], "time": [0, seconds or 1], "loss": [2, loss]}
    return {
        "optimizer": label,
        "settings": "s",
        "train_loss": loss,
        "test_acc": 0.9,
        "seconds": 2.0,
        "steps_to_target": steps,
        "epochs_to_target": None if steps is None else steps / 10,
        "time_to_target": seconds,
        "clipped": None,
        "history": h,
    }


def test_tuning_keeps_fewest_steps_then_lowest_loss():
    rank = demo.tuning_rank
    runs = {
        "fast": _result("A", 40, 9.0, loss=0.09),  # fewest steps, even if its clock was slow
        "slow": _result("A", 60, 1.0, loss=0.01),
        "tie": _result("A", 40, 2.0, loss=0.08),  # same steps, lower loss: wins the tie
        "missed": _result("A", None, None, loss=0.001),
        "nan": _result("A", None, None, loss=float("nan")),
    }
    assert min(runs, key=lambda k: rank(runs[k])) == "tie"
    del runs["tie"], runs["fast"], runs["slow"]
    assert min(runs, key=lambda k: rank(runs[k])) == "missed"  # none reached: lowest loss


def test_table_ratio_and_verdicts():
    results = {
        "adam": {**_result("Adam", 50, 2.0), "grid": []},
        "kfac": _result("KFAC", 20, 3.0),
        "ekfac": _result("EKFAC", None, None, loss=0.5),
    }
    text = demo.table(results, target=0.1)
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines()[2:]}
    assert rows["KFAC"][5:8] == ["20 (epoch 2.00)", "3.00", "1.50 |"]
    assert rows["Adam"][7] == "1.00 |" and rows["EKFAC"][5] == "not reached"
    lines = demo.verdicts(results, target=0.1)
    assert lines == [
        "KFAC reached loss 0.1 in 3.00 s (20 steps), 1.50x the time of the tuned Adam "
        "(2.00 s, 50 steps).",
        "EKFAC did not reach loss 0.1.",
    ]
    results["adam"] = _result("Adam", None, None, loss=0.3)  # untuned, missed
    assert demo.verdicts(results, 0.1)[0].endswith("Adam (not tuned) did not reach it: no ratio.")
    assert demo.table(results, 0.1).splitlines()[3].endswith("| 20 (epoch 2.00) | 3.00 | - |")


def test_adam_grid_and_no_tune_options(capsys):
    pytest.importorskip("sklearn")
    base = ["--epochs", "1", "--subsample", "128", "--optimizers", "adam", "--figure", ""]
    base += ["--no-progress", "--eval-samples", "128"]
    results = demo.main(base + ["--adam-lrs", "0.05", "1e-5"])
    out = capsys.readouterr().out
    grid = results["adam"]["grid"]
    assert [p["lr"] for p in grid] == [0.05, 1e-5] and results["adam"]["lr"] == 0.05
    assert grid[1]["train_loss"] > grid[0]["train_loss"]  # lr 1e-5 barely moves
    assert "tuned over 0.05, 1e-05" in out  # 2 steps: neither reaches loss 0.1
    assert "Kept: 0.05 (none reached the target: lowest final training loss)" in out
    results = demo.main(base + ["--no-tune", "--adam-lr", "0.02"])
    out = capsys.readouterr().out
    assert "grid" not in results["adam"] and "lr 0.02 (not tuned)" in out
    assert "tuned on this data" not in out
    with pytest.raises(SystemExit):
        demo.parse_args(["--adam-lrs", "0.1", "-1"])


def test_read_idx(tmp_path):
    a = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a-idx3-ubyte", a)
    write_idx(tmp_path / "a-idx3-ubyte.gz", a)
    f = np.arange(6, dtype=">f4").reshape(6)
    write_idx(tmp_path / "f-idx1", f)
    np.testing.assert_array_equal(demo_data.read_idx(str(tmp_path / "a-idx3-ubyte")), a)
    np.testing.assert_array_equal(demo_data.read_idx(str(tmp_path / "a-idx3-ubyte.gz")), a)
    np.testing.assert_array_equal(demo_data.read_idx(str(tmp_path / "f-idx1")), f)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x01\x00")
    with pytest.raises(ValueError, match="magic"):
        demo_data.read_idx(str(tmp_path / "bad"))
    (tmp_path / "short").write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"\x00")
    with pytest.raises(ValueError, match="shape"):
        demo_data.read_idx(str(tmp_path / "short"))


@pytest.mark.parametrize("gz", [True, False])
def test_fashion_mnist_from_data_dir(tmp_path, gz):
    tiny_fashion(tmp_path, gz=gz)
    data = demo.load_data("fashion-mnist", str(tmp_path), subsample=64)
    assert data.Xtr.shape == (64, 784) and data.Xte.shape == (40, 784)
    assert data.Xtr.dtype == torch.float32 and 0 <= data.Xtr.min() and data.Xtr.max() <= 1
    assert data.ytr.dtype == torch.long and set(data.yte.tolist()) == set(range(10))
    assert "Fashion-MNIST" in data.description


def test_fashion_mnist_demo(tmp_path, capsys):
    tiny_fashion(tmp_path)
    results = demo.main(
        ["--dataset", "fashion-mnist", "--data-dir", str(tmp_path), "--epochs", "1"]
        + ["--optimizers", "adam", "kfac", "--figure", "", "--no-progress", "--hidden", "16"]
    )
    out = capsys.readouterr().out
    assert "Fashion-MNIST 28x28" in out and "MLP 784-16-10" in out
    assert "time to loss 0.4 (s)" in out and set(results) == {"adam", "kfac"}


def test_fashion_mnist_missing(tmp_path):
    with pytest.raises(SystemExit, match="--data-dir"):
        demo.load_data("fashion-mnist", str(tmp_path))


def test_device_choice():
    assert demo.pick_device("cpu") == torch.device("cpu")
    assert demo.pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA is not available"):
            demo.pick_device("cuda")


def test_progress_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    bar = demo.progress_bar(6, "KFAC", steps_per_epoch=3)
    assert isinstance(bar, demo._PlainBar)
    bar.set_postfix_str("loss 0.5")
    for _ in range(6):
        bar.update(1)
    bar.close()
    out = capsys.readouterr().out.splitlines()
    assert out == ["KFAC: epoch 1, step 3/6 loss 0.5", "KFAC: epoch 2, step 6/6 loss 0.5"]


def test_help_documents_every_option_with_its_real_default(capsys):
    """Every option has help text; no default is shown as None (the dataset-dependent ones
    name their values)."""
    with pytest.raises(SystemExit):
        demo.parse_args(["--help"])
    out = capsys.readouterr().out
    parser_help = out.split("options:", 1)[1]
    assert "None" not in parser_help
    options = [a for a in demo.build_parser()._actions if a.option_strings]
    assert all(a.help for a in options), [a.option_strings for a in options if not a.help]
    for text in ("(default: 10 for digits, 3 for fashion-mnist)", "(default: 64)", "0: none"):
        assert text in " ".join(parser_help.split())


def test_figure_labels_the_target_and_plots_against_steps(tmp_path, monkeypatch):
    plt = pytest.importorskip("matplotlib.pyplot")
    shown = {}
    monkeypatch.setattr(plt, "close", lambda fig: shown.setdefault("fig", fig))
    h = {"step": [0, 5, 10], "epoch": [0, 0.5, 1], "time": [0, 0.1, 0.2], "loss": [2, 1, 0.5]}
    results = {
        "kfac": {"optimizer": "KFAC", "history": h, "steps_per_epoch": 10},
        "adam": {"optimizer": "Adam", "label": "Adam, tuned lr 0.03", "history": h},
    }
    assert demo.plot(results, str(tmp_path / "f.png"), "title", target=0.7)
    wall, steps = shown["fig"].axes
    assert steps.get_xlabel() == "step (10 per epoch)" and "wall time" in wall.get_xlabel()
    for ax in (wall, steps):
        labels = [line.get_label() for line in ax.get_lines()]
        assert labels == ["KFAC", "Adam, tuned lr 0.03", "target loss 0.7"]
    assert list(steps.get_lines()[0].get_xdata()) == [0, 5, 10]
