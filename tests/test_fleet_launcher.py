"""``gpunet-probe fleet`` (gpunet_exporter.probe.fleet): the schedule each node gets, the
environment of a pair's ranks, the file each node writes, bad input, and a real run of four nodes on
loopback (gloo over TCP, started with srun's environment) that writes the ring's pairs on both
ends of every pair. Issue 31: a pair end runs only on GPUs free of other work (the NVML
stand-in's, whose processes the test lists): the decision, the watch, and real runs with a
node busy from the start and a node that gets busy mid-pair."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from gpunet_exporter.probe import adaptive, fleet, pairs, pairworker, plan, results, runner
from gpunet_exporter.sources import nvml
from gpunet_exporter.sources.commands import Child

from support import fake_nvml
from support import fleet as launch
from support.exporter import free_port
from support.wait import wait_for


def args(*extra: str, state: Path | str = "/nonexistent") -> argparse.Namespace:
    p = argparse.ArgumentParser()
    fleet.add_arguments(p)
    a = p.parse_args(["--state-dir", str(state), *extra])
    fleet._check(a)
    return a


def members(n: int, address: str | None = None, leaves: dict[str, str] | None = None
            ) -> list[fleet.Member]:
    return [fleet.Member(f"node{i}", address or f"10.0.0.{i + 1}", (leaves or {}).get(f"node{i}"))
            for i in range(n)]


# -- the schedule --------------------------------------------------------------------------

def test_every_pair_of_the_plan_is_one_turn_on_each_end() -> None:
    ms = members(10)
    made, turns = fleet.schedules(list(reversed(ms)), args("--kind", "ring"), seed=0)
    # natural order, not the order the nodes arrived in: node2 before node10
    assert made == plan.ring([f"node{i}" for i in range(10)])
    for r, rnd in enumerate(made):
        for a, b in rnd:
            ta = next(t for t in turns[a] if t.round == r)
            tb = next(t for t in turns[b] if t.round == r)
            assert (ta.peer, tb.peer, ta.serve, tb.serve) == (b, a, True, False)
            assert ta.master == tb.master == f"10.0.0.{int(a[4:]) + 1}"  # the serving end's
    assert all(len(ts) == 2 for ts in turns.values())  # a ring: two pairs per node


def test_pairs_served_at_one_address_get_their_own_ports() -> None:
    _, turns = fleet.schedules(members(6, address="127.0.0.1"), args("--port", "30000"), seed=0)
    for r in (0, 1):
        ports = sorted(t.port for ts in turns.values() for t in ts if t.round == r and t.serve)
        assert ports == [30000, 30001, 30002]
    _, apart = fleet.schedules(members(6), args("--port", "30000"), seed=0)
    assert {t.port for ts in apart.values() for t in ts} == {30000}  # one port per host


def test_leaf_and_repair_plans_use_what_the_nodes_said() -> None:
    leaves = {f"node{i}": "r1" if i < 2 else "r2" for i in range(4)}
    made, turns = fleet.schedules(members(4, leaves=leaves), args("--kind", "leaf"), seed=0)
    assert made == plan.leaf_aware([f"node{i}" for i in range(4)], leaves)
    assert {t.peer_leaf for t in turns["node0"]} == {"r1", "r2"}
    made, _ = fleet.schedules(members(4), args("--kind", "repair", "--suspects", "node2"), 0)
    assert made == [[("node2", "node0")]]


@pytest.mark.parametrize("ms, extra, want", [
    ([fleet.Member("a", "10.0.0.1", None), fleet.Member("a", "10.0.0.2", None)], (),
     "node name 'a' is used by two nodes (10.0.0.1 and 10.0.0.2)"),
    (members(4), ("--kind", "leaf"), "a leaf plan needs --leaves"),
    (members(4), ("--kind", "repair", "--suspects", "nodeX"), "suspect 'nodeX'"),
])
def test_a_plan_that_cannot_be_made_says_why(ms: list[fleet.Member], extra: tuple[str, ...],
                                             want: str) -> None:
    with pytest.raises(fleet.FleetError, match=want.replace("(", r"\(").replace(")", r"\)")):
        fleet.schedules(ms, args(*extra), seed=0)


# -- a pair's ranks ------------------------------------------------------------------------

def test_pair_ranks_get_the_pairs_rendezvous_not_the_agents() -> None:
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "x", "GROUP_RANK": "3",
           "RANK": "7", "WORLD_SIZE": "64", "MASTER_ADDR": "head", "MASTER_PORT": "29400",
           "NCCL_IB_HCA": "mlx5_0", "PATH": "/bin"}
    t = fleet.Turn(round=1, peer="b", peer_leaf=None, serve=False, master="10.0.0.9", port=29601)
    got = fleet.child_env(env, t, local=2, gpus=4)
    assert not [k for k in got if k.startswith(("TORCHELASTIC_", "GROUP_"))]
    assert (got["RANK"], got["WORLD_SIZE"], got["LOCAL_RANK"], got["LOCAL_WORLD_SIZE"]) == \
        ("6", "8", "2", "4")  # the second end's third GPU of a 2 x 4 world
    assert (got["MASTER_ADDR"], got["MASTER_PORT"]) == ("10.0.0.9", "29601")
    assert got["NCCL_IB_HCA"] == "mlx5_0"  # the operator's NCCL settings pass through


# -- the file ------------------------------------------------------------------------------

def _pair(peer: str, ok: bool = True, bw: float = 1e9) -> pairs.Pair:
    return pairs.Pair(peer=peer, ok=ok, bus_bandwidth_bytes_per_second=bw if ok else None)


def test_a_plan_replaces_the_file_and_a_repair_merges_into_it(tmp_path: Path) -> None:
    me = fleet.Member("n1", "10.0.0.2", "r1")
    fleet.write(args("--kind", "ring", state=tmp_path), me, [_pair("n0"), _pair("n2", ok=False)])
    first = pairs.read(pairs.pairs_path(str(tmp_path)))
    assert [(p.peer, p.ok) for p in first.pairs] == [("n0", True), ("n2", False)]
    assert (first.node, first.leaf, first.plan) == ("n1", "r1", "ring")

    repair = args("--kind", "repair", "--suspects", "n2", state=tmp_path)
    fleet.write(repair, me, [_pair("n2", bw=2e9), _pair("n5")])
    merged = pairs.read(pairs.pairs_path(str(tmp_path)))
    assert [(p.peer, p.ok, p.bus_bandwidth_bytes_per_second) for p in merged.pairs] == [
        ("n0", True, 1e9), ("n2", True, 2e9), ("n5", True, 1e9)]
    assert merged.round_timestamp >= first.round_timestamp

    ring = args("--kind", "ring", state=tmp_path)
    fleet.write(ring, me, [_pair("n7")])
    assert [p.peer for p in pairs.read(pairs.pairs_path(str(tmp_path))).pairs] == ["n7"]
    fleet.write(ring, me, [])  # no pair in this plan: file left alone
    assert [p.peer for p in pairs.read(pairs.pairs_path(str(tmp_path))).pairs] == ["n7"]


def test_a_pair_is_ok_only_when_both_ends_say_so() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    fleet._put(store, "view/b", [{"peer": "a", "ok": False, "error": "timed out after 5 s"}])
    fleet._put(store, "view/c", [{"peer": "a", "ok": True, "error": None}])
    bad = fleet._agree(_pair("b"), store, "a", timeout=1)
    assert (bad.ok, bad.error) == (False, "the peer's end failed: timed out after 5 s")
    assert fleet._agree(_pair("c"), store, "a", timeout=1).ok
    assert fleet._agree(_pair("d"), store, "a", timeout=0.2).ok  # silent peer: ours stands


def test_barrier_waits_for_everyone_and_gives_up_after_its_timeout() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    ranks = [fleet.Barriers(store, 3) for _ in range(3)]

    def together(bs: list[fleet.Barriers], name: str, timeout: float) -> list[bool]:
        got: list[bool] = []
        threads = [threading.Thread(target=lambda b=b: got.append(b.wait(name, timeout)))
                   for b in bs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    assert together(ranks, "r0", 10) == [True, True, True]
    # rank 2 dies: the two others wait for it once, then no more
    assert together(ranks[:2], "r1", 0.5) == [False, False]
    assert ranks[0].expected == ranks[1].expected == 2
    assert together(ranks[:2], "r2", 10) == [True, True]


def test_a_barrier_that_times_out_releases_everyone_waiting_there() -> None:
    """Four ranks, one dead. Rank 2 arrives with a deadline far off (it came late: its pair
    with the dead node ran to the pair timeout); ranks 0 and 1 give up first, and rank 2
    leaves with them, not at its own deadline, knowing three arrived: the next barrier of the
    three passes."""
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    store.set_timeout(timedelta(seconds=5))
    ranks = [fleet.Barriers(store, 4) for _ in range(3)]
    late: list[bool] = []
    waiter = threading.Thread(target=lambda: late.append(ranks[2].wait("r0", 600)), daemon=True)
    waiter.start()
    wait_for(lambda: store.add(fleet.PREFIX + "r0", 0) == 1, "rank 2 at the barrier")
    early: list[bool] = []
    givers = [threading.Thread(target=lambda b=b: early.append(b.wait("r0", 0.5)))
              for b in ranks[:2]]
    for t in givers:
        t.start()
    for t in givers:
        t.join()
    waiter.join(timeout=60)  # released with them: not 600 s
    assert not waiter.is_alive(), "rank 2 stayed at a barrier the others gave up on"
    assert early == [False, False] and late == [False]
    assert [b.expected for b in ranks] == [3, 3, 3]
    done: list[bool] = []
    threads = [threading.Thread(target=lambda b=b: done.append(b.wait("r1", 10)))
               for b in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done == [True, True, True]


# -- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, env, want", [
    (["--gpus-per-node", "0"], {"RANK": "0", "WORLD_SIZE": "2"}, "--gpus-per-node must be"),
    (["--kind", "repair"], {"RANK": "0", "WORLD_SIZE": "2"}, "a repair plan needs --suspects"),
    (["--kind", "adaptive", "--max-rounds", "0"], {"RANK": "0", "WORLD_SIZE": "2"},
     "--max-rounds must be from 1 to 64"),
    (["--kind", "adaptive", "--slow-ratio", "2"], {"RANK": "0", "WORLD_SIZE": "2"},
     "--slow-ratio must be from 0 to 1"),
    ([], {}, "RANK and WORLD_SIZE are not set"),
    ([], {"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR and MASTER_PORT must be set"),
    (["--node-name", "a/b"], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "1"}, "node name 'a/b'"),
    (["--", "--rounds", "3"], {"RANK": "0", "WORLD_SIZE": "2"}, "--rounds is set by the fleet"),
    (["--bogus"], {"RANK": "0", "WORLD_SIZE": "2"}, "unrecognized arguments: --bogus"),
    (["stray", "--x"], {"RANK": "0", "WORLD_SIZE": "2"}, "unknown arguments 'stray --x'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, argv: list[str],
                                          env: dict[str, str], want: str) -> None:
    clean = {k: v for k, v in os.environ.items()
             if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
             and not k.startswith("SLURM_")}
    p = subprocess.run([sys.executable, "-m", "gpunet_exporter.probe.cli", "fleet",
                        "--state-dir", str(tmp_path), *argv], env={**clean, **env},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], p.stderr
    assert not (tmp_path / "pairs.json").exists()


# -- a real run ----------------------------------------------------------------------------

def test_four_nodes_on_loopback_write_the_ring_on_both_ends(tmp_path: Path) -> None:
    """Four fleet processes with srun's environment, one rendezvous on loopback: each node's
    pairs.json names its two ring neighbours, measured, and rank 0 prints each pair once."""
    nodes = [f"n{i}" for i in range(4)]
    pair_port = str(free_port())  # the serving ends on one host take it and the next ones
    launches = [launch.Launch(n, tmp_path / n, ("--port", pair_port, *launch.QUICK,
                                                "--pair-timeout", "60")) for n in nodes]
    procs = launch.start(launches, launcher="srun", master="127.0.0.1", port=free_port())
    done = launch.finish(procs, timeout=180)
    assert [rc for rc, _ in done] == [0, 0, 0, 0], "\n".join(out[-3000:] for _, out in done)
    ring = plan.ring(nodes)
    for n in nodes:
        got = pairs.read(pairs.pairs_path(str(tmp_path / n)))
        assert (got.node, got.plan) == (n, "ring")
        assert [p.peer for p in got.pairs] == plan.peers(ring, n)
        for p in got.pairs:
            assert p.ok and p.transport == "Socket" and p.error is None, p
            assert (p.bus_bandwidth_bytes_per_second or 0) > 0
            assert 0 < (p.latency_seconds or 0) < 1
            assert (tmp_path / n / "fleet" / p.peer / "inter.json").is_file()
    summary = [json.loads(line) for line in done[0][1].splitlines() if line.startswith("{")]
    assert sorted((s["node"], s["peer"]) for s in summary) == sorted(
        pair for rnd in ring for pair in rnd)
    assert all(s["ok"] for s in summary), summary
    assert not [line for _, out in done[1:] for line in out.splitlines()
                if line.startswith("{")]  # only rank 0 prints the summary


# -- one end's view of its pair -------------------------------------------------------------

TURN = fleet.Turn(round=0, peer="b", peer_leaf="r2", serve=True, master="10.0.0.1", port=29600)
SIZES = [8 << 10, 64 << 20]


def _result(sizes: tuple[results.SizeResult, ...], **kw: object) -> results.Result:
    base: dict[str, object] = {"scope": "inter", "time": 2.0, "started": 1.0, "success": True,
                               "backend": "nccl", "world_size": 2, "sizes": sizes,
                               "net": "IB", "net_transports": ("IB",), "gdr": True}
    return results.Result(**{**base, **kw})  # type: ignore[arg-type]


def test_a_measured_pair_has_the_small_sizes_latency_and_the_large_sizes_bandwidth() -> None:
    got = fleet.judge(TURN, _result((
        results.SizeResult(8 << 10, median_seconds=2e-5, busbw_bytes_per_second=4e8),
        results.SizeResult(64 << 20, median_seconds=2e-3, busbw_bytes_per_second=4.5e10))),
        SIZES, gpus=1, backend="nccl")
    assert (got.ok, got.latency_seconds, got.bus_bandwidth_bytes_per_second) == (True, 2e-5, 4.5e10)
    assert (got.transport, got.gdr, got.peer_leaf) == ("IB", True, "r2")


def test_a_busy_gpu_leaves_the_pair_without_bandwidth_not_slow() -> None:
    """Seen on an H100 (docs/fleet.md): the runner skipped 1 MiB and up on a GPU busy with the
    other pair, and the 8 KiB bus bandwidth, 1.7 MB/s, passed for the pair's."""
    got = fleet.judge(TURN, _result((
        results.SizeResult(8 << 10, median_seconds=4.8e-3, busbw_bytes_per_second=1.7e6),
        results.SizeResult(64 << 20, skipped=True)), skipped_busy=True),
        SIZES, gpus=1, backend="nccl")
    assert got.ok and got.latency_seconds == 4.8e-3 and got.bus_bandwidth_bytes_per_second is None


