"""pairs.json (gpunet_exporter.probe.pairs) and the probe collector's gpunet_fleet_* metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.probe import pairs
from gpunet_exporter.registry import drop_unexposable
from gpunet_exporter.statefile import write_json

from support import sysfs_tree as st
from support.metrics import Samples, make_collector, samples_of, series, value

FLEET = ("gpunet_fleet_pair_bus_bandwidth_bytes_per_second", "gpunet_fleet_pair_latency_seconds",
         "gpunet_fleet_pair_success", "gpunet_fleet_pair_info", "gpunet_fleet_pair_skipped",
         "gpunet_fleet_node_info", "gpunet_fleet_round_timestamp_seconds",
         "gpunet_fleet_pairs_dropped")


def pair(peer: str, **over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"peer": peer, "peer_leaf": "leaf-b", "ok": True,
                            "latency_seconds": 2.5e-5, "bus_bandwidth_bytes_per_second": 4.0e10,
                            "transport": "IB", "gdr": True, "error": None}
    data.update(over)
    return data


def pairs_file(*entries: dict[str, Any], **over: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"version": 1, "node": "n1", "leaf": "leaf-a", "plan": "ring",
                            "round_timestamp": 1767225600.0, "pairs": list(entries)}
    data.update(over)
    return data


class Node:
    """The probe collector with `runner: none` on a state directory; scrape() ticks first."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.state = tmp_path / "state"
        self.state.mkdir()
        c = make_collector(ProbeCollector, st.build_dgx_h100(tmp_path / "tree"),
                           {"state_dir": str(self.state), "runner": "none", **config})
        assert isinstance(c, ProbeCollector)
        self.c = c

    def write(self, data: dict[str, Any]) -> None:
        write_json(str(self.state / pairs.FILE), data)

    def scrape(self) -> Samples:
        self.c.supervisor.refresh()
        return samples_of(list(self.c.collect(Scrape())))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    n = Node(tmp_path)
    yield n
    n.c.close()


def fleet(s: Samples) -> Samples:
    return {k: v for k, v in s.items() if k[0] in FLEET}


def lbl(**labels: str) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def test_a_pairs_file_gives_exactly_the_fleet_series(node: Node) -> None:
    assert fleet(node.scrape()) == {}  # no file: no fleet series, no fleet failures
    node.write(pairs_file(
        pair("n2"),
        pair("n3", peer_leaf=None, ok=False, latency_seconds=None,
             bus_bandwidth_bytes_per_second=None, transport=None, gdr=None,
             error="NCCL timeout"),
        pair("n4", transport="Socket", gdr=False, peer_leaf="leaf-a")))
    s = node.scrape()
    assert fleet(s) == {
        ("gpunet_fleet_node_info", lbl(name="n1", leaf="leaf-a")): 1,
        ("gpunet_fleet_round_timestamp_seconds", lbl()): 1767225600.0,
        ("gpunet_fleet_pairs_dropped", lbl()): 0,
        ("gpunet_fleet_pair_success", lbl(peer="n2")): 1,
        ("gpunet_fleet_pair_success", lbl(peer="n3")): 0,
        ("gpunet_fleet_pair_success", lbl(peer="n4")): 1,
        ("gpunet_fleet_pair_latency_seconds", lbl(peer="n2")): 2.5e-5,
        ("gpunet_fleet_pair_latency_seconds", lbl(peer="n4")): 2.5e-5,
        ("gpunet_fleet_pair_bus_bandwidth_bytes_per_second", lbl(peer="n2")): 4.0e10,
        ("gpunet_fleet_pair_bus_bandwidth_bytes_per_second", lbl(peer="n4")): 4.0e10,
        # This node's leaf and cross_leaf beside the peer's: "true" across leaves, "false"
        # within one, empty where a leaf is unknown.
        ("gpunet_fleet_pair_info", lbl(peer="n2", leaf="leaf-a", peer_leaf="leaf-b",
                                       cross_leaf="true", transport="IB", gdr="true")): 1,
        ("gpunet_fleet_pair_info", lbl(peer="n3", leaf="leaf-a", peer_leaf="", cross_leaf="",
                                       transport="", gdr="")): 1,
        ("gpunet_fleet_pair_info", lbl(peer="n4", leaf="leaf-a", peer_leaf="leaf-a",
                                       cross_leaf="false", transport="Socket", gdr="false")): 1,
    }
    assert value(s, "gpunet_probe_failures_total", scope="fleet", reason="bad_result") == 0
    # The scopes are untouched: no round of theirs, no series.
    assert not [k for k in s if k[0] == "gpunet_probe_success"]
    node.write(pairs_file(pair("n2"), leaf=None))
    s = node.scrape()
    assert s[("gpunet_fleet_node_info", lbl(name="n1", leaf=""))] == 1
    (info,) = series(s, "gpunet_fleet_pair_info")
    assert dict(info)["leaf"] == "" and dict(info)["cross_leaf"] == ""


