"""alerts/: the generated rule file, its promtool unit tests, the thresholds that drive it, the
Alertmanager example and the runbooks. The end-to-end run with a real Prometheus and
Alertmanager is tests/test_alerts_e2e.py."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunet_exporter.mixin import promql, rules, thresholds
from gpunet_exporter.mixin.alerts import MODULES

from support.paths import REPO

ALERTS_DIR = REPO / "alerts"
RULES = ALERTS_DIR / "gpunet.rules.yml"
# promtool unit tests, one file per class of alerts (and one of the health matrix), each naming
# ../gpunet.rules.yml.
RULE_TESTS = sorted((ALERTS_DIR / "tests").glob("*.test.yml"))


class _CaseLoader(yaml.SafeLoader):
    """YAML as promtool reads the test files: PyYAML's YAML 1.1 takes `values: 0x20` (0, 20
    times) for the hex number 32, and `1:30` for 90; promtool's YAML keeps them as text. Only
    plain decimal integers are numbers here, so cases written back out mean the same."""


def _int_or_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int | str:
    text = loader.construct_scalar(node)
    assert isinstance(text, str)
    return int(text) if re.fullmatch(r"[-+]?(0|[1-9][0-9]*)", text) else text


_CaseLoader.add_constructor("tag:yaml.org,2002:int", _int_or_text)


def rule_test_cases() -> list[dict[str, Any]]:
    """Every promtool test case of every file, as promtool reads it."""
    return [case for path in RULE_TESTS
            for case in yaml.load(path.read_text(), Loader=_CaseLoader)["tests"]]
AM_CONFIG = ALERTS_DIR / "alertmanager.yml"
RUNBOOKS = REPO / "docs" / "runbooks.md"


def tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is required (Debian's prometheus / prometheus-alertmanager packages)"
    return path


def run_rules(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpunet_exporter.mixin.rules", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def documented_metrics() -> set[str]:
    text = (REPO / "docs" / "metrics.md").read_text()
    return set(re.findall(r"^\| `(gpunet_[a-z0-9_]+)` \|", text, re.M))


def rule_list(path: Path = RULES) -> list[dict[str, Any]]:
    doc = yaml.safe_load(path.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def promtool_test(tmp_path: Path, rules_text: str, tests: list[dict[str, Any]]) -> str:
    """Run `promtool test rules` on ``tests`` against ``rules_text``; returns its output, and
    raises AssertionError when it fails."""
    (tmp_path / "r.yml").write_text(rules_text)
    (tmp_path / "t.yml").write_text(yaml.safe_dump(
        {"rule_files": ["r.yml"], "evaluation_interval": "1m", "tests": tests}))
    out = subprocess.run([tool("promtool"), "test", "rules", "t.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# -- the rule file --------------------------------------------------------------------------


def test_rule_file_is_generated_from_the_defaults() -> None:
    out = run_rules("--check", str(RULES))
    assert out.returncode == 0, (
        f"{out.stderr}alerts/gpunet.rules.yml is stale: run "
        "`python -m gpunet_exporter.mixin`")
    assert RULES.read_text() == rules.render(thresholds.defaults(rules.ALERT_NAMES))


def test_check_detects_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "rules.yml"
    stale.write_text(RULES.read_text().replace("> 120", "> 121"))
    out = run_rules("--check", str(stale))
    assert out.returncode == 1 and "stale" in out.stderr


def test_check_reads_only_a_regular_file(tmp_path: Path) -> None:
    """--check never blocks on a FIFO nor reads a device; a file that is not UTF-8 is stale, not
    a traceback; line endings are read as open() reads text (CRLF is the same file)."""
    os.mkfifo(tmp_path / "fifo")
    for path, problem in ((tmp_path / "fifo", "a FIFO, not a regular file"),
                          (Path("/dev/zero"), "a character device, not a regular file"),
                          (tmp_path, "a directory, not a regular file")):
        out = run_rules("--check", str(path))  # its timeout guards against a hang
        assert out.returncode == 2
        assert out.stderr == f"gpunet-rules: cannot read {path}: {problem}\n"
    binary = tmp_path / "binary.yml"
    binary.write_bytes(b"\xff" + RULES.read_bytes())
    out = run_rules("--check", str(binary))
    assert out.returncode == 1 and "stale" in out.stderr and "Traceback" not in out.stderr
    crlf = tmp_path / "crlf.yml"
    crlf.write_bytes(RULES.read_bytes().replace(b"\n", b"\r\n"))
    assert run_rules("--check", str(crlf)).returncode == 0


def test_promtool_check_rules() -> None:
    out = subprocess.run([tool("promtool"), "check", "rules", str(RULES)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rule_list())} rules found" in out.stdout


def test_promtool_unit_tests_pass(tmp_path: Path) -> None:
    """Every case of alerts/tests passes: run per class (by_class), as promtool would judge the
    shipped files (`promtool test rules alerts/tests/*.test.yml`, 26 s of CPU; so, 8 s)."""
    files = by_class(yaml.safe_load(RULES.read_text()), rule_test_cases(), tmp_path)
    out = subprocess.run([tool("promtool"), "test", "rules", *files], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert out.stdout.count("SUCCESS") == len(files)


def test_the_unit_tests_are_split_by_class() -> None:
    """One file per module of mixin/alerts (and the health matrix's), each reading the rule
    file; an alert's cases sit in the file of the module that declares it."""
    assert sorted(p.name for p in RULE_TESTS) == sorted(
        f"{c}.test.yml" for c in (*rules.CLASSES, "health"))
    owner = {a.name: m.__name__.rpartition(".")[2] for m in MODULES for a in m.ALERTS}
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        # by_class below runs the cases as these files say: one rule file, 1m between steps.
        assert doc.keys() == {"rule_files", "evaluation_interval", "tests"}, path
        assert doc["rule_files"] == ["../gpunet.rules.yml"], path
        assert doc["evaluation_interval"] == "1m", path
        for case in doc["tests"]:
            for a in case.get("alert_rule_test", []):
                assert f"{owner[a['alertname']]}.test.yml" == path.name, (path, case["name"])


def test_every_alert_has_a_firing_and_a_silent_unit_test() -> None:
    firing: set[str] = set()
    silent: set[str] = set()
    for t in rule_test_cases():
        for a in t.get("alert_rule_test", []):
            (firing if a["exp_alerts"] else silent).add(a["alertname"])
            for exp in a["exp_alerts"]:  # each expectation spells out the whole notification
                assert set(exp["exp_annotations"]) == {"summary", "description", "runbook_url"}
    names = set(rules.ALERT_NAMES)
    assert names - firing == set(), "alerts without a firing test"
    assert names - silent == set(), "alerts without a not-firing test"
    assert (firing | silent) <= names


def test_unit_tests_bite_when_a_threshold_moves(tmp_path: Path) -> None:
    """The shipped unit tests fail against rules generated with another threshold: they check
    the numbers, not just that something fires."""
    (tmp_path / "t.yml").write_text("infiniband: {symbol_errors_per_hour: 200}\n")
    moved = rules.render(thresholds.load(str(tmp_path / "t.yml"), rules.ALERT_NAMES))
    (tmp_path / "gpunet.rules.yml").write_text(moved)
    budget = {"GpunetPortSymbolErrors", "GpunetFabricPortSymbolErrors"}
    cases = [c for c in rule_test_cases()
             if budget & {a["alertname"] for a in c.get("alert_rule_test", [])}]
    (tmp_path / "t.yml").write_text(yaml.safe_dump(
        {"rule_files": ["gpunet.rules.yml"], "evaluation_interval": "1m", "tests": cases}))
    out = subprocess.run([tool("promtool"), "test", "rules", "t.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "GpunetPortSymbolErrors: fires" in out.stdout + out.stderr
    # A switch port is judged by the same budget as the host end of its cable.
    assert "GpunetFabricPortSymbolErrors: fires" in out.stdout + out.stderr


# Alerts about a leaf switch's uplinks, aggregated over the leaf's nodes: labelled by `leaf`, not
# `instance`.
LEAF_ALERTS = {"GpunetFleetCrossLeafSlow"}

def test_alerts_are_well_formed() -> None:
    """Names, severities, classes, `for:`, a static summary, a templated description naming
    the node, and a runbook section for every alert."""
    runbook = RUNBOOKS.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", runbook, re.M)}
    alerts = [r for r in rule_list() if "alert" in r]
    assert len(alerts) == len(rules.ALERTS) == len(set(rules.ALERT_NAMES))
    for r in alerts:
        name = r["alert"]
        assert re.fullmatch(r"Gpunet[A-Z][A-Za-z]+", name)
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["labels"]["class"] in rules.CLASSES
        assert re.fullmatch(r"\d+[smh]", r["for"])
        ann = r["annotations"]
        assert "{{" not in ann["summary"], name
        # A leaf-level alert names its leaf: no one node is at fault (see LEAF_ALERTS).
        where = "{{ $labels.leaf }}" if name in LEAF_ALERTS else "{{ $labels.instance }}"
        assert where in ann["description"], name
        assert "$value" in ann["description"] or name in (
            "GpunetPortCounterSaturated", "GpunetNcclSocketFallback", "GpunetGdrInactive",
            "GpunetGdrNotReady", "GpunetGpuNicNumaMismatch", "GpunetGpuPcieLinkDegraded",
            "GpunetGpuLost", "GpunetNvmlDown", "GpunetProbeFailing", "GpunetProbeIdleUnknown",
            "GpunetCollectorFailing", "GpunetCheckUnknown",
            "GpunetExporterDown", "GpunetPauseStorm", "GpunetPfcDisabledOnRocePriority",
            "GpunetPfcTrustNotExpected", "GpunetFabricSweepFailing",
            "GpunetGpuFabricNotReady", "GpunetGpuFabricUnhealthy", "GpunetGdrPeermemOnly",
            "GpunetNicHealthReporterError"), (
            f"{name}: the description should show the value")
        url = ann["runbook_url"]
        assert url.startswith(thresholds.defaults().runbook_url + "#")
        assert url.split("#")[1] in anchors, f"{name}: no section in docs/runbooks.md"
    assert {r["labels"]["severity"] for r in alerts} >= {"critical", "warning"}


def test_recording_rules_follow_level_metric_operations() -> None:
    for r in rule_list():
        if "record" in r:
            assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", r["record"]), r["record"]


def test_rules_use_only_metrics_the_exporter_exposes() -> None:
    known = documented_metrics()
    assert len(known) > 200
    recorded = {r["record"] for r in rule_list() if "record" in r}
    used: set[str] = set()
    for r in rule_list():
        expr = re.sub(r'"[^"]*"', '""', r["expr"])  # label values and label_replace arguments
        used.update(re.findall(r"\b(gpunet_[a-z0-9_]+|[a-z_]+:[a-z_]+:[a-z0-9_]+)\b", expr))
    unknown = {n for n in used if n not in known and n not in recorded}
    assert not unknown, f"rules use metrics the exporter does not expose: {sorted(unknown)}"
    assert len(used - recorded) > 40


def test_metric_check_catches_a_misspelt_name() -> None:
    known = documented_metrics()
    assert "gpunet_infiniband_port_state_id" in known
    assert "gpunet_infiniband_port_state" not in known


# -- thresholds -----------------------------------------------------------------------------


def test_thresholds_override_one_place(tmp_path: Path) -> None:
    f = tmp_path / "thresholds.yml"
    f.write_text("pfc: {roce_priority: 5, trust: pcp}\njob: gpu-nodes\n"
                 "for: {GpunetPortRateBelowExpected: 15m}\n"
                 "probe: {expected_bus_bandwidth_bytes_per_second: {inter: 3.2e11}}\n"
                 "fabric: {uplink_imbalance_ratio: 0.5}\n")
    out = run_rules("--thresholds", str(f))
    assert out.returncode == 0, out.stderr
    by_name = {r.get("alert") or r["record"]: r for r in
               (r for g in yaml.safe_load(out.stdout)["groups"] for r in g["rules"])}
    assert 'priority="5"' in by_name["GpunetPfcDisabledOnRocePriority"]["expr"]
    assert 'trust!="pcp"' in by_name["GpunetPfcTrustNotExpected"]["expr"]
    assert by_name["GpunetPortRateBelowExpected"]["for"] == "15m"
    assert by_name["GpunetPortDown"]["for"] == "2m"  # the rest keep theirs
    assert 'up{job="gpu-nodes"}' in by_name["GpunetExporterDown"]["expr"]
    busbw = by_name["GpunetBusBandwidthLow"]["expr"]
    assert 'scope="inter"} < 0.8 * 320000000000' in busbw
    assert 'scope=~"intra|net"' in busbw  # intra and net still compare with the fleet median
    # Unchanged values stay the defaults.
    assert "> 120" in by_name["GpunetPortSymbolErrors"]["expr"]
    assert "gpunet_fabric_leaf_uplink_imbalance_ratio > 0.5" in by_name[
        "GpunetFabricUplinkImbalance"]["expr"]
    assert by_name["GpunetFabricSweepStale"]["expr"].endswith("> 900")


def test_configured_expected_bandwidth_fires_below_80_percent(tmp_path: Path) -> None:
    f = tmp_path / "thresholds.yml"
    f.write_text("probe: {expected_bus_bandwidth_bytes_per_second: {inter: 1.0e11}}\n")
    text = rules.render(thresholds.load(str(f), rules.ALERT_NAMES))
    bw = ('gpunet_probe_allreduce_bus_bandwidth_bytes_per_second{instance="%s", job="gpunet", '
          'scope="inter", size="67108864"}')
    promtool_test(tmp_path, text, [{
        "interval": "1m",
        "input_series": [{"series": bw % "slow", "values": "70000000000x20"},
                         {"series": bw % "fine", "values": "90000000000x20"}],
        "alert_rule_test": [{"eval_time": "15m", "alertname": "GpunetBusBandwidthLow",
                             "exp_alerts": [{"exp_labels": {
                                 "severity": "warning", "class": "collective", "scope": "inter",
                                 "size": "67108864", "instance": "slow", "job": "gpunet"},
                                 "exp_annotations": {
                                     "summary": "All-reduce bus bandwidth below the expected",
                                     "description": "The 67108864-byte all-reduce reaches 70GB/s"
                                     " bus bandwidth (inter probe) on slow, below the "
                                     "expected.",
                                     "runbook_url": thresholds.defaults().runbook_url
                                     + "#gpunetbusbandwidthlow"}}]}]}])


@pytest.mark.parametrize(("content", "message"), [
    ("pfc: {roce_prio: 3}\n", "key 'pfc.roce_prio': unknown key"),
    ("pfc: {roce_priority: three}\n", "key 'pfc.roce_priority': expected an integer"),
    ("for: {GpunetPortDown: soon}\n", "key 'for.GpunetPortDown': expected a Prometheus duration"),
    ("for: {GpunetNoSuchAlert: 5m}\n", "key 'for.GpunetNoSuchAlert': unknown key"),
    ("probe: {variation_window: 30}\n", "key 'probe.variation_window': expected a string"),
    ("pfc: [\n", "invalid YAML at line"),
    ("pfc: {trust: vlan}\n", "expected one of dscp, pcp"),
    # Checked for meaning: each of these would silently turn an alert off or leave it always on.
    ("pfc: {roce_priority: 9}\n", "key 'pfc.roce_priority': expected a value from 0 to 7, got 9"),
    ("pfc: {roce_priority: -1}\n", "key 'pfc.roce_priority': expected a value from 0 to 7"),
    ("gpu: {busy_utilization_ratio: 50}\n",
     "key 'gpu.busy_utilization_ratio': expected a value from 0 to 1, got 50"),
    ("pfc: {pause_ratio: 1.5}\n", "key 'pfc.pause_ratio': expected a value from 0 to 1"),
    ("probe: {bus_bandwidth_ratio: -0.2}\n", "key 'probe.bus_bandwidth_ratio': expected a value "
     "from 0 to 1"),
    ("probe: {variation_ratio: 10}\n", "key 'probe.variation_ratio': expected a value from 0 to 1"),
    ("infiniband: {link_downed_count: -2}\n", "key 'infiniband.link_downed_count': expected a "
     "value >= 1, got -2"),
    ("infiniband: {symbol_errors_per_hour: -5}\n", "key 'infiniband.symbol_errors_per_hour': "
     "expected a value >= 0, got -5"),
    ("pfc: {cnp_handled_per_second: -1}\n", "key 'pfc.cnp_handled_per_second': expected a value "
     ">= 0"),
    ("link: {roce_min_mtu_bytes: 0}\n", "key 'link.roce_min_mtu_bytes': expected a value >= 68"),
    ("probe: {latency_seconds: 0}\n", "key 'probe.latency_seconds': expected a value >= 1e-06"),
    ("probe: {stale_seconds: 0}\n", "key 'probe.stale_seconds': expected a value >= 1"),
    ("probe: {bandwidth_size_bytes: 1000001}\n", "key 'probe.bandwidth_size_bytes': expected a "
     "multiple of 4"),
    ("probe: {variation_window: 0m}\n", "key 'probe.variation_window': expected a window longer "
     "than 0"),
    ("gpu: {critical_xids: [79, 0]}\n", "key 'gpu.critical_xids[1]': expected a value >= 1"),
    ("fabric: {uplink_imbalance_ratio: -0.2}\n", "key 'fabric.uplink_imbalance_ratio': expected "
     "a value >= 0, got -0.2"),
    ("fabric: {stale_seconds: 0}\n", "key 'fabric.stale_seconds': expected a value >= 1"),
    # Per-alert overrides: alert names and values checked as `for:`'s are.
    ("enabled: {GpunetNoSuchAlert: false}\n", "key 'enabled.GpunetNoSuchAlert': unknown key"),
    ("enabled: {GpunetPortDown: off-ish}\n", "key 'enabled.GpunetPortDown': expected true or "
     "false"),
    ("severity: {GpunetNoSuchAlert: info}\n", "key 'severity.GpunetNoSuchAlert': unknown key"),
    ("severity: {GpunetPortDown: page}\n", "key 'severity.GpunetPortDown': expected one of "
     "critical, warning, info, got 'page'"),
    ("severity: [GpunetPortDown]\n", "key 'severity': expected a mapping"),
    ("cluster: ''\n", "key 'cluster': expected a label value, got ''"),
    ("cluster: {name: a}\n", "key 'cluster': expected a string"),
    ("selector: env=prod\n", "key 'selector': expected label matchers such as env=\"prod\", "
     "cluster=~\"a|b\", got 'env=prod'"),
    ("selector: 'env=\"a\"} or vector(1) # '\n", "key 'selector': expected label matchers"),
    ("multi_cluster: maybe\n", "key 'multi_cluster': expected true or false"),
])
def test_bad_thresholds_file_one_line_exit_2(tmp_path: Path, content: str, message: str) -> None:
    f = tmp_path / "t.yml"
    f.write_text(content)
    out = run_rules("--thresholds", str(f))
    assert out.returncode == 2
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert lines[0].startswith(f"gpunet-rules: thresholds file '{f}': ")
    assert message in lines[0]


# -- per-alert overrides: job, enabled, severity, cluster, selector ---------------------------

# The selector lets through the shipped cases' series, which have no env label.
SELECTOR = 'env!="staging"'
OVERRIDES = ("job: gpu-nodes\ncluster: prod-a\nenabled: {GpunetPortDown: false}\n"
             "severity: {GpunetPortSymbolErrors: critical, GpunetGpuLost: warning}\n"
             f"selector: '{SELECTOR}'\n")


def test_overrides_shape_the_rules(tmp_path: Path) -> None:
    """A disabled alert is left out, a severity replaced, the job in every `up{}`, the
    selector on every selector of the exporters' series and the cluster label on every rule;
    everything else as the defaults have it."""
    (tmp_path / "t.yml").write_text(OVERRIDES)
    t = thresholds.load(str(tmp_path / "t.yml"), rules.ALERT_NAMES)
    assert not t.enabled("GpunetPortDown") and t.enabled("GpunetPortFlapping")
    text = rules.render(t)
    doc = yaml.safe_load(text)
    every = [r for g in doc["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in every if "alert" in r}
    assert set(alerts) == set(rules.ALERT_NAMES) - {"GpunetPortDown"}
    assert alerts["GpunetPortSymbolErrors"]["labels"]["severity"] == "critical"
    assert alerts["GpunetGpuLost"]["labels"]["severity"] == "warning"
    assert alerts["GpunetPortFlapping"]["labels"]["severity"] == "warning"
    assert all(r["labels"]["cluster"] == "prod-a" for r in every)
    assert 'job="gpunet"' not in text and text.count(f'up{{job="gpu-nodes", {SELECTOR}}}') == (
        1 + len(rules.CLASSES))
    read = [sel for r in every for sel in promql.selectors(r["expr"])]
    own = [sel for sel in read if promql.exporter_series(sel)]
    assert len(own) > len(rules.ALERT_NAMES)
    assert all(sel.matchers.endswith(SELECTOR) for sel in own), [
        sel for sel in own if not sel.matchers.endswith(SELECTOR)]
    assert not any(SELECTOR in sel.matchers for sel in read if sel not in own)
    # The defaults: no cluster label, every alert, the built-in severities.
    default = rules.rule_groups(thresholds.defaults(rules.ALERT_NAMES))
    assert not any("cluster" in r.get("labels", {})
                   for g in default["groups"] for r in g["rules"])


def overridden_cases(job: str, disabled: set[str], severity: dict[str, str],
                     cluster: str) -> list[dict[str, Any]]:
    """The shipped promtool cases as rules generated with these overrides must pass them: the
    job renamed in the input series and expected labels, the disabled alerts' expectations
    left out, the changed severities and the cluster label expected, on the alerts and on the
    recorded series."""
    recorded = {r["record"] for r in rule_list() if "record" in r}
    old = 'job="gpunet"'
    new = f'job="{job}"'
    out = []
    for case in copy.deepcopy(rule_test_cases()):
        for series in case.get("input_series", []):
            series["series"] = series["series"].replace(old, new)
        kept = [a for a in case.get("alert_rule_test", []) if a["alertname"] not in disabled]
        for a in kept:
            for exp in a["exp_alerts"]:
                labels = exp["exp_labels"]
                if labels.get("job") == "gpunet":
                    labels["job"] = job
                labels["severity"] = severity.get(a["alertname"], labels["severity"])
                labels["cluster"] = cluster
        case["alert_rule_test"] = kept
        for expr in case.get("promql_expr_test", []):
            expr["expr"] = expr["expr"].replace(old, new)
            for sample in expr["exp_samples"]:
                text = sample["labels"].replace(old, new)
                name, _, rest = text.partition("{")
                if name in recorded:
                    body = rest.removesuffix("}")
                    text = f'{name}{{{body + ", " if body else ""}cluster="{cluster}"}}'
                sample["labels"] = text
        if case["alert_rule_test"] or case.get("promql_expr_test"):
            out.append(case)
    return out


def by_class(doc: dict[str, Any], cases: list[dict[str, Any]], where: Path) -> list[str]:
    """``cases`` as promtool test files in ``where``, one per set of alert classes their alert
    expectations name, each reading a copy of the rule file ``doc`` with only the alerts of
    those classes and the recording rules that they or the cases' expressions read; cases
    without alert expectations (the recorded series of ALERTS) read all of it. promtool
    evaluates every rule of its file at every step of every case: 26 s of CPU for the shipped
    cases with the whole file each, 5 s so. Each alert is judged as with the whole file, since
    no alert's expression reads another's (ALERTS), asserted here."""
    every = [r for g in doc["groups"] for r in g["rules"]]
    assert all("ALERTS" not in r["expr"] for r in every if "alert" in r)
    records = {r["record"]: r["expr"] for r in every if "record" in r}

    def read_by(exprs: list[str]) -> set[str]:
        """The recorded series ``exprs`` read, directly or through other recording rules."""
        out: set[str] = set()
        todo = list(exprs)
        while todo:
            text = todo.pop()
            for name in records.keys() - out:
                if re.search(rf"(?<![\w:]){re.escape(name)}(?![\w:])", text):
                    out.add(name)
                    todo.append(records[name])
        return out

    cls = {a.name: a.cls for a in rules.ALERTS}
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for c in cases:
        key = tuple(sorted({cls[a["alertname"]] for a in c.get("alert_rule_test", [])}))
        groups.setdefault(key, []).append(c)
    files = []
    for key, group in groups.items():
        name = "-".join(key) or "all"
        alerts = {a["alertname"] for c in group for a in c.get("alert_rule_test", [])}
        needed = alerts | read_by([r["expr"] for r in every if r.get("alert") in alerts]
                                  + [e["expr"] for c in group
                                     for e in c.get("promql_expr_test", [])])
        part = {"groups": [g | {"rules": [r for r in g["rules"] if not key
                                          or r.get("alert", r.get("record")) in needed]}
                           for g in doc["groups"]]}
        (where / f"r-{name}.yml").write_text(yaml.safe_dump(part))
        (where / f"t-{name}.yml").write_text(yaml.safe_dump(
            {"rule_files": [f"r-{name}.yml"], "evaluation_interval": "1m", "tests": group}))
        files.append(f"t-{name}.yml")
    return files


def test_overridden_rules_pass_promtool(tmp_path: Path) -> None:
    """Rules generated with another job, an alert off, two severities changed and a cluster
    label: `promtool check rules` accepts them, and the shipped unit tests of the alerts left
    pass against them (adjusted as overridden_cases says); the disabled alert is gone."""
    (tmp_path / "t.yml").write_text(OVERRIDES)
    out = run_rules("--thresholds", str(tmp_path / "t.yml"), "-o", str(tmp_path / "r.yml"))
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "r.yml").read_text()
    check = subprocess.run([tool("promtool"), "check", "rules", "r.yml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(rule_list()) - 1} rules found" in check.stdout
    cases = overridden_cases("gpu-nodes", {"GpunetPortDown"},
                             {"GpunetPortSymbolErrors": "critical", "GpunetGpuLost": "warning"},
                             "prod-a")
    names = {a["alertname"] for c in cases for a in c["alert_rule_test"]}
    assert names == set(rules.ALERT_NAMES) - {"GpunetPortDown"}
    files = by_class(yaml.safe_load(text), cases, tmp_path)
    test = subprocess.run([tool("promtool"), "test", "rules", *files], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert test.returncode == 0, (test.stdout + test.stderr)[-4000:]
    assert test.stdout.count("SUCCESS") == len(files)
    # The unchanged expectations bite: the shipped cases of the disabled alert fail.
    (tmp_path / "t.yml").write_text(yaml.safe_dump(
        {"rule_files": ["r.yml"], "evaluation_interval": "1m", "tests": [
            c for c in rule_test_cases() if any(a["alertname"] == "GpunetPortDown"
                                                for a in c.get("alert_rule_test", []))]}))
    test = subprocess.run([tool("promtool"), "test", "rules", "t.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert test.returncode != 0
    assert text.count("cluster: prod-a") == len(rule_list()) - 1
    # The selector bites: the symbol-error cases' series on a staging node alert no more.
    staged = [c for c in cases if any(a["alertname"] == "GpunetPortSymbolErrors"
                                      and a["exp_alerts"] for a in c["alert_rule_test"])]
    assert staged
    for case in staged:
        for series in case.get("input_series", []):
            name, brace, rest = series["series"].partition("{")
            series["series"] = (f'{name}{{env="staging", {rest}' if brace
                                else f'{name}{{env="staging"}}')
    (tmp_path / "t.yml").write_text(yaml.safe_dump(
        {"rule_files": ["r.yml"], "evaluation_interval": "1m", "tests": staged}))
    test = subprocess.run([tool("promtool"), "test", "rules", "t.yml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert test.returncode != 0 and "GpunetPortSymbolErrors" in test.stdout + test.stderr


def test_values_at_the_bounds_are_accepted(tmp_path: Path) -> None:
    f = tmp_path / "t.yml"
    f.write_text("pfc: {roce_priority: 7, pause_ratio: 1}\ngpu: {busy_utilization_ratio: 0}\n"
                 "probe: {straggler_wait_ratio: 0.3}\nfor: {GpunetPortDown: 0s}\n")
    t = thresholds.load(str(f), rules.ALERT_NAMES)
    assert t.pfc.roce_priority == 7 and t.probe.straggler_wait_ratio == 0.3


def test_missing_thresholds_file(tmp_path: Path) -> None:
    out = run_rules("--thresholds", str(tmp_path / "nope.yml"))
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_output_file(tmp_path: Path) -> None:
    out = run_rules("-o", str(tmp_path / "r.yml"))
    assert out.returncode == 0 and out.stdout == ""
    assert (tmp_path / "r.yml").read_text() == RULES.read_text()


def test_every_threshold_is_documented_in_the_runbooks() -> None:
    """docs/runbooks.md has the thresholds table with every key and its default."""
    text = RUNBOOKS.read_text()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
            return
        if prefix in ("for", "runbook_url", "job", "cluster", "selector", "multi_cluster"):
            return
        assert f"`{prefix}`" in text, f"threshold {prefix} is not in docs/runbooks.md"

    walk("", thresholds.as_dict(thresholds.defaults()))


# -- dcgm-exporter's series ------------------------------------------------------------------


def shipped_queries() -> list[str]:
    """Every PromQL expression shipped: the rules' and the dashboards' (the generated files)."""
    exprs = [r["expr"] for r in rule_list()]

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            exprs.extend(v for k, v in node.items() if k in ("expr", "query")
                         and isinstance(v, str))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    for dash in sorted((REPO / "grafana").glob("*.json")):
        walk(json.loads(dash.read_text()))
    return exprs


def test_nothing_shipped_reads_dcgm_series() -> None:
    """What docs/reading-metrics.md promises: no rule or dashboard query selects dcgm-exporter's
    series or names its node label, in either spelling (it went from `Hostname` to
    `hostname`). A query that starts to must join on the UUID, as the doc shows."""
    exprs = shipped_queries()
    assert len(exprs) > 200  # the rules and the dashboards were read
    for expr in exprs:
        names = {s.name for s in promql.selectors(expr)}
        assert not {n for n in names if n.startswith("DCGM_")}, expr
        idents = {t.text for t in promql.tokens(expr) if t.kind == "ident"}
        assert not idents & {"Hostname", "hostname"}, expr


def test_documented_dcgm_join_accepts_both_label_spellings(tmp_path: Path) -> None:
    """The doc's join of DCGM series with gpunet_gpu_info, through promtool: series of a
    dcgm-exporter that says `Hostname` and of one that says `hostname` both get the GPU's PCI
    address and NUMA node, with their own labels kept."""
    text = (REPO / "docs" / "reading-metrics.md").read_text()
    expr = re.search(r"<!-- dcgm-join -->\n```promql\n(.*?)```", text, re.S)
    assert expr, "the dcgm-join block of docs/reading-metrics.md"
    rules_text = yaml.safe_dump({"groups": [{"name": "join", "rules": [
        {"record": "dcgm:gpu_util:joined", "expr": expr.group(1)}]}]})
    info = 'gpunet_gpu_info{{instance="{n}:9808",gpu="0",uuid="{u}",pci_address="{p}",' \
        'numa_node="1",name="H100",driver_version="580.159.04"}}'
    series = [
        {"series": info.format(n="a", u="GPU-a", p="0000:1b:00.0"), "values": "1x5"},
        {"series": info.format(n="b", u="GPU-b", p="0000:43:00.0"), "values": "1x5"},
        {"series": 'DCGM_FI_DEV_GPU_UTIL{instance="a:9400",gpu="0",UUID="GPU-a",'
                   'Hostname="a"}', "values": "97x5"},
        {"series": 'DCGM_FI_DEV_GPU_UTIL{instance="b:9400",gpu="0",UUID="GPU-b",'
                   'hostname="b"}', "values": "22x5"}]
    promtool_test(tmp_path, rules_text, [{"interval": "1m", "input_series": series,
                                         "promql_expr_test": [{
        "expr": "dcgm:gpu_util:joined", "eval_time": "2m", "exp_samples": [
            {"labels": 'dcgm:gpu_util:joined{instance="a:9400",gpu="0",UUID="GPU-a",'
                       'Hostname="a",pci_address="0000:1b:00.0",numa_node="1"}', "value": 97},
            {"labels": 'dcgm:gpu_util:joined{instance="b:9400",gpu="0",UUID="GPU-b",'
                       'hostname="b",pci_address="0000:43:00.0",numa_node="1"}',
             "value": 22}]}]}])


# -- Alertmanager example ---------------------------------------------------------------------


def test_amtool_checks_the_example() -> None:
    out = subprocess.run([tool("amtool"), "check-config", str(AM_CONFIG)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "12 inhibit rules" in out.stdout


@pytest.mark.parametrize(("labels", "receiver"), [
    (["severity=critical", "alertname=GpunetGdrNotReady"], "pager"),
    (["severity=warning", "alertname=GpunetPortSymbolErrors"], "ticket"),
    (["severity=info"], "none"),
    (["alertname=Unlabelled"], "ticket"),
])
def test_routing_tree(labels: list[str], receiver: str) -> None:
    out = subprocess.run([tool("amtool"), "config", "routes", "test",
                          f"--config.file={AM_CONFIG}", *labels],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == receiver, out.stdout + out.stderr


SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}
# Labels every alert has from its series or the rule file: an `equal` of them needs no check.
COMMON_LABELS = {"instance", "job"}


def metric_labels() -> dict[str, set[str]]:
    """Metric name -> its labels, from the table of docs/metrics.md."""
    text = (REPO / "docs" / "metrics.md").read_text()
    return {name: set(re.findall(r"`(\w+)`", labels)) for name, labels in re.findall(
        r"^\| `(gpunet_[a-z0-9_]+)` \| \w+ \| [^|]* \| ([^|]*) \|", text, re.M)}


def carries(expr: str, label: str, labels: dict[str, set[str]]) -> bool:
    """Whether an alert of ``expr`` can carry ``label``: a metric it reads has it, or the
    expression names it (a join's group_left, a label_replace, a by clause). A metric read only
    as the other side of a group_left or group_right join gives only the labels listed there."""
    if re.search(rf"\b{label}\b", expr):
        return True
    read = re.findall(r"gpunet_[a-z0-9_]+", expr)
    joined = re.findall(r"group_(?:left|right)\s*\([^)]*\)\s*(gpunet_[a-z0-9_]+)", expr)
    return any(label in labels.get(m, set()) for m in read if read.count(m) > joined.count(m))


def inhibition_problems(am: dict[str, Any], exprs: dict[str, str]) -> list[str]:
    """What is wrong with the inhibition rules of Alertmanager config ``am`` against the alerts
    ``exprs`` (name -> expression): an alert-name matcher, or an alternative of its regex, that
    names no alert (a renamed alert would silently stop being inhibited); a label matcher or an
    `equal` label that an alert the rule selects does not carry (its expression does not name
    it: the rule could never apply); a target more severe than a source."""
    problems: list[str] = []
    names = set(exprs)
    labels = metric_labels()
    severities = {a.name: a.severity for a in rules.ALERTS}
    for i, rule in enumerate(am["inhibit_rules"]):
        selected: dict[str, set[str]] = {}
        for key in ("source_matchers", "target_matchers"):
            others = []
            for m in rule[key]:
                label, op, value = re.fullmatch(r'(\w+)(=~|=)"(.*)"', m).groups()  # type: ignore[union-attr]
                if label != "alertname":
                    others.append(label)
                    continue
                pattern = re.compile(value if op == "=~" else re.escape(value))
                selected[key] = {n for n in names if pattern.fullmatch(n)}
                if not selected[key]:
                    problems.append(f"rule {i}: {m} matches no alert")
                if op == "=~":
                    problems += [f"rule {i}: {alt} in {m} names no alert"
                                 for alt in _alternatives(value)
                                 if not any(re.fullmatch(alt, n) for n in names)]
            for label in others:
                problems += [f"rule {i}: {n} does not carry {label} ({key})"
                             for n in sorted(selected.get(key, set()))
                             if not carries(exprs[n], label, labels)]
        for label in set(rule.get("equal", [])) - COMMON_LABELS:
            for key in ("source_matchers", "target_matchers"):
                problems += [f"rule {i}: {n} does not carry {label} (equal)"
                             for n in sorted(selected.get(key, set()))
                             if not carries(exprs[n], label, labels)]
        # Inhibition only ever silences alerts that are at most as severe as their cause.
        problems += [f"rule {i}: {t} ({severities[t]}) is more severe than {s}"
                     for s in selected.get("source_matchers", set())
                     for t in selected.get("target_matchers", set())
                     if SEVERITY_RANK[severities[t]] < SEVERITY_RANK[severities[s]]]
    return problems


def _alert_exprs() -> dict[str, str]:
    return {r["alert"]: r["expr"] for r in rule_list() if "alert" in r}


def test_inhibition_rules_name_real_alerts() -> None:
    am = yaml.safe_load(AM_CONFIG.read_text())
    assert inhibition_problems(am, _alert_exprs()) == []


def test_inhibition_checker_catches_what_it_should() -> None:
    """The checker above fed broken inputs: a misspelt alert, a label the source does not carry
    (GpunetFleetCrossLeafSlow without its peer_leaf copy), a target label the target lacks, and
    a warning that would silence a critical alert."""
    exprs = _alert_exprs()
    am = yaml.safe_load(AM_CONFIG.read_text())
    am["inhibit_rules"][0]["source_matchers"] = ['alertname="GpunetPortDwn"']
    assert "rule 0: alertname=\"GpunetPortDwn\" matches no alert" in inhibition_problems(am, exprs)
    am = yaml.safe_load(AM_CONFIG.read_text())
    broken = dict(exprs, GpunetFleetCrossLeafSlow=exprs["GpunetFleetCrossLeafSlow"].replace(
        "peer_leaf", "other_leaf"))
    assert any("GpunetFleetCrossLeafSlow does not carry peer_leaf (equal)" in p
               for p in inhibition_problems(am, broken))
    broken = dict(exprs, GpunetFleetLinkSlow=exprs["GpunetFleetLinkSlow"].replace(
        "cross_leaf", "x"))
    assert any("GpunetFleetLinkSlow does not carry cross_leaf (target_matchers)" in p
               for p in inhibition_problems(am, broken))
    am["inhibit_rules"].append({"source_matchers": ['alertname="GpunetFleetLinkSlow"'],
                                "target_matchers": ['alertname="GpunetPortDown"'],
                                "equal": ["instance"]})
    assert any("GpunetPortDown (critical) is more severe than GpunetFleetLinkSlow" in p
               for p in inhibition_problems(am, exprs))


def _alternatives(regex: str) -> list[str]:
    """Top-level alternatives of a regex (splitting on | outside parentheses)."""
    parts, depth, cur = [], 0, ""
    for ch in regex:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "|" and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def test_exponent_numbers_read_as_numbers(tmp_path: Path) -> None:
    """PyYAML reads 1.0e11 (no exponent sign) as a string; a number field takes it as YAML 1.2
    would, while other strings are still refused."""
    f = tmp_path / "t.yml"
    f.write_text("probe: {expected_bus_bandwidth_bytes_per_second: {inter: 1.0e11, intra: 4e11}}\n")
    t = thresholds.load(str(f))
    assert t.probe.expected_bus_bandwidth_bytes_per_second == thresholds.ExpectedBusBandwidth(
        inter=1e11, intra=4e11, net=0)
    f.write_text("probe: {latency_seconds: 2ms}\n")
    with pytest.raises(thresholds.ConfigError, match="expected a number, got '2ms'"):
        thresholds.load(str(f))


def test_runbook_index_matches_the_rules() -> None:
    """The alert index at the top of docs/runbooks.md lists every alert with its class,
    severity and `for:` as the rules have them."""
    rows = re.findall(r"^\| \[(Gpunet\w+)\]\(#\w+\) \| (\w+) \| (\w+) \| (\w+) \|$",
                      RUNBOOKS.read_text(), re.M)
    index = {name: (cls, sev, for_) for name, cls, sev, for_ in rows}
    assert index == {a.name: (a.cls, a.severity, a.for_) for a in rules.ALERTS}


def test_nan_threshold_refused(tmp_path: Path) -> None:
    f = tmp_path / "t.yml"
    f.write_text("probe: {latency_seconds: .nan}\n")
    with pytest.raises(thresholds.ConfigError, match=r"key 'probe\.latency_seconds': expected a "
                                                     r"number, got NaN"):
        thresholds.load(str(f))


_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> float:
    """A Prometheus duration (``1h30m``, as the test files and promtool's reports write it)."""
    parts = _DURATION.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(int(n) * _SECONDS[u] for n, u in parts)


def failed_expectations(report: str) -> set[tuple[str, str, float]]:
    """(case, alert, eval time in seconds) of every alert expectation that a `promtool test
    rules` report lists as failed: each sits under the `name: <case>,` line of its case."""
    out: set[tuple[str, str, float]] = set()
    case = None
    for line in report.splitlines():
        line = line.strip()
        if line.startswith("name: ") and line.endswith(","):
            case = line[len("name: "):-1]
        m = re.match(r"alertname: (\S+), time: (\S+),", line)
        if m:
            assert case is not None, line
            out.add((case, m[1], seconds(m[2])))
    return out


def test_failed_expectations_reads_promtool_s_report(tmp_path: Path) -> None:
    """The reader of the mutation test below, against a real report: two expectations of one
    case fail, a third passes."""
    (tmp_path / "r.yml").write_text(yaml.safe_dump({"groups": [{"name": "g", "rules": [
        {"alert": "A", "expr": "vector(1) == 0", "for": "1m"}, {"alert": "B", "expr": "vector(1)"}
    ]}]}))
    exp = [{"exp_labels": {}}]
    (tmp_path / "t.yml").write_text(yaml.safe_dump({"rule_files": ["r.yml"], "tests": [
        {"name": "one, two", "interval": "1m", "input_series": [], "alert_rule_test": [
            {"alertname": "A", "eval_time": "90m", "exp_alerts": exp},
            {"alertname": "B", "eval_time": "5m", "exp_alerts": []},
            {"alertname": "B", "eval_time": "6m", "exp_alerts": exp}]}]}))
    out = subprocess.run([tool("promtool"), "test", "rules", "t.yml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1
    assert failed_expectations(out.stdout + out.stderr) == {("one, two", "A", 5400),
                                                            ("one, two", "B", 300)}


@pytest.mark.slow  # two promtool runs of every unit test
def test_every_alert_test_can_fail(tmp_path: Path) -> None:
    """Mutation check of alerts/tests/*.test.yml: with every alert's expression made to never
    fire, each firing expectation fails; made to always fire, each silent expectation evaluated
    after its alert's `for:` has run fails (those before it check the `for:`, which an
    always-true expression does not change), and every alert has both kinds. So no expectation
    passes whatever its alert's expression says. Each alert's expectations are read from the
    report one by one, so mutating all alerts in one run judges each as mutating it alone
    would: no alert's expression reads another alert."""
    cases = rule_test_cases()
    base = rules.rule_groups(thresholds.defaults(rules.ALERT_NAMES))
    for_ = {a.name: seconds(a.for_) for a in rules.ALERTS}
    firing: set[tuple[str, str, float]] = set()
    silent: set[tuple[str, str, float]] = set()
    for c in cases:
        for a in c.get("alert_rule_test", []):
            key = (c["name"], a["alertname"], seconds(a["eval_time"]))
            if a["exp_alerts"]:
                firing.add(key)
            elif key[2] >= for_[a["alertname"]]:
                silent.add(key)
    assert {k[1] for k in firing} == {k[1] for k in silent} == set(for_)
    # The alerts' names, expressions and `for:` only: a mutant reads no recording rule, and
    # fails an expectation by firing or not whatever its labels and annotations say (their
    # templates, expanded at every step of every case for every firing alert, cost promtool
    # nine tenths of its time); the cases' checks of recording rules (promql_expr_test) are
    # not what this test is about.
    alerts_only = [c | {"promql_expr_test": []} for c in cases]
    for mutant, must_fail in (("vector(1) == 0", firing), ("vector(1)", silent)):
        groups = yaml.safe_load(yaml.safe_dump(base))
        for g in groups["groups"]:
            assert all("ALERTS" not in r["expr"] for r in g["rules"] if "alert" in r), g
            g["rules"] = [{"alert": r["alert"], "expr": mutant, "for": r.get("for", "0s")}
                          for r in g["rules"] if "alert" in r]
        where = tmp_path / ("never" if must_fail is firing else "always")
        where.mkdir()
        files = by_class(groups, alerts_only, where)
        out = subprocess.run([tool("promtool"), "test", "rules", *files], cwd=where,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode != 0, f"with expr {mutant!r}: every case passed"
        passed = must_fail - failed_expectations(out.stdout + out.stderr)
        assert not passed, f"passed with every alert's expr {mutant!r}: {sorted(passed)}"
