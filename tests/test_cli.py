"""Bad input gets one clear message and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import re
import resource
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import requests

from gpunet_exporter import __version__

from support.exporter import exporter_binary, free_port
from support.paths import REPO, UPSTREAM
from support.wait import wait_for
from support.yaml_bombs import alias_bomb, merge_bomb

SYSFS = str(UPSTREAM / "node_exporter-sysfs-infiniband" / "tree" / "sys")


def run(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    return subprocess.run([exporter_binary(), *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def check_user_error(res: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    assert res.returncode == code, res.stderr
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in res.stderr, res.stderr


def write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "gpunet.yml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text,needles", [
    ("infiniband:\n  device_includ: mlx5\n",
     ["key 'infiniband.device_includ': unknown key", "device_include"]),
    ("bogus: 1\n", ["key 'bogus': unknown key"]),
    ("infiniband:\n  device_include: '[mlx5'\n",
     ["key 'infiniband.device_include': invalid regular expression '[mlx5'"]),
    ("infiniband:\n  expected_rate:\n    - device: mlx5\n      gbps: fast\n",
     ["key 'infiniband.expected_rate[0].gbps': expected a number, got 'fast' (str)"]),
    ("infiniband:\n  expected_rate:\n    - device: mlx5\n",
     ["infiniband.expected_rate[0].gbps': missing, it is required"]),
    ("collectors:\n  infiniband: yes please\n",
     ["key 'collectors.infiniband': expected true or false"]),
    ("link:\n  expected_mtu:\n    - mtu: 12\n",
     ["link.expected_mtu[0].mtu': expected a value >= 68"]),
    ("link:\n  ibv_devinfo:\n    timeout_seconds: soon\n",
     ["key 'link.ibv_devinfo.timeout_seconds': expected a number, got 'soon' (str)"]),
    ("probe:\n  memory_cap_bytes: 5\n",
     ["key 'probe.memory_cap_bytes': expected a value >= 1048576, got 5"]),
    ("probe:\n  sizes: [8, 6]\n", ["key 'probe.sizes[1]': expected a multiple of 4, got 6"]),
    ("- just\n- a list\n", ["top level: expected a mapping"]),
    ("infiniband: [\n", ["invalid YAML at line 2"]),
])
def test_config_errors(tmp_path: Path, text: str, needles: list[str]) -> None:
    path = write(tmp_path, text)
    res = run(f"--config.file={path}", f"--path.sysfs={SYSFS}")
    check_user_error(res, 2, f"config file {path!r}", *needles)
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_config_missing_file(tmp_path: Path) -> None:
    res = run(f"--config.file={tmp_path}/nope.yml")
    check_user_error(res, 2, "nope.yml", "cannot read", "No such file")


@pytest.mark.parametrize("args,needle", [
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--web.listen"], "unrecognized arguments: --web.listen"),  # no abbreviations
    (["--collector.infiniband.device-include=("], "invalid regular expression"),
    (["--web.listen-address=nowhere"], "invalid --web.listen-address 'nowhere'"),
    (["--web.listen-address=:99999"], "invalid --web.listen-address"),
    (["--scrape.timeout=-1"], "expected a positive number of seconds"),
    (["--scrape.timeout=inf"], "expected a positive number of seconds"),
    (["--log.level=loud"], "invalid choice: 'loud'"),
    (["--web.telemetry-path=metrics"], "--web.telemetry-path"),
    (["--web.max-requests=-1"], "argument --web.max-requests: expected 0 or more, got '-1'"),
    (["--web.max-requests=many"], "argument --web.max-requests: expected a whole number"),
])
def test_bad_flags(args: list[str], needle: str) -> None:
    """One line naming the problem and where to look, not forty lines of usage above it."""
    res = run(*args)
    check_user_error(res, 2, needle)
    assert res.stderr.startswith("gpunet-exporter: error: ")
    assert res.stderr.endswith(" (try `gpunet-exporter --help`)\n")
    assert res.stderr.count("\n") == 1, res.stderr


@pytest.mark.parametrize("flag", ["--path.sysfs", "--path.procfs"])
def test_bad_root_paths(tmp_path: Path, flag: str) -> None:
    """A typo in --path.sysfs or --path.procfs would start an exporter that finds no device and
    reports every collector as successful: it is refused with the flag and the path named."""
    kind = flag.rsplit(".", 1)[1]
    missing = tmp_path / "nope"
    afile = tmp_path / "file"
    afile.write_text("")
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, problem in ((missing, "no such directory"), (afile, "not a directory"),
                          (empty, f"not a {kind} tree")):
        res = run(f"{flag}={path}")
        check_user_error(res, 2, f"gpunet-exporter: {flag} '{path}': {problem}")
        assert res.stderr.count("\n") == 1, res.stderr


def test_sysfs_parent_given_for_the_tree_gets_a_hint() -> None:
    """The example's folder instead of its sys/: the message says which one was meant."""
    example = Path(__file__).resolve().parents[1] / "examples" / "dgx-h100"
    res = run(f"--path.sysfs={example}")
    check_user_error(res, 2, f"--path.sysfs '{example}': not a sysfs tree (it has none of "
                     f"class/, bus/, devices/); did you mean {example / 'sys'}?")


