"""What the nic collector reads, built byte for byte (RECONSTRUCTED: no real capture): module
EEPROM pages of an OSFP 400G SR4 module (CMIS 5.0), a QSFP56 200G SR4 module (SFF-8636) and a
QSFP56 passive copper cable, each healthy or with a fault planted (one lane's receive power
low, the module hot); mlx5's devlink health reporters as ``devlink -j health show`` prints
them; and stand-in ``ethtool`` and ``devlink`` programs that replay both from a folder.

Byte layouts: docs/formats.md §12 (SFF-8636 rev 2.10a, OIF CMIS 5.0; SFF-8024 codes) and §13
(iproute2 devlink/devlink.c). Vendor names, part and serial numbers and values are invented.
"""

from __future__ import annotations

import json
import stat
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

Pages = dict[str, bytes]  # "lower" (bytes 0-127), "page00", "page01", ... (bytes 128-255)

# The modules' own thresholds (high alarm, low alarm, high warning, low warning), as an SR4
# module of either memory map advertises them: temperature in degrees Celsius, power in mW.
TEMPERATURE_LEVELS = (80.0, -5.0, 75.0, 0.0)
RX_LEVELS = (3.1623, 0.0912, 2.5119, 0.1445)  # +5, -10.4, +4, -8.4 dBm
TX_LEVELS = (3.1623, 0.1, 2.5119, 0.1585)  # +5, -10, +4, -8 dBm
HEALTHY_RX_MW = (0.71, 0.69, 0.74, 0.66)
HEALTHY_TX_MW = (0.89, 0.91, 0.87, 0.9)
LOW_RX_MW = 0.0302  # -15.2 dBm: a dirty or damaged fibre, below the low alarm too
HOT_C = 78.5  # above the high warning (75), below the high alarm (80)


def _ascii(text: str, size: int) -> bytes:
    return text.encode("ascii").ljust(size, b" ")[:size]


def _put(buf: bytearray, offset: int, data: bytes) -> None:
    """Write ``data`` at the EEPROM byte address ``offset`` of a 128-byte page (0-127 lower,
    128-255 upper)."""
    at = offset - 128 if offset >= 128 else offset
    buf[at:at + len(data)] = data


def _u16(v: float) -> bytes:
    return struct.pack(">H", max(0, min(0xFFFF, round(v))))


def _s16(v: float) -> bytes:
    return struct.pack(">h", round(v))


def _mw(v: float) -> bytes:
    return _u16(v * 10_000)  # 0.1 uW units


def _temp(v: float) -> bytes:
    return _s16(v * 256)


def _levels(values: Sequence[float], conv: Callable[[float], bytes]) -> bytes:
    return b"".join(conv(v) for v in values)


