"""Hostile-client harness: how an HTTP(S) metrics endpoint copes with clients that misbehave.

Each target is an exporter's listening address; every case runs against every target in turn
(never two targets at once, so they do not compete for the CPU), and the result is a markdown
table with one row per case and one column per target, so that gpunet-exporter's HTTP server can
be read side by side with node_exporter's (Go net/http through exporter-toolkit).

    python bench/hostile.py --target ours=127.0.0.1:19400,pid=1234 \\
        --target node=127.0.0.1:9100,pid=5678 [--cases slowloris,idle] [--json out.json]
    python bench/hostile.py --start-node-exporter --target ours=127.0.0.1:19400,pid=1234

A target is ``NAME=HOST:PORT`` followed by comma-separated options: ``tls`` (speak HTTPS; the
certificate is not verified), ``pid=PID`` (the server's process, for thread, memory and
file-descriptor counts from /proc/PID) and ``path=/metrics`` (the scrape path). IPv6 literals
are written ``[::1]:9100``. ``--start-node-exporter`` starts /usr/bin/prometheus-node-exporter
itself on a free loopback port with its *default* collectors (a body of the size a real node
serves; ``--node-exporter-web-config`` adds ``--web.config.file`` and marks the target tls), adds
it as a target with its pid, and stops it at the end.

Python 3.10+ standard library only; the clients are plain sockets (wrapped in ``ssl`` for tls
targets), parsing what comes back byte by byte, so no client library smooths anything over.

Cases
-----
Every case opens its own connections, has its own deadline, and is run in a thread that the
harness abandons after a hard cap, so a server that never answers cannot hang the run. While a
case runs, a *legit scraper* fetches the scrape path over a fresh connection every
``--legit-interval`` seconds (default 1 s), and once more after the case; a legit scrape counts
as good only when it is a 200 whose body arrived in full (Content-Length or chunked framing
complete) and looks like an exposition (``# TYPE`` and a final newline).

desync_get_body
    GET with ``Content-Length: N`` and a body that is itself a whole request (``GET /smuggled``)
    on a kept-alive connection. One response and a working follow-up request on the same
    connection means the body was read and thrown away; two responses mean the server ignored
    the body and ran it as a second request (a request-smuggling desync).
cl_conflict
    Two different Content-Length headers; RFC 9112 section 6.3 says 400 and close.
cl_and_te
    Content-Length and ``Transfer-Encoding: chunked`` together (the CL.TE smuggling shape, with
    a request hidden after the last chunk); 400 expected. "junk follows" reports responses or
    bytes after the first response.
te_unknown
    ``Transfer-Encoding: gzip, chunked`` and ``Transfer-Encoding: xchunked``, each on its own
    connection; 400 or 501 expected.
garbage
    256 seeded random bytes and a blank line; a proper status line with 400 expected. The first
    bytes of the answer are shown.
http09
    ``GET /metrics`` with no version (an HTTP/0.9 request line): what comes back, and how long
    the connection stays open (up to ``--wait-cap``).
long_request_line, huge_headers, many_headers
    A 100 KB request line; 1 MB of headers in 16 lines of 64 KB (each line under the usual 64 KB
    line limits, so only a bound on the whole head stops it); 10,000 small header lines. 414,
    431 or 400 expected, and memory (VmRSS) should not stay grown.
slowloris
    ``--conns`` connections (200) each send the request line and then one byte of a never-ending
    header every ``--slowloris-interval`` seconds (5) for ``--slowloris-duration`` (40 s), from
    one poll loop. Reported: when the server closed them (seconds from connect: median and max,
    or how many were still open at the end), legit-scraper errors and worst latency, and server
    threads before, at peak and after.
idle
    ``--conns`` connections that send nothing (over TLS: after the handshake); how long until
    the server closes them, up to ``--wait-cap``.
burst_connect
    ``--conns`` threads released by a barrier at the same instant, each connecting and sending
    one GET. Reported: how many got a full 200, the worst connect latency, and how many connects
    took over 1 s (the first SYN was dropped because the listen backlog overflowed and the kernel
    retried after its 1 s initial retransmission timeout), and the host's ListenOverflows
    counter (/proc/net/netstat; host-wide, so other traffic on the box counts too).
burst_scrape
    ``--burst-scrapers`` (50) scrapers released at once, each making ``--burst-requests`` (3)
    scrapes over one kept-alive connection: errors (503 counted apart) and p50/p99/max latency.
mid_response_disconnect
    ``--disconnects`` (100) scrapes abandoned with a TCP reset (SO_LINGER 0): half right after the
    request is sent, half once the first response byte has arrived. The server must keep
    serving, and its threads and descriptors must not grow.
tls_stall, tls_partial_hello (tls targets only)
    A TCP connection to the TLS port that sends nothing, and one that sends half of a real
    ClientHello: time until the server closes it, up to ``--wait-cap``.
post_body
    POST to the scrape path declaring and sending a ``--post-mb`` (10) MB body: the status, how
    much of the body had been sent when the answer came, how the connection ended, and whether
    a second request on it still works.
pipelining
    GET of the scrape path and GET / in a single send on one connection; both answered, in
    order (the metrics first, the landing page second) expected.

Reading the table
-----------------
Each cell starts with what came back: statuses of the responses in order (``200+404`` is two
responses on one connection), the time to the first response byte from the end of the connect
(and TLS handshake), then how the connection ended: ``FIN`` (closed), ``RST`` (reset), or
``open at 1.0 s`` when it was still open when the harness stopped looking. A cell that starts
with ``!`` departs from what the case expects (see above). Then ``legit a/b ok max T``: the
legit scrapes during and after the case. With a pid, ``thr A>P>B`` is the server's thread
count before, at the peak during, and after the case (a second after it), ``rss`` the change in
resident memory and ``fd`` in open descriptors. ``--json`` writes the same cells with every raw
number behind them.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import random
import select
import signal
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    name: str
    host: str
    port: int
    tls: bool = False
    pid: int | None = None
    path: str = "/metrics"

    @property
    def hostport(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


def parse_target(spec: str) -> Target:
    """``NAME=HOST:PORT[,tls][,pid=PID][,path=/metrics]``; raises argparse.ArgumentTypeError."""
    name, sep, rest = spec.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"{spec!r}: expected NAME=HOST:PORT[,options]")
    addr, *options = rest.split(",")
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{spec!r}: bad address {addr!r}, expected HOST:PORT")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    tls, pid, path = False, None, "/metrics"
    for opt in options:
        key, _, value = opt.partition("=")
        if key == "tls" and not value:
            tls = True
        elif key == "pid" and value.isdigit():
            pid = int(value)
        elif key == "path" and value.startswith("/"):
            path = value
        else:
            raise argparse.ArgumentTypeError(f"{spec!r}: unknown option {opt!r}")
    return Target(name, host or "127.0.0.1", int(port), tls, pid, path)


@dataclass(frozen=True)
class Settings:
    conns: int = 200
    slowloris_duration: float = 40.0
    slowloris_interval: float = 5.0
    wait_cap: float = 30.0
    legit_interval: float = 1.0
    legit_timeout: float = 10.0
    burst_scrapers: int = 50
    burst_requests: int = 3
    disconnects: int = 100
    post_mb: float = 10.0
    quiet: float = 1.0
    seed: int = 1


# --------------------------------------------------------------------------- small helpers


def now() -> float:
    return time.perf_counter()


def fmt_dur(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1000:.1f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def fmt_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    if n < 1024 * 1024:
        return f"{n / 1024:.0f} KB"
    return f"{n / (1024 * 1024):.1f} MB"


def err_name(exc: BaseException) -> str:
    """ECONNRESET, EPIPE, timeout, or the exception's class and first words."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, ssl.SSLError):
        return f"TLS {exc.reason or type(exc).__name__}"
    if isinstance(exc, OSError) and exc.errno is not None and exc.errno in errno.errorcode:
        return errno.errorcode[exc.errno]
    text = str(exc).split("\n")[0][:40]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def short_repr(data: bytes, limit: int = 24) -> str:
    text = repr(data[:limit])
    return text + ("..." if len(data) > limit else "")


