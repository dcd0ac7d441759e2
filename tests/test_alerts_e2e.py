"""The whole bundle with real components on loopback: two installed exporters on fixture trees (a
healthy node and a node with faults), Debian's Prometheus scraping both every second with the
generated rules loaded, and Debian's Alertmanager running the shipped alerts/alertmanager.yml
(its receivers pointed at a webhook this test serves, its group waits shortened).

The faulty node has a port trained down to 200 Gb/s, PFC off on the RoCE priority (on priority 5
instead of 3), a cluster-mode probe result showing NCCL on TCP sockets without GPUDirect RDMA, and
no nvidia_peermem (with the proprietary driver, so no DMA-BUF either). The test proves that:
the expected alerts reach the webhook, routed by severity, with their labels and annotations;
the alerts they cause (bandwidth and latency low, GDR inactive) fire in Prometheus but are
inhibited by Alertmanager; the healthy node raises nothing, not even a pending alert; and every
dashboard query, with its variables substituted, runs and returns data.

The rules are the shipped generator's, with every `for:` set to 0s through a thresholds file
(the same override an operator uses), so alerts fire within seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests
import yaml

from gpunet_exporter.health import rules, thresholds
from gpunet_exporter.probe import results

import fake_nvml
import sysfs_tree as st
from conftest import FIXTURES, REPO, Exporter, free_port
from test_link import DEVINFO

HEALTHY, FAULTY = "gpu-healthy", "gpu-faulty"
HEALTHY_JOB_PID = 4242
HEALTHY_JOB_ENV = {"PATH": "/usr/bin", "NCCL_SOCKET_IFNAME": "bond0", "NCCL_ALGO": "Ring"}
DEGRADED_PORT, DOWN_PORT = "mlx5_5", "mlx5_3"
NIC_PCIE_DEGRADED = "mlx5_7"  # its PCIe link trained down to x8
MTU_PORT = "mlx5_8"  # the other RoCE port; its netdev is left at MTU 1500 on the faulty node
QOS_DEVICE = "mlx5_9"  # the RoCE port whose netdev carries the QoS configuration
RETRANSMITTING = MTU_PORT  # its out_of_sequence hw_counter rises while the bundle runs
MISSING_DEVICE = "mlx5_12"  # learned earlier by the faulty node's exporter, gone since
CAPTURE = FIXTURES / "synthetic" / "ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt"
ETHTOOL = """\
#!/bin/sh
[ "$1" = -S ] && [ "$2" = {netdev} ] && exec cat {capture}
echo "Cannot get stats strings information: Operation not supported" >&2
exit 94
"""
# The faulty node's stand-in: the same capture, plus FEC-uncorrected symbol errors that rise by
# 1000 a second (the clock in milliseconds), so both Prometheus' increase() and the doctor's two
# readings, however close, see the counter rise.
ETHTOOL_RISING_PHY = """\
#!/bin/sh
if [ "$1" = -S ] && [ "$2" = {netdev} ]; then
  cat {capture}
  echo "     rx_pcs_symbol_err_phy: $(( $(date +%s%N) / 1000000 ))"
  exit 0
fi
echo "Cannot get stats strings information: Operation not supported" >&2
exit 94
"""
# Stand-in for `mlnx_qos -i IF` on the QoS netdev: the hand-built report of
# tests/fixtures/pfc (PFC on priority 5 only), or the same report with PFC moved to priority 3
# for the healthy node; the other RoCE netdev gets a healthy report (PFC on 3 and 5) on both
# nodes (a RoCE interface whose configuration cannot be read raises GpunetPfcConfigUnreadable).
MLNX_QOS = """\
#!/bin/sh
[ "$1" = -i ] && [ "$2" = {netdev} ] && exec cat {report}
[ "$1" = -i ] && [ -n "$2" ] && [ -f {healthy} ] && exec cat {healthy}
echo "Netlink error: no such device" >&2
exit 1
"""
QOS_REPORT = FIXTURES / "pfc" / "mlnx_qos_os-dscp-pfc5-custom.txt"
PFC5 = ("\tenabled     0   0   0   0   0   1   0   0   \n"
        "\tbuffer      0   0   0   0   0   1   0   0   ")
PFC3 = ("\tenabled     0   0   0   1   0   0   0   0   \n"
        "\tbuffer      0   0   0   1   0   0   0   0   ")
PFC35 = ("\tenabled     0   0   0   1   0   1   0   0   \n"
         "\tbuffer      0   0   0   1   0   1   0   0   ")
CONFIG = """\
collectors: {{probe: true}}
infiniband:
  expected_rate:
    - {{link_layer: InfiniBand, gbps: 400}}
