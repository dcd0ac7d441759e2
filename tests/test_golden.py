"""Golden end-to-end test: the installed exporter on a DGX H100 tree with every fault variant.

One exporter (the installed console script) serves a DGX tree (with its GPUs and PCIe switches)
with all fault variants of sysfs_tree applied except make_unreadable (its result depends on
running as root), a procfs with two GPU processes whose environment turns NCCL's fast paths off,
NVML replayed by tests/support/fake_nvml.py from the real H200 capture (its two GPUs placed at
the DGX tree's first two GPU addresses, one XID event delivered), and a config with an expected
rate and an expected MTU rule. Its /metrics, minus what varies from run to run (durations, ages,
versions, the values of the exporter's own process_* and python_* series) and minus HELP text,
sorted, must equal tests/fixtures/golden/dgx-h100-faults.prom.

Regenerate the golden file with GPUNET_UPDATE_GOLDEN=1 (the test then rewrites it and passes);
test_facts checks the meaning of the same scrape independently of the golden file, so a wrong
regeneration is caught even when the reviewer skims the diff. test_promtool lints the raw scrape.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunet_exporter.collectors.infiniband import COUNTER_SPECS

from support import fake_nvml, nic, paths
from support import sysfs_tree as st
from support.exporter import Exporter
from support.metrics import Samples, parse, series, value
from support.paths import FIXTURES, REPO
from support.wait import wait_for

GOLDEN = paths.GOLDEN / "dgx-h100-faults.prom"
UPDATE = os.environ.get("GPUNET_UPDATE_GOLDEN") == "1"

CONFIG = """\
infiniband:
  expected_rate:
    - {link_layer: InfiniBand, gbps: 400}
link:
  expected_mtu:
    - {link_layer: Ethernet, mtu: 9000}
  ibv_devinfo: {enabled: false}   # keep the host's ibv_devinfo (if any) out of the output
pfc:
  stats_source: ethtool             # a stand-in ethtool: the host has no such interfaces
  ethtool: {path: ETHTOOL}
  config: {sources: [sysfs]}        # MLNX_OFED qos/ files on mlx5_9's netdev; no host tools
nccl:
  ports: [1]                        # keep the host's NCCL jobs out: nothing listens on port 1
nic:                                # stand-ins: the host has no such modules or devlink devices
  infiniband_transceivers: false    # IPoIB cannot read modules: left out, not unknown
  eeprom_source: ethtool
  ethtool: {path: XCVR_ETHTOOL}
  health_source: devlink
  devlink: {path: XCVR_DEVLINK}
