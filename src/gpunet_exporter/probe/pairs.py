"""Pair results of fleet probes: ``<state_dir>/pairs.json``, this node's view of the last plan.

Written atomically on both nodes of each pair (statefile.write_json) by whoever runs the plan;
read by the probe collector as the gpunet_fleet_* metrics. The format, ``skipped`` and the
reader's bounds: docs/fleet.md, "The file". The reader raises only BadPairs (or OSError),
which the exporter counts as one failure. No torch here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpunet_exporter import statefile
from gpunet_exporter.errors import short
from gpunet_exporter.probe.results import finite, load_json

VERSION = 1
FILE = "pairs.json"
MAX_BYTES = 1 << 20
MAX_PAIRS = 4096  # per file; the exporter exports at most probe.fleet_max_peers of them
MAX_NAME = 253  # a DNS name's length; label checks happen in the registry
MAX_TEXT = 64  # plan kind, transport
# Why a pair was not measured (``skipped``): this end's GPUs, or the peer's.
BUSY = "busy"  # a process that is not the probe's on one of this node's GPUs
UNKNOWN = "unknown"  # this node's GPU processes cannot be read (no NVML) and the pair uses GPUs
PEER_BUSY = "peer_busy"
PEER_UNKNOWN = "peer_unknown"
SKIP_REASONS = (BUSY, UNKNOWN, PEER_BUSY, PEER_UNKNOWN)


def pairs_path(state_dir: str) -> str:
    return os.path.join(state_dir, FILE)


@dataclass(frozen=True)
class Pair:
    peer: str
    ok: bool
    peer_leaf: str | None = None
    latency_seconds: float | None = None
    bus_bandwidth_bytes_per_second: float | None = None
    transport: str | None = None
    gdr: bool | None = None
    error: str | None = None
    skipped: str | None = None  # one of SKIP_REASONS: not measured, neither ok nor failed

    @property
    def failed(self) -> bool:
        """Measured, and not ok: what the alerts count against the node and the link."""
        return not self.ok and self.skipped is None


def peer_reason(reason: str) -> str:
    """What the other end of a pair records when this end did not run for ``reason``."""
    return {BUSY: PEER_BUSY, UNKNOWN: PEER_UNKNOWN}.get(reason, reason)


@dataclass(frozen=True)
class Pairs:
    node: str
    plan: str
    round_timestamp: float
    pairs: tuple[Pair, ...] = ()
    leaf: str | None = None


class BadPairs(ValueError):
    """A pairs file that is not what the writer writes; the text says what is wrong."""


def _name(d: Mapping[str, Any], key: str, where: str, *, optional: bool = False,
          limit: int = MAX_NAME) -> str | None:
    v = d.get(key)
    if v is None and optional:
        return None
    if not isinstance(v, str) or not v or len(v) > limit:
        raise BadPairs(f"{where}: {key!r} must be a non-empty string of at most {limit} "
                       f"characters{' or null' if optional else ''}, got {short(v)}")
    return v


def _number(d: Mapping[str, Any], key: str, where: str) -> float | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not finite(v) or v < 0:
        raise BadPairs(f"{where}: {key!r} must be a non-negative number or null, got "
                       f"{short(v)}")
    return float(v)


def parse(data: Any, where: str = FILE) -> Pairs:
    """Validate a decoded pairs file; raises BadPairs naming the first problem."""
    if not isinstance(data, dict):
        raise BadPairs(f"{where}: expected a JSON object")
    if data.get("version") != VERSION:
        raise BadPairs(f"{where}: version {short(data.get('version'))}, expected {VERSION}")
    node = _name(data, "node", where)
    leaf = _name(data, "leaf", where, optional=True)
    kind = _name(data, "plan", where, limit=MAX_TEXT)
    ts = _number(data, "round_timestamp", where)
    if ts is None:
        raise BadPairs(f"{where}: 'round_timestamp' must be a Unix time")
    raw = data.get("pairs")
    if not isinstance(raw, list) or len(raw) > MAX_PAIRS:
        raise BadPairs(f"{where}: 'pairs' must be a list (of at most {MAX_PAIRS})")
    out: list[Pair] = []
    seen: set[str] = set()
    for i, p in enumerate(raw):
        got = parse_pair(p, f"{where}: pairs[{i}]")
        if got.peer in seen:
            raise BadPairs(f"{where}: pairs[{i}]: peer {short(got.peer)} appears twice (one "
                           "entry per peer)")
        seen.add(got.peer)
        out.append(got)
    assert node is not None and kind is not None
    return Pairs(node=node, plan=kind, round_timestamp=ts, pairs=tuple(out), leaf=leaf)


def parse_pair(p: Any, w: str) -> Pair:
    """Validate one entry of ``pairs`` (also a peer's view in the fleet's store); BadPairs."""
    if not isinstance(p, dict):
        raise BadPairs(f"{w}: expected an object")
    peer = _name(p, "peer", w)
    assert peer is not None
    ok, gdr, error, skipped = p.get("ok"), p.get("gdr"), p.get("error"), p.get("skipped")
    if not isinstance(ok, bool):
        raise BadPairs(f"{w}: 'ok' must be true or false")
    if gdr is not None and not isinstance(gdr, bool):
        raise BadPairs(f"{w}: 'gdr' must be true, false or null")
    if error is not None and not isinstance(error, str):
        raise BadPairs(f"{w}: 'error' must be a string or null")
    if skipped is not None and skipped not in SKIP_REASONS:
        raise BadPairs(f"{w}: 'skipped' must be one of {', '.join(SKIP_REASONS)} or null, got "
                       f"{short(skipped)}")
    if skipped is not None and ok:
        raise BadPairs(f"{w}: a skipped pair (not measured) cannot be ok")
    return Pair(
        peer=peer, ok=ok, peer_leaf=_name(p, "peer_leaf", w, optional=True),
        latency_seconds=_number(p, "latency_seconds", w),
        bus_bandwidth_bytes_per_second=_number(p, "bus_bandwidth_bytes_per_second", w),
        transport=_name(p, "transport", w, optional=True, limit=MAX_TEXT), gdr=gdr,
        error=None if error is None else error[:500], skipped=skipped)


def read(path: str) -> Pairs:
    """Read and validate a pairs file; raises OSError or BadPairs."""
    return parse(load_json(path, BadPairs, "a pairs file", MAX_BYTES), path)


def pair_json(x: Pair) -> dict[str, Any]:
    """One entry of the file's ``pairs`` (``skipped`` only when set: a measured pair's entry
    is what it was before the field)."""
    out: dict[str, Any] = {"peer": x.peer, "peer_leaf": x.peer_leaf, "ok": x.ok,
                           "latency_seconds": x.latency_seconds,
                           "bus_bandwidth_bytes_per_second": x.bus_bandwidth_bytes_per_second,
                           "transport": x.transport, "gdr": x.gdr, "error": x.error}
    if x.skipped is not None:
        out["skipped"] = x.skipped
    return out


def to_json(p: Pairs) -> dict[str, Any]:
    """The file's content for ``p``."""
    return {"version": VERSION, "node": p.node, "leaf": p.leaf, "plan": p.plan,
            "round_timestamp": p.round_timestamp, "pairs": [pair_json(x) for x in p.pairs]}


def write(state_dir: str, p: Pairs) -> None:
    """Replace ``<state_dir>/pairs.json`` with ``p``, atomically; raises OSError."""
    statefile.write_json(pairs_path(state_dir), to_json(p))
