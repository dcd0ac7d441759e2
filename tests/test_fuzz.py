"""Property-based robustness tests (issue 7): random bytes, random text and near-valid mutations
of real inputs go to every parser, and no exception escapes beyond the parser's documented, clean
rejection.

Inputs are the real samples of tests/fixtures/pfc/ (mlnx_qos reports, dcb JSON of iproute2 6.1 and
6.15), tests/fixtures/ (NCCL logs, the NVML capture that tests/support/fake_nvml.py replays, the
synthetic ``ethtool -S`` capture), trees built by tests/support/sysfs_tree.py and the formats of
docs/formats.md, mutated by :func:`mutated`: lines deleted, duplicated, swapped,
truncated or replaced, numbers made huge, negative, fractional or non-numeric, NUL, control,
non-ASCII, U+FFFD (what a non-UTF-8 byte decodes to) and line-separator characters inserted,
whitespace changed, the text cut short; :func:`mutated_bytes` adds invalid UTF-8 bytes.

Label values are fuzzed end to end as well: hypothesis-made names of any bytes (what Linux
allows in a file name) become counter files, an RDMA device and a netdev in a real tree, and the
collection goes through the registry's label check and prometheus_client's text and OpenMetrics
encoders (test_names_end_to_end).

Contracts: "never raises" means a value (or None) for any input; where a parser has a documented
clean rejection the test accepts exactly that exception and nothing else.

====================================  ====================================  ====================
parser (module)                       contract                              tests
====================================  ====================================  ====================
parse_uint, parse_int (exporter/      int or None, never raises             sysfs_numbers
sysfs.py)
Root.read/read_dir/read_bytes         text (invalid UTF-8 replaced) or      the collector trees
                                      OSError
parse_rate, parse_state (collectors/  Rate/int or None, never raises        rate_and_state,
infiniband.py)                                                              infiniband_link_tree
InfinibandCollector.collect           completes and renders; garbage costs  infiniband_link_tree
                                      values (unreadable), not the scrape
parse_ibv_devinfo, roce_active_mtu    dict / int or None, never raises      ibv_devinfo
(src/gpunet_exporter/collectors/link.py)
LinkCollector.collect                 as InfinibandCollector                infiniband_link_tree
drop_unexposable (exporter/           renders through both encoders; a      names_end_to_end
registry.py) on names from listings   name that can be a label is exported
(counter files, RDMA devices,         as is, one that cannot costs its
netdevs) and text in labels           samples, counted
parse_stats_text (exporter/           NicStats (names and values of equal   ethtool_text
ethtool.py)                           length), never raises
EthtoolReader.read (ioctl buffers)    NicStats or OSError                   ethtool_ioctl
_plan (gpunet_exporter.collectors.pfc)             never raises                          pfc_plan
parse_mlnx_qos (collectors/           QosConfig or ValueError ("not the     mlnx_qos_near_valid
pfc_config.py)                        tool's output at all")
parse_dcb                             QosConfig or ValueError               dcb_near_valid
parse_qos_sysfs                       QosConfig or ValueError (the          qos_sysfs
                                      collector's refresh catches it)
read_ecn                              Ecn; bad files go to ``skip``         pfc_tree
PfcCollector.refresh/collect          completes; garbage costs values       pfc_tree
ncclog.parse_lines/parse_file/        never raises (module docstring)       nccl_log_*
looks_like_nccl_log (src/gpunet_exporter/probe)
results.parse/results.read            Result, or BadResult (read: also      probe_result_*
(src/gpunet_exporter/probe/results.py)           OSError)
supervisor.read_status (exporter/     never raises                          probe_status_file
probe, status.json)
run_options.parse_bytes/parse_sizes   value, or ArgumentTypeError/          runner_arguments
                                      ValueError (argparse reports both)
runner.cluster_from_env               Cluster or None, never raises         runner_arguments
config.parse_settings, read_yaml,     value, or ConfigError only; a valid   config_validate,
load_file, thresholds.load            collector section converts to its     config_file
                                      typed settings, never raises
errors.short, key_text (error         at most 60 characters: repr() or its  short_excerpt
messages)                             start, for any value (huge, shared)
read_yaml (anchors and aliases)       refused exactly beyond MAX_VALUES     yaml_aliases_are_
                                      values counted through every alias    counted
webconfig.load_web_config             WebConfig or ConfigError only         web_config_file
webconfig.BasicAuth.check             bool, never raises (request header)   basic_auth_header
topology: parse_environ,              value or None, never raises           topology_text
parse_starttime,
parse_nvidia_version,
parse_kernel_release, _strtol,
env_findings
topology.acs_control                  int or None, or EOFError              acs_control
topology.endpoint, relation           Endpoint/None; path in PATHS          pci_paths
TopologyCollector.collect             completes and renders                 topology_tree
nvml.sysfs_bus_id                     sysfs form or "", never raises        nvml_bus_id
nvml.Session + GpuCollector           completes and renders on odd NVML     gpu_odd_nvml_values
(collect, refresh, device_event)      values (bytes or str, huge/negative
                                      ints, any NVMLError, lost GPUs)
collectors.tables.load                rows of str -> str, or ValueError     regression only
                                      naming file and row
====================================  ====================================  ====================

Already fuzzed elsewhere, not repeated here: random text into parse_mlnx_qos and its whitespace
invariance (test_pfc.py); random lines, random NCCL-prefixed lines, random bytes and every
truncation of real lines into ncclog.parse_lines (test_ncclog.py); random bytes through
json.loads into results.parse (test_probe.py). web.http (parse_listen_address) is left
out while it is being reworked.

Bugs this suite found are pinned by regression tests at the end, each with its minimal input
and, in a comment, what went wrong (they were strict xfails until fixed). The property tests
above them draw those inputs too (numbers beyond the float range and int()'s digit limit,
characters that ``str.isdigit`` accepts and ``int`` refuses, deep nesting, NUL in names that
become paths, odd YAML escapes, ...): a new known bug gets a strict xfail test here and, only
while it stands, an exclusion in the strategies that names that test.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import ctypes
import errno
import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import bcrypt
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse
from prometheus_client.parser import text_string_to_metric_families

from gpunet_exporter.background import Refresher
from gpunet_exporter.collector import Collector, Scrape
from gpunet_exporter.collectors import tables
from gpunet_exporter.collectors.gpu import GpuCollector
from gpunet_exporter.collectors.infiniband import HW_NAMES, InfinibandCollector
from gpunet_exporter.collectors.link import LinkCollector
from gpunet_exporter.collectors.pfc import NAMES, PfcCollector, _plan
from gpunet_exporter.collectors.probe import ProbeCollector
from gpunet_exporter.collectors.topology import TopologyCollector
from gpunet_exporter.config import Field, Settings, load_file, parse_settings, settings_fields
from gpunet_exporter.errors import ConfigError, key_text, short
from gpunet_exporter.files import MAX_VALUES, read_yaml
from gpunet_exporter.mixin import thresholds
from gpunet_exporter.nccl import log as ncclog
from gpunet_exporter.nccl.env import (
    NCCL_FINDINGS,
    NCCL_SETTINGS,
    env_findings,
    parse_environ,
    strtol,
)
from gpunet_exporter.probe import results, supervisor
from gpunet_exporter.probe.run_options import parse_bytes, parse_sizes
from gpunet_exporter.probe.runner import Cluster, cluster_from_env
from gpunet_exporter.registry import drop_unexposable, label_problem
from gpunet_exporter.sources import nvml, rdma
from gpunet_exporter.sources.ethtool import (
    ETH_GSTRING_LEN,
    ETH_SS_STATS,
    ETHTOOL_GDRVINFO,
    ETHTOOL_GSSET_INFO,
    ETHTOOL_GSTATS,
    ETHTOOL_GSTRINGS,
    EthtoolReader,
    NicStats,
    parse_stats_text,
)
from gpunet_exporter.sources.ibv_devinfo import parse_ibv_devinfo
from gpunet_exporter.sources.pcie import PATHS, Endpoint, acs_control, endpoint, relation
from gpunet_exporter.sources.proc import parse_kernel_release, parse_nvidia_version, parse_starttime
from gpunet_exporter.sources.qos import (
    PRIORITIES,
    QosConfig,
    parse_dcb,
    parse_mlnx_qos,
    parse_qos_sysfs,
    read_ecn,
)
from gpunet_exporter.sources.rdma import parse_rate, parse_state, roce_active_mtu
from gpunet_exporter.sources.sysfs import Root, parse_int, parse_uint
from gpunet_exporter.web.webconfig import BasicAuth, WebConfigFile, load_web_config, wrap

from support import fake_nvml
from support import sysfs_tree as st
from support.metrics import make_collector, samples_of, series
from support.paths import FIXTURES

PFC_DATA = FIXTURES / "pfc"
MLNX_QOS = {p.name: p.read_text() for p in sorted(PFC_DATA.glob("mlnx_qos_*.txt"))}
DCB = {d.name: {p.stem: p.read_text() for p in sorted(d.glob("*.json"))}
       for d in sorted(PFC_DATA.glob("dcb-*"))}
ETHTOOL_CAPTURE = (FIXTURES / "synthetic"
                   / "ethtool-S_mlx5_pfc-prio3_RECONSTRUCTED.txt").read_text()
NCCL_LOGS = {p.name: p.read_text() for p in [*sorted((FIXTURES / "nccl").glob("*.log")),
                                             *(FIXTURES / "synthetic").glob("*.log")]}

# ---- strategies --------------------------------------------------------------------------------


# Characters the parsers split, strip or match on, and the odd ones a real read produces ("²"
# and "①": str.isdigit() accepts them, int() refuses them).
SPECIAL = ("\x00\t\r\n\x0b\x0c\x1c\x1e\x1f\x7f\x85\u2028\u2029 :;,.=%()[]/-+_#\"'\\"
           "\ufffd\u00a0\u0663\uff11\u00e9\u4e2d\u00b2\u2460")
CHARS = hs.sampled_from(SPECIAL + "0123456789abcxyzAX") | hs.characters(
    codec="utf-8")  # utf-8: no lone surrogates, as a decoded read never has
# Beyond the float range (400 digits) and beyond int()'s digit limit (4300) included.
WEIRD_NUMBERS = ("0", "-0", "-1", "00", "007", "4294967295", "4294967296", "18446744073709551615",
                 "18446744073709551616", "9" * 40, "1" + "0" * 100, "1" + "0" * 400, "9" * 5000,
                 "1e400", "-1e400", "0x1f", "1.5", ".5", "5.", "nan", "inf", "", " ", "N/A",
                 "\u0663", "\uff17", "\ufffd", "\u00b2", "1\u00b2", "1\x002", "1 2", "+3")
WHITESPACE = ("", " ", "  ", "\t", "\t\t", " \t ", "\r", "\u00a0", "\x0b", "\n")
BAD_BYTES = (b"\x00", b"\xff", b"\xfe", b"\xc3", b"\xed\xa0\x80", b"\xe2\x80", b"\r", b"\x1b[0m",
             b"\xef\xbb\xbf")


def text(max_size: int = 200) -> hs.SearchStrategy[str]:
    return hs.text(CHARS, max_size=max_size)


NUMBER = hs.sampled_from(WEIRD_NUMBERS) | hs.integers(-(2**70), 2**70).map(str)
_DIGITS = re.compile(r"\d+")
_OPS = ("delete", "duplicate", "swap", "truncate", "number", "number", "insert", "whitespace",
        "replace", "cut")


@hs.composite
def mutated(draw: hs.DrawFn, sample: str, max_ops: int = 6) -> str:
    """``sample`` with up to ``max_ops`` line-level and character-level edits."""
    lines = sample.splitlines(keepends=True) or [""]
    for _ in range(draw(hs.integers(0, max_ops), label="edits")):
        if not lines:
            lines = [""]
        i = draw(hs.integers(0, len(lines) - 1), label="line")
        line = lines[i]
        op = draw(hs.sampled_from(_OPS), label="edit")
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, line)
        elif op == "swap":
            j = draw(hs.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif op == "truncate":
            lines[i] = line[:draw(hs.integers(0, len(line)))]
        elif op == "number":
            spans = [m.span() for m in _DIGITS.finditer(line)]
            new = draw(NUMBER)
            if spans:
                a, b = draw(hs.sampled_from(spans))
                lines[i] = line[:a] + new + line[b:]
            else:
                lines[i] = new + line
        elif op == "insert":
            pos = draw(hs.integers(0, len(line)))
            lines[i] = line[:pos] + draw(hs.sampled_from(SPECIAL) | text(8)) + line[pos:]
        elif op == "whitespace":
            blank = draw(hs.sampled_from(WHITESPACE))
            lines[i] = re.sub(r"[ \t]+", blank, line)  # no backslash in WHITESPACE
        elif op == "replace":
            lines[i] = draw(text(60))
        else:  # the read ends here
            lines = [*lines[:i], line[:draw(hs.integers(0, len(line)))]]
    return "".join(lines)


@hs.composite
def mutated_bytes(draw: hs.DrawFn, sample: str, max_ops: int = 6) -> bytes:
    """:func:`mutated`, encoded, with invalid UTF-8 and control bytes inserted."""
    data = bytearray(draw(mutated(sample, max_ops)).encode())
    for _ in range(draw(hs.integers(0, 3))):
        pos = draw(hs.integers(0, len(data)))
        data[pos:pos] = draw(hs.sampled_from(BAD_BYTES) | hs.binary(min_size=1, max_size=4))
    return bytes(data)


def near(sample: str, max_size: int = 200) -> hs.SearchStrategy[str]:
    """A mutation of ``sample`` or plain random text."""
    return mutated(sample) | text(max_size)


def decoded(sample: str) -> hs.SearchStrategy[str]:
    """What Root.read returns for a file holding a mutation of ``sample`` or random bytes."""
    raw = mutated_bytes(sample) | hs.binary(max_size=80)
    return raw.map(lambda b: b.decode("utf-8", "replace").rstrip())


def file_content(sample: str) -> hs.SearchStrategy[bytes]:
    """Bytes for a sysfs or procfs file that normally holds ``sample``."""
    return (mutated_bytes(sample, 3) | hs.binary(max_size=60)
            | hs.sampled_from(WEIRD_NUMBERS).map(lambda n: f"{n}\n".encode()))


JSON_SCALARS = (hs.none() | hs.booleans() | hs.integers(-(2**63), 2**64)
                | hs.sampled_from((10**400, -(10**400)))  # beyond the float range
                | hs.floats() | text(20))
JSON = hs.recursive(JSON_SCALARS, lambda inner: hs.lists(inner, max_size=4)
                    | hs.dictionaries(text(10), inner, max_size=4), max_leaves=10)


def _mutate_node(draw: hs.DrawFn, node: Any, depth: int = 0) -> Any:
    """One edit somewhere below ``node``: a value replaced, a key or element dropped or
    duplicated, a key added; the whole document is replaced only now and then."""
    descend = draw(hs.sampled_from((True,) * (9 if depth == 0 else 3) + (False,)))
    if isinstance(node, dict) and node and descend:
        key = draw(hs.sampled_from(sorted(node)))
        action = draw(hs.sampled_from(("descend", "descend", "replace", "delete", "add")))
        if action == "descend":
            node[key] = _mutate_node(draw, node[key], depth + 1)
        elif action == "replace":
            node[key] = draw(JSON)
        elif action == "delete":
            del node[key]
        else:
            node[draw(text(10))] = draw(JSON)
        return node
    if isinstance(node, list) and node and descend:
        i = draw(hs.integers(0, len(node) - 1))
        action = draw(hs.sampled_from(("descend", "descend", "replace", "delete", "duplicate")))
        if action == "descend":
            node[i] = _mutate_node(draw, node[i], depth + 1)
        elif action == "replace":
            node[i] = draw(JSON)
        elif action == "delete":
            del node[i]
        else:
            node.insert(i, copy.deepcopy(node[i]))
        return node
    return draw(JSON)


@hs.composite
def mutated_json(draw: hs.DrawFn, sample: Any, max_ops: int = 4) -> Any:
    value = copy.deepcopy(sample)
    for _ in range(draw(hs.integers(1, max_ops))):
        value = _mutate_node(draw, value)
    return value


def fuzz(examples: int) -> settings:
    """Settings of every property test here: ``examples`` inputs, no deadline."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- helpers -----------------------------------------------------------------------------------


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render(families: list[Metric]) -> bytes:
    """The exposition text of some families: what /metrics would serve."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))
    return generate_latest(registry)


def scrape(c: Collector) -> tuple[list[Metric], int]:
    """One collection, through the label check the registry's Runner makes after every
    collect(), rendered (so that the values and labels are valid samples), and the number of
    values the collector skipped."""
    families = list(c.collect(Scrape()))
    drop_unexposable(families, c.ctx.skip)
    render(families)
    return families, c.ctx.unreadable


def no_background(c: Collector) -> None:
    """Stop a collector's Refresher before it starts, so that collect() starts no thread; the
    test calls the collector's refresh() itself, where an exception cannot be swallowed by the
    thread."""
    refresher = c._refresher  # type: ignore[attr-defined]
    assert isinstance(refresher, Refresher)
    refresher.stop()


def check_qos(cfg: QosConfig, source: str) -> None:
    """What the pfc collector relies on: priorities 0-7, DSCPs 0-63, numbers where numbers."""
    assert cfg.source == source
    assert set(cfg.pfc) <= set(PRIORITIES) and all(isinstance(v, bool) for v in cfg.pfc.values())
    assert set(cfg.prio_tc) <= set(PRIORITIES)
    assert all(isinstance(v, int) and v >= 0 for v in cfg.prio_tc.values())
    assert set(cfg.prio_buffer) <= set(PRIORITIES)
    assert all(isinstance(v, int) and v >= 0 for v in cfg.prio_buffer.values())
    assert all(0 <= d < 64 and p in PRIORITIES for d, p in cfg.dscp_prio.items())
    assert cfg.default_prio is None or cfg.default_prio in PRIORITIES
    assert all(isinstance(v, str) for v in cfg.tc_tsa.values())
    assert all(isinstance(v, float) for v in [*cfg.tc_bw.values(), *cfg.tc_rate_limit.values()])
    assert all(isinstance(v, int) and v >= 0 for v in cfg.buffer_size.values())
    assert cfg.buffer_total is None or (isinstance(cfg.buffer_total, int)
                                        and cfg.buffer_total >= 0)
    assert isinstance(cfg.trust, str) and isinstance(cfg.dcbx_mode, str)


def _write_files(root: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


# ---- sysfs values and InfiniBand port files ----------------------------------------------------


@fuzz(150)
@given(near("18446744073709551615\n") | hs.sampled_from(WEIRD_NUMBERS)
       | hs.integers(-(2**80), 2**80).map(str))
def test_sysfs_numbers(value: str) -> None:
    u, i = parse_uint(value), parse_int(value)
    assert u is None or (u >= 0 and u == int(value))
    assert i is None or i == int(value)
    if u is not None:
        assert i == u


RATES = ("400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)", "10 Gb/sec (4X)", "53.125 Gb/sec (1X HDR)",
         "100 Gb/sec (2X HDR)", "800 Gb/sec (4X XDR)", "1600 Gb/sec (8X XDR)")
STATES = ("4: ACTIVE", "1: DOWN", "5: LinkUp", "7: Phy Test", "0: <unknown>", "N/A (no PMA)")


@fuzz(200)
@given(hs.sampled_from(RATES + STATES).flatmap(decoded) | text())
def test_rate_and_state(value: str) -> None:
    rate = parse_rate(value)
    if rate is not None:
        assert rate.lanes >= 1 and rate.gbps >= 0 and isinstance(rate.speed, str)
        assert rate.lane_bytes_per_second <= rate.bytes_per_second
    state = parse_state(value)
    assert state is None or isinstance(state, int)


IBV_DEVINFO = (
    "hca_id:\tmlx5_0\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t28.39.2048\n"
    "\tnode_guid:\t\t\tb83f:d203:00a1:2b3c\n\tvendor_id:\t\t\t0x02c9\n"
    "\tvendor_part_id:\t\t\t4129\n\thw_ver:\t\t\t\t0x0\n\tboard_id:\t\t\tMT_0000000838\n"
    "\tphys_port_cnt:\t\t\t1\n\t\tport:\t1\n\t\t\tstate:\t\t\tPORT_ACTIVE (4)\n"
    "\t\t\tmax_mtu:\t\t4096 (5)\n\t\t\tactive_mtu:\t\t4096 (5)\n\t\t\tsm_lid:\t\t\t1\n"
    "\t\t\tport_lid:\t\t1691\n\t\t\tport_lmc:\t\t0x00\n\t\t\tlink_layer:\t\tInfiniBand\n"
    "\t\t\tactive_width:\t\t4X (2)\n\t\t\tactive_speed:\t\t100.0 Gbps (128)\n"
    "\t\t\tphys_state:\t\tLINK_UP (5)\n\n"
    "hca_id:\tmlx5_9\n\tphys_port_cnt:\t\t\t1\n\t\tport:\t1\n\t\t\tactive_mtu:\t\t1024 (3)\n"
    "\t\t\tlink_layer:\t\tEthernet\n"
    "\t\t\tGID[  0]:\t\tfe80:0000:0000:0000:0ac0:ebff:fe21:03da, RoCE v1\n"
)


@fuzz(150)
@given(near(IBV_DEVINFO), hs.integers(-(2**70), 2**70))
def test_ibv_devinfo(value: str, netdev_mtu: int) -> None:
    out = parse_ibv_devinfo(value)
    assert all(isinstance(d, str) and isinstance(p, str) and isinstance(m, int) and m >= 0
               for (d, p), m in out.items())
    active = roce_active_mtu(netdev_mtu)
    assert active is None or active in (256, 512, 1024, 2048, 4096)


# ---- ethtool -S: text and the SIOCETHTOOL buffers ----------------------------------------------


def check_stats(stats: NicStats) -> None:
    assert len(stats.names) == len(stats.values)
    assert all(isinstance(n, str) for n in stats.names)
    assert all(isinstance(v, int) and v >= 0 for v in stats.values)


@fuzz(150)
@given(mutated_bytes(ETHTOOL_CAPTURE).map(lambda b: b.decode("utf-8", "replace")) | text(400))
def test_ethtool_text(value: str) -> None:
    stats = parse_stats_text(value)
    check_stats(stats)
    assert all(n and n == n.strip() for n in stats.names)


@dataclass(frozen=True)
class _Reply:
    """One round of a driver's answers: its count, how many strings and values it wrote."""

    count: int
    n_strings: int
    n_stats: int
    strings: bytes
    stats: bytes