@pytest.mark.parametrize("kw, want", [
    ({"success": False, "failure": "timeout", "error": "init took more than 8 s"},
     "timeout: init took more than 8 s"),
    ({"world_size": 4}, "no size measured in a world of 4"),
])
def test_a_failed_or_foreign_result_is_a_failed_pair(kw: dict[str, object], want: str) -> None:
    got = fleet.judge(TURN, _result((results.SizeResult(8 << 10, median_seconds=1e-5),), **kw),
                      SIZES, gpus=1, backend="nccl")
    assert (got.ok, got.error, got.bus_bandwidth_bytes_per_second) == (False, want, None)


# -- --leaves-from ---------------------------------------------------------------------------

def test_leaves_from_a_mounted_configmap_directory(tmp_path: Path) -> None:
    """The layout the kubelet makes of a ConfigMap volume: keys are symlinks into ..data."""
    data = tmp_path / "..2026_11_24" / "x"
    data.parent.mkdir()
    data.mkdir()
    (data / "gpu-node-7").write_text("leaf-3\n")
    (tmp_path / "..data").symlink_to(data)
    (tmp_path / "gpu-node-7").symlink_to(Path("..data") / "gpu-node-7")
    assert fleet.leaf_from(str(tmp_path), "gpu-node-7") == "leaf-3"
    assert fleet.leaf_from(str(tmp_path), "gpu-node-8") is None


