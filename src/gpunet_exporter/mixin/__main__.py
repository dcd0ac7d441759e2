"""``python -m gpunet_exporter.mixin``: every generated file (mixin/generate.py)."""

from gpunet_exporter.mixin.generate import entry

entry()
