"""Names and text from the system that cannot be exposed (issue 15): a sample whose label is not
UTF-8, holds a NUL or is longer than LABEL_VALUE_MAX costs that sample, never the scrape.

Linux allows any bytes but '/' and NUL in a file name, and os.listdir gives those that are not
UTF-8 as lone surrogates, which prometheus_client's encoders refuse: before the check in
gpunet_exporter.registry one such name (a hw_counters file, an RDMA device, a netdev) failed every
scrape with HTTP 500. Each test here puts one such name where the system can put it, in a real
tree, and renders the scrape with prometheus_client's own encoders (text format 0.0.4 and
OpenMetrics, parsed back), or over HTTP from the installed exporter.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.samples import Sample

from gpunet_exporter.collector import Collector, Scrape
from gpunet_exporter.collectors.infiniband import InfinibandCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.pfc import PfcCollector
from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.collectors.topology import TopologyCollector
from gpunet_exporter.logs import JSONFormatter, LogfmtFormatter
from gpunet_exporter.registry import LABEL_VALUE_MAX, Scraper, drop_unexposable, label_problem
from gpunet_exporter.sources.ethtool import NicStats, parse_stats_text
from gpunet_exporter.web.http import _landing

from support import sysfs_tree as st
from support.exporter import install_plugin
from support.metrics import Samples, make_collector, parse, samples_of, series, value
from support.paths import FIXTURES

BAD = b"\xff"  # a byte that is never UTF-8
UNREADABLE = "gpunet_scrape_collector_unreadable_values"
IB = "class/infiniband"


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def expose(*collectors: Collector) -> tuple[Samples, str]:
    """One scrape of ``collectors`` through the exporter's Scraper (and so its label check),
    rendered by prometheus_client's text and OpenMetrics encoders as /metrics serves them, both
    parsed back: the samples and the OpenMetrics text. Closes the collectors."""
    scraper = Scraper({c.name: c for c in collectors}, timeout=60)
    try:
        families = list(scraper.collect())
    finally:
        scraper.close()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))  # type: ignore[arg-type]
    text = generate_latest(registry).decode("utf-8")  # what raised before the fix
    om = openmetrics.generate_latest(registry).decode("utf-8")
    samples = parse(text)
    assert samples_of(list(om_parse(om))).keys() == samples.keys()
    return samples, om


def unreadable(s: Samples, collector: str) -> float | None:
    return value(s, UNREADABLE, collector=collector)


def badname(path: Path, suffix: bytes = BAD) -> bytes:
    """``path`` with bytes that are not UTF-8 appended to its last component."""
    return os.fsencode(path) + suffix


def rename(old: Path, new: bytes) -> None:
    os.rename(os.fsencode(old), new)


def relink(link: Path, new: bytes, target_suffix: bytes = b"") -> None:
    """Move a symlink to the name ``new``, keeping its target (plus ``target_suffix``)."""
    target = os.readlink(os.fsencode(link))
    link.unlink()
    os.symlink(target + target_suffix, new)


def rename_netdev(sys: Path, device: str, suffix: bytes = BAD) -> str:
    """Give the netdev of RDMA device ``device`` a name that is not UTF-8 (its directory under
    the PCI function and its class/net link); returns the new name as os.listdir gives it."""
    net = st._netdev(sys, device).resolve()
    new = badname(net, suffix)
    rename(net, new)
    relink(sys / "class/net" / net.name, badname(sys / "class/net" / net.name, suffix), suffix)
    return os.fsdecode(os.path.basename(new))


@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path)


# ---- the one place: gpunet_exporter.registry ------------------------------------------------


def test_label_problem() -> None:
    assert label_problem({"device": "mlx5_0", "port": "1"}) is None
    assert label_problem({"name": "GPU \u00e9\u4e2d\ufffd"}) is None  # UTF-8, U+FFFD included
    assert label_problem({"v": "x" * LABEL_VALUE_MAX}) is None
    assert label_problem({}) is None
    for labels, why in [
            ({"counter": "x\udcff"}, "not UTF-8"),
            ({"counter": "\ud800"}, "not UTF-8"),
            ({"fw_ver": "28.39\x00junk"}, "NUL"),
            ({"v": "x" * (LABEL_VALUE_MAX + 1)}, "longer than 256"),
            ({"v": 3}, "not a string"),
            ({"my.label": "a"}, "not a Prometheus label name"),
            ({"1x": "a"}, "not a Prometheus label name"),
            ({"": "a"}, "not a Prometheus label name"),
            ({"x\udcff": "a"}, "not a Prometheus label name"),
            (["a"], "not a dict")]:
        problem = label_problem(labels)
        assert problem is not None and why in problem, (labels, problem)
        problem.encode("ascii")  # fit for any log line


class ThirdParty(Collector):
    """A third-party collector with every kind of label the encoders refuse, next to good ones,
    some sharing one label dict."""

    name = "thirdparty"

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        g = GaugeMetricFamily("gpunet_thirdparty_value", "Built from the name dev\udcff.",
                              labels=("device",))
        for dev in ("ok0", "bad\udcff", "nul\x00", "x" * 300, "y" * 256, "\u00e9\u4e2d"):
            g.add_metric([dev], 1)
        g.samples.append(Sample(g.name, {"device": 7}, 3))  # type: ignore[dict-item]
        g.samples.append(Sample(g.name, {"dotted.name": "a"}, 4))
        yield g
        shared = {"device": "ok1"}  # one dict in three families, as Families.add_labeled does
        broken = {"device": "\udcfe"}
        for i in range(3):
            f = GaugeMetricFamily(f"gpunet_thirdparty_shared{i}", "Shared.", labels=("device",))
            f.samples.extend([Sample(f.name, shared, i), Sample(f.name, broken, i)])
            yield f
        c = CounterMetricFamily("gpunet_thirdparty_events", "Events.", labels=())
        c.add_metric([], 5)
        yield c


def test_third_party_collector(tmp_path: Path) -> None:
    c = make_collector(ThirdParty, tmp_path)
    s, om = expose(c)
    devices = {dict(lbl)["device"] for lbl in series(s, "gpunet_thirdparty_value")}
    assert devices == {"ok0", "y" * 256, "\u00e9\u4e2d"}
    for i in range(3):
        assert series(s, f"gpunet_thirdparty_shared{i}") == {frozenset({("device", "ok1")}): i}
    assert value(s, "gpunet_thirdparty_events_total") == 5
    # bad, NUL, too long, the shared broken dict three times, an int, a dotted name
    assert unreadable(s, "thirdparty") == 8
    assert value(s, "gpunet_scrape_collector_success", collector="thirdparty") == 1
    # The HELP text escaped, not dropped (OpenMetrics writes its backslash as two).
    assert "# HELP gpunet_thirdparty_value Built from the name dev\\\\udcff." in om


def test_every_check_keeps_what_is_fine(tmp_path: Path) -> None:
    """drop_unexposable on a clean DGX scrape changes nothing and skips nothing."""
    sys = st.build_dgx_h100(tmp_path)
    c = make_collector(InfinibandCollector, sys)
    families = list(c.collect(Scrape()))
    before = samples_of(families)
    skipped: list[str] = []
    drop_unexposable(families, lambda what, why: skipped.append(what))
    assert not skipped and samples_of(families) == before


# ---- each place a name from the system reaches a label -----------------------------------------


def test_port_hw_counter_name_not_utf8(dgx: Path) -> None:
    """The reproduction of issue 15: a file named x<0xff> in one port's hw_counters/."""
    hw = dgx / IB / "mlx5_0/ports/1/hw_counters"
    with open(badname(hw / "x"), "w") as fh:
        fh.write("5\n")
    s, _ = expose(make_collector(InfinibandCollector, dgx))
    assert unreadable(s, "infiniband") == 1
    assert value(s, "gpunet_scrape_collector_success", collector="infiniband") == 1
    # The same port's other series, curated and generic, and the other ports stand.
    assert value(s, "gpunet_infiniband_port_hw_out_of_buffer_drops_total", device="mlx5_0",
                 port="1") == int((hw / "out_of_buffer").read_text())
    dev, name, raw = st.FUTURE_HW_COUNTER
    assert value(s, "gpunet_infiniband_port_hw_total", device=dev, port="1", counter=name) == raw
    assert len(series(s, "gpunet_infiniband_port_state_id")) == 10
    assert not [k for k in s if k[0] == "gpunet_infiniband_port_hw_total"
                and ("device", "mlx5_0") in k[1]]