_CLIENT_CTX: ssl.SSLContext | None = None
_CTX_LOCK = threading.Lock()


def client_context() -> ssl.SSLContext:
    """A TLS client context that accepts any certificate (self-signed test certificates)."""
    global _CLIENT_CTX
    with _CTX_LOCK:
        if _CLIENT_CTX is None:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
            _CLIENT_CTX = ctx
        return _CLIENT_CTX


def open_socket(target: Target, timeout: float, *, tls: bool | None = None) -> socket.socket:
    """A connected, non-blocking socket; for a tls target (unless tls=False) after a completed
    handshake. Raises OSError (ssl.SSLError included) or TimeoutError."""
    family = socket.AF_INET6 if ":" in target.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(timeout, 0.05))
        sock.connect((target.host, target.port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if target.tls if tls is None else tls:
            tsock = client_context().wrap_socket(sock, server_hostname=target.host,
                                                 do_handshake_on_connect=False)
            tsock.settimeout(max(timeout, 0.05))
            try:
                tsock.do_handshake()
            except BaseException:
                tsock.close()
                raise
            sock = tsock
        sock.setblocking(False)
        return sock
    except BaseException:
        sock.close()
        raise


def reset_close(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER on, 0 s) instead of a FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def build_request(target: Target, method: str = "GET", path: str | None = None,
                  headers: Iterable[str] = (), body: bytes = b"", *,
                  close: bool = False) -> bytes:
    lines = [f"{method} {path or target.path} HTTP/1.1", f"Host: {target.hostport}",
             "User-Agent: gpunet-hostile/1", "Accept: text/plain;version=0.0.4", *headers]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# --------------------------------------------------------------------------- /proc


@dataclass
class ProcStat:
    threads: int
    rss_kb: int
    fds: int | None


def read_proc(pid: int | None) -> ProcStat | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        threads = int(fields["Threads"].strip())
        rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    except (OSError, KeyError, ValueError):
        return None
    try:
        fds: int | None = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = None
    return ProcStat(threads, rss_kb, fds)


def listen_overflows() -> int | None:
    """The host's TcpExt ListenOverflows counter: handshakes dropped because a listening
    socket's accept queue was full."""
    try:
        with open("/proc/net/netstat", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names.startswith("TcpExt:"):
            table = dict(zip(names.split()[1:], values.split()[1:], strict=False))
            with contextlib.suppress(KeyError, ValueError):
                return int(table["ListenOverflows"])
    return None


# --------------------------------------------------------------------------- wire


@dataclass
class Transcript:
    """What one exchange on one connection saw; times are seconds after the first send."""

    data: bytearray = field(default_factory=bytearray)
    sent: int = 0
    send_error: str | None = None
    send_error_at: float | None = None
    first_byte: float | None = None
    sent_at_first_byte: int = 0
    closed: str | None = None  # "FIN", "RST" or an error name; None: still open
    closed_at: float | None = None
    elapsed: float = 0.0


def _poll(sock: socket.socket, want_write: bool, timeout: float) -> tuple[bool, bool]:
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True, False
    poller = select.poll()
    mask = select.POLLIN | (select.POLLOUT if want_write else 0)
    poller.register(sock.fileno(), mask)
    readable = writable = False
    for _, ev in poller.poll(max(0, int(timeout * 1000))):
        readable = bool(ev & (select.POLLIN | select.POLLHUP | select.POLLERR))
        writable = bool(ev & select.POLLOUT)
    return readable, writable


def _drain(sock: socket.socket, tr: Transcript, t0: float) -> int:
    """Read all that is there without blocking; marks tr.closed on end of stream or error."""
    total = 0
    while tr.closed is None:
        try:
            chunk = sock.recv(65536)
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            break
        except ConnectionResetError:
            tr.closed = "RST"
        except ssl.SSLZeroReturnError:
            tr.closed = "FIN"
        except OSError as exc:
            tr.closed = err_name(exc)
        else:
            if not chunk:
                tr.closed = "FIN"
            else:
                if tr.first_byte is None:
                    tr.first_byte = now() - t0
                    tr.sent_at_first_byte = tr.sent
                tr.data += chunk
                total += len(chunk)
    if tr.closed is not None and tr.closed_at is None:
        tr.closed_at = now() - t0
    return total


def exchange(sock: socket.socket, payload: bytes, *, cap: float, quiet: float | None = None,
             stop: Callable[[Transcript], bool] | None = None,
             until_sent: bool = False) -> Transcript:
    """Send ``payload`` on a non-blocking socket while reading whatever comes back, until the
    server closes the connection, ``stop(transcript)`` is true after new bytes, ``quiet``
    seconds pass without new bytes once something has arrived and the payload is out, the
    payload is out (``until_sent``), or ``cap`` seconds pass. A send error stops the sending,
    not the reading."""
    tr = Transcript()
    t0 = now()
    end = t0 + max(cap, 0.0)
    view = memoryview(payload)
    step = 16384 if isinstance(sock, ssl.SSLSocket) else 262144
    last_rx = t0
    while True:
        t = now()
        if t >= end:
            break
        sending = tr.sent < len(payload) and tr.send_error is None
        if until_sent and not sending:
            break
        wait = end - t
        if quiet is not None and not sending and tr.data:
            if t - last_rx >= quiet:
                break
            wait = min(wait, quiet - (t - last_rx))
        readable, writable = _poll(sock, sending, wait)
        if readable:
            if _drain(sock, tr, t0):
                last_rx = now()
                if stop is not None and stop(tr):
                    break
            if tr.closed is not None:
                break
        if writable and sending:
            try:
                tr.sent += sock.send(view[tr.sent:tr.sent + step])
            except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError,
                    ssl.SSLWantReadError):
                pass
            except OSError as exc:
                tr.send_error, tr.send_error_at = err_name(exc), now() - t0
    tr.elapsed = now() - t0
    return tr


@dataclass
class Response:
    version: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    complete: bool
    framing: str  # "length", "chunked", "close" or "none"

    def header(self, name: str) -> str | None:
        for key, value in self.headers:
            if key.lower() == name.lower():
                return value
        return None


@dataclass
class Parsed:
    responses: list[Response]
    junk: bytes  # bytes where a status line was expected that are not one


def _dechunk(data: bytes, pos: int) -> tuple[bytes, int] | None:
    """Body and end offset of a chunked body starting at pos; None while incomplete; raises
    ValueError on bad framing."""
    body = bytearray()
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(data[pos:eol].split(b";")[0].strip() or b"x", 16)
        pos = eol + 2
        if size == 0:
            while True:  # trailer fields, then the empty line
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    return None
                empty, pos = eol == pos, eol + 2
                if empty:
                    return bytes(body), pos
        if len(data) < pos + size + 2:
            return None
        body += data[pos:pos + size]
        pos += size + 2


def parse_responses(data: bytes, closed: bool) -> Parsed:
    """Split a byte stream into HTTP/1.x responses (to requests without HEAD)."""
    out: list[Response] = []
    pos = 0
    while pos < len(data):
        if not data.startswith(b"HTTP/", pos):
            tail = data[pos:]
            if not closed and len(tail) < 5 and b"HTTP/".startswith(tail):
                break  # the start of a status line, the rest still on its way
            return Parsed(out, tail)
        end = data.find(b"\r\n\r\n", pos)
        if end < 0:
            if closed:
                return Parsed(out, data[pos:])
            break
        lines = data[pos:end].decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[1].isdigit():
            return Parsed(out, data[pos:])
        status = int(parts[1])
        headers = [(k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:])]
        start = end + 4
        resp = Response(parts[0], status, headers, b"", True, "none")
        te = (resp.header("Transfer-Encoding") or "").lower()
        length = resp.header("Content-Length")
        if status < 200 or status in (204, 304):
            pos = start
        elif "chunked" in te:
            resp.framing = "chunked"
            try:
                got = _dechunk(data, start)
            except ValueError:
                return Parsed(out, data[pos:])
            if got is None:
                resp.body, resp.complete, pos = data[start:], False, len(data)
            else:
                resp.body, pos = got
        elif length is not None and length.strip().isdigit():
            resp.framing = "length"
            stop = start + int(length)
            resp.body, resp.complete = data[start:stop], len(data) >= stop
            pos = min(stop, len(data))
        else:
            resp.framing = "close"
            resp.body, resp.complete, pos = data[start:], closed, len(data)
        out.append(resp)
    return Parsed(out, b"")


def responses_done(count: int) -> Callable[[Transcript], bool]:
    """A stop condition: ``count`` complete responses, or bytes that are not HTTP."""

    def stop(tr: Transcript) -> bool:
        parsed = parse_responses(bytes(tr.data), closed=False)
        return sum(r.complete for r in parsed.responses) >= count or bool(parsed.junk)

    return stop


def describe(tr: Transcript, parsed: Parsed, *, open_note: bool = True) -> str:
    """``400 in 2 ms, FIN at 3 ms``: statuses, time to first byte, how the connection ended."""
    parts: list[str] = []
    if parsed.responses:
        statuses = "+".join(str(r.status) + ("" if r.complete else " (cut)")
                            for r in parsed.responses)
        parts.append(f"{statuses} in {fmt_dur(tr.first_byte or 0.0)}")
    if parsed.junk:
        lead = "then non-HTTP" if parsed.responses else "non-HTTP answer"
        parts.append(f"{lead} {short_repr(parsed.junk)} ({fmt_bytes(len(parsed.junk))})")
    if not tr.data:
        parts.append("no answer")
    if tr.send_error is not None:
        parts.append(f"send {tr.send_error} after {fmt_bytes(tr.sent)}")
    if tr.closed is not None:
        parts.append(f"{tr.closed} at {fmt_dur(tr.closed_at or 0.0)}")
    elif open_note:
        parts.append(f"open at {fmt_dur(tr.elapsed)}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- legit scraper


@dataclass
class Scrape:
    ok: bool
    latency: float
    status: int | None
    error: str = ""


def legit_scrape(target: Target, timeout: float) -> Scrape:
    """One scrape as a well-behaved client, over a fresh connection."""
    t0 = now()
    try:
        sock = open_socket(target, timeout)
    except (OSError, ValueError) as exc:
        return Scrape(False, now() - t0, None, f"connect {err_name(exc)}")
    try:
        tr = exchange(sock, build_request(target, close=True), cap=timeout - (now() - t0),
                      stop=responses_done(1))
    finally:
        sock.close()
    latency = now() - t0
    parsed = parse_responses(bytes(tr.data), tr.closed is not None)
    if not parsed.responses:
        why = "timeout" if tr.closed is None else f"{tr.closed}, no response"
        return Scrape(False, latency, None, why if not parsed.junk else "non-HTTP answer")
    r = parsed.responses[0]
    if r.status != 200:
        return Scrape(False, latency, r.status, str(r.status))
    if not r.complete:
        return Scrape(False, latency, 200, "body cut")
    if b"# TYPE" not in r.body or not r.body.endswith(b"\n"):
        return Scrape(False, latency, 200, "body not an exposition")
    return Scrape(True, latency, 200)


class Background:
    """The legit scraper and a /proc sampler, running while a case runs."""

    def __init__(self, target: Target, settings: Settings) -> None:
        self.target = target
        self.settings = settings
        self.scrapes: list[Scrape] = []
        self.peak: ProcStat | None = None
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._scrape_loop, daemon=True),
                         threading.Thread(target=self._sample_loop, daemon=True)]

    def __enter__(self) -> Background:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.settings.legit_timeout + 2)

    def _scrape_loop(self) -> None:
        next_at = now()
        while not self._stop.is_set():
            self.scrapes.append(legit_scrape(self.target, self.settings.legit_timeout))
            next_at = max(next_at + self.settings.legit_interval, now())
            self._stop.wait(next_at - now())

    def _sample_loop(self) -> None:
        while True:
            stat = read_proc(self.target.pid)
            if stat is not None:
                if self.peak is None:
                    self.peak = stat
                else:
                    self.peak = ProcStat(max(self.peak.threads, stat.threads),
                                         max(self.peak.rss_kb, stat.rss_kb),
                                         max(self.peak.fds or 0, stat.fds or 0))
            if self._stop.wait(0.25):
                return


