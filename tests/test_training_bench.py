"""benchmarks/training.py: the report and the verdicts from fixture runs (nothing is timed)."""

import pathlib
import sys
import time

import pytest
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


def toy_workload(**overrides) -> "training.Workload":
    """A 3 -> 1 linear regression workload that never reaches its target (``overrides``:
    any :class:`Workload` field)."""
    X = overrides.pop("X", None)
    X = torch.randn(32, 3) if X is None else X
    fields = dict(
        name="toy",
        title="toy",
        make_model=lambda: nn.Linear(3, 1),
        X=X,
        y=X[:, :1],
        loss_func=nn.MSELoss(),
        batch=8,
        budget=3.0,
        eval_every=2,
        evaluate=lambda m: {"loss": 1.0},
        reached=lambda m: False,
        target_text="never",
    )
    return training.Workload(**{**fields, **overrides})


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


def test_train_checks_by_time_when_eval_seconds_is_set(monkeypatch):
    """With ``eval_seconds`` the checks follow the clock, not a count of steps: a fake
    clock that advances 0.25 s per read (one read per step, one at each end of a stretch)
    checks after the first step that ends at or past each whole second (4 steps, then 3
    each: the end reads count too) although ``eval_every`` says 5."""
    X = torch.randn(64, 3)
    reads = iter(0.25 * k for k in range(10**6))
    monkeypatch.setattr(training, "clock_now", lambda: next(reads))
    wl = toy_workload(X=X, y=X.sum(1, keepdim=True), batch=16, eval_every=5, eval_seconds=1.0)
    r = training.train(wl, "SGD", "sgd", {"lr": 0.05}, 0)
    assert r.steps == [0, 4, 7, 10]
    assert r.times == [0.0, 1.25, 2.25, 3.25]
    assert wl.check_text() == "every 1 s of the training clock"


# -- the PINN and image workloads ----------------------------------------------------------
def pinn_run(method, seed, l2, steps=100):
    return {
        "method": method,
        "seed": seed,
        "steps": [0, steps],
        "times": [0.0, 30.0],
        "losses": [1.0, 0.1],
        "metrics": [{"loss": 1.0, "l2": 1.0}, {"loss": 0.1, "l2": l2}],
        "steps_to_target": None,
        "time_to_target": None,
        "diverged": False,
    }


def pinn_fixture(kfac_l2=(1e-4, 2e-4)):
    return {
        "kind": "pinn",
        "title": "PINN",
        "target": "10x",
        "grids": {
            "adam": [pinn_run("Adam lr=0.001", 0, 3e-3), pinn_run("Adam lr=0.003", 0, 1e-3)],
            "sgd": [pinn_run("SGD+momentum lr=0.001", 0, float("nan"))],
        },
        "runs": [
            pinn_run("Adam lr=0.003", 0, 1e-3),
            pinn_run("Adam lr=0.003", 1, 1e-3),
            pinn_run("KFAC (example defaults)", 0, kfac_l2[0], 20),
            pinn_run("KFAC (example defaults)", 1, kfac_l2[1], 20),
        ],
    }


def test_pinn_report_ratio_at_equal_time_and_verdict_per_seed():
    text = training.report({"pinn-heat": pinn_fixture()}, [0, 1])
    # 1e-3 / 1e-4 = 10x on seed 0 but 5x on seed 1: not met on each seed
    assert "= 10.0x, 5.0x" in text and "**not met**" in text
    assert "| KFAC (example defaults) | 1.00e-04 (20) | 2.00e-04 (20) |" in text
    assert "0.003: L2 1.00e-03 after 100 steps" in text  # the grid's best point
    assert "**met**" in training.report({"pinn-heat": pinn_fixture((1e-4, 1e-4))}, [0, 1])


def test_pinn_final_treats_divergence_as_infinite():
    assert training.pinn_final(pinn_run("SGD", 0, float("nan"))) == float("inf")
    best = min(pinn_fixture()["grids"]["adam"], key=training.pinn_final)
    assert best["method"] == "Adam lr=0.003"


