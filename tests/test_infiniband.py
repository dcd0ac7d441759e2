"""infiniband collector on the DGX tree, its fault variants and the upstream fixture trees."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gpunet_exporter.collector import Scrape, build_collector
from gpunet_exporter.collectors.infiniband import COUNTER_SPECS, InfinibandCollector
from gpunet_exporter.errors import ConfigError
from gpunet_exporter.sources.sysfs import Root

from support import sysfs_tree as st
from support.metrics import Samples, collect, make_collector, samples_of, series, value
from support.paths import UPSTREAM

GBIT = 125_000_000
IB = [f"mlx5_{i}" for i in range(8)]
ROCE = ["mlx5_8", "mlx5_9"]


@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path)


def run(sysfs: Path, config: dict[str, object] | None = None, root: Root | None = None
        ) -> tuple[Samples, int]:
    return collect(InfinibandCollector, sysfs, config, root)


def counter_file(sysfs: Path, dev: str, name: str, sub: str = "counters") -> int:
    return int((sysfs / "class/infiniband" / dev / "ports/1" / sub / name).read_text())


def test_healthy_dgx(dgx: Path) -> None:
    s, unreadable = run(dgx)
    assert unreadable == 0
    infos = series(s, "gpunet_infiniband_device_info")
    assert len(infos) == 10
    mlx5_0 = dict(next(lbl for lbl in infos if ("device", "mlx5_0") in lbl))
    assert mlx5_0 == {"device": "mlx5_0", "fw_ver": "28.39.2048", "hca_type": "MT4129",
                      "board_id": "MT_0000000838", "node_guid": (dgx / "class/infiniband/mlx5_0/"
                      "node_guid").read_text().strip(), "pci_address": "0000:18:00.0",
                      "numa_node": "0"}
    ports = {dict(lbl)["device"]: dict(lbl) for lbl in series(s, "gpunet_infiniband_port_info")}
    assert ports["mlx5_0"]["link_layer"] == "InfiniBand"
    assert ports["mlx5_0"]["interface"] == "ibp24s0"
    assert ports["mlx5_8"]["link_layer"] == "Ethernet"
    assert ports["mlx5_8"]["interface"] == "enp41s0f0np0"  # from gid_attrs/ndevs
    for dev in IB + ROCE:
        assert value(s, "gpunet_infiniband_port_state_id", device=dev, port="1") == 4
        assert value(s, "gpunet_infiniband_port_phys_state_id", device=dev, port="1") == 5
        assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device=dev,
                     port="1") == 400 * GBIT
        assert value(s, "gpunet_infiniband_port_link_width_lanes", device=dev, port="1") == 4
        assert value(s, "gpunet_infiniband_port_lane_speed_bytes_per_second", device=dev,
                     port="1") == 100 * GBIT
        assert value(s, "gpunet_infiniband_port_rate_degraded", device=dev, port="1") == 0
        # Correct to the byte: octets/4 in the file, bytes exported.
        assert value(s, "gpunet_infiniband_port_transmitted_bytes_total", device=dev,
                     port="1") == 4 * counter_file(dgx, dev, "port_xmit_data")
        assert value(s, "gpunet_infiniband_port_received_bytes_total", device=dev,
                     port="1") == 4 * counter_file(dgx, dev, "port_rcv_data")
        assert value(s, "gpunet_infiniband_port_symbol_errors_total", device=dev,
                     port="1") == counter_file(dgx, dev, "symbol_error")
        assert value(s, "gpunet_infiniband_port_hw_out_of_buffer_drops_total", device=dev,
                     port="1") == counter_file(dgx, dev, "out_of_buffer", "hw_counters")
    # Every standard counter file of the tree is exported under its curated name.
    for spec in COUNTER_SPECS.values():
        if spec.name.endswith(("receive_discards_total",)):  # mlx4 only
            continue
        assert len(series(s, spec.name)) == 10, spec.name
    # No counter of a healthy node sits at its maximum: no saturation series at all.
    assert not series(s, "gpunet_infiniband_port_pma_saturated")
    # lifespan is a setting, not a counter.
    assert not any("lifespan" in name for name, _ in s)


def test_unknown_hw_counter_is_kept(dgx: Path) -> None:
    s, _ = run(dgx)
    dev, name, raw = st.FUTURE_HW_COUNTER
    assert value(s, "gpunet_infiniband_port_hw_total", device=dev, port="1",
                 counter=name) == raw
    assert not [k for k in s if k[0].startswith("gpunet_infiniband_device_hw_")]


def test_device_level_hw_counters_in_switchdev_mode(dgx: Path) -> None:
    st.make_switchdev(dgx, "mlx5_9")
    (dgx / "class/infiniband/mlx5_9/hw_counters/rx_next_gen_counter").write_text("7\n")
    s, unreadable = run(dgx)
    assert unreadable == 0
    hw = dgx / "class/infiniband/mlx5_9/hw_counters"
    assert value(s, "gpunet_infiniband_device_hw_rp_cnp_handled_total",
                 device="mlx5_9") == int((hw / "rp_cnp_handled").read_text())
    assert value(s, "gpunet_infiniband_device_hw_total", device="mlx5_9",
                 counter="rx_next_gen_counter") == 7
    device_level = [k for k in s if k[0].startswith("gpunet_infiniband_device_hw_")]
    assert len(device_level) == len(list(hw.iterdir())) - 1  # all but lifespan
    assert all(("device", "mlx5_9") in lbl for _, lbl in device_level)


class CountingRoot(Root):
    """Records every file read (relative to the root)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.reads: list[str] = []

    def _read(self, path: str, dir_fd: int | None, rel: str) -> str:
        self.reads.append(rel)
        return super()._read(path, dir_fd, rel)


