"""The transport alerts: what NCCL really uses; and the doctor's checks of them."""

from __future__ import annotations

from collections.abc import Callable

from gpunet_exporter.mixin.alerts.common import NODE, PORT, SCOPE, Alert, simple
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.check import Check, DoctorCheck, Note, Simple, checks, port
from gpunet_exporter.nccl.env import NCCL_FAULT_CLASSES, NCCL_SETTING_NOTES

_ACTIVE_RDMA_PORT = "count by (instance) (gpunet_infiniband_port_state_id == 4) > 0"


# Alerts of a simple shape: the PromQL and the doctor's check from one declaration.
SOCKET_FALLBACK = Simple(
    "GpunetNcclSocketFallback", "gpunet_probe_socket_fallback", "==", 1, "nccl_tcp",
    lambda lbl: f"{lbl['scope']} probe",
    lambda c, lbl, v, limit: "NCCL runs over TCP sockets although RDMA should carry it",
    lambda lbl: "gpunet-probe explain-log <the job's NCCL_DEBUG=INFO log>")
ENV_DISABLES_FAST_PATH = Simple(
    "GpunetNcclEnvDisablesFastPath", "gpunet_topology_nccl_env_findings", ">", 0, "nccl_tcp",
    lambda lbl: lbl["variable"],
    lambda c, lbl, v, limit: f"{v:.0f} GPU processes set {lbl['variable']} ({lbl['issue']})",
    lambda lbl: "tr '\\0' '\\n' < /proc/PID/environ | grep ^NCCL_  # PIDs: nvidia-smi")


def note_nccl_settings(c: Check) -> None:
    """NCCL settings a job makes on purpose (no alert): notes."""
    for lbl, v in c.b.all("gpunet_topology_nccl_env_settings"):
        if v > 0 and (lbl["variable"], lbl["value_class"]) not in NCCL_FAULT_CLASSES:
            note = NCCL_SETTING_NOTES.get((lbl["variable"], lbl["value_class"]))
            c.notes.append(Note(lbl["variable"], f"{v:.0f} GPU processes set it "
                                f"({lbl['value_class']})" + (f": {note}" if note else "")))


@checks("GpunetGdrNotReady", "GpunetGdrPeermemOnly", "GpunetGdrInactive")
def check_gdr(c: Check) -> None:
    """GPUDirect RDMA, judged only while an RDMA port is ACTIVE (as the alerts' join)."""
    b = c.b
    if not c.active_rdma_port():
        return
    if b.get("gpunet_topology_gdr_ready") == 0:
        c.add("gdr_off", "GpunetGdrNotReady", "node",
              "no DMA-BUF (it needs the open kernel module and Linux 5.12 or later) and no "
              "peer-memory module (nvidia_peermem) loaded",
              "cat /proc/driver/nvidia/version; uname -r; "
              "lsmod | grep -E 'nvidia_peermem|nv_peer_mem'")
    if b.get("gpunet_topology_gdr_path", path="peermem") == 1:
        c.add("gdr_off", "GpunetGdrPeermemOnly", "node",
              "GPUDirect RDMA rests on nvidia_peermem alone: no DMA-BUF (proprietary kernel "
              "module or a kernel before 5.12)", "cat /proc/driver/nvidia/version; uname -r")
    for lbl, v in b.all("gpunet_probe_gdr_active"):
        if v == 0:
            c.add("gdr_off", "GpunetGdrInactive", f"{lbl['scope']} probe",
                  "NCCL's network channels do not use GPUDirect RDMA while RDMA ports are up: "
                  "data is staged through host memory",
                  "NCCL_DEBUG=INFO: look for /GDRDMA on the NET/IB channel lines")


@checks("GpunetGpuJobRdmaIdle")
def check_job_rdma_idle(c: Check) -> None:
    """GpunetGpuJobRdmaIdle: GPUs with compute processes starved (the mean of the two readings
    below gpu.busy_utilization_ratio) while the RDMA ports, all together, move less than
    infiniband.rdma_idle_ratio of what the ACTIVE ones can carry, between the readings."""
    b = c.b
    capacity = 2 * sum(v for lbl, v in b.all("gpunet_infiniband_port_rate_bytes_per_second")
                       if b.get("gpunet_infiniband_port_state_id", **lbl) == 4)
    if not capacity:
        return
    rates = [r for name in ("gpunet_infiniband_port_transmitted_bytes_total",
                            "gpunet_infiniband_port_received_bytes_total")
             for _, r in c.rate(name)]
    ratio = c.t.infiniband.rdma_idle_ratio
    if not rates or sum(rates) >= ratio * capacity:
        return
    lo = c.t.gpu.busy_utilization_ratio
    starved = [gpu for gpu, util in c.working_gpus().items() if util < lo]
    if starved:
        c.add("nccl_tcp", "GpunetGpuJobRdmaIdle", "node",
              f"{len(starved)} GPUs with compute processes (GPU {', '.join(starved)}) are busy "
              f"less than {lo:.0%} while the RDMA ports move {sum(rates):.3g} B/s, "
              f"{sum(rates) / capacity:.1%} of what they carry (idle below {ratio:.0%}): the "
              "job's traffic is not on RDMA, or it does not use the network (read over the "
              f"check's {c.dt:.3g} s; the alert averages 10 minutes)",
              "NCCL_DEBUG=INFO in the job, then: gpunet-probe explain-log <its log>; "
              "tr '\\0' '\\n' < /proc/PID/environ | grep ^NCCL_  # PIDs: nvidia-smi")


