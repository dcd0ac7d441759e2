"""Localizing bad nodes with adaptive plans (issue 35): a simulated fleet, the real planner.

    python bench/localize_sim.py [--nodes 232,1000,10000] [--bad 0,1,5] [--seeds 20]
                                 [--per-leaf 32] [--uplinks 32] [--out FILE.json]

Pure simulation, no torch, no network: the planner is gpunet_exporter.probe.adaptive, the one
`gpunet-probe fleet --kind adaptive` runs; only the pairs' outcomes are simulated. The fleet:
N nodes on leaves of --per-leaf nodes (node i on leaf i // per-leaf), a two-level fat tree
whose leaves have --uplinks uplinks each; d bad nodes (every pair with one fails); with
"+ link", one bad uplink: uplink u of leaf L, picked by the seed. A cross-leaf pair a-b is
routed by destination, as a fat tree's tables do: a's traffic leaves a's leaf on uplink
crc32(b) mod uplinks and comes down to b's leaf from that spine on b's leaf's uplink of the same
number, and b's the other way; a pair whose traffic crosses the bad cable in either direction
(one end on L and either end's route u) is slow (0.3 of the fleet's
bandwidth), measured as a bandwidth and judged slow by adaptive.with_slow against the pass's
median, as the fleet does. Healthy pairs measure 1.0 +- 5%.

Per scenario and seed: rounds, pair tests, and the verdict against the truth (every bad node
found? a healthy node named bad? the bad uplink's leaf named?). Wall time = rounds x (a pair's
time + a round's coordination): a pair 1.8 s over sockets (bench/pair_setup.py) or 0.72 s
(the RDMA estimate), coordination one barrier across N (docs/benchmarks.md, "Time per plan":
0.02 / 0.06 / 0.34 s at 100 / 1,000 / 10,000 nodes, the next size up taken). Printed as a
markdown table beside NVIDIA's published figure and exhaustive pairwise testing.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from gpunet_exporter.probe import adaptive

PAIR_SOCKETS = 1.8  # s, one pair over sockets, bench/pair_setup.py
PAIR_RDMA = 0.72  # s, the RDMA estimate, docs/benchmarks.md "Time per plan"
BARRIER = ((100, 0.02), (1000, 0.06), (10000, 0.34))  # nodes, s (docs/benchmarks.md)
SLOW_LINK = 0.3
# NVIDIA's published figure (issue 35): 232 nodes, 5 bad.
NVIDIA = {"nodes": 232, "bad": 5, "tests": 55, "rounds": 7, "minutes": 28,
          "healthy_minutes": 12}


def barrier(n: int) -> float:
    return next((s for size, s in BARRIER if n <= size), BARRIER[-1][1])


@dataclass
class Run:
    nodes: int
    bad: int
    link: bool
    seed: int
    rounds: int
    pairs: int
    found_all: bool
    healthy_blamed: int
    link_named: str  # "leaf", "leaf pair", "missed", "not seen" (no pair crossed it), ""
    unresolved: int
    plan_seconds: float  # the planner's own CPU time, all rounds


def simulate(n: int, d: int, link: bool, seed: int, per_leaf: int, uplinks: int,
             max_rounds: int) -> Run:
    rng = random.Random(seed)
    nodes = [f"n{i}" for i in range(n)]
    leaf = {x: f"leaf{i // per_leaf}" for i, x in enumerate(nodes)}
    route = {x: zlib.crc32(x.encode()) % uplinks for x in nodes}
    bad = set(rng.sample(nodes, d))
    leaves = sorted(set(leaf.values()))
    bad_leaf = rng.choice(leaves) if link and len(leaves) > 1 else None
    bad_uplink = rng.randrange(uplinks)

    def crosses(a: str, b: str) -> bool:
        if bad_leaf is None or leaf[a] == leaf[b]:
            return False
        # up the cable: traffic from L to the other end goes by that end's route; down it:
        # traffic to L's end comes from the spine of that end's route
        return bad_leaf in (leaf[a], leaf[b]) and bad_uplink in (route[a], route[b])

    measured: list[dict[adaptive.Pair, tuple[str, float | None]]] = []
    state = adaptive.start(nodes, leaf, max_rounds=max_rounds, seed=seed)
    seen_link = False
    took = 0.0
    while True:
        t0 = time.perf_counter()
        rnd = adaptive.next_round(state)
        took += time.perf_counter() - t0
        if rnd is None:
            break
        got: dict[adaptive.Pair, tuple[str, float | None]] = {}
        for a, b in rnd:
            if a in bad or b in bad:
                got[(a, b)] = (adaptive.FAILED, None)
            elif crosses(a, b):
                seen_link = True
                got[(a, b)] = (adaptive.OK, SLOW_LINK * rng.uniform(0.95, 1.05))
            else:
                got[(a, b)] = (adaptive.OK, rng.uniform(0.95, 1.05))
        measured.append(got)
        t0 = time.perf_counter()
        outcomes = adaptive.with_slow(measured)
        state = adaptive.start(nodes, leaf, max_rounds=max_rounds, seed=seed)
        for o in outcomes:
            state = adaptive.record(state, o)
        took += time.perf_counter() - t0
    v = adaptive.verdict(state)
    named = ""
    if bad_leaf is not None:
        if (bad_leaf,) in v.suspect_leaves:
            named = "leaf"
        elif any(bad_leaf in x for x in v.suspect_leaves):
            named = "leaf pair"
        else:
            named = "missed" if seen_link else "not seen"
    return Run(n, d, link, seed, v.rounds, v.pairs, bad <= set(v.bad_nodes),
               len(set(v.bad_nodes) - bad), named, len(v.unresolved), took)


def _mw(values: Sequence[float], fmt: str = "{:g}") -> str:
    return f"{fmt.format(statistics.median(values))} / {fmt.format(max(values))}"


def table(runs: Sequence[Run]) -> str:
    rows = ["| nodes | bad nodes | bad uplink | rounds (median / worst) | pair tests "
            "(median / worst) | wall, sockets 1.8 s a pair | wall, RDMA 0.72 s a pair "
            "| all bad found | healthy named bad | uplink's leaf named |",
            "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    keys = sorted({(r.nodes, r.bad, r.link) for r in runs})
    for n, d, link in keys:
        rs = [r for r in runs if (r.nodes, r.bad, r.link) == (n, d, link)]
        per = barrier(n)
        sock = [r.rounds * (PAIR_SOCKETS + per) for r in rs]
        rdma = [r.rounds * (PAIR_RDMA + per) for r in rs]
        named = "" if not link else ", ".join(
            f"{k} {sum(r.link_named == k for r in rs)}" for k in
            ("leaf", "leaf pair", "missed", "not seen") if any(r.link_named == k for r in rs))
        rows.append(f"| {n:,} | {d} | {'yes' if link else 'no'} | {_mw([r.rounds for r in rs])}"
                    f" | {_mw([r.pairs for r in rs], '{:,.0f}')} | {_mw(sock, '{:.1f} s')} | "
                    f"{_mw(rdma, '{:.1f} s')} | {sum(r.found_all for r in rs)}/{len(rs)} | "
                    f"{sum(r.healthy_blamed for r in rs)} | {named or 'n/a'} |")
    return "\n".join(rows)


def comparison(runs: Sequence[Run]) -> str:
    n = NVIDIA["nodes"]
    rows = ["| method (232 nodes) | rounds | tests | wall time, 5 bad | wall time, healthy |",
            "| --- | ---: | ---: | ---: | ---: |",
            f"| NVIDIA, adaptive group testing (published) | {NVIDIA['rounds']} | "
            f"~{NVIDIA['tests']} | ~{NVIDIA['minutes']} min | ~{NVIDIA['healthy_minutes']} min |"]
    bad5 = [r for r in runs if (r.nodes, r.bad, r.link) == (n, 5, False)]
    ok = [r for r in runs if (r.nodes, r.bad, r.link) == (n, 0, False)]
    per = barrier(n)
    if bad5 and ok:
        for name, pair in (("sockets", PAIR_SOCKETS), ("RDMA estimate", PAIR_RDMA)):
            rows.append(
                f"| gpunet adaptive pair plan, {name} (simulated; median / worst) | "
                f"{_mw([r.rounds for r in bad5])} | {_mw([r.pairs for r in bad5])} pair tests |"
                f" {_mw([r.rounds * (pair + per) for r in bad5], '{:.1f} s')} | "
                f"{_mw([r.rounds * (pair + per) for r in ok], '{:.1f} s')} |")
    exhaustive = n * (n - 1) // 2
    rows.append(f"| exhaustive pairwise (every pair once, {n - 1} rounds of {n // 2}) | {n - 1} "
                f"| {exhaustive:,} pair tests | {(n - 1) * (PAIR_SOCKETS + per) / 60:.1f} min "
                f"(sockets) | same |")
    return "\n".join(rows)


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="232,1000,10000")
    p.add_argument("--bad", default="0,1,5")
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--per-leaf", type=int, default=32)
    p.add_argument("--uplinks", type=int, default=32)
    p.add_argument("--max-rounds", type=int, default=adaptive.MAX_ROUNDS)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        sizes = [int(x) for x in a.nodes.split(",") if x]
        bads = [int(x) for x in a.bad.split(",") if x]
        if a.seeds < 1 or a.per_leaf < 1 or a.uplinks < 1 or min(sizes) < 2 or min(bads) < 0:
            raise ValueError("sizes from 2, seeds, --per-leaf and --uplinks from 1")
    except ValueError as exc:
        print(f"localize_sim: {exc}", file=sys.stderr)
        return 2
    runs = []
    for n in sizes:
        for d in bads:
            for link in (False, True):
                for seed in range(a.seeds):
                    runs.append(simulate(n, d, link, seed, a.per_leaf, a.uplinks,
                                         a.max_rounds))
    print(table(runs))
    print()
    print(comparison(runs))
    slowest = max(runs, key=lambda r: r.plan_seconds)
    print(f"\nplanner CPU time, slowest pass: {slowest.plan_seconds:.2f} s "
          f"({slowest.nodes:,} nodes, {slowest.rounds} rounds)")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as fh:
            json.dump([asdict(r) for r in runs], fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
