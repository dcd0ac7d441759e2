"""link collector: speed, MTU, carrier and flaps of the netdevs behind RDMA ports (plus any
interfaces named in the config), the active RDMA MTU, and expected-versus-actual MTU.

Reads /sys/class/net/<if>/{operstate,carrier,speed,mtu,carrier_changes}; the RoCE active MTU is
derived from the netdev MTU as the kernel's iboe_get_mtu() does (docs/formats.md §1.6), the
InfiniBand one comes from ``ibv_devinfo`` (§7) run in a background.Refresher, never in the scrape.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.background import Fresh, Refresher, add_freshness, last_success_spec
from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec, Scrape
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.sources import rdma
from gpunet_exporter.sources.commands import run_command
from gpunet_exporter.sources.ibv_devinfo import parse_ibv_devinfo
from gpunet_exporter.sources.rdma import roce_active_mtu
from gpunet_exporter.sources.sysfs import parse_int

# RFC 2863 operational states as the kernel prints them (include/uapi/linux/if.h IF_OPER_*).
OPERSTATES = {"unknown": 0, "notpresent": 1, "down": 2, "lowerlayerdown": 3, "testing": 4,
              "dormant": 5, "up": 6}
_I = ("interface",)
_DP = ("device", "port")
_NET = "/sys/class/net/<interface>"
INFO = MetricSpec(
    "gpunet_link_info", "gauge",
    "Always 1: the RDMA device and port behind the interface",
    ("interface", "device", "port", "link_layer"), "",
    "/sys/class/infiniband/<device>/ports/<port> netdev mapping")
OPERSTATE = MetricSpec(
    "gpunet_link_operstate_id", "gauge",
    "RFC 2863 operational state as the kernel numbers it (6 up, 2 down, 5 dormant)",
    _I, "enum", f"{_NET}/operstate")
CARRIER = MetricSpec(
    "gpunet_link_carrier",
    "gauge", "1 when the interface has carrier, else 0", _I, "boolean", f"{_NET}/carrier")
SPEED = MetricSpec(
    "gpunet_link_speed_bytes_per_second", "gauge",
    "Negotiated link speed (Mb/s x 125000)", _I,
    "bytes per second", f"{_NET}/speed")
MTU = MetricSpec("gpunet_link_mtu_bytes", "gauge", "Netdev MTU", _I, "bytes", f"{_NET}/mtu")
CARRIER_CHANGES = MetricSpec(
    "gpunet_link_carrier_changes_total", "counter",
    "Carrier up and down transitions (link flaps) since the interface was created", _I,
    "transitions", f"{_NET}/carrier_changes")
MTU_EXPECTED = MetricSpec(
    "gpunet_link_mtu_expected_bytes", "gauge",
    "Netdev MTU the first matching link.expected_mtu rule of the config asks for", _I, "bytes",
    "config file")
MTU_MISMATCH = MetricSpec(
    "gpunet_link_mtu_mismatch", "gauge",
    "1 when the netdev MTU differs from the expected MTU, else 0", _I, "boolean",
    f"{_NET}/mtu and config file")
RDMA_MTU = MetricSpec(
    "gpunet_link_rdma_active_mtu_bytes", "gauge",
    "Active RDMA (IB transport) MTU of the port", _DP, "bytes",
    "/sys/class/net/<netdev>/mtu (RoCE) or ibv_devinfo active_mtu (InfiniBand)")
RDMA_MTU_EXPECTED = MetricSpec(
    "gpunet_link_rdma_mtu_expected_bytes", "gauge",
    "Active RDMA MTU the first matching link.expected_mtu rule asks for", _DP, "bytes",
    "config file")
RDMA_MTU_MISMATCH = MetricSpec(
    "gpunet_link_rdma_mtu_mismatch", "gauge",
    "1 when the active RDMA MTU differs from the expected one, else 0", _DP, "boolean",
    "ibv_devinfo or netdev MTU, and config file")
IBV_SUCCESS = MetricSpec(
    "gpunet_link_ibv_devinfo_refresh_success", "gauge",
    "1 if the latest background run of ibv_devinfo succeeded, else 0",
    (), "boolean", "ibv_devinfo exit status")
IBV_LAST_SUCCESS = last_success_spec("gpunet_link_ibv_devinfo", "background run of ibv_devinfo")


@dataclass(frozen=True, kw_only=True)
class MtuRule(Settings):
    """One rule of link.expected_mtu."""

    interface: re.Pattern[str] | None = setting("netdevs this rule applies to (unset: every "
                                                "netdev)")
    device: re.Pattern[str] | None = setting("RDMA devices this rule applies to (unset: every "
                                             "device)")
    link_layer: str | None = setting("the link layer this rule applies to, `InfiniBand` or "
                                     "`Ethernet` (RoCE) (unset: both)")
    mtu: int | None = setting("expected netdev MTU in bytes, e.g. 9000 on RoCE", minimum=68)
    rdma_mtu: int | None = setting("expected active RDMA MTU in bytes, e.g. 4096", minimum=256)

    def matches(self, interface: str, device: str, layer: str) -> bool:
        return ((self.interface is None or bool(interface and self.interface.search(interface)))
                and (self.device is None or bool(device and self.device.search(device)))
                and self.link_layer in (None, layer))


@dataclass(frozen=True)
class IbvDevinfoSettings(Settings):
    """link.ibv_devinfo."""

    enabled: bool = setting("run it", default=True)
    path: str = setting("program name (looked up in PATH) or path", default="ibv_devinfo")
    timeout_seconds: float = setting("how long one run may take", default=10, minimum=0.1)
    interval_seconds: float = setting("how often it runs", default=300, minimum=1)


@dataclass(frozen=True)
class LinkSettings(Settings):
    interfaces: tuple[str, ...] = setting(
        "netdevs to report in addition to those behind RDMA ports (a name that does not exist "
        "is logged once as a warning)", default=())
    interface_exclude: re.Pattern[str] | None = setting("netdevs not to report")
    expected_mtu: tuple[MtuRule, ...] = setting(
        "expected MTUs: the netdev MTU is the first matching rule's `mtu`, the active RDMA MTU "
        "the first matching rule's `rdma_mtu` (rules without it are passed over)", default=())
    ibv_devinfo: IbvDevinfoSettings = setting(
        "the background `ibv_devinfo` run that gives InfiniBand active MTUs",
        default=IbvDevinfoSettings())


class LinkCollector(Collector):
    name = "link"
    description = "Speed, MTU, carrier and flaps of RDMA netdevs; active RDMA MTU; expected MTU"
    metrics = (INFO, OPERSTATE, CARRIER, SPEED, MTU, CARRIER_CHANGES, MTU_EXPECTED, MTU_MISMATCH,
               RDMA_MTU, RDMA_MTU_EXPECTED, RDMA_MTU_MISMATCH, IBV_SUCCESS, IBV_LAST_SUCCESS)
    settings_type = LinkSettings
    settings: LinkSettings
    unknown_checks: ClassVar[Mapping[str, str]] = {
        "ib_mtu": "the active MTU of InfiniBand ports and its expected value "
                  "(`gpunet_link_rdma_active_mtu_bytes`): ibv_devinfo reads it"}

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self._ibv: Refresher[dict[tuple[str, str], int]] | None = None
        self._ibv_cfg = self.settings.ibv_devinfo
        self._unknown: Mapping[str, str] = {}

    def _devinfo(self) -> Refresher[dict[tuple[str, str], int]] | None:
        """Started on the first scrape that sees an InfiniBand port, if the tool is installed;
        its thread runs the first round at once. No refresh timeout of its own: run_command
        kills ibv_devinfo after ``timeout_seconds``."""
        if self._ibv is None and self._ibv_cfg.enabled:
            path = shutil.which(self._ibv_cfg.path)
            if path is None:
                self.ctx.log_once(logging.DEBUG, "%s not installed: no InfiniBand active MTU",
                                  self._ibv_cfg.path)
                return None
            timeout = float(self._ibv_cfg.timeout_seconds)
            self._ibv = Refresher(
                "ibv_devinfo", float(self._ibv_cfg.interval_seconds),
                lambda: parse_ibv_devinfo(run_command([path], timeout)), self.ctx.log_once)
            self._ibv.start()
        return self._ibv

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        cfg, root, fams = self.settings, self.ctx.sysfs, Families()
        exclude = cfg.interface_exclude
        rules = cfg.expected_mtu
        ports = scrape.rdma(root).ports()
        seen: dict[str, rdma.Port | None] = {}
        for p in ports:
            if p.netdev and p.netdev not in seen:
                seen[p.netdev] = p
        for name in rdma.extra_netdevs(root, cfg.interfaces, seen,
                                       self.ctx.log_once):
            seen[name] = None
        has_ib = any(p.link_layer == "InfiniBand" for p in ports)
        # Started before the netdevs are read, so that a first run overlaps with them.
        devinfo = self._devinfo() if has_ib else None
        netdev_mtu: dict[str, int] = {}
        for ifname, port in seen.items():
            if exclude is not None and exclude.search(ifname):
                continue
            mtu = self._netdev(fams, ifname, port)
            if mtu is not None:
                netdev_mtu[ifname] = mtu
                layer = port.link_layer if port else ""
                want = next((r.mtu for r in rules if r.mtu is not None
                             and r.matches(ifname, port.device if port else "", layer)), None)
                if want is not None:
                    fams.add(MTU_EXPECTED, [ifname], want)
                    fams.add(MTU_MISMATCH, [ifname], int(mtu != want))

        fresh: Fresh[dict[tuple[str, str], int]] = (
            devinfo.wait_first(scrape.deadline) if devinfo else Fresh())
        ib_mtus = fresh.value or {}
        for p in ports:
            if p.link_layer == "Ethernet":
                nmtu = netdev_mtu.get(p.netdev)
                active = roce_active_mtu(nmtu) if nmtu is not None else None
            else:
                active = ib_mtus.get((p.device, p.port))
            if active is None:
                continue
            fams.add(RDMA_MTU, [p.device, p.port], active)
            want = next((r.rdma_mtu for r in rules if r.rdma_mtu is not None
                         and r.matches(p.netdev, p.device, p.link_layer)), None)
            if want is not None:
                fams.add(RDMA_MTU_EXPECTED, [p.device, p.port], want)
                fams.add(RDMA_MTU_MISMATCH, [p.device, p.port], int(active != want))
        if devinfo is not None:
            add_freshness(fams, IBV_SUCCESS, IBV_LAST_SUCCESS, [], fresh)
        self._unknown = {}
        if self._ibv_cfg.enabled and has_ib:
            if devinfo is None:
                self._unknown = {"ib_mtu": "tool_missing"}
            elif fresh.ok is False and fresh.value is None:
                self._unknown = {"ib_mtu": "tool_failing"}
        return iter(fams)

    def unknown(self) -> Mapping[str, str]:
        """``ib_mtu`` while InfiniBand ports are present and ibv_devinfo, enabled, is not
        installed or has not succeeded once (its last good values are served while it fails
        later); nothing while it is switched off (``link.ibv_devinfo.enabled: false``)."""
        return self._unknown

    def _netdev(self, fams: Families, ifname: str, port: rdma.Port | None) -> int | None:
        """Emit one interface's series; returns its MTU when readable."""
        base = f"class/net/{ifname}"
        root = self.ctx.sysfs
        if not root.exists(base):
            self.ctx.logger.debug("interface %s vanished during the scrape", ifname)
            return None
        fams.add(INFO, [ifname, port.device if port else "", port.port if port else "",
                        port.link_layer if port else ""], 1)
        values: dict[str, str] = {}
        try:
            files = root.read_many(base, ("operstate", "carrier", "speed", "mtu",
                                          "carrier_changes"))
        except OSError:
            files = {}
        for attr, content in files.items():
            if not isinstance(content, OSError):
                values[attr] = content
            # carrier and speed fail with EINVAL on a down or virtual interface: no value.
            elif attr not in ("carrier", "speed"):
                self.ctx.skip(f"{base}/{attr}", content.strerror or content)
        shared = {"interface": ifname}  # one dict for the interface's series
        state = values.get("operstate")
        if state is not None:
            if state in OPERSTATES:
                fams.add_labeled(OPERSTATE, shared, OPERSTATES[state])
            else:
                self.ctx.skip(f"{base}/operstate", f"unknown state {state[:20]!r}")
        for attr, spec, scale in (("carrier", CARRIER, 1), ("speed", SPEED, 125_000),
                                  ("mtu", MTU, 1), ("carrier_changes", CARRIER_CHANGES, 1)):
            text = values.get(attr)
            if text is None:
                continue
            value = parse_int(text)
            if value is None:
                self.ctx.skip(f"{base}/{attr}", f"unparseable {text[:40]!r}")
            elif value >= 0:  # speed -1 means unknown
                fams.add_labeled(spec, shared, value * scale)
        mtu = parse_int(values.get("mtu", ""))
        return mtu if mtu is not None and mtu > 0 else None

    def device_event(self, subsystem: str, action: str, properties: Mapping[str, str]) -> None:
        """An RDMA device came, went or was renamed: run ibv_devinfo now rather than at the end
        of its interval (a re-added port's active MTU, a removed one's dropped). Netdevs need
        nothing: their files are read on every scrape."""
        if subsystem == "infiniband" and action in ("add", "remove", "move") and self._ibv:
            self._ibv.wake()

    def close(self) -> None:
        if self._ibv is not None:
            self._ibv.stop()
