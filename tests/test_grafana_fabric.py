"""The fabric dashboard (grafana/gpunet-fabric.json) on real parts: a simulated InfiniBand
fabric (ibsim + opensm, tests/support/ibsim.py), the installed exporter with only the fabric
collector sweeping it every second, and one Prometheus scraping that exporter.

The fabric: leaves L1 and L2, spines S1 and S2, two hosts per leaf, one cable per leaf and
spine, and these faults, each one code of the health matrix:
- the L2-S1 cable trains at 4X instead of 12X (degraded, both ends: 1);
- L2's port to S2 has its symbol error, link error recovery, receive error and transmit discard
  counters rising (errors: 2);
- the L1-S1 cable is unplugged once the exporter has seen it up (a fabric link down, both
  ends: 3);
- L1's second host is unplugged the same way (a host down: 4);
- S2's port to L1 has its PortXmitWait rising (congestion, which is no error: 0);
- the spines' ports 3 and 4 never had a cable (absent from the matrix).
Every query of the dashboard returns data, and the matrix, the tables and the stats name
exactly these faults."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from gpunet_exporter.mixin import dashboards as gen

from support import ibsim
from support.exporter import Exporter
from support.prometheus import query, start_prometheus, stop
from support.wait import wait_for

NARROW = (("L2", "S1"),)
TREE = ibsim.fat_tree(2, 2, 2, narrow=NARROW)
ERRORS_AT = ("L2", TREE.uplinks[("L2", "S2")][0][0])
ERROR_FIELDS = ("SymbolErrorCounter", "LinkErrorRecoveryCounter", "PortRcvErrors",
                "PortXmitDiscards")
WAIT_AT = ("S2", TREE.uplinks[("L1", "S2")][0][1])
UNPLUGGED = ("L1", "S1")  # the cable unplugged
HOST_DOWN = ("L1", 2)  # L1's port to its second host
JOB = "gpunet"
NODE = "fabric-host"
VARIABLES = {"instance": NODE, "job": JOB, "leaf": "L2", "__rate_interval": "30s",
             "__interval": "1s", "__range": "5m", "datasource": "prometheus"}

DASH = gen.dashboards()["gpunet-fabric.json"]
# Needs the fleet's pair results (fabric.prometheus_url): tests/test_fabric_paths.py runs it.
PATHS_PANEL = "Cables the slow fleet pairs share"
PANELS = {p["title"]: p for p in gen.iter_panels(DASH)}


def expected_health() -> dict[tuple[str, str], int]:
    """(switch name, port) -> the matrix's code, from the tree and the faults above."""
    want: dict[tuple[str, str], int] = {}
    for leaf in TREE.leaves:
        for port in range(1, len(TREE.hosts[leaf]) + 1):
            want[(leaf, str(port))] = 4 if (leaf, port) == HOST_DOWN else 0
    for (leaf, spine), cables in TREE.uplinks.items():
        for lp, sp in cables:
            code = 3 if (leaf, spine) == UNPLUGGED else 1 if (leaf, spine) in NARROW else 0
            want[(leaf, str(lp))] = want[(spine, str(sp))] = code
    if want[(ERRORS_AT[0], str(ERRORS_AT[1]))] == 0:
        want[(ERRORS_AT[0], str(ERRORS_AT[1]))] = 2
    return want


@dataclass
class Stack:
    prometheus: str
    sim: ibsim.Sim


def _bump(sim: ibsim.Sim, stop_event: threading.Event) -> None:
    """Keep the chosen error counters and the XmtWait counter rising, as a bad cable and a
    congested port do."""
    value = 0
    while not stop_event.wait(0.5):
        value += 3
        for field in ERROR_FIELDS:
            sim.command(f'PerformanceSet "{ERRORS_AT[0]}"[{ERRORS_AT[1]}] '
                        f"PortCounters.{field}={value}")
        sim.command(f'PerformanceSet "{WAIT_AT[0]}"[{WAIT_AT[1]}] '
                    f"PortCounters.PortXmitWait={value * 1000}")