def cmis_osfp(temperature: float = 41.2, rx_mw: Sequence[float] = HEALTHY_RX_MW,
              tx_mw: Sequence[float] = HEALTHY_TX_MW) -> Pages:
    """An OSFP 400GBASE-SR4 module (CMIS 5.0, paged memory): 4 media lanes in use, Application
    1 active on host lanes 1-4."""
    lower, p0, p1, p2, p11 = (bytearray(128) for _ in range(5))
    lower[0] = 0x19  # SFF-8024 Identifier: OSFP
    lower[1] = 0x50  # CMIS revision 5.0
    lower[2] = 0x00  # MemoryModel 0: paged; SteppedConfigOnly 0; MciMaxSpeed 0
    lower[3] = 0x06  # ModuleState 011b: ModuleReady (bits 3-1)
    _put(lower, 14, _temp(temperature))  # TempMonValue
    _put(lower, 16, _u16(3.3 / 100e-6))  # VccMonValue, 100 uV units
    lower[85] = 0x01  # MediaType: multimode fibre
    # Application 1: 400GAUI-4-S C2M (host 0x50) / 400GBASE-SR4 (MMF media 0x1D), 4 host lanes
    # and 4 media lanes, on host lane 1.
    lower[86:90] = bytes([0x50, 0x1D, 0x44, 0x01])
    lower[90] = 0xFF  # Application 2: end of the list
    p0[0] = 0x19
    _put(p0, 129, _ascii("GPUNET OPTICS", 16))  # VendorName
    _put(p0, 145, b"\x00\x02\xc9")  # VendorOUI
    _put(p0, 148, _ascii("GN-OSFP-400G-SR4", 16))  # VendorPN
    _put(p0, 164, _ascii("A1", 2))
    _put(p0, 166, _ascii("GN24110001", 16))  # VendorSN
    _put(p0, 182, _ascii("241105  ", 8))
    p0[200 - 128] = 0xC0 | 0x00  # power class 7
    p0[212 - 128] = 0x00  # media interface technology: 850 nm VCSEL
    # Page 01h: bank 0 only (byte 142), monitors (159: temperature, Vcc; 160: tx bias, tx power,
    # rx power).
    p1[142 - 128] = 0x00
    p1[159 - 128] = 0x03
    p1[160 - 128] = 0x07
    _put(p2, 128, _levels(TEMPERATURE_LEVELS, _temp))
    _put(p2, 136, _levels((3.465, 3.135, 3.45, 3.15), lambda v: _u16(v / 100e-6)))
    _put(p2, 176, _levels(TX_LEVELS, _mw))
    _put(p2, 184, _levels((13.0, 2.0, 12.0, 3.0), lambda v: _u16(v * 500)))  # mA, 2 uA units
    _put(p2, 192, _levels(RX_LEVELS, _mw))
    for i in range(8):
        in_use = i < len(rx_mw)
        _put(p11, 154 + 2 * i, _mw(tx_mw[i] if in_use and i < len(tx_mw) else 0))
        _put(p11, 170 + 2 * i, _u16(7.5 * 500 if in_use else 0))
        _put(p11, 186 + 2 * i, _mw(rx_mw[i] if in_use else 0))
    p11[128 - 128:132 - 128] = bytes([0x44, 0x44, 0x11, 0x11])  # DPState: lanes 1-4 activated
    # Active Control Set, DPConfigLane 1-8: AppSel 1, DataPathID 0 on host lanes 1-4.
    p11[206 - 128:214 - 128] = bytes([0x10] * 4 + [0x00] * 4)
    return {"lower": bytes(lower), "page00": bytes(p0), "page01": bytes(p1),
            "page02": bytes(p2), "page11": bytes(p11)}


def sff8636_qsfp56(temperature: float = 38.7, rx_mw: Sequence[float] = HEALTHY_RX_MW,
                   tx_mw: Sequence[float] = HEALTHY_TX_MW) -> Pages:
    """A QSFP56 200GBASE-SR4 module (SFF-8636 rev 2.10a, paged: page 03h present)."""
    lower, p0, p3 = bytearray(128), bytearray(128), bytearray(128)
    lower[0] = 0x11  # QSFP28 or later
    lower[1] = 0x08  # SFF-8636 revision 2.10a (SFF-8636 Table 6-3)
    lower[2] = 0x00  # Flat_mem 0: paged (page 03h present); Data_Not_Ready 0
    _put(lower, 22, _temp(temperature))
    _put(lower, 26, _u16(3.3 / 100e-6))
    for i in range(4):
        _put(lower, 34 + 2 * i, _mw(rx_mw[i]))
        _put(lower, 42 + 2 * i, _u16(7.2 * 500))
        _put(lower, 50 + 2 * i, _mw(tx_mw[i]))
    p0[0] = 0x11
    p0[147 - 128] = 0x00  # transmitter technology: 850 nm VCSEL
    _put(p0, 148, _ascii("GPUNET OPTICS", 16))
    _put(p0, 165, b"\x00\x02\xc9")
    _put(p0, 168, _ascii("GN-QSFP56-200GSR", 16))
    _put(p0, 196, _ascii("GN24090007", 16))
    p0[220 - 128] = 0x3C  # temperature, Vcc monitored; rx average power; tx power monitored
    _put(p3, 128, _levels(TEMPERATURE_LEVELS, _temp))
    _put(p3, 144, _levels((3.465, 3.135, 3.45, 3.15), lambda v: _u16(v / 100e-6)))
    _put(p3, 176, _levels(RX_LEVELS, _mw))
    _put(p3, 184, _levels((13.0, 2.0, 12.0, 3.0), lambda v: _u16(v * 500)))
    _put(p3, 192, _levels(TX_LEVELS, _mw))
    return {"lower": bytes(lower), "page00": bytes(p0), "page03": bytes(p3)}


