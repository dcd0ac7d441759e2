#!/usr/bin/env python3
"""Generate the gpunet Grafana dashboards from code.

    python grafana/generate.py            # rewrite grafana/gpunet-*.json
    python grafana/generate.py --check    # exit 1 naming each stale file

Five dashboards (docs/dashboards.md): the fleet overview, one node, the NCCL probes
(collectives), the pair plan of fleet probes (pairs) and one InfiniBand fabric's switches
(fabric). Every panel and query uses the
``datasource`` variable, every query filters by ``instance`` (a series without one, per job or
per leaf, by ``job``), every counter is read through ``rate``/``increase`` over
``$__rate_interval``, and every panel has a unit; tests/test_grafana.py checks all of that and
that the committed JSON is what this file generates.

Helpers for tests, importable by path (standard library only):
``dashboards()`` (file name -> dashboard), ``queries(dashboard)`` ((panel title, expr) of every
target, rows included) and ``substitute(expr, variables)`` (Grafana variables replaced by
values, so that an expression can be sent to Prometheus).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Json = dict[str, Any]

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39  # Grafana 10.4; Grafana 10.0 (schema 38) and later import it
TAG = "gpunet"
DS: Json = {"type": "prometheus", "uid": "${datasource}"}
INSTANCE = 'instance=~"$instance"'
JOB = 'job=~"$job"'
RATE_INTERVAL = "$__rate_interval"
GRID_WIDTH = 24
NODE_UID = "gpunet-node"

# Classes of the recording rule instance_class:gpunet_alerts_firing:count (alerts/), in the
# order the health matrix shows them.
ALERT_CLASSES = ("link", "congestion", "transport", "topology", "gpu", "collective", "fabric",
                 "exporter")
ALERT_RULE = "instance_class:gpunet_alerts_firing:count"

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
STALE = steps(("green", None), ("yellow", 180), ("red", 600))  # probe interval is 60 s
# gpunet_probe_state's values (gpunet_exporter.probe.idle STATES, checked by tests/test_grafana.py),
# each drawn as its position from 1 in this list.
PROBE_STATES = ("measuring", "failing", "holdoff", "yielded", "unknown")
PROBE_STATE_MAP = ((1, "measuring", "green"), (2, "FAILING", "red"), (3, "hold-off", "blue"),
                   (4, "yielded to a job", "purple"), (5, "UNKNOWN", "orange"))
# Straggler wait ratio: probe.straggler_min_ratio (0.2) names the late rank, GpunetStragglerRank
# fires above 0.5.
STRAGGLER_STEPS = steps(("green", None), ("orange", 0.2), ("red", 0.5))
# Bus bandwidth over link bandwidth: the target is 0.8, GpunetBusBandwidthBelowLinkRate fires below.
LINK_RATE_STEPS = steps(("red", None), ("green", 0.8))


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


def straggler_table(*matchers: str) -> Json:
    """The late rank each node hosts (gpunet_probe_straggler_info) with the wait it imposes."""
    info = sel("gpunet_probe_straggler_info", *matchers)

    def named(metric: str) -> str:
        return (f"{sel(metric, *matchers)} * on (instance, job, scope) group_left (rank, gpu) "
                f"{info}")

    return table(
        "Straggler ranks", "The rank the others wait for, on the node that runs it, with its "
        "local GPU: named while the others wait at least probe.straggler_min_ratio (20%) of "
        "their all-reduce time for it. wait ratio is that share (red above 50%: "
        "GpunetStragglerRank), wait the median seconds at the largest size. Empty is healthy. "
        "A rank named round after round: check that GPU's clocks and PCIe link, and its NIC.",
        [target(named("gpunet_probe_straggler_wait_ratio"), table=True),
         target(named("gpunet_probe_straggler_wait_seconds"), table=True)], "percentunit",
        rename={"Value #A": "wait ratio", "Value #B": "wait"},
        order=["instance", "scope", "rank", "gpu", "wait ratio", "wait"],
        thresholds=STRAGGLER_STEPS, sort_by="wait ratio",
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


def fleet() -> Json:
    lay = Layout()
    lay.row("Now")
    lay.add(stat("Exporters down", "Scrape targets of the selected jobs whose last scrape "
                 "failed (up == 0). Above 0: every panel is blind for those nodes; check the "
                 "node and the gpunet-exporter service.",
                 [target(count_or_zero(f"up{{{JOB}, {INSTANCE}}} == 0"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Nodes with firing gpunet alerts", "Nodes where at least one Gpunet alert "
                 "fires (recording rule " + ALERT_RULE + " from alerts/). The health matrix "
                 "below says which class.",
                 [target(count_or_zero(f"sum by (instance) ({sel(ALERT_RULE)}) > 0"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("IB/RoCE ports not ACTIVE", "RDMA ports whose logical state is not ACTIVE "
                 "(4). A port that should carry traffic and is DOWN or INIT cuts that NIC out "
                 "of NCCL; the table below names them.",
                 [target(count_or_zero(sel("gpunet_infiniband_port_state_id") + " != 4"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("Ports below expected rate", "Active ports running below their expected "
                 "rate (e.g. NDR trained down to HDR, 4X to 2X). Each one slows every "
                 "all-reduce it is in.",
                 [target(sum_or_zero(sel("gpunet_infiniband_port_rate_degraded")))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Nodes with NCCL socket fallback", "Nodes whose last probe saw NCCL send "
                 "over TCP sockets although an RDMA port is ACTIVE (or intra-node traffic on "
                 "the network). Orders of magnitude slower; the net scope checks every node's "
                 "own NICs. Needs the probe collector; see the Collectives dashboard.",
                 [target(count_or_zero("max by (instance) ("
                                       + sel("gpunet_probe_socket_fallback") + ") == 1"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("Nodes with GPUDirect RDMA not ready", "GPU nodes with neither a "
                 "peer-memory module (nvidia_peermem) loaded nor DMA-BUF support: NCCL "
                 "copies every network transfer through host memory.",
                 [target(count_or_zero(sel("gpunet_topology_gdr_ready") + " == 0"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("GPUs with a degraded PCIe link", "Busy GPUs whose PCIe link runs below its "
                 "maximum generation, or any GPU with fewer lanes than its maximum.",
                 [target(sum_or_zero(sel("gpunet_gpu_pcie_link_degraded")))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Lost or missing GPUs", "GPUs NVML reports lost (fallen off the bus) plus "
                 "GPUs enumerated earlier that are gone. Above 0: the node needs a GPU reset "
                 "or a reboot.",
                 [target(f"({sum_or_zero(sel('gpunet_gpu_lost'))}) + "
                         f"({sum_or_zero(sel('gpunet_gpu_missing'))})")], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("MTU mismatches", "Netdevs and RDMA ports whose MTU differs from the "
                 "configured expectation (netdev MTU plus active RDMA MTU). A RoCE netdev at "
                 "1500 halves large-message bandwidth.",
                 [target(f"({sum_or_zero(sel('gpunet_link_mtu_mismatch'))}) + "
                         f"({sum_or_zero(sel('gpunet_link_rdma_mtu_mismatch'))})")], "short",
                 thresholds=OK_ORANGE), 4, 4)
    lay.add(stat("Nodes with a failing collector", "Nodes where a collector raised or timed "
                 "out in the last scrape: its metrics are missing, so other panels may look "
                 "healthy for the wrong reason.",
                 [target(count_or_zero("min by (instance) ("
                                       + sel("gpunet_scrape_collector_success") + ") == 0"))],
                 "short", thresholds=OK_ORANGE), 4, 4)
    lay.add(stat("Nodes below 80% of the link rate", "Nodes whose probe all-reduce through "
                 "the RDMA ports reaches less than 80% of the bus bandwidth those links allow "
                 "(gpunet_probe_bus_bandwidth_link_ratio < 0.8; GpunetBusBandwidthBelowLinkRate "
                 "after 10 minutes). Check the nodes in the bottom 10 below: GPUDirect RDMA "
                 "off, a GPU far from its NIC, PFC pauses or a slow PCIe link.",
                 [target(count_or_zero("min by (instance) ("
                                       + sel("gpunet_probe_bus_bandwidth_link_ratio")
                                       + ") < 0.8"))], "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("Nodes with a straggler rank", "Nodes that run a probe rank the others wait "
                 "for more than half of their all-reduce time (the condition of "
                 "GpunetStragglerRank): that GPU, its PCIe link or its NIC is slow. The "
                 "Straggler ranks table below names rank and GPU.",
                 [target(count_or_zero(
                     "count by (instance) (" + sel("gpunet_probe_straggler_wait_ratio")
                     + " * on (instance, job, scope) group_left (rank, gpu) "
                     + sel("gpunet_probe_straggler_info") + " > 0.5)"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Lowest probe bus bandwidth at $size B", "Lowest all-reduce bus bandwidth "
                 "over the selected nodes at the message size chosen above (defaults to the "
                 "largest), per scope. Compare with the fleet's usual value; the Collectives "
                 "dashboard has the detail.",
                 [target("min by (scope) (" + sel(
                     "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", 'size=~"$size"')
                     + ")", "{{scope}}")], "Bps", text_mode="value_and_name"), 8, 4)
    lay.add(stat("Lowest bus bandwidth / link rate", "Per scope, the lowest share of the "
                 "link rate a node's probe all-reduce reached at the largest size (bus "
                 "bandwidth over the lowest RDMA port rate per rank). 80% or more is the "
                 "target; red below. Scopes that use no RDMA port (intra) have no value.",
                 [target("min by (scope) (" + sel("gpunet_probe_bus_bandwidth_link_ratio")
                         + ")", "{{scope}}")], "percentunit", thresholds=LINK_RATE_STEPS,
                 text_mode="value_and_name"), 8, 4)
    lay.add(stat("Idle GPUs without a probe round", "The probe runs only on idle GPUs "
                 "(docs/probe.md). Over the nodes whose GPUs are idle, the longest time since "
                 "the later of the node's last complete round and the start of its idle time; "
                 "0 when none waits. Rounds run every minute by default: minutes means the "
                 "probe is failing or stuck (GpunetProbeStale). Nodes busy with jobs never "
                 "count.", [target(idle_without_round())], "s", thresholds=STALE), 8, 4)

    lay.row("Health matrix")
    cells = override("instance\\class", ("displayName", "node"), ("links", NODE_LINK),
                     ("custom.cellOptions", {"type": "auto"}))
    lay.add(table(
        "Firing gpunet alerts by node and problem class",
        "One row per node, one column per problem class; the number is how many Gpunet "
        "alerts fire. Green 0 is healthy, red is not. Click a node for its node view. Needs "
        "the recording rules in alerts/gpunet.rules.yml loaded into Prometheus.",
        [target(sel(ALERT_RULE), table=True)], "short",
        transformations=[
            {"id": "groupingToMatrix", "options": {
                "columnField": "class", "rowField": "instance", "valueField": "Value"}},
            {"id": "calculateField", "options": {
                "mode": "reduceRow", "reduce": {"reducer": "sum"}, "alias": "total",
                "replaceFields": False}},
        ],
        order=["instance\\class", *ALERT_CLASSES, "total"], thresholds=OK_RED,
        cell="color-background", overrides=[cells], sort_by="total", decimals=0), 24, 10)
    lay.add(state_timeline(
        "Firing gpunet alerts per node over time",
        "Per node, how many Gpunet alerts fired when: red bands show when a node went bad.",
        [target(f"sum by (instance) ({sel(ALERT_RULE)})", "{{instance}}")],
        mappings=mapping((0, "ok", "green")), unit="short", kind="status-history"), 24, 8)
    lay.add(timeseries("Firing gpunet alerts by class", "Alerts firing across the selected "
                       "nodes per problem class. A rise in one class across many nodes "
                       "points at the fabric or a fleet-wide change rather than one host.",
                       [target(f"sum by (class) ({sel(ALERT_RULE)})", "{{class}}")], "short"),
            12, 8)
    lay.add(timeseries("Exporters up", "Targets of the selected jobs that answered their "
                       "last scrape, against all targets.",
                       [target(f"sum(up{{{JOB}, {INSTANCE}}})", "up"),
                        target(f"count(up{{{JOB}, {INSTANCE}}})", "targets")], "short",
                       legend_table=False), 12, 8)

    lay.row("Links and ports")
    state_col = override("state", ("mappings", PORT_STATE),
                         ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table(
        "Ports not ACTIVE", "RDMA ports whose logical state is not ACTIVE, with their "
        "netdev. Empty is healthy. DOWN/Polling: no cable, dead optic or switch port; INIT: "
        "link up but no subnet manager has configured the port.",
        [target(f"({sel('gpunet_infiniband_port_state_id')} != 4) * on (instance, job, "
                f"device, port) group_left (link_layer, interface) "
                f"{sel('gpunet_infiniband_port_info')}", table=True)], "none",
        rename={"Value": "state"}, overrides=[state_col]), 12, 8)
    lay.add(table(
        "Ports below expected rate", "Active ports running slower than expected (actual "
        "against expected data rate). Empty is healthy. Reseat or replace the cable/optic, "
        "or check the switch port.",
        [target(f"{sel('gpunet_infiniband_port_rate_bytes_per_second')} and on (instance, "
                f"job, device, port) ({sel('gpunet_infiniband_port_rate_degraded')} == 1)",
                table=True),
         target(f"{sel('gpunet_infiniband_port_rate_expected_bytes_per_second')} and on "
                f"(instance, job, device, port) "
                f"({sel('gpunet_infiniband_port_rate_degraded')} == 1)", table=True)],
        "Bps", rename={"Value #A": "actual", "Value #B": "expected"}), 12, 8)
    lay.add(timeseries(
        "Link down events by node (top 10)", "Netdev carrier changes and InfiniBand "
        "LinkDowned events per interval. Any non-zero value is a flap: NCCL jobs on that "
        "node see timeouts or retries.",
        [target("topk(10, sum by (instance) (" + increase("gpunet_link_carrier_changes_total")
                + "))", "{{instance}} carrier changes"),
         target("topk(10, sum by (instance) (" + increase("gpunet_infiniband_port_link_downed_"
                                                          "total") + "))",
                "{{instance}} IB link downed")], "short", bars=True), 12, 8)
    lay.add(timeseries(
        "Symbol errors by node (top 10)", "InfiniBand symbol errors per second, summed over "
        "a node's ports. A sustained rate points at a bad cable or optic; the node view "
        "names the port.",
        [target("topk(10, sum by (instance) (" + rate("gpunet_infiniband_port_symbol_errors_"
                                                      "total") + "))", "{{instance}}")],
        "cps"), 12, 8)

    lay.row("Congestion")
    lay.add(timeseries(
        "Time paused by PFC, worst priority (top 10)", "Fraction of time a node's worst "
        "interface/priority/direction spent paused by PFC. rx: the switch paused us; tx: we "
        "paused the switch. Sustained above a few percent is congestion, near 100% a pause "
        "storm.",
        [target("topk(10, max by (instance) (" + rate("gpunet_pfc_pause_duration_seconds_"
                                                      "total") + "))", "{{instance}}")],
        "percentunit", thresholds=steps(("green", None), ("orange", 0.1), ("red", 0.5)),
        show_thresholds=True), 12, 8)
    lay.add(timeseries(
        "Discards by node (top 10)", "Packets dropped on per-priority queues (must stay at "
        "0 on the lossless RoCE priority) and by the physical port for lack of buffer.",
        [target("topk(10, sum by (instance) (" + rate("gpunet_pfc_priority_discards_total")
                + "))", "{{instance}} priority discards"),
         target("topk(10, sum by (instance) (" + rate("gpunet_pfc_port_discards_total")
                + "))", "{{instance}} port discards")], "pps"), 12, 8)
    lay.add(timeseries(
        "RDMA ACK timeouts and out-of-sequence packets by node (top 10)", "Transport-level "
        "signs of packet loss: QP ACK timeouts and out-of-sequence packets per second. A "
        "rising rate means loss on the fabric or a dead peer.",
        [target("topk(10, sum by (instance) (" + rate(
            "gpunet_infiniband_port_hw_local_ack_timeouts_total") + "))",
                "{{instance}} ACK timeouts"),
         target("topk(10, sum by (instance) (" + rate(
             "gpunet_infiniband_port_hw_out_of_sequence_packets_total") + "))",
                "{{instance}} out of sequence")], "cps"), 12, 8)
    lay.add(timeseries(
        "CNPs sent by node (top 10)", "Congestion notification packets the NIC sent after "
        "receiving ECN-marked RoCE packets: how much congestion the switches signal toward "
        "this node. High and steady means a congested path.",
        [target("topk(10, sum by (instance) (" + rate("gpunet_infiniband_port_hw_np_cnp_"
                                                      "sent_total") + "))", "{{instance}}")],
        "pps"), 12, 8)

    lay.row("GPUs, topology and collectives")
    count_cols = {"Value #A": "PCIe degraded GPUs", "Value #B": "lost GPUs",
                  "Value #C": "GPUs with a remote-NUMA NIC", "Value #D": "GDR not ready",
                  "Value #E": "GPUs with an XID in the last hour"}
    lay.add(table(
        "Nodes with GPU or GPUDirect problems", "Only nodes with a problem appear; empty is "
        "healthy. Click a node for the detail.",
        [target(f"sum by (instance) ({sel('gpunet_gpu_pcie_link_degraded')}) > 0",
                table=True),
         target(f"sum by (instance) ({sel('gpunet_gpu_lost')}) > 0", table=True),
         target(f"sum by (instance) ({sel('gpunet_topology_gpu_nearest_nic_numa_mismatch')})"
                " > 0", table=True),
         target(f"max by (instance) (1 - {sel('gpunet_topology_gdr_ready')}) > 0",
                table=True),
         target(f"count by (instance) (time() - "
                f"{sel('gpunet_gpu_xid_last_timestamp_seconds')} < 3600)", table=True)],
        "short", rename=count_cols, thresholds=OK_RED, cell="color-text", decimals=0), 12, 8)
    lay.add(table(
        "NCCL problems seen by the probe", "Problems the NCCL log of each node's last "
        "successful probe round shows (socket_fallback, gdr_disabled, no_ib_device, ...; "
        "docs/nccl-log.md). Empty is healthy.",
        [target(sel("gpunet_probe_nccl_problem"), table=True)], "none",
        order=["instance", "scope", "problem"],
        overrides=[override("Value", ("custom.hidden", True))]), 12, 8)
    lay.add(timeseries(
        "Lowest bus bandwidth at $size B (bottom 10 nodes)", "The ten slowest nodes by probe "
        "bus bandwidth at the chosen size. A node far below the others has a slow GPU, PCIe "
        "link or NIC.",
        [target("bottomk(10, min by (instance, scope) (" + sel(
            "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", 'size=~"$size"') + "))",
                "{{instance}} {{scope}}")], "Bps"), 12, 8)
    lay.add(timeseries(
        "Bus bandwidth / link rate (bottom 10 nodes)", "The ten nodes whose probe all-reduce "
        "at the largest size gets the least of what their RDMA links allow (bus bandwidth "
        "over the lowest port rate per rank sharing it). net: the node's GPUs through its own "
        "NICs. Below 80% (red line) for 10 minutes fires GpunetBusBandwidthBelowLinkRate: "
        "check GPUDirect RDMA, the GPU-NIC path, PFC pauses and the NIC's PCIe link.",
        [target("bottomk(10, min by (instance, scope) ("
                + sel("gpunet_probe_bus_bandwidth_link_ratio") + "))",
                "{{instance}} {{scope}}")], "percentunit", thresholds=LINK_RATE_STEPS,
        show_thresholds=True), 12, 8)
    lay.add(timeseries(
        "Straggler wait (top 10 nodes)", "Share of their all-reduce time the other ranks "
        "spend waiting for the rank that arrives last (largest size, median over "
        "iterations). 0.5 = they took twice as long as the collective itself; above 50% "
        "(red line) for 10 minutes fires GpunetStragglerRank. In the inter scope every node "
        "of the round shows the same wait; the table beside names the late rank's node.",
        [target("topk(10, max by (instance, scope) ("
                + sel("gpunet_probe_straggler_wait_ratio") + "))",
                "{{instance}} {{scope}}")], "percentunit", thresholds=STRAGGLER_STEPS,
        show_thresholds=True, max_value=1), 12, 8)
    lay.add(straggler_table(), 12, 8)

    lay.row("Exporter health", collapsed=True)
    lay.add(table(
        "Failing collectors per node (top 20)", "How many collectors raised or timed out in "
        "the last scrape; their metrics are missing for that node. 0 is healthy; the node "
        "view's Exporter row names them.",
        [target("topk(20, sum by (instance) (1 - " + sel("gpunet_scrape_collector_success")
                + "))", table=True)], "short",
        rename={"Value": "failing collectors"}, thresholds=OK_RED, cell="color-text",
        decimals=0), 12, 8)
    lay.add(timeseries(
        "Slowest collectors (top 10)", "Time a collector took in the scrape. Near the "
        "scrape timeout means scrapes will start failing.",
        [target("topk(10, max by (instance, collector) ("
                + sel("gpunet_scrape_collector_duration_seconds") + "))",
                "{{instance}} {{collector}}")], "s"), 12, 8)

    return dashboard(
        "gpunet-fleet", "gpunet / Fleet overview",
        "Which GPU nodes have network, GPU, topology or NCCL problems, by class.", lay,
        [job_variable(), instance_variable(multi=True),
         query_variable("size", "Probe size (bytes)",
                        "label_values(gpunet_probe_allreduce_bus_bandwidth_bytes_per_second, "
                        "size)", multi=False, include_all=False, sort=4)])


# --- node ---


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


def node() -> Json:
    lay = Layout()
    lay.row("Summary")
    lay.add(stat("Firing gpunet alerts by class", "How many Gpunet alerts fire on this node, "
                 "per problem class (rows below: link and congestion = ports, links, PFC; "
                 "transport = RDMA counters; gpu; topology; collective = probes and NCCL "
                 "jobs). Needs the rules in alerts/ loaded.",
                 [target(sel(ALERT_RULE), "{{class}}")], "short", thresholds=OK_RED,
                 text_mode="value_and_name"), 24, 3)
    lay.add(stat("Exporter", "Whether Prometheus reached the exporter on its last scrape.",
                 [target(f"up{{{JOB}, {INSTANCE}}}")], "none",
                 mappings=mapping((1, "UP", "green"), (0, "DOWN", "red"))), 4, 4)
    lay.add(stat("Ports ACTIVE / all", "RDMA ports in logical state ACTIVE, and all RDMA "
                 "ports. Fewer active than expected: see Port logical state below.",
                 [target(count_or_zero(sel("gpunet_infiniband_port_state_id") + " == 4"),
                         "active"),
                  target(count_or_zero(sel("gpunet_infiniband_port_state_id")), "all")],
                 "short", text_mode="value_and_name"), 4, 4)
    lay.add(stat("GPUs", "GPUs NVML enumerates now, and GPUs it enumerated before that are "
                 "gone (missing > 0 is bad).",
                 [target(count_or_zero(sel("gpunet_gpu_info")), "present"),
                  target(sel("gpunet_gpu_missing"), "missing")], "short",
                 text_mode="value_and_name"), 4, 4)
    lay.add(stat("GPUDirect RDMA ready", "Host side of GPUDirect RDMA: a peer-memory module "
                 "loaded or DMA-BUF capable. NO: NCCL bounces GPU data through host memory.",
                 [target(sel("gpunet_topology_gdr_ready"))], "none", mappings=GOOD_WHEN_1),
            4, 4)
    lay.add(stat("Collectors failing", "Collectors that raised or timed out in the last "
                 "scrape (see the Exporter row). Their panels below are empty, not healthy.",
                 [target(count_or_zero(sel("gpunet_scrape_collector_success") + " == 0"))],
                 "short", thresholds=OK_ORANGE), 4, 4)
    lay.add(stat("Exporter version", "Version of gpunet-exporter on this node.",
                 [target(sel("gpunet_exporter_build_info"), "{{version}}")], "none",
                 text_mode="name"), 4, 4)

    lay.row("InfiniBand / RoCE ports")
    lay.add(state_timeline("Port logical state", "ACTIVE is the only state that carries "
                           "traffic. DOWN: no link; INIT: link up, waiting for the subnet "
                           "manager; ARMED: configured, not yet active.",
                           [target(sel("gpunet_infiniband_port_state_id"), "{{device}}/{{port}}")],
                           mappings=PORT_STATE), 12, 8)
    lay.add(state_timeline("Port physical state", "LinkUp is healthy. Polling: no peer (cable "
                           "or optic out, switch port down); LinkErrorRecovery or Training "
                           "flickering: a marginal link.",
                           [target(sel("gpunet_infiniband_port_phys_state_id"),
                                   "{{device}}/{{port}}")], mappings=PHYS_STATE), 12, 8)
    lay.add(timeseries(
        "Port rate vs expected", "Active data rate of each port (solid) against the rate it "
        "should run at (dashed; config rules, or the fastest port of the same type). A solid "
        "line below its dashed one is a port trained down.",
        [target(sel("gpunet_infiniband_port_rate_bytes_per_second"), port_legend("actual")),
         target(sel("gpunet_infiniband_port_rate_expected_bytes_per_second"),
                port_legend("expected"))], "Bps",
        overrides=[override("/expected$/", ("custom.lineStyle",
                                            {"fill": "dash", "dash": [10, 10]}), regex=True)]),
        12, 8)
    lay.add(state_timeline("Port rate degraded", "DEGRADED (red): the active port runs below "
                           "its expected rate; every all-reduce through it slows down.",
                           [target(sel("gpunet_infiniband_port_rate_degraded"),
                                   "{{device}}/{{port}}")],
                           mappings=mapping((0, "ok", "green"), (1, "DEGRADED", "red"))),
            12, 8)
    lay.add(timeseries(
        "Physical link errors", "Per second: symbol errors (bad cable or optic), link error "
        "recoveries (retrains), link downed (flaps) and local link integrity errors. "
        "Healthy links stay at 0.",
        [target(rate("gpunet_infiniband_port_symbol_errors_total"), port_legend("symbol")),
         target(rate("gpunet_infiniband_port_link_error_recoveries_total"),
                port_legend("recovery")),
         target(rate("gpunet_infiniband_port_link_downed_total"), port_legend("downed")),
         target(rate("gpunet_infiniband_port_local_link_integrity_errors_total"),
                port_legend("integrity"))], "cps"), 12, 8)
    lay.add(timeseries(
        "Packet errors and discards", "Per second: received packets with errors, packets "
        "marked bad upstream (remote physical), transmit discards (port down or congested) "
        "and buffer overruns. Should stay at 0.",
        [target(rate("gpunet_infiniband_port_receive_errors_total"), port_legend("rcv err")),
         target(rate("gpunet_infiniband_port_receive_remote_physical_errors_total"),
                port_legend("remote phys")),
         target(rate("gpunet_infiniband_port_transmit_discards_total"),
                port_legend("xmit discard")),
         target(rate("gpunet_infiniband_port_excessive_buffer_overrun_errors_total"),
                port_legend("overrun"))], "pps"), 12, 8)
    lay.add(timeseries(
        "Port traffic", "Bytes per second transmitted (up) and received (down) per port.",
        [target(rate("gpunet_infiniband_port_transmitted_bytes_total"), port_legend("tx")),
         target(rate("gpunet_infiniband_port_received_bytes_total"), port_legend("rx"))],
        "Bps", min_value=None,
        overrides=[override("/ rx$/", ("custom.transform", "negative-Y"), regex=True)]),
        12, 8)
    lay.add(timeseries(
        "Transmit wait (credit starvation)", "Ticks per second a port had data but no "
        "flow-control credits (PortXmitWait; a tick is a few ns). Sustained growth means "
        "congestion downstream.",
        [target(rate("gpunet_infiniband_port_transmit_wait_ticks_total"),
                "{{device}}/{{port}}")], "short"), 12, 8)
    lay.add(timeseries(
        "RDMA transport errors", "Per second: QP ACK timeouts and out-of-sequence packets "
        "(loss on the fabric), RNR NAKs, receive-queue out-of-buffer drops, and requests "
        "that exhausted transport retries (NCCL fails with status 12; must stay 0).",
        [target(rate("gpunet_infiniband_port_hw_local_ack_timeouts_total"),
                port_legend("ACK timeout")),
         target(rate("gpunet_infiniband_port_hw_out_of_sequence_packets_total"),
                port_legend("out of seq")),
         target(rate("gpunet_infiniband_port_hw_rnr_nak_received_total"),
                port_legend("RNR NAK")),
         target(rate("gpunet_infiniband_port_hw_out_of_buffer_drops_total"),
                port_legend("out of buffer")),
         target(rate("gpunet_infiniband_port_hw_requester_transport_retries_exceeded_total"),
                port_legend("retries exceeded"))], "cps"), 24, 8)

    lay.row("Links (netdev) and MTU")
    mismatch_col = override("mismatch", ("mappings", mapping((0, "ok", "green"),
                                                             (1, "MISMATCH", "red"))),
                            ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table("Netdev MTU", "MTU of each RDMA netdev against the MTU the configuration "
                  "expects (empty: no rule). RoCE needs jumbo frames (typically 9000); 1500 "
                  "limits the RDMA MTU to 1024.",
                  [target(sel("gpunet_link_mtu_bytes"), table=True),
                   target(sel("gpunet_link_mtu_expected_bytes"), table=True),
                   target(sel("gpunet_link_mtu_mismatch"), table=True)], "none",
                  rename={"Value #A": "MTU", "Value #B": "expected", "Value #C": "mismatch"},
                  order=["instance", "interface"], overrides=[mismatch_col], decimals=0),
            12, 7)
    lay.add(table("Active RDMA MTU", "Active RDMA (IB transport) MTU per port against the "
                  "expected one. 4096 is the norm for NCCL; lower costs bandwidth.",
                  [target(sel("gpunet_link_rdma_active_mtu_bytes"), table=True),
                   target(sel("gpunet_link_rdma_mtu_expected_bytes"), table=True),
                   target(sel("gpunet_link_rdma_mtu_mismatch"), table=True)], "none",
                  rename={"Value #A": "active MTU", "Value #B": "expected",
                          "Value #C": "mismatch"},
                  order=["instance", "device", "port"], overrides=[mismatch_col], decimals=0),
            12, 7)
    lay.add(state_timeline("Netdev operational state", "up is healthy; down or "
                           "lowerlayerdown means no link on that interface.",
                           [target(sel("gpunet_link_operstate_id"), "{{interface}}")],
                           mappings=OPERSTATE), 12, 8)
    lay.add(timeseries("Link speed", "Negotiated speed of each netdev. A drop is a link "
                       "that renegotiated to a lower speed (cable, optic or switch port).",
                       [target(sel("gpunet_link_speed_bytes_per_second"), "{{interface}}")],
                       "Bps"), 6, 8)
    lay.add(timeseries("Carrier changes", "Carrier up/down transitions per interval: each "
                       "pair is a link flap.",
                       [target(increase("gpunet_link_carrier_changes_total"),
                               "{{interface}}")], "short", bars=True), 6, 8)

    lay.row("PFC and ECN (RoCE)")
    prio = "{{interface}} prio {{priority}}"
    lay.add(state_timeline("PFC enabled per priority", "PFC must be on for the priority RoCE "
                           "traffic uses (commonly 3) and usually off elsewhere. Off on the "
                           "RoCE priority: drops under congestion instead of pauses.",
                           [target(sel("gpunet_pfc_enabled"), prio)],
                           mappings=mapping((1, "on", "green"), (0, "off", "text")),
                           thresholds=NEUTRAL), 12, 8)
    lay.add(state_timeline("ECN (DCQCN) enabled per priority", "RoCE congestion control at "
                           "the notification point (np: marks and sends CNPs) and reaction "
                           "point (rp: slows down). Off on the RoCE priority: PFC alone "
                           "handles congestion, with pause storms.",
                           [target(sel("gpunet_pfc_ecn_enabled"), prio + " {{point}}")],
                           mappings=mapping((1, "on", "green"), (0, "off", "orange")),
                           thresholds=NEUTRAL), 12, 8)
    lay.add(timeseries("PFC pause frames per priority", "Pause frames per second. rx: the "
                       "switch paused us; tx: we paused the switch (our receive buffer "
                       "filled). Bursts are normal; steady high rates are congestion.",
                       [target(rate("gpunet_pfc_pause_frames_total"),
                               prio + " {{direction}}")], "pps"), 12, 8)
    lay.add(timeseries("Time paused by PFC per priority", "Fraction of time paused. rx: we "
                       "could not send; tx: we held the peer. Sustained above a few percent "
                       "costs bandwidth; near 100% is a pause storm.",
                       [target(rate("gpunet_pfc_pause_duration_seconds_total"),
                               prio + " {{direction}}")], "percentunit",
                       thresholds=steps(("green", None), ("orange", 0.1), ("red", 0.5)),
                       show_thresholds=True), 12, 8)
    lay.add(timeseries("Discards and pause storms", "Packets per second dropped per priority "
                       "(must be 0 on the lossless priority) and by the port for lack of "
                       "buffer, plus pause-storm errors (the NIC gave up pausing; drops "
                       "follow).",
                       [target(rate("gpunet_pfc_priority_discards_total"),
                               prio + " {{direction}} discards"),
                        target(rate("gpunet_pfc_port_discards_total"),
                               "{{interface}} port {{direction}} discards"),
                        target(rate("gpunet_pfc_pause_storm_error_events_total"),
                               "{{interface}} pause storm errors")], "pps"), 12, 8)
    lay.add(timeseries("ECN marks and CNPs", "Per second: ECN-marked RoCE packets received "
                       "and CNPs sent (notification point), CNPs handled (reaction point "
                       "slowed down) and ignored (must be 0 with congestion control on). "
                       "Port-level hw_counters.",
                       [target(rate("gpunet_infiniband_port_hw_np_ecn_marked_roce_packets_"
                                    "total"), port_legend("ECN marked rx")),
                        target(rate("gpunet_infiniband_port_hw_np_cnp_sent_total"),
                               port_legend("CNP sent")),
                        target(rate("gpunet_infiniband_port_hw_rp_cnp_handled_total"),
                               port_legend("CNP handled")),
                        target(rate("gpunet_infiniband_port_hw_rp_cnp_ignored_total"),
                               port_legend("CNP ignored"))], "pps"), 12, 8)
    lay.add(timeseries("Ethernet physical errors", "Per second on the physical port: "
                       "received frames with a bad CRC and symbol errors FEC could not "
                       "correct (lost traffic). Non-zero: cable, optic or switch port.",
                       [target(rate("gpunet_pfc_crc_errors_total"), "{{interface}} CRC"),
                        target(rate("gpunet_pfc_fec_uncorrected_symbol_errors_total"),
                               "{{interface}} FEC uncorrected")], "cps"), 24, 7)

    lay.row("GPUs")
    gpu = "GPU {{gpu}}"
    lay.add(timeseries("GPU utilization", "Fraction of time a kernel ran. Low while a job "
                       "runs (see compute processes) often means the GPU waits on the "
                       "network.",
                       [target(sel("gpunet_gpu_utilization_ratio"), gpu)], "percentunit",
                       max_value=1), 12, 8)
    lay.add(table("PCIe link: current vs max", "Current PCIe generation and width against "
                  "the maximum the GPU and slot support. An idle GPU lowering its generation "
                  "is power saving; fewer lanes, or a lower generation while busy, is "
                  "degraded (red).",
                  [target(sel("gpunet_gpu_pcie_link_generation"), table=True),
                   target(sel("gpunet_gpu_pcie_link_max_generation"), table=True),
                   target(sel("gpunet_gpu_pcie_link_width"), table=True),
                   target(sel("gpunet_gpu_pcie_link_max_width"), table=True),
                   target(sel("gpunet_gpu_pcie_link_degraded"), table=True)], "none",
                  rename={"Value #A": "gen", "Value #B": "max gen", "Value #C": "width",
                          "Value #D": "max width", "Value #E": "degraded"},
                  order=["instance", "gpu"], decimals=0,
                  overrides=[override("degraded", ("mappings", BAD_WHEN_1),
                                      ("custom.cellOptions", {"type": "color-text"}))]),
            12, 8)
    lay.add(state_timeline("PCIe link degraded", "BAD (red): the GPU's PCIe link runs below "
                           "its maximum (lanes, or generation while busy). GPU-NIC traffic "
                           "through it is capped.",
                           [target(sel("gpunet_gpu_pcie_link_degraded"), gpu)],
                           mappings=BAD_WHEN_1), 12, 6)
    lay.add(state_timeline("GPU lost", "LOST (red): NVML says the GPU fell off the bus; it "
                           "needs a reset or reboot.",
                           [target(sel("gpunet_gpu_lost"), gpu)],
                           mappings=mapping((0, "ok", "green"), (1, "LOST", "red"))), 12, 6)
    lay.add(timeseries("XID errors", "XID errors per interval by GPU and code. Codes 48, 63, "
                       "64, 74, 79, 92, 94, 95 are serious (ECC, NVLink, fallen off the "
                       "bus).",
                       [target(increase("gpunet_gpu_xid_errors_total"), gpu + " XID {{xid}}")],
                       "short", bars=True), 12, 8)
    lay.add(table("Latest XID per GPU", "The last XID code each GPU reported and how long "
                  "ago. Empty: no XID since the exporter started.",
                  [target(sel("gpunet_gpu_xid_last_code"), table=True),
                   target("time() - " + sel("gpunet_gpu_xid_last_timestamp_seconds"),
                          table=True)], "none",
                  rename={"Value #A": "XID", "Value #B": "age"}, order=["instance", "gpu"],
                  overrides=[override("age", ("unit", "s"))]), 12, 8)
    lay.add(timeseries("NVLink errors", "NVLink data-link errors per second by GPU and type, "
                       "summed over links. Non-zero baselines are normal; a rising rate is a "
                       "failing link.",
                       [target("sum by (gpu, type) (" + rate("gpunet_gpu_nvlink_errors_total")
                               + ")", gpu + " {{type}}")], "cps"), 12, 8)
    lay.add(timeseries("NVLink links active", "Active NVLink links per GPU; a drop means a "
                       "link went down and GPU-GPU traffic takes a slower path.",
                       [target("sum by (gpu) (" + sel("gpunet_gpu_nvlink_active") + ")", gpu)],
                       "short"), 12, 8)
    lay.add(timeseries("PCIe replays and recoveries", "Per second: PCIe replays "
                       "(link-level retransmissions) and link recoveries (retraining). "
                       "Rising: a marginal PCIe link, riser or slot.",
                       [target(rate("gpunet_gpu_pcie_replays_total"), gpu + " replays"),
                        target(rate("gpunet_gpu_pcie_link_recoveries_total"),
                               gpu + " recoveries")], "cps"), 12, 8)
    lay.add(timeseries("PCIe throughput", "PCIe traffic per GPU and direction.",
                       [target(sel("gpunet_gpu_pcie_throughput_bytes_per_second"),
                               gpu + " {{direction}}")], "Bps"), 12, 8)

    lay.row("Topology and GPUDirect RDMA")
    lay.add(stat("Peer-memory module", "nvidia_peermem (or nv_peer_mem) loaded. Either this "
                 "or DMA-BUF is needed for GPUDirect RDMA.",
                 [target(sel("gpunet_topology_gdr_peermem_loaded"))], "none",
                 mappings=mapping((1, "loaded", "green"), (0, "not loaded", "orange"))), 6, 4)
    lay.add(stat("DMA-BUF capable", "Open NVIDIA kernel module on Linux 5.12 or later: "
                 "GPUDirect RDMA works without a peer-memory module.",
                 [target(sel("gpunet_topology_gdr_dmabuf_capable"))], "none",
                 mappings=mapping((1, "yes", "green"), (0, "no", "orange"))), 6, 4)
    lay.add(stat("NVIDIA kernel module", "Flavor (open or proprietary) and version of the "
                 "loaded NVIDIA kernel module; DMA-BUF needs the open one.",
                 [target(sel("gpunet_topology_nvidia_kernel_module_info"),
                         "{{flavor}} {{version}}")], "none", text_mode="name"), 6, 4)
    lay.add(stat("GPU-NIC pairs with ACS redirect", "GPU/RDMA-device pairs with a PCI bridge "
                 "between them that redirects peer-to-peer traffic to the root complex "
                 "(ACS), which cripples GPUDirect RDMA. Should be 0.",
                 [target(count_or_zero(sel("gpunet_topology_gpu_nic_acs_redirect_bridges")
                                       + " > 0"))], "short", thresholds=OK_RED), 6, 4)
    numa_col = override("NUMA", ("mappings", mapping((0, "same node", "green"),
                                                     (1, "OTHER NODE", "red"),
                                                     (-1, "unknown", "text"))),
                        ("custom.cellOptions", {"type": "color-text"}))
    path_col = override("path", ("mappings", PCIE_PATH),
                        ("custom.cellOptions", {"type": "color-text"}))
    nearest = sel("gpunet_topology_gpu_nearest_nic")
    lay.add(table("Nearest NIC per GPU", "Each GPU's nearest RDMA device and the PCIe path "
                  "to it (PIX/PXB: behind a shared PCIe switch, best; PHB: through the host "
                  "bridge; NODE: same NUMA node; SYS: across sockets, bad). NUMA OTHER NODE "
                  "(red): the nearest NIC is on the other socket.",
                  [target(f"{nearest} * on (instance, job, gpu) group_left () "
                          f"{sel('gpunet_topology_gpu_nearest_nic_numa_mismatch')} "
                          f"or {nearest} * -1", table=True)], "none",
                  rename={"Value": "NUMA"}, order=["instance", "gpu", "device", "path"],
                  overrides=[numa_col, path_col]), 10, 9)
    lay.add(table("PCIe path between every GPU and RDMA device", "nvidia-smi topo -m for "
                  "GPU-NIC pairs: one row per GPU, one column per RDMA device.",
                  [target(sel("gpunet_topology_gpu_nic_path"), table=True)], "none",
                  transformations=[{"id": "groupingToMatrix", "options": {
                      "columnField": "device", "rowField": "gpu", "valueField": "path"}}],
                  mappings=PCIE_PATH, cell="color-text"), 14, 9)
    lay.add(table("NCCL environment findings", "GPU processes whose environment sets an "
                  "NCCL variable that hurts the network path (IB, GDR or P2P disabled, "
                  "sockets forced, unknown devices), per check. Every check is listed; 0 is "
                  "healthy.",
                  [target(sel("gpunet_topology_nccl_env_findings"), table=True)],
                  "short", rename={"Value": "processes"}, thresholds=OK_RED,
                  cell="color-text", order=["instance", "variable", "issue"]), 24, 6)

    lay.row("NCCL jobs (RAS)")
    lay.add(nccl_jobs_table("NCCL jobs on this node"), 24, 5)
    nccl_job_panels(lay, "port {{port}}")

    lay.row("Exporter", collapsed=True)
    lay.add(state_timeline("Collector success", "Per collector, whether the last scrape "
                           "finished without an exception in time. FAILED: its metrics are "
                           "missing.",
                           [target(sel("gpunet_scrape_collector_success"), "{{collector}}")],
                           mappings=mapping((1, "ok", "green"), (0, "FAILED", "red"))),
            12, 7)
    lay.add(timeseries("Collector duration", "Time each collector took in the scrape.",
                       [target(sel("gpunet_scrape_collector_duration_seconds"),
                               "{{collector}}")], "s"), 12, 7)
    lay.add(timeseries("Unreadable values", "Values skipped in a scrape because a file could "
                       "not be read or parsed. Persistent non-zero: a driver or permission "
                       "issue.",
                       [target(sel("gpunet_scrape_collector_unreadable_values"),
                               "{{collector}}")], "short"), 12, 7)
    ages = (("gpunet_gpu_counters_last_success_timestamp_seconds", gpu + " counters"),
            ("gpunet_pfc_config_last_success_timestamp_seconds", "{{interface}} QoS"),
            ("gpunet_link_ibv_devinfo_last_success_timestamp_seconds", "ibv_devinfo"))
    lay.add(timeseries("Age of background values", "Time since the last good read of the "
                       "values read in the background (GPU counters, QoS configuration, "
                       "ibv_devinfo): time() minus their last-success timestamps. Growing: "
                       "the reads fail or the background reader is stuck.",
                       [target("time() - " + sel(m), legend) for m, legend in ages],
                       "s"), 12, 7)

    return dashboard(
        NODE_UID, "gpunet / Node",
        "One GPU node: RDMA ports, links and MTU, PFC/ECN, GPUs, GPU-NIC topology and "
        "GPUDirect RDMA.", lay, [job_variable(), instance_variable(multi=False)])


# --- collectives ---


def collectives() -> Json:
    lay = Layout()
    probe = ('scope=~"$scope"',)
    sized = ('scope=~"$scope"', 'size=~"$size"')
    who = "{{instance}} {{scope}}"
    sized_legend = "{{instance}} {{scope}} {{size}} B"
    lay.row("Now")
    lay.add(stat("Probe rounds failing", "Nodes whose probe fails while their GPUs are idle "
                 "(state failing: timeout, NCCL error, no GPU). A probe that yielded to a job "
                 "is not failing. See failures by reason below.",
                 [target(count_or_zero(sel("gpunet_probe_state", 'state="failing"')
                                       + " == 1"))],
                 "short", thresholds=OK_RED), 6, 4)
    lay.add(stat("Idle GPUs without a probe round", "Over the nodes whose GPUs are idle "
                 "(the probe runs only there), the longest time since the later of the last "
                 "complete round and the start of the idle time; 0 when none waits. Minutes: "
                 "the probe is failing or stuck, and the panels below show stale values.",
                 [target(idle_without_round(*probe))], "s", thresholds=STALE), 6, 4)
    lay.add(stat("Socket fallback", "Node scopes where NCCL used TCP sockets although an "
                 "RDMA port is ACTIVE (or the network for intra-node traffic). The net scope "
                 "checks every node's own NICs. Far slower; check NCCL_IB_* settings and the "
                 "IB stack.",
                 [target(count_or_zero(sel("gpunet_probe_socket_fallback", *probe) + " == 1"))],
                 "short", thresholds=OK_RED), 6, 4)
    lay.add(stat("GPUDirect RDMA inactive", "Node scopes whose NCCL network channels did not "
                 "use GPUDirect RDMA (net and inter; intra has no network channels): data is "
                 "staged through host memory. The RDMA ports table below says which port.",
                 [target(count_or_zero(sel("gpunet_probe_gdr_active", *probe) + " == 0"))],
                 "short", thresholds=OK_RED), 6, 4)
    lay.add(stat("Worst straggler wait", "Largest share of their all-reduce time the other "
                 "ranks spend waiting for the rank that arrives last. 0.5: they took twice as "
                 "long as the collective itself (GpunetStragglerRank fires above); from 20% the "
                 "late rank is named in the Straggler ranks table.",
                 [target("max(" + sel("gpunet_probe_straggler_wait_ratio", *probe) + ")")],
                 "percentunit", thresholds=STRAGGLER_STEPS), 6, 4)
    lay.add(stat("Below 80% of the link rate", "Node scopes whose all-reduce at the largest "
                 "size reaches less than 80% of the bus bandwidth their RDMA links allow "
                 "(GpunetBusBandwidthBelowLinkRate after 10 minutes). See Bus bandwidth / link "
                 "rate and the RDMA ports table.",
                 [target(count_or_zero(sel("gpunet_probe_bus_bandwidth_link_ratio", *probe)
                                       + " < 0.8"))], "short", thresholds=OK_RED), 6, 4)
    lay.add(stat("Lowest bus bandwidth / link rate", "Per scope, the lowest share of the "
                 "link rate reached over the selected nodes. 80% or more is the target; red "
                 "below. Scopes that use no RDMA port (intra) have no value.",
                 [target("min by (scope) (" + sel("gpunet_probe_bus_bandwidth_link_ratio",
                                                  *probe) + ")", "{{scope}}")],
                 "percentunit", thresholds=LINK_RATE_STEPS, text_mode="value_and_name"), 6, 4)
    lay.add(stat("Ranks per round", "Ranks in the last round (largest over the selected "
                 "nodes). intra and net: one per local GPU, fewer means a GPU was left out "
                 "(a one-GPU node runs no intra scope); inter: ranks across the nodes.",
                 [target("max by (scope) (" + sel("gpunet_probe_world_size", *probe) + ")",
                         "{{scope}}")], "short", text_mode="value_and_name"), 6, 4)

    lay.row("Latency and bandwidth")
    lay.add(timeseries("All-reduce latency, median", "Median time of one all-reduce per "
                       "message size, counted once every rank arrived (waiting for a late "
                       "rank is the straggler wait below). Small sizes are latency-bound and "
                       "jitter by up to 2x between rounds.",
                       [target(sel("gpunet_probe_allreduce_seconds", *sized, 'stat="median"'),
                               sized_legend)], "s", log_scale=True), 12, 9)
    lay.add(timeseries("All-reduce latency, p99", "99th percentile all-reduce time per "
                       "size. Far above the median: intermittent stalls (congestion, PFC "
                       "pauses, a busy GPU).",
                       [target(sel("gpunet_probe_allreduce_seconds", *sized, 'stat="p99"'),
                               sized_legend)], "s", log_scale=True), 12, 9)
    lay.add(timeseries("Bus bandwidth", "nccl-tests bus bandwidth per size. Large sizes "
                       "should sit near the link rate; a step down is a degraded port, PCIe "
                       "link, socket fallback or lost GDR.",
                       [target(sel("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second",
                                   *sized), sized_legend)], "Bps"), 12, 9)
    lay.add(timeseries(
        "Bus bandwidth relative to the median node", "Each node's bus bandwidth divided by "
        "the median over the selected nodes at the same scope and size. Below 80%: that "
        "node is slower than its peers.",
        [target(sel("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", *sized)
                + " / ignoring (instance, job) group_left () quantile by (scope, size) (0.5, "
                + sel("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", *sized) + ")",
                sized_legend)], "percentunit",
        thresholds=steps(("red", None), ("orange", 0.8), ("green", 0.9)),
        show_thresholds=True), 12, 9)
    lay.add(timeseries("Tail latency ratio (p99 / median)", "How much longer the p99 "
                       "all-reduce takes than the median. Near 1 is steady; large values "
                       "are intermittent stalls.",
                       [target(sel("gpunet_probe_allreduce_seconds", *sized, 'stat="p99"')
                               + " / ignoring (stat) "
                               + sel("gpunet_probe_allreduce_seconds", *sized,
                                     'stat="median"'), sized_legend)], "none"), 12, 8)
    lay.add(timeseries(
        "Bus bandwidth / link rate", "Bus bandwidth of the largest size over the bus "
        "bandwidth the RDMA links allow (lowest port rate per rank sharing it), per node and "
        "scope. net: the node's GPUs through its own NICs (NIC loopback). 80% or more is the "
        "target; below (red line) for 10 minutes fires GpunetBusBandwidthBelowLinkRate: check "
        "GPUDirect RDMA, the GPU-NIC PCIe path, PFC pauses and the ports table below.",
        [target(sel("gpunet_probe_bus_bandwidth_link_ratio", *probe), who)], "percentunit",
        thresholds=LINK_RATE_STEPS, show_thresholds=True), 12, 8)

    lay.row("Stragglers")
    lay.add(timeseries("Straggler wait, share of collective time", "Share of their "
                       "all-reduce time the other ranks spend waiting for the rank that "
                       "arrives last (largest size, median over iterations). 0.5: they took "
                       "twice as long as the collective itself; above 50% (red line) for 10 "
                       "minutes fires GpunetStragglerRank. A persistent straggler is one GPU, "
                       "PCIe link or NIC; the table below names it.",
                       [target(sel("gpunet_probe_straggler_wait_ratio", *probe), who)],
                       "percentunit", thresholds=STRAGGLER_STEPS, show_thresholds=True,
                       max_value=1), 12, 8)
    lay.add(timeseries("Straggler wait", "What the other ranks wait for the last rank to "
                       "arrive, in seconds (median over iterations at the largest size). "
                       "Compare with the median all-reduce time above.",
                       [target(sel("gpunet_probe_straggler_wait_seconds", *probe), who)],
                       "s"), 12, 8)
    lay.add(straggler_table(*probe), 24, 6)

    lay.row("Path: transports, GPUDirect RDMA, fallback")
    net_col = override("net", ("mappings", mapping(("IB", "IB", "green"),
                                                   ("Socket", "Socket", "red"))),
                       ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table("NCCL transports used", "Transports NCCL's channels used in the last "
                  "successful round: P2P/SHM inside a node, NET between nodes with net IB "
                  "(or a plugin). NET over Socket is the fallback to avoid.",
                  [target(sel("gpunet_probe_transport_info", *probe), table=True)], "none",
                  order=["instance", "scope", "transport", "net"],
                  overrides=[net_col, override("Value", ("custom.hidden", True))]), 12, 8)
    lay.add(table("NCCL problems in the probe log", "Problem codes from the NCCL log of the "
                  "last successful round (docs/nccl-log.md). Empty is healthy.",
                  [target(sel("gpunet_probe_nccl_problem", *probe), table=True)], "none",
                  order=["instance", "scope", "problem"],
                  overrides=[override("Value", ("custom.hidden", True))]), 12, 8)
    hca = sel("gpunet_probe_hca_ranks", *probe)
    lay.add(table("RDMA ports used by the probe", "Per node, scope and RDMA port: how many "
                  "of the node's ranks NCCL ran through it (net: each rank pinned to the "
                  "ACTIVE port nearest its GPU, so usually 1), whether their network channels "
                  "used GPUDirect RDMA (NO in red: staged through host memory; check "
                  "nvidia_peermem/DMA-BUF and the GPU-NIC path) and the port's rate. Ranks "
                  "sharing a port divide its rate.",
                  [target(hca, table=True),
                   target(sel("gpunet_probe_hca_gdr_active", *probe), table=True),
                   target(f"{hca} * 0 + on (instance, job, device, port) group_left () "
                          f"{sel('gpunet_infiniband_port_rate_bytes_per_second')}",
                          table=True)], "none",
                  rename={"Value #A": "ranks", "Value #B": "GPUDirect RDMA",
                          "Value #C": "port rate"},
                  order=["instance", "scope", "device", "port", "ranks", "GPUDirect RDMA",
                         "port rate"],
                  overrides=[override("GPUDirect RDMA", ("mappings", GOOD_WHEN_1),
                                      ("custom.cellOptions", {"type": "color-text"})),
                             override("port rate", ("unit", "Bps"))]),
            12, 8)
    lay.add(timeseries("Link bandwidth", "The bus bandwidth the RDMA links allow each node "
                       "and scope: over the ports the ranks used, the lowest link rate "
                       "divided by the ranks sharing that port. A drop is a port trained "
                       "down, or ranks crowded onto fewer ports.",
                       [target(sel("gpunet_probe_link_bandwidth_bytes_per_second", *probe),
                               who)], "Bps"), 12, 8)
    lay.add(state_timeline("GPUDirect RDMA active", "OFF (red): NCCL's network channels did "
                           "not register GPU memory with the NIC. The net scope has network "
                           "channels on every node; intra (P2P/SHM) has none, so no value.",
                           [target(sel("gpunet_probe_gdr_active", *probe), who)],
                           mappings=mapping((1, "on", "green"), (0, "OFF", "red"))), 12, 7)
    lay.add(state_timeline("Socket fallback", "FALLBACK (red): NCCL sent over TCP sockets "
                           "although it should not.",
                           [target(sel("gpunet_probe_socket_fallback", *probe), who)],
                           mappings=mapping((0, "no", "green"), (1, "FALLBACK", "red"))),
            12, 7)

    lay.row("NCCL jobs (RAS): the jobs running now")
    for title, description, expr in (
            ("Nodes with a dead NCCL process", "Nodes whose NCCL job has a process RAS "
             "considers dead (GpunetNcclRankDead). Every node of a job reports it.",
             sel("gpunet_nccl_job_processes", 'state="dead"')),
            ("Nodes with a stuck NCCL rank", "Nodes whose NCCL job has ranks behind the others "
             "whose counts stopped (GpunetNcclRankStalled).", sel("gpunet_nccl_stalled_ranks")),
            ("Nodes with missing NCCL ranks", "Nodes whose NCCL job has ranks that do not "
             "answer RAS (GpunetNcclRankUnreachable).",
             sel("gpunet_nccl_missing_ranks", 'reason="unreachable"'))):
        lay.add(stat(title, description,
                     [target(count_or_zero(f"max by (instance) ({expr}) > 0"))], "short",
                     thresholds=OK_RED), 6, 4)
    lay.add(stat("RAS not answering", "Node ports where NCCL processes listen but RAS gave no "
                 "report (GpunetNcclRasUnreachable): that job's health is unknown.",
                 [target(count_or_zero(sel("gpunet_nccl_ras_listeners") + " > 0 and on "
                                       "(instance, job, port) "
                                       + sel("gpunet_nccl_ras_query_success") + " == 0"))],
                 "short", thresholds=OK_ORANGE), 6, 4)
    lay.add(nccl_jobs_table(), 24, 7)
    nccl_job_panels(lay, "{{instance}} port {{port}}")

    lay.row("Probe health")
    lay.add(state_timeline("Last round succeeded", "FAILED (red): the last round gave no "
                           "results; the latency and bandwidth panels keep showing older "
                           "values.",
                           [target(sel("gpunet_probe_success", *probe), who)],
                           mappings=mapping((1, "ok", "green"), (0, "FAILED", "red"))), 12, 7)
    lay.add(timeseries("Time since last successful round", "Age of the newest successful "
                       "round. Rounds run every probe.interval_seconds (60 s by default).",
                       [target("time() - " + sel("gpunet_probe_last_success_timestamp_seconds",
                                                 *probe), who)], "s",
                       thresholds=STALE, show_thresholds=True), 12, 7)
    lay.add(timeseries("Probe failures per minute by reason", "Rounds per minute that gave "
                       "no or partial results: timeout, crash, nccl_error, init_error, "
                       "bad_result; skipped_busy is sizes skipped because the GPUs ran other "
                       "work (expected while training).",
                       [target("60 * sum by (instance, scope, reason) ("
                               + rate("gpunet_probe_failures_total", *probe) + ")",
                               who + " {{reason}}")], "cpm", bars=True), 12, 7)
    lay.add(timeseries("Probe round duration", "Wall time of the last round, all sizes. "
                       "Growing toward probe.timeout_seconds (120 s) ends in timeouts.",
                       [target(sel("gpunet_probe_duration_seconds", *probe), who)], "s"),
            12, 7)
    codes = " or ".join("(" + sel("gpunet_probe_state", f'state="{state}"') + f" == 1) * {n}"
                        for n, state in enumerate(PROBE_STATES, 1))
    lay.add(state_timeline("Probe state", "What the node's probe does (docs/probe.md, \"Idle "
                           "only\"): measuring on idle GPUs; hold-off after another process "
                           "was on a GPU; yielded while a job runs (it holds no GPU memory "
                           "then); FAILING on idle GPUs; UNKNOWN when it cannot read the GPUs' "
                           "processes and runs nothing.",
                           [target(f"max by (instance) ({codes})", "{{instance}}")],
                           mappings=mapping(*PROBE_STATE_MAP)), 12, 6)
    lay.add(state_timeline("Sizes skipped (GPU busy)", "SKIPPED: the round left this size "
                           "out because a GPU was busy with other work.",
                           [target(sel("gpunet_probe_size_skipped", *sized),
                                   sized_legend)],
                           mappings=mapping((0, "run", "green"), (1, "SKIPPED", "yellow"))),
            12, 6)

    return dashboard(
        "gpunet-collectives", "gpunet / Collectives (NCCL probes)",
        "All-reduce probes: latency and bus bandwidth per size, transports, GPUDirect RDMA, "
        "socket fallback, stragglers and probe health.", lay,
        [job_variable(), instance_variable(multi=True),
         query_variable("scope", "Scope", "label_values(gpunet_probe_success, scope)",
                        multi=True, include_all=True, all_value=".+"),
         query_variable("size", "Size (bytes)",
                        "label_values(gpunet_probe_allreduce_seconds, size)", multi=True,
                        include_all=True, all_value=".+", sort=3)])


# --- pairs (the pair plan of fleet probes) ---

# Recording rules of alerts/gpunet.rules.yml (gpunet_exporter.health.rules) that the pair
# dashboard reads.
_PAIR_BW = "gpunet_fleet_pair_bus_bandwidth_bytes_per_second"
NODE_MEDIAN_BW = f"instance:{_PAIR_BW}:median"
FLEET_MEDIAN_BW = f"job:{_PAIR_BW}:median"
FLEET_MAD_BW = f"job:{_PAIR_BW}:mad"
PAIR_RATIO = f"instance_peer:{_PAIR_BW}:ratio_to_fleet_median"
NODE_PAIRS = "instance:gpunet_fleet_pairs:count"
NODE_PAIRS_HEALTHY = "instance:gpunet_fleet_pairs_healthy:count"
LEAF_INTRA_BW = f"leaf:{_PAIR_BW}:median_intra_leaf"
LEAF_CROSS_BW = f"leaf:{_PAIR_BW}:median_cross_leaf"
LEAF_CROSS_RATIO = f"leaf:{_PAIR_BW}:cross_to_intra_leaf_ratio"
# The default thresholds of gpunet_exporter.health.thresholds ("fleet"), which this stdlib-only file
# cannot import: fleet.link_slow_ratio, fleet.cross_leaf_ratio, fleet.stale_seconds.
LINK_SLOW_RATIO = 0.5
CROSS_LEAF_RATIO = 0.6
ROUND_STALE_SECONDS = 10800
PAIR_RATIO_STEPS = steps(("red", None), ("orange", LINK_SLOW_RATIO), ("green", 0.8))
FAILED_PAIR = mapping((-1, "FAILED", "red"))
ROUND_AGE_STEPS = steps(("green", None), ("yellow", 7200), ("red", ROUND_STALE_SECONDS))


def jsel(metric: str, *matchers: str) -> str:
    """A selector of a series without an instance label (per job or per leaf), limited to the
    selected jobs."""
    return metric + "{" + ", ".join([JOB, *matchers]) + "}"


def firing(alerts: str, *, per_instance: bool = True) -> str:
    """ALERTS of the named alerts (a regex) that fire; per_instance=False for alerts that carry
    no instance (GpunetFleetCrossLeafSlow names a leaf)."""
    matchers = ('alertstate="firing"', f'alertname=~"{alerts}"')
    return sel("ALERTS", JOB, *matchers) if per_instance else jsel("ALERTS", *matchers)


def pair_state() -> str:
    """Each pair's bus bandwidth over the fleet's median node, or -1 when the pair failed."""
    return (f"({sel(PAIR_RATIO)} or on (instance, job, peer) "
            f"({sel('gpunet_fleet_pair_success')} == 0) - 1)")


def pairs_dashboard() -> Json:
    lay = Layout()
    node_alerts = "GpunetFleet(NodeSuspect|BandwidthOutlier)"
    with_info = (" * on (instance, job, peer) group_left (peer_leaf, transport, gdr) "
                 + sel("gpunet_fleet_pair_info"))
    lay.row("Now")
    lay.add(stat("Nodes with pair results", "Selected nodes whose exporter exports a pair round "
                 "(a readable pairs.json in probe.state_dir). Nodes outside the last plan keep "
                 "their older file.",
                 [target(count_or_zero(sel("gpunet_fleet_round_timestamp_seconds")))],
                 "short"), 4, 4)
    lay.add(stat("Failed pairs", "Pairs of the last round that gave no result (success 0), "
                 "counted from each end. The matrix below shows them as FAILED.",
                 [target(count_or_zero(sel("gpunet_fleet_pair_success") + " == 0"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Slow pairs", "Pairs that ran but reached less than fleet.link_slow_ratio "
                 "(50%) of the fleet's median node, counted from each end.",
                 [target(count_or_zero(f"{sel(PAIR_RATIO)} < {LINK_SLOW_RATIO}"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Suspect nodes", "Nodes on which GpunetFleetNodeSuspect or "
                 "GpunetFleetBandwidthOutlier fires: the node, not its links, is the common "
                 "factor of its slow or failed pairs. The Suspects row names them.",
                 [target(count_or_zero(f"count by (instance) ({firing(node_alerts)})"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("Slow links", "GpunetFleetLinkSlow alerts firing: a pair slow or failed "
                 "between two nodes that are fine with their other peers. A link usually fires "
                 "from both ends, so counts twice.",
                 [target(count_or_zero(firing("GpunetFleetLinkSlow")))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Slow leaves", "Leaves on which GpunetFleetCrossLeafSlow fires: their "
                 "cross-leaf pairs reach less than fleet.cross_leaf_ratio (60%) of their "
                 "intra-leaf pairs (the spine side is the suspect). Per leaf, not per node: "
                 "the node selection does not apply.",
                 [target(count_or_zero(firing("GpunetFleetCrossLeafSlow",
                                              per_instance=False)))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Fleet median pair bus bandwidth", "The median over nodes of each node's "
                 "median pair bus bandwidth (recording rule " + FLEET_MEDIAN_BW + "), over "
                 "every node of the job, whatever the node selection.",
                 [target(jsel(FLEET_MEDIAN_BW), "{{job}}")], "Bps"), 8, 4)
    lay.add(stat("Fleet spread (MAD / median)", "Median absolute deviation of the node medians "
                 "over their median: how far a typical node lies from the median node. A few "
                 "percent is a uniform fleet; GpunetFleetBandwidthOutlier needs a node below "
                 "the median by 3 robust sigmas (1.4826 x MAD) and below 70% of it.",
                 [target(f"{jsel(FLEET_MAD_BW)} / {jsel(FLEET_MEDIAN_BW)}", "{{job}}")],
                 "percentunit", thresholds=steps(("green", None), ("orange", 0.1))), 8, 4)
    lay.add(stat("Oldest pair round", "Longest time since a selected node's last pair round. "
                 "The documented period is 1 h; past fleet.stale_seconds (3 h) "
                 "GpunetFleetProbeStale fires and the other fleet alerts judge old results.",
                 [target("max(time() - " + sel("gpunet_fleet_round_timestamp_seconds") + ")")],
                 "s", thresholds=ROUND_AGE_STEPS), 4, 4)
    lay.add(stat("Pairs dropped", "Peers of the last plan left out of the pair metrics because "
                 "a node had more than probe.fleet_max_peers (64); failed pairs are kept first. "
                 "Above 0: the plan gives nodes more peers than the exporter exports.",
                 [target(sum_or_zero(sel("gpunet_fleet_pairs_dropped")))], "short",
                 thresholds=OK_ORANGE), 4, 4)

    lay.row("Pair matrix")
    cells = override("instance\\peer", ("displayName", "node \\ peer"), ("links", NODE_LINK),
                     ("custom.cellOptions", {"type": "auto"}))
    lay.add(table(
        "Pair bus bandwidth / fleet median, node x peer",
        "One row per node (instance), one column per peer (the node name the plan uses), "
        "from the last round: each pair's bus bandwidth over the fleet's median node "
        "(recording rule " + PAIR_RATIO + "). Green from 80%, orange below, red below "
        "fleet.link_slow_ratio (50%); FAILED: the pair gave no result. A node whose row and "
        "column are red is the suspect; one red cell, mirrored across the diagonal, a link. "
        "Empty: no pair between them in the plan. Relabel instance to the node's name in "
        "Prometheus and rows and columns line up.",
        [target(pair_state(), table=True)], "percentunit",
        transformations=[{"id": "groupingToMatrix", "options": {
            "columnField": "peer", "rowField": "instance", "valueField": "Value"}}],
        mappings=FAILED_PAIR, thresholds=PAIR_RATIO_STEPS, cell="color-background",
        overrides=[cells], decimals=0), 24, 12)
    ratio_col = override("of fleet median", ("mappings", FAILED_PAIR),
                         ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table(
        "Pairs of the last round", "Every pair of the selected nodes, from each end: the peer, "
        "its leaf, the network (transport) and GPUDirect RDMA the pair used, its bus bandwidth "
        "and latency, and its share of the fleet's median node (FAILED: no result). Sorted "
        "worst first. Socket, or gdr false on a GPUDirect fabric, explains a slow pair.",
        [target(sel(_PAIR_BW) + with_info, table=True),
         target(pair_state() + with_info, table=True),
         target(sel("gpunet_fleet_pair_latency_seconds") + with_info, table=True),
         target(sel("gpunet_fleet_pair_success") + with_info, table=True)], "Bps",
        rename={"Value #A": "bus bandwidth", "Value #B": "of fleet median",
                "Value #C": "latency", "Value #D": "ok"},
        order=["instance", "peer", "peer_leaf", "transport", "gdr", "bus bandwidth",
               "of fleet median", "latency", "ok"],
        thresholds=PAIR_RATIO_STEPS, sort_by="of fleet median", sort_desc=False,
        overrides=[ratio_col, override("of fleet median", ("unit", "percentunit")),
                   override("latency", ("unit", "s")),
                   override("ok", ("unit", "none"), ("mappings", GOOD_WHEN_1),
                            ("custom.cellOptions", {"type": "color-text"}))]), 24, 10)

    lay.row("Suspects")
    node_rows = f"max by (instance, alertname) ({firing(node_alerts)})"

    def per_alert(expr: str) -> str:
        return f"{node_rows} * on (instance) group_left () max by (instance) ({expr})"

    lay.add(table(
        "Suspect nodes", "Nodes on which GpunetFleetNodeSuspect (every pair failed or slow) or "
        "GpunetFleetBandwidthOutlier (median pair a robust outlier) fires, with the node's "
        "pairs, how many of them are healthy and its median pair bus bandwidth (empty when "
        "none ran). Empty is healthy. Follow the node's own link, transport and topology "
        "alerts; after the repair, run the repair plan (docs/runbooks.md, Pair plan).",
        [target(node_rows, table=True),
         target(per_alert(sel(NODE_PAIRS)), table=True),
         target(per_alert(sel(NODE_PAIRS_HEALTHY)), table=True),
         target(per_alert(sel(NODE_MEDIAN_BW)), table=True)], "short",
        rename={"Value #B": "pairs", "Value #C": "healthy pairs",
                "Value #D": "median pair bus bandwidth"},
        order=["instance", "alertname", "pairs", "healthy pairs",
               "median pair bus bandwidth"], decimals=0,
        overrides=[override("Value #A", ("custom.hidden", True)),
                   override("median pair bus bandwidth", ("unit", "Bps"),
                            ("decimals", None))]), 12, 8)
    leaf_rows = f"max by (job, leaf) ({firing('GpunetFleetCrossLeafSlow', per_instance=False)})"

    def per_leaf(metric: str) -> str:
        return f"{leaf_rows} * on (job, leaf) {jsel(metric)}"

    lay.add(table(
        "Slow leaves", "Leaves on which GpunetFleetCrossLeafSlow fires: the median of their "
        "cross-leaf pairs against the median of their intra-leaf pairs. Below 60% (red): the "
        "leaf's uplinks, the spines or the routing. While it fires, Alertmanager mutes "
        "GpunetFleetLinkSlow of the pairs that cross from or to the leaf. Per leaf: the "
        "node selection does not apply. Empty is healthy.",
        [target(per_leaf(LEAF_CROSS_RATIO), table=True),
         target(per_leaf(LEAF_INTRA_BW), table=True),
         target(per_leaf(LEAF_CROSS_BW), table=True)], "percentunit",
        rename={"Value #A": "cross / intra", "Value #B": "intra-leaf median",
                "Value #C": "cross-leaf median"},
        order=["leaf", "cross / intra", "intra-leaf median", "cross-leaf median"],
        thresholds=steps(("red", None), ("green", CROSS_LEAF_RATIO)),
        overrides=[override("cross / intra", ("custom.cellOptions", {"type": "color-text"})),
                   override("intra-leaf median", ("unit", "Bps")),
                   override("cross-leaf median", ("unit", "Bps"))]), 12, 8)
    link_labels = "instance, peer, leaf, peer_leaf, cross_leaf"
    lay.add(table(
        "Slow links", "GpunetFleetLinkSlow alerts firing: the pair from node (instance) to "
        "peer, both leaves, whether it crosses leaves, and its share of the fleet's median "
        "node (FAILED: no result). A link usually appears twice, once from each end. "
        "cross_leaf true while its leaf is slow (Slow leaves): muted in Alertmanager, look at "
        "the spine side first. Empty is healthy.",
        [target(f"max by ({link_labels}) ({firing('GpunetFleetLinkSlow')}) * on (instance, "
                f"peer) max by (instance, peer) ({pair_state()})", table=True)],
        "percentunit", rename={"Value": "of fleet median"},
        order=["instance", "peer", "leaf", "peer_leaf", "cross_leaf", "of fleet median"],
        mappings=FAILED_PAIR, thresholds=PAIR_RATIO_STEPS, sort_by="of fleet median",
        sort_desc=False,
        overrides=[override("of fleet median", ("custom.cellOptions",
                                                {"type": "color-text"}))]), 24, 7)

    lay.row("Fleet trend")
    lay.add(timeseries(
        "Fleet median pair bus bandwidth and MAD", "The fleet's median node (median over nodes "
        "of each node's median pair), its median absolute deviation, and the slow-pair line "
        "(fleet.link_slow_ratio, 50% of the median) per job, round after round. A falling "
        "median with a steady MAD is the whole fabric; a growing MAD, nodes drifting apart.",
        [target(jsel(FLEET_MEDIAN_BW), "median {{job}}"),
         target(jsel(FLEET_MAD_BW), "MAD {{job}}"),
         target(f"{LINK_SLOW_RATIO} * {jsel(FLEET_MEDIAN_BW)}", "slow-pair line {{job}}")],
        "Bps", overrides=[override("/^slow-pair line/", ("custom.lineStyle",
                                                          {"fill": "dash", "dash": [10, 10]}),
                                   regex=True)]), 12, 8)
    lay.add(timeseries(
        "Node median pair bus bandwidth (bottom 10)", "The ten selected nodes whose median pair "
        "is slowest. A node far below the others is an outlier (GpunetFleetBandwidthOutlier).",
        [target(f"bottomk(10, {sel(NODE_MEDIAN_BW)})", "{{instance}}")], "Bps"), 12, 8)
    lay.add(timeseries(
        "Intra-leaf and cross-leaf medians per leaf", "Per leaf, the median bus bandwidth of the "
        "pairs whose peer is on the same leaf (solid) and on another leaf (dashed), seen from "
        "the leaf's nodes. Per leaf: the node selection does not apply.",
        [target(jsel(LEAF_INTRA_BW), "{{leaf}} intra"),
         target(jsel(LEAF_CROSS_BW), "{{leaf}} cross")], "Bps",
        overrides=[override("/ cross$/", ("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
                            regex=True)]), 12, 8)
    lay.add(timeseries(
        "Cross-leaf / intra-leaf per leaf", "Per leaf, the cross-leaf median over the "
        "intra-leaf median. Below fleet.cross_leaf_ratio (60%, red line) for 5 minutes fires "
        "GpunetFleetCrossLeafSlow: the spine side of that leaf is the suspect.",
        [target(jsel(LEAF_CROSS_RATIO), "{{leaf}}")], "percentunit",
        thresholds=steps(("red", None), ("green", CROSS_LEAF_RATIO)), show_thresholds=True),
        12, 8)

    lay.row("Rounds")
    lay.add(timeseries(
        "Time since the last pair round", "Per node, time() minus the time of its last pair "
        "round (gpunet_fleet_round_timestamp_seconds). It saws up to the plan's period (1 h "
        "documented) and drops at each round; past 3 h (red line) GpunetFleetProbeStale "
        "fires.",
        [target("time() - " + sel("gpunet_fleet_round_timestamp_seconds"), "{{instance}}")],
        "s", thresholds=ROUND_AGE_STEPS, show_thresholds=True), 12, 8)
    lay.add(state_timeline(
        "Nodes with a failed pair", "Per node, whether a pair of its last round failed "
        "(FAILED, red) or all of them gave a result (ok).",
        [target(f"min by (instance) ({sel('gpunet_fleet_pair_success')})", "{{instance}}")],
        mappings=mapping((1, "ok", "green"), (0, "FAILED", "red")), kind="status-history"),
        12, 8)
    lay.add(timeseries(
        "Healthy pairs per node (bottom 10)", "Share of a node's pairs that ran and reached "
        "the slow-pair line (" + NODE_PAIRS_HEALTHY + " over " + NODE_PAIRS + "). 0 with at "
        "least 2 pairs is GpunetFleetNodeSuspect.",
        [target(f"bottomk(10, {sel(NODE_PAIRS_HEALTHY)} / {sel(NODE_PAIRS)})",
                "{{instance}}")], "percentunit", max_value=1), 12, 8)
    lay.add(timeseries(
        "Pair latency (top 10)", "The ten slowest pairs by small-message latency, from each "
        "end. A pair far above the rest with normal bandwidth: a long or congested path.",
        [target(f"topk(10, {sel('gpunet_fleet_pair_latency_seconds')})",
                "{{instance}} to {{peer}}")], "s"), 12, 8)

    return dashboard(
        "gpunet-pairs", "gpunet / Fleet pairs (pair plan)",
        "The pair plan of fleet probes: node x peer bus bandwidth, failed pairs, the nodes, "
        "links and leaves the fleet alerts blame, the fleet median and the rounds' age.", lay,
        [job_variable(), instance_variable(multi=True)])


# --- fabric (the fabric collector: every switch port, seen from the node that sweeps) ---

FABRIC_PORT = "instance, job, switch, port"
FABRIC_SWITCH = "instance, job, switch"
LEAF = 'name=~"$leaf"'
ROLE_LEAF = 'role="leaf"'
# Error counters whose rise marks a port "errors rising" in the health matrix: the link's
# physical errors and what they cost (PortXmitWait is congestion, shown on its own).
FABRIC_ERRORS = ("symbol_errors", "link_error_recoveries", "link_downed", "receive_errors",
                 "receive_remote_physical_errors", "local_link_integrity_errors",
                 "excessive_buffer_overrun_errors", "transmit_discards")
# The documented alert threshold of a leaf's uplink imbalance (docs/fabric.md).
UPLINK_IMBALANCE = 0.2
IMBALANCE_STEPS = steps(("green", None), ("orange", UPLINK_IMBALANCE))
FABRIC_HEALTH = mapping((0, "ok", "green"), (1, "degraded", "orange"), (2, "errors", "red"),
                        (3, "DOWN", "dark-red"), (4, "host down", "yellow"))
SWEEP_STEPS = ("discover", "links", "counters", "errors", "routes")


def port_info(remote_type: str) -> str:
    """gpunet_fabric_port_info of the ports whose (last) neighbour is of remote_type."""
    return sel("gpunet_fabric_port_info", f'remote_type="{remote_type}"')


def fabric_named(expr: str) -> str:
    """expr (per switch) with the switch's name from gpunet_fabric_switch_info."""
    return (f"({expr}) * on ({FABRIC_SWITCH}) group_left (name) "
            f"{sel('gpunet_fabric_switch_info')}")


