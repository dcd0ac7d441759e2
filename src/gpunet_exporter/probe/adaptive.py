"""Adaptive fleet plans (issue 35): one round at a time, each planned from the results so far.

Pure and deterministic, like probe/plan.py. ``start`` makes the state of a pass (the nodes,
their leaves if known), ``record`` adds a round's outcomes (pair -> ``ok``, ``slow``,
``failed``, or ``skipped``: not measured, no evidence), ``next_round`` gives the next round's
disjoint pairs or None when the pass is done, and ``verdict`` what the evidence says: bad
nodes, suspected links and leaves, and what it could not separate. The strategy and why:
docs/fleet.md, "Adaptive plans".

The model: a bad node fails (or is slow in) every pair it is in; a bad link or uplink fails
some pairs between two good nodes, and only pairs that cross it (with leaves: cross-leaf
pairs); a pair of two good nodes over good links passes. So a pass clears both ends, and a
node that failed with two different nodes that passed elsewhere is bad.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpunet_exporter.probe.plan import Pair, PlanError, Round, _check_nodes, check

KIND = "adaptive"
MAX_ROUNDS = 8  # the pass stops after this many rounds, decided or not (--max-rounds)
MAX_ROUNDS_LIMIT = 64
SLOW_RATIO = 0.5  # bus bandwidth under this x the pass's median: slow (fleet.link_slow_ratio's)
CONFIRM = 2  # distinct known-good nodes a suspect must fail with to be bad, one on its leaf
UNTESTED_TRIES = 2  # rounds a node whose pairs were not measured is tried in

OK, SLOW, FAILED, SKIPPED = "ok", "slow", "failed", "skipped"
OUTCOMES = (OK, SLOW, FAILED, SKIPPED)
NEGATIVE = frozenset((SLOW, FAILED))


@dataclass(frozen=True)
class State:
    """A pass so far: the nodes in the order given, their leaves (may be empty), and per round
    done the outcome of each of its pairs."""
    nodes: tuple[str, ...]
    leaves: Mapping[str, str] = field(default_factory=dict)
    results: tuple[tuple[tuple[Pair, str], ...], ...] = ()
    max_rounds: int = MAX_ROUNDS
    seed: int | None = None


@dataclass(frozen=True)
class Verdict:
    bad_nodes: tuple[str, ...]
    suspect_links: tuple[Pair, ...]  # failed (again) while both ends passed elsewhere
    suspect_leaves: tuple[tuple[str, ...], ...]  # (leaf,): its cross-leaf path; (a, b): a-b
    unresolved: tuple[tuple[str, str], ...]  # (node or "a-b", why)
    rounds: int
    pairs: int
    done: bool  # False: --max-rounds ran out with tests still to run


def start(nodes: Sequence[str], leaves: Mapping[str, str] | None = None, *,
          max_rounds: int = MAX_ROUNDS, seed: int | None = None) -> State:
    """The state of a pass over ``nodes`` before its first round; PlanError for bad input."""
    ns = _check_nodes(nodes)
    if not 1 <= max_rounds <= MAX_ROUNDS_LIMIT:
        raise PlanError(f"max rounds must be from 1 to {MAX_ROUNDS_LIMIT}, got {max_rounds}")
    got = {}
    known = set(ns)
    for n, leaf in (leaves or {}).items():
        if n in known:
            if not isinstance(leaf, str) or not leaf:
                raise PlanError(f"the leaf of {n!r} must be a non-empty string, got {leaf!r}")
            got[n] = leaf
    return State(tuple(ns), got, (), max_rounds, seed)


def record(state: State, outcomes: Mapping[Pair, str]) -> State:
    """``state`` with one more round done, whose pairs had ``outcomes``."""
    known = set(state.nodes)
    for (a, b), o in outcomes.items():
        if o not in OUTCOMES:
            raise PlanError(f"outcome {o!r} of {a}-{b}, expected one of {', '.join(OUTCOMES)}")
        for n in (a, b):
            if n not in known:
                raise PlanError(f"{n!r} is not one of the nodes")
    check([list(outcomes)])
    return State(state.nodes, state.leaves, (*state.results, tuple(outcomes.items())),
                 state.max_rounds, state.seed)


def with_slow(rounds: Sequence[Mapping[Pair, tuple[str, float | None]]],
              ratio: float = SLOW_RATIO) -> list[dict[Pair, str]]:
    """Outcomes from measurements: (``ok``/``failed``/``skipped``, bus bandwidth or None) per
    pair; an ok pair under ``ratio`` x the median bandwidth of every ok pair measured so far
    is ``slow`` (an ok pair without a bandwidth stays ok)."""
    bws = sorted(bw for rnd in rounds for o, bw in rnd.values() if o == OK and bw is not None)
    median = (bws[len(bws) // 2] + bws[(len(bws) - 1) // 2]) / 2 if bws else None
    out = []
    for rnd in rounds:
        out.append({p: SLOW if o == OK and bw is not None and median is not None
                    and bw < ratio * median else o for p, (o, bw) in rnd.items()})
    return out


# -- the evidence --------------------------------------------------------------------------

class _Evidence:
    def __init__(self, state: State) -> None:
        self.state = state
        self.order = {n: i for i, n in enumerate(state.nodes)}
        self.tests: list[tuple[Pair, str]] = [t for rnd in state.results for t in rnd]
        self.cleared = {n for (a, b), o in self.tests if o == OK for n in (a, b)}
        self.partners: dict[str, set[str]] = {n: set() for n in state.nodes}
        self.negs: dict[str, list[str]] = {n: [] for n in state.nodes}
        self.skips: dict[str, int] = dict.fromkeys(state.nodes, 0)
        self.history: dict[frozenset[str], list[str]] = {}
        for (a, b), o in self.tests:
            self.partners[a].add(b)
            self.partners[b].add(a)
            self.history.setdefault(frozenset((a, b)), []).append(o)
            if o in NEGATIVE:
                self.negs[a].append(b)
                self.negs[b].append(a)
            elif o == SKIPPED:
                self.skips[a] += 1
                self.skips[b] += 1
        self.bad = {n for n in state.nodes if self._bad(n)}
        self.stuck = {n for n in state.nodes if self.negs[n] and self._stuck(n)}
        self.good = sorted(self.cleared, key=self.order.__getitem__)
        self.good_by_leaf: dict[str, list[str]] = {}
        for g in self.good:
            leaf = self.leaf(g)
            if leaf is not None:
                self.good_by_leaf.setdefault(leaf, []).append(g)

    def leaf(self, n: str) -> str | None:
        return self.state.leaves.get(n)

    def _bad(self, n: str) -> bool:
        if n in self.cleared:
            return False
        good = set(self.negs[n]) & self.cleared
        return len(good) >= CONFIRM and any(not self.cross(n, g) for g in good)

    def _stuck(self, n: str) -> bool:
        """A suspect that failed only across the spine, with CONFIRM known-good nodes or more,
        and has no node of its own leaf left to meet: the node, or its leaf's uplinks (a dead
        uplink fails every cross-leaf pair of the nodes routed through it); more pairs across
        the spine cannot tell which."""
        if n in self.cleared or n in self.bad or len(set(self.negs[n]) & self.cleared) < CONFIRM:
            return False
        mine = self.leaf(n)
        return not any(m != n and self.leaf(m) == mine and m not in self.partners[n]
                       and m not in self.bad for m in self.state.nodes)

    def suspects(self) -> list[str]:
        return [n for n in self.state.nodes if n not in self.cleared and n not in self.bad
                and n not in self.stuck and self.negs[n]]

    def untested(self) -> list[str]:
        return [n for n in self.state.nodes if n not in self.cleared and not self.negs[n]
                and self.skips[n] < UNTESTED_TRIES]

    def links(self) -> list[Pair]:
        """Pairs that failed and whose two ends both passed elsewhere, by their last test."""
        out = []
        for (a, b), o in self.tests:
            h = self.history[frozenset((a, b))]
            if o in NEGATIVE and {a, b} <= self.cleared and h[-1] in NEGATIVE and \
                    (a, b) not in out and (b, a) not in out:
                out.append((a, b))
        return out

    def transient(self) -> list[Pair]:
        """Pairs that failed and passed when run again."""
        out: list[Pair] = []
        for (a, b), _ in self.tests:
            h = self.history[frozenset((a, b))]
            if h[-1] == OK and any(o in NEGATIVE for o in h) and (a, b) not in out \
                    and (b, a) not in out:
                out.append((a, b))
        return out

    def cross(self, a: str, b: str) -> bool:
        return None not in (self.leaf(a), self.leaf(b)) and self.leaf(a) != self.leaf(b)

    def failed_across(self, n: str, but: str) -> bool:
        """Whether ``n`` failed a cross-leaf pair with a known-good node other than ``but``."""
        return any(m != but and m in self.cleared and self.cross(n, m) for m in self.negs[n])

    def passed_away(self, n: str, leaves: set[str | None]) -> bool:
        """Whether ``n`` passed a pair with a node on none of ``leaves``."""
        return any(o == OK and n in (a, b) and self.leaf(b if a == n else a) not in leaves
                   for (a, b), o in self.tests)

    def follow_ups(self, busy: set[str]) -> Round:
        """For each suspected link tested once, and not yet confirmed by another failure of
        one of its ends across the spine: each cross-leaf end that has not passed with a third
        leaf meets a known-good node of one (whose end's leaf it is shows: the end whose probe
        fails); when both ends have, or no third leaf is free, the pair itself once more (a
        link, or a blip that passes). A link of a leaf already named needs none."""
        out: Round = []
        links = self.links()
        named = {leaf for group in _leaves(self, links) if len(group) == 1 for leaf in group}
        for a, b in links:
            if len(self.history[frozenset((a, b))]) > 1 or a in busy or b in busy:
                continue
            if self.cross(a, b) and (self.failed_across(a, b) or self.failed_across(b, a)
                                     or {self.leaf(a), self.leaf(b)} & named):
                continue  # confirmed, and its leaf named
            probes: Round = []
            if self.cross(a, b):
                taken = {self.leaf(a), self.leaf(b)}
                for n in (a, b):
                    if self.passed_away(n, {self.leaf(a), self.leaf(b)}):
                        continue
                    m = next((g for g in self.good if self.leaf(g) not in taken
                              and g not in busy and g not in self.partners[n]
                              and g not in (a, b)), None)
                    if m is not None:
                        probes.append((n, m))
                        busy.update((n, m))
                        taken.add(self.leaf(m))  # the other end's probe: yet another leaf
            if not probes:
                probes = [(a, b)]
                busy.update((a, b))
            out.extend(probes)
        return out

    def partner(self, n: str, busy: set[str], pending: Sequence[str]) -> str | None:
        """A partner for ``n`` this round, one it has not met: a known-good node of its own
        leaf, else a node of its own leaf still to be tested (a pass clears both; with the
        leaf's uplinks at fault, the only pairs that can), else any known-good node, else any
        node still to be tested."""
        def pick(pool: Sequence[str]) -> str | None:
            return next((m for m in pool if m != n and m not in busy
                         and m not in self.partners[n] and m not in self.bad), None)

        mine = self.leaf(n)
        same = self.good_by_leaf.get(mine, []) if mine is not None else []
        others = [m for m in pending if mine is not None and self.leaf(m) == mine]
        return pick(same) or pick(others) or pick(self.good) or pick(pending)


def _first(state: State) -> Round:
    """Round 1: a perfect matching of everyone (an odd one out waits for round 2). With
    leaves, nodes are interleaved across leaves, so that most pairs cross the spine."""
    ns = list(state.nodes)
    rng = random.Random(state.seed) if state.seed is not None else None
    groups: dict[str | None, list[str]] = {}
    for n in ns:
        groups.setdefault(state.leaves.get(n), []).append(n)
    members = list(groups.values())
    if rng is not None:
        for g in members:
            rng.shuffle(g)
    if len(members) > 1:
        order: list[str] = []
        for i in range(max(len(g) for g in members)):
            k = i % len(members)  # rotate the leaves column by column: more leaf pairs meet
            order.extend(g[i] for g in members[k:] + members[:k] if i < len(g))
        ns = order
    else:
        ns = members[0] if members else []
    return [(ns[i], ns[i + 1]) for i in range(0, len(ns) - 1, 2)]


def next_round(state: State) -> Round | None:
    """The next round's disjoint pairs; None when the pass is done (nothing left to test, or
    ``max_rounds`` rounds run)."""
    if len(state.results) >= state.max_rounds:
        return None
    return _round(state)


def _round(state: State) -> Round | None:
    """The next round, however many rounds ran."""
    if len(state.nodes) < 2:
        return None
    if not state.results:
        return _first(state)
    ev = _Evidence(state)
    pending = ev.suspects() + ev.untested()
    busy: set[str] = set()
    out: Round = []
    for n in pending:
        if n in busy:
            continue
        m = ev.partner(n, busy, pending)
        if m is not None:
            out.append((n, m))
            busy.update((n, m))
    out.extend(ev.follow_ups(busy))
    return out or None


def verdict(state: State) -> Verdict:
    """What the pass's evidence says (see the module's docstring for the model)."""
    ev = _Evidence(state)
    more = _round(state) is not None
    unresolved: list[tuple[str, str]] = []
    suspects = set(ev.suspects())
    for n in state.nodes:
        others = ", ".join(sorted(set(ev.negs[n]), key=ev.order.__getitem__))
        if n in ev.stuck:
            unresolved.append((n, f"failed only across the spine ({others}) and no node of its "
                                  "leaf is left to test it with: the node or its leaf's uplinks"))
        elif n in suspects:
            unresolved.append((n, f"undecided after {len(state.results)} rounds (--max-rounds)"
                               if more else f"failed with {others}, none known good or too "
                               "few: no other node left to test it with"))
    for n in state.nodes:
        if n not in ev.cleared and not ev.negs[n]:
            unresolved.append((n, "not measured: its pairs were skipped" if ev.skips[n]
                               else "not paired"))
    for a, b in ev.transient():
        unresolved.append((f"{a}-{b}", "failed, then passed when run again"))
    links = ev.links()
    return Verdict(tuple(n for n in state.nodes if n in ev.bad), tuple(links),
                   _leaves(ev, links), tuple(unresolved), len(state.results),
                   len(ev.tests), not more)


def _leaves(ev: _Evidence, links: Sequence[Pair]) -> tuple[tuple[str, ...], ...]:
    """Leaves named by suspected links: a leaf whose failing cross-leaf pairs go to two other
    leaves or more is named alone (its uplinks); any other cross-leaf link, its leaf pair."""
    cross = [(ev.leaf(a), ev.leaf(b)) for a, b in links]
    cross_known = [(x, y) for x, y in cross if x is not None and y is not None and x != y]
    far: dict[str, set[str]] = {}
    for x, y in cross_known:
        far.setdefault(x, set()).add(y)
        far.setdefault(y, set()).add(x)
    named = sorted((leaf for leaf, others in far.items() if len(others) >= 2),
                   key=lambda leaf: (-len(far[leaf]), leaf))
    out: list[tuple[str, ...]] = [(leaf,) for leaf in named]
    for x, y in cross_known:
        pair = tuple(sorted((x, y)))
        if x not in named and y not in named and pair not in out:
            out.append(pair)
    return tuple(out)


def verdict_json(v: Verdict) -> dict[str, object]:
    """The verdict as `gpunet-probe fleet --kind adaptive` prints it (rank 0, last line)."""
    return {"verdict": {
        "bad_nodes": list(v.bad_nodes), "suspect_links": [list(p) for p in v.suspect_links],
        "suspect_leaves": [list(leaves) for leaves in v.suspect_leaves],
        "unresolved": [{"what": what, "why": why} for what, why in v.unresolved],
        "rounds": v.rounds, "pairs": v.pairs, "done": v.done}}
