"""The link alerts: port state, rate, errors, MTU; and the doctor's checks of them."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gpunet_exporter.mixin.alerts import collective
from gpunet_exporter.mixin.alerts.common import IF, NODE, PORT, ROCE_INTERFACE, Alert, simple
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.check import (
    Check,
    DoctorCheck,
    Labels,
    Note,
    Simple,
    checks,
    port,
    seconds,
)
from gpunet_exporter.mixin.thresholds import Thresholds


def _port_with_interface(expr: str) -> str:
    """``expr`` (labels instance, device, port) with the port's netdev as ``interface``, so
    Alertmanager can inhibit the interface's alerts too; unchanged where there is no info."""
    info = 'gpunet_infiniband_port_info{interface!=""}'
    return (f"(\n  {expr}\n) * on (instance, device, port) group_left (interface) {info}\n"
            f"or on (instance, device, port)\n(\n  {expr}\n)")


def _port_counter(what: str) -> Callable[[Check, Labels, float, float], str]:
    return lambda c, lbl, v, limit: f"{v:.4g} {what} (limit {limit:g})"


def _perfquery(lbl: Labels) -> str:
    return f"perfquery -x  # {lbl['device']} port {lbl['port']}, twice"


# --- alerts of a simple shape: the PromQL and the doctor's check from one declaration ---------
SYMBOL_ERRORS = Simple(
    "GpunetPortSymbolErrors", "gpunet_infiniband_port_symbol_errors_total", ">",
    "infiniband.symbol_errors_per_hour", "link", port,
    _port_counter("symbol errors per hour"), _perfquery, window="1h", increase=True)
LINK_ERROR_RECOVERIES = Simple(
    "GpunetPortLinkErrorRecoveries", "gpunet_infiniband_port_link_error_recoveries_total", ">",
    "infiniband.link_error_recoveries_per_minute", "link", port,
    _port_counter("link retrains per minute"), _perfquery, window="5m", per=60)
RECEIVE_ERRORS = Simple(
    "GpunetPortReceiveErrors", "gpunet_infiniband_port_receive_errors_total", ">",
    "infiniband.receive_errors_per_second", "link", port,
    _port_counter("receive errors per second"), _perfquery, window="5m")
TRANSMIT_DISCARDS = Simple(
    "GpunetPortTransmitDiscards", "gpunet_infiniband_port_transmit_discards_total", ">",
    "infiniband.transmit_discards_per_second", "link", port,
    _port_counter("transmit discards per second"), _perfquery, window="5m")
COUNTER_SATURATED = Simple(
    "GpunetPortCounterSaturated", "gpunet_infiniband_port_pma_saturated", "==", 1, "link", port,
    lambda c, lbl, v, limit: (f"counter {lbl['counter']} stuck at its maximum; its errors are "
                              "invisible"),
    lambda lbl: "perfquery -R  # clears the port's counters")


def _missing(c: Check, lbl: Labels, v: float, limit: float) -> str:
    kind = lbl["kind"]
    names = sorted(m["name"] for m, _ in c.b.all("gpunet_inventory_missing_info", kind=kind))
    return f"{v:.0f} expected {kind} gone" + (f": {', '.join(names)}" if names else "")


# Devices, ports and netdevs expected (configured or learned by the exporter, whose state file
# the doctor reads and never writes) and gone.
DEVICES_MISSING = Simple(
    "GpunetRdmaDeviceMissing", "gpunet_inventory_missing", ">", 0, "inventory",
    lambda lbl: lbl["kind"], _missing,
    lambda lbl: "ls /sys/class/infiniband; ibv_devices; lspci -d 15b3:")


# --- hand-written checks: joins, and the flap history -----------------------------------------
@checks("GpunetPortDown")
def check_port_down(c: Check) -> None:
    b = c.b
    phys = {(lbl["device"], lbl["port"]): v for lbl, v in b.all(
        "gpunet_infiniband_port_phys_state_id")}
    for lbl, state in b.all("gpunet_infiniband_port_state_id"):
        p = phys.get((lbl["device"], lbl["port"]))
        if state != 4 or (p is not None and p != 5):
            c.add("link", "GpunetPortDown", port(lbl),
                  f"not ACTIVE/LinkUp (state {state:.0f}, physical state "
                  f"{'?' if p is None else f'{p:.0f}'})",
                  f"ibstat {lbl['device']} {lbl['port']}")


