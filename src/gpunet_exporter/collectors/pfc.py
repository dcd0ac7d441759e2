"""pfc collector: PFC, QoS and ECN of the netdevs behind RoCE ports, joining the configuration with
the per-priority counters ("pause frames on a priority that has no PFC").

The configuration (``mlnx_qos``, iproute2 ``dcb`` or the OFED ``qos/`` files, and ``ecn/``) is
read in a background.Refresher; the counters every scrape through the SIOCETHTOOL ioctl or
``ethtool -S``, mapped by collectors/data/pfc_ethtool.csv. Formats: docs/formats.md §2-4; design
notes: docs/architecture.md, "collectors".
"""

from __future__ import annotations

import errno
import logging
import re
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.background import Fresh, Refresher, add_freshness, last_success_spec
from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec, Scrape
from gpunet_exporter.collectors.tables import load
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.sources import rdma
from gpunet_exporter.sources.commands import CommandError, CommandTimeout, run_command
from gpunet_exporter.sources.ethtool import CommandStatsReader, EthtoolReader, StatsReader
from gpunet_exporter.sources.qos import (
    PRIORITIES,
    QOS_FILES,
    Ecn,
    QosConfig,
    parse_dcb,
    parse_mlnx_qos,
    parse_qos_sysfs,
    read_ecn,
)

SOURCES = ("mlnx_qos", "dcb", "sysfs")

_I = ("interface",)
_ID = ("interface", "direction")
_IPD = ("interface", "priority", "direction")
_ETHTOOL = "ethtool -S <interface> (SIOCETHTOOL)"
_NET = "/sys/class/net/<interface>"

# ---- counter families (the CSV maps driver names to these) -----------------------------------

_COUNTERS: dict[str, tuple[tuple[str, ...], str, str]] = {
    # metric: (labels, unit, help)
    "priority_bytes": (_IPD, "bytes", "Bytes received (rx) or sent (tx) on the 802.1p priority"),
    "priority_packets": (_IPD, "packets", "Packets received or sent on the priority"),
    "priority_discards": (
        _IPD, "packets", "Packets the NIC dropped on the priority for lack of receive buffer"),
    "priority_buffer_discards": (
        _IPD, "packets", "Packets discarded on the priority because no per-host receive buffer "
        "was free"),
    "priority_congestion_discards": (
        _IPD, "packets", "Packets discarded on the priority by congestion (WRED)"),
    "priority_ecn_marked_packets": (
        _IPD, "packets", "Packets the NIC ECN-marked on the priority for per-host congestion"),
    "pause_frames": (
        _IPD, "frames", "PFC pause frames on the priority (rx: the peer paused us)"),
    "pause_duration_seconds": (
        _IPD, "seconds", "Time paused by PFC on the priority (rx: we could not send)"),
    "pause_transitions": (
        _IPD, "transitions", "XOFF to XON transitions of PFC pause on the priority"),
    "priority_other": (
        ("interface", "priority", "counter"), "as the driver counts it",
        "A per-priority NIC statistic this exporter has no curated name for, by driver name"),
    "global_pause_frames": (
        _ID, "frames", "802.3x link-level (global) pause frames"),
    "global_pause_duration_seconds": (
        _ID, "seconds", "Time paused by 802.3x link-level pause (microseconds in the driver)"),
    "global_pause_transitions": (
        _ID, "transitions", "XOFF to XON transitions of 802.3x link-level pause"),
    "pause_storm_warning_events": (
        _I, "events", "Times the NIC sent pause for longer than the stall warning threshold"),
    "pause_storm_error_events": (
        _I, "events", "Times the NIC hit the pause stall timeout and stopped sending pause"),
    "pause_control_frames": (
        _ID, "frames", "MAC pause control frames (PFC or global, all priorities) on the physical "
        "port"),
    "port_discards": (
        _ID, "packets", "Packets the physical port discarded"),
    "out_of_buffer": (
        _I, "packets", "Packets dropped because an Ethernet (not RDMA) receive queue had no buffer "
        "posted"),
    "link_down_events": (_I, "events", "Times the physical link went down"),
    "crc_errors": (_I, "packets", "Packets received with a bad FCS on the physical port"),
    "symbol_errors": (_I, "errors", "Symbol errors received on the physical port"),
    "buffer_passed_threshold_events": (
        _I, "events", "Times the port's receive buffer filled past 85 percent"),
    "fec_corrected_bit_errors": (
        _I, "bit errors", "Bits corrected by FEC (RS or FC)"),
    "fec_uncorrected_symbol_errors": (
        _I, "symbol errors", "Symbol errors FEC did not correct (or FEC is off): lost traffic"),
    "phy_lane_raw_errors": (
        ("interface", "lane"), "errors", "Physical raw errors on one lane, before FEC correction"),
    "phy_received_bytes": (
        _I, "bytes", "Traffic the PHY could have received, the denominator of bit error ratios"),
}


