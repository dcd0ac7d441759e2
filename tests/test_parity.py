"""Parity with node_exporter's infiniband collector (Debian's prometheus-node-exporter 1.5.0).

Both exporters scrape the same sysfs tree; every InfiniBand counter node_exporter exports must be
exported by us with the same value for the same device and port, and so must its state, physical
state and rate gauges and its device info attributes. A node_exporter name that is neither mapped
nor explicitly declared not comparable fails the test, so a new upstream counter cannot slip by.

Fault trees are not parity inputs: node_exporter (procfs) may drop a whole device for one bad
file, where we drop only the bad value.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from support import sysfs_tree as st
from support.exporter import Exporter, free_port
from support.metrics import parse, series, value
from support.paths import UPSTREAM
from support.wait import wait_for

NODE_EXPORTER = "prometheus-node-exporter"

# node_exporter 1.5.0 counter name -> our metric name (names checked by scraping node_exporter
# 1.5.0 on the three trees below). The legacy_* names are node_exporter's view of counters_ext/
# (64-bit *_64 files of kernels before 4.5); see SUPERSEDED_BY_LEGACY.
COUNTERS: dict[str, str] = {
    "node_infiniband_symbol_error_total": "gpunet_infiniband_port_symbol_errors_total",
    "node_infiniband_link_error_recovery_total":
        "gpunet_infiniband_port_link_error_recoveries_total",
    "node_infiniband_link_downed_total": "gpunet_infiniband_port_link_downed_total",
    "node_infiniband_port_errors_received_total": "gpunet_infiniband_port_receive_errors_total",
    "node_infiniband_port_receive_remote_physical_errors_total":
        "gpunet_infiniband_port_receive_remote_physical_errors_total",
    "node_infiniband_port_receive_switch_relay_errors_total":
        "gpunet_infiniband_port_receive_switch_relay_errors_total",
    "node_infiniband_port_discards_transmitted_total":
        "gpunet_infiniband_port_transmit_discards_total",
    "node_infiniband_port_discards_received_total":
        "gpunet_infiniband_port_receive_discards_total",
    "node_infiniband_port_constraint_errors_transmitted_total":
        "gpunet_infiniband_port_transmit_constraint_errors_total",
    "node_infiniband_port_constraint_errors_received_total":
        "gpunet_infiniband_port_receive_constraint_errors_total",
    "node_infiniband_local_link_integrity_errors_total":
        "gpunet_infiniband_port_local_link_integrity_errors_total",
    "node_infiniband_excessive_buffer_overrun_errors_total":
        "gpunet_infiniband_port_excessive_buffer_overrun_errors_total",
    "node_infiniband_vl15_dropped_total": "gpunet_infiniband_port_vl15_dropped_total",
    "node_infiniband_port_data_transmitted_bytes_total":
        "gpunet_infiniband_port_transmitted_bytes_total",
    "node_infiniband_port_data_received_bytes_total": "gpunet_infiniband_port_received_bytes_total",
    "node_infiniband_port_packets_transmitted_total":
        "gpunet_infiniband_port_transmitted_packets_total",
    "node_infiniband_port_packets_received_total": "gpunet_infiniband_port_received_packets_total",
    "node_infiniband_unicast_packets_transmitted_total":
        "gpunet_infiniband_port_unicast_transmitted_packets_total",
    "node_infiniband_unicast_packets_received_total":
        "gpunet_infiniband_port_unicast_received_packets_total",
    "node_infiniband_multicast_packets_transmitted_total":
        "gpunet_infiniband_port_multicast_transmitted_packets_total",
    "node_infiniband_multicast_packets_received_total":
        "gpunet_infiniband_port_multicast_received_packets_total",
    "node_infiniband_port_transmit_wait_total": "gpunet_infiniband_port_transmit_wait_ticks_total",
    # counters_ext/ (pre-4.5 kernels)
    "node_infiniband_legacy_data_transmitted_bytes_total":
        "gpunet_infiniband_port_transmitted_bytes_total",
    "node_infiniband_legacy_data_received_bytes_total":
        "gpunet_infiniband_port_received_bytes_total",
    "node_infiniband_legacy_packets_transmitted_total":
        "gpunet_infiniband_port_transmitted_packets_total",
    "node_infiniband_legacy_packets_received_total":
        "gpunet_infiniband_port_received_packets_total",
    "node_infiniband_legacy_unicast_packets_transmitted_total":
        "gpunet_infiniband_port_unicast_transmitted_packets_total",
    "node_infiniband_legacy_unicast_packets_received_total":
        "gpunet_infiniband_port_unicast_received_packets_total",
    "node_infiniband_legacy_multicast_packets_transmitted_total":
        "gpunet_infiniband_port_multicast_transmitted_packets_total",
    "node_infiniband_legacy_multicast_packets_received_total":
        "gpunet_infiniband_port_multicast_received_packets_total",
}  # fmt: skip

# Where a port has both a counters/ file and its counters_ext/ 64-bit twin, node_exporter exports
# both (plain and legacy_* name) and we export one value, deliberately from counters_ext/ (the
# 32-bit counters/ file of those kernels saturates; collectors/data/infiniband_counters.csv:
# "64-bit versions that take precedence over counters/"). There the plain series is compared
# with the legacy one's value, not with node_exporter's counters/ value; every such case is
# counted and reported by the test, never skipped silently.
SUPERSEDED_BY_LEGACY: dict[str, str] = {
    "node_infiniband_port_data_transmitted_bytes_total":
        "node_infiniband_legacy_data_transmitted_bytes_total",
    "node_infiniband_port_data_received_bytes_total":
        "node_infiniband_legacy_data_received_bytes_total",
    "node_infiniband_port_packets_transmitted_total":
        "node_infiniband_legacy_packets_transmitted_total",
    "node_infiniband_port_packets_received_total": "node_infiniband_legacy_packets_received_total",
    "node_infiniband_unicast_packets_transmitted_total":
        "node_infiniband_legacy_unicast_packets_transmitted_total",
    "node_infiniband_unicast_packets_received_total":
        "node_infiniband_legacy_unicast_packets_received_total",
    "node_infiniband_multicast_packets_transmitted_total":
        "node_infiniband_legacy_multicast_packets_transmitted_total",
    "node_infiniband_multicast_packets_received_total":
        "node_infiniband_legacy_multicast_packets_received_total",
}  # fmt: skip

# node_exporter counters with no counterpart to compare against, each with the reason. Empty:
# node_exporter 1.5.0 exports nothing we do not. (hw_counters/ are not exported by 1.5.0; a later
# node_exporter that adds them fails the test until they are mapped or listed here.)
NOT_COMPARABLE: dict[str, str] = {}

GAUGES: dict[str, str] = {
    "node_infiniband_state_id": "gpunet_infiniband_port_state_id",
    "node_infiniband_physical_state_id": "gpunet_infiniband_port_phys_state_id",
    "node_infiniband_rate_bytes_per_second": "gpunet_infiniband_port_rate_bytes_per_second",
}
# node_infiniband_info label -> gpunet_infiniband_device_info label
INFO_LABELS: dict[str, str] = {
    "device": "device", "board_id": "board_id", "firmware_version": "fw_ver",
    "hca_type": "hca_type",
}  # fmt: skip

Scrape = Callable[[Path], str]


def _wait_metrics(url: str, proc: subprocess.Popen[str], what: str) -> None:
    def answers() -> bool:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"{what} exited {proc.returncode}: {err}")
        return requests.get(url, timeout=2).status_code == 200

    wait_for(answers, f"{what} to answer {url}", timeout=20, ignore=(requests.ConnectionError,))


@pytest.fixture
def node_exporter() -> Iterator[Scrape]:
    """Scrape node_exporter's infiniband collector (and nothing else) on a sysfs tree."""
    exe = shutil.which(NODE_EXPORTER)
    assert exe, f"{NODE_EXPORTER} is not installed (tests/run.sh installs it as root)"
    procs: list[subprocess.Popen[str]] = []

    def scrape(sysfs: Path) -> str:
        address = f"127.0.0.1:{free_port()}"
        url = f"http://{address}/metrics"
        proc = subprocess.Popen(
            [exe, "--collector.disable-defaults", "--collector.infiniband",
             f"--path.sysfs={sysfs}", f"--web.listen-address={address}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(proc)
        _wait_metrics(url, proc, NODE_EXPORTER)
        r = requests.get(url, timeout=30)
        r.raise_for_status()
        return r.text

    yield scrape
    for proc in procs:
        proc.kill()
        proc.communicate()


def _show(name: str, labels: frozenset[tuple[str, str]], v: float | None = None) -> str:
    """name{a="x",b="y"} [value], labels sorted, integral values without a fraction."""
    text = name + "{" + ",".join(f'{k}="{x}"' for k, x in sorted(labels)) + "}"
    if v is not None:
        text += f" {int(v) if float(v).is_integer() else v}"
    return text


def _port_key(labels: frozenset[tuple[str, str]]) -> tuple[str, str]:
    d = dict(labels)
    return d["device"], d["port"]


def _dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path)


def _dgx_distinct(tmp_path: Path) -> Path:
    """The DGX tree with a different value in every counters/ file of a port, so a mapping that
    pairs the wrong two counters fails (in the plain tree most error counters are 0). Values fit
    each file's PMA field (1..11 in the 4-bit ones, 16..165 elsewhere): valid kernel output."""
    sysfs = st.build_dgx_h100(tmp_path)
    nibble = ("local_link_integrity_errors", "excessive_buffer_overrun_errors")
    for n, nic in enumerate(st.DGX_NICS):
        counters = sysfs / "class/infiniband" / nic.ibdev / "ports/1/counters"
        for k, name in enumerate(st.PORT_COUNTERS):
            v = 1 + n + nibble.index(name) if name in nibble else 16 + 7 * k + n
            (counters / name).write_text(f"{v}\n")
    return sysfs


# tree -> (sysfs path builder, minimum number of counter series compared, counters/ series
# superseded by counters_ext/ values)
TREES: dict[str, tuple[Callable[[Path], Path], int, int]] = {
    "dgx-h100": (_dgx, 210, 0),  # 10 ports x 21 counters/ files
    "dgx-h100-distinct-counters": (_dgx_distinct, 210, 0),
    "node_exporter-fixture": (
        lambda _: UPSTREAM / "node_exporter-sysfs-infiniband/tree/sys", 40, 14),
    "procfs-fixture": (lambda _: UPSTREAM / "procfs-sysfs-infiniband/tree/sys", 72, 0),
}


@pytest.mark.parametrize("tree", list(TREES))
def test_parity_with_node_exporter(tree: str, tmp_path: Path, node_exporter: Scrape,
                                   run_exporter: Callable[..., Exporter]) -> None:
    build, min_counters, want_superseded = TREES[tree]
    sysfs = build(tmp_path)
    assert (sysfs / "class/infiniband").is_dir(), sysfs
    theirs = parse(node_exporter(sysfs))
    ours = parse(run_exporter("--collector.disable-defaults", "--collector.infiniband",
                              f"--path.sysfs={sysfs}").metrics())

    assert value(theirs, "node_scrape_collector_success", collector="infiniband") == 1
    assert value(ours, "gpunet_scrape_collector_success", collector="infiniband") == 1

    names = {name for name, _ in theirs if name.startswith("node_infiniband_")}
    unknown = sorted(n for n in names - set(COUNTERS) - set(NOT_COMPARABLE) - set(GAUGES)
                     - {"node_infiniband_info"})
    assert not unknown, f"node_exporter exports names this test does not map: {unknown}"

    mismatches: list[str] = []
    superseded: list[str] = []
    compared = 0
    # For each of our metrics, the (device, port) pairs node_exporter has a series for.
    expected_ports: dict[str, set[tuple[str, str]]] = {}
    for (name, labels), theirs_value in theirs.items():
        if name not in COUNTERS:
            continue
        our_name = COUNTERS[name]
        expected_ports.setdefault(our_name, set()).add(_port_key(labels))
        legacy = SUPERSEDED_BY_LEGACY.get(name)
        if legacy is not None and (legacy, labels) in theirs:
            want = theirs[(legacy, labels)]
            superseded.append(f"{_show(name, labels, theirs_value)} from counters/, but "
                              f"{_show(legacy, labels, want)} from counters_ext/")
        else:
            want = theirs_value
        got = ours.get((our_name, labels))
        compared += 1
        if got != want:
            mismatches.append(f"node_exporter {_show(name, labels, want)}, ours "
                              f"{_show(our_name, labels, got) if got is not None else 'absent'}")
    # And the other way: no mapped metric of ours has a series node_exporter lacks.
    for our_name, ports in expected_ports.items():
        extra = {_port_key(lbl) for lbl in series(ours, our_name)} - ports
        if extra:
            mismatches.append(f"{our_name} has series node_exporter lacks: {sorted(extra)}")

    gauges = 0
    for name, our_name in GAUGES.items():
        theirs_series = series(theirs, name)
        ours_series = series(ours, our_name)
        assert theirs_series, f"node_exporter exports no {name}"
        for labels, theirs_value in theirs_series.items():
            gauges += 1
            if ours_series.get(labels) != theirs_value:
                mismatches.append(f"node_exporter {_show(name, labels, theirs_value)}, ours "
                                  f"{_show(our_name, labels, ours_series.get(labels))}")
        if set(ours_series) != set(theirs_series):
            mismatches.append(f"{our_name}: ports {sorted(map(_port_key, ours_series))} "
                              f"differ from {name}'s {sorted(map(_port_key, theirs_series))}")

    theirs_info = {
        dict(lbl)["device"]: {INFO_LABELS[k]: v for k, v in lbl} for lbl in
        series(theirs, "node_infiniband_info")
    }  # fmt: skip
    ours_info = {
        dict(lbl)["device"]: {k: v for k, v in lbl if k in INFO_LABELS.values()}
        for lbl in series(ours, "gpunet_infiniband_device_info")
    }  # fmt: skip
    assert theirs_info, "node_exporter exports no node_infiniband_info"
    if ours_info != theirs_info:
        mismatches.append(f"device info differs: node_exporter {theirs_info}, ours {ours_info}")

    assert not mismatches, "\n".join(
        [f"{len(mismatches)} of {compared} counters / {gauges} gauges differ:", *mismatches])
    assert compared >= min_counters, f"only {compared} counter series compared"
    assert gauges == 3 * len({_port_key(lbl) for lbl in series(theirs, "node_infiniband_state_id")})
    assert len(superseded) == want_superseded, "\n".join(
        ["counters/ series whose value we take from counters_ext/:", *superseded])
    print(f"{tree}: {compared} counter series, {gauges} gauges, {len(theirs_info)} devices equal; "
          f"{len(superseded)} counters/ series taken from counters_ext/ instead:",
          *superseded, sep="\n  ")
