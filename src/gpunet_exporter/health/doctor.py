"""``gpunet-exporter doctor``: a one-off health check of this node, for a person at a terminal, a
Slurm prolog or a node health check.

It runs the collectors the exporter would run (same flags, same config file), reads them twice
``--interval`` seconds apart so counters give rates, waits for the probe's first round when the
probe collector is on, and applies the alert thresholds of gpunet_exporter.mixin.thresholds (the
same values the generated Prometheus rules use; ``--thresholds FILE`` overrides them the same
way, and its ``enabled: {ALERT: false}`` and ``severity`` apply to the findings of each alert
as to the rules). Findings are grouped by root cause, each naming the device and a command that
confirms it.

Exit codes: 0 healthy (or only info findings), 1 findings, 2 could not check (a collector failed,
nothing to check, or bad input). ``--json`` prints one JSON document instead of the report.

Notes say what is worth knowing but no finding: NCCL settings a job makes on purpose, and the
link-downed and carrier-change counts it cannot place in the alerts' windows. They are printed in
their own section (``notes`` in JSON) and never change the exit code. The counters it read go to
a small state file (``--state-file``), so that the next run can count the flaps since this one, as
the flapping alerts count them over hours; by default none when ``--path.sysfs`` is not /sys (a
tree's counters are not this node's). Confirming commands that read /sys or /proc name the trees
it read instead.

The checks are not here: each sits beside the alert it mirrors, in the module of its class under
gpunet_exporter.mixin.alerts (an alert of a simple shape declares its metric, comparison and
threshold once, and both its PromQL and its check derive from that); the types they share
(Snapshot, Check, Finding, Note) are gpunet_exporter.mixin.check. This module takes the two
readings, runs the checks in mixin.alerts.DOCTOR_CHECKS' order, keeps the flap history's state
file and reports.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from gpunet_exporter.collector import Collector, Scrape
from gpunet_exporter.collectors.nccl import NcclCollector
from gpunet_exporter.collectors.probe import ProbeCollector, ProbeSettings
from gpunet_exporter.errors import ConfigError
from gpunet_exporter.files import read_regular
from gpunet_exporter.logs import setup
from gpunet_exporter.mixin.alerts import ALERT_NAMES, DOCTOR_CHECKS
from gpunet_exporter.mixin.alerts.link import FLAP_COUNTERS, flap_key, since_reset
from gpunet_exporter.mixin.check import (
    CAUSES,
    SEVERITY,
    Check,
    Finding,
    Note,
    Snapshot,
    seconds,
)
from gpunet_exporter.mixin.thresholds import Thresholds, load
from gpunet_exporter.options import build_parser, server_only_flags, start_collectors
from gpunet_exporter.probe import idle
from gpunet_exporter.registry import Scraper, discover
from gpunet_exporter.sources.commands import kill_running
from gpunet_exporter.statefile import write_json

__all__ = ["CAUSES", "COULD_NOT_CHECK", "DOCTOR_CHECKS", "JOB_CAUSES", "SEVERITY", "Check",
           "Finding", "Note", "Snapshot", "main", "on_tree", "read_history", "report", "seconds",
           "state_file", "write_history"]

PROG = "gpunet-exporter doctor"
DEFAULT_STATE = "/var/lib/gpunet-exporter/doctor.json"

# Findings that say something could not be checked rather than that something is wrong: alone,
# they make the exit code 2 (could not check), not 1, and each also gives a `problems` entry.
COULD_NOT_CHECK = frozenset({"GpunetPfcConfigUnreadable", "GpunetCheckUnknown"})
# Causes that say something of a job rather than of this node: listed, never the exit code. RAS
# reports the whole job from every node, so a rank killed on one node (out of memory, a user's
# bug) would otherwise fail the health check of every node of the job and drain them all.
JOB_CAUSES = frozenset({"nccl_job"})
HISTORY_KEEP = 64  # observations kept per counter of the state file


def read_history(path: str) -> tuple[dict[str, Any], str | None]:
    """The state file's counters, and a note when it exists but cannot be used."""
    if not path or not os.path.lexists(path):
        return {}, None
    try:
        data = json.loads(read_regular(path))
        if not isinstance(data, dict) or data.get("version") != 1:
            raise ValueError("not a doctor state file of version 1")
        counters = {kind: {str(k): [[float(t), float(v)] for t, v in obs]
                           for k, obs in data.get(kind, {}).items()}
                    for _, _, kind, *_ in FLAP_COUNTERS}
    except (ConfigError, ValueError, TypeError, AttributeError, RecursionError) as exc:
        return {}, f"history {path} ignored ({str(exc) or type(exc).__name__}): no history"
    return counters, None