def test_device_hw_counter_name_not_utf8(dgx: Path) -> None:
    st.make_switchdev(dgx, "mlx5_9")
    hw = dgx / IB / "mlx5_9/hw_counters"
    with open(badname(hw / "rx_new"), "w") as fh:
        fh.write("7\n")
    (hw / "rx_newer").write_text("8\n")
    s, _ = expose(make_collector(InfinibandCollector, dgx))
    assert unreadable(s, "infiniband") == 1
    assert value(s, "gpunet_infiniband_device_hw_total", device="mlx5_9", counter="rx_newer") == 8
    assert value(s, "gpunet_infiniband_device_hw_rp_cnp_handled_total", device="mlx5_9") == int(
        (hw / "rp_cnp_handled").read_text())
    assert len(series(s, "gpunet_infiniband_device_hw_total")) == 1


def test_rdma_device_name_not_utf8(dgx: Path) -> None:
    """class/infiniband/mlx5_<0xff>: every series of that device is skipped and counted, in
    each collector that names RDMA devices; the rest of the node stands."""
    # Its series, as the collector makes them while the device has a good name.
    alone = make_collector(InfinibandCollector, dgx, {"device_include": "^mlx5_3$"})
    per_device = len([k for k in samples_of(list(alone.collect(Scrape())))
                      if ("device", "mlx5_3") in k[1]])
    alone.close()
    netdev = st._netdev(dgx, "mlx5_3").name
    relink(dgx / IB / "mlx5_3", badname(dgx / IB / "mlx5_"))
    link = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"enabled": False}})
    s, _ = expose(make_collector(InfinibandCollector, dgx), link)
    assert per_device > 50
    assert unreadable(s, "infiniband") == per_device
    assert len(series(s, "gpunet_infiniband_port_state_id")) == 9
    assert not [k for k in s if k[0].startswith("gpunet_infiniband_") and ("device", "mlx5_3")
                in k[1]]
    # link: the netdev's own series stand (interface label only); the info naming the device
    # is skipped.
    assert value(s, "gpunet_link_mtu_bytes", interface=netdev) is not None
    assert not [k for k in series(s, "gpunet_link_info") if ("interface", netdev) in k]
    assert len(series(s, "gpunet_link_info")) == 9
    assert unreadable(s, "link") == 1


