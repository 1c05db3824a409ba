"""Input embeddings: the LEV layer and the five baselines, chosen by `model.embedding`.

    emb = build_input_embedding(model_cfg, padded_vocab_size)   # (B, S) ids -> (B, S, D)
    embedding_class("tied").ties_output_head                    # what a variant is: ask its class

Adding a variant: one `InputEmbedding` subclass (its `name`, `label`, `from_config` and
`parameter_count`) and one line in REGISTRY. REGISTRY is the only list of variants: the
config, the model, checkpoints, sizing and the experiment grid all read it.
"""

from __future__ import annotations

import dataclasses

from megatron_lev.config import ModelConfig
from megatron_lev.errors import ConfigError, check_choice
from megatron_lev.model.embeddings.base import InputEmbedding, check_token_ids
from megatron_lev.model.embeddings.baselines import (
    AlbertEmbedding,
    FactorizedMlpEmbedding,
    FlatMlpEmbedding,
    TiedEmbedding,
    UntiedEmbedding,
)
from megatron_lev.model.embeddings.lev import LevEmbedding, lev_parameter_count
from megatron_lev.parallel.layout import SINGLE, ParallelLayout

REGISTRY: dict[str, type[InputEmbedding]] = {
    cls.name: cls
    for cls in (
        TiedEmbedding,
        UntiedEmbedding,
        AlbertEmbedding,
        FlatMlpEmbedding,
        FactorizedMlpEmbedding,
        LevEmbedding,
    )
}


def embedding_class(name: str) -> type[InputEmbedding]:
    """The class of variant `name`; a ConfigError naming `model.embedding` and the choices otherwise."""
    check_choice("model.embedding", name, tuple(REGISTRY))
    return REGISTRY[name]


def build_input_embedding(
    model_cfg: ModelConfig,
    vocab_size: int,
    layout: ParallelLayout = SINGLE,
    base_vocab: int | None = None,
) -> InputEmbedding:
    """The input embedding named by `model_cfg.embedding`, for the (already padded) `vocab_size`, sharded
    over `layout`'s TP ranks; `base_vocab` is that vocabulary padded for one process (see
    `InputEmbedding.from_config`)."""
    return embedding_class(model_cfg.embedding).from_config(model_cfg, vocab_size, layout, base_vocab)


def _with_width(model_cfg: ModelConfig, hidden_size: int) -> ModelConfig:
    return (
        model_cfg
        if hidden_size == model_cfg.hidden_size
        else dataclasses.replace(model_cfg, hidden_size=hidden_size)
    )


def parameter_counts(
    variant: str, vocab_size: int, hidden_size: int, model_cfg: ModelConfig
) -> dict[str, int]:
    """`{"input", "output", "total_embedding"}`: output is the dense `V x D` head (0 when the head is
    tied)."""
    cls = embedding_class(variant)
    inp = cls.parameter_count(_with_width(model_cfg, hidden_size), vocab_size)
    out = 0 if cls.ties_output_head else vocab_size * hidden_size
    return {"input": inp, "output": out, "total_embedding": inp + out}


def baseline_sizes(
    variant: str, vocab_size: int, hidden_size: int, model_cfg: ModelConfig
) -> tuple[int, int]:
    """`(e, hidden)` of a compressed baseline (its class's `widths`)."""
    cls = embedding_class(variant)
    if not hasattr(cls, "widths"):
        raise ConfigError(
            f"model.embedding={variant!r} has no sizes to match (only "
            f"{', '.join(n for n, c in REGISTRY.items() if hasattr(c, 'widths'))})"
        )
    return cls.widths(_with_width(model_cfg, hidden_size), vocab_size)


__all__ = [
    "REGISTRY",
    "InputEmbedding",
    "LevEmbedding",
    "baseline_sizes",
    "build_input_embedding",
    "check_token_ids",
    "embedding_class",
    "lev_parameter_count",
    "parameter_counts",
]
