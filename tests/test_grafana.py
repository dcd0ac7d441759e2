"""The Grafana dashboards in grafana/: committed JSON equals what gpunet_exporter.mixin.dashboards
builds, the structure Grafana 10 needs and our conventions (stable uids, tag, datasource
variable, units, $__rate_interval, instance filters, no overlapping panels), every metric a
query names exists in docs/metrics.md or in a collector's MetricSpecs, and every query is valid
PromQL to promtool. Each checker is also fed a deliberately broken input, so that a check that
silently accepts everything fails here."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpunet_exporter.mixin import dashboards as gen
from gpunet_exporter.mixin import promql, thresholds
from gpunet_exporter.mixin.alerts.common import CLASSES as RULE_CLASSES
from gpunet_exporter.mixin.rules import ALERT_NAMES
from gpunet_exporter.registry import discover

from support.paths import REPO

GRAFANA = REPO / "grafana"


Json = dict[str, Any]
DASHBOARDS: dict[str, Json] = gen.dashboards()

EXPECTED_UIDS = {"gpunet-fleet.json": "gpunet-fleet", "gpunet-node.json": "gpunet-node",
                 "gpunet-collectives.json": "gpunet-collectives",
                 "gpunet-pairs.json": "gpunet-pairs", "gpunet-fabric.json": "gpunet-fabric"}
DS_REF = {"type": "prometheus", "uid": "${datasource}"}
PANEL_TYPES = {"row", "timeseries", "stat", "table", "state-timeline", "status-history",
               "bargauge", "gauge"}
# Grafana unit ids the dashboards use; add a new one here only after checking Grafana has it.
KNOWN_UNITS = {"short", "none", "s", "Bps", "bps", "bytes", "percentunit", "pps", "cps", "cpm",
               "dBm"}  # Grafana's units: dBm is under "Signal strength"
# Built-in Grafana variables a query or title may use besides the dashboard's own.
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                     "__range_ms"}

# Names a query may use that are not in docs/metrics.md: Prometheus' own series, and recording
# rules of alerts/gpunet.rules.yml (level:metric:operations).
PROMETHEUS_SERIES = {"up", "ALERTS"}
_PAIR_BW = "gpunet_fleet_pair_bus_bandwidth_bytes_per_second"
RECORDING_RULES = {
    "instance_class:gpunet_alerts_firing:count",
    # the pair plan's (gpunet-pairs)
    f"instance:{_PAIR_BW}:median", f"job:{_PAIR_BW}:median", f"job:{_PAIR_BW}:mad",
    f"instance_peer:{_PAIR_BW}:slow_ratio_to_fleet_median",
    "instance:gpunet_fleet_pairs_healthy:count", f"leaf:{_PAIR_BW}:median_intra_leaf",
    f"leaf:{_PAIR_BW}:median_cross_leaf", f"leaf:{_PAIR_BW}:cross_to_intra_leaf_ratio",
}
# Alerts whose rule aggregates the instance away (GpunetFleetCrossLeafSlow is per job and leaf):
# a query of their ALERTS filters by job, as one of a recording rule without instance does.
ALERTS_WITHOUT_INSTANCE = {"GpunetFleetCrossLeafSlow"}
RECORDING_RULE_NAME = re.compile(r"^[a-z_]+:[a-z_]+:[a-z_0-9]+$")


def every(check: Callable[[Json], list[str]]) -> list[str]:
    return [f"{name}: {p}" for name, dash in DASHBOARDS.items() for p in check(dash)]


def all_queries(dash: Json) -> list[tuple[str, str]]:
    return [*gen.queries(dash), *gen.annotation_queries(dash)]


# ---------------------------------------------------------------------------------------------
# Which names in an expression are metric names (gpunet_exporter.mixin.promql's tokenizer)


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, matchers between braces or '') of every vector selector in expr; a
    selector without a metric name ({__name__=...}) comes back with name ''."""
    return [(sel.name, sel.matchers) for sel in promql.selectors(expr)]


def metric_names(expr: str) -> set[str]:
    return {name for name, _ in selectors(expr)}


