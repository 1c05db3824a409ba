"""Checked merge/split of tensor-parallel shards, on top of the model's canonical shard rules.

`megatron_lev.model.canonical` says how every parameter is laid out across TP ranks
(partition dim, fused QKV / gate-up parts). These wrappers add what a converter needs
on real files: shapes checked against the model, replicated tensors checked equal on
every rank, and errors that name the parameter.
"""

from __future__ import annotations

import torch

from megatron_lev.errors import UserError
from megatron_lev.model.canonical import ParamSpec, merge_tp_shards, split_tp_shard


class ShardMismatchError(UserError, ValueError):
    """Shards do not fit the model's shapes (wrong config, or a mixed/corrupted checkpoint)."""


def merge_shards(shards: list[torch.Tensor], spec: ParamSpec, check_replicas: bool = True) -> torch.Tensor:
    """The full tensor from its per-rank shards (TP-rank order), checked against `spec.shape`."""
    if spec.partition_dim is None and check_replicas:
        for r, s in enumerate(shards[1:], 1):
            if s.shape != shards[0].shape or not torch.equal(s, shards[0]):
                raise ShardMismatchError(
                    f"{spec.name}: replicated parameter differs between TP rank 0 and {r}"
                )
    try:
        full = merge_tp_shards(spec, shards)
    except RuntimeError as exc:  # torch.cat/split on mismatched shapes
        raise ShardMismatchError(
            f"{spec.name}: cannot merge shards of shapes {[tuple(s.shape) for s in shards]}: {exc}"
        ) from None
    if tuple(full.shape) != spec.shape:
        raise ShardMismatchError(
            f"{spec.name}: merged shape {tuple(full.shape)} from {len(shards)} shard(s) of "
            f"{[tuple(s.shape) for s in shards]} does not match the model's {spec.shape} "
            "(is the checkpoint's config.yaml the one it was trained with?)"
        )
    return full


def split_full(full: torch.Tensor, spec: ParamSpec, tp: int) -> list[torch.Tensor]:
    """The per-rank shards of a full tensor for tensor-parallel size `tp` (inverse of `merge_shards`)."""
    if tuple(full.shape) != spec.shape:
        raise ShardMismatchError(
            f"{spec.name}: shape {tuple(full.shape)} does not match the model's {spec.shape}"
        )
    if spec.partition_dim is not None:
        sizes = spec.parts or (spec.shape[spec.partition_dim],)
        if any(p % tp for p in sizes):
            raise ShardMismatchError(
                f"{spec.name}: sizes {sizes} along dim {spec.partition_dim} are not divisible by TP={tp}"
            )
    return [split_tp_shard(spec, full, tp, r).clone() for r in range(tp)]
