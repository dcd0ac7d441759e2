"""The HTTP/1.1 server under the exporter's WSGI app: h11 parses and frames every message, an
asyncio event loop in one thread of its own holds the connections, and a bounded pool of threads
runs the app; this module only enforces limits (request time, head and body size, open
connections). The limits and what a client that breaks them gets: docs/security.md, "How the
server behaves"; why not hypercorn, cheroot or waitress: docs/benchmarks.md ("HTTP server").
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import socket
import ssl
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote_to_bytes, urlsplit

import h11
from prometheus_client.core import Metric

from gpunet_exporter.collector import MetricSpec

log = logging.getLogger("gpunet.exporter.http")

StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

HANDSHAKE_TIMEOUT = 10.0  # seconds a client has to complete the TLS handshake
# Seconds a connection has to send a whole request, from its start or the end of the previous
# response; an idle kept-alive connection closes after as long. Below the usual 15 s scrape
# interval, so that the server never closes a connection just as Prometheus reuses it.
HEAD_TIMEOUT = 10.0
CLOSE_TIMEOUT = 5.0  # seconds a closing connection may take (TLS close_notify) before a reset
DEFAULT_MAX_CONNECTIONS = 256  # TLS connections hold about 280 KB each (asyncio buffers)
MAX_HEAD = 64 * 1024  # bytes of request line and headers
MAX_BODY = 64 * 1024  # bytes of request body read (and dropped)
_REQUEST_LINE = re.compile(rb"^[!-~]+ [!-~]+ HTTP/[0-9]\.[0-9]\r?\n")

CONNECTIONS = MetricSpec(
    "gpunet_exporter_http_connections", "gauge",
    "HTTP connections open now, those still in the TLS handshake included", (),
    "connections", "exporter")
CONNECTIONS_REFUSED = MetricSpec(
    "gpunet_exporter_http_connections_refused_total", "counter",
    "Connections reset as soon as they were accepted because --web.max-connections were "
    "already open", (), "connections", "exporter")


class Listener(socket.socket):
    """The listening socket. Its accept(), which the event loop calls, resets a new connection
    at once while ``cap`` are open (0: no cap). Open connections are counted through weak
    references to their sockets: one the loop has closed (fileno -1) or dropped (collected, hence
    closed) no longer counts, so the count cannot drift."""

    def __init__(self, family: int, cap: int) -> None:
        super().__init__(family, socket.SOCK_STREAM)
        self.cap = cap
        self.backlog = _backlog()
        self.refused = 0
        self._open: weakref.WeakSet[socket.socket] = weakref.WeakSet()

    def open_connections(self) -> int:
        return sum(1 for conn in list(self._open) if conn.fileno() != -1)

    def accept(self) -> tuple[socket.socket, Any]:
        while True:
            conn, addr = super().accept()  # BlockingIOError once the backlog is empty
            if not self.cap or self.open_connections() < self.cap:
                self._open.add(conn)
                return conn, addr
            self.refused += 1
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()  # a reset: the client fails at once instead of waiting

    def collect(self) -> Iterable[Metric]:
        family = CONNECTIONS.family()
        family.add_metric([], self.open_connections())
        yield family
        family = CONNECTIONS_REFUSED.family()
        family.add_metric([], self.refused)
        yield family


def _backlog() -> int:
    """The kernel's own limit for a listen backlog, as Go's net package uses it."""
    try:
        with open("/proc/sys/net/core/somaxconn") as fh:
            return max(int(fh.read().strip()), 128)
    except (OSError, ValueError):
        return socket.SOMAXCONN


def bind(host: str, port: int, cap: int) -> Listener:
    """A listening socket on host:port ("" or "::": every address, IPv4 too where the OS
    allows). Raises OSError."""
    if host in ("", "::") or ":" in host:
        family, host = socket.AF_INET6, host or "::"
    else:
        family = socket.AF_INET
    try:
        return _bind(family, host, port, cap)
    except OSError:
        if family == socket.AF_INET6 and host == "::":  # no IPv6 on this host: IPv4 alone
            return _bind(socket.AF_INET, "0.0.0.0", port, cap)
        raise


def _bind(family: int, host: str, port: int, cap: int) -> Listener:
    listener = Listener(family, cap)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            with contextlib.suppress(OSError):
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        listener.bind((host, port))
        listener.listen(listener.backlog)  # connections queue from now on
    except OSError:
        listener.close()
        raise
    return listener


class _Response:
    """What the app answered: status, headers, body (joined: exporter answers are small)."""

    def __init__(self) -> None:
        self.status = 500
        self.reason = b"Internal Server Error"
        self.headers: list[tuple[str, str]] = []
        self.body = b""

    def start_response(self, status: str, headers: list[tuple[str, str]],
                       exc_info: Any = None) -> Callable[[bytes], None]:
        code, _, reason = status.partition(" ")
        self.status, self.reason = int(code), reason.encode("latin-1")
        self.headers = headers
        return self._write

    def _write(self, data: bytes) -> None:
        self.body += data


def _run_app(app: WSGIApp, environ: dict[str, Any], gone: Callable[[], bool]) -> _Response:
    resp = _Response()
    if gone():  # the client left while the request waited for a thread: no scrape for nobody
        return resp
    try:
        result = app(environ, resp.start_response)
        try:
            resp.body += b"".join(result)
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
    except Exception:
        log.exception("the app failed on %s", environ.get("PATH_INFO"))
        resp = _Response()
        resp.body = b"Internal Server Error\n"
        resp.headers = [("Content-Type", "text/plain; charset=utf-8")]
    # The body is complete, so its length is known: no chunked framing, and HEAD gets it too.
    resp.headers = [(k, v) for k, v in resp.headers if k.lower() != "content-length"]
    resp.headers.append(("Content-Length", str(len(resp.body))))
    return resp


class _Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.request: h11.Request | None = None
        self.body = 0
        self.busy = False  # the app is answering; later bytes wait in h11's buffer
        self.received = False  # bytes of the current request have arrived
        self.first_line: bytes | None = b""  # the connection's first request line, until checked

    # --- asyncio callbacks, all on the loop's thread ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._deadline(HEAD_TIMEOUT)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.conn.receive_data(data)
        except h11.RemoteProtocolError as exc:  # data after the connection was closed
            self._refuse(exc.error_status_hint, str(exc))
            return
        if self.first_line is not None:  # h11 waits for a blank line before it parses
            self.first_line += data[:MAX_HEAD]
            if b"\n" in self.first_line:
                if not _REQUEST_LINE.match(self.first_line):
                    self._refuse(400, "malformed request line (HTTP/0.9 or garbage)")
                    return
                self.first_line = None
        self._process()

    def eof_received(self) -> bool:
        if self.busy:  # half-closed after its request: answer, then close
            with contextlib.suppress(h11.RemoteProtocolError):
                self.conn.receive_data(b"")
            return True
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.transport = None

    # --- protocol ---

    def _process(self) -> None:
        while not self.busy and self.transport is not None:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse(exc.error_status_hint, str(exc))
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.ConnectionClosed):
                self._close()
                return
            if isinstance(event, h11.Request):
                headers = {name for name, _ in event.headers}
                if b"content-length" in headers and b"transfer-encoding" in headers:
                    self._refuse(400, "both Content-Length and Transfer-Encoding")
                    return
                if event.http_version not in (b"1.0", b"1.1"):
                    self._refuse(505, "HTTP/1.0 and HTTP/1.1 only")
                    return
                if not (event.target.startswith(b"/") or b"://" in event.target):
                    self._refuse(400, "the request target must be a path")
                    return
                self.request, self.body = event, 0
            elif isinstance(event, h11.Data):
                self.body += len(event.data)
                if self.body > MAX_BODY:
                    self._refuse(413, f"request body over {MAX_BODY} bytes")
                    return
            elif isinstance(event, h11.EndOfMessage) and self.request is not None:
                self._dispatch(self.request)
                return

    def _dispatch(self, request: h11.Request) -> None:
        self.busy = True
        if self.timer is not None:
            self.timer.cancel()
        environ = self.server.environ(request, self.transport)
        loop = asyncio.get_running_loop()
        transport = self.transport
        future = loop.run_in_executor(self.server.pool, _run_app, self.server.app, environ,
                                      lambda: transport is None or transport.is_closing())
        future.add_done_callback(self._answered)

    def _answered(self, future: asyncio.Future[_Response]) -> None:
        resp = future.result()
        self.busy = False
        self.request = None
        self.received = False
        if self.transport is None or self.transport.is_closing():
            return  # the client left during the answer
        try:
            data = self.conn.send(h11.Response(status_code=resp.status, reason=resp.reason,
                                               headers=resp.headers))
            data = (data or b"") + (self.conn.send(h11.Data(data=resp.body)) or b"")
            data += self.conn.send(h11.EndOfMessage()) or b""
        except h11.LocalProtocolError as exc:  # headers the app should not have sent
            log.error("cannot send the app's answer: %s", exc)
            self._close(abort=True)
            return
        self.transport.write(data)
        if self.conn.our_state is h11.MUST_CLOSE or self.conn.their_state is not h11.DONE:
            self._close()
            return
        self.conn.start_next_cycle()
        self._deadline(HEAD_TIMEOUT)
        self._process()  # a pipelined request may be waiting

    def _refuse(self, status: int, why: str) -> None:
        """Answer an error (when an answer can still be sent) and close."""
        log.debug("refusing a request: %s", why)
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE) and self.transport is not None:
            body = f"{why}\n".encode()
            with contextlib.suppress(h11.LocalProtocolError):
                data = self.conn.send(h11.Response(
                    status_code=status, reason=HTTPStatus(status).phrase.encode(),
                    headers=[("Content-Type", "text/plain; charset=utf-8"),
                             ("Content-Length", str(len(body))), ("Connection", "close")]))
                data = (data or b"") + body
                self.transport.write(data)
        self._close()

    def _deadline(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._expired)

    def _expired(self) -> None:
        if self.busy:
            return
        if self.received:  # part of a request arrived, too slowly
            self._refuse(408, "request not received in time")
        else:
            self._close()

    def _close(self, abort: bool = False) -> None:
        transport = self.transport
        if transport is None:
            return
        if abort:
            transport.abort()
            return
        transport.close()
        # A TLS close waits for the client's close_notify; no client may hold it open.
        asyncio.get_running_loop().call_later(CLOSE_TIMEOUT, transport.abort)


class Server:
    """Serves a WSGI app on a listening socket from a thread of its own; see the module
    docstring for the limits."""

    def __init__(self, app: WSGIApp, listener: Listener, ssl_context: ssl.SSLContext | None,
                 threads: int) -> None:
        self.app = app
        self.listener = listener
        self.ssl_context = ssl_context
        self.server_address = listener.getsockname()
        self.pool = ThreadPoolExecutor(threads, "http-worker")
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: asyncio.base_events.Server | None = None
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)
        host, port = self.server_address[:2]
        self._base = {
            "SERVER_NAME": str(host), "SERVER_PORT": str(port), "SCRIPT_NAME": "",
            "wsgi.version": (1, 0), "wsgi.url_scheme": "https" if ssl_context else "http",
            "wsgi.errors": sys.stderr, "wsgi.multithread": True, "wsgi.multiprocess": False,
            "wsgi.run_once": False,
        }
        if ssl_context is not None:
            self._base["HTTPS"] = "on"

    def start(self) -> None:
        self.thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        kwargs: dict[str, Any] = {}
        if self.ssl_context is not None:
            kwargs = {"ssl": self.ssl_context, "ssl_handshake_timeout": HANDSHAKE_TIMEOUT}
            if sys.version_info >= (3, 11):
                kwargs["ssl_shutdown_timeout"] = CLOSE_TIMEOUT
        self._server = self._loop.run_until_complete(self._loop.create_server(
            lambda: _Connection(self), sock=self.listener, backlog=self.listener.backlog,
            **kwargs))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def environ(self, request: h11.Request, transport: asyncio.BaseTransport | None
                ) -> dict[str, Any]:
        target = request.target
        if not target.startswith(b"/"):  # absolute form: http://host/path
            parts = urlsplit(target)
            target = (parts.path or b"/") + (b"?" + parts.query if parts.query else b"")
        path, _, query = target.partition(b"?")
        env = dict(self._base)
        env.update({
            "REQUEST_METHOD": request.method.decode("ascii"),
            "PATH_INFO": unquote_to_bytes(path).decode("latin-1"),
            "QUERY_STRING": query.decode("latin-1"),
            "SERVER_PROTOCOL": f"HTTP/{request.http_version.decode('ascii')}",
            "wsgi.input": io.BytesIO(b""),
        })
        peer = transport.get_extra_info("peername") if transport is not None else None
        if peer:
            env["REMOTE_ADDR"], env["REMOTE_PORT"] = str(peer[0]), str(peer[1])
        for name, value in request.headers:
            key = name.decode("latin-1").upper().replace("-", "_")
            if key not in ("CONTENT_LENGTH", "CONTENT_TYPE"):
                key = "HTTP_" + key
            text = value.decode("latin-1")
            env[key] = f"{env[key]},{text}" if key in env else text
        return env

    def shutdown(self) -> None:
        """Stop accepting and close the listening socket; requests being answered finish."""
        def stop() -> None:
            if self._server is not None:
                self._server.close()
            self._loop.stop()

        with contextlib.suppress(RuntimeError):  # the loop is already closed
            self._loop.call_soon_threadsafe(stop)
        self.thread.join(10)
        self.pool.shutdown(wait=False)

    def server_close(self) -> None:
        self.listener.close()


def serve(app: WSGIApp, host: str, port: int, ssl_context: ssl.SSLContext | None,
          max_connections: int, threads: int) -> Server:
    """Bind, listen and start serving in a thread, over TLS with ``ssl_context``, the app in
    ``threads`` worker threads. Raises OSError when the address cannot be bound."""
    server = Server(app, bind(host, port, max_connections), ssl_context, threads)
    server.start()
    return server
