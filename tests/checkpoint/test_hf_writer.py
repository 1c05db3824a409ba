"""The Hugging Face writer: config fields, streamed shards with an index, tokenizer files."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_lev.checkpoint.hf_writer import (
    SafetensorsShardWriter,
    llama_config,
    write_config,
    write_tokenizer,
)
from megatron_lev.config import ModelConfig


def _model_cfg() -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2, seq_length=64,
                       rope_theta=5000.0, norm_eps=1e-6)


def test_sharded_model_round_trips_through_from_pretrained(tmp_path, shared_data):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    info = write_tokenizer(tmp_path, "hf", shared_data / "tokenizers" / "gpt-neox-20b.json")
    assert info["size"] == 50277 and info["eos_token_id"] == 0
    config = llama_config(_model_cfg(), vocab_size=info["size"], tie_word_embeddings=False, dtype=torch.float32,
                          bos_token_id=info["bos_token_id"], eos_token_id=info["eos_token_id"])
    torch.manual_seed(0)
    source = LlamaForCausalLM(config).eval()
    writer = SafetensorsShardWriter(tmp_path, max_shard_bytes=2_000_000)
    for name, tensor in source.state_dict().items():
        writer.add(name, tensor)
    files = writer.close()
    write_config(tmp_path, config)
    assert len(files) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(source.state_dict())
    assert not list(tmp_path.glob(".shard-*"))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 2 and cfg["rms_norm_eps"] == 1e-6 and cfg["rope_theta"] == 5000.0
    assert cfg["intermediate_size"] == _model_cfg().ffn_size and cfg["tie_word_embeddings"] is False

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.rope_parameters["rope_theta"] == 5000.0
    ids = AutoTokenizer.from_pretrained(tmp_path)("The cat sat", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == 510
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, source(ids).logits, rtol=0, atol=0)


def test_sentencepiece_tokenizer_is_converted(tmp_path, shared_data):
    import sentencepiece as spm
    from transformers import AutoTokenizer

    text = (shared_data / "README.md").read_text()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text)
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=600,
                                   model_type="bpe", byte_fallback=True, minloglevel=2)
    out = tmp_path / "hf"
    out.mkdir()
    info = write_tokenizer(out, "sentencepiece", tmp_path / "sp.model")
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    tok = AutoTokenizer.from_pretrained(out)
    sample = "The tokenizer of The Pile and Pythia."
    assert tok(sample, add_special_tokens=False)["input_ids"] == sp.encode(sample)
    assert info["eos_token_id"] == sp.eos_id() and (out / "tokenizer.model").is_file()


def test_unknown_tokenizer_and_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer_path"):
        write_tokenizer(tmp_path, "hf", tmp_path / "nope.json")
    (tmp_path / "x").write_text("")
    with pytest.raises(ValueError, match="tiktoken"):
        write_tokenizer(tmp_path, "tiktoken", tmp_path / "x")