def fabric_neighbour(expr: str, *matchers: str) -> str:
    """expr (per switch port) with the port's neighbour name from gpunet_fabric_port_info."""
    return (f"({expr}) * on ({FABRIC_PORT}) group_left (remote_name) "
            f"{sel('gpunet_fabric_port_info', *matchers)}")


def of_leaf(expr: str) -> str:
    """expr (per switch) limited to the leaf chosen in $leaf."""
    return (f"({expr}) and on ({FABRIC_SWITCH}) "
            f"{sel('gpunet_fabric_switch_info', ROLE_LEAF, LEAF)}")


def fabric_errors_increase() -> str:
    """Per switch port, how much the error counters of FABRIC_ERRORS rose over the interval."""
    return " + ".join(increase(f"gpunet_fabric_port_{name}_total") for name in FABRIC_ERRORS)


def port_health() -> str:
    """The health code of each switch port (FABRIC_HEALTH): the first of 3 not ACTIVE with a
    switch as its last neighbour, 4 not ACTIVE with a host, 2 error counters rising,
    1 degraded, 0 ACTIVE; ports never connected are absent. `or` keeps the left side's
    series, so each port gets the first code that applies."""
    state = sel("gpunet_fabric_port_state_id")

    def down_to(remote_type: str, code: int) -> str:
        return f"(0 * ({state} != 4 and on ({FABRIC_PORT}) {port_info(remote_type)}) + {code})"

    return " or ".join([
        down_to("switch", 3), down_to("ca", 4),
        f"(0 * (({fabric_errors_increase()}) > 0) + 2)",
        f"(0 * ({sel('gpunet_fabric_port_rate_degraded')} == 1) + 1)",
        f"(0 * ({state} == 4))",
    ])


