"""topology collector: GPU-NIC PCIe distances, nearest NIC and NUMA, ACS redirect, GPUDirect RDMA
readiness, and the NCCL environment audit of GPU processes."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import pytest

from gpunet_exporter.collector import Collector, Scrape
from gpunet_exporter.collectors.infiniband import InfinibandCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.topology import TopologyCollector
from gpunet_exporter.nccl.env import (
    NCCL_FAULT_CLASSES,
    NCCL_FINDINGS,
    NCCL_SETTING_NOTES,
    NCCL_SETTINGS,
    env_findings,
    env_settings,
    parse_environ,
    strtol,
)
from gpunet_exporter.sources.nvml import Gpu
from gpunet_exporter.sources.pcie import Endpoint, pci_sort_key, relation
from gpunet_exporter.sources.proc import parse_kernel_release, parse_nvidia_version, parse_starttime
from gpunet_exporter.sources.sysfs import Root

from support import sysfs_tree as st
from support.metrics import (
    Samples,
    collect,
    make_collector,
    parse,
    samples_of,
    scrape_and_page,
    series,
    value,
)

P = "gpunet_topology_"
NIC_NUMA = {f"mlx5_{i}": 0 if i < 4 else 1 for i in range(8)} | {"mlx5_8": 0, "mlx5_9": 1}
DGX_DEVICES = sorted(NIC_NUMA)
DGX_NETDEVS = {nic.netdev for nic in st.DGX_NICS}


class FakeNvml:
    """Stands in for the shared NVML session: the GPUs and compute PIDs it would report."""

    def __init__(self, gpus: list[Gpu] | None = None, pids: Iterable[int] | None = None) -> None:
        self._gpus = gpus
        self.pids = None if pids is None else set(pids)

    def gpus(self) -> list[Gpu] | None:
        return self._gpus

    def compute_pids(self) -> set[int] | None:
        return self.pids


def topology(sysfs: Path, procfs: Path | None = None, config: dict[str, object] | None = None,
             nvml: FakeNvml | None = None, root: Root | None = None) -> Collector:
    """A collector on the trees; NVML is the stand-in (no NVML unless given), so a GPU machine
    running the tests sees the fixture's GPUs, not its own."""
    c = make_collector(TopologyCollector, sysfs, config, root=root,
                       procfs=procfs or sysfs.parent / "no-proc")
    c.nvml = nvml or FakeNvml()  # type: ignore[attr-defined]
    return c


def run(sysfs: Path, procfs: Path | None = None, config: dict[str, object] | None = None,
        nvml: FakeNvml | None = None, root: Root | None = None) -> tuple[Samples, int]:
    c = topology(sysfs, procfs, config, nvml, root)
    try:
        return samples_of(list(c.collect(Scrape()))), c.ctx.unreadable
    finally:
        c.close()


def paths(s: Samples) -> dict[tuple[str, str], str]:
    """(gpu, device) -> path of every gpu_nic_path series."""
    out = {}
    for lbl, v in series(s, P + "gpu_nic_path").items():
        d = dict(lbl)
        assert v == 1
        out[(d["gpu"], d["device"])] = d["path"]
    return out


def nearest(s: Samples) -> dict[str, tuple[str, str]]:
    out = {}
    for lbl in series(s, P + "gpu_nearest_nic"):
        d = dict(lbl)
        assert d["gpu"] not in out, "one nearest device per GPU"
        out[d["gpu"]] = (d["device"], d["path"])
    return out


def acs(s: Samples) -> dict[tuple[str, str], float]:
    return {(dict(lbl)["gpu"], dict(lbl)["device"]): v
            for lbl, v in series(s, P + "gpu_nic_acs_redirect_bridges").items()}


def dgx_expected_paths(devices: Iterable[str] = DGX_DEVICES) -> dict[tuple[str, str], str]:
    devices = list(devices)
    out = {}
    for g in range(8):
        gpu_numa = 0 if g < 4 else 1
        for dev in devices:
            if dev == f"mlx5_{g}":
                out[(str(g), dev)] = "PIX"
            else:
                out[(str(g), dev)] = "NODE" if NIC_NUMA[dev] == gpu_numa else "SYS"
    return out


@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100_gpus(tmp_path / "tree")


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    return st.build_procfs(tmp_path / "tree")


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    return st.build_mixed_topology(tmp_path / "tree")


# ---- fixture trees ----------------------------------------------------------------------------


def test_dgx_gpu_tree_leaves_other_collectors_unchanged(dgx: Path, tmp_path: Path) -> None:
    plain = st.build_dgx_h100(tmp_path / "plain")
    no_tool = {"ibv_devinfo": {"enabled": False}}
    for cls, cfg in ((InfinibandCollector, {}), (LinkCollector, no_tool)):
        assert collect(cls, dgx, cfg) == collect(cls, plain, cfg), cls.name


def test_gpu_trees_deterministic_and_self_contained(tmp_path: Path) -> None:
    for build in (st.build_dgx_h100_gpus, st.build_mixed_topology, st.build_numa_wrong_side):
        trees = [build(tmp_path / build.__name__ / k) for k in "ab"]
        contents = []
        for sysfs in trees:
            entries = {}
            for path in sorted(sysfs.rglob("*")):
                rel = path.relative_to(sysfs).as_posix()
                if path.is_symlink():
                    target = os.readlink(path)
                    assert not target.startswith("/"), rel
                    real_root = os.path.realpath(sysfs)
                    assert os.path.realpath(path).startswith(real_root + "/"), rel
                    entries[rel] = target.encode()
                elif path.is_file():
                    entries[rel] = path.read_bytes()
            contents.append(entries)
        assert contents[0] == contents[1], build.__name__


def test_bridge_config_layout(dgx: Path) -> None:
    """The config files hold what lspci -vvv would decode: a type 1 header and the extended
    capability chain AER -> ACS -> Secondary PCIe, ACS redirect off."""
    downstream = st.pci_function_dir(dgx, "0000:1b:00.0").parent
    assert downstream.name == "0000:17:03.0"
    cfg = (downstream / "config").read_bytes()
    assert len(cfg) == 4096
    assert struct.unpack_from("<HH", cfg, 0) == (0x1000, 0xC030)
    assert cfg[0x0E] == 1 and cfg[0x0B] == 0x06
    offset, chain = 0x100, []
    while offset:
        header = struct.unpack_from("<I", cfg, offset)[0]
        chain.append((header & 0xFFFF, offset))
        offset = header >> 20
    assert chain == [(0x0001, 0x100), (0x000D, st.ACS_OFFSET), (0x0019, 0x158)]
    assert struct.unpack_from("<H", cfg, st.ACS_OFFSET + 6)[0] & 0x000C == 0


# ---- PCIe distances ---------------------------------------------------------------------------


def test_dgx_paths_nearest_and_numa(dgx: Path, proc: Path) -> None:
    s, unreadable = run(dgx, proc)
    assert unreadable == 0
    assert paths(s) == dgx_expected_paths()
    assert paths(s)[("0", "mlx5_0")] == "PIX"
    assert paths(s)[("0", "mlx5_1")] == "NODE"
    assert paths(s)[("0", "mlx5_4")] == "SYS"
    assert nearest(s) == {str(g): (f"mlx5_{g}", "PIX") for g in range(8)}
    assert series(s, P + "gpu_nearest_nic_numa_mismatch") == {
        frozenset({("gpu", str(g))}): 0 for g in range(8)}
    assert set(acs(s).values()) == {0}
    assert len(acs(s)) == 80


def test_sysfs_gpu_discovery_skips_nvswitch_and_bmc_vga(dgx: Path) -> None:
    """Without NVML, GPUs are the NVIDIA display/3D controllers numbered in PCI address order:
    the NVSwitch bridges (NVIDIA, class 0x0680) and the ASPEED VGA (class 0x0300) are not."""
    assert (dgx / "bus/pci/devices/0000:05:00.0/class").read_text() == "0x068000\n"
    assert (dgx / "bus/pci/devices/0000:04:00.0/class").read_text() == "0x030000\n"
    s, _ = run(dgx)
    assert {g for g, _ in paths(s)} == {str(g) for g in range(8)}
    assert nearest(s)["4"] == ("mlx5_4", "PIX")  # 0000:9d:00.0 is the fifth GPU by address


def test_pci_sort_key_orders_wide_domains_numerically() -> None:
    addresses = ["10000:00:00.0", "0000:c3:00.0", "0000:1b:00.0", "0001:00:00.0", "0000:1b:01.0"]
    assert sorted(addresses, key=pci_sort_key) == [
        "0000:1b:00.0", "0000:1b:01.0", "0000:c3:00.0", "0001:00:00.0", "10000:00:00.0"]


