"""daemon/privileges.py: which readings want a capability, and the warning for running as root."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from gpunet_exporter.collectors.link import LinkSettings
from gpunet_exporter.collectors.topology import TopologyCollector
from gpunet_exporter.config import Settings, parse_settings
from gpunet_exporter.daemon import privileges
from gpunet_exporter.daemon.privileges import needs, root_warning

from support.wait import wait_for

ALL = ["infiniband", "link", "pfc", "gpu", "topology"]


def test_not_root_no_warning() -> None:
    assert root_warning(ALL, {}, euid=1000) is None
    assert root_warning([], {}, euid=65534) is None


def test_root_without_collectors_that_want_capabilities() -> None:
    line = root_warning(["pfc", "infiniband", "link", "gpu"], {}, euid=0)
    assert line is not None
    assert "\n" not in line
    assert "none of the enabled collectors (gpu, infiniband, link, pfc) needs" in line
    assert "unprivileged user" in line
    assert "CAP_" not in line


def test_root_with_topology_names_the_capabilities() -> None:
    line = root_warning(ALL, {}, euid=0)
    assert line is not None
    assert "\n" not in line
    assert "no collector needs" in line
    assert "CAP_SYS_ADMIN (topology: ACS redirect" in line
    assert "CAP_SYS_PTRACE + CAP_DAC_READ_SEARCH (topology: NCCL environment audit" in line


def topology(section: object) -> dict[str, Settings]:
    """The topology collector's settings of a config file's section."""
    return {"topology": parse_settings(TopologyCollector.settings_type, section, "topology")}


def test_audit_turned_off_drops_its_capabilities() -> None:
    config = topology({"nccl_env_audit": False})
    line = root_warning(["topology"], config, euid=0)
    assert line is not None
    assert "CAP_SYS_ADMIN" in line
    assert "CAP_SYS_PTRACE" not in line
    assert [n.what for n in needs(["topology"], config)] == ["ACS redirect of PCIe bridges"]


@pytest.mark.parametrize("config", [{}, topology({}), topology({"nccl_env_audit": True}),
                                    topology(None), {"link": LinkSettings()}])
def test_audit_default_is_on(config: dict[str, Settings]) -> None:
    caps = {c for n in needs(["topology"], config) for c in n.capabilities}
    assert caps == {"CAP_SYS_ADMIN", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"}


def test_no_collectors() -> None:
    assert needs([], {}) == []
    line = root_warning([], {}, euid=0)
    assert line is not None and "no collector enabled" in line


def test_unknown_collector_wants_nothing() -> None:
    assert needs(["mycollector"], {}) == []


def test_default_euid_is_the_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert root_warning(ALL, {}) is not None
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert root_warning(ALL, {}) is None


def test_every_need_documented() -> None:
    """docs/install.md's capability table names every capability a collector declares."""
    from support.paths import REPO

    text = (REPO / "docs" / "install.md").read_text(encoding="utf-8")
    assert privileges.declared()  # topology declares two
    for need in privileges.declared():
        for cap in need.capabilities:
            assert f"`{cap}`" in text, cap


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv (util-linux) to drop to another user")
def test_environ_needs_both_capabilities() -> None:
    """The claim behind the audit's Need: another user's /proc/PID/environ opens with
    CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH together, and with neither one alone."""
    target = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "sleep", "30"])
    try:
        def comm() -> str:
            with open(f"/proc/{target.pid}/comm", encoding="ascii") as fh:
                return fh.read().strip()

        wait_for(lambda: comm() == "sleep", "setpriv to become the user and exec sleep",
                 timeout=5, interval=0.01)

        def opens(caps: str) -> bool:
            argv = ["setpriv", "--reuid=1", "--regid=1", "--clear-groups"]
            if caps:
                argv += [f"--inh-caps={caps}", f"--ambient-caps={caps}"]
            return subprocess.run([*argv, "cat", f"/proc/{target.pid}/environ"],
                                  capture_output=True, check=False).returncode == 0

        assert not opens("")
        assert not opens("+sys_ptrace")
        assert not opens("+dac_read_search")
        assert opens("+sys_ptrace,+dac_read_search")
    finally:
        target.kill()
        target.wait()
