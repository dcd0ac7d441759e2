"""The collective alerts: probe results, the NCCL jobs running now, the pair plan; and the
recording rules they read (the fleet median per probe scope and size, the pair plan's per-node,
per-peer, per-leaf and fleet statistics), whose names the dashboards and the pair plan's alerts
of other classes (GpunetFleetLinkSlow in ``link``, GpunetFleetCrossLeafSlow in ``topology``)
import."""

from __future__ import annotations

from collections.abc import Callable

from gpunet_exporter.collectors import fabric
from gpunet_exporter.collectors import probe as probe_collector
from gpunet_exporter.mixin.alerts.common import NODE, SCOPE, Alert, Rule, simple
from gpunet_exporter.mixin.alerts.common import number as _g
from gpunet_exporter.mixin.check import Check, DoctorCheck, Note, Simple, Snapshot, checks
from gpunet_exporter.mixin.thresholds import Thresholds
from gpunet_exporter.probe import idle, results

FLEET_MEDIAN_BUSBW = "scope_size:gpunet_probe_allreduce_bus_bandwidth_bytes_per_second:median"

# The pair plan (issue 18): every node exports its own view of the last round's pairs, labelled
# by the peer's node name. Nothing joins `peer` to `instance` (a scrape address): a node is judged
# from its own pairs, and a peer from the pairs that name it, on the other nodes' series.
PAIR_BW = "gpunet_fleet_pair_bus_bandwidth_bytes_per_second"
PAIR_OK = "gpunet_fleet_pair_success"
NODE_MEDIAN_BW = f"instance:{PAIR_BW}:median"
FLEET_MEDIAN_BW = f"job:{PAIR_BW}:median"
FLEET_MAD_BW = f"job:{PAIR_BW}:mad"
FLEET_NODES = "job:gpunet_fleet_nodes_reporting:count"
# The pairs that ran below fleet.link_slow_ratio of the fleet's median node, valued at that
# ratio: few series (the fabric collector's path localization reads them too).
PAIR_SLOW = fabric.SLOW_PAIRS
NODE_PAIRS = probe_collector.PAIRS_MEASURED.name  # served by each node's exporter
NODE_PAIRS_OK = probe_collector.PAIRS_SUCCEEDED.name
NODE_PAIRS_HEALTHY = "instance:gpunet_fleet_pairs_healthy:count"
# Per pair: this node's leaf, the peer's leaf and whether they differ (cross_leaf "true"/"false";
# absent when either leaf is unknown), as the exporter labels them; GpunetFleetLinkSlow carries
# them for Alertmanager, and the leaf medians select by cross_leaf.
PAIR_INFO = "gpunet_fleet_pair_info"
# Each node's name in the plan (its peers' `peer`) and leaf: the join from `peer` to `instance`.
NODE_INFO = probe_collector.NODE_INFO.name
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


def pair_ratio(sel: Callable[[str], str] = str, fleet_sel: Callable[[str], str] = str) -> str:
    """Each pair's bandwidth over the fleet's median node (``sel`` and ``fleet_sel`` add a
    dashboard's matchers to the per-node and the per-job series): computed where it is read,
    since only the slow pairs are recorded."""
    return f"{sel(PAIR_BW)}\n/ on (job) group_left {fleet_sel(FLEET_MEDIAN_BW)}"


def node_suspect(t: Thresholds) -> str:
    """The nodes whose every measured pair (at least fleet.suspect_min_pairs) failed or was
    slow, by instance: GpunetFleetNodeSuspect, and what GpunetFleetLinkSlow leaves out."""
    return (f"{NODE_PAIRS} >= {t.fleet.suspect_min_pairs}\n"
            f"  and on (instance, job) {NODE_PAIRS_HEALTHY} == 0")