def test_nvml_gpus_keep_nvml_index(dgx: Path) -> None:
    gpus = [Gpu(0, "GPU-a", "NVIDIA H100 80GB HBM3", "0000:df:00.0", None),
            Gpu(1, "GPU-b", "NVIDIA H100 80GB HBM3", "0000:1b:00.0", None),
            Gpu(2, "", "", "", None)]  # lost at enumeration: no bus id, no series
    s, unreadable = run(dgx, nvml=FakeNvml(gpus))
    assert unreadable == 0
    assert nearest(s) == {"0": ("mlx5_7", "PIX"), "1": ("mlx5_0", "PIX")}
    assert value(s, P + "gdr_ready") == 1


def test_nvml_gpu_missing_from_sysfs_costs_its_series(dgx: Path) -> None:
    gpus = [Gpu(0, "", "", "0000:ee:00.0", None), Gpu(1, "", "", "0000:43:00.0", None)]
    s, unreadable = run(dgx, nvml=FakeNvml(gpus))
    assert unreadable == 1
    assert nearest(s) == {"1": ("mlx5_1", "PIX")}


def test_nvml_without_gpus_means_no_gpus(dgx: Path) -> None:
    s, unreadable = run(dgx, nvml=FakeNvml([]))  # NVML up, no GPU: sysfs is not consulted
    assert unreadable == 0
    assert not paths(s) and value(s, P + "gdr_ready") is None
    assert value(s, P + "gdr_peermem_loaded") == 1


def test_mixed_topology_every_distance(mixed: Path) -> None:
    s, unreadable = run(mixed)
    assert unreadable == 0
    assert paths(s) == {
        ("0", "mlx5_0"): "PXB", ("1", "mlx5_0"): "PXB", ("2", "mlx5_0"): "PIX",
        ("3", "mlx5_0"): "PHB",
        **{(g, "mlx5_1"): "NODE" for g in "0123"}, **{(g, "mlx5_2"): "SYS" for g in "0123"},
    }
    assert nearest(s) == {"0": ("mlx5_0", "PXB"), "1": ("mlx5_0", "PXB"),
                          "2": ("mlx5_0", "PIX"), "3": ("mlx5_0", "PHB")}


def test_numa_wrong_side(tmp_path: Path) -> None:
    sysfs = st.build_numa_wrong_side(tmp_path)
    s, unreadable = run(sysfs)
    assert unreadable == 0
    assert paths(s) == {("0", "mlx5_0"): "SYS", ("0", "mlx5_1"): "SYS",
                        ("1", "mlx5_0"): "PIX", ("1", "mlx5_1"): "NODE"}
    # Both SYS; mlx5_1 is across 2 bridges (two root ports), mlx5_0 across 4 (and sorts first).
    assert nearest(s) == {"0": ("mlx5_1", "SYS"), "1": ("mlx5_0", "PIX")}
    assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="0") == 1
    assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="1") == 0


def test_unknown_numa_counts_as_same_node(tmp_path: Path) -> None:
    sysfs = st.build_numa_wrong_side(tmp_path)
    st.set_numa_node(sysfs, "0000:1b:00.0", -1)
    s, unreadable = run(sysfs)
    assert unreadable == 0
    assert paths(s)[("0", "mlx5_0")] == paths(s)[("0", "mlx5_1")] == "NODE"
    assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="0") is None  # unknown, not 0
    assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="1") == 0


def test_unknown_nic_numa(dgx: Path) -> None:
    st.set_numa_node(dgx, "0000:9a:00.0", -1)  # mlx5_4
    s, _ = run(dgx)
    assert paths(s)[("0", "mlx5_4")] == "NODE"
    assert paths(s)[("0", "mlx5_5")] == "SYS"
    assert paths(s)[("4", "mlx5_4")] == "PIX"
    assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="4") is None


def test_garbage_numa_costs_one_value(dgx: Path) -> None:
    (st.pci_function_dir(dgx, "0000:1b:00.0") / "numa_node").write_text("lots\n")
    s, unreadable = run(dgx)
    assert unreadable == 1
    assert paths(s)[("0", "mlx5_4")] == "NODE"  # treated as unknown
    assert paths(s)[("1", "mlx5_4")] == "SYS"


@pytest.mark.parametrize("exclude,expected", [
    ("^mlx5_0$", ("mlx5_8", "NODE")),  # NODE like mlx5_1-3, across 4 bridges instead of 6
    ("^mlx5_[08]$", ("mlx5_1", "NODE")),  # mlx5_1, 2 and 3 tie: the name decides
])
def test_nearest_tie_breaks(dgx: Path, exclude: str, expected: tuple[str, str]) -> None:
    s, _ = run(dgx, config={"device_exclude": exclude})
    assert nearest(s)["0"] == expected


def test_relation_rules() -> None:
    def ep(name: str, host: str, *chain: str, numa: int = 0) -> Endpoint:
        return Endpoint(name, host, chain, tuple(f"d/{c}" for c in chain), numa)

    gpu = ep("0", "pci0000:10", "rp", "usp", "dsp1", "gpu")
    assert relation(gpu, ep("n", "pci0000:10", "rp", "usp", "dsp2", "nic")).path == "PIX"
    # NIC right on the switch's internal bus: still one bridge at most per side.
    assert relation(gpu, ep("n", "pci0000:10", "rp", "usp", "nic")).path == "PIX"
    deep = relation(gpu, ep("n", "pci0000:10", "rp", "usp", "dsp2", "usp2", "dsp3", "nic"))
    assert deep.path == "PXB" and deep.bridges == ("d/dsp1", "d/dsp2", "d/usp2", "d/dsp3")
    two = ep("n", "pci0000:10", "rp", "usp", "dsp2", "usp2", "nic")  # 2 bridges on its side
    assert relation(gpu, two).path == "PXB" and relation(two, gpu).path == "PXB"
    assert relation(gpu, ep("n", "pci0000:10", "rp2", "nic")).path == "PHB"
    assert relation(gpu, ep("n", "pci0000:20", "rp", "nic", numa=0)).path == "NODE"
    far = relation(gpu, ep("n", "pci0000:20", "rp", "nic", numa=1))
    assert far.path == "SYS" and far.bridges == ("d/rp", "d/usp", "d/dsp1", "d/rp")
    assert relation(gpu, ep("n", "pci0000:20", "rp", "nic", numa=-1)).path == "NODE"
    assert relation(ep("0", "pci0000:20", "rp", "g", numa=-1),
                    ep("n", "pci0000:30", "rp", "nic", numa=1)).path == "NODE"


def test_virtual_and_dangling_rdma_devices_skipped(dgx: Path) -> None:
    st.add_virtual_rdma_device(dgx, "rxe0", "eno1")
    st.add_dangling_device(dgx, "mlx5_10")
    s, unreadable = run(dgx)
    assert unreadable == 0
    assert {dev for _, dev in paths(s)} == set(DGX_DEVICES)


def test_include_exclude(dgx: Path) -> None:
    s, _ = run(dgx, config={"device_include": "^mlx5_[0-3]$", "device_exclude": "mlx5_2"})
    assert {dev for _, dev in paths(s)} == {"mlx5_0", "mlx5_1", "mlx5_3"}
    assert nearest(s)["2"] == ("mlx5_0", "NODE")  # mlx5_0, 1 and 3 tie: the name decides
    assert nearest(s)["4"][1] == "SYS"


def test_no_gpus_no_rdma(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    sysfs.mkdir()
    s, unreadable = run(sysfs)
    assert unreadable == 0
    assert s == {(P + "gdr_peermem_loaded", frozenset()): 0}


def test_rdma_node_without_gpus(tmp_path: Path) -> None:
    s, unreadable = run(st.build_dgx_h100(tmp_path), st.build_procfs(tmp_path))
    assert unreadable == 0
    assert not paths(s) and not series(s, P + "gpu_nic_acs_redirect_bridges")
    assert value(s, P + "gdr_ready") is None  # only where there is a GPU


# ---- ACS ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("control,redirect", [
    (st.ACS_CONTROL_REDIRECT, 1), (0x0004, 1), (0x0008, 1),  # request, completion redirect
    (st.ACS_CONTROL_OFF, 0), (0x0001 | 0x0002 | 0x0010 | 0x0040, 0), (0xFFF3, 0),
])
def test_acs_redirect_bits(dgx: Path, control: int, redirect: int) -> None:
    st.make_acs_enabled(dgx, gpu_bus=0x1B, control=control)
    s, unreadable = run(dgx)
    assert unreadable == 0
    got = acs(s)
    assert got[("0", "mlx5_0")] == redirect  # the downstream port above GPU0 is on every path
    assert got[("0", "mlx5_4")] == redirect  # of GPU0
    assert got[("1", "mlx5_0")] == 0  # but on no path of GPU1's
    assert sum(got.values()) == 10 * redirect


