"""The thresholds behind the alert rules and the dashboards: one typed declaration, shared by
the rules (``gpunet-rules``), the dashboards and the node health check (the doctor).

Every value has a default here, with the source that documented it in docs/runbooks.md. An
operator changes thresholds in one YAML file that names only what differs, for example::

    pfc: {roce_priority: 5}
    probe: {expected_bus_bandwidth_bytes_per_second: {inter: 3.2e11}}
    for: {GpunetPortRateBelowExpected: 15m}
    severity: {GpunetGpuXidErrors: critical}
    enabled: {GpunetGpusNetworkBoundBand: false}
    cluster: prod-a
    selector: env="prod"

and regenerates rules and dashboards with ``python -m gpunet_exporter.mixin --thresholds FILE``
(or only the rules with ``gpunet-rules --thresholds FILE``). Unknown keys, wrong types and bad
durations are refused with one line naming the key.

Besides the thresholds, the file tunes each alert the way a kube-prometheus mixin's ``_config``
does, keyed by alert name as ``for`` is: ``enabled`` (false leaves the alert out of the rules
and its findings out of the doctor's report), ``severity`` (the alert's ``severity`` label, and
the doctor's); ``cluster``, a static label every alert and recording rule carries;
``selector``, label matchers on every selector of the exporters' series in the rules and the
dashboards; and ``multi_cluster``, a ``cluster`` variable in the dashboards.

Each section is a frozen dataclass declared with :func:`gpunet_exporter.config.setting`, as a
collector's settings are (the ``for`` map, whose keys are the alert names, through
:func:`gpunet_exporter.config.make_settings`): its keys, kinds, bounds and defaults are the
declaration. Every number is checked for meaning, not only for type: counts, rates and
durations are not negative, ratios lie from 0 to 1, a priority from 0 to 7; a value outside
would silently turn an alert off or leave it always on.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from gpunet_exporter import HOME
from gpunet_exporter.collectors.fabric import FabricSettings
from gpunet_exporter.config import Settings, make_settings, parse_settings, setting, settings_items
from gpunet_exporter.errors import ConfigError, short
from gpunet_exporter.files import read_yaml
from gpunet_exporter.mixin.promql import MATCHERS

# Prometheus duration syntax, as `for:` and range selectors take it (one or more unit groups).
_DURATION = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")

# The period of the fleet's pair plans in the shipped schedules (kubernetes/fleet-probe.yaml's
# CronJob, slurm/gpunet-fleet.sbatch's example; tests/test_kubernetes.py holds them to it).
PLAN_PERIOD_SECONDS = 3600
_SWEEP_SECONDS = FabricSettings().interval_seconds  # the fabric collector's default

# The alerts' severities: critical pages, warning opens a ticket, info goes nowhere.
SEVERITIES = ("critical", "warning", "info")

CRITICAL_XIDS = (48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 119, 120)


def _help(cls: type[Settings]) -> str:
    """A section's help: its class docstring on one line."""
    return " ".join((cls.__doc__ or "").split())


@dataclass(frozen=True)
class Infiniband(Settings):
    """port state, rate and error counters"""

    symbol_errors_per_hour: float = setting(
        "symbol errors per hour above which a link is out of its BER budget", 120, minimum=0)
    link_downed_count: int = setting(
        "link-downed events within link_downed_window from which a port is flapping", 2,
        minimum=1)
    link_downed_window: str = setting("window of link_downed_count", "24h")
    carrier_changes_count: int = setting(
        "netdev carrier changes within carrier_changes_window from which an interface is "
        "flapping (one flap is two changes: down, then up)", 4, minimum=1)
    carrier_changes_window: str = setting("window of carrier_changes_count", "6h")
    link_error_recoveries_per_minute: float = setting("link retrains per minute", 5, minimum=0)
    receive_errors_per_second: float = setting("received packets with errors, per second", 10,
                                               minimum=0)
    transmit_discards_per_second: float = setting("packets discarded on transmit, per second",
                                                  100, minimum=0)
    sequence_errors_per_second: float = setting(
        "RoCE/IB transport sequence errors per second (out_of_sequence, packet_seq_err, "
        "implied_nak_seq_err hw_counters), each a lost packet and a retransmission", 10,
        minimum=0)
    ack_timeouts_per_second: float = setting(
        "QP ACK timer expiries per second (local_ack_timeout_err hw_counter)", 1, minimum=0)
    efa_remote_events_per_second: float = setting(
        "EFA SRD unresponsive-remote or impaired-connection events per second "
        "(unresponsive_remote_events, impaired_remote_conn_events hw_counters)", 0.01,
        minimum=0)
    efa_retransmit_timeouts_per_second: float = setting(
        "EFA SRD retransmit timeouts per second, each a move to another network path "
        "(retrans_timeout_events hw_counter)", 0.1, minimum=0)
    rdma_idle_ratio: float = setting(
        "share of what a node's ACTIVE RDMA ports can carry (both directions, at their link "
        "rates) below which they count as idle for a starved GPU job (GpunetGpuJobRdmaIdle)",
        0.02, minimum=0, maximum=1)