def _fleet_outlier(t: Thresholds) -> str:
    f = t.fleet
    sigma = _g(f.outlier_mad_factor * 1.4826)
    return (f"{NODE_MEDIAN_BW}\n  < on (job) group_left ()\n"
            f"  ({FLEET_MEDIAN_BW} - {sigma} * {FLEET_MAD_BW})\n"
            f"and on (instance, job)\n{NODE_MEDIAN_BW}\n"
            f"  < on (job) group_left {_g(f.outlier_ratio)} * {FLEET_MEDIAN_BW}\n"
            f"and on (job) {FLEET_NODES} >= {f.outlier_min_nodes}")


@checks("GpunetAllreduceLatencyHigh", "GpunetBusBandwidthLow", "GpunetProbeFailing")
def check_probe(c: Check) -> None:
    """The probe's last results: latency and bus bandwidth against the thresholds, a failed
    round; and the probe's state (GpunetProbeIdleUnknown a problem, a yielded probe a note)."""
    b, p = c.b, c.t.probe
    for lbl, v in b.all("gpunet_probe_allreduce_seconds", size=str(p.latency_size_bytes),
                        stat="median"):
        if v > p.latency_seconds:
            c.add("collective", "GpunetAllreduceLatencyHigh", f"{lbl['scope']} probe",
                  f"{lbl['size']}-byte all-reduce takes {v * 1e3:.3g} ms "
                  f"(limit {p.latency_seconds * 1e3:g} ms)",
                  "cat /var/lib/gpunet-exporter/probe/*.json")
    expected = p.expected_bus_bandwidth_bytes_per_second
    for lbl, v in b.all("gpunet_probe_allreduce_bus_bandwidth_bytes_per_second",
                        size=str(p.bandwidth_size_bytes)):
        want = (getattr(expected, lbl["scope"])
                if lbl["scope"] in ("intra", "net", "inter") else 0)
        if want > 0 and v < p.bus_bandwidth_ratio * want:
            c.add("collective", "GpunetBusBandwidthLow", f"{lbl['scope']} probe",
                  f"bus bandwidth {v / 1e9:.3g} GB/s, expected {want / 1e9:.3g} GB/s",
                  "cat /var/lib/gpunet-exporter/probe/*.json")
    # As the alert: the node's own scopes fail only while the GPUs are idle (state failing);
    # a cluster-mode scope on its last result.
    failing = b.get("gpunet_probe_state", state=idle.FAILING) == 1
    for lbl, v in b.all("gpunet_probe_success"):
        if v == 0 and (failing or lbl["scope"] not in results.NODE_SCOPES):
            c.add("collective", "GpunetProbeFailing", f"{lbl['scope']} probe",
                  "the last probe round failed",
                  "tail /var/lib/gpunet-exporter/probe/runner.log")
    if b.get("gpunet_probe_state", state=idle.UNKNOWN) == 1:
        c.problems.append("probe: the GPUs' processes cannot be read (NVML), so no probe round "
                          "runs (GpunetProbeIdleUnknown)")
    if b.get("gpunet_probe_state", state=idle.YIELDED) == 1:
        c.notes.append(Note("probe", "not run: a job's processes are on the GPUs (the probe "
                            "runs only on idle GPUs)"))


# An alert of a simple shape: the PromQL and the doctor's check from one declaration.
BELOW_LINK_RATE = Simple(
    "GpunetBusBandwidthBelowLinkRate", "gpunet_probe_bus_bandwidth_link_ratio", "<",
    "probe.link_ratio", "collective", lambda lbl: f"{lbl['scope']} probe",
    lambda c, lbl, v, limit: (f"the all-reduce reaches {v:.0%} of what its RDMA links allow "
                              f"(limit {limit:.0%})"),
    lambda lbl: "cat /var/lib/gpunet-exporter/probe/net.json  # hcas, link_bytes_per_second")


BELOW_NVLINK = Simple(
    "GpunetBusBandwidthBelowNvlink", "gpunet_probe_bus_bandwidth_nvlink_ratio", "<",
    "probe.nvlink_ratio", "collective", lambda lbl: f"{lbl['scope']} probe",
    lambda c, lbl, v, limit: (f"the all-reduce reaches {v:.0%} of what the GPUs' NVLinks carry "
                              f"(limit {limit:.0%})"),
    lambda lbl: "nvidia-smi topo -m; nvidia-smi nvlink -s")


