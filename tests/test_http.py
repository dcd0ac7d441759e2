"""The metrics endpoint's output is exactly what prometheus_client's own encoders produce."""

from __future__ import annotations

import gzip
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics

from gpunet_exporter.web.http import render_metrics

PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-"
                     "text;version=0.0.1;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2")


class Fixed:
    def __init__(self, extra_name: str | None = None) -> None:
        self.extra_name = extra_name

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily("gpunet_demo_bytes_total",
                                'Help with "quotes" and \\ and\nnewline.',
                                labels=("device", "port"))
        c.add_metric(["mlx5_0", "1"], 12345678901234.0)
        c.add_metric(['we"ird\\dev\nice', "2"], 0)
        yield c
        g = GaugeMetricFamily("gpunet_demo_info", "Info.", labels=("fw_ver",))
        g.add_metric(["28.39.2048"], 1)
        yield g
        yield GaugeMetricFamily("gpunet_demo_nan", "NaN and inf.", value=float("inf"))
        if self.extra_name:
            yield GaugeMetricFamily(self.extra_name, "A non-legacy name.", value=1)


@pytest.mark.parametrize("extra", [None, "gpunet.dotted.name"])
def test_openmetrics_identical_to_prometheus_client(extra: str | None) -> None:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Fixed(extra))  # type: ignore[arg-type]
    body, headers = render_metrics(reg, PROMETHEUS_ACCEPT, "")
    assert body == openmetrics.generate_latest(reg)  # the underscores escaping it asked for
    assert dict(headers)["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    if extra:
        assert b"gpunet_dotted_name" in body


def test_text_format_and_gzip() -> None:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Fixed())  # type: ignore[arg-type]
    body, headers = render_metrics(reg, "text/plain;version=0.0.4", "gzip, deflate")
    assert dict(headers)["Content-Encoding"] == "gzip"
    assert gzip.decompress(body) == generate_latest(reg)
    body, headers = render_metrics(reg, "", "")
    assert body == generate_latest(reg) and "Content-Encoding" not in dict(headers)
    only, _ = render_metrics(reg, "", "", ["gpunet_demo_info", "gpunet_demo_bytes_total"])
    assert b"gpunet_demo_info" in only and b"gpunet_demo_bytes" in only
    assert b"gpunet_demo_nan" not in only


def test_keep_alive_and_http10(run_exporter) -> None:  # type: ignore[no-untyped-def]
    import http.client

    from support.paths import UPSTREAM
    e = run_exporter(f"--path.sysfs={UPSTREAM / 'procfs-sysfs-infiniband/tree/sys'}")
    conn = http.client.HTTPConnection("127.0.0.1", e.port, timeout=10)
    conn.connect()
    sock = conn.sock
    for path in ("/metrics", "/", "/-/healthy", "/nope", "/metrics"):
        conn.request("GET", path, headers={"Accept-Encoding": "gzip"})
        resp = conn.getresponse()
        body = resp.read()
        assert resp.version == 11 and len(body) == int(resp.headers["Content-Length"])
        assert conn.sock is sock  # one persistent connection, as Prometheus keeps
    conn.close()
    # HTTP/1.0 clients get their answer and the connection closes.
    import socket
    with socket.create_connection(("127.0.0.1", e.port), timeout=10) as s:
        s.sendall(b"GET /-/healthy HTTP/1.0\r\n\r\n")
        data = b""
        while chunk := s.recv(4096):
            data += chunk
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"Healthy\n")
