"""The service: serves /metrics until SIGTERM or SIGINT.

Exit codes: 0 clean shutdown, 1 could not start (address in use), 2 bad input (flags, config).
User errors print one line on stderr and never a traceback.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
)

from gpunet_exporter import __version__
from gpunet_exporter.daemon.hotplug import Hotplug
from gpunet_exporter.daemon.privileges import root_warning
from gpunet_exporter.errors import ConfigError
from gpunet_exporter.logs import setup
from gpunet_exporter.options import build_parser, fail, start_collectors
from gpunet_exporter.registry import Scraper, discover
from gpunet_exporter.sources.commands import kill_running
from gpunet_exporter.web.http import RequestLimit, make_app, parse_listen_address, serve
from gpunet_exporter.web.webconfig import WebConfig, load_web_config, wrap

log = logging.getLogger("gpunet.exporter")


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
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

    # From here on SIGTERM and SIGINT stop the service cleanly, even while it starts: the
    # collectors may start background work (the probe's runner) that must not outlive it, and
    # a signal right after the "listening" line must not end the process before its warning.
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    web = WebConfig()
    if args.web_config_file:
        try:
            web = load_web_config(args.web_config_file)
        except ConfigError as exc:
            fail(str(exc))
    collectors, settings, _ = start_collectors(args, classes, parser)

    hotplug = Hotplug(collectors)
    scraper = Scraper(collectors, args.scrape_timeout)
    registry = CollectorRegistry(auto_describe=False)  # what /metrics shows after the scraper's
    registry.register(hotplug)
    limit = RequestLimit(args.max_requests)
    if not args.disable_exporter_metrics:  # node_exporter's process_*, python_*, refusals
        for own in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR, limit):
            registry.register(own)
    app = wrap(make_app(scraper, registry, args.telemetry_path, limit), web)
    if stop.is_set():  # asked to stop while starting: nothing was served
        scraper.close()
        kill_running()
        return
    try:
        httpd = serve(app, host, port, web.ssl_context, args.max_connections, args.max_requests)
    except OSError as exc:
        fail(f"cannot listen on {args.listen_address}: {exc.strerror or exc}", code=1)
    if not args.disable_exporter_metrics:
        registry.register(httpd.listener)

    log.info("gpunet-exporter %s listening on %s%s (%s), collectors: %s", __version__,
             args.listen_address, args.telemetry_path, web.describe(),
             ", ".join(collectors) or "none")
    warning = root_warning(collectors, settings)  # once started: a failed start says one line
    if warning:
        log.warning("%s", warning)
    if args.hotplug:
        hotplug.start()
    stop.wait()
    httpd.shutdown()
    hotplug.stop()
    scraper.close()
    kill_running()  # a tool still hanging in a collector must not outlive the exporter

