"""Griffe extension for the docs build: the reST bits of the docstrings become Markdown.

The package's Google-style docstrings name other objects with Sphinx roles
(``:class:`~curvature.capture.Capture```, ``:meth:`step```) and write a few formulas
as ``.. math::`` directives. mkdocstrings reads neither, so this extension rewrites
each role into an optional autorefs link to the object's canonical path (a link where
the object is rendered in the API reference, plain code otherwise) and each math
directive into a code block of its LaTeX source; doctest examples (``>>>`` lines, their
``...`` continuations and output) become fenced Python code blocks, which Markdown would
otherwise read as nested block quotes, and their doctest flags are dropped. It changes
only the docs build, never the package.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

DOCTEST = re.compile(r"\s*# doctest: \+\w+")
MATH = re.compile(r"^(\s*)\.\. math::(.*)$")
PROMPT = re.compile(r"^(\s*)>>>( |$)")
ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):`(~?)([\w.]+)(?:\(\))?`")


def _canonical(obj: griffe.Object, name: str, loader: griffe.GriffeLoader) -> str | None:
    """The canonical path of ``name`` as seen from ``obj``'s scope, or None."""
    head, _, rest = name.partition(".")
    candidates = [name]
    try:
        resolved = obj.resolve(head)
        candidates.insert(0, f"{resolved}.{rest}" if rest else resolved)
    except (griffe.NameResolutionError, griffe.AliasResolutionError, KeyError):
        pass
    for path in candidates:
        try:
            return loader.modules_collection[path].canonical_path
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
    return None


def _math_blocks(text: str) -> str:
    """``.. math:: X`` (and its indented continuation lines) to a fenced code block."""
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        match = MATH.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent, body = match.group(1), [match.group(2).strip()]
        i += 1
        while i < len(lines) and (
            not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > len(indent)
        ):
            body.append(lines[i].strip())
            i += 1
        while body and not body[-1]:
            body.pop()
        out += [f"{indent}```text", *(f"{indent}{b}" for b in body if b), f"{indent}```", ""]
    return "\n".join(out)


def _doctest_blocks(text: str) -> str:
    """A doctest example (from a ``>>>`` line to the next blank or less indented line) to a
    fenced ``python`` block, prompts and output kept.
    """
    lines, out, i = text.split("\n"), [], 0
    while i < len(lines):
        match = PROMPT.match(lines[i])
        if not match:
            out.append(lines[i])
            i += 1
            continue
        indent, body = match.group(1), []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            body.append(lines[i][len(indent) :])
            i += 1
        out += [f"{indent}```python", *(indent + b for b in body), f"{indent}```", ""]
    return "\n".join(out)


def _rewrite(obj: griffe.Object, loader: griffe.GriffeLoader) -> None:
    if obj.docstring is None:
        return
    text = _doctest_blocks(_math_blocks(obj.docstring.value))
    obj.docstring.value = DOCTEST.sub("", text)

    def replace(match: re.Match) -> str:
        short, name = match.group(1), match.group(2).lstrip(".")
        title = name.rsplit(".", 1)[-1] if short else name
        path = _canonical(obj, name, loader)
        if path is None:
            return f"`{title}`"
        return f'<autoref identifier="{path}" optional><code>{title}</code></autoref>'

    obj.docstring.value = ROLE.sub(replace, obj.docstring.value)


class SphinxRoles(griffe.Extension):
    """Rewrite Sphinx roles once the whole package is loaded."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Walk every object of the package (aliases excluded) and rewrite its docstring."""
        stack: list = [pkg]
        while stack:
            obj = stack.pop()
            _rewrite(obj, loader)
            stack.extend(m for m in obj.members.values() if not m.is_alias)

    # griffe 1.x names the same event ``on_package_loaded``; rewriting twice is harmless.
    on_package_loaded = on_package
