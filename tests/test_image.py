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

Root only (buildah's chroot isolation and podman without user namespaces mount file systems);
tests/run.sh installs buildah, mmdebstrap, podman and runc. `pytest -s` prints the time of
each step and the image's size (docs/container.md quotes them)."""

from __future__ import annotations

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
from support.metrics import parse, value
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
        context = tmp_path_factory.mktemp("context")
        version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(),
                            re.M).group(1)
        env = {**os.environ, "BUILDER": "buildah", "BASE": BASE, "PYTHON": sys.executable,
               "BUILD_CONTEXT": str(context)}
        cmd = [str(REPO / "container" / "build.sh"), *store.flags(), "--isolation", "chroot",
               "--pull=never"]
        lines: list[str] = []
        start = time.monotonic()
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL, env=env, start_new_session=True) as proc:
            # A mirror that stops answering: the script and the builder under it are killed.
            deadline = threading.Timer(BUILD_TIMEOUT, os.killpg, (proc.pid, signal.SIGKILL))
            deadline.start()
            try:
                assert proc.stdout is not None
                for line in proc.stdout:  # the wheels are made when the builder's line comes
                    if line.startswith("build.sh: buildah ") and WHEELS not in STEPS.seconds:
                        STEPS.seconds[WHEELS] = time.monotonic() - start
                        start = time.monotonic()
                    lines.append(line)
                rc = proc.wait()
            finally:
                deadline.cancel()
        STEPS.seconds["buildah bud, apt included (build.sh)"] = time.monotonic() - start
        log = "".join(lines)
        assert rc == 0, f"container/build.sh exited {rc} (killed after {BUILD_TIMEOUT} s: " \
                        f"-9):\n{log[-6000:]}"
        tag = f"gpunet-exporter:{version}"
        assert lines[-1].strip() == f"build.sh: built {tag}", log[-2000:]
        # The apt step ran here, from Debian, not from anything in the base.
        assert re.search(r"Setting up infiniband-diags .*\n", log), log[-6000:]
        info = store.inspect(f"localhost/{tag}")
        yield Image(store, f"localhost/{tag}", version, info["Config"], int(info["Size"]),
                    int(store.inspect(BASE)["Size"]))
    finally:
        subprocess.run(store.podman("rmi", "--all", "--force"), capture_output=True,
                       timeout=120)
        store.remove()


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
                "--read-only", "--read-only-tmpfs=false", "--log-driver=k8s-file",
                # podman's default limits (2^20) are above what a runner without
                # CAP_SYS_RESOURCE may set; the exporter needs few of either.
                "--ulimit=nofile=4096:4096", "--ulimit=nproc=4096:4096",
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
    print("steps: " + ", ".join(f"{k} {v:.1f} s" for k, v in STEPS.seconds.items()))
