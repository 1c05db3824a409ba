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
from megatron_lev.analysis.perplexity import RecordLengths, load_counts
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
    """Write the missing temperature records; returns the paths written. Each is checked against the
    evaluation beside it (the same documents, the same loss at T = 1); `seq_len` is used only where
    the evaluation does not record its window."""
    corpus, counts_path = out / "data" / CORPUS, out / "data" / COUNTS
    for need in (corpus, counts_path):
        if not need.is_file():
            raise DataError(f"{need}: not found; pass the study directory `python -m studies run` wrote")
    if not raw.is_dir():
        raise DataError(f"{raw}: not a directory; run `python -m studies collect` first")
    try:
        counts = load_counts(counts_path)
    except ValueError as exc:
        raise DataError(str(exc)) from None
    unknown = sorted(set(runs or ()) - {p.name for p in raw.iterdir() if p.is_dir()})
    if unknown:
        raise DataError(f"--runs {' '.join(unknown)}: no collected run of that name in {raw}")
    written = []
    for run, kind, n, model_dir in checkpoints(out, raw, runs):
        dst = raw / run / RECORD.format(kind=kind, n=n)
        if dst.is_file():
            continue
        if not (model_dir / "config.json").is_file():
            raise DataError(f"{model_dir}: no exported model for {run}{kind} at {n} steps (its convert step)")
        start = time.time()
        result = text_result(raw / run / EVAL.format(kind=kind, n=n))
        window = int(result.get("seq_len") or seq_len)  # the window the evaluation used
        tokenizer = load_tokenizer(model_dir)  # as the study's evaluate step reads it (no --tokenizer)
        docs = RecordLengths(TokenizedCorpus([corpus], tokenizer))
        nll, entropy, targets, _ = temperature_losses(
            sequence_batches(docs, window, 4), hf_model_fn(model_dir), TEMPERATURES, progress=False
        )
        record = temperature_record(nll, entropy, targets, TEMPERATURES, docs.lengths, counts)
        record.update(
            {
                "run": run,
                "branch": "cooled" if kind else "constant",
                "stage": n,
                "corpus": CORPUS,
                "seq_len": window,
                "command": f"python -m studies calibrate <study> <raw> (model {run}{kind} at {n} steps)",
            }
        )
        check_record(record, result, dst)
        atomic_write_json(dst, record)
        written.append(dst)
        log(f"{dst}: {len(targets)} tokens, {time.time() - start:.0f}s")
    return written


def text_result(eval_path: Path) -> dict:
    """The zero-shot (text corpus) result of a collected evaluation."""
    try:
        results = json.loads(eval_path.read_text(encoding="utf-8")).get("results", [])
    except (OSError, json.JSONDecodeError, AttributeError) as exc:
        raise DataError(f"{eval_path}: not a readable evaluation ({exc})") from None
    found = next((r for r in results if r.get("corpus_kind") == "text"), None)
    if found is None or "per_document" not in found:
        raise DataError(f"{eval_path}: no zero-shot result with per-document sums; evaluate with --text")
    return found


def check_record(record: dict, result: dict, where: Path) -> None:
    """Refuse a record that is not over the evaluation's documents, or whose T = 1 loss is not the
    evaluation's (another model, corpus, tokenizer or window), or that holds a non-finite loss."""
    doc = result["per_document"]
    if record.get("tokens") != doc["tokens"]:
        raise DataError(
            f"{where}: its documents' token counts are not those of the evaluation beside it; "
            "delete it and run `python -m studies calibrate` again"
        )
    nll = np.asarray(record["nll_sum"], dtype=np.float64)
    if not np.isfinite(nll).all():
        raise DataError(f"{where}: a non-finite loss; the model's logits are not finite")
    if 1.0 not in record["temperatures"]:
        raise DataError(f"{where}: T = 1 is not on its grid {record['temperatures']}")
    at_one = nll[record["temperatures"].index(1.0)]
    worst = float(np.max(np.abs(at_one - np.asarray(doc["nll_sum"], dtype=np.float64)), initial=0.0))
    if worst > 1e-2:
        raise DataError(
            f"{where}: its T = 1 loss differs from the evaluation beside it by up to {worst:.3g} nats a "
            "document; delete it and run `python -m studies calibrate` again"
        )


def read_record(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: not a readable temperature record ({exc})") from None
