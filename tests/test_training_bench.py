"""benchmarks/training.py: the report and the verdicts from fixture runs (nothing is timed)."""

import pathlib
import sys

import torch
from torch import nn

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import training  # noqa: E402


def run(method, seed, t, steps=100, losses=(1.0, 0.2)):
    return {
        "method": method,
        "seed": seed,
        "steps": [0, steps],
        "times": [0.0, 5.0 if t is None else t],
        "losses": list(losses),
        "metrics": [{"loss": x} for x in losses],
        "steps_to_target": None if t is None else steps,
        "time_to_target": t,
        "diverged": False,
    }


def fixture():
    return {
        "fmnist-mlp": {
            "title": "MLP",
            "target": "loss <= 0.3",
            "grids": {"adam": [run("Adam lr=0.001", 0, None), run("Adam lr=0.003", 0, 4.0)]},
            "runs": [
                run("Adam lr=0.003", 0, 4.0),
                run("Adam lr=0.003", 1, 5.0),
                run("KFAC defaults", 0, 1.0, 20),
                run("KFAC defaults", 1, 3.0, 60),
            ],
        }
    }


def test_report_lists_every_seed_and_says_met_or_not_met():
    text = training.report(fixture(), [0, 1])
    assert "| KFAC defaults | 1.0 s / 20 | 3.0 s / 60 |" in text
    # 1/4 on seed 0 but 3/5 on seed 1: the <= 0.5 target is not met on each seed
    assert "= 0.25, 0.60" in text and "**not met**" in text
    assert "0.001: not reached" in text


def test_verdict_met_only_when_every_seed_is_below_the_bound():
    res = fixture()
    res["fmnist-mlp"]["runs"][3] = run("KFAC defaults", 1, 2.0, 40)
    assert "**met**" in training.report(res, [0, 1])


def test_apply_target_reads_the_curve():
    r = run("KFAC", 0, None, losses=(1.0, 0.2))
    training.apply_target(r, lambda m: m["loss"] <= 0.5)
    assert r["time_to_target"] == 5.0 and r["steps_to_target"] == 100
    training.apply_target(r, lambda m: m["loss"] <= 0.1)
    assert r["time_to_target"] is None


def test_train_stops_at_the_target_and_counts_steps():
    torch.manual_seed(0)
    X = torch.randn(64, 3)
    y = X @ torch.tensor([[1.0], [-2.0], [0.5]])
    mse = nn.MSELoss()

    def evaluate(model):
        with torch.no_grad():
            return {"loss": float(mse(model(X), y))}

    wl = training.Workload(
        name="toy",
        title="toy",
        make_model=lambda: nn.Linear(3, 1),
        X=X,
        y=y,
        loss_func=mse,
        batch=16,
        budget=30.0,
        eval_every=5,
        evaluate=evaluate,
        reached=lambda m: m["loss"] <= 1e-2,
        target_text="loss <= 1e-2",
    )
    r = training.train(wl, "SGD", "sgd", {"lr": 0.05}, 0)
    assert r.time_to_target is not None and r.steps_to_target % 5 == 0
    assert r.losses[-1] <= 1e-2 < r.losses[-2]
