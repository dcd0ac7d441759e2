"""Checks that need real NVIDIA GPUs, run on the device machine (docs/gpu.md has the results).

    python3 bench/device_checks.py gpu [--scrapes 300] [--out DIR]
    python3 bench/device_checks.py probe [--rounds 3] [--sizes 1MiB,64MiB,256MiB] [--out DIR]
                                                                      (any number of GPUs)
    python3 bench/device_checks.py fleet [--nodes 4] [--out DIR]      (one GPU is enough)
    python3 bench/device_checks.py fleet-yield [--job-seconds 20] [--out DIR]
    python3 bench/device_checks.py job [--job-seconds 60] [--beside-seconds 60] [--out DIR]
                                                     (every GPU of the machine, 1 or more)
    python3 bench/device_checks.py renew [--rounds 3] [--out DIR]      (one GPU is enough)
    python3 bench/device_checks.py fabric [--monitor-seconds 40] [--nccl-lib DIR] [--out DIR]

gpu: installs this checkout into a temporary directory, starts the exporter with the gpu and
topology collectors on the machine's real /sys and NVML, puts load on GPU 0 with PyTorch (so
utilization, compute processes and PCIe counters move), scrapes /metrics and checks every GPU
value that nvidia-smi also shows against nvidia-smi's answer. Then it times the gpu collector's
per-scrape collection in-process (real NVML, per GPU), the background counter round, the NVML
calls that decide what runs per scrape, and, side by side in the same loop, a peer:
``nvidia-smi --query-gpu`` run as a subprocess the way nvidia-smi-based exporters do on every
scrape. Exit status 1 when a check fails.

probe: (1) the exporter with the probe collector at its defaults (a round every 4 s): the net
scope on every GPU (two ranks on the GPU of a one-GPU machine) with their own NCCL_HOSTID, and
with no HCA NCCL must fall back to sockets, which the probe reports; the intra scope with two
GPUs or more; scrapes are timed during and between rounds. (2) the straggler: rank 1 made 50 ms
late through the runner's test hook must be named, and nobody in a fair round. (3) cluster mode
across two simulated nodes (two torchrun invocations, one rank each, NCCL_HOSTID per node),
exported as scope="inter", the late rank's node naming it. (4) bench/probe_bench.py, two ranks
with their own host IDs (net scope): the probe's bus bandwidth per --sizes against a tight loop
of 20 all-reduces timed like nccl-tests in the same processes, memory at each stage, the cost
of a round. (5) with two GPUs or more, the same with one rank per GPU (the intra scope); with
one GPU it is skipped, and the summary says so. (6) the node's launcher (`gpunet-probe run`,
both scopes, --sizes) over a few rounds: between rounds, each probe process's GPU memory as
nvidia-smi shows it and its resident host memory, and the launcher's own. The summary (printed
last, and in probe_check.json) has the ratios per size and the memory per scope.

fleet: `gpunet-probe fleet` with NCCL across simulated nodes that share the GPU (srun's
environment, one NCCL_HOSTID per node, which each node's persistent pair worker inherits): a
ring over --nodes nodes, then a repair pass that must merge into the files; every node's
pairs.json must hold its ring peers, measured, with the transport NCCL reported (Socket
without an HCA), and one node's exporter must serve them. Then `ring --hops 2` over 4 simulated
nodes (three rounds, three pairs per node): its pairs measured over Socket too (the transport
read from a worker's NCCL log kept across pairs), one pair worker started per node for the
whole pass, and the pair round's time under 3 s (median over the rounds; issue 35). Each pass's
round times (first pair end's start to last pair end's end, from the pair ends' probe.log
lines), the time its groups took to come up, and its worker starts are printed and kept.

job (issue 31): that the probe never gets in a training job's way, on every GPU of the machine,
with bench/standin_job.py as the job (one rank per GPU, NCCL; each step bf16 matmuls and a
256 MiB all-reduce, about 10 ms on an H100) and the exporter with the gpu and probe collectors
(probe.interval_seconds 10, probe.holdoff_seconds 15). Every 0.1 s NVML's compute processes
are sorted into the probe's (the exporter's process tree, or a session one of its processes
leads: the runner and its workers) and the job's; the exporter is scraped alongside.
(1) the job alone, twice (before and after (2), for the noise): step time median and p99;
(2) the probe first: a complete round of every scope (intra with two GPUs or more, net), the
probe's GPU memory per GPU and the host memory of the exporter's tree; then the job: how long
until the probe holds nothing on any GPU, then at every poll no probe process and 0 MiB, state
`yielded`, no failures_total increase of crash/init_error/timeout/nccl_error, the yields counter
up; the job's step median and p99 within 1 % of alone (or the alone runs' own spread, if
larger); after the job, `holdoff` then `measuring` and the next complete round within hold-off
+ the probe's start and round (as the first round measured) + slack;
(3) the job first, holding all but 300 MiB of each GPU, then the exporter for 60 s beside it:
the probe never on a GPU, failures_total all 0, state `yielded`, the runner not running; the job
stopped (SIGTERM), the next complete round as in (2). Versions (torch, NCCL, driver, GPUs) go
into the summary. About 7 minutes with the defaults on 4 GPUs; every process it starts is
killed at the end, failure or not.

renew (issue 33): a round whose NCCL fell back ends its group, and the next round starts it
anew. The launcher's net scope (two ranks, their own host IDs) over --rounds rounds, with
--path.sysfs a copy of examples/dgx-h100/sys, whose RDMA ports are ACTIVE: NCCL, with no HCA
here, takes sockets, which beside an ACTIVE port is a fallback. Every round must write a
successful result with Socket among its NET transports and end its group ("starts anew"), and
the launcher exit 0. Then the copy's ports are set DOWN (the cause gone, as far as the probe
can tell): the same run must measure every round with one group, renewing none.

fabric (issue 34): per GPU, every version of NVML's fabric call (state, status, clique, cluster
UUID, health mask and summary where the driver has them), per NVLink link its state, version,
remote end and the speed and state field values, nvidia-smi's topology, NVLink status and
FABRIC section, and whether nvidia-fabricmanager runs; then NCCL RAS's MONITOR stream (NCCL
2.29.2 and later): a two-rank job on GPU 0 with its own RAS port, a text and a JSON monitoring
client (every event group), rank 1 killed, and every chunk each client receives for
--monitor-seconds. On an older NCCL the record holds what RAS answered to MONITOR; --nccl-lib
runs the job on another libnccl.so.2. Versions (driver, NVML, nvidia-ml-py, torch, NCCL) go
into the summary.

Needs: python3 with nvidia-ml-py, prometheus_client, PyYAML and (for the load and the probe)
torch, which the device image has. Every environment this script starts has NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NO_MULTICAST): NVLink multicast
stays off on the shared machines.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import http.client
import io
import json
import os
import pstats
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, also when loaded by path
from standin_job import summary  # beside this script: the job's step statistics

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}
# What a probe rank held between rounds before PyTorch's cache was released (issue 31: four
# H100s with NVLink, default sizes), for the summary's comparison.
BEFORE_MIB = {"intra": 1524, "net": 1084}
PROBE_SIZES = "1MiB,64MiB,256MiB"

LOAD = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
dev = torch.empty_like(host, device="cuda:0")
end = time.time() + float(sys.argv[1])
print("load running", flush=True)
while time.time() < end:
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    dev.copy_(host, non_blocking=True)  # PCIe traffic for the byte counters
    torch.cuda.synchronize()
"""


def sh(*argv: str, timeout: float = 60) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True,
                          timeout=timeout).stdout


def install(tmp: Path) -> Path:
    """This checkout installed (with its entry points) into tmp/site, nothing fetched."""
    site = tmp / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(site), str(REPO)], check=True,
                   capture_output=True)
    return site


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def pick(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def smi_gpus() -> list[dict[str, str]]:
    fields = ("index,uuid,name,pci.bus_id,driver_version,memory.total,memory.used,"
              "pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
              "pcie.link.width.max,utilization.gpu")
    out = sh("nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits")
    keys = fields.split(",")
    return [dict(zip(keys, (v.strip() for v in line.split(",")), strict=True))
            for line in out.strip().splitlines()]


def smi_apps() -> dict[str, int]:
    out = sh("nvidia-smi", "--query-compute-apps=gpu_uuid,pid", "--format=csv,noheader")
    counts: dict[str, int] = {}
    for line in out.strip().splitlines():
        if "," in line:
            uuid = line.split(",")[0].strip()
            counts[uuid] = counts.get(uuid, 0) + 1
    return counts


_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": MIB, "mib": MIB, "g": 1 << 30,
          "gib": 1 << 30}


def size_list(text: str) -> list[int]:
    """Bytes of a comma-separated list of sizes as the runner's --sizes takes them (8KiB, 1MiB,
    65536); ValueError for anything else."""
    out = []
    for part in text.split(","):
        t = part.strip().lower()
        digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
        if not digits.isdigit() or t[len(digits):] not in _UNITS:
            raise ValueError(f"not a size: {part!r}")
        out.append(int(digits) * _UNITS[t[len(digits):]])
    return out


def sizes_arg(text: str) -> str:
    """--sizes as given, once it reads as sizes (argparse names the type in its error)."""
    size_list(text)
    return text


sizes_arg.__name__ = "sizes"


def parse_app_memory(text: str) -> dict[int, int]:
    """{pid: MiB} from ``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,
    nounits``: a process on several GPUs summed; lines without two numbers ([N/A],
    [Insufficient Permissions]) left out."""
    out: dict[int, int] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(parts[1])
    return out


def smi_app_memory() -> dict[int, int]:
    return parse_app_memory(sh("nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"))


def smi_nvlink(index: int) -> tuple[int, dict[tuple[str, str], int], dict[str, float]]:
    """(active links, {(link, kind): errors}, {link: GB/s}) from nvidia-smi nvlink -s / -e
    (``Link 0: 26.562 GB/s`` per active link)."""
    status = sh("nvidia-smi", "nvlink", "-s", "-i", str(index))
    active = sum(1 for line in status.splitlines()
                 if line.strip().startswith("Link ") and "inactive" not in line.lower())
    speeds: dict[str, float] = {}
    for line in status.splitlines():
        head, _, tail = line.strip().partition(":")
        if head.startswith("Link ") and tail.strip().endswith("GB/s"):
            speeds[head.split()[1]] = float(tail.split()[0])
    errors: dict[tuple[str, str], int] = {}
    kinds = {"Replay Errors": "replay", "Recovery Errors": "recovery", "CRC Errors": "crc_flit"}
    for line in sh("nvidia-smi", "nvlink", "-e", "-i", str(index)).splitlines():
        parts = [p.strip() for p in line.strip().split(":")]
        if len(parts) == 3 and parts[0].startswith("Link ") and parts[1] in kinds:
            errors[(parts[0].split()[1], kinds[parts[1]])] = int(parts[2])
    return active, errors, speeds


class Checks:
    """Check rows: what, the value found, the value wanted (named ``names``), and whether it
    passed."""

    def __init__(self, names: tuple[str, str] = ("exporter", "nvidia-smi")) -> None:
        self.rows: list[dict[str, Any]] = []
        self.names = names

    def eq(self, what: str, ours: Any, theirs: Any, ok: bool | None = None) -> None:
        good = (ours == theirs) if ok is None else ok
        a, b = self.names
        self.rows.append({"check": what, a: ours, b: theirs, "ok": good})
        print(f"  {'ok  ' if good else 'FAIL'} {what}: {a}={ours} {b}={theirs}", flush=True)

    @property
    def failed(self) -> int:
        return sum(not r["ok"] for r in self.rows)