class _NoNvml:
    def gpus(self) -> None:
        return None

    def compute_pids(self) -> None:
        return None


def test_rdma_device_name_not_utf8_topology(tmp_path: Path) -> None:
    sys = st.build_dgx_h100_gpus(tmp_path)
    relink(sys / IB / "mlx5_3", badname(sys / IB / "mlx5_"))
    c = make_collector(TopologyCollector, sys, procfs=tmp_path / "no-proc")
    c.nvml = _NoNvml()  # type: ignore[attr-defined]
    s, _ = expose(c)
    paths = series(s, "gpunet_topology_gpu_nic_path")
    assert len(paths) == 8 * 9  # 8 GPUs, the 9 devices with a good name
    # Per GPU: the path to it and the ACS count of that pair; GPU 3's nearest NIC and nearest
    # rail NIC are mlx5_3; the device's own PCIe link series (as many as mlx5_0 has); and its
    # rail's GPU count.
    pcie = [k for k in s if k[0].startswith("gpunet_topology_nic_pcie_")
            and ("device", "mlx5_0") in k[1]]
    assert len(pcie) >= 10
    assert unreadable(s, "topology") == 8 * 2 + 2 + len(pcie) + 1
    assert value(s, "gpunet_topology_gpu_nearest_nic", gpu="0", device="mlx5_0",
                 path="PIX") == 1
    assert not series(s, "gpunet_topology_gpu_nearest_nic").keys() & {
        frozenset({"gpu": "3", "device": "mlx5_3", "path": "PIX"}.items())}


