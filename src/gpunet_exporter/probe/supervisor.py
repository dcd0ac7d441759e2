"""The probe's supervisor: keeps the node's runner (``gpunet-probe run``) going and reads what
it and cluster-mode ranks write, outside the scrape.

A Refresher (gpunet_exporter.background) ticks every POLL_SECONDS. Each tick reads the result
files that changed (probe/results.py) and, when the exporter runs the runner itself,
watches it:
- the runner runs as a ``commands.Child``: in a session and process group of its own, registered
  for ``kill_running``, its output in ``<state_dir>/runner.log``; the session is one of the
  exporter's own for NVML (the gpu collector leaves the probe's ranks out);
- the launcher ends a group's start or round after ``timeout`` itself; a launcher whose status
  file has not moved for that long and a grace period more (or that sleeps past the next
  round's start by the grace period) has its whole process group killed, counted as a
  ``timeout`` (a hung NCCL never blocks anything);
- a runner that exits is started again, after a backoff of 2, 4, 8 ... up to
  RESTART_BACKOFF_MAX seconds that starts over after a successful round; an exit that no
  result file explains counts as a ``crash``, so do a runner that cannot be started at all;
- failures that result files name count under their reason (``nccl_error``, ``init_error`` ...),
  unreadable result files as ``bad_result``, rounds that skipped sizes as ``skipped_busy``,
  except the round a job's arrival cut short (below);
- ``pairs.json`` (probe/pairs.py), the fleet probes' pair results, is read when its
  mtime, inode or size changes; a bad one leaves no pairs (its old peers are not this node's
  view any more) and counts one ``bad_result`` under ``pair_failures``.

The runner runs only while the node's GPUs are idle (probe/idle.py, issue 31): each
tick looks at the GPUs' processes first; the runner is started only once no foreign process has
been seen for the hold-off, and the moment one appears its whole process group is killed (a
yield, not a failure: nothing is counted but ``yields``), whatever it was doing, so that its
workers' CUDA contexts and memory are gone within a tick and the driver's clean-up. Where the
processes cannot be read (no NVML) the runner does not run: the state is ``unknown``.
The runner's ranks look at their GPU's processes too, at each round's start, and skip the large
sizes when one is foreign: a job that comes in the second between such a look and the
supervisor's next one leaves a round with skipped sizes behind as well as a yield. Such a round
is held for SKIP_GRACE seconds: when the gate has seen a foreign process since the round began
it is part of the yield and counts nothing; otherwise (a process too brief for the supervisor
to see) it counts as ``skipped_busy``.

Every tick ends in a Snapshot, the Refresher's value: the scrape reads that and nothing else.
``close`` stops the ticks and kills the runner's process group.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from gpunet_exporter.background import Refresher
from gpunet_exporter.probe import idle, pairs, results
from gpunet_exporter.probe.results import Result
from gpunet_exporter.sources import nvml
from gpunet_exporter.sources.commands import Child

REASONS = (*results.FAILURE_REASONS, "bad_result")
POLL_SECONDS = 0.5
RESTART_BACKOFF_MAX = 60.0
GRACE_MAX = 10.0  # seconds past a phase's own limit before the supervisor kills the launcher
CLOSE_WAIT = 5.0  # seconds close() (or another tick) waits for a tick under way
# Seconds a round that skipped sizes waits for the gate to see the foreign process behind it
# (ticks are POLL_SECONDS apart) before it counts as skipped_busy rather than as the yield's.
SKIP_GRACE = 5.0
LOG_FILE = "runner.log"

Log = Callable[..., None]  # (level, msg, *args), as CollectorContext.log_once


@dataclass(frozen=True)
class ScopeView:
    """What the supervisor knows of one scope."""

    last: Result | None  # the last result read, successful or not
    good: Result | None  # the last successful one
    failures: Mapping[str, int]  # rounds that gave no or partial results, by reason (REASONS)


@dataclass(frozen=True)
class Snapshot:
    """One tick's view, for the scrape."""

    scopes: Mapping[str, ScopeView]
    running: bool | None  # the runner is alive; None when the exporter starts none
    pairs: pairs.Pairs | None = None  # the last good pairs.json, None after a bad one
    pair_failures: int = 0  # unreadable pairs.json files (bad_result)
    pairs_seen: bool = False  # a pairs.json was ever found, good or bad
    state: str = ""  # idle.STATES, "" without a runner of the exporter's
    state_since: float = 0.0  # Unix time the state began
    idle_since: float | None = None  # Unix time the node became idle past the hold-off
    foreign: int = 0  # foreign GPU processes seen at the last look
    yields: int = 0  # times the runner was killed because a foreign process appeared


