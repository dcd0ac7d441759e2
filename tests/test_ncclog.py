"""The NCCL INFO log parser (nccl.log) and explain-log (nccl.explain), in gpunet_exporter.

Lines are built from the format strings quoted in docs/formats.md section 5, with the
NCCL versions that print them; the real 2.28.9 logs and the synthetic IB+GDR log are checked in
full.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from gpunet_exporter.nccl import log as ncclog
from gpunet_exporter.nccl.log import RankReport, looks_like_nccl_log, parse_lines, summarize

from support.paths import FIXTURES, REPO

NCCL_DIR = FIXTURES / "nccl"
SYNTHETIC = FIXTURES / "synthetic" / "nccl-2.27_ib-gdr_RECONSTRUCTED.log"
LOGS = sorted(NCCL_DIR.glob("*.log"))


def c(fmt: str, *args: Any) -> str:
    """A C format string of NCCL's, filled in like printf."""
    return fmt % args


def info(msg: str, host: str = "node1", pid: int = 4242, tid: int = 4242, dev: int = 0) -> str:
    """src/debug.cc: "%s:%d:%d [%d] NCCL INFO " + message."""
    return c("%s:%d:%d [%d] NCCL INFO ", host, pid, tid, dev) + msg


def warn(msg: str, host: str = "node1", pid: int = 4242, dev: int = 0,
         where: tuple[str, int] = ("net_ib.cc", 2458)) -> str:
    """src/debug.cc: "\\n%s:%d:%d [%d] %s:%d NCCL WARN " + message (a leading empty line)."""
    return c("\n%s:%d:%d [%d] %s:%d NCCL WARN ", host, pid, pid, dev, *where) + msg


def one(*lines: str) -> RankReport:
    reports = parse_lines(lines)
    assert len(reports) == 1, reports
    return reports[0]


# ---------------------------------------------------------------------------------------------
# The shipped logs, in full.

def _fixture(mode: str, rank: int, pid: int, **over: Any) -> dict[str, Any]:
    """The P2P and SHM runs used no network device, so the machine having none
    (no_ib_device) is no problem of theirs; the settings that forced SHM and sockets are."""
    env = {"NCCL_NVLS_ENABLE": "0"}
    problems = []
    if mode in ("shm", "socket"):
        env["NCCL_P2P_DISABLE"] = "1"
        problems.append("p2p_disabled_by_env")
    if mode == "socket":
        env["NCCL_SHM_DISABLE"] = "1"  # a setting, not a fault: P2P decides
    base: dict[str, Any] = {
        "host": "vm", "pid": pid, "rank": rank, "nranks": 2,
        # The socket runs were two nodes to NCCL (one host ID each): NET/Socket between them.
        "nnodes": 2 if mode == "socket" else 1, "cuda_dev": rank,
        "nccl_version": "2.28.9", "net": "Socket", "transports": [], "net_transports": [],
        "gdr": None, "gdr_enabled_hcas": [], "gdr_disabled": False, "hcas": [], "env": env,
        "warnings": [], "problems": sorted(problems)}
    return {**base, **over}


SOCKET_PROBLEMS = ["no_ib_device", "p2p_disabled_by_env", "plugin_not_found", "socket_fallback"]
EXPECTED = {
    "nccl-2.28.9-h200x2-p2p-rank0.log": _fixture("p2p", 0, 663, transports=["P2P"]),
    "nccl-2.28.9-h200x2-p2p-rank1.log": _fixture("p2p", 1, 664, transports=["P2P"]),
    "nccl-2.28.9-h200x2-shm-rank0.log": _fixture("shm", 0, 789, transports=["SHM"]),
    "nccl-2.28.9-h200x2-shm-rank1.log": _fixture("shm", 1, 790, transports=["SHM"]),
    "nccl-2.28.9-h200x2-socket-rank0.log": _fixture(
        "socket", 0, 915, transports=["NET"], net_transports=["Socket"], gdr=False,
        problems=SOCKET_PROBLEMS),
    "nccl-2.28.9-h200x2-socket-rank1.log": _fixture(
        "socket", 1, 916, transports=["NET"], net_transports=["Socket"], gdr=False,
        problems=SOCKET_PROBLEMS),
}


def test_every_fixture_is_covered() -> None:
    assert sorted(p.name for p in LOGS) == sorted(EXPECTED)


@pytest.mark.parametrize("path", LOGS, ids=lambda p: p.name)
def test_real_228_logs(path: Path) -> None:
    reports = ncclog.parse_file(path)
    assert [r.to_dict() for r in reports] == [EXPECTED[path.name]]
    assert looks_like_nccl_log(path.read_text().splitlines())


def test_real_228_single_node_runs_use_no_network() -> None:
    """P2P and SHM runs never open a NET channel, even though NCCL picked Socket as its
    network (there is no HCA); only a NET/Socket channel or an IB device makes that a fallback."""
    for name in EXPECTED:
        if "socket" not in name:
            (r,) = ncclog.parse_file(NCCL_DIR / name)
            assert "NET" not in r.transports and r.gdr is None
            assert "socket_fallback" not in r.problems


def test_real_228_proxy_thread_lines_keep_the_rank_gpu() -> None:
    # shm-rank1 logs "vm:790:872 [0] NCCL INFO [Proxy Service] Device 1": the process is GPU 1.
    (r,) = ncclog.parse_file(NCCL_DIR / "nccl-2.28.9-h200x2-shm-rank1.log")
    assert r.cuda_dev == 1


def test_synthetic_227_ib_gdr() -> None:
    (r,) = ncclog.parse_file(SYNTHETIC)
    assert r.to_dict() == {
        "host": "node1", "pid": 4242, "rank": 0, "nranks": 16, "nnodes": 2, "cuda_dev": 0,
        "nccl_version": "2.27.7", "net": "IB", "transports": ["NET", "P2P"],
        "net_transports": ["IB"], "gdr": True, "gdr_enabled_hcas": ["mlx5_0"],
        "gdr_disabled": False, "hcas": ["mlx5_0", "mlx5_1"], "env": {}, "warnings": [],
        "problems": []}


