"""Fabric sweep at scale (issue 19): how long the fabric collector takes to sweep a simulated
fabric of 100+ switches and 1,000+ host ports, and what a scrape costs while the sweep's
results sit in the cache.

    python bench/fabric_refresh.py [--sizes 64x40x16,128x80x16] [--refreshes 5]
                                   [--scrapes 20] [--busy-scrapes 10]
                                   [--out bench/results/fabric_refresh.json]
    python bench/fabric_refresh.py --sizes 8x4x4 --refreshes 2 --scrapes 10 --busy-scrapes 5
                                   (a smoke run, under a minute)

A size is LEAVESxSPINESxHOSTS_PER_LEAF: tests/support/ibsim.py's fat_tree (one cable between
every leaf and spine), run by Debian's ibsim (ibsim-utils 0.10) with opensm as subnet manager,
the tools reaching it through libumad2sim.so as in the tests. ibsim's default limits (2048
nodes, 256 switches, 13312 ports) are raised with -N/-S/-P only for a fabric over them. Per
size, printed as markdown and written, with every raw number, to --out:

- bring-up: ibsim parsing the netfile and opensm's first heavy sweep (Sim.start());
- tools: each tool of the sweep run once by hand against the simulator, its wall time and the
  bytes it prints (what the collector then parses);
- sweeps: FabricCollector.refresh() called --refreshes times in this process (the collector
  built as the exporter builds it, its background thread never started): wall time of
  refresh() (the sweep plus building the samples), gpunet_fabric_sweep_duration_seconds (tools
  and parsing) and each gpunet_fabric_step_duration_seconds, median and max; the CPU seconds
  of this process (parsing, building), of the tools (RUSAGE_CHILDREN) and of ibsim (which
  answers every MAD) per sweep; what the sweep found (switches, switch ports, host-facing and
  switch-facing ports, series) and checks that it is the whole fabric, every port Active;
- scrape, in process: collect() alone, and the OpenMetrics text of its families as the exporter
  writes it (src/gpunet_exporter/web/openmetrics.py encode()), on the warm cache;
- scrape, over HTTP: a real `gpunet-exporter --collector.disable-defaults --collector.fabric`
  (config file: the simulator's environment, interval_seconds 3600, so that no sweep runs
  while it is timed) scraped as Prometheus scrapes it (bench/scrape.py's Target: one
  persistent connection, Prometheus's headers, gzip; the scrape timeout raised to 60 s, header
  and --scrape.timeout, as a fabric job would set it), after its first sweep: median, p90 and
  max, bytes, its own gpunet_scrape_collector_duration_seconds, its CPU per scrape and its
  VmRSS/VmHWM; then a second exporter sweeping back to back (interval_seconds 1), scraped
  --busy-scrapes times: what a scrape costs while a sweep runs beside it in the same process.

The simulator answers every MAD in its own process, with no wire and no switch firmware: real
fabrics add per-MAD latency (microseconds per hop, more when a switch's management CPU is busy),
which ibnetdiscover and ibqueryerrors partly hide by keeping several MADs outstanding (their -o
option). Wall-clock numbers are for docs/benchmarks.md, never for test assertions.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # support.*
sys.path.insert(0, str(REPO / "bench"))  # scrape.Target

from scrape import SCRAPE_HEADERS, Stats, Target, count_samples, self_reported  # noqa: E402

from gpunet_exporter.collector import Scrape  # noqa: E402
from gpunet_exporter.collectors.fabric import FabricCollector  # noqa: E402
from gpunet_exporter.web.openmetrics import encode  # noqa: E402

from support.ibsim import UMAD2SIM, FatTree, Sim, fat_tree, missing  # noqa: E402
from support.metrics import make_collector, samples_of, series  # noqa: E402

# ibsim 0.10's limits, as its startup log prints them (MaxNetNodes, MaxNetSwitches, MaxNetPorts).
IBSIM_NODES, IBSIM_SWITCHES, IBSIM_PORTS = 2048, 256, 13312
WARMUP = 2
# A fabric job's scrape timeout: a whole fabric's series take seconds to serve (the exporter's
# --scrape.timeout is raised to match; Prometheus sends the header, and the exporter keeps to
# the shorter of the two).
SCRAPE_TIMEOUT_S = 60
SCRAPE_HEADERS["X-Prometheus-Scrape-Timeout-Seconds"] = str(SCRAPE_TIMEOUT_S)
STEPS = ("discover", "links", "counters", "errors", "routes")
_SUCCESS = re.compile(rb"^gpunet_fabric_sweep_success 1(\.0)?$", re.M)
_FABRIC_LINE = re.compile(rb"^gpunet_fabric_", re.M)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Size:
    leaves: int
    spines: int
    hosts_per_leaf: int

    @classmethod
    def parse(cls, text: str) -> Size:
        leaves, spines, hosts = (int(x) for x in text.lower().split("x"))
        return cls(leaves, spines, hosts)

    @property
    def switches(self) -> int:
        return self.leaves + self.spines

    @property
    def hosts(self) -> int:
        return self.leaves * self.hosts_per_leaf

    def __str__(self) -> str:
        return f"{self.leaves}x{self.spines}x{self.hosts_per_leaf}"


def ibsim_args(size: Size, tree: FatTree) -> list[str]:
    """-N/-S/-P with room to spare when the fabric is over one of ibsim's default limits (its
    port count taken as every node's ports plus port 0), else none."""
    nodes = size.switches + size.hosts
    ports = size.switches * (tree.switch_ports + 1) + size.hosts * 2
    if nodes <= IBSIM_NODES and size.switches <= IBSIM_SWITCHES and ports <= IBSIM_PORTS:
        return []
    return ["-N", str(2 * nodes), "-S", str(2 * size.switches), "-P", str(2 * ports)]


