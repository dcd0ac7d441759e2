"""link collector: RDMA netdevs' speed, MTU, carrier, flaps; RDMA MTU; ibv_devinfo handling."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.registry import Scraper

from support import sysfs_tree as st
from support.metrics import (
    Samples,
    collect,
    make_collector,
    samples_of,
    scrape_and_page,
    series,
    value,
)
from support.sysfs_tree import DGX_IBV_DEVINFO as DEVINFO
from support.wait import wait_for

LAST_SUCCESS = "gpunet_link_ibv_devinfo_last_success_timestamp_seconds"

RDMA_NETDEVS = {"ibp24s0", "ibp64s0", "ibp79s0", "ibp94s0", "ibp154s0", "ibp192s0", "ibp206s0",
                "ibp220s0", "enp41s0f0np0", "enp170s0f0np0"}


@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path / "tree")


def run(sysfs: Path, config: dict[str, object] | None = None) -> tuple[Samples, int]:
    cfg = {"ibv_devinfo": {"enabled": False}, **(config or {})}
    return collect(LinkCollector, sysfs, cfg)


def interfaces(s: Samples) -> set[str]:
    return {dict(lbl)["interface"] for lbl in series(s, "gpunet_link_info")}


def test_dgx_rdma_netdevs(dgx: Path) -> None:
    s, unreadable = run(dgx)
    assert unreadable == 0
    assert interfaces(s) == RDMA_NETDEVS  # not eno1 or lo
    assert value(s, "gpunet_link_info", interface="ibp24s0", device="mlx5_0", port="1",
                 link_layer="InfiniBand") == 1
    for ifname in RDMA_NETDEVS:
        assert value(s, "gpunet_link_speed_bytes_per_second", interface=ifname) == 400e9 / 8
        assert value(s, "gpunet_link_operstate_id", interface=ifname) == 6
        assert value(s, "gpunet_link_carrier", interface=ifname) == 1
        changes = int((dgx / "class/net" / ifname / "carrier_changes").read_text())
        assert value(s, "gpunet_link_carrier_changes_total", interface=ifname) == changes
    assert value(s, "gpunet_link_mtu_bytes", interface="enp41s0f0np0") == 9000
    assert value(s, "gpunet_link_mtu_bytes", interface="ibp24s0") == 4092
    # RoCE active MTU derived from the netdev MTU; IB needs ibv_devinfo (disabled here).
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_8", port="1") == 4096
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_0", port="1") is None
    assert not series(s, "gpunet_link_ibv_devinfo_refresh_success")


def test_port_down_and_unknown_speed(dgx: Path) -> None:
    st.make_port_down(dgx, "mlx5_3")
    s, unreadable = run(dgx)
    assert value(s, "gpunet_link_operstate_id", interface="ibp94s0") == 2
    assert value(s, "gpunet_link_carrier", interface="ibp94s0") == 0
    assert value(s, "gpunet_link_speed_bytes_per_second", interface="ibp94s0") is None  # "-1"
    assert value(s, "gpunet_link_carrier_changes_total", interface="ibp94s0") == 3
    assert unreadable == 0


def test_extra_interfaces_and_exclude(dgx: Path) -> None:
    s, _ = run(dgx, {"interfaces": ["eno1", "lo", "nope0"], "interface_exclude": "^ibp2"})
    assert interfaces(s) == (RDMA_NETDEVS - {"ibp24s0", "ibp206s0", "ibp220s0"}) | {"eno1", "lo"}
    assert value(s, "gpunet_link_info", interface="eno1", device="", port="", link_layer="") == 1
    assert value(s, "gpunet_link_speed_bytes_per_second", interface="eno1") == 125e6
    assert value(s, "gpunet_link_speed_bytes_per_second", interface="lo") is None  # no speed file
    assert value(s, "gpunet_link_operstate_id", interface="lo") == 0  # "unknown"


def test_expected_mtu_and_mismatch(dgx: Path) -> None:
    st.make_mtu_1500(dgx, "mlx5_8")
    rules = [{"link_layer": "Ethernet", "mtu": 9000, "rdma_mtu": 4096},
             {"interface": "^eno", "mtu": 1500}]
    s, _ = run(dgx, {"expected_mtu": rules, "interfaces": ["eno1"]})
    assert value(s, "gpunet_link_mtu_bytes", interface="enp41s0f0np0") == 1500
    assert value(s, "gpunet_link_mtu_expected_bytes", interface="enp41s0f0np0") == 9000
    assert value(s, "gpunet_link_mtu_mismatch", interface="enp41s0f0np0") == 1
    assert value(s, "gpunet_link_mtu_mismatch", interface="enp170s0f0np0") == 0
    assert value(s, "gpunet_link_mtu_mismatch", interface="eno1") == 0
    assert value(s, "gpunet_link_mtu_mismatch", interface="ibp24s0") is None  # no rule
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_8", port="1") == 1024
    assert value(s, "gpunet_link_rdma_mtu_mismatch", device="mlx5_8", port="1") == 1
    assert value(s, "gpunet_link_rdma_mtu_mismatch", device="mlx5_9", port="1") == 0


def test_unreadable_mtu_costs_one_value(dgx: Path) -> None:
    (dgx / "class/net/ibp24s0/mtu").write_text("lots\n")
    s, unreadable = run(dgx)
    assert unreadable == 1
    assert value(s, "gpunet_link_mtu_bytes", interface="ibp24s0") is None
    assert value(s, "gpunet_link_speed_bytes_per_second", interface="ibp24s0") == 50e9


def fake_tool(tmp_path: Path, body: str) -> Path:
    """A stand-in for ibv_devinfo on PATH: a real executable that prints, fails or hangs."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    tool = bindir / "ibv_devinfo"
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    return tool


