"""One InfiniBand fabric's switches, seen from the node that sweeps it (gpunet-fabric.json)."""

from __future__ import annotations

from gpunet_exporter.mixin.alerts.common import number
from gpunet_exporter.mixin.dashboards.common import (
    BAD_WHEN_1,
    GOOD_WHEN_1,
    OK_RED,
    PHYS_STATE,
    SWEEP_INTERVAL,
    Json,
    Layout,
    count_or_zero,
    dashboard,
    increase,
    job_variable,
    mapping,
    override,
    panel,
    percent,
    query_variable,
    rate,
    sel,
    stale_steps,
    stat,
    state_timeline,
    steps,
    table,
    target,
    timeseries,
)
from gpunet_exporter.mixin.thresholds import Thresholds

# --- fabric (the fabric collector: every switch port, seen from the node that sweeps) ---

FABRIC_PORT = "instance, job, switch, port"
FABRIC_SWITCH = "instance, job, switch"
LEAF = 'name=~"$leaf"'
ROLE_LEAF = 'role="leaf"'
# Error counters whose rise marks a port "errors rising" in the health matrix: the link's
# physical errors and what they cost (PortXmitWait is congestion, shown on its own).
FABRIC_ERRORS = ("symbol_errors", "link_error_recoveries", "link_downed", "receive_errors",
                 "receive_remote_physical_errors", "local_link_integrity_errors",
                 "excessive_buffer_overrun_errors", "transmit_discards")
# The documented alert threshold of a leaf's uplink imbalance (docs/fabric.md).
FABRIC_HEALTH = mapping((0, "ok", "green"), (1, "degraded", "orange"), (2, "errors", "red"),
                        (3, "DOWN", "dark-red"), (4, "host down", "yellow"))
SWEEP_STEPS = ("discover", "links", "counters", "errors", "routes")


def port_info(remote_type: str) -> str:
    """gpunet_fabric_port_info of the ports whose (last) neighbour is of remote_type."""
    return sel("gpunet_fabric_port_info", f'remote_type="{remote_type}"')


def fabric_named(expr: str) -> str:
    """expr (per switch) with the switch's name from gpunet_fabric_switch_info."""
    return (f"({expr}) * on ({FABRIC_SWITCH}) group_left (name) "
            f"{sel('gpunet_fabric_switch_info')}")


def fabric_neighbour(expr: str, *matchers: str) -> str:
    """expr (per switch port) with the port's neighbour name from gpunet_fabric_port_info."""
    return (f"({expr}) * on ({FABRIC_PORT}) group_left (remote_name) "
            f"{sel('gpunet_fabric_port_info', *matchers)}")


def of_leaf(expr: str) -> str:
    """expr (per switch) limited to the leaf chosen in $leaf."""
    return (f"({expr}) and on ({FABRIC_SWITCH}) "
            f"{sel('gpunet_fabric_switch_info', ROLE_LEAF, LEAF)}")


def fabric_errors_increase() -> str:
    """Per switch port, how much the error counters of FABRIC_ERRORS rose over the interval."""
    return " + ".join(increase(f"gpunet_fabric_port_{name}_total") for name in FABRIC_ERRORS)


def port_health() -> str:
    """The health code of each switch port (FABRIC_HEALTH): the first of 3 not ACTIVE with a
    switch as its last neighbour, 4 not ACTIVE with a host, 2 error counters rising,
    1 degraded, 0 ACTIVE; ports never connected are absent. `or` keeps the left side's
    series, so each port gets the first code that applies."""
    state = sel("gpunet_fabric_port_state_id")

    def down_to(remote_type: str, code: int) -> str:
        return f"(0 * ({state} != 4 and on ({FABRIC_PORT}) {port_info(remote_type)}) + {code})"

    return " or ".join([
        down_to("switch", 3), down_to("ca", 4),
        f"(0 * (({fabric_errors_increase()}) > 0) + 2)",
        f"(0 * ({sel('gpunet_fabric_port_rate_degraded')} == 1) + 1)",
        f"(0 * ({state} == 4))",
    ])


def bargauge(title: str, description: str, targets: list[Json], unit: str) -> Json:
    return panel("bargauge", title, description, targets, unit,
                 thresholds=steps(("blue", None)),
                 options={"reduceOptions": {"calcs": ["lastNotNull"], "fields": "",
                                            "values": False},
                          "orientation": "horizontal", "displayMode": "basic",
                          "showUnfilled": True, "valueMode": "color", "namePlacement": "auto",
                          "sizing": "auto", "minVizHeight": 16, "minVizWidth": 8,
                          "maxVizHeight": 300})


