"""Test helpers: run a collector in-process on a tree, or the installed exporter over HTTP."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))

from gpunet_exporter.collector import Collector, CollectorContext, LogOnce, collector_logger
from gpunet_exporter.config import Field, settings_from, validate
from gpunet_exporter.sources.sysfs import Root

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"  # every fixture, with its SOURCES.md
UPSTREAM = FIXTURES / "upstream"

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
    """The collector as options.start_collectors() builds it, with ``config`` as its section."""
    section = validate(dict(config or {}), Field("map", fields=dict(cls.config_fields)), cls.name)
    logger = collector_logger(cls.name)
    ctx = CollectorContext(cls.name, root or Root(str(sysfs)), Root(str(procfs)), section, logger,
                           LogOnce(logger), nvml_module=nvml_module,
                           settings=settings_from(cls.settings_type, section))
    return cls(ctx)


def collect(cls: type[Collector], sysfs: Path | str, config: Mapping[str, Any] | None = None,
            root: Root | None = None, procfs: Path | str = "/proc",
            nvml_module: str = "pynvml") -> tuple[Samples, int]:
    """Samples of one collection and the number of values the collector skipped."""
    c = make_collector(cls, sysfs, config, root, procfs, nvml_module)
    try:
        return samples_of(list(c.collect())), c.ctx.unreadable
    finally:
        c.close()


def install_plugin(site: Path, module: str, source: str, entry_points: Mapping[str, str]) -> Path:
    """A third-party distribution installed in ``site`` (a folder for PYTHONPATH): the module
    ``module`` with ``source``, and a dist-info whose entry points register each name ->
    "module:attribute" of ``entry_points`` as a collector."""
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[gpunet_exporter.collectors]\n" + "".join(
        f"{name} = {target}\n" for name, target in entry_points.items()))
    return site


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exporter_binary() -> str:
    exe = shutil.which("gpunet-exporter")
    assert exe, "the gpunet-exporter console script is not installed (pip install .)"
    return exe


class Exporter:
    """The installed exporter on a free port. ``scheme``, ``verify``, ``auth`` and ``cert`` are
    what requests needs to reach it when --web.config.file asks for TLS or basic auth."""

    def __init__(self, args: list[str], env: Mapping[str, str] | None = None,
                 scheme: str = "http", verify: str | bool = True,
                 auth: tuple[str, str] | None = None,
                 cert: str | tuple[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.requests_kw: dict[str, Any] = {"verify": verify, "auth": auth, "cert": cert}
        self.proc = subprocess.Popen(
            [exporter_binary(), f"--web.listen-address=127.0.0.1:{self.port}", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"exporter exited {self.proc.returncode}: "
                                     f"{self.proc.stderr.read() if self.proc.stderr else ''}")
            try:
                if requests.get(f"{self.url}/-/healthy", timeout=1,
                                **self.requests_kw).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("exporter did not start within 20 s")
            time.sleep(0.05)

    def metrics(self, **kw: Any) -> str:
        r = requests.get(f"{self.url}/metrics", **{"timeout": 30, **self.requests_kw, **kw})
        r.raise_for_status()
        return r.text

    def stop(self) -> str:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


@pytest.fixture
def run_exporter() -> Iterator[Any]:
    started: list[Exporter] = []

    def start(*args: str, env: Mapping[str, str] | None = None, **kw: Any) -> Exporter:
        e = Exporter(list(args), env, **kw)
        started.append(e)
        return e

    yield start
    for e in started:
        if e.proc.poll() is None:
            e.stop()


@pytest.fixture(autouse=True)
def _quiet_logs() -> None:
    logging.getLogger("gpunet").setLevel(logging.WARNING)