def test_leaves_from_a_yaml_mapping(tmp_path: Path) -> None:
    f = tmp_path / "leaves.yml"
    f.write_text("n1: r1\nn2: r2\n")
    assert (fleet.leaf_from(str(f), "n2"), fleet.leaf_from(str(f), "n9")) == ("r2", None)


@pytest.mark.parametrize("text, want", [
    ("- n1\n- n2\n", "expected a mapping of node names to leaves"),
    ("n1: [r1]\n", "the leaf of 'n1' must be a string"),
    ("n1: r1\n  bad: [\n", "leaves.yml: "),
])
def test_a_bad_leaves_file_is_one_clear_error(tmp_path: Path, text: str, want: str) -> None:
    f = tmp_path / "leaves.yml"
    f.write_text(text)
    with pytest.raises(fleet.FleetError, match=re.escape(want)):
        fleet.leaf_from(str(f), "n1")


# -- GPUs busy with other work (issue 31) ---------------------------------------------------

@pytest.mark.parametrize("found, backend, want", [
    (set(), "nccl", None),
    (set(), "gloo", None),
    ({4242}, "nccl", pairs.BUSY),
    ({4242}, "gloo", pairs.BUSY),  # NVML says so: the gloo ranks stay off the node too
    (None, "nccl", pairs.UNKNOWN),  # cannot tell: a pair on GPUs does not run ("unknown")
    (None, "gloo", None),  # no NVML and no GPU in use: nothing to protect, as before
])
def test_the_decision_of_a_pair_end(found: set[int] | None, backend: str,
                                    want: str | None) -> None:
    assert fleet.verdict(found, backend) == want


SKIP_TURN = fleet.Turn(round=0, peer="b", peer_leaf="r2", serve=True, master="10.0.0.1",
                       port=29600)


def _ok(peer: str = "b") -> pairs.Pair:
    return pairs.Pair(peer=peer, ok=True, peer_leaf="r2", latency_seconds=2e-5,
                      bus_bandwidth_bytes_per_second=4e10, transport="IB", gdr=True)


@pytest.mark.parametrize("mine, theirs, want", [
    # the peer's end did not run: this end's pair is not measured either, whatever it saw
    (_ok(), fleet._skipped(SKIP_TURN, pairs.BUSY, "the GPUs are busy"),
     (False, pairs.PEER_BUSY, "the peer's end did not run: the GPUs are busy")),
    (fleet._failed(SKIP_TURN, "timed out after 120 s (killed)"),
     fleet._skipped(SKIP_TURN, pairs.UNKNOWN, "cannot tell"),
     (False, pairs.PEER_UNKNOWN, "the peer's end did not run: cannot tell")),
    # this end did not run: it stays so, whatever the peer's end says
    (fleet._skipped(SKIP_TURN, pairs.BUSY, "busy"), _ok("a"), (False, pairs.BUSY, "busy")),
    (fleet._skipped(SKIP_TURN, pairs.PEER_BUSY, "x"), None, (False, pairs.PEER_BUSY, "x")),
    # measured on both ends: as before
    (_ok(), fleet._failed(SKIP_TURN, "NCCL timeout"),
     (False, None, "the peer's end failed: NCCL timeout")),
    (_ok(), _ok("a"), (True, None, None)),
    (_ok(), None, (True, None, None)),
])
def test_a_pair_not_measured_on_one_end_is_not_measured_on_both(
        mine: pairs.Pair, theirs: pairs.Pair | None,
        want: tuple[bool, str | None, str | None]) -> None:
    got = fleet.agree(mine, theirs)
    assert (got.ok, got.skipped, got.error) == want
    if got.skipped is not None:
        assert got.latency_seconds is None and got.bus_bandwidth_bytes_per_second is None
        assert not got.failed


