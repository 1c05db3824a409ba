"""The cool-down plan: the budget's staged runs, and from each stage's checkpoint a branch that decays
the rate over 10% of the stage's steps, exported and evaluated in its own directory; the report's
readings on synthetic raw files with known gaps."""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from megatron_lev.config import load_config
from megatron_lev.errors import ConfigError
from megatron_lev.training.resume_checks import schedule_branch
from megatron_lev.training.schedule import learning_rate
from studies.collect import collect_study
from studies.plans import BUDGET_STAGES, PLANS, REGIME_TOKENS_PER_STEP, study_plan
from studies.runner import Study

PLAN = PLANS["cooldown"]


def _study(tmp_path, **kw) -> Study:
    pile = tmp_path / "pile"
    pile.mkdir(exist_ok=True)
    return Study(pile, tmp_path / "cooldown", plan="cooldown", tokenizer=tmp_path / "tok.json", **kw)


def test_the_plan_is_the_budgets_runs_on_two_seeds_with_the_logits_loss():
    budget = {r.name: r for r in study_plan("budget")}
    runs = study_plan("cooldown")
    assert sorted(r.name for r in runs) == ["lev-s1234", "lev-s1235", "tied-s1234", "tied-s1235"]
    for run in runs:
        twin = budget[run.name.replace("s1235", "s1234")]
        assert run.overrides[1:] == (*twin.overrides[1:], "model.fused_loss=false")
    assert PLAN.stages == BUDGET_STAGES and PLAN.cooldown_iters(2000) == 200


def test_each_stage_is_followed_by_its_branch_from_its_own_checkpoint(tmp_path):
    study = _study(tmp_path)
    run = study_plan("cooldown")[0]
    names = [s.name for s in study.run_steps(run)]
    per_stage = [
        f"{k}-{run.name}{s}"
        for n in BUDGET_STAGES
        for k, s in (
            ("train", f"-i{n}"),
            *((k, f"-cool-i{n}") for k in ("train", "convert", "evaluate")),
            ("convert", f"-i{n}"),
            ("evaluate", f"-i{n}"),
        )
    ]
    # each stage trains, then its branch trains and is evaluated, then the stage is; geometry last
    assert names == [*per_stage, f"geometry-{run.name}"]
    steps = {s.name: s for s in study.run_steps(run)}
    n = BUDGET_STAGES[1]
    branch = study.out / "runs" / f"{run.name}-cool-i{n}"
    train = steps[f"train-{run.name}-cool-i{n}"].command()
    assert train[-5:] == [
        f"train.train_tokens={(n + n // 10) * REGIME_TOKENS_PER_STEP}",
        "train.lr_decay_style=wsd",
        f"train.lr_wsd_decay_iters={n // 10}",
        "train.lr_wsd_decay_style=linear",
        f"train.load={study.run_dir(run) / 'checkpoints' / f'iter_{n:07d}'}",
    ]
    assert f"train.save={branch / 'checkpoints'}" in train and "train.exit_interval" not in " ".join(
        train[-5:]
    )
    ev = steps[f"evaluate-{run.name}-cool-i{n}"].command()
    assert ev[ev.index("--out") + 1] == str(branch / "eval")


def test_max_stage_runs_the_first_stages_only_and_refuses_another_number(tmp_path):
    run = study_plan("cooldown")[0]
    names = [s.name for s in _study(tmp_path, max_stage=2000).run_steps(run)]
    assert names[-1] == f"evaluate-{run.name}-i2000" and not any("i3000" in n for n in names)
    assert not any(n.startswith("geometry") for n in names)
    with pytest.raises(ConfigError, match="--max-stage 1500: not a stage"):
        _study(tmp_path, max_stage=1500).run_steps(run)
    with pytest.raises(
        ConfigError, match="--max-stage 1000: not a stage of the study plan .it has no stages"
    ):
        Study(tmp_path / "pile", tmp_path / "study", plan="study", max_stage=1000)
    lane = _study(tmp_path, max_stage=2000).lane_command(1, [run])
    assert lane[lane.index("--max-stage") + 1] == "2000"


