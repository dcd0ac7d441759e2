"""Probe result files: how the runner hands a round's results to the exporter.

One JSON file per scope in the state directory (``intra.json``, ``net.json``, ``inter.json``),
replaced atomically, so a reader sees the previous round or the new one, never half a file;
``status.json`` says what the node's launcher does now and since when (how the supervisor tells a
hung launcher from a slow interval). No torch here: the exporter imports this module.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpunet_exporter.errors import short

VERSION = 2
SCOPES = ("intra", "net", "inter")
NODE_SCOPES = ("intra", "net")  # what a node's own runner measures; inter is cluster mode
STATUS = "status.json"
# Why a round did not produce numbers; the exporter adds bad_result. timeout and crash come
# from the launcher (a group it killed, or one that died without saying why) or the exporter.
FAILURE_REASONS = ("timeout", "crash", "nccl_error", "no_gpu", "init_error", "error",
                   "skipped_busy")
# The error of an init_error result written by a runner whose Python has no torch (the
# collector reports the check as unknown: its library is missing).
NO_TORCH = "torch is not installed: pip install 'gpunet-exporter[probe]'"


def result_path(state_dir: str, scope: str) -> str:
    return os.path.join(state_dir, f"{scope}.json")


@dataclass(frozen=True)
class SizeResult:
    bytes: int
    skipped: bool = False  # not measured this round (GPU busy with other work)
    median_seconds: float = 0.0
    p99_seconds: float = 0.0
    max_seconds: float = 0.0
    algbw_bytes_per_second: float = 0.0  # bytes x iterations / loop_seconds
    busbw_bytes_per_second: float = 0.0
    # The tight loop's time (that many all-reduces back to back, the shortest of the ranks'
    # times), which the bandwidths come from; 0 in files of runners before the loop, whose
    # bandwidths came from median_seconds.
    loop_seconds: float = 0.0


@dataclass(frozen=True)
class Straggler:
    wait_seconds: float  # what the other ranks waited for the last to arrive (median)
    wait_ratio: float  # that wait over the others' time in the collective, 0 to 1
    late_share: float  # share of iterations in which that rank arrived last
    rank: int | None = None  # named only when wait_ratio reached the runner's minimum
    gpu: int | None = None  # its local GPU index
    local: bool = False  # it runs on this node


@dataclass(frozen=True)
class Hca:
    device: str
    port: str
    ranks: tuple[int, ...]  # the ranks on this node that used it
    gdr: bool | None  # their NET channels used GPUDirect RDMA; None: no NET channel
    rate_bytes_per_second: float | None  # the port's link rate when measured


@dataclass(frozen=True)
class Result:
    scope: str
    time: float  # Unix time the round ended
    started: float  # Unix time the round started
    success: bool
    failure: str = ""  # one of FAILURE_REASONS when not success
    error: str = ""  # one line for logs; never exported
    backend: str = ""
    world_size: int = 0
    nccl_version: str = ""
    sizes: tuple[SizeResult, ...] = ()
    straggler: Straggler | None = None
    net: str = ""  # the network NCCL chose (IB, Socket, plugin name)
    transports: tuple[str, ...] = ()  # P2P, SHM, NET, COLLNET
    net_transports: tuple[str, ...] = ()  # IB, Socket, ... of the NET channels
    gdr: bool | None = None  # None: no NET channel
    problems: tuple[str, ...] = ()
    skipped_busy: bool = False  # sizes were skipped because a GPU was busy with other work
    hcas: tuple[Hca, ...] = ()  # RDMA ports this node's ranks used
    link_bytes_per_second: float | None = None  # the link bandwidth a rank can expect
    # intra scope: one direction of the NVLinks of the rank's GPU, the least over the ranks
    nvlink_bytes_per_second: float | None = None


def socket_fallback(scope: str, backend: str, transports: Sequence[str],
                    net_transports: Sequence[str], rdma_active: Callable[[], bool]) -> bool:
    """Whether a round's NCCL took a slower path than the node offers
    (gpunet_probe_socket_fallback): intra, a NET transport between the node's own GPUs; net,
    sockets while an RDMA port is ACTIVE (``rdma_active``, asked only then)."""
    if backend != "nccl":
        return False
    if scope == "intra":
        return "NET" in transports
    return "Socket" in net_transports and rdma_active()


class BadResult(ValueError):
    """A result file that is not what the runner writes; the text says what is wrong."""


def _num(d: Mapping[str, Any], key: str, where: str, *, allow_none: bool = False) -> Any:
    v = d.get(key)
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not finite(v) or v < 0:
        raise BadResult(f"{where}: {key!r} must be a non-negative number, got {short(v)}")
    return v


def finite(v: float) -> bool:
    """Finite, and for an int within the float range (math.isfinite raises OverflowError for
    an int beyond it, and so would every float() the exporter does with it later)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _strs(d: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise BadResult(f"{where}: {key!r} must be a list of strings")
    return tuple(v)


def parse(data: Any, where: str = "result") -> Result:
    """Validate a decoded result file; raises BadResult naming the first problem."""
    if not isinstance(data, dict):
        raise BadResult(f"{where}: expected a JSON object")
    if data.get("version") != VERSION:
        raise BadResult(f"{where}: version {short(data.get('version'))}, expected {VERSION}")
    scope = data.get("scope")
    if scope not in SCOPES:
        raise BadResult(f"{where}: scope {short(scope)}, expected one of {', '.join(SCOPES)}")
    success = data.get("success")
    if not isinstance(success, bool):
        raise BadResult(f"{where}: 'success' must be true or false")
    failure = data.get("failure") or ""
    if not success and failure not in FAILURE_REASONS:
        raise BadResult(f"{where}: failure {short(failure)}, expected one of "
                        f"{', '.join(FAILURE_REASONS)}")
    sizes = []
    raw_sizes = data.get("sizes", [])
    if not isinstance(raw_sizes, list):
        raise BadResult(f"{where}: 'sizes' must be a list")
    for i, s in enumerate(raw_sizes):
        w = f"{where}: sizes[{i}]"
        if not isinstance(s, dict):
            raise BadResult(f"{w}: expected an object")
        if not isinstance(s.get("skipped", False), bool):
            raise BadResult(f"{w}: 'skipped' must be true or false")
        n = _num(s, "bytes", w)
        if not isinstance(n, int) or n <= 0:
            raise BadResult(f"{w}: 'bytes' must be a positive integer")
        if s.get("skipped", False):
            sizes.append(SizeResult(n, True))
            continue
        median, p99, most, algbw, busbw = (float(_num(s, k, w)) for k in (
            "median_seconds", "p99_seconds", "max_seconds", "algbw_bytes_per_second",
            "busbw_bytes_per_second"))
        loop = float(_num(s, "loop_seconds", w)) if "loop_seconds" in s else 0.0
        sizes.append(SizeResult(n, False, median, p99, most, algbw, busbw, loop))
    gdr = data.get("gdr")
    if gdr is not None and not isinstance(gdr, bool):
        raise BadResult(f"{where}: 'gdr' must be true, false or null")
    world = _num(data, "world_size", where) if "world_size" in data else 0
    link = _num(data, "link_bytes_per_second", where, allow_none=True)
    nvlink = _num(data, "nvlink_bytes_per_second", where, allow_none=True)
    return Result(
        scope=scope, time=float(_num(data, "time", where)),
        started=float(_num(data, "started", where)), success=success, failure=failure,
        error=str(data.get("error", ""))[:500], backend=str(data.get("backend", "")),
        world_size=int(world), nccl_version=str(data.get("nccl_version", ""))[:32],
        sizes=tuple(sizes),
        straggler=_straggler(data.get("straggler"), f"{where}: straggler"),
        net=str(data.get("net", ""))[:64], transports=_strs(data, "transports", where),
        net_transports=_strs(data, "net_transports", where), gdr=gdr,
        problems=_strs(data, "problems", where),
        skipped_busy=data.get("skipped_busy") is True, hcas=_hcas(data.get("hcas"), where),
        link_bytes_per_second=None if link is None else float(link),
        nvlink_bytes_per_second=None if nvlink is None else float(nvlink))


def _index(d: Mapping[str, Any], key: str, where: str) -> int | None:
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 20:
        raise BadResult(f"{where}: {key!r} must be a small non-negative integer or null")
    return v


def _straggler(data: Any, where: str) -> Straggler | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise BadResult(f"{where}: expected an object or null")
    ratio, share = _num(data, "wait_ratio", where), _num(data, "late_share", where)
    if ratio > 1 or share > 1:
        raise BadResult(f"{where}: 'wait_ratio' and 'late_share' must be from 0 to 1")
    return Straggler(float(_num(data, "wait_seconds", where)), float(ratio), float(share),
                     _index(data, "rank", where), _index(data, "gpu", where),
                     data.get("local") is True)


_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _hcas(data: Any, where: str) -> tuple[Hca, ...]:
    if data is None:
        return ()
    if not isinstance(data, list) or len(data) > 256:
        raise BadResult(f"{where}: 'hcas' must be a list (of at most 256)")
    out = []
    for i, h in enumerate(data):
        w = f"{where}: hcas[{i}]"
        if not isinstance(h, dict):
            raise BadResult(f"{w}: expected an object")
        device, port = h.get("device"), h.get("port")
        if not (isinstance(device, str) and _NAME.fullmatch(device)
                and isinstance(port, str) and port.isdigit() and len(port) < 4):
            raise BadResult(f"{w}: 'device' must be an RDMA device name and 'port' a number")
        ranks = h.get("ranks", [])
        if not isinstance(ranks, list) or len(ranks) > 4096 or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
            raise BadResult(f"{w}: 'ranks' must be a list of rank numbers")
        gdr = h.get("gdr")
        if gdr is not None and not isinstance(gdr, bool):
            raise BadResult(f"{w}: 'gdr' must be true, false or null")
        rate = _num(h, "rate_bytes_per_second", w, allow_none=True)
        out.append(Hca(device, port, tuple(ranks), gdr, None if rate is None else float(rate)))
    return tuple(out)


def load_json(path: str, bad: type[ValueError], what: str, limit: int = 1 << 20) -> Any:
    """The decoded JSON of a file the probe writes (a result, pairs.json), reading at most
    ``limit`` bytes; raises OSError, or ``bad`` naming ``path`` and what is wrong."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read(limit + 1)
    if len(text) > limit:
        raise bad(f"{path}: larger than {limit} bytes")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(f"{path}: not JSON: {exc.msg} at line {exc.lineno}") from None
    except ValueError as exc:  # an integer beyond int()'s digit limit (4300)
        raise bad(f"{path}: not {what}: {exc}") from None
    except RecursionError:
        raise bad(f"{path}: not {what}: JSON nested too deeply") from None


def read(path: str) -> Result:
    """Read and validate a result file; raises OSError or BadResult."""
    return parse(load_json(path, BadResult, "a result file"), path)