def test_an_end_that_failed_as_its_peer_yielded_was_not_measured() -> None:
    """The peer killed its ranks and ours failed on the broken connection before the peer's
    word came: with the word, read after the round's barrier, the pair is not measured."""
    failed = fleet._failed(SKIP_TURN, "no result (ranks exited [1]): Connection reset by peer")
    got = fleet._peer_did_not_run(failed, pairs.BUSY)
    assert (got.ok, got.skipped, got.error) == (False, pairs.PEER_BUSY,
                                                "the peer's end did not run: busy")
    assert fleet._peer_did_not_run(failed, None) is failed  # no word: a failure stays one


@pytest.fixture
def nvml_processes(tmp_path: Path) -> Iterator[Path]:
    """The NVML stand-in in this process, its compute processes listed in the file returned."""
    path = tmp_path / "nvml-processes"
    os.environ["GPUNET_FAKE_NVML_PROCESSES"] = str(path)
    try:
        fake_nvml.load(fake_nvml.h200x2())
        nvml.forget(fake_nvml.MODULE)
        yield path
    finally:
        del os.environ["GPUNET_FAKE_NVML_PROCESSES"]
        nvml.forget(fake_nvml.MODULE)
        fake_nvml.load(fake_nvml.h200x2())


def test_the_gpus_are_busy_with_a_process_of_another_session(nvml_processes: Path) -> None:
    gpus = fleet.Gpus(fake_nvml.MODULE, "/proc", "nccl")
    assert gpus.look() is None  # no process on either GPU
    with launch.foreign_process() as job:
        nvml_processes.write_text(f"1 {job.pid}\n")
        reason, why = gpus.look() or ("", "")
        assert reason == pairs.BUSY
        assert why == f"the GPUs are busy: {job.pid} (sleep) is not the probe's"
        nvml_processes.write_text(f"0 {os.getpid()}\n")  # this process's session: the fleet's
        assert gpus.look() is None
        sleeper = Child(["sleep", "30"])  # a rank: a session of its own, the fleet's child
        try:
            nvml_processes.write_text(f"0 {sleeper.pid}\n")
            assert (gpus.look() or ("",))[0] == pairs.BUSY  # not a rank of this pair end
            assert gpus.look([sleeper]) is None
        finally:
            sleeper.kill()


def test_without_nvml_a_pair_on_gpus_cannot_run_and_says_why(nvml_processes: Path) -> None:
    fake_nvml.load({"library": "missing", "devices": []})
    assert fleet.Gpus(fake_nvml.MODULE, "/proc", "gloo").look() is None
    nvml.forget(fake_nvml.MODULE)
    reason, why = fleet.Gpus(fake_nvml.MODULE, "/proc", "nccl").look() or ("", "")
    assert reason == pairs.UNKNOWN
    assert why.startswith("cannot tell whether the GPUs are free (nvmlInit: "), why


class FakeGpus(fleet.Gpus):
    """Answers look() from a list: one answer a call, the last one over and over."""

    def __init__(self, *answers: tuple[str, str] | None) -> None:
        self.answers = list(answers)
        self.calls = 0

    def look(self, ranks: Sequence[Child] = ()) -> tuple[str, str] | None:
        self.calls += 1
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_a_busy_node_starts_no_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    where = tmp_path / "fleet" / "b"
    where.mkdir(parents=True)
    (where / "inter.json").write_text("{}")  # an earlier run's: must not pass for this one's

    def no_child(*_: object, **__: object) -> None:
        raise AssertionError("a rank was started on a busy node")

    monkeypatch.setattr(pairworker, "Child", no_child)  # the pair workers' start
    got = fleet.run_pair(args(*launch.QUICK, state=tmp_path), SKIP_TURN, {},
                         FakeGpus((pairs.BUSY, "the GPUs are busy: 7 (python) is not the "
                                                "probe's")))
    assert (got.ok, got.skipped, got.failed) == (False, pairs.BUSY, False)
    assert got.error == "the GPUs are busy: 7 (python) is not the probe's"
    assert sorted(p.name for p in where.iterdir()) == ["probe.log"]
    assert (where / "probe.log").read_text() == \
        "gpunet-probe fleet: no rank started: the GPUs are busy: 7 (python) is not the probe's\n"


@pytest.mark.parametrize("gpus, word, want", [
    (FakeGpus(None, None, (pairs.BUSY, "the GPUs are busy: 9 (x)")), None,
     (pairs.BUSY, "the GPUs are busy: 9 (x)")),
    (FakeGpus(None), pairs.UNKNOWN, (pairs.PEER_UNKNOWN, "the peer's end did not run (unknown)")),
])
def test_the_watch_kills_the_ranks_the_moment_the_pair_must_stop(
        gpus: FakeGpus, word: str | None, want: tuple[str, str]) -> None:
    ranks = [Child(["sleep", "60"]), Child(["sleep", "60"])]
    asked: list[int] = []

    def peer() -> str | None:
        asked.append(1)
        return word if len(asked) > 1 else None

    started = time.monotonic()
    codes, stop = fleet._watch(ranks, started + 60, gpus, peer)
    assert stop == want
    assert time.monotonic() - started < 5 * fleet.WATCH_SECONDS
    assert codes == [None, None]  # running when it stopped them
    assert all(c.poll() is not None for c in ranks)  # killed, whole groups, and reaped


def test_the_watch_returns_the_ranks_codes_or_kills_them_at_the_deadline() -> None:
    ranks = [Child(["true"]), Child(["false"])]
    assert fleet._watch(ranks, time.monotonic() + 30, FakeGpus(None), fleet._no_word) == \
        ([0, 1], None)
    late = [Child(["sleep", "60"])]
    assert fleet._watch(late, time.monotonic() + 0.2, FakeGpus(None), fleet._no_word) == \
        ([None], None)
    assert late[0].poll() is not None


def test_a_pair_end_hears_in_the_store_that_its_peer_yielded() -> None:
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    ask = fleet._yielded(store, fleet.Turn(3, "b", None, False, "10.0.0.1", 29600))
    assert ask() is None
    fleet._put(store, "yield/3/a", pairs.BUSY)  # another pair's peer
    assert ask() is None
    fleet._put(store, "yield/3/b", pairs.UNKNOWN)
    assert ask() == pairs.UNKNOWN


