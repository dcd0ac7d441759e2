"""One listing of the RDMA devices per scrape (issue 17): the infiniband, link, pfc and topology
collectors of a scrape share one rdma.Snapshot (CollectorContext.rdma()) instead of each walking
/sys/class/infiniband again, and a device that goes away between the listing and the reading
costs its own values only.

The walks are counted on a real tree through a Root that records its directory listings and
file reads (and from which thread), not by replacing any collector's code.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpunet_exporter.collector import Collector, CollectorContext, Scrape
from gpunet_exporter.collectors.infiniband import InfinibandCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.pfc import PfcCollector
from gpunet_exporter.collectors.topology import TopologyCollector
from gpunet_exporter.registry import Scraper
from gpunet_exporter.sources import rdma
from gpunet_exporter.sources.sysfs import Root

from support import sysfs_tree as st
from support.metrics import Samples, make_collector, samples_of

DEVICES = [f"mlx5_{i}" for i in range(10)]
SCRAPE_FAMILIES = ("gpunet_scrape_", "gpunet_exporter_build_info", "gpunet_check_unknown")


def in_scrape() -> bool:
    """Whether the calling thread is one of the Scraper's collector threads (not a collector's
    own background thread, such as pfc's configuration refresh, which lists on its own)."""
    return threading.current_thread().name.startswith("collect-")


class CountingRoot(Root):
    """Counts the directory listings and file reads made from the scrape's collector threads,
    and calls ``on_list`` / ``on_read`` (rel) after each, so a test can change the tree there."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.lists: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.on_list: Callable[[str], None] = lambda rel: None
        self.on_read: Callable[[str], None] = lambda rel: None
        self._lock = threading.Lock()

    def listdir(self, rel: str) -> list[str]:
        names = super().listdir(rel)
        if in_scrape():
            with self._lock:
                self.lists[rel] += 1
            self.on_list(rel)
        return names

    def _read(self, path: str, dir_fd: int | None, rel: str) -> str:
        text = super()._read(path, dir_fd, rel)
        if in_scrape():
            with self._lock:
                self.reads[rel] += 1
            self.on_read(rel)
        return text


def collectors(sysfs: Path, root: Root) -> list[Collector]:
    """The four collectors that use the RDMA listing, on one root (as the exporter builds them:
    start_collectors gives every collector the same Root)."""
    return [
        make_collector(InfinibandCollector, sysfs, root=root),
        make_collector(LinkCollector, sysfs, {"ibv_devinfo": {"enabled": False}}, root=root),
        make_collector(PfcCollector, sysfs, {"config": {"sources": ["sysfs"]}}, root=root),
        make_collector(TopologyCollector, sysfs, root=root),
    ]


def scrape(cs: list[Collector], times: int = 1) -> list[Samples]:
    scraper = Scraper({c.name: c for c in cs}, timeout=60)
    try:
        return [samples_of(list(scraper.collect())) for _ in range(times)]
    finally:
        scraper.close()


def by_collector(s: Samples) -> dict[str, float]:
    return {dict(lbl)["collector"]: v for (name, lbl), v in s.items()
                if name == "gpunet_scrape_collector_unreadable_values"}


def successes(s: Samples) -> dict[str, float]:
    return {dict(lbl)["collector"]: v for (name, lbl), v in s.items()
            if name == "gpunet_scrape_collector_success"}


def without_scrape_families(s: Samples) -> Samples:
    return {k: v for k, v in s.items() if not k[0].startswith(SCRAPE_FAMILIES)}


def remove_device(sys: Path, device: str) -> None:
    """Hot-unplug: the device's directory and its class/infiniband link go, for real."""
    link = sys / "class" / "infiniband" / device
    shutil.rmtree(link.resolve())
    link.unlink()


@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path / "a")


