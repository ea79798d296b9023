"""benchmarks/op_time.py: the aten calls of a KFAC step, timed (and ASDL's where installed)."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import op_time  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_seeded")


def test_lists_our_steps_calls(capsys):
    op_time.main(["--steps", "2", "--period", "1", "--top", "3"])
    out = capsys.readouterr().out
    assert "ours: total" in out and "GEMMs" in out
    lines = out.split("ours: total")[1].splitlines()[1:4]
    assert len(lines) == 3 and all("aten." in line for line in lines)  # the top 3 calls


def test_counts_a_step_of_known_calls():
    # the mode sees every aten call once: a step of two mm calls
    import torch

    mode = op_time.OpTimes()
    a = torch.ones(3, 3)
    with mode:
        torch.mm(torch.mm(a, a), a)
    assert mode.count["aten.mm.default"] == 2 and mode.time["aten.mm.default"] > 0
