"""The container image (issue 21; Containerfile, container/build.sh, docs/container.md), built
and run for real, without a registry or a cluster.

A minbase Debian 12 root filesystem made by mmdebstrap, slimmed as Debian's bookworm-slim is
(no man pages, documentation or translations), stands in for debian:bookworm-slim: it goes into
a private vfs store under a temporary folder as the Containerfile's BASE. container/build.sh
makes the wheels and builds the repository's Containerfile with buildah (chroot isolation): its
apt step downloads and installs the tools from Debian. podman (runc, host network) runs the
image as its unprivileged user with a read-only root filesystem and no writable /tmp, against
the example tree of a faulty DGX H100 node mounted where the image's default flags look
(/host/sys), and the exporter is scraped over loopback.

The Kubernetes manifests' containers run from the image as the kubelet would run them
(`kubelet_flags`: their users, groups and capabilities, read-only root, hostPaths, ConfigMaps and
emptyDirs as podman flags): the fleet probe pods' init container hands the host folder over,
their probe container (root with IPC_LOCK only, group 65534) writes pairs.json into it and locks
more memory than containerd's 8 MiB limit, and the example overlay's DaemonSet serves it.

Root only (buildah's chroot isolation and podman without user namespaces mount file systems);
tests/run.sh installs buildah, mmdebstrap, podman and runc. `pytest -s` prints the time of
each step and the image's size (docs/container.md quotes them)."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from gpunet_exporter import DEFAULT_PORT

from support.exporter import free_port
from support.kube import kustomize, render_exporter
from support.metrics import Samples, parse, value
from support.paths import REPO
from support.wait import wait_for

pytestmark = pytest.mark.slow  # about a minute: a Debian root filesystem, apt, a build

TREE = REPO / "examples" / "dgx-h100-faulty"
# Debian 12 as debian:bookworm-slim has it: its three suites, and dpkg leaving out what the slim
# images leave out (mmdebstrap writes the options into the root filesystem's dpkg.cfg.d).
SUITES = ["deb http://deb.debian.org/debian bookworm main",
          "deb http://deb.debian.org/debian bookworm-updates main",
          "deb http://deb.debian.org/debian-security bookworm-security main"]
SLIM = [f"--dpkgopt=path-{rule}" for rule in (
    "exclude=/usr/share/man/*", "exclude=/usr/share/info/*", "exclude=/usr/share/doc/*",
    "include=/usr/share/doc/*/copyright", "exclude=/usr/share/locale/*")]
BASE = "localhost/gpunet-test-bookworm-minbase:latest"
NOBODY = "65534"
# The exporter's own part of the image (everything above the base): 119 MB measured (Python,
# the Debian tools, perl for infiniband-diags, the virtualenv). CUDA or PyTorch would be GBs.
ADDED_LIMIT = 150 << 20
# The stand-in base is the size of debian:bookworm-slim (75 MB): the whole image stays below this.
IMAGE_LIMIT = 256 << 20
TOOLS = ("buildah", "mmdebstrap", "podman", "runc")
WHEELS = "wheels (build.sh)"
# podman's default limits (2^20) are above what a runner without CAP_SYS_RESOURCE may set; the
# exporter needs few of either.
ULIMITS = ["--ulimit=nofile=4096:4096", "--ulimit=nproc=4096:4096"]
BUILD_TIMEOUT = 600  # seconds; the build takes about 20 s with the mirror near


@dataclass
class Steps:
    """How long each step took, in order (printed at the end; never asserted)."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = time.monotonic() - start


STEPS = Steps()


@pytest.fixture(scope="module", autouse=True)
def print_steps() -> Iterator[None]:
    """Each step's time, printed after the module (`pytest -s`)."""
    yield
    print("\nsteps: " + ", ".join(f"{k} {v:.1f} s" for k, v in STEPS.seconds.items()))


