from gpunet_exporter.probe.cli import entry

entry()
