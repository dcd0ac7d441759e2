"""The pieces every dashboard is built of: PromQL helpers, field configuration (steps, value
mappings, overrides), targets and panels, the grid layout, variables and the dashboard frame;
and, for tests, the walkers of a dashboard's queries and the substitution of Grafana variables.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from gpunet_exporter.collectors.fabric import FabricSettings
from gpunet_exporter.mixin.alerts import ALERTS
from gpunet_exporter.mixin.promql import add_matchers, exporter_series
from gpunet_exporter.mixin.thresholds import Thresholds
from gpunet_exporter.probe import run_options
from gpunet_exporter.probe.idle import STATES as PROBE_STATES

Json = dict[str, Any]

SCHEMA_VERSION = 39  # Grafana 10.4; Grafana 10.0 (schema 38) and later import it
TAG = "gpunet"

# How the dashboards draw each state of gpunet_probe_state: (text, colour).
SHOWN = {"measuring": ("measuring", "green"), "failing": ("FAILING", "red"),
         "holdoff": ("hold-off", "blue"), "yielded": ("yielded to a job", "purple"),
         "unknown": ("UNKNOWN", "orange")}

DS: Json = {"type": "prometheus", "uid": "${datasource}"}
INSTANCE = 'instance=~"$instance"'
JOB = 'job=~"$job"'
RATE_INTERVAL = "$__rate_interval"
GRID_WIDTH = 24
NODE_UID = "gpunet-node"


# ---------------------------------------------------------------------------------------------
# PromQL


def sel(metric: str, *matchers: str) -> str:
    """A vector selector limited to the selected instances, plus any other matchers."""
    return metric + "{" + ", ".join([INSTANCE, *matchers]) + "}"


def rate(metric: str, *matchers: str, fn: str = "rate") -> str:
    """rate() (or increase()/irate()) of a counter over $__rate_interval."""
    return f"{fn}({sel(metric, *matchers)}[{RATE_INTERVAL}])"


def increase(metric: str, *matchers: str) -> str:
    return rate(metric, *matchers, fn="increase")


def count_or_zero(expr: str) -> str:
    """Number of series of expr, 0 instead of no data."""
    return f"count({expr}) or vector(0)"


def idle_without_round(*matchers: str) -> str:
    """Over the nodes whose GPUs are idle, the longest time since the later of the node's last
    complete round (its oldest scope) and the start of its idle time: what GpunetProbeStale
    fires on past probe.stale_seconds. 0 when no idle node waits; busy nodes never count."""
    rounds = ("max by (instance, job) (time() - "
              + sel("gpunet_probe_last_success_timestamp_seconds", 'scope!="inter"', *matchers)
              + ")")
    idle = sel("gpunet_probe_idle_since_timestamp_seconds")
    return (f'max(min by (instance, job) (label_replace({rounds}, "age", "round", "", "") or '
            f'label_replace(time() - {idle}, "age", "idle", "", "")) and on (instance, job) '
            f"{idle}) or vector(0)")


def sum_or_zero(expr: str) -> str:
    return f"sum({expr}) or vector(0)"


# ---------------------------------------------------------------------------------------------
# Field configuration pieces


def steps(*pairs: tuple[str, float | None]) -> Json:
    """Absolute thresholds; the first pair's value is None (the base colour)."""
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in pairs]}


OK_RED = steps(("green", None), ("red", 1))
OK_ORANGE = steps(("green", None), ("orange", 1))
NEUTRAL = steps(("blue", None))


# What the dashboards' descriptions call "by default": a probe round every PROBE_INTERVAL
# seconds (`gpunet-probe run --interval`, the probe: key interval_seconds), a fabric sweep every
# SWEEP_INTERVAL (the fabric: key interval_seconds).
PROBE_INTERVAL: float = run_options.default("interval_seconds")
SWEEP_INTERVAL: float = FabricSettings().interval_seconds


def stale_steps(seconds: float, interval: float) -> Json:
    """Age of the last good result: yellow from 3 rounds or sweeps at the default ``interval``,
    red where the stale alert fires (``seconds``: its threshold)."""
    return steps(("green", None), ("yellow", whole(3 * interval)), ("red", seconds))


