"""The paper grid: every generated run config is valid at its cluster layout, the variants of a size
differ only in the embedding, budgets are Chinchilla per size, and the committed scripts are current."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from megatron_lev.config import load_config
from megatron_lev.experiments.grid import (
    PAPER_DIR,
    PAPER_SIZES,
    TOKENS_PER_STEP,
    chinchilla_tokens,
    evaluation_script,
    manifest_markdown,
    paper_runs,
    submission_script,
)
from megatron_lev.model.embeddings import REGISTRY
from megatron_lev.plan import validate_config, validate_run

ROOT = Path(__file__).resolve().parents[2]
DATA = {
    "$PILE_DATA": "data/pile_train_text_document",
    "$PILE_VALID": "data/pile_val_text_document",
    "$PILE_TOKENIZER": "tokenizers/o200k_base.tiktoken",
}


def _resolved(run):
    """The run's config as the trainer would load it, with the shell variables filled in."""
    overrides = []
    for item in run.overrides():
        key, _, value = item.partition("=")
        overrides.append(f"{key}={DATA.get(value, value) if value.startswith('$') else value}")
    return validate_config(load_config(ROOT / run.config, overrides, validate=False), run.world_size)


def test_eighteen_runs_all_valid_at_their_layout():
    runs = paper_runs()
    assert len(runs) == 18 and len({r.name for r in runs}) == 18
    for run in runs:
        cfg = _resolved(run)
        validate_run(cfg, run.world_size, cuda=True)  # the trainer's own checks (batch layout, budget)
        assert cfg.model.embedding == run.variant
        assert cfg.data.data_path == [DATA["$PILE_DATA"]]


def test_variants_of_a_size_differ_only_in_embedding_and_paths():
    for size in PAPER_SIZES:
        dicts = []
        for run in paper_runs([size]):
            d = _resolved(run).to_dict()
            d["model"].pop("embedding")
            d["train"].pop("save")
            d["logging"].pop("output_dir")
            dicts.append(d)
        assert all(d == dicts[0] for d in dicts[1:]), size


def test_paper_training_defaults_and_chinchilla_budget_per_size():
    seeds = set()
    for size in PAPER_SIZES:
        cfg = load_config(ROOT / PAPER_DIR / f"{size}.yaml", validate=False)
        t, m = cfg.train, cfg.model
        assert m.seq_length == 2048 and t.global_batch_size * m.seq_length == TOKENS_PER_STEP
        assert (t.adam_beta1, t.adam_beta2, t.weight_decay, t.clip_grad) == (0.9, 0.95, 0.1, 1.0)
        assert t.lr_warmup_fraction == 0.01 and t.lr_warmup_iters is None
        assert t.lr_decay_style == "cosine" and t.min_lr == pytest.approx(0.1 * t.lr)
        assert t.precision == "bf16" and cfg.parallel.zero_stage == 1
        assert not t.chinchilla and t.train_tokens == chinchilla_tokens(size)
        seeds.add((t.seed, cfg.data.seed))
    assert len(seeds) == 1
    # the paper: up to 24.1B tokens at 1.2B (ours counts 1.216B TIED parameters)
    assert chinchilla_tokens("1.2b") == pytest.approx(24.1e9, rel=0.02)


def test_committed_scripts_match_the_generator():
    runs = paper_runs()
    tokens = {s: chinchilla_tokens(s) for s in PAPER_SIZES}
    assert (ROOT / PAPER_DIR / "submit_all.sh").read_text() == submission_script(runs)
    assert (ROOT / PAPER_DIR / "evaluate_all.sh").read_text() == evaluation_script(runs)
    assert (ROOT / PAPER_DIR / "RUNS.md").read_text() == manifest_markdown(runs, tokens)


def test_submission_script_submits_every_run_with_expanded_data(tmp_path):
    """Run submit_all.sh with a fake sbatch on PATH: 18 calls, the data paths arrive as single words."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    log = tmp_path / "calls.txt"
    fake.write_text(f'#!/usr/bin/env bash\nprintf "%q " "$@" >> {shlex.quote(str(log))}\necho >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {
        **os.environ,
        "PATH": f"{fake.parent}:{os.environ['PATH']}",
        "PILE_DATA": "my data/train_text_document",
        "PILE_VALID": "v_text_document",
        "PILE_TOKENIZER": "tok.json",
    }
    script = ROOT / PAPER_DIR / "submit_all.sh"
    subprocess.run(["bash", str(script)], env=env, check=True, cwd=tmp_path)
    calls = [shlex.split(line) for line in log.read_text().splitlines()]
    assert len(calls) == 18
    assert {c[c.index("--config") + 1] for c in calls} == {str(PAPER_DIR / f"{s}.yaml") for s in PAPER_SIZES}
    assert all("data.data_path=my data/train_text_document" in c for c in calls)
    assert {c[0] for c in calls} == {f"--nodes={n}" for n in PAPER_SIZES.values()}
    assert sorted(a.split("=", 1)[1] for c in calls for a in c if a.startswith("model.embedding=")) == sorted(
        list(tuple(REGISTRY)) * 3
    )
    missing = {k: v for k, v in env.items() if k != "PILE_VALID"}
    proc = subprocess.run(["bash", str(script)], env=missing, cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode != 0 and "PILE_VALID" in proc.stderr


def _padded(run, cfg):
    from megatron_lev.data.tokenizers import KNOWN_VOCABULARIES
    from megatron_lev.model.vocab import padded_vocab_size

    return padded_vocab_size(
        KNOWN_VOCABULARIES[run.vocab], cfg.model, cfg.parallel.tensor_model_parallel_size
    )


def test_paper_grid_is_sized_for_o200k_and_its_baselines_pass_the_width_rule():
    """TIED near 200M / 400M / 1.2B and UNTIED near the paper's 611M at 400M with o200k_base; every
    compressed baseline of the grid and of the vocabulary study passes its config's minimum width."""
    from megatron_lev.model.embeddings import embedding_class
    from megatron_lev.model.flops import parameter_count

    totals = {}
    for run in paper_runs(vocabs=["o200k_base", "cl100k_base", "neox"]):
        cfg = _resolved(run)
        assert cfg.data.tokenizer_type == ("hf" if run.vocab == "neox" else "tiktoken")
        embedding_class(run.variant).check_vocab(cfg.model, _padded(run, cfg))  # would raise
        if run.vocab == "o200k_base":
            assert _padded(run, cfg) == 200_064
            totals[run.size, run.variant] = parameter_count(cfg.model, 200_064, run.variant)["total"]
    for size, target in (("200m", 200e6), ("400m", 400e6), ("1.2b", 1.2e9)):
        assert abs(totals[size, "tied"] / target - 1) < 0.025, size
    assert totals["400m", "untied"] == pytest.approx(611e6, rel=0.005)
    assert totals["400m", "untied"] - totals["400m", "tied"] == 200_064 * 1024


