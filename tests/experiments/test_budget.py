"""The budget plan: one run per side trained in stages in one directory (each stage resumes the last
and is a prefix of the longer run), exported and evaluated at every stage, on a larger split."""

from __future__ import annotations

import json

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
        assert train.command()[-1] == f"train.train_tokens={n * REGIME_TOKENS_PER_STEP}"
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


def test_collect_copies_every_stages_evaluation(tmp_path):
    out = tmp_path / "budget"
    state = out / ".steps"
    state.mkdir(parents=True)
    name = "tied-s1234"
    run = out / "runs" / name
    (run / "geometry").mkdir(parents=True)
    (run / "geometry" / "geometry.json").write_text("{}")
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.yaml").write_text("train: {}\n")
    for n in BUDGET_STAGES:
        (run / f"eval-i{n}").mkdir()
        (run / f"eval-i{n}" / "eval.json").write_text(json.dumps({"results": [], "stage": n}))
        for kind in ("train", "convert", "evaluate"):
            (state / f"{kind}-{name}-i{n}.json").write_text(json.dumps({"seconds": 1.0, "command": ["x"]}))
    (state / f"geometry-{name}.json").write_text(json.dumps({"seconds": 1.0, "command": ["x"]}))
    (state / f"train-lev-s1234-i{BUDGET_STAGES[0]}.json").write_text(
        json.dumps({"seconds": 1.0})
    )  # unfinished
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
