"""docs/metrics.md is generated from the code and must not be stale; every metric follows the
naming rules (prefix, base units, _total on counters, no target labels)."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

import pytest

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.infiniband import InfinibandCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.pfc import PfcCollector
from gpunet_exporter.daemon import hotplug
from gpunet_exporter.mixin import configdoc
from gpunet_exporter.mixin.metricsdoc import own_metrics, render
from gpunet_exporter.registry import SCRAPE_METRICS, discover
from gpunet_exporter.sources.ethtool import parse_stats_text
from gpunet_exporter.web.http import SCRAPES_REJECTED
from gpunet_exporter.web.httpserver import CONNECTIONS, CONNECTIONS_REFUSED

from support import sysfs_tree as st
from support.metrics import collect, make_collector, samples_of
from support.paths import FIXTURES, GOLDEN, REPO

ALL_SPECS = [*SCRAPE_METRICS, *hotplug.METRICS, SCRAPES_REJECTED, CONNECTIONS,
             CONNECTIONS_REFUSED, *(s for c in discover().values() for s in c.metrics)]

# HELP is one sentence plus its source (MetricSpec.full_help adds the source): the bound is on the
# sentence, what the value is; a source is a path or a command, as long as it is.
HELP_MAX = 100


def test_metrics_md_is_fresh() -> None:
    committed = (REPO / "docs" / "metrics.md").read_text()
    assert committed == render(), (
        "docs/metrics.md is stale: run `python -m gpunet_exporter.mixin`")


def test_configuration_keys_are_fresh() -> None:
    """The key table of docs/configuration.md is generated from the collectors' settings
    (tests/test_settings.py checks that its defaults are the dataclasses')."""
    text = (REPO / "docs" / "configuration.md").read_text()
    assert configdoc.refresh(text) == text, (
        "docs/configuration.md is stale: run `python -m gpunet_exporter.mixin`")


def test_every_exported_family_is_documented(tmp_path: Path) -> None:
    sysfs = st.build_dgx_h100(tmp_path)
    st.make_switchdev(sysfs)  # device-level hw_counters
    st.make_port_degraded(sysfs)
    documented = {s.name for s in ALL_SPECS}
    doc_text = (REPO / "docs" / "metrics.md").read_text()
    seen = set()
    for cls, cfg in ((InfinibandCollector, {}), (LinkCollector, {
            "ibv_devinfo": {"enabled": False},
            "expected_mtu": [{"mtu": 9000, "rdma_mtu": 4096, "link_layer": "Ethernet"}]})):
        samples, _ = collect(cls, sysfs, cfg)
        for name, _labels in samples:
            family = name  # counters are declared with their _total name
            assert family in documented, f"{family} is exported but not declared"
            assert f"`{family}`" in doc_text
            seen.add(family)
    # pfc: configuration from the OFED sysfs files, counters from the synthetic mlx5 capture.
    netdev = st.make_ofed_qos(sysfs)
    capture = FIXTURES / "synthetic/ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt"
    stats = parse_stats_text(capture.read_text())

    class Capture:
        def read(self, ifname: str):  # type: ignore[no-untyped-def]
            if ifname != netdev:
                raise OSError(19, "No such device")
            return stats

        def close(self) -> None:
            pass

    pfc = make_collector(PfcCollector, sysfs, {"config": {"sources": ["sysfs"]}})
    pfc.reader = Capture()  # type: ignore[attr-defined]
    try:
        for name, _labels in samples_of(list(pfc.collect(Scrape()))):
            assert name in documented and f"`{name}`" in doc_text, name
            seen.add(name)
    finally:
        pfc.close()
    assert len(seen) > 80


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_naming_rules(spec) -> None:  # type: ignore[no-untyped-def]
    assert re.fullmatch(r"gpunet_[a-z0-9_]+", spec.name)
    assert spec.name.endswith("_total") == (spec.type == "counter")
    assert not {"hostname", "host", "instance", "job", "node"} & set(spec.labels)
    assert spec.help and spec.source, "HELP must say what the value is and where it comes from"
    if spec.unit == "bytes":
        assert spec.name.endswith(("_bytes", "_bytes_total")), spec.name
    if spec.unit == "bytes per second":
        assert spec.name.endswith("_bytes_per_second")
    if spec.unit == "seconds":
        assert spec.name.endswith(("_seconds", "_seconds_total"))
    for forbidden in ("_kb", "_mb", "_gb", "_ms", "_percent", "_bits"):
        assert forbidden not in spec.name
    if spec.name.endswith("_info"):
        assert spec.type == "gauge"


def _help_problem(spec) -> str:  # type: ignore[no-untyped-def]
    """Why the spec's HELP is not one short sentence plus its source, or ""."""
    sentence = spec.help.rstrip(".")
    if re.search(r"[.;] |\n", sentence):
        return f"more than one sentence: {sentence!r}"
    if len(sentence) > HELP_MAX:
        return f"{len(sentence)} characters, over {HELP_MAX}: {sentence!r}"
    return ""


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.name)
def test_help_is_one_sentence_plus_source(spec) -> None:  # type: ignore[no-untyped-def]
    """What the value is, in one sentence, and where it comes from; how to read it, edge cases
    and settings are in the prose docs (docs/<topic>.md), where an operator reads on."""
    problem = _help_problem(spec)
    assert not problem, problem


