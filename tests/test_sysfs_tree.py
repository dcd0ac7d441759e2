"""Tests for the fake sysfs builder (tests/support/sysfs_tree.py) and the committed example tree."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from gpunet_exporter.sources.qos import QOS_FILES, parse_mlnx_qos, parse_qos_sysfs

from support import sysfs_tree as st

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
EXAMPLE = EXAMPLES / "dgx-h100"
EXAMPLE_FAULTY = EXAMPLES / "dgx-h100-faulty"

IB_DEVICES = [f"mlx5_{i}" for i in range(8)]
ROCE_DEVICES = ["mlx5_8", "mlx5_9"]
NETDEV_OF = {
    "mlx5_0": "ibp24s0", "mlx5_1": "ibp64s0", "mlx5_2": "ibp79s0", "mlx5_3": "ibp94s0",
    "mlx5_4": "ibp154s0", "mlx5_5": "ibp192s0", "mlx5_6": "ibp206s0", "mlx5_7": "ibp220s0",
    "mlx5_8": "enp41s0f0np0", "mlx5_9": "enp170s0f0np0",
}  # fmt: skip

RATE = re.compile(r"^(\d+(?:\.5)?) Gb/sec \((\d+)X(?: (\w+))?\)$")
STATE = re.compile(r"^\d+: .+$")
GUID = re.compile(r"^[0-9a-f]{4}(?::[0-9a-f]{4}){3}\n$")
GID = re.compile(r"^[0-9a-f]{4}(?::[0-9a-f]{4}){7}\n$")
DECIMAL = re.compile(r"^\d+\n$")

Entry = tuple[str, bytes, int]  # kind ("dir", "file", "link"), content or link target, mode


def snapshot(root: Path, modes: bool = False) -> dict[str, Entry]:
    """Every path under root (symlinks not followed): kind, content or target, mode."""
    tree: dict[str, Entry] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            mode = stat.S_IMODE(path.lstat().st_mode) if modes else 0
            if path.is_symlink():
                tree[rel] = ("link", os.readlink(path).encode(), 0)
            elif path.is_dir():
                tree[rel] = ("dir", b"", mode)
            else:
                try:
                    content = path.read_bytes()
                except PermissionError:  # mode 000 and not root
                    content = b"<unreadable>"
                tree[rel] = ("file", content, mode)
    return tree


@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path)


def read(path: Path) -> str:
    return path.read_text(encoding="ascii")


@pytest.mark.parametrize("example, build, command", [
    (EXAMPLE, st.build_dgx_h100_example, "python tests/support/sysfs_tree.py examples/dgx-h100"),
    (EXAMPLE_FAULTY, st.build_dgx_h100_faulty,
     "python tests/support/sysfs_tree.py --faulty examples/dgx-h100-faulty"),
], ids=["healthy", "faulty"])
def test_committed_example_matches_generator(
    tmp_path: Path, example: Path, build: Callable[[Path], Path], command: str
) -> None:
    assert example.is_dir(), f"run: {command}"
    build(tmp_path)
    generated, committed = snapshot(tmp_path), snapshot(example)
    # Beside the generated tree, its hand-written configuration (test_doctor.py runs it).
    assert committed.pop(st.EXAMPLE_CONFIG)[0] == "file"
    assert sorted(generated) == sorted(committed), f"{example.name} is stale; run: {command}"
    stale = [path for path in generated if generated[path] != committed[path]]
    assert not stale, f"{example.name} is stale; run: {command}"


def test_faulty_example_differs_by_its_faults(dgx: Path, tmp_path: Path) -> None:
    faulty = st.build_dgx_h100_faulty(tmp_path / "faulty")
    changed = _changes(snapshot(dgx), snapshot(faulty))
    roce_qos = st._netdev(faulty, "mlx5_9")
    assert read(faulty / "class/infiniband/mlx5_5/ports/1/rate") == "200 Gb/sec (2X NDR)\n"
    assert read(faulty / "class/infiniband/mlx5_3/ports/1/state") == "1: DOWN\n"
    assert read(faulty / "class/net/ibp94s0/operstate") == "down\n"
    assert read(faulty / "class/net/enp41s0f0np0/mtu") == "1500\n"
    assert read(roce_qos / "qos/trust") == "pcp\n"
    assert "5\t\t1\n" in read(roce_qos / "qos/prio2buffer")  # lossless buffer on priority 5
    assert read(roce_qos / "ecn/roce_np/enable/5") == "1\n"
    assert read(roce_qos / "ecn/roce_np/enable/3") == "0\n"
    # Nothing else differs from the healthy tree: the faults, and the OFED qos/ and ecn/ files.
    faults = {path for variant, expected in FAULTS for path in expected
              if variant in (st.make_port_down, st.make_port_degraded, st.make_mtu_1500)}
    real = faulty.resolve()
    qos_dir = roce_qos.resolve().relative_to(real).as_posix() + "/"
    assert {p for p in changed if not p.startswith(qos_dir)} == {
        (faulty / p).resolve().relative_to(real).as_posix() for p in faults}


def test_faulty_example_mlnx_qos_replays_the_same_configuration(tmp_path: Path) -> None:
    """The faulty node's recorded `mlnx_qos -i` report says what its qos/ files say (trust pcp,
    the lossless buffer on priority 5) plus what no sysfs file holds: PFC on priority 5 only.
    The replay script prints it for that netdev, a healthy one (PFC on 3) for the node's other
    RoCE netdev, and fails, as mlnx_qos does, for any other."""
    sys = st.build_dgx_h100_faulty(tmp_path)
    netdev = st._netdev(sys, "mlx5_9").name
    replay = tmp_path / "mlnx_qos" / "mlnx_qos"
    out = subprocess.run([str(replay), "-i", netdev], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    report = parse_mlnx_qos(out.stdout)
    from_sysfs = parse_qos_sysfs({name: read(sys / "class/net" / netdev / "qos" / name)
                                  for name in QOS_FILES})
    assert report.pfc == {p: p == 5 for p in range(8)}
    assert report.trust == from_sysfs.trust == "pcp"
    assert report.prio_buffer == from_sysfs.prio_buffer
    assert report.buffer_total == from_sysfs.buffer_total
    assert report.buffer_size == from_sysfs.buffer_size
    other = subprocess.run([str(replay), "-i", "enp41s0f0np0"], capture_output=True, text=True,
                           timeout=10)
    assert other.returncode == 0, other.stderr
    healthy = parse_mlnx_qos(other.stdout)
    assert healthy.pfc == {p: p == 3 for p in range(8)} and healthy.trust == "dscp"
    none = subprocess.run([str(replay), "-i", "ibp24s0"], capture_output=True, text=True,
                          timeout=10)
    assert none.returncode == 1 and none.stdout == ""


def test_mlnx_qos_report_with_dscp_trust_lists_the_default_map() -> None:
    report = parse_mlnx_qos(st.mlnx_qos_report(pfc_priority=3, trust="dscp"))
    assert report.trust == "dscp" and report.pfc[3] and not report.pfc[5]
    assert report.dscp_prio == {d: d >> 3 for d in range(64)}


def test_no_empty_directories(dgx: Path) -> None:
    # git cannot hold empty directories, so the committed copy would silently lack them
    empty = [d for d, subdirs, files in os.walk(dgx) if not subdirs and not files]
    assert not empty


def test_devices_and_netdevs(dgx: Path) -> None:
    ib = dgx / "class" / "infiniband"
    assert sorted(p.name for p in ib.iterdir()) == sorted(NETDEV_OF)
    netdevs = {*NETDEV_OF.values(), "eno1", "lo"}
    assert {p.name for p in (dgx / "class" / "net").iterdir()} == netdevs
    for device, netdev in NETDEV_OF.items():
        assert [p.name for p in (ib / device / "device" / "net").iterdir()] == [netdev]
        back = dgx / "class" / "net" / netdev / "device" / "infiniband" / device
        assert back.resolve() == (ib / device).resolve()
        numa = "1\n" if device in {"mlx5_4", "mlx5_5", "mlx5_6", "mlx5_7", "mlx5_9"} else "0\n"
        assert read(ib / device / "device" / "numa_node") == numa
    for device in ROCE_DEVICES:
        ndevs = ib / device / "ports" / "1" / "gid_attrs" / "ndevs"
        assert {read(p) for p in ndevs.iterdir()} == {NETDEV_OF[device] + "\n"}
        assert read(ib / device / "ports/1/link_layer") == "Ethernet\n"
        assert read(ib / device / "ports/1/gid_attrs/types/3") == "RoCE v2\n"
    for device in IB_DEVICES:
        assert read(ib / device / "ports/1/link_layer") == "InfiniBand\n"
    lids = {read(ib / d / "ports/1/lid") for d in IB_DEVICES}
    assert len(lids) == len(IB_DEVICES)
    assert not (dgx / "class/net/lo/device").exists()
    assert not (dgx / "class/net/lo/speed").exists()
    assert read(dgx / "class/net/eno1/device/vendor") == "0x8086\n"


def test_symlinks_relative_and_inside_tree(dgx: Path) -> None:
    root = dgx.resolve()
    links = [p for p in dgx.rglob("*") if p.is_symlink()]
    # class/infiniband/*, class/net/* (+ eno1, lo), device in each ibdev and PCI netdev (+ eno1)
    assert len(links) == 4 * len(NETDEV_OF) + 3
    for link in links:
        assert not os.path.isabs(os.readlink(link)), link
        assert link.exists(), f"dangling: {link}"
        assert link.resolve().is_relative_to(root), link


def test_kernel_formats(dgx: Path) -> None:
    ports = sorted(dgx.glob("class/infiniband/*/ports/*"))
    assert len(ports) == len(NETDEV_OF)
    for port in ports:
        assert RATE.match(read(port / "rate").rstrip("\n")), port
        assert read(port / "rate").endswith(")\n")
        for name in ("state", "phys_state"):
            assert STATE.match(read(port / name).rstrip("\n")), port / name
        assert all(GID.match(read(gid)) for gid in (port / "gids").iterdir())
    for device in dgx.glob("class/infiniband/*"):
        assert GUID.match(read(device / "node_guid")), device
        assert GUID.match(read(device / "sys_image_guid")), device
    guids = {read(d / "node_guid") for d in dgx.glob("class/infiniband/*")}
    assert len(guids) == len(NETDEV_OF)
    counters = [*dgx.glob("class/infiniband/*/ports/*/*counters/*")]
    assert len(counters) > 10 * (21 + 32)
    # mlx5 outside switchdev mode has no device-level hw_counters/
    assert not list(dgx.glob("class/infiniband/*/hw_counters"))
    bad = [str(c) for c in counters if not DECIMAL.match(read(c))]
    assert not bad
    assert all(DECIMAL.match(read(f)) for f in dgx.glob("class/net/*/statistics/*"))


def test_counter_values_realistic(dgx: Path) -> None:
    ib = dgx / "class" / "infiniband"
    xmit = [int(read(ib / d / "ports/1/counters/port_xmit_data")) for d in IB_DEVICES]
    assert any(x > 2**32 for x in xmit) and all(x < 2**64 for x in xmit)
    hw = ib / "mlx5_9" / "ports/1/hw_counters"
    assert int(read(hw / "np_cnp_sent")) > 0 and int(read(hw / "rp_cnp_handled")) > 0
    assert read(hw / "rp_cnp_ignored") == "0\n"
    assert read(hw / "lifespan") == "10\n"
    errors = [*st.PORT_COUNTERS[:12]]
    for device in ROCE_DEVICES:
        assert all(read(ib / device / "ports/1/counters" / e) == "0\n" for e in errors)
    # the made-up future firmware counter exists only on mlx5_9's port
    future = [p.relative_to(dgx).as_posix() for p in dgx.rglob("rx_future_fw_counter")]
    assert future == ["devices/pci0000:a9/0000:a9:01.0/0000:aa:00.0/infiniband/mlx5_9/"
                      "ports/1/hw_counters/rx_future_fw_counter"]  # fmt: skip


def _changes(before: dict[str, Entry], after: dict[str, Entry]) -> set[str]:
    return {p for p in before.keys() | after.keys() if before.get(p) != after.get(p)}


# variant, {path under sys/ (through class links): expected content}. Only these may change.
FAULTS: list[tuple[Callable[[Path], None], dict[str, str]]] = [
    (st.make_port_down, {
        "class/infiniband/mlx5_3/ports/1/state": "1: DOWN\n",
        "class/infiniband/mlx5_3/ports/1/phys_state": "3: Disabled\n",
        "class/net/ibp94s0/operstate": "down\n", "class/net/ibp94s0/carrier": "0\n",
        "class/net/ibp94s0/speed": "-1\n", "class/net/ibp94s0/carrier_changes": "3\n",
        "class/net/ibp94s0/carrier_down_count": "2\n",
    }),
    (st.make_port_degraded, {
        "class/infiniband/mlx5_5/ports/1/rate": "200 Gb/sec (2X NDR)\n",
        "class/net/ibp192s0/speed": "200000\n",
    }),
    (st.make_counters_saturated, {
        f"class/infiniband/mlx5_1/ports/1/counters/{name}": f"{value}\n" for name, value in {
            "symbol_error": 65535, "link_error_recovery": 255, "link_downed": 255,
            "port_rcv_errors": 65535, "local_link_integrity_errors": 15,
            "excessive_buffer_overrun_errors": 15, "port_xmit_wait": 4294967295,
        }.items()
    }),
    (st.make_no_pma, {
        f"class/infiniband/mlx5_2/ports/1/counters/{name}": "N/A (no PMA)\n"
        for name in st.PORT_COUNTERS
    }),
    (st.make_garbage, {
        "class/infiniband/mlx5_6/ports/1/counters/link_downed": "garbage\n",
        "class/infiniband/mlx5_6/ports/1/counters/VL15_dropped": "",
        "class/infiniband/mlx5_6/ports/1/rate": "fast\n",
    }),
    (st.make_mtu_1500, {"class/net/enp41s0f0np0/mtu": "1500\n"}),
]  # fmt: skip


@pytest.mark.parametrize("variant, expected", FAULTS, ids=lambda v: getattr(v, "__name__", None))
def test_fault_variant_contents(
    dgx: Path, variant: Callable[[Path], None], expected: dict[str, str]
) -> None:
    before = snapshot(dgx)
    variant(dgx)
    for path, content in expected.items():
        assert read(dgx / path) == content, path
    real = {(dgx / p).resolve().relative_to(dgx.resolve()).as_posix() for p in expected}
    assert _changes(before, snapshot(dgx)) == real


def test_make_unreadable(dgx: Path) -> None:
    port = dgx / "class/infiniband/mlx5_4/ports/1"
    before = snapshot(dgx, modes=True)
    st.make_unreadable(dgx)
    for rel in ("counters/symbol_error", "hw_counters/out_of_buffer"):
        assert stat.S_IMODE((port / rel).stat().st_mode) == 0, rel
    with pytest.raises(IsADirectoryError):
        (port / "counters/port_rcv_errors").read_text()
    assert len(_changes(before, snapshot(dgx, modes=True))) == 3


def test_make_missing_hw_counters(dgx: Path) -> None:
    device = dgx / "class/infiniband/mlx5_7"
    st.make_missing_hw_counters(dgx)
    assert not (device / "hw_counters").exists()
    assert not (device / "ports/1/hw_counters").exists()
    assert (device / "ports/1/counters/port_xmit_data").exists()
    assert (dgx / "class/infiniband/mlx5_6/ports/1/hw_counters").is_dir()


def test_make_switchdev(dgx: Path) -> None:
    device = dgx / "class/infiniband/mlx5_9"
    st.make_switchdev(dgx)
    names = {f.name for f in (device / "hw_counters").iterdir()}
    port_names = {f.name for f in (device / "ports/1/hw_counters").iterdir()}
    assert names == port_names - {st.FUTURE_HW_COUNTER[1]} and "lifespan" in names
    assert read(device / "hw_counters/np_cnp_sent") == read(device / "ports/1/hw_counters/"
                                                            "np_cnp_sent")


def test_add_dangling_device(dgx: Path) -> None:
    st.add_dangling_device(dgx)
    link = dgx / "class/infiniband/mlx5_10"
    assert link.is_symlink() and not link.exists()
    assert not os.path.isabs(os.readlink(link))


@pytest.mark.parametrize("ports", [2, 32, 41])
def test_build_scaled(tmp_path: Path, ports: int) -> None:
    sys = st.build_scaled(tmp_path, ports)
    devices = sorted(p.name for p in (sys / "class/infiniband").iterdir())
    assert devices == sorted(f"mlx5_{k}" for k in range(ports))
    assert len(list((sys / "class/net").iterdir())) == ports + 2  # + lo, eno1
    assert all(link.exists() for link in sys.rglob("*") if link.is_symlink())
    assert {read(p) for p in sys.glob("class/infiniband/*/ports/1/rate")} == {
        "400 Gb/sec (4X NDR)\n"
    }


def test_scaled_devices_match_dgx_ib_devices(dgx: Path, tmp_path: Path) -> None:
    scaled = st.build_scaled(tmp_path / "scaled", 2)
    for device in ("mlx5_0", "mlx5_1"):
        a = snapshot(dgx / "class/infiniband" / device)
        b = snapshot(scaled / "class/infiniband" / device)
        assert a.keys() == b.keys()
        assert {k for k in a if a[k] != b[k]} == {"device"}  # only the PCI address differs


def test_build_scaled_rejects_zero(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        st.build_scaled(tmp_path, 0)
