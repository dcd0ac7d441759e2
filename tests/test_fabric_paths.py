"""Path-aware localization (gpunet_exporter.localize, the fabric collector's pairs step) on a
simulated fat tree (ibsim + opensm, tests/support/ibsim.py): the paths walked through dump_fts's
forwarding tables are the ones ``ibtracert`` (infiniband-diags, asking every switch on the way)
traces; a spine port whose paths carry the slow pairs is named, a healthy fabric names nothing,
a slow node is blamed on itself, not on a spine; and end to end, pair results planted in each
node's ``pairs.json`` reach the fabric collector through a real Prometheus evaluating the
shipped rules, and GpunetFabricPathSuspect names the spine port. The pairs step also reaches a
real Prometheus behind TLS, client certificates and basic authentication (its own
--web.config.file), and says in one line what that Prometheus refused."""

from __future__ import annotations

import http.server
import itertools
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
import requests
import yaml

from gpunet_exporter import localize
from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.fabric import FabricCollector
from gpunet_exporter.mixin import dashboards
from gpunet_exporter.probe import pairs
from gpunet_exporter.sources import ibdiag, promapi

from support import ibsim, pki
from support.exporter import Exporter, free_port
from support.metrics import Samples, make_collector, samples_of, series, value
from support.prometheus import api, query, start, start_prometheus, stop
from support.wait import wait_for

# fat_tree(3, 2, 2): leaves L1..L3 with hosts L<i>H1, L<i>H2; spines S1, S2; spine port i faces
# leaf Li. GUIDs as ibsim numbers them (tests/support/ibsim.py).
S1 = "0x0000000000200003"
TREE = (3, 2, 2)
GOOD_BW, SLOW_BW = 40e9, 10e9  # a quarter: below fleet.link_slow_ratio (0.5) of the median


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ibsim.Sim]:
    ibsim.require()
    s = ibsim.Sim(tmp_path_factory.mktemp("sim") / "sim",
                  ibsim.fat_tree(*TREE).netfile).start()
    try:
        yield s
    finally:
        s.stop()


def sweep(sim: ibsim.Sim) -> tuple[ibdiag.Fabric, localize.Routes]:
    fabric = ibdiag.sweep(ibdiag.Tools(env=sim.env()))
    assert fabric.forwarding is not None, fabric.failed
    spines = {lk.switch for lk in fabric.links if lk.switch_name.startswith("S")}
    return fabric, localize.routes(fabric.links, fabric.forwarding, spines, r"^(\S+)")


_HOP = re.compile(r"^\[(\d+)\] -> (switch|ca) port \{(0x[0-9a-f]+)\}\[(\d+)\].*\"(\S+)\"$")


def traced(sim: ibsim.Sim, src: int, dst: int, cwd: Path) -> set[frozenset[tuple[str, int]]]:
    """The switch-to-switch cables ``ibtracert SRC DST`` crosses, each as its two ends."""
    out = subprocess.run(["ibtracert", str(src), str(dst)], env=sim.env(), cwd=cwd,
                         capture_output=True, text=True, timeout=30, check=True).stdout
    cables, here = set(), None
    for line in out.splitlines():
        m = _HOP.match(line.strip())
        if not m:
            continue
        port, kind, guid, inport = int(m[1]), m[2], f"0x{int(m[3], 16):016x}", int(m[4])
        if here is not None and kind == "switch":
            cables.add(frozenset({(here, port), (guid, inport)}))
        here = guid if kind == "switch" else None
    return cables


def test_paths_are_the_ones_ibtracert_traces(sim: ibsim.Sim, tmp_path: Path) -> None:
    fabric, r = sweep(sim)
    assert sorted(r.hosts) == [f"L{i}H{j}" for i in (1, 2, 3) for j in (1, 2)]
    ends = {}  # our cable (one end) -> both its ends, from iblinkinfo
    for lk in fabric.links:
        if lk.remote_port is not None and lk.remote.startswith("0x00000000002"):
            ends[(lk.switch, lk.port)] = frozenset({(lk.switch, lk.port),
                                                    (lk.remote, lk.remote_port)})
    crossed = 0
    for a, b in itertools.permutations(sorted(r.hosts), 2):
        ours = r.path(r.hosts[a][0], r.hosts[b][0])
        assert ours is not None, (a, b)
        theirs = traced(sim, r.hosts[a][0].lid, r.hosts[b][0].lid, tmp_path)
        assert {ends[(c.switch, c.port)] for c in ours} == theirs, (a, b)
        assert all(c.switch in {S1, "0x0000000000200004"} for c in ours)  # named at the spine
        crossed += len(ours)
    assert crossed == 2 * 24  # every cross-leaf path (24 of 30) crosses two cables


