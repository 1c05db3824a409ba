"""A Llama-style decoder block (pre-norm attention + SwiGLU, no biases)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.model.attention import ParallelAttention
from megatron_lev.model.documents import Documents
from megatron_lev.model.mlp import ParallelSwiGLU
from megatron_lev.model.norm import RMSNorm
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.random import RNGStatesTracker, seeded


class TransformerBlock(nn.Module):
    """`x + attn(norm(x))`, then `+ mlp(norm(x))`. Built from its own seed (see `layer_seed`); `rng` is
    the model's tracker, whose TP stream attention dropout draws from."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_index: int,
        seed: int,
        layout: ParallelLayout = SINGLE,
        rng: RNGStatesTracker | None = None,
    ):
        super().__init__()
        self.layer_index = layer_index
        self.hidden_dropout = cfg.hidden_dropout
        with seeded(seed):
            self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.attention = ParallelAttention(cfg, cfg.num_layers, layout, rng)
            self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
            self.mlp = ParallelSwiGLU(cfg, cfg.num_layers, layout)

    def forward(
        self, x: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:  # (B, S, D) -> (B, S, D)
        # hidden dropout acts on replicated activations: the default stream, identical on TP ranks
        p = self.hidden_dropout if self.training else 0.0
        x = x + F.dropout(self.attention(self.attention_norm(x), documents), p, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), p, self.training)