def documented_metrics() -> set[str]:
    """The metrics of docs/metrics.md, and those the installed collectors declare (the
    source docs/metrics.md is generated from; a new collector's metrics count before the
    document is regenerated, which tests/test_docs.py demands anyway)."""
    text = (REPO / "docs" / "metrics.md").read_text()
    names = set(re.findall(r"^\| `([a-zA-Z_:][a-zA-Z0-9_:]*)` \| (?:gauge|counter|histogram|"
                           r"summary|info|untyped) \|", text, re.M))
    assert len(names) > 100, "docs/metrics.md: metric table not found; did its format change?"
    declared = {spec.name for cls in discover().values() for spec in cls.metrics}
    assert "gpunet_fabric_port_state_id" in declared, "the installed collectors' specs"
    return names | declared


def unknown_metrics(expr: str, documented: set[str]) -> list[str]:
    problems = []
    for name in sorted(metric_names(expr)):
        if name == "":
            problems.append("a selector without a metric name")
        elif name in RECORDING_RULES:
            if not RECORDING_RULE_NAME.match(name):
                problems.append(f"{name}: not a level:metric:operations name")
        elif name not in documented and name not in PROMETHEUS_SERIES:
            problems.append(f"{name}: not in docs/metrics.md")
    return problems


# ---------------------------------------------------------------------------------------------
# Checkers (each returns its problems; the tests below assert none, and feed them bad input)


def _panels(dash: Json) -> Iterator[Json]:
    yield from gen.iter_panels(dash)


def _overlap(a: Json, b: Json) -> bool:
    ga, gb = a["gridPos"], b["gridPos"]
    return (ga["x"] < gb["x"] + gb["w"] and gb["x"] < ga["x"] + ga["w"]
            and ga["y"] < gb["y"] + gb["h"] and gb["y"] < ga["y"] + ga["h"])


def _overlaps(group: list[Json]) -> list[str]:
    return [f"panels {a.get('title')!r} and {b.get('title')!r} overlap"
            for i, a in enumerate(group) for b in group[i + 1:] if _overlap(a, b)]


def structure_problems(dash: Json) -> list[str]:
    problems = []
    if dash.get("uid") not in EXPECTED_UIDS.values():
        problems.append(f"unexpected uid {dash.get('uid')!r}")
    if "gpunet" not in dash.get("tags", []):
        problems.append("missing tag gpunet")
    if not 36 <= dash.get("schemaVersion", 0) <= 41:
        problems.append(f"schemaVersion {dash.get('schemaVersion')} is not Grafana 10/11's")
    ids = [p.get("id") for p in _panels(dash)]
    if len(ids) != len(set(ids)) or None in ids:
        problems.append(f"panel ids not unique: {ids}")
    for p in _panels(dash):
        title = p.get("title") or f"<id {p.get('id')}>"
        grid = p.get("gridPos", {})
        if not all(isinstance(grid.get(k), int) for k in ("x", "y", "w", "h")):
            problems.append(f"{title}: gridPos missing or incomplete")
            continue
        if grid["x"] < 0 or grid["w"] < 1 or grid["x"] + grid["w"] > 24 or grid["h"] < 1:
            problems.append(f"{title}: gridPos {grid} outside the 24-column grid")
        if p.get("type") not in PANEL_TYPES:
            problems.append(f"{title}: panel type {p.get('type')!r}")
    if problems:
        return problems
    top = dash["panels"]
    problems += _overlaps(top)
    for row in top:
        if row.get("type") == "row" and row.get("panels"):
            if not row.get("collapsed"):
                problems.append(f"row {row['title']!r}: panels nested in an expanded row")
            problems += _overlaps([row, *row["panels"]])
    return problems


def panel_problems(dash: Json) -> list[str]:
    """Every panel: title, description, datasource variable on it and on its targets, a unit,
    at least one query."""
    problems = []
    for p in _panels(dash):
        if p["type"] == "row":
            continue
        title = p.get("title", "")
        if not title or not p.get("description"):
            problems.append(f"panel {p.get('id')}: no title or description")
        if p.get("datasource") != DS_REF:
            problems.append(f"{title}: panel datasource {p.get('datasource')} is not $datasource")
        if not p.get("targets"):
            problems.append(f"{title}: no targets")
        for t in p.get("targets", []):
            if t.get("datasource") != DS_REF:
                problems.append(f"{title}: target {t.get('refId')} datasource "
                                f"{t.get('datasource')} is not $datasource")
            if not t.get("expr"):
                problems.append(f"{title}: target {t.get('refId')} has no expr")
        unit = p.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if not unit:
            problems.append(f"{title}: no unit (fieldConfig.defaults.unit)")
        elif unit not in KNOWN_UNITS:
            problems.append(f"{title}: unit {unit!r} not in KNOWN_UNITS")
    return problems