def test_help_lengths() -> None:
    """The median and longest HELP sentence, printed with -s; the bound above is the rule."""
    lengths = sorted(len(s.help) for s in ALL_SPECS)
    median = statistics.median(lengths)
    print(f"HELP sentences: {len(lengths)}, median {median}, max {lengths[-1]} characters")
    assert lengths[-1] <= HELP_MAX


def test_reading_metrics_names_declared_metrics() -> None:
    """docs/reading-metrics.md holds what the HELP sentences leave out; a metric it names by its
    full name must exist, so a rename does not leave the prose behind."""
    declared = {s.name for s in ALL_SPECS}
    declared |= {n.removesuffix("_total") for n in declared}
    text = (REPO / "docs" / "reading-metrics.md").read_text()
    named = set(re.findall(r"`(gpunet_[a-z0-9_]+[a-z0-9])`", text))
    assert named - declared == set()
    # every collector has its section
    for name in discover():
        assert f"## {name} collector" in text, name


def test_every_family_of_the_golden_scrape_is_documented() -> None:
    """The golden end-to-end scrape has every collector, GPUs and topology included, and the
    exporter's own process_* and python_* families."""
    documented = {s.name for s in [*ALL_SPECS, *own_metrics()]}
    doc_text = (REPO / "docs" / "metrics.md").read_text()
    golden = (GOLDEN / "dgx-h100-faults.prom").read_text()
    families = {line.split()[2] for line in golden.splitlines() if line.startswith("# TYPE ")}
    families = {f if f in documented else f + "_total" for f in families}  # counters' TYPE
    assert {f for f in families if f.startswith(("gpunet_gpu_", "gpunet_topology_"))}
    for family in families:
        assert family in documented, f"{family} is exported but not declared"
        assert f"`{family}`" in doc_text, family


def test_readme_counts_the_alerts_the_rules_hold() -> None:
    """The README's alert count is the generated rules file's, not a number written once."""
    from gpunet_exporter.mixin import rules

    readme = (REPO / "README.md").read_text()
    stated = re.search(r"\((\d+) alerts:", readme)
    assert stated, "README.md no longer says how many alerts there are"
    assert int(stated.group(1)) == len(rules.ALERT_NAMES)


def test_readme_prometheus_snippet_fits_the_rules_and_dashboards() -> None:
    """The README's prometheus.yml: the scrape job is the thresholds' default `job` (the one
    the rules select by), it loads the rule file, and its relabelling turns a target's address
    into the node's name, the `instance` the dashboards and the fleet's `peer` expect; the
    runbook paragraph names the default `runbook_url`."""
    import yaml

    from gpunet_exporter.mixin import thresholds

    readme = (REPO / "README.md").read_text()
    found = re.search(r"```yaml\n# prometheus\.yml\n(.*?)```", readme, re.S)
    assert found, "README.md has no prometheus.yml snippet"
    config = yaml.safe_load(found.group(1))
    assert config["rule_files"][0].endswith("gpunet.rules.yml")
    (job,) = config["scrape_configs"]
    t = thresholds.defaults()
    assert job["job_name"] == t.job
    (relabel,) = job["relabel_configs"]
    assert relabel["source_labels"] == ["__address__"] and relabel["target_label"] == "instance"
    targets = job["static_configs"][0]["targets"]
    assert all(a.endswith(":19400") for a in targets)
    # Prometheus anchors the regex and expands $1 as Python's \1.
    pattern = re.compile(relabel["regex"])
    assert [pattern.fullmatch(a).expand(relabel["replacement"].replace("$1", r"\1"))  # type: ignore[union-attr]
            for a in targets] == [a.rpartition(":")[0] for a in targets]
    assert f"`{t.runbook_url}`" in readme and "runbook_url: https://" in readme