def test_help_says_what_every_flag_does_and_its_default() -> None:
    """Every flag has help text; a flag with a default value names it."""
    from gpunet_exporter.options import build_parser
    from gpunet_exporter.registry import discover

    for server in (True, False):
        parser = build_parser(discover(), server=server)
        for action in parser._actions:
            if action.dest in ("help", "version"):
                continue
            flag = action.option_strings[0]
            assert action.help and action.help != "==SUPPRESS==", flag
            collector_setting = flag.startswith("--collector.") and flag.count(".") == 2
            if action.default not in (None, False) or collector_setting:
                assert "default" in action.help, (flag, action.help)
    out = run("--help").stdout
    for flag in ("--log.level LEVEL", "--log.format FORMAT", "--web.max-requests N",
                 "--web.disable-exporter-metrics"):
        assert flag in out


def test_usage_names_the_doctor() -> None:
    out = run("--help").stdout
    assert out.startswith("usage: gpunet-exporter [FLAGS]")
    assert "gpunet-exporter doctor [FLAGS]" in out.split("\n\n")[0]


def test_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run(f"--web.listen-address=127.0.0.1:{port}", f"--path.sysfs={SYSFS}")
    check_user_error(res, 1, f"cannot listen on 127.0.0.1:{port}", "in use")
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_version() -> None:
    res = run("--version")
    assert res.returncode == 0 and res.stdout.startswith("gpunet-exporter ")


