"""The repository's tracked files: no absolute path of the machine they were written on."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
from typing import List

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: Directories whose absolute paths are machine-specific wherever they appear.
MACHINE_PREFIXES = ("/work", "/root", "/home", "/Users", "/tmp")


def machine_path_pattern() -> re.Pattern:
    """The regex of :func:`test_no_absolute_machine_paths` (see there)."""
    prefixes = set(MACHINE_PREFIXES)
    for here in (tempfile.gettempdir(), os.path.expanduser("~")):
        if os.path.isabs(here) and here.rstrip("/"):
            prefixes.add(here.rstrip("/"))
    roots = {str(ROOT), os.path.abspath(ROOT), os.path.realpath(ROOT)}
    boundary = r"(?<![\w.~-])"  # not inside a word or a relative path (a/tmp/x, ../tmp/x, ~/x)
    prefix = "|".join(re.escape(p) for p in sorted(prefixes, key=len, reverse=True))
    root = "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True))
    return re.compile(rf"{boundary}(?:(?:{root})(?![\w.-])|(?:{prefix})(?=/[\w.-]))")


def tracked_files() -> List[pathlib.Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("no git or no .git here: the tracked files are unknown")
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False, timeout=60
    )
    if out.returncode != 0:
        pytest.skip(f"git ls-files failed: {out.stderr.decode(errors='replace').strip()}")
    return [ROOT / name for name in out.stdout.decode().split("\0") if name]


def test_no_absolute_machine_paths():
    """No tracked file names an absolute path of this machine.

    Flagged, at a boundary (the character before is not a letter, digit, ``_``, ``.``,
    ``~`` or ``-``, so ``a/tmp/x``, ``../tmp/x`` and ``~/x`` pass, while the same after a
    space, a quote, a parenthesis or ``file://`` is flagged):

    - the repository's own absolute path (computed now, as given, absolute and
      resolved), followed by anything but a further name character;
    - ``/work``, ``/root``, ``/home``, ``/Users``, ``/tmp``, this machine's temporary
      directory and home directory, each followed by ``/`` and a path component (a
      letter, digit, ``_``, ``.`` or ``-``): a bare ``/tmp/`` in prose passes.

    The regex is :func:`machine_path_pattern`; binary files (with a NUL byte) are skipped.
    Every offending ``file:line`` is reported.
    """
    pattern = machine_path_pattern()
    offending = []
    for path in tracked_files():
        if not path.is_file():  # deleted in the work tree, or a submodule
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        for i, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            for m in pattern.finditer(line):
                rel = path.relative_to(ROOT).as_posix()
                offending.append(f"{rel}:{i}: {line[m.start() : m.start() + 60].strip()}")
    assert not offending, "absolute paths of this machine in tracked files:\n" + "\n".join(
        offending
    )


# "@" stands for the "/" that starts an absolute path (this file must pass the test too)
@pytest.mark.parametrize(
    "text,flagged",
    [
        ("see @work/shared/PERFORMANCE.md", True),
        ("--json @tmp/dist.json", True),
        ('open("@home/me/x")', True),
        ("file://@Users/me/x", True),
        ("(@root/.cache)", True),
        ("`cd {root}`", True),
        ("{root}/benchmarks/common.py", True),
        ("shared/PERFORMANCE.md beside the repository", False),
        ("--json results.json", False),
        ("benchmarks/tmp/x.json and ../tmp/x and ~/work/x", False),
        ("the @tmp/ directory, the @home/ directories", False),
        ("https://github.com/org/home/tree", False),
    ],
)
def test_the_machine_path_pattern(text, flagged):
    text = text.replace("@", "/").replace("{root}", str(ROOT))
    assert bool(machine_path_pattern().search(text)) is flagged


def test_recorded_benchmark_commands_are_repository_relative():
    """The benchmark scripts record their commands (in docs/benchmarks.md and the JSON
    results) with repository paths relative to the repository and other absolute paths
    by their file name."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import common
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    outside = os.path.join(tempfile.gettempdir(), "run", "a.json")
    argv = [
        "--json",
        str(ROOT / "benchmarks" / "results" / "x.json"),
        f"--doc={ROOT / 'docs' / 'benchmarks.md'}",
        f"per_sample={outside}",
        "--quick",
        "out/r.json",
        str(ROOT),
    ]
    command = common.portable_command("benchmarks/x.py", argv)
    assert command == (
        "python benchmarks/x.py --json benchmarks/results/x.json --doc=docs/benchmarks.md "
        "per_sample=a.json --quick out/r.json ."
    )
    assert not machine_path_pattern().search(command)
