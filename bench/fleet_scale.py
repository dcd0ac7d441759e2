"""Fleet probes at scale (issue 18): what a pairing plan, the nodes' fleet series and the
generated fleet rules cost for fleets far larger than the test fleets.

    python bench/fleet_scale.py [--nodes 500,1000,2000] [--pairs 2,4] [--single 2000,10000]
                                [--evaluations 10] [--store-clients 100,1000,10000]
                                [--out bench/results/fleet_scale.json]
    python bench/fleet_scale.py --nodes 40 --pairs 2 --single '' --evaluations 3 \\
                                --plan-sizes 100 --store-clients 10      (a smoke run, < 2 min)

Four parts, each printed as markdown and written, with every raw number, to --out:

- plans: for 100, 1,000 and 10,000 nodes (--plan-sizes) and each kind of
  gpunet_exporter.probe.plan (ring, random, leaf with 32 nodes per leaf, repair with 1% suspects):
  generation time (median of repeats), rounds, pairs, pairs per node, the size of a node's
  pairs.json (written as statefile.write_json writes it) and the series its exporter serves for
  it (the probe collector's own _export_pairs, counted).
- prometheus: a real Prometheus (Debian's `prometheus` on PATH) loads the generated rules
  (gpunet_exporter.mixin.rules, every `for:` at 0s as tests/support/prometheus.py makes them, the
  expressions unchanged) and scrapes synthetic fleets: per node the gpunet_fleet_* series its
  exporter would serve for a plan of 2 pairs per node (the ring) or 4 (the ring plus a ring
  through the leaves, whose pairs all cross leaves), 32 nodes per leaf, a few nodes slow (every
  pair at 0.2x), a few failed (ok=false), one slow link (0.3x), two with a stale round. Two
  ways of serving them:
  * `targets` (--nodes): one Prometheus target per node, each with its own `instance`
    (static_configs labels, `__metrics_path__` /n/<node>), all served by one HTTP server in
    this process: Prometheus sees N targets, N `up` series, N scrapes per interval.
  * `single` (--single): one target serving every node's series with an explicit `instance`
    label, `honor_labels: true`. The fleet rules group by (instance, job) and (job, peer), so
    their work is the same; only `up` and the per-target scrape series are not per node (the
    gpunet-health group, which joins on `up`, then has one row). This reaches 10,000 nodes,
    where 10,000 targets would be too much for the one Python server on 2 cores.
  Measured over --evaluations evaluations after the fleet is in and the planted alerts fire:
  per rule group the evaluation time (evaluationTime of /api/v1/rules, the value
  prometheus_rule_group_last_duration_seconds reports, one sample per evaluation: deduplicated
  by the group's lastEvaluation), the summed and per-rule evaluation times of the fleet rules,
  median and max; each fleet rule's expression run once as a query with stats=all (samples
  touched); prometheus_rule_evaluation_duration_seconds (all rules), missed iterations and
  failures; samples per scrape and fleet series per node; head and recorded series;
  Prometheus's RSS and its CPU seconds per evaluation. Sanity check: the firing fleet
  alerts must be exactly GpunetFleetNodeSuspect for the slow and failed nodes, LinkSlow for the
  two ends of the slow link, ProbeStale for the stale nodes, BandwidthOutlier for at least the
  slow nodes (also allowed: the slow link's ends and, with 2 pairs, the slow nodes' ring
  neighbours, whose median of a slow and a fast pair is their mean); the run exits 1 otherwise.
- fit: evaluation time against pair series, least squares over the `targets` points,
  extrapolated to 10,000 nodes and compared with the `single` points.
- store: torch's TCPStore (the c10d rendezvous store, libuv server) in one process with N
  clients (--store-clients) from 8 client processes, each connecting its share one after the
  other: time to connect them all, an add-and-wait barrier across all of them, and the size
  of the c10d dynamic rendezvous state (the pickled _RendezvousState every node
  compare-and-sets on join and on every keep-alive) for N nodes. Needs torch (the `probe`
  extra); skipped without it.

The machine's 2 cores run Prometheus, the HTTP server and the store clients together: the
numbers are upper bounds for a dedicated Prometheus. Wall-clock numbers are for
docs/benchmarks.md, never for test assertions.
"""

from __future__ import annotations

import argparse
import base64
import functools
import http.server
import json
import os
import pickle
import random
import shutil
import socketserver
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # for support.prometheus, support.wait

import requests  # noqa: E402
import yaml  # noqa: E402
from prometheus_client.exposition import generate_latest  # noqa: E402
from prometheus_client.registry import CollectorRegistry  # noqa: E402
from scrape import emit, machine  # noqa: E402  (bench/scrape.py, next to this script)

from gpunet_exporter.collector import Families  # noqa: E402
from gpunet_exporter.collectors.probe import ProbeCollector  # noqa: E402
from gpunet_exporter.mixin import rules  # noqa: E402
from gpunet_exporter.probe import pairs, plan  # noqa: E402

from support import prometheus as prom  # noqa: E402
from support.exporter import free_port  # noqa: E402
from support.wait import wait_for  # noqa: E402

