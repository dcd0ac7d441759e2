"""Accuracy and cost of the probe, on GPUs (docs/probe.md, docs/benchmarks.md "probe").

    python3 -m torch.distributed.run --standalone --nproc-per-node N bench/probe_bench.py \\
        [--sizes 1MiB,64MiB,256MiB] [--reps 3]

One rank per GPU (local rank modulo the GPUs) is the intra scope's set-up. With
BENCH_HOSTID_PER_RANK=1 every rank gets its own NCCL_HOSTID (the net scope: NCCL goes through its
network), and ranks may share a GPU. bench/device_checks.py ``probe`` runs it both ways.

Every rank builds the runner's own probe state (gpunet_exporter.probe.runner ``_Probe``: one process
group, its memory cap, its rounds) and, in the same process on the same GPUs:

1. accuracy, per size: the bus bandwidth of the probe's own rounds (``_Probe.round``: each size's
   per-iteration timed all-reduces, then its tight loop, which the bandwidth comes from) against
   a reference timed like nccl-tests: 5 warm-up all-reduces, the ranks started together, one
   pair of CUDA events around REFERENCE_LOOP all-reduces back to back, nothing synchronised in
   between. The reference's time is the shortest of the ranks' (as the probe's); the slowest
   rank's is reported too. Rounds and references alternate (--reps times, the order swapped
   every other time); the ratio is the median probe bus bandwidth over the median reference.
   The bus bandwidth the probe exported before the loop (bytes / median of the per-iteration
   times) is reported next to it: what the loop fixes;
2. memory: this process's GPU memory as NVML counts it (what nvidia-smi shows: the CUDA context,
   NCCL's buffers, PyTorch's cache) and its host memory (VmRSS) at each stage: the CUDA context,
   the process group, after a round (PyTorch's cache released: what a rank holds between
   rounds), and after a round whose buffers were left in PyTorch's cache (what the runner held
   before it released them); PyTorch's reserved bytes; CUDA's module loading mode;
3. cost: a default round (8 KiB, 1 MiB, 64 MiB; 5 warm-up and 20 timed iterations, and the
   20-iteration loop, each) after warm-up: the GPU time of its all-reduces (sum of CUDA-event
   times) and wall time.

Rank 0 prints one JSON object. Keep NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1 set on shared multi-GPU machines.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from gpunet_exporter.probe import run_options, runner
from gpunet_exporter.probe.run_options import RunOptions

REFERENCE_LOOP = 20  # all-reduces in the reference's loop (nccl-tests' default -n is 20)
REFERENCE_WARMUP = 5
DEFAULT_SIZES = "1MiB,64MiB,256MiB"
MIB = 1 << 20


def args_for(sizes: Sequence[int], warmup: int, iterations: int,
             memory_cap: int = 1 << 30) -> RunOptions:
    return RunOptions(state_dir="/tmp", backend="nccl", memory_cap_bytes=memory_cap,
                      sizes=tuple(sizes), warmup=warmup, iterations=iterations, skip_busy=False)


def memory_cap_for(sizes: Sequence[int]) -> int:
    """The runner's default cap (1 GiB), or twice the largest size when that is more."""
    return max(1 << 30, 2 * max(sizes))


def process_memory(index: int) -> int | None:
    """This process's GPU memory as NVML (and nvidia-smi) count it: context, NCCL, caches."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        return next((int(p.usedGpuMemory) for p in
                     pynvml.nvmlDeviceGetComputeRunningProcesses(h) if p.pid == os.getpid()),
                    None)
    except Exception:
        return None


def rss() -> int:
    """This process's resident host memory in bytes (VmRSS)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def module_loading() -> str:
    """CUDA's module loading mode in this process (after CUDA is initialised): LAZY or EAGER,
    from the driver (cuModuleGetLoadingMode), else what the environment asks for."""
    try:
        mode = ctypes.c_int(0)
        if ctypes.CDLL("libcuda.so.1").cuModuleGetLoadingMode(ctypes.byref(mode)) == 0:
            return {1: "EAGER", 2: "LAZY"}.get(mode.value, str(mode.value))
    except (OSError, AttributeError):
        pass
    return f"unknown (CUDA_MODULE_LOADING={os.environ.get('CUDA_MODULE_LOADING', 'unset')})"


def busbw(nbytes: int, count: int, seconds: float, world: int) -> float:
    return runner.bus_bandwidth(nbytes * count / seconds, world) if seconds > 0 else 0.0


