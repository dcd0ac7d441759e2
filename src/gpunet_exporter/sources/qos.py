"""QoS configuration of a RoCE netdev, from the best source the machine has: ``mlnx_qos -i IF``
(MLNX_OFED / mlnx-tools), iproute2 ``dcb -j ... show dev IF`` (upstream kernels), or the
MLNX_OFED sysfs files under ``/sys/class/net/IF/qos/``; plus the ECN switches under
``/sys/class/net/IF/ecn/``. Grammars: docs/formats.md §2 and §4; how tolerant the parsers are:
docs/architecture.md, "sources".
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpunet_exporter.sources.sysfs import MAX_DIGITS, Root, parse_uint

PRIORITIES = range(8)
_UINT_LIMIT = 10**MAX_DIGITS
# dcb ets prints "strict", "cbs", "ets", "vendor" or "???" (dcb_ets.c).
DCB_TSAS = frozenset(("strict", "cbs", "ets", "vendor"))


@dataclass
class QosConfig:
    """One interface's QoS configuration; fields a source does not give stay empty."""

    source: str
    dcbx_mode: str = ""  # "os" or "firmware"
    trust: str = ""  # "pcp", "dscp" or "none" (the tool says trust is not supported)
    pfc: dict[int, bool] = field(default_factory=dict)  # priority -> PFC enabled
    prio_tc: dict[int, int] = field(default_factory=dict)  # priority -> traffic class
    tc_tsa: dict[int, str] = field(default_factory=dict)  # tc -> strict/ets/vendor/...
    tc_bw: dict[int, float] = field(default_factory=dict)  # tc -> ETS share, percent
    tc_rate_limit: dict[int, float] = field(default_factory=dict)  # tc -> bytes/s (limited)
    dscp_prio: dict[int, int] = field(default_factory=dict)  # dscp -> priority
    default_prio: int | None = None
    buffer_size: dict[int, int] = field(default_factory=dict)  # receive buffer -> bytes
    buffer_total: int | None = None  # bytes
    prio_buffer: dict[int, int] = field(default_factory=dict)  # priority -> receive buffer


_NUMBER = re.compile(r"\d+")


def _ints(text: str) -> list[int | None]:
    """Every run of digits in ``text``, in order; None for one that is not a number (non-ASCII
    digits, more than 20 of them), so that it costs its own value and not its neighbours'
    positions."""
    return [parse_uint(t) for t in _NUMBER.findall(text)]


