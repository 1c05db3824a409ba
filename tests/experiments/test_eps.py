"""The eps report (`studies/eps_report.py`) from synthetic raw files: the README's outcomes from known
differences on the never-seen bucket and a known premise, and the page."""

from __future__ import annotations

import json

import numpy as np
import pytest

from studies import eps_report as er
from studies.plan_raw import PlanRaw
from tests.experiments.test_clip import BANDS, _write

NEVER = np.array([1.0, 0.0, 0.0, 0.0, 0.0])  # the paper's bucket < 1e-7 (and band 0) only


def _rows(share: float) -> dict:
    band = {"band": "0", "rows": 10, "sqrt_v": {"q10": 1e-8, "q50": 1e-8, "q90": 1e-8}}
    return {"adam_eps": 1e-8, "bands": [{**band, "eps_share_median": share}]}


def _raw(tmp_path, eps_shift: float, share: float):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(40, BANDS)).astype(float)
    zero = np.zeros(BANDS)
    _write(
        tmp_path / "regime" / "raw",
        "regime",
        [("TIED", (1234,), zero, {}), ("LEV", (1234,), zero, {})],
        rng,
        tokens,
        logged=False,
    )
    raw = tmp_path / "eps" / "raw"
    _write(
        raw,
        "eps",
        [("LEV", (1234,), zero, {}), ("LEV-EPS", (1234,), eps_shift * NEVER, {})],
        rng,
        tokens,
        logged=True,
    )
    (raw / "lev-s1234" / "output_rows.json").write_text(json.dumps(_rows(share)))
    return raw


@pytest.mark.parametrize(
    "shift, share, expected",
    [
        (0.4, 0.5, "eps carries the lead"),
        (0.1, 0.5, "eps is part of it"),
        (0.0, 0.5, "not eps"),
        (-0.3, 0.5, "not eps"),
        (0.4, 0.1, "not eps (the premise fails)"),
    ],
)
def test_the_outcomes(tmp_path, shift, share, expected):
    raw_dir = _raw(tmp_path, shift, share)
    raw = er.CombinedRaw(PlanRaw(raw_dir), PlanRaw(tmp_path / "regime" / "raw"))
    label, reasons = er.outcome(raw)
    assert label == expected, reasons
    assert f"{share:.3f}" in reasons[0]


def test_the_page_and_plot(tmp_path):
    raw_dir = _raw(tmp_path, 0.4, 0.5)
    paths = er.write_eps_report(raw_dir, tmp_path / "out", plots=True)
    page = paths["eps.md"].read_text()
    assert "**eps carries the lead**" in page
    assert "| LEV-EPS - LEV | < 1e-07 |" in page and "| LEV - LEV-R | overall |" in page
    assert "| LEV | 0.500 |" in page and "| LEV-EPS | - |" in page  # LEV-EPS has no rows file here
    assert (tmp_path / "out" / "plots" / "eps.png").stat().st_size > 0
    again = er.write_eps_report(raw_dir, tmp_path / "again", plots=False)
    assert again["eps.md"].read_text() == page


@pytest.mark.parametrize(
    "share, mean, interval, expected",
    [
        (0.3, 0.196, (0.01, 0.4), "eps carries the lead"),  # both thresholds inclusive
        (0.3, 0.1959, (0.01, 0.4), "eps is part of it"),
        (0.2999, 0.4, (0.1, 0.7), "not eps (the premise fails)"),  # whatever D is
        (0.2999, -0.1, (-0.3, 0.1), "not eps (the premise fails)"),
        (0.5, 0.3, (0.0, 0.6), "not eps"),  # an interval that touches zero includes it
        (0.5, 0.3, None, "not available yet"),  # no interval (a resample without the bucket's tokens)
    ],
)
def test_the_outcomes_at_their_boundaries(tmp_path, monkeypatch, share, mean, interval, expected):
    raw_dir = _raw(tmp_path, 0.0, share)
    raw = er.CombinedRaw(PlanRaw(raw_dir), PlanRaw(tmp_path / "regime" / "raw"))
    fixed = {"seeds": [1234], "diffs": [mean], "mean": mean, "document": interval, "seed": None}
    monkeypatch.setattr(er.rr, "comparison", lambda *a, **k: fixed)
    monkeypatch.setattr(er, "reproduces_regime", lambda raw: (True, "reproduced"))
    assert er.outcome(raw)[0] == expected


def test_the_report_command_picks_the_eps_writer(tmp_path):
    from studies.__main__ import main

    raw_dir = _raw(tmp_path, 0.4, 0.5)
    assert main(["report", str(raw_dir), str(tmp_path / "out"), "--no-plots"]) == 0
    assert "**eps carries the lead**" in (tmp_path / "out" / "eps.md").read_text()


@pytest.mark.parametrize("regime_shift, reproduced", [(0.0, True), (0.05, False)])
def test_the_outcome_says_when_this_code_s_lev_is_not_the_regime_s(tmp_path, regime_shift, reproduced):
    """LEV here against the regime's LEV: the same numbers reproduce it; 0.05 nats everywhere does not."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(40, BANDS)).astype(float)
    zero = np.zeros(BANDS)
    regime = [("TIED", (1234,), zero, {}), ("LEV", (1234,), np.full(BANDS, regime_shift), {})]
    _write(tmp_path / "regime" / "raw", "regime", regime, rng, tokens, logged=False)
    rng = np.random.default_rng(0)  # the same noise for this code's LEV as for the regime's
    tokens = rng.integers(1, 30, size=(40, BANDS)).astype(float)
    _write(tmp_path / "x", "regime", [("TIED", (1234,), zero, {})], rng, tokens, logged=False)
    raw_dir = tmp_path / "eps" / "raw"
    groups = [("LEV", (1234,), zero, {}), ("LEV-EPS", (1234,), 0.4 * NEVER, {})]
    _write(raw_dir, "eps", groups, rng, tokens, logged=True)
    (raw_dir / "lev-s1234" / "output_rows.json").write_text(json.dumps(_rows(0.5)))
    raw = er.CombinedRaw(PlanRaw(raw_dir), PlanRaw(tmp_path / "regime" / "raw"))
    label, reasons = er.outcome(raw)
    assert label.startswith("eps carries the lead")
    assert label.endswith("about this code's LEV only") != reproduced, reasons[-1]


def test_the_committed_eps_page_is_that_of_the_committed_raw_files(tmp_path):
    """The committed eps.md is the report of results/eps/raw and the regime's raw files."""
    from tests.experiments.committed import assert_pages_regenerate

    assert_pages_regenerate(er.write_eps_report, "eps", er.PAGES, tmp_path, plots=False)
