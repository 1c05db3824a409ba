"""The budget plan: one run per side trained in stages in one directory (each stage resumes the last
and is a prefix of the longer run), exported and evaluated at every stage, on a larger split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_lev.config import load_config
from megatron_lev.plan import validate_run
from megatron_lev.training.schedule import learning_rate
from studies.collect import collect_study
from studies.plans import BUDGET_STAGES, PLANS, REGIME_CONFIG, REGIME_TOKENS_PER_STEP, study_plan
from studies.runner import Study

TOK = "tok.json"


def _study(tmp_path) -> Study:
    pile = tmp_path / "pile"
    pile.mkdir(exist_ok=True)
    return Study(pile, tmp_path / "budget", plan="budget", tokenizer=tmp_path / TOK)


def test_regime_config_steps_are_the_plans_tokens_per_step():
    cfg = load_config([REGIME_CONFIG], validate=False)
    assert cfg.train.global_batch_size * cfg.model.seq_length == REGIME_TOKENS_PER_STEP
    assert PLANS["budget"].tokens_per_step == REGIME_TOKENS_PER_STEP


def test_staged_steps_resume_convert_their_own_tag_and_evaluate_apart(tmp_path):
    study = _study(tmp_path)
    assert study.grid.max_chars_per_subset == PLANS["budget"].max_chars_per_subset == 5_000_000
    run = study_plan("budget")[0]
    steps = study.run_steps(run)
    suffixes = [f"-i{n}" for n in BUDGET_STAGES]
    assert [s.name for s in steps] == [
        *(f"{k}-{run.name}{s}" for s in suffixes for k in ("train", "convert", "evaluate")),
        f"geometry-{run.name}",
    ]
    for n, s in zip(BUDGET_STAGES, suffixes, strict=True):
        train, convert, evaluate = (
            next(x for x in steps if x.name == f"{k}-{run.name}{s}") for k in ("train", "convert", "evaluate")
        )
        # the full run's length and data order at every stage; it stops at the stage's multiple
        assert train.command()[-2:] == [
            f"train.train_tokens={BUDGET_STAGES[-1] * REGIME_TOKENS_PER_STEP}",
            f"train.exit_interval={BUDGET_STAGES[0]}",
        ]
        conv = convert.command()
        assert conv[conv.index("--tag") + 1] == f"iter_{n:07d}"
        assert str(study.run_dir(run) / f"hf{s}") in conv
        ev = evaluate.command()
        assert str(study.run_dir(run) / f"eval{s}") == ev[ev.index("--out") + 1]


def test_every_stage_is_a_prefix_of_the_longer_run(tmp_path):
    """The rate at step i does not depend on the run's length (a fixed warm-up, then constant), the
    config validates, and the runs differ from the regime's only in the schedule."""
    study = _study(tmp_path)
    for run in study_plan("budget"):
        cfg = study.run_config(run)
        assert cfg.train.lr_decay_style == "constant" and cfg.train.lr_warmup_iters == 100
        assert not any(o.startswith("train.lr_warmup_fraction=") for o in run.overrides)
        short = {i: learning_rate(i, cfg.train, BUDGET_STAGES[0]) for i in range(0, BUDGET_STAGES[0], 7)}
        long = {i: learning_rate(i, cfg.train, BUDGET_STAGES[-1]) for i in short}
        assert short == long and short[0] < short[98] < cfg.train.lr == short[700]
        validate_run(cfg, 1, cuda=False, tokenizer_vocab=50277)


def _staged_run(out: Path, name: str, stages, geometry: bool) -> None:
    """A budget run's directory and step markers, evaluated at `stages` (and its geometry step)."""
    state = out / ".steps"
    state.mkdir(parents=True, exist_ok=True)
    run = out / "runs" / name
    (run / "geometry").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.yaml").write_text("train: {}\n")
    for n in stages:
        (run / f"eval-i{n}").mkdir()
        (run / f"eval-i{n}" / "eval.json").write_text(json.dumps({"results": [], "stage": n}))
        for kind in ("train", "convert", "evaluate"):
            (state / f"{kind}-{name}-i{n}.json").write_text(json.dumps({"seconds": 1.0, "command": ["x"]}))
    if geometry:
        (run / "geometry" / "geometry.json").write_text("{}")
        (state / f"geometry-{name}.json").write_text(json.dumps({"seconds": 1.0, "command": ["x"]}))


