"""The installed exporter as a subprocess on a free port, and third-party collector plugins."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import requests

from support.wait import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exporter_binary() -> str:
    exe = shutil.which("gpunet-exporter")
    assert exe, "the gpunet-exporter console script is not installed (pip install .)"
    return exe


class Exporter:
    """The installed exporter on a free port. ``scheme``, ``verify``, ``auth`` and ``cert`` are
    what requests needs to reach it when --web.config.file asks for TLS or basic auth; ``cwd``
    its working directory (the simulator's libumad2sim leaves ./sys-<pid> trees there)."""

    def __init__(self, args: list[str], env: Mapping[str, str] | None = None,
                 scheme: str = "http", verify: str | bool = True,
                 auth: tuple[str, str] | None = None,
                 cert: str | tuple[str, str] | None = None,
                 cwd: str | Path | None = None) -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.requests_kw: dict[str, Any] = {"verify": verify, "auth": auth, "cert": cert}
        self.proc = subprocess.Popen(
            [exporter_binary(), f"--web.listen-address=127.0.0.1:{self.port}", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})}, cwd=cwd)
        wait_for(self._healthy, f"the exporter to answer {self.url}/-/healthy", timeout=20,
                 ignore=(requests.ConnectionError,))

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"exporter exited {self.proc.returncode}: "
                                 f"{self.proc.stderr.read() if self.proc.stderr else ''}")
        return bool(requests.get(f"{self.url}/-/healthy", timeout=1,
                                 **self.requests_kw).status_code == 200)

    def metrics(self, **kw: Any) -> str:
        r = requests.get(f"{self.url}/metrics", **{"timeout": 30, **self.requests_kw, **kw})
        r.raise_for_status()
        return r.text

    def stop(self) -> str:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def install_plugin(site: Path, module: str, source: str, entry_points: Mapping[str, str]) -> Path:
    """A third-party distribution installed in ``site`` (a folder for PYTHONPATH): the module
    ``module`` with ``source``, and a dist-info whose entry points register each name ->
    "module:attribute" of ``entry_points`` as a collector."""
    site.mkdir(exist_ok=True)
    (site / f"{module}.py").write_text(source)
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[gpunet_exporter.collectors]\n" + "".join(
        f"{name} = {target}\n" for name, target in entry_points.items()))
    return site