link:
  expected_mtu:
    - {{link_layer: Ethernet, mtu: 9000}}
    - {{link_layer: InfiniBand, rdma_mtu: 4096}}
  ibv_devinfo: {{path: {ibv_devinfo}}}
pfc:
  stats_source: ethtool
  ethtool: {{path: {ethtool}}}
  config: {{sources: [mlnx_qos], mlnx_qos_path: {mlnx_qos}, interval_seconds: 1}}
probe:
  command: [{python}, {runner}]   # a stand-in runner: writes the node's results, then idles
  state_dir: {state}
"""


def probe_result(scope: str, *, socket: bool) -> dict[str, Any]:
    """A successful probe round as the runner writes it: 8 KiB, 1 MiB and 64 MiB; intra over
    P2P; net (the node's 8 GPUs through their 8 HCAs) and inter over NET/IB with GPUDirect RDMA,
    or (socket) over NET/Socket without it, at TCP speeds."""
    now = time.time()
    fabric = scope != "intra"
    busbw = {8192: 4.1e8, 1 << 20: 2.1e10, 64 << 20: 3.6e11 if not fabric else 4.4e10}
    latency = {8192: 4e-5 if not fabric else 1.2e-4, 1 << 20: 1e-4, 64 << 20: 3.7e-4}
    if socket:
        busbw = {8192: 1.5e7, 1 << 20: 1.1e9, 64 << 20: 2.9e9}
        latency = {8192: 3.1e-3, 1 << 20: 1.9e-3, 64 << 20: 4.6e-2}
    sizes = [{"bytes": b, "skipped": False, "median_seconds": latency[b],
              "p99_seconds": latency[b] * 1.3, "max_seconds": latency[b] * 1.6,
              "algbw_bytes_per_second": busbw[b] / 1.75, "busbw_bytes_per_second": busbw[b]}
             for b in busbw]
    transports = {"intra": ["P2P"], "net": ["NET"], "inter": ["NET", "P2P"]}[scope]
    hcas = [{"device": f"mlx5_{i}", "port": "1", "ranks": [i], "gdr": not socket,
             "rate_bytes_per_second": 5e10} for i in range(8)] if fabric and not socket else []
    return {"version": 2, "scope": scope, "started": now - 2.0, "time": now, "success": True,
            "backend": "nccl", "world_size": 16 if scope == "inter" else 8,
            "nccl_version": "2.28.9", "sizes": sizes,
            # The faulty node's cluster-mode round names a local late rank below the alert.
            "straggler": {"wait_seconds": 1.4e-2, "wait_ratio": 0.3, "late_share": 0.9,
                          "rank": 3, "gpu": 3, "local": True} if socket else {
                "wait_seconds": 1e-5, "wait_ratio": 0.03, "late_share": 0.4, "rank": None,
                "gpu": None, "local": False},
            "net": ("Socket" if socket else "IB") if fabric else "",
            "transports": transports,
            "net_transports": (["Socket"] if socket else ["IB"]) if fabric else [],
            "gdr": (not socket) if fabric else None,
            "problems": ["gdr_disabled", "socket_fallback"] if socket else [],
            # On sockets NCCL's log names no HCA: no link to compare with.
            "hcas": hcas, "link_bytes_per_second": 5e10 if hcas else None}


RUNNER = """\
import json, os, sys, time
state = sys.argv[sys.argv.index("--state-dir") + 1]
os.makedirs(state, exist_ok=True)
for scope, data in json.load(open({results!r})).items():
    data.update(started=time.time() - 2.0, time=time.time())
    with open(os.path.join(state, f".{{scope}}.tmp"), "w") as fh:
        json.dump(data, fh)
    os.replace(os.path.join(state, f".{{scope}}.tmp"), os.path.join(state, f"{{scope}}.json"))
time.sleep(3600)
"""
# PHY counters of a mlx5 port (counters.rst names, docs/formats.md 3.2) that the synthetic capture
# leaves out; appended so the node dashboard's physical-error panel has its series.
PHY_COUNTERS = """\
     rx_crc_errors_phy: 0
     rx_symbol_err_phy: 0
     rx_pcs_symbol_err_phy: 0
     rx_corrected_bits_phy: 1204
     rx_bits_phy: 2984057164880
     rx_err_lane_0_phy: 301
     rx_err_lane_1_phy: 297
     rx_err_lane_2_phy: 310
     rx_err_lane_3_phy: 296
"""


def build_node(root: Path, faulty: bool) -> tuple[list[str], dict[str, str], str]:
    """Arguments (those the exporter and the doctor share) and environment for one node; returns
    also the RoCE netdev whose PFC configuration the test inspects.

    Faults of the faulty node, beyond the four the issue names: a port down, an IB port with a
    2048-byte active MTU, GPU 0 on a x8 link, on the other NUMA node than its NIC and with an
    XID 13, GPU 0 65 % busy with a compute process (the network-bound band), GPU 1 lost,
    mlx5_7's own PCIe link trained down to x8, and the RoCE netdev of mlx5_8 at MTU 1500 (below
    the RoCE minimum and not the expected 9000: two alerts) whose QoS configuration cannot be
    read and whose out_of_sequence counter rises while the bundle runs, and an RDMA device
    (MISSING_DEVICE) in the learned inventory that the tree no longer has."""
    sysfs = st.build_dgx_h100_gpus(root)
    qos_netdev = st.make_ofed_qos(sysfs, QOS_DEVICE)  # its netdev's name; ECN files for panels
    scenario = fake_nvml.h200x2()
    for dev, bus in zip(scenario["devices"], st.DGX_GPU_BUSES, strict=False):
        dev["nvmlDeviceGetPciInfo"]["ok"]["busId"] = f"00000000:{bus:02X}:00.0"
    devinfo = DEVINFO.replace("2048 (4)", "4096 (5)")
    if faulty:
        st.make_port_degraded(sysfs, DEGRADED_PORT)
        st.make_port_down(sysfs, DOWN_PORT)
        st.make_peermem_unloaded(sysfs)
        st.make_mtu_1500(sysfs, MTU_PORT)  # RoCE netdev: below 4200 and not the expected 9000
        st.set_numa_node(sysfs, f"0000:{st.DGX_GPU_BUSES[0]:02x}:00.0", 1)
        scenario["devices"][0]["nvmlDeviceGetCurrPcieLinkWidth"] = {"ok": 8}
        scenario["devices"][1]["lost"] = True
        st.make_nic_pcie_downtrained(sysfs, NIC_PCIE_DEGRADED)
        # GPU 0 runs a training process at 65 %: the network-bound band (an info alert).
        scenario["devices"][0]["nvmlDeviceGetUtilizationRates"] = {
            "ok": {"gpu": 65, "memory": 30}}
        scenario["devices"][0]["processes"] = [4242]
        devinfo = DEVINFO
    procfs = st.build_procfs(root, nvidia=st.NVRM_PROPRIETARY if faulty else st.NVRM_OPEN)
    if not faulty:
        # A good job's settings, not faults (issue 16): bootstrap on the management bond, a forced
        # algorithm. The healthy node must still raise nothing, in Prometheus and in the doctor;
        # its GPU is busy (a process at low utilization would be GpunetGpuStarved).
        scenario["devices"][0]["processes"] = [HEALTHY_JOB_PID]
        scenario["devices"][0]["nvmlDeviceGetUtilizationRates"] = {"ok": {"gpu": 97, "memory": 40}}
        st.write_process(procfs, HEALTHY_JOB_PID, HEALTHY_JOB_ENV)
    (root / "nvml.json").write_text(json.dumps(scenario))
    (root / "xid-events").write_text("0 13\n" if faulty else "")
    (root / "devinfo.txt").write_text(devinfo)
    ibv_devinfo = root / "ibv_devinfo"
    ibv_devinfo.write_text(f"#!/bin/sh\nexec cat {root / 'devinfo.txt'}\n")
    ibv_devinfo.chmod(0o755)
    (root / "results.json").write_text(json.dumps(
        {scope: probe_result(scope, socket=faulty and scope == "inter")
         for scope in results.SCOPES}))
    runner = root / "runner.py"
    runner.write_text(RUNNER.format(results=str(root / "results.json")))
    phy = PHY_COUNTERS
    if faulty:  # the stand-in prints a rising rx_pcs_symbol_err_phy instead
        phy = phy.replace("     rx_pcs_symbol_err_phy: 0\n", "")
        assert phy != PHY_COUNTERS
    (root / "ethtool-S.txt").write_text(CAPTURE.read_text() + phy)
    ethtool = root / "ethtool"
    ethtool.write_text((ETHTOOL_RISING_PHY if faulty else ETHTOOL).format(
        netdev=qos_netdev, capture=root / "ethtool-S.txt"))
    ethtool.chmod(0o755)
    report = QOS_REPORT.read_text()
    assert PFC5 in report
    (root / "mlnx_qos.txt").write_text(report if faulty else report.replace(PFC5, PFC3))
    if not faulty:  # the faulty node's other RoCE netdev answers nothing: PFC unreadable there
        (root / "mlnx_qos-healthy.txt").write_text(report.replace(PFC5, PFC35))
    mlnx_qos = root / "mlnx_qos"
    mlnx_qos.write_text(MLNX_QOS.format(netdev=qos_netdev, report=root / "mlnx_qos.txt",
                                        healthy=root / "mlnx_qos-healthy.txt"))
    mlnx_qos.chmod(0o755)
    config = root / "config.yml"
    config.write_text(CONFIG.format(ethtool=ethtool, state=root / "probe", mlnx_qos=mlnx_qos,
                                    ibv_devinfo=ibv_devinfo, python=sys.executable,
                                    runner=runner))
    # The inventory the exporter learns (the doctor reads it, never writes it); the faulty
    # node's learned earlier an RDMA device that has since fallen off the bus.
    inventory = root / "inventory.json"
    if faulty:
        inventory.write_text(json.dumps({"version": 1, "rdma_device": [MISSING_DEVICE],
                                         "rdma_port": [], "netdev": []}))
    args = [f"--path.sysfs={sysfs}", f"--path.procfs={procfs}", f"--config.file={config}",
            "--nvml.module=fake_nvml", f"--collector.infiniband.inventory-state-file={inventory}"]
    env = {"PYTHONPATH": str(REPO / "tests"), "GPUNET_FAKE_NVML": str(root / "nvml.json"),
           "GPUNET_FAKE_NVML_EVENTS": str(root / "xid-events")}
    return args, env, qos_netdev


@dataclass
class Webhook:
    """Alertmanager's webhook receiver: every notification, by path (/pager, /ticket)."""
    port: int = field(default_factory=free_port)
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> ThreadingHTTPServer:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook.lock:
                    hook.received.append((self.path, body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def alerts(self) -> list[tuple[str, dict[str, Any]]]:
        """(receiver path, alert) for every firing alert delivered so far."""
        with self.lock:
            return [(path, a) for path, body in self.received for a in body["alerts"]
                    if a["status"] == "firing"]


@dataclass
class Bundle:
    prometheus: str
    alertmanager: str
    webhook: Webhook
    qos_netdev: str
    nodes: dict[str, tuple[list[str], dict[str, str]]]  # instance -> exporter args, env


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_until(what: str, check: Callable[[], Any], timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except requests.RequestException:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.5)


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = requests.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bundle]:
    for binary in ("prometheus", "prometheus-alertmanager"):
        assert shutil.which(binary), f"{binary} is required (tests/run.sh installs it as root)"
    tmp = tmp_path_factory.mktemp("bundle")
    procs: list[subprocess.Popen[bytes]] = []
    exporters: list[Exporter] = []
    hook = Webhook()
    server = hook.start()
    done = threading.Event()
    try:
        qos_netdev = ""
        targets = []
        nodes = {}
        for name in (HEALTHY, FAULTY):
            (tmp / name).mkdir()
            args, env, qos_netdev = build_node(tmp / name, faulty=name == FAULTY)
            nodes[name] = (args, env)
            e = Exporter([*args, "--no-hotplug"], env=env)
            exporters.append(e)
            targets.append({"targets": [f"127.0.0.1:{e.port}"], "labels": {"instance": name}})

        # The faulty node's RoCE port loses packets: its out_of_sequence counter rises by
        # 200 a second while the bundle runs (GpunetRoceRetransmissions, for Prometheus and the
        # doctor alike).
        counter = (tmp / FAULTY / "sys/class/infiniband" / RETRANSMITTING /
                   "ports/1/hw_counters/out_of_sequence")

        def retransmit() -> None:
            while not done.wait(0.2):
                counter.write_text(f"{int(counter.read_text()) + 40}\n")

        threading.Thread(target=retransmit, daemon=True).start()

        # Rules: the generator's, every `for:` 0s through a thresholds file.
        overrides = tmp / "thresholds.yml"
        overrides.write_text(yaml.safe_dump({"for": dict.fromkeys(rules.ALERT_NAMES, "0s")}))
        (tmp / "rules.yml").write_text(
            rules.render(thresholds.load(str(overrides), rules.ALERT_NAMES)))

        # Alertmanager: the shipped example, receivers on the webhook, waits shortened.
        am = yaml.safe_load((REPO / "alerts" / "alertmanager.yml").read_text())
        am["route"].update(group_wait="1s", group_interval="1s", repeat_interval="1h")
        for receiver in am["receivers"]:
            for hook_cfg in receiver.get("webhook_configs", []):
                hook_cfg["url"] = f"http://127.0.0.1:{hook.port}/{receiver['name']}"
        (tmp / "alertmanager.yml").write_text(yaml.safe_dump(am))
        am_port = free_port()
        procs.append(start(["prometheus-alertmanager", f"--config.file={tmp / 'alertmanager.yml'}",
                            f"--storage.path={tmp / 'am-data'}",
                            f"--web.listen-address=127.0.0.1:{am_port}",
                            "--cluster.listen-address="], tmp / "alertmanager.log"))

        prom_port = free_port()
        (tmp / "prometheus.yml").write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "rules.yml")],
            "alerting": {"alertmanagers": [
                {"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [{"job_name": "gpunet", "static_configs": targets}],
        }))
        procs.append(start(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                            f"--storage.tsdb.path={tmp / 'prom-data'}",
                            f"--web.listen-address=127.0.0.1:{prom_port}"],
                           tmp / "prometheus.log"))
        prom = f"http://127.0.0.1:{prom_port}"
        wait_until("both targets up", lambda: len(query(prom, 'up{job="gpunet"} == 1')) == 2)
        yield Bundle(prom, f"http://127.0.0.1:{am_port}", hook, qos_netdev, nodes)
    finally:
        done.set()
        for p in procs:
            stop(p)
        for e in exporters:
            e.stop()
        server.shutdown()


