"""systemd/: the unit passes `systemd-analyze verify` and its security exposure stays at or below
SECURITY_THRESHOLD; the sysusers file, the environment file and the unit agree with the exporter.

Measured with systemd 252 (Debian 12): exposure 1.6 "OK" (docs/install.md). The threshold leaves
room for a newer systemd that scores more settings, not for weakening the unit.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.daemon.privileges import declared

from support.paths import REPO

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "gpunet-exporter.service"
SYSUSERS = SYSTEMD / "gpunet-exporter.sysusers"
DEFAULT = SYSTEMD / "gpunet-exporter.default"
INSTALLED_EXEC = "/opt/gpunet-exporter/bin/gpunet-exporter"
SECURITY_THRESHOLD = 2.0  # systemd's scale: 0 (best) to 10

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed "
                                   "(Debian package systemd; tests/run.sh installs it as root)")


def unit_lines() -> list[tuple[str, str]]:
    """(key, value) of every setting of the unit, in order, repeated keys kept."""
    out = []
    for raw in UNIT.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.append((key, value))
    return out


def settings(key: str) -> list[str]:
    return [v for k, v in unit_lines() if k == key]


@pytest.fixture
def runnable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at the installed console script (verify checks that the
    program exists and is executable)."""
    exe = shutil.which("gpunet-exporter")
    exe = exe and os.path.abspath(exe)  # a relative PATH entry gives a relative path
    if exe is None:
        pytest.skip("gpunet-exporter console script not on PATH")
    text = UNIT.read_text(encoding="utf-8")
    assert f"ExecStart={INSTALLED_EXEC} $ARGS\n" in text
    path = tmp_path / UNIT.name
    path.write_text(text.replace(f"ExecStart={INSTALLED_EXEC} ", f"ExecStart={exe} "),
                    encoding="utf-8")
    return path


def analyze(*args: str) -> subprocess.CompletedProcess[str]:
    assert ANALYZE is not None
    env = {**os.environ, "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "", "LC_ALL": "C.UTF-8"}
    return subprocess.run([ANALYZE, *args], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


@needs_analyze
def test_verify_clean(runnable_unit: Path) -> None:
    res = analyze("verify", str(runnable_unit))
    output = (res.stdout + res.stderr).strip()
    assert res.returncode == 0, output
    assert output == "", f"systemd-analyze verify warned:\n{output}"


@needs_analyze
def test_verify_catches_a_bad_setting(tmp_path: Path, runnable_unit: Path) -> None:
    """The check above would see a mistake: verify prints (and exits 0) for a bad value."""
    bad = tmp_path / "bad" / UNIT.name
    bad.parent.mkdir()
    bad.write_text(runnable_unit.read_text(encoding="utf-8").replace(
        "ProtectSystem=strict", "ProtectSystem=stricter"), encoding="utf-8")
    res = analyze("verify", str(bad))
    assert "protect system value" in res.stdout + res.stderr


@needs_analyze
def test_security_exposure(runnable_unit: Path) -> None:
    res = analyze("security", "--offline=true", str(runnable_unit))
    output = res.stdout + res.stderr
    assert res.returncode == 0, output
    m = re.search(r"Overall exposure level for gpunet-exporter\.service: (\d+(?:\.\d+)?) (\w+)",
                  output)
    assert m, output
    score, label = float(m.group(1)), m.group(2)
    print(f"systemd-analyze security --offline=true: exposure {score} {label}")
    assert score <= SECURITY_THRESHOLD, output
    # The same bound through systemd's own check (threshold in tenths).
    res = analyze("security", "--offline=true", f"--threshold={round(SECURITY_THRESHOLD * 10)}",
                  str(runnable_unit))
    assert res.returncode == 0, res.stdout + res.stderr


def test_unprivileged_by_default() -> None:
    assert settings("User") == ["gpunet-exporter"]
    assert settings("Group") == ["gpunet-exporter"]
    assert "DynamicUser" not in dict(unit_lines())
    assert settings("CapabilityBoundingSet") == [""]
    assert settings("AmbientCapabilities") == [""]
    assert settings("NoNewPrivileges") == ["yes"]
    # PrivateDevices=yes would hide /dev/nvidia*; the device cgroup restricts instead.
    assert settings("PrivateDevices") in ([], ["no"])
    assert settings("DevicePolicy") == ["closed"]
    allowed = settings("DeviceAllow")
    for group in ("char-nvidia rw", "char-nvidia-frontend rw", "char-nvidia-uvm rw",
                  "char-infiniband_verbs rw"):
        assert group in allowed
    families = settings("RestrictAddressFamilies")[0].split()
    assert {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"} == set(families)


def test_optional_capabilities_commented_match_privileges() -> None:
    """The commented-out capability lines list exactly what exporter.privileges says the
    collectors can use (a drop-in may pick some)."""
    text = UNIT.read_text(encoding="utf-8")
    wanted = {c for n in declared() for c in n.capabilities}
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        m = re.search(rf"^#{key}=(.*)$", text, re.M)
        assert m, key
        commented = set(m.group(1).split())
        assert commented <= wanted, key
        mentioned = set(re.findall(r"CAP_[A-Z_]+", text))
        assert wanted <= mentioned


def test_state_directory_holds_probe_state_dir() -> None:
    (state,) = settings("StateDirectory")
    default = ProbeCollector.config_fields["state_dir"].default
    assert default.startswith(f"/var/lib/{state}/")
    (home,) = [shlex.split(line)[4] for line in SYSUSERS.read_text(encoding="utf-8").splitlines()
               if line.startswith("u ")]
    assert home == f"/var/lib/{state}"


def test_exec_and_environment_file() -> None:
    assert settings("ExecStart") == [f"{INSTALLED_EXEC} $ARGS"]
    assert settings("EnvironmentFile") == ["-/etc/default/gpunet-exporter"]
    assert settings("Restart") == ["on-failure"]
    assert settings("RestartPreventExitStatus") == ["2"]  # bad flags or configuration


def test_default_file_examples_parse() -> None:
    """ARGS in the environment file, and every commented example, are flags the exporter
    accepts."""
    from gpunet_exporter.options import build_parser
    from gpunet_exporter.registry import discover

    parser = build_parser(discover())
    text = DEFAULT.read_text(encoding="utf-8")
    active = re.findall(r'^ARGS="([^"]*)"$', text, re.M)
    assert active == [""]
    examples = re.findall(r'^#\s+ARGS="([^"]*)"', text, re.M)
    assert len(examples) >= 3
    for args in [*active, *examples]:
        parser.parse_args(shlex.split(args))


def test_sections_parse() -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(re.sub(r"^(After|DeviceAllow|SystemCallFilter)=", r"#\1=",
                          UNIT.read_text(encoding="utf-8"), flags=re.M))
    assert cp.sections() == ["Unit", "Service", "Install"]
    assert cp["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or os.geteuid() != 0,
                    reason="needs systemd-sysusers and root")
def test_sysusers_creates_the_user(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    res = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", "-"],
                         input=SYSUSERS.read_text(encoding="utf-8"), capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text(encoding="utf-8")
    (entry,) = [e.split(":") for e in passwd.splitlines() if e.startswith("gpunet-exporter:")]
    assert 0 < int(entry[2]) < 1000  # a system user
    assert entry[5:] == ["/var/lib/gpunet-exporter", "/usr/sbin/nologin"]
    group = (tmp_path / "etc" / "group").read_text(encoding="utf-8")
    assert any(g.startswith("gpunet-exporter:") for g in group.splitlines())
