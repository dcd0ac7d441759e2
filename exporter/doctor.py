"""``gpunet-exporter doctor``: a one-off health check of this node, for a person at a terminal, a
Slurm prolog or a node health check.

It runs the collectors the exporter would run (same flags, same config file), reads them twice
``--interval`` seconds apart so counters give rates, waits for the probe's first round when the
probe collector is on, and applies the alert thresholds of exporter.thresholds (the same values
the generated Prometheus rules use; ``--thresholds FILE`` overrides them the same way). Findings
are grouped by root cause, each naming the device and a command that confirms it.

Exit codes: 0 healthy, 1 findings, 2 could not check (a collector failed, nothing to check, or
bad input). Notes (settings worth knowing, such as NCCL variables a job sets on purpose) are
printed in their own section (``notes`` in JSON) and never change the exit code. ``--json``
prints one JSON document instead of the report.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client.core import Metric

from collectors.topology import NCCL_FAULT_CLASSES, NCCL_SETTING_NOTES
from exporter import rules
from exporter.background import kill_running
from exporter.cli import build_parser, server_only_flags, start_collectors
from exporter.collector import Collector
from exporter.config import ConfigError
from exporter.logs import setup
from exporter.registry import Scraper, discover
from exporter.thresholds import load

PROG = "gpunet-exporter doctor"
T = dict[str, Any]
Labels = dict[str, str]

# Root causes, in the order the report lists them, in the operator's words.
CAUSES = {
    "nccl_tcp": "NCCL on TCP sockets",
    "gdr_off": "GPUDirect RDMA off",
    "link": "Degraded or flapping link",
    "pfc": "PFC or ECN misconfigured, or congestion",
    "mtu": "MTU",
    "numa": "GPU and NIC placement (NUMA, ACS)",
    "gpu_pcie": "Degraded GPU PCIe link",
    "gpu": "GPU faults",
    "collective": "Slow collectives or a straggler",
}
SEVERITY = {a.name: a.severity for a in rules.ALERTS}


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
    """A setting the doctor reports without judging it a fault: no alert fires on it and it
    never changes the exit code (e.g. NCCL_SOCKET_IFNAME pointing at the management network)."""
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

    def __init__(self, a: Snapshot, b: Snapshot, t: T) -> None:
        self.a, self.b, self.t = a, b, t
        self.dt = max(b.time - a.time, 1e-3)
        self.findings: list[Finding] = []
        self.notes: list[Note] = []  # settings worth knowing: no alert, no effect on the exit code

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

    def roce_interfaces(self) -> set[str]:
        return {lbl["interface"] for lbl, _ in self.b.all("gpunet_link_info")
                if lbl.get("link_layer") == "Ethernet"}


def _port(lbl: Labels) -> str:
    return f"{lbl.get('device')} port {lbl.get('port')}"


def check_links(c: Check) -> None:
    b, t = c.b, c.t["infiniband"]
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
            ("symbol_errors", "GpunetPortSymbolErrors", t["symbol_errors_per_hour"], 3600,
             "symbol errors per hour"),
            ("link_error_recoveries", "GpunetPortLinkErrorRecoveries",
             t["link_error_recoveries_per_minute"], 60, "link retrains per minute"),
            ("receive_errors", "GpunetPortReceiveErrors", t["receive_errors_per_second"], 1,
             "receive errors per second"),
            ("transmit_discards", "GpunetPortTransmitDiscards",
             t["transmit_discards_per_second"], 1, "transmit discards per second")):
        for lbl, r in c.rate(f"gpunet_infiniband_port_{metric}_total"):
            if r * per > limit:
                c.add("link", alert, _port(lbl), f"{r * per:.4g} {what} (limit {limit:g})",
                      f"perfquery -x  # {lbl['device']} port {lbl['port']}, twice")
    for lbl, v in b.all("gpunet_infiniband_port_pma_saturated"):
        if v == 1:
            c.add("link", "GpunetPortCounterSaturated", _port(lbl),
                  f"counter {lbl['counter']} stuck at its maximum; its errors are invisible",
                  "perfquery -R  # clears the port's counters")


def check_mtu(c: Check) -> None:
    b, roce = c.b, c.roce_interfaces()
    least = c.t["link"]["roce_min_mtu_bytes"]
    for lbl, mtu in b.all("gpunet_link_mtu_bytes"):
        name = lbl["interface"]
        if name in roce and mtu < least:
            c.add("mtu", "GpunetRoceMtuTooSmall", name,
                  f"RoCE interface at MTU {mtu:.0f}, below {least}", f"ip link show {name}")
        elif b.get("gpunet_link_mtu_mismatch", interface=name) == 1:
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
    b, t, roce = c.b, c.t["pfc"], c.roce_interfaces()
    prio = str(t["roce_priority"])
    for lbl, v in b.all("gpunet_pfc_enabled", priority=prio):
        if v == 0 and lbl["interface"] in roce:
            c.add("pfc", "GpunetPfcDisabledOnRocePriority", lbl["interface"],
                  f"PFC off on priority {prio}, the one RoCE uses",
                  f"mlnx_qos -i {lbl['interface']}  # or: dcb pfc show dev {lbl['interface']}")
    for lbl, _ in b.all("gpunet_pfc_config_info"):
        trust = lbl.get("trust", "")
        if trust and trust != t["trust"]:
            c.add("pfc", "GpunetPfcTrustNotExpected", lbl["interface"],
                  f"trusts {trust}, expected {t['trust']}", f"mlnx_qos -i {lbl['interface']}")
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
        if r > t["pause_ratio"]:
            c.add("pfc", "GpunetPauseDurationHigh", lbl["interface"],
                  f"paused {r:.0%} of the time ({lbl['direction']}) on priority "
                  f"{lbl['priority']}", f"ethtool -S {lbl['interface']} | grep pause_duration")
    for metric, alert, limit, what in (
            ("np_ecn_marked_roce_packets", "GpunetEcnMarksHigh",
             t["ecn_marked_packets_per_second"], "ECN-marked packets received per second"),
            ("rp_cnp_handled", "GpunetCnpsHigh", t["cnp_handled_per_second"],
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


def check_placement(c: Check) -> None:
    for lbl, v in c.b.all("gpunet_topology_gpu_nearest_nic_numa_mismatch"):
        if v == 1:
            c.add("numa", "GpunetGpuNicNumaMismatch", f"GPU {lbl['gpu']}",
                  "no RDMA NIC on the GPU's NUMA node", "nvidia-smi topo -m")
    for lbl, v in c.b.all("gpunet_topology_gpu_nic_acs_redirect_bridges"):
        if v > 0:
            c.add("numa", "GpunetGpuNicAcsRedirect", f"GPU {lbl['gpu']} - {lbl['device']}",
                  f"{v:.0f} PCIe bridges redirect peer-to-peer traffic (ACS)",
                  "lspci -vvv | grep -i 'ACSCtl'")


def check_gpus(c: Check) -> None:
    b, t = c.b, c.t["gpu"]
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
        if r * 60 > t["pcie_replays_per_minute"]:
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
    critical = set(t["critical_xids"])
    for lbl, when in b.all("gpunet_gpu_xid_last_timestamp_seconds"):
        if b.time - when < 600:
            code = b.get("gpunet_gpu_xid_last_code", gpu=lbl["gpu"]) or 0
            alert = "GpunetGpuXidCritical" if int(code) in critical else "GpunetGpuXidErrors"
            c.add("gpu", alert, f"GPU {lbl['gpu']}",
                  f"XID {code:.0f} {b.time - when:.0f} s ago", "dmesg | grep -i xid")


def check_collectives(c: Check) -> None:
    b, p = c.b, c.t["probe"]
    for lbl, v in b.all("gpunet_probe_allreduce_seconds", size=str(p["latency_size_bytes"]),
                        stat="median"):
        if v > p["latency_seconds"]:
            c.add("collective", "GpunetAllreduceLatencyHigh", f"{lbl['scope']} probe",
                  f"{lbl['size']}-byte all-reduce takes {v * 1e3:.3g} ms "
                  f"(limit {p['latency_seconds'] * 1e3:g} ms)",
                  "cat /var/lib/gpunet-exporter/probe/*.json")
    expected = p["expected_bus_bandwidth_bytes_per_second"]
    for lbl, v in b.all("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second",
                        size=str(p["bandwidth_size_bytes"])):
        want = expected.get(lbl["scope"], 0)
        if want > 0 and v < p["bus_bandwidth_ratio"] * want:
            c.add("collective", "GpunetBusBandwidthLow", f"{lbl['scope']} probe",
                  f"bus bandwidth {v / 1e9:.3g} GB/s, expected {want / 1e9:.3g} GB/s",
                  "cat /var/lib/gpunet-exporter/probe/*.json")
    for lbl, v in b.all("gpunet_probe_success"):
        if v == 0:
            c.add("collective", "GpunetProbeFailing", f"{lbl['scope']} probe",
                  "the last probe round failed",
                  "tail /var/lib/gpunet-exporter/probe/runner.log")
    for lbl, v in b.all("gpunet_probe_bus_bandwidth_link_ratio"):
        if v < p["link_ratio"]:
            c.add("collective", "GpunetBusBandwidthBelowLinkRate", f"{lbl['scope']} probe",
                  f"the all-reduce reaches {v:.0%} of what its RDMA links allow "
                  f"(limit {p['link_ratio']:.0%})",
                  "cat /var/lib/gpunet-exporter/probe/net.json  # hcas, link_bytes_per_second")
    for lbl, _ in b.all("gpunet_probe_straggler_info"):
        v = b.get("gpunet_probe_straggler_wait_ratio", scope=lbl["scope"]) or 0.0
        if v > p["straggler_wait_ratio"]:
            c.add("collective", "GpunetStragglerRank", f"{lbl['scope']} probe",
                  f"rank {lbl['rank']} (GPU {lbl['gpu']}) arrives late: the other ranks spend "
                  f"{v:.0%} of their all-reduce time waiting for it",
                  "cat /var/lib/gpunet-exporter/probe/*.json  # straggler")


CHECKS: tuple[Callable[[Check], None], ...] = (
    check_transport, check_links, check_pfc, check_mtu, check_placement, check_gpus,
    check_collectives)


def _progress(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"doctor: {message}", file=sys.stderr, flush=True)


def _wait_for_probe(probe: Collector, timeout: float, quiet: bool) -> None:
    """Until the probe collector has a result of the scope a round ends with (net, the NICs;
    intra when net is not configured). It only reads its cache, so asking it alone is cheap;
    the other collectors are not run meanwhile."""
    scopes = probe.ctx.config.get("scopes") or ["intra"]
    last = "net" if "net" in scopes else str(scopes[-1])
    _progress(quiet, f"waiting for the probe's round (up to {timeout:g} s)")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = Snapshot(probe.collect())
        if s.get("gpunet_probe_success", scope=last) is not None:
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
        lines += ["", "Settings (notes, not findings):"]
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
        t = load(args.thresholds, rules.ALERT_NAMES)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    early: list[str] = []
    if args.probe:
        if importlib.util.find_spec("torch") is None:
            early.append("the probe needs torch: pip install 'gpunet-exporter[probe]'")
        else:
            args.enable__probe = True
    collectors, _, enabled = start_collectors(args, classes, parser)
    scraper = Scraper(collectors, args.scrape_timeout)
    quiet = args.json
    try:
        _progress(quiet, f"reading {', '.join(collectors) or 'no collectors'}")
        a = Snapshot(scraper.collect())
        if "probe" in collectors:
            _wait_for_probe(collectors["probe"], args.probe_wait, quiet)
        _progress(quiet, f"reading counters again in {args.interval:g} s for their rates")
        time.sleep(args.interval)
        b = Snapshot(scraper.collect())
    finally:
        scraper.close()
        kill_running()
    check = Check(a, b, t)
    for fn in CHECKS:
        fn(check)
    checked = {lbl["collector"]: v == 1 for lbl, v in b.all("gpunet_scrape_collector_success")}
    problems = early + [f"collector {n} failed" for n, ok in checked.items() if not ok]
    problems += [f"collector {n} did not start" for n in enabled if n not in collectors]
    hardware = any(b.all("gpunet_infiniband_port_state_id")) or any(b.all("gpunet_gpu_info"))
    if not hardware:
        problems.append("no RDMA port and no NVIDIA GPU found")
    findings = check.findings
    code = 1 if findings else (2 if problems else 0)
    if args.json:
        print(json.dumps({"status": ("findings", "healthy", "could_not_check")[
            (code == 0) + 2 * (code == 2)], "exit_code": code,
            "findings": [{**asdict(f), "severity": f.severity} for f in findings],
            "notes": [asdict(n) for n in check.notes],
            "checked": checked, "problems": problems}, indent=1))
    else:
        sys.stdout.write(report(findings, checked, problems, t["runbook_url"], check.notes))
    return code