def _counter_spec(metric: str) -> MetricSpec:
    labels, unit, help_text = _COUNTERS[metric]
    return MetricSpec(f"gpunet_pfc_{metric}_total", "counter", help_text, labels, unit, _ETHTOOL)


COUNTER_SPECS = {m: _counter_spec(m) for m in _COUNTERS}
OTHER = COUNTER_SPECS["priority_other"]


@dataclass(frozen=True)
class _Stat:
    """What one driver statistic name becomes."""

    spec: MetricSpec
    labels: tuple[str, ...]  # after "interface"
    divisor: int  # the CSV's scale is 1/divisor; dividing keeps 20913 us at exactly 0.020913 s


def _name_table() -> dict[str, _Stat]:
    """Every concrete driver name of the CSV, with {p} and {l} expanded."""
    out: dict[str, _Stat] = {}
    for row in load("pfc_ethtool.csv"):
        spec = COUNTER_SPECS[row["metric"]]
        direction = (row["direction"],) if "direction" in spec.labels else ()
        divisor = round(1 / float(row["scale"]))
        for placeholder in ("{p}", "{l}"):
            if placeholder in row["name"]:
                for i in PRIORITIES:
                    out[row["name"].replace(placeholder, str(i))] = _Stat(
                        spec, (str(i), *direction), divisor)
                break
        else:
            out[row["name"]] = _Stat(spec, direction, divisor)
    return out


NAMES = _name_table()
# Any other name with a priority in it (mlx5 rx_prio3_x, bnxt x_pri3, ice x_priority_3_y).
_PRIORITY_IN_NAME = re.compile(r"(?:^|_)(?:prio|pri|priority_)([0-7])(?=_|\.|$)")

# ---- configuration families ------------------------------------------------------------------

_CFG = "mlnx_qos, dcb or /sys/class/net/<interface>/qos (config.sources)"
CONFIG_INFO = MetricSpec(
    "gpunet_pfc_config_info", "gauge",
    "Always 1: where the QoS configuration came from, the DCBX mode and the priority trust",
    ("interface", "source", "dcbx_mode", "trust"), "", _CFG)
PFC_ENABLED = MetricSpec(
    "gpunet_pfc_enabled", "gauge", "1 when PFC is enabled on the priority, else 0",
    ("interface", "priority"), "boolean", "mlnx_qos 'enabled' row or dcb pfc prio_pfc")
PRIORITY_TC = MetricSpec(
    "gpunet_pfc_priority_traffic_class", "gauge", "The ETS traffic class the priority maps to",
    ("interface", "priority"), "traffic class", "mlnx_qos tc blocks or dcb ets prio_tc")
TC_INFO = MetricSpec(
    "gpunet_pfc_traffic_class_info", "gauge",
    "Always 1: the transmission selection algorithm of a traffic class",
    ("interface", "tc", "tsa"), "", "mlnx_qos tc lines or dcb ets tc_tsa")