def run(cmd: list[str], timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    """``cmd``, which must succeed; its output, the tail of it, in the failure."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                         stdin=subprocess.DEVNULL, **kw)
    assert out.returncode == 0, (f"{' '.join(cmd)} exited {out.returncode}:\n"
                                 f"{(out.stdout + out.stderr)[-4000:]}")
    return out


def require() -> None:
    """Skip where the tools cannot work; fail where they are only missing."""
    if os.geteuid() != 0:
        pytest.skip("building (buildah, chroot isolation) and running (podman, runc) the image "
                    "without user namespaces needs root")
    missing = [t for t in TOOLS if shutil.which(t) is None]
    assert not missing, f"{', '.join(missing)} required (tests/run.sh installs them as root)"
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no mount namespace here (buildah and podman need one): "
                    f"{probe.stderr.strip()}")


@dataclass(frozen=True)
class Store:
    """A private containers/storage (vfs: no overlay or fuse needed) that buildah and podman
    share, and nothing of the host's."""

    path: Path

    def flags(self) -> list[str]:
        return ["--root", str(self.path / "root"), "--runroot", str(self.path / "run"),
                "--storage-driver", "vfs"]

    def buildah(self, *args: str) -> list[str]:
        return ["buildah", *self.flags(), *args]

    def podman(self, *args: str) -> list[str]:
        # runc, not the default crun, which refuses hosts with cgroups v1 and v2 mounted at
        # once; cgroupfs and no events: no systemd or journald needed.
        return ["podman", *self.flags(), "--tmpdir", str(self.path / "tmp"), "--runtime", "runc",
                "--cgroup-manager", "cgroupfs", "--events-backend", "none", *args]

    def inspect(self, image: str) -> dict[str, Any]:
        return json.loads(run(self.podman("image", "inspect", image)).stdout)[0]

    def remove(self) -> None:
        """The store's folder, unless something is still mounted under it (a bind mount of the
        example tree would be deleted through)."""
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        if any(line.split()[4].startswith(str(self.path)) for line in mounts):
            print(f"{self.path}: mounts left under it, not removed")
            return
        shutil.rmtree(self.path, ignore_errors=True)


@dataclass(frozen=True)
class Image:
    store: Store
    tag: str
    version: str
    config: dict[str, Any]  # the OCI image configuration (podman image inspect)
    size: int
    base_size: int


def project_version() -> str:
    found = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert found
    return found.group(1)


VERSION = project_version()


def build(store: Store, context: Path, image: str, env: dict[str, str], step: str) -> str:
    """container/build.sh with buildah (chroot isolation, nothing pulled) into ``store``, for
    ``image`` (exporter or probe); its output. The wheels' time and the build's go to STEPS."""
    env = {**os.environ, **env, "BUILDER": "buildah", "IMAGE": image, "PYTHON": sys.executable,
           "BUILD_CONTEXT": str(context)}
    cmd = [str(REPO / "container" / "build.sh"), *store.flags(), "--isolation", "chroot",
           "--pull=never"]
    lines: list[str] = []
    start = time.monotonic()
    wheels = f"{WHEELS}, {image}"
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL, env=env, start_new_session=True) as proc:
        # A mirror that stops answering: the script and the builder under it are killed.
        deadline = threading.Timer(BUILD_TIMEOUT, os.killpg, (proc.pid, signal.SIGKILL))
        deadline.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:  # the wheels are made when the builder's line comes
                if line.startswith("build.sh: buildah ") and wheels not in STEPS.seconds:
                    STEPS.seconds[wheels] = time.monotonic() - start
                    start = time.monotonic()
                lines.append(line)
            rc = proc.wait()
        finally:
            deadline.cancel()
    STEPS.seconds[step] = time.monotonic() - start
    log = "".join(lines)
    assert rc == 0, f"container/build.sh exited {rc} (killed after {BUILD_TIMEOUT} s: " \
                    f"-9):\n{log[-6000:]}"
    return log


