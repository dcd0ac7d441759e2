"""Everything that touches the machine: sysfs, RDMA devices, ethtool, NVML, PCIe, QoS tools,
subprocesses. Typed results, no metrics."""
