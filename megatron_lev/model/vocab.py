"""The model's vocabulary: the tokenizer's, padded so that every tensor-parallel rank holds
the same number of rows (the padding rows are left out of the loss)."""

from __future__ import annotations

from megatron_lev.config import ModelConfig
from megatron_lev.errors import ConfigError


def padded_vocab_size(tokenizer_vocab_size: int, model_cfg: ModelConfig, tp: int = 1) -> int:
    """Round the vocabulary up to a multiple of `make_vocab_size_divisible_by x TP`
    (e.g. 50,277 -> 50,304)."""
    return _round_up(tokenizer_vocab_size, model_cfg.make_vocab_size_divisible_by * tp)


def _round_up(vocab_size: int, multiple: int) -> int:
    if vocab_size <= 0:
        raise ConfigError(f"vocabulary size must be positive, got {vocab_size}")
    return -(-vocab_size // multiple) * multiple


def base_vocab_size(vocab_size: int, true_vocab_size: int | None, model_cfg: ModelConfig) -> int:
    """The vocabulary as padded for one process: what an embedding's shape and token arithmetic
    (LEV's digit base, reference ids and id order; a matched baseline's width) derive from, so that
    every TP size builds the same model. `vocab_size` is the padded size at this TP size; without a
    `true_vocab_size` every row is real and the answer is `vocab_size`."""
    if true_vocab_size is None:
        return vocab_size
    return min(vocab_size, _round_up(true_vocab_size, model_cfg.make_vocab_size_divisible_by))
