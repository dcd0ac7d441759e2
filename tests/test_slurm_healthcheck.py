"""slurm/gpunet-healthcheck, the Slurm gate around `gpunet-exporter doctor` (docs/doctor.md,
"A Slurm gate").

Under a real Slurm (Debian slurm-wlm 22.05, tests/support/slurm.py: two slurmd nodes in their
own namespaces) whose slurm.conf names the script as HealthCheckProgram, Prolog and Epilog, as
an administrator would, through a stand-in for what the administrator installs beside it
(SHIM: the node's settings file and SLURM_CONF; no PATH, as Slurm gives none). The doctor is the
installed one, on the example trees: examples/dgx-h100 (healthy) and examples/dgx-h100-faulty
(mlx5_3 down first, then two more faults), with a tiny gloo probe round when it probes.

Without a cluster: the script's arguments and settings, its exit codes where scontrol fails,
the drain reason it makes of the doctor's JSON and the doctor's time budget, through a
stand-in doctor (FAKE_DOCTOR)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from support import netns, slurm
from support.exporter import exporter_binary
from support.paths import REPO
from support.wait import wait_for

SCRIPT = REPO / "slurm" / "gpunet-healthcheck"
HEALTHY = REPO / "examples" / "dgx-h100" / "sys"
FAULTY = REPO / "examples" / "dgx-h100-faulty" / "sys"
# The faulty tree's three faults with the infiniband and link collectors, the first critical
# one named, in the doctor's own words.
FIRST = "gpunet: mlx5_3 port 1: not ACTIVE/LinkUp (state 1, physical state 3) (+2 more)"
HEALTH_CHECK_INTERVAL = 5  # slurm.conf HealthCheckInterval, seconds
# What the administrator installs beside the script: the node's settings (here one file per
# node and script context, and nothing runs without one) and, here only, SLURM_CONF (a real
# node's scontrol finds /etc/slurm/slurm.conf). No PATH: the script runs with Slurm's
# environment. Each run's output and exit status go to a file of their own (runs overlap when
# one takes longer than HealthCheckInterval).
SHIM = """\
#!/bin/sh
ctx=${{SLURM_SCRIPT_CONTEXT:-health_check}}
settings={gate}/$SLURMD_NODENAME-$ctx.conf
[ -f "$settings" ] || exit 0
mkdir -p {gate}/$SLURMD_NODENAME-$ctx.runs
out={gate}/$SLURMD_NODENAME-$ctx.runs/$$
export SLURM_CONF={conf} GPUNET_HEALTHCHECK_SETTINGS="$settings"
{script} > "$out.part" 2>&1
rc=$?
echo "exit $rc" >> "$out.part"
mv "$out.part" "$out"
exit $rc
"""
LOGGER = """\
#!/bin/sh
echo "$*" >> {log}
"""
# The probe's round when the doctor probes: gloo on the CPU, one rank pair, one small size.
# straggler_min_ratio 1: no rank is named late. Four 4 KiB all-reduces of gloo ranks on two
# busy cores are a scheduler's lottery (one such run found 68% of the time spent waiting for one
# rank, and the healthy node was drained); what these tests judge is the script, not the probe.
PROBE = """\
link:
  ibv_devinfo: {enabled: false}  # the tree's MTUs are not what these tests judge
probe:
  backend: gloo
  nprocs: 1
  sizes: [4096]
  warmup: 1
  iterations: 4
  straggler_min_ratio: 1
