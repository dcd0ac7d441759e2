"""The probe runner: rounds of micro all-reduces through torch.distributed, results to files.

Two ways to start it, one code path for the measurement:
- on a node (``gpunet-probe run``, what the exporter starts): a launcher keeps up to two groups of
  worker processes and drives their rounds one after the other, so they never share the GPUs:
  - ``intra``: one rank per local GPU over NCCL's intra-node paths (NVLink/P2P, SHM); only with
    at least two GPUs;
  - ``net``: the same GPUs (two ranks on one GPU when the node has one), each rank with its own
    ``NCCL_HOSTID``: NCCL takes them for separate hosts and must carry the all-reduce over its
    network, each rank pinned to the ACTIVE RDMA port nearest its GPU (``NCCL_IB_HCA``), so
    every NIC, GPUDirect RDMA and the path through the switch are exercised (NIC loopback);
- cluster mode: the same ``gpunet-probe run`` started by torchrun or srun on every node (their
  standard variables: RANK/WORLD_SIZE/LOCAL_RANK, or SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with
  MASTER_ADDR/MASTER_PORT); each node's local rank 0 writes the round's ``inter`` result.

A worker keeps its process group between rounds (NCCL is initialised once); a group that fails
or hangs is killed, its failure written to its result file, and started again next round.
Each round: for each message size, warm-up all-reduces, then timed ones, each on its own (CUDA
events and a synchronisation around each on GPUs, the monotonic clock on CPU), every rank timing
its own wait in the collective. An iteration's collective time is the shortest of its ranks'
times: the rank that arrived last waited least, and its time is the collective once everybody
was there. The difference to the others is the wait that rank imposed: the straggler
(``straggler()``). Per size: median, p99 and max of those. Then, the ranks started together, a
tight loop of as many all-reduces back to back (one event pair around the loop, nothing
synchronised inside, as nccl-tests times it): the per-iteration synchronisation costs more than
the collective itself on NVLink (a 64 MiB median of 403 us against 327 us in a loop on four
H100s), so the bandwidth comes from the loop: algorithm bandwidth = bytes x iterations / loop
time (the shortest of the ranks' loop times, as for an iteration); bus bandwidth = algbw x
2(n-1)/n (nccl-tests' all-reduce formula). Each size's buffer is freed, and PyTorch's cache of
it released, before the next: between rounds a rank holds its CUDA context and NCCL's buffers.
NCCL logs at INFO into ``<state-dir>/nccl``, and the parser (ncclog.py) says which network,
transports and HCAs carried the round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import select
import shutil
import signal
import socket
import statistics
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpunet_exporter.probe import results, run_options
from gpunet_exporter.probe.run_options import RunOptions
from gpunet_exporter.sources.commands import Child, CommandError, run_command
from gpunet_exporter.sources.sysfs import parse_uint
from gpunet_exporter.statefile import write_json

EXIT_ROUND_FAILED = 4
EXIT_NO_GPU = 3
EXIT_NO_TORCH = 5


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


def collective_times(matrix: Sequence[Sequence[float]]) -> list[float]:
    """Each iteration's collective time from every rank's own time (rows are ranks): the
    shortest, which is the time of the rank that arrived last, once everybody was there."""
    return [min(col) for col in zip(*matrix, strict=True)]


def summarize_times(matrix: Sequence[Sequence[float]], loops: Sequence[float], nbytes: int,
                    world_size: int) -> results.SizeResult:
    """Per-size statistics. The latencies from every rank's per-iteration times (``matrix``,
    rows are ranks); the bandwidth from every rank's time of its tight loop of as many
    all-reduces (``loops``, one per rank), of which the shortest is the loop's time: the rank
    that started last waited least, as in collective_times."""
    iterations = collective_times(matrix)
    med = statistics.median(iterations)
    loop = min(loops)
    algbw = nbytes * len(iterations) / loop if loop > 0 else 0.0
    return results.SizeResult(
        nbytes, False, med, percentile(iterations, 99), max(iterations), algbw,
        bus_bandwidth(algbw, world_size), loop)


@dataclass(frozen=True)
class Straggler:
    rank: int  # the rank that arrived last most often
    wait_seconds: float  # median over iterations of what the others waited for it
    wait_ratio: float  # that wait over the others' median time in the collective (0 to 1)
    late_share: float  # share of iterations in which it was the last to arrive


def straggler(matrix: Sequence[Sequence[float]]) -> Straggler | None:
    """Who arrives last and how long the others wait for it, from every rank's own time in
    each iteration (rows are ranks; no clock is shared between ranks, so this works across
    nodes too). In each iteration the rank that arrived last has the shortest time; the
    candidate is the rank that does so most often (the lowest among equals). Its wait is the
    median over iterations of (the other ranks' median time - its time), at least 0, and the
    ratio divides that by the others' median time: 0.5 means the others spent half their time
    in the collective waiting for it, i.e. they took twice as long. None with one rank."""
    if len(matrix) < 2 or not matrix[0]:
        return None
    cols = list(zip(*matrix, strict=True))
    late = [min(range(len(col)), key=lambda r, c=col: (c[r], r)) for col in cols]  # type: ignore[misc]
    counts = {r: late.count(r) for r in set(late)}
    cand = min(counts, key=lambda r: (-counts[r], r))
    waits, others = [], []
    for col in cols:
        rest = statistics.median(t for r, t in enumerate(col) if r != cand)
        waits.append(rest - col[cand])
        others.append(rest)
    wait = max(0.0, statistics.median(waits))
    total = statistics.median(others)
    return Straggler(cand, wait, min(1.0, wait / total) if total > 0 else 0.0,
                     counts[cand] / len(cols))


# -- the node's launcher ---------------------------------------------------------------------

CONTROL_ENV = "GPUNET_PROBE_CONTROL"  # "<command fd>,<reply fd>" of a launched worker
# Test hook "<rank>:<seconds>": that rank arrives late at each all-reduce timed on its own.
DELAY_ENV = "GPUNET_PROBE_DELAY"
LOG_SUBDIR = "nccl"
STOP_SECONDS = 5.0  # a stopped group's workers have this long to exit before they are killed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_COUNT_GPUS = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"


def _visible_gpus(timeout: float) -> int:
    """The CUDA devices the workers will see (0 without torch or CUDA), counted by a
    short-lived child: torch and the CUDA driver, once imported and initialised here, would
    stay in the launcher's memory (hundreds of MB) for its whole life for one number."""
    try:
        out = run_command([sys.executable, "-W", "ignore", "-c", _COUNT_GPUS], timeout)
    except CommandError:
        return 0
    lines = out.split()
    return (parse_uint(lines[-1]) or 0) if lines else 0


def _fail(state_dir: str, scope: str, reason: str, error: str, backend: str,
          started: float | None = None) -> None:
    now = time.time()
    write_json(results.result_path(state_dir, scope), {
        "version": results.VERSION, "scope": scope, "time": now,
        "started": now if started is None else started, "success": False, "failure": reason,
        "error": error[:500], "backend": backend})


def _said_since(state_dir: str, scope: str, since: float) -> bool:
    """Whether the scope's result file already tells of a round that ended after ``since``."""
    try:
        return results.read(results.result_path(state_dir, scope)).time >= since
    except (OSError, results.BadResult):
        return False


def write_status(state_dir: str, phase: str, scope: str, since: float, round_no: int) -> None:
    """What the launcher does now, for the exporter's supervisor: ``init`` (a group starts),
    ``round`` (a group measures) or ``sleep`` (until the next round), since when."""
    write_json(os.path.join(state_dir, results.STATUS), {
        "version": results.VERSION, "phase": phase, "scope": scope, "since": since,
        "round": round_no, "pid": os.getpid()})


def plan(scopes: Sequence[str], devices: int) -> dict[str, list[int]]:
    """Each scope's ranks, as the local device of each rank: intra needs two devices; net runs
    on every device, two ranks on one device when there is only one."""
    out: dict[str, list[int]] = {}
    if devices <= 0:
        return out
    if "intra" in scopes and devices >= 2:
        out["intra"] = list(range(devices))
    if "net" in scopes:
        out["net"] = [r % devices for r in range(max(devices, 2))]
    return out


class _Group:
    """The worker processes of one scope, driven over a pipe each: the launcher writes
    ``round <time>`` lines and reads ``ready``, ``done`` or ``failed`` lines. Each worker is a
    commands.Child in the launcher's own process group and session, not one of its own: the
    exporter's kill of the launcher's group takes them along, and the GPU busy check knows the
    probe's processes by that session (_Probe._own)."""

    def __init__(self, scope: str, devices: list[int], argv: Sequence[str], logdir: str,
                 backend: str) -> None:
        self.scope, self.devices, self.argv, self.logdir = scope, devices, argv, logdir
        self.backend = backend
        self.procs: list[Child] = []
        self.commands: list[int] = []
        self.replies: list[int] = []

    @property
    def running(self) -> bool:
        return bool(self.procs)

    def start(self) -> None:
        port = _free_port()
        n = len(self.devices)
        command = [sys.executable, "-m", "gpunet_exporter.probe.cli", "worker", *self.argv]
        for rank, device in enumerate(self.devices):
            cmd_r, cmd_w = os.pipe()
            rep_r, rep_w = os.pipe()
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "GPUNET_PROBE_LOG_DIR": self.logdir, "GPUNET_PROBE_SCOPE": self.scope,
                   "GPUNET_PROBE_DEVICE": str(device), CONTROL_ENV: f"{cmd_r},{rep_w}"}
            if self.scope == "net":
                # Separate hosts for NCCL (docs/probe.md "net scope"): no P2P, SHM or NVLS
                # between them, and no multi-node NVLink either, or it would not be the NIC.
                env["NCCL_HOSTID"] = f"gpunet-probe-net-{rank}"
                env.setdefault("NCCL_MNNVL_ENABLE", "0")
            try:
                self.procs.append(Child(command, stdout=None, stderr=None, env=env,
                                        pass_fds=(cmd_r, rep_w), own_group=False))
            finally:
                os.close(cmd_r)
                os.close(rep_w)
            self.commands.append(cmd_w)
            self.replies.append(rep_r)

    def send(self, line: str) -> bool:
        for fd in self.commands:
            try:
                os.write(fd, (line + "\n").encode())
            except OSError:
                return False
        return True

    def wait(self, expect: str, deadline: float, parent: int) -> str:
        """Until every worker replied ``expect``: "ok"; or, for "done", replied it or "renew"
        and one said "renew": "renew"; a worker failed or exited: "failed"; past the deadline:
        "timeout"; whoever started the launcher is gone: "orphaned"."""
        pending = dict(zip(self.replies, self.procs, strict=True))
        buffers = dict.fromkeys(pending, b"")
        renew = False
        while pending:
            if os.getppid() != parent:
                return "orphaned"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select(list(pending), [], [], min(left, 0.2))
            for fd in ready:
                chunk = os.read(fd, 4096)
                if not chunk:  # the worker closed its end: it exited
                    return "failed"
                buffers[fd] += chunk
                while b"\n" in buffers[fd]:
                    line, _, buffers[fd] = buffers[fd].partition(b"\n")
                    if line.strip() == b"failed":
                        return "failed"
                    if line.strip() == expect.encode():
                        pending.pop(fd, None)
                    elif expect == "done" and line.strip() == b"renew":
                        pending.pop(fd, None)
                        renew = True
            if any(p.poll() is not None for p in pending.values()):
                return "failed"
        return "renew" if renew else "ok"

    def stop(self) -> None:
        for fd in self.commands:  # EOF: the workers leave their loop and exit
            with contextlib.suppress(OSError):
                os.close(fd)
        deadline = time.monotonic() + STOP_SECONDS
        for p in self.procs:
            p.stop(max(0.1, deadline - time.monotonic()))
        for fd in self.replies:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.procs, self.commands, self.replies = [], [], []

    def kill(self) -> None:
        for p in self.procs:
            p.kill()
        self.stop()


