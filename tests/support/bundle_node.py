"""A node of the end-to-end bundle (tests/test_alerts_e2e.py; tests/test_doctor.py runs the
doctor on the same nodes): the DGX H100 tree with GPUs, NVML replayed by support.fake_nvml,
stand-ins for ethtool, mlnx_qos, ibv_devinfo and the probe runner, a configuration, and the
exporter's arguments and environment. The healthy node has a good job's settings; the faulty one
has the faults build_node's docstring lists."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpunet_exporter.probe import results

from support import fake_nvml, nic
from support import sysfs_tree as st
from support.paths import FIXTURES
from support.ras_server import Behaviour, Server

HEALTHY, FAULTY = "gpu-healthy", "gpu-faulty"
HEALTHY_JOB_PID = 4242
HEALTHY_JOB_ENV = {"PATH": "/usr/bin", "NCCL_SOCKET_IFNAME": "bond0", "NCCL_ALGO": "Ring"}
DEGRADED_PORT, DOWN_PORT = "mlx5_5", "mlx5_3"
NIC_PCIE_DEGRADED = "mlx5_7"  # its PCIe link trained down to x8
MTU_PORT = "mlx5_8"  # the other RoCE port; its netdev is left at MTU 1500 on the faulty node
QOS_DEVICE = "mlx5_9"  # the RoCE port whose netdev carries the QoS configuration
RETRANSMITTING = MTU_PORT  # its out_of_sequence hw_counter rises while the bundle runs
MISSING_DEVICE = "mlx5_12"  # learned earlier by the faulty node's exporter, gone since
# The faulty node's GPU 2 has its rail NIC (mlx5_2) in a socket-1 slot (build_dgx_h100_gpus):
# GPU 2's nearest rail is then another GPU's, and mlx5_2 serves none (GpunetRailMapShared).
MISPLACED_RAIL = 2
# The faulty node's job: GPUs 0, 3 and 4 in the network-bound band (65 %), GPU 2 starved (22 %)
# while the RDMA ports carry nothing (its NCCL on sockets: GpunetGpuJobRdmaIdle), GPU 1 lost.
FAULTY_GPUS, BAND_GPUS, STARVED_GPU = 5, (0, 3, 4), 2
# The nic collector's faults (stand-in ethtool -m and devlink, tests/support/nic.py): lane 3 of
# the QoS netdev's module in low light, the MTU netdev's module hot, a fw_fatal reporter in error.
FW_FATAL_DEVICE = "mlx5_6"
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
topology:
  rail_exclude: '^mlx5_(8|9)$'  # the RoCE storage NICs, as examples/gpunet.yml has it
pfc:
  stats_source: ethtool
  ethtool: {{path: {ethtool}}}
  config: {{sources: [mlnx_qos], mlnx_qos_path: {mlnx_qos}, interval_seconds: 1}}
probe:
  command: [{python}, {runner}]   # a stand-in runner: writes the node's results, then idles
  state_dir: {state}
  holdoff_seconds: 0
nccl: {{host: 127.0.0.1, ports: {ras_ports}, interval_seconds: 1, handshake_seconds: 0.2}}
nic:
  interval_seconds: 1
  infiniband_transceivers: false  # the IB rails' modules: the fabric's tools (UFM) watch them
  eeprom_source: ethtool
  ethtool: {{path: {xcvr_ethtool}}}
  health_source: devlink
  devlink: {{path: {xcvr_devlink}}}
"""
# The NCCL jobs each node runs, as stand-in RAS servers (support.ras_server) replaying the
# captures of tests/fixtures/nccl_ras: the healthy node's job is healthy; the faulty node runs
# three jobs: one whose rank was killed (a dead process; the survivor holds an asynchronous
# error), one with a rank stuck behind the other (its collective count does not move) and one
# whose one process on this node is stopped (its listener accepts and never answers).
RAS = FIXTURES / "nccl_ras"
RAS_JOBS = {False: ("healthy",), True: ("dead", "stuck-1", "silent")}


def start_ras_jobs(faulty: bool) -> list[Server]:
    """The node's stand-in RAS servers, started on free loopback ports (stop each when done)."""
    return [Server(Behaviour(silent=True) if job == "silent" else Behaviour(
        json=(RAS / f"{job}.json").read_text())).start() for job in RAS_JOBS[faulty]]


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