# The metric a dashboard's instance variable lists the nodes of: every exporter, except on the
# fabric dashboard, whose nodes are those that sweep a fabric (one or two per fabric).
INSTANCE_SOURCE = {"gpunet-fabric": "gpunet_fabric_switches"}


def variable_problems(dash: Json) -> list[str]:
    problems = []
    variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
    ds = variables.get("datasource", {})
    if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
        problems.append("no datasource variable of type datasource, query prometheus")
    inst = variables.get("instance", {})
    source = INSTANCE_SOURCE.get(dash.get("uid", ""), "gpunet_exporter_build_info")
    if inst.get("type") != "query" or not re.fullmatch(
            rf"label_values\({source}(\{{[^}}]*\}})?, instance\)", inst.get("query", "")):
        problems.append(f"no instance variable from label_values({source}, instance)")
    for v in variables.values():
        if v.get("type") == "query" and v.get("datasource") != DS_REF:
            problems.append(f"variable {v['name']}: datasource is not $datasource")
    # Every $variable used in a query, a title or a variable query must be defined.
    texts = [e for _, e in all_queries(dash)]
    texts += [p.get("title", "") for p in _panels(dash)]
    texts += [v.get("query", "") for v in variables.values() if v.get("type") == "query"]
    for text in texts:
        for m in gen.VARIABLE.finditer(text):
            name = next(g for g in m.groups() if g)
            if name not in variables and name not in BUILTIN_VARIABLES:
                problems.append(f"${name} used in {text!r} is not a variable of the dashboard")
    return problems


RANGE_FUNCTION = re.compile(r"\b(rate|irate|increase)\s*\(")


def rate_problems(expr: str) -> list[str]:
    """rate/irate/increase read their counter over [$__rate_interval]; no other range appears."""
    problems = []
    for m in RANGE_FUNCTION.finditer(expr):
        depth, end = 0, len(expr)
        for j in range(m.end() - 1, len(expr)):
            depth += {"(": 1, ")": -1}.get(expr[j], 0)
            if depth == 0:
                end = j
                break
        if not expr[m.end():end].rstrip().endswith("[$__rate_interval]"):
            problems.append(f"{m.group(1)}() without [$__rate_interval]: {expr}")
    for rng in re.findall(r"\[[^\[\]]*\]", expr):
        if rng != "[$__rate_interval]":
            problems.append(f"range {rng} instead of [$__rate_interval]: {expr}")
    return problems


INSTANCE_MATCHER = re.compile(r'(?:^|,)\s*instance\s*=~?\s*"\$(?:instance|\{instance\})"')
JOB_MATCHER = re.compile(r'(?:^|,)\s*job\s*=~?\s*"\$(?:job|\{job\})"')


def without_instance(name: str, matchers: str) -> bool:
    """Whether the series of a selector carry no instance label: a recording rule whose level
    does not include instance (job:, leaf:), or ALERTS of an alert in ALERTS_WITHOUT_INSTANCE."""
    if ":" in name:
        return "instance" not in name.split(":", 1)[0].split("_")
    if name == "ALERTS":
        m = re.search(r'alertname\s*=~?\s*"([^"]*)"', matchers)
        return bool(m) and m.group(1) in ALERTS_WITHOUT_INSTANCE  # named, not a pattern
    return False


def instance_problems(expr: str) -> list[str]:
    """Every vector selector filters by the instance variable, or by the job variable where
    its series carry no instance."""
    problems = []
    for name, matchers in selectors(expr):
        if INSTANCE_MATCHER.search(matchers):
            continue
        if without_instance(name, matchers):
            if not JOB_MATCHER.search(matchers):
                problems.append(f"{name} (no instance label) not filtered by job: {expr}")
            continue
        problems.append(f"{name or '{...}'} not filtered by instance: {expr}")
    return problems


