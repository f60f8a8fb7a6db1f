"""Plain-text tables, for reports and the command line."""

from __future__ import annotations

from collections.abc import Sequence


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns, two spaces apart, a dashed rule under the header."""
    table = [tuple(header), *(tuple(r) for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True))

    lines = [line(table[0]).rstrip(), line(["-" * w for w in widths])]
    lines += [line(row).rstrip() for row in table[1:]]
    return "\n".join(lines)