def test_run_pinn_runs_the_example_and_compares_at_equal_time():
    torch.set_num_threads(1)
    res = training.run_pinn("pinn-heat", 0.3, [0], {"adam": (1e-3, 1e-2)}, clock="cpu", lbfgs=False)
    methods = [r["method"] for r in res["runs"]]
    assert methods[-1] == "KFAC (example defaults)" and methods[0].startswith("Adam lr=")
    assert len(res["grids"]["adam"]) == 2
    best = min(res["grids"]["adam"], key=training.pinn_final)
    assert res["runs"][0]["method"] == best["method"]
    for r in res["runs"]:  # every run stops at the budget: equal time
        assert r["times"][-1] >= 0.3 and r["steps"][-1] > 0 and 0 < r["metrics"][-1]["l2"]
    assert res["plot_target"] == training.pinn_final(best) / 10
    assert training.plot_metric(res)[0] == "l2"
    assert "target >= 10x on each seed" in training.report({"pinn-heat": res}, [0])


def image_run(method, seed, t, acc):
    r = run(method, seed, t)
    r["metrics"] = [{"loss": 1.0, "test_acc": 0.1}, {"loss": 0.2, "test_acc": acc}]
    return r


def image_fixture(kfac_time, bound=1.0):
    return {
        "title": "ResNet",
        "target": "test accuracy >= 90%",
        "compare": {"bound": bound, "accuracy": 0.9},
        "grids": {"adamw": [image_run("AdamW lr=0.001", 0, 8.0, 0.91)]},
        "runs": [
            image_run("AdamW lr=0.001", 0, 8.0, 0.91),
            image_run("SGD+momentum lr=0.1", 0, 6.0, 0.90),
            image_run("KFAC defaults", 0, kfac_time, 0.88 if kfac_time is None else 0.9),
        ],
    }


def test_image_verdict_against_the_fastest_baseline_of_every_kind():
    # SGD (6 s) is the best baseline, not AdamW (8 s): 7 / 6 > 1
    text = training.report({"resnet18": image_fixture(7.0)}, [0])
    assert "best tuned baseline's = 1.17" in text and "**not met**" in text
    assert "- KFAC defaults: seed 0: 90.0% after 7 s / 100 steps" in text
    assert "**met**" in training.report({"resnet18": image_fixture(5.0)}, [0])
    text = training.report({"resnet18": image_fixture(None)}, [0])
    assert "= inf" in text and "**not met**" in text
    text = training.report({"cnn": image_fixture(5.0, bound=None)}, [0])
    assert "sets no target" in text and "met**" not in text


def test_image_verdict_when_no_baseline_reaches_the_target():
    res = image_fixture(5.0)
    res["runs"] = [image_run("AdamW lr=0.001", 0, None, 0.85), res["runs"][2]]
    # KFAC at 5 s, the baseline not in its 5 s: below 5 / 5, an upper bound for the verdict
    text = training.report({"resnet18": res}, [0])
    assert "= < 1.00 (no baseline reached it in 5 s)" in text and "**met**" in text
    res["runs"].append(image_run("SGD+momentum lr=0.1", 1, None, 0.8))  # no seed-0 run
    assert "= < 1.00 (no baseline reached it in 5 s)" in training.report({"resnet18": res}, [0])
    res["runs"].pop()
    res["runs"][1] = image_run("KFAC defaults", 0, 4.0, 0.91)
    res["runs"][0]["times"][-1] = 2.0  # a baseline that ran only 2 s decides nothing
    assert "= < 2.00 (no baseline reached it in 2 s)" in training.report({"resnet18": res}, [0])
    res["runs"][1] = image_run("KFAC defaults", 0, None, 0.87)
    text = training.report({"resnet18": res}, [0])
    assert "= n/a" in text and "**not met** (neither KFAC nor" in text


def tiny_images(n=96):
    g = torch.Generator().manual_seed(0)
    X, Xte = torch.rand(n, 784, generator=g), torch.rand(64, 784, generator=g)
    return X, torch.randint(0, 10, (n,), generator=g), Xte, torch.randint(0, 10, (64,))


