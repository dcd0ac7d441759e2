"""Load, faults and bad input against the installed exporter (tests, not benchmarks).

- X-Prometheus-Scrape-Timeout-Seconds shortens the per-scrape deadline (and bad values of it are
  ignored), seen through a GPU collector whose NVML calls are slow.
- Hanging sources: a stuck ``mlnx_qos`` (run in the background), a stuck ``ethtool -S`` (run in
  the scrape), an NVML call that blocks, and FIFOs planted in sysfs. Whatever hangs costs its own
  collector at most: the others' metrics arrive, the scrape answers within the timeout plus
  slack, and no threads pile up.
- Load: 50 concurrent scrapers for 30 s on the DGX H100 tree with GPUs; every response complete,
  memory flat.
- Soak: 10,000 scrapes while RDMA devices are unplugged and plugged back, a dangling class link
  comes and goes and a netdev goes down and up: no memory growth, no leaked threads or file
  descriptors, no stale series.

Each test starts its own exporter (the console script) with ``--no-hotplug``: the fixture trees'
changes make no uevents, and the host's own would only add noise; every scrape re-lists devices
either way. Measured numbers are printed (``pytest -s`` shows them). The only time assertions
are timeouts: a scrape that must answer within its deadline plus slack.
"""

from __future__ import annotations

import gzip
import http.client
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
from prometheus_client.parser import text_string_to_metric_families

from gpunet_exporter.collector import Collector, Scrape
from gpunet_exporter.registry import Scraper
from gpunet_exporter.web.http import scrape_timeout

from support import fake_nvml
from support import sysfs_tree as st
from support.exporter import Exporter
from support.metrics import Samples, make_collector, parse, samples_of, value
from support.wait import describe, hold, wait_for

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-"
                     "text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")
COLLECTORS = ("gpu", "infiniband", "link", "pfc", "topology")
ROCE, IB = "mlx5_9", "mlx5_1"  # devices the soak unplugs
SLACK = 3.0  # seconds a scrape may take beyond its deadline (encoding, a loaded CI machine)

# The pfc collector reads the host kernel's NIC statistics (none for the tree's netdevs) and its
# QoS configuration from the MLNX_OFED sysfs files that make_ofed_qos writes; no host tools.
BASE_CONFIG = {
    "link": {"ibv_devinfo": {"enabled": False}},
    "pfc": {"config": {"sources": ["sysfs"], "interval_seconds": 1}},
}


# ---- the node: DGX H100 tree with GPUs, NVML replayed by tests/support/fake_nvml.py -----------


@dataclass
class Node:
    root: Path
    sysfs: Path
    procfs: Path
    scenario: dict[str, Any]
    config: dict[str, Any] = field(default_factory=lambda: json.loads(json.dumps(BASE_CONFIG)))

    def start(self, *flags: str) -> Drained:
        """The installed exporter on this node."""
        (self.root / "nvml.json").write_text(json.dumps(self.scenario))
        (self.root / "config.yml").write_text(json.dumps(self.config))  # JSON is YAML
        return Drained([f"--path.sysfs={self.sysfs}", f"--path.procfs={self.procfs}",
                        f"--config.file={self.root / 'config.yml'}",
                        f"--nvml.module={fake_nvml.MODULE}", "--no-hotplug", *flags],
                       env=fake_nvml.exporter_env(self.root / "nvml.json"))


class Drained(Exporter):
    """The exporter with its stderr read as it comes: a full pipe would block its logging, and
    with it a scrape."""

    def __init__(self, args: list[str], env: Mapping[str, str]) -> None:
        super().__init__(args, env)
        self.lines: list[str] = []
        stderr = self.proc.stderr
        assert stderr is not None
        self.drain = threading.Thread(target=lambda: self.lines.extend(stderr), daemon=True)
        self.drain.start()

    def stop(self) -> str:
        """SIGTERM, then SIGKILL after 10 s; the exporter's stderr."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.drain.join(timeout=5)
        return "".join(self.lines)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    """build_dgx_h100_gpus, MLNX_OFED QoS files on mlx5_9's netdev, the H200 NVML capture's two
    GPUs placed at the tree's first two GPU addresses (as tests/test_golden.py does)."""
    sysfs = st.build_dgx_h100_gpus(tmp_path)
    st.make_ofed_qos(sysfs, ROCE)
    procfs = st.build_procfs(tmp_path)
    scenario = fake_nvml.h200x2()
    for dev, bus in zip(scenario["devices"], st.DGX_GPU_BUSES, strict=False):
        dev["nvmlDeviceGetPciInfo"]["ok"]["busId"] = f"00000000:{bus:02X}:00.0"
    return Node(tmp_path, sysfs, procfs, scenario)


@dataclass
class Proc:
    rss_kb: int
    threads: int
    fds: int


