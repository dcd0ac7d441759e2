"""pfc collector: QoS configuration parsers (mlnx_qos, dcb, OFED sysfs, ECN), the counter name
table, per-priority counters without zero-fill, broken configuration tools, and the SIOCETHTOOL
path on a real veth pair in a network namespace."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
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
from gpunet_exporter.collectors.pfc import (
    _PRIORITY_IN_NAME,
    COUNTER_SPECS,
    NAMES,
    OTHER,
    PfcCollector,
)
from gpunet_exporter.collectors.tables import load
from gpunet_exporter.registry import Scraper
from gpunet_exporter.sources.ethtool import NicStats, parse_stats_text
from gpunet_exporter.sources.qos import (
    QOS_FILES,
    QosConfig,
    parse_dcb,
    parse_mlnx_qos,
    parse_qos_sysfs,
    read_ecn,
)
from gpunet_exporter.sources.sysfs import Root

from support import sysfs_tree as st
from support.exporter import free_port
from support.metrics import (
    Samples,
    make_collector,
    parse,
    samples_of,
    scrape_and_page,
    series,
    value,
)
from support.paths import FIXTURES, REPO
from support.wait import wait_for

DATA = FIXTURES / "pfc"
CAPTURE = FIXTURES / "synthetic" / "ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt"
ROCE = "enp170s0f0np0"  # netdev of mlx5_9 in the DGX tree
ROCE2 = "enp41s0f0np0"  # netdev of mlx5_8
NO_TOOL = "/nonexistent/tool"
LAST_SUCCESS = "gpunet_pfc_config_last_success_timestamp_seconds"


# ---- mlnx_qos ---------------------------------------------------------------------------------

def _qos(name: str) -> QosConfig:
    return parse_mlnx_qos((DATA / name).read_text())


def test_mlnx_qos_os_controlled_dscp_trust_custom_map() -> None:
    cfg = _qos("mlnx_qos_os-dscp-pfc5-custom.txt")
    assert (cfg.source, cfg.dcbx_mode, cfg.trust) == ("mlnx_qos", "os", "dscp")
    assert cfg.pfc == {p: p == 5 for p in range(8)}
    # Default map dscp >> 3, except 26 moved to priority 5 (its line wrapped after 8 values).
    assert cfg.dscp_prio == {d: 5 if d == 26 else d >> 3 for d in range(64)}
    assert cfg.default_prio is None  # header present, no entry
    assert cfg.buffer_size == {0: 130944, 1: 130944, **dict.fromkeys(range(2, 8), 0)}
    assert cfg.buffer_total == 1048576  # max_buffer_size=
    assert cfg.prio_buffer == {p: int(p == 5) for p in range(8)}
    assert cfg.prio_tc == {0: 1, 1: 0, **{p: p for p in range(2, 8)}}
    assert set(cfg.tc_tsa.values()) == {"strict"} and not cfg.tc_bw and not cfg.tc_rate_limit


def test_mlnx_qos_firmware_controlled_total_size_ets() -> None:
    cfg = _qos("mlnx_qos_fw-buffers-total-size.txt")
    assert (cfg.dcbx_mode, cfg.trust, cfg.default_prio) == ("firmware", "pcp", 3)
    assert [p for p, on in cfg.pfc.items() if on] == [3]
    assert cfg.buffer_total == 262016  # total_size= of older builds
    assert cfg.tc_bw == {0: 10.0, 1: 10.0, 3: 80.0}
    assert cfg.tc_tsa[2] == "vendor" and cfg.tc_tsa[6] == "strict"
    assert cfg.tc_rate_limit == {6: 8e9 / 8}  # "8.0 Gbps"
    assert not cfg.dscp_prio  # pcp trust: no dscp2prio section


def test_mlnx_qos_warnings_and_unsupported_features() -> None:
    cfg = _qos("mlnx_qos_os-vendor-no-buffers.txt")
    assert (cfg.dcbx_mode, cfg.trust) == ("os", "none")
    assert cfg.pfc == dict.fromkeys(range(8), False)
    assert not cfg.buffer_size and cfg.buffer_total is None and not cfg.prio_buffer
    assert cfg.prio_tc == dict.fromkeys(range(8), 0)
    assert cfg.tc_rate_limit == {0: 25.5e9 / 8}


def test_mlnx_qos_old_layout_whitespace_lost() -> None:
    cfg = _qos("mlnx_qos_old-ofed-whitespace-lost.txt")
    assert cfg.trust == "pcp" and cfg.dcbx_mode == ""  # "Priority trust mode:", no DCBX line
    assert [p for p, on in cfg.pfc.items() if on] == [3]
    assert cfg.prio_tc == {0: 1, 1: 0, 2: 2, 3: 3, 4: 2, 5: 2, 6: 2, 7: 2}  # "up:" members
    assert cfg.tc_bw == {3: 60.0, 2: 40.0}


_REPORTS = sorted(p.name for p in DATA.glob("mlnx_qos_*.txt"))


@pytest.mark.parametrize("name", _REPORTS)
@settings(max_examples=25, deadline=None)
@given(data=hs.data())
def test_mlnx_qos_whitespace_does_not_matter(name: str, data: hs.DataObject) -> None:
    """TABs turned into runs of spaces, trailing blanks, CRLF line ends, blank lines: same
    configuration."""
    text = (DATA / name).read_text()
    blank = data.draw(hs.sampled_from([" ", "  ", "\t", " \t "]), label="blank")
    trail = data.draw(hs.sampled_from(["", " ", "\t", "   "]), label="trailing")
    end = data.draw(hs.sampled_from(["\n", "\r\n", "\n\n"]), label="line end")
    mangled = end.join(ln.replace("\t", blank) + trail for ln in text.splitlines()) + end
    assert parse_mlnx_qos(mangled) == parse_mlnx_qos(text)


@settings(max_examples=200, deadline=None)
@given(hs.text())
def test_mlnx_qos_never_raises_anything_but_value_error(text: str) -> None:
    with contextlib.suppress(ValueError):
        parse_mlnx_qos(text)


@pytest.mark.parametrize("text", ["", "garbage\n", "mlnx_qos: command not found\n",
                                  "Interface name is required\nUsage: mlnx_qos -i <interface>\n"])
def test_mlnx_qos_unparseable(text: str) -> None:
    with pytest.raises(ValueError):
        parse_mlnx_qos(text)


# ---- dcb --------------------------------------------------------------------------------------

def _dcb(version: str) -> QosConfig:
    d = DATA / version

    def part(obj: str) -> str | None:
        f = d / f"{obj}.json"
        return f.read_text() if f.exists() else None

    pfc = part("pfc")
    assert pfc is not None
    return parse_dcb(pfc, ets=part("ets"), app=part("app"), buffer=part("buffer"),
                     dcbx=part("dcbx"), apptrust=part("apptrust"))


@pytest.mark.parametrize("version", ["dcb-6.1", "dcb-6.15"])
def test_dcb_json(version: str) -> None:
    cfg = _dcb(version)
    assert (cfg.source, cfg.dcbx_mode, cfg.trust) == ("dcb", "os", "dscp")
    assert [p for p, on in cfg.pfc.items() if on] == [3]
    assert cfg.dscp_prio == {d: d >> 3 for d in range(64)}  # [d, p] and [d, p, " "] entries
    assert cfg.prio_tc[0] == 1 and cfg.prio_tc[3] == 3
    assert cfg.tc_bw == {3: 60.0, 5: 40.0}  # only for ets TCs
    assert cfg.tc_tsa[3] == "ets" and cfg.tc_tsa[0] == "strict"
    assert cfg.prio_buffer[3] == 1 and cfg.buffer_size[1] == 261888
    assert cfg.buffer_total == 1048576


def test_dcb_optional_parts_and_trust_inference() -> None:
    pfc = (DATA / "dcb-6.1" / "pfc.json").read_text()
    cfg = parse_dcb(pfc)
    assert cfg.trust == "" and cfg.dcbx_mode == "" and not cfg.prio_tc
    assert parse_dcb(pfc, app="{}").trust == "pcp"  # no DSCP app entries
    assert parse_dcb(pfc, dcbx='{"ieee":true}').dcbx_mode == "firmware"  # no host bit
    assert parse_dcb(pfc, apptrust='{"order":["pcp","dscp"]}').trust == "pcp"
    assert parse_dcb(pfc, app='{"default_prio":[3]}').default_prio == 3


@pytest.mark.parametrize("text", ["", "\n", "not json", "[]", '{"pfc_cap":8}', "[1, 2]"])
def test_dcb_unparseable(text: str) -> None:
    with pytest.raises(ValueError):
        parse_dcb(text)


# ---- OFED sysfs and ECN ----------------------------------------------------------------------

@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path / "tree")


def test_ofed_qos_sysfs_and_ecn(dgx: Path) -> None:
    netdev = st.make_ofed_qos(dgx, "mlx5_9", pfc_priority=3)
    assert netdev == ROCE
    qos = dgx / "class/net" / ROCE / "qos"
    cfg = parse_qos_sysfs({f: (qos / f).read_text() for f in QOS_FILES})
    assert (cfg.source, cfg.trust) == ("sysfs", "dscp")
    assert cfg.buffer_total == 1048576 and cfg.buffer_size[1] == 261888
    assert cfg.prio_buffer == {p: int(p == 3) for p in range(8)}
    assert cfg.dscp_prio == {d: d >> 3 for d in range(64)}
    assert not cfg.pfc  # the OFED qos/ files do not say
    skipped: list[str] = []
    ecn = read_ecn(Root(str(dgx)), ROCE, lambda what, why: skipped.append(what))
    assert ecn.enabled == {(pt, p): p == 3 for pt in ("np", "rp") for p in range(8)}
    assert (ecn.cnp_dscp, ecn.cnp_priority, skipped) == (48, 6, [])
    # Upstream driver: no ecn/ at all, which is "unknown", not "disabled".
    assert read_ecn(Root(str(dgx)), ROCE2, lambda *a: None).enabled == {}
    # A file the driver leaves empty (firmware query failed) costs that value alone.
    (dgx / "class/net" / ROCE / "ecn/roce_np/enable/3").write_text("")
    ecn = read_ecn(Root(str(dgx)), ROCE, lambda what, why: skipped.append(what))
    assert ("np", 3) not in ecn.enabled and ("rp", 3) in ecn.enabled and len(skipped) == 1


# ---- ethtool -S text and the name table ------------------------------------------------------

def test_ethtool_text_parser() -> None:
    stats = parse_stats_text(CAPTURE.read_text())
    got = dict(zip(stats.names, stats.values, strict=True))
    assert got["rx_prio3_pause_duration"] == 20913 and got["tx_prio3_pause"] == 622
    assert "rx_prio0_pause" not in got  # PFC is off on priority 0: the driver prints nothing
    assert not any(n.startswith(("#", "NIC")) for n in stats.names)
    odd = parse_stats_text("NIC statistics:\n     tx_pause_storm_warning_events : 3\n"
                           "\trx_priority_0_xoff.nic: 7\n     broken line\n     x: -1\n"
                           "     y: 1.5\n     rx_prio3_pause:  12  \n")
    assert dict(zip(odd.names, odd.values, strict=True)) == {
        "tx_pause_storm_warning_events": 3, "rx_priority_0_xoff.nic": 7, "rx_prio3_pause": 12}


def test_name_table_is_consistent() -> None:
    rows = load("pfc_ethtool.csv")
    assert {r["metric"] for r in rows} <= set(COUNTER_SPECS)
    unused = set(COUNTER_SPECS) - {r["metric"] for r in rows} - {"priority_other"}
    assert not unused, f"declared but never mapped: {unused}"
    seen: set[str] = set()
    for row in rows:
        assert row["name"] not in seen, f"duplicate row {row['name']}"
        seen.add(row["name"])
        spec = COUNTER_SPECS[row["metric"]]
        assert (row["direction"] in ("rx", "tx")) == ("direction" in spec.labels), row
        per_priority = "{p}" in row["name"]
        assert per_priority == ("priority" in spec.labels), row
        assert ("{l}" in row["name"]) == ("lane" in spec.labels), row
        assert float(row["scale"]) > 0 and (1 / float(row["scale"])).is_integer(), row
        if spec.name.endswith("_seconds_total"):
            assert float(row["scale"]) == 1e-6, row  # drivers count microseconds
    # Every per-priority name of the table also reads as per-priority to the generic matcher,
    # so a spelling dropped from the table still lands in gpunet_pfc_priority_other_total.
    for name, target in NAMES.items():
        if "priority" in target.spec.labels:
            m = _PRIORITY_IN_NAME.search(name)
            assert m and m.group(1) == target.labels[0], name
        else:
            assert not _PRIORITY_IN_NAME.search(name), name


# ---- the collector on counters ---------------------------------------------------------------

class TextReader:
    """Counters from ethtool -S text per interface (a capture), ENODEV for the rest."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts
        self.cache: dict[str, tuple[str, NicStats]] = {}

    def read(self, ifname: str) -> NicStats:
        if ifname not in self.texts:
            raise OSError(errno.ENODEV, "No such device")
        text = self.texts[ifname]
        old = self.cache.get(ifname)
        if old is None or old[0] != text:
            self.cache[ifname] = (text, parse_stats_text(text))
        return self.cache[ifname][1]

    def close(self) -> None:
        pass