def crossing(r: localize.Routes, cable: localize.Cable) -> set[tuple[str, str]]:
    return {(a, b) for a, b in itertools.combinations(sorted(r.hosts), 2)
            if cable in (r.pair(a, b) or set())}


def health(r: localize.Routes, slow: set[tuple[str, str]]) -> dict[tuple[str, str], bool]:
    return {p: p not in slow for p in itertools.combinations(sorted(r.hosts), 2)}


def test_localize_names_the_spine_port_the_slow_pairs_share(sim: ibsim.Sim) -> None:
    _, r = sweep(sim)
    bad = localize.Cable(S1, 2)  # S1's cable to L2
    slow = crossing(r, bad)
    assert len(slow) >= 4
    found = localize.localize(r, health(r, slow))
    named = {c: v for c, v in found.verdicts.items() if v in (localize.SUSPECT,
                                                             localize.AMBIGUOUS)}
    assert named == {bad: localize.SUSPECT}
    assert found.crossing[bad] == (0, len(slow))
    assert found.nodes_blamed == []
    assert found.pairs == {"healthy": 15 - len(slow), "unhealthy": len(slow),
                           "unexplained": 0, "unrouted": 0}
    assert set(found.verdicts.values()) <= {localize.SUSPECT, localize.CLEARED,
                                            localize.UNPROVEN}


def test_localize_healthy_fabric_names_nothing(sim: ibsim.Sim) -> None:
    _, r = sweep(sim)
    found = localize.localize(r, health(r, set()))
    assert set(found.verdicts.values()) == {localize.CLEARED}
    assert len(found.verdicts) == 6  # 3 leaves x 2 spines
    assert found.nodes_blamed == [] and found.pairs["unhealthy"] == 0


def test_localize_blames_a_slow_node_not_a_spine(sim: ibsim.Sim) -> None:
    _, r = sweep(sim)
    slow = {p for p in itertools.combinations(sorted(r.hosts), 2) if "L3H2" in p}
    found = localize.localize(r, health(r, slow))
    assert found.nodes_blamed == ["L3H2"]
    assert localize.SUSPECT not in found.verdicts.values()
    assert localize.AMBIGUOUS not in found.verdicts.values()


def test_localize_says_ambiguous_when_the_evidence_cannot_tell(sim: ibsim.Sim) -> None:
    _, r = sweep(sim)
    # Only two nodes measured, on two leaves, and their one pair slow: its nodes and all four
    # cables of its paths explain it equally.
    found = localize.localize(r, {("L1H1", "L2H1"): False})
    named = sorted(c for c, v in found.verdicts.items() if v == localize.AMBIGUOUS)
    assert len(named) == len(r.pair("L1H1", "L2H1") or ()) > 0
    assert localize.SUSPECT not in found.verdicts.values()
    assert found.nodes_blamed == ["L1H1", "L2H1"]
    # A node the fabric does not know: the pair is judged on its nodes only.
    other = localize.localize(r, {("L1H1", "elsewhere"): False, ("L1H1", "L2H1"): True})
    assert other.pairs["unrouted"] == 1 and other.nodes_blamed == ["elsewhere"]


def collector(sim: ibsim.Sim, settings: dict[str, str]) -> FabricCollector:
    """The fabric collector on the simulated fabric, swept only when the test says."""
    c = make_collector(FabricCollector, "/", {
        "timeout_seconds": 5, **settings,
        "environment": [f"LD_PRELOAD={ibsim.UMAD2SIM}", f"IBSIM_SOCKNAME={sim.sockname}"]})
    assert isinstance(c, FabricCollector)
    c._refresher.stop()
    return c


