"""`deepspeed.initialize` over the model, with our AdamW and the run's DeepSpeed JSON.

The plain model (PP = 1) runs under ZeRO 0-3 (optionally CPU offload); a
`PipelineModule` (PP > 1) under ZeRO 0/1. The optimizer is always a torch AdamW
(`optim.GuardedAdamW`) passed in, so no DeepSpeed op is compiled at start.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from megatron_lev.config import RunConfig
from megatron_lev.parallel import state
from megatron_lev.training.optim import GuardedAdamW, param_groups

GROUP_FILLER = "param_group_filler"


def disable_cpu_shm_comm() -> None:
    """Keep DeepSpeed from compiling its shared-memory all-reduce op on CPU (gloo suffices).

    `MEGATRON_LEV_CPU_SHM=1` keeps the op (faster CPU all-reduce, ~40 s g++ build the first time).
    """
    if torch.cuda.is_available() or os.environ.get("MEGATRON_LEV_CPU_SHM") == "1":
        return
    import deepspeed.ops as ds_ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        ds_ops.__compatible_ops__[builder.NAME] = False


class TensorParallelMPU:
    """The `mpu` object DeepSpeed asks for (model-parallel = tensor-parallel groups when PP = 1)."""

    get_model_parallel_rank = staticmethod(state.get_tensor_model_parallel_rank)
    get_model_parallel_world_size = staticmethod(state.get_tensor_model_parallel_world_size)
    get_model_parallel_group = staticmethod(state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_rank = staticmethod(state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(state.get_tensor_model_parallel_group)
    get_data_parallel_rank = staticmethod(state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(state.get_data_parallel_group)
    get_pipeline_model_parallel_rank = staticmethod(state.get_pipeline_model_parallel_rank)
    get_pipeline_model_parallel_world_size = staticmethod(state.get_pipeline_model_parallel_world_size)
    get_pipeline_model_parallel_group = staticmethod(state.get_pipeline_model_parallel_group)


def uses_zero_optimizer_per_group(ds_config: dict) -> bool:
    """Whether DeepSpeed wraps the optimizer in its ZeRO-1/2 optimizer, which works group by group.

    bf16 with fp32 gradient accumulation under ZeRO-1 (the pipeline template) gets DeepSpeed's
    BF16 optimizer instead, which reduces one norm over all groups and steps once.
    """
    stage = (ds_config.get("zero_optimization") or {}).get("stage", 0)
    bf16 = (ds_config.get("bf16") or {}).get("enabled", False)
    fp32_accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype") == "fp32"
    return stage in (1, 2) and not (stage == 1 and bf16 and fp32_accum)


def same_groups_on_every_stage(model: nn.Module, groups: list[dict]) -> list[dict]:
    """Give an empty group a one-element zero parameter (no gradient, saved in no layer file).

    DeepSpeed's ZeRO-1/2 optimizer all-reduces one gradient norm per parameter group over
    the model-parallel group, and the guard agrees once per group: under a pipeline, a stage
    without, say, any 1-D parameter would issue fewer collectives than the others and every
    rank would wait forever at the first step. With the filler every stage has both groups.
    """
    reference = next(model.parameters())
    for group in groups:
        if not group["params"]:
            filler = nn.Parameter(torch.zeros(1, dtype=reference.dtype, device=reference.device))
            model.register_parameter(GROUP_FILLER, filler)
            group["params"].append(filler)
    return [g for g in groups if g["params"]]


def build_engine(cfg: RunConfig, model: nn.Module, ds_config: dict, pipeline: bool):
    """Returns `(engine, optimizer)`; the optimizer is the `GuardedAdamW` DeepSpeed wraps."""
    import deepspeed

    t = cfg.train
    groups = param_groups(model, t.weight_decay, keep_empty=pipeline)
    if pipeline and uses_zero_optimizer_per_group(ds_config):
        groups = same_groups_on_every_stage(model, groups)
    groups = [g for g in groups if g["params"]]
    optimizer = GuardedAdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    mpu = TensorParallelMPU() if not pipeline and cfg.parallel.tensor_model_parallel_size > 1 else None
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=ds_config, mpu=mpu, dist_init_required=False
    )
    return engine, optimizer
