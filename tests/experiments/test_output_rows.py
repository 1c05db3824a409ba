"""Adam's state of the output rows by training count (`studies/output_rows.py`) and the clip report's
page of it: known moments give known eps shares, steps and norms; the page prints the files' numbers
and the eps share a clip factor would give."""

from __future__ import annotations

import json

import numpy as np
import pytest

from studies import clip_report as cr
from studies.output_rows import band_stats
from tests.experiments.test_clip import RARE, _raw

STEP = 1000  # bias corrections 1 - 0.9**1000 and 1 - 0.95**1000 are 1 to double precision


def _moments(counts, sqrt_v_by_band, m_by_band, width=4, padding=3):
    """Weight, exp_avg and exp_avg_sq with one value per band (rows ordered by `counts`), plus
    `padding` rows past the vocabulary whose values would change every statistic if read."""
    band = np.searchsorted(np.asarray((1, 10, 100, 1000)), counts, side="right")
    rows = len(counts) + padding
    w = np.full((rows, width), 1e3)
    m = np.full((rows, width), 1e3)
    v = np.full((rows, width), 1e3)
    for i, b in enumerate(band):
        w[i] = (i + 1) / np.sqrt(width)  # row i's norm is i + 1
        m[i] = m_by_band[b]
        v[i] = sqrt_v_by_band[b] ** 2
    return w, m, v


def test_known_moments_give_known_band_statistics():
    counts = np.array([0, 0, 0, 3, 5, 50, 500, 5000, 0])
    sqrt_v = [1e-8, 1e-7, 1e-5, 1e-4, 1e-3]
    m_hat = [2e-8, 1e-7, 1e-6, 1e-4, 5e-4]
    w, m, v = _moments(counts, sqrt_v, m_hat)
    stats = band_stats(w, m, v, counts, STEP, eps=1e-8)
    assert [s["band"] for s in stats] == ["0", "1-9", "10-99", "100-999", ">= 1000"]
    assert [s["rows"] for s in stats] == [4, 2, 1, 1, 1]
    zero = stats[0]
    assert zero["sqrt_v"]["q50"] == pytest.approx(1e-8)
    assert zero["eps_share_median"] == pytest.approx(0.5)  # sqrt(v) equal to eps: half the denominator
    assert zero["adam_step_median"] == pytest.approx(1.0)  # 2e-8 / (1e-8 + 1e-8)
    # rows 0, 1, 2 and 8; the padding rows (values 1e3) would change every median if read
    assert zero["row_norm_median"] == pytest.approx(np.median([1, 2, 3, 9]))
    assert stats[1]["eps_share_median"] == pytest.approx(1e-8 / (1e-7 + 1e-8))
    assert stats[4]["adam_step_median"] == pytest.approx(5e-4 / (1e-3 + 1e-8))
    assert stats[2]["row_norm_median"] == pytest.approx(6.0)


def test_a_band_without_rows_and_a_short_layer():
    counts = np.array([0, 0, 20])
    w, m, v = _moments(counts, [1e-8] * 5, [1e-8] * 5, padding=0)
    stats = band_stats(w, m, v, counts, STEP, eps=1e-8)
    assert stats[1] == {"band": "1-9", "rows": 0}
    from megatron_lev.errors import DataError

    with pytest.raises(DataError, match="do not hold the 3 ids"):
        band_stats(w[:2], m[:2], v[:2], counts, STEP, eps=1e-8)


def test_the_rows_page_prints_the_files_and_the_factor_s_arithmetic(tmp_path):
    _raw(tmp_path, lev_sc_shift=0.1 * RARE, lev_r_shift=0.4 * RARE)
    raw_dir = tmp_path / "clip" / "raw"
    rec = {
        "tag": "iter_0001000",
        "step": 1000,
        "adam_eps": 1e-8,
        "parameter": "output_head.weight",
        "bands": [
            {
                "band": "0",
                "rows": 1234,
                "sqrt_v": {"q10": 2e-8, "q50": 4e-8, "q90": 8e-8},
                "eps_share_median": 0.2,
                "adam_step_median": 0.3,
                "row_norm_median": 2.5,
            },
            {"band": "1-9", "rows": 0},
        ],
    }
    (raw_dir / "lev-sc-s1234" / "output_rows.json").write_text(json.dumps(rec))
    page = cr.rows_markdown(cr.CombinedRaw(cr.PlanRaw(raw_dir), cr.PlanRaw(tmp_path / "regime" / "raw")))
    assert "| lev-sc-s1234 | 0 | 1,234 | 4.00e-08 [2.00e-08, 8.00e-08] | 0.200 | 0.300 | 2.500 |" in page
    assert "| lev-sc-s1234 | 1-9 |" not in page  # a band without rows has no line
    # the regime's LEV seed 1234 logged grad norm 4 (clip_grad 1): f = 1 / (4 + 1e-6); the run's own
    # logged global factor is 0.9, so its gradients are scaled by f / 0.9
    scaled = 1 / (4 + 1e-6) / 0.9 * 4e-8
    share = f"{1e-8 / (4e-8 + 1e-8):.3f} | {1e-8 / (scaled + 1e-8):.3f}"
    assert f"| lev-sc-s1234 | 4.00e-08 | 0.900 | {share} |" in page
    empty = tmp_path / "empty"
    _raw(empty, lev_sc_shift=0.1 * RARE, lev_r_shift=0.4 * RARE)
    raw = cr.CombinedRaw(cr.PlanRaw(empty / "clip" / "raw"), cr.PlanRaw(empty / "regime" / "raw"))
    assert "No run has `output_rows.json` yet." in cr.rows_markdown(raw)


def test_the_moments_are_bias_corrected_with_the_run_s_betas():
    counts = np.array([0, 0])
    w, m, v = _moments(counts, [1e-6] * 5, [1e-6] * 5, padding=0)
    stats = band_stats(w, m, v, counts, step=2, eps=1e-30, betas=(0.5, 0.75))
    # m_hat = m / (1 - 0.5**2), sqrt(v_hat) = sqrt(v / (1 - 0.75**2))
    assert stats[0]["sqrt_v"]["q50"] == pytest.approx(1e-6 / np.sqrt(1 - 0.75**2))
    assert stats[0]["adam_step_median"] == pytest.approx(np.sqrt(1 - 0.75**2) / (1 - 0.5**2))
