"""The nccl collector and its RAS client, against reports captured from a live NCCL 2.28.9 job
on an H100 (tests/fixtures/nccl_ras, SOURCES.md there) replayed by a stand-in RAS server on
loopback (tests/support/ras_server.py): healthy, a rank stuck while alive, a stopped rank, a
dead one, a killed one; text and JSON; slow, cut short, garbage, endless and silent servers,
and listeners sharing a port as NCCL's processes do."""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from gpunet_exporter.collector import Scrape
from gpunet_exporter.collectors.nccl import NcclCollector
from gpunet_exporter.sources import ras

from support.metrics import make_collector, samples_of, series, value
from support.paths import FIXTURES
from support.ras_server import Behaviour, Server, serving
from support.wait import wait_for

DATA = FIXTURES / "nccl_ras"


def fixture(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


def capture(name: str) -> dict[str, Any]:
    conv: dict[str, Any] = json.loads(fixture("conversations.json"))[name]
    return conv


# -- the reports -------------------------------------------------------------------------------

def test_healthy_json_report() -> None:
    st = ras.parse_json(fixture("healthy.json"))
    assert st.format == "json" and st.version == "2.28.9"
    assert st.communicators is not None and len(st.communicators) == 1
    comm = st.communicators[0]
    assert comm.size == 2 and comm.status == "running" and not comm.missing
    assert [r.rank for r in comm.ranks] == [0, 1]
    assert {r.counts["AllReduce"] for r in comm.ranks} == {301}
    assert set(comm.ranks[0].counts) == set(ras.OPS)
    assert st.collection_seconds == 0.0 and st.timeouts == 0


def test_missing_rank_json_of_nccl_2_28_9_is_repaired() -> None:
    """2.28.9 writes a missing rank without the comma after nvml_dev: not JSON as it stands."""
    text = fixture("stopped.json")
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    comm = ras.parse_json(text).communicators[0]  # type: ignore[index]
    assert [(m.rank, m.unresponsive, m.dead) for m in comm.missing] == [(1, True, False)]
    dead = ras.parse_json(fixture("dead.json")).communicators[0]  # type: ignore[index]
    assert [(m.rank, m.unresponsive, m.dead) for m in dead.missing] == [(1, True, True)]


def test_killed_peer_leaves_an_async_error() -> None:
    comm = ras.parse_json(fixture("killed.json")).communicators[0]  # type: ignore[index]
    assert [(r.rank, r.async_error, r.errored) for r in comm.ranks] == [(0, 6, True)]
    assert comm.missing[0].dead


@pytest.mark.parametrize("name, groups, dead, missing, errored", [
    ("healthy.txt", [(1, 2, "running", "ok")], 0, 0, 0),
    ("healthy-verbose.txt", [(1, 2, "running", "ok")], 0, 0, 0),
    ("stuck.txt", [(1, 2, "running", "mismatch")], 0, 0, 0),
    ("dead.txt", [(1, 2, "running", "incomplete")], 1, 1, 0),
    ("killed.txt", [(1, 2, "running", "incomplete,error")], 1, 1, 1),
])
def test_text_reports(name: str, groups: list[tuple[int, int, str, str]], dead: int,
                      missing: int, errored: int) -> None:
    st = ras.parse_text(fixture(name))
    assert (st.format, st.version) == ("text", "2.28.9")
    assert st.groups == groups
    assert (st.nodes, st.processes, st.gpus) == (1, 2, 2)
    assert (st.dead_processes, st.missing_ranks, st.errored_ranks) == (dead, missing, errored)


@pytest.mark.parametrize("text", [
    "", "{", "[]", '{"communicators": {}}', '{"communicators": [{"ranks": [{"rank": "x"}]}]}',
    '{"communicators": [{"ranks": [{"rank": 0, "status": {"abort_flag": 1}}]}]}',
    '{"communicators": [{"missing_ranks": [7]}]}', '{"ras": []}',
])
def test_broken_json_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        ras.parse_json(text)


def test_text_ranks_of_dead_processes() -> None:
    """A rank listed under a communicator's INCOMPLETE error is dead when the DEAD error lists
    its process (host and pid), else unreachable; ranks beyond those RAS lists (more than 10)
    are dead when no process is merely unresponsive. Synthetic, from the real dead.txt."""
    real = fixture("dead.txt")
    st = ras.parse_text(real)
    assert (st.missing_ranks, st.dead_ranks, st.unresponsive_processes) == (1, 1, 0)
    other = real.replace("Rank 1 -- GPU 0 managed by process 434",
                         "Rank 1 -- GPU 0 managed by process 999")
    st = ras.parse_text(other)
    assert (st.missing_ranks, st.dead_ranks) == (1, 0)
    many = re.sub(r"Missing communicator data from 1 rank\n  Rank 1 -- .*\n",
                  "Missing communicator data from 12 ranks\n", real)
    assert (ras.parse_text(many).missing_ranks, ras.parse_text(many).dead_ranks) == (12, 12)
    both = many.replace("DEAD\n", "INCOMPLETE\n  Missing communicator data from 1 job process\n"
                        "  Process 7 on node 192.0.2.3 managing GPU 1\n\nDEAD\n")
    st = ras.parse_text(both)
    assert (st.missing_ranks, st.dead_ranks, st.unresponsive_processes) == (12, 0, 1)


def test_text_that_is_no_report() -> None:
    with pytest.raises(ValueError):
        ras.parse_text("ERROR: Unknown command STATUS\n")


def test_listeners_in_proc_net_tcp() -> None:
    """The kernel's format (net/ipv4/tcp_ipv4.c get_tcp4_sock): state 0A is LISTEN."""
    head = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
            "timeout inode")
    line = "   {n}: {local} 00000000:0000 {st} 00000000:00000000 00:00000000 00000000     0 0 1"
    tcp = "\n".join([head, line.format(n=0, local="0100007F:6D7C", st="0A"),
                     line.format(n=1, local="0100007F:6D7C", st="0A"),
                     line.format(n=2, local="0100007F:6D7C", st="01"),  # a client's
                     line.format(n=3, local="0100007F:6D7D", st="0A")])
    tcp6 = "\n".join([head, line.format(n=0, local="00000000000000000000000001000000:6D7C",
                                        st="0A")])
    assert ras.listeners([tcp, tcp6], 28028) == 3
    assert ras.listeners([tcp], 28029) == 1
    assert ras.listeners([head], 28028) == 0


