"""The `logging` section: the output directory, log lines, TensorBoard, W&B, training dynamics."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # [first, last]: a torch.profiler trace of these iterations (and on CUDA a memory snapshot) under
    # output_dir/profile (training/profiler.py); empty: off
    profile_steps: list[int] = field(default_factory=list)
    profile_ranks: list[int] = field(default_factory=lambda: [0])  # the ranks that profile

    def validate(self) -> None:
        check_fields(self, "logging")
        if self.profile_steps and (
            len(self.profile_steps) != 2 or not 1 <= self.profile_steps[0] <= self.profile_steps[1]
        ):
            raise ConfigError(
                f"logging.profile_steps={self.profile_steps}: give [first, last] iterations with "
                "1 <= first <= last, e.g. [20, 24], or [] for no profile"
            )
        if any(r < 0 for r in self.profile_ranks):
            raise ConfigError(f"logging.profile_ranks={self.profile_ranks}: ranks are >= 0, e.g. [0]")
        if self.wandb_mode not in ("online", "offline"):
            raise ConfigError(f"logging.wandb_mode={self.wandb_mode!r}: must be 'online' or 'offline'")
