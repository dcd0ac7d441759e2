"""Built-in collectors, one module per collector, registered as entry points in pyproject.toml."""