def test_vocabulary_study_runs_read_their_own_data_variables():
    runs = paper_runs(["400m"], ["tied", "lev"], ["o200k_base", "neox"])
    assert [r.name for r in runs] == ["400m-tied", "400m-lev", "400m-neox-tied", "400m-neox-lev"]
    neox = runs[3].overrides()
    assert "data.data_path=$PILE_DATA_NEOX" in neox and "data.tokenizer_type=hf" in neox
    assert not any("tokenizer_type" in o for o in runs[0].overrides())
    script = submission_script(runs)
    assert ': "${PILE_TOKENIZER_NEOX:?' in script and ': "${PILE_TOKENIZER:?' in script
    evals = evaluation_script(runs)
    assert 'EVAL_DATA="$PILE_VALID_NEOX"' in evals and "results/paper/400m-neox" in evals


# the layouts of the paper configs before the fused loss: (micro-batch, activation checkpointing)
LAYOUT_BEFORE = {"200m": (8, False), "400m": (8, False), "1.2b": (4, True)}
GPUS = {"200m": 8, "400m": 16, "1.2b": 32}


def _estimate(size: str, *overrides: str) -> float:
    from megatron_lev.model.vocab import padded_vocab_size
    from megatron_lev.plan.memory import estimate_memory

    cfg = load_config([ROOT / PAPER_DIR / f"{size}.yaml"], list(overrides), validate=False)
    vocab = padded_vocab_size(199_999, cfg.model, 1)
    return estimate_memory(cfg, GPUS[size], vocab, cuda=False).per_process / 2**30


def _layout(micro: int, gpus: int, checkpointing: bool) -> str:
    return f"{micro} x {256 // (micro * gpus)}" + (", checkpointed" if checkpointing else "")


def test_paper_memory_table_is_what_the_estimate_gives_and_every_layout_fits_with_room():
    """docs/experiments.md's table, recomputed from the configs; every size's layout now is the largest
    micro-batch whose estimate is at most 40 GiB (half an 80 GB GPU), without checkpointing."""
    rows = []
    for size, gpus in GPUS.items():
        cfg = load_config([ROOT / PAPER_DIR / f"{size}.yaml"], validate=False)
        micro, ac = cfg.train.micro_batch_size, cfg.model.activation_checkpointing
        now = _estimate(size)
        assert now <= 40 and not ac and cfg.model.fused_loss, (size, now)
        bigger = 2 * micro
        if 256 % (bigger * gpus) == 0:
            bigger_estimate = _estimate(size, f"train.micro_batch_size={bigger}")
            assert bigger_estimate > 40, f"{size}: micro-batch {bigger} fits too"
        logits = _estimate(size, "model.fused_loss=false")
        b_micro, b_ac = LAYOUT_BEFORE[size]
        before = _estimate(
            size,
            "model.fused_loss=false",
            f"train.micro_batch_size={b_micro}",
            f"model.activation_checkpointing={str(b_ac).lower()}",
        )
        rows.append(
            f"| {size} | {gpus} | {_layout(micro, gpus, ac)} | {now:.1f} GiB | {logits:.1f} GiB "
            f"| {_layout(b_micro, gpus, b_ac)} | {before:.1f} GiB |"
        )
    text = (ROOT / "docs" / "experiments.md").read_text()
    start, end = "<!-- paper-memory-table -->\n", "<!-- /paper-memory-table -->"
    body = text[text.index(start) + len(start) : text.index(end)].splitlines()
    if os.environ.get("MEGATRON_LEV_WRITE_DOCS") == "1":  # regenerate the table in place
        new = "\n".join(body[:2] + rows) + "\n"
        (ROOT / "docs" / "experiments.md").write_text(
            text[: text.index(start) + len(start)] + new + text[text.index(end) :]
        )
        return
    assert body[2:] == rows
