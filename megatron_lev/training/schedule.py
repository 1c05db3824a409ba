"""Training length and learning rate as pure functions of the iteration.

Keeping the LR a function of the iteration (not an object with state) makes resume
exact by construction: the checkpoint stores the iteration and nothing else is needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lev.config import TrainConfig
from megatron_lev.errors import ConfigError

CHINCHILLA_TOKENS_PER_PARAM = 20


@dataclass(frozen=True)
class Budget:
    train_iters: int
    tokens_per_iter: int  # global batch x sequence length
    source: str  # which setting fixed the length, for the log

    @property
    def train_tokens(self) -> int:
        return self.train_iters * self.tokens_per_iter


def training_budget(train: TrainConfig, global_batch: int, seq_length: int, n_params: int) -> Budget:
    """Iterations from (in order of precedence) train.chinchilla, train.train_tokens, train.train_iters."""
    tokens_per_iter = global_batch * seq_length
    if train.chinchilla:
        tokens = CHINCHILLA_TOKENS_PER_PARAM * n_params
        return Budget(
            max(1, math.ceil(tokens / tokens_per_iter)),
            tokens_per_iter,
            f"chinchilla: {CHINCHILLA_TOKENS_PER_PARAM} x {n_params:,} parameters = {tokens:,} tokens",
        )
    if train.train_tokens is not None:
        if train.train_tokens <= 0:
            raise ConfigError(f"train.train_tokens must be positive, got {train.train_tokens}")
        return Budget(
            max(1, math.ceil(train.train_tokens / tokens_per_iter)),
            tokens_per_iter,
            f"train.train_tokens={train.train_tokens:,}",
        )
    if train.train_iters is None or train.train_iters <= 0:
        raise ConfigError(f"train.train_iters must be positive, got {train.train_iters}")
    return Budget(train.train_iters, tokens_per_iter, f"train.train_iters={train.train_iters}")


def warmup_iters(train: TrainConfig, total_iters: int) -> int:
    if train.lr_warmup_iters is not None:
        if train.lr_warmup_iters < 0:
            raise ConfigError(f"train.lr_warmup_iters must be >= 0, got {train.lr_warmup_iters}")
        return train.lr_warmup_iters
    return int(round(train.lr_warmup_fraction * total_iters))


def wsd_decay_iters(train: TrainConfig, total_iters: int) -> int:
    """Iterations of WSD's decay stage: train.lr_wsd_decay_iters, else that fraction of the run."""
    if train.lr_wsd_decay_iters is not None:
        return min(train.lr_wsd_decay_iters, total_iters)
    return int(round(train.lr_wsd_decay_fraction * total_iters))


def _decay_factor(style: str, progress: float) -> float:
    """From 1 at progress 0 to 0 at progress 1."""
    if style == "linear":
        return 1.0 - progress
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def learning_rate(iteration: int, train: TrainConfig, total_iters: int) -> float:
    """LR for the update that produces iteration `iteration + 1` (0-based: the first update uses it=0).

    Linear warmup from lr/warmup to lr over the warmup iterations, then cosine, linear
    or constant decay to min_lr at `total_iters`, min_lr afterwards. `wsd` (warmup-stable-decay):
    lr until the last `wsd_decay_iters` iterations, which decay it to min_lr in the shape of
    train.lr_wsd_decay_style; a constant-rate checkpoint of such a run branches into its own decay
    by a resume with a shorter train.train_iters (the rate before the checkpoint is unchanged).
    """
    warm = warmup_iters(train, total_iters)
    if warm > 0 and iteration < warm:
        return train.lr * (iteration + 1) / warm
    if train.lr_decay_style == "constant":
        return train.lr
    if train.lr_decay_style == "wsd":
        decay = wsd_decay_iters(train, total_iters)
        start = max(total_iters - decay, warm)
        if iteration < start:
            return train.lr
        progress = min(1.0, (iteration - start + 1) / max(1, total_iters - start))
        return train.min_lr + (train.lr - train.min_lr) * _decay_factor(train.lr_wsd_decay_style, progress)
    decay_iters = max(1, total_iters - warm)
    progress = min(1.0, (iteration - warm) / decay_iters)
    factor = _decay_factor(train.lr_decay_style, progress)
    return train.min_lr + (train.lr - train.min_lr) * factor
