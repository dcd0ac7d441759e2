"""nccl collector: the health of the NCCL jobs running on this node, from NCCL's own RAS service
(NCCL 2.24 and later; on by default: with no job it costs one refused connection per round).

A background.Refresher asks each configured RAS port for a report (sources/ras.py) every
``interval_seconds`` and exports job-wide numbers per port: listeners, processes, communicators,
missing and errored ranks, collective skew and stalls; per communicator only with
``per_communicator``. The design and its choices: docs/nccl-ras.md; formats: docs/formats.md §11.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import Metric

from gpunet_exporter.background import Fresh, Refresher, add_freshness, last_success_spec
from gpunet_exporter.collector import Collector, CollectorContext, Families, MetricSpec, Scrape
from gpunet_exporter.config import Settings, setting
from gpunet_exporter.sources import ras

_P = ("port",)
_SRC = "NCCL RAS report (STATUS)"
_JSON = "NCCL RAS JSON report (NCCL 2.28.7 and later)"
_TCP = ("net/tcp", "net/tcp6")
TCP_MAX = 64 << 20  # bytes of each table read at most (150 bytes a socket)

LISTENERS = MetricSpec(
    "gpunet_nccl_ras_listeners", "gauge",
    "Sockets listening on the RAS port, one per NCCL process with RAS on this node", _P,
    "processes", "/proc/net/tcp and tcp6 (LISTEN), connection refused")
QUERY_SUCCESS = MetricSpec(
    "gpunet_nccl_ras_query_success", "gauge",
    "1 if the latest query of a listening RAS server got its report, else 0", _P, "boolean",
    _SRC)
QUERY_LAST_SUCCESS = last_success_spec("gpunet_nccl_ras_query", "RAS report", _P)
QUERY_DURATION = MetricSpec(
    "gpunet_nccl_ras_query_duration_seconds", "gauge", "How long the latest query took", _P,
    "seconds", "exporter clock")
UNANSWERED = MetricSpec(
    "gpunet_nccl_ras_unanswered_connections_total", "counter",
    "Connections to the RAS port not answered within nccl.handshake_seconds",
    _P, "connections", "the RAS handshake (CLIENT PROTOCOL)")
INFO = MetricSpec(
    "gpunet_nccl_ras_info", "gauge",
    "Always 1 after a report: the NCCL version that answered and the report's format",
    ("port", "version", "format"), "",
    "nccl_version, or the text report's first line")
COLLECTION = MetricSpec(
    "gpunet_nccl_ras_collection_duration_seconds", "gauge",
    "How long RAS took to gather the report from the job's processes", _P, "seconds",
    "collection_time_sec (text: the Communicators heading)")
TIMEOUTS = MetricSpec(
    "gpunet_nccl_ras_collection_timeouts", "gauge",
    "Communication timeouts RAS met while gathering the report (a process not answering)", _P,
    "timeouts", "timeouts_count (text: the TIMEOUT warning)")
PROCESSES = MetricSpec(
    "gpunet_nccl_job_processes", "gauge",
    "Processes of the whole job, by state (answering, unresponsive, dead)", ("port", "state"),
    "processes", _SRC)
NODES = MetricSpec(
    "gpunet_nccl_job_nodes", "gauge", "Nodes of the job (distinct hosts of its ranks)", _P,
    "nodes", _SRC)
GPUS = MetricSpec(
    "gpunet_nccl_job_gpus", "gauge", "GPUs of the job (distinct host and NVML device)", _P,
    "GPUs", _SRC)
COMMS = MetricSpec(
    "gpunet_nccl_communicators", "gauge",
    "Communicators of the job, by status", ("port", "status"), "communicators", _SRC)
RANKS = MetricSpec(
    "gpunet_nccl_communicator_ranks", "gauge",
    "Ranks of all the job's communicators together: expected (their sizes), seen (answered) and "
    "missing", ("port", "state"), "ranks", _SRC)
MISSING = MetricSpec(
    "gpunet_nccl_missing_ranks", "gauge",
    "Missing ranks of all the communicators, by why", ("port", "reason"), "ranks", _SRC)
ERRORED = MetricSpec(
    "gpunet_nccl_ranks_errored", "gauge",
    "Ranks whose initialisation failed or that hold an asynchronous error", _P, "ranks",
    "init_state and async_error (text: the ERROR entries)")
SKEW = MetricSpec(
    "gpunet_nccl_collective_skew_operations", "gauge",
    "Largest difference in collectives of this kind launched between the ranks of a communicator",
    ("port", "op"), "operations", f"{_JSON}: collective_counts")
SKEW_GROWING = MetricSpec(
    "gpunet_nccl_communicators_skew_growing", "gauge",
    "Communicators whose largest collective-count skew grew since the previous report", _P,
    "communicators", f"{_JSON}: collective_counts, two reports")
STALLED = MetricSpec(
    "gpunet_nccl_stalled_ranks", "gauge",
    "Ranks left behind their communicator's leader whose collective counts did not move", _P,
    "ranks", f"{_JSON}: collective_counts, two reports")
IDLE = MetricSpec(
    "gpunet_nccl_communicators_without_progress", "gauge",
    "Running communicators whose collective counts did not change since the previous report",
    _P, "communicators",
    f"{_JSON}: collective_counts, two reports")


# nccl.per_communicator (off by default): one series per communicator of a JSON report.
_C = ("port", "communicator")
# From JSON reports only, for at most nccl.max_communicators communicators, the most troubled
# first (docs/reading-metrics.md).
C_EXPECTED = MetricSpec(
    "gpunet_nccl_communicator_expected_ranks", "gauge",
    "Ranks of the communicator (its size)", _C, "ranks", f"{_JSON}: size")
C_MISSING = MetricSpec(
    "gpunet_nccl_communicator_missing_ranks", "gauge",
    "Missing ranks of the communicator, by why",
    ("port", "communicator", "reason"), "ranks", f"{_JSON}: missing_ranks")
C_STATUS = MetricSpec(
    "gpunet_nccl_communicator_status", "gauge",
    "1 for the communicator's status, 0 for the other statuses",
    ("port", "communicator", "status"), "boolean",
    f"{_JSON}: the ranks' status")
C_ERRORED = MetricSpec(
    "gpunet_nccl_communicator_errored_ranks", "gauge",
    "Ranks of the communicator whose initialisation failed or that hold an asynchronous error",
    _C, "ranks",
    f"{_JSON}: init_state and async_error")
C_SKEW = MetricSpec(
    "gpunet_nccl_communicator_skew_operations", "gauge",
    "Largest difference in collectives of one kind launched between the communicator's ranks",
    _C, "operations",
    f"{_JSON}: collective_counts")
C_STALLED = MetricSpec(
    "gpunet_nccl_communicator_stalled_ranks", "gauge",
    "Stalled ranks of the communicator, as gpunet_nccl_stalled_ranks counts them", _C, "ranks",
    f"{_JSON}: collective_counts, two reports")
UNLABELLED = MetricSpec(
    "gpunet_nccl_communicators_unlabelled", "gauge",
    "Communicators of the latest report without gpunet_nccl_communicator_* series of their own",
    _P, "communicators",
    _SRC)
PER_COMM = (C_EXPECTED, C_MISSING, C_STATUS, C_ERRORED, C_SKEW, C_STALLED, UNLABELLED)

MONITOR_CONNECTED = MetricSpec(
    "gpunet_nccl_ras_monitor_connected", "gauge",
    "1 while a MONITOR connection to the RAS port is open, 0 while the port's job refuses one",
    _P, "boolean", "RAS MONITOR (NCCL 2.29.2 and later)")
EVENTS = MetricSpec(
    "gpunet_nccl_ras_events_total", "counter",
    "Peer events RAS reported on the MONITOR connection, by event", ("port", "event"), "events",
    "RAS MONITOR stream (JSON)")
STATUS_SKIPPED = MetricSpec(
    "gpunet_nccl_ras_status_skipped", "gauge",
    "1 while the port's job runs an NCCL whose status report is known to crash jobs, so none is "
    "asked", _P, "boolean", "the report's NCCL version, nccl.status_skip_versions")
# Events after which the next status report is asked at once: a peer gone or not answering.
URGENT_EVENTS = frozenset({"PEER_DEAD", "PEER_TIMEOUT_DEAD", "PEER_UNRESPONSIVE"})

SPECS = (MONITOR_CONNECTED, EVENTS, STATUS_SKIPPED, LISTENERS, QUERY_SUCCESS, QUERY_LAST_SUCCESS,
         QUERY_DURATION, UNANSWERED, INFO, COLLECTION, TIMEOUTS, PROCESSES, NODES, GPUS, COMMS,
         RANKS, MISSING, ERRORED, SKEW, SKEW_GROWING, STALLED, IDLE, *PER_COMM)


@dataclass(frozen=True)
class NcclSettings(Settings):
    interval_seconds: float = setting(
        "how often each port is queried in the background; each query makes RAS gather data "
        "from every process of the job, so on large jobs keep it long", default=30, minimum=1)
    host: str = setting("address the RAS servers listen on (NCCL_RAS_ADDR's host)",
                        default="localhost")
    ports: tuple[int, ...] = setting(
        "RAS ports to query: NCCL's default, plus those of jobs started with another "
        "NCCL_RAS_ADDR (each is a label value)", default=(ras.DEFAULT_PORT,), minimum=1,
        maximum=65535)
    handshake_seconds: float = setting(
        "how long a connection may wait for the protocol handshake, which a running RAS "
        "thread answers at once", default=2, minimum=0.1)
    timeout_seconds: float = setting(
        "how long one query may take in all (RAS itself waits up to 10 s for slow processes)",
        default=15, minimum=0.5)
    attempts: int = setting(
        "connections tried per query when one is accepted but not answered (the kernel hands "
        "each to one of the job's processes on the node, a stopped one too), within "
        "timeout_seconds", default=6, minimum=1, maximum=20)
    max_reply_bytes: int = setting("longest report read; a longer one fails the query",
                                   default=8 << 20, minimum=1024)
    json: bool = setting("ask for the JSON report (NCCL 2.28.7 and later; the text report is "
                         "read where the server does not know it)", default=True)
    per_communicator: bool = setting(
        "export one series per communicator of the JSON report too "
        "(`gpunet_nccl_communicator_*{communicator}`, labelled with its hash); off by default: "
        "a job may hold thousands of communicators, each hash a new series", default=False)
    monitor: bool = setting(
        "keep one MONITOR connection per port where NCCL offers it (2.29.2 and later): peer "
        "events are counted as they happen, a status report is asked at once after a peer "
        "died or stopped answering, and otherwise every `monitor_status_interval_seconds`",
        default=True)
    monitor_status_interval_seconds: float = setting(
        "with a MONITOR connection open, how often a status report is asked without an event "
        "(status reports are the expensive part of RAS)", default=300, minimum=1)
    status_skip_versions: tuple[str, ...] = setting(
        "NCCL versions whose status report is known to crash jobs (docs/nccl-ras.md names the "
        "bugs): once a report shows one, its port is not asked for another while the job "
        "runs; MONITOR events still count", default=("2.26.2", "2.26.5", "2.27.3", "2.29.7"))
    max_communicators: int = setting(
        "with `per_communicator`, most communicators per port given series of their own: those "
        "with the most missing, stalled and errored ranks, then the widest skew (ties by hash); "
        "the rest are counted in `gpunet_nccl_communicators_unlabelled`", default=64, minimum=1)


_Sample = tuple[MetricSpec, list[str], float]
# What _progress found per communicator key: its widest skew, and its stalled ranks (None
# until it was in the previous report too).
_Progress = dict[str, tuple[int, int | None]]


@dataclass
class _Report:
    """What one query found, ready for a scrape: the job's samples are worked out once, in
    the background, from the report (which may list thousands of ranks)."""

    listeners: int
    seconds: float = 0.0
    samples: list[_Sample] | None = None  # None: no report


@dataclass
class _Port:
    fresh: Fresh[_Report] = field(default_factory=Fresh)
    report: _Report | None = None  # the latest, good or not
    unanswered: int = 0
    # communicator key -> (rank -> total count, skew) of the previous JSON report
    counts: dict[str, tuple[dict[int, int], int]] = field(default_factory=dict)
    monitor: bool | None = None  # a MONITOR connection open; False: refused; None: no job
    events: dict[str, int] = field(default_factory=dict)  # by event, once monitored
    urgent: bool = False  # an event asks for a status report at once
    queried: float = 0.0  # time.monotonic() of the latest status query
    skip: str = ""  # the NCCL version whose reports are not asked for, while its job runs


class NcclCollector(Collector):
    name = "nccl"
    description = ("The NCCL jobs on this node, from NCCL's RAS service (in the background): "
                   "processes and ranks missing or dead, communicators by status, errors, and "
                   "collective counts that show a stuck rank")
    default_enabled = True
    metrics = SPECS
    settings_type = NcclSettings
    settings: NcclSettings

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self._lock = threading.Lock()
        self._round = threading.Lock()  # one round at a time: the thread's, or refresh()'s
        self._ports = {int(p): _Port() for p in dict.fromkeys(self.settings.ports)}
        self._refresher: Refresher[None] = Refresher(
            "nccl", float(self.settings.interval_seconds), lambda: self.refresh(),
            self.ctx.log_once)
        self._stop = threading.Event()
        self._monitors: list[threading.Thread] = []

    # -- background ------------------------------------------------------------------------

    def refresh(self) -> None:
        """One round: every port queried; runs in the background thread (tests and the doctor,
        which compares two reports, call it too: rounds never overlap)."""
        with self._round:
            for port, state in self._ports.items():
                now = time.monotonic()
                with self._lock:
                    # MONITOR open and nothing urgent: the port's report can wait its interval.
                    quiet = (state.monitor and not state.urgent and now - state.queried
                             < self.settings.monitor_status_interval_seconds)
                    state.urgent = False
                    if not quiet and not state.skip:
                        state.queried = now
                if state.skip:  # a crashing version: only whether its job still runs
                    if self._listeners(port) == 0:
                        with self._lock:
                            state.skip = ""
                elif not quiet:
                    self._query(port, state)

    def _monitor(self, port: int, state: _Port) -> None:
        """One port's MONITOR connection, kept open while the job's RAS accepts it (a thread
        per port): events counted, a status query woken after an urgent one. A refused port
        (no job) is tried again every interval; an NCCL without MONITOR every ten."""
        cfg = self.settings
        interval = float(cfg.interval_seconds)
        while not self._stop.is_set():
            mon = ras.Monitor(cfg.host, port, handshake_timeout=float(cfg.handshake_seconds))
            try:
                mon.open()
            except ConnectionRefusedError:
                with self._lock:
                    state.monitor = None
                self._stop.wait(interval)
                continue
            except ras.MonitorUnsupported:
                with self._lock:
                    state.monitor = False
                self._stop.wait(10 * interval)
                continue
            except (OSError, ras.RasError) as exc:
                self.ctx.log_once(logging.DEBUG, "NCCL RAS MONITOR on port %d: %s", port, exc)
                with self._lock:
                    state.monitor = False
                self._stop.wait(interval)
                continue
            with self._lock:
                state.monitor = True
                for name in (*ras.EVENTS, "other"):
                    state.events.setdefault(name, 0)
            try:
                while not self._stop.is_set():
                    events = mon.events(1.0)
                    urgent = False
                    with self._lock:
                        for ev in events:
                            state.events[ev.event] += 1
                            urgent |= ev.event in URGENT_EVENTS
                        state.urgent |= urgent
                    if urgent:
                        self._refresher.wake()
            except (OSError, ras.RasError) as exc:
                self.ctx.log_once(logging.DEBUG, "NCCL RAS MONITOR on port %d ended: %s",
                                  port, exc)
            finally:
                mon.close()
                with self._lock:
                    state.monitor = False
            self._stop.wait(1.0)  # the job's RAS went away: its port is refused next

    def _listeners(self, port: int) -> int:
        tables = []
        for rel in _TCP:
            try:
                # Read to the end: procfs hands these out a few lines per read().
                with open(self.ctx.procfs.path(rel), "rb") as fh:
                    tables.append(fh.read(TCP_MAX).decode("ascii", "replace"))
            except OSError as exc:
                self.ctx.skip(rel, exc)
        return ras.listeners(tables, port)

    def _query(self, port: int, state: _Port) -> None:
        cfg = self.settings
        start = time.monotonic()
        status: ras.Status | None = None
        listeners = -1
        error: Exception | None = None
        deadline = start + float(cfg.timeout_seconds)  # for the whole query, every attempt
        for _ in range(cfg.attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                status = ras.query(
                    cfg.host, port, timeout=left,
                    handshake_timeout=min(float(cfg.handshake_seconds), left),
                    max_bytes=int(cfg.max_reply_bytes), json_format=bool(cfg.json))
                break
            except ras.Unanswered as exc:
                error = exc
                with self._lock:
                    state.unanswered += 1
            except ConnectionRefusedError:
                listeners, error = 0, None
                break
            except (OSError, ras.RasError, ValueError) as exc:
                error = exc
                break
        if listeners < 0:
            listeners = self._listeners(port)
        seconds = time.monotonic() - start
        report = _Report(listeners, seconds)
        if status is not None and status.version in cfg.status_skip_versions:
            self.ctx.log_once(logging.WARNING, "NCCL RAS on port %d: NCCL %s's status report "
                              "is known to crash jobs (nccl.status_skip_versions): no more "
                              "asked while this job runs", port, status.version)
            with self._lock:
                state.skip = status.version
        if status is not None:
            samples: list[_Sample] = []
            derived, per_comm = self._progress(state, status)
            _export(lambda *sample: samples.append(sample), str(port), status, derived)
            if cfg.per_communicator:
                _per_communicator(lambda *sample: samples.append(sample), str(port), status,
                                  per_comm, int(cfg.max_communicators))
            report.samples = samples
        elif error is not None:
            self.ctx.log_once(logging.WARNING, "NCCL RAS on port %d: %s", port, error)
        with self._lock:
            state.report = report
            if status is not None:
                state.fresh = state.fresh.succeeded(report)
            elif listeners > 0 or error is not None:
                state.fresh = state.fresh.failed()
            else:  # no job: nothing was asked, so neither success nor failure
                state.fresh = Fresh(None, None, state.fresh.last_success)

    def _progress(self, state: _Port, status: ras.Status) -> tuple[dict[str, float], _Progress]:
        """The counts compared with the previous JSON report (runs in the background): the
        port's figures, and each communicator's."""
        if status.communicators is None:
            state.counts = {}
            return {}, {}
        previous = state.counts
        state.counts = {}
        skew: dict[str, int] = {}
        per_comm: _Progress = {}
        growing = stalled = idle = 0
        compared = False
        for comm in status.communicators:
            totals = {r.rank: sum(r.counts.values()) for r in comm.ranks}
            widest = 0
            for op in {op for r in comm.ranks for op in r.counts}:
                values = [r.counts.get(op, 0) for r in comm.ranks]
                gap = max(values) - min(values)
                widest = max(widest, gap)
                if op in ras.OPS:
                    skew[op] = max(skew.get(op, 0), gap)
            state.counts[comm.key] = (totals, widest)
            per_comm[comm.key] = (widest, None)
            before = previous.get(comm.key)
            if before is None or not totals:
                continue
            compared = True
            old, old_widest = before
            if widest > old_widest:
                growing += 1
            lead = max(totals.values())
            moved = {r for r, n in totals.items() if r in old and n != old[r]}
            if comm.status == "running" and lead > 0 and not moved and all(
                    r in old for r in totals):
                idle += 1
            behind = sum(1 for r, n in totals.items() if n < lead and old.get(r) == n)
            stalled += behind
            per_comm[comm.key] = (widest, behind)
        out: dict[str, float] = {f"skew:{op}": float(v) for op, v in skew.items()}
        for op in ras.OPS:
            out.setdefault(f"skew:{op}", 0.0)
        if compared:
            out.update(growing=float(growing), stalled=float(stalled), idle=float(idle))
        return out, per_comm

    # -- scrape ----------------------------------------------------------------------------

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        self._refresher.start()
        if self.settings.monitor and not self._monitors:
            for port, state in self._ports.items():
                t = threading.Thread(target=self._monitor, args=(port, state),
                                     name=f"nccl-monitor-{port}", daemon=True)
                t.start()
                self._monitors.append(t)
        self._refresher.wait_first(scrape.deadline)
        fams = Families()
        with self._lock:
            ports = [(p, s.fresh, s.report, s.unanswered, s.monitor, dict(s.events), s.skip)
                     for p, s in self._ports.items()]
        for port, fresh, report, unanswered, monitor, events, skip in ports:
            lbl = str(port)
            fams.add(UNANSWERED, [lbl], float(unanswered))
            if report is not None and report.listeners > 0:
                fams.add(STATUS_SKIPPED, [lbl], float(bool(skip)))
            if monitor is not None:
                fams.add(MONITOR_CONNECTED, [lbl], float(monitor))
            for name, n in events.items():
                fams.add(EVENTS, [lbl, name], float(n))
            if report is None:
                continue
            fams.add(LISTENERS, [lbl], float(report.listeners))
            if fresh.ok is not None:
                add_freshness(fams, QUERY_SUCCESS, QUERY_LAST_SUCCESS, [lbl], fresh)
                fams.add(QUERY_DURATION, [lbl], report.seconds)
            good = fresh.value
            if good is None or good.samples is None or fresh.ok is not True:
                continue  # a job's figures are those of the latest report only
            for spec, labels, v in good.samples:
                fams.add(spec, labels, v)
        return iter(fams)

    def close(self) -> None:
        self._stop.set()
        self._refresher.stop()
        for t in self._monitors:
            t.join(timeout=5)


def _export(add: Callable[[MetricSpec, list[str], float], None], lbl: str, st: ras.Status,
            derived: dict[str, float]) -> None:
    """The job's samples from one report (``derived``: what _progress compared)."""
    add(INFO, [lbl, st.version, st.format], 1.0)
    if st.collection_seconds is not None:
        add(COLLECTION, [lbl], st.collection_seconds)
    if st.timeouts is not None:
        add(TIMEOUTS, [lbl], float(st.timeouts))
    by_status = dict.fromkeys(ras.STATUSES, 0)
    if st.communicators is not None:
        procs: dict[str, set[tuple[str, int]]] = {"answering": set(), "unresponsive": set(),
                                                   "dead": set()}
        hosts: set[str] = set()
        gpus: set[tuple[str, int]] = set()
        expected = seen = errored = 0
        missing = {"unreachable": 0, "dead": 0, "not_member": 0}
        for comm in st.communicators:
            by_status[comm.status] += 1
            expected += comm.size
            seen += len(comm.ranks)
            for r in comm.ranks:
                procs["answering"].add((r.host, r.pid))
                hosts.add(r.host)
                gpus.add((r.host, r.nvml_dev))
                errored += r.errored
            for m in comm.missing:
                hosts.add(m.host)
                gpus.add((m.host, m.nvml_dev))
                why = _why(m)
                missing[why] += 1
                if why == "dead":
                    procs["dead"].add((m.host, m.pid))
                elif why == "unreachable":
                    procs["unresponsive"].add((m.host, m.pid))
        procs["unresponsive"] -= procs["dead"]
        for state, members in procs.items():
            add(PROCESSES, [lbl, state], float(len(members)))
        add(NODES, [lbl], float(len(hosts)))
        add(GPUS, [lbl], float(len(gpus)))
        missing_total = sum(missing.values())
        for reason, n in missing.items():
            add(MISSING, [lbl, reason], float(n))
        add(ERRORED, [lbl], float(errored))
        for op in ras.OPS:
            add(SKEW, [lbl, op], derived.get(f"skew:{op}", 0.0))
        for key, spec in (("growing", SKEW_GROWING), ("stalled", STALLED), ("idle", IDLE)):
            if key in derived:
                add(spec, [lbl], derived[key])
    else:
        expected = seen = 0
        for n, size, status, _errors in st.groups:
            by_status[status if status in by_status else "running"] += n
            expected += n * size
        # The text report's verdicts, as the JSON's where the text carries them: a missing
        # rank of a process the DEAD error names is dead, another unreachable (ras.parse_text).
        missing_total = st.missing_ranks or 0
        seen = expected - missing_total
        dead_ranks = st.dead_ranks or 0
        add(MISSING, [lbl, "unreachable"], float(missing_total - dead_ranks))
        add(MISSING, [lbl, "dead"], float(dead_ranks))
        add(ERRORED, [lbl], float(st.errored_ranks or 0))
        if st.processes is not None:
            dead = st.dead_processes or 0
            unresponsive = st.unresponsive_processes or 0
            add(PROCESSES, [lbl, "answering"], float(max(0, st.processes - dead - unresponsive)))
            add(PROCESSES, [lbl, "unresponsive"], float(unresponsive))
            add(PROCESSES, [lbl, "dead"], float(dead))
        if st.nodes is not None:
            add(NODES, [lbl], float(st.nodes))
        if st.gpus is not None:
            add(GPUS, [lbl], float(st.gpus))
    for status, n in by_status.items():
        add(COMMS, [lbl, status], float(n))
    add(RANKS, [lbl, "expected"], float(expected))
    add(RANKS, [lbl, "seen"], float(seen))
    add(RANKS, [lbl, "missing"], float(missing_total))


