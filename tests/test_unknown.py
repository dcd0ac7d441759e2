"""Issue 33's "never silently blind", end to end: the installed exporter and doctor on a node
whose hardware calls for checks they cannot run.

The node: the DGX tree with its 8 GPUs on the PCI bus, 8 InfiniBand and 2 RoCE ports; this
machine's real nvidia-ml-py without NVIDIA's library (where the library is installed, NVML
works and its check is not expected to be unknown); no `ibv_devinfo`, no QoS source and no
`ethtool` or `devlink` (the nic collector's command backends) where the configuration looks for
them. Each missing check must be unknown in Prometheus
(gpunet_check_unknown), on the landing page and in the doctor's report (exit 2), and no
collector with a check that did not run may say "ok".
"""

from __future__ import annotations

import ctypes.util
import json
import re
import subprocess
from pathlib import Path

import requests

from gpunet_exporter.collector import UNKNOWN_REASONS

from support import sysfs_tree as st
from support.exporter import Exporter, exporter_binary
from support.metrics import parse, series

COLLECTORS = ("infiniband", "link", "pfc", "gpu", "topology", "nic")


def _node(tmp_path: Path) -> list[str]:
    sysfs = st.build_dgx_h100_gpus(tmp_path / "node")
    proc = st.build_procfs(tmp_path / "node")
    missing = tmp_path / "not-installed"
    cfg = tmp_path / "gpunet.yml"
    cfg.write_text(f"link:\n  ibv_devinfo: {{path: {missing}}}\n"
                   f"pfc:\n  config: {{mlnx_qos_path: {missing}, dcb_path: {missing}}}\n"
                   f"nic:\n  eeprom_source: ethtool\n  ethtool: {{path: {missing}}}\n"
                   f"  health_source: devlink\n  devlink: {{path: {missing}}}\n")
    return [f"--path.sysfs={sysfs}", f"--path.procfs={proc}", f"--config.file={cfg}",
            "--collector.disable-defaults", *(f"--collector.{c}" for c in COLLECTORS)]


def _expected() -> dict[tuple[str, str], str]:
    expected = {("link", "ib_mtu"): "tool_missing", ("pfc", "pfc_config"): "tool_missing",
                ("nic", "transceiver"): "tool_missing", ("nic", "health_reporters"): "tool_missing"}
    if ctypes.util.find_library("nvidia-ml") is None:  # the CI machine, this one
        expected[("gpu", "nvml")] = "library_missing"
    return expected


def test_each_check_that_cannot_run_is_unknown_everywhere(tmp_path: Path) -> None:
    args = _node(tmp_path)
    expected = _expected()
    exporter = Exporter([*args, "--no-hotplug"])
    try:
        text = exporter.metrics()
        page = requests.get(exporter.url + "/", timeout=10).text
    finally:
        exporter.stop()
    samples = parse(text)
    got = {(dict(k)["collector"], dict(k)["check"]): dict(k)["reason"]
           for k, v in series(samples, "gpunet_check_unknown").items() if v == 1}
    assert got == expected
    # Each collector ran; the ones with an unknown check are not "ok" on the landing page.
    assert all(v == 1 for v in series(samples, "gpunet_scrape_collector_success").values())
    rows = dict(re.findall(r"<tr><td>(\w+)</td><td>([^<]*)</td>", page))
    assert set(rows) == set(COLLECTORS), rows
    for collector, state in rows.items():
        mine = sorted(check for (c, check) in expected if c == collector)
        if mine:
            assert state.startswith("UNKNOWN: "), (collector, state)
            for check in mine:
                why = UNKNOWN_REASONS[expected[(collector, check)]]
                assert f"{check} not checked ({why})" in state
        else:
            assert state == "ok", (collector, state)

    out = subprocess.run([exporter_binary(), "doctor", *args, "--interval", "0.5",
                          f"--state-file={tmp_path / 'doctor.json'}", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    report = json.loads(out.stdout)
    unknown = {f["where"] for f in report["findings"] if f["alert"] == "GpunetCheckUnknown"}
    assert unknown == {f"{c} {check}" for c, check in expected}
    assert not [f for f in report["findings"] if f["fault"]], report["findings"]
    text_out = subprocess.run([exporter_binary(), "doctor", *args, "--interval", "0.5",
                               f"--state-file={tmp_path / 'doctor.json'}"],
                              capture_output=True, text=True, timeout=120)
    checked = next(line for line in text_out.stdout.splitlines()
                   if line.startswith("Checked: "))
    for collector in COLLECTORS:
        mine = sorted(check for (c, check) in expected if c == collector)
        state = f"UNKNOWN: {', '.join(mine)} not checked" if mine else "ok"
        assert f"{collector} ({state})" in checked, checked
