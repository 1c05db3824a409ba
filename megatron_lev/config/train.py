"""The `train` section: batch, length, schedule, AdamW, clipping, checkpoints, evaluation, and the
optimizer's per-name rules (`train.param_groups`, `train.clip_groups`).

The rules a model variant implies come before these; `plan.param_group_rules` and
`clip_group_rules` join them (the variant's first), for every reader of the optimizer's groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_lev.config.ranges import FRACTION, SEED, K, M, Range, check_fields, count, nonempty, ranged
from megatron_lev.errors import ConfigError, check_choice

PRECISIONS = ("fp32", "bf16", "fp16")
LR_DECAY_STYLES = ("cosine", "linear", "constant", "wsd")
# the shape of WSD's decay stage: from lr to min_lr over its iterations (progress p from 0 to 1)
#   linear 1 - p; cosine (1 + cos(pi p)) / 2; minus_sqrt 1 - sqrt(p) (Hagele et al., 2024)
WSD_DECAY_STYLES = ("linear", "cosine", "minus_sqrt")
GLOBAL_CLIP_GROUP = "global"  # every parameter no clip group names


@dataclass
class ParamGroupRule:
    """Optimizer settings for the parameters whose canonical name matches `pattern` (a shell-style
    glob such as `embedding.*` or `embedding.out_proj`); the first matching rule of
    `train.param_groups` applies."""

    pattern: str = ""
    lr_mult: float = 1.0  # the group's learning rate is the schedule's times this
    weight_decay: float | None = None  # its matrices' decay (1-D, norms, biases: 0); None: train.weight_decay
    adam_eps: float | None = None  # None: train.adam_eps


@dataclass
class ClipGroupRule:
    """The parameters whose canonical name matches one of `patterns` (shell-style globs) are clipped on
    their own gradient norm at `max_norm` and left out of the global norm; the first matching rule of
    `train.clip_groups` takes a parameter."""

    name: str = ""  # an identifier, logged as clip_factor/<name> and grad_norm/clip/<name>
    patterns: list[str] = field(default_factory=list)
    max_norm: float | None = None  # None: train.clip_grad; 0: never clipped (still out of the global norm)


@dataclass
class TrainConfig:
    micro_batch_size: int = ranged(4, count(cap=64 * K))
    # None: micro_batch_size x DP (no accumulation)
    global_batch_size: int | None = ranged(None, count("or null for micro x DP", cap=64 * M))
    train_iters: int | None = ranged(100, count("or null with train.train_tokens or train.chinchilla"))
    train_tokens: int | None = ranged(None, count())  # token budget; converted to iterations
    chinchilla: bool = False  # token budget = 20 tokens per parameter
    lr: float = ranged(
        3e-4,
        Range(
            0,
            lo_open=True,
            cap=1,
            why="the peak learning rate: AdamW moves every weight by about lr per step",
        ),
    )
    min_lr: float = ranged(3e-5, Range(0, cap=1))
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int | None = ranged(None, count(lo=0))
    lr_warmup_fraction: float = ranged(0.01, FRACTION)
    # lr_decay_style=wsd: warm-up, lr held constant, then a decay stage to min_lr over the last
    # lr_wsd_decay_iters iterations (None: lr_wsd_decay_fraction of them), shaped by lr_wsd_decay_style
    lr_wsd_decay_iters: int | None = ranged(None, count("or null for train.lr_wsd_decay_fraction", lo=0))
    lr_wsd_decay_fraction: float = ranged(
        0.1, Range(0, 1, why="the share of the run spent decaying, e.g. 0.1")
    )
    lr_wsd_decay_style: str = "linear"  # one of WSD_DECAY_STYLES
    weight_decay: float = ranged(0.1, Range(0, cap=100))
    adam_beta1: float = ranged(0.9, FRACTION)
    adam_beta2: float = ranged(0.95, FRACTION)
    adam_eps: float = ranged(
        1e-8, Range(0, lo_open=True, cap=1, why="0 divides by zero for rows without gradient")
    )
    clip_grad: float = ranged(1.0, Range(0, why="0 turns clipping off"))
    precision: str = "fp32"
    seed: int = ranged(1234, SEED)
    # a template path, or a name in ds_configs/ (packaged); None: by zero_stage
    ds_config: str | None = nonempty(None)
    save: str | None = nonempty(None)  # checkpoint directory
    load: str | None = nonempty(None)  # checkpoint directory to resume from (default: save)
    # a fresh run's first weights (weights only: fresh optimizer, iteration 0, this run's schedule): a
    # Hugging Face model directory or a checkpoint (tag or save directory); ignored when the run resumes
    init_from: str | None = nonempty(None)
    save_interval: int = ranged(0, count("0 saves only at the end", lo=0))  # 0: only at the end
    save_initial: bool = False  # also save the initial weights (iteration 0), e.g. for `geometry`
    keep_last: int = ranged(2, count())
    # complete a save (the checksums into its `complete` marker, `latest`, pruning) on a background
    # thread while training goes on; the next save, and the end of training, wait for it
    async_save: bool = False
    eval_interval: int = ranged(0, count("0 turns evaluation off", lo=0))
    # save and exit (status 0) at every multiple of this many iterations before the last (Megatron's
    # --exit-interval): a long run in stages, each a prefix of it (the same data order and schedule)
    exit_interval: int = ranged(0, count("0 turns it off", lo=0))
    eval_iters: int = ranged(10, count())
    # non-finite or spike steps in a row before the run stops
    max_consecutive_skips: int = ranged(10, count())
    # spike skipping (engine/spikes.py): a step whose gradient norm or loss is more than spike_zscore
    # standard deviations above its mean over the last spike_window applied steps is not applied; 0: off
    spike_window: int = ranged(0, count("applied steps the mean is over, e.g. 100; 0 turns it off", lo=0))
    spike_zscore: float = ranged(6.0, Range(0, lo_open=True, cap=1e6, why="standard deviations, e.g. 6"))
    # an update growing the global weight norm more stops the run
    max_update_ratio: float | None = ranged(
        2.0,
        Range(
            1, lo_open=True, why="how much one update may grow the weight norm, or null to turn the check off"
        ),
    )
    callbacks: list[str] = field(default_factory=list)  # extra trainer callbacks, "module:Class"
    param_groups: list[ParamGroupRule] = field(default_factory=list)  # per-pattern lr/decay/eps
    clip_groups: list[ClipGroupRule] = field(default_factory=list)  # clipped on their own norm

    def validate(self) -> None:
        check_fields(self, "train")
        for i, spec in enumerate(self.callbacks):
            module, colon, name = spec.partition(":")
            if not colon or not all(p.isidentifier() for p in (*module.split("."), *name.split("."))):
                raise ConfigError(
                    f"train.callbacks[{i}]={spec!r} must be 'module:Class' (an importable module and a "
                    "Callback class in it), e.g. 'my_probes.grad:GradProbe'"
                )
        for i, rule in enumerate(self.param_groups):
            key = f"train.param_groups[{i}]"
            if not rule.pattern.strip():
                raise ConfigError(f"{key}.pattern is empty: give a glob of parameter names, e.g. embedding.*")
            if not rule.lr_mult > 0:
                raise ConfigError(f"{key}.lr_mult={rule.lr_mult} must be > 0 (it scales the learning rate)")
            if rule.weight_decay is not None and rule.weight_decay < 0:
                raise ConfigError(f"{key}.weight_decay={rule.weight_decay} must be >= 0 (0 exempts them)")
            if rule.adam_eps is not None and not rule.adam_eps > 0:
                raise ConfigError(f"{key}.adam_eps={rule.adam_eps} must be > 0")
        seen: set[str] = set()
        for i, rule in enumerate(self.clip_groups):
            key = f"train.clip_groups[{i}]"
            if not rule.name.isidentifier() or rule.name == GLOBAL_CLIP_GROUP:
                raise ConfigError(
                    f"{key}.name={rule.name!r} must be an identifier other than '{GLOBAL_CLIP_GROUP}', "
                    "e.g. 'head'"
                )
            if rule.name in seen:
                raise ConfigError(f"{key}.name={rule.name!r} names two clip groups: give each its own name")
            seen.add(rule.name)
            if not rule.patterns or not all(p.strip() for p in rule.patterns):
                raise ConfigError(
                    f"{key}.patterns is empty: give globs of parameter names, e.g. [embedding.*]"
                )
            if rule.max_norm is not None and not (0 <= rule.max_norm < math.inf):
                raise ConfigError(
                    f"{key}.max_norm={rule.max_norm} must be a finite number >= 0 (0: never clipped; "
                    "leave it out for train.clip_grad)"
                )
        check_choice("train.precision", self.precision, PRECISIONS)
        check_choice("train.lr_decay_style", self.lr_decay_style, LR_DECAY_STYLES)
        check_choice("train.lr_wsd_decay_style", self.lr_wsd_decay_style, WSD_DECAY_STYLES)
        if self.train_iters is None and self.train_tokens is None and not self.chinchilla:
            raise ConfigError("set one of train.train_iters, train.train_tokens or train.chinchilla=true")
        if self.min_lr > self.lr:
            raise ConfigError(
                f"train.min_lr={self.min_lr} is above train.lr={self.lr}: the schedule decays "
                "from lr to min_lr, so min_lr must be <= lr"
            )

    def clip_group_rules(self) -> list[ClipGroupRule]:
        """`train.clip_groups`, each with its threshold resolved (`train.clip_grad` where a rule gives
        none). A model variant's own clip groups go before them (`plan.clip_group_rules`)."""
        return [
            ClipGroupRule(
                rule.name, list(rule.patterns), self.clip_grad if rule.max_norm is None else rule.max_norm
            )
            for rule in self.clip_groups
        ]