def whole(v: float) -> float:
    """``v`` as an int where it is one (a dashboard's JSON writes 180, not 180.0)."""
    return int(v) if float(v).is_integer() else v


# Time paused by PFC: orange where GpunetPauseDurationHigh fires (pfc.pause_ratio), red from
# half the time (near a pause storm).
PAUSE_STORM_RATIO = 0.5


def pause_steps(t: Thresholds) -> Json:
    return steps(("green", None), ("orange", t.pfc.pause_ratio), ("red", PAUSE_STORM_RATIO))


# gpunet_probe_state's values (gpunet_exporter.probe.idle.STATES), each drawn as its position
# from 1 in that tuple: the text and colour of each, in its order.
PROBE_STATE_MAP = tuple((n, *SHOWN[state]) for n, state in enumerate(PROBE_STATES, 1))


def straggler_steps(t: Thresholds) -> Json:
    """Straggler wait ratio: from the probe's straggler_min_ratio (STRAGGLER_MIN_RATIO) the late
    rank is named, GpunetStragglerRank fires above probe.straggler_wait_ratio."""
    return steps(("green", None), ("orange", STRAGGLER_MIN_RATIO),
                 ("red", t.probe.straggler_wait_ratio))


def link_rate_steps(t: Thresholds) -> Json:
    """Bus bandwidth over link bandwidth: GpunetBusBandwidthBelowLinkRate fires below
    probe.link_ratio, the target."""
    return steps(("red", None), ("green", t.probe.link_ratio))


def percent(ratio: float) -> str:
    """A ratio threshold as a description writes it (0.8: 80%)."""
    return f"{ratio:.0%}"


# The share of the others' wait from which the probe names the late rank
# (gpunet_probe_straggler_info): the default of `gpunet-probe run --straggler-min-ratio`, the
# probe: key straggler_min_ratio. The dashboards describe a probe run with its defaults.
STRAGGLER_MIN_RATIO: float = run_options.default("straggler_min_ratio")

_FOR = {a.name: a.for_ for a in ALERTS}  # each alert's own `for:` duration
_UNIT_WORDS = {"ms": "millisecond", "s": "second", "m": "minute", "h": "hour", "d": "day",
               "w": "week", "y": "year"}


def duration_words(duration: str) -> str:
    """A Prometheus duration as a description writes it: 10m is "10 minutes", 1h30m "1 hour
    30 minutes"."""
    return " ".join(f"{n} {_UNIT_WORDS[unit]}{'' if int(n) == 1 else 's'}"
                    for n, unit in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))


def for_words(t: Thresholds, alert: str) -> str:
    """How long ``alert``'s condition must hold before it fires, in words: the thresholds
    file's ``for:`` duration, else the alert's own."""
    return duration_words(t.for_(alert, _FOR[alert]))


def mapping(*entries: tuple[int | str, str, str]) -> list[Json]:
    """Value mappings: (value, text, colour)."""
    return [{"type": "value", "options": {
        str(value): {"text": text, "color": color, "index": i}
        for i, (value, text, color) in enumerate(entries)}}]


BAD_WHEN_1 = mapping((0, "ok", "green"), (1, "BAD", "red"))
GOOD_WHEN_1 = mapping((1, "yes", "green"), (0, "NO", "red"))
PORT_STATE = mapping((0, "NOP", "red"), (1, "DOWN", "red"), (2, "INIT", "orange"),
                     (3, "ARMED", "orange"), (4, "ACTIVE", "green"),
                     (5, "ACTIVE_DEFER", "yellow"))
PHYS_STATE = mapping((1, "Sleep", "red"), (2, "Polling", "red"), (3, "Disabled", "red"),
                     (4, "Training", "orange"), (5, "LinkUp", "green"),
                     (6, "LinkErrorRecovery", "orange"), (7, "PhyTest", "purple"))
OPERSTATE = mapping((0, "unknown", "text"), (1, "notpresent", "red"), (2, "down", "red"),
                    (3, "lowerlayerdown", "red"), (4, "testing", "orange"),
                    (5, "dormant", "orange"), (6, "up", "green"))