def test_summarize_fixtures() -> None:
    socket = [r for p in LOGS if "socket" in p.name for r in ncclog.parse_file(p)]
    both = socket + ncclog.parse_file(SYNTHETIC)
    assert summarize(both) == {
        "ranks": 3, "nccl_versions": ["2.27.7", "2.28.9"], "net": "IB, Socket",
        "transports": ["NET", "P2P"], "net_transports": ["IB", "Socket"], "gdr": False,
        "hcas": ["mlx5_0", "mlx5_1"], "problems": SOCKET_PROBLEMS}
    assert summarize(ncclog.parse_file(SYNTHETIC))["gdr"] is True
    assert summarize(ncclog.parse_file(LOGS[0]))["net"] == "Socket"
    assert summarize([]) == {
        "ranks": 0, "nccl_versions": [], "net": "", "transports": [], "net_transports": [],
        "gdr": None, "hcas": [], "problems": []}
    json.dumps(summarize(both))


def test_dict_round_trip() -> None:
    for path in [*LOGS, SYNTHETIC]:
        for r in ncclog.parse_file(path):
            d = json.loads(json.dumps(r.to_dict()))
            assert RankReport.from_dict(d) == r


# ---------------------------------------------------------------------------------------------
# 5.1 line prefix

def test_prefix_variants() -> None:
    reports = parse_lines([
        info("Using network IB", host="gpu-node-07.cluster.local", pid=1, dev=3),
        info("Using network IB", host="trainer-7f9c6d-0", pid=2),
        ":22901:22901 [0] NCCL INFO Using network Socket",  # empty hostname
        # 2.26+: "[%F %T] " timestamp (on WARN by default; INFO when the env var says so)
        "[2025-03-01 12:00:00] ts-host:5:5 [1] NCCL INFO Using network IB",
        "0: srun-host:6:6 [0] NCCL INFO Using network IB",  # srun --label
        "[default0]:torch-host:7:7 [0] NCCL INFO Using network IB",  # torchrun --tee
        "node1:8:8 [0] NCCL INFO Using network IB\r",
    ])
    assert [(r.host, r.pid, r.cuda_dev, r.net) for r in reports] == [
        ("gpu-node-07.cluster.local", 1, 3, "IB"), ("trainer-7f9c6d-0", 2, 0, "IB"),
        ("", 22901, 0, "Socket"), ("ts-host", 5, 1, "IB"), ("srun-host", 6, 0, "IB"),
        ("torch-host", 7, 0, "IB"), ("node1", 8, 0, "IB")]


def test_warn_lines_with_and_without_timestamp() -> None:
    text = "".join([
        info("Using network IB"),
        warn("Call to ibv_modify_qp failed with error Network is unreachable",
             where=("misc/ibvwrap.cc", 187)),
        "\n[2025-03-01 12:00:00] node1:4242:4250 [0] net_ib.cc:2458 NCCL WARN "
        "NET/Socket : No usable listening interface found\n",
    ])
    r = one(*text.splitlines())
    assert r.warnings == ["Call to ibv_modify_qp failed with error Network is unreachable",
                          "NET/Socket : No usable listening interface found"]
    assert r.problems == ["nccl_warn"]


def test_warnings_are_capped() -> None:
    r = one(*(warn(f"warning {i}") for i in range(50)))
    assert len(r.warnings) == ncclog.MAX_WARNINGS == 20
    assert r.warnings[0] == "warning 0"


def test_version_lines() -> None:
    # 2.28 logs it with the prefix; every version prints it unprefixed to stdout.
    assert one(info("NCCL version 2.28.9+cuda13.0")).nccl_version == "2.28.9"
    reports = parse_lines([
        info("cudaDriverVersion 12040", pid=1),
        "NCCL version 2.21.5+cuda12.4",  # unprefixed: belongs to the next process without one
        info("Bootstrap : Using eth0:10.0.0.2<0>", pid=1),  # pid 1 has no version yet: its own
        info("Using network IB", pid=2)])
    assert [(r.pid, r.nccl_version) for r in reports] == [(1, "2.21.5"), (2, "")]
    # last in the file: every process of the file without a version gets it
    reports = parse_lines([info("NCCL version 2.18.5+cuda12.2", pid=1), info("x", pid=2),
                           "NCCL version 2.18.5+cuda12.2"])
    assert [r.nccl_version for r in reports] == ["2.18.5", "2.18.5"]
    # alone: a report for the file, though it is no NCCL INFO log
    (r,) = parse_lines(["NCCL version 2.21.5+cuda12.4"])
    assert (r.host, r.pid, r.nccl_version) == ("", 0, "2.21.5")
    assert not looks_like_nccl_log(["NCCL version 2.21.5+cuda12.4"])


def test_mixed_file_of_two_ranks() -> None:
    lines = []
    for ch in range(2):
        lines += [
            info(c(SEND_226, ch, 0, 0, 0, 8, 0, "IB", 0, "/GDRDMA", "", ""), host="a", pid=10),
            info(c(P2P_227, ch, 0, 9, 1, 8, 0, "CUMEM", "/read", ""), host="b", pid=10, dev=1),
        ]
    lines += [info("ncclCommInitRankConfig comm 0x1 rank 0 nranks 16 cudaDev 0 nvmlDev 0 busId "
                   "18000 commId 0x2 - Init START", host="a", pid=10),
              info("ncclCommInitRankConfig comm 0x3 rank 9 nranks 16 cudaDev 1 nvmlDev 1 busId "
                   "2a000 commId 0x2 - Init START", host="b", pid=10, dev=1)]
    a, b = parse_lines(lines)
    assert (a.host, a.rank, a.transports, a.gdr) == ("a", 0, {"NET"}, True)
    assert (b.host, b.rank, b.cuda_dev, b.transports, b.gdr) == ("b", 9, 1, {"P2P"}, None)


# ---------------------------------------------------------------------------------------------
# 5.5 rank lines: Init START|COMPLETE (<=2.20), ncclCommInitRank (2.21-2.22), API name (2.23+)

