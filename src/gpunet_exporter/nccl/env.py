"""The NCCL settings of a process's environment, judged the way NCCL reads each variable
(NVIDIA/nccl src/misc/param.cc, graph/paths.cc, misc/socket.cc, transport/net_ib.cc): a fixed
value class per variable, the classes that are faults, and a note where there is something sure
to say. One judge for the topology collector's audit of GPU processes
(gpunet_topology_nccl_env_*), the doctor's notes and explain-log's problem codes; what each
class means: docs/configuration.md ("NCCL environment audit")."""

from __future__ import annotations

from collections.abc import Collection, Mapping

# The NCCL environment audit. Faults: settings that certainly take a fast path away. The
# (variable, value_class) of each, and its issue.
NCCL_FAULT_CLASSES = {
    ("NCCL_IB_DISABLE", "disabled"): "ib_disabled",
    ("NCCL_NET_GDR_LEVEL", "loc"): "gdr_disabled",
    ("NCCL_IB_GDR_LEVEL", "loc"): "gdr_disabled",
    ("NCCL_P2P_DISABLE", "disabled"): "p2p_disabled",
    ("NCCL_P2P_LEVEL", "loc"): "p2p_disabled",
    ("NCCL_NET", "socket"): "socket_forced",
    ("NCCL_IB_HCA", "unknown_device"): "unknown_device",
}
# Every (variable, issue) the audit can report: gpunet_topology_nccl_env_findings and the alert.
NCCL_FINDINGS = tuple(dict.fromkeys((v, issue) for (v, _), issue in NCCL_FAULT_CLASSES.items()))
# Path levels NCCL accepts by name (ncclTopoGetLevel compares with strcmp, up to SYS; the set
# differs a little between releases), and the legacy numbers 0-5 it maps to names.
NCCL_LEVELS = ("LOC", "NVL", "NVB", "C2C", "PIX", "PXB", "PXN", "P2C", "PHB", "SYS")
_LEGACY_LEVELS = ("LOC", "PIX", "PXB", "PHB", "SYS", "SYS")
_LEVEL_CLASSES = (*(lv.lower() for lv in NCCL_LEVELS), "unrecognized")
NCCL_ALGOS = ("ring", "tree", "collnetdirect", "collnetchain", "nvls", "nvlstree", "pat")
NCCL_PROTOS = ("ll", "ll128", "simple")
NCCL_BUFFSIZE_DEFAULT = 4 << 20  # bytes: the Simple protocol's buffer when NCCL_BUFFSIZE is unset
# Every audited variable and the value classes it can be exported with: a fixed vocabulary, so
# gpunet_topology_nccl_env_settings never carries a value (values are unbounded, may be secret).
NCCL_SETTINGS: dict[str, tuple[str, ...]] = {
    "NCCL_IB_DISABLE": ("disabled", "enabled"),
    "NCCL_NET": ("socket", "ib", "other"),
    "NCCL_NET_GDR_LEVEL": _LEVEL_CLASSES,
    "NCCL_IB_GDR_LEVEL": (*_LEVEL_CLASSES, "overridden"),
    "NCCL_P2P_DISABLE": ("disabled", "no_effect"),
    "NCCL_P2P_LEVEL": _LEVEL_CLASSES,
    "NCCL_SHM_DISABLE": ("disabled", "enabled"),
    "NCCL_SOCKET_IFNAME": ("rdma_netdev", "non_rdma_netdev", "exclusion", "ignored"),
    "NCCL_IB_HCA": ("devices_present", "unknown_device", "exclusion"),
    "NCCL_ALGO": (*NCCL_ALGOS, "list", "exclusion", "other"),
    "NCCL_PROTO": (*NCCL_PROTOS, "list", "exclusion", "other"),
    "NCCL_BUFFSIZE": ("below_default", "default_or_above", "invalid"),
    "NCCL_CROSS_NIC": ("0", "1", "2", "other"),
    "NCCL_MIN_NCHANNELS": ("set",),
    "NCCL_MAX_NCHANNELS": ("set",),
}
# What a setting means where there is something sure to say; doctor prints these as notes.
NCCL_SETTING_NOTES = {
    ("NCCL_SOCKET_IFNAME", "non_rdma_netdev"):
        "bootstrap and NCCL's socket traffic on a non-RDMA interface (often the management "
        "network, on purpose); InfiniBand/RoCE data still goes over RDMA",
    ("NCCL_SOCKET_IFNAME", "rdma_netdev"):
        "bootstrap and NCCL's socket traffic on an RDMA port's netdev",
    ("NCCL_IB_HCA", "devices_present"): "NCCL limited to the named RDMA devices, all present",
    ("NCCL_SHM_DISABLE", "disabled"):
        "no shared-memory transport: GPU pairs without P2P go through the network transport",
    ("NCCL_BUFFSIZE", "below_default"):
        "buffers below NCCL's 4 MiB default can lower bandwidth",
    **{("NCCL_ALGO", c): "forcing algorithms overrides NCCL's tuning; often slower at some sizes"
       for c in (*NCCL_ALGOS, "list", "exclusion")},
    **{("NCCL_PROTO", c): "forcing protocols overrides NCCL's tuning; NVIDIA discourages it "
       "except to avoid a suspected protocol bug" for c in (*NCCL_PROTOS, "list", "exclusion")},
    **{(v, c): f"GPUDirect RDMA only where GPU and NIC are within {c.upper()}; farther pairs "
       "stage through host memory" for v in ("NCCL_NET_GDR_LEVEL", "NCCL_IB_GDR_LEVEL")
       for c in ("pix", "pxb")},
    **{(v, "unrecognized"): "not a level NCCL knows: NCCL ignores it"
       for v in ("NCCL_NET_GDR_LEVEL", "NCCL_IB_GDR_LEVEL", "NCCL_P2P_LEVEL")},
    ("NCCL_IB_GDR_LEVEL", "overridden"): "ignored: NCCL_NET_GDR_LEVEL is set",
}
NCCL_VARIABLES = frozenset(NCCL_SETTINGS)


