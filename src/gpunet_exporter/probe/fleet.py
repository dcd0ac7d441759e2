"""``gpunet-probe fleet``: run a pairing plan across nodes and write each node's ``pairs.json``.

Started once per node by Slurm (srun) or torchrun; the nodes meet in torch.distributed's
rendezvous store, rank 0 makes the plan (probe/plan.py), each pair runs ``gpunet-probe run`` in
cluster mode on GPUs free of other work (probe/idle.py), and every node writes its view
(probe/pairs.py). The steps, the barrier, busy GPUs and the exit codes: docs/fleet.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Protocol

import yaml

from gpunet_exporter.errors import ConfigError, short
from gpunet_exporter.files import read_regular
from gpunet_exporter.flags import Parser
from gpunet_exporter.probe import (
    adaptive,
    idle,
    pairs,
    pairworker,
    plan,
    results,
    run_options,
    runner,
)
from gpunet_exporter.sources import nvml
from gpunet_exporter.sources.sysfs import Root, parse_uint

PROG = "gpunet-probe fleet"
# A pair's all-reduces per size: 5 warm-up, 10 timed, 10 in the tight loop. Half the node
# probe's 20: a pair is measured once a plan (hourly), and judged against the fleet's median of
# many pairs, not on its own; over sockets the round's all-reduces are most of a pair's time
# (docs/benchmarks.md, "Time per plan": 2.0 of a 2.9 s round against 3.6 to 4.2 of 4.6 s).
PAIR_ITERATIONS = 10
KINDS = ("ring", "random", "leaf", "repair", adaptive.KIND)
NODE_ENV = ("GPUNET_NODE", "SLURMD_NODENAME")
LEAF_ENV = "GPUNET_LEAF"
PREFIX = "gpunet-fleet/"
FLEET_SUBDIR = "fleet"
# A node name becomes a label value and a directory name: a DNS name's characters.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
# Environment of torchrun's agent that must not reach a pair's ranks: with it, the pair's
# rendezvous would look for the agent's store instead of serving its own.
_AGENT_ENV = ("TORCHELASTIC_", "GROUP_", "ROLE_", "LOCAL_WORLD_SIZE", "TORCH_NCCL_ASYNC")
VIEW_SECONDS = 2.0  # how long a node waits for a peer's view once every live node put its own
EXIT_BAD_ARGS = 2
EXIT_RENDEZVOUS = 4
WATCH_SECONDS = 0.5  # how often a running pair end looks at the GPUs and at its peer


class FleetError(Exception):
    """Bad arguments or node names; the text says what, in one line."""


class Store(Protocol):
    """The part of torch.distributed's Store the fleet uses (tests pass a HashStore)."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def wait(self, keys: list[str], timeout: timedelta) -> None: ...
    def check(self, keys: list[str]) -> bool: ...


@dataclass(frozen=True)
class Member:
    node: str
    address: str
    leaf: str | None


@dataclass(frozen=True)
class Turn:
    """One node's part in one round: its peer, and whether it serves the pair's rendezvous."""
    round: int
    peer: str
    peer_leaf: str | None
    serve: bool
    master: str  # the address of the end that serves
    port: int


# -- arguments -----------------------------------------------------------------------------

def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = run_options.default
    p.add_argument("--state-dir", required=True,
                   help="the exporter's probe.state_dir: pairs.json is written there")
    p.add_argument("--kind", choices=KINDS, default="ring", help="the pairing plan (ring)")
    p.add_argument("--max-rounds", type=int, default=adaptive.MAX_ROUNDS,
                   help=f"adaptive: the most rounds of a pass ({adaptive.MAX_ROUNDS})")
    p.add_argument("--slow-ratio", type=float, default=adaptive.SLOW_RATIO,
                   help="adaptive: a pair under this fraction of the pass's median bus "
                        f"bandwidth counts as slow, as a failed one does ({adaptive.SLOW_RATIO})")
    p.add_argument("--hops", type=int, default=1,
                   help="ring: pair each node with the next HOPS nodes, 2 x HOPS pairs per node "
                        "(2: four pairs, what the fleet rules judge a node by most robustly) (1)")
    p.add_argument("--seed", type=int, default=None,
                   help="random, adaptive: the shuffle's seed (default: rank 0's clock, so "
                        "runs differ)")
    p.add_argument("--suspects", default="", help="repair: the suspect nodes, comma-separated")
    p.add_argument("--good", default=None,
                   help="repair: the known-good nodes (default: every node not a suspect)")
    p.add_argument("--node-name", dest="node", default=None,
                   help="this node's name (default $GPUNET_NODE, $SLURMD_NODENAME, the short "
                        "hostname)")
    p.add_argument("--leaf", default=None,
                   help="this node's rack or leaf switch (default $GPUNET_LEAF; leaf plans "
                        "need it on every node)")
    p.add_argument("--leaves-from", default=None, metavar="PATH",
                   help="where this node's leaf is looked up when --leaf and $GPUNET_LEAF are "
                        "not set: a directory with one file per node name holding its leaf (a "
                        "mounted Kubernetes ConfigMap), or a YAML file mapping node names to "
                        "leaves")
    p.add_argument("--address", default=None,
                   help="the address peers reach this node at (default: this node's address "
                        "on the route to MASTER_ADDR)")
    p.add_argument("--port", type=int, default=29600,
                   help="the port a pair's serving end listens on (29600)")
    p.add_argument("--gpus-per-node", type=int, default=1,
                   help="ranks per node in each pair: GPUs (nccl) or processes (gloo) (1)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=d("backend"),
                   help="nccl on GPUs (default), gloo on CPUs")
    p.add_argument("--sizes", type=run_options.parse_sizes, default=list(d("sizes")),
                   help=f"all-reduce message sizes (default {run_options.sizes_text(d('sizes'))})"
                        ": the latency is the smallest's, the bus bandwidth the largest's")
    p.add_argument("--warmup", type=int, default=d("warmup"), help="untimed all-reduces per size")
    p.add_argument("--iterations", type=int, default=PAIR_ITERATIONS,
                   help="timed all-reduces per size, then as many in the tight loop "
                        f"({PAIR_ITERATIONS}: with the warm-up, 25 all-reduces per size)")
    p.add_argument("--nvml.module", dest="nvml_module", default="pynvml", metavar="MODULE",
                   help="Python module implementing the pynvml API through which a pair end "
                        "checks that no other process is on the node's GPUs (default pynvml, "
                        "from nvidia-ml-py); tests name a stand-in here")
    p.add_argument("--path.procfs", dest="procfs", default="/proc", metavar="DIR",
                   help="the host's procfs, where NVML's process IDs are looked up (default "
                        "/proc; in a container with a PID namespace of its own, the host's "
                        "/proc mounted there)")
    p.add_argument("--pair-timeout", type=float, default=120.0,
                   help="seconds a pair may take, rendezvous included, before it is killed and "
                        "recorded failed (120)")
    p.add_argument("run_args", nargs=argparse.REMAINDER,
                   help="after --: more `gpunet-probe run` options for every pair")


