"""Slow work of collectors, done one way: the :class:`Refresher`.

Anything a scrape must not wait for (a subprocess such as ibv_devinfo or mlnx_qos, NVML firmware
round trips) runs in a Refresher's daemon thread on its own interval. The scrape serves the last
good value (:class:`Fresh`) together with its freshness, exported the same way by every collector
(:func:`add_freshness`, :func:`last_success_spec`):

- ``gpunet_<collector>_<what>_refresh_success``: 1 if the latest round succeeded, 0 if it failed,
  raised, or overran its timeout (the last good value keeps being served); absent until the
  first round has ended.
- ``gpunet_<collector>_<what>_last_success_timestamp_seconds``: unix time (exporter clock) of the
  last good round; absent until one succeeds (never 0, so ``time() - metric`` is never a
  fifty-year age), and it stops advancing while rounds fail. Alert and graph on
  ``time() - metric``.

A scrape never waits longer than its deadline: the registry hands each collection its
:class:`gpunet_exporter.collector.Scrape`, whose ``deadline`` it passes here, and the first
scrape after a Refresher starts waits for its first value at most until then
(:meth:`Refresher.wait_first`); every later scrape serves what is there at once.

XID events (collectors/gpu.py XidWatcher) and hot-plug events (daemon/hotplug.py) are not
refreshed values but event listeners, and keep their own threads: see their docstrings.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from gpunet_exporter.collector import Families, MetricSpec

T = TypeVar("T")


@dataclass(frozen=True)
class Fresh(Generic[T]):
    """A value read in the background as a scrape serves it.

    ``value`` is the last good value (None until one), ``ok`` whether the latest attempt succeeded
    (None until one has ended), ``last_success`` the time.time() of the last good value (0.0:
    never). Collectors that keep one result per device (a netdev's QoS configuration, a GPU's
    counters) keep one Fresh per device and build the next from it with :meth:`succeeded` or
    :meth:`failed`.
    """

    value: T | None = None
    ok: bool | None = None
    last_success: float = 0.0

    def succeeded(self, value: T, at: float | None = None) -> Fresh[T]:
        return Fresh(value, True, time.time() if at is None else at)

    def failed(self) -> Fresh[T]:
        """The last good value, still served, with ``ok`` False and its time unchanged."""
        return Fresh(self.value, False, self.last_success)

    def age(self) -> float | None:
        return max(0.0, time.time() - self.last_success) if self.last_success else None


def last_success_spec(prefix: str, what: str, labels: tuple[str, ...] = ()) -> MetricSpec:
    """The freshness family of a background value, named and described alike everywhere:
    ``<prefix>_last_success_timestamp_seconds``; ``what`` names the work ("background run of
    ibv_devinfo")."""
    return MetricSpec(
        f"{prefix}_last_success_timestamp_seconds", "gauge",
        f"Unix time of the last good {what}", labels,
        "seconds", "exporter clock at the end of the read")


def add_freshness(fams: Families, success: MetricSpec | None, last_success: MetricSpec,
                  labels: Sequence[str], fresh: Fresh[T], ok: bool | None = None) -> None:
    """Export one background value's freshness: ``success`` (when given) once an attempt has
    ended, ``last_success`` once one has succeeded. ``ok`` overrides ``fresh.ok`` (a per-device
    result within a whole round that failed)."""
    ok = fresh.ok if ok is None else ok
    if success is not None and ok is not None:
        fams.add(success, list(labels), int(ok))
    if fresh.last_success:
        fams.add(last_success, list(labels), fresh.last_success)


class Refresher(Generic[T]):
    """Calls ``fn`` now and then every ``interval`` seconds in a daemon thread.

    The last good result is kept; a round that raises keeps it, and so does a round that runs
    past ``timeout``: that round counts as failed from the moment it overruns (``ok`` False in
    :meth:`snapshot`, logged), and its result, should it come later, is discarded, so a source
    that is always slower than its timeout reads as failing rather than flapping between fresh
    and failed. No thread can be killed, so an overrunning round is left to finish (or hang) in
    the Refresher's one thread: rounds never pile up. ``timeout`` None (the default) suits work
    that bounds itself, such as a subprocess run through sources.commands.run_command with its
    own timeout.

    :meth:`wake` makes the thread run the next round now instead of at the end of the interval
    (a device appeared or went away); wakes during a round coalesce into one more round.
    :meth:`refresh` runs one round in the calling thread (tests; the thread calls it too).
    A Refresher stopped before it started never starts a thread.
    """

    def __init__(self, name: str, interval: float, fn: Callable[[], T],
                 log: Callable[[int, str, object], None], *,
                 timeout: float | None = None) -> None:
        self.name = name
        self.interval = interval
        self.timeout = timeout
        self._fn = fn
        self._log = log
        self._fresh: Fresh[T] = Fresh()
        self._round = 0  # rounds started
        self._running_since: float | None = None  # time.monotonic() of the round running now
        self._overrun_logged = 0  # the round whose overrun was logged
        self._first_done = threading.Event()  # the first round ended (or overran its timeout)
        self._waited = False  # wait_first() waited once
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by wake() and stop(): ends the wait early
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- life cycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the thread, whose first round runs at once (idempotent; nothing after stop())."""
        with self._lock:
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._loop, name=f"refresh-{self.name}",
                                                daemon=True)
                self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def wake(self) -> None:
        """Run the next round now (a no-op before start() and after stop())."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # a wake during the round below asks for one more round
            self.refresh()
            self._wake.wait(self.interval)

    # -- rounds --------------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Run one round now, in the calling thread; True when its value was taken."""
        t0 = time.monotonic()
        with self._lock:
            self._round += 1
            this = self._round
            self._running_since = t0
        value: T | None = None
        error = ""
        try:
            value = self._fn()
        except Exception as exc:  # the last good value keeps being served
            error = str(exc) or type(exc).__name__
        took = time.monotonic() - t0
        late = self.timeout is not None and took > self.timeout
        with self._lock:
            if self._round == this:
                self._running_since = None
            if error or late:
                self._fresh = self._fresh.failed()
            else:
                self._fresh = Fresh(value, True, time.time())
            logged = self._overrun_logged == this
        self._first_done.set()
        if error:
            self._log(logging.WARNING, "%s", f"{self.name} refresh failed: {error}")
        elif late and not logged:
            self._log(logging.WARNING, "%s", f"{self.name} refresh took {took:.1f}s, more than "
                      f"its timeout of {self.timeout:g}s: counted as failed, its result "
                      "discarded, the last good value kept")
        return not (error or late)

    def snapshot(self) -> Fresh[T]:
        """The value to serve now; a round running past its timeout makes ``ok`` False."""
        with self._lock:
            fresh, since, this = self._fresh, self._running_since, self._round
            overrun = (self.timeout is not None and since is not None
                       and time.monotonic() - since > self.timeout)
            first_log = overrun and self._overrun_logged != this
            if first_log:
                self._overrun_logged = this
        if not overrun:
            return fresh
        self._first_done.set()  # a first round that overran has ended as far as waiting goes
        if first_log:
            self._log(logging.WARNING, "%s", f"{self.name} refresh still running after its "
                      f"timeout of {self.timeout:g}s: counted as failed, the last good value "
                      "kept")
        return fresh.failed()

    def wait_first(self, deadline: float | None) -> Fresh[T]:
        """:meth:`snapshot`, for a scrape. The first call after start() waits until the first
        round has ended, at most until ``deadline`` (time.monotonic(); a scrape passes its
        Scrape.deadline) and, with a ``timeout``, at most that long; None waits for
        the round (a one-off reader with no scrape deadline). Later calls never wait: a
        first round that outlives a scrape's deadline is not waited for again."""
        if self._thread is not None and not self._waited and not self._first_done.is_set():
            self._waited = True
            limits = [x for x in (None if deadline is None else deadline - time.monotonic(),
                                  self.timeout) if x is not None]
            wait = min(limits) if limits else None
            if wait is None or wait > 0:
                self._first_done.wait(wait)
        return self.snapshot()
