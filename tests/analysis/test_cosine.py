"""Exact eps: blocked streaming statistics against the full cosine matrix computed naively."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_lev.analysis.cosine import cosine_stats, gram_moments


def _naive(x: np.ndarray) -> tuple[float, float, np.ndarray]:
    x = x[np.linalg.norm(x, axis=1) > 0].astype(np.float64)
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    c = (u @ u.T)[np.triu_indices(len(u), k=1)]  # all pairs i < j
    return c.mean(), c.std(), c


@pytest.fixture(scope="module")
def matrix() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(61, 9)) + 0.3 * rng.normal(size=(1, 9))  # a shared direction: mu != 0
    x[[4, 33]] = 0.0  # zero rows are dropped
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
    assert np.abs(s.hist_counts - ref).sum() <= 2  # only float32 ties at bin edges


def test_block_sizes_agree_and_gram_crosscheck(matrix):
    a, b = cosine_stats(matrix, block=7), cosine_stats(matrix, block=61)
    assert a.eps == pytest.approx(b.eps, abs=1e-7)  # float32 products, summed differently
    mu, sigma = gram_moments(torch.from_numpy(matrix))
    assert a.mean == pytest.approx(mu, abs=1e-7) and a.std == pytest.approx(sigma, abs=1e-7)


def test_sample_and_hist_stride(matrix):
    s = cosine_stats(matrix, sample=20, seed=1)
    assert s.pairs == 190 and s.sampled_rows == 20 and s.to_dict()["exact"] is False
    full = cosine_stats(matrix, sample=10_000)  # more rows than exist: exact
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

    assert auto_hist_stride(61, 9) == 1  # small: every pair histogrammed
    assert auto_hist_stride(50_277, 1024) == 4 and auto_hist_stride(200_019, 4096) == 1


def _structured(kind: str) -> np.ndarray:
    rng = np.random.default_rng(7)
    if kind == "random":
        return rng.normal(size=(300, 40))
    if kind == "shared-direction":  # mu ~ 0.9, sigma small
        return rng.normal(size=(200, 64)) * 0.2 + 3.0 * rng.normal(size=(1, 64))
    if kind == "duplicate-rows":  # tied tokens: rows repeated and rescaled
        x = rng.normal(size=(80, 30)) + 0.5 * rng.normal(size=(1, 30))
        return np.concatenate([x, 2.5 * x[:40], x[:10]])
    if kind == "zero-rows":
        x = rng.normal(size=(120, 20))
        x[[0, 5, 6, 119]] = 0.0
        return x
    if kind == "d-over-V":  # several Gram panels, rank < d
        return rng.normal(size=(40, 700)) + 0.1 * rng.normal(size=(1, 700))
    if kind == "V=2":
        return rng.normal(size=(2, 300))
    if kind == "parallel-rows":  # every cosine 1: sigma 0
        return rng.uniform(0.5, 2.0, size=(50, 1)) * rng.normal(size=(1, 33))
    raise ValueError(kind)


@pytest.mark.parametrize(
    "kind", ["random", "shared-direction", "duplicate-rows", "zero-rows", "d-over-V", "V=2", "parallel-rows"]
)
def test_gram_equals_all_pairs_in_float64(kind):
    x = _structured(kind)
    mu, sigma, c = _naive(x)
    s = cosine_stats(x, block=16, histogram="off")  # several row blocks
    assert s.pairs == len(c) and s.hist_pairs == 0 and s.hist_mode == "off"
    assert abs(s.mean - mu) < 1e-9
    if kind == "parallel-rows":
        # sigma^2 = E[c^2] - mu^2 cancels at float64 resolution when sigma is 0: the floor is
        # sqrt(ulp) ~ 1.5e-8 on sigma, 1e-16 on sigma^2
        assert abs(s.std**2 - sigma**2) < 1e-15 and s.std < 3e-8
    else:
        assert abs(s.std - sigma) < 1e-9 and abs(s.eps - (mu + 2 * sigma)) < 1e-9
    t = torch.from_numpy(x)
    assert gram_moments(t) == pytest.approx((s.mean, s.std), abs=1e-12)


def test_gram_rows_rounded_to_float32_agree():
    """Normalising in float64 or rounding the unit rows to float32 first: eps moves by ~1e-8."""
    x = torch.from_numpy(_structured("shared-direction"))
    mu64, sd64 = gram_moments(x)
    mu32, sd32 = gram_moments(x, rows_dtype=torch.float32)
    assert abs((mu64 + 2 * sd64) - (mu32 + 2 * sd32)) < 1e-6
    assert (mu64, sd64) != (mu32, sd32)  # it did round


def test_full_histogram_cross_checks_eps():
    x = _structured("random")
    s = cosine_stats(x, block=64, histogram="full", bins=50)
    assert s.hist_mode == "full" and s.hist_rows == 300 and s.hist_pairs == s.pairs == 300 * 299 // 2
    assert s.hist_seed is None and abs(s.eps_pairs - s.eps) < 1e-6


def test_histogram_sample_is_reproducible_by_seed():
    x = _structured("random")
    a = cosine_stats(x, block=32, hist_rows=60, seed=3, bins=50)
    b = cosine_stats(x, block=32, hist_rows=60, seed=3, bins=50)
    c = cosine_stats(x, block=32, hist_rows=60, seed=4, bins=50)
    assert a.hist_mode == "sample" and a.hist_rows == 60 and a.hist_seed == 3 and a.eps_pairs is None
    assert a.hist_pairs == a.hist_counts.sum() == 60 * 59 // 2
    assert np.array_equal(a.hist_counts, b.hist_counts) and not np.array_equal(a.hist_counts, c.hist_counts)
    assert a.eps == c.eps == cosine_stats(x, histogram="off").eps  # eps never depends on the sample
    # the sample's histogram is that of the naive cosines among the same seeded rows
    kept = np.flatnonzero(np.linalg.norm(x, axis=1) > 0)
    rows = kept[np.sort(torch.randperm(len(kept), generator=torch.Generator().manual_seed(3))[:60].numpy())]
    ref, _ = np.histogram(_naive(x[rows])[2], bins=50, range=(-1, 1))
    assert np.abs(a.hist_counts - ref).sum() <= 2
    assert cosine_stats(x, hist_rows=1000).hist_mode == "full"  # no more rows than asked: all pairs
    with pytest.raises(ValueError, match="hist-rows"):
        cosine_stats(x, hist_rows=1)
    with pytest.raises(ValueError, match="histogram"):
        cosine_stats(x, histogram="some")