def launch(args: RunOptions) -> int:
    """Run a node's probe groups round after round; returns the exit status. Each worker is
    given the same run options (run_options.argv)."""
    os.makedirs(args.state_dir, exist_ok=True)
    if importlib.util.find_spec("torch") is None:
        # Before anything that would import it (the GPU count's child, the workers): one line,
        # not a worker's traceback or a misleading "no CUDA device".
        for scope in args.scopes:
            _fail(args.state_dir, scope, "init_error", results.NO_TORCH, args.backend)
        print(f"gpunet-probe run: {results.NO_TORCH}", file=sys.stderr)
        return EXIT_NO_TORCH
    cluster = cluster_from_env(os.environ)
    if cluster is not None:  # started by torchrun or srun: this process is a rank itself
        return worker(args, cluster)
    if args.backend == "nccl":
        devices = _visible_gpus(args.timeout_seconds)
        if devices == 0:
            for scope in args.scopes:
                _fail(args.state_dir, scope, "no_gpu", "no CUDA device visible", args.backend)
            print("gpunet-probe: no CUDA device visible (CUDA_VISIBLE_DEVICES="
                  f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})", file=sys.stderr)
            return EXIT_NO_GPU
        devices = min(devices, args.nprocs) if args.nprocs > 0 else devices
    else:
        devices = args.nprocs if args.nprocs > 0 else 2
    # NCCL's logs of this launcher's workers, private (0700), cleared at every start: a
    # launcher killed with its process group leaves nothing behind anywhere else.
    logdir = os.path.join(args.state_dir, LOG_SUBDIR)
    shutil.rmtree(logdir, ignore_errors=True)
    os.makedirs(logdir, mode=0o700, exist_ok=True)
    argv = run_options.argv(args)
    groups = {scope: _Group(scope, devs, argv, logdir, args.backend)
              for scope, devs in plan(args.scopes, devices).items()}
    if "intra" in args.scopes and "intra" not in groups:
        print(f"gpunet-probe: {devices} GPU: the intra scope needs two; measuring the net "
              "scope only", file=sys.stderr)
    if not groups:
        return 0
    parent = os.getppid()
    round_no = 0
    with contextlib.suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while True:
            started = time.time()
            failed_last = False
            for scope, group in groups.items():
                outcome = _group_round(args, scope, group, round_no, parent)
                if outcome == "orphaned":
                    return 143
                failed_last |= outcome != "ok"
            round_no += 1
            if args.rounds and round_no >= args.rounds:
                return EXIT_ROUND_FAILED if failed_last else 0
            write_status(args.state_dir, "sleep", "", time.time(), round_no)
            while time.time() < started + args.interval_seconds:
                if os.getppid() != parent:  # whoever started us (the exporter) is gone
                    return 143
                time.sleep(min(0.2, max(0.0, started + args.interval_seconds - time.time())))
    finally:
        for group in groups.values():
            if group.running:
                group.kill()


