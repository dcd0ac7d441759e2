"""The options of ``gpunet-probe run``, declared once: :class:`RunOptions`.

Each field of RunOptions is one option: its flag, the flag's help, how the flag's text becomes
the value and back, and its one default. Everything else is derived from it:
- the flags of ``gpunet-probe run`` (and of its workers): :func:`add_arguments`, and the value
  the runner and its workers read, a RunOptions: :func:`from_args`;
- the ``probe:`` keys of the exporter's configuration that are run options: the probe
  collector declares each with :func:`key`, which gives it the option's default, help and
  bounds (an option with a key's ``help`` is one);
- the command line that starts the runner: :func:`argv`, which leaves out every option at its
  default (the runner applies the same one).

A message size thus goes from ``probe.sizes`` (the collector's settings) through ``argv``
(``--sizes 8KiB,1MiB``) to the runner's parser and into the RunOptions its workers read.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpunet_exporter.config import Settings, setting
from gpunet_exporter.probe import results
from gpunet_exporter.sources.sysfs import parse_uint

# -- the flags' values: parsers and their inverses -------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
          "g": 1 << 30, "gib": 1 << 30}
_SHOWN_UNITS = (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))
LAUNCHED_SCOPES = results.NODE_SCOPES


def parse_bytes(text: str) -> int:
    t = text.strip().lower()
    digits = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(digits):]
    n = parse_uint(digits)
    if n is None or unit not in _UNITS or n <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a size such as 8KiB, 1MiB or 65536, got {text!r}")
    return n * _UNITS[unit]


def bytes_text(n: int) -> str:
    """A size as parse_bytes reads it, in the largest unit that divides it: 8KiB, 65540."""
    return next((f"{n // size}{unit}" for unit, size in _SHOWN_UNITS if n % size == 0),
                str(n))


def parse_sizes(text: str) -> list[int]:
    sizes = sorted({parse_bytes(part) for part in text.split(",") if part.strip()})
    if not sizes:
        raise argparse.ArgumentTypeError("expected at least one size")
    bad = [s for s in sizes if s % 4]
    if bad:
        raise argparse.ArgumentTypeError(f"sizes must be multiples of 4 bytes (float32), got {bad}")
    return sizes


def sizes_text(sizes: Iterable[int]) -> str:
    return ",".join(bytes_text(s) for s in sizes)


def parse_scopes(text: str) -> list[str]:
    scopes = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in scopes if s not in LAUNCHED_SCOPES]
    if bad or not scopes:
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of {', '.join(LAUNCHED_SCOPES)}, got {text!r}")
    return [s for s in LAUNCHED_SCOPES if s in scopes]


def parse_ratio(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a ratio from 0 to 1, got {text!r}")
    return v


def _number_text(value: float) -> str:
    """A number as float() reads it back exactly: 60, 2.5, 0.1."""
    if float(value).is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(float(value))


# -- the declaration --------------------------------------------------------------------------

_FLAG = "gpunet_exporter.probe.flag"  # the key of a field's Flag in its dataclass metadata


@dataclass(frozen=True)
class Flag:
    """How a RunOptions field is a flag of ``gpunet-probe run``."""

    flag: str  # --sizes; a bool's flag is the switch away from its default (--no-skip-busy)
    usage: str  # its --help text; "{default}" stands for the default as text() writes it
    parse: Callable[[str], Any] | None  # the flag's text to the value (None: as written)
    text: Callable[[Any], str]  # the value to the flag's text, parse's inverse
    choices: tuple[str, ...]  # the values a str option may take (argparse checks them)
    metavar: str | None
    key: bool  # a probe: key too (it has the key's help)


def option(flag: str, usage: str, default: Any = None, *, parse: Callable[[str], Any] | None
           = None, text: Callable[[Any], str] | None = None, metavar: str | None = None,
           help: str = "", required: bool = False, minimum: float | None = None,
           maximum: float | None = None, choices: tuple[str, ...] = (),
           multiple_of: int | None = None) -> Any:
    """A field of RunOptions: the flag (``flag``, its --help text ``usage``, ``parse`` from the
    flag's text to the value and ``text`` back, by default int, float or str as the field's
    type is, a list's items joined by commas) and, for an option that is a ``probe:`` key too,
    the key's help (``help``, the meaning column of docs/configuration.md) and bounds, as
    config.setting takes them."""
    base = setting(help, default, required=required, minimum=minimum, maximum=maximum,
                   choices=choices, multiple_of=multiple_of)
    meta = {**base.metadata,
            _FLAG: Flag(flag, usage, parse, text or _plain_text, tuple(choices), metavar,
                        bool(help))}
    if required:
        return dataclasses.field(metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _plain_text(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(_plain_text(v) for v in value)
    if isinstance(value, float):
        return _number_text(value)
    return str(value)


@dataclass(frozen=True, kw_only=True)
class RunOptions(Settings):
    """The options of ``gpunet-probe run``, as the runner and its workers read them; in the
    order of its --help. Those with a ``help`` are ``probe:`` keys too (collectors/probe.py)."""

    state_dir: str = option("--state-dir", "where result files are written", required=True)
    backend: str = option(
        "--backend", "nccl on GPUs (default), gloo on CPUs (tests, machines without GPUs)",
        "nccl", choices=("nccl", "gloo"),
        help="`nccl` on GPUs; `gloo` runs the same code on CPUs")
    nprocs: int = option(
        "--nprocs", "local GPUs to probe (default: every visible GPU); with gloo, how many GPUs "
        "to stand in for (default 2)", 0, minimum=0,
        help="local GPUs the runner probes (0: every visible GPU; with gloo, how many GPUs to "
             "stand in for: 2)")
    scopes: tuple[str, ...] = option(
        "--scopes", "what a node's rounds measure: intra (the GPUs' own paths, with two GPUs or "
        "more), net (through the NICs) (default {default})", LAUNCHED_SCOPES, parse=parse_scopes,
        choices=LAUNCHED_SCOPES,
        help="what the node's rounds measure: `intra`, the GPUs among themselves (NVLink/P2P, "
             "SHM; only with two GPUs or more); `net`, the GPUs through the node's NICs (NIC "
             "loopback, below)")
    sizes: tuple[int, ...] = option(
        "--sizes", "all-reduce message sizes (default {default})", (8 << 10, 1 << 20, 64 << 20),
        parse=parse_sizes, text=sizes_text, minimum=4, multiple_of=4,
        help="all-reduce message sizes in bytes (float32: multiples of 4)")
    warmup: int = option("--warmup", "untimed all-reduces per size ({default})", 5, minimum=0,
                         help="untimed all-reduces per size and round")
    iterations: int = option(
        "--iterations", "timed all-reduces per size, each timed on its own (latency), then as "
        "many in a tight loop (bandwidth) ({default})", 20, minimum=1,
        help="timed all-reduces per size and round")
    interval_seconds: float = option(
        "--interval", "seconds from one round's start to the next ({default})", 60.0, minimum=1,
        help="from one round's start to the next")
    rounds: int = option("--rounds", "stop after this many rounds (0: never)", 0)
    memory_cap_bytes: int = option(
        "--memory-cap", "GPU memory the probe may allocate per GPU (default {default})", 1 << 30,
        parse=parse_bytes, text=bytes_text, minimum=1 << 20,
        help="GPU memory in bytes that the probe's PyTorch allocations may use per GPU (the "
             "CUDA context and NCCL's own buffers are outside it)")
    busy_utilization: float = option(
        "--busy-utilization", "a GPU above this utilization (0 to 1) counts as busy with other "
        "work, in cluster mode (a node's own rounds run on idle GPUs) ({default})", 0.5,
        minimum=0,
        help="GPU utilization (0 to 1) above which a GPU is busy with other work: sizes of 1 "
             "MiB and up are skipped while it is (with `skip_busy`); cluster-mode rounds only, "
             "since the node's own run on idle GPUs")
    busy_min_size: int = option(
        "--busy-min-size", "sizes from this one up are skipped while a GPU is busy ({default})",
        1 << 20, parse=parse_bytes, text=bytes_text)
    skip_busy: bool = option(
        "--no-skip-busy", "measure every size even while GPUs are busy with other work "
        "(default: skip them)", True,
        help="skip sizes of 1 MiB and up while a GPU is busy: above `busy_utilization`, or "
             "running a process that is not the probe's")
    timeout_seconds: float = option(
        "--timeout", "seconds a group's start or round may take before it is killed "
        "({default})", 120.0, minimum=1,
        help="a scope's start or round taking longer has that scope's workers killed by the "
             "runner, and a runner stuck that long plus a grace period (the timeout, at most "
             "10 s) has its whole process group killed by the exporter")
    scope: str = option("--scope", "auto: inter when started by torchrun or srun (default "
                        "{default})", "auto", choices=("auto", *results.SCOPES))
    straggler_min_ratio: float = option(
        "--straggler-min-ratio", "the late rank is named when the others wait at least this "
        "share of their collective time for it (default {default})", 0.2, parse=parse_ratio,
        minimum=0, maximum=1,
        help="the late rank is named (`gpunet_probe_straggler_info`) when the other ranks wait "
             "at least this share of their collective time for it")
    sysfs: str = option("--path.sysfs", "sysfs mount point, for the RDMA ports and their rates "
                        "(default {default})", "/sys", metavar="SYSFS")
    pin_hca: bool = option(
        "--no-pin-hca", "net scope: let NCCL choose the HCAs instead of pinning each rank to the "
        "ACTIVE RDMA port nearest its GPU (default: pin)", True,
        help="net scope: pin each rank to the ACTIVE RDMA port nearest its GPU with "
             "`NCCL_IB_HCA`, so that every NIC is exercised (an `NCCL_IB_HCA` in the exporter's "
             "environment wins)")


_FIELDS = {f.name: f for f in dataclasses.fields(RunOptions)}
_TYPES = typing.get_type_hints(RunOptions)


def _flag(f: dataclasses.Field[Any]) -> Flag:
    flag: Flag = f.metadata[_FLAG]
    return flag


def _parser(f: dataclasses.Field[Any], flag: Flag) -> Callable[[str], Any] | None:
    if flag.parse is not None:
        return flag.parse
    kind = _TYPES[f.name]
    return kind if kind in (int, float) else None


# -- what is derived from it ------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``gpunet-probe run``, one per RunOptions field, its destination the field's
    name."""
    for f in dataclasses.fields(RunOptions):
        flag = _flag(f)
        usage = flag.usage
        if f.default is not dataclasses.MISSING:
            usage = usage.replace("{default}", flag.text(f.default))
        if _TYPES[f.name] is bool:  # the switch away from the default
            p.add_argument(flag.flag, dest=f.name, help=usage,
                           action="store_false" if f.default else "store_true")
            continue
        kwargs: dict[str, Any] = {"dest": f.name, "help": usage, "metavar": flag.metavar or
                                  flag.flag.lstrip("-").upper().replace("-", "_")}
        if f.default is dataclasses.MISSING:
            kwargs["required"] = True
        else:
            kwargs["default"] = f.default
        if _TYPES[f.name] is str and flag.choices:
            kwargs["choices"], kwargs["metavar"] = flag.choices, None
        parse = _parser(f, flag)
        if parse is not None:
            kwargs["type"] = parse
        p.add_argument(flag.flag, **kwargs)


def from_args(args: argparse.Namespace) -> RunOptions:
    """The RunOptions that add_arguments' flags parsed into ``args`` (a list as a tuple)."""
    values: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(args, name)
        values[name] = tuple(value) if isinstance(value, list) else value
    return RunOptions(**values)


def argv(options: RunOptions) -> list[str]:
    """The arguments of ``gpunet-probe run`` that give ``options``: an option at its default is
    left out (the runner's default is the same), a switch (``--no-skip-busy``) stands for the
    value it sets, a list is joined with commas."""
    out: list[str] = []
    for f in dataclasses.fields(RunOptions):
        value = getattr(options, f.name)
        if f.default is not dataclasses.MISSING and value == f.default:
            continue
        flag = _flag(f)
        out += [flag.flag] if _TYPES[f.name] is bool else [flag.flag, flag.text(value)]
    return out


def default(name: str) -> Any:
    """The default of the option ``name`` (a RunOptions field)."""
    return _FIELDS[name].default


def key(name: str) -> Any:
    """A ``probe:`` key that is the run option ``name``: a field of the collector's settings
    with the option's default, help and bounds (the field's name must be ``name``, its type the
    option's)."""
    f = _FIELDS[name]
    if not _flag(f).key:
        raise TypeError(f"run option {name} is no probe: key (it has no key help)")
    return dataclasses.field(default=f.default, metadata=f.metadata)


def keys(settings: Settings) -> dict[str, Any]:
    """The values of the run options among the fields of ``settings`` (declared with key)."""
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if _FLAG in f.metadata}
