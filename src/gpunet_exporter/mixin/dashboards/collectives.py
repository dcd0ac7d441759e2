"""The NCCL probes and jobs (gpunet-collectives.json)."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import number
from gpunet_exporter.mixin.dashboards.common import (
    GOOD_WHEN_1,
    OK_ORANGE,
    OK_RED,
    PROBE_INTERVAL,
    PROBE_STATE_MAP,
    STRAGGLER_MIN_RATIO,
    Json,
    Layout,
    count_or_zero,
    dashboard,
    for_words,
    idle_without_round,
    instance_variable,
    job_variable,
    link_rate_steps,
    mapping,
    nccl_job_panels,
    nccl_jobs_table,
    override,
    percent,
    query_variable,
    rate,
    sel,
    stale_steps,
    stat,
    state_timeline,
    steps,
    straggler_steps,
    straggler_table,
    table,
    target,
    timeseries,
)
from gpunet_exporter.mixin.thresholds import Thresholds
from gpunet_exporter.probe.idle import STATES as PROBE_STATES


def collectives(t: Thresholds) -> Json:
    link_pct, wait_pct = percent(t.probe.link_ratio), percent(t.probe.straggler_wait_ratio)
    link_for = for_words(t, "GpunetBusBandwidthBelowLinkRate")
    lay = Layout()
    probe = ('scope=~"$scope"',)
    sized = ('scope=~"$scope"', 'size=~"$size"')
    who = "{{instance}} {{scope}}"
    sized_legend = "{{instance}} {{scope}} {{size}} B"
    lay.row("Now")
    lay.add(stat("Probe rounds failing", "Nodes whose probe fails while their GPUs are idle "
                 "(state failing: timeout, NCCL error, no GPU). A probe that yielded to a job "
                 "is not failing. See failures by reason below.",
                 [target(count_or_zero(sel("gpunet_probe_state", 'state="failing"')
                                       + " == 1"))],
                 "short", thresholds=OK_RED), 6, 4)
    lay.add(stat("Idle GPUs without a probe round", "Over the nodes whose GPUs are idle "
                 "(the probe runs only there), the longest time since the later of the last "
                 "complete round and the start of the idle time; 0 when none waits. Minutes: "
                 "the probe is failing or stuck, and the panels below show stale values.",
                 [target(idle_without_round(*probe))], "s",
                 thresholds=stale_steps(t.probe.stale_seconds, PROBE_INTERVAL)), 6, 4)
    lay.add(stat("Socket fallback", "Node scopes where NCCL used TCP sockets although an "
                 "RDMA port is ACTIVE (or the network for intra-node traffic). The net scope "
                 "checks every node's own NICs. Far slower; check NCCL_IB_* settings and the "
                 "IB stack.",
                 [target(count_or_zero(sel("gpunet_probe_socket_fallback", *probe) + " == 1"))],
                 "short", thresholds=OK_RED), 6, 4)
    lay.add(stat("GPUDirect RDMA inactive", "Node scopes whose NCCL network channels did not "
                 "use GPUDirect RDMA (net and inter; intra has no network channels): data is "
                 "staged through host memory. The RDMA ports table below says which port.",
                 [target(count_or_zero(sel("gpunet_probe_gdr_active", *probe) + " == 0"))],
                 "short", thresholds=OK_RED), 6, 4)
    lay.add(stat("Worst straggler wait", "Largest share of their all-reduce time the other "
                 "ranks spend waiting for the rank that arrives last. 0.5: they took twice as "
                 "long as the collective itself (GpunetStragglerRank fires above); from "
                 f"{percent(STRAGGLER_MIN_RATIO)} the "
                 "late rank is named in the Straggler ranks table.",
                 [target("max(" + sel("gpunet_probe_straggler_wait_ratio", *probe) + ")")],
                 "percentunit", thresholds=straggler_steps(t)), 6, 4)
    lay.add(stat(f"Below {link_pct} of the link rate", "Node scopes whose all-reduce at the "
                                                       "largest "
                 f"size reaches less than {link_pct} of the bus bandwidth their RDMA links allow "
                 f"(GpunetBusBandwidthBelowLinkRate after {link_for}). See Bus bandwidth / link "
                 "rate and the RDMA ports table.",
                 [target(count_or_zero(sel("gpunet_probe_bus_bandwidth_link_ratio", *probe)
                                       + f" < {number(t.probe.link_ratio)}"))], "short",
                 thresholds=OK_RED), 6, 4)
    lay.add(stat("Lowest bus bandwidth / link rate", "Per scope, the lowest share of the "
                 f"link rate reached over the selected nodes. {link_pct} or more is the target; "
                 "red "
                 "below. Scopes that use no RDMA port (intra) have no value.",
                 [target("min by (scope) (" + sel("gpunet_probe_bus_bandwidth_link_ratio",
                                                  *probe) + ")", "{{scope}}")],
                 "percentunit", thresholds=link_rate_steps(t), text_mode="value_and_name"), 6, 4)
    lay.add(stat("Ranks per round", "Ranks in the last round (largest over the selected "
                 "nodes). intra and net: one per local GPU, fewer means a GPU was left out "
                 "(a one-GPU node runs no intra scope); inter: ranks across the nodes.",
                 [target("max by (scope) (" + sel("gpunet_probe_world_size", *probe) + ")",
                         "{{scope}}")], "short", text_mode="value_and_name"), 6, 4)

    lay.row("Latency and bandwidth")
    lay.add(timeseries("All-reduce latency, median", "Median time of one all-reduce per "
                       "message size, counted once every rank arrived (waiting for a late "
                       "rank is the straggler wait below). Small sizes are latency-bound and "
                       "jitter by up to 2x between rounds.",
                       [target(sel("gpunet_probe_allreduce_seconds", *sized, 'stat="median"'),
                               sized_legend)], "s", log_scale=True), 12, 9)
    lay.add(timeseries("All-reduce latency, p99", "99th percentile all-reduce time per "
                       "size. Far above the median: intermittent stalls (congestion, PFC "
                       "pauses, a busy GPU).",
                       [target(sel("gpunet_probe_allreduce_seconds", *sized, 'stat="p99"'),
                               sized_legend)], "s", log_scale=True), 12, 9)
    lay.add(timeseries("Bus bandwidth", "nccl-tests bus bandwidth per size. Large sizes "
                       "should sit near the link rate; a step down is a degraded port, PCIe "
                       "link, socket fallback or lost GDR.",
                       [target(sel("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second",
                                   *sized), sized_legend)], "Bps"), 12, 9)
    lay.add(timeseries(
        "Bus bandwidth relative to the median node", "Each node's bus bandwidth divided by "
        "the median over the selected nodes at the same scope and size. Below "
        f"{percent(t.probe.bus_bandwidth_ratio)}: that node is slower than its peers.",
        [target(sel("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", *sized)
                + " / ignoring (instance, job) group_left () quantile by (scope, size) (0.5, "
                + sel("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", *sized) + ")",
                sized_legend)], "percentunit",
        thresholds=steps(("red", None), ("orange", t.probe.bus_bandwidth_ratio), ("green", 0.9)),
        show_thresholds=True), 12, 9)
    lay.add(timeseries("Tail latency ratio (p99 / median)", "How much longer the p99 "
                       "all-reduce takes than the median. Near 1 is steady; large values "
                       "are intermittent stalls.",
                       [target(sel("gpunet_probe_allreduce_seconds", *sized, 'stat="p99"')
                               + " / ignoring (stat) "
                               + sel("gpunet_probe_allreduce_seconds", *sized,
                                     'stat="median"'), sized_legend)], "none"), 12, 8)
    lay.add(timeseries(
        "Bus bandwidth / link rate", "Bus bandwidth of the largest size over the bus "
        "bandwidth the RDMA links allow (lowest port rate per rank sharing it), per node and "
        f"scope. net: the node's GPUs through its own NICs (NIC loopback). {link_pct} or more is "
        "the "
        f"target; below (red line) for {link_for} fires GpunetBusBandwidthBelowLinkRate: check "
        "GPUDirect RDMA, the GPU-NIC PCIe path, PFC pauses and the ports table below.",
        [target(sel("gpunet_probe_bus_bandwidth_link_ratio", *probe), who)], "percentunit",
        thresholds=link_rate_steps(t), show_thresholds=True), 12, 8)

    lay.row("Stragglers")
    lay.add(timeseries("Straggler wait, share of collective time", "Share of their "
                       "all-reduce time the other ranks spend waiting for the rank that "
                       "arrives last (largest size, median over iterations). 0.5: they took "
                       f"twice as long as the collective itself; above {wait_pct} (red line) for "
                       f"{for_words(t, 'GpunetStragglerRank')} fires GpunetStragglerRank. A "
                       "persistent straggler is one GPU, PCIe link or NIC; the table below names "
                       "it.",
                       [target(sel("gpunet_probe_straggler_wait_ratio", *probe), who)],
                       "percentunit", thresholds=straggler_steps(t), show_thresholds=True,
                       max_value=1), 12, 8)
    lay.add(timeseries("Straggler wait", "What the other ranks wait for the last rank to "
                       "arrive, in seconds (median over iterations at the largest size). "
                       "Compare with the median all-reduce time above.",
                       [target(sel("gpunet_probe_straggler_wait_seconds", *probe), who)],
                       "s"), 12, 8)
    lay.add(straggler_table(t, *probe), 24, 6)

    lay.row("Path: transports, GPUDirect RDMA, fallback")
    net_col = override("net", ("mappings", mapping(("IB", "IB", "green"),
                                                   ("Socket", "Socket", "red"))),
                       ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table("NCCL transports used", "Transports NCCL's channels used in the last "
                  "successful round: P2P/SHM inside a node, NET between nodes with net IB "
                  "(or a plugin). NET over Socket is the fallback to avoid.",
                  [target(sel("gpunet_probe_transport_info", *probe), table=True)], "none",
                  order=["instance", "scope", "transport", "net"],
                  overrides=[net_col, override("Value", ("custom.hidden", True))]), 12, 8)
    lay.add(table("NCCL problems in the probe log", "Problem codes from the NCCL log of the "
                  "last successful round (docs/nccl-log.md). Empty is healthy.",
                  [target(sel("gpunet_probe_nccl_problem", *probe), table=True)], "none",
                  order=["instance", "scope", "problem"],
                  overrides=[override("Value", ("custom.hidden", True))]), 12, 8)
    hca = sel("gpunet_probe_hca_ranks", *probe)
    lay.add(table("RDMA ports used by the probe", "Per node, scope and RDMA port: how many "
                  "of the node's ranks NCCL ran through it (net: each rank pinned to the "
                  "ACTIVE port nearest its GPU, so usually 1), whether their network channels "
                  "used GPUDirect RDMA (NO in red: staged through host memory; check "
                  "nvidia_peermem/DMA-BUF and the GPU-NIC path) and the port's rate. Ranks "
                  "sharing a port divide its rate.",
                  [target(hca, table=True),
                   target(sel("gpunet_probe_hca_gdr_active", *probe), table=True),
                   target(f"{hca} * 0 + on (instance, job, device, port) group_left () "
                          f"{sel('gpunet_infiniband_port_rate_bytes_per_second')}",
                          table=True)], "none",
                  rename={"Value #A": "ranks", "Value #B": "GPUDirect RDMA",
                          "Value #C": "port rate"},
                  order=["instance", "scope", "device", "port", "ranks", "GPUDirect RDMA",
                         "port rate"],
                  overrides=[override("GPUDirect RDMA", ("mappings", GOOD_WHEN_1),
                                      ("custom.cellOptions", {"type": "color-text"})),
                             override("port rate", ("unit", "Bps"))]),
            12, 8)
    lay.add(timeseries("Link bandwidth", "The bus bandwidth the RDMA links allow each node "
                       "and scope: over the ports the ranks used, the lowest link rate "
                       "divided by the ranks sharing that port. A drop is a port trained "
                       "down, or ranks crowded onto fewer ports.",
                       [target(sel("gpunet_probe_link_bandwidth_bytes_per_second", *probe),
                               who)], "Bps"), 12, 8)
    lay.add(state_timeline("GPUDirect RDMA active", "OFF (red): NCCL's network channels did "
                           "not register GPU memory with the NIC. The net scope has network "
                           "channels on every node; intra (P2P/SHM) has none, so no value.",
                           [target(sel("gpunet_probe_gdr_active", *probe), who)],
                           mappings=mapping((1, "on", "green"), (0, "OFF", "red"))), 12, 7)
    lay.add(state_timeline("Socket fallback", "FALLBACK (red): NCCL sent over TCP sockets "
                           "although it should not.",
                           [target(sel("gpunet_probe_socket_fallback", *probe), who)],
                           mappings=mapping((0, "no", "green"), (1, "FALLBACK", "red"))),
            12, 7)

    lay.row("NCCL jobs (RAS): the jobs running now")
    for title, description, expr in (
            ("Nodes with a dead NCCL process", "Nodes whose NCCL job has a process RAS "
             "considers dead (GpunetNcclRankDead). Every node of a job reports it.",
             sel("gpunet_nccl_job_processes", 'state="dead"')),
            ("Nodes with a stuck NCCL rank", "Nodes whose NCCL job has ranks behind the others "
             "whose counts stopped (GpunetNcclRankStalled).", sel("gpunet_nccl_stalled_ranks")),
            ("Nodes with missing NCCL ranks", "Nodes whose NCCL job has ranks that do not "
             "answer RAS (GpunetNcclRankUnreachable).",
             sel("gpunet_nccl_missing_ranks", 'reason="unreachable"'))):
        lay.add(stat(title, description,
                     [target(count_or_zero(f"max by (instance) ({expr}) > 0"))], "short",
                     thresholds=OK_RED), 6, 4)
    lay.add(stat("RAS not answering", "Node ports where NCCL processes listen but RAS gave no "
                 "report (GpunetNcclRasUnreachable): that job's health is unknown.",
                 [target(count_or_zero(sel("gpunet_nccl_ras_listeners") + " > 0 and on "
                                       "(instance, job, port) "
                                       + sel("gpunet_nccl_ras_query_success") + " == 0"))],
                 "short", thresholds=OK_ORANGE), 6, 4)
    lay.add(nccl_jobs_table(), 24, 7)
    nccl_job_panels(lay, "{{instance}} port {{port}}")

    lay.row("Probe health")
    lay.add(state_timeline("Last round succeeded", "FAILED (red): the last round gave no "
                           "results; the latency and bandwidth panels keep showing older "
                           "values.",
                           [target(sel("gpunet_probe_success", *probe), who)],
                           mappings=mapping((1, "ok", "green"), (0, "FAILED", "red"))), 12, 7)
    lay.add(timeseries("Time since last successful round", "Age of the newest successful "
                       "round. Rounds run every probe.interval_seconds "
                       f"({number(PROBE_INTERVAL)} s by default).",
                       [target("time() - " + sel("gpunet_probe_last_success_timestamp_seconds",
                                                 *probe), who)], "s",
                       thresholds=stale_steps(t.probe.stale_seconds, PROBE_INTERVAL),
                       show_thresholds=True), 12, 7)
    lay.add(timeseries("Probe failures per minute by reason", "Rounds per minute that gave "
                       "no or partial results: timeout, crash, nccl_error, init_error, "
                       "bad_result; skipped_busy is sizes skipped because the GPUs ran other "
                       "work (expected while training).",
                       [target("60 * sum by (instance, scope, reason) ("
                               + rate("gpunet_probe_failures_total", *probe) + ")",
                               who + " {{reason}}")], "cpm", bars=True), 12, 7)
    lay.add(timeseries("Probe round duration", "Wall time of the last round, all sizes. "
                       "Growing toward probe.timeout_seconds (120 s) ends in timeouts.",
                       [target(sel("gpunet_probe_duration_seconds", *probe), who)], "s"),
            12, 7)
    codes = " or ".join("(" + sel("gpunet_probe_state", f'state="{state}"') + f" == 1) * {n}"
                        for n, state in enumerate(PROBE_STATES, 1))
    lay.add(state_timeline("Probe state", "What the node's probe does (docs/probe.md, \"Idle "
                           "only\"): measuring on idle GPUs; hold-off after another process "
                           "was on a GPU; yielded while a job runs (it holds no GPU memory "
                           "then); FAILING on idle GPUs; UNKNOWN when it cannot read the GPUs' "
                           "processes and runs nothing.",
                           [target(f"max by (instance) ({codes})", "{{instance}}")],
                           mappings=mapping(*PROBE_STATE_MAP)), 12, 6)
    lay.add(state_timeline("Sizes skipped (GPU busy)", "SKIPPED: the round left this size "
                           "out because a GPU was busy with other work.",
                           [target(sel("gpunet_probe_size_skipped", *sized),
                                   sized_legend)],
                           mappings=mapping((0, "run", "green"), (1, "SKIPPED", "yellow"))),
            12, 6)

    return dashboard(
        "gpunet-collectives", "gpunet / Collectives (NCCL probes)",
        "All-reduce probes: latency and bus bandwidth per size, transports, GPUDirect RDMA, "
        "socket fallback, stragglers and probe health.", lay,
        [job_variable(), instance_variable(multi=True),
         query_variable("scope", "Scope", "label_values(gpunet_probe_success, scope)",
                        multi=True, include_all=True, all_value=".+"),
         query_variable("size", "Size (bytes)",
                        "label_values(gpunet_probe_allreduce_seconds, size)", multi=True,
                        include_all=True, all_value=".+", sort=3)])