@checks("GpunetPortRateBelowExpected")
def check_port_rate(c: Check) -> None:
    b = c.b
    for lbl, v in b.all("gpunet_infiniband_port_rate_degraded"):
        if v == 1:
            rate = b.get("gpunet_infiniband_port_rate_bytes_per_second", **lbl) or 0
            want = b.get("gpunet_infiniband_port_rate_expected_bytes_per_second", **lbl) or 0
            c.add("link", "GpunetPortRateBelowExpected", port(lbl),
                  f"runs at {rate * 8 / 1e9:g} Gb/s, expected {want * 8 / 1e9:g} Gb/s",
                  f"cat /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/rate")


@checks("GpunetPortFlapping", "GpunetInterfaceFlapping")
def check_flapping_now(c: Check) -> None:
    """A flap during the check's own seconds (check_flap_history counts those since earlier
    runs, as the alerts count them over hours)."""
    for lbl, r in c.rate("gpunet_infiniband_port_link_downed_total"):
        if r > 0:
            c.add("link", "GpunetPortFlapping", port(lbl), "went down during the check",
                  f"perfquery -x (on {lbl['device']} port {lbl['port']}); dmesg | grep -i mlx5")
    for lbl, r in c.rate("gpunet_link_carrier_changes_total"):
        if r > 0:
            c.add("link", "GpunetInterfaceFlapping", lbl["interface"],
                  "carrier changed during the check", f"ip -s link show {lbl['interface']}")


@checks("GpunetNicPcieLinkDegraded")
def check_nic_pcie(c: Check) -> None:
    b = c.b
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


@checks("GpunetRoceMtuTooSmall", "GpunetInterfaceMtuNotExpected", "GpunetRdmaMtuNotExpected")
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
            c.add("mtu", "GpunetRdmaMtuNotExpected", port(lbl),
                  f"active RDMA MTU {mtu:.0f}, expected {want:.0f}",
                  f"ibv_devinfo -d {lbl['device']} -i {lbl['port']} | grep active_mtu")


# PHY counters of ethtool -S behind GpunetInterfacePhyErrors, with the driver names to grep.
PHY_ERRORS = (
    ("fec_uncorrected_symbol_errors", "FEC-uncorrected symbol errors", "rx_pcs_symbol_err_phy"),
    ("symbol_errors", "symbol errors", "rx_symbol_err_phy|symbol_err"),
    ("crc_errors", "CRC errors", "rx_crc_errors_phy"),
)


@checks("GpunetInterfacePhyErrors")
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


def flap_key(kind: str, lbl: Labels) -> tuple[str, str]:
    """The state file's key of a series and where the report says it is."""
    if kind == "link_downed":
        return f"{lbl.get('device')}/{lbl.get('port')}", port(lbl)
    return lbl.get("interface", ""), lbl.get("interface", "")


def since_reset(obs: list[list[float]], v: float) -> list[list[float]]:
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


@checks("GpunetPortFlapping", "GpunetInterfaceFlapping")
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
            key, where = flap_key(kind, lbl)
            if (alert, where) in found:
                continue  # it changed during the check: check_flapping_now reported it
            obs = since_reset(past.get(key, []), v)
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


# --- modules and NIC firmware (the nic collector): against the module's own thresholds --------
_XCVR = "gpunet_nic_transceiver"
RX_POWER_LOW = (f"{_XCVR}_rx_power_watts\n  < on (instance, interface) group_left ()\n  "
                f'{_XCVR}_rx_power_threshold_watts{{level="low_warning"}}\n'
                "and on (instance, interface) gpunet_link_carrier == 1")
TEMPERATURE_HIGH = (f"{_XCVR}_temperature_celsius\n  > on (instance, interface) "
                    f'group_left ()\n  {_XCVR}_temperature_threshold_celsius'
                    '{level="high_warning"}')


def _dbm(watts: float) -> str:
    return f"{10 * math.log10(watts * 1000):.1f} dBm" if watts > 0 else "no light"


