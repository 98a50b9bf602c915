"""Plain aligned text tables for the command line: no dependency, fits any terminal."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

# the longest a cell may be before it is cut (an error message, say), so one row stays one line
MAX_CELL = 60


def cell(value: object) -> str:
    """How a value reads in a table: empty for None, floats to 6 significant digits, ISO
    timestamps to the minute."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value)
    text = " ".join(str(value).split())
    if len(text) > 19 and text[4:5] == "-" and text[10:11] == "T":
        try:
            return datetime.fromisoformat(text).strftime("%Y-%m-%d %H:%M")
        except ValueError:
            pass
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 3] + "..."


def render(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """The rows under their headers, columns aligned (numbers to the right)."""
    cells = [[cell(v) for v in row] for row in rows]
    numeric = [
        bool(rows) and all(isinstance(row[i], int | float) or row[i] is None for row in rows)
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        padded = (v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))
        return "  ".join(padded).rstrip()

    return "\n".join([line([h.upper() for h in headers]), *(line(r) for r in cells)])