def prom(url: str, expr: str) -> list[dict[str, Any]]:
    return query(url, gen.substitute(expr, VARIABLES))


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60) -> Any:
    return wait_for(check, what, timeout=timeout, interval=0.5,
                    ignore=(requests.RequestException,))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    ibsim.require()
    tmp: Path = tmp_path_factory.mktemp("fabric-dashboard")
    sim = ibsim.Sim(tmp / "sim", TREE.netfile)
    stop_event = threading.Event()
    bumper = threading.Thread(target=_bump, args=(sim, stop_event), daemon=True)
    exporter = proc = None
    try:
        sim.start()
        (tmp / "exporter.yml").write_text(yaml.safe_dump({"fabric": {
            "interval_seconds": 1, "balance_min_bytes_per_second": 0,
            "environment": [f"LD_PRELOAD={ibsim.UMAD2SIM}",
                            f"IBSIM_SOCKNAME={sim.sockname}"]}}))
        exporter = Exporter(["--collector.disable-defaults", "--collector.fabric",
                             f"--config.file={tmp / 'exporter.yml'}", "--no-hotplug"],
                            env={"PATH": sim.env()["PATH"]}, cwd=tmp)
        proc, url = start_prometheus(
            tmp, [{"targets": [f"127.0.0.1:{exporter.port}"], "labels": {"instance": NODE}}])
        # Every cable up and its neighbour known before the faults, so that the unplugged
        # ports keep their last neighbour.
        cabled = len(expected_health())
        wait_until("Prometheus holding a sweep with every cabled port ACTIVE", lambda: len(
            query(url, f'gpunet_fabric_port_state_id{{job="{JOB}"}} == 4')) == cabled)
        leaf, spine = UNPLUGGED
        sim.command(f'Unlink "{leaf}"[{TREE.uplinks[(leaf, spine)][0][0]}]')
        sim.command(f'Unlink "{HOST_DOWN[0]}"[{HOST_DOWN[1]}]')
        bumper.start()
        wait_until("the unplugged ports down in Prometheus", lambda: len(
            query(url, f'gpunet_fabric_port_state_id{{job="{JOB}"}} != 4 and on (switch, '
                       'port) gpunet_fabric_port_info{remote!=""}')) == 3)
        yield Stack(url, sim)
    finally:
        stop_event.set()
        if bumper.is_alive():
            bumper.join(timeout=5)
        if proc is not None:
            stop(proc)
        if exporter is not None:
            exporter.stop()
        sim.stop()


def run(stack: Stack, title: str, ref: str = "A") -> list[dict[str, Any]]:
    (t,) = [t for t in PANELS[title]["targets"] if t["refId"] == ref]
    return prom(stack.prometheus, t["expr"])


def values(rows: list[dict[str, Any]], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(r["metric"].get(k, "") for k in labels): float(r["value"][1]) for r in rows}


def matrix_settled(stack: Stack) -> None:
    """Until the matrix's query gives every cabled port its code, and no port never cabled
    one."""
    want = {k: float(v) for k, v in expected_health().items()}

    def read() -> dict[tuple[str, ...], float] | None:
        got = values(run(stack, "Switch port health, switch x port"), "name", "port")
        return got if got == want else None

    try:
        wait_until("the matrix to show the faults", read)
    except AssertionError:
        got = values(run(stack, "Switch port health, switch x port"), "name", "port")
        raise AssertionError(f"matrix {sorted(got.items())} != {sorted(want.items())}") \
            from None


def test_health_matrix_codes_each_fault(stack: Stack) -> None:
    matrix_settled(stack)


def test_every_fabric_panel_query_returns_data(stack: Stack) -> None:
    """Every query of the fabric dashboard, for the sweeping node and leaf L2, returns at least
    one series (the uplink imbalance once two sweeps have measured L2's uplinks)."""
    queries = [(title, expr) for title, expr in gen.queries(DASH) if title != PATHS_PANEL]
    assert len(queries) >= 15

    def empty() -> list[str]:
        return [f"{title}: {expr}" for title, expr in queries
                if not prom(stack.prometheus, expr)]

    missing: list[str] = []

    def none_empty() -> bool:
        missing[:] = empty()
        return not missing

    try:
        wait_until("every query to return data", none_empty)
    except AssertionError:
        raise AssertionError("queries without data:\n" + "\n".join(missing)) from None
    names = [v["name"] for v in DASH["templating"]["list"]]
    assert names == ["datasource", "job", "instance", "leaf"]
    for name, q in gen.variable_queries(DASH):
        m = q.removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
        got = {r["metric"][m[1]] for r in prom(stack.prometheus, m[0])}
        want = {"job": {JOB}, "instance": {NODE}, "leaf": set(TREE.leaves)}[name]
        assert got == want, name