@hs.composite
def _replies(draw: hs.DrawFn) -> _Reply:
    count = draw(hs.integers(0, 40))
    consistent = draw(hs.booleans())
    odd = hs.sampled_from((0, 1, count + 1, 2 * count + 257, 2**31, 2**32 - 1)) | hs.integers(0, 99)
    n_strings = count if consistent else draw(odd)
    n_stats = count if consistent else draw(odd)
    names = draw(hs.binary(max_size=min(n_strings, 80) * ETH_GSTRING_LEN)
                 | hs.lists(hs.sampled_from(sorted(NAMES)) | text(40), max_size=80).map(
                     lambda ns: b"".join(n.encode()[:ETH_GSTRING_LEN].ljust(ETH_GSTRING_LEN,
                                                                            b"\0") for n in ns)))
    return _Reply(count, n_strings, n_stats, names, draw(hs.binary(max_size=min(n_stats, 80) * 8)))


class _FakeKernel(EthtoolReader):
    """SIOCETHTOOL answered from drawn replies instead of a driver: counts, names and values as
    a buggy or reconfigured driver could write them, never past the caller's buffer."""

    def __init__(self, replies: list[_Reply], gsset: str) -> None:
        super().__init__()
        self.replies, self.gsset, self.round = replies, gsset, 0

    def _ioctl(self, ifname: bytes, buf: ctypes.Array[ctypes.c_char]) -> None:
        cmd, = struct.unpack_from("I", buf, 0)
        reply = self.replies[min(self.round, len(self.replies) - 1)]

        def put(offset: int, data: bytes) -> None:
            data = data[:max(0, len(buf) - offset)]
            ctypes.memmove(ctypes.addressof(buf) + offset, data, len(data))

        if cmd == ETHTOOL_GSSET_INFO:
            if self.gsset == "old kernel":
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            if self.gsset == "gone":
                raise OSError(errno.ENODEV, "No such device")
            struct.pack_into("QI", buf, 8, 0 if self.gsset == "no mask" else 1 << ETH_SS_STATS,
                             reply.count)
        elif cmd == ETHTOOL_GDRVINFO:
            struct.pack_into("I", buf, 4 + 128 + 12, reply.count)
        elif cmd == ETHTOOL_GSTRINGS:
            struct.pack_into("I", buf, 8, reply.n_strings)
            put(12, reply.strings)
        elif cmd == ETHTOOL_GSTATS:
            struct.pack_into("I", buf, 4, reply.n_stats)
            put(8, reply.stats)
            self.round += 1
        else:
            raise AssertionError(f"unexpected ethtool command {cmd:#x}")


