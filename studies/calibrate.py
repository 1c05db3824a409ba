"""The temperature records of a staged study's checkpoints on its zero-shot corpus
(`megatron_lev.analysis.calibration`), written beside the collected evaluations:
`RAW_DIR/<run>/calibration-i<n>.json` for a stage and `calibration-cool-i<n>.json` for its cool-down
branch, for every stage whose evaluation `collect` copied there. A record already written is kept,
so the command goes on where it stopped.

python -m studies calibrate runs/cooldown results/cooldown/raw
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from megatron_lev.analysis.calibration import TEMPERATURES, temperature_losses, temperature_record
from megatron_lev.analysis.corpora import TokenizedCorpus, load_tokenizer, sequence_batches
from megatron_lev.analysis.evaluate import hf_model_fn
from megatron_lev.analysis.perplexity import RecordLengths
from megatron_lev.errors import DataError
from megatron_lev.utils.io import atomic_write_json

CORPUS = "zero_shot.jsonl"  # in the study's data directory
COUNTS = "train_text_document.counts.npy"
EVAL = "eval{kind}-i{n}.json"  # what collect wrote; kind "" (the stage) or "-cool" (its branch)
RECORD = "calibration{kind}-i{n}.json"


def checkpoints(out: Path, raw: Path, runs: list[str] | None = None) -> list[tuple[str, str, int, Path]]:
    """(run, kind, stage, exported model directory) of every collected stage evaluation: the
    constant-rate stages first, then the cool-down branches."""
    found = []
    run_dirs = sorted(p for p in raw.iterdir() if p.is_dir() and (not runs or p.name in runs))
    for kind, model in (("", "runs/{run}/hf-i{n}"), ("-cool", "runs/{run}-cool-i{n}/hf")):  # stages first
        for run_dir in run_dirs:
            for path in sorted(run_dir.glob(f"eval{kind}-i*.json")):
                tail = path.stem.removeprefix(f"eval{kind}-i")
                if not tail.isdigit():
                    continue
                n = int(tail)
                found.append((run_dir.name, kind, n, out / model.format(run=run_dir.name, n=n)))
    return found


def calibrate_study(
    out: Path, raw: Path, runs: list[str] | None = None, seq_len: int = 256, log=print
) -> list[Path]:
    """Write the missing temperature records; returns the paths written."""
    corpus, counts_path = out / "data" / CORPUS, out / "data" / COUNTS
    for need in (corpus, counts_path):
        if not need.is_file():
            raise DataError(f"{need}: not found; pass the study directory `python -m studies run` wrote")
    if not raw.is_dir():
        raise DataError(f"{raw}: not a directory; run `python -m studies collect` first")
    counts = np.load(counts_path)
    written = []
    for run, kind, n, model_dir in checkpoints(out, raw, runs):
        dst = raw / run / RECORD.format(kind=kind, n=n)
        if dst.is_file():
            continue
        if not (model_dir / "config.json").is_file():
            raise DataError(f"{model_dir}: no exported model for {run}{kind} at {n} steps (its convert step)")
        start = time.time()
        tokenizer = load_tokenizer(model_dir)  # as the study's evaluate step reads it (no --tokenizer)
        docs = RecordLengths(TokenizedCorpus([corpus], tokenizer))
        nll, entropy, targets, _ = temperature_losses(
            sequence_batches(docs, seq_len, 4), hf_model_fn(model_dir), TEMPERATURES, progress=False
        )
        record = temperature_record(nll, entropy, targets, TEMPERATURES, docs.lengths, counts)
        record.update(
            {
                "run": run,
                "branch": "cooled" if kind else "constant",
                "stage": n,
                "corpus": CORPUS,
                "seq_len": seq_len,
                "command": f"python -m studies calibrate <study> <raw> (model {run}{kind} at {n} steps)",
            }
        )
        atomic_write_json(dst, record)
        written.append(dst)
        log(f"{dst}: {len(targets)} tokens, {time.time() - start:.0f}s")
    return written


def read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable temperature record ({exc})") from None