TC_BW = MetricSpec(
    "gpunet_pfc_traffic_class_bandwidth_ratio", "gauge",
    "Guaranteed share of the link of an ETS traffic class (0 to 1)", ("interface", "tc"),
    "ratio", "mlnx_qos 'bw:' or dcb ets tc_bw")
TC_RATE = MetricSpec(
    "gpunet_pfc_traffic_class_rate_limit_bytes_per_second", "gauge",
    "Rate limit of a traffic class", ("interface", "tc"),
    "bytes per second", "mlnx_qos 'ratelimit:'")
DSCP_PRIORITY = MetricSpec(
    "gpunet_pfc_dscp_priority", "gauge",
    "The priority packets with this DSCP are given, while the interface trusts DSCP",
    ("interface", "dscp"), "priority", "mlnx_qos dscp2prio, dcb app dscp_prio or qos/dscp2prio")
DEFAULT_PRIORITY = MetricSpec(
    "gpunet_pfc_default_priority", "gauge",
    "Priority of traffic no other app entry matches (the default-priority app entry)", _I,
    "priority", "mlnx_qos 'default priority:' or dcb app default_prio")
BUFFER_SIZE = MetricSpec(
    "gpunet_pfc_buffer_size_bytes", "gauge", "Size of a receive buffer of the port",
    ("interface", "buffer"), "bytes", "mlnx_qos, dcb buffer or qos/buffer_size")
BUFFER_CAPACITY = MetricSpec(
    "gpunet_pfc_buffer_capacity_bytes", "gauge",
    "Receive buffer memory of the port (total_size, max_buffer_size or Port buffer size)", _I,
    "bytes", "mlnx_qos, dcb buffer or qos/buffer_size")
PRIORITY_BUFFER = MetricSpec(
    "gpunet_pfc_priority_buffer", "gauge", "The receive buffer a priority is mapped to",
    ("interface", "priority"), "buffer index", "mlnx_qos 'buffer' row, dcb buffer or "
    "qos/prio2buffer")
ECN_ENABLED = MetricSpec(
    "gpunet_pfc_ecn_enabled", "gauge",
    "1 when RoCE ECN (DCQCN) is enabled on the priority at the point, else 0",
    ("interface", "priority", "point"),
    "boolean", f"{_NET}/ecn/roce_np|roce_rp/enable/<priority>")
ECN_CNP_DSCP = MetricSpec(
    "gpunet_pfc_ecn_cnp_dscp", "gauge", "DSCP of the CNPs the notification point sends", _I,
    "dscp", f"{_NET}/ecn/roce_np/cnp_dscp")
ECN_CNP_PRIORITY = MetricSpec(
    "gpunet_pfc_ecn_cnp_priority", "gauge", "802.1p priority of the CNPs the notification "
    "point sends", _I, "priority", f"{_NET}/ecn/roce_np/cnp_802p_prio")
REFRESH_SUCCESS = MetricSpec(
    "gpunet_pfc_config_refresh_success", "gauge",
    "1 if the latest background read of the interface's QoS configuration succeeded, else 0",
    _I, "boolean", "exit status and output of the configuration source")
REFRESH_LAST_SUCCESS = last_success_spec(
    "gpunet_pfc_config", "background read of the interface's QoS configuration", _I)

CONFIG_SPECS = (CONFIG_INFO, PFC_ENABLED, PRIORITY_TC, TC_INFO, TC_BW, TC_RATE, DSCP_PRIORITY,
                DEFAULT_PRIORITY, BUFFER_SIZE, BUFFER_CAPACITY, PRIORITY_BUFFER, ECN_ENABLED,
                ECN_CNP_DSCP, ECN_CNP_PRIORITY, REFRESH_SUCCESS, REFRESH_LAST_SUCCESS)


