"""The `logging` section: the output directory, log lines, TensorBoard, W&B, training dynamics."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lev.config.ranges import M, Range, check_fields, count, nonempty, ranged
from megatron_lev.errors import ConfigError


@dataclass
class LoggingConfig:
    log_interval: int = ranged(10, count())
    output_dir: str = nonempty("runs/default")  # resolved config, logs and TensorBoard go here
    tensorboard: bool = True
    log_all_ranks: bool = False  # every rank also writes logs/rank{N}.log
    # per device, for MFU (H100 dense bf16)
    peak_tflops: float = ranged(989.0, Range(0, lo_open=True, cap=1e6, why="per device, for MFU"))
    progress_bar: bool = True
    # per log line: gradient/update norms per group and input-layer tensor, the input table's shape
    # (training.dynamics); measuring a step keeps a copy of the rank's master weights meanwhile
    train_dynamics: bool = True
    # token ids the input table's statistics are over
    dynamics_sample_ids: int = ranged(
        1024, count("token ids the input table's statistics are over", lo=2, cap=16 * M)
    )
    # mirror the logged values to Weights & Biases (needs `wandb`)
    wandb_project: str | None = nonempty(None)
    wandb_group: str | None = nonempty(None)
    wandb_mode: str = "online"  # "offline": write the run under output_dir/wandb, `wandb sync` it later

    def validate(self) -> None:
        check_fields(self, "logging")
        if self.wandb_mode not in ("online", "offline"):
            raise ConfigError(f"logging.wandb_mode={self.wandb_mode!r}: must be 'online' or 'offline'")