@dataclass
class _Scope:
    last: Result | None = None
    good: Result | None = None
    mtime_ns: int = 0
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    skipped: Result | None = None  # a round that skipped sizes, until the gate tells why
    skipped_until: float = 0.0  # the gate's clock, when it counts as skipped_busy regardless


def read_status(state_dir: str, started_wall: float) -> tuple[str, str, float]:
    """(phase, scope, since) from the launcher's status file: ``init``, ``round`` or
    ``sleep``; ("start", "", started_wall) when there is none, or only a previous runner's
    (older than ``started_wall``, when the current one started). Never raises."""
    try:
        with open(os.path.join(state_dir, results.STATUS), encoding="utf-8") as fh:
            status: Any = json.load(fh)
        since = float(status["since"])
        phase, scope = str(status["phase"]), str(status.get("scope", ""))
    # ValueError: not JSON, digits beyond int()'s limit, not a number; OverflowError: an int
    # beyond the float range; RecursionError: nesting too deep for json.
    except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
        since, phase, scope = 0.0, "start", ""
    if not math.isfinite(since):  # "nan" or "inf" would stop the hung-launcher timeout
        since = 0.0
    if since < started_wall or phase not in ("init", "round", "sleep"):
        return "start", "", started_wall
    return phase, scope, since


