"""The suite's two tiers (issue 32): ``unit`` and ``system``.

- **unit**: in-process tests. They need no Debian package and start no process: no installed
  exporter, no Prometheus, promtool, network namespace, Slurm, ibsim or container image. They run
  with ``bash tests/run.sh --unit`` (``pytest -m unit``) on a machine with nothing but Python.
- **system**: everything else.

Every collected test gets exactly one of the two markers (tests/conftest.py's
``pytest_collection_modifyitems`` calls :func:`classify`). A test is ``system`` when

1. it carries ``@pytest.mark.system`` itself, or
2. its module is in :data:`SYSTEM_MODULES` (every test of it starts processes), or
3. it is named in :data:`SYSTEM_TESTS` (modules that mix both: split by test), or
4. it asks, directly or through another fixture, for a fixture of :data:`SYSTEM_FIXTURES`;

else it is ``unit``. The tiers cannot drift: while a ``unit`` test runs (its setup, call and
teardown), :func:`install` makes every way of starting a process (``subprocess``, ``os.fork``,
``os.posix_spawn``, ``os.system``, ``os.exec*``, multiprocessing's spawn) and every look-up of a
Debian package's program (:data:`DEBIAN_PROGRAMS`, through ``shutil.which``) raise
:class:`UnitTierViolation` and fail the test, in every run, full suite included, even when the
code under test catches the exception. A new test that starts a process is therefore marked
``system`` (one of the four ways above) or it fails.

``GPUNET_TIER_AUDIT=<folder>`` records instead of failing: for every test (both tiers), what it
started, one JSON file per pytest worker; it is how the lists below were drawn up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

# Modules whose every test starts processes (the installed exporter, Prometheus, promtool,
# network namespaces, Slurm, ibsim, images, the gloo probe), or nearly every one, or whose tests
# share a fixture that does; by module name. Drawn up with GPUNET_TIER_AUDIT (2026-11-27).
SYSTEM_MODULES: frozenset[str] = frozenset({
    "test_alerts_e2e", "test_cli", "test_commands", "test_demo", "test_doctor",
    "test_fabric_alerts", "test_fabric_paths", "test_fleet_launcher_netns", "test_fleet_netns",
    "test_fleet_rules_netns", "test_fleet_slurm", "test_golden", "test_grafana_fabric",
    "test_grafana_pairs", "test_hostile_http", "test_image", "test_isolation",
    "test_kubernetes_exporter", "test_load", "test_parity", "test_prometheus",
    "test_slurm_healthcheck", "test_slurm_script", "test_unknown", "test_web_config",
})

# Modules that mix both: the system tests of each, by function name (without parameters).
SYSTEM_TESTS: dict[str, frozenset[str]] = {
    "test_alerts": frozenset({
        "test_amtool_checks_the_example",
        "test_bad_thresholds_file_one_line_exit_2",
        "test_check_detects_a_stale_file",
        "test_check_reads_only_a_regular_file",
        "test_configured_expected_bandwidth_fires_below_80_percent",
        "test_documented_dcgm_join_accepts_both_label_spellings",
        "test_every_alert_test_can_fail",
        "test_failed_expectations_reads_promtool_s_report",
        "test_missing_thresholds_file",
        "test_output_file",
        "test_overridden_rules_pass_promtool",
        "test_promtool_check_rules",
        "test_promtool_unit_tests_pass",
        "test_routing_tree",
        "test_rule_file_is_generated_from_the_defaults",
        "test_thresholds_override_one_place",
        "test_unit_tests_bite_when_a_threshold_moves",
    }),
    "test_fabric": frozenset({
        "test_a_fabric_not_swept_is_an_unknown_check",
        "test_a_failing_step_costs_only_its_own_values",
        "test_a_vanished_fabric_fails_the_sweep_and_keeps_the_last_values",
        "test_healthy_fabric_every_switch_port_and_nothing_flagged",
        "test_imbalance_not_judged_below_the_traffic_floor",
        "test_leaf_oversubscription_from_active_uplinks",
        "test_narrow_and_slow_links_are_degraded_at_both_ends",
        "test_switch_port_errors_show_on_their_port_only",
        "test_unplugged_uplink_is_down_keeps_its_neighbour_and_unbalances_routing",
        "test_uplink_traffic_balance",
    }),
    "test_fleet_launcher": frozenset({
        "test_a_busy_node_costs_its_pairs_a_measurement_not_a_failure",
        "test_a_node_that_gets_busy_mid_pair_kills_its_ranks",
        "test_an_adaptive_pass_names_the_bad_node_of_six",
        "test_a_worker_killed_for_a_busy_gpu_is_replaced_for_the_next_pair",
        "test_a_worker_not_started_by_the_fleet_says_so_and_exits_2",
        "test_a_worker_that_dies_mid_pair_costs_only_that_pair",
        "test_a_worker_whose_pair_failed_is_not_given_the_next_one",
        "test_bad_input_is_one_line_and_exit_2",
        "test_each_node_keeps_one_worker_for_all_its_pairs",
        "test_idle_workers_are_killed_when_other_work_comes_between_pairs",
        "test_four_nodes_on_loopback_write_the_ring_on_both_ends",
        "test_the_gpus_are_busy_with_a_process_of_another_session",
        "test_the_watch_kills_the_ranks_the_moment_the_pair_must_stop",
        "test_the_watch_returns_the_ranks_codes_or_kills_them_at_the_deadline",
    }),
    "test_gpu": frozenset({
        "test_end_to_end_installed_exporter",
        "test_end_to_end_without_nvidia",
    }),
    "test_grafana": frozenset({
        "test_promtool_check_catches_bad_promql",
        "test_queries_are_valid_promql",
    }),
    "test_hotplug": frozenset({
        "test_exporter_without_pyudev_and_with_no_hotplug",
        "test_installed_exporter_counts_veth_events",
        "test_link_refreshes_ibv_devinfo_now",
        "test_real_monitor_sees_a_veth_pair_come_and_go",
    }),
    "test_http": frozenset({
        "test_keep_alive_and_http10",
    }),
    "test_infiniband": frozenset({
        "test_eacces_for_real_as_unprivileged_user",
    }),
    "test_kubernetes": frozenset({
        "test_the_kustomization_knobs_reach_every_place",
        "test_the_kustomization_makes_the_manifests",
    }),
    "test_labels": frozenset({
        "test_names_not_utf8_over_http",
    }),
    "test_link": frozenset({
        "test_first_scrape_does_not_wait_for_a_slow_ibv_devinfo",
        "test_ibv_devinfo_active_mtu",
        "test_ibv_devinfo_broken_tool",
        "test_ibv_devinfo_failure_keeps_last_good_values",
    }),
    "test_ncclog": frozenset({
        "test_explain_healthy_ib_log",
        "test_explain_json",
        "test_explain_not_an_nccl_log",
        "test_explain_single_node_job_says_network_unused",
        "test_explain_socket_log",
        "test_explain_stdin_and_usage",
        "test_explain_unreadable",
        "test_explain_warnings_and_empty_host",
        "test_file_without_newlines",
    }),
    "test_nic": frozenset({
        "test_a_hanging_ethtool_costs_the_scrape_nothing",
        "test_a_netdev_without_module_access_is_unknown",
        "test_command_reader_checks_the_length",
        "test_failures_keep_the_last_good_module",
        "test_faults_reach_their_metrics",
        "test_infiniband_ports_are_unknown_by_default",
        "test_modules_and_reporters_of_a_healthy_node",
        "test_no_module_access_and_no_devlink_are_unknown",
    }),
    "test_pfc": frozenset({
        "test_bad_config_is_one_line_and_exit_2",
        "test_broken_mlnx_qos",
        "test_dcb_refresh",
        "test_exporter_answers_through_broken_tools",
        "test_first_scrape_does_not_wait_for_a_slow_mlnx_qos",
        "test_interface_that_disappears_between_listing_and_reading",
        "test_ioctl_reads_what_ethtool_prints",
        "test_mlnx_qos_refresh_and_last_good_values",
        "test_sources_order_and_sysfs_source",
    }),
    "test_privileges": frozenset({
        "test_environ_needs_both_capabilities",
    }),
    "test_mixin": frozenset({
        "test_a_thresholds_file_changes_rules_dashboards_and_the_prometheusrule",
        "test_bad_input_is_one_line",
        "test_it_writes_every_generated_file",
        "test_the_check_names_each_stale_file",
        "test_the_checkout_is_fresh",
    }),
    "test_probe": frozenset({
        "test_bad_arguments_one_line_exit_2",
        "test_collector_runs_the_real_runner",
        "test_command_passes_every_setting_that_differs",
        "test_crashing_runner_counts_crash_and_is_restarted",
        "test_device_check_helpers",
        "test_device_check_probe_arguments_parse",
        "test_end_to_end_exporter_with_gloo_probe",
        "test_help_shows_the_commands_people_run",
        "test_hung_round_is_killed_with_its_process_group",
        "test_nccl_without_gpu_says_no_gpu",
        "test_one_device_node_has_no_intra_scope",
        "test_planted_straggler_is_named_and_a_fair_run_names_none",
        "test_runner_between_rounds_is_not_a_hang",
        "test_runner_that_cannot_start_counts_one_crash_per_try",
        "test_sizes_not_multiple_of_4_rejected",
        "test_three_gloo_ranks_bandwidth_from_the_loop",
        "test_two_gloo_ranks_intra_and_net",
        "test_two_gloo_ranks_under_torchrun_cluster_mode",
    }),
    "test_probe_idle": frozenset({
        "test_a_job_mid_round_stops_the_round_without_a_failure",
        "test_a_round_cut_short_by_a_job_is_the_yields_not_skipped_busy",
        "test_foreign_are_the_processes_outside_the_probe_sessions",
        "test_job_first_the_probe_never_starts",
        "test_probe_waits_measures_yields_to_a_job_and_comes_back",
    }),
    "test_repository": frozenset({
        "test_wheel_builds_clean_with_its_license",
    }),
    "test_sysfs_tree": frozenset({
        "test_faulty_example_mlnx_qos_replays_the_same_configuration",
    }),
    "test_systemd": frozenset({
        "test_fabric_unit_command_sweeps_unprivileged",
        "test_security_exposure",
        "test_sysusers_creates_the_user",
        "test_udev_rule_applies",
        "test_udev_test_sees_a_broken_rule",
        "test_verify_catches_a_bad_setting",
        "test_verify_clean",
    }),
    "test_topology": frozenset({
        "test_end_to_end",
        "test_nccl_audit_eacces_for_real_as_unprivileged_user",
        "test_nccl_audit_real_proc",
    }),
    "test_tiers": frozenset({"test_pytest_fails_a_unit_test_that_starts_a_process"}),
}

# Fixtures that start processes, by name: a test asking for one is system wherever it is.
SYSTEM_FIXTURES: frozenset[str] = frozenset({"run_exporter"})

# Programs of the Debian packages tests/run.sh installs (tests/test_tiers.py checks that every
# `command -v` of run.sh is here). A unit test may not even look for one: its outcome would then
# depend on what the machine has installed.
DEBIAN_PROGRAMS: frozenset[str] = frozenset({
    "prometheus", "promtool", "prometheus-node-exporter", "prometheus-alertmanager", "ip", "tc",
    "ethtool", "systemd-analyze", "systemd-sysusers", "udevadm", "slurmctld", "slurmd", "sbatch",
    "srun", "sinfo", "scontrol", "squeue", "munged", "ibsim", "opensm", "ibnetdiscover",
    "mmdebstrap", "buildah", "podman", "runc", "setpriv", "unshare", "nsenter",
})


class UnitTierViolation(Exception):
    """A test of the unit tier started a process or looked for a Debian package's program."""


