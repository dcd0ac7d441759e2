"""Hot-plug: device events (uevents) from the kernel or udev, counted and handed to collectors.

A daemon thread listens through pyudev for the ``infiniband``, ``net`` and ``pci`` subsystems,
counts each event in ``gpunet_device_events_total`` and passes it to every collector's
``device_event()`` hook. Sources (udev or the kernel), what each collector does with an event and
what happens without a monitor: docs/configuration.md, "Hot-plug"; design notes:
docs/architecture.md, "daemon".
"""

from __future__ import annotations

import errno
import importlib
import logging
import os
import select
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from prometheus_client.core import Metric

from gpunet_exporter.collector import Collector, MetricSpec

log = logging.getLogger("gpunet.hotplug")

SUBSYSTEMS = ("infiniband", "net", "pci")
ACTIONS = ("add", "remove", "bind", "unbind", "change", "move")
OTHER = "other"  # label value of any subsystem or action outside the lists above
UDEV_CONTROL = "/run/udev/control"  # exists while udevd runs
RECEIVE_BUFFER_BYTES = 8 << 20  # a burst (SR-IOV VFs, a driver reload) must not overflow it
STOP_WAIT_SECONDS = 2.0

# Exported by the service next to the scrape metrics (Hotplug is registered in its registry).
HOTPLUG_MONITORING = MetricSpec(
    "gpunet_hotplug_monitoring", "gauge",
    "1 while the exporter receives hot-plug events (uevents) of RDMA, network and PCI devices",
    (), "boolean",
    "pyudev netlink monitor (udev, or kernel uevents without udevd)")
DEVICE_EVENTS = MetricSpec(
    "gpunet_device_events_total", "counter",
    "Device events received since the exporter started, by subsystem and action",
    ("subsystem", "action"), "events", "udev or kernel uevents (netlink)")
METRICS = (HOTPLUG_MONITORING, DEVICE_EVENTS)



class Event(Protocol):
    """What the dispatcher reads of an event: a pyudev.Device, or a test's stand-in."""

    @property
    def subsystem(self) -> str | None: ...

    @property
    def action(self) -> str | None: ...

    @property
    def properties(self) -> Mapping[str, str]: ...


def udev_source() -> str:
    """``udev`` when udevd runs, else ``kernel``."""
    return "udev" if os.path.exists(UDEV_CONTROL) else "kernel"


class Hotplug:
    """Counts device events and dispatches them to the collectors' ``device_event`` hooks.

    :meth:`dispatch` is the whole event path (tests inject events there); :meth:`start` feeds
    it from a pyudev netlink monitor in a daemon thread.
    """

    def __init__(self, collectors: Mapping[str, Collector]) -> None:
        self.collectors = dict(collectors)
        self.monitoring = False  # a monitor is open and its thread reading
        self.source = ""  # "udev" or "kernel" once started
        self.error = ""  # why events are unavailable
        self._counts: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_w = -1
        self._thread: threading.Thread | None = None

    # -- events --------------------------------------------------------------------------------

    def dispatch(self, event: Event) -> None:
        """Count one event and, when its subsystem and action are known, pass it to every
        collector; a failing hook costs only its own call."""
        subsystem = event.subsystem if event.subsystem in SUBSYSTEMS else OTHER
        action = event.action if event.action in ACTIONS else OTHER
        with self._lock:
            self._counts[(subsystem, action)] = self._counts.get((subsystem, action), 0) + 1
        if OTHER in (subsystem, action):
            return
        properties = dict(event.properties)
        log.debug("device event: %s %s %s", subsystem, action, properties.get("DEVPATH", ""))
        for name, collector in self.collectors.items():
            try:
                collector.device_event(subsystem, action, properties)
            except Exception as exc:
                collector.ctx.log_once(logging.WARNING, "device_event(%s, %s) failed: %s",
                                       subsystem, action, exc)
                log.debug("collector %s: device_event traceback", name, exc_info=True)

    def counts(self) -> dict[tuple[str, str], int]:
        """Events so far by (subsystem, action), both bounded to the known values or "other"."""
        with self._lock:
            return dict(self._counts)

    def collect(self) -> Iterator[Metric]:
        """Whether events arrive, and the events so far (a prometheus_client collector)."""
        monitoring = HOTPLUG_MONITORING.family()
        monitoring.add_metric([], int(self.monitoring))
        yield monitoring
        counts = self.counts()
        if counts:
            events = DEVICE_EVENTS.family()
            for labels, n in sorted(counts.items()):
                events.add_metric(list(labels), n)
            yield events

    # -- monitor -------------------------------------------------------------------------------

    def start(self) -> bool:
        """Open the netlink monitor and start its thread; False (logged once) when unavailable."""
        source = udev_source()
        try:
            pyudev = importlib.import_module("pyudev")
        except ImportError as exc:
            return self._unavailable(f"cannot import pyudev ({exc})")
        try:
            monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source=source)
            for subsystem in SUBSYSTEMS:
                monitor.filter_by(subsystem)
            try:  # SO_RCVBUFFORCE: needs CAP_NET_ADMIN; the default buffer does otherwise
                monitor.set_receive_buffer_size(RECEIVE_BUFFER_BYTES)
            except (OSError, ValueError) as exc:
                log.debug("hot-plug receive buffer left at its default: %s", exc)
            monitor.start()
        except Exception as exc:  # ImportError (no libudev), OSError (EPERM, no netlink), ...
            return self._unavailable(f"cannot open a netlink uevent monitor ({source}): "
                                     f"{_describe(exc)}")
        wake_r, self._wake_w = os.pipe()
        self.source, self.monitoring = source, True
        self._thread = threading.Thread(target=self._run, args=(monitor, wake_r),
                                        name="hotplug", daemon=True)
        self._thread.start()
        log.info("watching hot-plug events of %s (source %s%s)", ", ".join(SUBSYSTEMS), source,
                 "" if source == "udev" else ": udevd is not running")
        return True

    def _unavailable(self, reason: str) -> bool:
        self.error = reason
        log.info("hot-plug events unavailable: %s; devices are re-listed on every scrape",
                 reason)
        return False

    def _run(self, monitor: Any, wake_r: int) -> None:
        poller = select.poll()
        poller.register(monitor.fileno(), select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        try:
            while not self._stop.is_set():
                ready = poller.poll()
                if self._stop.is_set():
                    break
                if any(fd == monitor.fileno() and mask & (select.POLLERR | select.POLLHUP |
                                                          select.POLLNVAL)
                       for fd, mask in ready):
                    raise OSError(errno.EPIPE, "the uevent socket hung up")
                self._drain(monitor)
        except Exception as exc:
            self.monitoring = False
            self.error = _describe(exc)
            log.error("hot-plug events stopped: %s; devices are re-listed on every scrape",
                      self.error)
        finally:
            os.close(wake_r)

    def _drain(self, monitor: Any) -> None:
        while True:
            try:
                device = monitor.poll(timeout=0)
            except OSError as exc:
                if exc.errno != errno.ENOBUFS:
                    raise
                # The kernel dropped events for a full receive buffer; scrapes re-list devices
                # and background refreshes catch up on their intervals.
                log.warning("hot-plug events were lost (receive buffer full)")
                continue
            if device is None:
                return
            self.dispatch(device)

    def stop(self) -> None:
        """Stop the thread (hooks are not called after this returns, within its wait)."""
        self._stop.set()
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            finally:
                os.close(self._wake_w)
                self._wake_w = -1
        if self._thread is not None:
            self._thread.join(STOP_WAIT_SECONDS)
        self.monitoring = False


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
