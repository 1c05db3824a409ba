"""Checked TP merge/split on real tensor-parallel shards of the model (fused QKV / gate-up, LEV heads,
vocab rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.convert.merge import ShardMismatchError, merge_shards, split_full
from megatron_lev.model.canonical import canonical_state_dict_spec
from megatron_lev.model.gpt import GPTModel
from megatron_lev.parallel import state
from megatron_lev.testing import run_distributed

VOCAB = 64
SMALL = [
    "model.num_layers=2",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.num_kv_heads=2",
    "model.seq_length=16",
    "model.make_vocab_size_divisible_by=8",
    "model.lev.d_seed=8",
    "model.lev.heads=2",
    "model.lev.kappa=4",
    "model.lev.rank=4",
    "model.embedding=lev",
]


def _cfg():
    return load_config(None, SMALL).model


def _tp_state() -> dict:
    layout = state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = GPTModel(_cfg(), VOCAB, seed=5, layout=layout)
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tp2_shards():
    shards = run_distributed(_tp_state, world_size=2)
    return [{k: torch.from_numpy(v) for k, v in s.items()} for s in shards]


@pytest.mark.multiprocess
def test_merge_and_split_match_real_shards(tp2_shards):
    full_model = GPTModel(_cfg(), VOCAB, seed=5)
    specs = canonical_state_dict_spec(_cfg(), VOCAB)
    assert specs["layers.0.attention.qkv.weight"].parts == (32, 16, 16)
    for name, full in full_model.state_dict().items():
        merged = merge_shards([s[name] for s in tp2_shards], specs[name])
        torch.testing.assert_close(merged, full, rtol=0, atol=0)
        for rank, shard in enumerate(split_full(full, specs[name], 2)):
            torch.testing.assert_close(shard, tp2_shards[rank][name], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_naive_concat_of_fused_weight_is_not_the_merge(tp2_shards):
    """The classic conversion bug: concatenating fused QKV shards interleaves Q, K and V."""
    full = GPTModel(_cfg(), VOCAB, seed=5).state_dict()["layers.0.attention.qkv.weight"]
    naive = torch.cat([s["layers.0.attention.qkv.weight"] for s in tp2_shards], dim=0)
    assert not np.allclose(naive.numpy(), full.numpy())


def test_mismatches_are_reported_by_name():
    specs = canonical_state_dict_spec(_cfg(), VOCAB)
    good = GPTModel(_cfg(), VOCAB, seed=5).state_dict()
    name = "layers.0.mlp.down.weight"
    with pytest.raises(ShardMismatchError, match=name):
        merge_shards([good[name]] * 2, specs[name])
    norm = "final_norm.weight"
    with pytest.raises(ShardMismatchError, match="replicated parameter differs"):
        merge_shards([good[norm], good[norm] + 1], specs[norm])
    with pytest.raises(ShardMismatchError, match="not divisible"):
        split_full(good["layers.0.attention.qkv.weight"], specs["layers.0.attention.qkv.weight"], 3)