@checks("GpunetTransceiverRxPowerLow")
def check_rx_power(c: Check) -> None:
    b = c.b
    for lbl, v in b.all(f"{_XCVR}_rx_power_watts"):
        ifname = lbl["interface"]
        low = b.get(f"{_XCVR}_rx_power_threshold_watts", interface=ifname, level="low_warning")
        if low is not None and v < low and b.get("gpunet_link_carrier", interface=ifname) == 1:
            c.add("nic_health", "GpunetTransceiverRxPowerLow", f"{ifname} lane {lbl['lane']}",
                  f"receives {_dbm(v)}, below the module's low warning {_dbm(low)}",
                  f"sudo ethtool -m {ifname}")


@checks("GpunetTransceiverTemperatureHigh")
def check_module_temperature(c: Check) -> None:
    b = c.b
    for lbl, v in b.all(f"{_XCVR}_temperature_celsius"):
        ifname = lbl["interface"]
        high = b.get(f"{_XCVR}_temperature_threshold_celsius", interface=ifname,
                     level="high_warning")
        if high is not None and v > high:
            c.add("nic_health", "GpunetTransceiverTemperatureHigh", ifname,
                  f"module at {v:.1f} C, above its high warning {high:g} C",
                  f"sudo ethtool -m {ifname}")


HEALTH_REPORTER_ERROR = Simple(
    "GpunetNicHealthReporterError", "gpunet_nic_health_reporter_healthy", "==", 0,
    "nic_health", lambda lbl: f"{lbl['device'] or lbl['handle']} {lbl['reporter']}",
    lambda c, lbl, v, limit: (f"devlink health reporter {lbl['reporter']} of "
                              f"{lbl['handle']} in error state, not recovered"),
    lambda lbl: (f"devlink health diagnose {lbl['handle']} reporter {lbl['reporter']}"))
HEALTH_REPORTER_RECOVERING = Simple(
    "GpunetNicHealthReporterRecovering", "gpunet_nic_health_reporter_recoveries_total", ">=",
    "link.nic_recoveries_per_hour", "nic_health",
    lambda lbl: f"{lbl['device'] or lbl['handle']} {lbl['reporter']}",
    lambda c, lbl, v, limit: (f"devlink health reporter {lbl['reporter']} of {lbl['handle']} "
                              f"recovers {v:.3g} times per hour (limit {limit:g})"),
    lambda lbl: (f"devlink health show {lbl['handle']} reporter {lbl['reporter']}; "
                 "dmesg | grep -i mlx5"), window="1h", increase=True)


