"""grafana/generate.py, loaded by path (it is not part of the installed package): its
dashboards(), queries(), iter_panels() and substitute() for the tests that check the dashboards
and run their queries in a real Prometheus."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from support.paths import REPO


def load_generator() -> ModuleType:
    """A fresh copy of grafana/generate.py as a module."""
    spec = importlib.util.spec_from_file_location("gpunet_grafana_generate",
                                                  REPO / "grafana" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