def _hw_series(s: Samples, family: str, **labels: str) -> dict[str, float]:
    """counter label -> value of one port's (or device's) generic hw_counters series."""
    want = set(labels.items())
    return {dict(lbl)["counter"]: v for lbl, v in series(s, family).items() if want <= lbl}


def test_generic_hw_counters_capped_per_port(dgx: Path) -> None:
    """20,000 files in one hw_counters/ (a driver bug, a planted tree): the first 512 generic
    files by name are exported, the rest counted as dropped; curated counters all pass, and the
    other ports are unaffected."""
    hw = dgx / "class/infiniband/mlx5_0/ports/1/hw_counters"
    names = [f"a{i:05d}" for i in range(20_000)]  # sort before every curated name
    for i, name in enumerate(names):
        (hw / name).write_text(f"{i}\n")
    before, _ = run(st.build_dgx_h100(dgx.parent / "clean"))
    root = CountingRoot(str(dgx))
    c = make_collector(InfinibandCollector, dgx, root=root)
    s = samples_of(list(c.collect(Scrape())))
    c.close()
    assert c.ctx.unreadable == 0
    # The files beyond the cap are not even read: the scrape costs their listing only.
    assert sum(1 for rel in root.reads if "mlx5_0/ports/1/hw_counters/a" in rel) == 512
    kept = _hw_series(s, "gpunet_infiniband_port_hw_total", device="mlx5_0", port="1")
    assert kept == {name: i for i, name in enumerate(names[:512])}  # deterministic: by name
    assert value(s, "gpunet_infiniband_port_hw_counters_dropped", device="mlx5_0",
                 port="1") == 20_000 - 512
    assert value(s, "gpunet_infiniband_port_hw_out_of_buffer_drops_total", device="mlx5_0",
                 port="1") == int((hw / "out_of_buffer").read_text())
    curated = {k for k in s if k[0].startswith("gpunet_infiniband_port_hw_")
               and k[0] != "gpunet_infiniband_port_hw_total" and ("device", "mlx5_0") in k[1]
               and not k[0].endswith("_dropped")}
    assert len(curated) == len({k for k in before if k[0].startswith("gpunet_infiniband_port_hw_")
                                and k[0] != "gpunet_infiniband_port_hw_total"
                                and ("device", "mlx5_0") in k[1]})
    # Every other port exactly as on the same tree without the files (values differ per tree).
    others = {k for k in s if ("device", "mlx5_0") not in k[1]}
    assert others == {k for k in before if ("device", "mlx5_0") not in k[1]}
    assert len(series(s, "gpunet_infiniband_port_hw_counters_dropped")) == 1


def test_generic_hw_counters_cap_from_config(dgx: Path) -> None:
    hw = dgx / "class/infiniband/mlx5_9/ports/1/hw_counters"
    for name in ("z_new_1", "z_new_2", "z_new_3"):
        (hw / name).write_text("1\n")
    dev, future, raw = st.FUTURE_HW_COUNTER
    assert dev == "mlx5_9"
    s, _ = run(dgx, {"generic_hw_counters_max": 2})
    assert _hw_series(s, "gpunet_infiniband_port_hw_total", device="mlx5_9") == {
        future: raw, "z_new_1": 1}
    assert value(s, "gpunet_infiniband_port_hw_counters_dropped", device="mlx5_9",
                 port="1") == 2
    # 0: curated counters only, every generic file dropped.
    st.make_switchdev(dgx, "mlx5_9")
    (dgx / "class/infiniband/mlx5_9/hw_counters/z_dev").write_text("1\n")
    s, _ = run(dgx, {"generic_hw_counters_max": 0})
    assert not series(s, "gpunet_infiniband_port_hw_total")
    assert not series(s, "gpunet_infiniband_device_hw_total")
    assert value(s, "gpunet_infiniband_port_hw_counters_dropped", device="mlx5_9",
                 port="1") == 4
    # make_switchdev copied the port's z_new_* files, then z_dev
    assert value(s, "gpunet_infiniband_device_hw_counters_dropped", device="mlx5_9") == 4
    assert value(s, "gpunet_infiniband_device_hw_rp_cnp_handled_total",
                 device="mlx5_9") is not None
    # Within the cap nothing is dropped, and no dropped series exists.
    s, _ = run(dgx)
    assert not [k for k in s if k[0].endswith("_hw_counters_dropped")]
    with pytest.raises(ConfigError, match="generic_hw_counters_max"):
        run(dgx, {"generic_hw_counters_max": -1})


