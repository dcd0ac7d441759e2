"""``gpunet-probe fleet`` (exporter/probe/fleet.py): the schedule each node gets, the environment
of a pair's ranks, the file each node writes, bad input, and a real run of four nodes on
loopback (gloo over TCP, started with srun's environment) that writes the ring's pairs on both
ends of every pair."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from gpunet_exporter.probe import fleet, pairs, plan, results

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
