"""The lower learning rate's report (`studies/lr_report.py`) from synthetic raw files of the three
plans it reads: the README's outcomes per side, the 0.01 reading floor, and whether the verdict at
this scale changes with each side at its better rate."""

from __future__ import annotations

import numpy as np
import pytest

from studies import lr_report as lr
from studies.plan_raw import PlanRaw
from tests.experiments.test_clip import BANDS, _write


def _raws(tmp_path, tied_low: float, lev: float, lev_low: float) -> dict:
    """Shifts in nats on every band: TIED (clip) 0, ALBERT-32 +0.3, LEV (regime) `lev`, TIED-LR05
    `tied_low`, LEV-LR05 `lev_low`."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(40, BANDS)).astype(float)
    full = lambda x: np.full(BANDS, x)  # noqa: E731
    _write(tmp_path / "clip" / "raw", "clip", [("TIED", (1234,), full(0.0), {})], rng, tokens, logged=True)
    regime = [
        ("TIED", (1234,), full(0.0), {}),
        ("LEV", (1234,), full(lev), {}),
        ("ALBERT-32", (1234,), full(0.3), {}),
    ]
    _write(tmp_path / "regime" / "raw", "regime", regime, rng, tokens, logged=False)
    low = [("TIED-LR05", (1234,), full(tied_low), {}), ("LEV-LR05", (1234,), full(lev_low), {})]
    _write(tmp_path / "lr" / "raw", "lr", low, rng, tokens, logged=True)
    return {name: PlanRaw(tmp_path / name / "raw") for name in ("lr", "clip", "regime")}


@pytest.mark.parametrize(
    "tied_low, lev, lev_low, tied_out, lev_out, verdict",
    [
        # TIED worse at 5e-4, LEV better by 0.1: LEV at 5e-4 is ahead of TIED at 1e-3
        (0.1, 0.08, -0.02, "1e-3 stands", "prefers a lower rate", "the verdict at this scale changes"),
        # nothing moves: LEV stays 0.08 behind everywhere, refute on the rare bands before and after
        (0.0, 0.08, 0.08, "not resolved", "not resolved", "the regime's verdict stands"),
        # a difference under the 0.01 floor is not read even where its interval excludes zero
        (0.005, 0.08, 0.075, "not resolved", "not resolved", "the regime's verdict stands"),
        # LEV better at 5e-4 but still behind TIED with an interval above zero, and still behind on rare
        (0.0, 0.2, 0.1, "not resolved", "prefers a lower rate", "the regime's verdict stands"),
    ],
)
def test_the_outcomes(tmp_path, tied_low, lev, lev_low, tied_out, lev_out, verdict):
    raw = lr.Sources(_raws(tmp_path, tied_low, lev, lev_low))
    outcomes = lr.rate_outcomes(raw)
    assert outcomes["TIED"][0] == tied_out and outcomes["LEV"][0] == lev_out
    label, reasons = lr.verdict_change(raw, outcomes)
    assert label == verdict, reasons


def test_the_page_and_plot(tmp_path):
    _raws(tmp_path, 0.1, 0.08, -0.02)
    paths = lr.write_lr_report(tmp_path / "lr" / "raw", tmp_path / "out")
    page = paths["lr.md"].read_text()
    assert "| TIED | +0.10" in page and "| 1e-3 stands |" in page  # +0.1 with the documents' noise
    assert "| LEV | -0.09" in page or "| LEV | -0.10" in page
    assert "**the verdict at this scale changes**" in page
    assert "at the better rates: LEV-LR05 - TIED" in page
    # the descriptive table, one row per run at its rate: the clip factor a run logged (0.9), or for a
    # regime run (DeepSpeed clipped, nothing logged) 1 / its logged norm of 4
    rows = {line.split("|")[1].strip(): line.split("|") for line in page.splitlines() if "e-" in line[:20]}
    assert set(rows) == {"TIED-LR05", "LEV-LR05", "TIED", "LEV"}
    assert rows["TIED-LR05"][2].strip() == "5e-4" and rows["LEV"][2].strip() == "1e-3"
    assert rows["TIED-LR05"][5].strip() == "0.900" and rows["LEV"][5].strip() == "0.250"
    assert (tmp_path / "out" / "plots" / "lr.png").stat().st_size > 0
    again = lr.write_lr_report(tmp_path / "lr" / "raw", tmp_path / "again", plots=False)
    assert again["lr.md"].read_text() == page


def test_a_missing_neighbour_is_one_line(tmp_path):
    from megatron_lev.errors import DataError

    _raws(tmp_path, 0.0, 0.0, 0.0)
    import shutil

    shutil.rmtree(tmp_path / "clip")
    with pytest.raises(DataError, match="clip/raw: missing"):
        lr.write_lr_report(tmp_path / "lr" / "raw", tmp_path / "out")


def test_the_committed_lr_page_is_that_of_the_committed_raw_files(tmp_path):
    """The committed lr.md is the report of results/lr/raw and the clip and regime raw files."""
    from tests.experiments.committed import assert_pages_regenerate

    assert_pages_regenerate(lr.write_lr_report, "lr", lr.PAGES, tmp_path, plots=False)