def test_ibv_devinfo_active_mtu(dgx: Path, tmp_path: Path) -> None:
    out = tmp_path / "devinfo.txt"
    out.write_text(DEVINFO)
    tool = fake_tool(tmp_path, f"cat {out}\n")
    cfg = {"ibv_devinfo": {"path": str(tool)},
           "expected_mtu": [{"link_layer": "InfiniBand", "rdma_mtu": 4096}]}
    c = make_collector(LinkCollector, dgx, cfg)
    try:
        s = samples_of(list(c.collect(Scrape())))
    finally:
        c.close()
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_0", port="1") == 4096
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_6", port="1") == 2048
    assert value(s, "gpunet_link_rdma_mtu_mismatch", device="mlx5_6", port="1") == 1
    assert sum(series(s, "gpunet_link_rdma_mtu_mismatch").values()) == 1
    assert value(s, "gpunet_link_ibv_devinfo_refresh_success") == 1
    when = value(s, LAST_SUCCESS)
    assert when is not None and abs(time.time() - when) < 60


def test_ibv_devinfo_failure_keeps_last_good_values(dgx: Path, tmp_path: Path) -> None:
    out = tmp_path / "devinfo.txt"
    out.write_text(DEVINFO)
    # Succeeds while the capture exists, then fails like a broken driver would.
    tool = fake_tool(tmp_path, f"[ -f {out} ] || {{ echo 'Failed to get IB devices list' >&2; "
                               "exit 1; }\n" f"cat {out}\n")
    c = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"path": str(tool)}})
    try:
        first = samples_of(list(c.collect(Scrape())))
        assert value(first, "gpunet_link_ibv_devinfo_refresh_success") == 1
        good = value(first, LAST_SUCCESS)
        assert good is not None
        out.unlink()
        refresher = c._ibv  # type: ignore[attr-defined]
        time.sleep(0.05)
        refresher.refresh()  # the background thread's next round, without waiting for it
        s = samples_of(list(c.collect(Scrape())))
        unknown = c.unknown()
        out.write_text(DEVINFO)
        time.sleep(0.05)
        refresher.refresh()  # the tool works again
        again = samples_of(list(c.collect(Scrape())))
    finally:
        c.close()
    assert value(s, "gpunet_link_ibv_devinfo_refresh_success") == 0
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_0", port="1") == 4096
    assert value(s, LAST_SUCCESS) == good  # the last good run's time, no longer advancing
    assert unknown == {}  # checked, on the last good values: their age says how old
    assert value(again, "gpunet_link_ibv_devinfo_refresh_success") == 1
    later = value(again, LAST_SUCCESS)
    assert later is not None and later > good


@pytest.mark.parametrize("body,reason", [("exit 3\n", "fails"), ("echo garbage\n", "garbage"),
                                         ("sleep 30\n", "hangs")])