def scrape(sysfs: Path, reader: TextReader, config: dict[str, object] | None = None
           ) -> tuple[Samples, int]:
    cfg: dict[str, object] = {"config": {"sources": ["sysfs"]}, **(config or {})}
    c = make_collector(PfcCollector, sysfs, cfg)
    c.reader = reader  # type: ignore[attr-defined]
    try:
        return samples_of(list(c.collect(Scrape()))), c.ctx.unreadable
    finally:
        c.close()


def per_prio(s: Samples, name: str, ifname: str = ROCE, direction: str = "rx"
             ) -> dict[str, float]:
    out = {}
    for lbl, v in series(s, name).items():
        d = dict(lbl)
        if d["interface"] == ifname and d.get("direction", direction) == direction:
            out[d["priority"]] = v
    return out


def test_counters_of_a_pfc_port_are_not_zero_filled(dgx: Path) -> None:
    s, unreadable = scrape(dgx, TextReader({ROCE: CAPTURE.read_text()}))
    assert unreadable == 0  # enp41s0f0np0 has no counters here (ENODEV): not an error
    assert per_prio(s, "gpunet_pfc_pause_frames_total") == {"3": 1840}
    assert per_prio(s, "gpunet_pfc_pause_frames_total", direction="tx") == {"3": 622}
    assert per_prio(s, "gpunet_pfc_pause_duration_seconds_total") == {"3": 20913e-6}
    assert per_prio(s, "gpunet_pfc_pause_transitions_total") == {"3": 920}
    assert per_prio(s, "gpunet_pfc_priority_bytes_total")["3"] == 372425941406
    assert len(per_prio(s, "gpunet_pfc_priority_discards_total")) == 8
    assert set(per_prio(s, "gpunet_pfc_priority_congestion_discards_total")) == {"0", "3"}
    assert value(s, "gpunet_pfc_pause_control_frames_total", interface=ROCE,
                 direction="rx") == 1840
    assert value(s, "gpunet_pfc_pause_storm_error_events_total", interface=ROCE) == 0
    assert not series(s, "gpunet_pfc_global_pause_frames_total")  # global pause off
    assert not [k for k in s if ("interface", ROCE2) in k[1]]
    assert not series(s, "gpunet_pfc_priority_other_total")


