"""The vocabulary-parallel output head: logits for this rank's `V/tp` vocabulary rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.parallel.fused_cross_entropy import fused_linear_cross_entropy
from megatron_lev.parallel.layers import init_sharded_, vocab_range
from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.mappings import copy_to_tensor_parallel_region


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """`(B, S, D)` hidden states and this rank's rows `(V/tp, D)` of `layout` -> logits `(B, S, V/tp)`."""
    # the hidden state is replicated on TP ranks: its gradient is the sum over vocabulary shards
    return F.linear(copy_to_tensor_parallel_region(hidden, layout), weight)


def vocab_parallel_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int | None,
    loss_mask: torch.Tensor | None,
    chunk_tokens: int | None,
    layout: ParallelLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head and its loss fused: `(B, S, D)` hidden, rows `(V/tp, D)`, labels `(B, S)` -> the masked
    mean loss `()` and the detached per-token losses `(B, S)`, without the logits
    (`parallel.fused_cross_entropy`); `vocab_size`: the real vocabulary."""
    return fused_linear_cross_entropy(
        copy_to_tensor_parallel_region(hidden, layout),
        weight,
        labels,
        vocab_size,
        layout=layout,
        loss_mask=loss_mask,
        chunk_tokens=chunk_tokens,
    )


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

    def forward(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None = None,
        vocab_size: int | None = None,
        loss_mask: torch.Tensor | None = None,
        chunk_tokens: int | None = None,
    ):
        """Logits `(B, S, V/tp)`; given `labels`, the fused loss instead (`vocab_parallel_loss`), run
        inside this module's forward so that whatever gathers its weight (ZeRO-3) sees the use."""
        if labels is None:
            return vocab_parallel_logits(hidden, self.weight, self.layout)  # (B, S, V/tp)
        return vocab_parallel_loss(
            hidden, self.weight, labels, vocab_size, loss_mask, chunk_tokens, self.layout
        )