def query_problems(dash: Json, documented: set[str]) -> list[str]:
    problems = []
    for title, expr in all_queries(dash):
        problems += [f"{title}: {p}" for p in rate_problems(expr)]
        problems += [f"{title}: {p}" for p in instance_problems(expr)]
        problems += [f"{title}: {p}" for p in unknown_metrics(expr, documented)]
    for name, query in gen.variable_queries(dash):
        m = re.fullmatch(r"label_values\((.+), *\w+\)", query)
        if not m:
            problems.append(f"variable {name}: query {query!r} is not label_values(metric, label)")
            continue
        problems += [f"variable {name}: {p}" for p in unknown_metrics(m.group(1), documented)]
    return problems


# ---------------------------------------------------------------------------------------------
# (a) generated == committed


def test_committed_dashboards_are_fresh() -> None:
    assert set(DASHBOARDS) == set(EXPECTED_UIDS)
    for name, dash in DASHBOARDS.items():
        path = GRAFANA / name
        assert path.exists(), f"{path} missing: run `python -m gpunet_exporter.mixin`"
        assert path.read_text(encoding="utf-8") == gen.render(dash), (
            f"{path} is stale: run `python -m gpunet_exporter.mixin` and commit the result")
        assert json.loads(path.read_text(encoding="utf-8")) == dash


def test_generation_is_deterministic() -> None:
    again = gen.dashboards()
    for name, dash in DASHBOARDS.items():
        text = gen.render(dash)
        assert text == gen.render(again[name])
        assert text.endswith("}\n")


# ---------------------------------------------------------------------------------------------
# (b) structure


def test_uids_titles_and_tags() -> None:
    assert {name: d["uid"] for name, d in DASHBOARDS.items()} == EXPECTED_UIDS
    assert len({d["title"] for d in DASHBOARDS.values()}) == len(EXPECTED_UIDS)
    assert all(d["tags"] == ["gpunet"] for d in DASHBOARDS.values())


def test_structure() -> None:
    assert every(structure_problems) == []


def test_panels_have_datasource_unit_and_description() -> None:
    assert every(panel_problems) == []


def test_variables() -> None:
    assert every(variable_problems) == []
    multi = {name: next(v for v in d["templating"]["list"] if v["name"] == "instance")["multi"]
             for name, d in DASHBOARDS.items()}
    assert multi == {"gpunet-fleet.json": True, "gpunet-node.json": False,
                     "gpunet-collectives.json": True, "gpunet-pairs.json": True,
                     "gpunet-fabric.json": False}


def test_queries_use_rate_interval_instance_and_documented_metrics() -> None:
    documented = documented_metrics()
    assert every(lambda d: query_problems(d, documented)) == []


def test_dashboards_have_queries() -> None:
    for name, dash in DASHBOARDS.items():
        assert len(gen.queries(dash)) >= 15, name


def test_fleet_health_matrix_uses_the_recording_rule() -> None:
    fleet = DASHBOARDS["gpunet-fleet.json"]
    matrix = [p for p in gen.iter_panels(fleet) if any(
        t["id"] == "groupingToMatrix" for t in p.get("transformations", []))]
    assert len(matrix) == 1
    (expr,) = [t["expr"] for t in matrix[0]["targets"]]
    assert metric_names(expr) == {"instance_class:gpunet_alerts_firing:count"}
    organize = matrix[0]["transformations"][-1]["options"]["indexByName"]
    # One column per class the rules label alerts with, in their order.
    assert [c for c in organize if c in RULE_CLASSES] == list(RULE_CLASSES)


