"""`ParallelLayout` from sizes alone: DeepSpeed's rank order, shard names without process groups, and a
clear refusal of any collective."""

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.engine.mpu import TensorParallelMPU
from megatron_lev.model.canonical import canonical_state_dict_spec
from megatron_lev.model.gpt import GPTModel
from megatron_lev.parallel.layout import SINGLE, ParallelLayout, ParallelLayoutError, rank_of


def test_coordinates_follow_deepspeeds_rank_order():
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    for rank in range(12):
        layout = ParallelLayout.from_sizes(tp=2, pp=2, dp=3, rank=rank)
        coord = topo.get_coord(rank)
        assert (layout.pp_rank, layout.dp_rank, layout.tp_rank) == (coord.pipe, coord.data, coord.model)
        assert layout.rank == rank == rank_of(layout.pp_rank, layout.dp_rank, layout.tp_rank, 2, 3)
        assert rank in layout.tp_ranks and rank in layout.dp_ranks and rank in layout.pp_ranks
        assert list(layout.tp_ranks) == topo.get_axis_comm_lists("model")[rank // 2]
    assert SINGLE == ParallelLayout.from_sizes() and SINGLE.world_size == 1
    with pytest.raises(ParallelLayoutError, match="outside a world"):
        ParallelLayout.from_sizes(tp=2, rank=2)


def test_a_sizes_only_layout_refuses_collectives_but_names_shards():
    layout = ParallelLayout.from_sizes(tp=2, rank=1)
    assert SINGLE.tp_group is None and layout.dp_group is None  # size 1: nothing to talk to
    with pytest.raises(ParallelLayoutError, match="from sizes alone and has no TP process group"):
        _ = layout.tp_group
    with pytest.raises(ValueError, match="needs process groups"):
        TensorParallelMPU(layout)
    cfg = load_config(None, ["model.embedding=lev", "model.make_vocab_size_divisible_by=64"]).model
    # the spec depends on its arguments alone, not on whether groups exist
    assert canonical_state_dict_spec(cfg, 1024) == canonical_state_dict_spec(cfg, 1024, layout)
    with torch.device("meta"):
        shard = GPTModel(cfg, 1024, layout=layout)
    assert (
        shard.layers[0].attention.qkv.weight.shape[0] * 2
        == GPTModel(cfg, 1024).layers[0].attention.qkv.weight.shape[0]
    )
    model = GPTModel(cfg, 1024, layout=layout)
    with pytest.raises(ParallelLayoutError, match="cannot run collectives"):
        model(torch.zeros(1, 4, dtype=torch.long))
