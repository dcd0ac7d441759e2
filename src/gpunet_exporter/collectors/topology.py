"""topology collector: where each GPU sits relative to each RDMA NIC on the PCIe tree, whether
GPUDirect RDMA can work on this host, whether PCIe ACS forces GPU-NIC traffic through the root
complex, the NICs' PCIe links, and which NCCL variables of the GPU processes turn fast paths off.

Reads sysfs PCI paths and numa_node files, the peer-memory and NVIDIA driver files (docs/formats.md
§5.3), bridges' ACS Control registers (root only), and /proc/<pid>/environ of NVML's compute
processes; GPUs from the shared NVML session, else from sysfs.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.collector import (
    Collector,
    CollectorContext,
    Families,
    MetricSpec,
    Privilege,
    Scrape,
)
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.nccl.env import NCCL_FAULT_CLASSES, NCCL_FINDINGS, env_settings, parse_environ
from gpunet_exporter.sources import nvml, rdma
from gpunet_exporter.sources.pcie import (
    ACS_REDIRECT_BITS,
    PATHS,
    RANK,
    Endpoint,
    NvidiaGpus,
    acs_control,
    endpoint,
    link_degraded,
    parse_link_speed,
    parse_link_width,
    relation,
    resolve,
)
from gpunet_exporter.sources.proc import parse_kernel_release, parse_nvidia_version, parse_starttime
from gpunet_exporter.sources.sysfs import parse_int

# GPUDirect RDMA peer-memory clients, by module name: the files NCCL's ncclIbGdrSupport checks.
PEERMEM_FILES = (
    ("nvidia_peermem", "module/nvidia_peermem/version"),
    ("nv_peer_mem", "kernel/mm/memory_peers/nv_mem/version"),
    ("nv_peer_mem_nc", "kernel/mm/memory_peers/nv_mem_nc/version"),
    ("nvidia-peermem", "kernel/mm/memory_peers/nvidia-peermem/version"),
)
DMABUF_MIN_KERNEL = (5, 12)
_LABEL_MAX = 32

# Errors that mean "not ours to read" or "already gone": expected, not a fault of the exporter.
_PROC_EXPECTED = (errno.EACCES, errno.EPERM, errno.ENOENT, errno.ESRCH)
ENVIRON_MAX = 1 << 20  # bytes of /proc/<pid>/environ read at most
ENV_CACHE_MAX = 4096  # processes whose NCCL variables are remembered

_G = ("gpu",)
_GD = ("gpu", "device")
_GDP = ("gpu", "device", "path")
_PCI_SOURCE = ("realpath of /sys/bus/pci/devices/<gpu> and /sys/class/infiniband/<device>/device, "
               "their numa_node files")
PEERMEM_LOADED = MetricSpec(
    "gpunet_topology_gdr_peermem_loaded", "gauge",
    "1 when a GPUDirect RDMA peer-memory client (nvidia_peermem, nv_peer_mem) is loaded, else 0",
    (), "boolean",
    "/sys/module/nvidia_peermem/version, /sys/kernel/mm/memory_peers/{nv_mem,nv_mem_nc,"
    "nvidia-peermem}/version")
PEERMEM_INFO = MetricSpec(
    "gpunet_topology_gdr_peermem_info", "gauge",
    "Always 1, for each peer-memory client present, with its version",
    ("module", "version"), "", "the peer-memory version files")
KERNEL_MODULE_INFO = MetricSpec(
    "gpunet_topology_nvidia_kernel_module_info", "gauge",
    "Always 1 while the NVIDIA kernel module is loaded: its flavor and version",
    ("flavor", "version"), "", "/proc/driver/nvidia/version")
DMABUF_CAPABLE = MetricSpec(
    "gpunet_topology_gdr_dmabuf_capable", "gauge",
    "1 when GPUDirect RDMA can use DMA-BUF instead of a peer-memory module, else 0", (),
    "boolean",
    "/proc/driver/nvidia/version and /proc/sys/kernel/osrelease")
GDR_READY = MetricSpec(
    "gpunet_topology_gdr_ready", "gauge",
    "1 when the host side of GPUDirect RDMA is in place (peer memory or DMA-BUF), else 0", (),
    "boolean",
    "peer-memory version files, /proc/driver/nvidia/version, /proc/sys/kernel/osrelease")
GDR_PATHS = ("dmabuf", "peermem", "none")
GDR_PATH = MetricSpec(
    "gpunet_topology_gdr_path", "gauge",
    "1 for the way GPUDirect RDMA takes on this host (DMA-BUF first, as NCCL), 0 for the others",
    ("path",), "boolean",
    "peer-memory version files, /proc/driver/nvidia/version, /proc/sys/kernel/osrelease")
GPU_NIC_PATH = MetricSpec(
    "gpunet_topology_gpu_nic_path", "gauge",
    "Always 1: the PCIe path between the GPU and the RDMA device, in nvidia-smi topo's terms",
    _GDP, "", _PCI_SOURCE)
NEAREST_NIC = MetricSpec(
    "gpunet_topology_gpu_nearest_nic", "gauge",
    "Always 1, for the RDMA device nearest the GPU", _GDP, "", _PCI_SOURCE)
NUMA_MISMATCH = MetricSpec(
    "gpunet_topology_gpu_nearest_nic_numa_mismatch", "gauge",
    "1 when the GPU's nearest rail RDMA device is on another NUMA node, else 0", _G, "boolean",
    "numa_node of the GPU and of the device")
ACS_REDIRECT = MetricSpec(
    "gpunet_topology_gpu_nic_acs_redirect_bridges", "gauge",
    "PCI bridges between the GPU and the RDMA device whose ACS redirects P2P traffic",
    _GD, "bridges", "/sys/bus/pci/devices/<bridge>/config, ACS Control register")
NCCL_ENV_FINDINGS = MetricSpec(
    "gpunet_topology_nccl_env_findings", "gauge",
    "GPU compute processes whose environment sets the NCCL variable to take a fast path away",
    ("variable", "issue"), "processes", "/proc/<pid>/environ of NVML's compute processes")
NCCL_ENV_SETTINGS = MetricSpec(
    "gpunet_topology_nccl_env_settings", "gauge",
    "GPU compute processes whose initial environment sets the NCCL variable, by class of value",
    ("variable", "value_class"), "processes", "/proc/<pid>/environ of NVML's compute processes")
NCCL_ENV_PROCESSES = MetricSpec(
    "gpunet_topology_nccl_env_processes", "gauge",
    "GPU compute processes whose environment was inspected or could not be read", ("result",),
    "processes",
    "NVML compute processes, /proc/<pid>/environ")

# -- PCIe link of each RDMA device's PCI function (issue 16) ---------------------------------------
_LINK_SOURCE = ("{current,max}_link_{speed,width} of /sys/class/infiniband/<device>/device and "
                "of the bridge above it")
NIC_PCIE_INFO = MetricSpec(
    "gpunet_topology_nic_pcie_info", "gauge",
    "Always 1, for each RDMA device with a PCI function: its address and the bridge port above",
    ("device", "pci_address", "upstream_pci_address"), "",
    "realpath of /sys/class/infiniband/<device>/device")
NIC_PCIE_SPEED = MetricSpec(
    "gpunet_topology_nic_pcie_link_speed_transfers_per_second", "gauge",
    "Current PCIe link speed at this end of the RDMA device's link (32e9 is Gen5)",
    ("device", "end"), "transfers per second", _LINK_SOURCE)
NIC_PCIE_WIDTH = MetricSpec(
    "gpunet_topology_nic_pcie_link_width_lanes", "gauge",
    "Current PCIe link width at this end of the RDMA device's link",
    ("device", "end"), "lanes", _LINK_SOURCE)
NIC_PCIE_MAX_SPEED = MetricSpec(
    "gpunet_topology_nic_pcie_link_max_speed_transfers_per_second", "gauge",
    "Highest PCIe link speed the end supports (Link Capabilities)",
    ("device", "end"), "transfers per second", _LINK_SOURCE)
NIC_PCIE_MAX_WIDTH = MetricSpec(
    "gpunet_topology_nic_pcie_link_max_width_lanes", "gauge",
    "Widest PCIe link the end supports (Link Capabilities)",
    ("device", "end"), "lanes", _LINK_SOURCE)
NIC_PCIE_DEGRADED = MetricSpec(
    "gpunet_topology_nic_pcie_link_degraded", "gauge",
    "1 when the RDMA device's PCIe link runs slower or narrower than both its ends allow, else 0",
    ("device",), "boolean", _LINK_SOURCE + ", power_state")
NEAREST_RAIL_NIC = MetricSpec(
    "gpunet_topology_gpu_nearest_rail_nic", "gauge",
    "Always 1, for the rail RDMA device nearest the GPU (the one NCCL would use for it)", _GDP,
    "", _PCI_SOURCE)
RAIL_GPUS = MetricSpec(
    "gpunet_topology_rail_nic_gpus", "gauge",
    "GPUs whose nearest rail RDMA device, the one NCCL would give them, this is",
    ("device",), "GPUs", _PCI_SOURCE)
_LINK_FILES = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
@dataclass(frozen=True)
class TopologySettings(Settings):
    device_include: re.Pattern[str] | None = setting("only RDMA devices whose name matches are "
                                                     "covered by the GPU-NIC series")
    device_exclude: re.Pattern[str] | None = setting("RDMA devices whose name matches are not "
                                                     "covered by the GPU-NIC series")
    nccl_env_audit: bool = setting(
        "read the environment of GPU compute processes for NCCL settings, and those that turn "
        "off InfiniBand, GPUDirect RDMA or P2P (other users' processes need CAP_SYS_PTRACE and "
        "CAP_DAC_READ_SEARCH; without them the check is unknown while they run)", default=True)
    acs_audit: bool = setting(
        "read the ACS Control register of the PCIe bridges between GPUs and RDMA devices "
        "(needs CAP_SYS_ADMIN; without it the check is unknown); false where ACS is checked "
        "another way", default=True)
    rail_devices: re.Pattern[str] | None = setting(
        "RDMA devices that are compute rails, the NICs NCCL uses for GPU traffic (unset: every "
        "device the collector covers); the NUMA mismatch is judged against each GPU's nearest "
        "rail")
    rail_exclude: re.Pattern[str] | None = setting(
        "RDMA devices that are not rails even when `rail_devices` matches, e.g. storage or "
        "front-end ports")


class TopologyCollector(Collector):
    name = "topology"
    description = ("GPU-NIC PCIe distances, GPUDirect RDMA readiness, ACS redirect on the path, "
                   "NCCL environment audit of GPU processes")
    metrics = (PEERMEM_LOADED, PEERMEM_INFO, KERNEL_MODULE_INFO, DMABUF_CAPABLE, GDR_READY,
               GDR_PATH, GPU_NIC_PATH, NEAREST_NIC, NUMA_MISMATCH, ACS_REDIRECT, NCCL_ENV_FINDINGS,
               NCCL_ENV_SETTINGS, NCCL_ENV_PROCESSES, NIC_PCIE_INFO, NIC_PCIE_SPEED,
               NIC_PCIE_WIDTH, NIC_PCIE_MAX_SPEED, NIC_PCIE_MAX_WIDTH, NIC_PCIE_DEGRADED,
               NEAREST_RAIL_NIC, RAIL_GPUS)
    settings_type = TopologySettings
    settings: TopologySettings
    flags: ClassVar[Mapping[str, tuple[str, str]]] = {
        "device-include": ("device_include", "regexp of RDMA devices to include"),
        "device-exclude": ("device_exclude", "regexp of RDMA devices to exclude"),
    }
    # The kernel shows a config file beyond its first 64 bytes only to CAP_SYS_ADMIN
    # (drivers/pci/pci-sysfs.c, pci_read_config); /proc/PID/environ of another user's process is
    # mode 0400 (CAP_DAC_READ_SEARCH) and opening it needs ptrace read access (CAP_SYS_PTRACE).
    privileges = (
        Privilege("ACS redirect of PCIe bridges", ("CAP_SYS_ADMIN",), option="acs_audit"),
        Privilege("NCCL environment audit of other users' GPU processes",
                  ("CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"), option="nccl_env_audit"),
    )

    unknown_checks: ClassVar[Mapping[str, str]] = {
        "acs": "whether ACS on the PCIe bridges between GPUs and RDMA devices redirects their "
               "peer-to-peer traffic (`gpunet_topology_gpu_nic_acs_redirect_bridges`): reading "
               "the ACS Control register needs CAP_SYS_ADMIN",
        "nccl_env": "the NCCL settings of other users' GPU processes "
                    "(`gpunet_topology_nccl_env_findings`): reading their /proc/PID/environ "
                    "needs CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH"}

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self.nvml = nvml.session(ctx.nvml_module)
        self._unknown: dict[str, str] = {}
        self._denied = 0  # processes whose environment this scrape was refused
        # pid -> (starttime, the process's NCCL variables); only processes NVML still lists.
        self._env_cache: dict[int, tuple[int, dict[str, str]]] = {}
        # Endpoints of the last scrape by (label, path, symlink targets): resolving a path
        # costs an lstat per component, reading its links two readlinks. PCIe placement only
        # changes with hot-plug, which changes the links.
        self._endpoints: dict[tuple[str, ...], Endpoint | None] = {}
        self._endpoints_now: dict[tuple[str, ...], Endpoint | None] = {}
        # The NVIDIA GPUs among the PCI functions, while the list of functions stays the same.
        self._sysfs_gpus = NvidiaGpus(ctx.sysfs)

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        fams = Families()
        self._endpoints_now = {}
        gpus = self._gpus()
        self._gdr(fams, bool(gpus))
        nics = self._nics(scrape)
        self._endpoints = self._endpoints_now  # only what this scrape saw stays cached
        self._unknown = {}
        self._pairs(fams, gpus, nics)
        self._nic_links(fams, nics)
        if self.settings.nccl_env_audit:
            self._denied = 0
            self._nccl_audit(fams, scrape)
            if self._denied:
                self._unknown["nccl_env"] = "privilege_missing"
        return iter(fams)

    def unknown(self) -> Mapping[str, str]:
        """``acs`` (``privilege_missing``) while a bridge between a GPU and an RDMA device shows
        only the first 64 bytes of its config space, as the kernel does without CAP_SYS_ADMIN;
        ``nccl_env`` while a GPU process's environment is refused (another user's, without
        CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH). Neither while its audit is switched off
        (``acs_audit``, ``nccl_env_audit``), nor on a node without such a bridge or process."""
        return self._unknown

    # -- PCIe placement --------------------------------------------------------------------

    def _numa(self, device_dir: str) -> int:
        rel = f"{device_dir}/numa_node"
        try:
            text = self.ctx.sysfs.read(rel)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # kernels without CONFIG_NUMA have no such file
                self.ctx.skip(rel, exc.strerror or exc)
            return -1
        value = parse_int(text)
        if value is None:
            self.ctx.skip(rel, f"unparseable {text[:20]!r}")
            return -1
        return value

    def _links(self, rel: str) -> tuple[str, ...] | None:
        """The symlink targets that decide where ``rel`` resolves (its own and its parent's:
        class/infiniband/<dev> and .../device are both links); None when it is gone."""
        out = []
        for path in (rel, os.path.dirname(rel)):
            try:
                out.append(os.readlink(self.ctx.sysfs.path(path)))
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: not a link
                    return None
                out.append("")
        return tuple(out)

    def _pci_endpoint(self, name: str, rel: str) -> Endpoint | None:
        links = self._links(rel)
        if links is None:
            return None
        key = (name, rel, *links)
        if key in self._endpoints:
            ep = self._endpoints_now[key] = self._endpoints[key]
            return ep
        real = resolve(self.ctx.sysfs, rel)
        if real is None:
            return None
        ep = endpoint(name, real, -1)
        if ep is not None:
            ep = replace(ep, numa=self._numa(real))
        self._endpoints_now[key] = ep
        return ep

    def _gpus(self) -> list[Endpoint]:
        """GPUs labelled with NVML's index: from NVML when it is up, else the NVIDIA display and
        3D controllers in sysfs, numbered in PCI address order (which is NVML's order)."""
        listed = self.nvml.gpus()
        if listed is not None:
            pairs = [(str(g.index), g.pci_bus_id) for g in listed if g.pci_bus_id]
        else:
            pairs = [(str(i), address) for i, address in enumerate(self._sysfs_gpus())]
        out = []
        for label, address in pairs:
            ep = self._pci_endpoint(label, f"bus/pci/devices/{address}")
            if ep is None:
                self.ctx.skip(f"bus/pci/devices/{address}", "GPU without a PCI device in sysfs")
            else:
                out.append(ep)
        return out

    def _nics(self, scrape: Scrape) -> list[Endpoint]:
        cfg = self.settings
        out = []
        for dev in scrape.rdma(self.ctx.sysfs).devices(cfg.device_include, cfg.device_exclude):
            ep = self._pci_endpoint(dev, f"{rdma.CLASS}/{dev}/device")
            if ep is None:  # rxe/siw (no PCI parent), or gone
                self.ctx.log_once(logging.DEBUG, "RDMA device %s has no PCI function; skipped",
                                  dev)
            else:
                out.append(ep)
        return out

    def _pairs(self, fams: Families, gpus: list[Endpoint], nics: list[Endpoint]) -> None:
        acs: dict[str, bool | None] = {}  # bridge dir -> redirect, for this scrape
        rails = {nic.name for nic in nics if self._is_rail(nic.name)}
        served = dict.fromkeys(sorted(rails), 0)  # rail -> GPUs it is the nearest rail of
        for gpu in gpus:
            best: tuple[int, int, str] | None = None
            best_nic: Endpoint | None = None
            best_rail: tuple[tuple[int, int, str], Endpoint] | None = None
            for nic in nics:
                rel = relation(gpu, nic)
                fams.add(GPU_NIC_PATH, [gpu.name, nic.name, rel.path], 1)
                key = (RANK[rel.path], len(rel.bridges), nic.name)
                if best is None or key < best:
                    best, best_nic = key, nic
                if nic.name in rails and (best_rail is None or key < best_rail[0]):
                    best_rail = (key, nic)
                if not self.settings.acs_audit:
                    continue
                redirects = 0
                for bridge in rel.bridges:
                    if bridge not in acs:
                        acs[bridge] = self._acs_redirect(bridge)
                    state = acs[bridge]
                    if state is None:
                        redirects = -1
                        break
                    redirects += int(state)
                if redirects >= 0:
                    fams.add(ACS_REDIRECT, [gpu.name, nic.name], redirects)
            if best is not None and best_nic is not None:
                fams.add(NEAREST_NIC, [gpu.name, best_nic.name, PATHS[best[0]]], 1)
            if best_rail is not None:
                # The NUMA question is the rail's: a storage port on the GPU's node does not
                # hide a rail NIC across the sockets.
                (rank, _, _), rail = best_rail
                fams.add(NEAREST_RAIL_NIC, [gpu.name, rail.name, PATHS[rank]], 1)
                served[rail.name] += 1
                if gpu.numa >= 0 and rail.numa >= 0:
                    fams.add(NUMA_MISMATCH, [gpu.name], int(gpu.numa != rail.numa))
        if gpus:
            for rail_name, n in served.items():
                fams.add(RAIL_GPUS, [rail_name], n)

    def _is_rail(self, name: str) -> bool:
        cfg = self.settings
        include, exclude = cfg.rail_devices, cfg.rail_exclude
        return ((include is None or bool(include.search(name)))
                and not (exclude is not None and exclude.search(name)))

    def _link_end(self, device_dir: str) -> dict[str, float | int | None] | None:
        """The link attributes of one PCI function or bridge; None when its directory is gone."""
        try:
            attrs = self.ctx.sysfs.read_many(device_dir, (*_LINK_FILES, "power_state"))
        except OSError:
            return None
        out: dict[str, float | int | None] = {}
        for name in _LINK_FILES:
            value = attrs[name]
            if isinstance(value, OSError):
                if value.errno != errno.ENOENT:
                    self.ctx.skip(f"{device_dir}/{name}", value.strerror or value)
                out[name] = None
            else:
                out[name] = (parse_link_speed(value) if name.endswith("speed")
                             else parse_link_width(value))
        power = attrs["power_state"]
        # power_state (Linux 5.17+): a function in D3 may have its link down or retrained.
        out["d0"] = 1 if isinstance(power, OSError) or power == "D0" else 0
        return out

    def _nic_links(self, fams: Families, nics: list[Endpoint]) -> None:
        """Each RDMA device's PCIe link, both ends, and whether it trained down."""
        for nic in nics:
            upstream_dir = nic.dirs[-2] if len(nic.dirs) > 1 else ""
            fams.add(NIC_PCIE_INFO, [nic.name, nic.chain[-1],
                                     nic.chain[-2] if len(nic.chain) > 1 else ""], 1)
            dev = self._link_end(nic.dirs[-1])
            up = self._link_end(upstream_dir) if upstream_dir else None
            for end, attrs in (("device", dev), ("upstream", up)):
                if attrs is None:
                    continue
                for spec, name in ((NIC_PCIE_SPEED, "current_link_speed"),
                                   (NIC_PCIE_WIDTH, "current_link_width"),
                                   (NIC_PCIE_MAX_SPEED, "max_link_speed"),
                                   (NIC_PCIE_MAX_WIDTH, "max_link_width")):
                    value = attrs[name]
                    if value is not None:
                        fams.add(spec, [nic.name, end], value)
            if dev is None or up is None or not dev["d0"]:
                continue
            values = (dev["current_link_speed"], dev["current_link_width"],
                      dev["max_link_speed"], dev["max_link_width"],
                      up["max_link_speed"], up["max_link_width"])
            if all(v is not None for v in values):
                cs, cw, ds, dw, us, uw = (v or 0 for v in values)
                fams.add(NIC_PCIE_DEGRADED, [nic.name],
                         int(link_degraded(cs, int(cw), ds, int(dw), us, int(uw))))

    def _acs_redirect(self, bridge: str) -> bool | None:
        """Whether the bridge's ACS Control has a P2P redirect bit set (False also without an
        ACS capability); None when its extended config space cannot be read."""
        rel = f"{bridge}/config"
        try:
            control = acs_control(lambda offset, size: self.ctx.sysfs.read_bytes(rel, offset, size))
        except EOFError:
            self.ctx.log_once(logging.DEBUG, "ACS of %s unknown: config space beyond 64 bytes is "
                              "readable with CAP_SYS_ADMIN only; no ACS series for its GPU-NIC "
                              "pairs", bridge)
            self._unknown["acs"] = "privilege_missing"
            return None
        except OSError as exc:
            self.ctx.log_once(logging.DEBUG, "cannot read ACS of %s: %s; no ACS series for its "
                              "GPU-NIC pairs", bridge, exc.strerror or exc)
            return None
        return control is not None and bool(control & ACS_REDIRECT_BITS)

    # -- GPUDirect RDMA --------------------------------------------------------------------

    def _gdr(self, fams: Families, have_gpu: bool) -> None:
        root = self.ctx.sysfs
        loaded = False
        for module, rel in PEERMEM_FILES:
            if not root.exists(rel):
                continue
            loaded = True
            try:
                version = root.read(rel)
            except OSError as exc:
                self.ctx.skip(rel, exc.strerror or exc)
                continue
            fams.add(PEERMEM_INFO, [module, version[:_LABEL_MAX]], 1)
        fams.add(PEERMEM_LOADED, [], int(loaded))

        dmabuf = self._dmabuf(fams)
        if have_gpu:
            ready = True if loaded else dmabuf
            if ready is not None:
                fams.add(GDR_READY, [], int(ready))
            # NCCL takes DMA-BUF where the driver and kernel allow it (NCCL_DMABUF_ENABLE, on by
            # default), else the peer-memory module; unknown while DMA-BUF cannot be told.
            path = ("dmabuf" if dmabuf else "peermem" if loaded and dmabuf is not None
                    else "none" if dmabuf is not None else None)
            if path is not None:
                for name in GDR_PATHS:
                    fams.add(GDR_PATH, [name], int(name == path))

    def _dmabuf(self, fams: Families) -> bool | None:
        """Whether DMA-BUF GPUDirect is possible: False without the NVIDIA driver, None when it
        cannot be told."""
        proc = self.ctx.procfs
        try:
            text = proc.read("driver/nvidia/version")
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                self.ctx.skip("driver/nvidia/version", exc.strerror or exc)
                return None
            return False  # no NVIDIA driver loaded
        module = parse_nvidia_version(text)
        if module is None:
            self.ctx.skip("driver/nvidia/version", f"unparseable {text[:40]!r}")
            return None
        flavor, version = module
        fams.add(KERNEL_MODULE_INFO, [flavor, version], 1)
        try:
            release = parse_kernel_release(proc.read("sys/kernel/osrelease"))
        except OSError as exc:
            self.ctx.skip("sys/kernel/osrelease", exc.strerror or exc)
            return None
        if release is None:
            self.ctx.skip("sys/kernel/osrelease", "unparseable")
            return None
        capable = flavor == "open" and release >= DMABUF_MIN_KERNEL
        fams.add(DMABUF_CAPABLE, [], int(capable))
        return capable

    # -- NCCL environment audit ------------------------------------------------------------

    def _nccl_audit(self, fams: Families, scrape: Scrape) -> None:
        pids = self.nvml.compute_pids()
        if pids is None:
            return
        counts = dict.fromkeys(NCCL_FINDINGS, 0)
        settings: dict[tuple[str, str], int] = {}
        inspected = unreadable = 0
        netdevs: set[str] | None = None
        devices: list[str] = []
        no_data: set[tuple[str, str]] = set()
        cache: dict[int, tuple[int, dict[str, str]]] = {}
        for pid in sorted(pids):
            env = self._environment(pid, cache)
            if env is None:
                unreadable += 1
                continue
            inspected += 1
            if not env:
                continue
            if netdevs is None:  # only when some process sets an NCCL variable
                snapshot = scrape.rdma(self.ctx.sysfs)
                netdevs = {p.netdev for p in snapshot.ports() if p.netdev}
                devices = snapshot.devices()
                no_data = {(p.device, p.port) for p in snapshot.ports() if not p.data}
            for variable, cls in env_settings(env, netdevs, devices, no_data).items():
                settings[(variable, cls)] = settings.get((variable, cls), 0) + 1
                issue = NCCL_FAULT_CLASSES.get((variable, cls))
                if issue is not None:
                    counts[(variable, issue)] += 1
        self._env_cache = cache
        for (variable, issue), n in counts.items():
            fams.add(NCCL_ENV_FINDINGS, [variable, issue], n)
        for (variable, cls), n in sorted(settings.items()):
            fams.add(NCCL_ENV_SETTINGS, [variable, cls], n)
        fams.add(NCCL_ENV_PROCESSES, ["inspected"], inspected)
        fams.add(NCCL_ENV_PROCESSES, ["unreadable"], unreadable)

    def _environment(self, pid: int,
                     cache: dict[int, tuple[int, dict[str, str]]]) -> dict[str, str] | None:
        """A process's NCCL variables, from the cache while its start time is unchanged (a
        reused PID has another); None when it cannot be read."""
        proc = self.ctx.procfs
        rel = f"{pid}/stat"
        try:
            stat = proc.read(rel)
            start = parse_starttime(stat)
            if start is None:
                self.ctx.skip(rel, "no start time")
                return None
            cached = self._env_cache.get(pid)
            if cached is not None and cached[0] == start:
                env = cached[1]
            else:
                rel = f"{pid}/environ"
                env = parse_environ(proc.read_bytes(rel, 0, ENVIRON_MAX))
        except OSError as exc:
            if exc.errno not in _PROC_EXPECTED:
                self.ctx.skip(rel, exc.strerror or exc)
            elif exc.errno in (errno.EACCES, errno.EPERM):
                self._denied += 1
            return None
        if len(cache) < ENV_CACHE_MAX:
            cache[pid] = (start, env)
        return env
