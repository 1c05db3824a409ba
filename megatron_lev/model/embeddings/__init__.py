"""Input embeddings: the LEV layer and the five baselines, chosen by `model.embedding`.

    emb = build_input_embedding(model_cfg, padded_vocab_size)   # (B, S) ids -> (B, S, D)

Adding a variant: one class with `from_config(model_cfg, vocab_size)` and one line in REGISTRY.
"""

from __future__ import annotations

from megatron_lev.config import EMBEDDINGS, ConfigError, ModelConfig
from megatron_lev.model.embeddings.base import InputEmbedding, check_token_ids
from megatron_lev.model.embeddings.baselines import (
    AlbertEmbedding,
    FactorizedMlpEmbedding,
    FlatMlpEmbedding,
    TiedEmbedding,
    UntiedEmbedding,
)
from megatron_lev.model.embeddings.lev import LevEmbedding
from megatron_lev.model.embeddings.sizing import baseline_sizes, lev_parameter_count, parameter_counts

REGISTRY: dict[str, type[InputEmbedding]] = {
    "tied": TiedEmbedding,
    "untied": UntiedEmbedding,
    "albert": AlbertEmbedding,
    "flat_mlp": FlatMlpEmbedding,
    "factorized_mlp": FactorizedMlpEmbedding,
    "lev": LevEmbedding,
}
assert tuple(REGISTRY) == EMBEDDINGS, "REGISTRY and config.EMBEDDINGS must list the same variants"


def build_input_embedding(model_cfg: ModelConfig, vocab_size: int) -> InputEmbedding:
    """The input embedding named by `model_cfg.embedding`, for the (already padded) `vocab_size`."""
    if model_cfg.embedding not in REGISTRY:
        raise ConfigError(f"model.embedding={model_cfg.embedding!r} is not one of {', '.join(REGISTRY)}")
    return REGISTRY[model_cfg.embedding].from_config(model_cfg, vocab_size)


__all__ = ["REGISTRY", "InputEmbedding", "build_input_embedding", "check_token_ids", "parameter_counts",
           "lev_parameter_count", "baseline_sizes", "LevEmbedding"]
