"""The fabric collector: infiniband-diags' output parsed (captured from the simulator, whose
tools are the real rdma-core 44 ones), and the collector against a real simulated fabric (ibsim
+ opensm, tests/support/ibsim.py) with each fault the issue names: a link trained narrower or
slower, switch port errors, a link unplugged (and the routing opensm makes around it), uplink
traffic on one path, a tool that fails and a fabric that vanishes."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.fabric import FabricCollector
from gpunet_exporter.sources import ibdiag

from support import ibsim
from support.metrics import make_collector, samples_of, series, value

FIXTURES = Path(__file__).parent / "fixtures" / "fabric"
GB = ibdiag.BYTES_PER_GBIT


def guid(n: int) -> str:
    return f"0x{n:016x}"


# ibsim numbers switches 0x200000, 0x200001, ... in netfile order: leaves, then spines.
L1, L2 = guid(0x200000), guid(0x200001)


# ---- parsers, on output captured from the simulator (tests/fixtures/fabric, its netfile) -------


def test_iblinkinfo_every_switch_port_with_state_rate_and_neighbour() -> None:
    links = ibdiag.parse_iblinkinfo((FIXTURES / "iblinkinfo-l-switches.txt").read_text())
    assert len(links) == 4 * 6  # 4 switches of 6 ports, down ones included
    by = {(lk.switch, lk.port): lk for lk in links}
    host = by[(L1, 1)]
    assert (host.state, host.phys_state, host.width, host.lane_gbps) == (4, 5, 12, 50.0)
    assert (host.remote, host.remote_port, host.remote_name) == (guid(0x100001), 1, "L1H1")
    assert host.switch_name == "L1" and host.rate_gbps == host.supported_gbps == 600
    narrow = by[(L2, 4)]  # the netfile's narrowed L2-S2 cable: "Could be 12X"
    assert (narrow.width, narrow.could_width, narrow.rate_gbps, narrow.supported_gbps) == (
        4, 12, 200, 600)
    slow = by[(L1, 4)]  # the slowed L1-S2 cable, EDR: "Could be 53.125 Gbps"
    assert (slow.lane_gbps, slow.could_lane_gbps, slow.rate_gbps, slow.supported_gbps) == (
        25.0, 50.0, 300, 600)
    down = by[(L2, 3)]  # unlinked
    assert (down.state, down.phys_state, down.width, down.remote, down.rate_gbps) == (
        1, 2, None, "", None)


def test_iblinkinfo_rejects_output_it_cannot_read() -> None:
    with pytest.raises(ibdiag.ParseError):
        ibdiag.parse_iblinkinfo("iblinkinfo: something else entirely\n")
    assert ibdiag.parse_iblinkinfo("") == []


def test_ibqueryerrors_data_and_errors_per_port() -> None:
    data = ibdiag.parse_ibqueryerrors((FIXTURES / "ibqueryerrors-counters.txt").read_text())
    assert len(data) == 24
    assert set(data[(L1, 1)]) >= {"PortXmitData", "PortRcvData", "PortXmitPkts", "PortRcvPkts"}
    errors = ibdiag.parse_ibqueryerrors((FIXTURES / "ibqueryerrors-errors.txt").read_text())
    # "port ALL" sums are not ports.
    assert errors == {(L1, 3): {"SymbolErrorCounter": 7},
                      (guid(0x200002), 2): {"PortXmitDiscards": 3},
                      (L2, 3): {"PortXmitDiscards": 1}}


def test_dump_fts_counts_host_lids_per_out_port() -> None:
    routes = ibdiag.parse_dump_fts((FIXTURES / "dump_fts.txt").read_text())
    assert set(routes) == {L1, L2, guid(0x200002), guid(0x200003)}
    # L2 lost its S1 cable: both of L1's hosts go out of its one uplink, port 4.
    assert routes[L2] == {4: 2, 1: 1, 2: 1}
    # L1 can reach L2's hosts only through S2 (port 4): its other uplink routes none.
    assert routes[L1].get(3, 0) == 0 and routes[L1][4] == 2

    # The whole tables, for the paths (gpunet_exporter.localize): L2 sends L1H1 (LID 2) up port
    # 4 and itself (LID 3) nowhere (port 0); a LID it has no entry for has no route.
    fwd = ibdiag.parse_forwarding((FIXTURES / "dump_fts.txt").read_text())
    assert (fwd.port(L2, 2), fwd.port(L2, 3), fwd.port(L2, 99), fwd.port("0x0", 2)) == (
        4, 0, None, None)
    assert fwd.lids[2] == ibdiag.Destination("Channel Adapter", guid(0x100001), "L1H1")


# ---- the collector against the simulator ------------------------------------------------------


@contextlib.contextmanager
def collector(sim: ibsim.Sim, **config: object) -> Iterator[FabricCollector]:
    cfg = {"balance_min_bytes_per_second": 0,
           "environment": [f"LD_PRELOAD={ibsim.UMAD2SIM}", f"IBSIM_SOCKNAME={sim.sockname}"]}
    cfg.update(config)
    c = make_collector(FabricCollector, "/", cfg)
    assert isinstance(c, FabricCollector)
    # Stopped before it starts: no background thread; each scrape() below runs one sweep in
    # the test's thread, so the sweeps and their intervals are the test's.
    c._refresher.stop()
    try:
        yield c
    finally:
        c.close()


def scrape(c: FabricCollector) -> dict:
    c.refresh()
    return samples_of(list(c.collect(Scrape())))


@pytest.fixture
def sims(tmp_path: Path) -> Iterator[list[ibsim.Sim]]:
    started: list[ibsim.Sim] = []
    yield started
    for s in started:
        s.stop()


def run_sim(sims: list[ibsim.Sim], tmp_path: Path, tree: ibsim.FatTree) -> ibsim.Sim:
    ibsim.require()
    s = ibsim.Sim(tmp_path / "sim", tree.netfile).start()
    sims.append(s)
    return s


def test_healthy_fabric_every_switch_port_and_nothing_flagged(sims: list[ibsim.Sim],
                                                              tmp_path: Path) -> None:
    tree = ibsim.fat_tree(4, 3, 4)
    sim = run_sim(sims, tmp_path, tree)
    with collector(sim) as c:
        s = scrape(c)
    ports = tree.switch_ports
    assert value(s, "gpunet_fabric_switches") == 7
    assert len(series(s, "gpunet_fabric_port_state_id")) == 7 * ports
    active = [lbl for lbl, v in series(s, "gpunet_fabric_port_state_id").items() if v == 4]
    assert len(active) == 4 * 4 + 4 * 3 * 2  # host ports + both ends of every uplink
    assert set(series(s, "gpunet_fabric_port_rate_degraded").values()) == {0}
    for lbl, rate in series(s, "gpunet_fabric_port_rate_bytes_per_second").items():
        assert rate == 600 * GB == value(s, "gpunet_fabric_port_rate_supported_bytes_per_second",
                                         **dict(lbl))
    errors = [v for (name, _), v in s.items()
              if name.startswith("gpunet_fabric_port_") and name.endswith("_errors_total")]
    assert errors and set(errors) == {0}
    roles = {dict(lbl)["name"]: dict(lbl)["role"]
             for lbl in series(s, "gpunet_fabric_switch_info")}
    assert roles == {"L1": "leaf", "L2": "leaf", "L3": "leaf", "L4": "leaf",
                     "S1": "spine", "S2": "spine", "S3": "spine"}
    info = {(dict(lbl)["switch"], dict(lbl)["port"]): dict(lbl)
            for lbl in series(s, "gpunet_fabric_port_info")}
    assert info[(L1, "5")]["remote_name"] == "S1" and info[(L1, "5")]["remote_type"] == "switch"
    assert info[(L1, "1")]["remote_name"] == "L1H1" and info[(L1, "1")]["remote_type"] == "ca"
    assert set(series(s, "gpunet_fabric_leaf_uplinks").values()) == {3}
    assert set(series(s, "gpunet_fabric_leaf_routes_unbalanced").values()) == {0}
    # Each leaf sends the other leaves' 12 hosts 4 per uplink.
    assert value(s, "gpunet_fabric_port_routed_host_lids", switch=L1, port="5") == 4
    assert value(s, "gpunet_fabric_sweep_success") == 1
    steps = series(s, "gpunet_fabric_step_success")
    assert {dict(lbl)["step"]: v for lbl, v in steps.items()} == dict.fromkeys(
        ibdiag.STEPS, 1.0)


def test_narrow_and_slow_links_are_degraded_at_both_ends(sims: list[ibsim.Sim],
                                                         tmp_path: Path) -> None:
    tree = ibsim.fat_tree(2, 2, 2, narrow=[("L2", "S2")], slow=[("L1", "S1")])
    sim = run_sim(sims, tmp_path, tree)
    with collector(sim) as c:
        s = scrape(c)
    degraded = {(dict(lbl)["switch"], dict(lbl)["port"])
                for lbl, v in series(s, "gpunet_fabric_port_rate_degraded").items() if v == 1}
    s1, s2 = guid(0x200002), guid(0x200003)
    # Leaf ports 3, 4 face S1, S2; spine port N faces leaf N.
    assert degraded == {(L2, "4"), (s2, "2"), (L1, "3"), (s1, "1")}
    assert value(s, "gpunet_fabric_port_rate_bytes_per_second", switch=L2, port="4") == 200 * GB
    assert value(s, "gpunet_fabric_port_link_width_lanes", switch=L2, port="4") == 4
    assert value(s, "gpunet_fabric_port_rate_bytes_per_second", switch=L1, port="3") == 300 * GB
    assert value(s, "gpunet_fabric_port_lane_speed_bytes_per_second", switch=L1,
                 port="3") == 25 * GB
    for sw, port in degraded:
        assert value(s, "gpunet_fabric_port_rate_supported_bytes_per_second", switch=sw,
                     port=port) == 600 * GB


def test_leaf_oversubscription_from_active_uplinks(sims: list[ibsim.Sim],
                                                   tmp_path: Path) -> None:
    """Four hosts per leaf and two uplinks (2:1). L2's cable to S2 trained to 4X: 2400 Gb/s of
    hosts over 600 + 200 of uplinks, 3:1; then L1's cable to S1 unplugged: 4:1. A leaf's host
    side counts only active ports to hosts."""
    tree = ibsim.fat_tree(2, 2, 4, narrow=[("L2", "S2")])
    sim = run_sim(sims, tmp_path, tree)
    with collector(sim) as c:
        before = scrape(c)
        sweeps = sim.heavy_sweeps()
        sim.command('Unlink "L1"[5]')  # L1's cable to S1 (leaf ports 5, 6 face S1, S2)
        sim.wait_resweep(sweeps)
        after = scrape(c)
    hosts = 4 * 600 * GB
    for s in (before, after):
        assert value(s, "gpunet_fabric_leaf_host_capacity_bytes_per_second", switch=L2) == hosts
        assert value(s, "gpunet_fabric_leaf_uplink_capacity_bytes_per_second",
                     switch=L2) == 800 * GB
        assert value(s, "gpunet_fabric_leaf_oversubscription_ratio", switch=L2) == 3
    assert value(before, "gpunet_fabric_leaf_oversubscription_ratio", switch=L1) == 2
    assert value(after, "gpunet_fabric_leaf_uplink_capacity_bytes_per_second",
                 switch=L1) == 600 * GB
    assert value(after, "gpunet_fabric_leaf_oversubscription_ratio", switch=L1) == 4
    # Spines are not leaves: no capacity series.
    leaves = {dict(lbl)["switch"]
              for lbl in series(after, "gpunet_fabric_leaf_oversubscription_ratio")}
    assert leaves == {L1, L2}


def test_switch_port_errors_show_on_their_port_only(sims: list[ibsim.Sim],
                                                    tmp_path: Path) -> None:
    sim = run_sim(sims, tmp_path, ibsim.fat_tree(2, 2, 2))
    with collector(sim) as c:
        before = scrape(c)
        sim.command('PerformanceSet "L1"[3] PortCounters.SymbolErrorCounter=7')
        sim.command('PerformanceSet "S2"[2] PortCounters.LinkErrorRecoveryCounter=2')
        sim.command('PerformanceSet "S2"[2] PortCounters.PortRcvRemotePhysicalErrors=5')
        after = scrape(c)
    assert value(before, "gpunet_fabric_port_symbol_errors_total", switch=L1, port="3") == 0
    assert value(after, "gpunet_fabric_port_symbol_errors_total", switch=L1, port="3") == 7
    s2 = guid(0x200003)
    assert value(after, "gpunet_fabric_port_link_error_recoveries_total", switch=s2,
                 port="2") == 2
    assert value(after, "gpunet_fabric_port_receive_remote_physical_errors_total", switch=s2,
                 port="2") == 5
    nonzero = {(name, dict(lbl)["switch"], dict(lbl)["port"])
               for (name, lbl), v in after.items()
               if name.startswith("gpunet_fabric_port_") and name.endswith("errors_total")
               and v}
    assert nonzero == {("gpunet_fabric_port_symbol_errors_total", L1, "3"),
                       ("gpunet_fabric_port_receive_remote_physical_errors_total", s2, "2")}


def test_unplugged_uplink_is_down_keeps_its_neighbour_and_unbalances_routing(
        sims: list[ibsim.Sim], tmp_path: Path) -> None:
    tree = ibsim.fat_tree(2, 2, 2)
    sim = run_sim(sims, tmp_path, tree)
    with collector(sim) as c:
        healthy = scrape(c)
        sweeps = sim.heavy_sweeps()
        sim.command('Unlink "L2"[3]')  # L2's cable to S1
        sim.wait_resweep(sweeps)
        after = scrape(c)
    s1 = guid(0x200002)
    assert value(healthy, "gpunet_fabric_port_state_id", switch=L2, port="3") == 4
    for sw, port, name in ((L2, "3", "S1"), (s1, "2", "L2")):
        assert value(after, "gpunet_fabric_port_state_id", switch=sw, port=port) == 1
        assert value(after, "gpunet_fabric_port_phys_state_id", switch=sw, port=port) == 2
        info = [dict(lbl) for lbl in series(after, "gpunet_fabric_port_info")
                if dict(lbl)["switch"] == sw and dict(lbl)["port"] == port]
        assert len(info) == 1 and info[0]["remote_name"] == name
        assert info[0]["remote_type"] == "switch"
        assert value(after, "gpunet_fabric_port_rate_bytes_per_second", switch=sw,
                     port=port) is None
    assert value(after, "gpunet_fabric_leaf_uplinks", switch=L2) == 1
    # opensm routed around it: L1 reaches L2's hosts only through S2, its port 4.
    assert value(healthy, "gpunet_fabric_leaf_routes_unbalanced", switch=L1) == 0
    assert value(after, "gpunet_fabric_leaf_routes_unbalanced", switch=L1) == 1
    assert value(after, "gpunet_fabric_leaf_routes_imbalance_ratio", switch=L1) == 1.0
    # check_lft_balance, the tool itself, names the same switch.
    cache = tmp_path / "cache"
    sim.run(["ibnetdiscover", "--cache", str(cache)])
    lfts = tmp_path / "lfts"
    lfts.write_text(sim.run(["dump_fts"]))
    out = sim.run(["check_lft_balance", "-l", str(lfts), "-i", str(cache)])
    assert "Unbalanced Switch Port Usage: L1, 0x0000000000200000" in out
    assert "L2," not in out


def test_uplink_traffic_balance(sims: list[ibsim.Sim], tmp_path: Path) -> None:
    tree = ibsim.fat_tree(2, 2, 4)
    sim = run_sim(sims, tmp_path, tree)
    lids = sim.lids()
    def ping(src: str, dst: str) -> None:
        subprocess.run(["ibping", "-c", "3000", "-f", str(lids[dst])], env=sim.env(src),
                       cwd=sim.workdir, capture_output=True, timeout=60, check=False)

    with collector(sim) as c:
        first = scrape(c)
        # Hot flow: one host pair, so L1 sends it all up the one uplink its table picks.
        ping("L1H1", "L2H1")
        hot = scrape(c)
        # Spread: every host of L2, which L1's table divides evenly across its uplinks.
        for dst in tree.hosts["L2"]:
            ping("L1H1", dst)
        spread = scrape(c)
    assert value(first, "gpunet_fabric_leaf_uplink_imbalance_ratio", switch=L1,
                 direction="tx") is None  # one sweep: no interval yet
    hot_ratio = value(hot, "gpunet_fabric_leaf_uplink_imbalance_ratio", switch=L1,
                      direction="tx")
    assert hot_ratio is not None and hot_ratio > 0.9  # one of two uplinks: 1.0 at the limit
    # The same flow arrives at L2 over one uplink.
    rx = value(hot, "gpunet_fabric_leaf_uplink_imbalance_ratio", switch=L2, direction="rx")
    assert rx is not None and rx > 0.9
    spread_ratio = value(spread, "gpunet_fabric_leaf_uplink_imbalance_ratio", switch=L1,
                         direction="tx")
    assert spread_ratio is not None and spread_ratio < 0.2
    mean = value(spread, "gpunet_fabric_leaf_uplink_bytes_per_second", switch=L1, direction="tx")
    assert mean is not None and mean > 0


def test_imbalance_not_judged_below_the_traffic_floor(sims: list[ibsim.Sim],
                                                      tmp_path: Path) -> None:
    sim = run_sim(sims, tmp_path, ibsim.fat_tree(2, 2, 2))
    with collector(sim, balance_min_bytes_per_second=1e9) as c:
        scrape(c)
        s = scrape(c)  # the readout's own few packets only
    assert series(s, "gpunet_fabric_leaf_uplink_bytes_per_second")
    assert not series(s, "gpunet_fabric_leaf_uplink_imbalance_ratio")


def _tools_with(tmp_path: Path, broken: str) -> Path:
    """A tools folder of the real programs, with ``broken`` replaced by one that fails."""
    folder = tmp_path / "tools"
    folder.mkdir()
    for name in ("ibnetdiscover", "iblinkinfo", "ibqueryerrors", "dump_fts"):
        target = folder / name
        if name == broken:
            target.write_text("#!/bin/sh\necho 'ibwarn: cannot read the tables' >&2\nexit 3\n")
            target.chmod(target.stat().st_mode | stat.S_IXUSR)
        else:
            target.symlink_to(f"/usr/sbin/{name}")
    return folder


def test_a_failing_step_costs_only_its_own_values(sims: list[ibsim.Sim],
                                                  tmp_path: Path) -> None:
    sim = run_sim(sims, tmp_path, ibsim.fat_tree(2, 2, 2))
    with collector(sim, tools_dir=str(_tools_with(tmp_path, "dump_fts"))) as c:
        s = scrape(c)
        assert c.unknown() == {}  # every tool is there: a failing step is a failure
    steps = {dict(lbl)["step"]: v for lbl, v in series(s, "gpunet_fabric_step_success").items()}
    assert steps["routes"] == 0 and steps["links"] == 1 and steps["counters"] == 1
    assert value(s, "gpunet_fabric_sweep_success") == 1
    assert not series(s, "gpunet_fabric_leaf_routes_unbalanced")
    assert len(series(s, "gpunet_fabric_port_state_id")) == 4 * 4  # 4 switches of 4 ports
    assert series(s, "gpunet_fabric_port_symbol_errors_total")


def test_a_vanished_fabric_fails_the_sweep_and_keeps_the_last_values(
        sims: list[ibsim.Sim], tmp_path: Path) -> None:
    sim = run_sim(sims, tmp_path, ibsim.fat_tree(2, 2, 2))
    with collector(sim, timeout_seconds=5) as c:
        good = scrape(c)
        sim.stop()
        with pytest.raises(ibdiag.CommandError):
            c.refresh()
        s = samples_of(list(c.collect(Scrape())))
        assert c.unknown() == {}  # checked, on the last good sweep's values
    assert value(s, "gpunet_fabric_sweep_success") == 0
    assert value(s, "gpunet_fabric_sweep_last_success_timestamp_seconds") == value(
        good, "gpunet_fabric_sweep_last_success_timestamp_seconds")
    assert len(series(s, "gpunet_fabric_port_state_id")) == len(
        series(good, "gpunet_fabric_port_state_id"))


@pytest.mark.parametrize("case", ["a tool missing", "never swept"])
def test_a_fabric_not_swept_is_an_unknown_check(tmp_path: Path, case: str) -> None:
    """A tool of the sweep not installed, or no sweep succeeded since the start: the fabric is
    not checked, and the collector says so (gpunet_check_unknown, the landing page)."""
    folder = tmp_path / "tools"
    folder.mkdir()
    for name in ("ibnetdiscover", "iblinkinfo", "ibqueryerrors", "dump_fts"):
        if case == "never swept" or name != "iblinkinfo":
            (folder / name).write_text("#!/bin/sh\nexit 3\n")
            (folder / name).chmod(0o755)
    c = make_collector(FabricCollector, "/", {"tools_dir": str(folder)})
    assert isinstance(c, FabricCollector)
    c._refresher.stop()  # no sweep runs: the collector has not swept yet, or it failed
    try:
        if case == "never swept":
            c._sweep = c._sweep.failed()  # what refresh() leaves after a failed sweep
        list(c.collect(Scrape()))
        got = c.unknown()
    finally:
        c.close()
    assert got == {"sweep": "tool_missing" if case == "a tool missing" else "tool_failing"}


def test_bad_environment_setting_is_one_clear_error(tmp_path: Path) -> None:
    from gpunet_exporter.errors import ConfigError
    with pytest.raises((ValueError, ConfigError), match="NAME=value"):
        make_collector(FabricCollector, "/", {"environment": ["LD_PRELOAD"]})


@pytest.mark.parametrize(("setting", "value", "says"), [
    ("prometheus_url", "prometheus:9090", "not an http:// or https:// URL"),
    ("prometheus_url", "file:///etc/passwd", "not an http:// or https:// URL"),
    ("host_pattern", "^(\\S+", "not a regular expression"),
    ("host_pattern", "^\\S+", "has no group"),
])
def test_bad_localization_setting_is_one_clear_error(setting: str, value: str,
                                                     says: str) -> None:
    from gpunet_exporter.errors import ConfigError
    with pytest.raises((ValueError, ConfigError), match=f"fabric.{setting}: .*{says}"):
        make_collector(FabricCollector, "/", {setting: value})


HTTPS = "https://127.0.0.1:9090"


@pytest.mark.parametrize(("settings", "names", "says"), [
    ({"ca_file": "ca.pem"}, "ca_file", "set, but the URL 'http://127.0.0.1:9090' is not https"),
    ({"url": HTTPS, "ca_file": "missing.pem"}, "ca_file", "'.*missing.pem': No such file"),
    ({"url": HTTPS, "ca_file": "junk.pem"}, "ca_file", "'.*junk.pem': .*"),
    ({"url": HTTPS, "cert_file": "junk.pem"}, "cert_file",
     "'.*junk.pem' \\(key in it\\): not a PEM certificate with its private key"),
    ({"url": HTTPS, "cert_file": "missing.pem", "key_file": "junk.pem"}, "cert_file",
     "'.*missing.pem' \\(key .*junk.pem\\): No such file"),
    ({"url": HTTPS, "key_file": "junk.pem"}, "key_file", "set without cert_file"),
    ({"username": "u"}, "username", "set without password_file"),
    ({"password_file": "secret"}, "password_file", "set without username"),
    ({"username": "u", "password_file": "missing"}, "password_file", "'.*missing': No such file"),
    ({"username": "u", "password_file": "empty"}, "password_file", "'.*empty': empty"),
    ({"username": "u", "password_file": "secret", "bearer_token_file": "secret"},
     "bearer_token_file", "set with username"),
    ({"bearer_token_file": "two-lines"}, "bearer_token_file", "'.*two-lines': more than one line"),
])
def test_bad_prometheus_access_is_one_clear_error(tmp_path: Path, settings: dict[str, str],
                                                  names: str, says: str) -> None:
    """How the pairs step reaches Prometheus (TLS, client certificate, basic auth or a bearer
    token) is checked at start: a setting that cannot serve names itself in one line."""
    from gpunet_exporter.errors import ConfigError
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    (tmp_path / "secret").write_text("s3cret\n")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "two-lines").write_text("a\nb\n")
    cfg = {f"prometheus_{k}": v if k in ("url", "username") else str(tmp_path / v)
           for k, v in {"url": "http://127.0.0.1:9090", **settings}.items()}
    with pytest.raises((ValueError, ConfigError), match=f"^fabric.prometheus_{names}: {says}") \
            as err:
        make_collector(FabricCollector, "/", cfg)
    assert "\n" not in str(err.value)


def test_off_by_default() -> None:
    assert FabricCollector.default_enabled is False
    assert os.environ.get("IBSIM_SOCKNAME") is None  # the tests never leak a simulator