@fuzz(120)
@given(hs.lists(_replies(), min_size=1, max_size=4),
       hs.sampled_from(("ok", "ok", "no mask", "old kernel", "gone")))
def test_ethtool_ioctl(replies: list[_Reply], gsset: str) -> None:
    reader = _FakeKernel(replies, gsset)
    for _ in range(2):  # the second read goes through the cached buffers and names
        try:
            check_stats(reader.read("eth0"))
        except OSError as exc:
            assert exc.errno in (errno.EAGAIN, errno.ENODEV)
    reader.forget(set())
    reader.close()


@fuzz(150)
@given(hs.lists(hs.sampled_from(sorted(NAMES)) | text(40)
                | hs.builds("{}prio{}_{}".format, hs.sampled_from(("rx_", "tx_", "")),
                            hs.integers(0, 9), text(10)), max_size=40))
def test_pfc_plan(names: list[str]) -> None:
    for index, spec, labels, divisor in _plan("eth0", names):
        assert 0 <= index < len(names) and divisor >= 1
        assert tuple(labels) == spec.labels and labels["interface"] == "eth0"


# ---- QoS configuration: mlnx_qos, dcb JSON, OFED sysfs -----------------------------------------


@fuzz(150)
@given(hs.sampled_from(sorted(MLNX_QOS)).flatmap(lambda n: mutated(MLNX_QOS[n], 8)))
def test_mlnx_qos_near_valid(report: str) -> None:
    try:
        cfg = parse_mlnx_qos(report)
    except ValueError:
        return
    check_qos(cfg, "mlnx_qos")


@hs.composite
def _dcb_inputs(draw: hs.DrawFn) -> dict[str, str | None]:
    files = DCB[draw(hs.sampled_from(sorted(DCB)))]
    out: dict[str, str | None] = {}
    for cmd in ("pfc", "ets", "app", "buffer", "dcbx", "apptrust"):
        sample = files.get(cmd, "{}")
        how = draw(hs.sampled_from(("as is", *("json",) * 5, "text",
                                    *(("absent",) if cmd != "pfc" else ()))))
        if how == "as is":
            out[cmd] = sample
        elif how == "json":
            out[cmd] = json.dumps(draw(mutated_json(json.loads(sample))))
        elif how == "text":
            out[cmd] = draw(near(sample, 60))
        else:
            out[cmd] = None
    return out


@fuzz(100)
@given(_dcb_inputs())
def test_dcb_near_valid(inputs: dict[str, str | None]) -> None:
    pfc = inputs.pop("pfc")
    assert pfc is not None
    try:
        cfg = parse_dcb(pfc, **inputs)
    except ValueError:
        return
    check_qos(cfg, "dcb")


QOS_SYSFS = {
    "trust": "dscp\n",
    "dscp2prio": "dscp\tprio\n" + "".join(f"{d}\t{d >> 3}\n" for d in range(64)),
    "buffer_size": "Port buffer size = 1048576\nSpare buffer size = 0\n"
                   "Buffer\tSize\txoff_threshold\txon_threshold\n"
                   + "".join(f"{i}\t{s}\t{s // 2}\t\t{max(0, s // 2 - 4096)}\n"
                             for i, s in enumerate([130944, 261888, *[0] * 6])),
    "prio2buffer": "Priority\tBuffer\n" + "".join(f"{p}\t\t{int(p == 3)}\n" for p in range(8)),
}


@fuzz(200)
@given(hs.fixed_dictionaries({}, optional={name: decoded(sample)
                                           for name, sample in QOS_SYSFS.items()}))
def test_qos_sysfs(files: dict[str, str]) -> None:
    try:
        cfg = parse_qos_sysfs(files)
    except ValueError:
        return
    check_qos(cfg, "sysfs")


# ---- collectors on sysfs trees with garbage in their files --------------------------------------

ROCE_DEV, IB_DEV = "mlx5_9", "mlx5_0"
ROCE_NETDEV = "enp170s0f0np0"


@pytest.fixture(scope="module")
def dgx_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, bytes]]]:
    """A DGX H100 tree with MLNX_OFED's qos/ and ecn/ files on the RoCE netdev, built once;
    each example rewrites the files it fuzzes and restores the rest from the second item."""
    sys = st.build_dgx_h100(tmp_path_factory.mktemp("dgx"))
    st.make_ofed_qos(sys, ROCE_DEV)
    ib, roce = f"class/infiniband/{IB_DEV}", f"class/infiniband/{ROCE_DEV}"
    net = f"class/net/{ROCE_NETDEV}"
    rels = [*(f"{ib}/ports/1/{f}" for f in (
        "state", "phys_state", "rate", "counters/symbol_error", "counters/port_xmit_data",
        "counters/port_xmit_wait", "counters/unicast_xmit_packets", "hw_counters/out_of_buffer")),
        f"{ib}/fw_ver", f"{ib}/device/numa_node",
        *(f"{roce}/ports/1/{f}" for f in ("state", "rate", "counters/port_rcv_data",
                                          "gid_attrs/ndevs/0")),
        *(f"{net}/{f}" for f in ("operstate", "carrier", "speed", "mtu", "carrier_changes")),
        *(f"{net}/qos/{f}" for f in ("trust", "dscp2prio", "buffer_size", "prio2buffer")),
        f"{net}/ecn/roce_np/enable/3", f"{net}/ecn/roce_rp/enable/3", f"{net}/ecn/roce_np/cnp_dscp",
        f"{net}/ecn/roce_np/cnp_802p_prio"]
    yield sys, {rel: (sys / rel).read_bytes() for rel in rels}


@hs.composite
def _garbage(draw: hs.DrawFn, originals: dict[str, bytes]) -> dict[str, bytes]:
    """Every fuzzed file: for a drawn subset garbage, for the others the original."""
    chosen = draw(hs.sets(hs.sampled_from(sorted(originals)), min_size=1, max_size=6))
    out = {rel: draw(file_content(data.decode())) if rel in chosen else data
           for rel, data in originals.items()}
    return out


def _unparseable(data: bytes) -> bool:
    return parse_uint(data.decode("utf-8", "replace").rstrip()) is None


