"""Tensor / pipeline / data parallel plumbing. Imports nothing else of the project."""