@pytest.fixture(scope="session")
def base_rootfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A minbase Debian 12 root filesystem as a tarball, made once a session."""
    require()
    tar = tmp_path_factory.mktemp("rootfs") / "bookworm-minbase.tar"
    with STEPS.step("mmdebstrap minbase bookworm"):
        # Merged /usr by mmdebstrap's hook (bookworm's default) rather than with the usrmerge
        # package, which would pull perl into the base.
        run(["mmdebstrap", "--quiet", "--variant=minbase", *SLIM,
             "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr", "bookworm", str(tar), *SUITES],
            timeout=600)
    yield tar
    tar.unlink()


@pytest.fixture(scope="module")
def image(base_rootfs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Image]:
    """The repository's Containerfile built by container/build.sh on the stand-in base."""
    store = Store(tmp_path_factory.mktemp("store"))
    try:
        with STEPS.step("import the base"):
            work = run(store.buildah("from", "scratch")).stdout.strip()
            run(store.buildah("add", "--quiet", work, str(base_rootfs), "/"))
            run(store.buildah("config", "--env",
                              "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                              work))
            run(store.buildah("commit", "--quiet", "--rm", work, BASE))
        log = build(store, tmp_path_factory.mktemp("context"), "exporter",
                    {"BASE": BASE}, "buildah bud, apt included (build.sh)")
        tag = f"gpunet-exporter:{VERSION}"
        assert log.splitlines()[-1].strip() == f"build.sh: built {tag}", log[-2000:]
        # The apt step ran here, from Debian, not from anything in the base.
        assert re.search(r"Setting up infiniband-diags .*\n", log), log[-6000:]
        info = store.inspect(f"localhost/{tag}")
        yield Image(store, f"localhost/{tag}", VERSION, info["Config"], int(info["Size"]),
                    int(store.inspect(BASE)["Size"]))
    finally:
        subprocess.run(store.podman("rmi", "--all", "--force"), capture_output=True,
                       timeout=120)
        store.remove()


GET = ("import sys, urllib.request; "
       "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())")


@dataclass
class Running:
    image: Image
    name: str
    url: str
    pid: int

    def podman(self, *args: str) -> list[str]:
        return self.image.store.podman(*args)

    def exec(self, script: str) -> subprocess.CompletedProcess[str]:
        """A shell script in the running container, as its user; not checked."""
        return subprocess.run(self.podman("exec", self.name, "sh", "-c", script),
                              capture_output=True, text=True, timeout=60)

    def state(self) -> dict[str, Any]:
        return json.loads(run(self.podman("inspect", self.name)).stdout)[0]["State"]

    def logs(self) -> str:
        out = subprocess.run(self.podman("logs", self.name), capture_output=True, text=True,
                             timeout=60)
        return out.stdout + out.stderr

    def metrics(self) -> str:
        r = requests.get(f"{self.url}/metrics", timeout=30)
        r.raise_for_status()
        return r.text

    def get_inside(self, path: str) -> str | None:
        """GET ``url + path`` from inside the container (its own network namespace); None
        when that fails."""
        out = subprocess.run(self.podman("exec", self.name, "/opt/gpunet-exporter/bin/python",
                                         "-c", GET, self.url + path),
                             capture_output=True, text=True, timeout=60)
        return out.stdout if out.returncode == 0 else None


@pytest.fixture(scope="module")
def exporter(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    """The image's entrypoint with its default flags and two more (a loopback port and a
    configuration file), the example tree at /host/sys, the host's /proc at /host/proc."""
    conf = tmp_path_factory.mktemp("conf") / "gpunet.yml"
    # PFC configuration from the tree's recorded `mlnx_qos -i` reports, replayed by the tree's
    # script (a shell script run by the exporter inside the image), not from the host's NICs.
    conf.write_text(yaml.safe_dump({"pfc": {"config": {
        "sources": ["mlnx_qos"], "mlnx_qos_path": "/host/mlnx_qos/mlnx_qos"}}}))
    conf.chmod(0o644)
    port = free_port()
    name = f"gpunet-image-test-{uuid.uuid4().hex[:8]}"
    store = image.store
    args = [*image.config["Cmd"], f"--web.listen-address=127.0.0.1:{port}",
            "--config.file=/etc/gpunet-exporter/gpunet.yml"]
    try:
        with STEPS.step("podman run (vfs copies the image)"):
            run(store.podman(
                "run", "--detach", "--name", name, "--pull=never", "--network=host",
                "--read-only", "--read-only-tmpfs=false", "--log-driver=k8s-file", *ULIMITS,
                f"--volume={TREE / 'sys'}:/host/sys:ro", "--volume=/proc:/host/proc:ro",
                f"--volume={TREE / 'mlnx_qos'}:/host/mlnx_qos:ro",
                f"--volume={conf}:/etc/gpunet-exporter/gpunet.yml:ro",
                image.tag, *args))
        c = Running(image, name, f"http://127.0.0.1:{port}", 0)

        def healthy() -> bool:
            if not c.state()["Running"]:
                raise AssertionError(f"the container stopped:\n{c.logs()}")
            return requests.get(f"{c.url}/-/healthy", timeout=2).status_code == 200

        with STEPS.step("exporter up"):
            wait_for(healthy, f"the exporter in the container to answer {c.url}", timeout=60,
                     ignore=(requests.ConnectionError,))
        c.pid = int(c.state()["Pid"])
        yield c
    finally:
        subprocess.run(store.podman("rm", "--force", "--time", "10", name), capture_output=True,
                       timeout=120)


def test_the_image_says_what_it_is(image: Image) -> None:
    cfg = image.config
    assert cfg["User"] == f"{NOBODY}:{NOBODY}"
    assert cfg["Entrypoint"] == ["/opt/gpunet-exporter/bin/gpunet-exporter"]
    assert cfg["Cmd"] == ["--path.sysfs=/host/sys", "--path.procfs=/host/proc"]
    assert set(cfg["ExposedPorts"]) == {f"{DEFAULT_PORT}/tcp"}
    labels = cfg["Labels"]
    assert labels["org.opencontainers.image.version"] == image.version
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.title"] == "gpunet-exporter"
    assert labels["org.opencontainers.image.source"].startswith("https://")


def rate(device: str) -> float:
    """The port's rate in bytes per second, from the tree's file ("400 Gb/sec (4X NDR)")."""
    text = (TREE / "sys" / "class" / "infiniband" / device / "ports" / "1" / "rate").read_text()
    return float(text.split()[0]) * 125_000_000


def test_the_exporter_in_the_image_reads_the_mounted_tree(exporter: Running) -> None:
    """Values of the faulty example node, as its files say, through the image's default
    --path.sysfs: a port trained down to 200 Gb/s beside 400 Gb/s ones, a port down, a RoCE
    netdev at MTU 1500, and PFC on priority 5 instead of 3 (from the replayed mlnx_qos)."""
    def pfc_read() -> str | None:
        text = exporter.metrics()
        return text if value(parse(text), "gpunet_pfc_config_refresh_success",
                             interface="enp170s0f0np0") == 1 else None

    s = parse(wait_for(pfc_read, "the background mlnx_qos run of enp170s0f0np0"))
    assert rate("mlx5_5") == 200 * 125_000_000 and rate("mlx5_0") == 400 * 125_000_000
    for device in ("mlx5_0", "mlx5_5"):
        assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device=device,
                     port="1") == rate(device)
    assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_3", port="1") == 1  # DOWN
    assert value(s, "gpunet_infiniband_port_state_id", device="mlx5_0", port="1") == 4
    mtu = int((TREE / "sys" / "class" / "net" / "enp41s0f0np0" / "mtu").read_text())
    assert mtu == 1500
    assert value(s, "gpunet_link_mtu_bytes", interface="enp41s0f0np0") == mtu
    assert value(s, "gpunet_pfc_enabled", interface="enp170s0f0np0", priority="5") == 1
    assert value(s, "gpunet_pfc_enabled", interface="enp170s0f0np0", priority="3") == 0
    for collector in ("infiniband", "link", "pfc", "gpu", "topology", "nccl"):
        assert value(s, "gpunet_scrape_collector_success", collector=collector) == 1, collector


def test_it_runs_as_nobody_without_capabilities(exporter: Running) -> None:
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{exporter.pid}/status").read_text().splitlines())
    assert status["Uid"].split() == [NOBODY] * 4
    assert status["Gid"].split() == [NOBODY] * 4
    assert "gpunet-exporter" in Path(f"/proc/{exporter.pid}/cmdline").read_text()
    for cap in ("CapEff", "CapPrm", "CapAmb"):
        assert int(status[cap], 16) == 0, cap


def test_the_root_filesystem_is_read_only_and_the_exporter_needs_no_more(
        exporter: Running) -> None:
    """Started with no writable place (no tmpfs on /tmp either), it served the scrapes above;
    a write anywhere in the image fails."""
    for path in ("/x", "/tmp/x", "/opt/gpunet-exporter/x"):
        out = exporter.exec(f"touch {path}")
        assert out.returncode != 0 and "Read-only file system" in out.stderr, (path, out)
    assert "gpunet_scrape_collector_success" in exporter.metrics()


def test_the_collectors_tools_run_in_the_image(exporter: Running) -> None:
    """Each tool a collector calls, run as the image's user: it finds its libraries."""
    versions = {
        "ethtool --version": "ethtool version",  # pfc, pfc.stats_source: ethtool
        "ip -V": "iproute2",
        "dcb -V": "iproute2",  # pfc's QoS configuration without mlnx_qos
        "ibnetdiscover --version": "BUILD VERSION",  # fabric
        "iblinkinfo --version": "BUILD VERSION",
        "ibqueryerrors --version": "BUILD VERSION",
        "dump_fts --version": "BUILD VERSION",
    }
    for cmd, want in versions.items():
        out = exporter.exec(cmd)
        assert out.returncode == 0 and want in out.stdout + out.stderr, (cmd, out)
    # link: ibv_devinfo, with the mlx5 verbs provider it needs to see a ConnectX port
    out = exporter.exec("command -v ibv_devinfo && ls /usr/lib/*/libibverbs/libmlx5-rdmav*.so")
    assert out.returncode == 0, out


def test_the_image_has_no_probe_stack_and_stays_small(exporter: Running) -> None:
    """No PyTorch, CUDA or NCCL (the probe runs from an image of its own): not importable, and
    no such file anywhere in the image."""
    out = exporter.exec("python -c 'import importlib.util as u; print(u.find_spec(\"torch\"))'")
    assert out.returncode == 0 and out.stdout.strip() == "None", out
    store, img = exporter.image.store, exporter.image
    root = Path(run(store.podman("image", "mount", img.tag)).stdout.strip())
    try:
        found = []
        for folder, dirs, files in os.walk(root):
            for name in dirs + files:
                if (name in ("torch", "nvidia", "triton")
                        or re.match(r"lib(cudart|cublas|cudnn|nccl|torch|nvrtc)", name)):
                    found.append(str(Path(folder, name).relative_to(root)))
        assert (root / "opt/gpunet-exporter/bin/gpunet-exporter").is_file()
        assert not found, found
    finally:
        run(store.podman("image", "unmount", img.tag))
    added = img.size - img.base_size
    print(f"image {img.tag}: {img.size / 1e6:.1f} MB, of which the base {img.base_size / 1e6:.1f} "
          f"MB and the exporter's part {added / 1e6:.1f} MB")
    assert added < ADDED_LIMIT, added
    assert img.size < IMAGE_LIMIT, img.size


def test_it_stops_cleanly_on_sigterm(exporter: Running) -> None:
    """`podman stop` (as a kubelet does): SIGTERM to the exporter, process 1 of the container."""
    with STEPS.step("podman stop"):
        run(exporter.podman("stop", "--time", "20", exporter.name), timeout=60)
    state = exporter.state()
    logs = exporter.logs()
    assert state["ExitCode"] == 0, logs
    assert "received SIGTERM, shutting down" in logs
    assert "Traceback" not in logs, logs


# -- the Kubernetes manifests' containers, run from the image ----------------------------------

KUBE = REPO / "kubernetes"
# containerd's RLIMIT_MEMLOCK under its systemd unit (systemd's default LimitMEMLOCK, 8 MiB),
# which every container of a Kubernetes node inherits: Kubernetes has no field to raise it.
MEMLOCK = 8 << 20
CAP_IPC_LOCK = 1 << 14


def kubelet_flags(docs: list[dict[str, Any]], pod: dict[str, Any], c: dict[str, Any],
                  nodes: dict[str, Path], folder: Path) -> list[str]:
    """podman flags for container ``c`` of ``pod`` as a kubelet with containerd runs it: the
    user and group (the container's over the pod's; no group: the user's own, as containerd
    takes it from the image), the capabilities dropped and added (never ambient: Kubernetes
    has none, so an added capability of a non-root user would not take effect, and this fails
    on one), a read-only root, no new privileges, the host PID namespace, the environment's
    values, and the volumes: a hostPath as the test folder ``nodes`` maps its node path to, a
    ConfigMap written out from ``docs`` under ``folder``, an emptyDir as a tmpfs of mode 0777.
    Not the network: the caller says which. The entrypoint stays the image's unless ``c`` has
    a command."""
    psc, sc = pod.get("securityContext", {}), c["securityContext"]
    uid = sc.get("runAsUser", psc.get("runAsUser"))
    gid = sc.get("runAsGroup", psc.get("runAsGroup"))
    assert uid is not None, "every container of the manifests says its user"
    assert not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) and uid == 0)
    caps = sc["capabilities"]
    assert caps["drop"] == ["ALL"]
    assert uid == 0 or not caps.get("add"), f"{c['name']}: capabilities for uid {uid} are inert"
    flags = [f"--user={uid}" + ("" if gid is None else f":{gid}"), "--cap-drop=ALL",
             *(f"--cap-add={cap}" for cap in caps.get("add", []))]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    flags.append("--security-opt=no-new-privileges")
    if sc.get("readOnlyRootFilesystem"):
        flags += ["--read-only", "--read-only-tmpfs=false"]
    if pod.get("hostPID"):
        flags.append("--pid=host")
    for e in c.get("env", []):
        if "value" in e:
            flags.append(f"--env={e['name']}={e['value']}")
    if "command" in c:
        flags.append("--entrypoint=" + json.dumps(c["command"]))
    volumes = {v["name"]: v for v in pod["volumes"]}
    for m in c.get("volumeMounts", []):
        v, ro = volumes[m["name"]], bool(m.get("readOnly"))
        if "hostPath" in v:
            flags.append(f"--volume={nodes[v['hostPath']['path']]}:{m['mountPath']}"
                         + (":ro" if ro else ""))
        elif "configMap" in v:
            [cm] = [d for d in docs if d["kind"] == "ConfigMap"
                    and d["metadata"]["name"] == v["configMap"]["name"]]
            out = folder / f"configmap-{cm['metadata']['name']}"
            out.mkdir(mode=0o755, exist_ok=True)
            for name, text in cm["data"].items():
                (out / name).write_text(text, encoding="utf-8")
                (out / name).chmod(0o644)
            flags.append(f"--volume={out}:{m['mountPath']}:ro")
        else:
            size = v["emptyDir"].get("sizeLimit")
            flags.append(f"--mount=type=tmpfs,destination={m['mountPath']},tmpfs-mode=0777"
                         + (f",tmpfs-size={quantity(size)}" if size else "")
                         + (",ro=true" if ro else ""))
    return flags


