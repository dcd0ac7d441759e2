"""Path-aware localization: which switch-to-switch cable, if any, the slow fleet pairs share.

From one fabric sweep (iblinkinfo's cables, dump_fts's forwarding tables) :func:`routes` finds
each host's ports and walks the tables from one host to another, as the switches forward a
packet; :func:`localize` joins those paths with the fleet's pair verdicts (healthy or not,
docs/fleet.md) by boolean network tomography: every node and cable a healthy pair crosses is
cleared, and the fewest remaining elements that explain every unhealthy pair are named, a
cable alone (``suspect``) or with the cables it cannot be told apart from (``ambiguous``). A
node that explains its pairs better than any cable is left to the fleet's node alerts. Pure:
no I/O, so the tests and the simulation feed it directly. Design: docs/fabric.md.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpunet_exporter.sources import ibdiag

# The verdict of a switch-to-switch cable, the label value of gpunet_fabric_link_verdict.
SUSPECT = "suspect"  # the one element that explains some unhealthy pairs
AMBIGUOUS = "ambiguous"  # explains them, as equally do other cables it cannot be told from
UNPROVEN = "unproven"  # crossed only by unhealthy pairs that other elements explain
CLEARED = "cleared"  # a healthy pair crosses it
UNTESTED = "untested"  # no measured pair crosses it
VERDICTS = (SUSPECT, AMBIGUOUS, UNPROVEN, CLEARED, UNTESTED)
# The pairs of one localization, the label value of gpunet_fabric_localization_pairs.
PAIR_RESULTS = ("healthy", "unhealthy", "unexplained", "unrouted")


@dataclass(frozen=True, order=True)
class Cable:
    """A cable between two switches, named by one end (:func:`routes` picks a spine's)."""

    switch: str
    port: int


@dataclass(frozen=True)
class HostPort:
    """One port of a host on the fabric: its rail (the node description after the host's
    name, ``mlx5_0``), LID, and the switch port it is cabled to."""

    rail: str
    lid: int
    switch: str
    port: int


@dataclass
class Routes:
    """The hosts of one sweep and the paths between them."""

    hosts: dict[str, list[HostPort]] = field(default_factory=dict)
    cables: set[Cable] = field(default_factory=set)
    # (switch, port) -> (neighbour switch, its port), for every active switch-to-switch cable
    _next: dict[tuple[str, int], tuple[str, int]] = field(default_factory=dict)
    _canonical: dict[tuple[str, int], Cable] = field(default_factory=dict)
    _forwarding: ibdiag.Forwarding = field(default_factory=ibdiag.Forwarding)
    _arrive: dict[tuple[str, int], int] = field(default_factory=dict)  # host port -> its LID

    def path(self, src: HostPort, dst: HostPort) -> list[Cable] | None:
        """The cables a packet from ``src`` to ``dst`` crosses, in order, as the forwarding
        tables send it; None when a table has no route or the walk loops."""
        here, out = src.switch, list[Cable]()
        for _ in range(len(self._forwarding.tables) + 1):
            port = self._forwarding.port(here, dst.lid)
            if port is None or port == 0:
                return None
            if self._arrive.get((here, port)) == dst.lid:
                return out
            step = self._next.get((here, port))
            if step is None:
                return None
            out.append(self._canonical[(here, port)])
            here = step[0]
        return None

    def pair(self, a: str, b: str) -> set[Cable] | None:
        """Every cable the pair's traffic crosses, both directions and every rail the two
        hosts share (by rail name; hosts without a rail in common pair their ports in
        order); None when either host is not on the fabric or a path is missing."""
        pa, pb = self.hosts.get(a), self.hosts.get(b)
        if not pa or not pb:
            return None
        by_rail = {p.rail: p for p in pb}
        matched = [(p, by_rail[p.rail]) for p in pa if p.rail in by_rail]
        if not matched:
            matched = list(zip(pa, pb, strict=False))
        out: set[Cable] = set()
        for x, y in matched:
            for src, dst in ((x, y), (y, x)):
                hops = self.path(src, dst)
                if hops is None:
                    return None
                out.update(hops)
        return out


def routes(links: Sequence[ibdiag.Link], forwarding: ibdiag.Forwarding, spines: Iterable[str],
           host_pattern: str) -> Routes:
    """The hosts and paths of one sweep. ``host_pattern``'s first group picks the host's name
    out of a channel adapter's node description (``^(\\S+)``: ``n1 mlx5_0`` is host ``n1``,
    rail ``mlx5_0``); a description it does not match is not a host of the fleet."""
    pattern = re.compile(host_pattern)
    spine = set(spines)
    out = Routes(_forwarding=forwarding)
    switches = {lk.switch for lk in links}
    host_at: dict[int, tuple[str, int]] = {}
    for lk in links:
        if lk.state != 4 or not lk.remote:
            continue
        if lk.remote in switches and lk.remote_port is not None:
            out._next[(lk.switch, lk.port)] = (lk.remote, lk.remote_port)
        elif lk.remote_lid is not None:
            host_at[lk.remote_lid] = (lk.switch, lk.port)
            out._arrive[(lk.switch, lk.port)] = lk.remote_lid
    for end, other in out._next.items():
        # One name per cable: the spine's end, else the lower (switch, port).
        if (end[0] in spine) != (other[0] in spine):
            name = end if end[0] in spine else other
        else:
            name = min(end, other)
        out._canonical[end] = Cable(*name)
    out.cables = set(out._canonical.values())
    for lid, dest in sorted(forwarding.lids.items()):
        if dest.kind != "Channel Adapter" or lid not in host_at:
            continue
        m = pattern.search(dest.name)
        if not m or not m.group(1):
            continue
        rail = (dest.name[:m.start(1)] + dest.name[m.end(1):]).strip()
        out.hosts.setdefault(m.group(1), []).append(HostPort(rail, lid, *host_at[lid]))
    return out


@dataclass
class Localization:
    """What one localization concluded."""

    verdicts: dict[Cable, str] = field(default_factory=dict)
    crossing: dict[Cable, tuple[int, int]] = field(default_factory=dict)  # (healthy, unhealthy)
    pairs: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PAIR_RESULTS, 0))
    nodes_blamed: list[str] = field(default_factory=list)