def swept(c: FabricCollector) -> Samples:
    c.refresh()
    return samples_of(list(c.collect(Scrape())))


def test_an_unreachable_prometheus_fails_only_the_pairs_step(sim: ibsim.Sim) -> None:
    c = collector(sim, {"prometheus_url": f"http://127.0.0.1:{free_port()}"})
    try:
        s = swept(c)
    finally:
        c.close()
    assert value(s, "gpunet_fabric_step_success", step="pairs") == 0
    assert value(s, "gpunet_fabric_step_success", step="routes") == 1
    assert value(s, "gpunet_fabric_sweep_success") == 1
    assert series(s, "gpunet_fabric_port_state_id")
    assert not series(s, "gpunet_fabric_link_verdict")
    assert c.unknown() == {}


# ---- a Prometheus behind TLS, client certificates and basic authentication -------------------


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real Prometheus whose web.config.yml asks for TLS, a client certificate of the test CA
    and user ``fabric``'s password; its URL and the folder of the PKI (tests/support/pki.py)."""
    d = pki.make(tmp_path_factory.mktemp("secured"))
    (d / "web.yml").write_text(pki.tls_section(
        d, f"  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {d / 'ca.crt'}\n")
        + f"basic_auth_users:\n  fabric: '{pki.HASH}'\n")
    (d / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "1s"}}))
    (d / "password").write_text(pki.PASSWORD + "\n")
    port = free_port()
    proc = start(["prometheus", f"--config.file={d / 'prometheus.yml'}",
                  f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                  f"--web.config.file={d / 'web.yml'}"], d / "prometheus.log")
    url = f"https://127.0.0.1:{port}"
    try:
        wait_for(lambda: requests.get(
            f"{url}/-/ready", verify=str(d / "ca.crt"), auth=("fabric", pki.PASSWORD),
            cert=(str(d / "client.crt"), str(d / "client.key")), timeout=5).status_code == 200,
            "the secured Prometheus ready", timeout=60, interval=0.2,
            ignore=(requests.ConnectionError,))
        yield url, d
    finally:
        stop(proc)


def access(d: Path, **kw: str) -> dict[str, str]:
    """Every setting the secured Prometheus asks for, but those ``kw`` change."""
    return {"ca_file": str(d / "ca.crt"), "cert_file": str(d / "client.crt"),
            "key_file": str(d / "client.key"), "username": "fabric",
            "password_file": str(d / "password"), **kw}


def test_the_pairs_step_reaches_a_prometheus_behind_tls_and_basic_auth(
        sim: ibsim.Sim, secured: tuple[str, Path], tmp_path: Path) -> None:
    url, d = secured
    password = tmp_path / "password"
    password.write_text(pki.PASSWORD + "\n")
    c = collector(sim, {"prometheus_url": url, **{
        f"prometheus_{k}": v for k, v in access(d, password_file=str(password)).items()}})
    try:
        s = swept(c)
        assert value(s, "gpunet_fabric_step_success", step="pairs") == 1
        assert value(s, "gpunet_fabric_localization_pairs", result="healthy") == 0
        # The password file is read at every query: a changed password counts at the next.
        password.write_text("not it\n")
        s = swept(c)
        assert value(s, "gpunet_fabric_step_success", step="pairs") == 0
        assert value(s, "gpunet_fabric_step_success", step="routes") == 1
    finally:
        c.close()


