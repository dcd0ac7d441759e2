"""The fabric alerts end to end: two simulated fabrics (ibsim + opensm), a real exporter with the
fabric collector on each, and a real Prometheus with the generated rules (every ``for:`` at 0s,
tests/support/prometheus.py). The healthy fabric stays silent; a fabric whose netfile narrows
one cable fires GpunetFabricLinkDegraded at both ends of that cable and, its leaf now 3:1,
GpunetFabricLeafOversubscribed, and nothing else; then, on the healthy one, symbol errors on a
port, an unplugged leaf-spine cable (and the routing opensm makes around it) and traffic on one
path fire their alerts, naming the switch and port."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from support import ibsim
from support.exporter import Exporter
from support.prometheus import api, query, start_prometheus, stop
from support.wait import wait_for

pytestmark = pytest.mark.slow

L1, L2 = "0x0000000000200000", "0x0000000000200001"
S1, S2 = "0x0000000000200002", "0x0000000000200003"


def exporter_for(sim: ibsim.Sim, tmp: Path, name: str) -> Exporter:
    # The floor: above the few kB/s of the sweep's own management packets (never even), below
    # the MB/s of the ibping flood.
    cfg = tmp / f"{name}.yml"
    cfg.write_text(
        "collectors: {infiniband: false, link: false, pfc: false, gpu: false, "
        "topology: false, probe: false, fabric: true}\n"
        "fabric:\n  interval_seconds: 1\n  balance_min_bytes_per_second: 100000\n"
        f"  environment: [\"LD_PRELOAD={ibsim.UMAD2SIM}\", "
        f"\"IBSIM_SOCKNAME={sim.sockname}\"]\n")
    return Exporter([f"--config.file={cfg}"])


def firing(url: str, instance: str) -> set[tuple[str, str, str]]:
    """(alert, switch, port or direction) of the fabric alerts firing for ``instance``."""
    out = set()
    for a in api(url, "alerts")["alerts"]:
        lbl = a["labels"]
        if (a["state"] == "firing" and lbl["alertname"].startswith("GpunetFabric")
                and lbl.get("instance") == instance):
            out.add((lbl["alertname"], lbl.get("switch", ""),
                     lbl.get("port", lbl.get("direction", ""))))
    return out


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[dict]:
    ibsim.require()
    healthy = ibsim.Sim(tmp_path / "a", ibsim.fat_tree(2, 2, 2).netfile).start()
    # Four hosts per leaf, two uplinks (2:1, at the oversubscription limit); L2's cable to S2
    # narrowed to 4X: L2 offers 2400 Gb/s to 800 of uplinks (3:1).
    narrow = ibsim.Sim(tmp_path / "b",
                       ibsim.fat_tree(2, 2, 4, narrow=[("L2", "S2")]).netfile).start()
    exporters = [exporter_for(healthy, tmp_path, "a"), exporter_for(narrow, tmp_path, "b")]
    targets = [e.url.removeprefix("http://") for e in exporters]
    prom, url = start_prometheus(tmp_path, [{"targets": targets}])
    try:
        yield {"url": url, "healthy": healthy, "targets": targets}
    finally:
        stop(prom)
        for e in exporters:
            e.stop()
        healthy.stop()
        narrow.stop()


def wait_evaluated(url: str, targets: list[str], timeout: float = 60) -> None:
    """Until both exporters' sweeps are in Prometheus and the alert rules ran after that."""
    def swept() -> bool:
        have = {r["metric"]["instance"] for r in query(url, "gpunet_fabric_sweep_success == 1")}
        return have == set(targets) and bool(
            query(url, "gpunet_fabric_leaf_uplink_bytes_per_second"))

    began = time.monotonic()
    wait_for(swept, "the exporters' fabric sweeps to reach Prometheus", timeout=timeout,
             interval=0.5, ignore=(requests.ConnectionError,))  # Prometheus still starting
    start = time.time()

    def evaluated() -> bool:
        groups = api(url, "rules")["groups"]
        alerts = next(g for g in groups if g["name"] == "gpunet-alerts")
        return all(r.get("lastEvaluation", "") and _ts(r["lastEvaluation"]) > start + 1
                   for r in alerts["rules"])

    wait_for(evaluated, "the alert rules to evaluate after the sweeps",
             timeout=max(1.0, timeout - (time.monotonic() - began)), interval=0.5)


def _ts(text: str) -> float:
    from datetime import datetime
    return datetime.fromisoformat(text.replace("Z", "+00:00")[:26] + "+00:00").timestamp()


def test_fabric_faults_fire_their_alerts_and_the_healthy_fabric_is_silent(stack: dict) -> None:
    url, sim = stack["url"], stack["healthy"]
    a, b = stack["targets"]
    wait_evaluated(url, stack["targets"])
    assert firing(url, a) == set()
    assert firing(url, b) == {("GpunetFabricLinkDegraded", L2, "6"),
                              ("GpunetFabricLinkDegraded", S2, "2"),
                              ("GpunetFabricLeafOversubscribed", L2, "")}
    degraded = [x for x in api(url, "alerts")["alerts"]
                if x["labels"]["alertname"] == "GpunetFabricLinkDegraded"]
    assert all("200" in x["annotations"]["description"] for x in degraded)  # 4X HDR in Gb/s

    lids = sim.lids()
    sim.command('PerformanceSet "L1"[3] PortCounters.SymbolErrorCounter=5000')
    sweeps = sim.heavy_sweeps()
    sim.command('Unlink "L2"[3]')  # L2's cable to S1
    sim.wait_resweep(sweeps)
    expected = {
        ("GpunetFabricPortSymbolErrors", L1, "3"),
        ("GpunetFabricLinkDown", L2, "3"), ("GpunetFabricLinkDown", S1, "2"),
        # L1 reaches L2's hosts through S2 only now: its table and its traffic say so.
        ("GpunetFabricRoutingUnbalanced", L1, ""),
        ("GpunetFabricUplinkImbalance", L1, "tx"),
    }
    seen: set[tuple[str, str, str]] = set()
    deadline = time.monotonic() + 90
    while not expected <= seen and time.monotonic() < deadline:
        subprocess.run(["ibping", "-c", "5000", "-f", str(lids["L2H1"])],
                       env=sim.env("L1H1"), cwd=sim.workdir,
                       capture_output=True, timeout=60, check=False)
        seen |= firing(url, a)
    assert expected <= seen, f"missing {expected - seen}; fired {seen}"
    # Nothing else, once the fabric has settled: judged on the alerts of an evaluation after
    # every expected one was seen, not on all seen on the way. With every `for:` at 0s a single
    # sweep between the unlink and opensm's new tables counts: one found L2's table unbalanced
    # (probably its port 3 read still up beside a table already routed around it), which the
    # shipped 15m `for:` passes over.
    wait_evaluated(url, stack["targets"])
    settled = firing(url, a)
    tolerated = ("GpunetFabricUplinkImbalance", "GpunetFabricPortTransmitDiscards")
    unexpected = {x for x in settled - expected if x[0] not in tolerated}
    assert not unexpected, f"{unexpected}; seen on the way {seen - expected}"
    assert firing(url, b) == {("GpunetFabricLinkDegraded", L2, "6"),
                              ("GpunetFabricLinkDegraded", S2, "2"),
                              ("GpunetFabricLeafOversubscribed", L2, "")}
