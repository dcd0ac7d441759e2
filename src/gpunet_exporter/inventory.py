"""What this node had: RDMA devices, RDMA ports and the netdevs behind them, learned from what
was seen (and kept across restarts in a small state file) or counted in the config, so that a
device that falls off the bus is noticed although it leaves no series behind.

The state file is JSON, ``{"version": 1, "rdma_device": [...], "rdma_port": [...],
"netdev": [...]}``, written atomically (a temporary file in the same directory, then rename),
at most ``MAX_NAMES`` names per kind and ``MAX_FILE_BYTES`` in all. A state file that cannot be
written leaves learning in memory (logged once as a warning); one that cannot be read or parsed
is ignored (logged once) and rewritten. Reset after a planned removal: stop the exporter, delete
the file, start it (docs/configuration.md). A hot-plug ``remove`` event forgets nothing: a NIC
that falls off the bus sends one too. A reader that must not learn (the doctor) passes
``learn=False``: it reads the file and never writes it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping

from gpunet_exporter.errors import ConfigError
from gpunet_exporter.files import read_regular
from gpunet_exporter.statefile import write_json

KINDS = ("rdma_device", "rdma_port", "netdev")
MAX_NAMES = 256  # per kind: a node has tens of RDMA devices at most
MAX_FILE_BYTES = 256 * 1024
VERSION = 1

Log = Callable[..., None]  # LogOnce-like: (level, msg, *args)


class Inventory:
    """The names of each kind ever seen (by this process, and by earlier ones through the state
    file), and what is missing of them now."""

    def __init__(self, state_file: str | None, learn: bool, log: Log) -> None:
        self.state_file = state_file or None
        self.learn = learn
        self._log = log
        self._lock = threading.Lock()
        self.known: dict[str, set[str]] = {k: set() for k in KINDS}
        self._written: dict[str, set[str]] | None = None
        self._writable = True
        if self.state_file:
            self.known = read_state(self.state_file, log)
            self._written = {k: set(v) for k, v in self.known.items()}

    def update(self, present: Mapping[str, Iterable[str]]) -> dict[str, list[str]]:
        """Record what is present now (when learning); returns the missing names of each kind:
        those known and not present, sorted."""
        now = {k: set(v) for k, v in present.items()}
        with self._lock:
            if self.learn:
                for kind, names in now.items():
                    room = MAX_NAMES - len(self.known[kind])
                    new = sorted(names - self.known[kind])
                    if len(new) > room:
                        self._log(logging.WARNING, "inventory: more than %d %s names; not "
                                  "remembering the rest", MAX_NAMES, kind)
                        new = new[:max(room, 0)]
                    self.known[kind].update(new)
                self._save()
            return {k: sorted(self.known[k] - now.get(k, set())) for k in KINDS}

    def _save(self) -> None:
        if not self.state_file or not self._writable or self._written == self.known:
            return
        try:
            write_state(self.state_file, self.known)
        except OSError as exc:
            self._writable = False
            self._log(logging.WARNING, "inventory: cannot write %s (%s); learning in memory "
                      "only, so a device gone before a restart is not noticed after it",
                      self.state_file, exc.strerror or exc)
            return
        self._written = {k: set(v) for k, v in self.known.items()}


def read_state(path: str, log: Log) -> dict[str, set[str]]:
    """The names of the state file; empty sets where it is absent, unreadable or not ours."""
    known: dict[str, set[str]] = {k: set() for k in KINDS}
    if not os.path.lexists(path):
        return known
    try:
        doc = json.loads(read_regular(path, MAX_FILE_BYTES).decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("version") != VERSION:
            raise ValueError("not an inventory state file of version 1")
        for kind in KINDS:
            names = doc.get(kind, [])
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError(f"{kind} is not a list of names")
            known[kind] = set(names[:MAX_NAMES])
    except (ConfigError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        log(logging.WARNING, "inventory: ignoring %s: %s", path, str(exc)[:200])
        return {k: set() for k in KINDS}
    return known


def write_state(path: str, known: Mapping[str, set[str]]) -> None:
    """Write the state file atomically (same-directory temporary file, fsync, rename)."""
    doc = {"version": VERSION, **{k: sorted(known.get(k, ()))[:MAX_NAMES] for k in KINDS}}
    write_json(path, doc)
