"""The exporter's flags and configuration, and the collectors they start: shared by the service
(daemon/serve.py) and the doctor (health/doctor.py).

User errors print one line on stderr, exit 2 and never show a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import NoReturn

from gpunet_exporter import DEFAULT_PORT
from gpunet_exporter.collector import Collector, build_collector
from gpunet_exporter.config import (
    Settings,
    load_file,
    make_settings,
    setting,
    settings_fields,
    settings_items,
    with_setting,
)
from gpunet_exporter.errors import ConfigError
from gpunet_exporter.flags import Parser, non_negative_int, positive_seconds, root_problem
from gpunet_exporter.logs import LEVELS
from gpunet_exporter.sources.sysfs import Root
from gpunet_exporter.web.http import DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_REQUESTS

PROG = "gpunet-exporter"
log = logging.getLogger("gpunet.exporter")


def config_type(classes: dict[str, type[Collector]]) -> type[Settings]:
    """The config file's top level, declared from the collectors: ``collectors``, whether each
    one runs (unset: its default), and a section per collector, its settings_type."""
    switches = make_settings("Collectors", {n: (bool | None, setting()) for n in classes})
    return make_settings("ConfigFile", {
        "collectors": (switches, setting("Enable (true) or disable (false) collectors by name",
                                         default=switches())),
        **{name: (cls.settings_type, setting(f"Settings of the {name} collector",
                                             default=cls.settings_type()))
           for name, cls in classes.items()}})


USAGE = ("%(prog)s [FLAGS]          serve /metrics\n"
         "       %(prog)s doctor [FLAGS]   check this node once (doctor --help)")


def build_parser(classes: dict[str, type[Collector]], server: bool = True) -> Parser:
    """The exporter's flags; without ``server``, only those that say what to read and how (the
    doctor's): no listening, TLS, request limits or hot-plug."""
    p = Parser(
        prog=PROG, usage=USAGE if server else None,
        description="Prometheus exporter for GPU-cluster networking "
                    "(InfiniBand/RoCE ports, links, PFC, GPUs, NCCL probes).")
    if server:
        p.add_argument("--web.listen-address", dest="listen_address",
                       default=f":{DEFAULT_PORT}", metavar="ADDR",
                       help=f"address to listen on (default :{DEFAULT_PORT})")
        p.add_argument("--web.telemetry-path", dest="telemetry_path", default="/metrics",
                       metavar="PATH", help="path under which to expose metrics (default /metrics)")
        p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                       help="configuration file for TLS and basic authentication, in the "
                            "Prometheus exporter-toolkit format (docs/security.md; default "
                            "none: plain HTTP)")
        p.add_argument("--web.max-requests", dest="max_requests", type=non_negative_int,
                       default=DEFAULT_MAX_REQUESTS, metavar="N",
                       help="scrapes served at once; one more is answered 503 at once "
                            f"(0: no limit; default {DEFAULT_MAX_REQUESTS})")
        p.add_argument("--web.max-connections", dest="max_connections", type=non_negative_int,
                       default=DEFAULT_MAX_CONNECTIONS, metavar="N",
                       help="HTTP connections open at once; one more is closed as soon as it "
                            f"is accepted (0: no limit; default {DEFAULT_MAX_CONNECTIONS})")
        p.add_argument("--web.disable-exporter-metrics", dest="disable_exporter_metrics",
                       action="store_true",
                       help="leave out the exporter's own process_* and python_* metrics "
                            "(default: exported)")
    p.add_argument("--path.sysfs", dest="sysfs", default="/sys", metavar="DIR",
                   help="sysfs mount point (default /sys)")
    p.add_argument("--path.procfs", dest="procfs", default="/proc", metavar="DIR",
                   help="procfs mount point (default /proc)")
    p.add_argument("--nvml.module", dest="nvml_module", default="pynvml", metavar="MODULE",
                   help="Python module implementing the pynvml API through which the gpu and "
                        "topology collectors reach NVML (default pynvml, from nvidia-ml-py); "
                        "tests name a stand-in here")
    p.add_argument("--config.file", dest="config_file", metavar="FILE",
                   help="YAML configuration file (default none: built-in settings)")
    p.add_argument("--scrape.timeout", dest="scrape_timeout", type=positive_seconds,
                   default=8.0, metavar="SECONDS",
                   help="per-scrape deadline for every collector; a collector that has not "
                        "answered by then reports success 0 (default 8)"
                        + ("; Prometheus' X-Prometheus-Scrape-Timeout-Seconds header "
                           "shortens it" if server else ""))
    if server:
        p.add_argument("--hotplug", action=argparse.BooleanOptionalAction, default=True,
                       help="watch udev/kernel device events (InfiniBand, net, PCI) so "
                            "background values catch up at once when a device comes or goes "
                            "(default: on; without it devices are still re-listed on every "
                            "scrape)")
    p.add_argument("--log.level", dest="log_level", choices=LEVELS, default="info",
                   metavar="LEVEL", help=f"{', '.join(LEVELS)} (default info)")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"),
                   default="logfmt", metavar="FORMAT", help="logfmt or json (default logfmt)")
    p.add_argument("--collector.disable-defaults", dest="disable_defaults", action="store_true",
                   help="disable all collectors that are on by default (default: they run)")
    for name, cls in classes.items():
        default = "enabled" if cls.default_enabled else "disabled"
        g = p.add_argument_group(f"collector {name}", cls.description)
        g.add_argument(f"--collector.{name}", dest=f"enable__{name}", action="store_const",
                       const=True, default=None, help=f"enable the {name} collector ({default} "
                       "by default)")
        g.add_argument(f"--no-collector.{name}", dest=f"enable__{name}", action="store_const",
                       const=False, help=f"disable the {name} collector")
        for flag, (key, help_text) in cls.flags.items():
            value = settings_fields(cls.settings_type)[key].default
            g.add_argument(f"--collector.{name}.{flag}", dest=f"flag__{name}__{key}",
                           metavar="VALUE", help=f"{help_text}; overrides {name}.{key} of the "
                           f"config file (default: {'none' if value is None else value})")
    return p


