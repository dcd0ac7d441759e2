"""State files the exporter and its commands keep between runs (probe results, the learned
inventory, the doctor's counter history): JSON, replaced atomically so that a reader never sees
a partial file and a crash leaves the previous one."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Mapping
from typing import Any


def write_json(path: str, data: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``data`` as JSON: a temporary file in the same directory, written,
    fsynced and made world-readable (0644), then renamed over ``path``. Raises OSError; the
    temporary file is removed on any failure."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
