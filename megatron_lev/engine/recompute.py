"""Activation checkpointing: a training policy, applied to a built model from outside (`apply_ac`
in torchtitan).

`model.activation_checkpointing` keeps only the inputs of each group of `model.checkpoint_num_layers`
decoder blocks and recomputes the rest in backward; `model.recompute_attention` (selective) recomputes
only each block's attention core (scores, softmax, dropout: the `(B, H, S, S)` part where it is
materialised), through the slot `ParallelAttention.recompute_core` this module fills. The model's own
forward knows nothing of either:

    GPTModel (PP = 1)        `apply_activation_checkpointing(model, model_cfg)` replaces each group of
                             block stages in `model.stages` by one `CheckpointedStages`
    PipelineModule (PP > 1)  DeepSpeed groups its layers itself (`activation_checkpoint_interval`,
                             `engine.pipeline.build_pipeline`), with `checkpointed` from here

Either way the recomputation runs through `checkpointed`, which replays both RNG streams, so a
checkpointed run draws the same dropout masks, and gives the same losses and gradients, as one without.
"""

from __future__ import annotations

import functools
import itertools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_lev.config import ModelConfig
from megatron_lev.model.attention import ParallelAttention
from megatron_lev.model.gpt import GPTModel
from megatron_lev.model.stages import BlockStage
from megatron_lev.parallel.random import RNGStatesTracker


def checkpointed(function, *args, rng: RNGStatesTracker | None = None):
    """Run `function(*args)` without storing its activations; recompute them in backward.

    torch's non-reentrant checkpoint replays the default RNG; this also replays the model's
    tensor-parallel RNG stream (`rng`, the model's tracker: attention dropout), so the recomputation
    draws the same masks.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    if rng is None:
        return checkpoint(function, *args, use_reentrant=False)
    tracker = rng
    states = tracker.get_states()
    calls = [0]

    def run(*inputs):
        if calls[0] == 0:  # the forward pass itself
            calls[0] += 1
            return function(*inputs)
        current = tracker.get_states()  # recomputation during backward
        tracker.set_states(
            {k: (c.clone(), g.clone() if g is not None else None) for k, (c, g) in states.items()}
        )
        try:
            return function(*inputs)
        finally:
            tracker.set_states(current)

    return checkpoint(run, *args, use_reentrant=False)


class CheckpointedStages(nn.Module):
    """Consecutive stages run as one; in training, through `checkpointed` (recomputed in backward).

    Takes and returns what the stages do: a hidden state, or `(h, *document tensors)`. `rng` is the
    model's tracker, whose TP stream the recomputation replays.
    """

    def __init__(self, stages: list[nn.Module], rng: RNGStatesTracker | None = None):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.rng = rng

    def _run(self, *inputs):
        x = inputs[0] if len(inputs) == 1 else inputs
        for stage in self.stages:
            x = stage(x)
        return x

    def forward(self, x):
        if not self.training:
            return self._run(x)
        return checkpointed(self._run, *(x if isinstance(x, tuple) else (x,)), rng=self.rng)


def apply_activation_checkpointing(model: nn.Module, model_cfg: ModelConfig) -> nn.Module:
    """Checkpoint `model`'s blocks in groups of `model_cfg.checkpoint_num_layers` when
    `model_cfg.activation_checkpointing` is on; returns `model`.

    A `GPTModel`'s block stages are grouped in order from the first block; parameters and their
    names do not change. A pipeline (anything else) is left as is: DeepSpeed checkpoints its layers
    (`build_pipeline`). Applying it twice changes nothing more.
    """
    if model_cfg.recompute_attention:  # selective: the attention cores of every block, any model
        for module in model.modules():
            if isinstance(module, ParallelAttention):
                module.recompute_core = functools.partial(checkpointed, rng=module.rng)
    if not model_cfg.activation_checkpointing or not isinstance(model, GPTModel):
        return model
    if any(isinstance(stage, CheckpointedStages) for stage in model.stages):
        return model
    size, stages = model_cfg.checkpoint_num_layers, []
    for blocks, run in itertools.groupby(model.stages, key=lambda stage: isinstance(stage, BlockStage)):
        run = list(run)
        if not blocks:
            stages += run
            continue
        groups = (CheckpointedStages(run[i : i + size], model.rng) for i in range(0, len(run), size))
        stages += [group.train(model.training) for group in groups]
    model.stages = stages
    return model
