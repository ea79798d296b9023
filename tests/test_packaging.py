"""Packaging: one version (semantic), py.typed shipped, a wheel that builds, a changelog."""

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

import curvature

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEMVER = r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?"


def test_version_is_semantic_and_single_sourced():
    assert re.fullmatch(SEMVER, curvature.__version__)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', pyproject, re.M)
    assert re.search(r'^version = \{ ?attr = "curvature.__version__" ?\}', pyproject, re.M)
    assert not re.search(r'^version = "', pyproject, re.M)


def test_installed_metadata_matches(tmp_path):
    """Where this checkout is installed (pip install -e .), its metadata has the version."""
    from importlib import metadata

    try:
        dist = metadata.distribution("torch-curvature")
    except metadata.PackageNotFoundError:
        pytest.skip("torch-curvature is not installed (running from a checkout)")
    direct = dist.read_text("direct_url.json") or ""
    where = str(getattr(dist, "_path", ""))  # an egg-info folder in the checkout: setup.py develop
    if ROOT.as_uri() not in direct and not where.startswith(str(ROOT)):
        pytest.skip(f"the installed torch-curvature is another copy ({direct or where})")
    assert dist.version == curvature.__version__, "reinstall: pip install -e ."


def test_py_typed_and_changelog():
    assert (ROOT / "curvature" / "py.typed").exists()
    assert re.search(
        r'^curvature = \[.*"py.typed".*\]', (ROOT / "pyproject.toml").read_text(), re.M
    )
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "semantic versioning" in changelog
    assert re.search(rf"^## .*({re.escape(curvature.__version__)}|Unreleased)", changelog, re.M)


def _setuptools_ok() -> bool:
    if importlib.util.find_spec("setuptools") is None:
        return False
    from importlib.metadata import version

    return int(version("setuptools").split(".")[0]) >= 77


@pytest.mark.skipif(
    importlib.util.find_spec("build") is None or not _setuptools_ok(),
    reason="needs `build` and setuptools>=77 (pip install -e '.[test]')",
)
def test_wheel_builds(tmp_path):
    """`python -m build --wheel` on a copy of the sources (no network: --no-isolation)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "CHANGELOG.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "curvature", src / "curvature", ignore=shutil.ignore_patterns("__pycache__")
    )
    proc = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path)]
        + [str(src)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name == f"torch_curvature-{curvature.__version__}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    for required in ("curvature/py.typed", "curvature/info.py", "curvature/demo.py"):
        assert required in names
    assert not any("tests/" in n or "benchmarks/" in n for n in names)
    meta = (
        zipfile.ZipFile(wheel)
        .read(f"torch_curvature-{curvature.__version__}.dist-info/METADATA")
        .decode()
    )
    assert f"Version: {curvature.__version__}" in meta
    assert "Requires-Dist: torch>=2.3" in meta and "Provides-Extra: examples" in meta


#: distribution name -> import name, where they differ
IMPORT_NAMES = {"pyyaml": "yaml", "scikit-learn": "sklearn"}


def runtime_dependencies() -> list:
    """The names in ``[project] dependencies`` of pyproject.toml (versions dropped)."""
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)\]", text, re.M | re.S)
    assert block, "pyproject.toml has no [project] dependencies list"
    specs = re.findall(r'"([^"]+)"', block.group(1))
    return [re.match(r"[A-Za-z0-9_.-]+", s).group(0).lower() for s in specs]


def imported_modules(package: pathlib.Path) -> set:
    """Top-level names of the absolute imports in every module under ``package``."""
    import ast

    names = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_every_runtime_dependency_is_imported():
    """A declared runtime dependency that no module imports is dead weight for every user
    (and one the code needs but does not declare breaks a clean install: see
    test_wheel_builds)."""
    deps = runtime_dependencies()
    assert "torch" in deps and "numpy" in deps, deps
    used = imported_modules(ROOT / "curvature")
    unused = [d for d in deps if IMPORT_NAMES.get(d, d.replace("-", "_")) not in used]
    assert not unused, f"declared in pyproject.toml but imported by no module: {unused}"


def test_dependency_check_sees_imports(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("import numpy as np\nfrom . import b\n")
    (tmp_path / "sub" / "c.py").write_text("def f():\n    from einops.layers import x\n")
    assert imported_modules(tmp_path) == {"numpy", "einops"}
