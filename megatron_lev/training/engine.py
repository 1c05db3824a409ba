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


def build_engine(cfg: RunConfig, model: nn.Module, ds_config: dict, pipeline: bool):
    """Returns `(engine, optimizer)`; the optimizer is the `GuardedAdamW` DeepSpeed wraps."""
    import deepspeed

    t = cfg.train
    optimizer = GuardedAdamW(param_groups(model, t.weight_decay), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2),
                             eps=t.adam_eps)
    mpu = TensorParallelMPU() if not pipeline and cfg.parallel.tensor_model_parallel_size > 1 else None
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=mpu,
                                           dist_init_required=False)
    return engine, optimizer