@pytest.mark.parametrize("text", [
    "{not json",
    json.dumps(pairs_file(pair("n2")))[:40],  # truncated
    json.dumps(pairs_file(pair("n2"), version=2)),
    json.dumps(pairs_file(pair("n2"), pair("n2"))),  # one entry per peer
    json.dumps(pairs_file(pair("n2", ok="yes"))),
    json.dumps(pairs_file(pair("n2", latency_seconds=-1))),
    json.dumps(pairs_file(pair(""))),
    json.dumps(pairs_file(round_timestamp=None)),
    "[]",
    "9" * 5000,
])
def test_a_bad_file_costs_only_the_fleet_series(node: Node, tmp_path: Path, text: str) -> None:
    write_json(str(node.state / "intra.json"), intra_result())
    node.write(pairs_file(pair("n2")))
    assert value(node.scrape(), "gpunet_fleet_pair_success", peer="n2") == 1
    tmp = node.state / "pairs.tmp"  # replaced whole: the collector's own ticks run too
    tmp.write_text(text)
    os.replace(tmp, node.state / pairs.FILE)
    s = node.scrape()
    assert fleet(s) == {}
    assert value(s, "gpunet_probe_failures_total", scope="fleet", reason="bad_result") == 1
    assert value(s, "gpunet_probe_success", scope="intra") == 1
    assert value(s, "gpunet_probe_failures_total", scope="intra", reason="bad_result") == 0
    # Read once per change: the next scrapes neither count it again nor log it again.
    assert value(node.scrape(), "gpunet_probe_failures_total", scope="fleet",
                 reason="bad_result") == 1
    node.write(pairs_file(pair("n5")))
    s = node.scrape()
    assert value(s, "gpunet_fleet_pair_success", peer="n5") == 1
    assert value(s, "gpunet_probe_failures_total", scope="fleet", reason="bad_result") == 1


def intra_result() -> dict[str, Any]:
    now = time.time()
    return {"version": 2, "scope": "intra", "started": now - 0.2, "time": now, "success": True,
            "backend": "gloo", "world_size": 2, "sizes": []}


def skipped(peer: str, reason: str = "busy") -> dict[str, Any]:
    """An entry as gpunet-probe fleet writes a pair that was not measured."""
    return pair(peer, ok=False, latency_seconds=None, bus_bandwidth_bytes_per_second=None,
                transport=None, gdr=None, error="the GPUs are busy: 4242 (python) is not the "
                "probe's", skipped=reason)


def test_a_pair_not_measured_is_neither_a_success_nor_a_failure(node: Node) -> None:
    """Issue 31: a pair skipped because a GPU was busy (on this end or the peer's) has no
    gpunet_fleet_pair_success, which the fleet rules count (alerts/tests/collective.test.yml,
    "a busy node's pairs not measured"), and says why in gpunet_fleet_pair_skipped."""
    node.write(pairs_file(pair("n2"), skipped("n3"), skipped("n4", "peer_busy"),
                          skipped("n5", "unknown"), skipped("n6", "peer_unknown"),
                          pair("n7", ok=False, latency_seconds=None,
                               bus_bandwidth_bytes_per_second=None, error="NCCL timeout")))
    s = node.scrape()
    assert {dict(k)["peer"]: v for k, v in series(s, "gpunet_fleet_pair_success").items()} == \
        {"n2": 1, "n7": 0}
    assert {tuple(sorted(dict(k).items())): v
            for k, v in series(s, "gpunet_fleet_pair_skipped").items()} == {
        (("peer", "n3"), ("reason", "busy")): 1, (("peer", "n4"), ("reason", "peer_busy")): 1,
        (("peer", "n5"), ("reason", "unknown")): 1,
        (("peer", "n6"), ("reason", "peer_unknown")): 1}
    assert {dict(k)["peer"] for k in series(s, "gpunet_fleet_pair_info")} == {
        "n2", "n3", "n4", "n5", "n6", "n7"}  # every peer of the plan
    assert {dict(k)["peer"] for k in series(s, "gpunet_fleet_pair_latency_seconds")} == {"n2"}
    assert value(s, "gpunet_probe_failures_total", scope="fleet", reason="bad_result") == 0


def test_a_file_written_before_skipped_reads_as_measured(tmp_path: Path) -> None:
    """Files without the field (every pair measured) read as they did."""
    data = pairs_file(pair("n2"), pair("n3", ok=False))
    assert "skipped" not in json.dumps(data)
    got = pairs.parse(data)
    assert [(p.ok, p.skipped, p.failed) for p in got.pairs] == [(True, None, False),
                                                                (False, None, True)]
    assert pairs.to_json(got) == data  # and a measured pair's entry is written as before