@pytest.mark.parametrize("msg", [
    "comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx - Init START",
    "ncclCommInitRank comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId 0x%llx "
    "- Init COMPLETE",
    "ncclCommInitRankConfig comm %p rank %d nranks %d cudaDev %d nvmlDev %d busId %lx commId "
    "0x%llx - Init START",
])
def test_rank_from_init_lines(msg: str) -> None:
    c = msg.replace("%p", "0x55d5c1e0a1f0").replace("%lx", "%x").replace("%llx", "%x")
    line = c % (5, 16, 5, 5, 0x18000, 0x1f2e)
    r = one(info(line, dev=5))
    assert (r.rank, r.nranks, r.cuda_dev) == (5, 16, 5)


def test_rank_of_the_largest_communicator() -> None:
    r = one(info("comm 0x1 rank 1 nRanks 2 nNodes 1 localRanks 2 localRank 1 MNNVL 0", dev=1),
            info("ncclCommSplit comm 0x2 rank 3 nranks 8 cudaDev 1 nvmlDev 1 busId 1000 parent "
                 "0x1 splitCount 1 color 0 key 3 - Init START", dev=1),
            info("Init timings - ncclCommInitRankConfig: rank 0 nranks 4 total 0.39", dev=1))
    assert (r.rank, r.nranks, r.cuda_dev) == (3, 8, 1)


# ---------------------------------------------------------------------------------------------
# 5.4 per-connection lines: (format, arguments, transports, net_transports, gdr)

SEND = "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s"
SEND_226 = "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d%s%s%s"
PXN_226 = "Channel %02d/%d : %d[%d] -> %d[%d] [send] via NET/%s/%d(%d)%s%s%s"
RECV_226 = "Channel %02d/%d : %d[%d] -> %d[%d] [receive] via NET/%s/%d%s%s%s"
P2P_227 = "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/%s%s%s"
CONNECTIONS = [
    ("2.18-2.25 send GDR", SEND, (0, 0, 0, 0, 8, 0, "IB", 0, "/GDRDMA", ""), {"NET"}, {"IB"},
     True),
    ("2.18-2.25 send shared, no GDR", SEND, (1, 1, 0, 0, 8, 0, "IB", 3, "", "/Shared"), {"NET"},
     {"IB"}, False),
    ("2.26+ send GDR over PCI", SEND_226, (2, 0, 0, 0, 8, 0, "IB", 0, "/GDRDMA", "(PCI)", ""),
     {"NET"}, {"IB"}, True),
    ("2.26+ send GDR shared", SEND_226, (2, 1, 0, 0, 8, 0, "IB", 0, "/GDRDMA", "", "/Shared"),
     {"NET"}, {"IB"}, True),
    ("2.26+ PXN", PXN_226, (2, 0, 0, 0, 9, 1, "IB", 1, 1, "/GDRDMA", "", ""), {"NET"}, {"IB"},
     True),
    ("2.26+ receive Socket", RECV_226, (0, 0, 1, 1, 0, 0, "Socket", 0, "", "", ""), {"NET"},
     {"Socket"}, False),
    ("2.26+ receive plugin", RECV_226, (4, 0, 8, 0, 0, 0, "IBext_v8", 4, "", "", ""), {"NET"},
     {"IBext_v8"}, False),
    ("2.26+ plugin name with a space", RECV_226,
     (4, 0, 8, 0, 0, 0, "AWS Libfabric", 0, "/GDRDMA", "", ""), {"NET"}, {"AWS Libfabric"},
     True),
    ("2.27+ P2P/CUMEM/read", P2P_227, (1, 0, 0, 0, 1, 1, "CUMEM", "/read", ""), {"P2P"}, set(),
     None),
    ("2.27+ P2P/MNNVL/CE", P2P_227, (1, 0, 0, 0, 1, 1, "MNNVL", "", "/CE"), {"P2P"}, set(),
     None),
    ("2.18+ P2P/IPC", "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/IPC%s%s",
     (3, 0, 0, 0, 1, 1, "/read", ""), {"P2P"}, set(), None),
    ("2.18+ P2P/direct pointer", "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/direct pointer%s",
     (3, 0, 0, 0, 1, 1, "/read"), {"P2P"}, set(), None),
    ("2.18+ P2P/indirect", "Channel %02d/%01d : %d[%d] -> %d[%d] via P2P/indirect/%d[%d]%s",
     (3, 0, 0, 0, 2, 2, 1, 1, ""), {"P2P"}, set(), None),
    ("2.18+ SHM direct/direct", "Channel %02d : %d[%d] -> %d[%d] via SHM/%s/%s",
     (0, 1, 1, 0, 0, "direct", "direct"), {"SHM"}, set(), None),
    ("2.18+ SHM CE/direct", "Channel %02d : %d[%d] -> %d[%d] via SHM/%s/%s",
     (0, 1, 1, 0, 0, "CE", "direct"), {"SHM"}, set(), None),
    ("2.18+ CollNet", "CollNet %02d/%1d : %d [send] via COLLNET/%s/%d%s",
     (0, 0, 0, "SHARP", 0, "/GDRDMA"), {"COLLNET"}, set(), None),
    ("older CollNet", "CollNet %02d : %d [send] via COLLNET/%s/%d%s", (0, 0, "SHARP", 0, ""),
     {"COLLNET"}, set(), None),
    # LEGACY (<= ~2.11, the NCCL 2.5.6 sample): rank[busId hex], no /connIndex
    ("2.5.6 legacy", "Channel 01 : 2[c7000] -> 0[87000] [receive] via NET/IB/5/GDRDMA", (),
     {"NET"}, {"IB"}, True),
    # pre-2.5 source (read in the code index): "Ring %02d : %d -> %d [send] via NET/%s/%d%s"
    ("pre-2.5 ring", "Ring %02d : %d -> %d [send] via NET/%s/%d%s", (0, 0, 1, "IB", 0, ""),
     {"NET"}, {"IB"}, False),
]


@pytest.mark.parametrize("fmt,args,transports,nets,gdr",
                         [c[1:] for c in CONNECTIONS], ids=[c[0] for c in CONNECTIONS])
