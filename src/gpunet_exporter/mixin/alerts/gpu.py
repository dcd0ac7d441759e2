"""The gpu alerts, and the doctor's checks of them."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import GPU, NODE, Alert, simple
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.check import Check, DoctorCheck, Labels, Simple, checks
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


@checks("GpunetGpuPcieLinkDegraded")
def check_pcie_link(c: Check) -> None:
    b = c.b
    for lbl, v in b.all("gpunet_gpu_pcie_link_degraded"):
        if v == 1:
            gen = b.get("gpunet_gpu_pcie_link_generation", **lbl)
            width = b.get("gpunet_gpu_pcie_link_width", **lbl)
            gmax = b.get("gpunet_gpu_pcie_link_max_generation", **lbl)
            wmax = b.get("gpunet_gpu_pcie_link_max_width", **lbl)
            c.add("gpu_pcie", "GpunetGpuPcieLinkDegraded", f"GPU {lbl['gpu']}",
                  f"PCIe Gen{gen or 0:.0f} x{width or 0:.0f}, capable of Gen{gmax or 0:.0f} "
                  f"x{wmax or 0:.0f}", f"nvidia-smi -q -d PCIE -i {lbl['gpu']}")


def _gpu(lbl: Labels) -> str:
    return f"GPU {lbl['gpu']}"


def _node(lbl: Labels) -> str:
    return "node"


# Alerts of a simple shape: the PromQL and the doctor's check from one declaration.
PCIE_REPLAYS = Simple(
    "GpunetGpuPcieReplays", "gpunet_gpu_pcie_replays_total", ">", "gpu.pcie_replays_per_minute",
    "gpu_pcie", _gpu, lambda c, lbl, v, limit: f"{v:.3g} PCIe replays per minute",
    lambda lbl: f"nvidia-smi -q -d PCIE -i {lbl['gpu']}", window="5m", per=60)
LOST = Simple(
    "GpunetGpuLost", "gpunet_gpu_lost", "==", 1, "gpu", _gpu,
    lambda c, lbl, v, limit: "fallen off the bus (GPU is lost)",
    lambda lbl: "nvidia-smi; dmesg | grep -i -E 'xid|fallen off'")
MISSING = Simple(
    "GpunetGpuMissing", "gpunet_gpu_missing", ">", 0, "gpu", _node,
    lambda c, lbl, v, limit: f"{v:.0f} GPUs no longer enumerated",
    lambda lbl: "nvidia-smi -L; lspci -d 10de:")
NVML_DOWN = Simple(
    "GpunetNvmlDown", "gpunet_gpu_nvml_up", "==", 0, "gpu", _node,
    lambda c, lbl, v, limit: "NVML fails", lambda lbl: "nvidia-smi")


@checks("GpunetGpuXidErrors", "GpunetGpuXidCritical")
def check_xids(c: Check) -> None:
    """An XID in the last 10 minutes, critical or not by gpu.critical_xids (the doctor sees the
    GPU's last XID; the alerts count each XID's events)."""
    b = c.b
    critical = set(c.t.gpu.critical_xids)
    for lbl, when in b.all("gpunet_gpu_xid_last_timestamp_seconds"):
        if b.time - when < 600:
            code = b.get("gpunet_gpu_xid_last_code", gpu=lbl["gpu"]) or 0
            alert = "GpunetGpuXidCritical" if int(code) in critical else "GpunetGpuXidErrors"
            c.add("gpu", alert, f"GPU {lbl['gpu']}",
                  f"XID {code:.0f} {b.time - when:.0f} s ago", "dmesg | grep -i xid")


@checks("GpunetGpuStarved", "GpunetGpusNetworkBoundBand")
def check_gpu_utilization(c: Check) -> None:
    """GpunetGpuStarved and GpunetGpusNetworkBoundBand on the check's own readings: the mean of
    the two snapshots' utilization, where the alerts average 10 or 30 minutes."""
    t = c.t.gpu
    lo, hi = t.busy_utilization_ratio, t.network_bound_utilization_ratio
    working = c.working_gpus()
    busy, in_band = len(working), 0
    for gpu, util in working.items():
        if util < lo:
            c.add("gpu_wait", "GpunetGpuStarved", f"GPU {gpu}",
                  f"busy only {util:.0%} of the time while compute processes run on it "
                  f"(limit {lo:.0%}; read over the check's {c.dt:.3g} s, the alert averages "
                  "10 minutes)", f"nvidia-smi dmon -s u -c 10 -i {gpu}")
        elif util < hi:
            in_band += 1
    if busy and in_band / busy >= t.network_bound_gpu_share:
        c.add("gpu_wait", "GpunetGpusNetworkBoundBand", "node",
              f"{in_band} of {busy} GPUs running compute processes are {lo:.0%} to {hi:.0%} "
              "busy, the band of training that waits on its collectives (read over the "
              f"check's {c.dt:.3g} s; the alert averages {t.network_bound_window})",
              "nvidia-smi dmon -s u -c 30  # and the job's other nodes")