def _summary_lines(out: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_a_busy_node_costs_its_pairs_a_measurement_not_a_failure(tmp_path: Path) -> None:
    """The four nodes on loopback again; n3's GPUs (the NVML stand-in, on every node) carry a
    process of another session from the start. n3 starts no rank: its pairs, with n2 and n0,
    are not measured on both ends ("busy" on n3, "peer_busy" on the others), the other pairs
    are measured, nothing is failed, and no node waits out the pair timeout for n3."""
    nodes = [f"n{i}" for i in range(4)]
    pair_port = str(free_port())
    with launch.foreign_process() as job:
        launches = []
        for n in nodes:
            listing = tmp_path / f"{n}-nvml-processes"
            listing.write_text(f"1 {job.pid}\n" if n == "n3" else "")
            flags, env = launch.fake_gpus(listing)
            launches.append(launch.Launch(n, tmp_path / n, (
                *flags, "--port", pair_port, *launch.QUICK, "--pair-timeout", "60"), env=env))
        started = time.monotonic()
        done = launch.finish(launch.start(launches, launcher="srun", master="127.0.0.1",
                                          port=free_port()), timeout=180)
        took = time.monotonic() - started
    assert [rc for rc, _ in done] == [0, 0, 0, 0], "\n".join(out[-3000:] for _, out in done)
    assert took < 60, f"{took:.0f} s: a node waited out the pair timeout"
    busy = {"n3": {"n2": pairs.BUSY, "n0": pairs.BUSY}, "n2": {"n3": pairs.PEER_BUSY},
            "n0": {"n3": pairs.PEER_BUSY}}
    for n in nodes:
        got = pairs.read(pairs.pairs_path(str(tmp_path / n)))
        assert [p.peer for p in got.pairs] == plan.peers(plan.ring(nodes), n)
        for p in got.pairs:
            assert not p.failed, p
            want = busy.get(n, {}).get(p.peer)
            assert p.skipped == want, (n, p)
            if want is None:
                assert p.ok and (p.bus_bandwidth_bytes_per_second or 0) > 0, p
            else:
                assert p.bus_bandwidth_bytes_per_second is None and p.error, p
    # n3 started no rank: its pairs' folders hold the line that says so, and nothing else
    for peer in ("n2", "n0"):
        folder = tmp_path / "n3" / "fleet" / peer
        assert sorted(f.name for f in folder.iterdir()) == ["probe.log"]
        assert (folder / "probe.log").read_text() == (
            f"gpunet-probe fleet: no rank started: the GPUs are busy: {job.pid} (sleep) is not "
            "the probe's\n")
    assert "n3: round 0: the pair with n2 is not measured (busy)" in done[3][1]
    summary = {(s["node"], s["peer"]): s for s in _summary_lines(done[0][1])}
    assert set(summary) == {("n0", "n1"), ("n2", "n3"), ("n1", "n2"), ("n3", "n0")}
    assert [summary[k]["ok"] for k in (("n0", "n1"), ("n1", "n2"))] == [True, True]
    assert (summary[("n2", "n3")]["skipped"], summary[("n3", "n0")]["skipped"]) == (
        pairs.PEER_BUSY, pairs.BUSY)


WORKER_LINE = re.compile(r"^gpunet-probe fleet: local rank (\d+): pair worker (\d+) "
                         r"\((started for this pair|kept from an earlier pair)\)$", re.M)


def _workers_of(folder: Path) -> list[tuple[int, bool]]:
    """(pid, started for this pair) of each pair worker that ran the pair end whose folder is
    ``folder``, as its probe.log says."""
    try:
        text = (folder / "probe.log").read_text()
    except OSError:
        return []
    return [(int(m[2]), m[3].startswith("started")) for m in WORKER_LINE.finditer(text)]


def _ranks_of(folder: Path) -> list[int]:
    """PIDs of the pair workers running the pair end whose state directory is ``folder``."""
    return [pid for pid, _ in _workers_of(folder) if os.path.exists(f"/proc/{pid}")]


def test_a_node_that_gets_busy_mid_pair_kills_its_ranks(tmp_path: Path) -> None:
    """Two nodes, one pair, n1's rank slowed down (GPUNET_PROBE_DELAY: 3 s before each timed
    all-reduce, six of them: 18 s). Once both ends' ranks run, a process of another session appears
    on n1's GPU 0: n1 kills its ranks at once and n0 its own when it hears of it in the store;
    the pair is not measured on both ends, and nobody waits for the pair to end."""
    pair_port = str(free_port())
    listings = {n: tmp_path / f"{n}-nvml-processes" for n in ("n0", "n1")}
    launches = []
    for n, listing in listings.items():
        listing.write_text("")
        flags, env = launch.fake_gpus(listing)
        if n == "n1":
            env[runner.DELAY_ENV] = "1:3"
        launches.append(launch.Launch(n, tmp_path / n, (
            *flags, "--port", pair_port, *launch.QUICK, "--pair-timeout", "60"), env=env))
    with launch.foreign_process() as job:
        procs = launch.start(launches, launcher="srun", master="127.0.0.1", port=free_port())
        rank = wait_for(lambda: _ranks_of(tmp_path / "n1" / "fleet" / "n0"), "n1's rank",
                        timeout=60)
        wait_for(lambda: _ranks_of(tmp_path / "n0" / "fleet" / "n1"), "n0's rank", timeout=60)
        busy_at = time.monotonic()
        listings["n1"].write_text(f"0 {job.pid}\n")
        done = launch.finish(procs, timeout=120)
        took = time.monotonic() - busy_at
    assert [rc for rc, _ in done] == [0, 0], "\n".join(out[-3000:] for _, out in done)
    assert took < 10, f"{took:.1f} s from the job's start to the end of the fleet run"
    assert all(not os.path.exists(f"/proc/{pid}") for pid in rank)
    n0 = pairs.read(pairs.pairs_path(str(tmp_path / "n0"))).pairs
    n1 = pairs.read(pairs.pairs_path(str(tmp_path / "n1"))).pairs
    assert [(p.peer, p.ok, p.skipped) for p in n1] == [("n0", False, pairs.BUSY)]
    assert [(p.peer, p.ok, p.skipped) for p in n0] == [("n1", False, pairs.PEER_BUSY)]
    assert not (tmp_path / "n1" / "fleet" / "n0" / "inter.json").exists()
    assert (tmp_path / "n1" / "fleet" / "n0" / "probe.log").read_text().endswith(
        f"gpunet-probe fleet: ranks killed: the GPUs are busy: {job.pid} (sleep) is not the "
        "probe's\n")
    assert (tmp_path / "n0" / "fleet" / "n1" / "probe.log").read_text().endswith(
        "gpunet-probe fleet: ranks killed: the peer's end did not run (busy)\n")
    [line] = _summary_lines(done[0][1])
    assert (line["node"], line["peer"], line["ok"], line["skipped"]) == (
        "n0", "n1", False, pairs.PEER_BUSY)


# -- adaptive passes (issue 35) ---------------------------------------------------------------

def test_rank_0_plans_each_round_from_both_ends_views() -> None:
    """An adaptive pass's store keys, without processes: round 1's turns and head, then the
    outcomes rank 0 agrees from the ends' views (ok only when both ends say so, a busy end's
    pair not measured, a pair without any view failed) and the next round they give."""
    torch_dist = pytest.importorskip("torch.distributed")
    store = torch_dist.HashStore()
    ms = members(8, address="127.0.0.1")
    p = fleet._Pass(ms, args("--kind", "adaptive", "--port", "30000"), seed=0)
    p.publish(store, 0)
    assert fleet._take(store, "adaptive/0", 1) == {"done": False, "pairs": 4}
    (a, b), (c, d), (e, f), (g, h) = p.round
    ta = fleet._turn(fleet._take(store, f"adaptive/0/turn/{a}", 1))
    tb = fleet._turn(fleet._take(store, f"adaptive/0/turn/{b}", 1))
    assert (ta.peer, ta.serve, tb.peer, tb.serve, ta.port) == (b, True, a, False, tb.port)

    def view(node: str, peer: str, **kw: Any) -> None:
        base: dict[str, Any] = {"ok": True, "bus_bandwidth_bytes_per_second": 1e9, **kw}
        fleet._put(store, f"adaptive/0/view/{node}",
                   pairs.pair_json(pairs.Pair(peer=peer, peer_leaf=None, **base)))

    view(a, b)
    view(b, a)  # both ends ok
    view(c, d)
    view(d, c, ok=False, bus_bandwidth_bytes_per_second=None, error="timed out")  # one failed
    view(e, f, ok=False, bus_bandwidth_bytes_per_second=None, error="x", skipped=pairs.BUSY)
    view(f, e, ok=False, bus_bandwidth_bytes_per_second=None, error="reset")  # peer yielded
    # g and h: no view at all (dead)
    p.collect(store, 0)
    assert dict(p.state.results[0]) == {(a, b): "ok", (c, d): "failed", (e, f): "skipped",
                                        (g, h): "failed"}
    assert [(x["node"], x["peer"], x["ok"]) for x in p.lines] == [
        (a, b, True), (c, d, False), (e, f, False), (g, h, False)]
    assert p.lines[2]["skipped"] == pairs.BUSY
    assert p.lines[3]["error"] == "no report from either end"
    p.publish(store, 1)
    nxt = {n for pair in p.round for n in pair}
    assert {c, d, e, f, g, h} <= nxt  # suspects and the unmeasured, with a and b, known good
    assert fleet._take(store, "adaptive/1", 1)["pairs"] == len(p.round) == 4
    for m in ms:  # a turn for each node of the round, none for the others
        assert store.check([fleet.PREFIX + f"adaptive/1/turn/{m.node}"]) == (m.node in nxt)
    p.round = []
    p.state = adaptive.start([m.node for m in ms])  # nothing left to test: the pass ends
    p.state = adaptive.record(p.state, {(ms[i].node, ms[i + 1].node): adaptive.OK
                                        for i in range(0, 8, 2)})
    p.publish(store, 2)
    assert fleet._take(store, "adaptive/2", 1) == {"done": True, "pairs": 0}


def test_an_adaptive_pass_names_the_bad_node_of_six(tmp_path: Path) -> None:
    """Six nodes on loopback, n4's pair ends unable to run gloo (its GLOO_SOCKET_IFNAME names
    no interface: its ranks fail at once, their peers' ranks at the pair timeout). The adaptive
    pass re-pairs only n4 and its first partner: n4 is named bad in at most 3 rounds, no
    healthy node is, every node's pairs.json holds its pairs of the pass, and rank 0 prints
    one line per pair and round, then the verdict. No pair is judged slow (--slow-ratio 0):
    gloo on two shared cores measures the CPUs' load, not a link (seen: a healthy node's two
    pairs under half the median, and the node named bad)."""
    nodes = [f"n{i}" for i in range(6)]
    pair_port = str(free_port())
    flags = ("--kind", "adaptive", "--seed", "3", "--port", pair_port, *launch.QUICK,
             "--pair-timeout", "30", "--slow-ratio", "0")
    broken = {"GLOO_SOCKET_IFNAME": "gpunet-none"}
    launches = [launch.Launch(n, tmp_path / n, flags, env=broken if n == "n4" else {})
                for n in nodes]
    done = launch.finish(launch.start(launches, launcher="srun", master="127.0.0.1",
                                      port=free_port()), timeout=400)
    assert [rc for rc, _ in done] == [0] * 6, "\n".join(out[-3000:] for _, out in done)
    lines = _summary_lines(done[0][1])
    verdict = lines[-1]["verdict"]
    assert verdict["bad_nodes"] == ["n4"], lines
    assert verdict["rounds"] <= 3 and verdict["done"] and not verdict["unresolved"]
    assert verdict["suspect_links"] == []
    per_pair = lines[:-1]
    assert len(per_pair) == verdict["pairs"]
    rounds: dict[int, list[str]] = {}
    for s in per_pair:
        rounds.setdefault(int(s["round"]), []).extend((s["node"], s["peer"]))
        assert s["ok"] == ("n4" not in (s["node"], s["peer"])), s
    assert all(len(v) == len(set(v)) for v in rounds.values())  # disjoint pairs
    assert len(rounds[0]) == 6  # everyone in round 1
    assert sorted(rounds) == list(range(verdict["rounds"]))
    for n in nodes:
        got = pairs.read(pairs.pairs_path(str(tmp_path / n)))
        peers = {s["peer"] if s["node"] == n else s["node"] for s in per_pair
                 if n in (s["node"], s["peer"])}
        assert (got.plan, {p.peer for p in got.pairs}) == ("adaptive", peers), (n, got)
        for p in got.pairs:
            assert p.ok == (p.peer != "n4" and n != "n4"), (n, p)
    assert not [line for _, out in done[1:] for line in out.splitlines()
                if line.startswith("{")]


# -- the persistent pair worker (issue 35) ----------------------------------------------------

WORKER_DONE = re.compile(r"^gpunet-probe pair-worker (\d+): pair (\d+): rank \d+ of 2: exit 0 "
                         r"after [0-9.]+ s$", re.M)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_each_node_keeps_one_worker_for_all_its_pairs(tmp_path: Path) -> None:
    """ring --hops 2 over four nodes on loopback: three rounds, three pairs per node. Each node
    starts one pair worker, at its first pair, and that process runs all three of its pairs
    (the worker's own count says 1, 2, 3), every pair measured; none is left at the end."""
    nodes = [f"n{i}" for i in range(4)]
    pair_port = str(free_port())
    launches = [launch.Launch(n, tmp_path / n, ("--hops", "2", "--port", pair_port,
                                                *launch.QUICK, "--pair-timeout", "60"))
                for n in nodes]
    done = launch.finish(launch.start(launches, launcher="srun", master="127.0.0.1",
                                      port=free_port()), timeout=180)
    assert [rc for rc, _ in done] == [0, 0, 0, 0], "\n".join(out[-3000:] for _, out in done)
    made = plan.make("ring", nodes, seed=0, hops=2, suspects=[], good=None, leaves=None)
    assert len(made) == 3
    pids: set[int] = set()
    for n in nodes:
        got = pairs.read(pairs.pairs_path(str(tmp_path / n)))
        order = plan.peers(made, n)  # in round order
        assert [p.peer for p in got.pairs] == order and len(order) == 3
        assert all(p.ok and (p.bus_bandwidth_bytes_per_second or 0) > 0 for p in got.pairs), got
        ran = [_workers_of(tmp_path / n / "fleet" / peer) for peer in order]
        assert [[started for _, started in r] for r in ran] == [[True], [False], [False]], ran
        [pid] = {pid for r in ran for pid, _ in r}
        counts = [[(int(m[1]), int(m[2])) for m in WORKER_DONE.finditer(
            (tmp_path / n / "fleet" / peer / "probe.log").read_text())] for peer in order]
        assert counts == [[(pid, 1)], [(pid, 2)], [(pid, 3)]], counts
        pids.add(pid)
    assert len(pids) == 4
    assert not [pid for pid in pids if _alive(pid)]  # each exited with its pass


def _two_rounds(tmp_path: Path, delays: dict[str, str]
                ) -> tuple[list[launch.Launch], dict[str, Path]]:
    """A ring over four nodes (round 0: n0-n1, n2-n3; round 1: n1-n2, n3-n0) on the NVML
    stand-in, each node's GPU processes listed in the file returned for it."""
    pair_port = str(free_port())
    listings = {f"n{i}": tmp_path / f"n{i}-nvml-processes" for i in range(4)}
    launches = []
    for n, listing in listings.items():
        listing.write_text("")
        flags, env = launch.fake_gpus(listing)
        if n in delays:
            env[runner.DELAY_ENV] = delays[n]
        launches.append(launch.Launch(n, tmp_path / n, (
            *flags, "--port", pair_port, *launch.QUICK, "--pair-timeout", "60"), env=env))
    return launches, listings


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_a_worker_killed_for_a_busy_gpu_is_replaced_for_the_next_pair(tmp_path: Path) -> None:
    """n1's GPU gets a foreign process while n1's worker runs its pair with n0 (slowed down);
    the watch kills it, and once the process is gone, n1's next pair (with n2) is measured by a
    fresh worker. n0's worker, killed on n1's word, is replaced too; n2 and n3 keep theirs."""
    # n1 late in round 0 (rank 1 there), and n3 (rank 1 with n2): round 0 lasts until the
    # test has taken the foreign process off n1's list again.
    launches, listings = _two_rounds(tmp_path, {"n1": "1:3", "n3": "1:0.3"})
    with launch.foreign_process() as job:
        procs = launch.start(launches, launcher="srun", master="127.0.0.1", port=free_port())
        first = wait_for(lambda: _ranks_of(tmp_path / "n1" / "fleet" / "n0"), "n1's worker",
                         timeout=60)
        wait_for(lambda: _ranks_of(tmp_path / "n0" / "fleet" / "n1"), "n0's worker", timeout=60)
        listings["n1"].write_text(f"0 {job.pid}\n")
        wait_for(lambda: "ranks killed" in _read(tmp_path / "n1" / "fleet" / "n0" / "probe.log"),
                 "n1's worker killed", timeout=30)
        listings["n1"].write_text("")
        done = launch.finish(procs, timeout=120)
    assert [rc for rc, _ in done] == [0] * 4, "\n".join(out[-3000:] for _, out in done)
    assert not _alive(first[0])
    n1 = {p.peer: p for p in pairs.read(pairs.pairs_path(str(tmp_path / "n1"))).pairs}
    n0 = {p.peer: p for p in pairs.read(pairs.pairs_path(str(tmp_path / "n0"))).pairs}
    assert (n1["n0"].skipped, n0["n1"].skipped) == (pairs.BUSY, pairs.PEER_BUSY)
    assert n1["n2"].ok and (n1["n2"].bus_bandwidth_bytes_per_second or 0) > 0, n1["n2"]
    assert n0["n3"].ok and (n0["n3"].bus_bandwidth_bytes_per_second or 0) > 0, n0["n3"]
    for node, killed, nxt in (("n1", "n0", "n2"), ("n0", "n1", "n3")):
        [(old, _)] = _workers_of(tmp_path / node / "fleet" / killed)
        [(new, started)] = _workers_of(tmp_path / node / "fleet" / nxt)
        assert started and new != old, (node, old, new)
    for node, second in (("n2", "n1"), ("n3", "n0")):  # untouched: one worker for both pairs
        assert [s for _, s in _workers_of(tmp_path / node / "fleet" / second)] == [False]


def test_a_worker_that_dies_mid_pair_costs_only_that_pair(tmp_path: Path) -> None:
    """n1's worker is killed (SIGKILL, from outside) once its pair's group with n0 is up: that
    pair fails on both ends (n0's worker sees the connection go), and both nodes' next pairs
    are measured by fresh workers; the other pairs are measured as usual."""
    launches, _ = _two_rounds(tmp_path, {"n1": "1:3", "n3": "1:0.3"})
    procs = launch.start(launches, launcher="srun", master="127.0.0.1", port=free_port())
    folder = tmp_path / "n1" / "fleet" / "n0"
    wait_for(lambda: "group up" in _read(folder / "probe.log"), "n1's group", timeout=60)
    [pid] = _ranks_of(folder)
    os.kill(pid, 9)
    done = launch.finish(procs, timeout=120)
    assert [rc for rc, _ in done] == [0] * 4, "\n".join(out[-3000:] for _, out in done)
    views = {n: {p.peer: p for p in pairs.read(pairs.pairs_path(str(tmp_path / n))).pairs}
             for n in ("n0", "n1", "n2", "n3")}
    assert views["n1"]["n0"].failed and views["n0"]["n1"].failed
    assert views["n1"]["n0"].error == f"no result (ranks exited [-9]): " \
        f"[Errno 2] No such file or directory: '{folder / 'inter.json'}'"
    measured = [(n, peer) for n, v in views.items() for peer, p in v.items()
                if p.ok and (p.bus_bandwidth_bytes_per_second or 0) > 0]
    assert sorted(measured) == [("n0", "n3"), ("n1", "n2"), ("n2", "n1"), ("n2", "n3"),
                                ("n3", "n0"), ("n3", "n2")]
    [(new, started)] = _workers_of(tmp_path / "n1" / "fleet" / "n2")
    assert started and new != pid


@pytest.mark.parametrize("line, want", [
    (b"{not json\n", "a job is a JSON object"),
    (b"[1]\n", "a job is a JSON object"),
    (b'{"rank": 2, "world": 2, "local": 0, "master": "h", "port": 1, "state_dir": "/s", '
     b'"log": "/l"}', "job: rank 2 of 2 at port 1"),
    (b'{"rank": true, "world": 2, "local": 0, "master": "h", "port": 1, "state_dir": "/s", '
     b'"log": "/l"}', "job: rank must be a whole number, got True"),
    (b'{"rank": 0, "world": 2, "local": 0, "master": "", "port": 1, "state_dir": "/s", '
     b'"log": "/l"}', "job: master must be a non-empty string"),
])
def test_a_bad_job_is_refused_with_one_line(line: bytes, want: str) -> None:
    with pytest.raises(pairworker.BadJob, match=re.escape(want)):
        pairworker.parse_job(line)


def test_a_job_says_what_a_ranks_environment_said() -> None:
    t = fleet.Turn(round=1, peer="b", peer_leaf=None, serve=False, master="10.0.0.9", port=29601)
    job = pairworker.job_for(fleet.child_env({}, t, local=1, gpus=2), "/s/fleet/b", "/l")
    assert pairworker.parse_job(job.line()) == job
    assert (job.rank, job.world, job.local, job.master, job.port) == (3, 4, 1, "10.0.0.9", 29601)


def test_a_worker_not_started_by_the_fleet_says_so_and_exits_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != pairworker.CONTROL_ENV}
    p = subprocess.run([sys.executable, "-m", "gpunet_exporter.probe.cli", "pair-worker",
                        "--state-dir", str(tmp_path)], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"gpunet-probe pair-worker: started by gpunet-probe fleet only "
        f"({pairworker.CONTROL_ENV} is not set)"]


