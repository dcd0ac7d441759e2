"""The InfiniBand fabric as infiniband-diags print it: parsers for ``iblinkinfo -l``,
``ibqueryerrors`` and ``dump_fts``, and :func:`sweep`, which runs them (never through a shell,
each with a timeout) and joins what they print into one :class:`Fabric`.

One sweep discovers the subnet once (``ibnetdiscover --cache``) and runs the other tools on that
cache; a step that fails costs its own part (``Fabric.failed``), discovery failing the whole
sweep. The steps: docs/architecture.md, "sources"; formats: docs/formats.md §10.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from gpunet_exporter.sources.commands import CommandError, run_command

BYTES_PER_GBIT = 125_000_000
# Lane speeds as libibmad prints them (mad_dump_linkspeed/linkspeedext, and iblinkinfo's
# "FDR10"), to the nominal lane rate the kernel's rate file uses (4X HDR is "200 Gb/sec").
LANE_GBPS = {"2.5": 2.5, "5.0": 5.0, "10.0": 10.0, "FDR10": 10.0, "14.0625": 14.0,
             "25.78125": 25.0, "53.125": 50.0, "106.25": 100.0, "212.5": 200.0}
STATES = {"Down": 1, "Initialize": 2, "Armed": 3, "Active": 4, "ActDefer": 5}
PHYS_STATES = {"Sleep": 1, "Polling": 2, "Disabled": 3, "PortConfigurationTraining": 4,
               "LinkUp": 5, "LinkErrorRecovery": 6, "PhyTest": 7}
# ibqueryerrors' error counter names (its threshold file's keys).
ERROR_COUNTERS = ("SymbolErrorCounter", "LinkErrorRecoveryCounter", "LinkDownedCounter",
                  "PortRcvErrors", "PortRcvRemotePhysicalErrors", "PortRcvSwitchRelayErrors",
                  "PortXmitDiscards", "PortXmitConstraintErrors", "PortRcvConstraintErrors",
                  "LocalLinkIntegrityErrors", "ExcessiveBufferOverrunErrors", "VL15Dropped",
                  "PortXmitWait")
STEPS = ("discover", "links", "counters", "errors", "routes")
T = TypeVar("T")


class ParseError(ValueError):
    """Output a parser does not recognise at all."""


@dataclass(frozen=True)
class Link:
    """One switch port as ``iblinkinfo -l`` prints it."""

    switch: str  # node GUID, 0x + 16 hex digits
    switch_name: str  # node description
    port: int
    state: int | None  # STATES
    phys_state: int | None  # PHYS_STATES
    width: int | None  # active lanes; None while down
    lane_gbps: float | None  # nominal active lane rate
    remote: str = ""  # neighbour's port GUID ("" when down)
    remote_port: int | None = None
    remote_name: str = ""
    remote_lid: int | None = None
    could_width: int | None = None  # "Could be 12X": the widest both ends support, when wider
    could_lane_gbps: float | None = None

    @property
    def rate_gbps(self) -> float | None:
        if self.width is None or self.lane_gbps is None:
            return None
        return self.width * self.lane_gbps

    @property
    def supported_gbps(self) -> float | None:
        """What both ends support: iblinkinfo's "Could be" values, else what it runs at."""
        width = self.could_width or self.width
        lane = self.could_lane_gbps or self.lane_gbps
        if width is None or lane is None:
            return None
        return width * lane


_LINK = re.compile(
    r'^(?P<guid>0x[0-9a-fA-F]+)\s+"(?P<name>[^"]*)"\s+(?P<lid>\d+)\s+(?P<port>\d+)\[[^\]]*\]\s+'
    r'==\(\s*(?P<mid>[^)]*?)\s*\)==>\s+'
    r'(?:(?P<rguid>0x[0-9a-fA-F]+)\s+(?P<rlid>\d+)\s+(?P<rport>\d+))?\s*\[[^\]]*\]\s+'
    r'"(?P<rname>[^"]*)"\s+\((?P<tail>.*)\)\s*$')
_MID = re.compile(r'^(?:(?P<width>\d+)X\s+)?(?:(?P<speed>[\d.]+) Gbps\s+|(?P<fdr10>FDR10)\s+)?'
                  r'(?P<state>\w+)/\s*(?P<phys>\w+)')
_COULD_WIDTH = re.compile(r"Could be (\d+)X")
_COULD_SPEED = re.compile(r"Could be ([\d.]+) Gbps|Could be (FDR10)")


def _lane(speed: str | None) -> float | None:
    return None if speed is None else LANE_GBPS.get(speed)


