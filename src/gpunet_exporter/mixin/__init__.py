"""The alerting bundle, in the manner of kubernetes-mixin: the thresholds (``thresholds``), the
alerts and recording rules of each problem class (``alerts``), the rule file (``rules``,
``gpunet-rules``), the Grafana dashboards (``dashboards``) and the Kubernetes resources that carry
them (``kubernetes``), all from one declaration.

``python -m gpunet_exporter.mixin`` writes every generated file of the checkout;
``--thresholds FILE`` builds rules and dashboards from an operator's thresholds, ``--check``
exits 1 naming each stale file.
"""
