"""The `parallel` section: tensor, pipeline and ZeRO degrees, the backend and its timeouts.

How these sizes divide the model and the world is a rule across sections (`RunConfig.validate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lev.config.ranges import K, Range, check_fields, count, ranged
from megatron_lev.errors import ConfigError, check_choice

PARTITION_METHODS = ("parameters", "uniform")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = ranged(1, count(cap=4 * K))
    pipeline_model_parallel_size: int = ranged(1, count(cap=4 * K))
    partition_method: str = "parameters"  # how blocks are split across pipeline stages
    zero_stage: int = ranged(1, Range(0, 3, why="the ZeRO stage 0, 1, 2 or 3"))
    cpu_offload: bool = False  # ZeRO-3 parameter + optimizer offload to CPU
    distributed_backend: str | None = None  # None: nccl on CUDA, gloo on CPU
    # seconds the rendezvous and any collective may wait before every rank stops (docs/training.md)
    collective_timeout_s: float = ranged(
        600.0, Range(1, why="seconds the rendezvous and any collective may wait, e.g. 600")
    )
    # seconds a rank may stay silent (no heartbeat) before the watchdog ends the job; 0: no watchdog
    heartbeat_timeout_s: float = ranged(
        300.0, Range(0, why="seconds a rank may stay silent before the job ends; 0 turns the watchdog off")
    )

    def validate(self) -> None:
        check_fields(self, "parallel")
        check_choice("parallel.partition_method", self.partition_method, PARTITION_METHODS)
        if self.pipeline_model_parallel_size > 1 and self.zero_stage > 1:
            raise ConfigError(
                f"parallel.zero_stage={self.zero_stage} cannot be combined with pipeline parallelism "
                f"(parallel.pipeline_model_parallel_size={self.pipeline_model_parallel_size}): DeepSpeed "
                "shards gradients across micro-batches only with ZeRO 0/1 under a pipeline. "
                "Use parallel.zero_stage=1, or parallel.pipeline_model_parallel_size=1 for ZeRO-2/3."
            )
        if self.cpu_offload and self.zero_stage != 3:
            raise ConfigError("parallel.cpu_offload=true needs parallel.zero_stage=3")
        if 0 < self.heartbeat_timeout_s < 1:
            raise ConfigError(
                f"parallel.heartbeat_timeout_s={self.heartbeat_timeout_s:g} is too short: it must be "
                "at least 1 (seconds; a rank beats every tenth of it), or 0 to turn the watchdog off"
            )
        if self.distributed_backend not in (None, "nccl", "gloo"):
            raise ConfigError(
                f"parallel.distributed_backend must be nccl or gloo, got {self.distributed_backend}"
            )
