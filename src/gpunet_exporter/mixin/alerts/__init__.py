"""The alerts, one module per class (common.CLASSES), each with the recording rules its alerts
read beside them. A new alert goes into the module of its class; its promtool test into
alerts/tests/<class>.test.yml, its runbook into docs/runbooks.md.

One exception keeps the rule file as it was: the pair plan's alerts live together in
``collective`` beside the recording rules they read, two of them labelled with the class the
health matrix shows them in (GpunetFleetLinkSlow ``link``, GpunetFleetCrossLeafSlow
``topology``).
"""

from __future__ import annotations

from types import ModuleType

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
from gpunet_exporter.mixin.thresholds import Thresholds

# In the order of CLASSES: the rule file lists the alerts class by class.
MODULES: tuple[ModuleType, ...] = (link, congestion, transport, topology, gpu, collective,
                                   fabric, exporter)
assert tuple(m.__name__.rpartition(".")[2] for m in MODULES) == CLASSES

ALERTS: tuple[Alert, ...] = tuple(a for m in MODULES for a in m.ALERTS)
assert all(a.cls == m.__name__.rpartition(".")[2] or m is collective
           for m in MODULES for a in m.ALERTS)
ALERT_NAMES = tuple(a.name for a in ALERTS)


def recording(t: Thresholds) -> list[Rule]:
    """Every class's recording rules, class by class."""
    return [r for m in MODULES if hasattr(m, "recording") for r in m.recording(t)]