def test_image_workloads_train_cnn_and_resnet18_with_batchnorm():
    import warnings

    torch.set_num_threads(1)
    for wl in (
        training.small_cnn(1e-9, data=tiny_images()),
        training.resnet18_fmnist(1e-9, data=tiny_images(), width=4),
    ):
        wl.eval_every, wl.batch = 3, 16  # a budget of 1e-9 s: every run stops at step 3
        assert wl.X.shape == (96, 1, 28, 28) and wl.compare["accuracy"] == 0.9
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # KFAC's BatchNorm note
            res = training.run_workload(wl, [0], {k: v[:1] for k, v in wl.grids.items()})
        names = [r["method"] for r in res["runs"]]
        assert names[-2:] == ["KFAC defaults", "KFAC safe start, kl_clip=1e-3"]
        assert {n.split(" lr=")[0] for n in names[:-2]} == (
            {"AdamW", "SGD+momentum"} if wl.name == "resnet18" else {"Adam", "SGD+momentum"}
        )
        for r in res["runs"]:
            assert r["steps"][-1] == 3 and 0 <= r["metrics"][-1]["test_acc"] <= 1
        res["compare"] = wl.compare
        assert "Test accuracy at the end of the run" in training.report({wl.name: res}, [0])
    assert any(isinstance(m, nn.BatchNorm2d) for m in wl.make_model().modules())


