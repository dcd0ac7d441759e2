"""gpu collector against the NVML stand-in (tests/support/fake_nvml.py) replaying the real 2 x H200
readings of tests/fixtures/nvml, and against the real nvidia-ml-py without a driver."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.gpu import XID_LABELS_PER_GPU, GpuCollector, XidWatcher
from gpunet_exporter.registry import Scraper
from gpunet_exporter.sources import nvml

from support import fake_nvml
from support.metrics import (
    Samples,
    collect,
    make_collector,
    parse,
    samples_of,
    scrape_and_page,
    series,
    value,
)
from support.wait import wait_for

CAPTURE = fake_nvml.h200x2()
UUID0 = CAPTURE["devices"][0]["nvmlDeviceGetUUID"]["ok"]
UUID1 = CAPTURE["devices"][1]["nvmlDeviceGetUUID"]["ok"]
NO_BACKGROUND = {"counters_interval_seconds": 3600}
LAST_SUCCESS = "gpunet_gpu_counters_last_success_timestamp_seconds"


@pytest.fixture(autouse=True)
def fresh_nvml() -> Iterator[None]:
    """Every test starts with the real capture and a new NVML session."""
    fake_nvml.load(fake_nvml.h200x2())
    nvml.forget(fake_nvml.MODULE)
    yield
    nvml.forget(fake_nvml.MODULE)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    """A sysfs with the two H200s' PCI functions (numa_node as the VM printed it)."""
    for bdf in ("0000:00:06.0", "0000:00:07.0"):
        d = tmp_path / "sys" / "bus" / "pci" / "devices" / bdf
        d.mkdir(parents=True)
        (d / "numa_node").write_text("-1\n")
    return tmp_path / "sys"


class Gpu:
    """A collector kept across scrapes (the background thread and XID watcher live on)."""

    def __init__(self, sysfs: Path, config: dict[str, Any] | None = None,
                 procfs: Path | str = "/proc") -> None:
        self.c = make_collector(GpuCollector, sysfs, {**NO_BACKGROUND, **(config or {})},
                                procfs=procfs, nvml_module=fake_nvml.MODULE)

    def scrape(self) -> Samples:
        """One scrape's samples; ``unreadable``: the values it skipped."""
        before = self.c.ctx.unreadable
        s = samples_of(list(self.c.collect(Scrape())))
        self.unreadable = self.c.ctx.unreadable - before
        return s

    def close(self) -> None:
        self.c.close()


@pytest.fixture
def gpu(sysfs: Path) -> Iterator[Gpu]:
    g = Gpu(sysfs)
    yield g
    g.close()


def scrape_once(sysfs: Path, scenario: dict[str, Any] | None = None) -> Samples:
    """One scrape of a fresh collector, on a scenario (default: the capture as it is)."""
    if scenario is not None:
        fake_nvml.load(scenario)
    g = Gpu(sysfs)
    try:
        return g.scrape()
    finally:
        g.close()


def test_capture_values_exactly(gpu: Gpu) -> None:
    s = gpu.scrape()
    assert gpu.unreadable == 0
    for i, (uuid, bdf) in enumerate(((UUID0, "0000:00:06.0"), (UUID1, "0000:00:07.0"))):
        dev, g = CAPTURE["devices"][i], str(i)
        info = {"gpu": g, "uuid": uuid, "name": "NVIDIA H200", "pci_address": bdf,
                "driver_version": "580.159.04", "numa_node": "-1"}
        assert series(s, "gpunet_gpu_info")[frozenset(info.items())] == 1
        mem = dev["nvmlDeviceGetMemoryInfo"]["ok"]
        assert value(s, "gpunet_gpu_memory_used_bytes", gpu=g) == mem["used"]
        assert value(s, "gpunet_gpu_memory_total_bytes", gpu=g) == mem["total"] == 150754820096
        assert value(s, "gpunet_gpu_utilization_ratio", gpu=g) == 0
        assert value(s, "gpunet_gpu_pcie_link_generation", gpu=g) == 5
        assert value(s, "gpunet_gpu_pcie_link_max_width", gpu=g) == 16
        assert value(s, "gpunet_gpu_pcie_link_degraded", gpu=g) == 0
        assert value(s, "gpunet_gpu_compute_processes", gpu=g) == 0
        assert value(s, "gpunet_gpu_lost", gpu=g) == 0
    assert value(s, "gpunet_gpu_nvml_up") == 1
    assert value(s, "gpunet_gpu_missing") == 0