@checks("GpunetStragglerRank")
def check_straggler(c: Check) -> None:
    b, p = c.b, c.t.probe
    for lbl, _ in b.all("gpunet_probe_straggler_info"):
        v = b.get("gpunet_probe_straggler_wait_ratio", scope=lbl["scope"]) or 0.0
        if v > p.straggler_wait_ratio:
            c.add("collective", "GpunetStragglerRank", f"{lbl['scope']} probe",
                  f"rank {lbl['rank']} (GPU {lbl['gpu']}) arrives late: the other ranks spend "
                  f"{v:.0%} of their all-reduce time waiting for it",
                  "cat /var/lib/gpunet-exporter/probe/*.json  # straggler")


def _plural(n: float, one: str, many: str = "") -> str:
    return f"{n:.0f} {one if n == 1 else (many or one + 's')}"


def _verb(n: float, one: str, many: str) -> str:
    return one if n == 1 else many


@checks("GpunetNcclRasUnreachable", "GpunetNcclRankDead", "GpunetNcclRankUnreachable",
        "GpunetNcclRankStalled")
def check_nccl_jobs(c: Check) -> None:
    """The NCCL jobs on this node, as NCCL's RAS service reports them (the nccl collector; the
    doctor asks for a second report just before its second reading, so that the collective
    counts are compared): the four GpunetNccl* alerts as findings, and each job that answered
    described in a note."""
    b = c.b
    for lbl, listening in b.all("gpunet_nccl_ras_listeners"):
        port = lbl["port"]
        where = f"NCCL job on RAS port {port}"
        confirm = f"ncclras -p {port}  # NCCL's RAS client (-v: per rank, -f json)"
        ok = b.get("gpunet_nccl_ras_query_success", port=port)
        if listening > 0 and ok == 0:
            silent = b.get("gpunet_nccl_ras_unanswered_connections_total", port=port) or 0
            why = (f" ({_plural(silent, 'connection')} accepted and never answered: a stopped "
                   "or hung process)") if silent else ""
            c.add("nccl_job", "GpunetNcclRasUnreachable", where,
                  f"{_plural(listening, 'NCCL process', 'NCCL processes')} "
                  f"{_verb(listening, 'listens', 'listen')} on the port but none gave a "
                  f"report{why}; the job's health is unknown",
                  f"ss -ltnp 'sport = :{port}'  # who listens; then ps -o pid,stat,cmd -p PID "
                  f"(stat T: stopped); {confirm}")
        if ok != 1:
            continue
        get = _reader(b, port)
        dead = get("gpunet_nccl_job_processes", state="dead")
        errored = get("gpunet_nccl_ranks_errored")
        if dead > 0:
            c.add("nccl_job", "GpunetNcclRankDead", where,
                  f"{_plural(dead, 'process', 'processes')} of the job "
                  f"{_verb(dead, 'is', 'are')} considered dead by RAS"
                  + (f"; {_plural(errored, 'other rank')} {_verb(errored, 'holds', 'hold')}"
                     " an error" if errored else "")
                  + f": the job waits for {_verb(dead, 'it', 'them')} or is about to fail",
                  confirm)
        unreachable = get("gpunet_nccl_missing_ranks", reason="unreachable")
        if unreachable > 0:
            c.add("nccl_job", "GpunetNcclRankUnreachable", where,
                  f"{_plural(unreachable, 'rank')} {_verb(unreachable, 'does', 'do')} not answer "
                  "RAS: their process is stopped, hung or cut off", confirm)
        stalled = get("gpunet_nccl_stalled_ranks")
        if stalled > 0:
            skew = max((v for _, v in b.all("gpunet_nccl_collective_skew_operations",
                                            port=port)), default=0.0)
            c.add("nccl_job", "GpunetNcclRankStalled", where,
                  f"{_plural(stalled, 'rank')} {_verb(stalled, 'launches', 'launch')} no more "
                  f"collectives, up to {_plural(skew, 'operation')} behind the other ranks of "
                  "the communicator, which wait for them", confirm)
        c.notes.append(Note(where, _job_summary(b, port)))


