"""The optional YAML configuration file: a small schema, validated once at start.

An unknown key, a wrong type or a bad regular expression produces one ``ConfigError`` that names
the file, the key (dotted, with list indexes) and what was expected.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(value: Any) -> str:
    return f"{_short(value)} ({type(value).__name__})"


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
            raise ConfigError(f"{where}: expected a value {expected}, got {value!r}")
        if spec.multiple_of and cast(int, value) % spec.multiple_of:
            raise ConfigError(f"{where}: expected a multiple of {spec.multiple_of}, "
                              f"got {value!r}")
        return value
    if spec.kind == "str":
        if not isinstance(value, str):
            raise wrong()
        problem = text_problem(value)
        if problem is not None:
            raise ConfigError(f"{where}: expected text, got a string with {problem}: "
                              f"{_short(value)}")
        if spec.choices and value not in spec.choices:
            raise ConfigError(f"{where}: expected one of {', '.join(spec.choices)}, "
                              f"got {value!r}")
        return value
    if spec.kind == "regex":
        if not isinstance(value, str):
            raise wrong()
        try:
            return re.compile(value)
        # Besides re.error, re.compile raises OverflowError for a repetition count of 2**32 or
        # more, ValueError for one beyond int()'s digit limit, RecursionError for deep nesting.
        except (re.error, OverflowError, ValueError) as exc:
            raise ConfigError(f"{where}: invalid regular expression {_short(value)}: "
                              f"{exc}") from None
        except RecursionError:
            raise ConfigError(f"{where}: invalid regular expression {_short(value)}: nested "
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
        sub = f"{key}.{k}" if key else str(k)
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


def read_yaml(path: str) -> Any:
    """A YAML file's content; raises ConfigError saying what is wrong (without the file name,
    which the caller puts in front)."""
    try:
        with open(path, encoding="utf-8") as fh:
            return yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"invalid YAML{at}: {problem}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"not UTF-8 text: {exc.reason}") from None
    # PyYAML lets these through its YAMLError: RecursionError from its composer for deep
    # nesting; ValueError or OverflowError from constructing a value (chr() of an escape beyond
    # U+10FFFF, int() of more than 4300 digits, a date such as 2001-13-45).
    except RecursionError:
        raise ConfigError("invalid YAML: nested too deeply") from None
    except (ValueError, OverflowError) as exc:
        raise ConfigError(f"invalid YAML: cannot construct a value ({exc})") from None


def load_file(path: str, schema: Field, what: str = "config file") -> dict[str, Any]:
    """Read and validate a YAML file (an empty one is an empty mapping). Raises ConfigError
    with ``what`` and the file name in the text."""
    try:
        raw = read_yaml(path)
        result: dict[str, Any] = validate({} if raw is None else raw, schema, "")
    except ConfigError as exc:
        raise ConfigError(f"{what} {path!r}: {exc}") from None
    return result