PCIE_PATH = mapping(("PIX", "PIX", "green"), ("PXB", "PXB", "green"), ("PHB", "PHB", "yellow"),
                    ("NODE", "NODE", "orange"), ("SYS", "SYS", "red"))


def override(name: str, *properties: tuple[str, Any], regex: bool = False) -> Json:
    """A field override by name (or by regex over display names) setting properties."""
    return {"matcher": {"id": "byRegexp" if regex else "byName", "options": name},
            "properties": [{"id": k, "value": v} for k, v in properties]}


NODE_LINK = [{
    "title": "Node view of ${__value.text}",
    "url": f"/d/{NODE_UID}?${{datasource:queryparam}}&var-instance=${{__value.raw}}"
           "&${__url_time_range}",
}]


def node_link_column(column: str = "instance") -> Json:
    """Turn a table's instance column into a link to the node view."""
    return override(column, ("links", NODE_LINK), ("custom.cellOptions", {"type": "auto"}))


# ---------------------------------------------------------------------------------------------
# Targets and panels


def target(expr: str, legend: str = "", *, table: bool = False) -> Json:
    """A Prometheus query; table=True makes it an instant query formatted as a table."""
    return {
        "datasource": DS,
        "editorMode": "code",
        "expr": expr,
        "format": "table" if table else "time_series",
        "instant": table,
        "legendFormat": legend if legend else "__auto",
        "range": not table,
    }


def _with_ref_ids(targets: list[Json]) -> list[Json]:
    return [{**t, "refId": chr(ord("A") + i)} for i, t in enumerate(targets)]


def panel(kind: str, title: str, description: str, targets: list[Json], unit: str, *,
          thresholds: Json | None = None, mappings: list[Json] | None = None,
          custom: Json | None = None, options: Json | None = None,
          overrides: list[Json] | None = None, transformations: list[Json] | None = None,
          decimals: int | None = None, min_value: float | None = None,
          max_value: float | None = None, color: str = "thresholds") -> Json:
    defaults: Json = {
        "unit": unit,
        "color": {"mode": color},
        "thresholds": thresholds or NEUTRAL,
        "mappings": mappings or [],
    }
    if custom is not None:
        defaults["custom"] = custom
    if decimals is not None:
        defaults["decimals"] = decimals
    if min_value is not None:
        defaults["min"] = min_value
    if max_value is not None:
        defaults["max"] = max_value
    out: Json = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": _with_ref_ids(targets),
        "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
        "options": options or {},
    }
    if transformations:
        out["transformations"] = transformations
    return out


LEGEND_TABLE = {"displayMode": "table", "placement": "right", "showLegend": True,
                "calcs": ["lastNotNull", "max"], "sortBy": "Max", "sortDesc": True}
LEGEND_LIST = {"displayMode": "list", "placement": "bottom", "showLegend": True, "calcs": []}


def timeseries(title: str, description: str, targets: list[Json], unit: str, *,
               thresholds: Json | None = None, show_thresholds: bool = False,
               bars: bool = False, overrides: list[Json] | None = None,
               min_value: float | None = 0, max_value: float | None = None,
               log_scale: bool = False, legend_table: bool = True) -> Json:
    custom: Json = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 60 if bars else 5,
        "showPoints": "never",
        "spanNulls": False,
        "axisSoftMin": 0,
        "thresholdsStyle": {"mode": "dashed" if show_thresholds else "off"},
        "scaleDistribution": {"type": "log", "log": 10} if log_scale else {"type": "linear"},
    }
    return panel("timeseries", title, description, targets, unit,
                 thresholds=thresholds or steps(("green", None)), custom=custom,
                 color="palette-classic", overrides=overrides,
                 min_value=None if log_scale else min_value, max_value=max_value,
                 options={"legend": LEGEND_TABLE if legend_table else LEGEND_LIST,
                          "tooltip": {"mode": "multi", "sort": "desc"}})


