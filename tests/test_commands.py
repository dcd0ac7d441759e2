"""Subprocesses the exporter's way (gpunet_exporter.sources.commands): run_command and Child, with
real processes: their process groups killed on timeout, at kill, after a leader's exit and at
kill_running, nothing left behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gpunet_exporter.sources import commands
from gpunet_exporter.sources.commands import Child, CommandError, CommandTimeout, run_command

from support.wait import wait_for

# Forks a child that sleeps, writes both process ids to argv[1], then does argv[2]: "sleep"
# (hang) or an exit status.
FORKER = """import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(1000)
    os._exit(0)
with open(sys.argv[1] + ".tmp", "w") as fh:
    fh.write(f"{os.getpid()} {child}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
if sys.argv[2] == "sleep":
    time.sleep(1000)
sys.exit(int(sys.argv[2]))
"""


def alive(pid: int) -> bool:
    """Runs still (a zombie has ended; it waits only for its status to be read)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def gone(pid: int, timeout: float = 10) -> bool:
    try:
        wait_for(lambda: not alive(pid), f"process {pid} gone", timeout=timeout)
    except AssertionError:
        return False
    return True


def pids_of(path: Path, timeout: float = 30) -> tuple[int, int]:
    wait_for(path.exists, "the forker started", timeout=timeout, interval=0.02)
    leader, child = (int(x) for x in path.read_text().split())
    return leader, child


def registered(pid: int) -> bool:
    with commands._running_lock:
        return pid in commands._running


def test_run_command_output_and_errors(tmp_path: Path) -> None:
    # What earlier tests of this worker left running (a collector's background tool) is theirs.
    with commands._running_lock:
        before = set(commands._running)
    assert run_command([sys.executable, "-c", "print('hi')"], 30) == "hi\n"
    with pytest.raises(CommandError, match=r"exited with status 3: oops"):
        run_command([sys.executable, "-c", "import sys; print('oops', file=sys.stderr); "
                     "sys.exit(3)"], 30)
    with pytest.raises(CommandError, match="cannot run"):
        run_command([str(tmp_path / "missing")], 30)
    with commands._running_lock:
        assert commands._running <= before  # nothing of these stays registered


def test_run_command_timeout_kills_the_whole_group(tmp_path: Path) -> None:
    ids = tmp_path / "pids"
    with pytest.raises(CommandTimeout, match="timed out after 2s"):
        run_command([sys.executable, "-c", FORKER, str(ids), "sleep"], 2)
    leader, child = pids_of(ids)
    assert gone(leader) and gone(child), "the forked child outlived the timeout"
    assert not registered(leader)


def test_child_kill_takes_its_group_and_reaps(tmp_path: Path) -> None:
    ids = tmp_path / "pids"
    c = Child([sys.executable, "-c", FORKER, str(ids), "sleep"])
    leader, child = pids_of(ids)
    assert leader == c.pid and os.getpgid(child) == c.pid != os.getpgid(0)  # its own group
    assert registered(c.pid) and c.poll() is None and c.wait(0.2) is None
    assert c.kill() == -9
    assert gone(child) and not registered(c.pid)
    assert c.poll() == -9 and c.kill() == -9  # reaped once, then the same answer


def test_child_exit_takes_what_it_left_in_its_group(tmp_path: Path) -> None:
    ids = tmp_path / "pids"
    c = Child([sys.executable, "-c", FORKER, str(ids), "5"])
    _, child = pids_of(ids)
    assert c.wait(30) == 5
    assert gone(child), "the leader's exit left its child running"
    assert not registered(c.pid)


def test_kill_running_reaches_a_running_child(tmp_path: Path) -> None:
    ids = tmp_path / "pids"
    c = Child([sys.executable, "-c", FORKER, str(ids), "sleep"])
    _, child = pids_of(ids)
    commands.kill_running()  # the exporter is exiting
    assert c.wait(30) == -9 and gone(child)


def test_child_in_the_callers_group_is_killed_alone(tmp_path: Path) -> None:
    c = Child([sys.executable, "-c", "import time; time.sleep(1000)"], own_group=False)
    try:
        assert os.getpgid(c.pid) == os.getpgid(0) and not registered(c.pid)
        assert c.stop(0.2) == -9  # did not exit by itself: killed, and only it
    finally:
        c.kill()
    c = Child([sys.executable, "-c", "pass"], own_group=False)
    assert c.stop(30) == 0
