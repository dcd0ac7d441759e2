"""`gpunet-exporter doctor`: the installed console script on fixture nodes. Its agreement with the
Prometheus rules on the same nodes is tests/test_alerts_e2e.py::test_doctor_agrees_with_prometheus.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from exporter import doctor as doctor_module

import sysfs_tree as st
from conftest import exporter_binary
from test_alerts_e2e import HEALTHY_JOB_ENV, HEALTHY_JOB_PID, build_node


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exporter_binary(), "doctor", "--interval", "0.5", *args],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], dict[str, str]]:
    args, env, _ = build_node(tmp_path_factory.mktemp("faulty"), faulty=True)
    return args, env


def test_report_groups_findings_by_cause(faulty: tuple[list[str], dict[str, str]]) -> None:
    args, env = faulty
    out = run(*args, env=env)
    assert out.returncode == 1, out.stderr
    text = out.stdout
    assert text.startswith("12 findings on this node:")
    # Causes in the report's order, each with its findings, device and confirming command.
    positions = [text.index(title) for title in (
        "NCCL on TCP sockets", "GPUDirect RDMA off", "Degraded or flapping link",
        "PFC or ECN misconfigured", "MTU", "GPU and NIC placement", "Degraded GPU PCIe link",
        "GPU faults", "Slow collectives")]
    assert positions == sorted(positions)
    assert "[critical] mlx5_5 port 1: runs at 200 Gb/s, expected 400 Gb/s" in text
    assert "confirm: cat /sys/class/infiniband/mlx5_5/ports/1/rate" in text
    assert "[critical] enp170s0f0np0: PFC off on priority 3, the one RoCE uses" in text
    assert "[warning] GPU 0: PCIe Gen5 x8, capable of Gen5 x16" in text
    assert "docs/runbooks.md#gpunetgdrnotready (alert GpunetGdrNotReady)" in text
    assert text.rstrip().endswith("topology (ok)")
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
    assert len(alerts) == 10
    assert "GpunetPfcDisabledOnRocePriority" not in alerts
    assert "GpunetAllreduceLatencyHigh" not in alerts
    assert result["exit_code"] == out.returncode == 1


def test_json_shape(faulty: tuple[list[str], dict[str, str]]) -> None:
    args, env = faulty
    out = run(*args, "--json", "--no-collector.probe", env=env)
    result = json.loads(out.stdout)
    assert out.stderr == ""  # --json: nothing but the document
    assert set(result) == {"status", "exit_code", "findings", "notes", "checked", "problems"}
    lost = next(f for f in result["findings"] if f["alert"] == "GpunetGpuLost")
    assert lost == {"cause": "gpu", "alert": "GpunetGpuLost", "where": "GPU 1",
                    "message": "fallen off the bus (GPU is lost)", "severity": "critical",
                    "confirm": "nvidia-smi; dmesg | grep -i -E 'xid|fallen off'"}
    assert "probe" not in result["checked"]


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
    knows; the doctor reads the same threshold keys (a typo would raise KeyError here)."""
    names = set(doctor_module.SEVERITY)
    source = Path(doctor_module.__file__).read_text()
    used = set(re.findall(r'"(Gpunet[A-Za-z]+)"', source))
    assert used <= names and len(used) == 38
    causes = set(re.findall(r'c\.add\("(\w+)"', source))
    assert causes <= set(doctor_module.CAUSES)


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


def test_doctor_speaks_like_the_alerts(faulty: tuple[list[str], dict[str, str]]) -> None:
    args, env = faulty
    text = run(*args, env=env).stdout
    assert "inter probe: NCCL runs over TCP sockets although RDMA should carry it" in text
    assert ("inter probe: NCCL's network channels do not use GPUDirect RDMA while RDMA ports "
            "are up: data is staged through host memory") in text


def test_settings_are_notes_not_findings(tmp_path: Path) -> None:
    """Issue 16: a good job's NCCL settings (bootstrap on the management bond, a forced
    algorithm) are printed as notes and leave the exit code at 0; a fault in the same process is
    a finding (exit 1) and is not repeated as a note."""
    args, env, _ = build_node(tmp_path, faulty=False)
    out = run(*args, "--no-collector.probe", env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert text.startswith("No findings on this node.\n\nSettings (notes, not findings):\n")
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