def _compact(obs: list[list[float]], horizon: float) -> list[list[float]]:
    """The observations worth keeping: of a run of equal values its first and last (a count
    from any of them is the same), and of those older than ``horizon`` (the alert's window)
    only the newest."""
    out = [o for i, o in enumerate(obs)
           if i in (0, len(obs) - 1) or not obs[i - 1][1] == o[1] == obs[i + 1][1]]
    old = [o for o in out if o[0] < horizon]
    return (old[-1:] + [o for o in out if o[0] >= horizon])[-HISTORY_KEEP:]


def write_history(path: str, history: dict[str, Any], b: Snapshot, t: Thresholds) -> str | None:
    """Add this run's counters to the history and write it atomically (a temporary file in the
    same directory, then rename); a note instead of an error when it cannot."""
    if not path:
        return None
    data: dict[str, Any] = {"version": 1, "time": b.time}
    for metric, _, kind, _, window_key, _ in FLAP_COUNTERS:
        horizon = b.time - seconds(getattr(t.infiniband, window_key))
        mine: dict[str, list[list[float]]] = {}
        for lbl, v in b.all(metric):
            key, _ = flap_key(kind, lbl)
            kept = since_reset(history.get(kind, {}).get(key, []), v)
            mine[key] = _compact([*kept, [b.time, v]], horizon)
        # A series not read this time (its collector failed, the netdev is gone for now) keeps
        # its history while that lies within the window.
        for key, obs in history.get(kind, {}).items():
            if key not in mine and obs and obs[-1][0] >= horizon:
                mine[key] = _compact(obs, horizon)
        data[kind] = mine
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
        write_json(path, data)
    except OSError as exc:
        return (f"cannot record the counters in {path} ({exc.strerror or exc}): the next run "
                "has no history")
    return None


def state_file(given: str | None, sysfs: str) -> tuple[str, str | None]:
    """The state file to use, and a note when none is kept because the doctor reads a tree that
    is not this node's /sys (a fixture, a copy from another node): its counters would be
    compared with the next real run's. An explicit ``--state-file`` is used as given."""
    if given is not None:
        return given, None
    if os.path.realpath(sysfs) == "/sys":
        return DEFAULT_STATE, None
    return "", (f"none kept: --path.sysfs {sysfs} is not /sys, so no flap history is read or "
                "written (--state-file FILE keeps one)")


_SYS = re.compile(r"(?<![\w./-])/sys(?=/|\b)")
_PROC = re.compile(r"(?<![\w./-])/proc(?=/|\b)")


def on_tree(command: str, sysfs: str, procfs: str) -> str:
    """A confirming command that reads files of /sys or /proc, naming the --path.sysfs and
    --path.procfs trees the doctor read instead when they are others (quoted for the shell)."""
    for pattern, path, default in ((_SYS, sysfs, "/sys"), (_PROC, procfs, "/proc")):
        if path.rstrip("/") != default:
            # A literal replacement, not a template: a path's backslashes stay as they are.
            command = pattern.sub(shlex.quote(path.rstrip("/") or "/").replace("\\", "\\\\"),
                                  command)
    return command


def _progress(quiet: bool, message: str) -> None:
    if not quiet:
        print(f"doctor: {message}", file=sys.stderr, flush=True)


