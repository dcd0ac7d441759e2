"""Settings: every section of every file the commands read, declared once and validated once.

Every section is declared once, as a frozen dataclass of :class:`Settings` whose fields are
declared with :func:`setting` (a collector's section, the web config file, the thresholds, the
config file's top level through :func:`make_settings`); the schema (:func:`settings_fields`) is
derived from it, and :func:`parse_settings` (or :func:`load_file` for a whole YAML file, read
through :func:`gpunet_exporter.files.read_yaml`) checks a section and returns an instance of it.
An unknown key, a wrong type or a bad regular expression produces one ``ConfigError`` that names
the file, the key (dotted, with list indexes) and what was expected.

``Field`` is the schema of one key as :func:`settings_fields` gives it, to read (the docs' key
table, ``--help``'s defaults); it is built only here, from a declaration, and checked only here
(``_validate``): it is no way to declare. This module is the stable import path of ``Settings``
and ``setting`` for third-party collectors (docs/architecture.md).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import keyword
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, cast

from gpunet_exporter.errors import ConfigError, bounds_text, key_text, short, text_problem
from gpunet_exporter.files import read_yaml

Kind = Literal["str", "int", "number", "bool", "regex", "list", "map"]

@dataclass(frozen=True)
class Field:
    """The schema of one key, derived from its declaration (read-only outside this module)."""

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


def _validate(value: Any, spec: Field, key: str) -> Any:
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
        return [_validate(v, spec.item, f"{key}[{i}]") for i, v in enumerate(value)]
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
            out[k] = _validate(v, spec.values, sub)
            continue
        if not isinstance(k, str) or k not in spec.fields:
            known = ", ".join(sorted(spec.fields)) or "none"
            raise ConfigError(f"key {sub!r}: unknown key (known keys here: {known})")
        out[k] = _validate(v, spec.fields[k], sub)
    for k, f in spec.fields.items():
        if k not in out:
            if f.required:
                raise ConfigError(f"key {(key + '.' + k) if key else k!r}: missing, it is required")
            if f.default is not None:
                out[k] = _validate(f.default, f, f"{key}.{k}" if key else k)
    return out


# ---- typed settings -------------------------------------------------------------------------
#
# Every section of every file is declared once, as a frozen dataclass deriving from Settings
# whose fields carry their schema (setting()): the Python type of each field gives its kind, and
# the dataclass default is the default. The schema _validate() checks, the defaults shown by
# --help and docs/configuration.md are all derived from that declaration, and parse_settings()
# turns a section into an instance, once, at start. Field and _validate() are how that is done,
# not a way to declare: nothing outside this module builds a Field or calls _validate().


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
    convert: Callable[[Any], Any]  # from what _validate() returns to the field's type


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
        _validate(default, spec, where)  # a default the schema refuses is a bug of the code
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
    valid = _validate(section, Field("map", fields=settings_fields(cls)), key)
    return _build(cls, _members(cls), valid)


def with_setting(settings: S, key: str, value: Any, where: str) -> S:
    """``settings`` with one key set to ``value`` (a flag's text), checked as the file's value
    would be; ConfigError naming ``where`` otherwise."""
    member = next(m for m in _members(type(settings)) if m.key == key)
    valid = _validate(value, member.spec, where)
    return dataclasses.replace(settings, **{member.name: member.convert(valid)})


def load_file(path: str, schema: type[S], what: str = "config file") -> S:
    """Read a YAML file (an empty one is an empty mapping) and check it against ``schema``, a
    Settings class; its instance is returned. Raises ConfigError with ``what`` and the file name
    in the text."""
    try:
        return parse_settings(schema, read_yaml(path), "")
    except ConfigError as exc:
        raise ConfigError(f"{what} {path!r}: {exc}") from None
