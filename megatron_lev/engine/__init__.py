"""Everything that knows DeepSpeed's objects: the engine, the pipeline module, the checkpoint file
layout, the step probe and the `mpu` shim (the run's DeepSpeed JSON is plain data, built by `plan`).
The rest of the package talks to `Engine` (`engine/base.py`: `train_batch`, `eval_batch`, `save`,
`load`, ...) and never imports `deepspeed`.
"""

from megatron_lev.engine.base import Engine
from megatron_lev.engine.silenced_warnings import quiet_known_warnings

quiet_known_warnings()  # before anything imports DeepSpeed (see engine/silenced_warnings.py)

__all__ = ["Engine"]
