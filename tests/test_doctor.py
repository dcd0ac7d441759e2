"""`gpunet-exporter doctor`: the installed console script on fixture nodes. Its agreement with the
Prometheus rules on the same nodes is tests/test_alerts_e2e.py::test_doctor_agrees_with_prometheus.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunet_exporter.health import doctor as doctor_module
from gpunet_exporter.mixin import alerts as alerts_module
from gpunet_exporter.mixin.alerts import collective, link, transport

from support import fake_nvml
from support import sysfs_tree as st
from support.bundle_node import (
    HEALTHY_JOB_ENV,
    HEALTHY_JOB_PID,
    RAS,
    build_node,
    start_ras_jobs,
)
from support.exporter import exporter_binary
from support.paths import REPO
from support.ras_server import Behaviour, Server


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # No history unless a test names a state file (a later --state-file wins).
    return subprocess.run([exporter_binary(), "doctor", "--interval", "0.5", "--state-file=",
                           *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], dict[str, str]]]:
    jobs = start_ras_jobs(faulty=True)  # its NCCL jobs: a dead process, a stuck rank, a stopped one
    try:
        args, env, _ = build_node(tmp_path_factory.mktemp("faulty"), faulty=True,
                                  ras_ports=[j.port for j in jobs])
        yield args, env
    finally:
        for job in jobs:
            job.stop()


def test_report_groups_findings_by_cause(faulty: tuple[list[str], dict[str, str]]) -> None:
    args, env = faulty
    out = run(*args, env=env)
    assert out.returncode == 1, out.stderr
    text = out.stdout
    assert text.startswith("29 findings on this node:")
    # Causes in the report's order, each with its findings, device and confirming command.
    positions = [text.index(title) for title in (
        "NCCL on TCP sockets", "GPUDirect RDMA off", "Degraded or flapping link",
        "Transceiver or NIC firmware health", "PFC or ECN misconfigured", "MTU",
        "GPU and NIC placement", "Degraded GPU PCIe link",
        "GPU faults", "Slow collectives", "GPUs waiting", "RDMA devices, ports or netdevs gone",
        "NCCL jobs running now")]
    assert positions == sorted(positions)
    assert "[critical] mlx5_5 port 1: runs at 200 Gb/s, expected 400 Gb/s" in text
    # A confirming command that reads a file names the tree the doctor read, not /sys.
    sysfs = next(a.partition("=")[2] for a in args if a.startswith("--path.sysfs="))
    assert f"confirm: cat {sysfs}/class/infiniband/mlx5_5/ports/1/rate" in text
    assert "/sys/class" not in text.replace(sysfs, "SYSFS")
    assert "[critical] enp170s0f0np0: PFC off on priority 3, the one RoCE uses" in text
    assert "[warning] GPU 0: PCIe Gen5 x8, capable of Gen5 x16" in text
    assert "[critical] GPU 0: NVLink fabric registration in progress\n      confirm: nvidia-smi" \
        in text
    assert ("[warning] mlx5_7: PCIe link at 32 GT/s x8, both ends allow 32 GT/s x16\n"
            "      confirm: sudo lspci -vv -s 0000:dc:00.0 | grep -E 'LnkCap|LnkSta'") in text
    assert "docs/runbooks.md#gpunetgdrnotready (alert GpunetGdrNotReady)" in text
    assert "[critical] rdma_device: 1 expected rdma_device gone: mlx5_12" in text
    # The rail NIC in the wrong slot, and the starved job whose RDMA ports are idle.
    assert ("[warning] node: mlx5_0 is the nearest rail of 2 GPUs, while mlx5_1, mlx5_2, "
            "mlx5_5, mlx5_6, mlx5_7 serve none") in text
    assert ("[warning] node: 1 GPUs with compute processes (GPU 2) are busy less than 50% "
            "while the RDMA ports move 0 B/s") in text
    assert ("[warning] enp170s0f0np0 lane 3: receives -15.2 dBm, below the module's low "
            "warning -8.4 dBm\n      confirm: sudo ethtool -m enp170s0f0np0") in text
    assert "[warning] enp41s0f0np0: module at 78.5 C, above its high warning 75 C" in text
    assert ("[warning] mlx5_6 fw_fatal: devlink health reporter fw_fatal of pci/0000:ce:00.0 "
            "in error state, not recovered") in text
    # Last, what could not be checked: the other RoCE netdev's QoS configuration.
    assert text.rstrip().endswith("topology (ok)\nCould not check: PFC on enp41s0f0np0: its QoS "
                                  "configuration cannot be read")
    # Progress on stderr, one line per step, so a prolog's log shows where it waits.
    assert "doctor: waiting for the probe's round" in out.stderr
    assert "doctor: reading counters again in 0.5 s" in out.stderr


def test_thresholds_file_changes_the_verdict(faulty: tuple[list[str], dict[str, str]],
                                             tmp_path: Path) -> None:
    """The same override file as gpunet-rules: with PFC expected on priority 5 and latency
    allowed up to 5 ms, those two findings go away."""
    args, env = faulty
    (tmp_path / "t.yml").write_text("pfc: {roce_priority: 5}\nprobe: {latency_seconds: 0.005}\n")
    out = run(*args, "--json", f"--thresholds={tmp_path / 't.yml'}", env=env)
    result: dict[str, Any] = json.loads(out.stdout)
    alerts = {f["alert"] for f in result["findings"]}
    assert len(alerts) == 27
    assert "GpunetPfcDisabledOnRocePriority" not in alerts
    assert "GpunetAllreduceLatencyHigh" not in alerts
    assert result["exit_code"] == out.returncode == 1


def test_json_shape(faulty: tuple[list[str], dict[str, str]]) -> None:
    args, env = faulty
    out = run(*args, "--json", "--no-collector.probe", env=env)
    result = json.loads(out.stdout)
    assert out.stderr == ""  # --json: nothing but the document
    assert set(result) == {"status", "exit_code", "findings", "checked", "problems", "notes"}
    lost = next(f for f in result["findings"] if f["alert"] == "GpunetGpuLost")
    assert lost == {"cause": "gpu", "alert": "GpunetGpuLost", "where": "GPU 1",
                    "message": "fallen off the bus (GPU is lost)", "severity": "critical",
                    "confirm": "nvidia-smi; dmesg | grep -i -E 'xid|fallen off'", "fault": True}
    assert "probe" not in result["checked"]
    # fault: what makes the exit code 1 (slurm/gpunet-healthcheck drains for it); not an info
    # finding, a job's (NCCL's RAS) or one that says something could not be checked.
    not_faults = {(f["alert"], f["severity"], f["cause"]) for f in result["findings"]
                  if not f["fault"]}
    assert {a for a, _, _ in not_faults} >= {"GpunetGpusNetworkBoundBand",
                                             "GpunetPfcConfigUnreadable", "GpunetNcclRankDead"}
    assert all(s == "info" or c == "nccl_job" or a == "GpunetPfcConfigUnreadable"
               for a, s, c in not_faults), not_faults
    assert all(f["severity"] != "info" and f["cause"] != "nccl_job"
               for f in result["findings"] if f["fault"])


def test_nothing_to_check_exits_2(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys"
    (sysfs / "class" / "infiniband").mkdir(parents=True)
    out = run(f"--path.sysfs={sysfs}", "--collector.disable-defaults", "--collector.infiniband",
              "--json")
    assert out.returncode == 2
    result = json.loads(out.stdout)
    assert result["status"] == "could_not_check"
    assert result["problems"] == ["no RDMA port and no NVIDIA GPU found"]


def test_failing_collector_exits_2(tmp_path: Path) -> None:
    """A collector that fails makes the check incomplete: exit 2, naming it (here every
    collector runs past a scrape timeout of a microsecond)."""
    sysfs = st.build_dgx_h100(tmp_path / "tree")
    out = run(f"--path.sysfs={sysfs}", "--collector.disable-defaults",
              "--collector.infiniband", "--collector.link", "--scrape.timeout=0.000001")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Could not check: collector infiniband failed" in out.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--thresholds=/nonexistent.yml"], "thresholds file '/nonexistent.yml': cannot read"),
    (["--interval=0"], "--interval must be positive"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag (try `gpunet-exporter doctor "
                         "--help`)"),
    (["--path.sysfs=/nonexistent"],
     "gpunet-exporter doctor: --path.sysfs '/nonexistent': no such directory"),
    # The service's flags are refused by name, not read as a request to serve.
    (["--web.listen-address=:9999"], "--web.listen-address is a flag of the exporter service"),
    (["--web.max-requests", "3"], "--web.max-requests is a flag of the exporter service"),
    (["--no-hotplug"], "--no-hotplug is a flag of the exporter service"),
])
def test_bad_input_one_line_exit_2(args: list[str], message: str) -> None:
    out = run(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stdout == ""


def test_help_lists_only_the_flags_the_doctor_uses() -> None:
    out = run("--help")
    assert out.returncode == 0
    for flag in ("--thresholds", "--interval", "--path.sysfs", "--config.file",
                 "--collector.infiniband", "--scrape.timeout", "--log.level"):
        assert flag in out.stdout
    for flag in ("--web.listen-address", "--web.config.file", "--web.telemetry-path",
                 "--web.max-requests", "--web.disable-exporter-metrics", "--hotplug"):
        assert flag not in out.stdout
    assert out.stdout.startswith("usage: gpunet-exporter doctor ")


def test_checks_name_real_alerts_and_causes() -> None:
    """Every alert a doctor check reports exists in the rules, with a root cause the report
    knows, and is among those its check declares (``@checks``) in the module of its class."""
    names = set(doctor_module.SEVERITY)
    checked = alerts_module.checked()
    assert set(checked) <= names and len(checked) == 61
    for m in alerts_module.MODULES:
        source = Path(m.__file__ or "").read_text()
        reported = set(re.findall(r'c\.add\("\w+", "(Gpunet[A-Za-z]+)"', source))
        declared = {a for step in getattr(m, "CHECKS", {}).values() for fn in step
                    for a in getattr(fn, "alerts", ())}
        assert reported <= declared, (m.__name__, reported - declared)
        assert set(re.findall(r'c\.add\("(\w+)"', source)) <= set(doctor_module.CAUSES)
    for a in alerts_module.ALERTS:
        if a.check is not None:
            assert a.check.cause in doctor_module.CAUSES and a.check.alert == a.name


def test_every_alert_has_a_doctor_check_or_a_reason() -> None:
    """Each alert is checked by the doctor (a check beside it in its class module, derived or
    hand-written, run by the doctor) or listed in its module's UNCHECKED with the reason; not
    both. Each module's checks run, every step of them."""
    checked, unchecked = alerts_module.checked(), alerts_module.unchecked()
    for a in alerts_module.ALERTS:
        assert (a.name in checked) != (a.name in unchecked), a.name
        assert a.name not in unchecked or len(unchecked[a.name]) > 20, a.name
        if a.check is not None:  # a simple alert: its declaration is its check
            assert a.check in checked[a.name], a.name
    assert set(unchecked) <= set(doctor_module.SEVERITY)
    every = [fn for m in alerts_module.MODULES for step in getattr(m, "CHECKS", {}).values()
             for fn in step]
    assert sorted(map(id, every)) == sorted(map(id, doctor_module.DOCTOR_CHECKS))