# GPUs whose NVLink fabric registration has not finished, or finished with an error (the
# status is read only once the state is completed).
FABRIC_NOT_READY = ('gpunet_gpu_fabric_state{state=~"not_started|in_progress"} == 1\n'
                    "or on (instance, job, gpu)\n"
                    "gpunet_gpu_fabric_status_code != 0")
FABRIC_UNHEALTHY = ("max by (instance, job, gpu) (gpunet_gpu_fabric_health == 1)\n"
                    "or on (instance, job, gpu)\n"
                    'max by (instance, job, gpu) (gpunet_gpu_fabric_health_summary'
                    '{summary!="healthy"} == 1)')
FABRIC_CONFIRM = "nvidia-smi -q -i {gpu} | sed -n '/Fabric/,/^    [A-Z]/p'; " \
    "systemctl status nvidia-fabricmanager"


@checks("GpunetGpuFabricNotReady", "GpunetGpuFabricUnhealthy")
def check_fabric(c: Check) -> None:
    """The two fabric alerts on the second snapshot."""
    b = c.b
    for lbl, v in b.all("gpunet_gpu_fabric_state"):
        if v == 1 and lbl["state"] in ("not_started", "in_progress"):
            c.add("gpu", "GpunetGpuFabricNotReady", f"GPU {lbl['gpu']}",
                  f"NVLink fabric registration {lbl['state'].replace('_', ' ')}",
                  FABRIC_CONFIRM.format(gpu=lbl["gpu"]))
    for lbl, v in b.all("gpunet_gpu_fabric_status_code"):
        if v != 0:
            c.add("gpu", "GpunetGpuFabricNotReady", f"GPU {lbl['gpu']}",
                  f"NVLink fabric registration failed (NVML status {v:.0f})",
                  FABRIC_CONFIRM.format(gpu=lbl["gpu"]))
    bad: dict[str, list[str]] = {}
    for lbl, v in b.all("gpunet_gpu_fabric_health"):
        if v == 1:
            bad.setdefault(lbl["gpu"], []).append(lbl["check"].replace("_", " "))
    for lbl, v in b.all("gpunet_gpu_fabric_health_summary"):
        if v == 1 and lbl["summary"] != "healthy":
            bad.setdefault(lbl["gpu"], []).append(lbl["summary"].replace("_", " "))
    for gpu, what in sorted(bad.items()):
        c.add("gpu", "GpunetGpuFabricUnhealthy", f"GPU {gpu}",
              f"NVLink fabric health: {', '.join(sorted(what))}", FABRIC_CONFIRM.format(gpu=gpu))


ALERTS: tuple[Alert, ...] = (
    Alert("GpunetGpuPcieLinkDegraded", "gpu", "warning", "10m",
          lambda t: "gpunet_gpu_pcie_link_degraded == 1",
          "GPU PCIe link below its maximum",
          f"{GPU} runs its PCIe link below its maximum generation or width while busy."),
    simple("GpunetGpuPcieReplays", "gpu", "warning", "10m", PCIE_REPLAYS,
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
    simple("GpunetGpuLost", "gpu", "critical", "0m", LOST,
           "GPU lost",
           f"{GPU} has fallen off the bus (NVML: GPU is lost)."),
    simple("GpunetGpuMissing", "gpu", "critical", "5m", MISSING,
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
    Alert("GpunetGpuFabricNotReady", "gpu", "critical", "5m", lambda t: FABRIC_NOT_READY,
          "GPU's NVLink fabric not ready",
          f"{GPU} has not finished registering with its NVLink fabric, or its registration "
          "failed: NVLink traffic through the NVSwitches cannot run (the Fabric Manager or the "
          "NVLink subnet manager)."),
    Alert("GpunetGpuFabricUnhealthy", "gpu", "warning", "10m", lambda t: FABRIC_UNHEALTHY,
          "GPU's NVLink fabric unhealthy",
          f"The driver reports the NVLink fabric of {GPU} unhealthy (degraded bandwidth, a "
          "route recovery or fault, a wrong configuration or the fabric manager gone): "
          "collectives across its NVLinks slow down or fail."),
    simple("GpunetNvmlDown", "gpu", "warning", "5m", NVML_DOWN,
           "NVML not answering",
           f"NVML fails {NODE}: no GPU metrics (driver reloading, failing or mismatched)."),
)

# The doctor's checks, in steps (mixin.alerts.DOCTOR_ORDER).
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {
    "gpus": (check_pcie_link, PCIE_REPLAYS, LOST, MISSING, NVML_DOWN, check_xids, check_fabric),
    "utilization": (check_gpu_utilization,)}