def test_memory_v2_as_nvidia_smi_shows_it(sysfs: Path) -> None:
    """Drivers with nvmlDeviceGetMemoryInfo_v2 report the driver's reservation apart from
    `used` (values read on an idle H200, driver 580, docs/gpu.md); nvidia-smi shows v2 `used`.
    The capture recorded only v1, which the stand-in answers for drivers without v2."""
    scenario = fake_nvml.h200x2()
    scenario["devices"][1]["nvmlDeviceGetMemoryInfo_v2"] = {"ok": {
        "version": 0x02000028, "total": 150754820096, "reserved": 644939776,
        "free": 150109880320, "used": 0}}
    s = scrape_once(sysfs, scenario)
    assert value(s, "gpunet_gpu_memory_used_bytes", gpu="1") == 0
    assert value(s, "gpunet_gpu_memory_reserved_bytes", gpu="1") == 644939776
    assert value(s, "gpunet_gpu_memory_used_bytes", gpu="0") == 644939776  # v1: reserved in
    assert value(s, "gpunet_gpu_memory_reserved_bytes", gpu="0") is None


def test_numa_node_falls_back_to_sysfs(sysfs: Path) -> None:
    """NumaNodeId is NotSupported in the capture's VM: the kernel's numa_node is used."""
    (sysfs / "bus/pci/devices/0000:00:07.0/numa_node").write_text("1\n")
    s = scrape_once(sysfs)
    numa = {dict(lbl)["gpu"]: dict(lbl)["numa_node"] for lbl in series(s, "gpunet_gpu_info")}
    assert numa == {"0": "-1", "1": "1"}