def bargauge(title: str, description: str, targets: list[Json], unit: str) -> Json:
    return panel("bargauge", title, description, targets, unit,
                 thresholds=steps(("blue", None)),
                 options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                            "values": False},
                          "orientation": "horizontal", "displayMode": "basic",
                          "showUnfilled": True, "valueMode": "color", "namePlacement": "auto",
                          "sizing": "auto", "minVizHeight": 16, "minVizWidth": 8,
                          "maxVizHeight": 300})


def fabric_dashboard() -> Json:
    lay = Layout()
    state = sel("gpunet_fabric_port_state_id")
    degraded = f"{sel('gpunet_fabric_port_rate_degraded')} == 1"

    def degraded_to(remote_type: str) -> str:
        return f"{degraded} and on ({FABRIC_PORT}) {port_info(remote_type)}"

    lay.row("Now")
    lay.add(stat("Switches", "Switches the last sweep of the selected node found "
                 "(gpunet_fabric_switches). A drop is a switch gone from the fabric, or a "
                 "sweep that saw less of it.",
                 [target(sel("gpunet_fabric_switches"))], "short", decimals=0), 4, 4)
    lay.add(stat("Ports ACTIVE", "Switch ports whose logical state is ACTIVE (4), host and "
                 "switch links alike. Compare with yesterday: fewer is links lost.",
                 [target(count_or_zero(f"{state} == 4"))], "short", decimals=0), 4, 4)
    lay.add(stat("Links degraded", "ACTIVE links that trained below what both their ends "
                 "support (narrower or slower, gpunet_fabric_port_rate_degraded): a link "
                 "between two switches counts once, though both its ports say so. The "
                 "Degraded links table names them.",
                 [target(f"({count_or_zero(degraded_to('ca'))}) + "
                         f"({count_or_zero(degraded_to('switch'))}) / 2")],
                 "short", thresholds=OK_RED, decimals=0), 4, 4)
    lay.add(stat("Ports with errors rising", "Switch ports whose error counters (symbol "
                 "errors, link error recoveries, link downed, receive errors, remote physical "
                 "errors, local link integrity, buffer overruns, transmit discards) rose over "
                 "the last interval. A steady riser is a bad cable or optic; Error rates "
                 "below names the counter.",
                 [target(count_or_zero(f"({fabric_errors_increase()}) > 0"))], "short",
                 thresholds=OK_RED, decimals=0), 4, 4)
    lay.add(stat("Sweep age", "Time since the last sweep that discovered the fabric "
                 "(gpunet_fabric_sweep_last_success_timestamp_seconds). Sweeps run every "
                 "fabric.interval_seconds (60 s by default): minutes old means the sweeps fail "
                 "and every panel shows the last good one.",
                 [target("time() - " + sel("gpunet_fabric_sweep_last_success_timestamp_"
                                           "seconds"))], "s", thresholds=STALE), 4, 4)
    lay.add(stat("Sweep success", "Whether the latest sweep discovered the fabric "
                 "(gpunet_fabric_sweep_success). NO: ibnetdiscover or iblinkinfo failed; the "
                 "Sweep row says which step, the exporter's log why.",
                 [target(sel("gpunet_fabric_sweep_success"))], "none",
                 thresholds=steps(("red", None), ("green", 1)), mappings=GOOD_WHEN_1), 4, 4)

    lay.row("Switch x port health")
    cells = override("name\\port", ("displayName", "switch \\ port"),
                     ("custom.cellOptions", {"type": "auto"}))
    lay.add(table(
        "Switch port health, switch x port",
        "One row per switch (its node description), one column per port, from the last "
        "sweep. 0 ok (green): ACTIVE, full rate, no errors. 1 degraded (orange): ACTIVE below "
        "what both ends support. 2 errors (red): error counters rose over the interval. "
        "3 DOWN (dark red): not ACTIVE, and its last neighbour was a switch: a fabric link is "
        "lost. 4 host down (yellow): not ACTIVE, its last neighbour was a host (rebooted or "
        "powered off?). The worst applies: DOWN before host down before errors before "
        "degraded. Empty (grey): a port never connected since the exporter started. "
        "Switches with the same node description share a row: give them distinct names.",
        [target(fabric_named(port_health()), table=True)], "none",
        transformations=[
            # ports in numeric order: the columns come in the order of the rows
            {"id": "convertFieldType", "options": {"fields": {}, "conversions": [
                {"targetField": "port", "destinationType": "number"}]}},
            {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "port"}]}},
            {"id": "groupingToMatrix", "options": {
                "columnField": "port", "rowField": "name", "valueField": "Value"}}],
        mappings=FABRIC_HEALTH, thresholds=steps(("green", None), ("orange", 1),
                                                 ("red", 2)),
        cell="color-background", overrides=[cells], decimals=0), 24, 10)

    lay.row("Links")
    lay.add(table(
        "Degraded links", "ACTIVE switch ports whose link trained below what both ends "
        "support, with the neighbour: the rate it runs at against the best both ends could "
        "(iblinkinfo's 'Could be'), in bits per second. Both ends of a switch-to-switch link "
        "appear. Empty is healthy. Reseat or replace the cable or optic.",
        [target(fabric_named(fabric_neighbour(
            f"8 * {sel('gpunet_fabric_port_rate_bytes_per_second')} and on ({FABRIC_PORT}) "
            f"({degraded})")), table=True),
         target(fabric_named(fabric_neighbour(
             f"8 * {sel('gpunet_fabric_port_rate_supported_bytes_per_second')} and on "
             f"({FABRIC_PORT}) ({degraded})")), table=True)], "bps",
        rename={"name": "switch name", "remote_name": "neighbour", "Value #A": "rate",
                "Value #B": "supported", "switch": "switch GUID"},
        order=["name", "port", "remote_name", "Value #A", "Value #B", "switch"],
        sort_by="rate", sort_desc=False), 12, 8)
    lay.add(table(
        "Ports down with a neighbour", "Switch ports not ACTIVE whose last neighbour (since "
        "the exporter started) is known: a switch there is a lost fabric link, a host a "
        "node down or unplugged. Physical state says why: Polling no light, Disabled "
        "switched off, LinkErrorRecovery flapping. Empty is healthy.",
        [target(fabric_named(fabric_neighbour(
            f"{sel('gpunet_fabric_port_phys_state_id')} and on ({FABRIC_PORT}) "
            f"({state} != 4)", 'remote_type!=""')), table=True)], "none",
        rename={"name": "switch name", "remote_name": "neighbour",
                "Value": "physical state", "switch": "switch GUID"},
        order=["name", "port", "remote_name", "Value", "switch"],
        overrides=[override("physical state", ("mappings", PHYS_STATE),
                            ("custom.cellOptions", {"type": "color-text"}))]), 12, 8)

    lay.row("Errors and congestion")
    error_targets = [
        target(f"topk(10, {fabric_named(rate(f'gpunet_fabric_port_{name}_total'))} > 0)",
               "{{name}} port {{port}} " + label)
        for name, label in (("symbol_errors", "symbol errors"),
                            ("link_error_recoveries", "link error recoveries"),
                            ("receive_errors", "receive errors"),
                            ("transmit_discards", "transmit discards"))]
    lay.add(timeseries(
        "Port error rates (top 10 per counter)", "Per switch port, the ten fastest-rising of "
        "each: symbol errors and link error recoveries (the cable or optic), receive errors "
        "(bad packets arrive), transmit discards (packets dropped: the port was down or "
        "congested). Ports at 0 are left out. A port here is red in the matrix above.",
        error_targets, "cps"), 12, 8)
    lay.add(timeseries(
        "XmtWait (top 10)", "Per switch port, PortXmitWait ticks per second: time the port had "
        "data to send but no credits from the other end (a tick is implementation-defined, a "
        "few ns). Sustained growth is congestion behind this port; on an uplink, check the "
        "uplink balance below.",
        [target(f"topk(10, {fabric_named(rate('gpunet_fabric_port_transmit_wait_ticks_total'))}"
                " > 0)", "{{name}} port {{port}}")], "short"), 12, 8)

    lay.row("Uplink balance per leaf")
    lay.add(timeseries(
        "Uplink traffic imbalance per leaf", "Per leaf and direction (tx toward the spines, rx "
        "from them), the busiest uplink's traffic over the mean of its uplinks, minus 1, over "
        "the last sweep interval: 0 is an even split. Above 0.2 (orange line) one uplink "
        "carries 20% more than its share: a routing or a cabling problem, or a few large "
        "flows. Absent while the leaf is idle (below fabric.balance_min_bytes_per_second) or "
        "has fewer than 2 uplinks.",
        [target(fabric_named(sel("gpunet_fabric_leaf_uplink_imbalance_ratio")),
                "{{name}} {{direction}}")], "percentunit", thresholds=IMBALANCE_STEPS,
        show_thresholds=True), 12, 8)
    lay.add(timeseries(
        "Uplink traffic of leaf $leaf", "Bytes per second each uplink (a port whose "
        "neighbour is a switch) of the leaf chosen above transmits toward the spines (tx) "
        "and receives from them (rx). Even lines are a balanced leaf; one line above the "
        "rest is the imbalance of the panel beside.",
        [target(of_leaf(fabric_neighbour(rate("gpunet_fabric_port_transmitted_bytes_total"),
                                         'remote_type="switch"')),
                "tx port {{port}} to {{remote_name}}"),
         target(of_leaf(fabric_neighbour(rate("gpunet_fabric_port_received_bytes_total"),
                                         'remote_type="switch"')),
                "rx port {{port}} from {{remote_name}}")], "Bps",
        overrides=[override("/^rx /", ("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
                            regex=True)]), 12, 8)
    lay.add(state_timeline(
        "Routing unbalanced per leaf", "Per leaf, whether its forwarding table sends more "
        "host LIDs out of one active uplink than out of another, by more than one "
        "(gpunet_fabric_leaf_routes_unbalanced, check_lft_balance's test). BAD after a link "
        "came back until the subnet manager reroutes; lasting, check the routing engine.",
        [target(fabric_named(sel("gpunet_fabric_leaf_routes_unbalanced")), "{{name}}")],
        mappings=BAD_WHEN_1, kind="status-history"), 12, 8)
    lay.add(bargauge(
        "Host LIDs routed per uplink of leaf $leaf", "How many host LIDs the forwarding table "
        "of the leaf chosen above sends out of each uplink "
        "(gpunet_fabric_port_routed_host_lids): even bars are balanced routing. An uplink "
        "missing routes none.",
        [target(of_leaf(fabric_neighbour(sel("gpunet_fabric_port_routed_host_lids"),
                                         'remote_type="switch"')),
                "port {{port}} to {{remote_name}}")], "short"), 12, 8)

    lay.row("Sweep")
    lay.add(timeseries(
        "Sweep duration per step", "How long each step of the last sweep took (discover: "
        "ibnetdiscover, links: iblinkinfo, counters and errors: ibqueryerrors, routes: "
        "dump_fts), and the whole sweep. Near fabric.timeout_seconds, the step is about to "
        "fail; near fabric.interval_seconds, sweeps run back to back.",
        [target(sel("gpunet_fabric_step_duration_seconds"), "{{step}}"),
         target(sel("gpunet_fabric_sweep_duration_seconds"), "whole sweep")], "s"), 12, 8)
    lay.add(state_timeline(
        "Step success", "Per step of the sweep, whether it succeeded. A failed step's "
        "metrics keep the values of its last good sweep; the exporter's log says why.",
        [target(sel("gpunet_fabric_step_success"), "{{step}}")],
        mappings=GOOD_WHEN_1, thresholds=steps(("red", None), ("green", 1))), 12, 8)

    return dashboard(
        "gpunet-fabric", "gpunet / Fabric (InfiniBand switches)",
        "Every switch port of an InfiniBand fabric, from the node whose fabric collector "
        "sweeps it: a switch x port health matrix, degraded and lost links, error rates, "
        "uplink traffic and routing balance per leaf, and the sweeps.", lay,
        [job_variable(),
         query_variable("instance", "Fabric (sweeping node)",
                        'label_values(gpunet_fabric_switches{job=~"$job"}, instance)',
                        multi=False, include_all=False),
         query_variable("leaf", "Leaf",
                        'label_values(gpunet_fabric_switch_info{job=~"$job", '
                        'instance=~"$instance", role="leaf"}, name)',
                        multi=False, include_all=False)])


# ---------------------------------------------------------------------------------------------
# API for tests and the command line


def dashboards() -> dict[str, Json]:
    """File name (in grafana/) -> dashboard."""
    return {"gpunet-fleet.json": fleet(), "gpunet-node.json": node(),
            "gpunet-collectives.json": collectives(), "gpunet-pairs.json": pairs_dashboard(),
            "gpunet-fabric.json": fabric_dashboard()}


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
    "datasource": "prometheus",
}

_VARIABLE = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace $name, ${name}, ${name:format} and [[name]] by variables[name], else by
    DEFAULT_VALUES[name]; an unknown variable raises KeyError."""
    values = {**DEFAULT_VALUES, **variables}

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in values:
            raise KeyError(f"no value for Grafana variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def render(dash: Json) -> str:
    return json.dumps(dash, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a committed dashboard is stale")
    parser.add_argument("--dir", type=Path, default=HERE,
                        help="where the JSON files are (default: next to this script)")
    args = parser.parse_args(argv)
    stale = []
    for name, dash in dashboards().items():
        path = args.dir / name
        text = render(dash)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(path)
        else:
            path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{path} is stale: run `python grafana/generate.py`", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
