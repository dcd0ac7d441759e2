"""The NCCL probe: runner, NCCL log parser, result files."""
