"""The probe runner: rounds of micro all-reduces through torch.distributed, results to a file.

Two ways to start it, one code path:
- intra-node (``gpunet-probe run``, what the exporter starts): a launcher spawns one worker
  process per local GPU (NCCL) or ``--nprocs`` CPU workers (gloo), joined over 127.0.0.1;
- cluster mode: the same ``gpunet-probe run`` started by torchrun or srun on every node (their
  standard variables: RANK/WORLD_SIZE/LOCAL_RANK, or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with
  MASTER_ADDR/MASTER_PORT); each node's local rank 0 writes the round's result for its node.

A worker keeps its process group between rounds (NCCL is initialised once); any failure ends
the process with the failure written to the result file, and the exporter starts it again.
Each round: for each message size, warm-up all-reduces, then timed ones (CUDA events on GPUs, the
monotonic clock on CPU). Every rank's per-iteration times are gathered; an iteration takes as
long as its slowest rank. Per size: median, p99 and max; algorithm bandwidth = bytes / median;
bus bandwidth = algbw x 2(n-1)/n (nccl-tests' all-reduce formula); the slowest rank's median over
the median of all ranks' medians is the straggler lateness. NCCL logs at INFO into a private
directory, and the parser (ncclog.py) says which network and transports carried the round.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exporter.probe import results
from exporter.sysfs import parse_uint

EXIT_ROUND_FAILED = 4
EXIT_NO_GPU = 3


@dataclass(frozen=True)
class Cluster:
    rank: int
    world_size: int
    local_rank: int
    launcher: str  # torchrun, srun, intra


def cluster_from_env(env: Mapping[str, str]) -> Cluster | None:
    """The rank of a process started by torchrun or srun; None otherwise."""
    def num(key: str) -> int | None:
        return parse_uint(env.get(key, ""))

    rank, world, local = num("RANK"), num("WORLD_SIZE"), num("LOCAL_RANK")
    if rank is not None and world is not None:
        return Cluster(rank, world, local or 0, "torchrun")
    rank, world, local = num("SLURM_PROCID"), num("SLURM_NTASKS"), num("SLURM_LOCALID")
    if rank is not None and world is not None and env.get("MASTER_ADDR"):
        return Cluster(rank, world, local or 0, "srun")
    return None


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw x 2(n-1)/n."""
    return algbw * 2 * (world_size - 1) / world_size if world_size > 1 else algbw


def summarize_times(matrix: Sequence[Sequence[float]], nbytes: int,
                    world_size: int) -> tuple[results.SizeResult, list[float]]:
    """Per-size statistics from every rank's per-iteration times (rows are ranks), and each
    rank's median."""
    iterations = [max(col) for col in zip(*matrix, strict=True)]
    med = statistics.median(iterations)
    algbw = nbytes / med if med > 0 else 0.0
    return results.SizeResult(
        nbytes, False, med, percentile(iterations, 99), max(iterations), algbw,
        bus_bandwidth(algbw, world_size)), [statistics.median(r) for r in matrix]


def lateness(rank_medians: Sequence[float]) -> float | None:
    """How much later than the median rank the slowest rank is, as a ratio (0.5: 50 %)."""
    if len(rank_medians) < 2:
        return None
    mid = statistics.median(rank_medians)
    return (max(rank_medians) - mid) / mid if mid > 0 else None


# -- arguments -------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30}