def fabric(t: Thresholds) -> Json:
    # GpunetFabricUplinkImbalance fires above fabric.uplink_imbalance_ratio.
    imbalance = t.fabric.uplink_imbalance_ratio
    imbalance_steps = steps(("green", None), ("orange", imbalance))
    # GpunetFabricLeafOversubscribed fires above fabric.leaf_oversubscription_ratio.
    oversub = t.fabric.leaf_oversubscription_ratio
    lay = Layout()
    state = sel("gpunet_fabric_port_state_id")
    degraded = f"{sel('gpunet_fabric_port_rate_degraded')} == 1"

    def degraded_to(remote_type: str) -> str:
        return f"{degraded} and on ({FABRIC_PORT}) {port_info(remote_type)}"

    lay.row("Now")
    lay.add(stat("Switches", "Switches the last sweep of the selected node found "
                 "(gpunet_fabric_switches). A drop is a switch gone from the fabric, or a "
                 "sweep that saw less of it.",
                 [target(sel("gpunet_fabric_switches"))], "short", decimals=0), 4, 4)
    lay.add(stat("Ports ACTIVE", "Switch ports whose logical state is ACTIVE (4), host and "
                 "switch links alike. Compare with yesterday: fewer is links lost.",
                 [target(count_or_zero(f"{state} == 4"))], "short", decimals=0), 4, 4)
    lay.add(stat("Links degraded", "ACTIVE links that trained below what both their ends "
                 "support (narrower or slower, gpunet_fabric_port_rate_degraded): a link "
                 "between two switches counts once, though both its ports say so. The "
                 "Degraded links table names them.",
                 [target(f"({count_or_zero(degraded_to('ca'))}) + "
                         f"({count_or_zero(degraded_to('switch'))}) / 2")],
                 "short", thresholds=OK_RED, decimals=0), 4, 4)
    lay.add(stat("Ports with errors rising", "Switch ports whose error counters (symbol "
                 "errors, link error recoveries, link downed, receive errors, remote physical "
                 "errors, local link integrity, buffer overruns, transmit discards) rose over "
                 "the last interval. A steady riser is a bad cable or optic; Error rates "
                 "below names the counter.",
                 [target(count_or_zero(f"({fabric_errors_increase()}) > 0"))], "short",
                 thresholds=OK_RED, decimals=0), 4, 4)
    lay.add(stat("Sweep age", "Time since the last sweep that discovered the fabric "
                 "(gpunet_fabric_sweep_last_success_timestamp_seconds). Sweeps run every "
                 f"fabric.interval_seconds ({number(SWEEP_INTERVAL)} s by default): minutes "
                 "old means the sweeps fail "
                 "and every panel shows the last good one.",
                 [target("time() - " + sel("gpunet_fabric_sweep_last_success_timestamp_"
                                           "seconds"))], "s",
                 thresholds=stale_steps(t.fabric.stale_seconds, SWEEP_INTERVAL)), 4, 4)
    lay.add(stat("Sweep success", "Whether the latest sweep discovered the fabric "
                 "(gpunet_fabric_sweep_success). NO: ibnetdiscover or iblinkinfo failed; the "
                 "Sweep row says which step, the exporter's log why.",
                 [target(sel("gpunet_fabric_sweep_success"))], "none",
                 thresholds=steps(("red", None), ("green", 1)), mappings=GOOD_WHEN_1), 4, 4)

    lay.row("Switch x port health")
    cells = override("name\\port", ("displayName", "switch \\ port"),
                     ("custom.cellOptions", {"type": "auto"}))
    lay.add(table(
        "Switch port health, switch x port",
        "One row per switch (its node description), one column per port, from the last "
        "sweep. 0 ok (green): ACTIVE, full rate, no errors. 1 degraded (orange): ACTIVE below "
        "what both ends support. 2 errors (red): error counters rose over the interval. "
        "3 DOWN (dark red): not ACTIVE, and its last neighbour was a switch: a fabric link is "
        "lost. 4 host down (yellow): not ACTIVE, its last neighbour was a host (rebooted or "
        "powered off?). The worst applies: DOWN before host down before errors before "
        "degraded. Empty (grey): a port never connected since the exporter started. "
        "Switches with the same node description share a row: give them distinct names.",
        [target(fabric_named(port_health()), table=True)], "none",
        transformations=[
            # ports in numeric order: the columns come in the order of the rows
            {"id": "convertFieldType", "options": {"fields": {}, "conversions": [
                {"targetField": "port", "destinationType": "number"}]}},
            {"id": "sortBy", "options": {"fields": {}, "sort": [{"field": "port"}]}},
            {"id": "groupingToMatrix", "options": {
                "columnField": "port", "rowField": "name", "valueField": "Value"}}],
        mappings=FABRIC_HEALTH, thresholds=steps(("green", None), ("orange", 1),
                                                 ("red", 2)),
        cell="color-background", overrides=[cells], decimals=0), 24, 10)

    lay.row("Links")
    lay.add(table(
        "Degraded links", "ACTIVE switch ports whose link trained below what both ends "
        "support, with the neighbour: the rate it runs at against the best both ends could "
        "(iblinkinfo's 'Could be'), in bits per second. Both ends of a switch-to-switch link "
        "appear. Empty is healthy. Reseat or replace the cable or optic.",
        [target(fabric_named(fabric_neighbour(
            f"8 * {sel('gpunet_fabric_port_rate_bytes_per_second')} and on ({FABRIC_PORT}) "
            f"({degraded})")), table=True),
         target(fabric_named(fabric_neighbour(
             f"8 * {sel('gpunet_fabric_port_rate_supported_bytes_per_second')} and on "
             f"({FABRIC_PORT}) ({degraded})")), table=True)], "bps",
        rename={"name": "switch name", "remote_name": "neighbour", "Value #A": "rate",
                "Value #B": "supported", "switch": "switch GUID"},
        order=["name", "port", "remote_name", "Value #A", "Value #B", "switch"],
        sort_by="rate", sort_desc=False), 12, 8)
    lay.add(table(
        "Ports down with a neighbour", "Switch ports not ACTIVE whose last neighbour (since "
        "the exporter started) is known: a switch there is a lost fabric link, a host a "
        "node down or unplugged. Physical state says why: Polling no light, Disabled "
        "switched off, LinkErrorRecovery flapping. Empty is healthy.",
        [target(fabric_named(fabric_neighbour(
            f"{sel('gpunet_fabric_port_phys_state_id')} and on ({FABRIC_PORT}) "
            f"({state} != 4)", 'remote_type!=""')), table=True)], "none",
        rename={"name": "switch name", "remote_name": "neighbour",
                "Value": "physical state", "switch": "switch GUID"},
        order=["name", "port", "remote_name", "Value", "switch"],
        overrides=[override("physical state", ("mappings", PHYS_STATE),
                            ("custom.cellOptions", {"type": "color-text"}))]), 12, 8)

    unhealthy = sel("gpunet_fabric_link_probe_pairs", 'result="unhealthy"')
    named = sel("gpunet_fabric_link_verdict", 'verdict=~"suspect|ambiguous"')
    lay.add(table(
        "Cables the slow fleet pairs share", "Switch-to-switch cables that the path "
        "localization names (docs/fabric.md): the fleet's unhealthy pairs whose paths, as the "
        "forwarding tables route them, cross the cable while no healthy pair does. suspect: "
        "the one explanation; ambiguous: as good as other cables of the same paths. Empty: "
        "nothing named, or fabric.prometheus_url unset. From "
        f"{t.fabric.path_min_pairs} pairs it alerts (GpunetFabricPathSuspect).",
        [target(fabric_named(fabric_neighbour(
            f"{unhealthy}\n  * on ({FABRIC_PORT}) group_left (verdict)\n  {named}")),
            table=True)], "short",
        rename={"name": "switch name", "remote_name": "neighbour", "Value": "unhealthy pairs",
                "switch": "switch GUID"},
        order=["name", "port", "remote_name", "verdict", "Value", "switch"]), 24, 8)

    lay.row("Errors and congestion")
    error_targets = [
        target(f"topk(10, {fabric_named(rate(f'gpunet_fabric_port_{name}_total'))} > 0)",
               "{{name}} port {{port}} " + label)
        for name, label in (("symbol_errors", "symbol errors"),
                            ("link_error_recoveries", "link error recoveries"),
                            ("receive_errors", "receive errors"),
                            ("transmit_discards", "transmit discards"))]
    lay.add(timeseries(
        "Port error rates (top 10 per counter)", "Per switch port, the ten fastest-rising of "
        "each: symbol errors and link error recoveries (the cable or optic), receive errors "
        "(bad packets arrive), transmit discards (packets dropped: the port was down or "
        "congested). Ports at 0 are left out. A port here is red in the matrix above.",
        error_targets, "cps"), 12, 8)
    lay.add(timeseries(
        "XmtWait (top 10)", "Per switch port, PortXmitWait ticks per second: time the port had "
        "data to send but no credits from the other end (a tick is implementation-defined, a "
        "few ns). Sustained growth is congestion behind this port; on an uplink, check the "
        "uplink balance below.",
        [target(f"topk(10, {fabric_named(rate('gpunet_fabric_port_transmit_wait_ticks_total'))}"
                " > 0)", "{{name}} port {{port}}")], "short"), 12, 8)

    lay.row("Uplink balance per leaf")
    lay.add(timeseries(
        "Uplink traffic imbalance per leaf", "Per leaf and direction (tx toward the spines, rx "
        "from them), the busiest uplink's traffic over the mean of its uplinks, minus 1, over "
        "the last sweep interval: 0 is an even split. Above "
        f"{number(imbalance)} (orange line) one uplink carries {percent(imbalance)} more than "
        "its share: a routing or a cabling problem, or a few large flows. Absent while the leaf "
        "is idle (below fabric.balance_min_bytes_per_second) or "
        "has fewer than 2 uplinks.",
        [target(fabric_named(sel("gpunet_fabric_leaf_uplink_imbalance_ratio")),
                "{{name}} {{direction}}")], "percentunit", thresholds=imbalance_steps,
        show_thresholds=True), 12, 8)
    lay.add(timeseries(
        "Uplink traffic of leaf $leaf", "Bytes per second each uplink (a port whose "
        "neighbour is a switch) of the leaf chosen above transmits toward the spines (tx) "
        "and receives from them (rx). Even lines are a balanced leaf; one line above the "
        "rest is the imbalance of the panel beside.",
        [target(of_leaf(fabric_neighbour(rate("gpunet_fabric_port_transmitted_bytes_total"),
                                         'remote_type="switch"')),
                "tx port {{port}} to {{remote_name}}"),
         target(of_leaf(fabric_neighbour(rate("gpunet_fabric_port_received_bytes_total"),
                                         'remote_type="switch"')),
                "rx port {{port}} from {{remote_name}}")], "Bps",
        overrides=[override("/^rx /", ("custom.lineStyle", {"fill": "dash", "dash": [10, 10]}),
                            regex=True)]), 12, 8)
    lay.add(state_timeline(
        "Routing unbalanced per leaf", "Per leaf, whether its forwarding table sends more "
        "host LIDs out of one active uplink than out of another, by more than one "
        "(gpunet_fabric_leaf_routes_unbalanced, check_lft_balance's test). BAD after a link "
        "came back until the subnet manager reroutes; lasting, check the routing engine.",
        [target(fabric_named(sel("gpunet_fabric_leaf_routes_unbalanced")), "{{name}}")],
        mappings=BAD_WHEN_1, kind="status-history"), 12, 8)
    lay.add(bargauge(
        "Host LIDs routed per uplink of leaf $leaf", "How many host LIDs the forwarding table "
        "of the leaf chosen above sends out of each uplink "
        "(gpunet_fabric_port_routed_host_lids): even bars are balanced routing. An uplink "
        "missing routes none.",
        [target(of_leaf(fabric_neighbour(sel("gpunet_fabric_port_routed_host_lids"),
                                         'remote_type="switch"')),
                "port {{port}} to {{remote_name}}")], "short"), 12, 8)
    lay.add(timeseries(
        "Oversubscription per leaf", "Per leaf, the capacity of its active ports to hosts over "
        "that of its active uplinks (width x speed; gpunet_fabric_leaf_oversubscription_ratio): "
        f"1 is non-blocking. Above {number(oversub)} (orange line) the leaf is oversubscribed: "
        "uplinks down or trained narrower. Absent for a leaf without an active uplink.",
        [target(fabric_named(sel("gpunet_fabric_leaf_oversubscription_ratio")), "{{name}}")],
        "short", thresholds=steps(("green", None), ("orange", oversub)),
        show_thresholds=True), 12, 8)

    lay.row("Sweep")
    lay.add(timeseries(
        "Sweep duration per step", "How long each step of the last sweep took (discover: "
        "ibnetdiscover, links: iblinkinfo, counters and errors: ibqueryerrors, routes: "
        "dump_fts), and the whole sweep. Near fabric.timeout_seconds, the step is about to "
        "fail; near fabric.interval_seconds, sweeps run back to back.",
        [target(sel("gpunet_fabric_step_duration_seconds"), "{{step}}"),
         target(sel("gpunet_fabric_sweep_duration_seconds"), "whole sweep")], "s"), 12, 8)
    lay.add(state_timeline(
        "Step success", "Per step of the sweep, whether it succeeded. A failed step's "
        "metrics keep the values of its last good sweep; the exporter's log says why.",
        [target(sel("gpunet_fabric_step_success"), "{{step}}")],
        mappings=GOOD_WHEN_1, thresholds=steps(("red", None), ("green", 1))), 12, 8)

    return dashboard(
        "gpunet-fabric", "gpunet / Fabric (InfiniBand switches)",
        "Every switch port of an InfiniBand fabric, from the node whose fabric collector "
        "sweeps it: a switch x port health matrix, degraded and lost links, error rates, "
        "uplink traffic and routing balance per leaf, and the sweeps.", lay,
        [job_variable(),
         query_variable("instance", "Fabric (sweeping node)",
                        'label_values(gpunet_fabric_switches{job=~"$job"}, instance)',
                        multi=False, include_all=False),
         query_variable("leaf", "Leaf",
                        'label_values(gpunet_fabric_switch_info{job=~"$job", '
                        'instance=~"$instance", role="leaf"}, name)',
                        multi=False, include_all=False)])