def test_connection_lines(fmt: str, args: tuple[Any, ...], transports: set[str],
                          nets: set[str], gdr: bool | None) -> None:
    r = one(info(fmt % args if args else fmt))
    assert (r.transports, r.net_transports, r.gdr) == (transports, nets, gdr)


def test_ring_summary_lines_are_not_connections() -> None:
    # 5.5: ring/tree summaries look like channel lines but carry no "via"
    r = one(info("Channel 00/02 :    0   1"), info("Channel 00/02 : 0 1"),
            info("Ring 00 : 1 -> 0 -> 1"), info("Tree 0 : -1 -> 0 -> 1/-1/-1"),
            info("Trees [0] 1/-1/-1->0->-1 [1] -1/-1/-1->0->1"),
            info("Connected all rings, use ring PXN 0 GDR 1"))  # 2.24+: not about NET channels
    assert (r.transports, r.gdr, r.problems) == (set(), None, [])


def test_gdr_of_a_rank_with_some_channels_without_it() -> None:
    # Send-side GDR (NIC reads GPU memory) is off by default on some platforms while receive is
    # on: the rank uses GDR.
    r = one(info(RECV_226 % (0, 0, 8, 0, 0, 0, "IB", 0, "/GDRDMA", "", "")),
            info(SEND_226 % (0, 0, 0, 0, 8, 0, "IB", 0, "", "", "")))
    assert r.gdr is True and r.problems == []


# ---------------------------------------------------------------------------------------------
# 5.2 network selection

IB_USING = "NET/IB : Using%s %s; OOB %s:%s"


@pytest.mark.parametrize("devices,ro,hcas", [
    (" [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE", "[RO]", ["mlx5_0", "mlx5_1"]),
    (" [0]mlx5_0:1/IB [1]mlx5_1:1/RoCE", "", ["mlx5_0", "mlx5_1"]),  # "... /RoCE ; OOB ..."
    (" [0]mlx5_2:1/UNSPECIFIED", "", ["mlx5_2"]),
    (" [0]mlx5_0:1/IB/SHARP [1]mlx5_3:1/IB/SHARP", "[RO]", ["mlx5_0", "mlx5_3"]),  # HPC-X
    ("", "[RO]", []),  # zero devices, as in the 2.28.9 logs
])
def test_ib_using_line(devices: str, ro: str, hcas: list[str]) -> None:
    r = one(info(IB_USING % (devices, ro, "ib0", "10.10.0.11<0>")))
    assert r.hcas == hcas


def test_ib_device_lines_227() -> None:
    fmt = "NET/IB: [%d] %s:%s:%d/%s provider=%s speed=%d context=%s pciPath=%s ar=%d"
    r = one(info(fmt % (0, "mlx5_0", "uverbs0", 1, "IB", "Mlx5", 400000, "0x55d5c1a2b3c0",
                        "/sys/devices/pci0000:15/0000:15:01.0", 1)),
            info(fmt % (1, "mlx5_1", "uverbs1", 1, "RoCE", "None", 200000, "0x1", "/sys/x", 0)),
            info(c("NET/IB : Made virtual device [%d] name=%s speed=%d ndevs=%d",
                   2, "mlx5_0+mlx5_1", 800000, 2)),
            info(c("NET/IB: Data Direct DMA Interface is detected for device %s", "mlx5_0")))
    assert r.hcas == ["mlx5_0", "mlx5_1"]  # used when no "Using" line lists them


@pytest.mark.parametrize("net", ["IB", "Socket", "IBext_v8", "IBext", "AWS Libfabric"])
def test_using_network(net: str) -> None:
    assert one(info(c("Using network %s", net))).net == net


# the net plugin loader, version by version (5.2)
PLUGIN_MISSING = [
    "NET/Plugin : Plugin load (libnccl-net.so) returned 2 : libnccl-net.so: cannot open shared "
    "object file: No such file or directory",  # 2.18-2.21
    "NET/Plugin : No plugin found, using internal implementation",  # 2.18-2.20
    "NET/Plugin: No plugin found (libnccl-net.so)",  # 2.21
    "NET/Plugin: Could not find:libnccl-net.so. Using internal network plugin.",  # 2.22-2.25
    "NET/Plugin: Could not find: libnccl-net.so",  # 2.26+
]
SOCKET_CHANNEL = info(RECV_226 % (0, 0, 1, 1, 0, 0, "Socket", 0, "", "", ""))


@pytest.mark.parametrize("line", PLUGIN_MISSING)
def test_plugin_not_found_only_with_socket_fallback(line: str) -> None:
    # Normal with the internal IB transport: not a problem while NCCL uses IB.
    ib = one(info(line), info(IB_USING % (" [0]mlx5_0:1/IB", "[RO]", "ib0", "10.0.0.1<0>")),
             info("Using network IB"))
    assert ib.problems == []
    sock = one(info(line), info("Using network Socket"), SOCKET_CHANNEL)
    assert sock.problems == ["plugin_not_found", "socket_fallback"]


def test_other_plugin_loaders_are_not_the_net_plugin() -> None:
    r = one(info("ENV/Plugin: Could not find: libnccl-env.so"),
            info("TUNER/Plugin: Could not find: libnccl-tuner.so"),
            info("PROFILER/Plugin: Could not find: libnccl-profiler.so"), SOCKET_CHANNEL)
    assert r.problems == ["socket_fallback"]


def test_socket_fallback_triggers() -> None:
    # Socket chosen on a node without HCAs and no NET channel (single node): nothing to say.
    assert one(info("Using network Socket")).problems == []
    # NET/Socket channels: traffic goes over TCP.
    assert one(SOCKET_CHANNEL).problems == ["socket_fallback"]
    # Socket chosen while NCCL listed an IB device
    r = one(info(IB_USING % (" [0]mlx5_0:1/IB", "[RO]", "ib0", "10.0.0.1<0>")),
            info("Using network Socket"))
    assert r.problems == ["socket_fallback"]
    # Socket chosen because IB is disabled in the environment (IB init then fails silently;
    # 2.28 says "Failed to initialize NET plugin IB", which is then no missing device)
    r = one(info("NCCL_IB_DISABLE set by environment to 1."),
            info("Failed to initialize NET plugin IB"), info("Using network Socket"))
    assert r.problems == ["ib_disabled_by_env", "socket_fallback"]
    assert r.env == {"NCCL_IB_DISABLE": "1"}


