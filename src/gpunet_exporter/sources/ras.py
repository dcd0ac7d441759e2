"""NCCL's RAS service (NCCL 2.24 and later): its client protocol, its answers and its listeners.

Every NCCL process listens on ``localhost:28028`` (``NCCL_RAS_ADDR``), all on one port through
SO_REUSEPORT. The client sends ``CLIENT PROTOCOL 2``, optionally ``TIMEOUT`` and ``SET FORMAT
json`` (NCCL 2.28.7 and later), then ``STATUS`` for the report (NVIDIA/nccl src/ras/client.cc).
Of the text report only the job summary, the communicator table and the DEAD and INCOMPLETE
errors are read. The protocol and both formats: docs/formats.md §11.
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any

PROTOCOL = 2
DEFAULT_PORT = 28028
# NCCL_NUM_FUNCTIONS in NCCL 2.28: the collective operations RAS counts per rank, by name.
OPS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")
# ncclResult_t: 0 ncclSuccess, 7 ncclInProgress (initialisation not finished); others are errors.
_FINE = (0, 7)
STATUSES = ("init", "running", "finalize", "abort")


class RasError(Exception):
    """The RAS service did not answer as the protocol says."""


class Unanswered(RasError):
    """Connected, but no answer within the time allowed (a stopped process holding a listener)."""


@dataclass
class Rank:
    rank: int
    host: str
    pid: int
    nvml_dev: int
    init_state: int = 0
    async_error: int = 0
    finalize: bool = False
    abort: bool = False
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def status(self) -> str:
        """As NCCL's own text report ranks it (client_support.cc)."""
        if self.abort:
            return "abort"
        if self.finalize:
            return "finalize"
        return "running" if self.init_state == 0 else "init"

    @property
    def errored(self) -> bool:
        return self.init_state not in _FINE or self.async_error not in _FINE


@dataclass
class Missing:
    rank: int
    host: str
    pid: int
    nvml_dev: int
    unresponsive: bool
    dead: bool


@dataclass
class Communicator:
    key: str  # hash and secondary hash: unique within the report
    size: int
    ranks: list[Rank]
    missing: list[Missing]
    hash: str = ""  # the primary hash as the report prints it (0x and hex digits), else ""

    @property
    def status(self) -> str:
        """The furthest status of its ranks (abort over finalize over init over running)."""
        seen = {r.status for r in self.ranks}
        for status in ("abort", "finalize", "init"):
            if status in seen:
                return status
        return "running"


@dataclass
class Status:
    """One RAS report. ``communicators`` is None for a text report (it groups them);
    ``groups`` then holds its table rows as (communicators, ranks per communicator, status,
    errors)."""

    format: str
    version: str = ""
    communicators: list[Communicator] | None = None
    groups: list[tuple[int, int, str, str]] = field(default_factory=list)
    collection_seconds: float | None = None
    timeouts: int | None = None
    processes: int | None = None  # the text job summary's
    nodes: int | None = None
    gpus: int | None = None
    dead_processes: int | None = None  # the text report's DEAD error
    unresponsive_processes: int | None = None  # its job-wide INCOMPLETE error
    missing_ranks: int | None = None  # the text report's INCOMPLETE communicators, summed
    dead_ranks: int | None = None  # of those, the ranks of the DEAD processes
    errored_ranks: int | None = None  # the text report's ERROR communicators, summed


@dataclass
class Exchange:
    """One conversation with a RAS server: what was sent and everything received, in order
    (the tests' captures are these)."""

    sent: list[str] = field(default_factory=list)
    received: list[bytes] = field(default_factory=list)

    @property
    def reply(self) -> bytes:
        return b"".join(self.received)