def test_other_kernels_and_drivers(dgx: Path) -> None:
    legacy = "NIC statistics:\n" + "".join(
        f"     {n}: {v}\n" for n, v in (
            ("prio3_rx_octets", 4000), ("prio3_tx_frames", 30), ("prio3_rx_pause", 5),
            ("prio3_rx_pause_duration", 2500000), ("pause_ctrl_rx", 5), ("symbol_err", 2),
            ("tx_pause_storm_warning_events ", 1), ("rx_prio3_future_thing", 77),
            ("rx0_packets", 12), ("rx_bits_phy", 800), ("rx_corrected_bits_phy", 3),
            ("rx_err_lane_1_phy", 9)))
    bnxt = ("NIC statistics:\n     rx_pfc_ena_frames_pri5: 11\n     pfc_pri5_tx_duration_us: 4\n"
            "     rx_bytes_pri5: 1000\n     rx_priority_2_xon.nic: 6\n")
    s, unreadable = scrape(dgx, TextReader({ROCE: legacy, ROCE2: bnxt}))
    assert unreadable == 0
    assert per_prio(s, "gpunet_pfc_priority_bytes_total") == {"3": 4000}
    assert per_prio(s, "gpunet_pfc_priority_packets_total", direction="tx") == {"3": 30}
    assert per_prio(s, "gpunet_pfc_pause_duration_seconds_total") == {"3": 2.5}
    assert value(s, "gpunet_pfc_pause_control_frames_total", interface=ROCE, direction="rx") == 5
    assert value(s, "gpunet_pfc_symbol_errors_total", interface=ROCE) == 2
    assert value(s, "gpunet_pfc_pause_storm_warning_events_total", interface=ROCE) == 1
    assert value(s, "gpunet_pfc_phy_received_bytes_total", interface=ROCE) == 100
    assert value(s, "gpunet_pfc_fec_corrected_bit_errors_total", interface=ROCE) == 3
    assert value(s, "gpunet_pfc_phy_lane_raw_errors_total", interface=ROCE, lane="1") == 9
    # An unknown per-priority name is exported generically; a per-queue one is not.
    assert value(s, OTHER.name, interface=ROCE, priority="3", counter="rx_prio3_future_thing") \
        == 77
    assert not [k for k in s if "rx0_packets" in str(k)]
    assert per_prio(s, "gpunet_pfc_pause_frames_total", ROCE2) == {"5": 11}
    assert per_prio(s, "gpunet_pfc_pause_duration_seconds_total", ROCE2, "tx") == {"5": 4e-6}
    assert per_prio(s, "gpunet_pfc_priority_bytes_total", ROCE2) == {"5": 1000}
    assert value(s, OTHER.name, interface=ROCE2, priority="2", counter="rx_priority_2_xon.nic") \
        == 6


