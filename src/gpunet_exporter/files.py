"""Bounded reads of the files a user names, and the bounded YAML loader.

Every YAML file the commands read (``--config.file``, ``--web.config.file``, thresholds files) goes
through :func:`read_yaml`, which bounds what a file can cost before any value is checked: a
regular file (a FIFO, a device, a directory or a socket is refused without being opened for a
blocking read), at most ``MAX_FILE_BYTES`` (never more is read), nested at most ``MAX_DEPTH``
deep, and at most ``MAX_VALUES`` values once YAML aliases are expanded, so that a few hundred
bytes of anchors and aliases (a "billion laughs") cannot make validation or an error message walk
billions of values. Other files a user names (inventories, fleet plans, rule files) are read
through :func:`read_regular`, with the same refusals. Each raises ConfigError saying what is
wrong, without the file name, which the caller puts in front.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from gpunet_exporter.errors import ConfigError, key_text

MAX_FILE_BYTES = 1 << 20  # a config, web config or thresholds file: some KiB in practice
MAX_DEPTH = 32  # nesting; the schemas go 5 deep
MAX_VALUES = 100_000  # keys, scalars, lists and mappings, each alias counted as all it repeats

_NOT_REGULAR = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                (stat.S_ISSOCK, "a socket"))


def _mib(size: int) -> str:
    return f"{size / (1 << 20):g} MiB"


def _not_regular(mode: int) -> str:
    what = next((name for test, name in _NOT_REGULAR if test(mode)), None)
    return f"{what}, not a regular file" if what else "not a regular file"


def open_regular(path: str, limit: int) -> int:
    """A file descriptor open for reading on the regular file at ``path`` of at most ``limit``
    bytes; ConfigError saying what is wrong (without the file name) otherwise.

    It never blocks and never opens a device: the path is stat()ed first (a FIFO, a device, a
    directory or a socket is refused by its type), then opened with O_NONBLOCK and checked again
    (it may have been replaced in between).
    """
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(_not_regular(info.st_mode))
        if info.st_size > limit:
            raise ConfigError(f"too large: {info.st_size} bytes, the limit is {_mib(limit)}")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}") from None
    except ValueError as exc:  # a NUL, or a surrogate with no bytes: no file has this name
        raise ConfigError(f"cannot read: not a file name ({exc})") from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise ConfigError(f"cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise ConfigError(_not_regular(info.st_mode))
    return fd


def read_regular(path: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The content of the regular file at ``path``, read only up to ``limit`` + 1 bytes so that a
    file that grows after the check is refused without being read; ConfigError as
    :func:`open_regular` says, or "too large"."""
    fd = open_regular(path, limit)
    chunks, size = [], 0
    try:
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise ConfigError(f"too large: more than {_mib(limit)}, the limit")
    return b"".join(chunks)


def _at(mark: Any) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader that counts what it composes, before anything is constructed: at most
    ``MAX_DEPTH`` levels of nesting and ``MAX_VALUES`` values, where an alias counts as every
    value under its anchor (PyYAML shares the aliased object, but whoever walks the result, a
    ``<<`` merge included, walks it once per alias). An alias inside its own anchor (a recursive
    structure) is refused. Linear in the size of the text: the expanded size of every anchored
    node is remembered when its composition ends."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.values = 0
        self.depth = 0
        self.sizes: dict[int, int] = {}  # id(anchored node) -> its values, aliases expanded

    def count(self, n: int, mark: Any) -> None:
        self.values += n
        if self.values > MAX_VALUES:
            raise ConfigError(f"more than {MAX_VALUES} values{_at(mark)} (keys, scalars, lists "
                              "and mappings, each YAML alias counted as all it repeats)")

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event: Any = self.peek_event()  # type: ignore[no-untyped-call]
        if isinstance(event, yaml.AliasEvent):
            node = self.anchors.get(event.anchor)
            if node is not None:  # an undefined alias is PyYAML's error
                size = self.sizes.get(id(node))
                if size is None:
                    raise ConfigError(f"alias *{key_text(event.anchor)} inside its own anchor (a "
                                      f"recursive structure){_at(event.start_mark)}")
                self.count(size, event.start_mark)
            return super().compose_node(parent, index)
        if self.depth >= MAX_DEPTH:
            raise ConfigError(f"nested more than {MAX_DEPTH} levels deep"
                              f"{_at(event.start_mark)}")
        before = self.values
        self.count(1, event.start_mark)
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if getattr(event, "anchor", None) is not None:
            self.sizes[id(node)] = self.values - before
        return node


def _cut(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_yaml(path: str) -> Any:
    """A YAML file's content; raises ConfigError saying what is wrong (without the file name,
    which the caller puts in front). The file is bounded as the module's docstring says."""
    data = read_regular(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc.reason}") from None
    loader = None
    try:
        loader = _BoundedLoader(text)  # the reader refuses non-printable characters here
        return loader.get_single_data()
    except yaml.reader.ReaderError as exc:  # its str() is two lines
        line = text.count("\n", 0, exc.position) + 1
        column = exc.position - text.rfind("\n", 0, exc.position)
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ConfigError(f"invalid YAML at line {line}, column {column}: unacceptable "
                          f"character #x{char:04x} ({exc.reason})") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML{_at(getattr(exc, 'problem_mark', None))}: "
                          f"{_cut(' '.join(problem.split()))}") from None
    # PyYAML lets these through its YAMLError: RecursionError from its composer for deep
    # nesting (MAX_DEPTH stops that first); ValueError or OverflowError from constructing a value
    # (chr() of an escape beyond U+10FFFF, int() of more than 4300 digits, a date such as
    # 2001-13-45).
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply") from None
    except (ValueError, OverflowError) as exc:
        raise ConfigError(f"invalid YAML: cannot construct a value ({_cut(str(exc))})") from None
    finally:
        if loader is not None:
            loader.dispose()
