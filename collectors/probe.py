"""probe collector: the results of micro all-reduce probes (exporter/probe/runner.py).

The collector never imports torch. With ``runner: intra`` (default) a supervisor thread starts
``gpunet-probe run`` in its own process group, which keeps running rounds every
``interval_seconds``: the ``intra`` scope (the GPUs among themselves, with two or more) and the
``net`` scope (the GPUs through the node's NICs). The launcher kills a group whose start or round
takes longer than ``timeout_seconds`` itself; a launcher whose status file has not moved for
that long and a grace period more has its whole process group killed (a hung NCCL never blocks
anything) and is started again, as it is after any exit. Results come from the files the runner
writes atomically into ``state_dir`` (exporter/probe/results.py); cluster-mode ranks started by
torchrun or srun write ``inter.json`` there, and the collector exports whatever it finds, so
``runner: none`` serves those alone.

Scrapes read only what the supervisor thread cached: every value is from the last round, whose
time and success come with it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import IO

from prometheus_client.core import Metric

from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.probe import results
from gpunet_exporter.probe.results import Result
from gpunet_exporter.sources import nvml, rdma

REASONS = (*results.FAILURE_REASONS, "bad_result")
_S = ("scope",)
_CACHED = (" Cached: from the probe's last round (every probe.interval_seconds; "
           "gpunet_probe_last_round_timestamp_seconds says when)")
_FILE = "<probe.state_dir>/<scope>.json, written by gpunet-probe"
POLL_SECONDS = 0.5
RESTART_BACKOFF_MAX = 60.0
GRACE_MAX = 10.0  # seconds past a phase's own limit before the supervisor kills the launcher

SUCCESS = MetricSpec(
    "gpunet_probe_success", "gauge",
    "1 if the last probe round finished with results, else 0 (timeout, error, no GPU); scope "
    "intra: this node's GPUs among themselves (NVLink/P2P, SHM), net: this node's GPUs through "
    "its NICs (NIC loopback), inter: a cluster-mode round across nodes", _S, "boolean", _FILE)
LAST_ROUND = MetricSpec(
    "gpunet_probe_last_round_timestamp_seconds", "gauge",
    "Unix time the last probe round ended, successful or not", _S, "seconds", _FILE)
LAST_SUCCESS = MetricSpec(
    "gpunet_probe_last_success_timestamp_seconds", "gauge",
    "Unix time the last successful probe round ended (alert when it grows old)", _S, "seconds",
    _FILE)
DURATION = MetricSpec(
    "gpunet_probe_duration_seconds", "gauge",
    "Wall time of the last probe round, all sizes" + _CACHED, _S, "seconds", _FILE)
FAILURES = MetricSpec(
    "gpunet_probe_failures_total", "counter",
    "Probe rounds that gave no or partial results, by reason: timeout (killed after "
    "probe.timeout_seconds), crash (the runner exited without saying why), nccl_error, "
    "init_error, error, no_gpu, bad_result (an unreadable result file), skipped_busy (sizes "
    "skipped because GPUs were busy with other work)", ("scope", "reason"), "rounds",
    "the probe supervisor and result files")
RUNNING = MetricSpec(
    "gpunet_probe_runner_running", "gauge",
    "1 while the exporter's probe runner process is alive (runner: intra), else 0", (),
    "boolean", "the probe supervisor")
LATENCY = MetricSpec(
    "gpunet_probe_allreduce_seconds", "gauge",
    "All-reduce time per message size: median, p99 or max over the timed iterations; an "
    "iteration's time is the collective once every rank arrived (the shortest of the ranks' "
    "own times: waiting for a late rank is gpunet_probe_straggler_wait_seconds)" + _CACHED,
    ("scope", "size", "stat"), "seconds", _FILE)
ALGBW = MetricSpec(
    "gpunet_probe_allreduce_algorithm_bandwidth_bytes_per_second", "gauge",
    "Algorithm bandwidth: message bytes / median time" + _CACHED, ("scope", "size"),
    "bytes per second", _FILE)
BUSBW = MetricSpec(
    "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", "gauge",
    "Bus bandwidth, nccl-tests' all-reduce formula algbw x 2(n-1)/n" + _CACHED,
    ("scope", "size"), "bytes per second", _FILE)
SKIPPED = MetricSpec(
    "gpunet_probe_size_skipped", "gauge",
    "1 when the last round skipped this size because a GPU was busy with other work",
    ("scope", "size"), "boolean", _FILE)
STRAGGLER_WAIT = MetricSpec(
    "gpunet_probe_straggler_wait_seconds", "gauge",
    "What the other ranks wait for the rank that arrives last at the all-reduce: the median over "
    "iterations of their time in the collective minus that rank's, at the largest size measured"
    + _CACHED, _S, "seconds", _FILE)
STRAGGLER_RATIO = MetricSpec(
    "gpunet_probe_straggler_wait_ratio", "gauge",
    "That wait as a share of the other ranks' time in the collective (0.5: they took twice as "
    "long as the collective itself)" + _CACHED, _S, "ratio", _FILE)
STRAGGLER = MetricSpec(
    "gpunet_probe_straggler_info", "gauge",
    "Always 1, on the node of the late rank only, while the others wait at least "
    "probe.straggler_min_ratio of their time for it: its rank and local GPU index" + _CACHED,
    ("scope", "rank", "gpu"), "", _FILE)
LINK = MetricSpec(
    "gpunet_probe_link_bandwidth_bytes_per_second", "gauge",
    "The bus bandwidth the links allow: over the RDMA ports the ranks used, the lowest link rate "
    "divided by the ranks sharing that port" + _CACHED, _S, "bytes per second",
    _FILE + ", from /sys/class/infiniband/<device>/ports/<port>/rate")
LINK_RATIO = MetricSpec(
    "gpunet_probe_bus_bandwidth_link_ratio", "gauge",
    "Bus bandwidth of the largest size over gpunet_probe_link_bandwidth_bytes_per_second (the "
    "documented target is at least 0.8); absent when that size was skipped" + _CACHED, _S,
    "ratio", _FILE)
HCA_RANKS = MetricSpec(
    "gpunet_probe_hca_ranks", "gauge",
    "This node's probe ranks whose NCCL used this RDMA port in the last round (net scope: "
    "each rank is pinned to the ACTIVE port nearest its GPU)" + _CACHED,
    ("scope", "device", "port"), "ranks", _FILE + ", from NCCL's INFO log")
HCA_GDR = MetricSpec(
    "gpunet_probe_hca_gdr_active", "gauge",
    "1 when the NET channels of the ranks on this RDMA port used GPUDirect RDMA, 0 when not; "
    "absent without NET channels" + _CACHED, ("scope", "device", "port"), "boolean",
    "NCCL INFO log, /GDRDMA on NET channels")
WORLD = MetricSpec("gpunet_probe_world_size", "gauge", "Ranks in the last probe round", _S,
                   "ranks", _FILE)
INFO = MetricSpec(
    "gpunet_probe_info", "gauge", "Always 1; the backend and NCCL version of the last round",
    ("scope", "backend", "nccl_version"), "", _FILE)
TRANSPORT = MetricSpec(
    "gpunet_probe_transport_info", "gauge",
    "Always 1 for each transport NCCL's channels used in the last successful round (P2P, SHM, "
    "NET, COLLNET), with the network of NET channels (IB, Socket or a plugin's name)" + _CACHED,
    ("scope", "transport", "net"), "", "NCCL INFO log of the probe, per-connection lines")
GDR = MetricSpec(
    "gpunet_probe_gdr_active", "gauge",
    "1 when NCCL's network channels registered GPU memory with the NIC (GPUDirect RDMA), 0 when "
    "they did not; absent without network channels" + _CACHED, _S, "boolean",
    "NCCL INFO log, /GDRDMA on NET channels")
SOCKET_FALLBACK = MetricSpec(
    "gpunet_probe_socket_fallback", "gauge",
    "1 when NCCL sends over TCP sockets although it should not: inter-node channels on "
    "NET/Socket while this node has an ACTIVE RDMA port, or intra-node traffic on the network "
    "instead of P2P/SHM; else 0" + _CACHED, _S, "boolean",
    "NCCL INFO log and /sys/class/infiniband/*/ports/*/state")
PROBLEM = MetricSpec(
    "gpunet_probe_nccl_problem", "gauge",
    "Always 1 for each problem the NCCL log of the last successful round shows (socket_fallback, "
    "gdr_disabled, no_ib_device, ...; docs/nccl-log.md)" + _CACHED, ("scope", "problem"), "",
    "NCCL INFO log of the probe")


@dataclass
class _ScopeState:
    last: Result | None = None  # the last result read, successful or not
    good: Result | None = None  # the last successful one
    mtime_ns: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


@dataclass(frozen=True)
class ProbeSettings(Settings):
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
    backend: str = setting("`nccl` on GPUs; `gloo` runs the same code on CPUs", default="nccl",
                           choices=("nccl", "gloo"))
    nprocs: int = setting("local GPUs the runner probes (0: every visible GPU; with gloo, how "
                          "many GPUs to stand in for: 2)", default=0, minimum=0)
    scopes: tuple[str, ...] = setting(
        "what the node's rounds measure: `intra`, the GPUs among themselves (NVLink/P2P, SHM; "
        "only with two GPUs or more); `net`, the GPUs through the node's NICs (NIC loopback, "
        "below)", default=results.NODE_SCOPES, choices=results.NODE_SCOPES)
    pin_hca: bool = setting(
        "net scope: pin each rank to the ACTIVE RDMA port nearest its GPU with `NCCL_IB_HCA`, so "
        "that every NIC is exercised (an `NCCL_IB_HCA` in the exporter's environment wins)",
        default=True)
    straggler_min_ratio: float = setting(
        "the late rank is named (`gpunet_probe_straggler_info`) when the other ranks wait at "
        "least this share of their collective time for it", default=0.2, minimum=0, maximum=1)
    sizes: tuple[int, ...] = setting("all-reduce message sizes in bytes (float32: multiples of "
                                     "4)", default=(8 << 10, 1 << 20, 64 << 20), minimum=4,
                                     multiple_of=4)
    warmup: int = setting("untimed all-reduces per size and round", default=5, minimum=0)
    iterations: int = setting("timed all-reduces per size and round", default=20, minimum=1)
    interval_seconds: float = setting("from one round's start to the next", default=60,
                                      minimum=1)
    timeout_seconds: float = setting(
        "a scope's start or round taking longer has that scope's workers killed by the runner, "
        "and a runner stuck that long plus a grace period (the timeout, at most 10 s) has its "
        "whole process group killed by the exporter", default=120, minimum=1)
    memory_cap_bytes: int = setting(
        "GPU memory in bytes that the probe's PyTorch allocations may use per GPU (the CUDA "
        "context and NCCL's own buffers are outside it)", default=1 << 30, minimum=1 << 20)
    busy_utilization: float = setting(
        "GPU utilization (0 to 1) above which a GPU is busy with other work: sizes of 1 MiB and "
        "up are skipped while it is (with `skip_busy`)", default=0.5, minimum=0)
    skip_busy: bool = setting("skip sizes of 1 MiB and up while a GPU is busy: above "
                              "`busy_utilization`, or running a process that is not the "
                              "probe's", default=True)


class ProbeCollector(Collector):
    name = "probe"
    description = ("Micro all-reduce probes through torch.distributed/NCCL run outside the "
                   "scrape: latency, bus bandwidth, stragglers, NCCL transport and GDR")
    default_enabled = False  # it puts work on the GPUs: an operator turns it on
    metrics = (SUCCESS, LAST_ROUND, LAST_SUCCESS, DURATION, FAILURES, RUNNING, LATENCY, ALGBW,
               BUSBW, SKIPPED, STRAGGLER_WAIT, STRAGGLER_RATIO, STRAGGLER, LINK, LINK_RATIO,
               HCA_RANKS, HCA_GDR, WORLD, INFO, TRANSPORT, GDR, SOCKET_FALLBACK, PROBLEM)
    settings_type = ProbeSettings
    settings: ProbeSettings

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self.state_dir = self.settings.state_dir
        self._scopes = {s: _ScopeState() for s in results.SCOPES}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._proc: subprocess.Popen[bytes] | None = None
        self._proc_started_wall = 0.0  # time.time() the current runner was started
        self._restarts = 0
        self._thread: threading.Thread | None = None

    # -- the runner ------------------------------------------------------------------------

    def command(self) -> list[str]:
        cfg = self.settings
        base = list(cfg.command or (sys.executable, "-m", "gpunet_exporter.probe.cli"))
        return [*base, "run", "--state-dir", self.state_dir, "--backend", cfg.backend,
                "--nprocs", str(cfg.nprocs), "--scopes", ",".join(cfg.scopes),
                "--path.sysfs", self.ctx.sysfs.root,
                "--straggler-min-ratio", str(cfg.straggler_min_ratio),
                *([] if cfg.pin_hca else ["--no-pin-hca"]),
                "--sizes", ",".join(str(s) for s in cfg.sizes),
                "--warmup", str(cfg.warmup), "--iterations", str(cfg.iterations),
                "--interval", str(cfg.interval_seconds),
                "--timeout", str(cfg.timeout_seconds),
                "--memory-cap", str(cfg.memory_cap_bytes),
                "--busy-utilization", str(cfg.busy_utilization),
                *([] if cfg.skip_busy else ["--no-skip-busy"])]

    def _start_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._supervise, name="probe-supervisor",
                                            daemon=True)
            self._thread.start()

    def _supervise(self) -> None:
        next_start = 0.0
        while not self._stop.is_set():
            try:
                self._poll_results()
                if self.settings.runner == "intra":
                    next_start = self._watch_runner(next_start)
            except Exception as exc:  # the supervisor must outlive anything
                self.ctx.log_once(logging.ERROR, "probe supervisor: %s", exc)
            self._stop.wait(POLL_SECONDS)
        self._kill("exporter stopping")

    def _watch_runner(self, next_start: float) -> float:
        now = time.monotonic()
        proc = self._proc
        if proc is None:
            if now >= next_start:
                self._spawn()
            return next_start
        rc = proc.poll()
        if rc is not None:
            self._proc = None
            nvml.own_session(proc.pid, started=False)
            self._on_exit(rc)
            self._restarts += 1
            return now + self._backoff()
        allowed, phase, since = self._allowed()
        if time.time() - since > allowed:
            self._count(self._runner_scope(), "timeout")
            self._kill(f"probe {phase} exceeded {allowed:g}s")
            return now + self._backoff()
        return next_start

    def _allowed(self) -> tuple[float, str, float]:
        """How long the runner may stay in what it does now, what that is, and since when. The
        launcher ends a group's start or round after timeout_seconds itself; the supervisor
        kills it only when it misses that by a grace period (a hung launcher), or sleeps past
        the next round's start."""
        timeout = float(self.settings.timeout_seconds)
        grace = min(GRACE_MAX, timeout)
        phase, _, since = self._round_state()
        if phase == "sleep":
            return float(self.settings.interval_seconds) + grace, phase, since
        return timeout + grace, phase, since

    def _runner_scope(self) -> str:
        """Where a failure of the launcher itself counts: the scope its status names, else the
        first configured one."""
        scope = self._round_state()[1]
        if scope in results.SCOPES:
            return scope
        return (self.settings.scopes or ("intra",))[0]

    def _backoff(self) -> float:
        """Seconds before the next start: 2, 4, 8 ... up to RESTART_BACKOFF_MAX."""
        return min(RESTART_BACKOFF_MAX, 2.0 ** min(self._restarts, 6))

    def _spawn(self) -> None:
        try:
            os.makedirs(self.state_dir, exist_ok=True)
            log: IO[bytes] | int = open(  # noqa: SIM115 - closed below, once the child has it
                os.path.join(self.state_dir, "runner.log"), "wb")
        except OSError as exc:
            self.ctx.log_once(logging.ERROR, "probe: cannot use state_dir %s: %s",
                              self.state_dir, exc.strerror or exc)
            log = subprocess.DEVNULL
        try:
            self._proc = subprocess.Popen(
                self.command(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True)  # its own process group, killed as a whole
            nvml.own_session(self._proc.pid, started=True)
        except OSError as exc:
            self.ctx.log_once(logging.ERROR, "probe: cannot start the runner: %s", exc)
            self._count(self._runner_scope(), "crash")
            self._proc = None
        finally:
            if not isinstance(log, int):
                log.close()
        self._proc_started_wall = time.time()
        self.ctx.logger.info("probe runner started: %s", " ".join(self.command()))

    def _round_state(self) -> tuple[str, str, float]:
        """(phase, scope, since) from the launcher's status file: ``init``, ``round`` or
        ``sleep``; ("start", "", when the runner started) before this runner wrote one."""
        try:
            with open(os.path.join(self.state_dir, results.STATUS), encoding="utf-8") as fh:
                status = json.load(fh)
            since = float(status["since"])
            phase, scope = str(status["phase"]), str(status.get("scope", ""))
        # ValueError: not JSON, digits beyond int()'s limit, not a number; OverflowError: an int
        # beyond the float range; RecursionError: nesting too deep for json.
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
            since, phase, scope = 0.0, "start", ""
        if not math.isfinite(since):  # "nan" or "inf" would stop the hung-launcher timeout
            since = 0.0
        if since < self._proc_started_wall or phase not in ("init", "round", "sleep"):
            return "start", "", self._proc_started_wall  # none yet, or a previous runner's
        return phase, scope, since

    def _on_exit(self, rc: int) -> None:
        said = any(st.last is not None and not st.last.success
                   and st.last.time >= self._proc_started_wall for st in self._scopes.values())
        if not said:  # the runner died without writing why
            self._count(self._runner_scope(), "crash")
        tail = self._log_tail()
        self.ctx.log_once(logging.WARNING, "probe runner exited with status %d%s", rc,
                          f": {tail}" if tail else "")

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.state_dir, "runner.log"), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 400))
                lines = fh.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:200] if lines else ""

    def _kill(self, why: str) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        nvml.own_session(proc.pid, started=False)
        if proc.poll() is not None:
            return
        self.ctx.log_once(logging.WARNING, "probe runner killed: %s", why)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.wait()

    def _count(self, scope: str, reason: str) -> None:
        with self._lock:
            self._scopes[scope].failures[reason] += 1

    # -- result files ----------------------------------------------------------------------

    def _poll_results(self) -> None:
        for scope, st in self._scopes.items():
            path = results.result_path(self.state_dir, scope)
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            if mtime == st.mtime_ns:
                continue
            st.mtime_ns = mtime
            try:
                res = results.read(path)
            except (OSError, results.BadResult) as exc:
                self.ctx.log_once(logging.WARNING, "probe: %s", exc)
                self._count(scope, "bad_result")
                continue
            with self._lock:
                st.last = res
                if res.success:
                    st.good = res
                    self._restarts = 0  # the backoff starts over after a good round
                    if res.skipped_busy:
                        st.failures["skipped_busy"] += 1
                else:
                    st.failures[res.failure] += 1

    # -- scrape ----------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        self._start_thread()
        fams = Families()
        if self.settings.runner == "intra":
            proc = self._proc
            fams.add(RUNNING, [], int(proc is not None and proc.poll() is None))
        with self._lock:
            scopes = {s: (st.last, st.good, dict(st.failures)) for s, st in self._scopes.items()}
        rdma_active: bool | None = None
        for scope, (last, good, failures) in scopes.items():
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
            if scope == "intra":  # the GPUs' own paths should carry it, not the network
                fallback = "NET" in good.transports
            else:
                if rdma_active is None:
                    rdma_active = self._rdma_active()
                fallback = "Socket" in good.net_transports and rdma_active
            fams.add(SOCKET_FALLBACK, [scope], int(fallback))
        yield from fams

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
        link = good.link_bytes_per_second
        if link:
            fams.add(LINK, [scope], link)
            largest = max(good.sizes, key=lambda x: x.bytes, default=None)
            if largest is not None and not largest.skipped:
                fams.add(LINK_RATIO, [scope], largest.busbw_bytes_per_second / link)
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

    def _rdma_active(self) -> bool:
        return bool(rdma.active_ports(self.ctx.sysfs))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._kill("exporter stopping")
