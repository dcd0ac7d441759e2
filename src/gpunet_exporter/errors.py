"""``ConfigError``, the one error of a user's file or flag, and how its message shows the value
at fault.

A message names the file or flag, the key and what was expected; a value in it is shown through
:func:`short` (a key through :func:`key_text`), which builds at most a short excerpt whatever the
value's size, so a huge or aliased value cannot make an error message cost more than its text.
A bound is written as people write it (:func:`bounds_text`), in a message as in the docs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, cast


class ConfigError(Exception):
    """A user error in the configuration; its text is the whole message to print."""


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

