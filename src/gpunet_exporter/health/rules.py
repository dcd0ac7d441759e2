"""Prometheus alerting and recording rules, generated from the thresholds (health/thresholds.py).

``gpunet-rules`` (or ``python -m gpunet_exporter.health.rules``) prints the rule file;
``--thresholds FILE`` applies an operator's overrides, ``--check FILE`` exits 1 when FILE differs
from what would be generated. alerts/gpunet.rules.yml is this output for the defaults
(tests/test_alerts.py fails when it is stale). Each alert carries ``severity`` (critical pages,
warning tickets, info) and ``class`` (the problem class of the fleet dashboard's health matrix), a
static summary, a templated description that names the node, the device and the value, and a runbook
link.

Exit codes: 0 written (or up to date), 1 stale (--check), 2 bad input.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from gpunet_exporter.config import ConfigError, read_regular
from gpunet_exporter.flags import Parser
from gpunet_exporter.health.thresholds import load

T = dict[str, Any]
CLASSES = ("link", "congestion", "transport", "topology", "gpu", "collective", "fabric",
           "exporter")
SEVERITIES = ("critical", "warning", "info")

# Label sets used to join series of one node, port or interface.
_ACTIVE_RDMA_PORT = "count by (instance) (gpunet_infiniband_port_state_id == 4) > 0"
_ROCE_INTERFACE = 'gpunet_link_info{link_layer="Ethernet"}'
FLEET_MEDIAN_BUSBW = "scope_size:gpunet_probe_allreduce_bus_bandwidth_bytes_per_second:median"
ALERTS_FIRING = "instance_class:gpunet_alerts_firing:count"

# The pair plan (issue 18): every node exports its own view of the last round's pairs, labelled
# by the peer's node name. Nothing joins `peer` to `instance` (a scrape address): a node is judged
# from its own pairs, and a peer from the pairs that name it, on the other nodes' series.
_PAIR_BW = "gpunet_fleet_pair_bus_bandwidth_bytes_per_second"
_PAIR_OK = "gpunet_fleet_pair_success"
NODE_MEDIAN_BW = f"instance:{_PAIR_BW}:median"
FLEET_MEDIAN_BW = f"job:{_PAIR_BW}:median"
FLEET_MAD_BW = f"job:{_PAIR_BW}:mad"
FLEET_NODES = "job:gpunet_fleet_nodes_reporting:count"
PAIR_RATIO = f"instance_peer:{_PAIR_BW}:ratio_to_fleet_median"
PAIR_HEALTHY = "instance_peer:gpunet_fleet_pair_healthy:bool"
NODE_PAIRS = "instance:gpunet_fleet_pairs:count"
NODE_PAIRS_HEALTHY = "instance:gpunet_fleet_pairs_healthy:count"
PEER_PAIRS = "peer:gpunet_fleet_pairs:count"
PEER_PAIRS_HEALTHY = "peer:gpunet_fleet_pairs_healthy:count"
# Per pair: this node's leaf, the peer's leaf and whether they differ (cross_leaf "true"/"false";
# absent when either leaf is unknown), so GpunetFleetLinkSlow can carry them for Alertmanager.
PAIR_LEAVES = "instance_peer:gpunet_fleet_pair_info:leaves"
LEAF_INTRA_BW = f"leaf:{_PAIR_BW}:median_intra_leaf"
LEAF_CROSS_BW = f"leaf:{_PAIR_BW}:median_cross_leaf"
LEAF_CROSS_RATIO = f"leaf:{_PAIR_BW}:cross_to_intra_leaf_ratio"


@dataclass(frozen=True)
class Alert:
    name: str
    cls: str
    severity: str
    for_: str
    expr: Callable[[T], str]
    summary: str
    description: str

    def __post_init__(self) -> None:
        assert self.cls in CLASSES and self.severity in SEVERITIES, self.name


def _g(v: float) -> str:
    """A number as PromQL and humans read it (no exponent for ordinary sizes)."""
    return f"{v:.15g}" if abs(v) < 1e15 else repr(float(v))


def _port_with_interface(expr: str) -> str:
    """``expr`` (labels instance, device, port) with the port's netdev as ``interface``, so
    Alertmanager can inhibit the interface's alerts too; unchanged where there is no info."""
    info = 'gpunet_infiniband_port_info{interface!=""}'
    return (f"(\n  {expr}\n) * on (instance, device, port) group_left (interface) {info}\n"
            f"or on (instance, device, port)\n(\n  {expr}\n)")


def _busbw_low(t: T) -> str:
    p = t["probe"]
    ratio = _g(p["bus_bandwidth_ratio"])
    metric = ('gpunet_probe_allreduce_bus_bandwidth_bytes_per_second'
              f'{{size="{p["bandwidth_size_bytes"]}"')
    parts = []
    expected = p["expected_bus_bandwidth_bytes_per_second"]
    fleet = []
    for scope in ("intra", "net", "inter"):
        if expected[scope] > 0:
            parts.append(f'{metric}, scope="{scope}"}} < {ratio} * {_g(expected[scope])}')
        else:
            fleet.append(scope)
    if fleet:
        sel = f'{metric}, scope=~"{"|".join(fleet)}"}}'
        parts.append(f"{sel}\n  < on (scope, size) group_left {ratio} * {FLEET_MEDIAN_BUSBW}")
    return "\nor\n".join(parts)


def _variation(t: T) -> str:
    """Coefficient of variation of the per-round median time at the bandwidth size."""
    p = t["probe"]
    sel = (f'gpunet_probe_allreduce_seconds{{size="{p["bandwidth_size_bytes"]}", '
           'stat="median"}')
    w = p["variation_window"]
    return (f"stddev_over_time({sel}[{w}])\n  / avg_over_time({sel}[{w}]) > "
            f"{_g(p['variation_ratio'])}")


def _probe_stale(t: T) -> str:
    stale = _g(t["probe"]["stale_seconds"])
    return ("(\n    time() - gpunet_probe_last_success_timestamp_seconds{scope!=\"inter\"} > "
            f"{stale}\n  and on (instance)\n    time() - "
            f"gpunet_probe_idle_since_timestamp_seconds > {stale}\n)\nor\n  time() - "
            f"gpunet_probe_last_success_timestamp_seconds{{scope=\"inter\"}} > {stale}")


def _xid(t: T, critical: bool) -> str:
    """XID counts that rose in the last 10 minutes. A (GPU, XID) series appears with its first
    event, already at 1, where increase() sees nothing; so a series absent 10 minutes ago counts
    too, when the GPU's last XID is that recent (not after a Prometheus restart)."""
    codes = "|".join(str(c) for c in sorted(set(t["gpu"]["critical_xids"])))
    sel = f'gpunet_gpu_xid_errors_total{{xid{"=~" if critical else "!~"}"{codes}"}}'
    return (f"(\n  increase({sel}[10m]) > 0\n  or\n  ({sel} unless {sel} offset 10m)\n)\n"
            "and on (instance, gpu) (time() - gpunet_gpu_xid_last_timestamp_seconds < 600)")