# What the faulty node must page or ticket for: alert -> (receiver, labels it must carry).
EXPECTED = {
    "GpunetPortDown": ("/pager", {"device": DOWN_PORT, "port": "1"}),
    "GpunetPortRateBelowExpected": ("/pager", {"device": DEGRADED_PORT, "port": "1"}),
    "GpunetRdmaMtuNotExpected": ("/ticket", {"device": "mlx5_6", "port": "1"}),
    "GpunetPfcDisabledOnRocePriority": ("/pager", {"priority": "3"}),
    "GpunetNcclSocketFallback": ("/pager", {"scope": "inter"}),
    "GpunetGdrNotReady": ("/pager", {}),
    "GpunetGpuNicNumaMismatch": ("/ticket", {"gpu": "0"}),
    "GpunetNicPcieLinkDegraded": ("/ticket", {"device": NIC_PCIE_DEGRADED}),
    "GpunetGpuPcieLinkDegraded": ("/ticket", {"gpu": "0"}),
    "GpunetGpuXidErrors": ("/ticket", {"gpu": "0", "xid": "13"}),
    "GpunetGpuLost": ("/pager", {"gpu": "1"}),
    "GpunetInterfacePhyErrors": ("/ticket", {}),  # on the QoS netdev, asserted below
    # One netdev, two alerts: below the RoCE minimum and not the configured 9000.
    "GpunetRoceMtuTooSmall": ("/ticket", {}),
    "GpunetInterfaceMtuNotExpected": ("/ticket", {}),
    "GpunetRdmaDeviceMissing": ("/pager", {"kind": "rdma_device"}),
    "GpunetPfcConfigUnreadable": ("/ticket", {}),  # on mlx5_8's netdev, asserted below
    "GpunetRoceRetransmissions": ("/ticket", {"device": RETRANSMITTING, "port": "1"}),
}
# Firing in Prometheus on the faulty node, silenced by the shipped inhibition rules: NCCL on
# sockets and GDR not ready silence the slow-collective alerts and "GDR inactive".
INHIBITED = {"GpunetGdrInactive", "GpunetBusBandwidthLow", "GpunetAllreduceLatencyHigh"}
# Firing in Prometheus on the faulty node, info severity: the example routes it to no receiver.
UNROUTED = {"GpunetGpusNetworkBoundBand"}