def proc_cpu(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def own_memory_kb() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(rest.split()[0])
    return out


@dataclass
class Sweep:
    wall_s: float  # refresh(): tools, parsing, building the samples
    duration_s: float  # gpunet_fabric_sweep_duration_seconds
    steps_s: dict[str, float]
    cpu_self_s: float
    cpu_tools_s: float
    cpu_ibsim_s: float


@dataclass
class Result:
    size: str
    ibsim_args: list[str]
    bring_up_s: float = 0.0
    tools: dict[str, dict[str, float]] = field(default_factory=dict)
    sweeps: list[Sweep] = field(default_factory=list)
    found: dict[str, int] = field(default_factory=dict)
    bench_memory_kb: dict[str, int] = field(default_factory=dict)
    collect_ms: list[float] = field(default_factory=list)
    exposition_ms: list[float] = field(default_factory=list)
    exposition_bytes: int = 0
    http: dict[str, Any] = field(default_factory=dict)
    http_busy: dict[str, Any] = field(default_factory=dict)


def run_tools(sim: Sim, workdir: Path) -> dict[str, dict[str, float]]:
    """Each tool of a sweep once, by hand: wall time and output size."""
    cache = str(workdir / "bench.cache")
    out: dict[str, dict[str, float]] = {}
    for name, argv in (
        ("ibnetdiscover", ["ibnetdiscover", "--cache", cache]),
        ("iblinkinfo", ["iblinkinfo", "-l", "--switches-only", "--load-cache", cache]),
        ("ibqueryerrors --counters",
         ["ibqueryerrors", "--switch", "--counters", "--load-cache", cache]),
        ("dump_fts", ["dump_fts"]),
    ):
        t0 = time.perf_counter()
        text = sim.run(argv, timeout=600)
        out[name] = {"seconds": time.perf_counter() - t0, "bytes": len(text),
                     "lines": text.count("\n")}
    return out


def check_found(size: Size, samples: dict[Any, float]) -> dict[str, int]:
    """What the sweep found; refuses a partial fabric (the numbers would be of a smaller one)."""
    info = series(samples, "gpunet_fabric_port_info")
    kinds = [dict(lbl).get("remote_type", "") for lbl in info]
    states = series(samples, "gpunet_fabric_port_state_id")
    found = {
        "switches": int(samples.get(("gpunet_fabric_switches", frozenset()), 0)),
        "switch_ports": len(info),
        "host_ports": kinds.count("ca"),
        "switch_facing_ports": kinds.count("switch"),
        "active_ports": sum(1 for v in states.values() if v == 4),
        "series": len(samples),
    }
    want_links = size.hosts + 2 * size.leaves * size.spines
    if (found["switches"] != size.switches or found["host_ports"] != size.hosts
            or found["switch_facing_ports"] != 2 * size.leaves * size.spines
            or found["active_ports"] != want_links):
        raise SystemExit(f"the sweep did not find the whole {size} fabric: {found} (want "
                         f"{size.switches} switches, {size.hosts} host ports, {want_links} "
                         "active ports)")
    return found


def sweeps(sim: Sim, env: list[str], size: Size, refreshes: int, result: Result) -> None:
    c = make_collector(FabricCollector, "/sys", {"environment": env, "interval_seconds": 3600,
                                                 "timeout_seconds": 600})
    c.close()  # no background thread: refresh() runs here, and collect() reads what it left
    assert isinstance(c, FabricCollector)
    assert sim._ibsim is not None
    ibsim_pid = sim._ibsim.pid
    for i in range(refreshes):
        cpu0, kids0, sim0 = time.process_time(), children_cpu(), proc_cpu(ibsim_pid)
        t0 = time.perf_counter()
        c.refresh()
        wall = time.perf_counter() - t0
        cpu1, kids1, sim1 = time.process_time(), children_cpu(), proc_cpu(ibsim_pid)
        samples = samples_of(list(c.collect(Scrape())))
        steps = {dict(lbl)["step"]: v for lbl, v in
                 series(samples, "gpunet_fabric_step_duration_seconds").items()}
        failed = [dict(lbl)["step"] for lbl, v in
                  series(samples, "gpunet_fabric_step_success").items() if v != 1]
        if failed:
            raise SystemExit(f"sweep {i + 1}: steps failed: {failed}")
        duration = samples[("gpunet_fabric_sweep_duration_seconds", frozenset())]
        result.sweeps.append(Sweep(wall, duration, steps, cpu1 - cpu0, kids1 - kids0,
                                   sim1 - sim0))
        log(f"  sweep {i + 1}/{refreshes}: {wall:.2f} s (sweep {duration:.2f} s; "
            + ", ".join(f"{s} {steps.get(s, 0):.2f}" for s in STEPS) + ")")
    samples = samples_of(list(c.collect(Scrape())))
    result.found = check_found(size, samples)
    result.bench_memory_kb = own_memory_kb()

    for _ in range(10):
        t0 = time.perf_counter()
        families = list(c.collect(Scrape()))
        result.collect_ms.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        encoded = encode(families)  # the exporter's own encoder, as /metrics uses it
        if encoded is None:
            raise SystemExit("the exporter's encoder declined the fabric families")
        result.exposition_ms.append((time.perf_counter() - t0) * 1000)
        result.exposition_bytes = len(encoded)


class FabricTarget(Target):
    """bench/scrape.py's Target, ready once its first sweep has succeeded (which can take longer
    than Target's 30 s), over a connection that waits as long as a scrape may take."""

    def _wait_ready(self) -> None:
        self.conn.timeout = 2 * SCRAPE_TIMEOUT_S
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: "
                                   f"{Path(self.logfile.name).read_text()[-2000:]}")
            try:
                if _SUCCESS.search(self.scrape().body):
                    return
            except (OSError, http.client.HTTPException):
                self.conn.close()
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name}: no successful sweep within 600 s")
            time.sleep(0.2)


