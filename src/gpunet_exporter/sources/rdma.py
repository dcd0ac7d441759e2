"""RDMA device and port discovery under /sys/class/infiniband, shared by the collectors.

:class:`Snapshot` is one listing of the devices, their ports, link layers and netdevs; a scrape
builds one and every collector of that scrape reads it (CollectorContext.rdma()). Counters and
states are not in it: each collector reads those itself. Formats: docs/formats.md §1.1.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field, replace

from gpunet_exporter.sources.sysfs import Root, parse_int, parse_uint

CLASS = "class/infiniband"
_PCI_ADDRESS = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# A RoCE port's GID table has up to 255 slots; the netdev is nearly always in slot 0 or 1.
_GID_SLOTS_TRIED = 8
BYTES_PER_GBIT = 125_000_000
# "%d%s Gb/sec (%dX%s)": rate, lanes, optional speed name (absent on old kernels for SDR).
_RATE = re.compile(r"^(\d+)(\.5)? Gb/sec \((\d+)X(?: (\w+))?\)$")


@dataclass(frozen=True)
class Port:
    device: str
    port: str
    link_layer: str  # "" when it could not be read
    netdev: str  # "" when the port has none
    # Why ``link_layer`` could not be read; None when it was.
    link_layer_error: OSError | None = field(default=None, compare=False)
    # False for a port that by design carries no data (see :func:`carries_data`).
    data: bool = True

    @property
    def dir(self) -> str:
        return f"{CLASS}/{self.device}/ports/{self.port}"


@dataclass(frozen=True)
class Device:
    """An RDMA device as one listing found it: its ports in numeric order, or ``error`` (then no
    ports) when ``ports/`` could not be listed, because the device went away or is unreadable."""

    name: str
    ports: tuple[Port, ...]
    error: OSError | None = field(default=None, compare=False)


def _select(names: Iterable[str], include: re.Pattern[str] | None,
            exclude: re.Pattern[str] | None) -> list[str]:
    return [n for n in names
            if (include is None or include.search(n)) and not (exclude and exclude.search(n))]


def read_device(root: Root, name: str) -> Device:
    """One device's ports, link layers and netdevs, read now."""
    try:
        numbers = ports(root, name)
    except OSError as exc:
        return Device(name, (), exc)
    out = []
    for p in numbers:
        error = None
        try:
            layer = root.read(f"{CLASS}/{name}/ports/{p}/link_layer")
        except OSError as exc:
            layer, error = "", exc
        out.append(Port(name, p, layer, netdev(root, name, p, layer, len(numbers) > 1), error))
    return Device(name, tuple(carries_data(out)))


def carries_data(ports: list[Port]) -> list[Port]:
    """The ports of one device, each marked whether it can carry data (docs/formats.md §1.8).

    A multi-plane ConnectX-8 in RoCE mode lists many ports of which only some carry data, each
    with its netdev (scitix/sichek #98: 12 ports, data on 3/6/9/12). A RoCE port cannot carry
    RoCE traffic without a netdev behind its GIDs, so on a device where some Ethernet port has
    a netdev, an Ethernet port without one is marked ``data=False``. A single-port device, an
    InfiniBand port and an EFA port (link layer "Unknown") are always data ports here;
    ``infiniband.data_ports`` overrides this in the collector.
    """
    if len(ports) < 2 or not any(p.link_layer == "Ethernet" and p.netdev for p in ports):
        return ports
    return [p if p.link_layer != "Ethernet" or p.netdev else replace(p, data=False)
            for p in ports]


class Snapshot:
    """The RDMA devices under a root, their ports, link layers and netdevs, each read once.

    The device names are listed when the snapshot is made; a device's ports (and their link
    layers and netdevs) when it is first asked for, so a device that every reader filters out
    is never read. Thread-safe: collectors of one scrape run in threads of their own, and a
    device asked for by two at once is read by one while the other waits for it. A device gone
    after the listing has ``error`` set (or, gone later still, files that fail to read), which
    costs its own values only.
    """

    def __init__(self, root: Root) -> None:
        self.root = root
        try:
            self.names: tuple[str, ...] = tuple(root.listdir(CLASS))
        except OSError:  # no class directory: no RDMA hardware
            self.names = ()
        self._devices: dict[str, Device] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()

    def devices(self, include: re.Pattern[str] | None = None,
                exclude: re.Pattern[str] | None = None) -> list[str]:
        """Device names in name order, filtered as :func:`devices` does."""
        return _select(self.names, include, exclude)

    def device(self, name: str) -> Device:
        """The device ``name`` (one of ``names``), read on first use."""
        dev = self._devices.get(name)
        if dev is not None:
            return dev
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            dev = self._devices.get(name)
            if dev is None:
                dev = self._devices[name] = read_device(self.root, name)
        return dev

    def ports(self, include: re.Pattern[str] | None = None,
              exclude: re.Pattern[str] | None = None) -> list[Port]:
        """Every port of every (filtered) device, as :func:`all_ports`."""
        return [p for name in self.devices(include, exclude) for p in self.device(name).ports]


def devices(root: Root, include: re.Pattern[str] | None = None,
            exclude: re.Pattern[str] | None = None) -> list[str]:
    """RDMA device names, filtered; [] when the class directory does not exist (no hardware)."""
    try:
        names = root.listdir(CLASS)
    except OSError:
        return []
    return _select(names, include, exclude)


