"""What every class of alerts shares: the Alert declaration, the classes and severities, the
health matrix's recording rule, and the pieces of PromQL and of descriptions that several
classes use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpunet_exporter.mixin.check import Simple, number
from gpunet_exporter.mixin.thresholds import SEVERITIES, Thresholds

__all__ = ["ALERTS_FIRING", "CLASSES", "SEVERITIES", "Alert", "Rule", "number", "simple"]

# The problem classes, one module each in this package, in the order the rule file lists their
# alerts and the fleet dashboard's health matrix shows them.
CLASSES = ("link", "congestion", "transport", "topology", "gpu", "collective", "fabric",
           "exporter")

# Per node and class, the alerts firing now (0 for a node scraped with none): the health matrix.
ALERTS_FIRING = "instance_class:gpunet_alerts_firing:count"

Rule = dict[str, Any]  # a recording rule as the rule file writes it: record, expr (, labels)

# Label sets used to join series of one interface.
ROCE_INTERFACE = 'gpunet_link_info{link_layer="Ethernet"}'


@dataclass(frozen=True)
class Alert:
    name: str
    cls: str
    severity: str
    for_: str
    expr: Callable[[Thresholds], str]
    summary: str
    description: str
    # The doctor's check when the alert has a simple shape (expr is then derived from it).
    check: Simple | None = None

    def __post_init__(self) -> None:
        assert self.cls in CLASSES and self.severity in SEVERITIES, self.name


def simple(name: str, cls: str, severity: str, for_: str, check: Simple, summary: str,
           description: str) -> Alert:
    """An alert of a simple shape: its PromQL and the doctor's check both from ``check``."""
    assert check.alert == name, name
    return Alert(name, cls, severity, for_, check.promql, summary, description, check)


# Where an alert is, as its description names it.
NODE = "on {{ $labels.instance }}"
PORT = "{{ $labels.device }} port {{ $labels.port }} " + NODE
IF = "{{ $labels.interface }} " + NODE
GPU = "GPU {{ $labels.gpu }} " + NODE
SCOPE = "({{ $labels.scope }} probe) " + NODE
