"""Node health: alert thresholds, the generated Prometheus rules, the doctor and the metric
reference."""
