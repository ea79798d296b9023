"""Every Python snippet in the README and docs/ runs (blocks of a page share a namespace)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(path: pathlib.Path) -> list:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_doc_snippets_run(page):
    namespace: dict = {"__name__": f"doc_{page.stem}"}
    for i, block in enumerate(python_blocks(page)):
        code = compile(block, f"{page.name}[block {i}]", "exec")
        exec(code, namespace)