def test_acs_counts_only_bridges_below_the_shared_one(mixed: Path) -> None:
    st.make_acs_enabled(mixed, gpu_bus=0x36)  # switch B's port above GPU0
    st.make_acs_enabled(mixed, gpu_bus=0x34)  # switch A's port above switch B
    st.make_acs_enabled(mixed, gpu_bus=0x32)  # switch A's upstream port (above 32:00.0)
    got = acs(run(mixed)[0])
    assert got[("0", "mlx5_0")] == 2  # 32:01.0 and 35:00.0; 31:00.0 is shared, not crossed
    assert got[("1", "mlx5_0")] == 1
    assert got[("2", "mlx5_0")] == 0  # PIX below the redirecting upstream port
    assert got[("3", "mlx5_0")] == 1  # PHB: up through 31:00.0 on the NIC's side
    assert got[("0", "mlx5_1")] == 3  # NODE: every bridge on GPU0's side
    assert got[("2", "mlx5_2")] == 1


def test_acs_capability_absent_means_no_redirect(dgx: Path) -> None:
    st.make_acs_absent(dgx, gpu_bus=0x1B)
    s, unreadable = run(dgx)
    assert unreadable == 0
    assert acs(s)[("0", "mlx5_0")] == 0 and len(acs(s)) == 80


