"""Build fake Linux sysfs trees for tests, in the kernel's exact file formats.

Formats follow docs/formats.md section 1 (drivers/infiniband/core/sysfs.c,
drivers/infiniband/hw/mlx5/counters.c) and net/core/net-sysfs.c. Everything is deterministic:
values are derived from the device index, never random.

    build_dgx_h100(root) -> root/sys   a DGX H100-class node (8 IB NDR + 2 RoCE 400G ports)
    build_dgx_h100_example(root)       it with root/mlnx_qos/, its RoCE netdevs' QoS (the example)
    build_dgx_h100_faulty(root)        the same node with one fault of each kind (FAULTY_EXAMPLE)
    build_scaled(root, ports)          `ports` IB NDR devices, for scrape-time scaling tests
    build_cx8_multiplane(root)         two ConnectX-8 in 4-plane RoCE mode: 12 ports each, data
                                       on 4 (make_plane_down: a data plane down)
    build_efa(root)                    four AWS EFA devices, a p5-like node
                                       (make_efa_retransmitting: SRD peers not answering)
    make_*(sys, ...), add_dangling_device(sys, ...)   fault variants applied to a built tree

For the topology collector (PCIe layout, GPUs, bridges' ACS, GPUDirect RDMA, NCCL environment):

    build_dgx_h100_gpus(root)          the same RDMA devices, plus 8 H100 GPUs, each sharing a
                                       PCIe switch with one IB NIC, and peermem loaded
    build_mixed_topology(root)         4 GPUs and 3 NICs at every distance (PIX PXB PHB NODE SYS)
    build_numa_wrong_side(root)        2 GPUs whose NICs both sit on NUMA node 1
    build_rail_misplaced(root)         the DGX with GPU 0's rail NIC in a socket-1 slot
    build_procfs(root), write_process(proc, pid, environ)   a /proc with the NVIDIA driver

Also what ibv_devinfo prints on the DGX node (DGX_IBV_DEVINFO), for its stand-ins.

`python tests/support/sysfs_tree.py examples/dgx-h100` regenerates the committed example tree;
`python tests/support/sysfs_tree.py --faulty examples/dgx-h100-faulty` the faulty one. The
module needs nothing beyond the standard library, so it runs as a script as well as
`support.sysfs_tree` (tests/ on sys.path: the tests, bench/scrape.py, bench/hostile_trees.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

try:  # tests/ on sys.path (the tests), or this file run as a script (its folder on sys.path)
    from support import nic as modules
except ImportError:  # pragma: no cover - the script
    import nic as modules  # type: ignore[no-redef]

HOST = "dgx01"
MELLANOX_OUI = 0x946DAE  # 94:6d:ae, a Mellanox/NVIDIA OUI

# ports/1/counters/: the PortCountersExtended table the kernel uses for mlx5 IB ports.
PORT_COUNTERS = (
    "symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
    "port_rcv_remote_physical_errors", "port_rcv_switch_relay_errors", "port_xmit_discards",
    "port_xmit_constraint_errors", "port_rcv_constraint_errors", "local_link_integrity_errors",
    "excessive_buffer_overrun_errors", "VL15_dropped", "port_xmit_data", "port_rcv_data",
    "port_xmit_packets", "port_rcv_packets", "unicast_xmit_packets", "unicast_rcv_packets",
    "multicast_xmit_packets", "multicast_rcv_packets", "port_xmit_wait",
)  # fmt: skip
# A few small non-zero error counters on otherwise healthy IB ports: (ibdev, file) -> value.
PORT_ERRORS = {("mlx5_5", "symbol_error"): 7, ("mlx5_5", "link_error_recovery"): 1}

# hw_counters/ (port and device level), mlx5 counters.c order, with base values for
# IB and RoCE ports; _vary() spreads them per device, zero stays zero.
#                  name                              IB          RoCE
HW_COUNTERS: dict[str, tuple[int, int]] = {
    # basic Q counters
    "rx_write_requests":              (18_440_211,  9_331_870),
    "rx_read_requests":               (2_210_394,   1_104_733),
    "rx_atomic_requests":             (0,           0),
    "rx_dct_connect":                 (0,           0),
    "out_of_buffer":                  (0,           0),
    # out_of_seq_cnt
    "out_of_sequence":                (0,           37),
    # retransmission_q_counters
    "duplicate_request":              (0,           5),
    "rnr_nak_retry_err":              (0,           0),
    "packet_seq_err":                 (0,           12),
    "implied_nak_seq_err":            (0,           0),
    "local_ack_timeout_err":          (0,           0),
    # enhanced_error_q_counters
    "resp_local_length_error":        (0,           0),
    "resp_cqe_error":                 (0,           0),
    "req_cqe_error":                  (0,           0),
    "req_remote_invalid_request":     (0,           0),
    "req_remote_access_errors":       (0,           0),
    "resp_remote_access_errors":      (0,           0),
    "resp_cqe_flush_error":           (96,          64),
    "req_cqe_flush_error":            (48,          32),
    "req_transport_retries_exceeded": (0,           0),
    "req_rnr_retries_exceeded":       (0,           0),
    # roce_accl
    "roce_adp_retrans":               (0,           41),
    "roce_adp_retrans_to":            (0,           2),
    "roce_slow_restart":              (0,           0),
    "roce_slow_restart_cnps":         (0,           0),
    "roce_slow_restart_trans":        (0,           0),
    # cc_query_allowed (congestion): DCQCN active on the RoCE ports
    "rp_cnp_ignored":                 (0,           0),
    "rp_cnp_handled":                 (0,           1_904_332),
    "np_ecn_marked_roce_packets":     (0,           2_871_045),
    "np_cnp_sent":                    (0,           2_870_112),
    # PCAM rx_icrc_encapsulated_counter
    "rx_icrc_encapsulated":           (0,           0),
}  # fmt: skip
# Made-up counter name standing in for one a future firmware adds; only on mlx5_9's port,
# so the collectors' "unknown hw counter" path is exercised.
FUTURE_HW_COUNTER = ("mlx5_9", "rx_future_fw_counter", 4242)

NETDEV_STATISTICS = (
    "rx_bytes", "tx_bytes", "rx_packets", "tx_packets", "rx_errors", "tx_errors",
    "rx_dropped", "tx_dropped", "multicast", "collisions", "rx_crc_errors", "rx_frame_errors",
    "rx_fifo_errors", "rx_missed_errors", "rx_over_errors", "rx_length_errors",
    "tx_aborted_errors", "tx_carrier_errors", "tx_fifo_errors", "tx_heartbeat_errors",
    "tx_window_errors", "rx_compressed", "tx_compressed", "rx_nohandler",
)  # fmt: skip
# Base values of the non-zero netdev statistics (the rest are 0); _vary()'d per netdev.
NETDEV_TRAFFIC = {
    "rx_bytes": 48_213_337_104, "tx_bytes": 39_114_512_986, "rx_packets": 71_230_554,
    "tx_packets": 64_877_301, "multicast": 120_477,
}  # fmt: skip

# net-sysfs.c attributes shared by every netdev here ("ifalias" is empty: the kernel
# returns 0 bytes when no alias is set).
NETDEV_COMMON = {
    "addr_assign_type": "0\n", "carrier": "1\n", "carrier_changes": "2\n",
    "carrier_up_count": "1\n", "carrier_down_count": "1\n", "dev_id": "0x0\n",
    "dev_port": "0\n", "dormant": "0\n", "duplex": "full\n", "flags": "0x1003\n", "ifalias": "",
    "link_mode": "0\n", "name_assign_type": "4\n", "netdev_group": "0\n", "operstate": "up\n",
    "tx_queue_len": "1000\n",
}  # fmt: skip
# On top of NETDEV_COMMON, per kind of netdev; None: the kernel has no such file (reading
# it fails), so none is written. address/ifindex/iflink are per netdev.
ETH_BROADCAST = "ff:ff:ff:ff:ff:ff\n"
NETDEV_KINDS: dict[str, dict[str, str | None]] = {
    "ipoib": {"type": "32\n", "mtu": "4092\n", "speed": "400000\n", "addr_len": "20\n",
              "tx_queue_len": "256\n",
              "broadcast": "00:ff:ff:ff:ff:12:40:1b:ff:ff:00:00:00:00:00:00:ff:ff:ff:ff\n"},
    "roce": {"type": "1\n", "mtu": "9000\n", "speed": "400000\n", "addr_len": "6\n",
             "phys_port_name": "p0\n", "broadcast": ETH_BROADCAST},
    "eno1": {"type": "1\n", "mtu": "1500\n", "speed": "1000\n", "addr_len": "6\n",
             "address": "3c:ec:ef:6a:10:e2\n", "broadcast": ETH_BROADCAST},
    "lo": {"type": "772\n", "mtu": "65536\n", "flags": "0x9\n", "operstate": "unknown\n",
           "addr_len": "6\n", "address": "00:00:00:00:00:00\n",
           "broadcast": "00:00:00:00:00:00\n", "name_assign_type": "3\n",
           "carrier_changes": "0\n", "carrier_up_count": "0\n", "carrier_down_count": "0\n",
           "duplex": None},  # lo has no ethtool link settings: duplex/speed fail
}  # fmt: skip

# ports/1 attributes by link layer; lid, gids and gid_attrs are per port.
PORT_ATTRS = {
    "InfiniBand": {"sm_lid": "0x1\n", "cap_mask": "0xa751e848\n"},
    "Ethernet": {"lid": "0x0\n", "sm_lid": "0x0\n", "cap_mask": "0x04010000\n"},
}
PORT_COMMON = {
    "state": "4: ACTIVE\n", "phys_state": "5: LinkUp\n", "rate": "400 Gb/sec (4X NDR)\n",
    "lid_mask_count": "0\n", "sm_sl": "0\n", "pkeys/0": "0xffff\n",
}  # fmt: skip
IBDEV_COMMON = {
    "node_type": "1: CA\n", "fw_ver": "28.39.2048\n", "hca_type": "MT4129\n", "hw_rev": "0x0\n",
    "board_id": "MT_0000000838\n",
}  # fmt: skip
PCI_CX7 = {
    "vendor": "0x15b3\n", "device": "0x1021\n", "current_link_speed": "32.0 GT/s PCIe\n",
    "current_link_width": "16\n",
}  # fmt: skip
PCI_CLASS = {"InfiniBand": "0x020700\n", "Ethernet": "0x020000\n"}
# eno1: Intel I210 1GbE, a PCI function of its own with no RDMA device.
MGMT_PCI_DIR = "devices/pci0000:00/0000:00:1c.0/0000:03:00.0"
MGMT_PCI_ATTRS = {
    "numa_node": "0\n", "vendor": "0x8086\n", "device": "0x1533\n", "class": "0x020000\n",
    "current_link_speed": "2.5 GT/s PCIe\n", "current_link_width": "1\n",
}  # fmt: skip


@dataclass(frozen=True)
class Nic:
    """One single-port ConnectX-7 PCI function with its RDMA device and netdev."""

    index: int  # N in mlx5_N
    bus: int  # PCI bus of the function 0000:BB:00.0
    numa: int
    roce: bool = False
    domain: int = 0
    ifindex: int = 0
    # sysfs directory (below sys/) of the bridge the function sits under, e.g. a PCIe switch's
    # downstream port; "" keeps the default layout: a root port of its own (see pci_dir).
    parent: str = ""

    @property
    def ibdev(self) -> str:
        return f"mlx5_{self.index}"

    @property
    def pci(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:00.0"

    @property
    def pci_dir(self) -> str:
        """sysfs path below sys/ of the PCI function: root bus, root port, endpoint (or the
        endpoint below ``parent`` when one is given)."""
        if self.parent:
            return f"{self.parent}/{self.pci}"
        root = f"{self.domain:04x}:{self.bus - 1:02x}"
        return f"devices/pci{root}/{root}:01.0/{self.pci}"

    @property
    def netdev(self) -> str:
        """systemd predictable name: ibp<bus>s0 (IPoIB) / enp<bus>s0f0np0 (Ethernet)."""
        dom = f"P{self.domain}" if self.domain else ""
        return f"en{dom}p{self.bus}s0f0np0" if self.roce else f"ib{dom}p{self.bus}s0"

    @property
    def link_layer(self) -> str:
        return "Ethernet" if self.roce else "InfiniBand"

    @property
    def guid(self) -> int:
        return (MELLANOX_OUI << 40) | (0x03 << 32) | (0x5A3C10 + 0x2B06 * self.index)

    @property
    def mac(self) -> bytes:
        return (MELLANOX_OUI << 24 | (self.guid & 0xFFFFFF)).to_bytes(6, "big")


# DGX H100: 8 IB NDR compute ports (netdev names as on the real system) + 2 RoCE ports.
DGX_NICS = (
    *(
        Nic(i, bus, numa=0 if i < 4 else 1, ifindex=3 + i)
        for i, bus in enumerate((0x18, 0x40, 0x4F, 0x5E, 0x9A, 0xC0, 0xCE, 0xDC))
    ),
    Nic(8, 0x29, numa=0, roce=True, ifindex=11),
    Nic(9, 0xAA, numa=1, roce=True, ifindex=12),
)


# `ibv_devinfo` on the DGX node's eight IB ports: all ACTIVE with a 4096-byte MTU but mlx5_6,
# whose active MTU is 2048 (what the link collector's stand-in tools print).
DGX_IBV_DEVINFO = "".join(
    f"hca_id:\tmlx5_{i}\n\ttransport:\t\t\tInfiniBand (0)\n\tphys_port_cnt:\t\t\t1\n"
    f"\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n\t\t\tmax_mtu:\t\t4096 (5)\n"
    f"\t\t\tactive_mtu:\t\t{2048 if i == 6 else 4096} ({4 if i == 6 else 5})\n"
    f"\t\t\tlink_layer:\t\tInfiniBand\n\n" for i in range(8))


def _vary(base: int, i: int) -> int:
    return base + base * 13 * i // 100


def _hexbytes(data: bytes) -> str:
    """Kernel "%*phC": lower-case hex bytes joined by ':'."""
    return ":".join(f"{b:02x}" for b in data)


def _guid_str(guid: int) -> str:
    """Kernel "%04x:%04x:%04x:%04x" of a GUID."""
    return ":".join(f"{guid >> s & 0xFFFF:04x}" for s in (48, 32, 16, 0))


def _gid_str(gid: bytes) -> str:
    """Kernel "%pI6": 8 groups of 4 hex digits, never compressed."""
    return ":".join(gid[k : k + 2].hex() for k in range(0, 16, 2))


def _write(directory: Path, files: Mapping[str, str | None]) -> None:
    """Write each file (creating directories); None means the file must not exist."""
    for name, text in files.items():
        path = directory / name
        if text is None:
            path.unlink(missing_ok=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("ascii"))


def _lines(values: Mapping[str, int]) -> dict[str, str]:
    return {name: f"{value}\n" for name, value in values.items()}


def _symlink(link: Path, target: str) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def _class_link(sys: Path, cls: str, name: str, device_dir: str) -> None:
    """sys/class/<cls>/<name> -> ../../<device_dir>, relative like the kernel's."""
    _symlink(sys / "class" / cls / name, f"../../{device_dir}")


