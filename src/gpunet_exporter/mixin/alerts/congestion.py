"""The congestion alerts: PFC, pause, ECN; and the doctor's checks of them."""

from __future__ import annotations

from collections.abc import Callable

from gpunet_exporter.mixin.alerts.common import IF, PORT, ROCE_INTERFACE, Alert, simple
from gpunet_exporter.mixin.check import Check, DoctorCheck, Labels, Simple, checks, port


@checks("GpunetPfcDisabledOnRocePriority")
def check_pfc_disabled(c: Check) -> None:
    prio = str(c.t.pfc.roce_priority)
    roce = c.roce_interfaces()
    for lbl, v in c.b.all("gpunet_pfc_enabled", priority=prio):
        if v == 0 and lbl["interface"] in roce:
            c.add("pfc", "GpunetPfcDisabledOnRocePriority", lbl["interface"],
                  f"PFC off on priority {prio}, the one RoCE uses",
                  f"mlnx_qos -i {lbl['interface']}  # or: dcb pfc show dev {lbl['interface']}")


@checks("GpunetPfcTrustNotExpected")
def check_trust(c: Check) -> None:
    want = c.t.pfc.trust
    for lbl, _ in c.b.all("gpunet_pfc_config_info"):
        trust = lbl.get("trust", "")
        if trust and trust != want:
            c.add("pfc", "GpunetPfcTrustNotExpected", lbl["interface"],
                  f"trusts {trust}, expected {want}", f"mlnx_qos -i {lbl['interface']}")


@checks("GpunetPauseWithoutPfc")
def check_pause_without_pfc(c: Check) -> None:
    for lbl, r in c.rate("gpunet_pfc_pause_frames_total"):
        on = c.b.get("gpunet_pfc_enabled", interface=lbl["interface"], priority=lbl["priority"])
        if r > 0 and on == 0:
            c.add("pfc", "GpunetPauseWithoutPfc", lbl["interface"],
                  f"pause frames ({lbl['direction']}) on priority {lbl['priority']}, where PFC "
                  "is off", f"ethtool -S {lbl['interface']} | grep prio{lbl['priority']}_pause")


@checks("GpunetPauseStorm")
def check_pause_storm(c: Check) -> None:
    for metric in ("pause_storm_error_events", "pause_storm_warning_events"):
        for lbl, r in c.rate(f"gpunet_pfc_{metric}_total"):
            if r > 0:
                c.add("pfc", "GpunetPauseStorm", lbl["interface"], "PFC pause storm detected",
                      f"ethtool -S {lbl['interface']} | grep pause_storm")


def _hw_counter(file: str) -> Callable[[Labels], str]:
    return lambda lbl: (f"cat /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/"
                        f"hw_counters/{file}")


def _per_second(what: str) -> Callable[[Check, Labels, float, float], str]:
    return lambda c, lbl, v, limit: f"{v:.4g} {what} (limit {limit:g})"


# Alerts of a simple shape: the PromQL and the doctor's check from one declaration.
PAUSE_DURATION = Simple(
    "GpunetPauseDurationHigh", "gpunet_pfc_pause_duration_seconds_total", ">", "pfc.pause_ratio",
    "pfc", lambda lbl: lbl["interface"],
    lambda c, lbl, v, limit: (f"paused {v:.0%} of the time ({lbl['direction']}) on priority "
                              f"{lbl['priority']}"),
    lambda lbl: f"ethtool -S {lbl['interface']} | grep pause_duration", window="5m")
ECN_MARKS = Simple(
    "GpunetEcnMarksHigh", "gpunet_infiniband_port_hw_np_ecn_marked_roce_packets_total", ">",
    "pfc.ecn_marked_packets_per_second", "pfc", port,
    _per_second("ECN-marked packets received per second"),
    _hw_counter("np_ecn_marked_roce_packets"), window="5m")
CNPS = Simple(
    "GpunetCnpsHigh", "gpunet_infiniband_port_hw_rp_cnp_handled_total", ">",
    "pfc.cnp_handled_per_second", "pfc", port, _per_second("CNPs handled per second"),
    _hw_counter("rp_cnp_handled"), window="5m")
CNPS_IGNORED = Simple(
    "GpunetCnpsIgnored", "gpunet_infiniband_port_hw_rp_cnp_ignored_total", ">", 0, "pfc", port,
    lambda c, lbl, v, limit: "ignores CNPs: congestion control is off on their priority",
    _hw_counter("rp_cnp_ignored"), window="10m", increase=True)