def parse_bytes(text: str) -> int:
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits):]
    n = parse_uint(digits)
    if n is None or unit not in _UNITS or n <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 8KiB, 1MiB or 65536, got {text!r}")
    return n * _UNITS[unit]


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({parse_bytes(part) for part in text.split(",") if part.strip()})
    if not sizes:
        raise argparse.ArgumentTypeError("expected at least one size")
    bad = [s for s in sizes if s % 4]
    if bad:
        raise argparse.ArgumentTypeError(f"sizes must be multiples of 4 bytes (float32), got {bad}")
    return sizes


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", required=True, help="where result files are written")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                   help="nccl on GPUs (default), gloo on CPUs (tests, machines without GPUs)")
    p.add_argument("--nprocs", type=int, default=0,
                   help="workers for an intra-node run (default: one per visible GPU; 2 for gloo)")
    p.add_argument("--sizes", type=parse_sizes, default=[8 << 10, 1 << 20, 64 << 20],
                   help="all-reduce message sizes (default 8KiB,1MiB,64MiB)")
    p.add_argument("--warmup", type=int, default=5, help="untimed all-reduces per size (5)")
    p.add_argument("--iterations", type=int, default=20, help="timed all-reduces per size (20)")
    p.add_argument("--interval", type=float, default=60.0,
                   help="seconds from one round's start to the next (60)")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many rounds (0: never)")
    p.add_argument("--memory-cap", type=parse_bytes, default=1 << 30,
                   help="GPU memory the probe may allocate per GPU (default 1GiB)")
    p.add_argument("--busy-utilization", type=float, default=0.5,
                   help="a GPU above this utilization (0 to 1) counts as busy with other work "
                        "(0.5)")
    p.add_argument("--busy-min-size", type=parse_bytes, default=1 << 20,
                   help="sizes from this one up are skipped while a GPU is busy (1MiB)")
    p.add_argument("--no-skip-busy", dest="skip_busy", action="store_false",
                   help="measure every size even while GPUs are busy with other work "
                        "(default: skip them)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a collective may take before torch.distributed gives up (120)")
    p.add_argument("--scope", choices=("auto", "intra", "inter"), default="auto",
                   help="auto: inter when started by torchrun or srun, else intra (auto)")


