"""The fleet's persistent pair worker (issue 35): one process per local rank of a node, started
at the first pair the node runs in a pass and kept for its later pairs, so that torch's import,
the CUDA context and NCCL's first initialisation are paid once per pass, not once per pair.

Both ends of its pipe live here. The fleet's side (``Workers``, ``Worker``) starts it the way
``gpunet-probe run``'s ranks were started (commands.Child: a session of its own, which the
fleet's GPU check counts as its own), writes it one JSON line per pair (``job``) and reads one
``done <exit status>`` line back. The worker's side (``main``, the hidden ``gpunet-probe
pair-worker``) runs each pair through runner.pair_round: a fresh process group on the pair's
own TCPStore, the round ``gpunet-probe run --scope inter --rounds 1`` runs, the group destroyed;
its output goes to the pair's ``probe.log``. It exits at the end of its pipe (the pass is over,
or the fleet is gone), when the fleet process dies (it checks every PARENT_SECONDS), and after
a pair that did not end in 0 (a group that failed may leave NCCL or the GPU unusable: the next
pair gets a fresh worker). The fleet kills it at once when the pair must yield. docs/fleet.md,
"How a pair end runs".
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import IO, Any

from gpunet_exporter.flags import Parser
from gpunet_exporter.probe import run_options, runner
from gpunet_exporter.sources.commands import Child

PROG = "gpunet-probe pair-worker"
CONTROL_ENV = "GPUNET_PAIR_WORKER_CONTROL"  # "<job fd>,<reply fd>" of a started worker
LOG_DIR = "fleet-nccl"  # under <state-dir>: NCCL's logs of a pass's workers (fleet/ has peers)
MAX_LINE = 16384  # a job or a reply longer than this is not one
PARENT_SECONDS = 0.5  # how often a worker looks whether the fleet process is still there
WATCH_SECONDS = 0.5  # how often idle workers' GPUs are looked at (fleet.WATCH_SECONDS too)
STOP_SECONDS = 5.0  # a worker has this long to exit at the end of the pass before it is killed
EXIT_BAD_JOB = 2


class BadJob(ValueError):
    """A job line that is not one; the text says why, in one line."""


@dataclass(frozen=True)
class Job:
    """One pair for one worker: its rank in the pair's world, where the pair meets, and where
    its result and its output go."""
    rank: int
    world: int
    local: int
    master: str
    port: int
    state_dir: str
    log: str

    def line(self) -> bytes:
        return (json.dumps(self.__dict__) + "\n").encode()


def parse_job(line: bytes) -> Job:
    try:
        d = json.loads(line)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadJob(f"a job is a JSON object, got {line[:80]!r}") from exc
    if not isinstance(d, dict):
        raise BadJob(f"a job is a JSON object, got {line[:80]!r}")
    ints = ("rank", "world", "local", "port")
    strs = ("master", "state_dir", "log")
    for k in ints:
        if not isinstance(d.get(k), int) or isinstance(d.get(k), bool) or d[k] < 0:
            raise BadJob(f"job: {k} must be a whole number, got {d.get(k)!r}")
    for k in strs:
        if not isinstance(d.get(k), str) or not d[k]:
            raise BadJob(f"job: {k} must be a non-empty string, got {d.get(k)!r}")
    if not d["rank"] < d["world"] or not 1 <= d["port"] <= 65535:
        raise BadJob(f"job: rank {d['rank']} of {d['world']} at port {d['port']}")
    return Job(**{k: d[k] for k in (*ints, *strs)})


def job_for(env: Mapping[str, str], state_dir: str, log: str) -> Job:
    """The job of a pair end's rank whose environment ``gpunet-probe run`` would get is
    ``env`` (fleet.child_env): one home for the ranks and the rendezvous."""
    return Job(rank=int(env["RANK"]), world=int(env["WORLD_SIZE"]),
               local=int(env["LOCAL_RANK"]), master=env["MASTER_ADDR"],
               port=int(env["MASTER_PORT"]), state_dir=state_dir, log=log)


# -- the fleet's side ------------------------------------------------------------------------

class Worker:
    """One started worker, as the fleet's pair end sees it: like a rank's Child (``pid``,
    ``poll``, ``wait``, ``kill``), where ``poll`` is the exit status of the pair it was last
    given (its ``done`` reply, or its own exit status when it exited without one)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log: IO[Any]) -> None:
        cmd_r, cmd_w = os.pipe()
        rep_r, rep_w = os.pipe()
        try:
            self.child = Child(argv, stdout=log, stderr=log,
                               env={**env, CONTROL_ENV: f"{cmd_r},{rep_w}"},
                               pass_fds=(cmd_r, rep_w))
        except OSError:
            os.close(cmd_w)
            os.close(rep_r)
            raise
        finally:
            os.close(cmd_r)
            os.close(rep_w)
        self.pid = self.child.pid
        self._jobs: int | None = cmd_w
        self._replies: int | None = rep_r
        self._buffer = b""
        self._code: int | None = None

    @property
    def alive(self) -> bool:
        return self._jobs is not None and self.child.poll() is None

    @property
    def reusable(self) -> bool:
        """Alive, and its last pair (if any) ended in 0: after any other end it is on its way
        out (main), and a job given to it now would be lost."""
        return self._code in (None, 0) and self.alive

    def send(self, job: Job) -> None:
        """Give it ``job``; OSError when it is gone."""
        if self._jobs is None:
            raise OSError("the pair worker was stopped")
        self._code = None
        os.write(self._jobs, job.line())

    def _read(self, timeout: float) -> bool:
        """Read what it replied within ``timeout``; False at the end of its pipe."""
        if self._replies is None:
            return False
        ready, _, _ = select.select([self._replies], [], [], max(0.0, timeout))
        if not ready:
            return True
        chunk = os.read(self._replies, 4096)
        if not chunk:
            return False
        self._buffer += chunk
        while b"\n" in self._buffer:
            line, _, self._buffer = self._buffer.partition(b"\n")
            word, _, rc = line.decode("ascii", "replace").partition(" ")
            if word == "done":
                self._code = int(rc) if rc.strip().lstrip("-").isdigit() else 1
        self._buffer = self._buffer[-MAX_LINE:]
        return True

    def _drain(self) -> None:
        """Read every reply there is now."""
        while self._replies is not None and select.select([self._replies], [], [], 0)[0]:
            if not self._read(0):
                return

    def poll(self) -> int | None:
        """The exit status of its pair; None while the pair runs."""
        if self._code is None:
            self._drain()
        if self._code is not None:
            return self._code
        rc = self.child.poll()
        if rc is None:
            return None
        self._drain()  # a reply written just before it exited
        if self._code is None:
            self._code = rc
        return self._code

    def wait(self, timeout: float) -> int | None:
        deadline = time.monotonic() + timeout
        while True:
            rc = self.poll()
            if rc is not None:
                return rc
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not self._read(min(left, 0.1)):  # its pipe closed: it is exiting
                self.child.wait(min(left, 0.05))

    def _close_pipes(self) -> None:
        for fd in (self._jobs, self._replies):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._jobs = self._replies = None

    def kill(self) -> int | None:
        """Kill it (its whole session's process group) and reap it."""
        rc = self.child.kill()
        if self._code is None and rc is not None:
            self._code = rc
        self._close_pipes()
        return rc

    def end(self) -> None:
        """The end of its pipe: it exits once its pair, if any, is done."""
        if self._jobs is not None:
            with contextlib.suppress(OSError):
                os.close(self._jobs)
            self._jobs = None

    def stop(self, timeout: float = STOP_SECONDS) -> None:
        """The end of the pass: the end of its pipe, then ``timeout`` to exit, then a kill."""
        self.end()
        self.child.stop(timeout)
        self._close_pipes()


