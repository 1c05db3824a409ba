"""Checkpoint directories: the format (`layout`), saving/loading one tag through an engine (`io`), and
what a checkpoint records of its run (`record`: the stored config, the batch its steps were made with;
`provenance`: the data and tokenizer it was trained on).

Below both the engine and the trainer, so that each imports it downward.
"""