def test_tables_and_stats_name_the_faults(stack: Stack) -> None:
    matrix_settled(stack)
    lane = 50e9  # HDR, bits per second per lane
    degraded = {}
    for leaf, spine in NARROW:
        ((lp, sp),) = TREE.uplinks[(leaf, spine)]
        degraded[(leaf, str(lp), spine)] = degraded[(spine, str(sp), leaf)] = None
    rate = values(run(stack, "Degraded links", "A"), "name", "port", "remote_name")
    supported = values(run(stack, "Degraded links", "B"), "name", "port", "remote_name")
    assert rate == dict.fromkeys(degraded, 4 * lane)
    assert supported == dict.fromkeys(degraded, 12 * lane)

    leaf, spine = UNPLUGGED
    ((lp, sp),) = TREE.uplinks[(leaf, spine)]
    host = TREE.hosts[HOST_DOWN[0]][HOST_DOWN[1] - 1]
    down = values(run(stack, "Ports down with a neighbour"), "name", "port", "remote_name")
    assert set(down) == {(leaf, str(lp), spine), (spine, str(sp), leaf),
                         (HOST_DOWN[0], str(HOST_DOWN[1]), host)}
    assert all(v != 5 for v in down.values())  # physical state: not LinkUp

    def stat(title: str) -> float:
        (row,) = run(stack, title)
        return float(row["value"][1])

    health = expected_health()
    assert stat("Switches") == len(TREE.leaves) + len(TREE.spines)
    assert stat("Ports ACTIVE") == sum(1 for code in health.values() if code in (0, 1, 2))
    assert stat("Links degraded") == len(NARROW)
    # L2's port, and the unplugged ports while their LinkDowned step is in the window
    assert 1 <= stat("Ports with errors rising") <= 1 + sum(1 for c in health.values() if c > 2)
    assert stat("Sweep success") == 1
    assert 0 <= stat("Sweep age") < 30

    errors = [values(run(stack, "Port error rates (top 10 per counter)", ref), "name", "port")
              for ref in "ABCD"]
    for per_counter in errors:  # symbol errors, recoveries, receive errors, discards
        assert (ERRORS_AT[0], str(ERRORS_AT[1])) in per_counter
        assert all(v > 0 for v in per_counter.values())
    wait = values(run(stack, "XmtWait (top 10)"), "name", "port")
    assert set(wait) == {(WAIT_AT[0], str(WAIT_AT[1]))}


def test_uplink_and_routing_panels_show_the_selected_leaf(stack: Stack) -> None:
    """The per-uplink panels show L2's two uplinks by their spine; the routing flag of L2
    agrees with the host LIDs its uplinks route (check_lft_balance's test)."""
    matrix_settled(stack)
    uplinks = {(str(lp), spine) for (leaf, spine), cables in TREE.uplinks.items()
               if leaf == "L2" for lp, _ in cables}
    for ref in "AB":
        got = values(run(stack, "Uplink traffic of leaf $leaf", ref), "port", "remote_name")
        assert set(got) == uplinks, ref
    routed = values(run(stack, "Host LIDs routed per uplink of leaf $leaf"), "port",
                    "remote_name")
    assert set(routed) <= uplinks and routed
    counts = [routed.get(key, 0.0) for key in uplinks]
    flags = values(run(stack, "Routing unbalanced per leaf"), "name")
    assert flags[("L2",)] == float(max(counts) > min(counts) + 1)
    imbalance = values(run(stack, "Uplink traffic imbalance per leaf"), "name", "direction")
    assert {name for name, _ in imbalance} == {"L2"}  # L1 has one uplink left
    assert all(v >= 0 for v in imbalance.values())
