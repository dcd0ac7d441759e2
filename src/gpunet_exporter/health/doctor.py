"""``gpunet-exporter doctor``: a one-off health check of this node, for a person at a terminal, a
Slurm prolog or a node health check.

It runs the collectors the exporter would run (same flags, same config file), reads them twice
``--interval`` seconds apart so counters give rates, waits for the probe's first round when the
probe collector is on, and applies the alert thresholds of gpunet_exporter.mixin.thresholds (the
same values the generated Prometheus rules use; ``--thresholds FILE`` overrides them the same
way). Findings are grouped by root cause, each naming the device and a command that confirms it.

Exit codes: 0 healthy (or only info findings), 1 findings, 2 could not check (a collector failed,
nothing to check, or bad input). ``--json`` prints one JSON document instead of the report.

Notes say what is worth knowing but no finding: NCCL settings a job makes on purpose, and the
link-downed and carrier-change counts it cannot place in the alerts' windows. They are printed in
their own section (``notes`` in JSON) and never change the exit code. The counters it read go to
a small state file (``--state-file``), so that the next run can count the flaps since this one, as
the flapping alerts count them over hours.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import Metric

from gpunet_exporter.collector import Collector, Scrape
from gpunet_exporter.collectors.nccl import NcclCollector
from gpunet_exporter.collectors.probe import ProbeCollector, ProbeSettings
from gpunet_exporter.errors import ConfigError
from gpunet_exporter.files import read_regular
from gpunet_exporter.logs import setup
from gpunet_exporter.mixin.alerts import ALERT_NAMES, ALERTS
from gpunet_exporter.mixin.thresholds import Thresholds, load
from gpunet_exporter.nccl.env import NCCL_FAULT_CLASSES, NCCL_SETTING_NOTES
from gpunet_exporter.options import build_parser, server_only_flags, start_collectors
from gpunet_exporter.probe import idle, results
from gpunet_exporter.registry import Scraper, discover
from gpunet_exporter.sources.commands import kill_running
from gpunet_exporter.statefile import write_json

PROG = "gpunet-exporter doctor"
DEFAULT_STATE = "/var/lib/gpunet-exporter/doctor.json"
Labels = dict[str, str]

# Root causes, in the order the report lists them, in the operator's words.
CAUSES = {
    "nccl_tcp": "NCCL on TCP sockets",
    "gdr_off": "GPUDirect RDMA off",
    "link": "Degraded or flapping link",
    "pfc": "PFC or ECN misconfigured, or congestion",
    "retransmit": "Packet loss: RDMA retransmissions",
    "mtu": "MTU",
    "numa": "GPU and NIC placement (NUMA, ACS)",
    "gpu_pcie": "Degraded GPU PCIe link",
    "gpu": "GPU faults",
    "collective": "Slow collectives or a straggler",
    "gpu_wait": "GPUs waiting (starved, or in the network-bound band)",
    "inventory": "RDMA devices, ports or netdevs gone",
    "nccl_job": "NCCL jobs running now (NCCL's RAS service; the job's, not the node's: no "
                "effect on the exit code)",
}
# Findings that say something could not be checked rather than that something is wrong: alone,
# they make the exit code 2 (could not check), not 1, and each also gives a `problems` entry.
COULD_NOT_CHECK = frozenset({"GpunetPfcConfigUnreadable"})
SEVERITY = {a.name: a.severity for a in ALERTS}
# Causes that say something of a job rather than of this node: listed, never the exit code. RAS
# reports the whole job from every node, so a rank killed on one node (out of memory, a user's
# bug) would otherwise fail the health check of every node of the job and drain them all.
JOB_CAUSES = frozenset({"nccl_job"})


@dataclass(frozen=True)
class Finding:
    cause: str  # a key of CAUSES
    alert: str  # the alert of alerts/gpunet.rules.yml that fires on the same condition
    where: str  # the device, port, interface or GPU
    message: str
    confirm: str  # a command that shows it

    @property
    def severity(self) -> str:
        return SEVERITY[self.alert]


@dataclass(frozen=True)
class Note:
    """What the doctor reports without judging it a fault: no alert fires on it and it never
    changes the exit code (an NCCL setting such as NCCL_SOCKET_IFNAME on the management network,
    flaps it cannot place in an alert's window, a state file it cannot use)."""
    where: str
    message: str


class Snapshot:
    """One collection: sample name -> [(labels, value)]."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.time = time.time()
        self.samples: dict[str, list[tuple[Labels, float]]] = {}
        for family in families:
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))

    def all(self, name: str, **match: str) -> Iterator[tuple[Labels, float]]:
        for labels, v in self.samples.get(name, []):
            if all(labels.get(k) == want for k, want in match.items()):
                yield labels, v

    def get(self, name: str, **match: str) -> float | None:
        return next((v for _, v in self.all(name, **match)), None)


class Check:
    """The two snapshots and the thresholds the checks read."""

    def __init__(self, a: Snapshot, b: Snapshot, t: Thresholds) -> None:
        self.a, self.b, self.t = a, b, t
        self.dt = max(b.time - a.time, 1e-3)
        self.findings: list[Finding] = []
        # What earlier doctor runs saw (the state file), and what is worth knowing but no
        # finding: no alert, no effect on the exit code.
        self.history: dict[str, Any] = {}
        self.notes: list[Note] = []
        self.problems: list[str] = []  # what the checks could not judge

    def rate(self, name: str) -> Iterator[tuple[Labels, float]]:
        """Per-second increase of a counter between the snapshots (series in both)."""
        before = {tuple(sorted(lbl.items())): v for lbl, v in self.a.all(name)}
        for labels, v in self.b.all(name):
            old = before.get(tuple(sorted(labels.items())))
            if old is not None and v >= old:
                yield labels, (v - old) / self.dt

    def add(self, cause: str, alert: str, where: str, message: str, confirm: str) -> None:
        self.findings.append(Finding(cause, alert, where, message, confirm))

    def active_rdma_port(self) -> bool:
        return any(v == 4 for _, v in self.b.all("gpunet_infiniband_port_state_id"))

    def working_gpus(self) -> dict[str, float]:
        """GPU -> its utilization, the mean of the two readings, for each GPU that runs compute
        processes (the GPUs the starved and band alerts judge)."""
        before = {lbl.get("gpu"): v for lbl, v in self.a.all("gpunet_gpu_utilization_ratio")}
        out = {}
        for lbl, v in self.b.all("gpunet_gpu_utilization_ratio"):
            gpu = lbl.get("gpu", "")
            if (self.b.get("gpunet_gpu_compute_processes", gpu=gpu) or 0) > 0:
                out[gpu] = (v + before.get(gpu, v)) / 2
        return out

    def roce_interfaces(self) -> set[str]:
        return {lbl["interface"] for lbl, _ in self.b.all("gpunet_link_info")
                if lbl.get("link_layer") == "Ethernet"}


def _port(lbl: Labels) -> str:
    return f"{lbl.get('device')} port {lbl.get('port')}"


def check_links(c: Check) -> None:
    b, t = c.b, c.t.infiniband
    phys = {(lbl["device"], lbl["port"]): v for lbl, v in b.all(
        "gpunet_infiniband_port_phys_state_id")}
    for lbl, state in b.all("gpunet_infiniband_port_state_id"):
        p = phys.get((lbl["device"], lbl["port"]))
        if state != 4 or (p is not None and p != 5):
            c.add("link", "GpunetPortDown", _port(lbl),
                  f"not ACTIVE/LinkUp (state {state:.0f}, physical state "
                  f"{'?' if p is None else f'{p:.0f}'})",
                  f"ibstat {lbl['device']} {lbl['port']}")
    for lbl, v in b.all("gpunet_infiniband_port_rate_degraded"):
        if v == 1:
            rate = b.get("gpunet_infiniband_port_rate_bytes_per_second", **lbl) or 0
            want = b.get("gpunet_infiniband_port_rate_expected_bytes_per_second", **lbl) or 0
            c.add("link", "GpunetPortRateBelowExpected", _port(lbl),
                  f"runs at {rate * 8 / 1e9:g} Gb/s, expected {want * 8 / 1e9:g} Gb/s",
                  f"cat /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/rate")
    for lbl, r in c.rate("gpunet_infiniband_port_link_downed_total"):
        if r > 0:
            c.add("link", "GpunetPortFlapping", _port(lbl), "went down during the check",
                  f"perfquery -x (on {lbl['device']} port {lbl['port']}); dmesg | grep -i mlx5")
    for lbl, r in c.rate("gpunet_link_carrier_changes_total"):
        if r > 0:
            c.add("link", "GpunetInterfaceFlapping", lbl["interface"],
                  "carrier changed during the check", f"ip -s link show {lbl['interface']}")
    for metric, alert, limit, per, what in (
            ("symbol_errors", "GpunetPortSymbolErrors", t.symbol_errors_per_hour, 3600,
             "symbol errors per hour"),
            ("link_error_recoveries", "GpunetPortLinkErrorRecoveries",
             t.link_error_recoveries_per_minute, 60, "link retrains per minute"),
            ("receive_errors", "GpunetPortReceiveErrors", t.receive_errors_per_second, 1,
             "receive errors per second"),
            ("transmit_discards", "GpunetPortTransmitDiscards",
             t.transmit_discards_per_second, 1, "transmit discards per second")):
        for lbl, r in c.rate(f"gpunet_infiniband_port_{metric}_total"):
            if r * per > limit:
                c.add("link", alert, _port(lbl), f"{r * per:.4g} {what} (limit {limit:g})",
                      f"perfquery -x  # {lbl['device']} port {lbl['port']}, twice")
    for lbl, v in b.all("gpunet_infiniband_port_pma_saturated"):
        if v == 1:
            c.add("link", "GpunetPortCounterSaturated", _port(lbl),
                  f"counter {lbl['counter']} stuck at its maximum; its errors are invisible",
                  "perfquery -R  # clears the port's counters")
    for lbl, v in b.all("gpunet_topology_nic_pcie_link_degraded"):
        if v == 1:
            dev = lbl["device"]
            info = next((i for i, _ in b.all("gpunet_topology_nic_pcie_info", device=dev)), {})
            bdf = info.get("pci_address") or (
                f"$(basename $(readlink /sys/class/infiniband/{dev}/device))")
            link = {(lb["end"], name): x for name in (
                "speed_transfers_per_second", "width_lanes", "max_speed_transfers_per_second",
                "max_width_lanes") for lb, x in b.all(
                    f"gpunet_topology_nic_pcie_link_{name}", device=dev)}
            speed = min(link.get((e, "max_speed_transfers_per_second"), 0)
                        for e in ("device", "upstream"))
            width = min(link.get((e, "max_width_lanes"), 0) for e in ("device", "upstream"))
            c.add("link", "GpunetNicPcieLinkDegraded", dev,
                  f"PCIe link at {link.get(('device', 'speed_transfers_per_second'), 0) / 1e9:g} "
                  f"GT/s x{link.get(('device', 'width_lanes'), 0):.0f}, both ends allow "
                  f"{speed / 1e9:g} GT/s x{width:.0f}",
                  f"sudo lspci -vv -s {bdf} | grep -E 'LnkCap|LnkSta'")


# PHY counters of ethtool -S behind GpunetInterfacePhyErrors, with the driver names to grep.
PHY_ERRORS = (
    ("fec_uncorrected_symbol_errors", "FEC-uncorrected symbol errors", "rx_pcs_symbol_err_phy"),
    ("symbol_errors", "symbol errors", "rx_symbol_err_phy|symbol_err"),
    ("crc_errors", "CRC errors", "rx_crc_errors_phy"),
)


def check_phy(c: Check) -> None:
    """GpunetInterfacePhyErrors: any of the PHY error counters of a RoCE interface rising
    faster than link.phy_errors_per_hour (one finding per interface, as the alert's ``or``)."""
    limit, roce = c.t.link.phy_errors_per_hour, c.roce_interfaces()
    seen: set[str] = set()
    for metric, what, names in PHY_ERRORS:
        for lbl, r in c.rate(f"gpunet_pfc_{metric}_total"):
            name = lbl["interface"]
            if name in roce and name not in seen and r * 3600 > limit:
                seen.add(name)
                c.add("link", "GpunetInterfacePhyErrors", name,
                      f"{r * 3600:.4g} {what} per hour (limit {limit:g})",
                      f"ethtool -S {name} | grep -E '{names}'  # twice, a minute apart; "
                      f"then mlxlink -d <PCI> -c")


# --- flap history: counters the earlier doctor runs recorded ---------------------------------
# The flapping alerts count link-downed events and carrier changes over hours; the check's own
# seconds see almost none. The doctor records both counters in its state file on every run, so
# the next run can count what happened since the runs that lie within the alert's window.
FLAP_COUNTERS = (
    # (metric, alert, state key, count threshold key, window threshold key, what)
    ("gpunet_infiniband_port_link_downed_total", "GpunetPortFlapping", "link_downed",
     "link_downed_count", "link_downed_window", "link-downed events"),
    ("gpunet_link_carrier_changes_total", "GpunetInterfaceFlapping", "carrier_changes",
     "carrier_changes_count", "carrier_changes_window", "carrier changes"),
)
HISTORY_KEEP = 64  # observations kept per counter
_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> float:
    """A Prometheus duration (thresholds has checked its syntax) in seconds."""
    return sum(float(n) * _UNIT[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))


def _flap_key(kind: str, lbl: Labels) -> tuple[str, str]:
    """The state file's key of a series and where the report says it is."""
    if kind == "link_downed":
        return f"{lbl.get('device')}/{lbl.get('port')}", _port(lbl)
    return lbl.get("interface", ""), lbl.get("interface", "")


def _since_reset(obs: list[list[float]], v: float) -> list[list[float]]:
    """The observations after the counter's last fall (reboot, driver reload, perfquery -R),
    given its value now."""
    kept: list[list[float]] = []
    for o in reversed(obs):
        if o[1] > v:
            break
        kept.append(o)
        v = o[1]
    return kept[::-1]


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(ts))


def check_flap_history(c: Check) -> None:
    """GpunetPortFlapping and GpunetInterfaceFlapping beyond the check's own seconds: a finding
    when the counter rose by the alert's count since an earlier doctor run that lies within the
    alert's window (so the alert fires too); a note when it rose less, or since a run older than
    the window, and for a large count since boot, whose time the doctor cannot tell."""
    b, t = c.b, c.t.infiniband
    found = {(f.alert, f.where) for f in c.findings}
    for metric, alert, kind, count_key, window_key, what in FLAP_COUNTERS:
        count, window = getattr(t, count_key), getattr(t, window_key)
        past: dict[str, list[list[float]]] = c.history.get(kind, {})
        for lbl, v in b.all(metric):
            key, where = _flap_key(kind, lbl)
            if (alert, where) in found:
                continue  # it changed during the check: check_links reported it
            obs = _since_reset(past.get(key, []), v)
            recent = [o for o in obs if b.time - o[0] <= seconds(window)]
            if recent and v - recent[0][1] >= count:
                c.add("link", alert, where,
                      f"{v - recent[0][1]:.0f} {what} since the doctor run at "
                      f"{_when(recent[0][0])} (the alert fires from {count} within {window})",
                      f"ip -s link show {where}" if kind == "carrier_changes" else
                      f"perfquery -x (on {lbl['device']} port {lbl['port']}); "
                      "dmesg | grep -i mlx5")
                continue
            since = recent[0] if recent else (obs[-1] if obs else None)
            if since is not None and v > since[1]:
                older = "" if recent else f", longer ago than the alert's {window}"
                c.notes.append(Note(where, f"{v - since[1]:.0f} {what} since the doctor run at "
                                   f"{_when(since[0])}{older} ({alert} counts {count} within "
                                   f"{window})"))
            elif v >= count:
                c.notes.append(Note(where, f"{v:.0f} {what} since boot (or since the counters "
                                   f"were cleared), at times the doctor cannot tell ({alert} "
                                   f"counts {count} within {window})"))


def read_history(path: str) -> tuple[dict[str, Any], str | None]:
    """The state file's counters, and a note when it exists but cannot be used."""
    if not path or not os.path.lexists(path):
        return {}, None
    try:
        data = json.loads(read_regular(path))
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a doctor state file of version 1")
        counters = {kind: {str(k): [[float(t), float(v)] for t, v in obs]
                           for k, obs in data.get(kind, {}).items()}
                    for _, _, kind, *_ in FLAP_COUNTERS}
    except (ConfigError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        return {}, f"history {path} ignored ({str(exc) or type(exc).__name__}): no history"
    return counters, None


def _compact(obs: list[list[float]], horizon: float) -> list[list[float]]:
    """The observations worth keeping: of a run of equal values its first and last (a count
    from any of them is the same), and of those older than ``horizon`` (the alert's window)
    only the newest."""
    out = [o for i, o in enumerate(obs)
           if i in (0, len(obs) - 1) or not obs[i - 1][1] == o[1] == obs[i + 1][1]]
    old = [o for o in out if o[0] < horizon]
    return (old[-1:] + [o for o in out if o[0] >= horizon])[-HISTORY_KEEP:]


def write_history(path: str, history: dict[str, Any], b: Snapshot, t: Thresholds) -> str | None:
    """Add this run's counters to the history and write it atomically (a temporary file in the
    same directory, then rename); a note instead of an error when it cannot."""
    if not path:
        return None
    data: dict[str, Any] = {"version": 1, "time": b.time}
    for metric, _, kind, _, window_key, _ in FLAP_COUNTERS:
        horizon = b.time - seconds(getattr(t.infiniband, window_key))
        mine: dict[str, list[list[float]]] = {}
        for lbl, v in b.all(metric):
            key, _ = _flap_key(kind, lbl)
            kept = _since_reset(history.get(kind, {}).get(key, []), v)
            mine[key] = _compact([*kept, [b.time, v]], horizon)
        # A series not read this time (its collector failed, the netdev is gone for now) keeps
        # its history while that lies within the window.
        for key, obs in history.get(kind, {}).items():
            if key not in mine and obs and obs[-1][0] >= horizon:
                mine[key] = _compact(obs, horizon)
        data[kind] = mine
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        write_json(path, data)
    except OSError as exc:
        return (f"cannot record the counters in {path} ({exc.strerror or exc}): the next run "
                "has no history")
    return None


def check_mtu(c: Check) -> None:
    b, roce = c.b, c.roce_interfaces()
    least = c.t.link.roce_min_mtu_bytes
    for lbl, mtu in b.all("gpunet_link_mtu_bytes"):
        name = lbl["interface"]
        if name in roce and mtu < least:
            c.add("mtu", "GpunetRoceMtuTooSmall", name,
                  f"RoCE interface at MTU {mtu:.0f}, below {least}", f"ip link show {name}")
        # Not elif: both alerts fire in Prometheus for a RoCE netdev below the minimum that is
        # also not at its expected MTU, so the doctor reports both.
        if b.get("gpunet_link_mtu_mismatch", interface=name) == 1:
            want = b.get("gpunet_link_mtu_expected_bytes", interface=name)
            c.add("mtu", "GpunetInterfaceMtuNotExpected", name,
                  f"MTU {mtu:.0f}, expected {want or 0:.0f}", f"ip link show {name}")
    for lbl, v in b.all("gpunet_link_rdma_mtu_mismatch"):
        if v == 1:
            mtu = b.get("gpunet_link_rdma_active_mtu_bytes", **lbl) or 0
            want = b.get("gpunet_link_rdma_mtu_expected_bytes", **lbl) or 0
            c.add("mtu", "GpunetRdmaMtuNotExpected", _port(lbl),
                  f"active RDMA MTU {mtu:.0f}, expected {want:.0f}",
                  f"ibv_devinfo -d {lbl['device']} -i {lbl['port']} | grep active_mtu")


def check_pfc(c: Check) -> None:
    b, t, roce = c.b, c.t.pfc, c.roce_interfaces()
    prio = str(t.roce_priority)
    for lbl, v in b.all("gpunet_pfc_enabled", priority=prio):
        if v == 0 and lbl["interface"] in roce:
            c.add("pfc", "GpunetPfcDisabledOnRocePriority", lbl["interface"],
                  f"PFC off on priority {prio}, the one RoCE uses",
                  f"mlnx_qos -i {lbl['interface']}  # or: dcb pfc show dev {lbl['interface']}")
    for lbl, _ in b.all("gpunet_pfc_config_info"):
        trust = lbl.get("trust", "")
        if trust and trust != t.trust:
            c.add("pfc", "GpunetPfcTrustNotExpected", lbl["interface"],
                  f"trusts {trust}, expected {t.trust}", f"mlnx_qos -i {lbl['interface']}")
    for lbl, r in c.rate("gpunet_pfc_pause_frames_total"):
        on = b.get("gpunet_pfc_enabled", interface=lbl["interface"], priority=lbl["priority"])
        if r > 0 and on == 0:
            c.add("pfc", "GpunetPauseWithoutPfc", lbl["interface"],
                  f"pause frames ({lbl['direction']}) on priority {lbl['priority']}, where PFC "
                  "is off", f"ethtool -S {lbl['interface']} | grep prio{lbl['priority']}_pause")
    for metric in ("pause_storm_error_events", "pause_storm_warning_events"):
        for lbl, r in c.rate(f"gpunet_pfc_{metric}_total"):
            if r > 0:
                c.add("pfc", "GpunetPauseStorm", lbl["interface"], "PFC pause storm detected",
                      f"ethtool -S {lbl['interface']} | grep pause_storm")
    for lbl, r in c.rate("gpunet_pfc_pause_duration_seconds_total"):
        if r > t.pause_ratio:
            c.add("pfc", "GpunetPauseDurationHigh", lbl["interface"],
                  f"paused {r:.0%} of the time ({lbl['direction']}) on priority "
                  f"{lbl['priority']}", f"ethtool -S {lbl['interface']} | grep pause_duration")
    for metric, alert, limit, what in (
            ("np_ecn_marked_roce_packets", "GpunetEcnMarksHigh",
             t.ecn_marked_packets_per_second, "ECN-marked packets received per second"),
            ("rp_cnp_handled", "GpunetCnpsHigh", t.cnp_handled_per_second,
             "CNPs handled per second")):
        for lbl, r in c.rate(f"gpunet_infiniband_port_hw_{metric}_total"):
            if r > limit:
                c.add("pfc", alert, _port(lbl), f"{r:.4g} {what} (limit {limit:g})",
                      f"cat /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/"
                      f"hw_counters/{metric}")
    for lbl, r in c.rate("gpunet_infiniband_port_hw_rp_cnp_ignored_total"):
        if r > 0:
            c.add("pfc", "GpunetCnpsIgnored", _port(lbl),
                  "ignores CNPs: congestion control is off on their priority",
                  f"cat /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/"
                  "hw_counters/rp_cnp_ignored")
    for lbl, v in b.all("gpunet_pfc_config_refresh_success"):
        if v == 0 and lbl["interface"] in roce:
            name = lbl["interface"]
            c.add("pfc", "GpunetPfcConfigUnreadable", name,
                  "its QoS configuration cannot be read: PFC not checked there",
                  f"mlnx_qos -i {name}  # or: dcb pfc show dev {name}")
            c.problems.append(f"PFC on {name}: its QoS configuration cannot be read")


def check_job_rdma_idle(c: Check) -> None:
    """GpunetGpuJobRdmaIdle: GPUs with compute processes starved (the mean of the two readings
    below gpu.busy_utilization_ratio) while the RDMA ports, all together, move less than
    infiniband.rdma_idle_bytes_per_second between the readings."""
    if not c.active_rdma_port():
        return
    rates = [r for name in ("gpunet_infiniband_port_transmitted_bytes_total",
                            "gpunet_infiniband_port_received_bytes_total")
             for _, r in c.rate(name)]
    idle = c.t.infiniband.rdma_idle_bytes_per_second
    if not rates or sum(rates) >= idle:
        return
    lo = c.t.gpu.busy_utilization_ratio
    starved = [gpu for gpu, util in c.working_gpus().items() if util < lo]
    if starved:
        c.add("nccl_tcp", "GpunetGpuJobRdmaIdle", "node",
              f"{len(starved)} GPUs with compute processes (GPU {', '.join(starved)}) are busy "
              f"less than {lo:.0%} while the RDMA ports move {sum(rates):.3g} B/s (idle below "
              f"{idle:.3g}): the job's traffic is not on RDMA, or it does not use the network "
              f"(read over the check's {c.dt:.3g} s; the alert averages 10 minutes)",
              "NCCL_DEBUG=INFO in the job, then: gpunet-probe explain-log <its log>; "
              "tr '\\0' '\\n' < /proc/PID/environ | grep ^NCCL_  # PIDs: nvidia-smi")


def check_transport(c: Check) -> None:
    b = c.b
    for lbl, v in b.all("gpunet_probe_socket_fallback"):
        if v == 1:
            c.add("nccl_tcp", "GpunetNcclSocketFallback", f"{lbl['scope']} probe",
                  "NCCL runs over TCP sockets although RDMA should carry it",
                  "gpunet-probe explain-log <the job's NCCL_DEBUG=INFO log>")
    for lbl, v in b.all("gpunet_topology_nccl_env_findings"):
        if v > 0:
            c.add("nccl_tcp", "GpunetNcclEnvDisablesFastPath", lbl["variable"],
                  f"{v:.0f} GPU processes set {lbl['variable']} ({lbl['issue']})",
                  "tr '\\0' '\\n' < /proc/PID/environ | grep ^NCCL_  # PIDs: nvidia-smi")
    for lbl, v in b.all("gpunet_topology_nccl_env_settings"):
        if v > 0 and (lbl["variable"], lbl["value_class"]) not in NCCL_FAULT_CLASSES:
            note = NCCL_SETTING_NOTES.get((lbl["variable"], lbl["value_class"]))
            c.notes.append(Note(lbl["variable"], f"{v:.0f} GPU processes set it "
                                f"({lbl['value_class']})" + (f": {note}" if note else "")))
    if not c.active_rdma_port():
        return
    if b.get("gpunet_topology_gdr_ready") == 0:
        c.add("gdr_off", "GpunetGdrNotReady", "node",
              "no peer-memory module (nvidia_peermem) loaded and no DMA-BUF",
              "lsmod | grep -E 'nvidia_peermem|nv_peer_mem'; cat /proc/driver/nvidia/version")
    for lbl, v in b.all("gpunet_probe_gdr_active"):
        if v == 0:
            c.add("gdr_off", "GpunetGdrInactive", f"{lbl['scope']} probe",
                  "NCCL's network channels do not use GPUDirect RDMA while RDMA ports are up: "
                  "data is staged through host memory",
                  "NCCL_DEBUG=INFO: look for /GDRDMA on the NET/IB channel lines")


# hw_counters behind GpunetRoceRetransmissions: (metric, file, thresholds key, words).
RETRANSMISSIONS = (
    ("out_of_sequence_packets", "out_of_sequence", "sequence_errors_per_second",
     "out-of-sequence packets"),
    ("packet_sequence_error_naks", "packet_seq_err", "sequence_errors_per_second",
     "sequence-error NAKs"),
    ("implied_nak_sequence_errors", "implied_nak_seq_err", "sequence_errors_per_second",
     "implied NAK sequence errors"),
    ("local_ack_timeouts", "local_ack_timeout_err", "ack_timeouts_per_second", "ACK timeouts"),
)


def check_retransmissions(c: Check) -> None:
    """GpunetRoceRetransmissions: one finding per port whose sequence errors or ACK timeouts
    rise faster than their thresholds (the alert's ``or`` of the four rates)."""
    t = c.t.infiniband
    seen: set[tuple[str, str]] = set()
    for metric, file, key, what in RETRANSMISSIONS:
        for lbl, r in c.rate(f"gpunet_infiniband_port_hw_{metric}_total"):
            port = (lbl.get("device", ""), lbl.get("port", ""))
            if port not in seen and r > getattr(t, key):
                seen.add(port)
                c.add("retransmit", "GpunetRoceRetransmissions", _port(lbl),
                      f"{r:.4g} {what} per second (limit {getattr(t, key):g})",
                      f"cat /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/"
                      f"hw_counters/{file}  # twice; rdma statistic show link "
                      f"{lbl['device']}/{lbl['port']}")


def check_placement(c: Check) -> None:
    for lbl, v in c.b.all("gpunet_topology_gpu_nearest_nic_numa_mismatch"):
        if v == 1:
            rail = next((r["device"] for r, _ in c.b.all(
                "gpunet_topology_gpu_nearest_rail_nic", gpu=lbl["gpu"])), "?")
            c.add("numa", "GpunetGpuNicNumaMismatch", f"GPU {lbl['gpu']}",
                  f"its nearest rail NIC ({rail}) is on another NUMA node",
                  "nvidia-smi topo -m")
    for lbl, v in c.b.all("gpunet_topology_gpu_nic_acs_redirect_bridges"):
        if v > 0:
            c.add("numa", "GpunetGpuNicAcsRedirect", f"GPU {lbl['gpu']} - {lbl['device']}",
                  f"{v:.0f} PCIe bridges redirect peer-to-peer traffic (ACS)",
                  "lspci -vvv | grep -i 'ACSCtl'")


def check_gpus(c: Check) -> None:
    b, t = c.b, c.t.gpu
    for lbl, v in b.all("gpunet_gpu_pcie_link_degraded"):
        if v == 1:
            gen = b.get("gpunet_gpu_pcie_link_generation", **lbl)
            width = b.get("gpunet_gpu_pcie_link_width", **lbl)
            gmax = b.get("gpunet_gpu_pcie_link_max_generation", **lbl)
            wmax = b.get("gpunet_gpu_pcie_link_max_width", **lbl)
            c.add("gpu_pcie", "GpunetGpuPcieLinkDegraded", f"GPU {lbl['gpu']}",
                  f"PCIe Gen{gen or 0:.0f} x{width or 0:.0f}, capable of Gen{gmax or 0:.0f} "
                  f"x{wmax or 0:.0f}", f"nvidia-smi -q -d PCIE -i {lbl['gpu']}")
    for lbl, r in c.rate("gpunet_gpu_pcie_replays_total"):
        if r * 60 > t.pcie_replays_per_minute:
            c.add("gpu_pcie", "GpunetGpuPcieReplays", f"GPU {lbl['gpu']}",
                  f"{r * 60:.3g} PCIe replays per minute", f"nvidia-smi -q -d PCIE -i {lbl['gpu']}")
    for lbl, v in b.all("gpunet_gpu_lost"):
        if v == 1:
            c.add("gpu", "GpunetGpuLost", f"GPU {lbl['gpu']}", "fallen off the bus (GPU is lost)",
                  "nvidia-smi; dmesg | grep -i -E 'xid|fallen off'")
    missing = b.get("gpunet_gpu_missing")
    if missing:
        c.add("gpu", "GpunetGpuMissing", "node", f"{missing:.0f} GPUs no longer enumerated",
              "nvidia-smi -L; lspci -d 10de:")
    if b.get("gpunet_gpu_nvml_up") == 0:
        c.add("gpu", "GpunetNvmlDown", "node", "NVML fails", "nvidia-smi")
    critical = set(t.critical_xids)
    for lbl, when in b.all("gpunet_gpu_xid_last_timestamp_seconds"):
        if b.time - when < 600:
            code = b.get("gpunet_gpu_xid_last_code", gpu=lbl["gpu"]) or 0
            alert = "GpunetGpuXidCritical" if int(code) in critical else "GpunetGpuXidErrors"
            c.add("gpu", alert, f"GPU {lbl['gpu']}",
                  f"XID {code:.0f} {b.time - when:.0f} s ago", "dmesg | grep -i xid")


def check_gpu_utilization(c: Check) -> None:
    """GpunetGpuStarved and GpunetGpusNetworkBoundBand on the check's own readings: the mean of
    the two snapshots' utilization, where the alerts average 10 or 30 minutes."""
    t = c.t.gpu
    lo, hi = t.busy_utilization_ratio, t.network_bound_utilization_ratio
    working = c.working_gpus()
    busy, in_band = len(working), 0
    for gpu, util in working.items():
        if util < lo:
            c.add("gpu_wait", "GpunetGpuStarved", f"GPU {gpu}",
                  f"busy only {util:.0%} of the time while compute processes run on it "
                  f"(limit {lo:.0%}; read over the check's {c.dt:.3g} s, the alert averages "
                  "10 minutes)", f"nvidia-smi dmon -s u -c 10 -i {gpu}")
        elif util < hi:
            in_band += 1
    if busy and in_band / busy >= t.network_bound_gpu_share:
        c.add("gpu_wait", "GpunetGpusNetworkBoundBand", "node",
              f"{in_band} of {busy} GPUs running compute processes are {lo:.0%} to {hi:.0%} "
              "busy, the band of training that waits on its collectives (read over the "
              f"check's {c.dt:.3g} s; the alert averages {t.network_bound_window})",
              "nvidia-smi dmon -s u -c 30  # and the job's other nodes")


def check_collectives(c: Check) -> None:
    b, p = c.b, c.t.probe
    for lbl, v in b.all("gpunet_probe_allreduce_seconds", size=str(p.latency_size_bytes),
                        stat="median"):
        if v > p.latency_seconds:
            c.add("collective", "GpunetAllreduceLatencyHigh", f"{lbl['scope']} probe",
                  f"{lbl['size']}-byte all-reduce takes {v * 1e3:.3g} ms "
                  f"(limit {p.latency_seconds * 1e3:g} ms)",
                  "cat /var/lib/gpunet-exporter/probe/*.json")
    expected = p.expected_bus_bandwidth_bytes_per_second
    for lbl, v in b.all("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second",
                        size=str(p.bandwidth_size_bytes)):
        want = (getattr(expected, lbl["scope"])
                if lbl["scope"] in ("intra", "net", "inter") else 0)
        if want > 0 and v < p.bus_bandwidth_ratio * want:
            c.add("collective", "GpunetBusBandwidthLow", f"{lbl['scope']} probe",
                  f"bus bandwidth {v / 1e9:.3g} GB/s, expected {want / 1e9:.3g} GB/s",
                  "cat /var/lib/gpunet-exporter/probe/*.json")
    # As the alert: the node's own scopes fail only while the GPUs are idle (state failing);
    # a cluster-mode scope on its last result.
    failing = b.get("gpunet_probe_state", state=idle.FAILING) == 1
    for lbl, v in b.all("gpunet_probe_success"):
        if v == 0 and (failing or lbl["scope"] not in results.NODE_SCOPES):
            c.add("collective", "GpunetProbeFailing", f"{lbl['scope']} probe",
                  "the last probe round failed",
                  "tail /var/lib/gpunet-exporter/probe/runner.log")
    if b.get("gpunet_probe_state", state=idle.UNKNOWN) == 1:
        c.problems.append("probe: the GPUs' processes cannot be read (NVML), so no probe round "
                          "runs (GpunetProbeIdleUnknown)")
    if b.get("gpunet_probe_state", state=idle.YIELDED) == 1:
        c.notes.append(Note("probe", "not run: a job's processes are on the GPUs (the probe "
                            "runs only on idle GPUs)"))
    for lbl, v in b.all("gpunet_probe_bus_bandwidth_link_ratio"):
        if v < p.link_ratio:
            c.add("collective", "GpunetBusBandwidthBelowLinkRate", f"{lbl['scope']} probe",
                  f"the all-reduce reaches {v:.0%} of what its RDMA links allow "
                  f"(limit {p.link_ratio:.0%})",
                  "cat /var/lib/gpunet-exporter/probe/net.json  # hcas, link_bytes_per_second")
    for lbl, _ in b.all("gpunet_probe_straggler_info"):
        v = b.get("gpunet_probe_straggler_wait_ratio", scope=lbl["scope"]) or 0.0
        if v > p.straggler_wait_ratio:
            c.add("collective", "GpunetStragglerRank", f"{lbl['scope']} probe",
                  f"rank {lbl['rank']} (GPU {lbl['gpu']}) arrives late: the other ranks spend "
                  f"{v:.0%} of their all-reduce time waiting for it",
                  "cat /var/lib/gpunet-exporter/probe/*.json  # straggler")


def check_inventory(c: Check) -> None:
    """Devices, ports and netdevs expected (configured or learned by the exporter, whose state
    file the doctor reads and never writes) and gone."""
    b = c.b
    for lbl, v in b.all("gpunet_inventory_missing"):
        if v > 0:
            kind = lbl["kind"]
            names = sorted(m["name"] for m, _ in b.all("gpunet_inventory_missing_info",
                                                        kind=kind))
            c.add("inventory", "GpunetRdmaDeviceMissing", kind,
                  f"{v:.0f} expected {kind} gone" + (f": {', '.join(names)}" if names else ""),
                  "ls /sys/class/infiniband; ibv_devices; lspci -d 15b3:")


def _plural(n: float, one: str, many: str = "") -> str:
    return f"{n:.0f} {one if n == 1 else (many or one + 's')}"


def _verb(n: float, one: str, many: str) -> str:
    return one if n == 1 else many


def check_nccl_jobs(c: Check) -> None:
    """The NCCL jobs on this node, as NCCL's RAS service reports them (the nccl collector; the
    doctor asks for a second report just before its second reading, so that the collective
    counts are compared): the four GpunetNccl* alerts as findings, and each job that answered
    described in a note."""
    b = c.b
    for lbl, listening in b.all("gpunet_nccl_ras_listeners"):
        port = lbl["port"]
        where = f"NCCL job on RAS port {port}"
        confirm = f"ncclras -p {port}  # NCCL's RAS client (-v: per rank, -f json)"
        ok = b.get("gpunet_nccl_ras_query_success", port=port)
        if listening > 0 and ok == 0:
            silent = b.get("gpunet_nccl_ras_unanswered_connections_total", port=port) or 0
            why = (f" ({_plural(silent, 'connection')} accepted and never answered: a stopped "
                   "or hung process)") if silent else ""
            c.add("nccl_job", "GpunetNcclRasUnreachable", where,
                  f"{_plural(listening, 'NCCL process', 'NCCL processes')} "
                  f"{_verb(listening, 'listens', 'listen')} on the port but none gave a "
                  f"report{why}; the job's health is unknown",
                  f"ss -ltnp 'sport = :{port}'  # who listens; then ps -o pid,stat,cmd -p PID "
                  f"(stat T: stopped); {confirm}")
        if ok != 1:
            continue
        get = _reader(b, port)
        dead = get("gpunet_nccl_job_processes", state="dead")
        errored = get("gpunet_nccl_ranks_errored")
        if dead > 0:
            c.add("nccl_job", "GpunetNcclRankDead", where,
                  f"{_plural(dead, 'process', 'processes')} of the job "
                  f"{_verb(dead, 'is', 'are')} considered dead by RAS"
                  + (f"; {_plural(errored, 'other rank')} {_verb(errored, 'holds', 'hold')}"
                     " an error" if errored else "")
                  + f": the job waits for {_verb(dead, 'it', 'them')} or is about to fail",
                  confirm)
        unreachable = get("gpunet_nccl_missing_ranks", reason="unreachable")
        if unreachable > 0:
            c.add("nccl_job", "GpunetNcclRankUnreachable", where,
                  f"{_plural(unreachable, 'rank')} {_verb(unreachable, 'does', 'do')} not answer "
                  "RAS: their process is stopped, hung or cut off", confirm)
        stalled = get("gpunet_nccl_stalled_ranks")
        if stalled > 0:
            skew = max((v for _, v in b.all("gpunet_nccl_collective_skew_operations",
                                            port=port)), default=0.0)
            c.add("nccl_job", "GpunetNcclRankStalled", where,
                  f"{_plural(stalled, 'rank')} {_verb(stalled, 'launches', 'launch')} no more "
                  f"collectives, up to {_plural(skew, 'operation')} behind the other ranks of "
                  "the communicator, which wait for them", confirm)
        c.notes.append(Note(where, _job_summary(b, port)))


def _reader(b: Snapshot, port: str) -> Callable[..., float]:
    """The value of one of the port's series (0 when absent)."""
    def get(name: str, **match: str) -> float:
        return b.get(name, port=port, **match) or 0.0
    return get


def _job_summary(b: Snapshot, port: str) -> str:
    """One job in operators' words: who runs it, how its communicators stand, what is wrong."""
    get = _reader(b, port)

    version = next((lbl.get("version", "") for lbl, _ in b.all("gpunet_nccl_ras_info",
                                                               port=port)), "")
    procs = {state: get("gpunet_nccl_job_processes", state=state)
             for state in ("answering", "unresponsive", "dead")}
    comms = {lbl["status"]: v for lbl, v in b.all("gpunet_nccl_communicators", port=port) if v}
    expected = get("gpunet_nccl_communicator_ranks", state="expected")
    seen = get("gpunet_nccl_communicator_ranks", state="seen")
    parts = [f"NCCL {version}: " if version else "",
             _plural(sum(procs.values()), "process", "processes"),
             f" on {_plural(get('gpunet_nccl_job_nodes'), 'node')}"
             f" with {_plural(get('gpunet_nccl_job_gpus'), 'GPU')}; "]
    parts.append(", ".join(f"{_plural(n, 'communicator')} {status}"
                           for status, n in sorted(comms.items())) or "no communicator")
    parts.append(f"; {seen:.0f} of {expected:.0f} ranks answered")
    trouble = [_plural(n, f"process {state}", f"processes {state}")
               for state, n in procs.items() if state != "answering" and n]
    if errored := get("gpunet_nccl_ranks_errored"):
        trouble.append(_plural(errored, "rank with an error", "ranks with an error"))
    if stalled := get("gpunet_nccl_stalled_ranks"):
        trouble.append(_plural(stalled, "rank stuck", "ranks stuck"))
    if idle := get("gpunet_nccl_communicators_without_progress"):
        trouble.append(_plural(idle, "communicator") + " without progress since the "
                       "previous report (idle, or hung as a whole)")
    if trouble:
        parts.append("; " + ", ".join(trouble))
    return "".join(parts)


CHECKS: tuple[Callable[[Check], None], ...] = (
    check_transport, check_job_rdma_idle, check_links, check_pfc, check_mtu, check_placement,
    check_gpus, check_collectives, check_phy, check_retransmissions, check_gpu_utilization,
    check_flap_history, check_inventory, check_nccl_jobs)


def _progress(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"doctor: {message}", file=sys.stderr, flush=True)


def _wait_for_probe(probe: Collector, timeout: float, quiet: bool) -> None:
    """Until the probe collector has a result of the scope a round ends with (net, the NICs;
    intra when net is not configured). It only reads its cache, so asking it alone is cheap;
    the other collectors are not run meanwhile."""
    scopes = probe.settings.scopes if isinstance(probe.settings, ProbeSettings) else ()
    last = "net" if "net" in scopes else (scopes[-1] if scopes else "intra")
    _progress(quiet, f"waiting for the probe's round (up to {timeout:g} s)")
    if isinstance(probe, ProbeCollector):
        # The doctor asks for a round now: no hold-off, but never beside a job.
        probe.supervisor.gate.holdoff = 0.0
    deadline = time.monotonic() + timeout
    asked = time.time()
    while time.monotonic() < deadline:
        s = Snapshot(probe.collect(Scrape()))
        # A round of this check, not an earlier one's file left in the state directory.
        if (s.get("gpunet_probe_last_round_timestamp_seconds", scope=last) or 0) >= asked:
            return
        for state in (idle.YIELDED, idle.UNKNOWN):
            if s.get("gpunet_probe_state", state=state) == 1:
                _progress(quiet, f"the probe is {state}: no round")
                return
        time.sleep(0.5)
    _progress(quiet, "no probe result in time; the probe is not checked")


def report(findings: list[Finding], checked: dict[str, bool], problems: list[str],
           runbook_url: str, notes: Sequence[Note] = ()) -> str:
    lines = []
    if findings:
        lines.append(f"{len(findings)} finding{'s' * (len(findings) != 1)} on this node:")
        for cause, title in CAUSES.items():
            mine = [f for f in findings if f.cause == cause]
            if not mine:
                continue
            lines += ["", title]
            for f in mine:
                lines.append(f"  [{f.severity}] {f.where}: {f.message}")
                lines.append(f"      confirm: {f.confirm}")
                lines.append(f"      runbook: {runbook_url}#{f.alert.lower()} (alert {f.alert})")
    else:
        lines.append("No findings on this node.")
    if notes:
        lines += ["", "Notes (no finding, no effect on the exit code):"]
        lines += [f"  {n.where}: {n.message}" for n in notes]
    lines.append("")
    lines.append("Checked: " + ", ".join(
        f"{name} ({'ok' if ok else 'FAILED'})" for name, ok in checked.items()))
    lines += [f"Could not check: {p}" for p in problems]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    classes = discover()
    parser = build_parser(classes, server=False)
    parser.prog = PROG
    parser.usage = None
    parser.description = ("Check this node once and report what would alert, grouped by root "
                          "cause. Exit 0 healthy, 1 findings, 2 could not check.")
    d = parser.add_argument_group("doctor")
    d.add_argument("--thresholds", metavar="FILE",
                   help="YAML file overriding alert thresholds, as for gpunet-rules (default: the "
                        "built-in thresholds)")
    d.add_argument("--json", action="store_true",
                   help="print the findings as JSON (default: a report for a person)")
    d.add_argument("--interval", type=float, default=5.0, metavar="SECONDS",
                   help="time between the two readings that give counter rates (default 5)")
    d.add_argument("--probe", action="store_true",
                   help="run one probe round through this node's NICs (the probe collector's "
                        "net scope; intra too with two GPUs or more) and check it; needs torch "
                        "(pip install 'gpunet-exporter[probe]') (default: only when the probe "
                        "collector is on)")
    d.add_argument("--state-file", default=DEFAULT_STATE, metavar="FILE",
                   help="where the doctor records the link-downed and carrier-change counters "
                        "it read, so the next run counts the flaps since this one; empty: "
                        f"no history (default {DEFAULT_STATE})")
    d.add_argument("--probe-wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long to wait for the probe's round when the probe is on "
                        "(default 120)")
    server = server_only_flags(classes)
    for arg in argv:
        if arg == "--":
            break
        if arg.partition("=")[0] in server:
            parser.error(f"{arg.partition('=')[0]} is a flag of the exporter service; the doctor "
                         "serves nothing and takes only the flags that say what to read")
    args = parser.parse_args(argv)
    setup("error" if args.log_level == "info" else args.log_level, args.log_format)
    if args.interval <= 0 or args.probe_wait < 0:
        parser.error("--interval must be positive and --probe-wait not negative")
    try:
        t = load(args.thresholds, ALERT_NAMES)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    early: list[str] = []
    if args.probe:
        if importlib.util.find_spec("torch") is None:
            early.append("the probe needs torch: pip install 'gpunet-exporter[probe]'")
        else:
            args.enable__probe = True
    collectors, _, enabled = start_collectors(args, classes, parser, learn=False)
    scraper = Scraper(collectors, args.scrape_timeout)
    quiet = args.json
    try:
        _progress(quiet, f"reading {', '.join(collectors) or 'no collectors'}")
        a = Snapshot(scraper.collect())
        if "probe" in collectors:
            _wait_for_probe(collectors["probe"], args.probe_wait, quiet)
        _progress(quiet, f"reading counters again in {args.interval:g} s for their rates")
        time.sleep(args.interval)
        nccl = collectors.get("nccl")
        if isinstance(nccl, NcclCollector):
            # A second RAS report now: what shows a stuck rank is counts compared across two.
            _progress(quiet, "asking NCCL's RAS service for a second report")
            nccl.refresh()
        b = Snapshot(scraper.collect())
    finally:
        scraper.close()
        kill_running()
    check = Check(a, b, t)
    check.history, unreadable = read_history(args.state_file)
    for fn in CHECKS:
        fn(check)
    unwritable = write_history(args.state_file, check.history, b, t)
    notes = check.notes + [Note("state file", n) for n in (unreadable, unwritable) if n]
    checked = {lbl["collector"]: v == 1 for lbl, v in b.all("gpunet_scrape_collector_success")}
    problems = early + [f"collector {n} failed" for n, ok in checked.items() if not ok]
    problems += check.problems
    if args.probe and b.get("gpunet_probe_state", state=idle.YIELDED) == 1:
        problems.append("probe: --probe asked for a round, but a job's processes are on the GPUs")
    problems += [f"collector {n} did not start" for n in enabled if n not in collectors]
    hardware = any(b.all("gpunet_infiniband_port_state_id")) or any(b.all("gpunet_gpu_info"))
    if not hardware:
        problems.append("no RDMA port and no NVIDIA GPU found")
    findings = check.findings
    # Info findings (a hint such as the network-bound band, routed to no receiver by the
    # example Alertmanager configuration) are listed but do not fail a health check; nor do
    # findings that say something could not be checked (they are problems: exit 2), nor those
    # of a job (JOB_CAUSES).
    faults = [f for f in findings if f.severity != "info" and f.alert not in COULD_NOT_CHECK
              and f.cause not in JOB_CAUSES]
    code = 1 if faults else (2 if problems else 0)
    if args.json:
        print(json.dumps({"status": ("findings", "healthy", "could_not_check")[
            (code == 0) + 2 * (code == 2)], "exit_code": code,
            # fault: whether the finding counts towards exit code 1 (what a Slurm gate
            # drains for: slurm/gpunet-healthcheck names the first one in the reason).
            "findings": [{**asdict(f), "severity": f.severity, "fault": f in faults}
                         for f in findings],
            "checked": checked, "problems": problems, "notes": [asdict(n) for n in notes]},
            indent=1))
    else:
        sys.stdout.write(report(findings, checked, problems, t.runbook_url, notes))
    return code

