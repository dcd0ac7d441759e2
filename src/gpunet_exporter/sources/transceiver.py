"""Pluggable module (transceiver, cable) health from its EEPROM: identifier, vendor, part number,
temperature, per-lane receive and transmit power, and the module's own alarm and warning
thresholds, decoded from SFF-8636 (QSFP, QSFP+, QSFP28/56) and CMIS (QSFP-DD, OSFP, QSFP112).

Pages are read in-process through ethtool netlink (ETHTOOL_MSG_MODULE_EEPROM_GET, pyroute2),
or by running ``ethtool -m IF raw on ...`` (captures replayed by a stand-in). Byte layouts and
sources: docs/formats.md §12; design notes: docs/architecture.md, "sources".
"""

from __future__ import annotations

import errno
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpunet_exporter.sources.commands import (
    CommandError,
    CommandNotStarted,
    CommandTimeout,
    run_command_bytes,
)

I2C_ADDRESS = 0x50  # the module's memory map (SFF-8636, CMIS; SFF-8472's A0h)
PAGE_LEN = 128
LEVELS = ("high_alarm", "low_alarm", "high_warning", "low_warning")  # the EEPROM's order

# SFF-8024 rev 4.11 Table 4-1, Identifier values.
IDENTIFIERS: Mapping[int, str] = {
    0x03: "SFP", 0x0C: "QSFP", 0x0D: "QSFP+", 0x11: "QSFP28", 0x18: "QSFP-DD", 0x19: "OSFP",
    0x1B: "DSFP", 0x1E: "QSFP+ CMIS",
}
SFF8636 = frozenset({0x0C, 0x0D, 0x11})
CMIS = frozenset({0x18, 0x19, 0x1B, 0x1E})


class EepromReader(Protocol):
    """Where module EEPROM pages come from: ethtool netlink, ``ethtool -m``, a test's stand-in.

    ``read`` returns ``length`` bytes at ``offset`` (0-127: the lower page; 128-255: the upper
    page ``page`` of ``bank``). Raises OSError: ENODEV (no such interface here), EOPNOTSUPP (the
    driver cannot read modules), ENOENT (no ethtool program), EIO or another errno (no module,
    a read that failed)."""

    def read(self, ifname: str, page: int, bank: int, offset: int, length: int,
             i2c_address: int = I2C_ADDRESS) -> bytes: ...

    def close(self) -> None: ...


class NetlinkEepromReader:
    """ETHTOOL_MSG_MODULE_EEPROM_GET through pyroute2 (the kernel falls back to a driver's
    legacy get_module_info/get_module_eeprom ops), one socket kept open between calls."""

    def __init__(self) -> None:
        self._sock: Any = None

    def read(self, ifname: str, page: int, bank: int, offset: int, length: int,
             i2c_address: int = I2C_ADDRESS) -> bytes:
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.generic.ethtool import NlEthtool, ethtool_module_eeprom_msg

        msg = ethtool_module_eeprom_msg()
        msg["attrs"] = [("ETHTOOL_A_MODULE_EEPROM_OFFSET", offset),
                        ("ETHTOOL_A_MODULE_EEPROM_LENGTH", length),
                        ("ETHTOOL_A_MODULE_EEPROM_PAGE", page),
                        ("ETHTOOL_A_MODULE_EEPROM_BANK", bank),
                        ("ETHTOOL_A_MODULE_EEPROM_I2C_ADDRESS", i2c_address)]
        try:
            if self._sock is None:
                self._sock = NlEthtool()
            replies = self._sock.get_module_eeprom(msg, ifname=ifname)
        except NetlinkError as exc:
            raise OSError(exc.code, f"{ifname}: {exc}") from None
        except OSError:
            self.close()  # a broken socket: the next call opens another
            raise
        for reply in replies:
            data = reply.get_attr("ETHTOOL_A_MODULE_EEPROM_DATA")
            if data is not None:
                return bytes(data)
        raise OSError(errno.EIO, f"{ifname}: no EEPROM data in the kernel's answer")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class CommandEepromReader:
    """``ethtool -m IF raw on offset O length L page P bank B i2c A`` (ethtool 5.13 and later:
    with a page, bank or I2C address given it reads through netlink and writes the bytes)."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path, self.timeout = path, timeout

    def read(self, ifname: str, page: int, bank: int, offset: int, length: int,
             i2c_address: int = I2C_ADDRESS) -> bytes:
        argv = [self.path, "-m", ifname, "raw", "on", "offset", str(offset), "length",
                str(length), "page", str(page), "bank", str(bank), "i2c", str(i2c_address)]
        try:
            out = run_command_bytes(argv, self.timeout)
        except CommandTimeout as exc:
            raise OSError(errno.ETIMEDOUT, str(exc)) from None
        except CommandNotStarted as exc:  # no ethtool program
            raise OSError(errno.ENOENT, str(exc)) from None
        except CommandError as exc:
            text = str(exc)
            code = (errno.EOPNOTSUPP if "not supported" in text
                    else errno.ENODEV if "No such device" in text else errno.EIO)
            raise OSError(code, text) from None
        if len(out) != length:
            raise OSError(errno.EIO, f"{self.path} -m {ifname} wrote {len(out)} bytes, not "
                          f"{length}")
        return out

    def close(self) -> None:
        pass


# ---- the decoded module ------------------------------------------------------------------------

@dataclass(frozen=True)
class Module:
    """What one module's EEPROM says. Power in watts, temperature in degrees Celsius; a monitor
    the module does not implement (a passive copper cable has none) is None or empty;
    ``thresholds`` maps "temperature", "rx_power", "tx_power" to {level: value}, from the
    module's own threshold page, empty when it has none."""

    identifier: int
    spec: str  # "sff8636", "cmis", "sff8472" or "unknown"
    vendor: str = ""
    part_number: str = ""
    passive_copper: bool = False
    temperature: float | None = None
    rx_power: tuple[float, ...] = ()  # per lane, lane 1 first
    tx_power: tuple[float, ...] = ()
    thresholds: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def identifier_name(self) -> str:
        return IDENTIFIERS.get(self.identifier, f"0x{self.identifier:02x}")