def stat(title: str, description: str, targets: list[Json], unit: str, *,
         thresholds: Json | None = None, mappings: list[Json] | None = None,
         decimals: int | None = None, text_mode: str = "auto") -> Json:
    return panel("stat", title, description, targets, unit, thresholds=thresholds,
                 mappings=mappings, decimals=decimals,
                 options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                            "values": False},
                          "colorMode": "background", "graphMode": "none",
                          "justifyMode": "auto", "orientation": "auto",
                          "textMode": text_mode, "showPercentChange": False})


def state_timeline(title: str, description: str, targets: list[Json], *,
                   mappings: list[Json], thresholds: Json | None = None,
                   unit: str = "none", kind: str = "state-timeline") -> Json:
    options: Json = {"showValue": "auto", "rowHeight": 0.8, "legend": LEGEND_LIST,
                     "tooltip": {"mode": "single", "sort": "none"}}
    if kind == "state-timeline":
        options.update(mergeValues=True, alignValue="left")
    else:
        options.update(colWidth=0.9)
    return panel(kind, title, description, targets, unit, thresholds=thresholds or OK_RED,
                 mappings=mappings, custom={"fillOpacity": 80, "lineWidth": 0},
                 options=options)


def organize(rename: dict[str, str] | None = None, order: list[str] | None = None,
             hide: tuple[str, ...] = ("Time", "__name__", "job")) -> Json:
    return {"id": "organize", "options": {
        "excludeByName": {name: True for name in hide},
        "indexByName": {name: i for i, name in enumerate(order or [])},
        "renameByName": rename or {}}}


def table(title: str, description: str, targets: list[Json], unit: str, *,
          rename: dict[str, str] | None = None, order: list[str] | None = None,
          mappings: list[Json] | None = None, thresholds: Json | None = None,
          overrides: list[Json] | None = None, transformations: list[Json] | None = None,
          sort_by: str | None = None, sort_desc: bool = True, cell: str = "auto",
          decimals: int | None = None) -> Json:
    """Instant queries as a table; several queries are merged on their labels."""
    steps_: list[Json] = []
    if len(targets) > 1:
        steps_.append({"id": "merge", "options": {}})
    steps_.extend(transformations or [])
    steps_.append(organize(rename, order))
    options: Json = {"showHeader": True, "cellHeight": "sm",
                     "footer": {"show": False, "reducer": ["sum"], "fields": ""}}
    if sort_by:
        options["sortBy"] = [{"displayName": sort_by, "desc": sort_desc}]
    return panel("table", title, description, targets, unit, mappings=mappings,
                 thresholds=thresholds, decimals=decimals,
                 custom={"align": "auto", "cellOptions": {"type": cell}, "filterable": True,
                         "inspect": False},
                 overrides=[node_link_column(), *(overrides or [])],
                 transformations=steps_, options=options)


def straggler_table(t: Thresholds, *matchers: str) -> Json:
    """The late rank each node hosts (gpunet_probe_straggler_info) with the wait it imposes."""
    info = sel("gpunet_probe_straggler_info", *matchers)

    def named(metric: str) -> str:
        return (f"{sel(metric, *matchers)} * on (instance, job, scope) group_left (rank, gpu) "
                f"{info}")

    return table(
        "Straggler ranks", "The rank the others wait for, on the node that runs it, with its "
        "local GPU: named while the others wait at least probe.straggler_min_ratio "
        f"({percent(STRAGGLER_MIN_RATIO)}) of "
        "their all-reduce time for it. wait ratio is that share (red above "
        f"{percent(t.probe.straggler_wait_ratio)}: "
        "GpunetStragglerRank), wait the median seconds at the largest size. Empty is healthy. "
        "A rank named round after round: check that GPU's clocks and PCIe link, and its NIC.",
        [target(named("gpunet_probe_straggler_wait_ratio"), table=True),
         target(named("gpunet_probe_straggler_wait_seconds"), table=True)], "percentunit",
        rename={"Value #A": "wait ratio", "Value #B": "wait"},
        order=["instance", "scope", "rank", "gpu", "wait ratio", "wait"],
        thresholds=straggler_steps(t), sort_by="wait ratio",
        overrides=[override("wait ratio", ("custom.cellOptions", {"type": "color-text"})),
                   override("wait", ("unit", "s"))])


