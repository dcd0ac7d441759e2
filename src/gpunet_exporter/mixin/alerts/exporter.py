"""The exporter alerts."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import NODE, Alert

ALERTS: tuple[Alert, ...] = (
    Alert("GpunetCollectorFailing", "exporter", "warning", "10m",
          lambda t: "gpunet_scrape_collector_success == 0",
          "Exporter collector failing",
          f"Collector {{{{ $labels.collector }}}} fails {NODE}: its metrics are missing."),
    Alert("GpunetExporterDown", "exporter", "warning", "5m",
          lambda t: f'up{{job="{t.job}"}} == 0',
          "gpunet-exporter target down",
          f"Prometheus cannot scrape gpunet-exporter {NODE}: no network or GPU health data "
          "from this node."),
)
# Alerts the doctor cannot check, and why.
UNCHECKED: dict[str, str] = {
    "GpunetCollectorFailing": "the doctor runs the collectors itself: a failed one is a "
                              "problem of its report (exit code 2), not a finding",
    "GpunetExporterDown": "the exporter service's scrape; the doctor serves nothing",
}