def localize(r: Routes, health: Mapping[tuple[str, str], bool]) -> Localization:
    """Join the pairs' verdicts (unordered node pair -> healthy) with their paths. Pairs with
    neither node on this fabric are left out; a pair with one, or without a path, counts as
    ``unrouted`` and is judged on its nodes alone."""
    out = Localization()
    elements: dict[tuple[str, str], set[object]] = {}
    for (a, b), ok in sorted(health.items()):
        if a not in r.hosts and b not in r.hosts:
            continue
        cables = r.pair(a, b)
        if cables is None:
            out.pairs["unrouted"] += 1
            cables = set()
        out.pairs["healthy" if ok else "unhealthy"] += 1
        for c in cables:
            h, u = out.crossing.get(c, (0, 0))
            out.crossing[c] = (h + ok, u + (not ok))
        elements[(a, b)] = {("node", a), ("node", b), *cables}
    cleared: set[object] = set()
    for pair, elems in elements.items():
        if health[pair]:
            cleared |= elems
    candidates = {pair: elems - cleared for pair, elems in elements.items()
                  if not health[pair]}
    out.pairs["unexplained"] = sum(1 for c in candidates.values() if not c)
    uncovered = {pair for pair, c in candidates.items() if c}
    chosen: dict[object, str] = {}
    while uncovered:
        cover: dict[object, frozenset[tuple[str, str]]] = {}
        for pair in uncovered:
            for e in candidates[pair]:
                cover[e] = cover.get(e, frozenset()) | {pair}
        # The element that explains the most pairs; those explaining exactly the same pairs
        # cannot be told apart. Ties between different sets: the first in a fixed order.
        best = max(cover.values(), key=lambda s: (len(s), sorted(s)))
        group = sorted((e for e, s in cover.items() if s == best), key=repr)
        word = SUSPECT if len(group) == 1 else AMBIGUOUS
        for e in group:
            chosen[e] = word
        uncovered -= best
    for e, word in chosen.items():
        if isinstance(e, Cable):
            out.verdicts[e] = word
        elif isinstance(e, tuple):
            out.nodes_blamed.append(str(e[1]))
    for c in r.cables:
        if c in out.verdicts:
            continue
        h, u = out.crossing.get(c, (0, 0))
        out.verdicts[c] = CLEARED if h else UNPROVEN if u else UNTESTED
    out.nodes_blamed.sort()
    return out
