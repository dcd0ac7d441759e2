"""The one command that writes every generated file of the checkout (``gpunet-mixin``, or
``python -m gpunet_exporter.mixin``):

- alerts/gpunet.rules.yml: the alerting and recording rules (``rules``);
- grafana/gpunet-*.json: the dashboards (``dashboards``);
- kubernetes/exporter/components/...: the PrometheusRule, the dashboards' ConfigMaps and the
  probe components' config.yml (``kubernetes``; it reads kubernetes/exporter/base/config.yml);
- docs/metrics.md: the metric reference (``metricsdoc``);
- the key table of docs/configuration.md (``configdoc``; the rest of that file is kept).

``--thresholds FILE`` builds the rules, the dashboards and the PrometheusRule from an
operator's thresholds (mixin/thresholds.py); ``--root DIR`` is where the files are (default:
the current directory, the checkout); ``--check`` writes nothing and exits 1 naming each stale
file.

Exit codes: 0 written (or up to date), 1 stale (--check), 2 bad input.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from gpunet_exporter.errors import ConfigError
from gpunet_exporter.files import read_regular
from gpunet_exporter.flags import Parser
from gpunet_exporter.mixin import configdoc, kubernetes, metricsdoc, rules
from gpunet_exporter.mixin.alerts import ALERT_NAMES
from gpunet_exporter.mixin.dashboards import dashboards
from gpunet_exporter.mixin.thresholds import Thresholds, load

PROG = "gpunet-mixin"
RULES = "alerts/gpunet.rules.yml"
GRAFANA = "grafana"
METRICS = "docs/metrics.md"
CONFIGURATION = "docs/configuration.md"


def _read(root: str, path: str) -> str:
    """A file of the checkout as text (newlines as open() in text mode reads them); ConfigError
    when it cannot be read."""
    full = os.path.join(root, path)
    try:
        data = read_regular(full)
    except ConfigError as exc:
        reason = str(exc).removeprefix("cannot read: ")
        raise ConfigError(f"cannot read {full}: {reason} (--root names the checkout)") from None
    try:
        return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read {full}: not UTF-8 text") from None


def outputs(t: Thresholds, root: str) -> dict[str, str]:
    """Path relative to ``root`` -> the text it should have."""
    out = {RULES: rules.render(t)}
    boards = {name: json.dumps(d, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
              for name, d in dashboards(t).items()}
    out.update({f"{GRAFANA}/{name}": text for name, text in boards.items()})
    out.update(kubernetes.outputs(t, boards, _read(root, kubernetes.BASE_CONFIG)))
    out[METRICS] = metricsdoc.render()
    try:
        out[CONFIGURATION] = configdoc.refresh(_read(root, CONFIGURATION))
    except ValueError as exc:
        raise ConfigError(f"{os.path.join(root, CONFIGURATION)}: {exc}") from None
    return out


def _current(root: str, path: str) -> str | None:
    try:
        return _read(root, path)
    except ConfigError:
        return None  # missing or unreadable: stale


def main(argv: Sequence[str] | None = None) -> int:
    p = Parser(prog=PROG, description="Write gpunet-exporter's generated files: rules, "
               "dashboards, Kubernetes resources, docs/metrics.md and the key table of "
               "docs/configuration.md.")
    p.add_argument("--thresholds", metavar="FILE",
                   help="YAML file overriding thresholds and `for:` durations (default: the "
                        "built-in ones, docs/runbooks.md)")
    p.add_argument("--root", metavar="DIR", default=".",
                   help="the checkout whose files are written or checked (default: the "
                        "current directory)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 naming each file that is stale")
    args = p.parse_args(argv)
    try:
        if not os.path.isdir(args.root):
            raise ConfigError(f"--root {args.root}: not a directory")
        out = outputs(load(args.thresholds, ALERT_NAMES), args.root)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if args.check:
        stale = [path for path, text in out.items() if _current(args.root, path) != text]
        for path in stale:
            where = os.path.normpath(os.path.join(args.root, path))
            print(f"{PROG}: {where} is stale; regenerate it with `python -m gpunet_exporter.mixin`",
                  file=sys.stderr)
        return 1 if stale else 0
    for path, text in out.items():
        full = os.path.join(args.root, path)
        if _current(args.root, path) == text:
            continue  # unchanged: its time stays
        try:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            print(f"{PROG}: cannot write {full}: {exc.strerror}", file=sys.stderr)
            return 2
    return 0


def entry() -> None:
    sys.exit(main())