def strtol(text: str) -> int:
    """C strtol(text, NULL, 0) as NCCL calls it: leading space, sign, 0x/0 prefixes, digits
    up to the first that does not belong; no digits gives 0."""
    s = text.lstrip(" \t\n\r\f\v")
    sign = -1 if s[:1] == "-" else 1
    s = s[1:] if s[:1] in "+-" else s
    base = 10
    if s[:2].lower() == "0x" and s[2:3] and s[2:3] in "0123456789abcdefABCDEF":
        base, s = 16, s[2:]
    elif s[:1] == "0":
        base = 8
    digits = "0123456789abcdef"[:base]
    n = 0
    for ch in s.lower():
        if ch not in digits:
            break
        n = n * base + digits.index(ch)
    return sign * n


def _level(value: str) -> str:
    """NCCL's ncclTopoGetLevel: a path name compared case-sensitively (strcmp), else a legacy
    number when the value starts with a digit (0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and above SYS);
    anything else NCCL ignores. The value class: the level's name in lower case, or
    ``unrecognized``. LOC turns the path off (GPUDirect RDMA, or P2P)."""
    if value in NCCL_LEVELS:
        return value.lower()
    if "0" <= value[:1] <= "9":
        return _LEGACY_LEVELS[min(strtol(value), len(_LEGACY_LEVELS) - 1)].lower()
    return "unrecognized"


def _choice(value: str, names: tuple[str, ...]) -> str:
    """NCCL_ALGO / NCCL_PROTO (case-insensitive names, ``^`` excludes, a comma list): one known
    name, ``list``, ``exclusion`` or ``other`` (per-collective syntax, unknown names)."""
    if value.startswith("^"):
        return "exclusion"
    tokens = [t.strip().lower() for t in value.split(",") if t.strip()]
    if not tokens or not all(t in names for t in tokens):
        return "other"
    return tokens[0] if len(tokens) == 1 else "list"


def _nccl_list(value: str) -> tuple[bool, bool, list[tuple[str, str]]]:
    """NCCL's device/interface list syntax (parseStringList): optional ``^`` (exclude), optional
    ``=`` (exact names, else prefixes), comma-separated ``name[:port]``. Returns (exclude, exact,
    the (name, port) entries with a name; port "" when none is given)."""
    exclude = value.startswith("^")
    value = value[1:] if exclude else value
    exact = value.startswith("=")
    value = value[1:] if exact else value
    entries = [tok.partition(":")[::2] for tok in value.split(",")]
    return exclude, exact, [(n, p) for n, p in entries if n]


def _matches(name: str, entries: list[str], exact: bool) -> bool:
    return any(name == e if exact else name.startswith(e) for e in entries)


def _selects_data(name: str, port: str, exact: bool, rdma_devices: Collection[str],
                  no_data: Collection[tuple[str, str]]) -> bool:
    """Whether one NCCL_IB_HCA entry (``name[:port]``) selects a port that can carry data: a
    device it names, and, when it names a port, one that is not a plane that carries no data
    by design (a multi-plane device's, rdma.carries_data)."""
    devices = [d for d in rdma_devices if _matches(d, [name], exact)]
    if not port:
        return bool(devices)
    return any((d, port) not in no_data for d in devices)


