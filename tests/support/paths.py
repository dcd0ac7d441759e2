"""Where things are: the repository, and the one folder of test data files."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# Every data file the tests read (captures, upstream trees, hand-built reports, the golden
# scrape), one folder per kind, each with its SOURCES.md (tests/fixtures/README.md indexes them).
FIXTURES = TESTS / "fixtures"
UPSTREAM = FIXTURES / "upstream"
GOLDEN = FIXTURES / "golden"
