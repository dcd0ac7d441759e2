"""The shipped example configuration is valid and means what its comments say."""

from __future__ import annotations

import re

import yaml

from gpunet_exporter.collectors.fabric import FabricCollector, FabricSettings
from gpunet_exporter.collectors.gpu import GpuCollector
from gpunet_exporter.collectors.pfc import PfcCollector
from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.config import Field, load_file, settings_from, validate
from gpunet_exporter.options import config_schema
from gpunet_exporter.registry import discover

from support.paths import REPO

EXAMPLE = REPO / "examples" / "gpunet.yml"


def test_example_config_loads() -> None:
    cfg = load_file(str(REPO / "examples" / "gpunet.yml"), config_schema(discover()))
    assert cfg["collectors"] == {"infiniband": True, "link": True, "pfc": True, "gpu": True,
                                 "topology": True, "probe": False}
    assert cfg["infiniband"]["device_include"].search("mlx5_3")
    assert [r["gbps"] for r in cfg["infiniband"]["expected_rate"]] == [400, 400]
    assert cfg["link"]["expected_mtu"][0] == {"link_layer": "Ethernet", "mtu": 9000,
                                              "rdma_mtu": 4096}
    # The pfc section spells out the defaults: it documents them and changes nothing.
    defaults = validate({}, Field("map", fields=dict(PfcCollector.config_fields)), "pfc")
    assert cfg["pfc"] == defaults
    assert defaults["config"]["sources"] == ["mlnx_qos", "dcb", "sysfs"]
    gpu_defaults = validate({}, Field("map", fields=dict(GpuCollector.config_fields)), "gpu")
    assert cfg["gpu"] == gpu_defaults
    assert gpu_defaults["counters_interval_seconds"] == 15
    probe_defaults = validate({}, Field("map", fields=dict(ProbeCollector.config_fields)),
                              "probe")
    assert cfg["probe"] == probe_defaults


def test_example_fabric_section_is_commented_defaults() -> None:
    """The fabric section is commented out (the collector is off but on one or two hosts per
    fabric); uncommented, it is valid, spells out every setting, and changes nothing."""
    text = EXAMPLE.read_text(encoding="utf-8")
    assert not re.search(r"^fabric:", text, re.M)
    block = re.search(r"^# fabric:.*?(?=^[^#]|\Z)", text, re.M | re.S)
    assert block, "no commented fabric: section"
    lines = [line[2:] for line in block.group(0).splitlines() if line.startswith("# ")]
    uncommented = "\n".join(line for line in lines if line.strip() and
                            not line.lstrip().startswith("#"))
    section = yaml.safe_load(uncommented)["fabric"]
    assert set(section) == set(FabricCollector.config_fields)
    schema = config_schema(discover())
    cfg = validate({"fabric": section}, schema, "")
    assert settings_from(FabricSettings, cfg["fabric"]) == FabricSettings()
    assert "collectors" not in cfg or "fabric" not in cfg["collectors"]
