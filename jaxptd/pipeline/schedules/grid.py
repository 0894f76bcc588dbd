"""The text grids of schedules (rank x position) and packed rounds (rank x round) that
error messages and the CLI print. Pure Python."""
from __future__ import annotations


def format_grid(rows: list, column_name: str, marks: dict | None = None) -> str:
    """rows[r][t] strings -> aligned text; marks {(r, t): '!'} appended to cells."""
    marks = marks or {}
    rows = [[c + marks.get((r, t), "") for t, c in enumerate(row)] for r, row in enumerate(rows)]
    width = max([len(c) for row in rows for c in row] + [2])
    ncol = max(len(row) for row in rows)
    head = f"{column_name:>7} " + " ".join(f"{t:<{width}}" for t in range(ncol))
    body = [f"rank {r:<2} " + " ".join(f"{c:<{width}}" for c in row) for r, row in enumerate(rows)]
    return "\n".join(line.rstrip() for line in [head] + body)


def round_cells(packed: list, chunks: int) -> list:
    """Per rank, per round: the round's actions as 'F0 B1 W0' text ('.' for an empty slot;
    the B and W columns only when some round uses them)."""
    width = max([i + 1 for row in packed for slots in row for i, a in enumerate(slots) if a]
                + [1])
    return [[" ".join(a.label(chunks) if a else "." for a in row[r][:width]).rstrip()
             for row in packed] for r in range(len(packed[0]) if packed else 0)]
