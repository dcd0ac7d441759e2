"""NCCL_DEBUG=INFO log parser: the network, transports and GPUDirect RDMA NCCL used, and problems.

Reads the line formats of NCCL 2.18 to 2.30 (docs/formats.md section 5) and the
legacy per-connection lines of older releases. One report per process (host, pid); lines it does
not know are skipped, and no input makes it raise. What each problem code means and what to check:
docs/nccl-log.md. No torch here: the exporter imports this module.
"""

from __future__ import annotations

import io
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TextIO

from gpunet_exporter.nccl.env import env_findings
from gpunet_exporter.sources.sysfs import parse_int, parse_uint

MAX_WARNINGS = 20
# NCCL formats a log line into a 1024-byte buffer (src/debug.cc); anything much longer is not one
# of its lines, and cutting it keeps the regular expressions linear on garbage.
MAX_LINE = 8192

# One line of explanation per problem code, most serious first; docs/nccl-log.md says more.
PROBLEMS: dict[str, str] = {
    "ib_completion_error": "an InfiniBand work request completed with an error (transport or "
                           "RNR retries exceeded, protection error): a link, cable, switch or "
                           "peer problem, or missing peermem/ATS settings",
    "socket_fallback": "NCCL's network is TCP sockets (NET/Socket), not InfiniBand/RoCE: "
                       "traffic between nodes gets a small fraction of the fabric's bandwidth",
    "ib_disabled_by_env": "NCCL_IB_DISABLE is set in the environment: NCCL will not use "
                          "InfiniBand/RoCE even where it exists",
    "socket_forced_by_env": "NCCL_NET=Socket is set in the environment: NCCL uses TCP sockets "
                            "even where InfiniBand/RoCE exists",
    "gdr_disabled_by_env": "NCCL_NET_GDR_LEVEL (or its former name NCCL_IB_GDR_LEVEL) is LOC or "
                           "0 in the environment: GPUDirect RDMA is off by setting, and every "
                           "network message is staged through host memory",
    "no_ib_device": "NCCL found no usable InfiniBand/RoCE device (no HCA, no active port, "
                    "rdma-core/libibverbs missing, or filtered out by NCCL_IB_HCA)",
    "plugin_not_found": "no external NCCL net plugin (libnccl-net.so) was found and NCCL ended "
                        "up on sockets: if this cluster needs one (aws-ofi-nccl, HPC-X SHARP), "
                        "check NCCL_NET_PLUGIN and LD_LIBRARY_PATH",
    "gdr_disabled": "GPUDirect RDMA is off: the NIC cannot reach GPU memory and every message "
                    "is staged through host memory (check nvidia_peermem or DMA-BUF, "
                    "NCCL_NET_GDR_LEVEL, the GPU-NIC PCIe path)",
    "p2p_disabled_by_env": "NCCL_P2P_DISABLE=1 (or NCCL_P2P_LEVEL=LOC) is set in the "
                           "environment: GPUs of one node exchange data through host memory "
                           "(SHM) or the network instead of NVLink or PCIe peer-to-peer",
    "nccl_warn": "NCCL printed WARN lines",
}