"""


def doctor_settings(tree: Path, gate: Path, **more: str) -> dict[str, str]:
    return {"GPUNET_DOCTOR": f"{exporter_binary()} doctor",
            "GPUNET_DOCTOR_CONFIG": str(gate / "probe.yml"),
            "GPUNET_DOCTOR_ARGS": f"--path.sysfs={tree} --collector.disable-defaults "
                                  "--collector.infiniband --collector.link",
            "GPUNET_HEALTHCHECK_INTERVAL": "0.5",
            "GPUNET_HEALTHCHECK_LOGGER": str(gate / "logger"), **more}


@dataclass(frozen=True)
class Run:
    rc: int
    text: str


@dataclass
class Gate:
    c: slurm.Cluster
    dir: Path
    jobs: list[str] = field(default_factory=list)

    def arm(self, node: str, ctx: str, tree: Path, **more: str) -> None:
        """From the next start in this context on, the node runs the script with these
        settings; earlier runs are over and forgotten."""
        (self.dir / f"{node}-{ctx}.conf").unlink(missing_ok=True)
        self.quiet([n for n in self.c.nodes if n.name == node])
        runs = self.dir / f"{node}-{ctx}.runs"
        for f in runs.glob("*") if runs.exists() else ():
            f.unlink()
        (self.dir / f"{node}-{ctx}.conf").write_text("".join(
            f"{k}={shlex.quote(v)}\n" for k, v in doctor_settings(tree, self.dir, **more).items()))

    def runs(self, node: str, ctx: str) -> list[Run]:
        runs = self.dir / f"{node}-{ctx}.runs"
        out = []
        done = [f for f in runs.glob("[0-9]*") if f.suffix != ".part"]  # moved there complete
        for f in sorted(done, key=lambda p: p.stat().st_mtime_ns):
            text = f.read_text()
            out.append(Run(int(text.rsplit("exit ", 1)[1]), text))
        return out

    def run(self, node: str, ctx: str = "health_check", timeout: float = 90) -> Run:
        """The first complete run since arming."""
        runs = wait_for(lambda: self.runs(node, ctx), f"a {ctx} run of the script on {node}",
                        timeout=timeout, interval=0.5)
        return runs[0]

    def node(self, name: str) -> dict[str, str]:
        """State and Reason as `scontrol show node` gives them."""
        r = self.c.run(["scontrol", "-o", "show", "node", name])
        assert r.returncode == 0, r.stderr
        state = re.search(r"\bState=(\S+)", r.stdout)
        reason = r.stdout.split(" Reason=", 1)[1].strip() if " Reason=" in r.stdout else ""
        return {"State": state.group(1) if state else "", "Reason": reason}

    def scontrol(self, *args: str) -> None:
        r = self.c.run(["scontrol", *args])
        assert r.returncode == 0, r.stderr

    def job(self, *args: str) -> str:
        r = self.c.run(["sbatch", "--parsable", f"--output={self.c.root}/job-%j.out", *args],
                       cwd=self.c.root)
        assert r.returncode == 0, r.stderr
        self.jobs.append(r.stdout.strip())
        return self.jobs[-1]

    def syslog(self) -> str:
        path = self.dir / "syslog.log"
        return path.read_text() if path.exists() else ""

    def quiet(self, nodes: Sequence[slurm.SlurmNode]) -> None:
        """Wait until no run of SHIM (and so of the script) is left on these nodes."""
        def running() -> list[int]:
            out = []
            for pid in [p for n in nodes for p in netns.pids_in(n.net.ns)]:
                with contextlib.suppress(OSError):
                    if b"gpunet-healthcheck" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        out.append(pid)
            return out

        wait_for(running, "the script's runs in flight to end", timeout=120, interval=0.5,
                 until_empty=True)

    def reset(self) -> None:
        """Disarm every node, wait for runs in flight, cancel the jobs, resume what drained."""
        for f in self.dir.glob("*.conf"):
            f.unlink()
        self.quiet(self.c.nodes)
        for job in self.jobs:
            self.c.run(["scancel", job])
        self.jobs.clear()
        wait_for(lambda: not self.c.run(["squeue", "-h"]).stdout.strip(), "no job left",
                 timeout=60, interval=0.5)
        for n in self.c.nodes:
            if "DRAIN" in self.node(n.name)["State"]:
                self.scontrol("update", f"nodename={n.name}", "state=RESUME")
        (self.dir / "syslog.log").unlink(missing_ok=True)
        wait_for(lambda: set(self.c.node_states().values()) == {"idle"}, "every node idle",
                 timeout=60, interval=0.5)


def slurm_lines(root: Path) -> list[str]:
    gate = root / "gate"
    gate.mkdir()
    shim = gate / "gpunet-healthcheck"
    shim.write_text(SHIM.format(gate=gate, conf=root / "slurm.conf", script=SCRIPT))
    logger = gate / "logger"
    logger.write_text(LOGGER.format(log=gate / "syslog.log"))
    (gate / "probe.yml").write_text(PROBE)
    for f in (shim, logger):
        f.chmod(0o755)
    return [f"HealthCheckProgram={shim}", f"HealthCheckInterval={HEALTH_CHECK_INTERVAL}",
            f"Prolog={shim}", f"Epilog={shim}"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm.Cluster]:
    slurm.require()
    with slurm.cluster(2, extra_conf=slurm_lines) as c:
        yield c


@pytest.fixture
def gate(cluster: slurm.Cluster) -> Iterator[Gate]:
    g = Gate(cluster, cluster.root / "gate")
    try:
        yield g
    finally:
        g.reset()


def probe_result(c: slurm.Cluster, node: int, forget: bool = False) -> bool:
    """Whether the node's probe has written a net-scope result (in its own
    /var/lib/gpunet-exporter/probe); ``forget``: remove it first (the doctor takes a result
    there for the round it waits for)."""
    path = c.nodes[node].state / "probe" / "net.json"
    if forget:
        path.unlink(missing_ok=True)
    return path.exists()


# -- under Slurm ------------------------------------------------------------------------------

def test_health_check_drains_a_faulty_node_naming_its_first_finding(gate: Gate) -> None:
    probe_result(gate.c, 0, forget=True)
    gate.arm("n0", "health_check", FAULTY)
    run = gate.run("n0")
    assert run.rc == 0, run.text  # drained: done, as HealthCheckProgram
    assert "health_check (IDLE; with probe;" in run.text, run.text
    assert f"drained: {FIRST}" in run.text, run.text
    node = gate.node("n0")
    assert "DRAIN" in node["State"] and node["Reason"].startswith(FIRST + " ["), node
    assert probe_result(gate.c, 0)  # the probe's round ran on the idle node
    assert "n0: health_check (IDLE; with probe;" in gate.syslog()
    assert "Traceback" not in run.text


def test_health_check_leaves_a_healthy_node_alone(gate: Gate) -> None:
    probe_result(gate.c, 1, forget=True)
    gate.arm("n1", "health_check", HEALTHY)
    run = gate.run("n1")
    assert run.rc == 0, run.text
    assert re.search(r"health_check \(IDLE; with probe; \d+ s\): healthy\n", run.text), run.text
    assert "drain" not in run.text
    assert probe_result(gate.c, 1)
    assert gate.node("n1") == {"State": "IDLE", "Reason": ""}


def test_no_probe_while_a_job_holds_the_node(gate: Gate) -> None:
    """The health check of a node that runs a job: the doctor without --probe (the probe never
    shares GPUs with a job), and still a verdict."""
    gate.job("--exclusive", "-w", "n1", "--wrap", "sleep 600")
    wait_for(lambda: gate.c.node_states().get("n1") == "alloc", "the job on n1", timeout=30)
    probe_result(gate.c, 1, forget=True)
    gate.arm("n1", "health_check", FAULTY)
    run = gate.run("n1")
    assert "health_check (ALLOCATED; no probe;" in run.text, run.text
    assert f"drained: {FIRST}" in run.text and run.rc == 0, run.text
    assert not probe_result(gate.c, 1)
    assert gate.node("n1")["State"] == "ALLOCATED+DRAIN"  # the job runs on; no new one comes


def test_a_node_drained_by_someone_else_is_left_alone(gate: Gate) -> None:
    reason = "cable swap, ticket 4711"
    gate.scontrol("update", "nodename=n0", "state=DRAIN", f"reason={reason}")
    gate.arm("n0", "health_check", FAULTY, GPUNET_HEALTHCHECK_UNDRAIN="1")
    run = gate.run("n0")
    assert run.rc == 0 and "by someone else (reason: cable swap, ticket 4711 [root@" in run.text
    assert f"left alone: {FIRST}" in run.text, run.text
    assert gate.node("n0")["Reason"].startswith(reason + " [")
    # Healthy, with GPUNET_HEALTHCHECK_UNDRAIN=1: only a drain of ours is lifted.
    gate.arm("n0", "health_check", HEALTHY, GPUNET_HEALTHCHECK_UNDRAIN="1")
    run = gate.run("n0")
    assert run.rc == 0 and "healthy" in run.text and "lifted" not in run.text, run.text
    node = gate.node("n0")
    assert node["State"] == "IDLE+DRAIN" and node["Reason"].startswith(reason + " ["), node


def test_our_drain_is_lifted_only_when_asked(gate: Gate) -> None:
    ours = "gpunet: mlx5_3 port 1: not ACTIVE/LinkUp (state 1, physical state 3)"
    gate.scontrol("update", "nodename=n1", "state=DRAIN", f"reason={ours}")
    gate.arm("n1", "health_check", HEALTHY)  # GPUNET_HEALTHCHECK_UNDRAIN=0, the default
    run = gate.run("n1")
    assert run.rc == 0 and "healthy" in run.text and "lifted" not in run.text, run.text
    assert gate.node("n1")["Reason"].startswith(ours + " [")
    gate.arm("n1", "health_check", HEALTHY, GPUNET_HEALTHCHECK_UNDRAIN="1")
    run = gate.run("n1")
    assert run.rc == 0 and f"lifted our drain ({ours} [root@" in run.text, run.text
    # RESUME leaves it IDLE+NOT_RESPONDING until slurmd registers again.
    wait_for(lambda: gate.node("n1") == {"State": "IDLE", "Reason": ""}, "n1 back in service",
             timeout=30, interval=0.5)


def test_could_not_check_is_logged_and_drains_only_when_asked(gate: Gate,
                                                                tmp_path: Path) -> None:
    empty = tmp_path / "sys"
    (empty / "class" / "infiniband").mkdir(parents=True)
    (empty / "class" / "net").mkdir(parents=True)
    gate.arm("n0", "health_check", empty)
    run = gate.run("n0")
    why = "no RDMA port and no NVIDIA GPU found"
    assert run.rc == 0 and f"could not check: {why}" in run.text, run.text
    assert "-p daemon.err -- n0: health_check (IDLE; with probe;" in gate.syslog()
    assert gate.node("n0") == {"State": "IDLE", "Reason": ""}
    gate.arm("n0", "health_check", empty, GPUNET_HEALTHCHECK_DRAIN_ON_UNKNOWN="1")
    run = gate.run("n0")
    assert run.rc == 0, run.text
    assert gate.node("n0")["Reason"].startswith(f"gpunet: could not check: {why} [")


def test_epilog_probes_the_idle_node_and_drains_with_our_reason(gate: Gate) -> None:
    """The Epilog: the job ended, the node is IDLE+COMPLETING, so the doctor probes; findings
    drain with our reason and the Epilog exits 0 (a failing Epilog would drain it as "Epilog
    error")."""
    gate.arm("n0", "epilog_slurmd", FAULTY)
    probe_result(gate.c, 0, forget=True)
    gate.job("-w", "n0", "--wrap", "true")
    run = gate.run("n0", "epilog_slurmd")
    assert run.rc == 0, run.text
    assert "epilog (IDLE+COMPLETING; with probe;" in run.text, run.text
    assert gate.node("n0")["Reason"].startswith(FIRST + " [")
    assert probe_result(gate.c, 0)


def test_prolog_drains_and_fails_so_the_job_is_requeued(gate: Gate) -> None:
    """The Prolog: no probe (the job holds the node, GPUNET_HEALTHCHECK_PROBE leaves the prolog
    out by default); findings drain with our reason and exit 1, so Slurm requeues the job
    instead of starting it on the node (held: SchedulerParameters=nohold_on_prolog_fail lets
    it run elsewhere), and keeps our reason."""
    gate.arm("n1", "prolog_slurmd", FAULTY)
    job = gate.job("-w", "n1", "--wrap", "true")
    run = gate.run("n1", "prolog_slurmd")
    assert run.rc == 1, run.text
    assert "prolog (ALLOCATED; no probe;" in run.text, run.text
    wait_for(lambda: gate.node("n1")["Reason"].startswith(FIRST + " ["),
             "n1 drained with our reason", timeout=30, interval=0.5)
    # Requeued: PENDING once slurmctld has finished with the failed launch (on busy cores it
    # first shows COMPLETING, "launch failed requeued held", for a moment).
    wait_for(lambda: gate.c.run(["squeue", "-h", "-j", job, "-o", "%T %r"]).stdout.split()[:1]
             == ["PENDING"], f"job {job} requeued (PENDING)", timeout=30, interval=0.5)
    assert gate.node("n1")["Reason"].startswith(FIRST + " [")  # not "Prolog error"


# -- without a cluster ------------------------------------------------------------------------

FAKE_DOCTOR = """\
import json, os, sys, time
with open(os.environ["FAKE_DOCTOR_ARGV"], "w") as f:
    json.dump(sys.argv[1:], f)
time.sleep(float(os.environ.get("FAKE_DOCTOR_SLEEP", "0")))
sys.stdout.write(os.environ.get("FAKE_DOCTOR_OUT", ""))
sys.exit(int(os.environ.get("FAKE_DOCTOR_EXIT", "0")))
"""


@pytest.fixture
def script(tmp_path: Path) -> Any:
    """Run the script with only the environment given, a stand-in doctor recording its
    arguments, no syslog and a stand-in scontrol first on PATH that fails at once (no Slurm:
    nothing is drained)."""
    doctor = tmp_path / "doctor.py"
    doctor.write_text(FAKE_DOCTOR)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir()
    scontrol.write_text("#!/bin/sh\necho 'scontrol: error: no Slurm here' >&2\nexit 1\n")
    scontrol.chmod(0o755)

    def run(*args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
        argv_file = tmp_path / "argv.json"
        argv_file.unlink(missing_ok=True)
        full = {"PATH": f"{scontrol.parent}:{os.environ['PATH']}", "SLURMD_NODENAME": "gpu07",
                "GPUNET_HEALTHCHECK_SETTINGS": str(tmp_path / "settings"),
                "GPUNET_DOCTOR": f"{sys.executable} {doctor}", "GPUNET_HEALTHCHECK_LOGGER": "",
                "FAKE_DOCTOR_ARGV": str(argv_file), **env}
        r = subprocess.run([str(SCRIPT), *args], env=full, capture_output=True, text=True,
                           timeout=60)
        return r, json.loads(argv_file.read_text()) if argv_file.exists() else []

    return run


def one_line_error(r: subprocess.CompletedProcess[str], text: str) -> None:
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and text in r.stderr, r.stderr


@pytest.mark.parametrize(("args", "env", "text"), [
    (["--bogus"], {}, "unexpected argument '--bogus': it takes none"),
    (["--probe"], {}, "unexpected argument '--probe'"),
    ([], {"GPUNET_HEALTHCHECK_BUDGET": "soon"}, "GPUNET_HEALTHCHECK_BUDGET='soon': not a number"),
    ([], {"GPUNET_HEALTHCHECK_DRAIN_ON_UNKNOWN": "maybe"}, "0 or 1"),
    ([], {"GPUNET_HEALTHCHECK_PROBE": "always"}, "a comma-separated list of health_check"),
    ([], {"GPUNET_DOCTOR_ARGS": "--thresholds t.yml --probe"}, "must not turn the probe on"),
    ([], {"GPUNET_DOCTOR_ARGS": "--thresholds 'unclosed"}, "cannot be split into arguments"),
    ([], {"SLURM_SCRIPT_CONTEXT": "epilog_slurmctld"}, "runs on the compute node only"),
])
def test_bad_input_one_line_exit_2(script: Any, args: list[str], env: dict[str, str],
                                   text: str) -> None:
    r, doctor = script(*args, **env)
    one_line_error(r, text)
    assert doctor == []  # nothing ran


def test_bad_settings_file_one_line_exit_2(script: Any, tmp_path: Path) -> None:
    (tmp_path / "settings").write_text("# site settings\nGPUNET_HEALTHCHECK_BUDGET=30\n"
                                       "GPUNET_HEALTHCHEK_UNDRAIN=1\n")
    r, _ = script()
    one_line_error(r, f"settings file {tmp_path / 'settings'}, line 3: expected NAME=value")


def test_help_lists_every_setting(script: Any) -> None:
    r, doctor = script("--help")
    assert r.returncode == 0 and r.stderr == "" and doctor == []
    for name in ("GPUNET_DOCTOR", "GPUNET_DOCTOR_CONFIG", "GPUNET_DOCTOR_ARGS",
                 "GPUNET_HEALTHCHECK_BUDGET=40", "GPUNET_HEALTHCHECK_JOB_BUDGET=90",
                 "GPUNET_HEALTHCHECK_PROBE=health_check,epilog",
                 "GPUNET_HEALTHCHECK_DRAIN_ON_UNKNOWN=0", "GPUNET_HEALTHCHECK_UNDRAIN=0",
                 "GPUNET_HEALTHCHECK_SETTINGS=/etc/default/gpunet-healthcheck"):
        assert f"  {name}" in r.stdout


def finding(alert: str, severity: str, where: str, message: str,
            fault: bool = True) -> dict[str, Any]:
    return {"cause": "x", "alert": alert, "severity": severity, "where": where,
            "message": message, "confirm": "true", "fault": fault}


def test_reason_names_the_first_fault_of_the_highest_severity(script: Any, tmp_path: Path) -> None:
    """Info and job findings (fault false) are skipped, a critical one goes before an earlier
    warning, the reason is one line without double quotes and at most 200 characters, and when
    scontrol cannot drain the script exits 1."""
    report = {"status": "findings", "exit_code": 1, "checked": {}, "problems": [], "notes": [],
              "findings": [
                  finding("GpunetGpusNetworkBoundBand", "info", "node", "band", fault=False),
                  finding("GpunetNcclRankDead", "warning", "NCCL job", "dead", fault=False),
                  finding("GpunetRoceMtuTooSmall", "warning", "enp41s0f0np0", "MTU 1500"),
                  finding("GpunetPortDown", "critical", "mlx5_3 port 1",
                          'not "ACTIVE"\nsecond line ' + "x" * 300),
                  finding("GpunetPortDown", "critical", "mlx5_4 port 1", "down")]}
    r, _ = script(FAKE_DOCTOR_OUT=json.dumps(report), FAKE_DOCTOR_EXIT="1")
    assert r.returncode == 1, r.stderr  # the drain failed: Slurm's own handling takes over
    [line] = [x for x in r.stderr.splitlines() if "could not drain" in x]
    reason = line.split("): ", 1)[1]
    assert reason.startswith("gpunet: mlx5_3 port 1: not 'ACTIVE' second line xxx")
    assert reason.endswith("... (+2 more)") and len(reason) == 200, reason
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("env", "rc", "says"), [
    ({"FAKE_DOCTOR_OUT": '{"status": "healthy", "findings": []}'}, 0, ": healthy"),
    ({"FAKE_DOCTOR_OUT": '{"status": "could_not_check", "problems": ["collector link failed"]}',
      "FAKE_DOCTOR_EXIT": "2"}, 0, "could not check: collector link failed"),
    ({"FAKE_DOCTOR_EXIT": "1"}, 0, "could not check: the doctor exited 1 without its report"),
    ({"FAKE_DOCTOR_SLEEP": "30", "GPUNET_HEALTHCHECK_BUDGET": "1"}, 0,
     "could not check: the doctor did not finish within 1 s"),
    ({"GPUNET_DOCTOR": "/nonexistent/gpunet-exporter doctor"}, 0,
     "could not check: cannot run /nonexistent/gpunet-exporter"),
    ({"FAKE_DOCTOR_OUT": '{"status": "could_not_check", "problems": ["collector link failed"]}',
      "FAKE_DOCTOR_EXIT": "2", "GPUNET_HEALTHCHECK_DRAIN_ON_UNKNOWN": "1"}, 1,
     "could not drain"),
])
def test_exit_codes(script: Any, env: dict[str, str], rc: int, says: str) -> None:
    """0 when the outcome is handled (a crash of the doctor or one past its budget is "could
    not check", never findings), 1 when a drain that should happen fails."""
    r, _ = script(**env)
    assert r.returncode == rc and says in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_doctor_arguments_and_budget(script: Any, tmp_path: Path) -> None:
    """The doctor's wait for the probe fits the budget (budget - interval - 12 s for its
    start and two readings); the probe is off where the node's state is unknown; the extra
    arguments come last; --config.file only when the file is there."""
    healthy = '{"status": "healthy", "findings": []}'
    _, argv = script(FAKE_DOCTOR_OUT=healthy, GPUNET_DOCTOR_ARGS="--thresholds t.yml")
    assert argv == ["--json", "--interval", "2", "--probe-wait", "26", "--no-collector.probe",
                    "--thresholds", "t.yml"]
    cfg = tmp_path / "gpunet.yml"
    cfg.write_text("{}\n")
    _, argv = script(FAKE_DOCTOR_OUT=healthy, SLURM_SCRIPT_CONTEXT="epilog_slurmd",
                     GPUNET_DOCTOR_CONFIG=str(cfg), GPUNET_HEALTHCHECK_INTERVAL="5")
    assert argv == ["--json", "--interval", "5", "--probe-wait", "73", "--config.file", str(cfg),
                    "--no-collector.probe"]
    # The Prolog probes only when asked, and then without asking Slurm's state.
    _, argv = script(FAKE_DOCTOR_OUT=healthy, SLURM_SCRIPT_CONTEXT="prolog_slurmd",
                     GPUNET_HEALTHCHECK_PROBE="prolog,epilog")
    assert "--probe" in argv
