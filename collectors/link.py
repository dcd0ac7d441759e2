"""link collector: speed, MTU, carrier and flaps of the netdevs behind RDMA ports (plus any
interfaces named in the config), the active RDMA MTU, and expected-versus-actual MTU.

Sources: /sys/class/net/<if>/{operstate,carrier,speed,mtu,carrier_changes} (kernel
net/core/net-sysfs.c); RoCE active MTU derived from the netdev MTU as the kernel's iboe_get_mtu()
does (docs/formats.md §1.6); InfiniBand active MTU from ``ibv_devinfo`` (docs/formats.md §7),
which runs in the background on its own interval, never in the scrape.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.background import Refresher
from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec
from gpunet_exporter.config import Field
from gpunet_exporter.sources import rdma
from gpunet_exporter.sources.commands import run_command
from gpunet_exporter.sources.sysfs import parse_int, parse_uint

# RFC 2863 operational states as the kernel prints them (include/uapi/linux/if.h IF_OPER_*).
OPERSTATES = {"unknown": 0, "notpresent": 1, "down": 2, "lowerlayerdown": 3, "testing": 4,
              "dormant": 5, "up": 6}
IB_MTUS = (4096, 2048, 1024, 512, 256)
# GRH 40 + UDP 8 + BTH 12 + XRC 4 + AtomicETH 28 + ICRC 4 (include/rdma/ib_addr.h iboe_get_mtu).
ROCE_HEADER_BYTES = 96


def roce_active_mtu(netdev_mtu: int) -> int | None:
    """The RDMA MTU the kernel derives for a RoCE port from its netdev MTU (9000 -> 4096)."""
    payload = netdev_mtu - ROCE_HEADER_BYTES
    return next((m for m in IB_MTUS if payload >= m), None)


_KV = re.compile(r"^\s*([A-Za-z_]+):\s*(.*?)\s*$")


def parse_ibv_devinfo(text: str) -> dict[tuple[str, str], int]:
    """Active MTU per (device, port) from ``ibv_devinfo`` output; unknown lines are ignored."""
    out: dict[tuple[str, str], int] = {}
    device = port = ""
    for line in text.splitlines():
        m = _KV.match(line)
        if not m:
            continue
        key, value = m.groups()
        if key == "hca_id":
            device, port = value, ""
        elif key == "port":
            port = value
        elif key == "active_mtu" and device and port:
            mtu = parse_uint(value.split(" ", 1)[0])
            if mtu is not None:
                out[(device, port)] = mtu
    return out


_I = ("interface",)
_DP = ("device", "port")
_NET = "/sys/class/net/<interface>"
INFO = MetricSpec(
    "gpunet_link_info", "gauge",
    "Always 1; the RDMA device and port behind the interface (empty for interfaces named only in "
    "the config)", ("interface", "device", "port", "link_layer"), "",
    "/sys/class/infiniband/<device>/ports/<port> netdev mapping")
OPERSTATE = MetricSpec(
    "gpunet_link_operstate_id", "gauge",
    "RFC 2863 operational state: " + ", ".join(f"{v} {k}" for k, v in OPERSTATES.items()),
    _I, "enum", f"{_NET}/operstate")
CARRIER = MetricSpec(
    "gpunet_link_carrier", "gauge", "1 when the interface has carrier, 0 when not; absent while "
    "the interface is administratively down", _I, "boolean", f"{_NET}/carrier")
SPEED = MetricSpec(
    "gpunet_link_speed_bytes_per_second", "gauge",
    "Negotiated link speed (Mb/s x 125000); absent when the driver reports it unknown (-1)", _I,
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
    "Active RDMA (IB transport) MTU of the port: for RoCE derived from the netdev MTU as the "
    "kernel does (netdev MTU - 96 rounded down to 4096/2048/1024/512/256); for InfiniBand the "
    "active_mtu of ibv_devinfo (cached, refreshed in the background)", _DP, "bytes",
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
    "1 if the latest background run of ibv_devinfo succeeded, else 0 (the last good values keep "
    "being served); absent when ibv_devinfo is not installed or no InfiniBand port exists", (),
    "boolean", "ibv_devinfo exit status")
IBV_AGE = MetricSpec(
    "gpunet_link_ibv_devinfo_age_seconds", "gauge",
    "Age of the cached ibv_devinfo values", (), "seconds", "exporter")

_MTU_RULE = Field("map", fields={
    "interface": Field("regex", "interfaces this rule applies to"),
    "device": Field("regex", "RDMA devices this rule applies to"),
    "link_layer": Field("str", "InfiniBand or Ethernet (RoCE)"),
    "mtu": Field("int", "expected netdev MTU in bytes (e.g. 9000 on RoCE)", minimum=68),
    "rdma_mtu": Field("int", "expected active RDMA MTU in bytes (e.g. 4096)", minimum=256),
})


def _rule_matches(rule: Mapping[str, Any], interface: str, device: str, layer: str) -> bool:
    return (("interface" not in rule or bool(interface and rule["interface"].search(interface)))
            and ("device" not in rule or bool(device and rule["device"].search(device)))
            and rule.get("link_layer", layer) == layer)


class LinkCollector(Collector):
    name = "link"
    description = "Speed, MTU, carrier and flaps of RDMA netdevs; active RDMA MTU; expected MTU"
    metrics = (INFO, OPERSTATE, CARRIER, SPEED, MTU, CARRIER_CHANGES, MTU_EXPECTED, MTU_MISMATCH,
               RDMA_MTU, RDMA_MTU_EXPECTED, RDMA_MTU_MISMATCH, IBV_SUCCESS, IBV_AGE)
    config_fields: ClassVar[Mapping[str, Field]] = {
        "interfaces": Field("list", "extra interfaces to report besides RDMA netdevs",
                            item=Field("str")),
        "interface_exclude": Field("regex", "skip interfaces whose name matches"),
        "expected_mtu": Field("list", "expected MTUs; the first matching rule that sets a value "
                              "wins", item=_MTU_RULE),
        "ibv_devinfo": Field("map", "the ibv_devinfo run giving InfiniBand active MTUs", fields={
            "enabled": Field("bool", default=True),
            "path": Field("str", "program name or path", default="ibv_devinfo"),
            "timeout_seconds": Field("number", default=10, minimum=0.1),
            "interval_seconds": Field("number", default=300, minimum=1),
        }, default={}),  # absent: the defaults of its keys
    }

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self._ibv: Refresher[dict[tuple[str, str], int]] | None = None
        self._ibv_cfg: Mapping[str, Any] = ctx.config["ibv_devinfo"]

    def _devinfo(self) -> Refresher[dict[tuple[str, str], int]] | None:
        """Started on the first scrape that sees an InfiniBand port, if the tool is installed."""
        if self._ibv is None and self._ibv_cfg["enabled"]:
            path = shutil.which(self._ibv_cfg["path"])
            if path is None:
                self.ctx.log_once(logging.DEBUG, "%s not installed: no InfiniBand active MTU",
                                  self._ibv_cfg["path"])
                return None
            timeout = float(self._ibv_cfg["timeout_seconds"])
            self._ibv = Refresher(
                "ibv_devinfo", float(self._ibv_cfg["interval_seconds"]),
                lambda: parse_ibv_devinfo(run_command([path], timeout)), self.ctx.log_once)
            self._ibv.refresh()  # the first scrape waits once, so it has data
            self._ibv.start()
        return self._ibv

    def collect(self) -> Iterator[Metric]:
        cfg, root, fams = self.ctx.config, self.ctx.sysfs, Families()
        exclude = cfg.get("interface_exclude")
        rules: list[Mapping[str, Any]] = cfg.get("expected_mtu") or []
        ports = self.ctx.rdma().ports()
        seen: dict[str, rdma.Port | None] = {}
        for p in ports:
            if p.netdev and p.netdev not in seen:
                seen[p.netdev] = p
        for name in rdma.extra_netdevs(root, cfg.get("interfaces") or [], seen,
                                       self.ctx.log_once):
            seen[name] = None
        netdev_mtu: dict[str, int] = {}
        for ifname, port in seen.items():
            if exclude is not None and exclude.search(ifname):
                continue
            mtu = self._netdev(fams, ifname, port)
            if mtu is not None:
                netdev_mtu[ifname] = mtu
                layer = port.link_layer if port else ""
                want = next((r["mtu"] for r in rules if "mtu" in r
                             and _rule_matches(r, ifname, port.device if port else "", layer)),
                            None)
                if want is not None:
                    fams.add(MTU_EXPECTED, [ifname], want)
                    fams.add(MTU_MISMATCH, [ifname], int(mtu != want))

        devinfo = self._devinfo() if any(p.link_layer == "InfiniBand" for p in ports) else None
        ib_mtus = (devinfo.value if devinfo else None) or {}
        for p in ports:
            if p.link_layer == "Ethernet":
                nmtu = netdev_mtu.get(p.netdev)
                active = roce_active_mtu(nmtu) if nmtu is not None else None
            else:
                active = ib_mtus.get((p.device, p.port))
            if active is None:
                continue
            fams.add(RDMA_MTU, [p.device, p.port], active)
            want = next((r["rdma_mtu"] for r in rules if "rdma_mtu" in r
                         and _rule_matches(r, p.netdev, p.device, p.link_layer)), None)
            if want is not None:
                fams.add(RDMA_MTU_EXPECTED, [p.device, p.port], want)
                fams.add(RDMA_MTU_MISMATCH, [p.device, p.port], int(active != want))
        if devinfo is not None and devinfo.ok is not None:
            fams.add(IBV_SUCCESS, [], int(devinfo.ok))
            age = devinfo.age()
            if age is not None:
                fams.add(IBV_AGE, [], age)
        return iter(fams)

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
