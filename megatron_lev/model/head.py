"""The vocabulary-parallel output head: logits for this rank's `V/tp` vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.parallel.layers import init_sharded_, vocab_range
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.mappings import copy_to_tensor_parallel_region


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """`(B, S, D)` hidden states and this rank's rows `(V/tp, D)` of `layout` -> logits `(B, S, V/tp)`."""
    # the hidden state is replicated on TP ranks: its gradient is the sum over vocabulary shards
    return F.linear(copy_to_tensor_parallel_region(hidden, layout), weight)


class VocabParallelHead(nn.Module):
    """The untied head: owns `weight (V/tp, D)`, `(B, S, D) -> (B, S, V/tp)`.

    `vocab_size` is the padded row count. A tied head has no module of its own: the embedding
    stage's `head_logits` runs `vocab_parallel_logits` on the input table (`model.stages`).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        init_std: float = 0.02,
        layout: ParallelLayout = SINGLE,
        init_rows: int | None = None,
    ):
        super().__init__()
        self.layout = layout
        world, rank = layout.tp, layout.tp_rank
        self.vocab_size = vocab_size
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, rank, world)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size))
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 0
        init_sharded_(  # `init_rows`: the rows padded for one process are drawn, further ones are zero
            self.weight,
            (vocab_size, hidden_size),
            0,
            lambda t: nn.init.normal_(t, 0.0, init_std),
            layout,
            init_rows,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_logits(hidden, self.weight, self.layout)  # (B, S, V/tp)