def test_peermem_version_with_nul(tmp_path: Path) -> None:
    """Text from a file, not a name: a NUL in it is garbage, and the sample is skipped."""
    sys = st.build_dgx_h100_gpus(tmp_path)
    st.make_peermem(sys, "nvidia_peermem", "580.1\x00junk")
    c = make_collector(TopologyCollector, sys, procfs=tmp_path / "no-proc")
    c.nvml = _NoNvml()  # type: ignore[attr-defined]
    s, _ = expose(c)
    assert unreadable(s, "topology") == 1
    assert not series(s, "gpunet_topology_peermem_info")
    assert value(s, "gpunet_topology_gdr_peermem_loaded") == 1


def test_port_directory_name_not_utf8(dgx: Path) -> None:
    """ports/<N> enters labels only as a number: another name is no port, and costs nothing."""
    port = dgx / IB / "mlx5_0/ports/1"
    shutil.copytree(port, os.fsdecode(badname(port.parent / "2")), symlinks=True)
    s, _ = expose(make_collector(InfinibandCollector, dgx))
    assert unreadable(s, "infiniband") == 0
    assert {dict(k)["port"] for k in series(s, "gpunet_infiniband_port_state_id")} == {"1"}


def test_ipoib_netdev_name_not_utf8(dgx: Path) -> None:
    """An InfiniBand port's netdev comes from device/net/: a name that is not UTF-8 costs the
    port's info series (infiniband) and that netdev's series (link)."""
    other = st._netdev(dgx, "mlx5_1").name
    rename_netdev(dgx, "mlx5_0")
    link = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"enabled": False}})
    s, _ = expose(make_collector(InfinibandCollector, dgx), link)
    assert unreadable(s, "infiniband") == 1
    assert len(series(s, "gpunet_infiniband_port_info")) == 9
    assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_0", port="1") == 4
    # info, operstate, carrier, speed, mtu, carrier_changes of that netdev
    assert unreadable(s, "link") == 6
    assert len(series(s, "gpunet_link_mtu_bytes")) == 9
    assert value(s, "gpunet_link_mtu_bytes", interface=other) is not None


def test_roce_netdev_name_not_utf8(dgx: Path) -> None:
    """A RoCE port names its netdev in gid_attrs/ndevs/<idx>, a file read as text (bytes that
    are not UTF-8 become U+FFFD): a valid label, whose netdev the link collector then cannot
    find. With the GID table empty the name comes from device/net/: skipped and counted."""
    name = rename_netdev(dgx, "mlx5_8")
    for ndev in (dgx / IB / "mlx5_8/ports/1/gid_attrs/ndevs").iterdir():
        ndev.write_bytes(name.encode("utf-8", "surrogateescape") + b"\n")
    link = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"enabled": False}})
    s, _ = expose(make_collector(InfinibandCollector, dgx), link)
    shown = name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    assert value(s, "gpunet_infiniband_port_info", device="mlx5_8", port="1",
                 link_layer="Ethernet", interface=shown) == 1
    assert unreadable(s, "infiniband") == 0 and unreadable(s, "link") == 0
    assert len(series(s, "gpunet_link_mtu_bytes")) == 9

    shutil.rmtree(dgx / IB / "mlx5_8/ports/1/gid_attrs/ndevs")
    link = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"enabled": False}})
    s, _ = expose(make_collector(InfinibandCollector, dgx), link)
    assert unreadable(s, "infiniband") == 1 and unreadable(s, "link") == 6
    assert len(series(s, "gpunet_infiniband_port_info")) == 9


class _Reader:
    """ethtool -S statistics for every interface (the synthetic mlx5 capture)."""

    def __init__(self) -> None:
        capture = FIXTURES / "synthetic/ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt"
        self.stats = parse_stats_text(capture.read_text())

    def read(self, ifname: str) -> NicStats:
        return self.stats

    def close(self) -> None:
        pass