class Workers:
    """A node's pair workers for one pass, one per local rank: each started at the first pair
    that needs it (after it died or was killed: afresh) and kept while it lives.

    Between pairs they hold their CUDA contexts, so they are watched then too: every
    WATCH_SECONDS, while no pair runs (``pair()``), ``look`` is asked about the GPUs (with the
    workers, the fleet's own processes), and when it says the pair ends must not run (other
    work came), every worker is killed at once, as a running pair end's ranks are."""

    def __init__(self, argv: Sequence[str], state_dir: str,
                 look: Callable[[Sequence[Worker]], tuple[str, str] | None] | None = None
                 ) -> None:
        self.argv = list(argv)
        self.logdir = os.path.join(state_dir, LOG_DIR)
        self.look = look
        self.by_local: dict[int, Worker] = {}
        self.started = 0  # workers started in this pass
        self._lock = threading.Lock()  # held while a pair runs, and while the watch looks
        self._closed = threading.Event()
        self._watch: threading.Thread | None = None

    @contextlib.contextmanager
    def pair(self) -> Iterator[None]:
        """While a pair runs: the pair end's own watch looks at the GPUs, not the idle one."""
        with self._lock:
            yield

    def get(self, local: int, env: Mapping[str, str], log: IO[Any]) -> tuple[Worker, bool]:
        """The worker of local rank ``local``, and whether it was started now (with ``env``, its
        output to ``log``). OSError when it cannot be started."""
        w = self.by_local.get(local)
        if w is not None and w.reusable:
            return w, False
        if w is not None:
            w.kill()  # reaped, its pipes closed
        if self.started == 0:  # NCCL's logs of an earlier pass's workers go
            shutil.rmtree(self.logdir, ignore_errors=True)
        os.makedirs(self.logdir, mode=0o700, exist_ok=True)
        w = Worker(self.argv, {**env, "GPUNET_PROBE_LOG_DIR": self.logdir}, log)
        self.by_local[local] = w
        self.started += 1
        if self._watch is None and self.look is not None:
            self._watch = threading.Thread(target=self._idle_watch, name="idle-workers",
                                           daemon=True)
            self._watch.start()
        return w, True

    def _idle_watch(self) -> None:
        assert self.look is not None
        while not self._closed.wait(WATCH_SECONDS):
            if not self._lock.acquire(blocking=False):
                continue  # a pair runs: its own watch looks
            try:
                running = self.running()
                stop = self.look(running) if running else None
                if stop is not None and not self._closed.is_set():
                    self.kill()
                    print(f"gpunet-probe fleet: pair workers killed between pairs: {stop[1]}",
                          file=sys.stderr, flush=True)
            except Exception as exc:  # the watch must not die of one bad look
                print(f"gpunet-probe fleet: the idle pair workers' watch: {exc}",
                      file=sys.stderr, flush=True)
            finally:
                self._lock.release()

    def running(self) -> list[Worker]:
        return [w for w in list(self.by_local.values()) if w.alive]

    def kill(self) -> None:
        """Kill every worker now (the GPUs are wanted by other work)."""
        for w in list(self.by_local.values()):
            w.kill()
        self.by_local.clear()

    def close(self) -> None:
        """The end of the pass: every worker exits (or is killed after STOP_SECONDS)."""
        self._closed.set()
        with self._lock:  # not while the idle watch is looking
            for w in self.by_local.values():
                w.end()  # all told first: they exit side by side
            deadline = time.monotonic() + STOP_SECONDS
            for w in self.by_local.values():
                w.stop(max(0.1, deadline - time.monotonic()))
            self.by_local.clear()
        if self._watch is not None:
            self._watch.join(timeout=5)


