"""Scrape benchmark: gpunet-exporter against node_exporter on the same fixture sysfs tree.

Both exporters read a generated DGX H100-class tree (tests/support/sysfs_tree.py), and are scraped
over HTTP the way Prometheus scrapes them: one persistent HTTP/1.1 connection per target (re-opened
only when the server closes it), Prometheus's Accept / Accept-Encoding / scrape-timeout headers,
and the full body read and gunzipped inside the timed region (Prometheus's scrape duration
covers reading the decompressed body too). Scrapes alternate ours, theirs, ours, theirs... so
both see the same machine noise. Then each exporter's resident memory, and how the median scrape
time grows with the number of ports (build_scaled trees of 2..32 single-port IB devices).

    python bench/scrape.py [--scrapes 300] [--out bench/results/scrape.json]
                           [--baseline /path/to/an/older/gpunet-exporter]

With --baseline, a second gpunet-exporter (another commit's console script, or a wrapper that
runs one) is scraped in the same loop (ours, baseline, node_exporter, ours, ...), for before and
after numbers taken side by side. Besides the ratio of medians, the cost per exported value
(median ms, and CPU ms, per sample) is compared with node_exporter's, since the exporters do not
export the same number of series.

stdlib only; needs the gpunet-exporter console script and prometheus-node-exporter on PATH.
Wall-clock numbers are for docs/benchmarks.md, never for test assertions.
"""

from __future__ import annotations

import argparse
import gzip
import http.client
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any, TextIO

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # for support.sysfs_tree

from support.sysfs_tree import DGX_NICS, build_dgx_h100, build_scaled  # noqa: E402

# What Prometheus 2.x sends on every scrape with its default scrape_protocols (the Accept header
# asks for OpenMetrics first), gzip, and the scrape timeout.
SCRAPE_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    "Accept-Encoding": "gzip",
    "X-Prometheus-Scrape-Timeout-Seconds": "10",
    "User-Agent": "gpunet-bench/1 (Prometheus-like scrape)",
}
WARMUP = 10
SCALING_PORTS = (2, 4, 8, 16, 32)
SCALING_SCRAPES = 100
TARGET_RATIO = 1.5
TARGET_MEDIAN_MS = 15.0
TARGET_RSS_MB = 40.0  # decimal megabytes (10^6 bytes), as the issue states it
NODE_EXPORTER = "prometheus-node-exporter"
OURS = "gpunet-exporter"
BASELINE = "baseline"  # the name of the --baseline target

# Per-collector duration each exporter reports about itself, for the where-does-time-go split.
_SELF_DURATION = re.compile(
    rb'^(?:gpunet|node)_scrape_collector_duration_seconds\{collector="([^"]+)"\} (\S+)$', re.M
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Scrape:
    seconds: float
    body: bytes  # uncompressed
    wire_bytes: int  # as sent (gzip)
    content_type: str
    new_connection: bool


class Target:
    """One exporter process and the persistent connection Prometheus would hold to it."""

    def __init__(self, name: str, argv: list[str], logdir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.argv = [*argv, f"--web.listen-address=127.0.0.1:{self.port}"]
        self.logfile: TextIO = (logdir / f"{name}.{self.port}.log").open("w")
        self.proc = subprocess.Popen(self.argv, stdout=self.logfile, stderr=subprocess.STDOUT)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        self.connects = 0
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited {self.proc.returncode}: "
                    f"{Path(self.logfile.name).read_text()[-2000:]}"
                )
            try:
                self.scrape()
                return
            except (OSError, http.client.HTTPException):
                self.conn.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not answer /metrics within 30 s")
            time.sleep(0.05)

    def scrape(self) -> Scrape:
        new = self.conn.sock is None
        t0 = time.perf_counter()
        self.conn.request("GET", "/metrics", headers=SCRAPE_HEADERS)
        resp = self.conn.getresponse()
        raw = resp.read()
        encoding = resp.getheader("Content-Encoding", "")
        body = gzip.decompress(raw) if encoding == "gzip" else raw
        seconds = time.perf_counter() - t0
        if resp.status != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status}: {body[:200]!r}")
        if resp.will_close:
            self.conn.close()
        self.connects += new
        return Scrape(seconds, body, len(raw), resp.getheader("Content-Type", ""), new)

    def memory_kb(self) -> dict[str, int]:
        """VmRSS and VmHWM (kB) of the exporter process."""
        out = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                out[key] = int(rest.split()[0])
        return out

    def cpu_seconds(self) -> float:
        """User + system CPU time the exporter process has used so far."""
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def executable(self) -> str:
        return os.readlink(f"/proc/{self.proc.pid}/exe")

    def stop(self) -> None:
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.logfile.close()


