"""gpunet-exporter core: collector interface, registry, configuration, CLI and HTTP."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("gpunet-exporter")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+unknown"

DEFAULT_PORT = 19400
