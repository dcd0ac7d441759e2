"""Helpers of the test suite, in one place; no test module imports another.

    paths        REPO, FIXTURES (every data file the tests read, tests/fixtures/), UPSTREAM, GOLDEN
    metrics      Samples, parse, samples_of, value, series; make_collector and collect (in-process)
    exporter     the installed exporter as a subprocess (Exporter), free_port, install_plugin
    wait         wait_for (the one polling loop), refresher_idle, hold (an explicit, named sleep)
    sysfs_tree   fake sysfs/procfs trees (also a script: `python tests/support/sysfs_tree.py`)
    fake_nvml    a pynvml stand-in replaying real readings (`--nvml.module support.fake_nvml`)
    yaml_bombs   hostile YAML documents (alias and merge-key bombs)
    bundle_node  a node of the end-to-end bundle: its tree, stand-in tools, NVML and exporter args
    netns        a fleet of network-namespace nodes on a bridge, tc shaping, a probe pair across two
    slurm        a real Slurm (slurmctld, slurmd per namespace node, munge) on one host; stand-ins
                 for srun, sbatch and sinfo

tests/conftest.py holds only pytest fixtures. This package imports nothing at import time, so an
exporter subprocess that loads support.fake_nvml loads nothing else of it.
"""