def check_against_smi(url: str, checks: Checks) -> dict[str, Any]:
    s = scrape(url)
    gpus = smi_gpus()
    apps = smi_apps()
    print(f"\n== exported GPU metrics vs nvidia-smi ({len(gpus)} GPUs)")
    for row in gpus:
        g = row["index"]
        info = [dict(lbl) for (n, lbl) in s if n == "gpunet_gpu_info" and dict(lbl)["gpu"] == g]
        checks.eq(f"gpu {g} info present", len(info), 1)
        if not info:
            continue
        lbl = info[0]
        checks.eq(f"gpu {g} uuid", lbl["uuid"], row["uuid"])
        checks.eq(f"gpu {g} name", lbl["name"], row["name"])
        checks.eq(f"gpu {g} pci_address", lbl["pci_address"], row["pci.bus_id"][-12:].lower())
        checks.eq(f"gpu {g} driver_version", lbl["driver_version"], row["driver_version"])
        total = pick(s, "gpunet_gpu_memory_total_bytes", gpu=g)
        checks.eq(f"gpu {g} memory total MiB", int((total or 0) // MIB), int(row["memory.total"]))
        used = pick(s, "gpunet_gpu_memory_used_bytes", gpu=g)
        used_mib = int((used or 0) // MIB)
        checks.eq(f"gpu {g} memory used MiB (within 64 MiB: sampled apart)", used_mib,
                  int(row["memory.used"]), abs(used_mib - int(row["memory.used"])) <= 64)
        for metric, col in (("gpunet_gpu_pcie_link_generation", "pcie.link.gen.current"),
                            ("gpunet_gpu_pcie_link_max_generation", "pcie.link.gen.max"),
                            ("gpunet_gpu_pcie_link_width", "pcie.link.width.current"),
                            ("gpunet_gpu_pcie_link_max_width", "pcie.link.width.max")):
            v = pick(s, metric, gpu=g)
            checks.eq(f"gpu {g} {metric}", None if v is None else int(v), int(row[col]))
        procs = pick(s, "gpunet_gpu_compute_processes", gpu=g)
        checks.eq(f"gpu {g} compute processes", None if procs is None else int(procs),
                  apps.get(row["uuid"], 0))
        util = pick(s, "gpunet_gpu_utilization_ratio", gpu=g)
        smi_util = int(row["utilization.gpu"])
        checks.eq(f"gpu {g} utilization busy-or-idle agrees (sampled apart)",
                  util, smi_util / 100, (util or 0) > 0.3 if smi_util > 30 else True)
        active, errors, speeds = smi_nvlink(int(g))
        ours_active = [v for (n, lbl), v in s.items()
                       if n == "gpunet_gpu_nvlink_active" and dict(lbl)["gpu"] == g]
        checks.eq(f"gpu {g} NVLink active links", int(sum(ours_active)), active)
        # The speed of each active link, read in one batched field call (GB/s as nvidia-smi
        # prints it, to the MB/s).
        ours_speed = {dict(lbl)["link"]: round(v / 1e9, 3) for (n, lbl), v in s.items()
                      if n == "gpunet_gpu_nvlink_speed_bytes_per_second"
                      and dict(lbl)["gpu"] == g}
        checks.eq(f"gpu {g} NVLink link speeds (GB/s)", ours_speed, speeds,
                  bool(speeds) and ours_speed == speeds)
        for (link, kind), n in sorted(errors.items()):
            v = pick(s, "gpunet_gpu_nvlink_errors_total", gpu=g, link=link, type=kind)
            if link in ("0", "17") or v != n:
                checks.eq(f"gpu {g} NVLink {link} {kind} errors", v, n)
        checks.eq(f"gpu {g} lost", pick(s, "gpunet_gpu_lost", gpu=g), 0.0)
        checks.eq(f"gpu {g} XID events registered", pick(s, "gpunet_gpu_xid_monitoring", gpu=g),
                  1.0)
    return {"samples": {f"{n}{dict(sorted(lbl))}": v for (n, lbl), v in sorted(
        s.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))) if n.startswith("gpunet_")}}


def time_calls(n: int, site: Path) -> dict[str, Any]:
    """Median cost of the per-scrape collection with the real NVML, and of its parts, measured
    on this checkout as installed into ``site``."""
    sys.path.insert(0, str(site))
    import pynvml

    from gpunet_exporter.collector import Scrape, build_collector
    from gpunet_exporter.collectors.gpu import GpuCollector
    from gpunet_exporter.sources import nvml

    c = build_collector(GpuCollector, {"counters_interval_seconds": 3600})
    list(c.collect(Scrape()))  # discovery, info, NVLink link count, background round, XID thread
    gpus = nvml.session().gpus() or []
    ngpu = len(gpus)
    fields = ("utilization.gpu,memory.used,memory.total,pcie.link.gen.current,"
              "pcie.link.width.current")

    def ours() -> float:
        t = time.perf_counter()
        list(c.collect(Scrape()))
        return time.perf_counter() - t

    def peer() -> float:
        t = time.perf_counter()
        sh("nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits")
        return time.perf_counter() - t

    # Three phases in one run: ours alone, the peer alone, then both interleaved (each
    # nvidia-smi start initialises NVML and the driver anew, which slows the calls after it).
    alone = [ours() for _ in range(n)]
    peer_alone = [peer() for _ in range(max(n // 5, 20))]
    collect_s, smi_s = [], []
    for _ in range(n):
        collect_s.append(ours())
        smi_s.append(peer())
    t = time.perf_counter()
    c.refresh()
    round_s = time.perf_counter() - t
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(100):
        list(c.collect(Scrape()))
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(20)
    print(text.getvalue())
    memory = {}
    for g in gpus:
        v1 = pynvml.nvmlDeviceGetMemoryInfo(g.handle)
        v2 = pynvml.nvmlDeviceGetMemoryInfo(g.handle, version=pynvml.nvmlMemory_v2)
        memory[g.index] = {"v1": {"total": v1.total, "free": v1.free, "used": v1.used},
                           "v2": {"total": v2.total, "reserved": v2.reserved, "free": v2.free,
                                  "used": v2.used}}
    print("memory v1/v2:", memory)
    parts: dict[str, float] = {}
    h = gpus[0].handle
    for name, fn in (
            ("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount),
            ("nvmlDeviceGetUtilizationRates", lambda: pynvml.nvmlDeviceGetUtilizationRates(h)),
            ("nvmlDeviceGetMemoryInfo", lambda: pynvml.nvmlDeviceGetMemoryInfo(h)),
            ("nvmlDeviceGetMemoryInfo_v2", lambda: pynvml.nvmlDeviceGetMemoryInfo(
                h, version=pynvml.nvmlMemory_v2)),
            ("nvmlDeviceGetCurrPcieLinkGeneration",
             lambda: pynvml.nvmlDeviceGetCurrPcieLinkGeneration(h)),
            ("nvmlDeviceGetMaxPcieLinkGeneration",
             lambda: pynvml.nvmlDeviceGetMaxPcieLinkGeneration(h)),
            ("nvmlDeviceGetCurrPcieLinkWidth", lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(h)),
            ("nvmlDeviceGetMaxPcieLinkWidth", lambda: pynvml.nvmlDeviceGetMaxPcieLinkWidth(h)),
            ("nvmlDeviceGetComputeRunningProcesses",
             lambda: pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
            ("nvmlDeviceGetNvLinkState(link 0)", lambda: pynvml.nvmlDeviceGetNvLinkState(h, 0)),
            ("nvmlDeviceGetNvLinkErrorCounter(link 0)",
             lambda: pynvml.nvmlDeviceGetNvLinkErrorCounter(h, 0, 0)),
            ("nvmlDeviceGetFieldValues(1 PCIe error field)",
             lambda: pynvml.nvmlDeviceGetFieldValues(h, [176])),
            ("nvmlDeviceGetFieldValues(NVLINK_GET_STATE x 18 links)",
             lambda: pynvml.nvmlDeviceGetFieldValues(h, [(165, i) for i in range(18)]))):
        ts = []
        for _ in range(50):
            t = time.perf_counter()
            try:
                fn()
            except pynvml.NVMLError as exc:
                parts[name + " error"] = 0.0
                print(f"  {name}: {exc}")
                break
            ts.append(time.perf_counter() - t)
        if ts:
            parts[name] = statistics.median(ts) * 1e6
    c.close()
    med, med_alone = statistics.median(collect_s), statistics.median(alone)
    res = {
        "gpus": ngpu, "scrapes": n,
        "alone_collect_median_ms": med_alone * 1e3,
        "alone_collect_p90_ms": sorted(alone)[int(0.9 * n)] * 1e3,
        "alone_collect_per_gpu_median_ms": med_alone * 1e3 / max(ngpu, 1),
        "alone_peer_nvidia_smi_query_median_ms": statistics.median(peer_alone) * 1e3,
        "interleaved_collect_median_ms": med * 1e3,
        "interleaved_collect_p90_ms": sorted(collect_s)[int(0.9 * n)] * 1e3,
        "interleaved_collect_per_gpu_median_ms": med * 1e3 / max(ngpu, 1),
        "interleaved_peer_nvidia_smi_query_median_ms": statistics.median(smi_s) * 1e3,
        "background_round_ms": round_s * 1e3,
        "call_median_us": parts,
        "memory_v1_v2": memory,
        "profile": text.getvalue(),
    }
    print("\n== timing (real NVML)")
    print(json.dumps({k: v for k, v in res.items() if k != "profile"}, indent=1))
    return res


def finish(out: dict[str, Any], checks: Checks, directory: str | None, name: str) -> int:
    """Print the tally, write everything to directory/name; exit status 1 if a check failed."""
    out["checks"] = checks.rows
    print(f"\n{len(checks.rows) - checks.failed}/{len(checks.rows)} checks passed")
    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
        (Path(directory) / name).write_text(json.dumps(out, indent=1, default=str))
    return 1 if checks.failed else 0


def gpu(args: argparse.Namespace) -> int:
    checks = Checks()
    out: dict[str, Any] = {"nvidia_smi": sh("nvidia-smi", "-L")}
    print(out["nvidia_smi"])
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        site = install(tmp)
        load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.load_seconds)],
                                stdout=subprocess.PIPE, text=True)
        assert load.stdout is not None
        load.stdout.readline()  # "load running"
        port = free_port()
        env = {**os.environ, "PYTHONPATH": str(site)}
        exp = subprocess.Popen(
            [sys.executable, "-m", "gpunet_exporter", f"--web.listen-address=127.0.0.1:{port}",
             "--collector.disable-defaults", "--collector.gpu", "--collector.topology",
             "--log.level=debug"],
            env=env, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            for _ in range(100):
                try:
                    scrape(url)
                    break
                except OSError:
                    time.sleep(0.1)
            time.sleep(3)  # a utilization sample period under load, and a background round
            out |= check_against_smi(url, checks)
            s = scrape(url)
            for coll in ("gpu", "topology"):
                checks.eq(f"collector {coll} success",
                          pick(s, "gpunet_scrape_collector_success", collector=coll), 1.0)
            out["topology"] = {f"{n}{dict(sorted(lbl))}": v for (n, lbl), v in s.items()
                               if n.startswith("gpunet_topology_")}
            print("\n== topology series")
            for k, v in sorted(out["topology"].items()):
                print(f"  {k} {v}")
        finally:
            exp.terminate()
            _, err = exp.communicate(timeout=10)
            out["exporter_log_tail"] = err.splitlines()[-40:]
            load.terminate()
            load.wait(timeout=30)
        out["timing"] = time_calls(args.scrapes, site)
    return finish(out, checks, args.out, "gpu_check.json")


def _scope_round(state: Path, scope: str) -> bool:
    """Whether the launcher is in a round (or start) of ``scope`` now."""
    try:
        status = json.loads((state / "status.json").read_text())
    except (OSError, ValueError):
        return False
    return status.get("phase") in ("init", "round") and status.get("scope") == scope


def _labels(s: dict[Any, float], name: str, key: str) -> list[str]:
    return sorted(dict(lbl)[key] for (n, lbl), v in s.items() if n == name and v)


def parents() -> dict[int, int]:
    """Every process's parent (from /proc/<pid>/stat; processes gone meanwhile are skipped)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
    return parent


def children(pid: int) -> list[int]:
    return sorted(p for p, pp in parents().items() if pp == pid)


def proc_rss(pid: int) -> int | None:
    """A process's resident bytes (VmRSS); None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def proc_environ(pid: int, key: str) -> str | None:
    """One variable of a process's environment as it started; None when unset or unreadable."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name.decode(errors="replace") == key:
            return value.decode(errors="replace")
    return None


def process_tree(root: int) -> set[int]:
    """``root`` and every process under it (from /proc; processes gone meanwhile are skipped)."""
    parent = parents()
    tree, grew = {root}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def tree_rss(root: int) -> tuple[int, int, int]:
    """Resident bytes of ``root`` and every process under it, their count, and the largest
    one's bytes (VmRSS from /proc; processes gone meanwhile are skipped)."""
    sizes = [n for pid in process_tree(root) if (n := proc_rss(pid)) is not None]
    return sum(sizes), len(sizes), max(sizes, default=0)


def probe_exporter(site: Path, tmp: Path, rounds: int, gpus: int,
                   checks: Checks) -> dict[str, Any]:
    """The exporter with the probe collector at its defaults (a round every 4 s): the net
    scope, one rank per GPU with its own NCCL_HOSTID (two on the GPU of a one-GPU machine),
    and with two GPUs or more the intra scope."""
    state = tmp / "state-net"
    cfg = tmp / "probe-net.yml"
    # No hold-off: nothing else runs on this machine's GPUs (the `job` check measures it).
    cfg.write_text(f"probe:\n  state_dir: {json.dumps(str(state))}\n  interval_seconds: 4\n"
                   "  holdoff_seconds: 0\n")
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(site)}
    exp = subprocess.Popen(
        [sys.executable, "-m", "gpunet_exporter", f"--web.listen-address=127.0.0.1:{port}",
         "--collector.disable-defaults", "--collector.probe", "--collector.infiniband",
         f"--config.file={cfg}"], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    during, idle, seen = [], [], []
    deadline = time.monotonic() + 240
    s: dict[Any, float] = {}
    rss_peak, rss_largest, rss_procs, rss_idle = 0, 0, 0, None
    try:
        while time.monotonic() < deadline:
            # the pod's memory with the probe component: the exporter, its runner and the ranks
            total, count, largest = tree_rss(exp.pid)
            if count == 1:
                rss_idle = total
            if total > rss_peak:
                rss_peak, rss_procs = total, count
            rss_largest = max(rss_largest, largest)
            t0 = time.perf_counter()
            try:
                s = scrape(url)
            except OSError:
                time.sleep(0.2)
                continue
            dt = time.perf_counter() - t0
            (during if _scope_round(state, "net") else idle).append(dt)
            last = pick(s, "gpunet_probe_last_round_timestamp_seconds", scope="net")
            if last is not None and last not in seen:
                seen.append(last)
                if len(seen) >= rounds:
                    break
            time.sleep(0.05)
    finally:
        exp.terminate()
        _, err = exp.communicate(timeout=20)
    print(f"\n== probe through the exporter, {gpus} GPU(s)")
    transports = sorted((dict(lbl)["transport"], dict(lbl)["net"]) for (n, lbl) in s
                        if n == "gpunet_probe_transport_info" and dict(lbl)["scope"] == "net")
    busbw = {int(dict(lbl)["size"]): v for (n, lbl), v in s.items()
             if n == "gpunet_probe_allreduce_bus_bandwidth_bytes_per_second"
             and dict(lbl)["scope"] == "net"}
    lat = {int(dict(lbl)["size"]): v for (n, lbl), v in s.items()
           if n == "gpunet_probe_allreduce_seconds" and dict(lbl)["stat"] == "median"}
    out = {
        "success_net": pick(s, "gpunet_probe_success", scope="net"),
        "success_intra": pick(s, "gpunet_probe_success", scope="intra"),
        "intra_series": sorted({n for (n, lbl) in s if ("scope", "intra") in lbl}),
        "rounds_seen": len(seen), "transports": transports,
        "world_size": pick(s, "gpunet_probe_world_size", scope="net"),
        "busbw_GBps": {k: v / 1e9 for k, v in sorted(busbw.items())},
        "median_us": {k: v * 1e6 for k, v in sorted(lat.items())},
        "socket_fallback": pick(s, "gpunet_probe_socket_fallback", scope="net"),
        "gdr_active": pick(s, "gpunet_probe_gdr_active", scope="net"),
        "link_ratio": pick(s, "gpunet_probe_bus_bandwidth_link_ratio", scope="net"),
        "straggler_wait_ratio": pick(s, "gpunet_probe_straggler_wait_ratio", scope="net"),
        "straggler_named": _labels(s, "gpunet_probe_straggler_info", "rank"),
        "round_seconds": pick(s, "gpunet_probe_duration_seconds", scope="net"),
        "failures": {dict(lbl)["reason"]: v for (n, lbl), v in s.items()
                     if n == "gpunet_probe_failures_total" and v},
        "problems": _labels(s, "gpunet_probe_nccl_problem", "problem"),
        "rdma_ports": len([1 for (n, _) in s if n == "gpunet_infiniband_port_state_id"]),
        "scrape_ms_median_during_rounds": statistics.median(during) * 1e3 if during else None,
        "scrape_ms_median_between_rounds": statistics.median(idle) * 1e3 if idle else None,
        "scrapes_during_rounds": len(during), "scrapes_between_rounds": len(idle),
        "tree_rss_peak_MB": rss_peak / 1e6, "tree_processes_at_peak": rss_procs,
        "largest_process_rss_MB": rss_largest / 1e6,
        "exporter_alone_rss_MB": None if rss_idle is None else rss_idle / 1e6,
        "exporter_log_tail": err.splitlines()[-10:],
    }
    print(json.dumps({k: v for k, v in out.items() if k != "exporter_log_tail"}, indent=1))
    checks.eq("net: probe success", out["success_net"], 1.0)
    checks.eq("net: a rank per GPU (two on a single GPU)", out["world_size"],
              float(max(gpus, 2)))
    if gpus == 1:
        checks.eq("one GPU: no intra-scope series at all", out["intra_series"], [])
    else:
        checks.eq(f"intra: probe success on {gpus} GPUs", out["success_intra"], 1.0)
    if out["rdma_ports"] == 0:
        checks.eq("net: NET/Socket carries it (no HCA here)", transports, [("NET", "Socket")])
        checks.eq("net: NCCL's log says no IB device", "no_ib_device" in out["problems"], True)
        checks.eq("net: no link ratio without an RDMA port", out["link_ratio"], None)
        checks.eq("net: socket_fallback 0 without an ACTIVE RDMA port", out["socket_fallback"],
                  0.0)
    else:  # IB or a fallback, depending on the machine's fabric: reported
        checks.eq("net: transports and socket_fallback with RDMA ports (reported)",
                  [transports, out["socket_fallback"]], "recorded", True)
    checks.eq("net: nobody named in a fair run", out["straggler_named"], [])
    checks.eq("memory: the process tree's peak (reported; the probe component's limits)",
              round(rss_peak / 1e6), "recorded", rss_procs > 1)
    return out


def runner_once(site: Path, state: Path, env_extra: dict[str, str],
                *extra: str) -> tuple[dict[str, Any] | None, str]:
    """One round of ``gpunet-probe run`` (the launcher, no exporter); the net result."""
    r = subprocess.run(
        [sys.executable, "-m", "gpunet_exporter.probe.cli", "run", "--state-dir", str(state),
         "--scopes", "net", "--rounds", "1", *extra], capture_output=True, text=True,
        timeout=300, env={**os.environ, "PYTHONPATH": str(site), **env_extra})
    try:
        return json.loads((state / "net.json").read_text()), r.stderr[-1500:]
    except (OSError, ValueError):
        return None, r.stderr[-1500:]


def probe_straggler(site: Path, tmp: Path, checks: Checks) -> dict[str, Any]:
    """Rank 1 made 50 ms late before every timed all-reduce (GPUNET_PROBE_DELAY), then a fair
    round: the late rank must be named, and nobody in the fair one."""
    out = {}
    for name, env in (("late", {"GPUNET_PROBE_DELAY": "1:0.05"}), ("fair", {})):
        res, err = runner_once(site, tmp / f"state-straggler-{name}", env)
        out[name] = {"straggler": res and res.get("straggler"), "success": res and
                     res.get("success"), "stderr_tail": err if not res else ""}
    print("\n== straggler (NCCL, net scope, two ranks on one GPU)")
    print(json.dumps(out, indent=1))
    late, fair = out["late"]["straggler"] or {}, out["fair"]["straggler"] or {}
    checks.eq("straggler: rank 1 named when 50 ms late", late.get("rank"), 1)
    checks.eq("straggler: wait about 50 ms", round(late.get("wait_seconds", 0) * 1e3, 1),
              "30..80", 0.03 <= late.get("wait_seconds", 0) <= 0.08)
    checks.eq("straggler: nobody named in the fair round", fair.get("rank", "absent"), None)
    return out


def serve_state(site: Path, tmp: Path, state: Path, ready: Any) -> dict[Any, float]:
    """Start an exporter (probe collector alone, runner: none) on ``state`` and scrape it until
    ``ready(samples)`` or 30 s; the last scrape's samples."""
    cfg = tmp / f"{state.name}.yml"
    cfg.write_text(f"probe:\n  runner: none\n  state_dir: {json.dumps(str(state))}\n")
    eport = free_port()
    exp = subprocess.Popen(
        [sys.executable, "-m", "gpunet_exporter", f"--web.listen-address=127.0.0.1:{eport}",
         "--collector.disable-defaults", "--collector.probe", f"--config.file={cfg}"],
        env={**os.environ, "PYTHONPATH": str(site)}, stderr=subprocess.PIPE, text=True)
    s: dict[Any, float] = {}
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                s = scrape(f"http://127.0.0.1:{eport}/metrics")
                if ready(s):
                    break
            except OSError:
                pass
            time.sleep(0.3)
    finally:
        exp.terminate()
        exp.communicate(timeout=20)
    return s


def probe_inter(site: Path, tmp: Path, checks: Checks) -> dict[str, Any]:
    """Cluster mode across two simulated nodes on one GPU: two torchrun invocations (nnodes 2,
    one rank each) with their own NCCL_HOSTID and state directory; rank 1 made 50 ms late.
    Node 0's exporter (runner: none) must export scope="inter", node 1 must name its rank."""
    port = free_port()
    procs = []
    for node in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(site), "NCCL_HOSTID": f"sim-node-{node}",
               "GPUNET_PROBE_DELAY": "1:0.05"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank",
             str(node), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "-m", "gpunet_exporter.probe.cli", "run", "--state-dir",
             str(tmp / f"state-inter-{node}"), "--rounds", "1"], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0][-1500:] for p in procs]
    files = []
    for node in (0, 1):
        try:
            files.append(json.loads((tmp / f"state-inter-{node}" / "inter.json").read_text()))
        except (OSError, ValueError):
            files.append({})
    s = serve_state(site, tmp, tmp / "state-inter-1",
                    lambda s: pick(s, "gpunet_probe_success", scope="inter") is not None)
    out = {"returncodes": [p.returncode for p in procs],
           "inter_json": [{k: f.get(k) for k in ("success", "world_size", "transports",
                                                 "net_transports", "straggler", "sizes")}
                          for f in files],
           "node1_exported": {"success": pick(s, "gpunet_probe_success", scope="inter"),
                              "straggler_named": _labels(s, "gpunet_probe_straggler_info",
                                                         "rank"),
                              "transports": _labels(s, "gpunet_probe_transport_info", "net")},
           "logs": logs if any(p.returncode for p in procs) else []}
    print("\n== cluster mode, two simulated nodes on one GPU")
    print(json.dumps(out, indent=1, default=str))
    checks.eq("inter: both simulated nodes finished", out["returncodes"], [0, 0])
    checks.eq("inter: world size 2, over NET", [f.get("world_size") for f in files], [2, 2])
    checks.eq("inter: exported as scope=inter", out["node1_exported"]["success"], 1.0)
    checks.eq("inter: the late rank's node names it", out["node1_exported"]["straggler_named"],
              ["1"])
    checks.eq("inter: the other node does not claim it",
              (files[0].get("straggler") or {}).get("local"), False)
    return out


# Stages of bench/probe_bench.py's memory (process_gpu_MiB_max_rank (NVML)).
RELEASED = "after a round (cache released: between rounds)"
KEPT = "after a round, cache kept (the runner before)"


def run_bench(site: Path, nproc: int, net: bool, sizes: str,
              reps: int) -> tuple[dict[str, Any] | None, str]:
    """bench/probe_bench.py under torch.distributed.run, ``nproc`` ranks (one per GPU, modulo
    the GPUs); ``net``: every rank its own NCCL_HOSTID. Its JSON, or None and the output."""
    env = {**os.environ, "PYTHONPATH": str(site)}
    if net:
        env["BENCH_HOSTID_PER_RANK"] = "1"
    try:
        r = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             str(nproc), str(REPO / "bench" / "probe_bench.py"), "--sizes", sizes,
             "--reps", str(reps)], capture_output=True, text=True, timeout=480, env=env)
    except subprocess.TimeoutExpired as exc:
        return None, f"timed out after {exc.timeout} s"
    try:
        return json.loads(r.stdout[r.stdout.index("{"):]), ""
    except ValueError:
        return None, r.stdout[-3000:] + r.stderr[-3000:]


