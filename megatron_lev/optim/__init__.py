"""The optimizer: AdamW with weight-decay groups and a guard that skips non-finite updates."""

from megatron_lev.optim.adamw import (
    CLIP_SEPARATOR,
    GROUP_NAMES,
    NO_DECAY_NAME_PARTS,
    GuardedAdamW,
    all_finite,
    clip_group_of,
    decays,
    group_name,
    group_names,
    param_groups,
    squared_norm,
)

__all__ = [
    "CLIP_SEPARATOR",
    "GROUP_NAMES",
    "NO_DECAY_NAME_PARTS",
    "GuardedAdamW",
    "all_finite",
    "clip_group_of",
    "decays",
    "group_name",
    "group_names",
    "param_groups",
    "squared_norm",
]