@checks("GpunetPfcConfigUnreadable")
def check_config_unreadable(c: Check) -> None:
    """Said as a finding and as a problem: the doctor could not check PFC there."""
    b, roce = c.b, c.roce_interfaces()
    for lbl, v in b.all("gpunet_pfc_config_refresh_success"):
        if v == 0 and lbl["interface"] in roce:
            name = lbl["interface"]
            c.add("pfc", "GpunetPfcConfigUnreadable", name,
                  "its QoS configuration cannot be read: PFC not checked there",
                  f"mlnx_qos -i {name}  # or: dcb pfc show dev {name}")
            c.problems.append(f"PFC on {name}: its QoS configuration cannot be read")


ALERTS: tuple[Alert, ...] = (
    Alert("GpunetPfcDisabledOnRocePriority", "congestion", "critical", "5m",
          lambda t: (f'gpunet_pfc_enabled{{priority="{t.pfc.roce_priority}"}} == 0\n'
                     f"  and on (instance, interface) {ROCE_INTERFACE}"),
          "PFC off on the RoCE priority",
          f"PFC is off on priority {{{{ $labels.priority }}}} of RoCE interface {IF}: RoCE "
          "traffic there is not lossless."),
    Alert("GpunetPfcTrustNotExpected", "congestion", "warning", "10m",
          lambda t: f'gpunet_pfc_config_info{{trust!="", trust!="{t.pfc.trust}"}}',
          "Priority trust mode is not the expected one",
          f"Interface {IF} trusts {{{{ $labels.trust }}}} to classify traffic, so RoCE packets "
          "may land on a priority without PFC."),
    Alert("GpunetPauseWithoutPfc", "congestion", "warning", "5m",
          lambda t: ("increase(gpunet_pfc_pause_frames_total[10m]) > 0\n"
                     "  and on (instance, interface, priority) gpunet_pfc_enabled == 0"),
          "Pause frames on a priority without PFC",
          f"Interface {IF} counted {{{{ $value | printf \"%.0f\" }}}} pause frames "
          "({{ $labels.direction }}) in 10 minutes on priority {{ $labels.priority }}, where "
          "PFC is off."),
    Alert("GpunetPauseStorm", "congestion", "critical", "0m",
          lambda t: ("increase(gpunet_pfc_pause_storm_error_events_total[10m]) > 0\n"
                     "or\nincrease(gpunet_pfc_pause_storm_warning_events_total[10m]) > 0"),
          "PFC pause storm",
          f"Interface {IF} detected a PFC pause storm in the last 10 minutes: the NIC kept "
          "pausing its peer for too long."),
    simple("GpunetPauseDurationHigh", "congestion", "warning", "10m", PAUSE_DURATION,
           "Interface paused for a large share of time",
           f"Interface {IF} spends {{{{ $value | humanizePercentage }}}} of the time paused "
           "({{ $labels.direction }}) on priority {{ $labels.priority }}."),
    simple("GpunetEcnMarksHigh", "congestion", "warning", "15m", ECN_MARKS,
           "Many ECN-marked RoCE packets",
           f"RDMA port {PORT} receives {{{{ $value | humanize }}}} ECN-marked RoCE packets per "
           "second: the fabric is congested on the way to this node."),
    simple("GpunetCnpsHigh", "congestion", "warning", "15m", CNPS,
           "Many congestion notifications received",
           f"RDMA port {PORT} slows its senders on {{{{ $value | humanize }}}} CNPs per "
           "second: its traffic meets congestion."),
    simple("GpunetCnpsIgnored", "congestion", "warning", "10m", CNPS_IGNORED,
           "Congestion notifications ignored",
           f"RDMA port {PORT} ignored {{{{ $value | printf \"%.0f\" }}}} CNPs in 10 minutes: "
           "congestion control (DCQCN) is off on the priority they arrive on."),
    Alert("GpunetPfcConfigUnreadable", "congestion", "warning", "10m",
          lambda t: ("gpunet_pfc_config_refresh_success == 0\n"
                     f"  and on (instance, interface) {ROCE_INTERFACE}"),
          "PFC configuration of a RoCE interface cannot be read",
          f"The QoS configuration of RoCE interface {IF} cannot be read "
          "(gpunet_pfc_config_refresh_success {{ $value }}: mlnx_qos, dcb or sysfs fails), so "
          "its PFC alerts judge stale values or none."),
)

# The doctor's checks, in steps (mixin.alerts.DOCTOR_ORDER).
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {
    "pfc": (check_pfc_disabled, check_trust, check_pause_without_pfc, check_pause_storm,
            PAUSE_DURATION, ECN_MARKS, CNPS, CNPS_IGNORED, check_config_unreadable)}