def start_node_exporter(sysfs: Path, logdir: Path) -> Target:
    return Target(
        "node_exporter",
        [
            NODE_EXPORTER,
            "--collector.disable-defaults",
            "--collector.infiniband",
            "--collector.netclass",
            f"--path.sysfs={sysfs}",
        ],
        logdir,
    )


def start_targets(sysfs: Path, logdir: Path, baseline: str | None = None) -> list[Target]:
    """Ours, the baseline (when given) and node_exporter, all on ``sysfs``, in scrape order."""
    started: list[Target] = []
    try:
        started.append(Target(OURS, [OURS, f"--path.sysfs={sysfs}"], logdir))
        if baseline:
            started.append(Target(BASELINE, [baseline, f"--path.sysfs={sysfs}"], logdir))
        started.append(start_node_exporter(sysfs, logdir))
    except BaseException:
        for t in started:
            t.stop()
        raise
    return started


def start_pair(sysfs: Path, logdir: Path) -> tuple[Target, Target]:
    ours, theirs = start_targets(sysfs, logdir)
    return ours, theirs


def count_samples(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


def self_reported(body: bytes) -> dict[str, float]:
    return {m[1].decode(): float(m[2]) for m in _SELF_DURATION.finditer(body)}


def pct(values: Sequence[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass
class Stats:
    n: int
    median_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    min_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Stats:
        ms = [s * 1000 for s in seconds]
        return cls(
            len(ms),
            statistics.median(ms),
            pct(ms, 90),
            pct(ms, 99),
            max(ms),
            min(ms),
            statistics.fmean(ms),
        )


@dataclass
class Run:
    """Interleaved timed scrapes of both targets."""

    times: dict[str, list[float]] = field(default_factory=dict)
    self_ms: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    last: dict[str, Scrape] = field(default_factory=dict)
    new_connections: dict[str, int] = field(default_factory=dict)
    cpu_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    other_cores: float = 0.0  # CPU used by processes other than the two exporters and the bench
    steal_cores: float = 0.0  # CPU the hypervisor gave to other guests


def interleaved(targets: Sequence[Target], scrapes: int, keep_self: bool = False) -> Run:
    for _ in range(WARMUP):
        for t in targets:
            t.scrape()
    run = Run(times={t.name: [] for t in targets}, self_ms={t.name: {} for t in targets})
    bodies: dict[str, list[bytes]] = {t.name: [] for t in targets}
    connects0 = {t.name: t.connects for t in targets}
    cpu0 = {t.name: t.cpu_seconds() for t in targets}
    (busy0, steal0), self0, wall0 = machine_cpu_seconds(), time.process_time(), time.perf_counter()
    for _ in range(scrapes):
        for t in targets:
            s = t.scrape()
            run.times[t.name].append(s.seconds)
            run.last[t.name] = s
            if keep_self:
                bodies[t.name].append(s.body)
    (busy1, steal1), self1 = machine_cpu_seconds(), time.process_time()
    run.wall_s = time.perf_counter() - wall0
    for t in targets:
        run.cpu_s[t.name] = t.cpu_seconds() - cpu0[t.name]
        run.new_connections[t.name] = t.connects - connects0[t.name]
        per: dict[str, list[float]] = {}
        for body in bodies[t.name]:  # parsed after the timed loop
            for coll, sec in self_reported(body).items():
                per.setdefault(coll, []).append(sec * 1000)
        run.self_ms[t.name] = per
    other = (busy1 - busy0) - (self1 - self0) - sum(run.cpu_s.values())
    run.other_cores = max(0.0, other) / run.wall_s
    run.steal_cores = (steal1 - steal0) / run.wall_s
    return run


def tenths(values: Sequence[float]) -> list[Sequence[float]]:
    """The values in 10 consecutive slices (fewer when there are fewer than 10 values)."""
    k = max(1, len(values) // 10)
    return [values[i : i + k] for i in range(0, k * min(10, len(values)), k)]


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, steal) CPU seconds of all CPUs since boot (/proc/stat). Busy: user, nice, system,
    irq, softirq, i.e. work done in this machine; steal: time the hypervisor ran someone else."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / hz, ticks[7] / hz


def check_reads_fixture(name: str, body: bytes, host_netdevs: set[str]) -> None:
    """Fail unless the exporter reports the fixture's devices and none of the host's."""
    text = body.decode()
    want = {n.netdev for n in DGX_NICS} | {n.ibdev for n in DGX_NICS}
    missing = sorted(w for w in want if f'"{w}"' not in text)
    leaked = sorted(h for h in host_netdevs if f'device="{h}"' in text)
    if missing or leaked:
        raise SystemExit(
            f"{name} does not read the fixture tree: missing {missing}, host netdevs {leaked}"
        )


def tool_version(argv: list[str]) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    return (out.stdout or out.stderr).strip().splitlines()[0]


def emit(text: str, report: dict[str, Any], out: Path | None) -> None:
    """Print the markdown; write the raw numbers as JSON when asked to."""
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        log(f"raw numbers written to {out}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def machine() -> dict[str, Any]:
    cpu = cpu_model()
    try:
        ours = dist_version("gpunet-exporter")
    except PackageNotFoundError:
        ours = "not installed"
    mem_kb = int(Path("/proc/meminfo").read_text().split()[1])
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "cpu_model": cpu,
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)),
        "mem_total_gib": round(mem_kb / 2**20, 1),
        "kernel": platform.release(),
        "python_bench": platform.python_version(),
        "gpunet_exporter_version": ours,
        "git_commit": (git or "unknown")
        + (" + uncommitted src/ changes" if dirty else ""),
        "prometheus_client_version": dist_version("prometheus_client"),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
        "gpunet_exporter_cli": tool_version([OURS, "--version"]),
        "node_exporter_version": tool_version([NODE_EXPORTER, "--version"]),
    }


def temp_root() -> tuple[Path, str]:
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="gpunet-bench-", dir=shm)), "tmpfs (/dev/shm)"
    tmp = Path(tempfile.mkdtemp(prefix="gpunet-bench-"))
    return tmp, f"{tmp.parent} (/dev/shm not available; not memory-backed unless tmpfs)"


