"""Hostile clients against the real exporter and its real HTTP server (web.httpserver):
request desync and smuggling, garbage, HTTP/0.9, oversized heads and bodies, slowloris with a
legitimate scraper alongside, a burst of connections, the connection cap, clients that leave in
the middle of an answer. bench/hostile.py measures the same cases side by side with
node_exporter; these tests hold the outcomes that must not regress."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from support.paths import UPSTREAM
from support.wait import wait_for

SYSFS = f"--path.sysfs={UPSTREAM / 'procfs-sysfs-infiniband/tree/sys'}"
STATUS = re.compile(rb"HTTP/1\.1 (\d{3})")


def exchange(port: int, data: bytes, timeout: float = 10) -> tuple[bytes, bool]:
    """Send ``data`` on a fresh connection; everything the server sends until it closes, and
    whether it closed (False: still open when ``timeout`` ran out)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            return out, False
        except ConnectionResetError:  # after an answer to a request it did not read in full
            pass
        return out, True


def statuses(data: bytes) -> list[int]:
    return [int(m) for m in STATUS.findall(data)]


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise AssertionError("no Threads line")


def server_side(port: int) -> dict[str, int]:
    """The server's end of the connections to ``port`` by TCP state (ss: ESTAB, CLOSE-WAIT, ...),
    and under "queued" those in the listener's accept queue, not accepted yet."""
    out = subprocess.run(["ss", "-Htan", f"sport = :{port}"], capture_output=True, text=True,
                         check=True).stdout
    counts: dict[str, int] = {}
    for line in out.splitlines():
        state, recv_q = line.split()[:2]
        if state == "LISTEN":
            counts["queued"] = int(recv_q)  # a listener's Recv-Q: its accept queue
        else:
            counts[state] = counts.get(state, 0) + 1
    return counts


def open_connections(port: int) -> int:
    """Connections the server has accepted and not closed: established, or closed by the client
    (CLOSE-WAIT) and not yet by the server (which counts a connection until it closes it)."""
    counts = server_side(port)
    return counts.get("ESTAB", 0) + counts.get("CLOSE-WAIT", 0) + counts.get("queued", 0)