def test_no_ib_device() -> None:
    assert one(info("NET/IB : No device found.")).problems == ["no_ib_device"]
    assert one(info("Failed to initialize NET plugin IB")).problems == ["no_ib_device"]  # 2.28+
    assert one(info("Failed to initialize NET plugin Socket")).problems == []


@pytest.mark.parametrize("line,env,problems", [
    ("NCCL_IB_DISABLE set by environment to 1.", {"NCCL_IB_DISABLE": "1"}, ["ib_disabled_by_env"]),
    ("NCCL_IB_DISABLE set by environment to 0.", {"NCCL_IB_DISABLE": "0"}, []),
    ("NCCL_P2P_DISABLE set by environment to 1", {"NCCL_P2P_DISABLE": "1"},  # 2.28.9: no dot
     ["p2p_disabled_by_env"]),
    ("NCCL_P2P_DISABLE set by environment to 0x1.", {"NCCL_P2P_DISABLE": "0x1"},
     ["p2p_disabled_by_env"]),  # strtoll(..., 0)
    ("NCCL_P2P_DISABLE set by environment to 2.", {"NCCL_P2P_DISABLE": "2"}, []),  # exactly 1
    ("NCCL_SHM_DISABLE set by environment to 1.", {"NCCL_SHM_DISABLE": "1"}, []),  # a setting
    ("NCCL_P2P_LEVEL set by environment to LOC.", {"NCCL_P2P_LEVEL": "LOC"},
     ["p2p_disabled_by_env"]),
    ("NCCL_NET set by environment to socket.", {"NCCL_NET": "socket"}, ["socket_forced_by_env"]),
    ("NCCL_NET set by environment to IB.", {"NCCL_NET": "IB"}, []),
    ("NCCL_NET_GDR_LEVEL set by environment to LOC.", {"NCCL_NET_GDR_LEVEL": "LOC"},
     ["gdr_disabled_by_env"]),
    ("NCCL_NET_GDR_LEVEL set by environment to 0.", {"NCCL_NET_GDR_LEVEL": "0"},
     ["gdr_disabled_by_env"]),
    ("NCCL_NET_GDR_LEVEL set by environment to PHB.", {"NCCL_NET_GDR_LEVEL": "PHB"}, []),
    ("NCCL_IB_GDR_LEVEL set by environment to LOC.", {"NCCL_IB_GDR_LEVEL": "LOC"},
     ["gdr_disabled_by_env"]),  # the former name
    ("NCCL_ALGO set by environment to Ring.", {"NCCL_ALGO": "Ring"}, []),  # a setting, no fault
    ("NCCL_SOCKET_IFNAME set by environment to bond0", {"NCCL_SOCKET_IFNAME": "bond0"}, []),
    ("NCCL_IB_HCA set to mlx5_4", {"NCCL_IB_HCA": "mlx5_4"}, []),
    ("Comm config Blocking set to 1", {}, []),
    ("P2P Chunksize set to 131072", {}, []),
])
def test_environment_lines(line: str, env: dict[str, str], problems: list[str]) -> None:
    r = one(info(line))
    assert (r.env, r.problems) == (env, problems)


# ---------------------------------------------------------------------------------------------
# 5.3 GPUDirect RDMA

GDR_HCA = "NET/%s : GPU Direct RDMA %s for HCA %d '%s'"


def test_gdr_hca_lines() -> None:
    r = one(info(GDR_HCA % ("IB", "Enabled", 0, "mlx5_0")),
            info(GDR_HCA % ("IB", "Enabled", 1, "mlx5_1")))
    assert (r.gdr_enabled_hcas, r.gdr_disabled, r.problems) == (["mlx5_0", "mlx5_1"], False, [])
    # No nvidia_peermem nor DMA-BUF: the IB plugin reports GDR disabled.
    r = one(info(GDR_HCA % ("IB", "Disabled", 0, "mlx5_0")))
    assert (r.gdr_disabled, r.problems) == (True, ["gdr_disabled"])
    # Sockets never do GDR; NCCL says so on every run, as in the 2.28.9 logs: no news.
    r = one(info(GDR_HCA % ("Socket", "Disabled", 0, "eth0")))
    assert (r.gdr_disabled, r.problems) == (False, [])


PAIR_DISABLED = [
    ("2.18-2.20", "GPU Direct RDMA Disabled for GPU %lx / HCA %d (distance %d > %d)",
     (0x18000, 0, 7, 4)),
    ("2.21-2.23", "GPU Direct RDMA Disabled for GPU %lx / HCA %lx (distance %d > %d)",
     (0x18000, 0x1, 7, 4)),
    ("2.24+", "GPU Direct RDMA Disabled for GPU %d / HCA %lx (distance %d > %d)", (0, 0x1, 9, 5)),
    ("pre-2.18 net_ib.cc", "NET/IB : GPU Direct RDMA Disabled for GPU %d / HCA %s (no module or "
     "not supported by GPU)", (0, "mlx5_0")),
]


@pytest.mark.parametrize("fmt,args", [p[1:] for p in PAIR_DISABLED],
                         ids=[p[0] for p in PAIR_DISABLED])
def test_gdr_pair_disabled(fmt: str, args: tuple[Any, ...]) -> None:
    line = info(fmt.replace("%lx", "%x") % args)
    r = one(line)
    assert (r.gdr_disabled, r.problems) == (True, ["gdr_disabled"])
    # ncclTopoIsGdrAvail tries NIC after NIC: a far NIC's "Disabled" before a near NIC's
    # "Enabled" is normal.
    enabled = ("GPU Direct RDMA Enabled for GPU %d / HCA %lx (distance %d <= %d), read %d mode %s"
               .replace("%lx", "%x") % (0, 0x2, 4, 5, 1, "Default"))  # 2.26+
    r = one(line, info(enabled))
    assert (r.gdr_disabled, r.problems) == (True, [])


