"""benchmarks/run_all.py: the summary table from fixture results (nothing is timed here)."""

import json
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import run_all  # noqa: E402


def entry(ratio, mem=None, mismatch=False, disturbed=False):
    e = {"ratio": ratio, "disturbed": disturbed, "mismatch": mismatch, "time": 0.01}
    if mem is not None:
        e.update(mem_ratio=mem, peak_bytes=mem * 2**20)
    return e


def per_sample_fixture():
    mlp = {
        "title": "MLP 784-512-256-10, N=128",
        "plain": {"peak_bytes": 2**20, "time": 0.003},
        "skipped": {},
        "methods": {
            "curvature": {
                "grads": entry(7.9),
                "norms": entry(0.8, mem=0.7),
                "gram": entry(1.1),
            },
            "curvature out=": {"grads": entry(4.5)},
            "torch.func": {"grads": entry(33.0), "norms": entry(28.0, mem=77.0)},
            "opacus EW": {"grads": entry(27.0)},
            "opacus ghost": {"norms": entry(1.4, mem=1.0, disturbed=True)},
            "BackPACK": {"grads": entry(2.0, mismatch=True)},
        },
    }
    tf = {
        "title": "transformer block d=128, S=64, N=16",
        "plain": {"peak_bytes": 2**20, "time": 0.02},
        "skipped": {"BackPACK/grads": "RuntimeError: no extension"},
        "methods": {
            "curvature": {"grads": entry(1.42), "norms": entry(1.15, mem=2.0)},
            "opacus EW": {"grads": entry(1.23)},
        },
    }
    return {
        "command": "python benchmarks/per_sample.py",
        "workloads": {"mlp": mlp, "transformer": tf},
    }


def laplacian_fixture():
    res = {
        "Laplacian": {"forward": entry(3.6), "autograd": entry(11.0), "hutchinson": entry(9.0)},
        "Laplacian + parameter gradient": {"forward": entry(15.0), "autograd": entry(30.0)},
    }
    return {
        "workload": "MLP 16-64-64-1 tanh",
        "results": res,
        "targets": [
            {"target": "forward Laplacian <= 4x fwd+bwd", "met": True, "detail": "3.60x"},
            {"target": "autograd Laplacian <= 10x fwd+bwd", "met": False, "detail": "11.00x"},
        ],
    }


def pinn_fixture():
    hk = {"step": [0, 5, 10], "time": [0.0, 1.0, 2.0], "l2": [1.0, 0.1, 0.02]}
    ha = {"step": [0, 50, 100], "time": [0.0, 1.5, 3.0], "l2": [1.0, 0.5, 0.2]}
    return {"problems": {"poisson": run_all.pinn_compare(hk, ha)}}


def optim_fixture():
    return {
        "MLP 784-512-256-10, N=128": {
            "SGD": entry(1.1),
            "Adam": entry(1.9),
            "KFAC empirical": entry(7.9),
        }
    }


def distributed_fixture():
    return {
        "one_process_two_threads": {"mlp/kfac-empirical": {"median": 0.02, "mean": 0.03}},
        "two_processes_one_thread": {"mlp/kfac-empirical": {"median": 0.015, "mean": 0.02}},
    }


def benchmarks():
    results = {
        "per_sample": per_sample_fixture(),
        "optim_step": optim_fixture(),
        "pinn": pinn_fixture(),
        "laplacian": laplacian_fixture(),
        "distributed": distributed_fixture(),
    }
    return {
        k: {"command": f"python {k}", "date": "today", "elapsed_s": 1, "result": v}
        for k, v in results.items()
    }


def test_pinn_compare_uses_the_best_error_both_reach():
    r = pinn_fixture()["problems"]["poisson"]
    assert r["level"] == 0.2  # Adam's best; KFAC reaches it at t = 1.0, Adam at 3.0
    assert r["kfac_time"] == 1.0 and r["adam_time"] == 3.0 and r["met"] is True
    hk = {"step": [0, 1], "time": [0.0, 5.0], "l2": [1.0, 0.3]}
    ha = {"step": [0, 1], "time": [0.0, 1.0], "l2": [1.0, 0.1]}
    r = run_all.pinn_compare(hk, ha)
    assert r["level"] == 0.3 and r["met"] is False


