"""The `data` section: the training and validation blends, the split, the tokenizer, the loader."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron_lev.config.ranges import SEED, check_fields, count, nonempty, ranged
from megatron_lev.errors import ConfigError, check_choice

TOKENIZER_TYPES = ("hf", "sentencepiece", "tiktoken")


@dataclass
class DataConfig:
    # Megatron-style blend: ["path/prefix"] or ["0.7", "a_prefix", "0.3", "b_prefix"]
    data_path: list[str] = field(default_factory=list)
    valid_data_path: list[str] = field(default_factory=list)  # separate validation shards (optional)
    split: str = "969,30,1"  # train,valid,test by document when valid_data_path is empty
    tokenizer_type: str = "hf"  # one of TOKENIZER_TYPES
    tokenizer_path: str | None = nonempty(None)
    cache_dir: str | None = nonempty(None)  # index cache; default: beside the data
    seed: int = ranged(1234, SEED)
    num_workers: int = ranged(0, count("0 loads batches in the training process", lo=0, cap=1024))
    # packed documents, split at the tokenizer's EOD id (Megatron-LM / GPT-NeoX semantics; docs/training.md)
    reset_position_ids: bool = False  # positions restart at 0 after every EOD
    reset_attention_mask: bool = False  # attention does not cross documents
    eod_mask_loss: bool = (
        False  # no loss where the input is EOD (the target is the next document's first token)
    )

    def validate(self) -> None:
        check_fields(self, "data")
        check_choice("data.tokenizer_type", self.tokenizer_type, TOKENIZER_TYPES)
        try:
            weights = [float(p) for p in self.split.split(",")]
        except ValueError:
            raise ConfigError(
                f"data.split={self.split!r} must be comma-separated numbers, e.g. '969,30,1'"
            ) from None
        if len(weights) != 3 or not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
            raise ConfigError(
                f"data.split={self.split!r} must be three finite non-negative numbers "
                "train,valid,test with a positive sum, e.g. '969,30,1'"
            )
        _check_blend("data.data_path", self.data_path)
        _check_blend("data.valid_data_path", self.valid_data_path)


def _check_blend(key: str, paths: list[str]) -> None:
    """`[prefix]` or `[weight, prefix, weight, prefix, ...]` with finite weights >= 0, not all zero."""
    example = "e.g. ['0.7', 'a_text_document', '0.3', 'b_text_document']"
    for i, item in enumerate(paths):
        if not str(item).strip():
            raise ConfigError(
                f"{key}[{i}] is an empty string: give a shard prefix such as data/pile_text_document"
            )
    if len(paths) <= 1:
        return
    if len(paths) % 2:
        raise ConfigError(
            f"{key} with several entries must alternate weight and prefix, {example}; got {paths}"
        )
    weights = []
    for i in range(0, len(paths), 2):
        try:
            weight = float(paths[i])
        except ValueError:
            raise ConfigError(
                f"{key}[{i}]={paths[i]!r} is not a weight: a blend alternates weight and prefix, {example}"
            ) from None
        if not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"{key}[{i}]={paths[i]!r}: a blend weight must be a finite number >= 0")
        weights.append(weight)
    if sum(weights) <= 0:
        raise ConfigError(f"{key}: every blend weight is 0; give at least one positive weight")