def test_gdr_enabled_pair_lines() -> None:
    for line in [c("GPU Direct RDMA Enabled for GPU %x / HCA %d (distance %d <= %d), read %d",
                   0x18000, 0, 4, 4, 1),  # 2.18-2.20
                 "GPU Direct RDMA Enabled for GPU 0 / HCA 0 (distance 4 <= 4), read 1 mode PCI"]:
        assert one(info(line)).problems == []


def test_gdr_disabled_from_channels() -> None:
    # IB channels without /GDRDMA at all: every byte staged through host memory
    r = one(info(SEND_226 % (0, 0, 0, 0, 8, 0, "IB", 0, "", "", "")),
            info(RECV_226 % (0, 0, 8, 0, 0, 0, "IB", 0, "", "", "")))
    assert (r.gdr, r.problems) == (False, ["gdr_disabled"])
    # Socket channels have no GDR either, but the problem there is the socket
    r = one(SOCKET_CHANNEL)
    assert (r.gdr, r.problems) == (False, ["socket_fallback"])
    # A disabled line does not outvote channels that carry GDR
    r = one(info(GDR_HCA % ("IB", "Disabled", 3, "mlx5_3")),
            info(RECV_226 % (0, 0, 8, 0, 0, 0, "IB", 0, "/GDRDMA", "", "")))
    assert (r.gdr, r.gdr_disabled, r.problems) == (True, True, [])


def test_dmabuf_line_is_ignored() -> None:
    assert one(info("DMA-BUF is available on GPU device 0")).problems == []


# ---------------------------------------------------------------------------------------------
# 5.6 error lines

COMPLETIONS = [
    ("2.18", "NET/IB : Got completion from peer %s with error %d, opcode %d, len %d, vendor err "
     "%d (%s)%s%s%s%s", ("10.0.0.2<45678>", 12, 0, 0, 129, "Send", "", "", "", "")),
    ("2.2x", "NET/IB : Got completion from peer %s with status=%d opcode=%d len=%d vendor err "
     "%d (%s)%s%s%s%s", ("10.0.0.2<45678>", 13, 1, 0, 0, "Recv", " localGid ",
                         "::ffff:10.0.0.1", " remoteGids", "::ffff:10.0.0.2")),
    ("2.2x-2.27", "NET/IB: Got completion from peer %s with status=%d opcode=%d len=%u vendor "
     "err %u (%s)%s%s%s%s hca %s", ("10.0.0.2<45678>", 4, 0, 0, 0, "Send", "", "", "", "",
                                    "mlx5_0")),
    ("2.28+", "NET/IB: Got completion from peer %s with status=%s(%d) opcode=%s(%d) "
     "reqSize=%d vendor_err=%u req_type=%s%s%s%s%s hca %s",
     ("10.0.0.2<45678>", "IBV_WC_RETRY_EXC_ERR", 12, "IBV_WC_RDMA_WRITE", 1, 524288, 129,
      "Send", "", "", "", "", "mlx5_0")),
]


@pytest.mark.parametrize("fmt,args", [c[1:] for c in COMPLETIONS],
                         ids=[c[0] for c in COMPLETIONS])
def test_completion_errors(fmt: str, args: tuple[Any, ...]) -> None:
    msg = fmt % args
    r = one(*warn(msg).splitlines())
    assert r.problems == ["ib_completion_error", "nccl_warn"]
    assert r.warnings == [msg]
    # the same text at INFO (as some plugins log it) still counts
    assert one(info(msg)).problems == ["ib_completion_error"]


# ---------------------------------------------------------------------------------------------
# robustness

def test_not_nccl() -> None:
    text = ["hello", "# a comment quoting NCCL INFO lines", "torch NCCL version: (2, 21, 5)",
            "print('Using network IB')", ""]
    assert parse_lines(text) == []
    assert not looks_like_nccl_log(text)
    assert looks_like_nccl_log([*text, info("x")])
    assert looks_like_nccl_log(["", warn("boom")])


def test_pasted_lines_without_the_prefix() -> None:
    """Lines as people paste them into issues: "NCCL INFO ..." (or "[0] NCCL INFO ...") with
    the host:pid:tid part cut, and bare messages that say how NCCL connected. They make one
    report of their own; a comment that only quotes "NCCL INFO" in the middle does not count."""
    pasted = [
        "NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.1<0>",
        "[0] NCCL INFO Using network IB",
        "NCCL INFO NCCL_IB_HCA set by environment to mlx5_0,mlx5_1.",
        "Channel 00/0 : 0[0] -> 8[0] [send] via NET/IB/0",
        "  Channel 01/0 : 8[0] -> 0[0] [receive] via NET/IB/1",
    ]
    r = one(*pasted)
    assert (r.host, r.pid) == ncclog.PASTED
    assert (r.net, r.hcas, r.net_transports, r.gdr) == ("IB", ["mlx5_0", "mlx5_1"], {"IB"}, False)
    assert r.env == {"NCCL_IB_HCA": "mlx5_0,mlx5_1"}
    assert r.problems == ["gdr_disabled"]  # IB channels without /GDRDMA
    # Next to prefixed lines, the pasted ones stay apart.
    reports = parse_lines([info("Using network IB"), *pasted])
    assert [(x.host, x.pid) for x in reports] == [("node1", 4242), ncclog.PASTED]


def test_network_from_channel_lines() -> None:
    """No "Using network" line (an excerpt): the network is the NET/<name> of the channels,
    a plugin's (IBext_v8) included."""
    r = one(info("Channel 00/0 : 0[0] -> 8[0] [send] via NET/IBext_v8/0/GDRDMA"),
            info("NET/IBext_v8 : Using [0]mlx5_0:1/IB ; OOB ib0:10.0.0.1<0>"))
    assert (r.net, r.gdr, r.hcas, r.problems) == ("IBext_v8", True, ["mlx5_0"], [])
    r = one(info("Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0"))
    assert r.net == "Socket" and "socket_fallback" in r.problems
    assert one(info("Using network IB"),
               info("Channel 00/0 : 0[0] -> 8[0] [send] via NET/Socket/0")).net == "IB"