def test_labels_follow_the_names_when_pfc_moves(dgx: Path) -> None:
    """Same number of statistics, other names: PFC moved from priority 3 to 4."""
    reader = TextReader({ROCE: "     rx_prio3_pause: 10\n     rx_prio3_bytes: 1\n"})
    c = make_collector(PfcCollector, dgx, {"config": {"sources": ["sysfs"]}})
    c.reader = reader  # type: ignore[attr-defined]
    try:
        first = samples_of(list(c.collect(Scrape())))
        reader.texts[ROCE] = "     rx_prio4_pause: 2\n     rx_prio4_bytes: 1\n"
        second = samples_of(list(c.collect(Scrape())))
    finally:
        c.close()
    assert per_prio(first, "gpunet_pfc_pause_frames_total") == {"3": 10}
    assert per_prio(second, "gpunet_pfc_pause_frames_total") == {"4": 2}


class FailingReader(TextReader):
    def read(self, ifname: str) -> NicStats:
        if ifname == ROCE2:
            raise OSError(errno.EIO, "Input/output error")
        return super().read(ifname)


def test_a_failing_interface_costs_only_its_counters(dgx: Path) -> None:
    s, unreadable = scrape(dgx, FailingReader({ROCE: CAPTURE.read_text()}))
    assert unreadable == 1
    assert per_prio(s, "gpunet_pfc_pause_frames_total") == {"3": 1840}


def test_interfaces_filters(dgx: Path) -> None:
    reader = TextReader({n: CAPTURE.read_text() for n in (ROCE, ROCE2, "eno1")})
    s, _ = scrape(dgx, reader, {"interfaces": ["eno1", "nope0"], "interface_exclude": "^enp41"})
    got = {dict(lbl)["interface"] for lbl in series(s, "gpunet_pfc_pause_frames_total")}
    assert got == {ROCE, "eno1"}  # IPoIB netdevs are not RoCE; nope0 does not exist
    s, _ = scrape(dgx, reader, {"interface_include": "^enp41"})
    assert {dict(lbl)["interface"] for lbl in series(s, "gpunet_pfc_pause_frames_total")} == {
        ROCE2}


# ---- configuration refresh with stand-in tools ----------------------------------------------

