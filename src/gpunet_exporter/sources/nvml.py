"""One NVML session per process, shared by the collectors that need NVML (gpu, topology).

NVML is reached through a module with the pynvml API (nvidia-ml-py by default, docs/formats.md
§6.1; a stand-in in tests, ``--nvml.module``). The session initialises once, enumerates the GPUs
and re-initialises after a driver reload; its states (absent, up, down) and when it retries:
docs/architecture.md, "sources".
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

log = logging.getLogger("gpunet.nvml")

RETRY_SECONDS = 10.0

# Sessions (setsid leaders' PIDs) of GPU processes this exporter started itself: the probe runner
# and its workers. The gpu collector leaves them out of gpunet_gpu_compute_processes, so an idle
# node whose only GPU processes are the probe's does not look "busy but starved".
_own_sessions: set[int] = set()
_own_lock = threading.Lock()


def own_session(sid: int, started: bool) -> None:
    """Record that the exporter started (or ended) a process session holding GPU contexts."""
    with _own_lock:
        if started:
            _own_sessions.add(sid)
        else:
            _own_sessions.discard(sid)


def own_sessions() -> frozenset[int]:
    with _own_lock:
        return frozenset(_own_sessions)
State = Literal["absent", "up", "down"]
_BUS_ID = re.compile(r"^([0-9a-f]{1,8}):([0-9a-f]{2}:[0-9a-f]{2}\.[0-7])$")

# NVML errors that mean "this process's NVML no longer talks to a working driver".
SESSION_ERRORS = ("NVMLError_Uninitialized", "NVMLError_DriverNotLoaded",
                  "NVMLError_LibRmVersionMismatch")
# Errors at the first nvmlInit that mean "no NVIDIA driver here" rather than "broken".
ABSENT_ERRORS = ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded")
_REASONS = {"NVMLError_LibraryNotFound": "library_missing",
            "NVMLError_DriverNotLoaded": "driver_not_loaded"}


@dataclass(frozen=True)
class Gpu:
    """A GPU as enumerated at initialisation. ``handle`` is None when the GPU was lost then."""

    index: int
    uuid: str
    name: str
    pci_bus_id: str  # sysfs form: lower-case, 4-digit domain ("0000:18:00.0"); "" if unknown
    handle: Any


# The NVLink fabric of a GPU (nvmlDeviceGetGpuFabricInfoV; nvml.h NVML_GPU_FABRIC_*): its
# state by index, its health summary by value (0: not reported), and the fields of its health
# mask: check -> (shift, width, the values that mean failing, those that mean passing); any
# other value (0) means the driver does not report the check. Docs: docs/formats.md §6.
FABRIC_STATES = ("not_supported", "not_started", "in_progress", "completed")
FABRIC_SUMMARIES = {1: "healthy", 2: "unhealthy", 3: "limited_capacity"}
FABRIC_HEALTH: dict[str, tuple[int, int, frozenset[int], frozenset[int]]] = {
    "degraded_bandwidth": (0, 0x3, frozenset({1}), frozenset({2})),
    "route_recovery": (2, 0x3, frozenset({1}), frozenset({2})),
    "route_unhealthy": (4, 0x3, frozenset({1}), frozenset({2})),
    "access_timeout_recovery": (6, 0x3, frozenset({1}), frozenset({2})),
    "incorrect_configuration": (8, 0xF, frozenset(range(2, 16)), frozenset({1})),
    "fabric_manager_disconnected": (14, 0x3, frozenset({2}), frozenset({1})),
}


def fabric_health(mask: int) -> dict[str, int]:
    """The health checks a fabric health mask reports: 1 failing, 0 passing; the checks the
    driver does not report are left out."""
    out = {}
    for check, (shift, width, bad, good) in FABRIC_HEALTH.items():
        v = (mask >> shift) & width
        if v in bad or v in good:
            out[check] = int(v in bad)
    return out


# nvmlValueType_t -> the member of nvmlValue_t that holds a field value.
VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")


def field_value(fv: Any) -> float:
    """A field value (c_nvmlFieldValue_t) as a number, by its value type."""
    t = int(fv.valueType)
    return float(getattr(fv.value, VALUE_MEMBERS[t] if 0 <= t < len(VALUE_MEMBERS) else "ullVal"))


def nvlink_speed_fields(nv: Any, links: Iterable[int]) -> list[tuple[int, int]]:
    """The field-value request of the speed of each of ``links``: NVML_FI_DEV_NVLINK_GET_SPEED
    with the link as its scope (docs/formats.md §6.2); empty where the bindings lack the
    field. One nvmlDeviceGetFieldValues call answers them all, in order."""
    speed = getattr(nv, "NVML_FI_DEV_NVLINK_GET_SPEED", None)
    return [] if speed is None else [(speed, link) for link in links]


def link_speed(fv: Any) -> float:
    """One answer to :func:`nvlink_speed_fields` in bytes per second (NVML gives MB/s: 26562
    per link on an H100)."""
    return field_value(fv) * 1e6


def nvlink_bandwidth(nv: Any, handle: Any) -> float | None:
    """Bytes per second the GPU's active NVLinks carry in one direction: the sum of their
    speeds, read in one field-value call. None for a GPU without NVLink, or where a link's
    speed cannot be read."""
    active = []
    for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
        try:
            state = nv.nvmlDeviceGetNvLinkState(handle, link)
        except nv.NVMLError:
            break  # past the last link (InvalidArgument), or no NVLink (NotSupported)
        if state == nv.NVML_FEATURE_ENABLED:
            active.append(link)
    fields = nvlink_speed_fields(nv, active)
    if not fields:
        return None
    try:
        values = nv.nvmlDeviceGetFieldValues(handle, fields)
    except nv.NVMLError:
        return None
    if len(values) != len(fields) or any(int(fv.nvmlReturn) != 0 for fv in values):
        return None
    return sum(link_speed(fv) for fv in values)


def error_name(exc: BaseException) -> str:
    """The pynvml exception class name (``NVMLError_NotSupported``), also for stand-ins."""
    return type(exc).__name__


def sysfs_bus_id(raw: str | bytes) -> str:
    """NVML's busId ("00000000:18:00.0", bytes or str) in sysfs form ("0000:18:00.0")."""
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else str(raw)
    m = _BUS_ID.match(text.strip().lower())
    if not m:
        return ""
    # sysfs prints the domain with at least 4 digits (VMD domains have 5: "10000:01:00.0").
    return f"{int(m[1], 16):04x}:{m[2]}"