# ---------------------------------------------------------------------------------------------
# Layout


class Layout:
    """Places panels left to right on Grafana's 24-column grid, wrapping to a new line, and
    numbers them. Panels after a collapsed row go inside it, as Grafana stores them."""

    def __init__(self) -> None:
        self.panels: list[Json] = []
        self._into = self.panels
        self._x = 0
        self._y = 0
        self._line_height = 0
        self._next_id = 1
        self._resume_y: int | None = None

    def _id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _newline(self) -> None:
        self._y += self._line_height
        self._x = 0
        self._line_height = 0

    def row(self, title: str, *, collapsed: bool = False) -> None:
        self._newline()
        if self._resume_y is not None:  # top level goes on right below the collapsed row
            self._y, self._resume_y = self._resume_y, None
        row: Json = {"type": "row", "id": self._id(), "title": title, "collapsed": collapsed,
                     "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": self._y}, "panels": []}
        self.panels.append(row)
        self._y += 1
        if collapsed:
            self._into = row["panels"]
            self._resume_y = self._y
        else:
            self._into = self.panels

    def add(self, item: Json, w: int, h: int) -> None:
        if self._x + w > GRID_WIDTH:
            self._newline()
        self._into.append({"id": self._id(),
                           "gridPos": {"h": h, "w": w, "x": self._x, "y": self._y}, **item})
        self._x += w
        self._line_height = max(self._line_height, h)


# ---------------------------------------------------------------------------------------------
# Dashboards


def datasource_variable() -> Json:
    return {"name": "datasource", "label": "Data source", "type": "datasource",
            "query": "prometheus", "current": {}, "hide": 0, "includeAll": False,
            "multi": False, "options": [], "refresh": 1, "regex": "", "skipUrlSync": False}


def query_variable(name: str, label: str, query: str, *, multi: bool, include_all: bool,
                   all_value: str | None = None, sort: int = 1) -> Json:
    """A variable from label_values(); sort 1 alphabetical, 3 numerical, 4 numerical desc."""
    return {"name": name, "label": label, "type": "query", "datasource": DS, "query": query,
            "definition": query, "current": {}, "hide": 0, "includeAll": include_all,
            "allValue": all_value, "multi": multi, "options": [], "refresh": 2, "regex": "",
            "sort": sort, "skipUrlSync": False}


def job_variable() -> Json:
    return query_variable("job", "Job", "label_values(gpunet_exporter_build_info, job)",
                          multi=True, include_all=True)


def instance_variable(*, multi: bool) -> Json:
    return query_variable(
        "instance", "Node", 'label_values(gpunet_exporter_build_info{job=~"$job"}, instance)',
        multi=multi, include_all=multi, all_value=".+" if multi else None)


def dashboard(uid: str, title: str, description: str, layout: Layout,
              variables: list[Json]) -> Json:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "liveNow": False,
        "fiscalYearStartMonth": 0,
        "refresh": "1m",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "weekStart": "",
        "links": [{"title": "gpunet dashboards", "type": "dashboards", "tags": [TAG],
                   "asDropdown": True, "includeVars": True, "keepTime": True,
                   "icon": "external link", "targetBlank": False, "tooltip": "", "url": ""}],
        "annotations": {"list": [
            {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
             "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
             "name": "Annotations & Alerts", "type": "dashboard"},
            {"datasource": DS, "enable": True, "hide": False, "iconColor": "red",
             "name": "Gpunet alerts firing",
             "expr": sel("ALERTS", 'alertstate="firing"', 'alertname=~"Gpunet.*"'),
             "step": "60s", "titleFormat": "{{alertname}}",
             "textFormat": "{{instance}} {{device}} {{interface}} {{gpu}}",
             "tagKeys": "class,severity", "useValueForTime": False},
        ]},
        "templating": {"list": [datasource_variable(), *variables]},
        "panels": layout.panels,
    }


# --- fleet ---


def port_legend(what: str) -> str:
    return "{{device}}/{{port}} " + what


# --- NCCL jobs, from NCCL's RAS service (gpunet_exporter.collectors.nccl; both the node and
# collectives dashboards show them)