def test_ibv_devinfo_broken_tool(dgx: Path, tmp_path: Path, body: str, reason: str) -> None:
    tool = fake_tool(tmp_path, body)
    c = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"path": str(tool),
                                                           "timeout_seconds": 0.5}})
    t0 = time.monotonic()
    try:
        s = samples_of(list(c.collect(Scrape())))
    finally:
        c.close()
    assert time.monotonic() - t0 < 20  # killed after its timeout, not waited for
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_0", port="1") is None
    assert value(s, "gpunet_link_mtu_bytes", interface="ibp24s0") == 4092  # the rest is intact
    expected = 1 if reason == "garbage" else 0  # garbage parses to "no ports": not a failure
    assert value(s, "gpunet_link_ibv_devinfo_refresh_success") == expected
    # Never succeeded: the InfiniBand MTUs are not checked, and the check says why.
    assert c.unknown() == ({} if expected else {"ib_mtu": "tool_failing"})


def test_ibv_devinfo_not_installed(dgx: Path, tmp_path: Path) -> None:
    """No ibv_devinfo where InfiniBand ports are: no active MTU, and gpunet_check_unknown and
    the landing page say that it was not checked, and why."""
    s, page = scrape_and_page(make_collector(LinkCollector, dgx,
                                             {"ibv_devinfo": {"path": str(tmp_path / "no")}}))
    assert value(s, "gpunet_scrape_collector_unreadable_values", collector="link") == 0
    assert not series(s, "gpunet_link_ibv_devinfo_refresh_success")
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_0", port="1") is None
    assert series(s, "gpunet_check_unknown") == {
        frozenset({("collector", "link"), ("check", "ib_mtu"), ("reason", "tool_missing")}): 1}
    assert "UNKNOWN: ib_mtu not checked (its command-line tool is not installed)" in page
    assert os.path.exists(dgx)


@pytest.mark.parametrize("case", ["switched off", "no InfiniBand port"])
def test_ib_mtu_not_asked_for(tmp_path: Path, case: str) -> None:
    """Switched off (the operator checks it another way), or a node with RoCE ports only:
    nothing unknown, though no ibv_devinfo is installed."""
    if case == "switched off":
        tree = st.build_dgx_h100(tmp_path / "t")
        cfg = {"ibv_devinfo": {"enabled": False, "path": str(tmp_path / "no")}}
    else:
        tree = st.build_roce_only(tmp_path / "t")
        cfg = {"ibv_devinfo": {"path": str(tmp_path / "no")}}
    c = make_collector(LinkCollector, tree, cfg)
    try:
        list(c.collect(Scrape()))
        assert c.unknown() == {}
    finally:
        c.close()


def test_first_scrape_does_not_wait_for_a_slow_ibv_devinfo(dgx: Path, tmp_path: Path) -> None:
    """ibv_devinfo that takes longer than the scrape timeout (its own timeout, 30 s, is longer
    still): the scrape answers within its deadline with everything else, and no InfiniBand
    active MTU nor any ibv_devinfo success or timestamp yet; a later scrape has them."""
    out, gate = tmp_path / "devinfo.txt", tmp_path / "gate"
    out.write_text(DEVINFO)
    # Blocks until the test opens the gate, however slow or fast this machine is.
    tool = fake_tool(tmp_path, f"while [ ! -f {gate} ]; do sleep 0.05; done\ncat {out}\n")
    c = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"path": str(tool),
                                                           "timeout_seconds": 30}})
    scraper = Scraper({"link": c}, 1.0)
    try:
        for _ in range(2):  # the first scrape waits (up to its deadline), the second does not
            t0 = time.monotonic()
            s = samples_of(list(scraper.collect()))
            assert time.monotonic() - t0 < 25  # not the tool's 30 s
            # Finished within the deadline: the registry says 0 for a collector it gave up on.
            assert value(s, "gpunet_scrape_collector_success", collector="link") == 1
            assert value(s, "gpunet_link_mtu_bytes", interface="ibp24s0") == 4092
            assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_8", port="1") == 4096
            assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_0", port="1") is None
            assert not series(s, "gpunet_link_ibv_devinfo_refresh_success")
            assert not series(s, LAST_SUCCESS)
        gate.write_text("")
        s = wait_for(lambda: (lambda s: s if value(
            s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_0", port="1") is not None
            else None)(samples_of(list(scraper.collect()))), "ibv_devinfo's values", timeout=20)
    finally:
        c.close()
    assert value(s, "gpunet_link_rdma_active_mtu_bytes", device="mlx5_6", port="1") == 2048
    assert value(s, "gpunet_link_ibv_devinfo_refresh_success") == 1
    when = value(s, LAST_SUCCESS)
    assert when is not None and abs(time.time() - when) < 60