def _group_round(args: RunOptions, scope: str, group: _Group, round_no: int,
                 parent: int) -> str:
    """One round of one group, starting it first when it is not running. A group that fails
    is killed (the next round starts it again) and its failure written unless it said why."""
    since = time.time()
    if not group.running:
        write_status(args.state_dir, "init", scope, since, round_no)
        group.start()
        outcome = group.wait("ready", time.monotonic() + args.timeout_seconds, parent)
        if outcome != "ok":
            return _group_failed(args, scope, group, outcome, since, "start")
    since = time.time()
    write_status(args.state_dir, "round", scope, since, round_no)
    outcome = group.wait("done", time.monotonic() + args.timeout_seconds, parent) \
        if group.send(f"round {since!r}") else "failed"
    if outcome == "renew":  # measured; NCCL fell back: a fresh group for the next round
        print(f"gpunet-probe: {scope}: NCCL fell back to a slower transport; the group starts "
              "anew next round, so that NCCL chooses again", file=sys.stderr)
        group.stop()
        return "ok"
    return outcome if outcome == "ok" else _group_failed(args, scope, group, outcome, since,
                                                         "round")


def _group_failed(args: RunOptions, scope: str, group: _Group, outcome: str,
                  since: float, what: str) -> str:
    group.kill()
    if outcome == "orphaned":
        return outcome
    if not _said_since(args.state_dir, scope, since):
        reason = "timeout" if outcome == "timeout" else "crash"
        error = (f"the {scope} probe's {what} took longer than {args.timeout_seconds:g}s" if
                 outcome == "timeout" else f"a {scope} probe worker exited during its {what}")
        _fail(args.state_dir, scope, reason, error, args.backend, since)
    print(f"gpunet-probe: {scope}: {what} {outcome}; the group starts again next round",
          file=sys.stderr)
    return outcome


