"""Loads the counter tables shipped in collectors/data/ (CSV with '#' comment lines)."""

from __future__ import annotations

import csv
from importlib.resources import files


def load(name: str) -> list[dict[str, str]]:
    text = (files("collectors") / "data" / name).read_text(encoding="utf-8")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [{k: (v or "").strip() for k, v in row.items()} for row in csv.DictReader(lines)]