def test_pair_matrix_is_node_by_peer() -> None:
    """The pair dashboard's matrix: one instant query of the pair ratio (failed pairs as -1,
    shown FAILED), pivoted to rows of instance and columns of peer."""
    pairs = DASHBOARDS["gpunet-pairs.json"]
    matrix = [p for p in gen.iter_panels(pairs) if any(
        t["id"] == "groupingToMatrix" for t in p.get("transformations", []))]
    assert len(matrix) == 1
    (t,) = matrix[0]["targets"]
    assert t["instant"] and t["format"] == "table"
    assert metric_names(t["expr"]) == {_PAIR_BW, f"job:{_PAIR_BW}:median",
                                       "gpunet_fleet_pair_success"}
    (grouping,) = [x["options"] for x in matrix[0]["transformations"]
                   if x["id"] == "groupingToMatrix"]
    assert (grouping["rowField"], grouping["columnField"]) == ("instance", "peer")
    mapped = matrix[0]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert mapped["-1"]["text"] == "FAILED"


def test_fabric_health_matrix_is_switch_by_port() -> None:
    """The fabric dashboard's matrix: one instant query, the switch's name joined from
    gpunet_fabric_switch_info, pivoted to rows of switch name and columns of port, each code
    of the legend its description documents mapped to a text."""
    fabric = DASHBOARDS["gpunet-fabric.json"]
    matrix = [p for p in gen.iter_panels(fabric) if any(
        t["id"] == "groupingToMatrix" for t in p.get("transformations", []))]
    assert len(matrix) == 1
    (t,) = matrix[0]["targets"]
    assert t["instant"] and t["format"] == "table"
    assert "group_left (name) gpunet_fabric_switch_info" in t["expr"]
    assert {"gpunet_fabric_port_state_id", "gpunet_fabric_port_info",
            "gpunet_fabric_port_rate_degraded"} <= metric_names(t["expr"])
    (grouping,) = [x["options"] for x in matrix[0]["transformations"]
                   if x["id"] == "groupingToMatrix"]
    assert (grouping["rowField"], grouping["columnField"]) == ("name", "port")
    mapped = matrix[0]["fieldConfig"]["defaults"]["mappings"][0]["options"]
    assert sorted(mapped) == ["0", "1", "2", "3", "4"]
    for code, entry in mapped.items():
        assert f"{code} {entry['text']}" in matrix[0]["description"]
    leaf = next(v for v in fabric["templating"]["list"] if v["name"] == "leaf")
    assert 'role="leaf"' in leaf["query"] and leaf["query"].endswith(", name)")
    assert not leaf["multi"] and not leaf["includeAll"]


def test_variable_checker_knows_each_dashboards_instance_source() -> None:
    fabric = copy.deepcopy(DASHBOARDS["gpunet-fabric.json"])
    node = copy.deepcopy(DASHBOARDS["gpunet-node.json"])
    for dash, other in ((fabric, "gpunet_exporter_build_info"),
                        (node, "gpunet_fabric_switches")):
        inst = next(v for v in dash["templating"]["list"] if v["name"] == "instance")
        inst["query"] = f'label_values({other}{{job=~"$job"}}, instance)'
        assert any("no instance variable" in p for p in variable_problems(dash)), other


def test_recording_rules_exist_in_alerts() -> None:
    rules_file = REPO / "alerts" / "gpunet.rules.yml"
    if not rules_file.exists():
        pytest.skip("alerts/gpunet.rules.yml not present in this tree")
    recorded = {r["record"] for g in yaml.safe_load(rules_file.read_text())["groups"]
                for r in g["rules"] if "record" in r}
    missing = RECORDING_RULES - recorded
    assert not missing, f"recording rules the dashboards use are not in {rules_file}: {missing}"


# ---------------------------------------------------------------------------------------------
# (c) the checkers catch what they should


def _first(dash: Json, kind: str) -> Json:
    return next(p for p in gen.iter_panels(dash) if p["type"] == kind)


def test_structure_checker_catches_overlap_duplicate_ids_and_bad_grid() -> None:
    dash = copy.deepcopy(DASHBOARDS["gpunet-node.json"])
    a, b = [p for p in dash["panels"] if p["type"] == "timeseries"][:2]
    b["gridPos"] = dict(a["gridPos"])
    assert any("overlap" in p for p in structure_problems(dash))
    b["id"] = a["id"]
    assert any("not unique" in p for p in structure_problems(dash))
    b["id"] = 9999
    b["gridPos"] = {"x": 20, "y": 500, "w": 8, "h": 4}
    assert any("24-column" in p for p in structure_problems(dash))
    del b["gridPos"]
    assert any("gridPos missing" in p for p in structure_problems(dash))
    dash = copy.deepcopy(DASHBOARDS["gpunet-node.json"])
    dash["uid"], dash["tags"], dash["schemaVersion"] = "node", [], 16
    assert len(structure_problems(dash)) == 3


