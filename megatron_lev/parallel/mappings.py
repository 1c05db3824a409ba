"""The four tensor-parallel autograd regions (Megatron's vocabulary).

- copy:    identity forward,            all-reduce backward   (enter a TP region)
- reduce:  all-reduce forward,          identity backward     (leave a row-parallel region)
- scatter: split last dim forward,      all-gather backward
- gather:  all-gather last dim forward, split backward

Each takes the `ParallelLayout` whose TP group it communicates over (the layer's own). With
TP = 1 every region is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lev.parallel.layout import ParallelLayout


def _all_reduce(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    if layout.tp == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=layout.tp_group)
    return x


def _split_last_dim(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    world = layout.tp
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[layout.tp_rank].contiguous()


def _gather_last_dim(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    world = layout.tp
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=layout.tp_group)
    return torch.cat(parts, dim=-1)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.layout), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return _all_reduce(x.clone(), layout)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return _split_last_dim(x, layout)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.layout), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return _gather_last_dim(x, layout)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.layout), None


def copy_to_tensor_parallel_region(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    return _CopyToTensorParallelRegion.apply(x, layout) if layout.tp > 1 else x


def reduce_from_tensor_parallel_region(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    return _ReduceFromTensorParallelRegion.apply(x, layout) if layout.tp > 1 else x


def scatter_to_tensor_parallel_region(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    return _ScatterToTensorParallelRegion.apply(x, layout) if layout.tp > 1 else x


def gather_from_tensor_parallel_region(x: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    return _GatherFromTensorParallelRegion.apply(x, layout) if layout.tp > 1 else x
