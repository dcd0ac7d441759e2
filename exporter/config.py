"""The optional YAML configuration file: a small schema, validated once at start.

An unknown key, a wrong type or a bad regular expression produces one ``ConfigError`` that names
the file, the key (dotted, with list indexes) and what was expected.

Every YAML file the commands read (``--config.file``, ``--web.config.file``, thresholds files) goes
through :func:`read_yaml`, which bounds what a file can cost before any value is checked: a
regular file (a FIFO, a device, a directory or a socket is refused without being opened for a
blocking read), at most ``MAX_FILE_BYTES`` (never more is read), nested at most ``MAX_DEPTH``
deep, and at most ``MAX_VALUES`` values once YAML aliases are expanded, so that a few hundred
bytes of anchors and aliases (a "billion laughs") cannot make ``validate`` or an error message walk
billions of values. Error messages show values through :func:`short`, which builds at most a
short excerpt, whatever the value's size.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import yaml

Kind = Literal["str", "int", "number", "bool", "regex", "list", "map"]


class ConfigError(Exception):
    """A user error in the configuration; its text is the whole message to print."""


@dataclass(frozen=True)
class Field:
    kind: Kind
    help: str = ""
    default: Any = None
    item: Field | None = None  # element schema of a list
    fields: Mapping[str, Field] = field(default_factory=dict)  # keys of a map
    minimum: float | None = None
    maximum: float | None = None
    required: bool = False
    choices: tuple[str, ...] = ()  # the allowed values of a str
    multiple_of: int | None = None  # an int must be a multiple of this


_EXPECTED = {
    "str": "a string",
    "int": "an integer",
    "number": "a number",
    "bool": "true or false",
    "regex": "a regular expression (string)",
    "list": "a list",
    "map": "a mapping of keys to values",
}


_EXPONENT = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


SHORT = 60  # characters of a value that an error message shows


def _pieces(value: Any, room: int) -> Iterator[str]:
    """repr(value) in pieces, lazily: a consumer that stops after ``room`` characters has made
    only those, however large or aliased the value is (9**9 leaves behind 9 shared lists)."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if isinstance(value, (set, frozenset)) and not value:
            yield f"{type(value).__name__}()"
            return
        opening, closing = ("[", "]") if isinstance(value, list) else (
            ("(", ")") if isinstance(value, tuple) else ("{", "}"))
        yield opening
        items: Any = value.items() if isinstance(value, dict) else value
        for i, item in enumerate(items):
            if i:
                yield ", "
            if isinstance(value, dict):
                yield from _pieces(item[0], room)
                yield ": "
                yield from _pieces(item[1], room)
            else:
                yield from _pieces(item, room)
        if isinstance(value, tuple) and len(value) == 1:
            yield ","
        yield closing
    elif isinstance(value, (str, bytes)):
        yield repr(value[:room + 1])  # a longer one is cut anyway; its repr may not be made
    elif isinstance(value, int) and not isinstance(value, bool):
        yield _int_text(value)
    else:  # None, bool, float, dates: short by nature
        yield repr(value)


def _int_text(value: int) -> str:
    """repr() of an int, or its size where Python refuses to convert it (beyond 4,300 digits
    unless configured otherwise; YAML's 0x form has no such limit)."""
    try:
        return repr(value)
    except ValueError:
        digits = int(value.bit_length() * math.log10(2)) + 1
        return f"<{'negative ' if value < 0 else ''}integer of about {digits} digits>"


def short(value: Any, limit: int = SHORT) -> str:
    """repr(value), or its first ``limit - 3`` characters and "..."; bounded in time and memory
    for any value."""
    text = ""
    for piece in _pieces(value, limit):
        text += piece
        if len(text) > limit:
            return text[:limit - 3] + "..."
    return text


def key_text(key: Any) -> str:
    """A mapping key as error messages name it: as str() gives it, cut to ``SHORT``
    characters."""
    if isinstance(key, str):
        text = key
    elif isinstance(key, int) and not isinstance(key, bool):
        text = _int_text(key)
    elif isinstance(key, (bytes, tuple, frozenset)):  # !!binary; no other key has a size
        text = short(key)
    else:  # None, bool, float, dates
        text = str(key)
    return text if len(text) <= SHORT else text[:SHORT - 3] + "..."


def _describe(value: Any) -> str:
    return f"{short(value)} ({type(value).__name__})"


def _in_float_range(value: float) -> bool:
    """False for an int beyond the float range: every float() of it (a timeout, a rate, the
    sample prometheus_client renders) would raise OverflowError."""
    try:
        float(value)
    except OverflowError:
        return False
    return True