@pytest.mark.parametrize("entry, want", [
    (pair("n2", ok=False, skipped="asleep"), "'skipped' must be one of busy, unknown, "),
    (pair("n2", ok=False, skipped=1), "'skipped' must be one of"),
    (pair("n2", skipped="busy"), "a skipped pair (not measured) cannot be ok"),
])
def test_a_bad_skipped_is_a_bad_file(entry: dict[str, Any], want: str) -> None:
    with pytest.raises(pairs.BadPairs, match=re.escape(want)):
        pairs.parse(pairs_file(entry))


def test_more_peers_than_the_max_are_dropped_and_counted(tmp_path: Path) -> None:
    node = Node(tmp_path, fleet_max_peers=3)
    try:
        node.write(pairs_file(skipped("busy1"), *[pair(f"n{i}") for i in range(2, 8)],
                              pair("bad", ok=False)))
        s = node.scrape()
        assert value(s, "gpunet_fleet_pairs_dropped") == 5
        peers = {dict(k)["peer"] for k in series(s, "gpunet_fleet_pair_info")}
        assert peers == {"bad", "busy1", "n2"}  # failed pairs first, then file order
        for name in FLEET[:5]:
            assert {dict(k)["peer"] for k in series(s, name)} <= peers
    finally:
        node.c.close()


def test_a_newer_file_replaces_the_old_peers(node: Node) -> None:
    node.write(pairs_file(pair("n2"), pair("n3")))
    assert len(series(node.scrape(), "gpunet_fleet_pair_info")) == 2
    node.write(pairs_file(pair("n4"), plan="repair", round_timestamp=1767225700.0))
    s = node.scrape()
    for name in FLEET[:4]:
        assert {dict(k)["peer"] for k in series(s, name)} <= {"n4"}, name
    assert value(s, "gpunet_fleet_round_timestamp_seconds") == 1767225700.0
    (node.state / pairs.FILE).unlink()  # gone: the last view stays until a new file comes
    assert value(node.scrape(), "gpunet_fleet_pair_success", peer="n4") == 1


def test_peer_names_go_through_the_label_checks(node: Node) -> None:
    node.write(pairs_file(pair("n2"), pair("bad\0name")))
    node.c.supervisor.refresh()
    fams = list(node.c.collect(Scrape()))
    skipped: list[str] = []
    drop_unexposable(fams, lambda what, why: skipped.append(what))
    s = samples_of(fams)
    assert {dict(k)["peer"] for k in series(s, "gpunet_fleet_pair_success")} == {"n2"}
    assert skipped and all("gpunet_fleet_pair" in w for w in skipped)


def test_round_trip(tmp_path: Path) -> None:
    data = pairs.Pairs(node="n1", plan="leaf", round_timestamp=12.5, leaf="l1", pairs=(
        pairs.Pair("n2", True, "l2", 1e-5, 3e10, "RoCE", False, None),
        pairs.Pair("n3", False, error="timeout"),
        pairs.Pair("n4", False, error="the GPUs are busy", skipped="peer_busy")))
    pairs.write(str(tmp_path), data)
    assert pairs.read(pairs.pairs_path(str(tmp_path))) == data


@given(hs.binary(max_size=300))
def test_garbage_only_ever_raises_bad_pairs(tmp_path_factory: pytest.TempPathFactory,
                                            data: bytes) -> None:
    path = tmp_path_factory.mktemp("g") / pairs.FILE
    path.write_bytes(data)
    with contextlib.suppress(pairs.BadPairs):  # and nothing else
        pairs.read(str(path))


def test_an_oversized_file_is_bad(tmp_path: Path) -> None:
    path = tmp_path / pairs.FILE
    path.write_text(" " * (pairs.MAX_BYTES + 1))
    with pytest.raises(pairs.BadPairs, match="larger than"):
        pairs.read(str(path))


JSON = hs.recursive(
    hs.none() | hs.booleans() | hs.integers() | hs.floats() | hs.text(max_size=20),
    lambda inner: hs.lists(inner, max_size=4) | hs.dictionaries(hs.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12)


@given(hs.sampled_from(["version", "node", "leaf", "plan", "round_timestamp", "pairs"]),
       hs.sampled_from(["peer", "peer_leaf", "ok", "latency_seconds",
                        "bus_bandwidth_bytes_per_second", "transport", "gdr", "error",
                        "skipped"]),
       JSON, hs.booleans())
def test_near_valid_files_parse_or_raise_bad_pairs(top: str, key: str, junk: Any,
                                                   in_pair: bool) -> None:
    data = pairs_file(pair("n2"), pair("n3"))
    if in_pair:
        data["pairs"][1][key] = junk
    else:
        data[top] = junk
    try:
        got = pairs.parse(data)
    except pairs.BadPairs:
        return
    assert isinstance(got, pairs.Pairs)
    assert pairs.parse(pairs.to_json(got)) == got  # what parses, writes back the same
