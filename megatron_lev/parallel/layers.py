"""Tensor-parallel layers.

Initialisation convention (so TP = N reproduces TP = 1 with the same seed): a
sharded parameter is initialised by drawing the *full* tensor from the default
torch RNG, exactly as the unsharded layer would, and keeping this rank's slice.
Every rank therefore consumes the same random numbers in the same order.

Each layer is given the `ParallelLayout` it is sharded over (default: one process) and keeps it:
its shard is the layout's TP rank's, and its regions communicate over the layout's TP group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lev.parallel.layout import SINGLE, ParallelLayout
from megatron_lev.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)


def init_sharded_(
    param: torch.Tensor,
    full_shape: tuple[int, ...],
    dim: int,
    init_fn: Callable[[torch.Tensor], object],
    layout: ParallelLayout,
    init_rows: int | None = None,
) -> None:
    """Fill `param` with `layout`'s TP rank's slice (along `dim`) of a full tensor drawn by `init_fn`.

    `init_rows` (a vocabulary table: the rows padded as for one process) draws only the first rows
    along dim 0 and leaves the extra padding rows a larger TP size adds at zero, so the drawn rows
    (and the random stream after them) are those of one process whatever the padding."""
    full = torch.empty(full_shape, dtype=torch.float32)
    if init_rows is None or init_rows >= full_shape[0]:
        init_fn(full)
    else:  # only the padding rows are zeroed: no extra pass over a full table at start-up
        init_fn(full[:init_rows])
        full[init_rows:].zero_()
    world, rank = layout.tp, layout.tp_rank
    shard = full.chunk(world, dim=dim)[rank] if world > 1 else full
    with torch.no_grad():
        param.copy_(shard.to(param.dtype))


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of the rows of a `vocab_size` table held by TP rank `rank`."""
    if vocab_size % world:
        raise ValueError(
            f"vocabulary size {vocab_size} is not divisible by tensor-parallel size {world}; "
            "pad it (model.make_vocab_size_divisible_by)"
        )
    per = vocab_size // world
    return rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    """A `V x D` table split by rows across TP ranks; the lookup is all-reduced.

    Each rank looks up the ids it owns (others give zero rows), and the reduce
    region sums the partial results, so every rank ends with the full `[.., D]`.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        init_std: float = 0.02,
        params_dtype: torch.dtype = torch.float32,
        layout: ParallelLayout = SINGLE,
        init_rows: int | None = None,
    ):
        """`init_rows`: the rows drawn at init (the vocabulary padded for one process); the further
        padding rows of a larger TP size start at zero (`init_sharded_`)."""
        super().__init__()
        self.layout = layout
        world, rank = layout.tp, layout.tp_rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, rank, world)
        self.weight = nn.Parameter(
            torch.empty(self.vocab_end - self.vocab_start, embedding_dim, dtype=params_dtype)
        )
        self.weight.tensor_model_parallel = True  # marks a sharded parameter (dim 0) for checkpoints/export
        self.weight.partition_dim = 0
        init_sharded_(
            self.weight,
            (num_embeddings, embedding_dim),
            0,
            lambda t: nn.init.normal_(t, mean=0.0, std=init_std),
            layout,
            init_rows,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.layout.tp == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(mask, 0)
        out = F.embedding(local, self.weight)  # (..., D)
        out = out.masked_fill(mask.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(out, self.layout)


def init_fused_sharded_(
    param: torch.Tensor,
    part_sizes: tuple[int, ...],
    in_features: int,
    init_fn: Callable[[torch.Tensor], object],
    layout: ParallelLayout,
) -> None:
    """Init a column-parallel weight fused from parts (e.g. Q, K, V): rank r keeps its slice of each part.

    The full `(sum(part_sizes), in_features)` tensor is drawn once, split into its parts,
    each part is chunked over TP ranks, and the rank's chunks are concatenated in order.
    """
    full = torch.empty(sum(part_sizes), in_features, dtype=torch.float32)
    init_fn(full)
    world, rank = layout.tp, layout.tp_rank
    shard = torch.cat([p.chunk(world, dim=0)[rank] for p in full.split(list(part_sizes), dim=0)], dim=0)
    with torch.no_grad():
        param.copy_(shard.to(param.dtype))


def _mark(param: nn.Parameter, partition_dim: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim


class ColumnParallelLinear(nn.Module):
    """`y = x A^T` with `A (out, in)` split by output rows: each rank computes `out/tp` features.

    Input `(.., in)` is replicated (copy region: its gradient is all-reduced); output
    `(.., out/tp)` stays sharded unless `gather_output`. `part_sizes` fuses several
    matrices (QKV, gate/up): each part is split across ranks separately, and a rank's
    shard is the concatenation of its slice of every part (see `init_fused_sharded_`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        gather_output: bool = False,
        init_std: float = 0.02,
        part_sizes: tuple[int, ...] | None = None,
        params_dtype: torch.dtype = torch.float32,
        layout: ParallelLayout = SINGLE,
    ):
        super().__init__()
        self.layout = layout
        world = layout.tp
        self.part_sizes = tuple(part_sizes) if part_sizes else (out_features,)
        if sum(self.part_sizes) != out_features:
            raise ValueError(f"part_sizes {self.part_sizes} must sum to out_features={out_features}")
        for size in self.part_sizes:
            if size % world:
                raise ValueError(f"output size {size} is not divisible by tensor-parallel size {world}")
        self.in_features, self.out_features, self.gather_output = in_features, out_features, gather_output
        self.weight = nn.Parameter(torch.empty(out_features // world, in_features, dtype=params_dtype))
        _mark(self.weight, 0)
        init_fused_sharded_(
            self.weight,
            self.part_sizes,
            in_features,
            lambda t: nn.init.normal_(t, mean=0.0, std=init_std),
            layout,
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features // world, dtype=params_dtype))
            _mark(self.bias, 0)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (.., in) -> (.., out/tp) or (.., out)
        y = F.linear(copy_to_tensor_parallel_region(x, self.layout), self.weight, self.bias)
        if self.gather_output:
            if len(self.part_sizes) > 1:
                raise ValueError("gather_output of a fused column-parallel layer would interleave its parts")
            y = gather_from_tensor_parallel_region(y, self.layout)
        return y


class RowParallelLinear(nn.Module):
    """`y = x A^T` with `A (out, in)` split by input columns; partial products are all-reduced.

    Input `(.., in/tp)` is already sharded (the output of a column-parallel layer) unless
    `input_is_parallel=False`, in which case it is scattered first. Output `(.., out)` is full.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        input_is_parallel: bool = True,
        init_std: float = 0.02,
        params_dtype: torch.dtype = torch.float32,
        layout: ParallelLayout = SINGLE,
    ):
        super().__init__()
        self.layout = layout
        world = layout.tp
        if in_features % world:
            raise ValueError(f"input size {in_features} is not divisible by tensor-parallel size {world}")
        self.in_features, self.out_features, self.input_is_parallel = (
            in_features,
            out_features,
            input_is_parallel,
        )
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world, dtype=params_dtype))
        _mark(self.weight, 1)
        init_sharded_(
            self.weight,
            (out_features, in_features),
            1,
            lambda t: nn.init.normal_(t, mean=0.0, std=init_std),
            layout,
        )
        if bias:  # replicated, added once after the reduction
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=params_dtype))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (.., in/tp) -> (.., out)
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.layout)
        y = reduce_from_tensor_parallel_region(F.linear(x, self.weight), self.layout)
        return y + self.bias if self.bias is not None else y