def legit_summary(scrapes: Sequence[Scrape]) -> str:
    if not scrapes:
        return "legit none"
    good = sum(s.ok for s in scrapes)
    text = f"legit {good}/{len(scrapes)} ok max {fmt_dur(max(s.latency for s in scrapes))}"
    errors = sorted({s.error for s in scrapes if not s.ok})
    return text + (f" ({', '.join(errors)[:60]})" if errors else "")


# --------------------------------------------------------------------------- cases


@dataclass
class Outcome:
    cell: str
    flag: bool = False  # departs from what the case expects
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ctx:
    target: Target
    settings: Settings
    deadline: float

    def left(self, cap: float | None = None) -> float:
        rest = self.deadline - now()
        return max(0.0, rest if cap is None else min(cap, rest))


def one_shot(ctx: Ctx, payload: bytes, *, cap: float = 10.0, quiet: float | None = None,
             until_close: bool = False, followup: bool = True
             ) -> tuple[Transcript, Parsed, str]:
    """Send one payload on a fresh connection and read what comes back until ``quiet`` seconds
    (default --quiet) of silence, or until the server closes it (``until_close``), or ``cap``;
    when the connection is still open, try an ordinary GET on it (``then GET 200``)."""
    sock = open_socket(ctx.target, ctx.left(10))
    if quiet is None and not until_close:
        quiet = ctx.settings.quiet
    try:
        tr = exchange(sock, payload, cap=ctx.left(cap), quiet=quiet)
        parsed = parse_responses(bytes(tr.data), tr.closed is not None)
        text = describe(tr, parsed)
        if followup and tr.closed is None and tr.send_error is None and not parsed.junk:
            tr2 = exchange(sock, build_request(ctx.target), cap=ctx.left(5),
                           stop=responses_done(1))
            p2 = parse_responses(bytes(tr2.data), tr2.closed is not None)
            if p2.responses:
                status = p2.responses[0].status
                text += f"; then GET {status}" + (
                    "" if status == 200 else " (leftover bytes spoiled it: out of sync)")
            elif p2.junk:
                text += f"; then GET non-HTTP {short_repr(p2.junk, 16)}"
            else:
                text += f"; then GET {tr2.closed or 'no answer'}"
    finally:
        sock.close()
    return tr, parsed, text