def test_idle_workers_are_killed_when_other_work_comes_between_pairs(tmp_path: Path) -> None:
    """n0 and n1 are done with round 0 and wait at its barrier, holding their workers, while
    n2 and n3 still measure (n3 slowed down). A process of another session appears on n0's
    GPU: n0's worker is killed within a few watches, while round 0 still runs, not at n0's
    next pair; once the process is gone, that pair (with n3) is measured by a fresh worker."""
    launches, listings = _two_rounds(tmp_path, {"n3": "1:1.5"})
    with launch.foreign_process() as job:
        procs = launch.start(launches, launcher="srun", master="127.0.0.1", port=free_port())
        first = tmp_path / "n0" / "fleet" / "n1"
        wait_for(lambda: "pair end took" in _read(first / "probe.log"), "n0's first pair",
                 timeout=60)
        [(pid, _)] = _workers_of(first)
        assert _alive(pid)  # kept, idle, between pairs
        listings["n0"].write_text(f"0 {job.pid}\n")
        wait_for(lambda: not _alive(pid), "n0's idle worker killed", timeout=5)
        assert "pair end took" not in _read(tmp_path / "n2" / "fleet" / "n3" / "probe.log")
        listings["n0"].write_text("")
        done = launch.finish(procs, timeout=120)
    assert [rc for rc, _ in done] == [0] * 4, "\n".join(out[-3000:] for _, out in done)
    assert ("gpunet-probe fleet: pair workers killed between pairs: the GPUs are busy: "
            f"{job.pid} (sleep) is not the probe's") in done[0][1]
    views = {n: pairs.read(pairs.pairs_path(str(tmp_path / n))).pairs for n in ("n0", "n1")}
    assert all(p.ok for v in views.values() for p in v), views
    [(new, started)] = _workers_of(tmp_path / "n0" / "fleet" / "n3")
    assert started and new != pid