def test_pfc_interface_name_not_utf8(dgx: Path) -> None:
    """The pfc collector's interfaces are the RoCE netdevs: one whose name is not UTF-8 (found
    through device/net/) costs its own series, with its QoS files read as usual."""
    st.make_ofed_qos(dgx, "mlx5_9")
    st.make_ofed_qos(dgx, "mlx5_8")
    rename_netdev(dgx, "mlx5_9")
    shutil.rmtree(dgx / IB / "mlx5_9/ports/1/gid_attrs/ndevs")
    c = make_collector(PfcCollector, dgx, {"config": {"sources": ["sysfs"]}})
    c.reader = _Reader()  # type: ignore[attr-defined]
    good = st._netdev(dgx, "mlx5_8").name
    s, _ = expose(c)
    interfaces = {dict(k).get("interface") for name, k in s if name.startswith("gpunet_pfc_")}
    assert interfaces == {good}
    per_interface = sum(1 for name, k in s if ("interface", good) in k)
    assert per_interface > 50
    assert unreadable(s, "pfc") == per_interface  # the same series, for the other netdev


def test_probe_result_strings(tmp_path: Path) -> None:
    """Strings of a result file (JSON: escapes give lone surrogates and NULs, any length)."""
    now = time.time()
    data = {
        "version": 2, "scope": "intra", "started": now - 0.2, "time": now, "success": True,
        "backend": "nccl", "world_size": 2, "nccl_version": "2.28\udcff",
        "sizes": [{"bytes": 8192, "skipped": False, "median_seconds": 2e-5,
                   "p99_seconds": 3e-5, "max_seconds": 4e-5, "algbw_bytes_per_second": 4.1e8,
                   "busbw_bytes_per_second": 4.1e8}],
        "net": "", "transports": ["P2P", "x" * 300, "SHM"], "net_transports": [], "gdr": None,
        "problems": ["bad\x00problem", "\ud800"]}
    (tmp_path / "intra.json").write_text(json.dumps(data))  # ensure_ascii: "\udcff" escapes
    c = make_collector(ProbeCollector, tmp_path, {"state_dir": str(tmp_path), "runner": "none"})
    assert isinstance(c, ProbeCollector)
    c.supervisor.refresh()
    s, _ = expose(c)
    assert unreadable(s, "probe") == 4  # info (nccl_version), a transport, two problems
    assert value(s, "gpunet_probe_success", scope="intra") == 1
    assert value(s, "gpunet_probe_allreduce_seconds", scope="intra", size="8192",
                 stat="median") == 2e-5
    assert {dict(k)["transport"] for k in series(s, "gpunet_probe_transport_info")} == {
        "P2P", "SHM"}
    assert not series(s, "gpunet_probe_info")


# ---- landing page and log lines ----------------------------------------------------------------


class _Failing(Collector):
    name = "failing"

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        # OSError's text shows the file name as repr() (escaped); a message names it as is.
        raise RuntimeError("cannot read /sys/class/net/eth\udcff/mtu")


def test_landing_page_with_a_name_not_utf8_in_an_error(tmp_path: Path) -> None:
    scraper = Scraper({"failing": make_collector(_Failing, tmp_path)}, timeout=10)
    try:
        list(scraper.collect())
        page = _landing(scraper, "/metrics").decode("utf-8")
    finally:
        scraper.close()
    assert "/sys/class/net/eth\\udcff/mtu" in page


class _Unsure(Collector):
    """Says what it could not check: a declared check, an undeclared one, a reason unknown."""

    name = "unsure"
    unknown_checks = {"declared": "what it watches"}  # noqa: RUF012 (a test's class)
    says: dict[str, str] = {}  # noqa: RUF012

    def collect(self, scrape: Scrape) -> Iterator[Metric]:
        return iter(())

    def unknown(self) -> dict[str, str]:
        return self.says


def test_unknown_checks_are_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """gpunet_check_unknown keeps only a check the collector declares with a reason of
    UNKNOWN_REASONS: anything else is left out and said once in the log, not exported."""
    c = make_collector(_Unsure, tmp_path)
    c.says = {"declared": "tool_missing", "undeclared": "tool_missing"}  # type: ignore[attr-defined]
    scraper = Scraper({"unsure": c}, timeout=10)
    caplog.set_level(logging.ERROR, logger="gpunet")
    try:
        first = samples_of(list(scraper.collect()))
        c.says = {"declared": "no such reason"}  # type: ignore[attr-defined]
        second = samples_of(list(scraper.collect()))
        list(scraper.collect())
    finally:
        scraper.close()
    assert series(first, "gpunet_check_unknown") == {frozenset(
        {("collector", "unsure"), ("check", "declared"), ("reason", "tool_missing")}): 1}
    assert not series(second, "gpunet_check_unknown")
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 2 and "'undeclared'" in said[0] and "'no such reason'" in said[1], said