class Session:
    def __init__(self, module_name: str) -> None:
        self.module_name = module_name
        self.nv: ModuleType | None = None
        self.state: State = "absent"
        self.error = ""  # why NVML is not up, for logs and the landing page
        # ... as a word of collector.UNKNOWN_REASONS ("" while up or never tried)
        self.reason = ""
        self.driver_version = ""
        self.generation = 0  # bumped at each successful initialisation
        self.initialised_at = 0.0  # time.monotonic() of the latest successful initialisation
        self._gpus: list[Gpu] | None = None
        self._ever_up = False
        self._next_try = 0.0
        self._said = ""  # the failure last logged: a retry that fails alike logs at DEBUG
        self._lock = threading.RLock()
        self._before_shutdown: list[Callable[[], None]] = []

    @property
    def errors(self) -> Any:
        """The NVMLError base class of the backend module (``except session.errors``)."""
        return self.nv.NVMLError if self.nv is not None else ()

    def gpus(self) -> list[Gpu] | None:
        """The GPUs of the current initialisation, initialising if needed; None without NVML."""
        with self._lock:
            if self._gpus is None and time.monotonic() >= self._next_try:
                self._next_try = time.monotonic() + RETRY_SECONDS
                self._init()
            return self._gpus

    def _say(self, level: int, msg: str, *args: object) -> None:
        """Log a failed initialisation at ``level`` the first time it fails so, at DEBUG when a
        retry (every RETRY_SECONDS) fails alike: a node without NVIDIA's library logs one line,
        not one per retry."""
        text = msg % args
        if text != self._said:
            self._said = text
            log.log(level, "%s", text)
        else:
            log.debug("%s", text)

    def _init(self) -> None:
        if self.nv is None:
            try:
                self.nv = importlib.import_module(self.module_name)
            except Exception as exc:  # ImportError, or a broken module
                self.error = f"cannot import {self.module_name}: {exc}"
                self.reason = "library_missing"
                self._say(logging.INFO, "NVML unavailable (%s); no GPU data", self.error)
                return
        nv = self.nv
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            self.error = f"nvmlInit: {exc}"
            self.reason = _REASONS.get(error_name(exc), "init_failed")
            absent = error_name(exc) in ABSENT_ERRORS and not self._ever_up
            self.state = "absent" if absent else "down"
            self._say(logging.INFO if absent else logging.WARNING, "NVML not initialised: %s; %s",
                      exc, "no GPU data" if absent else f"retrying every {RETRY_SECONDS:g}s")
            return
        try:
            gpus = self._enumerate(nv)
            version = nv.nvmlSystemGetDriverVersion()
        except nv.NVMLError as exc:
            self.error = f"enumerating GPUs: {exc}"
            self.reason = "init_failed"
            self.state = "down"
            self._say(logging.WARNING, "NVML initialised but cannot enumerate GPUs: %s", exc)
            self._shutdown(nv)
            return
        self.driver_version = _text(version)  # bytes from older nvidia-ml-py releases
        self._gpus, self.state, self.error, self.reason = gpus, "up", "", ""
        self._ever_up = True
        self._said = ""
        self.generation += 1
        self.initialised_at = time.monotonic()
        log.info("NVML initialised: driver %s, %d GPU(s)", self.driver_version, len(gpus))

    @staticmethod
    def _enumerate(nv: ModuleType) -> list[Gpu]:
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
            except nv.NVMLError as exc:  # a GPU lost before we could open it
                log.warning("GPU %d: cannot get an NVML handle: %s", i, exc)
                out.append(Gpu(i, "", "", "", None))
                continue
            try:
                uuid, name = _text(nv.nvmlDeviceGetUUID(h)), _text(nv.nvmlDeviceGetName(h))
                bus = sysfs_bus_id(nv.nvmlDeviceGetPciInfo(h).busId)
            except nv.NVMLError as exc:
                if error_name(exc) != "NVMLError_GpuIsLost":
                    raise
                out.append(Gpu(i, "", "", "", None))
                continue
            out.append(Gpu(i, uuid, name, bus, h))
        return out

    def device_count_changed(self) -> bool:
        """True when NVML now reports a different number of GPUs than it enumerated."""
        gpus, nv = self._gpus, self.nv
        if gpus is None or nv is None:
            return False
        try:
            return int(nv.nvmlDeviceGetCount()) != len(gpus)
        except nv.NVMLError:
            return True

    def before_shutdown(self, fn: Callable[[], None]) -> None:
        """Register a hook (stopping an event thread) run before NVML is shut down."""
        with self._lock:
            self._before_shutdown.append(fn)

    def invalidate(self, reason: str, level: int = logging.WARNING) -> None:
        """Drop the current initialisation; the next :meth:`gpus` initialises again."""
        with self._lock:
            if self._gpus is None:
                return
            log.log(level, "re-initialising NVML: %s", reason)
            self._gpus, self.state, self.error = None, "down", reason
            self._next_try = 0.0
            if self.nv is not None:
                self._shutdown(self.nv)

    def _shutdown(self, nv: ModuleType) -> None:
        for fn in list(self._before_shutdown):
            try:
                fn()
            except Exception as exc:
                log.debug("before-shutdown hook failed: %s", exc)
        try:
            nv.nvmlShutdown()
        except nv.NVMLError as exc:
            log.debug("nvmlShutdown: %s", exc)

    def compute_pids(self) -> set[int] | None:
        """PIDs of the compute processes on any GPU (host PID namespace); None without NVML."""
        gpus, nv = self.gpus(), self.nv
        if gpus is None or nv is None:
            return None
        pids: set[int] = set()
        for g in gpus:
            if g.handle is None:
                continue
            try:
                pids.update(int(p.pid) for p in nv.nvmlDeviceGetComputeRunningProcesses(g.handle))
            except nv.NVMLError as exc:
                log.debug("GPU %d: compute processes: %s", g.index, exc)
        return pids


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


_sessions: dict[str, Session] = {}
_sessions_lock = threading.Lock()


def session(module_name: str = "pynvml") -> Session:
    """The process-wide session for a backend module (one NVML initialisation per process)."""
    with _sessions_lock:
        s = _sessions.get(module_name)
        if s is None:
            s = _sessions[module_name] = Session(module_name)
        return s


def forget(module_name: str) -> None:
    """Drop a backend's session (tests start each scenario from scratch)."""
    with _sessions_lock:
        s = _sessions.pop(module_name, None)
    if s is not None:
        s.invalidate("session forgotten", logging.DEBUG)