Pages = Mapping[tuple[int, int], bytes]  # (page, bank) -> its 128 upper bytes; (-1, 0) lower


def _text(raw: bytes) -> str:
    """An ASCII field of the EEPROM, space padded (SFF-8636 §6.3, CMIS §8.3)."""
    return "".join(c if 32 <= ord(c) < 127 else "?" for c in raw.decode("latin-1")).strip()


def _u16(page: bytes, offset: int, fmt: str = ">H") -> int:
    """The big-endian word at the EEPROM ``offset`` (an upper page's 128-255 as its 0-127)."""
    return int(struct.unpack_from(fmt, page, offset % PAGE_LEN)[0])


def _s16(page: bytes, offset: int) -> int:
    return _u16(page, offset, ">h")


def _power(raw: int) -> float:
    return raw / 1e7  # 0.1 uW per unit (SFF-8636 §6.2.4, CMIS §8.9.4)


def _temperature(raw: int) -> float:
    return raw / 256  # signed, 1/256 degree Celsius per unit


def _levels(page: bytes, offset: int, convert: Callable[[int], float], signed: bool = False
            ) -> dict[str, float]:
    read = _s16 if signed else _u16
    return {level: convert(read(page, offset + 2 * i)) for i, level in enumerate(LEVELS)}


def pages_to_read(lower: bytes) -> list[tuple[int, int]]:
    """The upper pages (page, bank) worth reading after the lower page and upper page 00h: those
    the module says exist (a flat memory has none) and that hold monitors or thresholds."""
    ident = lower[0]
    if ident in SFF8636:
        # Byte 2 bit 2, Flat_mem: 1 = upper page 00h only (SFF-8636 rev 2.10a, Table 6-2).
        return [] if lower[2] & 0x04 else [(3, 0)]
    if ident in CMIS:
        # Byte 2 bit 7, MemoryModel: 1 = flat (CMIS 5.2, Table 8-4). Page 01h says which
        # monitors exist, 02h holds the thresholds, 11h bank 0 the lane monitors of lanes 1-8.
        return [] if lower[2] & 0x80 else [(1, 0), (2, 0), (0x11, 0)]
    return []


def decode(lower: bytes, pages: Pages) -> Module:
    """The module in ``lower`` (bytes 0-127) and ``pages`` ((page, bank) -> upper bytes
    128-255; upper page 00h at (0, 0)). Raises ValueError when the bytes are too few for what
    the identifier says."""
    if len(lower) < PAGE_LEN:
        raise ValueError(f"lower page of {len(lower)} bytes, not {PAGE_LEN}")
    for key, page in pages.items():
        if len(page) < PAGE_LEN:
            raise ValueError(f"page {key[0]:02x}h of {len(page)} bytes, not {PAGE_LEN}")
    ident = lower[0]
    page0 = pages.get((0, 0), b"")
    if ident in SFF8636 and page0:
        return _sff8636(lower, page0, pages.get((3, 0)))
    if ident in CMIS and page0:
        return _cmis(lower, page0, pages)
    if ident == 0x03:  # SFP: SFF-8472's A0h is the lower page plus page 00h at 0x50
        return Module(ident, "sff8472", vendor=_text(lower[20:36]),
                      part_number=_text(lower[40:56]))
    return Module(ident, "unknown")