def _network_bound(t: T) -> str:
    """Share of the node's GPUs with compute processes whose utilization, averaged over the
    window, lies in [busy_utilization_ratio, network_bound_utilization_ratio): above "starved",
    below a compute-bound GPU. Per node: the ranks of a job on one node wait together."""
    g = t["gpu"]
    avg = f"avg_over_time(gpunet_gpu_utilization_ratio[{g['network_bound_window']}])"
    busy = "gpunet_gpu_compute_processes > 0"
    return (f"(\n  count by (instance, job) (\n    ({avg} >= {_g(g['busy_utilization_ratio'])})"
            f" < {_g(g['network_bound_utilization_ratio'])}\n"
            f"    and on (instance, gpu) {busy}\n  )\n"
            f"  / on (instance, job)\n  count by (instance, job) ({busy})\n)"
            f" >= {_g(g['network_bound_gpu_share'])}")


def _fleet_link_slow(t: T) -> str:
    """A pair slow or failed while this node has a healthy pair, unless the fleet's view of the
    peer (the pairs that name it, on every other node) makes the peer the suspect: then
    GpunetFleetNodeSuspect names it and its pairs are not blamed as links. The alert carries
    the pair's leaf, peer_leaf and cross_leaf (PAIR_LEAVES) for Alertmanager's inhibition."""
    f = t["fleet"]
    return (f"(\n  (\n    {PAIR_RATIO} < {_g(f['link_slow_ratio'])}\n"
            f"    or on (instance, job, peer)\n    0 * ({_PAIR_OK} == 0)\n  )\n"
            f"  and on (instance, job) {NODE_PAIRS_HEALTHY} >= 1\n"
            f"  unless on (job, peer) (\n    {PEER_PAIRS} >= {f['suspect_min_pairs']}\n"
            f"    and on (job, peer) {PEER_PAIRS_HEALTHY} == 0\n  )\n)\n"
            # The leaves, for Alertmanager: GpunetFleetCrossLeafSlow inhibits cross-leaf pairs.
            f"* on (instance, job, peer) group_left (leaf, peer_leaf, cross_leaf) {PAIR_LEAVES}")


def _fleet_outlier(t: T) -> str:
    f = t["fleet"]
    sigma = _g(f["outlier_mad_factor"] * 1.4826)
    return (f"{NODE_MEDIAN_BW}\n  < on (job) group_left ()\n"
            f"  ({FLEET_MEDIAN_BW} - {sigma} * {FLEET_MAD_BW})\n"
            f"and on (instance, job)\n{NODE_MEDIAN_BW}\n"
            f"  < on (job) group_left {_g(f['outlier_ratio'])} * {FLEET_MEDIAN_BW}\n"
            f"and on (job) {FLEET_NODES} >= {f['outlier_min_nodes']}")


def _fabric_port(expr: str, neighbour: str = "gpunet_fabric_port_info") -> str:
    """``expr`` (labels instance, switch, port) with the port's last known neighbour (remote,
    remote_port, remote_name, remote_type, from ``neighbour``: a selector of port_info, which
    filters too) and the switch's node description as ``name``. Every port of a sweep has a
    port_info and every switch with ports a switch_info, so the join drops nothing else."""
    return (f"(\n  {expr}\n)\n"
            "* on (instance, switch, port) group_left (remote, remote_port, remote_name, "
            f"remote_type)\n  {neighbour}\n"
            "* on (instance, switch) group_left (name) gpunet_fabric_switch_info")


def _fabric_switch(expr: str) -> str:
    """``expr`` (labels instance, switch, ...) with the switch's node description as ``name``."""
    return (f"(\n  {expr}\n)\n"
            "* on (instance, switch) group_left (name) gpunet_fabric_switch_info")


def _fabric_receive_errors(t: T) -> str:
    """Receive errors of a switch port, and packets it received already marked bad upstream,
    each with its counter's name in ``counter``."""
    limit = _g(t["infiniband"]["receive_errors_per_second"])
    parts = [f'label_replace(\n    rate(gpunet_fabric_port_{m}_total[5m]) > {limit},\n'
             f'    "counter", "{m}", "", ""\n  )'
             for m in ("receive_errors", "receive_remote_physical_errors")]
    return _fabric_port("\n  or\n  ".join(parts))


_NODE = "on {{ $labels.instance }}"
_PORT = "{{ $labels.device }} port {{ $labels.port }} " + _NODE
_IF = "{{ $labels.interface }} " + _NODE
_GPU = "GPU {{ $labels.gpu }} " + _NODE
_SCOPE = "({{ $labels.scope }} probe) " + _NODE
# A switch port: the switch's node description and GUID, the port, and its last neighbour.
_SWITCH = "{{ $labels.name }} ({{ $labels.switch }})"
_SWPORT = (f"Switch {_SWITCH} port {{{{ $labels.port }}}}{{{{ with $labels.remote_name }}}}"
           " (to {{ . }} port {{ $labels.remote_port }}){{ end }}")
_SWEPT = "Seen by the fabric sweep on {{ $labels.instance }}."
_SUPPORTED = (
    '{{ with printf "gpunet_fabric_port_rate_supported_bytes_per_second{instance=%q, '
    'switch=%q, port=%q} * 8 / 1e9" $labels.instance $labels.switch $labels.port | query }}'
    "{{ . | first | value }} Gb/s{{ else }}rate{{ end }}")