def test_expected_alerts_reach_the_webhook(bundle: Bundle) -> None:
    def delivered() -> dict[str, tuple[str, dict[str, Any]]]:
        got = {a["labels"]["alertname"]: (path, a) for path, a in bundle.webhook.alerts()
               if a["labels"]["instance"] == FAULTY}
        return got if set(EXPECTED) <= set(got) else {}

    got = wait_until("the faulty node's alerts at the webhook", delivered)
    meta = {a.name: a for a in rules.ALERTS}
    for name, (path, labels) in EXPECTED.items():
        receiver, alert = got[name]
        assert receiver == path, f"{name} went to {receiver}"
        assert alert["labels"]["instance"] == FAULTY
        assert alert["labels"]["severity"] == meta[name].severity
        assert alert["labels"]["class"] == meta[name].cls
        assert alert["labels"]["job"] == "gpunet"
        for k, v in labels.items():
            assert alert["labels"][k] == v, (name, k)
        ann = alert["annotations"]
        assert ann["summary"] == meta[name].summary
        assert FAULTY in ann["description"] and "{{" not in ann["description"]
        assert ann["runbook_url"].endswith("/docs/runbooks.md#" + name.lower())
    assert got["GpunetPfcDisabledOnRocePriority"][1]["labels"]["interface"] == bundle.qos_netdev
    assert got["GpunetInterfacePhyErrors"][1]["labels"]["interface"] == bundle.qos_netdev
    assert "runs at 200 Gb/s" in got["GpunetPortRateBelowExpected"][1]["annotations"][
        "description"]