@fuzz(40)
@given(data=hs.data())
def test_infiniband_link_tree(dgx_tree: tuple[Path, dict[str, bytes]], data: hs.DataObject
                              ) -> None:
    sys, originals = dgx_tree
    files = data.draw(_garbage({r: d for r, d in originals.items() if "/qos/" not in r
                                and "/ecn/" not in r}))
    _write_files(sys, files)
    try:
        ib = make_collector(InfinibandCollector, sys)
        _, unreadable = scrape(ib)
        counters = [d for r, d in files.items() if "counters/" in r and d != originals[r]]
        if any(_unparseable(d) for d in counters):
            assert unreadable >= 1  # the bad value was skipped and counted, not the port
        link = make_collector(LinkCollector, sys, {"ibv_devinfo": {"enabled": False}})
        samples_of(scrape(link)[0])
        link.close()
    finally:
        _write_files(sys, originals)


# ---- names from directory listings, end to end through prometheus_client's encoders ----------

# What a file or directory name can be in Linux: 1 to 255 bytes, any but '/' and NUL, not '.' or
# '..'; os.listdir gives bytes that are not UTF-8 as lone surrogates (surrogateescape).
NAME = (hs.binary(min_size=1, max_size=30) | text(30).map(str.encode)
        | hs.sampled_from((b"x\xff", b"\xed\xa0\x80", b"\xc3", b"\xef\xbb\xbfbom", b"n" * 255,
                           "\u00e9".encode() * 127, b"\\", b'"', b"\n", b" ", b"a=b,c"))
        ).filter(lambda b: 0 < len(b) <= 255 and b"/" not in b and b"\0" not in b
                 and b not in (b".", b".."))


def _exposable(value: str) -> bool:
    return label_problem({"label": value}) is None


def _bpath(path: Path, name: bytes) -> bytes:
    return os.fsencode(path) + b"/" + name


@pytest.fixture(scope="module")
def names_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DGX H100 tree with a device-level hw_counters/ on mlx5_9, built once; each example
    adds and renames, then puts everything back."""
    sys = st.build_dgx_h100(tmp_path_factory.mktemp("names"))
    st.make_switchdev(sys, "mlx5_9")
    return sys


@fuzz(40)
@given(port_files=hs.lists(NAME, max_size=5, unique=True),
       device_files=hs.lists(NAME, max_size=3, unique=True), device=NAME, netdev=NAME,
       fw_ver=hs.binary(max_size=600) | hs.sampled_from((b"28.39\x00x\n", b"9" * 300)))
def test_names_end_to_end(names_tree: Path, port_files: list[bytes], device_files: list[bytes],
                          device: bytes, netdev: bytes, fw_ver: bytes) -> None:
    """Hypothesis-made names as counter files (port and device level), an RDMA device and a
    netdev, and odd text in a label file, collected and rendered by prometheus_client's text
    and OpenMetrics encoders as /metrics does: the scrape never fails, a name that can be a
    label is exported as it is, and one that cannot costs its own samples, counted."""
    sys = names_tree
    ib = sys / "class/infiniband"
    port_hw, dev_hw = ib / "mlx5_0/ports/1/hw_counters", ib / "mlx5_9/hw_counters"
    written = [_bpath(d, n) for d, names in ((port_hw, port_files), (dev_hw, device_files))
               for n in names if not os.path.lexists(_bpath(d, n))]
    fw_file = ib / "mlx5_2/fw_ver"
    fw_original = fw_file.read_bytes()
    netdev_dir = st._netdev(sys, "mlx5_1").resolve()
    renames: list[tuple[bytes, bytes, bytes | None]] = []  # (old, new, class/net link target)
    try:
        for i, path in enumerate(written):
            with open(path, "wb") as fh:
                fh.write(f"{i + 1}\n".encode())
        fw_file.write_bytes(fw_ver)
        if not os.path.lexists(_bpath(ib, device)):
            os.rename(os.fsencode(ib / "mlx5_3"), _bpath(ib, device))
            renames.append((os.fsencode(ib / "mlx5_3"), _bpath(ib, device), None))
        net_class = sys / "class/net"
        if not os.path.lexists(_bpath(net_class, netdev)):
            link = os.fsencode(net_class / netdev_dir.name)
            target = os.readlink(link)
            os.rename(os.fsencode(netdev_dir), _bpath(netdev_dir.parent, netdev))
            renames.append((os.fsencode(netdev_dir), _bpath(netdev_dir.parent, netdev), None))
            os.unlink(link)
            os.symlink(os.path.dirname(target) + b"/" + netdev, _bpath(net_class, netdev))
            renames.append((link, _bpath(net_class, netdev), target))

        ib_c = make_collector(InfinibandCollector, sys)
        link_c = make_collector(LinkCollector, sys, {"ibv_devinfo": {"enabled": False}})
        families: list[Metric] = []
        for c in (ib_c, link_c):
            got = list(c.collect(Scrape()))
            drop_unexposable(got, c.ctx.skip)  # what the Runner does after every collect()
            families += got
        body = render(families).decode("utf-8")
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Fixed(families))
        om = openmetrics.generate_latest(registry).decode("utf-8")
        s = samples_of(list(text_string_to_metric_families(body)))
        assert samples_of(list(om_parse(om))).keys() == s.keys()
        link_c.close()

        def generic(family: str, **labels: str) -> dict[str, float]:
            return {dict(k)["counter"]: v for (n, k), v in s.items()
                    if n == family and set(labels.items()) <= k}

        expected_skips = 0
        for hw, names, family, labels in (
                (port_hw, port_files, "gpunet_infiniband_port_hw_total",
                 {"device": "mlx5_0", "port": "1"}),
                (dev_hw, device_files, "gpunet_infiniband_device_hw_total",
                 {"device": "mlx5_9"})):
            got = generic(family, **labels)
            for raw in names:
                name = os.fsdecode(raw)
                if _bpath(hw, raw) not in written or name in HW_NAMES:
                    continue
                if _exposable(name):
                    assert name in got
                else:
                    assert name not in got
                    expected_skips += 1
        fw = fw_ver.decode("utf-8", "replace").rstrip()
        infos = series(s, "gpunet_infiniband_device_info")
        device_renamed = any(new == _bpath(ib, device) for _, new, _ in renames)
        device_ok = _exposable(os.fsdecode(device)) or not device_renamed
        assert len(infos) == 8 + int(device_ok) + int(_exposable(fw))
        if _exposable(fw):
            assert any(("fw_ver", fw) in lbl for lbl in infos)
        assert ib_c.ctx.unreadable >= expected_skips + (not _exposable(fw))
        netdev_renamed = len(renames) > int(device_renamed)
        netdev_ok = _exposable(os.fsdecode(netdev)) or not netdev_renamed
        assert len(series(s, "gpunet_link_mtu_bytes")) == 9 + int(netdev_ok)
    finally:
        for path in written:
            os.unlink(path)
        fw_file.write_bytes(fw_original)
        for old, new, target in reversed(renames):
            if target is None:
                os.rename(new, old)
            else:
                os.unlink(new)
                os.symlink(target, old)


class _StatsReader:
    """ethtool -S text per interface, for the pfc collector."""

    def __init__(self, text: str) -> None:
        self.stats = parse_stats_text(text)

    def read(self, ifname: str) -> NicStats:
        if ifname != ROCE_NETDEV:
            raise OSError(errno.ENODEV, "No such device")
        return self.stats

    def close(self) -> None:
        pass


@fuzz(40)
@given(data=hs.data())
def test_pfc_tree(dgx_tree: tuple[Path, dict[str, bytes]], data: hs.DataObject) -> None:
    sys, originals = dgx_tree
    files = data.draw(_garbage({r: d for r, d in originals.items() if "/qos/" in r
                                or "/ecn/" in r}))
    _write_files(sys, files)
    try:
        skipped: list[str] = []
        read_ecn(Root(str(sys)), ROCE_NETDEV, lambda what, _why: skipped.append(what))
        for rel, content in files.items():
            if "/enable/" in rel and content != originals[rel] and _unparseable(content):
                assert rel in skipped  # costs that priority's value alone
        c = make_collector(PfcCollector, sys, {"config": {"sources": ["sysfs"]}})
        assert isinstance(c, PfcCollector)
        c.reader.close()
        c.reader = _StatsReader(data.draw(mutated(ETHTOOL_CAPTURE)))
        no_background(c)
        try:
            c.refresh()
            scrape(c)  # a driver name printed twice gives a series twice: not checked here
        finally:
            c.close()
    finally:
        _write_files(sys, originals)


# ---- NCCL logs ---------------------------------------------------------------------------------


def check_reports(reports: list[ncclog.RankReport]) -> None:
    for r in reports:
        assert r.problems == sorted(set(r.problems)) and set(r.problems) <= set(ncclog.PROBLEMS)
        json.dumps(r.to_dict())
    json.dumps(ncclog.summarize(reports))


@fuzz(60)
@given(hs.sampled_from(sorted(NCCL_LOGS)).flatmap(lambda n: mutated(NCCL_LOGS[n], 10)))
def test_nccl_log_mutations(log: str) -> None:
    check_reports(ncclog.parse_lines(log.splitlines(keepends=True)))
    ncclog.looks_like_nccl_log(log.splitlines())


@fuzz(40)
@given(hs.sampled_from(sorted(NCCL_LOGS)).flatmap(lambda n: mutated_bytes(NCCL_LOGS[n], 6))
       | hs.binary(max_size=3000))
def test_nccl_log_file_bytes(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "rank0.log"
        path.write_bytes(raw)
        check_reports(ncclog.parse_file(path))


# ---- probe result files ------------------------------------------------------------------------

GOOD_RESULT: dict[str, Any] = {
    "version": 2, "scope": "net", "time": 1700000060.5, "started": 1700000000.25,
    "success": True, "failure": "", "error": "", "backend": "nccl", "world_size": 2,
    "nccl_version": "2.28.9", "net": "IB",
    "straggler": {"wait_seconds": 4e-3, "wait_ratio": 0.6, "late_share": 1.0, "rank": 1,
                  "gpu": 1, "local": True},
    "hcas": [{"device": "mlx5_0", "port": "1", "ranks": [0, 1], "gdr": True,
              "rate_bytes_per_second": 5e10}],
    "link_bytes_per_second": 2.5e10,
    "transports": ["NET", "P2P"], "net_transports": ["IB"], "gdr": True, "problems": [],
    "skipped_busy": False,
    "sizes": [{"bytes": 8192, "median_seconds": 2e-5, "p99_seconds": 3e-5, "max_seconds": 4e-5,
               "algbw_bytes_per_second": 4.1e8, "busbw_bytes_per_second": 4.1e8},
              {"bytes": 1048576, "skipped": True}],
}


@fuzz(150)
@given(mutated_json(GOOD_RESULT) | JSON)
def test_probe_result_structure(data: Any) -> None:
    try:
        res = results.parse(data)
    except results.BadResult:
        return
    assert res.scope in results.SCOPES and isinstance(res.success, bool)
    assert res.success or res.failure in results.FAILURE_REASONS
    assert all(s.bytes > 0 for s in res.sizes)
    assert res.straggler is None or 0 <= res.straggler.wait_ratio <= 1
    assert all(h.port.isdigit() and len(h.device) <= 64 for h in res.hcas)


@fuzz(80)
@given(mutated_json(GOOD_RESULT).map(json.dumps).flatmap(mutated_bytes) | hs.binary(max_size=300))
def test_probe_result_file(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "intra.json")
        with open(path, "wb") as fh:
            fh.write(raw)
        with contextlib.suppress(results.BadResult):
            results.read(path)


@fuzz(60)
@given(hs.fixed_dictionaries({"phase": hs.sampled_from(("init", "round", "sleep")) | JSON,
                              "scope": JSON, "since": JSON}).map(json.dumps)
       .flatmap(mutated_bytes) | hs.binary(max_size=100))
def test_probe_status_file(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        Path(d, results.STATUS).write_bytes(raw)
        phase, scope, since = supervisor.read_status(d, 0.0)
        assert phase in ("start", "init", "round", "sleep") and isinstance(since, float)
        assert isinstance(scope, str) and math.isfinite(since)


@fuzz(150)
@given(near("8KiB,1MiB,65536", 40),
       hs.dictionaries(hs.sampled_from(("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID",
                                        "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR")),
                       hs.sampled_from(WEIRD_NUMBERS) | text(12)))
def test_runner_arguments(sizes: str, env: dict[str, str]) -> None:
    for parse in (parse_sizes, parse_bytes):
        with contextlib.suppress(argparse.ArgumentTypeError, ValueError):  # argparse: both
            parse(sizes)
    cluster = cluster_from_env(env)
    assert cluster is None or isinstance(cluster, Cluster)


# ---- configuration files -----------------------------------------------------------------------

# A regular expression of the config, with repetition counts beyond 2**32 and nesting deeper than
# re's parser recurses among them.
REGEX = (hs.text(hs.sampled_from("ab_.^$*+?|()[]{},\\-0123456789"), max_size=12)
         | hs.sampled_from(("a{4294967296}", "a{1," + "9" * 5000 + "}", "(" * 1000 + ")" * 1000)))


def field_values(spec: Field, depth: int = 0) -> hs.SearchStrategy[Any]:
    """Values near what ``spec`` accepts: right-typed, wrong-typed, out of range, unknown keys."""
    wrong = JSON_SCALARS | hs.lists(JSON_SCALARS, max_size=3)
    if spec.kind == "map" and spec.values is not None and depth < 4:
        right: hs.SearchStrategy[Any] = hs.dictionaries(
            text(10), field_values(spec.values, depth + 1), max_size=3)
    elif spec.kind == "map" and depth < 4:
        right = section_values(spec.fields, depth)
    elif spec.kind == "list" and spec.item is not None and depth < 4:
        right = hs.lists(field_values(spec.item, depth + 1), max_size=3)
    elif spec.kind == "str":
        right = hs.sampled_from(spec.choices) if spec.choices else text(20)
    elif spec.kind == "int":
        right = hs.integers(-(2**70), 2**70)
    elif spec.kind == "number":
        right = (hs.integers(-(2**70), 2**70) | hs.floats()
                 | hs.sampled_from(("1e3", "1E-9", "-2e+400", "1e", ".5e1")))
    elif spec.kind == "bool":
        right = hs.booleans()
    elif spec.kind == "regex":
        right = REGEX
    else:
        right = JSON
    return hs.one_of(right, right, right, wrong) if depth else right


def section_values(fields: Mapping[str, Field], depth: int = 0) -> hs.SearchStrategy[Any]:
    """Maps of some of ``fields``' keys (as settings_fields gives them) and an unknown one."""
    return hs.fixed_dictionaries({}, optional={
        **{k: field_values(f, depth + 1) for k, f in fields.items()}, "unknown_key": JSON_SCALARS})


