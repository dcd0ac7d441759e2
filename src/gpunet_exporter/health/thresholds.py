"""The thresholds behind the alert rules: one definition, shared by the rule generator
(``gpunet-rules``, ``exporter.rules``) and the node health check.

Every value has a default here, with the source that documented it in docs/runbooks.md. An
operator changes thresholds in one YAML file that names only what differs, for example::

    pfc: {roce_priority: 5}
    probe: {expected_bus_bandwidth_bytes_per_second: {inter: 3.2e11}}
    for: {GpunetPortRateBelowExpected: 15m}

and regenerates the rules with ``gpunet-rules --thresholds FILE``. Unknown keys, wrong types and
bad durations are refused with one line naming the key.
"""

from __future__ import annotations

import re
from typing import Any

from gpunet_exporter.config import ConfigError, Field, load_file, short, validate

# Prometheus duration syntax, as `for:` and range selectors take it (one or more unit groups).
_DURATION = re.compile(r"^(?:\d+(?:ms|s|m|h|d|w|y))+$")


# Every number is checked for meaning, not only for type: counts, rates and durations are not
# negative, ratios lie from 0 to 1, a priority from 0 to 7; a value outside would silently turn
# an alert off or leave it always on.
def _num(help: str, default: float, minimum: float = 0) -> Field:
    return Field("number", help, default=default, minimum=minimum)


def _ratio(help: str, default: float) -> Field:
    return Field("number", help, default=default, minimum=0, maximum=1)


def _int(help: str, default: int, minimum: int = 0, maximum: int | None = None,
         multiple_of: int | None = None) -> Field:
    return Field("int", help, default=default, minimum=minimum, maximum=maximum,
                 multiple_of=multiple_of)


