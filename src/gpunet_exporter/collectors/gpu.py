"""gpu collector: NVML utilization, memory, PCIe link and errors, NVLink, compute processes, XID
errors, and lost GPUs.

Reads NVML through the process-wide session of sources/nvml.py (shared with topology): cheap
reads every scrape, firmware round trips (PCIe and NVLink counters, PCIe throughput) in a
background.Refresher, XID errors from an NVML event thread. Calls and errors: docs/formats.md §6;
design notes: docs/architecture.md, "collectors"; real-GPU runs: docs/gpu.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.background import Fresh, Refresher, add_freshness, last_success_spec
from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec, Scrape
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.sources import nvml
from gpunet_exporter.sources.nvml import Gpu, Session, error_name
from gpunet_exporter.sources.pcie import NvidiaGpus

_G = ("gpu",)
_NVML = "NVML"
UNSUPPORTED = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound",
               "NVMLError_ArgumentVersionMismatch")
XID_WAIT_MS = 500
XID_LABELS_PER_GPU = 64  # XID codes are a small enumeration; anything beyond this is "other"

INFO = MetricSpec(
    "gpunet_gpu_info", "gauge",
    "Always 1: the static attributes of the GPU (gpu is its NVML index)",
    ("gpu", "uuid", "name", "pci_address", "driver_version", "numa_node"), "",
    "nvmlDeviceGetUUID, GetName, GetPciInfo, GetNumaNodeId (or sysfs numa_node), "
    "nvmlSystemGetDriverVersion")
NVML_UP = MetricSpec(
    "gpunet_gpu_nvml_up", "gauge",
    "1 while NVML is initialised, 0 when it is failing", (), "boolean", "nvmlInit")
LOST = MetricSpec(
    "gpunet_gpu_lost", "gauge",
    "1 when NVML answers GpuIsLost for the GPU (fallen off the bus, needs a reset), else 0",
    _G, "boolean", "NVML_ERROR_GPU_IS_LOST")
MISSING = MetricSpec(
    "gpunet_gpu_missing", "gauge",
    "GPUs NVML enumerated earlier in this exporter's life (by UUID) that it no longer "
    "enumerates", (), "GPUs", "nvmlDeviceGetCount and nvmlDeviceGetUUID")
UTIL = MetricSpec(
    "gpunet_gpu_utilization_ratio", "gauge",
    "Fraction of the last sample period (1/6 s to 1 s) during which a kernel ran (0 to 1)", _G,
    "ratio", "nvmlDeviceGetUtilizationRates .gpu / 100")
MEM_UTIL = MetricSpec(
    "gpunet_gpu_memory_utilization_ratio", "gauge",
    "Fraction of the last sample period during which device memory was read or written (0 to 1)",
    _G, "ratio", "nvmlDeviceGetUtilizationRates .memory / 100")
MEM_USED = MetricSpec(
    "gpunet_gpu_memory_used_bytes",
    "gauge", "Device memory allocated, as nvidia-smi shows it", _G, "bytes",
    "nvmlDeviceGetMemoryInfo_v2 .used (v1 .used on old drivers)")
MEM_RESERVED = MetricSpec(
    "gpunet_gpu_memory_reserved_bytes", "gauge", "Device memory the driver and firmware reserve",
    _G, "bytes", "nvmlDeviceGetMemoryInfo_v2 .reserved")
MEM_TOTAL = MetricSpec("gpunet_gpu_memory_total_bytes", "gauge", "Device memory installed", _G,
                       "bytes", "nvmlDeviceGetMemoryInfo .total")
PROCS = MetricSpec(
    "gpunet_gpu_compute_processes", "gauge",
    "Compute processes with a context on the GPU, other than the exporter's own probe workers",
    _G, "processes",
    "nvmlDeviceGetComputeRunningProcesses, /proc/<pid>/stat session")
PCIE_GEN = MetricSpec(
    "gpunet_gpu_pcie_link_generation", "gauge", "Current PCIe link generation", _G, "generation",
    "nvmlDeviceGetCurrPcieLinkGeneration")
PCIE_GEN_MAX = MetricSpec(
    "gpunet_gpu_pcie_link_max_generation", "gauge",
    "Highest PCIe generation the GPU and the slot both support", _G, "generation",
    "nvmlDeviceGetMaxPcieLinkGeneration")
PCIE_WIDTH = MetricSpec("gpunet_gpu_pcie_link_width", "gauge", "Current PCIe link width", _G,
                        "lanes", "nvmlDeviceGetCurrPcieLinkWidth")
PCIE_WIDTH_MAX = MetricSpec("gpunet_gpu_pcie_link_max_width", "gauge",
                            "Widest PCIe link the GPU and the slot both support", _G, "lanes",
                            "nvmlDeviceGetMaxPcieLinkWidth")
PCIE_DEGRADED = MetricSpec(
    "gpunet_gpu_pcie_link_degraded", "gauge",
    "1 when the PCIe link runs narrower than its maximum, or slower while the GPU is busy, else 0",
    _G, "boolean",
    "NVML current and maximum PCIe generation and width")
NVLINK_ACTIVE = MetricSpec(
    "gpunet_gpu_nvlink_active", "gauge", "1 when the NVLink link is active, else 0",
    ("gpu", "link"), "boolean", "nvmlDeviceGetNvLinkState")
_FABRIC_SRC = "nvmlDeviceGetGpuFabricInfoV"
FABRIC_STATE = MetricSpec(
    "gpunet_gpu_fabric_state", "gauge",
    "1 for the state of the GPU's registration with its NVLink fabric, 0 for the others",
    ("gpu", "state"), "boolean", f"{_FABRIC_SRC} state")
FABRIC_STATUS = MetricSpec(
    "gpunet_gpu_fabric_status_code", "gauge",
    "NVML return code of the GPU's completed fabric registration (0: success)", _G,
    "NVML return code", f"{_FABRIC_SRC} status")
FABRIC_INFO = MetricSpec(
    "gpunet_gpu_fabric_info", "gauge",
    "Always 1: the NVLink domain (cluster UUID) and clique the GPU's fabric registration gave it",
    ("gpu", "cluster_uuid", "clique_id"), "", f"{_FABRIC_SRC} clusterUuid, cliqueId")
FABRIC_HEALTH = MetricSpec(
    "gpunet_gpu_fabric_health", "gauge",
    "1 when a health check of the GPU's NVLink fabric fails, 0 when it passes (as the driver "
    "reports it)", ("gpu", "check"), "boolean", f"{_FABRIC_SRC} healthMask")
FABRIC_SUMMARY = MetricSpec(
    "gpunet_gpu_fabric_health_summary", "gauge",
    "1 for the driver's summary of the GPU's NVLink fabric health, 0 for the others",
    ("gpu", "summary"), "boolean", f"{_FABRIC_SRC} healthSummary (v3)")
# Background counters -------------------------------------------------------------------------
# Read in the background every counters_interval_seconds (docs/reading-metrics.md).
NVLINK_SPEED = MetricSpec(
    "gpunet_gpu_nvlink_speed_bytes_per_second", "gauge",
    "Speed of an NVLink link, one direction", ("gpu", "link"), "bytes per second",
    "nvmlDeviceGetFieldValues NVML_FI_DEV_NVLINK_GET_SPEED (MB/s), the link as the scope")
PCIE_THROUGHPUT = MetricSpec(
    "gpunet_gpu_pcie_throughput_bytes_per_second", "gauge",
    "PCIe throughput over a 20 ms sample (NVML KB/s x 1000)",
    ("gpu", "direction"),
    "bytes per second", "nvmlDeviceGetPcieThroughput TX_BYTES / RX_BYTES")
PCIE_REPLAYS = MetricSpec(
    "gpunet_gpu_pcie_replays_total", "counter",
    "PCIe replays (link-level retransmissions) since the driver loaded", _G, "replays",
    "NVML_FI_DEV_PCIE_REPLAY_COUNTER")
PCIE_REPLAY_ROLLOVERS = MetricSpec(
    "gpunet_gpu_pcie_replay_rollovers_total", "counter",
    "Times the PCIe replay number rolled over (4 replays of one packet)", _G, "rollovers",
    "NVML_FI_DEV_PCIE_REPLAY_ROLLOVER_COUNTER")
PCIE_RECOVERIES = MetricSpec(
    "gpunet_gpu_pcie_link_recoveries_total", "counter",
    "Transitions of the PCIe link from L0 into Recovery (retraining)", _G, "transitions",
    "NVML_FI_DEV_PCIE_L0_TO_RECOVERY_COUNTER")
PCIE_ERRORS = MetricSpec(
    "gpunet_gpu_pcie_errors_total", "counter",
    "PCIe errors the GPU counted, by type", ("gpu", "type"), "errors",
    "NVML_FI_DEV_PCIE_COUNT_<TYPE>")
NVLINK_ERRORS = MetricSpec(
    "gpunet_gpu_nvlink_errors_total", "counter",
    "NVLink data-link errors, by type", ("gpu", "link", "type"),
    "errors", "nvmlDeviceGetNvLinkErrorCounter")
COUNTERS_SUCCESS = MetricSpec(
    "gpunet_gpu_counters_refresh_success", "gauge",
    "1 if the latest background read of the GPU's counters succeeded, else 0", _G, "boolean",
    "exporter")
COUNTERS_LAST_SUCCESS = last_success_spec("gpunet_gpu_counters",
                                          "background read of the GPU's counters", _G)
# XID events ----------------------------------------------------------------------------------
XID_MONITORING = MetricSpec(
    "gpunet_gpu_xid_monitoring", "gauge",
    "1 when the exporter receives XID events for the GPU, 0 when NVML refused them",
    _G, "boolean", "nvmlDeviceRegisterEvents")
XID_ERRORS = MetricSpec(
    "gpunet_gpu_xid_errors_total", "counter",
    "XID errors reported by the driver since the exporter started, by XID code",
    ("gpu", "xid"), "errors", "NVML event nvmlEventTypeXidCriticalError .eventData")
XID_LAST = MetricSpec(
    "gpunet_gpu_xid_last_timestamp_seconds", "gauge",
    "Unix time of the latest XID error", _G, "seconds",
    "NVML XID events, exporter clock")
XID_LAST_CODE = MetricSpec(
    "gpunet_gpu_xid_last_code", "gauge", "XID code of the latest XID error", _G, "xid",
    "NVML event .eventData")

# Background field values: (constant name in pynvml, spec, labels after gpu). Not read:
# NVML_FI_DEV_PCIE_COUNT_TX_BYTES / RX_BYTES, 32-bit values (valueType unsigned int) that wrap
# every 0.3 s at the 14 GB/s measured on an H200 (docs/gpu.md): no scrape interval can follow them.
_FIELDS: tuple[tuple[str, MetricSpec, tuple[str, ...]], ...] = (
    ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", PCIE_REPLAYS, ()),
    ("NVML_FI_DEV_PCIE_REPLAY_ROLLOVER_COUNTER", PCIE_REPLAY_ROLLOVERS, ()),
    ("NVML_FI_DEV_PCIE_L0_TO_RECOVERY_COUNTER", PCIE_RECOVERIES, ()),
    ("NVML_FI_DEV_PCIE_COUNT_CORRECTABLE_ERRORS", PCIE_ERRORS, ("correctable",)),
    ("NVML_FI_DEV_PCIE_COUNT_NAKS_RECEIVED", PCIE_ERRORS, ("naks_received",)),
    ("NVML_FI_DEV_PCIE_COUNT_RECEIVER_ERROR", PCIE_ERRORS, ("receiver_error",)),
    ("NVML_FI_DEV_PCIE_COUNT_BAD_TLP", PCIE_ERRORS, ("bad_tlp",)),
    ("NVML_FI_DEV_PCIE_COUNT_NAKS_SENT", PCIE_ERRORS, ("naks_sent",)),
    ("NVML_FI_DEV_PCIE_COUNT_BAD_DLLP", PCIE_ERRORS, ("bad_dllp",)),
    ("NVML_FI_DEV_PCIE_COUNT_NON_FATAL_ERROR", PCIE_ERRORS, ("non_fatal",)),
    ("NVML_FI_DEV_PCIE_COUNT_FATAL_ERROR", PCIE_ERRORS, ("fatal",)),
    ("NVML_FI_DEV_PCIE_COUNT_UNSUPPORTED_REQ", PCIE_ERRORS, ("unsupported_request",)),
    ("NVML_FI_DEV_PCIE_COUNT_LCRC_ERROR", PCIE_ERRORS, ("lcrc",)),
    ("NVML_FI_DEV_PCIE_COUNT_LANE_ERROR", PCIE_ERRORS, ("lane",)),
)
NVLINK_COUNTERS = (("NVML_NVLINK_ERROR_DL_REPLAY", "replay"),
                   ("NVML_NVLINK_ERROR_DL_RECOVERY", "recovery"),
                   ("NVML_NVLINK_ERROR_DL_CRC_FLIT", "crc_flit"),
                   ("NVML_NVLINK_ERROR_DL_CRC_DATA", "crc_data"),
                   ("NVML_NVLINK_ERROR_DL_ECC_DATA", "ecc_data"))
_OK = 0  # NVML_SUCCESS


class _Lost(Exception):
    """The GPU answered GpuIsLost."""


class _SessionGone(Exception):
    """NVML answered as if shut down: the driver went away or was reloaded."""


class _Failed(Exception):
    """A background read failed; the GPU keeps its last good counters."""


Sample = tuple[MetricSpec, tuple[str, ...], float]


def _raise_if_fatal(exc: BaseException, fn: str) -> str:
    """The error's name, unless it ends the GPU's collection (_Lost) or the whole scrape
    (_SessionGone), which it raises instead."""
    name = error_name(exc)
    if name == "NVMLError_GpuIsLost":
        raise _Lost from None
    if name in nvml.SESSION_ERRORS:
        raise _SessionGone(f"{fn}: {exc}") from None
    return name


@dataclass
class _GpuState:
    """What is known of one GPU within one NVML initialisation."""

    gpu: Gpu
    info: tuple[str, ...] = ()
    nvlinks: int | None = None  # links, 0 without NVLink; None until discovered
    unsupported: set[str] = field(default_factory=set)


Counters = dict[str, Fresh[list[Sample]]]  # by GPU UUID


class XidWatcher:
    """Counts XID events of every GPU in a daemon thread blocked in nvmlEventSetWait.

    Counts are kept by GPU UUID, so they survive NVML re-initialisations.

    Not a background.Refresher, which serves the last good value of a periodic read: this is an
    event listener whose counts only ever accumulate (no round, no "last good value", no
    interval: no event is the normal state, so there is no freshness to export), and its
    thread is bound to one NVML initialisation: the event set belongs to it, so the thread must
    be stopped and joined before nvmlShutdown (Session.before_shutdown) and started again after
    the next nvmlInit, which a Refresher (stopped for good, never joined) does not do.
    """

    def __init__(self, log: Callable[..., None]) -> None:
        self._log = log
        self._lock = threading.Lock()
        self.counts: dict[tuple[str, str], int] = {}  # (uuid, xid) -> count
        self.last: dict[str, tuple[float, int]] = {}  # uuid -> (time, xid)
        self.registered: dict[str, bool] = {}  # uuid -> registration worked
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._generation = -1

    def ensure(self, session: Session, gpus: list[Gpu]) -> None:
        """Start (or after a re-initialisation restart) the event thread."""
        if self._generation == session.generation and self._thread is not None:
            return
        self.stop()
        nv = session.nv
        assert nv is not None
        self._generation = session.generation
        try:
            es = nv.nvmlEventSetCreate()
        except nv.NVMLError as exc:
            self._log(logging.WARNING, "XID events unavailable: nvmlEventSetCreate: %s", exc)
            for g in gpus:
                self.registered[g.uuid] = False
            return
        mask = nv.nvmlEventTypeXidCriticalError
        for g in gpus:
            if g.handle is None:
                continue
            try:
                nv.nvmlDeviceRegisterEvents(g.handle, mask, es)
                self.registered[g.uuid] = True
            except nv.NVMLError as exc:
                self.registered[g.uuid] = False
                self._log(logging.WARNING, "GPU %d: XID events not available: %s", g.index, exc)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(nv, es, mask, self._stop),
                                        name="gpu-xid-events", daemon=True)
        self._thread.start()

    def _run(self, nv: Any, es: Any, mask: int, stop: threading.Event) -> None:
        try:
            while not stop.is_set():
                try:
                    data = nv.nvmlEventSetWait_v2(es, XID_WAIT_MS)
                except nv.NVMLError as exc:
                    if error_name(exc) != "NVMLError_Timeout":
                        self._log(logging.WARNING, "waiting for XID events: %s", exc)
                        stop.wait(1.0)
                    continue
                if not int(data.eventType) & mask:  # only XID events count
                    continue
                try:
                    uuid = nv.nvmlDeviceGetUUID(data.device)
                except nv.NVMLError as exc:
                    self._log(logging.WARNING, "XID %s on an unknown GPU: %s", data.eventData,
                              exc)
                    continue
                self.record(uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                            int(data.eventData))
        finally:
            with contextlib.suppress(nv.NVMLError):
                nv.nvmlEventSetFree(es)

    def record(self, uuid: str, xid: int) -> None:
        with self._lock:
            code = str(xid)
            known = {x for (u, x) in self.counts if u == uuid}
            if code not in known and len(known) >= XID_LABELS_PER_GPU:
                code = "other"
            self.counts[(uuid, code)] = self.counts.get((uuid, code), 0) + 1
            self.last[uuid] = (time.time(), xid)
        self._log(logging.WARNING, "XID %d on GPU %s", xid, uuid)

    def snapshot(self) -> tuple[dict[tuple[str, str], int], dict[str, tuple[float, int]]]:
        with self._lock:
            return dict(self.counts), dict(self.last)

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        self._stop.set()
        if thread is not None:
            thread.join(timeout=2 * XID_WAIT_MS / 1000 + 1)


@dataclass(frozen=True)
class GpuSettings(Settings):
    counters_interval_seconds: float = setting(
        "how often the slow NVML counters (PCIe replay, error and recovery counters, PCIe "
        "throughput, NVLink error counters) are read in the background", default=15, minimum=1)
    pcie_throughput: bool = setting(
        "sample PCIe throughput with `nvmlDeviceGetPcieThroughput` in the background (it blocks "
        "20 ms per direction and GPU)", default=True)
    xid_events: bool = setting("count XID errors through an NVML event thread", default=True)


class GpuCollector(Collector):
    name = "gpu"
    description = ("NVIDIA GPUs through NVML: utilization, memory, PCIe link and errors, NVLink, "
                   "compute processes, XID errors, lost GPUs")
    metrics = (INFO, NVML_UP, LOST, MISSING, UTIL, MEM_UTIL, MEM_USED, MEM_RESERVED, MEM_TOTAL,
               PROCS, PCIE_GEN,
               PCIE_GEN_MAX, PCIE_WIDTH, PCIE_WIDTH_MAX, PCIE_DEGRADED, NVLINK_ACTIVE,
               FABRIC_STATE, FABRIC_STATUS, FABRIC_INFO, FABRIC_HEALTH, FABRIC_SUMMARY,
               PCIE_THROUGHPUT, PCIE_REPLAYS, PCIE_REPLAY_ROLLOVERS, PCIE_RECOVERIES,
               PCIE_ERRORS, NVLINK_ERRORS, NVLINK_SPEED, COUNTERS_SUCCESS, COUNTERS_LAST_SUCCESS,
               XID_MONITORING, XID_ERRORS, XID_LAST, XID_LAST_CODE)
    settings_type = GpuSettings
    settings: GpuSettings
    unknown_checks: ClassVar[Mapping[str, str]] = {
        "nvml": "every GPU series and alert: NVIDIA GPUs sit on the PCI bus, but "
                 "NVML cannot be used"}

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self.session = nvml.session(ctx.nvml_module)
        self._on_bus = NvidiaGpus(ctx.sysfs)
        self._unknown: dict[str, str] = {}
        self.xid = XidWatcher(ctx.log_once)
        self.session.before_shutdown(self.xid.stop)
        self._states: dict[int, _GpuState] = {}
        self._generation = -1
        self._seen: set[str] = set()  # UUIDs ever enumerated
        # The background counters, started by the first scrape with GPUs. NVML calls cannot be
        # given a timeout, so the round has one: a round still running after an interval has
        # failed.
        interval = float(self.settings.counters_interval_seconds)
        self._refresher: Refresher[Counters] = Refresher(
            "gpu-counters", interval, self._round, ctx.log_once, timeout=interval)
        self._hotplug = ""  # why NVML must be initialised again, from a hot-plug event

    # -- NVML plumbing -------------------------------------------------------------------------

    def _states_for(self, gpus: list[Gpu]) -> list[_GpuState]:
        if self._generation != self.session.generation:
            self._generation = self.session.generation
            self._states = {g.index: _GpuState(g) for g in gpus}
            self._seen.update(g.uuid for g in gpus if g.uuid)
        return [self._states[g.index] for g in gpus]

    def _call(self, st: _GpuState, fn: str, *args: Any, key: str = "",
              background: bool = False, **kwargs: Any) -> Any:
        """One NVML call for one GPU: None when unsupported (remembered under ``key``, logged
        once) or failed (one unreadable value; in the background it raises _Failed); raises
        _Lost or _SessionGone."""
        key = key or fn
        nv = self.session.nv
        assert nv is not None
        call = getattr(nv, fn, None)
        if key in st.unsupported:
            return None
        if call is None:  # an nvidia-ml-py older than the call
            st.unsupported.add(key)
            self.ctx.log_once(logging.INFO, "GPU %d: %s not in %s; skipped", st.gpu.index, fn,
                              self.session.module_name)
            return None
        try:
            return call(st.gpu.handle, *args, **kwargs)
        except nv.NVMLError as exc:
            name = _raise_if_fatal(exc, fn)
            if name in UNSUPPORTED:
                st.unsupported.add(key)
                self.ctx.log_once(logging.INFO, "GPU %d: %s not supported (%s); skipped",
                                  st.gpu.index, key, exc)
            elif background:
                raise _Failed(f"{key}: {exc}") from None
            else:
                self.ctx.skip(f"GPU {st.gpu.index} {key}", exc)
            return None

    def _foreign(self, procs: list[Any]) -> int:
        """How many of ``procs`` are not the exporter's own probe workers (by session ID, field 6
        of /proc/<pid>/stat; a process whose stat cannot be read counts as foreign)."""
        own = nvml.own_sessions()
        if not own:
            return len(procs)
        n = 0
        for p in procs:
            try:
                stat = self.ctx.procfs.read(f"{int(p.pid)}/stat")
                sid = int(stat[stat.rindex(")") + 2:].split()[3])
            except (OSError, ValueError, IndexError):
                sid = -1
            n += sid not in own
        return n

    def _info(self, st: _GpuState) -> tuple[str, ...]:
        if not st.info:
            g, nv = st.gpu, self.session.nv
            assert nv is not None
            numa = self._call(st, "nvmlDeviceGetNumaNodeId")
            if numa is None and g.pci_bus_id:  # not supported in VMs: the kernel's view
                try:
                    numa = self.ctx.sysfs.read(f"bus/pci/devices/{g.pci_bus_id}/numa_node")
                except OSError:
                    numa = None
            st.info = (str(g.index), g.uuid, g.name, g.pci_bus_id, self.session.driver_version,
                       "-1" if numa is None else str(numa))
        return st.info

    def _memory(self, st: _GpuState) -> Any:
        """Memory as nvidia-smi shows it: the v2 struct, whose ``used`` leaves out what the
        driver reserves (the v1 ``used`` includes it: about 614 MiB more on an H200); v1 on
        drivers before the v2 call."""
        nv = self.session.nv
        v2 = getattr(nv, "nvmlMemory_v2", None)
        if v2 is not None:
            mem = self._call(st, "nvmlDeviceGetMemoryInfo", version=v2,
                             key="nvmlDeviceGetMemoryInfo_v2")
            if mem is not None:
                return mem
        return self._call(st, "nvmlDeviceGetMemoryInfo")

    def _nvlinks(self, st: _GpuState) -> int:
        """Number of NVLink links of the GPU: probe states from link 0 until InvalidArgument."""
        if st.nvlinks is None:
            nv = self.session.nv
            assert nv is not None
            n = 0
            for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
                try:
                    nv.nvmlDeviceGetNvLinkState(st.gpu.handle, link)
                except nv.NVMLError as exc:
                    name = _raise_if_fatal(exc, "nvmlDeviceGetNvLinkState")
                    if name not in UNSUPPORTED and name != "NVMLError_InvalidArgument":
                        self.ctx.skip(f"GPU {st.gpu.index} NVLink {link} state", exc)
                        return 0  # try again next scrape
                    break
                n = link + 1
            st.nvlinks = n
        return st.nvlinks

    def unknown(self) -> Mapping[str, str]:
        """``nvml`` while NVIDIA GPUs sit on the PCI bus and NVML cannot be used; nothing on a
        node without them."""
        return self._unknown

    # -- scrape --------------------------------------------------------------------------------

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        fams = Families()
        session = self.session
        hotplug, self._hotplug = self._hotplug, ""
        if hotplug:
            session.invalidate(hotplug, logging.INFO)
        gpus = session.gpus()
        if gpus is not None and session.device_count_changed():
            session.invalidate("the number of GPUs changed")
            gpus = session.gpus()
        self._unknown = {}
        if gpus is None:
            if session.state == "down":
                fams.add(NVML_UP, [], 0)
            if self._on_bus():  # NVIDIA GPUs on the PCI bus, and no NVML to ask about them
                self._unknown = {"nvml": session.reason or "init_failed"}
            yield from fams
            return
        self._start_background(gpus)
        fams.add(NVML_UP, [], 1)
        lost: set[int] = set()
        try:
            for st in self._states_for(gpus):
                if self._collect_gpu(st, fams):
                    lost.add(st.gpu.index)
        except _SessionGone as exc:
            session.invalidate(str(exc))
            fams = Families()  # nothing of a half-read scrape
            fams.add(NVML_UP, [], 0)
            yield from fams
            return
        # Every GPU lost at once is rather a driver reload than N faults: initialise again, but
        # not more often than NVML retries, so truly lost GPUs stay visible as lost.
        if (gpus and len(lost) == len(gpus)
                and time.monotonic() - session.initialised_at >= nvml.RETRY_SECONDS):
            session.invalidate("every GPU answered GpuIsLost")
        present = {g.uuid for g in gpus if g.uuid}
        fams.add(MISSING, [], len(self._seen - present))
        self._add_background(fams, gpus, lost, scrape.deadline)
        yield from fams

    def _collect_gpu(self, st: _GpuState, fams: Families) -> bool:
        """Add one GPU's per-scrape series; returns True when the GPU is lost."""
        g, nv = st.gpu, self.session.nv
        assert nv is not None
        gpu = str(g.index)
        if g.handle is None:
            fams.add(LOST, [gpu], 1)
            return True
        try:
            info = self._info(st)
            util = self._call(st, "nvmlDeviceGetUtilizationRates")
            mem = self._memory(st)
            procs = self._call(st, "nvmlDeviceGetComputeRunningProcesses")
            gen = self._call(st, "nvmlDeviceGetCurrPcieLinkGeneration")
            gen_max = self._call(st, "nvmlDeviceGetMaxPcieLinkGeneration")
            width = self._call(st, "nvmlDeviceGetCurrPcieLinkWidth")
            width_max = self._call(st, "nvmlDeviceGetMaxPcieLinkWidth")
            links = [(link, self._call(st, "nvmlDeviceGetNvLinkState", link,
                                       key=f"nvmlDeviceGetNvLinkState/{link}"))
                     for link in range(self._nvlinks(st))]
            fabric = self._fabric(st)
        except _Lost:
            fams.add(LOST, [gpu], 1)
            return True
        fams.add(LOST, [gpu], 0)
        fams.add(INFO, list(info), 1)
        if util is not None:
            fams.add(UTIL, [gpu], util.gpu / 100)
            fams.add(MEM_UTIL, [gpu], util.memory / 100)
        if mem is not None:
            fams.add(MEM_USED, [gpu], mem.used)
            fams.add(MEM_TOTAL, [gpu], mem.total)
            if hasattr(mem, "reserved"):
                fams.add(MEM_RESERVED, [gpu], mem.reserved)
        foreign = self._foreign(procs) if procs is not None else 0
        if procs is not None:
            fams.add(PROCS, [gpu], foreign)
        for spec, v in ((PCIE_GEN, gen), (PCIE_GEN_MAX, gen_max), (PCIE_WIDTH, width),
                        (PCIE_WIDTH_MAX, width_max)):
            if v is not None:
                fams.add(spec, [gpu], v)
        if None not in (gen, gen_max, width, width_max):
            busy = (util is not None and util.gpu > 0) or foreign > 0
            degraded = width < width_max or (busy and gen < gen_max)
            fams.add(PCIE_DEGRADED, [gpu], int(degraded))
        for link, state in links:
            if state is not None:
                fams.add(NVLINK_ACTIVE, [gpu, str(link)], int(state == nv.NVML_FEATURE_ENABLED))
        if fabric is not None:
            _add_fabric(fams, gpu, fabric)
        return False

    def _fabric(self, st: _GpuState) -> Any:
        """The GPU's fabric info: the v3 structure (with the health summary), else v2, where the
        bindings and the driver have the call; None otherwise, or when it fails."""
        nv = self.session.nv
        for struct in ("c_nvmlGpuFabricInfo_v3_t", "c_nvmlGpuFabricInfo_v2_t"):
            cls = getattr(nv, struct, None)
            key = f"nvmlDeviceGetGpuFabricInfoV/{struct}"
            if cls is None or key in st.unsupported:
                continue
            info = cls()
            # By reference: handed over as it is, the structure goes to C by value and NVML
            # writes through garbage (a segmentation fault; tests/fixtures/nvml/SOURCES.md).
            if self._call(st, "nvmlDeviceGetGpuFabricInfoV", ctypes.byref(info),
                          key=key) is not None:
                return info
            if key not in st.unsupported:  # failed, not unsupported: one unreadable value
                return None
        return None

    # -- background counters and XID events ----------------------------------------------------

    def _start_background(self, gpus: list[Gpu]) -> None:
        if self.settings.xid_events:
            self.xid.ensure(self.session, gpus)
        self._refresher.start()  # its first round runs while this scrape reads the GPUs

    def refresh(self) -> None:
        """One background round now, in the calling thread, kept as the thread keeps its own."""
        self._refresher.refresh()

    def _round(self) -> Counters:
        """One background round over every GPU, built on the last good round's values: a GPU
        that fails keeps its last good values, a GPU not enumerated now keeps its entry."""
        counters: Counters = dict(self._refresher.snapshot().value or {})
        for g in self.session.gpus() or []:
            if g.handle is None or not g.uuid:
                continue
            old = counters.get(g.uuid, Fresh())
            try:
                counters[g.uuid] = old.succeeded(self._read_counters(g))
            except (_Lost, _SessionGone, _Failed) as exc:
                self.ctx.log_once(logging.WARNING, "GPU %d: background counters: %s",
                                  g.index, str(exc) or type(exc).__name__)
                counters[g.uuid] = old.failed()
        return counters

    def _read_counters(self, g: Gpu) -> list[Sample]:
        nv = self.session.nv
        assert nv is not None
        st = self._states.get(g.index)
        if st is None or st.gpu is not g:
            st = _GpuState(g)  # a round racing a re-initialisation: no cached knowledge
        gpu = str(g.index)
        out: list[Sample] = []
        wanted = [(const, getattr(nv, const), spec, labels) for const, spec, labels in _FIELDS
                  if hasattr(nv, const) and f"field/{const}" not in st.unsupported]
        if wanted:
            values = self._call(st, "nvmlDeviceGetFieldValues", [w[1] for w in wanted],
                                background=True)
            for (const, _, spec, labels), fv in zip(wanted, values or (), strict=False):
                if fv.nvmlReturn == _OK:
                    out.append((spec, (gpu, *labels), nvml.field_value(fv)))
                elif fv.nvmlReturn == getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3):
                    st.unsupported.add(f"field/{const}")
                    self.ctx.log_once(logging.INFO, "GPU %s: %s not supported; skipped", gpu,
                                      const)
                else:
                    raise _Failed(f"{const}: nvmlReturn {fv.nvmlReturn}")
        if self.settings.pcie_throughput:
            for counter, direction in ((nv.NVML_PCIE_UTIL_TX_BYTES, "tx"),
                                       (nv.NVML_PCIE_UTIL_RX_BYTES, "rx")):
                kbps = self._call(st, "nvmlDeviceGetPcieThroughput", counter, background=True)
                if kbps is not None:
                    out.append((PCIE_THROUGHPUT, (gpu, direction), kbps * 1000))
        for link in range(self._nvlinks(st)):
            for const, kind in NVLINK_COUNTERS:
                v = self._call(st, "nvmlDeviceGetNvLinkErrorCounter", link, getattr(nv, const),
                               key=f"nvmlDeviceGetNvLinkErrorCounter/{link}/{kind}",
                               background=True)
                if v is not None:
                    out.append((NVLINK_ERRORS, (gpu, str(link), kind), v))
        out += self._nvlink_speeds(st, gpu)
        return out

    def _nvlink_speeds(self, st: _GpuState, gpu: str) -> list[Sample]:
        """Each NVLink link's speed, in one field-value call (the link as each value's scope);
        none where the driver does not have the field, which is then not asked again."""
        nv = self.session.nv
        fields = nvml.nvlink_speed_fields(nv, range(self._nvlinks(st)))
        if not fields or "nvlink_speed" in st.unsupported:
            return []
        values = self._call(st, "nvmlDeviceGetFieldValues", fields, key="nvlink_speed",
                            background=True)
        out: list[Sample] = []
        for link, fv in enumerate(values or ()):
            if fv.nvmlReturn == _OK:
                speed = nvml.link_speed(fv)
                if speed > 0:
                    out.append((NVLINK_SPEED, (gpu, str(link)), speed))
            elif fv.nvmlReturn == getattr(nv, "NVML_ERROR_NOT_SUPPORTED", 3):
                st.unsupported.add("nvlink_speed")
                return []
        return out

    def _add_background(self, fams: Families, gpus: list[Gpu], lost: set[int],
                        deadline: float | None) -> None:
        fresh = self._refresher.wait_first(deadline)
        counters = fresh.value or {}
        # A round that failed as a whole (overran its timeout, raised) fails every GPU.
        round_failed = fresh.ok is False
        counts, last = self.xid.snapshot()
        xid_on = self.settings.xid_events
        for g in gpus:
            if g.handle is None or not g.uuid:
                continue
            gpu = str(g.index)
            c = counters.get(g.uuid)
            if c is not None and g.index not in lost:
                for spec, labels, v in c.value or ():
                    fams.add(spec, [gpu, *labels[1:]], v)
                add_freshness(fams, COUNTERS_SUCCESS, COUNTERS_LAST_SUCCESS, [gpu], c,
                              ok=False if round_failed else None)
            if xid_on and g.uuid in self.xid.registered:
                fams.add(XID_MONITORING, [gpu], int(self.xid.registered[g.uuid]))
            for (uuid, code), n in sorted(counts.items()):
                if uuid == g.uuid:
                    fams.add(XID_ERRORS, [gpu, code], n)
            if g.uuid in last:
                when, code_ = last[g.uuid]
                fams.add(XID_LAST, [gpu], when)
                fams.add(XID_LAST_CODE, [gpu], code_)

    def device_event(self, subsystem: str, action: str, properties: Mapping[str, str]) -> None:
        """An NVIDIA PCI function (vendor 0x10de: a GPU or NVSwitch) was added, removed, or
        bound to or unbound from its driver: NVML's enumeration is stale, so drop it and let the
        next scrape initialise again. The per-scrape GPU-count check catches a changed count
        anyway; this also catches a GPU replaced, or rebound, at the same count. Other vendors'
        functions (NICs and their SR-IOV VFs) are ignored. The re-initialisation itself happens
        at the start of the next scrape, not on the hot-plug thread."""
        if subsystem != "pci" or action not in ("add", "remove", "bind", "unbind"):
            return
        vendor = properties.get("PCI_ID", "").partition(":")[0]  # "10DE:2335": vendor:device
        if vendor.lower() == "10de":
            slot = properties.get("PCI_SLOT_NAME", "") or properties.get("DEVPATH", "?")
            self._hotplug = f"PCI device {slot} {action} (hot-plug)"

    def close(self) -> None:
        self._refresher.stop()
        self.xid.stop()


def _add_fabric(fams: Families, gpu: str, info: Any) -> None:
    """One GPU's fabric series from its fabric info (nvml.FABRIC_* say what each value is)."""
    index = int(info.state)
    state = nvml.FABRIC_STATES[index] if 0 <= index < len(nvml.FABRIC_STATES) else None
    for name in nvml.FABRIC_STATES:
        fams.add(FABRIC_STATE, [gpu, name], int(name == state))
    if state in (None, "not_supported"):
        return
    if state == "completed":
        fams.add(FABRIC_STATUS, [gpu], int(info.status))
        uuid = bytes(info.clusterUuid).hex()
        uuid = f"{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:32]}"
        fams.add(FABRIC_INFO, [gpu, uuid, str(int(info.cliqueId))], 1)
    for check, failing in nvml.fabric_health(int(info.healthMask)).items():
        fams.add(FABRIC_HEALTH, [gpu, check], failing)
    summary = nvml.FABRIC_SUMMARIES.get(int(getattr(info, "healthSummary", 0)))
    if summary is not None:
        for name in nvml.FABRIC_SUMMARIES.values():
            fams.add(FABRIC_SUMMARY, [gpu, name], int(name == summary))

