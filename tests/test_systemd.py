"""systemd/: both units (the node's, and the fabric hosts' gpunet-exporter-fabric.service) pass
`systemd-analyze verify` and their security exposure stays at or below SECURITY_THRESHOLD; the
sysusers files, the environment files and the units agree with the exporter; the fabric unit
keeps every hardening setting of the node unit; the udev rule for the umad nodes gives them to the
fabric unit's group, and real udev applies it (test_udev_rule_applies).

Measured with systemd 252 (Debian 12): exposure 1.6 "OK" for the node unit (docs/install.md),
1.4 "OK" for the fabric unit (docs/fabric.md). The threshold leaves room for a newer systemd that
scores more settings, not for weakening a unit.
"""

from __future__ import annotations

import configparser
import fnmatch
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import requests

from gpunet_exporter import DEFAULT_PORT
from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.config import settings_items
from gpunet_exporter.daemon.privileges import declared

from support import ibsim
from support.exporter import exporter_binary, free_port
from support.paths import REPO
from support.wait import wait_for

SYSTEMD = REPO / "systemd"
UNIT = SYSTEMD / "gpunet-exporter.service"
SYSUSERS = SYSTEMD / "gpunet-exporter.sysusers"
DEFAULT = SYSTEMD / "gpunet-exporter.default"
FABRIC_UNIT = SYSTEMD / "gpunet-exporter-fabric.service"
FABRIC_SYSUSERS = SYSTEMD / "gpunet-exporter-fabric.sysusers"
FABRIC_DEFAULT = SYSTEMD / "gpunet-exporter-fabric.default"
UMAD_RULES = SYSTEMD / "92-gpunet-umad.rules"
FABRIC_PORT = 19401
UNITS = [UNIT, FABRIC_UNIT]
INSTALLED_EXEC = "/opt/gpunet-exporter/bin/gpunet-exporter"
SECURITY_THRESHOLD = 2.0  # systemd's scale: 0 (best) to 10

ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze not installed "
                                   "(Debian package systemd; tests/run.sh installs it as root)")


def unit_lines(unit: Path = UNIT) -> list[tuple[str, str]]:
    """(key, value) of every setting of a unit, in order, repeated keys kept."""
    out = []
    for raw in unit.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        out.append((key, value))
    return out


def settings(key: str, unit: Path = UNIT) -> list[str]:
    return [v for k, v in unit_lines(unit) if k == key]


def runnable(unit: Path, folder: Path) -> Path:
    """The unit with ExecStart pointing at the installed console script (verify checks that the
    program exists and is executable)."""
    exe = shutil.which("gpunet-exporter")
    exe = exe and os.path.abspath(exe)  # a relative PATH entry gives a relative path
    if exe is None:
        pytest.skip("gpunet-exporter console script not on PATH")
    text = unit.read_text(encoding="utf-8")
    assert f"ExecStart={INSTALLED_EXEC} " in text
    assert re.search(rf"^ExecStart={re.escape(INSTALLED_EXEC)} .*\$ARGS$", text, re.M)
    path = folder / unit.name
    path.write_text(text.replace(f"ExecStart={INSTALLED_EXEC} ", f"ExecStart={exe} "),
                    encoding="utf-8")
    return path


@pytest.fixture(params=UNITS, ids=lambda u: u.stem)
def runnable_unit(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return runnable(request.param, tmp_path)


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
    bad = tmp_path / "bad" / runnable_unit.name
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
    m = re.search(rf"Overall exposure level for {re.escape(runnable_unit.name)}: "
                  r"(\d+(?:\.\d+)?) (\w+)", output)
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
    default = settings_items(ProbeCollector.settings_type())["state_dir"]
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


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.stem)
def test_sections_parse(unit: Path) -> None:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(re.sub(r"^(After|DeviceAllow|SystemCallFilter)=", r"#\1=",
                          unit.read_text(encoding="utf-8"), flags=re.M))
    assert cp.sections() == ["Unit", "Service", "Install"]
    assert cp["Install"]["WantedBy"] == "multi-user.target"


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None or os.geteuid() != 0,
                    reason="needs systemd-sysusers and root")
@pytest.mark.parametrize(("sysusers", "user", "home"), [
    (SYSUSERS, "gpunet-exporter", "/var/lib/gpunet-exporter"),
    (FABRIC_SYSUSERS, "gpunet-fabric", "/")], ids=["node", "fabric"])
