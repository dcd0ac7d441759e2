"""nic collector: the pluggable modules (transceivers, cables) of the netdevs behind RoCE ports
(temperature, per-lane receive and transmit power, and the module's own thresholds) and the
NIC's devlink health reporters (firmware, tx and rx queues), both read in one background round.

Module EEPROM: sources/transceiver.py (ethtool netlink, or ``ethtool -m``); reporters:
sources/devlink.py (devlink netlink, or ``devlink -j health show``). Formats: docs/formats.md
§12-13; design notes: docs/architecture.md, "collectors".
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.background import Fresh, Refresher, add_freshness, last_success_spec
from gpunet_exporter.collector import (
    Collector,
    CollectorContext,
    Families,
    MetricSpec,
    Privilege,
    Scrape,
)
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.sources import rdma
from gpunet_exporter.sources.devlink import (
    CommandHealthReader,
    HealthReader,
    NetlinkHealthReader,
    Reporter,
)
from gpunet_exporter.sources.transceiver import (
    CommandEepromReader,
    EepromReader,
    Module,
    NetlinkEepromReader,
    read_module,
)

_I = ("interface",)
_EEPROM = "module EEPROM (ethtool -m <interface>)"
_THRESHOLD = "module EEPROM threshold page (SFF-8636 page 03h, CMIS page 02h)"
_LEVEL = ("interface", "level")
_LANE = ("interface", "lane")
_REPORTER = ("device", "handle", "reporter")
_DEVLINK = "devlink health show"

TRANSCEIVER_INFO = MetricSpec(
    "gpunet_nic_transceiver_info", "gauge",
    "Always 1: the module in the interface's cage, its form factor, memory map and maker",
    ("interface", "identifier", "spec", "vendor", "part_number"), "", _EEPROM)
TEMPERATURE = MetricSpec(
    "gpunet_nic_transceiver_temperature_celsius", "gauge", "The module's internal temperature",
    _I, "degrees Celsius", _EEPROM)
RX_POWER = MetricSpec(
    "gpunet_nic_transceiver_rx_power_watts", "gauge",
    "Optical power received on the module's media lane", _LANE, "watts", _EEPROM)
TX_POWER = MetricSpec(
    "gpunet_nic_transceiver_tx_power_watts", "gauge",
    "Optical power the module transmits on its media lane", _LANE, "watts", _EEPROM)
TEMPERATURE_THRESHOLD = MetricSpec(
    "gpunet_nic_transceiver_temperature_threshold_celsius", "gauge",
    "The module's own alarm or warning threshold of its temperature", _LEVEL,
    "degrees Celsius", _THRESHOLD)
RX_POWER_THRESHOLD = MetricSpec(
    "gpunet_nic_transceiver_rx_power_threshold_watts", "gauge",
    "The module's own alarm or warning threshold of each lane's received power", _LEVEL,
    "watts", _THRESHOLD)
TX_POWER_THRESHOLD = MetricSpec(
    "gpunet_nic_transceiver_tx_power_threshold_watts", "gauge",
    "The module's own alarm or warning threshold of each lane's transmitted power", _LEVEL,
    "watts", _THRESHOLD)
TRANSCEIVER_SUCCESS = MetricSpec(
    "gpunet_nic_transceiver_refresh_success", "gauge",
    "1 if the latest background read of the interface's module EEPROM succeeded, else 0", _I,
    "boolean", "ethtool netlink or ethtool -m")
TRANSCEIVER_LAST_SUCCESS = last_success_spec(
    "gpunet_nic_transceiver", "background read of the interface's module EEPROM", _I)
HEALTHY = MetricSpec(
    "gpunet_nic_health_reporter_healthy", "gauge",
    "1 when the devlink health reporter is healthy, 0 in error (not recovered)", _REPORTER,
    "boolean", _DEVLINK)
ERRORS = MetricSpec(
    "gpunet_nic_health_reporter_errors_total", "counter",
    "Errors the devlink health reporter has reported since the driver loaded", _REPORTER,
    "errors", _DEVLINK)
RECOVERIES = MetricSpec(
    "gpunet_nic_health_reporter_recoveries_total", "counter",
    "Recoveries (automatic or requested) the devlink health reporter has run", _REPORTER,
    "recoveries", _DEVLINK)
HEALTH_SUCCESS = MetricSpec(
    "gpunet_nic_health_refresh_success", "gauge",
    "1 if the latest background read of the devlink health reporters succeeded, else 0", (),
    "boolean", "devlink netlink or devlink -j health show")
HEALTH_LAST_SUCCESS = last_success_spec(
    "gpunet_nic_health", "background read of the devlink health reporters")

THRESHOLD_SPECS = {"temperature": TEMPERATURE_THRESHOLD, "rx_power": RX_POWER_THRESHOLD,
                   "tx_power": TX_POWER_THRESHOLD}
SPECS = (TRANSCEIVER_INFO, TEMPERATURE, RX_POWER, TX_POWER, TEMPERATURE_THRESHOLD,
         RX_POWER_THRESHOLD, TX_POWER_THRESHOLD, TRANSCEIVER_SUCCESS, TRANSCEIVER_LAST_SUCCESS,
         HEALTHY, ERRORS, RECOVERIES, HEALTH_SUCCESS, HEALTH_LAST_SUCCESS)


@dataclass(frozen=True)
class EthtoolSettings(Settings):
    """nic.ethtool."""

    path: str = setting("program name (looked up in PATH) or path", default="ethtool")
    timeout_seconds: float = setting("how long one page read may take", default=5, minimum=0.1)


@dataclass(frozen=True)
class DevlinkSettings(Settings):
    """nic.devlink."""

    path: str = setting("program name (looked up in PATH) or path", default="devlink")
    timeout_seconds: float = setting("how long one run may take", default=5, minimum=0.1)


@dataclass(frozen=True)
class NicSettings(Settings):
    interfaces: tuple[str, ...] = setting("netdevs whose modules are read in addition to those "
                                          "behind RoCE ports", default=())
    interval_seconds: float = setting("how often modules and health reporters are read in the "
                                      "background", default=60, minimum=1)
    transceivers: bool = setting("read the modules of the interfaces (CAP_NET_ADMIN); false: "
                                 "no transceiver series, and no unknown check", default=True)
    infiniband_transceivers: bool = setting(
        "also try the IPoIB netdevs of InfiniBand ports: mlx5's IPoIB driver cannot read "
        "modules, so they show the transceiver check as unknown until this is set to false "
        "(their modules then unchecked here: watch them from the fabric's tools)", default=True)
    eeprom_source: str = setting(
        "how module EEPROM pages are read: `netlink`, in-process through ethtool netlink; "
        "`ethtool`, by running `ethtool -m IF raw on ...` (to replay captures through a "
        "stand-in program)", default="netlink", choices=("netlink", "ethtool"))
    ethtool: EthtoolSettings = setting("the `ethtool` program, for `eeprom_source: ethtool`",
                                       default=EthtoolSettings())
    health_reporters: bool = setting("read the devlink health reporters; false: no reporter "
                                     "series, and no unknown check", default=True)
    health_source: str = setting(
        "how reporters are read: `netlink`, in-process through devlink netlink; `devlink`, by "
        "running `devlink -j health show`", default="netlink", choices=("netlink", "devlink"))
    devlink: DevlinkSettings = setting("the `devlink` program, for `health_source: devlink`",
                                       default=DevlinkSettings())


@dataclass(frozen=True)
class _Round:
    """What one background round found."""

    modules: Mapping[str, Fresh[Module]]
    reporters: Fresh[list[Reporter]]
    unknown: Mapping[str, str]
    skipped_infiniband: int
    by_pci: Mapping[str, str]  # PCI address -> RDMA device name, as the round saw them


_WHY = {errno.EOPNOTSUPP: "not_supported", errno.EPERM: "privilege_missing",
        errno.EACCES: "privilege_missing"}


class NicCollector(Collector):
    name = "nic"
    description = ("NIC module and firmware health: transceiver temperature, per-lane optical "
                   "power and the module's thresholds (module EEPROM), and devlink health "
                   "reporters, read in the background")
    metrics = SPECS
    settings_type = NicSettings
    settings: NicSettings
    privileges = (Privilege("module EEPROM of the interfaces (ethtool netlink)",
                            ("CAP_NET_ADMIN",), "transceivers"),)
    unknown_checks: ClassVar[Mapping[str, str]] = {
        "transceiver": "the modules' temperature and optical power against their thresholds "
                       "(`gpunet_nic_transceiver_rx_power_watts`)",
        "health_reporters": "the NIC's firmware and queue health "
                            "(`gpunet_nic_health_reporter_healthy`)"}

    def __init__(self, ctx: CollectorContext, eeprom: EepromReader | None = None,
                 health: HealthReader | None = None) -> None:
        super().__init__(ctx)
        cfg = self.settings
        if eeprom is None:
            eeprom = (CommandEepromReader(cfg.ethtool.path, float(cfg.ethtool.timeout_seconds))
                      if cfg.eeprom_source == "ethtool" else NetlinkEepromReader())
        if health is None:
            health = (CommandHealthReader(cfg.devlink.path, float(cfg.devlink.timeout_seconds))
                      if cfg.health_source == "devlink" else NetlinkHealthReader())
        self.eeprom, self.health = eeprom, health
        self._last = _Round({}, Fresh(), {}, 0, {})
        self._refresher: Refresher[_Round] = Refresher(
            "nic", float(cfg.interval_seconds), lambda: self.refresh(), self.ctx.log_once)

    # -- what is read ----------------------------------------------------------------------

    def interfaces(self) -> tuple[list[str], int]:
        """Netdevs behind RoCE ports (and, with infiniband_transceivers, IPoIB ones), then
        configured ones that exist; and how many InfiniBand ports were left out."""
        root, cfg = self.ctx.sysfs, self.settings
        names: list[str] = []
        skipped = 0
        for p in rdma.all_ports(root):
            if not p.netdev or p.netdev in names:
                continue
            if p.link_layer == "Ethernet" or (p.link_layer == "InfiniBand"
                                              and cfg.infiniband_transceivers):
                names.append(p.netdev)
            elif p.link_layer == "InfiniBand":
                skipped += 1
        names += rdma.extra_netdevs(root, cfg.interfaces, names, self.ctx.log_once)
        return names, skipped

    def devices_by_pci(self) -> dict[str, str]:
        """PCI address -> RDMA device name, from /sys/class/infiniband/<device>/device."""
        out: dict[str, str] = {}
        for dev in rdma.devices(self.ctx.sysfs):
            address = rdma.pci_address(self.ctx.sysfs, dev)
            if address:
                out.setdefault(address, dev)
        return out

    # -- background ------------------------------------------------------------------------

    def refresh(self) -> _Round:
        """One round: every interface's module, then the reporters (the background thread)."""
        cfg, old = self.settings, self._last
        unknown: dict[str, str] = {}
        modules: dict[str, Fresh[Module]] = {}
        names, skipped = self.interfaces() if cfg.transceivers else ([], 0)
        for ifname in names:
            before = old.modules.get(ifname, Fresh[Module]())
            try:
                module = read_module(self.eeprom, ifname)
            except OSError as exc:
                why = _WHY.get(exc.errno or 0)
                if exc.errno == errno.ENODEV:  # gone, or a sysfs tree of another machine
                    self.ctx.log_once(logging.DEBUG, "no interface %s in this network "
                                      "namespace: its module is not read", ifname)
                    continue
                if why is not None or (exc.errno == errno.ENOENT
                                       and cfg.eeprom_source == "ethtool"):
                    unknown["transceiver"] = why or "tool_missing"
                    self.ctx.log_once(logging.INFO, "the module of %s cannot be read: %s",
                                      ifname, exc.strerror or exc)
                    continue
                self.ctx.log_once(logging.WARNING, "reading the module EEPROM of %s failed: %s",
                                  ifname, exc.strerror or exc)
                modules[ifname] = before.failed()
                continue
            except ValueError as exc:
                self.ctx.log_once(logging.WARNING, "the module EEPROM of %s does not decode: "
                                  "%s", ifname, exc)
                modules[ifname] = before.failed()
                continue
            modules[ifname] = Fresh(module, True, time.time())
        reporters: Fresh[list[Reporter]] = Fresh()
        by_pci: dict[str, str] = {}
        if cfg.health_reporters:
            by_pci = self.devices_by_pci()
            reporters, why = self._read_health(old.reporters, by_pci)
            if why:
                unknown["health_reporters"] = why
        self._last = _Round(modules, reporters, unknown, skipped, by_pci)
        return self._last

    def _read_health(self, old: Fresh[list[Reporter]], by_pci: Mapping[str, str]
                     ) -> tuple[Fresh[list[Reporter]], str]:
        """The reporters and, when mlx5 devices (of ``by_pci``, devices_by_pci) should have
        some and none can be seen, why."""
        try:
            found = self.health.read()
        except OSError as exc:
            if exc.errno == errno.ENOENT:  # no devlink family, or no devlink program
                self.ctx.log_once(logging.INFO, "devlink health reporters cannot be read: %s",
                                  exc.strerror or exc)
                why = ("tool_missing" if self.settings.health_source == "devlink"
                       else "not_supported")
                mlx5 = any(d.startswith("mlx5_") for d in by_pci.values())
                return Fresh(), why if mlx5 else ""
            self.ctx.log_once(logging.WARNING, "reading the devlink health reporters failed: "
                              "%s", exc.strerror or exc)
            return old.failed(), ""
        seen = {r.bus_device for r in found}
        # mlx5 registers fw and fw_fatal on every physical function: an mlx5 device with none
        # is one whose devlink instance this network namespace does not see.
        hidden = [a for a, dev in by_pci.items()
                  if dev.startswith("mlx5_") and f"pci/{a}" not in seen]
        if hidden:
            self.ctx.log_once(logging.INFO, "no devlink health reporters of %s in this network "
                              "namespace", ", ".join(sorted(hidden)))
        return Fresh(found, True, time.time()), "not_supported" if hidden else ""

    # -- scrape ----------------------------------------------------------------------------

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        self._refresher.start()
        fresh = self._refresher.wait_first(scrape.deadline)
        state = self._last
        fams = Families()
        for ifname, mod in sorted(state.modules.items()):
            self._module(fams, ifname, mod)
        if self.settings.health_reporters:
            for r in state.reporters.value or ():
                device = state.by_pci.get(r.bus_device.partition("/")[2], "")
                labels = [device, r.handle, r.name]
                fams.add(HEALTHY, labels, int(r.state == "healthy"))
                fams.add(ERRORS, labels, r.errors)
                fams.add(RECOVERIES, labels, r.recoveries)
            # A round that failed as a whole (an exception) fails the reporters too.
            add_freshness(fams, HEALTH_SUCCESS, HEALTH_LAST_SUCCESS, [], state.reporters,
                          ok=False if fresh.ok is False and state.reporters.ok else None)
        return iter(fams)

    def _module(self, fams: Families, ifname: str, fresh: Fresh[Module]) -> None:
        add_freshness(fams, TRANSCEIVER_SUCCESS, TRANSCEIVER_LAST_SUCCESS, [ifname], fresh)
        m = fresh.value
        if m is None:
            return
        fams.add(TRANSCEIVER_INFO, [ifname, m.identifier_name, m.spec, m.vendor,
                                    m.part_number], 1)
        if m.temperature is not None:
            fams.add(TEMPERATURE, [ifname], m.temperature)
        for spec, values in ((RX_POWER, m.rx_power), (TX_POWER, m.tx_power)):
            for lane, watts in enumerate(values, 1):
                fams.add(spec, [ifname, str(lane)], watts)
        for quantity, levels in m.thresholds.items():
            for level, value in levels.items():
                fams.add(THRESHOLD_SPECS[quantity], [ifname, level], value)

    def unknown(self) -> Mapping[str, str]:
        """``transceiver`` when an interface's module cannot be read by its driver
        (``not_supported``), without CAP_NET_ADMIN (``privilege_missing``) or without the
        `ethtool` program (``tool_missing``); ``health_reporters`` when mlx5 devices are present
        and the kernel has no devlink, the devlink instances are in another network namespace
        (``not_supported``) or the `devlink` program is missing (``tool_missing``)."""
        return self._last.unknown

    def summary(self) -> str:
        s = self._last
        parts = [f"{sum(1 for m in s.modules.values() if m.value is not None)} modules read"]
        if s.skipped_infiniband:
            parts.append(f"{s.skipped_infiniband} InfiniBand ports' modules not read "
                         "(nic.infiniband_transceivers)")
        return ", ".join(parts)

    def device_event(self, subsystem: str, action: str, properties: Mapping[str, str]) -> None:
        """A netdev or RDMA device came or went (a module swapped with its link): read again."""
        if subsystem in ("net", "infiniband") and action in ("add", "remove", "move"):
            self._refresher.wake()

    def close(self) -> None:
        self._refresher.stop()
        self.eeprom.close()
        self.health.close()
