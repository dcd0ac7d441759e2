"""The probe: runner arithmetic, result files, real gloo ranks through the real runner (a node's
intra and net scopes, a one-device node, a planted straggler, torchrun cluster mode), and the
collector supervising it (timeouts, crashes, garbage)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.probe import REASONS, ProbeCollector, ProbeSettings
from gpunet_exporter.config import settings_fields
from gpunet_exporter.flags import Parser
from gpunet_exporter.probe import cli, results, run_options, runner
from gpunet_exporter.probe.run_options import RunOptions
from gpunet_exporter.sources import nvml
from gpunet_exporter.statefile import write_json

from support import sysfs_tree as st
from support.exporter import free_port
from support.metrics import Samples, make_collector, parse, samples_of, series, value
from support.paths import REPO
from support.wait import hold, wait_for

GLOO = {"backend": "gloo", "nprocs": 2, "sizes": [4096, 65536], "warmup": 1, "iterations": 5,
        "interval_seconds": 1, "timeout_seconds": 60}


def probe(*args: str, env: dict[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpunet_exporter.probe.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


# -- arithmetic ------------------------------------------------------------------------------


def test_bus_bandwidth_is_nccl_tests_formula() -> None:
    assert runner.bus_bandwidth(100.0, 2) == 100.0
    assert runner.bus_bandwidth(100.0, 8) == 175.0  # 2 * 7 / 8
    assert runner.bus_bandwidth(100.0, 1) == 100.0


def test_summarize_times_takes_the_collective_without_the_wait() -> None:
    matrix = [[1.0, 2.0, 3.0, 4.0], [2.0, 1.0, 5.0, 1.0]]  # rows: ranks
    stats = runner.summarize_times(matrix, [3.5, 2.5], 1000, 2)
    assert stats.median_seconds == 1.0  # of 1, 1, 3, 1: the last to arrive waited least
    assert stats.max_seconds == 3.0 and stats.p99_seconds == 3.0


def test_bandwidth_comes_from_the_tight_loop() -> None:
    """Not from the median of the per-iteration times: from the loop of as many all-reduces,
    whose time is the shortest of the ranks' (the rank that started last waited least)."""
    matrix = [[4e-3] * 10, [5e-3] * 10, [4.5e-3] * 10, [6e-3] * 10]
    stats = runner.summarize_times(matrix, [0.031, 0.030, 0.032, 0.033], 1 << 20, 4)
    assert stats.median_seconds == 4e-3 and stats.loop_seconds == 0.030
    assert stats.algbw_bytes_per_second == pytest.approx((1 << 20) * 10 / 0.030)
    assert stats.busbw_bytes_per_second == pytest.approx(stats.algbw_bytes_per_second * 1.5)
    assert runner.summarize_times(matrix, [0.0] * 4, 1 << 20, 4).busbw_bytes_per_second == 0


def test_straggler_is_the_rank_that_waits_least() -> None:
    """The issue's numbers: rank 2 made 5 ms late; per-rank medians [11.8, 11.7, 6.4, 11.8] ms.
    The old lateness named rank 0; the late rank is the one with the shortest time."""
    base = [[11.8, 11.9, 11.7], [11.7, 11.6, 11.8], [6.4, 6.5, 6.3], [11.8, 11.8, 11.9]]
    s = runner.straggler([[t / 1e3 for t in row] for row in base])
    assert s is not None and s.rank == 2 and s.late_share == 1.0
    assert s.wait_seconds == pytest.approx(5.4e-3, abs=1e-4)
    assert s.wait_ratio == pytest.approx(5.4 / 11.8, abs=0.01)


def test_straggler_in_a_fair_run_waits_for_nobody() -> None:
    fair = [[1.00, 1.02, 0.99, 1.01], [1.01, 0.99, 1.00, 1.02], [0.99, 1.01, 1.02, 1.00]]
    s = runner.straggler(fair)
    assert s is not None and s.wait_ratio < 0.05 and s.late_share <= 0.5
    assert runner.straggler([[1.0, 2.0]]) is None  # one rank


def test_plan_of_a_node() -> None:
    assert runner.plan(["intra", "net"], 8) == {"intra": list(range(8)), "net": list(range(8))}
    # One GPU: no intra scope (nothing to reduce with), two net ranks on that GPU.
    assert runner.plan(["intra", "net"], 1) == {"net": [0, 0]}
    assert runner.plan(["intra"], 1) == {}
    assert runner.plan(["net"], 0) == {}


def test_hca_usage_divides_the_link_among_its_ranks() -> None:
    g = 50e9
    per_rank = [("a", [{"device": "mlx5_0", "port": "1", "gdr": True, "rate": g}]),
                ("a", [{"device": "mlx5_0", "port": "1", "gdr": False, "rate": g}]),
                ("a", [{"device": "mlx5_1", "port": "1", "gdr": True, "rate": g / 2}]),
                ("b", [{"device": "mlx5_0", "port": "1", "gdr": True, "rate": g}])]
    hcas, link = runner.hca_usage(per_rank, "a")
    assert [(h["device"], h["ranks"], h["gdr"]) for h in hcas] == [
        ("mlx5_0", [0, 1], False), ("mlx5_1", [2], True)]  # host b's port is not this node's
    assert link == g / 2  # mlx5_0: 50 GB/s for two ranks; mlx5_1: 25 GB/s for one
    assert runner.hca_usage([("a", [])], "a") == ([], None)


def test_percentile_nearest_rank() -> None:
    values = list(range(1, 101))
    assert runner.percentile(values, 99) == 99
    assert runner.percentile(values, 50) == 50
    assert runner.percentile([3.0], 99) == 3.0


def test_sizes_parse_with_units_and_reject_bad_ones() -> None:
    assert run_options.parse_sizes("8KiB,1MiB,64MiB") == [8192, 1 << 20, 64 << 20]
    assert run_options.parse_sizes("65536, 8k") == [8192, 65536]
    for bad in ("", "8KB", "-1", "3", "1.5MiB"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"size|multiples"):
            run_options.parse_sizes(bad)
    # What the command line writes reads back the same.
    for sizes in ([8192, 1 << 20, 64 << 20], [4, 65540, 3 << 30]):
        assert run_options.parse_sizes(run_options.sizes_text(sizes)) == sizes
    assert run_options.sizes_text([8192, 1 << 20, 64 << 20]) == "8KiB,1MiB,64MiB"


