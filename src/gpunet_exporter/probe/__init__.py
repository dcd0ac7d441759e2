"""The probe program and its use by the exporter: runner, supervisor, pair plans, result files."""