def main_run(root: Path, scrapes: int, baseline: str | None = None) -> dict[str, Any]:
    host_netdevs = (
        set(os.listdir("/sys/class/net")) - {"lo"} if Path("/sys/class/net").is_dir() else set()
    )
    host_netdevs -= {n.netdev for n in DGX_NICS} | {"eno1"}
    sysfs = build_dgx_h100(root / "dgx")
    targets = start_targets(sysfs, root, baseline)
    try:
        for t in targets:
            check_reads_fixture(t.name, t.scrape().body, host_netdevs)
        log(f"DGX tree: {scrapes} interleaved scrapes each after {WARMUP} warm-up ...")
        run = interleaved(targets, scrapes, keep_self=True)
        mem = {t.name: t.memory_kb() for t in targets}
        exe = {t.name: t.executable() for t in targets}
        argv = {t.name: t.argv for t in targets}
    finally:
        for t in targets:
            t.stop()
    result: dict[str, Any] = {"targets": {}}
    for name in [t.name for t in targets]:
        last = run.last[name]
        result["targets"][name] = {
            "argv": argv[name],
            "executable": exe[name],
            "stats": asdict(Stats.of(run.times[name])),
            "samples": count_samples(last.body),
            "body_bytes": len(last.body),
            "wire_bytes_gzip": last.wire_bytes,
            "content_type": last.content_type,
            "new_connections": run.new_connections[name],
            "cpu_ms_per_scrape": run.cpu_s[name] * 1000 / scrapes,
            "self_reported_collector_ms_median": {
                c: statistics.median(v) for c, v in sorted(run.self_ms[name].items())
            },
            "memory_kb": mem[name],
            "times_ms": [round(s * 1000, 4) for s in run.times[name]],
        }
    result["median_ms_per_tenth"] = {
        name: [round(statistics.median(part) * 1000, 2) for part in tenths(run.times[name])]
        for name in run.times
    }
    result["other_processes_cores"] = run.other_cores
    result["steal_cores"] = run.steal_cores
    result["wall_s"] = run.wall_s
    t = result["targets"]
    result["ratio_of_medians"] = (
        t[OURS]["stats"]["median_ms"] / t["node_exporter"]["stats"]["median_ms"]
    )
    result["per_value"] = {name: per_value(t[name], t["node_exporter"]) for name in t}
    if baseline:
        result["baseline_ratio_of_medians"] = (
            t[BASELINE]["stats"]["median_ms"] / t["node_exporter"]["stats"]["median_ms"]
        )
    return result


