"""slurm/gpunet-fleet.sbatch's own logic, without a cluster: the commands it would run, seen
through stand-ins for srun, sbatch and sinfo first on PATH (tests/support/slurm.py), with the
real ``scontrol show hostnames`` expanding the host list. The script under a real Slurm with
four nodes is tests/test_fleet_slurm.py."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpunet_exporter.probe import fleet

from support import slurm
from support.paths import REPO

SCRIPT = REPO / "slurm" / "gpunet-fleet.sbatch"
DOC = REPO / "docs" / "fleet.md"
JOB = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4",
       "SLURM_JOB_NODELIST": "gpu[07-09],gpu11", "SLURM_JOB_PARTITION": "gpu"}
DEFAULT_SRUN = ["--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
                "--mpi=none", "gpunet-probe", "fleet", "--state-dir",
                "/var/lib/gpunet-exporter/probe", "--kind", "ring", "--hops", "2",
                "--backend", "nccl",
                "--gpus-per-node", "1"]


@dataclass(frozen=True)
class Ran:
    returncode: int
    stdout: str
    stderr: str
    calls: list[dict[str, Any]]  # what the stand-ins were called with, in order

    def of(self, tool: str) -> list[dict[str, Any]]:
        return [c for c in self.calls if c["tool"] == tool]


@pytest.fixture
def run_script(tmp_path: Path) -> Any:
    """Run the script with bash, the stand-ins first on PATH and only the environment given
    (nothing of the caller's Slurm or GPUNET_ settings leaks in)."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol (slurm-client) is not installed; tests/run.sh installs it")
    bin_dir = tmp_path / "bin"
    slurm.fake_tools(bin_dir, sys.executable)
    conf = slurm.minimal_conf(tmp_path / "slurm.conf")
    log = tmp_path / "calls.jsonl"

    def run(*args: str, env: Mapping[str, str] | None = None) -> Ran:
        log.write_text("")
        full = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_CONF": str(conf),
                "FAKE_SLURM_LOG": str(log), **(env or {})}
        r = subprocess.run(["bash", str(SCRIPT), *args], env=full, capture_output=True,
                           text=True, timeout=60)
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        return Ran(r.returncode, r.stdout, r.stderr, calls)

    return run


def directives() -> list[str]:
    return re.findall(r"^#SBATCH (\S+)", SCRIPT.read_text(), re.MULTILINE)


def test_script_parses_and_asks_for_whole_nodes_briefly() -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert os.access(SCRIPT, os.X_OK)
    d = directives()
    assert "--exclusive" in d  # probes never share a node with a training job
    [limit] = [x.split("=", 1)[1] for x in d if x.startswith("--time=")]
    h, m, s = (int(x) for x in limit.split(":"))
    assert 0 < h * 3600 + m * 60 + s <= 30 * 60, limit


def test_default_srun_line_is_the_documented_one(run_script: Any) -> None:
    r = run_script(env=JOB)
    assert r.returncode == 0, r.stderr
    [srun] = r.of("srun")
    assert srun["argv"] == DEFAULT_SRUN
    assert (srun["MASTER_ADDR"], srun["MASTER_PORT"]) == ("gpu07", "29500")
    assert (srun["NCCL_MNNVL_ENABLE"], srun["NCCL_NVLS_ENABLE"]) == ("0", "0")  # the network
    assert not r.of("sbatch")  # no period: no next round
    line = " ".join(["srun", *srun["argv"]])
    doc = " ".join(DOC.read_text().replace("\\\n", " ").split())  # continued lines joined
    assert line in doc, f"docs/fleet.md should show the srun line: {line}"


def test_settings_reach_the_command_line(run_script: Any) -> None:
    env = {**JOB, "SLURM_GPUS_ON_NODE": "8", "GPUNET_PROBE": "/opt/gpunet/bin/gpunet-probe",
           "GPUNET_FLEET_STATE_DIR": "/srv/probe", "GPUNET_FLEET_KIND": "random",
           "GPUNET_FLEET_BACKEND": "gloo", "GPUNET_FLEET_SIZES": "1MiB,16MiB",
           "GPUNET_FLEET_ARGS": "--seed 3  --pair-timeout 30",
           "GPUNET_FLEET_SRUN_ARGS": "--gpus-per-node=8", "GPUNET_FLEET_MASTER_PORT": "31000"}
    r = run_script("--warmup", "1", env=env)
    assert r.returncode == 0, r.stderr
    [srun] = r.of("srun")
    assert srun["argv"] == [
        "--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--kill-on-bad-exit=0", "--mpi=none",
        "--gpus-per-node=8", "/opt/gpunet/bin/gpunet-probe", "fleet", "--state-dir",
        "/srv/probe", "--kind", "random", "--hops", "2", "--backend", "gloo",
        "--gpus-per-node", "8",
        "--sizes", "1MiB,16MiB", "--seed", "3", "--pair-timeout", "30", "--warmup", "1"]
    assert srun["MASTER_PORT"] == "31000"
    r = run_script(env={**env, "NCCL_NVLS_ENABLE": "1"})  # the operator's NCCL_* are kept
    assert r.of("srun")[0]["NCCL_NVLS_ENABLE"] == "1"
    r = run_script(env={**env, "GPUNET_FLEET_GPUS_PER_NODE": "4"})
    assert r.of("srun")[0]["argv"][16:18] == ["--gpus-per-node", "4"]