ALERTS: tuple[Alert, ...] = (
    # --- link: port state, rate, errors, MTU --------------------------------------------------
    Alert("GpunetPortDown", "link", "critical", "2m",
          lambda t: _port_with_interface(
              "gpunet_infiniband_port_state_id\n  and on (instance, device, port)\n  "
              "(gpunet_infiniband_port_state_id != 4 or gpunet_infiniband_port_phys_state_id "
              "!= 5)"),
          "RDMA port not ACTIVE or not LinkUp",
          f"RDMA port {_PORT} is not ACTIVE/LinkUp (logical state {{{{ $value }}}}; 4 is "
          "ACTIVE). Its traffic moves to the node's other ports or fails."),
    Alert("GpunetPortRateBelowExpected", "link", "critical", "5m",
          lambda t: ("gpunet_infiniband_port_rate_bytes_per_second * 8 / 1e9\n"
                     "  and on (instance, device, port) gpunet_infiniband_port_rate_degraded == 1"),
          "RDMA port trained below its expected rate",
          f"RDMA port {_PORT} runs at {{{{ $value }}}} Gb/s, below the rate expected for it "
          "(gpunet_infiniband_port_rate_expected_bytes_per_second)."),
    Alert("GpunetPortFlapping", "link", "warning", "0m",
          lambda t: ("increase(gpunet_infiniband_port_link_downed_total"
                     f"[{t['infiniband']['link_downed_window']}]) >= "
                     f"{t['infiniband']['link_downed_count']}"),
          "RDMA port flapping",
          f"RDMA port {_PORT} went down {{{{ $value | printf \"%.0f\" }}}} times recently "
          "(gpunet_infiniband_port_link_downed_total)."),
    Alert("GpunetInterfaceFlapping", "link", "warning", "0m",
          lambda t: ("increase(gpunet_link_carrier_changes_total"
                     f"[{t['infiniband']['carrier_changes_window']}]) >= "
                     f"{t['infiniband']['carrier_changes_count']}"),
          "Network interface carrier flapping",
          f"Interface {_IF} changed carrier {{{{ $value | printf \"%.0f\" }}}} times recently "
          "(gpunet_link_carrier_changes_total)."),
    Alert("GpunetPortSymbolErrors", "link", "warning", "0m",
          lambda t: ("increase(gpunet_infiniband_port_symbol_errors_total[1h]) > "
                     f"{_g(t['infiniband']['symbol_errors_per_hour'])}"),
          "RDMA port above the symbol-error budget",
          f"RDMA port {_PORT} counted {{{{ $value | printf \"%.0f\" }}}} symbol errors in the "
          "last hour, above the bit-error-rate budget."),
    Alert("GpunetPortLinkErrorRecoveries", "link", "warning", "0m",
          lambda t: ("rate(gpunet_infiniband_port_link_error_recoveries_total[5m]) * 60 > "
                     f"{_g(t['infiniband']['link_error_recoveries_per_minute'])}"),
          "RDMA port retraining its link",
          f"RDMA port {_PORT} retrains its link {{{{ $value | humanize }}}} times per "
          "minute."),
    Alert("GpunetPortReceiveErrors", "link", "warning", "10m",
          lambda t: ("rate(gpunet_infiniband_port_receive_errors_total[5m]) > "
                     f"{_g(t['infiniband']['receive_errors_per_second'])}"),
          "RDMA port receiving packets with errors",
          f"RDMA port {_PORT} receives {{{{ $value | humanize }}}} packets with errors per "
          "second."),
    Alert("GpunetPortTransmitDiscards", "link", "warning", "10m",
          lambda t: ("rate(gpunet_infiniband_port_transmit_discards_total[5m]) > "
                     f"{_g(t['infiniband']['transmit_discards_per_second'])}"),
          "RDMA port discarding packets on transmit",
          f"RDMA port {_PORT} discards {{{{ $value | humanize }}}} packets per second on "
          "transmit."),
    Alert("GpunetPortCounterSaturated", "link", "warning", "1h",
          lambda t: "gpunet_infiniband_port_pma_saturated == 1",
          "RDMA port error counter stuck at its maximum",
          f"Counter {{{{ $labels.counter }}}} of RDMA port {_PORT} sits at its maximum, so its "
          "rate reads 0 and its alert cannot fire."),
    Alert("GpunetRoceMtuTooSmall", "link", "warning", "10m",
          lambda t: (f"gpunet_link_mtu_bytes < {t['link']['roce_min_mtu_bytes']}\n"
                     f"  and on (instance, interface) {_ROCE_INTERFACE}"),
          "RoCE interface MTU too small for 4096-byte RDMA frames",
          f"RoCE interface {_IF} has MTU {{{{ $value }}}}, so RDMA runs with a smaller path MTU "
          "than 4096."),
    Alert("GpunetInterfaceMtuNotExpected", "link", "warning", "10m",
          lambda t: ("gpunet_link_mtu_bytes\n"
                     "  and on (instance, interface) gpunet_link_mtu_mismatch == 1"),
          "Interface MTU is not the expected one",
          f"Interface {_IF} has MTU {{{{ $value }}}}, not the one configured as expected "
          "(gpunet_link_mtu_expected_bytes)."),
    Alert("GpunetRdmaMtuNotExpected", "link", "warning", "10m",
          lambda t: ("gpunet_link_rdma_active_mtu_bytes\n"
                     "  and on (instance, device, port) gpunet_link_rdma_mtu_mismatch == 1"),
          "RDMA active MTU is not the expected one",
          f"RDMA port {_PORT} has active MTU {{{{ $value }}}}, not the one configured as "
          "expected (gpunet_link_rdma_mtu_expected_bytes)."),
    Alert("GpunetInterfacePhyErrors", "link", "warning", "0m",
          lambda t: ("(\n  " + "\n  or\n  ".join(
              f"increase(gpunet_pfc_{m}_total[1h]) > {_g(t['link']['phy_errors_per_hour'])}"
              for m in ("fec_uncorrected_symbol_errors", "symbol_errors", "crc_errors"))
              + f"\n)\nand on (instance, interface) {_ROCE_INTERFACE}"),
          "RoCE interface above the physical-layer error budget",
          f"RoCE interface {_IF} counted {{{{ $value | printf \"%.0f\" }}}} symbol, CRC or "
          "FEC-uncorrected errors in the last hour (ethtool -S), above the bit-error-rate "
          "budget."),
    Alert("GpunetNicPcieLinkDegraded", "link", "warning", "10m",
          lambda t: ('max without (end) (gpunet_topology_nic_pcie_link_width_lanes{end="device"})\n'
                     "  and on (instance, device) gpunet_topology_nic_pcie_link_degraded == 1"),
          "RDMA NIC's PCIe link trained down",
          "RDMA device {{ $labels.device }} " + _NODE + " runs its PCIe link (now x{{ $value }}) "
          "slower or narrower than both its ends allow: the NIC cannot reach its line rate (x8 "
          "halves a 400G NIC)."),
    Alert("GpunetRdmaDeviceMissing", "link", "critical", "5m",
          lambda t: "gpunet_inventory_missing > 0",
          "RDMA devices, ports or netdevs gone",
          f"{{{{ $value }}}} {{{{ $labels.kind }}}} expected {_NODE} are gone (fallen off the "
          "bus, driver unloaded); gpunet_inventory_missing_info names those learned earlier. "
          "Their ports have no series, so no port alert can fire for them."),
    # --- congestion: PFC, pause, ECN ---------------------------------------------------------
    Alert("GpunetPfcDisabledOnRocePriority", "congestion", "critical", "5m",
          lambda t: (f'gpunet_pfc_enabled{{priority="{t["pfc"]["roce_priority"]}"}} == 0\n'
                     f"  and on (instance, interface) {_ROCE_INTERFACE}"),
          "PFC off on the RoCE priority",
          f"PFC is off on priority {{{{ $labels.priority }}}} of RoCE interface {_IF}: RoCE "
          "traffic there is not lossless."),
    Alert("GpunetPfcTrustNotExpected", "congestion", "warning", "10m",
          lambda t: f'gpunet_pfc_config_info{{trust!="", trust!="{t["pfc"]["trust"]}"}}',
          "Priority trust mode is not the expected one",
          f"Interface {_IF} trusts {{{{ $labels.trust }}}} to classify traffic, so RoCE packets "
          "may land on a priority without PFC."),
    Alert("GpunetPauseWithoutPfc", "congestion", "warning", "5m",
          lambda t: ("increase(gpunet_pfc_pause_frames_total[10m]) > 0\n"
                     "  and on (instance, interface, priority) gpunet_pfc_enabled == 0"),
          "Pause frames on a priority without PFC",
          f"Interface {_IF} counted {{{{ $value | printf \"%.0f\" }}}} pause frames "
          "({{ $labels.direction }}) in 10 minutes on priority {{ $labels.priority }}, where "
          "PFC is off."),
    Alert("GpunetPauseStorm", "congestion", "critical", "0m",
          lambda t: ("increase(gpunet_pfc_pause_storm_error_events_total[10m]) > 0\n"
                     "or\nincrease(gpunet_pfc_pause_storm_warning_events_total[10m]) > 0"),
          "PFC pause storm",
          f"Interface {_IF} detected a PFC pause storm in the last 10 minutes: the NIC kept "
          "pausing its peer for too long."),
    Alert("GpunetPauseDurationHigh", "congestion", "warning", "10m",
          lambda t: ("rate(gpunet_pfc_pause_duration_seconds_total[5m]) > "
                     f"{_g(t['pfc']['pause_ratio'])}"),
          "Interface paused for a large share of time",
          f"Interface {_IF} spends {{{{ $value | humanizePercentage }}}} of the time paused "
          "({{ $labels.direction }}) on priority {{ $labels.priority }}."),
    Alert("GpunetEcnMarksHigh", "congestion", "warning", "15m",
          lambda t: ("rate(gpunet_infiniband_port_hw_np_ecn_marked_roce_packets_total[5m]) > "
                     f"{_g(t['pfc']['ecn_marked_packets_per_second'])}"),
          "Many ECN-marked RoCE packets",
          f"RDMA port {_PORT} receives {{{{ $value | humanize }}}} ECN-marked RoCE packets per "
          "second: the fabric is congested on the way to this node."),
    Alert("GpunetCnpsHigh", "congestion", "warning", "15m",
          lambda t: ("rate(gpunet_infiniband_port_hw_rp_cnp_handled_total[5m]) > "
                     f"{_g(t['pfc']['cnp_handled_per_second'])}"),
          "Many congestion notifications received",
          f"RDMA port {_PORT} slows its senders on {{{{ $value | humanize }}}} CNPs per "
          "second: its traffic meets congestion."),
    Alert("GpunetCnpsIgnored", "congestion", "warning", "10m",
          lambda t: "increase(gpunet_infiniband_port_hw_rp_cnp_ignored_total[10m]) > 0",
          "Congestion notifications ignored",
          f"RDMA port {_PORT} ignored {{{{ $value | printf \"%.0f\" }}}} CNPs in 10 minutes: "
          "congestion control (DCQCN) is off on the priority they arrive on."),
    Alert("GpunetPfcConfigUnreadable", "congestion", "warning", "10m",
          lambda t: ("gpunet_pfc_config_refresh_success == 0\n"
                     f"  and on (instance, interface) {_ROCE_INTERFACE}"),
          "PFC configuration of a RoCE interface cannot be read",
          f"The QoS configuration of RoCE interface {_IF} cannot be read "
          "(gpunet_pfc_config_refresh_success {{ $value }}: mlnx_qos, dcb or sysfs fails), so "
          "its PFC alerts judge stale values or none."),
    # --- transport: what NCCL really uses ----------------------------------------------------
    Alert("GpunetNcclSocketFallback", "transport", "critical", "0m",
          lambda t: "gpunet_probe_socket_fallback == 1",
          "NCCL fell back to TCP sockets",
          f"NCCL runs over TCP sockets {_SCOPE} although RDMA should carry it."),
    Alert("GpunetGdrInactive", "transport", "critical", "0m",
          lambda t: f"gpunet_probe_gdr_active == 0\n  and on (instance) {_ACTIVE_RDMA_PORT}",
          "NCCL network traffic without GPUDirect RDMA",
          f"NCCL's network channels do not use GPUDirect RDMA {_SCOPE} while RDMA ports are "
          "up: data is staged through host memory."),
    Alert("GpunetGdrNotReady", "transport", "critical", "5m",
          lambda t: f"gpunet_topology_gdr_ready == 0\n  and on (instance) {_ACTIVE_RDMA_PORT}",
          "nvidia_peermem not loaded and no DMA-BUF",
          f"GPUDirect RDMA cannot work {_NODE}: no peer-memory module (nvidia_peermem) is "
          "loaded and the driver or kernel cannot use DMA-BUF."),
    Alert("GpunetGpuJobRdmaIdle", "transport", "warning", "30m",
          lambda t: ("count by (instance) (\n"
                     "  avg_over_time(gpunet_gpu_utilization_ratio[10m]) < "
                     f"{_g(t['gpu']['busy_utilization_ratio'])}\n"
                     "  and on (instance, gpu) gpunet_gpu_compute_processes > 0\n)\n"
                     "and on (instance)\n"
                     "(\n  sum by (instance) (\n"
                     "    rate(gpunet_infiniband_port_transmitted_bytes_total[10m])\n"
                     "    + rate(gpunet_infiniband_port_received_bytes_total[10m])\n  ) < "
                     f"{_g(t['infiniband']['rdma_idle_bytes_per_second'])}\n)\n"
                     f"and on (instance) {_ACTIVE_RDMA_PORT}"),
          "GPU job starved while the RDMA ports are idle",
          f"{{{{ $value }}}} GPUs {_NODE} run compute processes but are starved while its RDMA "
          "ports carry almost nothing: the job's traffic is not on RDMA (NCCL on sockets, as "
          "in a container without the InfiniBand libraries) or the job does not use the "
          "network."),
    Alert("GpunetNcclEnvDisablesFastPath", "transport", "warning", "10m",
          lambda t: "gpunet_topology_nccl_env_findings > 0",
          "GPU processes run NCCL with a fast path turned off",
          f"{{{{ $value }}}} GPU processes {_NODE} set {{{{ $labels.variable }}}} "
          "({{ $labels.issue }})."),
    Alert("GpunetRoceRetransmissions", "transport", "warning", "10m",
          lambda t: ("\nor\n".join(
              f"rate(gpunet_infiniband_port_hw_{m}_total[5m]) > "
              f"{_g(t['infiniband']['sequence_errors_per_second'])}"
              for m in ("out_of_sequence_packets", "packet_sequence_error_naks",
                        "implied_nak_sequence_errors"))
              + "\nor\nrate(gpunet_infiniband_port_hw_local_ack_timeouts_total[5m]) > "
              f"{_g(t['infiniband']['ack_timeouts_per_second'])}"),
          "RDMA transport retransmitting",
          f"RDMA port {_PORT} sees {{{{ $value | humanize }}}} sequence errors or ACK timeouts "
          "per second (hw_counters): packets are lost and retransmitted."),
    # --- topology -----------------------------------------------------------------------------
    Alert("GpunetGpuNicNumaMismatch", "topology", "warning", "10m",
          lambda t: "gpunet_topology_gpu_nearest_nic_numa_mismatch == 1",
          "GPU's nearest rail NIC on another NUMA node",
          f"The nearest rail NIC of {_GPU} is on another NUMA node: its network traffic crosses "
          "the inter-socket link."),
    Alert("GpunetGpuNicAcsRedirect", "topology", "warning", "10m",
          lambda t: "gpunet_topology_gpu_nic_acs_redirect_bridges > 0",
          "ACS redirects GPU-NIC peer traffic",
          f"{{{{ $value }}}} PCIe bridges between {_GPU} and {{{{ $labels.device }}}} redirect "
          "peer-to-peer traffic to the root complex (ACS), slowing GPUDirect RDMA."),
    # --- gpu ----------------------------------------------------------------------------------
    Alert("GpunetGpuPcieLinkDegraded", "gpu", "warning", "10m",
          lambda t: "gpunet_gpu_pcie_link_degraded == 1",
          "GPU PCIe link below its maximum",
          f"{_GPU} runs its PCIe link below its maximum generation or width while busy."),
    Alert("GpunetGpuPcieReplays", "gpu", "warning", "10m",
          lambda t: ("rate(gpunet_gpu_pcie_replays_total[5m]) * 60 > "
                     f"{_g(t['gpu']['pcie_replays_per_minute'])}"),
          "GPU PCIe link replaying packets",
          f"{_GPU} replays {{{{ $value | humanize }}}} PCIe packets per minute: the link is "
          "unreliable."),
    Alert("GpunetGpuXidErrors", "gpu", "warning", "0m",
          lambda t: _xid(t, critical=False),
          "GPU reported XID errors",
          f"{_GPU} reported XID {{{{ $labels.xid }}}} in the last 10 minutes ({{{{ $value | "
          "printf \"%.0f\" }} in that time or since the exporter started)."),
    Alert("GpunetGpuXidCritical", "gpu", "critical", "0m",
          lambda t: _xid(t, critical=True),
          "GPU reported a critical XID error",
          f"{_GPU} reported XID {{{{ $labels.xid }}}} in the last 10 minutes ({{{{ $value | "
          "printf \"%.0f\" }} in that time or since the exporter started); it needs a reset or "
          "the node a drain."),
    Alert("GpunetGpuLost", "gpu", "critical", "0m",
          lambda t: "gpunet_gpu_lost == 1",
          "GPU lost",
          f"{_GPU} has fallen off the bus (NVML: GPU is lost)."),
    Alert("GpunetGpuMissing", "gpu", "critical", "5m",
          lambda t: "gpunet_gpu_missing > 0",
          "GPUs no longer enumerated",
          f"{{{{ $value }}}} GPUs that NVML enumerated earlier {_NODE} are gone."),
    Alert("GpunetGpuStarved", "gpu", "warning", "30m",
          lambda t: ("avg_over_time(gpunet_gpu_utilization_ratio[10m]) < "
                     f"{_g(t['gpu']['busy_utilization_ratio'])}\n"
                     "  and on (instance, gpu) gpunet_gpu_compute_processes > 0"),
          "GPU under-utilized while compute processes run",
          f"{_GPU} is busy only {{{{ $value | humanizePercentage }}}} of the time while "
          "compute processes run on it: it is waiting, often on the network."),
    Alert("GpunetGpusNetworkBoundBand", "gpu", "info", "15m", _network_bound,
          "GPUs in the utilization band of network-bound training",
          f"{{{{ $value | humanizePercentage }}}} of the GPUs running compute processes {_NODE} "
          "have been busy, on average, more than starved GPUs but less than compute-bound ones: "
          "the band of training that waits on its collectives."),
    Alert("GpunetNvmlDown", "gpu", "warning", "5m",
          lambda t: "gpunet_gpu_nvml_up == 0",
          "NVML not answering",
          f"NVML fails {_NODE}: no GPU metrics (driver reloading, failing or mismatched)."),
    # --- collective: probe results ------------------------------------------------------------
    Alert("GpunetAllreduceLatencyHigh", "collective", "warning", "10m",
          lambda t: ("gpunet_probe_allreduce_seconds"
                     f'{{size="{t["probe"]["latency_size_bytes"]}", stat="median"}} > '
                     f"{_g(t['probe']['latency_seconds'])}"),
          "Small all-reduce too slow",
          f"The {{{{ $labels.size }}}}-byte all-reduce takes {{{{ $value | humanizeDuration }}}}"
          f" {_SCOPE}."),
    Alert("GpunetBusBandwidthLow", "collective", "warning", "10m", _busbw_low,
          "All-reduce bus bandwidth below the expected",
          f"The {{{{ $labels.size }}}}-byte all-reduce reaches {{{{ $value | humanize }}}}B/s "
          f"bus bandwidth {_SCOPE}, below the expected."),
    Alert("GpunetBusBandwidthBelowLinkRate", "collective", "warning", "10m",
          lambda t: ("gpunet_probe_bus_bandwidth_link_ratio < "
                     f"{_g(t['probe']['link_ratio'])}"),
          "All-reduce through the NICs well below the link rate",
          f"The probe's all-reduce {_SCOPE} reaches {{{{ $value | humanizePercentage }}}} of "
          "what its RDMA links allow (gpunet_probe_link_bandwidth_bytes_per_second)."),
    Alert("GpunetStragglerRank", "collective", "warning", "10m",
          lambda t: ("gpunet_probe_straggler_wait_ratio\n  * on (instance, scope) group_left "
                     "(rank, gpu) gpunet_probe_straggler_info\n  > "
                     f"{_g(t['probe']['straggler_wait_ratio'])}"),
          "A straggler rank slows the collective",
          f"Rank {{{{ $labels.rank }}}} (GPU {{{{ $labels.gpu }}}}) {_SCOPE} arrives late: the "
          "other ranks spend {{ $value | humanizePercentage }} of their all-reduce time waiting "
          "for it."),
    Alert("GpunetProbeTimeVariance", "collective", "warning", "15m",
          _variation,
          "All-reduce time varies from round to round",
          f"The {{{{ $labels.size }}}}-byte all-reduce time varies by {{{{ $value | "
          f"humanizePercentage }}}} from round to round {_SCOPE}."),
    # A node's own probe runs only while its GPUs are idle (issue 31): a node busy with jobs for
    # days has old results and is not stale; one idle past the hold-off and still without a
    # complete round is. Cluster-mode (inter) results follow their own schedule.
    Alert("GpunetProbeStale", "collective", "warning", "0m", _probe_stale,
          "No recent successful probe round",
          f"The last successful probe round {_SCOPE} ended {{{{ $value | humanizeDuration }}}}"
          " ago."),
    Alert("GpunetProbeFailing", "collective", "warning", "15m",
          lambda t: ('gpunet_probe_state{state="failing"} == 1\nor\n'
                     'gpunet_probe_success{scope="inter"} == 0'),
          "Probe rounds failing",
          f"Probe rounds {_NODE} fail although nothing else uses its GPUs "
          "(gpunet_probe_success and gpunet_probe_failures_total say which scope and why)."),
    Alert("GpunetProbeIdleUnknown", "collective", "warning", "15m",
          lambda t: 'gpunet_probe_state{state="unknown"} == 1',
          "Probe cannot tell whether the GPUs are idle",
          f"The probe {_NODE} cannot read its GPUs' processes (NVML), so it runs no rounds: "
          "NCCL's transport and GPUDirect RDMA are not checked there."),
    # --- the NCCL jobs running now, from NCCL's RAS service (issue 20) -------------------------
    Alert("GpunetNcclRankDead", "collective", "warning", "0m",
          lambda t: 'gpunet_nccl_job_processes{state="dead"} > 0',
          "NCCL job process dead",
          "{{ $value }} process(es) of the NCCL job on RAS port {{ $labels.port }} "
          f"{_NODE} are considered dead: the job waits for them or is about to fail."),
    Alert("GpunetNcclRankUnreachable", "collective", "warning", "1m",
          lambda t: 'gpunet_nccl_missing_ranks{reason="unreachable"} > 0',
          "NCCL ranks not answering",
          "{{ $value }} rank(s) of the NCCL job on RAS port {{ $labels.port }} "
          f"{_NODE} do not answer NCCL's RAS: their process is stopped, hung or cut off."),
    Alert("GpunetNcclRankStalled", "collective", "warning", "2m",
          lambda t: "gpunet_nccl_stalled_ranks > 0",
          "NCCL rank stuck behind the others",
          "{{ $value }} rank(s) of the NCCL job on RAS port {{ $labels.port }} "
          f"{_NODE} launch no more collectives while their communicator's other ranks have "
          "gone further: the others wait for them."),
    Alert("GpunetNcclRasUnreachable", "collective", "warning", "5m",
          lambda t: ("gpunet_nccl_ras_listeners > 0\n"
                     "  and on (instance, job, port) gpunet_nccl_ras_query_success == 0"),
          "NCCL's RAS service not answering",
          "{{ $value }} NCCL process(es) listen on RAS port {{ $labels.port }} "
          f"{_NODE} but none gave a report: the job's health is unknown."),
    # --- the pair plan across the fleet (issue 18) ---------------------------------------------
    Alert("GpunetFleetNodeSuspect", "collective", "warning", "5m",
          lambda t: (f"{NODE_PAIRS} >= {t['fleet']['suspect_min_pairs']}\n"
                     f"  and on (instance, job) {NODE_PAIRS_HEALTHY} == 0"),
          "Node in every failing or slow pair of the pair plan",
          "All {{ $value }} pairs of {{ $labels.instance }} failed or were slow in the last "
          "pair round while the fleet's other pairs were not: the node, not its links, is the "
          "common factor."),
    Alert("GpunetFleetBandwidthOutlier", "collective", "warning", "5m", _fleet_outlier,
          "Node's pair bandwidth a robust outlier of the fleet",
          "The median bus bandwidth of the pairs of {{ $labels.instance }} is {{ $value | "
          "humanize }}B/s, below the fleet's median node by more than the robust-sigma "
          f"threshold (1.4826 x MAD, {FLEET_MAD_BW}) and the ratio threshold."),
    Alert("GpunetFleetLinkSlow", "link", "warning", "5m", _fleet_link_slow,
          "Pair slow between two otherwise healthy nodes",
          "The pair {{ $labels.instance }} to {{ $labels.peer }} reaches {{ $value | "
          "humanizePercentage }} of the fleet's median node bandwidth (0% when it failed), "
          "while both ends have healthy pairs: the link between them (cable, ports, switch "
          "path) is the suspect."),
    Alert("GpunetFleetCrossLeafSlow", "topology", "warning", "5m",
          # peer_leaf repeats leaf: Alertmanager's `equal` compares labels of one name, and a
          # cross-leaf GpunetFleetLinkSlow names this leaf as its leaf or as its peer_leaf.
          lambda t: (f'label_replace(\n  {LEAF_CROSS_RATIO} < '
                     f'{_g(t["fleet"]["cross_leaf_ratio"])},\n'
                     '  "peer_leaf", "$1", "leaf", "(.*)"\n)'),
          "Cross-leaf pairs much slower than intra-leaf pairs",
          "The cross-leaf pairs of leaf {{ $labels.leaf }} reach {{ $value | "
          "humanizePercentage }} of the bandwidth of its intra-leaf pairs (medians): the spine "
          "side (the leaf's uplinks, the spines, routing) is the suspect."),
    Alert("GpunetFleetProbeStale", "collective", "warning", "0m",
          lambda t: ("time() - gpunet_fleet_round_timestamp_seconds > "
                     f"{_g(t['fleet']['stale_seconds'])}"),
          "No recent pair round of the pair plan",
          "The last pair round of {{ $labels.instance }} ended {{ $value | humanizeDuration }} "
          "ago: the fleet alerts judge old results."),
    # --- fabric: switch ports, uplinks and routing, from the fabric collector's sweep -----------
    Alert("GpunetFabricLinkDown", "fabric", "critical", "5m",
          lambda t: _fabric_port("gpunet_fabric_port_state_id != 4",
                                 'gpunet_fabric_port_info{remote_type="switch"}'),
          "Link between two switches down",
          f"{_SWPORT} is not Active (logical state {{{{ $value }}}}: 1 Down, 2 Initialize, 3 "
          "Armed): the link between the two switches is down, and its routes move to the other "
          f"links once the subnet manager has swept. {_SWEPT}"),
    Alert("GpunetFabricHostPortDown", "fabric", "warning", "30m",
          lambda t: _fabric_port("gpunet_fabric_port_state_id != 4",
                                 'gpunet_fabric_port_info{remote_type="ca"}'),
          "Switch port to a host down",
          f"{_SWPORT} is not Active (logical state {{{{ $value }}}}: 1 Down, 2 Initialize, 3 "
          f"Armed): the host is off the fabric, or its cable or port failed. {_SWEPT}"),
    Alert("GpunetFabricLinkDegraded", "fabric", "warning", "5m",
          lambda t: _fabric_port(
              "gpunet_fabric_port_rate_bytes_per_second * 8 / 1e9\n"
              "  and on (instance, switch, port) gpunet_fabric_port_rate_degraded == 1"),
          "Fabric link trained below what both ends support",
          f"{_SWPORT} runs at {{{{ $value }}}} Gb/s, below the {_SUPPORTED} both ends support: "
          f"the link trained narrower or slower. {_SWEPT}"),
    Alert("GpunetFabricPortSymbolErrors", "fabric", "warning", "0m",
          lambda t: _fabric_port(
              "increase(gpunet_fabric_port_symbol_errors_total[1h]) > "
              f"{_g(t['infiniband']['symbol_errors_per_hour'])}"),
          "Switch port above the symbol-error budget",
          f"{_SWPORT} counted {{{{ $value | printf \"%.0f\" }}}} symbol errors in the last hour, "
          f"above the bit-error-rate budget. {_SWEPT}"),
    Alert("GpunetFabricPortLinkErrorRecoveries", "fabric", "warning", "0m",
          lambda t: _fabric_port(
              "rate(gpunet_fabric_port_link_error_recoveries_total[5m]) * 60 > "
              f"{_g(t['infiniband']['link_error_recoveries_per_minute'])}"),
          "Switch port retraining its link",
          f"{_SWPORT} retrains its link {{{{ $value | humanize }}}} times per minute. {_SWEPT}"),
    Alert("GpunetFabricPortFlapping", "fabric", "warning", "0m",
          lambda t: _fabric_port(
              "increase(gpunet_fabric_port_link_downed_total"
              f"[{t['infiniband']['link_downed_window']}]) >= "
              f"{t['infiniband']['link_downed_count']}"),
          "Switch port flapping",
          f"{_SWPORT} went down {{{{ $value | printf \"%.0f\" }}}} times recently "
          f"(gpunet_fabric_port_link_downed_total). {_SWEPT}"),
    Alert("GpunetFabricPortReceiveErrors", "fabric", "warning", "10m", _fabric_receive_errors,
          "Switch port receiving packets with errors",
          f"{_SWPORT} receives {{{{ $value | humanize }}}} packets per second "
          '{{ if eq $labels.counter "receive_remote_physical_errors" }}already marked bad on an '
          "earlier hop{{ else }}with errors{{ end }} ({{ $labels.counter }}). " + _SWEPT),
    Alert("GpunetFabricPortTransmitDiscards", "fabric", "warning", "10m",
          lambda t: _fabric_port(
              "rate(gpunet_fabric_port_transmit_discards_total[5m]) > "
              f"{_g(t['infiniband']['transmit_discards_per_second'])}"),
          "Switch port discarding packets on transmit",
          f"{_SWPORT} discards {{{{ $value | humanize }}}} packets per second on transmit: "
          f"congestion behind it, or a link going down. {_SWEPT}"),
    Alert("GpunetFabricUplinkImbalance", "fabric", "warning", "15m",
          lambda t: _fabric_switch(
              "gpunet_fabric_leaf_uplink_imbalance_ratio > "
              f"{_g(t['fabric']['uplink_imbalance_ratio'])}"),
          "Leaf switch's uplink traffic unevenly spread",
          f"The busiest uplink of leaf {_SWITCH} carries {{{{ $value | humanizePercentage }}}} "
          "more {{ $labels.direction }} traffic than the mean of its uplinks: flows crowd onto "
          f"some uplinks while others idle. {_SWEPT}"),
    Alert("GpunetFabricRoutingUnbalanced", "fabric", "warning", "15m",
          lambda t: _fabric_switch(
              "gpunet_fabric_leaf_routes_imbalance_ratio\n"
              "  and on (instance, switch) gpunet_fabric_leaf_routes_unbalanced == 1"),
          "Leaf switch's forwarding table unbalanced",
          f"The forwarding table of leaf {_SWITCH} sends more than one host LID more out of one "
          "uplink than out of another; its busiest uplink routes "
          f"{{{{ $value | humanizePercentage }}}} more host LIDs than the mean. {_SWEPT}"),
    Alert("GpunetFabricSweepFailing", "fabric", "warning", "15m",
          lambda t: ("gpunet_fabric_step_success == 0\n"
                     "or on (instance, job)\ngpunet_fabric_sweep_success == 0"),
          "Fabric sweep failing",
          "The fabric sweep on {{ $labels.instance }} fails{{ with $labels.step }} at its "
          "{{ . }} step{{ end }}: the fabric alerts judge the values of its last good sweep."),
    Alert("GpunetFabricSweepStale", "fabric", "warning", "0m",
          lambda t: ("time() - gpunet_fabric_sweep_last_success_timestamp_seconds > "
                     f"{_g(t['fabric']['stale_seconds'])}"),
          "No recent successful fabric sweep",
          "The last successful fabric sweep on {{ $labels.instance }} ended {{ $value | "
          "humanizeDuration }} ago: the fabric alerts judge old values."),
    # --- exporter -----------------------------------------------------------------------------
    Alert("GpunetCollectorFailing", "exporter", "warning", "10m",
          lambda t: "gpunet_scrape_collector_success == 0",
          "Exporter collector failing",
          f"Collector {{{{ $labels.collector }}}} fails {_NODE}: its metrics are missing."),
    Alert("GpunetExporterDown", "exporter", "warning", "5m",
          lambda t: f'up{{job="{t["job"]}"}} == 0',
          "gpunet-exporter target down",
          f"Prometheus cannot scrape gpunet-exporter {_NODE}: no network or GPU health data "
          "from this node."),
)

