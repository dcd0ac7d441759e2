"""Which privileges the collectors use, and the warning for running as root.

No collector needs root. Everything the exporter reads is open to any user (sysfs, NVML through
the /dev/nvidia* nodes, the SIOCETHTOOL statistics ioctl, DCB netlink reads, rdma-core's
/dev/infiniband/uverbs*) except two topology readings, and for those a capability gives the same
data as root (measured on Linux 6.18 with setpriv, see docs/install.md):

- the ACS Control register of PCIe bridges: the kernel shows a ``config`` file beyond its first
  64 bytes only to CAP_SYS_ADMIN (drivers/pci/pci-sysfs.c, pci_read_config);
- /proc/PID/environ of GPU processes of other users, for the NCCL environment audit: the file is
  mode 0400 (CAP_DAC_READ_SEARCH passes that) and opening it needs ptrace read access
  (CAP_SYS_PTRACE); neither one alone is enough.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Need:
    """Data that one collector reads only with extra privileges."""

    collector: str
    what: str
    capabilities: tuple[str, ...]
    option: str | None = None  # a boolean setting of the collector that turns this reading off
    option_default: bool = True


NEEDS: tuple[Need, ...] = (
    Need("topology", "ACS redirect of PCIe bridges", ("CAP_SYS_ADMIN",)),
    Need("topology", "NCCL environment audit of other users' GPU processes",
         ("CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"), option="nccl_env_audit"),
)


def needs(enabled_collectors: Iterable[str], config: Mapping[str, Any]) -> list[Need]:
    """The readings of the enabled collectors that want a capability.

    ``config`` maps a collector's name to its settings, as the configuration file and the
    resolved per-collector sections both do; a setting that is absent has its default.
    """
    enabled = set(enabled_collectors)
    out = []
    for need in NEEDS:
        if need.collector not in enabled:
            continue
        if need.option is not None:
            section = config.get(need.collector)
            value = section.get(need.option) if isinstance(section, Mapping) else None
            if not (need.option_default if value is None else bool(value)):
                continue
        out.append(need)
    return out


def root_warning(enabled_collectors: Iterable[str], config: Mapping[str, Any], *,
                 euid: int | None = None) -> str | None:
    """One warning line when the process runs as root (effective UID 0), else None.

    Root is never needed, so the line always advises an unprivileged user, and names the
    capabilities that give what the enabled collectors would read with root's privileges.
    ``euid`` defaults to this process's.
    """
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    enabled = sorted(set(enabled_collectors))
    wanted = needs(enabled, config)
    head = "running as root, which "
    advice = ("run as an unprivileged user instead (systemd/gpunet-exporter.service, "
              "docs/install.md)")
    if not wanted:
        if not enabled:
            return f"running as root with no collector enabled: {advice}"
        return f"{head}none of the enabled collectors ({', '.join(enabled)}) needs: {advice}"
    gives = ", ".join(f"{' + '.join(n.capabilities)} ({n.collector}: {n.what})" for n in wanted)
    return f"{head}no collector needs: {advice}; these capabilities give the same data: {gives}"


__all__ = ["NEEDS", "Need", "needs", "root_warning"]
