"""Parsers of sysfs and tool output, against the formats in docs/formats.md."""

from __future__ import annotations

import pytest

from gpunet_exporter.sources.ibv_devinfo import parse_ibv_devinfo
from gpunet_exporter.sources.rdma import parse_rate, parse_state, roce_active_mtu

# (speed name, per-lane Gb/s) from docs/formats.md §1.3; widths 1X 2X 4X 8X 12X.
SPEEDS = [("SDR", 2.5), ("DDR", 5), ("QDR", 10), ("FDR10", 10), ("FDR", 14), ("EDR", 25),
          ("HDR", 50), ("NDR", 100), ("XDR", 200)]


def kernel_rate_string(lane_gbps: float, width: int, name: str) -> str:
    """Format a rate the way rate_show() does: "%d%s Gb/sec (%dX%s)" from deci-Gb/s."""
    deci = round(lane_gbps * 10) * width
    return f"{deci // 10}{'.5' if deci % 10 else ''} Gb/sec ({width}X {name})"


@pytest.mark.parametrize("name,lane", SPEEDS)
@pytest.mark.parametrize("width", [1, 2, 4, 8, 12])
def test_rate_every_speed_and_width(name: str, lane: float, width: int) -> None:
    text = kernel_rate_string(lane, width, name)
    rate = parse_rate(text)
    assert rate is not None, text
    assert rate.lanes == width
    assert rate.speed == name
    assert rate.bytes_per_second == pytest.approx(lane * width * 125_000_000)
    assert rate.lane_bytes_per_second == pytest.approx(lane * 125_000_000)


def test_rate_examples_from_formats() -> None:
    assert parse_rate("2.5 Gb/sec (1X SDR)").bytes_per_second == 312_500_000  # type: ignore[union-attr]
    assert parse_rate("400 Gb/sec (4X NDR)").bytes_per_second == 50_000_000_000  # type: ignore[union-attr]
    old = parse_rate("10 Gb/sec (4X)")  # old kernels print SDR without a speed name
    assert old is not None and old.speed == "SDR" and old.lanes == 4
    assert old.lane_bytes_per_second == 312_500_000


@pytest.mark.parametrize("text", ["", "fast", "400 Gb/sec", "400 Gb/sec (0X NDR)",
                                  "400 Gb/s (4X NDR)", "-1 Gb/sec (4X NDR)", "4e2 Gb/sec (4X)"])
def test_rate_garbage(text: str) -> None:
    assert parse_rate(text) is None


@pytest.mark.parametrize("text,expected", [
    ("4: ACTIVE", 4), ("1: DOWN", 1), ("5: LinkUp", 5), ("7: Phy Test", 7),
    ("4: ACTIVE", 4), ("0: <unknown>", 0), ("4:ACTIVE", 4),
    ("ACTIVE", None), ("", None), ("x: y", None), ("N/A (no PMA)", None)])
def test_state(text: str, expected: int | None) -> None:
    assert parse_state(text) == expected


@pytest.mark.parametrize("mtu,active", [(9000, 4096), (4200, 4096), (4192, 4096), (4191, 2048),
                                        (1500, 1024), (1120, 1024), (1119, 512), (300, None)])
def test_roce_active_mtu(mtu: int, active: int | None) -> None:
    # docs/formats.md §1.6: RoCE active_mtu 4096 needs netdev MTU >= 4192
    # (9000 -> 4096, 1500 -> 1024).
    assert roce_active_mtu(mtu) == active


IBV_DEVINFO = (
    "hca_id:\tmlx5_0\n"
    "\ttransport:\t\t\tInfiniBand (0)\n"
    "\tfw_ver:\t\t\t\t28.39.2048\n"
    "\tnode_guid:\t\t\tb83f:d203:00a1:2b3c\n"
    "\tvendor_part_id:\t\t\t4129\n"
    "\tphys_port_cnt:\t\t\t1\n"
    "\t\tport:\t1\n"
    "\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n"
    "\t\t\tmax_mtu:\t\t4096 (5)\n"
    "\t\t\tactive_mtu:\t\t4096 (5)\n"
    "\t\t\tsm_lid:\t\t\t1\n"
    "\t\t\tlink_layer:\t\tInfiniBand\n"
    "\n"
    "hca_id:\tmlx4_0\n"
    "\tphys_port_cnt:\t\t\t2\n"
    "\t\tport:\t1\n"
    "\t\t\tactive_mtu:\t\t2048 (4)\n"
    "\t\tport:\t2\n"
    "\t\t\tstate:\t\t\tPORT_DOWN (1)\n"
    "\t\t\tactive_mtu:\t\t1024 (3)\n"
    "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0ac0:ebff:fe21:03da, RoCE v1\n"
)


def test_ibv_devinfo() -> None:
    assert parse_ibv_devinfo(IBV_DEVINFO) == {
        ("mlx5_0", "1"): 4096, ("mlx4_0", "1"): 2048, ("mlx4_0", "2"): 1024}


@pytest.mark.parametrize("text", ["", "garbage", "active_mtu: 4096 (5)", "hca_id:\n port: 1\n"
                                  " active_mtu: lots\n", "\x00\xff" * 10])
def test_ibv_devinfo_garbage(text: str) -> None:
    assert parse_ibv_devinfo(text) == {}