def _reader(b: Snapshot, port: str) -> Callable[..., float]:
    """The value of one of the port's series (0 when absent)."""
    def get(name: str, **match: str) -> float:
        return b.get(name, port=port, **match) or 0.0
    return get


def _job_summary(b: Snapshot, port: str) -> str:
    """One job in operators' words: who runs it, how its communicators stand, what is wrong."""
    get = _reader(b, port)

    version = next((lbl.get("version", "") for lbl, _ in b.all("gpunet_nccl_ras_info",
                                                               port=port)), "")
    procs = {state: get("gpunet_nccl_job_processes", state=state)
             for state in ("answering", "unresponsive", "dead")}
    comms = {lbl["status"]: v for lbl, v in b.all("gpunet_nccl_communicators", port=port) if v}
    expected = get("gpunet_nccl_communicator_ranks", state="expected")
    seen = get("gpunet_nccl_communicator_ranks", state="seen")
    parts = [f"NCCL {version}: " if version else "",
             _plural(sum(procs.values()), "process", "processes"),
             f" on {_plural(get('gpunet_nccl_job_nodes'), 'node')}"
             f" with {_plural(get('gpunet_nccl_job_gpus'), 'GPU')}; "]
    parts.append(", ".join(f"{_plural(n, 'communicator')} {status}"
                           for status, n in sorted(comms.items())) or "no communicator")
    parts.append(f"; {seen:.0f} of {expected:.0f} ranks answered")
    trouble = [_plural(n, f"process {state}", f"processes {state}")
               for state, n in procs.items() if state != "answering" and n]
    if errored := get("gpunet_nccl_ranks_errored"):
        trouble.append(_plural(errored, "rank with an error", "ranks with an error"))
    if stalled := get("gpunet_nccl_stalled_ranks"):
        trouble.append(_plural(stalled, "rank stuck", "ranks stuck"))
    if idle := get("gpunet_nccl_communicators_without_progress"):
        trouble.append(_plural(idle, "communicator") + " without progress since the "
                       "previous report (idle, or hung as a whole)")
    if trouble:
        parts.append("; " + ", ".join(trouble))
    return "".join(parts)


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
    simple("GpunetBusBandwidthBelowLinkRate", "collective", "warning", "10m", BELOW_LINK_RATE,
           "All-reduce through the NICs well below the link rate",
           f"The probe's all-reduce {SCOPE} reaches {{{{ $value | humanizePercentage }}}} of "
           "what its RDMA links allow (gpunet_probe_link_bandwidth_bytes_per_second)."),
    simple("GpunetBusBandwidthBelowNvlink", "collective", "warning", "10m", BELOW_NVLINK,
           "All-reduce over NVLink well below what the NVLinks carry",
           f"The probe's all-reduce {SCOPE} reaches {{{{ $value | humanizePercentage }}}} of "
           "what its GPUs' NVLinks carry (gpunet_probe_nvlink_bandwidth_bytes_per_second)."),
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
          node_suspect,
          "Node in every failing or slow pair of the pair plan",
          "All {{ $value }} pairs of {{ $labels.instance }} failed or were slow in the last "
          "pair round while the fleet's other pairs were not: the node, not its links, is the "
          "common factor."),
    Alert("GpunetFleetBandwidthOutlier", "collective", "warning", "5m", _fleet_outlier,
          "Node's pair bandwidth a robust outlier of the fleet",
          "The median bus bandwidth of the pairs of {{ $labels.instance }} is {{ $value | "
          "humanize }}B/s, below the fleet's median node by more than the robust-sigma "
          f"threshold (1.4826 x MAD, {FLEET_MAD_BW}) and the ratio threshold."),
    Alert("GpunetFleetProbeStale", "collective", "warning", "0m",
          lambda t: ("time() - gpunet_fleet_round_timestamp_seconds > "
                     f"{_g(t.fleet.stale_seconds)}"),
          "No recent pair round of the pair plan",
          "The last pair round of {{ $labels.instance }} ended {{ $value | humanizeDuration }} "
          "ago: the fleet alerts judge old results."),
)


