"""Parameter counts per embedding variant and model FLOPs per token (for MFU).

FLOPs convention (PaLM / Megatron "model FLOPs"): a matmul with an `m x n` weight costs
`2 m n` per token forward, backward costs twice the forward, so training costs 3x.
Attention scores and the weighted sum cost `2 * 2 * S * H * hd` per token per layer,
counted over the full sequence (not halved for the causal mask), as in PaLM's `12 L H Q T`.
Recomputation for activation checkpointing is not counted (it is not model work). The
input embedding is excluded: a lookup for the dense tables, and LEV's per-unique-token
G is below 0.1% of the total even if every token were distinct.
"""

from __future__ import annotations

from megatron_lev.config import ModelConfig


def block_parameter_count(cfg: ModelConfig) -> int:
    """One decoder block: two RMSNorms, fused QKV, output projection, SwiGLU (no biases)."""
    d, hd = cfg.hidden_size, cfg.hidden_size // cfg.num_attention_heads
    attention = d * (cfg.num_attention_heads + 2 * cfg.kv_heads) * hd + cfg.num_attention_heads * hd * d
    return 2 * d + attention + 3 * d * cfg.ffn_size


def parameter_count(cfg: ModelConfig, vocab_size: int, variant: str | None = None) -> dict[str, int]:
    """`{"input", "output", "blocks", "final_norm", "total"}` for `variant` (default `cfg.embedding`).

    `vocab_size` is the padded vocabulary. `output` is 0 when the variant ties the head to its input table.
    """
    from megatron_lev.model.embeddings import parameter_counts

    emb = parameter_counts(variant or cfg.embedding, vocab_size, cfg.hidden_size, cfg)
    counts = {
        "input": emb["input"],
        "output": emb["output"],
        "blocks": cfg.num_layers * block_parameter_count(cfg),
        "final_norm": cfg.hidden_size,
    }
    counts["total"] = sum(counts.values())
    return counts


def flops_per_token(cfg: ModelConfig, vocab_size: int, seq_length: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of the blocks, attention and the output head."""
    s = seq_length or cfg.seq_length
    hd = cfg.hidden_size // cfg.num_attention_heads
    matmul_params = block_parameter_count(cfg) - 2 * cfg.hidden_size  # norms are not matmuls
    per_layer = 2 * matmul_params + 2 * 2 * s * cfg.num_attention_heads * hd
    forward = cfg.num_layers * per_layer + 2 * cfg.hidden_size * vocab_size
    return 3.0 * forward


def mfu(
    tokens_per_second: float,
    cfg: ModelConfig,
    vocab_size: int,
    num_devices: int,
    peak_flops_per_device: float,
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    return tokens_per_second * flops_per_token(cfg, vocab_size) / (num_devices * peak_flops_per_device)