def parse_iblinkinfo(text: str) -> list[Link]:
    """Switch ports from ``iblinkinfo -l --switches-only``; lines it cannot read are skipped
    (a tool's warnings), and output with none it can read and none of its headers raises."""
    out: list[Link] = []
    for line in text.splitlines():
        m = _LINK.match(line.strip())
        if not m:
            continue
        mid = _MID.match(m["mid"])
        state = phys = width = None
        lane = None
        if mid:
            state = STATES.get(mid["state"])
            phys = PHYS_STATES.get(mid["phys"])
            width = int(mid["width"]) if mid["width"] else None
            lane = _lane(mid["speed"] or mid["fdr10"])
        could_w = _COULD_WIDTH.search(m["tail"])
        could_s = _COULD_SPEED.search(m["tail"])
        out.append(Link(
            switch=_guid(m["guid"]), switch_name=m["name"].strip(), port=int(m["port"]),
            state=state, phys_state=phys, width=width if state and state > 1 else None,
            lane_gbps=lane if state and state > 1 else None,
            remote=_guid(m["rguid"]) if m["rguid"] else "",
            remote_port=int(m["rport"]) if m["rport"] else None,
            remote_lid=int(m["rlid"]) if m["rlid"] else None,
            remote_name=m["rname"].strip(),
            could_width=int(could_w.group(1)) if could_w else None,
            could_lane_gbps=_lane(could_s.group(1) or could_s.group(2)) if could_s else None))
    if not out and text.strip():
        raise ParseError("no switch port in the output of iblinkinfo")
    return out


def _guid(text: str) -> str:
    """A GUID as every label carries it: 0x and 16 lower-case hex digits."""
    return f"0x{int(text, 16):016x}"


_QE_PORT = re.compile(r"^\s*GUID (0x[0-9a-fA-F]+) port (\d+):\s*(.*)$")
_QE_FIELD = re.compile(r"\[(\w+) == (\d+)")


def parse_ibqueryerrors(text: str) -> dict[tuple[str, int], dict[str, int]]:
    """(switch GUID, port) -> {counter name: value} from ``ibqueryerrors`` (with or without
    ``--counters``); the per-node "port ALL" sums are skipped."""
    out: dict[tuple[str, int], dict[str, int]] = {}
    for line in text.splitlines():
        m = _QE_PORT.match(line)
        if not m:
            continue
        fields = {k: int(v) for k, v in _QE_FIELD.findall(m.group(3))}
        out.setdefault((_guid(m.group(1)), int(m.group(2))), {}).update(fields)
    return out


_LINES = re.compile(r"[^\n]+")
_FT_HEAD = re.compile(r"^Unicast lids .* guid (0x[0-9a-fA-F]+) ")
_FT_ENTRY = re.compile(r"^0x([0-9a-fA-F]+) (\d+) : \((Channel Adapter|Switch|Router) "
                       r"portguid (0x[0-9a-fA-F]+): '(.*)'\)")


@dataclass(frozen=True)
class Destination:
    """What a LID of the forwarding tables is: a host (channel adapter) port, a switch or a
    router, its port GUID and its node description."""

    kind: str  # "Channel Adapter", "Switch", "Router"
    guid: str
    name: str


MAX_UNICAST_LID = 0xBFFF  # IBA: unicast LIDs are 0x0001 to 0xBFFF
NO_ROUTE = 0xFF  # a linear forwarding table's "drop" port; IBA switches have at most 254 ports


@dataclass
class Forwarding:
    """Every switch's linear forwarding table, from ``dump_fts``: switch GUID -> out port per
    destination LID (a byte per LID, indexed by LID, NO_ROUTE where the table has none, port 0
    the switch itself: 10,000 hosts and 500 switches fit in 5 MB), and what each LID is."""

    tables: dict[str, bytearray] = field(default_factory=dict)
    lids: dict[int, Destination] = field(default_factory=dict)

    def port(self, switch: str, lid: int) -> int | None:
        """The port ``switch`` sends ``lid`` out of; None without a route."""
        table = self.tables.get(switch)
        if table is None or lid >= len(table) or table[lid] == NO_ROUTE:
            return None
        return table[lid]

    def host_lids_per_port(self) -> dict[str, dict[int, int]]:
        """Switch GUID -> {out port: number of host LIDs its table sends out of it}."""
        hosts = [lid for lid, d in self.lids.items() if d.kind == "Channel Adapter"]
        out: dict[str, dict[int, int]] = {}
        for sw in self.tables:
            counts = out.setdefault(sw, {})
            for lid in hosts:
                port = self.port(sw, lid)
                if port is not None:
                    counts[port] = counts.get(port, 0) + 1
        return out