@pytest.mark.parametrize("change, said", [
    ({}, None),
    ({"password_file": "wrong"}, "HTTP 401 Unauthorized"),
    ({"username": "other"}, "HTTP 401 Unauthorized"),
    # Go's TLS sends a bad_certificate alert and closes: the client reads the alert, or, when
    # the close wins, an EOF (seen once in CI); both lines say where to look.
    ({"cert_file": "", "key_file": ""}, "see prometheus_cert_file"),
    ({"cert_file": "rogue.crt", "key_file": "rogue.key"}, "see prometheus_cert_file"),
    ({"ca_file": "rogue-ca.crt"}, "Prometheus's certificate did not verify (unable to get "
                                  "local issuer certificate): see prometheus_ca_file"),
])
def test_a_refused_query_says_what_was_refused_in_one_line(
        secured: tuple[str, Path], change: dict[str, str], said: str | None) -> None:
    url, d = secured
    (d / "wrong").write_text("not the password\n")
    kw = access(d, **{k: v and str(d / v) if k.endswith("_file") else v
                      for k, v in change.items()})
    client = promapi.Client(url, **kw)
    if said is None:
        assert client.query("vector(1)", 5) == [({}, 1.0)]
        return
    with pytest.raises(promapi.QueryError) as err:
        client.query("vector(1)", 5)
    assert said in str(err.value) and "\n" not in str(err.value), err.value
    assert str(err.value).startswith(f"querying {url}: ")


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers /api/v1/query as Prometheus does, or a redirect for /moved/, and keeps each
    request's Authorization header (no Debian package here checks bearer tokens: Prometheus's
    web.config.yml has basic authentication only)."""

    seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        if self.path.startswith("/moved/"):
            self.send_response(302)
            self.send_header("Location", "http://127.0.0.1:1/api/v1/query")
            body = b""
        else:
            self.send_response(200)
            body = b'{"status":"success","data":{"resultType":"vector","result":[]}}'
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_bearer_token_is_read_at_every_query_and_no_redirect_carries_it(
        tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Recorder.seen = []
    try:
        token = tmp_path / "token"
        token.write_text("first-token\n")
        url = f"http://127.0.0.1:{server.server_port}"
        client = promapi.Client(url, bearer_token_file=str(token))
        assert client.query("up", 5) == []
        token.write_text("rotated-token")  # a service account token renewed by the kubelet
        assert client.query("up", 5) == []
        assert _Recorder.seen == ["Bearer first-token", "Bearer rotated-token"]
        with pytest.raises(promapi.QueryError, match=r"HTTP 302 Found$"):
            promapi.Client(url + "/moved/", bearer_token_file=str(token)).query("up", 5)
        assert len(_Recorder.seen) == 3  # the redirect was not followed
        token.unlink()
        with pytest.raises(promapi.QueryError, match=r"reading .*token: No such file"):
            client.query("up", 5)
        assert len(_Recorder.seen) == 3  # nothing sent without the token
    finally:
        server.shutdown()
        server.server_close()


# ---- end to end: pairs.json -> node exporters -> Prometheus -> fabric collector -> alert ------


def write_pairs(states: dict[str, Path], slow: set[tuple[str, str]], stamp: float) -> None:
    nodes = sorted(states)
    for node in nodes:
        mine = []
        for peer in nodes:
            if peer == node:
                continue
            bw = SLOW_BW if (min(node, peer), max(node, peer)) in slow else GOOD_BW
            mine.append(pairs.Pair(peer=peer, ok=True, peer_leaf=peer[:2],
                                   latency_seconds=2e-5,
                                   bus_bandwidth_bytes_per_second=bw, transport="IB", gdr=True))
        pairs.write(str(states[node]), pairs.Pairs(node=node, plan="ring", leaf=node[:2],
                                                   round_timestamp=stamp, pairs=tuple(mine)))


def path_alerts(url: str) -> set[tuple[str, str, str]]:
    return {(a["labels"]["switch"], a["labels"]["port"], a["labels"]["verdict"])
            for a in api(url, "alerts")["alerts"]
            if a["labels"]["alertname"] == "GpunetFabricPathSuspect" and a["state"] == "firing"}


def suspects(url: str, instances: dict[str, str]) -> set[str]:
    return {instances[a["labels"]["instance"]] for a in api(url, "alerts")["alerts"]
            if a["labels"]["alertname"] == "GpunetFleetNodeSuspect" and a["state"] == "firing"}


@pytest.mark.slow
def test_shipped_rules_name_the_spine_port_end_to_end(sim: ibsim.Sim, tmp_path: Path) -> None:
    _, r = sweep(sim)
    nodes = sorted(r.hosts)
    states = {n: tmp_path / n for n in nodes}
    for d in states.values():
        d.mkdir()
    write_pairs(states, set(), time.time())
    prom_port = free_port()
    exporters, instances = [], {}
    try:
        for n in nodes:
            cfg = tmp_path / f"{n}.yml"
            cfg.write_text(yaml.safe_dump({"probe": {"runner": "none",
                                                     "state_dir": str(states[n])}}))
            e = Exporter(["--collector.disable-defaults", "--collector.probe",
                          f"--config.file={cfg}", "--no-hotplug"])
            exporters.append(e)
            instances[e.url.removeprefix("http://")] = n
        cfg = tmp_path / "fabric.yml"
        cfg.write_text(yaml.safe_dump({
            "collectors": {"fabric": True},
            "fabric": {"interval_seconds": 1,
                       "prometheus_url": f"http://127.0.0.1:{prom_port}",
                       "environment": [f"LD_PRELOAD={ibsim.UMAD2SIM}",
                                       f"IBSIM_SOCKNAME={sim.sockname}"]}}))
        fab = Exporter(["--collector.disable-defaults", "--collector.fabric",
                        f"--config.file={cfg}", "--no-hotplug"], cwd=tmp_path)
        exporters.append(fab)
        fabric_instance = fab.url.removeprefix("http://")
        prom, url = start_prometheus(
            tmp_path, [{"targets": [*instances, fabric_instance]}], port=prom_port)
        try:
            def localized(unhealthy: int) -> bool:
                # The fabric collector's last localization, scraped, saw this round's pairs.
                got = query(url, 'gpunet_fabric_localization_pairs{result="unhealthy"}')
                total = query(url, "sum(gpunet_fabric_localization_pairs"
                                   '{result=~"healthy|unhealthy"})')
                return (bool(got) and float(got[0]["value"][1]) == unhealthy
                        and bool(total) and float(total[0]["value"][1]) == 15)

            def settle(unhealthy: int) -> None:
                wait_for(lambda: localized(unhealthy), f"{unhealthy} unhealthy pairs localized",
                         timeout=60, interval=0.5, ignore=(requests.ConnectionError,))
                time.sleep(3)  # a scrape and the alert rules after it

            settle(0)
            assert path_alerts(url) == set()
            assert query(url, 'gpunet_fabric_link_verdict{verdict="cleared"}')

            bad = localize.Cable(S1, 2)
            slow = crossing(r, bad)
            write_pairs(states, slow, time.time())
            settle(len(slow))
            wait_for(lambda: path_alerts(url) == {(S1, "2", "suspect")},
                     "GpunetFabricPathSuspect on S1 port 2", timeout=30, interval=0.5)
            alert = next(a for a in api(url, "alerts")["alerts"]
                         if a["labels"]["alertname"] == "GpunetFabricPathSuspect")
            assert alert["labels"]["remote_name"] == "L2"
            assert "the one cable" in alert["annotations"]["description"]
            # The fabric dashboard's table of named cables shows it, with its evidence.
            (panel,) = [p for p in dashboards.iter_panels(
                dashboards.dashboards()["gpunet-fabric.json"])
                if p["title"] == "Cables the slow fleet pairs share"]
            rows = query(url, dashboards.substitute(panel["targets"][0]["expr"], {
                "instance": fabric_instance, "job": "gpunet"}))
            assert [(r["metric"]["name"], r["metric"]["port"], r["metric"]["remote_name"],
                     r["metric"]["verdict"], float(r["value"][1])) for r in rows] == [
                ("S1", "2", "L2", "suspect", float(len(slow)))]
            assert f"{len(slow)} slow or failed" in alert["annotations"]["description"]

            slow_node = {p for p in itertools.combinations(nodes, 2) if "L3H2" in p}
            write_pairs(states, slow_node, time.time())
            settle(len(slow_node))
            wait_for(lambda: suspects(url, instances) == {"L3H2"},
                     "GpunetFleetNodeSuspect on L3H2", timeout=30, interval=0.5)
            assert path_alerts(url) == set()
            blamed = query(url, "gpunet_fabric_localization_nodes_blamed")
            assert float(blamed[0]["value"][1]) == 1
        finally:
            stop(prom)
    finally:
        for e in exporters:
            e.stop()
