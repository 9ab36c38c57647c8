"""Plain-text tables of figures, as ``calc`` prints them: right-aligned columns and "N B (size)" cells."""

from __future__ import annotations

from kvscope.core.model.spec import human_bytes


def bytes_cell(n: int) -> str:
    """Exact bytes and, beside them, binary units (1 GiB = 1,073,741,824 B), the window's convention, so a
    figure reads the same in the terminal and on screen."""
    return f"{n:,} B ({human_bytes(n)})"


def aligned(table: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells right-aligned in columns, a rule of dashes under the first (the header)."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = []
    for i, row in enumerate(table):
        lines.append("  ".join(cell.rjust(widths[j]) for j, cell in enumerate(row)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines
