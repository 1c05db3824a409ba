"""A Llama-style decoder block (pre-norm attention + SwiGLU, no biases) and activation checkpointing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from megatron_lev.config import ModelConfig
from megatron_lev.model.attention import ParallelAttention
from megatron_lev.model.documents import Documents
from megatron_lev.model.mlp import ParallelSwiGLU
from megatron_lev.model.norm import RMSNorm
from megatron_lev.parallel.random import get_rng_tracker, seeded


class TransformerBlock(nn.Module):
    """`x + attn(norm(x))`, then `+ mlp(norm(x))`. Built from its own seed (see `layer_seed`)."""

    def __init__(self, cfg: ModelConfig, layer_index: int, seed: int):
        super().__init__()
        self.layer_index = layer_index
        self.hidden_dropout = cfg.hidden_dropout
        with seeded(seed):
            self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.attention = ParallelAttention(cfg, cfg.num_layers)
            self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.mlp = ParallelSwiGLU(cfg, cfg.num_layers)

    def forward(
        self, x: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:  # (B, S, D) -> (B, S, D)
        # hidden dropout acts on replicated activations: the default stream, identical on TP ranks
        p = self.hidden_dropout if self.training else 0.0
        x = x + F.dropout(self.attention(self.attention_norm(x), documents), p, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), p, self.training)


def checkpointed(function, *args):
    """Run `function(*args)` without storing its activations; recompute them in backward.

    torch's non-reentrant checkpoint replays the default RNG; this also replays the
    tensor-parallel RNG stream (attention dropout), so the recomputation draws the same masks.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    tracker = get_rng_tracker()
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
