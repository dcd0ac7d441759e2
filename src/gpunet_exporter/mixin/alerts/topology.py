"""The topology alerts, and the doctor's checks of them."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts import collective
from gpunet_exporter.mixin.alerts.common import GPU, Alert, simple
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.check import Check, DoctorCheck, Labels, Simple, checks


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


# GPUs sharing their nearest rail NIC although the node has a rail for each GPU: the rail map
# is wrong (a rail NIC in another GPU's slot, or on the other socket), and NCCL puts two GPUs
# on one NIC while another NIC stays idle.
RAIL_SHARED = ("max by (instance, job) (gpunet_topology_rail_nic_gpus) > 1\n"
               "and on (instance, job)\n"
               "count by (instance, job) (gpunet_topology_rail_nic_gpus)\n"
               "  >= on (instance, job) sum by (instance, job) (gpunet_topology_rail_nic_gpus)")


@checks("GpunetRailMapShared")
def check_rail_map(c: Check) -> None:
    served = {lbl["device"]: v for lbl, v in c.b.all("gpunet_topology_rail_nic_gpus")}
    if not served or max(served.values()) <= 1 or len(served) < sum(served.values()):
        return
    shared = sorted(d for d, n in served.items() if n > 1)
    idle = sorted(d for d, n in served.items() if n == 0)
    c.add("numa", "GpunetRailMapShared", "node",
          f"{', '.join(f'{d} is the nearest rail of {served[d]:.0f} GPUs' for d in shared)}, "
          f"while {', '.join(idle) or 'no rail'} serve{'s' * (len(idle) == 1)} none",
          "nvidia-smi topo -m")


ALERTS: tuple[Alert, ...] = (
    simple("GpunetGpuNicNumaMismatch", "topology", "warning", "10m", NUMA_MISMATCH,
           "GPU's nearest rail NIC on another NUMA node",
           f"The nearest rail NIC of {GPU} is on another NUMA node: its network traffic "
           "crosses the inter-socket link."),
    simple("GpunetGpuNicAcsRedirect", "topology", "warning", "10m", ACS_REDIRECT,
           "ACS redirects GPU-NIC peer traffic",
           f"{{{{ $value }}}} PCIe bridges between {GPU} and {{{{ $labels.device }}}} redirect "
           "peer-to-peer traffic to the root complex (ACS), slowing GPUDirect RDMA."),
    Alert("GpunetRailMapShared", "topology", "warning", "10m", lambda t: RAIL_SHARED,
          "GPUs share a rail NIC while another rail NIC is idle",
          "{{ $value }} GPUs on {{ $labels.instance }} have the same rail NIC as their nearest "
          "although the node has a rail NIC for each GPU: a rail NIC sits in the wrong slot or "
          "socket, and NCCL sends those GPUs' traffic through one NIC while another idles."),
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
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {
    "placement": (NUMA_MISMATCH, ACS_REDIRECT, check_rail_map)}
# Node-level alerts the doctor cannot check, and why.
UNCHECKED: dict[str, str] = {
    "GpunetFleetCrossLeafSlow": "the pair plan's per-leaf statistics: no node sees them alone",
}
