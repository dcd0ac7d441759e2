"""Path-aware localization at scale (issue 35): what the fabric collector's pairs step costs
for a fabric of 10,000 hosts, beside the sweep it follows.

    python bench/localize_scale.py [--leaves 250] [--spines 16] [--hosts-per-leaf 40]
                                   [--plans 2] [--repeats 3] [--trace-memory] [--out FILE.json]

No simulator and no tool: ibsim's fabrics stop well short of 10,000 hosts on these cores
(bench/fabric_refresh.py measures real sweeps up to 2,048). The fabric is built in memory as the
sweep's parsers return it, a two-level fat tree: leaves with hosts on ports 1..H and one cable
to each spine after them, spine port i to leaf i, and destination routing as opensm's fat-tree
engine lays it out (a host's LID goes down through spine (host index mod spines), every leaf
sending it up to that spine). The pairs are ``--plans`` random perfect matchings of every host
(gpunet_exporter.probe.plan, as `gpunet-probe fleet --kind random` pairs them), each pair's
health planted: every pair whose path crosses one spine's cable to one leaf is slow, and so is
every pair of 5 slow nodes. Measured, median of --repeats: the dump_fts text parsed into the
tables (parse_forwarding, on text printed as dump_fts prints it), the paths (routes), the
verdict (localize), this process's peak RSS (the fabric's own generation sets it), and with
--trace-memory the memory parse_forwarding allocates beyond the text while it parses and what it
keeps (tracemalloc: one more parse, about 7 times slower); checked: the verdict names that one
cable alone and blames the 5 nodes, not a spine. No open tool localizes from forwarding tables
(docs/fabric.md), so there is no peer to run beside it; the alternative design, each pair's hops
as series for PromQL to join, is counted instead. Wall-clock numbers are for docs/benchmarks.md,
never for test assertions.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from gpunet_exporter import localize
from gpunet_exporter.probe import plan
from gpunet_exporter.sources import ibdiag


def guid(n: int) -> str:
    return f"0x{n:016x}"


def fabric(leaves: int, spines: int, hosts: int) -> tuple[list[ibdiag.Link], str, list[str]]:
    """iblinkinfo's links, dump_fts's text and the spines' GUIDs of the fat tree."""
    host_lid = {(j, k): j * hosts + k + 1 for j in range(leaves) for k in range(hosts)}
    leaf_g = [guid(0x200000 + j) for j in range(leaves)]
    spine_g = [guid(0x300000 + s) for s in range(spines)]
    first_switch_lid = leaves * hosts + 1
    links: list[ibdiag.Link] = []
    for j in range(leaves):
        for k in range(hosts):
            links.append(ibdiag.Link(leaf_g[j], f"L{j}", k + 1, 4, 5, 4, 100.0,
                                     guid(0x100000 + host_lid[(j, k)]), 1, f"n{j}-{k} mlx5_0",
                                     host_lid[(j, k)]))
        for s in range(spines):
            links.append(ibdiag.Link(leaf_g[j], f"L{j}", hosts + 1 + s, 4, 5, 4, 100.0,
                                     spine_g[s], j + 1, f"S{s}",
                                     first_switch_lid + leaves + s))
    for s in range(spines):
        for j in range(leaves):
            links.append(ibdiag.Link(spine_g[s], f"S{s}", j + 1, 4, 5, 4, 100.0, leaf_g[j],
                                     hosts + 1 + s, f"L{j}", first_switch_lid + j))
    out = []
    dest = {lid: f"(Channel Adapter portguid {guid(0x100000 + lid)}: 'n{j}-{k} mlx5_0')"
            for (j, k), lid in host_lid.items()}
    names = [f"L{j}" for j in range(leaves)] + [f"S{s}" for s in range(spines)]
    for sw_index, (g, name) in enumerate(zip([*leaf_g, *spine_g], names, strict=True)):
        out.append(f"Unicast lids [0x0-0x{len(host_lid):x}] of switch DR path slid 0; dlid 0; "
                   f"0,1 guid {g} ({name}):")
        out.append("  Lid  Out   Destination")
        out.append("       Port     Info ")
        for (j, k), lid in host_lid.items():
            if sw_index < leaves:
                port = k + 1 if sw_index == j else hosts + 1 + (k % spines)
            else:
                port = j + 1
            out.append(f"0x{lid:04x} {port:03d} : {dest[lid]}")
        out.append(f"{len(host_lid)} valid lids dumped ")
    return links, "\n".join(out) + "\n", spine_g


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leaves", type=int, default=250)
    ap.add_argument("--spines", type=int, default=16)
    ap.add_argument("--hosts-per-leaf", type=int, default=40)
    ap.add_argument("--plans", type=int, default=2, help="random matchings (pairs per node)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--trace-memory", action="store_true",
                    help="one more parse under tracemalloc: its peak and kept memory")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    links, text, spines = fabric(args.leaves, args.spines, args.hosts_per_leaf)
    nodes = sorted({lk.remote_name.split()[0] for lk in links if "mlx5" in lk.remote_name})
    pairs_: set[tuple[str, str]] = set()
    for seed in range(args.plans):
        for rnd in plan.random_pairs(nodes, seed):
            pairs_ |= {(min(a, b), max(a, b)) for a, b in rnd}
    times: dict[str, list[float]] = {"parse": [], "routes": [], "localize": []}
    found = None
    bad = localize.Cable(spines[0], 8)  # spine S0's cable to leaf L7
    slow_nodes = random.Random(1).sample(nodes, 5)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        fwd = ibdiag.parse_forwarding(text)
        t1 = time.perf_counter()
        r = localize.routes(links, fwd, spines, r"^(\S+)")
        t2 = time.perf_counter()
        health = {p: True for p in pairs_}
        hops = 0
        for p in pairs_:
            cables = r.pair(*p) or set()
            hops += len(cables)
            if bad in cables or p[0] in slow_nodes or p[1] in slow_nodes:
                health[p] = False
        t3 = time.perf_counter()
        found = localize.localize(r, health)
        t4 = time.perf_counter()
        times["parse"].append(t1 - t0)
        times["routes"].append(t2 - t1)
        times["localize"].append(t4 - t3)  # the planting walk above is the test's, not timed
    assert found is not None
    named = {c: v for c, v in found.verdicts.items()
             if v in (localize.SUSPECT, localize.AMBIGUOUS)}
    ok = named == {bad: localize.SUSPECT} and found.nodes_blamed == sorted(slow_nodes)
    out: dict[str, Any] = {
        "hosts": len(nodes), "switches": args.leaves + len(spines), "pairs": len(pairs_),
        "dump_fts_bytes": len(text), "unhealthy": found.pairs["unhealthy"],
        "cables": len(r.cables), "cable_crossings": hops,
        "seconds": {k: round(median(v), 3) for k, v in times.items()},
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "named": {f"{c.switch}:{c.port}": v for c, v in named.items()},
        "nodes_blamed": found.nodes_blamed, "correct": ok,
        "hop_series_instead": 2 * hops,  # each pair seen from both ends, one series per cable
    }
    if args.trace_memory:
        import tracemalloc
        tracemalloc.start()
        held = ibdiag.parse_forwarding(text)
        kept, peak = tracemalloc.get_traced_memory()
        del held
        tracemalloc.stop()
        out["parse_peak_mib"] = round(peak / 2**20, 1)
        out["parse_kept_mib"] = round(kept / 2**20, 1)
    print(json.dumps(out, indent=1))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
