"""The repository is the whole project: nothing reads or cites files beside the checkout, the
wheel builds without a warning and carries its license, and the README's two commands are the
ones CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from fnmatch import fnmatch
from pathlib import Path

from support.paths import REPO

SKIP_DIRS = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".pytest_cache",
             ".hypothesis", "build", "dist"}
# Ways to reach outside the checkout: the reference folder that sat beside it while the project
# was written, and paths that climb above the repository root. Spelt in pieces so that this
# file does not match itself.
OUTSIDE = re.compile("|".join([
    re.escape("../" + "shared"),
    "shared" + "/(?:fixtures|reference)",
    "fixtures" + "-upstream",
    "FORMATS" + r"\.md",
    re.escape("REPO" + ".parent"),
    re.escape(".parent" + ".parent" + ".parent"),
]))


def project_files() -> list[Path]:
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        out += [Path(root) / f for f in files]
    return out


def test_nothing_reaches_outside_the_repository() -> None:
    files = project_files()
    assert len(files) > 1000  # the example trees included
    hits = []
    for path in files:
        if path.is_symlink():
            target = os.path.realpath(path)
            if not target.startswith(str(REPO) + os.sep):
                hits.append(f"{path.relative_to(REPO)}: symlink to {target}")
            continue
        text = path.read_bytes().decode("utf-8", "replace")
        for m in OUTSIDE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            hits.append(f"{path.relative_to(REPO)}:{line}: {m.group(0)}")
    assert not hits, "reaches outside the repository:\n" + "\n".join(hits)


def test_the_outside_check_can_fail() -> None:
    for text in ("../" + "shared/x", "shared" + "/reference/y", "see " + "FORMATS" + ".md §1",
                 "REPO" + ".parent"):
        assert OUTSIDE.search(text)
    assert not OUTSIDE.search("docs/formats.md §1.4, tests/fixtures/upstream")


def test_every_fixture_folder_says_where_its_files_come_from() -> None:
    fixtures = REPO / "tests" / "fixtures"
    folders = [p for p in fixtures.iterdir() if p.is_dir()]
    assert {p.name for p in folders} >= {"nccl", "nvml", "synthetic", "upstream", "pfc"}
    for folder in folders:
        sources = folder / "SOURCES.md"
        assert sources.is_file(), f"{folder.relative_to(REPO)} has no SOURCES.md"
        text = sources.read_text()
        patterns = [p.rstrip("/") for p in re.findall(r"`([^`\s]*\*[^`\s]*)`", text)]
        for entry in folder.iterdir():
            if entry.name != "SOURCES.md":
                assert entry.name in text or any(fnmatch(entry.name, p) for p in patterns), (
                    f"{sources.relative_to(REPO)} does not name {entry.name}")


def test_readme_starts_with_the_two_commands_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    assert blocks[:2] == ["python3 -m venv .venv && .venv/bin/pip install . && "
                          ".venv/bin/gpunet-exporter", "bash tests/run.sh"]
    assert readme.index("```sh") < readme.index("\n## ")  # before any section
    ci = (REPO / ".ci" / "run").read_text()
    assert "\nbash tests/run.sh\n" in ci and "mktemp -d" in ci


def test_wheel_builds_clean_with_its_license(tmp_path: Path) -> None:
    """No setuptools warning (the TOML-table license was deprecated with a deadline, and a data
    directory missing from `packages` was warned about), the license in the metadata as an SPDX
    expression and its text in the wheel, the data tables and typing markers included."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path),
                          str(REPO)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    log = out.stdout + out.stderr
    warnings = [ln for ln in log.splitlines()
                if re.search(r"Warning|deprecat|absent from", ln)
                and not ln.startswith("WARNING: Location")]  # pip's note on a missing local index
    assert not warnings, "\n".join(warnings)
    wheel = next(tmp_path.glob("gpunet_exporter-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta
    assert any(n.endswith("/licenses/LICENSE") for n in names)
    for name in ("gpunet_exporter/collectors/data/infiniband_counters.csv",
                 "gpunet_exporter/collectors/data/pfc_ethtool.csv",
                 "gpunet_exporter/collectors/py.typed", "gpunet_exporter/py.typed",
                 "gpunet_exporter/cli.py", "gpunet_exporter/sources/rdma.py"):
        assert name in names
    # One top-level name, unique to this project: nothing installs as exporter or collectors.
    assert {n.split("/")[0] for n in names if not n.startswith("gpunet_exporter-")} == {
        "gpunet_exporter"}
    assert not [n for n in names if n.startswith("tests/")]
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert (REPO / "CHANGELOG.md").read_text().startswith("# Changelog")