SETTINGS: dict[str, type[Settings]] = {
    **{cls.name: cls.settings_type
       for cls in (InfinibandCollector, LinkCollector, PfcCollector, GpuCollector,
                   TopologyCollector, ProbeCollector)},
    "web config": WebConfigFile,
    "thresholds": thresholds.file_settings(("GpunetLinkDown",)),
}


@fuzz(150)
@given(hs.sampled_from(sorted(SETTINGS)).flatmap(
    lambda n: hs.tuples(hs.just(n), section_values(settings_fields(SETTINGS[n])) | JSON)))
def test_config_validate(case: tuple[str, Any]) -> None:
    """What is accepted is always the section's typed settings; anything else is ConfigError."""
    name, value = case
    try:
        assert isinstance(parse_settings(SETTINGS[name], value, ""), SETTINGS[name])
    except ConfigError:
        return


THRESHOLDS_YAML = """\
job: gpunet
runbook_url: https://runbooks.example/{{ $labels.alertname }}
infiniband:
  link_downed_count: 3
  link_downed_window: 24h
link:
  roce_min_mtu_bytes: 4200
pfc:
  roce_priority: 3
for:
  GpunetLinkDown: 5m
"""


# Text PyYAML turns into other exceptions than YAMLError, or into strings that no file name or
# user name can hold: escapes beyond U+10FFFF, a lone surrogate, NUL, deep nesting, an integer
# beyond int()'s digit limit, an impossible date.
YAML_ODD = ('"\\U42949672"', '"\\UFFFFFFFF"', '"\\ud800"', '"c\\0"', "[" * 1000, "1" * 5000,
            "2001-13-45")


def yaml_text(sample: str) -> hs.SearchStrategy[str]:
    """A YAML file near ``sample``: its text mutated, or its values mutated and dumped again."""
    text_ = near(sample, 300) | mutated_json(yaml.safe_load(sample)).map(yaml.safe_dump).flatmap(
        mutated)
    return text_ | _yaml_odd(sample)


@hs.composite
def _yaml_odd(draw: hs.DrawFn, sample: str) -> str:
    """``sample`` with the key or the value of one of its lines, or a place in its text,
    replaced by one of YAML_ODD."""
    lines = sample.splitlines(keepends=True)
    i = draw(hs.integers(0, len(lines) - 1))
    odd = draw(hs.sampled_from(YAML_ODD))
    key, sep, _ = lines[i].partition(": ")
    how = draw(hs.sampled_from(("key", "value", "anywhere")))
    if how == "anywhere" or not sep:
        pos = draw(hs.integers(0, len(sample)))
        return sample[:pos] + odd + sample[pos:]
    indent = key[:len(key) - len(key.lstrip())]
    lines[i] = f"{indent}{odd}: x\n" if how == "key" else f"{key}: {odd}\n"
    return "".join(lines)


@fuzz(100)
@given(yaml_text(THRESHOLDS_YAML))
def test_config_file(text_: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "thresholds.yml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text_)
        with contextlib.suppress(ConfigError):
            load_file(path, SETTINGS["thresholds"])
        with contextlib.suppress(ConfigError):
            thresholds.load(path, ("GpunetLinkDown",))


HASH = bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=4)).decode()
WEB_YAML = f"""\
basic_auth_users:
  alice: {HASH}
http_server_config:
  headers:
    X-Frame-Options: deny
    Content-Security-Policy: "default-src 'self'"
tls_server_config:
  cert_file: cert.pem
  key_file: key.pem
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: ca.pem
  min_version: TLS12
"""


@fuzz(100)
@given(yaml_text(WEB_YAML))
def test_web_config_file(text_: str) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "web.yml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text_)
        with contextlib.suppress(ConfigError):
            load_web_config(path)


# Values as YAML builds them, with the sharing aliases leave: a list repeating one value n times
# is n aliases to one anchor, so a few levels of it are billions of values when walked.
_UNQUOTED = hs.characters(codec="utf-8", exclude_characters="'\"")
SHARED = hs.recursive(
    hs.none() | hs.booleans() | hs.floats() | hs.integers(-(2**70), 2**70)
    | hs.integers(2**14_300, 2**20_000)  # beyond repr()'s 4,300 digits
    | hs.text(_UNQUOTED, max_size=80)
    | hs.binary(max_size=80).map(lambda b: b.replace(b"'", b"").replace(b'"', b"")),
    lambda inner: (hs.lists(inner, max_size=4)
                   | hs.tuples(inner, hs.integers(0, 12)).map(lambda t: [t[0]] * t[1])
                   | hs.dictionaries(hs.text(_UNQUOTED, max_size=8), inner, max_size=3)),
    max_leaves=30)


def expanded(value: Any, memo: dict[int, int] | None = None) -> int:
    """The values of ``value`` counted as a walk meets them (every alias anew), as read_yaml
    counts them; linear in the distinct objects."""
    memo = {} if memo is None else memo
    if not isinstance(value, (list, dict)):
        return 1
    if id(value) not in memo:
        memo[id(value)] = 1 + (sum(1 + expanded(v, memo) for v in value.values())
                               if isinstance(value, dict) else
                               sum(expanded(v, memo) for v in value))
    return memo[id(value)]


@fuzz(200)
@given(SHARED | hs.sampled_from(("x" * 10**6, b"\0" * 10**6, -(2**20_000))))
def test_short_excerpt(value: Any) -> None:
    """short() is at most 60 characters for any value, however large or shared, and is repr()
    or its first 57 characters and "..." (strings without quotes: repr() picks its quote from the
    whole string)."""
    excerpt = short(value)
    assert len(excerpt) <= 60
    assert len(key_text(value if not isinstance(value, (list, dict)) else 0)) <= 60
    if expanded(value) > 10_000:
        return  # repr() would take too long to compare with
    try:
        full = repr(value)
    except ValueError:  # an int beyond 4,300 digits somewhere in it
        return
    assert excerpt == (full if len(full) <= 60 else full[:57] + "...")


