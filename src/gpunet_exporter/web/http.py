"""HTTP serving: /metrics through prometheus_client (gzip and OpenMetrics negotiation, the
scraper's X-Prometheus-Scrape-Timeout-Seconds shortening the collectors' deadline), a landing
page at / listing the collectors and their last status, and /-/healthy; over TLS when
``--web.config.file`` asks for it (web/webconfig.py). The server is web/httpserver.py
(HTTP/1.1 parsed by h11, with limits on connections, request heads, bodies and threads)."""

from __future__ import annotations

import functools
import gzip
import html
import logging
import math
import re
import ssl
import threading
import time
from collections.abc import Iterable
from typing import Any, Protocol
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics

from gpunet_exporter import __version__
from gpunet_exporter.collector import UNKNOWN_REASONS, MetricSpec
from gpunet_exporter.registry import Scraper
from gpunet_exporter.web import httpserver
from gpunet_exporter.web import openmetrics as fast_openmetrics
from gpunet_exporter.web.httpserver import Server, StartResponse, WSGIApp

log = logging.getLogger("gpunet.exporter.http")
_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
DEFAULT_MAX_CONNECTIONS = httpserver.DEFAULT_MAX_CONNECTIONS


# What Prometheus sends with every scrape: its scrape_timeout in seconds ("10", "2.5").
SCRAPE_TIMEOUT_HEADER = "HTTP_X_PROMETHEUS_SCRAPE_TIMEOUT_SECONDS"
# Taken off the scraper's timeout, so that encoding and sending the answer fit in it too: half a
# second as blackbox_exporter's --timeout-offset, or half the timeout when that is 1 s or less.
SCRAPE_TIMEOUT_MARGIN = 0.5


def scrape_timeout(header: str | None) -> float | None:
    """The deadline a scraper's X-Prometheus-Scrape-Timeout-Seconds leaves the collectors: the
    value less SCRAPE_TIMEOUT_MARGIN (less half of it when it is 1 s or less); None when the
    header is absent or not a finite positive number of seconds (then --scrape.timeout alone
    applies). Scraper.collect caps the result at --scrape.timeout."""
    if header is None:
        return None
    try:
        seconds = float(header.strip())
    except ValueError:
        return None
    if not (math.isfinite(seconds) and seconds > 0):
        return None
    return seconds - min(SCRAPE_TIMEOUT_MARGIN, seconds / 2)


def _landing(scraper: Scraper, telemetry_path: str) -> bytes:
    rows = []
    for r in scraper.runners:
        st = r.status
        state = "not scraped yet" if st.success is None else ("ok" if st.success else "failed")
        if st.success and st.unknown:  # ran, but not every check that applies: not "ok"
            state = "UNKNOWN: " + "; ".join(
                f"{check} not checked ({UNKNOWN_REASONS.get(reason, reason)})"
                for check, reason in sorted(st.unknown.items()))
        age = f"{time.time() - st.at:.0f}s ago" if st.at else ""
        try:
            now = r.collector.summary()
        except Exception as exc:  # a landing page never fails for one collector
            now = f"summary failed: {exc}"
        rows.append(
            f"<tr><td>{html.escape(r.name)}</td><td>{state}</td>"
            f"<td>{st.duration * 1000:.1f} ms</td><td>{age}</td>"
            f"<td>{html.escape(now)}</td><td>{html.escape(st.error)}</td></tr>")
    table = "\n".join(rows) or "<tr><td colspan=6>no collectors enabled</td></tr>"
    path = html.escape(telemetry_path)
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>gpunet-exporter</title></head>
<body>
<h1>gpunet-exporter {html.escape(__version__)}</h1>
<p>Prometheus exporter for GPU-cluster networking. <a href="{path}">Metrics</a> ·
<a href="/-/healthy">Health</a></p>
<h2>Collectors</h2>
<table border="1" cellpadding="4">
<tr><th>collector</th><th>last status</th><th>duration</th><th>when</th><th>now</th>
<th>error</th></tr>
{table}
</table>
</body></html>
"""
    # An error text can hold a name the kernel gave as bytes (a lone surrogate): escaped, not
    # a failed page.
    return page.encode("utf-8", "backslashreplace")


class _Collected:
    """One scrape's families, handed to prometheus_client's encoders as a registry."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


class Collects(Protocol):
    """What render_metrics() encodes: a prometheus_client registry, or anything else that
    collects families."""

    def collect(self) -> Iterable[Metric]: ...


