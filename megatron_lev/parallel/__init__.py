"""Tensor / pipeline / data parallel plumbing, and the local gloo launcher offline tools run their
ranks with (`local_workers.py`). Imports nothing else of the project but the base modules."""