def bench_checks(bench: dict[str, Any], label: str, checks: Checks) -> dict[str, Any]:
    """The checks on one bench/probe_bench.py result, and its summary: per size the probe's
    bus bandwidth over the tight loop's (at least 0.9 from 64 MiB up; below, reported), and
    PyTorch's cache given back between rounds."""
    summary: dict[str, Any] = {}
    for key, row in sorted(bench["accuracy"].items(), key=lambda kv: int(kv[0])):
        n, r = int(key), row["probe_over_reference"]
        size = f"{n / MIB:g}MiB"
        summary[size] = {k: row.get(k) for k in (
            "probe_busbw_GBps", "reference_busbw_GBps", "probe_over_reference",
            "old_way_busbw_GBps (bytes / per-iteration median)", "old_way_over_reference")}
        shown = None if r is None else round(r, 3)
        if n >= 64 * MIB:
            checks.eq(f"{label}: probe busbw / tight loop at {size} at least 0.9", shown,
                      ">= 0.9", r is not None and r >= 0.9)
            checks.eq(f"{label}: probe busbw / tight loop at {size} not above 1.1 (a timing "
                      "error)", shown, "<= 1.1", r is not None and r <= 1.1)
        else:
            checks.eq(f"{label}: probe busbw / tight loop at {size} (reported)", shown,
                      "recorded", True)
    mem = bench["memory"]
    gpu = mem["process_gpu_MiB_max_rank (NVML)"]
    largest = max(int(k) for k in bench["accuracy"]) / MIB
    drop = gpu.get(KEPT, 0) - gpu.get(RELEASED, 0)
    summary["memory"] = {
        "gpu_MiB_between_rounds_max_rank": gpu.get(RELEASED),
        "gpu_MiB_had_the_cache_been_kept": gpu.get(KEPT),
        "gpu_MiB_context": gpu.get("CUDA context"),
        "gpu_MiB_process_group": gpu.get("process group"),
        "host_rss_MiB": mem["host_rss_MiB_max_rank"],
        "cuda_module_loading": bench.get("cuda_module_loading")}
    # One 2 MiB segment of PyTorch's small-block pool stays: the live small tensors (the busy
    # flag, the gathered peers); measured on 4 H100s. The round's buffers are gone.
    reserved = mem["torch_reserved_MiB_max_rank_between_rounds"]
    checks.eq(f"{label}: PyTorch holds no round buffer between rounds (reserved MiB)",
              reserved, "<= 2", reserved <= 2.0)
    checks.eq(f"{label}: releasing the cache gives back at least the largest size "
              f"({largest:g} MiB, NVML)", round(drop), f">= {0.9 * largest:g}",
              drop >= 0.9 * largest)
    return summary


def sample_probe_processes(launcher: int) -> dict[str, Any]:
    """The launcher's worker ranks now: scope, device, GPU memory (nvidia-smi) and host RSS;
    and the launcher's own RSS."""
    apps = smi_app_memory()
    procs = []
    for pid in children(launcher):
        scope = proc_environ(pid, "GPUNET_PROBE_SCOPE")
        if scope is None:
            continue
        rss = proc_rss(pid)
        procs.append({"pid": pid, "scope": scope,
                      "device": proc_environ(pid, "GPUNET_PROBE_DEVICE"),
                      "gpu_MiB": apps.get(pid),
                      "rss_MiB": None if rss is None else round(rss / MIB, 1)})
    own = proc_rss(launcher)
    return {"launcher_rss_MiB": None if own is None else round(own / MIB, 1),
            "processes": procs}


def memory_by_scope(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scope, over every sample: the most GPU memory and host RSS of one process, and how
    much a process's GPU memory grew from its first sample to its last."""
    out: dict[str, Any] = {}
    first: dict[int, int] = {}
    for sample in samples:
        for p in sample["processes"]:
            e = out.setdefault(p["scope"], {"processes": 0, "gpu_MiB_max": None,
                                            "rss_MiB_max": None, "gpu_MiB_growth_max": 0,
                                            "not_seen_by_nvidia_smi": 0})
            if p["gpu_MiB"] is None:
                e["not_seen_by_nvidia_smi"] += 1
            else:
                e["gpu_MiB_max"] = max(e["gpu_MiB_max"] or 0, p["gpu_MiB"])
                first.setdefault(p["pid"], p["gpu_MiB"])
                e["gpu_MiB_growth_max"] = max(e["gpu_MiB_growth_max"],
                                              p["gpu_MiB"] - first[p["pid"]])
            if p["rss_MiB"] is not None:
                e["rss_MiB_max"] = max(e["rss_MiB_max"] or 0, p["rss_MiB"])
    for sample in samples[-1:]:
        for scope, e in out.items():
            e["processes"] = sum(p["scope"] == scope for p in sample["processes"])
    return out


def probe_memory(site: Path, tmp: Path, sizes: str, rounds: int, interval: float,
                 checks: Checks) -> dict[str, Any]:
    """The node's launcher (`gpunet-probe run`, both scopes, ``sizes``, the cap at twice the
    largest and at least 1 GiB) for ``rounds`` rounds: a sample of every probe process once per
    pause between rounds (a rank releases PyTorch's cache before it says its round is done),
    kept only when the pause was still on once the sample was taken."""
    cap = max(1 << 30, 2 * max(size_list(sizes)))
    state = tmp / "state-memory"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpunet_exporter.probe.cli", "run", "--state-dir", str(state),
         "--sizes", sizes, "--memory-cap", str(cap), "--rounds", str(rounds), "--interval",
         str(interval), "--timeout", "300", "--no-skip-busy"],
        env={**os.environ, "PYTHONPATH": str(site)}, stderr=subprocess.PIPE, text=True)
    samples: list[dict[str, Any]] = []
    seen: set[Any] = set()
    raced = 0
    deadline = time.monotonic() + 120 + rounds * max(interval, 60)

    def status() -> dict[str, Any]:
        try:
            return dict(json.loads((state / "status.json").read_text()))
        except (OSError, ValueError):
            return {}

    try:
        while launcher.poll() is None and time.monotonic() < deadline:
            before = status()
            key = (before.get("round"), before.get("since"))
            if before.get("phase") == "sleep" and key not in seen:
                seen.add(key)
                sample = sample_probe_processes(launcher.pid)
                if status() == before:
                    samples.append({"after_round": before.get("round"), **sample})
                else:
                    raced += 1  # the next round began meanwhile: not a pause's numbers
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.terminate()
        _, err = launcher.communicate(timeout=60)
    results = {}
    for scope in ("intra", "net"):
        with contextlib.suppress(OSError, ValueError):
            res = json.loads((state / f"{scope}.json").read_text())
            results[scope] = {"success": res.get("success"), "sizes": [
                (s["bytes"], round(s.get("busbw_bytes_per_second", 0) / 1e9, 2),
                 s.get("loop_seconds")) for s in res.get("sizes", [])]}
    by_scope = memory_by_scope(samples)
    out = {"sizes": sizes, "memory_cap_bytes": cap, "returncode": launcher.returncode,
           "samples": samples, "samples_raced": raced, "by_scope": by_scope,
           "last_results": results,
           "launcher_rss_MiB_max": max((s["launcher_rss_MiB"] or 0 for s in samples),
                                       default=None),
           "stderr_tail": err[-2000:] if launcher.returncode else ""}
    print("\n== the node's launcher between rounds (both scopes, sizes " + sizes + ")")
    print(json.dumps({k: v for k, v in out.items() if k != "samples"}, indent=1))
    checks.eq("memory: the launcher finished its rounds", launcher.returncode, 0)
    checks.eq("memory: samples between rounds", len(samples), rounds - 1)
    for scope, e in by_scope.items():
        checks.eq(f"memory: every {scope} process seen by nvidia-smi",
                  e["not_seen_by_nvidia_smi"], 0)
        checks.eq(f"memory: {scope} GPU memory does not grow between rounds (MiB)",
                  e["gpu_MiB_growth_max"], "<= 16", e["gpu_MiB_growth_max"] <= 16)
    launcher_rss = out["launcher_rss_MiB_max"]
    checks.eq("memory: the launcher holds no torch (RSS MiB)", launcher_rss, "< 150",
              launcher_rss is not None and launcher_rss < 150)
    return out


def probe(args: argparse.Namespace) -> int:
    checks = Checks()
    out: dict[str, Any] = {"nvidia_smi": sh("nvidia-smi", "-L")}
    print(out["nvidia_smi"])
    gpus = len(smi_gpus())
    summary: dict[str, Any] = {"gpus": gpus, "sizes": args.sizes}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        site = install(tmp)
        out["net"] = probe_exporter(site, tmp, args.rounds, gpus, checks)
        out["straggler"] = probe_straggler(site, tmp, checks)
        out["inter"] = probe_inter(site, tmp, checks)
        # (4) and (5): the probe against a tight loop in the same processes, and its memory
        benches = [("net", 2, True)]
        if gpus >= 2:
            benches.insert(0, ("intra", gpus, False))
        else:
            summary["intra"] = "skipped: one GPU, and the intra scope needs two"
            print("\n== intra scope skipped: one GPU, and the intra scope needs two")
        for label, nproc, net in benches:
            bench, err = run_bench(site, nproc, net, args.sizes, args.reps)
            where = "two ranks, their own host IDs" if net else f"one rank on each of {nproc} GPUs"
            print(f"\n== bench/probe_bench.py, {label} scope ({where})")
            print(json.dumps(bench, indent=1) if bench else err)
            out[f"bench_{label}"] = bench or {"error": err}
            if bench is None:
                checks.eq(f"{label}: bench/probe_bench.py output", "no JSON", "JSON", False)
                continue
            try:
                summary[label] = bench_checks(bench, label, checks)
            except (KeyError, TypeError, ValueError) as exc:
                checks.eq(f"{label}: bench/probe_bench.py output", repr(exc), "its fields",
                          False)
            cost = bench.get("default_round", {})
            summary[label + "_default_round_gpu_ms"] = cost.get("gpu_time_ms_max_rank")
        # (6) the launcher's processes between rounds
        mem = probe_memory(site, tmp, args.sizes, args.memory_rounds, args.memory_interval,
                           checks)
        out["memory_between_rounds"] = mem
        summary["memory_between_rounds"] = {
            "launcher_rss_MiB": mem["launcher_rss_MiB_max"],
            **{scope: {**e, "before_MiB (4 H100, issue 31)": BEFORE_MIB.get(scope)}
               for scope, e in mem["by_scope"].items()}}
    summary["checks"] = f"{len(checks.rows) - checks.failed}/{len(checks.rows)} passed"
    summary["failed"] = [r["check"] for r in checks.rows if not r["ok"]]
    out["summary"] = summary
    print("\n== summary")
    print(json.dumps(summary, indent=1))
    return finish(out, checks, args.out, "probe_check.json")


def _fleet_run(site: Path, tmp: Path, nodes: list[str], extra: list[str], prefix: str = "fleet"
               ) -> tuple[list[int], list[str], float]:
    port, pair_port = free_port(), free_port()
    procs = []
    started = time.monotonic()
    for rank, node in enumerate(nodes):
        # NCCL_HOSTID: each simulated node a host of its own for NCCL, in the fleet's
        # environment, which its pair workers inherit (read at NCCL's first use in each).
        env = {**os.environ, "PYTHONPATH": str(site), "NCCL_HOSTID": f"sim-{node}",
               "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(len(nodes)),
               "SLURM_LOCALID": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "gpunet_exporter.probe.cli", "fleet", "--state-dir",
             str(tmp / f"{prefix}-{node}"), "--node-name", node, "--port", str(pair_port),
             "--pair-timeout", "120", *extra], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=500)[0] for p in procs]
    return [p.returncode for p in procs], outs, time.monotonic() - started


_PAIR_END = re.compile(r"pair end took ([0-9.]+) s \(wall clock ([0-9.]+) to ([0-9.]+)\)")
_GROUP_UP = re.compile(r"group up in ([0-9.]+) s")
_WORKER = re.compile(r"local rank \d+: pair worker (\d+) \((started|kept)")


def fleet_rounds(tmp: Path, prefix: str, summary: list[dict[str, Any]]) -> dict[str, Any]:
    """A pass's time per round from its pair ends' probe.log lines (``pair end took ... (wall
    clock A to B)``): a round lasts from the first of its pair ends' A to the last one's B.
    With the time each pair end's group took to come up (``group up in``), and how many pair
    workers each node started (``started for this pair``) and with which PIDs."""
    spans: dict[int, list[tuple[float, float]]] = {}
    ups: dict[int, list[float]] = {}
    measure: dict[int, list[float]] = {}  # the round's all-reduces: the result's time - started
    workers: dict[str, list[tuple[int, bool]]] = {}
    for line in summary:
        r = int(line["round"])
        for node, peer in ((line["node"], line["peer"]), (line["peer"], line["node"])):
            try:
                text = (tmp / f"{prefix}-{node}" / "fleet" / peer / "probe.log").read_text()
            except OSError:
                continue
            try:
                res = json.loads((tmp / f"{prefix}-{node}" / "fleet" / peer / "inter.json")
                                 .read_text())
                measure.setdefault(r, []).append(float(res["time"]) - float(res["started"]))
            except (OSError, ValueError, KeyError, TypeError):
                pass
            m = _PAIR_END.search(text)
            if m:
                spans.setdefault(r, []).append((float(m[2]), float(m[3])))
            ups.setdefault(r, []).extend(float(g) for g in _GROUP_UP.findall(text))
            workers.setdefault(node, []).extend(
                (int(pid), how == "started") for pid, how in _WORKER.findall(text))
    rounds = [round(max(b for _, b in v) - min(a for a, _ in v), 3)
              for _, v in sorted(spans.items())]
    return {"round_seconds": rounds,
            "median_round_seconds": round(statistics.median(rounds), 3) if rounds else None,
            "group_up_seconds_by_round": {r: sorted(round(x, 3) for x in v)
                                          for r, v in sorted(ups.items())},
            "measure_seconds_by_round": {r: round(max(v), 3) for r, v in sorted(measure.items())},
            "worker_starts": {n: sum(s for _, s in w) for n, w in sorted(workers.items())},
            "worker_pids": {n: sorted({p for p, _ in w}) for n, w in sorted(workers.items())}}


