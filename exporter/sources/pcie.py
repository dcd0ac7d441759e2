"""Where PCI functions sit in the PCIe tree, and nvidia-smi topo's distance between two of them.

Shared by the topology collector (GPU-NIC distances) and the probe runner (each rank's nearest
RDMA device). Input: the realpaths of /sys/bus/pci/devices/<address> and
/sys/class/infiniband/<device>/device, relative to the sysfs root.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from gpunet_exporter.sources.sysfs import Root

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