def _port_counters(nic: Nic) -> dict[str, int]:
    i = nic.index
    xmit, rcv = (
        (812_345_678 + 95_123_457 * i, 790_331_214 + 91_004_377 * i)
        if nic.roce  # RoCE ports count RDMA traffic only
        else (3_712_448_919 + 1_203_774_521 * i, 3_655_123_004 + 1_187_332_610 * i)
    )  # units of 4 octets; above 2^32 from mlx5_1 on
    mcast_x, mcast_r = 2_000 + 37 * i, 2_411 + 41 * i
    values = dict.fromkeys(PORT_COUNTERS, 0)
    values.update(
        port_xmit_data=xmit,
        port_rcv_data=rcv,
        port_xmit_packets=xmit // 1043,
        port_rcv_packets=rcv // 1043,
        unicast_xmit_packets=xmit // 1043 - mcast_x,
        unicast_rcv_packets=rcv // 1043 - mcast_r,
        multicast_xmit_packets=mcast_x,
        multicast_rcv_packets=mcast_r,
        port_xmit_wait=0 if nic.roce else 1_234_567 + 98_765 * i,
    )
    for (ibdev, name), value in PORT_ERRORS.items():
        if ibdev == nic.ibdev:
            values[name] = value
    return values


def _hw_counters(nic: Nic) -> dict[str, str]:
    values = {name: _vary(pair[nic.roce], nic.index) for name, pair in HW_COUNTERS.items()}
    return {**_lines(values), "lifespan": "10\n"}


def _gids(nic: Nic) -> list[tuple[bytes, str]]:
    """(gid, type) per GID index. RoCE: v1/v2 pairs of link-local then IPv4-mapped GID."""
    link_local = b"\xfe\x80" + bytes(6)
    if not nic.roce:
        return [(link_local + nic.guid.to_bytes(8, "big"), "IB/RoCE v1")]
    eui64 = bytes([nic.mac[0] ^ 0x02, *nic.mac[1:3], 0xFF, 0xFE, *nic.mac[3:]])
    ipv4_mapped = bytes(10) + b"\xff\xff" + bytes([10, 10, nic.index, 11])
    return [
        (gid, kind)
        for gid in (link_local + eui64, ipv4_mapped)
        for kind in ("IB/RoCE v1", "RoCE v2")
    ]


