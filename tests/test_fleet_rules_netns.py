"""Issue 18's "done when": the fleet rules, run in a real Prometheus over what real exporters
export from real pair measurements, name the shaped node and the shaped link, and nothing on a
healthy fleet.

Four network namespaces (tests/support/netns.py); every pair of the complete graph (the plan
``ring --hops 2`` of four nodes: the ring 0-1, 1-2, 2-3, 3-0 and 0-2, 1-3, three pairs per node)
is measured by the real launcher, ``gpunet-probe fleet`` started in each namespace with srun's
environment (gloo over TCP through the bridge), three times: every node's link at the fleet's
rate (healthy), node 2's link four times slower, the path 0-1 four times slower. The fleet's
links are shaped as a real fabric's are all one speed: unshaped, gloo between namespaces is
bound by the two CPUs, and a node whose pairs happened to share them with more of the others
measured up to a third below the rest (an outlier on a healthy fleet, seen in CI). Three pairs
per node keep the node medians robust: with the ring alone a node has two pairs, and the median
of (slow, fast) is their mean.

Each node's ``pairs.json`` of a scenario, as the launcher wrote it, is exported by one
installed ``gpunet-exporter`` per node (``runner: none``, its own state_dir; exporters run in the
root namespace on loopback, since exporting needs no fleet network), scraped by one Prometheus
(job ``gpunet``, instance = each exporter's address) evaluating the generated rules with every
``for:`` at 0s. Alerts are read from /api/v1/alerts once the rules have evaluated the scenario.
Numbers seen: docs/fleet.md ("Fleet tests on one host")."""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from gpunet_exporter.mixin.alerts import collective
from gpunet_exporter.probe import pairs, plan

from support import fleet as launch
from support import netns
from support.exporter import Exporter
from support.prometheus import api, start_prometheus, stop
from support.wait import wait_for

pytestmark = pytest.mark.slow

NODES = ("n0", "n1", "n2", "n3")
# ring --hops 2 of four nodes: the complete graph, 3 pairs per node.
PLAN: plan.Plan = plan.ring(NODES, 2)
SHAPED_NODE = "n2"
SHAPED_PAIR = ("n0", "n1")
# Every link of the healthy fleet: well below what gloo between namespaces reaches on two
# busy cores (700 to 1200 MB/s seen), so that the links, not the CPUs, set every pair's rate.
FLEET_RATE = "1600mbit"
SLOW_RATE = "400mbit"  # the shaped node's link and the shaped path: a quarter of the fleet's
FLEET_ALERTS = ("GpunetFleetNodeSuspect", "GpunetFleetBandwidthOutlier", "GpunetFleetLinkSlow",
                "GpunetFleetCrossLeafSlow", "GpunetFleetProbeStale")

Measured = dict[tuple[str, str], float]  # pair (plan order) -> bus bandwidth, largest size


@dataclass
class Scenario:
    files: dict[str, bytes]  # node -> its pairs.json, as the launcher wrote it
    bw: Measured  # each pair as its first node saw it


@dataclass
class Fleet:
    scenarios: dict[str, Scenario] = field(default_factory=dict)


def measure(f: netns.Fleet, state: Path) -> Scenario:
    """One run of the launcher over the four namespaces: each node's file, and each pair."""
    launches = [launch.Launch(n, state / n, ("--backend", "gloo", "--sizes", "1MiB,16MiB",
                                             "--warmup", "1", "--iterations", "4",
                                             "--hops", "2", "--pair-timeout", "60"), ns=f[i])
                for i, n in enumerate(NODES)]
    done = launch.finish(launch.start(launches, launcher="srun", master=f[0].addr, port=29400),
                         timeout=300)
    assert [rc for rc, _ in done] == [0] * len(NODES), "\n".join(o[-3000:] for _, o in done)
    files = {n: (state / n / pairs.FILE).read_bytes() for n in NODES}
    seen = {n: {p.peer: p for p in pairs.read(str(state / n / pairs.FILE)).pairs}
            for n in NODES}
    bw = {}
    for a, b in (pair for rnd in PLAN for pair in rnd):
        p = seen[a][b]
        assert p.ok and p.bus_bandwidth_bytes_per_second, p
        bw[(a, b)] = p.bus_bandwidth_bytes_per_second
    return Scenario(files, bw)


def show(bw: Measured) -> str:
    return ", ".join(f"{a}-{b}: {v / 1e6:.0f}" for (a, b), v in bw.items()) + " MB/s"


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Fleet:
    """The three scenarios' measurements, one fleet for the module."""
    netns.require()
    plan.check(PLAN)
    state = tmp_path_factory.mktemp("fleet-rules")
    out = Fleet()
    with netns.fleet(len(NODES), "gpunet-rules") as f:
        node = f[NODES.index(SHAPED_NODE)]
        a, b = (f[NODES.index(n)] for n in SHAPED_PAIR)

        def fleet_links() -> None:
            for n in f.nodes:  # both directions of every node's link
                netns.shape_node(n, rate=FLEET_RATE)

        try:
            fleet_links()
            out.scenarios["healthy"] = measure(f, state / "healthy")
            netns.shape_node(node, rate=SLOW_RATE)  # in place of its fleet rate
            out.scenarios["node"] = measure(f, state / "node")
            fleet_links()
            # htb on both ends' eth0, the path to the other end slow, the rest unclassified;
            # their bridge ports, every node's ingress, keep the fleet's rate
            netns.shape_pair(a, b, rate=SLOW_RATE)
            out.scenarios["pair"] = measure(f, state / "pair")
        finally:
            netns.unshape(*f.nodes)
    for name, sc in out.scenarios.items():
        # the numbers in docs/fleet.md (pytest -s)
        print(f"{name} (fleet {FLEET_RATE}, slow {SLOW_RATE}): {show(sc.bw)}")
    return out


