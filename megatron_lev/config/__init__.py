"""Typed run configuration: dataclasses loaded from YAML, overridden with dotted keys.

A run is described by one `RunConfig` with five sections (model, parallel, data, train,
logging), each a small dataclass in its own module that carries its keys' ranges
(`config/ranges.py`) and its own rules. `load_config(paths, overrides)` (`config/load.py`)
merges YAML files left to right, applies `section.key=value` overrides, type-checks every
value, refuses unknown keys (with a suggestion), and validates the combination before any
heavy work.

The rules here are the generic ones. An embedding variant's own rules belong to its class and
the trainer's to the run: both run in `plan` (`validate_config`, `validate_run`), which
is why this package knows nothing of the model.
"""

from megatron_lev.config.data import TOKENIZER_TYPES, DataConfig
from megatron_lev.config.load import from_dict, load_config, parse_override, set_dotted
from megatron_lev.config.logging import LoggingConfig
from megatron_lev.config.model import LEV_ID_ORDERS, LevConfig, ModelConfig
from megatron_lev.config.parallel import PARTITION_METHODS, ParallelConfig
from megatron_lev.config.ranges import Range
from megatron_lev.config.run import RunConfig, numeric_keys, ranges
from megatron_lev.config.train import (
    GLOBAL_CLIP_GROUP,
    LR_DECAY_STYLES,
    PRECISIONS,
    WSD_DECAY_STYLES,
    ClipGroupRule,
    ParamGroupRule,
    TrainConfig,
)
from megatron_lev.errors import ConfigError

__all__ = [
    "GLOBAL_CLIP_GROUP",
    "LEV_ID_ORDERS",
    "LR_DECAY_STYLES",
    "WSD_DECAY_STYLES",
    "PARTITION_METHODS",
    "PRECISIONS",
    "TOKENIZER_TYPES",
    "ClipGroupRule",
    "ConfigError",
    "DataConfig",
    "LevConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelConfig",
    "ParamGroupRule",
    "Range",
    "RunConfig",
    "TrainConfig",
    "from_dict",
    "load_config",
    "numeric_keys",
    "parse_override",
    "ranges",
    "set_dotted",
]