def fleet(args: argparse.Namespace) -> int:
    checks = Checks()
    out: dict[str, Any] = {"nvidia_smi": sh("nvidia-smi", "-L")}
    print(out["nvidia_smi"])
    nodes = [f"sim{i}" for i in range(args.nodes)]
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        site = install(tmp)
        # The simulated nodes share one GPU: a pair's load is not "other work" for the next
        # pair's busy check, which would skip the large sizes (seen on the first run).
        rcs, outs, wall = _fleet_run(site, tmp, nodes, ["--kind", "ring", "--", "--no-skip-busy"])
        summary = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
        files = {}
        for n in nodes:
            try:
                files[n] = json.loads((tmp / f"fleet-{n}" / "pairs.json").read_text())
            except (OSError, ValueError):
                files[n] = {}
        out["ring"] = {"returncodes": rcs, "wall_seconds": round(wall, 1), "summary": summary,
                       **fleet_rounds(tmp, "fleet", summary),
                       "logs": [o[-2000:] for o in outs] if any(rcs) else []}
        print("\n== ring over", len(nodes), "simulated nodes on one GPU, NCCL")
        print(json.dumps(out["ring"], indent=1))
        checks.eq("fleet ring: every node exited 0", rcs, [0] * len(nodes))
        ring_peers = {n: sorted({nodes[(i - 1) % len(nodes)], nodes[(i + 1) % len(nodes)]})
                      for i, n in enumerate(nodes)}
        checks.eq("fleet ring: each node's file names its ring neighbours",
                  {n: sorted(p["peer"] for p in f.get("pairs", [])) for n, f in files.items()},
                  ring_peers)
        pairs_all = [p for f in files.values() for p in f.get("pairs", [])]
        checks.eq("fleet ring: every pair ok and measured",
                  all(p["ok"] and (p["bus_bandwidth_bytes_per_second"] or 0) > 0
                      for p in pairs_all) and bool(pairs_all), True)
        checks.eq("fleet ring: NCCL's transport recorded (Socket: no HCA here)",
                  sorted({p["transport"] for p in pairs_all}), ["Socket"])
        # the second pass: sim1 re-paired with a good node, merged into the files
        rcs2, outs2, wall2 = _fleet_run(site, tmp, nodes, ["--kind", "repair", "--suspects",
                                                          nodes[1], "--", "--no-skip-busy"])
        after = json.loads((tmp / f"fleet-{nodes[1]}" / "pairs.json").read_text())
        out["repair"] = {"returncodes": rcs2, "wall_seconds": round(wall2, 1),
                         "sim1_peers": [p["peer"] for p in after["pairs"]], "plan": after["plan"],
                         "logs": [o[-2000:] for o in outs2] if any(rcs2) else []}
        print(json.dumps(out["repair"], indent=1))
        checks.eq("fleet repair: exit 0", rcs2, [0] * len(nodes))
        checks.eq("fleet repair: merged into the ring's file", len(after["pairs"]) >= 2
                  and after["plan"] == "repair", True)
        s = serve_state(site, tmp, tmp / f"fleet-{nodes[0]}",
                        lambda s: bool(_labels(s, "gpunet_fleet_pair_success", "peer")))
        out["exported"] = {
            "peers": _labels(s, "gpunet_fleet_pair_success", "peer"),
            "transport": _labels(s, "gpunet_fleet_pair_info", "transport"),
            "bandwidth": {peer: pick(s, "gpunet_fleet_pair_bus_bandwidth_bytes_per_second",
                                     peer=peer)
                          for peer in _labels(s, "gpunet_fleet_pair_success", "peer")}}
        print(json.dumps(out["exported"], indent=1))
        checks.eq("fleet: node 0's exporter serves its peers", out["exported"]["peers"],
                  ring_peers[nodes[0]])
        # ring --hops 2 over four simulated nodes: three rounds, the pair workers kept
        four = [f"sim{i}" for i in range(4)]
        rcs3, outs3, wall3 = _fleet_run(site, tmp, four, ["--kind", "ring", "--hops", "2", "--",
                                                          "--no-skip-busy", *args.pair_args],
                                        prefix="hops2")
        summary3 = [json.loads(line) for line in outs3[0].splitlines() if line.startswith("{")]
        files3 = {}
        for n in four:
            try:
                files3[n] = json.loads((tmp / f"hops2-{n}" / "pairs.json").read_text())
            except (OSError, ValueError):
                files3[n] = {}
        timing = fleet_rounds(tmp, "hops2", summary3)
        out["ring_hops2"] = {"returncodes": rcs3, "wall_seconds": round(wall3, 1),
                             "rounds": len({s["round"] for s in summary3}), **timing,
                             "summary": summary3,
                             "logs": [o[-2000:] for o in outs3] if any(rcs3) else []}
        print("\n== ring --hops 2 over 4 simulated nodes on one GPU, NCCL, pair workers kept")
        print(json.dumps({k: v for k, v in out["ring_hops2"].items() if k != "summary"},
                         indent=1))
        checks.eq("fleet ring --hops 2: every node exited 0", rcs3, [0] * len(four))
        pairs3 = [p for f in files3.values() for p in f.get("pairs", [])]
        checks.eq("fleet ring --hops 2: three pairs per node, every pair ok and measured",
                  [len(f.get("pairs", [])) for f in files3.values()] == [3] * 4
                  and all(p["ok"] and (p["bus_bandwidth_bytes_per_second"] or 0) > 0
                          for p in pairs3), True)
        checks.eq("fleet ring --hops 2: NCCL's transport recorded for every pair, kept workers "
                  "too (Socket)", sorted({str(p["transport"]) for p in pairs3}), ["Socket"])
        checks.eq("fleet ring --hops 2: one pair worker started per node for the pass",
                  timing["worker_starts"], dict.fromkeys(four, 1))
        median = timing["median_round_seconds"]
        print(f"\n   pair round time (s) per round: {timing['round_seconds']}, median {median}; "
              f"of which the all-reduces: {timing['measure_seconds_by_round']} "
              f"(run options {' '.join(args.pair_args) or 'default'})", flush=True)
        print(f"\n   pair round time (s) per round: {timing['round_seconds']}, median {median} "
              f"(ring over {len(nodes)}: {out['ring']['round_seconds']})", flush=True)
        checks.eq("fleet: pair round under 3 s (median round of ring --hops 2, seconds)",
                  median, "< 3", ok=median is not None and median < 3)
    return finish(out, checks, args.out, "fleet_check.json")


# -- fleet-yield: the fleet's kept pair workers beside a training job that starts mid-pass ---

def _worker_pids() -> set[int]:
    """The pair workers running on this machine (their command line names pair-worker)."""
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if b"pair-worker" in (d / "cmdline").read_bytes():
                    out.add(int(d.name))
            except OSError:
                continue
    return out


def _run_job(tmp: Path, name: str, seconds: float, env: dict[str, str]
             ) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp / f"job-{name}.json"
    log = (tmp / f"job-{name}.log").open("wb")
    # A session of its own, as a job started by a scheduler has: the fleet counts every
    # process of its own session as its own (docs/fleet.md), and this script's session would
    # otherwise hold both.
    return subprocess.Popen([sys.executable, str(JOB_SCRIPT), "--seconds", f"{seconds:g}",
                             "--out", str(out)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True), out


def fleet_yield(args: argparse.Namespace) -> int:
    """`gpunet-probe fleet` (ring --hops 2 over four simulated nodes on GPU 0, pairs long
    enough to be caught: 256 MiB the largest size) with the stand-in training job started on
    every GPU once the first pairs run: the kept workers must leave the GPUs within a poll of
    the job's first GPU process (0.5 s, the watch's period, plus nvidia-smi's own delay), no
    pair may fail (each is measured or not measured, busy), and the job's step time beside the
    fleet must match the job alone."""
    checks = Checks(("fleet", "expected"))
    out: dict[str, Any] = {"nvidia_smi": sh("nvidia-smi", "-L")}
    env = {**os.environ, **NCCL_SAFE}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        site = install(tmp)
        job, job_out = _run_job(tmp, "alone", args.job_seconds, env)
        job.wait(timeout=args.job_seconds + JOB_START_SECONDS)
        alone = json.loads(job_out.read_text())
        four = [f"sim{i}" for i in range(4)]
        port, pair_port = free_port(), free_port()
        procs = []
        for rank, node in enumerate(four):
            penv = {**env, "PYTHONPATH": str(site), "NCCL_HOSTID": f"sim-{node}",
                    "SLURM_PROCID": str(rank), "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "gpunet_exporter.probe.cli", "fleet", "--state-dir",
                 str(tmp / f"yield-{node}"), "--node-name", node, "--port", str(pair_port),
                 "--kind", "ring", "--hops", "2", "--pair-timeout", "120", "--",
                 "--no-skip-busy", "--sizes", "8KiB,1MiB,256MiB", "--iterations", "20"],
                env=penv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))  # as srun starts each task

        def pairs_running() -> bool:
            return any("group up in" in p.read_text(errors="replace")
                       for p in tmp.glob("yield-*/fleet/*/probe.log"))

        deadline = time.monotonic() + 120
        while not pairs_running() and time.monotonic() < deadline:
            time.sleep(0.1)
        started = time.time()
        job, job_out = _run_job(tmp, "beside", args.job_seconds, env)
        first_job_gpu = gone = None
        seen_workers: set[int] = set()
        while time.monotonic() < deadline + 60:
            apps = set(smi_app_memory())
            workers = _worker_pids()
            seen_workers |= workers & apps
            foreign = apps - workers
            now = time.time()
            if first_job_gpu is None and foreign:
                first_job_gpu = now
            if first_job_gpu is not None and not (workers & apps):
                gone = now
                break
            time.sleep(0.05)
        fleet_outs = [p.communicate(timeout=600)[0] for p in procs]
        job.wait(timeout=args.job_seconds + JOB_START_SECONDS)
        beside = json.loads(job_out.read_text())
        files = {n: json.loads((tmp / f"yield-{n}" / "pairs.json").read_text()) for n in four}
        got = [p for f in files.values() for p in f["pairs"]]
        skipped = sorted({str(p.get("skipped")) for p in got if p.get("skipped")})
        failed = [p for p in got if not p["ok"] and not p.get("skipped")]
        skip = 5
        a, b = summary(alone["step_ms"], skip), summary(beside["step_ms"], skip)
        out["yield"] = {
            "job_started_unix": round(started, 3),
            "job_first_gpu_process_to_workers_off_gpu_s":
                None if first_job_gpu is None or gone is None else round(gone - first_job_gpu, 3),
            "workers_seen_on_gpu": sorted(seen_workers), "skipped": skipped,
            "pairs": len(got), "failed": len(failed), "returncodes": [p.returncode for p in procs],
            "job_alone": a, "job_beside": b,
            "fleet_tail": [o[-1500:] for o in fleet_outs] if any(p.returncode for p in procs)
            else []}
        print(json.dumps(out["yield"], indent=1))
        y = out["yield"]["job_first_gpu_process_to_workers_off_gpu_s"]
        checks.eq("fleet-yield: a kept worker was on the GPU when the job came", bool(
            seen_workers), True)
        checks.eq("fleet-yield: workers off the GPU within 1.5 s of the job's first GPU process",
                  y, "<= 1.5", ok=y is not None and y <= 1.5)
        checks.eq("fleet-yield: every node exited 0", out["yield"]["returncodes"], [0] * 4)
        checks.eq("fleet-yield: no pair failed (measured, or not measured: busy)", len(failed), 0)
        checks.eq("fleet-yield: pairs not measured because of the job", bool(
            {"busy", "peer_busy"} & set(skipped)), True)
        ratio = (b["median_ms"] or 0) / (a["median_ms"] or 1)
        checks.eq("fleet-yield: the job's median step beside the fleet within 10% of alone",
                  round(ratio, 3), "0.9 to 1.1", ok=0.9 <= ratio <= 1.1)
    return finish(out, checks, args.out, "fleet_yield_check.json")


# -- ras: NCCL's RAS service, captured and read live ---------------------------------------------

RAS_JOB = """
import os, signal, sys, time, torch, torch.distributed as dist
stuck = False
def on_usr1(*_):
    global stuck
    stuck = True
signal.signal(signal.SIGUSR1, on_usr1)
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda:0"))
x = torch.ones(1 << 16, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
print("ready", torch.cuda.nccl.version(), flush=True)
i = 0
while True:
    if stuck:  # alive (RAS answers) but launching nothing more: the others wait for it
        print("stuck at", i, flush=True)
        while True:
            time.sleep(3600)
    dist.all_reduce(x)
    i += 1
    if i % 20 == 0:
        torch.cuda.synchronize()
        time.sleep(0.005)
"""
# job -> (RAS port, what happens to rank 1). 28028 is NCCL's default: job A sets no NCCL_RAS_ADDR.
RAS_JOBS = {"A": (28028, "stuck"), "B": (28029, "sigstop"), "C": (28030, "sigkill"),
            "D": (28032, "sigkill")}
# PyTorch's watchdog takes a process down when a peer's connection breaks (job D shows it: its
# port goes quiet); job C turns that off so that its rank 0 lives on and RAS reports the dead one.
RAS_KEEP_ALIVE = {"C"}
RAS_IDLE_PORT = 28031


def ras_converse(port: int, commands: list[str], timeout: float = 8) -> dict[str, Any]:
    """One raw conversation: each command sent after the answer to the one before (STATUS: the
    rest until the server closes). Every chunk received is kept with its time, for replay."""
    import socket
    rec: dict[str, Any] = {"port": port, "commands": commands, "chunks": [], "outcome": ""}
    start = time.monotonic()
    try:
        sock = socket.create_connection(("127.0.0.1", port), timeout=3)
    except OSError as exc:
        rec["outcome"] = f"connect: {exc!r}"
        return rec
    with sock:
        buf = b""
        for cmd in commands:
            sock.sendall(cmd.encode() + b"\n")
            rec["chunks"].append({"t": round(time.monotonic() - start, 4), "sent": cmd})
            last = cmd.upper().endswith("STATUS")
            while True:
                if not last and b"\n" in buf:
                    buf = buf.split(b"\n", 1)[1]
                    break
                sock.settimeout(max(0.01, start + timeout - time.monotonic()))
                try:
                    data = sock.recv(65536)
                except (TimeoutError, OSError) as exc:
                    rec["outcome"] = f"no answer to {cmd!r} after " \
                        f"{time.monotonic() - start:.1f} s: {exc!r}"
                    return rec
                if not data:
                    rec["outcome"] = "closed" if last else f"closed after {cmd!r}"
                    rec["seconds"] = round(time.monotonic() - start, 3)
                    if not last:
                        return rec
                    break
                rec["chunks"].append({"t": round(time.monotonic() - start, 4),
                                      "data": data.decode("utf-8", "replace")})
                buf += data
            if last:
                break
    return rec


