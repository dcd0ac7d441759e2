"""``ibv_devinfo`` output (rdma-core): the active MTU of InfiniBand ports, which sysfs does not
show (docs/formats.md)."""

from __future__ import annotations

import re

from gpunet_exporter.sources.sysfs import parse_uint

_KV = re.compile(r"^\s*([A-Za-z_]+):\s*(.*?)\s*$")


def parse_ibv_devinfo(text: str) -> dict[tuple[str, str], int]:
    """Active MTU per (device, port) from ``ibv_devinfo`` output; unknown lines are ignored."""
    out: dict[tuple[str, str], int] = {}
    device = port = ""
    for line in text.splitlines():
        m = _KV.match(line)
        if not m:
            continue
        key, value = m.groups()
        if key == "hca_id":
            device, port = value, ""
        elif key == "port":
            port = value
        elif key == "active_mtu" and device and port:
            mtu = parse_uint(value.split(" ", 1)[0])
            if mtu is not None:
                out[(device, port)] = mtu
    return out