@dataclass
class Stack:
    prometheus: str
    states: dict[str, Path]  # node -> its exporter's state_dir
    instance: dict[str, str]  # instance (exporter address) -> node


def wait_until(what: str, check: Callable[[], Any], timeout: float = 30) -> Any:
    return wait_for(check, what, timeout=timeout, interval=0.25,
                    ignore=(requests.RequestException,))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    assert shutil.which("prometheus"), "prometheus is required (tests/run.sh installs it)"
    tmp = tmp_path_factory.mktemp("fleet-prom")
    exporters: list[Exporter] = []
    procs: list[subprocess.Popen[bytes]] = []
    try:
        states, instance = {}, {}
        for node in NODES:
            state = tmp / node
            state.mkdir()
            (tmp / f"{node}.yml").write_text(yaml.safe_dump(
                {"probe": {"runner": "none", "state_dir": str(state)}}))
            e = Exporter(["--collector.disable-defaults", "--collector.probe",
                          f"--config.file={tmp / f'{node}.yml'}", "--no-hotplug"])
            exporters.append(e)
            states[node] = state
            instance[f"127.0.0.1:{e.port}"] = node
        proc, url = start_prometheus(tmp, [{"targets": list(instance)}])
        procs.append(proc)
        wait_until("every exporter scraped", lambda: len(api(
            url, "query", query='up{job="gpunet"} == 1')["result"]) == len(NODES))
        yield Stack(url, states, instance)
    finally:
        for p in procs:
            stop(p)
        for e in exporters:
            e.stop()


def evaluate(stack: Stack, sc: Scenario) -> set[tuple[str, str, str]]:
    """Give every node's exporter the launcher's file of the scenario, wait until the recording
    rules hold its node medians and the alert group has evaluated since; the firing fleet alerts
    as (alert, node, peer)."""
    want = {}
    for node, state in stack.states.items():
        (state / pairs.FILE).write_bytes(sc.files[node])
        got = pairs.read(str(state / pairs.FILE))
        want[node] = statistics.median(p.bus_bandwidth_bytes_per_second or 0.0
                                       for p in got.pairs)

    def medians() -> float | None:
        rows = api(stack.prometheus, "query", query=collective.NODE_MEDIAN_BW)["result"]
        got = {stack.instance[r["metric"]["instance"]]: float(r["value"][1]) for r in rows}
        ok = got.keys() == want.keys() and all(
            math.isclose(got[n], want[n], rel_tol=1e-9) for n in want)
        return time.time() if ok else None

    seen = wait_until("the recording rules on this round's pairs", medians)

    def alert_group_evaluated() -> bool:
        groups = api(stack.prometheus, "rules")["groups"]
        g = next(g for g in groups if g["name"] == "gpunet-alerts")
        # A whole interval later: its evaluation time is surely past the recorded samples'.
        return bool(_unix(g["lastEvaluation"]) > seen + 1)

    wait_until("the alert rules evaluated after that", alert_group_evaluated)
    firing = set()
    for a in api(stack.prometheus, "alerts")["alerts"]:
        name = a["labels"]["alertname"]
        if a["state"] == "firing" and name in FLEET_ALERTS:
            inst = a["labels"].get("instance", "")
            firing.add((name, stack.instance.get(inst, inst), a["labels"].get("peer", "")))
    print(f"firing: {sorted(firing)}")  # the numbers in docs/fleet.md (pytest -s)
    return firing


def _unix(rfc3339: str) -> float:
    """Prometheus' RFC 3339 time (nanoseconds, Z) as Unix seconds."""
    head, _, frac = rfc3339.rstrip("Z").partition(".")
    base = datetime.fromisoformat(head + "+00:00").timestamp()
    return base + (float(f"0.{frac}") if frac else 0.0)


def test_healthy_fleet_names_nothing(measured: Fleet, stack: Stack) -> None:
    sc = measured.scenarios["healthy"]
    assert evaluate(stack, sc) == set(), show(sc.bw)


def test_shaped_node_is_named_and_no_link(measured: Fleet, stack: Stack) -> None:
    sc = measured.scenarios["node"]
    firing = evaluate(stack, sc)
    assert ("GpunetFleetNodeSuspect", SHAPED_NODE, "") in firing, f"{firing}; {show(sc.bw)}"
    allowed = {("GpunetFleetNodeSuspect", SHAPED_NODE, ""),
               ("GpunetFleetBandwidthOutlier", SHAPED_NODE, "")}
    assert firing <= allowed, f"{firing - allowed}; {show(sc.bw)}"


def test_shaped_path_blames_the_link_not_a_node(measured: Fleet, stack: Stack) -> None:
    sc = measured.scenarios["pair"]
    firing = evaluate(stack, sc)
    a, b = SHAPED_PAIR
    ends = {("GpunetFleetLinkSlow", a, b), ("GpunetFleetLinkSlow", b, a)}
    assert firing == ends, f"{firing}; {show(sc.bw)}"  # once from each end, peer the other end
