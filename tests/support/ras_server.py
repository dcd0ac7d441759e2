"""A stand-in NCCL RAS server for the tests: it speaks the client protocol of NCCL 2.28.9
(src/ras/client_support.cc: CLIENT PROTOCOL, TIMEOUT, SET FORMAT, STATUS, ERROR lines) on a
loopback port and answers STATUS with a report replayed from a real capture
(tests/fixtures/nccl_ras), or misbehaves as told: silent, slow, cut short, garbage, endless.

Several servers may share one port through SO_REUSEPORT, as NCCL's processes on a node do.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Behaviour:
    json: str | None = None  # the JSON report; None: SET FORMAT json is refused (NCCL < 2.28.7)
    text: str = ""  # the text report
    silent: bool = False  # accepts, never answers (a stopped process's listener)
    chunk: int = 0  # send the report in pieces of this many bytes (0: at once)
    delay: float = 0.0  # seconds between pieces
    cut: int | None = None  # close after this many bytes of the report
    garbage: bytes | None = None  # send this instead of the handshake answer
    endless: bool = False  # the report never ends (bounded only by the client)
    # The first this many connections are accepted and never answered (a stopped process of
    # the job, sharing the port, took them), the later ones served as above.
    mute_first: int = 0
    # MONITOR (NCCL 2.29.2 and later): "OK", then these chunks, one every monitor_delay
    # seconds, and the connection held open; None: refused as NCCL before 2.29.2 refuses it.
    monitor: list[str] | None = None
    monitor_delay: float = 0.05
    version: str = "2"


@dataclass
class Server:
    behaviour: Behaviour
    port: int = 0
    reuse_port: bool = False
    backlog: int = 16  # listen()'s: a silent server's queue holds backlog + 1 connections
    connections: int = 0
    commands: list[str] = field(default_factory=list)
    _sock: socket.socket | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _muted: list[socket.socket] = field(default_factory=list)

    def start(self) -> Server:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", self.port))
        sock.listen(self.backlog)
        sock.settimeout(0.1)
        self.port = sock.getsockname()[1]
        self._sock = sock
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self._sock is not None:
            self._sock.close()
        for conn in self._muted:
            conn.close()

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            if self.behaviour.silent:
                # Like a stopped process: the kernel completes the handshake, nobody accepts.
                self._stop.wait(0.1)
                continue
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            if self.connections <= self.behaviour.mute_first:
                self._muted.append(conn)  # held open, never read
                continue
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket) -> None:
        b = self.behaviour
        fmt = "text"
        buf = b""
        conn.settimeout(5)
        with conn:
            try:
                while not self._stop.is_set():
                    while b"\n" not in buf:
                        data = conn.recv(4096)
                        if not data:
                            return
                        buf += data
                    raw, _, buf = buf.partition(b"\n")
                    cmd = raw.decode("ascii", "replace").rstrip("\r")
                    self.commands.append(cmd)
                    low = cmd.lower()
                    if low.startswith("client protocol "):
                        conn.sendall(b.garbage if b.garbage is not None
                                     else f"SERVER PROTOCOL {b.version}\n".encode())
                    elif low.startswith("timeout "):
                        ok = cmd[8:].isdigit()
                        conn.sendall(b"OK\n" if ok else
                                     f"ERROR: Invalid timeout value {cmd[8:]}\n".encode())
                    elif low.startswith("set format "):
                        want = cmd[11:].lower()
                        if want == "text" or (want == "json" and b.json is not None):
                            fmt = want
                            conn.sendall(b"OK\n")
                        elif want == "json":  # NCCL before 2.28.7 has no such command
                            conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())
                        else:
                            conn.sendall(f"ERROR: Invalid format {cmd[11:]}\n".encode())
                    elif low.startswith("monitor") and b.monitor is not None:
                        conn.sendall(b"OK\n")
                        for chunk in b.monitor:
                            if self._stop.wait(b.monitor_delay):
                                return
                            conn.sendall(chunk.encode())
                        self._stop.wait()
                        return
                    elif low in ("status", "verbose status"):
                        self._report(conn, (b.json or "") if fmt == "json" else b.text)
                        return
                    else:
                        conn.sendall(f"ERROR: Unknown command {cmd}\n".encode())
            except OSError:
                return

    def _report(self, conn: socket.socket, body: str) -> None:
        b = self.behaviour
        data = body.encode()
        if b.endless:
            piece = b"x" * 65536
            while not self._stop.is_set():
                conn.sendall(piece)
            return
        if b.cut is not None:
            data = data[:b.cut]
        step = b.chunk or len(data) or 1
        for i in range(0, len(data), step):
            if i and b.delay:
                time.sleep(b.delay)
            conn.sendall(data[i:i + step])


@contextmanager
def serving(behaviour: Behaviour, port: int = 0, reuse_port: bool = False) -> Iterator[Server]:
    server = Server(behaviour, port=port, reuse_port=reuse_port).start()
    try:
        yield server
    finally:
        server.stop()
