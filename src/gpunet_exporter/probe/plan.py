"""Pairing plans for fleet probes (issue 18): which nodes probe each other, and when.

A plan is a list of rounds; a round is a list of disjoint pairs, so its pairs run at once. Every
function here is pure and deterministic; node names are taken in the order given, and a name
given twice is an error. The kinds (``ring``, ``random_pairs``, ``repair``, ``leaf_aware``) and
what each is for: docs/fleet.md, "Plans".
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

Pair = tuple[str, str]
Round = list[Pair]
Plan = list[Round]
KINDS = ("ring", "random", "repair", "leaf")


class PlanError(ValueError):
    """Arguments no plan can be made of; the text says why in one line."""


def _check_nodes(nodes: Sequence[str]) -> list[str]:
    out = list(nodes)
    seen: set[str] = set()
    for n in out:
        if not isinstance(n, str) or not n:
            raise PlanError(f"node names must be non-empty strings, got {n!r}")
        if n in seen:
            raise PlanError(f"node {n!r} is listed twice")
        seen.add(n)
    return out


def check(plan: Plan) -> None:
    """Raise PlanError unless every round's pairs are disjoint and no pair is a node alone."""
    for i, rnd in enumerate(plan):
        used: set[str] = set()
        for a, b in rnd:
            if a == b:
                raise PlanError(f"round {i}: {a!r} paired with itself")
            if a in used or b in used:
                raise PlanError(f"round {i}: {a if a in used else b!r} is in two pairs")
            used.update((a, b))


def _nonempty(rounds: Sequence[Round]) -> Plan:
    return [list(r) for r in rounds if r]


def schedule(pairs: Sequence[Pair]) -> Plan:
    """Pairs into rounds, greedily: each pair in the first round where neither of its nodes is
    busy yet (at most 2 x the most pairs of one node - 1 rounds)."""
    rounds: list[Round] = []
    used: list[set[str]] = []
    for a, b in pairs:
        for rnd, busy in zip(rounds, used, strict=True):
            if a not in busy and b not in busy:
                rnd.append((a, b))
                busy.update((a, b))
                break
        else:
            rounds.append([(a, b)])
            used.append({a, b})
    return rounds


def ring(nodes: Sequence[str], hops: int = 1) -> Plan:
    """Each node paired with its successor (the last with the first); with ``hops`` above 1,
    also with the nodes 2 .. ``hops`` places on: 2 x ``hops`` pairs per node once there are
    more than 2 x ``hops`` nodes (fewer nodes: every pair once)."""
    if hops < 1:
        raise PlanError(f"hops must be at least 1, got {hops}")
    ns = _check_nodes(nodes)
    n = len(ns)
    if hops > 1:
        seen: set[frozenset[str]] = set()
        edges: list[Pair] = []
        for d in range(1, hops + 1):
            for i in range(n):
                a, b = ns[i], ns[(i + d) % n]
                if a != b and frozenset((a, b)) not in seen:
                    seen.add(frozenset((a, b)))
                    edges.append((a, b))
        return schedule(edges)
    if n < 2:
        return []
    if n == 2:
        return [[(ns[0], ns[1])]]
    edges = [(ns[i], ns[(i + 1) % n]) for i in range(n)]
    if n % 2 == 0:
        return _nonempty([edges[0::2], edges[1::2]])
    # An odd cycle needs three rounds: the closing edge meets the first one.
    return _nonempty([edges[0:n - 1:2], edges[1:n - 1:2], [edges[n - 1]]])


def random_pairs(nodes: Sequence[str], seed: int) -> Plan:
    """A perfect matching of the nodes shuffled by ``seed``; an odd one out is paired again
    with the first node of the shuffle, in a second round."""
    ns = _check_nodes(nodes)
    rng = random.Random(seed)
    rng.shuffle(ns)
    rounds: list[Round] = [[(ns[i], ns[i + 1]) for i in range(0, len(ns) - 1, 2)]]
    if len(ns) % 2 == 1 and len(ns) >= 3:
        rounds.append([(ns[-1], ns[0])])
    return _nonempty(rounds)