def _finite(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


# ---- mlnx_qos --------------------------------------------------------------------------------

_TC = re.compile(r"^tc:\s*(\d+)\s+ratelimit:\s*([^,]*?)\s*,\s*tsa:\s*([A-Za-z_]*)"
                 r"(?:\s*,\s*bw:\s*(\d+(?:\.\d+)?)\s*%?)?")
_TC_MEMBER = re.compile(r"^(?:priority|up)\s*:\s*(\d+)\s*$")
_PRIO_DSCP = re.compile(r"^prio\s*:\s*(\d+)\s*(?:dscp\s*:\s*(.*))?$")
_GBPS = re.compile(r"^(\d+(?:\.\d+)?)\s*Gbps$", re.IGNORECASE)


def parse_mlnx_qos(text: str) -> QosConfig:
    """The report ``mlnx_qos -i IF`` prints (docs/formats.md §2.1), every layout from old OFED to
    mlnx-tools 23.x: with or without buffers, ``total_size=`` or ``max_buffer_size=``, the
    ``default priority:`` header, wrapped ``prio:N dscp:`` lines, ``up:`` or ``priority:`` tc
    members, and whitespace that was tabs or was lost."""
    cfg = QosConfig("mlnx_qos")
    section = ""
    tc: int | None = None
    seen_pfc = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        low = line.lower()
        if low.startswith("dcbx mode:"):
            mode = low.split(":", 1)[1]
            cfg.dcbx_mode = "os" if "os" in mode.split() else "firmware" if "firmware" in mode \
                else ""
            continue
        if low.startswith(("priority trust state:", "priority trust mode:")):
            cfg.trust = line.split(":", 1)[1].strip().lower()
            continue
        if low.startswith("dscp2prio mapping"):
            section = "dscp"
            continue
        if low.startswith("default priority"):
            section = "default"
            continue
        if low.startswith("receive buffer size"):
            body = line.split(":", 1)[1] if ":" in line else ""
            items = [t.strip() for t in body.split(",") if t.strip()]
            sizes = [parse_uint(t) for t in items if t.isdigit()]
            cfg.buffer_size = {i: n for i, n in enumerate(sizes) if n is not None}
            for t in items:
                key, eq, val = t.partition("=")
                if eq and key.strip() in ("total_size", "max_buffer_size"):
                    total = parse_uint(val)
                    if total is not None:
                        cfg.buffer_total = total
            section = ""
            continue
        if low.startswith("pfc configuration"):
            section = "pfc"
            continue
        m = _TC.match(line)
        if m:
            section, tc = "tc", parse_uint(m.group(1))
            if tc is None:  # a garbled tc number: its settings and members belong to no tc
                continue
            rate = _GBPS.match(m.group(2).strip())
            gbps = _finite(rate.group(1)) if rate else None
            if gbps is not None:  # "%.1f Gbps"; "unlimited" has no limit
                cfg.tc_rate_limit[tc] = gbps * 1e9 / 8
            tsa = m.group(3).lower()
            if tsa:
                cfg.tc_tsa[tc] = tsa
            bw = _finite(m.group(4)) if m.group(4) is not None else None
            if bw is not None:
                cfg.tc_bw[tc] = bw
            continue
        if section == "pfc":
            head, _, rest = re.sub(r"\s+", " ", line).partition(" ")
            values = _ints(rest)
            if head == "enabled" and len(values) >= 8:
                cfg.pfc = {p: v != 0 for p in PRIORITIES if (v := values[p]) is not None}
                seen_pfc = True
            elif head == "buffer" and len(values) >= 8:
                cfg.prio_buffer = {p: v for p in PRIORITIES if (v := values[p]) is not None}
            continue
        if section == "tc" and tc is not None:
            m = _TC_MEMBER.match(line)
            member = parse_uint(m.group(1)) if m else None
            if member is not None and member in PRIORITIES:
                cfg.prio_tc[member] = tc
            continue  # "skprio:" lines of old builds, anything else
        if section in ("dscp", "default"):
            m = _PRIO_DSCP.match(line)
            prio = parse_uint(m.group(1)) if m else None
            if m is None or prio is None or prio not in PRIORITIES:
                continue
            if m.group(2) is not None:
                for dscp in _ints(m.group(2)):
                    if dscp is not None and dscp < 64:
                        cfg.dscp_prio[dscp] = prio
            elif section == "default":
                cfg.default_prio = prio
    if not (seen_pfc or cfg.prio_tc or cfg.dcbx_mode):
        raise ValueError("no DCBX mode, PFC configuration or tc lines: not mlnx_qos output")
    return cfg


# ---- iproute2 dcb (JSON) ---------------------------------------------------------------------

def _json(text: str, what: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:  # also: digits beyond int()'s limit, deep nesting
        raise ValueError(f"{what}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: expected a JSON object, got {type(data).__name__}")
    return data


def _indexed(value: object) -> dict[int, object]:
    """A dcb per-index JSON array (per priority or traffic class) by index."""
    return dict(enumerate(value)) if isinstance(value, list) else {}


def _per_priority(value: object) -> dict[int, int]:
    """A dcb array of 8 unsigned integers indexed by priority (prio_tc, prio_buffer)."""
    out = {}
    for prio, v in _indexed(value).items():
        n = _uint(v)
        if prio in PRIORITIES and n is not None:
            out[prio] = n
    return out


def _uint(value: object) -> int | None:
    """A non-negative integer, as JSON or as a string, of at most 20 digits (as parse_uint)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and 0 <= value < _UINT_LIMIT:
        return value
    if isinstance(value, str):
        return parse_uint(value.strip())
    return None


def parse_dcb(pfc: str, ets: str | None = None, app: str | None = None,
              buffer: str | None = None, dcbx: str | None = None,
              apptrust: str | None = None) -> QosConfig:
    """The JSON of ``dcb -j {pfc,ets,app,buffer,dcbx,apptrust} show dev IF`` (one object per
    command; iproute2 5.11 to 7.x). ``pfc`` is required; the others are given when the driver and
    the iproute2 version support them. ``maxrate`` is not read: its JSON unit changed from kbit/s
    to bytes/s in iproute2 (2025) with nothing in the output to tell which."""
    cfg = QosConfig("dcb")
    p = _json(pfc, "dcb pfc show")
    if "prio_pfc" not in p:
        raise ValueError("dcb pfc show: no prio_pfc key")
    # On/off values are JSON booleans (print_on_off) in every iproute2 that has dcb (5.11 on).
    cfg.pfc = {prio: v for prio, v in _indexed(p["prio_pfc"]).items()
               if prio in PRIORITIES and isinstance(v, bool)}
    if ets:
        e = _json(ets, "dcb ets show")
        cfg.prio_tc = _per_priority(e.get("prio_tc"))
        for tc, v in _indexed(e.get("tc_tsa")).items():
            if isinstance(v, str) and v:
                cfg.tc_tsa[tc] = v.lower() if v.lower() in DCB_TSAS else "unknown"
        for tc, v in _indexed(e.get("tc_bw")).items():
            bw = _uint(v)
            if bw is not None and cfg.tc_tsa.get(tc) == "ets":
                cfg.tc_bw[tc] = float(bw)
    if app:
        a = _json(app, "dcb app show")
        for entry in _indexed(a.get("dscp_prio")).values():  # a list; anything else: none
            pair = _pair(entry)
            if pair is not None and pair[0] < 64 and pair[1] in PRIORITIES:
                cfg.dscp_prio[pair[0]] = pair[1]
        defaults = [d for d in map(_uint, _indexed(a.get("default_prio")).values())
                    if d is not None and d in PRIORITIES]
        if defaults:
            cfg.default_prio = defaults[0]
        # Without apptrust, mlx5 trusts DSCP once a DSCP app entry exists (mlnx_qos infers the
        # same from the app table).
        cfg.trust = "dscp" if cfg.dscp_prio else "pcp"
    if apptrust:
        order = _json(apptrust, "dcb apptrust show").get("order")
        if isinstance(order, list):
            first = next((o for o in order if o in ("dscp", "pcp")), None)
            cfg.trust = first or "none"
    if buffer:
        b = _json(buffer, "dcb buffer show")
        cfg.prio_buffer = _per_priority(b.get("prio_buffer"))
        for idx, v in _indexed(b.get("buffer_size")).items():
            n = _uint(v)
            if n is not None:
                cfg.buffer_size[idx] = n
        cfg.buffer_total = _uint(b.get("total_size"))
    if dcbx:
        # Only the set bits are printed, each as true: no "host" means firmware controlled.
        cfg.dcbx_mode = "os" if _json(dcbx, "dcb dcbx show").get("host") is True else "firmware"
    return cfg


def _pair(entry: object) -> tuple[int, int] | None:
    """A dcb app entry [selector value, priority] (iproute2 >= 6.2 appends a " " element)."""
    if isinstance(entry, list) and len(entry) >= 2:
        a, b = _uint(entry[0]), _uint(entry[1])
        return (a, b) if a is not None and b is not None else None
    return None


# ---- MLNX_OFED sysfs (/sys/class/net/IF/qos) and ECN (/sys/class/net/IF/ecn) ---------------

def _rows(text: str) -> list[tuple[int, int]]:
    """The first two integers of each row of a sysfs table, header lines and rows whose first
    two are not both numbers skipped."""
    out = []
    for ln in text.splitlines():
        if ln.strip()[:1].isdigit():
            row = _ints(ln)
            if len(row) >= 2 and row[0] is not None and row[1] is not None:
                out.append((row[0], row[1]))
    return out


def parse_qos_sysfs(files: Mapping[str, str]) -> QosConfig:
    """The MLNX_OFED ``qos/`` files (those present): trust ("dscp"/"pcp"), dscp2prio (a header,
    then "dscp prio" rows), buffer_size ("Port buffer size = N", "Spare buffer size = N", a
    header, then "buffer size [xoff xon]" rows) and prio2buffer (a header, "prio buffer" rows).
    PFC enablement is not among them."""
    cfg = QosConfig("sysfs")
    if "trust" in files:
        cfg.trust = files["trust"].strip().lower()
    for dscp, prio in _rows(files.get("dscp2prio", "")):
        if dscp < 64 and prio in PRIORITIES:
            cfg.dscp_prio[dscp] = prio
    if "buffer_size" in files:
        text = files["buffer_size"]
        m = re.search(r"port buffer size\s*=\s*(\d+)", text, re.I)
        if m:
            cfg.buffer_total = parse_uint(m.group(1))
        for buf, size in _rows(text):
            cfg.buffer_size[buf] = size
    for prio, buf in _rows(files.get("prio2buffer", "")):
        if prio in PRIORITIES:
            cfg.prio_buffer[prio] = buf
    return cfg


QOS_FILES = ("trust", "dscp2prio", "buffer_size", "prio2buffer")


@dataclass
class Ecn:
    """ECN (DCQCN) switches of one interface; absent files leave entries out (unknown)."""

    enabled: dict[tuple[str, int], bool] = field(default_factory=dict)  # (np|rp, prio)
    cnp_dscp: int | None = None
    cnp_priority: int | None = None


def read_ecn(root: Root, ifname: str, skip: Callable[[str, object], None]) -> Ecn:
    """``/sys/class/net/IF/ecn/roce_{np,rp}/enable/<prio>`` ("0"/"1") and the notification
    point's cnp_dscp and cnp_802p_prio (MLNX_OFED mlx5 en_ecn.c). Nothing when the directory does
    not exist (upstream driver: unknown, not disabled)."""
    ecn = Ecn()
    base = f"class/net/{ifname}/ecn"
    for point in ("np", "rp"):
        try:
            files = root.read_dir(f"{base}/roce_{point}/enable")
        except OSError:
            continue
        for name, text in files.items():
            prio = parse_uint(name)
            if prio is None or prio not in PRIORITIES:
                continue
            if isinstance(text, OSError):
                skip(f"{base}/roce_{point}/enable/{name}", text.strerror or text)
                continue
            value = parse_uint(text)
            if value is None:  # the driver prints nothing when the firmware query fails
                skip(f"{base}/roce_{point}/enable/{name}", f"unparseable {text[:20]!r}")
                continue
            ecn.enabled[(point, prio)] = value != 0
    try:
        np = root.read_many(f"{base}/roce_np", ("cnp_dscp", "cnp_802p_prio"))
    except OSError:
        return ecn
    for key, text in np.items():
        value = parse_uint(text) if isinstance(text, str) else None
        if key == "cnp_dscp":
            ecn.cnp_dscp = value
        else:
            ecn.cnp_priority = value
    return ecn