def test_a_simple_alert_gives_its_promql_and_its_check_from_one_threshold(
        tmp_path: Path) -> None:
    """GpunetPortReceiveErrors, declared once: its rule and the doctor's check read the same
    threshold, so a thresholds override moves both (no copy in the doctor)."""
    from gpunet_exporter.mixin import thresholds
    decl = link.RECEIVE_ERRORS
    t = thresholds.defaults(alerts_module.ALERT_NAMES)
    assert decl.promql(t) == "rate(gpunet_infiniband_port_receive_errors_total[5m]) > " + (
        f"{t.infiniband.receive_errors_per_second:g}")
    p = {"device": "mlx5_0", "port": "1"}
    before = {"gpunet_infiniband_port_receive_errors_total": [(p, 0.0)]}
    after = {"gpunet_infiniband_port_receive_errors_total": [(p, 200.0)]}  # 20 per second
    c = _snapshots(10.0, before, after)
    decl(c)
    assert [(f.alert, f.where, f.cause) for f in c.findings] == [
        ("GpunetPortReceiveErrors", "mlx5_0 port 1", "link")]
    assert c.findings[0].message == "20 receive errors per second (limit 10)"
    # Raised above 20 per second by a thresholds file: the rule says so, and the doctor no
    # longer finds it.
    (tmp_path / "t.yml").write_text("infiniband:\n  receive_errors_per_second: 30\n")
    c.t = thresholds.load(str(tmp_path / "t.yml"), alerts_module.ALERT_NAMES)
    assert decl.promql(c.t).endswith("> 30")
    c.findings.clear()
    decl(c)
    assert c.findings == []


def test_probe_flag_runs_one_round_through_the_nics(tmp_path: Path) -> None:
    """`doctor --probe` turns the probe on for one check: the real runner (gloo ranks on CPU,
    the same code path as NCCL) runs its net-scope round, and the doctor waits for it."""
    sysfs = st.build_dgx_h100(tmp_path / "tree")
    cfg = tmp_path / "c.yml"
    cfg.write_text("probe:\n  backend: gloo\n  nprocs: 1\n  sizes: [4096]\n  warmup: 1\n"
                   f"  iterations: 4\n  state_dir: {json.dumps(str(tmp_path / 'state'))}\n")
    out = run(f"--path.sysfs={sysfs}", f"--config.file={cfg}", "--collector.disable-defaults",
              "--collector.infiniband", "--probe", "--json", "--probe-wait", "120")
    result = json.loads(out.stdout)
    assert result["checked"].get("probe") is True, out.stderr
    net = json.loads((tmp_path / "state" / "net.json").read_text())
    assert net["success"] and net["world_size"] == 2  # one device: two ranks, net scope
    assert not (tmp_path / "state" / "intra.json").exists()


