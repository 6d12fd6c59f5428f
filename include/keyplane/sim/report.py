"""Markdown tables for the reproduction benchmarks.

Every benchmark prints its results as a markdown table and can write it to
the reproduction docs, so a figure point of a paper sits beside the value the
simulator measured. One formatter keeps those tables uniform.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Cell = str | int | float | None


def format_cell(value: Cell, digits: int = 3) -> str:
    """Render one cell: floats to ``digits`` significant digits, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if math.isinf(value):
            return "∞"
        return f"{value:.{digits}g}"
    return value


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Cell]], digits: int = 3) -> str:
    """A GitHub-flavoured markdown table of ``rows`` under ``headers``."""
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"row {i} has {len(row)} cells, expected {len(headers)}")
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines.extend("| " + " | ".join(format_cell(c, digits) for c in row) + " |" for row in rows)
    return "\n".join(lines)
