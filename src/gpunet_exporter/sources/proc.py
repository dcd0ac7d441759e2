"""procfs: a process's start time, the NVIDIA driver's version and the kernel release."""

from __future__ import annotations

import re

from gpunet_exporter.sources.sysfs import parse_uint

LABEL_MAX = 32  # a version string longer than this is cut: it is a label value


def parse_starttime(stat: str) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot); comm may hold spaces and ')'."""
    fields = stat[stat.rfind(")") + 1:].split()
    return parse_uint(fields[19]) if len(fields) > 19 else None


def parse_nvidia_version(text: str) -> tuple[str, str] | None:
    """(flavor, version) from /proc/driver/nvidia/version's NVRM line, or None."""
    line = text.splitlines()[0] if text else ""
    if not line.startswith("NVRM version:"):
        return None
    flavor = "open" if "Open Kernel Module" in line else "proprietary"
    version = next((t for t in line.split() if re.fullmatch(r"\d+(?:\.\d+)+", t)), "")
    return flavor, version[:LABEL_MAX]


def parse_kernel_release(text: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text)
    if not m:
        return None
    major, minor = parse_uint(m.group(1)), parse_uint(m.group(2))
    return (major, minor) if major is not None and minor is not None else None
