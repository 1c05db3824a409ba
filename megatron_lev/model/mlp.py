"""SwiGLU feed-forward, tensor-parallel.

Fused gate/up layout (column-parallel, `partition_dim` 0): full weight `[Wgate (F, D); Wup (F, D)]`;
TP rank r holds `[Wgate rows r*F/tp..(r+1)*F/tp ; Wup same rows]`. `down (D, F)` is row-parallel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.config import ModelConfig
from megatron_lev.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lev.parallel.layout import SINGLE, ParallelLayout


class ParallelSwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, num_layers_for_init: int, layout: ParallelLayout = SINGLE):
        super().__init__()
        ffn = cfg.ffn_size
        self.gate_up = ColumnParallelLinear(
            cfg.hidden_size, 2 * ffn, part_sizes=(ffn, ffn), init_std=cfg.init_std, layout=layout
        )
        self.down = RowParallelLinear(
            ffn, cfg.hidden_size, init_std=cfg.init_std / math.sqrt(2 * num_layers_for_init), layout=layout
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, S, D) -> (B, S, D)
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (B, S, F/tp) each
        return self.down(F.silu(gate) * up)
