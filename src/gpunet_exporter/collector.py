"""The collector interface every built-in and third-party collector implements.

A collector is a class with a ``name`` and a ``collect()`` that yields freshly built metric
families on every scrape (no module-level gauges, so a vanished device simply stops appearing).
Collectors are found through the entry-point group ``gpunet_exporter.collectors``.
"""

from __future__ import annotations

import abc
import functools
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from gpunet_exporter.config import Settings, parse_settings
from gpunet_exporter.sources import rdma
from gpunet_exporter.sources.sysfs import Root

MetricType = Literal["gauge", "counter"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: the single place its name, type, unit, labels and source are declared.

    Collectors build their families from specs, and docs/metrics.md is generated from them.
    """

    name: str
    type: MetricType
    help: str
    labels: tuple[str, ...]
    unit: str = ""
    source: str = ""

    @functools.cached_property  # a frozen dataclass's __dict__ takes it; asked every scrape
    def full_help(self) -> str:
        parts = [self.help.rstrip(".") + "."]
        if self.source:
            parts.append(f"Source: {self.source}.")
        return " ".join(parts)

    def family(self) -> GaugeMetricFamily | CounterMetricFamily:
        if self.type == "counter":
            return CounterMetricFamily(self.name, self.full_help, labels=self.labels)
        return GaugeMetricFamily(self.name, self.full_help, labels=self.labels)


class LogOnce:
    """Logs a message the first time it is seen and at debug level after that.

    Keeps a repeated identical error (the same bad file on every scrape) from flooding the log.
    The memory it keeps is bounded.
    """

    _LIMIT = 10_000

    def __init__(self, logger: logging.Logger | logging.LoggerAdapter[logging.Logger]) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, level: int, msg: str, *args: object) -> None:
        key = f"{level}:{msg % args if args else msg}"
        with self._lock:
            first = key not in self._seen
            if first:
                if len(self._seen) >= self._LIMIT:
                    self._seen.clear()
                self._seen.add(key)
        self._logger.log(level if first else logging.DEBUG, msg, *args)


@dataclass(frozen=True)
class Privilege:
    """A reading that needs more than an ordinary user's rights; root is never needed, and the
    service's warning for running as root names these capabilities instead
    (daemon/privileges.py)."""

    what: str
    capabilities: tuple[str, ...]
    option: str | None = None  # a boolean setting of the collector that turns this reading off


class _Slot:
    """One shared value of a :class:`Scrape`, built by the first thread that asks for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.built = False
        self.value: Any = None


class Scrape:
    """One scrape, as each collector's ``collect()`` gets it: its deadline and the readings its
    collectors share.

    ``deadline`` (time.monotonic()) is when this collection should have returned: the registry
    sets it a little before the scrape's own deadline, so that the families still make it into
    the scrape; None: no deadline (a one-off reader, a test). A collector waits for nothing
    beyond it (gpunet_exporter.background.Refresher.wait_first).

    :meth:`shared` values are built once, by the first collector of the scrape that asks for one,
    and handed to the others (:meth:`rdma`: one listing of the RDMA devices). Thread-safe:
    collectors run in threads of their own, and one asking for a value another is building waits
    for it instead of building it again. A build that raises is not kept: the next one to ask
    tries again. ``Scrape()`` is a scrape of its own, with no deadline: what a test or a one-off
    reader passes to collect().
    """

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        self._lock = threading.Lock()
        self._slots: dict[Hashable, _Slot] = {}

    def shared(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """``build()``, once for all the collectors of this scrape that ask with ``key``."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
        if slot.built:
            return slot.value  # type: ignore[no-any-return]
        with slot.lock:
            if not slot.built:
                slot.value = build()
                slot.built = True
        return slot.value  # type: ignore[no-any-return]

    def rdma(self, sysfs: Root) -> rdma.Snapshot:
        """The RDMA devices, ports, link layers and netdevs under ``sysfs``, listed once per
        scrape and shared by its collectors (each reads its counters itself)."""
        return self.shared(("rdma", sysfs), lambda: rdma.Snapshot(sysfs))


class Skips:
    """How many values a collector has skipped since it started (CollectorContext.skip): the
    registry reports a collection's count as the difference over it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self) -> None:
        with self._lock:
            self._count += 1

    @property
    def count(self) -> int:
        return self._count


@dataclass(frozen=True)
class CollectorContext:
    """What a collector gets from the core for as long as the process runs: roots, its
    settings, a logger. What changes from one scrape to the next comes with each scrape
    (:class:`Scrape`)."""

    name: str
    sysfs: Root
    procfs: Root
    # The collector's section, an instance of its settings_type (Collector.settings).
    settings: Settings
    logger: logging.LoggerAdapter[logging.Logger]
    log_once: LogOnce
    # Python module implementing the pynvml API (nvidia-ml-py); tests name a stand-in.
    nvml_module: str = "pynvml"
    # False in a one-off reader (the doctor): state kept across restarts (the inventory) is
    # read, never learned into nor written.
    learn: bool = True
    skips: Skips = field(default_factory=Skips, compare=False)

    def skip(self, what: str, reason: object) -> None:
        """Record one value that could not be read or parsed; it costs that value alone."""
        self.skips.add()
        self.log_once(logging.DEBUG, "skipping %s: %s", what, reason)

    @property
    def unreadable(self) -> int:
        """Values skipped since the collector started (a collection's: the difference)."""
        return self.skips.count


def collector_logger(name: str) -> logging.LoggerAdapter[logging.Logger]:
    return logging.LoggerAdapter(logging.getLogger(f"gpunet.{name}"), {"collector": name})


C = TypeVar("C", bound="Collector")


def build_collector(cls: type[C], settings: Settings | Mapping[str, Any] | None = None, *,
                    sysfs: Root | str = "/sys", procfs: Root | str = "/proc",
                    nvml_module: str = "pynvml", learn: bool = True) -> C:
    """``cls`` started as the service, the doctor and the tests start a collector: its context
    (roots, logger) and its ``settings``, an instance of its settings_type or its section as
    the config file gives it (None: every default). Raises ConfigError naming the wrong key of
    the section, or whatever the collector's constructor raises."""
    if not isinstance(settings, Settings):
        settings = parse_settings(cls.settings_type, settings, cls.name)
    logger = collector_logger(cls.name)
    ctx = CollectorContext(cls.name, sysfs if isinstance(sysfs, Root) else Root(sysfs),
                           procfs if isinstance(procfs, Root) else Root(procfs), settings,
                           logger, LogOnce(logger), nvml_module=nvml_module, learn=learn)
    return cls(ctx)


# Why a check the node's hardware calls for could not run (Collector.unknown): the reason label
# of gpunet_check_unknown, and what the landing page, the doctor and the runbook say of it.
UNKNOWN_REASONS: Mapping[str, str] = {
    "library_missing": "its library is not installed or cannot be loaded",
    "driver_not_loaded": "its kernel driver is not loaded",
    "init_failed": "it fails to initialise",
    "tool_missing": "its command-line tool is not installed",
    "tool_failing": "its command-line tool has not succeeded once",
    "privilege_missing": "it needs a capability the exporter was not given",
    "not_supported": "the kernel or the device's driver does not offer it here",
}


class Collector(abc.ABC):
    """Base class for collectors.

    Subclasses set ``name`` (also the flag ``--collector.<name>`` and the metric subsystem),
    ``description``, ``metrics`` (every family it can emit), and optionally:

    - ``settings_type``: its YAML section, a frozen dataclass deriving from
      :class:`~gpunet_exporter.config.Settings` whose fields are declared with
      :func:`~gpunet_exporter.config.setting`. ``self.settings`` is then the section, typed,
      every default filled in (nested maps included); declare ``settings: ThatType`` in the
      class body so that type checkers know it.
    - ``flags`` (extra ``--collector.<name>.<flag>`` options, mapped to keys of its config
      section) and ``privileges`` (readings that want a capability).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    default_enabled: ClassVar[bool] = True
    metrics: ClassVar[tuple[MetricSpec, ...]] = ()
    settings_type: ClassVar[type[Settings]] = Settings  # none
    flags: ClassVar[Mapping[str, tuple[str, str]]] = {}
    privileges: ClassVar[tuple[Privilege, ...]] = ()
    # The checks unknown() may name, each with what goes unchecked while it cannot run: the
    # bounded values of gpunet_check_unknown's check label (GpunetCheckUnknown's runbook).
    unknown_checks: ClassVar[Mapping[str, str]] = {}
    settings: Settings

    def __init__(self, ctx: CollectorContext) -> None:
        if not isinstance(ctx.settings, self.settings_type):
            raise TypeError(f"{type(self).__qualname__}: its settings are a "
                            f"{type(ctx.settings).__qualname__}, not its settings_type "
                            f"{self.settings_type.__qualname__} (build_collector makes them)")
        self.ctx = ctx
        self.settings = ctx.settings

    @abc.abstractmethod
    def collect(self, scrape: Scrape) -> Iterable[Metric]:
        """Yield freshly built metric families for ``scrape`` (its deadline, its shared
        readings). May raise: the core isolates the failure."""

    def device_event(self, subsystem: str, action: str,  # noqa: B027 - optional hook
                     properties: Mapping[str, str]) -> None:
        """A device appeared, went away or changed (daemon/hotplug.py); does nothing by default.

        ``subsystem`` is ``infiniband``, ``net`` or ``pci``; ``action`` is ``add``, ``remove``,
        ``bind``, ``unbind``, ``change`` or ``move``; ``properties`` are the uevent's
        (``INTERFACE``, ``PCI_ID``, ``DEVPATH``, ``DEVPATH_OLD`` for a rename, ...). Called from
        the hot-plug thread, not the scrape: keep it quick (forget a cache, wake a background
        refresh) and thread-safe. An exception is logged and costs only this call. Without
        hot-plug events (no udev, ``--no-hotplug``) it is never called, so ``collect()`` must not
        depend on it.
        """

    def unknown(self) -> Mapping[str, str]:
        """The checks of this collector that the node's hardware calls for but that could not
        run in its last collection: check -> reason, each a word of :data:`UNKNOWN_REASONS`
        (bounded: both become labels of gpunet_check_unknown). Empty, the default: every check
        that applies ran, or none applies (a node without the hardware stays silent). Each
        check is a key of :attr:`unknown_checks`. Called by the registry right after
        collect(), in the same thread."""
        return {}

    def summary(self) -> str:
        """One short line for the landing page beside the collector's status: what it does or
        cannot do now (the probe: "yielded to a job since ..."); "" by default. Called from the
        HTTP thread: read what the last collection or background tick left, nothing more."""
        return ""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stop background work, if any."""


class Families:
    """The families of one collection, created on first use so empty ones are not exposed."""

    def __init__(self) -> None:
        self._fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, spec: MetricSpec, labels: list[str], value: float) -> None:
        self.add_labeled(spec, dict(zip(spec.labels, labels, strict=True)), value)

    def add_labeled(self, spec: MetricSpec, labels: dict[str, str], value: float) -> None:
        """Like add(), with the labels as a dict that many samples of one entity may share
        (it is never modified: a port's hundred counters need not build a hundred dicts)."""
        fam = self._fams.get(spec.name)
        if fam is None:
            fam = self._fams[spec.name] = spec.family()
        fam.samples.append(Sample(spec.name, labels, value))

    def __iter__(self) -> Iterator[Metric]:
        return iter(self._fams.values())