"""
# Stand-in for `ethtool -S`: the synthetic mlx5 capture (PFC on priority 3) for mlx5_9's
# netdev; for mlx5_8's it fails as ethtool does for a device it cannot read.
ETHTOOL = """\
#!/bin/sh
[ "$1" = -S ] && [ "$2" = {netdev} ] && exec cat {capture}
echo "Cannot get stats strings information: Operation not supported" >&2
exit 94
"""
CAPTURE = FIXTURES / "synthetic" / "ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt"

# Families whose values depend on time; dropped from the golden comparison.
TIME_BASED = {"gpunet_scrape_collector_duration_seconds",
              "gpunet_link_ibv_devinfo_last_success_timestamp_seconds",
              "gpunet_pfc_config_last_success_timestamp_seconds",
              "gpunet_gpu_counters_last_success_timestamp_seconds",
              "gpunet_gpu_xid_last_timestamp_seconds",
              "gpunet_nic_transceiver_last_success_timestamp_seconds",
              "gpunet_nic_health_last_success_timestamp_seconds",
              # open connections: the start-up check's may not have closed yet
              "gpunet_exporter_http_connections"}
# Families whose labels carry versions; kept, with their labels dropped.
VERSIONED = {"gpunet_exporter_build_info", "python_info"}
# The exporter's own process and interpreter (prometheus_client): kept without their values.
OWN_PROCESS = ("process_", "python_")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")

DOWN, DEGRADED, SATURATED, NO_PMA = "mlx5_3", "mlx5_5", "mlx5_1", "mlx5_2"
GARBAGE, NO_HW, MTU_1500, DANGLING = "mlx5_6", "mlx5_7", "mlx5_8", "mlx5_10"
SWITCHDEV = "mlx5_9"  # the only device with a device-level hw_counters/ directory
# Files make_counters_saturated sets to the all-ones value of their PMA field width.
SATURATED_FILES = {"symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
                   "local_link_integrity_errors", "excessive_buffer_overrun_errors",
                   "port_xmit_wait"}
DEVICES = [n.ibdev for n in st.DGX_NICS]
ACS_GPU_BUS = 0x43  # GPU 1's switch downstream port redirects peer-to-peer requests
# GPU processes (pid -> environment) and the NVML GPU each runs on.
PROCESSES = {31337: ({"NCCL_IB_DISABLE": "1", "NCCL_DEBUG": "INFO"}, 0),
             31338: ({"NCCL_IB_HCA": "=mlx5_0,mlx5_99", "NCCL_P2P_DISABLE": "1"}, 1)}


class Scrape:
    def __init__(self, sysfs: Path, text: str) -> None:
        self.sysfs = sysfs
        self.text = text
        self.samples: Samples = parse(text)


@pytest.fixture(scope="module")
def scrape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scrape]:
    root = tmp_path_factory.mktemp("golden")
    sysfs = st.build_dgx_h100_gpus(root)
    st.make_port_down(sysfs, DOWN)
    st.make_port_degraded(sysfs, DEGRADED)
    st.make_counters_saturated(sysfs, SATURATED)
    st.make_no_pma(sysfs, NO_PMA)
    st.make_mtu_1500(sysfs, MTU_1500)
    st.add_dangling_device(sysfs, DANGLING)
    st.make_garbage(sysfs, GARBAGE)
    st.make_missing_hw_counters(sysfs, NO_HW)
    st.make_switchdev(sysfs, SWITCHDEV)
    qos_netdev = st.make_ofed_qos(sysfs, SWITCHDEV)
    st.make_acs_enabled(sysfs, ACS_GPU_BUS)
    st.make_peermem_unloaded(sysfs)
    procfs = st.build_procfs(root, nvidia=st.NVRM_PROPRIETARY)  # no DMA-BUF: GDR not ready
    scenario = fake_nvml.h200x2()
    for i, (pid, (environ, gpu)) in enumerate(PROCESSES.items()):
        st.write_process(procfs, pid, environ, starttime=1000 + i)
        scenario["devices"][gpu]["processes"] = [pid]
    for dev, bus in zip(scenario["devices"], st.DGX_GPU_BUSES, strict=False):
        dev["nvmlDeviceGetPciInfo"]["ok"]["busId"] = f"00000000:{bus:02X}:00.0"
    (root / "nvml.json").write_text(json.dumps(scenario))
    (root / "xid-events").write_text("1 79\n")
    ethtool = root / "ethtool"
    ethtool.write_text(ETHTOOL.format(netdev=qos_netdev, capture=CAPTURE))
    ethtool.chmod(0o755)
    # The RoCE netdevs' modules: an OSFP with lane 3 in low light on mlx5_8's, a QSFP56 on
    # mlx5_9's; every device's mlx5 reporters, the fw_fatal one of mlx5_0 in error.
    low = list(nic.HEALTHY_RX_MW)
    low[2] = nic.LOW_RX_MW
    pci = {d: os.path.basename(os.path.realpath(sysfs / "class/infiniband" / d / "device"))
           for d in DEVICES}
    xcvr_ethtool, xcvr_devlink = nic.write_replay(
        root / "nic", {st._netdev(sysfs, MTU_1500).name: nic.cmis_osfp(rx_mw=low),
                       qos_netdev: nic.sff8636_qsfp56()},
        nic.reporters(sorted(pci.values()), {(pci["mlx5_0"], "fw_fatal"): 1}))
    config = root / "config.yml"
    config.write_text(CONFIG.replace("XCVR_ETHTOOL", str(xcvr_ethtool)).replace(
        "XCVR_DEVLINK", str(xcvr_devlink)).replace("ETHTOOL", str(ethtool)))
    exporter = Exporter(
        [f"--path.sysfs={sysfs}", f"--path.procfs={procfs}", f"--config.file={config}",
         f"--nvml.module={fake_nvml.MODULE}", "--no-hotplug"],  # host device events stay out
        env=fake_nvml.exporter_env(root / "nvml.json", root / "xid-events"))
    try:
        # The pfc configuration arrives from a background thread: normally before the first
        # scrape answers, but a stalled machine must not make the golden file flaky.
        # So do the GPU counters and the XID event.
        background = ("gpunet_pfc_config_refresh_success{", "gpunet_gpu_counters_refresh_success{",
                      "gpunet_gpu_xid_errors_total{")

        def complete() -> str:
            text = exporter.metrics()
            return text if all(b in text for b in background) else ""

        text = wait_for(complete, f"the background values {background} in a scrape",
                        timeout=20, interval=0.2)
        yield Scrape(sysfs, text)
    finally:
        exporter.stop()


def normalise(text: str) -> str:
    """Sorted TYPE and sample lines, without HELP, time-based families and version labels."""
    out: list[str] = []
    for line in text.splitlines():
        if not line or line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            name = line.split(" ")[2]
        else:
            m = _NAME.match(line)
            assert m, f"not an exposition line: {line!r}"
            name = m.group(0)
            if name in VERSIONED:
                line = re.sub(r"\{[^}]*\}", "", line)
            if name.startswith(OWN_PROCESS):
                line = line.rsplit(" ", 1)[0]
        if name not in TIME_BASED:
            out.append(line)
    return "\n".join(sorted(out)) + "\n"


def test_golden(scrape: Scrape) -> None:
    got = normalise(scrape.text)
    if UPDATE:
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(got)
        msg = f"GPUNET_UPDATE_GOLDEN=1: rewrote {GOLDEN} ({got.count(chr(10))} lines)"
        print(msg)
        warnings.warn(msg, stacklevel=1)
        return
    assert GOLDEN.exists(), f"{GOLDEN} missing; create it with GPUNET_UPDATE_GOLDEN=1"
    want = GOLDEN.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(
            want.splitlines(keepends=True), got.splitlines(keepends=True),
            fromfile=str(GOLDEN.relative_to(REPO)), tofile="scrape", n=1))
        pytest.fail(f"/metrics differs from the golden file (regenerate with "
                    f"GPUNET_UPDATE_GOLDEN=1 if the change is intended):\n{diff}", pytrace=False)


def test_promtool(scrape: Scrape) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed (tests/run.sh installs the prometheus package)"
    res = subprocess.run([promtool, "check", "metrics"], input=scrape.text, capture_output=True,
                         text=True, timeout=30, check=False)
    problems = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    assert res.returncode == 0 and not problems, (
        f"promtool check metrics exited {res.returncode}:\n" + "\n".join(problems))


def _ports(s: Samples, name: str) -> dict[str, float]:
    """device -> value of a per-port series (all ports here are port 1)."""
    out: dict[str, float] = {}
    for labels, v in series(s, name).items():
        d = dict(labels)
        assert d["port"] == "1", d
        out[d["device"]] = v
    return out


def test_facts(scrape: Scrape) -> None:
    s, sysfs = scrape.samples, scrape.sysfs
    for collector in ("infiniband", "link", "pfc", "nic"):
        assert value(s, "gpunet_scrape_collector_success", collector=collector) == 1, collector

    # Modules and reporters: the low lane, a QSFP56 module, one fw_fatal reporter in error.
    mtu_netdev = st._netdev(sysfs, MTU_1500).name
    assert value(s, "gpunet_nic_transceiver_rx_power_watts", interface=mtu_netdev,
                 lane="3") == pytest.approx(nic.LOW_RX_MW / 1000)
    assert value(s, "gpunet_nic_transceiver_info", interface=st._netdev(sysfs, SWITCHDEV).name,
                 identifier="QSFP28", spec="sff8636", vendor="GPUNET OPTICS",
                 part_number="GN-QSFP56-200GSR") == 1
    bad = {dict(k)["device"] + " " + dict(k)["reporter"] for k, v in series(
        s, "gpunet_nic_health_reporter_healthy").items() if v == 0}
    assert bad == {"mlx5_0 fw_fatal"}
    assert not [k for k in series(s, "gpunet_check_unknown") if ("collector", "nic") in k]

    # Every device of the tree reports, the dangling class link nowhere.
    infos = _ports(s, "gpunet_infiniband_port_info")
    assert sorted(infos) == sorted(DEVICES)
    assert DANGLING not in scrape.text

    # Degraded: only mlx5_5 (2X NDR, 200 Gb/s against the 400 Gb/s rule).
    degraded = _ports(s, "gpunet_infiniband_port_rate_degraded")
    assert degraded == {**dict.fromkeys(degraded, 0), DEGRADED: 1}
    assert len(degraded) == 6  # the active IB ports with a readable rate; RoCE has no rule
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device=DEGRADED,
                 port="1") == 200 * 125_000_000
    assert value(s, "gpunet_infiniband_port_link_width_lanes", device=DEGRADED, port="1") == 2

    # Down: state DOWN, phys Disabled, and no expected-rate judgement at all.
    assert value(s, "gpunet_infiniband_port_state_id", device=DOWN, port="1") == 1
    assert value(s, "gpunet_infiniband_port_phys_state_id", device=DOWN, port="1") == 3
    assert DOWN not in degraded
    assert DOWN not in _ports(s, "gpunet_infiniband_port_rate_expected_bytes_per_second")
    assert value(s, "gpunet_link_carrier", interface="ibp94s0") == 0

    # Saturated: exactly the files make_counters_saturated pinned, on mlx5_1 only.
    sat = {(dict(lbl)["device"], dict(lbl)["counter"]): v
           for lbl, v in series(s, "gpunet_infiniband_port_pma_saturated").items()}
    assert {c for (d, c), v in sat.items() if v == 1 and d == SATURATED} == SATURATED_FILES
    assert {d for (d, _), v in sat.items() if v == 1} == {SATURATED}
    assert value(s, "gpunet_infiniband_port_transmit_wait_ticks_total", device=SATURATED,
                 port="1") == 0xFFFFFFFF

    # No PMA: port_info (and hw_counters, which do not come from the PMA) but no counters/ value.
    assert infos[NO_PMA] == 1
    pma_names = {spec.name for spec in COUNTER_SPECS.values()}
    pma_names |= {"gpunet_infiniband_port_pma_total", "gpunet_infiniband_port_pma_saturated"}
    no_pma = [n for (n, lbl) in s if n in pma_names and ("device", NO_PMA) in lbl]
    assert no_pma == [], no_pma
    assert value(s, "gpunet_infiniband_port_hw_rx_write_requests_total", device=NO_PMA,
                 port="1") is not None

    # Garbage: only the three bad values go; missing hw_counters: no hw series for mlx5_7.
    assert GARBAGE not in _ports(s, "gpunet_infiniband_port_rate_bytes_per_second")
    assert GARBAGE not in _ports(s, "gpunet_infiniband_port_link_downed_total")
    assert GARBAGE not in _ports(s, "gpunet_infiniband_port_vl15_dropped_total")
    assert GARBAGE in _ports(s, "gpunet_infiniband_port_symbol_errors_total")
    assert not [n for (n, lbl) in s if "_hw_" in n and ("device", NO_HW) in lbl]
    # 21 "N/A (no PMA)" files + 3 garbage values, nothing else.
    assert value(s, "gpunet_scrape_collector_unreadable_values", collector="infiniband") == 24
    assert value(s, "gpunet_scrape_collector_unreadable_values", collector="link") == 0

    # MTU 1500 on the RoCE netdev of mlx5_8: mismatch against the 9000 rule, RDMA MTU 1024.
    assert value(s, "gpunet_link_mtu_bytes", interface="enp41s0f0np0") == 1500
    assert value(s, "gpunet_link_mtu_mismatch", interface="enp41s0f0np0") == 1
    assert value(s, "gpunet_link_mtu_mismatch", interface="enp170s0f0np0") == 0
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device=MTU_1500, port="1") == 1024
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_9", port="1") == 4096

    # port_xmit_data / port_rcv_data count octets / 4: exported x 4, to the byte.
    checked = 0
    for dev in DEVICES:
        counters = sysfs / "class/infiniband" / dev / "ports/1/counters"
        for fname, metric in (("port_xmit_data", "gpunet_infiniband_port_transmitted_bytes_total"),
                              ("port_rcv_data", "gpunet_infiniband_port_received_bytes_total")):
            text = (counters / fname).read_text()
            got = value(s, metric, device=dev, port="1")
            if dev == NO_PMA:
                assert text.startswith("N/A") and got is None
                continue
            assert got == 4 * int(text), (dev, fname, got, text)
            checked += 1
    assert checked == 2 * (len(DEVICES) - 1)


def test_pfc_facts(scrape: Scrape) -> None:
    s = scrape.samples
    roce, other = "enp170s0f0np0", "enp41s0f0np0"  # mlx5_9 (OFED files), mlx5_8
    # Counters of the capture; pause counters only where PFC is on, never zero-filled.
    pause = {dict(lbl)["priority"]: v for lbl, v in
             series(s, "gpunet_pfc_pause_frames_total").items()
             if dict(lbl)["direction"] == "rx"}
    assert pause == {"3": 1840}
    assert value(s, "gpunet_pfc_pause_duration_seconds_total", interface=roce, priority="3",
                 direction="rx") == 0.020913
    # The interface whose ethtool failed costs exactly its own counters.
    assert not [n for (n, lbl) in s if n.startswith("gpunet_pfc_") and ("interface", other) in lbl]
    assert value(s, "gpunet_scrape_collector_unreadable_values", collector="pfc") == 1
    # Configuration from the OFED sysfs files; ECN from ecn/.
    assert value(s, "gpunet_pfc_config_info", interface=roce, source="sysfs", dcbx_mode="",
                 trust="dscp") == 1
    assert value(s, "gpunet_pfc_config_refresh_success", interface=roce) == 1
    assert value(s, "gpunet_pfc_dscp_priority", interface=roce, dscp="26") == 3
    assert value(s, "gpunet_pfc_ecn_enabled", interface=roce, priority="3", point="np") == 1
    assert value(s, "gpunet_pfc_ecn_enabled", interface=roce, priority="0", point="np") == 0
    assert not series(s, "gpunet_pfc_enabled")  # the OFED sysfs files do not say


def test_gpu_and_topology_facts(scrape: Scrape) -> None:
    s = scrape.samples
    for collector in ("gpu", "topology"):
        assert value(s, "gpunet_scrape_collector_success", collector=collector) == 1, collector
        assert value(s, "gpunet_scrape_collector_unreadable_values", collector=collector) == 0
    # The capture's two H200s at the tree's first two GPU addresses, one process each.
    buses = {dict(lbl)["gpu"]: dict(lbl)["pci_address"] for lbl in series(s, "gpunet_gpu_info")}
    assert buses == {"0": "0000:1b:00.0", "1": "0000:43:00.0"}
    assert series(s, "gpunet_gpu_compute_processes") == {
        frozenset({("gpu", "0")}): 1, frozenset({("gpu", "1")}): 1}
    assert value(s, "gpunet_gpu_xid_errors_total", gpu="1", xid="79") == 1
    # Each GPU's nearest NIC is the one under its switch; GPU 1's switch redirects P2P.
    nearest = {dict(lbl)["gpu"]: (dict(lbl)["device"], dict(lbl)["path"])
               for lbl in series(s, "gpunet_topology_gpu_nearest_nic")}
    assert nearest == {"0": ("mlx5_0", "PIX"), "1": ("mlx5_1", "PIX")}
    assert value(s, "gpunet_topology_gpu_nic_path", gpu="0", device="mlx5_4", path="SYS") == 1
    assert value(s, "gpunet_topology_gpu_nic_path", gpu="0", device="mlx5_8", path="NODE") == 1
    assert value(s, "gpunet_topology_gpu_nic_acs_redirect_bridges", gpu="1",
                 device="mlx5_1") == 1
    assert value(s, "gpunet_topology_gpu_nic_acs_redirect_bridges", gpu="0",
                 device="mlx5_0") == 0
    assert value(s, "gpunet_topology_gpu_nearest_nic_numa_mismatch", gpu="0") == 0
    # No peer-memory client and a proprietary kernel module: GPUDirect RDMA cannot work.
    assert value(s, "gpunet_topology_gdr_peermem_loaded") == 0
    assert value(s, "gpunet_topology_gdr_dmabuf_capable") == 0
    assert value(s, "gpunet_topology_gdr_ready") == 0
    # The NCCL audit: one finding per harmful setting, counted by process, no values exported.
    findings = {(dict(lbl)["variable"], dict(lbl)["issue"]): v
                for lbl, v in series(s, "gpunet_topology_nccl_env_findings").items()}
    assert {k: v for k, v in findings.items() if v} == {
        ("NCCL_IB_DISABLE", "ib_disabled"): 1, ("NCCL_IB_HCA", "unknown_device"): 1,
        ("NCCL_P2P_DISABLE", "p2p_disabled"): 1}
    assert value(s, "gpunet_topology_nccl_env_processes", result="inspected") == 2
    assert "mlx5_99" not in scrape.text and "31337" not in scrape.text
