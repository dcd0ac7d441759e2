"""A stand-in for ``pynvml`` (nvidia-ml-py) at the module boundary, replaying real readings.

The default scenario is tests/fixtures/nvml/nvml_probe_h200x2.json, what NVML answered on
a 2 x H200 machine (driver 580.159.04): every value and every error in it comes back exactly as
recorded (NumaNodeId NotSupported, NVLink state InvalidArgument past link 17, the NVLink *_TOTAL
fields NotSupported, ...). Exceptions and constants are nvidia-ml-py's own, so the collector's
error handling meets the real classes. Scenario keys beyond the capture:

    "library": "missing" | "no_driver"      nvmlInit fails as on a node without NVIDIA
    devices[i]["lost"]: true                 every call on the GPU raises GpuIsLost
    devices[i]["processes"]: [pid, ...]      compute processes (the capture had none)
    devices[i]["graphics_processes"]: [pid, ...]   graphics processes
    devices[i][<function name>]: {"exc": "NVMLError_NotSupported"}   override one call
    devices[i]["nvmlDeviceGetMemoryInfo_v2"]: {"ok": {...}}   the v2 memory struct
    devices[i]["sleep"]: {<function name>: seconds}   the call blocks that long, then answers
                                                      (a hung driver; tests/test_load.py)
    devices[i]["fabric"]: {"state": 3, ...}  nvmlDeviceGetGpuFabricInfoV's answer (the v3
                                             structure's fields, clusterUuid in hex); without
                                             it the call is FunctionNotFound (not recorded)
    devices[i]["fabric"]: {"exc": "NVMLError_..."}   the call fails

:func:`fabric_h100x4` gives the fabric answers recorded on 4 H100s
(tests/fixtures/nvml/fabric_h100x4.json), to put into a scenario's devices.

Tests call :func:`load`, :func:`push_event` and :func:`reload_driver`. An exporter started as
a subprocess loads this module with ``--nvml.module support.fake_nvml`` (:data:`MODULE`, with
tests/ on PYTHONPATH), reads its scenario from the JSON file named by ``GPUNET_FAKE_NVML``, and
takes XID events from lines ``<gpu index> <xid>`` appended to the file named by
``GPUNET_FAKE_NVML_EVENTS``; :func:`exporter_env` is that environment. Processes come and go
at run time through the file named by ``GPUNET_FAKE_NVML_PROCESSES``: lines ``<gpu index>
<pid>``, compute processes listed besides the scenario's, the whole file read again at each
nvmlDeviceGetComputeRunningProcesses call (no file: none; replace it whole, or append whole
lines: a last line without its newline is not read yet).
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections import Counter, deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml as _real

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "nvml" / "nvml_probe_h200x2.json"
# What --nvml.module (and a collector's nvml_module) names to load this stand-in, with tests/
# on sys.path: the pytest run has it there, an exporter subprocess gets it from exporter_env().
MODULE = "support.fake_nvml"
TESTS = Path(__file__).resolve().parents[1]
NVMLError = _real.NVMLError
_PASSTHROUGH = ("NVML_", "NVMLError", "nvmlEventType", "nvmlMemory", "c_nvml")


def __getattr__(name: str) -> Any:
    """Constants and exception classes come from nvidia-ml-py; any NVML function this stand-in
    does not define is missing, as in an nvidia-ml-py too old to have it."""
    if name.startswith(_PASSTHROUGH):
        return getattr(_real, name)
    raise AttributeError(name)


def _error(name: str) -> NVMLError:
    return getattr(_real, name)()  # type: ignore[no-any-return]


class _Handle:
    def __init__(self, index: int, generation: int) -> None:
        self.index, self.generation = index, generation

    def __repr__(self) -> str:
        return f"<fake nvmlDevice {self.index}>"


class _State:
    def __init__(self) -> None:
        self.scenario: dict[str, Any] = {}
        self.initialized = 0
        self.generation = 0
        self.calls: Counter[tuple[str, int]] = Counter()
        self.events: deque[tuple[int, int, int]] = deque()
        self.registered: dict[int, set[int]] = {}  # event set id -> GPU indexes
        self.cond = threading.Condition()
        self.events_file = ""
        self.events_offset = 0
        self.processes_file = ""


_s = _State()


def h200x2() -> dict[str, Any]:
    """A fresh copy of the real 2 x H200 capture, for a test to modify."""
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


def add_gpus(scenario: dict[str, Any], count: int) -> None:
    """Grow a scenario to ``count`` GPUs with copies of its first one, each with its own index,
    UUID and PCI bus id (device number 6 + index, as the capture's two have)."""
    first = scenario["devices"][0]
    for index in range(len(scenario["devices"]), count):
        dev = copy.deepcopy(first)
        dev["index"] = index
        uuid = dev["nvmlDeviceGetUUID"]["ok"]
        dev["nvmlDeviceGetUUID"]["ok"] = f"{uuid[:-2]}{index:02x}"
        pci = dev["nvmlDeviceGetPciInfo"]["ok"]
        pci["device"] = 6 + index
        pci["busId"] = dev["busId_raw"] = f"00000000:00:{6 + index:02x}.0"
        pci["busIdLegacy"] = dev["sysfs_bdf"] = f"0000:00:{6 + index:02x}.0"
        scenario["devices"].append(dev)
    scenario["count"] = len(scenario["devices"])


def load(scenario: dict[str, Any] | None = None) -> None:
    """Start over with a scenario (default: GPUNET_FAKE_NVML's file, else the H200 capture)."""
    if scenario is None:
        path = os.environ.get("GPUNET_FAKE_NVML")
        scenario = json.loads(Path(path).read_text()) if path else h200x2()
    with _s.cond:
        _s.scenario = copy.deepcopy(scenario)
        _s.initialized = 0
        _s.generation += 1
        _s.calls.clear()
        _s.events.clear()
        _s.registered.clear()
        _s.events_file = os.environ.get("GPUNET_FAKE_NVML_EVENTS", "")
        _s.events_offset = 0
        _s.processes_file = os.environ.get("GPUNET_FAKE_NVML_PROCESSES", "")


def exporter_env(scenario: Path | None = None, events: Path | None = None,
                 processes: Path | None = None) -> dict[str, str]:
    """The environment an exporter subprocess needs to load this module as :data:`MODULE`:
    tests/ on PYTHONPATH, the scenario file (default: the H200 capture) and, when given, the XID
    event file and the processes file."""
    env = {"PYTHONPATH": str(TESTS)}
    if scenario is not None:
        env["GPUNET_FAKE_NVML"] = str(scenario)
    if events is not None:
        env["GPUNET_FAKE_NVML_EVENTS"] = str(events)
    if processes is not None:
        env["GPUNET_FAKE_NVML_PROCESSES"] = str(processes)
    return env


def calls(fn: str, index: int = -1) -> int:
    """How many times a function was called (for one GPU, or with no GPU when index is -1)."""
    return _s.calls[(fn, index)]


def device(index: int) -> dict[str, Any]:
    """The live scenario entry of a GPU, to change its answers between scrapes."""
    dev: dict[str, Any] = _s.scenario["devices"][index]
    return dev


def push_event(index: int, xid: int, event_type: int = 0x8) -> None:
    """Deliver an event (an XID by default) to event sets that registered the GPU."""
    with _s.cond:
        _s.events.append((index, event_type, xid))
        _s.cond.notify_all()


def reload_driver() -> None:
    """The driver went away and came back: old handles and the old initialisation are dead."""
    with _s.cond:
        _s.initialized = 0
        _s.generation += 1


# -- library ---------------------------------------------------------------------------------


def nvmlInit() -> None:
    _s.calls[("nvmlInit", -1)] += 1
    lib = _s.scenario.get("library")
    if lib == "missing":
        raise _error("NVMLError_LibraryNotFound")
    if lib == "no_driver":
        raise _error("NVMLError_DriverNotLoaded")
    _s.initialized += 1


def nvmlShutdown() -> None:
    _s.calls[("nvmlShutdown", -1)] += 1
    if not _s.initialized:
        raise _error("NVMLError_Uninitialized")
    _s.initialized -= 1


def _check_init() -> None:
    if not _s.initialized:
        raise _error("NVMLError_Uninitialized")


def nvmlSystemGetDriverVersion() -> str:
    _check_init()
    return str(_s.scenario["driver"]["ok"])


def nvmlDeviceGetCount() -> int:
    _check_init()
    _s.calls[("nvmlDeviceGetCount", -1)] += 1
    return len(_s.scenario["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    _check_init()
    if not 0 <= index < len(_s.scenario["devices"]):
        raise _error("NVMLError_InvalidArgument")
    if device(index).get("lost"):
        raise _error("NVMLError_GpuIsLost")
    return _Handle(index, _s.generation)


def _ns(value: Any) -> Any:
    return SimpleNamespace(**value) if isinstance(value, dict) else value


def _answer(entry: dict[str, Any]) -> Any:
    if "exc" in entry:
        raise _error(entry["exc"])
    return _ns(entry["ok"])


def _dev(h: _Handle, fn: str) -> dict[str, Any]:
    _check_init()
    if not isinstance(h, _Handle) or h.generation != _s.generation:
        raise _error("NVMLError_Uninitialized")
    _s.calls[(fn, h.index)] += 1
    dev = device(h.index)
    pause = dev.get("sleep", {}).get(fn)
    if pause:
        time.sleep(float(pause))
    if dev.get("lost"):
        raise _error("NVMLError_GpuIsLost")
    return dev


def _recorded(fn: str) -> Any:
    def call(h: _Handle) -> Any:
        dev = _dev(h, fn)
        if fn not in dev:
            raise _error("NVMLError_NotSupported")
        return _answer(dev[fn])
    call.__name__ = fn
    return call


nvmlDeviceGetName = _recorded("nvmlDeviceGetName")
nvmlDeviceGetUUID = _recorded("nvmlDeviceGetUUID")
nvmlDeviceGetPciInfo = _recorded("nvmlDeviceGetPciInfo")
nvmlDeviceGetNumaNodeId = _recorded("nvmlDeviceGetNumaNodeId")
nvmlDeviceGetUtilizationRates = _recorded("nvmlDeviceGetUtilizationRates")
_memory_v1 = _recorded("nvmlDeviceGetMemoryInfo")
_memory_v2 = _recorded("nvmlDeviceGetMemoryInfo_v2")


def nvmlDeviceGetMemoryInfo(h: _Handle, version: int | None = None) -> Any:
    """v1, or with ``version`` the v2 struct; a scenario without a recorded v2 answer behaves
    like a driver without nvmlDeviceGetMemoryInfo_v2 (the H200 capture recorded only v1)."""
    if not version:
        return _memory_v1(h)
    if "nvmlDeviceGetMemoryInfo_v2" not in _dev(h, "nvmlDeviceGetMemoryInfo"):
        raise _error("NVMLError_FunctionNotFound")
    return _memory_v2(h)
nvmlDeviceGetCurrPcieLinkGeneration = _recorded("nvmlDeviceGetCurrPcieLinkGeneration")
nvmlDeviceGetMaxPcieLinkGeneration = _recorded("nvmlDeviceGetMaxPcieLinkGeneration")
nvmlDeviceGetCurrPcieLinkWidth = _recorded("nvmlDeviceGetCurrPcieLinkWidth")
nvmlDeviceGetMaxPcieLinkWidth = _recorded("nvmlDeviceGetMaxPcieLinkWidth")


def _file_processes(index: int) -> list[int]:
    """The PIDs the processes file lists on GPU ``index`` now."""
    if not _s.processes_file:
        return []
    try:
        with open(_s.processes_file) as fh:
            text = fh.read()
    except FileNotFoundError:
        return []
    out = []
    for line in text[:text.rfind("\n") + 1].splitlines():
        if line.strip():
            gpu, pid = line.split()
            if int(gpu) == index:
                out.append(int(pid))
    return out


def _processes(pids: list[int]) -> list[Any]:
    return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in pids]


def nvmlDeviceGetComputeRunningProcesses(h: _Handle) -> list[Any]:
    dev = _dev(h, "nvmlDeviceGetComputeRunningProcesses")
    if "nvmlDeviceGetComputeRunningProcesses" in dev:
        return list(_answer(dev["nvmlDeviceGetComputeRunningProcesses"]))
    return _processes([*dev.get("processes", []), *_file_processes(h.index)])


def nvmlDeviceGetGraphicsRunningProcesses(h: _Handle) -> list[Any]:
    dev = _dev(h, "nvmlDeviceGetGraphicsRunningProcesses")
    if "nvmlDeviceGetGraphicsRunningProcesses" in dev:
        return list(_answer(dev["nvmlDeviceGetGraphicsRunningProcesses"]))
    return _processes(dev.get("graphics_processes", []))


def nvmlDeviceGetPcieThroughput(h: _Handle, counter: int) -> int:
    dev = _dev(h, "nvmlDeviceGetPcieThroughput")
    key = "pcie_tx_KBps" if counter == _real.NVML_PCIE_UTIL_TX_BYTES else "pcie_rx_KBps"
    if "nvmlDeviceGetPcieThroughput" in dev:
        return int(_answer(dev["nvmlDeviceGetPcieThroughput"]))
    return int(_answer(dev[key]))


_FIELD_NAMES: dict[int, list[str]] = {}
for _name in dir(_real):
    if _name.startswith("NVML_FI_") and isinstance(getattr(_real, _name), int):
        _FIELD_NAMES.setdefault(getattr(_real, _name), []).append(_name)


def nvmlDeviceGetFieldValues(h: _Handle, field_ids: list[Any]) -> list[Any]:
    dev = _dev(h, "nvmlDeviceGetFieldValues")
    if "nvmlDeviceGetFieldValues" in dev:
        _answer(dev["nvmlDeviceGetFieldValues"])
    recorded = dev.get("fieldValues", {})
    out = []
    for fid in field_ids:
        fid, scope = fid if isinstance(fid, tuple) else (fid, 0)
        entry = next((recorded[n] for n in _FIELD_NAMES.get(fid, []) if n in recorded),
                     {"nvmlReturn": _real.NVML_ERROR_NOT_SUPPORTED})
        v = entry.get("value", 0)
        value = SimpleNamespace(dVal=float(v), uiVal=v, ulVal=v, ullVal=v, sllVal=v, siVal=v,
                                usVal=v)
        out.append(SimpleNamespace(fieldId=fid, scopeId=scope, timestamp=0, latencyUsec=0,
                                   valueType=entry.get("valueType", 1),
                                   nvmlReturn=entry.get("nvmlReturn", 0), value=value))
    return out


FABRIC_FIXTURE = FIXTURE.parent / "fabric_h100x4.json"


def fabric_h100x4() -> list[dict[str, Any]]:
    """Per GPU, what nvmlDeviceGetGpuFabricInfoV answered with the v3 structure on 4 H100s."""
    gpus = json.loads(FABRIC_FIXTURE.read_text())["nvml"]["gpus"]
    return [g["fabric"]["nvmlDeviceGetGpuFabricInfoV/c_nvmlGpuFabricInfo_v3_t"]["value"]
            for g in gpus]


def nvmlDeviceGetGpuFabricInfoV(h: _Handle, ref: Any) -> int:
    """Fills the structure ``ref`` points to (ctypes.byref), as the real call does; a
    structure passed by value is refused (the real call would crash the process)."""
    dev = _dev(h, "nvmlDeviceGetGpuFabricInfoV")
    entry = dev.get("fabric")
    if entry is None:
        raise _error("NVMLError_FunctionNotFound")
    if "exc" in entry:
        _answer(entry)
    info = getattr(ref, "_obj", None)
    if info is None:
        raise TypeError("nvmlDeviceGetGpuFabricInfoV takes ctypes.byref(structure)")
    version = entry.get("version")
    if version is not None and getattr(info, "version", version) != version:
        raise _error("NVMLError_ArgumentVersionMismatch")
    for name, _ in info._fields_:
        if name == "version" or name not in entry:
            continue
        if name == "clusterUuid":
            raw = bytes.fromhex(entry[name])
            for i, b in enumerate(raw[:len(info.clusterUuid)]):
                info.clusterUuid[i] = b
        else:
            setattr(info, name, entry[name])
    return 0


def _link(h: _Handle, fn: str, link: int) -> dict[str, Any]:
    dev = _dev(h, fn)
    if fn in dev:
        _answer(dev[fn])
    if not 0 <= link < _real.NVML_NVLINK_MAX_LINKS:
        raise _error("NVMLError_InvalidArgument")
    nvlink = dev.get("nvlink")
    if not nvlink:
        raise _error("NVMLError_NotSupported")
    entry: dict[str, Any] = nvlink[str(link)]
    return entry


def nvmlDeviceGetNvLinkState(h: _Handle, link: int) -> int:
    return int(_answer(_link(h, "nvmlDeviceGetNvLinkState", link)["state"]))


_NVLINK_COUNTERS = {getattr(_real, n): n for n in dir(_real)
                    if n.startswith("NVML_NVLINK_ERROR_DL_") and "LANE" not in n
                    and "COUNT" not in n}


def nvmlDeviceGetNvLinkErrorCounter(h: _Handle, link: int, counter: int) -> int:
    entry = _link(h, "nvmlDeviceGetNvLinkErrorCounter", link)
    if "exc" in entry.get("state", {}):
        _answer(entry["state"])
    name = _NVLINK_COUNTERS.get(counter)
    if name is None or name not in entry:
        raise _error("NVMLError_InvalidArgument")
    return int(_answer(entry[name]))


# -- events ----------------------------------------------------------------------------------


def nvmlEventSetCreate() -> int:
    _check_init()
    es = len(_s.registered) + 1
    _s.registered[es] = set()
    return es


def nvmlDeviceRegisterEvents(h: _Handle, mask: int, es: int) -> None:
    dev = _dev(h, "nvmlDeviceRegisterEvents")
    if "nvmlDeviceRegisterEvents" in dev:
        _answer(dev["nvmlDeviceRegisterEvents"])
    if mask & _real.nvmlEventTypeXidCriticalError:
        _s.registered[es].add(h.index)


def _read_events_file() -> None:
    if not _s.events_file:
        return
    try:
        with open(_s.events_file) as fh:
            fh.seek(_s.events_offset)
            text = fh.read()
    except OSError:
        return
    complete = text[:text.rfind("\n") + 1]
    _s.events_offset += len(complete)
    for line in complete.splitlines():
        index, xid = line.split()
        _s.events.append((int(index), _real.nvmlEventTypeXidCriticalError, int(xid)))


def nvmlEventSetWait_v2(es: int, timeout_ms: int) -> Any:
    _check_init()
    deadline = time.monotonic() + timeout_ms / 1000
    with _s.cond:
        while True:
            _read_events_file()
            for i, (index, etype, data) in enumerate(_s.events):
                if index in _s.registered.get(es, ()):
                    del _s.events[i]
                    return SimpleNamespace(
                        device=_Handle(index, _s.generation), eventType=etype, eventData=data,
                        gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _error("NVMLError_Timeout")
            _s.cond.wait(min(left, 0.05))


def nvmlEventSetFree(es: int) -> None:
    _s.registered.pop(es, None)


load()
