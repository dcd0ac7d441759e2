"""Slow or active work (subprocesses such as ibv_devinfo or mlnx_qos) runs here, outside the
scrape: a daemon thread refreshes a value on its own interval, and the scrape reads the last good
value together with its age and whether the latest refresh succeeded."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Refresher(Generic[T]):
    """Calls ``fn`` now and then every ``interval`` seconds in a daemon thread.

    ``value`` keeps the last good result; a failed refresh keeps it and sets ``ok`` False.
    :meth:`wake` makes the thread run the next round now instead of at the end of the interval
    (a device appeared or went away); wakes during a round coalesce into one more round.
    """

    def __init__(self, name: str, interval: float, fn: Callable[[], T],
                 log: Callable[[int, str, object], None]) -> None:
        self.name = name
        self.interval = interval
        self._fn = fn
        self._log = log
        self.value: T | None = None
        self.ok: bool | None = None
        self.last_success = 0.0  # time.time() of the last good refresh
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by wake() and stop(): ends the wait early
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"refresh-{self.name}",
                                                daemon=True)
                self._thread.start()

    def refresh(self) -> None:
        try:
            value = self._fn()
        except Exception as exc:  # the last good value keeps being served
            self.ok = False
            self._log(logging.WARNING, "%s", f"{self.name} refresh failed: {exc}")
            return
        self.value, self.ok, self.last_success = value, True, time.time()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # a wake during the round below asks for one more round
            self.refresh()
            self._wake.wait(self.interval)

    def age(self) -> float | None:
        return time.time() - self.last_success if self.last_success else None

    def wake(self) -> None:
        """Run the next round now (a no-op before start() and after stop())."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