@dataclass(frozen=True)
class EthtoolSettings(Settings):
    """pfc.ethtool."""

    path: str = setting("program name (looked up in PATH) or path", default="ethtool")
    timeout_seconds: float = setting("how long one run may take, per interface", default=2,
                                     minimum=0.1)


@dataclass(frozen=True)
class QosConfigSettings(Settings):
    """pfc.config."""

    sources: tuple[str, ...] = setting(
        "where the QoS configuration comes from, in order: the first one present on the machine "
        "is used; `[]` reads none (the configuration is checked another way, and is not reported "
        "as unknown)", default=SOURCES, choices=SOURCES)
    interval_seconds: float = setting("how often the configuration is read in the background",
                                      default=60, minimum=1)
    timeout_seconds: float = setting("how long one tool may run", default=10, minimum=0.1)
    mlnx_qos_path: str = setting("the `mlnx_qos` program (looked up in PATH) or its path",
                                 default="mlnx_qos")
    dcb_path: str = setting("the `dcb` program (looked up in PATH) or its path", default="dcb")

    def program(self, source: str) -> str:
        """The program of a source that runs one (mlnx_qos, dcb)."""
        return self.mlnx_qos_path if source == "mlnx_qos" else self.dcb_path


@dataclass(frozen=True)
class PfcSettings(Settings):
    interfaces: tuple[str, ...] = setting("netdevs to report in addition to those behind RoCE "
                                          "ports", default=())
    interface_include: re.Pattern[str] | None = setting("only netdevs whose name matches are "
                                                        "reported")
    interface_exclude: re.Pattern[str] | None = setting("netdevs whose name matches are not "
                                                        "reported")
    stats_source: str = setting(
        "how NIC statistics are read: `ioctl`, in-process through the SIOCETHTOOL ioctl; "
        "`ethtool`, by running `ethtool -S IF` on every scrape (for platforms that refuse the "
        "ioctl to Python, and to replay captures through a stand-in program)", default="ioctl",
        choices=("ioctl", "ethtool"))
    ethtool: EthtoolSettings = setting("the `ethtool` program, for `stats_source: ethtool`",
                                       default=EthtoolSettings())
    config: QosConfigSettings = setting("the background read of the QoS configuration",
                                        default=QosConfigSettings())


@dataclass(frozen=True)
class _State:
    """What the background refresh knows of one interface."""

    qos: Fresh[QosConfig]  # last good configuration; ok None: no source installed
    ecn: Ecn