def test_structure_checker_sees_nested_panels() -> None:
    dash = copy.deepcopy(DASHBOARDS["gpunet-fleet.json"])
    row = next(p for p in dash["panels"] if p["type"] == "row" and p["collapsed"])
    assert row["panels"], "the test needs a collapsed row with panels"
    row["panels"][0]["gridPos"] = dict(row["gridPos"])
    assert any("overlap" in p for p in structure_problems(dash))
    dash = copy.deepcopy(DASHBOARDS["gpunet-fleet.json"])
    row = next(p for p in dash["panels"] if p["type"] == "row" and p["collapsed"])
    del row["panels"][0]["fieldConfig"]["defaults"]["unit"]
    assert any("no unit" in p for p in panel_problems(dash))


def test_panel_checker_catches_datasource_and_unit() -> None:
    dash = copy.deepcopy(DASHBOARDS["gpunet-collectives.json"])
    p = _first(dash, "timeseries")
    p["targets"][0]["datasource"] = {"type": "prometheus", "uid": "P1809F7CD0C75ACF3"}
    assert any("target A datasource" in x for x in panel_problems(dash))
    p["targets"][0]["datasource"] = DS_REF
    p["datasource"] = None
    assert any("panel datasource" in x for x in panel_problems(dash))
    p["datasource"] = DS_REF
    p["fieldConfig"]["defaults"]["unit"] = "bytes/sec"
    assert any("KNOWN_UNITS" in x for x in panel_problems(dash))
    del p["fieldConfig"]["defaults"]["unit"]
    assert any("no unit" in x for x in panel_problems(dash))


def test_variable_checker_catches_undefined_and_missing_variables() -> None:
    dash = copy.deepcopy(DASHBOARDS["gpunet-node.json"])
    _first(dash, "timeseries")["title"] = "Bandwidth at $size"  # node view has no size
    assert any("$size" in x for x in variable_problems(dash))
    dash["templating"]["list"] = [v for v in dash["templating"]["list"]
                                  if v["name"] != "datasource"]
    assert any("datasource variable" in x for x in variable_problems(dash))


def test_rate_checker() -> None:
    good = 'rate(m_total{instance=~"$instance"}[$__rate_interval])'
    assert rate_problems(good) == []
    assert rate_problems("sum by (x) (increase(m_total[$__rate_interval]))") == []
    assert rate_problems("rate(m_total[5m])")
    assert rate_problems("irate(m_total[$__interval])")
    assert rate_problems("increase(m_total[$__range])")
    assert rate_problems("max_over_time(m[1h])")  # any other range is flagged too
    assert rate_problems("rate(m_total)")


def test_instance_checker_for_series_without_instance() -> None:
    """Per-job and per-leaf series (recording rules whose level has no instance, ALERTS of a
    per-leaf alert) filter by job instead; everything else still needs instance."""
    assert instance_problems('job:a:median{job=~"$job"} / leaf:b:ratio{job=~"${job}"}') == []
    assert instance_problems(
        'ALERTS{job=~"$job", alertname=~"GpunetFleetCrossLeafSlow"}') == []
    assert instance_problems("job:a:median") == [
        "job:a:median (no instance label) not filtered by job: job:a:median"]
    assert instance_problems('instance:a:median{job=~"$job"}')  # has an instance: must filter
    assert instance_problems('instance_peer:a:ratio{job=~"$job"}')
    assert instance_problems('ALERTS{job=~"$job", alertname=~"GpunetFleetLinkSlow"}')
    assert instance_problems('ALERTS{job=~"$job", alertname=~"GpunetFleet.+"}')
    assert instance_problems('gpunet_fleet_pair_success{job=~"$job"}')


def test_instance_checker() -> None:
    assert instance_problems('a{instance=~"$instance"} / b{job="x", instance="$instance"}') == []
    assert instance_problems('a{instance=~"${instance}"} or vector(0)') == []
    assert instance_problems('a{instance=~"$instance"} / b{job="x"}') == [
        'b not filtered by instance: a{instance=~"$instance"} / b{job="x"}']
    assert instance_problems("time() - a")
    assert instance_problems('a{other_instance="$instance"}')