def test_acs_unknown_without_root(dgx: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A config file that ends at 64 bytes (what a reader without CAP_SYS_ADMIN gets): no ACS
    series for the pairs crossing that bridge, and not an error."""
    bridge = st.make_acs_unreadable(dgx, gpu_bus=0x1B)
    caplog.set_level(logging.DEBUG, logger="gpunet")
    s, unreadable = run(dgx)
    assert unreadable == 0
    got = acs(s)
    assert not [k for k in got if k[0] == "0"]
    assert len(got) == 70 and got[("1", "mlx5_0")] == 0
    assert len(paths(s)) == 80  # the distances do not need config space
    messages = [r.getMessage() for r in caplog.records
                if "with CAP_SYS_ADMIN only" in r.getMessage()]
    assert len(messages) == 1 and bridge.name in messages[0]
    # Not checked, and said: gpunet_check_unknown and the landing page, through the registry.
    got_s, page = scrape_and_page(topology(dgx))
    assert series(got_s, "gpunet_check_unknown") == {frozenset(
        {("collector", "topology"), ("check", "acs"), ("reason", "privilege_missing")}): 1}
    assert ("UNKNOWN: acs not checked (it needs a capability the exporter was not given)"
            in page)


def test_acs_audit_switched_off(dgx: Path) -> None:
    """``acs_audit: false`` (ACS checked another way): no config space read, no ACS series and
    nothing unknown, though the bridges would refuse it; the distances stay."""
    st.make_acs_unreadable(dgx, gpu_bus=0x1B)
    root = BytesErrnoRoot(str(dgx), "/never", errno.EIO)
    c = topology(dgx, config={"acs_audit": False}, root=root)
    s, page = scrape_and_page(c)
    assert not acs(s) and not [r for r in root.reads if r.endswith("/config")]
    assert len(paths(s)) == 80
    assert not series(s, "gpunet_check_unknown") and "UNKNOWN" not in page


class BytesErrnoRoot(Root):
    def __init__(self, root: str, suffix: str, err: int) -> None:
        super().__init__(root)
        self.suffix, self.err = suffix, err
        self.reads: list[str] = []

    def read_bytes(self, rel: str, offset: int, size: int) -> bytes:
        self.reads.append(rel)
        if rel.endswith(self.suffix):
            raise OSError(self.err, os.strerror(self.err))
        return super().read_bytes(rel, offset, size)


def test_acs_read_error_is_unknown(dgx: Path) -> None:
    root = BytesErrnoRoot(str(dgx), "0000:16:00.0/0000:17:03.0/config", errno.EACCES)
    s, unreadable = run(dgx, root=root)
    assert unreadable == 0
    assert not [k for k in acs(s) if k[0] == "0"] and len(acs(s)) == 70
    # Each bridge is read once per scrape, however many pairs cross it.
    # AER header, ACS header, ACS Control: 3 reads, though 17 pairs cross this root port.
    assert root.reads.count("devices/pci0000:15/0000:15:01.0/config") == 3


@pytest.mark.parametrize("header", [0x0000_0000, 0xFFFF_FFFF, 0x1000_0001])  # none; broken; loop
def test_acs_odd_capability_lists(dgx: Path, header: int) -> None:
    downstream = st.pci_function_dir(dgx, "0000:1b:00.0").parent
    cfg = bytearray((downstream / "config").read_bytes())
    struct.pack_into("<I", cfg, 0x100, header)  # 0x1000_0001: AER pointing at itself
    (downstream / "config").write_bytes(bytes(cfg))
    s, unreadable = run(dgx)
    assert unreadable == 0
    assert acs(s)[("0", "mlx5_0")] == 0


# ---- GPUDirect RDMA -----------------------------------------------------------------------------


@pytest.mark.parametrize("module", list(st.PEERMEM_FILES))
def test_peermem_each_path(dgx: Path, tmp_path: Path, module: str) -> None:
    st.make_peermem_unloaded(dgx)
    st.make_peermem(dgx, module, "1.3-0" if module.startswith("nv_") else "580.159.04")
    proc = st.build_procfs(tmp_path / "tree", st.NVRM_PROPRIETARY)  # no DMA-BUF
    s, unreadable = run(dgx, proc)
    assert unreadable == 0
    assert value(s, P + "gdr_peermem_loaded") == 1
    info = [dict(lbl) for lbl in series(s, P + "gdr_peermem_info")]
    assert info == [{"module": module,
                     "version": "1.3-0" if module.startswith("nv_") else "580.159.04"}]
    assert value(s, P + "gdr_ready") == 1
    assert gdr_path(s) == "peermem"  # the proprietary module: no DMA-BUF


def test_peermem_unloaded(dgx: Path, tmp_path: Path) -> None:
    st.make_peermem_unloaded(dgx)
    proc = st.build_procfs(tmp_path / "tree", st.NVRM_PROPRIETARY)
    s, _ = run(dgx, proc)
    assert value(s, P + "gdr_peermem_loaded") == 0
    assert not series(s, P + "gdr_peermem_info")
    assert value(s, P + "gdr_dmabuf_capable") == 0
    assert value(s, P + "gdr_ready") == 0
    assert gdr_path(s) == "none"


def gdr_path(s: Samples) -> str | None:
    """The one path gpunet_topology_gdr_path says GPUDirect RDMA takes (None: no series)."""
    got = {dict(lbl)["path"]: v for lbl, v in series(s, P + "gdr_path").items()}
    if not got:
        return None
    assert sorted(got) == ["dmabuf", "none", "peermem"] and sum(got.values()) == 1, got
    return next(p for p, v in got.items() if v == 1)


def test_peermem_version_capped(dgx: Path) -> None:
    st.make_peermem(dgx, "nvidia_peermem", "9" * 40)
    s, _ = run(dgx)
    (lbl,) = series(s, P + "gdr_peermem_info")
    assert dict(lbl)["version"] == "9" * 32


def test_peermem_version_unreadable(dgx: Path) -> None:
    version = dgx / st.PEERMEM_FILES["nvidia_peermem"]
    version.unlink()
    version.mkdir()  # EISDIR: present, unreadable
    s, unreadable = run(dgx)
    assert unreadable == 1
    assert value(s, P + "gdr_peermem_loaded") == 1 and not series(s, P + "gdr_peermem_info")


@pytest.mark.parametrize("nvrm,release,flavor,version,capable", [
    (st.NVRM_OPEN, "6.8.0-45-generic", "open", "580.159.04", 1),
    (st.NVRM_OPEN, "5.12.0-rc1", "open", "580.159.04", 1),
    (st.NVRM_OPEN, "5.11.22-100.fc32.x86_64", "open", "580.159.04", 0),
    (st.NVRM_OPEN, "4.18.0-553.el8_10.x86_64", "open", "580.159.04", 0),
    (st.NVRM_PROPRIETARY, "6.8.0-45-generic", "proprietary", "535.129.03", 0),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for aarch64  570.86.15  Release Build  "
     "(dvs-builder@U16-I1-N07-12-3)  Wed Jan 22 10:36:14 UTC 2025\n", "6.11.0-1004-nvidia",
     "open", "570.86.15", 1),
])
def test_dmabuf(dgx: Path, tmp_path: Path, nvrm: str, release: str, flavor: str, version: str,
                capable: int) -> None:
    st.make_peermem_unloaded(dgx)
    s, unreadable = run(dgx, st.build_procfs(tmp_path / "tree", nvrm, release))
    assert unreadable == 0
    assert value(s, P + "nvidia_kernel_module_info", flavor=flavor, version=version) == 1
    assert value(s, P + "gdr_dmabuf_capable") == capable
    assert value(s, P + "gdr_ready") == capable
    assert gdr_path(s) == ("dmabuf" if capable else "none")
    st.make_peermem(dgx, "nvidia_peermem")  # both: DMA-BUF first, as NCCL tries it
    assert gdr_path(run(dgx, st.build_procfs(tmp_path / "tree2", nvrm, release))[0]) == (
        "dmabuf" if capable else "peermem")


def test_no_nvidia_driver(dgx: Path, tmp_path: Path) -> None:
    st.make_peermem_unloaded(dgx)
    s, unreadable = run(dgx, st.build_procfs(tmp_path / "tree", nvidia=None))
    assert unreadable == 0
    assert not series(s, P + "nvidia_kernel_module_info")
    assert value(s, P + "gdr_dmabuf_capable") is None
    assert value(s, P + "gdr_ready") == 0


def test_unreadable_driver_files(dgx: Path, tmp_path: Path) -> None:
    st.make_peermem_unloaded(dgx)
    proc = st.build_procfs(tmp_path / "tree", osrelease=None)
    s, unreadable = run(dgx, proc)
    assert unreadable == 1  # osrelease missing: DMA-BUF unknown
    assert value(s, P + "nvidia_kernel_module_info", flavor="open", version="580.159.04") == 1
    assert value(s, P + "gdr_dmabuf_capable") is None
    assert value(s, P + "gdr_ready") is None  # neither yes nor no
    assert gdr_path(s) is None
    (proc / "driver/nvidia/version").write_text("garbage\n")
    s, unreadable = run(dgx, proc)
    assert unreadable == 1 and not series(s, P + "nvidia_kernel_module_info")
    st.make_peermem(dgx, "nvidia_peermem")  # peermem alone decides then
    s = run(dgx, proc)[0]
    assert value(s, P + "gdr_ready") == 1
    assert gdr_path(s) is None  # ready, but whether DMA-BUF would be taken is not known


def test_version_parsers() -> None:
    assert parse_nvidia_version(st.NVRM_OPEN) == ("open", "580.159.04")
    assert parse_nvidia_version(st.NVRM_PROPRIETARY) == ("proprietary", "535.129.03")
    assert parse_nvidia_version("") is None
    assert parse_kernel_release("6.8.0-45-generic") == (6, 8)
    assert parse_kernel_release("5.14.0-427.13.1.el9_4.x86_64") == (5, 14)
    assert parse_kernel_release("linux") is None


# ---- NCCL environment audit --------------------------------------------------------------------

NONE: set[tuple[str, str]] = set()


@pytest.mark.parametrize("env,expected", [
    ({}, NONE),
    ({"NCCL_DEBUG": "INFO", "NCCL_IB_QPS_PER_CONNECTION": "4"}, NONE),
    # NCCL_IB_DISABLE: an int64 parameter (strtoll base 0), any non-zero value disables IB.
    ({"NCCL_IB_DISABLE": "1"}, {("NCCL_IB_DISABLE", "ib_disabled")}),
    ({"NCCL_IB_DISABLE": "2"}, {("NCCL_IB_DISABLE", "ib_disabled")}),
    ({"NCCL_IB_DISABLE": " 0x1"}, {("NCCL_IB_DISABLE", "ib_disabled")}),
    ({"NCCL_IB_DISABLE": "0"}, NONE),
    ({"NCCL_IB_DISABLE": ""}, NONE),
    ({"NCCL_IB_DISABLE": "yes"}, NONE),  # strtoll reads no digits: 0
    # GDR level: the name LOC (strcmp: case matters), or a legacy number 0.
    ({"NCCL_NET_GDR_LEVEL": "LOC"}, {("NCCL_NET_GDR_LEVEL", "gdr_disabled")}),
    ({"NCCL_NET_GDR_LEVEL": "0"}, {("NCCL_NET_GDR_LEVEL", "gdr_disabled")}),
    ({"NCCL_NET_GDR_LEVEL": "00"}, {("NCCL_NET_GDR_LEVEL", "gdr_disabled")}),
    ({"NCCL_NET_GDR_LEVEL": "loc"}, NONE),  # NCCL ignores it and keeps its default
    ({"NCCL_NET_GDR_LEVEL": "PXB"}, NONE),
    ({"NCCL_NET_GDR_LEVEL": "5"}, NONE),
    ({"NCCL_NET_GDR_LEVEL": ""}, NONE),
    ({"NCCL_IB_GDR_LEVEL": "0"}, {("NCCL_IB_GDR_LEVEL", "gdr_disabled")}),
    ({"NCCL_IB_GDR_LEVEL": "LOC"}, {("NCCL_IB_GDR_LEVEL", "gdr_disabled")}),
    ({"NCCL_NET_GDR_LEVEL": "PXB", "NCCL_IB_GDR_LEVEL": "0"}, NONE),  # the current name wins
    ({"NCCL_NET_GDR_LEVEL": "LOC", "NCCL_IB_GDR_LEVEL": "0"},
     {("NCCL_NET_GDR_LEVEL", "gdr_disabled")}),
    # NCCL_P2P_DISABLE: strtol == 1 exactly.
    ({"NCCL_P2P_DISABLE": "1"}, {("NCCL_P2P_DISABLE", "p2p_disabled")}),
    ({"NCCL_P2P_DISABLE": "01"}, {("NCCL_P2P_DISABLE", "p2p_disabled")}),
    ({"NCCL_P2P_DISABLE": "2"}, NONE),
    ({"NCCL_P2P_DISABLE": "0"}, NONE),
    # NCCL_NET: compared with strcasecmp.
    ({"NCCL_NET": "Socket"}, {("NCCL_NET", "socket_forced")}),
    ({"NCCL_NET": "SOCKET"}, {("NCCL_NET", "socket_forced")}),
    ({"NCCL_NET": "IB"}, NONE),
    ({"NCCL_NET": "Sockets"}, NONE),
    # NCCL_P2P_LEVEL: LOC (or legacy 0) turns P2P off, unless NCCL_P2P_DISABLE decided already.
    ({"NCCL_P2P_LEVEL": "LOC"}, {("NCCL_P2P_LEVEL", "p2p_disabled")}),
    ({"NCCL_P2P_LEVEL": "0"}, {("NCCL_P2P_LEVEL", "p2p_disabled")}),
    ({"NCCL_P2P_LEVEL": "NVL"}, NONE),
    ({"NCCL_P2P_LEVEL": "SYS"}, NONE),
    ({"NCCL_P2P_LEVEL": "LOC", "NCCL_P2P_DISABLE": "1"}, {("NCCL_P2P_DISABLE", "p2p_disabled")}),
    # NCCL_SOCKET_IFNAME is a setting, never a fault: it carries bootstrap and socket traffic.
    ({"NCCL_SOCKET_IFNAME": "eno1"}, NONE),
    ({"NCCL_SOCKET_IFNAME": "bond0"}, NONE),
    ({"NCCL_SOCKET_IFNAME": "=ibp24"}, NONE),
    # Settings with at most a note: forced algorithms and protocols, buffers, channels, SHM.
    ({"NCCL_ALGO": "Ring", "NCCL_PROTO": "Simple", "NCCL_BUFFSIZE": "1024",
      "NCCL_MAX_NCHANNELS": "1", "NCCL_SHM_DISABLE": "1", "NCCL_CROSS_NIC": "1"}, NONE),
    ({"NCCL_NET_GDR_LEVEL": "PIX", "NCCL_IB_HCA": "mlx5_0"}, NONE),
    # NCCL_IB_HCA: dev[:port] entries, prefixes unless =, ^ not judged; any unknown entry.
    ({"NCCL_IB_HCA": "mlx5_0"}, NONE),
    ({"NCCL_IB_HCA": "mlx5"}, NONE),
    ({"NCCL_IB_HCA": "mlx5_0:1,mlx5_3:1,mlx5_9"}, NONE),
    ({"NCCL_IB_HCA": "=mlx5_0:1,=mlx5_1"}, {("NCCL_IB_HCA", "unknown_device")}),  # "=mlx5_1"
    ({"NCCL_IB_HCA": "=mlx5_0:1,mlx5_1:1"}, NONE),
    ({"NCCL_IB_HCA": "=mlx5"}, {("NCCL_IB_HCA", "unknown_device")}),
    ({"NCCL_IB_HCA": "mlx5_0,mlx5_10"}, {("NCCL_IB_HCA", "unknown_device")}),
    ({"NCCL_IB_HCA": "mlx5_bond_0:1"}, {("NCCL_IB_HCA", "unknown_device")}),
    ({"NCCL_IB_HCA": "^mlx5_42"}, NONE),
    ({"NCCL_IB_HCA": ":1,"}, NONE),
    ({"NCCL_IB_DISABLE": "1", "NCCL_NET": "socket", "NCCL_P2P_DISABLE": "1"},
     {("NCCL_IB_DISABLE", "ib_disabled"), ("NCCL_NET", "socket_forced"),
      ("NCCL_P2P_DISABLE", "p2p_disabled")}),
])
def test_env_findings(env: dict[str, str], expected: set[tuple[str, str]]) -> None:
    assert env_findings(env, DGX_NETDEVS, DGX_DEVICES) == expected


def test_env_ib_hca_naming_a_plane_without_data_is_unknown() -> None:
    """On a multi-plane device an NCCL_IB_HCA entry that selects only a plane carrying no data
    (roce_r0:1) gives NCCL no port, as a missing device does; a data plane, or the device with
    no port (NCCL takes its ACTIVE ports), is fine."""
    devices = ["roce_r0", "roce_r1"]
    no_data = {(d, str(p)) for d in devices for p in range(1, 13) if p % 3}
    for hca, cls in (("=roce_r0:1", "unknown_device"), ("roce_r0:3,roce_r1:1", "unknown_device"),
                     ("roce_r:2", "unknown_device"), ("=roce_r0:3,roce_r1:6", "devices_present"),
                     ("roce_r0", "devices_present"), ("roce_r:3", "devices_present")):
        assert env_settings({"NCCL_IB_HCA": hca}, set(), devices, no_data) == {
            "NCCL_IB_HCA": cls}, hca
    # Without the judgement of the planes (the default), only the device names count.
    assert env_settings({"NCCL_IB_HCA": "=roce_r0:1"}, set(), devices) == {
        "NCCL_IB_HCA": "devices_present"}


def test_env_findings_without_rdma() -> None:
    # No RDMA netdev at all: where sockets go says nothing then; a named HCA is still unknown.
    assert env_findings({"NCCL_SOCKET_IFNAME": "eno1", "NCCL_IB_HCA": "mlx5_0"}, set(), []) == {
        ("NCCL_IB_HCA", "unknown_device")}
    assert env_settings({"NCCL_SOCKET_IFNAME": "eno1"}, set(), []) == {
        "NCCL_SOCKET_IFNAME": "non_rdma_netdev"}


@pytest.mark.parametrize("env,expected", [
    ({}, {}),
    ({"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": ""}, {}),  # not audited; empty is unset
    ({"NCCL_IB_DISABLE": "0", "NCCL_SHM_DISABLE": "1"},
     {"NCCL_IB_DISABLE": "enabled", "NCCL_SHM_DISABLE": "disabled"}),
    ({"NCCL_NET": "IB"}, {"NCCL_NET": "ib"}),
    ({"NCCL_NET": "AWS Libfabric"}, {"NCCL_NET": "other"}),  # a plugin's name: never a label
    ({"NCCL_NET": "socket"}, {"NCCL_NET": "socket"}),
    # Path levels: names (case matters), legacy numbers 0-5 (above 5 clamps to SYS).
    ({"NCCL_NET_GDR_LEVEL": "PIX"}, {"NCCL_NET_GDR_LEVEL": "pix"}),
    ({"NCCL_NET_GDR_LEVEL": "2"}, {"NCCL_NET_GDR_LEVEL": "pxb"}),
    ({"NCCL_NET_GDR_LEVEL": "3"}, {"NCCL_NET_GDR_LEVEL": "phb"}),
    ({"NCCL_NET_GDR_LEVEL": "17"}, {"NCCL_NET_GDR_LEVEL": "sys"}),
    ({"NCCL_NET_GDR_LEVEL": "pix"}, {"NCCL_NET_GDR_LEVEL": "unrecognized"}),
    ({"NCCL_NET_GDR_LEVEL": "PXB", "NCCL_IB_GDR_LEVEL": "LOC"},
     {"NCCL_NET_GDR_LEVEL": "pxb", "NCCL_IB_GDR_LEVEL": "overridden"}),
    ({"NCCL_P2P_DISABLE": "2", "NCCL_P2P_LEVEL": "NVL"},
     {"NCCL_P2P_DISABLE": "no_effect", "NCCL_P2P_LEVEL": "nvl"}),
    ({"NCCL_P2P_DISABLE": "1", "NCCL_P2P_LEVEL": "SYS"}, {"NCCL_P2P_DISABLE": "disabled"}),
    # NCCL_SOCKET_IFNAME: prefixes, =exact, ^exclusion (not judged), one character ignored.
    ({"NCCL_SOCKET_IFNAME": "bond0"}, {"NCCL_SOCKET_IFNAME": "non_rdma_netdev"}),
    ({"NCCL_SOCKET_IFNAME": "eth,docker"}, {"NCCL_SOCKET_IFNAME": "non_rdma_netdev"}),
    ({"NCCL_SOCKET_IFNAME": "=ibp24"}, {"NCCL_SOCKET_IFNAME": "non_rdma_netdev"}),
    ({"NCCL_SOCKET_IFNAME": "ib"}, {"NCCL_SOCKET_IFNAME": "rdma_netdev"}),
    ({"NCCL_SOCKET_IFNAME": "eno1,enp41"}, {"NCCL_SOCKET_IFNAME": "rdma_netdev"}),
    ({"NCCL_SOCKET_IFNAME": "=ibp24s0"}, {"NCCL_SOCKET_IFNAME": "rdma_netdev"}),
    ({"NCCL_SOCKET_IFNAME": "ibp24s0:1"}, {"NCCL_SOCKET_IFNAME": "rdma_netdev"}),
    ({"NCCL_SOCKET_IFNAME": "^docker,lo"}, {"NCCL_SOCKET_IFNAME": "exclusion"}),
    ({"NCCL_SOCKET_IFNAME": "e"}, {"NCCL_SOCKET_IFNAME": "ignored"}),
    ({"NCCL_IB_HCA": "mlx5_0:1,mlx5_3:1"}, {"NCCL_IB_HCA": "devices_present"}),
    ({"NCCL_IB_HCA": "mlx5_0,mlx5_10"}, {"NCCL_IB_HCA": "unknown_device"}),
    ({"NCCL_IB_HCA": "^mlx5_42"}, {"NCCL_IB_HCA": "exclusion"}),
    # NCCL_ALGO / NCCL_PROTO: one known name (any case), a list, an exclusion, anything else.
    ({"NCCL_ALGO": "Ring"}, {"NCCL_ALGO": "ring"}),
    ({"NCCL_ALGO": "Tree,Ring"}, {"NCCL_ALGO": "list"}),
    ({"NCCL_ALGO": "^NVLS"}, {"NCCL_ALGO": "exclusion"}),
    ({"NCCL_ALGO": "allreduce:tree;broadcast:ring"}, {"NCCL_ALGO": "other"}),
    ({"NCCL_PROTO": "LL128"}, {"NCCL_PROTO": "ll128"}),
    ({"NCCL_PROTO": "^LL128"}, {"NCCL_PROTO": "exclusion"}),
    ({"NCCL_PROTO": "Fast"}, {"NCCL_PROTO": "other"}),
    # NCCL_BUFFSIZE against the 4 MiB default; channels and cross-NIC are only named.
    ({"NCCL_BUFFSIZE": "1048576"}, {"NCCL_BUFFSIZE": "below_default"}),
    ({"NCCL_BUFFSIZE": "0x400000"}, {"NCCL_BUFFSIZE": "default_or_above"}),
    ({"NCCL_BUFFSIZE": "big"}, {"NCCL_BUFFSIZE": "invalid"}),
    ({"NCCL_CROSS_NIC": "2", "NCCL_MIN_NCHANNELS": "32", "NCCL_MAX_NCHANNELS": "4"},
     {"NCCL_CROSS_NIC": "2", "NCCL_MIN_NCHANNELS": "set", "NCCL_MAX_NCHANNELS": "set"}),
    ({"NCCL_CROSS_NIC": "yes"}, {"NCCL_CROSS_NIC": "other"}),
])
def test_env_settings(env: dict[str, str], expected: dict[str, str]) -> None:
    settings = env_settings(env, DGX_NETDEVS, DGX_DEVICES)
    assert settings == expected
    assert all(cls in NCCL_SETTINGS[var] for var, cls in settings.items())  # the fixed vocabulary


def test_fault_classes_and_notes_are_in_the_vocabulary() -> None:
    assert {(var, issue) for (var, _), issue in NCCL_FAULT_CLASSES.items()} == set(NCCL_FINDINGS)
    for var, cls in (*NCCL_FAULT_CLASSES, *NCCL_SETTING_NOTES):
        assert cls in NCCL_SETTINGS[var], (var, cls)
    # A fault is never also a mere note: the doctor reports it once, as a finding.
    assert not set(NCCL_FAULT_CLASSES) & set(NCCL_SETTING_NOTES)


def test_strtol() -> None:
    for text, n in (("0x1f", 31), ("010", 8), ("-3", -3), (" 7abc", 7), ("", 0), ("abc", 0),
                    ("0x", 0), ("09", 0), ("+12", 12), ("0XA", 10)):
        assert strtol(text) == n, text


def test_parse_environ_and_stat() -> None:
    raw = (b"PATH=/usr/bin\0NCCL_IB_HCA=mlx5_0\0NCCL_IB_HCA=mlx5_1\0NCCL_DEBUG=INFO\0"
           b"NCCL_NET\0NCCL_NET_GDR_LEVEL=\xff\0NCCL_P2P_DISABLE=a=b\0")
    assert parse_environ(raw) == {"NCCL_IB_HCA": "mlx5_0", "NCCL_NET_GDR_LEVEL": "\ufffd",
                                  "NCCL_P2P_DISABLE": "a=b"}
    assert parse_starttime("42 (pt (main) x) S 1 42 42 0 -1 4194560 1 0 0 0 1 1 0 0 20 0 3 0 "
                           "987654 100 10") == 987654
    assert parse_starttime("42 (short) S 1") is None


def write_processes(proc: Path) -> dict[int, dict[str, str]]:
    envs = {
        100: {"PATH": "/usr/bin", "NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"},
        200: {"NCCL_NET_GDR_LEVEL": "LOC", "NCCL_P2P_DISABLE": "1", "NCCL_NET": "socket"},
        300: {"NCCL_SOCKET_IFNAME": "bond0", "NCCL_IB_HCA": "=mlx5_0:1,mlx5_12"},
        400: {"NCCL_SOCKET_IFNAME": "ib", "NCCL_IB_HCA": "mlx5", "NCCL_IB_DISABLE": "1",
              "NCCL_ALGO": "Ring"},
        500: {"HOME": "/root"},
    }
    for pid, env in envs.items():
        st.write_process(proc, pid, env, starttime=1000 + pid)
    return envs


def test_nccl_audit(dgx: Path, proc: Path) -> None:
    envs = write_processes(proc)
    s, unreadable = run(dgx, proc, nvml=FakeNvml(pids={100, 200, 300, 400, 500, 600}))
    assert unreadable == 0  # 600 has no /proc entry: exited, counted below, not an error
    findings = {(dict(lbl)["variable"], dict(lbl)["issue"]): v
                for lbl, v in series(s, P + "nccl_env_findings").items()}
    assert findings == {**dict.fromkeys(NCCL_FINDINGS, 0),
                        ("NCCL_IB_DISABLE", "ib_disabled"): 2,
                        ("NCCL_NET_GDR_LEVEL", "gdr_disabled"): 1,
                        ("NCCL_P2P_DISABLE", "p2p_disabled"): 1,
                        ("NCCL_NET", "socket_forced"): 1,
                        ("NCCL_IB_HCA", "unknown_device"): 1}
    # Every audited variable a process sets, by class, faults included; only classes present.
    settings = {(dict(lbl)["variable"], dict(lbl)["value_class"]): v
                for lbl, v in series(s, P + "nccl_env_settings").items()}
    assert settings == {("NCCL_IB_DISABLE", "disabled"): 2, ("NCCL_NET_GDR_LEVEL", "loc"): 1,
                        ("NCCL_P2P_DISABLE", "disabled"): 1, ("NCCL_NET", "socket"): 1,
                        ("NCCL_SOCKET_IFNAME", "non_rdma_netdev"): 1,
                        ("NCCL_SOCKET_IFNAME", "rdma_netdev"): 1,
                        ("NCCL_IB_HCA", "unknown_device"): 1,
                        ("NCCL_IB_HCA", "devices_present"): 1, ("NCCL_ALGO", "ring"): 1}
    assert value(s, P + "nccl_env_processes", result="inspected") == 5
    assert value(s, P + "nccl_env_processes", result="unreadable") == 1
    leaked = {v for env in envs.values() for v in env.values()} | {str(pid) for pid in envs}
    audit = {v for (name, lbl) in s if name.startswith(P + "nccl_") for _, v in lbl}
    # Labels come from a fixed vocabulary only (a value such as "socket" may equal a class name).
    vocabulary = {*NCCL_SETTINGS, *(c for cs in NCCL_SETTINGS.values() for c in cs),
                  *(issue for _, issue in NCCL_FINDINGS), "inspected", "unreadable"}
    assert audit and audit <= vocabulary
    assert not (leaked - vocabulary) & audit  # no values, no PIDs


def test_nccl_audit_all_zero_and_absent_without_nvml(dgx: Path, proc: Path) -> None:
    s, _ = run(dgx, proc, nvml=FakeNvml(pids=set()))
    assert set(series(s, P + "nccl_env_findings").values()) == {0}
    assert len(series(s, P + "nccl_env_findings")) == len(NCCL_FINDINGS)
    assert value(s, P + "nccl_env_processes", result="inspected") == 0
    s, _ = run(dgx, proc)  # compute_pids() None: NVML absent, no audit at all
    assert not series(s, P + "nccl_env_findings") and not series(s, P + "nccl_env_processes")
    write_processes(proc)
    s, _ = run(dgx, proc, config={"nccl_env_audit": False}, nvml=FakeNvml(pids={100}))
    assert not series(s, P + "nccl_env_processes")


def test_nccl_audit_unexpected_error_is_counted(dgx: Path, proc: Path) -> None:
    write_processes(proc)
    (proc / "100" / "environ").unlink()
    (proc / "100" / "environ").mkdir()  # EISDIR: not what /proc gives; a skipped value
    s, unreadable = run(dgx, proc, nvml=FakeNvml(pids={100, 200}))
    assert unreadable == 1
    assert value(s, P + "nccl_env_processes", result="unreadable") == 1
    assert value(s, P + "nccl_env_findings", variable="NCCL_IB_DISABLE", issue="ib_disabled") == 0


class CountingRoot(Root):
    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.environ_reads = 0

    def read_bytes(self, rel: str, offset: int, size: int) -> bytes:
        self.environ_reads += rel.endswith("/environ")
        return super().read_bytes(rel, offset, size)


def test_nccl_audit_cache(dgx: Path, proc: Path) -> None:
    st.write_process(proc, 100, {"NCCL_IB_DISABLE": "1"}, starttime=5000)
    st.write_process(proc, 200, {"NCCL_NET": "Socket"}, starttime=5001)
    fake = FakeNvml(pids={100, 200})
    c = topology(dgx, proc, nvml=fake)
    counting = CountingRoot(str(proc))
    c.ctx = dataclasses.replace(c.ctx, procfs=counting)

    def ib_disabled() -> float | None:
        s = samples_of(list(c.collect(Scrape())))
        return value(s, P + "nccl_env_findings", variable="NCCL_IB_DISABLE", issue="ib_disabled")

    assert ib_disabled() == 1 and counting.environ_reads == 2
    # The same process (same start time): its environment is not read again.
    st.write_process(proc, 100, {}, starttime=5000)
    assert ib_disabled() == 1 and counting.environ_reads == 2
    # The PID reused by a new process (another start time): read again.
    st.write_process(proc, 100, {}, starttime=9000)
    assert ib_disabled() == 0 and counting.environ_reads == 3
    # A process NVML no longer lists is forgotten.
    fake.pids = {100}
    ib_disabled()
    assert set(c._env_cache) == {100}  # type: ignore[attr-defined]
    fake.pids = set()
    ib_disabled()
    assert not c._env_cache  # type: ignore[attr-defined]


def test_nccl_audit_real_proc(dgx: Path) -> None:
    """A real child process, read through the real /proc (kernel stat and environ formats)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin"), "NCCL_IB_DISABLE": "1",
           "NCCL_SOCKET_IFNAME": "=docker0"}
    child = subprocess.Popen(["sleep", "30"], env=env)
    try:
        s, unreadable = run(dgx, Path("/proc"), nvml=FakeNvml(pids={child.pid}))
    finally:
        child.kill()
        child.wait()
    assert unreadable == 0
    assert value(s, P + "nccl_env_processes", result="inspected") == 1
    assert value(s, P + "nccl_env_findings", variable="NCCL_IB_DISABLE", issue="ib_disabled") == 1
    assert value(s, P + "nccl_env_settings", variable="NCCL_SOCKET_IFNAME",
                 value_class="non_rdma_netdev") == 1
    assert not any(dict(lbl)["variable"] == "NCCL_SOCKET_IFNAME"
                   for lbl in series(s, P + "nccl_env_findings"))


