"""Pretraining: the loop, its callbacks, checkpoint directories, preemption and logging.

`run.pretrain(plan)` is the entry point (`megatron-lev train` validates into the `RunPlan` it
takes, `plan.validate_run`), in three parts: `setup`, `build`, `fit`; `trainer.Trainer`
is the loop and `callbacks` what it does besides stepping; `schedule`, `resume`,
`signals`, `health`, `metrics`, `dynamics` (what each step does to the weights, per log
line), `launch` and `wandb_logger` are its parts, one idea each.
The engine that runs the steps (DeepSpeed) is `megatron_lev.engine`; the checkpoint directory
format is `megatron_lev.ckpt`, the optimizer `megatron_lev.optim`, the micro-batches
`megatron_lev.data.batches`.
"""

from megatron_lev.training.signals import PREEMPTED_EXIT_CODE

__all__ = ["PREEMPTED_EXIT_CODE"]
