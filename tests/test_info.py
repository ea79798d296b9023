"""`python -m curvature.info`: versions, machine, optional packages."""

import json
import subprocess
import sys

import torch

import curvature
from curvature import info


def test_collect():
    d = info.collect()
    assert d["curvature"] == curvature.__version__
    assert d["torch"] == torch.__version__ and d["cuda_available"] == torch.cuda.is_available()
    assert d["python"].count(".") == 2 and d["cpu_count"] >= 1 and d["numpy"]
    assert set(d["optional"]) == set(info.OPTIONAL)
    for dist in (
        "backpack-for-pytorch",
        "curvlinops-for-pytorch",
        "opacus",
        "asdfghjkl",
        "nngeometry",
        "torchjd",
        "matplotlib",
        "tqdm",
        "scikit-learn",
        "mkdocs",
    ):
        assert dist in d["optional"]
    assert json.loads(json.dumps(d)) == d  # JSON-serializable as it is


def test_version_of():
    assert info.version_of("torch") == torch.__version__.split("+")[0] or info.version_of(
        "torch"
    ).startswith(torch.__version__.split("+")[0])
    assert info.version_of("surely-not-an-installed-distribution-xyz") is None


def test_main_text_and_json(capsys):
    info.main([])
    text = capsys.readouterr().out
    assert text.startswith("curvature ") and "optional packages:" in text
    for dist in info.OPTIONAL:
        assert dist in text
    info.main(["--json"])
    assert json.loads(capsys.readouterr().out)["curvature"] == curvature.__version__


def test_module_entry_point_imports_no_peer():
    """Versions come from metadata: running the module imports none of the peers."""
    code = (
        "import sys, runpy, torch, curvature; before = set(sys.modules); "
        "runpy.run_module('curvature.info', run_name='__main__'); "
        "heavy = {'backpack', 'curvlinops', 'opacus', 'asdfghjkl', 'nngeometry', 'torchjd', "
        "'matplotlib', 'sklearn', 'tqdm', 'mkdocs'}; "
        "print('IMPORTED', sorted(heavy & {m.split('.')[0] for m in set(sys.modules) - before}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert "optional packages:" in out and "IMPORTED []" in out
