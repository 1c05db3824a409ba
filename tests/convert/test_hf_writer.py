"""The Hugging Face writer: config fields and streamed shards with an index."""

from __future__ import annotations

import json

import torch

from megatron_lev.config import ModelConfig
from megatron_lev.convert.hf_writer import SafetensorsShardWriter, llama_config, write_config


def _model_cfg() -> ModelConfig:
    return ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_kv_heads=2,
        seq_length=64,
        rope_theta=5000.0,
        norm_eps=1e-6,
    )


def test_sharded_model_round_trips_through_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    config = llama_config(
        _model_cfg(),
        vocab_size=1000,
        tie_word_embeddings=False,
        dtype=torch.float32,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)
    source = LlamaForCausalLM(config).eval()
    writer = SafetensorsShardWriter(tmp_path, max_shard_bytes=60_000)
    for name, tensor in source.state_dict().items():
        writer.add(name, tensor)
    files = writer.close()
    write_config(tmp_path, config)
    assert len(files) > 1 and all(f.is_file() for f in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source.state_dict())
    assert not list(tmp_path.glob(".shard-*"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 2 and cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 5000.0
    assert cfg["intermediate_size"] == _model_cfg().ffn_size and cfg["tie_word_embeddings"] is False
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == 0

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters["rope_theta"] == 5000.0
    ids = torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_single_shard_has_no_index(tmp_path):
    writer = SafetensorsShardWriter(tmp_path)
    writer.add("a", torch.ones(3))
    assert writer.close() == [tmp_path / "model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