ALERT_NAMES = tuple(a.name for a in ALERTS)


def _anchor(name: str) -> str:
    return name.lower()


def rule_groups(t: T) -> dict[str, Any]:
    """The rule file's content for thresholds ``t``."""
    alerts = []
    for a in ALERTS:
        alerts.append({
            "alert": a.name,
            "expr": a.expr(t),
            "for": t["for"].get(a.name, a.for_),
            "labels": {"severity": a.severity, "class": a.cls},
            "annotations": {
                "summary": a.summary,
                "description": a.description,
                "runbook_url": f"{t['runbook_url']}#{_anchor(a.name)}",
            },
        })
    job = t["job"]
    recording: list[dict[str, Any]] = [{
        "record": FLEET_MEDIAN_BUSBW,
        "expr": ("quantile by (scope, size) (0.5, "
                 "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second)"),
    }]
    recording += _fleet_recording(t)
    health = [{
        "record": ALERTS_FIRING,
        # Per node: an alert without an instance (GpunetFleetCrossLeafSlow, about a leaf) has
        # no row in the matrix.
        "expr": (f'count by (instance) (ALERTS{{alertstate="firing", alertname=~"Gpunet.+", '
                 f'class="{c}", instance!=""}})\nor on (instance)\n'
                 f'0 * group by (instance) (up{{job="{job}"}})'),
        "labels": {"class": c},
    } for c in CLASSES]
    return {"groups": [
        {"name": "gpunet-recording", "rules": recording},
        {"name": "gpunet-alerts", "rules": alerts},
        {"name": "gpunet-health", "rules": health},
    ]}