def test_sysusers_creates_the_user(tmp_path: Path, sysusers: Path, user: str, home: str) -> None:
    (tmp_path / "etc").mkdir()
    res = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", "-"],
                         input=sysusers.read_text(encoding="utf-8"), capture_output=True,
                         text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    passwd = (tmp_path / "etc" / "passwd").read_text(encoding="utf-8")
    (entry,) = [e.split(":") for e in passwd.splitlines() if e.startswith(f"{user}:")]
    assert 0 < int(entry[2]) < 1000  # a system user
    assert entry[5:] == [home, "/usr/sbin/nologin"]
    group = (tmp_path / "etc" / "group").read_text(encoding="utf-8")
    assert any(g.startswith(f"{user}:") for g in group.splitlines())


# -- the fabric hosts' unit, its user and the udev rule ------------------------------------------

# Settings of the node unit that the fabric unit must carry unchanged (the sandbox); the ones it
# changes on purpose are checked one by one in test_fabric_unit_hardening.
SAME_AS_NODE = ("Type", "Restart", "RestartSec", "RestartPreventExitStatus", "UMask",
                "CapabilityBoundingSet", "AmbientCapabilities", "NoNewPrivileges",
                "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateMounts",
                "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
                "ProtectControlGroups", "ProtectClock", "ProtectHostname", "ProtectProc",
                "RestrictNamespaces", "RestrictRealtime", "RestrictSUIDSGID", "LockPersonality",
                "RemoveIPC", "SystemCallArchitectures", "SystemCallErrorNumber", "DevicePolicy")


def fabric_argv() -> list[str]:
    """The fabric unit's ExecStart, without the program and $ARGS."""
    (line,) = settings("ExecStart", FABRIC_UNIT)
    argv = shlex.split(line)
    assert argv[0] == INSTALLED_EXEC and argv[-1] == "$ARGS"
    return argv[1:-1]


def udev_rules() -> list[dict[str, tuple[str, str]]]:
    """Each rule of the udev file: key -> (operator, value)."""
    out = []
    for line in UMAD_RULES.read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        pairs = re.findall(
            r'\s*([A-Z_]+(?:\{[^}]*\})?)\s*(==|!=|\+=|-=|:=|=)\s*"([^"]*)"\s*(?:,|$)', line)
        # Every byte of the line is one of the pairs: nothing left over that udev would reject.
        rebuilt = ", ".join(f'{k}{op}"{v}"' for k, op, v in pairs)
        assert rebuilt == line.strip(), line
        out.append({k: (op, v) for k, op, v in pairs})
    return out


def test_fabric_unit_hardening() -> None:
    for key in SAME_AS_NODE:
        assert settings(key, FABRIC_UNIT) == settings(key), key
    assert settings("User", FABRIC_UNIT) == settings("Group", FABRIC_UNIT) == ["gpunet-fabric"]
    assert settings("SupplementaryGroups", FABRIC_UNIT) == []
    assert "DynamicUser" not in dict(unit_lines(FABRIC_UNIT))
    assert settings("PrivateDevices", FABRIC_UNIT) in ([], ["no"])
    # The umad (and issm) nodes only: no GPU, no verbs.
    assert settings("DeviceAllow", FABRIC_UNIT) == ["char-infiniband_mad rw"]
    # No netlink (no --no-hotplug watch, no rdma/dcb netlink of the node collectors).
    (families,) = settings("RestrictAddressFamilies", FABRIC_UNIT)
    assert set(families.split()) == {"AF_INET", "AF_INET6", "AF_UNIX"}
    node_filter = settings("SystemCallFilter")
    fabric_filter = settings("SystemCallFilter", FABRIC_UNIT)
    assert fabric_filter[0] == node_filter[0] == "@system-service"
    assert set(node_filter[1].lstrip("~").split()) < set(fabric_filter[1].lstrip("~").split())
    assert fabric_filter[1].startswith("~")
    # Nothing to keep: no StateDirectory, and the user's home is / (the sysusers file).
    assert settings("StateDirectory", FABRIC_UNIT) == []
    assert settings("EnvironmentFile", FABRIC_UNIT) == ["-/etc/default/gpunet-exporter-fabric"]
    # Ordered after the RDMA stack (the umad nodes) as the node unit is, and not on the GPUs.
    after = " ".join(settings("After", FABRIC_UNIT)).split()
    assert {"rdma-hw.target", "openibd.service"} <= set(after)
    assert not [a for a in after if a.startswith("nvidia")]
    assert not [k for k, _ in unit_lines(FABRIC_UNIT) if k in ("Wants", "Requires")]


