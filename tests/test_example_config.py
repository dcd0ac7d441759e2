"""The shipped example configuration is valid and means what its comments say."""

from __future__ import annotations

from gpunet_exporter.collectors.gpu import GpuCollector
from gpunet_exporter.collectors.pfc import PfcCollector
from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.config import Field, load_file, validate
from gpunet_exporter.options import config_schema
from gpunet_exporter.registry import discover

from support.paths import REPO


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
