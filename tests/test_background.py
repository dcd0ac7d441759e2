"""The one pattern of slow work (gpunet_exporter.background): the Refresher's timeout, the scrape's
bounded wait for a first value, last good values, and freshness exported alike everywhere; and
the registry giving each collection its deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest
from prometheus_client.core import Metric

from gpunet_exporter.background import Fresh, Refresher, add_freshness, last_success_spec
from gpunet_exporter.collector import Collector, Families, MetricSpec, Scrape
from gpunet_exporter.registry import WAIT_RESERVE_MAX, Scraper

from support.metrics import make_collector, samples_of, series, value
from support.wait import wait_for

LOG: list[str] = []


def log(level: int, msg: str, *args: object) -> None:
    LOG.append(msg % args if args else msg)


class Source:
    """A slow source: each round takes the next answer, blocking while ``gate`` is closed."""

    def __init__(self, *answers: object) -> None:
        self.answers = list(answers)
        self.gate = threading.Event()
        self.gate.set()
        self.rounds = 0

    def __call__(self) -> object:
        self.rounds += 1
        self.gate.wait(30)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def refreshers() -> Iterator[list[tuple[Refresher[Any], Source]]]:
    made: list[tuple[Refresher[Any], Source]] = []
    yield made
    for r, src in made:
        r.stop()
        src.gate.set()


def make(made: list[tuple[Refresher[Any], Source]], src: Source, **kw: Any) -> Refresher[Any]:
    r: Refresher[Any] = Refresher("t", kw.pop("interval", 3600), src, log, **kw)
    made.append((r, src))
    return r


def test_failure_keeps_the_last_good_value_and_its_time(refreshers: Any) -> None:
    r = make(refreshers, Source("a", ValueError("tool broke"), "b"))
    assert r.snapshot() == Fresh()  # nothing yet: no value, no outcome, no time
    assert r.refresh() is True
    good = r.snapshot()
    assert (good.value, good.ok) == ("a", True) and good.last_success > 0
    time.sleep(0.01)
    assert r.refresh() is False
    assert r.snapshot() == Fresh("a", False, good.last_success)
    assert any("t refresh failed: tool broke" in m for m in LOG)
    time.sleep(0.01)
    r.refresh()
    assert r.snapshot().value == "b" and r.snapshot().last_success > good.last_success


def test_a_round_past_its_timeout_fails_and_its_late_result_is_discarded(
        refreshers: Any) -> None:
    LOG.clear()
    src = Source("good", "late")
    r = make(refreshers, src, timeout=0.2)
    r.refresh()
    good = r.snapshot()
    src.gate.clear()
    t = threading.Thread(target=r.refresh)
    t.start()
    try:
        wait_for(lambda: r.snapshot().ok is False)  # still running, but past its timeout
        assert t.is_alive()
        assert r.snapshot() == Fresh("good", False, good.last_success)
    finally:
        src.gate.set()
        t.join(10)
    assert src.rounds == 2
    assert r.snapshot() == Fresh("good", False, good.last_success)  # "late" was not taken
    assert sum("timeout of 0.2s" in m for m in LOG) == 1  # one overrun, logged once


def test_without_a_timeout_a_long_round_is_just_running(refreshers: Any) -> None:
    src = Source("a", "b")
    r = make(refreshers, src)
    r.refresh()
    src.gate.clear()
    t = threading.Thread(target=r.refresh)
    t.start()
    time.sleep(0.3)
    assert r.snapshot().ok is True  # the work bounds itself (a subprocess with its timeout)
    src.gate.set()
    t.join(10)
    assert r.snapshot().value == "b"


def test_the_first_wait_ends_at_the_deadline_and_later_ones_do_not_wait(
        refreshers: Any) -> None:
    src = Source({"mlx5_0": 4096})
    src.gate.clear()
    r = make(refreshers, src)
    r.start()
    t0 = time.monotonic()
    first = r.wait_first(time.monotonic() + 0.2)
    assert time.monotonic() - t0 < 20  # not the source's 30 s
    assert first == Fresh()  # the round still runs: no value and no outcome yet
    assert src.rounds == 1 and not src.gate.is_set()
    t0 = time.monotonic()
    assert r.wait_first(time.monotonic() + 60) == Fresh()  # a later scrape does not wait
    assert time.monotonic() - t0 < 20
    src.gate.set()
    wait_for(lambda: r.snapshot().ok is True)
    assert r.wait_first(time.monotonic() + 60).value == {"mlx5_0": 4096}


def test_the_first_wait_gets_a_quick_first_value(refreshers: Any) -> None:
    r = make(refreshers, Source("quick"))
    r.start()
    assert r.wait_first(time.monotonic() + 20).value == "quick"


def test_the_first_wait_ends_at_the_round_timeout(refreshers: Any) -> None:
    src = Source("never")
    src.gate.clear()
    r = make(refreshers, src, timeout=0.2)
    r.start()
    got = r.wait_first(None)  # no scrape deadline: the round's timeout bounds the wait
    assert got.ok is False and got.value is None and src.rounds == 1


def test_stopped_before_start_never_starts_nor_waits(refreshers: Any) -> None:
    src = Source("a")
    r = make(refreshers, src)
    r.stop()
    r.start()
    assert not r.started
    assert r.wait_first(None) == Fresh()  # returns at once instead of waiting forever
    assert src.rounds == 0
    r.refresh()  # the caller's own round still works (tests drive rounds this way)
    assert r.wait_first(None).value == "a"


SUCCESS = MetricSpec("gpunet_t_refresh_success", "gauge", "t", ("x",), "boolean", "t")
LAST = last_success_spec("gpunet_t", "background read of t", ("x",))


def freshness(fresh: Fresh[Any], ok: bool | None = None) -> dict[str, float | None]:
    fams = Families()
    add_freshness(fams, SUCCESS, LAST, ["1"], fresh, ok=ok)
    s = samples_of(list(fams))
    return {"success": value(s, SUCCESS.name, x="1"), "last": value(s, LAST.name, x="1")}


def test_freshness_is_exported_alike() -> None:
    assert LAST.name == "gpunet_t_last_success_timestamp_seconds" and LAST.unit == "seconds"
    assert freshness(Fresh()) == {"success": None, "last": None}  # no round has ended
    assert freshness(Fresh[int]().failed()) == {"success": 0, "last": None}  # never 0
    good = Fresh[int]().succeeded(7, at=1_700_000_000.0)
    assert freshness(good) == {"success": 1, "last": 1_700_000_000.0}
    assert freshness(good.failed()) == {"success": 0, "last": 1_700_000_000.0}
    assert freshness(good, ok=False) == {"success": 0, "last": 1_700_000_000.0}


class DeadlineRecorder(Collector):
    name = "recorder"

    def collect(self, scrape: Scrape) -> Iterable[Metric]:
        self.seen = (time.monotonic(), scrape.deadline)
        return []


@pytest.mark.parametrize("timeout,header", [(4.0, None), (4.0, 1.0), (0.5, None)])
def test_the_registry_gives_each_collection_its_deadline(tmp_path: Any, timeout: float,
                                                         header: float | None) -> None:
    c = make_collector(DeadlineRecorder, tmp_path)
    assert Scrape().deadline is None  # outside a scrape: none
    scraper = Scraper({"recorder": c}, timeout)
    before = time.monotonic()
    s = samples_of(list(scraper.collect(header)))
    assert series(s, "gpunet_scrape_collector_success")
    at, deadline = c.seen  # type: ignore[attr-defined]
    limit = timeout if header is None else min(timeout, header)
    assert deadline is not None
    # Before the scrape's own deadline by a tenth of it, at most WAIT_RESERVE_MAX.
    assert before + limit - min(limit / 10, WAIT_RESERVE_MAX) - 0.01 <= deadline
    assert deadline <= at + limit - min(limit / 10, WAIT_RESERVE_MAX) + 0.01