def test_fabric_unit_runs_only_the_fabric_collector() -> None:
    from gpunet_exporter.options import build_parser, resolve
    from gpunet_exporter.registry import discover

    classes = discover()
    parser = build_parser(classes)
    args = parser.parse_args(fabric_argv())
    enabled, _ = resolve(args, classes, None, parser)
    assert enabled == ["fabric"]
    assert args.hotplug is False
    assert args.listen_address == f":{FABRIC_PORT}"
    assert FABRIC_PORT != DEFAULT_PORT  # beside the node's exporter on the same host
    # $ARGS comes last, so the environment file can move the port.
    args = parser.parse_args([*fabric_argv(), "--web.listen-address=10.0.0.5:19411"])
    assert args.listen_address == "10.0.0.5:19411"


def test_fabric_default_file_examples_parse() -> None:
    from gpunet_exporter.options import build_parser
    from gpunet_exporter.registry import discover

    parser = build_parser(discover())
    text = FABRIC_DEFAULT.read_text(encoding="utf-8")
    active = re.findall(r'^ARGS="([^"]*)"$', text, re.M)
    assert active == [""]
    examples = re.findall(r'^#\s+ARGS="([^"]*)"', text, re.M)
    assert len(examples) >= 2
    for args in [*active, *examples]:
        parser.parse_args([*fabric_argv(), *shlex.split(args)])
    # The file quotes the unit's command line as it is.
    quoted = re.search(r"^#\s+(/opt/\S+ .*?)\\\n#\s+(.*\$ARGS)$", text, re.M)
    assert quoted, text
    assert shlex.split(quoted.group(1) + " " + quoted.group(2)) == [
        INSTALLED_EXEC, *fabric_argv(), "$ARGS"]


def test_fabric_user_group_rule_agree() -> None:
    """One name everywhere: the sysusers file's user (and its group), the unit's User= and
    Group=, the udev rule's GROUP=; and the rule's subsystem is the device group the unit allows
    (the kernel registers both under umad_class.name, drivers/infiniband/core/user_mad.c)."""
    (line,) = [shlex.split(x) for x in FABRIC_SYSUSERS.read_text(encoding="utf-8").splitlines()
               if x.startswith("u ")]
    user = line[1]
    assert settings("User", FABRIC_UNIT) == [user]
    assert user != settings("User")[0]  # not the node exporter's user
    (rule,) = udev_rules()
    assert rule["GROUP"] == ("=", user)
    assert rule["SUBSYSTEM"][0] == "=="
    (allow,) = settings("DeviceAllow", FABRIC_UNIT)
    assert allow == f"char-{rule['SUBSYSTEM'][1]} rw"


def test_udev_rule_matches_umad_only() -> None:
    """The rule matches every umadN (the kernel names them umad0.. for each port, past 64
    too) and no issmN (the subnet manager's node, whose opening sets IsSM on the port); group
    read/write and nothing for others."""
    (rule,) = udev_rules()
    assert rule["SUBSYSTEM"] == ("==", "infiniband_mad")
    op, kernel = rule["KERNEL"]
    assert op == "=="
    for name in ("umad0", "umad7", "umad63", "umad64", "umad1023"):
        assert fnmatch.fnmatchcase(name, kernel), name
    for name in ("issm0", "issm64", "umad", "uverbs0", "rdma_cm"):
        assert not fnmatch.fnmatchcase(name, kernel), name
    assert rule["MODE"] == ("=", "0660")
    assert set(rule) == {"SUBSYSTEM", "KERNEL", "GROUP", "MODE"}  # no OWNER, no RUN


UDEVADM = shutil.which("udevadm")
UNSHARE = shutil.which("unshare")