def test_cpu_clock_option_and_the_train_loop_uses_it(monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setattr(training, "clock_now", lambda: float(next(ticks)))
    wl = toy_workload()
    r = training.train(wl, "SGD", "sgd", {"lr": 0.01}, 0)
    # each block of 2 steps reads the fake clock twice: 1 "second" per block, 3 blocks
    assert r.times == [0.0, 1.0, 2.0, 3.0] and r.steps == [0, 2, 4, 6]
    assert training.CLOCKS["cpu"] is time.process_time


def test_plot_metric_per_workload_kind():
    assert training.plot_metric(image_fixture(5.0))[:2] == ("test_acc", 0.9)
    assert training.plot_metric({"target_loss": 0.3})[:2] == ("loss", 0.3)
    res = pinn_fixture()
    res["plot_target"] = 1e-4
    assert training.plot_metric(res)[:2] == ("l2", 1e-4)


def test_plot_writes_the_figure_where_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    res = {"fmnist-mlp": fixture()["fmnist-mlp"], "pinn-heat": pinn_fixture()}
    res["resnet18"] = image_fixture(5.0)
    res["pinn-heat"]["plot_target"] = 1e-4
    path = tmp_path / "training.png"
    assert training.plot(res, str(path)) and path.stat().st_size > 0


def test_merge_results_joins_a_workload_split_over_processes():
    a, b = image_fixture(5.0), image_fixture(5.0)
    a["runs"], b["grids"] = a["runs"][:2], {"sgd": [image_run("SGD+momentum lr=0.1", 0, 6, 0.9)]}
    b["runs"] = b["runs"][2:]
    other = {"fmnist-mlp": fixture()["fmnist-mlp"]}
    merged = training.merge_results(
        [{"results": {"resnet18": a}}, {"results": {"resnet18": b, **other}}]
    )
    assert list(merged) == ["resnet18", "fmnist-mlp"]
    assert set(merged["resnet18"]["grids"]) == {"adamw", "sgd"}
    names = [r["method"] for r in merged["resnet18"]["runs"]]
    assert names == ["AdamW lr=0.001", "SGD+momentum lr=0.1", "KFAC defaults"]
    assert len(a["runs"]) == 2  # the inputs are left alone


def test_merge_results_of_one_grid_split_keeps_the_best_point_over_all_parts():
    a, b = pinn_fixture(), pinn_fixture()
    # part a: Adam 1e-3 (3e-3 L2) and 3e-3 (1e-3), SGD, KFAC; part b: Adam 1e-2 (5e-4) only
    b["grids"] = {"adam": [pinn_run("Adam lr=0.01", 0, 5e-4)]}
    b["runs"] = [pinn_run("Adam lr=0.01", 0, 5e-4)]
    merged = training.merge_results([{"results": {"p": a}}, {"results": {"p": b}}])["p"]
    assert [t["method"] for t in merged["grids"]["adam"]] == [
        "Adam lr=0.001",
        "Adam lr=0.003",
        "Adam lr=0.01",
    ]
    names = [r["method"] for r in merged["runs"]]
    assert names == ["Adam lr=0.01", "KFAC (example defaults)", "KFAC (example defaults)"]
    # the ratio uses the best Adam of all parts: 5e-4 / 1e-4 = 5x
    assert "= 5.0x" in training.report({"p": merged}, [0])


def test_merge_results_of_another_seed_makes_rows_not_grid_points():
    """A part run on seed 1 only (its "grid" is the tuned point rerun there) adds seed-1
    rows; the verdict then covers both seeds."""
    a, b = pinn_fixture(), pinn_fixture()
    b["grids"] = {"adam": [pinn_run("Adam lr=0.003", 1, 2e-4)]}
    b["runs"] = [pinn_run("KFAC (example defaults)", 1, 1e-4)]
    runs = [{"seeds": [0], "results": {"p": a}}, {"seeds": [1], "results": {"p": b}}]
    merged = training.merge_results(runs)["p"]
    assert [t["method"] for t in merged["grids"]["adam"]] == ["Adam lr=0.001", "Adam lr=0.003"]
    assert training.workload_seeds(runs, "p") == [0, 1]
    text = training.report({"p": merged}, [0, 1])
    assert "= 10.0x, 2.0x (seeds 0, 1)" in text and "**not met**" in text  # seed 0 alone: met


def test_split_grids_by_kind_and_learning_rate():
    grids = {"adam": training.ADAM_GRID, "sgd": training.PINN_SGD_GRID}
    assert training.split_grids(grids, None, None) == grids
    assert training.split_grids(grids, ["sgd"], None) == {"sgd": training.PINN_SGD_GRID}
    assert training.split_grids(grids, ["adam"], [3e-4, 1e-2]) == {"adam": [3e-4, 1e-2]}


def test_equal_time_accuracy_reads_each_curve_at_the_shortest_end():
    res = image_fixture(None)
    kfac = res["runs"][2]
    kfac.update(times=[0.0, 4.0, 9.0], steps=[0, 10, 20])
    kfac["metrics"] = [{"loss": 1.0, "test_acc": 0.1}, {"loss": 0.5, "test_acc": 0.8}]
    kfac["metrics"].append({"loss": 0.3, "test_acc": 0.88})
    base = image_run("SGD+momentum lr=0.1", 0, None, 0.85)  # ends at 5 s
    res["runs"] = [base, kfac]
    text = training.report({"resnet18": res}, [0])
    line = "- at equal time, seed 0 (last check at or before 5 s): SGD+momentum lr=0.1 85.0%"
    assert line + " (5 s, 100 steps); KFAC defaults 80.0% (4 s, 10 steps)" in text


def test_equal_time_accuracy_leaves_out_a_diverged_run():
    # a run that diverged at 1 s does not set the equal time (it would compare at 1 s)
    res = image_fixture(None)
    base = image_run("SGD+momentum lr=0.1", 0, None, 0.85)  # ends at 5 s
    other = image_run("AdamW lr=0.001", 0, None, 0.86)
    other.update(times=[0.0, 4.0, 9.0], steps=[0, 10, 20])
    other["metrics"] = [{"loss": 1.0, "test_acc": 0.1}, {"loss": 0.5, "test_acc": 0.8}]
    other["metrics"].append({"loss": 0.3, "test_acc": 0.88})
    other["losses"] = [1.0, 0.5, 0.3]
    bad = image_run("KFAC defaults", 0, None, 0.1)
    bad.update(times=[0.0, 1.0], diverged=True)
    res["runs"] = [base, other, bad]
    text = training.report({"resnet18": res}, [0])
    line = "- at equal time, seed 0 (last check at or before 5 s): SGD+momentum lr=0.1 85.0%"
    assert line + " (5 s, 100 steps); AdamW lr=0.001 80.0% (4 s, 10 steps); " in text
    assert "KFAC defaults diverged (1 s, 100 steps)" in text


def test_time_based_checks_after_the_first_step_past_each_multiple(monkeypatch):
    clock = [0.0]

    class Slow(nn.Linear):
        def forward(self, x):  # a training step "costs" 0.7 s of the fake clock
            if self.training:
                clock[0] += 0.7
            return super().forward(x)

    monkeypatch.setattr(training, "clock_now", lambda: clock[0])
    wl = toy_workload(make_model=lambda: Slow(3, 1), budget=5.0, eval_every=1000, eval_seconds=2.0)
    r = training.train(wl, "SGD", "sgd", {"lr": 0.01}, 0)
    # steps end at 0.7, 1.4, 2.1 (check), 2.8, 3.5, 4.2 (check), 4.9, 5.6 (budget: check)
    assert r.steps == [0, 3, 6, 8]
    assert r.times == pytest.approx([0.0, 2.1, 4.2, 5.6])
    # a budget of its own (the autoencoder's KFAC rows)
    clock[0] = 0.0
    assert training.train(wl, "SGD", "sgd", {"lr": 0.01}, 0, budget=2.0).steps == [0, 3]


def ae_run(method, times, losses, seed=0):
    return {
        "method": method,
        "seed": seed,
        "steps": [10 * i for i in range(len(times))],
        "times": list(times),
        "losses": list(losses),
        "metrics": [{"loss": x} for x in losses],
        "steps_to_target": None,
        "time_to_target": None,
        "diverged": False,
    }


def ae_part(adam, kfac, seed=0):
    """One saved part of a split autoencoder run: Adam grid points (the last as a row) or
    KFAC rows, on ``seed``."""
    res = {
        "title": "AE",
        "target": "later",
        "grids": {"adam": adam} if adam else {},
        "runs": adam[-1:] + kfac,
        "target_loss": None,
        "budget": 600.0,
        "target_later": True,
    }
    return {"seeds": [seed], "results": {"autoencoder": res}}


def test_autoencoder_split_sets_the_target_from_the_best_adam_of_all_parts():
    part = ae_part
    a = [ae_run("Adam lr=0.001", [0, 300, 600], [0.5, 0.31, 0.29])]
    b = [ae_run("Adam lr=0.003", [0, 300, 600], [0.5, 0.30, 0.32])]
    k = [ae_run("KFAC adaptive", [0, 100, 150, 300], [0.5, 0.3, 0.289, 0.28])]
    merged = training.merge_results([part(a, []), part(b, []), part([], k)])["autoencoder"]
    assert merged["target_loss"] == 0.29  # lr 1e-3's loss at 600 s, not lr 3e-3's 0.30
    assert "training loss <= 0.29000 (best tuned Adam at 600 s)" == merged["target"]
    names = [r["method"] for r in merged["runs"]]
    assert names == ["Adam lr=0.001", "KFAC adaptive"]
    assert merged["runs"][1]["time_to_target"] == 150
    assert "= 0.25 (seeds 0); target <= 0.33 on each seed: **met**" in training.report(
        {"autoencoder": merged}, [0]
    )


def test_autoencoder_targets_per_seed_from_the_tuned_adam_rerun_on_that_seed():
    part = ae_part
    a0 = [ae_run("Adam lr=0.001", [0, 300, 600], [0.5, 0.31, 0.29])]
    b0 = [ae_run("Adam lr=0.003", [0, 300, 600], [0.5, 0.30, 0.32])]
    a1 = [ae_run("Adam lr=0.001", [0, 300, 600], [0.5, 0.31, 0.295], seed=1)]
    k0 = [ae_run("KFAC adaptive", [0, 100, 150, 300], [0.5, 0.3, 0.289, 0.28])]
    # seed 1: 0.292 at 100 s is below seed 1's own target (0.295) but not seed 0's (0.29)
    k1 = [ae_run("KFAC adaptive", [0, 100, 250, 300], [0.5, 0.292, 0.289, 0.28], seed=1)]
    parts = [part(a0, [], 0), part(b0, [], 0), part([], k0, 0), part(a1, [], 1), part([], k1, 1)]
    merged = training.merge_results(parts)["autoencoder"]
    assert merged["target"] == (
        "training loss <= 0.29000 (best tuned Adam at 600 s); "
        "seed 1: <= 0.29500 (the same Adam on seed 1 at 600 s)"
    )
    by = training.by_method(merged["runs"])
    assert by["KFAC adaptive"][0]["time_to_target"] == 150  # seed 0's target
    assert by["KFAC adaptive"][1]["time_to_target"] == 100  # seed 1's own
    assert by["Adam lr=0.001"][1]["time_to_target"] == 600
    text = training.report({"autoencoder": merged}, [0, 1])
    assert "= 0.25, 0.17 (seeds 0, 1); target <= 0.33 on each seed: **met**" in text


def test_autoencoder_split_options():
    import argparse

    wl = training.Workload(
        name="autoencoder",
        title="AE",
        make_model=lambda: nn.Linear(3, 3),
        X=torch.zeros(1, 3),
        y=torch.zeros(1, 3),
        loss_func=nn.MSELoss(),
        batch=1,
        budget=600.0,
        eval_every=20,
        evaluate=lambda m: {"loss": 1.0},
        reached=lambda m: False,
        target_text="later",
        kfac_rows={"KFAC": {}},
    )
    grids = {"adam": training.ADAM_GRID}
    ns = argparse.Namespace(only="adam", lrs="1e-3", ae_kfac_budget=None)
    assert training.autoencoder_split(wl, grids, ns) == {"adam": [1e-3]}
    assert wl.target_later and wl.kfac_rows == {}
    wl.kfac_rows = {"KFAC": {}}
    ns = argparse.Namespace(only=None, lrs=None, ae_kfac_budget=300.0)
    assert training.autoencoder_split(wl, grids, ns) == grids
    assert not wl.target_later and wl.kfac_budget == 300.0 and wl.kfac_rows


def test_kfac_row_names_its_options_and_refuses_what_is_not_a_json_object():
    name, options = training.kfac_row('{"factor_every": 10, "momentum": 0.5}')
    assert options == {"factor_every": 10, "momentum": 0.5}
    assert name == "KFAC factor_every=10, momentum=0.5 (tried by hand)"
    for bad in ("factor_every=10", "[1, 2]", "{}"):
        with pytest.raises(SystemExit, match="--kfac-row"):
            training.kfac_row(bad)


def test_a_kfac_row_takes_the_workloads_loss_by_true():
    ce = torch.nn.CrossEntropyLoss()
    name, options = training.kfac_row('{"fisher": "mc", "loss_func": true}', ce)
    assert options == {"fisher": "mc", "loss_func": ce} and "loss_func=True" in name
    with pytest.raises(SystemExit, match="needs a workload"):
        training.kfac_row('{"loss_func": true}')


def test_a_kfac_row_names_its_statistics_dtype_as_a_string():
    """``{"statistics_dtype": "bfloat16"}`` (JSON has no dtypes) reaches KFAC as the dtype;
    the row's options stay JSON (the results are saved); a name that is no dtype fails."""
    from torch import nn

    _, options = training.kfac_row('{"statistics_dtype": "torch.bfloat16"}')
    assert options == {"statistics_dtype": "torch.bfloat16"}
    opt = training.make_optimizer("kfac", nn.Linear(3, 2), options)
    assert opt.statistics_dtype == torch.bfloat16
    with pytest.raises(SystemExit, match="not a torch dtype"):
        training.make_optimizer("kfac", nn.Linear(3, 2), {"statistics_dtype": "Tensor"})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--device", "tpu"], "cpu or cuda"),
        (["--device", "cuda", "--clock", "cpu"], "CUDA is not available|--clock wall"),
        (["--device", "cuda", "--workloads", "pinn-poisson"], "CUDA is not available|PINN"),
    ],
)
def test_device_option_refuses_what_it_cannot_run(argv, message, capsys):
    with pytest.raises(SystemExit):
        training.main(argv)
    import re

    assert re.search(message, capsys.readouterr().err)


def test_image_workload_data_and_models_on_the_chosen_device(monkeypatch):
    """``--device``: the workload's tensors move there when it is built, each model when it
    is made (here the CPU, or CUDA where there is one, with the synchronizing clock)."""
    import warnings

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setattr(training, "DEVICE", device)
    if device.type == "cuda":
        monkeypatch.setattr(training, "clock_now", training._synchronized_clock)
    wl = training.resnet18_fmnist(1e-9, data=tiny_images(), width=4)
    assert wl.X.device.type == device.type and wl.y.device.type == device.type
    wl.eval_every, wl.batch = 3, 16
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = training.train(wl, "KFAC defaults", "kfac", {}, 0)
    assert r.steps[-1] == 3 and 0 <= r.metrics[-1]["test_acc"] <= 1
