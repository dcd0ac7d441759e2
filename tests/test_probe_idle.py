"""The probe runs only while the node's GPUs are idle, and leaves when a job comes (issue 31).

The gate (gpunet_exporter.probe.idle) against real processes, and the probe collector with its real
runner and gloo ranks beside a stand-in job: a real process that the NVML stand-in lists on a
GPU (tests/support/fake_nvml.py, GPUNET_FAKE_NVML_PROCESSES), as NVML lists a training job's.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.probe import idle, runner, supervisor
from gpunet_exporter.registry import Scraper
from gpunet_exporter.sources import nvml
from gpunet_exporter.sources.sysfs import Root
from gpunet_exporter.web.http import _landing

from support import fake_nvml
from support import sysfs_tree as st
from support.metrics import Samples, make_collector, samples_of, series, value
from support.wait import hold, wait_for

GLOO = {"backend": "gloo", "nprocs": 2, "sizes": [4096, 65536], "warmup": 1, "iterations": 5,
        "interval_seconds": 1, "timeout_seconds": 30}
HOLDOFF = 3.0
PROC = Root("/proc")


# -- the gate ---------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_gate_waits_the_holdoff_from_start_and_from_the_last_foreign_process() -> None:
    clock = Clock()
    gate = idle.Gate(120, clock)
    assert gate.observe(set()) == idle.HOLDOFF  # nothing seen yet for long enough
    clock.now += 119
    assert gate.observe(set()) == idle.HOLDOFF
    clock.now += 1
    assert gate.observe(set()) == idle.MEASURING
    assert gate.observe({4242}) == idle.YIELDED
    assert gate.foreign == {4242}
    clock.now += 60  # the job between two steps of its launcher: still not idle
    assert gate.observe(set()) == idle.HOLDOFF
    clock.now += 59
    assert gate.observe(set()) == idle.HOLDOFF
    clock.now += 1
    assert gate.observe(set()) == idle.MEASURING
    assert gate.idle_at() == 1000 + 120 + 120


def test_gate_that_cannot_look_is_unknown_never_idle() -> None:
    clock = Clock()
    gate = idle.Gate(0, clock)
    assert gate.observe(None) == idle.UNKNOWN
    assert gate.observe(set()) == idle.MEASURING


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    """A stand-in job: a process outside the probe's sessions."""
    p = subprocess.Popen(["sleep", "600"])
    yield p
    p.kill()
    p.wait()


def test_foreign_are_the_processes_outside_the_probe_sessions(
        job: subprocess.Popen[bytes]) -> None:
    own = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        known: set[int] = set()
        assert idle.foreign({job.pid, own.pid}, PROC, {own.pid}, known) == {job.pid}
        assert known == {own.pid}
        # A PID that exists nowhere here (another PID namespace's) is foreign: the probe yields
        # to what it cannot see.
        assert idle.foreign({2**22 + 7}, PROC, {own.pid}, known) == {2**22 + 7}
        # An own process that died is still the probe's while the driver lists it...
        own.kill()
        own.wait()
        known.add(own.pid)
        assert idle.foreign({own.pid}, PROC, set(), known) == set()
        # ...and forgotten once it is not listed any more.
        idle.foreign(set(), PROC, set(), known)
        assert known == set()
    finally:
        own.kill()
        own.wait()


def test_local_pid_maps_the_host_pid_through_nspid(tmp_path: Path) -> None:
    """In a container the procfs root is the host's /proc: NSpid's innermost entry is the PID
    here, accepted only when it names the same process (same start time)."""
    me = os.getpid()
    stat = Path(f"/proc/{me}/stat").read_text()
    host = tmp_path / "proc"
    (host / "90001").mkdir(parents=True)
    (host / "90001" / "stat").write_text(stat)
    (host / "90001" / "status").write_text(f"Name:\tpython\nNSpid:\t90001\t{me}\n")
    assert idle.local_pid(Root(str(host)), 90001) == me
    (host / "90002").mkdir()
    (host / "90002" / "stat").write_text(stat.replace(") ", ") X ", 1))  # another start time
    (host / "90002" / "status").write_text(f"NSpid:\t90002\t{me}\n")
    assert idle.local_pid(Root(str(host)), 90002) is None
    assert idle.local_pid(Root(str(host)), 90003) is None  # not there at all


