"""The pair plan of fleet probes (gpunet-pairs.json)."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.collective import (
    FLEET_MAD_BW,
    FLEET_MEDIAN_BW,
    LEAF_CROSS_BW,
    LEAF_CROSS_RATIO,
    LEAF_INTRA_BW,
    NODE_MEDIAN_BW,
    NODE_PAIRS,
    NODE_PAIRS_HEALTHY,
    PAIR_BW,
    PAIR_SLOW,
    pair_ratio,
)
from gpunet_exporter.mixin.alerts.common import number
from gpunet_exporter.mixin.dashboards.common import (
    GOOD_WHEN_1,
    JOB,
    NODE_LINK,
    OK_ORANGE,
    OK_RED,
    Json,
    Layout,
    count_or_zero,
    dashboard,
    for_words,
    instance_variable,
    job_variable,
    mapping,
    override,
    percent,
    sel,
    stat,
    state_timeline,
    steps,
    sum_or_zero,
    table,
    target,
    timeseries,
)
from gpunet_exporter.mixin.thresholds import PLAN_PERIOD_SECONDS, Thresholds

FAILED_PAIR = mapping((-1, "FAILED", "red"))


def jsel(metric: str, *matchers: str) -> str:
    """A selector of a series without an instance label (per job or per leaf), limited to the
    selected jobs."""
    return metric + "{" + ", ".join([JOB, *matchers]) + "}"


def firing(alerts: str, *, per_instance: bool = True) -> str:
    """ALERTS of the named alerts (a regex) that fire; per_instance=False for alerts that carry
    no instance (GpunetFleetCrossLeafSlow names a leaf)."""
    matchers = ('alertstate="firing"', f'alertname=~"{alerts}"')
    return sel("ALERTS", JOB, *matchers) if per_instance else jsel("ALERTS", *matchers)


def pair_state() -> str:
    """Each pair's bus bandwidth over the fleet's median node, or -1 when the pair failed."""
    return (f"({pair_ratio(sel, jsel)} or on (instance, job, peer) "
            f"({sel('gpunet_fleet_pair_success')} == 0) - 1)")


def pairs(t: Thresholds) -> Json:
    f = t.fleet
    slow_pct, cross_pct = percent(f.link_slow_ratio), percent(f.cross_leaf_ratio)
    # A pair's share of the fleet median: red below fleet.link_slow_ratio (GpunetFleetLinkSlow),
    # green from 0.8; a round's age: red past fleet.stale_seconds (GpunetFleetProbeStale).
    hours = number(PLAN_PERIOD_SECONDS / 3600)
    pair_ratio_steps = steps(("red", None), ("orange", f.link_slow_ratio), ("green", 0.8))
    round_age_steps = steps(("green", None), ("yellow", 2 * PLAN_PERIOD_SECONDS),
                            ("red", f.stale_seconds))
    lay = Layout()
    node_alerts = "GpunetFleet(NodeSuspect|BandwidthOutlier)"
    with_info = (" * on (instance, job, peer) group_left (peer_leaf, transport, gdr) "
                 + sel("gpunet_fleet_pair_info"))
    lay.row("Now")
    lay.add(stat("Nodes with pair results", "Selected nodes whose exporter exports a pair round "
                 "(a readable pairs.json in probe.state_dir). Nodes outside the last plan keep "
                 "their older file.",
                 [target(count_or_zero(sel("gpunet_fleet_round_timestamp_seconds")))],
                 "short"), 4, 4)
    lay.add(stat("Failed pairs", "Pairs of the last round that gave no result (success 0), "
                 "counted from each end. The matrix below shows them as FAILED.",
                 [target(count_or_zero(sel("gpunet_fleet_pair_success") + " == 0"))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Slow pairs", "Pairs that ran but reached less than fleet.link_slow_ratio "
                 f"({slow_pct}) of the fleet's median node, counted from each end.",
                 [target(count_or_zero(sel(PAIR_SLOW)))],
                 "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Suspect nodes", "Nodes on which GpunetFleetNodeSuspect or "
                 "GpunetFleetBandwidthOutlier fires: the node, not its links, is the common "
                 "factor of its slow or failed pairs. The Suspects row names them.",
                 [target(count_or_zero(f"count by (instance) ({firing(node_alerts)})"))],
                 "short", thresholds=OK_RED), 4, 4)
    lay.add(stat("Slow links", "GpunetFleetLinkSlow alerts firing: a pair slow or failed "
                 "between two nodes that are fine with their other peers. A link usually fires "
                 "from both ends, so counts twice.",
                 [target(count_or_zero(firing("GpunetFleetLinkSlow")))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Slow leaves", "Leaves on which GpunetFleetCrossLeafSlow fires: their "
                 f"cross-leaf pairs reach less than fleet.cross_leaf_ratio ({cross_pct}) of their "
                 "intra-leaf pairs (the spine side is the suspect). Per leaf, not per node: "
                 "the node selection does not apply.",
                 [target(count_or_zero(firing("GpunetFleetCrossLeafSlow",
                                              per_instance=False)))], "short",
                 thresholds=OK_RED), 4, 4)
    lay.add(stat("Fleet median pair bus bandwidth", "The median over nodes of each node's "
                 "median pair bus bandwidth (recording rule " + FLEET_MEDIAN_BW + "), over "
                 "every node of the job, whatever the node selection.",
                 [target(jsel(FLEET_MEDIAN_BW), "{{job}}")], "Bps"), 8, 4)
    lay.add(stat("Fleet spread (MAD / median)", "Median absolute deviation of the node medians "
                 "over their median: how far a typical node lies from the median node. A few "
                 "percent is a uniform fleet; GpunetFleetBandwidthOutlier needs a node below "
                 f"the median by {number(f.outlier_mad_factor)} robust sigmas (1.4826 x MAD) and "
                 f"below {percent(f.outlier_ratio)} of it.",
                 [target(f"{jsel(FLEET_MAD_BW)} / {jsel(FLEET_MEDIAN_BW)}", "{{job}}")],
                 "percentunit", thresholds=steps(("green", None), ("orange", 0.1))), 8, 4)
    lay.add(stat("Oldest pair round", "Longest time since a selected node's last pair round. "
                 f"The documented period is {hours} h; past fleet.stale_seconds "
                 f"({number(f.stale_seconds / 3600)} h) "
                 "GpunetFleetProbeStale fires and the other fleet alerts judge old results.",
                 [target("max(time() - " + sel("gpunet_fleet_round_timestamp_seconds") + ")")],
                 "s", thresholds=round_age_steps), 4, 4)
    lay.add(stat("Pairs dropped", "Peers of the last plan left out of the pair metrics because "
                 "a node had more than probe.fleet_max_peers (64); failed pairs are kept first. "
                 "Above 0: the plan gives nodes more peers than the exporter exports.",
                 [target(sum_or_zero(sel("gpunet_fleet_pairs_dropped")))], "short",
                 thresholds=OK_ORANGE), 4, 4)

    lay.row("Pair matrix")
    cells = override("instance\\peer", ("displayName", "node \\ peer"), ("links", NODE_LINK),
                     ("custom.cellOptions", {"type": "auto"}))
    lay.add(table(
        "Pair bus bandwidth / fleet median, node x peer",
        "One row per node (instance), one column per peer (the node name the plan uses), "
        "from the last round: each pair's bus bandwidth over the fleet's median node "
        "(" + PAIR_BW + " over " + FLEET_MEDIAN_BW + "). Green from 80%, orange below, red below "
        f"fleet.link_slow_ratio ({slow_pct}); FAILED: the pair gave no result. A node "
        "whose row and "
        "column are red is the suspect; one red cell, mirrored across the diagonal, a link. "
        "Empty: no pair between them in the plan. Relabel instance to the node's name in "
        "Prometheus and rows and columns line up.",
        [target(pair_state(), table=True)], "percentunit",
        transformations=[{"id": "groupingToMatrix", "options": {
            "columnField": "peer", "rowField": "instance", "valueField": "Value"}}],
        mappings=FAILED_PAIR, thresholds=pair_ratio_steps, cell="color-background",
        overrides=[cells], decimals=0), 24, 12)
    ratio_col = override("of fleet median", ("mappings", FAILED_PAIR),
                         ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table(
        "Pairs of the last round", "Every pair of the selected nodes, from each end: the peer, "
        "its leaf, the network (transport) and GPUDirect RDMA the pair used, its bus bandwidth "
        "and latency, and its share of the fleet's median node (FAILED: no result). Sorted "
        "worst first. Socket, or gdr false on a GPUDirect fabric, explains a slow pair.",
        [target(sel(PAIR_BW) + with_info, table=True),
         target(pair_state() + with_info, table=True),
         target(sel("gpunet_fleet_pair_latency_seconds") + with_info, table=True),
         target(sel("gpunet_fleet_pair_success") + with_info, table=True)], "Bps",
        rename={"Value #A": "bus bandwidth", "Value #B": "of fleet median",
                "Value #C": "latency", "Value #D": "ok"},
        order=["instance", "peer", "peer_leaf", "transport", "gdr", "bus bandwidth",
               "of fleet median", "latency", "ok"],
        thresholds=pair_ratio_steps, sort_by="of fleet median", sort_desc=False,
        overrides=[ratio_col, override("of fleet median", ("unit", "percentunit")),
                   override("latency", ("unit", "s")),
                   override("ok", ("unit", "none"), ("mappings", GOOD_WHEN_1),
                            ("custom.cellOptions", {"type": "color-text"}))]), 24, 10)

    lay.row("Suspects")
    node_rows = f"max by (instance, alertname) ({firing(node_alerts)})"

    def per_alert(expr: str) -> str:
        return f"{node_rows} * on (instance) group_left () max by (instance) ({expr})"

    lay.add(table(
        "Suspect nodes", "Nodes on which GpunetFleetNodeSuspect (every pair failed or slow) or "
        "GpunetFleetBandwidthOutlier (median pair a robust outlier) fires, with the node's "
        "pairs, how many of them are healthy and its median pair bus bandwidth (empty when "
        "none ran). Empty is healthy. Follow the node's own link, transport and topology "
        "alerts; after the repair, run the repair plan (docs/runbooks.md, Pair plan).",
        [target(node_rows, table=True),
         target(per_alert(sel(NODE_PAIRS)), table=True),
         target(per_alert(sel(NODE_PAIRS_HEALTHY)), table=True),
         target(per_alert(sel(NODE_MEDIAN_BW)), table=True)], "short",
        rename={"Value #B": "pairs", "Value #C": "healthy pairs",
                "Value #D": "median pair bus bandwidth"},
        order=["instance", "alertname", "pairs", "healthy pairs",
               "median pair bus bandwidth"], decimals=0,
        overrides=[override("Value #A", ("custom.hidden", True)),
                   override("median pair bus bandwidth", ("unit", "Bps"),
                            ("decimals", None))]), 12, 8)
    leaf_rows = f"max by (job, leaf) ({firing('GpunetFleetCrossLeafSlow', per_instance=False)})"

    def per_leaf(metric: str) -> str:
        return f"{leaf_rows} * on (job, leaf) {jsel(metric)}"

    lay.add(table(
        "Slow leaves", "Leaves on which GpunetFleetCrossLeafSlow fires: the median of their "
        f"cross-leaf pairs against the median of their intra-leaf pairs. Below {cross_pct} (red): "
        "the "
        "leaf's uplinks, the spines or the routing. While it fires, Alertmanager mutes "
        "GpunetFleetLinkSlow of the pairs that cross from or to the leaf. Per leaf: the "
        "node selection does not apply. Empty is healthy.",
        [target(per_leaf(LEAF_CROSS_RATIO), table=True),
         target(per_leaf(LEAF_INTRA_BW), table=True),
         target(per_leaf(LEAF_CROSS_BW), table=True)], "percentunit",
        rename={"Value #A": "cross / intra", "Value #B": "intra-leaf median",
                "Value #C": "cross-leaf median"},
        order=["leaf", "cross / intra", "intra-leaf median", "cross-leaf median"],
        thresholds=steps(("red", None), ("green", f.cross_leaf_ratio)),
        overrides=[override("cross / intra", ("custom.cellOptions", {"type": "color-text"})),
                   override("intra-leaf median", ("unit", "Bps")),
                   override("cross-leaf median", ("unit", "Bps"))]), 12, 8)
    link_labels = "instance, peer, leaf, peer_leaf, cross_leaf"
    lay.add(table(
        "Slow links", "GpunetFleetLinkSlow alerts firing: the pair from node (instance) to "
        "peer, both leaves, whether it crosses leaves, and its share of the fleet's median "
        "node (FAILED: no result). A link usually appears twice, once from each end. "
        "cross_leaf true while its leaf is slow (Slow leaves): muted in Alertmanager, look at "
        "the spine side first. Empty is healthy.",
        [target(f"max by ({link_labels}) ({firing('GpunetFleetLinkSlow')}) * on (instance, "
                f"peer) max by (instance, peer) ({pair_state()})", table=True)],
        "percentunit", rename={"Value": "of fleet median"},
        order=["instance", "peer", "leaf", "peer_leaf", "cross_leaf", "of fleet median"],
        mappings=FAILED_PAIR, thresholds=pair_ratio_steps, sort_by="of fleet median",
        sort_desc=False,
        overrides=[override("of fleet median", ("custom.cellOptions",
                                                {"type": "color-text"}))]), 24, 7)

    lay.row("Fleet trend")
    lay.add(timeseries(
        "Fleet median pair bus bandwidth and MAD", "The fleet's median node (median over nodes "
        "of each node's median pair), its median absolute deviation, and the slow-pair line "
        f"(fleet.link_slow_ratio, {slow_pct} of the median) per job, round after round. A "
        "falling "
        "median with a steady MAD is the whole fabric; a growing MAD, nodes drifting apart.",
        [target(jsel(FLEET_MEDIAN_BW), "median {{job}}"),
         target(jsel(FLEET_MAD_BW), "MAD {{job}}"),
         target(f"{number(f.link_slow_ratio)} * {jsel(FLEET_MEDIAN_BW)}",
                "slow-pair line {{job}}")],
        "Bps", overrides=[override("/^slow-pair line/", ("custom.lineStyle",
                                                          {"fill": "dash", "dash": [10, 10]}),
                                   regex=True)]), 12, 8)
    lay.add(timeseries(
        "Node median pair bus bandwidth (bottom 10)", "The ten selected nodes whose median pair "
        "is slowest. A node far below the others is an outlier (GpunetFleetBandwidthOutlier).",
        [target(f"bottomk(10, {sel(NODE_MEDIAN_BW)})", "{{instance}}")], "Bps"), 12, 8)
    lay.add(timeseries(
        "Intra-leaf and cross-leaf medians per leaf", "Per leaf, the median bus bandwidth of the "
        "pairs whose peer is on the same leaf (solid) and on another leaf (dashed), seen from "
        "the leaf's nodes. Per leaf: the node selection does not apply.",
        [target(jsel(LEAF_INTRA_BW), "{{leaf}} intra"),
         target(jsel(LEAF_CROSS_BW), "{{leaf}} cross")], "Bps",
        overrides=[override("/ cross$/", ("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
                            regex=True)]), 12, 8)
    lay.add(timeseries(
        "Cross-leaf / intra-leaf per leaf", "Per leaf, the cross-leaf median over the "
        f"intra-leaf median. Below fleet.cross_leaf_ratio ({cross_pct}, red line) for "
        f"{for_words(t, 'GpunetFleetCrossLeafSlow')} "
        "fires "
        "GpunetFleetCrossLeafSlow: the spine side of that leaf is the suspect.",
        [target(jsel(LEAF_CROSS_RATIO), "{{leaf}}")], "percentunit",
        thresholds=steps(("red", None), ("green", f.cross_leaf_ratio)), show_thresholds=True),
        12, 8)

    lay.row("Rounds")
    lay.add(timeseries(
        "Time since the last pair round", "Per node, time() minus the time of its last pair "
        "round (gpunet_fleet_round_timestamp_seconds). It saws up to the plan's period "
        f"({hours} h documented) and drops at each round; past "
        f"{number(f.stale_seconds / 3600)} h (red line) GpunetFleetProbeStale fires.",
        [target("time() - " + sel("gpunet_fleet_round_timestamp_seconds"), "{{instance}}")],
        "s", thresholds=round_age_steps, show_thresholds=True), 12, 8)
    lay.add(state_timeline(
        "Nodes with a failed pair", "Per node, whether a pair of its last round failed "
        "(FAILED, red) or all of them gave a result (ok).",
        [target(f"min by (instance) ({sel('gpunet_fleet_pair_success')})", "{{instance}}")],
        mappings=mapping((1, "ok", "green"), (0, "FAILED", "red")), kind="status-history"),
        12, 8)
    lay.add(timeseries(
        "Healthy pairs per node (bottom 10)", "Share of a node's pairs that ran and reached "
        "the slow-pair line (" + NODE_PAIRS_HEALTHY + " over " + NODE_PAIRS + "). 0 with at "
        "least 2 pairs is GpunetFleetNodeSuspect.",
        [target(f"bottomk(10, {sel(NODE_PAIRS_HEALTHY)} / {sel(NODE_PAIRS)})",
                "{{instance}}")], "percentunit", max_value=1), 12, 8)
    lay.add(timeseries(
        "Pair latency (top 10)", "The ten slowest pairs by small-message latency, from each "
        "end. A pair far above the rest with normal bandwidth: a long or congested path.",
        [target(f"topk(10, {sel('gpunet_fleet_pair_latency_seconds')})",
                "{{instance}} to {{peer}}")], "s"), 12, 8)

    return dashboard(
        "gpunet-pairs", "gpunet / Fleet pairs (pair plan)",
        "The pair plan of fleet probes: node x peer bus bandwidth, failed pairs, the nodes, "
        "links and leaves the fleet alerts blame, the fleet median and the rounds' age.", lay,
        [job_variable(), instance_variable(multi=True)])