class _Conn:
    def __init__(self, sock: socket.socket, deadline: float, max_bytes: int,
                 record: Exchange) -> None:
        self.sock, self.deadline, self.max_bytes, self.record = sock, deadline, max_bytes, record
        self.buf = b""
        self.total = 0

    def _recv(self, deadline: float) -> bytes:
        left = min(deadline, self.deadline) - time.monotonic()
        if left <= 0:
            raise Unanswered("no answer in time")
        self.sock.settimeout(left)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            raise Unanswered("no answer in time") from None
        self.total += len(chunk)
        if self.total > self.max_bytes:
            raise RasError(f"the answer is longer than {self.max_bytes} bytes")
        if chunk:
            self.record.received.append(chunk)
        return chunk

    def send(self, line: str) -> None:
        self.record.sent.append(line)
        self.sock.settimeout(max(0.001, self.deadline - time.monotonic()))
        try:
            self.sock.sendall(line.encode("ascii") + b"\n")
        except TimeoutError:
            raise Unanswered("the server does not read") from None

    def line(self, deadline: float) -> str:
        while b"\n" not in self.buf:
            chunk = self._recv(deadline)
            if not chunk:
                raise RasError("the server closed the connection"
                               + (f" after {self.buf[:80]!r}" if self.buf else ""))
            self.buf += chunk
        head, _, self.buf = self.buf.partition(b"\n")
        return head.decode("utf-8", "replace").rstrip("\r")

    def rest(self) -> bytes:
        out = [self.buf]
        while chunk := self._recv(self.deadline):
            out.append(chunk)
        return b"".join(out)


def query(host: str, port: int, *, timeout: float, handshake_timeout: float = 2.0,
          max_bytes: int = 8 << 20, json_format: bool = True, ras_timeout: int | None = None,
          record: Exchange | None = None) -> Status:
    """Ask the RAS server at ``host``:``port`` for its report.

    The handshake must be answered within ``handshake_timeout`` seconds (a RAS thread answers
    at once; a stopped process's listener never does) and the whole report within ``timeout``.
    ``json_format``: ask for JSON, and take text where the server does not know it (NCCL before
    2.28.7). ``ras_timeout``: the TIMEOUT command (how long RAS waits for each leg of its own
    collection). An answer longer than ``max_bytes`` is refused. Raises OSError when nothing
    listens, Unanswered when the server is silent (or its accept queue is full), RasError when
    it says something else or its report does not end within ``timeout``, and ValueError
    when the report does not parse.
    """
    record = record if record is not None else Exchange()
    start = time.monotonic()
    deadline = start + timeout
    sock, conn = _open(host, port, start, min(timeout, handshake_timeout), deadline,
                       max_bytes, record)
    with sock:
        try:
            fmt, body = _converse(conn, deadline, json_format, ras_timeout)
        except Unanswered:  # it answered the handshake: a report too slow, not a silent peer
            raise RasError(f"no whole report within {timeout:.1f} s") from None
    if not body.strip():
        raise RasError("the server closed the connection without a report")
    return parse_json(body) if fmt == "json" else parse_text(body)


def _open(host: str, port: int, start: float, handshake_timeout: float, deadline: float,
          max_bytes: int, record: Exchange) -> tuple[socket.socket, _Conn]:
    """A connection whose handshake (CLIENT PROTOCOL, SERVER PROTOCOL) was answered within
    ``handshake_timeout`` of ``start``; its later reads end at ``deadline``. Closed again when
    the handshake fails."""
    try:
        sock = socket.create_connection((host, port), timeout=handshake_timeout)
    except TimeoutError:
        # The kernel drops the SYN when the listener's accept queue is full: a stopped process
        # whose queue filled with earlier connections (ours too) that it never accepted.
        raise Unanswered("connection not accepted in time (a full accept queue)") from None
    try:
        conn = _Conn(sock, deadline, max_bytes, record)
        conn.send(f"CLIENT PROTOCOL {PROTOCOL}")
        answer = conn.line(start + handshake_timeout)
        if not answer.upper().startswith("SERVER PROTOCOL "):
            raise RasError(f"unexpected handshake answer {answer[:80]!r}")
    except BaseException:
        sock.close()
        raise
    return sock, conn


def _converse(conn: _Conn, deadline: float, json_format: bool,
              ras_timeout: int | None) -> tuple[str, str]:
    """After the handshake: the settings, STATUS, and the report (its format, its text)."""
    if ras_timeout is not None:
        conn.send(f"TIMEOUT {ras_timeout}")
        answer = conn.line(deadline)
        if answer.upper() != "OK":
            raise RasError(f"TIMEOUT refused: {answer[:80]!r}")
    fmt = "text"
    if json_format:
        conn.send("SET FORMAT json")
        answer = conn.line(deadline)
        if answer.upper() == "OK":
            fmt = "json"
        elif not answer.upper().startswith("ERROR"):
            raise RasError(f"unexpected answer to SET FORMAT: {answer[:80]!r}")
    conn.send("STATUS")
    return fmt, conn.rest().decode("utf-8", "replace")


