"""Hostile sysfs trees side by side: names that are not UTF-8 and a hw_counters/ directory of
20,000 files (issue 15, items 1 and 5), against gpunet-exporter and node_exporter.

Each case is a fresh copy of the generated DGX H100 tree (tests/support/sysfs_tree.py) with one
change; each exporter is started on it, scraped once to warm up and then five times, and the last
answer is counted: HTTP status, samples, InfiniBand samples, bytes, the median time and VmRSS. An
exporter that drops the connection is reported with its exit status (node_exporter 1.5.0 panics
on a label value that is not UTF-8).

    python bench/hostile_trees.py                              # this checkout's exporter
    python bench/hostile_trees.py --exporter before=/tmp/old/gpunet-exporter --json out.json

Results: docs/benchmarks.md, "Hostile sysfs trees".
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # for support.sysfs_tree

from support import sysfs_tree as st  # noqa: E402

BAD = b"\xff"  # never UTF-8
IB = "class/infiniband"


def _bad(path: Path) -> bytes:
    return os.fsencode(path) + BAD


def _move_link(link: Path, new: bytes, target_suffix: bytes = b"") -> None:
    target = os.readlink(os.fsencode(link))
    link.unlink()
    os.symlink(target + target_suffix, new)


def hw_counter_file(sysfs: Path) -> None:
    with open(_bad(sysfs / IB / "mlx5_0/ports/1/hw_counters/x"), "w") as fh:
        fh.write("5\n")


def rdma_device(sysfs: Path) -> None:
    _move_link(sysfs / IB / "mlx5_3", _bad(sysfs / IB / "mlx5_"))


def netdev(sysfs: Path) -> None:
    """mlx5_1's netdev renamed with a byte that is not UTF-8, at the PCI function and in
    class/net."""
    net = st._netdev(sysfs, "mlx5_1").resolve()
    os.rename(os.fsencode(net), _bad(net))
    _move_link(sysfs / "class/net" / net.name, _bad(sysfs / "class/net" / net.name), BAD)


def many_hw_counters(sysfs: Path) -> None:
    d = sysfs / IB / "mlx5_0/ports/1/hw_counters"
    for i in range(20_000):
        (d / f"gen_{i:05d}").write_text(f"{i}\n")


CASES: dict[str, Callable[[Path], None] | None] = {
    "baseline": None,
    "hw_counters file x\\xff": hw_counter_file,
    "RDMA device mlx5_\\xff": rdma_device,
    "netdev name ending in \\xff": netdev,
    "20,000 files in one hw_counters/": many_hw_counters,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def scrape(port: int) -> tuple[int, float, str]:
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read().decode("utf-8", "replace")
    finally:
        conn.close()
    return resp.status, time.monotonic() - t0, body


def start(cmd: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc


def measure(name: str, cmd: list[str], port: int) -> dict[str, Any]:
    proc = start(cmd, port)
    try:
        try:
            scrape(port)  # warm-up
            runs = [scrape(port) for _ in range(5)]
        except (OSError, http.client.HTTPException) as exc:
            time.sleep(0.3)
            return {"exporter": name, "error": repr(exc), "exited": proc.poll()}
        status, _, body = runs[-1]
        samples = [ln for ln in body.splitlines() if ln and not ln.startswith("#")]
        return {"exporter": name, "status": status,
                "median_ms": round(statistics.median(r[1] for r in runs) * 1000, 1),
                "samples": len(samples),
                "infiniband_samples": sum("infiniband" in ln for ln in samples),
                "bytes": len(body), "rss_mb": rss_mb(proc.pid)}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def commands(args: argparse.Namespace, sysfs: Path, port: int) -> dict[str, list[str]]:
    ours = ["--no-hotplug", "--no-collector.gpu", "--no-collector.probe",
            f"--web.listen-address=127.0.0.1:{port}", f"--path.sysfs={sysfs}"]
    out = {}
    for spec in args.exporter:
        name, _, exe = spec.partition("=")
        out[name] = [exe, *ours]
    if shutil.which(args.node_exporter_bin):
        out["node_exporter"] = [args.node_exporter_bin, f"--web.listen-address=127.0.0.1:{port}",
                                f"--path.sysfs={sysfs}"]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--exporter", action="append", metavar="NAME=PATH",
                   help="a gpunet-exporter executable to run (repeatable; default: "
                        "now=gpunet-exporter from PATH)")
    p.add_argument("--node-exporter-bin", default="prometheus-node-exporter")
    p.add_argument("--json", metavar="FILE", help="write the rows here")
    args = p.parse_args(argv)
    args.exporter = args.exporter or [f"now={shutil.which('gpunet-exporter') or 'gpunet-exporter'}"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpunet-hostile-trees-") as tmp:
        for case, change in CASES.items():
            root = Path(tmp) / "case"
            shutil.rmtree(root, ignore_errors=True)
            sysfs = st.build_dgx_h100(root)
            if change is not None:
                change(sysfs)
            for name in commands(args, sysfs, 0):
                port = free_port()
                row = {"case": case, **measure(name, commands(args, sysfs, port)[name], port)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