def render_metrics(registry: Collects, accept: str, accept_encoding: str,
                   names: list[str] | None = None) -> tuple[bytes, list[tuple[str, str]]]:
    """Body and headers of a scrape, formatted by prometheus_client as the client negotiated.

    Three departures from prometheus_client's own WSGI app, all for speed and none changing a
    byte of the exposition: (1) names that already follow the legacy character set need no
    escaping, so the OpenMetrics encoder runs in its allow-utf-8 mode, which for such names writes
    exactly what the underscores mode writes without escaping every sample name character by
    character; (2) that mode's text is written by web/openmetrics.py, which formats a label set
    shared by many samples once (prometheus_client's encoder when it declines); (3) gzip at
    level 1 instead of 9 (6 times faster for a few percent more bytes).
    """
    encoder, content_type = choose_encoder(accept)
    families = list(registry.collect())
    if names:  # ?name[]=... as prometheus_client supports it: family or sample names
        wanted = set(names)
        families = [f for f in families
                    if f.name in wanted or any(smp.name in wanted for smp in f.samples)]
    if (isinstance(encoder, functools.partial)
            and encoder.keywords.get("escaping") == openmetrics.UNDERSCORES
            and all(_LEGACY_NAME.match(f.name) for f in families)):
        encoder = functools.partial(encoder.func, **{**encoder.keywords,
                                                     "escaping": openmetrics.ALLOWUTF8})
    body = None
    if (isinstance(encoder, functools.partial) and encoder.func is openmetrics.generate_latest
            and encoder.keywords.get("escaping") == openmetrics.ALLOWUTF8):
        body = fast_openmetrics.encode(families)  # the same bytes, about 5 times sooner
    if body is None:
        body = encoder(_Collected(families))
    headers = [("Content-Type", content_type)]
    if gzip_accepted(accept_encoding):
        body = gzip.compress(body, compresslevel=1)
        headers.append(("Content-Encoding", "gzip"))
    return body, headers


DEFAULT_MAX_REQUESTS = 40  # node_exporter's --web.max-requests default
THREADS_UNLIMITED = 64  # threads that run the app when --web.max-requests is 0
SCRAPES_REJECTED = MetricSpec(
    "gpunet_exporter_scrapes_rejected_total", "counter",
    "Scrape requests answered 503 at once because --web.max-requests scrapes were already "
    "being served", (), "requests", "exporter")


class RequestLimit:
    """At most ``limit`` scrapes served at once (0: no limit); one beyond it is refused with a
    quick 503 instead of waiting, as node_exporter's ``--web.max-requests`` does, so no client
    can make the exporter queue work (and grow) without bound. A prometheus_client collector of
    its own refusals."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._slots = threading.BoundedSemaphore(limit) if limit else None
        self._lock = threading.Lock()
        self.rejected = 0

    def acquire(self) -> bool:
        if self._slots is None or self._slots.acquire(blocking=False):
            return True
        with self._lock:
            self.rejected += 1
        return False

    def release(self) -> None:
        if self._slots is not None:
            self._slots.release()

    def collect(self) -> Iterable[Metric]:
        family = SCRAPES_REJECTED.family()
        family.add_metric([], self.rejected)
        yield family


def make_app(scraper: Scraper, registry: CollectorRegistry, telemetry_path: str,
             limit: RequestLimit | None = None) -> WSGIApp:
    """The WSGI app: /metrics shows the scraper's families (under the deadline the request's
    X-Prometheus-Scrape-Timeout-Seconds leaves, :func:`scrape_timeout`), then those of
    ``registry`` (the exporter's own: hot-plug, process, refusals)."""
    limit = limit or RequestLimit(0)
    busy = (f"Limit of concurrent requests reached ({limit.limit}), try again later.\n"
            .encode())

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/") or "/"
        if path == telemetry_path:
            if environ.get("REQUEST_METHOD", "GET") != "GET":
                start_response("405 Method Not Allowed", [("Allow", "GET"),
                                                          ("Content-Length", "0")])
                return [b""]
            if not limit.acquire():
                start_response("503 Service Unavailable", [
                    ("Content-Type", "text/plain; charset=utf-8"),
                    ("Content-Length", str(len(busy)))])
                return [busy]
            try:
                names = parse_qs(environ.get("QUERY_STRING", "")).get("name[]")
                # The collectors' families first, then those of the exporter itself.
                timeout = scrape_timeout(environ.get(SCRAPE_TIMEOUT_HEADER))
                scraped = _Collected([*scraper.collect(timeout), *registry.collect()])
                body, headers = render_metrics(scraped, environ.get("HTTP_ACCEPT", ""),
                                               environ.get("HTTP_ACCEPT_ENCODING", ""), names)
            finally:
                limit.release()
            start_response("200 OK", [*headers, ("Content-Length", str(len(body)))])
            return [body]
        if path == "/":
            body = _landing(scraper, telemetry_path)
            start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        if path == "/-/healthy":
            body = b"Healthy\n"
            start_response("200 OK", [("Content-Type", "text/plain; charset=utf-8"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        body = b"Not Found\n"
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]

    return app


def parse_listen_address(addr: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``:port`` (all interfaces). Raises ValueError."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"invalid --web.listen-address {addr!r}: expected [host]:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def serve(app: WSGIApp, host: str, port: int, ssl_context: ssl.SSLContext | None = None,
          max_connections: int = DEFAULT_MAX_CONNECTIONS, max_requests: int = DEFAULT_MAX_REQUESTS
          ) -> Server:
    """Bind and start serving in a thread (web/httpserver.py), over TLS with
    ``ssl_context``. Raises OSError when the address cannot be bound. ``max_requests`` (0: no
    limit) sizes the pool of threads that run the app: RequestLimit refuses a scrape beyond it
    at once, and a few more threads answer / and /-/healthy meanwhile."""
    return httpserver.serve(app, host, port, ssl_context, max_connections,
                            max_requests + 4 if max_requests else THREADS_UNLIMITED)
