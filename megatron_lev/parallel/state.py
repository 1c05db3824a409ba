"""Create the process groups for tensor (TP), pipeline (PP) and data (DP) parallelism.

`initialize_model_parallel(tp, pp)` is collective: every rank creates every group, in the same
order, and gets back its own `ParallelLayout` (`parallel.layout`: sizes, coordinates, groups),
which the run passes to whatever needs it. Nothing is kept here: there is no global to read.
Few modules may import this one (the run's composition root, the resharder that starts its own
groups; `tests/test_architecture.py` holds the list).
"""

from __future__ import annotations

import torch.distributed as dist

from megatron_lev.parallel.layout import (
    ParallelLayout,
    ParallelLayoutError,
    ProcessGroups,
    data_parallel_size,
    rank_of,
)


def _new_groups(rank: int, rank_sets) -> object:
    """Create one group per rank set (collective, in order); return the one holding `rank`."""
    mine = None
    for ranks in rank_sets:
        group = dist.new_group(list(ranks))
        if rank in ranks:
            mine = group
    return mine


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1
) -> ParallelLayout:
    """Create the TP, DP, PP and model-parallel groups (collective: every rank must call, in this order)
    and return this rank's layout."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before initialize_model_parallel()")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    dp = data_parallel_size(world, tp, pp)
    tp_group = _new_groups(
        rank, (tuple(rank_of(p, d, t, tp, dp) for t in range(tp)) for p in range(pp) for d in range(dp))
    )
    dp_group = _new_groups(
        rank, (tuple(rank_of(p, d, t, tp, dp) for d in range(dp)) for p in range(pp) for t in range(tp))
    )
    pp_group = _new_groups(
        rank, (tuple(rank_of(p, d, t, tp, dp) for p in range(pp)) for d in range(dp) for t in range(tp))
    )
    mp_group = _new_groups(
        rank, (tuple(rank_of(p, d, t, tp, dp) for p in range(pp) for t in range(tp)) for d in range(dp))
    )
    groups = ProcessGroups(tp=tp_group, pp=pp_group, dp=dp_group, mp=mp_group)
    return ParallelLayout.from_sizes(tp, pp, dp, rank=rank, groups=groups)


__all__ = ["ParallelLayout", "ParallelLayoutError", "initialize_model_parallel"]