def build_node(root: Path, faulty: bool, ras_ports: Sequence[int] = (1,)
               ) -> tuple[list[str], dict[str, str], str]:
    """Arguments (those the exporter and the doctor share) and environment for one node; returns
    also the RoCE netdev whose PFC configuration the test inspects.

    Faults of the faulty node, beyond the four the issue names: a port down, an IB port with a
    2048-byte active MTU, GPU 0 on a x8 link, on the other NUMA node than its NIC and with an
    XID 13, GPUs 0, 3 and 4 65 % busy with compute processes (the network-bound band), GPU 2
    starved at 22 % while the RDMA ports are idle, GPU 0 not yet registered with its NVLink
    fabric (state in progress), GPU 1 lost, GPU 2's rail NIC in the other socket's slot,
    mlx5_7's own PCIe link trained down to x8, and the RoCE netdev of mlx5_8 at MTU 1500 (below
    the RoCE minimum and not the expected 9000: two alerts) whose QoS configuration cannot be
    read, whose module runs hot and whose out_of_sequence counter rises while the bundle runs,
    lane 3 of the QoS netdev's module in low light, FW_FATAL_DEVICE's fw_fatal devlink health
    reporter in error, and an RDMA device (MISSING_DEVICE) in the learned inventory that the
    tree no longer has.

    ``ras_ports``: the ports of the node's NCCL jobs (start_ras_jobs), listed as listening in its
    /proc/net/tcp and queried by the nccl collector; the default, port 1, has no job."""
    sysfs = st.build_dgx_h100_gpus(root, misplaced_rail=MISPLACED_RAIL if faulty else None)
    qos_netdev = st.make_ofed_qos(sysfs, QOS_DEVICE)  # its netdev's name; ECN files for panels
    scenario = fake_nvml.h200x2()
    if faulty:
        fake_nvml.add_gpus(scenario, FAULTY_GPUS)
    fabrics = fake_nvml.fabric_h100x4() + fake_nvml.fabric_h100x4()  # 8 GPUs, each its own
    for dev, bus, fabric in zip(scenario["devices"], st.DGX_GPU_BUSES, fabrics, strict=False):
        dev["nvmlDeviceGetPciInfo"]["ok"]["busId"] = f"00000000:{bus:02X}:00.0"
        dev["fabric"] = fabric  # registered with the NVLink fabric, as recorded on 4 H100s
    devinfo = st.DGX_IBV_DEVINFO.replace("2048 (4)", "4096 (5)")
    if faulty:
        st.make_port_degraded(sysfs, DEGRADED_PORT)
        st.make_port_down(sysfs, DOWN_PORT)
        st.make_peermem_unloaded(sysfs)
        st.make_mtu_1500(sysfs, MTU_PORT)  # RoCE netdev: below 4200 and not the expected 9000
        st.set_numa_node(sysfs, f"0000:{st.DGX_GPU_BUSES[0]:02x}:00.0", 1)
        scenario["devices"][0]["nvmlDeviceGetCurrPcieLinkWidth"] = {"ok": 8}
        scenario["devices"][1]["lost"] = True
        scenario["devices"][0]["fabric"]["state"] = 2  # still registering with the fabric
        st.make_nic_pcie_downtrained(sysfs, NIC_PCIE_DEGRADED)
        # A training job: three GPUs at 65 %, the network-bound band (an info alert), and one
        # starved at 22 % while the RDMA ports are idle (the job's NCCL on sockets).
        for gpu, util in [(g, 65) for g in BAND_GPUS] + [(STARVED_GPU, 22)]:
            scenario["devices"][gpu]["nvmlDeviceGetUtilizationRates"] = {
                "ok": {"gpu": util, "memory": 30}}
            scenario["devices"][gpu]["processes"] = [4242 + gpu]
        devinfo = st.DGX_IBV_DEVINFO
    procfs = st.build_procfs(root, nvidia=st.NVRM_PROPRIETARY if faulty else st.NVRM_OPEN)
    st.write_tcp_listeners(procfs, [p for p in ras_ports if p != 1])
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
    # The results of the node's last rounds, as the runner left them while the GPUs were idle:
    # the probe runs only then (docs/probe.md, "Idle only"), and the healthy node's GPU runs a
    # job now, so its stand-in runner is never started.
    (root / "probe").mkdir()
    for scope, data in json.loads((root / "results.json").read_text()).items():
        data.update(started=time.time() - 2.0, time=time.time())
        (root / "probe" / f"{scope}.json").write_text(json.dumps(data))
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
    mtu_netdev = st._netdev(sysfs, MTU_PORT).name
    low = list(nic.HEALTHY_RX_MW)
    low[2] = nic.LOW_RX_MW
    pci = {d.name: os.path.basename(os.path.realpath(d / "device"))
           for d in (sysfs / "class/infiniband").iterdir()}
    xcvr_ethtool, xcvr_devlink = nic.write_replay(
        root / "nic",
        {qos_netdev: nic.cmis_osfp(rx_mw=low) if faulty else nic.cmis_osfp(),
         mtu_netdev: nic.cmis_osfp(temperature=nic.HOT_C) if faulty else nic.sff8636_qsfp56()},
        nic.reporters(sorted(pci.values()),
                      {(pci[FW_FATAL_DEVICE], "fw_fatal"): 1} if faulty else {}))
    config = root / "config.yml"
    config.write_text(CONFIG.format(ethtool=ethtool, state=root / "probe", mlnx_qos=mlnx_qos,
                                    ibv_devinfo=ibv_devinfo, python=sys.executable,
                                    runner=runner, ras_ports=list(ras_ports),
                                    xcvr_ethtool=xcvr_ethtool, xcvr_devlink=xcvr_devlink))
    # The inventory the exporter learns (the doctor reads it, never writes it); the faulty
    # node's learned earlier an RDMA device that has since fallen off the bus.
    inventory = root / "inventory.json"
    if faulty:
        inventory.write_text(json.dumps({"version": 1, "rdma_device": [MISSING_DEVICE],
                                         "rdma_port": [], "netdev": []}))
    args = [f"--path.sysfs={sysfs}", f"--path.procfs={procfs}", f"--config.file={config}",
            f"--nvml.module={fake_nvml.MODULE}",
            f"--collector.infiniband.inventory-state-file={inventory}"]
    env = fake_nvml.exporter_env(root / "nvml.json", root / "xid-events")
    return args, env, qos_netdev