def _first_status(parsed: Parsed) -> int | None:
    return parsed.responses[0].status if parsed.responses else None


def case_desync_get_body(ctx: Ctx) -> Outcome:
    smuggled = build_request(ctx.target, path="/smuggled")
    payload = build_request(ctx.target, headers=[f"Content-Length: {len(smuggled)}"],
                            body=smuggled)
    _, parsed, text = one_shot(ctx, payload)
    n = len(parsed.responses)
    if n >= 2:
        verdict = "body run as a 2nd request (desync)"
    elif n == 1 and parsed.responses[0].status == 200 and "then GET 200" in text:
        verdict = "body read and discarded"
    else:
        verdict = f"{n} response(s)"
    flag = n != 1 or bool(parsed.junk)
    return Outcome(f"{verdict}: {text}", flag, {"responses": n, "detail": text})


def case_cl_conflict(ctx: Ctx) -> Outcome:
    body = b"0123456"
    payload = build_request(ctx.target, headers=["Content-Length: 6", "Content-Length: 7"],
                            body=body)
    _, parsed, text = one_shot(ctx, payload)
    return Outcome(text, _first_status(parsed) != 400, {"detail": text})


def case_cl_and_te(ctx: Ctx) -> Outcome:
    body = b"0\r\n\r\n" + build_request(ctx.target, path="/smuggled")
    payload = build_request(ctx.target, headers=[f"Content-Length: {len(body)}",
                                                 "Transfer-Encoding: chunked"], body=body)
    _, parsed, text = one_shot(ctx, payload)
    junk = len(parsed.responses) > 1 or bool(parsed.junk)
    text = ("junk follows: " if junk else "") + text
    return Outcome(text, _first_status(parsed) != 400 or junk, {"detail": text})


def case_te_unknown(ctx: Ctx) -> Outcome:
    cells: list[str] = []
    flag = False
    for te in ("gzip, chunked", "xchunked"):
        payload = build_request(ctx.target, headers=[f"Transfer-Encoding: {te}"],
                                body=b"5\r\nhello\r\n0\r\n\r\n")
        _, parsed, text = one_shot(ctx, payload)
        cells.append(f"[{te}] {text}")
        flag |= _first_status(parsed) not in (400, 501) or len(parsed.responses) > 1
    return Outcome("; ".join(cells), flag, {"detail": cells})


def case_garbage(ctx: Ctx) -> Outcome:
    noise = random.Random(ctx.settings.seed).randbytes(256) + b"\r\n\r\n"
    tr, parsed, text = one_shot(ctx, noise, followup=False)
    first = short_repr(bytes(tr.data[:16]), 16) if tr.data else "nothing"
    return Outcome(f"{text}; first bytes {first}", _first_status(parsed) != 400,
                   {"detail": text, "first_bytes": bytes(tr.data[:64]).decode("latin-1")})


def case_http09(ctx: Ctx) -> Outcome:
    payload = f"GET {ctx.target.path}\r\n".encode("latin-1")
    tr, parsed, _ = one_shot(ctx, payload, cap=ctx.settings.wait_cap, until_close=True,
                             followup=False)
    text = describe(tr, parsed, open_note=False)
    if tr.closed is None:
        text += f", still open at the cap (>{fmt_dur(tr.elapsed)})"
    if parsed.junk and not parsed.responses:
        text = "no status line (HTTP/0.9 style reply): " + text
    flag = _first_status(parsed) not in (400, 505) or tr.closed is None
    return Outcome(text, flag, {"detail": text, "closed_at": tr.closed_at,
                                "bytes": len(tr.data)})