def _fleet_link_slow(t: Thresholds) -> str:
    """A pair slow or failed while this node has a healthy pair, unless the peer is the
    suspect (GpunetFleetNodeSuspect on the peer's own exporter, found through its name in
    gpunet_fleet_node_info): then that alert names it and its pairs are not blamed as links.
    The alert carries the pair's leaf, peer_leaf and cross_leaf (gpunet_fleet_pair_info) for
    Alertmanager's inhibition."""
    suspect = collective.node_suspect(t).replace("\n", "\n      ")
    return (f"(\n  (\n    {collective.PAIR_SLOW}\n"
            f"    or on (instance, job, peer)\n    0 * ({collective.PAIR_OK} == 0)\n  )\n"
            f"  and on (instance, job) {collective.NODE_PAIRS_HEALTHY} >= 1\n"
            "  unless on (job, peer) label_replace(\n"
            f"    (\n      {suspect}\n    )\n"
            f"    * on (instance, job) group_left (name) {collective.NODE_INFO},\n"
            '    "peer", "$1", "name", "(.+)"\n  )\n)\n'
            # The leaves, for Alertmanager: GpunetFleetCrossLeafSlow inhibits cross-leaf pairs.
            "* on (instance, job, peer) group_left (leaf, peer_leaf, cross_leaf) "
            f"{collective.PAIR_INFO}")


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
    simple("GpunetPortSymbolErrors", "link", "warning", "0m", SYMBOL_ERRORS,
           "RDMA port above the symbol-error budget",
           f"RDMA port {PORT} counted {{{{ $value | printf \"%.0f\" }}}} symbol errors in the "
           "last hour, above the bit-error-rate budget."),
    simple("GpunetPortLinkErrorRecoveries", "link", "warning", "0m", LINK_ERROR_RECOVERIES,
           "RDMA port retraining its link",
           f"RDMA port {PORT} retrains its link {{{{ $value | humanize }}}} times per "
           "minute."),
    simple("GpunetPortReceiveErrors", "link", "warning", "10m", RECEIVE_ERRORS,
           "RDMA port receiving packets with errors",
           f"RDMA port {PORT} receives {{{{ $value | humanize }}}} packets with errors per "
           "second."),
    simple("GpunetPortTransmitDiscards", "link", "warning", "10m", TRANSMIT_DISCARDS,
           "RDMA port discarding packets on transmit",
           f"RDMA port {PORT} discards {{{{ $value | humanize }}}} packets per second on "
           "transmit."),
    simple("GpunetPortCounterSaturated", "link", "warning", "1h", COUNTER_SATURATED,
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
    simple("GpunetRdmaDeviceMissing", "link", "critical", "5m", DEVICES_MISSING,
           "RDMA devices, ports or netdevs gone",
           f"{{{{ $value }}}} {{{{ $labels.kind }}}} expected {NODE} are gone (fallen off the "
           "bus, driver unloaded); gpunet_inventory_missing_info names those learned earlier. "
           "Their ports have no series, so no port alert can fire for them."),
    # The pair plan's view of a link, from the statistics of mixin.alerts.collective.
    Alert("GpunetFleetLinkSlow", "link", "warning", "5m", _fleet_link_slow,
          "Pair slow between two otherwise healthy nodes",
          "The pair {{ $labels.instance }} to {{ $labels.peer }} reaches {{ $value | "
          "humanizePercentage }} of the fleet's median node bandwidth (0% when it failed), "
          "while both ends have healthy pairs: the link between them (cable, ports, switch "
          "path) is the suspect."),
    Alert("GpunetTransceiverRxPowerLow", "link", "warning", "5m", lambda t: RX_POWER_LOW,
          "Transceiver lane receives too little light",
          "Lane {{ $labels.lane }} of the module of " + IF + " receives {{ $value | "
          "humanize }}W, below the module's own low warning threshold while the link is up: "
          "a dirty or damaged fibre or connector, or a failing far-end transmitter (errors and "
          "flaps follow)."),
    Alert("GpunetTransceiverTemperatureHigh", "link", "warning", "5m",
          lambda t: TEMPERATURE_HIGH,
          "Transceiver above its high temperature warning",
          "The module of " + IF + " is at {{ $value }} C, above its own high warning "
          "threshold: airflow, a failing module, or a neighbour's heat; at its alarm "
          "threshold it may shut its laser down."),
    simple("GpunetNicHealthReporterError", "link", "warning", "2m", HEALTH_REPORTER_ERROR,
           "NIC devlink health reporter in error",
           "devlink health reporter {{ $labels.reporter }} of {{ $labels.handle }} "
           "(RDMA device {{ $labels.device }}) " + NODE + " is in error state and was not "
           "recovered (firmware fatal error, stuck send or receive queue)."),
    simple("GpunetNicHealthReporterRecovering", "link", "warning", "0m",
           HEALTH_REPORTER_RECOVERING, "NIC devlink health reporter recovering again and again",
           "devlink health reporter {{ $labels.reporter }} of {{ $labels.handle }} (RDMA "
           "device {{ $labels.device }}) " + NODE + " recovered {{ $value | printf \"%.0f\" }} "
           "times in the last hour: the error it recovers from keeps coming back."),
)

# The doctor's checks, in steps (mixin.alerts.DOCTOR_ORDER interleaves the classes' steps in the
# order the doctor runs them, which is the order of its --json findings).
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {
    "links": (check_port_down, check_port_rate, check_flapping_now, SYMBOL_ERRORS,
              LINK_ERROR_RECOVERIES, RECEIVE_ERRORS, TRANSMIT_DISCARDS, COUNTER_SATURATED,
              check_nic_pcie),
    "mtu": (check_mtu,),
    "phy": (check_phy,),
    "flap_history": (check_flap_history,),
    "inventory": (DEVICES_MISSING,),
    "nic": (check_rx_power, check_module_temperature, HEALTH_REPORTER_ERROR,
            HEALTH_REPORTER_RECOVERING),
}
# Node-level alerts the doctor cannot check, and why.
UNCHECKED: dict[str, str] = {
    "GpunetFleetLinkSlow": "the pair plan's fleet statistics: no node sees them alone",
}