def test_gpu_pids_reads_compute_and_graphics_processes() -> None:
    scenario = fake_nvml.h200x2()
    scenario["devices"][0]["processes"] = [11]
    scenario["devices"][1]["graphics_processes"] = [12]
    fake_nvml.load(scenario)
    nvml.forget(fake_nvml.MODULE)
    try:
        assert idle.gpu_pids(nvml.session(fake_nvml.MODULE)) == {11, 12}
        # A lost GPU runs no job (GpunetGpuLost says it is lost): the others still count.
        scenario["devices"][1]["lost"] = True
        fake_nvml.load(scenario)
        nvml.forget(fake_nvml.MODULE)
        assert idle.gpu_pids(nvml.session(fake_nvml.MODULE)) == {11}
        # A list that cannot be read for another reason: nothing is known.
        scenario["devices"][1]["lost"] = False
        scenario["devices"][1]["nvmlDeviceGetComputeRunningProcesses"] = {
            "exc": "NVMLError_Unknown"}
        fake_nvml.load(scenario)
        nvml.forget(fake_nvml.MODULE)
        assert idle.gpu_pids(nvml.session(fake_nvml.MODULE)) is None
    finally:
        nvml.forget(fake_nvml.MODULE)


# -- the collector and its runner beside a stand-in job -----------------------------------------


class Node:
    """The probe collector with its real runner (gloo), on a node whose NVML is the stand-in."""

    def __init__(self, tmp_path: Path, config: dict[str, object], gpu_processes: str = "") -> None:
        self.processes = tmp_path / "gpu-processes"
        self.processes.write_text(gpu_processes)
        self.state = tmp_path / "state"
        self.c = make_collector(ProbeCollector, st.build_dgx_h100(tmp_path / "tree"),
                                {"state_dir": str(self.state), **config},
                                nvml_module=fake_nvml.MODULE)
        assert isinstance(self.c, ProbeCollector)
        self.c.supervisor.start()

    def scrape(self) -> Samples:
        return samples_of(list(self.c.collect(Scrape())))

    def state_is(self, state: str) -> Samples | None:
        s = self.scrape()
        return s if value(s, "gpunet_probe_state", state=state) == 1 else None

    def job_on_gpu(self, index: int, pid: int) -> None:
        with self.processes.open("a") as fh:
            fh.write(f"{index} {pid}\n")

    def gpus_free(self) -> None:
        self.processes.write_text("")

    def probe_processes(self) -> list[str]:
        """The probe's processes: the runner's session, and any rank of this state dir."""
        pids = set()
        pid = self.c.supervisor.pid
        if pid is not None:
            pids |= set(subprocess.run(["pgrep", "-s", str(pid)], capture_output=True,
                                       text=True).stdout.split())
        pids |= set(subprocess.run(["pgrep", "-f", f"--state-dir {self.state}"],
                                   capture_output=True, text=True).stdout.split())
        return sorted(pids)


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Node]:
    monkeypatch.setenv("GPUNET_FAKE_NVML_PROCESSES", str(tmp_path / "gpu-processes"))
    fake_nvml.load(fake_nvml.h200x2())
    nvml.forget(fake_nvml.MODULE)
    n = Node(tmp_path, {**GLOO, "holdoff_seconds": HOLDOFF})
    yield n
    n.c.close()
    nvml.forget(fake_nvml.MODULE)


def failures(s: Samples) -> dict[str, float]:
    out: dict[str, float] = {}
    for lbl, v in series(s, "gpunet_probe_failures_total").items():
        reason = dict(lbl)["reason"]
        out[reason] = out.get(reason, 0) + v
    return out


def round_done(node: Node, after: float) -> Samples | None:
    s = node.scrape()
    times = [value(s, "gpunet_probe_last_success_timestamp_seconds", scope=scope) or 0
             for scope in ("intra", "net")]
    return s if min(times) > after else None


