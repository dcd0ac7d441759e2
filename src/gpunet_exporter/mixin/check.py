"""What the doctor's checks read and write: two snapshots of the collectors, the thresholds,
findings and notes; and ``Simple``, the declaration of an alert of a simple shape (one metric,
a gauge or the rate of a counter, compared with a threshold per device, port, interface or GPU)
from which both the alert's PromQL and the doctor's check are derived.

The checks sit beside the alerts they mirror, in the class modules of mixin/alerts (each
module's ``CHECKS``); ``gpunet-exporter doctor`` (health/doctor.py) takes the snapshots, runs
them and reports. This module sits on the mixin floor, below health.
"""

from __future__ import annotations

import operator
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from gpunet_exporter.mixin.thresholds import Thresholds

Labels = dict[str, str]

# Root causes, in the order the report lists them, in the operator's words.
CAUSES = {
    "nccl_tcp": "NCCL on TCP sockets",
    "gdr_off": "GPUDirect RDMA off",
    "link": "Degraded or flapping link",
    "nic_health": "Transceiver or NIC firmware health",
    "pfc": "PFC or ECN misconfigured, or congestion",
    "retransmit": "Packet loss: RDMA retransmissions",
    "mtu": "MTU",
    "numa": "GPU and NIC placement (NUMA, ACS)",
    "gpu_pcie": "Degraded GPU PCIe link",
    "gpu": "GPU faults",
    "collective": "Slow collectives or a straggler",
    "gpu_wait": "GPUs waiting (starved, or in the network-bound band)",
    "inventory": "RDMA devices, ports or netdevs gone",
    "unknown": "Checks that could not run (not checked: no effect on exit code 1, but 2)",
    "nccl_job": "NCCL jobs running now (NCCL's RAS service; the job's, not the node's: no "
                "effect on the exit code)",
}
# Alert -> severity, filled by mixin.alerts from its declarations (this module sits below it).
SEVERITY: dict[str, str] = {}


@dataclass(frozen=True)
class Finding:
    cause: str  # a key of CAUSES
    alert: str  # the alert of alerts/gpunet.rules.yml that fires on the same condition
    where: str  # the device, port, interface or GPU
    message: str
    confirm: str  # a command that shows it

    @property
    def severity(self) -> str:
        return SEVERITY[self.alert]


@dataclass(frozen=True)
class Note:
    """What the doctor reports without judging it a fault: no alert fires on it and it never
    changes the exit code (an NCCL setting such as NCCL_SOCKET_IFNAME on the management network,
    flaps it cannot place in an alert's window, a state file it cannot use)."""
    where: str
    message: str