def ras(args: argparse.Namespace) -> int:
    checks = Checks()
    out: dict[str, Any] = {"nvidia_smi": sh("nvidia-smi", "-L"), "captures": {}, "scrapes": {}}
    base_env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1", "NCCL_DEBUG": "INFO",
                "NCCL_DEBUG_SUBSYS": "INIT,RAS", "MASTER_ADDR": "127.0.0.1",
                "WORLD_SIZE": "2", "LOCAL_RANK": "0", "PYTHONUNBUFFERED": "1"}
    logs = Path(tempfile.mkdtemp(prefix="ras-nccl-logs-"))
    procs: dict[tuple[str, int], subprocess.Popen[str]] = {}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        site = install(tmp)
        sys.path.insert(0, str(site))
        from gpunet_exporter.sources import ras as ras_src
        for job, (port, _) in RAS_JOBS.items():
            mport = free_port()
            for rank in (0, 1):
                env = {**base_env, "MASTER_PORT": str(mport), "RANK": str(rank),
                       "NCCL_HOSTID": f"ras-{job}-{rank}",
                       "NCCL_DEBUG_FILE": str(logs / f"{job}{rank}.%p.log")}
                if port != 28028:
                    env["NCCL_RAS_ADDR"] = f"localhost:{port}"
                if job in RAS_KEEP_ALIVE:
                    env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
                procs[(job, rank)] = subprocess.Popen(
                    [sys.executable, "-c", RAS_JOB], env=env, stdout=subprocess.PIPE, text=True)
        cfg = tmp / "nccl.yml"
        ports = [p for p, _ in RAS_JOBS.values()] + [RAS_IDLE_PORT]
        cfg.write_text("nccl:\n  interval_seconds: 2\n  per_communicator: true\n  ports: [" +
                       ", ".join(map(str, ports)) + "]\n")
        eport = free_port()
        exp = subprocess.Popen(
            [sys.executable, "-m", "gpunet_exporter", f"--web.listen-address=127.0.0.1:{eport}",
             "--collector.disable-defaults", "--collector.nccl", f"--config.file={cfg}",
             "--no-hotplug", "--log.level=debug"],
            env={**os.environ, "PYTHONPATH": str(site)}, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{eport}/metrics"
        t0 = time.monotonic()

        def snap(phase: str) -> dict[Any, float]:
            s = scrape(url)
            out["scrapes"][phase] = {f"{n}{dict(sorted(lbl))}": v for (n, lbl), v in s.items()
                                     if n.startswith("gpunet_nccl_")}
            return s

        def capture(phase: str) -> None:
            for job, (port, _) in RAS_JOBS.items():
                for name, cmds in (("json", ["CLIENT PROTOCOL 2", "SET FORMAT json", "STATUS"]),
                                   ("text", ["CLIENT PROTOCOL 2", "STATUS"])):
                    tries = []
                    for _ in range(4):  # SO_REUSEPORT: another connection, maybe another process
                        rec = ras_converse(port, cmds)
                        tries.append(rec)
                        if rec["outcome"] == "closed":
                            break
                    out["captures"][f"{phase}/{job}/{name}"] = tries
                    print(f"[{time.monotonic() - t0:6.1f}s] {phase} {job} {name}: "
                          f"{[t['outcome'] for t in tries]}", flush=True)

        try:
            for (job, rank), pr in procs.items():
                assert pr.stdout is not None
                line = pr.stdout.readline()
                print(f"job {job} rank {rank}: {line.strip()!r}", flush=True)
                checks.eq(f"job {job} rank {rank} ready", line.startswith("ready"), True)
            out["nccl_version"] = line.split()[-1] if line else ""
            snap("start")  # the first scrape starts the collector's background rounds
            time.sleep(5)
            capture("healthy")
            out["captures"]["healthy/A/verbose"] = [ras_converse(
                28028, ["CLIENT PROTOCOL 2", "VERBOSE STATUS"])]
            out["captures"]["healthy/A/errors"] = [ras_converse(
                28028, ["CLIENT PROTOCOL 2", "SET FORMAT xml", "TIMEOUT x", "FOO"])]
            time.sleep(5)
            s = snap("healthy")
            for job, (port, _) in RAS_JOBS.items():
                p = str(port)
                checks.eq(f"{job} healthy: query success", pick(
                    s, "gpunet_nccl_ras_query_success", port=p), 1.0)
                checks.eq(f"{job} healthy: listeners", pick(
                    s, "gpunet_nccl_ras_listeners", port=p), 2.0)
                checks.eq(f"{job} healthy: a running communicator", pick(
                    s, "gpunet_nccl_communicators", port=p, status="running"), 1.0)
                checks.eq(f"{job} healthy: answering processes", pick(
                    s, "gpunet_nccl_job_processes", port=p, state="answering"), 2.0)
                checks.eq(f"{job} healthy: stalled ranks", pick(
                    s, "gpunet_nccl_stalled_ranks", port=p), 0.0)
                checks.eq(f"{job} healthy: missing ranks", pick(
                    s, "gpunet_nccl_communicator_ranks", port=p, state="missing"), 0.0)
            checks.eq("idle port: listeners", pick(
                s, "gpunet_nccl_ras_listeners", port=str(RAS_IDLE_PORT)), 0.0)
            checks.eq("idle port: no query", pick(
                s, "gpunet_nccl_ras_query_success", port=str(RAS_IDLE_PORT)), None)
            for job, (_, fault) in RAS_JOBS.items():
                pid = procs[(job, 1)].pid
                os.kill(pid, {"stuck": signal.SIGUSR1, "sigstop": signal.SIGSTOP,
                              "sigkill": signal.SIGKILL}[fault])
            fault = time.monotonic()
            out["fault_at"] = round(fault - t0, 1)
            for phase, at in (("fault+5s", 5), ("fault+30s", 30), ("fault+75s", 75)):
                time.sleep(max(0.0, fault + at - time.monotonic()))
                capture(phase)
                snap(phase)
            s = snap("end")
            checks.eq("A stuck: stalled ranks", (pick(
                s, "gpunet_nccl_stalled_ranks", port="28028") or 0) >= 1, True)
            checks.eq("A stuck: no missing rank", pick(
                s, "gpunet_nccl_communicator_ranks", port="28028", state="missing"), 0.0)
            for job in ("B", "C"):
                p = str(RAS_JOBS[job][0])
                checks.eq(f"{job}: a dead process", pick(
                    s, "gpunet_nccl_job_processes", port=p, state="dead"), 1.0)
                checks.eq(f"{job}: a dead rank", pick(
                    s, "gpunet_nccl_missing_ranks", port=p, reason="dead"), 1.0)
            checks.eq("B: listeners (the stopped one too)", pick(
                s, "gpunet_nccl_ras_listeners", port="28029"), 2.0)
            checks.eq("D: the job is gone", pick(
                s, "gpunet_nccl_ras_listeners", port="28032"), 0.0)
            # nccl.per_communicator: job A's one communicator, by its hash, with the stuck rank.
            stalled = {dict(lbl)["communicator"]: v for (n, lbl), v in s.items()
                       if n == "gpunet_nccl_communicator_stalled_ranks"
                       and dict(lbl)["port"] == "28028"}
            out["per_communicator_A"] = stalled
            checks.eq("A per communicator: one, stalled 1", list(stalled.values()), [1.0])
            checks.eq("A per communicator: labelled by its hash", all(
                c.startswith("0x") for c in stalled), True)
            # The doctor on the same jobs: their trouble as findings, each job as a note, and
            # an exit code that a job's trouble does not set (GPU checks only).
            doc = subprocess.run(
                [sys.executable, "-m", "gpunet_exporter", "doctor", "--json", "--state-file=",
                 "--interval", "1", "--collector.disable-defaults", "--collector.nccl",
                 "--collector.gpu", f"--config.file={cfg}"],
                env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True,
                timeout=180)
            out["doctor"] = {"rc": doc.returncode, "stdout": doc.stdout[-6000:],
                             "stderr": doc.stderr[-2000:]}
            try:
                result = json.loads(doc.stdout)
            except ValueError:
                result = {}
            found = {(f["alert"], f["where"]) for f in result.get("findings", [])}
            for alert, port in (("GpunetNcclRankStalled", 28028), ("GpunetNcclRankDead", 28029),
                                ("GpunetNcclRankDead", 28030)):
                checks.eq(f"doctor: {alert} on {port}",
                          (alert, f"NCCL job on RAS port {port}") in found, True)
            notes = {n["where"] for n in result.get("notes", [])}
            checks.eq("doctor: jobs A, B and C described", {
                f"NCCL job on RAS port {p}" for p in (28028, 28029, 28030)} <= notes, True)
            checks.eq("doctor: a job's trouble leaves the exit code alone",
                      doc.returncode != 1 or any(f["cause"] != "nccl_job" for f in
                                                 result.get("findings", [])), True)
            s5 = out["scrapes"]["fault+5s"]
            out["at_fault+5s"] = {k: v for k, v in s5.items() if "28029" in k or "28030" in k}
            out["unanswered"] = {p: pick(s, "gpunet_nccl_ras_unanswered_connections_total",
                                         port=str(p)) for p in ports}
            for key, tries in out["captures"].items():
                for rec in tries:
                    if rec["outcome"] != "closed" or "STATUS" not in rec["commands"][-1]:
                        continue
                    last = max(i for i, c in enumerate(rec["chunks"]) if "sent" in c)
                    body = "".join(c.get("data", "") for c in rec["chunks"][last + 1:])
                    try:
                        (ras_src.parse_json if key.endswith("json") else
                         ras_src.parse_text)(body)
                        ok = True
                    except ValueError as exc:
                        ok = False
                        print(key, "does not parse:", exc)
                    checks.eq(f"{key} parses", ok, True)
        finally:
            for pr in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pr.pid, signal.SIGCONT)
                pr.kill()
                pr.wait(timeout=30)
            exp.terminate()
            _, err = exp.communicate(timeout=10)
            out["exporter_log_tail"] = err.splitlines()[-60:]
            if args.out:  # one file: the device tool brings back only a few
                Path(args.out).mkdir(parents=True, exist_ok=True)
                with open(Path(args.out) / "ras_nccl.log", "w") as fh:
                    for log in sorted(logs.iterdir()):
                        fh.write(f"==> {log.name} <==\n{log.read_text(errors='replace')}\n")
    return finish(out, checks, args.out, "ras_check.json")


# -- job: the probe beside a training job (issue 31) ---------------------------------------------

JOB_SCRIPT = REPO / "bench" / "standin_job.py"
# Everything here that runs NCCL (the stand-in job, the exporter's runner and its ranks).
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}
# gpunet_probe_failures_total reasons that must not rise because the probe yields to a job.
# skipped_busy too: the node's own ranks judge busy GPUs by processes alone, and the exporter
# runs them on idle GPUs only (4 H100s, before that: one round per scope skipped its large sizes
# on the probe's other scope's utilization). A round a job's arrival cut short is the yield's
# and counts nothing (probe/supervisor.py, SKIP_GRACE).
YIELD_BAD_REASONS = ("crash", "init_error", "timeout", "nccl_error", "skipped_busy")
JOB_START_SECONDS = 180  # a job's start (spawn, CUDA, NCCL, warm-up) and end, at most
HOLDOFF_SLACK = 2.0  # the exporter sees the GPUs' processes a poll later or earlier than we do
VERSIONS = """
import json, torch
v = torch.cuda.nccl.version()
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "nccl": ".".join(map(str, v)) if isinstance(v, tuple) else str(v)}))
"""

Sink = dict[str, list[dict[str, Any]]]


def compare(value: float, alone: list[float], tolerance: float) -> dict[str, Any]:
    """``value`` against the job-alone runs' mean: the ratio, the alone runs' own spread
    ((max - min) / mean), the tolerance applied (``tolerance`` or that spread, the larger) and
    whether the ratio is within it (and within ``tolerance`` alone: ``strict_ok``)."""
    base = statistics.fmean(alone)
    spread = (max(alone) - min(alone)) / base if len(alone) > 1 else 0.0
    ratio = value / base
    applied = max(tolerance, spread)
    return {"ratio": ratio, "alone_spread": spread, "tolerance": applied,
            "ok": abs(ratio - 1) <= applied, "strict_ok": abs(ratio - 1) <= tolerance}


def collapse(seq: list[Any]) -> list[Any]:
    """``seq`` without consecutive repeats."""
    return [x for i, x in enumerate(seq) if i == 0 or x != seq[i - 1]]


def total(s: dict[Any, float], name: str) -> float | None:
    """The sum of a metric's samples over all their labels; None when it has none."""
    values = [v for (n, _), v in s.items() if n == name]
    return sum(values) if values else None


def probe_view(s: dict[Any, float]) -> dict[str, Any]:
    """The probe's state metrics of one scrape; a missing metric is None (the state: a text
    saying what is wrong), never an exception."""
    ones = [dict(lbl).get("state", "") for (n, lbl), v in s.items()
            if n == "gpunet_probe_state" and v == 1]
    present = any(n == "gpunet_probe_state" for (n, _) in s)
    if len(ones) == 1:
        state = ones[0]
    elif ones:
        state = "several: " + ",".join(sorted(ones))
    else:
        state = "no state is 1" if present else "gpunet_probe_state absent"
    return {
        "state": state,
        "state_since": pick(s, "gpunet_probe_state_since_timestamp_seconds"),
        "idle_since": pick(s, "gpunet_probe_idle_since_timestamp_seconds"),
        "foreign": total(s, "gpunet_probe_foreign_processes"),
        "yields": total(s, "gpunet_probe_yields_total"),
        "running": pick(s, "gpunet_probe_runner_running"),
        "last_success": {dict(lbl).get("scope", ""): v for (n, lbl), v in s.items()
                         if n == "gpunet_probe_last_success_timestamp_seconds"},
        "failures": {f"{dict(lbl).get('scope', '')}/{dict(lbl).get('reason', '')}": v
                     for (n, lbl), v in s.items() if n == "gpunet_probe_failures_total"},
    }


def complete_round(view: dict[str, Any], scopes: list[str], after: float) -> float | None:
    """When the round that completed every scope after ``after`` ended (the latest of their
    last-success times), or None while a scope has none newer."""
    times = [view.get("last_success", {}).get(s) for s in scopes]
    if not times or any(t is None or t <= after for t in times):
        return None
    return max(t for t in times if t is not None)


def failure_increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters of ``after`` that rose over ``before`` (a missing counter is 0)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())
            if v > before.get(k, 0.0)}


def _pdeathsig() -> Any:
    """A preexec_fn: the child is killed when this script dies (PR_SET_PDEATHSIG), so that
    nothing outlives a run killed from outside; None where prctl is not there."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG


class Nvml:
    """The GPUs' compute processes through NVML (this process makes no CUDA context)."""

    def __init__(self) -> None:
        import pynvml
        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]

    def processes(self) -> list[tuple[int, int, int | None]]:
        """(GPU index, PID, bytes or None) of every compute process on every GPU."""
        out = []
        for i, h in enumerate(self.handles):
            for p in self.nv.nvmlDeviceGetComputeRunningProcesses(h):
                used = p.usedGpuMemory
                out.append((i, int(p.pid), None if used is None else int(used)))
        return out

    def free_mib(self) -> list[int]:
        return [int(self.nv.nvmlDeviceGetMemoryInfo(h).free) // MIB for h in self.handles]

    def info(self) -> dict[str, Any]:
        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)
        return {"driver": text(self.nv.nvmlSystemGetDriverVersion()),
                "gpus": [text(self.nv.nvmlDeviceGetName(h)) for h in self.handles],
                "gpu_count": len(self.handles)}


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _starttime(pid: int) -> str | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


class Owners:
    """Whose a GPU process is: "probe" (the exporter's tree or a session one of its processes
    leads: the runner's, which its workers share), "job" (the stand-in job's), "other", or
    "gone" (no such PID here: exited, or in a PID namespace this script cannot see).
    ``leaders`` keeps each such session's leader with its start time, for the final cleanup."""

    def __init__(self) -> None:
        self.roots: dict[int, str] = {}
        self.sessions: dict[int, str] = {}
        self.leaders: dict[int, str | None] = {}

    def _session(self, sid: int, owner: str) -> None:
        self.sessions[sid] = owner
        self.leaders.setdefault(sid, _starttime(sid))

    def add(self, pid: int, owner: str) -> None:
        self.roots[pid] = owner
        with contextlib.suppress(OSError):
            self._session(os.getsid(pid), owner)

    def of(self, pid: int) -> str:
        try:
            sid = os.getsid(pid)
        except OSError:
            return "gone"
        if sid in self.sessions:
            return self.sessions[sid]
        p = pid
        for _ in range(64):
            if p in self.roots:
                self._session(sid, self.roots[p])
                return self.roots[p]
            try:
                p = _ppid(p)
            except (OSError, ValueError, IndexError):
                break
            if p <= 1:
                break
        return "other"


def _tail(path: Path, n: int = 30) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _first(times: Any) -> float | None:
    return next(iter(times), None)