def test_port_down(dgx: Path) -> None:
    st.make_port_down(dgx, "mlx5_3")
    s, _ = run(dgx)
    assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_3", port="1") == 1
    assert value(s, "gpunet_infiniband_port_phys_state_id", device="mlx5_3", port="1") == 3
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_3", port="1") is None
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_2", port="1") == 0


def test_degraded_against_fastest_peer(dgx: Path) -> None:
    st.make_port_degraded(dgx, "mlx5_5")
    s, _ = run(dgx)
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device="mlx5_5",
                 port="1") == 200 * GBIT
    assert value(s, "gpunet_infiniband_port_link_width_lanes", device="mlx5_5", port="1") == 2
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_5", port="1") == 1
    assert value(s, "gpunet_infiniband_port_rate_expected_bytes_per_second", device="mlx5_5",
                 port="1") == 400 * GBIT
    degraded = series(s, "gpunet_infiniband_port_rate_degraded")
    assert sum(degraded.values()) == 1 and len(degraded) == 10


def test_degraded_with_config_rules(dgx: Path) -> None:
    st.make_port_degraded(dgx, "mlx5_5")
    rules = [{"device": "^mlx5_5$", "gbps": 200}, {"link_layer": "InfiniBand", "gbps": 400}]
    s, _ = run(dgx, {"expected_rate": rules})
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_5", port="1") == 0
    assert value(s, "gpunet_infiniband_port_rate_expected_bytes_per_second", device="mlx5_5",
                 port="1") == 200 * GBIT
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_0", port="1") == 0
    # RoCE ports match no rule: no expectation, no verdict.
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_8", port="1") is None
    # A node where every IB port trained down: only a configured expectation catches it.
    for dev in IB:
        st.make_port_degraded(dgx, dev)
    s, _ = run(dgx)
    assert sum(series(s, "gpunet_infiniband_port_rate_degraded").values()) == 0
    s, _ = run(dgx, {"expected_rate": [{"link_layer": "InfiniBand", "gbps": 400}]})
    assert sum(series(s, "gpunet_infiniband_port_rate_degraded").values()) == 8


def test_roce_judged_by_netdev_speed(dgx: Path) -> None:
    port = dgx / "class/infiniband/mlx5_8/ports/1"
    # Drivers before the 400G_8X fix print a bogus low rate for a healthy 400G port.
    (port / "rate").write_text("40 Gb/sec (4X QDR)\n")
    s, _ = run(dgx)
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device="mlx5_8",
                 port="1") == 40 * GBIT
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_8", port="1") == 0
    (dgx / "class/net/enp41s0f0np0/speed").write_text("200000\n")
    s, _ = run(dgx)
    assert value(s, "gpunet_infiniband_port_rate_degraded", device="mlx5_8", port="1") == 1


def test_saturated_counters(dgx: Path) -> None:
    st.make_counters_saturated(dgx, "mlx5_1")
    s, _ = run(dgx)
    sat = {dict(lbl)["counter"]: v for lbl, v in series(s, "gpunet_infiniband_port_pma_saturated")
           .items() if ("device", "mlx5_1") in lbl}
    for name in ("symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
                 "local_link_integrity_errors", "excessive_buffer_overrun_errors",
                 "port_xmit_wait"):
        assert sat[name] == 1, name
    assert set(sat) == {"symbol_error", "link_error_recovery", "link_downed", "port_rcv_errors",
                        "local_link_integrity_errors", "excessive_buffer_overrun_errors",
                        "port_xmit_wait"}
    # The value itself is exported as read, never reset.
    assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_1",
                 port="1") == 65535


def test_narrow_table_data_counters_saturate(dgx: Path) -> None:
    counters = dgx / "class/infiniband/mlx5_0/ports/1/counters"
    for name in ("unicast_xmit_packets", "unicast_rcv_packets", "multicast_xmit_packets",
                 "multicast_rcv_packets"):
        (counters / name).unlink()  # the plain 32-bit PortCounters table
    (counters / "port_xmit_data").write_text("4294967295\n")
    (counters / "port_rcv_data").write_text("4294967294\n")
    s, _ = run(dgx)
    assert value(s, "gpunet_infiniband_port_pma_saturated", device="mlx5_0", port="1",
                 counter="port_xmit_data") == 1
    assert value(s, "gpunet_infiniband_port_pma_saturated", device="mlx5_0", port="1",
                 counter="port_rcv_data") is None
    # With the extended table the same value is far from the 64-bit maximum.
    st.build_dgx_h100(dgx.parent / "other")
    other = dgx.parent / "other" / "sys"
    (other / "class/infiniband/mlx5_0/ports/1/counters/port_xmit_data").write_text("4294967295\n")
    s, _ = run(other)
    assert not series(s, "gpunet_infiniband_port_pma_saturated")