def test_caused_alerts_fire_but_are_inhibited(bundle: Bundle) -> None:
    test_expected_alerts_reach_the_webhook(bundle)  # the causes are in Alertmanager
    def caused() -> set[str]:
        names = {r["metric"]["alertname"] for r in query(
            bundle.prometheus, f'ALERTS{{alertstate="firing", instance="{FAULTY}"}}')}
        return names if names >= INHIBITED | UNROUTED else set()

    firing = wait_until("the caused alerts firing in Prometheus", caused)
    assert firing >= set(EXPECTED) | INHIBITED | UNROUTED

    def suppressed() -> set[str]:
        alerts = requests.get(f"{bundle.alertmanager}/api/v2/alerts", timeout=10).json()
        states = {a["labels"]["alertname"]: a["status"] for a in alerts
                  if a["labels"].get("instance") == FAULTY}
        done = {n for n in INHIBITED if states.get(n, {}).get("state") == "suppressed"
                and states[n]["inhibitedBy"]}
        return done if done == INHIBITED else set()

    wait_until("Alertmanager marking the caused alerts inhibited", suppressed)
    time.sleep(3)  # well past group_wait and group_interval (1 s)
    delivered = {a["labels"]["alertname"] for _, a in bundle.webhook.alerts()}
    assert not delivered & INHIBITED, f"inhibited alerts were delivered: {delivered & INHIBITED}"
    # Nothing else fired on the faulty node beyond what the fixture explains.
    assert not delivered & UNROUTED, f"info alerts were delivered: {delivered & UNROUTED}"
    assert firing == set(EXPECTED) | INHIBITED | UNROUTED, sorted(firing)


