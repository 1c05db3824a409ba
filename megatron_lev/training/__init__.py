"""Pretraining on DeepSpeed: config building, the loop, checkpoints, preemption and logging.

`run.pretrain(cfg)` is the entry point (used by `megatron-lev train`); `trainer.Trainer`
is the loop; `ds_config`, `schedule`, `checkpointing`, `signals`, `health`, `metrics`,
`optim`, `engine`, `batches` and `launch` are its parts, one idea each.
"""

from megatron_lev.training.signals import PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE"]