def test_no_pma(dgx: Path) -> None:
    st.make_no_pma(dgx, "mlx5_2")
    s, unreadable = run(dgx)
    n_files = len(list((dgx / "class/infiniband/mlx5_2/ports/1/counters").iterdir()))
    assert unreadable == n_files
    assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_2",
                 port="1") is None
    assert value(s, "gpunet_infiniband_port_info", device="mlx5_2", port="1", link_layer=
                 "InfiniBand", interface="ibp79s0") == 1
    assert value(s, "gpunet_infiniband_port_hw_out_of_buffer_drops_total", device="mlx5_2",
                 port="1") is not None  # hw_counters do not go through the PMA
    assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_1",
                 port="1") is not None


def test_unreadable_isdir(dgx: Path) -> None:
    st.make_unreadable(dgx, "mlx5_4")
    s, unreadable = run(dgx)
    assert value(s, "gpunet_infiniband_port_receive_errors_total", device="mlx5_4",
                 port="1") is None
    assert value(s, "gpunet_infiniband_port_transmit_discards_total", device="mlx5_4",
                 port="1") is not None
    assert unreadable >= 1


class ErrnoRoot(Root):
    """A kernel's errors that regular files cannot produce: read() failing with an errno."""

    def __init__(self, root: str, failures: dict[str, int]) -> None:
        super().__init__(root)
        self.failures = failures

    def _read(self, path: str, dir_fd: int | None, rel: str) -> str:
        for suffix, err in self.failures.items():
            if rel.endswith(suffix):
                raise OSError(err, os.strerror(err))
        return super()._read(path, dir_fd, rel)


@pytest.mark.parametrize("err", [errno.EINVAL, errno.EOPNOTSUPP, errno.EACCES, errno.ENODATA,
                                 errno.EIO])
def test_read_errors_cost_one_value(dgx: Path, err: int) -> None:
    failures = {"mlx5_0/ports/1/counters/symbol_error": err,
                "mlx5_0/ports/1/hw_counters/np_cnp_sent": err,
                "mlx5_9/ports/1/rate": err,
                "mlx5_9/fw_ver": err}
    s, unreadable = run(dgx, root=ErrnoRoot(str(dgx), failures))
    assert unreadable == 3  # fw_ver is an optional label: "" rather than a skipped value
    assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_0",
                 port="1") is None
    assert value(s, "gpunet_infiniband_port_link_downed_total", device="mlx5_0",
                 port="1") is not None
    assert value(s, "gpunet_infiniband_port_hw_np_cnp_sent_total", device="mlx5_0",
                 port="1") is None
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device="mlx5_9",
                 port="1") is None
    assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_9", port="1") == 4
    info = [dict(lbl) for lbl in series(s, "gpunet_infiniband_device_info")]
    assert {"device": "mlx5_9", "fw_ver": ""}.items() <= next(
        i for i in info if i["device"] == "mlx5_9").items()


def test_eacces_for_real_as_unprivileged_user(tmp_path: Path) -> None:
    """mode 000 files give a real EACCES to a non-root reader; root is dropped for this."""
    base = Path(tempfile.mkdtemp(prefix="gpunet-eacces-"))
    try:
        base.chmod(0o755)
        sysfs = st.build_dgx_h100(base)
        st.make_unreadable(sysfs, "mlx5_4")
        code = (
            "import os, sys\n"
            "sys.path.insert(0, sys.argv[2])\n"
            "from support.metrics import collect, value\n"
            "from gpunet_exporter.collectors.infiniband import InfinibandCollector\n"
            "if os.geteuid() == 0:  # imports done: root's pyenv is not readable for nobody\n"
            "    os.setgid(65534); os.setuid(65534)\n"
            "s, n = collect(InfinibandCollector, sys.argv[1])\n"
            "print(n, value(s, 'gpunet_infiniband_port_symbol_errors_total', device='mlx5_4',"
            " port='1'), value(s, 'gpunet_infiniband_port_link_downed_total', device='mlx5_4',"
            " port='1') is not None, len([k for k in s if k[0].endswith('info')]))\n")
        res = subprocess.run([sys.executable, "-c", code, str(sysfs), str(Path(__file__).parent)],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        n, symbol, link_downed, infos = res.stdout.split()
        assert int(n) == 3  # two EACCES files and one EISDIR
        assert symbol == "None" and link_downed == "True" and int(infos) == 20
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_garbage(dgx: Path) -> None:
    st.make_garbage(dgx, "mlx5_6")
    s, unreadable = run(dgx)
    assert unreadable == 3
    for name in ("gpunet_infiniband_port_link_downed_total", "gpunet_infiniband_port_vl15_dropped"
                 "_total", "gpunet_infiniband_port_rate_bytes_per_second",
                 "gpunet_infiniband_port_rate_degraded"):
        assert value(s, name, device="mlx5_6", port="1") is None, name
    assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_6", port="1") == 4
    assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_6",
                 port="1") is not None


