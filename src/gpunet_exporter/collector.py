"""The collector interface every built-in and third-party collector implements.

A collector is a class with a ``name`` and a ``collect()`` that yields freshly built metric
families on every scrape (no module-level gauges, so a vanished device simply stops appearing).
Collectors are found through the entry-point group ``gpunet_exporter.collectors``.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from gpunet_exporter.config import Field, Settings, parse_settings, settings_fields
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
        if self.unit:
            parts.append(f"Unit: {self.unit}.")
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
    """One value of a :class:`ScrapeScope`, built by the first thread that asks for it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.built = False
        self.value: Any = None


class ScrapeScope:
    """What the collectors of one scrape share: values built once, by the first collector that
    asks for one, and handed to the others of the same scrape (CollectorContext.shared()).

    The Scraper makes one per scrape and runs each collection inside it (:func:`scrape_scope`);
    ``deadline`` (time.monotonic()) is when this scrape's collections should have returned, what
    each collection sees as CollectorContext.deadline (None: no scrape's). Thread-safe:
    collectors run in threads of their own, and one asking for a value another is building waits
    for it instead of building it again. A build that raises is not kept: the next one to ask
    tries again.
    """

    def __init__(self, deadline: float | None = None) -> None:
        self.deadline = deadline
        self._lock = threading.Lock()
        self._slots: dict[Hashable, _Slot] = {}

    def get(self, key: Hashable, build: Callable[[], _T]) -> _T:
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


# The scope of the scrape the current thread collects for; None outside a scrape (a test calling
# collect(), a background refresh thread: threads start with no value of it).
_SCOPE: ContextVar[ScrapeScope | None] = ContextVar("gpunet_scrape_scope", default=None)


@contextlib.contextmanager
def scrape_scope(scope: ScrapeScope | None) -> Iterator[None]:
    """Within the block (in this thread), CollectorContext.shared() uses ``scope``."""
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


@dataclass
class CollectorContext:
    """What a collector gets from the core: roots, its config section, a logger, and the
    deadline of the collection running now."""

    name: str
    sysfs: Root
    procfs: Root
    # The collector's section as validate() returns it, every default filled in; collectors
    # with a settings_type read ``Collector.settings`` (the same, typed) instead.
    config: Mapping[str, Any]
    logger: logging.LoggerAdapter[logging.Logger]
    log_once: LogOnce
    unreadable: int = field(default=0)
    # Python module implementing the pynvml API (nvidia-ml-py); tests name a stand-in.
    nvml_module: str = "pynvml"
    # False in a one-off reader (the doctor): state kept across restarts (the inventory) is
    # read, never learned into nor written.
    learn: bool = True
    # The section as the collector's settings_type, parsed once (options.resolve()); None:
    # the collector parses ``config`` when it starts (a context built by hand, as tests do).
    settings: Settings | None = None
    # time.monotonic() by which this collection should have returned, set by the registry
    # before each collect() (a little before the scrape's own deadline, so that the families
    # still make it into the scrape); None outside a scrape (a test calling collect()). A
    # collector waits for nothing beyond it: gpunet_exporter.background.Refresher.wait_first.
    deadline: float | None = None

    def skip(self, what: str, reason: object) -> None:
        """Record one value that could not be read or parsed; it costs that value alone."""
        self.unreadable += 1
        self.log_once(logging.DEBUG, "skipping %s: %s", what, reason)

    def shared(self, key: Hashable, build: Callable[[], _T]) -> _T:
        """``build()``, once per scrape for all the collectors of that scrape that ask with the
        same ``key``; outside a scrape (a test, a background thread) built anew on each call."""
        scope = _SCOPE.get()
        return build() if scope is None else scope.get(key, build)

    def rdma(self) -> rdma.Snapshot:
        """The RDMA devices, ports, link layers and netdevs under ``sysfs``, listed once per
        scrape and shared by that scrape's collectors (each reads its counters itself)."""
        sysfs = self.sysfs
        return self.shared(("rdma", sysfs), lambda: rdma.Snapshot(sysfs))


def collector_logger(name: str) -> logging.LoggerAdapter[logging.Logger]:
    return logging.LoggerAdapter(logging.getLogger(f"gpunet.{name}"), {"collector": name})


class Collector(abc.ABC):
    """Base class for collectors.

    Subclasses set ``name`` (also the flag ``--collector.<name>`` and the metric subsystem),
    ``description``, ``metrics`` (every family it can emit), and optionally:

    - ``settings_type``: its YAML section, a frozen dataclass deriving from
      :class:`~gpunet_exporter.config.Settings` whose fields are declared with
      :func:`~gpunet_exporter.config.setting`. ``self.settings`` is then the section, typed,
      every default filled in (nested maps included); declare ``settings: ThatType`` in the
      class body so that type checkers know it. ``config_fields`` is derived from it.
    - or ``config_fields``, the section's schema as a mapping of keys to ``Field``s, read as
      a mapping through ``ctx.config`` (the older way, still supported);
    - ``flags`` (extra ``--collector.<name>.<flag>`` options, mapped to keys of its config
      section) and ``privileges`` (readings that want a capability).
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    default_enabled: ClassVar[bool] = True
    metrics: ClassVar[tuple[MetricSpec, ...]] = ()
    settings_type: ClassVar[type[Settings]] = Settings  # none
    config_fields: ClassVar[Mapping[str, Field]] = {}
    flags: ClassVar[Mapping[str, tuple[str, str]]] = {}
    privileges: ClassVar[tuple[Privilege, ...]] = ()
    settings: Settings

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        declared = {"settings_type", "config_fields"} & set(cls.__dict__)
        if len(declared) == 2:
            raise TypeError(f"{cls.__qualname__}: declare settings_type or config_fields, not "
                            "both (config_fields is derived from settings_type)")
        if "settings_type" in declared:
            cls.config_fields = settings_fields(cls.settings_type)
        elif "config_fields" in declared:
            cls.settings_type = Settings  # read through ctx.config

    def __init__(self, ctx: CollectorContext) -> None:
        self.ctx = ctx
        if isinstance(ctx.settings, self.settings_type):
            self.settings = ctx.settings
        elif self.settings_type is Settings:
            self.settings = Settings()
        else:
            self.settings = parse_settings(self.settings_type, ctx.config, ctx.name)

    @abc.abstractmethod
    def collect(self) -> Iterable[Metric]:
        """Yield freshly built metric families. May raise: the core isolates the failure."""

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