def _write_ibdev(sys: Path, nic: Nic) -> None:
    """sys/devices/.../<pci>/infiniband/mlx5_N with ports/1, plus its class link."""
    dev = sys / nic.pci_dir / "infiniband" / nic.ibdev
    guid = _guid_str(nic.guid) + "\n"
    node = {"node_guid": guid, "sys_image_guid": guid, "node_desc": f"{HOST} {nic.ibdev}\n"}
    _write(dev, {**IBDEV_COMMON, **node})
    _symlink(dev / "device", f"../../../{nic.pci}")
    _class_link(sys, "infiniband", nic.ibdev, f"{nic.pci_dir}/infiniband/{nic.ibdev}")

    port = dev / "ports" / "1"
    gids = _gids(nic)
    _write(port, {
        **PORT_COMMON, "link_layer": f"{nic.link_layer}\n", "lid": f"0x{0x41 + nic.index:x}\n",
        **PORT_ATTRS[nic.link_layer],
        **{f"gids/{k}": _gid_str(gid) + "\n" for k, (gid, _) in enumerate(gids)},
        **{f"gid_attrs/types/{k}": f"{kind}\n" for k, (_, kind) in enumerate(gids)},
        # IB GIDs have no netdev: reading their ndevs/<k> fails (EINVAL), so no file at all.
        **{f"gid_attrs/ndevs/{k}": f"{nic.netdev}\n" for k in range(len(gids)) if nic.roce},
    })  # fmt: skip
    _write(port / "counters", _lines(_port_counters(nic)))
    # Port-level hw_counters only: mlx5 registers a device-level hw_counters/ directory only in
    # switchdev mode (drivers/infiniband/hw/mlx5/counters.c: hw_switchdev_stats_ops has
    # alloc_hw_device_stats, the normal hw_stats_ops only alloc_hw_port_stats), which GPU
    # compute nodes do not use. make_switchdev() adds it.
    hw = _hw_counters(nic)
    future_dev, future_name, future_value = FUTURE_HW_COUNTER
    if nic.ibdev == future_dev:
        hw[future_name] = f"{future_value}\n"
    _write(port / "hw_counters", hw)


def _write_netdev(
    sys: Path, device_dir: str, name: str, ifindex: int, attrs: Mapping[str, str | None]
) -> None:
    """sys/<device_dir>/net/<name>: net-sysfs attributes, statistics/, class link and, for
    a PCI netdev, the device link."""
    net = sys / device_dir / "net" / name
    stats = dict.fromkeys(NETDEV_STATISTICS, 0)
    stats.update({key: _vary(base, ifindex) for key, base in NETDEV_TRAFFIC.items()})
    _write(net, {**NETDEV_COMMON, "ifindex": f"{ifindex}\n", "iflink": f"{ifindex}\n", **attrs})
    _write(net / "statistics", _lines(stats))
    _class_link(sys, "net", name, f"{device_dir}/net/{name}")
    if device_dir != "devices/virtual":
        _symlink(net / "device", f"../../../{Path(device_dir).name}")


def _write_nic(sys: Path, nic: Nic) -> None:
    pci = {**PCI_CX7, "numa_node": f"{nic.numa}\n", "class": PCI_CLASS[nic.link_layer]}
    _write(sys / nic.pci_dir, pci)
    _write_ibdev(sys, nic)
    if nic.roce:
        kind, hwaddr = "roce", nic.mac
    else:  # IPoIB hardware address: flags+QPN (4 bytes), then the port GID (16 bytes)
        kind, hwaddr = "ipoib", (0x1049 + 8 * nic.index).to_bytes(4, "big") + _gids(nic)[0][0]
    attrs = {**NETDEV_KINDS[kind], "address": _hexbytes(hwaddr) + "\n"}
    _write_netdev(sys, nic.pci_dir, nic.netdev, nic.ifindex, attrs)


def _write_node(root: Path, nics: Iterable[Nic]) -> Path:
    """A whole node: lo, the eno1 management NIC (no RDMA) and the given RDMA NICs."""
    sys = root / "sys"
    _write_netdev(sys, "devices/virtual", "lo", 1, NETDEV_KINDS["lo"])
    _write(sys / MGMT_PCI_DIR, MGMT_PCI_ATTRS)
    _write_netdev(sys, MGMT_PCI_DIR, "eno1", 2, NETDEV_KINDS["eno1"])
    for nic in nics:
        _write_nic(sys, nic)
    return sys


# The configuration the doctor and the exporter need on an example tree (examples/README.md),
# written by hand beside its sys/ and kept when the tree is regenerated.
EXAMPLE_CONFIG = "gpunet.yml"


def build_dgx_h100(root: Path) -> Path:
    """Create root/sys for a DGX H100-class node; returns it (the --path.sysfs value)."""
    return _write_node(root, DGX_NICS)


def build_roce_only(root: Path) -> Path:
    """root/sys for a node with the DGX's two RoCE NICs and no InfiniBand port."""
    return _write_node(root, [n for n in DGX_NICS if n.roce])


