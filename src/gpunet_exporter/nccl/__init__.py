"""NCCL knowledge: its environment settings, its INFO log parser and the log explainer."""