def test_probe_flag_beside_a_job_runs_nothing_and_could_not_check(tmp_path: Path) -> None:
    """`doctor --probe` on a node whose GPUs run a job (a stand-in process the NVML stand-in
    lists on GPU 1) starts no rank and says it could not check (exit 2)."""
    sysfs = st.build_dgx_h100(tmp_path / "tree")
    cfg = tmp_path / "c.yml"
    cfg.write_text("probe:\n  backend: gloo\n  nprocs: 1\n  sizes: [4096]\n  warmup: 1\n"
                   f"  iterations: 4\n  state_dir: {json.dumps(str(tmp_path / 'state'))}\n")
    job = subprocess.Popen(["sleep", "300"])
    try:
        (tmp_path / "procs").write_text(f"1 {job.pid}\n")
        scenario = tmp_path / "nvml.json"
        scenario.write_text(json.dumps(fake_nvml.h200x2()))
        env = {**fake_nvml.exporter_env(scenario),
               "GPUNET_FAKE_NVML_PROCESSES": str(tmp_path / "procs")}
        out = run(f"--path.sysfs={sysfs}", f"--config.file={cfg}",
                  "--collector.disable-defaults", "--collector.infiniband", "--probe", "--json",
                  "--probe-wait", "60", f"--nvml.module={fake_nvml.MODULE}", env=env)
    finally:
        job.kill()
        job.wait()
    assert out.returncode == 2, out.stderr
    result = json.loads(out.stdout)
    assert any("a job's processes are on the GPUs" in p for p in result["problems"]), result
    assert {"where": "probe", "message": "not run: a job's processes are on the GPUs (the probe "
            "runs only on idle GPUs)"} in result["notes"]
    assert not (tmp_path / "state" / "net.json").exists()  # no rank ever ran


def test_doctor_speaks_like_the_alerts(faulty: tuple[list[str], dict[str, str]]) -> None:
    args, env = faulty
    text = run(*args, env=env).stdout
    assert "inter probe: NCCL runs over TCP sockets although RDMA should carry it" in text
    assert ("inter probe: NCCL's network channels do not use GPUDirect RDMA while RDMA ports "
            "are up: data is staged through host memory") in text


def _snapshots(dt: float, before: dict[str, list[tuple[dict[str, str], float]]],
               after: dict[str, list[tuple[dict[str, str], float]]]) -> doctor_module.Check:
    """Two readings ``dt`` seconds apart, as the doctor takes them, with the default
    thresholds."""
    a, b = doctor_module.Snapshot([]), doctor_module.Snapshot([])
    a.samples, b.samples = before, after
    b.time = a.time + dt
    from gpunet_exporter.mixin import rules, thresholds
    return doctor_module.Check(a, b, thresholds.defaults(rules.ALERT_NAMES))