def test_probe_waits_measures_yields_to_a_job_and_comes_back(
        node: Node, job: subprocess.Popen[bytes]) -> None:
    # Started: the hold-off counts from the exporter's start; nothing runs yet.
    s = wait_for(lambda: node.state_is(idle.HOLDOFF), "hold-off at start", timeout=5)
    assert node.c.supervisor.pid is None
    assert value(s, "gpunet_probe_idle_since_timestamp_seconds") is None
    # Idle past the hold-off: both scopes measure.
    s = wait_for(lambda: round_done(node, 0), "a complete round once idle", timeout=60,
                 interval=0.2)
    assert value(s, "gpunet_probe_state", state=idle.MEASURING) == 1
    assert value(s, "gpunet_probe_idle_since_timestamp_seconds") is not None
    assert node.probe_processes()
    # A job appears on GPU 1: the runner and every rank leave, and nothing counts as failed.
    node.job_on_gpu(1, job.pid)
    s = wait_for(lambda: node.state_is(idle.YIELDED), "yielded to the job", timeout=5)
    assert value(s, "gpunet_probe_foreign_processes") == 1
    assert value(s, "gpunet_probe_runner_running") == 0
    wait_for(node.probe_processes, "the probe's processes gone", timeout=5, until_empty=True)
    # The last round before the job, not the first: rounds run every second, and under load
    # one more can end before the probe sees the job (the likely cause of one failure: a round
    # "after the job" found while the state was still the hold-off).
    first = max(value(node.scrape(), "gpunet_probe_last_success_timestamp_seconds",
                      scope=scope) or 0 for scope in ("intra", "net"))
    assert value(s, "gpunet_probe_yields_total") == 1
    assert not any(failures(s).values()), failures(s)
    # The landing page says so, with the last complete round.
    page = _landing(Scraper({"probe": node.c}, 5), "/metrics").decode()
    assert "probe yielded: 1 other process(es) on the GPUs, since " in page
    assert "last complete round never" not in page
    # While the job runs nothing of the probe's starts again: no restart, no retry.
    hold(HOLDOFF + 2, "a job that runs longer than the hold-off keeps the probe away")
    s = node.scrape()
    assert node.probe_processes() == []
    assert value(s, "gpunet_probe_state", state=idle.YIELDED) == 1
    assert not any(failures(s).values()), failures(s)
    # The job ends: the hold-off, then a complete round again.
    node.gpus_free()
    wait_for(lambda: node.state_is(idle.HOLDOFF), "hold-off after the job", timeout=5)
    s = wait_for(lambda: round_done(node, first), "a complete round after the job",
                 timeout=60, interval=0.2)
    assert value(s, "gpunet_probe_state", state=idle.MEASURING) == 1
    assert not any(failures(s).values()), failures(s)


def test_job_first_the_probe_never_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          job: subprocess.Popen[bytes]) -> None:
    monkeypatch.setenv("GPUNET_FAKE_NVML_PROCESSES", str(tmp_path / "gpu-processes"))
    fake_nvml.load(fake_nvml.h200x2())
    nvml.forget(fake_nvml.MODULE)
    n = Node(tmp_path, {**GLOO, "holdoff_seconds": 0}, gpu_processes=f"0 {job.pid}\n")
    try:
        wait_for(lambda: n.state_is(idle.YIELDED), "yielded from the start", timeout=5)
        hold(3, "the probe must not start beside the job, not even once")
        s = n.scrape()
        assert n.probe_processes() == []
        assert value(s, "gpunet_probe_yields_total") == 0  # nothing was ever started
        assert not any(failures(s).values()), failures(s)
        assert not (n.state / "intra.json").exists()
    finally:
        n.c.close()
        nvml.forget(fake_nvml.MODULE)


