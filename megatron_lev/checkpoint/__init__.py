"""Checkpoints across layouts: merge/split tensor- and pipeline-parallel shards, export to and
import from Hugging Face Llama, reshard for a new layout, and offline lm-eval task files."""
