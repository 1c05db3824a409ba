"""Process groups for tensor (TP), pipeline (PP) and data (DP) parallelism.

Rank layout matches DeepSpeed's `PipeModelDataParallelTopology` (axes pipe, data,
model; model fastest): `rank = pp_rank * (DP * TP) + dp_rank * TP + tp_rank`.
So a TP group is TP consecutive ranks (one node, fast links), DP groups stride TP,
PP groups stride DP * TP. With nothing initialised, every query answers as a single
process (TP = PP = DP = 1), so model code runs unchanged without a process group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from megatron_lev.utils.dist import rank as global_rank


class ParallelLayoutError(ValueError):
    """The world size does not factor into TP x PP x DP."""


@dataclass
class _State:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    tp_group: object = None
    pp_group: object = None
    dp_group: object = None
    mp_group: object = None  # TP x PP (all model-parallel ranks of one replica)
    tp_ranks: tuple = (0,)
    pp_ranks: tuple = (0,)
    dp_ranks: tuple = (0,)
    initialized: bool = False


_STATE = _State()


def rank_of(pp_rank: int, dp_rank: int, tp_rank: int, tp: int, dp: int) -> int:
    return pp_rank * dp * tp + dp_rank * tp + tp_rank


def layout(world_size: int, tp: int, pp: int) -> int:
    """Validate `world = TP x PP x DP`; return DP."""
    if tp < 1 or pp < 1:
        raise ParallelLayoutError(f"tensor ({tp}) and pipeline ({pp}) parallel sizes must be >= 1")
    if world_size % (tp * pp):
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by tensor x pipeline parallel size = {tp} x {pp}; "
            "world = TP x PP x DP: change parallel.tensor_model_parallel_size, "
            "parallel.pipeline_model_parallel_size, or the number of processes"
        )
    return world_size // (tp * pp)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1
) -> None:
    """Create the TP, PP, DP and model-parallel groups (collective: every rank must call)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before initialize_model_parallel()")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    dp = layout(world, tp, pp)
    s = _State(tp=tp, pp=pp, dp=dp, initialized=True)
    # every rank must create every group, in the same order
    for p in range(pp):
        for d in range(dp):
            ranks = tuple(rank_of(p, d, t, tp, dp) for t in range(tp))
            g = dist.new_group(list(ranks))
            if rank in ranks:
                s.tp_group, s.tp_ranks = g, ranks
    for p in range(pp):
        for t in range(tp):
            ranks = tuple(rank_of(p, d, t, tp, dp) for d in range(dp))
            g = dist.new_group(list(ranks))
            if rank in ranks:
                s.dp_group, s.dp_ranks = g, ranks
    for d in range(dp):
        for t in range(tp):
            ranks = tuple(rank_of(p, d, t, tp, dp) for p in range(pp))
            g = dist.new_group(list(ranks))
            if rank in ranks:
                s.pp_group, s.pp_ranks = g, ranks
    for d in range(dp):
        ranks = tuple(rank_of(p, d, t, tp, dp) for p in range(pp) for t in range(tp))
        g = dist.new_group(list(ranks))
        if rank in ranks:
            s.mp_group = g
    global _STATE
    _STATE = s


def destroy_model_parallel() -> None:
    global _STATE
    _STATE = _State()


def is_initialized() -> bool:
    return _STATE.initialized


def get_tensor_model_parallel_group():
    return _STATE.tp_group


def get_pipeline_model_parallel_group():
    return _STATE.pp_group


def get_data_parallel_group():
    return _STATE.dp_group


def get_model_parallel_group():
    return _STATE.mp_group


def get_tensor_model_parallel_world_size() -> int:
    return _STATE.tp


def get_pipeline_model_parallel_world_size() -> int:
    return _STATE.pp


def get_data_parallel_world_size() -> int:
    return _STATE.dp


def get_tensor_model_parallel_rank() -> int:
    return _STATE.tp_ranks.index(global_rank()) if _STATE.initialized else 0


def get_pipeline_model_parallel_rank() -> int:
    return _STATE.pp_ranks.index(global_rank()) if _STATE.initialized else 0


def get_data_parallel_rank() -> int:
    return _STATE.dp_ranks.index(global_rank()) if _STATE.initialized else 0