def test_no_ib_device_is_no_problem_for_a_single_node_job() -> None:
    """A job whose channels all went P2P or SHM needed no network: NCCL finding no IB device
    is a fact, not a problem of that job. With no channel line seen, or a NET channel, it is."""
    no_dev = info("NET/IB : No device found.")
    assert one(no_dev, info("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM")).problems == []
    assert one(no_dev, info("Channel 00 : 0[0] -> 1[1] via SHM/direct/direct")).problems == []
    assert one(no_dev).problems == ["no_ib_device"]
    assert one(no_dev, info("Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM"),
               info("Channel 01/0 : 1[1] -> 2[0] [send] via NET/Socket/0")
               ).problems == ["no_ib_device", "socket_fallback"]


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.text(max_size=300), max_size=30))
def test_random_text_never_raises(lines: list[str]) -> None:
    reports = parse_lines(lines)
    json.dumps([r.to_dict() for r in reports])
    summarize(reports)


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from([
    "", "node1:4242:4242 [0] NCCL INFO ", "[2025-01-01 00:00:00] a:1:2 [1] x.cc:3 NCCL WARN ",
    ":1:1 [0] NCCL INFO ", "NCCL version ", "h:1:1 [-1] NCCL INFO "]),
    hs.sampled_from(["", "Channel ", "NET/IB : Using", "NET/", "Using network ", "CollNet ",
                     "GPU Direct RDMA ", "NCCL_IB_DISABLE set by environment to ", "rank ",
                     "Got completion from peer "]),
    hs.text(max_size=80)), max_size=20))
def test_random_nccl_lines_never_raise(parts: list[tuple[str, str, str]]) -> None:
    reports = parse_lines("".join(p) for p in parts)
    for r in reports:
        assert r.problems == sorted(set(r.problems)) and set(r.problems) <= set(ncclog.PROBLEMS)


@settings(max_examples=200, deadline=None)
@given(hs.binary(max_size=2000))
def test_random_bytes_never_raise(data: bytes) -> None:
    parse_lines(data.decode("utf-8", errors="replace").splitlines())


def test_truncated_real_lines_never_raise() -> None:
    lines = [*SYNTHETIC.read_text().splitlines(),
             *(NCCL_DIR / "nccl-2.28.9-h200x2-socket-rank0.log").read_text().splitlines()]
    for line in lines:
        for cut in range(len(line) + 1):
            parse_lines([line[:cut]])


def test_long_garbage_lines_are_fast() -> None:
    start = time.monotonic()
    for junk in ("a" * 1_000_000, "NCCL " * 200_000, ":1" * 500_000, "[" * 1_000_000,
                 "node:1:1 [0] NCCL INFO NET/" + "a/" * 500_000,
                 "node:1:1 [0] NCCL INFO Channel 00 : " + "0 " * 500_000):
        parse_lines([junk])
    assert time.monotonic() - start < 5


def test_file_without_newlines(tmp_path: Path) -> None:
    big = tmp_path / "core"
    with big.open("wb") as fh:
        fh.write(b"\0\1" * 5_000_000 + b"node1:1:1 [0] NCCL INFO cut off with the long line\n")
        fh.write(b"node1:1:1 [0] NCCL INFO Using network IB\n")
    start = time.monotonic()
    (r,) = ncclog.parse_file(big)
    assert r.net == "IB" and time.monotonic() - start < 5
    p = explain(str(big))
    assert p.returncode == 0 and "network: IB" in p.stdout