class Snapshot:
    """One collection: sample name -> [(labels, value)]."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.time = time.time()
        self.samples: dict[str, list[tuple[Labels, float]]] = {}
        for family in families:
            for s in family.samples:
                self.samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))

    def all(self, name: str, **match: str) -> Iterator[tuple[Labels, float]]:
        for labels, v in self.samples.get(name, []):
            if all(labels.get(k) == want for k, want in match.items()):
                yield labels, v

    def get(self, name: str, **match: str) -> float | None:
        return next((v for _, v in self.all(name, **match)), None)


class Check:
    """The two snapshots and the thresholds the checks read."""

    def __init__(self, a: Snapshot, b: Snapshot, t: Thresholds) -> None:
        self.a, self.b, self.t = a, b, t
        self.dt = max(b.time - a.time, 1e-3)
        self.findings: list[Finding] = []
        # What earlier doctor runs saw (the state file), and what is worth knowing but no
        # finding: no alert, no effect on the exit code.
        self.history: dict[str, Any] = {}
        self.notes: list[Note] = []
        self.problems: list[str] = []  # what the checks could not judge

    def rate(self, name: str) -> Iterator[tuple[Labels, float]]:
        """Per-second increase of a counter between the snapshots (series in both)."""
        before = {tuple(sorted(lbl.items())): v for lbl, v in self.a.all(name)}
        for labels, v in self.b.all(name):
            old = before.get(tuple(sorted(labels.items())))
            if old is not None and v >= old:
                yield labels, (v - old) / self.dt

    def add(self, cause: str, alert: str, where: str, message: str, confirm: str) -> None:
        self.findings.append(Finding(cause, alert, where, message, confirm))

    def active_rdma_port(self) -> bool:
        return any(v == 4 for _, v in self.b.all("gpunet_infiniband_port_state_id"))

    def working_gpus(self) -> dict[str, float]:
        """GPU -> its utilization, the mean of the two readings, for each GPU that runs compute
        processes (the GPUs the starved and band alerts judge)."""
        before = {lbl.get("gpu"): v for lbl, v in self.a.all("gpunet_gpu_utilization_ratio")}
        out = {}
        for lbl, v in self.b.all("gpunet_gpu_utilization_ratio"):
            gpu = lbl.get("gpu", "")
            if (self.b.get("gpunet_gpu_compute_processes", gpu=gpu) or 0) > 0:
                out[gpu] = (v + before.get(gpu, v)) / 2
        return out

    def roce_interfaces(self) -> set[str]:
        return {lbl["interface"] for lbl, _ in self.b.all("gpunet_link_info")
                if lbl.get("link_layer") == "Ethernet"}


DoctorCheck = Callable[[Check], None]


def checks(*alerts: str) -> Callable[[DoctorCheck], DoctorCheck]:
    """Marks a hand-written doctor check with the alerts it mirrors (the test that every
    node-level alert has a check reads them)."""
    def mark(fn: DoctorCheck) -> DoctorCheck:
        fn.alerts = alerts  # type: ignore[attr-defined]
        return fn
    return mark


def port(lbl: Labels) -> str:
    """Where the report says an RDMA port is."""
    return f"{lbl.get('device')} port {lbl.get('port')}"


_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> float:
    """A Prometheus duration (thresholds has checked its syntax) in seconds."""
    return sum(float(n) * _UNIT[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))


def number(v: float) -> str:
    """A number as PromQL and humans read it (no exponent for ordinary sizes)."""
    return f"{v:.15g}" if abs(v) < 1e15 else repr(float(v))


_OPS: dict[str, Callable[[float, float], bool]] = {
    ">": operator.gt, "<": operator.lt, ">=": operator.ge, "<=": operator.le,
    "==": operator.eq, "!=": operator.ne}


@dataclass(frozen=True)
class Simple:
    """An alert of a simple shape, declared once: ``metric`` (a gauge; with ``window``, the
    ``rate`` or ``increase`` of a counter over it, the rate scaled by ``per``) compared by ``op``
    with ``threshold`` (a thresholds attribute such as ``"infiniband.receive_errors_per_second"``,
    or a constant). ``promql`` gives the alert's expression; calling it with a Check is the
    doctor's check, on the value of the second snapshot or the rate between the two (an
    increase over the window is the rate times the window). Each series that passes is a
    finding of ``cause`` at ``where(labels)``, saying ``message(check, labels, value, limit)``,
    confirmed by ``confirm(labels)``."""
    alert: str
    metric: str
    op: str
    threshold: str | float
    cause: str
    where: Callable[[Labels], str]
    message: Callable[[Check, Labels, float, float], str]
    confirm: Callable[[Labels], str]
    window: str = ""
    increase: bool = False  # increase(metric[window]), not rate(metric[window])
    per: float = 1  # rate(...) * per

    def __post_init__(self) -> None:
        assert self.op in _OPS and self.cause in CAUSES, self.alert
        assert not (self.increase and self.per != 1), self.alert

    @property
    def alerts(self) -> tuple[str, ...]:
        return (self.alert,)

    def limit(self, t: Thresholds) -> float:
        if isinstance(self.threshold, str):
            section, _, key = self.threshold.partition(".")
            return float(getattr(getattr(t, section), key))
        return self.threshold

    def promql(self, t: Thresholds) -> str:
        if not self.window:
            left = self.metric
        elif self.increase:
            left = f"increase({self.metric}[{self.window}])"
        else:
            left = f"rate({self.metric}[{self.window}])" + (
                f" * {number(self.per)}" if self.per != 1 else "")
        return f"{left} {self.op} {number(self.limit(t))}"

    def values(self, c: Check) -> Iterator[tuple[Labels, float]]:
        """Each series' value as the alert compares it, from the doctor's two readings."""
        if not self.window:
            yield from c.b.all(self.metric)
            return
        per = seconds(self.window) if self.increase else self.per
        for lbl, r in c.rate(self.metric):
            yield lbl, r * per

    def __call__(self, c: Check) -> None:
        limit, cmp = self.limit(c.t), _OPS[self.op]
        for lbl, v in self.values(c):
            if cmp(v, limit):
                c.add(self.cause, self.alert, self.where(lbl), self.message(c, lbl, v, limit),
                      self.confirm(lbl))
