"""The eps report (`studies/eps_report.py`) from synthetic raw files: the README's outcomes from known
differences on the never-seen bucket and a known premise, and the page."""

from __future__ import annotations

import json

import numpy as np
import pytest

from studies import eps_report as er
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
    raw = er.CombinedRaw(er.PlanRaw(raw_dir), er.PlanRaw(tmp_path / "regime" / "raw"))
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