def test_missing_hw_counters(dgx: Path) -> None:
    st.make_missing_hw_counters(dgx, "mlx5_7")
    s, unreadable = run(dgx)
    assert unreadable == 0  # a driver without hw counters is not an error
    assert not [k for k in s if ("device", "mlx5_7") in k[1] and "_hw_" in k[0]]
    assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_7",
                 port="1") is not None
    assert len(series(s, "gpunet_infiniband_port_hw_out_of_buffer_drops_total")) == 9


def test_dangling_device(dgx: Path) -> None:
    st.add_dangling_device(dgx, "mlx5_10")
    s, unreadable = run(dgx)
    assert unreadable == 0
    assert not [k for k in s if ("device", "mlx5_10") in k[1]]
    assert len(series(s, "gpunet_infiniband_device_info")) == 10


class VanishingRoot(Root):
    """Hot-unplug in the middle of a scrape: the device's directory is removed for real right
    after the collector has read its first attribute."""

    def __init__(self, root: str, device: str) -> None:
        super().__init__(root)
        self.device = device
        self.gone = False

    def read(self, rel: str) -> str:
        text = super().read(rel)
        if not self.gone and rel.startswith(f"class/infiniband/{self.device}/"):
            link = Path(self.path(f"class/infiniband/{self.device}"))
            shutil.rmtree(link.resolve())
            link.unlink()
            self.gone = True
        return text


def test_device_vanishes_mid_scrape(dgx: Path) -> None:
    root = VanishingRoot(str(dgx), "mlx5_4")
    s, _ = run(dgx, root=root)
    assert root.gone
    assert value(s, "gpunet_infiniband_port_symbol_errors_total", device="mlx5_4",
                 port="1") is None
    for dev in [d for d in IB + ROCE if d != "mlx5_4"]:
        assert value(s, "gpunet_infiniband_port_symbol_errors_total", device=dev,
                     port="1") is not None, dev


def test_include_exclude(dgx: Path) -> None:
    import re
    s, _ = run(dgx, {"device_include": "^mlx5_[0-3]$", "device_exclude": "mlx5_2"})
    devs = {dict(lbl)["device"] for lbl in series(s, "gpunet_infiniband_device_info")}
    assert devs == {"mlx5_0", "mlx5_1", "mlx5_3"}
    assert re  # the config loader compiles the patterns


def test_no_infiniband_class(tmp_path: Path) -> None:
    (tmp_path / "class").mkdir()
    s, unreadable = run(tmp_path)
    assert s == {} and unreadable == 0


def test_upstream_node_exporter_tree() -> None:
    sysfs = UPSTREAM / "node_exporter-sysfs-infiniband/tree/sys"
    s, unreadable = run(sysfs)
    # i40iw0: every counter "N/A (no PMA)", old "10 Gb/sec (4X)" rate without a speed name.
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device="i40iw0",
                 port="1") == 10 * GBIT
    assert value(s, "gpunet_infiniband_port_lane_speed_bytes_per_second", device="i40iw0",
                 port="1") == 2.5 * GBIT
    assert not [k for k in s if k[0].endswith("_total") and ("device", "i40iw0") in k[1]]
    assert unreadable == 17
    # mlx4_0: counters_ext/ (pre-4.5 kernels) takes precedence over counters/.
    assert value(s, "gpunet_infiniband_port_received_packets_total", device="mlx4_0",
                 port="1") == 0
    assert value(s, "gpunet_infiniband_port_received_bytes_total", device="mlx4_0",
                 port="2") == 4 * 4631917
    assert value(s, "gpunet_infiniband_port_pma_saturated", device="mlx4_0", port="1",
                 counter="port_xmit_wait") == 1
    assert value(s, "gpunet_infiniband_port_transmit_wait_ticks_total", device="mlx4_0",
                 port="1") == 4294967295


def test_upstream_procfs_tree() -> None:
    sysfs = UPSTREAM / "procfs-sysfs-infiniband/tree/sys"
    s, unreadable = run(sysfs)
    assert unreadable == 0
    devs = {dict(lbl)["device"]: dict(lbl) for lbl in series(s, "gpunet_infiniband_device_info")}
    assert set(devs) == {"hfi1_0", "mlx4_0", "mlx5_0"}
    assert devs["mlx5_0"]["node_guid"]  # no trailing newline in the fixture
    assert value(s, "gpunet_infiniband_port_phys_state_id", device="mlx5_0", port="1") == 4
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device="mlx5_0",
                 port="1") == 25 * GBIT
    assert len(series(s, "gpunet_infiniband_port_state_id")) == 4  # mlx4_0 has two ports
    hw = [k for k in s if k[0].startswith("gpunet_infiniband_port_hw_") and
          ("device", "mlx5_0") in k[1]]
    assert len(hw) == len(list((sysfs / "class/infiniband/mlx5_0/ports/1/hw_counters")
                               .iterdir())) - 1  # every file but lifespan