class PfcCollector(Collector):
    name = "pfc"
    description = ("PFC, QoS and ECN of RoCE netdevs: configuration from mlnx_qos, dcb or sysfs "
                   "(refreshed in the background) and per-priority pause, discard and ECN "
                   "counters (SIOCETHTOOL, every scrape)")
    metrics = (*CONFIG_SPECS, *COUNTER_SPECS.values())
    settings_type = PfcSettings
    settings: PfcSettings
    flags: ClassVar[Mapping[str, tuple[str, str]]] = {
        "interface-include": ("interface_include", "regexp of interfaces to include"),
        "interface-exclude": ("interface_exclude", "regexp of interfaces to exclude"),
    }
    unknown_checks: ClassVar[Mapping[str, str]] = {
        "pfc_config": "whether PFC is enabled on each priority of RoCE interfaces, and their "
                      "trust and buffers (`gpunet_pfc_enabled`, `gpunet_pfc_config_info`): "
                      "mlnx_qos or dcb reports them (MLNX_OFED's qos/ files lack PFC)"}

    def __init__(self, ctx: CollectorContext, reader: StatsReader | None = None) -> None:
        super().__init__(ctx)
        cfg = self.settings
        if reader is None:
            if cfg.stats_source == "ethtool":
                reader = CommandStatsReader(cfg.ethtool.path,
                                            float(cfg.ethtool.timeout_seconds))
            else:
                reader = EthtoolReader()
        self.reader = reader
        self._cfg = cfg.config
        self._plans: dict[str, tuple[tuple[str, ...], list[tuple[int, MetricSpec,
                                                                  dict[str, str], int]]]] = {}
        self._states: dict[str, _State] = {}
        self._unknown: Mapping[str, str] = {}
        # Started by the first scrape; rounds call self.refresh() (looked up each round). No
        # round timeout: every tool run is killed after config.timeout_seconds (run_command).
        self._refresher: Refresher[None] = Refresher(
            "pfc-config", float(self._cfg.interval_seconds), lambda: self.refresh(),
            self.ctx.log_once)

    # -- interfaces ------------------------------------------------------------------------

    def interfaces(self, scrape: Scrape | None = None) -> list[str]:
        """Netdevs behind RoCE ports, then configured ones that exist, filtered; the ports as
        ``scrape`` lists them, else (the background, a device event) listed anew."""
        cfg, root = self.settings, self.ctx.sysfs
        names: list[str] = []
        for p in (scrape or Scrape()).rdma(root).ports():
            if p.link_layer == "Ethernet" and p.netdev and p.netdev not in names:
                names.append(p.netdev)
        names += rdma.extra_netdevs(root, cfg.interfaces, names, self.ctx.log_once)
        include, exclude = cfg.interface_include, cfg.interface_exclude
        return [n for n in names if (include is None or include.search(n))
                and not (exclude is not None and exclude.search(n))]

    # -- configuration (background) --------------------------------------------------------

    def refresh(self) -> None:
        """One round over every interface; runs in the background thread."""
        names = self.interfaces()
        for ifname in names:
            self._states[ifname] = self._refresh_one(ifname, self._states.get(ifname))
        for gone in self._states.keys() - set(names):
            del self._states[gone]

    def _pick_source(self, ifname: str) -> tuple[str, str] | None:
        for source in self._cfg.sources:
            if source == "sysfs":
                if self.ctx.sysfs.exists(f"class/net/{ifname}/qos"):
                    return source, ""
                continue
            path = shutil.which(self._cfg.program(source))
            if path is not None:
                return source, path
        return None

    def _refresh_one(self, ifname: str, old: _State | None) -> _State:
        ecn = read_ecn(self.ctx.sysfs, ifname, lambda what, why: self.ctx.log_once(
            logging.DEBUG, "skipping %s: %s", what, why))
        picked = self._pick_source(ifname)
        if picked is None:
            self.ctx.log_once(logging.DEBUG, "no QoS configuration source for %s (none of %s "
                              "installed)", ifname, ", ".join(self._cfg.sources))
            return _State(Fresh(), ecn)
        source, path = picked
        try:
            config = self._read_config(source, path, ifname)
        except (CommandError, ValueError, OSError) as exc:
            self.ctx.log_once(logging.WARNING, "reading the QoS configuration of %s with %s "
                              "failed: %s", ifname, source, exc)
            if old is not None and old.qos.value is not None and old.qos.value.source == source:
                return _State(old.qos.failed(), ecn)
            return _State(Fresh[QosConfig]().failed(), ecn)
        return _State(Fresh(config, True, time.time()), ecn)

    def _read_config(self, source: str, path: str, ifname: str) -> QosConfig:
        timeout = float(self._cfg.timeout_seconds)
        if source == "mlnx_qos":
            return parse_mlnx_qos(run_command([path, "-i", ifname], timeout))
        if source == "dcb":
            def show(obj: str, required: bool = False) -> str | None:
                try:
                    out = run_command([path, "-j", obj, "show", "dev", ifname], timeout)
                except CommandTimeout:
                    raise
                except CommandError:
                    if required:
                        raise
                    return None  # not supported by this driver or iproute2 version
                if not out.strip():  # dcb prints a bare newline when a read fails
                    if required:
                        raise CommandError(f"{path} {obj} show printed nothing")
                    return None
                return out
            pfc = show("pfc", required=True)
            assert pfc is not None
            return parse_dcb(pfc, ets=show("ets"), app=show("app"), buffer=show("buffer"),
                             dcbx=show("dcbx"), apptrust=show("apptrust"))
        base = f"class/net/{ifname}/qos"
        texts: dict[str, str] = {}
        for name, text in self.ctx.sysfs.read_many(base, QOS_FILES).items():
            if isinstance(text, str):
                texts[name] = text
            elif text.errno != errno.ENOENT:  # a file this OFED release lacks is no error
                raise OSError(text.errno, f"{base}/{name}: {text.strerror}")
        return parse_qos_sysfs(texts)

    # -- scrape ----------------------------------------------------------------------------

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        self._refresher.start()  # the first round runs while the counters are read
        fams = Families()
        names = self.interfaces(scrape)
        for ifname in names:
            self._counters(fams, ifname)
        # A round that failed as a whole (an exception, not one interface's tool) fails every
        # interface's configuration.
        round_failed = self._refresher.wait_first(scrape.deadline).ok is False
        unread = False
        for ifname in names:
            state = self._states.get(ifname)
            if state is not None:
                self._config(fams, ifname, state, round_failed)
                # No source installed, or one (the OFED files) that cannot say whether PFC is on.
                unread |= state.qos.ok is None or (state.qos.value is not None
                                                   and not state.qos.value.pfc)
        self._unknown = {"pfc_config": "tool_missing"} if unread and self._cfg.sources else {}
        for gone in self._plans.keys() - set(names):
            del self._plans[gone]
        forget = getattr(self.reader, "forget", None)
        if forget is not None:
            forget(set(names))
        return iter(fams)

    def unknown(self) -> Mapping[str, str]:
        """``pfc_config`` (``tool_missing``) while an interface it reports has no configuration
        source on the machine, or only one without PFC state (MLNX_OFED's qos/ files); nothing
        while ``pfc.config.sources`` is empty. A source that is present but fails is not
        unknown here: gpunet_pfc_config_refresh_success says so per interface
        (GpunetPfcConfigUnreadable), with the last good values kept."""
        return self._unknown

    def _counters(self, fams: Families, ifname: str) -> None:
        try:
            stats = self.reader.read(ifname)
        except OSError as exc:
            if exc.errno == errno.ENODEV:  # gone, or not in this network namespace
                self.ctx.log_once(logging.DEBUG, "no interface %s in this network namespace "
                                  "(gone, or a sysfs tree of another machine)", ifname)
            elif exc.errno == errno.EOPNOTSUPP:
                self.ctx.log_once(logging.DEBUG, "%s: the driver has no NIC statistics", ifname)
            else:
                self.ctx.skip(f"NIC statistics of {ifname}", exc.strerror or exc)
            return
        cached = self._plans.get(ifname)
        if cached is None or (cached[0] is not stats.names and cached[0] != stats.names):
            cached = self._plans[ifname] = (stats.names, _plan(ifname, stats.names))
        values = stats.values
        for index, spec, labels, divisor in cached[1]:
            fams.add_labeled(spec, labels, values[index] / divisor if divisor != 1
                             else values[index])

    def _config(self, fams: Families, ifname: str, state: _State, round_failed: bool) -> None:
        ecn = state.ecn
        for (point, prio), on in sorted(ecn.enabled.items()):
            fams.add(ECN_ENABLED, [ifname, str(prio), point], int(on))
        if ecn.cnp_dscp is not None:
            fams.add(ECN_CNP_DSCP, [ifname], ecn.cnp_dscp)
        if ecn.cnp_priority is not None:
            fams.add(ECN_CNP_PRIORITY, [ifname], ecn.cnp_priority)
        add_freshness(fams, REFRESH_SUCCESS, REFRESH_LAST_SUCCESS, [ifname], state.qos,
                      ok=False if round_failed and state.qos.ok is not None else None)
        cfg = state.qos.value
        if cfg is None:
            return
        fams.add(CONFIG_INFO, [ifname, cfg.source, cfg.dcbx_mode, cfg.trust], 1)
        for prio, on in sorted(cfg.pfc.items()):
            fams.add(PFC_ENABLED, [ifname, str(prio)], int(on))
        for prio, tc in sorted(cfg.prio_tc.items()):
            fams.add(PRIORITY_TC, [ifname, str(prio)], tc)
        for tc, tsa in sorted(cfg.tc_tsa.items()):
            fams.add(TC_INFO, [ifname, str(tc), tsa], 1)
        for tc, bw in sorted(cfg.tc_bw.items()):
            fams.add(TC_BW, [ifname, str(tc)], bw / 100)
        for tc, rate in sorted(cfg.tc_rate_limit.items()):
            fams.add(TC_RATE, [ifname, str(tc)], rate)
        if cfg.trust in ("dscp", ""):  # under pcp trust the map is not applied
            for dscp, prio in sorted(cfg.dscp_prio.items()):
                fams.add(DSCP_PRIORITY, [ifname, str(dscp)], prio)
        if cfg.default_prio is not None:
            fams.add(DEFAULT_PRIORITY, [ifname], cfg.default_prio)
        for buf, size in sorted(cfg.buffer_size.items()):
            fams.add(BUFFER_SIZE, [ifname, str(buf)], size)
        if cfg.buffer_total is not None:
            fams.add(BUFFER_CAPACITY, [ifname], cfg.buffer_total)
        for prio, buf in sorted(cfg.prio_buffer.items()):
            fams.add(PRIORITY_BUFFER, [ifname, str(prio)], buf)

    def device_event(self, subsystem: str, action: str, properties: Mapping[str, str]) -> None:
        """A netdev or RDMA device came, went or was renamed: when that changes the interfaces
        this collector reports, forget what it knew of the ones gone (a NIC whose driver is
        reloaded comes back under the same name, often with its QoS reset: its old PFC
        configuration must not be served as current) and refresh the configuration now. Events
        of other interfaces (container veths) cost one listing of the RDMA ports."""
        if (subsystem not in ("net", "infiniband") or action not in ("add", "remove", "move")
                or not self._refresher.started):
            return
        known, now = set(self._states), set(self.interfaces())
        gone = known - now
        if subsystem == "net" and action in ("remove", "move"):
            # A remove arrives before sysfs drops the device; a move names the old name.
            old = (properties.get("INTERFACE", "") if action == "remove"
                   else properties.get("DEVPATH_OLD", "").rpartition("/")[2])
            if old in known:
                gone.add(old)
        for ifname in gone:
            self._states.pop(ifname, None)
            self._plans.pop(ifname, None)
        if gone or now - known:
            self.ctx.logger.debug("%s %s: interfaces gone %s, new %s; refreshing the QoS "
                                  "configuration now", subsystem, action, sorted(gone),
                                  sorted(now - known))
            self._refresher.wake()

    def close(self) -> None:
        self._refresher.stop()
        self.reader.close()


def _plan(ifname: str, names: Sequence[str]) -> list[tuple[int, MetricSpec, dict[str, str],
                                                            int]]:
    """Which statistic (by index) becomes which sample: built once per set of driver names."""
    plan = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for index, raw in enumerate(names):
        name = raw.strip()
        stat = NAMES.get(name)
        if stat is not None:
            key = (stat.spec.name, stat.labels)
            if key in seen:  # two spellings of one counter: the first printed wins
                continue
            seen.add(key)
            labels = dict(zip(stat.spec.labels, (ifname, *stat.labels), strict=True))
            plan.append((index, stat.spec, labels, stat.divisor))
            continue
        m = _PRIORITY_IN_NAME.search(name)
        if m:
            plan.append((index, OTHER, {"interface": ifname, "priority": m.group(1),
                                        "counter": name}, 1))
    return plan