@dataclass
class RankReport:
    """What one NCCL process's log says. Field meanings: docs/nccl-log.md."""

    host: str
    pid: int
    rank: int | None = None
    nranks: int | None = None
    nnodes: int | None = None
    cuda_dev: int | None = None
    nccl_version: str = ""
    net: str = ""
    transports: set[str] = field(default_factory=set)
    net_transports: set[str] = field(default_factory=set)
    gdr: bool | None = None
    gdr_enabled_hcas: list[str] = field(default_factory=list)
    gdr_disabled: bool = False
    hcas: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """asdict() with the sets as sorted lists: JSON-able."""
        return {k: sorted(v) if isinstance(v, set) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RankReport:
        """The inverse of to_dict() (for reports sent between ranks as JSON); unknown keys are
        ignored, missing ones take their defaults."""
        r = cls(host=str(d.get("host", "")), pid=int(d.get("pid", 0)))
        for f in fields(cls):
            if f.name in d and f.name not in ("host", "pid"):
                v = d[f.name]
                setattr(r, f.name, set(v) if isinstance(getattr(r, f.name), set) else v)
        return r


_A = re.ASCII
# src/debug.cc: "%s:%d:%d [%d] NCCL INFO " and "\n%s:%d:%d [%d] %s:%d NCCL WARN ", from 2.26 with
# an optional "[%F %T] " timestamp in front. Searched, not anchored, so that a launcher's prefix
# ("0: " from srun --label, "[default0]:" from torchrun) or a timestamp is skipped. The host
# cannot start in the middle of a word, which keeps the search linear.
_PREFIX = re.compile(
    r"(?<![^\s:\[\]])(?P<host>[^\s:\[\]]*):(?P<pid>[0-9]+):(?P<tid>[0-9]+) "
    r"\[(?P<dev>-?[0-9]+)\] (?:[^\s\[\]]+:[0-9]+ )?NCCL (?P<level>INFO|WARN)(?: |$)", _A)
# Lines pasted without the host:pid:tid part (as people paste them into issues and chats):
# "NCCL INFO <message>", optionally after "[cudaDev] ", or a bare message of the kinds that say
# how NCCL connected (channel lines, the network choice, its devices, the settings it read).
_PASTED = re.compile(r"^\s*(?:\[(?P<dev>-?[0-9]+)\] )?NCCL (?P<level>INFO|WARN)(?: |$)", _A)
_BARE_MESSAGE = re.compile(
    r"^\s*(?:(?:Channel|Ring) [0-9]+(?:/[0-9]+)? : .* via |Using network |NET/[^:]+?: ?Using "
    r"|NET/IB ?: No device found|NCCL_[A-Z0-9_]+ set (?:by environment )?to )", _A)
PASTED = ("", 0)  # the (host, pid) of the lines without a prefix
_VERSION = re.compile(r"(?:^|\s)NCCL version ([0-9][0-9A-Za-z._+-]*)", _A)
_USING_NETWORK = re.compile(r"^Using network (.+)$")
_PLUGIN_MISSING = re.compile(
    r"^NET/Plugin ?: (?:No plugin found|Could not find|Plugin load \S+ returned)")
_INIT_FAILED = re.compile(r"^Failed to initialize NET plugin (\S+)")
_NO_IB_DEVICE = re.compile(r"^NET/IB ?: No device found")
_NET_USING = re.compile(r"^NET/([^:]+?) ?: Using(.*)$")
_NET_DEVICE = re.compile(r"\[[0-9]+\]([^\s:\[\]]+):[0-9]+/\S+", _A)
# 2.27+: "NET/IB: [%d] %s:%s:%d/%s provider=%s speed=%d ..." for each device NCCL accepted.
_IB_DEVICE_LINE = re.compile(r"^NET/IB ?: \[[0-9]+\] ([^\s:]+):[^\s:]*:[0-9]+/\S+ provider=", _A)
_GDR_HCA = re.compile(
    r"^NET/([^:]+?) ?: GPU Direct RDMA (Enabled|Disabled) for HCA [0-9]+ '([^']*)'", _A)
# graph/paths.cc per GPU/NIC pair ("for GPU %lx / HCA %d (distance ...)" and later forms), and
# the old "NET/IB : GPU Direct RDMA Disabled for GPU %d / HCA %s (no module ...)".
_GDR_PAIR = re.compile(r"^(?:NET/([^:]+?) ?: )?GPU Direct RDMA (Enabled|Disabled) for GPU ")
_CHANNEL = re.compile(
    r"^(?:Channel|Ring) [0-9]+(?:/[0-9]+)? : [0-9]+(?:\[\w+\])? -> [0-9]+(?:\[\w+\])?"
    r"(?: \[(?:send|receive)\])? via (.+)$", _A)
_COLLNET = re.compile(r"^Coll(?:Net)? [0-9]+(?:/[0-9]+)? : [0-9]+ \[(?:send|receive)\] via (.+)$",
                      _A)
_NET_PATH = re.compile(r"^NET/([^/]+)/[0-9]+(?:\([0-9]+\))?(.*)$", _A)
_ENV = re.compile(r"^([A-Z][A-Z0-9_]*) set by environment to (.*)$", _A)
_ENV_SET = re.compile(r"^(NCCL_[A-Z0-9_]+) set to (.*)$", _A)
_RANK = re.compile(r"\brank ([0-9]+) nranks ([0-9]+)\b", _A | re.IGNORECASE)
_CUDA_DEV = re.compile(r"\bcudaDev ([0-9]+)\b", _A)
_NNODES = re.compile(r"\bnNodes ([0-9]+)\b", _A)
_COMPLETION = re.compile(r"Got completion from peer .* with (?:error|status)")


# The faults of the NCCL environment audit (exporter.ncclenv) and their problem codes here.
ENV_PROBLEMS = {"ib_disabled": "ib_disabled_by_env", "socket_forced": "socket_forced_by_env",
                "gdr_disabled": "gdr_disabled_by_env", "p2p_disabled": "p2p_disabled_by_env"}


# Problems that follow from others: each consequence, and the problems that cause it, the likeliest
# first. explain-log lists a consequence under the first of its causes the log shows.
CONSEQUENCES: dict[str, tuple[str, ...]] = {
    "socket_fallback": ("socket_forced_by_env", "ib_disabled_by_env", "no_ib_device",
                        "plugin_not_found"),
    "gdr_disabled": ("gdr_disabled_by_env",),
}


def network_unused(r: RankReport) -> bool:
    """A single-node job whose channels all went P2P or SHM: no NET or COLLNET channel, on one
    node by NCCL's own count (``nNodes 1``), or, where the log lacks that count, with channels
    seen (as the no_ib_device rule judges). The network NCCL picked was never used."""
    if r.transports & {"NET", "COLLNET"}:
        return False
    return r.nnodes == 1 or (r.nnodes is None and bool(r.transports))


def root_causes(problems: list[str]) -> dict[str, list[str]]:
    """The problems that no other explains, each with the consequences it explains."""
    tree: dict[str, list[str]] = {}
    for code in problems:
        cause = next((c for c in CONSEQUENCES.get(code, ()) if c in problems), None)
        if cause is None:
            tree.setdefault(code, [])
        else:
            tree.setdefault(cause, []).append(code)
    return tree


def harmful_env(env: dict[str, str]) -> set[str]:
    """The problem codes of the NCCL settings in ``env`` that certainly take a fast path away,
    judged by the same rules as the topology collector's audit of GPU processes
    (exporter.ncclenv; an NCCL_IB_HCA naming no device is not judged: the log's machine is not
    this one)."""
    return {ENV_PROBLEMS[issue] for _, issue in env_findings(env, (), ()) if issue in ENV_PROBLEMS}


class _Rank:
    """A report being built, with what the problem rules need beyond the report's fields."""

    def __init__(self, host: str, pid: int) -> None:
        self.report = RankReport(host=host, pid=pid)
        self.devs: Counter[int] = Counter()
        self.comm_nranks = -1
        self.comm_dev: int | None = None
        self.ib_device_lines: list[str] = []
        self.no_ib_device = False
        self.ib_init_failed = False
        self.plugin_missing = False
        self.net_channel = False
        self.net_channel_gdr = False
        self.fabric_channel = False  # a NET channel over something other than Socket
        self.hca_gdr_disabled = False
        self.pair_gdr_disabled = False
        self.pair_gdr_enabled = False
        self.completion_error = False
        self.warned = False

    def line(self, level: str, msg: str) -> None:
        r = self.report
        if level == "WARN":
            self.warned = True
            if len(r.warnings) < MAX_WARNINGS:
                r.warnings.append(msg)
            if _COMPLETION.search(msg):
                self.completion_error = True
            return
        if "Got completion from peer" in msg and _COMPLETION.search(msg):
            self.completion_error = True
            return
        if msg.startswith(("Channel ", "Ring ")):
            m = _CHANNEL.match(msg)
            if m:
                self._via(m.group(1).strip())
            return
        if msg.startswith("Coll"):
            m = _COLLNET.match(msg)
            if m and m.group(1).startswith("COLLNET/"):
                r.transports.add("COLLNET")
            return
        if msg.startswith("NET/"):
            self._net_line(msg)
            return
        if "GPU Direct RDMA" in msg:
            self._gdr_pair(msg)
            return
        m = _USING_NETWORK.match(msg)
        if m:
            if not r.net:
                r.net = m.group(1).strip()
            return
        m = _INIT_FAILED.match(msg)
        if m:
            if m.group(1) == "IB":
                self.ib_init_failed = True
            return
        if msg.startswith("NCCL version "):
            m = _VERSION.match(msg)
            if m:
                r.nccl_version = m.group(1).split("+", 1)[0]
            return
        m = _ENV.match(msg) or _ENV_SET.match(msg)
        if m:
            value = m.group(2).strip()
            r.env[m.group(1)] = value[:-1] if value.endswith(".") else value
            return
        if "rank " in msg:
            m = _RANK.search(msg)
            rank, nranks = (parse_uint(m.group(1)), parse_uint(m.group(2))) if m else (None, None)
            if rank is not None and nranks is not None and nranks > self.comm_nranks:
                self.comm_nranks = nranks
                r.rank, r.nranks = rank, nranks
                d = _CUDA_DEV.search(msg)
                self.comm_dev = parse_uint(d.group(1)) if d else None
            if rank is not None and nranks == self.comm_nranks:
                # "comm 0x... rank R nRanks N nNodes M ...": the world's line without cudaDev.
                n = _NNODES.search(msg)
                if n:
                    r.nnodes = parse_uint(n.group(1))

    def _via(self, path: str) -> None:
        r = self.report
        if path.startswith("NET/"):
            m = _NET_PATH.match(path)
            if not m:
                return
            name = m.group(1).strip()
            r.transports.add("NET")
            r.net_transports.add(name)
            self.net_channel = True
            if name != "Socket":
                self.fabric_channel = True
            if "/GDRDMA" in m.group(2):
                self.net_channel_gdr = True
        elif path.startswith("P2P/"):
            r.transports.add("P2P")
        elif path.startswith("SHM/"):
            r.transports.add("SHM")
        elif path.startswith("COLLNET/"):
            r.transports.add("COLLNET")

    def _net_line(self, msg: str) -> None:
        r = self.report
        if _PLUGIN_MISSING.match(msg):
            self.plugin_missing = True
        elif _NO_IB_DEVICE.match(msg):
            self.no_ib_device = True
        elif "GPU Direct RDMA" in msg:
            m = _GDR_HCA.match(msg)
            if not m:
                self._gdr_pair(msg)
            elif m.group(2) == "Enabled":
                if m.group(3) not in r.gdr_enabled_hcas:
                    r.gdr_enabled_hcas.append(m.group(3))
            elif m.group(1).strip() != "Socket":  # sockets never do GDR: not news
                r.gdr_disabled = self.hca_gdr_disabled = True
        elif " provider=" in msg:
            m = _IB_DEVICE_LINE.match(msg)
            if m and m.group(1) not in self.ib_device_lines:
                self.ib_device_lines.append(m.group(1))
        else:
            m = _NET_USING.match(msg)
            if m and m.group(1).strip() != "Socket":
                devices = m.group(2).split("; OOB", 1)[0]
                for name in _NET_DEVICE.findall(devices):
                    if name not in r.hcas:
                        r.hcas.append(name)

    def _gdr_pair(self, msg: str) -> None:
        m = _GDR_PAIR.match(msg)
        if not m or (m.group(1) or "").strip() == "Socket":
            return
        if m.group(2) == "Enabled":
            self.pair_gdr_enabled = True
        else:
            self.report.gdr_disabled = self.pair_gdr_disabled = True

    def finish(self) -> RankReport:
        r = self.report
        if self.comm_dev is not None:
            r.cuda_dev = self.comm_dev
        elif self.devs:
            r.cuda_dev = self.devs.most_common(1)[0][0]  # first seen among equals
        if not r.hcas:
            r.hcas = list(self.ib_device_lines)
        r.gdr = self.net_channel_gdr if self.net_channel else None
        if not r.net and self.net_channel:  # no "Using network" line (a pasted excerpt)
            r.net = ", ".join(sorted(r.net_transports))
        problems = harmful_env(r.env)
        ib_disabled = "ib_disabled_by_env" in problems
        ib_present = bool(r.hcas)
        if "Socket" in r.net_transports or (r.net == "Socket" and (ib_present or ib_disabled)):
            problems.add("socket_fallback")
            if self.plugin_missing:
                problems.add("plugin_not_found")
        # A job on one node whose channels all went P2P or SHM needed no network device.
        single_node = bool(r.transports) and not self.net_channel
        if not single_node and (self.no_ib_device or (self.ib_init_failed and not ib_disabled)):
            problems.add("no_ib_device")
        if not self.net_channel_gdr and (
                self.fabric_channel
                or (self.hca_gdr_disabled and not r.gdr_enabled_hcas)
                or (self.pair_gdr_disabled and not self.pair_gdr_enabled)):
            problems.add("gdr_disabled")
        if self.warned:
            problems.add("nccl_warn")
        if self.completion_error:
            problems.add("ib_completion_error")
        r.problems = sorted(problems)
        return r


class LogParser:
    """Feed lines one at a time (a file of any size in constant memory), then finish()."""

    def __init__(self) -> None:
        self._ranks: dict[tuple[str, int], _Rank] = {}
        self._pending_version = ""
        self.nccl_lines = 0  # lines with the NCCL INFO/WARN prefix

    def feed(self, line: str) -> None:
        line = line[:MAX_LINE]
        if "NCCL" not in line:
            if ("via " in line or "Using" in line or "No device" in line) and \
                    _BARE_MESSAGE.match(line):
                self._add(PASTED, None, "INFO", line.strip())
            return
        m = _PREFIX.search(line)
        if m is not None:
            pid, dev = parse_uint(m.group("pid")), parse_int(m.group("dev"))
            if pid is None or dev is None:  # numbers "%d" cannot print: not one of its lines
                return
            self._add((m.group("host"), pid), dev, m.group("level"), line[m.end():].strip())
            return
        v = _VERSION.search(line)  # printed without prefix by the rank that makes the id
        if v:
            self._pending_version = v.group(1).split("+", 1)[0]
            return
        m = _PASTED.match(line)
        if m is not None:
            dev = parse_int(m.group("dev")) if m.group("dev") else None
            self._add(PASTED, dev, m.group("level"), line[m.end():].strip())
        elif _BARE_MESSAGE.match(line):  # "NCCL_IB_HCA set by environment to ..."
            self._add(PASTED, None, "INFO", line.strip())

    def _add(self, key: tuple[str, int], dev: int | None, level: str, msg: str) -> None:
        self.nccl_lines += 1
        rank = self._ranks.get(key)
        if rank is None:
            rank = self._ranks[key] = _Rank(*key)
        if dev is not None:
            rank.devs[dev] += 1
        if self._pending_version and not rank.report.nccl_version:
            rank.report.nccl_version, self._pending_version = self._pending_version, ""
        rank.line(level, msg)

    def finish(self) -> list[RankReport]:
        reports = [r.finish() for r in self._ranks.values()]
        if self._pending_version:
            if not reports:
                reports.append(RankReport(host="", pid=0))
            for r in reports:
                r.nccl_version = r.nccl_version or self._pending_version
        return reports


def parse_lines(lines: Iterable[str]) -> list[RankReport]:
    """One report per (host, pid) seen, in first-seen order."""
    parser = LogParser()
    for line in lines:
        parser.feed(line)
    return parser.finish()


def read_lines(fh: TextIO) -> Iterator[str]:
    """The lines of a text file, each cut to MAX_LINE characters, so that a file without
    newlines (a binary, a core dump) is read in constant memory."""
    rest_of_long_line = False
    while True:
        piece = fh.readline(MAX_LINE)
        if not piece:
            return
        if not rest_of_long_line:
            yield piece
        rest_of_long_line = not piece.endswith("\n")


def parse_file(path: str | os.PathLike[str], offset: int = 0) -> list[RankReport]:
    """Parse one log file from byte ``offset`` on (UTF-8, undecodable bytes replaced); raises
    OSError. A process that makes one NCCL group after another writes one file for all: a
    group's lines are those after the file's size when it began (the fleet's pair worker)."""
    with open(path, "rb") as raw:
        raw.seek(offset)
        with io.TextIOWrapper(raw, encoding="utf-8", errors="replace") as fh:
            return parse_lines(read_lines(fh))


def looks_like_nccl_log(lines: Iterable[str]) -> bool:
    """At least one line with the NCCL INFO or WARN prefix."""
    return any("NCCL" in line and _PREFIX.search(line[:MAX_LINE]) for line in lines)


def summarize(reports: list[RankReport]) -> dict[str, Any]:
    """Across ranks: the network(s), union of transports, HCAs and problems; gdr False when any
    rank has NET channels without GPUDirect RDMA, True when some have it and none lack it."""
    nets = list(dict.fromkeys(r.net for r in reports if r.net))
    gdrs = {r.gdr for r in reports if r.gdr is not None}
    hcas: dict[str, None] = {}
    for r in reports:
        hcas.update(dict.fromkeys(r.hcas))
    return {
        "ranks": len(reports),
        "nccl_versions": sorted({r.nccl_version for r in reports if r.nccl_version}),
        "net": nets[0] if len(nets) == 1 else ", ".join(sorted(nets)),
        "transports": sorted(set().union(*(r.transports for r in reports))),
        "net_transports": sorted(set().union(*(r.net_transports for r in reports))),
        "gdr": False if False in gdrs else (True if gdrs else None),
        "hcas": list(hcas),
        "problems": sorted(set().union(*(r.problems for r in reports))),
    }
