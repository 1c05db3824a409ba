"""The `mpu` object DeepSpeed asks for, over the project's process groups (`parallel.state`)."""

from __future__ import annotations

from megatron_lev.parallel import state


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