def exporter(workdir: Path, env: list[str], interval: int, name: str) -> Target:
    config = workdir / f"{name}.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "collectors": {"fabric": True},
        "fabric": {"environment": env, "interval_seconds": interval, "timeout_seconds": 600},
    }))
    return FabricTarget(name, ["gpunet-exporter", "--collector.disable-defaults",
                               "--collector.fabric", f"--config.file={config}",
                               f"--scrape.timeout={SCRAPE_TIMEOUT_S}"], workdir)


def scrape_http(target: Target, scrapes: int) -> dict[str, Any]:
    for _ in range(WARMUP):
        target.scrape()
    seconds = []
    cpu0 = target.cpu_seconds()
    last = None
    for _ in range(scrapes):
        last = target.scrape()
        seconds.append(last.seconds)
    cpu = target.cpu_seconds() - cpu0
    assert last is not None
    return {
        "stats": asdict(Stats.of(seconds)),
        "samples": count_samples(last.body),
        "fabric_lines": len(_FABRIC_LINE.findall(last.body)),
        "bytes": len(last.body),
        "wire_bytes": last.wire_bytes,
        "content_type": last.content_type,
        "self_reported_s": self_reported(last.body).get("fabric"),
        "cpu_ms_per_scrape": cpu / scrapes * 1000,
        "memory_kb": target.memory_kb(),
    }


