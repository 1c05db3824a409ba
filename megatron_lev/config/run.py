"""`RunConfig`: the five sections of a run and the rules across them.

Each section checks its own keys (`ModelConfig.validate`, ...); `RunConfig.validate` runs them and
the rules that join sections (the model against the TP and PP sizes, the batch against the world).
A model variant's own rules belong to its class and run with these in `plan`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from megatron_lev.config.data import DataConfig
from megatron_lev.config.logging import LoggingConfig
from megatron_lev.config.model import ModelConfig
from megatron_lev.config.parallel import ParallelConfig
from megatron_lev.config.ranges import Range, field_ranges, numeric_fields
from megatron_lev.config.train import TrainConfig
from megatron_lev.errors import ConfigError
from megatron_lev.utils.io import atomic_write_text


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> RunConfig:
        """Check every section and the combinations.

        The generic rules only: the embedding variant's own rules belong to its class, and the layout
        of a world size (TP x PP x DP, the batch over DP) to `parallel.layout` and the plan; both run
        with these in `plan.validate_config` / `validate_run`."""
        for section in (self.model, self.parallel, self.data, self.train, self.logging):
            section.validate()
        m, p, t = self.model, self.parallel, self.train
        tp = p.tensor_model_parallel_size
        if m.num_attention_heads % tp:
            raise ConfigError(
                f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
                f"parallel.tensor_model_parallel_size={tp}: choose a TP size that divides the heads"
            )
        if m.kv_heads % tp:
            raise ConfigError(
                f"model.num_kv_heads={m.kv_heads} is not divisible by "
                f"parallel.tensor_model_parallel_size={tp}"
            )
        if m.ffn_size % tp:
            raise ConfigError(
                f"model ffn size {m.ffn_size} is not divisible by parallel.tensor_model_parallel_size={tp}"
            )
        if p.pipeline_model_parallel_size > m.num_layers:
            raise ConfigError(
                f"parallel.pipeline_model_parallel_size={p.pipeline_model_parallel_size} exceeds "
                f"model.num_layers={m.num_layers}: every pipeline stage needs at least one block"
            )
        if t.precision == "bf16" and p.pipeline_model_parallel_size > 1 and p.zero_stage == 0:
            raise ConfigError(
                "train.precision=bf16 with pipeline parallelism needs parallel.zero_stage=1 "
                "(DeepSpeed cannot reload bf16 + pipeline + ZeRO-0 optimizer state)"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, directory: str | os.PathLike) -> Path:
        """Write the resolved config as `config.yaml` atomically; returns the path."""
        path = Path(directory) / "config.yaml"
        atomic_write_text(path, self.to_yaml())
        return path


def ranges() -> dict[str, Range]:
    """`{dotted key: Range}` of every numeric key of the run config, read from its sections."""
    return field_ranges(RunConfig)


def numeric_keys() -> list[str]:
    """Dotted names of every int/float key of the run config (each must have a range: `ranges()`)."""
    return numeric_fields(RunConfig)