def test_an_adaptive_pass_through_the_kind_setting(run_script: Any) -> None:
    """GPUNET_FLEET_KIND=adaptive reaches `gpunet-probe fleet`, whose own parser takes the line
    (the script passes --hops to every kind; an adaptive pass ignores it)."""
    r = run_script(env={**JOB, "GPUNET_FLEET_KIND": "adaptive",
                        "GPUNET_FLEET_ARGS": "--max-rounds 4"})
    assert r.returncode == 0, r.stderr
    [srun] = r.of("srun")
    argv = srun["argv"][srun["argv"].index("fleet") + 1:]
    assert argv[argv.index("--kind") + 1] == "adaptive"
    p = argparse.ArgumentParser()
    fleet.add_arguments(p)
    args = p.parse_args(argv)
    fleet._check(args)
    assert (args.kind, args.max_rounds) == ("adaptive", 4)


def test_exit_status_is_the_probes(run_script: Any) -> None:
    r = run_script(env={**JOB, "FAKE_SRUN_EXIT": "4"})
    assert r.returncode == 4
    assert "exit status 4" in r.stdout


def test_period_submits_the_next_round_first(run_script: Any) -> None:
    r = run_script("--kind", "leaf", env={**JOB, "GPUNET_FLEET_PERIOD": "6hours",
                                          "GPUNET_FLEET_SBATCH_ARGS": "--qos=low --nice=100"})
    assert r.returncode == 0, r.stderr
    assert [c["tool"] for c in r.calls] == ["sbatch", "srun"]
    assert r.of("sbatch")[0]["argv"] == [
        "--parsable", "--begin=now+6hours", "--nodes=4", "--partition=gpu", "--qos=low",
        "--nice=100", str(SCRIPT), "--kind", "leaf"]
    assert "next round: job 4242" in r.stdout
    r = run_script(env={**JOB, "GPUNET_FLEET_PERIOD": "1hour", "GPUNET_FLEET_NODES": "2-64"})
    assert "--nodes=2-64" in r.of("sbatch")[0]["argv"]
    # A failed resubmission is said, and the round still runs.
    r = run_script(env={**JOB, "GPUNET_FLEET_PERIOD": "1hour", "FAKE_SBATCH_EXIT": "1"})
    assert r.returncode == 0 and len(r.of("srun")) == 1
    assert "could not submit the next round" in r.stderr


SINFO = """\
gpu01 idle
gpu02 alloc
gpu03 idle*
gpu04 drain
gpu05 idle
gpu01 idle
gpu06 idle~
gpu07 mix
gpu08 resv
gpu09 idle
"""


def test_idle_mode_submits_on_the_idle_nodes_only(run_script: Any) -> None:
    r = run_script("--idle", "--qos=probe", env={"FAKE_SINFO": SINFO,
                                                 "GPUNET_FLEET_PARTITION": "gpu"})
    assert r.returncode == 0, r.stderr
    [sinfo] = r.of("sinfo")
    assert sinfo["argv"] == ["--noheader", "--Node", "--format=%N %t", "--partition=gpu"]
    [sbatch] = r.of("sbatch")
    # gpu01 listed twice (two partitions) is one node; idle* (not responding), idle~ (powered
    # down), drain, resv, alloc and mix are left out.
    assert sbatch["argv"] == ["--nodelist=gpu01,gpu05,gpu09", "--nodes=3",
                              "--deadline=now+30minutes", "--partition=gpu", "--qos=probe",
                              str(SCRIPT)]
    assert not r.of("srun")


def test_idle_mode_with_fewer_than_two_idle_nodes_submits_nothing(run_script: Any) -> None:
    r = run_script("--idle", env={"FAKE_SINFO": "gpu01 idle\ngpu02 alloc\n"})
    assert r.returncode == 0
    assert not r.of("sbatch")
    assert "1 idle node(s), a pair round needs two; nothing submitted" in r.stderr


@pytest.mark.parametrize(("args", "env", "says"), [
    ((), {}, "run it with sbatch"),
    ((), {**JOB, "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu07"},
     "needs two nodes or more; this job has 1"),
    (("--idle",), JOB, "--idle submits a job; run it outside of one"),
])
def test_misuse_is_one_line_and_exit_2(run_script: Any, args: tuple[str, ...],
                                       env: dict[str, str], says: str) -> None:
    r = run_script(*args, env=env)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert not r.calls