# -- worker ----------------------------------------------------------------------------------


class _Control:
    """A launched worker's pipes: commands in, replies out."""

    def __init__(self, spec: str) -> None:
        cmd, rep = (int(x) for x in spec.split(","))
        self.commands = os.fdopen(cmd, "r", encoding="ascii")
        self.reply_fd = rep

    def reply(self, word: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self.reply_fd, f"{word}\n".encode())

    def next_round(self) -> float | None:
        """The next round's start time; None at EOF (the launcher stops us)."""
        for line in self.commands:
            parts = line.split()
            if len(parts) == 2 and parts[0] == "round":
                return float(parts[1])
        return None


def host_key() -> str:
    """What NCCL calls this rank's host: NCCL_HOSTID, else the host name and boot id."""
    if os.environ.get("NCCL_HOSTID"):
        return os.environ["NCCL_HOSTID"]
    boot = ""
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as fh:
        boot = fh.read().strip()
    return socket.gethostname() + boot


def pair_round(args: RunOptions, cluster: Cluster, master: str, port: int) -> int:
    """One round of ``gpunet-probe run --rounds 1`` in cluster mode, in this process: a process
    group of its own made through a TCPStore at ``master``:``port`` (served by rank 0), the
    round, its result written by local rank 0, the group destroyed and PyTorch's cache given
    back; the exit status ``gpunet-probe run`` would have. What the fleet's persistent pair
    worker (probe/pairworker.py) runs for each pair, one process for many pairs."""
    return worker(dataclasses.replace(args, rounds=1), cluster, (master, port))