def proc_stats(pid: int) -> Proc:
    """VmRSS (/proc/PID/status), threads (/proc/PID/task) and open descriptors (/proc/PID/fd)."""
    with open(f"/proc/{pid}/status") as fh:
        rss = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
    return Proc(rss, len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd")))


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (/proc/PID/stat utime and stime)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quiet_stats(pid: int, n: int = 5) -> Proc:
    """Threads and descriptors at rest: the fewest of a few samples, so that a descriptor a
    background round has open for a moment does not count."""
    got = []
    for _ in range(n):
        got.append(proc_stats(pid))
        time.sleep(0.05)
    return Proc(min(p.rss_kb for p in got), min(p.threads for p in got),
                min(p.fds for p in got))


def success(s: Samples) -> dict[str, float | None]:
    return {c: value(s, "gpunet_scrape_collector_success", collector=c) for c in COLLECTORS}


def timed_scrape(e: Exporter, deadline: float, headers: Mapping[str, str] | None = None
                 ) -> Samples:
    """One scrape that must answer within ``deadline`` + SLACK seconds (a requests timeout)."""
    r = requests.get(f"{e.url}/metrics", headers=dict(headers or {}), timeout=deadline + SLACK)
    r.raise_for_status()
    return parse(r.text)


def scrape_until(e: Exporter, want: Callable[[Samples], bool], timeout: float = 20) -> Samples:
    """Scrape ``e`` until its samples satisfy ``want``; those samples."""
    def scrape() -> Samples | None:
        s = parse(e.metrics())
        return s if want(s) else None

    return wait_for(scrape, f"a scrape that satisfies {describe(want)}", timeout=timeout,
                    interval=0.2)


def background_ready(s: Samples) -> bool:
    """The background values have arrived: the GPU counters and the QoS configuration."""
    return (any(k[0] == "gpunet_gpu_counters_refresh_success" for k in s)
            and any(k[0] == "gpunet_pfc_config_refresh_success" for k in s))


def has_label_value(s: Samples, *values: str) -> list[tuple[str, frozenset[tuple[str, str]]]]:
    wanted = set(values)
    return [k for k in s if any(v in wanted for _, v in k[1])]


# ---- 1. X-Prometheus-Scrape-Timeout-Seconds -----------------------------------------------


@pytest.mark.parametrize("header,want", [
    ("10", 9.5), ("2.5", 2.0), (" 4 ", 3.5), ("1", 0.5), ("0.2", 0.1), ("1e3", 999.5),
    (None, None), ("", None), ("abc", None), ("10s", None), ("0", None), ("-3", None),
    ("nan", None), ("inf", None), ("-inf", None), ("1e999", None),
])
def test_scrape_timeout_header_parsing(header: str | None, want: float | None) -> None:
    assert scrape_timeout(header) == want


class _Slow(Collector):
    name = "slow"

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        time.sleep(0.6)
        return iter(())


def test_scraper_timeout_argument(tmp_path: Path) -> None:
    """Scraper.collect(timeout) shortens the deadline, never lengthens it."""
    scraper = Scraper({"slow": make_collector(_Slow, tmp_path)}, timeout=5)

    def ok(families: Iterator[Metric]) -> float | None:
        return value(samples_of(list(families)), "gpunet_scrape_collector_success",
                     collector="slow")

    assert ok(scraper.collect(0.1)) == 0
    assert scraper.runners[0].status.error.endswith("(timeout 0.1s)")
    assert ok(scraper.collect(30)) == 1  # joins the collection still running, waits up to 5 s
    assert ok(scraper.collect(0.2)) == 0
    assert scraper.runners[0].status.error.endswith("(timeout 0.2s)")
    assert ok(scraper.collect()) == 1  # without one: --scrape.timeout's 5 s


def test_scrape_timeout_header(node: Node) -> None:
    """The installed exporter with --scrape.timeout=5 and a GPU collector that takes at least
    0.5 s (each GPU's utilization call blocks 0.25 s): a header of 0.6 s leaves the collectors
    0.3 s, so the gpu collector misses it; a header above the flag, or a bad one, leaves the
    flag's 5 s, so it makes it. (Every bad form is in test_scrape_timeout_header_parsing.)"""
    for dev in node.scenario["devices"]:
        dev["sleep"] = {"nvmlDeviceGetUtilizationRates": 0.25}
    e = node.start("--scrape.timeout=5")
    try:
        scrape_until(e, background_ready)

        def scrape(header: str | None) -> Samples:
            # Every scrape below starts a fresh gpu collection: the one before waited for its.
            headers = {} if header is None else {"X-Prometheus-Scrape-Timeout-Seconds": header}
            return timed_scrape(e, 5, headers)

        s = scrape("0.6")
        assert success(s) == {"gpu": 0, "infiniband": 1, "link": 1, "pfc": 1, "topology": 1}
        landing = requests.get(e.url, timeout=10).text
        assert "(timeout 0.3s)" in landing, landing
        assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_0", port="1") == 4
        assert success(scrape(None))["gpu"] == 1  # joins the late collection, which finishes
        for header in ("30", "abc", "-3", "nan", "1e999"):
            assert success(scrape(header)) == dict.fromkeys(COLLECTORS, 1), header
        s = scrape("0.6")  # honoured again after all that
        assert success(s)["gpu"] == 0
    finally:
        err = e.stop()
    assert "Traceback" not in err
    assert err.count("collector timed out after 0.3s") == 1, err  # logged once


# ---- 2. hanging sources ---------------------------------------------------------------------

# --scrape.timeout of the hanging-source tests: above the one second that the first scrape of
# pfc and gpu waits for their first background round.
HANG_TIMEOUT = 1.5

STUCK_TOOL = """\
#!/bin/sh
echo $$ >> {pids}
exec sleep 60
"""


def stuck_tool(node: Node, name: str) -> tuple[str, Path]:
    """A program that records its PID and sleeps for a minute; its path and the PID file."""
    pids = node.root / f"{name}.pids"
    pids.touch()
    path = node.root / name
    path.write_text(STUCK_TOOL.format(pids=pids))
    path.chmod(0o755)
    return str(path), pids


def alive(pids: Path) -> list[int]:
    """PIDs in the file that still run (a zombie counts as gone)."""
    out = []
    for pid in map(int, pids.read_text().split()):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def reap(pids: Path) -> None:
    """Kill what is left of a stuck tool (`sleep 60`), should a test fail before the exporter
    shut down; the exporter kills the tools still running when it exits."""
    for pid in alive(pids):
        os.kill(pid, signal.SIGKILL)


def others_arrive(s: Samples, stuck: str, pfc_config: bool = True) -> None:
    """Every collector but ``stuck`` succeeded and brought its series (for pfc, which finds no
    NIC statistics for the tree's netdevs, the ECN settings of its QoS configuration, unless
    ``pfc_config`` is False)."""
    got = success(s)
    assert {c: v for c, v in got.items() if c != stuck} == {
        c: 1 for c in COLLECTORS if c != stuck}, got
    checks = {
        "infiniband": value(s, "gpunet_infiniband_port_state_id", device="mlx5_0", port="1"),
        "link": value(s, "gpunet_link_mtu_bytes", interface="enp41s0f0np0"),
        "topology": value(s, "gpunet_topology_gpu_nearest_nic", gpu="0", device="mlx5_0",
                          path="PIX"),
        "gpu": value(s, "gpunet_gpu_pcie_link_width", gpu="1"),
        "pfc": value(s, "gpunet_pfc_ecn_cnp_dscp", interface="enp170s0f0np0"),
    }
    for collector, v in checks.items():
        if collector != stuck and (collector != "pfc" or pfc_config):
            assert v is not None, f"{collector} series missing"


def repeated_scrapes(e: Exporter, stuck: str, n: int = 3, pfc_config: bool = True
                     ) -> list[Proc]:
    """n scrapes, each within the timeout plus slack, each with ``stuck`` failing (when it is a
    collector that hangs in the scrape) and everything else there; the process's numbers at
    rest after each (the handler thread of the connection just closed may take a moment to
    end)."""
    stats = []
    for _ in range(n):
        s = timed_scrape(e, HANG_TIMEOUT)
        others_arrive(s, stuck, pfc_config)
        if stuck:
            assert success(s)[stuck] == 0
        stats.append(quiet_stats(e.proc.pid))
    return stats


def test_stuck_mlnx_qos_runs_in_the_background(node: Node) -> None:
    """mlnx_qos hangs: the QoS configuration is read in the background, so no scrape waits for it
    beyond the first scrape's wait for the first round, which ends before the scrape's deadline;
    every collector, pfc included, succeeds. After pfc.config.timeout_seconds (longer than the
    three scrapes take) the tool's process group is killed and gpunet_pfc_config_refresh_success
    turns 0, with nothing left running."""
    tool, pids = stuck_tool(node, "mlnx_qos")
    node.config["pfc"]["config"] = {"sources": ["mlnx_qos"], "mlnx_qos_path": tool,
                                    "timeout_seconds": 4, "interval_seconds": 60}
    e = node.start(f"--scrape.timeout={HANG_TIMEOUT}")
    try:
        stats = repeated_scrapes(e, stuck="", pfc_config=False)
        assert stats[-1].threads <= stats[0].threads, stats
        assert alive(pids), "mlnx_qos should be running (stuck) now"
        # Both RoCE netdevs, one after the other, each killed after 4 s.
        s = scrape_until(e, lambda s: all(
            value(s, "gpunet_pfc_config_refresh_success", interface=i) == 0
            for i in ("enp41s0f0np0", "enp170s0f0np0")), timeout=30)
        others_arrive(s, stuck="")
        assert not alive(pids), "a killed mlnx_qos left processes behind"
    finally:
        err = e.stop()
        reap(pids)
    assert "mlnx_qos timed out after 4s and was killed" in err, err


def test_stuck_ethtool_costs_only_pfc(node: Node) -> None:
    """With stats_source ethtool, `ethtool -S` runs in the scrape; when it hangs, pfc misses the
    deadline (success 0), every other collector answers, and later scrapes join the collection
    still running instead of starting more (threads do not grow)."""
    tool, pids = stuck_tool(node, "ethtool")
    node.config["pfc"]["stats_source"] = "ethtool"
    node.config["pfc"]["ethtool"] = {"path": tool, "timeout_seconds": 4}
    e = node.start(f"--scrape.timeout={HANG_TIMEOUT}")
    try:
        stats = repeated_scrapes(e, stuck="pfc")
        assert stats[-1].threads <= stats[0].threads, stats
        assert len(alive(pids)) <= 1  # one interface's tool at a time, never a pile
    finally:
        err = e.stop()
        left = alive(pids)
        reap(pids)
    assert "Traceback" not in err
    assert not left, "a tool still running outlived the exporter"


def test_max_requests_refuses_at_once(node: Node) -> None:
    """--web.max-requests=1: while one scrape is held up (a stuck `ethtool -S` until the scrape
    deadline), a second is answered 503 at once, as node_exporter does, and counted; the other
    paths are not limited; once the first is done, scrapes are served again. 0 lifts the limit."""
    tool, pids = stuck_tool(node, "ethtool")
    node.config["pfc"]["stats_source"] = "ethtool"
    node.config["pfc"]["ethtool"] = {"path": tool, "timeout_seconds": 30}
    e = node.start("--scrape.timeout=4", "--web.max-requests=1")
    first: list[requests.Response] = []
    try:
        held = threading.Thread(target=lambda: first.append(
            requests.get(f"{e.url}/metrics", timeout=30)))
        held.start()
        wait_for(lambda: pids.read_text().strip(), "the held scrape in the stuck ethtool",
                 interval=0.02)
        refused = requests.get(f"{e.url}/metrics", timeout=30)
        answered_first = held.is_alive()  # refused before the held scrape was done
        healthy = requests.get(f"{e.url}/-/healthy", timeout=30)
        held.join(timeout=30)
        after = e.metrics()
    finally:
        e.stop()
        reap(pids)
    assert refused.status_code == 503
    assert refused.text == "Limit of concurrent requests reached (1), try again later.\n"
    assert answered_first, "the refusal waited for the held scrape"
    assert healthy.status_code == 200
    assert [r.status_code for r in first] == [200]
    assert value(parse(after), "gpunet_exporter_scrapes_rejected_total") == 1


def test_blocking_nvml_call_costs_only_gpu(node: Node) -> None:
    """nvmlDeviceGetUtilizationRates blocks for 30 s on GPU 0: the gpu collector misses the
    deadline, topology (same NVML session, other calls) and the rest answer in time."""
    node.scenario["devices"][0]["sleep"] = {"nvmlDeviceGetUtilizationRates": 30}
    e = node.start(f"--scrape.timeout={HANG_TIMEOUT}")
    try:
        stats = repeated_scrapes(e, stuck="gpu")
        assert stats[-1].threads <= stats[0].threads, stats
        assert stats[-1].fds <= stats[0].fds, stats
    finally:
        err = e.stop()
    assert "collector=gpu" in err and "collector timed out" in err, err


@pytest.mark.parametrize("writer", [False, True], ids=["no-writer", "silent-writer"])
def test_fifo_in_sysfs_costs_one_value(node: Node, writer: bool) -> None:
    """FIFOs in place of a port counter (infiniband), a netdev attribute (link) and a PCI
    bridge's config space (topology), with no writer or with one that holds them open and
    writes nothing. Reads open with O_NONBLOCK (gpunet_exporter.sources.sysfs), so a FIFO blocks
    nothing: each costs its one value (gpunet_scrape_collector_unreadable_values), the collectors
    succeed, the scrape answers in time, and nothing piles up across scrapes."""
    port = node.sysfs / "class/infiniband/mlx5_0/ports/1"
    netdev = node.sysfs / "class/net/ibp24s0"
    bridge = st.make_acs_absent(node.sysfs, st.DGX_GPU_BUSES[0])  # the bridge above GPU 0
    fifos = [port / "counters/symbol_error", netdev / "mtu", bridge / "config"]
    held = []
    for path in fifos:
        path.unlink()
        os.mkfifo(path)
        if writer:  # O_RDWR opens a FIFO without waiting for a reader: a writer that is silent
            held.append(os.open(path, os.O_RDWR | os.O_NONBLOCK))
    e = node.start(f"--scrape.timeout={HANG_TIMEOUT}")
    try:
        stats = repeated_scrapes(e, stuck="")
        assert stats[-1].threads <= stats[0].threads, stats
        assert stats[-1].fds <= stats[0].fds, stats
        s = timed_scrape(e, HANG_TIMEOUT)
        others_arrive(s, stuck="")
        assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_0",
                     port="1") is None
        assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_2",
                     port="1") == 0
        assert value(s, "gpunet_link_mtu_bytes", interface="ibp24s0") is None
        assert value(s, "gpunet_link_mtu_bytes", interface="ibp64s0") == 4092
        for c in ("infiniband", "link"):
            unreadable = value(s, "gpunet_scrape_collector_unreadable_values", collector=c)
            assert unreadable is not None and unreadable >= 1, (c, unreadable)
    finally:
        err = e.stop()
        for fd in held:
            os.close(fd)
    assert "Traceback" not in err


