"""Everything that knows DeepSpeed: the engine, its JSON config, the pipeline module, the
checkpoint file layout and the `mpu` shim. The rest of the package talks to `Engine`
(`engine/base.py`: `train_batch`, `eval_batch`, `save`, `load`, ...) and never imports `deepspeed`.
"""

from megatron_lev.engine.base import Engine
from megatron_lev.engine.quiet import quiet_known_warnings

quiet_known_warnings()  # before anything imports DeepSpeed (see engine/quiet.py)

__all__ = ["Engine"]
