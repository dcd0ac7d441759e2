"""The alerting bundle's one command (``python -m gpunet_exporter.mixin``, gpunet_exporter.mixin):
it writes every generated file of a checkout, ``--check`` names each stale one, and a
thresholds file changes the rules, the dashboards and the PrometheusRule together; the
dashboards turn red where the alerts fire."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunet_exporter.mixin import dashboards, generate, thresholds
from gpunet_exporter.mixin.alerts import ALERT_NAMES
from gpunet_exporter.mixin.dashboards.common import duration_words
from gpunet_exporter.probe import run_options

from support.paths import REPO

# What the command reads besides the code: the base config the Kubernetes components extend,
# and the configuration guide whose key table it rewrites.
INPUTS = ("kubernetes/exporter/base/config.yml", "docs/configuration.md")
STALE_PANELS = {  # (dashboard, panel title) -> the threshold its red step is
    ("gpunet-fleet.json", "Idle GPUs without a probe round"): ("probe", "stale_seconds"),
    ("gpunet-collectives.json", "Idle GPUs without a probe round"): ("probe", "stale_seconds"),
    ("gpunet-collectives.json", "Time since last successful round"): ("probe", "stale_seconds"),
    ("gpunet-pairs.json", "Oldest pair round"): ("fleet", "stale_seconds"),
    ("gpunet-pairs.json", "Time since the last pair round"): ("fleet", "stale_seconds"),
    ("gpunet-fabric.json", "Sweep age"): ("fabric", "stale_seconds"),
}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpunet_exporter.mixin", *args],
                          capture_output=True, text=True, timeout=120)


def checkout(tmp_path: Path) -> Path:
    """A root with only the command's inputs."""
    root = tmp_path / "root"
    for path in INPUTS:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / path, root / path)
    return root


def red(panel: dict[str, Any]) -> list[float]:
    steps = panel["fieldConfig"]["defaults"]["thresholds"]["steps"]
    return [s["value"] for s in steps if s["color"] == "red"]


def panels(boards: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(name, p["title"]): p for name, d in boards.items()
            for p in dashboards.iter_panels(d)}


def test_the_checkout_is_fresh() -> None:
    out = run("--check", "--root", str(REPO))
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_it_writes_every_generated_file(tmp_path: Path) -> None:
    """Into a root with only its inputs, the command writes the committed files, byte for
    byte; then --check finds them fresh."""
    root = checkout(tmp_path)
    out = run("--root", str(root))
    assert out.returncode == 0, out.stderr
    written = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    expected = sorted({*INPUTS, *generate.outputs(thresholds.defaults(ALERT_NAMES), str(REPO))})
    assert written == expected
    assert "alerts/gpunet.rules.yml" in written and "docs/metrics.md" in written
    assert len([w for w in written if w.startswith("grafana/")]) == 5
    for path in written:
        assert (root / path).read_bytes() == (REPO / path).read_bytes(), path
    assert run("--check", "--root", str(root)).returncode == 0