class JobBench:
    """The scenarios of ``job``: the stand-in job alone, the probe first then the job, the
    job first then the exporter. Every process it starts is in a session of its own, killed
    (with every process group under it) at the end, failure or not."""

    def __init__(self, args: argparse.Namespace, tmp: Path, site: Path, checks: Checks) -> None:
        self.args, self.tmp, self.site, self.checks = args, tmp, site, checks
        self.nv = Nvml()
        self.owners = Owners()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stopped: set[int] = set()
        self.gone: dict[int, int] = {}  # PIDs NVML listed that are not here: polls
        self.ngpu = len(self.nv.handles)
        self.scopes = ["intra", "net"] if self.ngpu >= 2 else ["net"]
        self.started = time.monotonic()
        self.t0 = time.time()
        self.env = {**os.environ, **NCCL_SAFE, "PYTHONUNBUFFERED": "1"}
        self.preexec = _pdeathsig()
        self.init_round: float | None = None  # the probe's start to a complete round, measured

    # -- plumbing ----------------------------------------------------------------------------

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.started:6.1f}s] {msg}",
              flush=True)

    def rel(self, t: float | None) -> float | None:
        return None if t is None else round(t - self.t0, 2)

    def popen(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(log, "wb") as fh:
            p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=fh,
                                 stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                 preexec_fn=self.preexec)
        self.procs.append(p)
        return p

    def stop(self, p: subprocess.Popen[bytes], grace: float = 20.0) -> int | None:
        """SIGTERM to the process's group, then SIGKILL to it and to every process group under
        it (the exporter's runner has its own); the exit status. Once per process."""
        if p.pid in self.stopped:
            return p.returncode
        self.stopped.add(p.pid)
        groups = {p.pid}
        for pid in process_tree(p.pid):
            with contextlib.suppress(OSError):
                groups.add(os.getpgid(pid))
        groups.discard(os.getpgid(0))
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)
        for g in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=10)
        return p.returncode

    def cleanup(self) -> None:
        for p in self.procs:
            self.stop(p, grace=5.0)
        own = os.getpgid(0)
        for sid, started in self.owners.leaders.items():  # a runner left over, say
            if sid != own and started is not None and _starttime(sid) == started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(sid, signal.SIGKILL)

    def poll(self) -> dict[str, Any]:
        rec: dict[str, Any] = {"t": time.time(), "probe": {}, "job": {}, "other": {},
                               "gone": []}
        try:
            procs = self.nv.processes()
        except self.nv.nv.NVMLError as exc:
            rec["error"] = str(exc)
            return rec
        for gpu, pid, used in procs:
            owner = self.owners.of(pid)
            if owner == "gone":
                rec["gone"].append(pid)
                self.gone[pid] = self.gone.get(pid, 0) + 1
            elif owner == "other":
                rec["other"].setdefault(gpu, []).append(pid)
            else:
                mib = -1 if used is None else used // MIB  # -1: NVML does not say
                have = rec[owner].get(gpu, 0)
                rec[owner][gpu] = -1 if -1 in (mib, have) else have + mib
        return rec

    def scrape(self, url: str) -> dict[str, Any]:
        t = time.time()
        try:
            s = scrape(url)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return {"t": t, "ok": False, "error": repr(exc)[:200]}
        return {"t": t, "ok": True, **probe_view(s)}

    def watch(self, sink: Sink, until: Any, timeout: float, url: str | None = None,
              scrape_every: float = 1.0, each_second: Any = None, label: str = "") -> bool:
        """Poll the GPUs every --poll seconds (and scrape ``url`` every ``scrape_every``) into
        ``sink`` until ``until()`` or ``timeout``; whether ``until()`` came true."""
        deadline = time.monotonic() + timeout
        next_scrape = next_second = next_report = 0.0
        while True:
            tick = time.monotonic()
            sink["polls"].append(self.poll())
            if url and tick >= next_scrape:
                next_scrape = tick + scrape_every
                sink["scrapes"].append(self.scrape(url))
            if each_second is not None and tick >= next_second:
                next_second = tick + 1.0
                each_second()
            if label and tick >= next_report:
                next_report = tick + 10.0
                self.report(label, sink)
            if until():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(max(0.0, tick + self.args.poll - time.monotonic()))

    def report(self, label: str, sink: Sink) -> None:
        p = sink["polls"][-1]
        s = next((x for x in reversed(sink["scrapes"]) if x["ok"]), None)
        text = (f"{label}: GPUs with probe {sorted(p['probe'])} job {sorted(p['job'])}"
                + (f" other {sorted(p['other'])}" if p["other"] else ""))
        if s is not None:
            text += (f"; state {s['state']}, foreign {s['foreign']}, yields {s['yields']}, "
                     f"runner {s['running']}")
        self.log(text)

    def complete(self, sink: Sink, after: float) -> float | None:
        s = next((x for x in reversed(sink["scrapes"]) if x["ok"]), None)
        return None if s is None else complete_round(s, self.scopes, after)

    def start_job(self, name: str, seconds: float, reserve: int | None = None
                  ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        out, log = self.tmp / f"job-{name}.json", self.tmp / f"job-{name}.log"
        argv = [sys.executable, str(JOB_SCRIPT), "--seconds", f"{seconds:g}", "--out", str(out),
                "--matmuls", str(self.args.matmuls),
                "--warmup-steps", str(self.args.warmup_steps)]
        if reserve is not None:
            argv += ["--reserve-all-but", str(reserve)]
        p = self.popen(argv, log, self.env)
        self.owners.add(p.pid, "job")
        self.log(f"{name}: job started (pid {p.pid}): {' '.join(argv[1:])}")
        return p, out, log

    def start_exporter(self, name: str) -> tuple[subprocess.Popen[bytes], str, Path, Path]:
        a = self.args
        state = self.tmp / f"state-{name}"
        cfg = self.tmp / f"{name}.yml"
        cfg.write_text(f"probe:\n  state_dir: {json.dumps(str(state))}\n"
                       f"  interval_seconds: {a.interval:g}\n  holdoff_seconds: {a.holdoff:g}\n")
        port = free_port()
        log = self.tmp / f"exporter-{name}.log"
        p = self.popen([sys.executable, "-m", "gpunet_exporter",
                        f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                        "--collector.gpu", "--collector.probe", f"--config.file={cfg}"],
                       log, {**self.env, "PYTHONPATH": str(self.site)})
        self.owners.add(p.pid, "probe")
        self.log(f"{name}: exporter started (pid {p.pid}), probe interval {a.interval:g} s, "
                 f"hold-off {a.holdoff:g} s, scopes {self.scopes}")
        return p, f"http://127.0.0.1:{port}/metrics", state, log

    def exited(self, name: str, exp: subprocess.Popen[bytes]) -> None:
        """A failed check when the exporter is no longer running."""
        rc = exp.poll()
        if rc is not None:
            self.log(f"{name}: the exporter exited with status {rc}")
            self.checks.eq(f"{name}: the exporter keeps running", f"exited {rc}", "running",
                           False)

    def read_job(self, path: Path, log: Path) -> dict[str, Any]:
        try:
            job: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            return {"missing": f"{path.name}: {exc}", "log_tail": _tail(log)}
        if job.get("error"):
            job["log_tail"] = _tail(log)
        return job

    def job_summary(self, job: dict[str, Any], after: float | None = None) -> dict[str, Any]:
        """The job's times, versions and rank 0's step statistics (after warm-up; with
        ``after``, also those of the steps that started after that time)."""
        ms, starts = job.get("step_ms", []), job.get("step_start_unix", [])
        skip = self.args.warmup_steps
        out = {k: job.get(k) for k in ("world_size", "error", "missing", "versions",
                                       "log_tail") if job.get(k)}
        out |= {k: self.rel(job.get(k)) for k in ("first_alloc_unix", "ready_unix", "end_unix")}
        out["stats"] = summary(ms, skip)
        out["ranks"] = [{k: r.get(k) for k in ("rank", "steps", "median_ms", "p99_ms",
                                               "context_seconds", "stopped_by", "reserve",
                                               "missing") if k in r}
                        for r in job.get("ranks", [])]
        kept = sorted(zip(ms[skip:], starts[skip:], strict=False), reverse=True)[:20]
        out["slowest_steps"] = [[self.rel(t), round(m, 3)] for m, t in kept]
        if after is not None:
            late = [m for m, t in zip(ms[skip:], starts[skip:], strict=False) if t >= after]
            out["stats_after_probe_left"] = summary(late, 0)
            out["steps_while_probe_on_gpus"] = sum(1 for t in starts[skip:] if t < after)
        return out

    def timeline(self, sink: Sink) -> dict[str, list[Any]]:
        """The polls where what is on the GPUs changed, and the scrapes where the probe's state
        changed (times from the start of the run)."""
        polls, last = [], None
        for p in sink["polls"]:
            sig = (sorted(p["probe"]), sorted(p["job"]), sorted(p["other"]), bool(p["gone"]),
                   p.get("error"))
            if sig != last:
                polls.append({"t": self.rel(p["t"]), **{k: p[k] for k in (
                    "probe", "job", "other", "gone", "error") if p.get(k)}})
                last = sig
        scrapes, prev = [], None
        for s in sink["scrapes"]:
            sig = (s.get("state"), s.get("running"), s.get("yields"), s.get("foreign"),
                   s.get("ok"))
            if sig != prev:
                scrapes.append({"t": self.rel(s["t"]), **{k: v for k, v in s.items()
                                                          if k != "t"}})
                prev = sig
        return {"polls": polls, "scrapes": scrapes}

    def wait_clean(self, label: str) -> None:
        """Until neither the probe nor a job is on a GPU (30 s at most: then a failed check)."""
        sink: Sink = {"polls": [], "scrapes": []}
        ok = self.watch(sink, lambda: not (sink["polls"][-1]["probe"]
                                           or sink["polls"][-1]["job"]), 30)
        if not ok:
            self.checks.eq(f"{label}: GPUs free of our processes afterwards",
                           self.timeline(sink)["polls"][-1:], "nothing", False)

    # -- scenarios ---------------------------------------------------------------------------

    def alone(self, name: str) -> dict[str, Any]:
        a = self.args
        self.log(f"{name}: the job alone for {a.job_seconds:g} s")
        proc, path, log = self.start_job(name, a.job_seconds)
        sink: Sink = {"polls": [], "scrapes": []}
        try:
            self.watch(sink, lambda: proc.poll() is not None, a.job_seconds + JOB_START_SECONDS,
                       label=name)
        finally:
            rc = self.stop(proc)
        res = self.job_summary(self.read_job(path, log))
        st = res["stats"]
        self.log(f"{name}: exit {rc}, {st['steps']} steps, median {_ms(st['median_ms'])} ms, "
                 f"p99 {_ms(st['p99_ms'])} ms")
        self.checks.eq(f"{name}: the job ran and finished (exit 0, steps recorded)",
                       (rc, st["steps"] > 0), (0, True))
        others = sorted({pid for p in sink["polls"] for pids in p["other"].values()
                         for pid in pids} | {-1 for p in sink["polls"] if p["probe"]})
        self.checks.eq(f"{name}: no other process on the GPUs while the job ran alone "
                       "(-1: the probe)", others, [])
        res["timeline"] = self.timeline(sink)
        self.wait_clean(name)
        return res

    def probe_first(self) -> dict[str, Any]:
        a, ck, name = self.args, self.checks, "probe-first"
        res: dict[str, Any] = {}
        exp, url, state, elog = self.start_exporter(name)
        t_exp = time.time()
        first: Sink = {"polls": [], "scrapes": []}
        during: Sink = {"polls": [], "scrapes": []}
        after: Sink = {"polls": [], "scrapes": []}
        rss: dict[str, Any] = {"peak_MB": 0.0, "processes_at_peak": 0, "largest_process_MB": 0.0,
                               "exporter_alone_MB": None}

        def sample_rss() -> None:  # the exporter, its runner and the runner's workers
            total, count, largest = tree_rss(exp.pid)
            if count == 1:
                rss["exporter_alone_MB"] = round(total / 1e6)
            if total / 1e6 > rss["peak_MB"]:
                rss["peak_MB"], rss["processes_at_peak"] = round(total / 1e6), count
            rss["largest_process_MB"] = max(rss["largest_process_MB"], round(largest / 1e6))

        job: dict[str, Any] = {}
        before: dict[str, Any] = {}
        t_last: float | None = None
        rc: int | None = None
        proc: subprocess.Popen[bytes] | None = None
        try:
            self.log(f"{name}: waiting for a complete round of {self.scopes} (hold-off "
                     f"{a.holdoff:g} s first)")
            self.watch(first, lambda: exp.poll() is not None
                       or self.complete(first, t_exp) is not None,
                       a.holdoff + a.round_timeout, url=url, scrape_every=0.5,
                       each_second=sample_rss, label=name)
            self.exited(name, exp)
            t_first = self.complete(first, t_exp)
            ck.eq(f"{name}: a complete round of every scope {self.scopes} after the start",
                  self.rel(t_first), f"within {a.holdoff + a.round_timeout:g} s",
                  t_first is not None)
            if t_first is None:
                return res  # (the finally block stops the exporter)
            self.init_round = max(0.0, t_first - t_exp - a.holdoff)
            res["first_round_seconds_after_start"] = round(t_first - t_exp, 2)
            self.log(f"{name}: complete round {t_first - t_exp:.1f} s after the start")
            # A few more seconds: the probe's memory between rounds, and where it is now.
            self.watch(first, lambda: False, 3.0, url=url, scrape_every=0.5,
                       each_second=sample_rss)
            mem = [max((p["probe"].get(g, 0) for p in first["polls"]), default=0)
                   for g in range(self.ngpu)]
            res["probe_gpu_memory_peak_mib"] = mem
            res["probe_gpu_memory_now_mib"] = [first["polls"][-1]["probe"].get(g, 0)
                                              for g in range(self.ngpu)]
            res["host_rss"] = rss
            t_on = _first(p["t"] for p in first["polls"] if p["probe"])
            ck.eq(f"{name}: the probe stays off the GPUs for the hold-off after the start",
                  None if t_on is None else round(t_on - t_exp, 1),
                  f">= {a.holdoff - HOLDOFF_SLACK:g} s",
                  t_on is not None and t_on - t_exp >= a.holdoff - HOLDOFF_SLACK)
            view = next((s for s in reversed(first["scrapes"]) if s["ok"]), {})
            ck.eq(f"{name}: state measuring after the round", view.get("state"), "measuring")
            ck.eq(f"{name}: idle_since present while measuring",
                  self.rel(view.get("idle_since")), "present", view.get("idle_since") is not None)
            ck.eq(f"{name}: the probe holds memory on every GPU when the job starts (MiB)",
                  res["probe_gpu_memory_now_mib"], "all > 0",
                  all(m != 0 for m in res["probe_gpu_memory_now_mib"]))
            before = view
            # The job, while the probe holds the GPUs.
            proc, path, log = self.start_job(name, a.job_seconds)
            self.watch(during, lambda: proc.poll() is not None,
                       a.job_seconds + JOB_START_SECONDS, url=url,
                       scrape_every=a.scrape_interval, label=name)
            rc = self.stop(proc)
            job = self.read_job(path, log)
            t_last = max((p["t"] for p in during["polls"] if p["job"]), default=None)
            if t_last is not None:
                self.log(f"{name}: job gone from the GPUs (exit {rc}); waiting for the next "
                         "complete round")
                bound = a.holdoff + self.init_round + a.recovery_slack
                self.watch(after, lambda: exp.poll() is not None
                           or self.complete(after, t_last) is not None,
                           bound + 60, url=url, scrape_every=0.5, label=name)
            self.exited(name, exp)
        finally:
            if proc is not None:
                self.stop(proc)
            self.stop(exp)
            res["exporter_log_tail"] = _tail(elog)
            res["runner_log_tail"] = _tail(state / "runner.log")
            res["timeline"] = {"first_round": self.timeline(first),
                               "job": self.timeline(during), "after": self.timeline(after)}
        self.wait_clean(name)
        self.judge_yield(name, res, before, during, after, job, rc, t_last)
        return res

    def judge_yield(self, name: str, res: dict[str, Any], before: dict[str, Any], during: Sink,
                    after: Sink, job: dict[str, Any], rc: int | None,
                    t_last: float | None) -> None:
        """The checks of the probe-first scenario, once the job ran."""
        a, ck = self.args, self.checks
        polls = during["polls"] + after["polls"]
        scrapes = [s for s in during["scrapes"] + after["scrapes"] if s["ok"]]
        t_seen = _first(p["t"] for p in polls if p["job"])
        t_gone = None if t_seen is None else _first(
            p["t"] for p in polls if p["t"] >= t_seen and not p["probe"])
        res["job"] = self.job_summary(job, after=t_gone)
        ck.eq(f"{name}: the job ran and finished (exit 0)", rc, 0)
        ck.eq(f"{name}: the job appeared on the GPUs", self.rel(t_seen), "seen",
              t_seen is not None)
        if t_seen is None or t_last is None:
            return
        alloc = job.get("first_alloc_unix")
        res["yield_seconds_from_job_on_gpu"] = None if t_gone is None else round(
            t_gone - t_seen, 3)
        res["yield_seconds_from_job_first_allocation"] = None if t_gone is None or \
            alloc is None else round(t_gone - alloc, 3)
        ck.eq(f"{name}: the probe left every GPU within {a.yield_limit:g} s of the job's "
              "first appearance (s)", res["yield_seconds_from_job_on_gpu"],
              f"<= {a.yield_limit:g}", t_gone is not None and t_gone - t_seen <= a.yield_limit)
        if t_gone is None:
            return
        self.log(f"{name}: the probe left the GPUs {t_gone - t_seen:.2f} s after the job "
                 "appeared" + ("" if alloc is None else
                               f", {t_gone - alloc:.2f} s after its first allocation"))
        rest = [p for p in polls if t_gone < p["t"] <= t_last]
        on = [p for p in rest if p["probe"]]
        res["polls_while_yielded"] = len(rest)
        ck.eq(f"{name}: no probe process on any GPU at any poll while the job ran "
              "(polls with one / polls)", f"{len(on)}/{len(rest)}", f"0/{len(rest)}",
              not on and bool(rest))
        worst = max((m for p in rest for m in p["probe"].values()), default=0)
        ck.eq(f"{name}: the probe's GPU memory 0 MiB on every GPU at every poll (max MiB; "
              "-1: unknown)", worst, 0)
        window = [s for s in scrapes if t_gone + 0.5 <= s["t"] <= t_last - 1.5]
        states = sorted({s["state"] for s in window})
        ck.eq(f"{name}: state yielded at every scrape while the job ran ({len(window)} scrapes)",
              states, ["yielded"])
        ck.eq(f"{name}: idle_since absent while yielded", sorted(
            {s["idle_since"] is None for s in window}), [True])
        foreign = max((s["foreign"] for s in window if s["foreign"] is not None), default=None)
        ck.eq(f"{name}: foreign processes seen while the job ran (max)", foreign,
              f">= 1 (job ranks: {self.ngpu})", foreign is not None and foreign >= 1)
        last = scrapes[-1] if scrapes else {}
        y0, y1 = before.get("yields"), last.get("yields")
        ck.eq(f"{name}: gpunet_probe_yields_total rose (before, after)", [y0, y1], "+1 or more",
              y1 is not None and y1 - (y0 or 0) >= 1)
        rose = failure_increase(before.get("failures", {}), last.get("failures", {}))
        res["failures_increase"] = rose
        bad = {k: v for k, v in rose.items() if k.split("/")[-1] in YIELD_BAD_REASONS}
        ck.eq(f"{name}: no failures_total increase of {'/'.join(YIELD_BAD_REASONS)} "
              f"(all increases: {rose})", bad, {})
        self.judge_recovery(name, res, after, t_last, scrapes, polls)

    def judge_recovery(self, name: str, res: dict[str, Any], after: Sink, t_last: float,
                       scrapes: list[dict[str, Any]], polls: list[dict[str, Any]]) -> None:
        """After the job left the GPUs: hold-off, then a complete round within hold-off + the
        probe's start and round (as measured, else --init-round) + --recovery-slack."""
        a, ck = self.args, self.checks
        init = self.init_round if self.init_round is not None else a.init_round
        bound = a.holdoff + init + a.recovery_slack
        t_done = self.complete(after, t_last)
        res["recovery_seconds"] = None if t_done is None else round(t_done - t_last, 2)
        res["recovery_bound_seconds"] = round(bound, 1)
        ck.eq(f"{name}: next complete round after the job left (s; hold-off {a.holdoff:g} + "
              f"start and round {init:.1f} + slack {a.recovery_slack:g})",
              res["recovery_seconds"], f"<= {bound:.1f}",
              t_done is not None and t_done - t_last <= bound)
        seq = collapse([s["state"] for s in scrapes if s["t"] > t_last])
        while seq and seq[0] == "yielded":
            seq.pop(0)
        res["states_after_job"] = seq
        ck.eq(f"{name}: states after the job: holdoff then measuring", seq,
              ["holdoff", "measuring"])
        t_back = _first(p["t"] for p in polls if p["t"] > t_last and p["probe"])
        ck.eq(f"{name}: the probe stays off the GPUs for the hold-off after the job (s)",
              None if t_back is None else round(t_back - t_last, 2),
              f">= {a.holdoff - HOLDOFF_SLACK:g}",
              t_back is not None and t_back - t_last >= a.holdoff - HOLDOFF_SLACK)
        hold = next((s for s in scrapes if s["t"] > t_last and s["state"] == "holdoff"), {})
        meas = next((s for s in scrapes if s["t"] > t_last and s["state"] == "measuring"), {})
        idle = meas.get("idle_since")
        ck.eq(f"{name}: idle_since = the job's last sighting + hold-off (within 3 s; s after "
              "that sighting)", None if idle is None else round(idle - t_last, 2),
              f"{a.holdoff:g} +- 3", idle is not None and abs(idle - t_last - a.holdoff) <= 3)
        since = [hold.get("state_since"), meas.get("state_since")]
        got = [None if v is None or ref is None else round(v - ref, 2)
               for v, ref in zip(since, (t_last, idle), strict=True)]
        ck.eq(f"{name}: state_since of holdoff - the job's last sighting, of measuring - "
              "idle_since (s)", got, "0 +- 3 each",
              all(g is not None and abs(g) <= 3 for g in got))

    def job_first(self) -> dict[str, Any]:
        a, ck, name = self.args, self.checks, "job-first"
        res: dict[str, Any] = {}
        proc, path, log = self.start_job(name, a.beside_seconds + 600, reserve=a.reserve_mib)
        pre: Sink = {"polls": [], "scrapes": []}
        beside: Sink = {"polls": [], "scrapes": []}
        after: Sink = {"polls": [], "scrapes": []}

        def ready() -> bool:
            return proc.poll() is not None or any(
                line.startswith("ready") for line in _tail(log, 200))

        self.watch(pre, ready, JOB_START_SECONDS, label=name)
        up = proc.poll() is None and ready()
        ck.eq(f"{name}: the job is up and holds all but {a.reserve_mib} MiB", up, True)
        if not up:
            self.stop(proc)
            res["job"] = self.job_summary(self.read_job(path, log))
            res["job_log_tail"] = _tail(log)
            return res
        free = self.nv.free_mib()
        res["free_mib_after_reserve"] = free
        ck.eq(f"{name}: free memory per GPU at most {a.reserve_mib} + 128 MiB (MiB)", free,
              f"<= {a.reserve_mib + 128}", all(f <= a.reserve_mib + 128 for f in free))
        exp, url, state, elog = self.start_exporter(name)
        t_exp = time.time()
        rc = None
        t_last: float | None = None
        try:
            self.watch(beside, lambda: proc.poll() is not None, a.beside_seconds, url=url,
                       scrape_every=a.scrape_interval, label=name)
            alive = proc.poll() is None
            ck.eq(f"{name}: the job still runs after {a.beside_seconds:g} s beside the exporter",
                  alive, True)
            self.log(f"{name}: stopping the job (SIGTERM)")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            self.watch(beside, lambda: proc.poll() is not None, 60, url=url,
                       scrape_every=a.scrape_interval)
            rc = self.stop(proc)
            t_last = max((p["t"] for p in pre["polls"] + beside["polls"] if p["job"]),
                         default=None)
            if t_last is not None:
                init = self.init_round if self.init_round is not None else a.init_round
                self.log(f"{name}: job gone from the GPUs (exit {rc}); waiting for the next "
                         "complete round")
                self.watch(after, lambda: exp.poll() is not None
                           or self.complete(after, t_last) is not None,
                           a.holdoff + init + a.recovery_slack + 60, url=url, scrape_every=0.5,
                           label=name)
            self.exited(name, exp)
        finally:
            self.stop(proc)
            self.stop(exp)
            res["exporter_log_tail"] = _tail(elog)
            res["runner_log_tail"] = _tail(state / "runner.log")
            res["timeline"] = {"start": self.timeline(pre), "beside": self.timeline(beside),
                               "after": self.timeline(after)}
        self.wait_clean(name)
        job = self.read_job(path, log)
        res["job"] = self.job_summary(job)
        ck.eq(f"{name}: the job stopped cleanly on SIGTERM (exit 0)", rc, 0)
        if t_last is None:
            ck.eq(f"{name}: the job appeared on the GPUs", None, "seen", False)
            return res
        polls = beside["polls"] + after["polls"]
        scrapes = [s for s in beside["scrapes"] + after["scrapes"] if s["ok"]]
        during = [p for p in polls if p["t"] <= t_last]
        on = [p for p in during if p["probe"]]
        ck.eq(f"{name}: no probe process on any GPU at any poll beside the job "
              "(polls with one / polls)", f"{len(on)}/{len(during)}", f"0/{len(during)}",
              not on and bool(during))
        s_during = [s for s in scrapes if s["t"] <= t_last - 1.5]
        ck.eq(f"{name}: the exporter answered beside the job (scrapes)", len(s_during), "> 0",
              bool(s_during))
        failed = sorted({f"{k}={v:g}" for s in s_during for k, v in s["failures"].items() if v})
        ck.eq(f"{name}: gpunet_probe_failures_total all 0 beside the job", failed, [])
        states = sorted({s["state"] for s in s_during if s["t"] >= t_exp + 3})
        ck.eq(f"{name}: state yielded at every scrape beside the job (from 3 s after the "
              "start)", states, ["yielded"])
        early = sorted({s["state"] for s in s_during} & {"measuring", "failing"})
        ck.eq(f"{name}: never measuring or failing beside the job", early, [])
        running = sorted({str(s["running"]) for s in s_during})
        ck.eq(f"{name}: gpunet_probe_runner_running 0 or absent beside the job", running,
              "0 / None", all(s["running"] in (None, 0) for s in s_during))
        yields = sorted({str(s["yields"]) for s in s_during})
        ck.eq(f"{name}: gpunet_probe_yields_total 0 or absent (nothing was started to stop)",
              yields, "0 / None", all(s["yields"] in (None, 0) for s in s_during))
        foreign = max((s["foreign"] for s in s_during if s["foreign"] is not None), default=None)
        ck.eq(f"{name}: foreign processes seen beside the job (max)", foreign,
              f">= 1 (job ranks: {self.ngpu})", foreign is not None and foreign >= 1)
        self.judge_recovery(name, res, after, t_last, scrapes, polls)
        return res

    def versions(self) -> dict[str, Any]:
        out = self.nv.info()
        stderr = ""
        try:  # in a process of its own: this one makes no CUDA context
            r = subprocess.run([sys.executable, "-c", VERSIONS], capture_output=True, text=True,
                               timeout=180, env=self.env)
            stderr = r.stderr[-500:]
            out |= json.loads(r.stdout.strip().splitlines()[-1])
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
            out["torch_error"] = f"{exc!r} {stderr}"
        return out


def job(args: argparse.Namespace) -> int:
    checks = Checks(("got", "want"))
    out: dict[str, Any] = {"nvidia_smi": sh("nvidia-smi", "-L"), "args": vars(args)}
    print(out["nvidia_smi"], flush=True)
    def on_term(*_: Any) -> None:
        print("SIGTERM: stopping every process started here", flush=True)
        sys.exit(143)

    # SIGTERM (a timeout from outside) ends through the finally blocks: nothing left running.
    signal.signal(signal.SIGTERM, on_term)
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        bench = JobBench(args, tmp, install(tmp), checks)
        a = args
        est = (2 if a.repeat_alone else 1) * (a.job_seconds + 12) + \
            (a.holdoff + 25 + a.job_seconds + 12 + a.holdoff + 25) + \
            (12 + a.beside_seconds + 5 + a.holdoff + 25)
        bench.log(f"{bench.ngpu} GPU(s); scenarios: job alone, probe first, job first; "
                  f"about {est / 60:.1f} min")
        results: dict[str, Any] = {}
        try:
            out["versions"] = bench.versions()
            bench.log(f"versions: {out['versions']}")
            p = bench.poll()
            checks.eq("GPUs free at the start (no compute process)",
                      {k: p[k] for k in ("probe", "job", "other", "gone") if p[k]}, {})
            for key, run in (("alone", lambda: bench.alone("alone-1")),
                             ("probe_first", bench.probe_first),
                             ("alone_repeat", lambda: bench.alone("alone-2")),
                             ("job_first", bench.job_first)):
                if key == "alone_repeat" and not a.repeat_alone:
                    continue
                try:
                    results[key] = run()
                except Exception as exc:  # one scenario's bug or surprise: the others still run
                    import traceback
                    traceback.print_exc()
                    checks.eq(f"{key}: ran to the end", f"{type(exc).__name__}: {exc}",
                              "no exception", False)
        finally:
            bench.cleanup()
        stale = sorted(pid for pid, n in bench.gone.items() if n >= 5)
        checks.eq("every PID NVML listed was visible here (else: run in the host's PID "
                  "namespace; PIDs listed in 5 polls or more but not found)", stale, [])
        out |= results
        versions = out.get("versions", {})
        for res in results.values():  # what the job's rank 0 saw, where the probe run failed
            for k, v in (res.get("job", res).get("versions") or {}).items():
                versions.setdefault(k, v)
        out["summary"] = {"versions": versions, **summarize(bench, results, checks)}
    print("\n== summary")
    print(json.dumps(out["summary"], indent=1, default=str), flush=True)
    return finish(out, checks, args.out, "job_check.json")


def summarize(bench: JobBench, results: dict[str, Any], checks: Checks) -> dict[str, Any]:
    """The step-time comparison (a check) and the numbers worth reading first."""
    a = bench.args
    alone = [results[k]["stats"] for k in ("alone", "alone_repeat")
             if k in results and results[k]["stats"]["steps"]]
    pf, jf = results.get("probe_first", {}), results.get("job_first", {})
    out: dict[str, Any] = {
        "gpus": bench.ngpu, "scopes": bench.scopes,
        "alone": [{k: s.get(k) for k in ("steps", "median_ms", "p99_ms")} for s in alone]}
    for label, res, checked in (("probe_first", pf, True), ("job_first", jf, False)):
        stats = res.get("job", {}).get("stats", {})
        if not stats.get("steps"):
            if checked:
                checks.eq(f"{label}: job step times recorded", None, "steps", False)
            continue
        row: dict[str, Any] = {"steps": stats["steps"]}
        for stat in ("median_ms", "p99_ms"):
            row[stat] = stats[stat]
            if not alone:
                if checked:
                    checks.eq(f"{label}: job step {stat} vs alone", stats[stat],
                              "no job-alone run to compare with", False)
                continue
            c = compare(stats[stat], [s[stat] for s in alone], a.tolerance)
            row[f"{stat}_ratio_to_alone"] = round(c["ratio"], 4)
            row[f"{stat}_alone_spread"] = round(c["alone_spread"], 4)
            row[f"{stat}_within_{a.tolerance:.0%}"] = c["strict_ok"]
            if checked:
                checks.eq(f"{label}: job step {stat} / alone (tolerance {c['tolerance']:.2%}: "
                          f"{a.tolerance:.0%} or the alone runs' spread "
                          f"{c['alone_spread']:.2%}, the larger)", round(c["ratio"], 4),
                          f"1 +- {c['tolerance']:.4f}", c["ok"])
        out[f"{label}_job"] = row
    for k in ("first_round_seconds_after_start", "probe_gpu_memory_peak_mib", "host_rss",
              "yield_seconds_from_job_on_gpu", "yield_seconds_from_job_first_allocation",
              "failures_increase", "recovery_seconds", "recovery_bound_seconds",
              "states_after_job"):
        if k in pf:
            out[f"probe_first_{k}"] = pf[k]
    if "job" in pf:
        out["probe_first_steps_while_probe_on_gpus"] = pf["job"].get("steps_while_probe_on_gpus")
        out["probe_first_stats_after_probe_left"] = pf["job"].get("stats_after_probe_left")
    for k in ("free_mib_after_reserve", "recovery_seconds", "recovery_bound_seconds",
              "states_after_job"):
        if k in jf:
            out[f"job_first_{k}"] = jf[k]
    out["checks_failed"] = [r["check"] for r in checks.rows if not r["ok"]]
    return out


def renew(args: argparse.Namespace) -> int:
    checks = Checks()
    out: dict[str, Any] = {"nvidia_smi": sh("nvidia-smi", "-L")}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        site = install(tmp)
        tree = tmp / "sys"
        shutil.copytree(REPO / "examples" / "dgx-h100" / "sys", tree, symlinks=True)
        for label in ("fallback", "fixed"):
            if label == "fixed":  # every port DOWN: sockets are all the node has now
                for state in tree.glob("devices/**/infiniband/*/ports/*/state"):
                    state.write_text("1: DOWN\n")
            state_dir = tmp / f"state-{label}"
            r = subprocess.run(
                [sys.executable, "-m", "gpunet_exporter.probe.cli", "run", "--state-dir",
                 str(state_dir), "--scopes", "net", "--rounds", str(args.rounds),
                 "--interval", "1", "--sizes", "1MiB", "--path.sysfs", str(tree)],
                capture_output=True, text=True, timeout=600,
                env={**os.environ, "PYTHONPATH": str(site)})
            try:
                res = json.loads((state_dir / "net.json").read_text())
            except (OSError, ValueError):
                res = {}
            renewed = r.stderr.count("starts anew next round")
            out[label] = {"exit": r.returncode, "renewed": renewed,
                          "success": res.get("success"),
                          "net_transports": res.get("net_transports"),
                          "stderr_tail": r.stderr[-800:]}
            checks.eq(f"{label}: launcher exit", r.returncode, 0)
            checks.eq(f"{label}: last round measured", res.get("success"), True)
            checks.eq(f"{label}: NCCL on sockets", "Socket" in (res.get("net_transports")
                                                                or []), True)
            checks.eq(f"{label}: groups started anew", renewed,
                      args.rounds if label == "fallback" else 0)
    print(json.dumps(out, indent=1))
    return finish(out, checks, args.out, "renew_check.json")


# -- fabric (issue 34): what NVML says of the NVLink fabric, and NCCL RAS's MONITOR stream ----

def _nvml_struct(nv: Any, st: Any) -> dict[str, Any]:
    """A ctypes structure as plain values (byte arrays as hex)."""
    out: dict[str, Any] = {}
    for name, _ in st._fields_:
        v = getattr(st, name)
        if hasattr(v, "_length_"):
            try:
                v = bytes(v).hex()
            except TypeError:
                v = [_nvml_struct(nv, x) if hasattr(x, "_fields_") else x for x in v]
        elif hasattr(v, "_fields_"):
            v = _nvml_struct(nv, v)
        out[name] = v
    return out


def _nvml_call(nv: Any, fn: str, *args: Any) -> dict[str, Any]:
    """One NVML call: its value, or the error's class name (NVMLError_NotSupported, ...)."""
    call = getattr(nv, fn, None)
    if call is None:
        return {"error": f"not in nvidia-ml-py {getattr(nv, '__version__', '?')}"}
    try:
        value = call(*args)
    except nv.NVMLError as exc:
        return {"error": type(exc).__name__, "text": str(exc)}
    except Exception as exc:  # ctypes or a missing symbol in an older driver
        return {"error": type(exc).__name__, "text": str(exc)}
    if hasattr(value, "_fields_"):
        value = _nvml_struct(nv, value)
    elif isinstance(value, bytes):
        value = value.decode(errors="replace")
    elif hasattr(value, "busId"):
        value = _nvml_struct(nv, value)
    return {"value": value}


def _fabric_info(nv: Any, handle: Any) -> dict[str, Any]:
    """Every version of the fabric info call the bindings and driver have."""
    import ctypes
    out: dict[str, Any] = {}
    for fn, struct in (("nvmlDeviceGetGpuFabricInfo", "c_nvmlGpuFabricInfo_t"),
                       ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v2_t"),
                       ("nvmlDeviceGetGpuFabricInfoV", "c_nvmlGpuFabricInfo_v3_t")):
        cls = getattr(nv, struct, None)
        if cls is None:
            out[f"{fn}/{struct}"] = {"error": "no such structure in these bindings"}
            continue
        info = cls()
        # The bindings hand the argument to C as it is: the structure by reference, or the call
        # receives it by value and NVML writes through garbage (a segmentation fault).
        res = _nvml_call(nv, fn, handle, ctypes.byref(info))
        if "error" not in res:
            res = {"value": _nvml_struct(nv, info)}
        out[f"{fn}/{struct}"] = res
    return out


def nvlink_capture(nv: Any) -> dict[str, Any]:
    """Per GPU: the fabric info, and per NVLink link its state, version, remote end and speed
    (field values), as NVML answers on this machine."""
    gpus = []
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        g: dict[str, Any] = {"index": i, "name": _nvml_call(nv, "nvmlDeviceGetName", h),
                             "uuid": _nvml_call(nv, "nvmlDeviceGetUUID", h),
                             "fabric": _fabric_info(nv, h), "links": []}
        fields = {"speed_common_mbps": getattr(nv, "NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON", 90),
                  "link_count": getattr(nv, "NVML_FI_DEV_NVLINK_LINK_COUNT", 91)}
        try:
            vals = nv.nvmlDeviceGetFieldValues(h, list(fields.values()))
            g["fields"] = {k: {"ret": int(v.nvmlReturn), "value": _field(v)}
                           for k, v in zip(fields, vals, strict=False)}
        except Exception as exc:
            g["fields"] = {"error": f"{type(exc).__name__}: {exc}"}
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 18))):
            state = _nvml_call(nv, "nvmlDeviceGetNvLinkState", h, link)
            if state.get("error") == "NVMLError_InvalidArgument":
                break
            rec = {"link": link, "state": state,
                   "version": _nvml_call(nv, "nvmlDeviceGetNvLinkVersion", h, link),
                   "remote_type": _nvml_call(nv, "nvmlDeviceGetNvLinkRemoteDeviceType", h, link),
                   "remote_pci": _nvml_call(nv, "nvmlDeviceGetNvLinkRemotePciInfo_v2", h, link)}
            for key, fid in (("get_speed", getattr(nv, "NVML_FI_DEV_NVLINK_GET_SPEED", 164)),
                             ("get_state", getattr(nv, "NVML_FI_DEV_NVLINK_GET_STATE", 165))):
                try:
                    rec[key] = _field_scoped(nv, h, fid, link)
                except Exception as exc:
                    rec[key] = {"error": f"{type(exc).__name__}: {exc}"}
            g["links"].append(rec)
        gpus.append(g)
    return {"gpus": gpus}