def tool(tmp_path: Path, name: str, body: str) -> Path:
    """A real executable standing in for mlnx_qos, dcb or ethtool."""
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def refreshed(sysfs: Path, config: dict[str, object]) -> Iterator[Samples]:
    """A collector whose background thread is not started: each next() runs one refresh round
    (as the thread would) and one scrape."""
    c = make_collector(PfcCollector, sysfs, config)
    c.reader = TextReader({})  # type: ignore[attr-defined]
    c._refresher.stop()  # type: ignore[attr-defined]  # stopped before it starts: no thread
    try:
        while True:
            c.refresh()  # type: ignore[attr-defined]
            yield samples_of(list(c.collect(Scrape())))
    finally:
        c.close()


def _cfg(**kw: object) -> dict[str, object]:
    return {"config": {"mlnx_qos_path": NO_TOOL, "dcb_path": NO_TOOL, **kw}}


def test_mlnx_qos_refresh_and_last_good_values(dgx: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.txt"
    shutil.copy(DATA / "mlnx_qos_fw-buffers-total-size.txt", report)
    # Prints the report while it exists, then fails like a tool on a broken driver.
    qos = tool(tmp_path, "mlnx_qos", f'[ "$1" = -i ] || exit 9\n[ -f {report} ] || '
               "{ echo 'Netlink error' >&2; exit 1; }\n" f"cat {report}\n")
    rounds = refreshed(dgx, _cfg(mlnx_qos_path=str(qos)))
    s = next(rounds)
    for ifname in (ROCE, ROCE2):
        assert value(s, "gpunet_pfc_config_info", interface=ifname, source="mlnx_qos",
                     dcbx_mode="firmware", trust="pcp") == 1
        assert value(s, "gpunet_pfc_config_refresh_success", interface=ifname) == 1
        assert value(s, "gpunet_pfc_enabled", interface=ifname, priority="3") == 1
        assert value(s, "gpunet_pfc_enabled", interface=ifname, priority="0") == 0
    assert value(s, "gpunet_pfc_traffic_class_bandwidth_ratio", interface=ROCE, tc="3") == 0.8
    assert value(s, "gpunet_pfc_traffic_class_info", interface=ROCE, tc="2", tsa="vendor") == 1
    assert value(s, "gpunet_pfc_traffic_class_rate_limit_bytes_per_second", interface=ROCE,
                 tc="6") == 1e9
    assert value(s, "gpunet_pfc_priority_traffic_class", interface=ROCE, priority="0") == 1
    assert value(s, "gpunet_pfc_buffer_capacity_bytes", interface=ROCE) == 262016
    assert value(s, "gpunet_pfc_default_priority", interface=ROCE) == 3
    assert not series(s, "gpunet_pfc_dscp_priority")  # pcp trust
    good = value(s, LAST_SUCCESS, interface=ROCE)
    assert good is not None and abs(time.time() - good) < 60
    report.unlink()
    time.sleep(0.05)
    s = next(rounds)
    assert value(s, "gpunet_pfc_config_refresh_success", interface=ROCE) == 0
    assert value(s, "gpunet_pfc_enabled", interface=ROCE, priority="3") == 1  # last good kept
    assert value(s, LAST_SUCCESS, interface=ROCE) == good  # and no longer advances
    shutil.copy(DATA / "mlnx_qos_fw-buffers-total-size.txt", report)
    s = next(rounds)
    assert value(s, "gpunet_pfc_config_refresh_success", interface=ROCE) == 1
    later = value(s, LAST_SUCCESS, interface=ROCE)
    assert later is not None and later > good
    rounds.close()


@pytest.mark.parametrize("body,reason", [("sleep 30\n", "hangs"), ("exit 1\n", "fails"),
                                         ("echo garbage; echo more garbage\n", "garbage")])
def test_broken_mlnx_qos(dgx: Path, tmp_path: Path, body: str, reason: str) -> None:
    qos = tool(tmp_path, "mlnx_qos", body)
    t0 = time.monotonic()
    s = next(refreshed(dgx, _cfg(mlnx_qos_path=str(qos), timeout_seconds=0.5)))
    assert time.monotonic() - t0 < 10  # killed after its timeout
    assert value(s, "gpunet_pfc_config_refresh_success", interface=ROCE) == 0
    assert not series(s, "gpunet_pfc_config_info")  # never had good values
    assert not series(s, LAST_SUCCESS)
    # Not unknown: the tool is there and fails, which GpunetPfcConfigUnreadable reports per
    # interface from the series above.
    s, page = scrape_and_page(make_collector(PfcCollector, dgx, _cfg(
        mlnx_qos_path=str(qos), timeout_seconds=0.5)))
    assert value(s, "gpunet_pfc_config_refresh_success", interface=ROCE) == 0
    assert not series(s, "gpunet_check_unknown") and "UNKNOWN" not in page


def test_first_scrape_does_not_wait_for_a_slow_mlnx_qos(dgx: Path, tmp_path: Path) -> None:
    """mlnx_qos slower than the scrape timeout (its own timeout, 30 s, longer still): the scrape
    answers within its deadline with the counters, and no configuration, success or timestamp
    yet; a later scrape has them."""
    gate = tmp_path / "gate"
    qos = tool(tmp_path, "mlnx_qos", f"while [ ! -f {gate} ]; do sleep 0.05; done\n"
               f"cat {DATA / 'mlnx_qos_fw-buffers-total-size.txt'}\n")
    c = make_collector(PfcCollector, dgx, _cfg(mlnx_qos_path=str(qos), sources=["mlnx_qos"],
                                               timeout_seconds=30))
    c.reader = TextReader({ROCE: CAPTURE.read_text()})  # type: ignore[attr-defined]
    scraper = Scraper({"pfc": c}, 1.0)
    try:
        for _ in range(2):  # the first scrape waits (up to its deadline), the second does not
            t0 = time.monotonic()
            s = samples_of(list(scraper.collect()))
            assert time.monotonic() - t0 < 25  # not the tool's 30 s
            # Finished within the deadline: the registry says 0 for a collector it gave up on.
            assert value(s, "gpunet_scrape_collector_success", collector="pfc") == 1
            assert per_prio(s, "gpunet_pfc_pause_frames_total") == {"3": 1840}
            assert not series(s, "gpunet_pfc_config_info")
            assert not series(s, "gpunet_pfc_config_refresh_success")
            assert not series(s, LAST_SUCCESS)
        gate.write_text("")
        s = wait_for(lambda: (lambda s: s if len(series(  # one per interface
            s, "gpunet_pfc_config_refresh_success")) >= 2 else None)(
                samples_of(list(scraper.collect()))), "the configuration", timeout=20)
    finally:
        c.close()
    for ifname in (ROCE, ROCE2):
        assert value(s, "gpunet_pfc_config_refresh_success", interface=ifname) == 1
        assert value(s, "gpunet_pfc_enabled", interface=ifname, priority="3") == 1
        when = value(s, LAST_SUCCESS, interface=ifname)
        assert when is not None and abs(time.time() - when) < 60


PFC_UNKNOWN = {frozenset({("collector", "pfc"), ("check", "pfc_config"),
                          ("reason", "tool_missing")}): 1}


def test_no_source_installed_is_no_data_and_an_unknown_check(dgx: Path) -> None:
    """RoCE netdevs, and none of mlnx_qos, dcb or qos/ files: no configuration series (nothing
    failed), but PFC is not checked, and gpunet_check_unknown and the landing page say so."""
    s, page = scrape_and_page(make_collector(PfcCollector, dgx, _cfg()))
    assert not series(s, "gpunet_pfc_config_refresh_success")
    assert not series(s, "gpunet_pfc_config_info")
    assert series(s, "gpunet_check_unknown") == PFC_UNKNOWN
    assert "UNKNOWN: pfc_config not checked (its command-line tool is not installed)" in page


def test_ofed_qos_files_alone_leave_pfc_unknown(dgx: Path) -> None:
    """MLNX_OFED's qos/ files give trust and buffers but not whether PFC is on: what they hold
    is reported, and the check is still unknown."""
    for device in ("mlx5_8", "mlx5_9"):
        st.make_ofed_qos(dgx, device)
    s, page = scrape_and_page(make_collector(PfcCollector, dgx, _cfg(sources=["sysfs"])))
    for ifname in (ROCE, ROCE2):
        assert value(s, "gpunet_pfc_config_info", interface=ifname, source="sysfs",
                     dcbx_mode="", trust="dscp") == 1
        assert value(s, "gpunet_pfc_priority_buffer", interface=ifname, priority="3") == 1
    assert not series(s, "gpunet_pfc_enabled")
    assert series(s, "gpunet_check_unknown") == PFC_UNKNOWN
    assert "UNKNOWN: pfc_config not checked" in page


@pytest.mark.parametrize("case", ["switched off", "no RoCE port"])
def test_pfc_config_not_asked_for(tmp_path: Path, case: str) -> None:
    """``sources: []`` (PFC checked another way), or a node with InfiniBand ports only: nothing
    unknown, though no source is installed."""
    if case == "switched off":
        tree, cfg = st.build_dgx_h100(tmp_path / "t"), _cfg(sources=[])
    else:
        tree, cfg = st.build_scaled(tmp_path / "t", 2), _cfg()
    s, page = scrape_and_page(make_collector(PfcCollector, tree, cfg))
    assert not series(s, "gpunet_check_unknown")
    assert not series(s, "gpunet_pfc_config_info")
    assert "UNKNOWN" not in page and "<td>pfc</td><td>ok</td>" in page


DCB_SCRIPT = """\
[ "$1" = -j ] && [ "$3" = show ] && [ "$4" = dev ] || exit 255
f={dir}/$2.json
[ -f "$f" ] || {{ echo "Attribute read: Operation not supported" >&2; echo; exit 1; }}
cat "$f"
"""


@pytest.mark.parametrize("version", ["dcb-6.1", "dcb-6.15"])
def test_dcb_refresh(dgx: Path, tmp_path: Path, version: str) -> None:
    d = tmp_path / version
    shutil.copytree(DATA / version, d)
    (d / "buffer.json").unlink()  # a driver without buffer commands: exit 1, not a failure
    dcb = tool(tmp_path, "dcb", DCB_SCRIPT.format(dir=d))
    s = next(refreshed(dgx, _cfg(dcb_path=str(dcb), sources=["mlnx_qos", "dcb", "sysfs"])))
    assert value(s, "gpunet_pfc_config_refresh_success", interface=ROCE) == 1
    assert value(s, "gpunet_pfc_config_info", interface=ROCE, source="dcb", dcbx_mode="os",
                 trust="dscp") == 1
    assert value(s, "gpunet_pfc_dscp_priority", interface=ROCE, dscp="26") == 3
    assert len(per_prio(s, "gpunet_pfc_enabled")) == 8
    assert not series(s, "gpunet_pfc_buffer_size_bytes")
    (d / "pfc.json").unlink()  # the one required read fails
    s = next(refreshed(dgx, _cfg(dcb_path=str(dcb), sources=["dcb"])))
    assert value(s, "gpunet_pfc_config_refresh_success", interface=ROCE) == 0


def test_sources_order_and_sysfs_source(dgx: Path, tmp_path: Path) -> None:
    st.make_ofed_qos(dgx, "mlx5_9")
    qos = tool(tmp_path, "mlnx_qos", f"cat {DATA / 'mlnx_qos_os-dscp-pfc5-custom.txt'}\n")
    s = next(refreshed(dgx, _cfg(mlnx_qos_path=str(qos), sources=["sysfs", "mlnx_qos"])))
    assert value(s, "gpunet_pfc_config_info", interface=ROCE, source="sysfs", dcbx_mode="",
                 trust="dscp") == 1  # first in the order and present
    assert value(s, "gpunet_pfc_config_info", interface=ROCE2, source="mlnx_qos",
                 dcbx_mode="os", trust="dscp") == 1  # no qos/ there: the next source
    assert value(s, "gpunet_pfc_ecn_enabled", interface=ROCE, priority="3", point="rp") == 1
    assert value(s, "gpunet_pfc_ecn_cnp_dscp", interface=ROCE) == 48
    assert not [k for k in s if k[0] == "gpunet_pfc_ecn_enabled" and ("interface", ROCE2) in k[1]]


# ---- the exporter, end to end, with stand-in tools -------------------------------------------

ETHTOOL_SCRIPT = """\
[ "$1" = -S ] || exit 2
case "$2" in
  {roce}) cat {capture} ;;
  *) echo "Cannot get stats strings information: No such device" >&2; exit 1 ;;
esac
"""


@pytest.mark.parametrize("mode", ["hangs", "fails", "garbage"])
def test_exporter_answers_through_broken_tools(dgx: Path, tmp_path: Path, run_exporter,  # type: ignore[no-untyped-def]
                                                mode: str) -> None:
    body = {"hangs": "exec sleep 60\n", "fails": "echo boom >&2; exit 3\n",
            "garbage": "head -c 300 /dev/urandom\n"}[mode]
    qos = tool(tmp_path, "mlnx_qos", body)
    ethtool = tool(tmp_path, "ethtool", ETHTOOL_SCRIPT.format(roce=ROCE, capture=CAPTURE))
    config = tmp_path / "gpunet.yml"
    config.write_text(textwrap.dedent(f"""\
        collectors: {{infiniband: false, link: false}}
        pfc:
          stats_source: ethtool
          ethtool: {{path: {ethtool}}}
          config: {{sources: [mlnx_qos], mlnx_qos_path: {qos}, timeout_seconds: 1,
                    interval_seconds: 1}}
        """))
    e = run_exporter(f"--path.sysfs={dgx}", f"--config.file={config}", "--scrape.timeout=5")
    for _ in range(3):
        t0 = time.monotonic()
        s = parse(e.metrics())
        assert time.monotonic() - t0 < 5
        assert value(s, "gpunet_scrape_collector_success", collector="pfc") == 1
        assert per_prio(s, "gpunet_pfc_pause_frames_total") == {"3": 1840}
        time.sleep(0.4)
    def failed() -> Samples | None:
        s = parse(e.metrics())
        return s if value(s, "gpunet_pfc_config_refresh_success", interface=ROCE) == 0 else None

    s = wait_for(failed, "refresh_success 0", timeout=10, interval=0.3)
    assert not series(s, "gpunet_pfc_config_info")


@pytest.mark.parametrize("yaml_text,key", [
    ("pfc:\n  stats_source: netlink\n", "pfc.stats_source"),
    ("pfc:\n  config: {sources: [lldptool]}\n", "pfc.config.sources[0]"),
    ("pfc:\n  config: {interval_seconds: 0}\n", "pfc.config.interval_seconds"),
])
def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, yaml_text: str, key: str) -> None:
    cfg = tmp_path / "bad.yml"
    cfg.write_text(yaml_text)
    exe = shutil.which("gpunet-exporter")
    assert exe
    listen = f"--web.listen-address=127.0.0.1:{free_port()}"
    res = subprocess.run([exe, f"--config.file={cfg}", listen], capture_output=True, text=True,
                         timeout=30, check=False)
    assert res.returncode == 2, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and key in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