@dataclass(frozen=True)
class Link(Settings):
    """MTU of the RoCE netdevs"""

    roce_min_mtu_bytes: int = setting(
        "smallest netdev MTU that carries a 4096-byte RDMA MTU with RoCE headers", 4200,
        minimum=68)
    phy_errors_per_hour: float = setting(
        "symbol, CRC or FEC-uncorrected errors per hour (ethtool -S) above which a RoCE "
        "interface is out of its bit-error budget", 120, minimum=0)
    nic_recoveries_per_hour: float = setting(
        "recoveries of one devlink health reporter per hour at or above which its errors keep "
        "coming back", 3, minimum=1)


@dataclass(frozen=True)
class Pfc(Settings):
    """PFC, pause and ECN on RoCE interfaces"""

    roce_priority: int = setting("the 802.1p priority RoCE traffic uses (lossless)", 3,
                                 minimum=0, maximum=7)
    trust: str = setting("the expected priority trust mode", "dscp", choices=("dscp", "pcp"))
    pause_ratio: float = setting(
        "fraction of time an interface may be paused (or pausing its peer) on one "
        "priority before it alerts", 0.1, minimum=0, maximum=1)
    ecn_marked_packets_per_second: float = setting(
        "ECN-marked RoCE packets received per second (notification point) above which "
        "congestion alerts", 100000, minimum=0)
    cnp_handled_per_second: float = setting(
        "CNPs acted on per second (reaction point) above which congestion alerts", 100000,
        minimum=0)


@dataclass(frozen=True)
class Gpu(Settings):
    """NVML"""

    pcie_replays_per_minute: float = setting("PCIe replays per minute", 8, minimum=0)
    busy_utilization_ratio: float = setting(
        "utilization under which a GPU with compute processes counts as starved", 0.5,
        minimum=0, maximum=1)
    network_bound_utilization_ratio: float = setting(
        "upper end of the network-bound band: a GPU with compute processes whose "
        "utilization, averaged over network_bound_window, lies from busy_utilization_ratio "
        "up to (not including) this value is in the band", 0.8, minimum=0, maximum=1)
    network_bound_gpu_share: float = setting(
        "share of a node's GPUs with compute processes that must be in the band for the "
        "node to alert", 0.75, minimum=0, maximum=1)
    network_bound_window: str = setting("window of the utilization average of the band", "30m")
    critical_xids: tuple[int, ...] = setting(
        "XID codes that page (the GPU needs a reset or the node a drain)", CRITICAL_XIDS,
        minimum=1)


@dataclass(frozen=True)
class ExpectedBusBandwidth(Settings):
    """expected bus bandwidth per scope; 0 (the default) compares with the fleet's median of
    the same scope and size instead"""

    intra: float = setting("intra-node", 0, minimum=0)
    net: float = setting("through the node's NICs", 0, minimum=0)
    inter: float = setting("across nodes", 0, minimum=0)


@dataclass(frozen=True)
class Probe(Settings):
    """all-reduce probes"""

    latency_size_bytes: int = setting("message size whose median time is checked", 8192,
                                      minimum=4, multiple_of=4)
    latency_seconds: float = setting("median all-reduce time above which latency alerts",
                                     0.002, minimum=1e-6)
    bandwidth_size_bytes: int = setting("message size whose bus bandwidth is checked", 64 << 20,
                                        minimum=4, multiple_of=4)
    bus_bandwidth_ratio: float = setting(
        "fraction of the expected bus bandwidth under which bandwidth alerts", 0.8, minimum=0,
        maximum=1)
    link_ratio: float = setting(
        "fraction of the link rate under which the bus bandwidth through the NICs alerts", 0.8,
        minimum=0, maximum=1)
    nvlink_ratio: float = setting(
        "fraction of the GPUs' NVLink bandwidth under which the intra probe's bus bandwidth "
        "alerts", 0.4, minimum=0, maximum=1)
    expected_bus_bandwidth_bytes_per_second: ExpectedBusBandwidth = setting(
        _help(ExpectedBusBandwidth), ExpectedBusBandwidth())
    straggler_wait_ratio: float = setting(
        "share of their collective time the other ranks may spend waiting for the late "
        "rank (0.5: they take twice as long as the collective itself)", 0.5, minimum=0,
        maximum=1)
    variation_ratio: float = setting(
        "coefficient of variation of the per-round median time over the window", 0.1,
        minimum=0, maximum=1)
    variation_window: str = setting("window of the round-to-round variation", "30m")
    stale_seconds: float = setting("age of the last successful round that counts as stale",
                                   900, minimum=1)