# ---- 3. load: 50 concurrent scrapers for 30 s ----------------------------------------------

LOAD_SCRAPERS = 50
# 30 s, both cores busy throughout: 60 s until 2026-11-27, a tenth of the suite's CPU; the finer
# leak check is the soak's, below.
LOAD_SECONDS = 30.0
FULL_PARSE_EVERY = 25  # each scraper parses every 25th response fully; all are checked cheaply
# Allowed rise of the RSS maximum from the first third of the run to the last. The allocator
# takes minutes to settle under 50 threads: on 2 cores, 50 scrapers for 9 minutes (72,000
# scrapes) took RSS from 51.3 MB (first 30 s) to 55.4 MB at 3.5 minutes and no further (55.8 MB
# at 9 minutes), while tracemalloc saw no Python allocation grow; in 60 s runs the rise between
# thirds was 0.9 to 3.4 MB alone, and 6.6 MB once beside the suite's three other workers
# (2026-11-27: 55.6 MB in the first third, 62.3 MB in the last, the jump between the second and
# the third, none of it at rest in the soak of the same run); in 30 s runs 2.9 and 4.2 MB. 9 MB
# stays clear of that and still catches a leak of about 5 KB per scrape (some 3,000 scrapes in
# 30 s under that load, the last third's maximum about two thirds of the run's growth above the
# first's), or of one response per scrape (110 KB) at once; the soak, at rest and with fewer
# threads, holds growth to 5 MB over 8,000 scrapes (about 650 bytes a scrape): the finer leak
# check is that one.
LOAD_RSS_BOUND_KB = 9 * 1024
_FAILED = re.compile(rb'gpunet_scrape_collector_success\{collector="([^"]+)"\} 0')