def test_the_check_names_each_stale_file(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    assert run("--root", str(root)).returncode == 0
    node = root / "grafana" / "gpunet-node.json"
    node.write_text(node.read_text().replace('"gpunet / Node"', '"gpunet / Node (old)"'))
    rule = root / "kubernetes/exporter/components/prometheusrule/prometheusrule.yaml"
    rule.write_text(rule.read_text().replace("for: 5m", "for: 6m", 1))
    (root / "alerts" / "gpunet.rules.yml").unlink()  # a missing file is stale too
    out = run("--check", "--root", str(root))
    assert out.returncode == 1
    named = sorted(line.split(": ")[1].split(" is stale")[0].removeprefix(str(root) + "/")
                   for line in out.stderr.splitlines())
    assert named == ["alerts/gpunet.rules.yml", "grafana/gpunet-node.json",
                     "kubernetes/exporter/components/prometheusrule/prometheusrule.yaml"]
    assert node.read_text().count("(old)") == 1  # --check writes nothing
    assert run("--root", str(root)).returncode == 0
    assert run("--check", "--root", str(root)).returncode == 0


def test_the_stale_panels_turn_red_where_the_alerts_fire() -> None:
    """Each age panel's red step is the threshold of its stale alert (GpunetProbeStale,
    GpunetFleetProbeStale, GpunetFabricSweepStale), not a number of its own."""
    t = thresholds.defaults()
    found = panels(dashboards.dashboards(t))
    for key, (section, name) in STALE_PANELS.items():
        assert red(found[key]) == [getattr(getattr(t, section), name)], key
    # The checker can fail: other thresholds move every one of them.
    moved = dataclasses.replace(
        t, probe=dataclasses.replace(t.probe, stale_seconds=1234),
        fleet=dataclasses.replace(t.fleet, stale_seconds=5678),
        fabric=dataclasses.replace(t.fabric, stale_seconds=4321))
    found = panels(dashboards.dashboards(moved))
    want = {"probe": [1234], "fleet": [5678], "fabric": [4321]}
    for key, (section, _) in STALE_PANELS.items():
        assert red(found[key]) == want[section], key


def test_a_thresholds_file_changes_rules_dashboards_and_the_prometheusrule(
        tmp_path: Path) -> None:
    root = checkout(tmp_path)
    f = tmp_path / "t.yml"
    f.write_text("probe: {stale_seconds: 1200, link_ratio: 0.7}\n"
                 "for: {GpunetProbeStale: 7m}\n")
    out = run("--root", str(root), "--thresholds", str(f))
    assert out.returncode == 0, out.stderr
    rules = yaml.safe_load((root / "alerts" / "gpunet.rules.yml").read_text())
    stale = next(r for g in rules["groups"] for r in g["rules"]
                 if r.get("alert") == "GpunetProbeStale")
    assert "> 1200" in stale["expr"] and stale["for"] == "7m"
    fleet = json.loads((root / "grafana" / "gpunet-fleet.json").read_text())
    found = panels({"gpunet-fleet.json": fleet})
    assert red(found[("gpunet-fleet.json", "Idle GPUs without a probe round")]) == [1200]
    assert ("gpunet-fleet.json", "Nodes below 70% of the link rate") in found
    configmap = (root / "kubernetes/exporter/components/dashboards/gpunet-fleet.yaml").read_text()
    assert "Nodes below 70% of the link rate" in configmap
    rule = yaml.safe_load(
        (root / "kubernetes/exporter/components/prometheusrule/prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == rules["groups"]
    # The committed files are the defaults: the check against them names these.
    out = run("--check", "--root", str(root))
    assert out.returncode == 1 and "gpunet-fleet.json is stale" in out.stderr


@pytest.mark.parametrize(("setup", "args", "message"), [
    (lambda root, tmp: (tmp / "t.yml").write_text("probe: {stale_seconds: -1}\n"),
     ["--thresholds", "{tmp}/t.yml"], "key 'probe.stale_seconds'"),
    (lambda root, tmp: None, ["--thresholds", "{tmp}/none.yml"], "cannot read"),
    (lambda root, tmp: (root / "docs" / "configuration.md").unlink(), [],
     "docs/configuration.md"),
    (lambda root, tmp: (root / "docs" / "configuration.md").write_text("no markers\n"), [],
     "markers of the generated table are missing"),
    (lambda root, tmp: (root / "kubernetes/exporter/base/config.yml").unlink(), [],
     "base/config.yml"),
    (lambda root, tmp: None, ["--root", "{tmp}/nowhere"], "not a directory"),
])
def test_bad_input_is_one_line(tmp_path: Path, setup: Any, args: list[str],
                               message: str) -> None:
    root = checkout(tmp_path)
    setup(root, tmp_path)
    argv = ["--root", str(root), *(a.format(tmp=tmp_path) for a in args)]
    out = run(*argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("gpunet-mixin: ") and message in lines[0]
    assert not (root / "alerts").exists()  # nothing written


def texts(t: thresholds.Thresholds) -> tuple[str, str]:
    """Every panel description, and every query, of the dashboards built with ``t``."""
    found = panels(dashboards.dashboards(t)).values()
    return ("\n".join(p.get("description", "") for p in found),
            "\n".join(q.get("expr", "") for p in found for q in p.get("targets", [])))


def test_the_descriptions_name_the_thresholds_in_force() -> None:
    """A description that names an alert's `for:` duration, or a threshold its query compares
    with, writes the thresholds in force; the straggler naming share is the probe's own
    default (run_options), not a number of the dashboards."""
    t = thresholds.defaults(ALERT_NAMES)
    described, queries = texts(t)
    assert "for 10 minutes fires GpunetStragglerRank" in described
    assert "GpunetBusBandwidthBelowLinkRate after 10 minutes" in described
    assert "for 5 minutes fires GpunetFleetCrossLeafSlow" in described
    assert "wait at least probe.straggler_min_ratio (20%)" in described
    assert run_options.default("straggler_min_ratio") == 0.2
    assert "< 0.8" in queries and "> 0.5" in queries
    # The checker can fail: other thresholds move every one of them.
    moved = dataclasses.replace(
        t, probe=dataclasses.replace(t.probe, link_ratio=0.65, straggler_wait_ratio=0.35,
                                     bus_bandwidth_ratio=0.55),
        durations={"GpunetStragglerRank": "1h30m", "GpunetBusBandwidthBelowLinkRate": "25m",
                   "GpunetFleetCrossLeafSlow": "2h"})
    described, queries = texts(moved)
    assert not re.search(r"\b(10|5) minutes", described)
    assert described.count("for 1 hour 30 minutes fires GpunetStragglerRank") == 2
    assert described.count("GpunetBusBandwidthBelowLinkRate after 25 minutes") == 2
    assert described.count("for 25 minutes fires GpunetBusBandwidthBelowLinkRate") == 2
    assert "for 2 hours fires GpunetFleetCrossLeafSlow" in described
    assert "more than 35% of their all-reduce time" in described
    assert "Below 55%: that node is slower than its peers" in described
    assert "< 0.8" not in queries and "> 0.5" not in queries
    assert "< 0.65" in queries and "> 0.35" in queries


def test_durations_in_words() -> None:
    assert [duration_words(d) for d in ("10m", "1h30m", "1m", "90s", "2d", "500ms")] == [
        "10 minutes", "1 hour 30 minutes", "1 minute", "90 seconds", "2 days",
        "500 milliseconds"]
