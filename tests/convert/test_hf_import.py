"""A random Hugging Face Llama imported into the project's GPTModel gives the same logits (block math
check)."""

from __future__ import annotations

import pytest
import torch

from megatron_lev.convert.hf_import import import_hf_llama, model_config_from_hf
from megatron_lev.errors import ConfigError


def _llama(tied: bool, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=tied,
        **extra,
    )
    torch.manual_seed(3)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a wrong RMSNorm placement shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_imported_llama_gives_the_same_logits(tied, tmp_path):
    hf = _llama(tied)
    hf.save_pretrained(tmp_path)
    model, cfg = import_hf_llama(tmp_path)
    assert cfg.embedding == ("tied" if tied else "untied") and cfg.kv_heads == 2 and cfg.rope_theta == 50000.0
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)[..., :200]
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_unsupported_llama_features_are_refused():
    with pytest.raises(ConfigError, match="biases"):
        model_config_from_hf(_llama(False, attention_bias=True).config)