def _fleet_recording(t: T) -> list[dict[str, Any]]:
    """The pair plan's recording rules: per-node and fleet statistics of the pair bandwidth
    (successful pairs only), each pair's health, and the per-leaf intra and cross medians."""
    f = t["fleet"]
    ran = f"{_PAIR_BW} and on (instance, job, peer) {_PAIR_OK} == 1"
    # Pairs whose peer is on this node's leaf: pair_info with peer_leaf copied into leaf, so it
    # matches the node's own leaf label (PromQL cannot compare two labels directly).
    with_leaf = (f"(\n    {ran}\n  )\n"
                 "  * on (instance, job) group_left (leaf) gpunet_fleet_node_info")
    same_leaf = 'label_replace(gpunet_fleet_pair_info, "leaf", "$1", "peer_leaf", "(.*)")'
    return [
        {"record": NODE_MEDIAN_BW, "expr": f"quantile by (instance, job) (0.5,\n  {ran}\n)"},
        {"record": FLEET_MEDIAN_BW, "expr": f"quantile by (job) (0.5, {NODE_MEDIAN_BW})"},
        {"record": FLEET_MAD_BW,
         "expr": (f"quantile by (job) (0.5,\n  abs({NODE_MEDIAN_BW}\n"
                  f"    - on (job) group_left {FLEET_MEDIAN_BW})\n)")},
        {"record": FLEET_NODES, "expr": f"count by (job) ({NODE_MEDIAN_BW})"},
        {"record": PAIR_RATIO,
         "expr": f"(\n  {ran}\n)\n/ on (job) group_left {FLEET_MEDIAN_BW}"},
        {"record": PAIR_HEALTHY,
         "expr": (f"{PAIR_RATIO} >= bool {_g(f['link_slow_ratio'])}\n"
                  f"or on (instance, job, peer)\n{_PAIR_OK} == bool 1")},
        {"record": NODE_PAIRS, "expr": f"count by (instance, job) ({_PAIR_OK})"},
        {"record": NODE_PAIRS_HEALTHY, "expr": f"sum by (instance, job) ({PAIR_HEALTHY})"},
        {"record": PEER_PAIRS, "expr": f"count by (job, peer) ({_PAIR_OK})"},
        {"record": PEER_PAIRS_HEALTHY, "expr": f"sum by (job, peer) ({PAIR_HEALTHY})"},
        {"record": PAIR_LEAVES, "expr": _pair_leaves()},
        {"record": LEAF_INTRA_BW,
         "expr": (f"quantile by (job, leaf) (0.5,\n  {with_leaf}\n"
                  f"  and on (instance, job, peer, leaf) {same_leaf}\n)")},
        {"record": LEAF_CROSS_BW,
         "expr": (f"quantile by (job, leaf) (0.5,\n  {with_leaf}\n"
                  f"  and on (instance, job, peer) gpunet_fleet_pair_info\n"
                  f"  unless on (instance, job, peer, leaf) {same_leaf}\n)")},
        {"record": LEAF_CROSS_RATIO,
         "expr": f"{LEAF_CROSS_BW}\n/ on (job, leaf) {LEAF_INTRA_BW}"},
    ]