# -- intra-node launcher ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _visible_gpus() -> int:
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def _fail(state_dir: str, scope: str, reason: str, error: str, backend: str) -> None:
    now = time.time()
    results.write_atomic(results.result_path(state_dir, scope), {
        "version": results.VERSION, "scope": scope, "time": now, "started": now,
        "success": False, "failure": reason, "error": error[:500], "backend": backend})


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the workers of an intra-node probe and wait for them; returns the exit status.
    ``argv`` are the run arguments, passed on to each worker."""
    os.makedirs(args.state_dir, exist_ok=True)
    cluster = cluster_from_env(os.environ)
    if cluster is not None:  # started by torchrun or srun: this process is a rank itself
        return worker(args, cluster)
    n = args.nprocs
    if args.backend == "nccl":
        gpus = _visible_gpus()
        if gpus == 0:
            _fail(args.state_dir, "intra", "no_gpu", "no CUDA device visible", args.backend)
            print("gpunet-probe: no CUDA device visible (CUDA_VISIBLE_DEVICES="
                  f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})", file=sys.stderr)
            return EXIT_NO_GPU
        n = n or gpus
    n = n or 2
    logdir = tempfile.mkdtemp(prefix="gpunet-probe-")  # private (0700): NCCL logs
    port = _free_port()
    procs = []
    command = [sys.executable, "-m", "exporter.probe.cli", "worker", *argv]
    parent = os.getppid()
    try:
        for rank in range(n):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "GPUNET_PROBE_LOG_DIR": logdir, "GPUNET_PROBE_SCOPE": "intra"}
            procs.append(subprocess.Popen(command, env=env))
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            if os.getppid() != parent:  # whoever started us (the exporter) is gone
                return 143
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(logdir, ignore_errors=True)


# -- worker ----------------------------------------------------------------------------------


def worker(args: argparse.Namespace, cluster: Cluster | None = None) -> int:
    """One rank: init the process group once, then rounds until --rounds or a failure."""
    cluster = cluster or cluster_from_env(os.environ)
    if cluster is None:
        print("gpunet-probe worker: RANK and WORLD_SIZE are not set", file=sys.stderr)
        return 2
    scope = args.scope if args.scope != "auto" else os.environ.get(
        "GPUNET_PROBE_SCOPE", "intra" if cluster.launcher == "intra" else "inter")
    writer = cluster.local_rank == 0  # rank 0 of the node writes the node's result
    logdir = os.environ.get("GPUNET_PROBE_LOG_DIR") or tempfile.mkdtemp(prefix="gpunet-probe-")
    if args.backend == "nccl":
        os.environ["NCCL_DEBUG"] = "INFO"  # into the private directory, whatever the exporter has
        os.environ["NCCL_DEBUG_FILE"] = os.path.join(logdir, "nccl.%h.%p.log")
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    started = time.time()
    try:
        probe = _Probe(args, cluster, scope)
    except Exception as exc:
        if writer:
            reason = "no_gpu" if isinstance(exc, _NoGpu) else "init_error"
            _fail(args.state_dir, scope, reason, f"{type(exc).__name__}: {exc}", args.backend)
        print(f"gpunet-probe: rank {cluster.rank}: cannot start: {exc}", file=sys.stderr)
        return EXIT_NO_GPU if isinstance(exc, _NoGpu) else EXIT_ROUND_FAILED
    with contextlib.suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    round_no = 0
    try:
        while True:
            started = time.time()
            if writer:
                results.write_atomic(os.path.join(args.state_dir, results.STATUS), {
                    "version": results.VERSION, "scope": scope, "round_started": started,
                    "round": round_no, "pid": os.getpid()})
            try:
                result = probe.round(started, logdir)
            except Exception as exc:
                if writer:
                    text = f"{type(exc).__name__}: {exc}"
                    reason = "nccl_error" if "nccl" in text.lower() else "error"
                    _fail(args.state_dir, scope, reason, text, args.backend)
                print(f"gpunet-probe: rank {cluster.rank}: round failed: {exc}", file=sys.stderr)
                return EXIT_ROUND_FAILED
            if writer:
                results.write_atomic(results.result_path(args.state_dir, scope), result)
            round_no += 1
            if args.rounds and round_no >= args.rounds:
                return 0
            time.sleep(max(0.0, args.interval - (time.time() - started)))
    finally:
        probe.close()


class _NoGpu(RuntimeError):
    pass


class _Probe:
    """A rank's persistent state: process group, device, buffers, NVML for the busy check."""

    def __init__(self, args: argparse.Namespace, cluster: Cluster, scope: str) -> None:
        import torch
        import torch.distributed as dist

        # Typed loosely: torch's own annotations differ between the versions the probe runs on.
        self.torch: Any = torch
        self.dist: Any = dist
        self.args, self.cluster, self.scope = args, cluster, scope
        self.cuda = args.backend == "nccl"
        if self.cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
                raise _NoGpu("no CUDA device visible")
            index = cluster.local_rank % torch.cuda.device_count()
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap / total), index)
            if max(args.sizes) > args.memory_cap // 2:
                raise ValueError(f"largest size {max(args.sizes)} does not fit the memory cap "
                                 f"{args.memory_cap} (needs twice the size)")
        else:
            self.device = torch.device("cpu")
        from datetime import timedelta
        self.dist.init_process_group(
            args.backend, rank=cluster.rank, world_size=cluster.world_size,
            timeout=timedelta(seconds=args.timeout), device_id=self.device if self.cuda else None)
        self.world = cluster.world_size
        self.pids = {int(p[0]) for p in self._gather([float(os.getpid())])}
        self.nvml: Any = None
        self.handle: Any = None
        if self.cuda and args.skip_busy:
            self._open_nvml(index)

    def _open_nvml(self, index: int) -> None:
        try:
            pynvml: Any = importlib.import_module("pynvml")
            pynvml.nvmlInit()
            uuid = str(self.torch.cuda.get_device_properties(index).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(
                uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            self.nvml = pynvml
        except Exception as exc:  # no busy check, but the probe still runs
            print(f"gpunet-probe: rank {self.cluster.rank}: no NVML busy check: {exc}",
                  file=sys.stderr)

    def _busy(self) -> bool:
        """This rank's GPU is busy with other work: utilization above the threshold or a
        compute process that is not one of the probe's."""
        if self.nvml is None:
            return False
        try:
            util = self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu / 100
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return False
        return util > self.args.busy_utilization or any(
            int(p.pid) not in self.pids for p in procs)

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _time_size(self, nbytes: int) -> list[float]:
        torch, dist = self.torch, self.dist
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=self.device)
        for _ in range(self.args.warmup):
            dist.all_reduce(buf)
        self._sync()
        times = []
        for _ in range(self.args.iterations):
            if self.cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                dist.all_reduce(buf)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                times.append(time.perf_counter() - t0)
        del buf
        return times

    def _gather(self, values: list[float]) -> list[list[float]]:
        torch, dist = self.torch, self.dist
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(out, local)
        return [t.cpu().tolist() for t in out]

    def _gather_json(self, value: Any) -> list[Any]:
        """Every rank's JSON-able value, through tensors (object collectives need NumPy)."""
        torch, dist = self.torch, self.dist
        data = json.dumps(value).encode()
        sizes = self._gather([float(len(data))])
        longest = int(max(s[0] for s in sizes))
        local = torch.zeros(longest, dtype=torch.uint8, device=self.device)
        local[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        out = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(out, local)
        return [json.loads(bytes(t.cpu().tolist()[: int(n[0])]))
                for t, n in zip(out, sizes, strict=True)]

    def round(self, started: float, logdir: str) -> dict[str, Any]:
        torch, dist = self.torch, self.dist
        flag = torch.tensor([1.0 if self._busy() else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must skip the same sizes
        busy = bool(flag.item())
        sizes: list[dict[str, Any]] = []
        rank_medians: list[float] | None = None
        for nbytes in self.args.sizes:
            if busy and self.args.skip_busy and nbytes >= self.args.busy_min_size:
                sizes.append({"bytes": nbytes, "skipped": True})
                continue
            stats, medians = summarize_times(self._gather(self._time_size(nbytes)), nbytes,
                                             self.world)
            rank_medians = medians  # the largest size measured decides stragglers
            sizes.append({"bytes": nbytes, "skipped": False, **{
                k: getattr(stats, k) for k in (
                    "median_seconds", "p99_seconds", "max_seconds", "algbw_bytes_per_second",
                    "busbw_bytes_per_second")}})
        transport = self._transport(logdir)
        out: dict[str, Any] = {
            "version": results.VERSION, "scope": self.scope, "started": started,
            "time": time.time(), "success": True, "backend": self.args.backend,
            "world_size": self.world, "nccl_version": self._nccl_version(),
            "sizes": sizes, "slowest_rank_lateness_ratio":
                None if rank_medians is None else lateness(rank_medians),
            "skipped_busy": busy and any(s["skipped"] for s in sizes), **transport}
        return out

    def _nccl_version(self) -> str:
        if not self.cuda:
            return ""
        v = self.torch.cuda.nccl.version()
        return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)

    def _transport(self, logdir: str) -> dict[str, Any]:
        """What NCCL says it used, from every rank's INFO log, merged across ranks."""
        if not self.cuda:
            return {}
        from exporter.probe import ncclog

        mine: list[Any] = []
        for name in os.listdir(logdir):
            if name.endswith(f".{os.getpid()}.log"):
                with contextlib.suppress(OSError):
                    mine += ncclog.parse_file(os.path.join(logdir, name))
        gathered = self._gather_json([r.to_dict() for r in mine])
        reports = [ncclog.RankReport.from_dict(row) for per_rank in gathered for row in per_rank]
        s = ncclog.summarize(reports)
        return {"net": s.get("net", ""), "transports": sorted(s.get("transports", [])),
                "net_transports": sorted(s.get("net_transports", [])), "gdr": s.get("gdr"),
                "problems": sorted(s.get("problems", []))}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.dist.destroy_process_group()
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