@dataclass
class Format:
    """What a complete response looks like in one exposition format."""

    name: str
    headers: dict[str, str]
    parser: Callable[[str], Any]
    tail: bytes = b""
    series: int = 0

    def decode(self, resp: http.client.HTTPResponse, body: bytes) -> bytes:
        if resp.getheader("Content-Encoding") == "gzip":
            return gzip.decompress(body)
        return body

    def full_parse(self, body: bytes) -> Samples:
        return samples_of(list(self.parser(body.decode())))


def sample_lines(body: bytes) -> int:
    """Sample lines of an exposition: lines not starting with '#' (HELP, TYPE, EOF)."""
    return body.count(b"\n") - body.count(b"\n#") - body.startswith(b"#")


def fetch(conn: http.client.HTTPConnection, headers: Mapping[str, str]
          ) -> tuple[http.client.HTTPResponse, bytes]:
    conn.request("GET", "/metrics", headers=dict(headers))
    resp = conn.getresponse()
    return resp, resp.read()  # IncompleteRead when fewer bytes than Content-Length arrive


def check_response(fmt: Format, resp: http.client.HTTPResponse, raw: bytes,
                   full: bool) -> str:
    """What is wrong with a response ("" when nothing)."""
    if resp.status != 200:
        return f"HTTP {resp.status}"
    if resp.getheader("Content-Length") != str(len(raw)):
        return f"Content-Length {resp.getheader('Content-Length')} but {len(raw)} bytes"
    body = fmt.decode(resp, raw)
    if not body.endswith(fmt.tail):
        return f"incomplete: ends {body[-80:]!r}"
    failed = _FAILED.findall(body)
    if failed:
        return f"collectors failed: {failed}"
    if sample_lines(body) != fmt.series:
        return f"{sample_lines(body)} sample lines, expected {fmt.series}"
    if full:
        n = len(fmt.full_parse(body))
        if n != fmt.series:
            return f"{n} series parsed, expected {fmt.series}"
    return ""