def test_parse_file_errors(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        ncclog.parse_file(tmp_path / "missing.log")
    with pytest.raises(OSError):
        ncclog.parse_file(tmp_path)
    bad = tmp_path / "bad.log"
    bad.write_bytes(b"node1:1:1 [0] NCCL INFO Using network \xff\xfeIB\n")
    assert ncclog.parse_file(bad)[0].net == "\ufffd\ufffdIB"


def test_docs_explain_every_problem_code() -> None:
    doc = (REPO / "docs" / "nccl-log.md").read_text()
    for code in ncclog.PROBLEMS:
        assert f"`{code}`" in doc, code


# ---------------------------------------------------------------------------------------------
# explain-log, as a subprocess

def explain(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    p = subprocess.run([sys.executable, "-m", "gpunet_exporter.nccl.explain", *args], cwd=REPO,
                       input=stdin, capture_output=True, text=True, timeout=60)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_explain_socket_log() -> None:
    path = NCCL_DIR / "nccl-2.28.9-h200x2-socket-rank0.log"
    p = explain(str(path))
    assert p.returncode == 1
    assert p.stdout.splitlines() == [
        f"== {path}: 1 process",
        "",
        "vm pid 915 rank 0/2 (GPU 0), NCCL 2.28.9",
        "  network: Socket",
        "  transports: NET/Socket",
        "  GDR: off",
        "  HCAs: none",
        "  environment: NCCL_NVLS_ENABLE=0, NCCL_P2P_DISABLE=1, NCCL_SHM_DISABLE=1",
        "  problems:",
        # The consequence under its root cause: no device, so sockets.
        f"    no_ib_device: {ncclog.PROBLEMS['no_ib_device']}",
        f"      -> socket_fallback: {ncclog.PROBLEMS['socket_fallback']}",
        f"    plugin_not_found: {ncclog.PROBLEMS['plugin_not_found']}",
        f"    p2p_disabled_by_env: {ncclog.PROBLEMS['p2p_disabled_by_env']}",
        "",
        "overall: 1 process in 1 NCCL log: problems: socket_fallback, no_ib_device, "
        "plugin_not_found, p2p_disabled_by_env"]


def test_explain_healthy_ib_log() -> None:
    p = explain(str(SYNTHETIC))
    assert p.returncode == 0, p.stdout
    assert p.stdout.splitlines()[2:] == [
        "node1 pid 4242 rank 0/16 (GPU 0), NCCL 2.27.7",
        "  network: IB",
        "  transports: P2P, NET/IB",
        "  GDR: on",
        "  HCAs: mlx5_0, mlx5_1",
        "  environment: none",
        "  looks fine",
        "",
        "overall: 1 process in 1 NCCL log: looks fine"]


def test_explain_single_node_job_says_network_unused() -> None:
    """P2P and SHM runs on one node (nNodes 1) never used the network NCCL picked (Socket, for
    want of an HCA): "unused (single-node job)", not "Socket" above "looks fine"."""
    path = NCCL_DIR / "nccl-2.28.9-h200x2-p2p-rank0.log"
    p = explain(str(path))
    assert p.returncode == 0, p.stdout
    lines = p.stdout.splitlines()
    assert lines[3] == "  network: unused (single-node job)"
    assert "Socket" not in p.stdout and lines[-1].endswith(": looks fine")
    p = explain(str(NCCL_DIR / "nccl-2.28.9-h200x2-shm-rank1.log"))
    assert "  network: unused (single-node job)" in p.stdout.splitlines()
    # Two nodes to NCCL over sockets: the network is used, and named.
    p = explain(str(NCCL_DIR / "nccl-2.28.9-h200x2-socket-rank1.log"))
    assert "  network: Socket" in p.stdout.splitlines()


@pytest.mark.parametrize("report, unused", [
    (RankReport("h", 1, nnodes=1, transports={"P2P"}), True),
    (RankReport("h", 1, nnodes=1), True),
    (RankReport("h", 1, transports={"SHM"}), True),  # no nNodes line: by the channels
    (RankReport("h", 1), False),  # nothing known
    (RankReport("h", 1, nnodes=1, transports={"NET"}), False),  # one node, sockets between GPUs
    (RankReport("h", 1, nnodes=2, transports={"P2P"}), False),  # multi-node NVLink: not unused
    (RankReport("h", 1, nnodes=1, transports={"COLLNET"}), False),
])
def test_network_unused(report: RankReport, unused: bool) -> None:
    assert ncclog.network_unused(report) is unused


def test_root_causes_put_consequences_under_their_cause() -> None:
    assert ncclog.root_causes(["socket_fallback", "no_ib_device", "plugin_not_found"]) == {
        "no_ib_device": ["socket_fallback"], "plugin_not_found": []}
    # The likeliest cause the log shows: a setting before a missing device.
    assert ncclog.root_causes(["no_ib_device", "socket_fallback", "socket_forced_by_env"]) == {
        "no_ib_device": [], "socket_forced_by_env": ["socket_fallback"]}
    assert ncclog.root_causes(["gdr_disabled", "gdr_disabled_by_env"]) == {
        "gdr_disabled_by_env": ["gdr_disabled"]}
    # Without a cause in the log, a consequence is a root of its own.
    assert ncclog.root_causes(["gdr_disabled", "socket_fallback"]) == {
        "gdr_disabled": [], "socket_fallback": []}


def test_explain_json() -> None:
    paths = [str(p) for p in LOGS]
    p = explain("--json", *paths)
    assert p.returncode == 1
    out = json.loads(p.stdout)
    assert [f["path"] for f in out["files"]] == paths
    for f in out["files"]:
        assert f["nccl_log"] is True and f["error"] is None
        assert f["ranks"] == [EXPECTED[Path(f["path"]).name]]
    assert out["summary"] == {
        "ranks": 6, "nccl_versions": ["2.28.9"], "net": "Socket",
        "transports": ["NET", "P2P", "SHM"], "net_transports": ["Socket"], "gdr": False,
        "hcas": [], "problems": SOCKET_PROBLEMS}
    assert out["exit_status"] == 1


def test_explain_warnings_and_empty_host(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    log.write_text("\n".join([":7:7 [2] NCCL INFO Using network IB",
                              "", ":7:7 [2] misc/ibvwrap.cc:187 NCCL WARN Call to "
                              "ibv_modify_qp failed with error Network is unreachable"]) + "\n")
    p = explain(str(log))
    assert p.returncode == 1
    assert "(no hostname) pid 7 (GPU 2), NCCL version unknown" in p.stdout
    assert ("    nccl_warn: NCCL printed 1 WARN line; first: Call to ibv_modify_qp failed with "
            "error Network is unreachable") in p.stdout


def test_explain_not_an_nccl_log(tmp_path: Path) -> None:
    other = tmp_path / "train.log"
    other.write_text("epoch 1 loss 0.3\n")
    p = explain(str(other))
    assert p.returncode == 2
    assert f"{other}: not an NCCL log (no 'NCCL INFO' or 'NCCL WARN' lines)" in p.stdout
    p = explain("--json", str(other))
    assert p.returncode == 2
    assert json.loads(p.stdout)["files"] == [
        {"path": str(other), "nccl_log": False, "error": None, "ranks": []}]
    # next to a real log it is only mentioned; the log decides the exit status
    p = explain(str(other), str(SYNTHETIC))
    assert p.returncode == 0
    assert p.stdout.splitlines()[-1] == (
        "overall: 1 process in 1 NCCL log, 1 not an NCCL log: looks fine")


def test_explain_unreadable(tmp_path: Path) -> None:
    missing = tmp_path / "missing.log"
    p = explain(str(missing), str(SYNTHETIC))
    assert p.returncode == 2
    assert p.stderr.strip() == f"{missing}: cannot read: No such file or directory"
    p = explain("--json", str(tmp_path))
    assert p.returncode == 2
    assert json.loads(p.stdout)["files"][0]["error"] == "Is a directory"
    assert p.stderr.strip() == f"{tmp_path}: cannot read: Is a directory"


def test_explain_stdin_and_usage() -> None:
    p = explain("-", stdin=SYNTHETIC.read_text())
    assert p.returncode == 0 and "node1 pid 4242" in p.stdout
    p = explain()
    assert p.returncode == 2 and p.stderr == (
        "gpunet-probe explain-log: error: the following arguments are required: FILE "
        "(try `gpunet-probe explain-log --help`)\n")
    p = explain("--bogus", str(SYNTHETIC))
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "unrecognized arguments: --bogus" in p.stderr
    p = explain("--help")
    assert p.returncode == 0 and "Exit codes" in p.stdout
