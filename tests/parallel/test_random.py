"""The TP-aware RNG tracker: the default stream is shared by TP ranks, the model-parallel stream is not;
each model owns its tracker (no process-wide one)."""

import pytest
import torch

from megatron_lev.config import load_config
from megatron_lev.engine.build import build_model
from megatron_lev.parallel.layout import SINGLE
from megatron_lev.parallel.random import manual_seed, seeded, tp_rng_tracker
from megatron_lev.plan import model_spec
from megatron_lev.testing import run_distributed


def _draws(seed):
    from megatron_lev.parallel import state

    manual_seed(seed)
    tracker = tp_rng_tracker(seed, state.initialize_model_parallel(2))
    with tracker.fork():
        tp_draw = torch.rand(4)
    default_draw = torch.rand(4)
    return tp_draw.tolist(), default_draw.tolist()


@pytest.mark.multiprocess
def test_tp_stream_differs_per_rank_default_stream_shared():
    (tp0, d0), (tp1, d1) = run_distributed(_draws, world_size=2, args=(11,))
    assert d0 == d1
    assert tp0 != tp1
    torch.manual_seed(11)
    assert d0 == torch.rand(4).tolist()  # fork() left the default stream untouched


def test_fork_resumes_its_stream_and_seeded_restores_default():
    tracker = tp_rng_tracker(3, SINGLE)
    with tracker.fork():
        a = torch.rand(3)
    with tracker.fork():
        b = torch.rand(3)
    with tp_rng_tracker(3, SINGLE).fork():
        ab = torch.rand(6)
    torch.testing.assert_close(torch.cat([a, b]), ab)
    before = torch.get_rng_state()
    with seeded(5):
        x = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    torch.testing.assert_close(x, torch.rand(2))
    with pytest.raises(KeyError, match="tp_rng_tracker"):
        with tracker.fork("missing"):
            pass


def test_each_model_owns_its_tracker_and_every_attention_uses_it():
    cfg = load_config(None, ["model.num_layers=2", "model.hidden_size=32", "model.attention_dropout=0.5"])
    spec = model_spec(cfg, 64)
    one, two = build_model(spec, SINGLE), build_model(spec, SINGLE)
    assert one.rng is not two.rng
    assert all(block.attention.rng is one.rng for block in one.layers)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    first = one(ids[:, :-1], ids[:, 1:])
    torch.manual_seed(1)
    second = two(ids[:, :-1], ids[:, 1:])  # the same weights, the same fresh stream: the same masks
    torch.testing.assert_close(first, second)
    torch.manual_seed(1)
    third = one(ids[:, :-1], ids[:, 1:])  # model one's stream moved on: other attention masks
    assert not torch.equal(first, third)


def test_a_new_tracker_leaves_the_default_stream_alone_and_starts_where_manual_seed_would():
    torch.manual_seed(4)
    before = torch.get_rng_state()
    tracker = tp_rng_tracker(100, SINGLE)  # stream 100 + 2718
    assert torch.equal(torch.get_rng_state(), before)
    with tracker.fork():
        drawn = torch.rand(5)
    torch.manual_seed(100 + 2718)
    assert torch.equal(drawn, torch.rand(5))
