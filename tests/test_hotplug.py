"""Hot-plug: events injected through the dispatcher (counting, label bounds, each collector's
hook), a real netlink monitor seeing a veth pair come and go in a network namespace, the
installed exporter doing the same, and the exporter without pyudev."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpunet_exporter.background import Refresher
from gpunet_exporter.collector import Collector, CollectorContext, Scrape, build_collector
from gpunet_exporter.collectors.gpu import GpuCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.pfc import PfcCollector
from gpunet_exporter.daemon.hotplug import Hotplug
from gpunet_exporter.registry import Scraper
from gpunet_exporter.sources import nvml

from support import fake_nvml
from support import sysfs_tree as st
from support.exporter import free_port
from support.metrics import make_collector, parse, samples_of, series, value
from support.paths import REPO, TESTS
from support.wait import refresher_idle, wait_for

ROCE, ROCE2 = "enp170s0f0np0", "enp41s0f0np0"  # netdevs of the RoCE ports mlx5_9, mlx5_8
NVIDIA = {"PCI_ID": "10DE:2335", "PCI_SLOT_NAME": "0000:00:06.0"}
MELLANOX = {"PCI_ID": "15B3:1021", "PCI_SLOT_NAME": "0000:29:00.0"}


@dataclass
class Ev:
    """A stand-in for pyudev.Device: what the dispatcher reads."""

    subsystem: str | None
    action: str | None
    properties: Mapping[str, str] = field(default_factory=dict)


def scrape(scraper: Scraper, hotplug: Hotplug | None = None) -> dict[Any, float]:
    """One scrape as the service's registry makes it: the collectors, then hot-plug's own."""
    return samples_of([*scraper.collect(), *(hotplug.collect() if hotplug else ())])


# ---- the dispatcher ---------------------------------------------------------------------------

class Recorder(Collector):
    name = "recorder"
    fail = False

    def __init__(self, ctx: CollectorContext) -> None:
        super().__init__(ctx)
        self.events: list[tuple[str, str, dict[str, str]]] = []

    def collect(self, scrape: Scrape) -> list[Any]:
        return []

    def device_event(self, subsystem: str, action: str, properties: Mapping[str, str]) -> None:
        if self.fail:
            raise RuntimeError("hook broke")
        self.events.append((subsystem, action, dict(properties)))


def test_counting_label_bounds_and_dispatch() -> None:
    broken, rec = build_collector(Recorder, sysfs="/"), build_collector(Recorder, sysfs="/")
    broken.fail = True
    hp = Hotplug({"broken": broken, "rec": rec})
    for ev in (Ev("net", "add", {"INTERFACE": "veth0"}), Ev("net", "add"), Ev("net", "remove"),
               Ev("pci", "bind", NVIDIA), Ev("infiniband", "move"), Ev("net", "change"),
               Ev("usb", "add"), Ev("net", "online"), Ev(None, None), Ev("block", "weird")):
        hp.dispatch(ev)
    assert hp.counts() == {("net", "add"): 2, ("net", "remove"): 1, ("pci", "bind"): 1,
                           ("infiniband", "move"): 1, ("net", "change"): 1, ("other", "add"): 1,
                           ("net", "other"): 1, ("other", "other"): 2}
    # Only known subsystems and actions reach the hooks, with their properties; a hook that
    # raises costs only its own call.
    assert rec.events == [("net", "add", {"INTERFACE": "veth0"}), ("net", "add", {}),
                          ("net", "remove", {}), ("pci", "bind", NVIDIA),
                          ("infiniband", "move", {}), ("net", "change", {})]
    s = scrape(Scraper({}, 1.0), hp)
    events = series(s, "gpunet_device_events_total")
    assert events[frozenset({("subsystem", "net"), ("action", "add")})] == 2
    assert {dict(k)["subsystem"] for k in events} == {"net", "pci", "infiniband", "other"}
    assert value(s, "gpunet_hotplug_monitoring") == 0  # counted, but no monitor running


def test_no_events_no_series_and_monitoring_0_without_monitor() -> None:
    s = scrape(Scraper({}, 1.0), Hotplug({}))
    assert value(s, "gpunet_hotplug_monitoring") == 0
    assert not series(s, "gpunet_device_events_total")


def test_refresher_wake() -> None:
    rounds: list[float] = []
    r: Refresher[None] = Refresher("t", 3600, lambda: rounds.append(time.monotonic()),
                                   lambda *a: None)
    r.wake()  # before start: nothing to wake, the first round runs anyway
    r.start()
    thread = r._thread
    try:
        wait_for(lambda: refresher_idle(r))  # the first round is done: waiting out the interval
        assert len(rounds) == 1  # the interval is an hour
        r.wake()
        wait_for(lambda: len(rounds) == 2)
    finally:
        r.stop()
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive(), "stop() did not end the refresher's thread"
    r.wake()
    assert r._thread is thread  # no thread started again: nothing is left to run a round
    assert len(rounds) == 2  # stopped stays stopped


def test_refresher_wakes_during_a_round_coalesce() -> None:
    gate, rounds = threading.Event(), []

    def slow() -> None:
        rounds.append(1)
        gate.wait(5)

    r: Refresher[None] = Refresher("t", 3600, slow, lambda *a: None)
    r.start()
    try:
        wait_for(lambda: len(rounds) == 1)
        for _ in range(5):
            r.wake()  # during the round: one more round, not five
        gate.set()
        wait_for(lambda: refresher_idle(r))  # the round asked for ran; none is pending
        assert len(rounds) == 2
    finally:
        r.stop()


# ---- collector hooks --------------------------------------------------------------------------

@pytest.fixture
def dgx(tmp_path: Path) -> Path:
    return st.build_dgx_h100(tmp_path / "tree")


def test_pfc_forgets_gone_interfaces_and_refreshes_now(dgx: Path) -> None:
    st.make_ofed_qos(dgx, "mlx5_9")
    c = make_collector(PfcCollector, dgx, {"config": {"sources": ["sysfs"],
                                                      "interval_seconds": 3600},
                                           "interfaces": ["veth7"]})
    rounds: list[set[str]] = []
    refresh = c.refresh  # type: ignore[attr-defined]

    def counting() -> None:
        refresh()
        rounds.append(set(c._states))  # type: ignore[attr-defined]

    c.refresh = counting  # type: ignore[attr-defined]
    hp = Hotplug({"pfc": c})
    try:
        hp.dispatch(Ev("net", "add"))  # before the first scrape: nothing started, nothing to do
        c.collect(Scrape())
        wait_for(lambda: len(rounds) == 1)
        assert rounds[0] == {ROCE, ROCE2}  # veth7 does not exist (yet)

        # A container's veth comes and goes: not one of ours, no refresh.
        for action in ("add", "remove"):
            hp.dispatch(Ev("net", action, {"INTERFACE": "veth1234"}))
        wait_for(lambda: refresher_idle(c._refresher))  # type: ignore[attr-defined]
        assert len(rounds) == 1

        # A configured interface appears: refreshed now.
        (dgx / "class/net/veth7").mkdir()
        hp.dispatch(Ev("net", "add", {"INTERFACE": "veth7"}))
        wait_for(lambda: len(rounds) == 2)
        assert rounds[1] == {ROCE, ROCE2, "veth7"}

        # The RoCE device goes away (driver unbound): its state is forgotten at once.
        (dgx / "class/infiniband/mlx5_9").unlink()  # a symlink, as in the kernel's sysfs
        hp.dispatch(Ev("infiniband", "remove", {"DEVPATH": "/devices/x/infiniband/mlx5_9"}))
        assert ROCE not in c._states  # type: ignore[attr-defined]
        wait_for(lambda: len(rounds) == 3)
        assert rounds[2] == {ROCE2, "veth7"}

        # A netdev remove arrives while sysfs still shows it: the named interface is dropped.
        hp.dispatch(Ev("net", "remove", {"INTERFACE": "veth7"}))
        assert "veth7" not in c._states  # type: ignore[attr-defined]
        wait_for(lambda: len(rounds) == 4)

        # change events do not invalidate anything.
        hp.dispatch(Ev("net", "change", {"INTERFACE": ROCE2}))
        wait_for(lambda: refresher_idle(c._refresher))  # type: ignore[attr-defined]
        assert len(rounds) == 4
    finally:
        c.close()


def test_link_refreshes_ibv_devinfo_now(dgx: Path, tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    tool = tmp_path / "bin" / "ibv_devinfo"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\necho run >> {runs}\necho 'hca_id:\tmlx5_0'\n")
    tool.chmod(0o755)
    c = make_collector(LinkCollector, dgx, {"ibv_devinfo": {"path": str(tool),
                                                            "interval_seconds": 3600}})
    hp = Hotplug({"link": c})

    def count() -> int:
        return len(runs.read_text().splitlines()) if runs.exists() else 0

    try:
        hp.dispatch(Ev("infiniband", "add"))  # not started yet: nothing to wake
        c.collect(Scrape())
        wait_for(lambda: count() == 1)  # the thread's first round
        for ev in (Ev("net", "add"), Ev("pci", "bind", MELLANOX), Ev("infiniband", "change")):
            hp.dispatch(ev)
        wait_for(lambda: refresher_idle(c._ibv))  # type: ignore[attr-defined]
        assert count() == 1
        hp.dispatch(Ev("infiniband", "add", {"DEVPATH": "/devices/x/infiniband/mlx5_12"}))
        wait_for(lambda: count() == 2)
    finally:
        c.close()


@pytest.fixture
def gpu_sysfs(tmp_path: Path) -> Iterator[Path]:
    fake_nvml.load(fake_nvml.h200x2())
    nvml.forget(fake_nvml.MODULE)
    for bdf in ("0000:00:06.0", "0000:00:07.0"):
        d = tmp_path / "sys" / "bus" / "pci" / "devices" / bdf
        d.mkdir(parents=True)
        (d / "numa_node").write_text("-1\n")
    yield tmp_path / "sys"
    nvml.forget(fake_nvml.MODULE)


def test_gpu_session_invalidated_only_for_nvidia_pci_events(gpu_sysfs: Path) -> None:
    c = make_collector(GpuCollector, gpu_sysfs, {"counters_interval_seconds": 3600},
                       nvml_module=fake_nvml.MODULE)
    session = nvml.session(fake_nvml.MODULE)
    hp = Hotplug({"gpu": c})
    try:
        s = samples_of(list(c.collect(Scrape())))
        assert value(s, "gpunet_gpu_nvml_up") == 1 and session.generation == 1
        for ev in (Ev("pci", "add", MELLANOX), Ev("pci", "unbind", MELLANOX),
                   Ev("pci", "change", NVIDIA), Ev("net", "add", NVIDIA), Ev("pci", "bind", {})):
            hp.dispatch(ev)
            s = samples_of(list(c.collect(Scrape())))
            assert session.state == "up" and session.generation == 1, ev
        inits = fake_nvml.calls("nvmlInit")
        for n, action in enumerate(("unbind", "bind", "remove", "add"), start=2):
            hp.dispatch(Ev("pci", action, NVIDIA))
            assert session.generation == n - 1  # nothing on the hot-plug thread ...
            s = samples_of(list(c.collect(Scrape())))  # ... the next scrape initialises again
            assert value(s, "gpunet_gpu_nvml_up") == 1 and session.generation == n
            assert fake_nvml.calls("nvmlInit") == inits + n - 1
            assert len(series(s, "gpunet_gpu_info")) == 2
    finally:
        c.close()


# ---- without pyudev ---------------------------------------------------------------------------

def test_without_pyudev_monitoring_0_and_logged_once(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setitem(sys.modules, "pyudev", None)  # import pyudev raises ImportError
    rec = build_collector(Recorder, sysfs="/")
    hp = Hotplug({"rec": rec})
    with caplog.at_level(logging.INFO, logger="gpunet.hotplug"):
        assert hp.start() is False
    hp.stop()
    msgs = [r.getMessage() for r in caplog.records if r.name == "gpunet.hotplug"]
    assert len(msgs) == 1 and msgs[0].startswith("hot-plug events unavailable: cannot import "
                                                 "pyudev"), msgs
    assert msgs[0].endswith("devices are re-listed on every scrape")
    assert caplog.records[-1].levelno == logging.INFO
    s = scrape(Scraper({"rec": rec}, 1.0), hp)
    assert value(s, "gpunet_hotplug_monitoring") == 0
    assert value(s, "gpunet_scrape_collector_success", collector="recorder") == 1


def test_exporter_without_pyudev_and_with_no_hotplug(tmp_path: Path, run_exporter) -> None:  # type: ignore[no-untyped-def]
    shadow = tmp_path / "shadow" / "pyudev"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('simulated: no pyudev here')\n")
    sysfs = st.build_dgx_h100(tmp_path / "tree")
    common = [f"--path.sysfs={sysfs}", "--collector.disable-defaults", "--collector.infiniband"]
    e = run_exporter(*common, env={"PYTHONPATH": str(tmp_path / "shadow")})
    s = parse(e.metrics())
    assert value(s, "gpunet_hotplug_monitoring") == 0
    assert value(s, "gpunet_scrape_collector_success", collector="infiniband") == 1
    err = e.stop()
    assert "hot-plug events unavailable: cannot import pyudev (simulated: no pyudev here); " \
           "devices are re-listed on every scrape" in err, err
    e2 = run_exporter(*common, "--no-hotplug")
    assert value(parse(e2.metrics()), "gpunet_hotplug_monitoring") == 0
    assert "hot-plug" not in e2.stop()


# ---- a real netlink monitor in a network namespace ------------------------------------------

# Kernel net uevents reach only uevent sockets in the device's network namespace: the monitor
# runs inside the namespace the test creates, so the host's interfaces are never touched.
needs_netns = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip"),
    reason="creating a network namespace and veth pairs needs root and iproute2's ip")


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"gpunet-hp-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def in_netns(ns: str, code: str, timeout: float = 30) -> dict[str, Any]:
    res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=timeout, check=False,
                         env={**os.environ, "PYTHONPATH": f"{REPO}:{TESTS}"})
    assert res.returncode == 0, res.stderr
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


@needs_netns
def test_real_monitor_sees_a_veth_pair_come_and_go(netns: str) -> None:
    pytest.importorskip("pyudev")
    got = in_netns(netns, textwrap.dedent("""\
        import json, subprocess
        from gpunet_exporter.daemon.hotplug import Hotplug
        from support.wait import wait_for

        class Rec:
            name = "rec"
            def __init__(self):
                self.events = []
            def device_event(self, subsystem, action, properties):
                self.events.append([subsystem, action, properties.get("INTERFACE", "")])

        rec = Rec()
        hp = Hotplug({"rec": rec})
        started = hp.start()
        subprocess.run(["ip", "link", "add", "hpa0", "type", "veth", "peer", "name", "hpb0"],
                       check=True)
        subprocess.run(["ip", "link", "del", "hpa0"], check=True)
        try:
            wait_for(lambda: hp.counts().get(("net", "remove"), 0) >= 2, timeout=10)
        except AssertionError:
            pass  # the test says what was missing, from the counts printed below
        hp.stop()
        print(json.dumps({"started": started, "source": hp.source, "error": hp.error,
                          "counts": {f"{s} {a}": n for (s, a), n in hp.counts().items()},
                          "events": rec.events}))
        """))
    assert got["started"], got["error"]
    assert got["source"] == ("udev" if os.path.exists("/run/udev/control") else "kernel")
    assert got["counts"].get("net add") == 2 and got["counts"].get("net remove") == 2, got
    events = {tuple(e) for e in got["events"]}
    assert {("net", a, i) for a in ("add", "remove") for i in ("hpa0", "hpb0")} <= events


@needs_netns
def test_installed_exporter_counts_veth_events(netns: str, tmp_path: Path) -> None:
    pytest.importorskip("pyudev")
    exe = shutil.which("gpunet-exporter")
    assert exe, "the gpunet-exporter console script is not installed (pip install .)"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # `ip netns exec` execs the exporter: it lives (and listens) inside the namespace.
    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, exe, f"--web.listen-address=127.0.0.1:{port}",
         "--collector.disable-defaults", "--collector.link", "--collector.pfc"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fetch = textwrap.dedent(f"""\
        import json, sys, urllib.request
        from support.wait import wait_for
        got = {{"text": ""}}

        def scraped():
            try:
                got["text"] = urllib.request.urlopen("{url}/metrics", timeout=5).read().decode()
            except OSError:
                got["text"] = ""
            return all(w in got["text"] for w in sys.argv[2:])

        try:
            wait_for(scraped, timeout=float(sys.argv[1]), interval=0.1)
        except AssertionError:
            pass  # the test says what was missing, from the last scrape printed below
        print(json.dumps(got))
        """)

    def metrics(wait: float, *want: str) -> str:
        res = subprocess.run(["ip", "netns", "exec", netns, sys.executable, "-c", fetch,
                              str(wait), *want], capture_output=True, text=True, timeout=60,
                             check=True, env={**os.environ, "PYTHONPATH": str(TESTS)})
        return str(json.loads(res.stdout)["text"])

    monitoring: float | None = None
    try:
        # The monitor starts just after the server binds: wait for it rather than race it.
        # The sample's line, not "gpunet_hotplug_monitoring 1" anywhere: the family's HELP
        # text starts with "1 while ...", and matched the first scrape, monitor up or not.
        first = metrics(20, "\ngpunet_hotplug_monitoring 1")
        monitoring = value(parse(first), "gpunet_hotplug_monitoring")
        if monitoring == 1:  # else said below, with the exporter's log (why it did not start)
            ip = ["ip", "-n", netns, "link"]
            subprocess.run([*ip, "add", "hpx0", "type", "veth", "peer", "name", "hpy0"],
                           check=True)
            subprocess.run([*ip, "del", "hpx0"], check=True)
            s = parse(metrics(10, 'action="add",subsystem="net"',
                              'action="remove",subsystem="net"'))
            assert (value(s, "gpunet_device_events_total", subsystem="net", action="add")
                    or 0) >= 1
            assert (value(s, "gpunet_device_events_total", subsystem="net", action="remove")
                    or 0) >= 1
            assert value(s, "gpunet_scrape_collector_success", collector="pfc") == 1
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert monitoring == 1, f"gpunet_hotplug_monitoring {monitoring}; the exporter said:\n{err}"
    source = "udev" if os.path.exists("/run/udev/control") else "kernel"
    assert f"watching hot-plug events of infiniband, net, pci (source {source}" in err, err
    assert proc.returncode == 0, err
