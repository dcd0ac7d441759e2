"""nic collector: the SFF-8636 and CMIS decoder on byte-exact pages (tests/support/nic.py), the
devlink JSON parser, the netlink readers against this machine's kernel, and the collector end to
end through stand-in ethtool and devlink programs on the DGX tree."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.nic import NicCollector
from gpunet_exporter.sources import devlink, transceiver
from gpunet_exporter.sources.transceiver import CommandEepromReader, decode, read_module

from support import nic
from support import sysfs_tree as st
from support.metrics import Samples, make_collector, samples_of, series, value
from support.paths import REPO
from support.wait import wait_for

ROCE, ROCE2 = "enp170s0f0np0", "enp41s0f0np0"  # netdevs of mlx5_9 and mlx5_8


class PageReader:
    """Pages of tests/support/nic.py as a reader serves them, and the reads asked for."""

    def __init__(self, pages: nic.Pages) -> None:
        self.pages, self.asked = pages, []  # type: list[tuple[int, int, int, int]]

    def read(self, ifname: str, page: int, bank: int, offset: int, length: int,
             i2c_address: int = 0x50) -> bytes:
        self.asked.append((page, bank, offset, length))
        data = self.pages.get("lower" if offset < 128 else f"page{page:02x}")
        if data is None:
            raise OSError(errno.EINVAL, "no such page")
        return data[offset % 128:offset % 128 + length]

    def close(self) -> None:
        pass


def _module(pages: nic.Pages) -> transceiver.Module:
    return read_module(PageReader(pages), "eth0")


# ---- the decoder ---------------------------------------------------------------------------------

def test_cmis_osfp_lanes_thresholds_and_pages_read() -> None:
    reader = PageReader(nic.cmis_osfp(temperature=41.5))
    m = read_module(reader, "eth0")
    assert (m.identifier_name, m.spec, m.vendor, m.part_number) == (
        "OSFP", "cmis", "GPUNET OPTICS", "GN-OSFP-400G-SR4")
    assert m.temperature == 41.5
    # 4 media lanes in use (Application 1, 400GBASE-SR4): lanes 5-8 are not reported.
    assert m.rx_power == pytest.approx([v / 1000 for v in nic.HEALTHY_RX_MW])
    assert m.tx_power == pytest.approx([v / 1000 for v in nic.HEALTHY_TX_MW])
    assert m.thresholds["rx_power"] == pytest.approx(dict(zip(
        transceiver.LEVELS, [v / 1000 for v in nic.RX_LEVELS], strict=True)))
    assert m.thresholds["temperature"] == dict(zip(transceiver.LEVELS,
                                                   nic.TEMPERATURE_LEVELS, strict=True))
    # The lower page, upper page 00h, then 01h, 02h and 11h bank 0: whole upper pages.
    assert reader.asked == [(0, 0, 0, 128), (0, 0, 128, 128), (1, 0, 128, 128),
                            (2, 0, 128, 128), (0x11, 0, 128, 128)]


def test_cmis_media_lanes_follow_the_active_data_paths() -> None:
    pages = nic.cmis_osfp()
    p11 = bytearray(pages["page11"])
    p11[206 - 128:214 - 128] = bytes([0x10, 0x10, 0x10, 0x10, 0x18, 0x18, 0x18, 0x18])
    # Two data paths of Application 1 (4 media lanes each): 8 lanes.
    m = _module({**pages, "page11": bytes(p11)})
    assert len(m.rx_power) == 8 and m.rx_power[4:] == (0.0,) * 4
    p11[206 - 128:214 - 128] = bytes(8)  # no data path active: Application 1's 4 lanes
    assert len(_module({**pages, "page11": bytes(p11)}).rx_power) == 4


def test_sff8636_qsfp56() -> None:
    reader = PageReader(nic.sff8636_qsfp56(temperature=-3.25, rx_mw=(0.5, 0.03, 0.6, 0.7)))
    m = read_module(reader, "eth0")
    assert (m.identifier_name, m.spec, m.part_number) == ("QSFP28", "sff8636",
                                                          "GN-QSFP56-200GSR")
    assert m.temperature == -3.25  # a signed value
    assert m.rx_power == pytest.approx([0.0005, 0.000003 * 10, 0.0006, 0.0007])
    assert m.thresholds["tx_power"]["low_warning"] == pytest.approx(nic.TX_LEVELS[3] / 1000)
    assert [a[0] for a in reader.asked] == [0, 0, 3]


def test_sff8636_without_tx_power_monitor_or_page_3() -> None:
    pages = nic.sff8636_qsfp56()
    p0 = bytearray(pages["page00"])
    p0[220 - 128] = 0x38  # no tx power monitor
    lower = bytearray(pages["lower"])
    lower[2] = 0x04  # flat memory: no page 03h
    m = _module({"lower": bytes(lower), "page00": bytes(p0)})
    assert m.tx_power == () and len(m.rx_power) == 4 and m.thresholds == {}


@pytest.mark.parametrize("pages", [nic.sff8636_dac()], ids=["qsfp56-dac"])
def test_passive_copper_reports_info_only(pages: nic.Pages) -> None:
    reader = PageReader(pages)
    m = read_module(reader, "eth0")
    assert m.passive_copper and m.temperature is None and not m.rx_power and not m.thresholds
    assert m.part_number == "GN-DAC-200G-1M"
    assert len(reader.asked) == 2  # flat memory: no threshold page asked for


def test_cmis_passive_copper_flat_memory() -> None:
    lower = bytearray(nic.cmis_osfp()["lower"])
    lower[2], lower[85] = 0x80, 0x03  # flat memory, passive copper
    reader = PageReader({"lower": bytes(lower), "page00": nic.cmis_osfp()["page00"]})
    m = read_module(reader, "eth0")
    assert m.passive_copper and not m.rx_power and m.temperature is None
    assert len(reader.asked) == 2


def test_cmis_active_copper_reports_what_page_01h_advertises() -> None:
    """An active copper cable (MediaType 04h, linear equalizers): its temperature monitor, and
    no optical power, as page 01h says; a passive one by media technology alone: info only."""
    pages = nic.cmis_osfp(temperature=52.0)
    lower, p0, p1 = (bytearray(pages[k]) for k in ("lower", "page00", "page01"))
    lower[85], p0[212 - 128], p1[160 - 128] = 0x04, 0x0F, 0x00
    m = _module({**pages, "lower": bytes(lower), "page00": bytes(p0), "page01": bytes(p1)})
    assert (m.passive_copper, m.temperature, m.rx_power, m.tx_power) == (False, 52.0, (), ())
    assert set(m.thresholds) == {"temperature"}
    lower[85], p0[212 - 128] = 0x01, 0x0A
    m = _module({**pages, "lower": bytes(lower), "page00": bytes(p0)})
    assert m.passive_copper and m.temperature is None


def test_sfp_and_unknown_identifiers_are_info_only() -> None:
    sfp = bytearray(128)
    sfp[0] = 0x03
    sfp[20:36] = b"SFP VENDOR      "
    sfp[40:56] = b"SFP-10G-SR      "
    reader = PageReader({"lower": bytes(sfp)})
    m = read_module(reader, "eth0")
    assert (m.spec, m.vendor, m.part_number, m.rx_power) == ("sff8472", "SFP VENDOR",
                                                              "SFP-10G-SR", ())
    assert len(reader.asked) == 1
    assert decode(bytes([0x7F]) + bytes(127), {}).identifier_name == "0x7f"


def test_truncated_pages_raise_value_error() -> None:
    pages = nic.cmis_osfp()
    with pytest.raises(ValueError, match="lower page"):
        decode(pages["lower"][:60], {})
    with pytest.raises(ValueError, match="page 11h"):
        decode(pages["lower"], {(0, 0): pages["page00"], (0x11, 0): pages["page11"][:10]})


@settings(max_examples=300, deadline=None)
@given(hs.binary(min_size=128, max_size=128), hs.binary(min_size=128, max_size=128),
       hs.binary(min_size=128, max_size=128), hs.sampled_from([0x0C, 0x0D, 0x11, 0x18, 0x19,
                                                               0x1E, 0x03, 0x00]))
def test_garbage_pages_decode_without_crashing(lower: bytes, upper: bytes, other: bytes,
                                               ident: int) -> None:
    pages = {(0, 0): upper, (1, 0): other, (2, 0): other, (3, 0): other, (0x11, 0): upper}
    m = decode(bytes([ident]) + lower[1:], pages)
    assert len(m.rx_power) <= 8 and all(v >= 0 for v in m.rx_power)


# ---- devlink -j health show ----------------------------------------------------------------------

def test_devlink_json() -> None:
    doc = nic.reporters(["0000:29:00.0"], errors={("0000:29:00.0", "fw_fatal"): 2})
    got = devlink.parse_health_json(json.dumps(doc))
    assert [(r.handle, r.name, r.state, r.errors) for r in got] == [
        ("pci/0000:29:00.0", "fw", "healthy", 0), ("pci/0000:29:00.0", "fw_fatal", "error", 2),
        ("pci/0000:29:00.0", "vnic", "healthy", 0), ("pci/0000:29:00.0/65535", "tx", "healthy", 0),
        ("pci/0000:29:00.0/65535", "rx", "healthy", 0)]
    assert got[3].bus_device == "pci/0000:29:00.0"


@pytest.mark.parametrize("text", ["", "[]", '{"health": []}', "garbage", '{"x": 1}'])
def test_devlink_json_unparseable(text: str) -> None:
    with pytest.raises(ValueError):
        devlink.parse_health_json(text)


def test_devlink_json_odd_entries_are_skipped() -> None:
    text = json.dumps({"health": {"pci/0000:01:00.0": [
        {"reporter": "fw", "state": "healthy", "error": 0, "recover": 0},
        {"reporter": "rx", "state": "healthy", "error": "unlimited", "recover": 0},
        {"reporter": "tx"}, 7], "weird": [{"reporter": "fw"}]}})
    assert [r.name for r in devlink.parse_health_json(text)] == ["fw"]


# ---- the readers against this machine's kernel ---------------------------------------------------

def test_netlink_eeprom_reader_here() -> None:
    """`lo` has no module (EOPNOTSUPP), a missing name is ENODEV; neither is a crash."""
    r = transceiver.NetlinkEepromReader()
    try:
        with pytest.raises(OSError) as exc:
            r.read("lo", 0, 0, 0, 128)
        assert exc.value.errno == errno.EOPNOTSUPP
        with pytest.raises(OSError) as exc:
            r.read("gpunet-none0", 0, 0, 0, 128)
        assert exc.value.errno == errno.ENODEV
    finally:
        r.close()


def test_netlink_health_reader_here() -> None:
    """This machine's kernel may lack devlink (ENOENT) or have it (a list, empty without
    devices); either way an answer, not a crash."""
    r = devlink.NetlinkHealthReader()
    try:
        try:
            got = r.read()
        except OSError as exc:
            assert exc.errno == errno.ENOENT, exc
        else:
            assert isinstance(got, list)
    finally:
        r.close()


needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip"),
    reason="creating a network namespace and a dummy netdev needs root and ip")


@needs_netns
def test_a_netdev_without_module_access_is_unknown(tmp_path: Path) -> None:
    """A real veth netdev named as a RoCE port's netdev, in a network namespace: the netlink
    read says EOPNOTSUPP, the collector reports the transceiver check as unknown."""
    ns = f"gpunet-nic-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "add", ROCE, "type", "veth", "peer", "name",
                        "vb"], check=True)
        tree = st.build_roce_only(tmp_path / "tree")
        code = textwrap.dedent(f"""\
            import json
            from gpunet_exporter.collector import build_collector
            from gpunet_exporter.collectors.nic import NicCollector
            c = build_collector(NicCollector, {{"health_reporters": False}}, sysfs={str(tree)!r})
            c.refresh()
            print(json.dumps({{"unknown": dict(c.unknown()), "read": list(c._last.modules)}}))
            c.close()
            """)
        res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                             capture_output=True, text=True, timeout=60, check=False, cwd=REPO)
        assert res.returncode == 0, res.stderr
        got = json.loads(res.stdout)
        assert got == {"unknown": {"transceiver": "not_supported"}, "read": []}, got
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


# ---- the collector through stand-in programs -----------------------------------------------------

@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path / "tree")


def _pci(sysfs: Path) -> list[str]:
    return sorted(os.path.basename(os.path.realpath(p / "device"))
                  for p in (sysfs / "class/infiniband").iterdir())


def replay(tmp_path: Path, sysfs: Path, modules: dict[str, nic.Pages],
           errors: dict[tuple[str, str], int] | None = None) -> dict[str, object]:
    ethtool, dl = nic.write_replay(tmp_path / "replay", modules,
                                   nic.reporters(_pci(sysfs), errors))
    # The InfiniBand ports' modules acknowledged as watched elsewhere (their IPoIB netdevs
    # cannot read them: test_infiniband_ports_are_unknown_by_default).
    return {"eeprom_source": "ethtool", "ethtool": {"path": str(ethtool)},
            "health_source": "devlink", "devlink": {"path": str(dl)},
            "infiniband_transceivers": False}


def rounds(sysfs: Path, config: dict[str, object]) -> Iterator[tuple[Samples, dict[str, str]]]:
    c = make_collector(NicCollector, sysfs, config)
    c._refresher.stop()  # type: ignore[attr-defined]  # no thread: each next() is one round
    try:
        while True:
            c.refresh()  # type: ignore[attr-defined]
            yield samples_of(list(c.collect(Scrape()))), dict(c.unknown())
    finally:
        c.close()


def test_modules_and_reporters_of_a_healthy_node(dgx: Path, tmp_path: Path) -> None:
    cfg = replay(tmp_path, dgx, {ROCE: nic.cmis_osfp(), ROCE2: nic.sff8636_qsfp56()})
    s, unknown = next(rounds(dgx, cfg))
    assert unknown == {}
    assert value(s, "gpunet_nic_transceiver_info", interface=ROCE, identifier="OSFP",
                 spec="cmis", vendor="GPUNET OPTICS", part_number="GN-OSFP-400G-SR4") == 1
    assert value(s, "gpunet_nic_transceiver_rx_power_watts", interface=ROCE2,
                 lane="4") == pytest.approx(0.00066)
    assert value(s, "gpunet_nic_transceiver_rx_power_threshold_watts", interface=ROCE,
                 level="low_warning") == pytest.approx(0.0001445)
    assert value(s, "gpunet_nic_transceiver_temperature_threshold_celsius", interface=ROCE2,
                 level="high_warning") == 75
    assert value(s, "gpunet_nic_transceiver_refresh_success", interface=ROCE) == 1
    # The IPoIB netdevs of the 8 InfiniBand ports are not read (nic.infiniband_transceivers).
    assert {dict(k)["interface"] for k in series(s, "gpunet_nic_transceiver_info")} == {
        ROCE, ROCE2}
    healthy = series(s, "gpunet_nic_health_reporter_healthy")
    assert len(healthy) == 10 * 5 and set(healthy.values()) == {1}
    devices = {dict(k)["device"] for k in healthy}
    assert devices == {f"mlx5_{i}" for i in range(10)}
    assert value(s, "gpunet_nic_health_refresh_success") == 1


def test_faults_reach_their_metrics(dgx: Path, tmp_path: Path) -> None:
    low = list(nic.HEALTHY_RX_MW)
    low[2] = nic.LOW_RX_MW
    pci = dict(zip([f"mlx5_{i}" for i in range(10)],
                   [os.path.basename(os.path.realpath(dgx / f"class/infiniband/mlx5_{i}/device"))
                    for i in range(10)], strict=True))
    cfg = replay(tmp_path, dgx, {ROCE: nic.cmis_osfp(rx_mw=low),
                                 ROCE2: nic.sff8636_qsfp56(temperature=nic.HOT_C)},
                 errors={(pci["mlx5_8"], "fw_fatal"): 1})
    s, unknown = next(rounds(dgx, cfg))
    assert unknown == {}
    assert value(s, "gpunet_nic_transceiver_rx_power_watts", interface=ROCE,
                 lane="3") == pytest.approx(nic.LOW_RX_MW / 1000)
    assert value(s, "gpunet_nic_transceiver_temperature_celsius", interface=ROCE2) == 78.5
    bad = {dict(k)["device"]: dict(k)["reporter"] for k, v in series(
        s, "gpunet_nic_health_reporter_healthy").items() if v == 0}
    assert bad == {"mlx5_8": "fw_fatal"}
    assert value(s, "gpunet_nic_health_reporter_errors_total", device="mlx5_8",
                 handle=f"pci/{pci['mlx5_8']}", reporter="fw_fatal") == 1


def test_failures_keep_the_last_good_module(dgx: Path, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    cfg = replay(tmp_path, dgx, {ROCE: nic.cmis_osfp(), ROCE2: nic.cmis_osfp()})
    it = rounds(dgx, cfg)
    s, _ = next(it)
    assert value(s, "gpunet_nic_transceiver_temperature_celsius", interface=ROCE) is not None
    (tmp_path / "replay" / ROCE / "page11.bin").write_bytes(b"short")  # the module answers junk
    for _ in range(3):
        s, unknown = next(it)
    assert value(s, "gpunet_nic_transceiver_refresh_success", interface=ROCE) == 0
    assert value(s, "gpunet_nic_transceiver_temperature_celsius", interface=ROCE) is not None
    assert value(s, "gpunet_nic_transceiver_refresh_success", interface=ROCE2) == 1
    assert unknown == {}
    # One warning line for the three failed rounds (later ones at debug level).
    warned = [r for r in caplog.records if r.levelname == "WARNING" and ROCE in r.getMessage()]
    assert len(warned) == 1 and "wrote 5 bytes, not 128" in warned[0].getMessage()


def test_no_module_access_and_no_devlink_are_unknown(dgx: Path, tmp_path: Path) -> None:
    """RoCE netdevs whose driver cannot read modules (no replay folder) and mlx5 devices none of
    whose reporters devlink shows (another network namespace)."""
    cfg = replay(tmp_path, dgx, {})
    (tmp_path / "replay" / "health.json").write_text('{"health": {}}\n')
    s, unknown = next(rounds(dgx, cfg))
    assert unknown == {"transceiver": "not_supported", "health_reporters": "not_supported"}
    assert not series(s, "gpunet_nic_transceiver_info")
    cfg = {**cfg, "ethtool": {"path": str(tmp_path / "none")},
           "devlink": {"path": str(tmp_path / "none")}}
    _, unknown = next(rounds(dgx, cfg))
    assert unknown == {"transceiver": "tool_missing", "health_reporters": "tool_missing"}
    _, unknown = next(rounds(dgx, {**cfg, "transceivers": False, "health_reporters": False}))
    assert unknown == {}


def test_infiniband_ports_are_unknown_by_default(dgx: Path, tmp_path: Path) -> None:
    """The IPoIB netdevs of the 8 InfiniBand ports are tried and cannot read their modules:
    the check is unknown (a check that cannot run is never an ok) until the operator leaves
    them out, which the landing page's summary then says."""
    cfg = replay(tmp_path, dgx, {ROCE: nic.cmis_osfp(), ROCE2: nic.cmis_osfp()})
    del cfg["infiniband_transceivers"]  # the default
    s, unknown = next(rounds(dgx, cfg))
    assert unknown == {"transceiver": "not_supported"}  # IPoIB: no module access
    assert {dict(k)["interface"] for k in series(s, "gpunet_nic_transceiver_info")} == {
        ROCE, ROCE2}
    c = make_collector(NicCollector, dgx, {**cfg, "infiniband_transceivers": False})
    c._refresher.stop()  # type: ignore[attr-defined]
    try:
        c.refresh()  # type: ignore[attr-defined]
        assert c.unknown() == {}
        assert c.summary() == ("2 modules read, 8 InfiniBand ports' modules not read "
                               "(nic.infiniband_transceivers)")
    finally:
        c.close()


