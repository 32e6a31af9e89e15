"""Task formats (Terminal-Bench, Harbor, HumanEval) behind one Task contract; see ``load_taskset``."""

from envs.taskset import load_taskset

__all__ = ["load_taskset"]
