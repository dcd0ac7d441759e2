"""The bounds on every YAML file the commands read (issue 15): a regular file of at most 1 MiB,
nesting at most 32 deep, at most 100,000 values with YAML aliases expanded; and error messages
that show a short excerpt of any value, however large or aliased. The real commands on hostile
files: tests/test_cli.py::test_hostile_yaml_files_are_refused_in_one_line."""

from __future__ import annotations

import os
import socket
import tempfile
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from gpunet_exporter import files
from gpunet_exporter.config import (
    Settings,
    load_file,
    parse_settings,
    setting,
    settings_items,
)
from gpunet_exporter.errors import ConfigError, key_text, short
from gpunet_exporter.files import MAX_DEPTH, MAX_FILE_BYTES, MAX_VALUES, read_regular, read_yaml
from gpunet_exporter.mixin import thresholds
from gpunet_exporter.mixin.alerts import ALERT_NAMES
from gpunet_exporter.options import config_type
from gpunet_exporter.registry import discover

from support.yaml_bombs import alias_bomb, merge_bomb


def write(tmp_path: Path, text: str | bytes) -> str:
    path = tmp_path / "c.yml"
    if isinstance(text, str):
        path.write_text(text)
    else:
        path.write_bytes(text)
    return str(path)


def refused(tmp_path: Path, text: str | bytes) -> str:
    with pytest.raises(ConfigError) as err:
        read_yaml(write(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message and len(message) < 300, message
    return message


def nine_to_the_ninth() -> list[Any]:
    """What the YAML alias bomb loads to, without the YAML: 9 shared lists, 9**9 leaves."""
    value: list[Any] = ["x"] * 9
    for _ in range(8):
        value = [value] * 9
    return value


# ---- short excerpts ---------------------------------------------------------------------------

def test_short_of_the_alias_bomb_makes_only_the_excerpt() -> None:
    """repr() of it is 2 GB and 40 s; the excerpt is made from the first leaves alone."""
    tracemalloc.start()
    try:
        text = short(nine_to_the_ninth())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert text == "[[[[[[[[['x', 'x', 'x', 'x', 'x', 'x', 'x', 'x', 'x'], ['..."
    assert peak < 100_000


def test_short_is_repr_when_short_and_its_start_otherwise() -> None:
    for value in ("fast", 12, -3.5, None, True, [1, "a"], {"a": [1, {2}]}, (1,), set(),
                  b"\x00", "x" * 58):
        assert short(value) == repr(value)
    for value in ("x" * 59, list(range(100)), {"k": "v" * 100}, b"\xff" * 100, 10**70):
        assert short(value) == repr(value)[:57] + "..."
    deep: list[Any] = []
    for _ in range(100_000):  # far beyond the recursion limit: only the first 60 are looked at
        deep = [deep]
    assert short(deep) == "[" * 57 + "..."
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    assert len(short(cyclic)) == 60


def test_short_of_integers_beyond_the_digit_limit() -> None:
    """YAML's 0x form builds ints of any size, and repr() refuses more than 4300 digits: a
    thresholds `job: 0xfff...` was a traceback (ValueError) instead of a wrong-type message."""
    huge = int("f" * 5000, 16)
    assert short(huge) == "<integer of about 6021 digits>"
    assert short(-huge) == "<negative integer of about 6021 digits>"
    assert key_text(huge) == "<integer of about 6021 digits>"
    assert key_text("k" * 100) == "k" * 57 + "..."
    assert key_text(b"\x00" * 100).startswith("b'\\x00") and len(key_text(b"\x00" * 100)) == 60


def test_messages_show_an_excerpt_of_huge_values(tmp_path: Path) -> None:
    cases = [
        ("job: 0x" + "f" * 5000, "key 'job': expected a string, got <integer of about 6021 "
                                 "digits> (int)"),
        ("pfc: {trust: " + "x" * 100_000 + "}",
         f"key 'pfc.trust': expected one of dscp, pcp, got '{'x' * 56}..."),
        ("infiniband: {link_downed_window: '" + "1" * 100_000 + "'}",
         f"key 'infiniband.link_downed_window': expected a Prometheus duration such as 5m or "
         f"1h30m, got '{'1' * 56}..."),
        ("? 0x" + "f" * 5000 + "\n: 1\n", "key '<integer of about 6021 digits>': unknown key"),
        ("? " + "k" * 2000 + "\n: 1\n", f"key '{'k' * 57}...': unknown key"),
    ]
    for text, needle in cases:
        with pytest.raises(ConfigError) as err:
            thresholds.load(write(tmp_path, text), ALERT_NAMES)
        assert needle in str(err.value)
        assert len(str(err.value)) < 400


# ---- the file ---------------------------------------------------------------------------------

def test_one_mib_is_read_and_one_byte_more_is_not(tmp_path: Path) -> None:
    head = "collectors: {gpu: false}\n"
    exactly = head + "#" * (MAX_FILE_BYTES - len(head) - 1) + "\n"
    assert len(exactly) == MAX_FILE_BYTES
    top = settings_items(load_file(write(tmp_path, exactly), config_type(discover())))
    assert settings_items(top["collectors"])["gpu"] is False
    message = refused(tmp_path, exactly + "\n")
    assert message == f"too large: {MAX_FILE_BYTES + 1} bytes, the limit is 1 MiB"


def test_a_file_that_grows_is_read_only_up_to_the_limit(tmp_path: Path) -> None:
    """stat() said small (as /proc files say 0), the file holds more: never more than the limit
    and one byte is read."""
    path = write(tmp_path, "#" * (3 * MAX_FILE_BYTES))
    small = os.stat_result((0o100644, 0, 0, 1, 0, 0, 10, 0, 0, 0))
    read = []
    real_read = os.read

    def counting_read(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        read.append(len(data))
        return data

    with (mock.patch.object(files.os, "stat", return_value=small),
          mock.patch.object(files.os, "read", counting_read),
          pytest.raises(ConfigError, match=r"^too large: more than 1 MiB, the limit$")):
        read_regular(path)
    assert sum(read) == MAX_FILE_BYTES + 1


def test_only_regular_files(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo")  # nobody writes: a blocking open() would never return
    (tmp_path / "dir").mkdir()
    for path, problem in ((tmp_path / "fifo", "a FIFO"), (tmp_path / "dir", "a directory"),
                          ("/dev/zero", "a character device"), ("/dev/null", "a character device")):
        with pytest.raises(ConfigError, match=rf"^{problem}, not a regular file$"):
            read_yaml(str(path))
    with tempfile.TemporaryDirectory(dir="/tmp") as d, socket.socket(socket.AF_UNIX) as s:
        s.bind(f"{d}/s")  # a short path: AF_UNIX allows 107 bytes
        with pytest.raises(ConfigError, match=r"^a socket, not a regular file$"):
            read_yaml(f"{d}/s")
    with pytest.raises(ConfigError, match=r"^cannot read: No such file or directory$"):
        read_yaml(str(tmp_path / "absent"))
    with pytest.raises(ConfigError, match=r"^cannot read: not a file name"):
        read_yaml("a\0b")


def test_a_file_replaced_by_a_fifo_after_the_check_is_refused(tmp_path: Path) -> None:
    """stat() saw a regular file; what open() got is checked again (and O_NONBLOCK kept it from
    blocking)."""
    os.mkfifo(tmp_path / "fifo")
    regular = os.stat(write(tmp_path, "a: 1\n"))
    with (mock.patch.object(files.os, "stat", return_value=regular),
          pytest.raises(ConfigError, match=r"^a FIFO, not a regular file$")):
        read_yaml(str(tmp_path / "fifo"))


def test_one_line_for_a_control_character(tmp_path: Path) -> None:
    assert refused(tmp_path, "a: 1\nb: \x1f\n") == (
        "invalid YAML at line 2, column 4: unacceptable character #x001f (special characters "
        "are not allowed)")
    assert refused(tmp_path, b"a: \xff\n") == "not UTF-8 text: invalid start byte"


# ---- the document -----------------------------------------------------------------------------

def test_values_up_to_the_limit(tmp_path: Path) -> None:
    """The list and its scalars: MAX_VALUES - 1 scalars fit, one more does not."""
    fits = "[" + ",".join(["1"] * (MAX_VALUES - 1)) + "]"
    assert len(read_yaml(write(tmp_path, fits))) == MAX_VALUES - 1
    message = refused(tmp_path, fits[:-1] + ",1]")
    assert message.startswith(f"more than {MAX_VALUES} values at line 1, column ")


def test_aliases_count_as_all_they_repeat(tmp_path: Path) -> None:
    """Aliases an operator writes load as before; the bomb is refused on its sixth line, long
    before anything walks it."""
    text = ("for: {GpunetPortDown: &slow 15m, GpunetPortFlapping: *slow}\n"
            "infiniband: &ib {link_downed_window: 12h}\n"
            "pfc: {<<: {trust: pcp}, roce_priority: 5}\n")
    t = thresholds.load(write(tmp_path, text), ALERT_NAMES)
    assert t.durations == {"GpunetPortDown": "15m", "GpunetPortFlapping": "15m"}
    assert t.pfc.trust == "pcp" and t.pfc.roce_priority == 5
    # A value 300 values large, repeated 300 times (90,000): inside the budget...
    leaves = ", ".join(["x"] * 299)
    ok = f"a: &a [{leaves}]\nb: [{', '.join(['*a'] * 300)}]\n"
    assert len(read_yaml(write(tmp_path, ok))["b"]) == 300
    # ... and 400 times (120,000): not.
    over = f"a: &a [{leaves}]\nb: [{', '.join(['*a'] * 400)}]\n"
    assert refused(tmp_path, over).startswith(f"more than {MAX_VALUES} values at line 2")
    assert refused(tmp_path, alias_bomb()).startswith(f"more than {MAX_VALUES} values at line 6")
    assert refused(tmp_path, merge_bomb()).startswith(f"more than {MAX_VALUES} values at line 5")


def test_recursive_aliases_are_refused(tmp_path: Path) -> None:
    assert refused(tmp_path, "infiniband: &a {x: *a}\n") == (
        "alias *a inside its own anchor (a recursive structure) at line 1, column 20")
    assert refused(tmp_path, "- &a [1, [2, *a]]\n").startswith("alias *a inside its own anchor")


def test_nesting_up_to_the_limit(tmp_path: Path) -> None:
    """MAX_DEPTH levels of lists, mappings and scalars (the scalar innermost counts)."""
    fits = "[" * (MAX_DEPTH - 1) + "x" + "]" * (MAX_DEPTH - 1)
    assert read_yaml(write(tmp_path, fits)) is not None
    assert refused(tmp_path, "[" + fits + "]") == (
        f"nested more than {MAX_DEPTH} levels deep at line 1, column {MAX_DEPTH + 1}")
    block = "".join("  " * i + "a:\n" for i in range(MAX_DEPTH + 5))
    assert refused(tmp_path, block).startswith(f"nested more than {MAX_DEPTH} levels deep")


def test_yaml_errors_are_cut_short(tmp_path: Path) -> None:
    """PyYAML's own messages repeat what they found: an undefined alias of 100,000 characters."""
    message = refused(tmp_path, "a: *" + "x" * 100_000 + "\n")
    assert message.startswith("invalid YAML at line 1, column 4: found undefined alias 'xxx")
    assert message.endswith("...")


@dataclass(frozen=True)
class Row(Settings):
    v: tuple[str, ...] = setting(default=())


@dataclass(frozen=True)
class Rows(Settings):
    x: tuple[Row, ...] = setting(default=())


def test_validate_never_walks_more_than_the_file_allows(tmp_path: Path) -> None:
    """What read_yaml returns has at most MAX_VALUES values even counted through every alias, so
    validation's walk is bounded; the schema's own defaults are not counted against it."""
    text = f"a: &a {{v: [{', '.join(['v'] * 99)}]}}\nx: [{', '.join(['*a'] * 900)}]\n"
    raw = read_yaml(write(tmp_path, text))
    del raw["a"]
    rows = parse_settings(Rows, raw, "").x
    assert len(rows) == 900 and all(len(row.v) == 99 for row in rows)