@pytest.mark.parametrize("command", [
    ["gpunet-exporter"], ["gpunet-exporter", "doctor"], ["gpunet-probe"],
    ["gpunet-probe", "run"], ["gpunet-probe", "explain-log"], ["gpunet-probe", "plan"],
    ["gpunet-probe", "fleet"], ["gpunet-rules"], ["gpunet-mixin"],
], ids=" ".join)
def test_every_command_has_version(command: list[str]) -> None:
    """Every console script of [project.scripts] and each subcommand: one line, the script's
    name and the package's version, exit 0, before any required argument is asked for."""
    exe = shutil.which(command[0], path=os.path.dirname(exporter_binary()))
    assert exe, command[0]
    res = subprocess.run([exe, *command[1:], "--version"], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(rf"{command[0]} {re.escape(__version__)} \(python [\d.]+\)\n",
                        res.stdout), res.stdout
    assert "Traceback" not in res.stderr


def test_scripts_are_the_ones_tested_for_version() -> None:
    """A new console script gets a --version test: the list above is pyproject's."""
    text = (REPO / "pyproject.toml").read_text()
    section = text.split("[project.scripts]\n", 1)[1].split("\n\n", 1)[0]
    scripts = {line.split("=")[0].strip() for line in section.splitlines()}
    assert scripts == {"gpunet-exporter", "gpunet-probe", "gpunet-rules", "gpunet-mixin"}


def test_help_lists_collector_flags() -> None:
    out = run("--help").stdout
    for flag in ("--collector.infiniband", "--no-collector.link", "--collector.disable-defaults",
                 "--collector.infiniband.device-exclude", "--path.procfs", "--log.format"):
        assert flag in out


def test_flags_enable_disable_and_defaults(run_exporter) -> None:  # type: ignore[no-untyped-def]
    e = run_exporter(f"--path.sysfs={SYSFS}", "--no-collector.link")
    text = e.metrics()
    assert 'gpunet_scrape_collector_success{collector="infiniband"} 1.0' in text
    assert 'collector="link"' not in text
    e2 = run_exporter(f"--path.sysfs={SYSFS}", "--collector.disable-defaults", "--collector.link")
    text2 = e2.metrics()
    assert 'collector="infiniband"' not in text2
    assert 'gpunet_scrape_collector_success{collector="link"} 1.0' in text2


def test_config_disables_and_flag_wins(tmp_path: Path, run_exporter) -> None:  # type: ignore[no-untyped-def]
    cfg = write(tmp_path, "collectors:\n  infiniband: false\n  link: false\n")
    e = run_exporter(f"--path.sysfs={SYSFS}", f"--config.file={cfg}", "--collector.link")
    text = e.metrics()
    assert 'collector="infiniband"' not in text
    assert 'collector="link"' in text


def test_device_filters_flag_over_config(tmp_path: Path, run_exporter) -> None:  # type: ignore[no-untyped-def]
    cfg = write(tmp_path, "infiniband:\n  device_include: '^i40iw'\n")
    text = run_exporter(f"--path.sysfs={SYSFS}", f"--config.file={cfg}").metrics()
    assert 'device="i40iw0"' in text and 'device="mlx4_0"' not in text
    text = run_exporter(f"--path.sysfs={SYSFS}", f"--config.file={cfg}",
                        "--collector.infiniband.device-include=^mlx4",
                        "--collector.infiniband.device-exclude=i40iw").metrics()
    assert 'device="mlx4_0"' in text and 'device="i40iw0"' not in text


def test_http_endpoints_gzip_and_openmetrics(run_exporter) -> None:  # type: ignore[no-untyped-def]
    e = run_exporter(f"--path.sysfs={SYSFS}", "--web.telemetry-path=/m")
    plain = requests.get(f"{e.url}/m", timeout=10, headers={"Accept-Encoding": "identity"})
    assert plain.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    gz = requests.get(f"{e.url}/m", timeout=10, headers={"Accept-Encoding": "gzip"})
    assert gz.headers.get("Content-Encoding") == "gzip"
    om = requests.get(f"{e.url}/m", timeout=10,
                      headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert om.headers["Content-Type"].startswith("application/openmetrics-text")
    assert om.text.rstrip().endswith("# EOF")
    landing = requests.get(e.url + "/", timeout=10)
    assert landing.status_code == 200
    assert "infiniband" in landing.text and 'href="/m"' in landing.text
    assert "ok" in landing.text  # the collectors' last status after the scrapes above
    assert requests.get(f"{e.url}/-/healthy", timeout=10).status_code == 200
    assert requests.get(f"{e.url}/nope", timeout=10).status_code == 404
    assert requests.get(f"{e.url}/metrics", timeout=10).status_code == 404  # path was moved


def test_exporter_metrics_and_their_switch(run_exporter) -> None:  # type: ignore[no-untyped-def]
    """The exporter watches itself as node_exporter does: process_* and python_* from
    prometheus_client's own collectors, off with --web.disable-exporter-metrics."""
    e = run_exporter(f"--path.sysfs={SYSFS}")
    text = e.metrics()
    for name in ("process_resident_memory_bytes", "process_cpu_seconds_total",
                 "process_open_fds", "process_max_fds", "process_start_time_seconds",
                 "python_info", "python_gc_collections_total",
                 "gpunet_exporter_scrapes_rejected_total"):
        assert f"\n{name}" in text, name
    rss = next(float(ln.split()[1]) for ln in text.splitlines()
               if ln.startswith("process_resident_memory_bytes "))
    assert 5e6 < rss < 2e9  # this exporter's own RSS, from its /proc/self
    off = run_exporter(f"--path.sysfs={SYSFS}", "--web.disable-exporter-metrics").metrics()
    assert 'gpunet_scrape_collector_success{collector="infiniband"} 1.0' in off
    assert not [ln for ln in off.splitlines()
                if ln.startswith(("process_", "python_", "gpunet_exporter_scrapes_rejected"))]


def test_sigterm_exits_cleanly(run_exporter) -> None:  # type: ignore[no-untyped-def]
    e = run_exporter(f"--path.sysfs={SYSFS}", "--log.format=json")
    e.metrics()
    err = e.stop()
    assert e.proc.returncode == 0
    assert '"msg": "received SIGTERM, shutting down"' in err
    assert free_port()  # nothing to assert about the port beyond a clean exit


# The service with its collectors' start held for a second, after it has said so in a file:
# what a slow start (a probe runner, a fabric tool looked up) gives a signal to land in.
SLOW_START = """
import sys, time
from gpunet_exporter.daemon import serve
started = serve.start_collectors
def slow(*args, **kw):
    open(sys.argv[1], "w").close()
    time.sleep(1)
    return started(*args, **kw)
serve.start_collectors = slow
serve.main(sys.argv[2:])
"""


def test_sigterm_while_starting_stops_cleanly(tmp_path: Path) -> None:
    """A SIGTERM that lands while the collectors start ends the service as one once started
    does: exit 0, the line saying so, nothing served. Seen in CI before the handlers moved
    ahead of the start: a SIGTERM right after the "listening" line ended the process by the
    signal, before its root warning."""
    marker = tmp_path / "starting"
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_START, str(marker), f"--path.sysfs={SYSFS}",
         f"--web.listen-address=127.0.0.1:{free_port()}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(marker.exists, "the collectors starting", timeout=30, interval=0.02)
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "received SIGTERM, shutting down" in err
    assert "listening" not in err


def test_root_warning_once_started(run_exporter: Any) -> None:
    """As root, a started exporter says once that it need not be (tests/run.sh runs as root)."""
    e = run_exporter(f"--path.sysfs={SYSFS}")
    err = e.stop()
    warned = [ln for ln in err.splitlines() if "running as root" in ln]
    assert len(warned) == (1 if os.geteuid() == 0 else 0), err
    if warned:
        assert "CAP_SYS_ADMIN" in warned[0] and "level=warn" in warned[0]


# ---- hostile files (issue 15): every YAML file a command reads is bounded ----------------------

def hostile(tmp_path: Path, case: str) -> str:
    """A path for ``case``: a file with that content, or a FIFO, a device, a directory."""
    path = tmp_path / "hostile.yml"
    if case == "alias bomb":
        path.write_text(alias_bomb())
    elif case == "merge bomb":
        path.write_text(merge_bomb())
    elif case == "over 1 MiB":
        path.write_text("#" * (1 << 20) + "\n")
    elif case == "FIFO":
        os.mkfifo(path)  # nobody writes: a blocking open() would wait for ever
    elif case == "directory":
        path.mkdir()
    else:
        return "/dev/zero"
    return str(path)


HOSTILE = {
    "alias bomb": "more than 100000 values at line 6, column ",
    "merge bomb": "more than 100000 values at line 5, column ",
    "over 1 MiB": f"too large: {(1 << 20) + 1} bytes, the limit is 1 MiB",
    "FIFO": "a FIFO, not a regular file",
    "/dev/zero": "a character device, not a regular file",
    "directory": "a directory, not a regular file",
}
# command -> (its program and arguments, the flag that takes the file, the start of the line)
READERS = {
    "exporter --config.file": (["gpunet-exporter"], "--config.file",
                               "gpunet-exporter: config file"),
    "exporter --web.config.file": (["gpunet-exporter"], "--web.config.file",
                                   "gpunet-exporter: web config file"),
    "doctor --config.file": (["gpunet-exporter", "doctor"], "--config.file",
                             "gpunet-exporter doctor: config file"),
    "doctor --thresholds": (["gpunet-exporter", "doctor"], "--thresholds",
                            "gpunet-exporter doctor: thresholds file"),
    "gpunet-rules --thresholds": (["gpunet-rules"], "--thresholds",
                                  "gpunet-rules: thresholds file"),
}
MEMORY_CAP = 512 << 20  # the alias bomb needed 4.3 GB before; a refusing exporter needs ~30 MB


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_hostile_yaml_files_are_refused_in_one_line(tmp_path: Path, reader: str,
                                                    case: str) -> None:
    """Every command that reads a YAML file refuses, at once and in bounded memory, an alias or
    merge-key bomb, a file over 1 MiB, and anything that is not a regular file: one line naming
    the file and the problem, exit 2. The address space is capped (a regression dies of
    MemoryError instead of eating the machine); the timeout only guards against a hang (the FIFO
    blocked start-up for ever), it asserts nothing about speed."""
    path = hostile(tmp_path, case)
    (program, *args), flag, start = READERS[reader]
    exe = shutil.which(program)
    assert exe, f"the {program} console script is not installed (pip install .)"
    if program == "gpunet-exporter":
        args.append(f"--path.sysfs={SYSFS}")
        if args[:1] != ["doctor"]:  # should it start after all, not on the default port
            args.append(f"--web.listen-address=127.0.0.1:{free_port()}")
    res = subprocess.run([exe, *args, f"{flag}={path}"], capture_output=True, text=True,
                         timeout=120, stdin=subprocess.DEVNULL, preexec_fn=_cap_memory)
    check_user_error(res, 2, f"{start} {path!r}: {HOSTILE[case]}")
    assert res.stderr.count("\n") == 1, res.stderr
    assert res.stdout == ""