RAS_ANSWER = mapping((1, "answered", "green"), (0, "NO ANSWER", "red"))
JOB_COLUMNS = (  # (column, metric, matchers)
    ("listening", "gpunet_nccl_ras_listeners", ()),
    ("answered", "gpunet_nccl_ras_query_success", ()),
    ("nodes", "gpunet_nccl_job_nodes", ()),
    ("GPUs", "gpunet_nccl_job_gpus", ()),
    ("processes", "gpunet_nccl_job_processes", ('state="answering"',)),
    ("dead", "gpunet_nccl_job_processes", ('state="dead"',)),
    ("ranks missing", "gpunet_nccl_communicator_ranks", ('state="missing"',)),
    ("ranks errored", "gpunet_nccl_ranks_errored", ()),
    ("ranks stalled", "gpunet_nccl_stalled_ranks", ()),
)


def nccl_jobs_table(title: str = "NCCL jobs") -> Json:
    """One row per node and RAS port: the job as RAS reported it last."""
    bad = steps(("green", None), ("red", 1))
    return table(
        title, "Each NCCL job on the selected nodes, one row per node and RAS port (28028 "
        "unless the job set NCCL_RAS_ADDR), from NCCL's RAS service (NCCL 2.24 or later; the "
        "nccl collector). listening: NCCL processes listening on this node (0: no job); "
        "answered: whether RAS gave a report (NO ANSWER while processes listen: a stopped or "
        "hung process, GpunetNcclRasUnreachable); nodes, GPUs and answering processes are the "
        "whole job's; dead, ranks missing, errored and stalled should be 0 (red: "
        "GpunetNcclRankDead, GpunetNcclRankUnreachable, GpunetNcclRankStalled). Every node of a "
        "job reports the same job.",
        [target(f"max by (instance, job, port) ({sel(metric, *m)})", table=True)
         for _, metric, m in JOB_COLUMNS], "short",
        rename={f"Value #{chr(ord('A') + i)}": col for i, (col, _, _) in enumerate(JOB_COLUMNS)},
        order=["instance", "port", *(col for col, _, _ in JOB_COLUMNS)], decimals=0,
        overrides=[override("answered", ("mappings", RAS_ANSWER),
                            ("custom.cellOptions", {"type": "color-text"})),
                   *(override(col, ("thresholds", bad),
                              ("custom.cellOptions", {"type": "color-text"}))
                     for col in ("dead", "ranks missing", "ranks errored", "ranks stalled"))])


def nccl_job_panels(lay: Layout, legend: str) -> None:
    """The jobs' trouble over time (legend: how a series names its node and port)."""
    lay.add(timeseries("NCCL processes by state", "The job's processes as RAS sees them: "
                       "answering, unresponsive (did not answer this report) and dead (RAS "
                       "gave up on them after 60 s; GpunetNcclRankDead). Dead or unresponsive "
                       "processes stall the whole job.",
                       [target(sel("gpunet_nccl_job_processes"), legend + " {{state}}")],
                       "short"), 12, 8)
    lay.add(timeseries("NCCL missing and stuck ranks", "Ranks missing from their "
                       "communicators by reason (unreachable: their process did not answer; "
                       "dead; not_member: during init or teardown), ranks holding an error, and "
                       "stalled ranks: behind their communicator's leader with counts that did "
                       "not move between two reports (GpunetNcclRankStalled).",
                       [target(sel("gpunet_nccl_missing_ranks"), legend + " missing {{reason}}"),
                        target(sel("gpunet_nccl_ranks_errored"), legend + " errored"),
                        target(sel("gpunet_nccl_stalled_ranks"), legend + " stalled")],
                       "short"), 12, 8)
    lay.add(timeseries("NCCL collective-count skew", "Per operation, the largest difference "
                       "within one communicator between the counts of collectives its ranks "
                       "launched. Small and moving is healthy; a flat, non-zero skew is a rank "
                       "left behind while the others wait.",
                       [target(sel("gpunet_nccl_collective_skew_operations"),
                               legend + " {{op}}")], "short"), 12, 8)
    lay.add(state_timeline("NCCL RAS answered", "Whether the latest query of a listening RAS "
                           "port got a report. NO ANSWER: the processes listen but none "
                           "answered (stopped, hung); the job's figures are then missing, not "
                           "healthy.",
                           [target(sel("gpunet_nccl_ras_query_success"), legend)],
                           mappings=RAS_ANSWER), 12, 8)


