"""The TP-aware RNG tracker: the default stream is shared by TP ranks, the model-parallel stream is not."""

import pytest
import torch

from megatron_lev.parallel.layout import SINGLE
from megatron_lev.parallel.random import get_rng_tracker, model_parallel_manual_seed, seeded
from megatron_lev.testing import run_distributed


def _draws(seed):
    from megatron_lev.parallel import state

    model_parallel_manual_seed(seed, state.initialize_model_parallel(2))
    with get_rng_tracker().fork():
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
    model_parallel_manual_seed(3, SINGLE)
    with get_rng_tracker().fork():
        a = torch.rand(3)
    with get_rng_tracker().fork():
        b = torch.rand(3)
    model_parallel_manual_seed(3, SINGLE)
    with get_rng_tracker().fork():
        ab = torch.rand(6)
    torch.testing.assert_close(torch.cat([a, b]), ab)
    before = torch.get_rng_state()
    with seeded(5):
        x = torch.rand(2)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    torch.testing.assert_close(x, torch.rand(2))
    with pytest.raises(KeyError, match="model_parallel_manual_seed"):
        with get_rng_tracker().fork("missing"):
            pass
