"""The topology alerts, and the doctor's checks of them."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts import collective
from gpunet_exporter.mixin.alerts.common import GPU, Alert, simple
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.check import Check, DoctorCheck, Labels, Simple


def _rail(c: Check, lbl: Labels, v: float, limit: float) -> str:
    rail = next((r["device"] for r, _ in c.b.all("gpunet_topology_gpu_nearest_rail_nic",
                                                  gpu=lbl["gpu"])), "?")
    return f"its nearest rail NIC ({rail}) is on another NUMA node"


# Alerts of a simple shape: the PromQL and the doctor's check from one declaration.
NUMA_MISMATCH = Simple(
    "GpunetGpuNicNumaMismatch", "gpunet_topology_gpu_nearest_nic_numa_mismatch", "==", 1,
    "numa", lambda lbl: f"GPU {lbl['gpu']}", _rail, lambda lbl: "nvidia-smi topo -m")
ACS_REDIRECT = Simple(
    "GpunetGpuNicAcsRedirect", "gpunet_topology_gpu_nic_acs_redirect_bridges", ">", 0, "numa",
    lambda lbl: f"GPU {lbl['gpu']} - {lbl['device']}",
    lambda c, lbl, v, limit: f"{v:.0f} PCIe bridges redirect peer-to-peer traffic (ACS)",
    lambda lbl: "lspci -vvv | grep -i 'ACSCtl'")


ALERTS: tuple[Alert, ...] = (
    simple("GpunetGpuNicNumaMismatch", "topology", "warning", "10m", NUMA_MISMATCH,
           "GPU's nearest rail NIC on another NUMA node",
           f"The nearest rail NIC of {GPU} is on another NUMA node: its network traffic "
           "crosses the inter-socket link."),
    simple("GpunetGpuNicAcsRedirect", "topology", "warning", "10m", ACS_REDIRECT,
           "ACS redirects GPU-NIC peer traffic",
           f"{{{{ $value }}}} PCIe bridges between {GPU} and {{{{ $labels.device }}}} redirect "
           "peer-to-peer traffic to the root complex (ACS), slowing GPUDirect RDMA."),
    # The pair plan's view of a leaf's uplinks, from the statistics of mixin.alerts.collective.
    Alert("GpunetFleetCrossLeafSlow", "topology", "warning", "5m",
          # peer_leaf repeats leaf: Alertmanager's `equal` compares labels of one name, and a
          # cross-leaf GpunetFleetLinkSlow names this leaf as its leaf or as its peer_leaf.
          lambda t: (f'label_replace(\n  {collective.LEAF_CROSS_RATIO} < '
                     f'{_g(t.fleet.cross_leaf_ratio)},\n'
                     '  "peer_leaf", "$1", "leaf", "(.*)"\n)'),
          "Cross-leaf pairs much slower than intra-leaf pairs",
          "The cross-leaf pairs of leaf {{ $labels.leaf }} reach {{ $value | "
          "humanizePercentage }} of the bandwidth of its intra-leaf pairs (medians): the spine "
          "side (the leaf's uplinks, the spines, routing) is the suspect."),
)

# The doctor's checks, in steps (mixin.alerts.DOCTOR_ORDER).
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {"placement": (NUMA_MISMATCH, ACS_REDIRECT)}
# Node-level alerts the doctor cannot check, and why.
UNCHECKED: dict[str, str] = {
    "GpunetFleetCrossLeafSlow": "the pair plan's per-leaf statistics: no node sees them alone",
}