# -- MONITOR (NCCL 2.29.2 and later) ---------------------------------------------------------------

# The events a MONITOR stream carries (src/ras: peers.cc, ras.cc, rasnet.cc), as
# gpunet_nccl_ras_events_total's bounded label; any other is counted as "other".
EVENTS = ("PEER_NEW", "PEER_DEAD", "PEER_TIMEOUT_DEAD", "PEER_UNRESPONSIVE", "PEER_DISCONNECTED",
          "PEER_INIT_TIMEOUT", "PEER_CONNECTING")


class MonitorUnsupported(RasError):
    """The server does not know MONITOR (NCCL before 2.29.2)."""


@dataclass(frozen=True)
class Event:
    """One event of a MONITOR stream (the JSON form)."""

    event: str  # one of EVENTS, or "other"
    group: str  # LIFECYCLE or TRACE
    host: str = ""
    pid: int = -1


class Monitor:
    """One long-lived MONITOR connection: ``open()`` speaks the protocol (CLIENT PROTOCOL, SET
    FORMAT json, MONITOR ``groups``), then ``events(timeout)`` returns the events that arrived
    within ``timeout`` seconds (none when nothing came). Raises OSError when nothing listens,
    Unanswered when the handshake is not answered, MonitorUnsupported on an older NCCL,
    RasError when the server closes the connection."""

    def __init__(self, host: str, port: int, *, handshake_timeout: float = 2.0,
                 groups: str = "lifecycle,trace", max_bytes: int = 1 << 20) -> None:
        self.host, self.port, self.groups = host, port, groups
        self.handshake_timeout, self.max_bytes = handshake_timeout, max_bytes
        self.sock: socket.socket | None = None
        self.buf = b""

    def open(self) -> None:
        start = time.monotonic()
        sock, conn = _open(self.host, self.port, start, self.handshake_timeout,
                           start + self.handshake_timeout, self.max_bytes, Exchange())
        try:
            for line in ("SET FORMAT json", f"MONITOR {self.groups}"):
                conn.send(line)
                answer = conn.line(conn.deadline)
                if answer.upper() != "OK":
                    if line.startswith("MONITOR") and "unknown command" in answer.lower():
                        raise MonitorUnsupported(answer[:80])
                    raise RasError(f"{line} refused: {answer[:80]!r}")
        except BaseException:
            sock.close()
            raise
        self.sock, self.buf = sock, conn.buf

    def events(self, timeout: float) -> list[Event]:
        assert self.sock is not None, "open() first"
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(65536)
        except TimeoutError:
            return []
        if not chunk:
            raise RasError("the server closed the MONITOR connection")
        self.buf += chunk
        if len(self.buf) > self.max_bytes:
            raise RasError(f"an event longer than {self.max_bytes} bytes")
        out, self.buf = parse_events(self.buf)
        return out

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


_DECODER = json.JSONDecoder()


def parse_events(buf: bytes) -> tuple[list[Event], bytes]:
    """The whole JSON events at the start of ``buf`` (client_support.cc
    rasClientsNotifyEvent), and the rest, which may be the start of the next one. Raises
    RasError on something that is not an event."""
    text = buf.decode("utf-8", "replace")
    out: list[Event] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            break
        if text[pos] != "{":
            raise RasError(f"not a MONITOR event: {text[pos:pos + 80]!r}")
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the rest of it has not arrived yet
        pos = end
        if not isinstance(obj, dict):
            raise RasError(f"not a MONITOR event: {obj!r:.80}")
        name = str(obj.get("event", ""))
        raw = obj.get("peer")
        peer: dict[str, Any] = raw if isinstance(raw, dict) else {}
        pid = peer.get("pid", -1)
        out.append(Event(name if name in EVENTS else "other", str(obj.get("group", ""))[:16],
                         str(peer.get("host", peer.get("addr", "")))[:64],
                         pid if isinstance(pid, int) else -1))
    return out, text[pos:].encode()


# -- JSON (NCCL 2.28.7 and later) ----------------------------------------------------------------

