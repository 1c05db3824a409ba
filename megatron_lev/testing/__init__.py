"""Helpers for the test suite (multi-process gloo runs on CPU)."""

from megatron_lev.testing.distributed import DistributedTestError, find_free_port, run_distributed

__all__ = ["DistributedTestError", "find_free_port", "run_distributed"]