def _wait_for_probe(probe: Collector, timeout: float, quiet: bool) -> None:
    """Until the probe collector has a result of the scope a round ends with (net, the NICs;
    intra when net is not configured). It only reads its cache, so asking it alone is cheap;
    the other collectors are not run meanwhile."""
    scopes = probe.settings.scopes if isinstance(probe.settings, ProbeSettings) else ()
    last = "net" if "net" in scopes else (scopes[-1] if scopes else "intra")
    _progress(quiet, f"waiting for the probe's round (up to {timeout:g} s)")
    if isinstance(probe, ProbeCollector):
        # The doctor asks for a round now: no hold-off, but never beside a job.
        probe.supervisor.gate.holdoff = 0.0
    deadline = time.monotonic() + timeout
    asked = time.time()
    while time.monotonic() < deadline:
        s = Snapshot(probe.collect(Scrape()))
        # A round of this check, not an earlier one's file left in the state directory.
        if (s.get("gpunet_probe_last_round_timestamp_seconds", scope=last) or 0) >= asked:
            return
        for state in (idle.YIELDED, idle.UNKNOWN):
            if s.get("gpunet_probe_state", state=state) == 1:
                _progress(quiet, f"the probe is {state}: no round")
                return
        time.sleep(0.5)
    _progress(quiet, "no probe result in time; the probe is not checked")


