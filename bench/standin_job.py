"""A stand-in training job for ``bench/device_checks.py job`` (issue 31): one process per GPU,
NCCL, world = the GPUs; each step a few bf16 matmuls and one all-reduce, like a data-parallel
step (about 10 ms on an H100 with the defaults).

    python3 bench/standin_job.py --seconds 60 --out job.json [--reserve-all-but 300]

Each rank: records the Unix time of its first GPU allocation (the CUDA context comes with it),
joins the process group, warms up (cuBLAS workspace, NCCL's connections), then with
``--reserve-all-but MiB`` has PyTorch's caching allocator take all but that much of the GPU's
free memory (a tensor allocated and freed: the cache keeps it, as a real job's does), and steps
for ``--seconds``. Every step ends in a synchronisation, and its wall time is recorded. Rank 0
decides when to stop (time is up, SIGTERM or SIGINT, or the launching process is gone) and tells
the others through the step's own all-reduce, so every rank stops after the same step. Rank 0
prints ``ready <unix time>`` once every rank has reserved and warmed up.

``--out``: one JSON object with the versions, per rank the times (first allocation, ready, end)
and step statistics, and rank 0's step start times and durations. Exit status 0 when every rank
finished. NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 are
set unless the environment sets them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
             "NVSHMEM_DISABLE_NVLS": "1"}
MIB = 1 << 20


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def summary(ms: list[float], skip: int) -> dict[str, Any]:
    """Step statistics after the first ``skip`` steps (warm-up)."""
    kept = ms[skip:]
    if not kept:
        return {"steps": 0, "median_ms": None, "p99_ms": None}
    return {"steps": len(kept), "median_ms": statistics.median(kept),
            "p99_ms": percentile(kept, 99), "mean_ms": statistics.fmean(kept),
            "max_ms": max(kept)}


def reserve(torch: Any, dev: Any, keep_mib: int) -> dict[str, Any]:
    """Let the caching allocator hold all but ``keep_mib`` of the GPU's free memory: allocate
    that much and free it (smaller tries if the driver cannot give one block that large)."""
    free, total = torch.cuda.mem_get_info(dev)
    take = free - keep_mib * MIB
    got = 0
    while take > 256 * MIB:
        try:
            blob = torch.empty(take, dtype=torch.uint8, device=dev)
        except torch.cuda.OutOfMemoryError:
            take -= 256 * MIB
            continue
        got = take
        del blob  # back to PyTorch's cache, not to the driver
        break
    free_after, _ = torch.cuda.mem_get_info(dev)
    return {"free_before_mib": free // MIB, "total_mib": total // MIB, "taken_mib": got // MIB,
            "free_after_mib": free_after // MIB,
            "torch_reserved_mib": torch.cuda.memory_reserved(dev) // MIB}


def rank_main(rank: int, args: argparse.Namespace, world: int, parent: int) -> None:
    import torch
    import torch.distributed as dist

    stop = False

    def on_signal(*_: Any) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    cpu = args.cpu
    dev = torch.device("cpu") if cpu else torch.device("cuda", rank)
    dtype = torch.float32 if cpu else torch.bfloat16
    n = args.matmul_size
    first_alloc = time.time()
    if not cpu:
        torch.cuda.set_device(dev)
    a = torch.randn(n, n, device=dev, dtype=dtype)  # the CUDA context comes with it
    context_s = time.time() - first_alloc
    print(f"rank {rank}: first allocation at {first_alloc:.3f} (context {context_s:.2f} s)",
          flush=True)
    dist.init_process_group("gloo" if cpu else "nccl", rank=rank, world_size=world,
                            timeout=timedelta(seconds=args.nccl_timeout),
                            **({} if cpu else {"device_id": dev}))
    b = torch.randn(n, n, device=dev, dtype=dtype)
    c = torch.empty_like(a)
    # float32 zeros: the sum stays 0, and element 0 carries rank 0's stop flag
    buf = torch.zeros(args.allreduce_mib * MIB // 4, dtype=torch.float32, device=dev)

    def step(flag: float) -> float:
        for _ in range(args.matmuls):
            torch.matmul(a, b, out=c)
        if rank == 0:
            buf[:1].fill_(flag)
        dist.all_reduce(buf)
        return float(buf[0].item())  # waits for the step: the all-reduce and the matmuls

    for _ in range(3):  # cuBLAS workspace, NCCL's connections and buffers
        step(0.0)
    reserved = None
    if not cpu:
        torch.cuda.synchronize()
        if args.reserve_all_but is not None:
            reserved = reserve(torch, dev, args.reserve_all_but)
    step(0.0)  # every rank is here: warmed up and reserved
    ready = time.time()
    if rank == 0:
        print(f"ready {ready:.3f} world {world}"
              + (f" reserved {reserved}" if reserved else ""), flush=True)
    end = ready + args.seconds
    ms: list[float] = []
    starts: list[float] = []
    while True:
        want = 0.0
        if rank == 0 and (stop or time.time() >= end or os.getppid() != parent):
            want = 1.0
        start_unix = time.time()
        t = time.perf_counter()
        flag = step(want)
        ms.append((time.perf_counter() - t) * 1e3)
        starts.append(start_unix)
        if flag:
            break
    finished = time.time()
    rec: dict[str, Any] = {"rank": rank, "first_alloc_unix": first_alloc,
                           "context_seconds": context_s, "ready_unix": ready,
                           "end_unix": finished, "stopped_by": "signal" if stop else "time",
                           "reserve": reserved, **summary(ms, args.warmup_steps)}
    if rank == 0:
        rec["versions"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "world_size": world}
        if not cpu:
            v = torch.cuda.nccl.version()
            rec["versions"] |= {"nccl": ".".join(map(str, v)) if isinstance(v, tuple)
                                else str(v), "gpu": torch.cuda.get_device_name(dev)}
        rec["step_start_unix"] = starts
        rec["step_ms"] = ms
    dist.destroy_process_group()
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(rec))
    print(f"rank {rank}: {len(ms)} steps, median {statistics.median(ms):.3f} ms", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def merge(args: argparse.Namespace, world: int, error: str) -> None:
    ranks = []
    for r in range(world):
        path = Path(f"{args.out}.rank{r}")
        try:
            ranks.append(json.loads(path.read_text()))
            path.unlink()
        except (OSError, ValueError):
            ranks.append({"rank": r, "missing": True})
    r0 = ranks[0]
    out = {"world_size": world, "error": error, "args": vars(args),
           "versions": r0.get("versions"),
           "first_alloc_unix": min((r["first_alloc_unix"] for r in ranks
                                    if "first_alloc_unix" in r), default=None),
           "ready_unix": r0.get("ready_unix"),
           "end_unix": max((r["end_unix"] for r in ranks if "end_unix" in r), default=None),
           "step_start_unix": r0.pop("step_start_unix", []), "step_ms": r0.pop("step_ms", []),
           "ranks": ranks}
    Path(args.out).write_text(json.dumps(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60, help="stepping time after warm-up (60)")
    p.add_argument("--out", required=True, help="JSON file for the times and step statistics")
    p.add_argument("--reserve-all-but", type=int, metavar="MiB",
                   help="after warm-up, the caching allocator takes all but this much of each "
                        "GPU's free memory")
    p.add_argument("--nprocs", type=int, default=0, help="ranks, one per GPU (0: every GPU)")
    p.add_argument("--matmuls", type=int, default=6, help="bf16 matmuls per step (6)")
    p.add_argument("--matmul-size", type=int, default=8192, help="square matrices' side (8192)")
    p.add_argument("--allreduce-mib", type=int, default=256, help="all-reduce per step (256)")
    p.add_argument("--warmup-steps", type=int, default=20,
                   help="steps left out of the statistics (20)")
    p.add_argument("--nccl-timeout", type=float, default=120,
                   help="seconds before a hung collective takes the job down (120)")
    p.add_argument("--cpu", action="store_true",
                   help="check this script without GPUs: gloo, float32 on the CPU, two ranks "
                        "unless --nprocs (use a small --matmul-size)")
    args = p.parse_args()
    for k, v in NCCL_SAFE.items():
        os.environ.setdefault(k, v)
    import torch
    import torch.multiprocessing as mp

    world = args.nprocs or (2 if args.cpu else torch.cuda.device_count())
    if world < 1:
        print("standin_job: no CUDA device", file=sys.stderr)
        return 2
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(rank_main, args=(args, world, os.getpid()), nprocs=world,
                             join=False, start_method="spawn")

    def forward(signum: int, _: Any) -> None:  # rank 0 stops everyone after the step
        for pid in ctx.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    error = ""
    try:
        while not ctx.join(timeout=1):
            pass
    except Exception as exc:  # a rank failed: start_processes has ended the others
        error = f"{type(exc).__name__}: {exc}"
        print(f"standin_job: {error}", file=sys.stderr, flush=True)
    merge(args, world, error)
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