def test_summary_rows_every_workload_and_target():
    rows, notes = run_all.summary_rows(benchmarks())
    assert notes == []
    workloads = {r["workload"] for r in rows}
    for w in ("MLP 784-512-256-10, N=128", "transformer block d=128, S=64, N=16",
              "MLP 16-64-64-1 tanh", "PINN poisson, 2-64-1 tanh, float64",
              "distributed: 2 processes x 1 thread (gloo) vs 1 process x 2 threads"):  # fmt: skip
        assert w in workloads
    targets = {(r["workload"], r["target"]): r for r in rows if r["target"]}
    grads = targets[("MLP 784-512-256-10, N=128", "< 1x the fastest peer")]
    # BackPACK's mismatching result is no candidate: the fastest agreeing peer is opacus EW
    assert grads["met"] is True and "opacus EW" in grads["detail"]
    assert "mismatch: BackPACK" in grads["peers"]
    assert grads["peers"].index("opacus EW") < grads["peers"].index("torch.func")
    tf = targets[("transformer block d=128, S=64, N=16", "< 1x the fastest peer")]
    assert tf["met"] is False and "no result: BackPACK" in tf["peers"]
    assert targets[("MLP 784-512-256-10, N=128", "<= 1.3x fwd+bwd")]["met"] is True
    assert targets[("MLP 784-512-256-10, N=128", "<= 1.2x")]["met"] is True
    # norms targets are for the MLP and the CNN only
    assert ("transformer block d=128, S=64, N=16", "<= 1.3x fwd+bwd") not in targets
    lap = [r for r in rows if r["workload"] == "MLP 16-64-64-1 tanh" and r["target"]]
    assert [r["met"] for r in lap] == [True, False]
    pinn = [r for r in rows if r["workload"].startswith("PINN")]
    # the short run cannot test issue 19's 300 s target: stated, not judged
    assert pinn[0]["met"] is None and "KFAC 1.0 s" in pinn[0]["curvature"]
    assert pinn[0]["target"] == run_all.PINN_TARGET and "300 s" in pinn[0]["target"]


def test_summary_table_marks_targets():
    rows, _ = run_all.summary_rows(benchmarks())
    table = run_all.summary_table(rows)
    lines = table.splitlines()
    assert lines[0].startswith("| workload | quantity | curvature | peers")
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    assert "**not met**" in table and "| met (" in table
    assert "ASDL KFAC 6.9x (reference, not re-measured)" in table
    assert "opacus ghost 1.40x †" in table  # disturbed ratios are marked


def test_summary_shows_measured_asdl_rows_and_the_goal():
    res = optim_fixture()
    mlp = res["MLP 784-512-256-10, N=128"]
    mlp["ASDL KFAC empirical"] = entry(8.5)
    mlp["ASDL KFAC mc-1"] = entry(9.0, disturbed=True)
    res["token MLP 128-256-128, [32, 64, 128]"] = {
        "KFAC empirical": entry(2.5),
        "ASDL KFAC empirical": entry(2.0),
    }
    rows = run_all.rows_optim_step(res)
    table = run_all.summary_table(rows)
    assert "reference, not re-measured" not in table
    assert "ASDL KFAC empirical 8.50x, ASDL KFAC mc-1 9.00x †" in rows[0]["peers"]
    assert "ASDL" not in rows[0]["curvature"] and "KFAC empirical 7.90x" in rows[0]["curvature"]
    assert rows[0]["met"] is True and rows[0]["detail"] == "0.93x ASDL's"
    assert "| met (0.93x ASDL's) |" in table
    # the goal is issue 17's, for the MLP: no status on the token MLP, though slower there
    assert rows[1]["target"] == "" and rows[1]["met"] is None
    mlp["ASDL KFAC empirical"] = entry(7.0)
    assert run_all.rows_optim_step(res)[0]["met"] is False


def info():
    return {
        "cpu": "CPU",
        "cpu_count": 2,
        "platform": "Linux",
        "python": "3.11",
        "torch": "2.13",
        "torch_threads": 2,
        "numpy": "2",
        "curvature": "0.1.0",
        "cuda_available": False,
        "cuda_devices": [],
        "optional": {"opacus": "1.6.0", "torchjd": None},
    }


def test_summary_body_and_doc_section(tmp_path):
    data = {
        "command": "python benchmarks/run_all.py",
        "date": "today",
        "elapsed_s": 3,
        "full": False,
        "info": info(),
        "benchmarks": benchmarks(),
    }
    del data["benchmarks"]["distributed"]
    body = run_all.summary_body(data)
    assert "Peers installed: opacus 1.6.0; not installed: torchjd." in body
    assert "Targets of the earlier issues: 4 of 6 met." in body
    assert "- distributed: not run" in body and "Quick runs" in body
    assert "Not met:" in body and "- transformer block d=128, S=64, N=16: < 1x" in body
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nIntro.\n\n## Per-sample quantities\n\nold table\n")
    run_all.write_summary(str(doc), body)
    run_all.write_summary(str(doc), body)  # idempotent: replaced in place
    text = doc.read_text()
    assert text.count("## Summary") == 1 and "old table" in text
    assert text.index("Intro.") < text.index("## Summary") < text.index("## Per-sample")