# -- the protocol ------------------------------------------------------------------------------

def test_stand_in_answers_as_the_capture() -> None:
    """The stand-in's handshake and error lines are those NCCL 2.28.9 sent."""
    conv = capture("errors")
    sent = [c["sent"] for c in conv["chunks"] if "sent" in c]
    want = [c["data"] for c in conv["chunks"] if "data" in c]
    with serving(Behaviour(json=fixture("healthy.json"))) as srv, \
            socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
        got = []
        for line in sent:
            sock.sendall(line.encode() + b"\n")
            got.append(sock.recv(4096).decode())
    assert got == want


def test_query_json_as_the_capture_asks() -> None:
    conv = capture("json_status")
    with serving(Behaviour(json=fixture("healthy.json"), chunk=200)) as srv:
        rec = ras.Exchange()
        st = ras.query("127.0.0.1", srv.port, timeout=10, record=rec)
    assert rec.sent == [c["sent"] for c in conv["chunks"] if "sent" in c] == srv.commands
    body = "".join(c["data"] for c in conv["chunks"] if "data" in c)
    assert rec.reply.decode() == body  # handshake, OK and the report, byte for byte
    assert st.format == "json" and st.communicators


def test_old_nccl_without_json_gets_the_text_report() -> None:
    with serving(Behaviour(json=None, text=fixture("dead.txt"))) as srv:
        st = ras.query("127.0.0.1", srv.port, timeout=10)
    assert srv.commands == ["CLIENT PROTOCOL 2", "SET FORMAT json", "STATUS"]
    assert st.format == "text" and st.dead_processes == 1
    with serving(Behaviour(json=fixture("healthy.json"), text=fixture("healthy.txt"))) as srv:
        assert ras.query("127.0.0.1", srv.port, timeout=10, json_format=False).format == "text"
    assert srv.commands == ["CLIENT PROTOCOL 2", "STATUS"]


def test_slow_report_within_the_timeout() -> None:
    with serving(Behaviour(json=fixture("healthy.json"), chunk=100, delay=0.02)) as srv:
        st = ras.query("127.0.0.1", srv.port, timeout=30)
    assert st.communicators is not None and len(st.communicators[0].ranks) == 2


