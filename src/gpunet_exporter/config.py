"""The optional YAML configuration file: a small schema, validated once at start.

An unknown key, a wrong type or a bad regular expression produces one ``ConfigError`` that names
the file, the key (dotted, with list indexes) and what was expected.

Every section is declared once, as a frozen dataclass of :class:`Settings` whose fields are
declared with :func:`setting` (a collector's section, the web config file, the config file's top
level through :func:`make_settings`); the schema (:func:`settings_fields`) is derived from it,
and :func:`parse_settings` (or :func:`load_file` for a whole file) checks a section and returns
an instance of it. ``Field`` and :func:`validate` are how that is done, not a way to declare.

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

import collections.abc
import dataclasses
import keyword
import math
import os
import re
import stat
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

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
    values: Field | None = None  # a map of any string keys, each value checked as this
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


def number_text(value: float) -> str:
    """A bound as people write it: 1048576, not %g's 1.04858e+06; 0.1."""
    if float(value).is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}"


def bounds_text(low: float | None, high: float | None) -> str:
    """``from LOW to HIGH``, ``>= LOW`` or ``<= HIGH``."""
    if low is not None and high is not None:
        return f"from {number_text(low)} to {number_text(high)}"
    return f">= {number_text(low)}" if low is not None else f"<= {number_text(cast(float, high))}"


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
            expected = bounds_text(low, high)
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
        if isinstance(value, re.Pattern):  # validated already (no YAML file makes one)
            return value
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
        if spec.values is not None:
            if not isinstance(k, str):
                raise ConfigError(f"key {sub!r}: a key must be a string (quote it)")
            problem = text_problem(k)
            if problem is not None:
                raise ConfigError(f"key {sub!r}: a key cannot hold {problem}")
            out[k] = validate(v, spec.values, sub)
            continue
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


# ---- typed settings -------------------------------------------------------------------------
#
# Every section of every file is declared once, as a frozen dataclass deriving from Settings
# whose fields carry their schema (setting()): the Python type of each field gives its kind, and
# the dataclass default is the default. The schema validate() checks, the defaults shown by
# --help and docs/configuration.md are all derived from that declaration, and parse_settings()
# turns a section into an instance, once, at start. Field and validate() are how that is done,
# not a way to declare.


@dataclass(frozen=True)
class Settings:
    """Base of a section's typed settings; on its own, the settings of a collector that has
    none.

    A subclass is a frozen dataclass whose fields are its keys. Each field's type gives the kind
    of its value: ``bool``, ``int``, ``float`` (a number: an int or a float), ``str``,
    ``re.Pattern[str]`` (a regular expression, compiled once), ``tuple[X, ...]`` (a list of X),
    ``Mapping[str, X]`` (a map of any string keys to X, such as user names; read-only), or
    another Settings subclass (a nested map, which always gets its own keys' defaults, whether
    the file names it or not; ``Nested | None``: absent unless the file names it, then with its
    required keys). ``X | None`` is a key that may be left unset (its default None). Declare
    each field with :func:`setting` to give it help text and bounds; a key that is no Python
    name (``Content-Security-Policy``) through :func:`make_settings`.
    """


S = TypeVar("S", bound=Settings)

_SETTING = "gpunet_exporter.setting"  # the key of a field's _Doc in its dataclass metadata


@dataclass(frozen=True)
class _Doc:
    help: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] = ()
    multiple_of: int | None = None
    key: str | None = None  # the key in the file, where it is not the field's name


def setting(help: str = "", default: Any = None, *, required: bool = False,
            minimum: float | None = None, maximum: float | None = None,
            choices: tuple[str, ...] = (), multiple_of: int | None = None) -> Any:
    """A field of a Settings dataclass: its help text (the meaning column of
    docs/configuration.md), its default and its bounds.

    ``default`` None is a key left unset: its type must then allow None. A list (``tuple``)
    defaults to a tuple (``()``: none), a nested map to an instance of its class with its own
    defaults (``Nested()``), a ``Mapping`` to ``{}`` (none). ``required`` keys have no default; a
    dataclass with one is best declared ``kw_only=True``. On a list, ``minimum``, ``maximum``,
    ``choices`` and ``multiple_of`` bound each of its items.
    """
    meta = {_SETTING: _Doc(help, minimum, maximum, tuple(choices), multiple_of)}
    if required:
        return field(metadata=meta)
    if isinstance(default, Mapping):
        if default:
            raise TypeError("a Mapping setting defaults to {} (none)")
        return field(default_factory=_empty_map, metadata=meta)
    return field(default=default, metadata=meta)


