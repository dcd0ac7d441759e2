"""The pair plan's dashboard (grafana/gpunet-pairs.json) and the fleet inhibition rules on real
parts: six installed exporters, each serving a pairs.json written with probe.pairs.write, one
Prometheus scraping them with the generated rules (every `for:` 0s) and Debian's Alertmanager
running the shipped alerts/alertmanager.yml.

The fleet: leaf-a (a1, a2, a3) and leaf-b (b1, b2, b3), every pair of the complete graph (5 pairs
per node): 40 GB/s inside a leaf, 20 GB/s across, and
- a3 bad: all its pairs at 2 GB/s (GpunetFleetNodeSuspect and GpunetFleetBandwidthOutlier);
- b1-b2 failed (GpunetFleetLinkSlow from both ends, inside leaf-b);
- a1-b3 at 5 GB/s (GpunetFleetLinkSlow from both ends, across the leaves);
- so leaf-b's cross-leaf median (20) is half its intra-leaf median (40): GpunetFleetCrossLeafSlow
  for leaf-b (leaf-a's intra-leaf median is pulled down by a3, so leaf-a does not fire).
Every node's median pair is 20 GB/s but a3's, so the fleet median is 20 GB/s.

Prometheus' target label `instance` is the node's name, as docs/dashboards.md advises, so the
matrix's rows and columns are the same names."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import requests
import yaml

from gpunet_exporter.mixin import dashboards as gen
from gpunet_exporter.probe import pairs

from support.exporter import Exporter, free_port
from support.paths import REPO
from support.prometheus import query, start, start_prometheus, stop
from support.wait import wait_for

LEAF = {"a1": "leaf-a", "a2": "leaf-a", "a3": "leaf-a",
        "b1": "leaf-b", "b2": "leaf-b", "b3": "leaf-b"}
GB = 1e9
BAD_NODE = "a3"
FAILED = frozenset(("b1", "b2"))
SLOW_CROSS = frozenset(("a1", "b3"))
JOB = "gpunet"


def bandwidth(a: str, b: str) -> float | None:
    """The pair's bus bandwidth in this fleet, None when it failed."""
    pair = frozenset((a, b))
    if pair == FAILED:
        return None
    if BAD_NODE in pair:
        return 2 * GB
    if pair == SLOW_CROSS:
        return 5 * GB
    return 40 * GB if LEAF[a] == LEAF[b] else 20 * GB


def view(node: str, ts: float) -> pairs.Pairs:
    """``node``'s pairs.json: every other node is a peer."""
    got = []
    for peer in LEAF:
        if peer == node:
            continue
        bw = bandwidth(node, peer)
        got.append(pairs.Pair(peer=peer, ok=bw is not None, peer_leaf=LEAF[peer],
                              latency_seconds=None if bw is None else 2e-5,
                              bus_bandwidth_bytes_per_second=bw,
                              transport=None if bw is None else "IB", gdr=bw is not None,
                              error=None if bw is not None else "timeout"))
    return pairs.Pairs(node=node, plan="custom", round_timestamp=ts, pairs=tuple(got),
                       leaf=LEAF[node])


# What the rules must fire on this fleet: (alert, instance, peer, leaf).
LINK = "GpunetFleetLinkSlow"
EXPECTED = {
    ("GpunetFleetNodeSuspect", "a3", "", ""),
    ("GpunetFleetBandwidthOutlier", "a3", "", ""),
    (LINK, "b1", "b2", "leaf-b"), (LINK, "b2", "b1", "leaf-b"),
    (LINK, "a1", "b3", "leaf-a"), (LINK, "b3", "a1", "leaf-b"),
    ("GpunetFleetCrossLeafSlow", "", "", "leaf-b"),
}
# ... and what the shipped inhibition rules mute: leaf-b's slow cross-leaf pairs, seen from
# either end, and the suspect node's outlier alert.
INHIBITED = {(LINK, "a1", "b3", "leaf-a"), (LINK, "b3", "a1", "leaf-b"),
             ("GpunetFleetBandwidthOutlier", "a3", "", "")}


