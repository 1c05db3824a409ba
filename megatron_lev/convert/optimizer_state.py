"""Adam's moments across a reshard: merge them like the parameters they belong to.

`exp_avg` and `exp_avg_sq` have their parameter's shape, so they merge and split with the
parameter's own TP rules (`model.canonical`); `step` is one count for the whole run. The
engine's reader (`engine.optimizer_files`) finds them in the checkpoint's files.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_lev.convert.merge import merge_shards
from megatron_lev.convert.source import SourceCheckpoint
from megatron_lev.engine.checkpoint_files import CheckpointError
from megatron_lev.engine.optimizer_files import MOMENTS, local_states
from megatron_lev.model.canonical import parameter_specs


@dataclass
class OptimizerState:
    """The merged (TP = 1, canonical names) Adam state of a checkpoint."""

    step: torch.Tensor  # AdamW's step count (a 0-d tensor)
    moments: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> {exp_avg, exp_avg_sq}
    master: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> fp32 master weight (ZeRO-1/2)


def read_optimizer_state(src: SourceCheckpoint) -> OptimizerState:
    """The source's Adam state, merged over DP partitions, pipeline stages and TP ranks."""
    by_name: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    steps = set()
    for (mp, name), entry in local_states(src).items():
        steps.add(float(entry["step"]))
        by_name.setdefault(name, {}).setdefault(mp % src.files.tp, entry)  # tied copies: the first stage's
    if len(steps) != 1:
        raise CheckpointError(
            f"{src.tag_dir}: the optimizer's step differs between parameters ({sorted(steps)})"
        )
    params = parameter_specs(src.specs)  # buffers (LEV's token order) have no optimizer state
    unknown = sorted(set(by_name) - set(params))
    if unknown:
        raise CheckpointError(
            f"{src.tag_dir}: optimizer state for {len(unknown)} parameter(s) the model does not have, "
            f"e.g. {unknown[:3]}: the checkpoint is from another model"
        )
    missing = sorted(set(params) - set(by_name))
    if missing:
        raise CheckpointError(
            f"{src.tag_dir}: no optimizer state for {len(missing)} parameter(s), e.g. {missing[:3]}"
        )
    out = OptimizerState(step=torch.tensor(steps.pop(), dtype=torch.float32))
    for name, ranks in by_name.items():
        spec = src.specs[name]
        if sorted(ranks) != list(range(src.files.tp)):
            raise CheckpointError(
                f"{src.tag_dir}: optimizer state of {name} for TP ranks {sorted(ranks)} only"
            )
        parts = [ranks[r] for r in range(src.files.tp)]
        out.moments[name] = {
            k: merge_shards([p[k] for p in parts], spec, check_replicas=False) for k in MOMENTS
        }
        if all("master" in p for p in parts):
            out.master[name] = merge_shards([p["master"] for p in parts], spec, check_replicas=False)
    return out