def env_settings(env: Mapping[str, str], rdma_netdevs: Collection[str],
                 rdma_devices: Collection[str],
                 no_data_ports: Collection[tuple[str, str]] = ()) -> dict[str, str]:
    """variable -> value class (a key of NCCL_SETTINGS, one of its classes) for each audited
    variable one process's environment sets, judged the way NCCL itself reads each variable
    (NVIDIA/nccl src/misc/param.cc, graph/paths.cc, misc/socket.cc, transport/net_ib.cc). An
    empty value is unset for NCCL; so it is here. ``no_data_ports``: the (device, port) pairs
    that carry no data by design; an NCCL_IB_HCA entry that selects only those is as unknown
    as one naming no device (NCCL skips ports that are not ACTIVE)."""
    out: dict[str, str] = {}
    for var in ("NCCL_IB_DISABLE", "NCCL_SHM_DISABLE"):
        if env.get(var):  # int64 parameters: any non-zero value disables
            out[var] = "disabled" if strtol(env[var]) != 0 else "enabled"
    if env.get("NCCL_NET"):  # matched with strcasecmp against the network names
        out["NCCL_NET"] = {"socket": "socket", "ib": "ib"}.get(env["NCCL_NET"].lower(), "other")
    # NCCL_NET_GDR_LEVEL; its former name (current releases ignore it) only when it is unset.
    if env.get("NCCL_NET_GDR_LEVEL"):
        out["NCCL_NET_GDR_LEVEL"] = _level(env["NCCL_NET_GDR_LEVEL"])
    if env.get("NCCL_IB_GDR_LEVEL"):
        out["NCCL_IB_GDR_LEVEL"] = ("overridden" if "NCCL_NET_GDR_LEVEL" in env
                                    else _level(env["NCCL_IB_GDR_LEVEL"]))
    if env.get("NCCL_P2P_DISABLE"):  # ncclGetLevel: exactly 1 disables, then P2P_LEVEL is unread
        out["NCCL_P2P_DISABLE"] = ("disabled" if strtol(env["NCCL_P2P_DISABLE"]) == 1
                                   else "no_effect")
    if env.get("NCCL_P2P_LEVEL") and out.get("NCCL_P2P_DISABLE") != "disabled":
        out["NCCL_P2P_LEVEL"] = _level(env["NCCL_P2P_LEVEL"])
    value = env.get("NCCL_SOCKET_IFNAME", "")
    if value:
        exclude, exact, entries = _nccl_list(value)
        names = [n for n, _ in entries]
        if len(value) <= 1:  # NCCL ignores a value of one character
            out["NCCL_SOCKET_IFNAME"] = "ignored"
        elif exclude:
            out["NCCL_SOCKET_IFNAME"] = "exclusion"
        elif any(_matches(n, names, exact) for n in rdma_netdevs):
            out["NCCL_SOCKET_IFNAME"] = "rdma_netdev"
        else:
            out["NCCL_SOCKET_IFNAME"] = "non_rdma_netdev"
    value = env.get("NCCL_IB_HCA", "")
    if value:
        exclude, exact, entries = _nccl_list(value)
        if exclude:
            out["NCCL_IB_HCA"] = "exclusion"
        elif any(not _selects_data(n, p, exact, rdma_devices, no_data_ports)
                 for n, p in entries):
            out["NCCL_IB_HCA"] = "unknown_device"
        else:
            out["NCCL_IB_HCA"] = "devices_present"
    if env.get("NCCL_ALGO"):
        out["NCCL_ALGO"] = _choice(env["NCCL_ALGO"], NCCL_ALGOS)
    if env.get("NCCL_PROTO"):
        out["NCCL_PROTO"] = _choice(env["NCCL_PROTO"], NCCL_PROTOS)
    value = env.get("NCCL_BUFFSIZE", "").strip()
    if value:
        size = strtol(value)
        out["NCCL_BUFFSIZE"] = ("invalid" if size <= 0 else "below_default"
                                if size < NCCL_BUFFSIZE_DEFAULT else "default_or_above")
    if env.get("NCCL_CROSS_NIC"):
        n = env["NCCL_CROSS_NIC"].strip()
        out["NCCL_CROSS_NIC"] = n if n in ("0", "1", "2") else "other"
    for var in ("NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS"):
        if env.get(var):
            out[var] = "set"
    return out


def env_findings(env: Mapping[str, str], rdma_netdevs: Collection[str],
                 rdma_devices: Collection[str],
                 no_data_ports: Collection[tuple[str, str]] = ()) -> set[tuple[str, str]]:
    """The (variable, issue) pairs of NCCL_FINDINGS one process's environment gives: its
    settings (env_settings) whose value class is a fault."""
    return {(var, NCCL_FAULT_CLASSES[(var, cls)])
            for var, cls in env_settings(env, rdma_netdevs, rdma_devices,
                                         no_data_ports).items()
            if (var, cls) in NCCL_FAULT_CLASSES}


def parse_environ(raw: bytes) -> dict[str, str]:
    """The NCCL variables this audit reads from a NUL-separated environment block; the first
    definition of a name wins, as getenv() finds it."""
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        if not entry.startswith(b"NCCL_"):
            continue
        key, sep, val = entry.partition(b"=")
        name = key.decode("ascii", "replace")
        if sep and name in NCCL_VARIABLES and name not in env:
            env[name] = val.decode("utf-8", "replace")
    return env
