"""Which RDMA port each probe rank uses, and how fast that port's link is.

The net scope pins each rank to the ACTIVE RDMA port nearest its GPU on the PCIe tree
(sources/pcie.py) through ``NCCL_IB_HCA==<device>:<port>``, so every rail is exercised and a
result can be told apart per HCA; the link rate comes from the port's ``rate`` file
(docs/formats.md §1.3). No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunet_exporter.sources import pcie, rdma
from gpunet_exporter.sources.sysfs import Root


@dataclass(frozen=True)
class HcaPort:
    device: str
    port: str
    path: str  # nvidia-smi topo distance to the GPU (PIX ... SYS), "" when unknown

    @property
    def nccl_ib_hca(self) -> str:
        """The NCCL_IB_HCA value that selects exactly this port ("=" means exact names)."""
        return f"={self.device}:{self.port}"


def _endpoint(root: Root, name: str, rel: str) -> pcie.Endpoint | None:
    real = pcie.resolve(root, rel)
    return None if real is None else pcie.endpoint(name, real, -1)


# The link layers whose ports NCCL's own IB transport drives, and NCCL_IB_HCA selects. An EFA
# port ("Unknown") is driven through the aws-ofi-nccl plugin (libfabric), which ignores
# NCCL_IB_HCA and picks the EFA devices nearest each GPU itself (docs/formats.md §1.8).
NCCL_IB_LINK_LAYERS = ("InfiniBand", "Ethernet")


def pinnable_ports(root: Root) -> list[tuple[str, str]]:
    """(device, port) of the ACTIVE ports NCCL_IB_HCA can pin: InfiniBand or RoCE ports meant
    to carry data (not a multi-plane device's planes that carry none, rdma.carries_data)."""
    eligible = {(p.device, p.port) for p in rdma.all_ports(root)
                if p.data and p.link_layer in NCCL_IB_LINK_LAYERS}
    return [dp for dp in rdma.active_ports(root) if dp in eligible]


def nearest_port(root: Root, gpu_pci_address: str) -> HcaPort | None:
    """The ACTIVE RDMA port nearest the GPU at ``gpu_pci_address`` ("0000:1b:00.0") that
    NCCL_IB_HCA can pin (:func:`pinnable_ports`): fewest PCIe hops by nvidia-smi topo's order,
    then fewest bridges, then name. None without one (then the probe pins nothing: on an EFA
    node the aws-ofi-nccl plugin places the ranks itself)."""
    ports = pinnable_ports(root)
    if not ports:
        return None
    gpu = _endpoint(root, "gpu", f"bus/pci/devices/{gpu_pci_address.lower()}")
    best: tuple[tuple[int, int, str, int], HcaPort] | None = None
    for dev, port in ports:
        nic = _endpoint(root, dev, f"{rdma.CLASS}/{dev}/device")
        if gpu is None or nic is None:
            key, path = (len(pcie.PATHS), 0, dev, int(port)), ""
        else:
            rel = pcie.relation(gpu, nic)
            key, path = (pcie.RANK[rel.path], len(rel.bridges), dev, int(port)), rel.path
        if best is None or key < best[0]:
            best = (key, HcaPort(dev, port, path))
    return best[1] if best else None


def port_rate(root: Root, device: str, port: str) -> float | None:
    """The port's link rate in bytes per second, None when unreadable."""
    try:
        rate = rdma.parse_rate(root.read(f"{rdma.CLASS}/{device}/ports/{port}/rate"))
    except OSError:
        return None
    return rate.bytes_per_second if rate else None


def first_active_port(root: Root, device: str) -> str | None:
    """A device's first ACTIVE port (for HCAs NCCL chose itself, whose log names no port)."""
    return next((p for d, p in rdma.active_ports(root) if d == device), None)
