"""Slow or active work (subprocesses such as ibv_devinfo or mlnx_qos) runs here, outside the
scrape: a daemon thread refreshes a value on its own interval, and the scrape reads the last good
value together with its age and whether the latest refresh succeeded."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class CommandError(Exception):
    """A subprocess that failed, timed out or could not start; the text says which."""


class CommandTimeout(CommandError):
    """A subprocess that did not finish within its timeout (and was killed)."""


# Process groups of the tools running now, killed at shutdown (kill_running): a tool that hangs
# runs in a session of its own and would otherwise outlive the exporter.
_running: set[int] = set()
_running_lock = threading.Lock()


def kill_running() -> None:
    """Kill every tool still running (the exporter or the doctor is exiting)."""
    with _running_lock:
        groups = list(_running)
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


def run_command(argv: Sequence[str], timeout: float) -> str:
    """Run argv (never through a shell) and return its stdout.

    On timeout the whole process group is killed, so a hung tool leaves nothing behind; so is
    every tool still running when the exporter exits (kill_running).
    """
    try:
        proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, env={**os.environ, "LC_ALL": "C"})
    except OSError as exc:
        raise CommandError(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    with _running_lock:
        _running.add(proc.pid)
    try:
        return _wait(proc, argv, timeout)
    finally:
        with _running_lock:
            _running.discard(proc.pid)


def _wait(proc: subprocess.Popen[bytes], argv: Sequence[str], timeout: float) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        raise CommandTimeout(f"{argv[0]} timed out after {timeout:g}s and was killed") from None
    if proc.returncode != 0:
        first = err.decode("utf-8", "replace").strip().splitlines()[:1]
        raise CommandError(f"{argv[0]} exited with status {proc.returncode}"
                           + (f": {first[0][:200]}" if first else ""))
    return out.decode("utf-8", "replace")


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
