"""The paper-style comparison of runs: relative perplexity change against a baseline (TIED),
overall and per frequency bucket, and tokens needed to reach the baseline's final loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

from megatron_lev.analysis.curves import Curve, tokens_to_target
from megatron_lev.errors import DataError


def load_result(path: str | Path, corpus: str | None = None) -> dict:
    """One evaluation result from `eval.json` (the first, or the one whose corpus contains `corpus`)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a directory: give the eval.json that `megatron-lev evaluate` wrote")
    if not path.is_file():
        raise DataError(
            f"{path}: evaluation result not found; run `megatron-lev evaluate ... --out DIR` "
            "and pass DIR/eval.json"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(
            f"{path}: not a readable evaluation result ({' '.join(str(exc).split())}); "
            "rerun `megatron-lev evaluate` to rewrite it"
        ) from None
    results = data.get("results", [data]) if isinstance(data, dict) else None
    if not isinstance(results, list) or not results or not all(isinstance(r, dict) for r in results):
        raise DataError(
            f"{path}: not an evaluate result (expected {{'results': [{{'perplexity': ...}}, ...]}})"
        )
    for r in results:
        ppl = r.get("perplexity")
        if isinstance(ppl, bool) or not isinstance(ppl, (int, float)):
            raise DataError(f"{path}: not an evaluate result (a result without a numeric 'perplexity')")
        if not math.isfinite(ppl) or ppl <= 0:
            raise DataError(
                f"{path}: perplexity {ppl} of {r.get('corpus', 'a corpus')} is not a finite positive "
                "number: the evaluated model diverged or the file is damaged; evaluate again"
            )
    if corpus is not None:
        results = [r for r in results if corpus in str(r.get("corpus", ""))]
        if not results:
            raise DataError(f"{path}: no result for a corpus matching {corpus!r} (--corpus)")
    return results[0]


def _rel(value: float | None, base: float | None) -> float | None:
    if value is None or base is None:
        return None
    return (value / base - 1.0) * 100.0


def compare_results(
    results: dict[str, dict], curves: dict[str, Curve] | None = None, baseline: str = "TIED"
) -> dict:
    """Rows per run: perplexity and % change vs the baseline, per bucket, and tokens-to-target."""
    if baseline not in results:
        raise DataError(
            f"--baseline {baseline!r} is not among the runs {sorted(results)}: name one run "
            f"{baseline}=EVAL_JSON, or pass --baseline NAME"
        )
    base = results[baseline]
    curves = curves or {}
    target = None
    if curves:
        if baseline not in curves:
            raise DataError(
                f"--curves: tokens-to-target needs the baseline's loss curve ({baseline}=PATH in --curves)"
            )
        target = float(curves[baseline].loss[-1])
    base_tokens = tokens_to_target(curves[baseline], target) if target is not None else None
    labels = [b["bucket"] for b in base.get("buckets", [])]
    rows = []
    for name, r in results.items():
        buckets = {b["bucket"]: b for b in r.get("buckets", [])}
        per_bucket = [
            {
                "bucket": b["bucket"],
                "tokens": buckets[lab]["tokens"] if lab in buckets else None,
                "perplexity": buckets[lab]["perplexity"] if lab in buckets else None,
                "rel_change_pct": _rel(
                    buckets[lab]["perplexity"] if lab in buckets else None, b["perplexity"]
                ),
            }
            for lab, b in zip(labels, base.get("buckets", []))
        ]
        row = {
            "name": name,
            "perplexity": r["perplexity"],
            "rel_change_pct": _rel(r["perplexity"], base["perplexity"]),
            "buckets": per_bucket,
        }
        if name in curves:
            t = tokens_to_target(curves[name], target)
            row.update(
                tokens_to_target=t,
                x_label=curves[name].x_label,
                final_loss=float(curves[name].loss[-1]),
                tokens_ratio=(t / base_tokens) if t is not None and base_tokens else None,
            )
        rows.append(row)
    return {
        "baseline": baseline,
        "target_loss": target,
        "bucket_labels": labels,
        "rows": rows,
        "note": "rel. change = perplexity / baseline perplexity - 1; tokens-to-target = first point "
        "(linearly interpolated) where a run's loss reaches the baseline's final loss",
    }


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}%"


def compare_markdown(cmp: dict) -> str:
    head = ["run", "perplexity", f"vs {cmp['baseline']}", *cmp["bucket_labels"]]
    has_curves = cmp["target_loss"] is not None
    if has_curves:
        head += [f"tokens to {cmp['baseline']} final loss ({cmp['target_loss']:.4f})", "ratio"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in cmp["rows"]:
        cells = [
            r["name"],
            f"{r['perplexity']:.3f}",
            _pct(r["rel_change_pct"]),
            *(_pct(b["rel_change_pct"]) for b in r["buckets"]),
        ]
        if has_curves:
            t = r.get("tokens_to_target")
            cells += [
                "not reached" if t is None and "final_loss" in r else ("-" if t is None else f"{t:.4g}"),
                "-" if r.get("tokens_ratio") is None else f"{r['tokens_ratio']:.3f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", cmp["note"]]) + "\n"


def plot_comparison(cmp: dict, curves: dict[str, Curve], out: Path) -> list[Path]:
    """loss_curves.png (with the target line) and bucket_perplexity.png (grouped bars, log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    if curves:
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, c in curves.items():
            ax.plot(c.x, c.loss, label=name)
        ax.axhline(cmp["target_loss"], color="k", ls=":", label=f"{cmp['baseline']} final")
        ax.set_xlabel(next(iter(curves.values())).x_label)
        ax.set_ylabel("loss")
        ax.legend()
        fig.tight_layout()
        written.append(out / "loss_curves.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    labels = cmp["bucket_labels"]
    if labels:
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.8 / len(cmp["rows"])
        for k, r in enumerate(cmp["rows"]):
            vals = [b["perplexity"] or np.nan for b in r["buckets"]]
            ax.bar(np.arange(len(labels)) + k * width, vals, width, label=r["name"])
        ax.set_xticks(np.arange(len(labels)) + 0.4 - width / 2, labels, fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("relative frequency of the target token in the training data")
        ax.set_ylabel("perplexity")
        ax.legend()
        fig.tight_layout()
        written.append(out / "bucket_perplexity.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written
