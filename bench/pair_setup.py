"""What one fleet pair costs besides its all-reduces: two NCCL ranks on GPU 0 with their own
NCCL_HOSTID (so NCCL must take its network path), one process each for several pairs in a row,
as a launcher started once per node runs them. Per pair: TCPStore plus init_process_group
(device_id given: the communicator is made there), the first all-reduce, the default round
(8 KiB, 1 MiB, 64 MiB; 25 all-reduces each, GPU time from CUDA events) and
destroy_process_group. Needs torch with CUDA; prints one JSON line per rank.

    python3 bench/pair_setup.py [--pairs 5]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta


def rank_main(rank: int, pairs: int, port: int) -> None:
    os.environ["NCCL_HOSTID"] = f"pair-setup-{rank}"  # read once, at NCCL's first use
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    torch.ones(1, device="cuda")  # the CUDA context, outside the timed pairs
    torch.cuda.synchronize()
    out = []
    for i in range(pairs):
        t0 = time.perf_counter()
        store = dist.TCPStore(  # type: ignore[attr-defined]
            "127.0.0.1", port + i, 2, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("nccl", store=store, rank=rank, world_size=2,
                                device_id=torch.device("cuda:0"))
        t1 = time.perf_counter()
        x = torch.ones(1, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        gpu_ms = 0.0
        for nbytes in (8 << 10, 1 << 20, 64 << 20):
            buf = torch.empty(nbytes // 4, device="cuda")
            e0 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e1 = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e0.record()
            for _ in range(25):
                dist.all_reduce(buf)
            e1.record()
            torch.cuda.synchronize()
            gpu_ms += e0.elapsed_time(e1)
        t3 = time.perf_counter()
        dist.destroy_process_group()
        t4 = time.perf_counter()
        del store
        out.append({"init_s": t1 - t0, "first_allreduce_s": t2 - t1, "round_s": t3 - t2,
                    "round_gpu_ms": gpu_ms, "destroy_s": t4 - t3})
    print(json.dumps({"rank": rank, "pairs": out}), flush=True)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
        return 0
    pairs = int(sys.argv[2]) if len(sys.argv) == 3 and sys.argv[1] == "--pairs" else 5
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(pairs), "29700"],
                              env=env) for r in (0, 1)]
    return max(p.wait(timeout=600) for p in ranks)


if __name__ == "__main__":
    sys.exit(main())
