"""infiniband collector: InfiniBand and RoCE ports from /sys/class/infiniband, read each scrape.

Formats and sources: docs/formats.md §1 (kernel drivers/infiniband/core/sysfs.c).
The unit of failure is a single value: a file that cannot be read or parsed ("N/A (no PMA)",
EINVAL, EACCES, EOPNOTSUPP, garbage, a device unplugged mid-scrape) costs that value alone.
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec, Scrape
from gpunet_exporter.collectors.tables import load
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.inventory import KINDS, Inventory
from gpunet_exporter.sources import rdma
from gpunet_exporter.sources.rdma import BYTES_PER_GBIT, parse_rate, parse_state
from gpunet_exporter.sources.sysfs import parse_int, parse_uint

STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PHYS_STATES = {1: "Sleep", 2: "Polling", 3: "Disabled", 4: "PortConfigurationTraining",
               5: "LinkUp", 6: "LinkErrorRecovery", 7: "Phy Test"}
ACTIVE = (4, 5)


@dataclass(frozen=True)
class CounterDef:
    metric: str
    width: str
    scale: int


def _counter_table() -> tuple[dict[str, CounterDef], dict[str, MetricSpec]]:
    defs: dict[str, CounterDef] = {}
    specs: dict[str, MetricSpec] = {}
    for row in load("infiniband_counters.csv"):
        defs[row["file"]] = CounterDef(row["metric"], row["width"], int(row["scale"]))
        if row["metric"] not in specs:  # the counters/ row carries the help text
            specs[row["metric"]] = MetricSpec(
                f"gpunet_infiniband_port_{row['metric']}_total", "counter", row["help"],
                ("device", "port"), row["unit"],
                f"/sys/class/infiniband/<device>/ports/<port>/counters/{row['file']}"
                + (" (x4)" if row["scale"] == "4" else "")
                + " or counters_ext/ on kernels before 4.5")
    return defs, specs


def _hw_table() -> tuple[dict[str, str], dict[str, MetricSpec], dict[str, MetricSpec]]:
    names: dict[str, str] = {}
    port: dict[str, MetricSpec] = {}
    device: dict[str, MetricSpec] = {}
    for row in load("infiniband_hw_counters.csv"):
        names[row["file"]] = row["metric"]
        if row["metric"] == "-" or row["metric"].startswith("@"):  # "@": a counters/ family
            continue
        port[row["file"]] = MetricSpec(
            f"gpunet_infiniband_port_hw_{row['metric']}_total", "counter", row["help"],
            ("device", "port"), row["unit"],
            f"/sys/class/infiniband/<device>/ports/<port>/hw_counters/{row['file']}")
        device[row["file"]] = MetricSpec(
            f"gpunet_infiniband_device_hw_{row['metric']}_total", "counter",
            row["help"], ("device",), row["unit"],
            f"/sys/class/infiniband/<device>/hw_counters/{row['file']}")
    return names, port, device


COUNTERS, COUNTER_SPECS = _counter_table()
HW_NAMES, HW_PORT_SPECS, HW_DEVICE_SPECS = _hw_table()

_P = ("device", "port")
DEVICE_INFO = MetricSpec(
    "gpunet_infiniband_device_info", "gauge",
    "Always 1: the static attributes of an RDMA device (numa_node -1: the platform gives none)",
    ("device", "fw_ver", "hca_type", "board_id", "node_guid", "pci_address", "numa_node"), "",
    "/sys/class/infiniband/<device>/{fw_ver,hca_type,board_id,node_guid}, device -> PCI function, "
    "device/numa_node")
PORT_INFO = MetricSpec(
    "gpunet_infiniband_port_info", "gauge",
    "Always 1: the link layer (InfiniBand, or Ethernet for RoCE) and the netdev behind the port",
    ("device", "port", "link_layer", "interface"), "",
    "ports/<port>/link_layer; netdev from ports/<port>/gid_attrs/ndevs/<idx> or device/net/")
STATE = MetricSpec(
    "gpunet_infiniband_port_state_id", "gauge",
    "Logical port state: " + ", ".join(f"{k} {v}" for k, v in STATES.items()), _P, "enum",
    "/sys/class/infiniband/<device>/ports/<port>/state")
PHYS_STATE = MetricSpec(
    "gpunet_infiniband_port_phys_state_id", "gauge",
    "Physical port state as IBA numbers it (5 LinkUp, 2 Polling, 3 Disabled)", _P, "enum",
    "/sys/class/infiniband/<device>/ports/<port>/phys_state")
RATE = MetricSpec(
    "gpunet_infiniband_port_rate_bytes_per_second", "gauge",
    "Active data rate of the port (Gb/s x 125000000)", _P, "bytes per second",
    "/sys/class/infiniband/<device>/ports/<port>/rate")
WIDTH = MetricSpec(
    "gpunet_infiniband_port_link_width_lanes", "gauge",
    "Active link width in lanes (the NX of the rate string)", _P, "lanes",
    "/sys/class/infiniband/<device>/ports/<port>/rate")
LANE_SPEED = MetricSpec(
    "gpunet_infiniband_port_lane_speed_bytes_per_second", "gauge",
    "Data rate per lane (HDR 50, NDR 100, XDR 200 Gb/s)", _P, "bytes per second",
    "/sys/class/infiniband/<device>/ports/<port>/rate")
RATE_EXPECTED = MetricSpec(
    "gpunet_infiniband_port_rate_expected_bytes_per_second", "gauge",
    "Rate an active port should run at, from infiniband.expected_rate or its peers on this node",
    _P,
    "bytes per second", "config file, or derived from the rate files")
CARRIES_DATA = MetricSpec(
    "gpunet_infiniband_port_carries_data", "gauge",
    "1 for a port meant to carry data, 0 for one that carries none by design (its state is "
    "not exported)", _P, "boolean",
    "infiniband.data_ports, else: a RoCE port with no netdev on a device with netdevs")
RATE_DEGRADED = MetricSpec(
    "gpunet_infiniband_port_rate_degraded", "gauge",
    "1 when an active port runs below its expected rate, else 0", _P, "boolean",
    "ports/<port>/rate, /sys/class/net/<netdev>/speed")
SATURATED = MetricSpec(
    "gpunet_infiniband_port_pma_saturated", "gauge",
    "1 for each standard PMA counter stuck at its maximum value (its rate reads 0)",
    ("device", "port", "counter"),
    "boolean", "/sys/class/infiniband/<device>/ports/<port>/counters/<counter>")
PORT_COUNTER = MetricSpec(
    "gpunet_infiniband_port_pma_total", "counter",
    "A counters/ file this exporter has no curated name for, by file name", (*_P, "counter"),
    "as the kernel counts it", "/sys/class/infiniband/<device>/ports/<port>/counters/<counter>")
PORT_HW_COUNTER = MetricSpec(
    "gpunet_infiniband_port_hw_total", "counter",
    "A hw_counters/ file this exporter has no curated name for, by file name", (*_P, "counter"),
    "as the driver counts it",
    "/sys/class/infiniband/<device>/ports/<port>/hw_counters/<counter>")
DEVICE_HW_COUNTER = MetricSpec(
    "gpunet_infiniband_device_hw_total", "counter",
    "A device-level hw_counters/ file this exporter has no curated name for, by file name",
    ("device", "counter"), "as the driver counts it",
    "/sys/class/infiniband/<device>/hw_counters/<counter>")

PORT_HW_DROPPED = MetricSpec(
    "gpunet_infiniband_port_hw_counters_dropped", "gauge",
    "Uncurated hw_counters/ files not exported, over infiniband.generic_hw_counters_max", _P,
    "files",
    "the listing of /sys/class/infiniband/<device>/ports/<port>/hw_counters/")
DEVICE_HW_DROPPED = MetricSpec(
    "gpunet_infiniband_device_hw_counters_dropped", "gauge",
    "Uncurated device-level hw_counters/ files not exported, over "
    "infiniband.generic_hw_counters_max", ("device",), "files",
    "the listing of /sys/class/infiniband/<device>/hw_counters/")
# Generic hw_counters series per port (and per device-level directory): an mlx5 port has about 40
# hw_counters files, nearly all curated; another driver's set is all generic here, and bnxt_re's,
# the largest in the mainline kernel, has about 70. A directory of thousands (a driver bug, a
# planted tree) must not turn into thousands of series on every scrape.
GENERIC_HW_COUNTERS_MAX = 512

_HCA_TYPE = DEVICE_INFO.labels.index("hca_type")

_INV_SRC = ("infiniband.inventory_expected, else the names learned in "
            "infiniband.inventory_state_file")
INVENTORY_EXPECTED = MetricSpec(
    "gpunet_inventory_expected", "gauge",
    "How many RDMA devices, RDMA ports or netdevs behind them this node should have", ("kind",),
    "devices", _INV_SRC)
INVENTORY_PRESENT = MetricSpec(
    "gpunet_inventory_present", "gauge",
    "How many RDMA devices, RDMA ports or netdevs behind RDMA ports this scrape found", ("kind",),
    "devices", "/sys/class/infiniband/<device>/ports/<port>, the port's netdev")
INVENTORY_MISSING = MetricSpec(
    "gpunet_inventory_missing", "gauge",
    "RDMA devices, RDMA ports or netdevs behind them expected and not found", ("kind",),
    "devices", _INV_SRC)
INVENTORY_MISSING_INFO = MetricSpec(
    "gpunet_inventory_missing_info", "gauge",
    "Always 1, for each learned name not present now", ("kind", "name"), "", _INV_SRC)
INVENTORY_SPECS = (INVENTORY_EXPECTED, INVENTORY_PRESENT, INVENTORY_MISSING,
                   INVENTORY_MISSING_INFO)


@dataclass(frozen=True, kw_only=True)
class RateRule(Settings):
    """One rule of infiniband.expected_rate."""

    device: re.Pattern[str] | None = setting("RDMA device names this rule applies to (unset: "
                                             "every device)")
    hca_type: re.Pattern[str] | None = setting("`hca_type` values this rule applies to, e.g. "
                                               "`MT4129` (unset: every type)")
    link_layer: str | None = setting("the link layer this rule applies to, `InfiniBand` or "
                                     "`Ethernet` (unset: both)")
    gbps: float = setting("expected rate in Gb/s, as the `rate` file prints it: 400 for NDR 4X",
                          required=True, minimum=0)

    def matches(self, device: str, hca_type: str, link_layer: str) -> bool:
        return ((self.device is None or bool(self.device.search(device)))
                and (self.hca_type is None or bool(self.hca_type.search(hca_type)))
                and self.link_layer in (None, link_layer))


@dataclass(frozen=True, kw_only=True)
class DataPortsRule(Settings):
    """One rule of infiniband.data_ports."""

    device: re.Pattern[str] = setting("RDMA device names this rule applies to", required=True)
    ports: tuple[int, ...] = setting("the port numbers that carry data; the device's other "
                                     "ports carry none", required=True, minimum=1)


@dataclass(frozen=True)
class InventoryExpected(Settings):
    """infiniband.inventory_expected: a count left unset is learned."""

    rdma_devices: int | None = setting("RDMA devices this node should have (after "
                                       "`device_include`/`device_exclude`)", minimum=0)
    rdma_ports: int | None = setting("RDMA ports, all devices together", minimum=0)
    netdevs: int | None = setting("netdevs behind RDMA ports", minimum=0)


@dataclass(frozen=True)
class InfinibandSettings(Settings):
    device_include: re.Pattern[str] | None = setting("only RDMA devices whose name matches are "
                                                     "reported")
    device_exclude: re.Pattern[str] | None = setting("RDMA devices whose name matches are not "
                                                     "reported")
    expected_rate: tuple[RateRule, ...] = setting(
        "expected port rates: the first rule that matches an ACTIVE port gives its expected "
        "rate; without rules, the fastest active port with the same `hca_type` and link layer "
        "does (see **Expected rate** below)", default=())
    data_ports: tuple[DataPortsRule, ...] = setting(
        "which ports of a device carry data: the first rule whose `device` matches decides for "
        "all its ports; without a matching rule, every port does except a RoCE port with no "
        "netdev on a device whose other ports have one (a multi-plane ConnectX-8; see **Ports "
        "that carry no data** below)", default=())
    generic_hw_counters_max: int = setting(
        "`hw_counters/` files without a curated name exported per port and per device-level "
        "directory, the first ones by file name (0: curated counters only); see "
        "**hw_counters** below", default=GENERIC_HW_COUNTERS_MAX, minimum=0)
    inventory_expected: InventoryExpected = setting(
        "how many RDMA devices, RDMA ports and netdevs this node should have; a count left unset "
        "is learned from what was seen (see **Inventory** below)", default=InventoryExpected())
    inventory_state_file: str | None = setting(
        "where the learned inventory is kept across restarts, e.g. "
        "`/var/lib/gpunet-exporter/inventory.json`; unset: learned in memory only")


def _selected(name: str, include: Any, exclude: Any) -> bool:
    return (include is None or bool(include.search(name))) and not (
        exclude is not None and exclude.search(name))


def _errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc))


@dataclass
class _Active:
    device: str
    port: str
    hca_type: str
    link_layer: str
    rate: float
    labels: dict[str, str]  # the port's {device, port}, shared by its series


class InfinibandCollector(Collector):
    name = "infiniband"
    description = "InfiniBand and RoCE port state, rate, counters and hw_counters from sysfs"
    metrics = (DEVICE_INFO, PORT_INFO, STATE, PHYS_STATE, RATE, WIDTH, LANE_SPEED, RATE_EXPECTED,
               RATE_DEGRADED, CARRIES_DATA, *COUNTER_SPECS.values(), SATURATED, PORT_COUNTER,
               *HW_PORT_SPECS.values(), PORT_HW_COUNTER, PORT_HW_DROPPED,
               *HW_DEVICE_SPECS.values(), DEVICE_HW_COUNTER, DEVICE_HW_DROPPED,
               *INVENTORY_SPECS)
    settings_type = InfinibandSettings
    settings: InfinibandSettings
    flags: ClassVar[Mapping[str, tuple[str, str]]] = {
        "device-include": ("device_include", "regexp of RDMA devices to include"),
        "device-exclude": ("device_exclude", "regexp of RDMA devices to exclude"),
        "inventory-state-file": ("inventory_state_file",
                                 "file keeping the learned inventory across restarts"),
    }

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self._info_cache: dict[str, tuple[tuple[int, int], list[str]]] = {}
        self._inventory = Inventory(self.settings.inventory_state_file, ctx.learn,
                                    ctx.log_once)
        self._present: dict[str, set[str]] = {}

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        cfg = self.settings
        # One collection runs at a time per collector (the core's Runner coalesces scrapes).
        self._fams = Families()
        snapshot = scrape.rdma(self.ctx.sysfs)
        names = snapshot.devices(cfg.device_include, cfg.device_exclude)
        for gone in self._info_cache.keys() - set(names):
            del self._info_cache[gone]
        if not names:
            where = self.ctx.sysfs.path(rdma.CLASS)
            self.ctx.log_once(logging.DEBUG, "no RDMA devices under %s", where)
        active: list[_Active] = []
        self._present = {k: set() for k in KINDS}
        for dev in names:
            self._device(snapshot.device(dev), active)
        self._degraded(active)
        self._inventory_families(cfg)
        return iter(self._fams)

    def _inventory_families(self, cfg: InfinibandSettings) -> None:
        """Expected, present and missing devices, ports and netdevs (inventory.py).
        Learned names outside device_include/exclude are not expected; a kind neither seen nor
        configured has no series."""
        missing = self._inventory.update(self._present)
        inc, exc = cfg.device_include, cfg.device_exclude
        configured = cfg.inventory_expected
        counts = {"rdma_device": configured.rdma_devices, "rdma_port": configured.rdma_ports,
                  "netdev": configured.netdevs}
        for kind in KINDS:
            names = [n for n in missing[kind] if kind == "netdev" or _selected(
                n.partition("/")[0], inc, exc)]
            present = len(self._present[kind])
            want = counts[kind]
            learned = present + len(names)
            expected = learned if want is None else want
            if want is None and not learned:
                continue  # no RDMA hardware, none expected: no series (as before)
            self._fams.add(INVENTORY_EXPECTED, [kind], expected)
            self._fams.add(INVENTORY_PRESENT, [kind], present)
            self._fams.add(INVENTORY_MISSING, [kind], max(expected - present, len(names), 0))
            for name in names:
                self._fams.add(INVENTORY_MISSING_INFO, [kind, name], 1)

    # -- helpers ---------------------------------------------------------------------------

    def _text(self, rel: str, required: bool = True) -> str | None:
        try:
            return self.ctx.sysfs.read(rel)
        except OSError as exc:
            if required:
                self.ctx.skip(rel, _errno_name(exc))
            return None

    def _uints(self, rel: str, select: Callable[[list[str]], Iterable[str]] | None = None
               ) -> list[tuple[str, int]]:
        """(file name, value) of every readable, parseable file in a counter directory (of
        those ``select`` picks from the sorted names, when given).

        A missing directory gives nothing (no such counters on this driver); an unreadable or
        unparseable file is skipped and counted, costing that value alone.
        """
        try:
            entries = self.ctx.sysfs.read_dir(rel, select)
        except OSError:
            return []
        out = []
        for fname, text in entries.items():
            if isinstance(text, OSError):
                self.ctx.skip(f"{rel}/{fname}", _errno_name(text))
                continue
            value = parse_uint(text)
            if value is None:
                why = "no PMA" if text.startswith("N/A") else f"unparseable {text[:40]!r}"
                self.ctx.skip(f"{rel}/{fname}", why)
                continue
            out.append((fname, value))
        return out

    # -- per device and port ---------------------------------------------------------------

    def _device(self, device: rdma.Device, active: list[_Active]) -> None:
        dev = device.name
        root, base = self.ctx.sysfs, f"{rdma.CLASS}/{dev}"
        if device.error is not None:
            if not root.exists(base):
                self.ctx.logger.debug("device %s vanished during the scrape", dev)
                return
            self.ctx.skip(f"{base}/ports", _errno_name(device.error))
        try:
            ident: tuple[int, int] | None = root.identity(base)
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # gone since the listing: none of its values
                self.ctx.logger.debug("device %s vanished during the scrape", dev)
                return
            ident = None
        info = self._device_info(dev, ident)
        self._present["rdma_device"].add(dev)
        self._fams.add(DEVICE_INFO, info, 1)
        self._hw(f"{base}/hw_counters", [dev], {"device": dev}, HW_DEVICE_SPECS,
                 DEVICE_HW_COUNTER, DEVICE_HW_DROPPED)
        for port in device.ports:
            self._port(port, info[_HCA_TYPE], active)

    def _device_info(self, dev: str, ident: tuple[int, int] | None) -> list[str]:
        """Labels of gpunet_infiniband_device_info, read once per device instance.

        Firmware version, GUID, PCI address and NUMA node only change when the device is
        re-created (hot-plug, driver reload, firmware reset), which gives its directory a new
        inode (``ident``); the cache is keyed on that, so a replaced device is read afresh.
        """
        root, base = self.ctx.sysfs, f"{rdma.CLASS}/{dev}"
        cached = self._info_cache.get(dev)
        if cached is not None and ident is not None and cached[0] == ident:
            return cached[1]
        attrs = [self._text(f"{base}/{a}", required=False) or ""
                 for a in ("fw_ver", "hca_type", "board_id", "node_guid")]
        numa = self._text(f"{base}/device/numa_node", required=False) or ""
        info = [dev, *attrs, rdma.pci_address(root, dev), numa]
        if ident is not None:
            self._info_cache[dev] = (ident, info)
        return info

    def _port(self, p: rdma.Port, hca_type: str, active: list[_Active]) -> None:
        dev, port, pdir = p.device, p.port, p.dir
        labels = [dev, port]
        shared = dict(zip(_P, labels, strict=True))  # one dict for the port's series
        try:
            files = self.ctx.sysfs.read_many(pdir, ("state", "phys_state", "rate"))
        except OSError:  # the port went away with its device mid-scrape
            return

        def attr(name: str) -> str | None:
            text = files[name]
            if isinstance(text, OSError):
                self.ctx.skip(f"{pdir}/{name}", _errno_name(text))
                return None
            return text

        # link layer and netdev: from the scrape's listing of the RDMA devices
        if p.link_layer_error is not None:
            self.ctx.skip(f"{pdir}/link_layer", _errno_name(p.link_layer_error))
        link_layer, netdev = p.link_layer, p.netdev
        self._present["rdma_port"].add(f"{dev}/{port}")
        if netdev:
            self._present["netdev"].add(netdev)
        self._fams.add(PORT_INFO, [dev, port, link_layer, netdev], 1)
        data = self._carries_data(p)
        self._fams.add_labeled(CARRIES_DATA, shared, 1 if data else 0)
        if not data:  # a plane that carries no data by design: no state to page on
            pma = self._counters(pdir, labels, shared)
            self._hw(f"{pdir}/hw_counters", labels, shared, HW_PORT_SPECS, PORT_HW_COUNTER,
                     PORT_HW_DROPPED, pma)
            return
        state = None
        for spec, fname in ((STATE, "state"), (PHYS_STATE, "phys_state")):
            text = attr(fname)
            value = parse_state(text) if text is not None else None
            if value is None:
                if text is not None:
                    self.ctx.skip(f"{pdir}/{fname}", f"unparseable {text[:40]!r}")
                continue
            self._fams.add_labeled(spec, shared, value)
            if fname == "state":
                state = value
        rate_text = attr("rate")
        rate = parse_rate(rate_text) if rate_text is not None else None
        if rate is not None:
            self._fams.add_labeled(RATE, shared, rate.bytes_per_second)
            self._fams.add_labeled(WIDTH, shared, rate.lanes)
            self._fams.add_labeled(LANE_SPEED, shared, rate.lane_bytes_per_second)
        elif rate_text is not None:
            self.ctx.skip(f"{pdir}/rate", f"unparseable {rate_text[:40]!r}")
        if state in ACTIVE:
            effective = rate.bytes_per_second if rate else None
            if link_layer == "Ethernet" and netdev:
                speed = parse_int(self._text(f"class/net/{netdev}/speed", required=False) or "")
                if speed and speed > 0:
                    effective = speed * 125_000.0
            if effective is not None:
                active.append(_Active(dev, port, hca_type, link_layer, effective, shared))
        pma = self._counters(pdir, labels, shared)
        self._hw(f"{pdir}/hw_counters", labels, shared, HW_PORT_SPECS, PORT_HW_COUNTER,
                 PORT_HW_DROPPED, pma)

    def _carries_data(self, p: rdma.Port) -> bool:
        """Whether the port is meant to carry data: the first infiniband.data_ports rule that
        matches its device, else the listing's judgement (rdma.carries_data)."""
        for rule in self.settings.data_ports:
            if rule.device.search(p.device):
                return parse_uint(p.port) in rule.ports
        return p.data

    def _counters(self, pdir: str, labels: list[str], shared: dict[str, str]) -> set[str]:
        """The port's counters/ families; returns the metrics it exported."""
        values: dict[str, tuple[int, int, int, str]] = {}  # metric -> (raw, scale, width, file)
        generic: list[tuple[str, int]] = []
        # counters_ext/ (kernels before 4.5) is read second and takes precedence.
        read = [self._uints(f"{pdir}/{sub}") for sub in ("counters", "counters_ext")]
        # The kernel uses the extended table (64-bit data counters) when it has these files.
        extended = any(fname == "unicast_xmit_packets" for fname, _ in read[0])
        for entries in read:
            for fname, raw in entries:
                d = COUNTERS.get(fname)
                if d is None:
                    generic.append((fname, raw))
                    continue
                width = 64 if d.width == "64" or (d.width == "32/64" and extended) else int(
                    d.width.split("/")[0])
                values[d.metric] = (raw, d.scale, width, fname)
        for metric, (raw, scale, width, fname) in values.items():
            self._fams.add_labeled(COUNTER_SPECS[metric], shared, raw * scale)
            if width < 64 and raw >= (1 << width) - 1:  # judged on the PMA field, not bytes
                self._fams.add(SATURATED, [*labels, fname], 1)
        for fname, value in generic:
            self._fams.add(PORT_COUNTER, [*labels, fname], value)
        return set(values)

    def _hw(self, hdir: str, labels: list[str], shared: dict[str, str],
            specs: Mapping[str, MetricSpec], generic: MetricSpec, dropped_spec: MetricSpec,
            pma: set[str] | None = None) -> None:
        """A hw_counters/ directory: every curated counter, and the first
        ``generic_hw_counters_max`` other files by name (the rest are not even read).

        A port's file mapped to a counters/ family ("@<metric>": EFA's bytes and packets) feeds
        that family where ``pma``, the families the port's counters/ gave, lacks it; elsewhere
        (the device-level directory) it is a generic counter."""
        limit = self.settings.generic_hw_counters_max
        dropped = 0

        def select(names: list[str]) -> list[str]:
            nonlocal dropped
            keep, generic_kept = [], 0
            for name in names:  # sorted: which generic files are kept does not vary
                kind = HW_NAMES.get(name)
                if kind == "-":  # lifespan: a setting, not a counter
                    continue
                if kind is None:
                    if generic_kept >= limit:
                        dropped += 1
                        continue
                    generic_kept += 1
                keep.append(name)
            return keep

        for fname, value in self._uints(hdir, select):
            spec = specs.get(fname)
            family = HW_NAMES.get(fname, "")[1:]
            if spec is not None:
                self._fams.add_labeled(spec, shared, value)
            elif pma is not None and family in COUNTER_SPECS and family not in pma:
                self._fams.add_labeled(COUNTER_SPECS[family], shared, value)
            else:
                self._fams.add(generic, [*labels, fname], value)
        if dropped:
            self._fams.add_labeled(dropped_spec, shared, dropped)
            # limit 0 is an operator's choice (curated counters only), not worth a warning
            self.ctx.log_once(logging.WARNING if limit else logging.DEBUG,
                              "%s has more than %d hw_counters files without a "
                              "curated name; exporting the first %d by name",
                              self.ctx.sysfs.path(hdir), limit, limit)

    # -- expected versus actual rate ------------------------------------------------------

    def _degraded(self, active: list[_Active]) -> None:
        rules = self.settings.expected_rate
        fastest: dict[tuple[str, str], float] = {}
        for a in active:
            key = (a.hca_type, a.link_layer)
            fastest[key] = max(fastest.get(key, 0.0), a.rate)
        for a in active:
            expected = None
            for rule in rules:
                if rule.matches(a.device, a.hca_type, a.link_layer):
                    expected = float(rule.gbps) * BYTES_PER_GBIT
                    break
            if expected is None and not rules:
                expected = fastest[(a.hca_type, a.link_layer)]
            if expected is None:
                continue
            self._fams.add_labeled(RATE_EXPECTED, a.labels, expected)
            self._fams.add_labeled(RATE_DEGRADED, a.labels, 1 if a.rate < expected else 0)
