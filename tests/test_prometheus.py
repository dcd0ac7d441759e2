"""A real Prometheus (Debian's package) scrapes the installed exporter on the DGX tree: what an
operator sees after pointing Prometheus at a node."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from support import sysfs_tree as st
from support.exporter import free_port
from support.wait import wait_for


@pytest.fixture
def prometheus(tmp_path: Path, run_exporter: Any) -> Iterator[tuple[str, Any]]:
    assert shutil.which("prometheus"), ("Debian's prometheus package is required; tests/run.sh "
                                        "installs it when run as root")
    sysfs = st.build_dgx_h100(tmp_path / "tree")
    st.make_port_degraded(sysfs, "mlx5_5")
    exporter = run_exporter(f"--path.sysfs={sysfs}")
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: gpunet\n"
        f"    static_configs: [{{targets: ['127.0.0.1:{exporter.port}']}}]\n")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        yield url, exporter
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=5)
    r.raise_for_status()
    result: list[dict[str, Any]] = r.json()["data"]["result"]
    return result


def query_until(url: str, expr: str, timeout: float = 60) -> list[dict[str, Any]]:
    """The result of ``expr`` once it has data."""
    return wait_for(lambda: query(url, expr), f"data for {expr!r}", timeout=timeout,
                    interval=0.5, ignore=(requests.RequestException,))


def test_prometheus_scrapes_every_port(prometheus: tuple[str, Any]) -> None:
    url, _ = prometheus
    up = query_until(url, 'up{job="gpunet"} == 1')
    assert len(up) == 1
    rates = query_until(url, "gpunet_infiniband_port_rate_bytes_per_second")
    assert len(rates) == 10
    by_device = {r["metric"]["device"]: float(r["value"][1]) for r in rates}
    assert by_device["mlx5_5"] == 200e9 / 8 and by_device["mlx5_0"] == 400e9 / 8
    degraded = query(url, "gpunet_infiniband_port_rate_degraded == 1")
    assert [d["metric"]["device"] for d in degraded] == ["mlx5_5"]
    # Counters arrive as counters: rate() works on them (flat fixture: 0 bytes per second).
    query_until(url, "count(rate(gpunet_infiniband_port_transmitted_bytes_total[5s])) == 10", 30)
    # Every collector succeeds, and the scrape was OpenMetrics-negotiated without errors.
    ok = query(url, "gpunet_scrape_collector_success")
    assert {r["metric"]["collector"]: r["value"][1] for r in ok} == {
        "infiniband": "1", "link": "1", "pfc": "1", "gpu": "1", "topology": "1", "nccl": "1",
        "nic": "1"}
    targets = requests.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
    assert targets[0]["health"] == "up" and not targets[0]["lastError"]


def test_planes_and_efa_through_the_shipped_rules(tmp_path: Path, run_exporter: Any) -> None:
    """docs/formats.md §1.8 in a real Prometheus with the generated rules (every `for:` at 0s):
    on a multi-plane ConnectX-8 node with one data plane down, GpunetPortDown fires for that
    plane alone, not for the sixteen planes that carry no data; on an EFA node whose SRD peers
    stop answering, GpunetEfaTransportImpaired fires for that device alone, and EFA's bytes
    reach the byte family the rules read."""
    from support.prometheus import start_prometheus, stop

    cx8 = st.build_cx8_multiplane(tmp_path / "cx8")
    st.make_plane_down(cx8, "roce_r1", 6)
    efa = st.build_efa(tmp_path / "efa")
    args = ("--collector.disable-defaults", "--collector.infiniband")
    e_cx8 = run_exporter(f"--path.sysfs={cx8}", *args)
    e_efa = run_exporter(f"--path.sysfs={efa}", *args)
    targets = {f"127.0.0.1:{e_cx8.port}": "cx8", f"127.0.0.1:{e_efa.port}": "efa"}
    proc, url = start_prometheus(tmp_path, [{"targets": sorted(targets)}])
    try:
        query_until(url, 'count(up{job="gpunet"} == 1) == 2')
        bytes_ = query_until(url, "gpunet_infiniband_port_transmitted_bytes_total"
                                  f'{{instance="127.0.0.1:{e_efa.port}"}}')
        assert len(bytes_) == len(st.EFA_BUSES)

        def firing() -> set[tuple[str, str, str, str]]:
            return {(targets[a["metric"]["instance"]], a["metric"]["alertname"],
                     a["metric"].get("device", ""), a["metric"].get("port", ""))
                    for a in query(url, 'ALERTS{alertstate="firing"}')}

        def efa_events() -> set[tuple[str, str, str, str]] | None:
            st.make_efa_retransmitting(efa, events=50)  # rising while Prometheus scrapes
            now = firing()
            want = {("efa", "GpunetEfaTransportImpaired", st.efa_name(st.EFA_BUSES[1]), "1"),
                    ("cx8", "GpunetPortDown", "roce_r1", "6")}
            return now if want <= now else None

        now = wait_for(efa_events, "GpunetEfaTransportImpaired and GpunetPortDown firing",
                       timeout=90,
                       interval=1, ignore=(requests.RequestException,))
        port_alerts = {a for a in now if a[1] in ("GpunetPortDown",
                                                  "GpunetPortRateBelowExpected")}
        assert port_alerts == {("cx8", "GpunetPortDown", "roce_r1", "6")}
        assert {a for a in now if a[1] == "GpunetEfaTransportImpaired"} == {
            ("efa", "GpunetEfaTransportImpaired", st.efa_name(st.EFA_BUSES[1]), "1")}
    finally:
        stop(proc)