@dataclass(frozen=True)
class Fleet(Settings):
    """pair plan across the fleet: which node, which link, which leaf"""

    link_slow_ratio: float = setting(
        "fraction of the fleet's median node bandwidth under which a pair counts as slow "
        "(a failed pair always counts as unhealthy)", 0.5, minimum=0, maximum=1)
    suspect_min_pairs: int = setting(
        "pairs a node must have in the last round before all of them failing or slow makes "
        "it the suspect", 2, minimum=2)
    outlier_mad_factor: float = setting(
        "robust sigmas (1.4826 x MAD of the node medians) below the fleet median from which "
        "a node's median pair bandwidth is an outlier", 3, minimum=0)
    outlier_ratio: float = setting(
        "fraction of the fleet median under which a node's median pair bandwidth must also "
        "lie to be an outlier (guards a fleet whose MAD is near 0)", 0.7, minimum=0, maximum=1)
    outlier_min_nodes: int = setting(
        "nodes reporting a median pair bandwidth needed before outliers are judged", 4,
        minimum=3)
    cross_leaf_ratio: float = setting(
        "median bandwidth of a leaf's cross-leaf pairs, as a fraction of its intra-leaf "
        "pairs, under which the spine side alerts", 0.6, minimum=0, maximum=1)
    stale_seconds: float = setting(
        "age of a node's last pair round that counts as stale (3 rounds at the documented "
        f"{PLAN_PERIOD_SECONDS // 3600} h pair-plan period)", 3 * PLAN_PERIOD_SECONDS, minimum=1)


@dataclass(frozen=True)
class Fabric(Settings):
    """switch ports, uplinks and routing of the InfiniBand fabric (the fabric collector); a
    switch port's error counters are judged by the infiniband section's budgets, as the host
    end of the same cable"""

    uplink_imbalance_ratio: float = setting(
        "how much more traffic a leaf's busiest uplink may carry than the mean of its "
        "uplinks (busiest / mean - 1) before the leaf's uplink traffic counts as unbalanced",
        0.2, minimum=0)
    leaf_oversubscription_ratio: float = setting(
        "a leaf's host-facing capacity over its uplink capacity above which it counts as "
        "oversubscribed (2: the rule of thumb for training fabrics, at most 2:1; 1 for a "
        "non-blocking design that must stay so)", 2, minimum=0)
    path_min_pairs: int = setting(
        "unhealthy fleet pairs a switch-to-switch cable must explain before the path "
        "localization's verdict on it pages (one slow pair may be noise)", 2, minimum=1)
    stale_seconds: float = setting(
        "age of the last successful fabric sweep that counts as stale (15 sweeps at the "
        f"default {_SWEEP_SECONDS} s fabric.interval_seconds)", 15 * _SWEEP_SECONDS, minimum=1)


@dataclass(frozen=True)
class Sections(Settings):
    """The keys of a thresholds file but the maps keyed by alert name (``for``, ``severity``,
    ``enabled``): one section per group of alerts, and the labels and links of every rule."""

    job: str = setting("the scrape job of the exporters (`up{job=...}`)", "gpunet")
    cluster: str | None = setting(
        "a static `cluster` label on every alert and recording rule (unset: none)", None)
    runbook_url: str = setting(
        "base address of the runbooks; each alert links to its section",
        f"{HOME}/blob/main/docs/runbooks.md")
    selector: str | None = setting(
        "label matchers every selector of the exporter's series carries, in the rules and the "
        "dashboards, e.g. `env=\"prod\"` (unset: none)", None)
    multi_cluster: bool = setting(
        "the dashboards get a `cluster` variable and every query filters by it, for a data "
        "source that sees several Prometheus servers (Thanos, Mimir) whose series carry a "
        "`cluster` label", False)
    infiniband: Infiniband = setting(_help(Infiniband), Infiniband())
    link: Link = setting(_help(Link), Link())
    pfc: Pfc = setting(_help(Pfc), Pfc())
    gpu: Gpu = setting(_help(Gpu), Gpu())
    probe: Probe = setting(_help(Probe), Probe())
    fleet: Fleet = setting(_help(Fleet), Fleet())
    fabric: Fabric = setting(_help(Fabric), Fabric())