def classify(item: pytest.Item) -> str:
    """``system`` or ``unit`` for one collected test (see the module's docstring)."""
    if item.get_closest_marker("system") is not None:
        return "system"
    module = item.module.__name__ if isinstance(item, pytest.Function) else ""
    name = getattr(item, "originalname", item.name)
    if module in SYSTEM_MODULES or name in SYSTEM_TESTS.get(module, ()):
        return "system"
    if SYSTEM_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        return "system"
    return "unit"


# System modules that measure bandwidth or wait on timing between processes sharing the CPUs:
# next to three busy xdist workers on 2 cores their numbers are the neighbours' (a ring of
# namespace pairs measured 46 to 490 MB/s unshaped in one such run). They are marked ``quiet``,
# and tests/run.sh runs them after the parallel part on two workers: the namespace fleets, which
# measure bandwidth, one after the other on one (QUIET_TOGETHER), beside the others, which
# mostly wait (about 4 s of CPU in 25 s).
QUIET_MODULES: frozenset[str] = frozenset({
    "test_fleet_netns", "test_fleet_rules_netns", "test_fabric_alerts", "test_hostile_http",
})
# Quiet modules that never run beside each other: one unit of work (scope()).
QUIET_TOGETHER: frozenset[str] = frozenset({"test_fleet_netns", "test_fleet_rules_netns"})