def test_command_reader_checks_the_length(tmp_path: Path) -> None:
    tool = tmp_path / "ethtool"
    tool.write_text("#!/bin/sh\nprintf abc\n")
    tool.chmod(0o755)
    with pytest.raises(OSError, match="wrote 3 bytes"):
        CommandEepromReader(str(tool), 5).read("eth0", 0, 0, 0, 128)


class CountingHealth:
    """Reporters from a list, counting the reads."""

    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> list[devlink.Reporter]:
        self.reads += 1
        return []

    def close(self) -> None:
        pass


def test_a_device_event_reads_again_at_once(tmp_path: Path) -> None:
    """The background round runs every interval_seconds (an hour here); a netdev or RDMA device
    that comes or goes (a module swapped with its link) makes it run now."""
    tree = st.build_roce_only(tmp_path / "tree")
    c = make_collector(NicCollector, tree, {"interval_seconds": 3600, "transceivers": False})
    health = CountingHealth()
    c.health = health  # type: ignore[attr-defined]
    try:
        c.collect(Scrape())
        assert health.reads == 1
        c.device_event("pci", "add", {})  # not a netdev or RDMA device: nothing
        c.device_event("net", "add", {"INTERFACE": ROCE})
        wait_for(lambda: health.reads >= 2, "a second read of the reporters")
        assert health.reads == 2
    finally:
        c.close()


def test_a_hanging_ethtool_costs_the_scrape_nothing(dgx: Path, tmp_path: Path) -> None:
    """`ethtool -m` that never answers: the first scrape returns at its deadline, the round
    kills each run after its timeout and the interfaces read as failed, not as unknown."""
    tool = tmp_path / "ethtool"
    tool.write_text("#!/bin/sh\nexec sleep 60\n")
    tool.chmod(0o755)
    c = make_collector(NicCollector, dgx, {"eeprom_source": "ethtool", "health_reporters": False,
                                           "infiniband_transceivers": False,
                                           "ethtool": {"path": str(tool),
                                                       "timeout_seconds": 0.3}})
    try:
        t0 = time.monotonic()
        s = samples_of(list(c.collect(Scrape(time.monotonic() + 0.5))))
        assert time.monotonic() - t0 < 2
        assert not series(s, "gpunet_nic_transceiver_info")

        wait_for(lambda: len(c._last.modules) == 2,  # type: ignore[attr-defined]
                 "the round to end with both interfaces failed")
        s = samples_of(list(c.collect(Scrape())))
        assert value(s, "gpunet_nic_transceiver_refresh_success", interface=ROCE) == 0
        assert c.unknown() == {}
    finally:
        c.close()
