"""Where PCI functions sit in the PCIe tree, and nvidia-smi topo's distance between two of them.

Shared by the topology collector (GPU-NIC distances) and the probe runner (each rank's nearest
RDMA device). Input: the realpaths of /sys/bus/pci/devices/<address> and
/sys/class/infiniband/<device>/device, relative to the sysfs root.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from gpunet_exporter.sources.sysfs import Root, parse_uint

PCI_ADDRESS = re.compile(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")
HOST_BRIDGE = re.compile(r"pci[0-9a-f]{4,8}:[0-9a-f]{2}")

# nvidia-smi topo's names, nearest first (NCCL's PIX < PXB < PHB < SYS, with NODE between).
PATHS = ("PIX", "PXB", "PHB", "NODE", "SYS")
RANK = {p: i for i, p in enumerate(PATHS)}


@dataclass(frozen=True)
class Endpoint:
    """A GPU or NIC PCI function and its place in the PCIe tree."""

    name: str  # the label: GPU index, or RDMA device name
    host: str  # host bridge, "pci0000:17"
    chain: tuple[str, ...]  # PCI addresses below the host bridge: root port ... the function
    dirs: tuple[str, ...]  # sysfs directory (relative to the root) of each chain element
    numa: int  # -1: unknown


@dataclass(frozen=True)
class Relation:
    path: str  # one of PATHS
    bridges: tuple[str, ...]  # directories of the bridges crossed below the shared component


def resolve(root: Root, rel: str) -> str | None:
    """Where a sysfs path leads, relative to the root; None when it leads nowhere (a device
    unplugged meanwhile) or out of the tree."""
    try:
        real = os.path.realpath(root.path(rel), strict=True)
    except OSError:
        return None
    base = os.path.realpath(root.root)
    return real[len(base) + 1:] if real.startswith(base + "/") else None


def endpoint(name: str, rel: str, numa: int) -> Endpoint | None:
    """The endpoint of a function at sysfs path ``rel`` (resolved, relative to the root), or
    None when the path does not end in a PCI function below a host bridge."""
    parts = rel.split("/")
    host = next((i for i, p in enumerate(parts) if HOST_BRIDGE.fullmatch(p)), None)
    if host is None or not PCI_ADDRESS.fullmatch(parts[-1]):
        return None
    keep = [i for i in range(host + 1, len(parts)) if PCI_ADDRESS.fullmatch(parts[i])]
    return Endpoint(name, parts[host], tuple(parts[i] for i in keep),
                    tuple("/".join(parts[: i + 1]) for i in keep), numa)


def relation(a: Endpoint, b: Endpoint) -> Relation:
    """nvidia-smi topo's distance between two functions, and the bridges between them."""
    shared = 0
    if a.host == b.host:
        while (shared < min(len(a.chain), len(b.chain))
               and a.chain[shared] == b.chain[shared]):
            shared += 1
    # Bridges strictly below the last shared component, not the endpoints themselves.
    below_a, below_b = a.dirs[shared:-1], b.dirs[shared:-1]
    if a.host != b.host:
        same_node = a.numa == b.numa or a.numa < 0 or b.numa < 0
        path = "NODE" if same_node else "SYS"
    elif shared == 0:
        path = "PHB"
    else:
        path = "PIX" if len(below_a) <= 1 and len(below_b) <= 1 else "PXB"
    return Relation(path, below_a + below_b)


# PCIe extended capabilities (PCIe base spec 7.6.3 and 7.7.8).
_EXT_CAP_START = 0x100
_EXT_CAP_MAX = (4096 - 0x100) // 8  # more than this many capabilities means a loop
_ACS_ID = 0x000D
_ACS_CONTROL = 6  # offset of the ACS Control register in the capability
ACS_REDIRECT_BITS = 0x0004 | 0x0008  # P2P Request Redirect, P2P Completion Redirect

# "32.0 GT/s PCIe" (pci_speed_string, Linux 5.3+), "8 GT/s" and "2.5 GT/s" (older kernels),
# "Unknown" (drivers/pci/pci-sysfs.c, docs/formats.md §9).
_LINK_SPEED = re.compile(r"^(\d+(?:\.\d+)?) GT/s(?: PCIe)?$")


def parse_link_speed(text: str) -> float | None:
    """Transfers per second from a sysfs ``*_link_speed`` value; None for "Unknown"."""
    m = _LINK_SPEED.match(text)
    return float(m.group(1)) * 1e9 if m else None


def parse_link_width(text: str) -> int | None:
    """Lanes from a sysfs ``*_link_width`` value; None for 0 (link down, or unknown)."""
    value = parse_uint(text)
    return value or None


def link_degraded(cur_speed: float, cur_width: int, dev_speed: float, dev_width: int,
                  up_speed: float, up_width: int) -> bool:
    """Whether a link trained below what both ends allow: current below min(device max,
    upstream max) in speed or width. Comparing with the device's maximum alone would call a
    x16 NIC in a x8 slot degraded (scitix/sichek issue 122)."""
    return cur_speed < min(dev_speed, up_speed) or cur_width < min(dev_width, up_width)


def _little_endian(raw: bytes, size: int) -> int:
    if len(raw) < size:
        raise EOFError
    return int.from_bytes(raw, "little")


def acs_control(read: Callable[[int, int], bytes]) -> int | None:
    """The ACS Control register of a PCIe function, found by walking its extended capability
    list with ``read(offset, size)`` on its config space; None without an ACS capability.
    Raises EOFError when the config space ends early, as it does past 64 bytes for a reader
    without CAP_SYS_ADMIN (drivers/pci/pci-sysfs.c pci_read_config)."""
    offset = _EXT_CAP_START
    for _ in range(_EXT_CAP_MAX):
        header = _little_endian(read(offset, 4), 4)
        if header in (0, 0xFFFFFFFF):  # no extended capabilities; a device gone
            return None
        if header & 0xFFFF == _ACS_ID:
            return _little_endian(read(offset + _ACS_CONTROL, 2), 2)
        offset = (header >> 20) & 0xFFC
        if offset < _EXT_CAP_START:  # 0: the end of the list
            return None
    return None  # a list that loops


NVIDIA = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")  # VGA compatible controller, 3D controller


def pci_sort_key(address: str) -> tuple[int, ...]:
    domain, bus, devfn = address.split(":")
    dev, fn = devfn.split(".")
    return int(domain, 16), int(bus, 16), int(dev, 16), int(fn)


class NvidiaGpus:
    """The NVIDIA display and 3D controllers on the PCI bus (``bus/pci/devices``), in PCI
    address order (NVML's order); each function's vendor and class are read again only when
    the bus's listing changes."""

    def __init__(self, root: Root) -> None:
        self.root = root
        self._cache: tuple[list[str], list[str]] | None = None

    def __call__(self) -> list[str]:
        try:
            names = self.root.listdir("bus/pci/devices")
        except OSError:
            return []
        if self._cache is not None and self._cache[0] == names:
            return self._cache[1]  # the same PCI functions as last time
        found = []
        for address in names:
            if not PCI_ADDRESS.fullmatch(address):
                continue
            try:
                attrs = self.root.read_many(f"bus/pci/devices/{address}", ("vendor", "class"))
            except OSError:
                continue  # removed meanwhile
            vendor, cls = attrs["vendor"], attrs["class"]
            if (isinstance(vendor, str) and isinstance(cls, str) and vendor == NVIDIA
                    and cls.startswith(GPU_CLASSES)):
                found.append(address)
        found.sort(key=pci_sort_key)
        self._cache = (names, found)
        return found