def per_value(target: dict[str, Any], node: dict[str, Any]) -> dict[str, float]:
    """Median scrape time and CPU time per exported sample (us), and their ratios to
    node_exporter's."""
    lat = target["stats"]["median_ms"] * 1000 / target["samples"]
    cpu = target["cpu_ms_per_scrape"] * 1000 / target["samples"]
    node_lat = node["stats"]["median_ms"] * 1000 / node["samples"]
    node_cpu = node["cpu_ms_per_scrape"] * 1000 / node["samples"]
    return {
        "latency_us": lat,
        "cpu_us": cpu,
        "latency_ratio": lat / node_lat,
        "cpu_ratio": cpu / node_cpu,
    }


def scaling_run(root: Path) -> list[dict[str, Any]]:
    rows = []
    for ports in SCALING_PORTS:
        sysfs = build_scaled(root / f"scaled-{ports}", ports)
        ours, theirs = start_pair(sysfs, root)
        try:
            log(f"scaling: {ports} ports, {SCALING_SCRAPES} interleaved scrapes ...")
            run = interleaved((ours, theirs), SCALING_SCRAPES)
            mem = {t.name: t.memory_kb() for t in (ours, theirs)}
        finally:
            ours.stop()
            theirs.stop()
        row: dict[str, Any] = {"ports": ports}
        for name in (OURS, "node_exporter"):
            row[name] = {
                "median_ms": statistics.median(run.times[name]) * 1000,
                "p90_ms": pct(run.times[name], 90) * 1000,
                "samples": count_samples(run.last[name].body),
                "memory_kb": mem[name],
            }
        row["ratio"] = row[OURS]["median_ms"] / row["node_exporter"]["median_ms"]
        row["other_processes_cores"] = run.other_cores
        row["steal_cores"] = run.steal_cores
        rows.append(row)
    return rows


def slope(rows: list[dict[str, Any]], name: str) -> tuple[float, float]:
    """Least-squares fit median_ms = intercept + slope * ports."""
    fit = statistics.linear_regression(
        [r["ports"] for r in rows], [r[name]["median_ms"] for r in rows]
    )
    return fit.slope, fit.intercept


def markdown(report: dict[str, Any]) -> str:
    m, d, rows = report["machine"], report["dgx"], report["scaling"]
    o, n = d["targets"][OURS], d["targets"]["node_exporter"]
    out = [
        f"Machine: {m['cpu_model']}, nproc {m['nproc']}, {m['mem_total_gib']} GiB, "
        f"Linux {m['kernel']}; {m['gpunet_exporter_cli']}; {m['node_exporter_version']}; "
        f"bench Python {m['python_bench']}; prometheus_client {m['prometheus_client_version']}; "
        f"commit {m['git_commit']}.",
        f"Fixture tree on {report['tree_on']}. {report['scrapes']} timed scrapes per exporter, "
        f"interleaved, after {WARMUP} warm-up scrapes each. Load average at start "
        f"{' '.join(m['loadavg_at_start'])}; CPU used by other processes during the timed run: "
        f"{d['other_processes_cores']:.2f} of {m['nproc']} cores, hypervisor steal "
        f"{d['steal_cores']:.2f} cores.",
        "",
        "| exporter | median ms | p90 ms | p99 ms | max ms | samples | body bytes | gzip bytes "
        "| CPU ms/scrape | new TCP conns | VmRSS MB | VmHWM MB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    table = [(OURS, o)]
    if BASELINE in d["targets"]:
        table.append(
            (f"{BASELINE} (`{d['targets'][BASELINE]['argv'][0]}`)", d["targets"][BASELINE])
        )
    for name, t in [*table, ("node_exporter 1.5.0", n)]:
        s, mem = t["stats"], t["memory_kb"]
        out.append(
            f"| {name} | {s['median_ms']:.2f} | {s['p90_ms']:.2f} | {s['p99_ms']:.2f} "
            f"| {s['max_ms']:.2f} | {t['samples']} | {t['body_bytes']} | {t['wire_bytes_gzip']} "
            f"| {t['cpu_ms_per_scrape']:.2f} | {t['new_connections']} "
            f"| {mem['VmRSS'] * 1024 / 1e6:.1f} | {mem['VmHWM'] * 1024 / 1e6:.1f} |"
        )
    out += [
        "",
        f"Ratio of medians (ours / node_exporter): **{d['ratio_of_medians']:.2f}**"
        + (
            f"; baseline / node_exporter: {d['baseline_ratio_of_medians']:.2f}"
            if "baseline_ratio_of_medians" in d
            else ""
        ),
        "",
        "Cost per exported value (median ms and CPU ms per scrape, divided by the samples), "
        "and its ratio to node_exporter's: "
        + "; ".join(
            f"{name} {v['latency_us']:.2f} us ({v['latency_ratio']:.2f}x), "
            f"CPU {v['cpu_us']:.2f} us ({v['cpu_ratio']:.2f}x)"
            for name, v in d["per_value"].items()
        )
        + ".",
        "",
        "Median per tenth of the run, ms (drift check): "
        + "; ".join(
            f"{name} " + " ".join(f"{v:.1f}" for v in vals)
            for name, vals in d["median_ms_per_tenth"].items()
        )
        + ".",
        "",
        f"Content-Type: ours `{o['content_type']}`; node_exporter `{n['content_type']}`.",
        "Self-reported collector time, median ms: "
        + "; ".join(
            f"{name}: "
            + ", ".join(f"{c} {v:.2f}" for c, v in t["self_reported_collector_ms_median"].items())
            for name, t in d["targets"].items()
        )
        + ".",
    ]
    if rows:
        out += scaling_table(rows)
    out += ["", "Targets:"]
    for label, ok, detail in report["targets"]:
        out.append(f"- {label}: {'MET' if ok else 'MISSED'} ({detail})")
    return "\n".join(out)


def scaling_table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        "",
        "| ports | ours median ms | node_exporter median ms | ratio | ours samples "
        "| node_exporter samples | ours VmRSS MB | node_exporter VmRSS MB "
        "| other load / steal (cores) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['ports']} | {r[OURS]['median_ms']:.2f} "
            f"| {r['node_exporter']['median_ms']:.2f} | {r['ratio']:.2f} "
            f"| {r[OURS]['samples']} | {r['node_exporter']['samples']} "
            f"| {r[OURS]['memory_kb']['VmRSS'] * 1024 / 1e6:.1f} "
            f"| {r['node_exporter']['memory_kb']['VmRSS'] * 1024 / 1e6:.1f} "
            f"| {r['other_processes_cores']:.2f} / {r['steal_cores']:.2f} |"
        )
    so, io = slope(rows, OURS)
    sn, inn = slope(rows, "node_exporter")
    out += [
        "",
        f"Linear fit, median ms = a + b x ports: ours a={io:.2f} b={so:.3f}; "
        f"node_exporter a={inn:.2f} b={sn:.3f}.",
    ]
    return out