def _why(m: ras.Missing) -> str:
    """Why a rank is missing, as gpunet_nccl_missing_ranks's reason."""
    if m.dead:
        return "dead"
    return "unreachable" if m.unresponsive else "not_member"


def _per_communicator(add: Callable[[MetricSpec, list[str], float], None], lbl: str,
                      st: ras.Status, progress: _Progress, limit: int) -> None:
    """nccl.per_communicator: the series of at most ``limit`` communicators, those with the most
    missing, stalled and errored ranks first, then the widest skew, ties by label (so that the
    choice is stable); the rest counted."""
    if st.communicators is None:  # a text report: groups of communicators, no hashes
        add(UNLABELLED, [lbl], float(sum(n for n, *_ in st.groups)))
        return
    shared: dict[str, int] = {}
    for comm in st.communicators:
        shared[comm.hash] = shared.get(comm.hash, 0) + 1
    rows = []
    for comm in st.communicators:
        # The hash alone where it names one communicator, else the whole key (unique; a
        # well-formed hash never contains the key's "/").
        name = comm.hash if comm.hash and shared[comm.hash] == 1 else comm.key
        missing = {"unreachable": 0, "dead": 0, "not_member": 0}
        for m in comm.missing:
            missing[_why(m)] += 1
        errored = sum(1 for r in comm.ranks if r.errored)
        skew, stalled = progress.get(comm.key, (0, None))
        order = (-sum(missing.values()), -(stalled or 0), -errored, -skew, name)
        rows.append((order, name, comm, missing, errored, skew, stalled))
    rows.sort(key=lambda row: row[0])
    for _, name, comm, missing, errored, skew, stalled in rows[:limit]:
        labels = [lbl, name]
        add(C_EXPECTED, labels, float(comm.size))
        for reason, n in missing.items():
            add(C_MISSING, [lbl, name, reason], float(n))
        status = comm.status
        for s in ras.STATUSES:
            add(C_STATUS, [lbl, name, s], 1.0 if s == status else 0.0)
        add(C_ERRORED, labels, float(errored))
        add(C_SKEW, labels, float(skew))
        if stalled is not None:
            add(C_STALLED, labels, float(stalled))
    add(UNLABELLED, [lbl], float(max(0, len(rows) - limit)))