@pytest.mark.parametrize(("expr", "names"), [
    ('sum by (device, port) (rate(gpunet_x_total{instance=~"$instance"}[$__rate_interval]))',
     {"gpunet_x_total"}),
    ("a and on (instance, job) b unless ignoring (device) c", {"a", "b", "c"}),
    ("a * on (gpu) group_left (path, numa_node) b", {"a", "b"}),
    ("a / ignoring (stat) group_right () b", {"a", "b"}),
    ("sum without (job) (a) by (x)", {"a"}),
    ('count_values("value", a)', {"a"}),
    ("topk(10, a) > bool 0", {"a"}),
    ("a offset 5m + b @ start()", {"a", "b"}),
    ('label_replace(a, "dst", "$1", "src", "(.*)")', {"a"}),
    ('histogram_quantile(0.99, sum by (le) (rate(a_bucket{le!="+Inf"}[5m])))', {"a_bucket"}),
    ("max_over_time(a[1h:5m]) - Inf + NaN * 1e3 - 0x1f", {"a"}),
    ("time() - vector(0) + scalar(a)", {"a"}),
    ("instance_class:gpunet_alerts_firing:count > 0",
     {"instance_class:gpunet_alerts_firing:count"}),
    ('{__name__="a"}', {""}),
    ("atan2(a, b)", {"a", "b"}),
    ("a atan2 b", {"a", "b"}),
    ("sum(a) by (by, on)", {"a"}),
])
def test_tokenizer_finds_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_metric_checker_catches_unknown_names() -> None:
    documented = documented_metrics()
    assert "gpunet_infiniband_port_state_id" in documented
    assert "gpunet_probe_failures_total" in documented
    ok = 'up{instance=~"$instance"} + ALERTS + instance_class:gpunet_alerts_firing:count'
    assert unknown_metrics(ok, documented) == []
    bad = 'sum by (device) (rate(gpunet_infiniband_port_symbol_error_total{instance=~"$instance"}' \
          '[$__rate_interval]))'
    assert unknown_metrics(bad, documented) == [
        "gpunet_infiniband_port_symbol_error_total: not in docs/metrics.md"]
    assert unknown_metrics("instance:gpunet_other:rate5m", documented)  # not allow-listed
    assert unknown_metrics('{__name__=~"gpunet_.*"}', documented)
    dash = copy.deepcopy(DASHBOARDS["gpunet-collectives.json"])
    _first(dash, "timeseries")["targets"][0]["expr"] = bad
    assert any("symbol_error_total" in p for p in query_problems(dash, documented))
    assert all(RECORDING_RULE_NAME.match(r) for r in RECORDING_RULES)


def test_substitute() -> None:
    expr = 'rate(a{instance=~"$instance", job=~"${job}", s=~"${size:regex}"}[$__rate_interval])'
    assert gen.substitute(expr, {"instance": "n1:19400|n2:19400", "job": "gpunet"}) == (
        'rate(a{instance=~"n1:19400|n2:19400", job=~"gpunet", s=~".+"}[1m])')
    assert gen.substitute("x[$__range] [$__interval] $__range_s", {}) == "x[1h] [15s] 3600"
    assert gen.substitute("[[instance]]", {"instance": "a"}) == "a"
    with pytest.raises(KeyError):
        gen.substitute("a{x=\"$nosuchvariable\"}", {})
    for dash in DASHBOARDS.values():
        for _, e in all_queries(dash):
            assert "$" not in gen.substitute(e, {"instance": "node1:19400"})


# ---------------------------------------------------------------------------------------------
# PromQL syntax: promtool parses every query as a recording rule


def _promtool_check(exprs: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (tests/run.sh installs the prometheus package)"
    rules = [{"record": f"gpunet_dashboard_check:query_{i}:check", "expr": e}
             for i, e in enumerate(exprs)]
    path = tmp_path / "dashboard-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    return subprocess.run([promtool, "check", "rules", str(path)], capture_output=True,
                          text=True)