SCHEMA_FIELDS: dict[str, Field] = {
    "job": Field("str", "the scrape job of the exporters (`up{job=...}`)", default="gpunet"),
    "runbook_url": Field(
        "str", "base address of the runbooks; each alert links to its section",
        default="https://github.com/gpunet-exporter/gpunet-exporter/blob/main/docs/runbooks.md"),
    "infiniband": Field("map", "port state, rate and error counters", default={}, fields={
        "symbol_errors_per_hour": _num(
            "symbol errors per hour above which a link is out of its BER budget", 120),
        "link_downed_count": _int(
            "link-downed events within link_downed_window from which a port is flapping", 2,
            minimum=1),
        "link_downed_window": Field("str", "window of link_downed_count", default="24h"),
        "carrier_changes_count": _int(
            "netdev carrier changes within carrier_changes_window from which an interface is "
            "flapping (one flap is two changes: down, then up)", 4, minimum=1),
        "carrier_changes_window": Field("str", "window of carrier_changes_count", default="6h"),
        "link_error_recoveries_per_minute": _num("link retrains per minute", 5),
        "receive_errors_per_second": _num("received packets with errors, per second", 10),
        "transmit_discards_per_second": _num("packets discarded on transmit, per second", 100),
        "sequence_errors_per_second": _num(
            "RoCE/IB transport sequence errors per second (out_of_sequence, packet_seq_err, "
            "implied_nak_seq_err hw_counters), each a lost packet and a retransmission", 10),
        "ack_timeouts_per_second": _num(
            "QP ACK timer expiries per second (local_ack_timeout_err hw_counter)", 1),
        "rdma_idle_bytes_per_second": _num(
            "bytes per second, sent and received over all of a node's RDMA ports together, "
            "below which the ports are idle (GpunetGpuJobRdmaIdle)", 1e6),
    }),
    "link": Field("map", "MTU of the RoCE netdevs", default={}, fields={
        "roce_min_mtu_bytes": _int(
            "smallest netdev MTU that carries a 4096-byte RDMA MTU with RoCE headers", 4200,
            minimum=68),
        "phy_errors_per_hour": _num(
            "symbol, CRC or FEC-uncorrected errors per hour (ethtool -S) above which a RoCE "
            "interface is out of its bit-error budget", 120),
    }),
    "pfc": Field("map", "PFC, pause and ECN on RoCE interfaces", default={}, fields={
        "roce_priority": _int("the 802.1p priority RoCE traffic uses (lossless)", 3,
                              maximum=7),
        "trust": Field("str", "the expected priority trust mode", default="dscp",
                       choices=("dscp", "pcp")),
        "pause_ratio": _ratio(
            "fraction of time an interface may be paused (or pausing its peer) on one "
            "priority before it alerts", 0.1),
        "ecn_marked_packets_per_second": _num(
            "ECN-marked RoCE packets received per second (notification point) above which "
            "congestion alerts", 100000),
        "cnp_handled_per_second": _num(
            "CNPs acted on per second (reaction point) above which congestion alerts", 100000),
    }),
    "gpu": Field("map", "NVML", default={}, fields={
        "pcie_replays_per_minute": _num("PCIe replays per minute", 8),
        "busy_utilization_ratio": _ratio(
            "utilization under which a GPU with compute processes counts as starved", 0.5),
        "network_bound_utilization_ratio": _ratio(
            "upper end of the network-bound band: a GPU with compute processes whose "
            "utilization, averaged over network_bound_window, lies from busy_utilization_ratio "
            "up to (not including) this value is in the band", 0.8),
        "network_bound_gpu_share": _ratio(
            "share of a node's GPUs with compute processes that must be in the band for the "
            "node to alert", 0.75),
        "network_bound_window": Field("str", "window of the utilization average of the band",
                                      default="30m"),
        "critical_xids": Field(
            "list", "XID codes that page (the GPU needs a reset or the node a drain)",
            item=Field("int", minimum=1),
            default=[48, 56, 57, 58, 62, 63, 64, 65, 68, 69, 73, 74, 79, 80, 81, 92, 119, 120]),
    }),
    "probe": Field("map", "all-reduce probes", default={}, fields={
        "latency_size_bytes": _int("message size whose median time is checked", 8192,
                                   minimum=4, multiple_of=4),
        "latency_seconds": _num("median all-reduce time above which latency alerts", 0.002,
                                minimum=1e-6),
        "bandwidth_size_bytes": _int("message size whose bus bandwidth is checked", 64 << 20,
                                     minimum=4, multiple_of=4),
        "bus_bandwidth_ratio": _ratio(
            "fraction of the expected bus bandwidth under which bandwidth alerts", 0.8),
        "link_ratio": _ratio(
            "fraction of the link rate under which the bus bandwidth through the NICs alerts",
            0.8),
        "expected_bus_bandwidth_bytes_per_second": Field(
            "map", "expected bus bandwidth per scope; 0 (the default) compares with the "
            "fleet's median of the same scope and size instead", default={}, fields={
                "intra": _num("intra-node", 0),
                "net": _num("through the node's NICs", 0),
                "inter": _num("across nodes", 0),
            }),
        "straggler_wait_ratio": _ratio(
            "share of their collective time the other ranks may spend waiting for the late "
            "rank (0.5: they take twice as long as the collective itself)", 0.5),
        "variation_ratio": _ratio(
            "coefficient of variation of the per-round median time over the window", 0.1),
        "variation_window": Field("str", "window of the round-to-round variation",
                                  default="30m"),
        "stale_seconds": _num("age of the last successful round that counts as stale", 900,
                              minimum=1),
    }),
    "fleet": Field("map", "pair plan across the fleet: which node, which link, which leaf",
                   default={}, fields={
        "link_slow_ratio": _ratio(
            "fraction of the fleet's median node bandwidth under which a pair counts as slow "
            "(a failed pair always counts as unhealthy)", 0.5),
        "suspect_min_pairs": _int(
            "pairs a node must have in the last round before all of them failing or slow makes "
            "it the suspect", 2, minimum=2),
        "outlier_mad_factor": _num(
            "robust sigmas (1.4826 x MAD of the node medians) below the fleet median from which "
            "a node's median pair bandwidth is an outlier", 3),
        "outlier_ratio": _ratio(
            "fraction of the fleet median under which a node's median pair bandwidth must also "
            "lie to be an outlier (guards a fleet whose MAD is near 0)", 0.7),
        "outlier_min_nodes": _int(
            "nodes reporting a median pair bandwidth needed before outliers are judged", 4,
            minimum=3),
        "cross_leaf_ratio": _ratio(
            "median bandwidth of a leaf's cross-leaf pairs, as a fraction of its intra-leaf "
            "pairs, under which the spine side alerts", 0.6),
        "stale_seconds": _num(
            "age of a node's last pair round that counts as stale (3 rounds at the documented "
            "1 h pair-plan period)", 10800, minimum=1),
    }),
    "fabric": Field("map", "switch ports, uplinks and routing of the InfiniBand fabric (the "
                    "fabric collector); a switch port's error counters are judged by the "
                    "infiniband section's budgets, as the host end of the same cable",
                    default={}, fields={
        "uplink_imbalance_ratio": _num(
            "how much more traffic a leaf's busiest uplink may carry than the mean of its "
            "uplinks (busiest / mean - 1) before the leaf's uplink traffic counts as unbalanced",
            0.2),
        "stale_seconds": _num(
            "age of the last successful fabric sweep that counts as stale (15 sweeps at the "
            "default 60 s fabric.interval_seconds)", 900, minimum=1),
    }),
}


def schema(alert_names: tuple[str, ...] = ()) -> Field:
    """The thresholds schema; ``alert_names`` are the keys allowed under ``for``."""
    fields = dict(SCHEMA_FIELDS)
    fields["for"] = Field("map", "`for:` duration per alert name, replacing the built-in one",
                          default={}, fields={n: Field("str") for n in alert_names})
    return Field("map", fields=fields)


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


def load(path: str | None, alert_names: tuple[str, ...] = ()) -> dict[str, Any]:
    """The defaults, overridden by the YAML file at ``path`` (when given); ConfigError names the
    file and the key that is wrong."""
    spec = schema(alert_names)
    where = "defaults" if path is None else f"thresholds file {path!r}"
    result = validate({}, spec, "") if path is None else load_file(path, spec, "thresholds file")
    try:
        _check_durations(result, "")
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return result


def defaults(alert_names: tuple[str, ...] = ()) -> dict[str, Any]:
    return load(None, alert_names)