def test_a_job_mid_round_stops_the_round_without_a_failure(
        node: Node, job: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 1 sleeps before each timed all-reduce (the runner's test hook): rounds take seconds,
    # and the job comes while one is under way.
    monkeypatch.setenv(runner.DELAY_ENV, "1:0.3")
    wait_for(lambda: round_done(node, 0), "a complete round once idle", timeout=60, interval=0.2)

    def in_round() -> bool:
        return supervisor.read_status(str(node.state), 0)[0] == "round"

    wait_for(in_round, "a round under way", timeout=30, interval=0.05)
    node.job_on_gpu(0, job.pid)
    wait_for(lambda: node.state_is(idle.YIELDED), "yielded", timeout=5)
    wait_for(node.probe_processes, "the probe's processes gone", timeout=5, until_empty=True)
    s = node.scrape()
    assert not any(failures(s).values()), failures(s)
    for scope in ("intra", "net"):  # no failure written for the round that was cut short
        assert value(s, "gpunet_probe_success", scope=scope) == 1


# A runner whose ranks saw a foreign process at the round's start: it writes the round they
# leave, large sizes skipped, and waits (the real runner's check needs CUDA and NVML).
ROUND_SKIPPED = r"""
import json, os, sys, time
state, scope = sys.argv[1], sys.argv[2]
now = time.time()
size = {"bytes": 8192, "median_seconds": 2e-5, "p99_seconds": 3e-5, "max_seconds": 4e-5,
        "algbw_bytes_per_second": 4e8, "busbw_bytes_per_second": 4e8}
res = {"version": 2, "scope": scope, "started": now, "time": now + 0.01, "success": True,
       "backend": "nccl", "world_size": 2, "skipped_busy": True,
       "sizes": [size, {"bytes": 1 << 20, "skipped": True}]}
with open(os.path.join(state, "tmp"), "w") as fh:
    json.dump(res, fh)
os.replace(os.path.join(state, "tmp"), os.path.join(state, scope + ".json"))
time.sleep(120)
"""


@pytest.mark.parametrize("job", ["after the round was read", "before it was read", "never"])
def test_a_round_cut_short_by_a_job_is_the_yields_not_skipped_busy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, job: str) -> None:
    """Seen on 4 H100s (docs/probe.md): a job came between the ranks' look at their GPUs, at a
    round's start, and the supervisor's next look; that round skipped its large sizes, and
    counted skipped_busy beside the yield. It is the yield's now, whichever the supervisor saw
    first; a process it never sees (gone within a tick) still counts as skipped_busy."""
    monkeypatch.setattr(supervisor, "SKIP_GRACE", 1.0)
    state = tmp_path / "state"
    state.mkdir()
    foreign: set[int] = set()
    sup = supervisor.Supervisor(
        str(state), [sys.executable, "-c", ROUND_SKIPPED, str(state), "intra"], interval=60,
        timeout=60, default_scope="intra", log=lambda *a: None,
        logger=logging.getLogger("test"), look=lambda: set(foreign), holdoff=0)
    try:
        sup.refresh()
        assert sup.pid is not None  # idle: the runner started
        wait_for(lambda: (state / "intra.json").exists(), "the round's result", timeout=30)
        if job == "before it was read":
            foreign.add(os.getpid())
        sup.refresh()
        snap = sup.snapshot()
        assert snap.scopes["intra"].good is not None and snap.scopes["intra"].good.skipped_busy
        assert snap.scopes["intra"].failures["skipped_busy"] == 0
        if job == "after the round was read":
            foreign.add(os.getpid())
            sup.refresh()
        hold(supervisor.SKIP_GRACE + 0.5, "the round held past the grace")
        sup.refresh()
        snap = sup.snapshot()
        if job == "never":
            assert (snap.state, snap.yields, sup.pid is not None) == (idle.MEASURING, 0, True)
            assert snap.scopes["intra"].failures == {**dict.fromkeys(supervisor.REASONS, 0),
                                                     "skipped_busy": 1}
        else:
            assert (snap.state, snap.yields, sup.pid) == (idle.YIELDED, 1, None)
            assert not any(snap.scopes["intra"].failures.values())
    finally:
        sup.close()


def test_no_nvml_with_nccl_is_unknown_and_runs_nothing(tmp_path: Path) -> None:
    """A node whose NVML is missing cannot tell a job from idle GPUs: unknown, no rounds."""
    scenario = fake_nvml.h200x2()
    scenario["library"] = "missing"
    fake_nvml.load(scenario)
    nvml.forget(fake_nvml.MODULE)
    c = make_collector(ProbeCollector, st.build_dgx_h100(tmp_path / "tree"),
                       {"state_dir": str(tmp_path / "state"), "holdoff_seconds": 0},
                       nvml_module=fake_nvml.MODULE)
    assert isinstance(c, ProbeCollector)
    try:
        c.supervisor.refresh()
        s = samples_of(list(c.collect(Scrape())))
        assert value(s, "gpunet_probe_state", state=idle.UNKNOWN) == 1
        assert value(s, "gpunet_probe_runner_running") == 0
        assert c.supervisor.pid is None
    finally:
        c.close()
        nvml.forget(fake_nvml.MODULE)


def test_exporter_runs_no_runner_of_its_own_under_runner_none(tmp_path: Path) -> None:
    c = make_collector(ProbeCollector, st.build_dgx_h100(tmp_path / "tree"),
                       {"state_dir": str(tmp_path / "state"), "runner": "none"})
    try:
        s = samples_of(list(c.collect(Scrape())))
        assert not series(s, "gpunet_probe_state")
    finally:
        c.close()