# -- the worker's side ------------------------------------------------------------------------

def _watch_parent(parent: int) -> None:
    """Exit the moment the fleet process is gone, even mid-pair: no orphan keeps a CUDA
    context on the node."""
    def watch() -> None:
        while True:
            time.sleep(PARENT_SECONDS)
            if os.getppid() != parent:
                os._exit(143)

    threading.Thread(target=watch, name="parent", daemon=True).start()


def _output_to(path: str) -> None:
    """This process's stdout and stderr (and its children's) to ``path``, appended."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: Sequence[str]) -> int:
    """The worker: jobs from the fleet's pipe until its end; one pair each."""
    p = Parser(prog=PROG)
    run_options.add_arguments(p)
    options = run_options.from_args(p.parse_args(list(argv)))
    try:
        job_fd, reply_fd = (int(x) for x in os.environ.get(CONTROL_ENV, "").split(","))
    except ValueError:
        print(f"{PROG}: started by gpunet-probe fleet only ({CONTROL_ENV} is not set)",
              file=sys.stderr)
        return EXIT_BAD_JOB
    _watch_parent(os.getppid())
    jobs = os.fdopen(job_fd, "rb")
    done = 0
    while True:
        line = jobs.readline(MAX_LINE)
        if not line:
            return 0  # the end of the pass, or the fleet is gone
        try:
            job = parse_job(line)
        except BadJob as exc:
            print(f"{PROG}: {exc}", file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):  # the fleet may be gone
                os.write(reply_fd, f"done {EXIT_BAD_JOB}\n".encode())
            return EXIT_BAD_JOB
        _output_to(job.log)
        # What `gpunet-probe run` would have read from its environment, for anything that does.
        os.environ.update({"RANK": str(job.rank), "WORLD_SIZE": str(job.world),
                           "LOCAL_RANK": str(job.local), "MASTER_ADDR": job.master,
                           "MASTER_PORT": str(job.port)})
        started = time.monotonic()
        rc = runner.pair_round(replace(options, state_dir=job.state_dir),
                               runner.Cluster(job.rank, job.world, job.local, "fleet"),
                               job.master, job.port)
        done += 1
        print(f"{PROG} {os.getpid()}: pair {done}: rank {job.rank} of {job.world}: exit {rc} "
              f"after {time.monotonic() - started:.2f} s", file=sys.stderr, flush=True)
        try:
            os.write(reply_fd, f"done {rc}\n".encode())
        except OSError:
            return rc or 143  # the fleet is gone
        if rc != 0:
            return rc  # a fresh worker for the next pair