LEAF_SIZE = 32
JOB = "gpunet"  # the job the generated rules' health group expects
BANDWIDTH = 45e9  # bytes/s of a healthy pair (a 400 Gb/s NDR rail's bus bandwidth, about)
LATENCY = 20e-6
SLOW_FACTOR = 0.2
SLOW_LINK_FACTOR = 0.3
STALE_AGE = 4 * 3600.0  # seconds; fleet.stale_seconds is 3 h
SCRAPE_INTERVAL = 10  # seconds
EVAL_INTERVAL = 2  # seconds
MAX_PEERS = 64  # probe.fleet_max_peers' default
FLEET_ALERTS = ("GpunetFleetNodeSuspect", "GpunetFleetBandwidthOutlier", "GpunetFleetLinkSlow",
                "GpunetFleetCrossLeafSlow", "GpunetFleetProbeStale")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def node_names(n: int) -> list[str]:
    return [f"node{i:05d}" for i in range(n)]


def leaf_of(i: int) -> str:
    return f"leaf{i // LEAF_SIZE:03d}"


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --- plans ---------------------------------------------------------------------------------


def pairs_view(node: str, leaf: str, peers: Sequence[tuple[str, str]]) -> pairs.Pairs:
    """A node's pairs.json content for ``peers`` (name, leaf), every pair a healthy IB pair."""
    return pairs.Pairs(node=node, plan="ring", round_timestamp=1767225600.0, leaf=leaf,
                       pairs=tuple(pairs.Pair(peer=p, ok=True, peer_leaf=pl,
                                              latency_seconds=LATENCY,
                                              bus_bandwidth_bytes_per_second=BANDWIDTH,
                                              transport="IB", gdr=True) for p, pl in peers))


def pairs_file_bytes(view: pairs.Pairs) -> int:
    """The size of pairs.json as statefile.write_json writes it."""
    return len(json.dumps(pairs.to_json(view), indent=1, sort_keys=True).encode()) + 1


def exposition(view: pairs.Pairs, max_peers: int = MAX_PEERS) -> bytes:
    """What the node's exporter serves for ``view``: the probe collector's fleet families, in
    the Prometheus text format."""
    fams = Families()
    ProbeCollector._export_pairs(fams, view, max_peers)

    class _Fams:
        def collect(self) -> Iterable[Any]:
            return iter(fams)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fams())
    return generate_latest(registry)