def _too_large(ctx: Ctx, payload: bytes, label: str) -> Outcome:
    _, parsed, text = one_shot(ctx, payload, cap=20, followup=False)
    status = _first_status(parsed)
    text = f"{label}: {text}"
    return Outcome(text, status not in (400, 413, 414, 431), {"detail": text})


def case_long_request_line(ctx: Ctx) -> Outcome:
    path = ctx.target.path + "?q=" + "a" * 100_000
    return _too_large(ctx, build_request(ctx.target, path=path), "100 KB line")


def case_huge_headers(ctx: Ctx) -> Outcome:
    headers = [f"X-Big-{i:02d}: " + "b" * 64_000 for i in range(17)]
    return _too_large(ctx, build_request(ctx.target, headers=headers), "17x64 KB")


def case_many_headers(ctx: Ctx) -> Outcome:
    headers = [f"X-H-{i:05d}: v" for i in range(10_000)]
    return _too_large(ctx, build_request(ctx.target, headers=headers), "10k lines")


@dataclass
class Held:
    sock: socket.socket
    opened: float
    next_send: float
    sent: int = 0
    closed_at: float | None = None
    how: str = ""
    first: bytes = b""


@dataclass
class HoldReport:
    opened: int
    connect_errors: list[str]
    connect_s: list[float]
    connect_phase: float
    closed_after: list[float]
    how: dict[str, int]
    still_open: int
    answers: dict[str, int]


class Holder:
    """Connections held open from one poll loop: reads (to notice when the server closes them)
    and, with a trickle, one byte of it per connection every ``interval`` seconds."""

    def __init__(self, trickle: bytes, interval: float) -> None:
        self.trickle = trickle
        self.interval = interval
        self.held: list[Held] = []
        self.live: dict[int, Held] = {}
        self.poller = select.poll()
        self._scratch = Transcript()

    def add(self, sock: socket.socket, opened: float) -> None:
        h = Held(sock, opened, opened + self.interval)
        self.held.append(h)
        self.live[sock.fileno()] = h
        self.poller.register(sock.fileno(), select.POLLIN)

    def _closed(self, fd: int, h: Held, how: str) -> None:
        h.closed_at, h.how = now() - h.opened, how
        self.poller.unregister(fd)
        del self.live[fd]

    def service(self, until: float) -> None:
        """One round: wait for events until ``until`` at most (or the next byte due), read and
        note closes, send the bytes that are due."""
        t = now()
        due = min((h.next_send for h in self.live.values()), default=until)
        wait = max(0.0, min(until, due if self.trickle else until) - t)
        for fd, _ in self.poller.poll(int(wait * 1000) + (1 if wait else 0)):
            h = self.live[fd]
            tr = self._scratch
            tr.data.clear()
            tr.closed = tr.closed_at = None
            _drain(h.sock, tr, h.opened)
            if tr.data and len(h.first) < 32:
                h.first += bytes(tr.data[:32 - len(h.first)])
            if tr.closed is not None:
                self._closed(fd, h, tr.closed)
        if not self.trickle:
            return
        t = now()
        for fd, h in list(self.live.items()):
            if h.next_send > t:
                continue
            h.next_send = t + self.interval
            at = h.sent % len(self.trickle)
            try:
                h.sent += h.sock.send(self.trickle[at:at + 1])
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                pass
            except OSError as exc:
                self._closed(fd, h, f"send {err_name(exc)}")

    def close_all(self) -> None:
        for h in self.held:
            h.sock.close()


def hold_connections(ctx: Ctx, n: int, duration: float, head: bytes, trickle: bytes,
                     interval: float) -> HoldReport:
    """Open n connections one after the other, send ``head`` on each, then one byte of
    ``trickle`` (cycled) every ``interval`` seconds (never, when trickle is empty) until
    ``duration`` has passed since the last one opened or the server has closed them all."""
    holder = Holder(trickle, interval)
    errors: list[str] = []
    connects: list[float] = []
    t_start = now()
    try:
        for _ in range(n):
            if ctx.left() < duration + 5:
                errors.append("harness: connect phase too slow")
                break
            t = now()
            try:
                sock = open_socket(ctx.target, ctx.left(10))
                connects.append(now() - t)
                if head:
                    exchange(sock, head, cap=ctx.left(2), until_sent=True)
            except (OSError, ValueError) as exc:
                errors.append(err_name(exc))
                continue
            holder.add(sock, t)
            holder.service(now())  # keep the earlier ones trickling while connecting
        connect_phase = now() - t_start
        end = min(now() + duration, ctx.deadline)
        while holder.live and now() < end:
            holder.service(end)
    finally:
        holder.close_all()
    how: dict[str, int] = {}
    answers: dict[str, int] = {}
    for h in holder.held:
        if h.closed_at is not None:
            how[h.how] = how.get(h.how, 0) + 1
        if h.first:
            key = h.first.split(b"\r\n")[0][:20].decode("latin-1")
            answers[key] = answers.get(key, 0) + 1
    return HoldReport(len(holder.held), errors, connects, connect_phase,
                      [h.closed_at for h in holder.held if h.closed_at is not None],
                      how, len(holder.live), answers)


def _hold_text(rep: HoldReport, duration: float) -> str:
    slow = sum(c > 1.0 for c in rep.connect_s)
    parts = [f"{rep.opened} opened in {fmt_dur(rep.connect_phase)}"
             + (f" ({slow} connects over 1 s)" if slow else "")]
    if rep.connect_errors:
        parts.append(f"{len(rep.connect_errors)} connect errors "
                     f"({', '.join(sorted(set(rep.connect_errors)))[:40]})")
    if rep.closed_after:
        how = "/".join(sorted(rep.how))
        parts.append(f"{len(rep.closed_after)} closed by server ({how}) after median "
                     f"{fmt_dur(statistics.median(rep.closed_after))} max "
                     f"{fmt_dur(max(rep.closed_after))}")
    if rep.still_open:
        parts.append(f"{rep.still_open} still open at end (>{fmt_dur(duration)})")
    if rep.answers:
        parts.append("server sent " + ", ".join(f"{k!r}x{v}" for k, v in rep.answers.items()))
    return ", ".join(parts)