def _check(args: argparse.Namespace) -> None:
    if args.gpus_per_node < 1:
        raise FleetError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if not 0 < args.pair_timeout <= 86400:
        raise FleetError(f"--pair-timeout must be above 0 and at most 86400, got "
                         f"{args.pair_timeout}")
    if not 1 <= args.port <= 65535:
        raise FleetError(f"--port must be a TCP port, got {args.port}")
    if not 1 <= args.hops <= 16:
        raise FleetError(f"--hops must be from 1 to 16, got {args.hops}")
    if not 1 <= args.max_rounds <= adaptive.MAX_ROUNDS_LIMIT:
        raise FleetError(f"--max-rounds must be from 1 to {adaptive.MAX_ROUNDS_LIMIT}, got "
                         f"{args.max_rounds}")
    if not 0 <= args.slow_ratio <= 1:
        raise FleetError(f"--slow-ratio must be from 0 to 1, got {args.slow_ratio}")
    if args.kind == "repair" and not _names(args.suspects):
        raise FleetError("a repair plan needs --suspects")
    extra = list(args.run_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    elif extra:
        raise FleetError(f"unknown arguments {' '.join(extra)!r} (run options go after --)")
    args.run_args = extra
    taken = {"--state-dir", "--rounds", "--scope", "--timeout", "--nprocs", "--interval"}
    clash = [a for a in extra if a.split("=")[0] in taken]
    if clash:
        raise FleetError(f"{clash[0]} is set by the fleet itself, not after --")


def node_name(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    name = args.node or next((env[k] for k in NODE_ENV if env.get(k)), "") \
        or socket.gethostname().split(".")[0]
    if not _NAME.match(name):
        raise FleetError(f"node name {name!r}: letters, digits, '.', '_' and '-' only, at most "
                         f"253, starting with a letter or digit (set --node-name or GPUNET_NODE)")
    return name


MAX_LEAVES_BYTES = 4 << 20  # a YAML map of 10,000 nodes is well under 1 MiB


def leaf_from(path: str, node: str) -> str | None:
    """``node``'s leaf from ``--leaves-from``: the file ``<path>/<node>`` of a directory, or the
    entry of a YAML mapping; None when the node is not listed. FleetError for a file that
    cannot be read or is not such a mapping."""
    try:
        if os.path.isdir(path):
            entry = os.path.join(path, node)
            if not os.path.lexists(entry):
                return None
            text = read_regular(entry, 4096).decode("utf-8").strip()
            return text or None
        data = yaml.safe_load(read_regular(path, MAX_LEAVES_BYTES))
    except (ConfigError, OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise FleetError(f"--leaves-from {path}: {str(exc).splitlines()[0]}") from exc
    if not isinstance(data, dict):
        raise FleetError(f"--leaves-from {path}: expected a mapping of node names to leaves")
    leaf = data.get(node)
    if leaf is not None and not isinstance(leaf, str):
        raise FleetError(f"--leaves-from {path}: the leaf of {node!r} must be a string, got "
                         f"{short(leaf)}")
    return leaf or None


def route_address(host: str, port: int) -> str:
    """This host's source address towards ``host``: what a peer on that network reaches."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    family, kind, proto, _, addr = info[0]
    with socket.socket(family, kind, proto) as s:
        s.connect(addr)  # UDP: no packet is sent, the kernel only picks the route
        return str(s.getsockname()[0])


# -- the plan, made once by rank 0 ---------------------------------------------------------

def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def schedules(members: Sequence[Member], args: argparse.Namespace, seed: int
              ) -> tuple[plan.Plan, dict[str, list[Turn]]]:
    """The plan for ``members`` and each node's turns in it; FleetError for a plan that cannot
    be made (two nodes of one name, a leaf plan without leaves)."""
    seen = by_name(members)
    nodes = sorted(seen, key=_natural)
    leaves = {m.node: m.leaf for m in members if m.leaf}
    try:
        made = plan.make(args.kind, nodes, seed=seed, hops=args.hops,
                         suspects=_names(args.suspects),
                         good=None if args.good is None else _names(args.good),
                         leaves=leaves or None)
    except plan.PlanError as exc:
        raise FleetError(str(exc)) from exc
    turns: dict[str, list[Turn]] = {n: [] for n in nodes}
    for r, rnd in enumerate(made):
        for node, t in round_turns(r, rnd, seen, args.port).items():
            turns[node].append(t)
    return made, turns


def by_name(members: Sequence[Member]) -> dict[str, Member]:
    """``members`` by node name; FleetError for two nodes of one name."""
    seen: dict[str, Member] = {}
    for m in members:
        if m.node in seen:
            raise FleetError(f"node name {m.node!r} is used by two nodes ({seen[m.node].address}"
                             f" and {m.address}): set --node-name or GPUNET_NODE")
        seen[m.node] = m
    return seen


def round_turns(r: int, rnd: plan.Round, seen: Mapping[str, Member], port: int
                ) -> dict[str, Turn]:
    """Each node's turn in round ``r``: the first node of a pair serves; pairs of the round
    served at one address (one host) take the next ports."""
    out: dict[str, Turn] = {}
    serving: dict[str, int] = {}
    for a, b in rnd:
        master = seen[a].address
        at = port + serving.get(master, 0)
        serving[master] = serving.get(master, 0) + 1
        out[a] = Turn(r, b, seen[b].leaf, True, master, at)
        out[b] = Turn(r, a, seen[a].leaf, False, master, at)
    return out


def _turn_json(t: Turn) -> dict[str, Any]:
    return {"round": t.round, "peer": t.peer, "peer_leaf": t.peer_leaf, "serve": t.serve,
            "master": t.master, "port": t.port}


def _turn(d: Mapping[str, Any]) -> Turn:
    return Turn(int(d["round"]), str(d["peer"]), d.get("peer_leaf"), bool(d["serve"]),
                str(d["master"]), int(d["port"]))


# -- one pair, one end ---------------------------------------------------------------------

def pair_dir(state_dir: str, peer: str) -> str:
    return os.path.join(state_dir, FLEET_SUBDIR, peer)


def child_env(env: Mapping[str, str], turn: Turn, local: int, gpus: int) -> dict[str, str]:
    out = {k: v for k, v in env.items() if not k.startswith(_AGENT_ENV)}
    out.update({"RANK": str((0 if turn.serve else 1) * gpus + local),
                "WORLD_SIZE": str(2 * gpus), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(gpus), "MASTER_ADDR": turn.master,
                "MASTER_PORT": str(turn.port)})
    return out


# -- the node's GPUs (issue 31) --------------------------------------------------------------

def verdict(foreign: Collection[int] | None, backend: str) -> str | None:
    """Why a pair end must not run, or must stop, given the foreign processes on this node's
    GPUs (None: NVML cannot say): ``busy`` with one, ``unknown`` when nothing is known and the
    pair would use the GPUs (nccl; a gloo pair holds no GPU: there is nothing to protect);
    None when it may run."""
    if foreign is None:
        return pairs.UNKNOWN if backend == "nccl" else None
    return pairs.BUSY if foreign else None


class End(Protocol):
    """A running rank of a pair end: a pair worker (pairworker.Worker) or any process with
    the same calls (commands.Child)."""

    pid: int

    def poll(self) -> int | None: ...
    def wait(self, timeout: float) -> int | None: ...
    def kill(self) -> int | None: ...


class Gpus:
    """This node's GPUs as its pair ends see them: the processes on them that are not the
    fleet's (probe/idle.py). The fleet's own are those of this process's session and
    of the sessions of its pair workers, each a session of its own (commands.Child)."""

    def __init__(self, module: str, procfs: str, backend: str) -> None:
        self.session = nvml.session(module)
        self.procfs = Root(procfs)
        self.backend = backend
        self.known_own: set[int] = set()

    def look(self, ranks: Sequence[End] = ()) -> tuple[str, str] | None:
        """(reason, what was seen) when the end must not run now; None when it may."""
        # The node's own probe (the exporter's runner) is no job to wait for: it yields to
        # the pair's ranks, as to any process that is not its own.
        found = idle.foreign_on_gpus(self.session, self.procfs,
                                     {os.getsid(0), *(c.pid for c in ranks)}, self.known_own,
                                     self.backend, probes_are_own=True)
        reason = verdict(found, self.backend)
        if reason is None:
            return None
        if found:
            return reason, (f"the GPUs are busy: {idle.describe(found, self.procfs)} is not "
                            "the probe's")
        why = self.session.error or "NVML cannot list their processes"
        return reason, f"cannot tell whether the GPUs are free ({why})"


def _no_word() -> str | None:
    return None


def pair_workers(args: argparse.Namespace, gpus: Gpus) -> pairworker.Workers:
    """The node's pair workers for a pass: each runs ``gpunet-probe run``'s round with the
    fleet's options and those after --, one pair after another; killed between pairs too when
    ``gpus`` stop being free."""
    run = run_options.RunOptions(
        state_dir=args.state_dir, scope="inter", rounds=1, timeout_seconds=args.pair_timeout,
        backend=args.backend, sizes=tuple(args.sizes), warmup=args.warmup,
        iterations=args.iterations)
    argv = [sys.executable, "-m", "gpunet_exporter.probe.cli", "pair-worker",
            *run_options.argv(run), *args.run_args]
    return pairworker.Workers(argv, args.state_dir, gpus.look)


def run_pair(args: argparse.Namespace, turn: Turn, env: Mapping[str, str], gpus: Gpus,
             peer_yielded: Callable[[], str | None] = _no_word,
             workers: pairworker.Workers | None = None) -> pairs.Pair:
    """This node's end of one pair: its ranks run by the node's pair workers (``workers``, kept
    from pair to pair; without them, workers of this pair's own), watched and waited for up to
    the pair timeout, and what its local rank 0 wrote, as this node's view of the pair.

    No rank starts when ``gpus`` are not free, and the idle workers are killed; the ranks are
    killed the moment they stop being free, or when ``peer_yielded`` returns the reason the
    peer's end did not run (it is asked every WATCH_SECONDS): in all three cases the pair is not
    measured (``skipped``). A killed worker is started afresh for the node's next pair."""
    own = workers is None
    workers = workers or pair_workers(args, gpus)
    try:
        with workers.pair():
            return _run_pair(args, turn, env, gpus, peer_yielded, workers)
    finally:
        if own:
            workers.close()


def _run_pair(args: argparse.Namespace, turn: Turn, env: Mapping[str, str], gpus: Gpus,
              peer_yielded: Callable[[], str | None], workers: pairworker.Workers
              ) -> pairs.Pair:
    where = pair_dir(args.state_dir, turn.peer)
    os.makedirs(where, exist_ok=True)
    path = results.result_path(where, "inter")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # an earlier run's result must not pass for this one's
    log_path = os.path.join(where, "probe.log")
    # Appended to, unbuffered: the workers write their lines into it too.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
    with open(fd, "wb", buffering=0) as log:
        stop = gpus.look(workers.running())
        if stop is not None:  # before any rank: nothing of the probe's touches a GPU
            workers.kill()  # and the idle workers leave it too, with their CUDA contexts
            log.write(f"{PROG}: no rank started: {stop[1]}\n".encode())
            return _skipped(turn, *stop)
        started, began = time.monotonic(), time.time()
        ends: list[pairworker.Worker] = []
        try:
            for local in range(args.gpus_per_node):
                rank_env = child_env(env, turn, local, args.gpus_per_node)
                w, new = workers.get(local, rank_env, log)
                log.write(f"{PROG}: local rank {local}: pair worker {w.pid} "
                          f"({'started for this pair' if new else 'kept from an earlier pair'}"
                          f")\n".encode())
                w.send(pairworker.job_for(rank_env, where, log_path))
                ends.append(w)
        except OSError as exc:
            for w in ends:
                w.kill()
            return _failed(turn, f"cannot start gpunet-probe's pair worker: {exc}")
        codes, stop = _watch(ends, started + args.pair_timeout + 15, gpus, peer_yielded)
        log.write(f"{PROG}: pair end took {time.monotonic() - started:.3f} s (wall clock "
                  f"{began:.3f} to {time.time():.3f})\n".encode())
        if stop is not None:
            log.write(f"{PROG}: ranks killed: {stop[1]}\n".encode())
            return _skipped(turn, *stop)
    if any(rc is None for rc in codes):
        return _failed(turn, f"timed out after {args.pair_timeout:g} s (killed)")
    try:
        res = results.read(path)
    except (OSError, results.BadResult) as exc:
        return _failed(turn, f"no result (ranks exited {codes}): {exc}")
    return judge(turn, res, args.sizes, args.gpus_per_node, args.backend)


def _watch(children: Sequence[End], deadline: float, gpus: Gpus,
           peer_yielded: Callable[[], str | None]
           ) -> tuple[list[int | None], tuple[str, str] | None]:
    """Wait for the ranks until ``deadline`` (time.monotonic()), looking every WATCH_SECONDS at
    the GPUs and at the peer. The ranks' exit codes (None: killed at the deadline), and why
    they were killed before it, if they were."""
    while True:
        codes = [c.poll() for c in children]
        running = [c for c, rc in zip(children, codes, strict=True) if rc is None]
        if not running:
            return codes, None
        left = deadline - time.monotonic()
        if left <= 0:
            for c in running:
                c.kill()
            return codes, None  # None for each rank killed
        stop = gpus.look(children)
        if stop is None:
            word = peer_yielded()
            if word is not None:
                stop = (pairs.peer_reason(word), f"the peer's end did not run ({word})")
        if stop is not None:
            for c in children:
                c.kill()
            return codes, stop
        running[0].wait(min(WATCH_SECONDS, left))


def judge(turn: Turn, res: results.Result, sizes: Sequence[int], gpus: int, backend: str
          ) -> pairs.Pair:
    """This end's view of the pair from the result its local rank 0 wrote."""
    if not res.success:
        return _failed(turn, f"{res.failure}: {res.error}"[:500], res)
    measured = [s for s in res.sizes if not s.skipped and s.median_seconds > 0]
    if not measured or res.world_size != 2 * gpus:
        return _failed(turn, f"no size measured in a world of {res.world_size}", res)
    small = min(measured, key=lambda s: s.bytes)
    large = max(measured, key=lambda s: s.bytes)
    # A busy GPU (the runner's NVML check) skips the large sizes: the bandwidth of a small one
    # would pass for a slow pair, so the pair then has a latency and no bandwidth.
    full = large.bytes == max(sizes)
    return pairs.Pair(peer=turn.peer, ok=True, peer_leaf=turn.peer_leaf,
                      latency_seconds=small.median_seconds,
                      bus_bandwidth_bytes_per_second=large.busbw_bytes_per_second if full
                      else None, transport=_transport(res, backend), gdr=res.gdr)


def _transport(res: results.Result | None, backend: str) -> str | None:
    if res is not None and res.net_transports:
        return res.net_transports[0]
    if res is not None and res.net:
        return res.net
    return "Socket" if backend == "gloo" else None  # gloo's all-reduce runs over TCP


def _skipped(turn: Turn, reason: str, why: str) -> pairs.Pair:
    """Not measured, for ``reason`` (pairs.SKIP_REASONS): neither ok nor failed."""
    return pairs.Pair(peer=turn.peer, ok=False, peer_leaf=turn.peer_leaf, error=why[:500],
                      skipped=reason)


def _failed(turn: Turn, error: str, res: results.Result | None = None) -> pairs.Pair:
    return pairs.Pair(peer=turn.peer, ok=False, peer_leaf=turn.peer_leaf,
                      transport=None if res is None else _transport(res, res.backend),
                      gdr=None if res is None else res.gdr, error=error)


# -- the store -----------------------------------------------------------------------------

def _put(store: Store, key: str, value: Any) -> None:
    store.set(PREFIX + key, json.dumps(value))


def _take(store: Store, key: str, timeout: float) -> Any:
    store.wait([PREFIX + key], timedelta(seconds=timeout))
    return json.loads(store.get(PREFIX + key))


class Barriers:
    """Barriers of the fleet's ranks in the store, O(1) requests per rank. After a barrier that
    timed out, the next ones wait only for as many ranks as had arrived at it: one dead node
    costs one barrier's timeout, not one per round.

    The first rank whose wait times out releases the barrier for every rank waiting there,
    with the count that had arrived, so that they all leave together and agree on the count.
    Each leaving at its own deadline would spread them by their arrival times (up to a pair
    timeout: the dead node's partner arrives last), and the next round's pairs would start as
    far apart and miss their rendezvous."""

    def __init__(self, store: Store, world: int) -> None:
        self.store = store
        self.expected = world

    def wait(self, name: str, timeout: float) -> bool:
        """Wait until the expected ranks arrived at ``name``, or until ``timeout`` ran out here
        or at another rank; False when not all of them arrived (then fewer are expected from
        here on). StoreBroken when the store is gone."""
        key, done = PREFIX + name, PREFIX + name + "/done"
        timed_out = False
        try:
            arrived = self.store.add(key, 1)
            if arrived >= self.expected:
                self.store.set(done, str(arrived))
            self.store.wait([done], timedelta(seconds=timeout))
        except (RuntimeError, TimeoutError) as exc:  # torch's DistStoreError is a RuntimeError
            if not isinstance(exc, TimeoutError) and "timeout" not in str(exc).lower():
                raise StoreBroken(f"the rendezvous store is gone: {exc}") from exc
            timed_out = True
        try:
            if timed_out:
                self.store.set(done, str(self.store.add(key, 0)))
            released = int(self.store.get(done))
        except (RuntimeError, ValueError) as exc:
            raise StoreBroken(f"the rendezvous store is gone: {exc}") from exc
        everyone = released >= self.expected
        self.expected = max(1, min(self.expected, released))
        return everyone


class StoreBroken(Exception):
    """The rendezvous store stopped answering (its host is gone)."""


def _meet(store: Store, rank: int, world: int, me: Member, wait: float,
          plan_it: Callable[[list[Member]], int]) -> dict[str, Any] | None:
    """Every node's entry in the store; rank 0 reads them all and makes the plan with
    ``plan_it`` (the plan's rounds, or FleetError), and every node reads the plan's head. None
    after printing why the plan cannot be made (every node prints the same line)."""
    _put(store, f"member/{rank}", {"node": me.node, "address": me.address, "leaf": me.leaf})
    if rank == 0:
        members = [Member(**_take(store, f"member/{r}", wait)) for r in range(world)]
        try:
            _put(store, "plan", {"rounds": plan_it(members), "error": None})
        except FleetError as exc:
            _put(store, "plan", {"rounds": 0, "error": str(exc)})
    head: dict[str, Any] = _take(store, "plan", wait)
    if head["error"]:
        print(f"{PROG}: {head['error']}", file=sys.stderr)
        return None
    return head


def run(args: argparse.Namespace, store: Store, rank: int, world: int, me: Member,
        env: Mapping[str, str], seed: int, out: Any = sys.stdout) -> int:
    """The whole fleet run of one node, through ``store``. Returns the exit status."""
    if args.kind == adaptive.KIND:
        return run_adaptive(args, store, rank, world, me, env, seed, out)
    wait = args.pair_timeout + 60
    members: list[Member] = []

    def plan_all(got: list[Member]) -> int:
        members[:] = got
        made, turns = schedules(got, args, seed)
        for node, ts in turns.items():
            _put(store, f"turns/{node}", [_turn_json(t) for t in ts])
        return len(made)

    head = _meet(store, rank, world, me, wait, plan_all)
    if head is None:
        return EXIT_BAD_ARGS
    by_round = {t.round: t for t in (_turn(x) for x in _take(store, f"turns/{me.node}", wait))}
    mine: list[pairs.Pair] = []
    heard: list[Callable[[], str | None]] = []  # per pair: did its peer's end not run?
    barriers = Barriers(store, world)
    broken = False
    gpus = Gpus(args.nvml_module, args.procfs, args.backend)
    workers = pair_workers(args, gpus)  # kept from pair to pair for the pass (issue 35)
    for r in range(int(head["rounds"])):
        t = by_round.get(r)
        if t is not None:
            heard.append(_no_word if broken else _yielded(store, t))
            p = run_pair(args, t, env, gpus, heard[-1], workers)
            mine.append(p)
            if p.skipped is not None:
                print(f"{PROG}: {me.node}: round {r}: the pair with {t.peer} is not measured "
                      f"({p.skipped}): {p.error}", file=sys.stderr, flush=True)
            if p.skipped in (pairs.BUSY, pairs.UNKNOWN) and not broken:
                with contextlib.suppress(RuntimeError):  # the peer then waits for its ranks
                    _put(store, f"yield/{r}/{me.node}", p.skipped)
        if broken:
            continue  # no barriers without the store: the pairs' own rendezvous still pair up
        try:
            if not barriers.wait(f"round/{r}", args.pair_timeout + 20):
                print(f"{PROG}: {me.node}: not every node finished round {r}; going on, "
                      f"waiting for the {barriers.expected} of {world} that did",
                      file=sys.stderr)
        except StoreBroken as exc:
            print(f"{PROG}: {me.node}: {exc}; running this node's pairs alone", file=sys.stderr)
            broken = True
    workers.close()  # the pass's pairs are done: no CUDA context stays on the node
    if broken:
        write(args, me, mine)  # this node's own view: no peer to agree with
        return EXIT_RENDEZVOUS
    # A pair end that failed as its peer's yielded (the peer killed its ranks, ours saw the
    # connection go before the word came) was not measured either: every word is in by now,
    # each end put it before the round's barrier.
    mine = [_peer_did_not_run(p, ask()) if p.failed else p for p, ask in zip(mine, heard,
                                                                             strict=True)]
    _put(store, f"view/{me.node}", [pairs.pair_json(p) for p in mine])
    # Every node that is still there puts its view before this barrier; after it, a view that
    # is missing is a dead node's, and is not waited for. (Waiting for it, up to the rendezvous
    # timeout, once made the partner of a node that died after their pair miss the "done"
    # barrier, and rank 0's store was gone before it finished: exit 4.)
    try:
        barriers.wait("views", args.pair_timeout + 20)
    except StoreBroken as exc:
        print(f"{PROG}: {me.node}: {exc}", file=sys.stderr)
        write(args, me, mine)
        return EXIT_RENDEZVOUS
    write(args, me, [_agree(p, store, me.node, VIEW_SECONDS) for p in mine])
    if not barriers.wait("done", args.pair_timeout + 20):
        print(f"{PROG}: {me.node}: not every node finished", file=sys.stderr)
    if rank == 0:  # the others are done with the store, which rank 0 may be serving
        _summary(store, members, out)
    return 0


def _view(store: Store, node: str, timeout: float) -> list[dict[str, Any]] | None:
    try:
        got = _take(store, f"view/{node}", timeout)
    except (RuntimeError, TimeoutError, ValueError):
        return None
    return got if isinstance(got, list) else None


def _yielded(store: Store, turn: Turn) -> Callable[[], str | None]:
    """Asks the store whether the peer's end of ``turn`` did not run, and why (its reason); the
    busy end says so at once, so this end need not wait out the pair timeout for it. One
    request a call; a store that fails is not asked again."""
    key = f"yield/{turn.round}/{turn.peer}"
    up = [True]

    def ask() -> str | None:
        if not up[0]:
            return None
        try:
            if not store.check([PREFIX + key]):
                return None
            word = json.loads(store.get(PREFIX + key))
        except (RuntimeError, ValueError):
            up[0] = False
            return None
        return word if word in (pairs.BUSY, pairs.UNKNOWN) else pairs.BUSY

    return ask


def _peer_did_not_run(p: pairs.Pair, word: str | None, why: str | None = None) -> pairs.Pair:
    """``p``, or when the peer's end did not run (``word``, its reason), this end's pair not
    measured either."""
    if word is None:
        return p
    return pairs.Pair(peer=p.peer, ok=False, peer_leaf=p.peer_leaf,
                      error=f"the peer's end did not run: {why or word}"[:500],
                      skipped=pairs.peer_reason(word))


def agree(p: pairs.Pair, theirs: pairs.Pair | None) -> pairs.Pair:
    """This end's view ``p`` of a pair, given the view of the peer's end (None: no report; a
    silent peer's end finished with ours): ok only when both ends say so, and not measured
    on this end either when the peer's end did not run."""
    if p.skipped is not None or theirs is None:
        return p
    if theirs.skipped in (pairs.BUSY, pairs.UNKNOWN):
        return _peer_did_not_run(p, theirs.skipped, theirs.error)
    if p.ok and theirs.failed:
        return replace(p, ok=False, error=f"the peer's end failed: {theirs.error}"[:500])
    return p


def _entry(view: Sequence[Any] | None, peer: str) -> pairs.Pair | None:
    """The entry for ``peer`` of a node's view in the store; None when absent or malformed."""
    raw = next((q for q in view or () if isinstance(q, dict) and q.get("peer") == peer), None)
    try:
        return None if raw is None else pairs.parse_pair(raw, "a peer's view")
    except pairs.BadPairs:
        return None


def _agree(p: pairs.Pair, store: Store, node: str, timeout: float) -> pairs.Pair:
    """``p`` with the peer's end's view from the store (agree). A pair this end did not pass
    stays as it is, without waiting for the view of a peer that may be dead."""
    if not p.ok:
        return p
    return agree(p, _entry(_view(store, p.peer, timeout), node))


def write(args: argparse.Namespace, me: Member, mine: Sequence[pairs.Pair]) -> None:
    """This node's pairs.json: a repair plan's pairs merged into the file there, any other
    plan's pairs replacing it; nothing when this node had no pair."""
    if not mine:
        return
    got = list(mine)
    if args.kind == "repair":
        try:
            old = pairs.read(pairs.pairs_path(args.state_dir))
        except (OSError, pairs.BadPairs):
            old = None
        if old is not None:
            new = {p.peer for p in got}
            got = [p for p in old.pairs if p.peer not in new] + got
    pairs.write(args.state_dir, pairs.Pairs(node=me.node, plan=args.kind,
                                            round_timestamp=time.time(),
                                            pairs=tuple(got[:pairs.MAX_PAIRS]), leaf=me.leaf))


def _summary(store: Store, members: Sequence[Member], out: Any) -> None:
    """Rank 0: one JSON line per pair of the plan, as its serving end saw it, agreed with the
    other end's view (a pair not measured on either end is not measured)."""
    nodes = sorted((m.node for m in members), key=_natural)
    views = {n: _view(store, n, 1.0) for n in nodes}
    for n in nodes:
        for t in (_turn(x) for x in _take(store, f"turns/{n}", 1.0)):
            if t.serve:
                mine = _entry(views[n], t.peer)
                v = pairs.pair_json(agree(mine, _entry(views.get(t.peer), n))) if mine else \
                    {"ok": False, "error": "no report from this node"}
                print(json.dumps({"round": t.round, "node": n, **v, "peer": t.peer}), file=out,
                      flush=True)


# -- adaptive passes (issue 35) -------------------------------------------------------------

def run_adaptive(args: argparse.Namespace, store: Store, rank: int, world: int, me: Member,
                 env: Mapping[str, str], seed: int, out: Any = sys.stdout) -> int:
    """An adaptive pass (probe/adaptive.py): rank 0 plans one round at a time from the agreed
    outcomes of the rounds before, under ``adaptive/<round>`` in the store; each node runs its
    turn there, if it has one, and puts its end's view of it before the round's barrier. The
    end (views, agreement, pairs.json) is as in ``run``; rank 0 prints one line per pair of
    each round, as agreed when it planned the next, then the verdict. docs/fleet.md,
    "Adaptive plans"."""
    wait = args.pair_timeout + 60
    pass_: _Pass | None = None

    def plan_first(got: list[Member]) -> int:
        nonlocal pass_
        pass_ = _Pass(got, args, seed)
        return 0  # the rounds are planned one at a time

    if _meet(store, rank, world, me, wait, plan_first) is None:
        return EXIT_BAD_ARGS
    mine: list[pairs.Pair] = []
    heard: list[Callable[[], str | None]] = []
    barriers = Barriers(store, world)
    gpus = Gpus(args.nvml_module, args.procfs, args.backend)
    workers = pair_workers(args, gpus)  # kept from pair to pair for the pass, as in run()
    r = 0
    try:
        while True:
            if pass_ is not None:
                pass_.publish(store, r)
            if _take(store, f"adaptive/{r}", wait)["done"]:
                break
            key = PREFIX + f"adaptive/{r}/turn/{me.node}"
            if store.check([key]):
                t = _turn(json.loads(store.get(key)))
                heard.append(_yielded(store, t))
                p = run_pair(args, t, env, gpus, heard[-1], workers)
                mine.append(p)
                if p.skipped is not None:
                    print(f"{PROG}: {me.node}: round {r}: the pair with {t.peer} is not "
                          f"measured ({p.skipped}): {p.error}", file=sys.stderr, flush=True)
                    if p.skipped in (pairs.BUSY, pairs.UNKNOWN):
                        _put(store, f"yield/{r}/{me.node}", p.skipped)
                _put(store, f"adaptive/{r}/view/{me.node}", pairs.pair_json(p))
            if not barriers.wait(f"round/{r}", args.pair_timeout + 20):
                print(f"{PROG}: {me.node}: not every node finished round {r}; going on, "
                      f"waiting for the {barriers.expected} of {world} that did",
                      file=sys.stderr)
            if pass_ is not None:
                pass_.collect(store, r)
            r += 1
    except (StoreBroken, RuntimeError, TimeoutError) as exc:
        print(f"{PROG}: {me.node}: the rendezvous store failed in round {r}: {exc}",
              file=sys.stderr)
        write(args, me, _last_per_peer(mine))
        return EXIT_RENDEZVOUS
    finally:
        workers.close()  # the pass's pairs are done: no CUDA context stays on the node
    mine = [_peer_did_not_run(p, ask()) if p.failed else p for p, ask in zip(mine, heard,
                                                                             strict=True)]
    _put(store, f"view/{me.node}", [pairs.pair_json(p) for p in _last_per_peer(mine)])
    try:
        barriers.wait("views", args.pair_timeout + 20)
    except StoreBroken as exc:
        print(f"{PROG}: {me.node}: {exc}", file=sys.stderr)
        write(args, me, _last_per_peer(mine))
        return EXIT_RENDEZVOUS
    write(args, me, _last_per_peer([_agree(p, store, me.node, VIEW_SECONDS) for p in mine]))
    if not barriers.wait("done", args.pair_timeout + 20):
        print(f"{PROG}: {me.node}: not every node finished", file=sys.stderr)
    if pass_ is not None:  # the others are done with the store, which rank 0 may be serving
        for line in pass_.lines:
            print(json.dumps(line), file=out, flush=True)
        print(json.dumps(adaptive.verdict_json(adaptive.verdict(pass_.state))), file=out,
              flush=True)
    return 0


def _last_per_peer(mine: Sequence[pairs.Pair]) -> list[pairs.Pair]:
    """One entry per peer, the last measurement (a pair run again replaces its first)."""
    return list({p.peer: p for p in mine}.values())


class _Pass:
    """Rank 0's side of an adaptive pass: the planner's state and the measurements so far."""

    def __init__(self, members: Sequence[Member], args: argparse.Namespace, seed: int) -> None:
        self.seen = by_name(members)
        nodes = sorted(self.seen, key=_natural)
        leaves = {m.node: m.leaf for m in members if m.leaf}
        self.args = args
        try:
            self.state = adaptive.start(nodes, leaves, max_rounds=args.max_rounds, seed=seed)
        except plan.PlanError as exc:
            raise FleetError(str(exc)) from exc
        self.measured: list[dict[plan.Pair, tuple[str, float | None]]] = []
        self.round: plan.Round = []
        self.lines: list[dict[str, Any]] = []  # one per pair and round, as _summary's

    def publish(self, store: Store, r: int) -> None:
        """Round ``r``'s turns, each under its node's key, then the round's head."""
        rnd = adaptive.next_round(self.state)
        self.round = rnd or []
        for node, t in round_turns(r, self.round, self.seen, self.args.port).items():
            _put(store, f"adaptive/{r}/turn/{node}", _turn_json(t))
        _put(store, f"adaptive/{r}", {"done": rnd is None, "pairs": len(self.round)})

    def collect(self, store: Store, r: int) -> None:
        """Round ``r``'s outcomes from both ends' views, agreed, into the planner's state. A
        view missing after the barrier is a dead node's: its pair failed."""
        got: dict[plan.Pair, tuple[str, float | None]] = {}
        for a, b in self.round:
            va, vb = (self._view(store, r, a, b), self._view(store, r, b, a))
            p = agree(va, vb) if va is not None else vb
            seen = {"ok": False, "error": "no report from either end"} if p is None else \
                pairs.pair_json(p)
            self.lines.append({"round": r, "node": a, **seen, "peer": b})
            if p is None or p.failed:
                got[(a, b)] = (adaptive.FAILED, None)
            elif p.skipped is not None:
                got[(a, b)] = (adaptive.SKIPPED, None)
            else:
                got[(a, b)] = (adaptive.OK, p.bus_bandwidth_bytes_per_second)
        self.measured.append(got)
        state = adaptive.start(self.state.nodes, self.state.leaves,
                               max_rounds=self.state.max_rounds, seed=self.state.seed)
        for outcomes in adaptive.with_slow(self.measured, self.args.slow_ratio):
            state = adaptive.record(state, outcomes)
        self.state = state

    @staticmethod
    def _view(store: Store, r: int, node: str, peer: str) -> pairs.Pair | None:
        key = PREFIX + f"adaptive/{r}/view/{node}"
        try:
            if not store.check([key]):
                return None
            p = pairs.parse_pair(json.loads(store.get(key)), "a peer's view")
        except (RuntimeError, ValueError, pairs.BadPairs):
            return None
        return p if p.peer == peer else None


# -- entry point ---------------------------------------------------------------------------

def main(argv: Sequence[str]) -> int:
    p = Parser(prog=PROG, description="run a pairing plan across nodes; pairs.json on each")
    add_arguments(p)
    args = p.parse_args(list(argv))
    env = dict(os.environ)
    try:
        _check(args)
        cluster = runner.cluster_from_env(env)
        if cluster is None:
            raise FleetError("start one per node with srun (MASTER_ADDR, MASTER_PORT set) or "
                             "torchrun: RANK and WORLD_SIZE are not set")
        master = env.get("MASTER_ADDR", "")
        port = parse_uint(env.get("MASTER_PORT", "")) or 0
        if not master or not port:
            raise FleetError("MASTER_ADDR and MASTER_PORT must be set (the rendezvous)")
        node = node_name(args, env)
        leaf = args.leaf if args.leaf is not None else env.get(LEAF_ENV) or None
        if leaf is None and args.leaves_from:
            leaf = leaf_from(args.leaves_from, node)
        if leaf is not None and not _NAME.match(leaf):
            raise FleetError(f"leaf {leaf!r}: letters, digits, '.', '_' and '-' only")
        me = Member(node, args.address or route_address(master, port), leaf)
    except (FleetError, OSError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_BAD_ARGS
    try:
        warnings.filterwarnings("ignore", message=".*NumPy.*")
        from torch.distributed.rendezvous import rendezvous

        store, rank, world = next(rendezvous(
            "env://", cluster.rank, cluster.world_size,
            timeout=timedelta(seconds=args.pair_timeout + 60)))
    except Exception as exc:  # torch raises many kinds; one line either way
        print(f"{PROG}: {me.node}: rendezvous at {master}:{port} failed: {exc}",
              file=sys.stderr)
        return EXIT_RENDEZVOUS
    seed = args.seed if args.seed is not None else int(time.time())
    try:
        return run(args, store, rank, world, me, env, seed)
    except (RuntimeError, TimeoutError, StoreBroken) as exc:
        print(f"{PROG}: {me.node}: the rendezvous store failed: {exc}", file=sys.stderr)
        return EXIT_RENDEZVOUS