def _pair_leaves() -> str:
    """One series (value 1) per pair of gpunet_fleet_pair_info with labels instance, job, peer,
    leaf (this node's), peer_leaf and cross_leaf: "false" when the two leaves are the same,
    "true" when they differ, absent when either is unknown (empty)."""
    def both(pad: str) -> str:
        return (f"group by (instance, job, peer, peer_leaf, leaf) (\n{pad}  "
                "gpunet_fleet_pair_info * on (instance, job) group_left (leaf) "
                f"gpunet_fleet_node_info\n{pad})")

    same = ('label_replace(gpunet_fleet_pair_info{peer_leaf!=""}, "leaf", "$1", "peer_leaf", '
            '"(.*)")')
    return (f'label_replace(\n  {both("  ")}\n  and on (instance, job, peer, leaf)\n'
            f'  {same},\n  "cross_leaf", "false", "", ""\n)\n'
            "or on (instance, job, peer)\n"
            f'label_replace(\n  label_replace(\n    {both("    ")},\n'
            '    "cross_leaf", "true", "peer_leaf", ".+"\n  ),\n'
            '  "cross_leaf", "", "leaf", ""\n)')


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)

HEADER = """\
# Prometheus rules for gpunet-exporter: generated by `gpunet-rules` from the thresholds in
# src/gpunet_exporter/health/thresholds.py; do not edit by hand. To change a threshold or a `for:`
# duration, write a thresholds file with only what differs and run
# `gpunet-rules --thresholds FILE > rules.yml`.
# Each alert's runbook: docs/runbooks.md. Load with `rule_files:` in prometheus.yml.
"""


