"""Capacity formulas against the paper's table, eps classes, and the refit of the constants."""

from __future__ import annotations

import math

import pytest

from megatron_lev.analysis.fit import load_packing, refit
from megatron_lev.analysis.formulas import FORMULAS, capacity_table, eps_class, format_log10

PAPER_ROWS = [  # (model, d, eps, capacity by the four-constant form)
    ("Llama 2 7B", 4096, 0.06450, 3.99e7),
    ("Mistral 7B v0.3", 4096, 0.07019, 1.33e8),
    ("Phi-2", 2560, 0.05497, 4.57e5),
    ("Qwen2.5 7B", 3584, 0.07501, 1.20e8),
    ("TinyLlama 1.1B", 2048, 0.06329, 4.81e5),
]


def _by_key(d, eps):
    return {r["key"]: r for r in capacity_table(d, eps)}


@pytest.mark.parametrize("model,d,eps,capacity", PAPER_ROWS)
def test_four_constant_form_reproduces_paper_table(model, d, eps, capacity):
    value = 10 ** _by_key(d, eps)["fitted"]["log10_capacity"]
    assert f"{value:.2e}" == f"{capacity:.2e}", model  # 3 significant digits


def test_one_constant_form_is_not_the_table():
    adjusted = 10 ** _by_key(4096, 0.06450)["adjusted"]["log10_capacity"]
    assert adjusted == pytest.approx(2.17e9, rel=0.01)
    rows = capacity_table(4096, 0.06450)
    assert [r["reproduces_paper_table"] for r in rows] == [False, False, False, True]
    assert [r["name"] for r in rows][:2] == ["JL, proven", "JL, tightened on random vectors"]


def test_log_space_has_no_overflow():
    for eps in (0.28223, 0.99918, 3.0):  # Llama 3.2 1B, Gemma 7B, absurd
        for row in capacity_table(3072, eps):
            assert math.isfinite(row["log10_capacity"]) and row["log10_capacity"] > 2
    assert format_log10(20.5) == "3.16e+20" and format_log10(7.0) == "1.00e+07"
    assert format_log10(math.log10(9.999e5)) == "1.00e+06"


@pytest.mark.parametrize(
    "eps,cls",
    [
        (0.0645, "low-eps"),
        (0.0999, "low-eps"),
        (0.1, "borderline"),
        (0.15, "borderline"),
        (0.2, "borderline"),
        (0.2001, "high-eps"),
        (0.28223, "high-eps"),
        (0.99918, "high-eps"),
    ],
)
def test_classes(eps, cls):
    assert eps_class(eps) == cls


def test_refit_reproduces_paper_constants(shared_data):
    fits = refit(load_packing(shared_data / "capacity" / "optimized_packing.json"))
    assert fits["adjusted"]["params"]["C"] == pytest.approx(1.2934, abs=5e-5)
    assert round(fits["adjusted"]["r2"], 4) == 0.9984
    assert fits["jl"]["params"]["C"] == pytest.approx(0.7068, abs=5e-5)
    four = fits["fitted"]["params"]
    expected = dict(zip("Cabc", FORMULAS[3].constants.values()))
    for name in "Cabc":
        assert four[name] == pytest.approx(expected[name], rel=1e-4), name
    random_fit = refit(load_packing(shared_data / "capacity" / "random_packing.json"))
    assert random_fit["jl"]["params"]["C"] == pytest.approx(3.029, abs=1e-3)  # the tightened JL constant


def test_load_packing_rejects_bad_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[[1, 2]]")
    with pytest.raises(ValueError, match="bad.json"):
        load_packing(bad)