def test_device_info_reread_when_device_is_recreated(dgx: Path) -> None:
    c = make_collector(InfinibandCollector, dgx)
    first = samples_of(list(c.collect(Scrape())))
    old = next(dict(lbl) for lbl in series(first, "gpunet_infiniband_device_info")
               if ("device", "mlx5_0") in lbl)
    # A firmware update plus driver reload re-creates the device: a new directory.
    link = dgx / "class/infiniband/mlx5_0"
    real = link.resolve()
    fresh = real.with_name("mlx5_0.new")
    shutil.copytree(real, fresh, symlinks=True)
    (fresh / "fw_ver").write_text("28.40.1000\n")
    shutil.rmtree(real)
    fresh.rename(real)
    second = samples_of(list(c.collect(Scrape())))
    new = next(dict(lbl) for lbl in series(second, "gpunet_infiniband_device_info")
               if ("device", "mlx5_0") in lbl)
    assert old["fw_ver"] == "28.39.2048" and new["fw_ver"] == "28.40.1000"
    assert {k: v for k, v in new.items() if k != "fw_ver"} == {
        k: v for k, v in old.items() if k != "fw_ver"}


# ---- inventory (issue 16): devices, ports and netdevs that were there and are gone ------------


def _inventory(s: Samples, name: str) -> dict[str, float]:
    return {dict(lbl)["kind"]: v for lbl, v in series(s, name).items()}


def _missing_names(s: Samples) -> set[tuple[str, str]]:
    return {(dict(lbl)["kind"], dict(lbl)["name"])
            for lbl in series(s, "gpunet_inventory_missing_info")}


def test_inventory_learns_persists_and_notices_a_device_gone(dgx: Path, tmp_path: Path) -> None:
    state = tmp_path / "state" / "inventory.json"
    state.parent.mkdir()
    cfg = {"inventory_state_file": str(state)}
    c = make_collector(InfinibandCollector, dgx, cfg)
    s = samples_of(list(c.collect(Scrape())))
    assert _inventory(s, "gpunet_inventory_expected") == {
        "rdma_device": 10, "rdma_port": 10, "netdev": 10}
    assert _inventory(s, "gpunet_inventory_missing") == dict.fromkeys(
        ("rdma_device", "rdma_port", "netdev"), 0)
    assert _missing_names(s) == set()
    doc = json.loads(state.read_text())
    assert doc["version"] == 1 and len(doc["rdma_device"]) == 10 and "mlx5_3/1" in doc["rdma_port"]
    assert [p.name for p in state.parent.iterdir()] == ["inventory.json"]  # no temporary left

    # The NIC falls off the bus: its device, port and netdev are gone, in this process...
    netdev = next(dict(lbl)["interface"] for lbl in series(s, "gpunet_infiniband_port_info")
                  if ("device", "mlx5_3") in lbl)
    (dgx / "class/infiniband/mlx5_3").unlink()
    s = samples_of(list(c.collect(Scrape())))
    c.close()
    missing = _inventory(s, "gpunet_inventory_missing")
    assert missing == {"rdma_device": 1, "rdma_port": 1, "netdev": 1}
    assert _inventory(s, "gpunet_inventory_expected")["rdma_device"] == 10
    assert _inventory(s, "gpunet_inventory_present")["rdma_device"] == 9
    names = _missing_names(s)
    assert {("rdma_device", "mlx5_3"), ("rdma_port", "mlx5_3/1")} <= names
    assert len(names) == 3 and ("netdev", netdev) in names

    # ... and after a restart, from the state file.
    s, _ = run(dgx, cfg)
    assert _inventory(s, "gpunet_inventory_missing")["rdma_device"] == 1
    # A reader that must not learn (the doctor) sees the same and writes nothing.
    before = state.read_bytes()
    c = build_collector(InfinibandCollector, cfg, sysfs=str(dgx), learn=False)
    s = samples_of(list(c.collect(Scrape())))
    assert _inventory(s, "gpunet_inventory_missing")["rdma_device"] == 1
    assert state.read_bytes() == before

    # Reset after a planned removal: delete the file; the next start learns afresh.
    state.unlink()
    s, _ = run(dgx, cfg)
    assert _inventory(s, "gpunet_inventory_missing")["rdma_device"] == 0
    assert _inventory(s, "gpunet_inventory_expected")["rdma_device"] == 9
    assert len(json.loads(state.read_text())["rdma_device"]) == 9


def test_inventory_without_a_state_file_learns_in_memory(dgx: Path) -> None:
    c = make_collector(InfinibandCollector, dgx)
    c.collect(Scrape())
    (dgx / "class/infiniband/mlx5_8").unlink()
    s = samples_of(list(c.collect(Scrape())))
    c.close()
    assert _inventory(s, "gpunet_inventory_missing")["rdma_device"] == 1
    s, _ = run(dgx)  # a new process forgets
    assert _inventory(s, "gpunet_inventory_missing")["rdma_device"] == 0


