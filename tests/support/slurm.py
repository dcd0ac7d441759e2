"""A real Slurm cluster on one host: one slurmctld and ``n`` slurmd "nodes", each slurmd in a
network namespace of its own (tests/support/netns.py's fleet: a veth into a bridge, its own
address), its own UTS namespace (hostname ``n<i>``) and its own mount namespace, in which
``/var/lib/gpunet-exporter`` is that node's own directory, as on real nodes.

Layout of ``cluster(n)``:

- a root directory ``/tmp/gpunet-slurm-<pid>-<random>/`` (mode 0755: munged wants every
  directory above its socket searchable by all) with ``slurm.conf``, ``cgroup.conf``, an empty
  ``plugstack.conf``, ``munge/`` (a fresh key, mode 0700), ``run/munge.sock``, ``ctl/`` (the
  controller's state, log and pid file) and ``nodes/n<i>/`` (each node's spool, log, pid file and
  ``state/``, its ``/var/lib/gpunet-exporter``);
- ``munged -F`` in the host's namespaces, on that private socket (``AuthInfo=socket=...``;
  the host's own munged, if any, is not used). A path socket is reached from every network
  namespace, so the daemons in the namespaces use it too;
- a fleet of ``n + 1`` namespaces: ``n<i>`` for the nodes (``10.233.0.<i+1>``), the last one
  for ``slurmctld -D`` (hostname ``ctl``, ``SlurmctldHost=ctl(<its address>)``). Client commands
  (``sbatch``, ``sinfo``, ``scontrol``) run in the controller's namespace (``Cluster.run``): the
  host's namespace has no route to the bridge, on purpose (netns.py);
- names: ``/etc/netns/<namespace>/hosts`` maps ``n<i>`` and ``ctl`` to their addresses;
  ``ip netns exec`` bind-mounts it over ``/etc/hosts`` for everything started in the
  namespace, so the nodes (and the jobs, which slurmd starts in its own namespaces) resolve each
  other by name, as the batch script's ``MASTER_ADDR=n0`` needs;
- each slurmd starts as ``ip netns exec NS unshare --uts --mount --propagation private sh -c
  'hostname n<i> && mount --bind <node>/state /var/lib/gpunet-exporter && exec slurmd -D ...'``
  (a shell in the harness only; the product runs none). slurmd finds its NodeName from the
  hostname; per-node paths use ``%n``. ``/var/lib/gpunet-exporter`` must exist on the host as a
  mount point: it is created when missing and removed again at teardown (when empty, and when
  no namespace of a parallel run mounts on it: removing it would detach that mount);
- no port is chosen on the host: every daemon listens inside its own namespace, where the
  standard ports (6817, 6818) are free by construction, and parallel runs have separate bridges;
- ``cgroup.conf`` names ``CgroupPlugin=cgroup/v1``: slurmd 22.05 initialises its cgroup plugin
  even with ``proctrack/linuxproc`` and ``task/none``, and its autodetection fails in a
  namespace where ``ip netns exec`` has remounted ``/sys`` (no ``/sys/fs/cgroup`` there).
  Nothing is confined: no cgroup is created;
- teardown (also after a failure): every process in the node and controller namespaces is
  killed (slurmd, slurmctld, slurmstepd and what the jobs left), then munged, then the
  namespaces, the ``/etc/netns`` entries and the root directory go. At start, what a run whose
  process is gone left behind (its namespaces with their processes, its ``/etc/netns`` entries,
  its munged and root directory) is swept first.

``require()`` skips with the reason when the fleet cannot be built (not root, no iproute2) or
a Slurm or munge binary is missing; tests/run.sh installs them, so CI runs the tests.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from support import netns
from support.wait import wait_for

BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "munged", "unshare",
            "mount")
STATE_MOUNT = Path("/var/lib/gpunet-exporter")  # each node's own, as on a real node
ETC_NETNS = Path("/etc/netns")
PREFIX = "gpunet-slurm"
CONTROLLER = "ctl"
MADE_MOUNT = "made-state-mount"  # in the root directory: this run created STATE_MOUNT


@dataclass(frozen=True)
class SlurmNode:
    name: str  # n<i>: NodeName and hostname
    net: netns.Node  # its namespace and address on the bridge
    root: Path  # <cluster root>/nodes/<name>
    state: Path  # what the node sees as /var/lib/gpunet-exporter

    @property
    def log(self) -> Path:
        return self.root / "slurmd.log"


@dataclass
class Cluster:
    root: Path
    conf: Path
    nodes: tuple[SlurmNode, ...]
    controller: netns.Node
    env: dict[str, str] = field(default_factory=dict)  # SLURM_CONF for clients

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 60, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """A client command (sbatch, sinfo ...) in the controller's namespace, with this
        cluster's SLURM_CONF and the caller's environment on top of the test's."""
        return subprocess.run(["ip", "netns", "exec", self.controller.ns, *argv],
                              env={**os.environ, **self.env, **(env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        """NodeName -> its state as sinfo prints it (idle, alloc, down*, ...)."""
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], timeout=30)
        if r.returncode:
            return {}
        return dict(line.split() for line in r.stdout.splitlines() if line.strip())

    def logs(self, lines: int = 25) -> str:
        """The tails of the controller's and the nodes' logs, for failure messages."""
        out = []
        for path in [self.root / "ctl" / "slurmctld.log", *(n.log for n in self.nodes)]:
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            out.append(f"== {path.relative_to(self.root)}\n"
                       + "\n".join(text.splitlines()[-lines:]))
        return "\n".join(out)


def missing() -> str:
    """Why a cluster cannot be built here; empty when it can."""
    reason = netns.missing()
    if reason:
        return reason
    absent = [b for b in BINARIES if shutil.which(b) is None]
    if absent:
        return (f"not installed: {', '.join(absent)} (Debian: slurmctld slurmd slurm-client "
                f"munge; tests/run.sh installs them)")
    return ""


def require() -> None:
    """Skip the calling test when a cluster cannot be built here."""
    import pytest

    reason = missing()
    if reason:
        pytest.skip(reason)


def slurm_conf(root: Path, nodes: Sequence[netns.Node], controller: netns.Node,
               extra: Sequence[str] = ()) -> str:
    """The cluster's slurm.conf: munge on the private socket, no cgroups, no accounting, one
    partition ``debug`` of every node; ``extra`` lines (``HealthCheckProgram=...``,
    ``Epilog=...``) before the nodes."""
    names = [f"n{i}" for i in range(len(nodes))]
    lines = [
        "ClusterName=gpunettest",
        f"SlurmctldHost={CONTROLLER}({controller.addr})",
        "SlurmctldPort=6817",
        "SlurmdPort=6818",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/run/munge.sock",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/ctl/state",
        f"SlurmctldPidFile={root}/ctl/slurmctld.pid",
        f"SlurmctldLogFile={root}/ctl/slurmctld.log",
        f"SlurmdSpoolDir={root}/nodes/%n/spool",
        f"SlurmdPidFile={root}/nodes/%n/slurmd.pid",
        f"SlurmdLogFile={root}/nodes/%n/slurmd.log",
        f"PlugStackConfig={root}/plugstack.conf",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/backfill",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SlurmdParameters=config_overrides",  # CPUs=1 per node on a host with more
        "PropagateResourceLimits=NONE",
        "ReturnToService=2",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "KillWait=2",
        # sbatch --wait polls at 2 s, 8 s, 32 s ... unless the next sleep would reach half of
        # MinJobAge (a finished job must outlive the poll): 4 keeps it at 2 s, so that a
        # 12 s job is seen done at 12 to 14 s rather than at 42 s. Finished jobs' records go
        # after 4 s: tests wait for a job's output file, not for its record.
        "MinJobAge=4",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        *extra,
    ]
    lines += [f"NodeName={name} NodeAddr={n.addr} CPUs=1 State=UNKNOWN"
              for name, n in zip(names, nodes, strict=True)]
    lines.append(f"PartitionName=debug Nodes={','.join(names)} Default=YES MaxTime=30 State=UP")
    return "\n".join(lines) + "\n"


def hosts_file(nodes: Sequence[netns.Node], controller: netns.Node) -> str:
    return ("127.0.0.1 localhost\n"
            + "".join(f"{n.addr} n{i}\n" for i, n in enumerate(nodes))
            + f"{controller.addr} {CONTROLLER}\n")


# -- stand-ins, for testing the batch script's own logic without a cluster ---------------------

FAKE_TOOL = """\
import json
import os
import sys

name = os.path.basename(sys.argv[0])
with open(os.environ["FAKE_SLURM_LOG"], "a", encoding="utf-8") as log:
    env = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "NCCL_MNNVL_ENABLE",
                                          "NCCL_NVLS_ENABLE")}
    log.write(json.dumps({"tool": name, "argv": sys.argv[1:], **env}) + "\\n")
if name == "sinfo":
    sys.stdout.write(os.environ.get("FAKE_SINFO", ""))
elif name == "sbatch":
    print("4242")
sys.exit(int(os.environ.get("FAKE_" + name.upper() + "_EXIT", "0")))
"""
FAKE_NAMES = ("srun", "sbatch", "sinfo")


def fake_tools(bin_dir: Path, python: str) -> None:
    """``srun``, ``sbatch`` and ``sinfo`` stand-ins in ``bin_dir``: each appends its arguments
    and MASTER_ADDR, MASTER_PORT, NCCL_MNNVL_ENABLE and NCCL_NVLS_ENABLE as a JSON line to
    ``$FAKE_SLURM_LOG``; sinfo prints ``$FAKE_SINFO``, sbatch a job id; each exits
    ``$FAKE_<NAME>_EXIT`` (default 0)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in FAKE_NAMES:
        tool = bin_dir / name
        tool.write_text(f"#!{python}\n{FAKE_TOOL}")
        tool.chmod(0o755)


def minimal_conf(path: Path) -> Path:
    """The least slurm.conf with which the real ``scontrol show hostnames`` expands a host
    list (it reads the configuration, and contacts no controller for that)."""
    path.write_text("ClusterName=gpunetfake\nSlurmctldHost=ctl\n")
    return path


# -- cleanup --------------------------------------------------------------------------------

def kill_namespace_processes(namespaces: Sequence[str], grace: float = 10.0) -> None:
    """SIGTERM to every process in these namespaces (all ours: we made the namespaces), then
    SIGKILL to what is left after ``grace`` seconds; returns when none is left."""
    netns.signal_all([p for ns in namespaces for p in netns.pids_in(ns)], signal.SIGTERM)
    try:
        wait_for(lambda: [p for ns in namespaces for p in netns.pids_in(ns)],
                 "the cluster's processes to exit on SIGTERM", timeout=grace, interval=0.2,
                 until_empty=True)
    except AssertionError:
        netns.signal_all([p for ns in namespaces for p in netns.pids_in(ns)], signal.SIGKILL)
        wait_for(lambda: [p for ns in namespaces for p in netns.pids_in(ns)],
                 "the cluster's processes to exit on SIGKILL", timeout=10, interval=0.2,
                 until_empty=True)


def _stop_munged(root: Path) -> None:
    """Kill the munged of this root directory (by its pid file, checking its command line)."""
    pidfile = root / "munge" / "munged.pid"
    with contextlib.suppress(OSError, ValueError):
        pid = int(pidfile.read_text().split()[0])
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if str(root).encode() in cmdline:
            os.kill(pid, signal.SIGKILL)


def state_mount_in_use() -> bool:
    """Whether a process anywhere (a parallel run's node) has a mount on STATE_MOUNT: removing
    the directory would detach that mount in its namespace."""
    for info in Path("/proc").glob("[0-9]*/mountinfo"):
        with contextlib.suppress(OSError):
            if any(line.split()[4] == str(STATE_MOUNT) for line in info.read_text().splitlines()
                   if len(line.split()) > 4):
                return True
    return False


def _drop_state_mount() -> None:
    """Remove STATE_MOUNT (made by a run of ours) when empty and no namespace mounts on it."""
    if not state_mount_in_use():
        with contextlib.suppress(OSError):
            STATE_MOUNT.rmdir()


def sweep(prefix: str = PREFIX) -> list[str]:
    """What runs of this prefix whose process is gone left behind: their namespaces (the
    processes in them killed first), /etc/netns entries, munged and root directories."""
    gone = netns.sweep(prefix)
    if ETC_NETNS.is_dir():
        for entry in ETC_NETNS.iterdir():
            pid = netns.run_pid(entry.name, prefix)
            if pid is not None and not netns.alive(pid):
                shutil.rmtree(entry, ignore_errors=True)
                gone.append(str(entry))
    for entry in Path(tempfile.gettempdir()).glob(f"{prefix}-*"):
        pid = netns.run_pid(entry.name, prefix)
        if pid is not None and not netns.alive(pid):
            _stop_munged(entry)
            if (entry / MADE_MOUNT).exists():
                _drop_state_mount()
            shutil.rmtree(entry, ignore_errors=True)
            gone.append(str(entry))
    return gone


# -- the cluster ----------------------------------------------------------------------------

def _start(argv: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=dict(env),
                                start_new_session=True)


@contextlib.contextmanager
def cluster(n: int = 4, prefix: str = PREFIX, startup_timeout: float = 60,
            extra_conf: Callable[[Path], Sequence[str]] | None = None) -> Iterator[Cluster]:
    """``n`` slurmd nodes and a controller (module docstring), every node idle on entry;
    everything is stopped and removed on exit. ``extra_conf``: given the cluster's root directory
    (made before the daemons start, for the files those lines name), more slurm.conf lines."""
    if not 1 <= n <= 200:
        raise ValueError(f"1 to 200 nodes, not {n}")
    sweep(prefix)
    root = Path(tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-"))
    root.chmod(0o755)
    made_mount = False
    etc_entries: list[Path] = []
    munged: subprocess.Popen[bytes] | None = None
    try:
        with netns.fleet(n + 1, prefix) as fleet:
            controller = fleet[n]
            net_nodes = fleet.nodes[:n]
            conf = root / "slurm.conf"
            conf.write_text(slurm_conf(root, net_nodes, controller,
                                       extra_conf(root) if extra_conf else ()))
            (root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
            (root / "plugstack.conf").write_text("")
            (root / "munge").mkdir(mode=0o700)
            (root / "run").mkdir(mode=0o755)
            (root / "ctl" / "state").mkdir(parents=True)
            key = root / "munge" / "munge.key"
            key.write_bytes(secrets.token_bytes(1024))
            key.chmod(0o600)
            hosts = hosts_file(net_nodes, controller)
            for node in fleet.nodes:
                entry = ETC_NETNS / node.ns
                entry.mkdir(parents=True, exist_ok=True)
                etc_entries.append(entry)
                (entry / "hosts").write_text(hosts)
            if not STATE_MOUNT.exists():
                STATE_MOUNT.mkdir(parents=True)
                made_mount = True
                (root / MADE_MOUNT).touch()  # for sweep, should this run die
            env = {**os.environ, "SLURM_CONF": str(conf)}
            munge_sock = root / "run" / "munge.sock"
            munged = _start(["munged", "-F", f"--socket={munge_sock}", f"--key-file={key}",
                             f"--pid-file={root}/munge/munged.pid",
                             f"--seed-file={root}/munge/munged.seed",
                             f"--log-file={root}/munge/munged.log"],
                            root / "munge" / "stdout.log", env)
            wait_for(lambda: munged.poll() is not None or munge_sock.exists(),
                     "munged to create its socket", timeout=20)
            if munged.poll() is not None:
                raise RuntimeError(f"munged exited {munged.returncode}: "
                                   f"{(root / 'munge' / 'stdout.log').read_text()}")
            try:
                _start(["ip", "netns", "exec", controller.ns, "unshare", "--uts", "sh", "-c",
                        f"hostname {CONTROLLER} && exec slurmctld -D -i -f {conf}"],
                       root / "ctl" / "stdout.log", env)
                nodes = []
                for i, net in enumerate(net_nodes):
                    name = f"n{i}"
                    node_root = root / "nodes" / name
                    (node_root / "spool").mkdir(parents=True)
                    (node_root / "state").mkdir()
                    _start(["ip", "netns", "exec", net.ns, "unshare", "--uts", "--mount",
                            "--propagation", "private", "sh", "-c",
                            f"hostname {name} && mount --bind {node_root / 'state'} "
                            f"{STATE_MOUNT} && exec slurmd -D -f {conf}"],
                           node_root / "stdout.log", env)
                    nodes.append(SlurmNode(name, net, node_root, node_root / "state"))
                c = Cluster(root, conf, tuple(nodes), controller, {"SLURM_CONF": str(conf)})
                want = {s.name: "idle" for s in nodes}
                try:
                    wait_for(lambda: c.node_states() == want,
                             f"{n} slurmd nodes idle in sinfo", timeout=startup_timeout,
                             interval=0.5)
                except AssertionError as exc:
                    raise AssertionError(f"{exc}\n{c.logs()}") from None
                yield c
            finally:
                kill_namespace_processes([node.ns for node in fleet.nodes])
    finally:
        if munged is not None and munged.poll() is None:
            munged.terminate()
            try:
                munged.wait(10)
            except subprocess.TimeoutExpired:
                munged.kill()
                munged.wait()
        for entry in etc_entries:
            shutil.rmtree(entry, ignore_errors=True)
        if made_mount:
            _drop_state_mount()
        shutil.rmtree(root, ignore_errors=True)
