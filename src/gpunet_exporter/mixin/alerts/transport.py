"""The transport alerts: what NCCL really uses."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import NODE, PORT, SCOPE, Alert
from gpunet_exporter.mixin.alerts.common import number as _g

_ACTIVE_RDMA_PORT = "count by (instance) (gpunet_infiniband_port_state_id == 4) > 0"


ALERTS: tuple[Alert, ...] = (
    Alert("GpunetNcclSocketFallback", "transport", "critical", "0m",
          lambda t: "gpunet_probe_socket_fallback == 1",
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
    Alert("GpunetGpuJobRdmaIdle", "transport", "warning", "30m",
          lambda t: ("count by (instance) (\n"
                     "  avg_over_time(gpunet_gpu_utilization_ratio[10m]) < "
                     f"{_g(t.gpu.busy_utilization_ratio)}\n"
                     "  and on (instance, gpu) gpunet_gpu_compute_processes > 0\n)\n"
                     "and on (instance)\n"
                     "(\n  sum by (instance) (\n"
                     "    rate(gpunet_infiniband_port_transmitted_bytes_total[10m])\n"
                     "    + rate(gpunet_infiniband_port_received_bytes_total[10m])\n  ) < "
                     f"{_g(t.infiniband.rdma_idle_bytes_per_second)}\n)\n"
                     f"and on (instance) {_ACTIVE_RDMA_PORT}"),
          "GPU job starved while the RDMA ports are idle",
          f"{{{{ $value }}}} GPUs {NODE} run compute processes but are starved while its RDMA "
          "ports carry almost nothing: the job's traffic is not on RDMA (NCCL on sockets, as "
          "in a container without the InfiniBand libraries) or the job does not use the "
          "network."),
    Alert("GpunetNcclEnvDisablesFastPath", "transport", "warning", "10m",
          lambda t: "gpunet_topology_nccl_env_findings > 0",
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
)