def build_scaled(root: Path, ports: int) -> Path:
    """Create root/sys with `ports` single-port IB NDR devices mlx5_0..mlx5_<ports-1>."""
    if ports < 1:
        raise ValueError(f"ports must be >= 1, got {ports}")
    nics = (
        Nic(k, 0x10 + 6 * (k % 40), numa=0 if 2 * k < ports else 1, domain=k // 40, ifindex=3 + k)
        for k in range(ports)
    )
    return _write_node(root, nics)


# ---- multi-plane ConnectX-8 and AWS EFA (docs/formats.md §1.8) ----

# A ConnectX-8 in 4-plane RoCE mode as scitix/sichek #98 (27a48f35) found it on B300 nodes: each
# RDMA device lists 12 ports; ports 3, 6, 9 and 12 carry data, each with its netdev eth_rN_pK
# (K the plane), and the platform keeps the other eight disabled. Per plane 2 lanes of 100G
# (openucx/ucx #11691: "max speed of a single plane ... active width (2) and number of planes
# (4)"). Assumed, not seen in a capture: the disabled ports read DOWN/Disabled with mlx5's
# default rate of a port without a link, have no GIDs, and all four netdevs sit under the one
# PCI function with dev_port 0..3.
CX8_PORTS = 12
CX8_DATA_PORTS = (3, 6, 9, 12)
CX8_IBDEV = {"node_type": "1: CA\n", "fw_ver": "40.44.1036\n", "hca_type": "MT4131\n",
             "hw_rev": "0x0\n", "board_id": "NVD0000000072\n"}
CX8_PCI = {"vendor": "0x15b3\n", "device": "0x1023\n", "class": "0x020000\n",
           "current_link_speed": "64.0 GT/s PCIe\n", "current_link_width": "16\n"}
CX8_NICS = ((0, 0x1A, 0), (1, 0x9C, 1))  # (N in roce_rN, PCI bus, NUMA node)


def _write_cx8(sys: Path, index: int, bus: int, numa: int) -> None:
    name, pci = f"roce_r{index}", f"0000:{bus:02x}:00.0"
    pci_dir = f"devices/pci0000:{bus - 1:02x}/0000:{bus - 1:02x}:01.0/{pci}"
    _write(sys / pci_dir, {**CX8_PCI, "numa_node": f"{numa}\n"})
    dev = sys / pci_dir / "infiniband" / name
    guid = (MELLANOX_OUI << 40) | (0x03 << 32) | (0x7B2200 + 0x100 * index)
    _write(dev, {**CX8_IBDEV, "node_guid": _guid_str(guid) + "\n",
                 "sys_image_guid": _guid_str(guid) + "\n", "node_desc": f"{HOST} {name}\n"})
    _symlink(dev / "device", f"../../../{pci}")
    _class_link(sys, "infiniband", name, f"{pci_dir}/infiniband/{name}")
    for p in range(1, CX8_PORTS + 1):
        port = dev / "ports" / str(p)
        files = {**PORT_COMMON, **PORT_ATTRS["Ethernet"], "link_layer": "Ethernet\n"}
        hw = {name_: 0 for name_ in HW_COUNTERS}
        if p in CX8_DATA_PORTS:
            plane = CX8_DATA_PORTS.index(p)
            netdev = f"eth_r{index}_p{plane}"
            mac = (MELLANOX_OUI << 24 | 0x7B0000 | index << 8 | plane).to_bytes(6, "big")
            eui64 = bytes([mac[0] ^ 0x02, *mac[1:3], 0xFF, 0xFE, *mac[3:]])
            gid = b"\xfe\x80" + bytes(6) + eui64
            files.update({"rate": "200 Gb/sec (2X NDR)\n", "gids/0": _gid_str(gid) + "\n",
                          "gids/1": _gid_str(gid) + "\n", "gid_attrs/types/0": "IB/RoCE v1\n",
                          "gid_attrs/types/1": "RoCE v2\n", "gid_attrs/ndevs/0": f"{netdev}\n",
                          "gid_attrs/ndevs/1": f"{netdev}\n"})
            xmit, rcv = 1_912_345_678 + 95_123_457 * plane, 1_890_331_214 + 91_004_377 * plane
            hw.update({k: _vary(v[1], 4 * index + plane) for k, v in HW_COUNTERS.items()})
            attrs = {**NETDEV_KINDS["roce"], "speed": "200000\n", "dev_port": f"{plane}\n",
                     "phys_port_name": f"p{plane}\n", "address": _hexbytes(mac) + "\n"}
            _write_netdev(sys, pci_dir, netdev, 20 + 4 * index + plane, attrs)
        else:
            files.update({"state": "1: DOWN\n", "phys_state": "3: Disabled\n",
                          "rate": "40 Gb/sec (4X QDR)\n"})
            (port / "gid_attrs" / "ndevs").mkdir(parents=True)  # no GID, no netdev
            (port / "gid_attrs" / "types").mkdir(parents=True)
            xmit = rcv = 0
        _write(port, files)
        counters = dict.fromkeys(PORT_COUNTERS, 0)
        counters.update(port_xmit_data=xmit, port_rcv_data=rcv, port_xmit_packets=xmit // 1043,
                        port_rcv_packets=rcv // 1043, unicast_xmit_packets=xmit // 1043,
                        unicast_rcv_packets=rcv // 1043)
        _write(port / "counters", _lines(counters))
        _write(port / "hw_counters", {**_lines(hw), "lifespan": "10\n"})


def build_cx8_multiplane(root: Path) -> Path:
    """root/sys for a node with two ConnectX-8 in 4-plane RoCE mode (roce_r0, roce_r1): 12
    ports each, data on ports 3, 6, 9 and 12 (netdevs eth_rN_p0..p3), the rest disabled."""
    sys = _write_node(root, ())
    for index, bus, numa in CX8_NICS:
        _write_cx8(sys, index, bus, numa)
    return sys


# AWS EFA as the efa driver registers it (amzn/amzn-drivers 64788ef7 kernel/linux/efa/src:
# efa_main.c, efa_verbs.c): node type RDMA_NODE_UNSPECIFIED, one port always ACTIVE/LinkUp with
# link layer IB_LINK_LAYER_UNSPECIFIED (sysfs "Unknown"), its rate from the device's maximum
# link speed (100 Gb/s on p5.48xlarge: 4X EDR), no process_mad (so no counters/ directory), no
# netdev, no hca_type/board_id/hw_rev files, an empty fw_ver; port hw_counters
# EFA_DEFINE_PORT_STATS and device-level EFA_DEFINE_DEVICE_STATS. Names as rdma-core's udev
# naming gives them on AWS AMIs (rdmap<bus>s<slot>); the kernel's own name is efa_<N>.
EFA_PORT_STATS = (
    "tx_bytes", "tx_pkts", "rx_bytes", "rx_pkts", "rx_drops", "send_bytes", "send_wrs",
    "recv_bytes", "recv_wrs", "rdma_read_wrs", "rdma_read_bytes", "rdma_read_wr_err",
    "rdma_read_resp_bytes", "rdma_write_wrs", "rdma_write_bytes", "rdma_write_wr_err",
    "rdma_write_recv_bytes", "retrans_bytes", "retrans_pkts", "retrans_timeout_events",
    "unresponsive_remote_events", "impaired_remote_conn_events",
)  # fmt: skip
EFA_DEVICE_STATS = (
    "submitted_cmds", "completed_cmds", "cmds_err", "no_completion_cmds", "keep_alive_rcvd",
    "alloc_pd_err", "create_qp_err", "create_cq_err", "reg_mr_err", "alloc_ucontext_err",
    "create_ah_err", "mmap_err",
)  # fmt: skip
EFA_BUSES = (0x4F, 0x50, 0xC7, 0xC8)  # two per socket, as on a p5.48xlarge's PCIe switches
AMAZON_VENDOR = 0x1D0F


def efa_name(bus: int) -> str:
    return f"rdmap{bus}s0"


def _efa_port_stats(k: int) -> dict[str, int]:
    tx, rx = 7_812_345_678_901 + 311_004_377 * k, 7_790_331_214_557 + 297_113_901 * k
    values = dict.fromkeys(EFA_PORT_STATS, 0)
    values.update(tx_bytes=tx, rx_bytes=rx, tx_pkts=tx // 8_400, rx_pkts=rx // 8_400,
                  send_bytes=tx // 50, send_wrs=tx // 50 // 8_192, recv_bytes=rx // 50,
                  recv_wrs=rx // 50 // 8_192, rdma_read_bytes=rx // 3,
                  rdma_read_wrs=rx // 3 // 1_048_576, rdma_read_resp_bytes=tx // 3,
                  rdma_write_bytes=tx // 2, rdma_write_wrs=tx // 2 // 1_048_576,
                  rdma_write_recv_bytes=rx // 2, retrans_bytes=4_211_008 + 1_024 * k,
                  retrans_pkts=1_031 + k, retrans_timeout_events=3)
    return values


def _write_efa(sys: Path, k: int, bus: int) -> None:
    name, pci = efa_name(bus), f"0000:{bus:02x}:00.0"
    pci_dir = f"devices/pci0000:{bus - 1:02x}/0000:{bus - 1:02x}:01.0/{pci}"
    _write(sys / pci_dir, {"vendor": f"0x{AMAZON_VENDOR:04x}\n", "device": "0xefa1\n",
                           "class": "0x020000\n", "numa_node": f"{k // 2}\n",
                           "current_link_speed": "32.0 GT/s PCIe\n",
                           "current_link_width": "16\n", "p2p": "NVIDIA\n"})
    dev = sys / pci_dir / "infiniband" / name
    guid = 0x0E1A_0000_0000_0000 | (bus << 8)
    _write(dev, {"node_type": "7: unspecified\n", "fw_ver": "\n",
                 "node_guid": _guid_str(guid) + "\n", "sys_image_guid": "0000:0000:0000:0000\n",
                 "node_desc": "\n"})
    _write(dev / "hw_counters", {**_lines(dict.fromkeys(EFA_DEVICE_STATS, 0)),
                                 "submitted_cmds": f"{4_410 + k}\n",
                                 "completed_cmds": f"{4_410 + k}\n",
                                 "keep_alive_rcvd": f"{86_400 + k}\n", "lifespan": "10\n"})
    _symlink(dev / "device", f"../../../{pci}")
    _class_link(sys, "infiniband", name, f"{pci_dir}/infiniband/{name}")
    addr = bytes(10) + bytes([0x0A, 0x00, 0x13, bus, 0x00, 0x01])
    port = dev / "ports" / "1"
    _write(port, {"state": "4: ACTIVE\n", "phys_state": "5: LinkUp\n",
                  "rate": "100 Gb/sec (4X EDR)\n", "link_layer": "Unknown\n", "lid": "0x0\n",
                  "sm_lid": "0x0\n", "lid_mask_count": "1\n", "sm_sl": "0\n",
                  "cap_mask": "0x00000000\n", "pkeys/0": "0xffff\n",
                  "gids/0": _gid_str(addr) + "\n", "gid_attrs/types/0": "IB/RoCE v1\n"})
    (port / "gid_attrs" / "ndevs").mkdir(parents=True)  # reading ndevs/0 fails: no netdev
    _write(port / "hw_counters", {**_lines(_efa_port_stats(k)), "lifespan": "10\n"})


def build_efa(root: Path) -> Path:
    """root/sys for a p5-like node's EFA side: four EFA devices (rdmap<bus>s0), no IB or RoCE
    port, besides lo and the eno1 management NIC."""
    sys = _write_node(root, ())
    for k, bus in enumerate(EFA_BUSES):
        _write_efa(sys, k, bus)
    return sys


def make_efa_retransmitting(sys: Path, bus: int = EFA_BUSES[1], events: int = 500) -> None:
    """An EFA device whose SRD peers stop answering: unresponsive-remote, impaired-connection
    and retransmit-timeout events and retransmitted packets grown by ``events``."""
    hw = sys / "class" / "infiniband" / efa_name(bus) / "ports" / "1" / "hw_counters"
    for fname in ("retrans_timeout_events", "unresponsive_remote_events",
                  "impaired_remote_conn_events", "retrans_pkts"):
        path = hw / fname
        path.write_text(f"{int(path.read_text()) + events}\n")


def make_plane_down(sys: Path, device: str = "roce_r1", port: int = 6) -> None:
    """A data plane of a multi-plane ConnectX-8 down: state DOWN, Polling, carrier lost."""
    _write(sys / "class" / "infiniband" / device / "ports" / str(port),
           {"state": "1: DOWN\n", "phys_state": "2: Polling\n"})


# ---- fault variants: each mutates a tree built above, in exact kernel formats ----


def _port(sys: Path, device: str) -> Path:
    return sys / "class" / "infiniband" / device / "ports" / "1"


def _netdev(sys: Path, device: str) -> Path:
    """The netdev of an RDMA device, found through device/net/ like a collector would."""
    (net,) = (sys / "class" / "infiniband" / device / "device" / "net").iterdir()
    return net


def make_port_down(sys: Path, device: str = "mlx5_3") -> None:
    """Port disabled: IB state DOWN, netdev carrier lost (one more carrier down event)."""
    _write(_port(sys, device), {"state": "1: DOWN\n", "phys_state": "3: Disabled\n"})
    _write(
        _netdev(sys, device),
        {
            "operstate": "down\n",
            "carrier": "0\n",
            "speed": "-1\n",
            "carrier_changes": "3\n",
            "carrier_down_count": "2\n",
        },
    )


def make_port_degraded(sys: Path, device: str = "mlx5_5") -> None:
    """Link trained down to 2 lanes: 200 Gb/s."""
    _write(_port(sys, device), {"rate": "200 Gb/sec (2X NDR)\n"})
    _write(_netdev(sys, device), {"speed": "200000\n"})


def make_counters_saturated(sys: Path, device: str = "mlx5_1") -> None:
    """PMA error counters stuck at all-ones of their field width (IBA counters saturate)."""
    _write(
        _port(sys, device) / "counters",
        _lines(
            {
                "symbol_error": 0xFFFF,
                "link_error_recovery": 0xFF,
                "link_downed": 0xFF,
                "port_rcv_errors": 0xFFFF,
                "local_link_integrity_errors": 0xF,
                "excessive_buffer_overrun_errors": 0xF,
                "port_xmit_wait": 0xFFFFFFFF,
            }
        ),
    )


def make_no_pma(sys: Path, device: str = "mlx5_2") -> None:
    """Pre-4.19 kernels without a PMA: every counters/ file reads "N/A (no PMA)"."""
    counters = _port(sys, device) / "counters"
    _write(counters, {f.name: "N/A (no PMA)\n" for f in counters.iterdir()})


def make_unreadable(sys: Path, device: str = "mlx5_4") -> None:
    """Two files mode 000 (EACCES, except for root) and one file that is a directory (EISDIR)."""
    port = _port(sys, device)
    for rel in ("counters/symbol_error", "hw_counters/out_of_buffer"):
        (port / rel).chmod(0o000)
    (port / "counters/port_rcv_errors").unlink()
    (port / "counters/port_rcv_errors").mkdir()


def make_garbage(sys: Path, device: str = "mlx5_6") -> None:
    """Unparseable contents: a word, an empty file, a rate without the kernel's format."""
    _write(
        _port(sys, device),
        {
            "counters/link_downed": "garbage\n",
            "counters/VL15_dropped": "",
            "rate": "fast\n",
        },
    )


def make_missing_hw_counters(sys: Path, device: str = "mlx5_7") -> None:
    """Driver without hw counters: neither port nor device hw_counters/ exists."""
    dev = sys / "class" / "infiniband" / device
    shutil.rmtree(dev / "ports" / "1" / "hw_counters")
    shutil.rmtree(dev / "hw_counters", ignore_errors=True)  # present only in switchdev mode


def make_switchdev(sys: Path, device: str = "mlx5_9") -> None:
    """NIC in switchdev mode: mlx5 then also has a device-level hw_counters/ (port 0's set)."""
    dev = sys / "class" / "infiniband" / device
    port_hw = dev / "ports" / "1" / "hw_counters"
    _write(dev / "hw_counters", {f.name: f.read_text() for f in port_hw.iterdir()
                                 if f.name != FUTURE_HW_COUNTER[1]})


def make_mtu_1500(sys: Path, netdev_of: str = "mlx5_8") -> None:
    """RoCE netdev left at MTU 1500 (RoCE active_mtu becomes 1024)."""
    _write(_netdev(sys, netdev_of), {"mtu": "1500\n"})


OFED_BUFFER_SIZES = [130944, 261888] + [0] * 6  # receive buffers 0..7, bytes
OFED_PORT_BUFFER = 1048576


def mlnx_qos_report(pfc_priority: int = 3, trust: str = "dscp") -> str:
    """What `mlnx_qos -i IF` (a newer mlnx-tools build, OS-controlled DCBX) prints for the
    configuration make_ofed_qos writes: PFC and the lossless buffer on `pfc_priority` only, the
    default DSCP map, strict priority with the kernel's default priority-to-tc map; in the byte
    layout of docs/formats.md §2.1 (TABs, the three trailing spaces of the enabled and buffer
    rows, eight DSCP values a line)."""
    lines = ["DCBX mode: OS controlled", f"Priority trust state: {trust}"]
    if trust == "dscp":
        lines.append("dscp2prio mapping:")
        for prio in range(8):
            values = [f"{d:02d}," for d in reversed(range(prio * 8, prio * 8 + 8))]
            lines.append(f"\tprio:{prio} dscp:{''.join(values)}")
    lines += ["default priority:",
              "Receive buffer size (bytes): "
              + "".join(f"{size}," for size in OFED_BUFFER_SIZES)
              + f"max_buffer_size={OFED_PORT_BUFFER}",
              "Cable len: 7", "PFC configuration:",
              "\tpriority    " + "".join(f"{p:1d}   " for p in range(8)).rstrip(),
              "\tenabled     " + "".join(f"{int(p == pfc_priority):1d}   " for p in range(8)),
              "\tbuffer      " + "".join(f"{int(p == pfc_priority):1d}   " for p in range(8))]
    tc_of = {0: 1, 1: 0}  # the kernel's default map puts priority 0 on tc 1 and 1 on tc 0
    for tc in range(8):
        lines.append(f"tc: {tc} ratelimit: unlimited, tsa: strict")
        lines += [f"\t priority:  {p}" for p in range(8) if tc_of.get(p, p) == tc]
    return "\n".join(lines) + "\n"


# Stands in for `mlnx_qos` on an example node, which has no NIC for the real tool to ask.
MLNX_QOS_REPLAY = """\
#!/bin/sh
# Stands in for `mlnx_qos -i IF` on this example node (examples/demo.py): prints the report
# recorded beside this script for IF (IF.txt), generated by tests/support/sysfs_tree.py from
# the same settings as the node's MLNX_OFED qos/ files. No real mlnx_qos is needed.
dir=$(dirname "$0")
if [ "$1" = -i ] && [ -n "$2" ] && [ -f "$dir/$2.txt" ]; then
  exec cat "$dir/$2.txt"
fi
echo "mlnx_qos replay: no recorded report for: $*" >&2
exit 1
"""


def make_ofed_qos(sys: Path, device: str = "mlx5_9", pfc_priority: int = 3,
                  trust: str = "dscp") -> str:
    """MLNX_OFED's mlx5 sysfs extras on the RoCE netdev of `device`; returns the netdev's name.

    qos/ (en_sysfs.c: buffer_size "Port buffer size = %d", "Spare buffer size = %d", a header and
    "%d\t%d\t%d\t\t%d" rows; prio2buffer "Priority\tBuffer" and "%d\t\t%d" rows; trust and
    dscp2prio as some OFED releases add them, whose dscp2prio header line is not verified from
    source) and ecn/roce_np|roce_rp (en_ecn.c, "%d\n"): ECN on `pfc_priority`, CNPs on DSCP 48,
    priority 6.
    """
    net = _netdev(sys, device)
    buffer_rows = "".join(f"{i}\t{size}\t{size // 2 if size else 0}\t\t"
                          f"{size // 2 - 4096 if size else 0}\n"
                          for i, size in enumerate(OFED_BUFFER_SIZES))
    prio_rows = "".join(f"{p}\t\t{int(p == pfc_priority)}\n" for p in range(8))
    dscp_rows = "".join(f"{d}\t{d >> 3}\n" for d in range(64))
    _write(net / "qos", {
        "buffer_size": f"Port buffer size = {OFED_PORT_BUFFER}\nSpare buffer size = 0\n"
                       "Buffer\tSize\txoff_threshold\txon_threshold\n" + buffer_rows,
        "prio2buffer": "Priority\tBuffer\n" + prio_rows,
        "trust": f"{trust}\n",
        "dscp2prio": "dscp\tprio\n" + dscp_rows,
        "tc_num": "8\n",
    })
    for point in ("roce_np", "roce_rp"):
        _write(net / "ecn" / point / "enable",
               {str(p): f"{int(p == pfc_priority)}\n" for p in range(8)})
    _write(net / "ecn" / "roce_np", {"cnp_dscp": "48\n", "cnp_802p_prio": "6\n",
                                     "min_time_between_cnps": "4\n"})
    return net.name


# The faulty example tree (examples/dgx-h100-faulty): build_dgx_h100 plus these faults, the
# kinds that slow multi-node training. fault -> RDMA device it is applied to.
FAULTY_EXAMPLE = {
    "port_degraded": "mlx5_5",  # IB port trained down to 2 lanes: 200 Gb/s instead of 400
    "port_down": "mlx5_3",  # IB port DOWN/Disabled, its IPoIB netdev without carrier
    "mtu_1500": "mlx5_8",  # RoCE netdev left at MTU 1500
    # MLNX_OFED qos/ files on the RoCE netdev: the lossless buffer and ECN on priority 5, not on
    # RoCE's 3, and priority trust pcp, not dscp. The files do not say whether PFC is enabled
    # (mlnx_qos asks DCB netlink for that), so the tree's mlnx_qos/ folder holds the report
    # `mlnx_qos -i` gives for that netdev, PFC on priority 5 only, and a script replaying it.
    "qos_pcp_priority_5": "mlx5_9",
    # The nic collector's stand-ins (root/nic/: ethtool -m and devlink health replays, from
    # tests/support/nic.py): lane 3 of mlx5_9's netdev's OSFP module receives -15 dBm, below
    # the module's low warning; mlx5_8's netdev's module runs at 78.5 C, above its high warning;
    # mlx5_7's fw_fatal devlink health reporter is in error.
    "rx_power_low": "mlx5_9",
    "module_hot": "mlx5_8",
    "fw_fatal_error": "mlx5_7",
}


def build_dgx_h100_faulty(root: Path) -> Path:
    """build_dgx_h100 with the faults of FAULTY_EXAMPLE; returns root/sys, beside which
    root/mlnx_qos/ holds the RoCE netdev's `mlnx_qos -i` report and its replay script. Error
    counters that rise over time are not a tree's matter: examples/demo.py raises them while it
    runs."""
    sys = build_dgx_h100(root)
    make_port_degraded(sys, FAULTY_EXAMPLE["port_degraded"])
    make_port_down(sys, FAULTY_EXAMPLE["port_down"])
    make_mtu_1500(sys, FAULTY_EXAMPLE["mtu_1500"])
    netdev = make_ofed_qos(sys, FAULTY_EXAMPLE["qos_pcp_priority_5"], pfc_priority=5,
                           trust="pcp")
    # The node's other RoCE netdev answers mlnx_qos too, configured as it should be: a node
    # whose QoS configuration cannot be read at all is another fault (GpunetPfcConfigUnreadable).
    other = _netdev(sys, FAULTY_EXAMPLE["mtu_1500"]).name
    _mlnx_qos_replay(root, {netdev: mlnx_qos_report(pfc_priority=5, trust="pcp"),
                            other: mlnx_qos_report()})
    low = list(modules.HEALTHY_RX_MW)
    low[2] = modules.LOW_RX_MW
    _nic_replay(root, sys, {
        _netdev(sys, FAULTY_EXAMPLE["rx_power_low"]).name: modules.cmis_osfp(rx_mw=low),
        _netdev(sys, FAULTY_EXAMPLE["module_hot"]).name: modules.cmis_osfp(
            temperature=modules.HOT_C)}, {FAULTY_EXAMPLE["fw_fatal_error"]: "fw_fatal"})
    return sys


def build_dgx_h100_example(root: Path) -> Path:
    """build_dgx_h100 with root/mlnx_qos/: what `mlnx_qos -i` prints for each RoCE netdev,
    configured as it should be (PFC on priority 3, trust dscp), and its replay script. The
    healthy example tree (examples/dgx-h100): without a QoS source its PFC would go unchecked
    (gpunet_check_unknown{check="pfc_config"})."""
    sys = build_dgx_h100(root)
    _mlnx_qos_replay(root, {_netdev(sys, nic.ibdev).name: mlnx_qos_report()
                            for nic in DGX_NICS if nic.roce})
    _nic_replay(root, sys, {_netdev(sys, nic.ibdev).name: modules.cmis_osfp()
                            for nic in DGX_NICS if nic.roce}, {})
    return sys


def _pci_address(sys: Path, device: str) -> str:
    return os.path.basename(os.path.realpath(sys / "class/infiniband" / device / "device"))


def _nic_replay(root: Path, sys: Path, pages: dict[str, modules.Pages],
                errors: dict[str, str]) -> None:
    """root/nic/: stand-ins for `ethtool -m` (each RoCE netdev's module pages) and `devlink -j
    health show` (mlx5's reporters of every device; ``errors``: device -> a reporter in
    error)."""
    devices = sorted(p.name for p in (sys / "class/infiniband").iterdir())
    modules.write_replay(root / "nic", pages, modules.reporters(
        [_pci_address(sys, d) for d in devices],
        {(_pci_address(sys, d), r): 1 for d, r in errors.items()}))


def _mlnx_qos_replay(root: Path, reports: dict[str, str]) -> None:
    """root/mlnx_qos/: each netdev's report and MLNX_QOS_REPLAY, executable."""
    tools = root / "mlnx_qos"
    _write(tools, {**{f"{netdev}.txt": text for netdev, text in reports.items()},
                   "mlnx_qos": MLNX_QOS_REPLAY})
    (tools / "mlnx_qos").chmod(0o755)


def add_dangling_device(sys: Path, name: str = "mlx5_10") -> None:
    """A class link whose device is gone (hot-unplugged between listing and reading)."""
    _class_link(
        sys, "infiniband", name, f"devices/pci0000:e5/0000:e5:01.0/0000:e6:00.0/infiniband/{name}"
    )


# ---- PCIe topology, GPUs, GPUDirect RDMA and /proc (topology collector) ----

DRIVER_VERSION = "580.159.04"
# H100 SXM5 (device 0x2330), a 3D controller (class 0x0302), Gen 5 x16.
PCI_H100 = {
    "vendor": "0x10de\n", "device": "0x2330\n", "class": "0x030200\n",
    "current_link_speed": "32.0 GT/s PCIe\n", "current_link_width": "16\n",
    "max_link_speed": "32.0 GT/s PCIe\n", "max_link_width": "16\n",
}  # fmt: skip
# Other PCI functions of a DGX H100 that GPU discovery must not mistake for GPUs: the NVSwitch
# chips (NVIDIA, but class 0x0680 "other bridge") and the BMC's ASPEED VGA (class 0x0300).
PCI_NVSWITCH = {"vendor": "0x10de\n", "device": "0x22a3\n", "class": "0x068000\n"}
PCI_ASPEED = {"vendor": "0x1a03\n", "device": "0x2000\n", "class": "0x030000\n"}
NVSWITCH_DIRS = tuple(f"devices/pci0000:00/0000:00:{2 + k:02x}.0/0000:{5 + k:02x}:00.0"
                      for k in range(4))
ASPEED_DIR = "devices/pci0000:00/0000:00:1c.4/0000:04:00.0"

# Link attributes of every bridge port here (drivers/pci/pci-sysfs.c, docs/formats.md §9).
PCI_LINK_GEN5_X16 = {
    "current_link_speed": "32.0 GT/s PCIe\n", "current_link_width": "16\n",
    "max_link_speed": "32.0 GT/s PCIe\n", "max_link_width": "16\n",
}  # fmt: skip
# PCI Express capability "device/port type" (PCIe base spec 7.5.3.2).
ROOT_PORT, UPSTREAM_PORT, DOWNSTREAM_PORT = 4, 5, 6
BRIDGE_IDS = {
    ROOT_PORT: (0x8086, 0x352A),  # an Intel Xeon root port
    UPSTREAM_PORT: (0x1000, 0xC030),  # Broadcom PEX890xx Gen 5 switch
    DOWNSTREAM_PORT: (0x1000, 0xC030),
}
# Extended capabilities of every bridge here, starting at 0x100: AER, then ACS (id 0x000D:
# capability register at +4, control register at +6), then Secondary PCIe.
AER_OFFSET, ACS_OFFSET, SECONDARY_PCIE_OFFSET = 0x100, 0x148, 0x158
ACS_CAPABILITY = 0x005F  # SV TB RR CR UF DT
ACS_CONTROL_OFF = 0x0011  # Source Validation + Upstream Forwarding: no P2P redirect
# What Linux's pci_std_enable_acs() sets: SV + P2P Request Redirect (bit 2) + P2P Completion
# Redirect (bit 3) + UF. Peer-to-peer traffic then detours through the root complex.
ACS_CONTROL_REDIRECT = 0x001D
CONFIG_SIZE = 4096
CONFIG_UNPRIVILEGED = 64  # what the kernel lets a reader without CAP_SYS_ADMIN see

# Where a GPUDirect RDMA peer-memory client shows (docs/formats.md §5.3), by module name.
PEERMEM_FILES = {
    "nvidia_peermem": "module/nvidia_peermem/version",
    "nv_peer_mem": "kernel/mm/memory_peers/nv_mem/version",
    "nv_peer_mem_nc": "kernel/mm/memory_peers/nv_mem_nc/version",
    "nvidia-peermem": "kernel/mm/memory_peers/nvidia-peermem/version",
}

# /proc/driver/nvidia/version of the open and of the proprietary kernel module.
NVRM_OPEN = (f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {DRIVER_VERSION}  "
             "Release Build  (nixbld@)  \nGCC version:  gcc version 14.3.0 (GCC) \n")
NVRM_PROPRIETARY = ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.129.03  Thu Oct 19 "
                    "18:56:32 UTC 2023\nGCC version:  gcc version 11.4.0 "
                    "(Ubuntu 11.4.0-1ubuntu1~22.04) \n")
OSRELEASE = "6.8.0-45-generic"


def _bdf(domain: int, bus: int, dev: int = 0, fn: int = 0) -> str:
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"


def pci_config(vendor: int, device: int, port_type: int,
               acs_control: int | None = ACS_CONTROL_OFF) -> bytes:
    """The 4096-byte configuration space of a PCIe bridge: type 1 header, a PCI Express
    capability with the port type, and the extended capability list at 0x100 (AER, ACS with
    ``acs_control`` unless it is None, Secondary PCIe). Little-endian, as the file reads."""
    cfg = bytearray(CONFIG_SIZE)
    struct.pack_into("<HHHH", cfg, 0x00, vendor, device, 0x0407, 0x0010)  # status: cap list
    cfg[0x0A], cfg[0x0B], cfg[0x0E] = 0x04, 0x06, 0x01  # PCI-to-PCI bridge, header type 1
    cfg[0x34] = 0x40  # capability pointer
    struct.pack_into("<BBH", cfg, 0x40, 0x10, 0x00, 0x0002 | port_type << 4)  # PCIe cap v2

    def ext(offset: int, cap_id: int, version: int, next_offset: int) -> None:
        struct.pack_into("<I", cfg, offset, cap_id | version << 16 | next_offset << 20)

    ext(AER_OFFSET, 0x0001, 2, SECONDARY_PCIE_OFFSET if acs_control is None else ACS_OFFSET)
    if acs_control is not None:
        ext(ACS_OFFSET, 0x000D, 1, SECONDARY_PCIE_OFFSET)
        struct.pack_into("<HH", cfg, ACS_OFFSET + 4, ACS_CAPABILITY, acs_control)
    ext(SECONDARY_PCIE_OFFSET, 0x0019, 1, 0)
    return bytes(cfg)


def _bus_link(sys: Path, device_dir: str) -> None:
    """sys/bus/pci/devices/<address> -> ../../../<device_dir>, as the kernel links every
    PCI function."""
    link = sys / "bus" / "pci" / "devices" / Path(device_dir).name
    if not link.is_symlink():
        _symlink(link, f"../../../{device_dir}")


def _write_bridge(sys: Path, bridge_dir: str, numa: int, port_type: int,
                  acs_control: int | None = ACS_CONTROL_OFF) -> None:
    vendor, device = BRIDGE_IDS[port_type]
    _write(sys / bridge_dir, {"vendor": f"0x{vendor:04x}\n", "device": f"0x{device:04x}\n",
                              "class": "0x060400\n", "numa_node": f"{numa}\n",
                              **PCI_LINK_GEN5_X16})
    (sys / bridge_dir / "config").write_bytes(pci_config(vendor, device, port_type, acs_control))
    _bus_link(sys, bridge_dir)


def _root_port(sys: Path, root_bus: int, numa: int, slot: int = 1, domain: int = 0) -> str:
    """Root port <domain>:<root_bus>:<slot>.0 of host bridge pci<domain>:<root_bus>; its dir."""
    port = f"devices/pci{domain:04x}:{root_bus:02x}/{_bdf(domain, root_bus, slot)}"
    _write_bridge(sys, port, numa, ROOT_PORT)
    return port


def _switch(sys: Path, above: str, bus: int, children: Iterable[int], numa: int,
            domain: int = 0) -> dict[int, str]:
    """A PCIe switch below the bridge directory ``above``: upstream port <bus>:00.0, downstream
    ports on bus+1, the one leading to child bus c being device c-bus-2 (firmware numbers buses
    depth first). Returns child bus -> downstream port directory."""
    upstream = f"{above}/{_bdf(domain, bus)}"
    _write_bridge(sys, upstream, numa, UPSTREAM_PORT)
    out = {}
    for child in children:
        out[child] = f"{upstream}/{_bdf(domain, bus + 1, child - bus - 2)}"
        _write_bridge(sys, out[child], numa, DOWNSTREAM_PORT)
    return out


def _write_gpu(sys: Path, parent: str, bus: int, numa: int, domain: int = 0) -> str:
    gpu_dir = f"{parent}/{_bdf(domain, bus)}"
    _write(sys / gpu_dir, {**PCI_H100, "numa_node": f"{numa}\n"})
    _bus_link(sys, gpu_dir)
    return gpu_dir


def _write_gpu_node(root: Path, nics: Iterable[Nic]) -> Path:
    """_write_node, plus the root ports of NICs in the default layout, bus links of every
    function, the NVSwitch and BMC functions, and nvidia_peermem loaded."""
    nics = list(nics)
    sys = _write_node(root, nics)
    for nic in nics:
        if not nic.parent:
            _write_bridge(sys, str(Path(nic.pci_dir).parent), nic.numa, ROOT_PORT)
        _bus_link(sys, nic.pci_dir)
        # The link capabilities the collectors of build_dgx_h100 do not read, kept out of it
        # (and of examples/): Gen5 x16, in D0.
        _write(sys / nic.pci_dir, {**PCI_LINK_GEN5_X16, "power_state": "D0\n"})
    _bus_link(sys, MGMT_PCI_DIR)
    for other_dir, attrs in ((ASPEED_DIR, PCI_ASPEED),
                             *((d, PCI_NVSWITCH) for d in NVSWITCH_DIRS)):
        _write(sys / other_dir, {**attrs, "numa_node": "0\n"})
        _bus_link(sys, other_dir)
    make_peermem(sys, "nvidia_peermem")
    return sys


# DGX H100: GPU i shares a PCIe switch with IB NIC mlx5_i (nvidia-smi topo: PIX).
DGX_GPU_BUSES = (0x1B, 0x43, 0x52, 0x61, 0x9D, 0xC3, 0xD1, 0xDF)


# Where build_rail_misplaced puts mlx5_0: a root port of its own on NUMA node 1.
RAIL_MISPLACED_BUS = 0xB0


def build_dgx_h100_gpus(root: Path, misplaced_rail: int | None = None) -> Path:
    """build_dgx_h100's RDMA devices, netdevs and PCI addresses (so the other collectors see the
    same node), placed in a DGX H100's PCIe layout: for each IB NIC a host bridge and root port
    on bus NIC-3, a switch (upstream port, downstream ports) whose downstream ports lead to the
    NIC and to one H100 GPU. GPUs 0-3 and mlx5_0-3 on NUMA node 0, the rest on 1; the RoCE
    mlx5_8 (node 0) and mlx5_9 (node 1) on root ports of their own. ACS redirect is off on every
    bridge, and nvidia_peermem is loaded. ``misplaced_rail``: that GPU's IB NIC is not in its
    switch but on a root port of its own on NUMA node 1, bus RAIL_MISPLACED_BUS
    (build_rail_misplaced)."""
    sys = root / "sys"
    nics = list(DGX_NICS)
    for i, gpu_bus in enumerate(DGX_GPU_BUSES):
        nic = nics[i]
        root_bus = nic.bus - 3
        port = _root_port(sys, root_bus, nic.numa)
        if i == misplaced_rail:
            downstream = _switch(sys, port, root_bus + 1, (gpu_bus,), nic.numa)
            nics[i] = replace(nic, bus=RAIL_MISPLACED_BUS, numa=1)
        else:
            downstream = _switch(sys, port, root_bus + 1, (nic.bus, gpu_bus), nic.numa)
            nics[i] = replace(nic, parent=downstream[nic.bus])
        _write_gpu(sys, downstream[gpu_bus], gpu_bus, nic.numa)
    return _write_gpu_node(root, nics)


def build_rail_misplaced(root: Path) -> Path:
    """build_dgx_h100_gpus with GPU 0's rail NIC in the wrong slot: mlx5_0 on a root port of
    its own on NUMA node 1 (bus RAIL_MISPLACED_BUS) instead of GPU 0's PCIe switch, which holds
    GPU 0 alone. GPU 0's nearest rail is then mlx5_1 (NODE, on GPU 0's NUMA node: the NUMA
    check is satisfied), which is GPU 1's too; mlx5_0 is the nearest rail of no GPU."""
    return build_dgx_h100_gpus(root, misplaced_rail=0)


def build_mixed_topology(root: Path) -> Path:
    """Four GPUs and three IB NICs at every distance nvidia-smi topo names.

    Host bridge pci0000:30 (NUMA 0): root port 30:01.0 -> switch A, whose downstream ports lead
    to mlx5_0 (33:00.0), to a second switch B holding GPU0 (36:00.0) and GPU1 (37:00.0), and to
    GPU2 (38:00.0); root port 30:02.0 -> GPU3 (39:00.0). mlx5_1 (51:00.0) on host bridge
    pci0000:50, NUMA 0; mlx5_2 (a1:00.0) on pci0000:a0, NUMA 1.
    With mlx5_0: GPU0 and GPU1 PXB, GPU2 PIX, GPU3 PHB. mlx5_1: NODE. mlx5_2: SYS.
    """
    sys = root / "sys"
    switch_a = _switch(sys, _root_port(sys, 0x30, 0), 0x31, (0x33, 0x34, 0x38), 0)
    switch_b = _switch(sys, switch_a[0x34], 0x34, (0x36, 0x37), 0)
    for bus in (0x36, 0x37):
        _write_gpu(sys, switch_b[bus], bus, 0)
    _write_gpu(sys, switch_a[0x38], 0x38, 0)
    _write_gpu(sys, _root_port(sys, 0x30, 0, slot=2), 0x39, 0)
    nics = (Nic(0, 0x33, numa=0, ifindex=3, parent=switch_a[0x33]),
            Nic(1, 0x51, numa=0, ifindex=4), Nic(2, 0xA1, numa=1, ifindex=5))
    return _write_gpu_node(root, nics)


def build_numa_wrong_side(root: Path) -> Path:
    """Two GPUs, two IB NICs, both NICs on NUMA node 1. GPU0 (1b:00.0, NUMA 0) sits alone on a
    root port; GPU1 (a0:00.0, NUMA 1) shares a switch with mlx5_0 (9d:00.0); mlx5_1 (c1:00.0,
    NUMA 1) has a root port of its own. GPU0's nearest NIC is mlx5_1 (SYS, like mlx5_0, but
    across fewer bridges), on the other NUMA node."""
    sys = root / "sys"
    _write_gpu(sys, _root_port(sys, 0x1A, 0), 0x1B, 0)
    downstream = _switch(sys, _root_port(sys, 0x9A, 1), 0x9B, (0x9D, 0xA0), 1)
    _write_gpu(sys, downstream[0xA0], 0xA0, 1)
    nics = (Nic(0, 0x9D, numa=1, ifindex=3, parent=downstream[0x9D]),
            Nic(1, 0xC1, numa=1, ifindex=4))
    return _write_gpu_node(root, nics)


def build_rail_wrong_side(root: Path) -> Path:
    """build_numa_wrong_side plus a storage RoCE NIC, mlx5_2 (29:00.0), on a root port of its own
    on NUMA node 0: GPU0's nearest RDMA device (NODE) but not a compute rail. GPU0's nearest rail
    is mlx5_1 (SYS), on NUMA node 1."""
    sys = root / "sys"
    _write_gpu(sys, _root_port(sys, 0x1A, 0), 0x1B, 0)
    downstream = _switch(sys, _root_port(sys, 0x9A, 1), 0x9B, (0x9D, 0xA0), 1)
    _write_gpu(sys, downstream[0xA0], 0xA0, 1)
    nics = (Nic(0, 0x9D, numa=1, ifindex=3, parent=downstream[0x9D]),
            Nic(1, 0xC1, numa=1, ifindex=4), Nic(2, 0x29, numa=0, roce=True, ifindex=5))
    return _write_gpu_node(root, nics)


def pci_function_dir(sys: Path, address: str) -> Path:
    """The real directory of a PCI function, found through bus/pci/devices like the kernel's."""
    return Path(os.path.realpath(sys / "bus" / "pci" / "devices" / address))


def set_numa_node(sys: Path, address: str, numa: int) -> None:
    """Change one PCI function's numa_node (-1: the platform gives none, as on many VMs)."""
    _write(pci_function_dir(sys, address), {"numa_node": f"{numa}\n"})


def _bridge_above(sys: Path, address: str) -> Path:
    return pci_function_dir(sys, address).parent


def _nic_function(sys: Path, device: str) -> Path:
    return Path(os.path.realpath(sys / "class" / "infiniband" / device / "device"))


def make_nic_pcie_downtrained(sys: Path, device: str = "mlx5_7", width: int = 8) -> None:
    """The NIC's PCIe link trained down to ``width`` lanes (Gen5 x16 -> x8 halves a 400G NIC):
    LnkSta of both ends, the NIC's function and the bridge port above it, says so."""
    nic = _nic_function(sys, device)
    for end in (nic, nic.parent):
        _write(end, {"current_link_width": f"{width}\n"})


def make_nic_slot_narrow(sys: Path, device: str = "mlx5_7", width: int = 8) -> None:
    """A x16 NIC in a slot whose port supports only ``width`` lanes: trained at that width, as
    it should; not a degraded link (scitix/sichek issue 122)."""
    nic = _nic_function(sys, device)
    _write(nic, {"current_link_width": f"{width}\n"})
    _write(nic.parent, {"current_link_width": f"{width}\n", "max_link_width": f"{width}\n"})


def make_acs_enabled(sys: Path, gpu_bus: int = 0x1B, control: int = ACS_CONTROL_REDIRECT,
                     domain: int = 0) -> Path:
    """Set the ACS Control register of the bridge right above the function <gpu_bus>:00.0 (for a
    GPU of the DGX tree, a switch downstream port; any bridge's address works too); returns that
    bridge's directory."""
    bridge = _bridge_above(sys, _bdf(domain, gpu_bus))
    config = bytearray((bridge / "config").read_bytes())
    struct.pack_into("<H", config, ACS_OFFSET + 6, control)
    (bridge / "config").write_bytes(bytes(config))
    return bridge


def make_acs_absent(sys: Path, gpu_bus: int = 0x1B, domain: int = 0) -> Path:
    """The bridge above GPU <gpu_bus> has no ACS capability (AER links straight to the next)."""
    bridge = _bridge_above(sys, _bdf(domain, gpu_bus))
    vendor, device = BRIDGE_IDS[DOWNSTREAM_PORT]
    (bridge / "config").write_bytes(pci_config(vendor, device, DOWNSTREAM_PORT, None))
    return bridge


def make_acs_unreadable(sys: Path, gpu_bus: int = 0x1B, domain: int = 0) -> Path:
    """The bridge above GPU <gpu_bus> as a reader without CAP_SYS_ADMIN sees its config space:
    only the first 64 bytes (drivers/pci/pci-sysfs.c pci_read_config)."""
    bridge = _bridge_above(sys, _bdf(domain, gpu_bus))
    config = (bridge / "config").read_bytes()
    (bridge / "config").write_bytes(config[:CONFIG_UNPRIVILEGED])
    return bridge


def make_peermem(sys: Path, module: str, version: str = DRIVER_VERSION) -> None:
    """A peer-memory client's version file (module: a key of PEERMEM_FILES)."""
    _write(sys, {PEERMEM_FILES[module]: f"{version}\n"})


def make_peermem_unloaded(sys: Path) -> None:
    """No peer-memory client at all: nvidia_peermem not loaded, no nv_peer_mem."""
    shutil.rmtree(sys / "module" / "nvidia_peermem", ignore_errors=True)
    shutil.rmtree(sys / "kernel" / "mm" / "memory_peers", ignore_errors=True)


def add_virtual_rdma_device(sys: Path, name: str = "rxe0", netdev: str = "eno1") -> None:
    """A soft-RoCE (rxe) device on ``netdev``: a class link into devices/virtual, no PCI parent
    (no ``device`` link), its netdev named by the GID table."""
    dev_dir = f"devices/virtual/infiniband/{name}"
    _write(sys / dev_dir, {"node_type": "1: CA\n", "hca_type": "\n"})
    _write(sys / dev_dir / "ports" / "1", {
        **PORT_COMMON, "link_layer": "Ethernet\n", **PORT_ATTRS["Ethernet"],
        "gid_attrs/ndevs/0": f"{netdev}\n", "gid_attrs/types/0": "RoCE v2\n",
    })
    _class_link(sys, "infiniband", name, dev_dir)


def build_procfs(root: Path, nvidia: str | None = NVRM_OPEN,
                 osrelease: str | None = OSRELEASE) -> Path:
    """root/proc with the NVIDIA driver's version file (None: no driver loaded) and the kernel
    release; add processes with write_process. Returns it (the --path.procfs value)."""
    proc = root / "proc"
    proc.mkdir(parents=True, exist_ok=True)
    _write(proc, {"driver/nvidia/version": nvidia,
                  "sys/kernel/osrelease": None if osrelease is None else f"{osrelease}\n"})
    return proc


def write_process(proc: Path, pid: int, environ: Mapping[str, str] | bytes,
                  starttime: int = 1_234_567, comm: str = "python3") -> None:
    """/proc/<pid>/stat (proc_pid_stat's format: starttime is field 22, in clock ticks since
    boot) and /proc/<pid>/environ (NUL-terminated KEY=value strings)."""
    raw = environ if isinstance(environ, bytes) else b"".join(
        f"{key}={val}".encode() + b"\0" for key, val in environ.items())
    fields = ["S", "1", str(pid), str(pid), "0", "-1", "4194560", "105273", "0", "12", "0",
              "1520", "310", "0", "0", "20", "0", "57", "0", str(starttime), "41943040000",
              "1203311", "18446744073709551615", *["0"] * 29]
    pid_dir = proc / str(pid)
    pid_dir.mkdir(parents=True, exist_ok=True)
    (pid_dir / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (pid_dir / "environ").write_bytes(raw)


# /proc/net/tcp's heading and a LISTEN line (state 0A), as tcp4_seq_show() prints them
# (net/ipv4/tcp_ipv4.c); addresses are hex, the IPv4 address in host (little-endian) order.
TCP_HEADER = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
              "timeout inode                                                     \n")
TCP6_HEADER = ("  sl  local_address                         remote_address                        "
               "st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n")


def write_tcp_listeners(proc: Path, ports: Sequence[int]) -> None:
    """/proc/net/tcp with one socket listening on 127.0.0.1 on each port (an NCCL process's RAS
    listener), and an empty /proc/net/tcp6."""
    lines = [f"{i:4d}: 0100007F:{port:04X} 00000000:0000 0A 00000000:00000000 00:00000000 "
             f"00000000  1000        0 {64300 + i} 1 000000007e6108dc 100 0 0 10 0"
             for i, port in enumerate(ports)]
    _write(proc, {"net/tcp": TCP_HEADER + "".join(f"{line}\n" for line in lines),
                  "net/tcp6": TCP6_HEADER})


def main() -> None:
    parser = argparse.ArgumentParser(
        description="(Re)generate a DGX H100 example sysfs tree: healthy, or with --faulty the "
                    "faults of FAULTY_EXAMPLE.")
    parser.add_argument("--faulty", action="store_true",
                        help="build the faulty tree (examples/dgx-h100-faulty)")
    parser.add_argument("dest", type=Path,
                        help="output directory, e.g. examples/dgx-h100 or examples/dgx-h100-faulty")
    args = parser.parse_args()
    dest: Path = args.dest
    config = None  # the tree's hand-written gpunet.yml (examples/README.md) is kept
    if dest.exists():
        if {p.name for p in dest.iterdir()} - {"sys", "mlnx_qos", "nic", EXAMPLE_CONFIG}:
            parser.error(f"{dest} holds more than a sys/ tree (and mlnx_qos/, nic/, "
                         f"{EXAMPLE_CONFIG}); refusing to delete it")
        if (dest / EXAMPLE_CONFIG).is_file():
            config = (dest / EXAMPLE_CONFIG).read_bytes()
        shutil.rmtree(dest)
    print((build_dgx_h100_faulty if args.faulty else build_dgx_h100_example)(dest))
    if config is not None:
        (dest / EXAMPLE_CONFIG).write_bytes(config)


if __name__ == "__main__":
    main()