def test_healthy_node_raises_nothing(bundle: Bundle) -> None:
    test_expected_alerts_reach_the_webhook(bundle)  # rules have had time to evaluate
    assert query(bundle.prometheus, f'ALERTS{{instance="{HEALTHY}"}}') == []
    assert not [a for _, a in bundle.webhook.alerts()
                if a["labels"].get("instance") == HEALTHY]
    # The same rules saw the healthy node's series: it is not silent for lack of data.
    for expr in ("gpunet_infiniband_port_rate_degraded", "gpunet_pfc_enabled",
                 "gpunet_probe_socket_fallback", "gpunet_topology_gdr_ready",
                 "gpunet_topology_nccl_env_findings"):
        assert query(bundle.prometheus, f'{expr}{{instance="{HEALTHY}"}}'), expr
    # Its GPU process's settings were audited and counted, as settings only (issue 16).
    for expr in ('gpunet_topology_nccl_env_settings{variable="NCCL_SOCKET_IFNAME", '
                 f'value_class="non_rdma_netdev", instance="{HEALTHY}"}} == 1',
                 f'gpunet_topology_nccl_env_settings{{variable="NCCL_ALGO", value_class="ring", '
                 f'instance="{HEALTHY}"}} == 1'):
        assert query(bundle.prometheus, expr), expr


