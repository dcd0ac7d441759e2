"""The shipped example configuration is valid and means what its comments say."""

from __future__ import annotations

import re

import yaml

from gpunet_exporter.collectors.fabric import FabricSettings
from gpunet_exporter.collectors.gpu import GpuSettings
from gpunet_exporter.collectors.link import MtuRule
from gpunet_exporter.collectors.pfc import PfcSettings
from gpunet_exporter.collectors.probe import ProbeSettings
from gpunet_exporter.config import load_file, parse_settings, settings_fields, settings_items
from gpunet_exporter.options import config_type
from gpunet_exporter.registry import discover

from support.paths import REPO

EXAMPLE = REPO / "examples" / "gpunet.yml"


def test_example_config_loads() -> None:
    cfg = settings_items(load_file(str(REPO / "examples" / "gpunet.yml"), config_type(discover())))
    switches = {k: v for k, v in settings_items(cfg["collectors"]).items() if v is not None}
    assert switches == {"infiniband": True, "link": True, "pfc": True, "gpu": True,
                        "topology": True, "probe": False}
    assert cfg["infiniband"].device_include.search("mlx5_3")
    assert [r.gbps for r in cfg["infiniband"].expected_rate] == [400, 400]
    assert cfg["link"].expected_mtu[0] == MtuRule(link_layer="Ethernet", mtu=9000, rdma_mtu=4096)
    # The pfc section spells out the defaults: it documents them and changes nothing.
    assert cfg["pfc"] == PfcSettings()
    assert cfg["pfc"].config.sources == ("mlnx_qos", "dcb", "sysfs")
    assert cfg["gpu"] == GpuSettings()
    assert cfg["gpu"].counters_interval_seconds == 15
    assert cfg["probe"] == ProbeSettings()


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
    assert set(section) == set(settings_fields(FabricSettings))
    cfg = settings_items(parse_settings(config_type(discover()), {"fabric": section}, ""))
    assert cfg["fabric"] == FabricSettings()
    assert settings_items(cfg["collectors"])["fabric"] is None


def test_example_trees_configs_read_only_the_tree() -> None:
    """Each example tree's gpunet.yml (examples/README.md) is the shipped example where the tree
    is not the host: the collectors that ask the host off, the QoS configuration from the tree
    (the faulty node's mlnx_qos replay, a path from the repository root), the rest unchanged."""
    types = config_type(discover())
    base = settings_items(load_file(str(EXAMPLE), types))
    for tree, sources in (("dgx-h100", ("sysfs",)), ("dgx-h100-faulty", ("mlnx_qos",))):
        cfg = settings_items(load_file(str(REPO / "examples" / tree / "gpunet.yml"), types))
        switches = {k: v for k, v in settings_items(cfg["collectors"]).items() if v is not None}
        assert switches == {"infiniband": True, "link": True, "pfc": True, "gpu": False,
                            "topology": False, "nccl": False, "probe": False}, tree
        assert cfg["infiniband"] == base["infiniband"], tree
        assert cfg["link"].expected_mtu == base["link"].expected_mtu, tree
        assert cfg["link"].interfaces == base["link"].interfaces, tree
        assert not cfg["link"].ibv_devinfo.enabled, tree
        assert cfg["pfc"].config.sources == sources, tree
    replay = cfg["pfc"].config.mlnx_qos_path
    assert replay == "examples/dgx-h100-faulty/mlnx_qos/mlnx_qos"
    assert (REPO / replay).is_file()
