"""Loads the counter tables shipped in collectors/data/ (CSV with '#' comment lines)."""

from __future__ import annotations

import csv
from importlib.resources import files


def load(name: str) -> list[dict[str, str]]:
    """The rows of a table as dicts of stripped strings (a missing field is ""). Raises
    ValueError naming the file and row for a row with more fields than the header (an unquoted
    comma), which would otherwise lose its text silently."""
    text = (files("gpunet_exporter.collectors") / "data" / name).read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    rows = []
    for number, row in enumerate(csv.DictReader(lines), start=1):
        extra = row.pop(None, None)
        if extra is not None:
            raise ValueError(f"collectors/data/{name}: row {number} has {len(extra)} field(s) "
                             f"more than the header ({', '.join(map(repr, extra))}); quote a "
                             "field that holds a comma")
        rows.append({k: (v or "").strip() for k, v in row.items()})
    return rows
