"""The exporter alerts."""

from __future__ import annotations

from gpunet_exporter.collector import UNKNOWN_REASONS
from gpunet_exporter.mixin.alerts.common import NODE, Alert
from gpunet_exporter.mixin.check import Check, DoctorCheck, checks

# What shows why a check cannot run, by check (gpunet_check_unknown's check label).
CONFIRM = {"nvml": "nvidia-smi  # fails as NVML does when its library or driver is missing",
           "ib_mtu": "ibv_devinfo | grep -E 'hca_id|active_mtu'",
           "allreduce": "python3 -c 'import torch'  # with the Python that runs gpunet-probe",
           "sweep": "command -v ibnetdiscover iblinkinfo ibqueryerrors dump_fts",
           "pfc_config": "command -v mlnx_qos dcb  # then: mlnx_qos -i IF, or dcb pfc show dev IF",
           "acs": "sudo lspci -vvv | grep -E 'ACSCtl' | grep -cE 'ReqRedir\\+|CmpltRedir\\+'",
           "nccl_env": "systemctl show gpunet-exporter -p AmbientCapabilities",
           "transceiver": "sudo ethtool -m IF  # IF: a RoCE netdev",
           "health_reporters": "devlink health show  # in the exporter's network namespace"}


@checks("GpunetCheckUnknown")
def check_unknown(c: Check) -> None:
    """Said as a finding and as a problem: something the node's hardware calls for was not
    checked (exit code 2)."""
    for lbl, v in c.b.all("gpunet_check_unknown"):
        if v != 1:
            continue
        check, reason = lbl["check"], lbl["reason"]
        why = UNKNOWN_REASONS.get(reason, reason)
        c.add("unknown", "GpunetCheckUnknown", f"{lbl['collector']} {check}",
              f"not checked: {why}", CONFIRM.get(check, "journalctl -u gpunet-exporter"))
        c.problems.append(f"{lbl['collector']}: {check} not checked: {why}")


ALERTS: tuple[Alert, ...] = (
    Alert("GpunetCollectorFailing", "exporter", "warning", "10m",
          lambda t: "gpunet_scrape_collector_success == 0",
          "Exporter collector failing",
          f"Collector {{{{ $labels.collector }}}} fails {NODE}: its metrics are missing."),
    Alert("GpunetCheckUnknown", "exporter", "warning", "15m",
          lambda t: "gpunet_check_unknown == 1",
          "A check cannot run",
          "The {{ $labels.collector }} collector cannot run its {{ $labels.check }} check "
          f"{NODE} ({{{{ $labels.reason }}}}): what it watches is not checked."),
    Alert("GpunetExporterDown", "exporter", "warning", "5m",
          lambda t: f'up{{job="{t.job}"}} == 0',
          "gpunet-exporter target down",
          f"Prometheus cannot scrape gpunet-exporter {NODE}: no network or GPU health data "
          "from this node."),
)
# The doctor's checks, in steps (mixin.alerts.DOCTOR_ORDER).
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {"unknown": (check_unknown,)}

# Alerts the doctor cannot check, and why.
UNCHECKED: dict[str, str] = {
    "GpunetCollectorFailing": "the doctor runs the collectors itself: a failed one is a "
                              "problem of its report (exit code 2), not a finding",
    "GpunetExporterDown": "the exporter service's scrape; the doctor serves nothing",
}
