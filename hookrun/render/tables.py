"""A sweep's ranking tables: its jobs (or their attributions) sorted by one number, best
first with NaN last, numbered, and written as <name>.csv and a Markdown <name>.md — the form
every stage's ranking takes (evaluate, metrics, steering)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

__all__ = ["ranked", "write_table"]


def ranked(rows: list[dict[str, Any]], key: str, higher: bool = True) -> list[dict[str, Any]]:
    """`rows` sorted by `key`, the best first (the highest, or the lowest with `higher`
    false), NaN last, each numbered in its `rank`."""
    sign = -1 if higher else 1

    def order(row: dict[str, Any]) -> tuple[bool, float]:
        value = float(row[key])
        return (math.isnan(value), 0.0 if math.isnan(value) else sign * value)

    out = sorted(rows, key=order)
    for place, row in enumerate(out, 1):
        row["rank"] = place
    return out


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) and math.isfinite(value) else str(value)


def write_table(
    folder: Path, name: str, rows: list[dict[str, Any]], columns: list[str], title: str
) -> list[Path]:
    """`rows` as `folder`/<name>.csv and <name>.md (a `# title` over a Markdown table)."""
    csv_path, md_path = folder / f"{name}.csv", folder / f"{name}.md"
    with csv_path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in columns) + " |" for r in rows]
    md_path.write_text("\n".join(lines) + "\n")
    return [csv_path, md_path]
