"""AdamW with weight-decay groups and a guard that skips non-finite updates.

DeepSpeed wraps this optimizer (ZeRO partitions, bf16 master weights) and calls its
`step()` on every rank at the same iteration; the guard checks the gradients it is
about to apply, agrees across all ranks (all-reduce MAX), and applies nothing —
parameters and Adam moments untouched — when any rank saw inf/NaN.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

NO_DECAY_NAME_PARTS = ("norm", "bias")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: decayed matrices, and undecayed norms, biases and other 1-D parameters."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        lowered = name.lower()
        if param.ndim < 2 or any(part in lowered for part in NO_DECAY_NAME_PARTS):
            no_decay.append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
              {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


class GuardedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` that skips its update on every rank when any rank's gradients are non-finite.

    DeepSpeed may call `step()` several times per iteration (ZeRO steps one parameter
    group at a time); each call checks the gradients it is given and agrees with the
    other ranks. `begin_iteration(force_skip)` resets the per-iteration record (the
    trainer forces a skip when the loss itself was non-finite); `iteration_skipped`
    says afterwards whether anything was held back (or DeepSpeed never called us).
    """

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.begin_iteration()

    def begin_iteration(self, force_skip: bool = False) -> None:
        self.force_skip = force_skip
        self.calls = 0
        self.skipped_calls = 0

    @property
    def iteration_skipped(self) -> bool:
        return self.calls == 0 or self.skipped_calls > 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        if dist.is_initialized() and dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        bad = torch.full((1,), float(self.force_skip), device=device)
        for g in grads:
            bad += (~torch.isfinite(g)).any().to(device=device, dtype=bad.dtype)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item() > 0:
            self.skipped_calls += 1
            return None
        return super().step(closure)
