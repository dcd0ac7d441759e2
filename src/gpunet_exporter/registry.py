"""Finds collectors and runs them on every scrape, each isolated from the others.

Each collection runs in its own thread with a deadline. An exception, a hang or a missing device
costs only that collector's own families; the scrape reports every collector's duration and
success. Every label of every collector's samples, third-party collectors' included, is checked
here (:func:`drop_unexposable`) before it can reach an encoder. While a collection is still
running (a hung read), later scrapes join it instead of starting another, so a stuck source never
piles up threads. The deadline is ``--scrape.timeout``, shortened for one request by the
scraper's own (``X-Prometheus-Scrape-Timeout-Seconds``, passed to :meth:`Scraper.collect`). Each
collection gets its scrape as an argument (collector.Scrape), with the deadline set WAIT_RESERVE
before the scrape's own (time.monotonic()), so that a collector waiting for a background value
(background.Refresher.wait_first) still returns in time to be part of the scrape.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from importlib.metadata import entry_points

from prometheus_client.core import Metric

from gpunet_exporter import __version__
from gpunet_exporter.collector import UNKNOWN_REASONS, Collector, MetricSpec, Scrape

log = logging.getLogger("gpunet.exporter")

ENTRY_POINT_GROUP = "gpunet_exporter.collectors"
SOLO_SECONDS = 0.25
# How long before the scrape's deadline a collection's own deadline (Scrape.deadline)
# lies: a tenth of the scrape's timeout, at most half a second.
WAIT_RESERVE = 0.1
WAIT_RESERVE_MAX = 0.5


def discover() -> dict[str, type[Collector]]:
    """Collector classes registered under the entry-point group, by name."""
    found: dict[str, type[Collector]] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = ep.load()
        except Exception as exc:  # a broken third-party plugin must not stop the exporter
            log.error("cannot load collector %r from %s: %s", ep.name, ep.value, exc)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Collector)):
            log.error("entry point %r (%s) is not a Collector subclass", ep.name, ep.value)
            continue
        if getattr(cls, "name", ep.name) != ep.name:
            log.error("entry point %r names a collector called %r; skipped", ep.name, cls.name)
            continue
        found[ep.name] = cls
    return dict(sorted(found.items()))


SCRAPE_METRICS = (
    MetricSpec(
        "gpunet_scrape_collector_duration_seconds", "gauge",
        "How long the collector took in this scrape", ("collector",), "seconds",
        "measured by the exporter"),
    MetricSpec(
        "gpunet_scrape_collector_success", "gauge",
        "1 if the collector finished in time without an exception, else 0", ("collector",),
        "boolean", "exporter"),
    MetricSpec(
        "gpunet_scrape_collector_unreadable_values", "gauge",
        "Values the collector skipped in this scrape because they could not be read, parsed or "
        "exposed", ("collector",), "count", "exporter"),
    MetricSpec(
        "gpunet_check_unknown", "gauge",
        "1 for each check the node's hardware calls for that could not run, and why",
        ("collector", "check", "reason"), "boolean", "the collectors"),
    MetricSpec(
        "gpunet_exporter_build_info", "gauge",
        "Always 1: the exporter and Python versions", ("version", "python_version"),
        "", "exporter"),
)


# Labels (docs/security.md, "Names and text from the system"). Names of devices, ports, netdevs
# and counter files come from directory listings, and the kernel allows any bytes but '/' and NUL
# in them: os.listdir gives bytes that are not UTF-8 as lone surrogates, which no encoder can
# write, so one such name would fail every scrape. Other values come from file contents, tool
# output and JSON, where a NUL means garbage (no name can hold one; C code cuts the string
# there). A listing's longest name is NAME_MAX, 255 bytes, and the strings drivers print into
# labels are shorter (IFNAMSIZ 16, IB_DEVICE_NAME_MAX and firmware/board ids 64, NVML names 96),
# so 256 characters passes every real value while a garbage file's text (up to 64 KiB) stays out
# of a label; and a Prometheus whose label_value_length_limit (which fails the whole scrape for
# one longer value) is 256 or more keeps every scrape of this exporter.
LABEL_VALUE_MAX = 256
# The label names every Prometheus version parses, and that web/http.py's encoding
# shortcut assumes; a third-party collector's other names are refused here.
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_good_label_names: set[str] = set()  # names found valid: those of the specs, a few dozen


def _show(value: object) -> str:
    """A value for a log line: ASCII (escapes for anything else), at most about 60 characters."""
    text = ascii(value[:60] if isinstance(value, str) else value)
    return text if len(text) <= 64 else text[:60] + "..."


def label_problem(labels: object) -> str | None:
    """Why a sample with these labels cannot be exposed, or None when it can: every name a
    Prometheus label name, every value a string of at most LABEL_VALUE_MAX characters that
    encodes as UTF-8 (strict: no lone surrogate) and holds no NUL."""
    if not isinstance(labels, dict):
        return f"labels are a {type(labels).__name__}, not a dict"
    for name, value in labels.items():
        if name not in _good_label_names:
            if not (isinstance(name, str) and _LABEL_NAME.fullmatch(name)):
                return f"label name {_show(name)} is not a Prometheus label name"
            if len(_good_label_names) < 10_000:
                _good_label_names.add(name)
        if not isinstance(value, str):
            return f"label {name}={_show(value)} is not a string"
        if len(value) > LABEL_VALUE_MAX:
            return (f"label {name}={_show(value)} is longer than {LABEL_VALUE_MAX} characters "
                    f"({len(value)})")
        if "\0" in value:
            return f"label {name}={_show(value)} holds a NUL character"
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return f"label {name}={_show(value)} is not UTF-8 (bytes the kernel gave as is)"
    return None


def drop_unexposable(families: list[Metric], skip: Callable[[str, object], None]) -> None:
    """Remove, in place, every sample whose labels cannot be exposed (:func:`label_problem`),
    calling ``skip(what, why)`` for each: such a sample costs itself, not the scrape. A HELP
    text UTF-8 cannot encode gets backslash escapes instead.

    Runs on every collection, so it is quick: many samples share one label dict
    (Families.add_labeled), so each distinct dict is judged once; and a dict whose names are
    known and whose values, joined, are printable (so no lone surrogate and no NUL) and no
    longer than LABEL_VALUE_MAX passes on that alone.
    """
    ok: set[int] = set()
    bad: dict[int, str] = {}
    good_names = _good_label_names
    for fam in families:
        # A third-party HELP text with a name in it: escaped, not dropped.
        doc = fam.documentation
        if isinstance(doc, str) and not doc.isascii():
            fam.documentation = doc.encode("utf-8", "backslashreplace").decode("utf-8")
        dropped = False
        for s in fam.samples:
            labels = s.labels
            key = id(labels)
            if key in ok:
                continue
            why = bad.get(key)
            if why is None:
                try:
                    joined = "".join(labels.values())
                    if (joined.isprintable() and len(joined) <= LABEL_VALUE_MAX
                            and labels.keys() <= good_names):
                        ok.add(key)
                        continue
                except (AttributeError, TypeError):  # not a dict, or a value not a string
                    pass
                why = label_problem(labels)
                if why is None:
                    ok.add(key)
                    continue
                bad[key] = why
            skip(f"a sample of {s.name}", why)
            dropped = True
        if dropped:
            fam.samples = [s for s in fam.samples if id(s.labels) not in bad]


@dataclass
class Result:
    families: list[Metric]
    unknown: Mapping[str, str]  # check -> reason (Collector.unknown)
    success: bool
    duration: float
    unreadable: int
    error: str
    finished_at: float


@dataclass
class Status:
    """Last outcome of a collector, shown on the landing page."""

    success: bool | None = None
    duration: float = 0.0
    error: str = ""
    at: float = 0.0
    unknown: Mapping[str, str] = field(default_factory=dict)  # check -> reason


class Runner:
    """Runs one collector in its own long-lived thread; concurrent scrapes share one collection.

    A collection still in flight (a hung read) is joined by later scrapes instead of queued
    behind, so a stuck source never piles up work or threads.
    """

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.name = collector.name
        self.status = Status()
        self._lock = threading.Lock()
        self._inflight: Future[Result] | None = None
        self._started = 0.0
        self._queue: queue.SimpleQueue[tuple[Future[Result], Scrape]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"collect-{self.name}", daemon=True).start()

    def start(self, scrape: Scrape) -> tuple[Future[Result], float]:
        """The collection in flight, or a new one for ``scrape``; a scrape that finds one
        still in flight joins it (and that one keeps the scrape it began in)."""
        with self._lock:
            if self._inflight is None or self._inflight.done():
                fut: Future[Result] = Future()
                self._started = time.perf_counter()
                self._inflight = fut
                self._queue.put((fut, scrape))
            return self._inflight, self._started

    def _loop(self) -> None:
        while True:
            self._run(*self._queue.get())

    def _run(self, fut: Future[Result], scrape: Scrape) -> None:
        ctx = self.collector.ctx
        skipped = ctx.skips.count
        t0 = time.perf_counter()
        try:
            families = list(self.collector.collect(scrape))
            drop_unexposable(families, ctx.skip)
            unknown = {}
            for check, reason in self.collector.unknown().items():
                if reason in UNKNOWN_REASONS and check in self.collector.unknown_checks:
                    unknown[check] = reason
                else:  # a label value beyond the bounded set: dropped, said once
                    ctx.log_once(logging.ERROR, "unknown check %r (reason %r) left out: not in "
                                 "unknown_checks or not a reason of UNKNOWN_REASONS", check,
                                 reason)
            success, error = True, ""
        except BaseException as exc:  # even SystemExit: this thread must answer the future
            families, unknown, success = [], {}, False
            error = f"{type(exc).__name__}: {exc}"
            ctx.log_once(logging.ERROR, "collector failed: %s", error)
            ctx.logger.debug("collector traceback", exc_info=True)
        fut.set_result(Result(families, unknown, success, time.perf_counter() - t0,
                              ctx.skips.count - skipped, error, time.time()))


class Scraper:
    """The single prometheus_client collector that runs all enabled collectors per scrape."""

    def __init__(self, collectors: Mapping[str, Collector], timeout: float) -> None:
        self.runners = [Runner(c) for c in collectors.values()]
        self.timeout = timeout

    def collect(self, timeout: float | None = None) -> Iterator[Metric]:
        """Every collector's families. ``timeout`` (the scraper's own, an HTTP request's) can
        shorten this scrape's deadline below ``self.timeout``, never lengthen it."""
        limit = self.timeout if timeout is None else min(self.timeout, timeout)
        deadline = time.perf_counter() + limit
        # What this scrape's collectors share (one listing of RDMA devices), and when they should
        # have returned.
        scrape = Scrape(time.monotonic() + limit - min(WAIT_RESERVE * limit, WAIT_RESERVE_MAX))
        started = []
        for runner in self.runners:
            fut, t_start = runner.start(scrape)
            started.append((runner, fut, t_start))
            # Collectors are mostly Python between short syscalls: run side by side they only
            # trade the GIL back and forth. So each gets the interpreter to itself for up to
            # SOLO_SECONDS; one that is slower (or hung) overlaps with the next instead of
            # delaying it.
            with contextlib.suppress(FutureTimeout):
                fut.result(timeout=max(0.0, min(SOLO_SECONDS, deadline - time.perf_counter())))
        duration, success, unreadable, unknown = (s.family() for s in SCRAPE_METRICS[:4])
        for runner, fut, t_start in started:
            try:
                res = fut.result(timeout=max(0.0, deadline - time.perf_counter()))
            except FutureTimeout:
                waited = time.perf_counter() - t_start
                err = f"still running after {waited:.1f}s (timeout {limit:g}s)"
                runner.collector.ctx.log_once(
                    logging.ERROR, "collector timed out after %gs; its metrics are left out until "
                    "it answers", limit)
                runner.status = Status(False, waited, err, time.time())
                duration.add_metric([runner.name], waited)
                success.add_metric([runner.name], 0)
                continue
            runner.status = Status(res.success, res.duration, res.error, res.finished_at,
                                   res.unknown)
            yield from res.families
            duration.add_metric([runner.name], res.duration)
            success.add_metric([runner.name], 1 if res.success else 0)
            unreadable.add_metric([runner.name], res.unreadable)
            for check, reason in sorted(res.unknown.items()):
                unknown.add_metric([runner.name, check, reason], 1)
        yield duration
        yield success
        yield unreadable
        if unknown.samples:
            yield unknown
        info = SCRAPE_METRICS[4].family()
        info.add_metric([__version__, platform.python_version()], 1)
        yield info

    def close(self) -> None:
        for r in self.runners:
            try:
                r.collector.close()
            except Exception as exc:
                log.warning("closing collector %s: %s", r.name, exc)
