"""The layout of the package (docs/architecture.md): its parts stand on floors, each part imports
only its own floor and those below, and no modules import each other in a loop.

The graph is read from the source with ast, as the interpreter would resolve the imports; an
import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from support.paths import REPO

PACKAGE = "gpunet_exporter"
# Lowest first. A module may import its own part and the parts below it, never one above.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sources", ("sources",)),
    ("core", ("__init__", "errors", "files", "config", "flags", "logs", "statefile", "collector",
              "background", "inventory", "registry", "localize")),
    ("nccl", ("nccl",)),
    ("probe", ("probe",)),
    ("collectors", ("collectors",)),
    ("web", ("web",)),
    ("options", ("options",)),
    ("daemon", ("daemon",)),
    ("mixin", ("mixin",)),
    ("health", ("health",)),
    ("cli", ("cli", "__main__")),
)


def modules() -> dict[str, Path]:
    """Module name -> file, read from the source tree (src/, as pyproject.toml installs it)."""
    out = {}
    folder = REPO / "src" / PACKAGE
    for path in sorted(folder.rglob("*.py")):
        parts = list(path.relative_to(folder).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts])] = path
    return out


def part(module: str) -> str:
    """The part (floor name) a module of the package belongs to."""
    rest = module[len(PACKAGE) + 1:].split(".") if module != PACKAGE else ["__init__"]
    for name, members in FLOORS:
        if rest[0] in members:
            return name
    raise AssertionError(f"{module} is on no floor: add it to FLOORS and docs/architecture.md")


def imports(module: str, path: Path, known: dict[str, Path]) -> Iterator[str]:
    """The package's modules that ``module`` imports."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name.startswith(PACKAGE) and name != module:
                yield name


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: set(imports(m, p, known)) for m, p in known.items()}


def test_the_package_is_read_whole() -> None:
    g = graph()
    assert f"{PACKAGE}.collectors.infiniband" in g and f"{PACKAGE}.sources.rdma" in g
    assert f"{PACKAGE}.sources.rdma" in g[f"{PACKAGE}.collectors.infiniband"]
    assert len(g) > 40


def test_no_import_runs_up_a_floor() -> None:
    rank = {name: i for i, (name, _) in enumerate(FLOORS)}
    upward = sorted(f"{m} ({part(m)}) imports {d} ({part(d)})"
                    for m, deps in graph().items() for d in deps
                    if rank[part(d)] > rank[part(m)])
    assert not upward, "\n".join(upward)


def test_no_import_cycle() -> None:
    g = graph()
    state: dict[str, int] = {}  # 1 on the path, 2 done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*path[path.index(d):], d]))
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_sources_touch_the_machine_and_export_nothing() -> None:
    """sources/ returns typed results: no metric families, no collectors."""
    for module, path in modules().items():
        if part(module) == "sources":
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                assert not any(n.startswith("prometheus_client") for n in names), module


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    """The floor test can fail: an import of the daemon from a source is found."""
    known = modules()
    bad = tmp_path / "bad.py"
    bad.write_text("from gpunet_exporter.daemon import serve\n")
    found = set(imports(f"{PACKAGE}.sources.bad", bad, known))
    assert found == {f"{PACKAGE}.daemon.serve"}
    assert part(f"{PACKAGE}.sources.bad") == "sources"
    assert part(f"{PACKAGE}.daemon.serve") == "daemon"


def schema_uses(source: str) -> list[str]:
    """Where ``source`` builds a ``Field`` of gpunet_exporter.config or imports a private name of
    it (``_validate``): a way to declare or check settings other than Settings and setting()."""
    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == f"{PACKAGE}.config":
            found += [f"{node.lineno}: imports {a.name}" for a in node.names
                      if a.name.startswith("_")]
        elif isinstance(node, ast.Call):
            name = (node.func.id if isinstance(node.func, ast.Name) else
                    node.func.attr if isinstance(node.func, ast.Attribute) else "")
            if name in ("Field", "_validate"):
                found.append(f"{node.lineno}: calls {name}")
    return found


def test_settings_are_declared_only_through_setting() -> None:
    """Field (the schema settings_fields gives, to read) is built and checked only inside
    config.py: every section, the thresholds' ``for`` map included, is a Settings class."""
    uses = []
    for folder in ("src", "tests", "bench", "examples"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if path != REPO / "src" / PACKAGE / "config.py":
                uses += [f"{path.relative_to(REPO)}:{use}"
                         for use in schema_uses(path.read_text(encoding="utf-8"))]
    assert not uses, "\n".join(uses)


def test_the_checker_sees_a_schema_built_by_hand() -> None:
    bad = ("from gpunet_exporter.config import Field, _validate\n"
           "_validate({}, Field('map'), '')\n")
    assert schema_uses(bad) == ["1: imports _validate", "2: calls _validate", "2: calls Field"]
    assert schema_uses("from dataclasses import field\nx = field(default=1)\n") == []
