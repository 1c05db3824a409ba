"""Merge tensor-parallel shards into full tensors, and split full tensors for a new TP size.

The rules come from the model itself, not from name patterns: a TP=1 instance of the
model tells, for every parameter, its full shape, whether it is sharded
(`param.tensor_model_parallel`), along which dimension (`param.partition_dim`), and,
for fused column-parallel weights (QKV, gate/up), the full sizes of the fused parts
(`module.part_sizes`). A rank's shard of a fused weight is the concatenation of its
slice of every part (see `parallel.layers.init_fused_sharded_`), so merging splits
each shard into its parts, concatenates the parts across ranks, then re-fuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class ShardMismatchError(ValueError):
    """Shards do not fit the model's shapes (wrong config, or a mixed/corrupted checkpoint)."""


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is laid out across tensor-parallel ranks."""

    shape: tuple[int, ...]  # full (TP=1) shape
    dim: int | None  # partition dimension; None: replicated on every rank
    parts: tuple[int, ...] | None = None  # full sizes of fused parts along `dim`


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """The layout of every parameter and buffer of `model` (built at TP=1), by state-dict name."""
    specs: dict[str, ShardSpec] = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for name, param in module.named_parameters(recurse=False):
            dim = getattr(param, "partition_dim", None) if getattr(param, "tensor_model_parallel", False) else None
            parts = getattr(module, "part_sizes", None)
            parts = tuple(parts) if parts and dim == 0 and len(parts) > 1 and param.dim() == 2 else None
            specs[prefix + name] = ShardSpec(tuple(param.shape), dim, parts)
        for name, buf in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set:
                continue
            specs[prefix + name] = ShardSpec(tuple(buf.shape), None)
    return specs


def merge_shards(name: str, shards: list[torch.Tensor], spec: ShardSpec, check_replicas: bool = True) -> torch.Tensor:
    """The full tensor from its per-rank shards (rank order)."""
    tp = len(shards)
    if spec.dim is None:
        full = shards[0]
        if check_replicas:
            for r, s in enumerate(shards[1:], 1):
                if s.shape != full.shape or not torch.equal(s, full):
                    raise ShardMismatchError(f"{name}: replicated parameter differs between TP rank 0 and {r}")
    elif spec.parts is None:
        full = torch.cat(shards, dim=spec.dim)
    else:
        per_rank = [p // tp for p in spec.parts]
        split = [s.split(per_rank, dim=spec.dim) for s in shards]  # rank -> parts
        full = torch.cat([torch.cat([split[r][i] for r in range(tp)], dim=spec.dim)
                          for i in range(len(spec.parts))], dim=spec.dim)
    if tuple(full.shape) != spec.shape:
        raise ShardMismatchError(f"{name}: merged shape {tuple(full.shape)} from {tp} shard(s) of "
                                 f"{[tuple(s.shape) for s in shards]} does not match the model's {spec.shape}")
    return full


def split_full(name: str, full: torch.Tensor, spec: ShardSpec, tp: int) -> list[torch.Tensor]:
    """The per-rank shards of a full tensor for tensor-parallel size `tp` (inverse of `merge_shards`)."""
    if tuple(full.shape) != spec.shape:
        raise ShardMismatchError(f"{name}: shape {tuple(full.shape)} does not match the model's {spec.shape}")
    if spec.dim is None:
        return [full.clone() for _ in range(tp)]
    sizes = spec.parts or (spec.shape[spec.dim],)
    if any(p % tp for p in sizes):
        raise ShardMismatchError(f"{name}: sizes {sizes} along dim {spec.dim} are not divisible by TP={tp}")
    parts = full.split(list(sizes), dim=spec.dim)
    return [torch.cat([p.chunk(tp, dim=spec.dim)[r] for p in parts], dim=spec.dim).clone() for r in range(tp)]