def test_a_kept_workers_group_reads_only_its_own_lines_of_nccls_log(tmp_path: Path) -> None:
    """NCCL opens its debug file once per process: a worker's one file holds every pair's
    lines. A pair's transports come from the lines after the marks taken before its group was
    made: the second group (sockets) does not inherit the first one's P2P."""
    fixtures = Path(__file__).parent / "fixtures" / "nccl"
    log = tmp_path / f"nccl.inter.vm.{os.getpid()}.log"
    log.write_bytes((fixtures / "nccl-2.28.9-h200x2-p2p-rank0.log").read_bytes())
    (tmp_path / "nccl.inter.vm.1.log").write_text("another process's\n")
    marks = runner.log_marks(str(tmp_path))
    assert marks == {log.name: log.stat().st_size}
    with log.open("ab") as fh:
        fh.write((fixtures / "nccl-2.28.9-h200x2-socket-rank0.log").read_bytes())
    from gpunet_exporter.nccl import log as ncclog

    second = ncclog.summarize(ncclog.parse_file(str(log), marks[log.name]))
    both = ncclog.summarize(ncclog.parse_file(str(log)))
    assert (second["transports"], second["net_transports"]) == (["NET"], ["Socket"])
    assert sorted(both["transports"]) == ["NET", "P2P"]


