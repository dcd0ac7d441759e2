"""Accuracy and cost of the probe, on GPUs (docs/benchmarks.md, "probe").

    python3 -m torch.distributed.run --standalone --nproc-per-node 2 bench/probe_bench.py

With BENCH_HOSTID_PER_RANK=1 every rank gets its own NCCL_HOSTID (the probe's net scope: NCCL
goes through its network), and ranks may share a GPU (local rank modulo the GPUs).

Every rank builds the runner's own probe state (exporter/probe/runner.py ``_Probe``: one process
group, its memory cap, its timing loop) and, in the same process on the same GPUs:

1. accuracy: the probe's bus bandwidth at 256 MiB (its own tight loop after the per-iteration
   timed all-reduces, the shortest of the ranks' loop times) against a tight loop written here:
   50 back-to-back all-reduces between two CUDA events, no synchronisation in between (the
   nccl-tests way); target within 10 %. The tight loop's time is the slowest rank's average;
2. cost: a default round (8 KiB, 1 MiB, 64 MiB; 5 warm-up and 20 timed iterations each) after
   warm-up: the GPU time of its all-reduces (sum of CUDA-event times) and wall time, and the
   GPU memory it holds: PyTorch's peak allocation and the process's total as NVML reports it
   (NCCL's own buffers included); target under 100 ms of GPU time and under 1 GiB per GPU.

Rank 0 prints one JSON object. Keep NCCL_NVLS_ENABLE=0 set on shared multi-GPU machines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

from gpunet_exporter.probe import runner


def args_for(sizes: list[int], warmup: int, iterations: int) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    runner.add_run_arguments(p)
    return p.parse_args(["--state-dir", "/tmp", "--backend", "nccl", "--memory-cap", "1GiB",
                         "--sizes", ",".join(map(str, sizes)), "--warmup", str(warmup),
                         "--iterations", str(iterations), "--no-skip-busy"])


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


def main() -> None:
    cluster = runner.cluster_from_env(os.environ)
    assert cluster is not None, "start me with torch.distributed.run"
    os.environ.setdefault("NCCL_DEBUG", "WARN")
    net = os.environ.get("BENCH_HOSTID_PER_RANK") == "1"
    if net:
        os.environ["NCCL_HOSTID"] = f"gpunet-bench-{cluster.rank}"
    big = 256 << 20
    import torch as torch_

    gpu = cluster.local_rank % torch_.cuda.device_count()
    torch_.cuda.set_device(gpu)
    torch_.zeros(1, device="cuda")  # the CUDA context alone
    memory = {"context": process_memory(gpu)}
    # One process group for both parts (the runner keeps one too), with the default 1 GiB cap.
    probe = runner._Probe(args_for([big], 5, 20), cluster, "net" if net else "intra", False)
    torch, dist = probe.torch, probe.dist
    memory["process group"] = process_memory(gpu)
    world = probe.world
    out: dict[str, Any] = {"world_size": world, "gpu": torch.cuda.get_device_name(probe.device),
                           "nccl": probe._nccl_version(), "torch": torch.__version__}

    # 1. accuracy at 256 MiB
    times, loop = probe._time_size(big)
    rows = probe._gather([*times, loop])
    stats = runner.summarize_times([r[:-1] for r in rows], [r[-1] for r in rows], big, world)
    buf = torch.zeros(big // 4, dtype=torch.float32, device=probe.device)
    for _ in range(5):
        dist.all_reduce(buf)
    torch.cuda.synchronize()
    tight = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            dist.all_reduce(buf)
        end.record()
        end.synchronize()
        tight.append(start.elapsed_time(end) / 1000 / 50)
    del buf
    tight_t = max(probe._gather([statistics.median(tight)]))[0]
    tight_busbw = runner.bus_bandwidth(big / tight_t, world)
    out["accuracy_256MiB"] = {
        "probe_busbw_GBps": stats.busbw_bytes_per_second / 1e9,
        "tight_loop_busbw_GBps": tight_busbw / 1e9,
        "probe_over_tight": stats.busbw_bytes_per_second / tight_busbw,
        "probe_median_us": stats.median_seconds * 1e6, "tight_loop_us": tight_t * 1e6}

    # 2. cost of a default round, after a warm-up round
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    memory["after 256 MiB runs, cache emptied"] = process_memory(gpu)
    probe.args = args_for([8 << 10, 1 << 20, 64 << 20], 5, 20)
    logdir = tempfile.mkdtemp(prefix="probe-bench-")
    probe.round(time.time(), logdir)  # warm-up round
    gpu_seconds = 0.0
    original = probe._time_size

    def timed(nbytes: int) -> tuple[list[float], float]:
        nonlocal gpu_seconds
        times, loop = original(nbytes)
        gpu_seconds += sum(times) * (5 + 20) / 20 + loop
        return times, loop

    probe._time_size = timed  # type: ignore[method-assign]
    t0 = time.perf_counter()
    result = probe.round(time.time(), logdir)
    wall = time.perf_counter() - t0
    # Warm-up iterations are not event-timed: counted at the per-iteration times' rate.
    gpu_total = gpu_seconds
    used = process_memory(gpu)
    memory["after a default round"] = used
    per_rank = probe._gather([gpu_total, wall, float(torch.cuda.max_memory_allocated()),
                              float(used or 0)])
    stages = probe._gather([float(v or 0) for v in memory.values()])
    out["process_gpu_memory_MiB_max_rank"] = {
        k: max(r[i] for r in stages) / 2**20 for i, k in enumerate(memory)}
    out["default_round"] = {
        "sizes": [(s["bytes"], round(s.get("busbw_bytes_per_second", 0) / 1e9, 2),
                   round(s.get("median_seconds", 0) * 1e6, 1)) for s in result["sizes"]],
        "gpu_time_ms_max_rank": max(r[0] for r in per_rank) * 1e3,
        "wall_ms_max_rank": max(r[1] for r in per_rank) * 1e3,
        "torch_peak_allocated_MiB_max_rank": max(r[2] for r in per_rank) / 2**20,
        "process_gpu_memory_MiB_max_rank (NVML, NCCL included)": max(r[3] for r in per_rank)
        / 2**20,
    }
    probe.close()
    if cluster.rank == 0:
        print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