# A thresholds file's narrowing: a cluster variable, and label matchers on the exporters' series.
SCOPE_SELECTOR = 'env!="staging"'
SCOPED_THRESHOLDS = f"multi_cluster: true\nselector: '{SCOPE_SELECTOR}'\n"


def scoped_dashboards(tmp_path: Path) -> dict[str, Json]:
    (tmp_path / "scoped.yml").write_text(SCOPED_THRESHOLDS)
    return gen.dashboards(thresholds.load(str(tmp_path / "scoped.yml"), ALERT_NAMES))


def test_multi_cluster_and_selector_reach_every_query(tmp_path: Path) -> None:
    """``multi_cluster``: a cluster variable after the data source, ``cluster=~"$cluster"`` on
    every selector of every query, annotation and variable query (but the cluster variable's
    own), the choice kept by the links to the node view. ``selector`` on every selector of the
    exporters' series. Every other check of the shipped dashboards still holds."""
    documented = documented_metrics()
    for name, dash in scoped_dashboards(tmp_path).items():
        variables = dash["templating"]["list"]
        assert [v["name"] for v in variables[:2]] == ["datasource", "cluster"], name
        assert variables[1]["allValue"] == ".*" and variables[1]["includeAll"]
        exprs = [e for _, e in all_queries(dash)] + [
            re.fullmatch(r"label_values\((.+), *\w+\)", q).group(1)  # type: ignore[union-attr]
            for v, q in gen.variable_queries(dash) if v != "cluster"]
        assert exprs, name
        for expr in exprs:
            for sel in promql.selectors(expr):
                assert 'cluster=~"$cluster"' in sel.matchers, f"{name}: {expr}"
                if promql.exporter_series(sel):
                    assert SCOPE_SELECTOR in sel.matchers, f"{name}: {expr}"
        (cluster_query,) = [q for v, q in gen.variable_queries(dash) if v == "cluster"]
        assert cluster_query == (f"label_values(gpunet_exporter_build_info{{{SCOPE_SELECTOR}}}, "
                                 "cluster)")
        text = json.dumps(dash)
        links = re.findall(r'"url": "(/d/[^"]*)"', text)
        assert all("${cluster:queryparam}" in u for u in links), (name, links)
        assert (structure_problems(dash), panel_problems(dash), variable_problems(dash),
                query_problems(dash, documented)) == ([], [], [], []), name
    links = [u for d in scoped_dashboards(tmp_path).values()
             for u in re.findall(r'"url": "(/d/[^"]*)"', json.dumps(d))]
    assert links, "no link to the node view was checked"
    assert not any(v["name"] == "cluster" for d in DASHBOARDS.values()
                   for v in d["templating"]["list"])  # the defaults: none


@pytest.mark.parametrize("scoped", [False, True], ids=["shipped", "scoped"])
def test_queries_are_valid_promql(tmp_path: Path, scoped: bool) -> None:
    exprs = []
    for dash in (scoped_dashboards(tmp_path) if scoped else DASHBOARDS).values():
        exprs += [gen.substitute(e, {}) for _, e in all_queries(dash)]
        exprs += [gen.substitute(re.fullmatch(r"label_values\((.+), *\w+\)", q).group(1), {})
                  for _, q in gen.variable_queries(dash)]
    res = _promtool_check(exprs, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in res.stdout


def test_promtool_check_catches_bad_promql(tmp_path: Path) -> None:
    res = _promtool_check(['sum(rate(a{instance=~".+"}[1m])', "a and on (x b"], tmp_path)
    assert res.returncode != 0


def test_probe_state_panel_knows_every_state() -> None:
    """The probe state timeline draws each of gpunet_probe_state's states (probe.idle STATES)
    as a number it maps to a name; a state added there must be drawn here."""
    from gpunet_exporter.probe import idle

    assert set(gen.PROBE_STATES) == set(idle.STATES)
    assert [code for code, _, _ in gen.PROBE_STATE_MAP] == list(
        range(1, len(gen.PROBE_STATES) + 1))
    for (_, name, _), state in zip(gen.PROBE_STATE_MAP, gen.PROBE_STATES, strict=True):
        assert name.replace("-", "").lower().startswith(state[:4]), (name, state)
