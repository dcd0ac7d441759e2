"""A fleet of simulated nodes on one host: network namespaces joined by a Linux bridge, with
real TCP between them, and ``tc`` to make one node's link or one node pair's path slow.

Layout of ``fleet(n, prefix)``:

- one namespace per node, ``<prefix>-<pid>-<random>-n<i>``, with loopback up and one veth,
  ``eth0``, addressed ``10.233.0.<i+1>/24``;
- one more namespace, ``<prefix>-<pid>-<random>-br``, holding the bridge ``br0`` and the other
  end of every node's veth (``p<i>``). The bridge sits in a namespace of its own so that nothing
  is created in the root namespace: no interface, route or firewall rule of the host is touched,
  and since every fleet has its own bridge namespace, two fleets (parallel test runs) may use the
  same addresses without meeting;
- teardown deletes the fleet's namespaces, which deletes their veths and the bridge with them,
  even when the test failed. At start, namespaces left by an earlier run of this prefix whose
  process (the pid in the name) is gone are swept, best effort.

Shaping (this kernel's ``tc`` needs only ``tbf``, ``htb`` and the ``u32`` classifier; ``netem``,
for delay, is used only when a delay is asked for):

- ``shape_node(node, rate=...)``: a token bucket on the node's ``eth0`` (what it sends) and on
  its bridge port (what it receives): every path through that node's link is slow both ways;
- ``shape_pair(a, b, rate=...)``: on each of the two nodes' ``eth0``, an ``htb`` qdisc whose
  one class is rate limited and a ``u32`` filter sending only packets to the other node's
  address into it; everything else leaves unclassified, which ``htb`` sends at once, unshaped;
- ``unshape(*nodes)``: back to the default qdiscs.

``require()`` skips the test (with the reason) when not root or when ``ip`` or ``tc`` is missing
or namespaces cannot be made; CI runs as root, so it runs there.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUBNET = "10.233.0"
IFNAME = "eth0"


@dataclass(frozen=True)
class Node:
    index: int
    ns: str  # its network namespace
    addr: str  # its address on the fleet's bridge
    bridge_ns: str  # the namespace of the bridge and of its bridge port
    port: str  # the bridge-side end of its veth
    ifname: str = IFNAME  # its own end, inside ns


@dataclass(frozen=True)
class Fleet:
    nodes: tuple[Node, ...]
    bridge_ns: str

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    def __len__(self) -> int:
        return len(self.nodes)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", "netns", "exec", ns, "tc", *args], capture_output=True,
                       text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"tc {' '.join(args)} in {ns}: {r.stderr.strip()}")
    return r


def missing() -> str:
    """Why a fleet cannot be built here; empty when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs the suite as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    name = f"gpunet-check-{os.getpid()}-{secrets.token_hex(3)}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode:
        return f"`ip netns add` fails here: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return ""


def require() -> None:
    """Skip the calling test when a fleet cannot be built here."""
    import pytest

    reason = missing()
    if reason:
        pytest.skip(reason)


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (signal 0)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """The names of the host's named network namespaces."""
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
            if line.strip()]


def add_namespace(name: str) -> None:
    _ip("netns", "add", name)


def del_namespace(name: str) -> None:
    _ip("netns", "del", name, check=False)


def dead_pid() -> int:
    """The pid of a process that has exited (for sweep's tests)."""
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def pids_in(ns: str) -> list[int]:
    """The processes in a network namespace (``ip netns pids``)."""
    r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
    return [int(p) for p in r.stdout.split() if p.isdigit()]


def signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def run_pid(name: str, prefix: str) -> int | None:
    """The creating pid in a name ``<prefix>-<pid>-...``, or None."""
    if not name.startswith(prefix + "-"):
        return None
    pid = name[len(prefix) + 1:].split("-")[0]
    return int(pid) if pid.isdigit() else None


def sweep(prefix: str) -> list[str]:
    """Delete the namespaces of this prefix whose creating process is gone, killing what still
    runs in them first (deleting a namespace's name does not stop its processes); their names."""
    gone = []
    for name in namespaces():
        pid = run_pid(name, prefix)
        if pid is not None and not alive(pid):
            signal_all(pids_in(name), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


@contextlib.contextmanager
def fleet(n: int, prefix: str = "gpunet") -> Iterator[Fleet]:
    """``n`` nodes joined by a bridge (module docstring); everything is removed on exit."""
    if not 1 <= n <= 250:
        raise ValueError(f"1 to 250 nodes, not {n}")
    sweep(prefix)
    base = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
    made: list[str] = []
    try:
        bridge_ns = f"{base}-br"
        _ip("netns", "add", bridge_ns)
        made.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        nodes = []
        for i in range(n):
            ns = f"{base}-n{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            port = f"p{i}"
            _ip("link", "add", "name", IFNAME, "netns", ns, "type", "veth",
                "peer", "name", port, "netns", bridge_ns)
            _ip("-n", bridge_ns, "link", "set", port, "master", "br0")
            _ip("-n", bridge_ns, "link", "set", port, "up")
            addr = f"{SUBNET}.{i + 1}"
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            nodes.append(Node(i, ns, addr, bridge_ns, port))
        yield Fleet(tuple(nodes), bridge_ns)
    finally:
        for ns in reversed(made):
            _ip("netns", "del", ns, check=False)


def run_in(node: Node, argv: Sequence[str], **popen_kw: Any) -> subprocess.Popen[Any]:
    """Start ``argv`` inside the node's namespace (``ip netns exec``, no shell)."""
    return subprocess.Popen(["ip", "netns", "exec", node.ns, *argv], **popen_kw)


RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1}


