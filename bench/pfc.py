"""Per-scrape cost of the pfc collector, next to running ``ethtool -S`` as a subprocess.

The issue's target: for 2 RoCE interfaces with 8 priorities, the collector's per-scrape cost
under 3 ms median, compared in the same run with ``ethtool -S`` run as a subprocess per
interface (what the Python ethtool exporters do).

There is no mlx5 NIC on the benchmark machine, so the stand-in is:

- **Real ioctl on a real driver.** The script (as root) creates its own network namespace
  ``gpunet-bench-pfc-<pid>`` holding two veth pairs va0/vb0 and va1/vb1 with 128 TX and 128 RX
  queues each (veth prints per-queue XDP counters: about 1,150 statistics per interface, the
  order of a ConnectX-7 with many channels), and re-executes itself inside it
  (``ip netns exec``, which also mounts the namespace's own /sys). The namespace is deleted at
  the end, on error and on Ctrl-C too.
- **mlx5 names on top.** The collector gets the real ``EthtoolReader``, wrapped so each reading
  is the veth's own names and values followed by those of the synthetic mlx5 capture
  (``tests/fixtures/synthetic/ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt``: 8 priorities,
  PFC on priority 3, port counters). The ioctl cost is real; mapping and sample building are
  those of an mlx5 port. The wrapper returns the same names tuple while the veth's names do not
  change, as the real reader does, so the collector's mapping plan stays cached.

Timed per scrape (``time.perf_counter``), after warm-up, interleaved in one loop (the order
rotates each round) so all see the same machine noise:

- ours, collect: ``list(collector.collect(Scrape()))`` over va0 and va1;
- ours, collect + exposition: ``generate_latest`` (text format 0.0.4) of a registry whose one
  collector returns that collect;
- ioctl only: ``EthtoolReader.read`` of both interfaces (a reader of its own);
- ``ethtool -S`` x2: ``subprocess.run([ethtool, "-S", IF])`` for both interfaces, each parsed
  with ``parse_stats_text``.

The QoS configuration thread finds no source here (sources: sysfs, and veth has no qos/), so
the configuration series (served from the background cache) are not in the measured scrapes.

    sudo .venv/bin/python bench/pfc.py [--scrapes 500] [--out bench/results/pfc.json]

stdlib plus the repository's modules. Wall-clock numbers are for docs/benchmarks.md, never for
test assertions.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
from prometheus_client.core import Metric  # noqa: E402
from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402
from scrape import cpu_model, emit  # noqa: E402  (bench/scrape.py, next to this script)

from gpunet_exporter.collector import Scrape, build_collector  # noqa: E402
from gpunet_exporter.collectors.pfc import PfcCollector  # noqa: E402
from gpunet_exporter.sources.ethtool import EthtoolReader, NicStats, parse_stats_text  # noqa: E402

MLX5_CAPTURE = REPO / "tests/fixtures/synthetic/ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt"
INTERFACES = ("va0", "va1")
PEERS = ("vb0", "vb1")
QUEUES = 128
WARMUP = 20
TARGET_MS = 3.0
ETHTOOL_TIMEOUT = 5.0
OURS = "ours, collect"
OURS_EXPO = "ours, collect + exposition"
IOCTL = "ioctl only (EthtoolReader.read x2)"
PEER = "ethtool -S subprocess x2"
STEPS = (OURS, OURS_EXPO, IOCTL, PEER)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- outside: the namespace and its veths ---------------------------------------------------


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, timeout=30)


def make_namespace(ns: str, queues: int) -> None:
    ip("netns", "add", ns)
    q = ("numtxqueues", str(queues), "numrxqueues", str(queues))
    for a, b in zip(INTERFACES, PEERS, strict=True):
        ip("-n", ns, "link", "add", a, *q, "type", "veth", "peer", "name", b, *q)
    for dev in ("lo", *INTERFACES, *PEERS):
        ip("-n", ns, "link", "set", dev, "up")


def outside(args: argparse.Namespace) -> int:
    """Create the namespace, run the measurement inside it, always delete it."""
    if os.geteuid() != 0:
        raise SystemExit("must run as root (it creates a network namespace and veths)")
    for tool in ("ip", "ethtool"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found on PATH")
    # SIGTERM unwinds like Ctrl-C does, so the finally below deletes the namespace.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    ns = f"gpunet-bench-pfc-{os.getpid()}"
    argv = [sys.executable, str(Path(__file__).resolve()), "--inside", "--ns", ns,
            "--scrapes", str(args.scrapes), "--queues", str(args.queues)]
    if args.out:
        argv += ["--out", str(args.out.resolve())]
    try:
        log(f"network namespace {ns}: veth pairs {INTERFACES} / {PEERS}, {args.queues} queues")
        make_namespace(ns, args.queues)
        return subprocess.run(["ip", "netns", "exec", ns, *argv], check=False).returncode
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"setting up {ns} failed: {' '.join(exc.cmd)}") from None
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, timeout=30)
        log(f"network namespace {ns} deleted")


# ---- inside: what is measured ---------------------------------------------------------------


class WithMlx5:
    """The real reader's reading of a veth, followed by the names and values of an mlx5 capture.

    Returns the same names tuple as long as the veth's names tuple is the same object, as the
    real reader does for unchanged names (the collector caches its mapping plan on it)."""

    def __init__(self, inner: EthtoolReader, extra: NicStats) -> None:
        self.inner, self.extra = inner, extra
        self.joins = 0  # times the names were concatenated anew
        self._names: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}

    def read(self, ifname: str) -> NicStats:
        stats = self.inner.read(ifname)
        cached = self._names.get(ifname)
        if cached is None or cached[0] is not stats.names:
            cached = self._names[ifname] = (stats.names, stats.names + self.extra.names)
            self.joins += 1
        return NicStats(cached[1], [*stats.values, *self.extra.values])

    def forget(self, keep: set[str]) -> None:
        self.inner.forget(keep)

    def close(self) -> None:
        self.inner.close()


class _Families:
    """A registry's only collector: one collect of the pfc collector per exposition."""

    def __init__(self, collector: PfcCollector) -> None:
        self.collector = collector

    def collect(self) -> list[Metric]:
        return list(self.collector.collect(Scrape()))