def parse_forwarding(text: str) -> Forwarding:
    """The forwarding tables ``dump_fts`` (or ``dump_lfts.sh``) prints; lines it cannot read
    are skipped."""
    out = Forwarding()
    current: bytearray | None = None
    # One line at a time: at 10,000 hosts the text is about 200 MB, and a list of its lines
    # would take 340 MB more while it is parsed (bench/localize_scale.py).
    for found in _LINES.finditer(text):
        line = found.group()
        head = _FT_HEAD.match(line)
        if head:
            current = out.tables.setdefault(_guid(head.group(1)), bytearray())
            continue
        entry = _FT_ENTRY.match(line)
        if entry and current is not None:
            lid, port = int(entry.group(1), 16), int(entry.group(2))
            if lid > MAX_UNICAST_LID or port >= NO_ROUTE:
                continue
            if lid >= len(current):
                current.extend(b"\xff" * (lid + 1 - len(current)))
            current[lid] = port
            out.lids.setdefault(lid, Destination(entry.group(3), _guid(entry.group(4)),
                                                 entry.group(5).strip()))
    return out


def parse_dump_fts(text: str) -> dict[str, dict[int, int]]:
    """Switch GUID -> {out port: number of channel adapter (host) LIDs the switch's linear
    forwarding table sends out of it}, from ``dump_fts`` (or ``dump_lfts.sh``). A switch whose
    table routes no host LID has an empty map."""
    return parse_forwarding(text).host_lids_per_port()


@dataclass
class Fabric:
    """What one sweep found. ``failed`` maps a step (STEPS) that failed to why."""

    at: float = 0.0  # time.time() at the end of the sweep
    duration: float = 0.0
    links: list[Link] = field(default_factory=list)
    counters: dict[tuple[str, int], dict[str, int]] = field(default_factory=dict)
    errors: dict[tuple[str, int], dict[str, int]] | None = None  # None: the step failed
    routes: dict[str, dict[int, int]] | None = None
    forwarding: Forwarding | None = None  # the tables routes counts; None: the step failed
    step_seconds: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Tools:
    """How to run infiniband-diags: the programs, the HCA port to send from, the timeout of one
    run and extra environment (a simulator's preload)."""

    ibnetdiscover: str = "ibnetdiscover"
    iblinkinfo: str = "iblinkinfo"
    ibqueryerrors: str = "ibqueryerrors"
    dump_fts: str = "dump_fts"
    ca: str = ""
    port: int = 0
    timeout: float = 60.0
    env: Mapping[str, str] = field(default_factory=dict)

    def argv(self, program: str, *args: str) -> list[str]:
        out = [program, *args]
        if self.ca:
            out += ["-C", self.ca]
        if self.port:
            out += ["-P", str(self.port)]
        return out


def _zero_thresholds(directory: str) -> str:
    path = os.path.join(directory, "error_thresholds")
    with open(path, "w", encoding="ascii") as fh:
        fh.write("".join(f"{name}=0\n" for name in ERROR_COUNTERS))
    return path


def sweep(tools: Tools) -> Fabric:
    """One sweep of the fabric; raises CommandError (or ParseError) only when discovery fails."""
    fabric = Fabric()
    start = time.monotonic()
    env = dict(tools.env)

    def run(step: str, argv: Sequence[str], ok_status: Sequence[int] = (0,)) -> str:
        t0 = time.monotonic()
        try:
            # In the sweep's own folder: whatever a tool (or a simulator's preload, which makes
            # ./sys-<pid>) leaves in its working folder goes away with it.
            return run_command(argv, tools.timeout, env=env, ok_status=ok_status, cwd=tmp)
        finally:
            fabric.step_seconds[step] = fabric.step_seconds.get(step, 0.0) + (
                time.monotonic() - t0)

    def optional(step: str, argv: Sequence[str], parse: Callable[[str], T],
                 ok_status: Sequence[int] = (0,)) -> T | None:
        """A step after discovery: its result, or None with why it failed in ``failed``."""
        try:
            return parse(run(step, argv, ok_status))
        except (CommandError, ParseError) as exc:
            fabric.failed[step] = str(exc)
            return None

    with tempfile.TemporaryDirectory(prefix="gpunet-fabric-") as tmp:
        cache = os.path.join(tmp, "ibnetdiscover.cache")
        run("discover", tools.argv(tools.ibnetdiscover, "--cache", cache))
        fabric.links = parse_iblinkinfo(run("links", tools.argv(
            tools.iblinkinfo, "-l", "--switches-only", "--load-cache", cache)))
        fabric.counters = optional("counters", tools.argv(
            tools.ibqueryerrors, "--switch", "--counters", "--load-cache", cache),
            parse_ibqueryerrors) or {}
        fabric.errors = optional("errors", tools.argv(
            tools.ibqueryerrors, "--switch", "--threshold-file", _zero_thresholds(tmp),
            "--load-cache", cache), parse_ibqueryerrors, ok_status=(0, 1))
        fabric.forwarding = optional("routes", tools.argv(tools.dump_fts), parse_forwarding)
        if fabric.forwarding is not None:
            fabric.routes = fabric.forwarding.host_lids_per_port()
    fabric.duration = time.monotonic() - start
    fabric.at = time.time()
    return fabric
