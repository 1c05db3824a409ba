"""The study: its plan (19 valid runs), lanes, the LAMBADA-style passages, collect (small files only)
and a report from synthetic raw files that is deterministic and holds the expected numbers."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from megatron_lev.errors import UserError
from megatron_lev.experiments.corpus import lambada_passages
from megatron_lev.plan import param_group_rules
from studies.collect import collect_study
from studies.plans import EQUAL_SCALE_RMS, SEEDS, assign_lanes, select_runs, study_plan
from studies.runner import Study
from studies.study_report import REPORT_PAGES, write_report
from tests.analysis.synthetic import synthetic_result

LABELS = ["< 1e-04", ">= 1e-04"]
RESUMED = "untied-s1234"  # the synthetic study's run that was stopped and resumed


def test_plan_has_19_runs_in_9_groups_with_their_seeds_and_overrides():
    plan = study_plan()
    assert len(plan) == 19 and len({r.name for r in plan}) == 19
    by_group: dict[str, list] = {}
    for r in plan:
        by_group.setdefault(r.group, []).append(r)
        assert r.overrides[0] == f"train.seed={r.seed}"
    assert {g: [r.seed for r in rs] for g, rs in by_group.items()} == {
        "TIED": list(SEEDS),
        "LEV": list(SEEDS),
        "UNTIED": [1234],
        "ALBERT": [1234],
        "FLAT-MLP": [1234],
        "FACT-MLP": [1234],
        "TIED-EQ": list(SEEDS),
        "LEV-EQ": list(SEEDS),
        "LEV-C": list(SEEDS),
    }
    assert SEEDS == (1234, 1235, 1236)
    spec = ("model.lev.centre_reference=0", "model.lev.seed_lr_mult=1")  # the study measured the spec
    assert all(r.overrides[1:] == (f"model.input_init_rms={EQUAL_SCALE_RMS}",) for r in by_group["TIED-EQ"])
    eq = (*spec, f"model.input_init_rms={EQUAL_SCALE_RMS}")
    assert all(r.overrides[1:] == eq for r in by_group["LEV-EQ"])
    assert all(r.overrides[1:] == (*spec, "model.lev.centred=true") for r in by_group["LEV-C"])
    assert all(r.overrides[1:] == spec for r in by_group["LEV"])
    assert {r.variant for r in by_group["LEV-C"] + by_group["LEV-EQ"]} == {"lev"}
    with pytest.raises(ValueError, match="unknown"):
        select_runs(["lev-s9"])


def test_every_run_config_passes_the_trainers_validation_and_keeps_data_order(tmp_path):
    import torch

    from megatron_lev.plan import validate_run

    pile = tmp_path / "pile"
    pile.mkdir()
    (pile / "a.jsonl").write_text(json.dumps({"text": "x", "meta": {"pile_set_name": "A"}}) + "\n")
    study = Study(pile, tmp_path / "study")
    cfgs = {}
    for run in study_plan():
        cfg = study.run_config(run)
        validate_run(cfg, 1, cuda=torch.cuda.is_available())
        cfgs[run.name] = cfg
        assert cfg.train.seed == run.seed and cfg.model.embedding == run.variant
        assert cfg.train.save == str(tmp_path / "study" / "runs" / run.name / "checkpoints")
        iters = cfg.train.train_tokens // (cfg.train.global_batch_size * cfg.model.seq_length)
        assert cfg.train.save_interval * 5 == iters and cfg.train.keep_last >= 6
        # at least 4x the small grid's 307,200 tokens
        assert cfg.train.train_tokens >= 4 * 307_200
    assert len({c.data.seed for c in cfgs.values()}) == 1  # one data order
    assert cfgs["lev-eq-s1235"].model.input_init_rms == EQUAL_SCALE_RMS
    assert cfgs["lev-c-s1236"].model.lev.centred and not cfgs["lev-s1236"].model.lev.centred
    for name in ("lev-s1234", "lev-eq-s1235", "lev-c-s1236"):  # the spec's LEV, as the raw files were made
        lev = cfgs[name].model.lev
        assert lev.centre_reference == 0 and lev.seed_lr_mult == 1.0 and param_group_rules(cfgs[name]) == []
    steps = [s.name for s in study.all_steps()]
    assert steps[:5] == ["split", "tokenizer", "preprocess-train", "preprocess-valid", "lambada"]
    assert len(steps) == 5 + 19 * 4 and len(set(steps)) == len(steps)
    evaluate = next(s for s in study.all_steps() if s.name == "evaluate-lev-c-s1234").command()
    for flag in ("--data", "--counts", "--text", "--lambada"):
        assert flag in evaluate
    train = next(s for s in study.all_steps() if s.name == "train-lev-c-s1234")
    assert train.command()[-4:] == [
        "train.seed=1234",
        "model.lev.centre_reference=0",
        "model.lev.seed_lr_mult=1",
        "model.lev.centred=true",
    ]
    assert train.env["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize("lanes", [1, 2, 3, 19, 25])
def test_lanes_cover_every_run_once(lanes):
    plan = study_plan()
    got = assign_lanes(plan, lanes)
    assert len(got) == lanes
    flat = [r.name for lane in got for r in lane]
    assert sorted(flat) == sorted(r.name for r in plan)
    assert max(map(len, got)) - min(map(len, got)) <= 1
    if lanes == 2:  # every group's first seed before any second seed
        dealt = [lane[i] for i in range(10) for lane in got if i < len(lane)]  # in start order
        assert [r.seed for r in dealt[:9]] == [1234] * 9 and dealt[9].seed == 1235


def test_a_lane_runs_its_runs_in_the_order_dealt():
    from studies.plans import select_runs

    (first, second) = assign_lanes(study_plan(), 2)
    for lane in (first, second):
        names = [r.name for r in lane]
        assert [r.name for r in select_runs(names)] == names  # not re-sorted into plan order
    assert first[0].name == "tied-s1234" and second[0].name == "lev-s1234"


def test_lambada_passages_end_in_an_alphabetic_word(tmp_path):
    src = tmp_path / "zero_shot.jsonl"
    words = [f"w{i}" if i % 7 else "alpha" for i in range(300)]  # w12 etc. are not alphabetic
    docs = [" ".join(words), "too short a document", "a\n" + " ".join(["beta"] * 50) + " 42."]
    src.write_text("".join(json.dumps({"text": t, "meta": {"pile_set_name": "W"}}) + "\n" for t in docs))
    out = tmp_path / "lambada.jsonl"
    summary = lambada_passages(src, out, min_words=40, max_words=60, max_passages=100)
    passages = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert summary["passages"] == len(passages) >= 5
    for p in passages:
        w = p.split()
        assert 40 <= len(w) <= 60 and w[-1].isalpha() and len(w[-1]) >= 2 and "\n" not in p
    assert passages[0].split()[-1] == "alpha" and len(passages[0].split()) == 57  # word 56 is "alpha"
    assert passages[-1] == " ".join(["a", *["beta"] * 50][:51])  # "42." is no target; "a" is too short
    again = tmp_path / "again.jsonl"
    lambada_passages(src, again, min_words=40, max_words=60, max_passages=100)
    assert again.read_bytes() == out.read_bytes()
    lambada_passages(src, again, min_words=40, max_words=60, max_passages=2)
    assert len(again.read_text().splitlines()) == 2
    # the evaluator reads them: the target is the last word
    from megatron_lev.data.zero_shot_formats import read_lambada

    assert [p.word for p in read_lambada(out)][:1] == ["alpha"]


# ------------------------------------------------------------------------------ synthetic raw files


def _eval_result(kind: str, tokens: np.ndarray, nll: np.ndarray) -> dict:
    return synthetic_result(tokens, nll, LABELS, corpus_kind=kind, corpus=f"<study>/{kind}")


FACTORS = {  # perplexity factor against TIED of the same seed, in every document
    "TIED": [1.0, 1.0, 1.0],
    "LEV": [0.90, 0.92, 0.88],
    "UNTIED": [0.95],
    "ALBERT": [1.02],
    "FLAT-MLP": [1.01],
    "FACT-MLP": [0.99],
    "TIED-EQ": [1.0, 1.0, 1.0],
    "LEV-EQ": [0.95, 0.96, 0.94],
    "LEV-C": [0.90 * 0.98, 0.92 * 0.98, 0.88 * 0.98],
}


def _raw_dir(tmp_path: Path) -> Path:
    raw = tmp_path / "raw"
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 30, size=(20, 2)).astype(float)
    base_nll = tokens * rng.uniform(2.0, 5.0, size=(20, 2))
    passage_nll = rng.uniform(8.0, 12.0, size=10)  # LAMBADA-style: the last word's NLL per passage
    runs = []
    for run in study_plan():
        k = SEEDS.index(run.seed)
        nll = base_nll + 0.01 * k * tokens + tokens * math.log(FACTORS[run.group][k])
        d = raw / run.name
        d.mkdir(parents=True)
        results = [
            _eval_result("mmidx", tokens, nll),
            _eval_result("text", tokens, nll + 0.5 * tokens),
            {
                "corpus_kind": "lambada",
                "task": "lambada",
                "perplexity": math.exp(passage_nll.mean()) * FACTORS[run.group][k],
                "acc": 0.25 + 0.01 * k,
                "per_document": {
                    "unit": "passage",
                    "tokens": [1] * len(passage_nll),
                    "nll_sum": (passage_nll + math.log(FACTORS[run.group][k])).tolist(),
                },
            },
        ]
        (d / "eval.json").write_text(json.dumps({"name": run.group, "results": results}))
        geo = [
            {
                "run": run.name,
                "embedding": run.variant,
                "iteration": it,
                "tokens": it * 2048,
                "matrix": m,
                "rows": 2048,
                "pair_rows": 2048,
                "dim": 384,
                "eps": 0.1 * it / 150 + (m == "output"),
                "mu": 0.01 * k,
                "sigma": 0.05,
                "mean_row_ratio": 0.2,
                "effective_rank": 100.0 + it / 150,
                "rank_bound": 72 if run.variant == "lev" else 384,
            }
            for it in (150, 300, 750)
            for m in ("input", "output")
        ]
        (d / "geometry.json").write_text(json.dumps({"rows": geo}))
        steps = {"train": 1800.0 + k, "convert": 10.0, "evaluate": 170.0, "geometry": 20.0}
        (d / "timing.json").write_text(
            json.dumps(
                {"run": run.name, "threads": 1, "steps": {s: {"seconds": v} for s, v in steps.items()}}
            )
        )
        start = {"kind": "event", "event": "start", "iteration": 0, "parameters": 1000}
        rows = [
            start,
            {"kind": "train", "iteration": 10, "loss": 5.0, "tokens_per_s": 900.0, "tokens": 20480},
        ]
        if run.name == RESUMED:  # stopped and resumed: two segments, 4,096,000 tokens at 1,000 tokens/s
            rows += [{**start, "iteration": 10}]
        seen = 4_096_000 if run.name == RESUMED else 40960
        rows += [{"kind": "train", "iteration": 20, "loss": 4.0, "tokens_per_s": 1000.0 + k, "tokens": seen}]
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append({**run.__dict__, "overrides": list(run.overrides)})
    (raw / "study.json").write_text(json.dumps({"runs": runs}))
    (raw / "lambada.json").write_text(
        json.dumps({"passages": 500, "min_words": 40, "max_words": 120, "mean_words": 82.0})
    )
    return raw


def test_report_from_raw_files_is_deterministic_with_the_expected_numbers(tmp_path):
    raw = _raw_dir(tmp_path)
    paths = write_report(raw, tmp_path / "a", plots=True)
    write_report(raw, tmp_path / "b", plots=False)
    assert sorted(paths) == sorted(REPORT_PAGES)
    for name in REPORT_PAGES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "plots" / "seeds_validation" / "overall_rel_change.png").is_file()
    read = lambda name: (tmp_path / "a" / name).read_text()  # noqa: E731
    # LEV vs TIED over three seeds: -10, -8, -12 % (sd 2) on validation and on LAMBADA-style
    seeds = read("seeds.md")
    assert "| LEV | all | -10.00% ± 2.00 |" in seeds
    assert "Seeds (train.seed): 1234, 1235, 1236." in seeds
    eq = read("equal_scale.md")
    assert "| LEV vs TIED (default init) | validation | 3 | -10.00% ± 2.00 |" in eq
    assert "| LEV-EQ vs TIED-EQ (equal scale) | validation | 3 | -5.00% ± 1.00 |" in eq
    assert "| LEV-EQ vs TIED-EQ (equal scale) | LAMBADA-style | 3 | -5.00% ± 1.00 |" in eq
    lambada_row = next(
        ln for ln in eq.splitlines() if ln.startswith("| LEV-EQ vs TIED-EQ (equal scale) | LAMBADA")
    )
    assert "not run" not in lambada_row and lambada_row.count("[") == 2  # seed-paired and passage bootstrap
    assert "| TIED-EQ vs TIED (control) | validation | 3 | +0.00% ± 0.00 |" in eq
    centred = read("centred.md")
    assert "| LEV-C vs LEV | zero-shot | 3 | -2.00% ± 0.00 |" in centred
    variants = read("variants.md")
    assert (
        "| ALBERT | all | +2.00% (1 seed) |" in variants and "| UNTIED | all | -5.00% (1 seed) |" in variants
    )
    dec = read("decomposition.md")
    gain = (1 - 0.99 / 1.01) * 100  # FACT-MLP vs FLAT-MLP
    assert f"| compositional structure | FACT-MLP vs FLAT-MLP | {gain:+.2f}% (1 seed)" in dec
    groups = read("groups.md")
    assert "| LEV | 3 | 1234, 1235, 1236 |" in groups and "26.00 ± 1.00%" in groups
    assert "500 of 40-120 words" in groups
    geometry = read("geometry.md")
    assert "| LEV | input | first | 150 | 0.1000 ± 0.0000 | 0.0100 ± 0.0100 |" in geometry
    assert (
        "| LEV | input | final | 750 | 0.5000 ± 0.0000 |" in geometry and "| 105.0 ± 0.0 | 72 |" in geometry
    )
    assert "| UNTIED | output | final | 750 | 1.5000 | 0.0000 | 0.0500 | 0.2000 | 105.0 | 384 |" in geometry
    cost = read("cost.md")
    hours = (1800 + 10 + 170 + 20) / 3600
    assert f"| tied-s1234 | TIED | 1 | 1,800 | 41 | 10 | 170 | 20 | {hours:.2f} | 1,000 |" in cost
    # a resumed run: the marker's 1,800 s saw the last segment only; its CPU-hours count the step estimate
    resumed = (4096 + 10 + 170 + 20) / 3600
    assert f"| {RESUMED} | UNTIED | 2 | 1,800 | 4,096 | 10 | 170 | 20 | {resumed:.2f} | 1,000 |" in cost
    total = sum((1800 + SEEDS.index(r.seed) + 200) / 3600 for r in study_plan()) + (4096 - 1800) / 3600
    assert f"| all 19 runs | {total:.2f} |" in cost


def test_report_says_what_is_missing_for_a_partial_study(tmp_path):
    raw = _raw_dir(tmp_path)
    study = json.loads((raw / "study.json").read_text())
    study["runs"] = [r for r in study["runs"] if r["group"] in ("TIED", "LEV")]
    (raw / "study.json").write_text(json.dumps(study))
    write_report(raw, tmp_path / "out", plots=False)
    assert "not run or not collected: LEV-C" in (tmp_path / "out" / "centred.md").read_text()
    assert "| LEV | all | -10.00% ± 2.00 |" in (tmp_path / "out" / "seeds.md").read_text()


def _finished_study(tmp_path: Path) -> Path:
    out = tmp_path / "study"
    state = out / ".steps"
    state.mkdir(parents=True)
    run = out / "runs" / "lev-s1234"
    for sub in ("eval", "geometry", "checkpoints/iter_0000150", "hf"):
        (run / sub).mkdir(parents=True)
    (run / "eval" / "eval.json").write_text(json.dumps({"results": [], "corpus": f"{out.resolve()}/data/v"}))
    (run / "geometry" / "geometry.json").write_text('{"rows": []}')
    (run / "metrics.jsonl").write_text("{}\n")
    (run / "config.yaml").write_text(f"train:\n  save: {out.resolve()}/runs/lev-s1234/checkpoints\n")
    (run / "checkpoints" / "iter_0000150" / "model.pt").write_bytes(b"\0" * 1000)
    (run / "hf" / "model.safetensors").write_bytes(b"\0" * 1000)
    for kind in ("train", "convert", "evaluate", "geometry"):
        (state / f"{kind}-lev-s1234.json").write_text(
            json.dumps({"seconds": 12.5, "command": ["/some/env/bin/python", "-m", "megatron_lev", kind]})
        )
    (state / "train-tied-s1234.json").write_text(json.dumps({"seconds": 1.0, "command": ["x"]}))  # unfinished
    (out / "data").mkdir()
    split = {"zero_shot_subset": "W", "data_dir": str(tmp_path.resolve() / "corpora" / "minipile")}
    (out / "data" / "split.json").write_text(json.dumps(split))
    (out / "data" / "lambada.jsonl").write_text('{"text": "a b c"}\n{"text": "a b"}\n')
    return out


def test_collect_copies_small_files_of_finished_runs_and_never_checkpoints(tmp_path):
    from studies.collect import _copy_small

    out = _finished_study(tmp_path)
    raw = tmp_path / "raw"
    sizes = collect_study(out, raw, log=lambda *_: None, plan="study")
    files = sorted(str(p.relative_to(raw)) for p in raw.rglob("*") if p.is_file())
    assert files == [
        "lambada.json",
        "lev-s1234/config.yaml",
        "lev-s1234/eval.json",
        "lev-s1234/geometry.json",
        "lev-s1234/metrics.jsonl",
        "lev-s1234/timing.json",
        "split.json",
        "study.json",
    ]
    assert sizes["lev-s1234/eval.json"] == (raw / "lev-s1234" / "eval.json").stat().st_size
    assert str(out.resolve()) not in (raw / "lev-s1234" / "config.yaml").read_text()
    assert "<study>/runs/lev-s1234/checkpoints" in (raw / "lev-s1234" / "config.yaml").read_text()
    timing = json.loads((raw / "lev-s1234" / "timing.json").read_text())
    assert timing["steps"]["train"] == {"seconds": 12.5, "command": ["python", "-m", "megatron_lev", "train"]}
    assert [r["name"] for r in json.loads((raw / "study.json").read_text())["runs"]] == ["lev-s1234"]
    assert json.loads((raw / "lambada.json").read_text())["passages"] == 2
    # an absolute --data-dir is a path of this machine: the raw split names its last part only
    assert json.loads((raw / "split.json").read_text())["data_dir"] == "<data>/minipile"
    ckpt = out / "runs" / "lev-s1234" / "checkpoints" / "iter_0000150" / "model.pt"
    with pytest.raises(UserError, match="checkpoint"):
        _copy_small(ckpt, raw / "x.pt", out)
    with pytest.raises(UserError, match="checkpoint"):
        _copy_small(out / "runs" / "lev-s1234" / "hf" / "model.safetensors", raw / "y", out)
    with pytest.raises(UserError, match="inside the study"):
        collect_study(out, out / "raw", log=lambda *_: None, plan="study")


def test_collect_keeps_the_runs_an_earlier_session_collected(tmp_path):
    """Each session's lanes hold only that session's runs: collecting them into a raw directory that
    already holds other runs lists both in study.json (in plan order), and drops a listed run whose
    files are gone; a raw directory of another plan is refused."""
    out = _finished_study(tmp_path)
    raw = tmp_path / "raw"
    earlier = {"name": "tied-s1234", "group": "TIED", "variant": "tied", "seed": 1234, "overrides": []}
    gone = {**earlier, "name": "tied-s1235", "seed": 1235}
    (raw / "tied-s1234").mkdir(parents=True)
    (raw / "tied-s1234" / "eval.json").write_text("{}")
    (raw / "study.json").write_text(json.dumps({"plan": "study", "runs": [earlier, gone]}))
    lines = []
    collect_study(out, raw, log=lines.append, plan="study")
    listed = [r["name"] for r in json.loads((raw / "study.json").read_text())["runs"]]
    assert listed == ["tied-s1234", "lev-s1234"]
    not_collected = lines[-1].split()
    assert "tied-s1234" not in not_collected and "tied-s1235" in not_collected
    (raw / "study.json").write_text(json.dumps({"plan": "pilot", "runs": [earlier]}))
    with pytest.raises(UserError, match="holds runs of the pilot plan, not study; give another directory"):
        collect_study(out, raw, log=lambda *_: None, plan="study")


def test_docs_match_report(tmp_path):
    from tests.experiments.committed import assert_pages_regenerate, pages_dir

    assert_pages_regenerate(write_report, "study", REPORT_PAGES, tmp_path, plots=False)
    # the hand-written reading quotes the report: every signed two-decimal percentage and interval in
    # it must be one the report prints (the paper's numbers are quoted with one decimal or unsigned)
    pages = "\n".join((tmp_path / name).read_text() for name in REPORT_PAGES)
    reading = (pages_dir("study") / "README.md").read_text()
    quoted = re.findall(r"\[[+-]\d+\.\d\d, [+-]\d+\.\d\d\]%|(?<![\d.])[+-]\d[\d,]*\.\d\d%", reading)
    assert quoted, "docs/results/study/README.md quotes no number of the report"
    missing = sorted({q for q in quoted if q not in pages})
    assert not missing, f"docs/results/study/README.md quotes numbers the report does not print: {missing}"


def test_vocabulary_buckets_count_the_byte_pieces_of_each_bucket(tmp_path):
    """What each frequency bucket of the vocabulary holds, from a real SentencePiece model with byte
    fallback: every byte piece the counts leave at zero is in the lowest bucket and counted as such."""
    import sentencepiece

    from studies.collect import vocabulary_buckets

    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(300)))
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "spm300"), vocab_size=300, byte_fallback=True
    )
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "spm300.model"))
    counts = np.zeros(sp.get_piece_size(), dtype=np.int64)
    normal = [
        i for i in range(sp.get_piece_size()) if not (sp.is_byte(i) or sp.is_control(i) or sp.is_unknown(i))
    ]
    counts[normal] = 1000  # every normal piece frequent, every byte and control piece unseen
    np.save(tmp_path / "train_text_document.counts.npy", counts)
    got = vocabulary_buckets(tmp_path)
    assert got["tokenizer"] == "spm300.model" and got["training_tokens"] == 1000 * len(normal)
    lowest, top = got["buckets"][0], got["buckets"][-1]
    assert lowest["byte_pieces"] == 256 and lowest["other"] == 0
    assert lowest["vocab_ids"] == 256 + lowest["control_or_unknown"]
    assert top["vocab_ids"] == len(normal) and top["byte_pieces"] == 0
    assert vocabulary_buckets(tmp_path / "nothing-here") is None


def test_a_study_directory_holds_one_plan(tmp_path):
    """The plans share run names (tied-s1234 is in the study, the pilot and the regime): `study run`
    records its plan in --out and refuses another's directory, and `collect` takes the recorded plan
    (refusing a --plan that contradicts it)."""
    from studies.runner import claim_plan, recorded_plan

    out = _finished_study(tmp_path)
    assert recorded_plan(out) is None
    with pytest.raises(UserError, match="no record of which plan.*give --plan study"):
        collect_study(out, tmp_path / "raw0", log=lambda *_: None)  # a directory from before the record
    assert not (tmp_path / "raw0").exists()
    claim_plan(out, "regime")
    claim_plan(out, "regime")  # going on with the same plan
    assert recorded_plan(out) == "regime"
    with pytest.raises(UserError, match="holds the runs of the regime plan; give --plan regime"):
        claim_plan(out, "study")
    with pytest.raises(UserError, match="not pilot: give --plan regime"):
        collect_study(out, tmp_path / "raw1", log=lambda *_: None, plan="pilot")
    collect_study(out, tmp_path / "raw2", log=lambda *_: None)
    assert json.loads((tmp_path / "raw2" / "study.json").read_text())["plan"] == "regime"
