"""The test suite's own layout (issue 17): helpers in tests/support, data files in
tests/fixtures, no test module importing another, one polling loop."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

from support.paths import FIXTURES, REPO, TESTS

# Python files whose imports are checked: the suite, and the scripts that use its helpers.
CHECKED = sorted([*TESTS.rglob("*.py"), *(REPO / "bench").glob("*.py")])
# What may sit in tests/ outside fixtures/: the suite's code and the script that runs it.
NOT_DATA = {".py"}
RUNNER = TESTS / "run.sh"


def _code(tree: ast.AST, strings: bool = True, depth: int = 0) -> Iterator[ast.AST]:
    """Every node of ``tree``, and (``strings``) of the Python programs held in its string
    constants (scripts a test runs in a subprocess: they import like any module)."""
    for node in ast.walk(tree):
        yield node
        if (strings and depth < 3 and isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and "import" in node.value):
            try:
                inner = ast.parse(textwrap.dedent(node.value))
            except (SyntaxError, ValueError):
                continue
            yield from _code(inner, strings, depth + 1)


def imports(source: str, strings: bool = True) -> Iterator[tuple[int, str]]:
    """(line, module) for every import in ``source``: statements at any depth, relative ones
    with their names, and importlib.import_module / __import__ of a constant name."""
    for node in _code(ast.parse(source), strings):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                yield node.lineno, node.module
            else:  # from . import x, from .x import y: tests/ is no package, but say what it is
                base = "." * node.level + (node.module or "")
                for alias in node.names:
                    yield node.lineno, f"{base}.{alias.name}" if node.module else alias.name
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name) and node.func.id == "__import__"))):
            yield node.lineno, node.args[0].value


def imports_of_tests(source: str, strings: bool = True) -> list[str]:
    """'line: module' for each import of a test module (test_*) or of conftest in ``source``."""
    out = []
    for line, module in imports(source, strings):
        top = module.lstrip(".").split(".")[0]
        if top.startswith("test_") or top == "conftest":
            out.append(f"{line}: {module}")
    return out


def test_no_test_module_imports_another() -> None:
    """Shared code lives in tests/support; a test module imports no other test module, and
    nothing imports conftest (pytest loads it; its fixtures reach tests by name)."""
    # This file's own strings are the cases of the check below.
    found = {str(path.relative_to(REPO)): hits for path in CHECKED
             if (hits := imports_of_tests(path.read_text(encoding="utf-8"),
                                          strings=path != Path(__file__).resolve()))}
    assert not found, f"imports of test modules or conftest (move the shared code to " \
                      f"tests/support): {found}"


def test_the_import_check_can_fail() -> None:
    cases = {
        "from test_cli import alias_bomb, merge_bomb\n": ["1: test_cli"],
        "import conftest\n": ["1: conftest"],
        "from conftest import REPO\n": ["1: conftest"],
        "def f():\n    import test_link as tl\n": ["2: test_link"],
        "import importlib\nm = importlib.import_module('test_alerts_e2e')\n":
            ["2: test_alerts_e2e"],
        "CODE = '''\nimport json\nfrom conftest import make_collector\n'''\n": ["3: conftest"],
        "from . import test_x\n": ["1: test_x"],
    }
    for source, want in cases.items():
        assert imports_of_tests(source) == want, source
    for fine in ("from support.wait import wait_for\n", "from support import fake_nvml\n",
                 "import pytest\nfrom gpunet_exporter.config import parse_settings\n",
                 "TEXT = 'import this test_x'\n"):
        assert imports_of_tests(fine) == [], fine


def data_files_outside_fixtures() -> list[str]:
    out = []
    for path in sorted(TESTS.rglob("*")):
        parts = path.relative_to(TESTS).parts
        if (path.is_dir() or parts[0] == "fixtures" or "__pycache__" in parts
                or path.suffix in NOT_DATA or path == RUNNER):
            continue
        out.append(str(path.relative_to(REPO)))
    return out


def test_data_files_are_in_fixtures() -> None:
    """One place for the suite's data files: tests/fixtures (tests/fixtures/README.md says what
    is not there on purpose: trees generated by tests/support/sysfs_tree.py)."""
    assert FIXTURES.is_dir()
    stray = data_files_outside_fixtures()
    assert not stray, f"data files outside {FIXTURES.relative_to(REPO)}: {stray}"


def test_conftest_holds_only_fixtures() -> None:
    """tests/conftest.py defines pytest fixtures and pytest's hooks (pytest_*, which hand over
    to tests/support: the tiers) and nothing else; helpers are in tests/support."""
    tree = ast.parse((TESTS / "conftest.py").read_text(encoding="utf-8"))
    others = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
            if not fixture and not node.name.startswith("pytest_"):
                others.append(f"function {node.name}")
        elif isinstance(node, (ast.ClassDef, ast.AsyncFunctionDef)):
            others.append(f"{type(node).__name__} {node.name}")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            others.append(f"assignment on line {node.lineno}")
    assert not others, f"tests/conftest.py defines more than fixtures: {others}"


def polling_loops(source: str) -> list[int]:
    """Lines of `while` loops that sleep (call time.sleep or sleep) in their body: hand-written
    waits, which wait_for replaces. Programs held in strings (run in a subprocess) are not
    counted: they cannot import the suite's helpers."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.While):
            for inner in ast.walk(node):
                if isinstance(inner, ast.Call) and ast.unparse(inner.func) in ("time.sleep",
                                                                                "sleep"):
                    out.append(node.lineno)
                    break
    return out


def test_one_polling_loop() -> None:
    """Waiting is wait_for's (tests/support/wait.py): it fails saying what it waited for."""
    wait = TESTS / "support" / "wait.py"
    assert polling_loops(wait.read_text(encoding="utf-8"))  # the one loop: the check can fail
    found = {str(path.relative_to(REPO)): lines for path in CHECKED
             if path.is_relative_to(TESTS) and path != wait
             and (lines := polling_loops(path.read_text(encoding="utf-8")))}
    assert not found, f"polling loops outside tests/support/wait.py (use wait_for): {found}"