def test_main_with_given_results(tmp_path, monkeypatch, capsys):
    """--from-json for some, a missing script skipped, nothing timed."""
    paths = {}
    for name, e in benchmarks().items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(e["result"]))
    monkeypatch.setattr(run_all, "command_for", lambda *a, **k: None)
    out_json, doc = tmp_path / "all.json", tmp_path / "b.md"
    given = [f"{n}={paths[n]}" for n in ("per_sample", "pinn", "laplacian")]
    data = run_all.main(
        ["--only", "distributed", "--from-json", *given, "--json", str(out_json)]
        + ["--doc", str(doc)]
    )
    assert data["benchmarks"]["distributed"]["skipped"]
    assert "optim_step" not in data["benchmarks"]
    saved = json.loads(out_json.read_text())
    assert saved["info"]["curvature"] and saved["summary"]["rows"]
    text = doc.read_text()
    assert "## Summary" in text and "- distributed: skipped" in text
    assert "- optim_step: not run" in text
    # --reuse takes what the last JSON holds
    data = run_all.main(["--only", "distributed", "--reuse", "--json", str(out_json), "--no-doc"])
    assert data["benchmarks"]["pinn"]["reused"] is True
    # --summarize runs nothing and keeps the run's own command
    before = json.loads(out_json.read_text())
    data = run_all.main(["--summarize", "--json", str(out_json), "--doc", str(doc)])
    assert data["command"] == before["command"] and data["date"] == before["date"]


def test_unknown_format_is_reported_not_fatal():
    b = {"laplacian": {"command": "x", "result": {"unexpected": 1}}}
    rows, notes = run_all.summary_rows(b)
    assert rows == [] and any("could not be summarized" in n for n in notes)


def test_command_lines(tmp_path):
    j = str(tmp_path / "x.json")
    quick = run_all.command_for("per_sample", False, j, True)
    assert "--quick" in quick and "--json" in quick
    assert "--quick" not in run_all.command_for("per_sample", True, j, True)
    assert "--no-doc" in run_all.command_for("optim_step", False, j, True)
    assert "--no-doc" not in run_all.command_for("optim_step", True, j, True)
    assert run_all.command_for("pinn", False, j, True)[2:4] == ["--worker", "pinn"]
    with pytest.raises(ValueError):
        run_all.command_for("nope", False, j, True)


def test_per_sample_children_get_the_parent_options():
    import per_sample

    argv = ["--quick", "--workloads", "mlp,cnn", "--json=x.json", "--doc", "d.md", "--no-doc"]
    argv += ["--repeats", "3", "--keep-freed-memory"]
    assert per_sample.child_argv(argv, "cnn", "c.json") == [
        "--workloads",
        "cnn",
        "--quick",
        "--repeats",
        "3",
        "--keep-freed-memory",
        "--child",
        "--no-doc",
        "--json",
        "c.json",
    ]


def test_per_sample_runs_each_workload_in_a_child_process(tmp_path):
    import per_sample

    out = tmp_path / "r.json"
    argv = ["--quick", "--workloads", "mlp,cnn", "--methods", "curvature", "--json", str(out)]
    res = per_sample.main(argv)
    assert set(res["workloads"]) == {"mlp", "cnn"}
    assert json.loads(out.read_text())["workloads"].keys() == {"mlp", "cnn"}
    processes = {wl["process"] for wl in res["workloads"].values()}
    assert len(processes) == 2 and os.getpid() not in processes  # a fresh one each
    for wl in res["workloads"].values():
        assert wl["methods"]["curvature"]["grads"]["ratio"] > 0


def test_per_sample_reports_the_transformer_without_page_faults():
    import argparse

    import per_sample

    wl = {
        "methods": {
            "curvature": {"grads": {"ratio": 1.0, "mismatch": False}},
            "opacus EW": {"grads": {"ratio": 1.1, "mismatch": False}},
        },
        "head_to_head": {"grads": {"opacus EW": {"ratio": 0.97, "disturbed": False}}},
    }
    (line,) = per_sample.fault_free_lines({"without_page_faults": {"transformer": wl}})
    assert "keep-freed-memory" in line and "curvature / opacus EW = 0.97 (head to head)" in line
    assert per_sample.fault_free_lines({}) == []
    full = argparse.Namespace(quick=False, child=False, in_process=False, keep_freed_memory=False)
    methods = list(per_sample.METHODS)
    assert per_sample.wants_fault_free_check(full, ["mlp", "transformer"], methods)
    assert not per_sample.wants_fault_free_check(full, ["mlp"], methods)
    assert not per_sample.wants_fault_free_check(full, ["transformer"], ["curvature"])
    quick = argparse.Namespace(**{**vars(full), "quick": True})
    assert not per_sample.wants_fault_free_check(quick, ["transformer"], methods)