class Sampler:
    """Samples the exporter's RSS, threads and descriptors every ``period`` seconds."""

    def __init__(self, pid: int, period: float = 0.25) -> None:
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, Proc]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append((time.monotonic() - self.t0, proc_stats(self.pid)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def formats(e: Exporter) -> list[Format]:
    """The text format (no Accept header, as curl) and what Prometheus asks for (OpenMetrics,
    gzip), each with the tail and series count of a reference scrape parsed in full."""
    out = [Format("text", {}, text_string_to_metric_families),
           Format("openmetrics", {"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"},
                  om_families)]
    conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=30)
    for fmt in out:
        resp, raw = fetch(conn, fmt.headers)
        body = fmt.decode(resp, raw)
        # The last family, whose value stays 0 while no scrape is refused (the process_*
        # families before it change from one scrape to the next).
        fmt.tail = body[body.rindex(b"# HELP gpunet_exporter_http_connections_refused"):]
        s = fmt.full_parse(body)
        assert success(s) == dict.fromkeys(COLLECTORS, 1)
        fmt.series = len(s)
        assert sample_lines(body) == fmt.series
    conn.close()
    assert out[0].series == out[1].series
    return out


@pytest.mark.slow
def test_load_50_concurrent_scrapers(node: Node) -> None:
    # Every scraper is to be served: the limit of concurrent scrapes (40 by default) is raised
    # to their number; test_max_requests_refuses_at_once covers what happens beyond it.
    e = node.start(f"--web.max-requests={LOAD_SCRAPERS}")
    try:
        scrape_until(e, background_ready)
        fmts = formats(e)
        errors: list[str] = []
        counts = [0] * LOAD_SCRAPERS
        latency = [0.0] * LOAD_SCRAPERS
        end = time.monotonic() + LOAD_SECONDS

        def scraper(i: int) -> None:
            fmt = fmts[i % 2]
            conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=30)
            while time.monotonic() < end:
                t = time.monotonic()
                try:
                    resp, raw = fetch(conn, fmt.headers)
                except (OSError, http.client.HTTPException) as exc:
                    errors.append(f"scraper {i}: {exc!r}")
                    conn.close()
                    continue
                latency[i] = max(latency[i], time.monotonic() - t)
                counts[i] += 1
                problem = check_response(fmt, resp, raw, counts[i] % FULL_PARSE_EVERY == 1)
                if problem:
                    errors.append(f"scraper {i} ({fmt.name}): {problem}")
            conn.close()

        sampler = Sampler(e.proc.pid)
        threads = [threading.Thread(target=scraper, args=(i,), daemon=True)
                   for i in range(LOAD_SCRAPERS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=LOAD_SECONDS + 60)
        sampler.stop()
        cpu = cpu_seconds(e.proc.pid)
        assert not any(t.is_alive() for t in threads), "a scraper hung"
    finally:
        err = e.stop()
    total = sum(counts)
    thirds = [[p.rss_kb for t, p in sampler.samples if k * LOAD_SECONDS / 3 <= t
               < (k + 1) * LOAD_SECONDS / 3] for k in range(3)]
    print(f"\nload: {total} scrapes by {LOAD_SCRAPERS} scrapers in {LOAD_SECONDS:g} s "
          f"({total / LOAD_SECONDS:.0f}/s, exporter CPU {cpu:.0f} s), {fmts[0].series} series "
          f"each, slowest round trip (client side, its GIL included) "
          f"{max(latency):.2f} s; RSS max by third {[max(x) for x in thirds]} kB; threads max "
          f"{max(p.threads for _, p in sampler.samples)}, fds max "
          f"{max(p.fds for _, p in sampler.samples)}; errors {len(errors)}")
    assert not errors, f"{len(errors)} bad responses, first ones: {errors[:10]}"
    assert min(counts) > 0
    assert max(thirds[2]) - max(thirds[0]) <= LOAD_RSS_BOUND_KB, thirds
    assert "Traceback" not in err


# ---- 4. soak: 10,000 scrapes while devices come and go --------------------------------------

# 8,000 scrapes after the warm-up: SOAK_RSS_BOUND_KB catches a leak of about 650 bytes a scrape
# (20,000 scrapes, 90 s of CPU on 2 cores, caught 300 bytes; a leak of one sample or one
# response per scrape is thousands of bytes either way).
SOAK_SCRAPES = 10_000
SOAK_CLIENTS = 8
SOAK_WARMUP = 2_000  # scrapes (and at least two churn cycles) before the baseline
SOAK_RSS_BOUND_KB = 5 * 1024
# The scrapers and the checker have at most SOAK_CLIENTS + 1 requests in flight, below this: no
# 503. The HTTP worker pool (ThreadPoolExecutor) starts a thread whenever a request arrives
# before a finished worker has marked itself idle, so on a busy machine it grows past the
# requests in flight, up to --web.max-requests + 4 threads (measured: 21 threads at rest after the
# warm-up, 24 at the end). That is bounded, not a leak; the threads at the end may exceed those
# at the start by that pool's size at most, far below one thread per churn cycle (over 50).
SOAK_MAX_REQUESTS = 12
SOAK_POOL = SOAK_MAX_REQUESTS + 4
# Unplugged before the start, to make a scrape cheaper (a third of the load test's): what the
# soak looks for (growth with the number of scrapes and of device changes, stale series) does
# not depend on how many ports stay put. mlx5_0 and mlx5_1 (InfiniBand, each beside a GPU that
# NVML sees) and mlx5_8 and mlx5_9 (RoCE) remain.
SOAK_TRIMMED = ("mlx5_2", "mlx5_3", "mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7")


@dataclass
class Function:
    """One PCI function of the tree (a NIC with its RDMA device and netdev) and the class and bus
    links into it, to unplug and plug back as the kernel does: on removal the links go first,
    then the directory; on arrival the directory comes first. Plugging copies a pristine stash,
    so the files are new inodes, as a re-plugged device's are."""

    pci: Path
    links: list[tuple[Path, str]]
    stash: Path
    names: tuple[str, ...]  # label values that belong to it: RDMA device, netdev, PCI address

    @classmethod
    def of(cls, sysfs: Path, ibdev: str, stash_root: Path) -> Function:
        pci = Path(os.path.realpath(sysfs / "class/infiniband" / ibdev / "device"))
        links = []
        for link in (*sysfs.glob("class/*/*"), *sysfs.glob("bus/pci/devices/*")):
            real = Path(os.path.realpath(link))
            if link.is_symlink() and (real == pci or pci in real.parents):
                links.append((link, os.readlink(link)))
        stash = stash_root / ibdev
        shutil.copytree(pci, stash, symlinks=True)
        netdevs = tuple(p.name for p in (pci / "net").iterdir())
        return cls(pci, links, stash, (ibdev, *netdevs, pci.name))

    def unplug(self) -> None:
        for link, _ in self.links:
            link.unlink()
        shutil.rmtree(self.pci)

    def plug(self) -> None:
        shutil.copytree(self.stash, self.pci, symlinks=True)
        for link, target in self.links:
            link.symlink_to(target)


class Gate:
    """Lets the scrapers run, or holds them between requests (their connections stay open)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._busy = 0

    def enter(self) -> None:
        with self._cond:
            while not self._open:
                self._cond.wait()
            self._busy += 1

    def leave(self) -> None:
        with self._cond:
            self._busy -= 1
            self._cond.notify_all()

    def close(self) -> None:
        """Returns once no request is in flight."""
        with self._cond:
            self._open = False
            while self._busy:
                self._cond.wait()

    def reopen(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()


def per_scrape(keys: set[tuple[str, frozenset[tuple[str, str]]]]
               ) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    """Series read during the scrape, without the pfc collector's QoS configuration, which a
    background round reads (every pfc.config.interval_seconds: 1 s here)."""
    return {k for k in keys if not k[0].startswith("gpunet_pfc_")}


@pytest.mark.slow
def test_soak_devices_come_and_go(node: Node, tmp_path: Path) -> None:
    """10,000 scrapes by SOAK_CLIENTS scrapers on kept-alive connections while the main thread
    churns the tree in cycles: mlx5_1 (InfiniBand) unplugged and plugged back, mlx5_9 (RoCE,
    with MLNX_OFED QoS files) likewise, a dangling class link added and removed, mlx5_8's netdev
    taken down and up. After each change the main thread scrapes twice and checks the second
    (the first may join a collection that began before the change: concurrent scrapes share
    one): a removed device has no series left but the inventory's missing_info naming it, a
    re-plugged one has all of them back (and is missing no more). Every
    response of every scraper is checked for completeness. Threads, descriptors and RSS are
    compared at rest (scrapers held, connections open) after the warm-up and at the end."""
    for dev in SOAK_TRIMMED:
        Function.of(node.sysfs, dev, tmp_path / "trimmed").unplug()
    for gpu in node.scenario["devices"]:
        del gpu["nvlink"]  # NVLink calls answer NotSupported
    fn = {dev: Function.of(node.sysfs, dev, tmp_path / "stash") for dev in (IB, ROCE)}
    toggled = node.sysfs / "class/net/enp41s0f0np0"  # mlx5_8's netdev
    e = node.start(f"--web.max-requests={SOAK_MAX_REQUESTS}")
    lock = threading.Lock()
    total = [0]
    errors: list[str] = []
    stop = threading.Event()
    gate = Gate()
    clients: list[threading.Thread] = []
    joined = [0]  # first scrapes after a change that still showed the state before it

    def count() -> None:
        with lock:
            total[0] += 1

    try:
        baseline = scrape_until(e, background_ready)
        fmt = formats(e)[0]  # uncompressed text: the cheapest answer to make
        base_keys = set(baseline)
        base_oper = value(baseline, "gpunet_link_operstate_id", interface=toggled.name)

        def client(i: int) -> None:
            conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=30)
            while not stop.is_set():
                gate.enter()
                try:
                    resp, raw = fetch(conn, fmt.headers)
                except (OSError, http.client.HTTPException) as exc:
                    errors.append(f"client {i}: {exc!r}")
                    conn.close()
                    continue
                finally:
                    gate.leave()
                count()
                if resp.status != 200 or not raw.endswith(fmt.tail):
                    errors.append(f"client {i}: HTTP {resp.status}, ends {raw[-80:]!r}")
                failed = _FAILED.findall(raw)
                if failed:
                    errors.append(f"client {i}: collectors failed: {failed}")
            conn.close()

        checker = http.client.HTTPConnection("127.0.0.1", e.port, timeout=30)

        def check(what: str, problem: Callable[[Samples], str]) -> None:
            for k in range(2):
                resp, raw = fetch(checker, {})
                count()
                assert resp.status == 200
                s = parse(raw.decode())
                if k == 0 and problem(s):
                    joined[0] += 1  # it joined a collection that began before the change
            bad = [c for c, v in success(s).items() if v != 1]
            msg = problem(s) or (f"collectors failed: {bad}" if bad else "")
            if msg:
                errors.append(f"after {what}: {msg}")

        def gone(f: Function) -> Callable[[Samples], str]:
            def problem(s: Samples) -> str:
                # The inventory names what it has seen and misses now: not stale, wanted.
                stale = [k for k in has_label_value(s, *f.names)
                         if k[0] != "gpunet_inventory_missing_info"]
                if stale:
                    return f"{len(stale)} stale series, e.g. {stale[:3]}"
                missing = {dict(k[1]).get("name") for k in s
                           if k[0] == "gpunet_inventory_missing_info"}
                return "" if f.names[0] in missing else f"the inventory misses no {f.names[0]}"
            return problem

        def back(s: Samples) -> str:
            keys = per_scrape(set(s))
            missing, extra = per_scrape(base_keys) - keys, keys - per_scrape(base_keys)
            if missing or extra:
                return f"missing {sorted(missing)[:3]} extra {sorted(extra)[:3]}"
            return ""

        def oper(want_down: bool) -> Callable[[Samples], str]:
            def problem(s: Samples) -> str:
                got = (value(s, "gpunet_link_operstate_id", interface=toggled.name),
                       value(s, "gpunet_link_carrier", interface=toggled.name))
                want = (None, 0) if want_down else (base_oper, 1)
                ok = got[1] == want[1] and (got[0] != base_oper if want_down
                                            else got[0] == base_oper)
                return "" if ok else f"operstate, carrier {got}, expected {want}"
            return problem

        def cycle() -> None:
            for dev in (IB, ROCE):
                fn[dev].unplug()
                check(f"unplugging {dev}", gone(fn[dev]))
                fn[dev].plug()
                check(f"plugging {dev} back", back)
            st.add_dangling_device(node.sysfs, "mlx5_10")
            check("adding a dangling mlx5_10", lambda s: back(s) or (
                "mlx5_10 has series" if has_label_value(s, "mlx5_10") else ""))
            (node.sysfs / "class/infiniband/mlx5_10").unlink()
            check("removing mlx5_10", back)
            for attr, text in (("operstate", "down\n"), ("carrier", "0\n")):
                (toggled / attr).write_text(text)
            check(f"{toggled.name} down", oper(True))
            for attr, text in (("operstate", "up\n"), ("carrier", "1\n")):
                (toggled / attr).write_text(text)
            check(f"{toggled.name} up", oper(False))

        def at_rest() -> Proc:
            gate.close()
            # The exporter's background rounds (QoS configuration every second, GPU counters)
            # say nothing outside it when they end: a descriptor one holds open must not count
            # as a leak, and quiet_stats takes the fewest of a few samples after this.
            hold(0.3, "a background round in flight ends")
            p = quiet_stats(e.proc.pid)
            gate.reopen()
            return p

        sampler = Sampler(e.proc.pid, period=1.0)
        clients += [threading.Thread(target=client, args=(i,), daemon=True)
                    for i in range(SOAK_CLIENTS)]
        for t in clients:
            t.start()
        cycles, start = 0, None
        while total[0] < SOAK_SCRAPES and len(errors) <= 50:
            cycle()
            cycles += 1
            if start is None and cycles >= 2 and total[0] >= SOAK_WARMUP:
                start = (total[0], at_rest())
        assert not errors, f"{len(errors)} problems, first ones: {errors[:10]}"
        assert start is not None
        # Background values too: the full set of series is the baseline's again.
        scrape_until(e, lambda s: set(s) == base_keys, timeout=10)
        end = (total[0], at_rest())
        cpu = cpu_seconds(e.proc.pid)
        sampler.stop()
        checker.close()
    finally:
        stop.set()
        gate.reopen()
        for t in clients:
            t.join(timeout=60)
        err = e.stop()
    peak = max(p.rss_kb for _, p in sampler.samples)
    print(f"\nsoak: {total[0]} scrapes ({len(base_keys)} series each at rest) by {SOAK_CLIENTS} "
          f"scrapers and the checker, {cycles} churn cycles ({joined[0]} of {cycles * 8} first "
          f"scrapes after a change showed the state before it), exporter CPU {cpu:.0f} s; at rest "
          f"after {start[0]} scrapes {start[1]}, after {end[0]} {end[1]}; RSS peak {peak} kB; "
          f"errors {len(errors)}")
    assert not errors, f"{len(errors)} problems, first ones: {errors[:10]}"
    assert total[0] >= SOAK_SCRAPES
    # The worker pool had at least one thread at the start and may have grown to SOAK_POOL.
    assert end[1].threads <= start[1].threads + SOAK_POOL - 1, (start, end)
    assert end[1].fds <= start[1].fds, (start, end)
    assert end[1].rss_kb - start[1].rss_kb <= SOAK_RSS_BOUND_KB, (start, end)
    assert "Traceback" not in err
