"""slurm/gpunet-fleet.sbatch under a real Slurm (Debian slurm-wlm 22.05): one slurmctld and four
slurmd nodes on this host, each slurmd in its own network, UTS and mount namespace, so each node
has its own address, hostname and /var/lib/gpunet-exporter (tests/support/slurm.py). The
script's srun starts one ``gpunet-probe fleet`` per node (gloo over TCP through the namespaces'
bridge) and every node's pairs.json, read from that node's own directory, must hold the ring's
peers with a measured bandwidth; a node whose GPU holds a process Slurm does not know about
(issue 31) has its pairs not measured, on both ends. What it showed: docs/fleet.md."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from gpunet_exporter.probe import pairs

from support import fleet as launch
from support import netns, slurm
from support.paths import REPO
from support.wait import wait_for

pytestmark = pytest.mark.slow

SCRIPT = REPO / "slurm" / "gpunet-fleet.sbatch"
# The script's default plan, ring --hops 2, of n0..n3: the ring n0-n1, n1-n2, n2-n3, n3-n0 and
# the two nodes on, n0-n2, n1-n3: with four nodes the complete graph.
RING4 = {n: {"n0", "n1", "n2", "n3"} - {n} for n in ("n0", "n1", "n2", "n3")}
RING3 = {"n0": {"n1", "n2"}, "n1": {"n0", "n2"}, "n2": {"n0", "n1"}}


def probe_env(**more: str) -> dict[str, str]:
    """The script's settings for a short gloo round on CPU, through the namespaces' eth0."""
    probe = shutil.which("gpunet-probe")
    assert probe, "the gpunet-probe console script is not installed (pip install .)"
    return {"GPUNET_PROBE": probe, "GPUNET_FLEET_BACKEND": "gloo",
            "GPUNET_FLEET_SIZES": "64KiB,1MiB", "GPUNET_FLEET_ARGS": "--warmup 1 --iterations 3 "
            "--pair-timeout 60", "GLOO_SOCKET_IFNAME": "eth0", **more}


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm.Cluster]:
    slurm.require()
    with slurm.cluster(4) as c:
        yield c


def pairs_of(node: slurm.SlurmNode) -> pairs.Pairs | None:
    """The node's pairs.json, as its exporter would read it from the default state_dir."""
    path = node.state / "probe" / pairs.FILE
    return pairs.read(str(path)) if path.exists() else None


def sbatch_wait(c: slurm.Cluster, args: list[str], env: Mapping[str, str],
                tag: str) -> tuple[str, float]:
    """``sbatch --wait`` (through the script's --idle mode when args start with it); the job's
    output and the seconds it took."""
    out = c.root / f"{tag}-%j.out"
    argv = ([str(SCRIPT), "--idle", "--wait", f"--output={out}"] if args[:1] == ["--idle"]
            else ["sbatch", "--wait", f"--output={out}", *args, str(SCRIPT)])
    started = time.monotonic()
    r = c.run(argv, env=env, timeout=240, cwd=c.root)
    took = time.monotonic() - started
    text = "\n".join(p.read_text() for p in sorted(c.root.glob(f"{tag}-*.out")))
    assert r.returncode == 0, f"{r.stdout}{r.stderr}\njob output:\n{text}\n{c.logs()}"
    return text, took


@contextlib.contextmanager
def training(c: slurm.Cluster, nodes: str) -> Iterator[None]:
    """A stand-in training job holding these nodes whole (--exclusive) for the block."""
    count = len(nodes.split(","))
    r = c.run(["sbatch", "--parsable", "--exclusive", f"--nodes={count}", f"--nodelist={nodes}",
               "--job-name=training", f"--output={c.root}/training-%j.out", "--wrap",
               "sleep 600"], cwd=c.root)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    try:
        wait_for(lambda: sorted(n for n, s in c.node_states().items() if s == "alloc")
                 == nodes.split(","), f"the training job on {nodes}", timeout=30)
        yield
    finally:
        c.run(["scancel", job])