def test_request_desync_and_framing(run_exporter: Any) -> None:
    e = run_exporter(SYSFS)
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"
    # A body on a GET is read and dropped: the request inside it is never answered, and the
    # connection goes on with the next real request.
    with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
        s.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                  % (len(smuggled), smuggled))
        s.sendall(b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    assert statuses(out) == [200, 404], out
    # Ambiguous framing: 400 and the connection closed, whatever follows.
    for head in (b"Content-Length: 4\r\nContent-Length: 5\r\n",
                 b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
                 b"Content-Length: 5, 6\r\n"):
        out, closed = exchange(e.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + head
                               + b"\r\n0\r\n\r\n" + smuggled)
        assert statuses(out) == [400] and closed, (head, out)
    out, closed = exchange(e.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
                           b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n")
    assert statuses(out) == [501] and closed, out
    # Pipelined requests are answered in order.
    out, closed = exchange(e.port, b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n"
                           b"GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert statuses(out) == [200, 404] and closed, out
    assert "Traceback" not in e.stop()


@pytest.mark.parametrize("request_bytes, status", [
    (bytes(range(256)) * 4, 400),                       # random bytes with a line break
    (bytes(range(11, 256)) * 4, 400),                   # ... and without one
    (b"GET /metrics\r\n", 400),                         # HTTP/0.9
    (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),         # HTTP/2 prior knowledge
    (b"GET * HTTP/1.1\r\nHost: x\r\n\r\n", 400),        # not a path
    (b"GET /" + b"a" * 300_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 431),  # 300 kB line
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 20_000 + b"\r\n", 431),
    (b"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n" + b"x" * 200_000,
     413),
], ids=["garbage", "garbage-no-newline", "http09", "http2", "star", "long-line", "many-headers",
        "big-body"])
def test_malformed_requests_get_a_status_and_a_close(run_exporter: Any, request_bytes: bytes,
                                                    status: int) -> None:
    e = run_exporter(SYSFS)
    out, closed = exchange(e.port, request_bytes)
    assert out.startswith(b"HTTP/1.1 %d " % status), out[:200]
    assert closed
    assert requests.get(f"{e.url}/-/healthy", timeout=10).status_code == 200
    assert "Traceback" not in e.stop()


def test_slowloris_costs_no_thread_and_is_cut_off(run_exporter: Any) -> None:
    """200 connections each sending a request head one byte at a time: the process gains no
    thread, a legitimate scraper alongside gets every full answer, and each slow connection gets
    408 and is closed once HEAD_TIMEOUT (10 s) has passed since it connected."""
    from gpunet_exporter.web.httpserver import HEAD_TIMEOUT

    e = run_exporter(SYSFS)
    assert requests.get(f"{e.url}/metrics", timeout=10).status_code == 200
    before = threads(e.proc.pid)
    sel = selectors.DefaultSelector()
    head = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    slow = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", e.port), timeout=10)
        s.setblocking(False)
        slow.append(s)
        sel.register(s, selectors.EVENT_READ)
    answers: dict[socket.socket, bytes] = {}
    closed: set[socket.socket] = set()
    legit = []
    start = time.monotonic()
    sent = 0
    try:
        while len(closed) < len(slow) and time.monotonic() - start < HEAD_TIMEOUT + 10:
            for s in slow:
                if s not in closed:
                    with contextlib.suppress(OSError):
                        s.send(head[sent:sent + 1])
            sent += 1
            r = requests.get(f"{e.url}/metrics", timeout=10)
            legit.append((r.status_code, "gpunet_scrape_collector_success" in r.text
                          and r.text.endswith("\n")))
            if len(legit) == 3:
                during = threads(e.proc.pid)
            for key, _ in sel.select(timeout=0.5):
                s = key.fileobj  # type: ignore[assignment]
                try:
                    data = s.recv(4096)
                except OSError:
                    data = b""
                answers[s] = answers.get(s, b"") + data
                if not data:
                    closed.add(s)
                    sel.unregister(s)
    finally:
        for s in slow:
            s.close()
    assert all(code == 200 and full for code, full in legit), legit
    assert len(legit) >= 3
    assert during <= before + 1, (before, during)  # no thread per connection
    assert len(closed) == len(slow), f"{len(slow) - len(closed)} slow connections still open"
    assert all(statuses(answers.get(s, b"")) == [408] for s in slow)
    assert threads(e.proc.pid) <= before + 1
    assert "Traceback" not in e.stop()


def test_listen_backlog_and_a_burst_of_connections(run_exporter: Any) -> None:
    """The listen backlog is the kernel's usual size, not socketserver's 5; 200 clients that
    connect at the same instant all get their answer."""
    e = run_exporter(SYSFS)
    ss = subprocess.run(["ss", "-Hltn", f"sport = :{e.port}"], capture_output=True, text=True,
                        check=True).stdout.split()
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert int(ss[2]) == somaxconn, ss  # Send-Q of a listening socket: its backlog
    barrier = threading.Barrier(200)
    results: list[int | str] = []

    def client() -> None:
        barrier.wait()
        try:
            out, _ = exchange(e.port, b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n"
                              b"Connection: close\r\n\r\n", timeout=30)
            results.append(statuses(out)[0] if statuses(out) else repr(out[:50]))
        except OSError as exc:
            results.append(repr(exc))

    workers = [threading.Thread(target=client) for _ in range(200)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert results == [200] * 200, [r for r in results if r != 200][:5]
    assert "Traceback" not in e.stop()


def test_connection_cap(run_exporter: Any) -> None:
    e = run_exporter(SYSFS, "--web.max-connections=6")
    wait_for(lambda: open_connections(e.port) == 0,
             "the start-up check's connection closed by the server")
    held = [socket.create_connection(("127.0.0.1", e.port), timeout=10) for _ in range(6)]
    try:
        wait_for(lambda: server_side(e.port).get("ESTAB") == 6
                 and not server_side(e.port).get("queued"), "the six connections accepted")
        # Reset at once: no answer, whether the reset meets connect, send or recv (on a
        # busy machine the server's reset can land before connect() returns).
        try:
            with socket.create_connection(("127.0.0.1", e.port), timeout=10) as seventh:
                seventh.sendall(b"GET /-/healthy HTTP/1.1\r\nHost: x\r\n\r\n")
                assert seventh.recv(100) == b""
        except ConnectionResetError:
            pass
        held.pop().close()
        wait_for(lambda: open_connections(e.port) == 5, "the server closing its end of it")
        text = requests.get(f"{e.url}/metrics", timeout=10).text
        assert "gpunet_exporter_http_connections 6.0" in text  # five held and this one
        assert "gpunet_exporter_http_connections_refused_total 1.0" in text
    finally:
        for s in held:
            s.close()
    assert "Traceback" not in e.stop()


def test_clients_that_leave_mid_answer(run_exporter: Any) -> None:
    """50 clients that ask and reset at once: the threads that run the app stay within the pool
    (--web.max-requests + 4), and no connection is left open."""
    e = run_exporter(SYSFS, "--web.max-requests=8")
    assert requests.get(f"{e.url}/metrics", timeout=10).status_code == 200
    before = threads(e.proc.pid)
    for _ in range(50):
        with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    # Requests already running finish: until then a scrape beyond the limit gets 503.
    r = wait_for(lambda: (r := requests.get(f"{e.url}/metrics", timeout=10)).status_code == 200
                 and r, "a scrape answered 200 once the abandoned ones are done", interval=0.2)
    assert "gpunet_scrape_collector_success" in r.text
    # The 50 connections are closed, not left in CLOSE-WAIT, and the threads back in the pool.
    wait_for(lambda: len(os.listdir(f"/proc/{e.proc.pid}/fd")) < 30
             and threads(e.proc.pid) <= before + 8 + 4, "the connections closed")
    assert "Traceback" not in e.stop()
