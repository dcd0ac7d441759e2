"""The alerts, one module per class (common.CLASSES), each with the recording rules its alerts
read and, for the node-level alerts, the doctor's checks beside them. A new alert goes into the
module of its class (an alert of a simple shape declared once as a ``check.Simple``, which gives
both its PromQL and the doctor's check; otherwise its PromQL and, when the doctor can check it,
a hand-written check in the module's ``CHECKS``, or the reason it cannot in its ``UNCHECKED``);
its promtool test into alerts/tests/<class>.test.yml, its runbook into docs/runbooks.md.
"""

from __future__ import annotations

from types import ModuleType

from gpunet_exporter.mixin import check
from gpunet_exporter.mixin.alerts import (
    collective,
    congestion,
    exporter,
    fabric,
    gpu,
    link,
    topology,
    transport,
)
from gpunet_exporter.mixin.alerts.common import CLASSES, Alert, Rule
from gpunet_exporter.mixin.check import DoctorCheck
from gpunet_exporter.mixin.thresholds import Thresholds

# In the order of CLASSES: the rule file lists the alerts class by class.
MODULES: tuple[ModuleType, ...] = (link, congestion, transport, topology, gpu, collective,
                                   fabric, exporter)
assert tuple(m.__name__.rpartition(".")[2] for m in MODULES) == CLASSES

ALERTS: tuple[Alert, ...] = tuple(a for m in MODULES for a in m.ALERTS)
assert all(a.cls == m.__name__.rpartition(".")[2] for m in MODULES for a in m.ALERTS)
ALERT_NAMES = tuple(a.name for a in ALERTS)
check.SEVERITY.update((a.name, a.severity) for a in ALERTS)

# The order in which the doctor runs the classes' check steps (each module's CHECKS), which is
# the order of its --json findings (slurm/gpunet-healthcheck drains with the first): kept as it
# was when the checks lived in the doctor. Steps not named here run after these, class by class.
DOCTOR_ORDER: tuple[tuple[ModuleType, str], ...] = (
    (transport, "transport"), (transport, "job_rdma_idle"), (link, "links"),
    (congestion, "pfc"), (link, "mtu"), (topology, "placement"), (gpu, "gpus"),
    (collective, "collectives"), (link, "phy"), (transport, "retransmissions"),
    (gpu, "utilization"), (link, "flap_history"), (link, "inventory"), (collective, "nccl_jobs"))


def _steps() -> list[tuple[ModuleType, str]]:
    every = [(m, step) for m in MODULES for step in getattr(m, "CHECKS", {})]
    named = [s for s in DOCTOR_ORDER if s in every]
    return named + [s for s in every if s not in named]


# The doctor's checks in the order it runs them.
DOCTOR_CHECKS: tuple[DoctorCheck, ...] = tuple(
    fn for m, step in _steps() for fn in m.CHECKS[step])


def checked() -> dict[str, list[DoctorCheck]]:
    """Alert -> the doctor's checks that report it."""
    out: dict[str, list[DoctorCheck]] = {}
    for fn in DOCTOR_CHECKS:
        for name in getattr(fn, "alerts", ()):
            out.setdefault(name, []).append(fn)
    return out


def unchecked() -> dict[str, str]:
    """Alert -> why the doctor cannot check it."""
    return {name: why for m in MODULES for name, why in getattr(m, "UNCHECKED", {}).items()}


def recording(t: Thresholds) -> list[Rule]:
    """Every class's recording rules of the node rules' group, class by class."""
    return [r for m in MODULES if hasattr(m, "recording") for r in m.recording(t)]

