"""The clip report (`studies/clip_report.py`) from synthetic raw files with known differences: the
change C and its interval, the README's outcomes, the paper's buckets, the clip factors, the pages."""

from __future__ import annotations

import json

import numpy as np
import pytest

from studies import clip_report as cr
from studies.plan_raw import PlanRaw

DOCS, BANDS = 40, 5
BAND_NLL = np.array([9.0, 8.0, 6.0, 5.0, 4.0])


def _result(kind: str, shift: np.ndarray, rng, tokens: np.ndarray) -> dict:
    nll = tokens * (BAND_NLL + shift) + rng.normal(0, 0.02, size=tokens.shape) * tokens
    doc = {"tokens": tokens.sum(1).astype(int).tolist(), "nll_sum": nll.sum(1).tolist()}
    rows = [
        {"band": str(b), "tokens": int(tokens[:, b].sum()), "vocab_ids": b, "mean_nll": 1.0}
        for b in range(BANDS)
    ]
    for side in ("target_band", "input_band", "bucket"):
        doc[f"{side}_tokens"] = tokens.T.astype(int).tolist()
        doc[f"{side}_nll_sum"] = nll.T.tolist()
    buckets = [{"bucket": label, "tokens": 1} for label in ("< 1e-07", "b1", "b2", "b3", ">= 1e-04")]
    return {
        "corpus_kind": kind,
        "mean_nll": float(nll.sum() / tokens.sum()),
        "count_bands": {"target": rows, "input": rows},
        "buckets": buckets,
        "per_document": doc,
    }


def _write(root, plan: str, groups, rng, tokens, logged: bool) -> None:
    root.mkdir(parents=True)
    runs = []
    for group, seeds, shift, extra in groups:
        for k, seed in enumerate(seeds):
            name = f"{group.lower()}-s{seed}"
            (root / name).mkdir()
            jitter = np.full(BANDS, (k - 1) * 0.01)
            results = [_result(kind, shift + jitter, rng, tokens) for kind in ("mmidx", "text")]
            (root / name / "eval.json").write_text(json.dumps({"results": results}))
            rows = []
            for it in (10, 20):
                row = {"kind": "train", "iteration": it, "loss": 5.0, "grad_norm": 4.0, "clipped": 1}
                if logged:
                    row.update({"clip_factor/global": 0.9, **extra})
                rows.append(row)
            (root / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            runs.append({"name": name, "group": group, "variant": "x", "seed": seed, "overrides": []})
    (root / "study.json").write_text(json.dumps({"plan": plan, "runs": runs}))


SEEDS = (1234, 1235, 1236)


def _raw(tmp_path, lev_sc_shift: np.ndarray, lev_r_shift: np.ndarray, untied_shift=0.0):
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(DOCS, BANDS)).astype(float)
    zero = np.zeros(BANDS)
    _write(
        tmp_path / "regime" / "raw",
        "regime",
        [
            ("TIED", SEEDS, zero, {}),
            ("LEV", SEEDS, lev_r_shift, {}),
            ("ALBERT-32", SEEDS[:1], np.full(BANDS, 0.3), {}),
            ("UNTIED", SEEDS[:1], np.full(BANDS, untied_shift), {}),
        ],
        rng,
        tokens,
        logged=False,
    )
    _write(
        tmp_path / "clip" / "raw",
        "clip",
        [
            ("TIED", SEEDS, zero, {}),
            ("LEV-SC", SEEDS, lev_sc_shift, {"clip_factor/lev_seed": 0.2}),
            ("TIED-C0", SEEDS[:1], zero, {}),
            ("LEV-C0", SEEDS[:1], lev_r_shift, {}),
            ("UNTIED", SEEDS[1:], np.full(BANDS, untied_shift), {}),
        ],
        rng,
        tokens,
        logged=True,
    )
    return cr.CombinedRaw(PlanRaw(tmp_path / "clip" / "raw"), PlanRaw(tmp_path / "regime" / "raw"))


RARE = np.array([0.0, 1.0, 0.0, 0.0, 0.0])  # band 1 (inputs seen 1-9 times) only


def test_the_change_c_is_the_known_difference_of_differences(tmp_path):
    raw = _raw(tmp_path, lev_sc_shift=0.1 * RARE, lev_r_shift=0.4 * RARE)
    c = cr.change(raw, "mmidx", ("input_band", 1))
    assert c["seeds"] == list(SEEDS)
    assert c["mean"] == pytest.approx(-0.3, abs=0.02)
    lo, hi = c["document"]
    assert lo < -0.25 and hi < 0  # the interval excludes zero where the shift is large beside the noise
    assert cr.change(raw, "mmidx", ("input_band", 3))["mean"] == pytest.approx(0.0, abs=0.02)


@pytest.mark.parametrize(
    "lev_sc, lev_r, expected",
    [
        (-0.3 * RARE, 0.4 * RARE, "the clipping carried the refute"),  # LEV-SC ahead on rare inputs
        (0.2 * RARE, 0.4 * RARE, "the clipping was part of it"),  # smaller, still behind
        (0.4 * RARE, 0.4 * RARE, "not the clipping"),
        (np.full(BANDS, 0.5), np.zeros(BANDS), "clipping the seed side on its own hurts"),
    ],
)
def test_the_first_question_s_outcomes(tmp_path, lev_sc, lev_r, expected):
    raw = _raw(tmp_path, lev_sc_shift=lev_sc, lev_r_shift=lev_r)
    outcome, reasons, _ = cr.question1(raw)
    assert outcome == expected, reasons


