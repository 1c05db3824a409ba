"""The small grid: the corpus split keeps train, validation and zero-shot apart; every variant trains
with the same config, seed and data; the summary compares against TIED."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_lev.config import load_config
from megatron_lev.errors import ConfigError
from megatron_lev.experiments.corpus import split_corpus
from megatron_lev.experiments.small import SmallGrid
from megatron_lev.experiments.summary import commands_markdown, grid_summary, summary_markdown

ROOT = Path(__file__).resolve().parents[2]


def _pile_dir(tmp_path: Path) -> Path:
    d = tmp_path / "pile"
    d.mkdir(parents=True)
    for subset, n in (("Wikipedia (en)", 7), ("Fortunes", 30), ("Github", 12)):
        with open(d / f"{subset.split()[0]}.jsonl", "w") as f:
            for i in range(n):
                f.write(
                    json.dumps(
                        {"text": f"{subset} document {i:03d} " + "x" * 40, "meta": {"pile_set_name": subset}}
                    )
                    + "\n"
                )
    return d


def _texts(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def test_split_holds_out_a_subset_and_every_nth_document(tmp_path):
    out = tmp_path / "split"
    summary = split_corpus(
        _pile_dir(tmp_path),
        out,
        "Wikipedia (en)",
        max_chars_per_subset=20 * 60,
        valid_every=5,
        zero_shot_max_chars=10_000,
    )
    train, valid, zero = (_texts(out / f"{p}.jsonl") for p in ("train", "valid", "zero_shot"))
    assert len(zero) == 7 and all(t.startswith("Wikipedia") for t in zero)
    assert not set(train) & set(valid) and not any(t.startswith("Wikipedia") for t in train + valid)
    fortunes = [t for t in train + valid if t.startswith("Fortunes")]
    assert len(fortunes) == 20  # the character cap: 20 documents of 60 characters
    assert {t for t in valid if t.startswith("Fortunes")} == {
        f"Fortunes document {i:03d} " + "x" * 40 for i in (4, 9, 14, 19)
    }
    assert (
        summary["subsets"]["Github"]["valid"]["docs"] == 2
        and summary["subsets"]["Github"]["train"]["docs"] == 10
    )
    assert json.loads((out / "split.json").read_text())["zero_shot_subset"] == "Wikipedia (en)"
    with pytest.raises(ValueError, match="Wikipedia_en.*subsets found"):
        split_corpus(_pile_dir(tmp_path / "again"), tmp_path / "s2", "Wikipedia_en")


def _grid(tmp_path: Path, **kw) -> SmallGrid:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return SmallGrid(_pile_dir(tmp_path), tmp_path / "grid", **kw)


def test_every_variant_trains_the_same_run_but_for_the_embedding(tmp_path):
    grid = _grid(tmp_path)
    grid.check()
    names = [s.name for s in grid.steps()]
    assert names[:4] == ["split", "tokenizer", "preprocess-train", "preprocess-valid"]
    assert names[-3:] == ["compare-validation", "compare-zero-shot", "compare-training"]
    assert names[4:7] == ["train-tied", "convert-tied", "evaluate-tied"] and len(names) == 4 + 6 * 3 + 3
    commands = {s.name: s.command() for s in grid.steps()}
    spm = str(grid.data / "spm2048.model")
    assert commands["tokenizer"][3:] == [
        "train-tokenizer",
        "--input",
        str(grid.data / "train.jsonl"),
        "--model-prefix",
        str(grid.data / "spm2048"),
        "--vocab-size",
        "2048",
        "--threads",
        "1",
    ]
    cmd = commands["preprocess-train"]
    assert cmd[cmd.index("--tokenizer") :][:4] == ["--tokenizer", spm, "--tokenizer-type", "sentencepiece"]
    assert commands["compare-training"][-2:] == ["--tag", "train/loss"]
    assert commands["compare-validation"][-2:] == ["--tag", "valid/loss"]
    cfgs = {v: grid.run_config(v).to_dict() for v in grid.variants}
    for v, d in cfgs.items():
        assert d["model"].pop("embedding") == v
        assert d["data"]["valid_data_path"] == [str(grid.prefix("valid"))]
        assert (d["data"]["tokenizer_path"], d["data"]["tokenizer_type"]) == (spm, "sentencepiece")
        for section, key in (("train", "save"), ("logging", "output_dir")):
            assert v in d[section].pop(key)
    assert all(d == cfgs["tied"] for d in cfgs.values())
    small = load_config(ROOT / "pretrain/configs/experiments/small/small.yaml")
    assert small.train.train_tokens and not small.train.chinchilla


def test_two_processes_keep_the_global_batch_and_bad_grids_are_refused(tmp_path):
    one = _grid(tmp_path / "a").run_config("lev")
    two = _grid(tmp_path / "b", nproc=2)
    cfg = two.run_config("lev")
    assert cfg.train.micro_batch_size * 2 == one.train.micro_batch_size
    assert cfg.train.global_batch_size == one.train.global_batch_size
    train_cmd = next(s for s in two.steps() if s.name == "train-lev").command()
    assert train_cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m"]
    assert train_cmd[6:8] == ["megatron_lev", "train"]
    with pytest.raises(ConfigError, match="include tied"):
        _grid(tmp_path / "c", variants=["lev"]).check()
    with pytest.raises(ConfigError, match="unknown config key 'train.lrr'"):
        _grid(tmp_path / "d", overrides=["train.lrr=1"]).check()


def _fake_run(root: Path, name: str, ppl: float, zs: float, params: int, tps: float) -> tuple[Path, Path]:
    run = root / name
    run.mkdir(parents=True)
    rows = [
        {"kind": "event", "iteration": 0, "event": "start", "parameters": params},
        {"kind": "train", "iteration": 2, "loss": 9.0, "tokens_per_s": 1.0},  # start-up window, dropped
        {"kind": "train", "iteration": 4, "loss": 8.0, "tokens_per_s": tps},
        {"kind": "valid", "iteration": 4, "loss": 8.5},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    buckets = [
        {"bucket": "< 1e-05", "tokens": 10, "perplexity": 2 * ppl},
        {"bucket": ">= 1e-05", "tokens": 90, "perplexity": ppl},
    ]
    results = [
        {"corpus_kind": "mmidx", "corpus": "valid_text_document", "perplexity": ppl, "buckets": buckets},
        {"corpus_kind": "text", "corpus": "zero_shot.jsonl", "perplexity": zs},
    ]
    (run / "eval.json").write_text(json.dumps({"name": name, "results": results}))
    return run, run / "eval.json"


def test_summary_is_relative_to_tied(tmp_path):
    runs = {
        "TIED": _fake_run(tmp_path, "TIED", 100.0, 200.0, 1000, 50.0),
        "LEV": _fake_run(tmp_path, "LEV", 90.0, 220.0, 1100, 40.0),
    }
    summary = grid_summary(runs)
    lev = next(r for r in summary["rows"] if r["name"] == "LEV")
    assert lev["valid_rel_pct"] == pytest.approx(-10.0) and lev["zero_shot_rel_pct"] == pytest.approx(10.0)
    assert lev["bucket_rel_pct"]["< 1e-05"] == pytest.approx(-10.0)
    assert lev["parameters_rel_pct"] == pytest.approx(10.0) and lev["step_time_ratio"] == pytest.approx(1.25)
    table = summary_markdown(summary)
    assert (
        "| LEV | 1,100 | +10.00% | 90.000 | -10.00% | -10.00% | -10.00% | 220.000 | +10.00% | 40 | 1.25x |"
        in table
    )
    assert "| TIED |" in table
    with pytest.raises(ValueError, match="TIED"):
        grid_summary({"LEV": runs["LEV"]})


def test_commands_file_lists_what_ran(tmp_path):
    grid = _grid(tmp_path)
    steps = grid.steps()
    state = tmp_path / "state"
    state.mkdir()
    (state / "split.json").write_text(
        json.dumps({"seconds": 3.0, "command": ["/opt/env/bin/python3.11", "-m", "x", "a b"]})
    )
    text = commands_markdown(state, steps)
    assert "python -m x 'a b'" in text and text.count("(not finished)") == len(steps) - 1
    assert "/opt/env" not in text  # no path of the machine it ran on


def test_a_finished_step_with_another_command_is_refused_but_compare_reruns(tmp_path):
    from megatron_lev.experiments.small import check_finished_steps

    grid = _grid(tmp_path)
    steps = {s.name: s for s in grid.steps()}
    state = tmp_path / "grid" / ".steps"
    state.mkdir(parents=True)
    for name in ("train-lev", "compare-validation"):
        (state / f"{name}.json").write_text(
            json.dumps({"command": ["/other/python", *steps[name].command()[1:]]})
        )
    check_finished_steps(state, list(steps.values()))  # same commands, another interpreter: fine
    grid.variants = ["tied", "lev"]  # fewer variants: the comparison changes and is rerun
    check_finished_steps(state, grid.steps())
    assert not (state / "compare-validation.json").exists() and (state / "train-lev.json").exists()
    grid.overrides = ["train.lr=1e-3"]
    with pytest.raises(ConfigError, match="(?s)'train-lev' already finished.*train.lr=1e-3"):
        check_finished_steps(state, grid.steps())


def _small_counts(vocab: int):
    from megatron_lev.model.embeddings import REGISTRY, embedding_class
    from megatron_lev.model.flops import parameter_count
    from megatron_lev.model.vocab import padded_vocab_size

    cfg = load_config(ROOT / "pretrain/configs/experiments/small/small.yaml").model
    padded = padded_vocab_size(vocab, cfg, 1)
    totals = {v: parameter_count(cfg, padded, v)["total"] for v in REGISTRY}
    widths = {
        v: embedding_class(v).widths(cfg, padded) for v in REGISTRY if hasattr(embedding_class(v), "widths")
    }
    return cfg, totals, widths


def test_small_grid_baselines_are_wide_enough_and_parameter_matched():
    """At the grid's own 2,048-piece vocabulary: every compressed width >= 16, every variant but UNTIED
    (one more V x D table by definition) within 1% of TIED, and no more training FLOPs than 1.2x the
    old 50k-vocabulary grid's."""
    from megatron_lev.model.flops import flops_per_token

    cfg, totals, widths = _small_counts(cfg_vocab := 2048)
    assert cfg.vocab_size == cfg_vocab and cfg.min_compressed_width == 16
    assert all(w >= 16 for pair in widths.values() for w in pair if w), widths
    assert widths == {"albert": (29, 0), "flat_mlp": (17, 88), "factorized_mlp": (32, 166)}
    for variant, total in totals.items():
        if variant != "untied":
            assert abs(total / totals["tied"] - 1) <= 0.01, (variant, total)
    assert totals["tied"] == 7_867_776 and totals["lev"] == 7_937_888
    assert flops_per_token(cfg, 2048) < 0.06e9  # the 50k grid (width 128 x 4): 0.045e9


def test_a_given_tokenizer_too_large_for_the_baselines_is_refused_before_any_step(tmp_path, shared_data):
    tok = shared_data / "tokenizers" / "gpt-neox-20b.json"
    grid = _grid(tmp_path, tokenizer=tok)
    cfg = grid.run_config("tied")
    assert cfg.model.vocab_size is None and cfg.data.tokenizer_type == "hf"
    assert "tokenizer" not in [s.name for s in grid.steps()]
    with pytest.raises(
        ConfigError,
        match=r"model\.embedding=albert: its table width e .* is 1, below model\."
        r"min_compressed_width=16.*model\.lev\.heads=",
    ):
        grid.check()
    _grid(tmp_path / "ok", tokenizer=tok, variants=["tied", "lev", "factorized_mlp"]).check()
