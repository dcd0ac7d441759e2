from exporter.probe.cli import entry

entry()
