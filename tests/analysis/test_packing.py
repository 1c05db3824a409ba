"""The packing simulation: exponent rule, optimised beats random, and the refit runs on its output."""

from __future__ import annotations

import numpy as np

from megatron_lev.analysis.fit import refit
from megatron_lev.analysis.packing import optimized_packing, packing_exponent, random_packing, run_sweep


def test_packing_exponent_rule():
    assert packing_exponent(32, 2000) == 11  # m = 40 (k <= 4000): floor(40 / ln 32)
    assert packing_exponent(4096, 32000) == 6  # m = 50 (d >= 3072)
    assert packing_exponent(256, 8000) == 10  # m = 60
    assert packing_exponent(2, 100) == 20  # capped


def test_optimised_packing_beats_random():
    rand = random_packing(6, 24, trials=3)
    opt = optimized_packing(6, 24, steps=300)
    assert 0 < opt < rand < 1
    assert optimized_packing(6, 24, steps=300) == opt  # seeded: reproducible


def test_sweep_rows_feed_the_refit():
    sweep = run_sweep((4, 8), (16, 32), steps=60, trials=2)
    rows = np.asarray(sweep["optimized"])
    assert rows.shape == (4, 3) and set(rows[:, 1]) == {4, 8}
    fits = refit(rows)
    assert fits["adjusted"]["params"]["C"] > 0 and fits["adjusted"]["n_fit"] == 4
