"""The pretraining sampler: fixed global order, DP slices, resume under another DP size."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_lev.data.samplers import PretrainingSampler, build_data_loader


def _steps(total, consumed, micro, dp, steps):
    """Global sample order seen by `steps` steps of all DP ranks together."""
    iters = [iter(PretrainingSampler(total, consumed, micro, r, dp)) for r in range(dp)]
    order = []
    for _ in range(steps):
        order.extend(i for it in iters for i in next(it))
    return order


def test_ranks_take_slices_of_each_global_micro_batch():
    r0 = list(PretrainingSampler(16, 0, 2, 0, 2))
    r1 = list(PretrainingSampler(16, 0, 2, 1, 2))
    assert r0 == [[0, 1], [4, 5], [8, 9], [12, 13]] and r1 == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert len(PretrainingSampler(17, 0, 2, 0, 2)) == 4  # the incomplete last batch is dropped


def test_resume_under_a_different_dp_size_keeps_the_global_order():
    full = _steps(96, 0, 2, 2, 24)
    assert full == list(range(96))
    first = _steps(96, 0, 2, 2, 5)  # DP=2 runs 5 steps, then the job restarts on 4 ranks
    state = {"consumed_samples": len(first)}
    samplers = [PretrainingSampler(96, 0, 1, r, 4) for r in range(4)]
    for s in samplers:
        s.load_state_dict(state)
    iters = [iter(s) for s in samplers]
    rest = [i for _ in range(3) for it in iters for i in next(it)]
    assert first + rest == full[: len(first) + len(rest)]
    assert _steps(96, 20, 2, 4, 3) == list(range(20, 44))  # other global batch sizes continue in order too


def test_loader_counts_delivered_batches():
    data = [{"tokens": np.full(5, i, dtype=np.int64)} for i in range(24)]
    sampler = PretrainingSampler(24, 4, 2, 1, 2)
    loader = build_data_loader(data, sampler, num_workers=0)
    batches = []
    for b in loader:
        batches.append(b["tokens"][:, 0].tolist())
        if len(batches) == 2:
            break
    assert batches == [[6, 7], [10, 11]] and batches[0] and tuple(b["tokens"].shape) == (2, 5)
    assert sampler.state_dict() == {"consumed_samples": 4 + 2 * 4}


def test_bad_arguments():
    with pytest.raises(ValueError, match="data_parallel_rank"):
        PretrainingSampler(10, 0, 1, 2, 2)
    with pytest.raises(ValueError, match="no samples"):
        PretrainingSampler(0, 0, 1, 0, 1)
