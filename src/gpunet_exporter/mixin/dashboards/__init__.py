"""The Grafana dashboards (docs/dashboards.md), built from code: one module per dashboard, the
pieces they share in ``common``. Five dashboards: the fleet overview, one node, the NCCL probes
(collectives), the pair plan of fleet probes (pairs) and one InfiniBand fabric's switches
(fabric).

They read the recording rules and alert classes of ``gpunet_exporter.mixin.alerts`` and colour
values from the thresholds, so a thresholds file changes the dashboards as it changes the
alerts. Every panel and query uses the ``datasource`` variable, every query filters by
``instance`` (a series without one, per job or per leaf, by ``job``), every counter is read
through ``rate``/``increase`` over ``$__rate_interval``, and every panel has a unit;
tests/test_grafana.py checks all of that, and ``python -m gpunet_exporter.mixin --check`` that
the committed grafana/*.json is what this package builds.

For tests: ``dashboards()`` (file name -> dashboard), ``queries(dashboard)`` ((panel title,
expr) of every target, rows included) and ``substitute(expr, variables)`` (Grafana variables
replaced by values, so that an expression can be sent to Prometheus).
"""

from __future__ import annotations

from gpunet_exporter.mixin.dashboards.collectives import collectives
from gpunet_exporter.mixin.dashboards.common import (
    DEFAULT_VALUES,
    PROBE_STATE_MAP,
    VARIABLE,
    Json,
    annotation_queries,
    iter_panels,
    queries,
    render,
    scoped,
    substitute,
    variable_queries,
)
from gpunet_exporter.mixin.dashboards.fabric import fabric
from gpunet_exporter.mixin.dashboards.fleet import fleet
from gpunet_exporter.mixin.dashboards.node import node
from gpunet_exporter.mixin.dashboards.pairs import pairs
from gpunet_exporter.mixin.thresholds import Thresholds, defaults
from gpunet_exporter.probe.idle import STATES as PROBE_STATES

__all__ = ["DEFAULT_VALUES", "PROBE_STATES", "PROBE_STATE_MAP", "VARIABLE", "Json",
           "annotation_queries", "dashboards", "iter_panels", "queries", "render", "substitute",
           "variable_queries"]


def dashboards(t: Thresholds | None = None) -> dict[str, Json]:
    """File name (in grafana/) -> dashboard, for thresholds ``t`` (default: the built-in)."""
    t = defaults() if t is None else t
    built = {"gpunet-fleet.json": fleet(t), "gpunet-node.json": node(t),
             "gpunet-collectives.json": collectives(t), "gpunet-pairs.json": pairs(t),
             "gpunet-fabric.json": fabric(t)}
    return {name: scoped(dash, t.selector, t.multi_cluster) for name, dash in built.items()}
