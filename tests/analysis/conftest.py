"""A tiny random Llama saved with save_pretrained, shared by the capacity and evaluate tests."""

from __future__ import annotations

import pytest
import torch

VOCAB = 50304  # covers the GPT-NeoX-20B tokenizer of ../shared/data/tokenizers


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path
