"""Pairing plans for fleet probes (src/gpunet_exporter/probe/plan.py) and `gpunet-probe plan`."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from gpunet_exporter.probe import adaptive, cli, plan
from gpunet_exporter.probe.plan import Plan, PlanError

NAMES = hs.lists(hs.from_regex(r"[a-z][a-z0-9-]{0,8}", fullmatch=True), unique=True,
                 max_size=40)


def pairs_of(p: Plan) -> list[tuple[str, str]]:
    return [pair for rnd in p for pair in rnd]


def per_node(p: Plan) -> Counter[str]:
    return Counter(n for pair in pairs_of(p) for n in pair)


def assert_rounds_disjoint(p: Plan) -> None:
    plan.check(p)  # raises on a node in two pairs of one round
    for rnd in p:
        nodes = [n for pair in rnd for n in pair]
        assert len(nodes) == len(set(nodes))
        assert rnd, "no empty rounds"


@given(NAMES)
def test_ring_covers_every_node_in_two_pairs(nodes: list[str]) -> None:
    p = plan.ring(nodes)
    assert_rounds_disjoint(p)
    if len(nodes) >= 3:
        assert per_node(p) == dict.fromkeys(nodes, 2)
        assert len(p) == (2 if len(nodes) % 2 == 0 else 3)
        # Each node with its successor.
        edges = {frozenset(pair) for pair in pairs_of(p)}
        assert edges == {frozenset((nodes[i], nodes[(i + 1) % len(nodes)]))
                         for i in range(len(nodes))}
    elif len(nodes) == 2:
        assert p == [[(nodes[0], nodes[1])]]
    else:
        assert p == []


@given(NAMES, hs.integers(2, 4))
def test_ring_with_hops_pairs_each_node_with_the_next_k(nodes: list[str], hops: int) -> None:
    p = plan.ring(nodes, hops)
    assert_rounds_disjoint(p)
    n = len(nodes)
    want = {frozenset((nodes[i], nodes[(i + d) % n])) for d in range(1, hops + 1)
            for i in range(n) if nodes[i] != nodes[(i + d) % n]}
    assert {frozenset(pair) for pair in pairs_of(p)} == want
    assert len(pairs_of(p)) == len(want)  # each pair once
    if n > 2 * hops:
        assert per_node(p) == dict.fromkeys(nodes, 2 * hops)
        assert len(p) <= 4 * hops - 1  # greedy: at most 2 x (pairs per node) - 1 rounds


def test_ring_with_two_hops_gives_four_pairs_in_five_rounds() -> None:
    nodes = [f"n{i}" for i in range(10)]
    p = plan.ring(nodes, 2)
    assert per_node(p) == dict.fromkeys(nodes, 4) and len(p) == 5
    with pytest.raises(PlanError, match="hops must be at least 1"):
        plan.ring(nodes, 0)


@given(NAMES, hs.integers(0, 2**32))
def test_random_is_a_matching_and_deterministic(nodes: list[str], seed: int) -> None:
    p = plan.random_pairs(nodes, seed)
    assert p == plan.random_pairs(list(nodes), seed)
    assert_rounds_disjoint(p)
    if len(nodes) < 2:
        assert p == []
        return
    first = p[0]
    covered = {n for pair in first for n in pair}
    assert len(first) == len(nodes) // 2
    if len(nodes) % 2 == 0:
        assert len(p) == 1 and covered == set(nodes)
    else:  # the odd one out is paired a second time, in a round of its own
        assert len(p) == 2 and len(p[1]) == 1
        (extra, partner), = p[1]
        assert extra not in covered and partner in covered
        assert per_node(p)[partner] == 2


def test_random_seeds_differ() -> None:
    nodes = [f"n{i}" for i in range(16)]
    assert len({json.dumps(plan.random_pairs(nodes, s)) for s in range(5)}) > 1


@given(hs.data())
def test_repair_pairs_each_suspect_with_a_distinct_good_node(data: hs.DataObject) -> None:
    nodes = data.draw(NAMES.filter(lambda n: len(n) >= 2))
    suspects = data.draw(hs.lists(hs.sampled_from(nodes), unique=True, min_size=1,
                                  max_size=len(nodes) // 2))
    p = plan.repair(nodes, suspects)
    assert_rounds_disjoint(p)
    assert len(p) == 1
    assert [s for s, _ in p[0]] == suspects
    goods = [g for _, g in p[0]]
    assert len(set(goods)) == len(goods) and not set(goods) & set(suspects)


def test_repair_prefers_a_good_node_of_the_suspects_leaf() -> None:
    leaves = {"a": "l1", "b": "l1", "c": "l2", "d": "l2"}
    assert plan.repair(list(leaves), ["c"], leaves=leaves) == [[("c", "d")]]
    assert plan.repair(list(leaves), ["c", "d"], leaves=leaves) == [[("c", "a"), ("d", "b")]]
    assert plan.repair(list(leaves), ["a"], good=["c"]) == [[("a", "c")]]


@pytest.mark.parametrize(("suspects", "good", "message"), [
    (["a", "b", "c"], None, "3 suspects need as many good nodes, there are 1"),
    (["a", "b"], ["c"], "2 suspects need as many good nodes, there are 1"),
    (["x"], None, "suspect 'x' is not one of the nodes"),
    (["a"], ["a"], "node 'a' is both a suspect and a good node"),
    (["a"], ["z"], "good node 'z' is not one of the nodes"),
    (["a", "a"], None, "node 'a' is listed twice"),
])
def test_repair_fails_clearly(suspects: list[str], good: list[str] | None,
                              message: str) -> None:
    with pytest.raises(PlanError, match=message):
        plan.repair(["a", "b", "c", "d"], suspects, good)


@given(hs.data())
def test_leaf_aware_gives_intra_and_cross_leaf_pairs(data: hs.DataObject) -> None:
    nodes = data.draw(NAMES)
    leaves = {n: data.draw(hs.sampled_from(["l1", "l2", "l3"])) for n in nodes}
    p = plan.leaf_aware(nodes, leaves)
    assert_rounds_disjoint(p)
    by_leaf = Counter(leaves.values())
    for n in nodes:
        mates = [b if a == n else a for a, b in pairs_of(p) if n in (a, b)]
        intra = [m for m in mates if leaves[m] == leaves[n]]
        cross = [m for m in mates if leaves[m] != leaves[n]]
        assert bool(intra) == (by_leaf[leaves[n]] >= 2), (n, p)
        assert bool(cross) == (len(by_leaf) >= 2), (n, p)


def test_leaf_aware_small_example() -> None:
    leaves = {"a": "r1", "b": "r1", "c": "r2", "d": "r2"}
    assert plan.leaf_aware(list(leaves), leaves) == [
        [("a", "b"), ("c", "d")], [("a", "c"), ("b", "d")]]
    with pytest.raises(PlanError, match="node 'e' has no leaf"):
        plan.leaf_aware([*leaves, "e"], leaves)


def test_peers_of_a_node() -> None:
    p = plan.ring(["a", "b", "c", "d"])
    assert plan.peers(p, "a") == ["b", "d"]
    assert plan.peers(p, "z") == []


# -- gpunet-probe plan ------------------------------------------------------------------------


def run_plan(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    try:
        rc = cli.main(["plan", *args])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("args", [
    ("--kind", "ring"),
    ("--kind", "random", "--seed", "7"),
    ("--kind", "repair", "--suspects", "b,d"),
    ("--kind", "leaf", "--leaves", "a=r1,b=r1,c=r2,d=r2,e=r3"),
])
def test_cli_prints_the_plan_as_json(capsys: pytest.CaptureFixture[str],
                                     args: tuple[str, ...]) -> None:
    rc, out, err = run_plan(capsys, "--nodes", "a,b,c,d,e", *args)
    assert rc == 0 and err == ""
    data = json.loads(out)
    assert data["kind"] == args[1]
    rounds = [[tuple(pair) for pair in rnd] for rnd in data["rounds"]]
    plan.check(rounds)
    assert {n for rnd in rounds for pair in rnd for n in pair} <= set("abcde")
    assert rounds  # five nodes always make pairs


@pytest.mark.parametrize(("args", "message"), [
    (("--nodes", "a,b", "--kind", "repair", "--suspects", "a,b"), "2 suspects need"),
    (("--nodes", "a,b", "--kind", "repair"), "a repair plan needs --suspects"),
    (("--nodes", "a,b", "--kind", "leaf"), "a leaf plan needs --leaves"),
    (("--nodes", "a,b", "--kind", "leaf", "--leaves", "a=x,b"), "node=leaf"),
    (("--nodes", "a,a", "--kind", "ring"), "listed twice"),
    (("--nodes", "a,b", "--kind", "star"), "invalid choice"),
    (("--nodes", "a,b", "--kind", "random", "--seed", "x"), "invalid int value"),
    (("--kind", "ring"), "required"),
])
def test_cli_bad_input_one_line_exit_2(capsys: pytest.CaptureFixture[str],
                                       args: tuple[str, ...], message: str) -> None:
    rc, out, err = run_plan(capsys, *args)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("gpunet-probe plan: error: "), err
    assert message in err and "Traceback" not in err


# -- adaptive passes (probe/adaptive.py, issue 35) ------------------------------------------

def run_pass(nodes: list[str], bad: set[str], leaves: dict[str, str] | None = None,
             bad_pairs: set[frozenset[str]] = frozenset(), skipped: set[str] = frozenset(),
             **kw: int) -> tuple[adaptive.Verdict, list[plan.Round]]:
    """An adaptive pass against a fleet where ``bad`` fail every pair, ``bad_pairs`` fail
    (their link) and the pairs of ``skipped`` are not measured."""
    s = adaptive.start(nodes, leaves, **kw)
    rounds = []
    while (rnd := adaptive.next_round(s)) is not None:
        rounds.append(rnd)
        s = adaptive.record(s, {p: adaptive.SKIPPED if set(p) & skipped else adaptive.FAILED
                                if set(p) & bad or frozenset(p) in bad_pairs else adaptive.OK
                                for p in rnd})
    assert len(rounds) <= s.max_rounds
    return adaptive.verdict(s), rounds


@given(hs.integers(2, 40), hs.data())
def test_adaptive_rounds_are_disjoint_and_find_the_bad_nodes(n: int, data: hs.DataObject
                                                              ) -> None:
    nodes = [f"n{i}" for i in range(n)]
    bad = set(data.draw(hs.lists(hs.sampled_from(nodes), max_size=max(0, n // 2 - 1))))
    v, rounds = run_pass(nodes, bad, max_rounds=64)
    for rnd in rounds:
        assert_rounds_disjoint([rnd])
    assert v.done
    assert set(v.bad_nodes) <= bad  # no healthy node is ever named
    if n - len(bad) >= 2:  # enough good nodes to confirm each suspect twice
        assert set(v.bad_nodes) == bad, (v, rounds)
        assert not v.unresolved and not v.suspect_links


@given(hs.integers(2, 60))
def test_a_healthy_fleet_is_done_after_one_round(n: int) -> None:
    nodes = [f"n{i}" for i in range(n)]
    v, rounds = run_pass(nodes, set())
    # even: one perfect matching; odd: the one left out is paired in a second round
    assert len(rounds) == (1 if n % 2 == 0 else 2)
    assert {x for rnd in rounds for p in rnd for x in p} == set(nodes)
    assert (v.bad_nodes, v.unresolved, v.suspect_links, v.done) == ((), (), (), True)


def test_one_bad_node_of_six_in_two_rounds() -> None:
    nodes = [f"n{i}" for i in range(6)]
    v, rounds = run_pass(nodes, {"n3"})
    assert rounds == [[("n0", "n1"), ("n2", "n3"), ("n4", "n5")], [("n2", "n0"), ("n3", "n1")]]
    assert (v.bad_nodes, v.rounds, v.pairs) == (("n3",), 2, 5)


def test_five_bad_of_232_in_two_or_three_rounds() -> None:
    nodes = [f"n{i}" for i in range(232)]
    leaves = {n: f"leaf{i // 32}" for i, n in enumerate(nodes)}
    for bad in ({"n3", "n40", "n77", "n150", "n231"}, {"n0", "n1", "n2", "n3", "n4"}):
        v, rounds = run_pass(nodes, bad, leaves)
        assert set(v.bad_nodes) == bad and not v.unresolved
        assert len(rounds) <= 3 and v.pairs <= 116 + 4 * len(bad)


def test_two_bad_nodes_paired_together_need_a_third_round() -> None:
    nodes = [f"n{i}" for i in range(6)]
    v, rounds = run_pass(nodes, {"n0", "n1"})  # round 1 pairs them with each other
    assert rounds[0][0] == ("n0", "n1")
    assert set(v.bad_nodes) == {"n0", "n1"} and len(rounds) == 3


def test_more_suspects_than_good_nodes() -> None:
    nodes = [f"n{i}" for i in range(6)]
    v, rounds = run_pass(nodes, {"n0", "n1", "n2", "n3"})
    assert set(v.bad_nodes) == {"n0", "n1", "n2", "n3"} and not v.unresolved
    assert all(len(rnd) <= 2 for rnd in rounds[1:])  # two good nodes: two tests a round


def test_two_nodes_cannot_tell_which_end_is_bad() -> None:
    v, rounds = run_pass(["a", "b"], {"a"})
    assert rounds == [[("a", "b")]]
    assert v.bad_nodes == () and [w for w, _ in v.unresolved] == ["a", "b"]
    assert "no other node left to test it with" in v.unresolved[0][1]


def test_all_bad_is_unresolved_not_blamed() -> None:
    v, _ = run_pass([f"n{i}" for i in range(5)], {f"n{i}" for i in range(5)})
    assert v.bad_nodes == () and len(v.unresolved) == 5


def test_max_rounds_leaves_suspects_unresolved() -> None:
    v, rounds = run_pass([f"n{i}" for i in range(6)], {"n0", "n1"}, max_rounds=2)
    assert len(rounds) == 2 and not v.done and v.bad_nodes == ()
    assert [w for w, _ in v.unresolved] == ["n0", "n1"]
    assert "--max-rounds" in v.unresolved[0][1]


def test_a_bad_link_between_two_leaves_is_the_leaf_pair() -> None:
    nodes = [f"n{i}" for i in range(6)]
    leaves = {n: "a" if i < 3 else "b" for i, n in enumerate(nodes)}
    v, rounds = run_pass(nodes, set(), leaves, bad_pairs={frozenset(("n0", "n3"))})
    assert rounds[0][0] == ("n0", "n3")  # round 1 crosses the spine
    assert v.bad_nodes == () and v.suspect_links == (("n0", "n3"),)
    assert v.suspect_leaves == (("a", "b"),)
    assert ("n0", "n3") in rounds[-1]  # run again once before it is named


def test_a_leaf_whose_cross_leaf_pairs_fail_is_named() -> None:
    nodes = [f"n{i}" for i in range(12)]
    leaves = {n: f"l{i % 3}" for i, n in enumerate(nodes)}
    cross = {frozenset((a, b)) for a in nodes for b in nodes
             if leaves[a] != leaves[b] and "l0" in (leaves[a], leaves[b])}
    v, _ = run_pass(nodes, set(), leaves, bad_pairs=cross)
    assert v.bad_nodes == () and v.suspect_leaves[0] == ("l0",)
    assert all("l0" in (leaves[a], leaves[b]) for a, b in v.suspect_links)


def test_a_link_that_passes_when_run_again_is_not_named() -> None:
    nodes = [f"n{i}" for i in range(4)]
    s = adaptive.start(nodes)
    s = adaptive.record(s, {("n0", "n1"): adaptive.FAILED, ("n2", "n3"): adaptive.OK})
    assert adaptive.next_round(s) == [("n0", "n2"), ("n1", "n3")]
    s = adaptive.record(s, {("n0", "n2"): adaptive.OK, ("n1", "n3"): adaptive.OK})
    assert adaptive.next_round(s) == [("n0", "n1")]
    s = adaptive.record(s, {("n0", "n1"): adaptive.OK})
    v = adaptive.verdict(s)
    assert adaptive.next_round(s) is None
    assert (v.bad_nodes, v.suspect_links) == ((), ())
    assert v.unresolved == (("n0-n1", "failed, then passed when run again"),)


def test_a_suspect_on_a_leaf_with_a_bad_uplink_is_not_blamed_for_cross_leaf_pairs() -> None:
    """n0's leaf has no other good node free, so it meets good nodes across the spine and fails
    (the uplink): two such failures do not make it bad, a pass on its own leaf clears it."""
    nodes = ["n0", "n1", "m0", "m1", "m2"]
    leaves = {"n0": "a", "n1": "a", "m0": "b", "m1": "b", "m2": "b"}
    s = adaptive.start(nodes, leaves)
    s = adaptive.record(s, {("n0", "m0"): adaptive.SLOW, ("n1", "m1"): adaptive.OK})
    s = adaptive.record(s, {("n0", "m1"): adaptive.SLOW, ("m0", "m2"): adaptive.OK})
    assert "n0" not in adaptive.verdict(s).bad_nodes
    assert adaptive.next_round(s)[0] == ("n0", "n1")  # its own leaf's good node now


def test_skipped_pairs_are_no_evidence() -> None:
    nodes = [f"n{i}" for i in range(4)]
    v, rounds = run_pass(nodes, set(), skipped={"n3"})
    # n3 is tried in UNTESTED_TRIES rounds; n2, whose first pair was n3's, is measured in
    # the second
    assert v.bad_nodes == () and len(rounds) == adaptive.UNTESTED_TRIES
    assert rounds[1] == [("n2", "n0"), ("n3", "n1")]
    assert [w for w, _ in v.unresolved] == ["n3"]
    assert "skipped" in v.unresolved[0][1]


def test_slow_pairs_are_judged_against_the_passes_median() -> None:
    got = adaptive.with_slow([{("a", "b"): ("ok", 100.0), ("c", "d"): ("ok", 40.0),
                               ("e", "f"): ("failed", None)},
                              {("a", "c"): ("ok", 90.0), ("b", "d"): ("ok", None),
                               ("e", "a"): ("skipped", None)}])
    assert got == [{("a", "b"): "ok", ("c", "d"): "slow", ("e", "f"): "failed"},
                   {("a", "c"): "ok", ("b", "d"): "ok", ("e", "a"): "skipped"}]


def test_the_slow_ratio_is_the_fleet_rules_default() -> None:
    from gpunet_exporter.mixin.thresholds import Fleet
    assert Fleet().link_slow_ratio == adaptive.SLOW_RATIO


@pytest.mark.parametrize(("call", "message"), [
    (lambda: adaptive.start(["a", "a"]), "listed twice"),
    (lambda: adaptive.start(["a", "b"], max_rounds=0), "max rounds must be from 1"),
    (lambda: adaptive.record(adaptive.start(["a", "b"]), {("a", "b"): "meh"}), "outcome 'meh'"),
    (lambda: adaptive.record(adaptive.start(["a", "b"]), {("a", "c"): "ok"}), "'c' is not"),
])
def test_adaptive_bad_input_says_why(call: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        call()  # type: ignore[operator]


def test_the_verdict_as_json() -> None:
    v, _ = run_pass([f"n{i}" for i in range(6)], {"n3"})
    assert adaptive.verdict_json(v) == {"verdict": {
        "bad_nodes": ["n3"], "suspect_links": [], "suspect_leaves": [], "unresolved": [],
        "rounds": 2, "pairs": 5, "done": True}}


def test_a_link_is_followed_to_its_leaf_across_a_third_one() -> None:
    """x's traffic across the spine goes through a bad uplink of its leaf (a fat tree routes
    by destination, so every cross-leaf pair of x crosses it): round 1 fails x's pair, round 2
    clears both ends on their own leaves, round 3 meets each end with a third leaf, and only
    x's fails: leaf a is named, alone."""
    nodes = [f"{leaf}{i}" for leaf in "abc" for i in range(3)]
    leaves = {n: n[0] for n in nodes}
    first = adaptive.next_round(adaptive.start(nodes, leaves))
    assert first is not None
    x, y = next(p for p in first if leaves[p[0]] == "a" and leaves[p[1]] != "a")
    cross = {frozenset((x, m)) for m in nodes if leaves[m] != "a"}
    v, rounds = run_pass(nodes, set(), leaves, bad_pairs=cross)
    assert v.bad_nodes == () and v.suspect_leaves == (("a",),), (v, rounds)
    third = {"b", "c"} - {leaves[y]}
    assert any(x in p and {leaves[m] for m in p} & third for p in rounds[2]), rounds
    assert len(rounds) == 3 and not v.unresolved


