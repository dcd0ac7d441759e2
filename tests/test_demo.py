"""examples/demo.py as a user runs it: the virtualenv's Python, a subprocess, real Prometheus and
Alertmanager. On the faulty tree exactly the expected alerts fire, each reaching the receiver its
severity routes it to or inhibited by the port-down alert; on the healthy tree nothing fires.
Nothing it started outlives it, also when interrupted, and a missing binary is one clear line.

The faulty and healthy runs go side by side (one fixture); with the Ctrl-C run that still takes
about 30 s, so those tests are marked slow.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.paths import REPO
from support.wait import wait_for

DEMO = REPO / "examples" / "demo.py"
TIMEOUT = 240  # seconds a demo run may take here; it waits up to 90 s for the alerts itself

# alert, device or interface -> severity, what Alertmanager did with it
EXPECTED = {
    ("GpunetPortDown", "mlx5_3"): ("critical", "-> pager"),
    ("GpunetPortRateBelowExpected", "mlx5_5"): ("critical", "-> pager"),
    ("GpunetRoceMtuTooSmall", "enp41s0f0np0"): ("warning", "-> ticket"),
    ("GpunetInterfaceMtuNotExpected", "enp41s0f0np0"): ("warning", "-> ticket"),
    ("GpunetRdmaMtuNotExpected", "mlx5_8"): ("warning", "-> ticket"),
    ("GpunetPfcDisabledOnRocePriority", "enp170s0f0np0"): ("critical", "-> pager"),
    ("GpunetPfcTrustNotExpected", "enp170s0f0np0"): ("warning", "-> ticket"),
    ("GpunetPortSymbolErrors", "mlx5_1"): ("warning", "-> ticket"),
    ("GpunetPortReceiveErrors", "mlx5_1"): ("warning", "-> ticket"),
    ("GpunetPortLinkErrorRecoveries", "mlx5_6"): ("warning", "-> ticket"),
    ("GpunetPortFlapping", "mlx5_3"): ("warning", "inhibited by GpunetPortDown"),
    ("GpunetInterfaceFlapping", "ibp94s0"): ("warning", "inhibited by GpunetPortDown"),
    ("GpunetTransceiverRxPowerLow", "enp170s0f0np0"): ("warning", "-> ticket"),
    ("GpunetTransceiverTemperatureHigh", "enp41s0f0np0"): ("warning", "-> ticket"),
    ("GpunetNicHealthReporterError", "mlx5_7"): ("warning", "-> ticket"),
}
# "  critical  GpunetPortDown   mlx5_3 port 1 (ibp94s0)   -> pager", then the description
ALERT_LINE = re.compile(r"^  (critical|warning|info) +(Gpunet\w+) +(\S+)(?: port \d+)?"
                        r"(?: \(\S+\))? +(-> .+|inhibited by .+|in Alertmanager .+|not in .+)$")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    tmp: Path

    def alerts(self) -> dict[tuple[str, str], tuple[str, str]]:
        out = {}
        for line in self.stdout.splitlines():
            m = ALERT_LINE.match(line)
            if m:
                severity, name, target, fate = m.groups()
                assert (name, target) not in out, f"listed twice: {line}"
                out[(name, target)] = (severity, fate)
        return out

    def description(self, name: str) -> str:
        lines = self.stdout.splitlines()
        index = next(i for i, line in enumerate(lines) if f" {name} " in line)
        return lines[index + 1].strip()


def demo_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The user's environment, with temporary files under ``tmp`` so that leftovers show."""
    return {**os.environ, "TMPDIR": str(tmp), **extra}


