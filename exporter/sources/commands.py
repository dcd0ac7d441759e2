"""Subprocesses, run the one way the exporter runs them: never through a shell, with a timeout,
in a process group of their own that is killed on timeout and when the exporter exits."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Sequence


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