def check_ring(c: slurm.Cluster, ring: Mapping[str, set[str]], text: str) -> None:
    for node in c.nodes:
        if node.name not in ring:
            continue
        p = pairs_of(node)
        assert p is not None, f"{node.name} wrote no pairs.json\n{text}"
        assert (p.node, p.plan) == (node.name, "ring"), p
        assert {x.peer for x in p.pairs} == ring[node.name], (node.name, p, text)
        for x in p.pairs:
            assert x.ok and x.error is None, (node.name, x, text)
            assert x.bus_bandwidth_bytes_per_second and x.bus_bandwidth_bytes_per_second > 0, x
            assert x.transport == "Socket", x


def test_sbatch_runs_a_ring_round_on_four_nodes(cluster: slurm.Cluster) -> None:
    text, took = sbatch_wait(cluster, ["-N4"], probe_env(), "ring4")
    print(f"sbatch --wait -N4: {took:.1f} s\n{text}")  # the numbers in docs/fleet.md (-s)
    assert "4 nodes (n[0-3]), MASTER_ADDR=n0 MASTER_PORT=29500" in text, text
    assert "exit status 0" in text, text
    check_ring(cluster, RING4, text)
    # Each node's directory is its own /var/lib/gpunet-exporter: nothing of another node's.
    for node in cluster.nodes:
        assert {p.name for p in (node.state / "probe" / "fleet").iterdir()} == RING4[node.name]


def test_a_node_busy_outside_slurm_costs_its_pairs_a_measurement(cluster: slurm.Cluster
                                                                  ) -> None:
    """Issue 31: a process Slurm does not know about holds n3's GPU (the NVML stand-in on every
    node; each node's list of GPU processes in its own /var/lib/gpunet-exporter, n3's naming a
    `sleep` of another session). n3 starts no rank; its three pairs are not measured on both
    ends, the three pairs of n0..n2 are measured, and no pair is failed."""
    listing = slurm.STATE_MOUNT / "nvml-processes"  # each node's own, through its mount
    flags, env = launch.fake_gpus(listing)
    for node in cluster.nodes:
        (node.state / listing.name).write_text("")
    with launch.foreign_process() as job:
        (cluster.nodes[3].state / listing.name).write_text(f"1 {job.pid}\n")
        text, took = sbatch_wait(cluster, ["-N4"], probe_env(**{
            **env, "GPUNET_FLEET_ARGS": probe_env()["GPUNET_FLEET_ARGS"] + " " + " ".join(
                flags)}), "busy")
    print(f"sbatch --wait -N4 with n3 busy: {took:.1f} s\n{text}")
    assert "exit status 0" in text, text
    for node in cluster.nodes:
        p = pairs_of(node)
        assert p is not None and {x.peer for x in p.pairs} == RING4[node.name], (node, text)
        for x in p.pairs:
            assert not x.failed, (node.name, x, text)
            if "n3" in (node.name, x.peer):
                assert x.skipped == ("busy" if node.name == "n3" else "peer_busy"), x
                assert x.bus_bandwidth_bytes_per_second is None, x
            else:
                assert x.ok and x.skipped is None, (node.name, x, text)
    for peer in ("n0", "n1", "n2"):  # n3 started no rank: its log is the line that says so
        folder = cluster.nodes[3].state / "probe" / "fleet" / peer  # (an earlier test's too)
        assert not (folder / "inter.json").exists(), peer
        assert (folder / "probe.log").read_text() == (
            f"gpunet-probe fleet: no rank started: the GPUs are busy: {job.pid} (sleep) is not "
            "the probe's\n")
    lines = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
    assert len(lines) == 6 and not [x for x in lines if not x["ok"] and "skipped" not in x]


