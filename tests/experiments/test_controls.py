"""The controls report (`studies/controls_report.py`) from synthetic raw files of four experiments with
known differences on the rare bucket: the README's outcomes for Q1 and Q2, the partners' names, the page."""

from __future__ import annotations

import numpy as np
import pytest

from studies import controls_report as ctl
from tests.experiments.test_clip import BANDS, DOCS, _write

RARE = np.array([1.0, 0.0, 0.0, 0.0, 0.0])  # the paper's bucket < 1e-7 only


def _raws(tmp_path, a_shift: float, b_shift: float, eps_seeds=(1234, 1235)):
    """Every group at zero except LEV-C0 (a_shift) and LEV-EPS (b_shift) on the rare bucket."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(DOCS, BANDS)).astype(float)
    zero = np.zeros(BANDS)
    plans = {
        "regime": [("LEV", (1234,), -0.9 * RARE, {}), ("UNTIED", (1234,), zero, {})],
        "clip": [
            ("TIED", (1234,), zero, {}),
            ("LEV-C0", (1234,), a_shift * RARE, {}),
            ("UNTIED", (1235, 1236), zero, {}),
        ],
        "eps": [("LEV", (1234,), zero, {}), ("LEV-EPS", (1234,), b_shift * RARE, {})],
        "controls": [
            ("UNTIED-C0", (1234,), zero, {}),
            ("UNTIED-EPS", tuple(eps_seeds), zero, {}),
            ("TIED-EPS", (1234,), zero, {}),
            ("LEV-EPS", tuple(s for s in eps_seeds if s != 1234), b_shift * RARE, {}),
        ],
    }
    for plan, groups in plans.items():
        _write(tmp_path / plan / "raw", plan, groups, rng, tokens, logged=False)
    return tmp_path / "controls" / "raw"


@pytest.mark.parametrize(
    "a_shift, expected",
    [
        (-0.8, "the input layer's, clip or not"),
        (-0.2, "the clip carries part of it"),
        (0.0, "not without the clip"),
        (0.3, "not without the clip"),
    ],
)
def test_question1(tmp_path, a_shift, expected):
    raw = ctl.joined(_raws(tmp_path, a_shift, -0.5))
    label, numbers = ctl.question1(raw)
    assert label == expected, numbers
    assert "(seed 1234)" in numbers


@pytest.mark.parametrize(
    "b_shift, seeds, expected, which",
    [
        (-0.5, (1234, 1235), "the lead survives eps 1e-10", "seed-paired over seeds 1234, 1235"),
        (0.0, (1234, 1235), "eps carries it against the matched head too", "seed-paired"),
        (-0.5, (1234,), "the lead survives eps 1e-10", "one seed"),
    ],
)
def test_question2(tmp_path, b_shift, seeds, expected, which):
    raw = ctl.joined(_raws(tmp_path, -0.8, b_shift, seeds))
    label, numbers = ctl.question2(raw)
    assert label == expected, numbers
    assert which in numbers


def test_the_partners_come_from_their_experiments(tmp_path):
    raw = ctl.joined(_raws(tmp_path, -0.8, -0.5))
    assert raw.seeds("LEV-R")[1234]["source"] == "regime"  # the regime's LEV, renamed
    assert sorted(raw.seeds("UNTIED")) == [1234, 1235, 1236]
    assert (
        raw.seeds("LEV-EPS")[1234]["source"] == "eps" and raw.seeds("LEV-EPS")[1235]["source"] == "controls"
    )
    assert "TIED" not in {r["group"] for r in raw.runs if r["source"] == "regime"}


def test_a_missing_control_leaves_its_question_open(tmp_path):
    raw_dir = _raws(tmp_path, -0.8, -0.5)
    raw = ctl.joined(raw_dir)
    raw.runs = [r for r in raw.runs if r["group"] != "UNTIED-C0"]
    assert ctl.question1(raw)[0].startswith("open")


def test_the_page(tmp_path):
    raw_dir = _raws(tmp_path, -0.8, -0.5)
    page = ctl.write_controls_report(raw_dir, tmp_path / "out")["controls.md"].read_text()
    assert "**Q1, the clip**: the input layer's, clip or not." in page
    assert "**Q2, Adam's eps**: the lead survives eps 1e-10." in page
    assert "## zero-shot, by target frequency (the paper's buckets)" in page
    assert "| < 1e-07 | LEV-C0 - UNTIED-C0 |" in page and "| < 1e-07 | LEV-EPS - UNTIED-EPS |" in page
    again = ctl.write_controls_report(raw_dir, tmp_path / "again")["controls.md"].read_text()
    assert again == page


def test_the_committed_controls_page_is_that_of_the_committed_raw_files(tmp_path):
    """The committed controls.md is the report of results/controls/raw and the other experiments' raw."""
    from tests.experiments.committed import assert_pages_regenerate

    assert_pages_regenerate(ctl.write_controls_report, "controls", ctl.PAGES, tmp_path, plots=False)
