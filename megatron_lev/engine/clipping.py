"""Gradient clipping by the true norm, in every layout, and by parameter group: `GradClipper`.

DeepSpeed clips inside each of its optimizers with a norm of its own, and they do not agree: under a
ZeRO-0 pipeline `runtime.utils.clip_grad_norm_` counts a tied table's second copy again and, past
the first stage, only tensor-parallel parameters, so a pipeline run silently trains another model than
one process does. The run's DeepSpeed JSON therefore sets `gradient_clipping` to 0 (`plan.ds_config`)
and this clipper does it, on one code path for every layout:

    clipper = GradClipper(ds_engine, optimizer, groups, rules, clip_grad, device, fp16, layout=layout)
    ... train_batch ...            # inside DeepSpeed's `_take_model_step`: norms, factors, then the step
    clipper.record                 # the last step's `ClipRecord` (device tensors)

It wraps `_take_model_step`, the one place every layout passes once per optimizer step, after the
gradients are reduced over data-parallel ranks (and between the stages that hold a tied table) and
before the optimizer steps (`engine.step_probe` explains what a rank holds there and how each part of
a full tensor is counted once). Each rank adds up its squared gradient norms by clip group: the global
group (every parameter no rule names) and one per `plan.clip_group_rules`. One all-reduce
(sum) over all ranks of that short vector gives the full norms, the same on every rank, and each
group's factor `min(1, max_norm / (norm + 1e-6))` (1 where max_norm is 0). The factors go to the
optimizer (`GuardedAdamW.grad_factors`), which multiplies each parameter group's gradients by its clip
group's factor before its update, on the device: no host read. The global norm of the step (`record.
full`, every group together) is what the run logs as `grad_norm` and `grad_norm/global`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatron_lev.config import GLOBAL_CLIP_GROUP
from megatron_lev.engine.step_probe import counted, holding, local_grad, squared_norms
from megatron_lev.parallel.layout import ParallelLayout

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_ and DeepSpeed: max_norm / (norm + EPS)


@dataclass
class ClipRecord:
    """One optimizer step's clipping: float64 device tensors `(len(names),)`, names[0] the global group.

    `norms`: each clip group's gradient norm (full tensors, unscaled, before clipping); `factors`:
    what its gradients were multiplied by; `full`: `()` the norm of every parameter together."""

    names: tuple[str, ...]
    norms: torch.Tensor
    factors: torch.Tensor
    full: torch.Tensor


class GradClipper:
    """Clips every optimizer step of `ds_engine` by clip group (see the module doc)."""

    def __init__(
        self,
        ds_engine: Any,
        optimizer: Any,
        groups: Sequence[tuple[int, Sequence[nn.Parameter]]],
        rules: Sequence,
        clip_grad: float,
        device: torch.device,
        fp16: bool = False,
        *,
        layout: ParallelLayout,
    ) -> None:
        """`groups`: `(clip index, parameters)` of each optimizer group (index 0: global, i: rules[i-1]);
        `rules`: `plan.clip_group_rules`; `clip_grad`: the global group's threshold (0: off);
        `layout`: this rank's parallel layout (which copy of a tensor this rank counts)."""
        if not hasattr(ds_engine, "_take_model_step"):
            raise RuntimeError(
                "this DeepSpeed version has no DeepSpeedEngine._take_model_step: the run cannot clip "
                "its gradients by the true norm"
            )
        self.ds_engine, self.optimizer, self.device, self.fp16 = ds_engine, optimizer, device, fp16
        self.layout = layout
        self.groups = [(int(clip), list(params)) for clip, params in groups]
        self.names = (GLOBAL_CLIP_GROUP, *(rule.name for rule in rules))
        thresholds = [float(clip_grad), *(float(rule.max_norm) for rule in rules)]
        self.max_norms = torch.tensor(thresholds, dtype=torch.float64, device=device)
        self.clips = self.max_norms > 0
        self.record: ClipRecord | None = None
        self._entries: list[tuple[nn.Parameter, str]] | None = None
        self._rows: torch.Tensor | None = None
        self.spikes = None  # an `engine.spikes.SpikeDetector` when train.spike_window is set
        self.pending_loss: torch.Tensor | None = None  # the step's loss, where known before its update
        step = ds_engine._take_model_step

        def take_model_step(*args, **kwargs):
            self._measure()
            if self.spikes is not None:  # decided on the device; the guard's one read carries it
                self.optimizer.spike_flag = self.spikes.check(self.record.full, self.pending_loss)
            return step(*args, **kwargs)

        ds_engine._take_model_step = take_model_step

    def _layout(self) -> None:
        """This rank's counted parameters and the row (clip group) each adds to; built at the first step,
        when DeepSpeed has linked its partitions."""
        tp_rank, dp_rank = self.layout.tp_rank, self.layout.dp_rank
        entries, rows, seen = [], [], set()
        for clip, params in self.groups:
            for p in params:
                kind = holding(p)
                if id(p) in seen or not p.requires_grad or not counted(p, kind, tp_rank, dp_rank):
                    continue
                seen.add(id(p))
                entries.append((p, kind))
                rows.append(clip)
        self._entries = entries
        self._rows = torch.tensor(rows, dtype=torch.long, device=self.device)

    def _measure(self) -> None:
        if self._entries is None:
            self._layout()
        grads = [local_grad(p, kind) for p, kind in self._entries]
        has = [i for i, g in enumerate(grads) if g is not None]
        sums = torch.zeros(len(self.names), dtype=torch.float64, device=self.device)
        if has:
            squares = squared_norms([grads[i] for i in has], self.device)
            sums.index_add_(0, self._rows[torch.tensor(has, device=self.device)], squares)
        if self.fp16:
            scale = self.ds_engine._get_optimizer_loss_scale() or 1.0
            sums = sums / float(scale) ** 2
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)
        norms = sums.sqrt()
        factors = torch.where(
            self.clips, (self.max_norms / (norms + EPS)).clamp(max=1.0), torch.ones_like(norms)
        )
        self.optimizer.grad_factors = factors
        self.record = ClipRecord(self.names, norms, factors, sums.sum().sqrt())

    def disable_engine_clipping(self) -> None:
        """Set DeepSpeed's own clipping threshold back to 0 where its optimizer keeps one: loading a
        checkpoint saved by a run that let DeepSpeed clip restores the old value into it."""
        optimizer = self.ds_engine.optimizer
        if getattr(optimizer, "clip_grad", 0):
            optimizer.clip_grad = 0.0


__all__ = ["EPS", "ClipRecord", "GradClipper"]
