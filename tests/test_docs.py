"""Every Python snippet in the README and docs/ runs (blocks of a page share a namespace),
and the documentation site builds without a warning."""

import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PEERS = ("backpack", "curvlinops", "opacus", "kfac", "asdl", "asdfghjkl", "nngeometry")


def python_blocks(path: pathlib.Path) -> list:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def page_id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def required(block: str) -> list:
    """The packages a block needs: its first line ``# requires: lightning transformers``."""
    first = re.match(r"#\s*requires:(.*)\n", block)
    return first.group(1).split() if first else []


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # absent, or installed for another torch
        return False
    return True


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=page_id)
def test_doc_snippets_run(page):
    """A block whose first line is ``# requires: pkg ...`` is skipped when one of them does
    not import (the page's other blocks still run; the test then reports a skip)."""
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    skipped = []
    for i, block in enumerate(python_blocks(page)):
        missing = [m for m in required(block) if not importable(m)]
        if missing:
            skipped.append(f"block {i} needs {', '.join(missing)}")
            continue
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)
    if skipped:
        pytest.skip(f"{page.name}: the other blocks ran; skipped: {'; '.join(skipped)}")


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=page_id)
def test_doc_snippets_need_no_peer_library(page):
    """Peers are optional: their code is shown as text, never in an executed block."""
    pattern = re.compile(rf"^\s*(?:import|from)\s+({'|'.join(PEERS)})\b", flags=re.M)
    for block in python_blocks(page):
        assert not pattern.search(block), f"{page.name} imports a peer library in a python block"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_python_code_is_fenced_as_python(page):
    """Only ```python blocks are executed above: other Python fences would escape the test."""
    fences = re.findall(r"^```(py|pycon|python3|ipython|py3)\s*$", page.read_text(), flags=re.M)
    assert not fences, f"{page.name}: use ```python (executed) or ```text, not ```{fences[0]}"


def _missing(*modules: str) -> list:
    return [m for m in modules if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(
    bool(_missing("mkdocs", "mkdocstrings", "mkdocstrings_handlers")),
    reason="the docs build needs mkdocs and mkdocstrings[python] "
    "(pip install -e '.[test]' or '.[docs]')",
)
def test_docs_build_strict(tmp_path):
    """`mkdocs build --strict`: nav, links, anchors and the API reference's docstrings."""
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "WARNING" not in log, log
    api = (tmp_path / "api" / "optim" / "index.html").read_text()
    # doctest examples render as code, not as nested block quotes of run-on prose
    assert '<code class="language-python">&gt;&gt;&gt; optim = curvature.KFAC(' in api
    for page in (tmp_path / "api").rglob("*.html"):
        assert "<blockquote>" not in page.read_text(), page
    # wide tables: the stylesheet that wraps cells and scrolls what is still too wide
    assert (tmp_path / "css" / "extra.css").exists() and "css/extra.css" in api


def test_required_packages_of_a_block():
    assert required("# requires: lightning transformers\nimport lightning\n") == [
        "lightning",
        "transformers",
    ]
    assert required("import torch\n# requires: lightning\n") == []
    assert not importable("curvature_no_such_module")