def ports(root: Root, device: str) -> list[str]:
    """Port numbers of a device in numeric order; raises OSError when the device is gone."""
    names = root.listdir(f"{CLASS}/{device}/ports")
    numbered = [(n, p) for p in names if (n := parse_uint(p)) is not None]
    return [p for _, p in sorted(numbered)]


def pci_address(root: Root, device: str) -> str:
    try:
        target = root.link_target(f"{CLASS}/{device}/device")
    except OSError:
        return ""
    return target if _PCI_ADDRESS.match(target) else ""


def netdev(root: Root, device: str, port: str, link_layer: str,
           multiport: bool = False) -> str:
    """The netdev behind a port, or "" when there is none.

    Order (docs/formats.md §1.1): ``gid_attrs/ndevs/<idx>`` (RoCE only: on InfiniBand every slot
    fails to read, and trying 255 of them per scrape would be slow), then ``device/net/*``,
    preferring the netdev whose ``dev_port`` is this port's index (dual-port mlx4 HCAs). On a
    device of several ports (``multiport``), a RoCE port whose GID table names no netdev has
    none: the PCI function's netdevs belong to its other ports (a multi-plane ConnectX-8's
    planes that carry no data, docs/formats.md §1.8).
    """
    base = f"{CLASS}/{device}"
    if link_layer == "Ethernet":
        for idx in range(_GID_SLOTS_TRIED):
            try:
                name = root.read(f"{base}/ports/{port}/gid_attrs/ndevs/{idx}")
            except OSError:
                continue
            if name and _netdev_name(name):
                return name
        if multiport and root.exists(f"{base}/ports/{port}/gid_attrs/ndevs"):
            return ""
    try:
        candidates = root.listdir(f"{base}/device/net")
    except OSError:
        return ""
    if len(candidates) > 1:
        want = str(int(port) - 1)
        for name in sorted(candidates, key=len):
            try:
                if root.read(f"{base}/device/net/{name}/dev_port") == want:
                    return name
            except OSError:
                continue
        return min(candidates, key=len)
    return candidates[0] if candidates else ""


def _netdev_name(name: str) -> bool:
    """Whether text read from ``gid_attrs/ndevs/<idx>`` can be a netdev name, which then becomes
    a path component: the kernel refuses names with '/' (and a NUL ends the C string), so such
    text is garbage, not an interface."""
    return "/" not in name and "\0" not in name and name not in (".", "..")


def extra_netdevs(root: Root, configured: Iterable[str], known: Container[str],
                  log: Callable[[int, str, object], None]) -> list[str]:
    """The netdevs a collector's config names besides those behind RDMA ports (``known``),
    those that exist; a name that does not is logged (once, by ``log``) as a warning."""
    out = []
    for name in configured:
        if name in known or name in out:
            continue
        if root.exists(f"class/net/{name}"):
            out.append(name)
        else:
            log(logging.WARNING, "configured interface %s does not exist", name)
    return out


def all_ports(root: Root, include: re.Pattern[str] | None = None,
              exclude: re.Pattern[str] | None = None) -> list[Port]:
    """Every port of every (filtered) RDMA device, read now; vanished devices and ports are
    skipped. A collector in a scrape asks CollectorContext.rdma() instead, which reads them once
    for the whole scrape."""
    return Snapshot(root).ports(include, exclude)


def active_ports(root: Root) -> list[tuple[str, str]]:
    """(device, port) of every RDMA port whose state is ACTIVE, in name order."""
    out = []
    for dev in sorted(devices(root)):
        try:
            numbers = ports(root, dev)
        except OSError:
            continue
        for port in numbers:
            try:
                if root.read(f"{CLASS}/{dev}/ports/{port}/state").endswith("ACTIVE"):
                    out.append((dev, port))
            except OSError:
                continue
    return out


@dataclass(frozen=True)
class Rate:
    gbps: float
    lanes: int
    speed: str

    @property
    def bytes_per_second(self) -> float:
        return self.gbps * BYTES_PER_GBIT

    @property
    def lane_bytes_per_second(self) -> float:
        return self.bytes_per_second / self.lanes


def parse_rate(text: str) -> Rate | None:
    """Parse a ``rate`` file, e.g. "400 Gb/sec (4X NDR)" or the old "10 Gb/sec (4X)"."""
    m = _RATE.match(text)
    if not m:
        return None
    gbps, lanes = parse_uint(m.group(1)), parse_uint(m.group(3))
    if gbps is None or not lanes:  # numbers int() refuses or beyond 20 digits; no lanes
        return None
    return Rate(gbps + (0.5 if m.group(2) else 0.0), lanes, m.group(4) or "SDR")


IB_MTUS = (4096, 2048, 1024, 512, 256)
# GRH 40 + UDP 8 + BTH 12 + XRC 4 + AtomicETH 28 + ICRC 4 (include/rdma/ib_addr.h iboe_get_mtu).
ROCE_HEADER_BYTES = 96


def roce_active_mtu(netdev_mtu: int) -> int | None:
    """The RDMA MTU the kernel derives for a RoCE port from its netdev MTU (9000 -> 4096)."""
    payload = netdev_mtu - ROCE_HEADER_BYTES
    return next((m for m in IB_MTUS if payload >= m), None)


def parse_state(text: str) -> int | None:
    """The numeric id of a ``state``/``phys_state`` file ("4: ACTIVE"), split on the first ':'."""
    head, sep, _ = text.partition(":")
    return parse_int(head.strip()) if sep else None