def _empty_map() -> Mapping[str, Any]:
    return types.MappingProxyType({})


def make_settings(name: str, keys: Mapping[str, tuple[Any, Any]]) -> type[Settings]:
    """A Settings class declared from a mapping of each key to ``(type, setting(...))``, for
    keys known only at run time (the config file's collector sections) or that are no Python
    names (HTTP header names): their fields are named ``key_0``, ``key_1`` ... unless the key is
    a Python name, and :func:`settings_items` gives them back by key."""
    fields: list[tuple[str, Any, Any]] = []
    for i, (key, (hint, spec)) in enumerate(keys.items()):
        doc = dataclasses.replace(spec.metadata.get(_SETTING) or _Doc(), key=key)
        attr = key if key.isidentifier() and not keyword.iskeyword(key) else f"key_{i}"
        if spec.default is not dataclasses.MISSING:
            made = field(default=spec.default, metadata={_SETTING: doc})
        elif spec.default_factory is not dataclasses.MISSING:
            made = field(default_factory=spec.default_factory, metadata={_SETTING: doc})
        else:
            made = field(metadata={_SETTING: doc})
        fields.append((attr, hint, made))
    return cast("type[Settings]", dataclasses.make_dataclass(
        name, fields, bases=(Settings,), frozen=True, kw_only=True))


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class _Member:
    name: str  # the field's
    key: str  # the file's
    spec: Field
    convert: Callable[[Any], Any]  # from what validate() returns to the field's type


def _scalar(hint: Any, doc: _Doc, where: str) -> Field:
    kinds: tuple[tuple[Any, Kind], ...] = ((bool, "bool"), (int, "int"), (float, "number"),
                                           (str, "str"))
    kind = next((k for t, k in kinds if hint is t), None)
    if kind is None and (hint is re.Pattern or typing.get_origin(hint) is re.Pattern):
        kind = "regex"
    if kind is None:
        raise TypeError(f"setting {where}: unsupported type {hint!r} (bool, int, float, str, "
                        "re.Pattern[str], tuple[X, ...], Mapping[str, X] or a Settings "
                        "subclass)")
    return Field(kind, doc.help, minimum=doc.minimum, maximum=doc.maximum, choices=doc.choices,
                 multiple_of=doc.multiple_of)


def _is_settings(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Settings)


def _member(f: dataclasses.Field[Any], hint: Any, where: str) -> _Member:
    doc = f.metadata.get(_SETTING) or _Doc()
    key = doc.key or f.name
    required, default = False, cast(Any, f.default)
    if f.default is dataclasses.MISSING:
        if f.default_factory is dataclasses.MISSING:
            required, default = True, None
        else:
            default = f.default_factory()
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        others = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(others) != 1 or len(typing.get_args(hint)) != 2:
            raise TypeError(f"setting {where}: a union other than `X | None`")
        hint, optional = others[0], True
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) != 2 or args[1] is not Ellipsis:
            raise TypeError(f"setting {where}: a list is declared tuple[X, ...]")
        if optional or not (required or isinstance(default, tuple)):
            raise TypeError(f"setting {where}: a list defaults to a tuple (() for none), "
                            "never None")
        item_hint = args[0]
        if _is_settings(item_hint):
            if doc.minimum is not None or doc.maximum is not None or doc.choices or (
                    doc.multiple_of is not None):
                raise TypeError(f"setting {where}: bounds apply to a list of scalars")
            items = _members(item_hint)
            item = Field("map", fields={m.key: m.spec for m in items})

            def convert_item(value: Any) -> Any:
                return _build(item_hint, items, value)
        else:
            item, convert_item = _scalar(item_hint, doc, f"{where}[]"), _same
        spec = Field("list", doc.help, default=list(default) if default else None, item=item,
                     required=required)
        return _Member(f.name, key, spec, lambda value: tuple(convert_item(v) for v in value))
    if typing.get_origin(hint) in (Mapping, collections.abc.Mapping):
        args = typing.get_args(hint)
        if len(args) != 2 or args[0] is not str or optional or required or default != {}:
            raise TypeError(f"setting {where}: a map of any keys is declared Mapping[str, X] "
                            "and defaults to {}")
        values = _scalar(args[1], doc, f"{where}[]")
        spec = Field("map", doc.help, values=dataclasses.replace(values, help=""))
        return _Member(f.name, key, spec, lambda value: types.MappingProxyType(dict(value)))
    if _is_settings(hint):
        nested = _members(hint)
        fields = {m.key: m.spec for m in nested}
        if optional and default is None and not required:  # absent unless the file names it
            spec = Field("map", doc.help, fields=fields)
        elif optional or required or default != hint():
            raise TypeError(f"setting {where}: a nested map defaults to its class with its own "
                            f"defaults ({hint.__name__}()), or to None (`{hint.__name__} | "
                            "None`)")
        else:
            spec = Field("map", doc.help, fields=fields, default={})  # absent: its keys' defaults
        return _Member(f.name, key, spec, lambda value: _build(hint, nested, value))
    spec = _scalar(hint, doc, where)
    if default is None and not (optional or required):
        raise TypeError(f"setting {where}: default None needs the type `X | None` (or "
                        "required=True)")
    if default is not None and spec.kind == "regex":
        raise TypeError(f"setting {where}: a regular expression defaults to None")
    if default is not None:
        validate(default, spec, where)  # a default the schema refuses is a bug of the code
    return _Member(f.name, key, dataclasses.replace(spec, default=default, required=required),
                   _same)