@pytest.mark.parametrize("formatter", [LogfmtFormatter(), JSONFormatter()],
                         ids=["logfmt", "json"])
def test_log_line_with_a_name_not_utf8(formatter: logging.Formatter) -> None:
    record = logging.LogRecord("gpunet.infiniband", logging.ERROR, __file__, 1,
                               "skipping %s: %s", ("class/infiniband/mlx5_\udcff/ports", "EIO"),
                               None)
    line = formatter.format(record)
    line.encode("utf-8")  # any stream, whatever its errors setting, can write it
    if line.startswith("{"):
        assert "mlx5_\\udcff/ports" in json.loads(line)["msg"]
    else:  # logfmt writes the escape's backslash as two
        assert "mlx5_\\\\udcff/ports" in line


# ---- the installed exporter over HTTP -----------------------------------------------------------

PLUGIN = '''
from prometheus_client.core import GaugeMetricFamily
from gpunet_exporter.collector import Collector


class Odd(Collector):
    name = "odd"
    def collect(self, scrape):
        g = GaugeMetricFamily("gpunet_odd_value", "Odd names.", labels=("name",))
        g.add_metric(["fine"], 1)
        g.add_metric(["odd\\udcff"], 2)
        yield g


class Boom(Collector):
    name = "boom"
    def collect(self, scrape):
        raise RuntimeError("cannot read /sys/class/infiniband/mlx5_\\udcff/fw_ver")
'''


def test_names_not_utf8_over_http(run_exporter, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The installed exporter on a DGX tree with a name that is not UTF-8 in each place the
    kernel can put one, plus a third-party collector with such a label and one failing with
    such a name in its error: /metrics is a 200 with everything else, / is a 200 too."""
    sys = st.build_dgx_h100(tmp_path / "tree")
    with open(badname(sys / IB / "mlx5_0/ports/1/hw_counters/x"), "w") as fh:
        fh.write("5\n")
    relink(sys / IB / "mlx5_3", badname(sys / IB / "mlx5_"))
    rename_netdev(sys, "mlx5_1")
    site = install_plugin(tmp_path / "site", "gpunet_plugin_odd", PLUGIN,
                          {"odd": "gpunet_plugin_odd:Odd", "boom": "gpunet_plugin_odd:Boom"})
    e = run_exporter(f"--path.sysfs={sys}", "--collector.disable-defaults",
                     "--collector.infiniband", "--collector.link", "--collector.odd",
                     "--collector.boom", env={"PYTHONPATH": str(site)})
    for accept in ("", "application/openmetrics-text;version=1.0.0"):
        r = requests.get(f"{e.url}/metrics", headers={"Accept": accept}, timeout=30)
        assert r.status_code == 200, r.text[:500]
        text = r.content.decode("utf-8")  # strict: the body is UTF-8
        s = parse(text) if not accept else samples_of(list(om_parse(text)))
        assert len(series(s, "gpunet_infiniband_port_state_id")) == 9
        assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_0", port="1") == 4
        assert len(series(s, "gpunet_link_mtu_bytes")) == 9
        assert series(s, "gpunet_odd_value") == {frozenset({("name", "fine")}): 1}
        assert unreadable(s, "odd") == 1
        # mlx5_3's series (62), the file x<0xff>, the info of mlx5_1's port naming its netdev
        assert unreadable(s, "infiniband") == 64
        assert unreadable(s, "link") == 1 + 6  # mlx5_3's info, mlx5_1's netdev
        for c in ("infiniband", "link", "odd"):
            assert value(s, "gpunet_scrape_collector_success", collector=c) == 1
        assert value(s, "gpunet_scrape_collector_success", collector="boom") == 0
    r = requests.get(f"{e.url}/", timeout=30)
    assert r.status_code == 200
    assert "mlx5_\\udcff/fw_ver" in r.content.decode("utf-8")
    err = e.stop()
    assert "Traceback" not in err and "Logging error" not in err
    # The error, logged once, with the name escaped (logfmt doubles the backslash).
    assert err.count("mlx5_\\\\udcff/fw_ver") == 1, err
