"""Whether the node's GPUs are free for the probe (issue 31): no compute or graphics process on
any GPU but the probe's own, now and for a hold-off window before now.

NVML lists processes by host PID; a process is the probe's own when its session is one the
exporter (or the fleet pair end) started (``own_sessions``), and one that cannot be found or read
is foreign. How PIDs are mapped through ``--path.procfs``: docs/probe.md, "Idle only". No torch
here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from gpunet_exporter.sources import nvml
from gpunet_exporter.sources.proc import parse_starttime
from gpunet_exporter.sources.sysfs import Root, parse_uint

# The probe's states, exported as gpunet_probe_state{state}: one home for their names.
MEASURING = "measuring"  # idle past the hold-off: rounds run
FAILING = "failing"  # idle past the hold-off, but the last attempt failed
HOLDOFF = "holdoff"  # no foreign process now, but one within the hold-off window
YIELDED = "yielded"  # a foreign process is on a GPU: the probe holds nothing there
UNKNOWN = "unknown"  # the GPUs' processes cannot be read (no NVML): no rounds
STATES = (MEASURING, FAILING, HOLDOFF, YIELDED, UNKNOWN)


def gpu_pids(session: nvml.Session) -> set[int] | None:
    """PIDs of every compute and graphics process on any of the node's GPUs; None when NVML
    cannot say (not initialised, or a GPU's list cannot be read: then nothing is known)."""
    gpus, nv = session.gpus(), session.nv
    if gpus is None or nv is None:
        return None
    pids: set[int] = set()
    for g in gpus:
        if g.handle is None:
            continue  # lost when enumerated: no job runs there (GpunetGpuLost says so)
        for fn in ("nvmlDeviceGetComputeRunningProcesses",
                   "nvmlDeviceGetGraphicsRunningProcesses"):
            call = getattr(nv, fn, None)
            if call is None:
                continue  # an nvidia-ml-py without it
            try:
                pids.update(int(p.pid) for p in call(g.handle))
            except nv.NVMLError as exc:
                # A GPU lost since: no job runs there (GpunetGpuLost). Any other error: the
                # GPU's processes are unknown, and so is whether the node is idle.
                if nvml.error_name(exc) in ("NVMLError_NotSupported", "NVMLError_GpuIsLost"):
                    continue
                return None
    return pids


def _stat(root: Root | None, pid: int) -> str:
    if root is None:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    return root.read(f"{pid}/stat")


def local_pid(procfs: Root, pid: int) -> int | None:
    """The PID of host process ``pid`` in this process's PID namespace, or None when it is not
    visible here (another container's process) or cannot be read."""
    try:
        status = procfs.read(f"{pid}/status")
        start = parse_starttime(_stat(procfs, pid))
    except OSError:
        return None
    here = pid
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            last = parse_uint(line.split()[-1]) if line.split()[1:] else None
            here = last if last is not None else pid
    if procfs.root == "/proc" and here == pid:
        return pid
    try:  # the same process here? (the innermost NSpid may be another namespace's)
        return here if parse_starttime(_stat(None, here)) == start else None
    except OSError:
        return None


PROBE_MODULE = "gpunet_exporter.probe.cli"  # every runner and worker runs it: python -m ...


def is_probe(procfs: Root, pid: int) -> bool:
    """Whether ``pid`` is a gpunet-probe runner or worker (of any exporter or doctor)."""
    try:
        argv = procfs.read(f"{pid}/cmdline").split("\0")
    except OSError:
        return False
    return PROBE_MODULE in argv or any(a.endswith("/gpunet-probe") for a in argv[:2])


def foreign(pids: Iterable[int], procfs: Root, own_sessions: Collection[int],
            known_own: set[int], probes_are_own: bool = False) -> set[int]:
    """The PIDs that are not the probe's. ``known_own`` remembers own PIDs seen alive, so that
    the driver's last listing of a probe process that just died does not count as a job; it is
    trimmed to the PIDs still listed. ``probes_are_own``: another gpunet-probe (the exporter's,
    beside a one-off doctor round) is no job to wait for; that exporter yields to this one."""
    out: set[int] = set()
    listed = set(pids)
    known_own &= listed
    for pid in listed:
        if pid in known_own:
            continue
        here = local_pid(procfs, pid)
        sid = -1
        if here is not None:
            with contextlib.suppress(OSError):
                sid = os.getsid(here)
        if sid in own_sessions:
            known_own.add(pid)
        elif probes_are_own and is_probe(procfs, pid):
            continue
        else:
            out.add(pid)
    return out


def foreign_on_gpus(session: nvml.Session, procfs: Root, own_sessions: Collection[int],
                    known_own: set[int], backend: str, probes_are_own: bool = False
                    ) -> set[int] | None:
    """The foreign processes on the node's GPUs (gpu_pids, then foreign); None when NVML
    cannot say. With gloo on a node without NVIDIA's library there is no GPU to protect:
    none."""
    pids = gpu_pids(session)
    if pids is None:
        return set() if backend == "gloo" and session.state == "absent" else None
    return foreign(pids, procfs, own_sessions, known_own, probes_are_own)


@dataclass
class Gate:
    """The hold-off: the node is idle for the probe once no foreign process has been seen for
    ``holdoff`` seconds. Times are ``time.time()`` values (they are exported); ``clock`` is the
    test hook."""

    holdoff: float
    clock: Callable[[], float] = field(default=time.time)
    started: float = 0.0  # when watching began: the hold-off counts from here too
    last_foreign: float | None = None  # the last time a foreign process was seen
    foreign: frozenset[int] = frozenset()  # those seen at the last observation

    def __post_init__(self) -> None:
        self.started = self.clock()

    def observe(self, pids: Collection[int] | None) -> str:
        """Record one look at the foreign PIDs (None: cannot tell); the state it leaves: idle
        (MEASURING), HOLDOFF, YIELDED or UNKNOWN."""
        now = self.clock()
        if pids is None:
            self.foreign = frozenset()
            return UNKNOWN
        self.foreign = frozenset(pids)
        if pids:
            self.last_foreign = now
            return YIELDED
        return MEASURING if now >= self.idle_at() else HOLDOFF

    def idle_at(self) -> float:
        """When the hold-off ends (or ended): the last foreign process, or the start, plus the
        hold-off."""
        return max(self.started, self.last_foreign or 0.0) + self.holdoff


def describe(pids: Collection[int], procfs: Root) -> str:
    """A short text naming up to three foreign processes, for logs."""
    names = []
    for pid in sorted(pids)[:3]:
        comm: Any = "?"
        with contextlib.suppress(OSError):
            comm = procfs.read(f"{pid}/comm")
        names.append(f"{pid} ({comm})")
    more = f" and {len(pids) - 3} more" if len(pids) > 3 else ""
    return ", ".join(names) + more
