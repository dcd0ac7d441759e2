"""The topology alerts."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import GPU, Alert

ALERTS: tuple[Alert, ...] = (
    Alert("GpunetGpuNicNumaMismatch", "topology", "warning", "10m",
          lambda t: "gpunet_topology_gpu_nearest_nic_numa_mismatch == 1",
          "GPU's nearest rail NIC on another NUMA node",
          f"The nearest rail NIC of {GPU} is on another NUMA node: its network traffic crosses "
          "the inter-socket link."),
    Alert("GpunetGpuNicAcsRedirect", "topology", "warning", "10m",
          lambda t: "gpunet_topology_gpu_nic_acs_redirect_bridges > 0",
          "ACS redirects GPU-NIC peer traffic",
          f"{{{{ $value }}}} PCIe bridges between {GPU} and {{{{ $labels.device }}}} redirect "
          "peer-to-peer traffic to the root complex (ACS), slowing GPUDirect RDMA."),
)