def case_slowloris(ctx: Ctx) -> Outcome:
    s = ctx.settings
    head = f"GET {ctx.target.path} HTTP/1.1\r\nHost: {ctx.target.hostport}\r\n".encode()
    trickle = b"X-Slowloris-Padding: " + b"z" * 1000
    rep = hold_connections(ctx, s.conns, s.slowloris_duration, head, trickle,
                           s.slowloris_interval)
    text = _hold_text(rep, s.slowloris_duration)
    return Outcome(text, bool(rep.connect_errors), asdict(rep))


def case_idle(ctx: Ctx) -> Outcome:
    s = ctx.settings
    rep = hold_connections(ctx, s.conns, s.wait_cap, b"", b"", 0)
    text = _hold_text(rep, s.wait_cap)
    return Outcome(text, bool(rep.connect_errors), asdict(rep))


T = TypeVar("T")


def run_at_once(worker: Callable[[T], None], args: Sequence[T], barrier: threading.Barrier,
                ctx: Ctx) -> bool:
    """One thread per argument, all released at the same instant through ``barrier`` (of
    len(args) + 1 parties, the last being this thread), then waited for within the case's time;
    False when they could not all be started."""
    threads = [threading.Thread(target=worker, args=(arg,), daemon=True) for arg in args]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout=30)
    except threading.BrokenBarrierError:
        return False
    for t in threads:
        t.join(ctx.left())
    return True


@dataclass
class Shot:
    connect: float | None = None
    total: float | None = None
    status: int | None = None
    error: str = ""


def case_burst_connect(ctx: Ctx) -> Outcome:
    n = ctx.settings.conns
    barrier = threading.Barrier(n + 1)
    shots = [Shot() for _ in range(n)]
    family = socket.AF_INET6 if ":" in ctx.target.host else socket.AF_INET
    timeout = ctx.left(30)

    def worker(shot: Shot) -> None:
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            shot.error = "barrier"
            return
        t0 = now()
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect((ctx.target.host, ctx.target.port))
            shot.connect = now() - t0
            if ctx.target.tls:
                sock = client_context().wrap_socket(sock, server_hostname=ctx.target.host)
            sock.setblocking(False)
            tr = exchange(sock, build_request(ctx.target, close=True),
                          cap=timeout - (now() - t0), stop=responses_done(1))
            parsed = parse_responses(bytes(tr.data), tr.closed is not None)
            if parsed.responses and parsed.responses[0].complete:
                shot.status = parsed.responses[0].status
            else:
                shot.error = f"{tr.closed} first" if tr.closed else "no answer"
            shot.total = now() - t0
        except (OSError, ValueError) as exc:
            shot.error = err_name(exc)
        finally:
            sock.close()

    overflows = listen_overflows()
    if not run_at_once(worker, shots, barrier, ctx):
        return Outcome("harness: could not start all client threads", True)
    overflow_delta = (None if overflows is None or (after := listen_overflows()) is None
                      else after - overflows)
    connects = [s.connect for s in shots if s.connect is not None]
    ok = sum(s.status == 200 for s in shots)
    errors: dict[str, int] = {}
    for s in shots:
        if s.status != 200:
            key = s.error or str(s.status)
            errors[key] = errors.get(key, 0) + 1
    slow = sum(c > 1.0 for c in connects)
    answered = [s.total for s in shots if s.total is not None and s.status is not None]
    parts = [f"{ok}/{n} got 200" + (f", last answer at {fmt_dur(max(answered))}"
                                     if answered else "")]
    if connects:
        parts.append(f"connect max {fmt_dur(max(connects))}, {slow} over 1 s")
    if errors:
        parts.append("errors " + ", ".join(f"{k}x{v}" for k, v in sorted(errors.items())))
    if overflow_delta is not None:
        parts.append(f"ListenOverflows +{overflow_delta}")
    return Outcome(", ".join(parts), ok != n,
                   {"ok": ok, "connect_s": connects, "errors": errors,
                    "listen_overflows": overflow_delta})


def case_burst_scrape(ctx: Ctx) -> Outcome:
    n, per = ctx.settings.burst_scrapers, ctx.settings.burst_requests
    barrier = threading.Barrier(n + 1)
    results: list[list[Scrape]] = [[] for _ in range(n)]
    timeout = ctx.settings.legit_timeout

    def worker(out: list[Scrape]) -> None:
        try:
            barrier.wait(timeout=30)
        except threading.BrokenBarrierError:
            return
        sock: socket.socket | None = None
        try:
            for _ in range(per):
                t0 = now()
                try:
                    if sock is None:
                        sock = open_socket(ctx.target, timeout)
                    tr = exchange(sock, build_request(ctx.target), cap=timeout - (now() - t0),
                                  stop=responses_done(1))
                except (OSError, ValueError) as exc:
                    out.append(Scrape(False, now() - t0, None, err_name(exc)))
                    sock = None
                    continue
                parsed = parse_responses(bytes(tr.data), tr.closed is not None)
                r = parsed.responses[0] if parsed.responses else None
                good = r is not None and r.status == 200 and r.complete
                why = "" if good else (str(r.status) if r else (tr.closed or "timeout"))
                out.append(Scrape(good, now() - t0, r.status if r else None, why))
                if (tr.closed is not None or r is None
                        or (r.header("Connection") or "").lower() == "close"):
                    sock.close()
                    sock = None
        finally:
            if sock is not None:
                sock.close()

    if not run_at_once(worker, results, barrier, ctx):
        return Outcome("harness: could not start all client threads", True)
    flat = [s for out in results for s in out]
    lat = [s.latency for s in flat]
    errors: dict[str, int] = {}
    for s in flat:
        if not s.ok:
            errors[s.error] = errors.get(s.error, 0) + 1
    bad = n * per - sum(s.ok for s in flat)
    text = f"{bad}/{n * per} errors"
    if errors:
        text += " (" + ", ".join(f"{k}x{v}" for k, v in sorted(errors.items())) + ")"
    if lat:
        text += (f", p50 {fmt_dur(percentile(lat, 50))} p99 {fmt_dur(percentile(lat, 99))}"
                 f" max {fmt_dur(max(lat))}")
    return Outcome(text, bad > 0, {"errors": errors, "latency_s": lat})