def test_one_listing_per_scrape_for_all_collectors(dgx: Path) -> None:
    root = CountingRoot(str(dgx))
    cs = collectors(dgx, root)
    first, second = scrape(cs, times=2)
    assert successes(first) == dict.fromkeys(("infiniband", "link", "pfc", "topology"), 1)
    # Two scrapes, four collectors that each walked the tree before: two listings.
    assert root.lists[rdma.CLASS] == 2
    for dev in DEVICES:
        assert root.lists[f"{rdma.CLASS}/{dev}/ports"] == 2, dev
        assert root.reads[f"{rdma.CLASS}/{dev}/ports/1/link_layer"] == 2, dev
    # the IB ports' netdevs come from device/net/, the RoCE ports' from gid_attrs/ndevs/0
    assert root.lists[f"{rdma.CLASS}/mlx5_0/device/net"] == 2
    assert root.reads[f"{rdma.CLASS}/mlx5_8/ports/1/gid_attrs/ndevs/0"] == 2
    assert first.keys() == second.keys()


def test_shared_listing_gives_what_each_collector_reads_alone(dgx: Path) -> None:
    """Through the Scraper (one shared snapshot) every collector exports what it exports when
    called alone, outside a scrape, where it lists the devices itself."""
    (together,) = scrape(collectors(dgx, Root(str(dgx))))
    assert set(by_collector(together).values()) == {0}
    alone: Samples = {}
    for c in collectors(dgx, Root(str(dgx))):
        try:
            alone.update(samples_of(list(c.collect(Scrape()))))
        finally:
            c.close()
    assert without_scrape_families(together).keys() == alone.keys()
    for key, v in alone.items():
        if "age_seconds" not in key[0]:
            assert together[key] == v, key


def test_each_scrape_lists_anew(dgx: Path) -> None:
    root = Root(str(dgx))
    one, two = Scrape(), Scrape()
    assert one.rdma(root) is one.rdma(root)  # one scrape: one listing, shared
    assert one.rdma(root) is not two.rdma(root)  # another scrape: listed anew
    other = Root(str(dgx))
    assert one.rdma(root) is not one.rdma(other)  # another root is another tree: its own


@pytest.mark.parametrize("device", ["mlx5_4", "mlx5_8"])  # an IB port and a RoCE port
@pytest.mark.parametrize("when", ["after the listing", "after its ports were read"])
def test_device_removed_mid_scrape_costs_only_its_values(tmp_path: Path, device: str,
                                                         when: str) -> None:
    """The device goes right after the scrape listed it, or right after the snapshot read its
    port (and before any collector read a value of it). Every collector still succeeds with
    nothing unreadable, and the scrape is exactly that of the node without the device."""
    racy = st.build_dgx_h100(tmp_path / "racy")
    root = CountingRoot(str(racy))
    removed: list[str] = []

    def remove_once() -> None:
        if not removed:
            remove_device(racy, device)
            removed.append(device)

    if when == "after the listing":
        root.on_list = lambda rel: remove_once() if rel == rdma.CLASS else None
    else:
        root.on_read = lambda rel: (
            remove_once() if rel == f"{rdma.CLASS}/{device}/ports/1/link_layer" else None)
    (got,) = scrape(collectors(racy, root))
    assert removed == [device]

    clean = st.build_dgx_h100(tmp_path / "clean")
    remove_device(clean, device)
    (want,) = scrape(collectors(clean, Root(str(clean))))

    assert successes(got) == dict.fromkeys(("infiniband", "link", "pfc", "topology"), 1)
    assert by_collector(got) == by_collector(want) == dict.fromkeys(
        ("infiniband", "link", "pfc", "topology"), 0)
    assert not [k for k in got if ("device", device) in k[1]]
    got_series, want_series = without_scrape_families(got), without_scrape_families(want)
    assert got_series.keys() == want_series.keys()
    assert len(got_series) > 500  # every other device's series are there
    for key, v in want_series.items():
        if "age_seconds" not in key[0]:
            assert got_series[key] == v, key