# ---- SIOCETHTOOL on a real veth pair in a network namespace ----------------------------------

needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("ethtool"),
    reason="creating a network namespace and veth pair needs root, ip and ethtool")


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"gpunet-test-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for a, b, q in (("va", "vb", 4), ("vc", "vd", 64)):
            subprocess.run(["ip", "-n", name, "link", "add", a, "numtxqueues", str(q),
                            "numrxqueues", str(q), "type", "veth", "peer", "name", b], check=True)
            subprocess.run(["ip", "-n", name, "link", "set", a, "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_netns(ns: str, code: str) -> dict[str, object]:
    """Run Python code inside the namespace (ip netns exec also mounts its own /sys); the code
    prints one JSON object."""
    res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60, check=False,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})
    assert res.returncode == 0, res.stderr
    out: dict[str, object] = json.loads(res.stdout)
    return out


@needs_netns
def test_ioctl_reads_what_ethtool_prints(netns: str) -> None:
    got = in_netns(netns, textwrap.dedent("""\
        import json, subprocess
        from gpunet_exporter.sources.ethtool import EthtoolReader, parse_stats_text
        r = EthtoolReader()
        out = {}
        for ifname in ("va", "vc"):
            a = r.read(ifname)
            b = r.read(ifname)
            text = subprocess.run(["ethtool", "-S", ifname], capture_output=True, text=True,
                                  check=True).stdout
            t = parse_stats_text(text)
            peer = int(open(f"/sys/class/net/{ifname}/iflink").read())
            out[ifname] = {"names": list(a.names), "values": list(a.values),
                           "ethtool_names": list(t.names), "ethtool_values": list(t.values),
                           "same_tuple": a.names is b.names, "peer": peer}
        for bad in ("lo", "nosuch0", "x" * 20):
            try:
                out[bad] = "empty" if not r.read(bad).names else "read"
            except OSError as exc:
                out[bad] = exc.errno
        print(json.dumps(out))
        """))
    for ifname, queues in (("va", 4), ("vc", 64)):
        d = got[ifname]
        assert isinstance(d, dict)
        assert d["names"] == d["ethtool_names"] and d["values"] == d["ethtool_values"]
        assert len(d["names"]) > 9 * queues  # veth: per-queue statistics
        names = dict(zip(d["names"], d["values"], strict=True))
        assert names["peer_ifindex"] == d["peer"]  # decoded, not just copied
        assert d["same_tuple"]  # unchanged names: the same tuple, so plans stay cached
    assert got["lo"] in ("empty", errno.EOPNOTSUPP)  # no statistics; kernels differ in how
    assert got["nosuch0"] == errno.ENODEV and got["x" * 20] == errno.ENODEV