def udev_test(tmp_path: Path, rules: str, group_gid: int) -> tuple[dict[str, str], str]:
    """Real udev (``udevadm test``) on two device nodes of the kernel's infiniband_mad class,
    umad0 and issm0, with ``rules`` installed in /etc/udev/rules.d, the distribution's own rules
    beside it, and a group gpunet-fabric: all in a private mount namespace (tmpfs over
    /etc/udev/rules.d, /run, /sys/devices/virtual and /dev; /etc/group bound over), so the
    host is left alone. Returns each node's "mode uid gid" after udev, and udev's log.
    A ``tmp_path`` under one of those (tests/run.sh puts pytest's files on /dev/shm) would be
    hidden from the script: a folder under /var/tmp is used instead."""
    if any(tmp_path.resolve().is_relative_to(top) for top in ("/dev", "/run", "/sys", "/etc")):
        with tempfile.TemporaryDirectory(dir="/var/tmp") as elsewhere:
            return udev_test(Path(elsewhere), rules, group_gid)
    (tmp_path / "92-gpunet-umad.rules").write_text(rules, encoding="utf-8")
    group = Path("/etc/group").read_text(encoding="utf-8")
    (tmp_path / "group").write_text(f"{group.rstrip()}\ngpunet-fabric:x:{group_gid}:\n",
                                    encoding="utf-8")
    script = r"""
set -eu
t=$1
mount -t tmpfs tmpfs /etc/udev/rules.d
cp "$t/92-gpunet-umad.rules" /etc/udev/rules.d/
mount --bind "$t/group" /etc/group
mount -t tmpfs tmpfs /run
mount -t tmpfs tmpfs /sys/devices/virtual
mount -t tmpfs tmpfs /dev
mkdir /dev/infiniband
# The kernel's layout (user_mad.c): class infiniband_mad, major 231, umadN at minor N,
# issmN at minor 64 + N, each with ibdev and port attributes; created 0600 root (devtmpfs).
for node in umad0:0 issm0:64; do
  name=${node%%:*}; minor=${node##*:}
  d=/sys/devices/virtual/infiniband_mad/$name
  mkdir -p "$d"
  printf 'MAJOR=231
MINOR=%s
DEVNAME=infiniband/%s
' "$minor" "$name" > "$d/uevent"
  ln -s ../../../../class/infiniband_mad "$d/subsystem"
  echo mlx5_0 > "$d/ibdev"; echo 1 > "$d/port"; echo "231:$minor" > "$d/dev"
  mknod -m 0600 "/dev/infiniband/$name" c 231 "$minor"
  udevadm test --action=add "$d" > "$t/$name.log" 2>&1
done
stat -c '%n %a %u %g' /dev/infiniband/umad0 /dev/infiniband/issm0
"""
    # The tmpfs under /sys/devices/virtual is not sysfs; this variable, which systemd provides
    # for tests, lets sd-device take it.
    env = {**os.environ, "SYSTEMD_DEVICE_VERIFY_SYSFS": "0", "SYSTEMD_LOG_LEVEL": "debug"}
    assert UNSHARE is not None
    res = subprocess.run([UNSHARE, "--mount", "--propagation", "private", "sh", "-c", script,
                          "sh", str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    log = "".join((tmp_path / f"{n}.log").read_text(errors="replace")
                  for n in ("umad0", "issm0") if (tmp_path / f"{n}.log").exists())
    assert res.returncode == 0, res.stdout + res.stderr + log
    nodes = {}
    for line in res.stdout.splitlines():
        path, rest = line.split(" ", 1)
        nodes[os.path.basename(path)] = rest
    return nodes, log


needs_udev = pytest.mark.skipif(
    UDEVADM is None or UNSHARE is None or os.geteuid() != 0,
    reason="needs udevadm (Debian package udev; tests/run.sh installs it as root), unshare and "
    "root")


@needs_udev
def test_udev_rule_applies(tmp_path: Path) -> None:
    nodes, log = udev_test(tmp_path, UMAD_RULES.read_text(encoding="utf-8"), 4242)
    assert nodes == {"umad0": "660 0 4242", "issm0": "600 0 0"}, log
    assert re.search(r"92-gpunet-umad\.rules:\d+ GROUP 4242", log), log
    # udev read the file without a complaint about it.
    complaints = [line for line in log.splitlines() if "92-gpunet-umad.rules" in line and
                  re.search(r"invalid|ignor|unknown|fail|error", line, re.I)]
    assert complaints == [], log


@needs_udev
def test_udev_test_sees_a_broken_rule(tmp_path: Path) -> None:
    """The check above would see a mistake: a misspelt key leaves the node as the kernel made
    it, and udev says why."""
    broken = UMAD_RULES.read_text(encoding="utf-8").replace('GROUP="', 'GRUOP="')
    assert broken != UMAD_RULES.read_text(encoding="utf-8")
    nodes, log = udev_test(tmp_path, broken, 4242)
    assert nodes["umad0"] == "600 0 0", log
    assert re.search(r"92-gpunet-umad\.rules:\d+.*GRUOP", log), log


def closed_to_others(path: Path) -> Path | None:
    """The first folder above ``path`` that other users cannot enter (no o+x), if any."""
    for folder in reversed(path.absolute().parents):
        if not folder.stat().st_mode & stat.S_IXOTH:
            return folder
    return None


def test_fabric_unit_command_sweeps_unprivileged(tmp_path: Path) -> None:
    """The unit's command line, run as nobody with no capabilities against a simulated fabric
    (ibsim; the tools reach it through libumad2sim instead of /dev/infiniband/umad*, so the
    device's permission is what the udev tests above check): the fabric collector, alone,
    sweeps the whole fabric."""
    ibsim.require()
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root (to drop to nobody) and setpriv")
    closed = closed_to_others(Path(exporter_binary()))
    if closed is not None:  # .ci/run opens its copy's folder for this test
        pytest.skip(f"nobody cannot reach the installed exporter: {closed} is closed to other "
                    "users; run the suite from a checkout they can read")
    tree = ibsim.fat_tree(leaves=2, spines=2, hosts_per_leaf=2)
    with ibsim.Sim(tmp_path / "sim", tree.netfile) as sim:
        # A folder nobody can read (pytest's tmp_path is 0700 root).
        shared = Path(tempfile.mkdtemp(prefix="gpunet-fabric-unit-"))
        try:
            shared.chmod(0o755)
            config = shared / "fabric.yml"
            config.write_text(
                "fabric:\n  interval_seconds: 3600\n  tools_dir: /usr/sbin\n  environment:\n"
                f"    - LD_PRELOAD={ibsim.UMAD2SIM}\n    - IBSIM_SOCKNAME={sim.sockname}\n",
                encoding="utf-8")
            config.chmod(0o644)
            port = free_port()
            argv = [a if not a.startswith("--web.listen-address=")
                    else f"--web.listen-address=127.0.0.1:{port}" for a in fabric_argv()]
            cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                   "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs",
                   exporter_binary(), *argv, f"--config.file={config}"]
            env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SIM_HOST")}
            # libumad2sim makes its stand-in sysfs (sys-PID) in the working directory.
            work = shared / "work"
            work.mkdir()
            os.chown(work, 65534, 65534)
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, env=env, cwd=work)
            url = f"http://127.0.0.1:{port}/metrics"
            try:
                def swept() -> str | None:
                    if proc.poll() is not None:
                        _, err = proc.communicate()
                        raise AssertionError(f"exited {proc.returncode}: {err}")
                    text = requests.get(url, timeout=5).text
                    return text if "\ngpunet_fabric_sweep_success " in text else None

                found = wait_for(swept, "the first sweep", timeout=60,
                                 ignore=(requests.ConnectionError,))
            finally:
                proc.terminate()
                _, err = proc.communicate(timeout=20)
        finally:
            shutil.rmtree(shared, ignore_errors=True)
    assert found is not None
    text = found
    assert "\ngpunet_fabric_sweep_success 1.0\n" in text, err
    assert f"\ngpunet_fabric_switches {float(len(tree.leaves) + len(tree.spines))}\n" in text
    ran = set(re.findall(r'^gpunet_scrape_collector_success\{collector="([^"]+)"\} 1\.0$', text,
                         re.M))
    assert ran == {"fabric"}
    steps = dict(re.findall(r'^gpunet_fabric_step_success\{step="([^"]+)"\} (\S+)$', text, re.M))
    assert steps and set(steps.values()) == {"1.0"}, steps
    assert "running as root" not in err
    assert "\ngpunet_hotplug_monitoring 0.0\n" in text  # --no-hotplug