def case_mid_response_disconnect(ctx: Ctx) -> Outcome:
    count = ctx.settings.disconnects
    errors: dict[str, int] = {}
    after_first_byte = resets = 0
    for i in range(count):
        if ctx.left() < 5:
            errors["harness: out of time"] = count - i
            break
        try:
            sock = open_socket(ctx.target, ctx.left(5))
        except (OSError, ValueError) as exc:
            errors[err_name(exc)] = errors.get(err_name(exc), 0) + 1
            continue
        wait_reply = i % 2 == 1
        payload = build_request(ctx.target)
        try:
            tr = exchange(sock, payload, cap=ctx.left(5),
                          stop=(lambda tr: True) if wait_reply else None,
                          until_sent=not wait_reply)
            after_first_byte += tr.first_byte is not None
        finally:
            reset_close(sock)
            resets += 1
    text = f"{resets} reset ({after_first_byte} after the first response byte)"
    if errors:
        text += ", errors " + ", ".join(f"{k}x{v}" for k, v in errors.items())
    return Outcome(text, bool(errors), {"errors": errors, "after_first_byte": after_first_byte})


def _stall(ctx: Ctx, payload: bytes) -> Outcome:
    sock = open_socket(ctx.target, ctx.left(5), tls=False)
    try:
        tr = exchange(sock, payload, cap=ctx.left(ctx.settings.wait_cap))
    finally:
        sock.close()
    if tr.closed is None:
        text = f"still open at the cap (>{fmt_dur(tr.elapsed)})"
    else:
        text = f"{tr.closed} after {fmt_dur(tr.closed_at or 0.0)}"
    if tr.data:
        text += f", server sent {short_repr(bytes(tr.data), 12)}"
    return Outcome(text, tr.closed is None, {"closed_at": tr.closed_at, "how": tr.closed})