def reference_loop(probe: Any, nbytes: int) -> float:
    """This rank's time of REFERENCE_LOOP all-reduces of ``nbytes`` back to back, timed the
    nccl-tests way, written here apart from the runner's code: warm-up, the ranks started
    together, one event pair around the loop."""
    torch, dist = probe.torch, probe.dist
    buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=probe.device)
    for _ in range(REFERENCE_WARMUP):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    dist.all_reduce(torch.zeros(1, device=probe.device))  # nccl-tests: a barrier, then time
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REFERENCE_LOOP):
        dist.all_reduce(buf)
    end.record()
    end.synchronize()
    del buf
    torch.cuda.empty_cache()
    return float(start.elapsed_time(end)) / 1000


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def accuracy(probe: Any, sizes: Sequence[int], reps: int, logdir: str) -> dict[str, Any]:
    """Per size: the probe's rounds against the reference loop, alternating (see the module's
    docstring). Every rank returns the same numbers (gathered)."""
    world, iterations = probe.world, probe.args.iterations
    rounds: list[dict[int, dict[str, float]]] = []
    refs: list[dict[int, tuple[float, float]]] = []

    def one_round() -> None:
        result = probe.round(time.time(), logdir)
        rounds.append({s["bytes"]: s for s in result["sizes"]})

    def one_reference() -> None:
        mine = [reference_loop(probe, n) for n in sizes]
        rows = probe._gather(mine)
        refs.append({n: (min(r[i] for r in rows), max(r[i] for r in rows))
                     for i, n in enumerate(sizes)})

    for rep in range(reps):
        for step in ((one_round, one_reference) if rep % 2 == 0 else
                     (one_reference, one_round)):
            step()
    out: dict[str, Any] = {}
    for n in sizes:
        probe_bw = [r[n]["busbw_bytes_per_second"] for r in rounds]
        old_bw = [busbw(n, 1, r[n]["median_seconds"], world) for r in rounds]
        ref_bw = [busbw(n, REFERENCE_LOOP, ref[n][0], world) for ref in refs]
        ref_slow = [busbw(n, REFERENCE_LOOP, ref[n][1], world) for ref in refs]
        p, o, r = (statistics.median(v) for v in (probe_bw, old_bw, ref_bw))
        out[str(n)] = {
            "MiB": n / MIB,
            "probe_busbw_GBps": round(p / 1e9, 3),
            "reference_busbw_GBps": round(r / 1e9, 3),
            "probe_over_reference": ratio(p, r),
            "old_way_busbw_GBps (bytes / per-iteration median)": round(o / 1e9, 3),
            "old_way_over_reference": ratio(o, r),
            "reference_slowest_rank_busbw_GBps": round(statistics.median(ref_slow) / 1e9, 3),
            "probe_loop_us_per_allreduce": statistics.median(
                r_[n]["loop_seconds"] for r_ in rounds) / iterations * 1e6,
            "probe_per_iteration_median_us": statistics.median(
                r_[n]["median_seconds"] for r_ in rounds) * 1e6,
            "reference_us_per_allreduce": statistics.median(
                ref[n][0] for ref in refs) / REFERENCE_LOOP * 1e6,
            "every_rep": {"probe_busbw_GBps": [round(v / 1e9, 3) for v in probe_bw],
                          "reference_busbw_GBps": [round(v / 1e9, 3) for v in ref_bw]},
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=run_options.parse_sizes,
                    default=run_options.parse_sizes(DEFAULT_SIZES),
                    help=f"sizes of the accuracy part ({DEFAULT_SIZES})")
    ap.add_argument("--reps", type=int, default=3, help="rounds and references each (3)")
    opts = ap.parse_args()
    cluster = runner.cluster_from_env(os.environ)
    assert cluster is not None, "start me with torch.distributed.run"
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    net = os.environ.get("BENCH_HOSTID_PER_RANK") == "1"
    if net:
        os.environ["NCCL_HOSTID"] = f"gpunet-bench-{cluster.rank}"
    import torch as torch_

    gpu = cluster.local_rank % torch_.cuda.device_count()
    torch_.cuda.set_device(gpu)
    torch_.zeros(1, device="cuda")  # the CUDA context alone
    gpu_mem: dict[str, int | None] = {"CUDA context": process_memory(gpu)}
    host_mem = {"CUDA context": rss()}
    cap = memory_cap_for(opts.sizes)
    # One process group for every part (the runner keeps one too).
    probe = runner._Probe(args_for(opts.sizes, 5, 20, cap), cluster,
                          "net" if net else "intra", False)
    torch = probe.torch
    gpu_mem["process group"], host_mem["process group"] = process_memory(gpu), rss()
    world = probe.world
    logdir = tempfile.mkdtemp(prefix="probe-bench-")
    out: dict[str, Any] = {
        "world_size": world, "scope": probe.scope, "gpu": torch.cuda.get_device_name(probe.device),
        "gpus_visible": torch.cuda.device_count(), "nccl": probe._nccl_version(),
        "torch": torch.__version__, "cuda_module_loading": module_loading(),
        "sizes": list(opts.sizes), "memory_cap_bytes": cap, "reps": opts.reps,
        "probe_iterations": 20, "reference_loop": REFERENCE_LOOP}

    # 1. accuracy
    out["accuracy"] = accuracy(probe, opts.sizes, opts.reps, logdir)
    gpu_mem["after a round (cache released: between rounds)"] = process_memory(gpu)
    host_mem["after a round (cache released: between rounds)"] = rss()
    reserved_between = torch.cuda.memory_reserved(probe.device)

    # 2. memory: the same round with its buffers left in PyTorch's cache (the runner before
    # it released them), then released again
    release = probe._release
    probe._release = lambda: None  # type: ignore[method-assign]
    probe.round(time.time(), logdir)
    probe._release = release  # type: ignore[method-assign]
    gpu_mem["after a round, cache kept (the runner before)"] = process_memory(gpu)
    reserved_kept = torch.cuda.memory_reserved(probe.device)
    torch.cuda.empty_cache()
    gpu_mem["that cache released"] = process_memory(gpu)

    # 3. cost of a default round, after a warm-up round
    probe.args = args_for([8 << 10, 1 << 20, 64 << 20], 5, 20, cap)
    torch.cuda.reset_peak_memory_stats(probe.device)
    probe.round(time.time(), logdir)  # warm-up round
    gpu_seconds = 0.0
    original = probe._time_size

    def timed(nbytes: int) -> tuple[list[float], float]:
        nonlocal gpu_seconds
        times, loop = original(nbytes)
        # warm-up iterations are not event-timed: counted at the per-iteration times' rate
        gpu_seconds += sum(times) * (5 + 20) / 20 + loop
        return times, loop

    probe._time_size = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    result = probe.round(time.time(), logdir)
    wall = time.perf_counter() - t0
    probe._time_size = original  # type: ignore[method-assign]
    per_rank = probe._gather([gpu_seconds, wall, float(torch.cuda.max_memory_allocated()),
                              float(reserved_between), float(reserved_kept)])
    stages = probe._gather([float(v or 0) for v in gpu_mem.values()])
    hosts = probe._gather([float(v) for v in host_mem.values()])
    out["memory"] = {
        "process_gpu_MiB_max_rank (NVML)": {k: max(r[i] for r in stages) / MIB
                                            for i, k in enumerate(gpu_mem)},
        "process_gpu_MiB_per_rank_between_rounds": [
            r[list(gpu_mem).index("after a round (cache released: between rounds)")] / MIB
            for r in stages],
        "host_rss_MiB_max_rank": {k: max(r[i] for r in hosts) / MIB
                                  for i, k in enumerate(host_mem)},
        "torch_reserved_MiB_max_rank_between_rounds": max(r[3] for r in per_rank) / MIB,
        "torch_reserved_MiB_max_rank_cache_kept": max(r[4] for r in per_rank) / MIB,
        "torch_peak_allocated_MiB_max_rank_default_round": max(r[2] for r in per_rank) / MIB,
    }
    out["default_round"] = {
        "sizes": [(s["bytes"], round(s.get("busbw_bytes_per_second", 0) / 1e9, 2),
                   round(s.get("median_seconds", 0) * 1e6, 1),
                   round(s.get("loop_seconds", 0) * 1e6, 1)) for s in result["sizes"]],
        "sizes_columns": ["bytes", "busbw GB/s (loop)", "median us", "loop us"],
        "gpu_time_ms_max_rank": max(r[0] for r in per_rank) * 1e3,
        "wall_ms_max_rank": max(r[1] for r in per_rank) * 1e3,
    }
    probe.close()
    if cluster.rank == 0:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