@pytest.mark.parametrize(
    "untied, expected",
    [(0.0, "the input layer's deficit holds with the head matched"), (0.5, "not the input layer's")],
)
def test_the_head_matched_question(tmp_path, untied, expected):
    raw = _raw(tmp_path, lev_sc_shift=0.4 * RARE, lev_r_shift=0.4 * RARE, untied_shift=untied)
    outcome, reasons = cr.question2(raw)
    assert expected in outcome, reasons
    assert "1234, 1235, 1236" in reasons[0]  # the regime's seed 1234 and this experiment's two


def test_the_pages(tmp_path):
    _raw(tmp_path, lev_sc_shift=0.1 * RARE, lev_r_shift=0.4 * RARE)
    paths = cr.write_clip_report(tmp_path / "clip" / "raw", tmp_path / "out", plots=True)
    assert sorted(paths) == sorted(cr.PAGES)
    bands = (tmp_path / "out" / "bands.md").read_text()
    assert "the paper's buckets" in bands and "| < 1e-07 |" in bands
    from studies.plan_raw import COUNT_SCOPE

    for name in ("bands.md", "rows.md", "verdict.md"):  # the pages that use the count bands say what counts
        assert (tmp_path / "out" / name).read_text().count(COUNT_SCOPE) == 1, name
    clipping = (tmp_path / "out" / "clipping.md").read_text()
    # logged factors for this experiment's runs; derived from the norm (1 / 4) for the regime's
    assert "| lev-sc-s1234 | 2 | 2/2 | 0.900 | 0.200 |" in clipping
    assert "| tied-s1234 (regime) | 2 | 2/2 | 0.250 | - |" in clipping
    assert (tmp_path / "out" / "plots" / "factors.png").stat().st_size > 0
    again = cr.write_clip_report(tmp_path / "clip" / "raw", tmp_path / "again", plots=False)
    for name in cr.PAGES:
        assert again[name].read_text() == paths[name].read_text()


def test_the_verdict_prints_each_interval_in_its_own_column(tmp_path):
    """No row of verdict.md mixes a document and a seed-paired interval: each has its column, and a
    comparison of one seed pair (against ALBERT-32-R, seed 1234) has no seed-paired interval."""
    raw = _raw(tmp_path, lev_sc_shift=0.1 * RARE, lev_r_shift=0.4 * RARE)
    page = cr.verdict_markdown(raw)
    header = "| comparison | slice | seed pairs | difference | document 95% | seed-paired 95% |"
    assert page.count(header) == 2
    rows = [line for line in page.splitlines() if line.startswith("| LEV") or line.startswith("| C =")]
    assert len(rows) == 7  # four regime criteria, C overall and input 1-9, LEV-R - UNTIED
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 6, row
        assert "document" not in row and "seed-paired" not in row, row
    albert = [r for r in rows if "ALBERT-32-R" in r]
    assert len(albert) == 2 and all(r.rstrip(" |").endswith("-") for r in albert)
    assert "| 1234, 1235, 1236 |" in next(r for r in rows if r.startswith("| LEV-R - UNTIED"))
    # the synthetic runs log no tokens or parameters: the scale names only what it rests on
    assert "at this scale only (one data sample, the seed pairs in each row)" in page


def test_the_scale_comes_from_the_logged_run(tmp_path):
    """`PlanRaw.scale`: the last logged step's cumulative tokens and the parameters the start logged
    (a resumed run's second start does not replace them)."""
    from studies.plan_raw import scale_phrase

    _raw(tmp_path, lev_sc_shift=0.1 * RARE, lev_r_shift=0.4 * RARE)
    raw = PlanRaw(tmp_path / "clip" / "raw")
    run = raw.run("TIED", 1234)
    assert raw.scale(run) == (None, None)
    rows = [
        {"kind": "event", "iteration": 0, "event": "start", "parameters": 11_429_568},
        {"kind": "train", "iteration": 10, "tokens": 20_480, "loss": 5.0},
        {"kind": "event", "iteration": 10, "event": "start", "parameters": 11_429_568},
        {"kind": "train", "iteration": 1000, "tokens": 2_048_000, "loss": 4.0},
    ]
    (tmp_path / "clip" / "raw" / run["name"] / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows)
    )
    scale = PlanRaw(tmp_path / "clip" / "raw").scale(run)
    assert scale == (2_048_000, 11_429_568)
    assert scale_phrase(*scale, "seed 1234") == (
        "2.05M tokens a run, TIED's 11.4M parameters, one data sample, seed 1234"
    )


def test_the_committed_clip_pages_are_those_of_the_committed_raw_files(tmp_path):
    """Every committed page of the clip experiment is the report of its raw files and the regime's."""
    from tests.experiments.committed import assert_pages_regenerate

    assert_pages_regenerate(cr.write_clip_report, "clip", cr.PAGES, tmp_path, plots=False)
