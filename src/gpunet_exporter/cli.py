"""The ``gpunet-exporter`` command: ``doctor`` checks this node once (health/doctor.py), anything
else serves /metrics (daemon/serve.py)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from gpunet_exporter.daemon import serve
from gpunet_exporter.health import doctor


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["doctor"]:
        raise SystemExit(doctor.main(argv[1:]))
    serve.main(argv)


if __name__ == "__main__":
    main()