def test_misbehaving_servers() -> None:
    report = fixture("healthy.json")
    # A report too slow is not a silent peer: it answered the handshake.
    with serving(Behaviour(json=report, chunk=100, delay=0.5)) as srv, \
            pytest.raises(ras.RasError, match=r"no whole report within 1\.0 s"):
        ras.query("127.0.0.1", srv.port, timeout=1)
    with serving(Behaviour(json=report, cut=len(report) // 2)) as srv, \
            pytest.raises(ValueError):
        ras.query("127.0.0.1", srv.port, timeout=10)
    with serving(Behaviour(json=report, cut=0)) as srv, pytest.raises(ras.RasError):
        ras.query("127.0.0.1", srv.port, timeout=10)
    with serving(Behaviour(json=report, garbage=b"\x00\xffHTTP/1.1 400\n")) as srv, \
            pytest.raises(ras.RasError, match="handshake"):
        ras.query("127.0.0.1", srv.port, timeout=10)
    with serving(Behaviour(json=report, endless=True)) as srv, \
            pytest.raises(ras.RasError, match="longer than"):
        ras.query("127.0.0.1", srv.port, timeout=30, max_bytes=1 << 20)
    with serving(Behaviour(silent=True)) as srv, pytest.raises(ras.Unanswered):
        ras.query("127.0.0.1", srv.port, timeout=10, handshake_timeout=0.2)
    port = srv.port  # closed now
    with pytest.raises(ConnectionRefusedError):
        ras.query("127.0.0.1", port, timeout=5)


# -- the collector -----------------------------------------------------------------------------

@contextmanager
def collector(ports: list[int], **config: Any) -> Iterator[NcclCollector]:
    # MONITOR off unless a test asks for it: its connection would count among the server's.
    c = make_collector(NcclCollector, "/sys", {"host": "127.0.0.1", "ports": ports,
                                               "handshake_seconds": 0.3, "monitor": False,
                                               **config})
    try:
        assert isinstance(c, NcclCollector)
        yield c
    finally:
        c.close()


def scrape(c: NcclCollector) -> dict[Any, float]:
    c.refresh()
    c._refresher.stop()  # the scrape serves what refresh() found, nothing newer
    return samples_of(list(c.collect(Scrape())))


def job(s: dict[Any, float], port: int) -> dict[str, float | None]:
    p = str(port)
    return {
        "success": value(s, "gpunet_nccl_ras_query_success", port=p),
        "listeners": value(s, "gpunet_nccl_ras_listeners", port=p),
        "answering": value(s, "gpunet_nccl_job_processes", port=p, state="answering"),
        "unresponsive": value(s, "gpunet_nccl_job_processes", port=p, state="unresponsive"),
        "dead": value(s, "gpunet_nccl_job_processes", port=p, state="dead"),
        "missing": value(s, "gpunet_nccl_communicator_ranks", port=p, state="missing"),
        "unreachable": value(s, "gpunet_nccl_missing_ranks", port=p, reason="unreachable"),
        "dead_ranks": value(s, "gpunet_nccl_missing_ranks", port=p, reason="dead"),
        "errored": value(s, "gpunet_nccl_ranks_errored", port=p),
        "running": value(s, "gpunet_nccl_communicators", port=p, status="running"),
        "stalled": value(s, "gpunet_nccl_stalled_ranks", port=p),
        "idle": value(s, "gpunet_nccl_communicators_without_progress", port=p),
        "growing": value(s, "gpunet_nccl_communicators_skew_growing", port=p),
        "skew": value(s, "gpunet_nccl_collective_skew_operations", port=p, op="AllReduce"),
        "unanswered": value(s, "gpunet_nccl_ras_unanswered_connections_total", port=p),
    }


def moved(report: str, by: int) -> str:
    """Synthetic, from a real report: every rank's AllReduce count ``by`` further on."""
    doc = json.loads(report)
    for comm in doc["communicators"]:
        for r in comm["ranks"]:
            r["collective_counts"]["AllReduce"] += by
    return json.dumps(doc, indent=2)


def test_healthy_job_moving_then_idle() -> None:
    report = fixture("healthy.json")
    with serving(Behaviour(json=report)) as srv, collector([srv.port]) as c:
        first = job(scrape(c), srv.port)
        assert first == {**first, "success": 1, "listeners": 1, "answering": 2,
                         "unresponsive": 0, "dead": 0, "missing": 0, "errored": 0,
                         "running": 1, "skew": 0}
        assert first["stalled"] is None  # one report: nothing to compare yet
        srv.behaviour = Behaviour(json=moved(report, 150))
        second = job(scrape(c), srv.port)
        assert (second["stalled"], second["idle"], second["growing"]) == (0, 0, 0)
        third = job(scrape(c), srv.port)  # the same counts again: no collective ran
        assert (third["stalled"], third["idle"]) == (0, 1)


def test_stuck_rank_alive() -> None:
    """Rank 1 stopped launching collectives (its process and RAS alive): 601 against 581."""
    with serving(Behaviour(json=fixture("healthy.json"))) as srv, collector([srv.port]) as c:
        scrape(c)
        srv.behaviour = Behaviour(json=fixture("stuck-1.json"))
        one = job(scrape(c), srv.port)
        # rank 0 went from 301 to 601, rank 1 to 581: both moved, skew appeared
        assert (one["skew"], one["growing"], one["stalled"], one["missing"]) == (20, 1, 0, 0)
        srv.behaviour = Behaviour(json=fixture("stuck-2.json"))
        two = job(scrape(c), srv.port)
        assert (two["skew"], two["growing"], two["stalled"], two["idle"]) == (20, 0, 1, 1)
        assert two["answering"] == 2 and two["missing"] == 0


# Synthetic, from the real dead.txt: rank 1's process stopped but not yet dead, as NCCL's text
# report words it (client_support.cc: the job-wide INCOMPLETE error lists the process that did
# not answer; no DEAD error). No real text report of that moment was captured.
STOPPED_TEXT = fixture("dead.txt").replace(
    "DEAD\n  1 job process is considered dead (unreachable via the RAS network)\n"
    "  Process 434 on node 192.0.2.2 managing GPU 0\n",
    "INCOMPLETE\n  Missing communicator data from 1 job process\n"
    "  Process 434 on node 192.0.2.2 managing GPU 0\n")


@pytest.mark.parametrize("name, want", [
    ("stopped.json", {"answering": 1, "unresponsive": 1, "dead": 0, "missing": 1,
                      "unreachable": 1, "dead_ranks": 0, "errored": 0}),
    ("dead.json", {"answering": 1, "unresponsive": 0, "dead": 1, "missing": 1,
                   "unreachable": 0, "dead_ranks": 1, "errored": 0}),
    ("killed.json", {"answering": 1, "unresponsive": 0, "dead": 1, "missing": 1,
                     "unreachable": 0, "dead_ranks": 1, "errored": 1}),
    # The text reports give the JSON's verdicts where they carry them: the DEAD error names
    # the process whose rank the communicator's INCOMPLETE error lists.
    ("dead.txt", {"answering": 1, "unresponsive": 0, "dead": 1, "missing": 1,
                  "unreachable": 0, "dead_ranks": 1, "errored": 0}),
    ("killed.txt", {"answering": 1, "unresponsive": 0, "dead": 1, "missing": 1,
                    "unreachable": 0, "dead_ranks": 1, "errored": 1}),
    ("healthy.txt", {"answering": 2, "unresponsive": 0, "dead": 0, "missing": 0,
                     "unreachable": 0, "dead_ranks": 0, "errored": 0}),
    ("stopped.txt", {"answering": 1, "unresponsive": 1, "dead": 0, "missing": 1,
                     "unreachable": 1, "dead_ranks": 0, "errored": 0}),
])
def test_faults(name: str, want: dict[str, float | None]) -> None:
    text = STOPPED_TEXT if name == "stopped.txt" else fixture(name)
    b = Behaviour(json=text) if name.endswith("json") else Behaviour(json=None, text=text)
    with serving(b) as srv, collector([srv.port]) as c:
        got = job(scrape(c), srv.port)
    assert got["success"] == 1 and got["running"] == 1
    assert {k: got[k] for k in want} == want
    if name.endswith("txt"):
        assert got["skew"] is None and got["stalled"] is None  # JSON only


def test_a_stopped_process_shares_the_port() -> None:
    """NCCL's processes all listen on the port (SO_REUSEPORT); the kernel hands a connection to
    a stopped one as readily as to a running one. Queries go on until one answers."""
    with serving(Behaviour(silent=True), reuse_port=True) as stopped, \
            serving(Behaviour(json=fixture("stopped.json")), port=stopped.port,
                    reuse_port=True), \
            collector([stopped.port], attempts=20) as c:
        got = job(scrape(c), stopped.port)
    assert got["listeners"] == 2  # read from the real /proc/net/tcp
    assert got["success"] == 1 and got["unresponsive"] == 1


def test_timeout_bounds_the_whole_query() -> None:
    """Five connections taken by a stopped process, then one by a process whose report
    trickles: the query ends at nccl.timeout_seconds, not a handshake wait per silent
    connection plus a whole timeout for the last (3.5 s here before the fix)."""
    trickle = Behaviour(json=fixture("healthy.json") * 40, chunk=256, delay=0.05,
                        mute_first=5)
    with serving(trickle) as srv, collector([srv.port], attempts=6, timeout_seconds=2) as c:
        got = job(s := scrape(c), srv.port)
        assert srv.connections == 6
    took = value(s, "gpunet_nccl_ras_query_duration_seconds", port=str(srv.port))
    assert (got["success"], got["unanswered"]) == (0, 5)
    assert took is not None and 1.5 <= took <= 2.0 + 0.25, took


# -- MONITOR (NCCL 2.29.2 and later) -------------------------------------------------------------

MONITOR = json.loads(fixture("monitor.json"))


def monitor_events() -> list[str]:
    """What NCCL 2.30.7's RAS sent the JSON monitoring client after rank 1 was killed."""
    return [c["data"] for c in MONITOR["nccl_2.30.7"]["clients"]["json"]["chunks"]
            if "data" in c and "sent" not in c]


def test_monitor_stream_parses_in_any_pieces() -> None:
    whole = "".join(monitor_events()).encode()
    want = ["PEER_DISCONNECTED", "PEER_UNRESPONSIVE", "PEER_INIT_TIMEOUT", "PEER_INIT_TIMEOUT",
            "PEER_TIMEOUT_DEAD", "PEER_DEAD"]
    for step in (1, 7, 100, len(whole)):
        got, buf = [], b""
        for i in range(0, len(whole), step):
            events, buf = ras.parse_events(buf + whole[i:i + step])
            got += events
        assert [e.event for e in got] == want and buf.strip() == b"", step
    assert got[-1] == ras.Event("PEER_DEAD", "LIFECYCLE", "192.0.2.2", 15033)
    assert ras.parse_events(b'{"event": "PEER_SOMETHING_NEW", "group": "TRACE"}\n')[0] == [
        ras.Event("other", "TRACE")]
    with pytest.raises(ras.RasError):
        ras.parse_events(b"[2026-11-27 11:54:04] PEER_DEAD: text, not JSON\n")


def test_monitor_counts_events_and_asks_for_a_status_at_once() -> None:
    """With a MONITOR connection open, the status report is asked only every
    monitor_status_interval_seconds (300 here, past the test), and at once after a peer died
    or stopped answering: the stream replayed here is NCCL 2.30.7's."""
    b = Behaviour(json=fixture("healthy.json"), monitor=monitor_events(), monitor_delay=0.2)
    with serving(b) as srv, collector([srv.port], interval_seconds=3600, monitor=True) as c:
        def done() -> dict[Any, float] | None:
            s = samples_of(list(c.collect(Scrape())))
            return s if value(s, "gpunet_nccl_ras_events_total", port=str(srv.port),
                              event="PEER_DEAD") == 1 else None
        s = wait_for(done, "the PEER_DEAD event counted", timeout=20)
        p = str(srv.port)
        events = {dict(lbl)["event"]: v for lbl, v in series(s, "gpunet_nccl_ras_events_total")
                  .items()}
        assert events == {"PEER_NEW": 0, "PEER_DEAD": 1, "PEER_TIMEOUT_DEAD": 1,
                          "PEER_UNRESPONSIVE": 1, "PEER_DISCONNECTED": 1,
                          "PEER_INIT_TIMEOUT": 2, "PEER_CONNECTING": 0, "other": 0}
        assert value(s, "gpunet_nccl_ras_monitor_connected", port=p) == 1
        # The first round's report, then one woken by the urgent events (the interval is
        # an hour): each STATUS follows CLIENT PROTOCOL and SET FORMAT json.
        wait_for(lambda: srv.commands.count("STATUS") >= 2, "a status report after the events",
                 timeout=10)
        assert srv.commands.count("MONITOR lifecycle,trace") == 1


def test_monitor_refused_by_an_older_nccl() -> None:
    """NCCL 2.28.9 answers MONITOR with the error recorded in monitor.json: the port is said
    not to be monitored, and status reports go on at the interval."""
    refused = MONITOR["nccl_2.28.9"]["clients"]["json"]["chunks"][-1]["data"]
    assert refused == "ERROR: Unknown command MONITOR all\n"
    with serving(Behaviour(json=fixture("healthy.json"))) as srv, \
            collector([srv.port], monitor=True) as c:
        s = wait_for(lambda: (lambda s: s if value(
            s, "gpunet_nccl_ras_monitor_connected", port=str(srv.port)) == 0 else None)(
                samples_of(list(c.collect(Scrape())))), "MONITOR refused", timeout=10)
        assert not series(s, "gpunet_nccl_ras_events_total")
        assert value(s, "gpunet_nccl_ras_query_success", port=str(srv.port)) == 1
        assert "MONITOR lifecycle,trace" in srv.commands


def test_no_status_report_on_a_version_known_to_crash() -> None:
    """A report from NCCL 2.29.7 (whose status reports crash jobs: NVIDIA/nccl#2346), from
    the real healthy.json with its version changed: no further STATUS while the job listens,
    said by gpunet_nccl_ras_status_skipped."""
    report = json.loads(fixture("healthy.json"))
    report["nccl_version"] = "2.29.7"
    with serving(Behaviour(json=json.dumps(report))) as srv, collector([srv.port]) as c:
        first = job(scrape(c), srv.port)
        assert first["success"] == 1
        c.refresh()
        s = scrape(c)
        assert srv.commands.count("STATUS") == 1
        assert value(s, "gpunet_nccl_ras_status_skipped", port=str(srv.port)) == 1
    with serving(Behaviour(json=fixture("healthy.json"))) as srv, collector([srv.port]) as c:
        scrape(c)
        s = scrape(c)
        assert srv.commands.count("STATUS") == 2  # 2.28.9: asked every round
        assert value(s, "gpunet_nccl_ras_status_skipped", port=str(srv.port)) == 0


def test_only_a_silent_listener() -> None:
    with serving(Behaviour(silent=True)) as srv, collector([srv.port], attempts=3) as c:
        s = scrape(c)
        got = job(s, srv.port)
    assert (got["success"], got["listeners"], got["unanswered"]) == (0, 1, 3)
    assert got["answering"] is None and got["running"] is None  # no job figures
    assert value(s, "gpunet_nccl_ras_query_last_success_timestamp_seconds",
                 port=str(srv.port)) is None


def test_a_full_accept_queue_is_unanswered_too() -> None:
    """A process stopped long enough: its accept queue filled with connections it never took
    (the collector's own, round after round), and the kernel drops new ones. Those count as
    unanswered and the next attempt goes on (it may reach another process of the job)."""
    srv = Server(Behaviour(silent=True), backlog=0).start()
    held = []
    try:
        def full() -> bool:  # fill the queue until a connection is no longer accepted
            try:
                held.append(socket.create_connection(("127.0.0.1", srv.port), timeout=0.2))
            except TimeoutError:
                return True
            return False

        wait_for(full, "the silent listener's accept queue full", timeout=10, interval=0)
        with pytest.raises(ras.Unanswered, match="accept queue"):
            ras.query("127.0.0.1", srv.port, timeout=5, handshake_timeout=0.2)
        with collector([srv.port], attempts=3) as c:
            got = job(scrape(c), srv.port)
        assert (got["success"], got["listeners"], got["unanswered"]) == (0, 1, 3)
    finally:
        for sock in held:
            sock.close()
        srv.stop()


def test_no_job_costs_one_refused_connection() -> None:
    with serving(Behaviour()) as srv:
        port = srv.port
    with collector([port]) as c:
        s = scrape(c)
    got = job(s, port)
    assert got["listeners"] == 0 and got["success"] is None and got["answering"] is None
    assert c.ctx.unreadable == 0  # /proc/net/tcp not even read
    assert {k[0] for k in s} == {"gpunet_nccl_ras_listeners",
                                 "gpunet_nccl_ras_unanswered_connections_total"}


def test_a_failed_query_drops_the_job_figures_and_keeps_its_age() -> None:
    report = fixture("healthy.json")
    with serving(Behaviour(json=report)) as srv, collector([srv.port]) as c:
        before = scrape(c)
        srv.behaviour = Behaviour(json=report, cut=100)
        after = scrape(c)
    p = str(srv.port)
    stamp = "gpunet_nccl_ras_query_last_success_timestamp_seconds"
    assert value(after, "gpunet_nccl_ras_query_success", port=p) == 0
    assert value(after, stamp, port=p) == value(before, stamp, port=p)
    assert value(after, "gpunet_nccl_job_processes", port=p, state="answering") is None


def test_one_bad_port_costs_only_its_own_values() -> None:
    with serving(Behaviour(json=fixture("dead.json"))) as good, \
            serving(Behaviour(json="garbage", endless=True)) as bad, \
            collector([good.port, bad.port], max_reply_bytes=65536) as c:
        s = scrape(c)
    assert job(s, good.port)["dead"] == 1
    assert job(s, bad.port)["success"] == 0


def test_reports_have_no_unbounded_labels() -> None:
    """No rank, host, pid or hash in any label: only the port, fixed states and op names."""
    with serving(Behaviour(json=fixture("killed.json"))) as srv, collector([srv.port]) as c:
        s = scrape(c)
    values = {v for k in s for name, v in k[1] if name not in ("port",)}
    allowed = {"answering", "unresponsive", "dead", "expected", "seen", "missing", "unreachable",
               "not_member", "json", "2.28.9", *ras.STATUSES, *ras.OPS}
    assert values <= allowed, values - allowed


# -- nccl.per_communicator ---------------------------------------------------------------------

HEALTHY_HASH = "0x78973600cc059fdb"  # healthy.json and stuck-*.json: job A's communicator
DEAD_HASH = "0xfc258c91b6dba877"  # stopped.json and dead.json: job B's


def per_comm(s: dict[Any, float], name: str) -> dict[tuple[str, ...], float]:
    """A gpunet_nccl_communicator_* family as {(communicator, other labels...): value}."""
    out = {}
    for (n, lbl), v in s.items():
        if n == name:
            labels = dict(lbl)
            labels.pop("port")
            out[(labels.pop("communicator"), *(labels[k] for k in sorted(labels)))] = v
    return out


def test_per_communicator_is_off_by_default() -> None:
    with serving(Behaviour(json=fixture("dead.json"))) as srv, collector([srv.port]) as c:
        s = scrape(c)
    assert c.settings.per_communicator is False
    assert {k[0] for k in s if k[0].startswith("gpunet_nccl_communicator_")} == {
        "gpunet_nccl_communicator_ranks"}
    assert not [k for k in s if k[0] == "gpunet_nccl_communicators_unlabelled"]
    assert not [lbl for k in s for lbl in k[1] if lbl[0] == "communicator"]


def test_per_communicator_healthy() -> None:
    with serving(Behaviour(json=fixture("healthy.json"))) as srv, \
            collector([srv.port], per_communicator=True) as c:
        s = scrape(c)
    p = str(srv.port)
    assert per_comm(s, "gpunet_nccl_communicator_expected_ranks") == {(HEALTHY_HASH,): 2}
    assert per_comm(s, "gpunet_nccl_communicator_status") == {
        (HEALTHY_HASH, st): float(st == "running") for st in ras.STATUSES}
    assert per_comm(s, "gpunet_nccl_communicator_missing_ranks") == {
        (HEALTHY_HASH, why): 0 for why in ("unreachable", "dead", "not_member")}
    assert per_comm(s, "gpunet_nccl_communicator_errored_ranks") == {(HEALTHY_HASH,): 0}
    assert per_comm(s, "gpunet_nccl_communicator_skew_operations") == {(HEALTHY_HASH,): 0}
    assert per_comm(s, "gpunet_nccl_communicator_stalled_ranks") == {}  # one report only
    assert value(s, "gpunet_nccl_communicators_unlabelled", port=p) == 0


def test_per_communicator_dead_rank() -> None:
    with serving(Behaviour(json=fixture("dead.json"))) as srv, \
            collector([srv.port], per_communicator=True) as c:
        s = scrape(c)
    assert per_comm(s, "gpunet_nccl_communicator_missing_ranks") == {
        (DEAD_HASH, "dead"): 1, (DEAD_HASH, "unreachable"): 0, (DEAD_HASH, "not_member"): 0}
    assert per_comm(s, "gpunet_nccl_communicator_expected_ranks") == {(DEAD_HASH,): 2}


def test_per_communicator_stuck_rank() -> None:
    with serving(Behaviour(json=fixture("stuck-1.json"))) as srv, \
            collector([srv.port], per_communicator=True) as c:
        first = scrape(c)
        srv.behaviour = Behaviour(json=fixture("stuck-2.json"))
        second = scrape(c)
    assert per_comm(first, "gpunet_nccl_communicator_stalled_ranks") == {}
    assert per_comm(second, "gpunet_nccl_communicator_stalled_ranks") == {(HEALTHY_HASH,): 1}
    assert per_comm(second, "gpunet_nccl_communicator_skew_operations") == {(HEALTHY_HASH,): 20}


def test_per_communicator_text_report_counts_them_unlabelled() -> None:
    with serving(Behaviour(json=None, text=fixture("dead.txt"))) as srv, \
            collector([srv.port], per_communicator=True) as c:
        s = scrape(c)
    assert not [k for k in s if k[0].startswith("gpunet_nccl_communicator_")
                and k[0] != "gpunet_nccl_communicator_ranks"]
    assert value(s, "gpunet_nccl_communicators_unlabelled", port=str(srv.port)) == 1


def several() -> str:
    """Synthetic, from a real report: five communicators of job A's. 0xc lost rank 1 (dead),
    both ranks of 0xe hold an asynchronous error, 0xd has a skew of 50, 0xa and 0xb are
    healthy."""
    doc = json.loads(fixture("healthy.json"))
    base = doc["communicators"][0]
    comms = []
    for h in ("0xb", "0xe", "0xa", "0xd", "0xc"):
        comm = json.loads(json.dumps(base))
        comm["hash"] = h
        comms.append(comm)
    by = {c["hash"]: c for c in comms}
    gone = by["0xc"]["ranks"].pop()
    gone["status"] = {"unresponsive": True, "considered_dead": True}
    del gone["collective_counts"]
    by["0xc"]["missing_ranks"] = [gone]
    for r in by["0xe"]["ranks"]:
        r["status"]["async_error"] = 6
    by["0xd"]["ranks"][0]["collective_counts"]["AllReduce"] += 50
    doc["communicators"] = comms
    return json.dumps(doc, indent=2)


@pytest.mark.parametrize("limit, labelled", [
    (1, ["0xc"]), (2, ["0xc", "0xe"]), (3, ["0xc", "0xe", "0xd"]),
    (4, ["0xc", "0xe", "0xd", "0xa"]), (64, ["0xc", "0xe", "0xd", "0xa", "0xb"]),
])
def test_per_communicator_keeps_the_most_troubled(limit: int, labelled: list[str]) -> None:
    """Missing ranks before errored ones before skew, ties by hash; the rest counted."""
    with serving(Behaviour(json=several())) as srv, \
            collector([srv.port], per_communicator=True, max_communicators=limit) as c:
        s = scrape(c)
    assert value(s, "gpunet_nccl_communicators", port=str(srv.port), status="running") == 5
    for name in ("expected_ranks", "errored_ranks", "skew_operations"):
        assert sorted(per_comm(s, f"gpunet_nccl_communicator_{name}")) == sorted(
            (h,) for h in labelled)
    assert value(s, "gpunet_nccl_communicators_unlabelled", port=str(srv.port)) == 5 - len(
        labelled)
    errored = per_comm(s, "gpunet_nccl_communicator_errored_ranks")
    assert errored.get(("0xe",), 2) == 2 and errored.get(("0xc",), 0) == 0
    skew = per_comm(s, "gpunet_nccl_communicator_skew_operations")
    assert skew.get(("0xd",), 50) == 50


def test_per_communicator_shared_hash_takes_the_secondary() -> None:
    """Two communicators with one primary hash are told apart by their secondary hash."""
    doc = json.loads(fixture("healthy.json"))
    twin = json.loads(json.dumps(doc["communicators"][0]))
    twin["secondary_hash"] = "0x1:0x2"
    doc["communicators"].append(twin)
    with serving(Behaviour(json=json.dumps(doc))) as srv, \
            collector([srv.port], per_communicator=True) as c:
        s = scrape(c)
    assert set(per_comm(s, "gpunet_nccl_communicator_expected_ranks")) == {
        (f"{HEALTHY_HASH}/0xf3a508a388abac92:0xfe50d8ba0ff213b1",), (f"{HEALTHY_HASH}/0x1:0x2",)}