def test_the_trainer_takes_the_branch_as_a_branch_with_the_stage_runs_rates(tmp_path):
    """Every update before the stage's checkpoint has the constant run's rate; after it the rate falls
    linearly to the floor, the last update at the floor; the trainer's resume check calls it a branch."""
    study = _study(tmp_path)
    run = study_plan("cooldown")[2]  # LEV: its seed side's multiplier is a parameter group, not the rate
    n = BUDGET_STAGES[0]
    steps = {s.name: s for s in study.run_steps(run)}
    overrides = steps[f"train-{run.name}-cool-i{n}"].command()[6:]
    branch = load_config(
        [study.config], [o for o in overrides if not o.startswith("train.load=")], validate=False
    )
    stage = study.run_config(run)
    stage_overrides = steps[f"train-{run.name}-i{n}"].command()[6:]
    stage = load_config([study.config], stage_overrides, validate=False)
    total = (n + n // 10, BUDGET_STAGES[-1])
    rates = [learning_rate(i, branch.train, total[0]) for i in range(total[0])]
    assert rates[:n] == [learning_rate(i, stage.train, total[1]) for i in range(n)]
    assert rates[n - 1] == stage.train.lr and rates[-1] == pytest.approx(stage.train.min_lr)
    assert all(a > b for a, b in zip(rates[n:], rates[n + 1 :], strict=False))
    stored = {"train": asdict(stage)["train"]}  # as a checkpoint's config records it
    why = schedule_branch(stored, branch, f"iter_{n:07d}", None)
    assert why is not None and why.startswith(f"a branch: the {n:,} updates")


def _marker(state: Path, name: str) -> None:
    (state / f"{name}.json").write_text(json.dumps({"seconds": 1.0, "command": ["x"]}))


def test_collect_takes_each_evaluated_branch_beside_its_stage(tmp_path):
    out = tmp_path / "cooldown"
    state = out / ".steps"
    state.mkdir(parents=True)
    name = "tied-s1234"
    run = out / "runs" / name
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.yaml").write_text("train: {}\n")
    for n in BUDGET_STAGES[:2]:
        (run / f"eval-i{n}").mkdir()
        (run / f"eval-i{n}" / "eval.json").write_text(json.dumps({"stage": n}))
        for k in ("train", "convert", "evaluate"):
            _marker(state, f"{k}-{name}-i{n}")
    branch = out / "runs" / f"{name}-cool-i1000"  # stage 1's branch is done; stage 2's only trained
    (branch / "eval").mkdir(parents=True)
    (branch / "eval" / "eval.json").write_text(json.dumps({"cooled": 1000}))
    (branch / "metrics.jsonl").write_text('{"kind": "train"}\n')
    for k in ("train", "convert", "evaluate"):
        _marker(state, f"{k}-{name}-cool-i1000")
    _marker(state, f"train-{name}-cool-i2000")
    raw = tmp_path / "raw"
    collect_study(out, raw, log=lambda *_: None, plan="cooldown")
    held = sorted(p.name for p in (raw / name).iterdir())
    assert "eval-cool-i1000.json" in held and "metrics-cool-i1000.jsonl" in held
    assert "eval-cool-i2000.json" not in held
    assert json.loads((raw / name / "eval-cool-i1000.json").read_text()) == {"cooled": 1000}


def _eval(tokens, nll) -> dict:
    doc = {"tokens": tokens.sum(1).tolist(), "nll_sum": nll.sum(1).tolist()}
    for key in ("input_band", "target_band", "bucket"):
        doc[f"{key}_tokens"], doc[f"{key}_nll_sum"] = tokens.T.tolist(), nll.T.tolist()
    return {
        "results": [
            {"corpus_kind": kind, "name": "x", "per_document": doc, "buckets": [{"bucket": "< 1e-07"}] * 3}
            for kind in ("mmidx", "text")
        ]
    }


def _raw(tmp_path, gap, cooled_gap, seeds=(1234,), stages=BUDGET_STAGES[:2], noise=0.01) -> Path:
    """Raw files whose LEV - TIED is `gap(k)` at stage k (constant) and `cooled_gap(k, seed)` for the
    branches, with per-document noise; the trainer's validation gap alternates by +-`noise`."""
    rng = np.random.default_rng(5)
    raw = tmp_path / "raw"
    tokens = rng.integers(20, 60, size=(200, 3)).astype(float)
    for seed in seeds:
        for k, n in enumerate(stages, start=1):
            for infix, shift in (("", gap(k)), ("-cool", cooled_gap(k, seed))):
                base = 5.0 + rng.normal(0, 0.3, size=tokens.shape)
                for side, s in (("tied", 0.0), ("lev", shift)):
                    (raw / f"{side}-s{seed}").mkdir(parents=True, exist_ok=True)
                    nll = tokens * (base + s + rng.normal(0, 0.01, size=tokens.shape))
                    (raw / f"{side}-s{seed}" / f"eval{infix}-i{n}.json").write_text(
                        json.dumps(_eval(tokens, nll))
                    )
        for side in ("tied", "lev"):
            valid = [
                {"kind": "valid", "iteration": i, "loss": 5.0 + (noise if side == "lev" and i % 200 else 0.0)}
                for n in stages
                for i in range(n - 200, n + 1, 100)
            ]
            (raw / f"{side}-s{seed}" / "metrics.jsonl").write_text(
                "".join(json.dumps(r) + "\n" for r in valid)
            )
    return raw


def test_the_report_reads_what_the_cool_down_moves_and_the_cooled_trend(tmp_path):
    from studies import cooldown_report as cr

    # constant: the gap grows by 0.05 a doubling; cooled: 0.1 lower at every stage and shrinking
    raw = _raw(tmp_path, lambda k: 0.05 * k, lambda k, s: 0.05 * k - 0.1 - 0.1 * (k - 1))
    c = cr.seed_curve(raw, 1234, BUDGET_STAGES[:2])
    assert c["d"] == pytest.approx([-0.1, -0.2], abs=0.01) and all(hi < 0 for _, hi in c["d_ci"])
    assert c["b_constant"] == pytest.approx(0.05, abs=0.01) and c["b_cooled"] == pytest.approx(
        -0.05, abs=0.01
    )
    s = cr.s_ckpt(raw, 1234, BUDGET_STAGES[:2])
    # validations at n-200, n-100, n: the gap is +0.01 at n-100 only (i % 200 != 0)
    assert s == pytest.approx(np.std([0.0, 0.01, 0.0], ddof=1))
    lo, hi = cr.widened(c["b_cooled"], c["b_cooled_ci"], s, c["sxx"])
    assert lo < c["b_cooled_ci"][0] and hi > c["b_cooled_ci"][1] and c["sxx"] == 0.5
    page = cr.report(raw)
    assert "**Stage 1,000: cooling moves the gap**" in page and "the gap shrinks when cooled" in page
    assert (
        "**Partial.** Not evaluated: seed 1234: 3,000, 4,000; seed 1235: 1,000, 2,000, 3,000, 4,000" in page
    )
    cr.write_cooldown_report(raw, tmp_path / "out")
    assert (tmp_path / "out" / "cooled.md").read_text() == page
    assert (tmp_path / "out" / "plots" / "cooled.png").stat().st_size > 0


def test_a_checkpoint_spread_wider_than_the_trend_leaves_it_unresolved_and_two_seeds_use_t(tmp_path):
    from studies import cooldown_report as cr

    raw = _raw(tmp_path, lambda k: 0.05 * k, lambda k, s: 0.05 * k + 0.02 * (k - 1), noise=0.3)
    page = cr.report(raw)
    assert "cooled, the trend is not resolved" in page and "does not move the gap" in page
    two = _raw(
        tmp_path / "two",
        lambda k: 0.0,
        lambda k, s: 0.1 * (k - 1) * (1 if s == 1234 else 1.1),
        seeds=(1234, 1235),
    )
    page = cr.report(two)
    over = r"\*\*Over seeds 1234, 1235\*\* \(stages 1,000-2,000\): bc = ([+-][0-9.]+) \[([+-][0-9.]+), "
    found = re.search(over, page)
    assert found is not None and float(found[1]) == pytest.approx(0.105, abs=0.005) and float(found[2]) > 0
    assert "(Student t, 1 df): the gap grows when cooled" in page and "alone" not in page


def test_a_seed_with_more_stages_is_read_over_the_common_stages_with_the_others_and_alone(tmp_path):
    from studies import cooldown_report as cr

    raw = _raw(
        tmp_path,
        lambda k: 0.0,
        lambda k, s: 0.1 * (k - 1) * (1 if s == 1234 else 1.1),
        seeds=(1234, 1235),
        stages=BUDGET_STAGES[:3],
    )
    for side in ("tied", "lev"):  # seed 1235 stops at stage 2
        for infix in ("", "-cool"):
            (raw / f"{side}-s1235" / f"eval{infix}-i{BUDGET_STAGES[2]}.json").unlink()
    page = cr.report(raw)
    found = re.search(r"\*\*Over seeds 1234, 1235\*\* \(stages 1,000-2,000\): bc = ([+-][0-9.]+) ", page)
    assert found is not None and float(found[1]) == pytest.approx(
        0.105, abs=0.005
    )  # not seed 1234's 3-stage fit
    alone = re.search(r"\*\*Seed 1234 alone\*\* \(stages 1,000-3,000\): bc = ([+-][0-9.]+) ", page)
    three = cr.seed_curve(raw, 1234, BUDGET_STAGES[:3])["b_cooled"]
    assert alone is not None and float(alone[1]) == pytest.approx(three, abs=5e-5) and three > 0.11


def test_the_committed_cooled_page_is_that_of_the_committed_raw_files(tmp_path):
    from studies import cooldown_report as cr
    from tests.experiments.committed import assert_pages_regenerate

    assert_pages_regenerate(cr.write_cooldown_report, "cooldown", cr.PAGES, tmp_path, plots=False)