def test_a_leaf_cut_off_from_the_spine_blames_no_node() -> None:
    """Every cross-leaf pair of leaf a fails (all its uplinks): a's nodes fail round 1 and
    have no good node of their own leaf; they meet each other, pass, and a is named."""
    nodes = [f"{leaf}{i}" for leaf in "abc" for i in range(4)]
    leaves = {n: n[0] for n in nodes}
    cross = {frozenset((x, m)) for x in nodes for m in nodes
             if leaves[x] == "a" and leaves[m] != "a"}
    v, rounds = run_pass(nodes, set(), leaves, bad_pairs=cross)
    assert v.bad_nodes == () and v.suspect_leaves == (("a",),), (v, rounds)
    assert rounds[1][:2] == [("a0", "a1"), ("a2", "a3")]  # of its own leaf, before others


def test_a_node_alone_on_its_leaf_that_fails_across_the_spine_is_unresolved() -> None:
    """x is alone on its leaf: failing with good nodes of other leaves cannot tell the node from
    its leaf's uplinks, so it is not named bad, and not tested further once it failed with 2."""
    nodes = ["x", *(f"b{i}" for i in range(4)), *(f"c{i}" for i in range(3))]
    leaves = {n: n[0] for n in nodes}
    v, rounds = run_pass(nodes, {"x"}, leaves)
    assert v.bad_nodes == () and [w for w, _ in v.unresolved] == ["x"]
    assert "the node or its leaf's uplinks" in v.unresolved[0][1]
    # its round-1 partner, cleared in round 2, and its round-2 one: CONFIRM known-good nodes
    assert sum("x" in p for rnd in rounds for p in rnd) == adaptive.CONFIRM