def test_collect_copies_every_stages_evaluation(tmp_path):
    out = tmp_path / "budget"
    name = "tied-s1234"
    _staged_run(out, name, BUDGET_STAGES, geometry=True)
    (out / ".steps" / f"train-lev-s1234-i{BUDGET_STAGES[0]}.json").write_text(
        json.dumps({"seconds": 1.0})
    )  # its first stage trained, not evaluated: nothing to collect
    raw = tmp_path / "raw"
    collect_study(out, raw, log=lambda *_: None, plan="budget")
    held = sorted(p.name for p in (raw / name).iterdir())
    assert held == sorted(
        ["config.yaml", "eval.json", "geometry.json", "metrics.jsonl", "timing.json"]
        + [f"eval-i{n}.json" for n in BUDGET_STAGES]
    )
    assert json.loads((raw / name / "eval.json").read_text())["stage"] == BUDGET_STAGES[-1]
    assert not (raw / "lev-s1234").exists()
    timing = json.loads((raw / name / "timing.json").read_text())
    assert set(timing["steps"]) == {
        f"{k}-i{n}" for n in BUDGET_STAGES for k in ("train", "convert", "evaluate")
    } | {"geometry"}


def _eval(tokens, nll) -> dict:
    doc = {
        "tokens": tokens.sum(1).tolist(),
        "nll_sum": nll.sum(1).tolist(),
        "input_band_tokens": tokens.T.tolist(),
        "input_band_nll_sum": nll.T.tolist(),
        "target_band_tokens": tokens.T.tolist(),
        "target_band_nll_sum": nll.T.tolist(),
    }
    return {"results": [{"corpus_kind": "mmidx", "name": "x", "per_document": doc}]}


