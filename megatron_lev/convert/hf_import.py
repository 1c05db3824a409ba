"""Hugging Face Llama -> the project's `GPTModel` (`tied` or `untied`), e.g. to start from a public model
or to check the block math (RMSNorm, rotary convention, SwiGLU order) against transformers.

    model, model_cfg = import_hf_llama("path/to/llama")   # or a LlamaForCausalLM instance
"""

from __future__ import annotations

import os

import torch

from megatron_lev.config import ModelConfig
from megatron_lev.convert.llama_names import from_hf
from megatron_lev.errors import ConfigError
from megatron_lev.model.vocab import padded_vocab_size


def model_config_from_hf(config, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """The `ModelConfig` of a Llama config, refusing features the project's blocks do not have."""
    rope = getattr(config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }
    problems = []
    if config.hidden_act != "silu":
        problems.append(f"hidden_act={config.hidden_act!r} (SwiGLU needs silu)")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        problems.append("biases (the project's blocks have none)")
    if rope.get("rope_type", "default") != "default":
        problems.append(f"rope scaling {rope.get('rope_type')!r}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        problems.append(f"head_dim={head_dim} x heads != hidden_size={config.hidden_size}")
    if problems:
        raise ConfigError("cannot import this Llama model: " + "; ".join(problems))
    cfg = ModelConfig(
        name="hf-import",
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        ffn_hidden_size=config.intermediate_size,
        seq_length=config.max_position_embeddings,
        vocab_size=config.vocab_size,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        embedding="tied" if config.tie_word_embeddings else "untied",
        rope_theta=float(rope["rope_theta"]),
        norm_eps=config.rms_norm_eps,
        init_std=config.initializer_range,
    )
    cfg.validate()
    return cfg


def import_hf_llama(source: str | os.PathLike | torch.nn.Module, make_vocab_size_divisible_by: int = 128):
    """A TP = 1 `GPTModel` holding the weights of a Llama model; returns `(model, model_cfg)`."""
    from megatron_lev.engine.build import build_model
    from megatron_lev.model.embeddings import embedding_class
    from megatron_lev.parallel.layout import SINGLE
    from megatron_lev.plan.spec import ModelSpec

    if isinstance(source, torch.nn.Module):
        hf_model = source
    else:
        from transformers import AutoModelForCausalLM

        from megatron_lev.utils.progress import hf_bars_off_a_terminal

        hf_bars_off_a_terminal()
        hf_model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    cfg = model_config_from_hf(hf_model.config, make_vocab_size_divisible_by)
    padded = padded_vocab_size(cfg.vocab_size, cfg, 1)
    hf_state = {k: v.detach().float() for k, v in hf_model.state_dict().items()}
    tied = embedding_class(cfg.embedding).ties_output_head
    if tied:
        hf_state.pop("lm_head.weight", None)
    state = from_hf(hf_state, cfg, padded, tied=tied)
    with torch.device("meta"):
        model = build_model(ModelSpec(cfg, padded, cfg.vocab_size), SINGLE)  # the loss keeps the true rows
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), cfg