def mark(items: Iterable[pytest.Item]) -> None:
    """Each test's tier, and ``quiet`` for the tests of :data:`QUIET_MODULES`."""
    for item in items:
        tier = classify(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(tier)
        if _module(item.nodeid) in QUIET_MODULES and item.get_closest_marker("quiet") is None:
            item.add_marker("quiet")


# ---- spreading the tests over pytest-xdist workers ----------------------------------------------

# Modules with a fixture built once per module or session (an image, a Slurm cluster, a fleet of
# namespaces, a Prometheus with its exporters): their tests run on one worker, so that no two
# workers build the same thing (tests/test_tiers.py checks the list against the modules).
GROUPED_MODULES: frozenset[str] = frozenset({
    "test_alerts_e2e", "test_demo", "test_doctor", "test_fabric_paths", "test_fleet_netns",
    "test_fleet_rules_netns", "test_fleet_slurm", "test_fuzz", "test_golden",
    "test_grafana_fabric", "test_grafana_pairs", "test_image", "test_kubernetes_exporter",
    "test_slurm_healthcheck", "test_web_config",
})

# Modules whose tests (or group) take longest, longest first (durations of 2026-11-27): they are
# handed out first, so that the run does not end waiting on one of them started last.
FIRST: tuple[str, ...] = (
    "test_image", "test_alerts", "test_load", "test_fleet_rules_netns", "test_slurm_healthcheck",
    "test_fleet_launcher_netns", "test_fleet_slurm", "test_fleet_netns", "test_doctor",
    "test_probe", "test_probe_idle", "test_fleet_launcher",
)


def _module(nodeid: str) -> str:
    return Path(nodeid.split("::")[0]).stem


def scope(nodeid: str) -> str:
    """The unit of work ``nodeid`` belongs to: the quiet fleets', its module's, or its own."""
    if _module(nodeid) in QUIET_TOGETHER:
        return "quiet: " + ", ".join(sorted(QUIET_TOGETHER))
    return nodeid.split("::")[0] if _module(nodeid) in GROUPED_MODULES else nodeid


def order(nodeids: list[str]) -> list[str]:
    """Tests of :data:`FIRST` first, in its order; the others as collected."""
    rank = {m: i for i, m in enumerate(FIRST)}
    return sorted(nodeids, key=lambda n: rank.get(_module(n), len(FIRST)))


def scheduler(config: pytest.Config, log: Any) -> Any:
    """The scheduler tests/conftest.py gives pytest-xdist. Its ``--dist loadgroup`` rewrites a
    test's node id, which pytest 9 no longer allows (the groups were silently lost). Here every
    test is a unit of work of its own, except that a module of :data:`GROUPED_MODULES` is one
    unit; the tests of :data:`FIRST` go first, the rest in the order of collection."""
    from xdist.scheduler import LoadScopeScheduling

    class Scheduling(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope(nodeid)

        ordered = False

        def _assign_work_unit(self, node: Any) -> None:
            # The queue of units, not the workers' collections (the workers are sent indexes
            # into those, as collected): reordered once, before the first unit goes out.
            if not self.ordered:
                self.ordered = True
                units = dict(self.workqueue)
                self.workqueue.clear()
                for first in order(list(units)):
                    self.workqueue[first] = units[first]
            super()._assign_work_unit(node)

    return Scheduling(config, log)


# The test running now, when it is a unit test (or every test, when auditing), and what it did.
_current: dict[str, Any] = {"item": None, "audit": None, "threads": frozenset()}
_AUDIT: dict[str, list[str]] = {}


# The suite's fixtures being set up or finished now, innermost last: (fixturedef, "setup" or
# "finish"). A fixture during whose setup a process started is tagged, whatever test set it up,
# so that a unit test that uses it later (a module's shared cluster, already built) fails too.
_fixtures: list[tuple[Any, str]] = []
_STARTED = "_gpunet_tier_started"


def _violation(what: str) -> None:
    if threading.current_thread() in _current["threads"]:
        return  # a thread of an earlier test (a supervisor still winding down): not this one's
    # A fixture's setup runs on the main thread: a process another thread starts meanwhile (a
    # background thread of an earlier test, started after this test's list of threads was
    # taken: seen once, charged to a fixture that builds a sysfs tree) is not the fixture's.
    for fixturedef, phase in _fixtures if threading.current_thread() is threading.main_thread() \
            else ():
        if phase == "setup" and not hasattr(fixturedef, _STARTED):
            setattr(fixturedef, _STARTED, what)
    item = _current["item"]
    if item is None:
        return
    finishing = [f for f, phase in _fixtures if phase == "finish"]
    if finishing and finishing[0].argname not in getattr(item, "fixturenames", ()):
        return  # a wider fixture of other tests, ending after this one: not this test's doing
    if _current["audit"] is not None:
        _AUDIT.setdefault(item.nodeid, [])
        if what not in _AUDIT[item.nodeid] and len(_AUDIT[item.nodeid]) < 5:
            _AUDIT[item.nodeid].append(what)
        return
    found = item.stash.setdefault(_VIOLATIONS, [])
    found.append(what)
    raise UnitTierViolation(
        f"{item.nodeid} is a unit test but {what}; mark it system (tests/support/tiers.py)")


_VIOLATIONS = pytest.StashKey[list[str]]()


def _wrap(owner: Any, name: str, describe: Callable[..., str]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, "_tier_guard", False):
        return

    def guarded(*args: Any, **kw: Any) -> Any:
        _violation(describe(*args, **kw))
        return original(*args, **kw)

    guarded._tier_guard = True  # type: ignore[attr-defined]
    guarded.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, guarded)


def _argv0(args: Any) -> str:
    if isinstance(args, (str, bytes, os.PathLike)):
        return os.fsdecode(args).split()[0] if os.fsdecode(args).split() else "?"
    try:
        return os.fsdecode(next(iter(args)))
    except (TypeError, IndexError):
        return repr(args)


@contextmanager
def fixture(fixturedef: Any, phase: str) -> Iterator[None]:
    """Around a fixture's setup (tests/conftest.py's pytest_fixture_setup) or finish."""
    _fixtures.append((fixturedef, phase))
    try:
        yield
    finally:
        _fixtures.pop()


def install() -> None:
    """Guard every way of starting a process, and shutil.which of Debian programs."""
    import multiprocessing.util

    from _pytest.fixtures import FixtureDef

    if not getattr(FixtureDef.finish, "_tier_guard", False):
        finish = FixtureDef.finish

        def finishing(self: Any, *a: Any, **kw: Any) -> Any:
            with fixture(self, "finish"):
                return finish(self, *a, **kw)

        finishing._tier_guard = True  # type: ignore[attr-defined]
        FixtureDef.finish = finishing  # type: ignore[method-assign]

    _wrap(subprocess.Popen, "_execute_child",
          lambda self, args, *a, **k: f"started a process ({_argv0(args)})")
    for name in ("fork", "forkpty"):
        _wrap(os, name, lambda *a, _n=name, **k: f"called os.{_n}()")
    for name in ("posix_spawn", "posix_spawnp", "execv", "execve", "execvp", "execvpe",
                 "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp",
                 "spawnvpe"):
        _wrap(os, name, lambda path, *a, _n=name, **k: f"called os.{_n}({os.fsdecode(path)})")
    _wrap(os, "system", lambda cmd, *a, **k: f"ran os.system({cmd.split()[0] if cmd else ''})")
    _wrap(multiprocessing.util, "spawnv_passfds",
          lambda path, *a, **k: f"spawned {os.fsdecode(path)} (multiprocessing)")
    original_which = shutil.which
    if getattr(original_which, "_tier_guard", False):
        return

    def which(cmd: Any, *a: Any, **kw: Any) -> Any:
        if os.path.basename(os.fsdecode(cmd)) in DEBIAN_PROGRAMS:
            _violation(f"looked for the Debian program {os.fsdecode(cmd)}")
        return original_which(cmd, *a, **kw)

    which._tier_guard = True  # type: ignore[attr-defined]
    shutil.which = which  # type: ignore[assignment]


def configure(config: pytest.Config) -> None:
    audit = os.environ.get("GPUNET_TIER_AUDIT")
    _current["audit"] = audit
    install()


def enter(item: pytest.Item) -> None:
    """Before a test's setup: guard it when it is a unit test (every test, when auditing)."""
    if _current["audit"] is not None or item.get_closest_marker("unit") is not None:
        _current["item"] = item
        _current["threads"] = frozenset(t for t in threading.enumerate()
                                        if t is not threading.main_thread())


def leave() -> None:
    _current["item"] = None


def report(item: pytest.Item, rep: pytest.TestReport) -> None:
    """Fail a phase of a unit test that tried to start a process, even if the code under test
    caught the exception."""
    found = item.stash.setdefault(_VIOLATIONS, [])
    if rep.when == "setup" and _current["item"] is item and _current["audit"] is None:
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info else ()):
            for fixturedef in defs:
                if hasattr(fixturedef, _STARTED):
                    found.append(f"uses the fixture {name}, which "
                                 f"{getattr(fixturedef, _STARTED)}")
    if found and rep.outcome != "failed":
        rep.outcome = "failed"
        rep.longrepr = "\n".join(f"unit tier violation: {item.nodeid} is a unit test but {w}; "
                                 f"mark it system (tests/support/tiers.py)" for w in found)
    item.stash[_VIOLATIONS] = []
    _encodable(rep)


def _encodable(rep: pytest.TestReport) -> None:
    """A report's captured output as UTF-8 can carry it: pytest-xdist sends reports from its
    workers as UTF-8, and a lone surrogate (a file name not in UTF-8, logged by the code under
    test) would end the worker with an internal error; such a character is written as its
    backslash escape."""
    def fix(text: str) -> str:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")

    rep.sections = [(fix(title), fix(body)) for title, body in rep.sections]
    if isinstance(rep.longrepr, str):
        rep.longrepr = fix(rep.longrepr)


def finish(config: pytest.Config) -> None:
    """With GPUNET_TIER_AUDIT, write what each test started."""
    folder = _current["audit"]
    if folder is None:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / f"{worker}.json").write_text(json.dumps(_AUDIT, indent=1, sort_keys=True))
