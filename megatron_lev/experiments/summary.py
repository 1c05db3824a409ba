"""The small grid's results table: perplexity against TIED (validation overall and by token frequency,
zero-shot), parameter counts and step time, read from each run's eval.json and metrics.jsonl."""

from __future__ import annotations

import json
import shlex
import statistics
from pathlib import Path

from megatron_lev.demo.steps import Step, read_marker
from megatron_lev.errors import DataError

BASELINE = "TIED"


def _rel(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else (value / base - 1.0) * 100.0


def _result(eval_json: Path, kind: str) -> dict:
    """The eval.json result of one corpus kind: 'mmidx' (validation shard) or 'text' (zero-shot)."""
    try:
        data = json.loads(Path(eval_json).read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(
            f"{eval_json}: damaged evaluation result ({' '.join(str(exc).split())}); delete it and "
            "run the grid again to re-evaluate"
        ) from None
    results = data.get("results") if isinstance(data, dict) else None
    for r in results if isinstance(results, list) else []:
        if (
            isinstance(r, dict)
            and r.get("corpus_kind") == kind
            and isinstance(r.get("perplexity"), (int, float))
        ):
            return r
    raise DataError(f"{eval_json}: no {kind} result with a perplexity (evaluate needs --data and --text)")


def run_stats(run_dir: Path) -> dict:
    """Parameters, median tokens/s (first logged window dropped: start-up) and final losses of one run."""
    from megatron_lev.training.metrics import read_metrics

    rows = read_metrics(Path(run_dir) / "metrics.jsonl")
    starts = [r for r in rows if r.get("kind") == "event" and r.get("event") == "start"]
    train = [r for r in rows if r.get("kind") == "train"]
    valid = [r for r in rows if r.get("kind") == "valid"]
    if not starts or not train:
        raise DataError(f"{run_dir}/metrics.jsonl: no start event or no training step logged")
    speeds = [r["tokens_per_s"] for r in (train[1:] or train) if r.get("tokens_per_s")]
    return {
        "parameters": starts[-1]["parameters"],
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "tokens": train[-1].get("tokens"),
        "segments": len(starts),
        "final_train_loss": train[-1]["loss"],
        "final_valid_loss": valid[-1]["loss"] if valid else None,
    }


def grid_summary(runs: dict[str, tuple[Path, Path]]) -> dict:
    """Rows per variant (`name -> (run_dir, eval_json)`), each with its change against TIED."""
    if BASELINE not in runs:
        raise DataError(f"the summary compares against {BASELINE}, which is not among {sorted(runs)}")
    raw = {}
    for name, (run_dir, eval_json) in runs.items():
        raw[name] = {
            **run_stats(run_dir),
            "valid": _result(eval_json, "mmidx"),
            "zero_shot": _result(eval_json, "text"),
        }
    base = raw[BASELINE]
    labels = [b["bucket"] for b in base["valid"].get("buckets", [])]
    rows = []
    for name, r in raw.items():
        buckets = {b["bucket"]: b.get("perplexity") for b in r["valid"].get("buckets", [])}
        base_buckets = {b["bucket"]: b.get("perplexity") for b in base["valid"].get("buckets", [])}
        tps, base_tps = r["tokens_per_s"], base["tokens_per_s"]
        rows.append(
            {
                "name": name,
                "parameters": r["parameters"],
                "parameters_rel_pct": _rel(r["parameters"], base["parameters"]),
                "valid_perplexity": r["valid"]["perplexity"],
                "valid_rel_pct": _rel(r["valid"]["perplexity"], base["valid"]["perplexity"]),
                "bucket_rel_pct": {lab: _rel(buckets.get(lab), base_buckets.get(lab)) for lab in labels},
                "zero_shot_perplexity": r["zero_shot"]["perplexity"],
                "zero_shot_rel_pct": _rel(r["zero_shot"]["perplexity"], base["zero_shot"]["perplexity"]),
                "tokens_per_s": tps,
                "step_time_ratio": base_tps / tps if tps and base_tps else None,
                "final_train_loss": r["final_train_loss"],
                "final_valid_loss": r["final_valid_loss"],
            }
        )
    bucket_tokens = {b["bucket"]: b["tokens"] for b in base["valid"].get("buckets", [])}
    return {
        "baseline": BASELINE,
        "bucket_labels": labels,
        "bucket_tokens": bucket_tokens,
        "rows": rows,
        "zero_shot_corpus": base["zero_shot"].get("corpus"),
        "valid_corpus": base["valid"].get("corpus"),
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}%"


def summary_markdown(summary: dict, split_json: Path | None = None) -> str:
    """The results table in markdown, with a line on what each column measures."""
    labels = summary["bucket_labels"]
    head = [
        "variant",
        "parameters",
        "vs TIED",
        "valid ppl",
        "vs TIED",
        *(f"{lab} ({summary['bucket_tokens'][lab]:,} tok)" for lab in labels),
        "zero-shot ppl",
        "vs TIED",
        "tokens/s",
        "step time / TIED",
    ]
    lines = [
        "# Small grid: every variant against TIED",
        "",
        "| " + " | ".join(head) + " |",
        "|---" * len(head) + "|",
    ]
    for r in summary["rows"]:
        cells = [
            r["name"],
            f"{r['parameters']:,}",
            _pct(r["parameters_rel_pct"]),
            f"{r['valid_perplexity']:.3f}",
            _pct(r["valid_rel_pct"]),
            *(_pct(r["bucket_rel_pct"][lab]) for lab in labels),
            f"{r['zero_shot_perplexity']:.3f}",
            _pct(r["zero_shot_rel_pct"]),
            "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:,.0f}",
            "-" if r["step_time_ratio"] is None else f"{r['step_time_ratio']:.2f}x",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "- vs TIED: perplexity / TIED's perplexity - 1 (negative is better). Frequency buckets: "
        "the relative frequency of the target token in the training shard; the change is per bucket.",
        f"- valid: held-out documents of the training subsets ({summary['valid_corpus']}); zero-shot: "
        f"a subset never trained on ({summary['zero_shot_corpus']}).",
        "- tokens/s: median of the logged training windows after the first; step time / TIED > 1 is "
        "slower. On a shared CPU these are indicative only.",
        "- Curves, tokens-to-target and plots: validation/ and zero_shot/ (megatron-lev compare).",
    ]
    if split_json is not None and Path(split_json).exists():
        split = json.loads(Path(split_json).read_text())
        lines.append(
            f"- Data: {split['data_dir']}, zero-shot subset {split['zero_shot_subset']}, "
            f"every {split['valid_every']}th document of the others held out for validation, "
            f"at most {split['max_chars_per_subset']:,} characters per subset."
        )
    return "\n".join(lines) + "\n"


def commands_markdown(state_dir: Path, steps: list[Step]) -> str:
    """Every step's command as it ran (from the step markers); steps not finished are listed as such."""
    lines = [
        "# Commands the grid ran",
        "",
        "In order; each ran from the directory the grid was started in.",
        "",
    ]
    for i, step in enumerate(steps, 1):
        marker = Path(state_dir) / f"{step.name}.json"
        lines.append(f"{i}. **{step.name}**: {step.describe}")
        rec = read_marker(marker)
        if rec and isinstance(rec.get("command"), list):
            env = " ".join(f"{k}={v}" for k, v in sorted(step.env.items()))
            command = list(rec["command"])
            if command and Path(command[0]).name.startswith("python"):  # the interpreter as a user types it
                command[0] = "python"
            lines += [
                "",
                "   ```bash",
                f"   {(env + ' ') if env else ''}{shlex.join(command)}",
                "   ```",
                f"   ({rec.get('seconds', 0.0):.0f} s)",
                "",
            ]
        else:
            lines += ["", "   (not finished)", ""]
    return "\n".join(lines)