def leftovers(tmp: Path) -> list[str]:
    """Command lines of processes that mention ``tmp`` (every process the demo starts does)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(str(tmp).encode() in a for a in args):
            found.append(b" ".join(args).decode(errors="replace"))
    return found


def start(tmp: Path, *args: str) -> subprocess.Popen[str]:
    tmp.mkdir()
    # SIGINT back to its default, as in a terminal: a shell that runs the suite in the
    # background (`pytest &`) ignores it, and the demo would inherit that and never see Ctrl-C.
    return subprocess.Popen([sys.executable, str(DEMO), *args], cwd=REPO, env=demo_env(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def finish(proc: subprocess.Popen[str], tmp: Path) -> Run:
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the demo ran longer than {TIMEOUT} s:\n{out}\n{err}") from None
    return Run(proc.returncode, out, err, tmp)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Run]]:
    for binary in ("prometheus", "prometheus-alertmanager"):
        assert shutil.which(binary), f"{binary} is required (tests/run.sh installs it as root)"
    base = tmp_path_factory.mktemp("demo")
    procs = {tree: start(base / tree, "--tree", tree) for tree in ("faulty", "healthy")}
    try:
        yield {tree: finish(proc, base / tree) for tree, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_faulty_tree_fires_the_expected_alerts(runs: dict[str, Run]) -> None:
    run = runs["faulty"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.alerts() == EXPECTED, run.stdout
    assert "All 15 expected alerts fired" in run.stdout
    assert "reached Alertmanager: 3 paged, 10 ticketed, 2 inhibited" in run.stdout
    assert "runs at 200 Gb/s" in run.description("GpunetPortRateBelowExpected")
    assert "has MTU 1500" in run.description("GpunetRoceMtuTooSmall")
    assert "trusts pcp" in run.description("GpunetPfcTrustNotExpected")
    assert "priority 3" in run.description("GpunetPfcDisabledOnRocePriority")
    assert "mlx5_3 port 1 on dgx-h100-faulty is not ACTIVE" in run.description("GpunetPortDown")
    # Each alert with its runbook, where an operator reads what to do.
    assert run.stdout.count("runbook: https://") == sum(
        1 for line in run.stdout.splitlines() if line.startswith(("  critical", "  warning",
                                                                  "  info")))
    assert "runbooks.md#gpunetportdown" in run.stdout


@pytest.mark.slow
def test_healthy_tree_fires_nothing(runs: dict[str, Run]) -> None:
    run = runs["healthy"]
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.alerts() == {}
    assert "No alert fired or is pending after 10 s" in run.stdout
    assert "of 10 RDMA ports and 11 interfaces" in run.stdout  # the rules had data to judge
    assert "Alertmanager received nothing" in run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("tree", ["faulty", "healthy"])
def test_nothing_left_behind(runs: dict[str, Run], tree: str) -> None:
    run = runs[tree]
    assert "Stopped prometheus, alertmanager, gpunet-exporter." in run.stdout
    assert leftovers(run.tmp) == []
    assert list(run.tmp.iterdir()) == []  # its temporary directory is removed


@pytest.mark.slow
def test_ctrl_c_stops_everything(tmp_path: Path) -> None:
    proc = start(tmp_path / "run")

    def prometheus_ready() -> bool:
        """The demo has started all three (Prometheus last) and Prometheus is ready: the demo
        is done setting up and watches for alerts."""
        assert proc.poll() is None, "the demo exited"
        found = [re.search(r"--web\.listen-address=(\S+)", cmd)
                 for cmd in leftovers(tmp_path / "run") if "--storage.tsdb.path=" in cmd]
        if not found or not found[0]:
            return False
        with urllib.request.urlopen(f"http://{found[0].group(1)}/-/ready", timeout=5) as r:
            return bool(r.status == 200)

    wait_for(prometheus_ready, "the demo's Prometheus ready", timeout=60, interval=0.2,
             ignore=(OSError,))
    proc.send_signal(signal.SIGINT)
    run = finish(proc, tmp_path / "run")
    assert run.returncode == 130, run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "demo: interrupted; everything it started is stopped")
    assert leftovers(run.tmp) == []
    assert list(run.tmp.iterdir()) == []


@pytest.mark.slow
def test_serve_keeps_everything_up_until_ctrl_c(tmp_path: Path) -> None:
    """--serve: after the check, the exporter, Prometheus and Alertmanager stay up (the URLs
    said) until Ctrl-C, which stops them all; the check's exit status stands."""
    proc = start(tmp_path / "run", "--tree", "healthy", "--serve")
    assert proc.stdout is not None
    seen: list[str] = []

    def serving() -> str | None:
        line = proc.stdout.readline() if proc.stdout else ""  # type: ignore[union-attr]
        assert line or proc.poll() is None, "the demo exited:\n" + "".join(seen)
        seen.append(line)
        return line if line.startswith("Serving until Ctrl-C") else None

    said = wait_for(serving, "the demo serving", timeout=TIMEOUT, interval=0)
    url = re.search(r"(http://127\.0\.0\.1:\d+)/alerts", said)
    assert url, said
    with urllib.request.urlopen(f"{url.group(1)}/-/ready", timeout=5) as r:
        assert r.status == 200  # still up after the check
    proc.send_signal(signal.SIGINT)
    run = finish(proc, tmp_path / "run")
    assert run.returncode == 0, "".join(seen) + run.stdout + run.stderr
    assert "Stopped prometheus, alertmanager, gpunet-exporter." in run.stdout
    assert leftovers(run.tmp) == []


def test_missing_prometheus_is_one_clear_line(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()  # a PATH with neither Prometheus nor Alertmanager
    out = subprocess.run([sys.executable, str(DEMO)], cwd=REPO, capture_output=True, text=True,
                         env=demo_env(tmp_path, PATH=str(tmp_path / "bin")), timeout=60)
    assert out.returncode == 2
    assert out.stderr == "demo: prometheus not found: apt-get install prometheus\n"
    assert out.stdout == ""