def test_inventory_unwritable_state_dir_falls_back_to_memory(dgx: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    c = make_collector(InfinibandCollector, dgx,
                       {"inventory_state_file": str(blocker / "inventory.json")})
    with caplog.at_level("WARNING", logger="gpunet"):
        c.collect(Scrape())
        (dgx / "class/infiniband/mlx5_0").unlink()
        s = samples_of(list(c.collect(Scrape())))
    c.close()
    assert _inventory(s, "gpunet_inventory_missing")["rdma_device"] == 1
    assert any("learning in memory only" in r.getMessage() for r in caplog.records)


def test_inventory_ignores_a_corrupt_or_huge_state_file(dgx: Path, tmp_path: Path) -> None:
    state = tmp_path / "inventory.json"
    for content in ("{not json", '{"version": 1, "rdma_device": 5}', "x" * 300_000,
                    '{"version": 2}'):
        state.write_text(content)
        s, _ = run(dgx, {"inventory_state_file": str(state)})
        assert _inventory(s, "gpunet_inventory_missing")["rdma_device"] == 0
        assert len(json.loads(state.read_text())["rdma_device"]) == 10  # rewritten


def test_inventory_configured_counts(dgx: Path) -> None:
    s, _ = run(dgx, {"inventory_expected": {"rdma_devices": 11, "rdma_ports": 10}})
    assert _inventory(s, "gpunet_inventory_expected") == {
        "rdma_device": 11, "rdma_port": 10, "netdev": 10}
    assert _inventory(s, "gpunet_inventory_missing") == {
        "rdma_device": 1, "rdma_port": 0, "netdev": 0}
    assert _missing_names(s) == set()  # a configured count names nobody


def test_inventory_state_learned_outside_the_filter_is_not_expected(dgx: Path,
                                                                    tmp_path: Path) -> None:
    state = tmp_path / "inventory.json"
    state.write_text(json.dumps({"version": 1, "rdma_device": ["mlx5_0", "mlx5_42"],
                                 "rdma_port": [], "netdev": []}))
    s, _ = run(dgx, {"inventory_state_file": str(state), "device_exclude": "mlx5_4"})
    assert _missing_names(s) == set()
    s, _ = run(dgx, {"inventory_state_file": str(state)})
    assert _missing_names(s) == {("rdma_device", "mlx5_42")}


# ---- multi-plane ConnectX-8 and AWS EFA (docs/formats.md §1.8) --------------------------------


def test_multiplane_planes_without_data_have_no_state(tmp_path: Path) -> None:
    """A 4-plane ConnectX-8 lists 12 ports with data on 3/6/9/12 (sichek #98): the other eight,
    DOWN by design, carry carries_data 0 and no state, rate or expected rate to page on; the
    inventory still counts every port; each data port keeps its own netdev."""
    sysfs = st.build_cx8_multiplane(tmp_path)
    s, unreadable = run(sysfs)
    assert unreadable == 0
    for dev in ("roce_r0", "roce_r1"):
        for p in range(1, st.CX8_PORTS + 1):
            data = p in st.CX8_DATA_PORTS
            lbl = {"device": dev, "port": str(p)}
            assert value(s, "gpunet_infiniband_port_carries_data", **lbl) == (1 if data else 0)
            state = value(s, "gpunet_infiniband_port_state_id", **lbl)
            assert state == (4 if data else None)
            assert (value(s, "gpunet_infiniband_port_rate_degraded", **lbl)
                    == (0 if data else None))
        netdevs = {dict(lbl)["port"]: dict(lbl)["interface"]
                   for lbl in series(s, "gpunet_infiniband_port_info")
                   if dict(lbl)["device"] == dev}
        assert netdevs == {str(p): (f"eth_{dev[5:]}_p{st.CX8_DATA_PORTS.index(p)}"
                                    if p in st.CX8_DATA_PORTS else "")
                           for p in range(1, st.CX8_PORTS + 1)}
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device="roce_r0",
                 port="3") == 200 * GBIT
    assert _inventory(s, "gpunet_inventory_present") == {
        "rdma_device": 2, "rdma_port": 24, "netdev": 8}


def test_multiplane_data_plane_down_still_pages(tmp_path: Path) -> None:
    sysfs = st.build_cx8_multiplane(tmp_path)
    st.make_plane_down(sysfs, "roce_r1", 6)
    s, _ = run(sysfs)
    assert value(s, "gpunet_infiniband_port_state_id", device="roce_r1", port="6") == 1
    assert value(s, "gpunet_infiniband_port_phys_state_id", device="roce_r1", port="6") == 2
    assert value(s, "gpunet_infiniband_port_carries_data", device="roce_r1", port="6") == 1


