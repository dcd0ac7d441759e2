"""fabric collector: every switch port of an InfiniBand fabric, seen from one host (off by default;
enable it on one or two hosts per fabric).

A background sweep (a background.Refresher, every ``interval_seconds``) runs infiniband-diags
through sources/ibdiag.py; scrapes read only its last result: switch ports, their neighbours and
counters, leaf uplink balance and the sweep's own health. Formats: docs/formats.md §10; the design
and its choices: docs/fabric.md; how to read the metrics: docs/reading-metrics.md.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import Metric

from gpunet_exporter import localize
from gpunet_exporter.background import Fresh, Refresher, add_freshness, last_success_spec
from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec, Scrape
from gpunet_exporter.collectors.probe import NODE_INFO, PAIR_SUCCESS
from gpunet_exporter.collectors.tables import load
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.sources import ibdiag, promapi
from gpunet_exporter.sources.commands import CommandError

_SP = ("switch", "port")
_SW = ("switch",)
_LINKS = "iblinkinfo -l --switches-only (from the sweep's ibnetdiscover)"
_QE = "ibqueryerrors --switch"
_BY = {"tx": "PortXmitData", "rx": "PortRcvData"}
PAIRS_STEP = "pairs"  # the fleet's pair verdicts, read from Prometheus (fabric.prometheus_url)
STEP_NAMES = (*ibdiag.STEPS, PAIRS_STEP)
# The fleet's slow pairs as its rules record them (mixin.alerts.collective: the bandwidth over
# the fleet's median node, only where below fleet.link_slow_ratio), and each pair's success:
# a pair is healthy when it succeeded and is not slow. Per pair as each end's exporter sees
# it, with the end's node name.
SLOW_PAIRS = ("instance_peer:gpunet_fleet_pair_bus_bandwidth_bytes_per_second:"
              "slow_ratio_to_fleet_median")
PAIRS_QUERY = (f"min by (name, peer) (\n  (\n    0 * {SLOW_PAIRS}\n"
               f"    or on (instance, job, peer)\n    {PAIR_SUCCESS.name} == bool 1\n  )\n"
               f"  * on (instance, job) group_left (name) {NODE_INFO.name}\n)")
_LOCALIZE = "dump_fts paths joined with the fleet's pair results (fabric.prometheus_url)"
TOOL_NAMES = ("ibnetdiscover", "iblinkinfo", "ibqueryerrors", "dump_fts")  # ibdiag.Tools fields


def _counter_specs() -> dict[str, tuple[MetricSpec, str, int]]:
    """ibqueryerrors name -> (spec, kind, scale)."""
    out = {}
    for row in load("fabric_counters.csv"):
        spec = MetricSpec(f"gpunet_fabric_port_{row['metric']}_total", "counter", row["help"],
                          _SP, row["unit"], f"{_QE} ({row['name']})")
        out[row["name"]] = (spec, row["kind"], int(row["scale"]))
    return out


COUNTERS = _counter_specs()

SWITCH_INFO = MetricSpec(
    "gpunet_fabric_switch_info", "gauge",
    "Always 1, for each switch of the fabric: its node description and role (leaf or spine)",
    ("switch", "name", "role"), "", _LINKS)
PORT_INFO = MetricSpec(
    "gpunet_fabric_port_info", "gauge",
    "Always 1: the neighbour of a switch port (its port GUID, port, node description and type)",
    ("switch", "port", "remote", "remote_port", "remote_name", "remote_type"), "", _LINKS)
STATE = MetricSpec(
    "gpunet_fabric_port_state_id", "gauge",
    "Logical port state: " + ", ".join(f"{v} {k}" for k, v in ibdiag.STATES.items()), _SP,
    "enum", _LINKS)
PHYS_STATE = MetricSpec(
    "gpunet_fabric_port_phys_state_id", "gauge",
    "Physical port state as IBA numbers it (5 LinkUp, 2 Polling, 3 Disabled)", _SP, "enum",
    _LINKS)
WIDTH = MetricSpec(
    "gpunet_fabric_port_link_width_lanes", "gauge", "Active link width", _SP,
    "lanes", _LINKS)
LANE_SPEED = MetricSpec(
    "gpunet_fabric_port_lane_speed_bytes_per_second", "gauge",
    "Nominal data rate per lane (HDR 50, NDR 100, XDR 200 Gb/s)", _SP,
    "bytes per second", _LINKS)
RATE = MetricSpec(
    "gpunet_fabric_port_rate_bytes_per_second", "gauge",
    "Rate the link runs at, width x lane speed", _SP, "bytes per second",
    _LINKS)
RATE_SUPPORTED = MetricSpec(
    "gpunet_fabric_port_rate_supported_bytes_per_second", "gauge",
    "Best rate both ends of the link support (iblinkinfo's 'Could be')",
    _SP, "bytes per second", _LINKS)
DEGRADED = MetricSpec(
    "gpunet_fabric_port_rate_degraded", "gauge",
    "1 when an active link trained narrower or slower than both its ends support, else 0",
    _SP, "boolean", _LINKS)
ROUTED = MetricSpec(
    "gpunet_fabric_port_routed_host_lids", "gauge",
    "Host (channel adapter) LIDs the switch's linear forwarding table sends out of this port",
    _SP, "LIDs", "dump_fts")
UPLINKS = MetricSpec(
    "gpunet_fabric_leaf_uplinks", "gauge",
    "Active ports of a leaf switch whose neighbour is a switch", _SW, "ports", _LINKS)
HOST_CAPACITY = MetricSpec(
    "gpunet_fabric_leaf_host_capacity_bytes_per_second", "gauge",
    "Summed rate of a leaf switch's active ports whose neighbour is a host (channel adapter)",
    _SW, "bytes per second", _LINKS)
UPLINK_CAPACITY = MetricSpec(
    "gpunet_fabric_leaf_uplink_capacity_bytes_per_second", "gauge",
    "Summed rate of a leaf switch's active ports whose neighbour is a switch", _SW,
    "bytes per second", _LINKS)
OVERSUBSCRIPTION = MetricSpec(
    "gpunet_fabric_leaf_oversubscription_ratio", "gauge",
    "A leaf's host-facing capacity over its uplink capacity (1 is non-blocking)", _SW, "ratio",
    f"{_LINKS}: active width x speed of both port sets")
UPLINK_RATE = MetricSpec(
    "gpunet_fabric_leaf_uplink_bytes_per_second", "gauge",
    "Mean traffic per active uplink of a leaf over the last sweep interval",
    ("switch", "direction"), "bytes per second",
    f"{_QE} --counters (PortXmitData, PortRcvData), difference of two sweeps")
IMBALANCE = MetricSpec(
    "gpunet_fabric_leaf_uplink_imbalance_ratio", "gauge",
    "The busiest uplink's traffic over the leaf's mean, minus 1 (0 is even)",
    ("switch", "direction"), "ratio",
    f"{_QE} --counters, difference of two sweeps")
ROUTES_IMBALANCE = MetricSpec(
    "gpunet_fabric_leaf_routes_imbalance_ratio", "gauge",
    "Host LIDs the leaf's busiest uplink routes over the mean of its active uplinks, minus 1",
    _SW, "ratio", "dump_fts")
ROUTES_UNBALANCED = MetricSpec(
    "gpunet_fabric_leaf_routes_unbalanced", "gauge",
    "1 when an active uplink of a leaf routes more than one host LID more than another, else 0",
    _SW, "boolean", "dump_fts")
LINK_VERDICT = MetricSpec(
    "gpunet_fabric_link_verdict", "gauge",
    "Always 1: what the last localization concluded of a switch-to-switch cable (its spine end)",
    ("switch", "port", "verdict"), "", _LOCALIZE)
LINK_PAIRS = MetricSpec(
    "gpunet_fabric_link_probe_pairs", "gauge",
    "Fleet pairs of the last localization whose paths cross the cable, healthy or not",
    ("switch", "port", "result"), "pairs", _LOCALIZE)
LOCALIZED_PAIRS = MetricSpec(
    "gpunet_fabric_localization_pairs", "gauge",
    "Fleet pairs of the last localization: " + ", ".join(localize.PAIR_RESULTS),
    ("result",), "pairs", _LOCALIZE)
NODES_BLAMED = MetricSpec(
    "gpunet_fabric_localization_nodes_blamed", "gauge",
    "Nodes, not cables, that the last localization found to explain unhealthy pairs", (),
    "nodes", _LOCALIZE)
SWITCHES = MetricSpec(
    "gpunet_fabric_switches", "gauge", "Switches the last sweep found", (), "switches", _LINKS)
SWEEP_SUCCESS = MetricSpec(
    "gpunet_fabric_sweep_success", "gauge",
    "1 if the latest sweep discovered the fabric, else 0",
    (), "boolean", "ibnetdiscover, iblinkinfo")
SWEEP_LAST_SUCCESS = last_success_spec("gpunet_fabric_sweep", "sweep of the fabric")
SWEEP_DURATION = MetricSpec(
    "gpunet_fabric_sweep_duration_seconds", "gauge", "How long the last sweep took", (),
    "seconds", "exporter clock")
STEP_SUCCESS = MetricSpec(
    "gpunet_fabric_step_success", "gauge",
    "1 if the step of the latest sweep succeeded, else 0", ("step",), "boolean", "exit status and "
    "output of the step's tool")
STEP_DURATION = MetricSpec(
    "gpunet_fabric_step_duration_seconds", "gauge", "How long the step took in the last sweep",
    ("step",), "seconds", "exporter clock")

SPECS = (SWITCH_INFO, PORT_INFO, STATE, PHYS_STATE, WIDTH, LANE_SPEED, RATE, RATE_SUPPORTED,
         DEGRADED, *(s for s, _, _ in COUNTERS.values()), ROUTED, UPLINKS, HOST_CAPACITY,
         UPLINK_CAPACITY, OVERSUBSCRIPTION, UPLINK_RATE, IMBALANCE, ROUTES_IMBALANCE,
         ROUTES_UNBALANCED, LINK_VERDICT, LINK_PAIRS, LOCALIZED_PAIRS, NODES_BLAMED, SWITCHES,
         SWEEP_SUCCESS, SWEEP_LAST_SUCCESS, SWEEP_DURATION,
         STEP_SUCCESS, STEP_DURATION)


@dataclass(frozen=True)
class FabricSettings(Settings):
    interval_seconds: float = setting("how often the fabric is swept in the background",
                                      default=60, minimum=1)
    timeout_seconds: float = setting("how long one tool may run before it is killed (its step "
                                     "fails)", default=120, minimum=0.1)
    ca: str = setting("HCA the tools send from (their -C); empty: the first with a port up",
                      default="")
    port: int = setting("port of that HCA (their -P); 0: the tools' default", default=0,
                        minimum=0, maximum=255)
    tools_dir: str = setting(
        "folder holding ibnetdiscover, iblinkinfo, ibqueryerrors and dump_fts; empty: looked up "
        "in PATH, then /usr/sbin and /sbin", default="")
    environment: tuple[str, ...] = setting(
        "extra NAME=value environment of the tools (a simulator's LD_PRELOAD and "
        "IBSIM_SOCKNAME in the tests)", default=())
    balance_min_bytes_per_second: float = setting(
        "mean traffic per uplink below which a leaf's uplink imbalance is not judged (an idle "
        "fabric's few management packets are never even)", default=1e8, minimum=0)
    prometheus_url: str = setting(
        "Prometheus whose fleet pair verdicts the sweep's paths are joined with, to name the "
        "cable slow pairs share (http://host:9090); empty: no path localization", default="")
    prometheus_ca_file: str = setting(
        "PEM file of the CAs that sign Prometheus's certificate (https://); empty: the system's",
        default="")
    prometheus_cert_file: str = setting(
        "PEM client certificate presented to Prometheus (https://, with prometheus_key_file "
        "unless the key is in it); empty: none", default="")
    prometheus_key_file: str = setting(
        "PEM private key of prometheus_cert_file; empty: in the certificate's file", default="")
    prometheus_username: str = setting(
        "user of HTTP basic authentication to Prometheus, with prometheus_password_file; "
        "empty: none", default="")
    prometheus_password_file: str = setting(
        "file holding that user's password, read at every query", default="")
    prometheus_bearer_token_file: str = setting(
        "file holding a bearer token sent to Prometheus, read at every query (a rotated "
        "service account token is picked up); empty: none", default="")
    host_pattern: str = setting(
        "regular expression whose first group is a host's node name in its HCA's node "
        "description (the rest names the rail)", default=r"^(\S+)")


def _program(name: str, folder: str) -> str:
    if folder:
        return os.path.join(folder, name)
    found = shutil.which(name) or shutil.which(
        name, path=os.pathsep.join(("/usr/sbin", "/sbin")))
    return found or name


@dataclass
class _Port:
    """What the collector remembers of one switch port across sweeps."""

    remote: str = ""
    remote_port: str = ""
    remote_name: str = ""
    remote_type: str = ""


class FabricCollector(Collector):
    name = "fabric"
    description = ("Every switch port of the InfiniBand fabric (infiniband-diags in the "
                   "background): state, width and speed against what both ends support, "
                   "counters, neighbours, uplink traffic balance and routing balance per leaf")
    default_enabled = False
    metrics = SPECS
    settings_type = FabricSettings
    settings: FabricSettings
    unknown_checks: ClassVar[Mapping[str, str]] = {
        "sweep": "the fabric's switch ports, links, counters and routing (the "
                 "`gpunet_fabric_` series): infiniband-diags runs the sweep"}

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        cfg = self.settings
        self._unknown: Mapping[str, str] = {}
        env = {}
        for item in cfg.environment:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"fabric.environment: {item!r} is not NAME=value")
            env[key] = value
        self._prometheus: promapi.Client | None = None
        if cfg.prometheus_url:
            try:
                self._prometheus = promapi.Client(
                    cfg.prometheus_url, ca_file=cfg.prometheus_ca_file,
                    cert_file=cfg.prometheus_cert_file, key_file=cfg.prometheus_key_file,
                    username=cfg.prometheus_username,
                    password_file=cfg.prometheus_password_file,
                    bearer_token_file=cfg.prometheus_bearer_token_file)
            except promapi.BadAccess as exc:
                raise ValueError(f"fabric.prometheus_{exc.field}: {exc}") from None
        try:
            pattern = re.compile(cfg.host_pattern)
        except re.error as exc:
            raise ValueError(f"fabric.host_pattern: {cfg.host_pattern!r} is not a regular "
                             f"expression ({exc})") from None
        if pattern.groups < 1:
            raise ValueError(f"fabric.host_pattern: {cfg.host_pattern!r} has no group (the "
                             "first group is the host's name)")
        folder = cfg.tools_dir
        self.tools = ibdiag.Tools(
            ibnetdiscover=_program("ibnetdiscover", folder),
            iblinkinfo=_program("iblinkinfo", folder),
            ibqueryerrors=_program("ibqueryerrors", folder),
            dump_fts=_program("dump_fts", folder), ca=cfg.ca, port=cfg.port,
            timeout=float(cfg.timeout_seconds), env=env)
        self._lock = threading.Lock()
        self._ports: dict[tuple[str, int], _Port] = {}
        self._last: ibdiag.Fabric | None = None  # the last good sweep
        self._counters_at: dict[str, tuple[float, dict[tuple[str, int], dict[str, int]]]] = {}
        self._families: list[Metric] = []  # the last sweep's, built once in the background
        self._localized: list[Metric] = []  # the last good localization's families
        self._steps: dict[str, tuple[bool, float]] = {}
        self._sweep: Fresh[float] = Fresh()  # value: the last good sweep's duration
        self._tools_missing = self._missing()  # looked up again by every round
        self._refresher: Refresher[None] = Refresher(
            "fabric", float(cfg.interval_seconds), lambda: self.refresh(), self.ctx.log_once)

    # -- background ------------------------------------------------------------------------

    def refresh(self) -> None:
        """One sweep; runs in the background thread (tests call it directly)."""
        missing = self._missing()
        with self._lock:
            self._tools_missing = missing
        try:
            fabric = ibdiag.sweep(self.tools)
        except (CommandError, ibdiag.ParseError, OSError) as exc:
            self.ctx.log_once(logging.WARNING, "sweeping the fabric failed: %s", exc)
            with self._lock:
                self._sweep = self._sweep.failed()
                self._steps = {s: (False, 0.0) for s in ("discover", "links")}
            raise
        for step, why in fabric.failed.items():
            self.ctx.log_once(logging.WARNING, "fabric sweep: %s failed: %s", step, why)
        roles = self._roles(fabric)
        families = self._build(fabric, roles)
        if self._prometheus is not None:
            families += self._localize(fabric, roles, self._prometheus)
        with self._lock:
            self._families = families
            self._steps = {s: (s not in fabric.failed, fabric.step_seconds.get(s, 0.0))
                           for s in STEP_NAMES if s in fabric.step_seconds}
            self._sweep = self._sweep.succeeded(fabric.duration, fabric.at)

    def _missing(self) -> bool:
        """Whether a tool of the sweep is not found (installed, or in ``tools_dir``)."""
        return any(shutil.which(getattr(self.tools, t)) is None for t in TOOL_NAMES)

    def _build(self, fabric: ibdiag.Fabric, roles: Mapping[str, str]) -> list[Metric]:
        """The families of one sweep, built once in the background (each port's samples share
        one label dict) so that a scrape only copies them."""
        last = self._last
        if fabric.errors is None and last is not None:
            fabric.errors = last.errors  # the last good ones, as a failed step promises
        if fabric.routes is None and last is not None:
            fabric.routes, fabric.forwarding = last.routes, last.forwarding
        if "counters" in fabric.failed and last is not None:
            fabric.counters = last.counters
        self._last = fabric
        fams = Families()
        switches = {link.switch for link in fabric.links}
        names: dict[str, str] = {}
        by_switch: dict[str, list[ibdiag.Link]] = {}
        for link in fabric.links:
            names.setdefault(link.switch, link.switch_name)
            by_switch.setdefault(link.switch, []).append(link)
        fams.add(SWITCHES, [], float(len(switches)))
        for sw in sorted(by_switch):
            fams.add(SWITCH_INFO, [sw, names[sw], roles[sw]], 1.0)
        seen: set[tuple[str, int]] = set()
        for link in fabric.links:
            key = (link.switch, link.port)
            seen.add(key)
            labels = {"switch": link.switch, "port": str(link.port)}  # shared by the port
            mem = self._ports.setdefault(key, _Port())
            if link.remote:
                mem.remote, mem.remote_port = link.remote, str(link.remote_port or "")
                mem.remote_name = link.remote_name
                mem.remote_type = "switch" if link.remote in switches else "ca"
            fams.add(PORT_INFO, [link.switch, str(link.port), mem.remote, mem.remote_port,
                                 mem.remote_name, mem.remote_type], 1.0)
            if link.state is not None:
                fams.add_labeled(STATE, labels, float(link.state))
            if link.phys_state is not None:
                fams.add_labeled(PHYS_STATE, labels, float(link.phys_state))
            rate, supported = link.rate_gbps, link.supported_gbps
            if link.width is not None:
                fams.add_labeled(WIDTH, labels, float(link.width))
            if link.lane_gbps is not None:
                fams.add_labeled(LANE_SPEED, labels, link.lane_gbps * ibdiag.BYTES_PER_GBIT)
            if rate is not None and supported is not None:
                fams.add_labeled(RATE, labels, rate * ibdiag.BYTES_PER_GBIT)
                fams.add_labeled(RATE_SUPPORTED, labels, supported * ibdiag.BYTES_PER_GBIT)
                if link.state == 4:
                    fams.add_labeled(DEGRADED, labels, float(rate < supported))
            data = fabric.counters.get(key)
            if data is not None:
                for name, value in data.items():
                    entry = COUNTERS.get(name)
                    if entry is not None and entry[1] == "data":
                        fams.add_labeled(entry[0], labels, float(value * entry[2]))
                if fabric.errors is not None:  # read: a counter not printed is 0
                    errs = fabric.errors.get(key, {})
                    for name, (spec, kind, scale) in COUNTERS.items():
                        if kind == "errors":
                            fams.add_labeled(spec, labels, float(errs.get(name, 0) * scale))
            routed = (fabric.routes or {}).get(link.switch, {}).get(link.port)
            if routed:
                fams.add_labeled(ROUTED, labels, float(routed))
        for gone in self._ports.keys() - seen:
            if gone[0] not in switches:  # a switch no longer in the fabric is forgotten
                del self._ports[gone]
        self._balance(fams, fabric, by_switch, roles, switches)
        return list(fams)

    @staticmethod
    def _roles(fabric: ibdiag.Fabric) -> dict[str, str]:
        """Switch GUID -> "leaf" (an active port to a host), "spine" (active ports to switches
        only) or "" (no active port)."""
        switches = {link.switch for link in fabric.links}
        roles: dict[str, str] = {}
        for link in fabric.links:
            up = link.state == 4 and bool(link.remote)
            if up and link.remote not in switches:
                roles[link.switch] = "leaf"
            elif up and roles.get(link.switch) != "leaf":
                roles[link.switch] = "spine"
            else:
                roles.setdefault(link.switch, "")
        return roles

    def _balance(self, fams: Families, fabric: ibdiag.Fabric,
                 by_switch: dict[str, list[ibdiag.Link]], roles: Mapping[str, str],
                 switches: set[str]) -> None:
        floor = float(self.settings.balance_min_bytes_per_second)
        counters_ok = "counters" not in fabric.failed
        previous = self._counters_at
        self._counters_at = {}
        for sw, links in sorted(by_switch.items()):
            if roles[sw] != "leaf":
                continue
            uplinks = [lk.port for lk in links
                       if lk.state == 4 and lk.remote and lk.remote in switches]
            fams.add(UPLINKS, [sw], float(len(uplinks)))
            self._capacity(fams, sw, links, switches)
            routes = (fabric.routes or {}).get(sw)
            if routes is not None and len(uplinks) >= 2:
                counts = [routes.get(p, 0) for p in uplinks]
                mean = sum(counts) / len(counts)
                if mean > 0:
                    fams.add(ROUTES_IMBALANCE, [sw], max(counts) / mean - 1)
                fams.add(ROUTES_UNBALANCED, [sw], float(max(counts) > min(counts) + 1))
            if not counters_ok:
                continue
            now = {(sw, p): fabric.counters[(sw, p)] for p in uplinks
                   if (sw, p) in fabric.counters}
            self._counters_at[sw] = (fabric.at, now)
            before = previous.get(sw)
            if before is None or len(uplinks) < 2 or len(now) != len(uplinks):
                continue
            dt = fabric.at - before[0]
            if dt <= 0 or set(before[1]) != set(now):
                continue  # the uplinks changed: judge from the next interval
            for direction, field_name in _BY.items():
                rates = []
                for key, values in now.items():
                    old = before[1][key].get(field_name)
                    new = values.get(field_name)
                    if old is None or new is None or new < old:
                        break  # cleared or reset: skip this leaf this time
                    rates.append((new - old) * 4 / dt)
                else:
                    mean = sum(rates) / len(rates)
                    fams.add(UPLINK_RATE, [sw, direction], mean)
                    if mean > 0 and mean >= floor:
                        fams.add(IMBALANCE, [sw, direction], max(rates) / mean - 1)

    def _localize(self, fabric: ibdiag.Fabric, roles: Mapping[str, str],
                  prometheus: promapi.Client) -> list[Metric]:
        """The pairs step: the fleet's pair verdicts from Prometheus, joined with this sweep's
        paths (gpunet_exporter.localize). A failed query costs only these families."""
        t0 = time.monotonic()
        try:
            rows = prometheus.query(PAIRS_QUERY, float(self.settings.timeout_seconds))
        except promapi.QueryError as exc:
            fabric.failed[PAIRS_STEP] = str(exc)
            self.ctx.log_once(logging.WARNING, "fabric sweep: %s failed: %s", PAIRS_STEP, exc)
            return self._localized  # the last good ones, as for every step
        finally:
            fabric.step_seconds[PAIRS_STEP] = time.monotonic() - t0
        health: dict[tuple[str, str], bool] = {}
        for labels, value in rows:
            a, b = labels.get("name", ""), labels.get("peer", "")
            if a and b and a != b:
                key = (min(a, b), max(a, b))
                health[key] = health.get(key, True) and value >= 1
        if fabric.forwarding is None:  # no routes step has succeeded yet
            return []
        r = localize.routes(fabric.links, fabric.forwarding,
                            (sw for sw, role in roles.items() if role == "spine"),
                            self.settings.host_pattern)
        found = localize.localize(r, health)
        fams = Families()
        for cable, verdict in sorted(found.verdicts.items()):
            fams.add(LINK_VERDICT, [cable.switch, str(cable.port), verdict], 1.0)
        for cable, (ok, bad) in sorted(found.crossing.items()):
            fams.add(LINK_PAIRS, [cable.switch, str(cable.port), "healthy"], float(ok))
            fams.add(LINK_PAIRS, [cable.switch, str(cable.port), "unhealthy"], float(bad))
        for result, n in found.pairs.items():
            fams.add(LOCALIZED_PAIRS, [result], float(n))
        fams.add(NODES_BLAMED, [], float(len(found.nodes_blamed)))
        self._localized = list(fams)
        return self._localized

    @staticmethod
    def _capacity(fams: Families, sw: str, links: list[ibdiag.Link],
                  switches: set[str]) -> None:
        """A leaf's host-facing and uplink capacity, each the summed rate of its active ports
        on that side, and their ratio (absent without an active uplink: a leaf cut off from
        the spines is a fabric of its own to a sweep from one of its hosts)."""
        capacity = {"host": 0.0, "uplink": 0.0}
        for lk in links:
            if lk.state == 4 and lk.remote and lk.rate_gbps is not None:
                side = "uplink" if lk.remote in switches else "host"
                capacity[side] += lk.rate_gbps * ibdiag.BYTES_PER_GBIT
        fams.add(HOST_CAPACITY, [sw], capacity["host"])
        fams.add(UPLINK_CAPACITY, [sw], capacity["uplink"])
        if capacity["uplink"] > 0:
            fams.add(OVERSUBSCRIPTION, [sw], capacity["host"] / capacity["uplink"])

    # -- scrape ----------------------------------------------------------------------------

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        self._refresher.start()
        self._refresher.wait_first(scrape.deadline)
        with self._lock:
            families, steps, sweep = self._families, self._steps, self._sweep
            tools_missing = self._tools_missing
        # Copies of the sweep's families (the registry may drop samples from what it gets),
        # sharing their samples.
        out: list[Metric] = []
        for fam in families:
            shallow = copy.copy(fam)
            shallow.samples = list(fam.samples)
            out.append(shallow)
        fams = Families()
        add_freshness(fams, SWEEP_SUCCESS, SWEEP_LAST_SUCCESS, [], sweep)
        if sweep.value is not None:
            fams.add(SWEEP_DURATION, [], sweep.value)
        for step, (ok, seconds) in sorted(steps.items()):
            fams.add(STEP_SUCCESS, [step], float(ok))
            if ok:
                fams.add(STEP_DURATION, [step], seconds)
        out += fams
        self._unknown = {}
        if tools_missing:
            self._unknown = {"sweep": "tool_missing"}
        elif sweep.ok is False and sweep.value is None:
            self._unknown = {"sweep": "tool_failing"}
        return iter(out)

    def unknown(self) -> Mapping[str, str]:
        """``sweep`` while a tool of the sweep is not installed (its step, at least, is not
        checked), or while no sweep has succeeded since the start; a sweep that fails later
        keeps the last good values (GpunetFabricSweepFailing)."""
        return self._unknown

    def close(self) -> None:
        self._refresher.stop()