def judge(d: dict[str, Any]) -> list[tuple[str, bool, str]]:
    o = d["targets"][OURS]
    med = o["stats"]["median_ms"]
    ratio = d["ratio_of_medians"]
    limit = TARGET_RATIO * d["targets"]["node_exporter"]["stats"]["median_ms"]
    rss = o["memory_kb"]["VmRSS"] * 1024 / 1e6
    hwm = o["memory_kb"]["VmHWM"] * 1024 / 1e6
    return [
        (
            f"median <= {TARGET_RATIO}x node_exporter's",
            ratio <= TARGET_RATIO,
            f"{ratio:.2f}x; limit {limit:.2f} ms, ours {med:.2f} ms",
        ),
        (f"median < {TARGET_MEDIAN_MS:g} ms", med < TARGET_MEDIAN_MS, f"{med:.2f} ms"),
        (
            f"resident memory < {TARGET_RSS_MB:g} MB",
            rss < TARGET_RSS_MB,
            f"VmRSS {rss:.1f} MB, VmHWM {hwm:.1f} MB",
        ),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--scrapes", type=int, default=300, help="timed scrapes per exporter")
    p.add_argument("--out", type=Path, help="write the raw numbers as JSON here")
    p.add_argument("--no-scaling", action="store_true", help="skip the 2..32 port scaling run")
    p.add_argument(
        "--baseline",
        help="another gpunet-exporter executable (an older commit's) scraped in the same loop",
    )
    args = p.parse_args(argv)
    if args.scrapes < 2:
        p.error("--scrapes must be at least 2")
    for exe in (OURS, NODE_EXPORTER):
        if shutil.which(exe) is None:
            p.error(f"{exe} not found on PATH")

    root, tree_on = temp_root()
    log(f"fixture trees under {root} ({tree_on})")
    try:
        report: dict[str, Any] = {
            "machine": machine(),
            "tree_on": tree_on,
            "scrapes": args.scrapes,
            "warmup": WARMUP,
            "headers": SCRAPE_HEADERS,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        report["dgx"] = main_run(root, args.scrapes, args.baseline)
        report["scaling"] = [] if args.no_scaling else scaling_run(root)
        report["targets"] = judge(report["dgx"])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    emit(markdown(report), report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
