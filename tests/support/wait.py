"""Waiting in tests: one polling loop (wait_for), a check that a background refresher has
finished every round asked of it (refresher_idle), and the one kind of sleep that remains, made
explicit (hold).

A test that waits for something polls for it with wait_for, whose failure says what it waited
for, how long, and what the last check saw. A test that asserts that something did *not* happen
first waits for an event proving that the thing that could have made it happen has been processed
(a later notification, a refresher back in its idle wait, a process gone); only where no such
event exists (absence over a period of time) does it call hold, with the reason.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from gpunet_exporter.background import Refresher

T = TypeVar("T")


def describe(check: Callable[[], Any]) -> str:
    """The check's own text: a lambda's source from `lambda` on, else its name."""
    try:
        source = inspect.getsource(check).strip()
    except (OSError, TypeError):
        return repr(check)
    if getattr(check, "__name__", "") == "<lambda>" and "lambda" in source:
        return source[source.index("lambda"):]
    return getattr(check, "__qualname__", source)


def wait_for(check: Callable[[], T], what: str = "", *, timeout: float = 10.0,
             interval: float = 0.05, ignore: tuple[type[BaseException], ...] = (),
             until_empty: bool = False) -> T:
    """Call ``check`` until it returns something true, and return that; with ``until_empty``,
    until it returns something empty (processes gone: the failure shows those left).

    After ``timeout`` seconds it fails with an AssertionError naming ``what`` (by default the
    check's source), the time waited and what the last call returned or raised. An exception of
    a class in ``ignore`` counts as "not yet" (a server still starting); any other propagates at
    once, so that a check can fail fast (the process it waits on has exited).
    """
    start = time.monotonic()
    while True:
        try:
            result = check()
        except ignore as exc:
            last = f"raised {exc!r}"
        else:
            if bool(result) != until_empty:
                return result
            last = f"returned {result!r}"
        if time.monotonic() - start >= timeout:
            if len(last) > 500:
                last = last[:500] + " ..."
            raise AssertionError(f"timed out after {timeout:g} s waiting for "
                                 f"{what or describe(check)}; the last check {last}")
        time.sleep(interval)


_CONDITION_WAIT = threading.Condition.wait.__code__
_LOOP = Refresher._loop.__code__


def refresher_idle(refresher: Refresher[Any]) -> bool:
    """Whether ``refresher``'s thread sits between rounds, blocked in its interval wait, with no
    wake pending: every round asked of it so far (the first one, each wake()) has run to its end.

    A check for wait_for: waiting for it, then asserting that a count of rounds has not grown,
    proves that no further round is on its way, where a sleep would only make one unlikely."""
    thread = refresher._thread
    if thread is None or thread.ident is None or not thread.is_alive():
        return False
    frame = sys._current_frames().get(thread.ident)
    if frame is None or frame.f_code is not _CONDITION_WAIT:
        return False
    while frame is not None and frame.f_code.co_filename == threading.__file__:
        frame = frame.f_back  # Condition.wait <- Event.wait <- the loop
    # Read after the frames: a wake that came first would have kept the thread out of the wait,
    # or woken it from there with the flag still set.
    return frame is not None and frame.f_code is _LOOP and not refresher._wake.is_set()


def hold(seconds: float, why: str) -> None:
    """Sleep on purpose, for ``why``: the test asserts that something does not happen within a
    period of time (a hang not declared before its deadline), which no event can announce.
    Everything else waits for an event with wait_for."""
    assert why, "say why this test must sleep"
    time.sleep(seconds)
