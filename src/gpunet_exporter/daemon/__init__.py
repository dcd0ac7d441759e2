"""The long-running service: serving /metrics, hot-plug events, privilege checks."""