def test_device_whose_ports_cannot_be_listed(dgx: Path) -> None:
    """ports/ unreadable while the device is there: one unreadable value for infiniband, the
    device's info still exported; the other collectors skip its ports silently, as before."""

    class NoPorts(Root):
        def listdir(self, rel: str) -> list[str]:
            if rel == f"{rdma.CLASS}/mlx5_2/ports":
                raise PermissionError(13, "Permission denied")
            return super().listdir(rel)

    root = NoPorts(str(dgx))
    snap = rdma.Snapshot(root)
    dev = snap.device("mlx5_2")
    assert dev.ports == () and isinstance(dev.error, PermissionError)
    (s,) = scrape(collectors(dgx, root))
    assert by_collector(s)["infiniband"] == 1
    assert {k for k in s if k[0] == "gpunet_infiniband_port_info"
            and ("device", "mlx5_2") in k[1]} == set()
    assert [k for k in s if k[0] == "gpunet_infiniband_device_info"
            and ("device", "mlx5_2") in k[1]]


def test_unreadable_link_layer_is_one_unreadable_value(dgx: Path) -> None:
    class NoLinkLayer(Root):
        def _read(self, path: str, dir_fd: int | None, rel: str) -> str:
            if rel == f"{rdma.CLASS}/mlx5_1/ports/1/link_layer":
                raise OSError(22, "Invalid argument")
            return super()._read(path, dir_fd, rel)

    (s,) = scrape(collectors(dgx, NoLinkLayer(str(dgx))))
    assert by_collector(s)["infiniband"] == 1
    (info,) = [lbl for name, lbl in s if name == "gpunet_infiniband_port_info"
               and ("device", "mlx5_1") in lbl]
    assert ("link_layer", "") in info


def test_snapshot_reads_each_device_once_under_concurrency(dgx: Path) -> None:
    """Threads asking for the same device at once: one reads it, the others get that reading."""
    root_lists: list[str] = []

    class Slow(Root):
        def listdir(self, rel: str) -> list[str]:
            root_lists.append(rel)
            if rel.endswith("/ports"):
                time.sleep(0.2)  # hold the first reader inside, so the others must wait
            return super().listdir(rel)

    root = Slow(str(dgx))
    snap = rdma.Snapshot(root)
    got: list[rdma.Device] = []
    threads = [threading.Thread(target=lambda: got.append(snap.device("mlx5_0")))
               for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(d is got[0] for d in got)
    assert root_lists.count(f"{rdma.CLASS}/mlx5_0/ports") == 1
    assert [p.netdev for p in got[0].ports] == [st._netdev(dgx, "mlx5_0").name]


def test_scrape_builds_once_across_threads() -> None:
    scrape = Scrape()
    calls = 0
    barrier = threading.Barrier(6)

    def build() -> object:
        nonlocal calls
        calls += 1
        time.sleep(0.05)
        return object()

    results: list[object] = []

    def ask() -> None:
        barrier.wait()
        results.append(scrape.shared("key", build))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == 1 and len(results) == 6 and all(r is results[0] for r in results)


def test_scrape_does_not_keep_a_failed_build() -> None:
    scrape = Scrape()

    def fail() -> object:
        raise OSError(5, "EIO")

    with pytest.raises(OSError):
        scrape.shared("k", fail)
    assert scrape.shared("k", lambda: 3) == 3


class _Asker(Collector):
    """A collector that only records the snapshot it was given."""

    name = "asker"

    def __init__(self, ctx: CollectorContext, seen: list[Any]) -> None:
        super().__init__(ctx)
        self.seen = seen

    def collect(self, scrape: Scrape) -> Iterator[Any]:
        self.seen.append(scrape.rdma(self.ctx.sysfs))
        return iter(())


def test_each_scrape_has_its_own_snapshot(dgx: Path) -> None:
    """Two collectors of one scrape get the same snapshot; the next scrape lists anew."""
    root = Root(str(dgx))
    seen: list[Any] = []
    askers = [_Asker(make_collector(InfinibandCollector, dgx, root=root).ctx, seen)
              for _ in range(2)]
    scraper = Scraper({f"asker{i}": a for i, a in enumerate(askers)}, timeout=10)
    try:
        list(scraper.collect())
        list(scraper.collect())
    finally:
        scraper.close()
    assert len(seen) == 4
    assert seen[0] is seen[1] and seen[2] is seen[3] and seen[0] is not seen[2]
