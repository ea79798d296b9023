"""The README's demo runs (one epoch) and prints its table."""

import pytest


def test_demo_runs(capsys):
    pytest.importorskip("sklearn")
    from curvature import demo

    demo.main(["--epochs", "1"])
    out = capsys.readouterr().out
    assert "| KFAC (MC Fisher, lr 1e-2) |" in out and "equals x: True" in out