class Supervisor:
    """Result files of ``state_dir`` and, with a ``command``, the runner it starts.

    ``interval`` and ``timeout`` are the runner's own (seconds between round starts, the limit
    of a group's start or round); ``default_scope`` is where the runner's own failures count
    while its status names no scope. ``look`` returns the foreign processes on the node's GPUs
    now (None: cannot tell); the runner starts once it has returned none for ``holdoff``
    seconds. Without ``look`` the runner runs regardless.
    """

    def __init__(self, state_dir: str, command: Sequence[str] | None, *, interval: float,
                 timeout: float, default_scope: str, log: Log,
                 logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
                 look: Callable[[], Collection[int] | None] | None = None,
                 holdoff: float = 0.0, describe: Callable[[Collection[int]], str] = str
                 ) -> None:
        self.state_dir = state_dir
        self.command = list(command) if command is not None else None
        self.interval, self.timeout = interval, timeout
        self.default_scope = default_scope
        self._log, self._logger = log, logger
        self._scopes = {s: _Scope() for s in results.SCOPES}
        self._pairs: pairs.Pairs | None = None
        self._pairs_key: tuple[int, int, int] | None = None  # mtime_ns, inode, size
        self._pair_failures = 0
        self._child: Child | None = None
        self._started_wall = 0.0  # time.time() the current runner was started
        self._next_start = 0.0  # time.monotonic() before which no runner is started
        self.restarts = 0  # runner exits and failed starts since the last good round
        self._closed = False
        self._look, self._describe = look, describe
        self.gate = idle.Gate(holdoff)
        self._state, self._state_since = "", 0.0
        self._yields = 0
        self._tick_lock = threading.Lock()  # one tick at a time; close() waits for it
        self._refresher: Refresher[Snapshot] = Refresher("probe-supervisor", POLL_SECONDS,
                                                         self.tick, log)

    # -- what callers use ------------------------------------------------------------------

    def start(self) -> None:
        """Start the ticks (idempotent; a no-op after close)."""
        if not self._closed:
            self._refresher.start()

    def refresh(self) -> None:
        """One tick now, in the caller's thread; its snapshot becomes the current one."""
        self._refresher.refresh()

    def snapshot(self) -> Snapshot:
        """The last tick's view (before the first one: nothing known, no runner running)."""
        snap = self._refresher.snapshot().value
        return snap if snap is not None else Snapshot({}, None if self.command is None else False)

    @property
    def pid(self) -> int | None:
        """The process id (and process group) of the runner while it runs."""
        child = self._child
        return child.pid if child is not None else None

    def close(self) -> None:
        """Stop the ticks and kill the runner's process group."""
        self._closed = True
        self._refresher.stop()
        got = self._tick_lock.acquire(timeout=CLOSE_WAIT)  # a tick under way may start one
        try:
            self._kill("exporter stopping")
        finally:
            if got:
                self._tick_lock.release()

    # -- a tick ----------------------------------------------------------------------------

    def tick(self) -> Snapshot:
        """Read the result files that changed, watch (start, restart, kill) the runner, and
        return the view the scrape serves until the next tick."""
        if not self._tick_lock.acquire(timeout=CLOSE_WAIT):
            raise RuntimeError(f"the previous tick still runs after {CLOSE_WAIT:g}s")
        try:
            self._poll_results()
            if self.command is not None and not self._closed:
                state = self._look_at_gpus()
                if state == idle.MEASURING:
                    self._watch_runner()
                    state = self._run_state()
                self._set_state(state)
            self._settle_skipped()
            return self._snapshot()
        finally:
            self._tick_lock.release()

    def _snapshot(self) -> Snapshot:
        child = self._child
        running = None if self.command is None else (
            child is not None and child.returncode is None)
        idle_since = self.gate.idle_at() if self._state in (idle.MEASURING, idle.FAILING) \
            else None
        return Snapshot({s: ScopeView(st.last, st.good, dict(st.failures))
                         for s, st in self._scopes.items()}, running, self._pairs,
                        self._pair_failures, self._pairs_key is not None, self._state,
                        self._state_since, idle_since, len(self.gate.foreign), self._yields)

    # -- the GPUs: idle, or a job's ----------------------------------------------------------

    def _look_at_gpus(self) -> str:
        """The gate's state: the runner may run only in MEASURING; it is killed (a yield) when
        a foreign process appeared or the GPUs' processes cannot be read."""
        if self._look is None:
            return idle.MEASURING
        try:
            pids = self._look()
        except Exception as exc:  # a check that breaks is a check that cannot run
            self._log(logging.WARNING, "probe: cannot read the GPUs' processes: %s", exc)
            pids = None
        state = self.gate.observe(pids)
        if state != idle.MEASURING and self._child is not None:
            if state == idle.YIELDED:
                self._yields += 1
                self._kill(f"yielding the GPUs to {self._describe(self.gate.foreign)}",
                           logging.INFO)
            else:
                self._kill("the GPUs' processes cannot be read (NVML)")
        return state

    def _run_state(self) -> str:
        """MEASURING, or FAILING when the runner keeps exiting or a scope's last round since the
        node became idle failed."""
        since = self.gate.idle_at()
        failed = any(st.last is not None and not st.last.success and st.last.time >= since
                     for st in self._scopes.values())
        return idle.FAILING if failed or self.restarts > 0 else idle.MEASURING

    def _set_state(self, state: str) -> None:
        if state != self._state:
            self._state, self._state_since = state, time.time()
            if state in (idle.YIELDED, idle.HOLDOFF, idle.UNKNOWN):
                self.restarts = 0  # a fresh start once the node is idle again
                self._next_start = 0.0

    def _poll_pairs(self) -> None:
        path = pairs.pairs_path(self.state_dir)
        try:
            st = os.stat(path)
        except OSError:
            return
        key = (st.st_mtime_ns, st.st_ino, st.st_size)  # a rename changes the inode
        if key == self._pairs_key:
            return
        self._pairs_key = key
        try:
            self._pairs = pairs.read(path)
        except (OSError, pairs.BadPairs) as exc:
            self._log(logging.WARNING, "probe: %s", exc)
            self._pairs = None
            self._pair_failures += 1

    def _poll_results(self) -> None:
        self._poll_pairs()
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
                self._log(logging.WARNING, "probe: %s", exc)
                st.failures["bad_result"] += 1
                continue
            st.last = res
            if res.success:
                st.good = res
                self.restarts = 0  # the backoff starts over after a good round
                if res.skipped_busy:
                    self._hold_skipped(st, res)
            else:
                st.failures[res.failure] += 1

    def _hold_skipped(self, st: _Scope, res: Result) -> None:
        """A round that skipped sizes: counted at once where there is no gate (cluster mode's
        ranks, a runner run regardless), else held until the gate tells a job's arrival (the
        yield's) from a process too brief to see (skipped_busy)."""
        if self.command is None or self._look is None:
            st.failures["skipped_busy"] += 1
            return
        self._settle(st, force=True)  # a round before it still held: settled first
        st.skipped, st.skipped_until = res, self.gate.clock() + SKIP_GRACE

    def _settle_skipped(self) -> None:
        for st in self._scopes.values():
            self._settle(st, force=False)

    def _settle(self, st: _Scope, *, force: bool) -> None:
        """A held round the gate has seen a foreign process since the start of is the yield's
        (nothing counted); otherwise it counts as skipped_busy once SKIP_GRACE has passed (or
        now, with ``force``)."""
        res = st.skipped
        if res is None:
            return
        last = self.gate.last_foreign
        if last is not None and last >= res.started:
            st.skipped = None
        elif force or self.gate.clock() >= st.skipped_until:
            st.failures["skipped_busy"] += 1
            st.skipped = None

    # -- the runner ------------------------------------------------------------------------

    def _watch_runner(self) -> None:
        now = time.monotonic()
        child = self._child
        if child is None:
            if now >= self._next_start:
                self._spawn()
            return
        rc = child.poll()
        if rc is not None:
            self._child = None
            nvml.own_session(child.pid, started=False)
            self._on_exit(rc)
            self._restart_later(now)
            return
        allowed, phase, since = self._allowed()
        if time.time() - since > allowed:
            self._count(self._runner_scope(), "timeout")
            self._kill(f"probe {phase} exceeded {allowed:g}s")
            self._next_start = now + self._backoff()

    def _restart_later(self, now: float) -> None:
        self.restarts += 1
        self._next_start = now + self._backoff()

    def _backoff(self) -> float:
        """Seconds before the next start: 2, 4, 8 ... up to RESTART_BACKOFF_MAX."""
        return min(RESTART_BACKOFF_MAX, 2.0 ** min(self.restarts, 6))

    def _allowed(self) -> tuple[float, str, float]:
        """How long the runner may stay in what it does now, what that is, and since when. The
        launcher ends a group's start or round after the timeout itself; the supervisor kills
        it only when it misses that by a grace period (a hung launcher), or sleeps past the
        next round's start."""
        grace = min(GRACE_MAX, self.timeout)
        phase, _, since = read_status(self.state_dir, self._started_wall)
        if phase == "sleep":
            return self.interval + grace, phase, since
        return self.timeout + grace, phase, since

    def _runner_scope(self) -> str:
        """Where a failure of the launcher itself counts: the scope its status names, else the
        default one."""
        scope = read_status(self.state_dir, self._started_wall)[1]
        return scope if scope in results.SCOPES else self.default_scope

    def _spawn(self) -> None:
        assert self.command is not None
        self._started_wall = time.time()
        try:
            os.makedirs(self.state_dir, exist_ok=True)
            log: IO[bytes] | int = open(  # noqa: SIM115 - closed below, once the child has it
                os.path.join(self.state_dir, LOG_FILE), "wb")
        except OSError as exc:
            self._log(logging.ERROR, "probe: cannot use state_dir %s: %s", self.state_dir,
                      exc.strerror or exc)
            log = subprocess.DEVNULL
        try:
            self._child = Child(self.command, stdout=log, stderr=log)
        except OSError as exc:
            self._log(logging.ERROR, "probe: cannot start the runner: %s", exc)
            self._count(self._runner_scope(), "crash")
            self._restart_later(time.monotonic())
            return
        finally:
            if not isinstance(log, int):
                log.close()
        nvml.own_session(self._child.pid, started=True)
        if self._closed:  # close() gave up waiting for this tick: it must not outlive it
            self._kill("exporter stopping")
            return
        self._logger.info("probe runner started: %s", " ".join(self.command))

    def _on_exit(self, rc: int) -> None:
        said = any(st.last is not None and not st.last.success
                   and st.last.time >= self._started_wall for st in self._scopes.values())
        if not said:  # the runner died without writing why
            self._count(self._runner_scope(), "crash")
        tail = self._log_tail()
        self._log(logging.WARNING, "probe runner exited with status %d%s", rc,
                  f": {tail}" if tail else "")

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.state_dir, LOG_FILE), "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 400))
                lines = fh.read().decode("utf-8", "replace").strip().splitlines()
        except OSError:
            return ""
        return lines[-1][:200] if lines else ""

    def _kill(self, why: str, level: int = logging.WARNING) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if child.poll() is None:
            self._logger.log(level, "probe runner killed: %s", why)
            child.kill()
        nvml.own_session(child.pid, started=False)

    def _count(self, scope: str, reason: str) -> None:
        self._scopes[scope].failures[reason] += 1