def test_idle_mode_leaves_a_busy_node_alone(cluster: slurm.Cluster) -> None:
    """A job holding n3 (--exclusive): the script's --idle mode submits on n0..n2 only, a ring
    of three; n3's file is not touched."""
    before = pairs_of(cluster.nodes[3])
    path = cluster.nodes[3].state / "probe" / pairs.FILE
    mtime = path.stat().st_mtime_ns if path.exists() else None
    with training(cluster, "n3"):
        text, took = sbatch_wait(cluster, ["--idle"], probe_env(), "idle")
    print(f"--idle with n3 busy: {took:.1f} s\n{text}")
    assert "3 nodes (n[0-2])" in text, text
    check_ring(cluster, RING3, text)
    assert pairs_of(cluster.nodes[3]) == before
    assert (path.stat().st_mtime_ns if path.exists() else None) == mtime


def test_a_period_resubmits_the_round_on_the_free_nodes(cluster: slurm.Cluster) -> None:
    """GPUNET_FLEET_PERIOD: the job submits its successor (--begin=now+PERIOD) from inside the
    job, from slurmd's copy of the script; with GPUNET_FLEET_NODES a range (2-4), the successor
    takes the nodes that are free when it starts: n0 and n1, while a job holds n2 and n3."""
    with training(cluster, "n2,n3"):
        first, _ = sbatch_wait(cluster, ["-N2"], probe_env(GPUNET_FLEET_PERIOD="2",
                                                           GPUNET_FLEET_NODES="2-4"), "period")
        assert "2 nodes (n[0-1])" in first and "next round: job" in first, first
        nxt = first.split("next round: job ", 1)[1].split(",", 1)[0]
        out = cluster.root / f"slurm-{nxt}.out"  # sbatch's default output, in the job's cwd
        try:
            text = wait_for(lambda: out.exists() and "exit status" in out.read_text()
                            and out.read_text(), f"job {nxt} (the next round) to end",
                            timeout=120, interval=0.5)
        finally:
            cluster.run(["scancel", "--name=gpunet-fleet"])  # ends the chain: its successor
    assert f"job {nxt}, 2 nodes (n[0-1])" in text and "exit status 0" in text, text
    [line] = [json.loads(x) for x in text.splitlines() if x.startswith("{")]  # rank 0's pair
    assert (line["node"], line["peer"], line["ok"]) == ("n0", "n1", True), text


def test_cluster_is_removed_after_a_failure() -> None:
    slurm.require()
    with pytest.raises(RuntimeError, match="planted"), slurm.cluster(2, "gpunet-slurmgone") as c:
        names = [n.net.ns for n in c.nodes] + [c.controller.ns]
        root = c.root
        raise RuntimeError("planted")
    assert not set(names) & set(slurm.netns.namespaces())
    assert not root.exists()
    assert not [n for n in names if (slurm.ETC_NETNS / n).exists()]


def test_sweep_removes_what_a_dead_run_left() -> None:
    slurm.require()
    dead = slurm.netns.dead_pid()
    ns = f"gpunet-slurmsweep-{dead}-abc123-n0"
    root = Path(f"/tmp/gpunet-slurmsweep-{dead}-xyz")
    slurm.netns.add_namespace(ns)
    left = None
    try:
        (slurm.ETC_NETNS / ns).mkdir(parents=True)
        root.mkdir()
        left = slurm.netns.run_in(slurm.netns.Node(0, ns, "", "", ""), ["sleep", "600"])
        wait_for(lambda: netns.pids_in(ns), f"sleep running in {ns}")
        gone = slurm.sweep("gpunet-slurmsweep")
        assert set(gone) == {ns, str(slurm.ETC_NETNS / ns), str(root)}
        assert left.wait(timeout=10) == -signal.SIGKILL  # a daemon it left is killed
        assert ns not in slurm.netns.namespaces() and not root.exists()
    finally:
        if left is not None and left.poll() is None:
            left.kill()
            left.wait()
        slurm.netns.del_namespace(ns)
        shutil.rmtree(slurm.ETC_NETNS / ns, ignore_errors=True)
        shutil.rmtree(root, ignore_errors=True)
