"""NIC statistics as ``ethtool -S`` prints them, read in-process through the SIOCETHTOOL ioctl,
plus a parser of ``ethtool -S`` text (captures, and platforms where the ioctl is refused).

Three ioctl calls per interface: the string set size, the names, the values (include/uapi/linux/
ethtool.h, ethtool's ``do_gnicstats``). Why the buffers have headroom and the names are re-read
on every call: docs/architecture.md, "sources"; text format: docs/formats.md §3.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gpunet_exporter.sources.commands import CommandError, run_command
from gpunet_exporter.sources.sysfs import parse_uint

SIOCETHTOOL = 0x8946
ETHTOOL_GDRVINFO = 0x03
ETHTOOL_GSTRINGS = 0x1B
ETHTOOL_GSTATS = 0x1D
ETHTOOL_GSSET_INFO = 0x37
ETH_SS_STATS = 1
ETH_GSTRING_LEN = 32
IFNAMSIZ = 16
# struct ifreq is 40 bytes on 64-bit Linux: the name, then a union whose pointer member is
# ifr_data.
_IFREQ = struct.Struct(f"{IFNAMSIZ}sP{40 - IFNAMSIZ - struct.calcsize('P')}x")
_DRVINFO_SIZE = 196  # struct ethtool_drvinfo
_RETRIES = 3


@dataclass(frozen=True)
class NicStats:
    """One reading: ``names[i]`` has the value ``values[i]``."""

    names: tuple[str, ...]
    values: Sequence[int]


class _Buffers:
    """Per-interface ioctl buffers and the names last read, reused from call to call."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.strings = ctypes.create_string_buffer(12 + capacity * ETH_GSTRING_LEN)
        self.stats = ctypes.create_string_buffer(8 + capacity * 8)
        self.blob = b""
        self.names: tuple[str, ...] = ()


class EthtoolReader:
    """Reads ``ethtool -S`` statistics of interfaces in this process's network namespace."""

    def __init__(self) -> None:
        self._sock: socket.socket | None = None
        self._bufs: dict[str, _Buffers] = {}

    def _fd(self) -> int:
        if self._sock is None:
            try:
                self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            except OSError:  # no IPv4 in this kernel: any socket reaches dev_ioctl
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        return self._sock.fileno()

    def _ioctl(self, ifname: bytes, buf: ctypes.Array[ctypes.c_char]) -> None:
        fcntl.ioctl(self._fd(), SIOCETHTOOL, _IFREQ.pack(ifname, ctypes.addressof(buf)))

    def _count(self, ifname: bytes) -> int:
        info = ctypes.create_string_buffer(16 + 4)
        struct.pack_into("IIQ", info, 0, ETHTOOL_GSSET_INFO, 0, 1 << ETH_SS_STATS)
        try:
            self._ioctl(ifname, info)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
            # Kernels before 2.6.34: the count is n_stats of ETHTOOL_GDRVINFO.
            drv = ctypes.create_string_buffer(_DRVINFO_SIZE)
            struct.pack_into("I", drv, 0, ETHTOOL_GDRVINFO)
            self._ioctl(ifname, drv)
            return int(struct.unpack_from("I", drv, 4 + 32 + 32 + 32 + 32 + 12)[0])
        mask, = struct.unpack_from("Q", info, 8)
        return int(struct.unpack_from("I", info, 16)[0]) if mask & (1 << ETH_SS_STATS) else 0

    def read(self, ifname: str) -> NicStats:
        """Names and values of one interface. Raises OSError: ENODEV when the interface does not
        exist (here), EOPNOTSUPP when its driver has no statistics, EAGAIN when the driver's set
        kept changing while it was read."""
        try:  # the name's bytes: os.listdir gives a non-UTF-8 name as surrogate escapes
            name = os.fsencode(ifname)
        except UnicodeEncodeError:  # a lone surrogate that stands for no byte
            name = b""
        if not name or len(name) >= IFNAMSIZ or b"/" in name or b"\0" in name:
            raise OSError(errno.ENODEV, f"not an interface name: {ifname!r}")
        for _ in range(_RETRIES):
            count = self._count(name)
            bufs = self._bufs.get(ifname)
            if bufs is None or bufs.capacity < 2 * count:  # keep at least `count` spare
                bufs = self._bufs[ifname] = _Buffers(2 * count + 256)
            if count == 0:
                return NicStats((), [])
            struct.pack_into("III", bufs.strings, 0, ETHTOOL_GSTRINGS, ETH_SS_STATS, count)
            self._ioctl(name, bufs.strings)
            n_strings, = struct.unpack_from("I", bufs.strings, 8)
            struct.pack_into("II", bufs.stats, 0, ETHTOOL_GSTATS, count)
            self._ioctl(name, bufs.stats)
            n_stats, = struct.unpack_from("I", bufs.stats, 4)
            if n_strings != n_stats or n_stats != count or n_stats > bufs.capacity:
                continue  # the driver's set changed between the calls: read it again
            blob = bufs.strings.raw[12:12 + n_strings * ETH_GSTRING_LEN]
            if blob != bufs.blob:
                bufs.blob = blob
                bufs.names = tuple(
                    blob[i:i + ETH_GSTRING_LEN].split(b"\0", 1)[0].decode("ascii", "replace")
                    for i in range(0, len(blob), ETH_GSTRING_LEN))
            values = memoryview(bufs.stats)[8:8 + n_stats * 8].cast("B").cast("Q")
            return NicStats(bufs.names, values.tolist())
        raise OSError(errno.EAGAIN, f"statistics of {ifname} kept changing while read")

    def forget(self, keep: set[str]) -> None:
        """Drop the buffers of interfaces not in ``keep`` (gone or no longer watched)."""
        for gone in self._bufs.keys() - keep:
            del self._bufs[gone]

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def parse_stats_text(text: str) -> NicStats:
    """``ethtool -S`` output: a ``NIC statistics:`` header, then ``     name: value`` lines.

    Names are stripped (some kernels printed ``tx_pause_storm_warning_events `` with a trailing
    space inside the name); lines that are not ``name: unsigned integer`` (of at most 20 digits,
    as a 64-bit counter prints) are ignored.
    """
    names: list[str] = []
    values: list[int] = []
    for line in text.splitlines():
        name, sep, raw = line.rpartition(":")
        if not sep:
            continue
        value = parse_uint(raw.strip())
        name = name.strip()
        if name and value is not None:
            names.append(name)
            values.append(value)
    return NicStats(tuple(names), values)


class StatsReader(Protocol):
    """Where the counters come from: the ioctl, ``ethtool -S``, or a test's stand-in."""

    def read(self, ifname: str) -> NicStats: ...

    def close(self) -> None: ...


class CommandStatsReader:
    """Runs ``ethtool -S IF`` (no shell, with a timeout) and parses its text."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path, self.timeout = path, timeout

    def read(self, ifname: str) -> NicStats:
        try:
            return parse_stats_text(run_command([self.path, "-S", ifname], self.timeout))
        except CommandError as exc:
            raise OSError(errno.EIO, str(exc)) from None

    def close(self) -> None:
        pass
