"""AdamW with weight-decay groups and a guard that skips non-finite updates.

DeepSpeed wraps this optimizer (ZeRO partitions, bf16 master weights) and calls its
`step()` on every rank at the same iteration; the guard checks the gradients it is
about to apply with one fused test, agrees across all ranks (one all-reduce MAX per
call), and applies nothing — parameters and Adam moments untouched — when any rank
saw inf/NaN. Every rank must therefore call `step()` equally often: see
`engine.deepspeed_engine.same_groups_on_every_stage`.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

NO_DECAY_NAME_PARTS = ("norm", "bias")
GROUP_NAMES = ("decay", "no_decay")


def all_finite(tensors) -> torch.Tensor:
    """One bool tensor: every element of every tensor is finite (one fused max-abs, no host sync).

    The max-abs of finite numbers is finite (unlike a sum or a 2-norm, it cannot overflow), and
    a NaN anywhere makes it NaN. `torch._foreach_norm` (one multi-tensor kernel per device and
    dtype on CUDA) is used rather than `torch.nn.utils.get_total_norm`, which needs torch >= 2.6.
    """
    tensors = [t.detach() for t in tensors if t is not None and t.numel()]
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    device = tensors[0].device
    maxima = [
        torch.stack(torch._foreach_norm(group, math.inf)).amax().float().to(device)
        for group in groups.values()
    ]
    return torch.isfinite(torch.stack(maxima).amax())


def squared_norm(tensors) -> torch.Tensor:
    """One float32 tensor: the sum of squares of every element of every tensor (no host sync).

    One `torch._foreach_norm` per device and dtype (accumulated in float32, also for bf16 tensors),
    like `all_finite`; the result is inf when the tensors are so large that the sum overflows, and
    NaN when one of them is.
    """
    tensors = [t.detach() for t in tensors if t is not None and t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float32)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    device = tensors[0].device
    sums = [
        torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).pow(2).sum().to(device)
        for group in groups.values()
    ]
    return torch.stack(sums).sum()


def decays(name: str, ndim: int) -> bool:
    """Whether weight decay applies: matrices, except those named like a norm or a bias."""
    return ndim >= 2 and not any(part in name.lower() for part in NO_DECAY_NAME_PARTS)


CLIP_SEPARATOR = "@"  # `decay@lev_seed`: the `decay` parameters of clip group `lev_seed`


def clip_group_of(name: str, clip_rules: Sequence = ()) -> str | None:
    """The clip group (`train.clip_groups`, `plan.clip_group_rules`) of parameter `name`: the
    first rule with a pattern that matches it, None for the global group."""
    for rule in clip_rules:
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in rule.patterns):
            return rule.name
    return None


def group_name(name: str, ndim: int, rules: Sequence = (), clip_rules: Sequence = ()) -> str:
    """The optimizer group of parameter `name`: `decay` / `no_decay`, or `rule<i>.decay` /
    `rule<i>.no_decay` for the first of `rules` (`train.param_groups`) whose pattern matches it;
    followed by `@<clip group>` when a clip rule takes it (a group is clipped as one)."""
    kind = "decay" if decays(name, ndim) else "no_decay"
    base = kind
    for i, rule in enumerate(rules):
        if fnmatch.fnmatchcase(name, rule.pattern):
            base = f"rule{i}.{kind}"
            break
    clip = clip_group_of(name, clip_rules)
    return base if clip is None else f"{base}{CLIP_SEPARATOR}{clip}"


def group_names(rules: Sequence = (), clip_rules: Sequence = ()) -> list[str]:
    """Every group name, in the optimizer's order: the two default groups, then two per rule; each of
    them again for every clip group."""
    bases = [*GROUP_NAMES, *(f"rule{i}.{kind}" for i in range(len(rules)) for kind in GROUP_NAMES)]
    return bases + [f"{b}{CLIP_SEPARATOR}{c.name}" for c in clip_rules for b in bases]


def param_groups(
    model: nn.Module,
    weight_decay: float,
    keep_empty: bool = False,
    rules: Sequence = (),
    canonical: Callable[[str], str] = str,
    clip_rules: Sequence = (),
) -> list[dict]:
    """Decayed matrices and undecayed norms, biases and other 1-D parameters; with `rules`
    (`train.param_groups`), two more groups per rule, each with its `lr_mult` (read by the engine's
    `set_lr`), weight decay and Adam epsilon.

    `canonical` maps a module's parameter name to the model's canonical one (a pipeline prefixes
    its layer index), which the rules' patterns match. An empty group is dropped unless `keep_empty`
    (the caller then fills it).

    With `clip_rules` (`plan.clip_group_rules`) every group is split by clip group: a group's
    `clip` is the index of its clip group in `["global", *clip_rules]`, which the engine's clipper
    reads.
    """
    members: dict[str, list] = {name: [] for name in group_names(rules, clip_rules)}
    for name, param in model.named_parameters():
        if param.requires_grad:
            members[group_name(canonical(name), param.ndim, rules, clip_rules)].append(param)
    clip_index = {rule.name: i + 1 for i, rule in enumerate(clip_rules)}
    groups = []
    for name, params in members.items():
        base, _, clip = name.partition(CLIP_SEPARATOR)
        rule = rules[int(base[4 : base.index(".")])] if base.startswith("rule") else None
        decay = weight_decay if rule is None or rule.weight_decay is None else rule.weight_decay
        matrices = not base.endswith("no_decay")
        group = {"params": params, "weight_decay": decay if matrices else 0.0, "name": name}
        if clip_rules:
            group["clip"] = clip_index[clip] if clip else 0
        if rule is not None:
            group["lr_mult"] = rule.lr_mult
            if rule.adam_eps is not None:
                group["eps"] = rule.adam_eps
        groups.append(group)
    return groups if keep_empty else [g for g in groups if g["params"]]


class GuardedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` that skips its update on every rank when any rank's gradients are non-finite.

    DeepSpeed may call `step()` several times per iteration (ZeRO steps one parameter
    group at a time); each call checks the gradients it is given and agrees with the
    other ranks. `begin_iteration(force_skip)` resets the per-iteration record (the
    trainer forces a skip when the loss itself was non-finite: a bool, or a bool tensor
    folded into the flag on the device, so the trainer never waits for the loss);
    `iteration_skipped` says afterwards whether anything was held back (or DeepSpeed
    never called us). The flag's one read per call is the step's only host sync here.

    Clipping: `grad_factors`, when set (the engine's `GradClipper` sets it before every step), is a
    device vector of clip factors; each group's gradients are multiplied by the factor of its clip
    group (`group["clip"]`, 0 when absent: the global group) before the update, on the device.
    """

    def __init__(self, params, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.grad_factors: torch.Tensor | None = None
        self.begin_iteration()

    def begin_iteration(self, force_skip: bool | torch.Tensor = False) -> None:
        self.force_skip = force_skip
        self.calls = 0
        self.skipped_calls = 0
        # a () bool device tensor set before the step (engine.spikes): a loss or gradient-norm spike
        self.spike_flag: torch.Tensor | None = None
        self.spiked = False  # the held-back update was a spike's (finite gradients and loss)

    @property
    def iteration_skipped(self) -> bool:
        return self.calls == 0 or self.skipped_calls > 0

    def _flag_device(self, grads: list[torch.Tensor]) -> torch.device:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return grads[0].device if grads else torch.device("cpu")

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        bad = (~all_finite(grads)).to(device=self._flag_device(grads), dtype=torch.float32).reshape(1)
        if isinstance(self.force_skip, torch.Tensor):
            bad = torch.maximum(bad, self.force_skip.to(device=bad.device, dtype=bad.dtype).reshape(1))
        elif self.force_skip:
            bad.fill_(1.0)
        if self.spike_flag is not None:  # the same one read: [non-finite or forced, spike]
            bad = torch.cat([bad, self.spike_flag.to(device=bad.device, dtype=bad.dtype).reshape(1)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        flags = bad.tolist()
        if max(flags) > 0:
            self.skipped_calls += 1
            self.spiked = self.spiked or flags[0] == 0
            return None
        if self.grad_factors is not None:
            self._clip(self.grad_factors)
        return super().step(closure)

    def _clip(self, factors: torch.Tensor) -> None:
        """Multiply each group's gradients by its clip group's factor (one foreach kernel per group,
        device and dtype; the factor is moved to the gradients' device only where they live elsewhere,
        as under CPU offload)."""
        for group in self.param_groups:
            by_kind: dict[tuple, list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is not None:
                    by_kind.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
            factor = factors[group.get("clip", 0)]
            for (device, dtype), grads in by_kind.items():
                torch._foreach_mul_(grads, factor.to(device=device, dtype=dtype))
