"""Third-party collectors through the entry-point group, and the isolation of failures: an
exception or a hang in one collector costs only that collector's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.exporter import install_plugin
from support.metrics import parse, value
from support.paths import UPSTREAM

SYSFS = str(UPSTREAM / "node_exporter-sysfs-infiniband" / "tree" / "sys")

PLUGIN = '''
import time
from prometheus_client.core import GaugeMetricFamily
from gpunet_exporter.collector import Collector


class Fine(Collector):
    name = "fine"
    def collect(self, scrape):
        g = GaugeMetricFamily("gpunet_fine_value", "A plugin value. Unit: none.")
        g.add_metric([], 42)
        yield g


class Boom(Collector):
    name = "boom"
    def collect(self, scrape):
        yield GaugeMetricFamily("gpunet_boom_partial", "Never exposed.", value=1)
        raise RuntimeError("the hardware caught fire")


class Sleepy(Collector):
    name = "sleepy"
    def collect(self, scrape):
        time.sleep(60)
        return iter(())


class Shy(Collector):
    name = "shy"
    default_enabled = False
    def collect(self, scrape):
        return iter(())


NotACollector = object()
'''


@pytest.fixture
def plugin_path(tmp_path: Path) -> str:
    """An installed third-party distribution: a module plus its dist-info with entry points."""
    return str(install_plugin(tmp_path / "site", "gpunet_plugin_demo", PLUGIN, {
        "fine": "gpunet_plugin_demo:Fine", "boom": "gpunet_plugin_demo:Boom",
        "sleepy": "gpunet_plugin_demo:Sleepy", "shy": "gpunet_plugin_demo:Shy",
        "broken": "gpunet_plugin_demo:NotACollector", "missing": "gpunet_plugin_demo_nope:Thing"}))


def test_plugins_are_isolated(run_exporter, plugin_path: str) -> None:  # type: ignore[no-untyped-def]
    e = run_exporter(f"--path.sysfs={SYSFS}", "--scrape.timeout=1",
                     env={"PYTHONPATH": plugin_path})
    for _ in range(3):  # the hung collection is joined, not restarted, on later scrapes
        s = parse(e.metrics(timeout=30))
        ok = {c: value(s, "gpunet_scrape_collector_success", collector=c)
              for c in ("infiniband", "link", "fine", "boom", "sleepy", "shy")}
        assert ok == {"infiniband": 1, "link": 1, "fine": 1, "boom": 0, "sleepy": 0, "shy": None}
        assert value(s, "gpunet_fine_value") == 42
        assert not [k for k in s if k[0] == "gpunet_boom_partial"]
        assert value(s, "gpunet_infiniband_port_state_id", device="mlx4_0", port="1") == 4
        duration = value(s, "gpunet_scrape_collector_duration_seconds", collector="sleepy")
        assert duration is not None and duration > 0.5  # ran until the scrape deadline
    err = e.stop()
    assert "Traceback" not in err
    # One failure, one line: repeated identical errors are logged once.
    assert err.count("the hardware caught fire") == 1, err
    assert err.count("collector timed out") == 1, err
    assert "is not a Collector subclass" in err and "gpunet_plugin_demo_nope" in err
    assert "collector=boom" in err


def test_disabled_plugin_enabled_by_flag(run_exporter, plugin_path: str) -> None:  # type: ignore[no-untyped-def]
    e = run_exporter(f"--path.sysfs={SYSFS}", "--collector.disable-defaults", "--collector.shy",
                     "--collector.fine", env={"PYTHONPATH": plugin_path})
    s = parse(e.metrics())
    assert value(s, "gpunet_scrape_collector_success", collector="shy") == 1
    assert value(s, "gpunet_scrape_collector_success", collector="fine") == 1
    assert value(s, "gpunet_scrape_collector_success", collector="infiniband") is None