_SLOW_TO_EXIT = """
import os, sys, time
job, reply = (int(x) for x in os.environ[sys.argv[1]].split(","))
os.read(job, 4096)
os.write(reply, b"done 4\\n")
time.sleep(30)  # on its way out, slowly (a torch process's exit takes its time)
"""


def test_a_worker_whose_pair_failed_is_not_given_the_next_one(tmp_path: Path) -> None:
    """A worker exits after a pair that did not end in 0; until it is gone it must not be
    taken for a live one (its next job would be lost and the pair fail): a fresh worker."""
    workers = pairworker.Workers([sys.executable, "-c", _SLOW_TO_EXIT, pairworker.CONTROL_ENV],
                                 str(tmp_path))
    job = pairworker.Job(0, 2, 0, "127.0.0.1", 29600, str(tmp_path), str(tmp_path / "log"))
    try:
        with open(tmp_path / "log", "wb") as log:
            first, new = workers.get(0, dict(os.environ), log)
            assert new
            first.send(job)
            assert first.wait(20) == 4
            assert first.alive  # still there, leaving
            second, new = workers.get(0, dict(os.environ), log)
            assert new and second.pid != first.pid
            assert not first.alive and not _alive(first.pid)  # killed and reaped
            assert workers.started == 2
    finally:
        workers.close()