def key(labels: dict[str, str]) -> tuple[str, str, str, str]:
    return (labels["alertname"], labels.get("instance", ""), labels.get("peer", ""),
            labels.get("leaf", ""))


@dataclass
class Stack:
    prometheus: str
    alertmanager: str


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return wait_for(check, what, timeout=timeout, interval=0.5,
                    ignore=(requests.RequestException,))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    for binary in ("prometheus", "prometheus-alertmanager"):
        assert shutil.which(binary), f"{binary} is required (tests/run.sh installs it as root)"
    tmp = tmp_path_factory.mktemp("pairs-dashboard")
    exporters: list[Exporter] = []
    procs: list[subprocess.Popen[bytes]] = []
    ts = float(int(time.time()))
    try:
        targets = []
        for node in LEAF:
            state = tmp / node
            state.mkdir()
            pairs.write(str(state), view(node, ts))
            (tmp / f"{node}.yml").write_text(yaml.safe_dump(
                {"probe": {"runner": "none", "state_dir": str(state)}}))
            e = Exporter(["--collector.disable-defaults", "--collector.probe",
                          f"--config.file={tmp / f'{node}.yml'}", "--no-hotplug"])
            exporters.append(e)
            targets.append({"targets": [f"127.0.0.1:{e.port}"], "labels": {"instance": node}})

        # Alertmanager: the shipped example, its receivers on a port nobody listens on (only
        # its inhibition is under test here), waits shortened.
        am = yaml.safe_load((REPO / "alerts" / "alertmanager.yml").read_text())
        am["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
        for receiver in am["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = f"http://127.0.0.1:{free_port()}/{receiver['name']}"
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am))
        am_port = free_port()
        procs.append(start(["prometheus-alertmanager",
                            f"--config.file={tmp / 'alertmanager.yml'}",
                            f"--storage.path={tmp / 'am-data'}",
                            f"--web.listen-address=127.0.0.1:{am_port}",
                            "--cluster.listen-address="], tmp / "alertmanager.log"))
        proc, url = start_prometheus(tmp, targets, f"127.0.0.1:{am_port}")
        procs.append(proc)
        wait_until("every exporter scraped",
                   lambda: len(query(url, f'up{{job="{JOB}"}} == 1')) == len(LEAF))
        yield Stack(url, f"http://127.0.0.1:{am_port}")
    finally:
        for p in procs:
            stop(p)
        for e in exporters:
            e.stop()


def settled(what: str, read: Callable[[], dict[Any, Any]],
            done: Callable[[dict[Any, Any]], bool]) -> dict[Any, Any]:
    """``read()`` once ``done`` says it is complete; on timeout the failure shows what the last
    read saw."""
    last: list[dict[Any, Any]] = [{}]

    def check() -> dict[Any, Any] | None:
        last[0] = read()
        return last[0] if done(last[0]) else None

    try:
        result: dict[Any, Any] = wait_until(what, check)
    except AssertionError:
        raise AssertionError(f"waiting for {what}; last seen: {sorted(last[0].items())}") \
            from None
    return result


def firing(stack: Stack) -> dict[tuple[str, str, str, str], dict[str, str]]:
    """The fleet alerts firing in Prometheus, once they are exactly the expected ones."""
    def read() -> dict[tuple[str, str, str, str], dict[str, str]]:
        rows = query(stack.prometheus, 'ALERTS{alertstate="firing", alertname=~"GpunetFleet.+"}')
        return {key(r["metric"]): r["metric"] for r in rows}

    return settled("the fleet alerts of this fleet firing", read,
                   lambda got: set(got) == EXPECTED)


def test_rules_fire_with_the_leaves_of_each_link(stack: Stack) -> None:
    """Exactly the expected alerts fire, and GpunetFleetLinkSlow carries both leaves and
    whether the pair crosses them; GpunetFleetCrossLeafSlow carries its leaf as peer_leaf too."""
    alerts = firing(stack)
    for (name, instance, peer, _), labels in alerts.items():
        if name == LINK:
            assert (labels["leaf"], labels["peer_leaf"]) == (LEAF[instance], LEAF[peer])
            cross = "true" if LEAF[instance] != LEAF[peer] else "false"
            assert labels["cross_leaf"] == cross, labels
    leaf = alerts[("GpunetFleetCrossLeafSlow", "", "", "leaf-b")]
    assert leaf["peer_leaf"] == "leaf-b" and "instance" not in leaf


