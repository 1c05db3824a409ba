"""TP merge/split rules derived from the model reproduce real tensor-parallel shards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from megatron_lev.checkpoint.merge import ShardMismatchError, merge_shards, shard_specs, split_full
from megatron_lev.parallel import state
from megatron_lev.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megatron_lev.testing import run_distributed


class _Net(nn.Module):
    """Every kind of sharding: vocab rows, fused QKV-like columns, rows, and a replicated norm."""

    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(16, 8)
        self.qkv = ColumnParallelLinear(8, 16, part_sizes=(8, 4, 4))
        self.up = ColumnParallelLinear(8, 12)
        self.down = RowParallelLinear(12, 8)
        self.norm = nn.LayerNorm(8)


def _build(seed: int) -> _Net:
    torch.manual_seed(seed)
    return _Net()


def _tp_state(seed: int) -> dict:
    state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        return {k: v.clone() for k, v in _build(seed).state_dict().items()}
    finally:
        state.destroy_model_parallel()


@pytest.fixture(scope="module")
def tp2_shards():
    return run_distributed(_tp_state, world_size=2, args=(7,))


@pytest.mark.multiprocess
def test_merge_and_split_match_real_shards(tp2_shards):
    full_model = _build(7)
    specs = shard_specs(full_model)
    assert specs["qkv.weight"].parts == (8, 4, 4) and specs["qkv.weight"].dim == 0
    assert specs["down.weight"].dim == 1 and specs["norm.weight"].dim is None
    for name, full in full_model.state_dict().items():
        merged = merge_shards(name, [s[name] for s in tp2_shards], specs[name])
        torch.testing.assert_close(merged, full, rtol=0, atol=0)
        for rank, shard in enumerate(split_full(name, full, specs[name], 2)):
            torch.testing.assert_close(shard, tp2_shards[rank][name], rtol=0, atol=0)


@pytest.mark.multiprocess
def test_naive_concat_of_fused_weight_is_not_the_merge(tp2_shards):
    """The classic conversion bug: concatenating fused QKV shards interleaves Q, K and V."""
    full = _build(7).state_dict()["qkv.weight"]
    naive = torch.cat([s["qkv.weight"] for s in tp2_shards], dim=0)
    assert not torch.equal(naive, full)


def test_mismatches_are_reported_by_name():
    specs = shard_specs(_build(1))
    good = _build(1).state_dict()
    with pytest.raises(ShardMismatchError, match="up.weight"):
        merge_shards("up.weight", [good["up.weight"]] * 2, specs["up.weight"])
    with pytest.raises(ShardMismatchError, match="norm.weight: replicated"):
        merge_shards("norm.weight", [good["norm.weight"], good["norm.weight"] + 1], specs["norm.weight"])
    with pytest.raises(ShardMismatchError, match="not divisible"):
        split_full("qkv.weight", good["qkv.weight"], specs["qkv.weight"], 3)