def recording(t: Thresholds) -> list[Rule]:
    """The probes' fleet median per scope and size (the node rules' group)."""
    return [{
        "record": FLEET_MEDIAN_BUSBW,
        "expr": ("quantile by (scope, size) (0.5, "
                 "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second)"),
    }]


def fleet_recording(t: Thresholds) -> list[Rule]:
    """The pair plan's recording rules, a group of their own (rules.FLEET_GROUP): per-node and
    fleet statistics of the pair bandwidth, the slow pairs and each node's healthy pairs. The
    exporter serves a bandwidth only for a pair that succeeded, and its own counts of measured
    and succeeded pairs, so no rule filters or counts the pairs again; and only the few slow
    pairs are recorded per pair (reading 40,000 pairs costs little, writing them back much)."""
    f = t.fleet
    return [
        {"record": NODE_MEDIAN_BW, "expr": f"quantile by (instance, job) (0.5, {PAIR_BW})"},
        {"record": FLEET_MEDIAN_BW, "expr": f"quantile by (job) (0.5, {NODE_MEDIAN_BW})"},
        {"record": FLEET_MAD_BW,
         "expr": (f"quantile by (job) (0.5,\n  abs({NODE_MEDIAN_BW}\n"
                  f"    - on (job) group_left {FLEET_MEDIAN_BW})\n)")},
        {"record": FLEET_NODES, "expr": f"count by (job) ({NODE_MEDIAN_BW})"},
        {"record": PAIR_SLOW,
         "expr": pair_ratio() + f" < {_g(f.link_slow_ratio)}"},
        {"record": NODE_PAIRS_HEALTHY,
         "expr": (f"{NODE_PAIRS_OK}\n  - on (instance, job) count by (instance, job) "
                  f"({PAIR_SLOW})\nor on (instance, job)\n{NODE_PAIRS_OK}")},
    ]


def leaf_recording(t: Thresholds) -> list[Rule]:
    """The per-leaf intra and cross medians, a group of their own (rules.LEAF_GROUP): they read
    only scraped series, and cost as much as the rest of the fleet's rules together."""

    def leaf_median(cross: str) -> str:
        """Per leaf, the median of the pairs that ran from its nodes to peers on the same leaf
        (cross "false") or on another (cross "true"), both leaves known (PAIR_INFO)."""
        return (f"quantile by (job, leaf) (0.5,\n  {PAIR_BW}\n"
                f"  * on (instance, job, peer) group_left (leaf)\n"
                f'  {PAIR_INFO}{{cross_leaf="{cross}"}}\n)')

    return [
        {"record": LEAF_INTRA_BW, "expr": leaf_median("false")},
        {"record": LEAF_CROSS_BW, "expr": leaf_median("true")},
        {"record": LEAF_CROSS_RATIO,
         "expr": f"{LEAF_CROSS_BW}\n/ on (job, leaf) {LEAF_INTRA_BW}"},
    ]


# The doctor's checks, in steps (mixin.alerts.DOCTOR_ORDER).
CHECKS: dict[str, tuple[DoctorCheck, ...]] = {
    "collectives": (check_probe, BELOW_LINK_RATE, BELOW_NVLINK, check_straggler),
    "nccl_jobs": (check_nccl_jobs,)}
# Alerts the doctor cannot check, and why.
UNCHECKED: dict[str, str] = {
    "GpunetProbeTimeVariance": "a variation over hours of probe rounds; the doctor sees one",
    "GpunetProbeStale": "the time since the last probe round; the doctor asks for a round",
    "GpunetProbeIdleUnknown": "reported as a problem (could not check), not a finding",
    "GpunetFleetNodeSuspect": "the pair plan's fleet statistics: no node sees them alone",
    "GpunetFleetBandwidthOutlier": "the pair plan's fleet statistics: no node sees them alone",
    "GpunetFleetProbeStale": "the pair plan's rounds, run by the fleet, not by the doctor",
}