def test_nvlink_links_states_and_errors(gpu: Gpu) -> None:
    s = gpu.scrape()
    links = {dict(lbl)["link"] for lbl in series(s, "gpunet_gpu_nvlink_active")
             if dict(lbl)["gpu"] == "0"}
    assert links == {str(i) for i in range(18)}  # link 18 answered InvalidArgument
    assert all(v == 1 for v in series(s, "gpunet_gpu_nvlink_active").values())
    wait_for(lambda: value(gpu.scrape(), "gpunet_gpu_counters_refresh_success", gpu="1") == 1)
    s = gpu.scrape()
    for i in (0, 1):
        for link in (0, 9, 17):
            rec = CAPTURE["devices"][i]["nvlink"][str(link)]
            for kind, name in (("crc_data", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
                               ("ecc_data", "NVML_NVLINK_ERROR_DL_ECC_DATA"),
                               ("replay", "NVML_NVLINK_ERROR_DL_REPLAY")):
                assert value(s, "gpunet_gpu_nvlink_errors_total", gpu=str(i), link=str(link),
                             type=kind) == rec[name]["ok"]
    assert len(series(s, "gpunet_gpu_nvlink_errors_total")) == 2 * 18 * 5


def with_fabric(*changes: dict[str, Any]) -> dict[str, Any]:
    """The capture's two GPUs answering the fabric call as the 4 x H100 machine's first two
    did (tests/fixtures/nvml/fabric_h100x4.json: completed, status 0, every health field and
    the summary not reported), each with ``changes`` applied."""
    scenario = fake_nvml.h200x2()
    for dev, fabric, change in zip(scenario["devices"], fake_nvml.fabric_h100x4(),
                                   changes or ({}, {}), strict=False):
        dev["fabric"] = {**fabric, **change}
    return scenario


def test_fabric_as_recorded_on_h100s(sysfs: Path) -> None:
    s = scrape_once(sysfs, with_fabric())
    for g in ("0", "1"):
        states = {dict(lbl)["state"]: v for lbl, v in series(s, "gpunet_gpu_fabric_state").items()
                  if dict(lbl)["gpu"] == g}
        assert states == {"not_supported": 0, "not_started": 0, "in_progress": 0,
                          "completed": 1}
        assert value(s, "gpunet_gpu_fabric_status_code", gpu=g) == 0
        assert value(s, "gpunet_gpu_fabric_info", gpu=g, clique_id="0",
                     cluster_uuid="00000000-0000-0000-0000-000000000000") == 1
    # healthMask 0 and healthSummary 0: the driver reports no health check, none is exported
    assert not series(s, "gpunet_gpu_fabric_health")
    assert not series(s, "gpunet_gpu_fabric_health_summary")


def test_fabric_not_ready_unhealthy_and_old_drivers(sysfs: Path) -> None:
    """GPU 0 still registering with the Fabric Manager; GPU 1 registered but its health mask
    says degraded bandwidth (1 << 0), route recovery passing (2 << 2) and an incorrect
    configuration (insufficient NVLinks, 5 << 8), summary limited capacity. Synthetic, on the
    recorded answers: no machine at hand had a failing fabric."""
    s = scrape_once(sysfs, with_fabric(
        {"state": 2, "status": 0},
        {"healthMask": 1 | 2 << 2 | 5 << 8, "healthSummary": 3, "cliqueId": 7,
         "clusterUuid": "0123456789abcdef0123456789abcdef"}))
    assert value(s, "gpunet_gpu_fabric_state", gpu="0", state="in_progress") == 1
    assert value(s, "gpunet_gpu_fabric_state", gpu="0", state="completed") == 0
    assert value(s, "gpunet_gpu_fabric_status_code", gpu="0") is None  # only once completed
    health = {dict(lbl)["check"]: v for lbl, v in series(s, "gpunet_gpu_fabric_health").items()
              if dict(lbl)["gpu"] == "1"}
    assert health == {"degraded_bandwidth": 1, "route_recovery": 0,
                      "incorrect_configuration": 1}
    assert value(s, "gpunet_gpu_fabric_health_summary", gpu="1", summary="limited_capacity") == 1
    assert value(s, "gpunet_gpu_fabric_health_summary", gpu="1", summary="healthy") == 0
    assert value(s, "gpunet_gpu_fabric_info", gpu="1", clique_id="7",
                 cluster_uuid="01234567-89ab-cdef-0123-456789abcdef") == 1
    # A driver with only the v2 structure: v3 is refused, v2 answers (no summary).
    v2 = with_fabric({"version": 0x02000024}, {"version": 0x02000024})
    s = scrape_once(sysfs, v2)
    assert value(s, "gpunet_gpu_fabric_state", gpu="1", state="completed") == 1
    assert not series(s, "gpunet_gpu_fabric_health_summary")
    # No fabric call at all (the recorded H200 capture has none): no fabric series, no error.
    g = Gpu(sysfs)
    try:
        fake_nvml.load(fake_nvml.h200x2())
        s = g.scrape()
        assert not series(s, "gpunet_gpu_fabric_state") and g.unreadable == 0
    finally:
        g.close()


def test_nvlink_speed_per_link(gpu: Gpu) -> None:
    """Each link's speed from the NVLink speed field, in one call of the background round: the
    value the 4 x H100 machine gave (26562 MB/s); a driver without the field gives no series and
    is not asked again."""
    fake_nvml.device(0).setdefault("fieldValues", {})["NVML_FI_DEV_NVLINK_GET_SPEED"] = {
        "value": 26562, "valueType": 1, "nvmlReturn": 0}
    s = wait_for(lambda: (lambda s: s if series(
        s, "gpunet_gpu_nvlink_speed_bytes_per_second") else None)(gpu.scrape()),
        "the NVLink speeds", timeout=20)
    speeds = {(dict(lbl)["gpu"], dict(lbl)["link"]): v for lbl, v in
              series(s, "gpunet_gpu_nvlink_speed_bytes_per_second").items()}
    assert speeds == {("0", str(i)): 26562e6 for i in range(18)}  # GPU 1: not supported
    asked = fake_nvml.calls("nvmlDeviceGetFieldValues", 1)
    gpu.c.refresh()
    assert fake_nvml.calls("nvmlDeviceGetFieldValues", 1) == asked + 1  # the counters only


def test_background_pcie_counters(gpu: Gpu) -> None:
    wait_for(lambda: value(gpu.scrape(), "gpunet_gpu_counters_refresh_success", gpu="1") == 1)
    s = gpu.scrape()
    fv = CAPTURE["devices"][0]["fieldValues"]
    assert value(s, "gpunet_gpu_pcie_errors_total", gpu="0", type="bad_tlp") == 2
    assert value(s, "gpunet_gpu_pcie_errors_total", gpu="0", type="receiver_error") == 2
    assert value(s, "gpunet_gpu_pcie_errors_total", gpu="0", type="naks_sent") == 1
    assert value(s, "gpunet_gpu_pcie_link_recoveries_total", gpu="0") == 163
    assert value(s, "gpunet_gpu_pcie_replays_total", gpu="0") == 0
    # The 32-bit PCIe byte counters wrap faster than any scrape: not exported.
    assert fv["NVML_FI_DEV_PCIE_COUNT_RX_BYTES"]["valueType"] == 1  # unsigned int
    assert not [n for (n, _) in s if "pcie_bytes" in n]
    # NVML reports KB/s (docs/formats.md §6.2): exported in bytes per second.
    assert value(s, "gpunet_gpu_pcie_throughput_bytes_per_second", gpu="0",
                 direction="tx") == 796_000
    assert value(s, "gpunet_gpu_pcie_throughput_bytes_per_second", gpu="1",
                 direction="rx") == 546_000
    when = value(s, LAST_SUCCESS, gpu="0")
    assert when is not None and abs(time.time() - when) < 60


def test_pcie_throughput_can_be_turned_off(sysfs: Path) -> None:
    g = Gpu(sysfs, {"pcie_throughput": False})
    try:
        wait_for(lambda: value(g.scrape(), "gpunet_gpu_counters_refresh_success", gpu="0") == 1)
        assert not series(g.scrape(), "gpunet_gpu_pcie_throughput_bytes_per_second")
        assert fake_nvml.calls("nvmlDeviceGetPcieThroughput", 0) == 0
    finally:
        g.close()


def test_not_supported_is_skipped_for_that_gpu_alone(gpu: Gpu,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    fake_nvml.device(1)["nvmlDeviceGetCurrPcieLinkWidth"] = {"exc": "NVMLError_NotSupported"}
    with caplog.at_level(logging.INFO, logger="gpunet"):
        for _ in range(3):
            s = gpu.scrape()
            assert gpu.unreadable == 0  # not supported is not an error
    assert value(s, "gpunet_gpu_pcie_link_width", gpu="0") == 16
    assert value(s, "gpunet_gpu_pcie_link_width", gpu="1") is None
    assert value(s, "gpunet_gpu_pcie_link_degraded", gpu="1") is None  # cannot be judged
    assert value(s, "gpunet_gpu_pcie_link_max_width", gpu="1") == 16  # the rest of GPU 1 stays
    assert fake_nvml.calls("nvmlDeviceGetCurrPcieLinkWidth", 1) == 1  # not asked again
    assert fake_nvml.calls("nvmlDeviceGetCurrPcieLinkWidth", 0) == 3
    logged = [r for r in caplog.records
              if "nvmlDeviceGetCurrPcieLinkWidth not supported" in r.message]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO


def test_other_errors_cost_one_value_each_scrape(gpu: Gpu) -> None:
    fake_nvml.device(0)["nvmlDeviceGetUtilizationRates"] = {"exc": "NVMLError_Unknown"}
    for _ in range(2):
        s = gpu.scrape()
        assert gpu.unreadable == 1
        assert value(s, "gpunet_gpu_utilization_ratio", gpu="0") is None
        assert value(s, "gpunet_gpu_memory_used_bytes", gpu="0") is not None
    assert fake_nvml.calls("nvmlDeviceGetUtilizationRates", 0) == 2  # retried: may be transient
    # Without the utilization sample the degraded gauge still judges by width and processes.
    assert value(s, "gpunet_gpu_pcie_link_degraded", gpu="0") == 0


def test_lost_gpu_is_a_series_not_an_exception(gpu: Gpu) -> None:
    wait_for(lambda: value(gpu.scrape(), "gpunet_gpu_counters_refresh_success", gpu="1") == 1)
    fake_nvml.device(1)["lost"] = True
    s = gpu.scrape()
    assert value(s, "gpunet_gpu_lost", gpu="1") == 1
    assert value(s, "gpunet_gpu_lost", gpu="0") == 0
    assert not [n for (n, lbl) in s if dict(lbl).get("gpu") == "1" and n != "gpunet_gpu_lost"
                and not n.startswith("gpunet_gpu_xid")]
    assert value(s, "gpunet_gpu_memory_used_bytes", gpu="0") is not None
    assert value(s, "gpunet_gpu_nvml_up") == 1
    fake_nvml.device(1)["lost"] = False  # after a reset the GPU answers again
    assert value(gpu.scrape(), "gpunet_gpu_lost", gpu="1") == 0


def test_gpu_lost_before_enumeration(sysfs: Path) -> None:
    scenario = fake_nvml.h200x2()
    scenario["devices"][0]["lost"] = True
    s = scrape_once(sysfs, scenario)
    assert value(s, "gpunet_gpu_lost", gpu="0") == 1
    assert value(s, "gpunet_gpu_lost", gpu="1") == 0
    assert {dict(lbl)["gpu"] for lbl in series(s, "gpunet_gpu_info")} == {"1"}


@pytest.mark.parametrize("library", ["missing", "no_driver"])
def test_no_library_or_driver_no_data(sysfs: Path, library: str) -> None:
    scenario = fake_nvml.h200x2()
    scenario["library"] = library
    fake_nvml.load(scenario)
    s, unreadable = collect(GpuCollector, sysfs, nvml_module=fake_nvml.MODULE)
    assert s == {} and unreadable == 0


def test_real_nvidia_ml_py_without_a_driver(sysfs: Path) -> None:
    """This machine has nvidia-ml-py but no libnvidia-ml: the real LibraryNotFound path."""
    nvml.forget("pynvml")
    s, unreadable = collect(GpuCollector, sysfs)
    assert s == {} and unreadable == 0
    assert nvml.session("pynvml").state == "absent"
    assert "NVML Shared Library Not Found" in nvml.session("pynvml").error


def test_a_failing_nvml_logs_once_not_every_retry(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Without the library, every retry fails alike: one INFO line, the retries at DEBUG (a
    CPU node logged one line per retry, some 8,600 a day); another failure is said again."""
    monkeypatch.setattr(nvml, "RETRY_SECONDS", 0.0)
    nvml.forget("pynvml")
    session = nvml.session("pynvml")
    with caplog.at_level(logging.DEBUG, logger="gpunet.nvml"):
        for _ in range(5):
            assert session.gpus() is None
    said = [r for r in caplog.records if r.name == "gpunet.nvml"]
    assert [r.levelno for r in said] == [logging.INFO] + [logging.DEBUG] * 4, said
    assert "NVML Shared Library Not Found" in said[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="gpunet.nvml"):
        nvml.forget("no_such_nvml_module")
        assert nvml.session("no_such_nvml_module").gpus() is None
    assert [r.levelno for r in caplog.records if r.name == "gpunet.nvml"] == [logging.INFO]


def nvidia_on_the_bus(sysfs: Path) -> None:
    """Make the tree's two PCI functions NVIDIA 3D controllers (H200: device 0x2335)."""
    for d in (sysfs / "bus" / "pci" / "devices").iterdir():
        (d / "vendor").write_text("0x10de\n")
        (d / "device").write_text("0x2335\n")
        (d / "class").write_text("0x030200\n")


@pytest.mark.parametrize("module, reason", [("pynvml", "library_missing"),
                                            ("no_such_nvml_module", "library_missing")])
def test_gpus_on_the_bus_without_nvml_are_unknown(sysfs: Path, module: str,
                                                  reason: str) -> None:
    """NVIDIA GPUs on the PCI bus and no NVML (nvidia-ml-py without libnvidia-ml, or no
    nvidia-ml-py): no GPU series, but gpunet_check_unknown says the GPUs were not checked and
    why, and the landing page says so instead of "ok"."""
    nvidia_on_the_bus(sysfs)
    nvml.forget(module)
    s, page = scrape_and_page(make_collector(GpuCollector, sysfs, nvml_module=module))
    assert value(s, "gpunet_scrape_collector_success", collector="gpu") == 1
    assert series(s, "gpunet_check_unknown") == {
        frozenset({("collector", "gpu"), ("check", "nvml"), ("reason", reason)}): 1}
    assert not [k for k in s if k[0].startswith("gpunet_gpu_")]
    assert "UNKNOWN: nvml not checked (its library is not installed or cannot be loaded)" in page


def test_no_nvidia_gpu_on_the_bus_no_unknown(sysfs: Path) -> None:
    """A node without NVIDIA GPUs (the tree's PCI functions are not NVIDIA's): nothing to
    check, so nothing unknown, and no family at all."""
    nvml.forget("pynvml")
    scraper = Scraper({"gpu": make_collector(GpuCollector, sysfs)}, 5.0)
    try:
        s = samples_of(list(scraper.collect()))
    finally:
        scraper.close()
    assert not series(s, "gpunet_check_unknown")
    assert value(s, "gpunet_scrape_collector_success", collector="gpu") == 1


def test_missing_backend_module_no_data(sysfs: Path) -> None:
    s, _ = collect(GpuCollector, sysfs, nvml_module="no_such_nvml_module")
    assert s == {}


def test_driver_reload_reinitialises(gpu: Gpu) -> None:
    fake_nvml.push_event(0, 48)
    wait_for(lambda: value(gpu.scrape(), "gpunet_gpu_xid_errors_total", gpu="0",
                           xid="48") == 1)
    inits = fake_nvml.calls("nvmlInit")
    fake_nvml.reload_driver()  # NVML answers Uninitialized until initialised again
    s = gpu.scrape()
    assert fake_nvml.calls("nvmlInit") == inits + 1
    assert value(s, "gpunet_gpu_nvml_up") == 1
    assert len(series(s, "gpunet_gpu_info")) == 2
    # The XID thread was restarted on the new initialisation; counts survived it.
    fake_nvml.push_event(0, 48)
    wait_for(lambda: value(gpu.scrape(), "gpunet_gpu_xid_errors_total", gpu="0",
                           xid="48") == 2)


def test_session_error_mid_scrape(gpu: Gpu) -> None:
    """A device call answering as if NVML were shut down: no half-read data, NVML down, then
    initialised again on the next scrape."""
    gpu.scrape()
    inits = fake_nvml.calls("nvmlInit")
    dev = fake_nvml.device(1)
    recorded = dev["nvmlDeviceGetMemoryInfo"]
    dev["nvmlDeviceGetMemoryInfo"] = {"exc": "NVMLError_Uninitialized"}
    s = gpu.scrape()
    assert s == {("gpunet_gpu_nvml_up", frozenset()): 0}
    dev["nvmlDeviceGetMemoryInfo"] = recorded
    s = gpu.scrape()
    assert fake_nvml.calls("nvmlInit") == inits + 1
    assert value(s, "gpunet_gpu_nvml_up") == 1
    assert value(s, "gpunet_gpu_memory_used_bytes", gpu="1") is not None


def test_every_gpu_lost_reinitialises_at_most_every_retry_period(
        gpu: Gpu, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu.scrape()
    inits = fake_nvml.calls("nvmlInit")
    for i in (0, 1):
        fake_nvml.device(i)["lost"] = True
    for _ in range(3):  # initialised moments ago: keep reporting them lost, no re-init storm
        s = gpu.scrape()
        assert series(s, "gpunet_gpu_lost") == {frozenset({("gpu", "0")}): 1,
                                                frozenset({("gpu", "1")}): 1}
    assert fake_nvml.calls("nvmlInit") == inits
    monkeypatch.setattr(nvml, "RETRY_SECONDS", 0.0)  # the retry period has passed
    gpu.scrape()  # all lost again: this time NVML is dropped ...
    for i in (0, 1):
        fake_nvml.device(i)["lost"] = False
    s = gpu.scrape()  # ... and initialised again
    assert fake_nvml.calls("nvmlInit") == inits + 1
    assert value(s, "gpunet_gpu_lost", gpu="0") == 0


def test_gpu_count_change_reenumerates_and_counts_missing(gpu: Gpu) -> None:
    gpu.scrape()
    del fake_nvml._s.scenario["devices"][1]  # the GPU no longer enumerates (failed init)
    s = gpu.scrape()
    assert {dict(lbl)["gpu"] for lbl in series(s, "gpunet_gpu_info")} == {"0"}
    assert value(s, "gpunet_gpu_missing") == 1


def test_pcie_degraded_width_always_generation_only_when_busy(gpu: Gpu) -> None:
    dev = fake_nvml.device(0)
    dev["nvmlDeviceGetCurrPcieLinkGeneration"] = {"ok": 1}  # idle power saving
    assert value(gpu.scrape(), "gpunet_gpu_pcie_link_degraded", gpu="0") == 0
    dev["processes"] = [4242]
    s = gpu.scrape()
    assert value(s, "gpunet_gpu_compute_processes", gpu="0") == 1
    assert value(s, "gpunet_gpu_pcie_link_degraded", gpu="0") == 1
    dev["processes"] = []
    dev["nvmlDeviceGetUtilizationRates"] = {"ok": {"gpu": 35, "memory": 12}}
    s = gpu.scrape()
    assert value(s, "gpunet_gpu_utilization_ratio", gpu="0") == 0.35
    assert value(s, "gpunet_gpu_memory_utilization_ratio", gpu="0") == 0.12
    assert value(s, "gpunet_gpu_pcie_link_degraded", gpu="0") == 1
    dev["nvmlDeviceGetCurrPcieLinkGeneration"] = {"ok": 5}
    dev["nvmlDeviceGetCurrPcieLinkWidth"] = {"ok": 8}
    dev["nvmlDeviceGetUtilizationRates"] = {"ok": {"gpu": 0, "memory": 0}}
    assert value(gpu.scrape(), "gpunet_gpu_pcie_link_degraded", gpu="0") == 1  # x8 of x16


def test_xid_events_counted_by_code_only_xid(gpu: Gpu) -> None:
    gpu.scrape()
    before = time.time()
    for xid in (79, 79, 48):
        fake_nvml.push_event(1, xid)
    fake_nvml.push_event(1, 0, event_type=0x10)  # a clock event: not an XID
    wait_for(lambda: value(gpu.scrape(), "gpunet_gpu_xid_errors_total", gpu="1",
                           xid="48") == 1)
    s = gpu.scrape()
    assert series(s, "gpunet_gpu_xid_errors_total") == {
        frozenset({("gpu", "1"), ("xid", "79")}): 2, frozenset({("gpu", "1"), ("xid", "48")}): 1}
    assert value(s, "gpunet_gpu_xid_last_code", gpu="1") == 48
    last = value(s, "gpunet_gpu_xid_last_timestamp_seconds", gpu="1")
    assert last is not None and before <= last <= time.time()
    assert value(s, "gpunet_gpu_xid_last_timestamp_seconds", gpu="0") is None
    assert value(s, "gpunet_gpu_xid_monitoring", gpu="0") == 1


def test_xid_registration_refused_is_reported(sysfs: Path) -> None:
    scenario = fake_nvml.h200x2()
    scenario["devices"][1]["nvmlDeviceRegisterEvents"] = {"exc": "NVMLError_NotSupported"}
    s = scrape_once(sysfs, scenario)
    assert value(s, "gpunet_gpu_xid_monitoring", gpu="0") == 1
    assert value(s, "gpunet_gpu_xid_monitoring", gpu="1") == 0


def test_xid_events_off(sysfs: Path) -> None:
    g = Gpu(sysfs, {"xid_events": False})
    try:
        assert not series(g.scrape(), "gpunet_gpu_xid_monitoring")
        assert fake_nvml.calls("nvmlDeviceRegisterEvents", 0) == 0
    finally:
        g.close()


def test_xid_codes_are_bounded() -> None:
    w = XidWatcher(lambda *a: None)
    for code in range(XID_LABELS_PER_GPU + 10):
        w.record("GPU-x", code)
    counts, _ = w.snapshot()
    assert len(counts) == XID_LABELS_PER_GPU + 1
    assert counts[("GPU-x", "other")] == 10


def test_background_failure_keeps_last_good_values(gpu: Gpu) -> None:
    wait_for(lambda: value(gpu.scrape(), "gpunet_gpu_counters_refresh_success", gpu="0") == 1)
    good = value(gpu.scrape(), LAST_SUCCESS, gpu="0")
    assert good is not None
    fake_nvml.device(0)["nvmlDeviceGetFieldValues"] = {"exc": "NVMLError_Unknown"}
    time.sleep(0.05)
    gpu.c.refresh()  # type: ignore[attr-defined]
    s = gpu.scrape()
    assert value(s, "gpunet_gpu_counters_refresh_success", gpu="0") == 0
    assert value(s, "gpunet_gpu_counters_refresh_success", gpu="1") == 1
    assert value(s, "gpunet_gpu_pcie_link_recoveries_total", gpu="0") == 163  # last good
    assert value(s, LAST_SUCCESS, gpu="0") == good  # no longer advancing
    later = value(s, LAST_SUCCESS, gpu="1")
    assert later is not None and later > good  # GPU 1's round went on


def test_first_scrape_does_not_wait_for_slow_counters(sysfs: Path) -> None:
    """NVML counters slower than the scrape timeout: the scrape answers within its deadline
    with the per-scrape values, and no counters, success or timestamp yet; a later scrape has
    them."""
    fake_nvml.device(0).setdefault("sleep", {})["nvmlDeviceGetFieldValues"] = 3
    g = Gpu(sysfs)
    scraper = Scraper({"gpu": g.c}, 1.0)
    try:
        s = samples_of(list(scraper.collect()))
        # Finished within the deadline: the registry says 0 for a collector it gave up on.
        assert value(s, "gpunet_scrape_collector_success", collector="gpu") == 1
        assert value(s, "gpunet_gpu_memory_total_bytes", gpu="0") is not None
        assert value(s, "gpunet_gpu_pcie_link_width", gpu="1") == 16
        assert not series(s, "gpunet_gpu_pcie_link_recoveries_total")
        assert not series(s, "gpunet_gpu_counters_refresh_success")
        assert not series(s, LAST_SUCCESS)
        s = wait_for(lambda: (lambda s: s if value(
            s, "gpunet_gpu_counters_refresh_success", gpu="0") is not None else None)(
                samples_of(list(scraper.collect()))), "the counters", timeout=20, interval=0.1)
    finally:
        g.close()
    assert value(s, "gpunet_gpu_counters_refresh_success", gpu="0") == 1
    assert value(s, "gpunet_gpu_pcie_link_recoveries_total", gpu="0") == 163
    assert value(s, LAST_SUCCESS, gpu="1") is not None


def test_a_round_past_its_timeout_fails_and_keeps_last_good_values(sysfs: Path) -> None:
    """NVML calls have no timeout: a round still running after one interval (its timeout)
    counts as failed for every GPU, the last good values stay, the timestamps stop, and the
    round's late result is not taken."""
    g = Gpu(sysfs, {"counters_interval_seconds": 1})
    try:
        wait_for(lambda: value(g.scrape(), "gpunet_gpu_counters_refresh_success", gpu="0") == 1)
        fake_nvml.device(0).setdefault("sleep", {})["nvmlDeviceGetFieldValues"] = 2.5
        wait_for(lambda: value(g.scrape(), "gpunet_gpu_counters_refresh_success", gpu="0") == 0,
                 timeout=15)
        s = g.scrape()
        stopped = {gpu: value(s, LAST_SUCCESS, gpu=gpu) for gpu in ("0", "1")}
        assert None not in stopped.values()
        time.sleep(4)  # more than one whole round (2.5 s) and the pause after it (1 s)
        s = g.scrape()
        for gpu in ("0", "1"):  # GPU 1 answered at once, but within a round that failed
            assert value(s, "gpunet_gpu_counters_refresh_success", gpu=gpu) == 0
            assert value(s, LAST_SUCCESS, gpu=gpu) == stopped[gpu]
        assert value(s, "gpunet_gpu_pcie_link_recoveries_total", gpu="0") == 163
        del fake_nvml.device(0)["sleep"]["nvmlDeviceGetFieldValues"]
        wait_for(lambda: value(g.scrape(), "gpunet_gpu_counters_refresh_success", gpu="0") == 1,
                 timeout=15)
        later, before = value(g.scrape(), LAST_SUCCESS, gpu="0"), stopped["0"]
        assert later is not None and before is not None and later > before
    finally:
        g.close()


def test_unsupported_fields_are_not_asked_again(gpu: Gpu) -> None:
    fake_nvml.device(0)["fieldValues"]["NVML_FI_DEV_PCIE_COUNT_LANE_ERROR"] = {"nvmlReturn": 3}
    c: Any = gpu.c
    gpu.scrape()
    c.refresh()
    c.refresh()
    s = gpu.scrape()
    assert value(s, "gpunet_gpu_pcie_errors_total", gpu="0", type="lane") is None
    assert value(s, "gpunet_gpu_pcie_errors_total", gpu="1", type="lane") == 0
    assert value(s, "gpunet_gpu_counters_refresh_success", gpu="0") == 1
    assert "field/NVML_FI_DEV_PCIE_COUNT_LANE_ERROR" in c._states[0].unsupported


def test_probe_workers_are_not_counted_as_compute_processes(sysfs: Path, tmp_path: Path) -> None:
    """The exporter's own probe workers (a session it started) hold CUDA contexts on every GPU;
    they are left out of the process count and do not make an idle GPU 'busy', so neither the
    starved-GPU alert nor the PCIe degraded gauge fires on an idle node that runs the probe."""
    proc = tmp_path / "proc"
    for pid, sid in ((101, 500), (102, 500), (103, 777)):
        (proc / str(pid)).mkdir(parents=True)
        # comm with a space and a parenthesis: the session is the 4th field after the last ')'
        (proc / str(pid) / "stat").write_text(
            f"{pid} (pt main) thread) S 500 {sid} {sid} 0 -1 4194560 0 0 0 0\n")
    dev = fake_nvml.device(0)
    dev["processes"] = [101, 102]
    dev["nvmlDeviceGetCurrPcieLinkGeneration"] = {"ok": 1}  # idle power saving
    dev["nvmlDeviceGetUtilizationRates"] = {"ok": {"gpu": 0, "memory": 0}}
    g = Gpu(sysfs, procfs=proc)
    try:
        s = g.scrape()  # no session registered: every process counts
        assert value(s, "gpunet_gpu_compute_processes", gpu="0") == 2
        assert value(s, "gpunet_gpu_pcie_link_degraded", gpu="0") == 1
        nvml.own_session(500, started=True)
        s = g.scrape()
        assert value(s, "gpunet_gpu_compute_processes", gpu="0") == 0
        assert value(s, "gpunet_gpu_pcie_link_degraded", gpu="0") == 0
        dev["processes"] = [101, 103, 104]  # 103: another session; 104: no /proc entry
        assert value(g.scrape(), "gpunet_gpu_compute_processes", gpu="0") == 2
        nvml.own_session(500, started=False)
        assert value(g.scrape(), "gpunet_gpu_compute_processes", gpu="0") == 3
    finally:
        nvml.own_session(500, started=False)
        g.close()


def test_end_to_end_installed_exporter(run_exporter: Any, sysfs: Path, tmp_path: Path) -> None:
    """The installed console script loads the stand-in through --nvml.module and reads XID
    events appended to a file while it runs."""
    scenario = fake_nvml.h200x2()
    scenario["devices"][0]["processes"] = [101, 102]
    (tmp_path / "nvml.json").write_text(json.dumps(scenario))
    events = tmp_path / "events"
    events.write_text("")
    env = fake_nvml.exporter_env(tmp_path / "nvml.json", events)
    e = run_exporter(f"--path.sysfs={sysfs}", "--collector.disable-defaults", "--collector.gpu",
                     f"--nvml.module={fake_nvml.MODULE}", env=env)
    s = parse(e.metrics())
    assert value(s, "gpunet_scrape_collector_success", collector="gpu") == 1
    assert value(s, "gpunet_gpu_compute_processes", gpu="0") == 2
    assert value(s, "gpunet_gpu_memory_total_bytes", gpu="1") == 150754820096
    with events.open("a") as fh:
        fh.write("0 79\n")
    wait_for(lambda: value(parse(e.metrics()), "gpunet_gpu_xid_errors_total", gpu="0",
                           xid="79") == 1)


def test_end_to_end_without_nvidia(run_exporter: Any, sysfs: Path) -> None:
    e = run_exporter(f"--path.sysfs={sysfs}", "--collector.disable-defaults", "--collector.gpu")
    text = e.metrics()
    s = parse(text)
    assert value(s, "gpunet_scrape_collector_success", collector="gpu") == 1
    assert "gpunet_gpu_" not in text
