"""The fleet overview: every node's health at a glance (gpunet-fleet.json)."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import ALERTS_FIRING, CLASSES, number
from gpunet_exporter.mixin.dashboards.common import (
    INSTANCE,
    JOB,
    NODE_LINK,
    OK_ORANGE,
    OK_RED,
    PORT_STATE,
    PROBE_INTERVAL,
    Json,
    Layout,
    count_or_zero,
    dashboard,
    for_words,
    idle_without_round,
    increase,
    instance_variable,
    job_variable,
    link_rate_steps,
    mapping,
    override,
    pause_steps,
    percent,
    query_variable,
    rate,
    sel,
    stale_steps,
    stat,
    state_timeline,
    straggler_steps,
    straggler_table,
    sum_or_zero,
    table,
    target,
    timeseries,
)
from gpunet_exporter.mixin.thresholds import Thresholds


def fleet(t: Thresholds) -> Json:
    link_pct, wait_pct = percent(t.probe.link_ratio), percent(t.probe.straggler_wait_ratio)
    link, wait = number(t.probe.link_ratio), number(t.probe.straggler_wait_ratio)
    link_for = for_words(t, "GpunetBusBandwidthBelowLinkRate")
    lay = Layout()
    lay.row("Now")
    lay.add(stat("Exporters down", "Scrape targets of the selected jobs whose last scrape "
                 "failed (up == 0). Above 0: every panel is blind for those nodes; check the "
                 "node and the gpunet-exporter service.",
                 [target(count_or_zero(f"up{{{JOB}, {INSTANCE}}} == 0"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Nodes with firing gpunet alerts", "Nodes where at least one Gpunet alert "
                 "fires (recording rule " + ALERTS_FIRING + " from alerts/). The health matrix "
                 "below says which class.",
                 [target(count_or_zero(f"sum by (instance) ({sel(ALERTS_FIRING)}) > 0"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("IB/RoCE ports not ACTIVE", "RDMA ports whose logical state is not ACTIVE "
                 "(4). A port that should carry traffic and is DOWN or INIT cuts that NIC out "
                 "of NCCL; the table below names them.",
                 [target(count_or_zero(sel("gpunet_infiniband_port_state_id") + " != 4"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("Ports below expected rate", "Active ports running below their expected "
                 "rate (e.g. NDR trained down to HDR, 4X to 2X). Each one slows every "
                 "all-reduce it is in.",
                 [target(sum_or_zero(sel("gpunet_infiniband_port_rate_degraded")))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Nodes with NCCL socket fallback", "Nodes whose last probe saw NCCL send "
                 "over TCP sockets although an RDMA port is ACTIVE (or intra-node traffic on "
                 "the network). Orders of magnitude slower; the net scope checks every node's "
                 "own NICs. Needs the probe collector; see the Collectives dashboard.",
                 [target(count_or_zero("max by (instance) ("
                                       + sel("gpunet_probe_socket_fallback") + ") == 1"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("Nodes with GPUDirect RDMA not ready", "GPU nodes with neither a "
                 "peer-memory module (nvidia_peermem) loaded nor DMA-BUF support: NCCL "
                 "copies every network transfer through host memory.",
                 [target(count_or_zero(sel("gpunet_topology_gdr_ready") + " == 0"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("GPUs with a degraded PCIe link", "Busy GPUs whose PCIe link runs below its "
                 "maximum generation, or any GPU with fewer lanes than its maximum.",
                 [target(sum_or_zero(sel("gpunet_gpu_pcie_link_degraded")))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Lost or missing GPUs", "GPUs NVML reports lost (fallen off the bus) plus "
                 "GPUs enumerated earlier that are gone. Above 0: the node needs a GPU reset "
                 "or a reboot.",
                 [target(f"({sum_or_zero(sel('gpunet_gpu_lost'))}) + "
                         f"({sum_or_zero(sel('gpunet_gpu_missing'))})")], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("MTU mismatches", "Netdevs and RDMA ports whose MTU differs from the "
                 "configured expectation (netdev MTU plus active RDMA MTU). A RoCE netdev at "
                 "1500 halves large-message bandwidth.",
                 [target(f"({sum_or_zero(sel('gpunet_link_mtu_mismatch'))}) + "
                         f"({sum_or_zero(sel('gpunet_link_rdma_mtu_mismatch'))})")], "short",
                 thresholds=OK_ORANGE), 4, 4)
    lay.add(stat("Nodes with a failing collector", "Nodes where a collector raised or timed "
                 "out in the last scrape: its metrics are missing, so other panels may look "
                 "healthy for the wrong reason.",
                 [target(count_or_zero("min by (instance) ("
                                       + sel("gpunet_scrape_collector_success") + ") == 0"))],
                 "short", thresholds=OK_ORANGE), 4, 4)
    lay.add(stat(f"Nodes below {link_pct} of the link rate", "Nodes whose probe all-reduce through "
                 f"the RDMA ports reaches less than {link_pct} of the bus bandwidth those links "
                 "allow "
                 f"(gpunet_probe_bus_bandwidth_link_ratio < {link}; "
                 f"GpunetBusBandwidthBelowLinkRate after {link_for}). Check the nodes in the "
                 "bottom 10 below: GPUDirect RDMA off, a GPU far from its NIC, PFC pauses or a "
                 "slow PCIe link.",
                 [target(count_or_zero("min by (instance) ("
                                       + sel("gpunet_probe_bus_bandwidth_link_ratio")
                                       + f") < {link}"))], "short", thresholds=OK_RED),
            4, 4)
    lay.add(stat("Nodes with a straggler rank", "Nodes that run a probe rank the others wait "
                 f"for more than {wait_pct} of their all-reduce time (the condition of "
                 "GpunetStragglerRank): that GPU, its PCIe link or its NIC is slow. The "
                 "Straggler ranks table below names rank and GPU.",
                 [target(count_or_zero(
                     "count by (instance) (" + sel("gpunet_probe_straggler_wait_ratio")
                     + " * on (instance, job, scope) group_left (rank, gpu) "
                     + sel("gpunet_probe_straggler_info") + f" > {wait})"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Lowest probe bus bandwidth at $size B", "Lowest all-reduce bus bandwidth "
                 "over the selected nodes at the message size chosen above (defaults to the "
                 "largest), per scope. Compare with the fleet's usual value; the Collectives "
                 "dashboard has the detail.",
                 [target("min by (scope) (" + sel(
                     "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", 'size=~"$size"')
                     + ")", "{{scope}}")], "Bps", text_mode="value_and_name"), 8, 4)
    lay.add(stat("Lowest bus bandwidth / link rate", "Per scope, the lowest share of the "
                 "link rate a node's probe all-reduce reached at the largest size (bus "
                 f"bandwidth over the lowest RDMA port rate per rank). {link_pct} or more is the "
                 "target; red below. Scopes that use no RDMA port (intra) have no value.",
                 [target("min by (scope) (" + sel("gpunet_probe_bus_bandwidth_link_ratio")
                         + ")", "{{scope}}")], "percentunit", thresholds=link_rate_steps(t),
                 text_mode="value_and_name"), 8, 4)
    lay.add(stat("Idle GPUs without a probe round", "The probe runs only on idle GPUs "
                 "(docs/probe.md). Over the nodes whose GPUs are idle, the longest time since "
                 "the later of the node's last complete round and the start of its idle time; "
                 "0 when none waits. Rounds run every "
                 f"{number(PROBE_INTERVAL)} s by default: minutes means the "
                 "probe is failing or stuck (GpunetProbeStale). Nodes busy with jobs never "
                 "count.", [target(idle_without_round())], "s",
                 thresholds=stale_steps(t.probe.stale_seconds, PROBE_INTERVAL)), 8, 4)

    lay.row("Health matrix")
    cells = override("instance\\class", ("displayName", "node"), ("links", NODE_LINK),
                     ("custom.cellOptions", {"type": "auto"}))
    lay.add(table(
        "Firing gpunet alerts by node and problem class",
        "One row per node, one column per problem class; the number is how many Gpunet "
        "alerts fire. Green 0 is healthy, red is not. Click a node for its node view. Needs "
        "the recording rules in alerts/gpunet.rules.yml loaded into Prometheus.",
        [target(sel(ALERTS_FIRING), table=True)], "short",
        transformations=[
            {"id": "groupingToMatrix", "options": {
                "columnField": "class", "rowField": "instance", "valueField": "Value"}},
            {"id": "calculateField", "options": {
                "mode": "reduceRow", "reduce": {"reducer": "sum"}, "alias": "total",
                "replaceFields": False}},
        ],
        order=["instance\\class", *CLASSES, "total"], thresholds=OK_RED,
        cell="color-background", overrides=[cells], sort_by="total", decimals=0), 24, 10)
    lay.add(state_timeline(
        "Firing gpunet alerts per node over time",
        "Per node, how many Gpunet alerts fired when: red bands show when a node went bad.",
        [target(f"sum by (instance) ({sel(ALERTS_FIRING)})", "{{instance}}")],
        mappings=mapping((0, "ok", "green")), unit="short", kind="status-history"), 24, 8)
    lay.add(timeseries("Firing gpunet alerts by class", "Alerts firing across the selected "
                       "nodes per problem class. A rise in one class across many nodes "
                       "points at the fabric or a fleet-wide change rather than one host.",
                       [target(f"sum by (class) ({sel(ALERTS_FIRING)})", "{{class}}")], "short"),
            12, 8)
    lay.add(timeseries("Exporters up", "Targets of the selected jobs that answered their "
                       "last scrape, against all targets.",
                       [target(f"sum(up{{{JOB}, {INSTANCE}}})", "up"),
                        target(f"count(up{{{JOB}, {INSTANCE}}})", "targets")], "short",
                       legend_table=False), 12, 8)

    lay.row("Links and ports")
    state_col = override("state", ("mappings", PORT_STATE),
                         ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table(
        "Ports not ACTIVE", "RDMA ports whose logical state is not ACTIVE, with their "
        "netdev. Empty is healthy. DOWN/Polling: no cable, dead optic or switch port; INIT: "
        "link up but no subnet manager has configured the port.",
        [target(f"({sel('gpunet_infiniband_port_state_id')} != 4) * on (instance, job, "
                f"device, port) group_left (link_layer, interface) "
                f"{sel('gpunet_infiniband_port_info')}", table=True)], "none",
        rename={"Value": "state"}, overrides=[state_col]), 12, 8)
    lay.add(table(
        "Ports below expected rate", "Active ports running slower than expected (actual "
        "against expected data rate). Empty is healthy. Reseat or replace the cable/optic, "
        "or check the switch port.",
        [target(f"{sel('gpunet_infiniband_port_rate_bytes_per_second')} and on (instance, "
                f"job, device, port) ({sel('gpunet_infiniband_port_rate_degraded')} == 1)",
                table=True),
         target(f"{sel('gpunet_infiniband_port_rate_expected_bytes_per_second')} and on "
                f"(instance, job, device, port) "
                f"({sel('gpunet_infiniband_port_rate_degraded')} == 1)", table=True)],
        "Bps", rename={"Value #A": "actual", "Value #B": "expected"}), 12, 8)
    lay.add(timeseries(
        "Link down events by node (top 10)", "Netdev carrier changes and InfiniBand "
        "LinkDowned events per interval. Any non-zero value is a flap: NCCL jobs on that "
        "node see timeouts or retries.",
        [target("topk(10, sum by (instance) (" + increase("gpunet_link_carrier_changes_total")
                + "))", "{{instance}} carrier changes"),
         target("topk(10, sum by (instance) (" + increase("gpunet_infiniband_port_link_downed_"
                                                          "total") + "))",
                "{{instance}} IB link downed")], "short", bars=True), 12, 8)
    lay.add(timeseries(
        "Symbol errors by node (top 10)", "InfiniBand symbol errors per second, summed over "
        "a node's ports. A sustained rate points at a bad cable or optic; the node view "
        "names the port.",
        [target("topk(10, sum by (instance) (" + rate("gpunet_infiniband_port_symbol_errors_"
                                                      "total") + "))", "{{instance}}")],
        "cps"), 12, 8)

    lay.row("Congestion")
    lay.add(timeseries(
        "Time paused by PFC, worst priority (top 10)", "Fraction of time a node's worst "
        "interface/priority/direction spent paused by PFC. rx: the switch paused us; tx: we "
        "paused the switch. Sustained above a few percent is congestion, near 100% a pause "
        "storm.",
        [target("topk(10, max by (instance) (" + rate("gpunet_pfc_pause_duration_seconds_"
                                                      "total") + "))", "{{instance}}")],
        "percentunit", thresholds=pause_steps(t),
        show_thresholds=True), 12, 8)
    lay.add(timeseries(
        "Discards by node (top 10)", "Packets dropped on per-priority queues (must stay at "
        "0 on the lossless RoCE priority) and by the physical port for lack of buffer.",
        [target("topk(10, sum by (instance) (" + rate("gpunet_pfc_priority_discards_total")
                + "))", "{{instance}} priority discards"),
         target("topk(10, sum by (instance) (" + rate("gpunet_pfc_port_discards_total")
                + "))", "{{instance}} port discards")], "pps"), 12, 8)
    lay.add(timeseries(
        "RDMA ACK timeouts and out-of-sequence packets by node (top 10)", "Transport-level "
        "signs of packet loss: QP ACK timeouts and out-of-sequence packets per second. A "
        "rising rate means loss on the fabric or a dead peer.",
        [target("topk(10, sum by (instance) (" + rate(
            "gpunet_infiniband_port_hw_local_ack_timeouts_total") + "))",
                "{{instance}} ACK timeouts"),
         target("topk(10, sum by (instance) (" + rate(
             "gpunet_infiniband_port_hw_out_of_sequence_packets_total") + "))",
                "{{instance}} out of sequence")], "cps"), 12, 8)
    lay.add(timeseries(
        "CNPs sent by node (top 10)", "Congestion notification packets the NIC sent after "
        "receiving ECN-marked RoCE packets: how much congestion the switches signal toward "
        "this node. High and steady means a congested path.",
        [target("topk(10, sum by (instance) (" + rate("gpunet_infiniband_port_hw_np_cnp_"
                                                      "sent_total") + "))", "{{instance}}")],
        "pps"), 12, 8)

    lay.row("GPUs, topology and collectives")
    count_cols = {"Value #A": "PCIe degraded GPUs", "Value #B": "lost GPUs",
                  "Value #C": "GPUs with a remote-NUMA NIC", "Value #D": "GDR not ready",
                  "Value #E": "GPUs with an XID in the last hour"}
    lay.add(table(
        "Nodes with GPU or GPUDirect problems", "Only nodes with a problem appear; empty is "
        "healthy. Click a node for the detail.",
        [target(f"sum by (instance) ({sel('gpunet_gpu_pcie_link_degraded')}) > 0",
                table=True),
         target(f"sum by (instance) ({sel('gpunet_gpu_lost')}) > 0", table=True),
         target(f"sum by (instance) ({sel('gpunet_topology_gpu_nearest_nic_numa_mismatch')})"
                " > 0", table=True),
         target(f"max by (instance) (1 - {sel('gpunet_topology_gdr_ready')}) > 0",
                table=True),
         target(f"count by (instance) (time() - "
                f"{sel('gpunet_gpu_xid_last_timestamp_seconds')} < 3600)", table=True)],
        "short", rename=count_cols, thresholds=OK_RED, cell="color-text", decimals=0), 12, 8)
    lay.add(table(
        "NCCL problems seen by the probe", "Problems the NCCL log of each node's last "
        "successful probe round shows (socket_fallback, gdr_disabled, no_ib_device, ...; "
        "docs/nccl-log.md). Empty is healthy.",
        [target(sel("gpunet_probe_nccl_problem"), table=True)], "none",
        order=["instance", "scope", "problem"],
        overrides=[override("Value", ("custom.hidden", True))]), 12, 8)
    lay.add(timeseries(
        "Lowest bus bandwidth at $size B (bottom 10 nodes)", "The ten slowest nodes by probe "
        "bus bandwidth at the chosen size. A node far below the others has a slow GPU, PCIe "
        "link or NIC.",
        [target("bottomk(10, min by (instance, scope) (" + sel(
            "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", 'size=~"$size"') + "))",
                "{{instance}} {{scope}}")], "Bps"), 12, 8)
    lay.add(timeseries(
        "Bus bandwidth / link rate (bottom 10 nodes)", "The ten nodes whose probe all-reduce "
        "at the largest size gets the least of what their RDMA links allow (bus bandwidth "
        "over the lowest port rate per rank sharing it). net: the node's GPUs through its own "
        f"NICs. Below {link_pct} (red line) for {link_for} fires "
        "GpunetBusBandwidthBelowLinkRate: "
        "check GPUDirect RDMA, the GPU-NIC path, PFC pauses and the NIC's PCIe link.",
        [target("bottomk(10, min by (instance, scope) ("
                + sel("gpunet_probe_bus_bandwidth_link_ratio") + "))",
                "{{instance}} {{scope}}")], "percentunit", thresholds=link_rate_steps(t),
        show_thresholds=True), 12, 8)
    lay.add(timeseries(
        "Straggler wait (top 10 nodes)", "Share of their all-reduce time the other ranks "
        "spend waiting for the rank that arrives last (largest size, median over "
        f"iterations). 0.5 = they took twice as long as the collective itself; above {wait_pct} "
        f"(red line) for {for_words(t, 'GpunetStragglerRank')} fires GpunetStragglerRank. In "
        "the inter scope every node "
        "of the round shows the same wait; the table beside names the late rank's node.",
        [target("topk(10, max by (instance, scope) ("
                + sel("gpunet_probe_straggler_wait_ratio") + "))",
                "{{instance}} {{scope}}")], "percentunit", thresholds=straggler_steps(t),
        show_thresholds=True, max_value=1), 12, 8)
    lay.add(straggler_table(t, ), 12, 8)

    lay.row("Exporter health", collapsed=True)
    lay.add(table(
        "Failing collectors per node (top 20)", "How many collectors raised or timed out in "
        "the last scrape; their metrics are missing for that node. 0 is healthy; the node "
        "view's Exporter row names them.",
        [target("topk(20, sum by (instance) (1 - " + sel("gpunet_scrape_collector_success")
                + "))", table=True)], "short",
        rename={"Value": "failing collectors"}, thresholds=OK_RED, cell="color-text",
        decimals=0), 12, 8)
    lay.add(timeseries(
        "Slowest collectors (top 10)", "Time a collector took in the scrape. Near the "
        "scrape timeout means scrapes will start failing.",
        [target("topk(10, max by (instance, collector) ("
                + sel("gpunet_scrape_collector_duration_seconds") + "))",
                "{{instance}} {{collector}}")], "s"), 12, 8)

    return dashboard(
        "gpunet-fleet", "gpunet / Fleet overview",
        "Which GPU nodes have network, GPU, topology or NCCL problems, by class.", lay,
        [job_variable(), instance_variable(multi=True),
         query_variable("size", "Probe size (bytes)",
                        "label_values(gpunet_probe_allreduce_bus_bandwidth_bytes_per_second, "
                        "size)", multi=False, include_all=False, sort=4)])


# --- node ---
