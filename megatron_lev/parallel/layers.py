"""Tensor-parallel layers.

Initialisation convention (so TP = N reproduces TP = 1 with the same seed): a
sharded parameter is initialised by drawing the *full* tensor from the default
torch RNG, exactly as the unsharded layer would, and keeping this rank's slice.
Every rank therefore consumes the same random numbers in the same order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.parallel import state
from megatron_lev.parallel.mappings import reduce_from_tensor_parallel_region


def init_sharded_(param: torch.Tensor, full_shape: tuple[int, ...], dim: int,
                  init_fn: Callable[[torch.Tensor], object]) -> None:
    """Fill `param` with this TP rank's slice (along `dim`) of a full tensor drawn by `init_fn`."""
    full = torch.empty(full_shape, dtype=torch.float32)
    init_fn(full)
    world, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
    shard = full.chunk(world, dim=dim)[rank] if world > 1 else full
    with torch.no_grad():
        param.copy_(shard.to(param.dtype))


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of the rows of a `vocab_size` table held by TP rank `rank`."""
    if vocab_size % world:
        raise ValueError(f"vocabulary size {vocab_size} is not divisible by tensor-parallel size {world}; "
                         "pad it (model.make_vocab_size_divisible_by)")
    per = vocab_size // world
    return rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    """A `V x D` table split by rows across TP ranks; the lookup is all-reduced.

    Each rank looks up the ids it owns (others give zero rows), and the reduce
    region sums the partial results, so every rank ends with the full `[.., D]`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, init_std: float = 0.02,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        world, rank = state.get_tensor_model_parallel_world_size(), state.get_tensor_model_parallel_rank()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, rank, world)
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim, dtype=params_dtype))
        self.weight.tensor_model_parallel = True  # marks a sharded parameter (dim 0) for checkpoints/export
        self.weight.partition_dim = 0
        init_sharded_(self.weight, (num_embeddings, embedding_dim), 0,
                      lambda t: nn.init.normal_(t, mean=0.0, std=init_std))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if state.get_tensor_model_parallel_world_size() == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight)  # (..., D)
        out = out.masked_fill(mask.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out)