def samples(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


def time_call(fn: Callable[[], Any], budget: float = 0.3, most: int = 7) -> tuple[float, Any]:
    """Median seconds of repeated calls of ``fn`` (at least 3, at most ``most``, stopping once
    ``budget`` seconds are spent), and its last result."""
    times: list[float] = []
    result: Any = None
    spent = 0.0
    while len(times) < 3 or (spent < budget and len(times) < most):
        t0 = time.perf_counter()
        result = fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return statistics.median(times), result


def plan_run(sizes: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        nodes = node_names(n)
        leaves = {name: leaf_of(i) for i, name in enumerate(nodes)}
        suspects = nodes[::100][: max(1, n // 100)]  # 1%, spread over the fleet
        makers: dict[str, Callable[[], plan.Plan]] = {
            "ring": functools.partial(plan.make, "ring", nodes),
            "random": functools.partial(plan.make, "random", nodes, seed=1),
            "leaf": functools.partial(plan.make, "leaf", nodes, leaves=leaves),
            "repair": functools.partial(plan.make, "repair", nodes, suspects=suspects,
                                        leaves=leaves),
        }
        for kind, make in makers.items():
            seconds, p = time_call(make)
            plan.check(p)
            per_node: dict[str, list[str]] = {}
            for rnd in p:
                for a, b in rnd:
                    per_node.setdefault(a, []).append(b)
                    per_node.setdefault(b, []).append(a)
            counts = [len(v) for v in per_node.values()]
            busiest = max(per_node, key=lambda k: len(per_node[k]))
            view = pairs_view(busiest, leaves[busiest],
                              [(q, leaves[q]) for q in per_node[busiest]])
            body = exposition(view)
            rows.append({
                "nodes": n, "kind": kind, "generate_seconds": seconds, "rounds": len(p),
                "pairs": sum(len(r) for r in p), "nodes_in_plan": len(per_node),
                "pairs_per_node_max": max(counts), "pairs_per_node_mean": statistics.fmean(counts),
                "largest_round": max(len(r) for r in p),
                "pairs_json_bytes_busiest": pairs_file_bytes(view),
                "series_busiest": samples(body), "exposition_bytes_busiest": len(body),
            })
            log(f"plan {kind:6} n={n:5}: {len(p)} rounds, {rows[-1]['pairs']} pairs, "
                f"{seconds * 1e3:.2f} ms")
    return rows


# --- the synthetic fleet ---------------------------------------------------------------------


@dataclass
class Fleet:
    nodes: list[str]
    leaves: dict[str, str]
    pairs_per_node: int
    edges: list[tuple[str, str]]
    adjacency: dict[str, list[str]]
    slow: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    slow_link: tuple[str, str] = ("", "")
    views: dict[str, pairs.Pairs] = field(default_factory=dict)

    def expected(self) -> dict[str, set[tuple[str, str]]]:
        """The firing fleet alerts the rules must give, as (instance node, peer or '')."""
        a, b = self.slow_link
        return {
            "GpunetFleetNodeSuspect": {(n, "") for n in [*self.slow, *self.failed]},
            "GpunetFleetLinkSlow": {(a, b), (b, a)},
            "GpunetFleetProbeStale": {(n, "") for n in self.stale},
            "GpunetFleetCrossLeafSlow": set(),
        }

    def outlier_bounds(self) -> tuple[set[str], set[str]]:
        """BandwidthOutlier: the nodes it must name, and those it may name."""
        must = set(self.slow)
        may = must | set(self.slow_link)
        # A peer of a slow node with two pairs: the median of a slow and a fast pair is their
        # mean, below fleet.outlier_ratio (0.7) of the fleet's median node.
        may |= {q for s in self.slow for q in self.adjacency[s] if len(self.adjacency[q]) <= 2}
        return must, may


def ring_through_leaves(nodes: Sequence[str]) -> list[str]:
    """The nodes ordered by position within the leaf, then leaf: successive nodes of this
    order sit on different leaves."""
    return [nodes[i] for i in sorted(range(len(nodes)), key=lambda i: (i % LEAF_SIZE,
                                                                        i // LEAF_SIZE))]


def build_fleet(n: int, per_node: int, seed: int = 18) -> Fleet:
    nodes = node_names(n)
    leaves = {name: leaf_of(i) for i, name in enumerate(nodes)}
    plans = [plan.ring(nodes)]
    if per_node >= 4:
        plans.append(plan.ring(ring_through_leaves(nodes)))
    if per_node not in (2, 4):
        raise SystemExit(f"--pairs: 2 or 4 pairs per node, got {per_node}")
    edges: list[tuple[str, str]] = []
    seen: set[frozenset[str]] = set()
    for p in plans:
        for rnd in p:
            for a, b in rnd:
                if frozenset((a, b)) not in seen:
                    seen.add(frozenset((a, b)))
                    edges.append((a, b))
    adjacency: dict[str, list[str]] = {name: [] for name in nodes}
    for a, b in edges:
        adjacency[a].append(b)
        adjacency[b].append(a)
    fleet = Fleet(nodes, leaves, per_node, edges, adjacency)
    plant_faults(fleet, random.Random(seed))
    fill_views(fleet, random.Random(seed + 1))
    return fleet


def plant_faults(fleet: Fleet, rng: random.Random) -> None:
    """Faulty nodes at least 3 pair hops apart (no two share a peer, so each one's peers keep a
    healthy pair) and away from leaf edges (the ring's cross-leaf pairs stay healthy)."""
    n = len(fleet.nodes)
    count = max(1, n // 250)
    order = [i for i in range(n) if 4 <= i % LEAF_SIZE < LEAF_SIZE - 4]
    rng.shuffle(order)
    taken: set[str] = set()

    def near(name: str) -> set[str]:
        one = set(fleet.adjacency[name])
        return {name} | one | {q for p in one for q in fleet.adjacency[p]}

    def take() -> str:
        while order:
            name = fleet.nodes[order.pop()]
            if not near(name) & taken:
                taken.add(name)
                return name
        raise SystemExit(f"{n} nodes are too few for the planted faults")

    fleet.slow = sorted(take() for _ in range(count))
    fleet.failed = sorted(take() for _ in range(count))
    a = take()  # 3 hops from every other fault, so its peer b is 2 hops from them at least
    b = fleet.adjacency[a][0]
    taken.add(b)
    fleet.slow_link = (a, b)
    fleet.stale = sorted(take() for _ in range(2))


def fill_views(fleet: Fleet, rng: random.Random) -> None:
    now = time.time()
    measured: dict[frozenset[str], tuple[bool, float | None, float | None]] = {}
    slow, failed = set(fleet.slow), set(fleet.failed)
    for a, b in fleet.edges:
        key = frozenset((a, b))
        if key & failed:
            measured[key] = (False, None, None)
            continue
        bw: float = BANDWIDTH * (1 + rng.gauss(0, 0.03))
        if key & slow:
            bw *= SLOW_FACTOR
        if key == frozenset(fleet.slow_link):
            bw *= SLOW_LINK_FACTOR
        measured[key] = (True, LATENCY * (1 + abs(rng.gauss(0, 0.05))), bw)
    stale = set(fleet.stale)
    for name in fleet.nodes:
        entries = []
        for peer in fleet.adjacency[name]:
            ok, lat, busbw = measured[frozenset((name, peer))]
            entries.append(pairs.Pair(
                peer=peer, ok=ok, peer_leaf=fleet.leaves[peer], latency_seconds=lat,
                bus_bandwidth_bytes_per_second=busbw, transport="IB", gdr=True,
                error=None if ok else "pair timed out after 120 s"))
        fleet.views[name] = pairs.Pairs(
            node=name, plan="ring", leaf=fleet.leaves[name], pairs=tuple(entries),
            round_timestamp=now - (STALE_AGE if name in stale else 60.0))


def instance(name: str) -> str:
    return f"{name}:9400"


def with_instance(body: bytes, inst: str) -> list[tuple[str, str]]:
    """(metric name, sample line with an instance label) for each sample of ``body``."""
    out = []
    label = f'instance="{inst}"'
    for raw in body.decode().splitlines():
        if not raw or raw.startswith("#"):
            continue
        name_end = min(i for i in (raw.find("{"), raw.find(" ")) if i >= 0)
        name = raw[:name_end]
        if raw[name_end] == "{":
            line = f"{name}{{{label},{raw[name_end + 1:]}"
        else:
            line = f"{name}{{{label}}}{raw[name_end:]}"
        out.append((name, line))
    return out


def bodies(fleet: Fleet, single: bool) -> dict[str, bytes]:
    """Path -> body: /n/<node> per node, or /all with every node's samples."""
    per_node = {name: exposition(fleet.views[name]) for name in fleet.nodes}
    if not single:
        return {f"/n/{name}": body for name, body in per_node.items()}
    meta: dict[str, list[str]] = {}
    lines: dict[str, list[str]] = {}
    for name, body in per_node.items():
        for raw in body.decode().splitlines():
            if raw.startswith("# "):
                metric = raw.split()[2]
                if metric not in lines:
                    meta.setdefault(metric, []).append(raw)
        for metric, line in with_instance(body, instance(name)):
            lines.setdefault(metric, []).append(line)
    text = []
    for metric, ls in lines.items():
        text += meta.get(metric, [])
        text += ls
    return {"/all": ("\n".join(text) + "\n").encode()}


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # Prometheus opens many connections at once
    errors = 0  # requests that failed (a scrape Prometheus gave up on: a broken pipe)

    def handle_error(self, request: Any, client_address: Any) -> None:
        type(self).errors += 1


def serve(paths: Mapping[str, bytes]) -> tuple[_Server, int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: no idle keep-alive threads

        def do_GET(self) -> None:
            body = paths.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = _Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, int(server.server_address[1])


# --- Prometheus -----------------------------------------------------------------------------


def prom_config(tmp: Path, port: int, fleet: Fleet, single: bool) -> Path:
    if single:
        scrape = {"job_name": JOB, "honor_labels": True, "metrics_path": "/all",
                  "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
    else:
        scrape = {"job_name": JOB, "static_configs": [
            {"targets": [f"127.0.0.1:{port}"],
             "labels": {"instance": instance(name), "__metrics_path__": f"/n/{name}"}}
            for name in fleet.nodes]}
    config = {
        "global": {"scrape_interval": f"{SCRAPE_INTERVAL}s",
                   "scrape_timeout": f"{SCRAPE_INTERVAL}s",
                   "evaluation_interval": f"{EVAL_INTERVAL}s"},
        "rule_files": [str(prom.fast_rules(tmp))],
        "scrape_configs": [scrape],
    }
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def metrics_text(url: str) -> str:
    return requests.get(f"{url}/metrics", timeout=10).text


def metric_values(text: str, name: str) -> dict[str, float]:
    """{labels text: value} of ``name``'s samples in Prometheus's own /metrics."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in "{ ":
            head, _, value = line.rpartition(" ")
            out[head[len(name):]] = float(value)
    return out


def scalar(url: str, expr: str) -> float:
    result = prom.query(url, expr)
    return float(result[0]["value"][1]) if result else float("nan")


def firing(url: str) -> dict[str, set[tuple[str, str]]]:
    out: dict[str, set[tuple[str, str]]] = {a: set() for a in FLEET_ALERTS}
    for alert in prom.api(url, "alerts")["alerts"]:
        name = alert["labels"]["alertname"]
        if name in out and alert["state"] == "firing":
            inst = alert["labels"].get("instance", "").removesuffix(":9400")
            out[name].add((inst, alert["labels"].get("peer", "")))
    return out


def sanity(fleet: Fleet, fired: Mapping[str, set[tuple[str, str]]]) -> list[str]:
    """What is wrong with the firing fleet alerts; empty when they are what the plant asks."""
    problems = []
    for name, want in fleet.expected().items():
        if fired[name] != want:
            problems.append(f"{name}: missing {sorted(want - fired[name])[:5]}, "
                            f"unexpected {sorted(fired[name] - want)[:5]}")
    must, may = fleet.outlier_bounds()
    named = {n for n, _ in fired["GpunetFleetBandwidthOutlier"]}
    if not must <= named or not named <= may:
        problems.append(f"GpunetFleetBandwidthOutlier: missing {sorted(must - named)[:5]}, "
                        f"unexpected {sorted(named - may)[:5]}")
    return problems


def is_fleet_rule(rule: Mapping[str, Any]) -> bool:
    return "gpunet_fleet" in rule.get("name", "") or rule.get("name", "").startswith(
        "GpunetFleet")


def proc_status(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def summary(xs: Sequence[float]) -> dict[str, float]:
    return {"median": median(xs), "max": max(xs) if xs else float("nan"),
            "min": min(xs) if xs else float("nan"), "n": len(xs)}


def prometheus_run(n: int, per_node: int, single: bool, evaluations: int) -> dict[str, Any]:
    mode = "single" if single else "targets"
    log(f"prometheus {mode} n={n} pairs/node={per_node}: building the fleet")
    t0 = time.perf_counter()
    fleet = build_fleet(n, per_node)
    paths = bodies(fleet, single)
    build_s = time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp(prefix="gpunet-fleet-scale-"))
    server, port = serve(paths)
    proc = None
    try:
        config = prom_config(tmp, port, fleet, single)
        url_port = free_port()
        proc = prom.start(["prometheus", f"--config.file={config}",
                           f"--storage.tsdb.path={tmp / 'data'}",
                           f"--web.listen-address=127.0.0.1:{url_port}"],
                          tmp / "prometheus.log")
        url = f"http://127.0.0.1:{url_port}"
        started = time.monotonic()
        wait_for(lambda: requests.get(f"{url}/-/ready", timeout=2).ok, "Prometheus ready",
                 timeout=60, ignore=(requests.RequestException,))
        healthy_nodes = n - len(fleet.failed)
        wait_for(lambda: scalar(url, "count(gpunet_fleet_round_timestamp_seconds)") == n
                 and scalar(url, f"sum({prom_job('up')})") == (1 if single else n),
                 f"all {n} nodes scraped", timeout=SCRAPE_INTERVAL * 4 + 30, interval=1)
        scraped_s = time.monotonic() - started
        wait_for(lambda: scalar(url, "sum(job:gpunet_fleet_nodes_reporting:count)")
                 == healthy_nodes, "the recording rules over every node", timeout=60,
                 interval=0.5)
        problems: list[str] = []
        try:
            wait_for(lambda: not sanity(fleet, firing(url)), "the planted fleet alerts",
                     timeout=60, interval=1)
        except AssertionError:
            problems = sanity(fleet, firing(url))
        fired = firing(url)
        # Measure: every group's last duration and the fleet rules' evaluation times, one
        # sample per evaluation (deduplicated by the group's last evaluation time).
        groups: dict[str, dict[str, list[float]]] = {}
        per_rule: dict[str, dict[str, list[float]]] = {}
        seen: dict[str, str] = {}
        _Server.errors = 0
        cpu0 = proc_cpu(proc.pid)
        own0 = time.process_time()
        wall0 = time.monotonic()

        def sample() -> bool:
            for g in prom.api(url, "rules")["groups"]:
                name = g["name"]
                if g.get("lastEvaluation") == seen.get(name):
                    continue
                seen[name] = g["lastEvaluation"]
                d = groups.setdefault(name, {"group_seconds": [], "fleet_rules_seconds": [],
                                             "rules_seconds": []})
                for r in g["rules"]:
                    per_rule.setdefault(name, {}).setdefault(r["name"], []).append(
                        float(r["evaluationTime"]))
                d["group_seconds"].append(float(g["evaluationTime"]))
                d["rules_seconds"].append(sum(float(r["evaluationTime"]) for r in g["rules"]))
                d["fleet_rules_seconds"].append(sum(float(r["evaluationTime"])
                                                    for r in g["rules"] if is_fleet_rule(r)))
            return bool(groups) and all(len(d["group_seconds"]) > evaluations
                                        for d in groups.values())

        wait_for(sample, f"{evaluations} evaluations of each group",
                 timeout=EVAL_INTERVAL * (evaluations + 5) + 30, interval=EVAL_INTERVAL / 4)
        wall = time.monotonic() - wall0
        prom_cpu = proc_cpu(proc.pid) - cpu0
        own_cpu = time.process_time() - own0
        text = metrics_text(url)
        last = metric_values(text, "prometheus_rule_group_last_duration_seconds")
        quantiles = metric_values(text, "prometheus_rule_evaluation_duration_seconds")
        missed = sum(metric_values(text, "prometheus_rule_group_iterations_missed_total")
                     .values())
        failures = sum(metric_values(text, "prometheus_rule_evaluation_failures_total").values())
        per_group = {}
        for name, d in groups.items():
            d = {k: v[1:] for k, v in d.items()}  # the first sample may predate the window
            per_group[name] = {k: summary(v) for k, v in d.items()}
        rules_median = {g: {r: median(v[1:]) for r, v in rs.items() if is_fleet_rule({"name": r})}
                        for g, rs in per_rule.items()}
        census = rule_census(url)
        series_fleet = scalar(url, 'count({__name__=~"gpunet_fleet_.+"})')
        recorded = scalar(url, 'count({__name__=~".+:.+"})')
        row: dict[str, Any] = {
            "mode": mode, "nodes": n, "pairs_per_node": per_node,
            "pair_series": sum(len(v.pairs) for v in fleet.views.values()),
            "slow": fleet.slow, "failed": fleet.failed, "stale": fleet.stale,
            "slow_link": list(fleet.slow_link),
            "build_seconds": build_s, "scraped_after_seconds": scraped_s,
            "body_bytes_total": sum(len(b) for b in paths.values()),
            "samples_per_scrape": summary([float(r["value"][1]) for r in prom.query(
                url, f"{prom_job('scrape_samples_scraped')}")]),
            "fleet_series": series_fleet, "fleet_series_per_node": series_fleet / n,
            "recorded_series": recorded,
            "head_series": sum(metric_values(text, "prometheus_tsdb_head_series").values()),
            "prometheus_rss_bytes": proc_status(proc.pid, "VmRSS"),
            "prometheus_hwm_bytes": proc_status(proc.pid, "VmHWM"),
            "window_seconds": wall, "prometheus_cpu_seconds": prom_cpu,
            "prometheus_cpu_share": prom_cpu / wall, "bench_cpu_share": own_cpu / wall,
            "groups": per_group,
            "fleet_rules_median_seconds": rules_median,
            "fleet_rules_query_stats": census,
            "prometheus_cpu_seconds_per_recording_evaluation":
                prom_cpu / max(1, len(groups.get(rules.FLEET_GROUP, {}).get("group_seconds",
                                                                            []))),
            "server_errors": _Server.errors,
            "group_last_duration_metric": last,
            "rule_evaluation_duration_quantiles": quantiles,
            "iterations_missed": missed, "evaluation_failures": failures,
            "firing": {k: sorted(map(list, v)) for k, v in fired.items()},
            "outliers_named": len(fired["GpunetFleetBandwidthOutlier"]),
            "sanity_problems": problems,
        }
        rec = per_group.get(rules.FLEET_GROUP, {})
        leaves = per_group.get(rules.LEAF_GROUP, {})
        log(f"  fleet group median {rec.get('group_seconds', {}).get('median', 0) * 1e3:.1f}"
            f" ms, leaves group median "
            f"{leaves.get('group_seconds', {}).get('median', 0) * 1e3:.1f} ms, head series "
            f"{row['head_series']:.0f}, RSS "
            f"{row['prometheus_rss_bytes'] / 2**20:.0f} MiB, sanity "
            f"{problems if problems else 'ok'}")
        return row
    finally:
        if proc is not None:
            prom.stop(proc)
        server.shutdown()
        server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)


def rule_census(url: str) -> dict[str, dict[str, float]]:
    """Each fleet rule's expression run once as an instant query with stats=all: its
    evaluation time and the samples it touched (which no other load on the machine changes)."""
    out = {}
    for g in prom.api(url, "rules")["groups"]:
        for r in g["rules"]:
            if not is_fleet_rule(r):
                continue
            reply = requests.get(f"{url}/api/v1/query",
                                 params={"query": r["query"], "stats": "all"}, timeout=60).json()
            stats = reply.get("data", {}).get("stats", {})
            out[r["name"]] = {
                "eval_seconds": float(stats.get("timings", {}).get("evalTotalTime", "nan")),
                "samples": float(stats.get("samples", {}).get("totalQueryableSamples", "nan")),
                "peak_samples": float(stats.get("samples", {}).get("peakSamples", "nan")),
                "result_series": float(len(reply.get("data", {}).get("result", []))),
            }
    return out


def prom_job(metric: str) -> str:
    return f'{metric}{{job="{JOB}"}}'


def proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fit(rows: Sequence[Mapping[str, Any]], group: str, key: str) -> dict[str, float] | None:
    """Least squares of the median ``key`` of ``group`` (seconds) on pair series."""
    pts = [(float(r["pair_series"]), r["groups"][group][key]["median"]) for r in rows
           if group in r["groups"]]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(x for x, _ in pts)
    my = statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    if sxx == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in pts) / sxx
    intercept = my - slope * mx
    resid = max(abs(y - (intercept + slope * x)) for x, y in pts)
    return {"intercept_seconds": intercept, "seconds_per_pair_series": slope,
            "max_residual_seconds": resid, "points": len(pts),
            "at_10000_nodes_2_pairs": intercept + slope * 20000,
            "at_10000_nodes_4_pairs": intercept + slope * 40000}


# --- the rendezvous store -------------------------------------------------------------------

STORE_SERVER = """
import sys, time, datetime
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=600))
print(store.port, store.libuvBackend, flush=True)
sys.stdin.read()
"""

STORE_CLIENT = """
import json, sys, time, datetime
import torch.distributed as dist
port, total, count = (int(x) for x in sys.argv[1:4])
t_import = time.time()
stores, took = [], []
for _ in range(count):
    t = time.perf_counter()
    stores.append(dist.TCPStore("127.0.0.1", port, is_master=False,
                                timeout=datetime.timedelta(seconds=600)))
    took.append(time.perf_counter() - t)
t_connected = time.time()
print("connected", flush=True)
sys.stdin.readline()  # every client process is connected: the barrier starts
t_go = time.time()
for s in stores:
    if s.add("arrived", 1) == total:
        s.set("all", "1")
for s in stores:
    s.wait(["all"])
print(json.dumps({"import": t_import, "connected": t_connected, "go": t_go,
                  "done": time.time(), "connect_seconds": took}), flush=True)
"""

# The c10d client looks up the name of every address it connects to (a reverse DNS query per
# connection, for its log lines); this machine's DNS server drops some queries, and each drop
# costs the resolver's 5 s timeout. timeout:0 makes a lookup fail at once instead.
STORE_ENV = {"RES_OPTIONS": "timeout:0 attempts:1"}


def store_run(clients: int, procs: int = 8) -> dict[str, Any]:
    """One TCPStore server process (torch's default, libuv) and ``clients`` clients from
    ``procs`` processes, each connecting its share one after the other (one process per node
    would connect them all at once; 2 cores cannot run 10,000 processes)."""
    py = sys.executable
    env = dict(os.environ, **STORE_ENV)
    server = subprocess.Popen([py, "-c", STORE_SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env)
    workers: list[subprocess.Popen[str]] = []
    try:
        assert server.stdout is not None
        port_text, libuv = server.stdout.readline().split()
        share = [clients // procs + (1 if k < clients % procs else 0) for k in range(procs)]
        t0 = time.time()
        workers = [subprocess.Popen([py, "-c", STORE_CLIENT, port_text, str(clients), str(c)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    env=env)
                   for c in share if c]
        for w in workers:
            assert w.stdout is not None
            line = w.stdout.readline()
            if line.strip() != "connected":
                raise RuntimeError(f"a store client process said {line!r}")
        server_rss = proc_status(server.pid, "VmRSS")
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        times = []
        for w in workers:
            out, _ = w.communicate(timeout=600)
            times.append(json.loads(out.strip().splitlines()[-1]))
        each = sorted(x for t in times for x in t["connect_seconds"])
        return {
            "clients": clients, "client_processes": len(workers),
            "libuv_server": libuv == "True", "resolver": STORE_ENV,
            "connect_seconds": max(t["connected"] for t in times)
            - min(t["import"] for t in times),
            "connect_each_median_seconds": median(each),
            "connect_each_p99_seconds": each[min(len(each) - 1, int(len(each) * 0.99))],
            "connects_over_half_a_second": sum(1 for x in each if x > 0.5),
            "barrier_seconds": max(t["done"] for t in times) - min(t["go"] for t in times),
            "wall_seconds": time.time() - t0,
            "server_rss_bytes_connected": server_rss,
        }
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if server.stdin:
            server.stdin.close()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def rendezvous_state_bytes(n: int) -> dict[str, int]:
    """The c10d dynamic rendezvous state of ``n`` one-process nodes, as the c10d backend
    stores it (pickled, then base64), once every node has joined and sent a heartbeat."""
    from datetime import datetime, timezone

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    state = dr._RendezvousState()
    now = datetime.now(timezone.utc)
    for i in range(n):
        node = dr._NodeDesc(f"node{i:05d}.cluster.example.com", 100000 + i, 0)
        state.participants[node] = i
        state.last_heartbeats[node] = now
    state.complete = True
    raw = pickle.dumps(state)
    return {"nodes": n, "pickled_bytes": len(raw), "stored_bytes": len(base64.b64encode(raw))}


# --- the report -----------------------------------------------------------------------------


def ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def markdown(report: Mapping[str, Any]) -> str:
    out = ["## Fleet probes at scale (bench/fleet_scale.py)", ""]
    m = report["machine"]
    out.append(f"{m['cpu_model']}, {m['nproc']} cores, {m['mem_total_gib']} GiB, kernel "
               f"{m['kernel']}, commit {m['git_commit']}, {report['date']}, "
               f"{report['prometheus_version']}")
    out += ["", "### Plans", "",
            "| nodes | kind | generate ms | rounds | pairs | pairs/node max | mean | "
            "pairs.json bytes (busiest) | series (busiest) |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["plans"]:
        out.append(f"| {r['nodes']} | {r['kind']} | {r['generate_seconds'] * 1e3:.2f} | "
                   f"{r['rounds']} | {r['pairs']} | {r['pairs_per_node_max']} | "
                   f"{r['pairs_per_node_mean']:.2f} | {r['pairs_json_bytes_busiest']} | "
                   f"{r['series_busiest']} |")
    if report["prometheus"]:
        out += ["", "### Rules in Prometheus", "",
                "| mode | nodes | pairs/node | samples/scrape | fleet series/node | head series | "
                f"{rules.FLEET_GROUP} group median / max ms | {rules.LEAF_GROUP} group median / "
                "max ms | alerts group median / max ms | health group median ms | RSS MiB | "
                "Prometheus CPU | CPU s per fleet group evaluation | sanity |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in report["prometheus"]:
            g = r["groups"]
            rec, lv = g.get(rules.FLEET_GROUP, {}), g.get(rules.LEAF_GROUP, {})
            al, he = g.get(rules.ALERTS_GROUP, {}), g.get(rules.HEALTH_GROUP, {})
            out.append(
                f"| {r['mode']} | {r['nodes']} | {r['pairs_per_node']} | "
                f"{r['samples_per_scrape']['median']:.0f} | {r['fleet_series_per_node']:.2f} | "
                f"{r['head_series']:.0f} | {ms(rec['group_seconds']['median'])} / "
                f"{ms(rec['group_seconds']['max'])} | "
                f"{ms(lv['group_seconds']['median'])} / {ms(lv['group_seconds']['max'])} | "
                f"{ms(al['group_seconds']['median'])} / {ms(al['group_seconds']['max'])} | "
                f"{ms(he['group_seconds']['median'])} | "
                f"{r['prometheus_rss_bytes'] / 2**20:.0f} | "
                f"{r['prometheus_cpu_share'] * 100:.0f}% | "
                f"{r['prometheus_cpu_seconds_per_recording_evaluation']:.2f} | "
                f"{'ok' if not r['sanity_problems'] else 'FAILED'} |")
        big = max(report["prometheus"], key=lambda r: r["pair_series"])
        out += ["", f"Fleet rules at {big['nodes']} nodes x {big['pairs_per_node']} pairs "
                f"({big['mode']}): median evaluation in the rule group, and the expression run "
                "once as a query with stats=all", "",
                "| rule | in group, median ms | as a query, ms | samples touched | "
                "peak samples | result series |", "|---|---:|---:|---:|---:|---:|"]
        medians = {k: v for g in big["fleet_rules_median_seconds"].values()
                   for k, v in g.items()}
        for name, st in big["fleet_rules_query_stats"].items():
            out.append(f"| `{name}` | {ms(medians.get(name, float('nan')))} | "
                       f"{ms(st['eval_seconds'])} | {st['samples']:.0f} | "
                       f"{st['peak_samples']:.0f} | {st['result_series']:.0f} |")
        for key, f in report["fit"].items():
            if f:
                out.append("")
                out.append(f"Fit {key}: {f['intercept_seconds'] * 1e3:.2f} ms + "
                           f"{f['seconds_per_pair_series'] * 1e6:.2f} us per pair series "
                           f"(max residual {ms(f['max_residual_seconds'])} ms, "
                           f"{f['points']} points); 10,000 nodes: "
                           f"{ms(f['at_10000_nodes_2_pairs'])} ms (2 pairs/node), "
                           f"{ms(f['at_10000_nodes_4_pairs'])} ms (4 pairs/node)")
    if report["store"]:
        out += ["", "### Rendezvous store", "",
                "| clients | libuv | connect all s | one connect, median ms | p99 ms | "
                "add+wait barrier s | server RSS MiB |",
                "|---:|---|---:|---:|---:|---:|---:|"]
        for r in report["store"]:
            out.append(f"| {r['clients']} | {r['libuv_server']} | {r['connect_seconds']:.2f} | "
                       f"{ms(r['connect_each_median_seconds'])} | "
                       f"{ms(r['connect_each_p99_seconds'])} | {r['barrier_seconds']:.2f} | "
                       f"{r['server_rss_bytes_connected'] / 2**20:.0f} |")
    if report["rendezvous_state"]:
        out += ["", "| nodes | c10d rendezvous state, stored bytes |", "|---:|---:|"]
        for r in report["rendezvous_state"]:
            out.append(f"| {r['nodes']} | {r['stored_bytes']} |")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan-sizes", type=csv_ints, default=[100, 1000, 10000])
    ap.add_argument("--nodes", type=csv_ints, default=[500, 1000, 2000],
                    help="fleet sizes served as one target per node")
    ap.add_argument("--single", type=csv_ints, default=[2000, 10000],
                    help="fleet sizes served from one target with honor_labels")
    ap.add_argument("--pairs", type=csv_ints, default=[2, 4], help="pairs per node (2, 4)")
    ap.add_argument("--evaluations", type=int, default=10)
    ap.add_argument("--store-clients", type=csv_ints, default=[100, 1000, 10000])
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/fleet_scale.json")
    args = ap.parse_args(argv)
    if shutil.which("prometheus") is None and (args.nodes or args.single):
        print("fleet_scale: prometheus is not on PATH (Debian package prometheus)",
              file=sys.stderr)
        return 2
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": machine(),
        "prometheus_version": subprocess.run(["prometheus", "--version"], capture_output=True,
                                             text=True, check=False).stdout.splitlines()[0]
        if shutil.which("prometheus") else "none",
        "settings": {"scrape_interval_seconds": SCRAPE_INTERVAL,
                     "evaluation_interval_seconds": EVAL_INTERVAL, "leaf_size": LEAF_SIZE,
                     "evaluations": args.evaluations},
    }
    report["plans"] = plan_run(args.plan_sizes)
    runs = []
    for single, sizes in ((False, args.nodes), (True, args.single)):
        for n in sizes:
            for k in args.pairs:
                runs.append(prometheus_run(n, k, single, args.evaluations))
    report["prometheus"] = runs
    report["fit"] = {}
    for k in args.pairs:
        pts = [r for r in runs if r["mode"] == "targets" and r["pairs_per_node"] == k]
        report["fit"][f"fleet group, targets, {k} pairs/node"] = fit(
            pts, rules.FLEET_GROUP, "group_seconds")
    pts = [r for r in runs if r["mode"] == "targets"]
    report["fit"]["fleet group, targets, all points"] = fit(
        pts, rules.FLEET_GROUP, "group_seconds")
    report["fit"]["alerts group, targets, all points"] = fit(pts, rules.ALERTS_GROUP,
                                                             "group_seconds")
    report["store"], report["rendezvous_state"] = [], []
    try:
        import torch  # noqa: F401
    except ImportError:
        log("store: torch is not installed (pip install '.[probe]'): skipped")
    else:
        for c in args.store_clients:
            log(f"store: {c} clients")
            report["store"].append(store_run(c))
        report["rendezvous_state"] = [rendezvous_state_bytes(n) for n in args.plan_sizes]
    report["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
    emit(markdown(report), report, args.out)
    bad = [r for r in runs if r["sanity_problems"]]
    for r in bad:
        log(f"SANITY FAILED {r['mode']} n={r['nodes']} k={r['pairs_per_node']}: "
            f"{r['sanity_problems']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
