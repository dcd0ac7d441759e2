"""The two tiers (tests/support/tiers.py): the guard that fails a unit test starting a process
can fail, and the lists that classify tests name what exists."""

from __future__ import annotations

import ast
import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from support import tiers
from support.paths import TESTS


class _Item:
    """What the guard reads of a test item."""

    def __init__(self) -> None:
        self.nodeid = "tests/test_x.py::test_y"
        self.stash = pytest.Stash()


@contextmanager
def as_unit_test() -> Iterator[_Item]:
    """The guard armed for a stand-in unit test (the running test's own state kept aside)."""
    saved = dict(tiers._current)
    item = _Item()
    tiers._current.update(item=item, audit=None)
    try:
        yield item
    finally:
        tiers._current.update(saved)


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"], check=False),
    lambda: subprocess.Popen(["true"]),
    lambda: os.system("true"),
    lambda: os.fork(),
    lambda: os.posix_spawn("/bin/true", ["true"], {}),
    lambda: shutil.which("promtool"),
    lambda: shutil.which("/usr/sbin/ip"),
], ids=["run", "Popen", "system", "fork", "posix_spawn", "which-promtool", "which-ip"])
def test_a_unit_test_starting_a_process_fails(start: Any) -> None:
    with as_unit_test() as item, pytest.raises(tiers.UnitTierViolation, match="mark it system"):
        start()
    assert item.stash[tiers._VIOLATIONS]


def test_the_violation_fails_the_test_even_when_caught() -> None:
    """Code under test that swallows the exception (a collector falling back when its program
    cannot run) does not hide it: the report of that phase fails."""
    with as_unit_test() as item, contextlib.suppress(Exception):
        subprocess.run(["ethtool", "-S", "eth0"], check=False)
    rep = pytest.TestReport(item.nodeid, ("x", 1, "y"), {}, "passed", None, "call")
    tiers.report(item, rep)  # type: ignore[arg-type]
    assert rep.outcome == "failed"
    assert "started a process (ethtool)" in str(rep.longrepr)


def test_outside_a_unit_test_nothing_is_stopped() -> None:
    with as_unit_test():
        tiers._current["item"] = None
        assert subprocess.run(["true"], check=False).returncode == 0


def test_other_programs_may_be_looked_up() -> None:
    """A unit test may ask for a program of no Debian package (the answer does not depend on
    what tests/run.sh installs)."""
    with as_unit_test():
        assert shutil.which("no-such-program-anywhere") is None


def test_every_debian_program_of_run_sh_is_guarded() -> None:
    """The programs tests/run.sh installs Debian packages for are the ones a unit test may not
    look for."""
    script = (TESTS / "run.sh").read_text(encoding="utf-8")
    checked = set(re.findall(r"command -v (\S+) >/dev/null \|\| need_apt", script))
    assert {"prometheus", "slurmctld", "buildah"} <= checked  # the pattern still finds them
    assert checked <= tiers.DEBIAN_PROGRAMS, checked - tiers.DEBIAN_PROGRAMS


def _functions(module: str) -> set[str]:
    tree = ast.parse((TESTS / f"{module}.py").read_text(encoding="utf-8"))
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_the_lists_name_modules_and_tests_that_exist() -> None:
    """A renamed module or test is not silently moved to the other tier by a stale list."""
    modules = {p.stem for p in TESTS.glob("test_*.py")}
    assert modules >= tiers.SYSTEM_MODULES, tiers.SYSTEM_MODULES - modules
    assert set(tiers.SYSTEM_TESTS) <= modules, set(tiers.SYSTEM_TESTS) - modules
    assert not tiers.SYSTEM_MODULES & set(tiers.SYSTEM_TESTS)
    missing = {m: names - _functions(m) for m, names in tiers.SYSTEM_TESTS.items()
               if names - _functions(m)}
    assert not missing, f"tests/support/tiers.py names tests that do not exist: {missing}"
    fixtures = set().union(*(_functions(p.stem) for p in TESTS.glob("test_*.py")),
                           _functions("conftest"))
    assert fixtures >= tiers.SYSTEM_FIXTURES, tiers.SYSTEM_FIXTURES - fixtures


def test_pytest_fails_a_unit_test_that_starts_a_process(tmp_path: Path) -> None:
    """End to end, through tests/conftest.py: a test in a module of neither list, starting a
    process, fails in a pytest run, and the failure says how to mark it."""
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text(encoding="utf-8"))
    (tmp_path / "test_drift.py").write_text(
        "import subprocess\n\n"
        "def test_starts_true():\n"
        "    subprocess.run(['true'], check=True)\n\n"
        "def test_in_process():\n"
        "    assert 1 + 1 == 2\n")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rf",
         f"--rootdir={tmp_path}", "-c", os.devnull, str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(TESTS)})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed, 1 passed" in r.stdout, r.stdout
    assert "test_starts_true is a unit test but started a process (true)" in r.stdout, r.stdout


def _shared_fixture_modules() -> set[str]:
    """Test modules defining a fixture of module, package or session scope."""
    out = set()
    for path in TESTS.glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef) and any(
                    "fixture" in ast.unparse(d)
                    and re.search(r"scope=['\"](module|package|session)['\"]", ast.unparse(d))
                    for d in node.decorator_list):
                out.add(path.stem)
    return out


def test_modules_with_shared_fixtures_run_on_one_worker() -> None:
    """Every module that builds something once for its tests is one unit of work for
    pytest-xdist (two workers would each build it: an image twice, two Slurm clusters)."""
    shared = _shared_fixture_modules()
    assert {"test_image", "test_fleet_slurm"} <= shared  # the scan still finds them
    assert shared <= tiers.GROUPED_MODULES, shared - tiers.GROUPED_MODULES
    modules = {p.stem for p in TESTS.glob("test_*.py")}
    assert modules >= tiers.GROUPED_MODULES and set(tiers.FIRST) <= modules
    assert modules >= tiers.QUIET_MODULES


def test_the_quiet_modules_are_system_modules() -> None:
    """tests/run.sh runs the quiet tests by themselves after the parallel part, and the unit tier
    (``--unit``) has no such second part: so no quiet module may hold a unit test."""
    assert tiers.QUIET_MODULES <= tiers.SYSTEM_MODULES, tiers.QUIET_MODULES - tiers.SYSTEM_MODULES


def test_the_scheduler_keeps_groups_and_puts_long_modules_first() -> None:
    assert tiers.scope("tests/test_image.py::test_a") == "tests/test_image.py"
    assert tiers.scope("tests/test_image.py::test_b[x]") == "tests/test_image.py"
    assert tiers.scope("tests/test_alerts.py::test_a") == "tests/test_alerts.py::test_a"
    assert tiers.QUIET_TOGETHER <= tiers.QUIET_MODULES
    assert tiers.scope("tests/test_fleet_netns.py::test_a") == tiers.scope(
        "tests/test_fleet_rules_netns.py::test_b[y]") != tiers.scope(
        "tests/test_hostile_http.py::test_c")
    nodeids = ["tests/test_settings.py::test_a", "tests/test_alerts.py::test_b",
               "tests/test_parsers.py::test_c", "tests/test_image.py::test_d"]
    assert tiers.order(nodeids) == ["tests/test_image.py::test_d",
                                    "tests/test_alerts.py::test_b",
                                    "tests/test_settings.py::test_a",
                                    "tests/test_parsers.py::test_c"]
