"""The vocabulary-parallel output head: logits for this rank's `V/tp` vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.parallel import state
from megatron_lev.parallel.layers import init_sharded_, vocab_range
from megatron_lev.parallel.mappings import copy_to_tensor_parallel_region


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`(B, S, D)` hidden states and this rank's rows `(V/tp, D)` -> logits `(B, S, V/tp)`."""
    # the hidden state is replicated on TP ranks: its gradient is the sum over vocabulary shards
    return F.linear(copy_to_tensor_parallel_region(hidden), weight)


class VocabParallelHead(nn.Module):
    """`(B, S, D) -> (B, S, V/tp)`. Untied: owns `weight (V/tp, D)`; tied: uses the table it is given.

    `vocab_size` is the padded row count; `true_vocab_size` (default: all rows) is the real
    vocabulary, which the loss uses to leave the padding rows out of the softmax.
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        init_std: float = 0.02,
        tied: bool = False,
        true_vocab_size: int | None = None,
    ):
        super().__init__()
        world, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
        if true_vocab_size is not None and not 0 < true_vocab_size <= vocab_size:
            raise ValueError(
                f"true vocabulary size {true_vocab_size} must be in [1, {vocab_size}] (the padded size)"
            )
        self.vocab_size, self.tied = vocab_size, tied
        self.true_vocab_size = true_vocab_size if true_vocab_size is not None else vocab_size
        self.vocab_start, self.vocab_end = vocab_range(vocab_size, rank, world)
        if tied:
            self.register_parameter("weight", None)
        else:
            self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size))
            self.weight.tensor_model_parallel = True
            self.weight.partition_dim = 0
            init_sharded_(
                self.weight, (vocab_size, hidden_size), 0, lambda t: nn.init.normal_(t, 0.0, init_std)
            )

    def forward(self, hidden: torch.Tensor, tied_weight: torch.Tensor | None = None) -> torch.Tensor:
        weight = tied_weight if self.tied else self.weight
        if weight is None:
            raise ValueError("a tied output head needs the embedding's table (tied_weight)")
        return vocab_parallel_logits(hidden, weight)  # (B, S, V/tp)
