"""Pairing plans for fleet probes (src/gpunet_exporter/probe/plan.py) and `gpunet-probe plan`."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from gpunet_exporter.probe import cli, plan
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