def test_cluster_environment() -> None:
    c = runner.cluster_from_env({"RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3"})
    assert c == runner.Cluster(3, 16, 3, "torchrun")
    c = runner.cluster_from_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16",
                                 "SLURM_LOCALID": "1", "MASTER_ADDR": "node01"})
    assert c == runner.Cluster(9, 16, 1, "srun")
    assert runner.cluster_from_env({"SLURM_PROCID": "9", "SLURM_NTASKS": "16"}) is None
    assert runner.cluster_from_env({}) is None


# -- result files ----------------------------------------------------------------------------


def good_result(**over: Any) -> dict[str, Any]:
    now = time.time()
    data: dict[str, Any] = {
        "version": 2, "scope": "intra", "started": now - 0.2, "time": now, "success": True,
        "backend": "nccl", "world_size": 2, "nccl_version": "2.28.9",
        "sizes": [{"bytes": 8192, "skipped": False, "median_seconds": 2e-5, "p99_seconds": 3e-5,
                   "max_seconds": 4e-5, "algbw_bytes_per_second": 4.1e8,
                   "busbw_bytes_per_second": 4.1e8},
                  {"bytes": 67108864, "skipped": True}],
        "straggler": {"wait_seconds": 1e-6, "wait_ratio": 0.05, "late_share": 0.5,
                      "rank": None, "gpu": None, "local": False},
        "net": "Socket", "transports": ["P2P"],
        "net_transports": [], "gdr": None, "problems": []}
    data.update(over)
    return data


def test_result_round_trip(tmp_path: Path) -> None:
    path = str(tmp_path / "intra.json")
    write_json(path, good_result())
    r = results.read(path)
    assert r.success and r.world_size == 2 and r.sizes[0].busbw_bytes_per_second == 4.1e8
    assert r.sizes[1].skipped and r.sizes[1].median_seconds == 0
    assert [p.name for p in tmp_path.iterdir()] == ["intra.json"]  # no temporary left


def test_result_loop_time_read_and_old_files_without_it(tmp_path: Path) -> None:
    """A runner's sizes carry the tight loop's time; a file from a runner before the loop
    (good_result: no loop_seconds) reads as it did, with 0 there."""
    path = str(tmp_path / "intra.json")
    write_json(path, good_result())
    assert results.read(path).sizes[0].loop_seconds == 0.0
    data = good_result()
    data["sizes"][0]["loop_seconds"] = 4e-4
    write_json(path, data)
    assert results.read(path).sizes[0].loop_seconds == 4e-4
    data["sizes"][0]["loop_seconds"] = "fast"
    write_json(path, data)
    with pytest.raises(results.BadResult, match="loop_seconds"):
        results.read(path)


