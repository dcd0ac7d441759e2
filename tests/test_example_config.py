"""The shipped example configuration is valid and means what its comments say."""

from __future__ import annotations

import re

import yaml

from gpunet_exporter.collectors.fabric import FabricSettings
from gpunet_exporter.collectors.gpu import GpuSettings
from gpunet_exporter.collectors.link import MtuRule
from gpunet_exporter.collectors.nccl import NcclSettings
from gpunet_exporter.collectors.nic import NicSettings
from gpunet_exporter.collectors.pfc import PfcSettings
from gpunet_exporter.collectors.probe import ProbeSettings
from gpunet_exporter.collectors.topology import TopologySettings
from gpunet_exporter.config import (
    Field,
    load_file,
    parse_settings,
    settings_fields,
    settings_items,
)
from gpunet_exporter.options import config_type
from gpunet_exporter.registry import discover

from support.paths import REPO

EXAMPLE = REPO / "examples" / "gpunet.yml"


def test_example_config_loads() -> None:
    cfg = settings_items(load_file(str(REPO / "examples" / "gpunet.yml"), config_type(discover())))
    switches = {k: v for k, v in settings_items(cfg["collectors"]).items() if v is not None}
    assert switches == {"infiniband": True, "link": True, "pfc": True, "gpu": True,
                        "topology": True, "nccl": True, "probe": False, "fabric": False,
                        "nic": True}
    assert switches == {n: c.default_enabled for n, c in discover().items()}
    assert cfg["infiniband"].device_include.search("mlx5_3")
    assert [r.gbps for r in cfg["infiniband"].expected_rate] == [400, 400]
    assert cfg["link"].expected_mtu[0] == MtuRule(link_layer="Ethernet", mtu=9000, rdma_mtu=4096)
    # The pfc section spells out the defaults: it documents them and changes nothing.
    assert cfg["pfc"] == PfcSettings()
    assert cfg["pfc"].config.sources == ("mlnx_qos", "dcb", "sysfs")
    assert cfg["gpu"] == GpuSettings()
    assert cfg["nic"] == NicSettings()  # spelt out: the defaults
    assert cfg["gpu"].counters_interval_seconds == 15
    assert cfg["probe"] == ProbeSettings()
    assert cfg["nccl"] == NcclSettings()
    assert cfg["topology"] == TopologySettings()


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


# A commented-out key: "# key: value" or "# - key: value", at any depth ("  # key:" or
# "#   key:"); uncommenting drops "# " and keeps the indentation on both sides of it.
_COMMENTED_KEY = re.compile(r"^(\s*)# ((?:\s*- )?\s*[A-Za-z_][A-Za-z0-9_]*:(?: |$).*)$")


def uncomment(text: str) -> str:
    """The example with every commented-out key put back; prose comments stay comments."""
    return "\n".join(m.group(1) + m.group(2) if (m := _COMMENTED_KEY.match(line)) else line
                     for line in text.splitlines())


def schema_keys(fields: dict[str, Field], prefix: str = "") -> set[str]:
    """Every key of the config file's schema as a dotted path; ``[]`` for the items of a list
    of maps (``infiniband.expected_rate[].gbps``)."""
    keys = set()
    for key, spec in fields.items():
        path = prefix + key
        keys.add(path)
        if spec.kind == "map":
            keys |= schema_keys(dict(spec.fields), path + ".")
        elif spec.kind == "list" and spec.item is not None and spec.item.kind == "map":
            keys |= schema_keys(dict(spec.item.fields), path + "[].")
    return keys


def example_keys(node: object, prefix: str = "") -> set[str]:
    """The keys a parsed YAML document names, as :func:`schema_keys` spells them."""
    keys: set[str] = set()
    if isinstance(node, dict):
        for key, value in node.items():
            keys.add(prefix + str(key))
            keys |= example_keys(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for item in node:
            if isinstance(item, dict):
                keys |= example_keys(item, prefix.removesuffix(".") + "[].")
    return keys


def missing_keys(text: str) -> set[str]:
    schema = schema_keys(dict(settings_fields(config_type(discover()))))
    return schema - example_keys(yaml.safe_load(uncomment(text)))


def test_example_names_every_key() -> None:
    """The example says it has every key, set or commented out: a key added to a collector's
    settings (or a new collector) fails here until the example shows it. Uncommented, the file
    is still a valid configuration."""
    text = EXAMPLE.read_text(encoding="utf-8")
    assert "Every key the exporter knows is here" in text
    assert missing_keys(text) == set()
    schema = config_type(discover())
    whole = settings_items(parse_settings(schema, yaml.safe_load(uncomment(text)), ""))
    assert whole["fabric"] == FabricSettings()


def test_the_every_key_check_can_fail() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    assert missing_keys(text.replace("  nccl_env_audit: true", "")) == {"topology.nccl_env_audit"}
    assert "nccl.ports" in missing_keys(text.replace("  ports: [28028]", ""))
    assert "infiniband.expected_rate[].hca_type" in missing_keys(
        text.replace("# - hca_type:", "# - hca_typo:"))
    assert uncomment("  # device_exclude: x  # why\n# Flags override this file.\n") == (
        "  device_exclude: x  # why\n# Flags override this file.")


def test_example_trees_configs_read_only_the_tree() -> None:
    """Each example tree's gpunet.yml (examples/README.md) is the shipped example where the tree
    is not the host: the collectors that ask the host off, the QoS configuration from the tree
    (each node's mlnx_qos replay, a path from the repository root), the rest unchanged."""
    types = config_type(discover())
    base = settings_items(load_file(str(EXAMPLE), types))
    for tree in ("dgx-h100", "dgx-h100-faulty"):
        cfg = settings_items(load_file(str(REPO / "examples" / tree / "gpunet.yml"), types))
        switches = {k: v for k, v in settings_items(cfg["collectors"]).items() if v is not None}
        assert switches == {"infiniband": True, "link": True, "pfc": True, "gpu": False,
                            "topology": False, "nccl": False, "probe": False}, tree
        assert cfg["infiniband"] == base["infiniband"], tree
        assert cfg["link"].expected_mtu == base["link"].expected_mtu, tree
        assert cfg["link"].interfaces == base["link"].interfaces, tree
        assert not cfg["link"].ibv_devinfo.enabled, tree
        assert cfg["pfc"].config.sources == ("mlnx_qos",), tree
        replay = cfg["pfc"].config.mlnx_qos_path
        assert replay == f"examples/{tree}/mlnx_qos/mlnx_qos", tree
        assert (REPO / replay).is_file(), tree