def run_size(size: Size, args: argparse.Namespace) -> Result:
    tree = fat_tree(size.leaves, size.spines, size.hosts_per_leaf)
    extra = ibsim_args(size, tree)
    result = Result(str(size), extra)
    log(f"{size}: {size.switches} switches ({tree.switch_ports} ports each), {size.hosts} "
        f"hosts; ibsim {' '.join(extra) or '(default limits)'}")
    with tempfile.TemporaryDirectory(prefix="gpunet-fabric-bench-") as tmp:
        workdir = Path(tmp)
        # libumad2sim makes a fake sysfs, ./sys-<pid>, in the working directory of every tool it
        # is preloaded into, and leaves it when the tool is killed: keep them in here.
        cwd = os.getcwd()
        os.chdir(workdir)
        sim = Sim(workdir / "sim", tree.netfile, ibsim_args=extra)
        t0 = time.perf_counter()
        sim.start(timeout=600)
        try:
            result.bring_up_s = time.perf_counter() - t0
            log(f"  ibsim + opensm up in {result.bring_up_s:.1f} s")
            env = [f"LD_PRELOAD={UMAD2SIM}", f"IBSIM_SOCKNAME={sim.sockname}"]
            result.tools = run_tools(sim, workdir)
            sweeps(sim, env, size, args.refreshes, result)
            target = exporter(workdir, env, 3600, "idle")
            try:
                result.http = scrape_http(target, args.scrapes)
            finally:
                target.stop()
            log(f"  HTTP scrape median {result.http['stats']['median_ms']:.1f} ms")
            if args.busy_scrapes:
                target = exporter(workdir, env, 1, "busy")
                try:
                    result.http_busy = scrape_http(target, args.busy_scrapes)
                finally:
                    target.stop()
                log(f"  HTTP scrape while sweeping, median "
                    f"{result.http_busy['stats']['median_ms']:.1f} ms")
        finally:
            sim.stop()
            os.chdir(cwd)
    return result


def med_max(values: Sequence[float], fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(statistics.median(values))} / {fmt.format(max(values))}"


