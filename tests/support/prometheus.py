"""A real Prometheus (and Alertmanager) for the end-to-end tests: started on loopback with the
generated rules, every `for:` at 0s and a 1 s scrape and evaluation interval, read through its
HTTP API."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import requests
import yaml

from gpunet_exporter.mixin import rules, thresholds

from support.exporter import free_port


def start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    """A server process whose output goes to ``log``."""
    with log.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[Any]) -> None:
    """Terminate a process, killing it when it has not ended within 15 s."""
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def fast_rules(tmp: Path, hold: Mapping[str, str] | None = None) -> Path:
    """The generator's rules with every `for:` at 0s (through a thresholds file), in ``tmp``,
    but those ``hold`` names (alert -> duration)."""
    overrides = tmp / "thresholds.yml"
    overrides.write_text(yaml.safe_dump(
        {"for": dict.fromkeys(rules.ALERT_NAMES, "0s") | dict(hold or {})}))
    path = tmp / "rules.yml"
    path.write_text(rules.render(thresholds.load(str(overrides), rules.ALERT_NAMES)))
    return path


def start_prometheus(tmp: Path, static_configs: list[dict[str, Any]],
                     alertmanager: str | None = None, hold: Mapping[str, str] | None = None,
                     port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Prometheus scraping ``static_configs`` as job ``gpunet`` every second with
    :func:`fast_rules` (``hold``), alerting ``alertmanager`` (host:port) if given, on ``port``
    (default: a free one; a target that queries Prometheus must know it first); the process
    and its URL."""
    config: dict[str, Any] = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                   "evaluation_interval": "1s"},
        "rule_files": [str(fast_rules(tmp, hold))],
        "scrape_configs": [{"job_name": "gpunet", "static_configs": static_configs}],
    }
    if alertmanager:
        config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = port or free_port()
    proc = start(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                  f"--storage.tsdb.path={tmp / 'prom-data'}",
                  f"--web.listen-address=127.0.0.1:{port}"], tmp / "prometheus.log")
    return proc, f"http://127.0.0.1:{port}"


def api(url: str, path: str, **params: str) -> Any:
    """The ``data`` of a successful answer of Prometheus' /api/v1/``path``."""
    r = requests.get(f"{url}/api/v1/{path}", params=params, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{path} {params}: {body}"
    return body["data"]


def query(url: str, expr: str) -> list[dict[str, Any]]:
    """An instant query's result vector."""
    result: list[dict[str, Any]] = api(url, "query", query=expr)["result"]
    return result
