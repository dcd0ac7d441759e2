"""One node: its ports, links, PFC, GPUs, probes and NCCL jobs (gpunet-node.json)."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import ALERTS_FIRING
from gpunet_exporter.mixin.dashboards.common import (
    BAD_WHEN_1,
    GOOD_WHEN_1,
    INSTANCE,
    JOB,
    NEUTRAL,
    NODE_UID,
    OK_ORANGE,
    OK_RED,
    OPERSTATE,
    PCIE_PATH,
    PHYS_STATE,
    PORT_STATE,
    Json,
    Layout,
    count_or_zero,
    dashboard,
    increase,
    instance_variable,
    job_variable,
    mapping,
    nccl_job_panels,
    nccl_jobs_table,
    override,
    pause_steps,
    port_legend,
    rate,
    sel,
    stat,
    state_timeline,
    table,
    target,
    timeseries,
)
from gpunet_exporter.mixin.thresholds import Thresholds


def node(t: Thresholds) -> Json:
    lay = Layout()
    lay.row("Summary")
    lay.add(stat("Firing gpunet alerts by class", "How many Gpunet alerts fire on this node, "
                 "per problem class (rows below: link and congestion = ports, links, PFC; "
                 "transport = RDMA counters; gpu; topology; collective = probes and NCCL "
                 "jobs). Needs the rules in alerts/ loaded.",
                 [target(sel(ALERTS_FIRING), "{{class}}")], "short", thresholds=OK_RED,
                 text_mode="value_and_name"), 24, 3)
    lay.add(stat("Exporter", "Whether Prometheus reached the exporter on its last scrape.",
                 [target(f"up{{{JOB}, {INSTANCE}}}")], "none",
                 mappings=mapping((1, "UP", "green"), (0, "DOWN", "red"))), 4, 4)
    lay.add(stat("Ports ACTIVE / all", "RDMA ports in logical state ACTIVE, and all RDMA "
                 "ports. Fewer active than expected: see Port logical state below.",
                 [target(count_or_zero(sel("gpunet_infiniband_port_state_id") + " == 4"),
                         "active"),
                  target(count_or_zero(sel("gpunet_infiniband_port_state_id")), "all")],
                 "short", text_mode="value_and_name"), 4, 4)
    lay.add(stat("GPUs", "GPUs NVML enumerates now, and GPUs it enumerated before that are "
                 "gone (missing > 0 is bad).",
                 [target(count_or_zero(sel("gpunet_gpu_info")), "present"),
                  target(sel("gpunet_gpu_missing"), "missing")], "short",
                 text_mode="value_and_name"), 4, 4)
    lay.add(stat("GPUDirect RDMA ready", "Host side of GPUDirect RDMA: a peer-memory module "
                 "loaded or DMA-BUF capable. NO: NCCL bounces GPU data through host memory.",
                 [target(sel("gpunet_topology_gdr_ready"))], "none", mappings=GOOD_WHEN_1),
            4, 4)
    lay.add(stat("Collectors failing", "Collectors that raised or timed out in the last "
                 "scrape (see the Exporter row). Their panels below are empty, not healthy.",
                 [target(count_or_zero(sel("gpunet_scrape_collector_success") + " == 0"))],
                 "short", thresholds=OK_ORANGE), 4, 4)
    lay.add(stat("Exporter version", "Version of gpunet-exporter on this node.",
                 [target(sel("gpunet_exporter_build_info"), "{{version}}")], "none",
                 text_mode="name"), 4, 4)

    lay.row("InfiniBand / RoCE ports")
    lay.add(state_timeline("Port logical state", "ACTIVE is the only state that carries "
                           "traffic. DOWN: no link; INIT: link up, waiting for the subnet "
                           "manager; ARMED: configured, not yet active.",
                           [target(sel("gpunet_infiniband_port_state_id"), "{{device}}/{{port}}")],
                           mappings=PORT_STATE), 12, 8)
    lay.add(state_timeline("Port physical state", "LinkUp is healthy. Polling: no peer (cable "
                           "or optic out, switch port down); LinkErrorRecovery or Training "
                           "flickering: a marginal link.",
                           [target(sel("gpunet_infiniband_port_phys_state_id"),
                                   "{{device}}/{{port}}")], mappings=PHYS_STATE), 12, 8)
    lay.add(timeseries(
        "Port rate vs expected", "Active data rate of each port (solid) against the rate it "
        "should run at (dashed; config rules, or the fastest port of the same type). A solid "
        "line below its dashed one is a port trained down.",
        [target(sel("gpunet_infiniband_port_rate_bytes_per_second"), port_legend("actual")),
         target(sel("gpunet_infiniband_port_rate_expected_bytes_per_second"),
                port_legend("expected"))], "Bps",
        overrides=[override("/expected$/", ("custom.lineStyle",
                                            {"fill": "dash", "dash": [10, 10]}), regex=True)]),
        12, 8)
    lay.add(state_timeline("Port rate degraded", "DEGRADED (red): the active port runs below "
                           "its expected rate; every all-reduce through it slows down.",
                           [target(sel("gpunet_infiniband_port_rate_degraded"),
                                   "{{device}}/{{port}}")],
                           mappings=mapping((0, "ok", "green"), (1, "DEGRADED", "red"))),
            12, 8)
    lay.add(timeseries(
        "Physical link errors", "Per second: symbol errors (bad cable or optic), link error "
        "recoveries (retrains), link downed (flaps) and local link integrity errors. "
        "Healthy links stay at 0.",
        [target(rate("gpunet_infiniband_port_symbol_errors_total"), port_legend("symbol")),
         target(rate("gpunet_infiniband_port_link_error_recoveries_total"),
                port_legend("recovery")),
         target(rate("gpunet_infiniband_port_link_downed_total"), port_legend("downed")),
         target(rate("gpunet_infiniband_port_local_link_integrity_errors_total"),
                port_legend("integrity"))], "cps"), 12, 8)
    lay.add(timeseries(
        "Packet errors and discards", "Per second: received packets with errors, packets "
        "marked bad upstream (remote physical), transmit discards (port down or congested) "
        "and buffer overruns. Should stay at 0.",
        [target(rate("gpunet_infiniband_port_receive_errors_total"), port_legend("rcv err")),
         target(rate("gpunet_infiniband_port_receive_remote_physical_errors_total"),
                port_legend("remote phys")),
         target(rate("gpunet_infiniband_port_transmit_discards_total"),
                port_legend("xmit discard")),
         target(rate("gpunet_infiniband_port_excessive_buffer_overrun_errors_total"),
                port_legend("overrun"))], "pps"), 12, 8)
    lay.add(timeseries(
        "Port traffic", "Bytes per second transmitted (up) and received (down) per port.",
        [target(rate("gpunet_infiniband_port_transmitted_bytes_total"), port_legend("tx")),
         target(rate("gpunet_infiniband_port_received_bytes_total"), port_legend("rx"))],
        "Bps", min_value=None,
        overrides=[override("/ rx$/", ("custom.transform", "negative-Y"), regex=True)]),
        12, 8)
    lay.add(timeseries(
        "Transmit wait (credit starvation)", "Ticks per second a port had data but no "
        "flow-control credits (PortXmitWait; a tick is a few ns). Sustained growth means "
        "congestion downstream.",
        [target(rate("gpunet_infiniband_port_transmit_wait_ticks_total"),
                "{{device}}/{{port}}")], "short"), 12, 8)
    lay.add(timeseries(
        "RDMA transport errors", "Per second: QP ACK timeouts and out-of-sequence packets "
        "(loss on the fabric), RNR NAKs, receive-queue out-of-buffer drops, and requests "
        "that exhausted transport retries (NCCL fails with status 12; must stay 0).",
        [target(rate("gpunet_infiniband_port_hw_local_ack_timeouts_total"),
                port_legend("ACK timeout")),
         target(rate("gpunet_infiniband_port_hw_out_of_sequence_packets_total"),
                port_legend("out of seq")),
         target(rate("gpunet_infiniband_port_hw_rnr_nak_received_total"),
                port_legend("RNR NAK")),
         target(rate("gpunet_infiniband_port_hw_out_of_buffer_drops_total"),
                port_legend("out of buffer")),
         target(rate("gpunet_infiniband_port_hw_requester_transport_retries_exceeded_total"),
                port_legend("retries exceeded"))], "cps"), 24, 8)

    lay.row("Links (netdev) and MTU")
    mismatch_col = override("mismatch", ("mappings", mapping((0, "ok", "green"),
                                                             (1, "MISMATCH", "red"))),
                            ("custom.cellOptions", {"type": "color-text"}))
    lay.add(table("Netdev MTU", "MTU of each RDMA netdev against the MTU the configuration "
                  "expects (empty: no rule). RoCE needs jumbo frames (typically 9000); 1500 "
                  "limits the RDMA MTU to 1024.",
                  [target(sel("gpunet_link_mtu_bytes"), table=True),
                   target(sel("gpunet_link_mtu_expected_bytes"), table=True),
                   target(sel("gpunet_link_mtu_mismatch"), table=True)], "none",
                  rename={"Value #A": "MTU", "Value #B": "expected", "Value #C": "mismatch"},
                  order=["instance", "interface"], overrides=[mismatch_col], decimals=0),
            12, 7)
    lay.add(table("Active RDMA MTU", "Active RDMA (IB transport) MTU per port against the "
                  "expected one. 4096 is the norm for NCCL; lower costs bandwidth.",
                  [target(sel("gpunet_link_rdma_active_mtu_bytes"), table=True),
                   target(sel("gpunet_link_rdma_mtu_expected_bytes"), table=True),
                   target(sel("gpunet_link_rdma_mtu_mismatch"), table=True)], "none",
                  rename={"Value #A": "active MTU", "Value #B": "expected",
                          "Value #C": "mismatch"},
                  order=["instance", "device", "port"], overrides=[mismatch_col], decimals=0),
            12, 7)
    lay.add(state_timeline("Netdev operational state", "up is healthy; down or "
                           "lowerlayerdown means no link on that interface.",
                           [target(sel("gpunet_link_operstate_id"), "{{interface}}")],
                           mappings=OPERSTATE), 12, 8)
    lay.add(timeseries("Link speed", "Negotiated speed of each netdev. A drop is a link "
                       "that renegotiated to a lower speed (cable, optic or switch port).",
                       [target(sel("gpunet_link_speed_bytes_per_second"), "{{interface}}")],
                       "Bps"), 6, 8)
    lay.add(timeseries("Carrier changes", "Carrier up/down transitions per interval: each "
                       "pair is a link flap.",
                       [target(increase("gpunet_link_carrier_changes_total"),
                               "{{interface}}")], "short", bars=True), 6, 8)

    lay.row("Transceivers and NIC firmware")
    xcvr = "gpunet_nic_transceiver"
    rx_power = sel(f"{xcvr}_rx_power_watts")
    rx_low = sel(f"{xcvr}_rx_power_threshold_watts", 'level="low_warning"')
    lay.add(timeseries("Transceiver receive power", "Optical power each media lane of a RoCE "
                       "netdev's module receives, in dBm. A lane far below the others, or below "
                       "its module's low warning (the table beside), is a dirty or damaged fibre "
                       "or connector: the usual cause of flapping links.",
                       [target(f"10 * log10({rx_power} * 1000)",
                               "{{interface}} lane {{lane}}")], "dBm", min_value=None),
            12, 8)
    lay.add(table("Module temperature and thresholds", "Each module's temperature, and its own "
                  "high warning and low warning thresholds of temperature and received power "
                  "(from its EEPROM). Empty: the module has no such monitor (passive copper).",
                  [target(sel(f"{xcvr}_temperature_celsius"), table=True),
                   target(sel(f"{xcvr}_temperature_threshold_celsius",
                              'level="high_warning"'), table=True),
                   target(f"10 * log10({rx_low} * 1000)", table=True)], "none",
                  rename={"Value #A": "temperature C", "Value #B": "high warning C",
                          "Value #C": "rx low warning dBm"},
                  order=["instance", "interface"], decimals=1), 12, 8)
    lay.add(table("devlink health reporters", "Each NIC health reporter (mlx5: fw, fw_fatal, "
                  "vnic per device; tx, rx per port): its state, and the errors it reported and "
                  "recovered from since the driver loaded.",
                  [target(sel("gpunet_nic_health_reporter_healthy"), table=True),
                   target(sel("gpunet_nic_health_reporter_errors_total"), table=True),
                   target(sel("gpunet_nic_health_reporter_recoveries_total"), table=True)],
                  "none", rename={"Value #A": "healthy", "Value #B": "errors",
                                  "Value #C": "recoveries"},
                  order=["instance", "device", "handle", "reporter"], decimals=0,
                  sort_by="healthy", sort_desc=False,
                  overrides=[override("healthy", ("mappings", mapping((0, "ERROR", "red"),
                                                                      (1, "healthy", "green"))),
                                      ("custom.cellOptions", {"type": "color-text"}))]),
            24, 8)

    lay.row("PFC and ECN (RoCE)")
    prio = "{{interface}} prio {{priority}}"
    lay.add(state_timeline("PFC enabled per priority", "PFC must be on for the priority RoCE "
                           "traffic uses (commonly 3) and usually off elsewhere. Off on the "
                           "RoCE priority: drops under congestion instead of pauses.",
                           [target(sel("gpunet_pfc_enabled"), prio)],
                           mappings=mapping((1, "on", "green"), (0, "off", "text")),
                           thresholds=NEUTRAL), 12, 8)
    lay.add(state_timeline("ECN (DCQCN) enabled per priority", "RoCE congestion control at "
                           "the notification point (np: marks and sends CNPs) and reaction "
                           "point (rp: slows down). Off on the RoCE priority: PFC alone "
                           "handles congestion, with pause storms.",
                           [target(sel("gpunet_pfc_ecn_enabled"), prio + " {{point}}")],
                           mappings=mapping((1, "on", "green"), (0, "off", "orange")),
                           thresholds=NEUTRAL), 12, 8)
    lay.add(timeseries("PFC pause frames per priority", "Pause frames per second. rx: the "
                       "switch paused us; tx: we paused the switch (our receive buffer "
                       "filled). Bursts are normal; steady high rates are congestion.",
                       [target(rate("gpunet_pfc_pause_frames_total"),
                               prio + " {{direction}}")], "pps"), 12, 8)
    lay.add(timeseries("Time paused by PFC per priority", "Fraction of time paused. rx: we "
                       "could not send; tx: we held the peer. Sustained above a few percent "
                       "costs bandwidth; near 100% is a pause storm.",
                       [target(rate("gpunet_pfc_pause_duration_seconds_total"),
                               prio + " {{direction}}")], "percentunit",
                       thresholds=pause_steps(t),
                       show_thresholds=True), 12, 8)
    lay.add(timeseries("Discards and pause storms", "Packets per second dropped per priority "
                       "(must be 0 on the lossless priority) and by the port for lack of "
                       "buffer, plus pause-storm errors (the NIC gave up pausing; drops "
                       "follow).",
                       [target(rate("gpunet_pfc_priority_discards_total"),
                               prio + " {{direction}} discards"),
                        target(rate("gpunet_pfc_port_discards_total"),
                               "{{interface}} port {{direction}} discards"),
                        target(rate("gpunet_pfc_pause_storm_error_events_total"),
                               "{{interface}} pause storm errors")], "pps"), 12, 8)
    lay.add(timeseries("ECN marks and CNPs", "Per second: ECN-marked RoCE packets received "
                       "and CNPs sent (notification point), CNPs handled (reaction point "
                       "slowed down) and ignored (must be 0 with congestion control on). "
                       "Port-level hw_counters.",
                       [target(rate("gpunet_infiniband_port_hw_np_ecn_marked_roce_packets_"
                                    "total"), port_legend("ECN marked rx")),
                        target(rate("gpunet_infiniband_port_hw_np_cnp_sent_total"),
                               port_legend("CNP sent")),
                        target(rate("gpunet_infiniband_port_hw_rp_cnp_handled_total"),
                               port_legend("CNP handled")),
                        target(rate("gpunet_infiniband_port_hw_rp_cnp_ignored_total"),
                               port_legend("CNP ignored"))], "pps"), 12, 8)
    lay.add(timeseries("Ethernet physical errors", "Per second on the physical port: "
                       "received frames with a bad CRC and symbol errors FEC could not "
                       "correct (lost traffic). Non-zero: cable, optic or switch port.",
                       [target(rate("gpunet_pfc_crc_errors_total"), "{{interface}} CRC"),
                        target(rate("gpunet_pfc_fec_uncorrected_symbol_errors_total"),
                               "{{interface}} FEC uncorrected")], "cps"), 24, 7)

    lay.row("GPUs")
    gpu = "GPU {{gpu}}"
    lay.add(timeseries("GPU utilization", "Fraction of time a kernel ran. Low while a job "
                       "runs (see compute processes) often means the GPU waits on the "
                       "network.",
                       [target(sel("gpunet_gpu_utilization_ratio"), gpu)], "percentunit",
                       max_value=1), 12, 8)
    lay.add(table("PCIe link: current vs max", "Current PCIe generation and width against "
                  "the maximum the GPU and slot support. An idle GPU lowering its generation "
                  "is power saving; fewer lanes, or a lower generation while busy, is "
                  "degraded (red).",
                  [target(sel("gpunet_gpu_pcie_link_generation"), table=True),
                   target(sel("gpunet_gpu_pcie_link_max_generation"), table=True),
                   target(sel("gpunet_gpu_pcie_link_width"), table=True),
                   target(sel("gpunet_gpu_pcie_link_max_width"), table=True),
                   target(sel("gpunet_gpu_pcie_link_degraded"), table=True)], "none",
                  rename={"Value #A": "gen", "Value #B": "max gen", "Value #C": "width",
                          "Value #D": "max width", "Value #E": "degraded"},
                  order=["instance", "gpu"], decimals=0,
                  overrides=[override("degraded", ("mappings", BAD_WHEN_1),
                                      ("custom.cellOptions", {"type": "color-text"}))]),
            12, 8)
    lay.add(state_timeline("PCIe link degraded", "BAD (red): the GPU's PCIe link runs below "
                           "its maximum (lanes, or generation while busy). GPU-NIC traffic "
                           "through it is capped.",
                           [target(sel("gpunet_gpu_pcie_link_degraded"), gpu)],
                           mappings=BAD_WHEN_1), 12, 6)
    lay.add(state_timeline("GPU lost", "LOST (red): NVML says the GPU fell off the bus; it "
                           "needs a reset or reboot.",
                           [target(sel("gpunet_gpu_lost"), gpu)],
                           mappings=mapping((0, "ok", "green"), (1, "LOST", "red"))), 12, 6)
    lay.add(state_timeline("NVLink fabric registered", "NOT READY (red): on NVSwitch systems "
                           "the GPU has not (yet) registered with its NVLink fabric, or "
                           "registration failed (the Fabric Manager); empty where NVML reports "
                           "no fabric (PCIe GPUs, NVLink bridges).",
                           [target("max by (gpu) (" + sel("gpunet_gpu_fabric_state",
                                                          'state="completed"') + ")", gpu)],
                           mappings=mapping((1, "ready", "green"), (0, "NOT READY", "red"))),
            12, 6)
    lay.add(timeseries("XID errors", "XID errors per interval by GPU and code. Codes 48, 63, "
                       "64, 74, 79, 92, 94, 95 are serious (ECC, NVLink, fallen off the "
                       "bus).",
                       [target(increase("gpunet_gpu_xid_errors_total"), gpu + " XID {{xid}}")],
                       "short", bars=True), 12, 8)
    lay.add(table("Latest XID per GPU", "The last XID code each GPU reported and how long "
                  "ago. Empty: no XID since the exporter started.",
                  [target(sel("gpunet_gpu_xid_last_code"), table=True),
                   target("time() - " + sel("gpunet_gpu_xid_last_timestamp_seconds"),
                          table=True)], "none",
                  rename={"Value #A": "XID", "Value #B": "age"}, order=["instance", "gpu"],
                  overrides=[override("age", ("unit", "s"))]), 12, 8)
    lay.add(timeseries("NVLink errors", "NVLink data-link errors per second by GPU and type, "
                       "summed over links. Non-zero baselines are normal; a rising rate is a "
                       "failing link.",
                       [target("sum by (gpu, type) (" + rate("gpunet_gpu_nvlink_errors_total")
                               + ")", gpu + " {{type}}")], "cps"), 12, 8)
    lay.add(timeseries("NVLink links active", "Active NVLink links per GPU; a drop means a "
                       "link went down and GPU-GPU traffic takes a slower path.",
                       [target("sum by (gpu) (" + sel("gpunet_gpu_nvlink_active") + ")", gpu)],
                       "short"), 12, 8)
    lay.add(timeseries("PCIe replays and recoveries", "Per second: PCIe replays "
                       "(link-level retransmissions) and link recoveries (retraining). "
                       "Rising: a marginal PCIe link, riser or slot.",
                       [target(rate("gpunet_gpu_pcie_replays_total"), gpu + " replays"),
                        target(rate("gpunet_gpu_pcie_link_recoveries_total"),
                               gpu + " recoveries")], "cps"), 12, 8)
    lay.add(timeseries("PCIe throughput", "PCIe traffic per GPU and direction.",
                       [target(sel("gpunet_gpu_pcie_throughput_bytes_per_second"),
                               gpu + " {{direction}}")], "Bps"), 12, 8)

    lay.row("Topology and GPUDirect RDMA")
    lay.add(stat("Peer-memory module", "nvidia_peermem (or nv_peer_mem) loaded. Either this "
                 "or DMA-BUF is needed for GPUDirect RDMA.",
                 [target(sel("gpunet_topology_gdr_peermem_loaded"))], "none",
                 mappings=mapping((1, "loaded", "green"), (0, "not loaded", "orange"))), 6, 4)
    lay.add(stat("DMA-BUF capable", "Open NVIDIA kernel module on Linux 5.12 or later: "
                 "GPUDirect RDMA works without a peer-memory module.",
                 [target(sel("gpunet_topology_gdr_dmabuf_capable"))], "none",
                 mappings=mapping((1, "yes", "green"), (0, "no", "orange"))), 6, 4)
    lay.add(stat("NVIDIA kernel module", "Flavor (open or proprietary) and version of the "
                 "loaded NVIDIA kernel module; DMA-BUF needs the open one.",
                 [target(sel("gpunet_topology_nvidia_kernel_module_info"),
                         "{{flavor}} {{version}}")], "none", text_mode="name"), 6, 4)
    lay.add(stat("GPU-NIC pairs with ACS redirect", "GPU/RDMA-device pairs with a PCI bridge "
                 "between them that redirects peer-to-peer traffic to the root complex "
                 "(ACS), which cripples GPUDirect RDMA. Should be 0.",
                 [target(count_or_zero(sel("gpunet_topology_gpu_nic_acs_redirect_bridges")
                                       + " > 0"))], "short", thresholds=OK_RED), 6, 4)
    numa_col = override("NUMA", ("mappings", mapping((0, "same node", "green"),
                                                     (1, "OTHER NODE", "red"),
                                                     (-1, "unknown", "text"))),
                        ("custom.cellOptions", {"type": "color-text"}))
    path_col = override("path", ("mappings", PCIE_PATH),
                        ("custom.cellOptions", {"type": "color-text"}))
    nearest = sel("gpunet_topology_gpu_nearest_nic")
    lay.add(table("Nearest NIC per GPU", "Each GPU's nearest RDMA device and the PCIe path "
                  "to it (PIX/PXB: behind a shared PCIe switch, best; PHB: through the host "
                  "bridge; NODE: same NUMA node; SYS: across sockets, bad). NUMA OTHER NODE "
                  "(red): the nearest NIC is on the other socket.",
                  [target(f"{nearest} * on (instance, job, gpu) group_left () "
                          f"{sel('gpunet_topology_gpu_nearest_nic_numa_mismatch')} "
                          f"or {nearest} * -1", table=True)], "none",
                  rename={"Value": "NUMA"}, order=["instance", "gpu", "device", "path"],
                  overrides=[numa_col, path_col]), 10, 9)
    lay.add(table("PCIe path between every GPU and RDMA device", "nvidia-smi topo -m for "
                  "GPU-NIC pairs: one row per GPU, one column per RDMA device.",
                  [target(sel("gpunet_topology_gpu_nic_path"), table=True)], "none",
                  transformations=[{"id": "groupingToMatrix", "options": {
                      "columnField": "device", "rowField": "gpu", "valueField": "path"}}],
                  mappings=PCIE_PATH, cell="color-text"), 14, 9)
    lay.add(table("NCCL environment findings", "GPU processes whose environment sets an "
                  "NCCL variable that hurts the network path (IB, GDR or P2P disabled, "
                  "sockets forced, unknown devices), per check. Every check is listed; 0 is "
                  "healthy.",
                  [target(sel("gpunet_topology_nccl_env_findings"), table=True)],
                  "short", rename={"Value": "processes"}, thresholds=OK_RED,
                  cell="color-text", order=["instance", "variable", "issue"]), 24, 6)

    lay.row("NCCL jobs (RAS)")
    lay.add(nccl_jobs_table("NCCL jobs on this node"), 24, 5)
    nccl_job_panels(lay, "port {{port}}")

    lay.row("Exporter", collapsed=True)
    lay.add(state_timeline("Collector success", "Per collector, whether the last scrape "
                           "finished without an exception in time. FAILED: its metrics are "
                           "missing.",
                           [target(sel("gpunet_scrape_collector_success"), "{{collector}}")],
                           mappings=mapping((1, "ok", "green"), (0, "FAILED", "red"))),
            12, 7)
    lay.add(timeseries("Collector duration", "Time each collector took in the scrape.",
                       [target(sel("gpunet_scrape_collector_duration_seconds"),
                               "{{collector}}")], "s"), 12, 7)
    lay.add(timeseries("Unreadable values", "Values skipped in a scrape because a file could "
                       "not be read or parsed. Persistent non-zero: a driver or permission "
                       "issue.",
                       [target(sel("gpunet_scrape_collector_unreadable_values"),
                               "{{collector}}")], "short"), 12, 7)
    ages = (("gpunet_gpu_counters_last_success_timestamp_seconds", gpu + " counters"),
            ("gpunet_pfc_config_last_success_timestamp_seconds", "{{interface}} QoS"),
            ("gpunet_link_ibv_devinfo_last_success_timestamp_seconds", "ibv_devinfo"))
    lay.add(timeseries("Age of background values", "Time since the last good read of the "
                       "values read in the background (GPU counters, QoS configuration, "
                       "ibv_devinfo): time() minus their last-success timestamps. Growing: "
                       "the reads fail or the background reader is stuck.",
                       [target("time() - " + sel(m), legend) for m, legend in ages],
                       "s"), 12, 7)

    return dashboard(
        NODE_UID, "gpunet / Node",
        "One GPU node: RDMA ports, links and MTU, PFC/ECN, GPUs, GPU-NIC topology and "
        "GPUDirect RDMA.", lay, [job_variable(), instance_variable(multi=False)])


# --- collectives ---