def _job_readings(moved: float, util: tuple[float, float, float] = (0.2, 0.3, 0.9),
                  state: float = 4, procs: float = 1
                  ) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One reading: three GPUs at ``util`` with ``procs`` compute processes each, one RDMA port
    in ``state`` whose byte counters stand at ``moved``."""
    port = {"device": "mlx5_0", "port": "1"}
    return {"gpunet_gpu_utilization_ratio": [({"gpu": str(g)}, u) for g, u in enumerate(util)],
            "gpunet_gpu_compute_processes": [({"gpu": str(g)}, procs) for g in range(3)],
            "gpunet_infiniband_port_state_id": [(port, state)],
            "gpunet_infiniband_port_rate_bytes_per_second": [(port, 5e10)],  # 400 Gb/s
            "gpunet_infiniband_port_transmitted_bytes_total": [(port, moved)],
            "gpunet_infiniband_port_received_bytes_total": [(port, moved)]}


@pytest.mark.parametrize("moved,state,procs,found", [
    (100.0, 4, 1, True),   # 20 B/s in 10 s: idle; GPUs 0 and 1 starved
    # 500 MB/s, 0.5 % of the 400G port (storage, the probe): still idle for a GPU job, though
    # far above the 1 MB/s the alert once took for idle (issue 34's job on sockets)
    (2.5e9, 4, 1, True),
    (1e11, 4, 1, False),   # 20 GB/s, 20 % of the port: the job's traffic is on RDMA
    (100.0, 1, 1, False),  # no ACTIVE port: not this alert's business
    (100.0, 4, 0, False),  # no compute process: nobody waits
])
def test_gpu_job_with_idle_rdma_ports(moved: float, state: float, procs: float,
                                      found: bool) -> None:
    """GpunetGpuJobRdmaIdle on the doctor's two readings, as the rule judges it (promtool
    covers the same four cases in alerts/tests/transport.test.yml)."""
    c = _snapshots(10.0, _job_readings(0.0, state=state, procs=procs),
                   _job_readings(moved, state=state, procs=procs))
    transport.check_job_rdma_idle(c)
    if not found:
        assert c.findings == []
        return
    (f,) = c.findings
    assert (f.cause, f.alert, f.where, f.severity) == (
        "nccl_tcp", "GpunetGpuJobRdmaIdle", "node", "warning")
    assert f.message.startswith("2 GPUs with compute processes (GPU 0, 1) are busy less than 50% "
                                f"while the RDMA ports move {2 * moved / 10:.3g} B/s, ")
    assert "of what they carry (idle below 2%)" in f.message
    assert "explain-log" in f.confirm


def test_phy_errors_rising_on_a_roce_interface() -> None:
    """GpunetInterfacePhyErrors: a PHY error counter of a RoCE interface that rises between the
    two readings faster than 120 an hour is a finding, one per interface; slower, or on an
    interface that is not RoCE, is not."""
    info = [({"interface": n, "link_layer": ll, "device": "", "port": ""}, 1.0)
            for n, ll in (("eth2", "Ethernet"), ("eth3", "Ethernet"), ("eth4", "Ethernet"),
                          ("ib0", "InfiniBand"))]
    before = {"gpunet_link_info": info,
              "gpunet_pfc_crc_errors_total": [({"interface": n}, 100.0)
                                              for n in ("eth2", "eth3", "eth4", "ib0")],
              "gpunet_pfc_fec_uncorrected_symbol_errors_total": [({"interface": "eth2"}, 5.0)]}
    after = {"gpunet_link_info": info,
             "gpunet_pfc_crc_errors_total": [
                 ({"interface": "eth2"}, 110.0),  # 10 in 10 s: 3600 an hour
                 ({"interface": "eth3"}, 100.0),  # flat
                 ({"interface": "eth4"}, 100.3),  # 0.3 in 10 s: 108 an hour, under 120
                 ({"interface": "ib0"}, 200.0)],  # not RoCE: GpunetPortSymbolErrors' job
             "gpunet_pfc_fec_uncorrected_symbol_errors_total": [({"interface": "eth2"}, 15.0)]}
    c = _snapshots(10.0, before, after)
    link.check_phy(c)
    assert [(f.alert, f.where, f.cause) for f in c.findings] == [
        ("GpunetInterfacePhyErrors", "eth2", "link")]
    f = c.findings[0]
    assert f.message == "3600 FEC-uncorrected symbol errors per hour (limit 120)"
    assert f.confirm.startswith("ethtool -S eth2 | grep -E 'rx_pcs_symbol_err_phy'")
    # Nothing rose: silent, as the alert on the healthy node.
    c = _snapshots(10.0, before, before)
    link.check_phy(c)
    assert c.findings == []


def test_retransmissions_rising_on_a_port() -> None:
    """GpunetRoceRetransmissions: sequence errors above 10/s or ACK timeouts above 1/s between
    the two readings, one finding per port; just under both thresholds, none."""
    def port(dev: str) -> dict[str, str]:
        return {"device": dev, "port": "1"}

    names = ("out_of_sequence_packets", "packet_sequence_error_naks",
             "implied_nak_sequence_errors", "local_ack_timeouts")
    before = {f"gpunet_infiniband_port_hw_{n}_total": [(port(d), 0.0) for d in
                                                       ("mlx5_0", "mlx5_1", "mlx5_2")]
              for n in names}
    after = {
        "gpunet_infiniband_port_hw_out_of_sequence_packets_total": [
            (port("mlx5_0"), 200.0), (port("mlx5_1"), 90.0), (port("mlx5_2"), 0.0)],
        "gpunet_infiniband_port_hw_packet_sequence_error_naks_total": [
            (port("mlx5_0"), 0.0), (port("mlx5_1"), 90.0), (port("mlx5_2"), 0.0)],
        "gpunet_infiniband_port_hw_implied_nak_sequence_errors_total": [
            (port("mlx5_0"), 0.0), (port("mlx5_1"), 90.0), (port("mlx5_2"), 0.0)],
        "gpunet_infiniband_port_hw_local_ack_timeouts_total": [
            (port("mlx5_0"), 50.0), (port("mlx5_1"), 9.0), (port("mlx5_2"), 20.0)],
    }
    c = _snapshots(10.0, before, after)
    transport.check_retransmissions(c)
    got = [(f.alert, f.where, f.message) for f in c.findings]
    assert got == [
        ("GpunetRoceRetransmissions", "mlx5_0 port 1",
         "20 out-of-sequence packets per second (limit 10)"),
        ("GpunetRoceRetransmissions", "mlx5_2 port 1", "2 ACK timeouts per second (limit 1)")]
    assert all(f.cause == "retransmit" and f.severity == "warning" for f in c.findings)
    assert "hw_counters/out_of_sequence" in c.findings[0].confirm
    c = _snapshots(10.0, before, before)
    transport.check_retransmissions(c)
    assert c.findings == []
def test_efa_peers_unresponsive_is_a_finding() -> None:
    """GpunetEfaTransportImpaired: an EFA port whose unresponsive-remote, impaired-connection or
    retransmit-timeout events rise faster than their thresholds between the two readings is a
    finding, one per port; a healthy EFA port (events flat, or just under) is silent."""
    def port(dev: str) -> dict[str, str]:
        return {"device": dev, "port": "1"}

    devs = ("rdmap79s0", "rdmap80s0", "rdmap199s0")
    names = ("unresponsive_remote_events", "impaired_remote_connection_events",
             "retransmit_timeouts")
    before = {f"gpunet_infiniband_port_hw_{n}_total": [(port(d), 3.0) for d in devs]
              for n in names}
    after = {
        "gpunet_infiniband_port_hw_unresponsive_remote_events_total": [
            (port("rdmap79s0"), 3.0), (port("rdmap80s0"), 8.0), (port("rdmap199s0"), 3.09)],
        "gpunet_infiniband_port_hw_impaired_remote_connection_events_total": [
            (port("rdmap79s0"), 3.0), (port("rdmap80s0"), 5.0), (port("rdmap199s0"), 3.09)],
        "gpunet_infiniband_port_hw_retransmit_timeouts_total": [
            (port("rdmap79s0"), 5.0), (port("rdmap80s0"), 3.0), (port("rdmap199s0"), 3.9)],
    }
    c = _snapshots(10.0, before, after)
    transport.check_efa_events(c)
    assert [(f.alert, f.where, f.message) for f in c.findings] == [
        ("GpunetEfaTransportImpaired", "rdmap80s0 port 1",
         "0.5 unresponsive-remote events per second (limit 0.01)"),
        ("GpunetEfaTransportImpaired", "rdmap79s0 port 1",
         "0.2 retransmit timeouts (path changes) per second (limit 0.1)")]
    assert all(f.cause == "retransmit" and f.severity == "warning" for f in c.findings)
    assert "hw_counters; grep . unresponsive_remote_events" in c.findings[0].confirm
    c = _snapshots(10.0, before, before)
    transport.check_efa_events(c)
    assert c.findings == []


def _plane_args(root: Path, sysfs: Path) -> list[str]:
    cfg = root / "gpunet.yml"
    cfg.write_text("link:\n  ibv_devinfo: {enabled: false}\n")
    return [f"--path.sysfs={sysfs}", "--collector.disable-defaults", "--collector.infiniband",
            "--collector.link", "--json", f"--config.file={cfg}"]


def test_multiplane_and_efa_healthy_trees_are_silent(tmp_path: Path) -> None:
    """The disabled planes of a multi-plane ConnectX-8 and the EFA ports (link layer Unknown,
    no netdev, no counters/) give no finding: exit 0 on both healthy trees."""
    for name, build in (("cx8", st.build_cx8_multiplane), ("efa", st.build_efa)):
        sysfs = build(tmp_path / name)
        out = run(*_plane_args(tmp_path / name, sysfs))
        result = json.loads(out.stdout)
        assert result["findings"] == [], (name, result["findings"])
        assert out.returncode == 0, out.stdout + out.stderr


def test_multiplane_data_plane_down_is_a_finding(tmp_path: Path) -> None:
    """A data plane down (roce_r1 port 6) is GpunetPortDown; the eight disabled planes of each
    device are not."""
    sysfs = st.build_cx8_multiplane(tmp_path / "cx8")
    st.make_plane_down(sysfs, "roce_r1", 6)
    out = run(*_plane_args(tmp_path, sysfs))
    result = json.loads(out.stdout)
    down = [(f["alert"], f["where"]) for f in result["findings"] if f["cause"] == "link"]
    assert down == [("GpunetPortDown", "roce_r1 port 6")]
    assert out.returncode == 1, out.stdout + out.stderr


def test_roce_mtu_below_minimum_and_not_expected_is_two_findings(
        faulty: tuple[list[str], dict[str, str]]) -> None:
    """A RoCE netdev at 1500 where 9000 is expected: both MTU alerts fire in Prometheus, so the
    doctor reports both."""
    args, env = faulty
    result = json.loads(run(*args, "--json", "--no-collector.probe", env=env).stdout)
    mtu = {f["alert"]: f["message"] for f in result["findings"] if f["cause"] == "mtu"}
    assert mtu["GpunetRoceMtuTooSmall"] == "RoCE interface at MTU 1500, below 4200"
    assert mtu["GpunetInterfaceMtuNotExpected"] == "MTU 1500, expected 9000"


def gpu_node(root: Path, util: list[int], procs: list[int]) -> tuple[list[str], dict[str, str]]:
    """The healthy node of the e2e test with its two GPUs at the given utilization (%) and
    compute process counts."""
    args, env, _ = build_node(root, faulty=False)
    scenario = json.loads((root / "nvml.json").read_text())
    for dev, u, n in zip(scenario["devices"], util, procs, strict=True):
        dev["nvmlDeviceGetUtilizationRates"] = {"ok": {"gpu": u, "memory": 10}}
        dev["processes"] = list(range(4000, 4000 + n))
    (root / "nvml.json").write_text(json.dumps(scenario))
    return [*args, "--no-collector.probe", "--json"], env


def test_network_bound_band_is_an_info_finding_exit_0(tmp_path: Path) -> None:
    """Both GPUs with processes at 60 % and 75 %: the network-bound band, an info finding that
    leaves the exit code at 0 (a health check must not drain a node for its job's shape)."""
    args, env = gpu_node(tmp_path, [60, 75], [2, 1])
    out = run(*args, env=env)
    result = json.loads(out.stdout)
    assert [(f["alert"], f["severity"], f["where"]) for f in result["findings"]] == [
        ("GpunetGpusNetworkBoundBand", "info", "node")]
    assert result["findings"][0]["message"].startswith(
        "2 of 2 GPUs running compute processes are 50% to 80% busy")
    assert "the alert averages 30m" in result["findings"][0]["message"]
    assert out.returncode == result["exit_code"] == 0 and result["status"] == "healthy"


def test_thresholds_file_turns_an_alert_off_or_changes_its_severity(tmp_path: Path) -> None:
    """The thresholds file's `severity` and `enabled` apply to the doctor's findings as to the
    rules: the band made a warning fails the check (exit 1), in JSON and in the report; turned
    off, it is not reported at all."""
    args, env = gpu_node(tmp_path, [60, 75], [2, 1])
    band = "GpunetGpusNetworkBoundBand"
    (tmp_path / "t.yml").write_text(f"severity: {{{band}: warning}}\n")
    out = run(*args, f"--thresholds={tmp_path / 't.yml'}", env=env)
    result = json.loads(out.stdout)
    assert [(f["alert"], f["severity"], f["fault"]) for f in result["findings"]] == [
        (band, "warning", True)]
    assert out.returncode == result["exit_code"] == 1
    text = run(*[a for a in args if a != "--json"], f"--thresholds={tmp_path / 't.yml'}",
               env=env)
    assert "  [warning] node: " in text.stdout and text.returncode == 1
    (tmp_path / "t.yml").write_text(f"enabled: {{{band}: false}}\nseverity: {{{band}: critical}}\n")
    out = run(*args, f"--thresholds={tmp_path / 't.yml'}", env=env)
    result = json.loads(out.stdout)
    assert result["findings"] == [] and out.returncode == result["exit_code"] == 0


def test_starved_gpu_is_a_finding_and_below_the_share_no_band(tmp_path: Path) -> None:
    """GPU 0 at 20 % with a process: GpunetGpuStarved (exit 1); GPU 1 at 70 % is then one of
    two busy GPUs in the band, under the 75 % share: no band finding. Idle GPUs count for
    neither."""
    args, env = gpu_node(tmp_path, [20, 70], [1, 1])
    out = run(*args, env=env)
    result = json.loads(out.stdout)
    # The fixture's RDMA counters stand still: a starved job beside idle RDMA ports, too.
    assert sorted((f["alert"], f["where"]) for f in result["findings"]) == [
        ("GpunetGpuJobRdmaIdle", "node"), ("GpunetGpuStarved", "GPU 0")]
    (starved,) = [f for f in result["findings"] if f["alert"] == "GpunetGpuStarved"]
    assert starved["message"].startswith(
        "busy only 20% of the time while compute processes run on it (limit 50%")
    assert out.returncode == 1
    idle, env = gpu_node(tmp_path / "idle", [20, 70], [0, 0])
    assert json.loads(run(*idle, env=env).stdout)["findings"] == []


def ib_tree(root: Path) -> tuple[Path, list[str]]:
    """The DGX tree and the doctor's arguments for its ports' counters. ibv_devinfo is switched
    off, as where InfiniBand MTUs are checked another way: these tests are about the counters
    (test_ib_mtu_without_ibv_devinfo_is_not_checked_exit_2 about the tool)."""
    sysfs = st.build_dgx_h100(root / "tree")
    cfg = root / "gpunet.yml"
    cfg.write_text("link:\n  ibv_devinfo: {enabled: false}\n")
    return sysfs, [f"--path.sysfs={sysfs}", "--collector.disable-defaults",
                   "--collector.infiniband", "--collector.link", "--json",
                   f"--config.file={cfg}", f"--state-file={root / 'state' / 'doctor.json'}"]


def test_rail_nic_in_the_wrong_slot_is_a_finding(tmp_path: Path) -> None:
    """GPU 0's rail NIC on the other socket (sysfs_tree.build_rail_misplaced), the storage NICs
    excluded from the rails as the example configuration does: one finding, exit 1."""
    sysfs = st.build_rail_misplaced(tmp_path / "tree")
    cfg = tmp_path / "gpunet.yml"
    cfg.write_text("topology:\n  rail_exclude: '^mlx5_(8|9)$'\n")
    proc = st.build_procfs(tmp_path / "tree")
    out = run(f"--path.sysfs={sysfs}", f"--path.procfs={proc}",
              f"--config.file={cfg}", "--collector.disable-defaults", "--collector.infiniband",
              "--collector.topology", "--json", "--nvml.module=no_such_nvml_module")
    result = json.loads(out.stdout)
    (found,) = [f for f in result["findings"] if f["alert"] == "GpunetRailMapShared"]
    assert found["message"] == "mlx5_1 is the nearest rail of 2 GPUs, while mlx5_0 serves none"
    assert out.returncode == 1, out.stdout + out.stderr


def test_ib_mtu_without_ibv_devinfo_is_not_checked_exit_2(tmp_path: Path) -> None:
    """InfiniBand ports and no ibv_devinfo: the doctor says their MTU was not checked, and
    why, and exits 2 (could not check), not 0."""
    sysfs = st.build_dgx_h100(tmp_path / "tree")
    cfg = tmp_path / "gpunet.yml"
    cfg.write_text(f"link:\n  ibv_devinfo: {{path: {tmp_path / 'not-installed'}}}\n")
    out = run(f"--path.sysfs={sysfs}", f"--config.file={cfg}", "--collector.disable-defaults",
              "--collector.link", "--json", f"--state-file={tmp_path / 'doctor.json'}")
    result = json.loads(out.stdout)
    (found,) = [f for f in result["findings"] if f["cause"] == "unknown"]
    assert (found["alert"], found["where"]) == ("GpunetCheckUnknown", "link ib_mtu")
    assert found["message"] == "not checked: its command-line tool is not installed"
    assert "ibv_devinfo" in found["confirm"]
    assert out.returncode == 2, out.stdout + out.stderr


def test_pfc_without_a_qos_source_is_not_checked_exit_2(tmp_path: Path) -> None:
    """RoCE ports and no QoS source: the text report lists the check under "could not check",
    names the collector UNKNOWN, not ok, in its "Checked:" line, and exits 2."""
    sysfs = st.build_roce_only(tmp_path / "tree")
    cfg = tmp_path / "gpunet.yml"
    cfg.write_text(f"pfc:\n  config: {{mlnx_qos_path: {tmp_path / 'no'}, "
                   f"dcb_path: {tmp_path / 'no'}}}\n")
    out = run(f"--path.sysfs={sysfs}", f"--config.file={cfg}", "--collector.disable-defaults",
              "--collector.infiniband", "--collector.pfc", f"--state-file={tmp_path / 'd.json'}")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "  [warning] pfc pfc_config: not checked: its command-line tool is not installed\n" \
        "      confirm: command -v mlnx_qos dcb" in out.stdout
    assert "Checked: infiniband (ok), pfc (UNKNOWN: pfc_config not checked)\n" in out.stdout
    assert ("Could not check: pfc: pfc_config not checked: its command-line tool is not "
            "installed") in out.stdout


def test_flaps_since_the_last_run_are_findings(tmp_path: Path) -> None:
    """Run, bump the counters as two link-downed events and four carrier changes would, run
    again: the second run names the counts since the first, as the flapping alerts would fire;
    one more link-downed event is a note only (below the alert's count)."""
    sysfs, args = ib_tree(tmp_path)
    first = run(*args)
    assert first.returncode == 0 and json.loads(first.stdout)["notes"] == []
    downed = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters" / "link_downed"
    netdev = st._netdev(sysfs, "mlx5_1")
    downed.write_text("2\n")
    (netdev / "carrier_changes").write_text("6\n")  # 2 at boot, then 4
    second = run(*args)
    result = json.loads(second.stdout)
    found = {f["alert"]: f for f in result["findings"]}
    assert set(found) == {"GpunetPortFlapping", "GpunetInterfaceFlapping"}
    assert found["GpunetPortFlapping"]["where"] == "mlx5_0 port 1"
    assert re.fullmatch(r"2 link-downed events since the doctor run at \S+ \S+ \S+ \(the alert "
                        r"fires from 2 within 24h\)", found["GpunetPortFlapping"]["message"])
    assert found["GpunetInterfaceFlapping"]["message"].startswith(
        "4 carrier changes since the doctor run at ")
    assert second.returncode == 1
    # The counts run from the first run while it is within the window: a third run still finds
    # them; a third link-downed event on another port is one, below the alert's two: a note.
    (sysfs / "class" / "infiniband" / "mlx5_2" / "ports" / "1" / "counters" / "link_downed"
     ).write_text("1\n")
    third = json.loads(run(*args).stdout)
    assert {f["alert"] for f in third["findings"]} == set(found)
    (note,) = [f"{n['where']}: {n['message']}" for n in third["notes"]]
    assert note.startswith("mlx5_2 port 1: 1 link-downed events since the doctor run at ")
    assert note.endswith("(GpunetPortFlapping counts 2 within 24h)")


def test_counter_reset_starts_the_history_over(tmp_path: Path) -> None:
    sysfs, args = ib_tree(tmp_path)
    downed = sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters" / "link_downed"
    downed.write_text("5\n")
    run(*args)
    downed.write_text("1\n")  # perfquery -R, then one event
    result = json.loads(run(*args).stdout)
    assert result["findings"] == [] and result["notes"] == []


def test_large_count_since_boot_is_a_note_exit_0(tmp_path: Path) -> None:
    """First run, no history: 7 link-downed events since boot could be last week's; a note,
    no finding, exit 0. The text report lists it under its own heading."""
    sysfs, args = ib_tree(tmp_path)
    (sysfs / "class" / "infiniband" / "mlx5_0" / "ports" / "1" / "counters" / "link_downed"
     ).write_text("7\n")
    out = run(*args)
    result = json.loads(out.stdout)
    assert out.returncode == 0 and result["findings"] == []
    assert result["notes"] == [{"where": "mlx5_0 port 1", "message":
        "7 link-downed events since boot (or since the counters were cleared), "
        "at times the doctor cannot tell (GpunetPortFlapping counts 2 within 24h)"}]
    text = run(*[a for a in args if a != "--json"]).stdout
    assert ("No findings on this node.\n\nNotes (no finding, no effect on the exit code):\n"
            "  mlx5_0 port 1: 7 ") in text


@pytest.mark.parametrize("state", ["/proc/gpunet/doctor.json", "{tmp}/bad.json"])
def test_unusable_state_file_is_one_note(tmp_path: Path, state: str) -> None:
    """A state file that cannot be written (or read) costs the history, never the check."""
    _, args = ib_tree(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    out = run(*args, f"--state-file={state.format(tmp=tmp_path)}")
    result = json.loads(out.stdout)
    assert out.returncode == 0 and "Traceback" not in out.stderr and out.stderr == ""
    (note,) = [f"{n['where']}: {n['message']}" for n in result["notes"]]
    assert ("cannot record the counters in /proc/gpunet/doctor.json (" in note
            if state.startswith("/proc") else "bad.json ignored (" in note), note


def test_history_keeps_what_a_count_needs() -> None:
    """Of a run of equal values the first and last observation; of those older than the window
    only the newest; after a counter's fall only what follows it."""
    compact, since_reset = doctor_module._compact, link.since_reset
    obs = [[0.0, 0.0], [10.0, 0.0], [20.0, 0.0], [30.0, 2.0], [40.0, 2.0], [50.0, 2.0]]
    assert compact(obs, horizon=5) == [[0, 0], [20, 0], [30, 2], [50, 2]]
    assert compact(obs, horizon=25) == [[20, 0], [30, 2], [50, 2]]
    assert since_reset([[0.0, 5.0], [10.0, 0.0], [20.0, 1.0]], 3) == [[10, 0], [20, 1]]
    assert since_reset([[0.0, 5.0]], 1) == []
    assert doctor_module.seconds("1h30m") == 5400 and doctor_module.seconds("24h") == 86400
def test_unreadable_pfc_configuration_could_not_check(tmp_path: Path) -> None:
    """A RoCE interface whose QoS configuration cannot be read: the finding that mirrors
    GpunetPfcConfigUnreadable, a `problems` entry, and exit 2 (could not check), not 1."""
    args, env, netdev = build_node(tmp_path, faulty=False)
    (tmp_path / "mlnx_qos").write_text("#!/bin/sh\necho 'Netlink error: no such device' >&2\n"
                                       "exit 1\n")
    out = run(*args, "--json", "--no-collector.probe", env=env)
    result = json.loads(out.stdout)
    assert {f["alert"] for f in result["findings"]} == {"GpunetPfcConfigUnreadable"}
    where = sorted(f["where"] for f in result["findings"])
    assert netdev in where and len(where) == 2  # both RoCE netdevs of the tree
    assert sorted(result["problems"]) == [f"PFC on {n}: its QoS configuration cannot be read"
                                          for n in where]
    assert out.returncode == result["exit_code"] == 2
    assert result["status"] == "could_not_check"


def test_inventory_is_read_not_learned(tmp_path: Path) -> None:
    """The doctor reads the exporter's learned inventory and never writes it: run on a healthy
    node without a state file, it leaves none behind; with one naming a device the tree lacks,
    it finds it gone."""
    args, env, _ = build_node(tmp_path, faulty=False)
    state = tmp_path / "inventory.json"
    out = run(*args, "--json", "--no-collector.probe", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not state.exists()
    state.write_text(json.dumps({"version": 1, "rdma_device": ["mlx5_0", "mlx5_77"],
                                 "rdma_port": ["mlx5_77/1"], "netdev": []}))
    before = state.read_bytes()
    out = run(*args, "--json", "--no-collector.probe", env=env)
    result = json.loads(out.stdout)
    assert {(f["alert"], f["where"], f["message"]) for f in result["findings"]} == {
        ("GpunetRdmaDeviceMissing", "rdma_device", "1 expected rdma_device gone: mlx5_77"),
        ("GpunetRdmaDeviceMissing", "rdma_port", "1 expected rdma_port gone: mlx5_77/1")}
    assert out.returncode == 1 and state.read_bytes() == before
def test_settings_are_notes_not_findings(tmp_path: Path) -> None:
    """Issue 16: a good job's NCCL settings (bootstrap on the management bond, a forced
    algorithm) are printed as notes and leave the exit code at 0; a fault in the same process is
    a finding (exit 1) and is not repeated as a note."""
    args, env, _ = build_node(tmp_path, faulty=False)
    out = run(*args, "--no-collector.probe", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.startswith(
        "No findings on this node.\n\nNotes (no finding, no effect on the exit code):\n")
    assert ("  NCCL_SOCKET_IFNAME: 1 GPU processes set it (non_rdma_netdev): bootstrap and "
            "NCCL's socket traffic on a non-RDMA interface") in text
    assert "  NCCL_ALGO: 1 GPU processes set it (ring): forcing algorithms" in text
    st.write_process(tmp_path / "proc", HEALTHY_JOB_PID,
                     {**HEALTHY_JOB_ENV, "NCCL_IB_DISABLE": "1"})
    out = run(*args, "--no-collector.probe", "--json", env=env)
    result = json.loads(out.stdout)
    assert out.returncode == result["exit_code"] == 1
    assert [(f["alert"], f["where"]) for f in result["findings"]] == [
        ("GpunetNcclEnvDisablesFastPath", "NCCL_IB_DISABLE")]
    assert {n["where"] for n in result["notes"]} == {"NCCL_SOCKET_IFNAME", "NCCL_ALGO"}


def test_nccl_jobs_in_operators_words(faulty: tuple[list[str], dict[str, str]]) -> None:
    """The faulty node's three NCCL jobs (stand-in RAS servers replaying the GPU machine's
    captures): a dead process, a rank stuck 20 operations behind (counts compared across the
    two reports the doctor asks for) and a port whose one listener never answers; each a finding
    of its alert, and the two jobs that answered described in notes."""
    args, env = faulty
    result = json.loads(run(*args, "--json", "--no-collector.probe", env=env).stdout)
    config = Path(next(a for a in args if a.startswith("--config.file=")).split("=", 1)[1])
    ports = re.search(r"ports: \[(.*?)\]", config.read_text()).group(1).split(", ")
    dead, stuck, stopped = (f"NCCL job on RAS port {p}" for p in ports)
    jobs = {(f["alert"], f["where"]): f["message"] for f in result["findings"]
            if f["cause"] == "nccl_job"}
    assert jobs == {
        ("GpunetNcclRankDead", dead): "1 process of the job is considered dead by RAS: the job "
                                      "waits for it or is about to fail",
        ("GpunetNcclRankStalled", stuck): "1 rank launches no more collectives, up to 20 "
                                          "operations behind the other ranks of the "
                                          "communicator, which wait for them",
        ("GpunetNcclRasUnreachable", stopped): "1 NCCL process listens on the port but none gave "
                                               "a report (12 connections accepted and never "
                                               "answered: a stopped or hung process); the "
                                               "job's health is unknown",
    }
    notes = {n["where"]: n["message"] for n in result["notes"]}
    assert notes[dead] == ("NCCL 2.28.9: 2 processes on 1 node with 1 GPU; 1 communicator "
                           "running; 1 of 2 ranks answered; 1 process dead, 1 communicator "
                           "without progress since the previous report (idle, or hung as a "
                           "whole)")
    assert notes[stuck].endswith("2 of 2 ranks answered; 1 rank stuck, 1 communicator without "
                                 "progress since the previous report (idle, or hung as a whole)")
    assert stopped not in notes


def _ras(port: str, *, listeners: float, ok: float | None, **values: float
         ) -> dict[str, list[tuple[dict[str, str], float]]]:
    """One port's nccl collector readings: ``values`` maps a metric (without gpunet_nccl_) and
    label state or reason, joined by ':', to its value."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {
        "gpunet_nccl_ras_listeners": [({"port": port}, listeners)]}
    if ok is not None:
        out["gpunet_nccl_ras_query_success"] = [({"port": port}, ok)]
    for key, v in values.items():
        name, _, label = key.partition(":")
        lbl = {"port": port}
        if label:
            lbl["reason" if name == "missing_ranks" else "state"] = label
        out.setdefault(f"gpunet_nccl_{name}", []).append((lbl, v))
    return out


@pytest.mark.parametrize("readings,alerts,note", [
    # No job: nothing listens, nothing asked; no finding, no note.
    (_ras("28028", listeners=0, ok=None), set(), False),
    # A text report (NCCL before 2.28.7): two ranks unreachable, nothing dead.
    (_ras("28028", listeners=4, ok=1, **{"missing_ranks:unreachable": 2,
                                          "job_processes:answering": 6, "job_nodes": 2}),
     {"GpunetNcclRankUnreachable"}, True),
    # Listening, the query failed: unreachable RAS, and no job figures judged from old values.
    (_ras("28028", listeners=2, ok=0, **{"job_processes:dead": 1}),
     {"GpunetNcclRasUnreachable"}, False),
    # A healthy job: a note only.
    (_ras("28028", listeners=2, ok=1, **{"job_processes:answering": 2, "stalled_ranks": 0}),
     set(), True),
])
def test_nccl_job_findings_follow_the_alerts(
        readings: dict[str, list[tuple[dict[str, str], float]]], alerts: set[str],
        note: bool) -> None:
    c = _snapshots(5.0, readings, readings)
    collective.check_nccl_jobs(c)
    assert {f.alert for f in c.findings} == alerts
    assert all(f.cause == "nccl_job" and f.where == "NCCL job on RAS port 28028"
               for f in c.findings)
    assert [n.where for n in c.notes] == (["NCCL job on RAS port 28028"] if note else [])


def test_a_jobs_trouble_is_listed_but_does_not_fail_the_node(tmp_path: Path) -> None:
    """A healthy node running a job one of whose processes died elsewhere: the finding is
    listed, yet the exit code stays 0 (every node of the job reports the same dead process; a
    health check must not drain them all)."""
    job = Server(Behaviour(json=(RAS / "dead.json").read_text())).start()
    try:
        args, env, _ = build_node(tmp_path, faulty=False, ras_ports=[job.port])
        out = run(*args, "--json", "--no-collector.probe", env=env)
        text = run(*args, "--no-collector.probe", env=env).stdout
    finally:
        job.stop()
    result = json.loads(out.stdout)
    assert [(f["alert"], f["cause"]) for f in result["findings"]] == [
        ("GpunetNcclRankDead", "nccl_job")]
    assert (out.returncode, result["status"], result["exit_code"]) == (0, "healthy", 0)
    assert text.startswith("1 finding on this node:")
    assert "the job's, not the node's: no effect on the exit code" in text


def _example(tree: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The doctor on an example tree as examples/README.md runs it: from the repository root,
    with the tree's configuration and no --state-file."""
    return subprocess.run([exporter_binary(), "doctor", "--interval", "0.2",
                           "--path.sysfs", f"examples/{tree}/sys",
                           "--config.file", f"examples/{tree}/gpunet.yml", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)


def test_healthy_example_tree_exits_0() -> None:
    out = _example("dgx-h100")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("No findings on this node.")
    # Only what the tree holds: the collectors that would read the host are off.
    assert "Checked: infiniband (ok), link (ok), nic (ok), pfc (ok)" in out.stdout


def test_faulty_example_tree_finds_every_planted_fault() -> None:
    """examples/README.md's four faults, PFC included: the tree's gpunet.yml points the pfc
    collector at the node's mlnx_qos replay."""
    out = _example("dgx-h100-faulty", "--json")
    assert out.returncode == 1, out.stderr
    doc = json.loads(out.stdout)
    found = {(f["alert"], f["where"]) for f in doc["findings"]}
    assert {("GpunetPortRateBelowExpected", "mlx5_5 port 1"),
            ("GpunetPortDown", "mlx5_3 port 1"),
            ("GpunetRoceMtuTooSmall", "enp41s0f0np0"),
            ("GpunetRdmaMtuNotExpected", "mlx5_8 port 1"),
            ("GpunetPfcDisabledOnRocePriority", "enp170s0f0np0"),
            ("GpunetPfcTrustNotExpected", "enp170s0f0np0"),
            # the nic collector's, through the tree's ethtool -m and devlink replays
            ("GpunetTransceiverRxPowerLow", "enp170s0f0np0 lane 3"),
            ("GpunetTransceiverTemperatureHigh", "enp41s0f0np0"),
            ("GpunetNicHealthReporterError", "mlx5_7 fw_fatal")} <= found
    assert doc["problems"] == []
    assert not any(f["alert"] == "GpunetPfcConfigUnreadable" for f in doc["findings"])
    rate = next(f for f in doc["findings"] if f["alert"] == "GpunetPortRateBelowExpected")
    assert rate["confirm"] == ("cat examples/dgx-h100-faulty/sys/class/infiniband/mlx5_5/ports/1/"
                               "rate")


def test_tree_not_sys_keeps_no_state_unless_asked(tmp_path: Path) -> None:
    """On a tree other than /sys and without --state-file, no history is read or written (the
    default file holds this node's counters) and a note says so; --state-file keeps one."""
    out = _example("dgx-h100")
    assert out.returncode == 0, out.stderr
    assert ("state file: none kept: --path.sysfs examples/dgx-h100/sys is not /sys, so no flap "
            "history is read or written (--state-file FILE keeps one)") in out.stdout
    assert "cannot record" not in out.stdout
    state = tmp_path / "doctor.json"
    out = _example("dgx-h100", f"--state-file={state}")
    assert out.returncode == 0, out.stderr
    assert "none kept" not in out.stdout
    assert json.loads(state.read_text())["version"] == 1


def test_state_file_default_follows_the_sysfs_tree(tmp_path: Path) -> None:
    assert doctor_module.state_file(None, "/sys") == (doctor_module.DEFAULT_STATE, None)
    assert doctor_module.state_file(None, "/sys/") == (doctor_module.DEFAULT_STATE, None)
    path, note = doctor_module.state_file(None, str(tmp_path))
    assert path == "" and note and str(tmp_path) in note
    assert doctor_module.state_file("x.json", str(tmp_path)) == ("x.json", None)
    assert doctor_module.state_file("", "/sys") == ("", None)


def test_confirm_names_the_trees_in_use() -> None:
    on_tree = doctor_module.on_tree
    cmd = "cat /sys/class/infiniband/mlx5_5/ports/1/rate"
    assert on_tree(cmd, "/sys", "/proc") == cmd
    assert on_tree(cmd, "/sys/", "/proc") == cmd
    assert on_tree(cmd, "t/sys", "/proc") == "cat t/sys/class/infiniband/mlx5_5/ports/1/rate"
    assert on_tree(cmd, "/my tree", "/proc") == \
        "cat '/my tree'/class/infiniband/mlx5_5/ports/1/rate"
    # Only a path of its own: not /sysfs, not /var/sys, not ibstat's words.
    for other in ("ls /sysfs/x", "cat /var/sys/x", "ibstat mlx5_3 1"):
        assert on_tree(other, "t", "p") == other
    env = "tr '\\0' '\\n' < /proc/PID/environ | grep ^NCCL_"
    assert on_tree(env, "t", "/fix/proc") == env.replace("/proc", "/fix/proc")