# hw_counters behind GpunetRoceRetransmissions: (metric, file, thresholds key, words).
RETRANSMISSIONS = (
    ("out_of_sequence_packets", "out_of_sequence", "sequence_errors_per_second",
     "out-of-sequence packets"),
    ("packet_sequence_error_naks", "packet_seq_err", "sequence_errors_per_second",
     "sequence-error NAKs"),
    ("implied_nak_sequence_errors", "implied_nak_seq_err", "sequence_errors_per_second",
     "implied NAK sequence errors"),
    ("local_ack_timeouts", "local_ack_timeout_err", "ack_timeouts_per_second", "ACK timeouts"),
)


def _hw_rate_findings(c: Check, alert: str, table: tuple[tuple[str, str, str, str], ...],
                     confirm: Callable[[dict[str, str], str], str]) -> None:
    """One finding of ``alert`` per port where a hw_counter of ``table`` (metric, file,
    thresholds key, words) rises faster than its infiniband threshold: the alert's ``or`` of
    the rates, the first counter over its limit named."""
    t = c.t.infiniband
    seen: set[tuple[str, str]] = set()
    for metric, file, key, what in table:
        for lbl, r in c.rate(f"gpunet_infiniband_port_hw_{metric}_total"):
            where = (lbl.get("device", ""), lbl.get("port", ""))
            if where not in seen and r > getattr(t, key):
                seen.add(where)
                c.add("retransmit", alert, port(lbl),
                      f"{r:.4g} {what} per second (limit {getattr(t, key):g})",
                      confirm(lbl, file))


@checks("GpunetRoceRetransmissions")
def check_retransmissions(c: Check) -> None:
    """GpunetRoceRetransmissions: one finding per port whose sequence errors or ACK timeouts
    rise faster than their thresholds (the alert's ``or`` of the four rates)."""
    _hw_rate_findings(
        c, "GpunetRoceRetransmissions", RETRANSMISSIONS,
        lambda lbl, file: (f"cat /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/"
                           f"hw_counters/{file}  # twice; rdma statistic show link "
                           f"{lbl['device']}/{lbl['port']}"))


# hw_counters behind GpunetEfaTransportImpaired: (metric, file, thresholds key, words). AWS EFA
# ports, Nitro v4 and later (docs/formats.md §1.8).
EFA_EVENTS = (
    ("unresponsive_remote_events", "unresponsive_remote_events", "efa_remote_events_per_second",
     "unresponsive-remote events"),
    ("impaired_remote_connection_events", "impaired_remote_conn_events",
     "efa_remote_events_per_second", "impaired-connection events"),
    ("retransmit_timeouts", "retrans_timeout_events", "efa_retransmit_timeouts_per_second",
     "retransmit timeouts (path changes)"),
)


@checks("GpunetEfaTransportImpaired")
def check_efa_events(c: Check) -> None:
    """GpunetEfaTransportImpaired: one finding per EFA port whose SRD peers stop answering, or
    whose traffic keeps timing out onto other paths, faster than the thresholds (the alert's
    ``or`` of the three rates)."""
    _hw_rate_findings(
        c, "GpunetEfaTransportImpaired", EFA_EVENTS,
        lambda lbl, file: (f"cd /sys/class/infiniband/{lbl['device']}/ports/{lbl['port']}/"
                           f"hw_counters; grep . {file} retrans_pkts  # twice, a minute apart"))