def sff8636_dac() -> Pages:
    """A QSFP56 passive copper cable (SFF-8636, flat memory: upper page 00h only)."""
    lower, p0 = bytearray(128), bytearray(128)
    lower[0] = 0x11
    lower[1] = 0x08
    lower[2] = 0x04  # Flat_mem 1: upper page 00h only
    p0[0] = 0x11
    p0[147 - 128] = 0xA0  # copper cable, unequalized
    _put(p0, 148, _ascii("GPUNET CABLES", 16))
    _put(p0, 168, _ascii("GN-DAC-200G-1M", 16))
    _put(p0, 146, bytes([1]))  # length of copper: 1 m
    return {"lower": bytes(lower), "page00": bytes(p0)}


# ---- devlink -j health show ------------------------------------------------------------------

def reporters(pci: Iterable[str], errors: Mapping[tuple[str, str], int] | None = None
              ) -> dict[str, object]:
    """``devlink -j health show`` of mlx5 physical functions at ``pci``: fw, fw_fatal and vnic
    per device, tx and rx on the uplink port (65535); ``errors`` maps (PCI address, reporter)
    to an error count left unrecovered (state error)."""
    errors = errors or {}
    health: dict[str, list[dict[str, object]]] = {}

    def entry(address: str, name: str, extra: dict[str, object]) -> dict[str, object]:
        err = errors.get((address, name), 0)
        out: dict[str, object] = {"reporter": name, "state": "error" if err else "healthy",
                                  "error": err, "recover": 0}
        if err:
            out.update(last_dump_date="2026-11-27", last_dump_time="09:41:07")
        out.update(extra)
        return out

    for address in pci:
        health[f"pci/{address}"] = [
            entry(address, "fw", {"auto_dump": True}),
            entry(address, "fw_fatal", {"grace_period": 1200000, "auto_recover": True,
                                        "auto_dump": True}),
            entry(address, "vnic", {})]
        health[f"pci/{address}/65535"] = [
            entry(address, name, {"grace_period": 500, "auto_recover": True,
                                  "auto_dump": True}) for name in ("tx", "rx")]
    return {"health": health}


# ---- stand-in programs -------------------------------------------------------------------------

ETHTOOL = """\
#!/bin/sh
# Stands in for `ethtool -m IF raw on offset O length L page P bank B i2c A` (ethtool 5.13 and
# later): writes the bytes of the module EEPROM page recorded beside this script, IF/lower.bin
# (offsets 0-127) or IF/pageNN.bin (the upper page NN, offsets 128-255), generated by
# tests/support/nic.py. An interface without a folder has a driver that cannot read modules.
dir=$(dirname "$0")/$2
if [ "$1" != -m ] || [ "$3" != raw ] || [ "$5" != offset ] || [ "$9" != page ]; then
  echo "ethtool replay: not a raw page read: $*" >&2
  exit 1
fi
if [ ! -d "$dir" ]; then
  echo "netlink error: Operation not supported" >&2
  exit 1
fi
if [ "$6" -lt 128 ]; then file=$dir/lower.bin; else file=$dir/page$(printf %02x "${10}").bin; fi
if [ ! -f "$file" ]; then
  echo "netlink error: Invalid argument" >&2
  exit 1
fi
exec dd if="$file" bs=1 skip=$(( $6 % 128 )) count="$8" status=none
"""

DEVLINK = """\
#!/bin/sh
# Stands in for `devlink -j health show`: prints health.json beside this script, generated by
# tests/support/nic.py.
if [ "$1" = -j ] && [ "$2" = health ] && [ "$3" = show ]; then
  exec cat "$(dirname "$0")/health.json"
fi
echo "devlink replay: not recorded: $*" >&2
exit 1
"""


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC | stat.S_IXGRP | stat.S_IXOTH)


def write_replay(folder: Path, modules: Mapping[str, Pages], health: Mapping[str, object]
                 ) -> tuple[Path, Path]:
    """``folder``/ethtool and ``folder``/devlink replaying ``modules`` (interface -> pages) and
    ``health``; returns the two programs."""
    folder.mkdir(parents=True, exist_ok=True)
    for ifname, pages in modules.items():
        (folder / ifname).mkdir(exist_ok=True)
        for name, data in pages.items():
            (folder / ifname / f"{name}.bin").write_bytes(data)
    (folder / "health.json").write_text(json.dumps(health, indent=2) + "\n")
    _script(folder / "ethtool", ETHTOOL)
    _script(folder / "devlink", DEVLINK)
    return folder / "ethtool", folder / "devlink"
