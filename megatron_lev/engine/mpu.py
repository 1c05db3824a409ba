"""The `mpu` object DeepSpeed asks for: a read-only adapter over the run's `ParallelLayout`."""

from __future__ import annotations

from megatron_lev.parallel.layout import ParallelLayout


class TensorParallelMPU:
    """The `mpu` object DeepSpeed asks for, answering from the `layout` it is given (model-parallel =
    tensor-parallel groups when PP = 1). It needs the layout's process groups."""

    def __init__(self, layout: ParallelLayout):
        if not layout.has_groups:
            raise ValueError(
                "DeepSpeed's mpu needs process groups: pass the layout initialize_model_parallel made"
            )
        self._layout = layout

    @property
    def layout(self) -> ParallelLayout:
        return self._layout

    def get_model_parallel_rank(self) -> int:
        return self._layout.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self._layout.tp

    def get_model_parallel_group(self):
        return self._layout.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_rank(self) -> int:
        return self._layout.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self._layout.dp

    def get_data_parallel_group(self):
        return self._layout.dp_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._layout.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._layout.pp

    def get_pipeline_model_parallel_group(self):
        return self._layout.pp_group