ALERTS: tuple[Alert, ...] = (
    simple("GpunetNcclSocketFallback", "transport", "critical", "0m", SOCKET_FALLBACK,
           "NCCL fell back to TCP sockets",
           f"NCCL runs over TCP sockets {SCOPE} although RDMA should carry it."),
    Alert("GpunetGdrInactive", "transport", "critical", "0m",
          lambda t: f"gpunet_probe_gdr_active == 0\n  and on (instance) {_ACTIVE_RDMA_PORT}",
          "NCCL network traffic without GPUDirect RDMA",
          f"NCCL's network channels do not use GPUDirect RDMA {SCOPE} while RDMA ports are "
          "up: data is staged through host memory."),
    Alert("GpunetGdrNotReady", "transport", "critical", "5m",
          lambda t: f"gpunet_topology_gdr_ready == 0\n  and on (instance) {_ACTIVE_RDMA_PORT}",
          "nvidia_peermem not loaded and no DMA-BUF",
          f"GPUDirect RDMA cannot work {NODE}: no peer-memory module (nvidia_peermem) is "
          "loaded and the driver or kernel cannot use DMA-BUF."),
    Alert("GpunetGdrPeermemOnly", "transport", "warning", "1h",
          lambda t: ('gpunet_topology_gdr_path{path="peermem"} == 1\n'
                     f"  and on (instance) {_ACTIVE_RDMA_PORT}"),
          "GPUDirect RDMA on nvidia_peermem alone, without DMA-BUF",
          f"GPUDirect RDMA {NODE} rests on the nvidia_peermem module alone: DMA-BUF, the way "
          "NVIDIA recommends, is not possible (the proprietary kernel module, or a kernel before "
          "5.12), and a driver or kernel update that drops the module turns GPUDirect RDMA off."),
    Alert("GpunetGpuJobRdmaIdle", "transport", "warning", "30m",
          lambda t: ("count by (instance, job) (\n"
                     "  avg_over_time(gpunet_gpu_utilization_ratio[10m]) < "
                     f"{_g(t.gpu.busy_utilization_ratio)}\n"
                     "  and on (instance, gpu) gpunet_gpu_compute_processes > 0\n)\n"
                     "and on (instance)\n"
                     "(\n  sum by (instance) (\n"
                     "    rate(gpunet_infiniband_port_transmitted_bytes_total[10m])\n"
                     "    + rate(gpunet_infiniband_port_received_bytes_total[10m])\n  )\n"
                     "  / on (instance)\n"
                     "  (2 * sum by (instance) (\n"
                     "    gpunet_infiniband_port_rate_bytes_per_second\n"
                     "    and on (instance, device, port) gpunet_infiniband_port_state_id == 4\n"
                     f"  )) < {_g(t.infiniband.rdma_idle_ratio)}\n)"),
          "GPU job starved while the RDMA ports are idle",
          f"{{{{ $value }}}} GPUs {NODE} run compute processes but are starved while its RDMA "
          "ports carry almost nothing of what they can: the job's traffic is not on RDMA (NCCL "
          "on sockets, as in a container without the InfiniBand libraries) or the job does not "
          "use the network."),
    simple("GpunetNcclEnvDisablesFastPath", "transport", "warning", "10m",
           ENV_DISABLES_FAST_PATH,
           "GPU processes run NCCL with a fast path turned off",
           f"{{{{ $value }}}} GPU processes {NODE} set {{{{ $labels.variable }}}} "
           "({{ $labels.issue }})."),
    Alert("GpunetRoceRetransmissions", "transport", "warning", "10m",
          lambda t: ("\nor\n".join(
              f"rate(gpunet_infiniband_port_hw_{m}_total[5m]) > "
              f"{_g(t.infiniband.sequence_errors_per_second)}"
              for m in ("out_of_sequence_packets", "packet_sequence_error_naks",
                        "implied_nak_sequence_errors"))
              + "\nor\nrate(gpunet_infiniband_port_hw_local_ack_timeouts_total[5m]) > "
              f"{_g(t.infiniband.ack_timeouts_per_second)}"),
          "RDMA transport retransmitting",
          f"RDMA port {PORT} sees {{{{ $value | humanize }}}} sequence errors or ACK timeouts "
          "per second (hw_counters): packets are lost and retransmitted."),
    Alert("GpunetEfaTransportImpaired", "transport", "warning", "10m",
          lambda t: "\nor\n".join(
              f"rate(gpunet_infiniband_port_hw_{m}_total[5m]) > "
              f"{_g(getattr(t.infiniband, key))}" for m, _, key, _ in EFA_EVENTS),
          "EFA transport losing its peers or paths",
          f"EFA port {PORT} sees {{{{ $value | humanize }}}} unresponsive-remote, "
          "impaired-connection or retransmit-timeout events per second (hw_counters): SRD "
          "peers stop answering, or traffic keeps moving off failing network paths."),
)

# The doctor's checks, in steps (mixin.alerts.DOCTOR_ORDER).
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {
    "transport": (SOCKET_FALLBACK, ENV_DISABLES_FAST_PATH, note_nccl_settings, check_gdr),
    "job_rdma_idle": (check_job_rdma_idle,),
    "retransmissions": (check_retransmissions, check_efa_events)}
