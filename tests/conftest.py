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

from support import tiers
from support.exporter import Exporter


# The two tiers (tests/support/tiers.py): every test is marked unit or system, and a unit test
# that starts a process fails.
def pytest_configure(config: pytest.Config) -> None:
    tiers.configure(config)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.mark(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[object]:
    tiers.enter(item)
    try:
        return (yield)
    finally:
        tiers.leave()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any]) -> Iterator[object]:
    with tiers.fixture(fixturedef, "setup"):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item) -> Iterator[pytest.TestReport]:
    rep: pytest.TestReport = yield
    tiers.report(item, rep)
    return rep


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    return tiers.scheduler(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    tiers.finish(config)


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
