"""Exact eps: blocked streaming statistics against the full cosine matrix computed naively."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lev.analysis.cosine import cosine_stats, gram_moments


def _naive(x: np.ndarray) -> tuple[float, float, np.ndarray]:
    x = x[np.linalg.norm(x, axis=1) > 0].astype(np.float64)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = (u @ u.T)[np.triu_indices(len(u), k=1)]                 # all pairs i < j
    return c.mean(), c.std(), c


@pytest.fixture(scope="module")
def matrix() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(61, 9)) + 0.3 * rng.normal(size=(1, 9))   # a shared direction: mu != 0
    x[[4, 33]] = 0.0                                                # zero rows are dropped
    return x.astype(np.float32)


@pytest.mark.parametrize("block", [1, 5, 17, 59, 4096])
def test_blocked_matches_naive(matrix, block):
    mu, sigma, c = _naive(matrix)
    s = cosine_stats(matrix, block=block, bins=40)
    assert s.rows == 59 and s.dropped_zero_rows == 2 and s.pairs == len(c) == 59 * 58 // 2
    assert s.mean == pytest.approx(mu, abs=1e-6)
    assert s.std == pytest.approx(sigma, abs=1e-6)
    assert s.eps == pytest.approx(mu + 2 * sigma, abs=1e-6)
    assert s.hist_counts.sum() == s.hist_pairs == len(c)
    ref, _ = np.histogram(c, bins=40, range=(-1, 1))
    assert np.abs(s.hist_counts - ref).sum() <= 2                   # only float32 ties at bin edges


def test_block_sizes_agree_and_gram_crosscheck(matrix):
    a, b = cosine_stats(matrix, block=7), cosine_stats(matrix, block=61)
    assert a.eps == pytest.approx(b.eps, abs=1e-7)             # float32 products, summed differently
    mu, sigma = gram_moments(torch.from_numpy(matrix))
    assert a.mean == pytest.approx(mu, abs=1e-7) and a.std == pytest.approx(sigma, abs=1e-7)


def test_sample_and_hist_stride(matrix):
    s = cosine_stats(matrix, sample=20, seed=1)
    assert s.pairs == 190 and s.sampled_rows == 20 and s.to_dict()["exact"] is False
    full = cosine_stats(matrix, sample=10_000)                      # more rows than exist: exact
    assert full.sampled_rows is None and full.pairs == 59 * 58 // 2
    strided = cosine_stats(matrix, block=16, hist_stride=3)
    assert strided.eps == pytest.approx(full.eps, abs=1e-7) and strided.hist_pairs < full.pairs


def test_bad_input():
    with pytest.raises(ValueError, match="2-D"):
        cosine_stats(np.zeros(5))
    with pytest.raises(ValueError, match="at least 2"):
        cosine_stats(np.zeros((4, 3)))


def test_auto_hist_stride_only_for_large_matrices():
    from megatron_lev.analysis.cosine import auto_hist_stride

    assert auto_hist_stride(61, 9) == 1                              # small: every pair histogrammed
    assert auto_hist_stride(50_277, 1024) == 4 and auto_hist_stride(200_019, 4096) == 1