def _bits(rate: str) -> float:
    """tc's rate ("400mbit", "1gbit", "5000bit") in bits per second."""
    for unit, scale in RATE_UNITS.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: a number and kbit, mbit, gbit or bit")


def _limit(rate: str | None, delay: str | None) -> list[str]:
    """A leaf qdisc: tbf for a rate alone, netem when a delay is asked for (with its rate).
    tbf's bucket holds 5 ms at the rate, at least 64 KiB (a veth's GSO packet): a smaller one
    at gigabit rates starves the link between the qdisc's timer wake-ups (1600mbit with 64 KiB
    gave half its rate)."""
    if delay:
        return ["netem", "delay", delay, *(["rate", rate] if rate else [])]
    if not rate:
        raise ValueError("a rate, a delay or both")
    burst = max(64 * 1024, int(_bits(rate) / 8 * 0.005))
    return ["tbf", "rate", rate, "burst", str(burst), "latency", "50ms"]


def shape_node(node: Node, rate: str | None = None, delay: str | None = None) -> None:
    """Every path through the node's link: its egress (eth0) and its ingress (the bridge port's
    egress), so both directions of every TCP connection to it are slow."""
    leaf = _limit(rate, delay)
    _tc(node.ns, "qdisc", "replace", "dev", node.ifname, "root", *leaf)
    _tc(node.bridge_ns, "qdisc", "replace", "dev", node.port, "root", *leaf)


def shape_pair(a: Node, b: Node, rate: str | None = None, delay: str | None = None) -> None:
    """Only traffic between ``a`` and ``b``: on each one's eth0, packets to the other's address
    go through a limited htb class; the rest is unclassified, which htb sends unshaped."""
    leaf = _limit(rate, delay)
    for src, dst in ((a, b), (b, a)):
        _tc(src.ns, "qdisc", "replace", "dev", src.ifname, "root", "handle", "1:", "htb")
        _tc(src.ns, "class", "add", "dev", src.ifname, "parent", "1:", "classid", "1:20",
            "htb", "rate", rate or "100gbit", "quantum", "60000")
        _tc(src.ns, "qdisc", "add", "dev", src.ifname, "parent", "1:20", "handle", "20:", *leaf)
        _tc(src.ns, "filter", "add", "dev", src.ifname, "parent", "1:", "protocol", "ip",
            "prio", "1", "u32", "match", "ip", "dst", f"{dst.addr}/32", "flowid", "1:20")


def unshape(*nodes: Node) -> None:
    """Remove what shape_node and shape_pair put on these nodes' links."""
    for node in nodes:
        _tc(node.ns, "qdisc", "del", "dev", node.ifname, "root", check=False)
        _tc(node.bridge_ns, "qdisc", "del", "dev", node.port, "root", check=False)


def qdiscs(node: Node) -> str:
    """``tc qdisc show`` of the node's two ends, for failure messages."""
    return (_tc(node.ns, "qdisc", "show", "dev", node.ifname, check=False).stdout
            + _tc(node.bridge_ns, "qdisc", "show", "dev", node.port, check=False).stdout)


# -- a two-rank all-reduce between two nodes, through the probe's cluster mode ---------------

@dataclass(frozen=True)
class PairResult:
    a: int
    b: int
    busbw: dict[int, float]  # bytes -> bus bandwidth, bytes/s (rank 0's inter.json)
    median: dict[int, float]  # bytes -> median seconds
    wall_seconds: float

    @property
    def largest_busbw(self) -> float:
        return self.busbw[max(self.busbw)]


def measure_pair(a: Node, b: Node, state_root: Path, sizes: str = "1MiB,16MiB",
                 warmup: int = 1, iterations: int = 4, timeout: float = 60.0) -> PairResult:
    """Run ``python -m gpunet_exporter.probe.cli run`` in both namespaces with the environment
    torchrun would give one rank per node (RANK, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR: a's
    address), gloo bound to each node's eth0; both write inter.json into their own state
    directory, read back with gpunet_exporter.probe.results."""
    from gpunet_exporter.probe import results

    port = str(20000 + secrets.randbelow(20000))
    procs = []
    dirs = []
    started = time.monotonic()
    for rank, node in enumerate((a, b)):
        state = state_root / f"pair-{a.index}-{b.index}-n{node.index}"
        state.mkdir(parents=True, exist_ok=True)
        dirs.append(state)
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0",
               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": a.addr, "MASTER_PORT": port,
               "GLOO_SOCKET_IFNAME": node.ifname}
        procs.append(run_in(node, [
            sys.executable, "-m", "gpunet_exporter.probe.cli", "run", "--backend", "gloo",
            "--sizes", sizes, "--warmup", str(warmup), "--iterations", str(iterations),
            "--rounds", "1", "--timeout", str(timeout), "--state-dir", str(state)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout + 30)
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    wall = time.monotonic() - started
    for p, out, node in zip(procs, outs, (a, b), strict=True):
        if p.returncode:
            raise AssertionError(f"rank on node {node.index} exited {p.returncode}: "
                                 f"{out[-2000:]}")
    res = results.read(results.result_path(str(dirs[0]), "inter"))
    if not res.success or res.world_size != 2:
        raise AssertionError(f"pair {a.index}-{b.index}: {res}")
    return PairResult(a.index, b.index,
                      {s.bytes: s.busbw_bytes_per_second for s in res.sizes if not s.skipped},
                      {s.bytes: s.median_seconds for s in res.sizes if not s.skipped}, wall)