def test_alertmanager_inhibits_the_caused_fleet_alerts(stack: Stack) -> None:
    """Prometheus sends the firing alerts to Alertmanager, which marks leaf-b's cross-leaf
    links (from both ends) and a3's outlier alert inhibited, and nothing else."""
    firing(stack)

    def states() -> dict[tuple[str, str, str, str], str]:
        return {key(a["labels"]): a["status"]["state"] for a in requests.get(
            f"{stack.alertmanager}/api/v2/alerts",
            params={"filter": 'alertname=~"GpunetFleet.+"'}, timeout=10).json()}

    want = {k: "suppressed" if k in INHIBITED else "active" for k in EXPECTED}
    settled("Alertmanager holding the fleet alerts, the caused ones inhibited", states,
            lambda got: got == want)


def test_every_pairs_panel_query_returns_data(stack: Stack) -> None:
    """Every query of the pair dashboard, variables substituted as Grafana does for all nodes
    of the job, returns at least one series on this fleet."""
    firing(stack)  # the rules have evaluated: recorded series and ALERTS exist
    variables = {"instance": ".+", "job": JOB, "__rate_interval": "30s", "__interval": "1s",
                 "__range": "5m", "datasource": "prometheus"}
    queries = [(title, gen.substitute(expr, variables))
               for title, expr in gen.queries(gen.dashboards()["gpunet-pairs.json"])]
    assert len(queries) >= 15
    empty = [f"{title}: {promql}" for title, promql in queries
             if not query(stack.prometheus, promql)]
    assert not empty, "queries without data:\n" + "\n".join(empty)


def test_pair_matrix_and_suspects_name_the_faults(stack: Stack) -> None:
    """What the matrix and the suspect tables show: each pair's share of the fleet median
    (20 GB/s) or -1 for the failed pair; the suspect node; the slow links with their share;
    the slow leaf with its cross/intra ratio."""
    firing(stack)
    dash = gen.dashboards()["gpunet-pairs.json"]
    panels = {p["title"]: p for p in gen.iter_panels(dash)}

    def run(title: str, ref: str = "A") -> list[dict[str, Any]]:
        (t,) = [t for t in panels[title]["targets"] if t["refId"] == ref]
        return query(stack.prometheus, gen.substitute(t["expr"], {"job": JOB}))

    matrix = {(r["metric"]["instance"], r["metric"]["peer"]): round(float(r["value"][1]), 3)
              for r in run("Pair bus bandwidth / fleet median, node x peer")}
    want = {}
    for a in LEAF:
        for b in LEAF:
            if a != b:
                bw = bandwidth(a, b)
                want[(a, b)] = -1.0 if bw is None else round(bw / (20 * GB), 3)
    assert matrix == want
    suspects = {(r["metric"]["instance"], r["metric"]["alertname"])
                for r in run("Suspect nodes")}
    assert suspects == {("a3", "GpunetFleetNodeSuspect"), ("a3", "GpunetFleetBandwidthOutlier")}
    healthy = {r["metric"]["alertname"]: float(r["value"][1]) for r in run("Suspect nodes", "C")}
    assert healthy == {"GpunetFleetNodeSuspect": 0.0, "GpunetFleetBandwidthOutlier": 0.0}
    links = {(r["metric"]["instance"], r["metric"]["peer"]): float(r["value"][1])
             for r in run("Slow links")}
    assert links == {("b1", "b2"): -1.0, ("b2", "b1"): -1.0, ("a1", "b3"): 0.25,
                     ("b3", "a1"): 0.25}
    leaves = {r["metric"]["leaf"]: float(r["value"][1]) for r in run("Slow leaves")}
    assert leaves == {"leaf-b": 0.5}