@pytest.mark.parametrize(("change", "message"), [
    ({"version": 1}, "version"), ({"scope": "cluster"}, "scope"), ({"success": "yes"}, "success"),
    ({"success": False, "failure": "gremlins"}, "failure"), ({"time": -1}, "'time'"),
    ({"sizes": [{"bytes": 0}]}, "bytes"), ({"sizes": {}}, "sizes"),
    ({"sizes": [{"bytes": 8, "median_seconds": float("nan")}]}, "median_seconds"),
    ({"gdr": "on"}, "gdr"), ({"transports": "P2P"}, "transports"),
    ({"straggler": {"wait_seconds": 1, "wait_ratio": 2, "late_share": 0}}, "wait_ratio"),
    ({"straggler": {"wait_seconds": 1, "wait_ratio": 0, "late_share": 0, "rank": -1}}, "rank"),
    ({"hcas": [{"device": "mlx5_0", "port": "1 2"}]}, "hcas"),
    ({"hcas": [{"device": "x" * 65, "port": "1"}]}, "hcas"),
    ({"link_bytes_per_second": "fast"}, "link_bytes_per_second"),
])
def test_bad_results_are_named(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    path = tmp_path / "intra.json"
    path.write_text(json.dumps(good_result(**change)))
    with pytest.raises(results.BadResult, match=message):
        results.read(str(path))


@given(hs.binary(max_size=300))
def test_garbage_only_ever_raises_bad_result(data: bytes) -> None:
    with contextlib.suppress(results.BadResult, json.JSONDecodeError):
        results.parse(json.loads(data.decode("utf-8", "replace")))


# -- the real runner: two gloo ranks on CPU ---------------------------------------------------


def test_two_gloo_ranks_intra_and_net(tmp_path: Path) -> None:
    r = probe("run", "--backend", "gloo", "--nprocs", "2", "--sizes", "4KiB,256KiB",
              "--warmup", "1", "--iterations", "8", "--rounds", "2", "--interval", "0.2",
              "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    intra = results.read(str(tmp_path / "intra.json"))
    net = results.read(str(tmp_path / "net.json"))
    for res, scope in ((intra, "intra"), (net, "net")):
        assert res.success and res.scope == scope and res.world_size == 2
        assert [s.bytes for s in res.sizes] == [4096, 262144]
        for s in res.sizes:
            assert 0 < s.median_seconds <= s.p99_seconds <= s.max_seconds
            assert s.loop_seconds > 0  # 8 all-reduces back to back: the bandwidth's
            assert s.algbw_bytes_per_second == pytest.approx(s.bytes * 8 / s.loop_seconds)
            assert s.busbw_bytes_per_second == pytest.approx(s.algbw_bytes_per_second)  # n = 2
        assert res.straggler is not None and 0 <= res.straggler.wait_ratio <= 1
        assert res.backend == "gloo" and res.transports == () and res.gdr is None
    assert intra.time <= net.started  # one group after the other, never both at once
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["round"] == 1 and status["phase"] == "round" and status["scope"] == "net"
    assert status["since"] == net.started  # the second round's net group
    # NCCL's logs live in the state directory, private; nothing is left in /tmp.
    assert (tmp_path / "nccl").stat().st_mode & 0o777 == 0o700


def test_three_gloo_ranks_bandwidth_from_the_loop(tmp_path: Path) -> None:
    """Three real ranks: the file has each size's loop time, and the bus bandwidth is
    bytes x iterations / loop time x 2(n-1)/n, whatever the per-iteration median."""
    r = probe("run", "--backend", "gloo", "--nprocs", "3", "--scopes", "net", "--sizes",
              "64KiB,1MiB", "--warmup", "1", "--iterations", "6", "--rounds", "1",
              "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    raw = json.loads((tmp_path / "net.json").read_text())
    assert all(s["loop_seconds"] > 0 for s in raw["sizes"])
    res = results.read(str(tmp_path / "net.json"))
    assert res.world_size == 3 and [s.bytes for s in res.sizes] == [65536, 1 << 20]
    for s in res.sizes:
        assert s.algbw_bytes_per_second == pytest.approx(s.bytes * 6 / s.loop_seconds)
        assert s.busbw_bytes_per_second == pytest.approx(
            s.bytes * 6 / s.loop_seconds * 2 * (3 - 1) / 3)


def test_one_device_node_has_no_intra_scope(tmp_path: Path) -> None:
    """One GPU: a 1-rank intra "all-reduce" would export a bandwidth that means nothing (the
    issue measured 1.94e12 B/s on an H100). Only the net scope runs, two ranks on the GPU."""
    r = probe("run", "--backend", "gloo", "--nprocs", "1", "--sizes", "4KiB",
              "--warmup", "1", "--iterations", "4", "--rounds", "1", "--state-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "intra.json").exists()
    assert "the intra scope needs two" in r.stderr
    net = results.read(str(tmp_path / "net.json"))
    assert net.success and net.world_size == 2


@pytest.mark.parametrize("late", [2, None], ids=["rank-2-late", "fair"])
def test_planted_straggler_is_named_and_a_fair_run_names_none(tmp_path: Path,
                                                              late: int | None) -> None:
    """Four real gloo ranks; rank 2 sleeps 20 ms before every timed all-reduce (the runner's
    documented test hook). The late rank must be the one named, and a fair run names none."""
    env = {runner.DELAY_ENV: f"{late}:0.02"} if late is not None else {}
    r = probe("run", "--backend", "gloo", "--nprocs", "4", "--scopes", "net", "--sizes", "1MiB",
              "--warmup", "2", "--iterations", "12", "--rounds", "1",
              "--state-dir", str(tmp_path), env=env)
    assert r.returncode == 0, r.stderr
    st = results.read(str(tmp_path / "net.json")).straggler
    assert st is not None
    if late is None:
        assert st.rank is None and st.wait_ratio < 0.2, st
    else:
        assert st.rank == late and st.gpu == late and st.local, st
        assert st.wait_seconds == pytest.approx(0.02, rel=0.5) and st.late_share >= 0.75


def test_two_gloo_ranks_under_torchrun_cluster_mode(tmp_path: Path) -> None:
    """Cluster mode: torchrun starts the ranks; the node's local rank 0 writes inter.json."""
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "gpunet_exporter.probe.cli", "run", "--backend", "gloo", "--sizes", "4KiB",
         "--warmup", "1", "--iterations", "4", "--rounds", "1", "--state-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    res = results.read(str(tmp_path / "inter.json"))
    assert res.success and res.scope == "inter" and res.world_size == 2
    assert not (tmp_path / "intra.json").exists() and not (tmp_path / "net.json").exists()


def test_nccl_without_gpu_says_no_gpu(tmp_path: Path) -> None:
    r = probe("run", "--backend", "nccl", "--state-dir", str(tmp_path), "--rounds", "1",
              env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == runner.EXIT_NO_GPU
    assert "no CUDA device visible" in r.stderr and "Traceback" not in r.stderr
    for scope in ("intra", "net"):
        res = results.read(str(tmp_path / f"{scope}.json"))
        assert not res.success and res.failure == "no_gpu"


def test_bad_arguments_one_line_exit_2(tmp_path: Path) -> None:
    r = probe("run", "--state-dir", str(tmp_path), "--sizes", "8KB")
    assert r.returncode == 2 and "8KB" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    r = probe("run", "--state-dir", str(tmp_path), "--no-such-flag")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("gpunet-probe: error: unrecognized arguments: --no-such-flag (try")


def test_run_without_torch_says_how_to_install_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No torch: one line naming the extra, exit 5, each scope's result an init_error saying
    the same (the exporter's probe collector reads it); nothing started, no traceback."""
    monkeypatch.setitem(sys.modules, "torch", None)  # find_spec("torch") is None, as uninstalled
    assert cli.main(["run", "--state-dir", str(tmp_path), "--scopes", "intra,net"]) == 5
    err = capsys.readouterr().err
    assert err == ("gpunet-probe run: torch is not installed: "
                   "pip install 'gpunet-exporter[probe]'\n")
    for scope in ("intra", "net"):
        r = json.loads((tmp_path / f"{scope}.json").read_text())
        assert (r["success"], r["failure"]) == (False, "init_error")
        assert "pip install 'gpunet-exporter[probe]'" in r["error"]
    # The exporter reading those files: the probe's check is unknown, and the page says why.
    from gpunet_exporter.registry import Scraper
    from gpunet_exporter.web.http import _landing

    p = Probe(st.build_dgx_h100(tmp_path / "tree"), tmp_path, {"runner": "none"})
    scraper = Scraper({"probe": p.c}, 5.0)
    try:
        p.wait("gpunet_probe_failures_total", scope="intra", reason="init_error")
        got = samples_of(list(scraper.collect()))
        page = _landing(scraper, "/metrics").decode()
        # Another failure is no unknown: the rounds ran, and failed.
        write_json(str(tmp_path / "intra.json"), good_result(
            success=False, failure="init_error", error="NCCL WARN ..."))
        write_json(str(tmp_path / "net.json"), good_result(scope="net", success=False,
                                                            failure="nccl_error"))
        wait_for(lambda: not series(samples_of(list(scraper.collect())),
                                    "gpunet_check_unknown"),
                 "the unknown check cleared", timeout=30, interval=0.2)
    finally:
        scraper.close()
    assert series(got, "gpunet_check_unknown") == {frozenset(
        {("collector", "probe"), ("check", "allreduce"), ("reason", "library_missing")}): 1}
    assert "UNKNOWN: allreduce not checked (its library is not installed" in page


def test_help_shows_the_commands_people_run() -> None:
    r = probe("--help")
    assert r.returncode == 0
    assert "run" in r.stdout and "explain-log" in r.stdout
    assert "SUPPRESS" not in r.stdout and "worker" not in r.stdout


# -- the collector ---------------------------------------------------------------------------


def scoped(s: Samples, name: str, scope: str) -> list[frozenset[tuple[str, str]]]:
    return [lbl for lbl in series(s, name) if ("scope", scope) in lbl]


class Probe:
    def __init__(self, sysfs: Path, state: Path, config: dict[str, Any]) -> None:
        # gloo unless a test says otherwise: on this machine without NVIDIA's library that is
        # a node with no GPU to protect, where the supervisor starts the runner at once (with
        # nccl it could not tell idle GPUs from a job's, and would start nothing).
        self.c = make_collector(ProbeCollector, sysfs,
                                {"backend": "gloo", "state_dir": str(state), **config})
        assert isinstance(self.c, ProbeCollector)
        self.supervisor = self.c.supervisor

    def scrape(self) -> Samples:
        return samples_of(list(self.c.collect(Scrape())))

    def wait(self, name: str, timeout: float = 60, **labels: str) -> Samples:
        def scrape() -> Samples | None:
            s = self.scrape()
            return s if value(s, name, **labels) else None

        return wait_for(scrape, f"{name}{labels} non-zero", timeout=timeout, interval=0.2)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path / "tree")


@pytest.fixture
def collector(request: pytest.FixtureRequest, sysfs: Path, tmp_path: Path) -> Iterator[Probe]:
    p = Probe(sysfs, tmp_path / "state", request.param)
    yield p
    p.c.close()


@pytest.mark.parametrize("collector", [GLOO], indirect=True)
def test_collector_runs_the_real_runner(collector: Probe) -> None:
    collector.wait("gpunet_probe_success", scope="intra")
    s = collector.wait("gpunet_probe_success", scope="net")
    assert value(s, "gpunet_probe_runner_running") == 1
    for scope in ("intra", "net"):
        assert value(s, "gpunet_probe_world_size", scope=scope) == 2
        for size in ("4096", "65536"):
            for stat in ("median", "p99", "max"):
                assert (value(s, "gpunet_probe_allreduce_seconds", scope=scope, size=size,
                              stat=stat) or 0) > 0
            assert (value(s, "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second",
                          scope=scope, size=size) or 0) > 0
        assert value(s, "gpunet_probe_info", scope=scope, backend="gloo", nccl_version="") == 1
        assert value(s, "gpunet_probe_straggler_wait_ratio", scope=scope) is not None
    assert not scoped(s, "gpunet_probe_failures_total", "inter")  # no cluster mode here
    assert {dict(lbl)["reason"] for lbl in series(s, "gpunet_probe_failures_total")} == set(
        REASONS)
    assert not series(s, "gpunet_probe_transport_info")  # gloo: no NCCL log
    first = value(s, "gpunet_probe_last_round_timestamp_seconds", scope="intra")
    # The runner stays up and keeps going: a later round, same process.
    pid = collector.supervisor.pid
    assert pid is not None
    wait_for(lambda: value(collector.scrape(), "gpunet_probe_last_round_timestamp_seconds",
                           scope="intra") != first, "a later round", timeout=30, interval=0.2)
    assert collector.supervisor.pid == pid
    # Its session is the exporter's own: the gpu collector leaves its workers out.
    assert pid in nvml.own_sessions()
    workers = subprocess.run(["pgrep", "-s", str(pid)], capture_output=True, text=True)
    assert len(workers.stdout.split()) >= 3  # the launcher and its two gloo ranks share it


def run_args(command: list[str]) -> tuple[RunOptions, list[str]]:
    """What the runner's own parser makes of a command line the collector built, and the
    arguments after ``run``."""
    assert command[:4] == [sys.executable, "-m", "gpunet_exporter.probe.cli", "run"], command
    return parse_run(command[4:]), command[4:]


def parse_run(argv: list[str]) -> RunOptions:
    p = Parser(prog="gpunet-probe run")
    run_options.add_arguments(p)
    return run_options.from_args(p.parse_args(argv))


def test_command_leaves_the_defaults_to_the_runner(sysfs: Path, tmp_path: Path) -> None:
    """An empty configuration passes no option but where to work: every other value the runner
    uses is its own default, and the configuration's defaults are those same values."""
    c = make_collector(ProbeCollector, sysfs, {"state_dir": str(tmp_path)})
    assert isinstance(c, ProbeCollector)
    args, argv = run_args(c.command())
    assert argv == ["--state-dir", str(tmp_path), "--path.sysfs", str(sysfs)]
    assert args == RunOptions(state_dir=str(tmp_path), sysfs=str(sysfs))
    keys = run_options.keys(c.settings)
    assert keys and all(v == getattr(args, k) for k, v in keys.items()), keys
    # The supervisor's limits are the runner's.
    assert c.supervisor.interval == args.interval_seconds == 60
    assert c.supervisor.timeout == args.timeout_seconds == 120


def test_command_passes_every_setting_that_differs(sysfs: Path, tmp_path: Path) -> None:
    config = {"backend": "gloo", "nprocs": 3, "scopes": ["net"], "pin_hca": False,
              "straggler_min_ratio": 0.35, "sizes": [4096, 65536], "warmup": 2,
              "iterations": 7, "interval_seconds": 2.5, "timeout_seconds": 9,
              "memory_cap_bytes": 1 << 21, "busy_utilization": 0.75, "skip_busy": False}
    c = make_collector(ProbeCollector, sysfs, {"state_dir": str(tmp_path), **config})
    assert isinstance(c, ProbeCollector)
    assert set(config) == set(run_options.keys(c.settings))  # every run option it has
    args, argv = run_args(c.command())
    for name, want in config.items():
        got = getattr(args, name)
        assert got == (tuple(want) if isinstance(want, list) else want), name
        assert got != run_options.default(name), name  # so it was passed
    assert "--no-pin-hca" in argv and "--no-skip-busy" in argv
    assert argv[argv.index("--sizes") + 1] == "4KiB,64KiB"


def test_every_run_option_round_trips_through_its_command_line() -> None:
    """argv gives back, through the runner's parser, every option it was given: the ones the
    configuration has and the runner's own (rounds, scope, busy_min_size, sysfs)."""
    other = RunOptions(
        state_dir="/x", backend="gloo", nprocs=3, scopes=("net",), sizes=(4, 65540, 3 << 30),
        warmup=0, iterations=3, interval_seconds=0.1, rounds=2, memory_cap_bytes=3 << 20,
        busy_utilization=0.125, busy_min_size=65540, skip_busy=False, timeout_seconds=1e-3,
        scope="inter", straggler_min_ratio=1 / 3, sysfs="/host/sys", pin_hca=False)
    defaults = RunOptions(state_dir="/x")
    for name in other.__dataclass_fields__:
        assert name == "state_dir" or getattr(other, name) != getattr(defaults, name), name
    assert parse_run(run_options.argv(other)) == other
    assert run_options.argv(defaults) == ["--state-dir", "/x"]
    assert parse_run(["--state-dir", "/x"]) == defaults


def test_the_keys_that_are_run_options_are_declared_by_the_runner() -> None:
    """Each probe: key that is a run option has the option's name, type, default, help and
    bounds, from RunOptions alone; the run options that are no key are the runner's own."""
    keys = run_options.keys(ProbeSettings())
    options = settings_fields(RunOptions)
    schema = settings_fields(ProbeSettings)
    types, run_types = typing.get_type_hints(ProbeSettings), typing.get_type_hints(RunOptions)
    for name in keys:
        assert schema[name] == options[name], name  # help, default, bounds, choices
        assert types[name] == run_types[name], name
    assert set(options) - set(keys) == {"state_dir", "rounds", "busy_min_size", "scope",
                                        "sysfs"}
    for name in set(options) - set(keys):
        with pytest.raises(TypeError, match="no probe: key"):
            run_options.key(name)
    # The runner's --help shows each default as its flag takes it.
    p = Parser(prog="gpunet-probe run")
    run_options.add_arguments(p)
    text = " ".join(p.format_help().split())
    for shown in ("(default 8KiB,1MiB,64MiB)", "(default 1GiB)", "(1MiB)", "next (60)",
                  "(default intra,net)", "(default 0.2)", "(default /sys)"):
        assert shown in text, shown


@pytest.mark.parametrize("collector", [{
    "command": ["/nonexistent/gpunet-probe"]}], indirect=True)
def test_runner_that_cannot_start_counts_one_crash_per_try(collector: Probe) -> None:
    """A runner that cannot be started is retried with the backoff, not at every tick."""
    s = collector.wait("gpunet_probe_failures_total", scope="intra", reason="crash")
    assert value(s, "gpunet_probe_runner_running") == 0
    time.sleep(1.5)  # three ticks; the next try is 2 s after the first
    crashes = value(collector.scrape(), "gpunet_probe_failures_total", scope="intra",
                    reason="crash")
    assert crashes is not None and crashes <= 2, crashes
    assert collector.supervisor.restarts >= 1


def alive_in_session(sid: int) -> list[int]:
    """The processes of session ``sid`` that still run (a zombie has ended: it only waits
    for its parent, or init, to read its status)."""
    out = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True)
    alive = []
    for pid in out.stdout.split():
        with contextlib.suppress(OSError):  # gone meanwhile
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            if state != "Z":
                alive.append(int(pid))
    return alive


HANG = """import json, os, sys, time
d = sys.argv[sys.argv.index("--state-dir") + 1]
os.makedirs(d, exist_ok=True)
json.dump({"phase": "round", "scope": "net", "since": time.time(), "round": 0},
          open(os.path.join(d, "status.json"), "w"))
child = os.fork()
time.sleep(1000)
"""


@pytest.mark.parametrize("collector", [{
    "command": [sys.executable, "-c", HANG], "timeout_seconds": 1}], indirect=True)
def test_hung_round_is_killed_with_its_process_group(collector: Probe) -> None:
    collector.scrape()  # starts the supervisor, whose first tick starts the stand-in
    first = wait_for(lambda: collector.supervisor.pid, "the stand-in runner started",
                     timeout=30)
    # The status names the net group's round: the timeout counts there.
    s = collector.wait("gpunet_probe_failures_total", scope="net", reason="timeout")
    assert value(s, "gpunet_probe_success", scope="net") is None  # no round ever finished
    # The whole group went: no process of the stand-in's session (its forked child) is left.
    assert collector.supervisor.pid != first
    # SIGKILL is delivered at once, the end takes a moment.
    wait_for(lambda: alive_in_session(first), "the hung runner's session gone", timeout=10,
             until_empty=True)
    assert first not in nvml.own_sessions()  # killed: forgotten


IDLE = """import json, os, sys, time
d = sys.argv[sys.argv.index("--state-dir") + 1]
os.makedirs(d, exist_ok=True)
now = time.time()
json.dump({"phase": "sleep", "scope": "", "since": now + 0.01, "round": 1},
          open(os.path.join(d, "status.json"), "w"))
json.dump({"version": 2, "scope": "intra", "started": now, "time": now + 0.01,
           "success": True, "backend": "gloo", "world_size": 2, "sizes": []},
          open(os.path.join(d, "intra.json"), "w"))
time.sleep(1000)
"""


@pytest.mark.parametrize("collector", [{
    "command": [sys.executable, "-c", IDLE], "timeout_seconds": 1, "interval_seconds": 3}],
    indirect=True)
def test_runner_between_rounds_is_not_a_hang(collector: Probe) -> None:
    """A runner that finished its round and waits for the next one is left alone until the
    next round is overdue (interval + timeout after the last one started)."""
    collector.wait("gpunet_probe_success", scope="intra")
    # No event marks "not a hang yet": the absence is only seen as time goes by.
    hold(2.0, "past the 1 s timeout, within the 4 s of interval + timeout")
    s = collector.scrape()
    assert value(s, "gpunet_probe_failures_total", scope="intra", reason="timeout") == 0
    assert value(s, "gpunet_probe_runner_running") == 1
    s = collector.wait("gpunet_probe_failures_total", scope="intra", reason="timeout")
    assert value(s, "gpunet_probe_success", scope="intra") == 1  # the last round stands


@pytest.mark.parametrize("collector", [{
    "command": [sys.executable, "-c", "import sys; sys.exit(7)"]}], indirect=True)
def test_crashing_runner_counts_crash_and_is_restarted(collector: Probe) -> None:
    s = collector.wait("gpunet_probe_failures_total", scope="intra", reason="crash")
    assert value(s, "gpunet_probe_failures_total", scope="intra", reason="timeout") == 0
    assert collector.supervisor.restarts >= 1


@pytest.mark.parametrize("collector", [{"runner": "none"}], indirect=True)
def test_results_from_files_and_garbage(collector: Probe, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    write_json(str(state / "intra.json"), good_result())
    s = collector.wait("gpunet_probe_success", scope="intra")
    assert value(s, "gpunet_probe_size_skipped", scope="intra", size="67108864") == 1
    assert value(s, "gpunet_probe_runner_running") is None  # runner: none starts nothing
    (state / "intra.json").write_text("{not json")
    s = collector.wait("gpunet_probe_failures_total", scope="intra", reason="bad_result")
    assert value(s, "gpunet_probe_success", scope="intra") == 1  # last good values stay
    assert value(s, "gpunet_probe_allreduce_seconds", scope="intra", size="8192",
                 stat="median") == 2e-5
    write_json(str(state / "intra.json"), good_result(
        success=False, failure="nccl_error", error="NCCL WARN ..."))
    s = collector.wait("gpunet_probe_failures_total", scope="intra", reason="nccl_error")
    assert value(s, "gpunet_probe_success", scope="intra") == 0
    assert value(s, "gpunet_probe_last_success_timestamp_seconds", scope="intra") is not None


@pytest.mark.parametrize("collector", [{"runner": "none"}], indirect=True)
def test_socket_fallback_and_transports(collector: Probe, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    # Inter-node over NET/Socket while this node has ACTIVE RDMA ports: fallback.
    write_json(str(state / "inter.json"), good_result(
        scope="inter", transports=["NET", "P2P"], net_transports=["Socket"], gdr=False,
        problems=["gdr_disabled", "socket_fallback"]))
    # Intra-node on P2P only: no fallback.
    write_json(str(state / "intra.json"), good_result())
    # NIC loopback on sockets while RDMA ports are ACTIVE: fallback too.
    write_json(str(state / "net.json"), good_result(
        scope="net", transports=["NET"], net_transports=["Socket"], gdr=False))
    s = collector.wait("gpunet_probe_success", scope="inter")
    assert value(s, "gpunet_probe_socket_fallback", scope="inter") == 1
    assert value(s, "gpunet_probe_socket_fallback", scope="intra") == 0
    assert value(collector.wait("gpunet_probe_success", scope="net"),
                 "gpunet_probe_socket_fallback", scope="net") == 1
    assert value(s, "gpunet_probe_transport_info", scope="inter", transport="NET",
                 net="Socket") == 1
    assert value(s, "gpunet_probe_transport_info", scope="inter", transport="P2P", net="") == 1
    assert value(s, "gpunet_probe_gdr_active", scope="inter") == 0
    assert value(s, "gpunet_probe_gdr_active", scope="intra") is None
    assert value(s, "gpunet_probe_nccl_problem", scope="inter", problem="socket_fallback") == 1


@pytest.mark.parametrize("collector", [{"runner": "none"}], indirect=True)
def test_net_scope_hcas_link_ratio_and_straggler(collector: Probe, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    sizes = [{"bytes": 8192, "skipped": False, "median_seconds": 3e-5, "p99_seconds": 4e-5,
              "max_seconds": 5e-5, "algbw_bytes_per_second": 2.7e8,
              "busbw_bytes_per_second": 2.7e8},
             {"bytes": 67108864, "skipped": False, "median_seconds": 2e-3, "p99_seconds": 3e-3,
              "max_seconds": 3e-3, "algbw_bytes_per_second": 3.3e10,
              "busbw_bytes_per_second": 3.0e10}]
    write_json(str(state / "net.json"), good_result(
        scope="net", sizes=sizes, transports=["NET"], net_transports=["IB"], gdr=False,
        hcas=[{"device": "mlx5_0", "port": "1", "ranks": [0], "gdr": True,
               "rate_bytes_per_second": 5e10},
              {"device": "mlx5_5", "port": "1", "ranks": [1], "gdr": False,
               "rate_bytes_per_second": 2.5e10}],
        link_bytes_per_second=2.5e10,
        straggler={"wait_seconds": 4e-3, "wait_ratio": 0.66, "late_share": 1.0, "rank": 1,
                   "gpu": 1, "local": True}))
    s = collector.wait("gpunet_probe_success", scope="net")
    assert value(s, "gpunet_probe_link_bandwidth_bytes_per_second", scope="net") == 2.5e10
    assert value(s, "gpunet_probe_bus_bandwidth_link_ratio", scope="net") == pytest.approx(1.2)
    assert value(s, "gpunet_probe_hca_ranks", scope="net", device="mlx5_5", port="1") == 1
    assert value(s, "gpunet_probe_hca_gdr_active", scope="net", device="mlx5_0", port="1") == 1
    assert value(s, "gpunet_probe_hca_gdr_active", scope="net", device="mlx5_5", port="1") == 0
    assert value(s, "gpunet_probe_straggler_info", scope="net", rank="1", gpu="1") == 1
    assert value(s, "gpunet_probe_straggler_wait_ratio", scope="net") == 0.66
    assert value(s, "gpunet_probe_socket_fallback", scope="net") == 0  # IB carried it
    # A remote late rank (cluster mode, another node's) is not named here; a skipped largest
    # size gives no link ratio; a one-rank round no latency or bandwidth at all.
    write_json(str(state / "inter.json"), good_result(
        scope="inter", link_bytes_per_second=2.5e10,
        straggler={"wait_seconds": 4e-3, "wait_ratio": 0.66, "late_share": 1.0, "rank": 9,
                   "gpu": 1, "local": False}))
    write_json(str(state / "intra.json"), good_result(world_size=1))
    s = collector.wait("gpunet_probe_success", scope="inter")
    s = collector.wait("gpunet_probe_world_size", scope="intra")
    assert not scoped(s, "gpunet_probe_straggler_info", "inter")
    assert value(s, "gpunet_probe_straggler_wait_ratio", scope="inter") == 0.66
    assert value(s, "gpunet_probe_bus_bandwidth_link_ratio", scope="inter") is None
    assert not scoped(s, "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second", "intra")
    assert not scoped(s, "gpunet_probe_allreduce_seconds", "intra")


@pytest.mark.parametrize("collector", [{"runner": "none"}], indirect=True)
def test_intra_scope_nvlink_ratio(collector: Probe, tmp_path: Path) -> None:
    """An intra round with its GPUs' NVLink bandwidth: the values the 4 x H100 machine gave
    at the default sizes (docs/probe.md): 478.116 GB/s, 307 GB/s at 64 MiB, a ratio of 0.64."""
    state = tmp_path / "state"
    state.mkdir()
    sizes = [{"bytes": 67108864, "skipped": False, "median_seconds": 2e-4, "p99_seconds": 3e-4,
              "max_seconds": 3e-4, "algbw_bytes_per_second": 2.0e11,
              "busbw_bytes_per_second": 3.07e11}]
    write_json(str(state / "intra.json"), good_result(
        scope="intra", sizes=sizes, transports=["P2P"], nvlink_bytes_per_second=478116000000.0))
    s = collector.wait("gpunet_probe_success", scope="intra")
    assert value(s, "gpunet_probe_nvlink_bandwidth_bytes_per_second",
                 scope="intra") == 478116000000.0
    assert value(s, "gpunet_probe_bus_bandwidth_nvlink_ratio", scope="intra") == pytest.approx(
        3.07e11 / 478116000000.0)
    assert value(s, "gpunet_probe_link_bandwidth_bytes_per_second", scope="intra") is None


def test_nvlink_bandwidth_from_nvml() -> None:
    """sources/nvml.nvlink_bandwidth through the NVML stand-in: the H200 capture's 18 active
    links, each at the speed the H100s' NVLink speed field gave (26562 MB/s, the capture
    predates that field); a link down leaves it out; no speed field, no figure."""
    from support import fake_nvml

    scenario = fake_nvml.h200x2()
    dev = scenario["devices"][0]
    dev.setdefault("fieldValues", {})["NVML_FI_DEV_NVLINK_GET_SPEED"] = {
        "value": 26562, "valueType": 1, "nvmlReturn": 0}
    fake_nvml.load(scenario)
    nv = importlib.import_module(fake_nvml.MODULE)
    nv.nvmlInit()
    try:
        h0, h1 = nv.nvmlDeviceGetHandleByIndex(0), nv.nvmlDeviceGetHandleByIndex(1)
        assert nvml.nvlink_bandwidth(nv, h0) == 18 * 26562e6
        assert nvml.nvlink_bandwidth(nv, h1) is None  # no speed field recorded for GPU 1
        dev["nvlink"]["3"]["state"] = {"ok": 0}
        fake_nvml.load(scenario)
        nv.nvmlInit()
        h0 = nv.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvlink_bandwidth(nv, h0) == 17 * 26562e6
    finally:
        nv.nvmlShutdown()


def test_socket_fallback_needs_an_active_rdma_port(tmp_path: Path) -> None:
    empty = tmp_path / "empty-sys"
    empty.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    write_json(str(state / "inter.json"), good_result(
        scope="inter", transports=["NET"], net_transports=["Socket"]))
    p = Probe(empty, state, {"runner": "none"})
    try:
        s = p.wait("gpunet_probe_success", scope="inter")
        assert value(s, "gpunet_probe_socket_fallback", scope="inter") == 0
    finally:
        p.c.close()


def test_sizes_not_multiple_of_4_rejected(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text("probe:\n  sizes: [8190]\n")
    proc = subprocess.run(["gpunet-exporter", f"--config.file={cfg}", "--collector.probe",
                           f"--web.listen-address=127.0.0.1:{free_port()}"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "probe.sizes[0]" in proc.stderr and "multiple of 4" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_end_to_end_exporter_with_gloo_probe(run_exporter: Any, sysfs: Path,
                                             tmp_path: Path) -> None:
    cfg = tmp_path / "c.yml"
    cfg.write_text("probe:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in GLOO.items())
                   + f"  state_dir: {json.dumps(str(tmp_path / 'state'))}\n")
    e = run_exporter(f"--path.sysfs={sysfs}", f"--config.file={cfg}", "--collector.probe")
    def scrape() -> Samples | None:
        s = parse(e.metrics())
        return s if value(s, "gpunet_probe_success", scope="intra") == 1 else None

    s = wait_for(scrape, "a probe round through the installed exporter", timeout=90,
                 interval=0.5)
    assert value(s, "gpunet_scrape_collector_success", collector="probe") == 1
    # Stopping the exporter stops the runner and its ranks.
    e.stop()

    def left() -> list[str]:
        return subprocess.run(["pgrep", "-f", f"--state-dir {tmp_path / 'state'}"],
                              capture_output=True, text=True).stdout.split()

    wait_for(left, "the runner's processes gone after the exporter stopped", timeout=5,
             until_empty=True)


# -- the GPU scripts (bench/device_checks.py probe, bench/probe_bench.py), without GPUs ---------


def bench_script(name: str) -> Any:
    """A script of bench/ loaded as a module (they need GPUs to run, not to be read)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_device_check_probe_arguments_parse() -> None:
    for script, args in (("device_checks.py", ["probe", "--help"]),
                         ("probe_bench.py", ["--help"])):
        r = subprocess.run([sys.executable, str(REPO / "bench" / script), *args], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "--sizes" in r.stdout
    r = subprocess.run([sys.executable, str(REPO / "bench" / "device_checks.py"), "probe",
                        "--sizes", "3XB"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "invalid sizes value" in r.stderr


def test_device_check_helpers() -> None:
    dc = bench_script("device_checks")
    assert dc.size_list("1MiB,64MiB,256MiB") == [1 << 20, 64 << 20, 256 << 20]
    assert dc.size_list("8KiB, 65536,1g") == [8192, 65536, 1 << 30]
    with pytest.raises(ValueError):
        dc.size_list("1.5MiB")
    assert dc.parse_app_memory("4242, 1458\n4243, 1460\n4242, 2\n77, [N/A]\n\n") == {
        4242: 1460, 4243: 1460}
    # a child of this process, found with its environment and resident memory
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env={**os.environ, "GPUNET_PROBE_SCOPE": "intra"})
    try:
        assert wait_for(lambda: child.pid in dc.children(os.getpid()), "the child listed",
                        timeout=10)
        assert dc.proc_environ(child.pid, "GPUNET_PROBE_SCOPE") == "intra"
        assert dc.proc_environ(child.pid, "NO_SUCH_VARIABLE_HERE") is None
        assert (dc.proc_rss(child.pid) or 0) > 1 << 20
    finally:
        child.kill()
        child.wait()
    assert dc.proc_rss(child.pid) is None


def _sample(after: int, intra: list[int], net: list[int | None]) -> dict[str, Any]:
    procs = [{"pid": 100 + i, "scope": "intra", "device": str(i), "gpu_MiB": m, "rss_MiB": 1100.0}
             for i, m in enumerate(intra)]
    procs += [{"pid": 200 + i, "scope": "net", "device": str(i), "gpu_MiB": m, "rss_MiB": 900.5}
              for i, m in enumerate(net)]
    return {"after_round": after, "launcher_rss_MiB": 40.0, "processes": procs}


def test_device_check_memory_by_scope() -> None:
    dc = bench_script("device_checks")
    got = dc.memory_by_scope([_sample(1, [1458, 1460], [1018, None]),
                              _sample(2, [1458, 1470], [1020, 1019])])
    assert got["intra"] == {"processes": 2, "gpu_MiB_max": 1470, "rss_MiB_max": 1100.0,
                            "gpu_MiB_growth_max": 10, "not_seen_by_nvidia_smi": 0}
    assert got["net"]["gpu_MiB_max"] == 1020 and got["net"]["not_seen_by_nvidia_smi"] == 1
    assert dc.memory_by_scope([]) == {}


def _bench(ratio_64: float, kept: float, released: float) -> dict[str, Any]:
    def row(r: float) -> dict[str, Any]:
        return {"probe_busbw_GBps": 300 * r, "reference_busbw_GBps": 300.0,
                "probe_over_reference": r, "old_way_over_reference": 0.8,
                "old_way_busbw_GBps (bytes / per-iteration median)": 240.0}
    return {"cuda_module_loading": "LAZY",
            "accuracy": {str(1 << 20): row(0.6), str(64 << 20): row(ratio_64),
                         str(256 << 20): row(0.99)},
            "memory": {"process_gpu_MiB_max_rank (NVML)": {
                "CUDA context": 612.0, "process group": 1440.0,
                "after a round (cache released: between rounds)": released,
                "after a round, cache kept (the runner before)": kept},
                "host_rss_MiB_max_rank": {"CUDA context": 800.0},
                "torch_reserved_MiB_max_rank_between_rounds": 0.0}}


def test_device_check_bench_checks() -> None:
    """From 64 MiB up the probe must be within 0.9..1.1 of the tight loop; 1 MiB is reported;
    releasing PyTorch's cache must give back at least (0.9 of) the largest size."""
    dc = bench_script("device_checks")
    checks = dc.Checks()
    summary = dc.bench_checks(_bench(0.97, kept=1780.0, released=1458.0), "intra", checks)
    assert checks.failed == 0 and len(checks.rows) == 7
    assert summary["1MiB"]["probe_over_reference"] == 0.6
    assert summary["memory"]["gpu_MiB_between_rounds_max_rank"] == 1458.0
    checks = dc.Checks()
    dc.bench_checks(_bench(0.81, kept=1524.0, released=1458.0), "intra", checks)
    assert [r["check"] for r in checks.rows if not r["ok"]] == [
        "intra: probe busbw / tight loop at 64MiB at least 0.9",
        "intra: releasing the cache gives back at least the largest size (256 MiB, NVML)"]


def test_probe_bench_helpers() -> None:
    pb = bench_script("probe_bench")
    assert pb.memory_cap_for([1 << 20, 256 << 20]) == 1 << 30
    assert pb.memory_cap_for([1 << 30]) == 2 << 30
    args = pb.args_for([1 << 20, 256 << 20], 5, 20, pb.memory_cap_for([256 << 20]))
    assert args.sizes == (1 << 20, 256 << 20) and args.iterations == 20
    assert args.memory_cap_bytes == 1 << 30 and not args.skip_busy
    assert pb.busbw(1 << 20, 20, 0.002, 4) == pytest.approx((1 << 20) * 20 / 0.002 * 1.5)
    assert pb.busbw(1 << 20, 20, 0.0, 4) == 0.0
    assert pb.ratio(1.0, 0.0) is None and pb.ratio(3.0, 4.0) == 0.75
    assert pb.rss() > 1 << 20


# -- a fallback is measured, then NCCL chooses again ---------------------------------------------


@pytest.mark.parametrize("scope, transports, net, active, fell", [
    ("intra", ["P2P"], [], True, False),
    ("intra", ["P2P", "NET"], ["Socket"], False, True),  # NET between the node's own GPUs
    ("net", ["NET"], ["IB"], True, False),
    ("net", ["NET"], ["Socket"], True, True),  # sockets while an RDMA port is ACTIVE
    ("net", ["NET"], ["Socket"], False, False),  # no RDMA port: sockets are all there is
])
def test_socket_fallback_is_judged_in_one_place(scope: str, transports: list[str],
                                                net: list[str], active: bool,
                                                fell: bool) -> None:
    asked: list[bool] = []

    def rdma_active() -> bool:
        asked.append(True)
        return active

    assert results.socket_fallback(scope, "nccl", transports, net, rdma_active) is fell
    assert not results.socket_fallback(scope, "gloo", transports, net, rdma_active)
    assert len(asked) <= 1  # sysfs is read only when sockets are in question


class _Alive:
    def poll(self) -> None:
        return None


def _fake_group(replies: list[bytes]) -> runner._Group:
    """A launcher group whose workers have already replied ``replies``, one line each."""
    g = runner._Group("net", list(range(len(replies))), [], "/nonexistent", "nccl")
    for line in replies:
        r, w = os.pipe()
        os.write(w, line)
        os.close(w)
        g.replies.append(r)
        g.procs.append(_Alive())  # type: ignore[arg-type]
    return g


@pytest.mark.parametrize("replies, outcome", [
    ([b"done\n", b"done\n"], "ok"),
    ([b"done\n", b"renew\n"], "renew"),
    ([b"renew\n", b"renew\n"], "renew"),
    ([b"renew\n", b"failed\n"], "failed"),
])
def test_a_worker_that_fell_back_asks_for_a_new_group(replies: list[bytes],
                                                      outcome: str) -> None:
    """GpunetNcclSocketFallback must clear by itself once the port is fixed: NCCL keeps the
    transports it chose for the life of a communicator, so a round that fell back ends with
    "renew" and the launcher starts the group anew (next round, NCCL chooses again)."""
    g = _fake_group(replies)
    try:
        assert g.wait("done", time.monotonic() + 5, os.getppid()) == outcome
    finally:
        for fd in g.replies:
            with contextlib.suppress(OSError):
                os.close(fd)


def test_renew_stops_the_group_and_is_no_failure(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    g = _fake_group([b"renew\n", b"renew\n"])
    stopped: list[bool] = []
    monkeypatch.setattr(g, "send", lambda line: True)
    monkeypatch.setattr(g, "stop", lambda: stopped.append(True))
    args = RunOptions(state_dir=str(tmp_path))
    assert runner._group_round(args, "net", g, 0, os.getppid()) == "ok"
    assert stopped == [True]
    # No failure written: the round measured (the worker wrote its result).
    assert not os.path.exists(results.result_path(str(tmp_path), "net"))
