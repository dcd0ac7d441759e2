"""gpunet-exporter core: collector interface, registry, configuration, CLI and HTTP."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpunet-exporter")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

DEFAULT_PORT = 19400
# The project's home: pyproject.toml's [project.urls] and the runbook links' default are it
# (tests/test_docs.py holds them to it).
HOME = "https://github.com/gpunet-exporter/gpunet-exporter"