@needs_netns
def test_interface_that_disappears_between_listing_and_reading(netns: str) -> None:
    got = in_netns(netns, textwrap.dedent("""\
        import errno, json, subprocess
        from gpunet_exporter.collector import Scrape
        from gpunet_exporter.collectors.pfc import PfcCollector
        from gpunet_exporter.sources.ethtool import EthtoolReader
        from support.metrics import make_collector

        class Vanishing:
            # The real reader; vc is deleted after the collector listed it, before its read.
            def __init__(self):
                self.real, self.results = EthtoolReader(), {}
            def read(self, ifname):
                if ifname == "vc":
                    subprocess.run(["ip", "link", "del", "vc"], check=True)
                try:
                    stats = self.real.read(ifname)
                except OSError as exc:
                    self.results[ifname] = exc.errno
                    raise
                self.results[ifname] = len(stats.names)
                return stats
            def forget(self, keep):
                self.real.forget(keep)
            def close(self):
                self.real.close()

        c = make_collector(PfcCollector, "/sys", {"interfaces": ["va", "vc"],
                                                 "config": {"sources": ["sysfs"]}})
        c.reader = Vanishing()
        families = list(c.collect(Scrape()))
        again = list(c.collect(Scrape()))  # vc no longer listed
        print(json.dumps({"results": c.reader.results, "unreadable": c.ctx.unreadable,
                          "interfaces": c.interfaces()}))
        c.close()
        """))
    assert got["results"] == {"va": 37, "vc": errno.ENODEV}
    assert got["unreadable"] == 0  # a vanished interface is not an unreadable value
    assert got["interfaces"] == ["va"]


def test_phy_error_counters_of_the_alert(dgx: Path) -> None:
    """The three counters GpunetInterfacePhyErrors reads, from the mlx5 PHY names (docs/formats.md
    §3), with their values; corrected bits and lane errors stay out of those families."""
    text = ("NIC statistics:\n     rx_crc_errors_phy: 7\n     rx_symbol_err_phy: 5\n"
            "     rx_pcs_symbol_err_phy: 3\n     rx_corrected_bits_phy: 1204\n"
            "     rx_err_lane_0_phy: 301\n")
    s, unreadable = scrape(dgx, TextReader({ROCE: text}))
    assert unreadable == 0
    assert value(s, "gpunet_pfc_crc_errors_total", interface=ROCE) == 7
    assert value(s, "gpunet_pfc_symbol_errors_total", interface=ROCE) == 5
    assert value(s, "gpunet_pfc_fec_uncorrected_symbol_errors_total", interface=ROCE) == 3
    assert value(s, "gpunet_pfc_fec_corrected_bit_errors_total", interface=ROCE) == 1204
    assert len(series(s, "gpunet_pfc_symbol_errors_total")) == 1
