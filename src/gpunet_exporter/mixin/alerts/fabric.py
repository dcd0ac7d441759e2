"""The fabric alerts."""

from __future__ import annotations

from gpunet_exporter.localize import AMBIGUOUS, SUSPECT
from gpunet_exporter.mixin.alerts.common import Alert
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.thresholds import Thresholds


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


def _fabric_receive_errors(t: Thresholds) -> str:
    """Receive errors of a switch port, and packets it received already marked bad upstream,
    each with its counter's name in ``counter``."""
    limit = _g(t.infiniband.receive_errors_per_second)
    parts = [f'label_replace(\n    rate(gpunet_fabric_port_{m}_total[5m]) > {limit},\n'
             f'    "counter", "{m}", "", ""\n  )'
             for m in ("receive_errors", "receive_remote_physical_errors")]
    return _fabric_port("\n  or\n  ".join(parts))


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
              f"{_g(t.infiniband.symbol_errors_per_hour)}"),
          "Switch port above the symbol-error budget",
          f"{_SWPORT} counted {{{{ $value | printf \"%.0f\" }}}} symbol errors in the last hour, "
          f"above the bit-error-rate budget. {_SWEPT}"),
    Alert("GpunetFabricPortLinkErrorRecoveries", "fabric", "warning", "0m",
          lambda t: _fabric_port(
              "rate(gpunet_fabric_port_link_error_recoveries_total[5m]) * 60 > "
              f"{_g(t.infiniband.link_error_recoveries_per_minute)}"),
          "Switch port retraining its link",
          f"{_SWPORT} retrains its link {{{{ $value | humanize }}}} times per minute. {_SWEPT}"),
    Alert("GpunetFabricPortFlapping", "fabric", "warning", "0m",
          lambda t: _fabric_port(
              "increase(gpunet_fabric_port_link_downed_total"
              f"[{t.infiniband.link_downed_window}]) >= "
              f"{t.infiniband.link_downed_count}"),
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
              f"{_g(t.infiniband.transmit_discards_per_second)}"),
          "Switch port discarding packets on transmit",
          f"{_SWPORT} discards {{{{ $value | humanize }}}} packets per second on transmit: "
          f"congestion behind it, or a link going down. {_SWEPT}"),
    Alert("GpunetFabricUplinkImbalance", "fabric", "warning", "15m",
          lambda t: _fabric_switch(
              "gpunet_fabric_leaf_uplink_imbalance_ratio > "
              f"{_g(t.fabric.uplink_imbalance_ratio)}"),
          "Leaf switch's uplink traffic unevenly spread",
          f"The busiest uplink of leaf {_SWITCH} carries {{{{ $value | humanizePercentage }}}} "
          "more {{ $labels.direction }} traffic than the mean of its uplinks: flows crowd onto "
          f"some uplinks while others idle. {_SWEPT}"),
    Alert("GpunetFabricLeafOversubscribed", "fabric", "warning", "15m",
          lambda t: _fabric_switch(
              "gpunet_fabric_leaf_oversubscription_ratio > "
              f"{_g(t.fabric.leaf_oversubscription_ratio)}"),
          "Leaf switch oversubscribed",
          f"Leaf {_SWITCH} has {{{{ $value | printf \"%.3g\" }}}} times more host-facing "
          "capacity than uplink capacity (its active ports, width x speed), above the limit "
          "(fabric.leaf_oversubscription_ratio): uplinks down or trained narrower leave its "
          f"hosts' cross-leaf traffic too little room. {_SWEPT}"),
    Alert("GpunetFabricRoutingUnbalanced", "fabric", "warning", "15m",
          lambda t: _fabric_switch(
              "gpunet_fabric_leaf_routes_imbalance_ratio\n"
              "  and on (instance, switch) gpunet_fabric_leaf_routes_unbalanced == 1"),
          "Leaf switch's forwarding table unbalanced",
          f"The forwarding table of leaf {_SWITCH} sends more than one host LID more out of one "
          "uplink than out of another; its busiest uplink routes "
          f"{{{{ $value | humanizePercentage }}}} more host LIDs than the mean. {_SWEPT}"),
    Alert("GpunetFabricPathSuspect", "fabric", "warning", "5m",
          lambda t: _fabric_port(
              'gpunet_fabric_link_probe_pairs{result="unhealthy"}\n'
              "  * on (instance, switch, port) group_left (verdict)\n"
              f'  gpunet_fabric_link_verdict{{verdict=~"{SUSPECT}|{AMBIGUOUS}"}}\n'
              f"  >= {t.fabric.path_min_pairs}"),
          "Slow fleet pairs share a switch-to-switch cable",
          f"{_SWPORT} is {{{{ if eq $labels.verdict \"{SUSPECT}\" }}}}the one cable"
          "{{ else }}one of several cables, in the same paths and not told apart,{{ end }} that "
          "{{ $value }} slow or failed fleet pairs share while no healthy pair crosses it "
          "(the forwarding tables' paths joined with the pair results): a degraded or "
          f"congested link between two switches. {_SWEPT}"),
    Alert("GpunetFabricSweepFailing", "fabric", "warning", "15m",
          lambda t: ("gpunet_fabric_step_success == 0\n"
                     "or on (instance, job)\ngpunet_fabric_sweep_success == 0"),
          "Fabric sweep failing",
          "The fabric sweep on {{ $labels.instance }} fails{{ with $labels.step }} at its "
          "{{ . }} step{{ end }}: the fabric alerts judge the values of its last good sweep."),
    Alert("GpunetFabricSweepStale", "fabric", "warning", "0m",
          lambda t: ("time() - gpunet_fabric_sweep_last_success_timestamp_seconds > "
                     f"{_g(t.fabric.stale_seconds)}"),
          "No recent successful fabric sweep",
          "The last successful fabric sweep on {{ $labels.instance }} ended {{ $value | "
          "humanizeDuration }} ago: the fabric alerts judge old values."),
)
# Alerts the doctor cannot check, and why.
UNCHECKED: dict[str, str] = {a.name: "the fabric's switches, read by the subnet manager's "
                             "node, not by this node" for a in ALERTS}
