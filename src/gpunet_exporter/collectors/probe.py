"""probe collector: the results of micro all-reduce probes (probe/runner.py) and of fleet pairs.

The collector never imports torch. With ``runner: intra`` the probe's supervisor
(probe/supervisor.py) keeps ``gpunet-probe run`` running while the GPUs are idle; scrapes read
only its last snapshot and the result files of ``state_dir`` (probe/results.py, and
``pairs.json`` of probe/pairs.py as the gpunet_fleet_* metrics). Design notes:
docs/architecture.md, "collectors"; the probe itself: docs/probe.md and docs/fleet.md. The keys
that are options of ``gpunet-probe run`` are declared once, in probe/run_options.py.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

from prometheus_client.core import Metric

from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec, Scrape
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.probe import idle, pairs, results, run_options, supervisor
from gpunet_exporter.probe.results import NO_TORCH, Result
from gpunet_exporter.probe.run_options import RunOptions, key
from gpunet_exporter.sources import nvml, rdma

REASONS = supervisor.REASONS
_S = ("scope",)
# Every value of a round is from the probe's last round (every probe.interval_seconds);
# gpunet_probe_last_round_timestamp_seconds says when (docs/reading-metrics.md).
_FILE = "<probe.state_dir>/<scope>.json, written by gpunet-probe"
SUCCESS = MetricSpec(
    "gpunet_probe_success", "gauge",
    "1 if the last probe round of the scope finished with results, else 0", _S, "boolean",
    _FILE)
LAST_ROUND = MetricSpec(
    "gpunet_probe_last_round_timestamp_seconds", "gauge",
    "Unix time the last probe round ended, successful or not", _S, "seconds", _FILE)
LAST_SUCCESS = MetricSpec(
    "gpunet_probe_last_success_timestamp_seconds", "gauge",
    "Unix time the last successful probe round ended (alert when it grows old)", _S, "seconds",
    _FILE)
DURATION = MetricSpec(
    "gpunet_probe_duration_seconds", "gauge",
    "Wall time of the last probe round, all sizes", _S, "seconds", _FILE)
FAILURES = MetricSpec(
    "gpunet_probe_failures_total", "counter",
    "Probe rounds that gave no or partial results, by reason", ("scope", "reason"), "rounds",
    "the probe supervisor and result files")
_SUPERVISOR = "the probe supervisor, from NVML's compute and graphics processes of every GPU"
STATE = MetricSpec(
    "gpunet_probe_state", "gauge",
    "1 for the probe's current state, else 0", ("state",), "boolean", _SUPERVISOR)
STATE_SINCE = MetricSpec(
    "gpunet_probe_state_since_timestamp_seconds", "gauge",
    "Unix time the probe's current state (gpunet_probe_state) began", (), "seconds", _SUPERVISOR)
IDLE_SINCE = MetricSpec(
    "gpunet_probe_idle_since_timestamp_seconds", "gauge",
    "Unix time the node's GPUs became idle for the probe", (), "seconds", _SUPERVISOR)
FOREIGN = MetricSpec(
    "gpunet_probe_foreign_processes", "gauge",
    "Processes on the node's GPUs that are not the probe's, at the supervisor's last look", (),
    "processes", _SUPERVISOR)
YIELDS = MetricSpec(
    "gpunet_probe_yields_total", "counter",
    "Times the probe's runner and workers were killed because a foreign process appeared on a "
    "GPU", (), "yields", _SUPERVISOR)
RUNNING = MetricSpec(
    "gpunet_probe_runner_running", "gauge",
    "1 while the exporter's probe runner process is alive (runner: intra), else 0", (),
    "boolean", "the probe supervisor")
LATENCY = MetricSpec(
    "gpunet_probe_allreduce_seconds", "gauge",
    "All-reduce time per message size: median, p99 or max over the timed iterations",
    ("scope", "size", "stat"), "seconds", _FILE)
ALGBW = MetricSpec(
    "gpunet_probe_allreduce_algorithm_bandwidth_bytes_per_second", "gauge",
    "Algorithm bandwidth of a tight loop of all-reduces, as nccl-tests times it",
    ("scope", "size"),
    "bytes per second", _FILE)
BUSBW = MetricSpec(
    "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", "gauge",
    "Bus bandwidth of the tight loop, nccl-tests' algbw x 2(n-1)/n",
    ("scope", "size"), "bytes per second", _FILE)
SKIPPED = MetricSpec(
    "gpunet_probe_size_skipped", "gauge",
    "1 when the last round skipped this size because a GPU was busy with other work",
    ("scope", "size"), "boolean", _FILE)
STRAGGLER_WAIT = MetricSpec(
    "gpunet_probe_straggler_wait_seconds", "gauge",
    "What the other ranks wait for the rank that arrives last at the all-reduce", _S, "seconds",
    _FILE)
STRAGGLER_RATIO = MetricSpec(
    "gpunet_probe_straggler_wait_ratio", "gauge",
    "The straggler wait as a share of the other ranks' time in the collective", _S, "ratio",
    _FILE)
STRAGGLER = MetricSpec(
    "gpunet_probe_straggler_info", "gauge",
    "Always 1, on the node of a late rank: its rank and local GPU index",
    ("scope", "rank", "gpu"), "", _FILE)
LINK = MetricSpec(
    "gpunet_probe_link_bandwidth_bytes_per_second", "gauge",
    "The bus bandwidth the RDMA ports the ranks used allow", _S, "bytes per second",
    _FILE + ", from /sys/class/infiniband/<device>/ports/<port>/rate")
LINK_RATIO = MetricSpec(
    "gpunet_probe_bus_bandwidth_link_ratio", "gauge",
    "Bus bandwidth of the largest size over gpunet_probe_link_bandwidth_bytes_per_second", _S,
    "ratio", _FILE)
NVLINK = MetricSpec(
    "gpunet_probe_nvlink_bandwidth_bytes_per_second", "gauge",
    "One direction of the active NVLinks of the ranks' GPUs, the least of them (intra scope)", _S,
    "bytes per second", _FILE + ", from NVML's NVLink speed field per active link")
NVLINK_RATIO = MetricSpec(
    "gpunet_probe_bus_bandwidth_nvlink_ratio", "gauge",
    "Bus bandwidth of the largest size over gpunet_probe_nvlink_bandwidth_bytes_per_second", _S,
    "ratio", _FILE)
HCA_RANKS = MetricSpec(
    "gpunet_probe_hca_ranks", "gauge",
    "This node's probe ranks whose NCCL used this RDMA port in the last round",
    ("scope", "device", "port"), "ranks", _FILE + ", from NCCL's INFO log")
HCA_GDR = MetricSpec(
    "gpunet_probe_hca_gdr_active", "gauge",
    "1 when the NET channels of the ranks on this RDMA port used GPUDirect RDMA, else 0",
    ("scope", "device", "port"), "boolean",
    "NCCL INFO log, /GDRDMA on NET channels")
WORLD = MetricSpec("gpunet_probe_world_size", "gauge", "Ranks in the last probe round", _S,
                   "ranks", _FILE)
INFO = MetricSpec(
    "gpunet_probe_info", "gauge", "Always 1: the backend and NCCL version of the last round",
    ("scope", "backend", "nccl_version"), "", _FILE)
TRANSPORT = MetricSpec(
    "gpunet_probe_transport_info", "gauge",
    "Always 1, for each transport NCCL's channels used in the last successful round",
    ("scope", "transport", "net"), "", "NCCL INFO log of the probe, per-connection lines")
GDR = MetricSpec(
    "gpunet_probe_gdr_active", "gauge",
    "1 when NCCL's network channels used GPUDirect RDMA, else 0", _S, "boolean",
    "NCCL INFO log, /GDRDMA on NET channels")
SOCKET_FALLBACK = MetricSpec(
    "gpunet_probe_socket_fallback", "gauge",
    "1 when NCCL sends over TCP sockets although it should not, else 0", _S, "boolean",
    "NCCL INFO log and /sys/class/infiniband/*/ports/*/state")
PROBLEM = MetricSpec(
    "gpunet_probe_nccl_problem", "gauge",
    "Always 1, for each problem the NCCL log of the last successful round shows",
    ("scope", "problem"), "",
    "NCCL INFO log of the probe")


_PAIRS = "<probe.state_dir>/pairs.json, written by the fleet pair probe on both nodes of a pair"
_PEER = ("peer",)
# Only the peers of the last plan, at most probe.fleet_max_peers (docs/reading-metrics.md).
PAIR_BUSBW = MetricSpec(
    "gpunet_fleet_pair_bus_bandwidth_bytes_per_second", "gauge",
    "Bus bandwidth of the last pair probe between this node and peer",
    _PEER, "bytes per second", _PAIRS)
PAIR_LATENCY = MetricSpec(
    "gpunet_fleet_pair_latency_seconds", "gauge",
    "Latency of the last pair probe between this node and peer (a small message)",
    _PEER, "seconds", _PAIRS)
PAIR_SUCCESS = MetricSpec(
    "gpunet_fleet_pair_success", "gauge",
    "1 if the last pair probe between this node and peer succeeded, else 0",
    _PEER, "boolean", _PAIRS)
PAIR_SKIPPED = MetricSpec(
    "gpunet_fleet_pair_skipped", "gauge",
    "Always 1, for each peer whose last pair was not measured, and why", ("peer", "reason"), "",
    _PAIRS)
PAIR_INFO = MetricSpec(
    "gpunet_fleet_pair_info", "gauge",
    "Always 1, for each peer: both leaves, whether they differ, the network and GDR used",
    ("peer", "leaf", "peer_leaf", "cross_leaf", "transport", "gdr"),
    "", _PAIRS)
NODE_INFO = MetricSpec(
    "gpunet_fleet_node_info", "gauge",
    "Always 1 while a pairs file is read: this node's name (its peers' peer label for it) and leaf",
    ("name", "leaf"), "", _PAIRS)
ROUND_TS = MetricSpec(
    "gpunet_fleet_round_timestamp_seconds", "gauge",
    "Unix time of the last pair round this node took part in (alert when it grows old)", (),
    "seconds", _PAIRS)
PAIRS_DROPPED = MetricSpec(
    "gpunet_fleet_pairs_dropped", "gauge",
    "Peers of the last plan left out of the gpunet_fleet_pair_* metrics, over "
    "probe.fleet_max_peers", (), "peers", _PAIRS)
PAIRS_MEASURED = MetricSpec(
    "gpunet_fleet_pairs_measured", "gauge",
    "Pairs of the last plan exported here that were measured, succeeded or failed (not skipped)",
    (), "pairs", _PAIRS)
PAIRS_SUCCEEDED = MetricSpec(
    "gpunet_fleet_pairs_succeeded", "gauge",
    "Pairs of the last plan exported here that were measured and succeeded", (), "pairs",
    _PAIRS)
FLEET_METRICS = (PAIR_BUSBW, PAIR_LATENCY, PAIR_SUCCESS, PAIR_SKIPPED, PAIR_INFO, NODE_INFO,
                 ROUND_TS, PAIRS_DROPPED, PAIRS_MEASURED, PAIRS_SUCCEEDED)
FLEET_SCOPE = "fleet"  # where an unreadable pairs.json counts in gpunet_probe_failures_total


@dataclass(frozen=True)
class ProbeSettings(Settings):
    """probe: the keys declared with ``key`` are options of `gpunet-probe run`, which
    run_options.RunOptions declares."""

    runner: str = setting(
        "`intra`: the exporter starts and supervises the intra-node runner; `none`: it only "
        "exports the results cluster-mode ranks write into `state_dir`", default="intra",
        choices=("intra", "none"))
    state_dir: str = setting("where result files are written and read (the runner's log is "
                             "`runner.log` there)", default="/var/lib/gpunet-exporter/probe")
    command: tuple[str, ...] = setting(
        "the runner program (empty: `<this Python> -m gpunet_exporter.probe.cli`, i.e. "
        "`gpunet-probe` of the exporter's environment, which needs the `probe` extra: torch)",
        default=())
    backend: str = key("backend")
    nprocs: int = key("nprocs")
    scopes: tuple[str, ...] = key("scopes")
    pin_hca: bool = key("pin_hca")
    straggler_min_ratio: float = key("straggler_min_ratio")
    sizes: tuple[int, ...] = key("sizes")
    warmup: int = key("warmup")
    iterations: int = key("iterations")
    interval_seconds: float = key("interval_seconds")
    timeout_seconds: float = key("timeout_seconds")
    memory_cap_bytes: int = key("memory_cap_bytes")
    busy_utilization: float = key("busy_utilization")
    holdoff_seconds: float = setting(
        "rounds run only once no process other than the probe's has been on any GPU for this "
        "long (and since the exporter started); the probe's workers leave the moment one "
        "appears", default=120.0, minimum=0)
    skip_busy: bool = key("skip_busy")
    fleet_max_peers: int = setting(
        "most peers of `pairs.json` (fleet pair probes) exported with a `peer` label; the rest "
        "are dropped, failed pairs kept first, and counted in `gpunet_fleet_pairs_dropped`",
        default=64, minimum=1)


class ProbeCollector(Collector):
    name = "probe"
    description = ("Micro all-reduce probes through torch.distributed/NCCL run outside the "
                   "scrape: latency, bus bandwidth, stragglers, NCCL transport and GDR")
    default_enabled = False  # it puts work on the GPUs: an operator turns it on
    metrics = (SUCCESS, LAST_ROUND, LAST_SUCCESS, DURATION, FAILURES, RUNNING, STATE,
               STATE_SINCE, IDLE_SINCE, FOREIGN, YIELDS, LATENCY, ALGBW,
               BUSBW, SKIPPED, STRAGGLER_WAIT, STRAGGLER_RATIO, STRAGGLER, LINK, LINK_RATIO, NVLINK,
               NVLINK_RATIO,
               HCA_RANKS, HCA_GDR, WORLD, INFO, TRANSPORT, GDR, SOCKET_FALLBACK, PROBLEM,
               *FLEET_METRICS)
    settings_type = ProbeSettings
    settings: ProbeSettings
    unknown_checks: ClassVar[Mapping[str, str]] = {
        "allreduce": "the probe's all-reduce rounds and every alert on them: the runner's "
                     "Python has no PyTorch"}

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        cfg = self.settings
        self.state_dir = cfg.state_dir
        self._unknown: Mapping[str, str] = {}
        self._known_own: set[int] = set()
        self.supervisor = supervisor.Supervisor(
            self.state_dir, self.command() if cfg.runner == "intra" else None,
            interval=float(cfg.interval_seconds), timeout=float(cfg.timeout_seconds),
            default_scope=(cfg.scopes or ("intra",))[0], log=ctx.log_once,
            logger=ctx.logger, look=self.foreign_processes,
            holdoff=float(cfg.holdoff_seconds),
            describe=lambda pids: idle.describe(pids, ctx.procfs))
        if ctx.learn and cfg.runner == "intra":  # the service: the hold-off counts from now
            self.supervisor.start()

    def foreign_processes(self) -> set[int] | None:
        """The processes on the node's GPUs that are not the probe's (None: cannot tell). With
        gloo on a node without NVIDIA's library there is no GPU to protect: none."""
        session = nvml.session(self.ctx.nvml_module)
        # A one-off reader (the doctor) does not wait for the exporter's own probe: the
        # exporter sees the doctor's ranks as foreign and yields to them.
        found = idle.foreign_on_gpus(session, self.ctx.procfs, nvml.own_sessions(),
                                     self._known_own, self.settings.backend,
                                     probes_are_own=not self.ctx.learn)
        if found is not None and session.state == "absent":
            self.supervisor.gate.holdoff = 0.0  # gloo, no GPU: nothing to wait for
        return found

    def command(self) -> list[str]:
        """The runner's command line: its options only where the configuration differs from
        their defaults."""
        cfg = self.settings
        base = list(cfg.command or (sys.executable, "-m", "gpunet_exporter.probe.cli"))
        run = RunOptions(state_dir=self.state_dir, sysfs=self.ctx.sysfs.root,
                         **run_options.keys(cfg))
        return [*base, "run", *run_options.argv(run)]

    # -- scrape ----------------------------------------------------------------------------

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        self.supervisor.start()
        snap = self.supervisor.snapshot()
        fams = Families()
        if snap.running is not None:
            fams.add(RUNNING, [], int(snap.running))
        if snap.state:
            for state in idle.STATES:
                fams.add(STATE, [state], int(state == snap.state))
            fams.add(STATE_SINCE, [], snap.state_since)
            fams.add(FOREIGN, [], snap.foreign)
            fams.add(YIELDS, [], snap.yields)
            if snap.idle_since is not None:
                fams.add(IDLE_SINCE, [], snap.idle_since)
        rdma_active = functools.cache(self._rdma_active)  # read once a scrape, if at all
        self._unknown = {}
        for scope, view in snap.scopes.items():
            last, good, failures = view.last, view.good, view.failures
            if last is not None and last.failure == "init_error" and last.error == NO_TORCH:
                self._unknown = {"allreduce": "library_missing"}
            if last is None and not any(failures.values()):
                continue  # this scope does not run here (inter: no cluster-mode rounds)
            for reason, n in failures.items():
                fams.add(FAILURES, [scope, reason], n)
            if last is None:
                continue
            fams.add(SUCCESS, [scope], int(last.success))
            fams.add(LAST_ROUND, [scope], last.time)
            if good is None:
                continue
            self._export_result(fams, scope, good)
            if good.backend != "nccl":
                continue
            fallback = results.socket_fallback(scope, good.backend, good.transports,
                                               good.net_transports, rdma_active)
            fams.add(SOCKET_FALLBACK, [scope], int(fallback))
        if snap.pairs_seen:
            fams.add(FAILURES, [FLEET_SCOPE, "bad_result"], snap.pair_failures)
        if snap.pairs is not None:
            self._export_pairs(fams, snap.pairs, self.settings.fleet_max_peers)
        yield from fams

    def unknown(self) -> Mapping[str, str]:
        """``allreduce`` while the latest round of a scope failed because the runner's Python
        has no torch (its result file says so)."""
        return self._unknown

    @staticmethod
    def _export_pairs(fams: Families, view: pairs.Pairs, max_peers: int) -> None:
        fams.add(NODE_INFO, [view.node, view.leaf or ""], 1)
        fams.add(ROUND_TS, [], view.round_timestamp)
        # Failed pairs first (stable otherwise): the cap never hides a bad peer behind good ones.
        kept = sorted(view.pairs, key=lambda p: not p.failed)[:max_peers]
        fams.add(PAIRS_DROPPED, [], len(view.pairs) - len(kept))
        fams.add(PAIRS_MEASURED, [], sum(1 for p in kept if p.skipped is None))
        fams.add(PAIRS_SUCCEEDED, [], sum(1 for p in kept if p.ok))
        for p in kept:
            gdr = "" if p.gdr is None else str(p.gdr).lower()
            # cross_leaf: "true" or "false" when both leaves are known, else empty (absent).
            cross = (str(view.leaf != p.peer_leaf).lower() if view.leaf and p.peer_leaf
                     else "")
            fams.add(PAIR_INFO, [p.peer, view.leaf or "", p.peer_leaf or "", cross,
                                 p.transport or "", gdr], 1)
            if p.skipped is not None:  # not measured: no success, neither 1 nor 0, no numbers
                fams.add(PAIR_SKIPPED, [p.peer, p.skipped], 1)
                continue
            fams.add(PAIR_SUCCESS, [p.peer], int(p.ok))
            if p.latency_seconds is not None:
                fams.add(PAIR_LATENCY, [p.peer], p.latency_seconds)
            # Only a pair that succeeded has a bandwidth: an end that measured while the other
            # failed keeps its number in the file, but the fleet's statistics (docs/fleet.md)
            # read the series as it is, with no filter on success to recompute.
            if p.ok and p.bus_bandwidth_bytes_per_second is not None:
                fams.add(PAIR_BUSBW, [p.peer], p.bus_bandwidth_bytes_per_second)

    @staticmethod
    def _export_result(fams: Families, scope: str, good: Result) -> None:
        fams.add(LAST_SUCCESS, [scope], good.time)
        fams.add(DURATION, [scope], max(0.0, good.time - good.started))
        fams.add(WORLD, [scope], good.world_size)
        fams.add(INFO, [scope, good.backend, good.nccl_version], 1)
        if good.world_size < 2:
            return  # one rank reduces nothing: no latency or bandwidth worth a number
        st = good.straggler
        if st is not None:
            fams.add(STRAGGLER_WAIT, [scope], st.wait_seconds)
            fams.add(STRAGGLER_RATIO, [scope], st.wait_ratio)
            if st.rank is not None and st.local:
                fams.add(STRAGGLER, [scope, str(st.rank),
                                     "" if st.gpu is None else str(st.gpu)], 1)
        for s in good.sizes:
            size = str(s.bytes)
            fams.add(SKIPPED, [scope, size], int(s.skipped))
            if s.skipped:
                continue
            for stat, v in (("median", s.median_seconds), ("p99", s.p99_seconds),
                            ("max", s.max_seconds)):
                fams.add(LATENCY, [scope, size, stat], v)
            fams.add(ALGBW, [scope, size], s.algbw_bytes_per_second)
            fams.add(BUSBW, [scope, size], s.busbw_bytes_per_second)
        largest = max(good.sizes, key=lambda x: x.bytes, default=None)
        for spec, ratio, bandwidth in ((LINK, LINK_RATIO, good.link_bytes_per_second),
                                       (NVLINK, NVLINK_RATIO, good.nvlink_bytes_per_second)):
            if bandwidth:
                fams.add(spec, [scope], bandwidth)
                if largest is not None and not largest.skipped:
                    fams.add(ratio, [scope], largest.busbw_bytes_per_second / bandwidth)
        for h in good.hcas:
            fams.add(HCA_RANKS, [scope, h.device, h.port], len(h.ranks))
            if h.gdr is not None:
                fams.add(HCA_GDR, [scope, h.device, h.port], int(h.gdr))
        if good.backend != "nccl":
            return
        for t in good.transports:
            nets = good.net_transports if t == "NET" else ("",)
            for net in nets or ("",):
                fams.add(TRANSPORT, [scope, t, net], 1)
        if good.gdr is not None:
            fams.add(GDR, [scope], int(good.gdr))
        for problem in good.problems:
            fams.add(PROBLEM, [scope, problem], 1)

    def summary(self) -> str:
        snap = self.supervisor.snapshot()
        if not snap.state:
            return ""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap.state_since))
        what = {idle.MEASURING: "measuring: the GPUs are idle",
                idle.FAILING: "failing: the GPUs are idle, rounds fail",
                idle.HOLDOFF: f"hold-off: waiting for {self.settings.holdoff_seconds:g} s "
                              "without other GPU processes",
                idle.YIELDED: f"yielded: {snap.foreign} other process(es) on the GPUs",
                idle.UNKNOWN: "unknown: the GPUs' processes cannot be read (NVML), no rounds",
                }.get(snap.state, snap.state)
        good = [v.good.time for v in snap.scopes.values() if v.good is not None]
        last = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(max(good))) if good
                else "never")
        return f"probe {what}, since {since}; last complete round {last}"

    def _rdma_active(self) -> bool:
        return bool(rdma.active_ports(self.ctx.sysfs))

    def close(self) -> None:
        self.supervisor.close()
