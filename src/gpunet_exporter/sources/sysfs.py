"""Reads under an injectable root (``--path.sysfs`` / ``--path.procfs``).

Every read a collector makes goes through a :class:`Root`, so tests point collectors at fixture
trees, and fault tests subclass it to inject the errors a real kernel returns (EINVAL, EOPNOTSUPP)
that regular files cannot produce. Reads use ``os.open``/``os.read`` directly: sysfs attributes
are at most one page, and the buffered ``open()`` machinery costs more than the read itself.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from typing import TypeVar

_T = TypeVar("_T")

# O_NONBLOCK: opening a FIFO planted in a tree returns at once instead of blocking the scrape.
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_PAGE = 4096
_MAX_READ = 65536


def _os(call: Callable[..., _T], path: str, *args: object, **kwargs: object) -> _T:
    """``call(path, ...)`` with a path the os module refuses before asking the kernel (a NUL
    byte, a lone surrogate that encodes to no bytes: ValueError) raised as the OSError every
    caller handles. Such a path comes from a file's content (a netdev name read from sysfs) or
    the configuration, and names no file."""
    try:
        return call(path, *args, **kwargs)
    except ValueError as exc:
        raise OSError(errno.EINVAL, f"not a valid path: {exc}", path) from None


class Root:
    """A filesystem root such as ``/sys``; all paths given to it are relative to it."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def read(self, rel: str) -> str:
        """The file's text with trailing whitespace removed; raises OSError."""
        return self._read(f"{self.root}/{rel}", None, rel)

    def read_dir(self, rel: str, select: Callable[[list[str]], Iterable[str]] | None = None
                 ) -> dict[str, str | OSError]:
        """Every entry of a directory read at once: name -> text, or the OSError reading it gave.

        Opens the directory once and each file relative to it (openat), which saves resolving
        the whole path, symlinks included, for each of the hundreds of counter files.
        ``select``, given the sorted names, returns those to read (default: all of them).
        Raises OSError when the directory itself cannot be opened.
        """
        return self.read_many(rel, None, select)

    def read_many(self, rel: str, names: Iterable[str] | None,
                  select: Callable[[list[str]], Iterable[str]] | None = None
                  ) -> dict[str, str | OSError]:
        """Several files of one directory (all of them, or those ``select`` picks from the
        sorted listing, when ``names`` is None), each read relative to the directory's
        descriptor. Raises OSError when the directory cannot be opened; a file that cannot be
        read maps to its OSError."""
        dfd = _os(os.open, f"{self.root}/{rel}", _DIR_FLAGS)
        try:
            out: dict[str, str | OSError] = {}
            if names is None:
                names = sorted(os.listdir(dfd))
                if select is not None:
                    names = select(names)
            for name in names:
                try:
                    out[name] = self._read(name, dfd, f"{rel}/{name}")
                except OSError as exc:
                    out[name] = exc
            return out
        finally:
            os.close(dfd)

    def _read(self, path: str, dir_fd: int | None, rel: str) -> str:
        """The one place a file is read; ``rel`` (relative to the root) lets tests inject errors."""
        try:
            fd = os.open(path, _OPEN_FLAGS, dir_fd=dir_fd)
        except ValueError as exc:  # what _os does, inline: this runs for every counter file
            raise OSError(errno.EINVAL, f"not a valid path: {exc}", path) from None
        try:
            # sysfs attributes fit in one page; asking for more allocates a large buffer per read.
            data = os.read(fd, _PAGE)
            if len(data) == _PAGE:  # a longer regular file (or 64 KiB pages): read the rest
                chunks = [data]
                while chunk := os.read(fd, _MAX_READ):
                    chunks.append(chunk)
                    if sum(map(len, chunks)) > _MAX_READ:
                        break
                data = b"".join(chunks)
        finally:
            os.close(fd)
        return data.decode("utf-8", "replace").rstrip()

    def read_bytes(self, rel: str, offset: int, size: int) -> bytes:
        """Up to ``size`` raw bytes at ``offset`` of a file (pread), fewer when the file (or what
        the kernel lets this reader see) ends sooner. For binary files such as a PCI function's
        ``config``, where only a few registers are wanted. Raises OSError."""
        fd = _os(os.open, f"{self.root}/{rel}", _OPEN_FLAGS)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)

    def listdir(self, rel: str) -> list[str]:
        """Sorted entries of a directory; raises OSError."""
        return sorted(_os(os.listdir, f"{self.root}/{rel}"))

    def identity(self, rel: str) -> tuple[int, int]:
        """(device, inode) of what a path resolves to: changes when the object is re-created."""
        st = _os(os.stat, f"{self.root}/{rel}")
        return st.st_dev, st.st_ino

    def exists(self, rel: str) -> bool:
        return os.path.exists(f"{self.root}/{rel}")

    def link_target(self, rel: str) -> str:
        """Last path component of where a symlink resolves (e.g. a PCI address); raises OSError."""
        real: str = _os(os.path.realpath, f"{self.root}/{rel}", strict=True)
        return os.path.basename(real)


# 2**64 - 1, the widest value the kernel prints ("%llu"), has 20 digits.
MAX_DIGITS = 20


def parse_decimal(text: str, signed: bool = False, max_digits: int = MAX_DIGITS) -> int | None:
    """``text`` as a decimal integer, or None: ASCII digits only (``str.isdigit()`` also accepts
    "²" or "①", which ``int()`` refuses), a leading ``-`` only where ``signed``, and at most
    ``max_digits`` digits after leading zeros, so that no value reaches ``int()``'s digit limit
    (4300) or lies beyond the float range that prometheus_client renders. The one integer parser
    of every text the exporter reads (sysfs, procfs, tool output, environment variables)."""
    negative = signed and text.startswith("-")
    body = text[1:] if negative else text
    if not (body.isascii() and body.isdigit()):
        return None
    digits = body.lstrip("0")
    if len(digits) > max_digits:
        return None
    value = int(digits) if digits else 0
    return -value if negative else value


def parse_uint(text: str) -> int | None:
    """A decimal unsigned integer as sysfs prints it (``"%llu"``), or None for anything else:
    :func:`parse_decimal` unsigned, with a fast path for the common case (every counter file of
    every scrape goes through here)."""
    if len(text) <= MAX_DIGITS and text.isascii() and text.isdigit():
        return int(text)
    return parse_decimal(text)


def parse_int(text: str) -> int | None:
    """A decimal integer, possibly negative (``"%d"``), or None."""
    return parse_decimal(text, signed=True)