_MEMBERS: dict[type[Settings], tuple[_Member, ...]] = {}


def _members(cls: type[Settings]) -> tuple[_Member, ...]:
    """The keys of a Settings class, worked out from its declaration once."""
    members = _MEMBERS.get(cls)
    if members is None:
        params = getattr(cls, "__dataclass_params__", None)
        if "__dataclass_fields__" not in cls.__dict__ or not (params and params.frozen):
            raise TypeError(f"{cls.__qualname__} must be a frozen dataclass")
        hints = typing.get_type_hints(cls)
        members = _MEMBERS[cls] = tuple(
            _member(f, hints[f.name], f"{cls.__qualname__}.{f.name}")
            for f in dataclasses.fields(cls))
    return members


def _build(cls: type[S], members: tuple[_Member, ...], section: Mapping[str, Any]) -> S:
    return cls(**{m.name: m.convert(section[m.key]) for m in members if m.key in section})


def settings_fields(cls: type[Settings]) -> dict[str, Field]:
    """The keys of ``cls`` and the schema each is checked against (for docs/configuration.md and
    --help's defaults)."""
    return {m.key: m.spec for m in _members(cls)}


def settings_items(settings: Settings) -> dict[str, Any]:
    """The values of ``settings`` by their keys in the file."""
    return {m.key: getattr(settings, m.name) for m in _members(type(settings))}


def parse_settings(cls: type[S], section: Any, key: str) -> S:
    """A section as YAML gives it (None: empty), checked against ``cls`` and returned as its
    settings, every default filled in; ConfigError naming ``key`` and the wrong key under it
    otherwise."""
    if section is None:
        section = {}
    elif isinstance(section, Mapping) and not isinstance(section, dict):
        section = dict(section)
    valid = validate(section, Field("map", fields=settings_fields(cls)), key)
    return _build(cls, _members(cls), valid)


def with_setting(settings: S, key: str, value: Any, where: str) -> S:
    """``settings`` with one key set to ``value`` (a flag's text), checked as the file's value
    would be; ConfigError naming ``where`` otherwise."""
    member = next(m for m in _members(type(settings)) if m.key == key)
    valid = validate(value, member.spec, where)
    return dataclasses.replace(settings, **{member.name: member.convert(valid)})


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


@typing.overload
def load_file(path: str, schema: type[S], what: str = ...) -> S: ...
@typing.overload
def load_file(path: str, schema: Field, what: str = ...) -> dict[str, Any]: ...


def load_file(path: str, schema: type[S] | Field, what: str = "config file"
              ) -> S | dict[str, Any]:
    """Read a YAML file (an empty one is an empty mapping) and check it against ``schema``, a
    Settings class (its instance is returned). Raises ConfigError with ``what`` and the file
    name in the text. (A ``Field`` schema, returning the validated mapping, is kept for
    the thresholds (mixin/thresholds.py), whose ``for`` map of alert names is built at run time.)"""
    try:
        raw = read_yaml(path)
        if isinstance(schema, Field):
            result: S | dict[str, Any] = validate({} if raw is None else raw, schema, "")
        else:
            result = parse_settings(schema, raw, "")
    except ConfigError as exc:
        raise ConfigError(f"{what} {path!r}: {exc}") from None
    return result