def worker(args: RunOptions, cluster: Cluster | None = None,
           rendezvous: tuple[str, int] | None = None) -> int:
    """One rank: init the process group once, then rounds: on the launcher's command when it
    has one, else every --interval until --rounds (cluster mode), or until a failure. The
    group meets through MASTER_ADDR and MASTER_PORT, or through a TCPStore at ``rendezvous``
    (host, port) when given (pair_round)."""
    cluster = cluster or cluster_from_env(os.environ)
    if cluster is None:
        print("gpunet-probe worker: RANK and WORLD_SIZE are not set", file=sys.stderr)
        return 2
    control = _Control(os.environ[CONTROL_ENV]) if os.environ.get(CONTROL_ENV) else None
    scope = args.scope if args.scope != "auto" else os.environ.get(
        "GPUNET_PROBE_SCOPE", "intra" if control else "inter")
    writer = cluster.local_rank == 0  # rank 0 of the node writes the node's result
    logdir = os.environ.get("GPUNET_PROBE_LOG_DIR") or os.path.join(args.state_dir, LOG_SUBDIR)
    os.makedirs(logdir, mode=0o700, exist_ok=True)
    if args.backend == "nccl":
        os.environ["NCCL_DEBUG"] = "INFO"  # into the private directory, whatever the exporter has
        os.environ["NCCL_DEBUG_FILE"] = os.path.join(logdir, f"nccl.{scope}.%h.%p.log")
        # CUDA's modules loaded as used, not all at the start (less GPU and host memory): the
        # default since CUDA 12.2; PyTorch sets it too, but only at its CUDA initialisation,
        # after _Probe's first device query has initialised the driver.
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    marks = log_marks(logdir)  # NCCL's log of this process so far: not this group's
    began = time.monotonic()
    try:
        probe = _Probe(args, cluster, scope, control is not None, rendezvous)
    except Exception as exc:
        if writer:
            reason = "no_gpu" if isinstance(exc, _NoGpu) else "init_error"
            _fail(args.state_dir, scope, reason, f"{type(exc).__name__}: {exc}", args.backend)
        print(f"gpunet-probe: {scope} rank {cluster.rank}: cannot start: {exc}", file=sys.stderr)
        if control:
            control.reply("failed")
        return EXIT_NO_GPU if isinstance(exc, _NoGpu) else EXIT_ROUND_FAILED
    probe.log_marks = marks
    if rendezvous is not None:  # a pair worker's: its pair's probe.log tells the group's cost
        print(f"gpunet-probe: {scope} rank {cluster.rank} of {cluster.world_size}: group up in "
              f"{time.monotonic() - began:.3f} s", file=sys.stderr, flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    round_no = 0
    try:
        if control:
            control.reply("ready")
        while True:
            if control:
                started = control.next_round()
                if started is None:
                    return 0
            else:
                started = time.time()
            try:
                result = probe.round(started, logdir)
            except Exception as exc:
                if writer:
                    text = f"{type(exc).__name__}: {exc}"
                    reason = "nccl_error" if "nccl" in text.lower() else "error"
                    _fail(args.state_dir, scope, reason, text, args.backend, started)
                print(f"gpunet-probe: {scope} rank {cluster.rank}: round failed: {exc}",
                      file=sys.stderr)
                if control:
                    control.reply("failed")
                return EXIT_ROUND_FAILED
            if writer:
                write_json(results.result_path(args.state_dir, scope), result)
            if control:
                # Every rank has the same merged transports, so all say the same.
                control.reply("renew" if probe.fell_back(result) else "done")
                continue
            round_no += 1
            if args.rounds and round_no >= args.rounds:
                return 0
            time.sleep(max(0.0, args.interval_seconds - (time.time() - started)))
    finally:
        probe.close()


class _NoGpu(RuntimeError):
    pass


def own_logs(logdir: str) -> list[str]:
    """The names of this process's NCCL logs in ``logdir`` (NCCL_DEBUG_FILE's ``%p``);
    raises OSError when the folder cannot be listed."""
    return [n for n in os.listdir(logdir) if n.endswith(f".{os.getpid()}.log")]


def log_marks(logdir: str) -> dict[str, int]:
    """The sizes of this process's NCCL logs in ``logdir`` now. NCCL opens its debug file once
    per process, at its first use: a process that makes one group after another (the fleet's
    pair worker) has one file for all, and a group's lines are those after its marks."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for name in own_logs(logdir):
            with contextlib.suppress(OSError):
                out[name] = os.stat(os.path.join(logdir, name)).st_size
    return out


def _delay(rank: int) -> float:
    """The test hook: seconds this rank sleeps before each all-reduce timed on its own (not
    in the tight loop) (DELAY_ENV)."""
    spec = os.environ.get(DELAY_ENV, "")
    who, _, seconds = spec.partition(":")
    try:
        return float(seconds) if who.strip() and int(who) == rank else 0.0
    except ValueError:
        return 0.0


class _Probe:
    """A rank's persistent state: process group, device, buffers, NVML for the busy check."""

    def __init__(self, args: RunOptions, cluster: Cluster, scope: str,
                 launched: bool, rendezvous: tuple[str, int] | None = None) -> None:
        import torch
        import torch.distributed as dist

        from gpunet_exporter.sources.sysfs import Root

        # Typed loosely: torch's own annotations differ between the versions the probe runs on.
        self.torch: Any = torch
        self.dist: Any = dist
        self.args, self.cluster, self.scope, self.launched = args, cluster, scope, launched
        self.cuda = args.backend == "nccl"
        self.sysfs = Root(args.sysfs)
        self.delay = _delay(cluster.rank)
        self.gpu = parse_uint(os.environ.get("GPUNET_PROBE_DEVICE", "")) if launched else None
        self.pinned: Any = None  # placement.HcaPort this rank's NCCL uses, when pinned
        if self.cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
                raise _NoGpu("no CUDA device visible")
            index = (self.gpu if self.gpu is not None else cluster.local_rank) \
                % torch.cuda.device_count()
            self.gpu = index
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", index)
            total = torch.cuda.get_device_properties(index).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_bytes / total),
                                                       index)
            if max(args.sizes) > args.memory_cap_bytes // 2:
                raise ValueError(f"largest size {max(args.sizes)} does not fit the memory cap "
                                 f"{args.memory_cap_bytes} (needs twice the size)")
            if scope == "net" and args.pin_hca and "NCCL_IB_HCA" not in os.environ:
                self._pin_hca(index)
        else:
            self.device = torch.device("cpu")
        from datetime import timedelta
        self.log_marks: dict[str, int] = {}  # where this group's lines of NCCL's logs begin
        timeout = timedelta(seconds=args.timeout_seconds)
        # A store of the group's own (pair_round): dropped with the group at close(), so that
        # the next group of this process can serve at the same port.
        self.store: Any = None if rendezvous is None else self.dist.TCPStore(
            rendezvous[0], rendezvous[1], cluster.world_size, cluster.rank == 0,
            timeout=timeout)
        self.dist.init_process_group(
            args.backend, rank=cluster.rank, world_size=cluster.world_size,
            timeout=timeout, device_id=self.device if self.cuda else None,
            **({} if self.store is None else {"store": self.store}))
        self.world = cluster.world_size
        self.host = host_key()
        self.peers = self._gather_json({"pid": os.getpid(), "host": self.host, "gpu": self.gpu})
        self.pids = {int(p["pid"]) for p in self.peers}
        self.nvml: Any = None
        self.handle: Any = None
        self.rounds = 0
        if self.cuda and (args.skip_busy or scope == "intra"):
            self._open_nvml(index)
        # What this rank's GPU's NVLinks carry, the intra scope's measure (None elsewhere).
        self.nvlink: float | None = None
        if self.cuda and scope == "intra" and self.nvml is not None:
            from gpunet_exporter.sources import nvml as nvml_source
            try:
                self.nvlink = nvml_source.nvlink_bandwidth(self.nvml, self.handle)
            except Exception as exc:  # no NVLink measure, but the probe still runs
                print(f"gpunet-probe: rank {cluster.rank}: no NVLink bandwidth: {exc}",
                      file=sys.stderr)
        self._release()

    def _pci_address(self, index: int) -> str:
        props = self.torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        if bus is None:
            return ""
        return (f"{getattr(props, 'pci_domain_id', 0):04x}:{bus:02x}:"
                f"{getattr(props, 'pci_device_id', 0):02x}.0")

    def _pin_hca(self, index: int) -> None:
        from gpunet_exporter.probe import placement

        port = placement.nearest_port(self.sysfs, self._pci_address(index))
        if port is not None:  # NCCL's net plugin reads it at its first communicator
            os.environ["NCCL_IB_HCA"] = port.nccl_ib_hca
            self.pinned = port

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

    def _own(self, pid: int) -> bool:
        """A process of the probe's: a rank of this group, or (launched by the node's
        launcher) anything in the launcher's session, such as the other scope's ranks."""
        if pid in self.pids:
            return True
        if not self.launched:
            return False
        try:
            return os.getsid(pid) == os.getsid(0)
        except OSError:
            return False

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
        # NVML's utilization covers the last fraction of a second to a second: right after the
        # group started, that is the probe's own NCCL setup, so the first round goes by
        # processes alone. A node's own ranks (launched) go by processes alone always: the
        # exporter starts them on idle GPUs only, so what utilization they see is their own
        # other scope's round just before (4 H100s: one round of each scope skipped so,
        # docs/probe.md).
        busy = self.rounds > 0 and not self.launched and util > self.args.busy_utilization
        return busy or any(not self._own(int(p.pid)) for p in procs)

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def _release(self) -> None:
        """Give PyTorch's cached blocks (freed buffers and gather tensors) back to the driver,
        so that between rounds the rank holds only its CUDA context and NCCL's own buffers."""
        if self.cuda:
            self.torch.cuda.empty_cache()

    def _together(self) -> None:
        """Every rank here before any goes on: a one-element all-reduce, waited for."""
        self._sync()
        self.dist.all_reduce(self.torch.zeros(1, device=self.device))
        self._sync()

    def _time_size(self, nbytes: int) -> tuple[list[float], float]:
        """This rank's times of one size: of each timed all-reduce on its own (latency
        percentiles, the straggler), and of a tight loop of as many back to back (bandwidth).
        The warm-up is a loop too, waited for once at its end."""
        torch, dist = self.torch, self.dist
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device=self.device)
        for _ in range(self.args.warmup):
            dist.all_reduce(buf)
        self._sync()
        times = []
        for _ in range(self.args.iterations):
            if self.delay:
                time.sleep(self.delay)
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
        loop = self._time_loop(buf, self.args.iterations)
        del buf
        self._release()
        return times, loop

    def _time_loop(self, buf: Any, count: int) -> float:
        """This rank's time of ``count`` all-reduces back to back, the ranks started together:
        one pair of CUDA events around the loop (the monotonic clock on CPU), no host
        synchronisation inside it, as nccl-tests times it. No test-hook delay here: a late
        rank is the straggler's business, not the bandwidth's."""
        torch, dist = self.torch, self.dist
        self._together()
        if not self.cuda:
            t0 = time.perf_counter()
            for _ in range(count):
                dist.all_reduce(buf)
            return time.perf_counter() - t0
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(count):
            dist.all_reduce(buf)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000

    def _gather(self, values: list[float]) -> list[list[float]]:
        """Every rank's list of numbers (all of one length), in one all-gather and one copy
        to the host."""
        torch, dist = self.torch, self.dist
        local = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(out, local)
        return [row.tolist() for row in torch.stack(out).cpu()]

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
        return [json.loads(bytes(row.tolist()[: int(n[0])]))
                for row, n in zip(torch.stack(out).cpu(), sizes, strict=True)]

    def round(self, started: float, logdir: str) -> dict[str, Any]:
        torch, dist = self.torch, self.dist
        flag = torch.tensor([1.0 if self._busy() else 0.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must skip the same sizes
        busy = bool(flag.item())
        del flag
        sizes: list[dict[str, Any]] = []
        last: list[list[float]] | None = None
        for nbytes in self.args.sizes:
            if busy and self.args.skip_busy and nbytes >= self.args.busy_min_size:
                sizes.append({"bytes": nbytes, "skipped": True})
                continue
            times, loop = self._time_size(nbytes)
            rows = self._gather([*times, loop])  # one all-gather: the loop's time last
            matrix = [row[:-1] for row in rows]
            last = matrix  # the largest size measured decides stragglers
            stats = summarize_times(matrix, [row[-1] for row in rows], nbytes, self.world)
            sizes.append({"bytes": nbytes, "skipped": False, **{
                k: getattr(stats, k) for k in (
                    "median_seconds", "p99_seconds", "max_seconds", "algbw_bytes_per_second",
                    "busbw_bytes_per_second", "loop_seconds")}})
        out: dict[str, Any] = {
            "version": results.VERSION, "scope": self.scope, "started": started,
            "success": True, "backend": self.args.backend,
            "world_size": self.world, "nccl_version": self._nccl_version(), "sizes": sizes,
            "straggler": self._straggler(last),
            "skipped_busy": busy and any(s["skipped"] for s in sizes),
            **self._transport(logdir)}
        out["time"] = time.time()
        self.rounds += 1
        self._release()
        return out

    def _straggler(self, matrix: list[list[float]] | None) -> dict[str, Any] | None:
        s = straggler(matrix) if matrix else None
        if s is None:
            return None
        named = s.wait_ratio >= self.args.straggler_min_ratio
        peer = self.peers[s.rank]
        return {"rank": s.rank if named else None, "wait_seconds": s.wait_seconds,
                "wait_ratio": s.wait_ratio, "late_share": s.late_share,
                "gpu": peer.get("gpu") if named else None,
                "local": named and (self.launched or peer.get("host") == self.host)}

    def _nccl_version(self) -> str:
        if not self.cuda:
            return ""
        v = self.torch.cuda.nccl.version()
        return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)

    def _transport(self, logdir: str) -> dict[str, Any]:
        """What NCCL says it used, from every rank's INFO log, merged across ranks; and the
        RDMA ports this node's ranks used, with their link rates and GDR."""
        if not self.cuda:
            return {}
        from gpunet_exporter.nccl import log as ncclog
        from gpunet_exporter.probe import placement

        mine: list[Any] = []
        for name in own_logs(logdir):
            with contextlib.suppress(OSError):
                mine += ncclog.parse_file(os.path.join(logdir, name), self.log_marks.get(name, 0))
        ports: list[list[Any]] = []
        if self.pinned is not None:
            ports.append([self.pinned.device, self.pinned.port])
        else:
            for r in mine:
                for dev in r.hcas:
                    port = placement.first_active_port(self.sysfs, dev)
                    if port is not None and [dev, port] not in ports:
                        ports.append([dev, port])
        gdr = ncclog.summarize(mine).get("gdr")
        used = [{"device": d, "port": p, "gdr": gdr,
                 "rate": placement.port_rate(self.sysfs, d, p)} for d, p in ports]
        gathered = self._gather_json({"host": self.host, "reports": [r.to_dict() for r in mine],
                                      "ports": used, "nvlink": self.nvlink})
        reports = [ncclog.RankReport.from_dict(row) for g in gathered for row in g["reports"]]
        s = ncclog.summarize(reports)
        hcas, link = hca_usage([(g["host"], g["ports"]) for g in gathered], self.host)
        # The intra scope: the NVLink bandwidth every rank's GPU has, the least of them (None
        # when a rank could not tell).
        nvlinks = [g.get("nvlink") for g in gathered]
        nvlink = (min(nvlinks) if nvlinks and all(isinstance(v, (int, float)) for v in nvlinks)
                  else None)
        return {"net": s.get("net", ""), "transports": sorted(s.get("transports", [])),
                "net_transports": sorted(s.get("net_transports", [])), "gdr": s.get("gdr"),
                "problems": sorted(s.get("problems", [])), "hcas": hcas,
                "link_bytes_per_second": link, "nvlink_bytes_per_second": nvlink}

    def fell_back(self, result: Mapping[str, Any]) -> bool:
        """Whether this round's NCCL took a slower path than the node offers (sockets while an
        RDMA port is ACTIVE, NET between the node's own GPUs): NCCL chose its transports when
        this process group's communicators were made and keeps them, so the group must be made
        anew for a fixed fault to show (the launcher restarts it: "renew")."""
        from gpunet_exporter.sources import rdma

        return results.socket_fallback(
            self.scope, self.args.backend, result.get("transports", ()),
            result.get("net_transports", ()), lambda: bool(rdma.active_ports(self.sysfs)))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.dist.destroy_process_group()
        self.store = None
        self._release()  # a process that goes on (pair_round) keeps only its CUDA context
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


def hca_usage(per_rank: Sequence[tuple[str, Sequence[Mapping[str, Any]]]],
              host: str) -> tuple[list[dict[str, Any]], float | None]:
    """The RDMA ports the ranks on ``host`` used (device, port, their ranks, GDR, link rate),
    and the link bandwidth one rank can expect: over every host's ports, the lowest rate
    divided by the ranks sharing that port (a ring all-reduce sends and receives its bus
    bandwidth through each rank's NIC). None when no port's rate is known."""
    ports: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rank, (h, used) in enumerate(per_rank):
        for u in used:
            e = ports.setdefault((h, str(u["device"]), str(u["port"])), {
                "device": str(u["device"]), "port": str(u["port"]), "ranks": [],
                "gdr": u.get("gdr"), "rate_bytes_per_second": u.get("rate")})
            e["ranks"].append(rank)
            if u.get("gdr") is False or e["gdr"] is None:
                e["gdr"] = u.get("gdr")
    shares = [e["rate_bytes_per_second"] / len(e["ranks"]) for e in ports.values()
              if e["rate_bytes_per_second"]]
    mine = [e for (h, _, _), e in sorted(ports.items()) if h == host]
    return mine, (min(shares) if shares else None)