def quantity(text: str) -> int:
    """A Kubernetes quantity in bytes (the binary suffixes the manifests use: 16Mi, 1Gi)."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(text[:-2]) * units[text[-2:]] if text[-2:] in units else int(text)


@dataclass(frozen=True)
class Manifests:
    exporter: list[dict[str, Any]]  # the example overlay, kubernetes/exporter/
    fleet: list[dict[str, Any]]  # the fleet probes, kubernetes/

    def fleet_pod(self) -> dict[str, Any]:
        [cron] = [d for d in self.fleet if d["kind"] == "CronJob"]
        return dict(cron["spec"]["jobTemplate"]["spec"]["template"]["spec"])


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> Manifests:
    home = tmp_path_factory.mktemp("kubectl-home")
    return Manifests(kustomize(KUBE / "exporter", home), kustomize(KUBE, home))


def daemonset_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [ds] = [d for d in docs if d["kind"] == "DaemonSet"]
    return dict(ds["spec"]["template"]["spec"])


def exporter_config_map(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ConfigMap of the exporter's config.yml (its name has kustomize's hash appended)."""
    [cm] = [d for d in docs if d["kind"] == "ConfigMap"
            and d["metadata"]["name"].startswith("gpunet-exporter-config")]
    return cm


def container_named(pod: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    [c] = [c for c in pod["initContainers" if init else "containers"] if c["name"] == name]
    return dict(c)


def podman_once(image: Image, flags: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """One container of ``image`` run to its end in a network namespace of its own; not
    checked."""
    return subprocess.run(image.store.podman(
        "run", "--rm", "--pull=never", "--network=none", *ULIMITS, *flags, image.tag, *args),
        capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


@contextmanager
def as_pod(image: Image, docs: list[dict[str, Any]], pod: dict[str, Any], c: dict[str, Any],
           nodes: dict[str, Path], tmp: Path) -> Iterator[Running]:
    """Container ``c`` of ``pod`` started from ``image`` as the kubelet would (kubelet_flags),
    in a network namespace of its own, with its arguments; its url is its metrics port's, seen
    from inside. Removed at the end."""
    name = f"gpunet-pod-test-{uuid.uuid4().hex[:8]}"
    run(image.store.podman("run", "--detach", "--name", name, "--pull=never", "--network=none",
                           "--log-driver=k8s-file", *ULIMITS,
                           *kubelet_flags(docs, pod, c, nodes, tmp), image.tag, *c["args"]))
    try:
        port = next(p["containerPort"] for p in c["ports"] if p["name"] == "metrics")
        yield Running(image, name, f"http://127.0.0.1:{port}", 0)
    finally:
        subprocess.run(image.store.podman("rm", "--force", "--time", "10", name),
                       capture_output=True, timeout=120)


PROBE_STATE = "/var/lib/gpunet-exporter/probe"


def run_init(image: Image, docs: list[dict[str, Any]], pod: dict[str, Any], folder: Path,
             tmp: Path) -> None:
    """``pod``'s init container probe-state-owner, run on ``folder`` as the node's probe
    folder."""
    init = container_named(pod, "probe-state-owner", init=True)
    out = podman_once(image, kubelet_flags(docs, pod, init, {PROBE_STATE: folder}, tmp))
    assert out.returncode == 0, out.stdout + out.stderr


def hand_over(image: Image, manifests: Manifests, folder: Path, tmp: Path) -> None:
    """The fleet probe pods' init container, run on ``folder``."""
    run_init(image, manifests.fleet, manifests.fleet_pod(), folder, tmp)


def owner_and_mode(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_uid, st.st_gid, st.st_mode & 0o7777


@pytest.fixture(scope="module")
def probe_folder(image: Image, manifests: Manifests,
                 tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node's /var/lib/gpunet-exporter/probe as the kubelet makes it for a hostPath of
    type DirectoryOrCreate (root's, 0755), after the fleet probe pods' init container."""
    folder = tmp_path_factory.mktemp("node") / "probe"
    folder.mkdir(mode=0o755)
    os.chown(folder, 0, 0)
    hand_over(image, manifests, folder, tmp_path_factory.mktemp("init"))
    return folder


def test_the_init_container_gives_the_probe_folder_to_the_exporter(
        image: Image, manifests: Manifests, probe_folder: Path, tmp_path: Path) -> None:
    """As root with only CHOWN: the kubelet's folder becomes 65534's, group-writable; run again
    it changes nothing, and a folder another user owns (the systemd unit's exporter) is left
    as it is."""
    assert owner_and_mode(probe_folder) == (65534, 65534, 0o775)
    hand_over(image, manifests, probe_folder, tmp_path)
    assert owner_and_mode(probe_folder) == (65534, 65534, 0o775)
    other = tmp_path / "theirs"
    other.mkdir(mode=0o700)
    os.chown(other, 4321, 4321)
    hand_over(image, manifests, other, tmp_path)
    assert owner_and_mode(other) == (4321, 4321, 0o700)


# Run in the fleet probe container's place: pairs.json written as `gpunet-probe fleet` writes
# it, then 64 MiB locked as RDMA memory registration locks it, and what the process had.
FLEET_STAND_IN = """
import ctypes, json, mmap, os, resource, time
from gpunet_exporter.probe import pairs
pairs.write(os.environ["STATE"], pairs.Pairs(node="node-a", plan="ring",
    round_timestamp=time.time(), pairs=(pairs.Pair(peer="node-b", ok=True,
    latency_seconds=2.5e-05, bus_bandwidth_bytes_per_second=4.6e10, transport="IB",
    gdr=True),)))
buf = mmap.mmap(-1, 64 << 20)
libc = ctypes.CDLL(None, use_errno=True)
address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
rc = libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(len(buf)))
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
print(json.dumps({"mlock": rc, "errno": ctypes.get_errno(),
                  "memlock": resource.getrlimit(resource.RLIMIT_MEMLOCK)[0],
                  "locked_kib": int(status["VmLck"].split()[0]),
                  "uid": os.getuid(), "gid": os.getgid(),
                  "cap_eff": int(status["CapEff"], 16), "cap_amb": int(status["CapAmb"], 16)}))
"""


def fleet_stand_in(image: Image, manifests: Manifests, folder: Path, tmp: Path,
                   without: str | None = None) -> dict[str, Any]:
    pod = manifests.fleet_pod()
    c = container_named(pod, "probe")
    c.pop("command")  # torchrun: the image has no torch; the stand-in runs in its place
    if without:
        sc = copy.deepcopy(c["securityContext"])
        sc["capabilities"]["add"].remove(without)
        c["securityContext"] = sc
    flags = kubelet_flags(manifests.fleet, pod, c, {PROBE_STATE: folder, "/proc": Path("/proc")},
                          tmp)
    out = podman_once(image, [*flags, f"--ulimit=memlock={MEMLOCK}:{MEMLOCK}",
                              f"--env=STATE={PROBE_STATE}",
                              '--entrypoint=["/opt/gpunet-exporter/bin/python", "-c"]'],
                      FLEET_STAND_IN)
    assert out.returncode == 0, out.stdout + out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_fleet_probe_container_writes_the_folder_and_locks_memory(
        image: Image, manifests: Manifests, probe_folder: Path, tmp_path: Path) -> None:
    """Root in group 65534 with IPC_LOCK alone: it writes pairs.json into the handed-over
    folder through the group (no DAC_OVERRIDE) and locks 64 MiB past the 8 MiB limit, which
    the same container without IPC_LOCK cannot."""
    got = fleet_stand_in(image, manifests, probe_folder, tmp_path)
    assert (got["uid"], got["gid"]) == (0, 65534)
    assert got["cap_eff"] == CAP_IPC_LOCK and got["cap_amb"] == 0
    assert got["memlock"] == MEMLOCK
    assert got["mlock"] == 0 and got["locked_kib"] >= 64 << 10, got
    written = probe_folder / "pairs.json"
    assert owner_and_mode(written) == (0, 65534, 0o644)
    elsewhere = tmp_path / "elsewhere"  # root's: this one's pairs.json stays out of the way
    elsewhere.mkdir()
    without = fleet_stand_in(image, manifests, elsewhere, tmp_path, without="IPC_LOCK")
    assert without["cap_eff"] == 0 and without["memlock"] == MEMLOCK
    assert without["mlock"] == -1 and without["errno"] in (errno.ENOMEM, errno.EPERM), without


def test_the_daemonset_runs_the_image_as_rendered(
        image: Image, manifests: Manifests, probe_folder: Path, tmp_path: Path) -> None:
    """The example overlay's DaemonSet (fleet-results on): its arguments, environment, user,
    capabilities and volumes, the config.yml of its ConfigMap, the example tree as the node's
    /sys and the handed-over probe folder. One difference from a node: a network namespace of
    its own rather than the host's, so that the fixed port 19400 meets nothing on this machine
    (the tree, not the host's netdevs, is what is read). Its liveness and readiness probes are
    answered, and it serves the tree's values and the pair the fleet probe wrote."""
    if not (probe_folder / "pairs.json").exists():
        fleet_stand_in(image, manifests, probe_folder, tmp_path)  # run alone (-k)
    pod = daemonset_pod(manifests.exporter)
    c = container_named(pod, "exporter")
    nodes = {"/sys": TREE / "sys", "/proc": Path("/proc"), PROBE_STATE: probe_folder}
    with as_pod(image, manifests.exporter, pod, c, nodes, tmp_path) as running:
        ports = {p["name"] for p in c["ports"]}
        for probe in ("livenessProbe", "readinessProbe"):
            http = c[probe]["httpGet"]
            assert http["port"] in ports
            wait_for(lambda path=http["path"]: running.get_inside(path) is not None,
                     f"the DaemonSet's {probe} ({http['path']})", timeout=60)

        def pair_served() -> Samples | None:  # pairs.json is read in the background
            s = parse(running.get_inside("/metrics") or "")
            return s if value(s, "gpunet_fleet_pair_success", peer="node-b") is not None \
                else None

        s = wait_for(pair_served, "the fleet probe's pair in the exporter's metrics")
        for device in ("mlx5_0", "mlx5_5"):
            assert value(s, "gpunet_infiniband_port_rate_bytes_per_second", device=device,
                         port="1") == rate(device)
        assert value(s, "gpunet_fleet_pair_success", peer="node-b") == 1
        assert value(s, "gpunet_fleet_pair_bus_bandwidth_bytes_per_second",
                     peer="node-b") == 4.6e10
        for collector in ("infiniband", "link", "gpu", "topology", "nccl", "probe"):
            assert value(s, "gpunet_scrape_collector_success", collector=collector) == 1, \
                collector
        # the one file it writes, on its emptyDir, with the root read-only
        inventory = yaml.safe_load(exporter_config_map(manifests.exporter)["data"][
            "config.yml"])["infiniband"]["inventory_state_file"]
        wait_for(lambda: running.exec(f"test -s {inventory}").returncode == 0,
                 f"the exporter to write {inventory}")
        pid = int(running.state()["Pid"])
        status = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines())
        assert status["Uid"].split() == [NOBODY] * 4 and int(status["CapEff"], 16) == 0
        grace = pod["terminationGracePeriodSeconds"]
        run(running.podman("stop", "--time", str(grace), running.name), timeout=grace + 60)
        assert running.state()["ExitCode"] == 0


# -- the probe's image and the DaemonSet's probe component -------------------------------------

@pytest.fixture(scope="module")
def probe_image(image: Image, tmp_path_factory: pytest.TempPathFactory) -> Image:
    """container/Containerfile.probe built by `IMAGE=probe container/build.sh` on the exporter's
    image: the `probe` extra's wheels, which are PyTorch's CPU build on this machine (pip's
    find-links), CUDA's from PyPI elsewhere."""
    log = build(image.store, tmp_path_factory.mktemp("probe-context"), "probe",
                {"EXPORTER": image.tag}, "buildah bud, the probe's image (build.sh)")
    tag = f"gpunet-exporter-probe:{VERSION}"
    assert log.splitlines()[-1].strip() == f"build.sh: built {tag}", log[-2000:]
    info = image.store.inspect(f"localhost/{tag}")
    return Image(image.store, f"localhost/{tag}", VERSION, info["Config"], int(info["Size"]),
                 image.size)


def test_the_probe_image_is_the_exporter_s_with_torch(probe_image: Image, image: Image,
                                                      manifests: Manifests,
                                                      tmp_path: Path) -> None:
    cfg = probe_image.config
    assert cfg["User"] == f"{NOBODY}:{NOBODY}"
    assert cfg["Entrypoint"] == image.config["Entrypoint"] and cfg["Cmd"] == image.config["Cmd"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    assert cfg["Labels"]["org.opencontainers.image.version"] == VERSION
    out = podman_once(probe_image, ["--read-only", "--read-only-tmpfs=false", "--entrypoint",
                                    "/opt/gpunet-exporter/bin/python"], "-c",
                      "import torch, torch.distributed as d; print(torch.__version__, "
                      "d.is_available(), d.is_gloo_available())")
    assert out.returncode == 0, out.stdout + out.stderr
    version, available, gloo = out.stdout.split()
    assert version.startswith("2.") and available == gloo == "True"
    # the fleet probe pods' command (torchrun, found on the PATH) with their privileges
    pod = manifests.fleet_pod()
    flags = kubelet_flags(manifests.fleet, pod, container_named(pod, "probe"),
                          {PROBE_STATE: tmp_path, "/proc": Path("/proc")}, tmp_path)
    out = podman_once(probe_image, flags, "--help")
    assert out.returncode == 0 and "--rdzv-backend" in out.stdout, out.stdout + out.stderr
    print(f"image {probe_image.tag}: {probe_image.size / 1e6:.1f} MB")


def test_the_probe_component_runs_rounds_in_the_probe_image(
        probe_image: Image, tmp_path: Path) -> None:
    """The DaemonSet with the probe component, from the probe's image as its images: would
    make it: its runner (gpunet-probe as a child of the exporter, uid 65534, read-only root,
    the host's PID namespace, /dev/shm on its emptyDir) runs rounds into the handed-over host
    folder and the exporter serves them. With `probe.backend: gloo` and two ranks on CPU, the
    same code as NCCL's on GPUs (no GPU here); the rest of the ConfigMap as rendered."""
    docs = render_exporter(tmp_path / "render", "probe")
    cm = exporter_config_map(docs)
    cfg = yaml.safe_load(cm["data"]["config.yml"])
    assert cfg["probe"]["runner"] == "intra"
    cfg["probe"].update({"backend": "gloo", "nprocs": 2, "sizes": [4096], "warmup": 1,
                         "iterations": 4, "scopes": ["intra"], "interval_seconds": 5})
    cm["data"]["config.yml"] = yaml.safe_dump(cfg)
    pod = daemonset_pod(docs)
    folder = tmp_path / "node" / "probe"
    folder.mkdir(parents=True, mode=0o755)  # the kubelet's, root's
    run_init(probe_image, docs, pod, folder, tmp_path)
    assert owner_and_mode(folder) == (65534, 65534, 0o775)
    c = container_named(pod, "exporter")
    nodes = {"/sys": TREE / "sys", "/proc": Path("/proc"), PROBE_STATE: folder}
    with as_pod(probe_image, docs, pod, c, nodes, tmp_path) as running:

        def round_served() -> Samples | None:
            s = parse(running.get_inside("/metrics") or "")
            return s if value(s, "gpunet_probe_success", scope="intra") is not None else None

        def logs() -> str:
            log = folder / "runner.log"
            return log.read_text(errors="replace")[-4000:] if log.exists() else "(no runner.log)"

        with STEPS.step("the probe component's first round served"):
            s = wait_for(round_served, "a probe round served by the exporter", timeout=180)
        assert value(s, "gpunet_probe_success", scope="intra") == 1, logs()
        assert value(s, "gpunet_probe_world_size", scope="intra") == 2
        result = folder / "intra.json"
        assert result.stat().st_uid == 65534 and json.loads(result.read_text())["success"]