def test_nccl_audit_eacces_for_real_as_unprivileged_user() -> None:
    """An environ the exporter may not read (mode 000 here; another user's process on a host)
    gives a real EACCES: counted as unreadable, not as an error. Root is dropped for this."""
    base = Path(tempfile.mkdtemp(prefix="gpunet-topology-eacces-"))
    try:
        base.chmod(0o755)
        sysfs = st.build_dgx_h100_gpus(base)
        proc = st.build_procfs(base)
        st.write_process(proc, 100, {"NCCL_IB_DISABLE": "1"})
        st.write_process(proc, 200, {"NCCL_NET": "Socket"})
        (proc / "100" / "environ").chmod(0o000)
        code = (
            "import os, sys\n"
            "sys.path.insert(0, sys.argv[3])\n"
            "from support.metrics import make_collector, samples_of, value\n"
            "from gpunet_exporter.collector import Scrape\n"
            "from gpunet_exporter.collectors.topology import TopologyCollector\n"
            "if os.geteuid() == 0:  # imports done: root's pyenv is not readable for nobody\n"
            "    os.setgid(65534); os.setuid(65534)\n"
            "class Nvml:\n"
            "    def gpus(self): return None\n"
            "    def compute_pids(self): return {100, 200}\n"
            "c = make_collector(TopologyCollector, sys.argv[1], procfs=sys.argv[2])\n"
            "c.nvml = Nvml()\n"
            "s = samples_of(list(c.collect(Scrape())))\n"
            "p = 'gpunet_topology_'\n"
            "print(c.ctx.unreadable, value(s, p + 'nccl_env_processes', result='unreadable'),\n"
            "      value(s, p + 'nccl_env_processes', result='inspected'),\n"
            "      value(s, p + 'nccl_env_findings', variable='NCCL_NET', issue='socket_forced'),\n"
            "      value(s, p + 'nccl_env_findings', variable='NCCL_IB_DISABLE',\n"
            "            issue='ib_disabled'), int(c.unknown() == {'nccl_env': "
            "'privilege_missing'}))\n")
        res = subprocess.run([sys.executable, "-c", code, str(sysfs), str(proc),
                              str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        assert [float(v) for v in res.stdout.split()] == [0, 1, 1, 1, 0, 1]
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---- end to end ---------------------------------------------------------------------------------


def test_end_to_end(tmp_path: Path, run_exporter) -> None:  # type: ignore[no-untyped-def]
    sysfs = st.build_dgx_h100_gpus(tmp_path)
    st.make_acs_enabled(sysfs, gpu_bus=0xC3)  # GPU5's downstream port
    proc = st.build_procfs(tmp_path)
    exporter = run_exporter(
        f"--path.sysfs={sysfs}", f"--path.procfs={proc}", "--collector.disable-defaults",
        "--collector.topology", "--collector.topology.device-exclude=^mlx5_9$",
        "--nvml.module=gpunet_tests_no_such_nvml")  # no NVML: GPUs from sysfs
    s = parse(exporter.metrics())
    assert value(s, "gpunet_scrape_collector_success", collector="topology") == 1
    assert value(s, "gpunet_scrape_collector_unreadable_values", collector="topology") == 0
    assert paths(s) == dgx_expected_paths(d for d in DGX_DEVICES if d != "mlx5_9")
    assert nearest(s) == {str(g): (f"mlx5_{g}", "PIX") for g in range(8)}
    assert acs(s)[("5", "mlx5_5")] == 1 and sum(acs(s).values()) == 9
    assert value(s, P + "gdr_ready") == 1
    assert value(s, P + "gdr_dmabuf_capable") == 1
    assert value(s, P + "nvidia_kernel_module_info", flavor="open", version="580.159.04") == 1
    assert not series(s, P + "nccl_env_processes")  # no NVML, no compute processes


def test_placement_cache_follows_hot_plug(dgx: Path, proc: Path) -> None:
    """Placement is cached between scrapes by the symlinks that decide it: a device that comes
    back elsewhere (here: mlx5_0's and mlx5_4's class links swapped) is placed anew, and a GPU
    that appears among the PCI functions is found."""
    c = topology(dgx, proc)
    try:
        s = samples_of(list(c.collect(Scrape())))
        assert paths(s)[("0", "mlx5_0")] == "PIX" and paths(s)[("0", "mlx5_4")] == "SYS"
        cls = dgx / "class" / "infiniband"
        a, b = os.readlink(cls / "mlx5_0"), os.readlink(cls / "mlx5_4")
        for name, target in (("mlx5_0", b), ("mlx5_4", a)):
            (cls / name).unlink()
            (cls / name).symlink_to(target)
        s = samples_of(list(c.collect(Scrape())))
        assert paths(s)[("0", "mlx5_0")] == "SYS" and paths(s)[("0", "mlx5_4")] == "PIX"
        gpu0 = dgx / "bus" / "pci" / "devices" / "0000:1b:00.0"
        target = os.readlink(gpu0)
        gpu0.unlink()  # GPU 0 gone: the others are renumbered, as NVML would
        s = samples_of(list(c.collect(Scrape())))
        assert nearest(s)["0"] == ("mlx5_1", "PIX")  # now the GPU at bus 0x43
        assert len(nearest(s)) == 7
        gpu0.symlink_to(target)  # back: under the switch of the NIC now named mlx5_4
        s = samples_of(list(c.collect(Scrape())))
        assert nearest(s)["0"] == ("mlx5_4", "PIX") and len(nearest(s)) == 8
    finally:
        c.close()


# ---- the probe's HCA pinning (gpunet_exporter.probe.placement)  ----------------------------------


def test_probe_pins_each_gpu_to_the_nearest_active_port(dgx: Path) -> None:
    """The net scope pins each rank to the ACTIVE RDMA port nearest its GPU: the same device
    the topology collector names, a PIX pair on a DGX H100, eight GPUs on eight HCAs."""
    from gpunet_exporter.probe import placement

    s, _ = run(dgx)
    named = nearest(s)
    root = Root(str(dgx))
    pinned = {}
    for i, bus in enumerate(st.DGX_GPU_BUSES):
        port = placement.nearest_port(root, f"0000:{bus:02x}:00.0")
        assert port is not None
        pinned[str(i)] = port
        assert (port.device, port.path) == named[str(i)]
        assert port.nccl_ib_hca == f"={port.device}:{port.port}"
    assert len({p.device for p in pinned.values()}) == 8
    assert placement.port_rate(root, pinned["0"].device, "1") == 400 * 125_000_000
    # A port that goes down is skipped: that GPU falls back to the next nearest ACTIVE one.
    state = dgx / "class" / "infiniband" / pinned["0"].device / "ports" / "1" / "state"
    state.write_text("1: DOWN\n")
    moved = placement.nearest_port(root, f"0000:{st.DGX_GPU_BUSES[0]:02x}:00.0")
    assert moved is not None and moved.device != pinned["0"].device
    assert moved.path in ("NODE", "PHB", "PXB")
    # No RDMA port at all: nothing to pin (NCCL finds no IB device and falls back).
    assert placement.nearest_port(Root(str(dgx.parent / "nowhere")), "0000:1b:00.0") is None


def test_probe_pins_data_planes_and_leaves_efa_to_its_plugin(tmp_path: Path) -> None:
    """On a multi-plane ConnectX-8 the probe pins a data port (never a plane that carries no
    data, even one ACTIVE); on an EFA node it pins nothing: NCCL reaches EFA through the
    aws-ofi-nccl plugin, which ignores NCCL_IB_HCA and places the ranks itself."""
    from gpunet_exporter.probe import placement

    cx8 = st.build_cx8_multiplane(tmp_path / "cx8")
    root = Root(str(cx8))
    # a plane that carries no data, ACTIVE: still not pinnable
    (cx8 / "class/infiniband/roce_r0/ports/1/state").write_text("4: ACTIVE\n")
    pins = placement.pinnable_ports(root)
    assert pins == [(d, str(p)) for d in ("roce_r0", "roce_r1") for p in st.CX8_DATA_PORTS]
    port = placement.nearest_port(root, "0000:1a:00.0")
    assert port is not None and (port.device, port.port) == ("roce_r0", "3")
    assert port.nccl_ib_hca == "=roce_r0:3"
    efa = st.build_efa(tmp_path / "efa")
    assert placement.pinnable_ports(Root(str(efa))) == []
    assert placement.nearest_port(Root(str(efa)), "0000:4f:00.0") is None


# ---- NIC PCIe links and rail NICs (issue 16) --------------------------------------------------


def nic_link(s: Samples, device: str) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for metric in ("speed_transfers_per_second", "width_lanes", "max_speed_transfers_per_second",
                   "max_width_lanes"):
        for end in ("device", "upstream"):
            out[f"{end}_{metric}"] = value(s, P + f"nic_pcie_link_{metric}", device=device,
                                           end=end)
    return out


def test_nic_pcie_link_healthy(dgx: Path) -> None:
    s, unreadable = run(dgx)
    assert unreadable == 0
    assert series(s, P + "nic_pcie_link_degraded") == {
        frozenset({("device", d)}): 0 for d in DGX_DEVICES}
    assert set(nic_link(s, "mlx5_0").values()) == {32e9, 16}
    # mlx5_0 (18:00.0) sits below its switch's downstream port 17:...; mlx5_8 on a root port.
    info = {dict(lbl)["device"]: dict(lbl) for lbl in series(s, P + "nic_pcie_info")}
    assert info["mlx5_0"]["pci_address"] == "0000:18:00.0"
    upstream = st.pci_function_dir(dgx, "0000:18:00.0").parent.name
    assert info["mlx5_0"]["upstream_pci_address"] == upstream
    assert info["mlx5_8"] == {"device": "mlx5_8", "pci_address": "0000:29:00.0",
                              "upstream_pci_address": "0000:28:01.0"}


def test_nic_pcie_link_trained_down(dgx: Path) -> None:
    st.make_nic_pcie_downtrained(dgx, "mlx5_7", 8)
    s, _ = run(dgx)
    assert value(s, P + "nic_pcie_link_degraded", device="mlx5_7") == 1
    assert value(s, P + "nic_pcie_link_width_lanes", device="mlx5_7", end="device") == 8
    assert value(s, P + "nic_pcie_link_max_width_lanes", device="mlx5_7", end="device") == 16
    assert value(s, P + "nic_pcie_link_degraded", device="mlx5_6") == 0


def test_nic_pcie_link_speed_trained_down(dgx: Path) -> None:
    nic = st.pci_function_dir(dgx, "0000:40:00.0")  # mlx5_1
    (nic / "current_link_speed").write_text("16.0 GT/s PCIe\n")
    s, _ = run(dgx)
    assert value(s, P + "nic_pcie_link_speed_transfers_per_second", device="mlx5_1",
                 end="device") == 16e9
    assert value(s, P + "nic_pcie_link_degraded", device="mlx5_1") == 1


def test_nic_in_narrow_slot_is_not_degraded(dgx: Path) -> None:
    """The slot's own maximum is the limit: a x16 NIC at x8 in a x8 slot is as good as it gets."""
    st.make_nic_slot_narrow(dgx, "mlx5_7", 8)
    s, _ = run(dgx)
    assert value(s, P + "nic_pcie_link_max_width_lanes", device="mlx5_7", end="upstream") == 8
    assert value(s, P + "nic_pcie_link_degraded", device="mlx5_7") == 0


@pytest.mark.parametrize("change", [
    {"max_link_width": None},  # an old kernel or a bridge without the attribute
    {"current_link_speed": "Unknown\n"},
    {"power_state": "D3hot\n"},  # not in D0: its link may be down or retrained
])
def test_nic_pcie_link_unknown_is_absent(dgx: Path, change: dict[str, str | None]) -> None:
    nic = st.pci_function_dir(dgx, "0000:40:00.0")  # mlx5_1
    st.make_nic_pcie_downtrained(dgx, "mlx5_1", 4)
    for name, text in change.items():
        target = nic.parent if name == "max_link_width" else nic
        if text is None:
            (target / name).unlink()
        else:
            (target / name).write_text(text)
    s, unreadable = run(dgx)
    assert unreadable == 0
    assert value(s, P + "nic_pcie_link_degraded", device="mlx5_1") is None
    assert value(s, P + "nic_pcie_link_degraded", device="mlx5_0") == 0


def test_nic_on_a_host_bridge_has_no_verdict(tmp_path: Path) -> None:
    """build_dgx_h100 (no GPUs): NICs below root port directories without attributes, like a VM
    whose virtual root port shows none; the NIC's own values are still exported."""
    sysfs = st.build_dgx_h100(tmp_path)
    (sysfs / "class/infiniband/mlx5_0/device/current_link_width").write_text("8\n")
    s, unreadable = run(sysfs)
    assert unreadable == 0
    assert series(s, P + "nic_pcie_link_degraded") == {}
    assert value(s, P + "nic_pcie_link_width_lanes", device="mlx5_0", end="device") == 8


def test_parse_link_attributes() -> None:
    from gpunet_exporter.sources.pcie import link_degraded, parse_link_speed, parse_link_width
    assert parse_link_speed("32.0 GT/s PCIe") == 32e9
    assert parse_link_speed("2.5 GT/s PCIe") == 2.5e9
    assert parse_link_speed("8 GT/s") == 8e9  # kernels before 5.3
    assert parse_link_speed("Unknown") is None
    assert parse_link_speed("") is None
    assert parse_link_width("16") == 16 and parse_link_width("0") is None
    assert parse_link_width("x16") is None
    assert not link_degraded(32e9, 8, 32e9, 16, 32e9, 8)  # narrow slot
    assert link_degraded(32e9, 8, 32e9, 16, 32e9, 16)
    assert not link_degraded(16e9, 16, 32e9, 16, 16e9, 16)  # Gen4 switch port
    assert link_degraded(16e9, 16, 32e9, 16, 32e9, 16)


def rail(s: Samples) -> dict[str, tuple[str, str]]:
    out = {}
    for lbl in series(s, P + "gpu_nearest_rail_nic"):
        d = dict(lbl)
        assert d["gpu"] not in out, "one nearest rail per GPU"
        out[d["gpu"]] = (d["device"], d["path"])
    return out


def test_rail_nic_on_the_other_socket(tmp_path: Path) -> None:
    """A storage port on GPU0's NUMA node is its nearest RDMA device, but its rail NIC is across
    the sockets: with the storage port named, the mismatch shows."""
    sysfs = st.build_rail_wrong_side(tmp_path)
    s, unreadable = run(sysfs)
    assert unreadable == 0
    assert nearest(s)["0"] == ("mlx5_2", "NODE")
    assert rail(s)["0"] == ("mlx5_2", "NODE")  # every device is a rail by default
    assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="0") == 0
    for config in ({"rail_exclude": "^mlx5_2$"}, {"rail_devices": "^mlx5_[01]$"}):
        s, _ = run(sysfs, config=config)
        assert nearest(s)["0"] == ("mlx5_2", "NODE")  # unchanged: all devices
        assert rail(s) == {"0": ("mlx5_1", "SYS"), "1": ("mlx5_0", "PIX")}
        assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="0") == 1
        assert value(s, P + "gpu_nearest_nic_numa_mismatch", gpu="1") == 0


