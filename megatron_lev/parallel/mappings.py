"""The four tensor-parallel autograd regions (Megatron's vocabulary).

- copy:    identity forward,            all-reduce backward   (enter a TP region)
- reduce:  all-reduce forward,          identity backward     (leave a row-parallel region)
- scatter: split last dim forward,      all-gather backward
- gather:  all-gather last dim forward, split backward

With TP = 1 (or nothing initialised) every region is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lev.parallel import state


def _tp_world() -> int:
    return state.get_tensor_model_parallel_world_size()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_world() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=state.get_tensor_model_parallel_group())
    return x


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = _tp_world()
    if world == 1:
        return x
    if x.shape[-1] % world:
        raise ValueError(f"last dimension {x.shape[-1]} is not divisible by tensor-parallel size {world}")
    return x.chunk(world, dim=-1)[state.get_tensor_model_parallel_rank()].contiguous()


def _gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = _tp_world()
    if world == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone())


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad)


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


def copy_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _CopyToTensorParallelRegion.apply(x) if _tp_world() > 1 else x


def reduce_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _ReduceFromTensorParallelRegion.apply(x) if _tp_world() > 1 else x


def scatter_to_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _ScatterToTensorParallelRegion.apply(x) if _tp_world() > 1 else x


def gather_from_tensor_parallel_region(x: torch.Tensor) -> torch.Tensor:
    return _GatherFromTensorParallelRegion.apply(x) if _tp_world() > 1 else x
