"""A griffe extension for the API reference (mkdocs.yml loads it).

kmp's docstrings are Google style with doctest examples written as plain
`>>>` lines after an "Example:" line. Markdown would read those lines as
nested block quotes, and a doctest's output such as `['float32', ...]` as
a reference link. This extension puts every run of doctest lines into a
`pycon` code block.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_DOCTEST_FLAGS = re.compile(r"\s*#\s*doctest:.*$")


def fence_doctests(text: str) -> str:
    """Wraps each run of lines starting with `>>>` (up to a blank line) in a
    fenced `pycon` block, and drops doctest flags from it."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        stripped = lines[i].lstrip()
        if not stripped.startswith(">>>"):
            out.append(lines[i])
            i += 1
            continue
        indent = lines[i][: len(lines[i]) - len(stripped)]
        block = []
        while i < len(lines) and lines[i].strip() and lines[i].startswith(indent):
            block.append(_DOCTEST_FLAGS.sub("", lines[i][len(indent) :]))
            i += 1
        out += [f"{indent}```pycon", *(indent + b for b in block), f"{indent}```"]
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Rewrites each docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = fence_doctests(obj.docstring.value)
            obj.docstring.value = text
