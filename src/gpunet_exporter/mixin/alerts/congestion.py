"""The congestion alerts: PFC, pause, ECN."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import IF, PORT, ROCE_INTERFACE, Alert
from gpunet_exporter.mixin.alerts.common import number as _g

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
    Alert("GpunetPauseDurationHigh", "congestion", "warning", "10m",
          lambda t: ("rate(gpunet_pfc_pause_duration_seconds_total[5m]) > "
                     f"{_g(t.pfc.pause_ratio)}"),
          "Interface paused for a large share of time",
          f"Interface {IF} spends {{{{ $value | humanizePercentage }}}} of the time paused "
          "({{ $labels.direction }}) on priority {{ $labels.priority }}."),
    Alert("GpunetEcnMarksHigh", "congestion", "warning", "15m",
          lambda t: ("rate(gpunet_infiniband_port_hw_np_ecn_marked_roce_packets_total[5m]) > "
                     f"{_g(t.pfc.ecn_marked_packets_per_second)}"),
          "Many ECN-marked RoCE packets",
          f"RDMA port {PORT} receives {{{{ $value | humanize }}}} ECN-marked RoCE packets per "
          "second: the fabric is congested on the way to this node."),
    Alert("GpunetCnpsHigh", "congestion", "warning", "15m",
          lambda t: ("rate(gpunet_infiniband_port_hw_rp_cnp_handled_total[5m]) > "
                     f"{_g(t.pfc.cnp_handled_per_second)}"),
          "Many congestion notifications received",
          f"RDMA port {PORT} slows its senders on {{{{ $value | humanize }}}} CNPs per "
          "second: its traffic meets congestion."),
    Alert("GpunetCnpsIgnored", "congestion", "warning", "10m",
          lambda t: "increase(gpunet_infiniband_port_hw_rp_cnp_ignored_total[10m]) > 0",
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
