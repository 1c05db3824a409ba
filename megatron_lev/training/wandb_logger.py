"""Mirror the run's logged values to Weights & Biases (optional: `pip install wandb`).

On when `logging.wandb_project` is set; rank 0 logs. `logging.wandb_mode: offline` writes the
run under `<output_dir>/wandb/` without a network (upload later with `wandb sync <dir>`), which
is also how clusters without outbound access use it. The W&B run id is derived from the output
directory, so a requeued or resumed job continues the same W&B run.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from megatron_lev.config import RunConfig
from megatron_lev.errors import ConfigError
from megatron_lev.training.hooks import Callback, Control


def run_id(output_dir: str) -> str:
    """A stable W&B run id for one output directory (the same across resumes)."""
    return hashlib.sha256(str(Path(output_dir).resolve()).encode()).hexdigest()[:16]


class WandbLogger(Callback):
    """Logs every log line's values under `train/`, validations under `valid/`, x-axis the iteration."""

    def __init__(self, cfg: RunConfig) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "logging.wandb_project is set but the wandb package is not installed: pip install wandb, "
                "or unset logging.wandb_project"
            ) from None
        self.cfg, self._wandb, self.run = cfg, wandb, None

    def on_train_begin(self, trainer, control: Control) -> None:
        lg = self.cfg.logging
        out = Path(lg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.run = self._wandb.init(
            project=lg.wandb_project,
            group=lg.wandb_group,
            name=self.cfg.model.name,
            id=run_id(lg.output_dir),
            resume="allow",
            dir=str(out),
            mode=lg.wandb_mode,
            config=self.cfg.to_dict(),
        )

    def on_log(self, trainer, iteration: int, values: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({f"train/{k}": v for k, v in values.items()}, step=iteration)

    def on_validation(self, trainer, iteration: int, metrics: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log({f"valid/{k}": v for k, v in metrics.items()}, step=iteration)

    def on_close(self, trainer) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
