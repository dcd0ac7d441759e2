"""Command line: node_exporter-style flags, config loading, start-up and shutdown.

Exit codes: 0 clean shutdown, 1 could not start (address in use), 2 bad input (flags, config).
User errors print one line on stderr and never a traceback.
"""

from __future__ import annotations

import argparse
import logging
import platform
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

from prometheus_client import CollectorRegistry

from exporter import DEFAULT_PORT, __version__
from exporter.background import kill_running
from exporter.collector import Collector, CollectorContext, LogOnce, collector_logger
from exporter.config import ConfigError, Field, load_file, validate
from exporter.hotplug import Hotplug
from exporter.http import make_app, parse_listen_address, serve
from exporter.logs import LEVELS, setup
from exporter.privileges import root_warning
from exporter.registry import Scraper, discover
from exporter.sysfs import Root
from exporter.webconfig import WebConfig, load_web_config, wrap

PROG = "gpunet-exporter"
log = logging.getLogger("gpunet.exporter")


def config_schema(classes: dict[str, type[Collector]]) -> Field:
    fields: dict[str, Field] = {
        "collectors": Field("map", "Enable (true) or disable (false) collectors by name",
                            fields={n: Field("bool") for n in classes}),
    }
    for name, cls in classes.items():
        fields[name] = Field("map", f"Settings of the {name} collector",
                             fields=dict(cls.config_fields))
    return Field("map", fields=fields)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text.rstrip("s"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected seconds such as 10 or 2.5s, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def build_parser(classes: dict[str, type[Collector]]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Prometheus exporter for GPU-cluster networking "
                    "(InfiniBand/RoCE ports, links, PFC, GPUs, NCCL probes).")
    p.add_argument("--version", action="version",
                   version=f"{PROG} {__version__} (python {platform.python_version()})")
    p.add_argument("--web.listen-address", dest="listen_address", default=f":{DEFAULT_PORT}",
                   metavar="ADDR", help=f"address to listen on (default :{DEFAULT_PORT})")
    p.add_argument("--web.telemetry-path", dest="telemetry_path", default="/metrics",
                   metavar="PATH", help="path under which to expose metrics (default /metrics)")
    p.add_argument("--web.config.file", dest="web_config_file", metavar="FILE",
                   help="configuration file for TLS and basic authentication, in the "
                        "Prometheus exporter-toolkit format (docs/security.md)")
    p.add_argument("--path.sysfs", dest="sysfs", default="/sys", metavar="DIR",
                   help="sysfs mount point (default /sys)")
    p.add_argument("--path.procfs", dest="procfs", default="/proc", metavar="DIR",
                   help="procfs mount point (default /proc)")
    p.add_argument("--nvml.module", dest="nvml_module", default="pynvml", metavar="MODULE",
                   help="Python module implementing the pynvml API through which the gpu and "
                        "topology collectors reach NVML (default pynvml, from nvidia-ml-py); "
                        "tests name a stand-in here")
    p.add_argument("--config.file", dest="config_file", metavar="FILE",
                   help="YAML configuration file (optional)")
    p.add_argument("--scrape.timeout", dest="scrape_timeout", type=_positive_seconds,
                   default=8.0, metavar="SECONDS",
                   help="per-scrape deadline for every collector; a collector that has not "
                        "answered by then reports success 0 (default 8); Prometheus' "
                        "X-Prometheus-Scrape-Timeout-Seconds header shortens it")
    p.add_argument("--hotplug", action=argparse.BooleanOptionalAction, default=True,
                   help="watch udev/kernel device events (InfiniBand, net, PCI) so background "
                        "values catch up at once when a device comes or goes (default on; "
                        "without it devices are still re-listed on every scrape)")
    p.add_argument("--log.level", dest="log_level", choices=LEVELS, default="info")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"),
                   default="logfmt")
    p.add_argument("--collector.disable-defaults", dest="disable_defaults", action="store_true",
                   help="disable all collectors that are on by default")
    for name, cls in classes.items():
        default = "enabled" if cls.default_enabled else "disabled"
        g = p.add_argument_group(f"collector {name}", cls.description)
        g.add_argument(f"--collector.{name}", dest=f"enable__{name}", action="store_const",
                       const=True, default=None, help=f"enable the {name} collector ({default} "
                       "by default)")
        g.add_argument(f"--no-collector.{name}", dest=f"enable__{name}", action="store_const",
                       const=False, help=f"disable the {name} collector")
        for flag, (key, help_text) in cls.flags.items():
            g.add_argument(f"--collector.{name}.{flag}", dest=f"flag__{name}__{key}",
                           metavar="VALUE", help=help_text)
    return p


