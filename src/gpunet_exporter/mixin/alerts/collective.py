"""The collective alerts: probe results, the NCCL jobs running now, the pair plan; and the
recording rules they read (the fleet median per probe scope and size, the pair plan's per-node,
per-peer, per-leaf and fleet statistics), whose names the dashboards import. The pair plan's
alerts stay together here, GpunetFleetLinkSlow labelled ``link`` and GpunetFleetCrossLeafSlow
``topology`` as the health matrix shows them."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import NODE, SCOPE, Alert, Rule
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.thresholds import Thresholds

FLEET_MEDIAN_BUSBW = "scope_size:gpunet_probe_allreduce_bus_bandwidth_bytes_per_second:median"

# The pair plan (issue 18): every node exports its own view of the last round's pairs, labelled
# by the peer's node name. Nothing joins `peer` to `instance` (a scrape address): a node is judged
# from its own pairs, and a peer from the pairs that name it, on the other nodes' series.
PAIR_BW = "gpunet_fleet_pair_bus_bandwidth_bytes_per_second"
_PAIR_OK = "gpunet_fleet_pair_success"
NODE_MEDIAN_BW = f"instance:{PAIR_BW}:median"
FLEET_MEDIAN_BW = f"job:{PAIR_BW}:median"
FLEET_MAD_BW = f"job:{PAIR_BW}:mad"
FLEET_NODES = "job:gpunet_fleet_nodes_reporting:count"
PAIR_RATIO = f"instance_peer:{PAIR_BW}:ratio_to_fleet_median"
PAIR_HEALTHY = "instance_peer:gpunet_fleet_pair_healthy:bool"
NODE_PAIRS = "instance:gpunet_fleet_pairs:count"
NODE_PAIRS_HEALTHY = "instance:gpunet_fleet_pairs_healthy:count"
PEER_PAIRS = "peer:gpunet_fleet_pairs:count"
PEER_PAIRS_HEALTHY = "peer:gpunet_fleet_pairs_healthy:count"
# Per pair: this node's leaf, the peer's leaf and whether they differ (cross_leaf "true"/"false";
# absent when either leaf is unknown), so GpunetFleetLinkSlow can carry them for Alertmanager.
PAIR_LEAVES = "instance_peer:gpunet_fleet_pair_info:leaves"
LEAF_INTRA_BW = f"leaf:{PAIR_BW}:median_intra_leaf"
LEAF_CROSS_BW = f"leaf:{PAIR_BW}:median_cross_leaf"
LEAF_CROSS_RATIO = f"leaf:{PAIR_BW}:cross_to_intra_leaf_ratio"


def _busbw_low(t: Thresholds) -> str:
    p = t.probe
    ratio = _g(p.bus_bandwidth_ratio)
    metric = ('gpunet_probe_allreduce_bus_bandwidth_bytes_per_second'
              f'{{size="{p.bandwidth_size_bytes}"')
    parts = []
    expected = p.expected_bus_bandwidth_bytes_per_second
    fleet = []
    for scope in ("intra", "net", "inter"):
        if getattr(expected, scope) > 0:
            parts.append(f'{metric}, scope="{scope}"}} < {ratio} * {_g(getattr(expected, scope))}')
        else:
            fleet.append(scope)
    if fleet:
        sel = f'{metric}, scope=~"{"|".join(fleet)}"}}'
        parts.append(f"{sel}\n  < on (scope, size) group_left {ratio} * {FLEET_MEDIAN_BUSBW}")
    return "\nor\n".join(parts)


def _variation(t: Thresholds) -> str:
    """Coefficient of variation of the per-round median time at the bandwidth size."""
    p = t.probe
    sel = (f'gpunet_probe_allreduce_seconds{{size="{p.bandwidth_size_bytes}", '
           'stat="median"}')
    w = p.variation_window
    return (f"stddev_over_time({sel}[{w}])\n  / avg_over_time({sel}[{w}]) > "
            f"{_g(p.variation_ratio)}")


def _probe_stale(t: Thresholds) -> str:
    stale = _g(t.probe.stale_seconds)
    return ("(\n    time() - gpunet_probe_last_success_timestamp_seconds{scope!=\"inter\"} > "
            f"{stale}\n  and on (instance)\n    time() - "
            f"gpunet_probe_idle_since_timestamp_seconds > {stale}\n)\nor\n  time() - "
            f"gpunet_probe_last_success_timestamp_seconds{{scope=\"inter\"}} > {stale}")


def _fleet_link_slow(t: Thresholds) -> str:
    """A pair slow or failed while this node has a healthy pair, unless the fleet's view of the
    peer (the pairs that name it, on every other node) makes the peer the suspect: then
    GpunetFleetNodeSuspect names it and its pairs are not blamed as links. The alert carries
    the pair's leaf, peer_leaf and cross_leaf (PAIR_LEAVES) for Alertmanager's inhibition."""
    f = t.fleet
    return (f"(\n  (\n    {PAIR_RATIO} < {_g(f.link_slow_ratio)}\n"
            f"    or on (instance, job, peer)\n    0 * ({_PAIR_OK} == 0)\n  )\n"
            f"  and on (instance, job) {NODE_PAIRS_HEALTHY} >= 1\n"
            f"  unless on (job, peer) (\n    {PEER_PAIRS} >= {f.suspect_min_pairs}\n"
            f"    and on (job, peer) {PEER_PAIRS_HEALTHY} == 0\n  )\n)\n"
            # The leaves, for Alertmanager: GpunetFleetCrossLeafSlow inhibits cross-leaf pairs.
            f"* on (instance, job, peer) group_left (leaf, peer_leaf, cross_leaf) {PAIR_LEAVES}")


def _fleet_outlier(t: Thresholds) -> str:
    f = t.fleet
    sigma = _g(f.outlier_mad_factor * 1.4826)
    return (f"{NODE_MEDIAN_BW}\n  < on (job) group_left ()\n"
            f"  ({FLEET_MEDIAN_BW} - {sigma} * {FLEET_MAD_BW})\n"
            f"and on (instance, job)\n{NODE_MEDIAN_BW}\n"
            f"  < on (job) group_left {_g(f.outlier_ratio)} * {FLEET_MEDIAN_BW}\n"
            f"and on (job) {FLEET_NODES} >= {f.outlier_min_nodes}")


ALERTS: tuple[Alert, ...] = (
    Alert("GpunetAllreduceLatencyHigh", "collective", "warning", "10m",
          lambda t: ("gpunet_probe_allreduce_seconds"
                     f'{{size="{t.probe.latency_size_bytes}", stat="median"}} > '
                     f"{_g(t.probe.latency_seconds)}"),
          "Small all-reduce too slow",
          f"The {{{{ $labels.size }}}}-byte all-reduce takes {{{{ $value | humanizeDuration }}}}"
          f" {SCOPE}."),
    Alert("GpunetBusBandwidthLow", "collective", "warning", "10m", _busbw_low,
          "All-reduce bus bandwidth below the expected",
          f"The {{{{ $labels.size }}}}-byte all-reduce reaches {{{{ $value | humanize }}}}B/s "
          f"bus bandwidth {SCOPE}, below the expected."),
    Alert("GpunetBusBandwidthBelowLinkRate", "collective", "warning", "10m",
          lambda t: ("gpunet_probe_bus_bandwidth_link_ratio < "
                     f"{_g(t.probe.link_ratio)}"),
          "All-reduce through the NICs well below the link rate",
          f"The probe's all-reduce {SCOPE} reaches {{{{ $value | humanizePercentage }}}} of "
          "what its RDMA links allow (gpunet_probe_link_bandwidth_bytes_per_second)."),
    Alert("GpunetStragglerRank", "collective", "warning", "10m",
          lambda t: ("gpunet_probe_straggler_wait_ratio\n  * on (instance, scope) group_left "
                     "(rank, gpu) gpunet_probe_straggler_info\n  > "
                     f"{_g(t.probe.straggler_wait_ratio)}"),
          "A straggler rank slows the collective",
          f"Rank {{{{ $labels.rank }}}} (GPU {{{{ $labels.gpu }}}}) {SCOPE} arrives late: the "
          "other ranks spend {{ $value | humanizePercentage }} of their all-reduce time waiting "
          "for it."),
    Alert("GpunetProbeTimeVariance", "collective", "warning", "15m",
          _variation,
          "All-reduce time varies from round to round",
          f"The {{{{ $labels.size }}}}-byte all-reduce time varies by {{{{ $value | "
          f"humanizePercentage }}}} from round to round {SCOPE}."),
    # A node's own probe runs only while its GPUs are idle (issue 31): a node busy with jobs for
    # days has old results and is not stale; one idle past the hold-off and still without a
    # complete round is. Cluster-mode (inter) results follow their own schedule.
    Alert("GpunetProbeStale", "collective", "warning", "0m", _probe_stale,
          "No recent successful probe round",
          f"The last successful probe round {SCOPE} ended {{{{ $value | humanizeDuration }}}}"
          " ago."),
    Alert("GpunetProbeFailing", "collective", "warning", "15m",
          lambda t: ('gpunet_probe_state{state="failing"} == 1\nor\n'
                     'gpunet_probe_success{scope="inter"} == 0'),
          "Probe rounds failing",
          f"Probe rounds {NODE} fail although nothing else uses its GPUs "
          "(gpunet_probe_success and gpunet_probe_failures_total say which scope and why)."),
    Alert("GpunetProbeIdleUnknown", "collective", "warning", "15m",
          lambda t: 'gpunet_probe_state{state="unknown"} == 1',
          "Probe cannot tell whether the GPUs are idle",
          f"The probe {NODE} cannot read its GPUs' processes (NVML), so it runs no rounds: "
          "NCCL's transport and GPUDirect RDMA are not checked there."),
    # --- the NCCL jobs running now, from NCCL's RAS service (issue 20) -------------------------
    Alert("GpunetNcclRankDead", "collective", "warning", "0m",
          lambda t: 'gpunet_nccl_job_processes{state="dead"} > 0',
          "NCCL job process dead",
          "{{ $value }} process(es) of the NCCL job on RAS port {{ $labels.port }} "
          f"{NODE} are considered dead: the job waits for them or is about to fail."),
    Alert("GpunetNcclRankUnreachable", "collective", "warning", "1m",
          lambda t: 'gpunet_nccl_missing_ranks{reason="unreachable"} > 0',
          "NCCL ranks not answering",
          "{{ $value }} rank(s) of the NCCL job on RAS port {{ $labels.port }} "
          f"{NODE} do not answer NCCL's RAS: their process is stopped, hung or cut off."),
    Alert("GpunetNcclRankStalled", "collective", "warning", "2m",
          lambda t: "gpunet_nccl_stalled_ranks > 0",
          "NCCL rank stuck behind the others",
          "{{ $value }} rank(s) of the NCCL job on RAS port {{ $labels.port }} "
          f"{NODE} launch no more collectives while their communicator's other ranks have "
          "gone further: the others wait for them."),
    Alert("GpunetNcclRasUnreachable", "collective", "warning", "5m",
          lambda t: ("gpunet_nccl_ras_listeners > 0\n"
                     "  and on (instance, job, port) gpunet_nccl_ras_query_success == 0"),
          "NCCL's RAS service not answering",
          "{{ $value }} NCCL process(es) listen on RAS port {{ $labels.port }} "
          f"{NODE} but none gave a report: the job's health is unknown."),
    # --- the pair plan across the fleet (issue 18) ---------------------------------------------
    Alert("GpunetFleetNodeSuspect", "collective", "warning", "5m",
          lambda t: (f"{NODE_PAIRS} >= {t.fleet.suspect_min_pairs}\n"
                     f"  and on (instance, job) {NODE_PAIRS_HEALTHY} == 0"),
          "Node in every failing or slow pair of the pair plan",
          "All {{ $value }} pairs of {{ $labels.instance }} failed or were slow in the last "
          "pair round while the fleet's other pairs were not: the node, not its links, is the "
          "common factor."),
    Alert("GpunetFleetBandwidthOutlier", "collective", "warning", "5m", _fleet_outlier,
          "Node's pair bandwidth a robust outlier of the fleet",
          "The median bus bandwidth of the pairs of {{ $labels.instance }} is {{ $value | "
          "humanize }}B/s, below the fleet's median node by more than the robust-sigma "
          f"threshold (1.4826 x MAD, {FLEET_MAD_BW}) and the ratio threshold."),
    Alert("GpunetFleetLinkSlow", "link", "warning", "5m", _fleet_link_slow,
          "Pair slow between two otherwise healthy nodes",
          "The pair {{ $labels.instance }} to {{ $labels.peer }} reaches {{ $value | "
          "humanizePercentage }} of the fleet's median node bandwidth (0% when it failed), "
          "while both ends have healthy pairs: the link between them (cable, ports, switch "
          "path) is the suspect."),
    Alert("GpunetFleetCrossLeafSlow", "topology", "warning", "5m",
          # peer_leaf repeats leaf: Alertmanager's `equal` compares labels of one name, and a
          # cross-leaf GpunetFleetLinkSlow names this leaf as its leaf or as its peer_leaf.
          lambda t: (f'label_replace(\n  {LEAF_CROSS_RATIO} < '
                     f'{_g(t.fleet.cross_leaf_ratio)},\n'
                     '  "peer_leaf", "$1", "leaf", "(.*)"\n)'),
          "Cross-leaf pairs much slower than intra-leaf pairs",
          "The cross-leaf pairs of leaf {{ $labels.leaf }} reach {{ $value | "
          "humanizePercentage }} of the bandwidth of its intra-leaf pairs (medians): the spine "
          "side (the leaf's uplinks, the spines, routing) is the suspect."),
    Alert("GpunetFleetProbeStale", "collective", "warning", "0m",
          lambda t: ("time() - gpunet_fleet_round_timestamp_seconds > "
                     f"{_g(t.fleet.stale_seconds)}"),
          "No recent pair round of the pair plan",
          "The last pair round of {{ $labels.instance }} ended {{ $value | humanizeDuration }} "
          "ago: the fleet alerts judge old results."),
)


def recording(t: Thresholds) -> list[Rule]:
    """The probes' fleet median per scope and size, and the pair plan's statistics."""
    return [{
        "record": FLEET_MEDIAN_BUSBW,
        "expr": ("quantile by (scope, size) (0.5, "
                 "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second)"),
    }, *_fleet_recording(t)]


def _fleet_recording(t: Thresholds) -> list[Rule]:
    """The pair plan's recording rules: per-node and fleet statistics of the pair bandwidth
    (successful pairs only), each pair's health, and the per-leaf intra and cross medians."""
    f = t.fleet
    ran = f"{PAIR_BW} and on (instance, job, peer) {_PAIR_OK} == 1"
    # Pairs whose peer is on this node's leaf: pair_info with peer_leaf copied into leaf, so it
    # matches the node's own leaf label (PromQL cannot compare two labels directly).
    with_leaf = (f"(\n    {ran}\n  )\n"
                 "  * on (instance, job) group_left (leaf) gpunet_fleet_node_info")
    same_leaf = 'label_replace(gpunet_fleet_pair_info, "leaf", "$1", "peer_leaf", "(.*)")'
    return [
        {"record": NODE_MEDIAN_BW, "expr": f"quantile by (instance, job) (0.5,\n  {ran}\n)"},
        {"record": FLEET_MEDIAN_BW, "expr": f"quantile by (job) (0.5, {NODE_MEDIAN_BW})"},
        {"record": FLEET_MAD_BW,
         "expr": (f"quantile by (job) (0.5,\n  abs({NODE_MEDIAN_BW}\n"
                  f"    - on (job) group_left {FLEET_MEDIAN_BW})\n)")},
        {"record": FLEET_NODES, "expr": f"count by (job) ({NODE_MEDIAN_BW})"},
        {"record": PAIR_RATIO,
         "expr": f"(\n  {ran}\n)\n/ on (job) group_left {FLEET_MEDIAN_BW}"},
        {"record": PAIR_HEALTHY,
         "expr": (f"{PAIR_RATIO} >= bool {_g(f.link_slow_ratio)}\n"
                  f"or on (instance, job, peer)\n{_PAIR_OK} == bool 1")},
        {"record": NODE_PAIRS, "expr": f"count by (instance, job) ({_PAIR_OK})"},
        {"record": NODE_PAIRS_HEALTHY, "expr": f"sum by (instance, job) ({PAIR_HEALTHY})"},
        {"record": PEER_PAIRS, "expr": f"count by (job, peer) ({_PAIR_OK})"},
        {"record": PEER_PAIRS_HEALTHY, "expr": f"sum by (job, peer) ({PAIR_HEALTHY})"},
        {"record": PAIR_LEAVES, "expr": _pair_leaves()},
        {"record": LEAF_INTRA_BW,
         "expr": (f"quantile by (job, leaf) (0.5,\n  {with_leaf}\n"
                  f"  and on (instance, job, peer, leaf) {same_leaf}\n)")},
        {"record": LEAF_CROSS_BW,
         "expr": (f"quantile by (job, leaf) (0.5,\n  {with_leaf}\n"
                  f"  and on (instance, job, peer) gpunet_fleet_pair_info\n"
                  f"  unless on (instance, job, peer, leaf) {same_leaf}\n)")},
        {"record": LEAF_CROSS_RATIO,
         "expr": f"{LEAF_CROSS_BW}\n/ on (job, leaf) {LEAF_INTRA_BW}"},
    ]


def _pair_leaves() -> str:
    """One series (value 1) per pair of gpunet_fleet_pair_info with labels instance, job, peer,
    leaf (this node's), peer_leaf and cross_leaf: "false" when the two leaves are the same,
    "true" when they differ, absent when either is unknown (empty)."""
    def both(pad: str) -> str:
        return (f"group by (instance, job, peer, peer_leaf, leaf) (\n{pad}  "
                "gpunet_fleet_pair_info * on (instance, job) group_left (leaf) "
                f"gpunet_fleet_node_info\n{pad})")

    same = ('label_replace(gpunet_fleet_pair_info{peer_leaf!=""}, "leaf", "$1", "peer_leaf", '
            '"(.*)")')
    return (f'label_replace(\n  {both("  ")}\n  and on (instance, job, peer, leaf)\n'
            f'  {same},\n  "cross_leaf", "false", "", ""\n)\n'
            "or on (instance, job, peer)\n"
            f'label_replace(\n  label_replace(\n    {both("    ")},\n'
            '    "cross_leaf", "true", "peer_leaf", ".+"\n  ),\n'
            '  "cross_leaf", "", "leaf", ""\n)')