def _int(obj: dict[str, Any], key: str, default: int = 0) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: {value!r} is not an integer")
    return value


def _bool(obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: {value!r} is not true or false")
    return value


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{what} is not a list")
    return value


# NCCL 2.28.9 writes a missing rank's "nvml_dev" without the comma before its "status"
# (jsonWriteMissingRank; fixed in later releases): the one repair made before parsing.
_NO_COMMA = re.compile(r'("nvml_dev": -?\d+)(\s*\n\s*"status")')
# A communicator's hash as NCCL 2.28.9's JSON prints it: 0x and the hex digits of a uint64_t.
_HASH = re.compile(r"0x[0-9a-fA-F]{1,16}")


def parse_json(text: str) -> Status:
    """The JSON report (client_support.cc rasDumpCommsToJSON)."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        try:
            raw = json.loads(_NO_COMMA.sub(r"\1,\2", text))
        except json.JSONDecodeError:
            raise ValueError(f"not JSON: {exc}") from None
    doc = _obj(raw, "the report")
    comms: list[Communicator] = []
    keys: set[str] = set()
    for i, raw in enumerate(_list(doc.get("communicators", []), "communicators")):
        c = _obj(raw, f"communicators[{i}]")
        ranks = []
        for r in _list(c.get("ranks", []), "ranks"):
            r = _obj(r, "a rank")
            st = _obj(r.get("status", {}), "a rank's status")
            counts = _obj(r.get("collective_counts", {}), "collective_counts")
            ranks.append(Rank(
                rank=_int(r, "rank"), host=str(r.get("host", "")), pid=_int(r, "pid", -1),
                nvml_dev=_int(r, "nvml_dev", -1), init_state=_int(st, "init_state"),
                async_error=_int(st, "async_error"),
                finalize=_bool(st, "finalize_called") or _bool(st, "destroy_flag"),
                abort=_bool(st, "abort_flag"),
                counts={str(k): _int(counts, k) for k in counts}))
        missing = []
        for m in _list(c.get("missing_ranks", []), "missing_ranks"):
            m = _obj(m, "a missing rank")
            st = _obj(m.get("status", {}), "a missing rank's status")
            missing.append(Missing(
                rank=_int(m, "rank"), host=str(m.get("host", "")), pid=_int(m, "pid", -1),
                nvml_dev=_int(m, "nvml_dev", -1), unresponsive=_bool(st, "unresponsive"),
                dead=_bool(st, "considered_dead")))
        primary = str(c.get("hash", ""))
        key = f"{primary[:64]}/{str(c.get('secondary_hash', ''))[:64]}"
        if key in keys:
            key += f"/{i}"
        keys.add(key)
        comms.append(Communicator(key=key, size=_int(c, "size"), ranks=ranks, missing=missing,
                                  hash=primary if _HASH.fullmatch(primary) else ""))
    ras = _obj(doc.get("ras", {}), "ras")
    seconds = ras.get("collection_time_sec")
    return Status(
        format="json", version=str(doc.get("nccl_version", ""))[:32], communicators=comms,
        collection_seconds=float(seconds) if isinstance(seconds, (int, float)) else None,
        timeouts=_int(ras, "timeouts_count") if "timeouts_count" in ras else None)


# -- text (every release) ------------------------------------------------------------------------

_VERSION = re.compile(r"^NCCL version (\S+)", re.M)
_SUMMARY = re.compile(
    r"^Job summary\n=+\n\n\s*Nodes\s+Processes\s+GPUs\s+Processes\s+GPUs\n.*\n"
    r"\s*(\d+)\s+\d+\s+\d+\s+(\d+)\s+(\d+)\s*$", re.M)
_GROUP = re.compile(
    r"^\s*\d+\s+(\d+)\s+\d+\s+[\d-]+\s+(\d+)\s+\d+\s+([A-Z]+)\s+([A-Z,]+)\s*$", re.M)
_DEAD = re.compile(r"^DEAD\n\s+(\d+) job process(?:es)? (?:is |are )?considered dead", re.M)
_UNRESPONSIVE = re.compile(r"^INCOMPLETE\n\s+Missing communicator data from (\d+) job process",
                           re.M)
_MISSING = re.compile(r"^#\d+-\d+ \(\w+\) INCOMPLETE\n\s+Missing communicator data from (\d+) "
                      r"rank", re.M)
# A process named in the DEAD error, and a rank named under a communicator's INCOMPLETE one
# (client_support.cc; up to RAS_CLIENT_DETAIL_THRESHOLD, 10, of each are listed).
_PROCESS = re.compile(r"^\s+Process (\d+) on node (\S+) managing GPU", re.M)
_RANK = re.compile(r"^\s+Rank \d+ -- (?:GPU .* managed by process (\d+) on node (\S+)|\[)",
                   re.M)
_COLLECTED = re.compile(r"^Communicators\.\.\. \((\d+(?:\.\d+)?)s\)", re.M)
_TIMEOUTS = re.compile(r"Encountered (\d+) communication timeouts?")
_ERRORED = re.compile(r"^\s+(?:Initialization|Asynchronous) errors? on (\d+) ranks?$", re.M)


def parse_text(text: str) -> Status:
    """What the text report says in a fixed form: the job summary (when every node runs as
    many processes of as many GPUs), the communicator table, and the DEAD, INCOMPLETE and
    ERROR entries of its Errors section."""
    if "Job summary" not in text and "Communicators" not in text:
        raise ValueError("not a RAS report: " + repr(text[:80]))
    out = Status(format="text")
    if m := _VERSION.search(text):
        out.version = m.group(1)[:32]
    if m := _SUMMARY.search(text):
        out.nodes, out.processes, out.gpus = (int(g) for g in m.groups())
    table = text.split("Communicators", 1)[1] if "Communicators" in text else ""
    table = table.split("\n\n\n", 1)[0] if "\n\n\n" in table else table.split("\nErrors\n")[0]
    out.groups = [(int(n), int(size), status.lower(), errors.lower())
                  for n, size, status, errors in _GROUP.findall(table)]
    if m := _COLLECTED.search(text):
        out.collection_seconds = float(m.group(1))
    m = _DEAD.search(text)
    out.dead_processes = int(m.group(1)) if m else 0
    m = _UNRESPONSIVE.search(text)
    out.unresponsive_processes = int(m.group(1)) if m else 0
    out.missing_ranks, out.dead_ranks = _missing_ranks(text, out.dead_processes,
                                                       out.unresponsive_processes)
    out.errored_ranks = sum(int(n) for n in _ERRORED.findall(text))
    m = _TIMEOUTS.search(text)
    out.timeouts = int(m.group(1)) if m else 0
    return out


def _blocks(text: str) -> list[str]:
    """The entries of the Errors section, each from its heading line to the blank line."""
    errors = text.split("\nErrors\n", 1)[1] if "\nErrors\n" in text else ""
    errors = errors.split("\nWarnings\n", 1)[0]
    return [b for b in errors.split("\n\n") if b.strip() and not b.startswith("=")]


def _missing_ranks(text: str, dead: int, unresponsive: int) -> tuple[int, int]:
    """(missing ranks, of those the dead processes') from the communicators' INCOMPLETE entries:
    a rank listed with the process and node of one the DEAD entry lists is dead, as the JSON
    report would say; another listed rank is unreachable. Ranks beyond those listed (more than
    RAS lists) are dead when the job has dead processes and no unresponsive ones, else
    unreachable (the report cannot tell)."""
    blocks = _blocks(text)
    dead_procs = {(node, pid) for b in blocks if b.startswith("DEAD\n")
                  for pid, node in _PROCESS.findall(b)}
    missing = dead_ranks = 0
    for b in blocks:
        m = _MISSING.match(b)
        if not m:
            continue
        n = int(m.group(1))
        listed = _RANK.findall(b)[:n]
        missing += n
        dead_ranks += sum((node, pid) in dead_procs for pid, node in listed)
        if dead and not unresponsive:
            dead_ranks += n - len(listed)
    return missing, dead_ranks


# -- listeners -----------------------------------------------------------------------------------

def listeners(tables: list[str], port: int) -> int:
    """Sockets listening on ``port`` in /proc/net/tcp and tcp6 (one per NCCL process with RAS
    on: they share the port through SO_REUSEPORT)."""
    want = f":{port:04X}"
    n = 0
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) > 3 and fields[3] == "0A" and fields[1].endswith(want):
                n += 1
    return n