@fuzz(60)
@given(hs.lists(hs.integers(1, 12), min_size=1, max_size=9), hs.booleans())
def test_yaml_aliases_are_counted(widths: list[int], merge: bool) -> None:
    """Chains of anchors, each level ``width`` aliases to the one before (lists, or mappings
    through ``<<`` merge keys): read_yaml refuses exactly the documents of more than MAX_VALUES
    values counted through every alias, and loads the others unchanged."""
    lines, total, size = [], 1, 0  # the document's mapping is a value
    for i, width in enumerate(widths):
        if merge and i == 0:
            body, size = "{" + ", ".join(f"k{j}: 1" for j in range(width)) + "}", 1 + 2 * width
        elif merge:
            body, size = f"{{<<: [{', '.join([f'*l{i - 1}'] * width)}]}}", 3 + width * size
        elif i == 0:
            body, size = f"[{', '.join(['x'] * width)}]", 1 + width
        else:
            body, size = f"[{', '.join([f'*l{i - 1}'] * width)}]", 1 + width * size
        lines.append(f"l{i}: &l{i} {body}")
        total += 1 + size
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "aliases.yml")
        with open(path, "w", encoding="utf-8") as fh:
            fh.write("\n".join(lines) + "\n")
        try:
            value = read_yaml(path)
        except ConfigError as exc:
            assert total > MAX_VALUES, (total, exc)
            assert str(exc).startswith(f"more than {MAX_VALUES} values at line ")
            return
    assert total <= MAX_VALUES
    if merge:  # the merged mappings hold each key once
        assert all(v == {f"k{j}": 1 for j in range(widths[0])} for v in value.values())
    else:
        assert expanded(value) == total


AUTH = BasicAuth({"alice": HASH})
GOOD_HEADER = "Basic " + base64.b64encode(b"alice:secret").decode()


@fuzz(150)
@given(near(GOOD_HEADER, 80)
       | hs.binary(max_size=90).map(lambda b: "Basic " + base64.b64encode(b).decode())
       | text(40).map(lambda t: "Basic " + base64.b64encode(
           f"alice:{t}".encode()).decode()))
def test_basic_auth_header(header: str) -> None:
    ok = AUTH.check(header)
    assert isinstance(ok, bool)
    if ok:
        _, _, value = header.strip().partition(" ")
        assert base64.b64decode(value.strip()) == b"alice:secret"


# ---- topology: /proc, PCI config space, PCIe paths, NCCL environment ---------------------------

STAT = ("4242 (python3 (x)) S 1 4242 4242 0 -1 4194560 105273 0 12 0 1520 310 0 0 20 0 57 0 "
        "1234567 41943040000 1203311 18446744073709551615 0 0 0 0 0 0 0 0\n")
ENVIRON = ("PATH=/usr/bin\0NCCL_IB_HCA=^=mlx5_0:1,mlx5_9\0NCCL_NET_GDR_LEVEL=LOC\0"
           "NCCL_SOCKET_IFNAME=eno1\0NCCL_P2P_DISABLE=1\0NCCL_NET=Socket\0"
           "NCCL_IB_DISABLE=0x10\0NCCL_IB_HCA=mlx5_1\0")


@fuzz(150)
@given(mutated_bytes(ENVIRON) | hs.binary(max_size=200), near(STAT),
       near(st.NVRM_OPEN) | near(st.NVRM_PROPRIETARY), near(st.OSRELEASE, 40),
       hs.dictionaries(hs.sampled_from([v for v, _ in NCCL_FINDINGS]),
                       text(16) | hs.sampled_from(WEIRD_NUMBERS)),
       hs.sets(text(16), max_size=3), hs.lists(text(10), max_size=3))
def test_topology_text(environ: bytes, stat: str, version: str, release: str,
                       env: dict[str, str], netdevs: set[str], devices: list[str]) -> None:
    parsed = parse_environ(environ)
    assert set(parsed) <= set(NCCL_SETTINGS)
    assert set(env_findings(parsed, netdevs, devices)) <= set(NCCL_FINDINGS)
    assert set(env_findings(env, netdevs, devices)) <= set(NCCL_FINDINGS)
    for value in env.values():
        assert isinstance(strtol(value), int)
    start = parse_starttime(stat)
    assert start is None or start >= 0
    module = parse_nvidia_version(version)
    assert module is None or (module[0] in ("open", "proprietary") and len(module[1]) <= 32)
    kernel = parse_kernel_release(release)
    assert kernel is None or all(isinstance(n, int) for n in kernel)


BRIDGE_CONFIG = st.pci_config(0x1000, 0xC030, st.DOWNSTREAM_PORT, st.ACS_CONTROL_REDIRECT)


@hs.composite
def config_space(draw: hs.DrawFn) -> bytes:
    """A bridge's config space with bytes of its capability list changed, cut short, or all
    random."""
    if draw(hs.integers(0, 3)) == 0:
        return draw(hs.binary(max_size=600))
    data = bytearray(BRIDGE_CONFIG)
    for _ in range(draw(hs.integers(0, 6))):
        offset = draw(hs.sampled_from((st.AER_OFFSET, st.ACS_OFFSET, st.SECONDARY_PCIE_OFFSET))
                      | hs.integers(0x100, 0xFFF))
        offset += draw(hs.integers(0, 7))
        data[offset:offset + 1] = draw(hs.binary(min_size=1, max_size=1))
    cut = draw(hs.sampled_from((4096, 4096, 64, 0x102, 0x14A)) | hs.integers(0, 4096))
    return bytes(data[:cut])


@fuzz(200)
@given(config_space())
def test_acs_control(config: bytes) -> None:
    try:
        control = acs_control(lambda offset, size: config[offset:offset + size])
    except EOFError:
        return
    assert control is None or 0 <= control < 2**16


PCI_PART = (hs.sampled_from(("pci0000:00", "pci0000:17", "pci10000:e0", "pci0000:xx"))
            | hs.builds("{:04x}:{:02x}:{:02x}.{}".format, hs.integers(0, 0x1FFFF),
                        hs.integers(0, 255), hs.integers(0, 31), hs.integers(0, 9))
            | text(12))


@fuzz(200)
@given(hs.lists(hs.lists(PCI_PART, max_size=6).map("/".join), min_size=2, max_size=4),
       hs.integers(-2, 3))
def test_pci_paths(paths: list[str], numa: int) -> None:
    eps: list[Endpoint] = [ep for i, p in enumerate(paths)
                           if (ep := endpoint(str(i), f"devices/{p}", numa)) is not None]
    for a in eps:
        for b in eps:
            assert relation(a, b).path in PATHS


MISSING_NVML = "gpunet_fuzz_no_such_nvml_module"
PID = 4242


