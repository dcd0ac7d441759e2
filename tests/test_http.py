"""The metrics endpoint's output is exactly what prometheus_client's own encoders produce."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.samples import Sample

from gpunet_exporter.collectors.infiniband import InfinibandCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.topology import TopologyCollector
from gpunet_exporter.registry import Scraper
from gpunet_exporter.web import openmetrics as fast_openmetrics
from gpunet_exporter.web.http import render_metrics

from support import sysfs_tree as st
from support.metrics import make_collector

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


def _om(families: list[Metric]) -> bytes:
    """prometheus_client's OpenMetrics text in the allow-utf-8 escaping (what render_metrics
    asks it for when every name is a legacy one)."""
    return openmetrics.generate_latest(_Fixed(families), escaping=openmetrics.ALLOWUTF8)


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def test_fast_openmetrics_on_a_whole_scrape(tmp_path: Path) -> None:
    """web/openmetrics.py writes a real scrape (the faulty DGX tree through the Scraper, with
    prometheus_client's process, platform and GC collectors) byte for byte as prometheus_client
    does, and render_metrics serves those bytes for Prometheus' Accept header."""
    sysfs = st.build_dgx_h100_faulty(tmp_path)
    cs = [make_collector(InfinibandCollector, sysfs),
          make_collector(LinkCollector, sysfs, {"ibv_devinfo": {"enabled": False}}),
          make_collector(TopologyCollector, sysfs)]
    scraper = Scraper({c.name: c for c in cs}, timeout=60)
    try:
        families = list(scraper.collect())
    finally:
        scraper.close()
    for own in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        families += list(own.collect())
    assert sum(len(f.samples) for f in families) > 600
    fast = fast_openmetrics.encode(families)
    assert fast is not None  # the fast path is taken for the exporter's own families
    assert fast == _om(families)
    assert fast == openmetrics.generate_latest(_Fixed(families))  # underscores, as asked
    body, _ = render_metrics(_Fixed(families), PROMETHEUS_ACCEPT, "")  # type: ignore[arg-type]
    assert body == fast


def _rarely(common: hs.SearchStrategy[Any], rare: hs.SearchStrategy[Any]
            ) -> hs.SearchStrategy[Any]:
    """``rare`` one time in 30, else ``common``."""
    return hs.integers(0, 29).flatmap(lambda i: rare if i == 0 else common)


# Mostly what the exporter's collectors make (so that the encoder writes most cases), with some
# of everything it must decline or write exactly as prometheus_client does.
_GOOD_NAMES = hs.sampled_from(["gpunet_a", "gpunet_b_total", "x", "_", "a:b", "gpunet_c_info"])
_NAMES = _rarely(_GOOD_NAMES,
                 hs.sampled_from(["gpunet.dotted", "with space", "", "ümlaut", "name\n"]))
_GOOD_LABEL_NAMES = hs.sampled_from(["device", "port", "le", "_x", "device2", "counter"])
_LABEL_NAMES = _rarely(_GOOD_LABEL_NAMES,
                       hs.sampled_from(["__reserved", "a:b", "dotted.name", "ü", "x\n"]))
_GOOD_VALUES = hs.one_of(
    hs.integers(0, 2**64), hs.integers(-(2**70), 2**70), hs.floats(allow_nan=True),
    hs.sampled_from([0, 1, -0.0, 0.0, 1e6, 999999.0, 1234567.0, 2**64 - 1, True, 1e-7,
                     0.1 + 0.2, 1e22, 1e21, 123456.5]))
# too large for a float, no value, a string: rare, or few cases would pass whole
_VALUES = _rarely(_GOOD_VALUES, hs.sampled_from([2**1100, None, "3"]))
_GOOD_LABEL_VALUES = hs.text(max_size=12) | hs.sampled_from(
    ['a"b', "a\\b", "line\nbreak", "\\\"", "mlx5_0", ""])
# not strings: prometheus_client raises, so must the encoder
_LABEL_VALUES = _rarely(_GOOD_LABEL_VALUES, hs.sampled_from([None, 3]))


@hs.composite
def _families(draw: hs.DrawFn) -> list[Metric]:
    out = []
    shared = [draw(hs.dictionaries(_LABEL_NAMES, _LABEL_VALUES, max_size=3)) for _ in range(3)]
    for _ in range(draw(hs.integers(0, 4))):
        fam = Metric(draw(_GOOD_NAMES | _NAMES.filter(bool)),
                     draw(hs.text(max_size=20) | hs.just('say "hi"\\\n')),
                     draw(hs.sampled_from(["gauge", "counter", "info", "unknown"])),
                     draw(hs.sampled_from(["", "", "bytes"])))
        for _ in range(draw(hs.integers(0, 8))):
            labels = draw(hs.sampled_from(shared) | hs.dictionaries(_LABEL_NAMES, _LABEL_VALUES,
                                                                    max_size=2))
            name = draw(hs.sampled_from([fam.name, fam.name + "_total"]) | _NAMES)
            timestamp = draw(hs.sampled_from([None] * 29 + [12.5]))
            fam.samples.append(Sample(name, labels, draw(_VALUES), timestamp))
        out.append(fam)
    return out


@settings(max_examples=400, deadline=None)
@given(_families())
def test_fast_openmetrics_is_prometheus_client_or_declines(families: list[Metric]) -> None:
    """Any families: the fast encoder writes what prometheus_client writes, or declines (None),
    and it declines wherever prometheus_client raises, so render_metrics raises as before."""
    try:
        want: bytes | None = _om(families)
    except Exception:
        want = None
    got = fast_openmetrics.encode(families)
    if want is None:
        assert got is None
    elif got is not None:
        assert got == want


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
