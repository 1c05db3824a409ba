"""The main job, end to end, on a sample corpus this machine builds for itself.

corpus -> SentencePiece tokenizer -> MMIDIDX shards -> DeepSpeed training of the tiny
LEV model on N processes -> perplexity overall and by token frequency -> Hugging Face
export (logit-checked) -> representational capacity of the input table and output head
-> a summary. Every step is a `megatron-lev` command a user could type; each runs once
(see `steps.py`), so a second run skips what is finished.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_lev.demo.steps import Step, StepRunner
from megatron_lev.resources import CONFIG_DIR, config_path
from megatron_lev.utils.io import atomic_write_json

DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"  # pretrain/configs/tiny.yaml in a checkout
# the input table's statistics the summary prints beside the loss (over `logging.dynamics_sample_ids`)
TABLE_SUMMARY = ("mean_row_ratio", "effective_rank_centred", "effective_rank")
VALID_SPLIT = "949,50,1"  # train, valid, test by document: the demo's corpus has ~1.5k documents


@dataclass
class DemoOptions:
    out: Path
    config: Path = DEFAULT_CONFIG
    embedding: str = "lev"
    iters: int = 300
    nproc: int | None = None  # None: GPUs if any, else 2 CPU processes
    corpus_mb: float = 12.0
    vocab_size: int = 8000
    corpus_dir: Path | None = None  # use an existing Pile-format corpus instead of building one
    force: bool = False


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_lev", *args]


def _nproc(opts: DemoOptions) -> int:
    if opts.nproc:
        return opts.nproc
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def build_steps(opts: DemoOptions) -> list[Step]:
    out = opts.out.resolve()
    corpus = opts.corpus_dir.resolve() if opts.corpus_dir else out / "corpus"
    spm = out / "tokenizer" / "spm"
    shards = out / "data" / "corpus"
    ckpt, run, hf = out / "checkpoints", out / "run", out / "hf"
    nproc = _nproc(opts)
    train_env = {
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "" if _has_cuda() else "cpu"),
    }
    train_env = {k: v for k, v in train_env.items() if v}
    steps = []
    if opts.corpus_dir is None:
        steps.append(
            Step(
                "corpus",
                f"build a {opts.corpus_mb:g} MB Pile-format sample corpus from this machine",
                lambda: _cli(
                    "sample-corpus",
                    "--output-dir",
                    str(corpus),
                    "--max-mb",
                    str(opts.corpus_mb),
                    "--no-progress",
                ),
                lambda: [corpus / "manifest.json"],
            )
        )
    steps += [
        Step(
            "tokenizer",
            f"train a {opts.vocab_size}-token SentencePiece BPE tokenizer on it",
            lambda: _cli(
                "train-tokenizer",
                "--input",
                str(corpus),
                "--model-prefix",
                str(spm),
                "--vocab-size",
                str(opts.vocab_size),
            ),
            lambda: [Path(f"{spm}.model")],
        ),
        Step(
            "preprocess",
            "tokenise into memory-mapped .bin/.idx shards (2 workers)",
            lambda: _cli(
                "preprocess",
                "--input",
                str(corpus),
                "--output-prefix",
                str(shards),
                "--tokenizer-type",
                "sentencepiece",
                "--tokenizer",
                f"{spm}.model",
                "--workers",
                "2",
                "--no-progress",
            ),
            lambda: [Path(f"{shards}.manifest.json")],
        ),  # written last: the set is complete
        Step(
            "train",
            f"train the tiny {opts.embedding.upper()} model with DeepSpeed on {nproc} processes, "
            f"{opts.iters} steps",
            lambda: [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={nproc}",
                "-m",
                "megatron_lev",
                "train",
                "--config",
                str(opts.config),
                *train_overrides(opts),
            ],
            lambda: [ckpt / "latest", run / "metrics.jsonl"],
            env=train_env,
        ),
        Step(
            "export",
            "convert the checkpoint to a Hugging Face LlamaForCausalLM, checking logits",
            lambda: _cli(
                "convert", str(ckpt), str(hf), "--tokenizer", f"{spm}.model", "--overwrite", "--no-progress"
            ),
            lambda: [hf / "config.json"],
        ),
        Step(
            "evaluate",
            "perplexity on the held-out documents, overall and by token frequency",
            lambda: _cli(
                "evaluate",
                str(hf),
                "--data",
                str(shards),
                "--split",
                "valid",
                "--split-spec",
                VALID_SPLIT,
                "--counts",
                f"{shards}.counts.npy",
                "--seq-len",
                str(_seq_length(opts)),
                "--name",
                opts.embedding,
                "--out",
                str(out / "eval"),
            ),
            lambda: [out / "eval" / "eval.json"],
        ),
        Step(
            "capacity",
            "representational capacity of the input table and the output head",
            lambda: _cli("capacity", str(hf), "--out", str(out / "capacity")),
            lambda: [out / "capacity" / "capacity.json"],
        ),
    ]
    return steps


def train_overrides(opts: DemoOptions) -> list[str]:
    """The dotted overrides the demo's training step adds to `opts.config`."""
    out = opts.out.resolve()
    shards, spm = out / "data" / "corpus", out / "tokenizer" / "spm"
    every = max(opts.iters // 3, 1)
    return [
        f"model.embedding={opts.embedding}",
        f"data.data_path=[{shards}]",
        f"data.split={VALID_SPLIT}",
        "data.tokenizer_type=sentencepiece",
        f"data.tokenizer_path={spm}.model",
        f"train.train_iters={opts.iters}",
        f"train.eval_interval={every}",
        f"train.save={out / 'checkpoints'}",
        f"train.save_interval={every}",
        f"logging.output_dir={out / 'run'}",
        "logging.progress_bar=false",
    ]


def check_options(opts: DemoOptions) -> None:
    """Refuse options the demo cannot run with before any step starts; errors name the flag."""
    from megatron_lev.config import load_config
    from megatron_lev.data.train_tokenizer import MIN_VOCAB, input_files
    from megatron_lev.errors import ConfigError
    from megatron_lev.plan import validate_config

    if opts.iters < 1:
        raise ConfigError(f"--iters {opts.iters}: must be an integer >= 1 (training steps)")
    if opts.vocab_size < MIN_VOCAB:
        raise ConfigError(
            f"--vocab-size {opts.vocab_size}: must be >= {MIN_VOCAB} (256 byte pieces + specials)"
        )
    if not (math.isfinite(opts.corpus_mb) and opts.corpus_mb > 0):
        raise ConfigError(f"--corpus-mb {opts.corpus_mb}: must be a finite number > 0")
    if opts.nproc is not None and opts.nproc < 1:
        raise ConfigError(f"--nproc {opts.nproc}: must be an integer >= 1")
    if opts.out.exists() and not opts.out.is_dir():
        raise ConfigError(f"--out {opts.out}: exists and is not a directory; give a directory")
    if opts.corpus_dir is not None:
        if not opts.corpus_dir.is_dir():
            raise ConfigError(
                f"--corpus-dir {opts.corpus_dir}: not a directory of Pile-format *.jsonl[.zst] files"
            )
        input_files([str(opts.corpus_dir)])
    opts.config = config_path(opts.config)  # as given, else a packaged config of that name
    if not Path(opts.config).is_file():
        raise ConfigError(
            f"--config {opts.config}: run config not found; give a YAML path or a packaged "
            "config such as tiny.yaml"
        )
    validate_config(load_config([opts.config], train_overrides(opts), validate=False), opts.nproc)


def _seq_length(opts: DemoOptions) -> int:
    from megatron_lev.config import load_config

    return load_config([opts.config], validate=False).model.seq_length


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_demo(opts: DemoOptions, log=print) -> dict:
    check_options(opts)
    runner = StepRunner(opts.out, force=opts.force, log=log)
    runner.run(build_steps(opts))
    summary = summarize(opts.out.resolve(), runner.timings)
    log(format_summary(summary))
    atomic_write_json(opts.out / "summary.json", summary)
    return summary


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON-lines file; a torn or damaged line (a killed writer) is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict | None:
    """A JSON object, or None when the file is missing or damaged (the summary then leaves it out)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def summarize(out: Path, timings: dict[str, float]) -> dict:
    """Collect the numbers a person looks at from the steps' outputs."""
    metrics = _read_jsonl(out / "run" / "metrics.jsonl")
    train = [m for m in metrics if m.get("kind") == "train" and "loss" in m]
    valid = [m for m in metrics if m.get("kind") == "valid" and "loss" in m]
    summary: dict = {
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "paths": {
            "corpus": str(out / "corpus"),
            "tokenizer": str(out / "tokenizer"),
            "shards": str(out / "data"),
            "checkpoints": str(out / "checkpoints"),
            "tensorboard": str(out / "run" / "tensorboard"),
            "hf_model": str(out / "hf"),
            "evaluation": str(out / "eval"),
            "capacity": str(out / "capacity"),
        },
    }
    if train:
        summary["train_loss_first"] = train[0]["loss"]
        summary["train_loss_last"] = train[-1]["loss"]
        summary["iterations"] = train[-1].get("iteration")
    table = [m for m in train if "input_table/mean_row_ratio" in m]
    if table:  # the input table's geometry at the last step that measured it (training/dynamics.py)
        summary["input_table"] = {
            "iteration": table[-1].get("iteration"),
            **{k: table[-1].get(f"input_table/{k}") for k in TABLE_SUMMARY},
        }
    if valid:
        summary["valid_loss_last"] = valid[-1]["loss"]
    result = _read_json(out / "eval" / "eval.json")
    if result and isinstance(result.get("results"), list) and result["results"]:
        summary["evaluation"] = _eval_headline(result)
    cap = _read_json(out / "capacity" / "capacity.json")
    if cap:
        summary["capacity"] = _capacity_headline(cap)
    return summary


def _eval_headline(result: dict) -> dict:
    """Overall perplexity and the per-bucket perplexities from an `evaluate` eval.json."""
    first = result["results"][0]
    head = {k: first.get(k) for k in ("corpus", "tokens", "perplexity", "mean_nll")}
    head["buckets"] = [
        {k: b.get(k) for k in ("bucket", "tokens", "perplexity")} for b in first.get("buckets", [])
    ]
    return head


def _capacity_headline(report: dict) -> list[dict]:
    return [{k: r.get(k) for k in ("name", "rows", "d", "eps", "class")} for r in report.get("reports", [])]


def format_summary(s: dict) -> str:
    lines = ["", "=" * 72, "megatron-lev demo: summary", "=" * 72]
    if "train_loss_first" in s:
        lines.append(
            f"training loss      {s['train_loss_first']:.3f} -> {s['train_loss_last']:.3f} "
            f"over {s.get('iterations')} iterations"
        )
    if "valid_loss_last" in s:
        lines.append(f"validation loss    {s['valid_loss_last']:.3f}")
    table = s.get("input_table")
    if table and table.get("mean_row_ratio") is not None:
        rank = table.get("effective_rank_centred")
        lines.append(
            f"input table        mean-row ratio {table['mean_row_ratio']:.3f}"
            + (f", centred effective rank {rank:.1f}" if rank is not None else "")
            + f" at iteration {table.get('iteration')} (near 1: every row points one way)"
        )
    ev = s.get("evaluation")
    if ev:
        if ev.get("perplexity") is not None:
            lines.append(f"held-out perplexity {ev['perplexity']:.2f} over {ev.get('tokens')} tokens")
        if ev.get("buckets"):
            lines.append("  by training-token frequency:")
            for b in ev["buckets"]:
                ppl = "empty" if not b.get("tokens") else f"{b['perplexity']:.2f}"
                lines.append(
                    f"    {str(b['bucket']):<18} {str(b.get('tokens')):>9} tokens   perplexity {ppl}"
                )
    for row in s.get("capacity", []):
        eps = row.get("eps")
        eps_txt = f"{eps:.4f}" if isinstance(eps, (int, float)) else str(eps)
        lines.append(f"capacity: {row.get('name')}: eps = {eps_txt} ({row.get('class')})")
    lines.append("step times: " + ", ".join(f"{k} {v:.0f}s" for k, v in s["timings_s"].items()))
    lines.append("where everything is:")
    for k, v in s["paths"].items():
        lines.append(f"  {k:<12} {v}")
    return "\n".join(lines)