def test_data_ports_from_config(tmp_path: Path) -> None:
    """infiniband.data_ports decides for the devices it names: here it says port 1 carries
    data, so the disabled port 1 is judged (and would page), and port 3 is not."""
    sysfs = st.build_cx8_multiplane(tmp_path)
    s, _ = run(sysfs, {"data_ports": [{"device": "^roce_r0$", "ports": [1]}]})
    assert value(s, "gpunet_infiniband_port_carries_data", device="roce_r0", port="1") == 1
    assert value(s, "gpunet_infiniband_port_state_id", device="roce_r0", port="1") == 1
    assert value(s, "gpunet_infiniband_port_carries_data", device="roce_r0", port="3") == 0
    assert value(s, "gpunet_infiniband_port_state_id", device="roce_r0", port="3") is None
    # roce_r1, which no rule names, keeps the listing's judgement
    assert value(s, "gpunet_infiniband_port_state_id", device="roce_r1", port="3") == 4
    # No ports: a device none of whose ports carries data (an SMI sub-device's planes)
    s, _ = run(sysfs, {"data_ports": [{"device": "^roce_r1$", "ports": []}]})
    assert value(s, "gpunet_infiniband_port_carries_data", device="roce_r1", port="3") == 0
    assert value(s, "gpunet_infiniband_port_state_id", device="roce_r1", port="3") is None
    for bad in ({"device": "x"}, {"device": "x", "ports": [0]}):
        with pytest.raises(ConfigError):
            make_collector(InfinibandCollector, sysfs, {"data_ports": [bad]})


def test_efa_counters_mapped(tmp_path: Path) -> None:
    """An EFA port: link layer "Unknown", always ACTIVE, its rate from the device's link speed,
    no counters/ directory; hw_counters' bytes and packets feed the byte and packet families
    the rules read, and the SRD retransmission counters have names of their own."""
    sysfs = st.build_efa(tmp_path)
    s, unreadable = run(sysfs)
    assert unreadable == 0
    dev = st.efa_name(st.EFA_BUSES[0])
    lbl = {"device": dev, "port": "1"}
    assert value(s, "gpunet_infiniband_port_info", **lbl, link_layer="Unknown",
                 interface="") == 1
    assert value(s, "gpunet_infiniband_port_state_id", **lbl) == 4
    assert value(s, "gpunet_infiniband_port_carries_data", **lbl) == 1
    assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", **lbl) == 100 * GBIT
    assert value(s, "gpunet_infiniband_port_rate_degraded", **lbl) == 0
    stats = st._efa_port_stats(0)
    assert value(s, "gpunet_infiniband_port_transmitted_bytes_total", **lbl) == stats["tx_bytes"]
    assert value(s, "gpunet_infiniband_port_received_bytes_total", **lbl) == stats["rx_bytes"]
    assert value(s, "gpunet_infiniband_port_transmitted_packets_total", **lbl) == stats["tx_pkts"]
    assert value(s, "gpunet_infiniband_port_hw_retransmitted_packets_total", **lbl) == (
        stats["retrans_pkts"])
    assert value(s, "gpunet_infiniband_port_hw_retransmit_timeouts_total", **lbl) == 3
    assert value(s, "gpunet_infiniband_port_hw_unresponsive_remote_events_total", **lbl) == 0
    generic = _hw_series(s, "gpunet_infiniband_port_hw_total", **lbl)
    assert "tx_bytes" not in generic and "retrans_pkts" not in generic
    assert generic["rdma_write_bytes"] == stats["rdma_write_bytes"]  # uncurated: kept generic
    assert _hw_series(s, "gpunet_infiniband_device_hw_total", device=dev)["keep_alive_rcvd"] > 0
    assert _inventory(s, "gpunet_inventory_present") == {"rdma_device": 4, "rdma_port": 4}


def test_efa_bytes_do_not_shadow_pma_counters(dgx: Path) -> None:
    """A port with counters/ keeps its PMA bytes; a hw_counters tx_bytes there (another
    driver's) stays a generic counter."""
    hw = dgx / "class/infiniband/mlx5_0/ports/1/hw_counters"
    (hw / "tx_bytes").write_text("5\n")
    s, _ = run(dgx)
    assert value(s, "gpunet_infiniband_port_transmitted_bytes_total", device="mlx5_0",
                 port="1") == counter_file(dgx, "mlx5_0", "port_xmit_data") * 4
    assert _hw_series(s, "gpunet_infiniband_port_hw_total", device="mlx5_0")["tx_bytes"] == 5


def test_multiplane_data_port_losing_its_netdev_is_a_netdev_missing(tmp_path: Path) -> None:
    """The limit of the judgement: a data plane whose netdev vanishes (its GIDs go with it)
    looks like a plane without data from then on, so it has no state to page on; the inventory,
    which learned the netdev, notices it gone (GpunetRdmaDeviceMissing, kind netdev)."""
    sysfs = st.build_cx8_multiplane(tmp_path)
    c = make_collector(InfinibandCollector, sysfs)
    c.collect(Scrape())
    port = sysfs / "class/infiniband/roce_r0/ports/3"
    for f in (port / "gid_attrs/ndevs").iterdir():
        f.unlink()
    shutil.rmtree(sysfs / "class/infiniband/roce_r0/device/net/eth_r0_p0")
    (sysfs / "class/net/eth_r0_p0").unlink()
    s = samples_of(list(c.collect(Scrape())))
    c.close()
    assert value(s, "gpunet_infiniband_port_carries_data", device="roce_r0", port="3") == 0
    assert _missing_names(s) == {("netdev", "eth_r0_p0")}