def report(findings: list[Finding], checked: dict[str, bool], problems: list[str],
           runbook_url: str, notes: Sequence[Note] = (),
           severity: Mapping[str, str] | None = None,
           unknown: Mapping[str, Sequence[str]] | None = None) -> str:
    """The report for a person; ``severity`` (alert -> severity) replaces the alerts' own, as
    a thresholds file's ``severity`` does; ``unknown`` (collector -> checks that could not run)
    turns a collector's "ok" into "UNKNOWN", as on the landing page."""
    severity, unknown = severity or {}, unknown or {}
    lines = []
    if findings:
        lines.append(f"{len(findings)} finding{'s' * (len(findings) != 1)} on this node:")
        for cause, title in CAUSES.items():
            mine = [f for f in findings if f.cause == cause]
            if not mine:
                continue
            lines += ["", title]
            for f in mine:
                lines.append(f"  [{severity.get(f.alert, f.severity)}] {f.where}: {f.message}")
                lines.append(f"      confirm: {f.confirm}")
                lines.append(f"      runbook: {runbook_url}#{f.alert.lower()} (alert {f.alert})")
    else:
        lines.append("No findings on this node.")
    if notes:
        lines += ["", "Notes (no finding, no effect on the exit code):"]
        lines += [f"  {n.where}: {n.message}" for n in notes]
    lines.append("")
    def state(name: str, ok: bool) -> str:
        if not ok:
            return "FAILED"
        return f"UNKNOWN: {', '.join(unknown[name])} not checked" if unknown.get(name) else "ok"

    lines.append("Checked: " + ", ".join(
        f"{name} ({state(name, ok)})" for name, ok in checked.items()))
    lines += [f"Could not check: {p}" for p in problems]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    classes = discover()
    parser = build_parser(classes, server=False)
    parser.prog = PROG
    parser.usage = None
    parser.description = ("Check this node once and report what would alert, grouped by root "
                          "cause. Exit 0 healthy, 1 findings, 2 could not check.")
    d = parser.add_argument_group("doctor")
    d.add_argument("--thresholds", metavar="FILE",
                   help="YAML file overriding alert thresholds, as for gpunet-rules (default: the "
                        "built-in thresholds)")
    d.add_argument("--json", action="store_true",
                   help="print the findings as JSON (default: a report for a person)")
    d.add_argument("--interval", type=float, default=5.0, metavar="SECONDS",
                   help="time between the two readings that give counter rates (default 5)")
    d.add_argument("--probe", action="store_true",
                   help="run one probe round through this node's NICs (the probe collector's "
                        "net scope; intra too with two GPUs or more) and check it; needs torch "
                        "(pip install 'gpunet-exporter[probe]') (default: only when the probe "
                        "collector is on)")
    d.add_argument("--state-file", default=None, metavar="FILE",
                   help="where the doctor records the link-downed and carrier-change counters "
                        "it read, so the next run counts the flaps since this one; empty: "
                        f"no history (default {DEFAULT_STATE}; none when --path.sysfs is not "
                        "/sys: a tree's counters are not this node's)")
    d.add_argument("--probe-wait", type=float, default=120.0, metavar="SECONDS",
                   help="how long to wait for the probe's round when the probe is on "
                        "(default 120)")
    server = server_only_flags(classes)
    for arg in argv:
        if arg == "--":
            break
        if arg.partition("=")[0] in server:
            parser.error(f"{arg.partition('=')[0]} is a flag of the exporter service; the doctor "
                         "serves nothing and takes only the flags that say what to read")
    args = parser.parse_args(argv)
    setup("error" if args.log_level == "info" else args.log_level, args.log_format)
    if args.interval <= 0 or args.probe_wait < 0:
        parser.error("--interval must be positive and --probe-wait not negative")
    try:
        t = load(args.thresholds, ALERT_NAMES)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    early: list[str] = []
    if args.probe:
        if importlib.util.find_spec("torch") is None:
            early.append("the probe needs torch: pip install 'gpunet-exporter[probe]'")
        else:
            args.enable__probe = True
    collectors, _, enabled = start_collectors(args, classes, parser, learn=False)
    scraper = Scraper(collectors, args.scrape_timeout)
    quiet = args.json
    try:
        _progress(quiet, f"reading {', '.join(collectors) or 'no collectors'}")
        a = Snapshot(scraper.collect())
        if "probe" in collectors:
            _wait_for_probe(collectors["probe"], args.probe_wait, quiet)
        _progress(quiet, f"reading counters again in {args.interval:g} s for their rates")
        time.sleep(args.interval)
        nccl = collectors.get("nccl")
        if isinstance(nccl, NcclCollector):
            # A second RAS report now: what shows a stuck rank is counts compared across two.
            _progress(quiet, "asking NCCL's RAS service for a second report")
            nccl.refresh()
        b = Snapshot(scraper.collect())
    finally:
        scraper.close()
        kill_running()
    state, untracked = state_file(args.state_file, args.sysfs)
    check = Check(a, b, t)
    check.history, unreadable = read_history(state)
    for fn in DOCTOR_CHECKS:
        fn(check)
    unwritable = write_history(state, check.history, b, t)
    notes = check.notes + [Note("state file", n) for n in (untracked, unreadable, unwritable)
                           if n]
    checked = {lbl["collector"]: v == 1 for lbl, v in b.all("gpunet_scrape_collector_success")}
    problems = early + [f"collector {n} failed" for n, ok in checked.items() if not ok]
    problems += check.problems
    if args.probe and b.get("gpunet_probe_state", state=idle.YIELDED) == 1:
        problems.append("probe: --probe asked for a round, but a job's processes are on the GPUs")
    problems += [f"collector {n} did not start" for n in enabled if n not in collectors]
    hardware = any(b.all("gpunet_infiniband_port_state_id")) or any(b.all("gpunet_gpu_info"))
    if not hardware:
        problems.append("no RDMA port and no NVIDIA GPU found")
    # The alerts a thresholds file turns off are not reported; those whose severity it
    # changes are reported with the file's. Confirm commands name the trees read.
    findings = [dataclasses.replace(f, confirm=on_tree(f.confirm, args.sysfs, args.procfs))
                for f in check.findings if t.enabled(f.alert)]
    severity = {f.alert: t.severity(f.alert, f.severity) for f in findings}
    # Info findings (a hint such as the network-bound band, routed to no receiver by the
    # example Alertmanager configuration) are listed but do not fail a health check; nor do
    # findings that say something could not be checked (they are problems: exit 2), nor those
    # of a job (JOB_CAUSES).
    faults = [f for f in findings if severity[f.alert] != "info" and f.alert not in COULD_NOT_CHECK
              and f.cause not in JOB_CAUSES]
    code = 1 if faults else (2 if problems else 0)
    if args.json:
        print(json.dumps({"status": ("findings", "healthy", "could_not_check")[
            (code == 0) + 2 * (code == 2)], "exit_code": code,
            # fault: whether the finding counts towards exit code 1 (what a Slurm gate
            # drains for: slurm/gpunet-healthcheck names the first one in the reason).
            "findings": [{**asdict(f), "severity": severity[f.alert], "fault": f in faults}
                         for f in findings],
            "checked": checked, "problems": problems, "notes": [asdict(n) for n in notes]},
            indent=1))
    else:
        unknown: dict[str, list[str]] = {}
        for lbl, v in b.all("gpunet_check_unknown"):
            if v == 1:
                unknown.setdefault(lbl["collector"], []).append(lbl["check"])
        sys.stdout.write(report(findings, checked, problems, t.runbook_url, notes, severity,
                                unknown))
    return code

