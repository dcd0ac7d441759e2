"""The link alerts: port state, rate, errors, MTU."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import IF, NODE, PORT, ROCE_INTERFACE, Alert
from gpunet_exporter.mixin.alerts.common import number as _g


def _port_with_interface(expr: str) -> str:
    """``expr`` (labels instance, device, port) with the port's netdev as ``interface``, so
    Alertmanager can inhibit the interface's alerts too; unchanged where there is no info."""
    info = 'gpunet_infiniband_port_info{interface!=""}'
    return (f"(\n  {expr}\n) * on (instance, device, port) group_left (interface) {info}\n"
            f"or on (instance, device, port)\n(\n  {expr}\n)")


ALERTS: tuple[Alert, ...] = (
    Alert("GpunetPortDown", "link", "critical", "2m",
          lambda t: _port_with_interface(
              "gpunet_infiniband_port_state_id\n  and on (instance, device, port)\n  "
              "(gpunet_infiniband_port_state_id != 4 or gpunet_infiniband_port_phys_state_id "
              "!= 5)"),
          "RDMA port not ACTIVE or not LinkUp",
          f"RDMA port {PORT} is not ACTIVE/LinkUp (logical state {{{{ $value }}}}; 4 is "
          "ACTIVE). Its traffic moves to the node's other ports or fails."),
    Alert("GpunetPortRateBelowExpected", "link", "critical", "5m",
          lambda t: ("gpunet_infiniband_port_rate_bytes_per_second * 8 / 1e9\n"
                     "  and on (instance, device, port) gpunet_infiniband_port_rate_degraded == 1"),
          "RDMA port trained below its expected rate",
          f"RDMA port {PORT} runs at {{{{ $value }}}} Gb/s, below the rate expected for it "
          "(gpunet_infiniband_port_rate_expected_bytes_per_second)."),
    Alert("GpunetPortFlapping", "link", "warning", "0m",
          lambda t: ("increase(gpunet_infiniband_port_link_downed_total"
                     f"[{t.infiniband.link_downed_window}]) >= "
                     f"{t.infiniband.link_downed_count}"),
          "RDMA port flapping",
          f"RDMA port {PORT} went down {{{{ $value | printf \"%.0f\" }}}} times recently "
          "(gpunet_infiniband_port_link_downed_total)."),
    Alert("GpunetInterfaceFlapping", "link", "warning", "0m",
          lambda t: ("increase(gpunet_link_carrier_changes_total"
                     f"[{t.infiniband.carrier_changes_window}]) >= "
                     f"{t.infiniband.carrier_changes_count}"),
          "Network interface carrier flapping",
          f"Interface {IF} changed carrier {{{{ $value | printf \"%.0f\" }}}} times recently "
          "(gpunet_link_carrier_changes_total)."),
    Alert("GpunetPortSymbolErrors", "link", "warning", "0m",
          lambda t: ("increase(gpunet_infiniband_port_symbol_errors_total[1h]) > "
                     f"{_g(t.infiniband.symbol_errors_per_hour)}"),
          "RDMA port above the symbol-error budget",
          f"RDMA port {PORT} counted {{{{ $value | printf \"%.0f\" }}}} symbol errors in the "
          "last hour, above the bit-error-rate budget."),
    Alert("GpunetPortLinkErrorRecoveries", "link", "warning", "0m",
          lambda t: ("rate(gpunet_infiniband_port_link_error_recoveries_total[5m]) * 60 > "
                     f"{_g(t.infiniband.link_error_recoveries_per_minute)}"),
          "RDMA port retraining its link",
          f"RDMA port {PORT} retrains its link {{{{ $value | humanize }}}} times per "
          "minute."),
    Alert("GpunetPortReceiveErrors", "link", "warning", "10m",
          lambda t: ("rate(gpunet_infiniband_port_receive_errors_total[5m]) > "
                     f"{_g(t.infiniband.receive_errors_per_second)}"),
          "RDMA port receiving packets with errors",
          f"RDMA port {PORT} receives {{{{ $value | humanize }}}} packets with errors per "
          "second."),
    Alert("GpunetPortTransmitDiscards", "link", "warning", "10m",
          lambda t: ("rate(gpunet_infiniband_port_transmit_discards_total[5m]) > "
                     f"{_g(t.infiniband.transmit_discards_per_second)}"),
          "RDMA port discarding packets on transmit",
          f"RDMA port {PORT} discards {{{{ $value | humanize }}}} packets per second on "
          "transmit."),
    Alert("GpunetPortCounterSaturated", "link", "warning", "1h",
          lambda t: "gpunet_infiniband_port_pma_saturated == 1",
          "RDMA port error counter stuck at its maximum",
          f"Counter {{{{ $labels.counter }}}} of RDMA port {PORT} sits at its maximum, so its "
          "rate reads 0 and its alert cannot fire."),
    Alert("GpunetRoceMtuTooSmall", "link", "warning", "10m",
          lambda t: (f"gpunet_link_mtu_bytes < {t.link.roce_min_mtu_bytes}\n"
                     f"  and on (instance, interface) {ROCE_INTERFACE}"),
          "RoCE interface MTU too small for 4096-byte RDMA frames",
          f"RoCE interface {IF} has MTU {{{{ $value }}}}, so RDMA runs with a smaller path MTU "
          "than 4096."),
    Alert("GpunetInterfaceMtuNotExpected", "link", "warning", "10m",
          lambda t: ("gpunet_link_mtu_bytes\n"
                     "  and on (instance, interface) gpunet_link_mtu_mismatch == 1"),
          "Interface MTU is not the expected one",
          f"Interface {IF} has MTU {{{{ $value }}}}, not the one configured as expected "
          "(gpunet_link_mtu_expected_bytes)."),
    Alert("GpunetRdmaMtuNotExpected", "link", "warning", "10m",
          lambda t: ("gpunet_link_rdma_active_mtu_bytes\n"
                     "  and on (instance, device, port) gpunet_link_rdma_mtu_mismatch == 1"),
          "RDMA active MTU is not the expected one",
          f"RDMA port {PORT} has active MTU {{{{ $value }}}}, not the one configured as "
          "expected (gpunet_link_rdma_mtu_expected_bytes)."),
    Alert("GpunetInterfacePhyErrors", "link", "warning", "0m",
          lambda t: ("(\n  " + "\n  or\n  ".join(
              f"increase(gpunet_pfc_{m}_total[1h]) > {_g(t.link.phy_errors_per_hour)}"
              for m in ("fec_uncorrected_symbol_errors", "symbol_errors", "crc_errors"))
              + f"\n)\nand on (instance, interface) {ROCE_INTERFACE}"),
          "RoCE interface above the physical-layer error budget",
          f"RoCE interface {IF} counted {{{{ $value | printf \"%.0f\" }}}} symbol, CRC or "
          "FEC-uncorrected errors in the last hour (ethtool -S), above the bit-error-rate "
          "budget."),
    Alert("GpunetNicPcieLinkDegraded", "link", "warning", "10m",
          lambda t: ('max without (end) (gpunet_topology_nic_pcie_link_width_lanes{end="device"})\n'
                     "  and on (instance, device) gpunet_topology_nic_pcie_link_degraded == 1"),
          "RDMA NIC's PCIe link trained down",
          "RDMA device {{ $labels.device }} " + NODE + " runs its PCIe link (now x{{ $value }}) "
          "slower or narrower than both its ends allow: the NIC cannot reach its line rate (x8 "
          "halves a 400G NIC)."),
    Alert("GpunetRdmaDeviceMissing", "link", "critical", "5m",
          lambda t: "gpunet_inventory_missing > 0",
          "RDMA devices, ports or netdevs gone",
          f"{{{{ $value }}}} {{{{ $labels.kind }}}} expected {NODE} are gone (fallen off the "
          "bus, driver unloaded); gpunet_inventory_missing_info names those learned earlier. "
          "Their ports have no series, so no port alert can fire for them."),
)
