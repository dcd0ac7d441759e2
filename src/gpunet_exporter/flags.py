"""Command-line parsing shared by gpunet-exporter, its doctor, gpunet-probe and gpunet-rules.

A bad flag or value is one line on stderr, ``PROG: error: WHAT (try `PROG --help`)``, and exit
code 2: argparse's default prints the whole usage first, which for the exporter is some forty
lines of collector flags above the one that says what is wrong.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from gpunet_exporter import __version__


class _Version(argparse.Action):
    """``--version``: the package's version under the command's name (the first word of the
    parser's prog, so ``gpunet-probe run --version`` says ``gpunet-probe ...``), exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS,
                         nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(version_line(parser.prog.split()[0]), file=sys.stdout, flush=True)
        parser.exit(0)


def version_line(prog: str) -> str:
    return f"{prog} {__version__} (python {platform.python_version()})"


class Parser(argparse.ArgumentParser):
    """argparse without abbreviations (``--web.list`` is not ``--web.listen-address``), whose
    errors are a single line with a hint; every parser, subcommands' included, takes
    ``--version``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.add_argument("--version", action=_Version)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (try `{self.prog} --help`)\n")


def positive_seconds(text: str) -> float:
    """A flag value in seconds: ``10``, ``2.5`` or ``2.5s``; positive and finite."""
    try:
        value = float(text.strip().removesuffix("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds such as 10 or 2.5s, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected 0 or more, got {text!r}")
    return value


# What a directory given as --path.sysfs or --path.procfs must hold at least one of: the
# directories the collectors read (sysfs: class/infiniband, class/net, bus/pci/devices and the
# devices/ they link to; procfs: driver/nvidia, sys/kernel, <pid>/ and self/).
SYSFS_DIRS = ("class", "bus", "devices")
PROCFS_DIRS = ("self", "sys", "driver")


def root_problem(path: str, kind: str) -> str | None:
    """Why ``path`` cannot be the ``kind`` ("sysfs" or "procfs") root the collectors read, in a
    few words; None when it can. A typo would otherwise start an exporter that finds no device
    and reports every collector as successful."""
    if not os.path.exists(path):
        return "no such directory"
    if not os.path.isdir(path):
        return "not a directory"
    try:
        entries = set(os.listdir(path))
    except OSError as exc:
        return f"cannot list it: {exc.strerror or exc}"
    wanted = SYSFS_DIRS if kind == "sysfs" else PROCFS_DIRS
    if entries.intersection(wanted) or (kind == "procfs" and any(e.isdigit() for e in entries)):
        return None
    listed = ", ".join(f"{d}/" for d in wanted)
    listed += ", or a process's directory" if kind == "procfs" else ""
    hint = ""
    nested = os.path.join(path, "sys" if kind == "sysfs" else "proc")
    if os.path.isdir(nested) and root_problem(nested, kind) is None:
        hint = f"; did you mean {nested}?"
    return f"not a {kind} tree (it has none of {listed}){hint}"
