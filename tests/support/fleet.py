"""Start ``gpunet-probe fleet`` once per simulated node, the way srun or torchrun would.

``start(nodes)`` starts one process per ``Launch``: either with the environment srun gives a
task plus MASTER_ADDR/MASTER_PORT (``launcher="srun"``), or under torchrun with the c10d
rendezvous (``launcher="torchrun"``: ``python -m torch.distributed.run --nnodes=N
--nproc-per-node=1 --rdzv-backend=c10d``), optionally inside a network namespace.
``finish(procs)`` waits for them and returns (exit status, output) per node.

A node's GPUs can be the NVML stand-in's (``fake_gpus``), whose processes a test lists in a file,
``<gpu index> <pid>`` per line; ``foreign_process()`` is a process to list there, one that is
not the fleet's (a session of its own), as a training job's would be.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from support import fake_nvml, netns

# Small and quick: gloo on CPU, two sizes.
QUICK = ("--backend", "gloo", "--sizes", "64KiB,1MiB", "--warmup", "1", "--iterations", "3")


def fake_gpus(processes: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    """The `gpunet-probe fleet` options and environment of a node whose GPUs are the NVML
    stand-in's two H200, with the compute processes that ``processes`` lists."""
    return ("--nvml.module", fake_nvml.MODULE), fake_nvml.exporter_env(processes=processes)


@contextlib.contextmanager
def foreign_process() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a session of its own (not the fleet's, not pytest's), killed at the end."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        yield p
    finally:
        p.kill()
        p.wait()


@dataclass
class Launch:
    node: str
    state: Path
    args: Sequence[str] = ()
    ns: netns.Node | None = None  # run inside this namespace
    env: dict[str, str] = field(default_factory=dict)


def argv(launch: Launch, *, launcher: str, rank: int, world: int, master: str, port: int
         ) -> tuple[list[str], dict[str, str]]:
    fleet = ["--state-dir", str(launch.state), "--node-name", launch.node, *launch.args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **launch.env}
    if launch.ns is not None:
        env["GLOO_SOCKET_IFNAME"] = launch.ns.ifname
    if launcher == "srun":
        env.update({"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world),
                    "SLURM_LOCALID": "0", "MASTER_ADDR": master, "MASTER_PORT": str(port)})
        return [sys.executable, "-m", "gpunet_exporter.probe.cli", "fleet", *fleet], env
    if launcher == "torchrun":
        # One host of many namespaces: torchrun cannot tell by hostname which agent serves the
        # c10d store (on real nodes it can), so rank 0's launch says so.
        # Nor can it find each one's address by its hostname: --local-addr tells it.
        host = [f"--rdzv-conf=is_host={1 if rank == 0 else 0}",
                *([f"--local-addr={launch.ns.addr}"] if launch.ns is not None else [])]
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={world}", *host,
                "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{port}",
                "--rdzv-id=gpunet-test", "--max-restarts=0", "--monitor-interval=0.5",
                "-m", "gpunet_exporter.probe.cli", "fleet", *fleet], env
    raise ValueError(f"launcher {launcher!r}")


def start(launches: Sequence[Launch], *, launcher: str, master: str, port: int
          ) -> list[subprocess.Popen[str]]:
    procs: list[subprocess.Popen[str]] = []
    for rank, launch in enumerate(launches):
        cmd, env = argv(launch, launcher=launcher, rank=rank, world=len(launches),
                        master=master, port=port)
        kw = {"env": env, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        procs.append(netns.run_in(launch.ns, cmd, **kw) if launch.ns is not None
                     else subprocess.Popen(cmd, **kw))  # type: ignore[call-overload]
    return procs


def finish(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Each process's exit status and output; all are killed if one overruns ``timeout``."""
    out: list[tuple[int, str]] = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out
