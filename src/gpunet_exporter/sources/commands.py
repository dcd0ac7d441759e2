"""Subprocesses, run the one way the exporter runs them: never through a shell, with a timeout,
in a process group of their own that is killed on timeout and when the exporter exits.

``run_command`` runs a tool to its end; ``Child`` is the same start for a process that keeps
running (the probe's runner, the runner's worker ranks), with the same kill and reaping.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any


class CommandError(Exception):
    """A subprocess that failed, timed out or could not start; the text says which."""


class CommandTimeout(CommandError):
    """A subprocess that did not finish within its timeout (and was killed)."""


class CommandNotStarted(CommandError):
    """A program that could not be started: not installed, or not executable."""


# Process groups of the tools running now, killed at shutdown (kill_running): a tool that hangs
# runs in a session of its own and would otherwise outlive the exporter.
_running: set[int] = set()
_running_lock = threading.Lock()

Stream = int | IO[Any] | None  # what subprocess.Popen takes for stdout and stderr
KILL_WAIT = 10.0  # seconds Child.kill waits for a killed process to exit


def kill_running() -> None:
    """Kill every tool still running (the exporter or the doctor is exiting)."""
    with _running_lock:
        groups = list(_running)
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)


class Child:
    """A subprocess started the exporter's way: argv never through a shell, stdin from
    /dev/null, and (``own_group``, the default) in a session and process group of its own,
    registered for kill_running until it is reaped.

    ``kill`` kills the whole group (or, without a group of its own, the process) and reaps it.
    A leader that exits by itself has its group's leftovers (children it did not wait for)
    killed when ``poll`` sees it gone, before it is reaped, while its process id still names
    the group. Raises OSError when the program cannot be started. Safe to use from more than
    one thread.
    """

    def __init__(self, argv: Sequence[str], *, stdout: Stream = subprocess.DEVNULL,
                 stderr: Stream = subprocess.DEVNULL, env: Mapping[str, str] | None = None,
                 pass_fds: Sequence[int] = (), own_group: bool = True,
                 cwd: str | None = None) -> None:
        self.argv = list(argv)
        self.own_group = own_group
        self._lock = threading.Lock()
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
            env=None if env is None else dict(env), pass_fds=tuple(pass_fds),
            start_new_session=own_group, cwd=cwd)
        self.pid = self._proc.pid
        if own_group:
            with _running_lock:
                _running.add(self.pid)

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def poll(self) -> int | None:
        """The exit status once the process has exited (then reaped), else None."""
        with self._lock:
            if self._proc.returncode is not None:
                return self._proc.returncode
            try:  # exited? (WNOWAIT: not reaped yet, so its pid still names its group)
                exited = os.waitid(os.P_PID, self.pid,
                                   os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            except ChildProcessError:  # reaped already
                exited = True
            if not exited:
                return None
            if self.own_group:  # what it left behind in its group goes with it
                self._signal_group()
            return self._reap()

    def wait(self, timeout: float) -> int | None:
        """The exit status, waiting up to ``timeout`` seconds for it; None if still running."""
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.05)

    def kill(self, timeout: float = KILL_WAIT) -> int | None:
        """SIGKILL the group (or the process) and reap it: its exit status, or None when it has
        not exited within ``timeout`` seconds (a process stuck in the kernel; it stays
        registered for kill_running)."""
        with self._lock:
            if self._proc.returncode is None:
                self._signal_group()
        return self.wait(timeout)

    def stop(self, timeout: float) -> int | None:
        """Its exit status, waiting up to ``timeout`` seconds for it to exit before killing it."""
        rc = self.wait(timeout)
        return self.kill() if rc is None else rc

    def communicate(self, timeout: float) -> tuple[bytes, bytes]:
        """stdout and stderr (started with pipes), once it exited within ``timeout`` seconds;
        else it is killed and subprocess.TimeoutExpired raised."""
        try:
            out, err = self._proc.communicate(timeout=timeout)
        except BaseException:  # TimeoutExpired, or the caller is interrupted: nothing stays
            self.kill()
            raise
        with self._lock:
            self._forget()
        return out or b"", err or b""

    def _signal_group(self) -> None:
        try:
            if self.own_group:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                self._proc.kill()
        except OSError:
            with contextlib.suppress(OSError):
                self._proc.kill()

    def _reap(self) -> int:
        """Reap the exited process, draining its pipes (bounded: a process outside its group
        may hold them open)."""
        if self._proc.stdout is not None or self._proc.stderr is not None:
            try:
                self._proc.communicate(timeout=1.0)
            except subprocess.TimeoutExpired:
                for fh in (self._proc.stdout, self._proc.stderr):
                    if fh is not None:
                        fh.close()
        rc = self._proc.wait()
        self._forget()
        return rc

    def _forget(self) -> None:
        if self.own_group:
            with _running_lock:
                _running.discard(self.pid)


def run_command(argv: Sequence[str], timeout: float,
                env: Mapping[str, str] | None = None, ok_status: Sequence[int] = (0,),
                cwd: str | None = None) -> str:
    """Run argv (never through a shell) and return its stdout; ``env`` adds to the exporter's
    environment, an exit status outside ``ok_status`` raises CommandError, and ``cwd`` is the
    folder it runs in (the exporter's own by default).

    On timeout the whole process group is killed, so a hung tool leaves nothing behind; so is
    every tool still running when the exporter exits (kill_running).
    """
    return run_command_bytes(argv, timeout, env, ok_status, cwd).decode("utf-8", "replace")


def run_command_bytes(argv: Sequence[str], timeout: float,
                      env: Mapping[str, str] | None = None, ok_status: Sequence[int] = (0,),
                      cwd: str | None = None) -> bytes:
    """:func:`run_command`, its stdout as the bytes the tool wrote (``ethtool -m ... raw on``)."""
    try:
        child = Child(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                      env={**os.environ, **(env or {}), "LC_ALL": "C"}, cwd=cwd)
    except OSError as exc:
        raise CommandNotStarted(f"cannot run {argv[0]}: {exc.strerror or exc}") from None
    try:
        out, err = child.communicate(timeout)
    except subprocess.TimeoutExpired:
        raise CommandTimeout(f"{argv[0]} timed out after {timeout:g}s and was killed") from None
    if child.returncode not in ok_status:
        first = err.decode("utf-8", "replace").strip().splitlines()[:1]
        raise CommandError(f"{argv[0]} exited with status {child.returncode}"
                           + (f": {first[0][:200]}" if first else ""))
    return out