def _field(v: Any) -> Any:
    kinds = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
             6: "usVal"}
    return getattr(v.value, kinds.get(int(v.valueType), "ullVal"))


def _field_scoped(nv: Any, handle: Any, field: int, scope: int) -> dict[str, Any]:
    """A field value with a scope ID (the link), through the raw call."""
    import ctypes
    arr = (nv.c_nvmlFieldValue_t * 1)()
    arr[0].fieldId, arr[0].scopeId = field, scope
    fn = nv._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
    ret = fn(handle, ctypes.c_int32(1), arr)
    return {"call_ret": int(ret), "ret": int(arr[0].nvmlReturn), "value": _field(arr[0])}


def monitor_capture(seconds: float, nccl_lib: str | None) -> dict[str, Any]:
    """NCCL RAS's MONITOR stream (NCCL 2.29.2 and later): a two-rank job (RAS_JOB, its rank 0
    kept alive as job C's is), two monitoring clients (text and JSON, every event group), then
    rank 1 killed; every chunk each client receives, with its time, until ``seconds`` after the
    kill. On an older NCCL the record holds what RAS answered to MONITOR instead."""
    import socket
    port, out = 28040, {"port": 28040, "clients": {}, "job": []}
    env_base = {**os.environ, **NO_MULTICAST, "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                "PYTHONUNBUFFERED": "1", "NCCL_RAS_ADDR": f"localhost:{port}",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    if nccl_lib:
        env_base["LD_LIBRARY_PATH"] = nccl_lib + ":" + os.environ.get("LD_LIBRARY_PATH", "")
        env_base["LD_PRELOAD"] = os.path.join(nccl_lib, "libnccl.so.2")
    ranks = [subprocess.Popen([sys.executable, "-c", RAS_JOB],
                              env={**env_base, "RANK": str(r), "NCCL_HOSTID": f"mon-{r}"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    socks: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        for r, pr in enumerate(ranks):
            assert pr.stdout is not None
            out["job"].append({"rank": r, "line": pr.stdout.readline().strip()})
        for name, cmds in (("text", ["CLIENT PROTOCOL 2", "MONITOR all"]),
                           ("json", ["CLIENT PROTOCOL 2", "SET FORMAT json", "MONITOR all"])):
            rec: dict[str, Any] = {"commands": cmds, "chunks": []}
            out["clients"][name] = rec
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError as exc:
                rec["error"] = repr(exc)
                continue
            socks[name] = s
            for cmd in cmds:
                s.sendall(cmd.encode() + b"\n")
                s.settimeout(5)
                try:
                    data = s.recv(65536)
                except OSError as exc:
                    rec["chunks"].append({"t": round(time.monotonic() - t0, 3), "sent": cmd,
                                          "error": repr(exc)})
                    break
                rec["chunks"].append({"t": round(time.monotonic() - t0, 3), "sent": cmd,
                                      "data": data.decode("utf-8", "replace")})
        time.sleep(2)
        out["killed_at"] = round(time.monotonic() - t0, 3)
        ranks[1].kill()
        end = time.monotonic() + seconds
        while time.monotonic() < end and socks:
            for name, s in list(socks.items()):
                s.settimeout(0.2)
                try:
                    data = s.recv(65536)
                except TimeoutError:
                    continue
                except OSError as exc:
                    out["clients"][name]["chunks"].append(
                        {"t": round(time.monotonic() - t0, 3), "error": repr(exc)})
                    del socks[name]
                    continue
                if not data:
                    out["clients"][name]["chunks"].append(
                        {"t": round(time.monotonic() - t0, 3), "closed": True})
                    del socks[name]
                    continue
                out["clients"][name]["chunks"].append(
                    {"t": round(time.monotonic() - t0, 3),
                     "data": data.decode("utf-8", "replace")})
    finally:
        for s in socks.values():
            s.close()
        for pr in ranks:
            pr.kill()
        for r, pr in enumerate(ranks):
            _, err = pr.communicate(timeout=30)
            out["job"].append({"rank": r, "stderr_tail": err[-3000:]})
    return out


def nvlink_ratio_runs(gpus: list[dict[str, Any]], checks: Checks) -> dict[str, Any]:
    """The intra scope (one rank per GPU) through the node's launcher, three rounds at the
    default sizes and three at 64 MiB and 256 MiB: each round's NVLink bandwidth (the runner's,
    from NVML) against the sum of the capture's link speeds, and its bus bandwidth ratio."""
    if len(gpus) < 2:
        return {"skipped": "one GPU: no intra scope"}
    want = min(sum(lk["get_speed"]["value"] * 1e6 for lk in g["links"]
                   if lk["state"].get("value") == 1 and "value" in lk.get("get_speed", {}))
               for g in gpus)
    out: dict[str, Any] = {"nvlink_from_capture": want, "runs": []}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        site = install(tmp)
        for label, extra in (("defaults", []), ("large", ["--sizes", "64MiB,256MiB"])):
            for i in range(3):
                state = tmp / f"{label}{i}"
                r = subprocess.run(
                    [sys.executable, "-m", "gpunet_exporter.probe.cli", "run", "--state-dir",
                     str(state), "--scopes", "intra", "--rounds", "1", *extra],
                    capture_output=True, text=True, timeout=300,
                    env={**os.environ, "PYTHONPATH": str(site)})
                try:
                    res = json.loads((state / "intra.json").read_text())
                except (OSError, ValueError):
                    out["runs"].append({"label": label, "error": r.stderr[-1500:]})
                    continue
                sizes = [x for x in res.get("sizes", []) if not x.get("skipped")]
                largest = max(sizes, key=lambda x: x["bytes"], default=None)
                nv = res.get("nvlink_bytes_per_second")
                row = {"label": label, "nvlink": nv, "largest_bytes": largest and largest["bytes"],
                       "busbw": largest and largest["busbw_bytes_per_second"],
                       "transports": res.get("transports")}
                if nv and largest:
                    row["ratio"] = largest["busbw_bytes_per_second"] / nv
                out["runs"].append(row)
                print(f"  intra {label} round {i}: {row}", flush=True)
    got = [r.get("nvlink") for r in out["runs"]]
    checks.eq("the runner's NVLink bandwidth equals the capture's link speeds summed",
              sorted(set(got)), [want])
    return out


def fabric(args: argparse.Namespace) -> int:
    """NVML's NVLink fabric answers on every GPU, versions, nvidia-smi's view, and a MONITOR
    stream; everything into fabric_check.json (tests/fixtures/nvml/ keeps the NVML part)."""
    import pynvml as nv
    checks = Checks()
    out: dict[str, Any] = {"versions": {}, "nvidia_smi": {}}
    nv.nvmlInit()
    try:
        out["versions"] = {"driver": _nvml_call(nv, "nvmlSystemGetDriverVersion"),
                           "nvml": _nvml_call(nv, "nvmlSystemGetNVMLVersion"),
                           "cuda_driver": _nvml_call(nv, "nvmlSystemGetCudaDriverVersion_v2"),
                           "nvidia_ml_py": getattr(nv, "__version__", "?")}
        out["nvml"] = nvlink_capture(nv)
    finally:
        nv.nvmlShutdown()
    for what, argv in (("topo", ["nvidia-smi", "topo", "-m"]),
                       ("nvlink_status", ["nvidia-smi", "nvlink", "-s"]),
                       ("query_fabric", ["nvidia-smi", "-q", "-d", "FABRIC"]),
                       ("fabricmanager", ["systemctl", "is-active", "nvidia-fabricmanager"])):
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
            out["nvidia_smi"][what] = {"rc": res.returncode, "out": res.stdout[-20000:],
                                       "err": res.stderr[-2000:]}
        except (OSError, subprocess.TimeoutExpired) as exc:
            out["nvidia_smi"][what] = {"error": repr(exc)}
    try:
        import torch
        out["versions"]["torch"] = torch.__version__
        out["versions"]["nccl_torch"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:
        out["versions"]["torch"] = repr(exc)
    gpus = out["nvml"]["gpus"]
    checks.eq("GPUs whose fabric call answered in some version (a value or an NVML error)",
              sum(any("value" in r or r.get("error", "").startswith("NVMLError")
                      for r in g["fabric"].values()) for g in gpus), len(gpus))
    out["nvlink_ratio"] = nvlink_ratio_runs(gpus, checks)
    if args.monitor_seconds <= 0:
        return finish(out, checks, args.out, "fabric_check.json")
    out["monitor"] = monitor_capture(args.monitor_seconds, args.nccl_lib)
    out["monitor"]["nccl_lib"] = args.nccl_lib or "PyTorch's own"
    text = "".join(c.get("data", "") for c in out["monitor"]["clients"].get("text", {})
                   .get("chunks", []))
    out["monitor"]["answered_ok"] = "\nOK\n" in "\n" + text
    out["monitor"]["peer_dead_seen"] = "PEER_DEAD" in text
    return finish(out, checks, args.out, "fabric_check.json")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu", help="the gpu and topology collectors against nvidia-smi")
    g.add_argument("--scrapes", type=int, default=300)
    g.add_argument("--load-seconds", type=float, default=60)
    g.add_argument("--out", help="directory for gpu_check.json")
    pr = sub.add_parser("probe", help="the probe's scopes, straggler, cluster mode, its "
                        "accuracy against a tight loop, its memory between rounds")
    pr.add_argument("--rounds", type=int, default=3, help="rounds to watch through the exporter")
    pr.add_argument("--sizes", default=PROBE_SIZES, type=sizes_arg,
                    help=f"sizes of the accuracy and memory parts ({PROBE_SIZES})")
    pr.add_argument("--reps", type=int, default=3,
                    help="rounds and tight loops each, alternating, in the accuracy part (3)")
    pr.add_argument("--memory-rounds", type=int, default=3,
                    help="launcher rounds in the memory part: a sample between each two (3)")
    pr.add_argument("--memory-interval", type=float, default=30.0,
                    help="seconds from one launcher round's start to the next (30)")
    pr.add_argument("--out", help="directory for probe_check.json")
    fl = sub.add_parser("fleet", help="gpunet-probe fleet with NCCL, simulated nodes on a GPU")
    fl.add_argument("--nodes", type=int, default=4)
    fl.add_argument("--pair-args", type=str.split, default=[],
                    help="more `gpunet-probe run` options for the ring --hops 2 pass, e.g. "
                         "'--warmup 5 --iterations 10' (bench/pair_setup.py's 25 per size)")
    fl.add_argument("--out", help="directory for fleet_check.json")
    fy = sub.add_parser("fleet-yield", help="the fleet's kept pair workers beside a job that "
                        "starts mid-pass (one GPU is enough; the job takes every GPU)")
    fy.add_argument("--job-seconds", type=float, default=20)
    fy.add_argument("--out", help="directory for fleet_yield_check.json")
    ra = sub.add_parser("ras", help="NCCL RAS captures and the nccl collector, live")
    ra.add_argument("--out", help="directory for ras_check.json and the NCCL logs")
    jb = sub.add_parser("job", help="the probe beside a stand-in training job on every GPU")
    jb.add_argument("--job-seconds", type=float, default=60,
                    help="the job's stepping time, alone and with the probe first (60)")
    jb.add_argument("--beside-seconds", type=float, default=60,
                    help="the exporter beside the job that took the GPUs first (60)")
    jb.add_argument("--no-repeat-alone", dest="repeat_alone", action="store_false",
                    help="run the job alone once, not twice (the second run shows the noise)")
    jb.add_argument("--holdoff", type=float, default=15, help="probe.holdoff_seconds (15)")
    jb.add_argument("--interval", type=float, default=10, help="probe.interval_seconds (10)")
    jb.add_argument("--reserve-mib", type=int, default=300,
                    help="job first: the job leaves this much of each GPU free (300)")
    jb.add_argument("--matmuls", type=int, default=6, help="the job's matmuls per step (6)")
    jb.add_argument("--warmup-steps", type=int, default=20,
                    help="job steps left out of the statistics (20)")
    jb.add_argument("--tolerance", type=float, default=0.01,
                    help="job step median and p99 with the probe vs alone: this ratio or the "
                         "alone runs' own spread, the larger (0.01)")
    jb.add_argument("--yield-limit", type=float, default=10,
                    help="seconds from the job's appearance to the probe off every GPU (10)")
    jb.add_argument("--round-timeout", type=float, default=150,
                    help="seconds after the hold-off to wait for the first complete round (150)")
    jb.add_argument("--init-round", type=float, default=60,
                    help="the probe's start and round, when the first round did not measure it "
                         "(60)")
    jb.add_argument("--recovery-slack", type=float, default=15,
                    help="seconds allowed past hold-off + start and round for the next complete "
                         "round after a job (15)")
    jb.add_argument("--poll", type=float, default=0.1, help="GPU process poll period (0.1)")
    jb.add_argument("--scrape-interval", type=float, default=1.0,
                    help="scrape period while a job runs (1.0; 0.5 otherwise)")
    jb.add_argument("--out", help="directory for job_check.json")
    fb = sub.add_parser("fabric", help="NVML's NVLink fabric answers, and RAS's MONITOR stream")
    fb.add_argument("--monitor-seconds", type=float, default=40,
                    help="how long the MONITOR clients listen after rank 1 is killed (40; 0: "
                         "no MONITOR capture)")
    fb.add_argument("--nccl-lib", help="a directory with another libnccl.so.2 for the job's "
                    "ranks (LD_PRELOAD), e.g. one built from NCCL's sources")
    fb.add_argument("--out", help="directory for fabric_check.json")
    rn = sub.add_parser("renew", help="a group that fell back to sockets starts anew")
    rn.add_argument("--rounds", type=int, default=3)
    rn.add_argument("--out", help="directory for renew_check.json")
    args = p.parse_args()
    os.environ.update(NO_MULTICAST)  # every child inherits it: NVLink multicast stays off
    return {"gpu": gpu, "probe": probe, "fleet": fleet, "fleet-yield": fleet_yield, "ras": ras,
            "job": job,
            "renew": renew, "fabric": fabric}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