def _sff8636(lower: bytes, page0: bytes, page3: bytes | None) -> Module:
    vendor, part = _text(page0[148 - 128:164 - 128]), _text(page0[168 - 128:184 - 128])
    # Byte 147 bits 7-4, transmitter technology: 1010b and above are copper cables, passive
    # (1010b, 1011b) or with equalizers; none of them has optical monitors (Table 6-19).
    copper = page0[147 - 128] >> 4 >= 0xA
    if copper:
        return Module(lower[0], "sff8636", vendor, part, passive_copper=page0[147 - 128] >> 4
                      in (0xA, 0xB))
    diag = page0[220 - 128]  # Diagnostic Monitoring Type (Table 6-24)
    rx = tuple(_power(_u16(lower, 34 + 2 * i)) for i in range(4))
    tx = tuple(_power(_u16(lower, 50 + 2 * i)) for i in range(4)) if diag & 0x04 else ()
    thresholds: dict[str, dict[str, float]] = {}
    if page3 is not None:  # Table 6-26, module and channel thresholds on page 03h
        thresholds["temperature"] = _levels(page3, 128, _temperature, signed=True)
        thresholds["rx_power"] = _levels(page3, 176, _power)
        if tx:
            thresholds["tx_power"] = _levels(page3, 192, _power)
    return Module(lower[0], "sff8636", vendor, part, temperature=_temperature(_s16(lower, 22)),
                  rx_power=rx, tx_power=tx, thresholds=thresholds)


def media_lanes(lower: bytes, page11: bytes | None) -> int:
    """How many media lanes carry the module's active data paths (CMIS): the media lane count
    of the application each data path runs (Active Control Set, page 11h bytes 206-213: AppSel
    in bits 7-4, DataPathID in 3-1; application descriptors on the lower page, bytes 86-117,
    the media lane count in bits 3-0 of each descriptor's third byte). Without an active data
    path, the first application's count; 8 when nothing says."""
    def lanes_of(appsel: int) -> int:
        return lower[86 + 4 * (appsel - 1) + 2] & 0x0F if 1 <= appsel <= 8 else 0

    if page11 is not None:
        paths = {(b >> 4, (b >> 1) & 0x7) for b in page11[206 - 128:214 - 128] if b >> 4}
        total = sum(lanes_of(appsel) for appsel, _ in paths)
        if total:
            return min(total, 8)
    return min(lanes_of(1), 8) or 8  # a 4-bit field: a module may claim up to 15


def _cmis(lower: bytes, page0: bytes, pages: Pages) -> Module:
    vendor, part = _text(page0[129 - 128:145 - 128]), _text(page0[148 - 128:164 - 128])
    # Byte 85, MediaType (Table 8-18 of CMIS 5.2): 03h passive copper; byte 212, media
    # interface technology (SFF-8024 Table 4-10): 0Ah and 0Bh passive copper cables. Active
    # cables (MediaType 04h) say on page 01h which monitors they have, like optics.
    passive = lower[85] == 0x03 or page0[212 - 128] in (0x0A, 0x0B)
    page1, page2, page11 = pages.get((1, 0)), pages.get((2, 0)), pages.get((0x11, 0))
    if passive or page1 is None:  # passive copper, or flat memory: no advertised monitors
        return Module(lower[0], "cmis", vendor, part, passive_copper=passive)
    module_mon, lane_mon = page1[159 - 128], page1[160 - 128]  # Table 8-44
    temperature = _temperature(_s16(lower, 14)) if module_mon & 0x01 else None
    rx: tuple[float, ...] = ()
    tx: tuple[float, ...] = ()
    if page11 is not None:
        lanes = media_lanes(lower, page11)
        if lane_mon & 0x04:
            rx = tuple(_power(_u16(page11, 186 + 2 * i)) for i in range(lanes))
        if lane_mon & 0x02:
            tx = tuple(_power(_u16(page11, 154 + 2 * i)) for i in range(lanes))
    thresholds: dict[str, dict[str, float]] = {}
    if page2 is not None:  # Table 8-62, module and lane thresholds on page 02h
        if temperature is not None:
            thresholds["temperature"] = _levels(page2, 128, _temperature, signed=True)
        if rx:
            thresholds["rx_power"] = _levels(page2, 192, _power)
        if tx:
            thresholds["tx_power"] = _levels(page2, 176, _power)
    return Module(lower[0], "cmis", vendor, part, temperature=temperature, rx_power=rx,
                  tx_power=tx, thresholds=thresholds)


def read_module(reader: EepromReader, ifname: str) -> Module:
    """Read and decode the module of ``ifname``: the lower page, upper page 00h, then the pages
    the module says it has. Raises OSError as the reader does, ValueError on bytes that do not
    decode."""
    lower = reader.read(ifname, 0, 0, 0, PAGE_LEN)
    pages: dict[tuple[int, int], bytes] = {}
    # SFF-8472 (SFP) needs no more: its vendor fields are in the lower 128 bytes at 0x50.
    if lower and (lower[0] in SFF8636 or lower[0] in CMIS):
        pages[(0, 0)] = reader.read(ifname, 0, 0, PAGE_LEN, PAGE_LEN)
        for page, bank in pages_to_read(lower):
            pages[(page, bank)] = reader.read(ifname, page, bank, PAGE_LEN, PAGE_LEN)
    return decode(lower, pages)
