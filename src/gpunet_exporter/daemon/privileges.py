"""Which privileges the collectors use, and the warning for running as root.

No collector needs root: each declares what needs more than an ordinary user
(``Collector.privileges``), and this module only reads the declarations. Today those are two
topology readings, the ACS Control register of PCIe bridges (CAP_SYS_ADMIN) and other users'
/proc/PID/environ (CAP_DAC_READ_SEARCH with CAP_SYS_PTRACE): docs/install.md says why and how.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpunet_exporter.collector import Collector, Privilege
from gpunet_exporter.config import Settings, settings_items
from gpunet_exporter.registry import discover


@dataclass(frozen=True)
class Need:
    """Data that one collector reads only with extra privileges (its ``Privilege``)."""

    collector: str
    what: str
    capabilities: tuple[str, ...]


def declared(classes: Mapping[str, type[Collector]] | None = None) -> list[Need]:
    """Every privileged reading the collectors declare (``Collector.privileges``)."""
    classes = discover() if classes is None else classes
    return [Need(name, p.what, p.capabilities) for name, cls in sorted(classes.items())
            for p in cls.privileges]


def _wanted(cls: type[Collector], p: Privilege, settings: Settings | None) -> bool:
    if p.option is None:
        return True
    if not isinstance(settings, cls.settings_type):
        settings = cls.settings_type()
    return bool(settings_items(settings)[p.option])


def needs(enabled_collectors: Iterable[str], settings: Mapping[str, Settings],
          classes: Mapping[str, type[Collector]] | None = None) -> list[Need]:
    """The readings of the enabled collectors that want a capability.

    ``settings`` maps a collector's name to its settings (options.resolve()); a collector
    without an entry has its declared defaults. ``classes`` defaults to the installed
    collectors.
    """
    classes = discover() if classes is None else classes
    out = []
    for name in sorted(set(enabled_collectors)):
        cls = classes.get(name)
        if cls is None:
            continue
        out += [Need(name, p.what, p.capabilities) for p in cls.privileges
                if _wanted(cls, p, settings.get(name))]
    return out


def root_warning(enabled_collectors: Iterable[str], settings: Mapping[str, Settings], *,
                 euid: int | None = None) -> str | None:
    """One warning line when the process runs as root (effective UID 0), else None.

    Root is never needed, so the line always advises an unprivileged user, and names the
    capabilities that give what the enabled collectors would read with root's privileges.
    ``euid`` defaults to this process's.
    """
    if (os.geteuid() if euid is None else euid) != 0:
        return None
    enabled = sorted(set(enabled_collectors))
    wanted = needs(enabled, settings)
    head = "running as root, which "
    advice = ("run as an unprivileged user instead (systemd/gpunet-exporter.service, "
              "docs/install.md)")
    if not wanted:
        if not enabled:
            return f"running as root with no collector enabled: {advice}"
        return f"{head}none of the enabled collectors ({', '.join(enabled)}) needs: {advice}"
    gives = ", ".join(f"{' + '.join(n.capabilities)} ({n.collector}: {n.what})" for n in wanted)
    return f"{head}no collector needs: {advice}; these capabilities give the same data: {gives}"


__all__ = ["Need", "declared", "needs", "root_warning"]