def test_rail_dgx_healthy(dgx: Path) -> None:
    s, _ = run(dgx, config={"rail_exclude": "^mlx5_[89]$"})
    assert rail(s) == {str(g): (f"mlx5_{g}", "PIX") for g in range(8)}
    assert set(series(s, P + "gpu_nearest_nic_numa_mismatch").values()) == {0}


def rail_gpus(s: Samples) -> dict[str, float]:
    return {dict(lbl)["device"]: v for lbl, v in series(s, P + "rail_nic_gpus").items()}


def test_rail_map_one_gpu_per_rail(dgx: Path) -> None:
    s, _ = run(dgx, config={"rail_exclude": "^mlx5_[89]$"})
    assert rail_gpus(s) == {f"mlx5_{i}": 1 for i in range(8)}


def test_rail_nic_in_the_wrong_slot(tmp_path: Path) -> None:
    """GPU 0's rail NIC on a socket-1 root port (build_rail_misplaced): GPU 0 takes mlx5_1,
    GPU 1's rail, on its own NUMA node (no NUMA finding), and mlx5_0 serves no GPU. With the
    storage NICs left in the rails (the default), GPU 0 takes the RoCE mlx5_8 instead."""
    sysfs = st.build_rail_misplaced(tmp_path)
    s, unreadable = run(sysfs, config={"rail_exclude": "^mlx5_[89]$"})
    assert unreadable == 0
    assert rail(s)["0"] == ("mlx5_1", "NODE") and rail(s)["1"] == ("mlx5_1", "PIX")
    assert rail_gpus(s) == {"mlx5_0": 0, "mlx5_1": 2, **{f"mlx5_{i}": 1 for i in range(2, 8)}}
    assert set(series(s, P + "gpu_nearest_nic_numa_mismatch").values()) == {0}
    s, _ = run(sysfs)
    assert rail(s)["0"] == ("mlx5_8", "NODE")
    assert rail_gpus(s)["mlx5_8"] == 1 and max(rail_gpus(s).values()) == 1


def test_no_rail_no_mismatch(dgx: Path) -> None:
    s, _ = run(dgx, config={"rail_devices": "^nothing$"})
    assert rail(s) == {}
    assert series(s, P + "gpu_nearest_nic_numa_mismatch") == {}
    assert len(nearest(s)) == 8
