"""A griffe extension for the API reference (mkdocs.yml loads it).

kmp's docstrings are Google style with doctest examples written as plain
`>>>` lines after an "Example:" line. Markdown would read those lines as
nested block quotes, and a doctest's output such as `['float32', ...]` as
a reference link. This extension puts every run of doctest lines into a
`pycon` code block, and joins an argument entry whose names are wrapped
over two lines ("a, b,\\n c: ...") into one entry.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters):\s*$")
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


def join_wrapped_names(text: str) -> str:
    """In an Args section, joins an entry line that lists names and ends in
    a comma (no colon yet) with the next entry-level line, which ends them."""
    out: list[str] = []
    section_indent = entry_indent = None
    for line in text.split("\n"):
        header = _SECTION.match(line)
        if header:
            section_indent, entry_indent = len(header.group(1)), None
            out.append(line)
            continue
        indent = len(line) - len(line.lstrip())
        if section_indent is not None and line.strip():
            if indent <= section_indent:
                section_indent = entry_indent = None
            elif entry_indent is None:
                entry_indent = indent
            elif indent == entry_indent and _wrapped(out[-1], entry_indent):
                out[-1] = f"{out[-1].rstrip()} {line.strip()}"
                continue
        out.append(line)
    return "\n".join(out)


def _wrapped(line: str, entry_indent: int) -> bool:
    """An entry line whose names go on: no colon yet, a trailing comma."""
    indent = len(line) - len(line.lstrip())
    return indent == entry_indent and ":" not in line and line.rstrip().endswith(",")


class DoctestBlocks(griffe.Extension):
    """Rewrites each docstring once the package is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = join_wrapped_names(fence_doctests(obj.docstring.value))
            obj.docstring.value = text