def _raw(tmp_path, gap, stages=BUDGET_STAGES) -> Path:
    """Raw files whose LEV - TIED is `gap(k)` at stage k = 1..4 (plus document noise), for `stages`."""
    rng = np.random.default_rng(3)
    raw = tmp_path / "raw"
    tokens = rng.integers(20, 60, size=(200, 3)).astype(float)
    for k, n in enumerate(stages, start=1):
        base = 5.0 + rng.normal(0, 0.3, size=tokens.shape)
        for run, shift in (("tied-s1234", 0.0), ("lev-s1234", gap(k))):
            (raw / run).mkdir(parents=True, exist_ok=True)
            nll = tokens * (base + shift + rng.normal(0, 0.01, size=tokens.shape))
            (raw / run / f"eval-i{n}.json").write_text(json.dumps(_eval(tokens, nll)))
    for run, run_gap in (("tied-s1234", lambda k: 0.0), ("lev-s1234", gap)):
        # the trainer's validation every 100 steps (none at a stage's own step), with the same gap
        valid = [
            {"kind": "valid", "iteration": i, "loss": 5.0 + run_gap(k) + (0.01 if i % 200 else -0.01)}
            for k, n in enumerate(stages, start=1)
            for i in range(n - stages[0] + 100, n, 100)
        ]
        lines = [{"kind": "train", "iteration": 1, "loss": 9.0}, *valid]
        (raw / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return raw


def test_the_report_reads_a_shrinking_gap_and_its_crossing(tmp_path):
    from studies import budget_report as br

    raw = _raw(tmp_path, lambda k: 0.3 - 0.1 * np.log2(k))
    c = br.curve(raw)
    assert c["b"] == pytest.approx(-0.1, abs=0.01) and c["b_ci"][1] < 0
    assert c["crossing_doublings"] == pytest.approx(3.0, abs=0.3)
    page = br.report(raw)
    assert "**Overall: the gap shrinks**" in page and "crosses 0 at 16." in page
    br.write_budget_report(raw, tmp_path / "out")
    assert (tmp_path / "out" / "curve.md").read_text() == page
    assert (tmp_path / "out" / "plots" / "curve.png").stat().st_size > 0


def test_the_trainer_gap_between_stages_is_the_mean_and_spread_of_each_window(tmp_path):
    from studies import budget_report as br

    raw = _raw(tmp_path, lambda k: 0.1 * k, stages=BUDGET_STAGES[:3])
    windows = br.trainer_gap(raw)
    assert [w["steps"] for w in windows] == [(0, 1000), (1000, 2000), (2000, 3000)]
    for k, w in enumerate(windows, start=1):
        # LEV's +-0.01 alternation against TIED's same alternation: the gap is exactly 0.1 k
        assert (
            w["points"] == 9
            and w["mean"] == pytest.approx(0.1 * k)
            and w["sd"] == pytest.approx(0, abs=1e-12)
        )
    page = br.report(raw)
    assert "| 2,001-3,000 | 9 | +0.300 | 0.000 | +0.300 | +0.300 |" in page


def test_the_report_reads_a_flat_gap_as_not_shrinking(tmp_path):
    from studies import budget_report as br

    raw = _raw(tmp_path, lambda k: 0.1)
    c = br.curve(raw)
    assert c["b_ci"][0] < 0 < c["b_ci"][1] and "crossing_doublings" not in c
    for (tied, lev), g in zip(c["sides"], c["gap"], strict=True):  # the sides' table is the gap's two terms
        assert lev - tied == pytest.approx(g)
    page = br.report(raw)
    assert "**Overall: the gap does not shrink**" in page and "Partial" not in page
    assert 'the regime\'s verdict stands, with "over a 4x longer run with a constant rate"' in page


def test_collect_takes_a_run_stopped_after_some_stages_with_the_stages_it_has(tmp_path):
    """A run stopped after stage 2 is collected with its two evaluations (the second as eval.json),
    no geometry, and a line naming what it lacks; a stage after a missing one is not taken."""
    out = tmp_path / "budget"
    _staged_run(out, "tied-s1234", BUDGET_STAGES[:2], geometry=False)
    _staged_run(out, "lev-s1234", BUDGET_STAGES[:2], geometry=False)
    # the last stage's markers without the third's (a damaged state): not a prefix, not collected
    (out / "runs" / "lev-s1234" / f"eval-i{BUDGET_STAGES[3]}").mkdir()
    for kind in ("train", "convert", "evaluate"):
        (out / ".steps" / f"{kind}-lev-s1234-i{BUDGET_STAGES[3]}.json").write_text(
            json.dumps({"seconds": 1.0})
        )
    raw = tmp_path / "raw"
    (raw / "tied-s1234").mkdir(parents=True)
    (raw / "tied-s1234" / "geometry.json").write_text("{}")  # an earlier, different collection's
    lines = []
    collect_study(out, raw, log=lines.append, plan="budget")
    for name in ("tied-s1234", "lev-s1234"):
        assert sorted(p.name for p in (raw / name).iterdir()) == sorted(
            ["config.yaml", "eval.json", "metrics.jsonl", "timing.json"]
            + [f"eval-i{n}.json" for n in BUDGET_STAGES[:2]]
        )
        assert json.loads((raw / name / "eval.json").read_text())["stage"] == BUDGET_STAGES[1]
        assert (
            f"{name}: partial, evaluated at iterations {BUDGET_STAGES[0]}, {BUDGET_STAGES[1]}; "
            f"not at {BUDGET_STAGES[2]}, {BUDGET_STAGES[3]}; no geometry"
        ) in lines
    assert {r["name"] for r in json.loads((raw / "study.json").read_text())["runs"]} == {
        "tied-s1234",
        "lev-s1234",
    }


def test_the_report_of_two_stages_is_one_doubling_and_says_it_is_partial(tmp_path):
    from studies import budget_report as br

    raw = _raw(tmp_path, lambda k: 0.3 - 0.02 * (k - 1), stages=BUDGET_STAGES[:2])
    c = br.curve(raw)
    assert c["stages"] == list(BUDGET_STAGES[:2])
    assert c["b"] == pytest.approx(c["gap"][1] - c["gap"][0], abs=1e-12)
    assert c["b"] == pytest.approx(-0.02, abs=0.005) and c["b_ci"][1] < 0
    page = br.report(raw)
    assert "**Partial: 2 of the plan's 4 stages.**" in page
    # the counts are the split's, not what the first stage (2.048M of the run's 8.192M tokens) saw
    assert "the stage at 2.048M tokens had seen at most 25% of the split" in page
    assert f"not run: {BUDGET_STAGES[2]:,}, {BUDGET_STAGES[3]:,} steps" in page
    assert "**Overall: the gap shrinks**" in page
    # crossing at 15 doublings of 2.048M tokens: far past twice the full run, so the verdict stands
    assert 'the regime\'s verdict stands, with "over a 2x longer run with a constant rate"' in page
    near = _raw(tmp_path / "near", lambda k: 0.3 - 0.15 * (k - 1), stages=BUDGET_STAGES[:2])
    assert "the partial points towards a change" in br.report(near)
    br.write_budget_report(raw, tmp_path / "out")
    assert (tmp_path / "out" / "plots" / "curve.png").stat().st_size > 0


def test_the_report_needs_two_stages_of_both_runs(tmp_path):
    from megatron_lev.errors import DataError
    from studies import budget_report as br

    raw = _raw(tmp_path, lambda k: 0.1, stages=BUDGET_STAGES[:2])
    (raw / "lev-s1234" / f"eval-i{BUDGET_STAGES[1]}.json").unlink()
    with pytest.raises(DataError, match="share 1 evaluated stage"):
        br.report(raw)


def test_the_committed_curve_is_that_of_the_committed_raw_files(tmp_path):
    """The committed curve.md is the report of results/budget/raw."""
    from studies import budget_report as br
    from tests.experiments.committed import assert_pages_regenerate

    assert_pages_regenerate(br.write_budget_report, "budget", br.PAGES, tmp_path, plots=False)