def _fail(message: str, code: int = 2) -> NoReturn:
    print(f"{PROG}: {message}", file=sys.stderr)
    raise SystemExit(code)


def resolve(args: argparse.Namespace, classes: dict[str, type[Collector]],
            config: dict[str, Any], parser: argparse.ArgumentParser
            ) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Which collectors run, and each one's settings: defaults < config file < flags."""
    enabled = []
    for name, cls in classes.items():
        on = cls.default_enabled and not args.disable_defaults
        on = config.get("collectors", {}).get(name, on)
        flag = getattr(args, f"enable__{name}")
        if flag is not None:
            on = flag
        if on:
            enabled.append(name)
    sections: dict[str, dict[str, Any]] = {}
    for name, cls in classes.items():
        section = dict(validate({}, Field("map", fields=dict(cls.config_fields)), name))
        section.update(config.get(name, {}))
        for flag, (key, _) in cls.flags.items():
            raw = getattr(args, f"flag__{name}__{key}")
            if raw is None:
                continue
            try:
                section[key] = validate(raw, cls.config_fields[key], f"{name}.{key}")
            except ConfigError as exc:
                parser.error(f"argument --collector.{name}.{flag}: {exc}")
        sections[name] = section
    return enabled, sections


def start_collectors(args: argparse.Namespace, classes: dict[str, type[Collector]],
                     parser: argparse.ArgumentParser
                     ) -> tuple[dict[str, Collector], dict[str, dict[str, Any]], list[str]]:
    """The enabled collectors that started, built from the flags and the config file, every
    collector's settings, and the names of those enabled; exits 2 with one line on a bad config
    file."""
    config: dict[str, Any] = {}
    if args.config_file:
        try:
            config = load_file(args.config_file, config_schema(classes))
        except ConfigError as exc:
            _fail(str(exc))
    enabled, sections = resolve(args, classes, config, parser)
    sysfs, procfs = Root(args.sysfs), Root(args.procfs)
    collectors: dict[str, Collector] = {}
    for name in enabled:
        logger = collector_logger(name)
        ctx = CollectorContext(name, sysfs, procfs, sections[name], logger, LogOnce(logger),
                               nvml_module=args.nvml_module)
        try:
            collectors[name] = classes[name](ctx)
        except Exception as exc:  # one broken collector must not stop the others
            log.error("collector %s could not start: %s", name, exc)
    return collectors, sections, enabled


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        from exporter import doctor  # only the subcommand needs it
        raise SystemExit(doctor.main(argv[1:]))
    setup("info", "logfmt")  # until the flags are parsed
    classes = discover()
    parser = build_parser(classes)
    parser.epilog = ("`gpunet-exporter doctor --help`: check this node once with the alert "
                     "thresholds (docs/doctor.md).")
    args = parser.parse_args(argv)
    if not args.telemetry_path.startswith("/") or args.telemetry_path in ("/", "/-/healthy"):
        parser.error(f"argument --web.telemetry-path: expected a path such as /metrics other "
                     f"than / and /-/healthy, got {args.telemetry_path!r}")
    try:
        host, port = parse_listen_address(args.listen_address)
    except ValueError as exc:
        parser.error(str(exc))
    setup(args.log_level, args.log_format)

    web = WebConfig()
    if args.web_config_file:
        try:
            web = load_web_config(args.web_config_file)
        except ConfigError as exc:
            _fail(str(exc))
    collectors, sections, _ = start_collectors(args, classes, parser)

    hotplug = Hotplug(collectors)
    scraper = Scraper(collectors, args.scrape_timeout, hotplug)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(scraper)
    app = wrap(make_app(scraper, registry, args.telemetry_path), web)
    try:
        httpd, _ = serve(app, host, port, web.ssl_context)
    except OSError as exc:
        _fail(f"cannot listen on {args.listen_address}: {exc.strerror or exc}", code=1)

    log.info("gpunet-exporter %s listening on %s%s (%s), collectors: %s", __version__,
             args.listen_address, args.telemetry_path, web.describe(),
             ", ".join(collectors) or "none")
    warning = root_warning(collectors, sections)  # once started: a failed start says one line
    if warning:
        log.warning("%s", warning)
    if args.hotplug:
        hotplug.start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    httpd.shutdown()
    hotplug.stop()
    scraper.close()
    kill_running()  # a tool still hanging in a collector must not outlive the exporter


if __name__ == "__main__":
    main()