def partial_client_hello() -> bytes:
    """The first half of a real TLS ClientHello record, from an in-memory handshake."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = client_context().wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    hello = outgoing.read()
    return hello[:len(hello) // 2]


def case_tls_stall(ctx: Ctx) -> Outcome:
    return _stall(ctx, b"")


def case_tls_partial_hello(ctx: Ctx) -> Outcome:
    return _stall(ctx, partial_client_hello())


def case_post_body(ctx: Ctx) -> Outcome:
    size = int(ctx.settings.post_mb * 1024 * 1024)
    head = build_request(ctx.target, "POST", headers=[
        f"Content-Length: {size}", "Content-Type: application/octet-stream"])
    tr, parsed, text = one_shot(ctx, head + b"p" * size, cap=30, quiet=2.0)
    if tr.first_byte is not None:
        text += f"; answer came after {fmt_bytes(tr.sent_at_first_byte)} of the body"
    status = _first_status(parsed)
    return Outcome(text, status not in (400, 405, 413),
                   {"detail": text, "sent": tr.sent, "sent_at_answer": tr.sent_at_first_byte})


def case_pipelining(ctx: Ctx) -> Outcome:
    payload = build_request(ctx.target) + build_request(ctx.target, path="/")
    sock = open_socket(ctx.target, ctx.left(10))
    try:
        tr = exchange(sock, payload, cap=ctx.left(10), quiet=ctx.settings.quiet,
                      stop=responses_done(2))
    finally:
        sock.close()
    parsed = parse_responses(bytes(tr.data), tr.closed is not None)
    kinds = []
    for r in parsed.responses:
        ctype = (r.header("Content-Type") or "").lower()
        kind = "metrics" if "text/plain" in ctype or "openmetrics" in ctype else (
            "landing" if "html" in ctype else ctype or "?")
        kinds.append(f"{r.status} {kind}")
    good = (len(parsed.responses) == 2 and all(r.complete for r in parsed.responses)
            and kinds == ["200 metrics", "200 landing"])
    text = (("both answered in order" if good else "not as expected")
            + f" ({', '.join(kinds) or 'nothing'}): {describe(tr, parsed)}")
    return Outcome(text, not good, {"responses": kinds})


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Ctx], Outcome]
    tls_only: bool = False

    def cap(self, s: Settings) -> float:
        """Seconds after which the harness gives up on the case."""
        if self.name == "slowloris":
            return s.slowloris_duration + 90
        if self.name in ("idle", "http09", "tls_stall", "tls_partial_hello"):
            return s.wait_cap + 60
        return 90.0


CASES = [
    Case("desync_get_body", case_desync_get_body),
    Case("cl_conflict", case_cl_conflict),
    Case("cl_and_te", case_cl_and_te),
    Case("te_unknown", case_te_unknown),
    Case("garbage", case_garbage),
    Case("http09", case_http09),
    Case("long_request_line", case_long_request_line),
    Case("huge_headers", case_huge_headers),
    Case("many_headers", case_many_headers),
    Case("slowloris", case_slowloris),
    Case("idle", case_idle),
    Case("burst_connect", case_burst_connect),
    Case("burst_scrape", case_burst_scrape),
    Case("mid_response_disconnect", case_mid_response_disconnect),
    Case("tls_stall", case_tls_stall, tls_only=True),
    Case("tls_partial_hello", case_tls_partial_hello, tls_only=True),
    Case("post_body", case_post_body),
    Case("pipelining", case_pipelining),
]


def proc_summary(before: ProcStat | None, peak: ProcStat | None,
                 after: ProcStat | None) -> str:
    if before is None or after is None:
        return ""
    top = max(before.threads, after.threads, peak.threads if peak else 0)
    text = f"thr {before.threads}>{top}>{after.threads}"
    rss = (after.rss_kb - before.rss_kb) / 1024
    text += f" rss {rss:+.1f} MB"
    if peak is not None and peak.rss_kb - before.rss_kb > 1024:
        text += f" (peak {(peak.rss_kb - before.rss_kb) / 1024:+.1f})"
    if before.fds is not None and after.fds is not None:
        text += f" fd {after.fds - before.fds:+d}"
    return text


def run_case(case: Case, target: Target, settings: Settings) -> Outcome:
    if case.tls_only and not target.tls:
        return Outcome("n/a (plain HTTP)")
    before = read_proc(target.pid)
    ctx = Ctx(target, settings, now() + case.cap(settings) - 5)
    box: list[Outcome] = []

    def body() -> None:
        try:
            box.append(case.run(ctx))
        except Exception as exc:  # report it in the cell; the other cases still run
            box.append(Outcome(f"harness error: {err_name(exc)}", True))

    with Background(target, settings) as bg:
        worker = threading.Thread(target=body, daemon=True, name=case.name)
        worker.start()
        worker.join(case.cap(settings))
    outcome = box[0] if box else Outcome(
        f"harness gave up after {fmt_dur(case.cap(settings))}", True)
    time.sleep(1.0)  # let the server reap what the case left behind
    final = legit_scrape(target, settings.legit_timeout)
    after = read_proc(target.pid)
    scrapes = [*bg.scrapes, final]
    extra = [legit_summary(scrapes), proc_summary(before, bg.peak, after)]
    outcome.cell = "; ".join(p for p in [outcome.cell, *extra] if p)
    if not all(s.ok for s in scrapes):
        outcome.flag = True
    outcome.details.update(
        legit=[asdict(s) for s in scrapes],
        proc_before=asdict(before) if before else None,
        proc_peak=asdict(bg.peak) if bg.peak else None,
        proc_after=asdict(after) if after else None)
    return outcome


# --------------------------------------------------------------------------- node_exporter


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_node_exporter(binary: str, web_config: str | None, name: str
                        ) -> tuple[subprocess.Popen[bytes], Target]:
    port = free_port()
    cmd = [binary, f"--web.listen-address=127.0.0.1:{port}"]
    if web_config:
        cmd.append(f"--web.config.file={web_config}")
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    target = Target(name, "127.0.0.1", port, tls=bool(web_config), pid=proc.pid)
    end = now() + 15
    while now() < end:
        if proc.poll() is not None:
            log.seek(0)
            raise SystemExit(f"{binary} exited with {proc.returncode}: "
                             f"{log.read().decode(errors='replace')[-500:]}")
        if legit_scrape(target, 2).ok:
            return proc, target
        time.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"{binary} did not serve a scrape on 127.0.0.1:{port} within 15 s")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# --------------------------------------------------------------------------- main


def markdown(cases: Sequence[Case], targets: Sequence[Target],
             results: dict[str, dict[str, Outcome]]) -> str:
    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| case | " + " | ".join(t.name for t in targets) + " |",
             "|---|" + "---|" * len(targets)]
    for case in cases:
        row = [("! " if results[case.name][t.name].flag else "") + results[case.name][t.name].cell
               for t in targets]
        lines.append(f"| {case.name} | " + " | ".join(cell(c) for c in row) + " |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--target", action="append", type=parse_target, default=[],
                   metavar="NAME=HOST:PORT[,tls][,pid=PID][,path=/metrics]")
    p.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    p.add_argument("--list-cases", action="store_true", help="print the case names and exit")
    p.add_argument("--json", metavar="FILE", help="write every cell and its numbers here")
    p.add_argument("--start-node-exporter", action="store_true",
                   help="start node_exporter (default collectors) on a free loopback port")
    p.add_argument("--node-exporter-bin", default="/usr/bin/prometheus-node-exporter")
    p.add_argument("--node-exporter-web-config", metavar="FILE",
                   help="--web.config.file for it; the target is then taken to be tls")
    p.add_argument("--node-exporter-name", default="node_exporter")
    d = Settings()
    p.add_argument("--conns", type=int, default=d.conns,
                   help="connections for slowloris, idle and burst_connect (%(default)s)")
    p.add_argument("--slowloris-duration", type=float, default=d.slowloris_duration)
    p.add_argument("--slowloris-interval", type=float, default=d.slowloris_interval)
    p.add_argument("--wait-cap", type=float, default=d.wait_cap,
                   help="longest wait for the server to close a connection (%(default)s s)")
    p.add_argument("--legit-interval", type=float, default=d.legit_interval)
    p.add_argument("--legit-timeout", type=float, default=d.legit_timeout)
    p.add_argument("--burst-scrapers", type=int, default=d.burst_scrapers)
    p.add_argument("--burst-requests", type=int, default=d.burst_requests)
    p.add_argument("--disconnects", type=int, default=d.disconnects)
    p.add_argument("--post-mb", type=float, default=d.post_mb)
    p.add_argument("--quiet", type=float, default=d.quiet,
                   help="seconds of silence after which a reply counts as finished")
    p.add_argument("--seed", type=int, default=d.seed)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_cases:
        print("\n".join(c.name + (" (tls only)" if c.tls_only else "") for c in CASES))
        return 0
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        print(f"unknown case(s): {', '.join(unknown)}", file=sys.stderr)
        return 2
    cases = [c for c in CASES if not wanted or c.name in wanted]
    settings = Settings(args.conns, args.slowloris_duration, args.slowloris_interval,
                        args.wait_cap, args.legit_interval, args.legit_timeout,
                        args.burst_scrapers, args.burst_requests, args.disconnects,
                        args.post_mb, args.quiet, args.seed)
    threading.stack_size(512 * 1024)  # hundreds of client threads on a small box
    targets: list[Target] = list(args.target)
    started: subprocess.Popen[bytes] | None = None
    if args.start_node_exporter:
        started, node = start_node_exporter(args.node_exporter_bin,
                                            args.node_exporter_web_config,
                                            args.node_exporter_name)
        targets.append(node)
        print(f"started {args.node_exporter_bin} pid {node.pid} on {node.hostport}",
              file=sys.stderr)
    if not targets:
        print("no --target given (and no --start-node-exporter)", file=sys.stderr)
        return 2
    if len({t.name for t in targets}) != len(targets):
        print("target names must differ", file=sys.stderr)
        return 2
    results: dict[str, dict[str, Outcome]] = {c.name: {} for c in cases}
    t_all = now()
    try:
        for target in targets:
            first = legit_scrape(target, settings.legit_timeout)
            if not first.ok:
                print(f"warning: {target.name}: a plain scrape fails ({first.error})",
                      file=sys.stderr)
            for case in cases:
                t0 = now()
                print(f"[{target.name}] {case.name} ...", end="", file=sys.stderr, flush=True)
                results[case.name][target.name] = out = run_case(case, target, settings)
                print(f" {fmt_dur(now() - t0)}{' !' if out.flag else ''}", file=sys.stderr)
    finally:
        if started is not None:
            stop_process(started)
    header = ", ".join(
        f"{t.name}={'https' if t.tls else 'http'}://{t.hostport}{t.path}"
        + (f" pid {t.pid}" if t.pid else "") for t in targets)
    print(f"hostile-client harness: {header}; {fmt_dur(now() - t_all)} in all")
    print(f"settings: {json.dumps(asdict(settings))}\n")
    print(markdown(cases, targets, results))
    if args.json:
        doc = {"settings": asdict(settings), "targets": [asdict(t) for t in targets],
               "results": {c: {t: asdict(o) for t, o in row.items()}
                           for c, row in results.items()}}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