def report(results: Sequence[Result]) -> str:
    out = ["| | " + " | ".join(f"`{r.size}`" for r in results) + " |",
           "|---|" + "---:|" * len(results)]

    def row(label: str, cells: Sequence[str]) -> None:
        out.append(f"| {label} | " + " | ".join(cells) + " |")

    row("switches / host ports", [f"{r.found['switches']} / {r.found['host_ports']:,}"
                                  for r in results])
    row("switch ports (of them Active)", [f"{r.found['switch_ports']:,} "
                                          f"({r.found['active_ports']:,})" for r in results])
    row("ibsim options", [" ".join(r.ibsim_args) or "(defaults)" for r in results])
    row("ibsim + opensm up (s)", [f"{r.bring_up_s:.1f}" for r in results])
    row("**refresh() wall, median / max (s)**",
        [f"**{med_max([s.wall_s for s in r.sweeps])}**" for r in results])
    row("sweep_duration_seconds, median / max (s)",
        [med_max([s.duration_s for s in r.sweeps]) for r in results])
    for step in STEPS:
        row(f"step `{step}`, median / max (s)",
            [med_max([s.steps_s.get(step, 0.0) for s in r.sweeps]) for r in results])
    row("parsing (sweep - steps), median (s)",
        [f"{statistics.median(s.duration_s - sum(s.steps_s.values()) for s in r.sweeps):.2f}"
         for r in results])
    row("building samples (wall - sweep), median (s)",
        [f"{statistics.median(s.wall_s - s.duration_s for s in r.sweeps):.2f}"
         for r in results])
    row("CPU per sweep: this process / tools / ibsim (s)",
        [" / ".join(f"{statistics.median(getattr(s, k) for s in r.sweeps):.2f}"
                    for k in ("cpu_self_s", "cpu_tools_s", "cpu_ibsim_s")) for r in results])
    row("tool output: iblinkinfo / ibqueryerrors --counters / dump_fts (MB)",
        [" / ".join(f"{r.tools[t]['bytes'] / 1e6:.1f}" for t in
                    ("iblinkinfo", "ibqueryerrors --counters", "dump_fts")) for r in results])
    row("fabric series", [f"{r.found['series']:,}" for r in results])
    row("collect(), median (ms)", [f"{statistics.median(r.collect_ms):.0f}" for r in results])
    row("collect() + OpenMetrics encoding, median (ms)",
        [f"{statistics.median(map(sum, zip(r.collect_ms, r.exposition_ms, strict=True))):.0f}"
         for r in results])
    row("**HTTP scrape, cache warm: median / p90 / max (ms)**",
        [f"**{h['median_ms']:.0f}** / {h['p90_ms']:.0f} / {h['max_ms']:.0f}"
         for h in (r.http["stats"] for r in results)])
    row("exporter's own fabric collector duration (ms)",
        [f"{(r.http['self_reported_s'] or 0) * 1000:.0f}" for r in results])
    row("exporter CPU per scrape (ms)", [f"{r.http['cpu_ms_per_scrape']:.0f}" for r in results])
    row("response: samples, bytes (gzip)",
        [f"{r.http['samples']:,}, {r.http['bytes'] / 1e6:.1f} MB "
         f"({r.http['wire_bytes'] / 1e6:.2f} MB)" for r in results])
    row("exporter VmRSS / VmHWM (MB)",
        [f"{r.http['memory_kb']['VmRSS'] / 1024:.0f} / {r.http['memory_kb']['VmHWM'] / 1024:.0f}"
         for r in results])
    if all(r.http_busy for r in results):
        row("HTTP scrape while sweeping back to back: median / p90 / max (ms)",
            [f"{h['median_ms']:.0f} / {h['p90_ms']:.0f} / {h['max_ms']:.0f}"
             for h in (r.http_busy["stats"] for r in results)])
        row("exporter VmHWM, sweeping (MB)",
            [f"{r.http_busy['memory_kb']['VmHWM'] / 1024:.0f}" for r in results])
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64x40x16,128x80x16",
                   help="fat trees, LEAVESxSPINESxHOSTS_PER_LEAF, comma-separated")
    p.add_argument("--refreshes", type=int, default=5, help="sweeps per size")
    p.add_argument("--scrapes", type=int, default=20, help="timed HTTP scrapes, cache warm")
    p.add_argument("--busy-scrapes", type=int, default=10,
                   help="timed HTTP scrapes while sweeping back to back (0: skip)")
    p.add_argument("--out", type=Path, default=None, help="JSON file for every raw number")
    args = p.parse_args(argv)
    if args.out:
        args.out = args.out.resolve()  # each size runs in its own working directory
    gone = missing()
    if gone:
        raise SystemExit("needs ibsim-utils, opensm and infiniband-diags: missing "
                         + ", ".join(gone))
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True, check=False).stdout.strip()
    load = os.getloadavg()
    results = []
    for text in (s for s in args.sizes.split(",") if s):
        results.append(run_size(Size.parse(text), args))
        if args.out:  # after every size: a later one may run out of time
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"started": started, "commit": commit,
                                            "results": [asdict(r) for r in results]}, indent=1))
    print(f"Run of {started}, commit `{commit}`, {platform.node()} ({os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}), load average {load[0]:.1f} at the start, "
          f"{os.getloadavg()[0]:.1f} at the end; {args.refreshes} sweeps, {args.scrapes} "
          f"HTTP scrapes per size.\n")
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