def server_only_flags(classes: dict[str, type[Collector]]) -> set[str]:
    """The flags of the service that the doctor does not take."""
    def flags(p: argparse.ArgumentParser) -> set[str]:
        return {o for a in p._actions for o in a.option_strings}
    return flags(build_parser(classes)) - flags(build_parser(classes, server=False))


def fail(message: str, code: int = 2, prog: str = PROG) -> NoReturn:
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(code)


def resolve(args: argparse.Namespace, classes: dict[str, type[Collector]],
            config: Settings | None, parser: argparse.ArgumentParser
            ) -> tuple[list[str], dict[str, Settings]]:
    """Which collectors run, and each one's settings: defaults < config file (an instance of
    :func:`config_type`, None: none) < flags."""
    items = settings_items(config) if config is not None else {}
    switches = settings_items(items["collectors"]) if items else {}
    enabled = []
    for name, cls in classes.items():
        on = cls.default_enabled and not args.disable_defaults
        if switches.get(name) is not None:
            on = switches[name]
        flag = getattr(args, f"enable__{name}")
        if flag is not None:
            on = flag
        if on:
            enabled.append(name)
    settings: dict[str, Settings] = {}
    for name, cls in classes.items():
        section = items.get(name) or cls.settings_type()
        for flag, (key, _) in cls.flags.items():
            raw = getattr(args, f"flag__{name}__{key}")
            if raw is None:
                continue
            try:
                section = with_setting(section, key, raw, f"{name}.{key}")
            except ConfigError as exc:
                parser.error(f"argument --collector.{name}.{flag}: {exc}")
        settings[name] = section
    return enabled, settings


def start_collectors(args: argparse.Namespace, classes: dict[str, type[Collector]],
                     parser: argparse.ArgumentParser, learn: bool = True
                     ) -> tuple[dict[str, Collector], dict[str, Settings], list[str]]:
    """The enabled collectors that started (build_collector), from the flags and the config
    file, every collector's settings, and the names of those enabled; exits 2 with one line on
    a bad config file. ``learn`` False (the doctor): collectors read state kept across
    restarts, never write it."""
    for flag, path, kind in (("--path.sysfs", args.sysfs, "sysfs"),
                             ("--path.procfs", args.procfs, "procfs")):
        problem = root_problem(path, kind)
        if problem:
            fail(f"{flag} {path!r}: {problem}", prog=parser.prog)
    config = None
    if args.config_file:
        try:
            config = load_file(args.config_file, config_type(classes))
        except ConfigError as exc:
            fail(str(exc), prog=parser.prog)
    enabled, settings = resolve(args, classes, config, parser)
    sysfs, procfs = Root(args.sysfs), Root(args.procfs)
    collectors: dict[str, Collector] = {}
    for name in enabled:
        try:
            collectors[name] = build_collector(classes[name], settings[name], sysfs=sysfs,
                                               procfs=procfs, nvml_module=args.nvml_module,
                                               learn=learn)
        except Exception as exc:  # one broken collector must not stop the others
            log.error("collector %s could not start: %s", name, exc)
    return collectors, settings, enabled