@dataclass(frozen=True)
class Thresholds(Sections):
    """The thresholds in force: the sections, and what a file sets per alert: the ``for:``
    durations it replaces (alert name -> duration), the severities it replaces (alert name ->
    severity) and the alerts it turns off."""

    durations: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    severities: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))
    disabled: frozenset[str] = frozenset()

    def for_(self, alert: str, default: str) -> str:
        """The ``for:`` duration of ``alert``: the file's, else the alert's own."""
        return self.durations.get(alert, default)

    def severity(self, alert: str, default: str) -> str:
        """The severity of ``alert``: the file's, else the alert's own."""
        return self.severities.get(alert, default)

    def enabled(self, alert: str) -> bool:
        """Whether ``alert`` is in the rules (and the doctor reports it): unless the file turns
        it off."""
        return alert not in self.disabled


def file_settings(alert_names: tuple[str, ...] = ()) -> type[Settings]:
    """The Settings of a thresholds file: the sections, and ``for``, ``severity`` and
    ``enabled`` with ``alert_names`` as their keys (a duration, a severity, a bool; each unset
    unless the file names it)."""
    durations = make_settings("For", {name: (str | None, setting()) for name in alert_names})
    severity = make_settings("Severity", {
        name: (str | None, setting(choices=SEVERITIES)) for name in alert_names})
    enabled = make_settings("Enabled", {name: (bool | None, setting()) for name in alert_names})
    hints = typing.get_type_hints(Sections)
    return make_settings("ThresholdsFile", {
        **{f.name: (hints[f.name], f) for f in dataclasses.fields(Sections)},
        "for": (durations, setting("`for:` duration per alert name, replacing the built-in one",
                                   durations())),
        "severity": (severity, setting("`severity` label per alert name, replacing the "
                                       "built-in one", severity())),
        "enabled": (enabled, setting("per alert name, false to leave the alert out of the "
                                     "rules and the doctor's report", enabled())),
    })


def _check_durations(value: Any, key: str) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _check_durations(v, f"{key}.{k}" if key else k)
    elif (key.startswith("for.") or key.endswith("_window")) and not _DURATION.match(value):
        raise ConfigError(f"key {key!r}: expected a Prometheus duration such as 5m or "
                          f"1h30m, got {short(value)}")
    elif key.endswith("_window") and not any(c in "123456789" for c in value):
        # `for: 0s` fires at once; a range of 0s is refused by Prometheus' rule loader.
        raise ConfigError(f"key {key!r}: expected a window longer than 0, got "
                          f"{short(value)}")


def load(path: str | None, alert_names: tuple[str, ...] = ()) -> Thresholds:
    """The defaults, overridden by the YAML file at ``path`` (when given); ConfigError names the
    file and the key that is wrong.

    The file is checked against its Settings first, then its durations in the file's order
    (the defaults are good durations), so the first wrong key is the one named."""
    where = "defaults" if path is None else f"thresholds file {path!r}"
    try:
        raw = None if path is None else read_yaml(path)
        read = parse_settings(file_settings(alert_names), raw, "")
        _check_durations(raw or {}, "")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    items = settings_items(read)
    if items["cluster"] is not None and not items["cluster"].strip():
        # An empty label value is no label to Prometheus: say so rather than drop it.
        raise ConfigError(f"{where}: key 'cluster': expected a label value, got "
                          f"{short(items['cluster'])}")
    if items["selector"] is not None and not MATCHERS.fullmatch(items["selector"]):
        raise ConfigError(f"{where}: key 'selector': expected label matchers such as "
                          f'env="prod", cluster=~"a|b", got {short(items["selector"])}')
    durations = {k: v for k, v in settings_items(items.pop("for")).items() if v is not None}
    severities = {k: v for k, v in settings_items(items.pop("severity")).items()
                  if v is not None}
    disabled = frozenset(k for k, v in settings_items(items.pop("enabled")).items()
                         if v is False)
    return Thresholds(**items, durations=MappingProxyType(durations),
                      severities=MappingProxyType(severities), disabled=disabled)


def defaults(alert_names: tuple[str, ...] = ()) -> Thresholds:
    return load(None, alert_names)


def as_dict(t: Sections) -> dict[str, Any]:
    """The thresholds as the file's mapping (lists as lists), the maps keyed by alert name left
    out."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Sections):
        value = getattr(t, f.name)
        out[f.name] = _lists(dataclasses.asdict(value) if isinstance(value, Settings) else value)
    return out


def _lists(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [_lists(v) for v in value]
    return value
