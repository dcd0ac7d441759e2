"""Samples of a scrape, and collectors run in-process on a tree."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from gpunet_exporter.collector import Collector, Scrape, build_collector
from gpunet_exporter.sources.sysfs import Root

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples_of(families: Iterator[Metric] | list[Metric]) -> Samples:
    out: Samples = {}
    for fam in families:
        for s in fam.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate series {key}"
            out[key] = s.value
    return out


def parse(text: str) -> Samples:
    return samples_of(list(text_string_to_metric_families(text)))


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {lbl: v for (n, lbl), v in samples.items() if n == name}


def make_collector(cls: type[Collector], sysfs: Path | str, config: Mapping[str, Any] | None = None,
                   root: Root | None = None, procfs: Path | str = "/proc",
                   nvml_module: str = "pynvml") -> Collector:
    """The collector as the service starts it (build_collector), with ``config`` as its
    section."""
    return build_collector(cls, config, sysfs=root or str(sysfs), procfs=str(procfs),
                           nvml_module=nvml_module)


def collect(cls: type[Collector], sysfs: Path | str, config: Mapping[str, Any] | None = None,
            root: Root | None = None, procfs: Path | str = "/proc",
            nvml_module: str = "pynvml") -> tuple[Samples, int]:
    """Samples of one collection and the number of values the collector skipped."""
    c = make_collector(cls, sysfs, config, root, procfs, nvml_module)
    try:
        return samples_of(list(c.collect(Scrape()))), c.ctx.unreadable
    finally:
        c.close()


def scrape_and_page(c: Collector) -> tuple[Samples, str]:
    """One scrape of ``c`` through the registry (its own series with the scrape's, among them
    gpunet_check_unknown) and the landing page after it; the registry is closed after."""
    from gpunet_exporter.registry import Scraper
    from gpunet_exporter.web.http import _landing

    scraper = Scraper({c.name: c}, 5.0)
    try:
        s = samples_of(list(scraper.collect()))
        return s, _landing(scraper, "/metrics").decode()
    finally:
        scraper.close()