@pytest.fixture(scope="module")
def topo_tree(tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[tuple[Path, Path, dict[str, bytes]]]:
    """build_mixed_topology and a /proc with the NVIDIA driver and one GPU process; the files a
    test fuzzes, with their contents."""
    root = tmp_path_factory.mktemp("topology")
    sys = st.build_mixed_topology(root)
    proc = st.build_procfs(root)
    st.write_process(proc, PID, ENVIRON.encode())
    gpu0 = st.pci_function_dir(sys, "0000:36:00.0")
    nic0 = st.pci_function_dir(sys, "0000:33:00.0")
    originals = {
        str(gpu0 / "numa_node"): b"0\n", str(nic0 / "numa_node"): b"0\n",
        str(gpu0 / "vendor"): b"0x10de\n", str(gpu0 / "class"): b"0x030200\n",
        str(gpu0.parent / "config"): (gpu0.parent / "config").read_bytes(),
        str(gpu0.parent.parent / "config"): (gpu0.parent.parent / "config").read_bytes(),
        str(sys / st.PEERMEM_FILES["nvidia_peermem"]): f"{st.DRIVER_VERSION}\n".encode(),
        str(proc / "driver/nvidia/version"): st.NVRM_OPEN.encode(),
        str(proc / "sys/kernel/osrelease"): f"{st.OSRELEASE}\n".encode(),
        str(proc / str(PID) / "stat"): (proc / str(PID) / "stat").read_bytes(),
        str(proc / str(PID) / "environ"): ENVIRON.encode(),
    }
    yield sys, proc, originals


@hs.composite
def _topology_garbage(draw: hs.DrawFn, originals: dict[str, bytes]) -> dict[str, bytes]:
    chosen = draw(hs.sets(hs.sampled_from(sorted(originals)), min_size=1, max_size=5))
    out = {}
    for path, data in originals.items():
        if path not in chosen:
            out[path] = data
        elif path.endswith("/config"):
            out[path] = draw(config_space())
        else:
            out[path] = draw(file_content(data.decode("utf-8", "replace")))
    return out


def _fake_nvml_scenario() -> dict[str, Any]:
    scenario = fake_nvml.h200x2()
    for dev, bus in zip(scenario["devices"], ("00000000:36:00.0", "00000000:38:00.0"),
                        strict=True):
        dev["nvmlDeviceGetPciInfo"]["ok"]["busId"] = bus
        dev["processes"] = [PID]
    return scenario


@fuzz(60)
@given(data=hs.data(), module=hs.sampled_from((fake_nvml.MODULE, MISSING_NVML)))
def test_topology_tree(topo_tree: tuple[Path, Path, dict[str, bytes]], data: hs.DataObject,
                       module: str) -> None:
    sys, proc, originals = topo_tree
    files = data.draw(_topology_garbage(originals))
    for path, content in files.items():
        Path(path).write_bytes(content)
    nvml.forget(fake_nvml.MODULE)
    fake_nvml.load(_fake_nvml_scenario())
    try:
        c = make_collector(TopologyCollector, sys, procfs=proc, nvml_module=module)
        samples_of(scrape(c)[0])
        c.close()
    finally:
        nvml.forget(fake_nvml.MODULE)
        fake_nvml.load(fake_nvml.h200x2())
        for path, content in originals.items():
            Path(path).write_bytes(content)


# ---- NVML return shapes ------------------------------------------------------------------------


@fuzz(200)
@given(near("00000000:18:00.0", 30) | hs.binary(max_size=30)
       | hs.builds("{:x}:{:02x}:{:02x}.{}".format, hs.integers(0, 2**40), hs.integers(0, 300),
                   hs.integers(0, 40), hs.integers(0, 9)))
def test_nvml_bus_id(raw: str | bytes) -> None:
    out = nvml.sysfs_bus_id(raw)
    assert out == "" or re.fullmatch(r"[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]", out)


NVML_ERRORS = ("NVMLError_NotSupported", "NVMLError_GpuIsLost", "NVMLError_Unknown",
               "NVMLError_InvalidArgument", "NVMLError_NoPermission", "NVMLError_FunctionNotFound",
               "NVMLError_Timeout", "NVMLError_Uninitialized", "NVMLError_DriverNotLoaded",
               "NVMLError_LibRmVersionMismatch", "NVMLError_InsufficientSize",
               "NVMLError_ArgumentVersionMismatch")
ODD_INT = hs.sampled_from((0, -1, 2**32 - 1, 2**64 - 1, 2**64, -(2**63))) | hs.integers(-5, 200)
ODD_TEXT = text(30) | hs.binary(max_size=30)


def answer(ok: hs.SearchStrategy[Any]) -> hs.SearchStrategy[dict[str, Any]]:
    """What fake_nvml replays for a call: a value, or an NVMLError."""
    return ok.map(lambda v: {"ok": v}) | hs.sampled_from(NVML_ERRORS).map(lambda e: {"exc": e})


CALLS: dict[str, hs.SearchStrategy[dict[str, Any]]] = {
    "nvmlDeviceGetName": answer(ODD_TEXT),
    "nvmlDeviceGetUUID": answer(ODD_TEXT | hs.just("GPU-0473bb98-196c-ff06-d25b-2ba754320b36")),
    "nvmlDeviceGetPciInfo": answer(hs.fixed_dictionaries({"busId": ODD_TEXT | near(
        "00000000:00:06.0", 20)})),
    "nvmlDeviceGetNumaNodeId": answer(ODD_INT),
    "nvmlDeviceGetUtilizationRates": answer(hs.fixed_dictionaries({"gpu": ODD_INT,
                                                                   "memory": ODD_INT})),
    "nvmlDeviceGetMemoryInfo": answer(hs.fixed_dictionaries(
        {"total": ODD_INT, "free": ODD_INT, "used": ODD_INT})),
    "nvmlDeviceGetMemoryInfo_v2": answer(hs.fixed_dictionaries(
        {"total": ODD_INT, "free": ODD_INT, "used": ODD_INT, "reserved": ODD_INT,
         "version": ODD_INT})),
    **{f"nvmlDevice{f}": answer(ODD_INT) for f in (
        "GetCurrPcieLinkGeneration", "GetMaxPcieLinkGeneration", "GetCurrPcieLinkWidth",
        "GetMaxPcieLinkWidth", "GetPcieThroughput", "RegisterEvents")},
    "pcie_tx_KBps": answer(ODD_INT), "pcie_rx_KBps": answer(ODD_INT),
}
FIELD_VALUE = hs.fixed_dictionaries({
    "valueType": hs.integers(-3, 12), "value": hs.integers(0, 2**64 - 1),
    "nvmlReturn": hs.sampled_from((0, 0, 1, 2, 3, 15, 999))})


@hs.composite
def odd_scenario(draw: hs.DrawFn) -> dict[str, Any]:
    """The real 2 x H200 capture with some of its answers replaced by odd ones."""
    scenario = fake_nvml.h200x2()
    for dev in scenario["devices"]:
        for call in draw(hs.sets(hs.sampled_from(sorted(CALLS)), max_size=5)):
            dev[call] = draw(CALLS[call])
        for name in draw(hs.sets(hs.sampled_from(sorted(dev["fieldValues"])), max_size=4)):
            dev["fieldValues"][name] = draw(FIELD_VALUE)
        for link in draw(hs.sets(hs.sampled_from(sorted(dev.get("nvlink") or {})), max_size=3)):
            dev["nvlink"][link]["state"] = draw(answer(ODD_INT))
            dev["nvlink"][link]["NVML_NVLINK_ERROR_DL_REPLAY"] = draw(answer(ODD_INT))
        dev["processes"] = draw(hs.lists(ODD_INT, max_size=3))
        dev["lost"] = draw(hs.integers(0, 9)) == 0
    scenario["driver"] = {"ok": draw(text(20))}
    return scenario


@fuzz(50)
@given(odd_scenario(), hs.dictionaries(
    hs.sampled_from(("PCI_ID", "PCI_SLOT_NAME", "DEVPATH", "INTERFACE")), text(20)
    | hs.just("10DE:2335")))
def test_gpu_odd_nvml_values(scenario: dict[str, Any], properties: dict[str, str]) -> None:
    nvml.forget(fake_nvml.MODULE)
    fake_nvml.load(scenario)
    with tempfile.TemporaryDirectory() as d:
        c = make_collector(GpuCollector, d, {"xid_events": False}, nvml_module=fake_nvml.MODULE)
        no_background(c)
        try:
            for _ in range(2):  # the second scrape meets the first one's cached knowledge
                c.refresh()  # type: ignore[attr-defined]
                samples_of(scrape(c)[0])
            for action in ("add", "remove", "bind", "change"):
                c.device_event("pci", action, properties)
            samples_of(scrape(c)[0])
        finally:
            c.close()
            nvml.forget(fake_nvml.MODULE)
            fake_nvml.load(fake_nvml.h200x2())


# ================================================================================================
# Regressions: bugs found by the tests above, each with the smallest input that showed it.
# ================================================================================================

HUGE = "1" * 5000  # beyond int()'s default limit of 4300 digits (CVE-2020-10735)


def _stat_with_start(start: str) -> str:
    return f"1 (x) S {' '.join(['0'] * 18)} {start} 0\n"


DIGIT_LIMIT: dict[str, Callable[[], object]] = {
    "sysfs.parse_uint": lambda: parse_uint(HUGE),
    "sysfs.parse_int": lambda: parse_int("-" + HUGE),
    "infiniband.parse_state": lambda: parse_state(f"{HUGE}: ACTIVE"),
    "rdma.parse_rate": lambda: parse_rate(f"1 Gb/sec ({HUGE}X)"),
    "link.parse_ibv_devinfo": lambda: parse_ibv_devinfo(
        f"hca_id:\tmlx5_0\n\t\tport:\t1\n\t\t\tactive_mtu:\t\t{HUGE} (5)\n"),
    "ethtool.parse_stats_text": lambda: parse_stats_text(f"NIC statistics:\n     rx_bytes: {HUGE}"),
    "topology.parse_kernel_release": lambda: parse_kernel_release(f"{HUGE}.0-1-generic"),
    "topology.parse_starttime": lambda: parse_starttime(_stat_with_start(HUGE)),
    "ncclog.parse_lines pid": lambda: ncclog.parse_lines([f"h:{HUGE}:1 [0] NCCL INFO x"]),
    "ncclog.parse_lines rank": lambda: ncclog.parse_lines(
        [f"h:1:1 [0] NCCL INFO comm 0x1 rank {HUGE} nranks 2 cudaDev 0 busId 18000"]),
    "runner.cluster_from_env": lambda: cluster_from_env({"RANK": HUGE, "WORLD_SIZE": "2"}),
}


# Was a strict xfail (the bug, now fixed): int() of more than 4300 decimal digits raises ValueError
# ('Exceeds the limit (4300 digits) for integer string conversion'); these parsers call int() on
# any all-digit token
@pytest.mark.parametrize("case", sorted(DIGIT_LIMIT))
def test_numbers_beyond_the_int_digit_limit(case: str) -> None:
    DIGIT_LIMIT[case]()


def _ib_port_tree(sys: Path, files: dict[str, str | bytes]) -> None:
    port = sys / "class/infiniband/roce0/ports/1"
    base: dict[str, str | bytes] = {"link_layer": "Ethernet\n", "state": "4: ACTIVE\n",
                                    "phys_state": "5: LinkUp\n", "rate": "400 Gb/sec (4X NDR)\n",
                                    "counters/symbol_error": "0\n"}
    for rel, content in {**base, **files}.items():
        (port / rel).parent.mkdir(parents=True, exist_ok=True)
        (port / rel).write_bytes(content.encode() if isinstance(content, str) else content)


# Was a strict xfail (the bug, now fixed): the digit limit reaches the scrape: parse_uint raises in
# InfinibandCollector._uints, so one counter file of 5000 digits fails the whole collection instead
# of costing one value
def test_infiniband_counter_beyond_the_digit_limit(tmp_path: Path) -> None:
    _ib_port_tree(tmp_path, {"counters/symbol_error": HUGE + "\n"})
    c = make_collector(InfinibandCollector, tmp_path)
    _, unreadable = scrape(c)
    assert unreadable == 1


# Was a strict xfail (the bug, now fixed): a netdev name read from gid_attrs/ndevs/<idx> with a NUL
# becomes a path: Root.read (os.open) raises ValueError 'embedded null byte', not OSError, and the
# scrape fails
def test_infiniband_netdev_name_with_nul(tmp_path: Path) -> None:
    _ib_port_tree(tmp_path, {"gid_attrs/ndevs/0": b"enp\x00x\n"})
    samples = samples_of(scrape(make_collector(InfinibandCollector, tmp_path))[0])
    assert samples[("gpunet_infiniband_port_info", frozenset({
        "device": "roce0", "port": "1", "link_layer": "Ethernet", "interface": ""}.items()))] == 1


# Was a strict xfail (the bug, now fixed): read_ecn parses ecn/roce_*/enable/<prio> with parse_uint
# (digit limit) and is called outside the try of PfcCollector._refresh_one: the whole refresh round
# fails, for every interface
def test_pfc_ecn_file_beyond_the_digit_limit(tmp_path: Path) -> None:
    _write_files(tmp_path, {"class/net/eth9/ecn/roce_np/enable/3": HUGE.encode()})
    c = make_collector(PfcCollector, tmp_path, {"interfaces": ["eth9"],
                                                "config": {"sources": ["sysfs"]}})
    no_background(c)
    try:
        c.refresh()  # type: ignore[attr-defined]
    finally:
        c.close()


FLOAT_RANGE: dict[str, tuple[type[Collector], dict[str, Any], str]] = {
    # collector, its config, the file (below the tree of test_value_beyond_the_float_range)
    "infiniband counter": (InfinibandCollector, {},
                           "class/infiniband/roce0/ports/1/counters/symbol_error"),
    "link carrier_changes": (LinkCollector, {"interfaces": ["eth9"],
                                             "ibv_devinfo": {"enabled": False}},
                             "class/net/eth9/carrier_changes"),
    "pfc ecn cnp_dscp": (PfcCollector, {"interfaces": ["eth9"], "config": {"sources": ["sysfs"]}},
                         "class/net/eth9/ecn/roce_np/cnp_dscp"),
}


# Was a strict xfail (the bug, now fixed): parse_uint/parse_int accept any number of digits below
# int()'s limit, so a sysfs value of 400 digits becomes a sample that prometheus_client cannot
# render (float(): 'int too large to convert to float'): the collection succeeds and the whole
# /metrics response fails
@pytest.mark.parametrize("case", sorted(FLOAT_RANGE))
def test_value_beyond_the_float_range(case: str, tmp_path: Path) -> None:
    cls, config, rel = FLOAT_RANGE[case]
    _ib_port_tree(tmp_path, {})
    _write_files(tmp_path, {"class/net/eth9/mtu": b"9000\n", rel: b"1" + b"0" * 400 + b"\n"})
    c = make_collector(cls, tmp_path, config)
    if isinstance(c, PfcCollector):
        c.reader.close()
        c.reader = _StatsReader("")
        no_background(c)
        c.refresh()
    try:
        scrape(c)
    finally:
        c.close()


SUPERSCRIPT_TWO = "\u00b2"  # str.isdigit() is True, int() refuses it


def _rdma_ports(tmp: Path) -> object:
    (tmp / "class/infiniband/mlx5_0/ports" / SUPERSCRIPT_TWO).mkdir(parents=True)
    return rdma.ports(Root(str(tmp)), "mlx5_0")


def _ecn_file_name(tmp: Path) -> object:
    _write_files(tmp, {f"class/net/eth9/ecn/roce_np/enable/{SUPERSCRIPT_TWO}": b"1\n"})
    return read_ecn(Root(str(tmp)), "eth9", lambda what, why: None)


ISDIGIT: dict[str, Callable[[Path], object]] = {
    "topology.parse_starttime": lambda _t: parse_starttime(_stat_with_start(SUPERSCRIPT_TWO)),
    "runner.cluster_from_env": lambda _t: cluster_from_env({"RANK": SUPERSCRIPT_TWO,
                                                            "WORLD_SIZE": "2"}),
    "rdma.ports": _rdma_ports,
    "pfc_config.read_ecn": _ecn_file_name,
}


# Was a strict xfail (the bug, now fixed): str.isdigit() accepts characters int() refuses
# (superscripts, circled digits); these guard int() with isdigit() alone (parse_uint/parse_int also
# check isascii())
@pytest.mark.parametrize("case", sorted(ISDIGIT))
def test_isdigit_is_not_int(case: str, tmp_path: Path) -> None:
    ISDIGIT[case](tmp_path)


# Was a strict xfail (the bug, now fixed): parse_mlnx_qos raises ValueError (meant for 'not
# mlnx_qos output at all') for a real report with one garbled number: int() of 'max_buffer_size=²'
# (isdigit) or of a buffer size beyond the digit limit
@pytest.mark.parametrize("garbled", [SUPERSCRIPT_TWO, HUGE])
def test_mlnx_qos_one_garbled_number(garbled: str) -> None:
    report = MLNX_QOS["mlnx_qos_os-dscp-pfc5-custom.txt"]
    assert "max_buffer_size=1048576" in report
    cfg = parse_mlnx_qos(report.replace("max_buffer_size=1048576", f"max_buffer_size={garbled}"))
    assert cfg.pfc[5]


# Was a strict xfail (the bug, now fixed): parse_dcb iterates `a.get('dscp_prio') or []`: a number
# there raises TypeError ('int' object is not iterable) instead of being ignored or a ValueError
@pytest.mark.parametrize("entries", ["5", "1.5", "true"])
def test_dcb_app_entries_not_a_list(entries: str) -> None:
    cfg = parse_dcb(DCB["dcb-6.15"]["pfc"], app=f'{{"dscp_prio": {entries}}}')
    assert cfg.dscp_prio == {}  # ignored, as any other entry it cannot read


# Was a strict xfail (the bug, now fixed): json.loads of deeply nested arrays raises
# RecursionError, which _json (catching ValueError) lets through
def test_dcb_deeply_nested_json() -> None:
    with pytest.raises(ValueError, match="not JSON"):  # the documented rejection
        parse_dcb("[" * 10_000)


# Was a strict xfail (the bug, now fixed): results._num calls math.isfinite() on an int beyond the
# float range: OverflowError, not BadResult
def test_probe_result_huge_integer() -> None:
    with pytest.raises(results.BadResult, match="'time' must be a non-negative number"):
        results.parse({**GOOD_RESULT, "time": 10**400})


# Was a strict xfail (the bug, now fixed): results.read catches only json.JSONDecodeError: an
# integer beyond the digit limit (ValueError) or deep nesting (RecursionError) escapes as something
# other than BadResult
@pytest.mark.parametrize("content", ["1" * 5000, "[" * 10_000], ids=["digits", "nesting"])
def test_probe_result_file_rejected_cleanly(content: str, tmp_path: Path) -> None:
    path = tmp_path / "intra.json"
    path.write_text(content)
    with pytest.raises(results.BadResult):
        results.read(str(path))


# Was a strict xfail (the bug, now fixed): so ProbeCollector._poll_results (now the probe
# supervisor's tick) raises for such a file
# (the supervisor logs the error) instead of counting
# gpunet_probe_failures_total{reason="bad_result"}, and the file's mtime is already remembered, so
# it is never counted
@pytest.mark.parametrize("content", ["1" * 5000, "[" * 10_000,
                                     json.dumps({**GOOD_RESULT, "time": 10**400})],
                         ids=["digits", "nesting", "huge-int"])
def test_probe_collector_counts_bad_result(content: str, tmp_path: Path) -> None:
    (tmp_path / "intra.json").write_text(content)
    c = make_collector(ProbeCollector, tmp_path, {"state_dir": str(tmp_path), "runner": "none"})
    assert isinstance(c, ProbeCollector)
    c.supervisor.refresh()
    assert c.supervisor.snapshot().scopes["intra"].failures["bad_result"] == 1


# Was a strict xfail (the bug, now fixed): ProbeCollector._round_state (now
# supervisor.read_status) catches OSError, ValueError,
# KeyError, TypeError around json.load and float(): a huge integer (OverflowError) or deep nesting
# (RecursionError) in status.json escapes, and the supervisor then skips the hung-round timeout
# every poll
@pytest.mark.parametrize("content", ['{"round_started": 1' + "0" * 400 + "}", "[" * 10_000],
                         ids=["huge-int", "nesting"])
def test_probe_status_file_rejected_cleanly(content: str, tmp_path: Path) -> None:
    (tmp_path / results.STATUS).write_text(content)
    assert supervisor.read_status(str(tmp_path), 0.0) == ("start", "", 0.0)


# Was a strict xfail (the bug, now fixed): load_web_config accepts strings that open() or
# str.encode() refuse: a file name with NUL (open: 'embedded null byte') or a lone surrogate
# (UnicodeEncodeError), both ValueErrors that _readable (catching OSError) lets through; a user
# name with a lone surrogate loads and then fails in BasicAuth (u.encode()) when wrap() builds the
# app at start
@pytest.mark.parametrize("content", [
    'tls_server_config:\n  cert_file: "c\\0"\n  key_file: k\n',
    'tls_server_config:\n  cert_file: "\\ud800"\n  key_file: k\n',
    f'basic_auth_users:\n  "\\ud800": "{HASH}"\n'],
    ids=["nul-in-file-name", "surrogate-in-file-name", "surrogate-in-user-name"])
def test_web_config_rejected_cleanly(content: str, tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_text(content)
    with pytest.raises(ConfigError):
        wrap(lambda _environ, _start: [], load_web_config(str(path)))


# Was a strict xfail (the bug, now fixed): read_yaml catches yaml.YAMLError only, and PyYAML raises
# others: RecursionError for deep nesting (its composer recurses), ValueError or OverflowError from
# chr() for a double-quoted escape beyond U+10FFFF; so load_file (--config.file, thresholds) and
# load_web_config fail with a traceback instead of a ConfigError
@pytest.mark.parametrize("loader", ["load_file", "load_web_config"])
@pytest.mark.parametrize("content", ["a: " + "[" * 1000, '"\\U42949672": x\n',
                                     '"\\UFFFFFFFF": x\n'],
                         ids=["nesting", "escape-ValueError", "escape-OverflowError"])
def test_yaml_rejected_cleanly(content: str, loader: str, tmp_path: Path) -> None:
    path = tmp_path / "config.yml"
    path.write_text(content)
    with pytest.raises(ConfigError):
        if loader == "load_file":
            load_file(str(path), SETTINGS["thresholds"])
        else:
            load_web_config(str(path))


# Was a strict xfail (the bug, now fixed): _validate() of a regex catches re.error only: re.compile
# raises OverflowError for a repetition count >= 2**32, ValueError beyond the digit limit,
# RecursionError for deep nesting
@pytest.mark.parametrize("regex", ["a{4294967296}", "a{" + "9" * 5000 + "}",
                                   "(" * 1000 + ")" * 1000], ids=["repeat", "digits", "nesting"])
def test_config_regex_rejected_cleanly(regex: str) -> None:
    with pytest.raises(ConfigError):
        parse_settings(SETTINGS["infiniband"], {"device_include": regex}, "infiniband")


# Was a strict xfail (the bug, now fixed): EthtoolReader.read encodes the name strictly: a netdev
# whose name is not UTF-8 (legal in Linux; os.listdir of device/net gives it as surrogate escapes)
# raises UnicodeEncodeError, which PfcCollector._counters (catching OSError) lets through
def test_ethtool_read_name_not_utf8() -> None:
    reader = EthtoolReader()
    try:
        with pytest.raises(OSError):
            reader.read("\udcff")
    finally:
        reader.close()


# Was a strict xfail (the bug, now fixed): nvml.Session._init decodes bytes from
# nvmlSystemGetDriverVersion strictly (names and UUIDs go through _text with errors='replace'):
# non-UTF-8 bytes fail every GPU scrape
def test_nvml_driver_version_not_utf8() -> None:
    nvml.forget(fake_nvml.MODULE)
    fake_nvml.load(fake_nvml.h200x2())
    try:
        with mock.patch.object(fake_nvml, "nvmlSystemGetDriverVersion", lambda: b"580.\xff"):
            assert nvml.session(fake_nvml.MODULE).gpus() is not None
    finally:
        nvml.forget(fake_nvml.MODULE)
        fake_nvml.load(fake_nvml.h200x2())


class _Resource:
    def __init__(self, text: str) -> None:
        self.text = text

    def __truediv__(self, _other: str) -> _Resource:
        return self

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.text


# Was a strict xfail (the bug, now fixed): tables.load: a row with more fields than the header
# gives csv.DictReader's restkey None a list, and `(v or '').strip()` raises AttributeError naming
# neither file nor row (shipped data only, checked by tests: low severity)
def test_table_row_with_extra_field() -> None:
    with (mock.patch.object(tables, "files", lambda _pkg: _Resource("file,metric\na,b,c\n")),
          pytest.raises(ValueError, match=r"extra\.csv: row 1 has 1 field\(s\) more")):
        tables.load("extra.csv")