def dump_yaml(doc: Any) -> str:
    """YAML as the rules file writes it: keys in order, multi-line strings as literal blocks
    (kubernetes/generate_manifests.py writes its manifests with it too)."""
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100,
                     default_flow_style=False, allow_unicode=True)


def render(t: T) -> str:
    return HEADER + dump_yaml(rule_groups(t))


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog="gpunet-rules", description="Print gpunet-exporter's Prometheus rules.")
    p.add_argument("--thresholds", metavar="FILE",
                   help="YAML file overriding thresholds and `for:` durations (default: the "
                        "built-in ones, docs/runbooks.md)")
    p.add_argument("--output", "-o", metavar="FILE",
                   help="write here (default: standard output)")
    p.add_argument("--check", metavar="FILE",
                   help="exit 1 when FILE differs from what would be generated")
    args = p.parse_args(argv)
    try:
        text = render(load(args.thresholds, ALERT_NAMES))
    except ConfigError as exc:
        print(f"gpunet-rules: {exc}", file=sys.stderr)
        return 2
    if args.check:
        try:  # a regular file, never a FIFO that would block, nor more than 1 MiB
            data = read_regular(args.check)
        except ConfigError as exc:
            print(f"gpunet-rules: cannot read {args.check}: "
                  f"{str(exc).removeprefix('cannot read: ')}", file=sys.stderr)
            return 2
        try:  # newlines as open() in text mode reads them
            current = data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        except UnicodeDecodeError:
            current = None  # not what we write
        if current != text:
            print(f"gpunet-rules: {args.check} is stale; regenerate it with gpunet-rules",
                  file=sys.stderr)
            return 1
        return 0
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            print(f"gpunet-rules: cannot write {args.output}: {exc.strerror}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    return 0


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