def make_pfc(reader: WithMlx5) -> PfcCollector:
    """As the service builds one (build_collector), with the reader injected."""
    config = {"interfaces": list(INTERFACES), "config": {"sources": ["sysfs"]}}
    collector = build_collector(PfcCollector, config)
    collector.reader.close()
    collector.reader = reader
    return collector


def run_ethtool(ethtool: str, ifname: str) -> NicStats:
    out = subprocess.run([ethtool, "-S", ifname], capture_output=True, text=True, check=True,
                         timeout=ETHTOOL_TIMEOUT)
    return parse_stats_text(out.stdout)


def pct(values: Sequence[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def summary(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"median_ms": statistics.median(ms), "p90_ms": pct(ms, 90), "p99_ms": pct(ms, 99),
            "max_ms": max(ms), "min_ms": min(ms), "mean_ms": statistics.fmean(ms)}


def cpu_seconds() -> tuple[float, float, float]:
    """(busy, steal) CPU seconds of the machine (/proc/stat), and this process's CPU seconds
    with its waited-for children (the ethtool runs)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return (ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6]) / hz, ticks[7] / hz, own


def check_same_stats(reader: EthtoolReader, ethtool: str) -> dict[str, int]:
    """The ioctl and ``ethtool -S`` must agree on the names; returns the count per interface."""
    counts = {}
    for ifname in INTERFACES:
        ours, theirs = reader.read(ifname).names, run_ethtool(ethtool, ifname).names
        if ours != theirs:
            raise SystemExit(f"{ifname}: ioctl and ethtool -S disagree on the statistics names")
        counts[ifname] = len(ours)
    return counts


def measure(scrapes: int, ethtool: str) -> dict[str, Any]:
    mlx5 = parse_stats_text(MLX5_CAPTURE.read_text())
    wrapped = WithMlx5(EthtoolReader(), mlx5)
    pfc = make_pfc(wrapped)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(pfc))
    ioctl_reader = EthtoolReader()
    steps: dict[str, Callable[[], object]] = {
        OURS: lambda: list(pfc.collect(Scrape())),
        OURS_EXPO: lambda: generate_latest(registry),
        IOCTL: lambda: [ioctl_reader.read(i) for i in INTERFACES],
        PEER: lambda: [run_ethtool(ethtool, i) for i in INTERFACES],
    }
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    try:
        veth_stats = check_same_stats(ioctl_reader, ethtool)
        for i in range(WARMUP):
            for step in STEPS[i % 4:] + STEPS[:i % 4]:
                steps[step]()
        joins0 = wrapped.joins
        busy0, steal0, own0 = cpu_seconds()
        wall0 = time.perf_counter()
        for i in range(scrapes):
            for step in STEPS[i % 4:] + STEPS[:i % 4]:
                fn = steps[step]
                t0 = time.perf_counter()
                fn()
                times[step].append(time.perf_counter() - t0)
        wall = time.perf_counter() - wall0
        busy1, steal1, own1 = cpu_seconds()
        families = list(pfc.collect(Scrape()))
        body = generate_latest(registry)
        rejoined = wrapped.joins - joins0
    finally:
        pfc.close()
        ioctl_reader.close()
    return {
        "stats": {s: summary(times[s]) for s in STEPS},
        "ratio_of_medians": statistics.median(times[PEER]) / statistics.median(times[OURS]),
        "stats_per_interface": {"veth": veth_stats, "mlx5_appended": len(mlx5.names),
                                "collector_sees": {i: veth_stats[i] + len(mlx5.names)
                                                   for i in INTERFACES}},
        "samples_per_scrape": sum(len(f.samples) for f in families),
        "families_per_scrape": len(families),
        "exposition_bytes": len(body),
        "names_rejoined_during_timed_run": rejoined,
        "other_processes_cores": max(0.0, (busy1 - busy0) - (own1 - own0)) / wall,
        "steal_cores": (steal1 - steal0) / wall,
        "wall_s": wall,
        "times_ms": {s: [round(t * 1000, 4) for t in times[s]] for s in STEPS},
    }


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                          check=False).stdout.strip()


def machine() -> dict[str, Any]:
    cpu = cpu_model()
    dirty = git("status", "--porcelain", "--", "src")
    ethtool = subprocess.run(["ethtool", "--version"], capture_output=True, text=True,
                             check=False).stdout.strip()
    return {
        "cpu_model": cpu,
        "nproc": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "prometheus_client": dist_version("prometheus_client"),
        "ethtool": ethtool,
        "git_commit": (git("rev-parse", "--short", "HEAD") or "unknown")
        + (" + uncommitted src/ changes" if dirty else ""),
        "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
    }


def markdown(report: dict[str, Any]) -> str:
    m, r = report["machine"], report["run"]
    per = r["stats_per_interface"]
    med = r["stats"][OURS]["median_ms"]
    out = [
        f"{report['started']}, commit {m['git_commit']}. Machine: {m['cpu_model']}, nproc "
        f"{m['nproc']}, Linux {m['kernel']}; Python {m['python']}; prometheus_client "
        f"{m['prometheus_client']}; {m['ethtool']}.",
        f"Stand-in: veth with {report['queues']} queues, {per['veth']['va0']} / "
        f"{per['veth']['va1']} statistics (va0 / va1) through the real ioctl, plus "
        f"{per['mlx5_appended']} mlx5 names of the synthetic capture: the collector sees "
        f"{per['collector_sees']['va0']} per interface. {report['scrapes']} timed scrapes after "
        f"{WARMUP} warm-up, interleaved. Load average at start {' '.join(m['loadavg_at_start'])};"
        f" other processes {r['other_processes_cores']:.2f} cores, steal "
        f"{r['steal_cores']:.2f} cores during the timed run.",
        "",
        "| per scrape (va0 + va1) | median ms | p90 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|",
    ]
    for step in STEPS:
        s = r["stats"][step]
        out.append(f"| {step} | {s['median_ms']:.3f} | {s['p90_ms']:.3f} | {s['p99_ms']:.3f} "
                   f"| {s['max_ms']:.3f} |")
    out += [
        "",
        f"Ratio of medians, ethtool -S subprocess / ours collect: **{r['ratio_of_medians']:.1f}**."
        f" Samples per scrape: {r['samples_per_scrape']} in {r['families_per_scrape']} families"
        f" ({r['exposition_bytes']} bytes of text exposition). Names re-joined by the wrapper"
        f" during the timed run: {r['names_rejoined_during_timed_run']} (0: plan stayed cached).",
        "",
        f"Target, median collect under {TARGET_MS:g} ms: **{'MET' if med < TARGET_MS else 'MISSED'}"
        f"** ({med:.3f} ms; with exposition {r['stats'][OURS_EXPO]['median_ms']:.3f} ms).",
    ]
    return "\n".join(out)


def inside(args: argparse.Namespace) -> int:
    missing = [i for i in INTERFACES if not Path(f"/sys/class/net/{i}").exists()]
    if missing:
        raise SystemExit(f"no {', '.join(missing)} here: run without --inside (it makes them)")
    ethtool = shutil.which("ethtool")
    if ethtool is None:
        raise SystemExit("ethtool not found on PATH")
    report: dict[str, Any] = {
        "machine": machine(),
        "namespace": args.ns,
        "queues": args.queues,
        "scrapes": args.scrapes,
        "warmup": WARMUP,
        "mlx5_capture": str(MLX5_CAPTURE),
        "started": time.strftime("%Y-%m-%d %H:%M %Z"),
    }
    log(f"{args.scrapes} interleaved rounds after {WARMUP} warm-up ...")
    report["run"] = measure(args.scrapes, ethtool)
    report["target_met"] = report["run"]["stats"][OURS]["median_ms"] < TARGET_MS
    emit(markdown(report), report, args.out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--scrapes", type=int, default=500, help="timed scrapes of each kind")
    p.add_argument("--queues", type=int, default=QUEUES, help="TX and RX queues per veth")
    p.add_argument("--out", type=Path, help="write the raw numbers as JSON here")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ns", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.scrapes < 2:
        p.error("--scrapes must be at least 2")
    try:
        return inside(args) if args.inside else outside(args)
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
