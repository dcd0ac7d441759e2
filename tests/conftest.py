"""pytest fixtures only; every helper lives in tests/support (see its __init__)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

# tests/ on sys.path, for `support` (pytest puts it there too; this does not depend on how).
sys.path.insert(0, str(Path(__file__).parent))

from support.exporter import Exporter


@pytest.fixture
def run_exporter() -> Iterator[Any]:
    """Start the installed exporter with these arguments (``env`` and Exporter's keywords);
    every one started is stopped after the test."""
    started: list[Exporter] = []

    def start(*args: str, env: Mapping[str, str] | None = None, **kw: Any) -> Exporter:
        e = Exporter(list(args), env, **kw)
        started.append(e)
        return e

    yield start
    for e in started:
        if e.proc.poll() is None:
            e.stop()


@pytest.fixture(autouse=True)
def _quiet_logs() -> None:
    logging.getLogger("gpunet").setLevel(logging.WARNING)