def test_health_matrix_records_every_node_and_class(bundle: Bundle) -> None:
    test_expected_alerts_reach_the_webhook(bundle)

    def matrix() -> dict[tuple[str, str], float]:
        rows = query(bundle.prometheus, rules.ALERTS_FIRING)
        got = {(r["metric"]["instance"], r["metric"]["class"]): float(r["value"][1])
               for r in rows}
        return got if got.get((FAULTY, "transport"), 0) >= 3 else {}

    got = wait_until("the health matrix", matrix)
    assert set(got) == {(n, c) for n in (HEALTHY, FAULTY) for c in rules.CLASSES}
    assert all(v == 0 for (n, _), v in got.items() if n == HEALTHY)
    assert got[(FAULTY, "link")] == 8 and got[(FAULTY, "congestion")] == 2
    assert got[(FAULTY, "gpu")] == 4 and got[(FAULTY, "topology")] == 1
    assert got[(FAULTY, "exporter")] == 0 and got[(FAULTY, "transport")] == 4


def test_port_down_inhibits_its_symptoms(bundle: Bundle) -> None:
    """The port-down rules of the shipped example, through Alertmanager's API: the down port's
    rate and PFC alerts are held back, another port's alert is not."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    base = {"instance": "gpu-inhibit", "job": "gpunet", "severity": "critical"}
    alerts = [
        {"alertname": "GpunetPortDown", "device": "mlx5_8", "port": "1", "interface": "eth8",
         "class": "link"},
        {"alertname": "GpunetPortRateBelowExpected", "device": "mlx5_8", "port": "1",
         "class": "link"},
        {"alertname": "GpunetPfcDisabledOnRocePriority", "interface": "eth8", "priority": "3",
         "class": "congestion"},
        {"alertname": "GpunetPortRateBelowExpected", "device": "mlx5_0", "port": "1",
         "class": "link"},
    ]
    r = requests.post(f"{bundle.alertmanager}/api/v2/alerts", timeout=10, json=[
        {"labels": {**base, **a}, "annotations": {"summary": "test"}, "startsAt": now}
        for a in alerts])
    assert r.status_code == 200, r.text

    def delivered() -> set[tuple[str, str]]:
        got = {(a["labels"]["alertname"], a["labels"].get("device", "")) for _, a in
               bundle.webhook.alerts() if a["labels"]["instance"] == "gpu-inhibit"}
        return got if ("GpunetPortRateBelowExpected", "mlx5_0") in got else set()

    wait_until("the other port's alert at the webhook", delivered)
    time.sleep(3)
    got = {(a["labels"]["alertname"], a["labels"].get("device", "")) for _, a in
           bundle.webhook.alerts() if a["labels"]["instance"] == "gpu-inhibit"}
    assert got == {("GpunetPortDown", "mlx5_8"), ("GpunetPortRateBelowExpected", "mlx5_0")}


def load_dashboards() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_generate",
                                                  REPO / "grafana" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_dashboard_query_returns_data(bundle: Bundle) -> None:
    """Every panel query of the three dashboards, variables substituted as Grafana would for
    the faulty node (or all nodes where the variable is multi-valued), runs in Prometheus and
    returns at least one series."""
    test_health_matrix_records_every_node_and_class(bundle)  # recorded series exist
    time.sleep(2)  # a few more samples for rate windows
    gen = load_dashboards()
    variables = {"instance": FAULTY, "job": "gpunet", "__rate_interval": "30s",
                 "__interval": "1s", "__range": "5m", "datasource": "prometheus"}
    empty: list[str] = []
    checked = 0
    for filename, dashboard in gen.dashboards().items():
        for title, expr in gen.queries(dashboard):
            promql = gen.substitute(expr, variables)
            assert "$" not in promql, f"{filename} {title}: unsubstituted variable: {promql}"
            checked += 1
            if not query(bundle.prometheus, promql):
                empty.append(f"{filename} / {title}: {promql}")
    assert checked > 40
    assert not empty, "queries without data:\n" + "\n".join(empty)


def doctor(args: list[str], env: dict[str, str], *extra: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(["gpunet-exporter", "doctor", *args, "--interval", "1", "--json",
                          "--state-file=", *extra], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=300)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def test_doctor_agrees_with_prometheus(bundle: Bundle) -> None:
    """`gpunet-exporter doctor` on each node, with the same thresholds, finds what the rules
    fire in Prometheus for it; the one alert it cannot judge alone is the comparison with the
    fleet's median bus bandwidth."""
    test_caused_alerts_fire_but_are_inhibited(bundle)  # every alert has had time to fire
    for node, (args, env) in bundle.nodes.items():
        code, result = doctor(args, env)
        found = {f["alert"] for f in result["findings"]}
        firing = {r["metric"]["alertname"] for r in query(
            bundle.prometheus, f'ALERTS{{alertstate="firing", instance="{node}"}}')}
        assert found == firing - {"GpunetBusBandwidthLow"}, node
        assert code == (1 if node == FAULTY else 0)
        assert result["status"] == ("findings" if node == FAULTY else "healthy")
        # The faulty node's other RoCE netdev: PFC could not be checked there (a finding that
        # mirrors GpunetPfcConfigUnreadable, and a problem).
        assert result["problems"] == ([] if node == HEALTHY else [
            f"PFC on {st._netdev(Path(args[0].split('=', 1)[1]), MTU_PORT).name}: its QoS "
            "configuration cannot be read"])
        assert all(result["checked"].values()) and "probe" in result["checked"]
        # The healthy node's job settings are notes: shown, never a finding or exit code 1.
        notes = {n["where"]: n["message"] for n in result["notes"]}
        if node == HEALTHY:
            assert set(notes) == {"NCCL_SOCKET_IFNAME", "NCCL_ALGO"}, notes
            assert notes["NCCL_SOCKET_IFNAME"].startswith("1 GPU processes set it "
                                                          "(non_rdma_netdev): bootstrap")
        else:
            assert notes == {}