def repair(nodes: Sequence[str], suspects: Sequence[str], good: Sequence[str] | None = None,
           leaves: Mapping[str, str] | None = None) -> Plan:
    """Each suspect paired with a distinct known-good node, in one round. ``good`` defaults to
    every node that is not a suspect; with ``leaves``, a good node of the suspect's own leaf
    is taken first."""
    ns = _check_nodes(nodes)
    known = set(ns)
    sus = _check_nodes(suspects)
    for s in sus:
        if s not in known:
            raise PlanError(f"suspect {s!r} is not one of the nodes")
    goods = [n for n in ns if n not in set(sus)] if good is None else _check_nodes(good)
    for g in goods:
        if g not in known:
            raise PlanError(f"good node {g!r} is not one of the nodes")
        if g in sus:
            raise PlanError(f"node {g!r} is both a suspect and a good node")
    if len(goods) < len(sus):
        raise PlanError(f"{len(sus)} suspects need as many good nodes, there are {len(goods)}")
    leaf = leaves or {}
    free = list(goods)
    pairs: Round = []
    for s in sus:
        same = [g for g in free if s in leaf and leaf.get(g) == leaf[s]]
        g = same[0] if same else free[0]
        free.remove(g)
        pairs.append((s, g))
    return _nonempty([pairs])


def _matching(group: Sequence[str]) -> list[Round]:
    """Pairs within one group: a matching, and the odd one out with the group's first node in
    a second round."""
    first: Round = [(group[i], group[i + 1]) for i in range(0, len(group) - 1, 2)]
    second: Round = [(group[-1], group[0])] if len(group) % 2 == 1 and len(group) >= 3 else []
    return [first, second]


def leaf_aware(nodes: Sequence[str], leaves: Mapping[str, str]) -> Plan:
    """Per node an intra-leaf pair (when its leaf has another node) and a cross-leaf pair (when
    there is another leaf). Intra-leaf pairs come first, then cross-leaf ones; a node whose
    leaf holds more than half of the nodes may share a cross-leaf partner with another such
    node, in a later round."""
    ns = _check_nodes(nodes)
    for n in ns:
        if n not in leaves or not isinstance(leaves[n], str) or not leaves[n]:
            raise PlanError(f"node {n!r} has no leaf")
    groups: dict[str, list[str]] = {}
    for n in ns:
        groups.setdefault(leaves[n], []).append(n)
    intra: list[Round] = [[], []]
    for members in groups.values():
        a, b = _matching(members)
        intra[0].extend(a)
        intra[1].extend(b)
    # Cross-leaf: repeatedly pair a node of the fullest leaf with one of the next fullest.
    left = {leaf: list(members) for leaf, members in groups.items()}
    cross: Round = []
    while True:
        order = sorted((leaf for leaf in left if left[leaf]), key=lambda k: -len(left[k]))
        if len(order) < 2:
            break
        cross.append((left[order[0]].pop(0), left[order[1]].pop(0)))
    rounds = [*intra, cross]
    rest = [n for members in left.values() for n in members]  # all of one leaf, if any
    if rest and len(groups) >= 2:
        others = [n for n in ns if leaves[n] != leaves[rest[0]]]
        for k in range(0, len(rest), len(others)):
            rounds.append(list(zip(rest[k:k + len(others)], others, strict=False)))
    return _nonempty(rounds)


def make(kind: str, nodes: Sequence[str], *, seed: int = 0,
         suspects: Sequence[str] = (), good: Sequence[str] | None = None,
         leaves: Mapping[str, str] | None = None, hops: int = 1) -> Plan:
    """The plan of ``kind`` (one of KINDS)."""
    if kind == "ring":
        return ring(nodes, hops)
    if kind == "random":
        return random_pairs(nodes, seed)
    if kind == "repair":
        if not suspects:
            raise PlanError("a repair plan needs --suspects")
        return repair(nodes, suspects, good, leaves)
    if kind == "leaf":
        if not leaves:
            raise PlanError("a leaf plan needs --leaves")
        return leaf_aware(nodes, leaves)
    raise PlanError(f"kind {kind!r}, expected one of {', '.join(KINDS)}")


def to_json(kind: str, plan: Plan) -> dict[str, object]:
    """The plan as `gpunet-probe plan` prints it."""
    return {"kind": kind, "rounds": [[list(p) for p in rnd] for rnd in plan]}


def peers(plan: Plan, node: str) -> list[str]:
    """The nodes ``node`` is paired with in ``plan``, each once, in plan order."""
    out: list[str] = []
    for rnd in plan:
        for a, b in rnd:
            other = b if a == node else a if b == node else None
            if other is not None and other not in out:
                out.append(other)
    return out
