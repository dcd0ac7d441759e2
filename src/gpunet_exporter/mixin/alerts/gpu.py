"""The gpu alerts."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import GPU, NODE, Alert
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.thresholds import Thresholds


def _xid(t: Thresholds, critical: bool) -> str:
    """XID counts that rose in the last 10 minutes. A (GPU, XID) series appears with its first
    event, already at 1, where increase() sees nothing; so a series absent 10 minutes ago counts
    too, when the GPU's last XID is that recent (not after a Prometheus restart)."""
    codes = "|".join(str(c) for c in sorted(set(t.gpu.critical_xids)))
    sel = f'gpunet_gpu_xid_errors_total{{xid{"=~" if critical else "!~"}"{codes}"}}'
    return (f"(\n  increase({sel}[10m]) > 0\n  or\n  ({sel} unless {sel} offset 10m)\n)\n"
            "and on (instance, gpu) (time() - gpunet_gpu_xid_last_timestamp_seconds < 600)")


def _network_bound(t: Thresholds) -> str:
    """Share of the node's GPUs with compute processes whose utilization, averaged over the
    window, lies in [busy_utilization_ratio, network_bound_utilization_ratio): above "starved",
    below a compute-bound GPU. Per node: the ranks of a job on one node wait together."""
    g = t.gpu
    avg = f"avg_over_time(gpunet_gpu_utilization_ratio[{g.network_bound_window}])"
    busy = "gpunet_gpu_compute_processes > 0"
    return (f"(\n  count by (instance, job) (\n    ({avg} >= {_g(g.busy_utilization_ratio)})"
            f" < {_g(g.network_bound_utilization_ratio)}\n"
            f"    and on (instance, gpu) {busy}\n  )\n"
            f"  / on (instance, job)\n  count by (instance, job) ({busy})\n)"
            f" >= {_g(g.network_bound_gpu_share)}")


ALERTS: tuple[Alert, ...] = (
    Alert("GpunetGpuPcieLinkDegraded", "gpu", "warning", "10m",
          lambda t: "gpunet_gpu_pcie_link_degraded == 1",
          "GPU PCIe link below its maximum",
          f"{GPU} runs its PCIe link below its maximum generation or width while busy."),
    Alert("GpunetGpuPcieReplays", "gpu", "warning", "10m",
          lambda t: ("rate(gpunet_gpu_pcie_replays_total[5m]) * 60 > "
                     f"{_g(t.gpu.pcie_replays_per_minute)}"),
          "GPU PCIe link replaying packets",
          f"{GPU} replays {{{{ $value | humanize }}}} PCIe packets per minute: the link is "
          "unreliable."),
    Alert("GpunetGpuXidErrors", "gpu", "warning", "0m",
          lambda t: _xid(t, critical=False),
          "GPU reported XID errors",
          f"{GPU} reported XID {{{{ $labels.xid }}}} in the last 10 minutes ({{{{ $value | "
          "printf \"%.0f\" }} in that time or since the exporter started)."),
    Alert("GpunetGpuXidCritical", "gpu", "critical", "0m",
          lambda t: _xid(t, critical=True),
          "GPU reported a critical XID error",
          f"{GPU} reported XID {{{{ $labels.xid }}}} in the last 10 minutes ({{{{ $value | "
          "printf \"%.0f\" }} in that time or since the exporter started); it needs a reset or "
          "the node a drain."),
    Alert("GpunetGpuLost", "gpu", "critical", "0m",
          lambda t: "gpunet_gpu_lost == 1",
          "GPU lost",
          f"{GPU} has fallen off the bus (NVML: GPU is lost)."),
    Alert("GpunetGpuMissing", "gpu", "critical", "5m",
          lambda t: "gpunet_gpu_missing > 0",
          "GPUs no longer enumerated",
          f"{{{{ $value }}}} GPUs that NVML enumerated earlier {NODE} are gone."),
    Alert("GpunetGpuStarved", "gpu", "warning", "30m",
          lambda t: ("avg_over_time(gpunet_gpu_utilization_ratio[10m]) < "
                     f"{_g(t.gpu.busy_utilization_ratio)}\n"
                     "  and on (instance, gpu) gpunet_gpu_compute_processes > 0"),
          "GPU under-utilized while compute processes run",
          f"{GPU} is busy only {{{{ $value | humanizePercentage }}}} of the time while "
          "compute processes run on it: it is waiting, often on the network."),
    Alert("GpunetGpusNetworkBoundBand", "gpu", "info", "15m", _network_bound,
          "GPUs in the utilization band of network-bound training",
          f"{{{{ $value | humanizePercentage }}}} of the GPUs running compute processes {NODE} "
          "have been busy, on average, more than starved GPUs but less than compute-bound ones: "
          "the band of training that waits on its collectives."),
    Alert("GpunetNvmlDown", "gpu", "warning", "5m",
          lambda t: "gpunet_gpu_nvml_up == 0",
          "NVML not answering",
          f"NVML fails {NODE}: no GPU metrics (driver reloading, failing or mismatched)."),
)
