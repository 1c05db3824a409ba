"""Checkpoint directories: the format (`layout`) and saving/loading one tag through an engine (`io`).

Below both the engine and the trainer, so that each imports it downward.
"""