def iter_panels(dashboard: Json) -> Iterator[Json]:
    """Every panel, rows and the panels nested in collapsed rows included."""
    for p in dashboard.get("panels", []):
        yield p
        yield from p.get("panels", [])


def queries(dashboard: Json) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, nested rows included."""
    return [(p.get("title", ""), t["expr"]) for p in iter_panels(dashboard)
            for t in p.get("targets", []) if t.get("expr")]


def annotation_queries(dashboard: Json) -> list[tuple[str, str]]:
    """(annotation name, expr) of the dashboard's Prometheus annotations."""
    return [(a["name"], a["expr"]) for a in dashboard.get("annotations", {}).get("list", [])
            if a.get("expr")]


def variable_queries(dashboard: Json) -> list[tuple[str, str]]:
    """(variable name, query) of the dashboard's query variables (label_values(...))."""
    return [(v["name"], v["query"]) for v in dashboard.get("templating", {}).get("list", [])
            if v.get("type") == "query"]


# Values for Grafana's built-in and this file's variables when a caller gives none. Multi-value
# variables with All become ".+", as the dashboards' allValue does; pass "a|b" for several.
DEFAULT_VALUES = {
    "__rate_interval": "1m",
    "__interval": "15s",
    "__interval_ms": "15000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
    "instance": ".+",
    "job": ".+",
    "scope": ".+",
    "size": ".+",
    "leaf": ".+",
    "cluster": ".*",
    "datasource": "prometheus",
}

VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace $name, ${name}, ${name:format} and [[name]] by variables[name], else by
    DEFAULT_VALUES[name]; an unknown variable raises KeyError."""
    values = {**DEFAULT_VALUES, **variables}

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return VARIABLE.sub(one, expr)


CLUSTER = 'cluster=~"$cluster"'


def cluster_variable() -> Json:
    """The ``cluster`` variable of ``multi_cluster`` dashboards: several or all (any, and
    none: ``.*`` also matches a series without the label)."""
    return query_variable("cluster", "Cluster", "label_values(gpunet_exporter_build_info, "
                          "cluster)", multi=True, include_all=True, all_value=".*")


def scoped(dash: Json, selector: str | None, multi_cluster: bool) -> Json:
    """``dash`` narrowed as a thresholds file says: its ``selector`` on every selector of the
    exporters' series (the recorded ones were narrowed by the rules), and with
    ``multi_cluster`` a ``cluster`` variable after the data source, ``cluster=~"$cluster"`` on
    every selector and the variable carried by the links to the node view."""
    if selector is None and not multi_cluster:
        return dash

    def expr(text: str, cluster: bool = True) -> str:
        if selector is not None:
            text = add_matchers(text, selector, exporter_series)
        return add_matchers(text, CLUSTER) if multi_cluster and cluster else text

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        if isinstance(out.get("expr"), str):
            out["expr"] = expr(out["expr"])
        if out.get("type") == "query" and isinstance(out.get("query"), str):
            m = re.fullmatch(r"label_values\((.+), *(\w+)\)", out["query"])
            if m:  # the cluster variable's own values are not narrowed by it
                out["query"] = out["definition"] = (
                    f"label_values({expr(m.group(1), m.group(2) != 'cluster')}, "
                    f"{m.group(2)})")
        url = out.get("url")
        if multi_cluster and isinstance(url, str) and "${datasource:queryparam}" in url:
            out["url"] = url.replace("${datasource:queryparam}",
                                     "${datasource:queryparam}&${cluster:queryparam}")
        return out

    if multi_cluster:
        dash = {**dash, "templating": {**dash["templating"], "list": [
            dash["templating"]["list"][0], cluster_variable(), *dash["templating"]["list"][1:]]}}
    return walk(dash)  # type: ignore[no-any-return]


def render(dash: Json) -> str:
    return json.dumps(dash, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