def text_problem(text: str) -> str | None:
    """Why a string cannot be a file name, program, interface, label or line of output: a NUL
    (open() and exec refuse it, C cuts the string there) or an unpaired surrogate (YAML's
    "\\ud800" escape: no UTF-8 encoding exists); None when it can."""
    if "\0" in text:
        return "a NUL character"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "an unpaired surrogate (not a Unicode character)"
    return None


def validate(value: Any, spec: Field, key: str) -> Any:
    """Check ``value`` against ``spec`` and return it normalised (regexes compiled).

    ``key`` is the dotted location used in error messages.
    """
    where = f"key {key!r}" if key else "top level"

    def wrong() -> ConfigError:
        return ConfigError(f"{where}: expected {_EXPECTED[spec.kind]}, got {_describe(value)}")

    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise wrong()
        return value
    if spec.kind == "number" and isinstance(value, str) and _EXPONENT.match(value):
        value = float(value)  # YAML 1.2 reads 1e11 as a number; PyYAML (YAML 1.1) as a string
    if spec.kind in ("int", "number"):
        ok_types: tuple[type, ...] = (int,) if spec.kind == "int" else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            raise wrong()
        if value != value:  # NaN (.nan in YAML) compares false with every bound
            raise ConfigError(f"{where}: expected {_EXPECTED[spec.kind]}, got NaN")
        if not _in_float_range(cast(float, value)):
            raise ConfigError(f"{where}: expected {_EXPECTED[spec.kind]} within the float range "
                              "(up to about 1.8e308), got a larger one")
        low, high, number = spec.minimum, spec.maximum, cast(float, value)
        if (low is not None and number < low) or (high is not None and number > high):
            expected = (f"from {low:g} to {high:g}" if low is not None and high is not None
                        else f">= {low:g}" if low is not None else f"<= {high:g}")
            raise ConfigError(f"{where}: expected a value {expected}, got {short(value)}")
        if spec.multiple_of and cast(int, value) % spec.multiple_of:
            raise ConfigError(f"{where}: expected a multiple of {spec.multiple_of}, "
                              f"got {short(value)}")
        return value
    if spec.kind == "str":
        if not isinstance(value, str):
            raise wrong()
        problem = text_problem(value)
        if problem is not None:
            raise ConfigError(f"{where}: expected text, got a string with {problem}: "
                              f"{short(value)}")
        if spec.choices and value not in spec.choices:
            raise ConfigError(f"{where}: expected one of {', '.join(spec.choices)}, "
                              f"got {short(value)}")
        return value
    if spec.kind == "regex":
        if not isinstance(value, str):
            raise wrong()
        try:
            return re.compile(value)
        # Besides re.error, re.compile raises OverflowError for a repetition count of 2**32 or
        # more, ValueError for one beyond int()'s digit limit, RecursionError for deep nesting.
        except (re.error, OverflowError, ValueError) as exc:
            raise ConfigError(f"{where}: invalid regular expression {short(value)}: "
                              f"{exc}") from None
        except RecursionError:
            raise ConfigError(f"{where}: invalid regular expression {short(value)}: nested "
                              "too deeply") from None
    if spec.kind == "list":
        if not isinstance(value, list):
            raise wrong()
        assert spec.item is not None
        return [validate(v, spec.item, f"{key}[{i}]") for i, v in enumerate(value)]
    # map
    if not isinstance(value, dict):
        raise wrong()
    out: dict[str, Any] = {}
    for k, v in value.items():
        sub = f"{key}.{key_text(k)}" if key else key_text(k)
        if not isinstance(k, str) or k not in spec.fields:
            known = ", ".join(sorted(spec.fields)) or "none"
            raise ConfigError(f"key {sub!r}: unknown key (known keys here: {known})")
        out[k] = validate(v, spec.fields[k], sub)
    for k, f in spec.fields.items():
        if k not in out:
            if f.required:
                raise ConfigError(f"key {(key + '.' + k) if key else k!r}: missing, it is required")
            if f.default is not None:
                out[k] = validate(f.default, f, f"{key}.{k}" if key else k)
    return out


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


def load_file(path: str, schema: Field, what: str = "config file") -> dict[str, Any]:
    """Read and validate a YAML file (an empty one is an empty mapping). Raises ConfigError
    with ``what`` and the file name in the text."""
    try:
        raw = read_yaml(path)
        result: dict[str, Any] = validate({} if raw is None else raw, schema, "")
    except ConfigError as exc:
        raise ConfigError(f"{what} {path!r}: {exc}") from None
    return result
